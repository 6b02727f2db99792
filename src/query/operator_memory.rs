//! What operators emit, held to the statement's memory budget: the operators whose output
//! is not their input's rows but copies of them, repeated.
//!
//! A join copies a build row into every output row it pairs with: a cross join emits, for
//! each build row, that row repeated as many times as a probe batch has rows (a 60 MB list
//! from a subquery, 8192 times a batch), and a hash or nested-loop join copies build rows
//! into output batches of up to the configured batch size. A window operator emits, for
//! each row, its aggregate over the row's frame, which can hold the whole frame (an
//! `array_agg` over a growing frame is quadratic). None of that is an operator's own
//! reservation, so DataFusion's memory pool does not see it, and it is built inside one
//! poll.
//!
//! [`BoundOperatorOutput`] (a physical optimizer rule, run last) puts [`BoundedExec`] nodes
//! around them:
//!
//! - **Joins** (cross, nested-loop, hash): the build side passes through a node that
//!   measures its widest row ([`Role::Build`]); the probe side through one that cuts its
//!   batches to as many rows as, paired with the widest build row, fit in a share of the
//!   statement's memory ([`Role::Probe`]; at least one row), and that stops the statement
//!   there once it was cancelled or timed out; and each output batch is charged to the
//!   statement's budget for as long as its buffers live ([`Role::Output`]), or refused.
//!   A build row is copied at most once per probe row it pairs with, so an output batch of a
//!   cross join is at most that share; one of a hash join at most its probe rows times the
//!   build rows each matches (the build side, charged by the join itself) times their width.
//! - **Windows**: the operator's polls run with its statement's budget, which every
//!   aggregate used as a window function charges the values it emits to
//!   ([`super::bounded_aggregates::in_window`]); its input's polls run without it
//!   ([`Role::WindowInput`]), so aggregates of the input (a `GROUP BY` under the window) are
//!   charged as DataFusion charges them.
//!
//! Invariant: every join and window operator of a statement's physical plan is wrapped so
//! (the rule runs after every other physical optimizer rule); outside a statement (no budget
//! in the task's configuration) the nodes pass batches through unchanged.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use arrow_array::{Array as _, RecordBatch};
use arrow_schema::SchemaRef;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{RecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::joins::{CrossJoinExec, HashJoinExec, NestedLoopJoinExec};
use datafusion::physical_plan::windows::{BoundedWindowAggExec, WindowAggExec};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, SendableRecordBatchStream,
};
use futures::Stream;

use super::bounded_aggregates::{WindowCharges, in_window, share};
use super::budget::{BudgetOption, StatementBudget};
use super::grouping::recompute;
use super::guard::{buffer_ranges, fresh_bytes, hold_batch, row_bytes};

/// What a [`BoundedExec`] does with the batches it passes on.
#[derive(Debug, Clone)]
pub(crate) enum Role {
    /// A join's build side: records the widest row's bytes in the shared width.
    Build(Arc<AtomicUsize>),
    /// A join's probe side: cuts batches to what fits beside the widest build row.
    Probe(Arc<AtomicUsize>),
    /// A join's output: each batch charged while it lives.
    Output,
    /// A window operator whose output is its input's this many columns and then the
    /// windows': polled with where its aggregates charge what they emit.
    Window(usize),
    /// A window operator's input: polled without it.
    WindowInput,
}

/// The physical optimizer rule that wraps joins and windows (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct BoundOperatorOutput;

impl PhysicalOptimizerRule for BoundOperatorOutput {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let join = node.downcast_ref::<CrossJoinExec>().is_some()
                || node.downcast_ref::<NestedLoopJoinExec>().is_some()
                || node.downcast_ref::<HashJoinExec>().is_some();
            let window = node.downcast_ref::<BoundedWindowAggExec>().is_some()
                || node.downcast_ref::<WindowAggExec>().is_some();
            if join {
                let children = node.children();
                let [build, probe] = children.as_slice() else {
                    return Ok(Transformed::no(node));
                };
                let width = Arc::new(AtomicUsize::new(0));
                let build = BoundedExec::wrap(Arc::clone(build), Role::Build(Arc::clone(&width)));
                let probe = BoundedExec::wrap(Arc::clone(probe), Role::Probe(width));
                let join = Arc::clone(&node).replace_children(vec![build, probe], recompute())?;
                Ok(Transformed::yes(BoundedExec::wrap(join, Role::Output)))
            } else if window {
                let input_columns = node
                    .children()
                    .first()
                    .map_or(0, |c| c.schema().fields().len());
                let inputs = node
                    .children()
                    .into_iter()
                    .map(|c| BoundedExec::wrap(Arc::clone(c), Role::WindowInput))
                    .collect();
                let window = Arc::clone(&node).replace_children(inputs, recompute())?;
                Ok(Transformed::yes(BoundedExec::wrap(
                    window,
                    Role::Window(input_columns),
                )))
            } else {
                Ok(Transformed::no(node))
            }
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "sluice_bound_operator_output"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// A node that passes its input's batches on in its [`Role`] (see the module docs).
#[derive(Debug)]
pub(crate) struct BoundedExec {
    input: Arc<dyn ExecutionPlan>,
    role: Role,
}

impl BoundedExec {
    fn wrap(input: Arc<dyn ExecutionPlan>, role: Role) -> Arc<dyn ExecutionPlan> {
        Arc::new(BoundedExec { input, role })
    }
}

impl DisplayAs for BoundedExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let role = match self.role {
            Role::Build(_) => "build",
            Role::Probe(_) => "probe",
            Role::Output => "output",
            Role::Window(_) => "window",
            Role::WindowInput => "window input",
        };
        write!(f, "BoundedExec: {role}")
    }
}

impl ExecutionPlan for BoundedExec {
    fn name(&self) -> &str {
        "BoundedExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
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
            .map_err(|_| DataFusionError::Internal("a bounded node has one child".into()))?;
        Ok(BoundedExec::wrap(input, self.role.clone()))
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let budget = BudgetOption::of(context.session_config().options()).cloned();
        let charges = match (&self.role, &budget) {
            (Role::Window(_), Some(budget)) => Some(WindowCharges::new(budget)?),
            _ => None,
        };
        let input = match self.role {
            Role::Window(_) => {
                in_window(charges.as_ref(), || self.input.execute(partition, context))?
            }
            Role::WindowInput => in_window(None, || self.input.execute(partition, context))?,
            _ => self.input.execute(partition, context)?,
        };
        Ok(Box::pin(BoundedStream {
            schema: input.schema(),
            input,
            role: self.role.clone(),
            budget,
            charges,
            cutting: None,
        }))
    }
}

/// The stream of a [`BoundedExec`].
struct BoundedStream {
    schema: SchemaRef,
    input: SendableRecordBatchStream,
    role: Role,
    budget: Option<Arc<StatementBudget>>,
    /// A window operator's: what its aggregates emitted and it has not passed on.
    charges: Option<Arc<WindowCharges>>,
    /// A probe batch being cut: the batch, the next row, the rows of each cut.
    cutting: Option<(RecordBatch, usize, usize)>,
}

impl BoundedStream {
    /// The next cut of the probe batch being cut, if any.
    fn next_cut(&mut self) -> Option<Result<RecordBatch>> {
        let (batch, next, rows) = self.cutting.as_mut()?;
        if let Some(budget) = &self.budget
            && let Err(e) = budget.checkpoint()
        {
            self.cutting = None;
            return Some(Err(e));
        }
        let cut = batch.slice(*next, (*rows).min(batch.num_rows() - *next));
        *next += cut.num_rows();
        if *next >= batch.num_rows() {
            self.cutting = None;
        }
        Some(Ok(cut))
    }

    /// What the role does with a batch of the input.
    fn pass(&mut self, batch: RecordBatch) -> Option<Result<RecordBatch>> {
        let Some(budget) = &self.budget else {
            return Some(Ok(batch));
        };
        match &self.role {
            Role::Build(width) => {
                width.fetch_max(widest_row(&batch), Ordering::AcqRel);
                Some(Ok(batch))
            }
            Role::Probe(width) => {
                let row = width
                    .load(Ordering::Acquire)
                    .saturating_add(widest_row(&batch));
                let rows = usize::try_from(share(budget.limit()))
                    .unwrap_or(usize::MAX)
                    .checked_div(row)
                    .unwrap_or(usize::MAX)
                    .max(1);
                if batch.num_rows() <= rows {
                    return Some(Ok(batch));
                }
                self.cutting = Some((batch, 0, rows));
                self.next_cut()
            }
            Role::Output | Role::Window(_) => {
                // What a window's aggregates emitted is in this batch's window columns now:
                // they are charged instead (its other columns are its input's rows).
                let own = match self.role {
                    Role::Window(input_columns) => input_columns,
                    _ => 0,
                };
                if let Some(charges) = &self.charges {
                    charges.emitted();
                }
                // Buffers are counted once, and a window's columns without what they share
                // with its input's.
                let inputs: Vec<(usize, usize)> = batch
                    .columns()
                    .iter()
                    .take(own)
                    .flat_map(|c| buffer_ranges(&c.to_data()))
                    .collect();
                let bytes = batch
                    .columns()
                    .iter()
                    .skip(own)
                    .map(|c| fresh_bytes(&c.to_data(), &inputs))
                    .fold(0usize, usize::saturating_add);
                Some(
                    budget
                        .reserve("operator output", bytes)
                        .and_then(|reservation| hold_batch(batch, reservation)),
                )
            }
            Role::WindowInput => Some(Ok(batch)),
        }
    }
}

/// The bytes of the widest row of `batch`: each column's widest value, added.
fn widest_row(batch: &RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|column| {
            let rows = column.len();
            if rows == 0 {
                return 0;
            }
            if column.data_type().is_primitive() || column.data_type().is_null() {
                return (column.get_array_memory_size() / rows) as u128;
            }
            (0..rows)
                .map(|row| row_bytes(column.as_ref(), row))
                .max()
                .unwrap_or(0)
        })
        .fold(0u128, u128::saturating_add)
        .try_into()
        .unwrap_or(usize::MAX)
}

impl Stream for BoundedStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(cut) = this.next_cut() {
            return Poll::Ready(Some(cut));
        }
        let polled = match this.role {
            Role::Window(_) => {
                in_window(this.charges.as_ref(), || this.input.as_mut().poll_next(cx))
            }
            Role::WindowInput => in_window(None, || this.input.as_mut().poll_next(cx)),
            _ => this.input.as_mut().poll_next(cx),
        };
        match polled {
            Poll::Ready(Some(Ok(batch))) => Poll::Ready(this.pass(batch)),
            other => other,
        }
    }
}

impl RecordBatchStream for BoundedStream {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }
}
