//! Guarded functions: no argument sizes an allocation unchecked.
//!
//! Every scalar function a statement can call is registered wrapped in [`Guarded`] (see
//! [`guard_functions`]): before the wrapped function runs, its arguments give an upper bound
//! of what its result (and its work buffers) can take, and that many bytes are reserved in
//! the statement's memory budget ([`super::budget`]); a bound past what the budget grants
//! refuses the call with `ResourcesExhausted`, before anything is allocated. Once the
//! function has answered, the reservation is set to what its result really holds (bytes not
//! shared with its arguments), and it lives as long as the result's buffers do (each buffer
//! of the result keeps it: [`hold_array`]); a result that is a single value is held until
//! the statement ends. This holds wherever DataFusion calls a function: while it runs the
//! statement, and while the optimizer folds constants (`repeat('a', 1e15)` is evaluated at
//! planning time, and is refused there).
//!
//! How a function's result is bounded is [`Sizing`], chosen by the function's name
//! ([`sizing_of`]): most functions' results are at most a few times their arguments
//! ([`Sizing::Linear`]); the functions whose result size comes from an argument's *value*
//! (a count, a length, a range, a separator repeated per element) have their own bound. A
//! new DataFusion version's functions are covered by the default, and a unit test lists
//! every registered function, so each new one is looked at.
//!
//! Called outside a statement (a table's computed columns, DataFusion's own evaluation of a
//! table function's arguments), a function is held to the statement memory limit per call.
//!
//! Some work is bounded by time rather than memory: `levenshtein` is quadratic in its
//! arguments' lengths, and regular expressions are compiled once per distinct pattern in a
//! batch; both are checked before they run ([`MAX_LEVENSHTEIN_WORK`], [`REGEX_SIZE_LIMIT`]).
//!
//! Operators DataFusion evaluates without a function are rewritten into guarded functions
//! ([`guard_plan`]): string concatenation (`||`, which doubles a string per step of a
//! recursive query) and regular-expression matches (`~`, `SIMILAR TO`, whose patterns from a
//! column are all compiled and kept at once).

use std::collections::HashSet;
use std::hash::Hash;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use arrow_array::cast::AsArray as _;
use arrow_array::types::{
    Date32Type, Date64Type, Int8Type, Int16Type, Int32Type, Int64Type, IntervalMonthDayNanoType,
    TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType,
    TimestampSecondType, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, ArrayRef, RecordBatch, make_array};
use arrow_buffer::{BooleanBuffer, Buffer, NullBuffer};
use arrow_schema::{DataType, Field, FieldRef, Schema, TimeUnit};
use datafusion::arrow::array::ArrayData;
use datafusion::common::tree_node::{Transformed, TreeNode as _};
use datafusion::common::{DFSchema, ScalarValue};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::MemoryReservation;
use datafusion::logical_expr::expr::ScalarFunction;
use datafusion::logical_expr::simplify::{ExprSimplifyResult, SimplifyContext};
use datafusion::logical_expr::{
    BinaryExpr, ColumnarValue, Documentation, Expr, ExprSchemable as _, ExpressionPlacement, Like,
    LogicalPlan, Operator, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl,
    Signature, Volatility,
};
use datafusion::physical_expr::PhysicalExpr as _;
use datafusion::physical_expr::expressions::{BinaryExpr as PhysicalBinary, Column};
use datafusion::prelude::SessionContext;

use super::budget::{BudgetOption, StatementBudget};

/// The most a `levenshtein` call may compute: the sum over its rows of the product of the two
/// strings' lengths (the algorithm is quadratic, and one call runs without a pause).
pub(crate) const MAX_LEVENSHTEIN_WORK: u128 = 1 << 28;

/// The most a regular expression may compile to (the `regex` crate's `size_limit`; its
/// default is 10 MiB). Each distinct pattern of a call is compiled once to check it.
pub(crate) const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// The longest regular expression (its text): the parser's syntax tree takes a hundred
/// bytes or more per byte of pattern before the compiled size is known.
pub(crate) const MAX_REGEX_BYTES: usize = 32 << 10;

/// What a compiled regular expression is counted at: its program and the lazy DFA's cache
/// (the `regex` crate's default `dfa_size_limit`).
const REGEX_BYTES: u128 = REGEX_SIZE_LIMIT as u128 + (2 << 20);

/// Bytes allowed per row for a variable-width result of a function whose result size is not
/// otherwise bounded by its arguments (`uuid()`, `to_hex(n)`, a number printed as text).
const VARIABLE_ROW_BYTES: u128 = 64;

/// The share of the statement memory one constant folded while planning may take (the
/// optimizer copies plans, and their constants with them).
pub(crate) const PLAN_CONSTANT_SHARE: usize = 8;

/// Single-value results smaller than this are not held (a function that returns one value
/// per batch must not add up over a long scan).
const HOLD_VALUE_BYTES: usize = 4 << 10;

/// How a function's result is bounded by its arguments (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Sizing {
    /// At most `factor` times the bytes of its arguments (a constant argument counts once
    /// per row), plus its type's fixed width per row.
    Linear(u8),
    /// `concat_ws(sep, a, b, ...)`: the separator once between every two arguments.
    ConcatWs,
    /// `repeat(s, n)`: `n` copies of `s`.
    Repeat,
    /// `lpad|rpad(s, n[, fill])`: `n` characters.
    Pad,
    /// `array_repeat(v, n)`: `n` copies of `v`.
    ArrayRepeat,
    /// `array_resize(a, n[, v])`: `n` elements.
    ArrayResize,
    /// `range|generate_series([start,] stop[, step])`: the elements between.
    Range,
    /// `replace(s, from, to)`: `to` once per match of `from` (once per character when `from`
    /// is empty).
    Replace,
    /// `regexp_replace(s, re, to[, flags])`: `to`, and the groups it names, once per match.
    RegexpReplace,
    /// A regular expression's matches (`regexp_like|match|count|instr(s, re, ...)`): each
    /// pattern is checked, and a match's groups are at most the string each.
    Regexp,
    /// `array_to_string(a, sep[, null])`: every element printed, with a separator.
    JoinList,
    /// `array_replace[_n|_all](a, from, to[, n])`: each element replaced by `to`.
    ReplaceElements,
    /// `string_to_array(s, sep[, null])`: an element per character at most.
    SplitString,
    /// `to_char|date_format(v, format)`: the format expanded per row.
    Format,
    /// `levenshtein(a, b)`: bounded work ([`MAX_LEVENSHTEIN_WORK`]).
    Levenshtein,
}

/// The bound of the function named `name` (its canonical name: aliases share the function).
pub(crate) fn sizing_of(name: &str) -> Sizing {
    match name {
        "concat_ws" => Sizing::ConcatWs,
        "repeat" => Sizing::Repeat,
        "lpad" | "rpad" => Sizing::Pad,
        "array_repeat" => Sizing::ArrayRepeat,
        "array_resize" => Sizing::ArrayResize,
        "range" | "generate_series" => Sizing::Range,
        "replace" => Sizing::Replace,
        "regexp_replace" => Sizing::RegexpReplace,
        "regexp_like" | "regexp_match" | "regexp_count" | "regexp_instr" => Sizing::Regexp,
        "array_to_string" => Sizing::JoinList,
        "array_replace" | "array_replace_n" | "array_replace_all" => Sizing::ReplaceElements,
        "string_to_array" => Sizing::SplitString,
        "to_char" | "date_format" => Sizing::Format,
        "levenshtein" => Sizing::Levenshtein,
        // Case mapping can triple a string's bytes (`ß` and some Greek letters), `translate`
        // can put a four-byte character where a one-byte one was.
        "upper" | "lower" | "initcap" | "translate" => Sizing::Linear(4),
        // Everything else: at most about its arguments (concatenations, slices, JSON
        // extraction, list operations, casts, hex and base64 encoding).
        _ => Sizing::Linear(2),
    }
}

/// Functions left as DataFusion registers them: results that are views of an argument, which
/// DataFusion recognizes by their type when it plans (`get_field` of a struct column is read
/// from Parquet as that field alone).
fn unguarded(name: &str) -> bool {
    matches!(name, "get_field")
}

/// `f`, guarded (unless it is already, or is left as it is).
pub(crate) fn guard(f: &Arc<ScalarUDF>, limit: usize) -> Arc<ScalarUDF> {
    if f.inner().is::<Guarded>() || f.inner().is::<StringConcat>() || unguarded(f.name()) {
        return Arc::clone(f);
    }
    Arc::new(ScalarUDF::new_from_impl(Guarded {
        sizing: sizing_of(f.name()),
        inner: Arc::clone(f),
        limit,
    }))
}

/// Registers every scalar function of `ctx` guarded; `limit` is the per-call bound outside
/// statements (the statement memory limit).
pub(crate) fn guard_functions(ctx: &mut SessionContext, limit: usize) {
    let mut seen = HashSet::new();
    let functions: Vec<Arc<ScalarUDF>> = ctx
        .state()
        .scalar_functions()
        .values()
        .filter(|f| seen.insert(f.name().to_owned()))
        .cloned()
        .collect();
    for f in functions {
        let guarded = guard(&f, limit);
        if !Arc::ptr_eq(&guarded, &f) {
            ctx.register_udf(guarded.as_ref().clone());
        }
    }
}

/// Refuses a cast in `expr` to a type one value of which takes more than `max` bytes: what a
/// function simplifies to (`arrow_cast` becomes a cast) is folded by the simplifier, which
/// makes the value without a function call to guard it.
fn check_cast_widths(expr: &Expr, max: usize) -> Result<()> {
    expr.apply(|e| {
        let target = match e {
            Expr::Cast(c) => Some(c.field.data_type()),
            Expr::TryCast(c) => Some(c.field.data_type()),
            _ => None,
        };
        if let Some(t) = target {
            let width = width_of(t, &mut 100_000).unwrap_or(u64::MAX);
            if width > max as u64 {
                return Err(DataFusionError::ResourcesExhausted(format!(
                    "a value of the type cast to takes {width} bytes; a value may take {max}"
                )));
            }
        }
        Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
    })
    .map(|_| ())
}

/// `array_position(a, v, start)` subtracts one from `start` unchecked (DataFusion 55):
/// the smallest 64-bit integer overflows.
fn check_start_index(args: &[ColumnarValue]) -> Result<()> {
    let out_of_range = match args.get(2) {
        Some(ColumnarValue::Scalar(ScalarValue::Int64(Some(v)))) => *v == i64::MIN,
        Some(ColumnarValue::Array(a)) => a
            .as_primitive_opt::<Int64Type>()
            .is_some_and(|a| a.iter().any(|v| v == Some(i64::MIN))),
        _ => false,
    };
    if out_of_range {
        return Err(DataFusionError::Execution(
            "array_position: the start index is out of range".into(),
        ));
    }
    Ok(())
}

/// `lpad`/`rpad` size their output buffer from a length of the rows' own, unchecked
/// (DataFusion 55): a negative one overflows the capacity and panics.
fn check_pad_length(name: &str, args: &[ColumnarValue]) -> Result<()> {
    let negative = match args.get(1) {
        Some(ColumnarValue::Scalar(ScalarValue::Int64(Some(v)))) => *v < 0,
        Some(ColumnarValue::Array(a)) => a
            .as_primitive_opt::<Int64Type>()
            .is_some_and(|a| a.iter().any(|v| v.is_some_and(|v| v < 0))),
        _ => false,
    };
    if negative {
        return Err(DataFusionError::Execution(format!(
            "{name}: the length is negative"
        )));
    }
    Ok(())
}

/// A scalar function that checks what its result can take before it runs (module docs).
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct Guarded {
    inner: Arc<ScalarUDF>,
    sizing: Sizing,
    /// The most one call may take outside a statement.
    limit: usize,
}

impl ScalarUDFImpl for Guarded {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn schema_name(&self, args: &[Expr]) -> Result<String> {
        self.inner.schema_name(args)
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        self.inner.return_type(arg_types)
    }

    fn with_updated_config(&self, config: &ConfigOptions) -> Option<ScalarUDF> {
        let updated = Arc::new(self.inner.inner().with_updated_config(config)?);
        Some(guard(&updated, self.limit).as_ref().clone())
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        check_type_strings(self.name(), args.scalar_arguments.iter().flatten().copied())?;
        let field = self.inner.return_field_from_args(args)?;
        // A type built from its arguments' types (`named_struct('a', x, 'b', x)`) can double
        // at every step of a chain, and SQL planning walks it whole at each: refused here,
        // where it is made.
        let mut budget = MAX_TYPE_FIELDS;
        if super::plan_limits::count_fields(field.data_type(), &mut budget).is_none() {
            return Err(super::plan_limits::too_complex(format!(
                "{}: the result's type has more than {MAX_TYPE_FIELDS} fields",
                self.name()
            )));
        }
        // A type one value of which is larger than a statement may hold
        // (`arrow_cast(x, 'FixedSizeBinary(2147483647)')`): DataFusion would make one.
        let width = width_of(field.data_type(), &mut 100_000).unwrap_or(u64::MAX);
        let most = (self.limit / PLAN_CONSTANT_SHARE) as u64;
        if width > most {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "{}: a value of its result's type takes {width} bytes; a value may take {most}",
                self.name()
            )));
        }
        Ok(field)
    }

    fn is_strict(&self) -> bool {
        self.inner.inner().is_strict()
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let scalars = args.args.iter().filter_map(|a| match a {
            ColumnarValue::Scalar(value) => Some(value),
            ColumnarValue::Array(_) => None,
        });
        check_type_strings(self.name(), scalars)?;
        match self.name() {
            "array_position" => check_start_index(&args.args)?,
            "lpad" | "rpad" => check_pad_length(self.name(), &args.args)?,
            _ => {}
        }
        let budget = BudgetOption::of(&args.config_options).cloned();
        if let Some(budget) = &budget {
            budget.checkpoint()?;
        }
        let estimate = estimate(self.name(), self.sizing, &args, budget.as_deref())?;
        let reservation = match &budget {
            Some(budget) => Some(budget.reserve(&format!("function {}", self.name()), estimate)?),
            None if estimate > self.limit => {
                return Err(DataFusionError::ResourcesExhausted(format!(
                    "{} would need about {estimate} bytes; a call may use {}",
                    self.name(),
                    self.limit
                )));
            }
            None => None,
        };
        let inputs: Vec<(usize, usize)> = args
            .args
            .iter()
            .filter_map(|a| match a {
                ColumnarValue::Array(a) => Some(a.to_data()),
                ColumnarValue::Scalar(_) => None,
            })
            .flat_map(|d| buffer_ranges(&d))
            .collect();
        let result = self.inner.invoke_with_args(args)?;
        let Some(reservation) = reservation else {
            return Ok(result);
        };
        match result {
            ColumnarValue::Array(array) => {
                let data = array.to_data();
                let new = new_bytes(&data, &inputs);
                if new == 0 {
                    return Ok(ColumnarValue::Array(array));
                }
                // A result larger than its bound (an estimate that missed something) is
                // counted as it is, or refused.
                reservation.try_resize(new)?;
                Ok(ColumnarValue::Array(hold_array(data, reservation)))
            }
            ColumnarValue::Scalar(value) => {
                drop(reservation);
                let bytes = value.size();
                // A constant folded while planning is copied with the plan by the optimizer's
                // rules, a few times over: it may take a share of the statement's memory.
                if super::runtime::on_planning_thread()
                    && let Some(budget) = &budget
                    && bytes > budget.limit() / PLAN_CONSTANT_SHARE
                {
                    return Err(DataFusionError::ResourcesExhausted(format!(
                        "{}: a constant of {bytes} bytes while planning; a constant may take \
                         {} (1/{PLAN_CONSTANT_SHARE} of query_memory_bytes)",
                        self.name(),
                        budget.limit() / PLAN_CONSTANT_SHARE
                    )));
                }
                if bytes >= HOLD_VALUE_BYTES
                    && let Some(budget) = &budget
                {
                    budget.hold(bytes)?;
                }
                Ok(ColumnarValue::Scalar(value))
            }
        }
    }

    fn simplify(&self, args: Vec<Expr>, info: &SimplifyContext) -> Result<ExprSimplifyResult> {
        let literals = args.iter().filter_map(|a| match a {
            Expr::Literal(value, _) => Some(value),
            _ => None,
        });
        check_type_strings(self.name(), literals)?;
        // `regexp_like` simplifies to the `~` operator, which would compile its patterns
        // unchecked: it stays a (guarded) call.
        if self.sizing == Sizing::Regexp {
            return Ok(ExprSimplifyResult::Original(args));
        }
        // A simplification may name other functions (`concat_ws` with an empty separator
        // becomes `concat`): those are guarded too, before the simplifier folds them.
        Ok(match self.inner.simplify(args, info)? {
            ExprSimplifyResult::Simplified(expr) => {
                check_cast_widths(&expr, self.limit / PLAN_CONSTANT_SHARE)?;
                ExprSimplifyResult::Simplified(guard_expr(expr, self.limit)?.data)
            }
            original => original,
        })
    }

    fn short_circuits(&self) -> bool {
        self.inner.short_circuits()
    }

    fn evaluate_bounds(
        &self,
        input: &[&datafusion::logical_expr::interval_arithmetic::Interval],
    ) -> Result<datafusion::logical_expr::interval_arithmetic::Interval> {
        self.inner.evaluate_bounds(input)
    }

    fn propagate_constraints(
        &self,
        interval: &datafusion::logical_expr::interval_arithmetic::Interval,
        inputs: &[&datafusion::logical_expr::interval_arithmetic::Interval],
    ) -> Result<Option<Vec<datafusion::logical_expr::interval_arithmetic::Interval>>> {
        self.inner.propagate_constraints(interval, inputs)
    }

    fn output_ordering(
        &self,
        inputs: &[datafusion::logical_expr::sort_properties::ExprProperties],
    ) -> Result<datafusion::logical_expr::sort_properties::SortProperties> {
        self.inner.output_ordering(inputs)
    }

    fn preserves_lex_ordering(
        &self,
        inputs: &[datafusion::logical_expr::sort_properties::ExprProperties],
    ) -> Result<bool> {
        self.inner.preserves_lex_ordering(inputs)
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }

    fn placement(&self, args: &[ExpressionPlacement]) -> ExpressionPlacement {
        self.inner.placement(args)
    }
}

/// Most fields (nested ones included) in the type of a function's result.
pub(crate) const MAX_TYPE_FIELDS: usize = 10_000;

/// Deepest a type named in a string (`arrow_cast(x, 'List(List(Int64))')`) may nest: Arrow
/// parses it recursively.
pub(crate) const MAX_TYPE_DEPTH: usize = 64;

/// Refuses, for the functions that parse a type from a string argument, a string that nests
/// deeper than [`MAX_TYPE_DEPTH`], before it is parsed.
fn check_type_strings<'a>(name: &str, values: impl Iterator<Item = &'a ScalarValue>) -> Result<()> {
    if !matches!(name, "arrow_cast" | "arrow_try_cast") {
        return Ok(());
    }
    for value in values {
        let Some(Some(text)) = value.try_as_str() else {
            continue;
        };
        let mut depth = 0usize;
        let mut deepest = 0usize;
        for c in text.chars() {
            match c {
                '(' | '[' | '<' => {
                    depth += 1;
                    deepest = deepest.max(depth);
                }
                ')' | ']' | '>' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        if deepest > MAX_TYPE_DEPTH {
            return Err(super::plan_limits::too_complex(format!(
                "{name}: the type nests {deepest} levels deep; the limit is {MAX_TYPE_DEPTH}"
            )));
        }
    }
    Ok(())
}

/// Guards every function `expr` calls, and turns the operators DataFusion evaluates without
/// a function into guarded functions (module docs). `schema`, when known, types the
/// operators' arguments (only string operands are rewritten).
pub(crate) fn guard_expr(expr: Expr, limit: usize) -> Result<Transformed<Expr>> {
    expr.transform_up(|e| match e {
        Expr::ScalarFunction(ScalarFunction { func, args })
            if !(func.inner().is::<Guarded>()
                || func.inner().is::<StringConcat>()
                || unguarded(func.name())) =>
        {
            Ok(Transformed::yes(Expr::ScalarFunction(ScalarFunction {
                func: guard(&func, limit),
                args,
            })))
        }
        other => Ok(Transformed::no(other)),
    })
}

/// [`guard_expr`] over every expression of `plan` and its subqueries, with the operator
/// rewrites that need the arguments' types (run after type coercion).
pub(crate) fn guard_plan(plan: LogicalPlan, limit: usize) -> Result<Transformed<LogicalPlan>> {
    plan.transform_up_with_subqueries(|node| {
        let schema = match node.inputs().as_slice() {
            [one] => Arc::clone(one.schema()),
            [] => Arc::new(DFSchema::empty()),
            _ => Arc::clone(node.schema()),
        };
        // An expression keeps its name (the node's schema must not change).
        let names = datafusion::logical_expr::expr_rewriter::NamePreserver::new(&node);
        node.map_expressions(|e| {
            let name = names.save(&e);
            let functions = guard_expr(e, limit)?;
            let rewritten = functions.transform_data(|e| rewrite_operators(e, &schema, limit))?;
            Ok(match rewritten.transformed {
                true => rewritten.update_data(|e| name.restore(e)),
                false => rewritten,
            })
        })
    })
}

/// `expr` (over `schema`) with every function guarded and the string operators rewritten, as
/// [`guard_plan`] does for a plan's expressions: for expressions evaluated outside statements.
pub(crate) fn guard_expression(expr: Expr, schema: &DFSchema, limit: usize) -> Result<Expr> {
    let functions = guard_expr(expr, limit)?.data;
    Ok(rewrite_operators(functions, schema, limit)?.data)
}

fn string_type(t: &DataType) -> bool {
    matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

/// `a || b` and regular-expression matches of strings, as guarded functions.
fn rewrite_operators(expr: Expr, schema: &DFSchema, limit: usize) -> Result<Transformed<Expr>> {
    let same_strings = |l: &Expr, r: &Expr| match (l.get_type(schema), r.get_type(schema)) {
        (Ok(a), Ok(b)) => a == b && string_type(&a),
        _ => false,
    };
    expr.transform_up(|e| {
        let regexp = |l: Expr, r: Expr, negated: bool, insensitive: bool| {
            let like = super::guard::guard(&datafusion::functions::regex::regexp_like(), limit);
            let mut args = vec![l, r];
            if insensitive {
                args.push(Expr::Literal(ScalarValue::Utf8(Some("i".into())), None));
            }
            let call = Expr::ScalarFunction(ScalarFunction::new_udf(like, args));
            Transformed::yes(if negated {
                Expr::Not(Box::new(call))
            } else {
                call
            })
        };
        Ok(match e {
            Expr::BinaryExpr(BinaryExpr { left, op, right }) if same_strings(&left, &right) => {
                match op {
                    Operator::StringConcat => {
                        Transformed::yes(Expr::ScalarFunction(ScalarFunction::new_udf(
                            Arc::new(ScalarUDF::new_from_impl(StringConcat::new(limit))),
                            vec![*left, *right],
                        )))
                    }
                    Operator::RegexMatch => regexp(*left, *right, false, false),
                    Operator::RegexIMatch => regexp(*left, *right, false, true),
                    Operator::RegexNotMatch => regexp(*left, *right, true, false),
                    Operator::RegexNotIMatch => regexp(*left, *right, true, true),
                    op => Transformed::no(Expr::BinaryExpr(BinaryExpr { left, op, right })),
                }
            }
            Expr::SimilarTo(Like {
                negated,
                expr,
                pattern,
                escape_char: None,
                case_insensitive,
            }) if same_strings(&expr, &pattern) => {
                regexp(*expr, *pattern, negated, case_insensitive)
            }
            other => Transformed::no(other),
        })
    })
}

/// `a || b` on strings, as DataFusion's operator evaluates it, guarded like a function.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct StringConcat {
    signature: Signature,
    limit: usize,
}

impl StringConcat {
    fn new(limit: usize) -> StringConcat {
        StringConcat {
            signature: Signature::any(2, Volatility::Immutable),
            limit,
        }
    }
}

impl ScalarUDFImpl for StringConcat {
    fn name(&self) -> &str {
        "string_concat"
    }

    fn schema_name(&self, args: &[Expr]) -> Result<String> {
        Ok(match args {
            [l, r] => format!("{} || {}", l.schema_name(), r.schema_name()),
            _ => "||".into(),
        })
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        match arg_types {
            [a, b] if a == b && string_type(a) => Ok(a.clone()),
            _ => Err(DataFusionError::Plan(format!(
                "|| of {arg_types:?}: both sides must be the same string type"
            ))),
        }
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let concat = Guarded {
            inner: Arc::new(ScalarUDF::new_from_impl(StringConcatKernel {
                signature: self.signature.clone(),
            })),
            sizing: Sizing::Linear(1),
            limit: self.limit,
        };
        concat.invoke_with_args(args)
    }
}

/// What [`StringConcat`] guards: DataFusion's own `||` on two arguments.
#[derive(Debug, PartialEq, Eq, Hash)]
struct StringConcatKernel {
    signature: Signature,
}

impl ScalarUDFImpl for StringConcatKernel {
    fn name(&self) -> &str {
        "||"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        Ok(arg_types.first().cloned().unwrap_or(DataType::Utf8))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let scalars = args
            .args
            .iter()
            .all(|a| matches!(a, ColumnarValue::Scalar(_)));
        let rows = if scalars { 1 } else { args.number_rows };
        let [left, right] = args.args.as_slice() else {
            return Err(DataFusionError::Internal("|| takes two arguments".into()));
        };
        let (left, right) = (left.to_array(rows)?, right.to_array(rows)?);
        let schema = Arc::new(Schema::new(vec![
            Field::new("l", left.data_type().clone(), true),
            Field::new("r", right.data_type().clone(), true),
        ]));
        let batch = RecordBatch::try_new(schema, vec![left, right])?;
        let op = PhysicalBinary::new(
            Arc::new(Column::new("l", 0)),
            Operator::StringConcat,
            Arc::new(Column::new("r", 1)),
        );
        let out = op.evaluate(&batch)?;
        if scalars {
            let array = out.to_array(1)?;
            return Ok(ColumnarValue::Scalar(ScalarValue::try_from_array(
                &array, 0,
            )?));
        }
        Ok(out)
    }
}

// ---- bounds ---------------------------------------------------------------------------------

/// An upper bound, in bytes, of what calling `name` with `args` takes (see [`Sizing`]).
fn estimate(
    name: &str,
    sizing: Sizing,
    args: &ScalarFunctionArgs,
    budget: Option<&StatementBudget>,
) -> Result<usize> {
    let call = Call::new(args);
    let too_complex = || {
        DataFusionError::ResourcesExhausted(format!(
            "{name}: the arguments' types are too complex to bound the result"
        ))
    };
    let width = width_of(args.return_field.data_type(), &mut 100_000).ok_or_else(too_complex)?;
    let variable = !fixed_width(args.return_field.data_type());
    let rows = call.out_rows();
    // Functions copy a constant argument into an array to compute with it.
    let copies = (0..call.args.len())
        .filter(|i| matches!(call.args.get(*i), Some(ColumnarValue::Scalar(_))))
        .map(|i| call.bytes(i, 0))
        .fold(0u128, u128::saturating_add);
    let mut bytes = (rows * (u128::from(width) + 1)).saturating_add(copies);
    if variable {
        bytes = bytes.saturating_add(rows * VARIABLE_ROW_BYTES);
    }
    let arg = |i: usize, row: usize| call.bytes(i, row);
    let int = |i: usize, row: usize| call.int(i, row).unwrap_or(0).max(0) as u128;
    let extra = match sizing {
        // A fixed-width result (a length, a position, a number) takes its width per row;
        // what the function reads on the way is its arguments.
        Sizing::Linear(_) if !variable => 0,
        Sizing::Linear(factor) => (0..call.args.len())
            .map(|i| call.total_bytes(i))
            .fold(0u128, u128::saturating_add)
            .saturating_mul(u128::from(factor)),
        Sizing::ConcatWs => call.per_row(|row| {
            let values = (1..call.args.len()).map(|i| arg(i, row)).sum::<u128>();
            values + arg(0, row) * (call.args.len() as u128)
        }),
        Sizing::Repeat => call.per_row(|row| arg(0, row).saturating_mul(int(1, row))),
        Sizing::Pad => call.per_row(|row| 4 * int(1, row) + arg(0, row)),
        Sizing::ArrayRepeat => call.per_row(|row| int(1, row).saturating_mul(arg(0, row) + 16)),
        Sizing::ArrayResize => call.per_row(|row| {
            let element = call.max_element(0, row).max(arg(2, row)) + 16;
            int(1, row).saturating_mul(element)
        }),
        Sizing::Range => call.per_row(|row| call.range_len(row).saturating_mul(16)),
        Sizing::Replace => call.per_row(|row| {
            let (s, from, to) = (arg(0, row), arg(1, row), arg(2, row));
            s + (s / from.max(1) + 1).saturating_mul(to)
        }),
        Sizing::RegexpReplace => {
            let patterns = check_patterns(name, &call, 1, Some(3), budget)?;
            patterns.saturating_add(
                call.per_row(|row| (arg(0, row) + 1).saturating_mul(2 * arg(2, row) + 1)),
            )
        }
        Sizing::Regexp => {
            let flags = match name {
                "regexp_count" => 3,
                "regexp_instr" => 4,
                _ => 2,
            };
            let patterns = check_patterns(name, &call, 1, Some(flags), budget)?;
            patterns.saturating_add(call.per_row(|row| {
                let groups = call.str(1, row).map_or(0, |p| p.matches('(').count()) as u128;
                arg(0, row).saturating_mul(groups + 2)
            }))
        }
        Sizing::JoinList => call.per_row(|row| {
            let per_element = arg(1, row) + arg(2, row) + 48;
            arg(0, row) + call.leaves(0, row).saturating_mul(per_element)
        }),
        Sizing::ReplaceElements => {
            call.per_row(|row| arg(0, row) + call.leaves(0, row).saturating_mul(arg(2, row) + 16))
        }
        Sizing::SplitString => call.per_row(|row| 17 * arg(0, row) + 16),
        Sizing::Format => call.per_row(|row| 16 * arg(1, row) + 64),
        Sizing::Levenshtein => {
            let work = call.per_row(|row| arg(0, row).saturating_mul(arg(1, row)));
            if work > MAX_LEVENSHTEIN_WORK {
                return Err(DataFusionError::ResourcesExhausted(format!(
                    "levenshtein would compare {work} pairs of characters; a call may compare \
                     {MAX_LEVENSHTEIN_WORK}"
                )));
            }
            2 * (0..2).map(|i| call.total_bytes(i)).sum::<u128>()
        }
    };
    let total = bytes.saturating_add(extra);
    Ok(usize::try_from(total).unwrap_or(usize::MAX))
}

/// Compiles each distinct pattern of argument `pattern` (with the flags of argument `flags`)
/// within [`REGEX_SIZE_LIMIT`]; answers what the compiled patterns are counted at.
fn check_patterns(
    name: &str,
    call: &Call<'_>,
    pattern: usize,
    flags: Option<usize>,
    budget: Option<&StatementBudget>,
) -> Result<u128> {
    let mut seen: HashSet<(&str, &str)> = HashSet::new();
    let limit = budget.map_or(usize::MAX, StatementBudget::limit) as u128;
    for row in 0..call.rows() {
        let Some(p) = call.str(pattern, row) else {
            continue;
        };
        let f = flags.and_then(|i| call.str(i, row)).unwrap_or("");
        if !seen.insert((p, f)) {
            continue;
        }
        // Parsing takes memory by the pattern's length before any size limit applies.
        if p.len() > MAX_REGEX_BYTES {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "{name}: a regular expression of {} bytes; the limit is {MAX_REGEX_BYTES}",
                p.len()
            )));
        }
        if let Some(budget) = budget {
            budget.checkpoint()?;
        }
        if (seen.len() as u128) * REGEX_BYTES > limit {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "{name}: {} distinct regular expressions in one batch, counted at {REGEX_BYTES} \
                 bytes each, pass the statement's memory",
                seen.len()
            )));
        }
        // As DataFusion compiles it: the flags inline (`g`, replace every match, is not a
        // flag of the expression).
        let inline: String = f.chars().filter(|c| *c != 'g').collect();
        let text = if inline.is_empty() {
            p.to_owned()
        } else {
            format!("(?{inline}){p}")
        };
        if let Err(regex::Error::CompiledTooBig(limit)) = regex::RegexBuilder::new(&text)
            .size_limit(REGEX_SIZE_LIMIT)
            .build()
        {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "{name}: the regular expression compiles to more than {limit} bytes"
            )));
        }
    }
    Ok(seen.len() as u128 * REGEX_BYTES)
}

/// A call's arguments, read row by row. Constant arguments have the same value in every row;
/// when every argument is constant the function runs once, for one row.
struct Call<'a> {
    args: &'a [ColumnarValue],
    rows: usize,
    scalars: bool,
}

impl<'a> Call<'a> {
    fn new(args: &'a ScalarFunctionArgs) -> Call<'a> {
        let scalars = args
            .args
            .iter()
            .all(|a| matches!(a, ColumnarValue::Scalar(_)));
        Call {
            args: &args.args,
            rows: args.number_rows,
            scalars,
        }
    }

    /// Rows a bound is summed over.
    fn rows(&self) -> usize {
        if self.scalars { 1 } else { self.rows }
    }

    /// Rows of the result (a function of constants may still answer one per row).
    fn out_rows(&self) -> u128 {
        self.rows.max(1) as u128
    }

    fn per_row(&self, f: impl Fn(usize) -> u128) -> u128 {
        (0..self.rows()).fold(0u128, |sum, row| sum.saturating_add(f(row)))
    }

    /// Bytes of argument `i` over all rows (a constant counted once per row of the result).
    fn total_bytes(&self, i: usize) -> u128 {
        match self.args.get(i) {
            Some(ColumnarValue::Array(a)) => a.get_array_memory_size() as u128,
            Some(ColumnarValue::Scalar(s)) => {
                let rows = if self.scalars { 1 } else { self.out_rows() };
                scalar_bytes(s).saturating_mul(rows)
            }
            None => 0,
        }
    }

    /// The bytes of argument `i`'s value in `row` (0 for null or a missing argument).
    fn bytes(&self, i: usize, row: usize) -> u128 {
        match self.args.get(i) {
            Some(ColumnarValue::Array(a)) => row_bytes(a.as_ref(), row),
            Some(ColumnarValue::Scalar(s)) => scalar_bytes(s),
            None => 0,
        }
    }

    /// Argument `i` in `row` as an integer.
    fn int(&self, i: usize, row: usize) -> Option<i128> {
        match self.args.get(i)? {
            ColumnarValue::Scalar(s) => scalar_int(s),
            ColumnarValue::Array(a) => array_int(a.as_ref(), row),
        }
    }

    /// Argument `i` in `row` as a string.
    fn str(&self, i: usize, row: usize) -> Option<&'a str> {
        match self.args.get(i)? {
            ColumnarValue::Scalar(s) => s.try_as_str().flatten(),
            ColumnarValue::Array(a) => {
                if row >= a.len() || a.is_null(row) {
                    return None;
                }
                match a.data_type() {
                    DataType::Utf8 => Some(a.as_string::<i32>().value(row)),
                    DataType::LargeUtf8 => Some(a.as_string::<i64>().value(row)),
                    DataType::Utf8View => Some(a.as_string_view().value(row)),
                    _ => None,
                }
            }
        }
    }

    /// The values (leaves) in argument `i`'s list in `row`.
    fn leaves(&self, i: usize, row: usize) -> u128 {
        match self.args.get(i) {
            Some(ColumnarValue::Array(a)) => leaves(a.as_ref(), row),
            Some(ColumnarValue::Scalar(s)) => match s {
                ScalarValue::List(a) => leaves(a.as_ref(), 0),
                ScalarValue::LargeList(a) => leaves(a.as_ref(), 0),
                ScalarValue::FixedSizeList(a) => leaves(a.as_ref(), 0),
                _ => 1,
            },
            None => 0,
        }
    }

    /// The bytes of the largest element of argument `i`'s list in `row`.
    fn max_element(&self, i: usize, row: usize) -> u128 {
        let list: ArrayRef = match self.args.get(i) {
            Some(ColumnarValue::Array(a)) => Arc::clone(a),
            Some(ColumnarValue::Scalar(s)) => match s.to_array() {
                Ok(a) => a,
                Err(_) => return 0,
            },
            None => return 0,
        };
        let row = if list.len() == 1 { 0 } else { row };
        match element_range(list.as_ref(), row) {
            Some((values, range)) => range
                .map(|j| row_bytes(values.as_ref(), j))
                .max()
                .unwrap_or(0),
            None => 0,
        }
    }

    /// How many elements `range` or `generate_series` makes in `row` (at most; a step whose
    /// parts have different signs counts as unbounded).
    fn range_len(&self, row: usize) -> u128 {
        let first = self.args.first().map(ColumnarValue::data_type);
        match first {
            Some(DataType::Date32 | DataType::Date64 | DataType::Timestamp(..)) => {
                let (Some(start), Some(stop)) = (self.instant(0, row), self.instant(1, row)) else {
                    return 0;
                };
                let day: i128 = 23 * 3600 * 1_000_000_000;
                let step = match self.interval(2, row) {
                    Some((months, days, nanos)) => {
                        let signs = [months.signum(), days.signum(), nanos.signum()];
                        // A step whose parts pull both ways (`1 month -30 days`) can stand
                        // still: DataFusion then adds elements until its dates overflow.
                        if signs.contains(&1) && signs.contains(&-1) {
                            return u128::MAX;
                        }
                        months.abs() * 28 * day + days.abs() * day + nanos.abs()
                    }
                    None => return 0,
                };
                let unit = match first {
                    Some(DataType::Timestamp(..)) => 1,
                    _ => day,
                };
                ((stop - start).unsigned_abs() / step.max(unit) as u128) + 1
            }
            _ => {
                let (start, stop, step) = match self.args.len() {
                    1 => (Some(0), self.int(0, row), Some(1)),
                    2 => (self.int(0, row), self.int(1, row), Some(1)),
                    _ => (self.int(0, row), self.int(1, row), self.int(2, row)),
                };
                match (start, stop, step) {
                    (Some(start), Some(stop), Some(step)) if step != 0 => {
                        (stop - start).unsigned_abs() / step.unsigned_abs() + 1
                    }
                    _ => 0,
                }
            }
        }
    }

    /// Argument `i` in `row` as nanoseconds (dates and timestamps).
    fn instant(&self, i: usize, row: usize) -> Option<i128> {
        let (value, unit) = match self.args.get(i)? {
            ColumnarValue::Scalar(s) => match s {
                ScalarValue::Date32(v) => (i128::from((*v)?), 86_400_000_000_000),
                ScalarValue::Date64(v) => (i128::from((*v)?), 1_000_000),
                ScalarValue::TimestampSecond(v, _) => (i128::from((*v)?), 1_000_000_000),
                ScalarValue::TimestampMillisecond(v, _) => (i128::from((*v)?), 1_000_000),
                ScalarValue::TimestampMicrosecond(v, _) => (i128::from((*v)?), 1_000),
                ScalarValue::TimestampNanosecond(v, _) => (i128::from((*v)?), 1),
                _ => return None,
            },
            ColumnarValue::Array(a) => {
                let row = if a.len() == 1 { 0 } else { row };
                if row >= a.len() || a.is_null(row) {
                    return None;
                }
                match a.data_type() {
                    DataType::Date32 => (
                        i128::from(a.as_primitive::<Date32Type>().value(row)),
                        86_400_000_000_000,
                    ),
                    DataType::Date64 => (
                        i128::from(a.as_primitive::<Date64Type>().value(row)),
                        1_000_000,
                    ),
                    DataType::Timestamp(TimeUnit::Second, _) => (
                        i128::from(a.as_primitive::<TimestampSecondType>().value(row)),
                        1_000_000_000,
                    ),
                    DataType::Timestamp(TimeUnit::Millisecond, _) => (
                        i128::from(a.as_primitive::<TimestampMillisecondType>().value(row)),
                        1_000_000,
                    ),
                    DataType::Timestamp(TimeUnit::Microsecond, _) => (
                        i128::from(a.as_primitive::<TimestampMicrosecondType>().value(row)),
                        1_000,
                    ),
                    DataType::Timestamp(TimeUnit::Nanosecond, _) => (
                        i128::from(a.as_primitive::<TimestampNanosecondType>().value(row)),
                        1,
                    ),
                    _ => return None,
                }
            }
        };
        Some(value * unit)
    }

    /// Argument `i` in `row` as an interval's months, days and nanoseconds.
    fn interval(&self, i: usize, row: usize) -> Option<(i128, i128, i128)> {
        let value = match self.args.get(i)? {
            ColumnarValue::Scalar(ScalarValue::IntervalMonthDayNano(v)) => (*v)?,
            ColumnarValue::Array(a) if matches!(a.data_type(), DataType::Interval(_)) => {
                let row = if a.len() == 1 { 0 } else { row };
                if row >= a.len() || a.is_null(row) {
                    return None;
                }
                a.as_primitive_opt::<IntervalMonthDayNanoType>()?.value(row)
            }
            _ => return None,
        };
        Some((
            i128::from(value.months),
            i128::from(value.days),
            i128::from(value.nanoseconds),
        ))
    }
}

fn scalar_int(s: &ScalarValue) -> Option<i128> {
    Some(match s {
        ScalarValue::Int8(v) => i128::from((*v)?),
        ScalarValue::Int16(v) => i128::from((*v)?),
        ScalarValue::Int32(v) => i128::from((*v)?),
        ScalarValue::Int64(v) => i128::from((*v)?),
        ScalarValue::UInt8(v) => i128::from((*v)?),
        ScalarValue::UInt16(v) => i128::from((*v)?),
        ScalarValue::UInt32(v) => i128::from((*v)?),
        ScalarValue::UInt64(v) => i128::from((*v)?),
        _ => return None,
    })
}

fn array_int(a: &dyn Array, row: usize) -> Option<i128> {
    let row = if a.len() == 1 { 0 } else { row };
    if row >= a.len() || a.is_null(row) {
        return None;
    }
    Some(match a.data_type() {
        DataType::Int8 => i128::from(a.as_primitive::<Int8Type>().value(row)),
        DataType::Int16 => i128::from(a.as_primitive::<Int16Type>().value(row)),
        DataType::Int32 => i128::from(a.as_primitive::<Int32Type>().value(row)),
        DataType::Int64 => i128::from(a.as_primitive::<Int64Type>().value(row)),
        DataType::UInt8 => i128::from(a.as_primitive::<UInt8Type>().value(row)),
        DataType::UInt16 => i128::from(a.as_primitive::<UInt16Type>().value(row)),
        DataType::UInt32 => i128::from(a.as_primitive::<UInt32Type>().value(row)),
        DataType::UInt64 => i128::from(a.as_primitive::<UInt64Type>().value(row)),
        _ => return None,
    })
}

/// The bytes a single value takes when copied.
pub(crate) fn scalar_bytes(s: &ScalarValue) -> u128 {
    match s {
        ScalarValue::List(a) => row_bytes(a.as_ref(), 0),
        ScalarValue::LargeList(a) => row_bytes(a.as_ref(), 0),
        ScalarValue::FixedSizeList(a) => row_bytes(a.as_ref(), 0),
        ScalarValue::Struct(a) => row_bytes(a.as_ref(), 0),
        ScalarValue::Map(a) => row_bytes(a.as_ref(), 0),
        other => match other.try_as_str() {
            Some(text) => text.map_or(0, |t| t.len() as u128),
            None => (other.size().saturating_sub(size_of::<ScalarValue>()) as u128).max(
                u128::from(width_of(&other.data_type(), &mut 10_000).unwrap_or(0)),
            ),
        },
    }
}

/// The list `a`'s values array and the range of them in `row`.
fn element_range(a: &dyn Array, row: usize) -> Option<(ArrayRef, std::ops::Range<usize>)> {
    if row >= a.len() || a.is_null(row) {
        return None;
    }
    match a.data_type() {
        DataType::List(_) => {
            let l = a.as_list::<i32>();
            let o = l.value_offsets();
            Some((Arc::clone(l.values()), o[row] as usize..o[row + 1] as usize))
        }
        DataType::LargeList(_) => {
            let l = a.as_list::<i64>();
            let o = l.value_offsets();
            Some((Arc::clone(l.values()), o[row] as usize..o[row + 1] as usize))
        }
        DataType::FixedSizeList(_, n) => {
            let l = a.as_fixed_size_list();
            let n = *n as usize;
            Some((Arc::clone(l.values()), row * n..(row + 1) * n))
        }
        DataType::Map(..) => {
            let m = a.as_map();
            let o = m.value_offsets();
            let entries: ArrayRef = Arc::new(m.entries().clone());
            Some((entries, o[row] as usize..o[row + 1] as usize))
        }
        _ => None,
    }
}

/// The bytes the value in `row` of `a` takes when copied (0 for null).
pub(crate) fn row_bytes(a: &dyn Array, row: usize) -> u128 {
    if row >= a.len() {
        return 0;
    }
    if a.is_null(row) {
        return 1;
    }
    match a.data_type() {
        DataType::Utf8 => a.as_string::<i32>().value(row).len() as u128 + 4,
        DataType::LargeUtf8 => a.as_string::<i64>().value(row).len() as u128 + 8,
        DataType::Utf8View => a.as_string_view().value(row).len() as u128 + 16,
        DataType::Binary => a.as_binary::<i32>().value(row).len() as u128 + 4,
        DataType::LargeBinary => a.as_binary::<i64>().value(row).len() as u128 + 8,
        DataType::BinaryView => a.as_binary_view().value(row).len() as u128 + 16,
        DataType::Struct(_) => {
            let s = a.as_struct();
            s.columns()
                .iter()
                .map(|c| row_bytes(c.as_ref(), row))
                .fold(0, u128::saturating_add)
        }
        DataType::Dictionary(..) => {
            let Some(d) = a.as_any_dictionary_opt() else {
                return 0;
            };
            let keys = d.normalized_keys();
            match keys.get(row) {
                Some(k) => row_bytes(d.values().as_ref(), *k),
                None => 0,
            }
        }
        other => match element_range(a, row) {
            Some((values, range)) => range
                .map(|j| row_bytes(values.as_ref(), j))
                .fold(8, u128::saturating_add),
            None => u128::from(width_of(other, &mut 10_000).unwrap_or(16)),
        },
    }
}

/// The values in the list in `row` of `a`, nested lists flattened (1 for anything else).
fn leaves(a: &dyn Array, row: usize) -> u128 {
    match element_range(a, row) {
        Some((values, range)) => range
            .map(|j| leaves(values.as_ref(), j))
            .fold(0, u128::saturating_add),
        None => 1,
    }
}

/// Whether values of `t` all take the same bytes.
fn fixed_width(t: &DataType) -> bool {
    t.primitive_width().is_some()
        || matches!(
            t,
            DataType::Null | DataType::Boolean | DataType::FixedSizeBinary(_)
        )
}

/// The bytes one value of `t` takes in an array, not counting variable-length data (a
/// string's offset, a list's offset, a fixed-size list's elements); `None` when the type is
/// too large to visit within `budget` nodes.
pub(crate) fn width_of(t: &DataType, budget: &mut usize) -> Option<u64> {
    *budget = budget.checked_sub(1)?;
    Some(match t {
        DataType::Null => 0,
        DataType::Boolean => 1,
        DataType::FixedSizeBinary(n) => u64::try_from(*n).unwrap_or(0),
        DataType::FixedSizeList(f, n) => {
            width_of(f.data_type(), budget)?.saturating_mul(u64::try_from(*n).unwrap_or(0))
        }
        DataType::Utf8 | DataType::Binary | DataType::List(_) | DataType::Map(..) => 4,
        DataType::LargeUtf8 | DataType::LargeBinary | DataType::LargeList(_) => 8,
        DataType::ListView(_) => 8,
        DataType::LargeListView(_) => 16,
        DataType::Utf8View | DataType::BinaryView => 16,
        DataType::Struct(fields) => {
            let mut sum = 0u64;
            for f in fields {
                sum = sum.saturating_add(width_of(f.data_type(), budget)?);
            }
            sum
        }
        DataType::Union(fields, _) => {
            let mut sum = 5u64;
            for (_, f) in fields.iter() {
                sum = sum.saturating_add(width_of(f.data_type(), budget)?);
            }
            sum
        }
        DataType::Dictionary(key, _) => width_of(key, budget)?,
        DataType::RunEndEncoded(_, values) => width_of(values.data_type(), budget)?,
        other => other.primitive_width().unwrap_or(16) as u64,
    })
}

// ---- holding a reservation for as long as a result lives -----------------------------------

/// The start and end addresses of every buffer of `data` and its children.
pub(crate) fn buffer_ranges(data: &ArrayData) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut stack = vec![data.clone()];
    while let Some(d) = stack.pop() {
        for b in d.buffers() {
            let start = b.as_ptr() as usize;
            out.push((start, start + b.len()));
        }
        if let Some(n) = d.nulls() {
            let b = n.buffer();
            let start = b.as_ptr() as usize;
            out.push((start, start + b.len()));
        }
        stack.extend(d.child_data().iter().cloned());
    }
    out
}

/// The bytes of `data`'s buffers that are not within any of `inputs`' buffers.
fn new_bytes(data: &ArrayData, inputs: &[(usize, usize)]) -> usize {
    bytes_outside(buffer_ranges(data), inputs)
}

/// What `data` holds beyond its inputs: the bytes of its distinct buffers that are not
/// within any of `inputs`' buffers (a buffer referred to many times counted once), and a
/// buffer handle for every reference (a view array concatenated from slices refers to
/// every data buffer of every slice).
pub(crate) fn fresh_bytes(data: &ArrayData, inputs: &[(usize, usize)]) -> usize {
    let mut ranges = buffer_ranges(data);
    let handles = ranges.len().saturating_mul(size_of::<Buffer>());
    ranges.sort_unstable();
    ranges.dedup();
    bytes_outside(ranges, inputs).saturating_add(handles)
}

/// The bytes of `ranges` that are not within any of `inputs`.
fn bytes_outside(ranges: Vec<(usize, usize)>, inputs: &[(usize, usize)]) -> usize {
    ranges
        .into_iter()
        .filter(|(start, end)| {
            !inputs
                .iter()
                .any(|(s, e)| *s <= *start && *end <= *e && start != end)
        })
        .map(|(start, end)| end - start)
        .fold(0, usize::saturating_add)
}

/// A reservation kept alive by the buffers that hold its bytes.
#[derive(Debug)]
struct Kept {
    _buffer: Buffer,
    _reservation: Arc<Mutex<MemoryReservation>>,
}

/// `batch`, whose buffers keep `reservation` until the last of them is dropped.
pub(crate) fn hold_batch(
    batch: RecordBatch,
    reservation: MemoryReservation,
) -> Result<RecordBatch> {
    let reservation = Arc::new(Mutex::new(reservation));
    let columns = batch
        .columns()
        .iter()
        .map(|c| make_array(hold_data(c.to_data(), &reservation)))
        .collect();
    Ok(RecordBatch::try_new_with_options(
        batch.schema(),
        columns,
        &arrow_array::RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
    )?)
}

/// `data` as an array whose buffers each keep `reservation` until they are dropped.
fn hold_array(data: ArrayData, reservation: MemoryReservation) -> ArrayRef {
    let reservation = Arc::new(Mutex::new(reservation));
    make_array(hold_data(data, &reservation))
}

fn hold_buffer(b: &Buffer, reservation: &Arc<Mutex<MemoryReservation>>) -> Buffer {
    let Some(ptr) = NonNull::new(b.as_ptr().cast_mut()) else {
        return b.clone();
    };
    if b.is_empty() {
        return b.clone();
    }
    let owner = Arc::new(Kept {
        _buffer: b.clone(),
        _reservation: Arc::clone(reservation),
    });
    // SAFETY: `ptr` points to `b.len()` initialized bytes owned by `b`, which `owner` keeps
    // alive (and never mutates) for as long as the new buffer exists.
    unsafe { Buffer::from_custom_allocation(ptr, b.len(), owner) }
}

fn hold_data(data: ArrayData, reservation: &Arc<Mutex<MemoryReservation>>) -> ArrayData {
    let buffers: Vec<Buffer> = data
        .buffers()
        .iter()
        .map(|b| hold_buffer(b, reservation))
        .collect();
    let children: Vec<ArrayData> = data
        .child_data()
        .iter()
        .map(|c| hold_data(c.clone(), reservation))
        .collect();
    let nulls = data.nulls().map(|n| {
        let bits = BooleanBuffer::new(hold_buffer(n.buffer(), reservation), n.offset(), n.len());
        // SAFETY: the same bits as `n`, whose null count is therefore still right.
        unsafe { NullBuffer::new_unchecked(bits, n.null_count()) }
    });
    let builder = data
        .into_builder()
        .buffers(buffers)
        .child_data(children)
        .nulls(nulls);
    // SAFETY: every buffer is the same memory as before, with the same lengths and offsets;
    // only what keeps it alive changed, so the data is as valid as it was.
    unsafe { builder.build_unchecked() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::query::QueryLimits;
    use crate::query::budget::{BudgetOption, StatementBudget};
    use arrow_array::RecordBatch;
    use datafusion::execution::memory_pool::{GreedyMemoryPool, MemoryPool};

    /// The engine's session with a statement budget of `limit` bytes.
    fn context(limit: usize) -> (SessionContext, Arc<StatementBudget>, Arc<dyn MemoryPool>) {
        let limits = QueryLimits {
            memory_bytes: limit,
            ..QueryLimits::default()
        };
        let mut state = crate::query::testing_session(limits);
        let server: Arc<dyn MemoryPool> = Arc::new(GreedyMemoryPool::new(limit));
        let budget = StatementBudget::new(&server, limit, std::time::Duration::from_secs(60));
        state
            .config_mut()
            .options_mut()
            .extensions
            .insert(BudgetOption(Arc::clone(&budget)));
        (SessionContext::new_with_state(state), budget, server)
    }

    async fn run(ctx: &SessionContext, sql: &str) -> Result<Vec<RecordBatch>> {
        ctx.sql(sql).await?.collect().await
    }

    fn exhausted(r: Result<Vec<RecordBatch>>, sql: &str) {
        match r {
            Err(e) => assert!(
                matches!(e.find_root(), DataFusionError::ResourcesExhausted(_)),
                "{sql}: {e}"
            ),
            Ok(_) => panic!("{sql} ran"),
        }
    }

    fn cell(batches: &[RecordBatch]) -> String {
        let column = batches[0].column(0);
        arrow_cast::display::array_value_to_string(column, 0).unwrap()
    }

    /// Counts, lengths and ranges that would size a result past the budget are refused
    /// before anything is allocated (were they allocated, this test's process would end:
    /// a terabyte does not fit), folded while planning or evaluated per row.
    #[tokio::test]
    async fn arguments_that_size_a_result_are_refused_before_it_is_made() {
        let (ctx, _, _) = context(64 << 20);
        for sql in [
            "SELECT repeat(arrow_cast('a', 'LargeUtf8'), 200000000000000)",
            "SELECT repeat('a', 100000000)",
            "SELECT max(length(repeat('a', 1000000000 + v))) FROM (VALUES (1), (2)) AS t(v)",
            "SELECT lpad('a', 2147483647)",
            "SELECT rpad('a', 100000000 + v) FROM (VALUES (1)) AS t(v)",
            "SELECT array_repeat(1, 1000000000)",
            "SELECT array_resize(make_array(1), 1000000000, 7)",
            "SELECT range(-9223372036854775808, 9223372036854775807)",
            "SELECT generate_series(TIMESTAMP '1970-01-01', TIMESTAMP '2200-01-01', INTERVAL '1 nanosecond')",
            "SELECT range(DATE '2000-01-31', DATE '1990-01-01', INTERVAL '1 month -29 days')",
            "SELECT replace(repeat('a', 100000), '', repeat('b', 100000))",
            "SELECT regexp_replace(repeat('a', 100000), 'x*', repeat('b', 10000), 'g')",
            "SELECT array_to_string(range(1, 100000), repeat('x', 10000))",
            "SELECT array_replace_all(array_repeat('', 100000), '', repeat('x', 10000))",
            "SELECT levenshtein(repeat('a', 100000), repeat('b', 100000))",
            "SELECT regexp_like('a', '((((x{100}){100}){100}){100})')",
            "SELECT 'a' ~ '((((x{100}){100}){100}){100})'",
            "SELECT 'a' SIMILAR TO '((((x{100}){100}){100}){100})'",
        ] {
            exhausted(run(&ctx, sql).await, sql);
        }
    }

    /// A negative length from a column made DataFusion's `lpad`/`rpad` size a buffer past
    /// what a vector holds and panic: refused as an error instead.
    #[tokio::test]
    async fn a_negative_pad_length_is_an_error_not_a_panic() {
        let (ctx, _, _) = context(64 << 20);
        for sql in [
            "SELECT lpad(c1, c2) FROM (VALUES ('a,b', -1), ('a,b', -1)) AS t(c1, c2)",
            "SELECT rpad(c1, c2, c3) FROM (VALUES ('a', -9223372036854775808, 'x')) AS t(c1, c2, c3)",
        ] {
            let error = run(&ctx, sql).await.expect_err(sql).to_string();
            assert!(error.contains("the length is negative"), "{sql}: {error}");
        }
    }

    /// What the guards rewrite answers as DataFusion's own functions and operators do.
    #[tokio::test]
    async fn guarded_functions_and_operators_answer_as_before() {
        let (ctx, _, _) = context(64 << 20);
        for (sql, expected) in [
            ("SELECT repeat('ab', 3)", "ababab"),
            ("SELECT 'a' || 'b'", "ab"),
            ("SELECT (NULL || 'b') IS NULL", "true"),
            ("SELECT s || s FROM (VALUES ('xy')) AS t(s)", "xyxy"),
            ("SELECT 'abc' ~ 'b'", "true"),
            ("SELECT 'abc' !~* 'B'", "false"),
            ("SELECT 'abc' SIMILAR TO 'a.c'", "true"),
            (
                "SELECT s ~ p FROM (VALUES ('abc', '^a')) AS t(s, p)",
                "true",
            ),
            ("SELECT lpad('a', 3, 'é')", "ééa"),
            ("SELECT cardinality(range(1, 10))", "9"),
            ("SELECT array_to_string(make_array(1, 2), '-')", "1-2"),
            ("SELECT regexp_replace('aaa', 'a', 'b', 'g')", "bbb"),
            ("SELECT levenshtein('kitten', 'sitting')", "3"),
        ] {
            let batches = run(&ctx, sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            assert_eq!(cell(&batches), expected, "{sql}");
        }
    }

    /// A result is held in the statement's memory for as long as it lives: results that fit
    /// one by one but not together are refused, and what a result held is returned once it
    /// is dropped.
    #[tokio::test]
    async fn results_are_held_while_they_live() {
        let (ctx, _, _) = context(64 << 20);
        // `concat` evaluates its three arguments before it runs: all three are held at once.
        let sql = "SELECT length(concat(a, b, c)) FROM (SELECT \
                   repeat('a', 25000000 + v - v) AS a, repeat('b', 25000000 + v - v) AS b, \
                   repeat('c', 25000000 + v - v) AS c FROM (VALUES (1)) AS t(v))";
        exhausted(run(&ctx, sql).await, sql);
        let (ctx, budget, server) = context(64 << 20);
        let held = run(
            &ctx,
            "SELECT repeat('a', 10000000 + v - v) FROM (VALUES (1)) AS t(v)",
        )
        .await
        .unwrap();
        assert!(server.reserved() >= 10_000_000, "{}", server.reserved());
        drop(held);
        assert_eq!(server.reserved(), 0);
        drop(ctx);
        budget.close();
    }

    /// Every function the engine registers, by the bound it gets: a new DataFusion version's
    /// functions show up here, to be looked at (are they bounded by their arguments?).
    #[tokio::test]
    async fn every_registered_function_has_a_reviewed_bound() {
        let engine = crate::query::testing_session(crate::query::QueryLimits::default());
        let specific: Vec<&str> = [
            "concat_ws",
            "repeat",
            "lpad",
            "rpad",
            "array_repeat",
            "array_resize",
            "range",
            "generate_series",
            "replace",
            "regexp_replace",
            "regexp_like",
            "regexp_match",
            "regexp_count",
            "regexp_instr",
            "array_to_string",
            "array_replace",
            "array_replace_n",
            "array_replace_all",
            "string_to_array",
            "to_char",
            "date_format",
            "levenshtein",
            "upper",
            "lower",
            "initcap",
            "translate",
        ]
        .to_vec();
        // Reviewed: each returns at most about its arguments' bytes (or a fixed width).
        let linear = REVIEWED_LINEAR;
        let mut unknown = Vec::new();
        for f in engine.scalar_functions().values() {
            let name = f.name();
            let guarded = f.inner().is::<Guarded>() || unguarded(name);
            assert!(guarded, "{name} is not guarded");
            if !specific.contains(&name) && !linear.contains(&name) && !unguarded(name) {
                unknown.push(name.to_owned());
            }
        }
        unknown.sort();
        unknown.dedup();
        assert!(
            unknown.is_empty(),
            "functions whose result bound nobody looked at (add them to a Sizing or to \
             REVIEWED_LINEAR): {unknown:?}"
        );
    }

    /// Functions whose result is at most a small multiple of their arguments, or of fixed
    /// width: checked by reading each one's implementation in DataFusion 55.2 and
    /// datafusion-functions-json 0.55.
    const REVIEWED_LINEAR: &[&str] = &[
        "abs",
        "acos",
        "acosh",
        "array_add",
        "array_any_value",
        "array_append",
        "array_avg",
        "array_compact",
        "array_concat",
        "array_distance",
        "array_distinct",
        "array_dims",
        "array_element",
        "array_empty",
        "array_except",
        "array_has",
        "array_has_all",
        "array_has_any",
        "array_intersect",
        "array_length",
        "array_max",
        "array_min",
        "array_ndims",
        "array_normalize",
        "array_pop_back",
        "array_pop_front",
        "array_position",
        "array_positions",
        "array_prepend",
        "array_product",
        "array_remove",
        "array_remove_all",
        "array_remove_n",
        "array_reverse",
        "array_scale",
        "array_slice",
        "array_sort",
        "array_subtract",
        "array_sum",
        "array_union",
        "arrays_overlap",
        "arrays_zip",
        "arrow_cast",
        "arrow_field",
        "arrow_metadata",
        "arrow_try_cast",
        "arrow_typeof",
        "ascii",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "bit_length",
        "btrim",
        "cardinality",
        "cast_to_type",
        "cbrt",
        "ceil",
        "character_length",
        "chr",
        "coalesce",
        "concat",
        "contains",
        "cos",
        "cosh",
        "cosine_distance",
        "cot",
        "current_date",
        "current_time",
        "current_timestamp",
        "date_bin",
        "date_part",
        "date_trunc",
        "decode",
        "degrees",
        "dot_product",
        "empty",
        "encode",
        "ends_with",
        "exp",
        "factorial",
        "file_row_index",
        "find_in_set",
        "flatten",
        "floor",
        "from_unixtime",
        "gcd",
        "greatest",
        "inner_product",
        "input_file_name",
        "isnan",
        "iszero",
        "json_as_text",
        "json_contains",
        "json_from_scalar",
        "json_get",
        "json_get_array",
        "json_get_bool",
        "json_get_float",
        "json_get_int",
        "json_get_json",
        "json_get_str",
        "json_length",
        "json_object_keys",
        "json_union_to_text",
        "lcm",
        "least",
        "left",
        "length",
        "ln",
        "log",
        "log10",
        "log2",
        "ltrim",
        "make_array",
        "make_date",
        "make_time",
        "map",
        "map_entries",
        "map_extract",
        "map_keys",
        "map_values",
        "named_struct",
        "nanvl",
        "now",
        "nullif",
        "nvl",
        "nvl2",
        "octet_length",
        "overlay",
        "pi",
        "power",
        "radians",
        "random",
        "reverse",
        "right",
        "round",
        "rtrim",
        "scalar_to_json",
        "signum",
        "sin",
        "sinh",
        "split_part",
        "sqrt",
        "starts_with",
        "strpos",
        "struct",
        "substr",
        "substr_index",
        "tan",
        "tanh",
        "to_date",
        "to_hex",
        "to_local_time",
        "to_time",
        "to_timestamp",
        "to_timestamp_micros",
        "to_timestamp_millis",
        "to_timestamp_nanos",
        "to_timestamp_seconds",
        "to_unixtime",
        "trunc",
        "try_cast_to_type",
        "union_extract",
        "union_tag",
        "uuid",
        "version",
        "with_metadata",
    ];
}
