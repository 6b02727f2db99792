//! Page pruning for filters that name several columns.
//!
//! DataFusion prunes Parquet pages only with predicates on a single column, because pages of
//! different columns need not line up. A filter such as the one a top-N query pushes into
//! the scan while it runs (`ORDER BY latency DESC, time LIMIT 10` gives
//! `latency > 1999.9 OR latency = 1999.9 AND time < t`) names two columns, so it prunes
//! nothing below the row group: every page of every column is decoded, though the threshold
//! is soon beyond all but a few pages' maximum.
//!
//! [`ColumnPruning`] adds to each scan, for every multi-column conjunct of its predicate and
//! every column that conjunct names, the weaker single-column predicate that the conjunct
//! implies ([`implied_on`]); for the filter above, `latency > 1999.9 OR latency = 1999.9`.
//! A conjunct that changes while the query runs (a dynamic filter) is wrapped in
//! [`ImpliedOn`], which derives the implied predicate from the conjunct's current value each
//! time the scan takes a snapshot of it (once per file it opens).
//!
//! The added predicates only ever keep more rows than the conjunct they come from, so the
//! answer does not change: they serve pruning, and rows are still filtered by the plan.
//!
//! It also takes out of each scan's predicate the conjuncts with a cast not known to keep
//! order ([`casts_out_of_order`]). DataFusion prunes through a cast by casting a column's
//! bounds, which holds only for casts that keep order; a timestamp's time of day does not
//! (a row group from 23:00 one day to 01:00 the next has the cast bounds 23:00 and 01:00,
//! and `CAST(time AS TIME) > '12:00'` dropped it with its rows at 23:00). The plan still
//! filters by them (the table's filters are inexact, a top-N sorts what it is given).
//!
//! Before that it turns a comparison of an interval column with an `INTERVAL` literal into
//! one of the column with a `Duration` ([`duration_comparison`]). The planner compares a
//! `Duration` column with `INTERVAL '90 seconds'` by casting the column to an
//! `Interval(MonthDayNano)`, a cast that prunes nothing (and is not known to keep order in
//! general); with no months and no days in the literal the comparison is exactly the one of
//! the nanoseconds, which prunes like any integer column's.
//!
//! And it drops the statistics of a scan's ranges when the scan's predicate does not change
//! while the query runs. They are there for top-N scans (`provider::ScanRange::statistics`);
//! with a fixed predicate their use was a pruning predicate DataFusion built, at some
//! tens of microseconds, each time it opened a range, to test the range's time bounds,
//! which the table's scan had tested when it chose the ranges. Row groups and pages are
//! still pruned with the file's own statistics.

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{DataType, Schema};
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfig, FileSource, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::logical_expr::{ColumnarValue, Operator};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::{BinaryExpr, CastExpr, Column, Literal, TryCastExpr};
use datafusion::physical_expr::utils::{collect_columns, conjunction, split_conjunction};
use datafusion::physical_expr_common::physical_expr::snapshot_physical_expr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;

/// The physical optimizer rule that adds implied single-column predicates to Parquet scans
/// (see the module documentation). It runs after DataFusion's rules, when the filters of
/// top-N operators have been pushed into the scans.
#[derive(Debug, Default)]
pub(crate) struct ColumnPruning;

impl PhysicalOptimizerRule for ColumnPruning {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(exec) = node.downcast_ref::<DataSourceExec>() else {
                return Ok(Transformed::no(node));
            };
            let Some(config) = exec.data_source().downcast_ref::<FileScanConfig>() else {
                return Ok(Transformed::no(node));
            };
            let Some(parquet) = config.file_source.downcast_ref::<ParquetSource>() else {
                return Ok(Transformed::no(node));
            };
            let Some(predicate) = parquet.filter() else {
                return Ok(Transformed::no(node));
            };
            let table_schema = parquet.table_schema().table_schema().as_ref();
            let conjuncts = split_conjunction(&predicate);
            let count = conjuncts.len();
            let mut kept = Vec::with_capacity(count);
            let mut rewritten = false;
            for conjunct in conjuncts {
                let conjunct = duration_comparison(conjunct, table_schema)?;
                rewritten |= conjunct.transformed;
                if !casts_out_of_order(&conjunct.data, table_schema)? {
                    kept.push(conjunct.data);
                }
            }
            let stripped = kept.len() != count || rewritten;
            let predicate = if stripped {
                conjunction(kept)
            } else {
                predicate
            };
            let implied = implied_conjuncts(&predicate)?;
            // Statistics of ranges serve a scan whose predicate changes as it runs (a
            // top-N's: see `provider::ScanRange::statistics`). Under a predicate that does
            // not, they only make each range's opening build a pruning predicate to test
            // the range's time bounds, which the table's scan tested already.
            let static_statistics = !is_dynamic(&predicate)?
                && (config.file_groups.iter()).any(|g| g.iter().any(|f| f.statistics.is_some()));
            if implied.is_empty() && !stripped && !static_statistics {
                return Ok(Transformed::no(node));
            }
            let predicate = conjunction(std::iter::once(predicate).chain(implied));
            let mut config = config.clone();
            if static_statistics {
                config.file_groups = (config.file_groups.iter())
                    .map(|group| {
                        let files = group.iter().cloned().map(|mut file| {
                            file.statistics = None;
                            file
                        });
                        FileGroup::new(files.collect())
                    })
                    .collect();
            }
            config.file_source = Arc::new(parquet.with_predicate(predicate));
            let exec = exec.clone().with_data_source(Arc::new(config));
            Ok(Transformed::yes(Arc::new(exec) as Arc<dyn ExecutionPlan>))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "sluice_column_pruning"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// `expr` with each comparison of a nanosecond `Duration` column cast to
/// `Interval(MonthDayNano)` with an interval literal of no months and no days turned into
/// the comparison of the column with that many nanoseconds as a `Duration`. The cast gives
/// `(0 months, 0 days, n nanoseconds)`, and intervals compare month, then day, then
/// nanosecond, so the two comparisons agree on every row (nulls included).
fn duration_comparison(
    expr: &Arc<dyn PhysicalExpr>,
    schema: &Schema,
) -> Result<Transformed<Arc<dyn PhysicalExpr>>> {
    use arrow_schema::{IntervalUnit, TimeUnit};
    let duration_column = |e: &Arc<dyn PhysicalExpr>| -> Result<Option<Arc<dyn PhysicalExpr>>> {
        let Some(cast) = e.downcast_ref::<CastExpr>() else {
            return Ok(None);
        };
        let column = cast.expr();
        let from_duration = column.downcast_ref::<Column>().is_some()
            && column.data_type(schema)? == DataType::Duration(TimeUnit::Nanosecond);
        let to_interval = cast.cast_type() == &DataType::Interval(IntervalUnit::MonthDayNano);
        Ok((from_duration && to_interval).then(|| Arc::clone(column)))
    };
    let nanoseconds = |e: &Arc<dyn PhysicalExpr>| -> Option<Arc<dyn PhysicalExpr>> {
        match e.downcast_ref::<Literal>()?.value() {
            ScalarValue::IntervalMonthDayNano(Some(v)) if v.months == 0 && v.days == 0 => {
                Some(Arc::new(Literal::new(ScalarValue::DurationNanosecond(
                    Some(v.nanoseconds),
                ))))
            }
            _ => None,
        }
    };
    Arc::clone(expr).transform_up(|e| {
        let Some(binary) = e.downcast_ref::<BinaryExpr>() else {
            return Ok(Transformed::no(e));
        };
        let comparison = matches!(
            binary.op(),
            Operator::Eq
                | Operator::NotEq
                | Operator::Lt
                | Operator::LtEq
                | Operator::Gt
                | Operator::GtEq
        );
        if !comparison {
            return Ok(Transformed::no(e));
        }
        let (left, right) = (binary.left(), binary.right());
        let operands = match (duration_column(left)?, duration_column(right)?) {
            (Some(column), None) => nanoseconds(right).map(|value| (column, value)),
            (None, Some(column)) => nanoseconds(left).map(|value| (value, column)),
            _ => None,
        };
        Ok(match operands {
            Some((l, r)) => {
                let rewritten: Arc<dyn PhysicalExpr> =
                    Arc::new(BinaryExpr::new(l, *binary.op(), r));
                Transformed::yes(rewritten)
            }
            None => Transformed::no(e),
        })
    })
}

/// Whether pruning with `expr` may drop rows it matches: somewhere in it (or in the
/// expressions a dynamic filter is built on) a value is cast in a way not known to keep
/// order ([`keeps_order`]; the types are those of `schema`, the scan's table schema, and a
/// cast whose input type cannot be told counts as one that does not keep it).
fn casts_out_of_order(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Result<bool> {
    let mut found = false;
    expr.apply(|e| {
        let cast = if let Some(cast) = e.downcast_ref::<CastExpr>() {
            Some((cast.expr(), cast.cast_type()))
        } else {
            e.downcast_ref::<TryCastExpr>()
                .map(|cast| (cast.expr(), cast.cast_type()))
        };
        if let Some((input, to)) = cast {
            found = input
                .data_type(schema)
                .map_or(true, |from| !keeps_order(&from, to));
        }
        Ok(if found {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    })?;
    Ok(found)
}

/// Whether a cast from `from` to `to` keeps the order of values, or makes those it cannot
/// represent null (which prunes nothing): the casts DataFusion may prune through by casting
/// a column's bounds. Not a time of day (23:00 one day, 01:00 the next), not a number as a
/// boolean (-5 and 5 are true, 0 false), not a timestamp as a date in a named time zone (a
/// local date goes back where clocks fall back across midnight), nor anything else not
/// listed here.
fn keeps_order(from: &DataType, to: &DataType) -> bool {
    use DataType::*;
    let utc_or_fixed = |tz: &Option<Arc<str>>| {
        tz.as_deref().is_none_or(|tz| {
            matches!(tz, "UTC" | "Z" | "Etc/UTC") || tz.starts_with('+') || tz.starts_with('-')
        })
    };
    let integer = |t: &DataType| t.is_integer();
    match (from, to) {
        (Dictionary(_, from), to) => keeps_order(from, to),
        (from, Dictionary(_, to)) => keeps_order(from, to),
        _ if from == to => true,
        (from, to) if from.is_numeric() && to.is_numeric() => true,
        (Boolean, to) if to.is_numeric() => true,
        (Timestamp(_, _), Timestamp(_, _)) => true,
        (Timestamp(_, tz), Date32 | Date64) => utc_or_fixed(tz),
        (Timestamp(_, _) | Date32 | Date64, Int64) => true,
        (Date32 | Date64, Date32 | Date64 | Timestamp(_, _)) => true,
        (from, Timestamp(_, _) | Date32 | Date64) if integer(from) => true,
        (Utf8 | LargeUtf8 | Utf8View, Utf8 | LargeUtf8 | Utf8View) => true,
        (Binary | LargeBinary | BinaryView, Binary | LargeBinary | BinaryView) => true,
        _ => false,
    }
}

/// The single-column predicates implied by the multi-column conjuncts of `predicate`.
fn implied_conjuncts(predicate: &Arc<dyn PhysicalExpr>) -> Result<Vec<Arc<dyn PhysicalExpr>>> {
    let mut implied = Vec::new();
    for conjunct in split_conjunction(predicate) {
        let mut columns: Vec<Column> = collect_columns(conjunct).into_iter().collect();
        if columns.len() < 2 {
            continue;
        }
        columns.sort_by_key(|c| c.index());
        if is_dynamic(conjunct)? {
            for column in columns {
                implied.push(Arc::new(ImpliedOn {
                    source: conjunct.clone(),
                    column,
                }) as Arc<dyn PhysicalExpr>);
            }
        } else {
            implied.extend(columns.iter().filter_map(|c| implied_on(conjunct, c)));
        }
    }
    Ok(implied)
}

/// Whether `expr` holds a node whose value changes while the query runs.
fn is_dynamic(expr: &Arc<dyn PhysicalExpr>) -> Result<bool> {
    let mut dynamic = false;
    expr.apply(|e| {
        dynamic = e.snapshot()?.is_some();
        Ok(if dynamic {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    })?;
    Ok(dynamic)
}

/// A predicate on `column` alone that holds wherever `expr` holds; `None` when nothing
/// about `column` follows from `expr`.
///
/// Through `AND` and `OR` the parts are replaced by what they imply (a part that implies
/// nothing is dropped from an `AND` and makes an `OR` imply nothing); any other expression
/// is kept whole if it names only `column`, and implies nothing otherwise. Each step keeps
/// "true where `expr` is true" (SQL's three-valued logic included), so the result never
/// rejects a row `expr` accepts.
pub(crate) fn implied_on(
    expr: &Arc<dyn PhysicalExpr>,
    column: &Column,
) -> Option<Arc<dyn PhysicalExpr>> {
    if let Some(binary) = expr.downcast_ref::<BinaryExpr>() {
        match binary.op() {
            Operator::And => {
                let left = implied_on(binary.left(), column);
                let right = implied_on(binary.right(), column);
                return match (left, right) {
                    (Some(l), Some(r)) => Some(Arc::new(BinaryExpr::new(l, Operator::And, r))),
                    (one, None) | (None, one) => one,
                };
            }
            Operator::Or => {
                let left = implied_on(binary.left(), column)?;
                let right = implied_on(binary.right(), column)?;
                return Some(Arc::new(BinaryExpr::new(left, Operator::Or, right)));
            }
            _ => {}
        }
    }
    if let Some(literal) = expr.downcast_ref::<Literal>() {
        // A constant implies itself; `true` says nothing.
        return match literal.value() {
            ScalarValue::Boolean(Some(true)) => None,
            _ => Some(expr.clone()),
        };
    }
    let columns = collect_columns(expr);
    // By name: the scan rewrites column indices from the table's schema to each file's.
    (!columns.is_empty() && columns.iter().all(|c| c.name() == column.name())).then(|| expr.clone())
}

/// What `source`, a predicate that changes while the query runs, currently implies about
/// `column` ([`implied_on`] of its snapshot; `true` when it implies nothing).
#[derive(Debug)]
pub(crate) struct ImpliedOn {
    source: Arc<dyn PhysicalExpr>,
    column: Column,
}

impl PartialEq for ImpliedOn {
    fn eq(&self, other: &Self) -> bool {
        self.source.as_ref() == other.source.as_ref() && self.column == other.column
    }
}

impl Eq for ImpliedOn {}

impl Hash for ImpliedOn {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.source.hash(state);
        self.column.hash(state);
    }
}

impl ImpliedOn {
    fn current(&self) -> Result<Arc<dyn PhysicalExpr>> {
        let now = snapshot_physical_expr(self.source.clone())?;
        Ok(implied_on(&now, &self.column)
            .unwrap_or_else(|| Arc::new(Literal::new(ScalarValue::Boolean(Some(true))))))
    }
}

impl fmt::Display for ImpliedOn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ImpliedOn({}) [ {} ]", self.column, self.source)
    }
}

impl PhysicalExpr for ImpliedOn {
    fn data_type(&self, _input_schema: &Schema) -> Result<DataType> {
        Ok(DataType::Boolean)
    }

    fn nullable(&self, _input_schema: &Schema) -> Result<bool> {
        Ok(true)
    }

    fn evaluate(&self, batch: &RecordBatch) -> Result<ColumnarValue> {
        self.current()?.evaluate(batch)
    }

    fn children(&self) -> Vec<&Arc<dyn PhysicalExpr>> {
        vec![&self.source]
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn PhysicalExpr>>,
    ) -> Result<Arc<dyn PhysicalExpr>> {
        let Some(source) = children.into_iter().next() else {
            return Ok(self);
        };
        Ok(Arc::new(ImpliedOn {
            source,
            column: self.column.clone(),
        }))
    }

    fn snapshot(&self) -> Result<Option<Arc<dyn PhysicalExpr>>> {
        self.current().map(Some)
    }

    fn fmt_sql(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use arrow_array::{Array, ArrayRef, BooleanArray, Float64Array, Int64Array};
    use arrow_schema::Field;
    use datafusion::physical_expr::expressions::{col, is_null, lit};
    use datafusion::physical_plan::expressions::DynamicFilterPhysicalExpr;

    use super::*;

    fn schema() -> Schema {
        Schema::new(vec![
            Field::new("latency", DataType::Float64, true),
            Field::new("time", DataType::Int64, true),
        ])
    }

    fn binary(
        l: Arc<dyn PhysicalExpr>,
        op: Operator,
        r: Arc<dyn PhysicalExpr>,
    ) -> Arc<dyn PhysicalExpr> {
        Arc::new(BinaryExpr::new(l, op, r))
    }

    /// `latency IS NULL OR latency > 5 OR latency = 5 AND time < 3`, the shape of a
    /// `ORDER BY latency DESC, time LIMIT n` threshold.
    fn top_n_filter(s: &Schema) -> Arc<dyn PhysicalExpr> {
        let latency = col("latency", s).unwrap();
        let time = col("time", s).unwrap();
        let tie = binary(
            binary(latency.clone(), Operator::Eq, lit(5.0)),
            Operator::And,
            binary(time, Operator::Lt, lit(3i64)),
        );
        binary(
            binary(
                is_null(latency.clone()).unwrap(),
                Operator::Or,
                binary(latency, Operator::Gt, lit(5.0)),
            ),
            Operator::Or,
            tie,
        )
    }

    fn rows(s: &Schema) -> RecordBatch {
        // (latency, time): every combination around the threshold, nulls included.
        let latency = [
            None,
            Some(4.0),
            Some(5.0),
            Some(5.0),
            Some(6.0),
            Some(5.0),
            Some(4.0),
        ];
        let time = [Some(9), Some(1), Some(2), Some(3), Some(9), None, None];
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Float64Array::from(latency.to_vec())),
            Arc::new(Int64Array::from(time.to_vec())),
        ];
        RecordBatch::try_new(Arc::new(s.clone()), columns).unwrap()
    }

    fn truth(expr: &Arc<dyn PhysicalExpr>, batch: &RecordBatch) -> Vec<bool> {
        let v = expr
            .evaluate(batch)
            .unwrap()
            .into_array(batch.num_rows())
            .unwrap();
        let v = v.as_any().downcast_ref::<BooleanArray>().unwrap();
        (0..v.len()).map(|i| v.is_valid(i) && v.value(i)).collect()
    }

    #[test]
    fn the_leading_column_keeps_its_part_and_others_imply_nothing() {
        let s = schema();
        let filter = top_n_filter(&s);
        let latency = Column::new("latency", 0);
        let implied = implied_on(&filter, &latency).expect("a predicate on latency");
        assert_eq!(
            implied.to_string(),
            "latency@0 IS NULL OR latency@0 > 5 OR latency@0 = 5"
        );
        // The tie-break column alone: `time < 3` is in an OR whose other parts do not
        // name time, so nothing about time follows.
        assert!(implied_on(&filter, &Column::new("time", 1)).is_none());
        // AND keeps what it can; a constant `true` implies nothing.
        let both = binary(
            binary(col("time", &s).unwrap(), Operator::Lt, lit(3i64)),
            Operator::And,
            lit(true),
        );
        assert_eq!(
            implied_on(&both, &Column::new("time", 1))
                .unwrap()
                .to_string(),
            "time@1 < 3"
        );
        assert!(implied_on(&both, &latency).is_none());
    }

    /// The implied predicate accepts every row the filter accepts (it may accept more).
    #[test]
    fn implied_predicates_never_reject_an_accepted_row() {
        let s = schema();
        let batch = rows(&s);
        let filter = top_n_filter(&s);
        let accepted = truth(&filter, &batch);
        assert_eq!(accepted, [true, false, true, false, true, false, false]);
        for column in [Column::new("latency", 0), Column::new("time", 1)] {
            let Some(implied) = implied_on(&filter, &column) else {
                continue;
            };
            let kept = truth(&implied, &batch);
            for (i, (&a, &k)) in accepted.iter().zip(&kept).enumerate() {
                assert!(!a || k, "row {i} accepted by {filter} but not by {implied}");
            }
        }
    }

    /// A dynamic filter is followed as it changes: the wrapper's snapshot is what the
    /// filter implies now.
    #[test]
    fn implied_on_a_dynamic_filter_follows_its_updates() {
        let s = schema();
        let latency = col("latency", &s).unwrap();
        let time = col("time", &s).unwrap();
        let dynamic = Arc::new(DynamicFilterPhysicalExpr::new(
            vec![latency.clone(), time],
            lit(true),
        ));
        let source: Arc<dyn PhysicalExpr> = dynamic.clone();
        assert!(is_dynamic(&source).unwrap());
        let wrapped = ImpliedOn {
            source,
            column: Column::new("latency", 0),
        };
        // Before the top-N has rows: nothing is implied.
        assert_eq!(wrapped.snapshot().unwrap().unwrap().to_string(), "true");
        dynamic.update(top_n_filter(&s)).unwrap();
        assert_eq!(
            wrapped.snapshot().unwrap().unwrap().to_string(),
            "latency@0 IS NULL OR latency@0 > 5 OR latency@0 = 5"
        );
        let batch = rows(&s);
        assert_eq!(
            truth(&(Arc::new(wrapped) as Arc<dyn PhysicalExpr>), &batch),
            [true, false, true, true, true, true, false]
        );
        // A static multi-column conjunct is not wrapped: its implications are computed once.
        let implied = implied_conjuncts(&top_n_filter(&s)).unwrap();
        assert_eq!(implied.len(), 1);
        assert!(implied[0].downcast_ref::<ImpliedOn>().is_none());
    }
}

#[cfg(test)]
mod statistics_tests {
    use arrow_schema::Field;
    use datafusion::common::Statistics;
    use datafusion::datasource::listing::PartitionedFile;
    use datafusion::datasource::physical_plan::FileScanConfigBuilder;
    use datafusion::execution::object_store::ObjectStoreUrl;
    use datafusion::physical_expr::expressions::{col, lit};
    use datafusion::physical_plan::expressions::DynamicFilterPhysicalExpr;

    use super::*;

    /// A Parquet scan of two ranges that carry statistics, with `predicate`.
    fn scan(predicate: Arc<dyn PhysicalExpr>) -> Arc<dyn ExecutionPlan> {
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, true)]));
        let range = |name: &str| {
            let mut statistics = Statistics::new_unknown(&schema);
            statistics.column_statistics[0].min_value =
                datafusion::common::stats::Precision::Inexact(ScalarValue::Int64(Some(1)));
            PartitionedFile::new(name, 100).with_statistics(Arc::new(statistics))
        };
        let source = ParquetSource::new(Arc::clone(&schema)).with_predicate(predicate);
        let config = FileScanConfigBuilder::new(
            ObjectStoreUrl::parse("sluice://").unwrap(),
            Arc::new(source),
        )
        .with_file_groups(vec![FileGroup::new(vec![range("a"), range("b")])])
        .build();
        DataSourceExec::from_data_source(config)
    }

    /// Whether every range of the scan in `plan` still has its statistics (`None` when
    /// none has).
    fn statistics_kept(plan: &Arc<dyn ExecutionPlan>) -> Option<bool> {
        let exec = plan.downcast_ref::<DataSourceExec>().unwrap();
        let config = exec.data_source().downcast_ref::<FileScanConfig>().unwrap();
        let files: Vec<_> = config.file_groups.iter().flat_map(|g| g.iter()).collect();
        assert_eq!(files.len(), 2);
        let with = files.iter().filter(|f| f.statistics.is_some()).count();
        match with {
            0 => None,
            2 => Some(true),
            _ => panic!("{with} of 2 ranges kept their statistics"),
        }
    }

    #[test]
    fn ranges_keep_statistics_only_under_a_changing_predicate() {
        let schema = Schema::new(vec![Field::new("k", DataType::Int64, true)]);
        let k = col("k", &schema).unwrap();
        let fixed: Arc<dyn PhysicalExpr> =
            Arc::new(BinaryExpr::new(Arc::clone(&k), Operator::Gt, lit(5i64)));
        let optimized = ColumnPruning
            .optimize(scan(fixed), &ConfigOptions::default())
            .unwrap();
        assert_eq!(statistics_kept(&optimized), None);

        let dynamic: Arc<dyn PhysicalExpr> =
            Arc::new(DynamicFilterPhysicalExpr::new(vec![k], lit(true)));
        let optimized = ColumnPruning
            .optimize(scan(dynamic), &ConfigOptions::default())
            .unwrap();
        assert_eq!(statistics_kept(&optimized), Some(true));
    }
}
