//! Running prepared statements: queries through the read-only query engine, inserts through
//! the database's one write path, catalog statements on the catalog.

use crate::catalog::{
    CatalogError, CatalogPath, ColumnDef, DEFAULT_DATABASE, DEFAULT_SCHEMA, DatabaseDef,
    MutateOptions, SchemaDef, TableDef,
};
use crate::ingest::Limits;
use crate::ingest::encode::{Target, write_ndjson};
use crate::query::ddl::{AlterColumn, Ddl, DropKind};
use crate::query::statements::begin_write;
use crate::query::{Insert, InsertColumns, Parsed, Prepared, QueryError, StatementOutput, qualify};

use super::{Database, IngestFailure};

/// How large one `INSERT` may be: its rows become one commit-log record, so that it is
/// applied whole or not at all.
const INSERT_LIMITS: Limits = Limits {
    max_body_bytes: 128 << 20,
    max_rows: 1_000_000,
    max_row_errors: 100,
};

impl From<IngestFailure> for QueryError {
    fn from(e: IngestFailure) -> Self {
        match e {
            IngestFailure::Input(input) => QueryError::Rows(input),
            other => QueryError::Write(other),
        }
    }
}

impl Database {
    /// Parses and classifies a statement (see [`Prepared`]).
    pub(crate) async fn prepare(&self, text: &str) -> Result<Parsed, QueryError> {
        self.engine.prepare(text.to_owned()).await
    }

    /// Runs a prepared statement to completion. The caller has checked that it may.
    pub(crate) async fn run(&self, parsed: Parsed) -> Result<StatementOutput, QueryError> {
        // The text's reservation is held until the statement has run; a query's budget takes
        // it over.
        let Parsed {
            statement,
            text_hold,
        } = parsed;
        // A change of the catalog acknowledged before the statement began is in what it
        // reads (`DESCRIBE`, `SELECT *` after another node's `ALTER`): a statement that
        // names a table catches up first (one shared look at the store); `SELECT 1` does not.
        let began = std::time::Instant::now();
        match statement {
            Prepared::Catalog(ddl) => {
                let _text_hold = text_hold;
                self.catch_up_catalog(began).await?;
                self.run_ddl(ddl).await
            }
            Prepared::Query(query) => {
                self.see_named_tables(&query, began).await?;
                self.engine.query(*query, Some(text_hold)).await
            }
            Prepared::Insert(insert) => {
                self.catch_up_catalog(began).await?;
                self.see_named_tables(&insert.source, began).await?;
                self.run_insert(insert, text_hold).await
            }
        }
    }

    /// A query that names tables reads the catalog as it was when the statement `began`
    /// ([`Database::catch_up_catalog`]). It may also name a table that another node sharing
    /// the object store created since this node last read the catalog: when a table it names
    /// is unknown here, the catalog is read again before it is planned (at most once per
    /// statement), as ingest does ([`Database::resolve_table`]). A name that is still unknown
    /// then fails in planning.
    async fn see_named_tables(
        &self,
        statement: &crate::query::DfStatement,
        began: std::time::Instant,
    ) -> Result<(), QueryError> {
        use datafusion::common::TableReference;
        let Ok((names, _)) = datafusion::sql::resolve::resolve_table_references(statement, true)
        else {
            // Its tables are not known: it may name some.
            return Ok(self.catch_up_catalog(began).await?);
        };
        if !names.is_empty() {
            self.catch_up_catalog(began).await?;
        }
        for name in names {
            let (db, schema, table) = match &name {
                TableReference::Bare { table } => (DEFAULT_DATABASE, DEFAULT_SCHEMA, table),
                TableReference::Partial { schema, table } => {
                    (DEFAULT_DATABASE, schema.as_ref(), table)
                }
                TableReference::Full {
                    catalog,
                    schema,
                    table,
                } => (catalog.as_ref(), schema.as_ref(), table),
            };
            if schema == "information_schema" {
                continue;
            }
            if let Err(CatalogError::NotFound { .. }) = self.catalog.table(db, schema, table).await
            {
                if let Err(e) = self.catalog.refresh().await {
                    tracing::debug!(error = %e, "catalog refresh before planning failed");
                }
                return Ok(());
            }
        }
        Ok(())
    }

    /// Runs one SQL, ScopeQL or catalog statement with every permission (for embedders and
    /// tests; the HTTP API checks each key's role first).
    pub async fn execute(&self, text: &str) -> Result<crate::query::QueryResult, QueryError> {
        let prepared = self.prepare(text).await?;
        Ok(self.run(prepared).await?.to_result())
    }

    /// `INSERT`: the source query runs read-only; its rows are written in ingest's NDJSON form
    /// and go through [`Database::insert_rows`], the path every table write takes.
    async fn run_insert(
        &self,
        insert: Insert,
        text_hold: datafusion::execution::memory_pool::MemoryReservation,
    ) -> Result<StatementOutput, QueryError> {
        let (d, s, t) = qualify(&insert.table)?;
        // The shape as the statement began (`run` caught up with the catalog): the source's
        // columns are mapped to it now, and a change before the rows commit is a conflict,
        // nothing applied.
        let table = self.resolve_table(&d, &s, &t).await?;
        let input_columns: Vec<ColumnDef> = table
            .def
            .columns
            .iter()
            .filter(|c| c.expression.is_none())
            .cloned()
            .collect();
        let source = self.engine.query(*insert.source, Some(text_hold)).await?;
        let source_names: Vec<String> = source
            .schema
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        let names: Vec<String> = match &insert.columns {
            InsertColumns::ByName => source_names.clone(),
            InsertColumns::Listed(listed) => {
                if listed.len() != source_names.len() {
                    return Err(QueryError::Invalid(format!(
                        "INSERT names {} columns but its source has {}",
                        listed.len(),
                        source_names.len()
                    )));
                }
                listed.clone()
            }
            InsertColumns::Positional => {
                if source_names.len() > input_columns.len() {
                    return Err(QueryError::Invalid(format!(
                        "INSERT source has {} columns but table {} takes {}",
                        source_names.len(),
                        table.qualified_name(),
                        input_columns.len()
                    )));
                }
                input_columns
                    .iter()
                    .take(source_names.len())
                    .map(|c| c.name.clone())
                    .collect()
            }
        };
        let mut targets = Vec::with_capacity(names.len());
        for name in &names {
            let Some(column) = table.def.columns.iter().find(|c| &c.name == name) else {
                return Err(QueryError::Invalid(format!(
                    "{name} is not a column of {}",
                    table.qualified_name()
                )));
            };
            if column.expression.is_some() {
                return Err(QueryError::Invalid(format!(
                    "{name} is a computed column of {}; it cannot be inserted",
                    table.qualified_name()
                )));
            }
            if targets.iter().any(|t: &Target| &t.name == name) {
                return Err(QueryError::Invalid(format!(
                    "column {name} appears twice in the INSERT"
                )));
            }
            let data_type = column
                .data_type
                .parse()
                .map_err(|e: crate::types::UnknownTypeError| QueryError::Invalid(e.to_string()))?;
            targets.push(Target {
                name: name.clone(),
                data_type,
            });
        }
        // Within the same budget as ingest request bodies: the rows are encoded, then
        // decoded and checked like a body.
        let _admitted = self
            .admit_ingest(source.memory_bytes())
            .await
            .map_err(|e| QueryError::Write(e.into()))?;
        let rows = source.num_rows();
        if rows > INSERT_LIMITS.max_rows {
            return Err(QueryError::Rows(crate::ingest::IngestError::TooManyRows {
                limit: INSERT_LIMITS.max_rows,
            }));
        }
        let mut body = Vec::new();
        let mut first_row = 0;
        for batch in &source.batches {
            // A value that cannot be written in its column's form is a row error, as ingest
            // reports one.
            write_ndjson(batch, &targets, first_row, &mut body)
                .map_err(|e| QueryError::Rows(e.into()))?;
            first_row += batch.num_rows();
            if body.len() > INSERT_LIMITS.max_body_bytes {
                return Err(QueryError::Rows(crate::ingest::IngestError::BodyTooLarge {
                    limit: INSERT_LIMITS.max_body_bytes,
                }));
            }
        }
        // From here the statement is not cancelled: its rows commit or fail whole, and the
        // answer says which.
        begin_write()?;
        let inserted = self
            .insert_rows(
                &table,
                bytes::Bytes::from(body),
                INSERT_LIMITS,
                super::Shape::AsResolved,
            )
            .await?;
        Ok(StatementOutput::inserted(inserted))
    }

    /// `CREATE TABLE|DATABASE|SCHEMA [IF NOT EXISTS]`: adds `def` at `path` unless something
    /// is there already.
    async fn create(
        &self,
        path: CatalogPath,
        def: impl serde::Serialize,
        label: String,
        if_not_exists: bool,
    ) -> Result<StatementOutput, QueryError> {
        if self.catalog.get(&path).await.is_ok() {
            if if_not_exists {
                return Ok(StatementOutput::text(
                    "status",
                    vec![format!("{label} exists")],
                ));
            }
            return Err(CatalogError::Invalid(format!("{label} already exists")).into());
        }
        let value = serde_json::to_value(&def).map_err(|e| QueryError::Query(e.to_string()))?;
        begin_write()?;
        self.mutate_catalog(&path, Some(value), MutateOptions::default())
            .await?;
        Ok(StatementOutput::text(
            "status",
            vec![format!("created {label}")],
        ))
    }

    /// `ALTER TABLE`: the table's definition with `change` made, written back if the
    /// catalog did not change meanwhile (tried again a few times if it did). Kept columns
    /// keep their ids (a rename too); a new column takes a new id.
    async fn alter_table(
        &self,
        name: &[String],
        change: &AlterColumn,
    ) -> Result<StatementOutput, QueryError> {
        const ATTEMPTS: u32 = 16;
        let (d, s, t) = qualify(name)?;
        let path = CatalogPath::Table(d.clone(), s.clone(), t.clone());
        let label = format!("{d}.{s}.{t}");
        let missing = |column: &str| CatalogError::NotFound {
            kind: "column",
            name: format!("{label}.{column}"),
        };
        let done = |message: String| Ok(StatementOutput::text("status", vec![message]));
        let mut attempt = 0;
        loop {
            attempt += 1;
            // Another node may have created the table or changed it: whether the change is
            // a no-op or an error is decided on the newest catalog, not this node's copy.
            self.catalog.refresh().await?;
            self.resolve_table(&d, &s, &t).await?;
            let (value, version) = self.catalog.get(&path).await?;
            let mut def: TableDef =
                serde_json::from_value(value).map_err(|e| CatalogError::Invalid(e.to_string()))?;
            let position =
                |def: &TableDef, column: &str| def.columns.iter().position(|c| c.name == column);
            // Names are compared without case for what may exist beside what (see the
            // catalog's check): `ADD COLUMN IF NOT EXISTS "X"` beside `x` is a no-op.
            let clash = |def: &TableDef, column: &str| {
                def.columns
                    .iter()
                    .position(|c| c.name.eq_ignore_ascii_case(column))
            };
            let destructive = match change {
                AlterColumn::Add {
                    column,
                    data_type,
                    comment,
                    if_not_exists,
                } => {
                    if let Some(i) = clash(&def, column) {
                        let existing = &def.columns[i].name;
                        if *if_not_exists {
                            return done(format!("column {label}.{existing} exists"));
                        }
                        return Err(CatalogError::Invalid(format!(
                            "column {label}.{existing} already exists (names are compared without case)"
                        ))
                        .into());
                    }
                    def.columns.push(ColumnDef {
                        id: None,
                        name: column.clone(),
                        data_type: data_type.as_str().to_owned(),
                        comment: comment.clone(),
                        expression: None,
                    });
                    false
                }
                AlterColumn::Drop { column, if_exists } => {
                    match position(&def, column) {
                        Some(i) => {
                            def.columns.remove(i);
                        }
                        None if *if_exists => return done("nothing to drop".into()),
                        None => return Err(missing(column).into()),
                    }
                    true
                }
                AlterColumn::Rename { from, to } => {
                    let i = position(&def, from).ok_or_else(|| missing(from))?;
                    if clash(&def, to).is_some_and(|j| j != i) {
                        return Err(CatalogError::Invalid(format!(
                            "column {label}.{to} already exists"
                        ))
                        .into());
                    }
                    def.columns[i].name = to.clone();
                    false
                }
                AlterColumn::Comment { column, comment } => {
                    let i = position(&def, column).ok_or_else(|| missing(column))?;
                    def.columns[i].comment = comment.clone();
                    false
                }
            };
            let value = serde_json::to_value(&def).map_err(|e| QueryError::Query(e.to_string()))?;
            let expected = version.to_string();
            let options = MutateOptions {
                if_match: Some(&expected),
                allow_destructive: destructive,
                ..MutateOptions::default()
            };
            begin_write()?;
            match self.mutate_catalog(&path, Some(value), options).await {
                Ok(_) => return done(format!("altered table {label}")),
                // Another change landed first (on this node or another): try again on the
                // newest catalog after a random pause, so that racing changes spread out.
                Err(QueryError::Catalog(CatalogError::Stale { .. } | CatalogError::Conflict))
                    if attempt < ATTEMPTS =>
                {
                    let ceiling = 2u64 << attempt.min(6);
                    let pause = 1 + (uuid::Uuid::new_v4().as_u128() % u128::from(ceiling)) as u64;
                    tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
                }
                // The precondition is this statement's own, not the client's: what the client
                // sees is a change that kept losing to others, to retry.
                Err(QueryError::Catalog(CatalogError::Stale { .. })) => {
                    return Err(CatalogError::Conflict.into());
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn run_ddl(&self, ddl: Ddl) -> Result<StatementOutput, QueryError> {
        match ddl {
            Ddl::CreateTable {
                name,
                if_not_exists,
                columns,
            } => {
                let (d, s, t) = qualify(&name)?;
                let def = TableDef {
                    last_column_id: None,
                    schema_id: None,
                    name: t.clone(),
                    comment: None,
                    columns: columns
                        .into_iter()
                        .map(|(name, t, comment)| ColumnDef {
                            id: None,
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
                        let (d, s, t) = qualify(n)?;
                        CatalogPath::Table(d, s, t)
                    }
                    _ => return Err(CatalogError::Invalid("bad name for DROP".into()).into()),
                };
                let drop = MutateOptions {
                    allow_destructive: true,
                    ..MutateOptions::default()
                };
                begin_write()?;
                match self.mutate_catalog(&path, None, drop).await {
                    Ok(_) => Ok(StatementOutput::text("status", vec!["dropped".into()])),
                    Err(QueryError::Catalog(CatalogError::NotFound { .. })) if if_exists => Ok(
                        StatementOutput::text("status", vec!["nothing to drop".into()]),
                    ),
                    Err(e) => Err(e),
                }
            }
            Ddl::AlterTable { name, change } => self.alter_table(&name, &change).await,
            Ddl::Describe { name } => {
                let (d, s, t) = qualify(&name)?;
                let table = self.resolve_table(&d, &s, &t).await?;
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
                Ok(StatementOutput::strings(
                    &["name", "data_type", "comment", "expression"],
                    rows,
                ))
            }
            Ddl::ShowTables => {
                let rows = self
                    .catalog
                    .tables()
                    .await
                    .into_iter()
                    .map(|t| vec![Some(t.database), Some(t.schema), Some(t.def.name)])
                    .collect();
                Ok(StatementOutput::strings(
                    &["database", "schema", "table"],
                    rows,
                ))
            }
            Ddl::ShowDatabases => Ok(StatementOutput::text(
                "database",
                self.catalog
                    .schemas()
                    .await
                    .into_iter()
                    .map(|(d, _)| d)
                    .collect(),
            )),
            Ddl::ShowSchemas => Ok(StatementOutput::text(
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
