//! What a statement's plan may cost: its size, checked before it is analyzed and optimized,
//! and the memory its constants can take once broadcast.
//!
//! A plan's size does not follow its statement's: every reference to a common table
//! expression is a copy of its plan, so a chain of CTEs each a `UNION ALL` of the one before
//! doubles the plan per link (eighteen links of a kilobyte planned for minutes). SQL planning
//! itself walks every copy (exponential in the links), so [`check_expansion`] counts the
//! expansion on the syntax tree first. The plan SQL planning makes shares the copies, so it
//! is small; the analyzer and optimizer rewrite every copy separately. [`check_size`] counts
//! the plan as they will see it (nodes,
//! expressions and fields, nested types included, subqueries included, and the bytes of the
//! fields' names in every node: long names repeated through a join of many tables cost
//! gigabytes without making the plan large in nodes), stopping at the caps,
//! before any of them runs; past a cap the statement answers `statement_too_complex`. What is
//! counted is also what planning is charged in the statement's memory budget
//! ([`PLAN_NODE_BYTES`] and the rest), held until the statement ends.
//!
//! Constants cost memory where they are evaluated: a literal in a projection becomes an array
//! of as many rows as each batch has (a megabyte literal over a table is a megabyte per row),
//! and a type can be arbitrarily wide (`arrow_cast(NULL, 'FixedSizeBinary(1000000000)')` is a
//! gigabyte per row). [`broadcast_bytes`] bounds that over the optimized plan: every literal,
//! cast and output row of every node, times the most rows a batch of its input has. The
//! statement holds that in its budget, so a plan whose constants cannot fit is refused before
//! it runs.
//!
//! The analyzer and optimizer rules are interleaved with [`Checkpoint`], which stops a
//! statement that was cancelled, ran out of time or was refused memory (DataFusion leaves a
//! constant whose evaluation failed unfolded, and would try it again in every pass);
//! [`GuardFunctions`] ends the analyzer and
//! guards every function the plan calls ([`super::guard`]).

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;

use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{Transformed, TreeNode as _, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::error::Result;
use datafusion::logical_expr::{Expr, LogicalPlan};
use datafusion::optimizer::analyzer::AnalyzerRule;
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};
use datafusion::sql::parser::Statement as DfStatement;
use datafusion::sql::sqlparser::ast::{Expr as SqlExpr, ObjectName, Query, Visit, Visitor};

use super::QueryError;
use super::budget::BudgetOption;
use super::guard::width_of;

/// A statement refused for its shape, as DataFusion carries it (from a function or rule):
/// it answers `statement_too_complex`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct TooComplex(pub(crate) String);

/// `message` as a [`TooComplex`] DataFusion error.
pub(crate) fn too_complex(message: String) -> datafusion::error::DataFusionError {
    datafusion::error::DataFusionError::External(Box::new(TooComplex(message)))
}

/// Most plan nodes a statement may plan (subqueries and every copy of a CTE included).
pub(crate) const MAX_PLAN_NODES: usize = 10_000;

/// Most expression nodes in a plan.
pub(crate) const MAX_PLAN_EXPRESSIONS: usize = 1_000_000;

/// Most fields in a plan's schemas, counting every field nested in a type.
pub(crate) const MAX_PLAN_FIELDS: usize = 1_000_000;

/// What planning is charged per plan node, per expression and per field: the analyzer and
/// optimizer hold a few copies of each while they rewrite.
pub(crate) const PLAN_NODE_BYTES: usize = 4 << 10;
pub(crate) const PLAN_EXPRESSION_BYTES: usize = 512;
pub(crate) const PLAN_FIELD_BYTES: usize = 256;

/// What planning is charged per byte of a field's name (and qualifier) in each plan node's
/// schema: the rules copy names as they rebuild schemas, so long names cost in proportion,
/// once per node they reach (a join of many tables whose columns have long names holds
/// every name at every level).
pub(crate) const PLAN_NAME_BYTE_COPIES: usize = 6;

/// How large a plan is (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PlanSize {
    pub(crate) nodes: usize,
    pub(crate) expressions: usize,
    pub(crate) fields: usize,
    /// Bytes of the names and qualifiers of every node's fields.
    pub(crate) name_bytes: usize,
}

impl PlanSize {
    /// What planning a plan of this size is charged.
    pub(crate) fn bytes(&self) -> usize {
        (self.nodes * PLAN_NODE_BYTES)
            .saturating_add(self.expressions * PLAN_EXPRESSION_BYTES)
            .saturating_add(self.fields * PLAN_FIELD_BYTES)
            .saturating_add(self.name_bytes.saturating_mul(PLAN_NAME_BYTE_COPIES))
    }
}

/// Counts `plan` as the analyzer and optimizer will walk it, and refuses it past a cap.
pub(crate) fn check_size(plan: &LogicalPlan) -> std::result::Result<PlanSize, QueryError> {
    let mut size = PlanSize::default();
    let mut over = None;
    let _ = plan.apply_with_subqueries(|node| {
        size.nodes += 1;
        if size.nodes > MAX_PLAN_NODES {
            over = Some(format!(
                "the statement plans to more than {MAX_PLAN_NODES} plan nodes (each use of a \
                 common table expression is a copy of it)"
            ));
            return Ok(TreeNodeRecursion::Stop);
        }
        let mut budget = MAX_PLAN_FIELDS.saturating_sub(size.fields);
        for (qualifier, field) in node.schema().iter() {
            size.name_bytes = size
                .name_bytes
                .saturating_add(field.name().len())
                .saturating_add(qualifier.map_or(0, |q| q.table().len()));
            if count_fields(field.data_type(), &mut budget).is_none() {
                over = Some(format!(
                    "the statement's plan has more than {MAX_PLAN_FIELDS} fields (nested \
                     types included)"
                ));
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        size.fields = MAX_PLAN_FIELDS - budget;
        node.apply_expressions(|e| {
            e.apply(|_| {
                size.expressions += 1;
                if size.expressions > MAX_PLAN_EXPRESSIONS {
                    over = Some(format!(
                        "the statement's plan has more than {MAX_PLAN_EXPRESSIONS} expressions"
                    ));
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })
    });
    match over {
        Some(message) => Err(QueryError::TooComplex(message)),
        None => Ok(size),
    }
}

/// Refuses a statement whose common table expressions expand past [`MAX_PLAN_NODES`], before
/// SQL planning sees it: planning a reference to a CTE walks every copy the CTE's own
/// references make (DataFusion resolves columns against the whole plan below), so a chain of
/// doubling CTEs takes exponential time in SQL planning already, where nothing can stop it.
/// The expansion is counted on the syntax tree, with each name resolved in its scope: a
/// query or a table reference counts one, a reference to a CTE also counts the CTE's
/// expansion. The count revisits a nested query once per level it is nested in, so it stops
/// (and refuses the statement) after [`MAX_EXPANSION_VISITS`] syntax nodes.
pub(crate) fn check_expansion(statement: &DfStatement) -> std::result::Result<(), QueryError> {
    let root = Scope {
        names: HashMap::new(),
        parent: None,
    };
    let visits = std::cell::Cell::new(0);
    let mut level = Level {
        scope: &root,
        depth: 0,
        weight: 0,
        visits: &visits,
    };
    let mut statement = statement;
    loop {
        match statement {
            DfStatement::Explain(e) => statement = &e.statement,
            DfStatement::Statement(s) => {
                if let ControlFlow::Break(e) = s.visit(&mut level) {
                    return Err(e);
                }
                return Ok(());
            }
            _ => return Ok(()),
        }
    }
}

/// Common table expressions in scope, by name, with their expansion.
struct Scope<'p> {
    names: HashMap<String, u128>,
    parent: Option<&'p Scope<'p>>,
}

impl Scope<'_> {
    fn lookup(&self, name: &str) -> Option<u128> {
        match self.names.get(name) {
            Some(w) => Some(*w),
            None => self.parent.and_then(|p| p.lookup(name)),
        }
    }
}

/// Counts the expansion of what it visits, at one level of query nesting: nested queries are
/// counted by their own level.
struct Level<'a, 's> {
    scope: &'a Scope<'s>,
    depth: usize,
    weight: u128,
    /// Syntax nodes visited so far, at every level.
    visits: &'a std::cell::Cell<usize>,
}

/// Most syntax nodes [`check_expansion`] visits (a flat statement of the longest length
/// visits a few hundred thousand).
pub(crate) const MAX_EXPANSION_VISITS: usize = 16_000_000;

impl Level<'_, '_> {
    fn visited(&mut self) -> ControlFlow<QueryError> {
        self.visits.set(self.visits.get() + 1);
        if self.visits.get() > MAX_EXPANSION_VISITS {
            return ControlFlow::Break(QueryError::TooComplex(
                "the statement nests too many queries to count its expansion".into(),
            ));
        }
        ControlFlow::Continue(())
    }

    fn add(&mut self, weight: u128) -> ControlFlow<QueryError> {
        self.weight = self.weight.saturating_add(weight);
        if self.weight > MAX_PLAN_NODES as u128 {
            return ControlFlow::Break(QueryError::TooComplex(format!(
                "the statement expands to more than {MAX_PLAN_NODES} plan nodes (each use of \
                 a common table expression is a copy of it)"
            )));
        }
        ControlFlow::Continue(())
    }
}

/// The expansion of `query` in `outer`.
fn query_weight(
    query: &Query,
    outer: &Scope<'_>,
    visits: &std::cell::Cell<usize>,
) -> std::result::Result<u128, QueryError> {
    let mut scope = Scope {
        names: HashMap::new(),
        parent: Some(outer),
    };
    if let Some(with) = &query.with {
        for cte in &with.cte_tables {
            let weight = 1 + query_weight(&cte.query, &scope, visits)?;
            scope
                .names
                .insert(super::prepare::normalized(&cte.alias.name), weight);
        }
    }
    let mut level = Level {
        scope: &scope,
        depth: 0,
        weight: 1,
        visits,
    };
    let flow = query.body.visit(&mut level);
    let flow = match flow {
        ControlFlow::Continue(()) => query.order_by.visit(&mut level),
        stop => stop,
    };
    match flow {
        ControlFlow::Break(e) => Err(e),
        ControlFlow::Continue(()) => Ok(level.weight),
    }
}

impl Visitor for Level<'_, '_> {
    type Break = QueryError;

    fn pre_visit_query(&mut self, query: &Query) -> ControlFlow<QueryError> {
        self.visited()?;
        self.depth += 1;
        if self.depth == 1 {
            match query_weight(query, self.scope, self.visits) {
                Ok(weight) => self.add(weight)?,
                Err(e) => return ControlFlow::Break(e),
            }
        }
        ControlFlow::Continue(())
    }

    fn post_visit_query(&mut self, _query: &Query) -> ControlFlow<QueryError> {
        self.depth -= 1;
        ControlFlow::Continue(())
    }

    fn pre_visit_relation(&mut self, relation: &ObjectName) -> ControlFlow<QueryError> {
        self.visited()?;
        if self.depth > 0 {
            return ControlFlow::Continue(());
        }
        let cte = match relation.0.as_slice() {
            [part] => part
                .as_ident()
                .and_then(|i| self.scope.lookup(&super::prepare::normalized(i))),
            _ => None,
        };
        self.add(1 + cte.unwrap_or(0))
    }

    fn pre_visit_expr(&mut self, _expr: &SqlExpr) -> ControlFlow<QueryError> {
        self.visited()
    }
}

/// Counts `t` and every field nested in it against `budget`; `None` once it is spent.
pub(crate) fn count_fields(t: &arrow_schema::DataType, budget: &mut usize) -> Option<()> {
    use arrow_schema::DataType;
    *budget = budget.checked_sub(1)?;
    match t {
        DataType::Struct(fields) => fields
            .iter()
            .try_for_each(|f| count_fields(f.data_type(), budget)),
        DataType::Union(fields, _) => fields
            .iter()
            .try_for_each(|(_, f)| count_fields(f.data_type(), budget)),
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::ListView(f)
        | DataType::LargeListView(f)
        | DataType::FixedSizeList(f, _)
        | DataType::Map(f, _)
        | DataType::RunEndEncoded(_, f) => count_fields(f.data_type(), budget),
        DataType::Dictionary(_, value) => count_fields(value, budget),
        _ => Some(()),
    }
}

/// The most rows one batch of `plan`'s output has: a plan that makes one row (`SELECT 1`) or
/// a few (`VALUES`) evaluates its expressions for those rows only.
fn batch_rows(plan: &LogicalPlan, batch_size: usize) -> u128 {
    let rows = match plan {
        LogicalPlan::EmptyRelation(e) => usize::from(e.produce_one_row),
        LogicalPlan::Values(v) => v.values.len(),
        LogicalPlan::Projection(_)
        | LogicalPlan::Filter(_)
        | LogicalPlan::Sort(_)
        | LogicalPlan::Limit(_)
        | LogicalPlan::SubqueryAlias(_)
        | LogicalPlan::Distinct(_)
        | LogicalPlan::Repartition(_)
        | LogicalPlan::Window(_)
        | LogicalPlan::Union(_) => plan
            .inputs()
            .iter()
            .map(|i| batch_rows(i, batch_size) as usize)
            .max()
            .unwrap_or(batch_size),
        _ => batch_size,
    };
    rows.min(batch_size) as u128
}

/// An upper bound of what `plan`'s constants, casts and rows take once evaluated for a
/// batch (see the module docs).
pub(crate) fn broadcast_bytes(plan: &LogicalPlan, batch_size: usize) -> u128 {
    let mut total: u128 = 0;
    let mut widest: u128 = 0;
    let _ = plan.apply_with_subqueries(|node| {
        let rows = batch_rows(node, batch_size);
        let mut budget = 100_000;
        let width: u128 = node
            .schema()
            .fields()
            .iter()
            .map(|f| u128::from(width_of(f.data_type(), &mut budget).unwrap_or(u64::MAX)))
            .fold(0, u128::saturating_add);
        widest = widest.max(width.saturating_mul(rows));
        // Each input row evaluates the node's expressions (a `VALUES` row's once).
        let per_row = match node {
            LogicalPlan::Values(_) => 1,
            _ => node
                .inputs()
                .iter()
                .map(|i| batch_rows(i, batch_size))
                .max()
                .unwrap_or(1),
        };
        node.apply_expressions(|e| {
            total = total.saturating_add(expression_bytes(e, per_row));
            Ok(TreeNodeRecursion::Continue)
        })
    });
    total.saturating_add(widest)
}

/// What `expr`'s literals and casts take, each evaluated for `rows` rows (an `IN` list's
/// values once: they become one set).
fn expression_bytes(expr: &Expr, rows: u128) -> u128 {
    let mut total: u128 = 0;
    let _ = expr.apply(|e| {
        match e {
            Expr::Literal(value, _) => {
                total = total.saturating_add(literal_bytes(value).saturating_mul(rows));
            }
            Expr::Cast(c) => {
                let width = width_of(c.field.data_type(), &mut 100_000).unwrap_or(u64::MAX);
                total = total.saturating_add(u128::from(width).saturating_mul(rows));
            }
            Expr::TryCast(c) => {
                let width = width_of(c.field.data_type(), &mut 100_000).unwrap_or(u64::MAX);
                total = total.saturating_add(u128::from(width).saturating_mul(rows));
            }
            Expr::InList(list) => {
                total = total.saturating_add(expression_bytes(&list.expr, rows));
                for value in &list.list {
                    total = total.saturating_add(expression_bytes(value, 1));
                }
                return Ok(TreeNodeRecursion::Jump);
            }
            _ => {}
        }
        Ok(TreeNodeRecursion::Continue)
    });
    total
}

/// What one copy of a literal takes in an array.
fn literal_bytes(value: &ScalarValue) -> u128 {
    let data = value.size().saturating_sub(size_of::<ScalarValue>()) as u128;
    let width = u128::from(width_of(&value.data_type(), &mut 100_000).unwrap_or(u64::MAX));
    data.saturating_add(width)
}

/// Stops a cancelled or timed-out statement between analyzer and optimizer rules.
#[derive(Debug, Default)]
pub(crate) struct Checkpoint;

fn checkpoint(options: &ConfigOptions) -> Result<()> {
    match BudgetOption::of(options) {
        Some(budget) => budget.planning_checkpoint(),
        None => Ok(()),
    }
}

impl AnalyzerRule for Checkpoint {
    fn analyze(&self, plan: LogicalPlan, config: &ConfigOptions) -> Result<LogicalPlan> {
        checkpoint(config)?;
        Ok(plan)
    }

    fn name(&self) -> &str {
        "sluice_checkpoint"
    }
}

impl OptimizerRule for Checkpoint {
    fn name(&self) -> &str {
        "sluice_checkpoint"
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>> {
        checkpoint(&config.options())?;
        Ok(Transformed::no(plan))
    }
}

/// Refuses a plan that names a type one value of which takes more than a share of the
/// statement memory (`INT[1000000000]`, `FixedSizeBinary(2147483647)`): DataFusion makes a
/// null of a cast's type to fold it, and a batch of them to run it. Runs first, before type
/// coercion makes any value.
#[derive(Debug)]
pub(crate) struct CheckTypes {
    /// The most one value may take.
    pub(crate) max_value_bytes: usize,
}

impl CheckTypes {
    fn check(&self, t: &arrow_schema::DataType) -> Result<()> {
        let width = width_of(t, &mut 100_000).unwrap_or(u64::MAX);
        if width > self.max_value_bytes as u64 {
            return Err(datafusion::error::DataFusionError::ResourcesExhausted(
                format!(
                    "a value of type {} takes {width} bytes; a value may take {}",
                    short(t),
                    self.max_value_bytes
                ),
            ));
        }
        Ok(())
    }
}

/// A type's name, cut short (a type can be very large).
fn short(t: &arrow_schema::DataType) -> String {
    let mut name = String::new();
    let _ = std::fmt::Write::write_fmt(&mut Limited(&mut name, 200), format_args!("{t}"));
    name
}

/// Writes at most `.1` bytes into `.0`, then fails (which stops the formatting).
struct Limited<'a>(&'a mut String, usize);

impl std::fmt::Write for Limited<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let room = self.1.saturating_sub(self.0.len());
        if s.len() > room {
            let cut = (0..=room)
                .rev()
                .find(|i| s.is_char_boundary(*i))
                .unwrap_or(0);
            self.0.push_str(&s[..cut]);
            self.0.push('…');
            return Err(std::fmt::Error);
        }
        self.0.push_str(s);
        Ok(())
    }
}

impl AnalyzerRule for CheckTypes {
    fn analyze(&self, plan: LogicalPlan, config: &ConfigOptions) -> Result<LogicalPlan> {
        checkpoint(config)?;
        let mut failed = None;
        plan.apply_with_subqueries(|node| {
            for field in node.schema().fields() {
                if let Err(e) = self.check(field.data_type()) {
                    failed = Some(e);
                    return Ok(TreeNodeRecursion::Stop);
                }
            }
            node.apply_expressions(|e| {
                e.apply(|e| {
                    let checked = match e {
                        Expr::Cast(c) => self.check(c.field.data_type()),
                        Expr::TryCast(c) => self.check(c.field.data_type()),
                        Expr::Literal(v, _) => self.check(&v.data_type()),
                        _ => Ok(()),
                    };
                    match checked {
                        Ok(()) => Ok(TreeNodeRecursion::Continue),
                        Err(e) => {
                            failed = Some(e);
                            Ok(TreeNodeRecursion::Stop)
                        }
                    }
                })
            })
        })?;
        match failed {
            Some(e) => Err(e),
            None => Ok(plan),
        }
    }

    fn name(&self) -> &str {
        "sluice_check_types"
    }
}

/// Guards every function the plan calls and rewrites `||` and regular-expression matches
/// into guarded functions ([`super::guard::guard_plan`]); runs after type coercion.
#[derive(Debug)]
pub(crate) struct GuardFunctions {
    /// The per-call bound outside statements.
    pub(crate) limit: usize,
}

impl AnalyzerRule for GuardFunctions {
    fn analyze(&self, plan: LogicalPlan, config: &ConfigOptions) -> Result<LogicalPlan> {
        checkpoint(config)?;
        Ok(super::guard::guard_plan(plan, self.limit)?.data)
    }

    fn name(&self) -> &str {
        "sluice_guard_functions"
    }
}

/// `rules` with a [`Checkpoint`] after each.
pub(crate) fn with_checkpoints<R: ?Sized>(rules: Vec<Arc<R>>, checkpoint: Arc<R>) -> Vec<Arc<R>> {
    let mut out = Vec::with_capacity(rules.len() * 2);
    for rule in rules {
        out.push(rule);
        out.push(Arc::clone(&checkpoint));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::prelude::SessionContext;

    async fn plan(sql: &str) -> LogicalPlan {
        let ctx = SessionContext::new();
        ctx.state().create_logical_plan(sql).await.unwrap()
    }

    /// A chain of `n` CTEs, each the `UNION ALL` of the one before with itself.
    fn doubling(n: usize) -> String {
        let mut sql = "WITH c0 AS (SELECT 1 AS x)".to_owned();
        for i in 1..=n {
            sql.push_str(&format!(
                ", c{i} AS (SELECT x FROM c{p} UNION ALL SELECT x FROM c{p})",
                p = i - 1
            ));
        }
        sql + &format!(" SELECT count(*) FROM c{n}")
    }

    fn parsed(sql: &str) -> DfStatement {
        datafusion::sql::parser::DFParser::parse_sql(sql)
            .unwrap()
            .pop_front()
            .unwrap()
    }

    /// A join of `tables` copies of a one-column table whose column's name is `name_len`
    /// bytes long.
    fn long_names(tables: usize, name_len: usize) -> String {
        let name = "n".repeat(name_len);
        let mut sql = format!("WITH t AS (SELECT 1 AS \"{name}\") SELECT * FROM t a0");
        for i in 1..tables {
            sql.push_str(&format!(" CROSS JOIN t a{i}"));
        }
        sql
    }

    #[tokio::test]
    async fn long_names_through_a_join_are_charged_at_every_level() {
        let short = check_size(&plan(&long_names(20, 1)).await).unwrap();
        let long = check_size(&plan(&long_names(20, 10_000)).await).unwrap();
        assert_eq!(short.nodes, long.nodes);
        // Every join level holds the names of all the tables below it: about n^2 / 2 names.
        assert!(long.name_bytes >= 200 * 10_000, "{long:?}");
        assert!(long.bytes() > 10 * short.bytes(), "{short:?} {long:?}");
        // The red team's statement (140 tables, names of 100,000 bytes) is charged past any
        // budget a server gives (it took 5 GB).
        let attack = check_size(&plan(&long_names(140, 100_000)).await).unwrap();
        assert!(attack.bytes() > 5 << 30, "{attack:?}");
    }

    #[tokio::test]
    async fn copies_of_common_table_expressions_count_and_are_refused_past_the_cap() {
        let small = check_size(&plan(&doubling(4)).await).unwrap();
        let larger = check_size(&plan(&doubling(6)).await).unwrap();
        // Each link doubles what the analyzer will walk.
        assert!(larger.nodes > 3 * small.nodes, "{small:?} {larger:?}");
        // Past the cap, refused from the syntax tree, before SQL planning (which would take
        // exponential time).
        check_expansion(&parsed(&doubling(8))).unwrap();
        for links in [14, 60, 500] {
            let e = check_expansion(&parsed(&doubling(links))).unwrap_err();
            assert!(matches!(e, QueryError::TooComplex(_)), "{e}");
        }
        // Whatever the spelling: nested in subqueries, in `IN`, behind shadowing names.
        let mut nested = "SELECT 1 AS x".to_owned();
        for _ in 0..40 {
            nested = format!(
                "WITH a AS ({nested}) SELECT x FROM a UNION ALL SELECT x FROM (SELECT x FROM a)"
            );
        }
        let e = check_expansion(&parsed(&nested)).unwrap_err();
        assert!(matches!(e, QueryError::TooComplex(_)), "{e}");
        let mut inside = "SELECT 1 AS x".to_owned();
        for _ in 0..40 {
            inside = format!("WITH a AS ({inside}) SELECT x FROM a WHERE x IN (SELECT x FROM a)");
        }
        let e = check_expansion(&parsed(&inside)).unwrap_err();
        assert!(matches!(e, QueryError::TooComplex(_)), "{e}");
        // A recursive CTE's reference to itself is its working table, not a copy.
        check_expansion(&parsed(
            "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 10) \
                 SELECT * FROM r",
        ))
        .unwrap();
    }

    #[tokio::test]
    async fn constants_are_counted_for_the_rows_that_evaluate_them() {
        let one_row = broadcast_bytes(&plan("SELECT 'aaaaaaaa'").await, 8192);
        let per_batch = broadcast_bytes(
            &plan("SELECT 'aaaaaaaa' FROM generate_series(1, 100000)").await,
            8192,
        );
        assert!(one_row < 1000, "{one_row}");
        assert!(per_batch > 8192 * 8, "{per_batch}");
        let wide = broadcast_bytes(
            &plan("SELECT arrow_cast(NULL, 'FixedSizeBinary(1000000000)') FROM generate_series(1, 10)")
                .await,
            8192,
        );
        assert!(wide >= 8192 * 1_000_000_000, "{wide}");
    }
}
