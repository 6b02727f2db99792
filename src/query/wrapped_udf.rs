//! A scalar function that wraps one of DataFusion's (or a library's) and changes one thing
//! about it: how it is invoked, and that it keeps DataFusion's default placement.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;

use arrow_array::cast::AsArray as _;
use arrow_array::{Array as _, StringViewArray, UInt32Array};
use arrow_schema::{DataType, FieldRef};
use arrow_select::take::take;
use datafusion::error::Result;
use datafusion::logical_expr::simplify::{ExprSimplifyResult, SimplifyContext};
use datafusion::logical_expr::{
    ColumnarValue, Documentation, Expr, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF,
    ScalarUDFImpl, Signature,
};

/// How a wrapped function is invoked.
pub(super) trait Invoke: Debug + PartialEq + Eq + Hash + Send + Sync + 'static {
    /// Evaluates the function; `inner` is the wrapped one.
    fn invoke(&self, inner: &ScalarUDF, args: ScalarFunctionArgs) -> Result<ColumnarValue>;
}

/// Invokes the wrapped function once for each distinct value of its first argument, when
/// that is a `Utf8View` array whose rows repeat a few values and every other argument is a
/// scalar; as it is otherwise. For deterministic functions only.
///
/// A string column stored as a Parquet dictionary (a JSON column of a few shapes, say) reads
/// as views of the dictionary's values: rows of one value carry the same 16-byte view. Rows
/// are told apart by that view, so `json_get_str(var, 'region')` parses each distinct text
/// once per batch instead of once per row. Equal views are equal strings (a long string's
/// view is its length, prefix, buffer and offset; a short one's holds it whole); equal
/// strings with different views are only evaluated more than once. A batch is evaluated
/// row by row once its distinct views pass [`OncePerValue::MAX_DISTINCT`] or a sixteenth
/// of its rows.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(super) struct OncePerValue;

impl OncePerValue {
    /// The most distinct values a batch is evaluated by.
    const MAX_DISTINCT: usize = 1024;
}

impl Invoke for OncePerValue {
    fn invoke(&self, inner: &ScalarUDF, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let Some((ColumnarValue::Array(first), rest)) = args.args.split_first() else {
            return inner.invoke_with_args(args);
        };
        let scalars = rest.iter().all(|a| matches!(a, ColumnarValue::Scalar(_)));
        let classes = match first.as_string_view_opt() {
            Some(views) if scalars => distinct_views(views, Self::MAX_DISTINCT),
            _ => None,
        };
        let Some((representatives, class_of_row)) = classes else {
            return inner.invoke_with_args(args);
        };
        let mut values = args.args.clone();
        values[0] = ColumnarValue::Array(take(first.as_ref(), &representatives, None)?);
        let per_value = inner.invoke_with_args(ScalarFunctionArgs {
            args: values,
            arg_fields: args.arg_fields.clone(),
            number_rows: representatives.len(),
            return_field: Arc::clone(&args.return_field),
            config_options: Arc::clone(&args.config_options),
        })?;
        match per_value {
            ColumnarValue::Array(per_value) => Ok(ColumnarValue::Array(take(
                per_value.as_ref(),
                &class_of_row,
                None,
            )?)),
            scalar @ ColumnarValue::Scalar(_) => Ok(scalar),
        }
    }
}

/// The rows of `views` by distinct view: the first row of each (null rows are one more
/// class), and each row's class. `None` once the classes pass `max_distinct` or a sixteenth
/// of the rows (past a few hundred rows), when evaluating row by row costs less.
fn distinct_views(
    views: &StringViewArray,
    max_distinct: usize,
) -> Option<(UInt32Array, UInt32Array)> {
    let limit = max_distinct.min((views.len() / 16).max(64));
    let mut classes: HashMap<u128, u32> = HashMap::new();
    let mut representatives: Vec<u32> = Vec::new();
    let mut null_class = None;
    let mut class_of_row = Vec::with_capacity(views.len());
    for (row, view) in views.views().iter().enumerate() {
        let next = u32::try_from(representatives.len()).ok()?;
        let class = if views.is_null(row) {
            *null_class.get_or_insert(next)
        } else {
            *classes.entry(*view).or_insert(next)
        };
        if class == next {
            if representatives.len() >= limit {
                return None;
            }
            representatives.push(u32::try_from(row).ok()?);
        }
        class_of_row.push(class);
    }
    Some((representatives.into(), class_of_row.into()))
}

/// `inner` with its name, signature, types and simplifications, invoked through `invoke`.
/// Its placement is DataFusion's default (evaluated where the plan puts it), whatever the
/// wrapped function asks for.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(super) struct Wrapped<I> {
    pub(super) inner: Arc<ScalarUDF>,
    pub(super) invoke: I,
}

impl<I: Invoke> ScalarUDFImpl for Wrapped<I> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner.return_type(arg_types)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        self.inner.return_field_from_args(args)
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }

    fn simplify(&self, args: Vec<Expr>, info: &SimplifyContext) -> Result<ExprSimplifyResult> {
        self.inner.simplify(args, info)
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        self.invoke.invoke(&self.inner, args)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{ArrayRef, DictionaryArray, StringArray, types::Int32Type};

    /// JSON texts read as the views of a dictionary's values: the rows of one value share
    /// a view (long and short texts), nulls are a class of their own.
    fn dictionary_views(keys: &[Option<i32>]) -> StringViewArray {
        let values = StringArray::from(vec![
            r#"{"region":"apac","attempt":1,"gateway":"credit_card"}"#,
            r#"{"r":"eu"}"#,
            r#"{"region":"emea","attempt":2,"gateway":"credit_card"}"#,
            "",
        ]);
        let dictionary =
            DictionaryArray::<Int32Type>::try_new(keys.iter().copied().collect(), Arc::new(values))
                .unwrap();
        let cast = arrow_cast::cast(&dictionary, &DataType::Utf8View).unwrap();
        cast.as_string_view().clone()
    }

    #[test]
    fn rows_of_one_dictionary_value_are_one_class() {
        let keys: Vec<Option<i32>> = (0..400).map(|i| (i % 7 != 3).then_some(i % 4)).collect();
        let views = dictionary_views(&keys);
        let (representatives, class_of_row) = distinct_views(&views, 1024).unwrap();
        // Four values and the nulls.
        assert_eq!(representatives.len(), 5);
        for row in 0..views.len() {
            let first = representatives.value(class_of_row.value(row) as usize) as usize;
            assert_eq!(views.is_null(row), views.is_null(first), "row {row}");
            if !views.is_null(row) {
                assert_eq!(views.value(row), views.value(first), "row {row}");
            }
        }
    }

    /// Records the rows it is given, answers its first argument.
    #[derive(Debug, PartialEq, Eq, Hash)]
    struct Probe {
        signature: Signature,
    }

    static PROBED_ROWS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    impl ScalarUDFImpl for Probe {
        fn name(&self) -> &str {
            "probe"
        }

        fn signature(&self) -> &Signature {
            &self.signature
        }

        fn return_type(&self, _: &[DataType]) -> Result<DataType> {
            Ok(DataType::Utf8View)
        }

        fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
            PROBED_ROWS.store(args.number_rows, std::sync::atomic::Ordering::SeqCst);
            Ok(args.args[0].clone())
        }
    }

    /// The inner function sees one row per class and every row gets its class's answer;
    /// with a second argument that is a column, it sees every row.
    #[test]
    fn the_function_runs_once_per_class() {
        use arrow_schema::Field;
        use datafusion::common::ScalarValue;
        use datafusion::config::ConfigOptions;
        use datafusion::logical_expr::Volatility;
        let probe = ScalarUDF::new_from_impl(Probe {
            signature: Signature::variadic_any(Volatility::Immutable),
        });
        let keys: Vec<Option<i32>> = (0..3000).map(|i| (i % 11 != 5).then_some(i % 4)).collect();
        let views: ArrayRef = Arc::new(dictionary_views(&keys));
        let call = |second: ColumnarValue| {
            let field = |t: DataType| Arc::new(Field::new("a", t, true));
            OncePerValue
                .invoke(
                    &probe,
                    ScalarFunctionArgs {
                        args: vec![ColumnarValue::Array(Arc::clone(&views)), second],
                        arg_fields: vec![field(DataType::Utf8View), field(DataType::Utf8View)],
                        number_rows: views.len(),
                        return_field: field(DataType::Utf8View),
                        config_options: Arc::new(ConfigOptions::default()),
                    },
                )
                .unwrap()
                .into_array(views.len())
                .unwrap()
        };
        let answer = call(ColumnarValue::Scalar(ScalarValue::Utf8View(Some(
            "k".into(),
        ))));
        assert_eq!(PROBED_ROWS.load(std::sync::atomic::Ordering::SeqCst), 5);
        assert_eq!(answer.as_string_view(), views.as_string_view());
        let answer = call(ColumnarValue::Array(Arc::clone(&views)));
        assert_eq!(PROBED_ROWS.load(std::sync::atomic::Ordering::SeqCst), 3000);
        assert_eq!(answer.as_string_view(), views.as_string_view());
    }

    #[test]
    fn many_distinct_values_are_evaluated_row_by_row() {
        let texts: ArrayRef = Arc::new(StringViewArray::from_iter_values(
            (0..4096).map(|i| format!(r#"{{"n":{i},"pad":"0123456789"}}"#)),
        ));
        assert!(distinct_views(texts.as_string_view(), 1024).is_none());
        // Past the cap even where a sixteenth of the rows would allow more.
        let few = dictionary_views(&[Some(0), Some(1), None]);
        assert!(distinct_views(&few, 2).is_none());
        assert_eq!(distinct_views(&few, 3).unwrap().0.len(), 3);
    }
}
