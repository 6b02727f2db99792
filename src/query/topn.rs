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

use std::sync::Arc;

use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::union::UnionExec;
use datafusion::physical_plan::{ExecutionPlan, SortOrderPushdownResult};

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
