//! Top-N queries over flushed files and unflushed batches read the most promising files first.
//!
//! DataFusion's sort pushdown tells a Parquet scan under a top-N (`ORDER BY time DESC LIMIT
//! 20`) the order asked for, and the scan then reads its ranges and row groups in the order of
//! their statistics (see `provider::ScanRange::statistics`): the newest first, so the top-N's
//! threshold is soon past every other range, whose row groups are skipped when it is opened.
//! The pushdown stops at a union, and a table with unflushed rows is scanned as the union of
//! its files and its batches; on a live table, the case people ask "what came in last" of,
//! the files were read oldest first.
//!
//! [`UnionTopN`] hands the order on to each scan under a top-N's union. The hint only orders
//! what is read: the sort stays, so the answer is the same whatever the hint does.
//!
//! Within a row group the rows come oldest first (files keep each row group in time order),
//! and a top-N of the newest then finds every row of a batch past its threshold: it converts each
//! to its row format and tries it against its heap (on the query bench's "latest 20" over
//! 100 MB, 100 thousand replacements took 19 of its 20 milliseconds). [`BatchTopN`] puts a
//! [`BatchTopNExec`] under such a top-N: of each batch it passes on only the rows that can
//! be among the top N, those at or before the batch's own N-th row by the first sort key (a
//! row after it has N rows of its batch before it in the sort's order). One partial sort of
//! one column per batch, and the top-N sees about N rows of each.
//!
//! Only batches that come in the sort's order are thinned: where rows come in no order (or
//! the first key ties), the top-N's own threshold already drops nearly every row with one
//! vectorized comparison, and a partial sort per batch made such queries several times
//! slower. A batch counts as coming in the sort's order when, of 16
//! steps between 17 rows spread evenly over it, at least 12 go strictly forward in the sort's
//! order (ascending times under `ORDER BY time DESC` go forward at every step; random keys at
//! about half).
//!
//! The rows dropped cannot be in the answer, and those kept keep their order: the answer is
//! the same.
//!

use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

use arrow_array::{BooleanArray, RecordBatch};
use arrow_schema::SortOptions;
use arrow_select::filter::filter_record_batch;
use datafusion::arrow::array::make_comparator;
use datafusion::arrow::compute::sort_to_indices;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::metrics::{
    BaselineMetrics, ExecutionPlanMetricsSet, MetricsSet, RecordOutput as _,
};
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties as _, PlanProperties,
    SendableRecordBatchStream, SortOrderPushdownResult,
};
use futures::StreamExt as _;

use super::grouping::recompute;

/// The physical optimizer rule that passes a top-N's order through a union to the scans
/// under it (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct UnionTopN;

impl PhysicalOptimizerRule for UnionTopN {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(sort) = node.downcast_ref::<SortExec>() else {
                return Ok(Transformed::no(node));
            };
            if sort.fetch().is_none() {
                return Ok(Transformed::no(node));
            }
            let Some(union) = sort.input().downcast_ref::<UnionExec>() else {
                return Ok(Transformed::no(node));
            };
            let mut changed = false;
            let mut children = Vec::with_capacity(union.inputs().len());
            for child in union.inputs() {
                let hinted = if child.downcast_ref::<DataSourceExec>().is_some() {
                    // A union's inputs share its schema, so the sort's expressions apply
                    // to each as they stand.
                    match child.try_pushdown_sort(sort.expr())? {
                        SortOrderPushdownResult::Inexact { inner } => Some(inner),
                        // Exact would let the sort go; it stays, and the hint is not needed.
                        SortOrderPushdownResult::Exact { .. }
                        | SortOrderPushdownResult::Unsupported => None,
                    }
                } else {
                    None
                };
                changed |= hinted.is_some();
                children.push(hinted.unwrap_or_else(|| child.clone()));
            }
            if !changed {
                return Ok(Transformed::no(node));
            }
            let union = sort
                .input()
                .clone()
                .replace_children(children, recompute())?;
            Ok(Transformed::yes(
                node.clone().replace_children(vec![union], recompute())?,
            ))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "sluice_union_top_n"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The physical optimizer rule that thins a top-N's input batch by batch (see the module
/// documentation): under every sort with a fetch whose first key is a column and whose input
/// has no order the sort could rely on, it puts a [`BatchTopNExec`].
#[derive(Debug, Default)]
pub(crate) struct BatchTopN;

impl PhysicalOptimizerRule for BatchTopN {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(sort) = node.downcast_ref::<SortExec>() else {
                return Ok(Transformed::no(node));
            };
            // A top-N only; not one over ordered input, which may stop early on that
            // order, nor one already thinned.
            let Some(fetch) = sort.fetch().filter(|f| *f > 0) else {
                return Ok(Transformed::no(node));
            };
            if sort.input().output_ordering().is_some()
                || sort.input().downcast_ref::<BatchTopNExec>().is_some()
            {
                return Ok(Transformed::no(node));
            }
            let first = sort.expr().first();
            let Some(column) = first.expr.downcast_ref::<Column>() else {
                return Ok(Transformed::no(node));
            };
            let input = Arc::new(BatchTopNExec::new(
                sort.input().clone(),
                column.index(),
                first.options,
                fetch,
            )?);
            Ok(Transformed::yes(
                node.clone().replace_children(vec![input], recompute())?,
            ))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "sluice_batch_top_n"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Passes on, of each batch of its input, the rows at or before the batch's `fetch`-th in
/// the order `options` gives column `column` (all of a batch of at most `fetch` rows), in
/// the order they came.
#[derive(Debug)]
pub(crate) struct BatchTopNExec {
    input: Arc<dyn ExecutionPlan>,
    column: usize,
    options: SortOptions,
    fetch: usize,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl BatchTopNExec {
    fn new(
        input: Arc<dyn ExecutionPlan>,
        column: usize,
        options: SortOptions,
        fetch: usize,
    ) -> Result<Self> {
        if column >= input.schema().fields().len() || fetch == 0 {
            return Err(DataFusionError::Internal(format!(
                "a batch top-{fetch} by column {column} does not fit its input"
            )));
        }
        let properties = PlanProperties::new(
            // Rows are dropped, none changed: what held of the input's columns holds.
            input.equivalence_properties().clone(),
            input.output_partitioning().clone(),
            input.pipeline_behavior(),
            input.boundedness(),
        );
        Ok(BatchTopNExec {
            input,
            column,
            options,
            fetch,
            properties: Arc::new(properties),
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }
}

/// How many steps between rows spread over a batch [`batch_top`] looks at.
const SAMPLE_STEPS: usize = 16;

/// How many of those steps must go forward in the sort's order for a batch to be thinned.
const FORWARD_STEPS_TO_THIN: usize = 12;

/// The rows of `batch` at or before its `fetch`-th (`fetch` > 0) in the order `options` gives
/// column `column`, in the order they came; all of it when it has at most `fetch` rows, does
/// not come in the sort's order (see the module documentation) or its column cannot be
/// sorted.
fn batch_top(
    batch: RecordBatch,
    column: usize,
    options: SortOptions,
    fetch: usize,
) -> Result<RecordBatch> {
    let rows = batch.num_rows();
    if rows <= fetch {
        return Ok(batch);
    }
    let key = batch.column(column);
    let Ok(compare) = make_comparator(key.as_ref(), key.as_ref(), options) else {
        return Ok(batch);
    };
    // Rows spread over the batch, and how many steps between them go forward (strictly
    // before, in the sort's order): a batch in no order goes forward about half the time.
    let samples: Vec<usize> = (0..=SAMPLE_STEPS)
        .map(|k| k * (rows - 1) / SAMPLE_STEPS)
        .collect();
    let forward = samples
        .windows(2)
        .filter(|pair| compare(pair[1], pair[0]) == Ordering::Less)
        .count();
    if forward < FORWARD_STEPS_TO_THIN {
        return Ok(batch);
    }
    let Ok(best) = sort_to_indices(key, Some(options), Some(fetch)) else {
        return Ok(batch);
    };
    let Some(nth) = best.values().get(fetch - 1).map(|i| *i as usize) else {
        return Ok(batch);
    };
    let keep: BooleanArray = (0..rows)
        .map(|i| Some(compare(i, nth) != Ordering::Greater))
        .collect();
    Ok(filter_record_batch(&batch, &keep)?)
}

impl DisplayAs for BatchTopNExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let schema = self.input.schema();
        let field = schema.field(self.column).name();
        match t {
            DisplayFormatType::TreeRender => {
                write!(f, "key={field} {}\nfetch={}", self.options, self.fetch)
            }
            _ => write!(
                f,
                "BatchTopNExec: fetch={}, key={field} {}",
                self.fetch, self.options
            ),
        }
    }
}

impl ExecutionPlan for BatchTopNExec {
    fn name(&self) -> &str {
        "BatchTopNExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [input] = <[_; 1]>::try_from(children)
            .map_err(|_| DataFusionError::Internal("a batch top-N has one child".into()))?;
        Ok(Arc::new(BatchTopNExec::new(
            input,
            self.column,
            self.options,
            self.fetch,
        )?))
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        // Rows are dropped, the rest pass on in the order they came.
        vec![true]
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let schema = input.schema();
        let baseline = BaselineMetrics::new(&self.metrics, partition);
        let (column, options, fetch) = (self.column, self.options, self.fetch);
        let output = input.map(move |batch| {
            let _timer = baseline.elapsed_compute().timer();
            Ok(batch_top(batch?, column, options, fetch)?.record_output(&baseline))
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, output)))
    }
}

#[cfg(test)]
mod tests {
    use arrow_array::{ArrayRef, Int64Array, StringArray};
    use arrow_schema::{DataType, Field, Schema};

    use super::*;

    /// A batch of `rows` rows: `key`, an int with many repeats and some nulls, and `id`, the
    /// row's position (unique).
    fn batch(rows: usize, seed: u64) -> RecordBatch {
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let keys: Vec<Option<i64>> = (0..rows)
            .map(|_| match next() % 10 {
                0 => None,
                n => Some(i64::try_from(next() % (1 + n * 3)).unwrap_or(0)),
            })
            .collect();
        let schema = Arc::new(Schema::new(vec![
            Field::new("key", DataType::Int64, true),
            Field::new("id", DataType::Utf8, false),
        ]));
        let ids: Vec<String> = (0..rows).map(|i| format!("{i:06}")).collect();
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(keys)),
            Arc::new(StringArray::from(ids)),
        ];
        RecordBatch::try_new(schema, columns).unwrap()
    }

    /// The `fetch` first ids of `batch` in the order of `key` (by `options`), then `id`.
    fn top_ids(batch: &RecordBatch, options: SortOptions, fetch: usize) -> Vec<String> {
        let key = batch.column(0);
        let id = batch.column(1);
        let by_key = make_comparator(key.as_ref(), key.as_ref(), options).unwrap();
        let by_id = make_comparator(id.as_ref(), id.as_ref(), SortOptions::default()).unwrap();
        let mut rows: Vec<usize> = (0..batch.num_rows()).collect();
        rows.sort_by(|a, b| by_key(*a, *b).then(by_id(*a, *b)));
        let ids = id.as_any().downcast_ref::<StringArray>().unwrap();
        rows.iter()
            .take(fetch)
            .map(|r| ids.value(*r).to_owned())
            .collect()
    }

    /// `batch` with its rows in the reverse of `options`' order by `key` (so each row comes
    /// before the ones ahead of it in the sort's order), ids renumbered in the new order.
    fn coming_in_order(batch: &RecordBatch, options: SortOptions) -> RecordBatch {
        let reverse = SortOptions {
            descending: !options.descending,
            nulls_first: !options.nulls_first,
        };
        let order = sort_to_indices(batch.column(0), Some(reverse), None).unwrap();
        let key = arrow_select::take::take(batch.column(0), &order, None).unwrap();
        let ids: Vec<String> = (0..batch.num_rows()).map(|i| format!("{i:06}")).collect();
        RecordBatch::try_new(batch.schema(), vec![key, Arc::new(StringArray::from(ids))]).unwrap()
    }

    /// Whatever the order the rows come in, nulls, ties at the `fetch`-th row and batch
    /// size, the rows kept hold the batch's top `fetch` by every sort key, in the order they
    /// came.
    #[test]
    fn the_rows_kept_hold_the_top_n_in_their_order() {
        for seed in 0..40u64 {
            let rows = [0, 1, 5, 64, 1_000][seed as usize % 5];
            let random = batch(rows, seed);
            for descending in [false, true] {
                for nulls_first in [false, true] {
                    let options = SortOptions {
                        descending,
                        nulls_first,
                    };
                    for input in [random.clone(), coming_in_order(&random, options)] {
                        for fetch in [1, 3, 10, 50, 2_000] {
                            let kept = batch_top(input.clone(), 0, options, fetch).unwrap();
                            assert_eq!(
                                top_ids(&kept, options, fetch),
                                top_ids(&input, options, fetch),
                                "seed {seed}, {options:?}, fetch {fetch}"
                            );
                            let ids = kept.column(1).as_any().downcast_ref::<StringArray>();
                            let ids: Vec<&str> = ids.unwrap().iter().flatten().collect();
                            assert!(ids.is_sorted(), "the rows kept changed order");
                        }
                    }
                }
            }
        }
    }

    /// A batch that comes in the sort's order is thinned to its top rows; one in the
    /// opposite order, or with one key throughout, is passed on whole (the top-N's own
    /// threshold drops its rows more cheaply).
    #[test]
    fn only_batches_coming_in_the_sorts_order_are_thinned() {
        let schema = Arc::new(Schema::new(vec![Field::new("key", DataType::Int64, true)]));
        let make = |keys: Vec<i64>| {
            RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(keys))]).unwrap()
        };
        let rising = make((0..1_000).collect());
        let flat = make(vec![7; 1_000]);
        let newest_first = SortOptions {
            descending: true,
            nulls_first: true,
        };
        let kept = batch_top(rising.clone(), 0, newest_first, 20).unwrap();
        let keys = kept
            .column(0)
            .as_any()
            .downcast_ref::<Int64Array>()
            .unwrap();
        assert_eq!(keys.values().to_vec(), (980..1_000).collect::<Vec<i64>>());
        let oldest_first = SortOptions::default();
        assert_eq!(
            batch_top(rising, 0, oldest_first, 20).unwrap().num_rows(),
            1_000
        );
        assert_eq!(
            batch_top(flat, 0, newest_first, 20).unwrap().num_rows(),
            1_000
        );
    }
}
