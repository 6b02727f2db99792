//! Queries: SQL through DataFusion over every table's files and unflushed batches, ScopeQL
//! pipelines translated to SQL, and the parsing of sluice's catalog statements.
//!
//! The query engine only reads. A statement is parsed once (`prepare`) into a
//! `Prepared` statement that says what it needs (`Access`); writes (`INSERT`) and catalog
//! changes run through [`crate::db::Database`], which owns the one write path. A query's
//! plan is checked again to be free of DDL, DML and session statements, and it runs on a
//! runtime of its own (`runtime`) whose DataFusion environment reaches only sluice's store.
//!
//! What a statement may cost is bounded before it is spent: each statement has a budget
//! (`budget`: memory in the server's statement pool, a deadline, a stop flag), its plan's
//! size is checked before it is optimized (`plan_limits`), it plans on a thread of its own
//! that stops at checkpoints (`runtime`), and every function it calls checks what its result
//! can take before it runs (`guard`).
//!
//! A table is named `db.schema.table` (DataFusion's catalog.schema.table); `scopedb.public` is
//! the default, so `FROM events` works too.

mod bounded_aggregates;
mod budget;
pub(crate) mod ddl;
mod dictionary_scan;
mod grouping;
mod guard;
mod json_functions;
mod lex;
mod operator_memory;
mod plan_limits;
mod prepare;
mod provider;
mod pruning;
mod runtime;
mod scopeql;
mod sessions;
pub(crate) mod statements;
mod time_functions;
mod topn;
mod wrapped_udf;

use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::{
    CatalogProvider, MemoryCatalogProvider, MemoryCatalogProviderList, MemorySchemaProvider,
};
use datafusion::error::DataFusionError;
use datafusion::execution::TaskContext;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::session_state::{SessionState, SessionStateBuilder};
use datafusion::physical_plan::execute_stream;
use datafusion::prelude::{SQLOptions, SessionConfig, SessionContext};
pub(crate) use datafusion::sql::parser::Statement as DfStatement;
use futures::StreamExt as _;

use crate::catalog::{Catalog, CatalogError, DEFAULT_DATABASE, DEFAULT_SCHEMA};
use crate::error::{Cause, Classify, ErrorClass, Kind};
use crate::ingest::IngestError;
use crate::storage::Storage;
use crate::table::{TableError, Tables};
use crate::types::ColumnType;
use crate::types::cell::format_cell;
pub(crate) use prepare::Access;
pub(crate) use prepare::{Insert, InsertColumns, Prepared};

/// A statement parsed, and the server's statement memory its text reserved for its syntax
/// tree and plans, held until it is dropped (when the statement has run).
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) statement: Prepared,
    pub(crate) text_hold: datafusion::execution::memory_pool::MemoryReservation,
}

impl Parsed {
    /// What the statement needs to run.
    pub(crate) fn access(&self) -> Access {
        self.statement.access()
    }
}
pub(crate) use runtime::QueryLimits;
use runtime::StatementRuntime;

/// Why a statement failed.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The statement does not parse.
    #[error("syntax error at line {line}, column {column}: {message}")]
    Syntax {
        /// What is wrong.
        message: String,
        /// 1-based line (0 when unknown).
        line: usize,
        /// 1-based column (0 when unknown).
        column: usize,
    },
    /// The statement is longer or nests deeper than sluice parses.
    #[error("statement too complex: {0}")]
    TooComplex(String),
    /// A statement kind sluice does not run.
    #[error("{0}")]
    Unsupported(String),
    /// DataFusion refused or failed the query.
    #[error("{0}")]
    Query(String),
    /// Rows an `INSERT` produced do not fit the table; nothing was written.
    #[error(transparent)]
    Rows(#[from] IngestError),
    /// An `INSERT`'s source does not match the table (columns, counts); nothing was written.
    #[error("{0}")]
    Invalid(String),
    /// An `INSERT`'s rows failed on the write path every table write takes, as ingest's
    /// would (the same class, the same answer).
    #[error(transparent)]
    Write(crate::ingest::IngestFailure),
    /// A catalog change failed.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// Table storage failed.
    #[error(transparent)]
    Table(#[from] TableError),
    /// The result is larger than a statement may return.
    #[error(
        "the result is larger than {limit} {unit}; add a LIMIT or aggregate (statement results are capped)"
    )]
    ResultTooLarge {
        /// The limit.
        limit: usize,
        /// `rows` or `bytes`.
        unit: &'static str,
    },
    /// The statement ran longer than it may.
    #[error("statement stopped after {0} seconds (the statement timeout)")]
    Timeout(u64),
    /// The statement's work panicked (a bug in the server, reported rather than left
    /// running). `wrote`: it had begun writing, so rows may have been applied.
    #[error("the statement failed inside the server; this is a bug")]
    Panicked {
        /// Whether the statement had begun writing.
        wrote: bool,
    },
    /// The statement was cancelled.
    #[error("statement cancelled")]
    Cancelled,
    /// The statement needs more memory than it may have (`retry`: false), or than the
    /// server's statement memory has left while other statements hold the rest (`retry`:
    /// true). Nothing was applied.
    #[error("resources exhausted: {message}")]
    ResourcesExhausted {
        /// What was asked for, and the limit.
        message: String,
        /// Whether the same statement may succeed once other statements end.
        retry: bool,
    },
}

impl Classify for QueryError {
    fn class(&self) -> ErrorClass {
        match self {
            QueryError::Syntax { .. } => ErrorClass::rejected(Kind::Syntax),
            QueryError::TooComplex(_) => ErrorClass::rejected(Kind::TooComplex),
            QueryError::Unsupported(_) => ErrorClass::rejected(Kind::Unsupported),
            QueryError::Query(_) => ErrorClass::rejected(Kind::QueryFailed),
            QueryError::Rows(e) => e.class(),
            QueryError::Write(e) => e.class(),
            QueryError::Invalid(_) => ErrorClass::rejected(Kind::Invalid),
            QueryError::Catalog(e) => e.class(),
            QueryError::Table(e) => e.class(),
            QueryError::ResultTooLarge { .. } => ErrorClass::rejected(Kind::ResultTooLarge),
            QueryError::Timeout(_) => ErrorClass::rejected(Kind::Timeout),
            QueryError::Panicked { wrote: false } => ErrorClass::rejected(Kind::Internal),
            QueryError::Panicked { wrote: true } => ErrorClass::unknown(Kind::Internal),
            // A statement is cancelled only before it writes anything (see
            // `query::statements`).
            QueryError::Cancelled => ErrorClass::rejected(Kind::Cancelled),
            // Other statements hold the memory: the same statement may succeed shortly.
            QueryError::ResourcesExhausted { retry: true, .. } => {
                ErrorClass::retry(Cause::StatementMemory)
            }
            QueryError::ResourcesExhausted { retry: false, .. } => {
                ErrorClass::rejected(Kind::ResourcesExhausted)
            }
        }
    }
}

impl QueryError {
    /// A syntax error at byte `offset` of `text`.
    pub(crate) fn syntax(text: &str, message: String, offset: usize) -> QueryError {
        let before = &text[..offset.min(text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        QueryError::Syntax {
            message: bounded_error_text(message),
            line,
            column,
        }
    }
}

/// The object-store failure under a DataFusion error, however it is wrapped, as text.
fn object_store_failure(e: &DataFusionError) -> Option<String> {
    let mut at: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = at {
        if let Some(store) = error.downcast_ref::<object_store::Error>() {
            return Some(store.to_string());
        }
        at = error.source();
    }
    None
}

/// The most bytes of an error's text kept with a statement or sent: a message may quote a
/// value of the statement's own making (a failed cast names the string it could not cast),
/// and a failed statement is kept, and its answer rendered, as often as it is fetched.
pub(crate) const MAX_ERROR_TEXT_BYTES: usize = 4 << 10;

/// `text` cut to [`MAX_ERROR_TEXT_BYTES`] (at a character boundary), saying how much went.
pub(crate) fn bounded_error_text(mut text: String) -> String {
    if text.len() <= MAX_ERROR_TEXT_BYTES {
        return text;
    }
    let mut cut = MAX_ERROR_TEXT_BYTES;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let elided = text.len() - cut;
    text.truncate(cut);
    text.push_str(&format!("… ({elided} bytes elided)"));
    text
}

impl From<DataFusionError> for QueryError {
    fn from(e: DataFusionError) -> Self {
        match e {
            DataFusionError::SQL(parse, _) => QueryError::Syntax {
                message: bounded_error_text(parse.to_string()),
                line: 0,
                column: 0,
            },
            // A shape refused where DataFusion plans it (a type string nested too deep).
            other
                if matches!(other.find_root(), DataFusionError::External(e)
                    if e.is::<plan_limits::TooComplex>()) =>
            {
                let message = match other.find_root() {
                    DataFusionError::External(e) => e.to_string(),
                    root => root.strip_backtrace(),
                };
                QueryError::TooComplex(bounded_error_text(message))
            }
            // Table storage failing under a scan is the server's trouble, not the query's.
            DataFusionError::External(e) => match e.downcast::<TableError>() {
                Ok(table) => QueryError::Table(*table),
                Err(other) => QueryError::Query(bounded_error_text(
                    DataFusionError::External(other).strip_backtrace(),
                )),
            },
            DataFusionError::ObjectStore(e) => QueryError::Table(TableError::Storage(*e)),
            other => {
                // The Parquet reader wraps a failed read of a data file (one that garbage
                // collection took after a compaction replaced it, while this statement's view
                // still named it), and operators share or annotate it on the way up: the
                // server's trouble too, however deep, and a retry reads afresh.
                if let Some(text) = object_store_failure(&other) {
                    return QueryError::Table(TableError::Storage(object_store::Error::Generic {
                        store: "object store",
                        source: text.into(),
                    }));
                }
                match other.find_root() {
                    // An exhausted budget, however deeply DataFusion wrapped it. (Statements
                    // classify it with their budget, which knows whether other statements hold
                    // the memory: `budget::StatementBudget::error`.)
                    DataFusionError::ResourcesExhausted(message) => {
                        QueryError::ResourcesExhausted {
                            message: bounded_error_text(message.clone()),
                            retry: false,
                        }
                    }
                    // DataFusion wraps our own errors as External; surface the message cleanly.
                    _ => QueryError::Query(bounded_error_text(other.strip_backtrace())),
                }
            }
        }
    }
}

/// One field of a result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultField {
    /// Column name.
    pub name: String,
    /// sluice type name (`int`, `string`, ..., or `null`).
    pub data_type: String,
}

/// A statement's result: fields and rows in the statements API's cell form.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QueryResult {
    /// The fields.
    pub fields: Vec<ResultField>,
    /// Rows of cells (`None` is SQL NULL).
    pub rows: Vec<Vec<Option<String>>>,
}

/// A statement's output as Arrow: what the statements API renders, cell by cell, when asked.
#[derive(Debug, Clone)]
pub(crate) struct StatementOutput {
    /// The result's schema.
    pub schema: SchemaRef,
    /// The rows.
    pub batches: Vec<RecordBatch>,
    /// The rows' size in the statements API's JSON.
    pub rendered: RenderedSize,
}

/// The size of rows in the statements API's JSON form, counted exactly as they are
/// written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RenderedSize {
    /// All the rows (with a comma after each).
    pub bytes: usize,
    /// The largest cell that is not a string or binary: one a fetch writes whole (text is
    /// written a part at a time, whatever its size).
    pub largest_whole_cell: usize,
}

impl RenderedSize {
    /// `batch`'s rows, counted cell by cell (every cell written to a counter, none built),
    /// or `None` once the count passes `limit` (so counting a huge result costs no more
    /// than counting `limit` bytes of it).
    pub(crate) fn of(batch: &RecordBatch, limit: usize) -> Option<RenderedSize> {
        use crate::types::cell::{CellWriter, JsonLength, JsonSink as _, write_json_row};
        let cells: Vec<CellWriter<'_>> = batch.columns().iter().map(CellWriter::new).collect();
        let mut count = JsonLength::up_to(limit);
        for row in 0..batch.num_rows() {
            write_json_row(&mut count, &cells, row);
            count.raw(b",");
            if count.over() {
                return None;
            }
        }
        Some(RenderedSize {
            bytes: count.bytes,
            largest_whole_cell: count.largest_whole_cell,
        })
    }

    /// This size and `other`'s together.
    fn add(self, other: RenderedSize) -> RenderedSize {
        RenderedSize {
            bytes: self.bytes.saturating_add(other.bytes),
            largest_whole_cell: self.largest_whole_cell.max(other.largest_whole_cell),
        }
    }
}

impl StatementOutput {
    /// A one-column text result (catalog statements' status lines and listings).
    pub(crate) fn text(column: &str, rows: Vec<String>) -> StatementOutput {
        Self::strings(&[column], rows.into_iter().map(|r| vec![Some(r)]).collect())
    }

    /// A result of text columns.
    pub(crate) fn strings(columns: &[&str], rows: Vec<Vec<Option<String>>>) -> StatementOutput {
        let schema = Arc::new(Schema::new(
            columns
                .iter()
                .map(|c| Field::new(*c, DataType::Utf8, true))
                .collect::<Vec<_>>(),
        ));
        let arrays: Vec<ArrayRef> = (0..columns.len())
            .map(|i| {
                Arc::new(StringArray::from_iter(
                    rows.iter().map(|r| r.get(i).cloned().flatten()),
                )) as ArrayRef
            })
            .collect();
        let batches =
            RecordBatch::try_new(schema.clone(), arrays).map_or_else(|_| Vec::new(), |b| vec![b]);
        StatementOutput::new(schema, batches)
    }

    /// An output of `batches`, measured.
    pub(crate) fn new(schema: SchemaRef, batches: Vec<RecordBatch>) -> StatementOutput {
        let rendered = batches
            .iter()
            .filter_map(|b| RenderedSize::of(b, usize::MAX))
            .fold(RenderedSize::default(), RenderedSize::add);
        StatementOutput {
            schema,
            batches,
            rendered,
        }
    }

    /// The count of inserted rows, as `INSERT` answers it.
    pub(crate) fn inserted(rows: usize) -> StatementOutput {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "num_rows_inserted",
            DataType::Int64,
            false,
        )]));
        let array: ArrayRef = Arc::new(arrow_array::Int64Array::from(vec![
            i64::try_from(rows).unwrap_or(i64::MAX),
        ]));
        let batches = RecordBatch::try_new(schema.clone(), vec![array])
            .map_or_else(|_| Vec::new(), |b| vec![b]);
        StatementOutput::new(schema, batches)
    }

    /// Rows in the result.
    pub(crate) fn num_rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }

    /// What the result weighs: the larger of its Arrow memory and its size once rendered
    /// (what retention counts).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.batches
            .iter()
            .map(RecordBatch::get_array_memory_size)
            .sum::<usize>()
            .max(self.rendered.bytes)
    }

    /// The result's fields with their sluice type names.
    pub(crate) fn fields(&self) -> Vec<ResultField> {
        self.schema
            .fields()
            .iter()
            .map(|f| ResultField {
                name: f.name().clone(),
                data_type: sluice_type_name(f).to_owned(),
            })
            .collect()
    }

    /// The result in the cell form (every value a string or null).
    pub(crate) fn to_result(&self) -> QueryResult {
        let mut rows = Vec::with_capacity(self.num_rows());
        for batch in &self.batches {
            for r in 0..batch.num_rows() {
                rows.push(batch.columns().iter().map(|c| format_cell(c, r)).collect());
            }
        }
        QueryResult {
            fields: self.fields(),
            rows,
        }
    }
}

/// What a field takes in a result's metadata: its name, escaped, and the object around it
/// with its type's name.
fn field_metadata_bytes(name: &str) -> usize {
    use std::fmt::Write as _;
    let mut count = crate::types::cell::JsonLength::up_to(usize::MAX);
    let _ = count.write_str(name);
    count.bytes.saturating_add(64)
}

/// The sluice type name of a result field.
pub(crate) fn sluice_type_name(field: &Field) -> &'static str {
    if let Some(t) = ColumnType::from_field(field) {
        return t.as_str();
    }
    match field.data_type() {
        DataType::Null => "null",
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => "int",
        DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => "uint",
        DataType::Float16 | DataType::Float32 | DataType::Float64 => "float",
        DataType::Decimal32(..)
        | DataType::Decimal64(..)
        | DataType::Decimal128(..)
        | DataType::Decimal256(..) => "float",
        DataType::Boolean => "boolean",
        DataType::Timestamp(..) | DataType::Date32 | DataType::Date64 => "timestamp",
        DataType::Duration(_) => "interval",
        DataType::Binary
        | DataType::LargeBinary
        | DataType::BinaryView
        | DataType::FixedSizeBinary(_) => "binary",
        DataType::List(_)
        | DataType::LargeList(_)
        | DataType::FixedSizeList(..)
        | DataType::ListView(_) => "array",
        DataType::Struct(_) | DataType::Map(..) => "object",
        _ => "string",
    }
}

/// What a statement needs to run (for embedders that check permissions themselves, and the
/// fuzz target): it is parsed exactly as it would be run.
pub fn statement_access(text: &str) -> Result<Access, QueryError> {
    prepare::prepare(text).map(|p| p.access())
}

/// An upper bound on how deeply an expression's text nests once parsed (see
/// [`lex::expression_depth`]).
pub(crate) fn expression_depth(text: &str) -> usize {
    lex::expression_depth(text)
}

/// A table name of one to three parts, with the default database and schema filled in.
pub(crate) fn qualify(name: &[String]) -> Result<(String, String, String), QueryError> {
    match name {
        [t] => Ok((DEFAULT_DATABASE.into(), DEFAULT_SCHEMA.into(), t.clone())),
        [s, t] => Ok((DEFAULT_DATABASE.into(), s.clone(), t.clone())),
        [d, s, t] => Ok((d.clone(), s.clone(), t.clone())),
        _ => Err(QueryError::Invalid(format!(
            "{:?} is not a table name: use [database.][schema.]table",
            name.join(".")
        ))),
    }
}

/// The session statements start from (see [`QueryEngine::base`]): every function guarded,
/// a checkpoint between analyzer and optimizer rules (see [`plan_limits`]).
fn base_session(env: Arc<RuntimeEnv>, limits: &QueryLimits) -> Result<SessionState, QueryError> {
    use datafusion::optimizer::analyzer::{Analyzer, AnalyzerRule};
    use datafusion::optimizer::{Optimizer, OptimizerRule};
    let config = SessionConfig::new()
        .with_default_catalog_and_schema(DEFAULT_DATABASE, DEFAULT_SCHEMA)
        .with_information_schema(true);
    let checkpoint = Arc::new(plan_limits::Checkpoint);
    let mut analyzer: Vec<Arc<dyn AnalyzerRule + Send + Sync>> =
        vec![Arc::new(plan_limits::CheckTypes {
            max_value_bytes: limits.memory_bytes / guard::PLAN_CONSTANT_SHARE,
        })];
    analyzer.extend(plan_limits::with_checkpoints(
        Analyzer::new().rules,
        checkpoint.clone() as _,
    ));
    analyzer.push(Arc::new(plan_limits::GuardFunctions {
        limit: limits.memory_bytes,
    }));
    let optimizer: Vec<Arc<dyn OptimizerRule + Send + Sync>> =
        plan_limits::with_checkpoints(Optimizer::new().rules, checkpoint as _);
    let state = SessionStateBuilder::new()
        .with_config(config)
        .with_runtime_env(env)
        .with_default_features()
        .with_analyzer_rules(analyzer)
        .with_optimizer_rules(optimizer)
        .with_physical_optimizer_rule(Arc::new(topn::UnionTopN))
        // After `UnionTopN`, which looks for a union right under the sort.
        .with_physical_optimizer_rule(Arc::new(topn::BatchTopN))
        .with_physical_optimizer_rule(Arc::new(pruning::ColumnPruning))
        .with_physical_optimizer_rule(Arc::new(grouping::KeyedGrouping::new(
            grouping::Limits::DEFAULT,
        )))
        // Last: it wraps the joins and windows the rules before it placed.
        .with_physical_optimizer_rule(Arc::new(operator_memory::BoundOperatorOutput))
        .build();
    let mut ctx = SessionContext::new_with_state(state);
    // v['k'] in ScopeQL, and json_get* in SQL.
    json_functions::register(&mut ctx)?;
    time_functions::register(&mut ctx);
    guard::guard_functions(&mut ctx, limits.memory_bytes);
    bounded_aggregates::register(&mut ctx, limits.memory_bytes);
    bounded_aggregates::charge_emitted(&mut ctx, limits.memory_bytes);
    Ok(ctx.state())
}

/// A DataFusion context for expressions evaluated outside statements (computed columns):
/// DataFusion's functions, guarded with `limit` bytes per call (see [`guard`]).
pub(crate) fn guarded_context(limit: usize) -> SessionContext {
    let mut ctx = SessionContext::new();
    guard::guard_functions(&mut ctx, limit);
    ctx
}

/// `expr` over `schema`, with its functions guarded and its string operators rewritten into
/// guarded functions (see [`guard`]), with `limit` bytes per call.
pub(crate) fn guarded_expression(
    expr: datafusion::logical_expr::Expr,
    schema: &datafusion::common::DFSchema,
    limit: usize,
) -> Result<datafusion::logical_expr::Expr, DataFusionError> {
    guard::guard_expression(expr, schema, limit)
}

/// The session statements start from, for tests that look at the engine's registry.
#[cfg(test)]
pub(crate) fn testing_session(limits: QueryLimits) -> SessionState {
    let store: Arc<dyn object_store::ObjectStore> = Arc::new(object_store::memory::InMemory::new());
    let env = runtime::runtime_env(provider::STORE_URL, store, &limits).unwrap();
    base_session(env, &limits).unwrap()
}

/// Runs read-only queries against one sluice database.
#[derive(Debug, Clone)]
pub(crate) struct QueryEngine {
    catalog: Arc<Catalog>,
    tables: Arc<Tables>,
    /// The session every statement starts from: configuration, optimizer rules, functions
    /// (sluice's included) and the runtime environment, which holds the object store and
    /// the cache of Parquet footers and page indexes (so a query does not fetch and parse
    /// them again). Building it registers some hundreds of functions; the session of each
    /// catalog version clones it instead, which costs a fraction of that.
    base: Arc<SessionState>,
    /// The session of the newest catalog version, with its plans (see [`sessions`]).
    sessions: Arc<sessions::Sessions>,
    runtime: Arc<StatementRuntime>,
    limits: QueryLimits,
    /// The server's statement memory, which each statement's budget draws from.
    memory: Arc<dyn datafusion::execution::memory_pool::MemoryPool>,
}

/// What a query's plan may contain: no DDL, no DML (`INSERT`, `COPY`), no session
/// statements (`SET`, transactions).
fn read_only() -> SQLOptions {
    SQLOptions::new()
        .with_allow_ddl(false)
        .with_allow_dml(false)
        .with_allow_statements(false)
}

impl QueryEngine {
    /// An engine over this catalog, these tables and their object store.
    pub(crate) fn new(
        catalog: Arc<Catalog>,
        tables: Arc<Tables>,
        storage: Storage,
        limits: QueryLimits,
    ) -> Result<Self, QueryError> {
        let env = runtime::runtime_env(provider::STORE_URL, storage.store().clone(), &limits)?;
        let runtime = StatementRuntime::new()
            .map_err(|e| QueryError::Query(format!("cannot start the query runtime: {e}")))?;
        let memory = Arc::clone(&env.memory_pool);
        let base = Arc::new(base_session(env, &limits)?);
        Ok(QueryEngine {
            catalog,
            tables,
            base,
            sessions: Arc::new(sessions::Sessions::default()),
            runtime: Arc::new(runtime),
            limits,
            memory,
        })
    }

    /// Parses and classifies a statement (on the statement runtime's threads: parsing
    /// recurses). What its syntax tree and plans can take ([`prepare::text_bytes`]) is
    /// reserved in the server's statement memory before the parse, until the statement
    /// ends (see [`Parsed`]).
    pub(crate) async fn prepare(&self, text: String) -> Result<Parsed, QueryError> {
        // A text past the length cap is refused by the parse's own check, at once.
        let bytes = if text.len() > prepare::MAX_STATEMENT_BYTES {
            0
        } else {
            prepare::text_bytes(&text)
        };
        let refused = |message: String, retry: bool| QueryError::ResourcesExhausted {
            message: format!(
                "a statement of {} bytes takes about {bytes} bytes to parse and plan: \
                 {message}",
                text.len()
            ),
            retry,
        };
        if bytes > self.limits.memory_bytes {
            return Err(refused(
                format!(
                    "more than a statement may use (query_memory_bytes, {} bytes)",
                    self.limits.memory_bytes
                ),
                false,
            ));
        }
        let text_hold = datafusion::execution::memory_pool::MemoryConsumer::new("statement text")
            .register(&self.memory);
        text_hold.try_grow(bytes).map_err(|_| {
            refused(
                "the running statements hold the server's statement memory; retry shortly".into(),
                true,
            )
        })?;
        let statement = self
            .runtime
            .run_blocking(move || prepare::prepare(&text))
            .await
            .map_err(QueryError::Query)??;
        Ok(Parsed {
            statement,
            text_hold,
        })
    }

    /// Statement work that has not ended on the statement runtime (a cancelled statement
    /// counts until its work stops).
    pub(crate) fn in_flight(&self) -> usize {
        self.runtime.in_flight()
    }

    /// A DataFusion session that sees every table of the catalog as it is now: the kept
    /// one while the catalog has not changed (see [`sessions`]).
    async fn session(&self) -> Result<Arc<sessions::CatalogSession>, QueryError> {
        if let Some(kept) = self.sessions.get(self.catalog.version().await) {
            return Ok(kept);
        }
        let listing = self.catalog.listing().await;
        let mut state = self.base.as_ref().clone();
        // The base's catalogs are shared by its clones: each session gets its own.
        state.register_catalog_list(Arc::new(MemoryCatalogProviderList::new()));
        let ctx = SessionContext::new_with_state(state);
        // The default database answers "no such table" even when the catalog has none.
        let default = Arc::new(MemoryCatalogProvider::new());
        default.register_schema(DEFAULT_SCHEMA, Arc::new(MemorySchemaProvider::new()))?;
        ctx.register_catalog(DEFAULT_DATABASE, default);
        for (db, schemas) in listing.schemas {
            let catalog = Arc::new(MemoryCatalogProvider::new());
            for s in schemas {
                catalog.register_schema(&s, Arc::new(MemorySchemaProvider::new()))?;
            }
            ctx.register_catalog(&db, catalog);
        }
        // Whether every table's storage exists (its schema is then the stored one for the
        // table's life): only then may the session be kept.
        let mut keep = true;
        for t in listing.tables {
            // A table in the catalog whose storage does not exist yet reads as empty; a query
            // never creates storage.
            match self.tables.schema(&t.id).await {
                Ok(_) => {}
                Err(TableError::NotFound(_)) => keep = false,
                Err(e) => return Err(e.into()),
            }
            // The catalog's shape: files and batches of any earlier one are read by column id.
            let schema = crate::types::arrow_schema_with_ids(&t.columns()?, &t.def.column_ids());
            let table = Arc::new(provider::SluiceTable::new(
                t.id.clone(),
                &schema,
                self.tables.clone(),
            ));
            if let Some(s) = ctx.catalog(&t.database).and_then(|c| c.schema(&t.schema)) {
                s.register_table(t.def.name.clone(), table)?;
            }
        }
        let session = Arc::new(sessions::CatalogSession::new(listing.version, ctx.state()));
        if keep {
            self.sessions.keep(Arc::clone(&session));
        }
        Ok(session)
    }

    /// Runs a read-only query to completion, within the statement limits: its budget
    /// (memory, deadline) and its plan's caps (see the module docs).
    /// `text` is what the statement's text reserved ([`Parsed`]): it counts against the
    /// statement's own budget from here.
    pub(crate) async fn query(
        &self,
        statement: DfStatement,
        text: Option<datafusion::execution::memory_pool::MemoryReservation>,
    ) -> Result<StatementOutput, QueryError> {
        let engine = self.clone();
        let timeout = self.limits.timeout;
        let budget =
            budget::StatementBudget::holding(&self.memory, self.limits.memory_bytes, timeout, text);
        let run = {
            let budget = Arc::clone(&budget);
            async move { engine.query_inner(statement, &budget).await }
        };
        // Whatever ends the wait (an answer, the timeout, a cancel that drops it) stops the
        // statement: its planning thread and its functions see the flag at their next
        // checkpoint. Its memory is returned once its threads have ended.
        let _stop = budget::CancelOnDrop(Arc::clone(&budget));
        let until_ended = budget::StopOnDrop(Arc::clone(&budget));
        // The timeout is kept here, not on the statement's threads: it answers even while
        // one of them is inside a poll that does not return for minutes.
        match tokio::time::timeout(timeout, self.runtime.run(run, until_ended)).await {
            Ok(Ok(result)) => result,
            Ok(Err(runtime::ThreadError::NoThread(message))) => {
                Err(QueryError::ResourcesExhausted {
                    message,
                    retry: true,
                })
            }
            Ok(Err(runtime::ThreadError::Panicked)) => Err(QueryError::Panicked { wrote: false }),
            Err(_) => {
                budget.time_out();
                Err(QueryError::Timeout(timeout.as_secs()))
            }
        }
    }

    async fn query_inner(
        &self,
        statement: DfStatement,
        budget: &Arc<budget::StatementBudget>,
    ) -> Result<StatementOutput, QueryError> {
        let session = self.session().await?;
        let state = session.state(budget);
        let kept = session.plan(&statement);
        let planning = {
            let budget = Arc::clone(budget);
            move |handle: &tokio::runtime::Handle| {
                plan(handle, session, state, statement, kept, &budget)
            }
        };
        let (state, plan, physical) = match self.runtime.plan(planning).await {
            Ok(planned) => planned?,
            Err(runtime::ThreadError::NoThread(message)) => {
                return Err(QueryError::ResourcesExhausted {
                    message,
                    retry: true,
                });
            }
            Err(runtime::ThreadError::Panicked) => {
                return Err(QueryError::Panicked { wrote: false });
            }
        };
        let task = TaskContext::from(&state).with_runtime(runtime::statement_env(
            state.runtime_env(),
            Arc::clone(budget.pool()),
        ));
        let result = self.collect(physical, Arc::new(task), plan.schema).await;
        result.map_err(|e| match e {
            Collected::DataFusion(e) => budget.error(e),
            Collected::Query(e) => e,
        })
    }

    /// Runs `physical` and gathers its rows, within the result limits.
    async fn collect(
        &self,
        physical: Arc<dyn datafusion::physical_plan::ExecutionPlan>,
        task: Arc<TaskContext>,
        schema: SchemaRef,
    ) -> Result<StatementOutput, Collected> {
        let mut stream = execute_stream(physical, task).map_err(Collected::DataFusion)?;
        let mut batches = Vec::new();
        let mut rows = 0usize;
        // The fields' names are written in every answer's metadata too.
        let mut rendered = RenderedSize {
            bytes: schema
                .fields()
                .iter()
                .map(|f| field_metadata_bytes(f.name()))
                .fold(0usize, usize::saturating_add),
            largest_whole_cell: 0,
        };
        if rendered.bytes > self.limits.max_result_bytes {
            return Err(Collected::Query(QueryError::ResultTooLarge {
                limit: self.limits.max_result_bytes,
                unit: "bytes",
            }));
        }
        while let Some(batch) = stream.next().await {
            let batch = batch.map_err(Collected::DataFusion)?;
            rows += batch.num_rows();
            if rows > self.limits.max_result_rows {
                return Err(Collected::Query(QueryError::ResultTooLarge {
                    limit: self.limits.max_result_rows,
                    unit: "rows",
                }));
            }
            // Counted exactly, as the rows will be written (escapes, nested values and
            // dictionaries' repeats included): what a fetch renders is never more than the
            // limit, whatever the values.
            let room = self.limits.max_result_bytes - rendered.bytes;
            let Some(size) = RenderedSize::of(&batch, room) else {
                return Err(Collected::Query(QueryError::ResultTooLarge {
                    limit: self.limits.max_result_bytes,
                    unit: "bytes",
                }));
            };
            rendered = rendered.add(size);
            batches.push(batch);
        }
        Ok(StatementOutput {
            schema,
            batches,
            rendered,
        })
    }
}

/// Why gathering a result failed: DataFusion's error (classified by the statement's
/// budget), or a limit of sluice's.
enum Collected {
    DataFusion(DataFusionError),
    Query(QueryError),
}

/// What planning answers: the state the statement runs in, its plan and its physical plan.
type Planned = (
    SessionState,
    sessions::ReusedPlan,
    Arc<dyn datafusion::physical_plan::ExecutionPlan>,
);

/// Plans `statement` (on its planning thread; `handle` waits for the asynchronous parts):
/// SQL to a logical plan, whose size is checked and charged before it is analyzed and
/// optimized (unless `kept` is its plan from before), its constants charged, then the
/// physical plan.
fn plan(
    handle: &tokio::runtime::Handle,
    session: Arc<sessions::CatalogSession>,
    state: SessionState,
    statement: DfStatement,
    kept: Option<sessions::ReusedPlan>,
    budget: &budget::StatementBudget,
) -> Result<Planned, QueryError> {
    let fail = |e: DataFusionError| budget.error(e);
    let plan = match kept {
        Some(plan) => plan,
        None => {
            let planned = handle
                .block_on(state.statement_to_plan(statement.clone()))
                .map_err(fail)?;
            let size = plan_limits::check_size(&planned)?;
            budget.hold(size.bytes()).map_err(fail)?;
            read_only().verify_plan(&planned).map_err(fail)?;
            let optimized = state.optimize(&planned).map_err(fail)?;
            plan_limits::check_size(&optimized)?;
            let plan = sessions::ReusedPlan {
                optimized,
                schema: Arc::new(planned.schema().as_arrow().clone()),
            };
            session.keep(&statement, &planned, &plan);
            plan
        }
    };
    let batch_size = state.config().batch_size();
    let constants = plan_limits::broadcast_bytes(&plan.optimized, batch_size);
    budget
        .hold(usize::try_from(constants).unwrap_or(usize::MAX))
        .map_err(fail)?;
    budget.checkpoint().map_err(fail)?;
    // What `SessionState::create_physical_plan` does after optimizing.
    let physical = handle
        .block_on(
            state
                .query_planner()
                .create_physical_plan(&plan.optimized, &state),
        )
        .map_err(fail)?;
    Ok((state, plan, physical))
}

#[cfg(test)]
mod tests {
    #[test]
    fn error_text_is_cut_at_a_character_boundary() {
        let text = "é".repeat(10_000);
        let cut = super::bounded_error_text(text);
        assert!(
            cut.len() < super::MAX_ERROR_TEXT_BYTES + 40,
            "{}",
            cut.len()
        );
        assert!(cut.ends_with("bytes elided)"), "{cut}");
        assert_eq!(super::bounded_error_text("short".into()), "short");
    }

    use super::*;
    use crate::error::Classify;

    /// A data file gone under a scan (collected after a compaction replaced it) is the
    /// server's transient trouble: retryable, nothing applied; never a `query_error`.
    #[test]
    fn a_data_file_gone_under_a_scan_is_retryable() {
        let gone = object_store::Error::NotFound {
            path: "tables/t/data/f.parquet".into(),
            source: "404".into(),
        };
        let error = DataFusionError::ParquetError(Box::new(
            parquet::errors::ParquetError::External(Box::new(gone)),
        ));
        let shared = DataFusionError::Context(
            "scan".into(),
            Box::new(DataFusionError::Shared(std::sync::Arc::new(error))),
        );
        let class = QueryError::from(shared).class();
        assert!(class.is_retryable(), "{class:?}");
        // Other Parquet failures stay the query's.
        let other = DataFusionError::ParquetError(Box::new(
            parquet::errors::ParquetError::General("bad footer".into()),
        ));
        assert!(!QueryError::from(other).class().is_retryable());
    }
}
