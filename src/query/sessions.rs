//! Sessions and query plans reused across statements.
//!
//! A statement needs a DataFusion session that sees every table of the catalog, and a plan:
//! parsed, analyzed and optimized. Both cost more than a small query's scan (a session
//! registers each database, schema and table; the logical optimizer runs some thirty rules),
//! and both depend only on the catalog's content, so they are kept per catalog version:
//!
//! - **The session** of the newest catalog version this node has planned for. A statement
//!   starts from a clone of it (cloning shares the catalogs, the functions and the runtime
//!   environment). A new catalog version builds a new session and drops the old one, with
//!   its plans. A session in which some table has no storage yet (it reads as empty, with
//!   the catalog's columns) is not kept: the storage can appear without a catalog change.
//! - **Optimized logical plans** of `SELECT` statements, keyed by the parsed statement (its
//!   syntax tree, compared whole), with the schema of the plan before optimization (the
//!   answer's columns and their sluice types, as without reuse). A plan is kept only if it
//!   calls no function whose result may change between calls (`now()`, `random()`: the
//!   optimizer folds those into constants) and reads only sluice tables (a table function's
//!   arguments are evaluated while planning, `now()` included). Plans hold no data: each run
//!   plans its scans afresh (files, unflushed batches and pruning are read at physical
//!   planning), so a kept plan answers with the rows committed when it runs.
//!
//! Invariants: a kept plan was checked read-only ([`super::read_only`]) before it was kept,
//! and was planned in the session it is kept with (its tables are that session's). What is
//! kept is bounded whatever statements clients send: at most [`MAX_PLANS`] plans, of
//! statements of at most [`MAX_KEPT_STATEMENT_BYTES`] (as printed), each plan at most
//! [`MAX_PLAN_WEIGHT`] and all at most [`MAX_KEPT_WEIGHT`] by an estimate of their bytes
//! ([`plan_weight`]). A plan's size does not follow its statement's: a short statement can
//! fold a function into a constant of any size (`repeat('x', 50000000)`), or copy a
//! subquery into every place a chain of CTEs uses it, doubling at each link. The least
//! recently used plans go first.

use std::collections::HashMap;
use std::hash::{BuildHasher as _, RandomState};
use std::sync::{Arc, Mutex};

use arrow_schema::DataType;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::datasource::source_as_provider;
use datafusion::execution::session_state::SessionState;
use datafusion::logical_expr::{Expr, LogicalPlan, Volatility};
use datafusion::sql::parser::Statement as DfStatement;
use datafusion::sql::sqlparser::ast::Statement as SqlStatement;

/// The most plans kept for one session: about the distinct statements a dashboard sends.
pub(super) const MAX_PLANS: usize = 256;

/// The longest statement (as printed) whose plan is kept: a dashboard's queries are shorter.
pub(super) const MAX_KEPT_STATEMENT_BYTES: usize = 2 << 10;

/// The largest plan kept, by [`plan_weight`]'s estimate of its bytes.
pub(super) const MAX_PLAN_WEIGHT: usize = 1 << 20;

/// The most bytes one session keeps in plans, by [`plan_weight`]'s estimate (plus the
/// statements, which are kept as keys).
pub(super) const MAX_KEPT_WEIGHT: usize = 16 << 20;

/// The session of the newest catalog version planned for (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Sessions {
    current: Mutex<Option<Arc<CatalogSession>>>,
}

impl Sessions {
    /// The kept session of catalog version `version`, if it is the one kept.
    pub(super) fn get(&self, version: u64) -> Option<Arc<CatalogSession>> {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        current.as_ref().filter(|s| s.version == version).cloned()
    }

    /// Keeps `session` unless a session of a newer catalog version is kept already.
    pub(super) fn keep(&self, session: Arc<CatalogSession>) {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_none_or(|s| s.version < session.version) {
            *current = Some(session);
        }
    }
}

/// A session that sees one catalog version, and the plans made in it.
#[derive(Debug)]
pub(super) struct CatalogSession {
    version: u64,
    state: SessionState,
    /// Hashes statements for `plans` (random keys: statements are clients' input).
    hasher: RandomState,
    plans: Mutex<Plans>,
}

#[derive(Debug, Default)]
struct Plans {
    /// Kept plans by the hash of their statement (computed outside the lock: a statement can
    /// be a megabyte long), then by the statement.
    by_hash: HashMap<u64, Vec<KeptPlan>>,
    /// How many plans are kept.
    count: usize,
    /// The estimated bytes of the plans kept ([`plan_weight`] and the statements' text).
    weight: usize,
    /// Counts lookups, to find the least recently used plan.
    clock: u64,
}

#[derive(Debug)]
struct KeptPlan {
    statement: SqlStatement,
    plan: ReusedPlan,
    weight: usize,
    used: u64,
}

impl Plans {
    /// Removes the least recently used plan; false when none is kept.
    fn evict_oldest(&mut self) -> bool {
        let oldest = (self.by_hash.iter())
            .flat_map(|(&hash, bucket)| {
                bucket
                    .iter()
                    .enumerate()
                    .map(move |(i, k)| (k.used, hash, i))
            })
            .min();
        let Some((_, hash, i)) = oldest else {
            return false;
        };
        self.remove(hash, i);
        true
    }

    fn remove(&mut self, hash: u64, index: usize) {
        let Some(bucket) = self.by_hash.get_mut(&hash) else {
            return;
        };
        let kept = bucket.swap_remove(index);
        if bucket.is_empty() {
            self.by_hash.remove(&hash);
        }
        self.count -= 1;
        self.weight -= kept.weight;
    }
}

/// A statement's plan, optimized, and the schema of its answer.
#[derive(Debug, Clone)]
pub(super) struct ReusedPlan {
    /// The optimized plan.
    pub(super) optimized: LogicalPlan,
    /// The schema of the plan before optimization: the answer's columns with their field
    /// metadata (sluice's types), which the optimizer may not keep (a union's fields carry
    /// its first input's).
    pub(super) schema: arrow_schema::SchemaRef,
}

impl CatalogSession {
    /// A session of catalog version `version`.
    pub(super) fn new(version: u64, state: SessionState) -> Self {
        CatalogSession {
            version,
            state,
            hasher: RandomState::new(),
            plans: Mutex::new(Plans::default()),
        }
    }

    /// The state a statement starts from: a clone that carries the statement's budget
    /// (to its functions and rules), marked as starting now (`now()`).
    pub(super) fn state(&self, budget: &Arc<super::budget::StatementBudget>) -> SessionState {
        let mut state = self.state.clone();
        state
            .config_mut()
            .options_mut()
            .extensions
            .insert(super::budget::BudgetOption(Arc::clone(budget)));
        state.mark_start_execution();
        state
    }

    /// The kept plan of `statement`, if any.
    pub(super) fn plan(&self, statement: &DfStatement) -> Option<ReusedPlan> {
        let DfStatement::Statement(statement) = statement else {
            return None;
        };
        let hash = self.hasher.hash_one(statement.as_ref());
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        plans.clock += 1;
        let clock = plans.clock;
        let bucket = plans.by_hash.get_mut(&hash)?;
        let kept = bucket
            .iter_mut()
            .find(|k| k.statement == *statement.as_ref())?;
        kept.used = clock;
        Some(kept.plan.clone())
    }

    /// Keeps `plan`, the read-only checked and optimized plan of `statement` whose plan
    /// before optimization was `planned`, if it may be reused (see the module docs).
    pub(super) fn keep(&self, statement: &DfStatement, planned: &LogicalPlan, plan: &ReusedPlan) {
        let DfStatement::Statement(statement) = statement else {
            return;
        };
        if !matches!(statement.as_ref(), SqlStatement::Query(_)) || !reusable(planned) {
            return;
        }
        let Some(plan_weight) = plan_weight(plan, MAX_PLAN_WEIGHT) else {
            return;
        };
        let text = statement.to_string().len();
        if text > MAX_KEPT_STATEMENT_BYTES {
            return;
        }
        // The syntax tree kept as the key: some hundred bytes a node, a node every few
        // bytes of text (`IN (1,1,1,...)`).
        let weight = plan_weight + 128 * text;
        let hash = self.hasher.hash_one(statement.as_ref());
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let same = (plans.by_hash.get(&hash)).and_then(|bucket| {
            bucket
                .iter()
                .position(|k| k.statement == *statement.as_ref())
        });
        if let Some(i) = same {
            plans.remove(hash, i);
        }
        while plans.count >= MAX_PLANS || plans.weight + weight > MAX_KEPT_WEIGHT {
            if !plans.evict_oldest() {
                break;
            }
        }
        plans.clock += 1;
        let used = plans.clock;
        plans.count += 1;
        plans.weight += weight;
        plans.by_hash.entry(hash).or_default().push(KeptPlan {
            statement: statement.as_ref().clone(),
            plan: plan.clone(),
            weight,
            used,
        });
    }

    /// How many plans are kept, and their estimated bytes.
    #[cfg(test)]
    pub(super) fn plans(&self) -> (usize, usize) {
        let plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        (plans.count, plans.weight)
    }
}

/// An estimate of the bytes `plan` holds, or `None` once it passes `limit` (every walk stops
/// there: a plan can have a hundred thousand nodes, and a type built as `struct(s, s)` k
/// times over has 2^k fields to visit). Each node counts a kilobyte, its schema's fields
/// with their names and nested fields, and its functional dependencies; each expression
/// 128 bytes and its constants' sizes (`repeat('x', 50000000)` is folded into a 50 MB
/// constant); the answer's schema its fields. A subplan or type shared by several places
/// counts once for each.
fn plan_weight(plan: &ReusedPlan, limit: usize) -> Option<usize> {
    let mut weight = 0;
    if !add_fields(
        &mut weight,
        plan.schema.fields().iter().map(|f| f.as_ref()),
        limit,
    ) {
        return None;
    }
    let visited = plan.optimized.apply_with_subqueries(|node| {
        weight += 1024;
        let schema = node.schema();
        let dependencies: usize = (schema.functional_dependencies().iter())
            .map(|d| 8 * (d.source_indices.len() + d.target_indices.len()))
            .sum();
        weight += dependencies;
        let fields = schema.fields().iter().map(|f| f.as_ref());
        if !add_fields(&mut weight, fields, limit) {
            return Ok(TreeNodeRecursion::Stop);
        }
        node.apply_expressions(|expr| {
            expr.apply(|e| {
                weight += 128;
                if let Expr::Literal(value, _) = e {
                    weight += value.size();
                }
                Ok(match weight > limit {
                    true => TreeNodeRecursion::Stop,
                    false => TreeNodeRecursion::Continue,
                })
            })
        })
    });
    (visited.is_ok() && weight <= limit).then_some(weight)
}

/// Adds to `weight` 128 bytes, the name and the metadata of each of `fields` and of every
/// field nested in their types; false (and stops) once `weight` passes `limit`.
fn add_fields<'a>(
    weight: &mut usize,
    fields: impl Iterator<Item = &'a arrow_schema::Field>,
    limit: usize,
) -> bool {
    let mut stack: Vec<&arrow_schema::Field> = fields.collect();
    while let Some(field) = stack.pop() {
        *weight += 128 + field.name().len();
        *weight += (field.metadata().iter())
            .map(|(k, v)| 64 + k.len() + v.len())
            .sum::<usize>();
        if *weight > limit {
            return false;
        }
        match field.data_type() {
            DataType::Struct(children) => stack.extend(children.iter().map(|f| f.as_ref())),
            DataType::Union(children, _) => stack.extend(children.iter().map(|(_, f)| f.as_ref())),
            DataType::List(child)
            | DataType::LargeList(child)
            | DataType::ListView(child)
            | DataType::LargeListView(child)
            | DataType::FixedSizeList(child, _)
            | DataType::Map(child, _)
            | DataType::RunEndEncoded(_, child) => stack.push(child.as_ref()),
            DataType::Dictionary(_, value) => {
                // A value type's fields, without a field of its own: count it as one.
                let inner = arrow_schema::Field::new("", value.as_ref().clone(), true);
                if !add_fields(weight, std::iter::once(&inner), limit) {
                    return false;
                }
            }
            _ => {}
        }
    }
    true
}

/// Whether a plan (before optimization) gives the same optimized plan whenever it runs: it
/// calls only functions whose result depends on their arguments alone, in every node and
/// every subquery, and reads only sluice's tables. (`now()` is stable, not immutable: the
/// optimizer folds it into the statement's start time. A table function, such as
/// `generate_series(now(), ...)`, has its arguments evaluated while the statement is
/// planned, so its scan holds their values.)
fn reusable(plan: &LogicalPlan) -> bool {
    let mut immutable = true;
    let visited = plan.apply_with_subqueries(|node| {
        if let LogicalPlan::TableScan(scan) = node {
            let sluice = source_as_provider(&scan.source)
                .is_ok_and(|p| p.downcast_ref::<super::provider::SluiceTable>().is_some());
            if !sluice {
                immutable = false;
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        node.apply_expressions(|expr| {
            expr.apply(|e| {
                let volatility = match e {
                    Expr::ScalarFunction(f) => Some(f.func.signature().volatility),
                    Expr::AggregateFunction(f) => Some(f.func.signature().volatility),
                    Expr::WindowFunction(f) => Some(f.fun.signature().volatility),
                    _ => None,
                };
                if volatility.is_some_and(|v| v != Volatility::Immutable) {
                    immutable = false;
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })?;
        Ok(match immutable {
            true => TreeNodeRecursion::Continue,
            false => TreeNodeRecursion::Stop,
        })
    });
    visited.is_ok() && immutable
}

#[cfg(test)]
mod tests {
    use datafusion::execution::session_state::SessionStateBuilder;
    use datafusion::sql::parser::DFParser;

    use super::*;

    fn session() -> CatalogSession {
        let state = SessionStateBuilder::new().with_default_features().build();
        CatalogSession::new(1, state)
    }

    async fn planned(session: &CatalogSession, sql: &str) -> (DfStatement, LogicalPlan) {
        let mut parsed = DFParser::parse_sql(sql).unwrap();
        let statement = parsed.pop_front().unwrap();
        // As a statement's state is: started now (`now()` is folded while planning).
        let mut state = session.state.clone();
        state.mark_start_execution();
        let plan = state.statement_to_plan(statement.clone()).await.unwrap();
        (statement, plan)
    }

    fn reused(plan: &LogicalPlan) -> ReusedPlan {
        ReusedPlan {
            optimized: plan.clone(),
            schema: Arc::new(plan.schema().as_arrow().clone()),
        }
    }

    async fn keep(s: &CatalogSession, sql: &str) -> DfStatement {
        let (statement, plan) = planned(s, sql).await;
        s.keep(&statement, &plan, &reused(&plan));
        statement
    }

    #[tokio::test]
    async fn plans_calling_functions_of_the_moment_are_not_kept() {
        let s = session();
        for sql in [
            "SELECT now()",
            "SELECT random() AS r",
            "SELECT 1 WHERE 1 IN (SELECT CAST(extract(year FROM now()) AS INT))",
            "SELECT x FROM (SELECT current_date AS x) AS d",
            "SELECT count(*) FROM (VALUES (1), (2)) AS v(a) HAVING max(a) > random()",
            // The arguments of a table function are evaluated while planning.
            "SELECT value FROM generate_series(now(), now(), INTERVAL '1 second')",
            "SELECT value FROM range(1, 3)",
        ] {
            let (statement, plan) = planned(&s, sql).await;
            assert!(!reusable(&plan), "{sql}");
            s.keep(&statement, &plan, &reused(&plan));
            assert!(s.plan(&statement).is_none(), "{sql}");
        }
        let statement = keep(&s, "SELECT abs(-1) + 1, upper('a')").await;
        assert!(s.plan(&statement).is_some());
    }

    #[tokio::test]
    async fn only_queries_are_kept() {
        let s = session();
        let statement = keep(&s, "EXPLAIN SELECT 1").await;
        assert!(s.plan(&statement).is_none());
        assert_eq!(s.plans(), (0, 0));
    }

    #[tokio::test]
    async fn kept_plans_are_bounded_and_the_least_recently_used_goes() {
        let s = session();
        let first = keep(&s, "SELECT 0").await;
        for i in 1..MAX_PLANS + 50 {
            // The first statement stays in use; the others are sent once each.
            assert!(s.plan(&first).is_some(), "statement 0 went at {i}");
            keep(&s, &format!("SELECT {i}")).await;
            assert!(s.plans().0 <= MAX_PLANS);
        }
        assert_eq!(s.plans().0, MAX_PLANS);
        let (gone, _) = planned(&s, "SELECT 1").await;
        assert!(s.plan(&gone).is_none());
        let (newest, _) = planned(&s, &format!("SELECT {}", MAX_PLANS + 49)).await;
        assert!(s.plan(&newest).is_some());
    }

    /// `sql` planned and optimized, as the engine keeps it.
    async fn optimized(s: &CatalogSession, sql: &str) -> (DfStatement, LogicalPlan, ReusedPlan) {
        let (statement, planned) = planned(s, sql).await;
        let plan = ReusedPlan {
            optimized: s.state.optimize(&planned).unwrap(),
            schema: Arc::new(planned.schema().as_arrow().clone()),
        };
        (statement, planned, plan)
    }

    #[tokio::test]
    async fn kept_plans_are_bounded_in_bytes_whatever_their_text() {
        let s = session();
        // Short statements whose plans hold a 200 KB constant: fewer fit than MAX_PLANS.
        let large = |i: usize| format!("SELECT repeat('x', 200000) || '{i}' AS x");
        let (first, planned, plan) = optimized(&s, &large(0)).await;
        s.keep(&first, &planned, &plan);
        for i in 1..200 {
            assert!(s.plan(&first).is_some(), "statement 0 went at {i}");
            let (statement, planned, plan) = optimized(&s, &large(i)).await;
            s.keep(&statement, &planned, &plan);
            let (count, weight) = s.plans();
            assert!(weight <= MAX_KEPT_WEIGHT, "{weight} bytes in {count} plans");
        }
        let (count, weight) = s.plans();
        assert!(count > 50 && count < 100, "{count} plans of {weight} bytes");
        // Sent again, a kept statement is not counted twice.
        let (statement, planned, plan) = optimized(&s, &large(0)).await;
        s.keep(&statement, &planned, &plan);
        assert_eq!(s.plans(), (count, weight));

        // Not kept: a constant over the bound, a subquery copied into every use of a chain
        // of CTEs (2^11 copies from 600 bytes of text), a statement over its bound.
        // CTEs c1..c{links}, each the union of two copies of the one before.
        let chain = |links: usize| {
            (1..=links)
                .map(|i| {
                    format!(
                        "c{i} AS (SELECT * FROM c{0} UNION ALL SELECT * FROM c{0})",
                        i - 1
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (wide, chain) = (chain(7), chain(11));
        // A wide struct type in every copy of a CTE chain: 2^7 projections of 600 fields.
        let fields = vec!["1"; 600].join(",");
        for sql in [
            format!("WITH c0 AS (SELECT struct({fields}) AS s), {wide} SELECT * FROM c7"),
            "SELECT repeat('x', 5000000) || 'y' AS x".to_string(),
            format!("WITH c0 AS (SELECT 1 AS a), {chain} SELECT count(*) FROM c11"),
            format!("SELECT '{}' AS x", "x".repeat(MAX_KEPT_STATEMENT_BYTES)),
        ] {
            let (statement, planned, plan) = optimized(&s, &sql).await;
            s.keep(&statement, &planned, &plan);
            assert!(s.plan(&statement).is_none(), "{}", &sql[..60]);
        }
    }

    #[test]
    fn nested_fields_are_weighed_and_the_walk_stops_at_the_bound() {
        use arrow_schema::{Field, Fields};
        let leaf = Field::new("leaf", DataType::Int64, true);
        let wide = Field::new_struct("wide", vec![leaf.clone(); 600], true);
        let mut weight = 0;
        assert!(add_fields(&mut weight, std::iter::once(&wide), usize::MAX));
        assert!(weight > 600 * 128, "{weight}");
        // struct(s, s) nested 60 deep: 2^60 fields to visit, weighed up to the bound only.
        let mut shared = leaf;
        for _ in 0..60 {
            let child = Arc::new(shared);
            shared = Field::new(
                "s",
                DataType::Struct(Fields::from(vec![child.clone(), child])),
                true,
            );
        }
        let mut weight = 0;
        assert!(!add_fields(&mut weight, std::iter::once(&shared), 1 << 20));
        assert!(weight <= (1 << 20) + 256, "{weight}");
    }

    #[test]
    fn only_a_newer_session_replaces_the_kept_one() {
        let sessions = Sessions::default();
        let state = || SessionStateBuilder::new().build();
        sessions.keep(Arc::new(CatalogSession::new(5, state())));
        sessions.keep(Arc::new(CatalogSession::new(4, state())));
        assert!(sessions.get(5).is_some());
        assert!(sessions.get(4).is_none());
        sessions.keep(Arc::new(CatalogSession::new(6, state())));
        assert!(sessions.get(5).is_none());
        assert!(sessions.get(6).is_some());
    }
}
