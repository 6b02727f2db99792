//! The aggregate and window functions whose result size comes from an argument's value,
//! bounded ([`register`]): `string_agg`, which puts its separator between every two values
//! (a ten-kilobyte separator over a hundred thousand rows is a gigabyte), and `lag`/`lead`,
//! which copy their default value into every row the offset reaches (a whole partition).
//!
//! Aggregates' state is counted in the statement's memory by DataFusion after each batch,
//! but a separator is appended per row within a batch, strings grow by doubling, and the
//! result is built or copied once more when the aggregate ends: what the statement's memory
//! sees is a fraction of what these take at their peak. So each is held to a share of the
//! statement memory ([`share`]) before it grows: `string_agg` counts the text it has built
//! (all groups together), `lag`/`lead` the default values a partition would take.
//!
//! Every other aggregate and window function keeps a state bounded by its input (a sum, a
//! count, the values it was given) or by a fixed size (`approx_distinct`), which
//! `guard::tests` lists as reviewed.

use std::sync::Arc;

use arrow_array::{ArrayRef, BooleanArray};
use arrow_schema::{DataType, FieldRef};
use datafusion::common::ScalarValue;
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::function::{
    AccumulatorArgs, PartitionEvaluatorArgs, StateFieldsArgs, WindowUDFFieldArgs,
};
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, Documentation, EmitTo, GroupsAccumulator,
    LimitEffect, PartitionEvaluator, ReversedUDAF, ReversedUDWF, Signature, WindowUDF,
    WindowUDFImpl,
};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Literal;
use datafusion::prelude::SessionContext;

use super::guard::{row_bytes, scalar_bytes};

/// The share of the statement memory `limit` one of these functions may build.
pub(crate) fn share(limit: usize) -> u128 {
    (limit / 8) as u128
}

/// Registers `string_agg`, `lag` and `lead` of `ctx` bounded to a share of `limit`.
pub(crate) fn register(ctx: &mut SessionContext, limit: usize) {
    let state = ctx.state();
    if let Some(inner) = state.aggregate_functions().get("string_agg") {
        ctx.register_udaf(AggregateUDF::new_from_impl(BoundedStringAgg {
            inner: Arc::clone(inner),
            limit,
        }));
    }
    for name in ["lag", "lead"] {
        if let Some(inner) = state.window_functions().get(name) {
            ctx.register_udwf(WindowUDF::new_from_impl(BoundedShift {
                inner: Arc::clone(inner),
                limit,
            }));
        }
    }
}

fn too_large(what: &str, bytes: u128, limit: usize) -> DataFusionError {
    DataFusionError::ResourcesExhausted(format!(
        "{what} would take more than {bytes} bytes; it may take {} (an eighth of \
         query_memory_bytes)",
        share(limit)
    ))
}

/// The bytes of the values of `array` (what appending them copies).
fn values_bytes(array: &ArrayRef) -> u128 {
    (0..array.len())
        .map(|row| row_bytes(array.as_ref(), row))
        .fold(0, u128::saturating_add)
}

/// The separator of a `string_agg` call: its second argument, a literal.
fn separator_bytes(exprs: &[Arc<dyn PhysicalExpr>]) -> u128 {
    exprs
        .get(1)
        .and_then(|e| e.downcast_ref::<Literal>())
        .map_or(0, |l| scalar_bytes(l.value()))
}

/// `string_agg`, held to a share of the statement memory.
#[derive(Debug, PartialEq, Eq, Hash)]
struct BoundedStringAgg {
    inner: Arc<AggregateUDF>,
    limit: usize,
}

impl AggregateUDFImpl for BoundedStringAgg {
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

    fn return_field(&self, arg_fields: &[FieldRef]) -> Result<FieldRef> {
        self.inner.return_field(arg_fields)
    }

    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        self.inner.state_fields(args)
    }

    fn accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        let separator = separator_bytes(args.exprs);
        Ok(Box::new(Bounded {
            inner: self.inner.accumulator(args)?,
            growth: Growth::new(separator, self.limit),
        }))
    }

    fn groups_accumulator_supported(&self, args: AccumulatorArgs) -> bool {
        self.inner.groups_accumulator_supported(args)
    }

    fn create_groups_accumulator(
        &self,
        args: AccumulatorArgs,
    ) -> Result<Box<dyn GroupsAccumulator>> {
        let separator = separator_bytes(args.exprs);
        Ok(Box::new(BoundedGroups {
            inner: self.inner.create_groups_accumulator(args)?,
            growth: Growth::new(separator, self.limit),
        }))
    }

    fn create_sliding_accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        let separator = separator_bytes(args.exprs);
        Ok(Box::new(Bounded {
            inner: self.inner.create_sliding_accumulator(args)?,
            growth: Growth::new(separator, self.limit),
        }))
    }

    fn reverse_expr(&self) -> ReversedUDAF {
        match self.inner.reverse_udf() {
            ReversedUDAF::Reversed(inner) => {
                ReversedUDAF::Reversed(Arc::new(AggregateUDF::new_from_impl(BoundedStringAgg {
                    inner,
                    limit: self.limit,
                })))
            }
            other => other,
        }
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }
}

/// What a `string_agg` has built so far, counted before it grows.
#[derive(Debug)]
struct Growth {
    separator: u128,
    built: u128,
    limit: usize,
}

impl Growth {
    fn new(separator: u128, limit: usize) -> Growth {
        Growth {
            separator,
            built: 0,
            limit,
        }
    }

    /// Counts `values` appended (each with a separator); refuses past the share.
    fn add(&mut self, values: &ArrayRef) -> Result<()> {
        let rows = (values.len() - values.null_count()) as u128;
        let grown = values_bytes(values).saturating_add(rows.saturating_mul(self.separator));
        let built = self.built.saturating_add(grown);
        if built > share(self.limit) {
            return Err(too_large("string_agg", built, self.limit));
        }
        self.built = built;
        Ok(())
    }
}

/// An accumulator of `string_agg` whose text is counted before it grows.
#[derive(Debug)]
struct Bounded {
    inner: Box<dyn Accumulator>,
    growth: Growth,
}

impl Accumulator for Bounded {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        if let Some(first) = values.first() {
            self.growth.add(first)?;
        }
        self.inner.update_batch(values)
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        self.inner.evaluate()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        self.inner.state()
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        if let Some(first) = states.first() {
            self.growth.add(first)?;
        }
        self.inner.merge_batch(states)
    }

    fn retract_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        self.inner.retract_batch(values)
    }

    fn supports_retract_batch(&self) -> bool {
        self.inner.supports_retract_batch()
    }
}

/// A groups accumulator of `string_agg` whose text (all groups) is counted before it grows.
struct BoundedGroups {
    inner: Box<dyn GroupsAccumulator>,
    growth: Growth,
}

impl GroupsAccumulator for BoundedGroups {
    fn update_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        opt_filter: Option<&BooleanArray>,
        total_num_groups: usize,
    ) -> Result<()> {
        if let Some(first) = values.first() {
            self.growth.add(first)?;
        }
        self.inner
            .update_batch(values, group_indices, opt_filter, total_num_groups)
    }

    fn evaluate(&mut self, emit_to: EmitTo) -> Result<ArrayRef> {
        self.inner.evaluate(emit_to)
    }

    fn state(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        self.inner.state(emit_to)
    }

    fn merge_batch(
        &mut self,
        values: &[ArrayRef],
        group_indices: &[usize],
        total_num_groups: usize,
    ) -> Result<()> {
        if let Some(first) = values.first() {
            self.growth.add(first)?;
        }
        self.inner
            .merge_batch(values, group_indices, total_num_groups)
    }

    fn convert_to_state(
        &self,
        values: &[ArrayRef],
        opt_filter: Option<&BooleanArray>,
    ) -> Result<Vec<ArrayRef>> {
        self.inner.convert_to_state(values, opt_filter)
    }

    fn size(&self) -> usize {
        self.inner.size()
    }
}

/// `lag` or `lead`, whose default value may fill a share of the statement memory.
#[derive(Debug, PartialEq, Eq, Hash)]
struct BoundedShift {
    inner: Arc<WindowUDF>,
    limit: usize,
}

impl WindowUDFImpl for BoundedShift {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn signature(&self) -> &Signature {
        self.inner.signature()
    }

    fn expressions(
        &self,
        args: datafusion::logical_expr::function::ExpressionArgs,
    ) -> Vec<Arc<dyn PhysicalExpr>> {
        self.inner.expressions(args)
    }

    fn partition_evaluator(
        &self,
        args: PartitionEvaluatorArgs,
    ) -> Result<Box<dyn PartitionEvaluator>> {
        let default = args
            .input_exprs()
            .get(2)
            .and_then(|e| e.downcast_ref::<Literal>())
            .map_or(0, |l| scalar_bytes(l.value()));
        Ok(Box::new(BoundedShiftEvaluator {
            inner: self.inner.partition_evaluator_factory(args)?,
            default,
            rows: 0,
            limit: self.limit,
            name: self.inner.name().to_owned(),
        }))
    }

    fn field(&self, args: WindowUDFFieldArgs) -> Result<FieldRef> {
        self.inner.field(args)
    }

    fn sort_options(&self) -> Option<arrow_schema::SortOptions> {
        self.inner.sort_options()
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }

    fn reverse_expr(&self) -> ReversedUDWF {
        match self.inner.reverse_expr() {
            ReversedUDWF::Reversed(inner) => {
                ReversedUDWF::Reversed(Arc::new(WindowUDF::new_from_impl(BoundedShift {
                    inner,
                    limit: self.limit,
                })))
            }
            other => other,
        }
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }

    fn limit_effect(&self, args: &[Arc<dyn PhysicalExpr>]) -> LimitEffect {
        self.inner.inner().limit_effect(args)
    }
}

/// A `lag`/`lead` evaluator that counts the default values a partition can take before it
/// evaluates rows: as if every row it evaluates took the default (it takes it where the
/// offset reaches past the partition).
#[derive(Debug)]
struct BoundedShiftEvaluator {
    inner: Box<dyn PartitionEvaluator>,
    default: u128,
    /// Rows evaluated one by one so far.
    rows: u128,
    limit: usize,
    name: String,
}

impl BoundedShiftEvaluator {
    fn count(&mut self, rows: u128) -> Result<()> {
        self.rows = self.rows.saturating_add(rows);
        let bytes = self.default.saturating_mul(self.rows);
        if bytes > share(self.limit) {
            return Err(too_large(&self.name, bytes, self.limit));
        }
        Ok(())
    }
}

impl PartitionEvaluator for BoundedShiftEvaluator {
    fn memoize(
        &mut self,
        state: &mut datafusion::logical_expr::window_state::WindowAggState,
    ) -> Result<()> {
        self.inner.memoize(state)
    }

    fn get_range(&self, idx: usize, n_rows: usize) -> Result<std::ops::Range<usize>> {
        self.inner.get_range(idx, n_rows)
    }

    fn is_causal(&self) -> bool {
        self.inner.is_causal()
    }

    fn evaluate_all(&mut self, values: &[ArrayRef], num_rows: usize) -> Result<ArrayRef> {
        self.count(num_rows as u128)?;
        self.inner.evaluate_all(values, num_rows)
    }

    fn evaluate(
        &mut self,
        values: &[ArrayRef],
        range: &std::ops::Range<usize>,
    ) -> Result<ScalarValue> {
        self.count(1)?;
        self.inner.evaluate(values, range)
    }

    fn evaluate_all_with_rank(
        &self,
        num_rows: usize,
        ranks_in_partition: &[std::ops::Range<usize>],
    ) -> Result<ArrayRef> {
        self.inner
            .evaluate_all_with_rank(num_rows, ranks_in_partition)
    }

    fn supports_bounded_execution(&self) -> bool {
        self.inner.supports_bounded_execution()
    }

    fn uses_window_frame(&self) -> bool {
        self.inner.uses_window_frame()
    }

    fn include_rank(&self) -> bool {
        self.inner.include_rank()
    }
}
