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
//! `guard::tests` lists by name.
//!
//! What an aggregate *emits* as a window function is another matter: it emits a value for
//! every row, over the row's frame, so an `array_agg` over a growing frame emits the whole
//! frame for every row (quadratic), and one over a whole partition emits its one value
//! repeated to every row. So every aggregate of the registry is registered wrapped
//! ([`charge_emitted`], [`Emitting`]): each value it emits is charged, before the window
//! operator collects it, to that operator's statement budget ([`WindowCharges`], set by
//! [`super::operator_memory`] while the operator runs): its values' bytes or the buffers it
//! holds beyond its inputs', whichever is more, times the rows given to it since the value
//! before (the rows a whole-partition window repeats it to). The charge lasts until the
//! operator emits the batch holding the values, which is charged instead. As an ordinary
//! aggregate (`GROUP BY`) the wrapper is the function it wraps.

use std::sync::Arc;

use arrow_array::{Array as _, ArrayRef, BooleanArray};
use arrow_schema::{DataType, FieldRef};
use datafusion::common::ScalarValue;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::MemoryReservation;
use datafusion::logical_expr::expr::{
    AggregateFunction, AggregateFunctionParams, WindowFunctionParams,
};
use datafusion::logical_expr::function::{
    AccumulatorArgs, AggregateFunctionSimplification, PartitionEvaluatorArgs, StateFieldsArgs,
    WindowUDFFieldArgs,
};
use datafusion::logical_expr::utils::AggregateOrderSensitivity;
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, Documentation, EmitTo, Expr, GroupsAccumulator,
    LimitEffect, Operator, PartitionEvaluator, ReversedUDAF, ReversedUDWF, SetMonotonicity,
    Signature, StatisticsArgs, WindowUDF, WindowUDFImpl,
};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Literal;
use datafusion::prelude::SessionContext;

use super::budget::StatementBudget;
use super::guard::{buffer_ranges, fresh_bytes, row_bytes, scalar_bytes};

/// The most input buffers an aggregate used as a window function remembers (see
/// [`EmittedCharged`]).
const MAX_INPUT_BUFFERS: usize = 64;

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

thread_local! {
    /// Where the aggregates of the window operator running on this thread now charge what
    /// they emit (see [`in_window`]).
    static WINDOW_CHARGES: std::cell::RefCell<Option<Arc<WindowCharges>>> =
        const { std::cell::RefCell::new(None) };
}

/// What the aggregates of one window operator have emitted and the operator has not yet
/// passed on: charged to its statement's budget until the operator emits the batch that
/// holds it (see [`super::operator_memory`]).
#[derive(Debug)]
pub(crate) struct WindowCharges {
    reservation: MemoryReservation,
}

impl WindowCharges {
    /// Charges to `budget`.
    pub(crate) fn new(budget: &StatementBudget) -> Result<Arc<WindowCharges>> {
        Ok(Arc::new(WindowCharges {
            reservation: budget.reserve("values emitted by window functions", 0)?,
        }))
    }

    /// The operator emitted what was charged (its output batch is charged instead).
    pub(crate) fn emitted(&self) {
        self.reservation.free();
    }
}

/// Runs `f` with `charges` as where the aggregates it creates or evaluates charge what they
/// emit (`None`: nowhere): a window operator's polls run with its charges, its input's
/// polls with none (see [`super::operator_memory`]).
pub(crate) fn in_window<T>(charges: Option<&Arc<WindowCharges>>, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<Arc<WindowCharges>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0.take();
            WINDOW_CHARGES.with(|c| *c.borrow_mut() = before);
        }
    }
    let _restore = Restore(WINDOW_CHARGES.with(|c| c.replace(charges.cloned())));
    f()
}

/// Registers every aggregate function of `ctx` wrapped in [`Emitting`], so that used as a
/// window function it charges what it emits (see the module docs).
pub(crate) fn charge_emitted(ctx: &mut SessionContext, limit: usize) {
    let state = ctx.state();
    let mut seen = std::collections::HashSet::new();
    let aggregates: Vec<Arc<AggregateUDF>> = state
        .aggregate_functions()
        .values()
        .filter(|f| seen.insert(f.name().to_owned()))
        .cloned()
        .collect();
    for inner in aggregates {
        ctx.register_udaf(AggregateUDF::new_from_impl(Emitting { inner, limit }));
    }
}

/// An aggregate function that, used as a window function, charges each value it emits to
/// its statement's budget (see the module docs). As an ordinary aggregate it is the
/// function it wraps.
#[derive(Debug, PartialEq, Eq, Hash)]
struct Emitting {
    inner: Arc<AggregateUDF>,
    limit: usize,
}

impl Emitting {
    fn wrap(&self, inner: Arc<AggregateUDF>) -> Arc<AggregateUDF> {
        Arc::new(AggregateUDF::new_from_impl(Emitting {
            inner,
            limit: self.limit,
        }))
    }

    fn charged(&self, inner: Box<dyn Accumulator>) -> Box<dyn Accumulator> {
        Box::new(EmittedCharged {
            inner,
            inputs: Vec::new(),
            counted: 0,
            limit: self.limit,
            rows: 0,
            name: self.inner.name().to_owned(),
        })
    }
}

impl AggregateUDFImpl for Emitting {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn aliases(&self) -> &[String] {
        self.inner.aliases()
    }

    fn schema_name(&self, params: &AggregateFunctionParams) -> Result<String> {
        self.inner.inner().schema_name(params)
    }

    fn human_display(&self, params: &AggregateFunctionParams) -> Result<String> {
        self.inner.inner().human_display(params)
    }

    fn window_function_schema_name(&self, params: &WindowFunctionParams) -> Result<String> {
        self.inner.inner().window_function_schema_name(params)
    }

    fn display_name(&self, params: &AggregateFunctionParams) -> Result<String> {
        self.inner.inner().display_name(params)
    }

    fn window_function_display_name(&self, params: &WindowFunctionParams) -> Result<String> {
        self.inner.inner().window_function_display_name(params)
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

    fn is_nullable(&self) -> bool {
        self.inner.is_nullable()
    }

    fn accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        Ok(self.charged(self.inner.accumulator(args)?))
    }

    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        self.inner.state_fields(args)
    }

    fn groups_accumulator_supported(&self, args: AccumulatorArgs) -> bool {
        self.inner.groups_accumulator_supported(args)
    }

    fn create_groups_accumulator(
        &self,
        args: AccumulatorArgs,
    ) -> Result<Box<dyn GroupsAccumulator>> {
        self.inner.create_groups_accumulator(args)
    }

    fn create_sliding_accumulator(&self, args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        Ok(self.charged(self.inner.create_sliding_accumulator(args)?))
    }

    fn with_beneficial_ordering(
        self: Arc<Self>,
        beneficial_ordering: bool,
    ) -> Result<Option<Arc<dyn AggregateUDFImpl>>> {
        let ordered =
            Arc::clone(self.inner.inner()).with_beneficial_ordering(beneficial_ordering)?;
        Ok(ordered.map(|inner| {
            Arc::new(Emitting {
                inner: Arc::new(AggregateUDF::new_from_shared_impl(inner)),
                limit: self.limit,
            }) as Arc<dyn AggregateUDFImpl>
        }))
    }

    fn order_sensitivity(&self) -> AggregateOrderSensitivity {
        self.inner.inner().order_sensitivity()
    }

    fn simplify(&self) -> Option<AggregateFunctionSimplification> {
        self.inner.simplify()
    }

    fn simplify_expr_op_literal(
        &self,
        agg_function: &AggregateFunction,
        arg: &Expr,
        op: Operator,
        lit: &Expr,
        arg_is_left: bool,
    ) -> Result<Option<Expr>> {
        self.inner
            .inner()
            .simplify_expr_op_literal(agg_function, arg, op, lit, arg_is_left)
    }

    fn reverse_expr(&self) -> ReversedUDAF {
        match self.inner.reverse_udf() {
            ReversedUDAF::Reversed(inner) => ReversedUDAF::Reversed(self.wrap(inner)),
            other => other,
        }
    }

    fn coerce_types(&self, arg_types: &[DataType]) -> Result<Vec<DataType>> {
        self.inner.coerce_types(arg_types)
    }

    fn is_descending(&self) -> Option<bool> {
        self.inner.is_descending()
    }

    fn value_from_stats(&self, statistics_args: &StatisticsArgs) -> Option<ScalarValue> {
        self.inner.value_from_stats(statistics_args)
    }

    fn default_value(&self, data_type: &DataType) -> Result<ScalarValue> {
        self.inner.default_value(data_type)
    }

    fn supports_null_handling_clause(&self) -> bool {
        self.inner.inner().supports_null_handling_clause()
    }

    fn supports_within_group_clause(&self) -> bool {
        self.inner.inner().supports_within_group_clause()
    }

    fn set_monotonicity(&self, data_type: &DataType) -> SetMonotonicity {
        self.inner.inner().set_monotonicity(data_type)
    }

    fn documentation(&self) -> Option<&Documentation> {
        self.inner.documentation()
    }
}

/// An accumulator that charges the values it emits (see the module docs): each value's
/// bytes, times the rows given to it since the value before (a window over a whole
/// partition repeats its one value to every row), to the window operator it runs in
/// ([`WindowCharges`]); outside one, to a share of the statement memory of its own.
#[derive(Debug)]
struct EmittedCharged {
    inner: Box<dyn Accumulator>,
    /// The buffers of the latest values given to it (distinct, at most
    /// [`MAX_INPUT_BUFFERS`]): what it emits may share them.
    inputs: Vec<(usize, usize)>,
    /// What was emitted outside a window operator.
    counted: u128,
    limit: usize,
    /// Rows given to the accumulator since it last emitted a value.
    rows: u128,
    name: String,
}

impl EmittedCharged {
    fn charge(&mut self, value: &ScalarValue) -> Result<()> {
        let rows = std::mem::take(&mut self.rows).max(1);
        // What the value holds: its values' bytes, or the buffers it holds that its inputs
        // do not, if more (a concatenation may copy more than it keeps).
        let arrays = match value {
            ScalarValue::List(a) => Some(a.to_data()),
            ScalarValue::LargeList(a) => Some(a.to_data()),
            ScalarValue::FixedSizeList(a) => Some(a.to_data()),
            ScalarValue::Struct(a) => Some(a.to_data()),
            ScalarValue::Map(a) => Some(a.to_data()),
            _ => None,
        };
        let fresh = arrays.map_or(0, |d| fresh_bytes(&d, &self.inputs) as u128);
        let bytes = scalar_bytes(value).max(fresh).saturating_mul(rows);
        match WINDOW_CHARGES.with(|c| c.borrow().clone()) {
            Some(charges) => charges
                .reservation
                .try_grow(usize::try_from(bytes).unwrap_or(usize::MAX))
                .map_err(|e| match e.find_root() {
                    DataFusionError::ResourcesExhausted(m) => DataFusionError::ResourcesExhausted(
                        format!("{} emits more than its statement may hold: {m}", self.name),
                    ),
                    _ => e,
                }),
            None => {
                self.counted = self.counted.saturating_add(bytes);
                if self.counted > share(self.limit) {
                    return Err(too_large(&self.name, self.counted, self.limit));
                }
                Ok(())
            }
        }
    }
}

impl Accumulator for EmittedCharged {
    fn update_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        let rows = values.first().map_or(0, |v| v.len());
        self.rows = self.rows.saturating_add(rows as u128);
        for range in values.iter().flat_map(|v| buffer_ranges(&v.to_data())) {
            if !self.inputs.contains(&range) {
                if self.inputs.len() >= MAX_INPUT_BUFFERS {
                    self.inputs.remove(0);
                }
                self.inputs.push(range);
            }
        }
        self.inner.update_batch(values)
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        let value = self.inner.evaluate()?;
        self.charge(&value)?;
        Ok(value)
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        self.inner.state()
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        self.inner.merge_batch(states)
    }

    fn retract_batch(&mut self, values: &[ArrayRef]) -> Result<()> {
        self.inner.retract_batch(values)
    }

    fn supports_retract_batch(&self) -> bool {
        self.inner.supports_retract_batch()
    }
}
