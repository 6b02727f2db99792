//! A scalar function that wraps one of DataFusion's (or a library's) and changes one thing
//! about it: how it is invoked, and that it keeps DataFusion's default placement.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;

use arrow_schema::{DataType, FieldRef};
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

/// Invokes the wrapped function as it is.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(super) struct AsIs;

impl Invoke for AsIs {
    fn invoke(&self, inner: &ScalarUDF, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        inner.invoke_with_args(args)
    }
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
