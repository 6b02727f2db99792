//! The catalog: databases, schemas and tables, kept as versions in object storage.
//!
//! The whole catalog is one JSON document. Each change writes the next version
//! (`catalog/{version:020}.json`) through the versioned-object protocol
//! (`crate::storage::versioned`: conditional create, tagged attempts, read-back), so two
//! nodes cannot both commit the same version; the version number is the catalog's `ETag`.
//! Every version holds the whole catalog, so garbage collection keeps only the newest few
//! (and those inside the grace period); a change always starts from a fresh listing. Changes are declarative: a
//! `PUT` replaces a subtree and answers what it was before and after. Every table carries a
//! storage id, fixed when the table is created, naming its data in object storage, so a table
//! dropped and created again starts empty.
//!
//! **Column ids.** Every column carries an id (`id`), given when the column is created and
//! never given again in its table: a table's `last_column_id` is the highest id it ever
//! gave, and a new column takes the next. Data files and batches name their columns by id
//! (`PARQUET:field_id` on their Arrow fields), so a column keeps its data across a rename,
//! a dropped column's data is never read again, and a new column that reuses a dropped
//! column's name starts empty. Tables stored before ids existed read with ids = positions
//! from 1 (their columns never changed). A change of a table's columns (added, dropped,
//! renamed, commented) raises its `schema_id` by one (the Iceberg view's schema id). A
//! `PUT` names a kept column by its `id`, or without one by its name; a column type or a
//! computed column's expression never changes (drop the column and add another).

use std::collections::BTreeMap;

use object_store::ObjectStoreExt as _;
use serde::{Deserialize, Serialize};

use crate::error::{Applied, Cause, Classify, ErrorClass, Kind};
use crate::storage::Storage;
use crate::storage::versioned::{Tagged, VersionError, VersionLog};
use crate::types::{Column, ColumnType};

/// The database and schema that exist from the start, so the seed's examples run as written.
pub(crate) const DEFAULT_DATABASE: &str = "scopedb";
/// The default schema in [`DEFAULT_DATABASE`].
pub(crate) const DEFAULT_SCHEMA: &str = "public";

/// Why a catalog operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// No such database, schema or table.
    #[error("{kind} {name} does not exist")]
    NotFound {
        /// `database`, `schema` or `table`.
        kind: &'static str,
        /// Its qualified name.
        name: String,
    },
    /// The definition is not acceptable.
    #[error("invalid definition: {0}")]
    Invalid(String),
    /// `If-Match` named an older version.
    #[error("catalog version {expected} is stale; the current version is {current}")]
    Stale {
        /// The version the request expected.
        expected: String,
        /// The current version.
        current: u64,
    },
    /// The change drops columns, tables, schemas or databases and was not allowed to.
    #[error("this change is destructive ({0}); repeat it with allow_destructive=true")]
    Destructive(String),
    /// The change is valid but not supported.
    #[error("{0}")]
    Unsupported(String),
    /// Another node committed a conflicting version.
    #[error("catalog changed concurrently; retry")]
    Conflict,
    /// This node could not read the newest catalog (the store refused, or did not answer in
    /// time), so it did not act on the one it holds; nothing was applied.
    #[error("this node could not read the newest catalog: {0}")]
    Behind(String),
    /// The table was dropped and created again while rows were written to it: nothing of
    /// them is visible in the new table.
    #[error(
        "table {0} was replaced while these rows were written; none of them is visible: send them again"
    )]
    Replaced(String),
    /// Object storage failed.
    #[error("object store error: {0}")]
    Storage(#[from] object_store::Error),
    /// A stored catalog version cannot be read.
    #[error("catalog version {path} is unreadable: {reason}")]
    Corrupt {
        /// The object.
        path: String,
        /// Why.
        reason: String,
    },
}

impl Classify for CatalogError {
    fn class(&self) -> ErrorClass {
        match self {
            CatalogError::NotFound { .. } => ErrorClass::rejected(Kind::NotFound),
            CatalogError::Invalid(_) => ErrorClass::rejected(Kind::Invalid),
            CatalogError::Stale { .. } => ErrorClass::rejected(Kind::PreconditionFailed),
            CatalogError::Destructive(_)
            | CatalogError::Unsupported(_)
            | CatalogError::Conflict
            | CatalogError::Replaced(_) => ErrorClass::rejected(Kind::Conflict),
            // A catalog change whose create failed ambiguously may have landed.
            CatalogError::Storage(_) => ErrorClass {
                applied: Applied::Unknown,
                ..ErrorClass::retry(Cause::StorageUnavailable)
            },
            CatalogError::Corrupt { .. } => ErrorClass::rejected(Kind::Internal),
            CatalogError::Behind(_) => ErrorClass::retry(Cause::StorageUnavailable),
        }
    }
}

/// A column of a table definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnDef {
    /// The column's id within its table (see the module docs): given by the catalog.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<i32>,
    /// Column name.
    pub name: String,
    /// One of sluice's type names.
    pub data_type: String,
    /// Free text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// For a computed column, the SQL expression over the other columns that fills it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expression: Option<String>,
}

/// A table definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableDef {
    /// Table name.
    pub name: String,
    /// Free text.
    #[serde(default)]
    pub comment: Option<String>,
    /// Columns in order.
    pub columns: Vec<ColumnDef>,
    /// The highest column id the table ever gave (see the module docs): given by the
    /// catalog.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_column_id: Option<i32>,
    /// The number of changes of the table's columns so far: given by the catalog.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_id: Option<i32>,
}

/// Most columns a table may have.
pub(crate) const MAX_COLUMNS: usize = 1000;

impl TableDef {
    /// Each column's id, in order (see the module docs).
    pub(crate) fn column_ids(&self) -> Vec<i32> {
        self.columns
            .iter()
            .enumerate()
            .map(|(i, c)| c.id.unwrap_or_else(|| position_id(i)))
            .collect()
    }

    /// The table's schema id (0 until its columns first change).
    pub(crate) fn schema_id(&self) -> i32 {
        self.schema_id.unwrap_or(0)
    }

    /// The highest column id the table ever gave.
    pub(crate) fn last_column_id(&self) -> i32 {
        let highest = self.column_ids().into_iter().max().unwrap_or(0);
        self.last_column_id.unwrap_or(0).max(highest)
    }
}

/// The id of the column at `index` of a table stored before ids existed.
pub(crate) fn position_id(index: usize) -> i32 {
    i32::try_from(index + 1).unwrap_or(i32::MAX)
}

/// Gives every column of `def` an id, and the table its `last_column_id` and `schema_id`
/// (a table stored before ids existed: ids are positions from 1).
fn fill_ids(def: &mut TableDef) {
    let ids = def.column_ids();
    for (c, id) in def.columns.iter_mut().zip(ids) {
        c.id = Some(id);
    }
    def.last_column_id = Some(def.last_column_id());
    def.schema_id = Some(def.schema_id());
}

/// Gives `after` (a new definition of table `name`, `before` if it exists) its column ids:
/// a column that names an id keeps it (it must be one of `before`'s), one without an id is
/// `before`'s column of that name if there is one (and no other column claimed its id), and
/// any other is new and takes the next id. Raises the schema id when the columns changed.
/// Refuses a change of a kept column's type or expression.
fn evolve(before: Option<&TableDef>, after: &mut TableDef, name: &str) -> Result<(), CatalogError> {
    let Some(before) = before else {
        for (i, c) in after.columns.iter_mut().enumerate() {
            c.id = Some(position_id(i));
        }
        after.last_column_id = Some(i32::try_from(after.columns.len()).unwrap_or(i32::MAX));
        after.schema_id = Some(0);
        return Ok(());
    };
    let before_ids = before.column_ids();
    let mut claimed = std::collections::HashSet::new();
    for c in &after.columns {
        if let Some(id) = c.id {
            if !before_ids.contains(&id) {
                return Err(CatalogError::Invalid(format!(
                    "column {} names id {id}, which no column of table {name} has (leave the id out for a new column)",
                    c.name
                )));
            }
            if !claimed.insert(id) {
                return Err(CatalogError::Invalid(format!(
                    "two columns of table {name} name id {id}"
                )));
            }
        }
    }
    let mut last = before.last_column_id();
    for c in after.columns.iter_mut().filter(|c| c.id.is_none()) {
        let kept = before
            .columns
            .iter()
            .zip(&before_ids)
            .find(|(b, id)| b.name == c.name && !claimed.contains(*id))
            .map(|(_, id)| *id);
        let id = match kept {
            Some(id) => id,
            None => {
                last = last.checked_add(1).ok_or_else(|| {
                    CatalogError::Invalid(format!("table {name} has used up its column ids"))
                })?;
                last
            }
        };
        claimed.insert(id);
        c.id = Some(id);
    }
    for c in &after.columns {
        let Some((b, _)) = before
            .columns
            .iter()
            .zip(&before_ids)
            .find(|(_, id)| Some(**id) == c.id)
        else {
            continue;
        };
        let (old, new) = (
            b.data_type.parse::<ColumnType>().ok(),
            c.data_type.parse::<ColumnType>().ok(),
        );
        if old != new {
            return Err(CatalogError::Unsupported(format!(
                "changing the type of column {name}.{} from {} to {} is not supported (no reader widens sluice's types): add a new column instead",
                c.name, b.data_type, c.data_type
            )));
        }
        if b.expression != c.expression {
            return Err(CatalogError::Unsupported(format!(
                "changing whether or how column {name}.{} is computed is not supported: drop it and add a new column",
                c.name
            )));
        }
    }
    after.last_column_id = Some(last);
    let mut kept = before.clone();
    fill_ids(&mut kept);
    after.schema_id = Some(if kept.columns == after.columns {
        kept.schema_id()
    } else {
        kept.schema_id().checked_add(1).ok_or_else(|| {
            CatalogError::Invalid(format!("table {name} has used up its schema ids"))
        })?
    });
    Ok(())
}

/// A schema definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SchemaDef {
    /// Schema name.
    pub name: String,
    /// Free text.
    #[serde(default)]
    pub comment: Option<String>,
    /// Tables.
    #[serde(default)]
    pub tables: Vec<TableDef>,
}

/// A database definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DatabaseDef {
    /// Database name.
    pub name: String,
    /// Free text.
    #[serde(default)]
    pub comment: Option<String>,
    /// Schemas.
    #[serde(default)]
    pub schemas: Vec<SchemaDef>,
}

/// The whole catalog.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RootDef {
    /// Databases.
    #[serde(default)]
    pub databases: Vec<DatabaseDef>,
}

/// A stored catalog version: the definitions plus each table's storage id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CatalogVersion {
    /// Version number (the `ETag`).
    pub version: u64,
    /// Random tag of the writer's attempt.
    #[serde(default)]
    pub tag: String,
    /// The definitions.
    pub root: RootDef,
    /// `db.schema.table` to storage id.
    #[serde(default)]
    pub table_ids: BTreeMap<String, String>,
}

impl Tagged for CatalogVersion {
    fn tag(&self) -> &str {
        &self.tag
    }
}

impl From<VersionError> for CatalogError {
    fn from(e: VersionError) -> Self {
        match e {
            VersionError::Storage(e) => CatalogError::Storage(e),
            VersionError::Corrupt { path, reason } => CatalogError::Corrupt { path, reason },
            VersionError::BelowFloor { .. } => CatalogError::Conflict,
        }
    }
}

/// A resolved table: its definition and where its data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedTable {
    /// Database name.
    pub database: String,
    /// Schema name.
    pub schema: String,
    /// The definition.
    pub def: TableDef,
    /// Storage id.
    pub id: String,
    /// The catalog version it was read from: while this node holds that version, the table
    /// is still the one the catalog names.
    pub(crate) version: u64,
}

impl ResolvedTable {
    /// The table's columns as the ingest path and storage see them.
    pub(crate) fn columns(&self) -> Result<Vec<Column>, CatalogError> {
        table_columns(&self.def)
    }

    /// `db.schema.table`.
    pub(crate) fn qualified_name(&self) -> String {
        format!("{}.{}.{}", self.database, self.schema, self.def.name)
    }
}

/// The columns of a definition, with their types parsed.
pub(crate) fn table_columns(def: &TableDef) -> Result<Vec<Column>, CatalogError> {
    def.columns
        .iter()
        .map(|c| {
            let t: ColumnType =
                c.data_type
                    .parse()
                    .map_err(|e: crate::types::UnknownTypeError| {
                        CatalogError::Invalid(format!("column {}: {e}", c.name))
                    })?;
            Ok(if c.expression.is_some() {
                Column::computed(c.name.clone(), t)
            } else {
                Column::new(c.name.clone(), t)
            })
        })
        .collect()
}

/// The table definitions in a subtree `value` that would be written at `path` (for checks
/// before a change). A value that does not parse yields none: the change itself reports it.
pub(crate) fn tables_in(
    path: &CatalogPath,
    value: &serde_json::Value,
) -> Result<Vec<TableDef>, CatalogError> {
    fn parse<T: for<'de> Deserialize<'de>>(v: &serde_json::Value) -> Option<T> {
        serde_json::from_value(v.clone()).ok()
    }
    let schemas = |s: Vec<SchemaDef>| s.into_iter().flat_map(|s| s.tables).collect::<Vec<_>>();
    Ok(match path {
        CatalogPath::Root => parse::<RootDef>(value)
            .map(|r| schemas(r.databases.into_iter().flat_map(|d| d.schemas).collect()))
            .unwrap_or_default(),
        CatalogPath::Database(_) => parse::<DatabaseDef>(value)
            .map(|d| schemas(d.schemas))
            .unwrap_or_default(),
        CatalogPath::Schema(..) => parse::<SchemaDef>(value)
            .map(|s| s.tables)
            .unwrap_or_default(),
        CatalogPath::Table(..) => parse::<TableDef>(value).into_iter().collect(),
    })
}

/// Which part of the catalog a request addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CatalogPath {
    /// `/v1/catalog`
    Root,
    /// `/v1/catalog/databases/{db}`
    Database(String),
    /// `/v1/catalog/databases/{db}/schemas/{schema}`
    Schema(String, String),
    /// `/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}`
    Table(String, String, String),
}

impl CatalogPath {
    fn describe(&self) -> (&'static str, String) {
        match self {
            CatalogPath::Root => ("catalog", String::new()),
            CatalogPath::Database(d) => ("database", d.clone()),
            CatalogPath::Schema(d, s) => ("schema", format!("{d}.{s}")),
            CatalogPath::Table(d, s, t) => ("table", format!("{d}.{s}.{t}")),
        }
    }

    fn not_found(&self) -> CatalogError {
        let (kind, name) = self.describe();
        CatalogError::NotFound { kind, name }
    }
}

/// How a catalog change is made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MutateOptions<'a> {
    /// Apply only if the catalog is at this version (an `If-Match` value; `*` matches any).
    pub if_match: Option<&'a str>,
    /// Plan and answer, but write nothing.
    pub dry_run: bool,
    /// Allow dropping databases, schemas, tables or columns.
    pub allow_destructive: bool,
}

/// Takes the catalog's own fields (columns' `id`, tables' `last_column_id` and `schema_id`)
/// out of `value`, a subtree at `path` as [`Catalog::get`] answers it: the ScopeDB-shaped
/// form that clients which refuse unknown fields read (the HTTP routes answer it unless
/// asked `?with_ids=true`). Walks the catalog's fixed levels (databases, schemas, tables,
/// columns), never deeper.
pub(crate) fn hide_ids(path: &CatalogPath, value: &mut serde_json::Value) {
    fn items<'a>(
        value: &'a mut serde_json::Value,
        key: &str,
    ) -> impl Iterator<Item = &'a mut serde_json::Value> {
        value
            .get_mut(key)
            .and_then(serde_json::Value::as_array_mut)
            .into_iter()
            .flatten()
    }
    fn table(t: &mut serde_json::Value) {
        if let Some(t) = t.as_object_mut() {
            t.remove("last_column_id");
            t.remove("schema_id");
        }
        for c in items(t, "columns") {
            if let Some(c) = c.as_object_mut() {
                c.remove("id");
            }
        }
    }
    fn schema(s: &mut serde_json::Value) {
        items(s, "tables").for_each(table);
    }
    fn database(d: &mut serde_json::Value) {
        items(d, "schemas").for_each(schema);
    }
    match path {
        CatalogPath::Root => items(value, "databases").for_each(database),
        CatalogPath::Database(_) => database(value),
        CatalogPath::Schema(..) => schema(value),
        CatalogPath::Table(..) => table(value),
    }
}

/// What a mutation did (or, in a dry run, would do).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Mutation {
    /// The subtree before, or null.
    pub before: Option<serde_json::Value>,
    /// The subtree after, or null.
    pub after: Option<serde_json::Value>,
    /// Whether anything was dropped.
    pub destructive: bool,
    /// The catalog version after the change (the current one in a dry run).
    #[serde(skip)]
    pub version: u64,
    /// Tables created by the change: (qualified name, storage id, definition).
    #[serde(skip)]
    pub created_tables: Vec<(String, String, TableDef)>,
    /// Existing tables whose columns the change changed: (qualified name, storage id, new
    /// definition).
    #[serde(skip)]
    pub changed_tables: Vec<(String, String, TableDef)>,
}

/// Checks a database, schema, table or column name.
pub(crate) fn check_name(kind: &str, name: &str) -> Result<(), CatalogError> {
    let mut chars = name.chars();
    let ok = name.len() <= 128
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(CatalogError::Invalid(format!(
            "{kind} name {name:?} must start with a letter or '_' and hold only letters, digits and '_' (at most 128)"
        )))
    }
}

fn check_table(def: &TableDef) -> Result<(), CatalogError> {
    check_name("table", &def.name)?;
    if def.columns.is_empty() {
        return Err(CatalogError::Invalid(format!(
            "table {} needs at least one column",
            def.name
        )));
    }
    if def.columns.len() > MAX_COLUMNS {
        return Err(CatalogError::Invalid(format!(
            "table {} has {} columns; at most {MAX_COLUMNS} are allowed",
            def.name,
            def.columns.len()
        )));
    }
    // Names are compared without case: Iceberg readers such as DuckDB match them so, and
    // cannot read a table with `x` and `X`.
    let mut seen = std::collections::HashSet::new();
    for c in &def.columns {
        check_name("column", &c.name)?;
        if !seen.insert(c.name.to_ascii_lowercase()) {
            return Err(CatalogError::Invalid(format!(
                "column {} appears twice in table {} (names are compared without case)",
                c.name, def.name
            )));
        }
    }
    table_columns(def)?;
    if def.columns.iter().all(|c| c.expression.is_some()) {
        return Err(CatalogError::Invalid(format!(
            "table {} needs at least one column that is not computed",
            def.name
        )));
    }
    Ok(())
}

fn check_schema(def: &SchemaDef) -> Result<(), CatalogError> {
    check_name("schema", &def.name)?;
    let mut seen = std::collections::HashSet::new();
    for t in &def.tables {
        check_table(t)?;
        if !seen.insert(t.name.as_str()) {
            return Err(CatalogError::Invalid(format!(
                "table {} appears twice",
                t.name
            )));
        }
    }
    Ok(())
}

fn check_database(def: &DatabaseDef) -> Result<(), CatalogError> {
    check_name("database", &def.name)?;
    let mut seen = std::collections::HashSet::new();
    for s in &def.schemas {
        check_schema(s)?;
        if !seen.insert(s.name.as_str()) {
            return Err(CatalogError::Invalid(format!(
                "schema {} appears twice",
                s.name
            )));
        }
    }
    Ok(())
}

fn to_json<T: Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

impl RootDef {
    fn database(&self, d: &str) -> Option<&DatabaseDef> {
        self.databases.iter().find(|x| x.name == d)
    }

    fn schema(&self, d: &str, s: &str) -> Option<&SchemaDef> {
        self.database(d)?.schemas.iter().find(|x| x.name == s)
    }

    fn table(&self, d: &str, s: &str, t: &str) -> Option<&TableDef> {
        self.schema(d, s)?.tables.iter().find(|x| x.name == t)
    }

    /// Every table, mutable, with its qualified name.
    fn tables_mut(&mut self) -> impl Iterator<Item = (String, &mut TableDef)> {
        self.databases.iter_mut().flat_map(|d| {
            let db = d.name.clone();
            d.schemas.iter_mut().flat_map(move |s| {
                let prefix = format!("{db}.{}", s.name);
                s.tables
                    .iter_mut()
                    .map(move |t| (format!("{prefix}.{}", t.name), t))
            })
        })
    }

    /// Every table as (qualified name, definition).
    fn all_tables(&self) -> BTreeMap<String, &TableDef> {
        let mut out = BTreeMap::new();
        for d in &self.databases {
            for s in &d.schemas {
                for t in &s.tables {
                    out.insert(format!("{}.{}.{}", d.name, s.name, t.name), t);
                }
            }
        }
        out
    }

    fn subtree(&self, path: &CatalogPath) -> Option<serde_json::Value> {
        match path {
            CatalogPath::Root => Some(to_json(self)),
            CatalogPath::Database(d) => self.database(d).map(to_json),
            CatalogPath::Schema(d, s) => self.schema(d, s).map(to_json),
            CatalogPath::Table(d, s, t) => self.table(d, s, t).map(to_json),
        }
    }
}

/// Compares two catalogs (column ids given, see [`evolve`]): what is dropped.
fn diff(before: &RootDef, after: &RootDef) -> Vec<String> {
    let mut dropped = Vec::new();
    for d in &before.databases {
        match after.database(&d.name) {
            None => dropped.push(format!("database {}", d.name)),
            Some(ad) => {
                for s in &d.schemas {
                    if !ad.schemas.iter().any(|x| x.name == s.name) {
                        dropped.push(format!("schema {}.{}", d.name, s.name));
                    }
                }
            }
        }
    }
    let (b, a) = (before.all_tables(), after.all_tables());
    for (name, bt) in &b {
        match a.get(name) {
            None => dropped.push(format!("table {name}")),
            Some(at) => {
                let kept = at.column_ids();
                for (c, id) in bt.columns.iter().zip(bt.column_ids()) {
                    if !kept.contains(&id) {
                        dropped.push(format!("column {name}.{}", c.name));
                    }
                }
            }
        }
    }
    dropped
}

/// One version's databases, schemas and tables (see [`Catalog::listing`]).
#[derive(Debug)]
pub(crate) struct CatalogListing {
    /// The catalog version listed.
    pub(crate) version: u64,
    /// The databases and, for each, its schemas.
    pub(crate) schemas: Vec<(String, Vec<String>)>,
    /// Every table, resolved.
    pub(crate) tables: Vec<ResolvedTable>,
}

fn resolved_tables(current: &CatalogVersion) -> Vec<ResolvedTable> {
    let mut out = Vec::new();
    for d in &current.root.databases {
        for s in &d.schemas {
            for t in &s.tables {
                if let Some(id) = current
                    .table_ids
                    .get(&format!("{}.{}.{}", d.name, s.name, t.name))
                {
                    out.push(ResolvedTable {
                        database: d.name.clone(),
                        schema: s.name.clone(),
                        def: t.clone(),
                        id: id.clone(),
                        version: current.version,
                    });
                }
            }
        }
    }
    out
}

fn schema_names(current: &CatalogVersion) -> Vec<(String, Vec<String>)> {
    current
        .root
        .databases
        .iter()
        .map(|d| {
            (
                d.name.clone(),
                d.schemas.iter().map(|s| s.name.clone()).collect(),
            )
        })
        .collect()
}

/// The catalog of one sluice database (bucket).
#[derive(Debug)]
pub struct Catalog {
    storage: Storage,
    log: VersionLog,
    current: tokio::sync::RwLock<CatalogVersion>,
    /// Serializes this node's mutations.
    write: tokio::sync::Mutex<()>,
    /// The looks for a newer version (see [`Catalog::changed_since`]).
    probe: tokio::sync::Mutex<Probe>,
    /// Held while [`Catalog::catch_up`] reads what a look found.
    refreshing: tokio::sync::Mutex<()>,
    /// When the last read [`Catalog::catch_up`] finished had begun.
    caught_up: std::sync::Mutex<Option<std::time::Instant>>,
    /// When a refresh last checked whether its version fell below the floor.
    floor_checked: std::sync::Mutex<Option<std::time::Instant>>,
    /// The highest version this node has tried to create. One it tried and did not install
    /// (the store failed or hung, or the change was cancelled, after the write may have
    /// landed) may be in the store though this node holds an older one: a private store is
    /// looked at as a shared one until this node holds at least this version.
    attempted: std::sync::atomic::AtomicU64,
}

/// What a look for a newer catalog version found ([`Catalog::changed_since`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Look {
    /// No version after `held`, the one this node held when it looked.
    Unchanged,
    /// A version after `held`: [`Catalog::refresh`] reads it.
    Newer {
        /// The version this node held when it looked.
        held: u64,
    },
    /// This node's own version and the next were collected (it looked last longer ago than
    /// the grace period): [`Catalog::reload`] lists the versions afresh.
    Collected,
    /// The store did not answer (within [`LOOK_TIMEOUT`], or not at all, or with a server
    /// error): while it does not, no node can change the catalog.
    Failed,
    /// The store answered the look with a refusal (403, 401): other nodes may still change
    /// the catalog, so this node must not act on the one it holds.
    Denied,
}

/// What [`Catalog::changed_since`] remembers of its looks.
#[derive(Debug, Default)]
struct Probe {
    /// The last look: when it started and what it found.
    last: Option<(std::time::Instant, Look)>,
    /// The version a look last found still stored, and when that look began (`None` after a
    /// failed look: the next one checks, as after any time the node could not look).
    own_checked: Option<(u64, std::time::Instant)>,
}

/// How long a look for a newer catalog version may take: past it, the look fails (and its
/// callers go on with the version they hold), so a slow store holds nobody for long.
const LOOK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a refresh or reload of the catalog may take.
const REFRESH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `work` (a refresh or reload), or [`CatalogError::Behind`] past [`REFRESH_TIMEOUT`].
async fn within_refresh_timeout(
    work: impl std::future::Future<Output = Result<(), CatalogError>>,
) -> Result<(), CatalogError> {
    match tokio::time::timeout(REFRESH_TIMEOUT, work).await {
        // Only reads: whatever the caller was about to do was not done.
        Ok(Err(CatalogError::Storage(e))) => Err(CatalogError::Behind(e.to_string())),
        Ok(result) => result,
        Err(_) => Err(CatalogError::Behind(format!(
            "no newer version read within {REFRESH_TIMEOUT:?}"
        ))),
    }
}

/// Most earlier catalog versions [`Catalog::restore_ids`] reads.
const RESTORE_LOOKBACK: u64 = 16;

/// Whether `def` was stored without column ids (by a binary from before them, or before
/// its table's first write by one that knows them).
fn lacks_ids(def: &TableDef) -> bool {
    def.schema_id.is_none()
        || def.last_column_id.is_none()
        || def.columns.iter().any(|c| c.id.is_none())
}

/// A table's column names, in order.
fn names(def: &TableDef) -> Vec<&str> {
    def.columns.iter().map(|c| c.name.as_str()).collect()
}

/// How often a refresh that finds nothing new checks the floor.
const FLOOR_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

impl Catalog {
    /// Opens the catalog in `storage`, creating version 0 (with `scopedb.public`) if there is
    /// none.
    pub(crate) async fn open(storage: Storage) -> Result<Catalog, CatalogError> {
        let catalog = Catalog {
            storage,
            log: VersionLog::new(crate::storage::paths::CATALOG),
            current: tokio::sync::RwLock::new(CatalogVersion::default()),
            write: tokio::sync::Mutex::new(()),
            probe: tokio::sync::Mutex::new(Probe::default()),
            refreshing: tokio::sync::Mutex::new(()),
            caught_up: std::sync::Mutex::new(None),
            floor_checked: std::sync::Mutex::new(None),
            attempted: std::sync::atomic::AtomicU64::new(0),
        };
        match catalog.load_latest().await? {
            Some(v) => *catalog.current.write().await = v,
            None => {
                let initial = CatalogVersion {
                    version: 0,
                    tag: uuid::Uuid::new_v4().simple().to_string(),
                    root: RootDef {
                        databases: vec![DatabaseDef {
                            name: DEFAULT_DATABASE.into(),
                            comment: None,
                            schemas: vec![SchemaDef {
                                name: DEFAULT_SCHEMA.into(),
                                comment: None,
                                tables: Vec::new(),
                            }],
                        }],
                    },
                    table_ids: BTreeMap::new(),
                };
                if !catalog.try_create(&initial).await? {
                    // Another node created it first.
                }
                let latest = catalog.load_latest().await?.unwrap_or(initial);
                *catalog.current.write().await = latest;
            }
        }
        Ok(catalog)
    }

    /// Reads version `v`, its tables' column ids given (see [`fill_ids`] and
    /// [`Catalog::restore_ids`]).
    async fn read_version(&self, v: u64) -> Result<Option<CatalogVersion>, CatalogError> {
        let mut version: Option<CatalogVersion> =
            self.log.read(self.storage.store().as_ref(), v).await?;
        if let Some(version) = &mut version {
            self.restore_ids(version).await?;
            for (_, def) in version.root.tables_mut() {
                fill_ids(def);
            }
        }
        Ok(version)
    }

    /// Gives back the column ids of `version`'s tables stored without them that an earlier
    /// version stored with them: a sluice binary from before column ids writes the whole
    /// catalog without them (serde drops the fields it does not know), and positions would
    /// be the wrong ids for any table whose columns changed (another column's data read
    /// under a column's name). Such a binary cannot change a table's columns, so the
    /// columns of that name are the same columns. Looks back through this node's version
    /// (if it is the one before) and then the stored ones, at most [`RESTORE_LOOKBACK`]
    /// versions; a table created since, or with no version left that has its ids, keeps
    /// ids = positions.
    async fn restore_ids(&self, version: &mut CatalogVersion) -> Result<(), CatalogError> {
        let mut wanted: BTreeMap<String, String> = version
            .root
            .tables_mut()
            .filter(|(_, def)| lacks_ids(def))
            .filter_map(|(name, _)| Some((name.clone(), version.table_ids.get(&name)?.clone())))
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        let held = self.current.read().await.clone();
        let mut restored: BTreeMap<String, (u64, TableDef)> = BTreeMap::new();
        for back in 1..=RESTORE_LOOKBACK {
            let Some(w) = version.version.checked_sub(back) else {
                break;
            };
            // This node's version holds ids given or restored when it was read.
            let from_memory = held.version == w && !held.tag.is_empty();
            let earlier = if from_memory {
                Some(held.clone())
            } else {
                self.log
                    .read::<CatalogVersion>(self.storage.store().as_ref(), w)
                    .await?
            };
            let Some(earlier) = earlier else {
                break;
            };
            let tables = earlier.root.all_tables();
            wanted.retain(|name, storage_id| {
                let Some(def) = tables.get(name) else {
                    return false;
                };
                if earlier.table_ids.get(name) != Some(storage_id) {
                    return false;
                }
                if from_memory || !lacks_ids(def) {
                    restored.insert(name.clone(), (w, (*def).clone()));
                    return false;
                }
                true
            });
            if wanted.is_empty() {
                break;
            }
        }
        for (name, def) in version.root.tables_mut() {
            let Some((from, earlier)) = restored.get(&name) else {
                continue;
            };
            let mut earlier = earlier.clone();
            fill_ids(&mut earlier);
            let mut again = def.clone();
            let result = if names(&again) == names(&earlier) {
                for (c, e) in again.columns.iter_mut().zip(&earlier.columns) {
                    c.id = e.id;
                }
                again.last_column_id = earlier.last_column_id;
                again.schema_id = earlier.schema_id;
                Ok(())
            } else {
                evolve(Some(&earlier), &mut again, &name)
            };
            match result {
                Ok(()) => {
                    tracing::warn!(
                        table = %name,
                        version = version.version,
                        from,
                        "catalog version was written without column ids (by an older sluice): \
                         the table's ids are taken from an earlier version"
                    );
                    *def = again;
                }
                Err(e) => tracing::error!(
                    table = %name,
                    version = version.version,
                    error = %e,
                    "catalog version was written without column ids, and an earlier \
                     version's do not fit: ids are positions"
                ),
            }
        }
        Ok(())
    }

    /// The newest version: the highest listed, then any that landed after the listing.
    async fn load_latest(&self) -> Result<Option<CatalogVersion>, CatalogError> {
        let listing = self.log.list(self.storage.store().as_ref()).await?;
        let Some(v) = listing.latest() else {
            return Ok(None);
        };
        let mut current = self.read_version(v).await?;
        while let Some(next) = self
            .read_version(current.as_ref().map_or(0, |c| c.version + 1))
            .await?
        {
            current = Some(next);
        }
        Ok(current)
    }

    /// Writes a version if it does not exist; `Ok(true)` when this attempt's version is there.
    async fn try_create(&self, v: &CatalogVersion) -> Result<bool, CatalogError> {
        Ok(self
            .log
            .try_create(self.storage.store().as_ref(), v.version, v)
            .await?)
    }

    /// Installs `latest` if it is newer than what this node holds.
    async fn install(&self, latest: CatalogVersion) {
        let mut current = self.current.write().await;
        if latest.version > current.version {
            *current = latest;
        }
    }

    /// Reads versions other nodes committed since this node last looked (and, now and then,
    /// loads the catalog afresh if old versions were collected past this node's), within
    /// [`REFRESH_TIMEOUT`]: a store that hangs holds no caller longer.
    pub(crate) async fn refresh(&self) -> Result<(), CatalogError> {
        within_refresh_timeout(self.refresh_unbounded()).await
    }

    async fn refresh_unbounded(&self) -> Result<(), CatalogError> {
        let mut version = self.current.read().await.version;
        let mut latest = None;
        while let Some(next) = self.read_version(version + 1).await? {
            version = next.version;
            latest = Some(next);
        }
        match latest {
            Some(latest) => self.install(latest).await,
            None => {
                let due = self
                    .floor_checked
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .is_none_or(|at| at.elapsed() >= FLOOR_CHECK_INTERVAL);
                if due {
                    let began = std::time::Instant::now();
                    let floor = self.log.floor(self.storage.store().as_ref()).await?;
                    // Stamped once the floor was read: a failed check is tried again at once.
                    *self.floor_checked.lock().unwrap_or_else(|p| p.into_inner()) = Some(began);
                    if version + 1 < floor
                        && let Some(latest) = self.load_latest().await?
                    {
                        self.install(latest).await;
                    }
                }
            }
        }
        Ok(())
    }

    /// Ends this node's changes of the catalog, then its hold on the store (shutdown): a
    /// change in flight ends first (within [`REFRESH_TIMEOUT`]), and none starts after.
    pub(crate) async fn release_store(&self) {
        let _write = tokio::time::timeout(REFRESH_TIMEOUT, self.write.lock()).await;
        self.storage.release_hold();
    }

    /// Whether a version newer than this node's exists, as seen by a look that started at
    /// or after `since` (one small read, at most [`LOOK_TIMEOUT`]; looks by concurrent
    /// callers are shared). Ingest and statements ask before they read the table's shape (a
    /// change acknowledged before a request began is seen by it), and ingest again after
    /// its rows are durable, before it answers: rows must not be acknowledged into a table
    /// another node dropped or replaced.
    ///
    /// A node's default store is held by it alone ([`Storage::is_private`]): every version
    /// in it is one this node made, so there is nothing to look for once it holds the last
    /// one it tried to make.
    pub(crate) async fn changed_since(&self, since: std::time::Instant) -> Look {
        if self.storage.is_private()
            && self.current.read().await.version
                >= self.attempted.load(std::sync::atomic::Ordering::SeqCst)
        {
            return Look::Unchanged;
        }
        let mut probe = self.probe.lock().await;
        if let Some((started, found)) = probe.last
            && started >= since
        {
            return found;
        }
        let started = std::time::Instant::now();
        let held = self.current.read().await.version;
        let exists = |version: u64| async move {
            let path = self.log.path(version);
            match tokio::time::timeout(LOOK_TIMEOUT, self.storage.exists(&path)).await {
                Ok(Ok(found)) => Ok(found),
                Ok(Err(
                    error @ (object_store::Error::PermissionDenied { .. }
                    | object_store::Error::Unauthenticated { .. }),
                )) => {
                    tracing::warn!(%error, "catalog look refused");
                    Err(Look::Denied)
                }
                Ok(Err(error)) => {
                    tracing::debug!(%error, "catalog look failed");
                    Err(Look::Failed)
                }
                Err(_) => Err(Look::Failed),
            }
        };
        // No next version: either none was made, or it was collected (this node looked last
        // longer ago than the grace period, during an outage of the store). Collection deletes
        // versions oldest first and stops at a failure, so a collected next version means this
        // node's own version is gone too. That is looked at now and then, as a refresh looks
        // at the floor, and after any failed look: one read per look otherwise.
        let found = match exists(held + 1).await {
            Err(look) => look,
            Ok(true) => Look::Newer { held },
            Ok(false)
                if probe.own_checked.is_none_or(|(version, at)| {
                    version != held || at.elapsed() >= FLOOR_CHECK_INTERVAL
                }) =>
            {
                match exists(held).await {
                    Err(look) => look,
                    Ok(true) => {
                        probe.own_checked = Some((held, started));
                        Look::Unchanged
                    }
                    Ok(false) => Look::Collected,
                }
            }
            Ok(false) => Look::Unchanged,
        };
        if matches!(found, Look::Failed | Look::Denied) {
            probe.own_checked = None;
        }
        // Failures are shared too: callers waiting behind a look that failed go on at once
        // rather than each wait for a look of its own.
        probe.last = Some((started, found));
        found
    }

    /// Reads the versions a look found (see [`Look`]) for a caller that needs every version
    /// committed before `since`, unless a read that began after `since` has finished since
    /// (concurrent callers that shared one look read the new versions once). Reads under a
    /// lock, so a read by another path (the maintenance refresh, say) that began before the
    /// newest version was made never stands in for it.
    pub(crate) async fn catch_up(
        &self,
        found: Look,
        since: std::time::Instant,
    ) -> Result<(), CatalogError> {
        let _refreshing = self.refreshing.lock().await;
        let done = *self.caught_up.lock().unwrap_or_else(|p| p.into_inner());
        if done.is_some_and(|at| at >= since) {
            return Ok(());
        }
        let began = std::time::Instant::now();
        match found {
            // From a listing, not a walk from this node's version: the newest listed version
            // is never collected, so a walk racing garbage collection cannot stop short, and
            // a node far behind reads the newest at once.
            Look::Newer { .. } | Look::Collected => self.reload().await?,
            Look::Unchanged | Look::Failed | Look::Denied => return Ok(()),
        }
        *self.caught_up.lock().unwrap_or_else(|p| p.into_inner()) = Some(began);
        Ok(())
    }

    /// Loads the newest version afresh (a listing, not the next-version probe), within
    /// [`REFRESH_TIMEOUT`].
    pub(crate) async fn reload(&self) -> Result<(), CatalogError> {
        within_refresh_timeout(self.reload_unbounded()).await
    }

    async fn reload_unbounded(&self) -> Result<(), CatalogError> {
        if let Some(latest) = self.load_latest().await? {
            self.install(latest).await;
        }
        Ok(())
    }

    /// Deletes old catalog versions: every version holds the whole catalog, so only the
    /// newest few and those younger than `grace` are kept; the floor is raised first.
    pub(crate) async fn collect_garbage(
        &self,
        grace: std::time::Duration,
    ) -> Result<crate::storage::GcReport, CatalogError> {
        /// Versions kept whatever their age.
        const KEEP: usize = 10;
        let store = self.storage.store().as_ref();
        let listing = self.log.list(store).await?;
        let cutoff = crate::storage::gc::cutoff(grace);
        let old = listing.versions.len().saturating_sub(KEEP);
        let doomed: Vec<&(u64, object_store::ObjectMeta)> = listing.versions[..old]
            .iter()
            .take_while(|(_, m)| m.last_modified < cutoff)
            .collect();
        let mut report = crate::storage::GcReport::default();
        let Some(&(last, _)) = doomed.last() else {
            return Ok(report);
        };
        self.log.raise_floor(store, last + 1).await?;
        // Oldest first, and no further after a failure: the deleted versions are always the
        // oldest ones (`changed_since` relies on it).
        for (_, meta) in doomed {
            match store.delete(&meta.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                    report.objects += 1;
                    report.bytes += meta.size;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "garbage collection: delete failed");
                    break;
                }
            }
        }
        Ok(report)
    }

    /// The subtree at `path` and the catalog version.
    pub(crate) async fn get(
        &self,
        path: &CatalogPath,
    ) -> Result<(serde_json::Value, u64), CatalogError> {
        let current = self.current.read().await;
        let value = current.root.subtree(path).ok_or_else(|| path.not_found())?;
        Ok((value, current.version))
    }

    /// The storage ids of every table the catalog names.
    pub(crate) async fn storage_ids(&self) -> std::collections::HashSet<String> {
        self.current
            .read()
            .await
            .table_ids
            .values()
            .cloned()
            .collect()
    }

    /// Finds a table by its three-part name.
    pub async fn table(
        &self,
        db: &str,
        schema: &str,
        table: &str,
    ) -> Result<ResolvedTable, CatalogError> {
        let current = self.current.read().await;
        let def = current
            .root
            .table(db, schema, table)
            .ok_or_else(|| CatalogError::NotFound {
                kind: "table",
                name: format!("{db}.{schema}.{table}"),
            })?;
        let id = current
            .table_ids
            .get(&format!("{db}.{schema}.{table}"))
            .cloned()
            .ok_or_else(|| CatalogError::Corrupt {
                path: "catalog".into(),
                reason: format!("table {db}.{schema}.{table} has no storage id"),
            })?;
        Ok(ResolvedTable {
            database: db.to_owned(),
            schema: schema.to_owned(),
            def: def.clone(),
            id,
            version: current.version,
        })
    }

    /// Every table, resolved.
    pub(crate) async fn tables(&self) -> Vec<ResolvedTable> {
        resolved_tables(&*self.current.read().await)
    }

    /// The databases and, for each, its schemas.
    pub(crate) async fn schemas(&self) -> Vec<(String, Vec<String>)> {
        schema_names(&*self.current.read().await)
    }

    /// The version this node holds, with its schemas and tables (as [`Catalog::schemas`] and
    /// [`Catalog::tables`] give them), read together: the version names this content.
    pub(crate) async fn listing(&self) -> CatalogListing {
        let current = self.current.read().await;
        CatalogListing {
            version: current.version,
            schemas: schema_names(&current),
            tables: resolved_tables(&current),
        }
    }

    /// The version this node holds: it changes whenever the content does.
    pub(crate) async fn version(&self) -> u64 {
        self.current.read().await.version
    }

    /// Replaces the subtree at `path` with `value` (`None` deletes it).
    ///
    /// See [`MutateOptions`] for conditional changes, dry runs and dropping.
    pub(crate) async fn mutate(
        &self,
        path: &CatalogPath,
        value: Option<serde_json::Value>,
        options: MutateOptions<'_>,
    ) -> Result<Mutation, CatalogError> {
        let MutateOptions {
            if_match,
            dry_run,
            allow_destructive,
        } = options;
        // Bounded waits: a change of this node stuck on a store that hangs holds the others
        // at most this long, and the answer says nothing was applied.
        let behind =
            |what: &str| CatalogError::Behind(format!("{what} within {REFRESH_TIMEOUT:?}"));
        let _write = tokio::time::timeout(REFRESH_TIMEOUT, self.write.lock())
            .await
            .map_err(|_| behind("another catalog change on this node did not end"))?;
        if self.storage.is_released() {
            // The node shut down, or was opened again in place: whoever holds the store now
            // may not look for a change made here.
            return Err(CatalogError::Behind(
                "this node has released its object store (it is shutting down)".into(),
            ));
        }
        // From a fresh listing: a change must never be numbered below versions that
        // garbage collection removed.
        let latest = tokio::time::timeout(REFRESH_TIMEOUT, self.load_latest())
            .await
            .map_err(|_| behind("the catalog's versions were not listed"))?
            .map_err(|e| match e {
                CatalogError::Storage(e) => CatalogError::Behind(e.to_string()),
                other => other,
            })?;
        if let Some(latest) = latest {
            self.install(latest).await;
        }
        let current = self.current.read().await.clone();
        if let Some(expected) = if_match {
            let expected_trimmed = expected.trim().trim_start_matches("W/").trim_matches('"');
            if expected_trimmed != "*" && expected_trimmed != current.version.to_string() {
                return Err(CatalogError::Stale {
                    expected: expected.to_owned(),
                    current: current.version,
                });
            }
        }
        let before = current.root.subtree(path);
        let mut root = current.root.clone();
        apply(&mut root, path, value.clone())?;
        let old_tables = current.root.all_tables();
        let mut changed_tables = Vec::new();
        for (name, def) in root.tables_mut() {
            let old = old_tables.get(&name).copied();
            evolve(old, def, &name)?;
            if let (Some(old), Some(id)) = (old, current.table_ids.get(&name))
                && old.schema_id() != def.schema_id()
            {
                changed_tables.push((name, id.clone(), def.clone()));
            }
        }
        let dropped = diff(&current.root, &root);
        let destructive = !dropped.is_empty();
        if destructive && !allow_destructive {
            return Err(CatalogError::Destructive(dropped.join(", ")));
        }
        let after = root.subtree(path);
        // Tables that are new get a fresh storage id; dropped ones lose theirs.
        let mut table_ids = BTreeMap::new();
        let mut created_tables = Vec::new();
        for (name, def) in root.all_tables() {
            match current.table_ids.get(&name) {
                Some(id) => {
                    table_ids.insert(name, id.clone());
                }
                None => {
                    let id = uuid::Uuid::new_v4().simple().to_string();
                    created_tables.push((name.clone(), id.clone(), def.clone()));
                    table_ids.insert(name, id);
                }
            }
        }
        if dry_run || (before == after && created_tables.is_empty()) {
            return Ok(Mutation {
                before,
                after,
                destructive,
                version: current.version,
                created_tables: Vec::new(),
                changed_tables: Vec::new(),
            });
        }
        let next = CatalogVersion {
            version: current.version + 1,
            tag: uuid::Uuid::new_v4().simple().to_string(),
            root,
            table_ids,
        };
        // Before the write: should this call fail or be dropped after the version landed,
        // a private store is looked at until it is read (see `changed_since`).
        self.attempted
            .fetch_max(next.version, std::sync::atomic::Ordering::SeqCst);
        if !self.try_create(&next).await? {
            // Another node committed this version first: the caller may retry on the new state.
            self.refresh().await?;
            return Err(CatalogError::Conflict);
        }
        let version = next.version;
        self.install(next).await;
        Ok(Mutation {
            before,
            after,
            destructive,
            version,
            created_tables,
            changed_tables,
        })
    }
}

/// Replaces (or with `None` removes) the subtree at `path` in `root`.
fn apply(
    root: &mut RootDef,
    path: &CatalogPath,
    value: Option<serde_json::Value>,
) -> Result<(), CatalogError> {
    fn parse<T: for<'de> Deserialize<'de>>(v: serde_json::Value) -> Result<T, CatalogError> {
        serde_json::from_value(v).map_err(|e| CatalogError::Invalid(e.to_string()))
    }
    fn name_matches(kind: &str, got: &str, want: &str) -> Result<(), CatalogError> {
        if got == want {
            Ok(())
        } else {
            Err(CatalogError::Invalid(format!(
                "the {kind} name in the body ({got:?}) must match the path ({want:?})"
            )))
        }
    }
    fn upsert<T>(
        items: &mut Vec<T>,
        name: &str,
        item: Option<T>,
        key: impl Fn(&T) -> &str,
    ) -> bool {
        let pos = items.iter().position(|x| key(x) == name);
        match (pos, item) {
            (Some(i), Some(item)) => items[i] = item,
            (None, Some(item)) => items.push(item),
            (Some(i), None) => {
                items.remove(i);
            }
            (None, None) => return false,
        }
        true
    }
    match path {
        CatalogPath::Root => {
            let new: RootDef = match value {
                Some(v) => parse(v)?,
                None => RootDef::default(),
            };
            let mut seen = std::collections::HashSet::new();
            for d in &new.databases {
                check_database(d)?;
                if !seen.insert(d.name.clone()) {
                    return Err(CatalogError::Invalid(format!(
                        "database {} appears twice",
                        d.name
                    )));
                }
            }
            *root = new;
        }
        CatalogPath::Database(d) => {
            let item: Option<DatabaseDef> = value.map(parse).transpose()?;
            if let Some(item) = &item {
                name_matches("database", &item.name, d)?;
                check_database(item)?;
            }
            if !upsert(&mut root.databases, d, item, |x| &x.name) {
                return Err(path.not_found());
            }
        }
        CatalogPath::Schema(d, s) => {
            let item: Option<SchemaDef> = value.map(parse).transpose()?;
            if let Some(item) = &item {
                name_matches("schema", &item.name, s)?;
                check_schema(item)?;
            }
            let db = root
                .databases
                .iter_mut()
                .find(|x| &x.name == d)
                .ok_or_else(|| CatalogPath::Database(d.clone()).not_found())?;
            if !upsert(&mut db.schemas, s, item, |x| &x.name) {
                return Err(path.not_found());
            }
        }
        CatalogPath::Table(d, s, t) => {
            let item: Option<TableDef> = value.map(parse).transpose()?;
            if let Some(item) = &item {
                name_matches("table", &item.name, t)?;
                check_table(item)?;
            }
            let schema = root
                .databases
                .iter_mut()
                .find(|x| &x.name == d)
                .ok_or_else(|| CatalogPath::Database(d.clone()).not_found())?
                .schemas
                .iter_mut()
                .find(|x| &x.name == s)
                .ok_or_else(|| CatalogPath::Schema(d.clone(), s.clone()).not_found())?;
            if !upsert(&mut schema.tables, t, item, |x| &x.name) {
                return Err(path.not_found());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(name: &str, data_type: &str, id: Option<i32>) -> ColumnDef {
        ColumnDef {
            id,
            name: name.into(),
            data_type: data_type.into(),
            comment: None,
            expression: None,
        }
    }

    fn table(columns: Vec<ColumnDef>) -> TableDef {
        TableDef {
            name: "t".into(),
            comment: None,
            columns,
            last_column_id: None,
            schema_id: None,
        }
    }

    fn shape(def: &TableDef) -> Vec<(&str, i32)> {
        def.columns
            .iter()
            .zip(def.column_ids())
            .map(|(c, id)| (c.name.as_str(), id))
            .collect()
    }

    #[test]
    fn column_ids_are_given_once_and_never_again() {
        let mut created = table(vec![col("a", "int", None), col("b", "string", None)]);
        evolve(None, &mut created, "t").unwrap();
        assert_eq!(shape(&created), [("a", 1), ("b", 2)]);
        assert_eq!((created.last_column_id(), created.schema_id()), (2, 0));
        // The same columns again (by name): nothing changes.
        let mut same = table(vec![col("a", "int", None), col("b", "string", None)]);
        evolve(Some(&created), &mut same, "t").unwrap();
        assert_eq!(same, created);
        // Drop b: a drop, seen by the diff.
        let mut dropped = table(vec![col("a", "int", None)]);
        evolve(Some(&created), &mut dropped, "t").unwrap();
        assert_eq!((dropped.last_column_id(), dropped.schema_id()), (2, 1));
        let root = |def: &TableDef| RootDef {
            databases: vec![DatabaseDef {
                name: "d".into(),
                comment: None,
                schemas: vec![SchemaDef {
                    name: "s".into(),
                    comment: None,
                    tables: vec![def.clone()],
                }],
            }],
        };
        assert_eq!(diff(&root(&created), &root(&dropped)), ["column d.s.t.b"]);
        // A new b, of another type: a new id.
        let mut again = table(vec![col("a", "int", None), col("b", "int", None)]);
        evolve(Some(&dropped), &mut again, "t").unwrap();
        assert_eq!(shape(&again), [("a", 1), ("b", 3)]);
        assert_eq!((again.last_column_id(), again.schema_id()), (3, 2));
        // A rename names the id; a new column may take the old name at once.
        let mut renamed = table(vec![
            col("x", "int", Some(1)),
            col("b", "int", None),
            col("a", "string", None),
        ]);
        evolve(Some(&again), &mut renamed, "t").unwrap();
        assert_eq!(shape(&renamed), [("x", 1), ("b", 3), ("a", 4)]);
        assert!(diff(&root(&again), &root(&renamed)).is_empty());
        // A type change, a changed expression and an unknown id are refused.
        let mut retyped = table(vec![col("x", "string", Some(1))]);
        assert!(matches!(
            evolve(Some(&renamed), &mut retyped, "t"),
            Err(CatalogError::Unsupported(m)) if m.contains("changing the type")
        ));
        let mut computed = table(vec![ColumnDef {
            expression: Some("1".into()),
            ..col("x", "int", Some(1))
        }]);
        assert!(evolve(Some(&renamed), &mut computed, "t").is_err());
        let mut unknown = table(vec![col("z", "int", Some(2))]);
        assert!(matches!(
            evolve(Some(&renamed), &mut unknown, "t"),
            Err(CatalogError::Invalid(m)) if m.contains("names id 2")
        ));
    }

    /// On a node's default store (held alone) no look reaches the store: a version that
    /// appears there behind the node's back (only its own change, failed or dropped after
    /// its write landed, can put one there) is not looked for, until the node has tried to
    /// make that version: then looks find it, and once it is read they stop again.
    #[tokio::test]
    async fn a_private_store_is_looked_at_only_while_a_change_of_this_node_is_unsettled() {
        let dir = std::env::temp_dir().join(format!("sluice-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let storage = Storage::local_private(&dir, false, None).unwrap();
        let catalog = Catalog::open(storage.clone()).await.unwrap();
        let held = catalog.version().await;
        let mut landed = catalog.current.read().await.clone();
        landed.version = held + 1;
        landed.tag = "landed-unseen".into();
        assert!(
            catalog
                .log
                .try_create(storage.store().as_ref(), landed.version, &landed)
                .await
                .unwrap()
        );
        let now = std::time::Instant::now;
        if !crate::storage::tests::local_file_system(&dir) {
            // Where locks cannot be trusted the default store is looked at as a shared one.
            eprintln!(
                "{}: not a file system known to be local: checked as shared",
                dir.display()
            );
            assert_eq!(catalog.changed_since(now()).await, Look::Newer { held });
            return;
        }
        assert_eq!(catalog.changed_since(now()).await, Look::Unchanged);
        // What `mutate` marks before its write.
        catalog
            .attempted
            .fetch_max(held + 1, std::sync::atomic::Ordering::SeqCst);
        let found = catalog.changed_since(now()).await;
        assert_eq!(found, Look::Newer { held });
        catalog.catch_up(found, now()).await.unwrap();
        assert_eq!(catalog.version().await, held + 1);
        assert_eq!(catalog.changed_since(now()).await, Look::Unchanged);
        // A shared store is looked at, whatever this node tried.
        drop((catalog, storage));
        let shared = Storage::open(&dir.display().to_string()).unwrap();
        let catalog = Catalog::open(shared.clone()).await.unwrap();
        landed.version = held + 2;
        catalog
            .log
            .try_create(shared.store().as_ref(), landed.version, &landed)
            .await
            .unwrap();
        assert_eq!(
            catalog.changed_since(now()).await,
            Look::Newer { held: held + 1 }
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A binary from before column ids writes the whole catalog without them: the ids of a
    /// table whose columns changed come back from an earlier version, on this node and on
    /// one opened afresh, also after several such versions in a row. Positions would read
    /// `c` as the dropped `b`'s data.
    #[tokio::test]
    async fn ids_an_older_binary_strips_come_back_from_an_earlier_version() {
        use serde_json::json;
        let storage = Storage::open("memory://").unwrap();
        let catalog = Catalog::open(storage.clone()).await.unwrap();
        let path = CatalogPath::Table("scopedb".into(), "public".into(), "t".into());
        let def = |names: &[&str]| {
            let columns: Vec<_> = names
                .iter()
                .map(|n| json!({"name": n, "data_type": "int"}))
                .collect();
            Some(json!({"name": "t", "columns": columns}))
        };
        let destructive = MutateOptions {
            allow_destructive: true,
            ..MutateOptions::default()
        };
        catalog
            .mutate(&path, def(&["id", "b", "c"]), destructive)
            .await
            .unwrap();
        catalog
            .mutate(&path, def(&["id", "c"]), destructive)
            .await
            .unwrap();
        let store = storage.store();
        async fn shape_of(catalog: &Catalog) -> (Vec<(String, i32)>, Option<i32>, Option<i32>) {
            let t = catalog.table("scopedb", "public", "t").await.unwrap().def;
            let ids = shape(&t).into_iter().map(|(n, id)| (n.to_owned(), id));
            (ids.collect(), t.last_column_id, t.schema_id)
        }
        let want = (
            vec![("id".to_owned(), 1), ("c".to_owned(), 3)],
            Some(3),
            Some(1),
        );
        assert_eq!(shape_of(&catalog).await, want);
        for _ in 0..3 {
            let latest = catalog.version().await;
            let bytes = store
                .get(&catalog.log.path(latest))
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap();
            let mut raw: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            for d in raw["root"]["databases"].as_array_mut().unwrap() {
                for s in d["schemas"].as_array_mut().unwrap() {
                    for t in s["tables"].as_array_mut().unwrap() {
                        let t = t.as_object_mut().unwrap();
                        t.remove("last_column_id");
                        t.remove("schema_id");
                        for c in t["columns"].as_array_mut().unwrap() {
                            c.as_object_mut().unwrap().remove("id");
                        }
                    }
                }
            }
            raw["version"] = json!(latest + 1);
            raw["tag"] = json!(format!("older-{latest}"));
            store
                .put(
                    &catalog.log.path(latest + 1),
                    serde_json::to_vec(&raw).unwrap().into(),
                )
                .await
                .unwrap();
            catalog.refresh().await.unwrap();
            assert_eq!(catalog.version().await, latest + 1);
            assert_eq!(
                shape_of(&catalog).await,
                want,
                "refreshed to {}",
                latest + 1
            );
            let fresh = Catalog::open(storage.clone()).await.unwrap();
            assert_eq!(shape_of(&fresh).await, want, "opened at {}", latest + 1);
        }
    }

    /// A node whose own catalog version was collected while it did not look (away longer
    /// than the grace period, while another node made more than the kept versions) finds
    /// that out on its next look and lists the versions afresh: it never goes on answering
    /// "unchanged" from a version that is gone.
    #[tokio::test]
    async fn a_node_whose_version_was_collected_loads_the_newest() {
        use serde_json::json;
        let storage = Storage::open("memory://").unwrap();
        let a = Catalog::open(storage.clone()).await.unwrap();
        let b = Catalog::open(storage.clone()).await.unwrap();
        let path = CatalogPath::Table("scopedb".into(), "public".into(), "t".into());
        let mut columns = vec![json!({"name": "c0", "data_type": "int"})];
        let put = |columns: &[serde_json::Value]| Some(json!({"name": "t", "columns": columns}));
        a.mutate(&path, put(&columns), MutateOptions::default())
            .await
            .unwrap();
        // b looks once (and checks its own version).
        let now = std::time::Instant::now();
        b.catch_up(b.changed_since(now).await, now).await.unwrap();
        assert_eq!(b.version().await, a.version().await);
        for i in 1..=15 {
            columns.push(json!({"name": format!("c{i}"), "data_type": "int"}));
            a.mutate(&path, put(&columns), MutateOptions::default())
                .await
                .unwrap();
        }
        a.collect_garbage(std::time::Duration::ZERO).await.unwrap();
        let now = std::time::Instant::now();
        let look = b.changed_since(now).await;
        assert_eq!(look, Look::Collected);
        b.catch_up(look, now).await.unwrap();
        assert_eq!(b.version().await, a.version().await);
        let t = b.table("scopedb", "public", "t").await.unwrap();
        assert_eq!(t.def.columns.len(), 16);
        let look = b.changed_since(std::time::Instant::now()).await;
        assert_eq!(look, Look::Unchanged);
    }

    /// A read of the catalog by another path (the maintenance refresh) that began before the
    /// newest version was made, and installs an older one after a request's look, never
    /// stands in for the read the look asked for: the request sees every version made before
    /// it began.
    #[tokio::test]
    async fn a_late_install_by_another_path_does_not_hide_a_newer_version() {
        use serde_json::json;
        let storage = Storage::open("memory://").unwrap();
        let a = Catalog::open(storage.clone()).await.unwrap();
        let b = Catalog::open(storage.clone()).await.unwrap();
        let held = b.version().await;
        let path = CatalogPath::Table("scopedb".into(), "public".into(), "t".into());
        let put = |names: &[&str]| {
            let columns: Vec<_> = names
                .iter()
                .map(|n| json!({"name": n, "data_type": "int"}))
                .collect();
            Some(json!({"name": "t", "columns": columns}))
        };
        a.mutate(&path, put(&["x"]), MutateOptions::default())
            .await
            .unwrap();
        a.mutate(&path, put(&["x", "y"]), MutateOptions::default())
            .await
            .unwrap();
        let since = std::time::Instant::now();
        let look = b.changed_since(since).await;
        assert_eq!(look, Look::Newer { held });
        // The other path read the first new version before the second was made.
        b.install(b.read_version(held + 1).await.unwrap().unwrap())
            .await;
        b.catch_up(look, since).await.unwrap();
        assert_eq!(b.version().await, a.version().await);
        let t = b.table("scopedb", "public", "t").await.unwrap();
        assert_eq!(t.def.columns.len(), 2);
    }

    #[test]
    fn tables_stored_before_ids_read_with_positions() {
        let mut old: TableDef = serde_json::from_value(serde_json::json!({
            "name": "t", "columns": [
                {"name": "a", "data_type": "int"}, {"name": "b", "data_type": "string"}
            ]
        }))
        .unwrap();
        fill_ids(&mut old);
        assert_eq!(shape(&old), [("a", 1), ("b", 2)]);
        assert_eq!((old.last_column_id, old.schema_id), (Some(2), Some(0)));
    }
}
