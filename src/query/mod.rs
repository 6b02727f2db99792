//! Queries: SQL through DataFusion over every table's files and unflushed batches, and the
//! catalog statements (`CREATE TABLE`, `DROP`, `DESCRIBE`, `SHOW TABLES`) on sluice's catalog.
//!
//! A table is named `db.schema.table` (DataFusion's catalog.schema.table); `scopedb.public` is
//! the default, so `FROM events` works too.

mod ddl;
mod json_functions;
mod lex;
mod provider;
mod pruning;
mod scopeql;
pub mod statements;
mod time_functions;
mod wrapped_udf;

use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{DataType, Field};
use datafusion::catalog::{CatalogProvider, MemoryCatalogProvider, MemorySchemaProvider};
use datafusion::error::DataFusionError;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::catalog::{
    Catalog, CatalogError, CatalogPath, ColumnDef, DEFAULT_DATABASE, DEFAULT_SCHEMA, DatabaseDef,
    MutateOptions, Mutation, SchemaDef, TableDef,
};
use crate::storage::Storage;
use crate::table::{TableError, Tables};
use crate::types::ColumnType;
use crate::types::cell::format_cell;
pub(crate) use ddl::DdlError;
use ddl::{Ddl, DropKind};

/// Why a statement failed.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The statement does not parse.
    #[error("syntax error at line {line}, column {column}: {message}")]
    Syntax {
        /// What is wrong.
        message: String,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
    },
    /// DataFusion refused or failed the query.
    #[error("{0}")]
    Query(String),
    /// A catalog change failed.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// Table storage failed.
    #[error(transparent)]
    Table(#[from] TableError),
    /// The statement was cancelled.
    #[error("statement cancelled")]
    Cancelled,
}

impl From<DataFusionError> for QueryError {
    fn from(e: DataFusionError) -> Self {
        // DataFusion wraps our own errors as External; surface the message cleanly.
        QueryError::Query(e.strip_backtrace())
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

/// The sluice type name of a result field.
pub fn sluice_type_name(field: &Field) -> &'static str {
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

/// Turns batches into a [`QueryResult`].
pub fn to_result(schema: &arrow_schema::Schema, batches: &[RecordBatch]) -> QueryResult {
    let fields = schema
        .fields()
        .iter()
        .map(|f| ResultField {
            name: f.name().clone(),
            data_type: sluice_type_name(f).to_owned(),
        })
        .collect();
    let mut rows = Vec::new();
    for batch in batches {
        for r in 0..batch.num_rows() {
            rows.push(batch.columns().iter().map(|c| format_cell(c, r)).collect());
        }
    }
    QueryResult { fields, rows }
}

fn line_column(sql: &str, offset: usize) -> (usize, usize) {
    let before = &sql[..offset.min(sql.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

fn text_result(column: &str, rows: Vec<String>) -> QueryResult {
    QueryResult {
        fields: vec![ResultField {
            name: column.to_owned(),
            data_type: "string".to_owned(),
        }],
        rows: rows.into_iter().map(|r| vec![Some(r)]).collect(),
    }
}

/// What a statement needs to be allowed to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// It only reads.
    Read,
    /// It writes rows.
    Write,
    /// It changes the catalog.
    Admin,
}

/// Runs statements against one sluice database.
#[derive(Debug, Clone)]
pub struct QueryEngine {
    catalog: Arc<Catalog>,
    tables: Arc<Tables>,
    /// Shared by every statement's session: it holds the object store and the cache of
    /// Parquet footers and page indexes, so a query does not fetch and parse them again.
    runtime: Arc<datafusion::execution::runtime_env::RuntimeEnv>,
}

impl QueryEngine {
    /// An engine over this catalog, these tables and their object store.
    pub fn new(catalog: Arc<Catalog>, tables: Arc<Tables>, storage: Storage) -> Self {
        let runtime = Arc::new(datafusion::execution::runtime_env::RuntimeEnv::default());
        if let Ok(url) = ObjectStoreUrl::parse(provider::STORE_URL) {
            runtime.register_object_store(url.as_ref(), storage.store().clone());
        }
        QueryEngine {
            catalog,
            tables,
            runtime,
        }
    }

    /// A DataFusion session that sees every table of the catalog as it is now.
    pub async fn session(&self) -> Result<SessionContext, QueryError> {
        let config = SessionConfig::new()
            .with_default_catalog_and_schema(DEFAULT_DATABASE, DEFAULT_SCHEMA)
            .with_information_schema(true);
        let state = SessionStateBuilder::new()
            .with_config(config)
            .with_runtime_env(self.runtime.clone())
            .with_default_features()
            .with_physical_optimizer_rule(Arc::new(pruning::ColumnPruning))
            .build();
        let mut ctx = SessionContext::new_with_state(state);
        // v['k'] in ScopeQL, and json_get* in SQL.
        json_functions::register(&mut ctx)?;
        time_functions::register(&mut ctx);
        for (db, schemas) in self.catalog.schemas().await {
            let catalog = Arc::new(MemoryCatalogProvider::new());
            for s in schemas {
                catalog.register_schema(&s, Arc::new(MemorySchemaProvider::new()))?;
            }
            ctx.register_catalog(&db, catalog);
        }
        for t in self.catalog.tables().await {
            let schema = match self.tables.schema(&t.id).await {
                Ok(s) => s,
                // Created in the catalog but its storage is not there yet: create it.
                Err(TableError::NotFound(_)) => {
                    self.tables.create_table(&t.id, &t.columns()?).await?;
                    self.tables.schema(&t.id).await?
                }
                Err(e) => return Err(e.into()),
            };
            let table = Arc::new(provider::SluiceTable::new(
                t.id.clone(),
                &schema,
                self.tables.clone(),
            ));
            if let Some(s) = ctx.catalog(&t.database).and_then(|c| c.schema(&t.schema)) {
                s.register_table(t.def.name.clone(), table)?;
            }
        }
        Ok(ctx)
    }

    /// What a statement would do, for access control: catalog changes are [`Access::Admin`],
    /// `INSERT INTO` pipelines [`Access::Write`], queries and catalog reads [`Access::Read`].
    /// Statements that do not parse are classed as reads; they fail when run.
    pub fn access(sql: &str) -> Access {
        match ddl::parse(sql) {
            Ok(Some(
                ddl::Ddl::Describe { .. }
                | ddl::Ddl::ShowTables
                | ddl::Ddl::ShowDatabases
                | ddl::Ddl::ShowSchemas,
            )) => return Access::Read,
            Ok(Some(_)) => return Access::Admin,
            Ok(None) | Err(_) => {}
        }
        if scopeql::is_scopeql(sql) {
            return match scopeql::parse(sql) {
                Ok(p) if p.insert_into.is_some() => Access::Write,
                _ => Access::Read,
            };
        }
        let first = lex::first_word(sql).to_ascii_uppercase();
        match first.as_str() {
            "SELECT" | "WITH" | "EXPLAIN" | "VALUES" | "SHOW" | "DESCRIBE" | "DESC" | "" => {
                Access::Read
            }
            "INSERT" => Access::Write,
            _ => Access::Admin,
        }
    }

    /// Runs one statement to completion.
    pub async fn execute(&self, sql: &str) -> Result<QueryResult, QueryError> {
        match ddl::parse(sql) {
            Ok(Some(ddl)) => return self.run_ddl(ddl).await,
            Ok(None) => {}
            Err(DdlError { message, offset }) => {
                let (line, column) = line_column(sql, offset);
                return Err(QueryError::Syntax {
                    message,
                    line,
                    column,
                });
            }
        }
        if scopeql::is_scopeql(sql) {
            return self.execute_scopeql(sql).await;
        }
        let ctx = self.session().await?;
        let df = ctx.sql(sql).await.map_err(|e| match e {
            DataFusionError::SQL(parse, _) => QueryError::Syntax {
                message: parse.to_string(),
                line: 0,
                column: 0,
            },
            other => other.into(),
        })?;
        let schema = df.schema().as_arrow().clone();
        let batches = df.collect().await?;
        Ok(to_result(&schema, &batches))
    }

    /// Replaces the catalog subtree at `path` (see [`Catalog::mutate`]), after checking any
    /// computed-column expressions, and creates storage for the tables it adds.
    pub async fn mutate_catalog(
        &self,
        path: &CatalogPath,
        value: Option<serde_json::Value>,
        options: MutateOptions<'_>,
    ) -> Result<Mutation, QueryError> {
        if let (Some(v), CatalogPath::Table(..)) = (&value, path) {
            if let Ok(def) = serde_json::from_value::<TableDef>(v.clone()) {
                crate::db::check_table_def(&def)?;
            }
        }
        let m = self.catalog.mutate(path, value, options).await?;
        for (_, id, def) in &m.created_tables {
            self.tables
                .create_table(id, &crate::catalog::table_columns(def)?)
                .await?;
        }
        Ok(m)
    }

    /// `CREATE TABLE|DATABASE|SCHEMA [IF NOT EXISTS]`: adds `def` at `path` unless something
    /// is there already.
    async fn create(
        &self,
        path: CatalogPath,
        def: impl serde::Serialize,
        label: String,
        if_not_exists: bool,
    ) -> Result<QueryResult, QueryError> {
        if self.catalog.get(&path).await.is_ok() {
            if if_not_exists {
                return Ok(text_result("status", vec![format!("{label} exists")]));
            }
            return Err(CatalogError::Invalid(format!("{label} already exists")).into());
        }
        let value = serde_json::to_value(&def).map_err(|e| QueryError::Query(e.to_string()))?;
        self.mutate_catalog(&path, Some(value), MutateOptions::default())
            .await?;
        Ok(text_result("status", vec![format!("created {label}")]))
    }

    /// Runs a ScopeQL pipeline: translated to SQL, planned by DataFusion; a final
    /// `INSERT INTO t` appends the rows to `t`.
    async fn execute_scopeql(&self, text: &str) -> Result<QueryResult, QueryError> {
        let pipeline = scopeql::parse(text).map_err(|e| {
            let (line, column) = line_column(text, e.offset);
            QueryError::Syntax {
                message: e.message,
                line,
                column,
            }
        })?;
        let ctx = self.session().await?;
        let df = ctx.sql(&pipeline.to_sql()).await?;
        let schema = df.schema().as_arrow().clone();
        let batches = df.collect().await?;
        let Some(target) = &pipeline.insert_into else {
            return Ok(to_result(&schema, &batches));
        };
        let (d, s, t) = Self::qualify(target);
        let table = self.catalog.table(&d, &s, &t).await?;
        let stored = self.tables.schema(&table.id).await?;
        let mut inserted = 0;
        for batch in &batches {
            if batch.num_rows() == 0 {
                continue;
            }
            let columns = stored
                .fields()
                .iter()
                .map(|field| match batch.column_by_name(field.name()) {
                    Some(c) => arrow_cast::cast(c, field.data_type())
                        .map_err(|e| QueryError::Query(format!("column {}: {e}", field.name()))),
                    None => Ok(arrow_array::new_null_array(
                        field.data_type(),
                        batch.num_rows(),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let converted = RecordBatch::try_new(stored.clone(), columns)
                .map_err(|e| QueryError::Query(e.to_string()))?;
            inserted += converted.num_rows();
            self.tables.append(&table.id, converted).await?;
        }
        Ok(QueryResult {
            fields: vec![ResultField {
                name: "num_rows_inserted".into(),
                data_type: "int".into(),
            }],
            rows: vec![vec![Some(inserted.to_string())]],
        })
    }

    fn qualify(name: &[String]) -> (String, String, String) {
        match name {
            [t] => (DEFAULT_DATABASE.into(), DEFAULT_SCHEMA.into(), t.clone()),
            [s, t] => (DEFAULT_DATABASE.into(), s.clone(), t.clone()),
            [d, s, t] => (d.clone(), s.clone(), t.clone()),
            _ => (String::new(), String::new(), String::new()),
        }
    }

    async fn run_ddl(&self, ddl: Ddl) -> Result<QueryResult, QueryError> {
        match ddl {
            Ddl::CreateTable {
                name,
                if_not_exists,
                columns,
            } => {
                let (d, s, t) = Self::qualify(&name);
                let def = TableDef {
                    name: t.clone(),
                    comment: None,
                    columns: columns
                        .into_iter()
                        .map(|(name, t, comment)| ColumnDef {
                            name,
                            data_type: t.as_str().to_owned(),
                            comment,
                            expression: None,
                        })
                        .collect(),
                };
                let label = format!("table {d}.{s}.{t}");
                self.create(CatalogPath::Table(d, s, t), def, label, if_not_exists)
                    .await
            }
            Ddl::CreateDatabase {
                name,
                if_not_exists,
            } => {
                let def = DatabaseDef {
                    name: name.clone(),
                    comment: None,
                    schemas: Vec::new(),
                };
                let label = format!("database {name}");
                self.create(CatalogPath::Database(name), def, label, if_not_exists)
                    .await
            }
            Ddl::CreateSchema {
                name,
                if_not_exists,
            } => {
                let (d, s) = match name.as_slice() {
                    [s] => (DEFAULT_DATABASE.to_owned(), s.clone()),
                    [d, s] => (d.clone(), s.clone()),
                    _ => return Err(CatalogError::Invalid("bad schema name".into()).into()),
                };
                let def = SchemaDef {
                    name: s.clone(),
                    comment: None,
                    tables: Vec::new(),
                };
                let label = format!("schema {d}.{s}");
                self.create(CatalogPath::Schema(d, s), def, label, if_not_exists)
                    .await
            }
            Ddl::Drop {
                kind,
                name,
                if_exists,
            } => {
                let path = match (kind, name.as_slice()) {
                    (DropKind::Database, [d]) => CatalogPath::Database(d.clone()),
                    (DropKind::Schema, [s]) => {
                        CatalogPath::Schema(DEFAULT_DATABASE.into(), s.clone())
                    }
                    (DropKind::Schema, [d, s]) => CatalogPath::Schema(d.clone(), s.clone()),
                    (DropKind::Table, n) if !n.is_empty() => {
                        let (d, s, t) = Self::qualify(n);
                        CatalogPath::Table(d, s, t)
                    }
                    _ => return Err(CatalogError::Invalid("bad name for DROP".into()).into()),
                };
                let drop = MutateOptions {
                    allow_destructive: true,
                    ..MutateOptions::default()
                };
                match self.mutate_catalog(&path, None, drop).await {
                    Ok(_) => Ok(text_result("status", vec!["dropped".into()])),
                    Err(QueryError::Catalog(CatalogError::NotFound { .. })) if if_exists => {
                        Ok(text_result("status", vec!["nothing to drop".into()]))
                    }
                    Err(e) => Err(e),
                }
            }
            Ddl::Describe { name } => {
                let (d, s, t) = Self::qualify(&name);
                let table = self.catalog.table(&d, &s, &t).await?;
                let rows = table
                    .def
                    .columns
                    .iter()
                    .map(|c| {
                        vec![
                            Some(c.name.clone()),
                            Some(c.data_type.clone()),
                            c.comment.clone(),
                            c.expression.clone(),
                        ]
                    })
                    .collect();
                let field = |n: &str| ResultField {
                    name: n.to_owned(),
                    data_type: "string".to_owned(),
                };
                Ok(QueryResult {
                    fields: vec![
                        field("name"),
                        field("data_type"),
                        field("comment"),
                        field("expression"),
                    ],
                    rows,
                })
            }
            Ddl::ShowTables => {
                let field = |n: &str| ResultField {
                    name: n.to_owned(),
                    data_type: "string".to_owned(),
                };
                let rows = self
                    .catalog
                    .tables()
                    .await
                    .into_iter()
                    .map(|t| vec![Some(t.database), Some(t.schema), Some(t.def.name)])
                    .collect();
                Ok(QueryResult {
                    fields: vec![field("database"), field("schema"), field("table")],
                    rows,
                })
            }
            Ddl::ShowDatabases => Ok(text_result(
                "database",
                self.catalog
                    .schemas()
                    .await
                    .into_iter()
                    .map(|(d, _)| d)
                    .collect(),
            )),
            Ddl::ShowSchemas => Ok(text_result(
                "schema",
                self.catalog
                    .schemas()
                    .await
                    .into_iter()
                    .flat_map(|(d, ss)| ss.into_iter().map(move |s| format!("{d}.{s}")))
                    .collect(),
            )),
        }
    }
}

#[cfg(test)]
mod access_tests {
    use super::*;

    #[test]
    fn statements_are_classed_by_what_they_do() {
        assert_eq!(QueryEngine::access("SELECT 1"), Access::Read);
        assert_eq!(QueryEngine::access(" -- c\n select 1"), Access::Read);
        assert_eq!(QueryEngine::access("SHOW TABLES"), Access::Read);
        assert_eq!(QueryEngine::access("FROM t SELECT a"), Access::Read);
        assert_eq!(
            QueryEngine::access("FROM t SELECT a INSERT INTO t"),
            Access::Write
        );
        assert_eq!(
            QueryEngine::access("INSERT INTO t VALUES (1)"),
            Access::Write
        );
        assert_eq!(QueryEngine::access("CREATE TABLE t (a int)"), Access::Admin);
        assert_eq!(QueryEngine::access("drop table t"), Access::Admin);
        assert_eq!(QueryEngine::access("COPY t TO 'x'"), Access::Admin);
    }
}
