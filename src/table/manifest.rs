//! A table's manifest: its versions as a create-next log of small JSON files in object storage.
//!
//! Version `n` lives at `tables/{id}/_log/{n:020}.json`, written through the versioned-object
//! protocol ([`crate::storage::versioned`]): a conditional create, a tag per attempt, and a
//! read-back that settles ambiguous outcomes. A loser reads what won, folds it into its state
//! and tries the next version. Every few versions a checkpoint (`{n:020}.checkpoint.json`)
//! holds the whole state, so opening a table reads the last checkpoint and the versions after
//! it, not the whole history; garbage collection deletes versions below a checkpoint once
//! they are older than the grace period, after raising the log's floor, and a reader whose
//! state is below the floor loads the table again.
//!
//! **Shape.** The manifest holds the table's current columns with their ids (see
//! [`crate::catalog`]'s column ids), its schema id and the highest column id it ever gave. A
//! change of the catalog's columns is committed here as a version with the new columns and
//! schema id (never one below the state's: [`Change::shape`]). Data files are never
//! rewritten for it: each [`DataFile`] records its columns' ids (`field_ids`; a file written
//! before ids has none, and its columns are the table's first, with ids = positions from 1)
//! and readers map its columns by id. The state keeps the shapes before the current one
//! (`past_shapes`, the newest [`MAX_PAST_SHAPES`]) for the Iceberg view's schema history.

use std::collections::BTreeMap;

use object_store::ObjectStore;
use serde::{Deserialize, Serialize};

use super::TableError;
use crate::storage::versioned::{Tagged, VersionError, VersionLog, read_json};
use crate::types::{Column, ColumnType};

/// One Parquet file of a table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataFile {
    /// Object path, relative to the database root.
    pub path: String,
    /// Rows in the file.
    pub rows: u64,
    /// Size of the object in bytes.
    pub bytes: u64,
    /// For each timestamp column, the (min, max) nanoseconds of its non-null values.
    #[serde(default)]
    pub time_ranges: BTreeMap<String, (i64, i64)>,
    /// Each column's id, by its name in the file (none in files written before ids: see the
    /// module docs).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub field_ids: BTreeMap<String, i32>,
}

/// A column as the manifest stores it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ColumnSpec {
    /// Column id (none in manifests written before ids: the position from 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<i32>,
    /// Column name.
    pub name: String,
    /// sluice type name.
    pub data_type: String,
}

/// One manifest version: what changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Version {
    /// Its number.
    pub version: u64,
    /// Random tag of the attempt that wrote it.
    pub tag: String,
    /// The table's stored columns (set by version 0, and by each change of shape).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub columns: Option<Vec<ColumnSpec>>,
    /// With `columns`: the schema id of that shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_id: Option<i32>,
    /// With `columns`: the highest column id the table ever gave.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_column_id: Option<i32>,
    /// Files added.
    #[serde(default)]
    pub added: Vec<DataFile>,
    /// Paths of files removed (compacted away).
    #[serde(default)]
    pub removed: Vec<String>,
    /// Per writing node, the commit-log position all of whose table records are now in files.
    #[serde(default)]
    pub flushed: BTreeMap<String, u64>,
    /// When the writer committed it (milliseconds since the epoch, its clock; 0 in versions
    /// written before this was recorded): the Iceberg snapshot's time.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub committed_ms: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// Where a live file stands in the table's history, for the Iceberg view
/// ([`crate::iceberg`]): the version that added it and the first row id of its rows (Iceberg
/// row lineage: each version's added files take the next ids in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Lineage {
    /// The version that added the file.
    pub version: u64,
    /// The row id of its first row.
    pub first_row_id: u64,
}

/// What the newest version changed, for its Iceberg snapshot's summary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LastChange {
    /// Files it added.
    pub added_files: u64,
    /// Rows in them.
    pub added_rows: u64,
    /// Files it removed.
    pub removed_files: u64,
    /// Rows in them.
    pub removed_rows: u64,
    /// When it was committed (see [`Version::committed_ms`]).
    pub committed_ms: u64,
}

impl Tagged for Version {
    fn tag(&self) -> &str {
        &self.tag
    }
}

impl From<VersionError> for TableError {
    fn from(e: VersionError) -> Self {
        match e {
            VersionError::Storage(e) => TableError::Storage(e),
            VersionError::Corrupt { path, reason } => TableError::CorruptManifest { path, reason },
            e @ VersionError::BelowFloor { .. } => TableError::Conflict(e.to_string()),
        }
    }
}

/// The folded state of a table at one version.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ManifestState {
    /// The version this state is at.
    pub version: u64,
    /// The stored columns.
    pub columns: Vec<ColumnSpec>,
    /// The schema id of `columns`.
    #[serde(default)]
    pub schema_id: i32,
    /// The highest column id the table ever gave (0 in states written before ids: then the
    /// number of columns).
    #[serde(default)]
    pub last_column_id: i32,
    /// The names of the table's first columns, once its shape changed (files written before
    /// ids hold these, with ids = positions from 1); empty while `columns` are the first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub first_columns: Vec<String>,
    /// The shapes the table had before `columns`, oldest first, at most
    /// [`MAX_PAST_SHAPES`]: the Iceberg view lists them as its earlier schemas.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub past_shapes: Vec<PastShape>,
    /// Live files, in the order they were added.
    pub files: Vec<DataFile>,
    /// Per node, the log position covered by files.
    pub flushed: BTreeMap<String, u64>,
    /// Per live file (by path), its place in the history. Files of states read from
    /// checkpoints written before this was kept have none.
    #[serde(default)]
    pub lineage: BTreeMap<String, Lineage>,
    /// The row id the next added row takes.
    #[serde(default)]
    pub next_row_id: u64,
    /// What the newest version changed.
    #[serde(default)]
    pub last_change: LastChange,
}

impl ManifestState {
    /// Applies one version on top of this state.
    pub(crate) fn apply(&mut self, v: &Version) {
        self.version = v.version;
        if let Some(columns) = &v.columns {
            if self.first_columns.is_empty() && !self.columns.is_empty() {
                self.first_columns = self.columns.iter().map(|c| c.name.clone()).collect();
            }
            self.last_column_id = self.last_column_id();
            let schema_id = v.schema_id.unwrap_or(0);
            if !self.columns.is_empty() && schema_id != self.schema_id {
                self.past_shapes.push(PastShape {
                    schema_id: self.schema_id,
                    columns: std::mem::take(&mut self.columns),
                });
                let over = self.past_shapes.len().saturating_sub(MAX_PAST_SHAPES);
                self.past_shapes.drain(..over);
            }
            self.columns = columns.clone();
            self.schema_id = v.schema_id.unwrap_or(0);
            self.last_column_id = self.last_column_id().max(v.last_column_id.unwrap_or(0));
        }
        let mut change = LastChange {
            committed_ms: v.committed_ms,
            ..LastChange::default()
        };
        if !v.removed.is_empty() {
            self.files.retain(|f| {
                let removed = v.removed.contains(&f.path);
                if removed {
                    change.removed_files += 1;
                    change.removed_rows += f.rows;
                }
                !removed
            });
            for path in &v.removed {
                self.lineage.remove(path);
            }
        }
        for f in &v.added {
            self.lineage.insert(
                f.path.clone(),
                Lineage {
                    version: v.version,
                    first_row_id: self.next_row_id,
                },
            );
            self.next_row_id += f.rows;
            change.added_files += 1;
            change.added_rows += f.rows;
        }
        self.last_change = change;
        self.files.extend(v.added.iter().cloned());
        for (node, lsn) in &v.flushed {
            let entry = self.flushed.entry(node.clone()).or_insert(0);
            *entry = (*entry).max(*lsn);
        }
    }

    /// Each stored column's id, in order.
    pub(crate) fn column_ids(&self) -> Vec<i32> {
        spec_ids(&self.columns)
    }

    /// The highest column id the table ever gave.
    pub(crate) fn last_column_id(&self) -> i32 {
        let highest = self.column_ids().into_iter().max().unwrap_or(0);
        self.last_column_id.max(highest)
    }

    /// The stored columns' Arrow schema, each field with its column id.
    pub(crate) fn schema(&self) -> Result<arrow_schema::SchemaRef, TableError> {
        Ok(crate::types::arrow_schema_with_ids(
            &self.table_columns()?,
            &self.column_ids(),
        ))
    }

    /// The column ids of `file` by name: its own, or for a file written before ids, the
    /// table's first columns by position.
    pub(crate) fn file_field_ids(&self, file: &DataFile) -> BTreeMap<String, i32> {
        if !file.field_ids.is_empty() {
            return file.field_ids.clone();
        }
        let first: Vec<&String> = if self.first_columns.is_empty() {
            self.columns.iter().map(|c| &c.name).collect()
        } else {
            self.first_columns.iter().collect()
        };
        first
            .into_iter()
            .enumerate()
            .map(|(i, name)| (name.clone(), crate::catalog::position_id(i)))
            .collect()
    }

    /// Whether `file` holds a column the table dropped: an id the table gave (at or below
    /// its `last_column_id`) that its current columns lack. (An id above it is a column
    /// another node added that this state does not know yet, not a dropped one.)
    pub(crate) fn holds_dropped_column(&self, file: &DataFile) -> bool {
        let last = self.last_column_id();
        let current = self.column_ids();
        self.file_field_ids(file)
            .values()
            .any(|id| *id <= last && !current.contains(id))
    }

    /// Leaves out `file`'s column ids where they are what [`ManifestState::file_field_ids`]
    /// gives a file without them (a table whose columns never changed): manifests stay as
    /// small as before ids.
    pub(crate) fn omit_default_field_ids(&self, file: &mut DataFile) {
        let ids = std::mem::take(&mut file.field_ids);
        if self.file_field_ids(file) != ids {
            file.field_ids = ids;
        }
    }

    /// The stored columns as sluice columns.
    pub(crate) fn table_columns(&self) -> Result<Vec<Column>, TableError> {
        shape_columns(&self.columns)
    }
}

/// Most earlier shapes a manifest state keeps ([`ManifestState::past_shapes`]): as many as
/// the Iceberg view keeps snapshots, so every snapshot it lists finds its schema.
pub(crate) const MAX_PAST_SHAPES: usize = 64;

/// A shape a table had before its current one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PastShape {
    /// Its schema id.
    pub schema_id: i32,
    /// Its columns, with their ids.
    pub columns: Vec<ColumnSpec>,
}

impl PastShape {
    /// Its columns as sluice columns, with their ids.
    pub(crate) fn columns(&self) -> Result<(Vec<Column>, Vec<i32>), TableError> {
        Ok((shape_columns(&self.columns)?, spec_ids(&self.columns)))
    }
}

/// Each column's id: its own, or (stored before ids) its position from 1.
fn spec_ids(columns: &[ColumnSpec]) -> Vec<i32> {
    columns
        .iter()
        .enumerate()
        .map(|(i, c)| c.id.unwrap_or_else(|| crate::catalog::position_id(i)))
        .collect()
}

/// Stored columns as sluice columns.
fn shape_columns(columns: &[ColumnSpec]) -> Result<Vec<Column>, TableError> {
    columns
        .iter()
        .map(|c| {
            let t: ColumnType = c
                .data_type
                .parse()
                .map_err(|_| TableError::CorruptManifest {
                    path: "columns".into(),
                    reason: format!("unknown column type {:?}", c.data_type),
                })?;
            Ok(Column::new(c.name.clone(), t))
        })
        .collect()
}

/// What a commit wants to change.
#[derive(Debug, Clone, Default)]
pub(crate) struct Change {
    /// Files to add.
    pub added: Vec<DataFile>,
    /// Files to remove; the commit fails with [`TableError::Conflict`] if another writer
    /// removed any of them first.
    pub removed: Vec<String>,
    /// Log positions now covered.
    pub flushed: BTreeMap<String, u64>,
    /// `(node, lsn)`: commit only while the manifest's position for `node` is below `lsn`
    /// (else [`TableError::Conflict`]): a flush whose rows are already in a file must not
    /// add them again.
    pub flushed_below: Option<(String, u64)>,
    /// A new shape (columns, schema id, last column id): committed only while the state's
    /// schema id is below this one's (a commit that finds it reached is a no-op).
    pub shape: Option<(Vec<ColumnSpec>, i32, i32)>,
}

/// Manifest access for one table.
#[derive(Debug, Clone)]
pub(crate) struct Manifest {
    log: VersionLog,
    checkpoint_interval: u64,
}

/// Milliseconds since the epoch, by this node's clock.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn new_tag() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

impl Manifest {
    /// The manifest of table `id`.
    pub(crate) fn new(id: &str, checkpoint_interval: u64) -> Self {
        Manifest {
            log: VersionLog::new(crate::storage::paths::table_manifest(id)),
            checkpoint_interval: checkpoint_interval.max(1),
        }
    }

    /// The manifest's version log.
    pub(crate) fn log(&self) -> &VersionLog {
        &self.log
    }

    /// Creates the table: version 0 with its columns (computed ones too: they are stored).
    /// Fails with
    /// [`TableError::AlreadyExists`] if version 0 is there (with other columns; the same
    /// columns answer the existing state, so a retried create is harmless).
    pub(crate) async fn create(
        &self,
        store: &dyn ObjectStore,
        columns: &[Column],
        ids: &[i32],
        schema_id: i32,
    ) -> Result<ManifestState, TableError> {
        let specs = column_specs(columns, ids);
        let v0 = Version {
            version: 0,
            tag: new_tag(),
            columns: Some(specs.clone()),
            schema_id: Some(schema_id),
            last_column_id: ids.iter().copied().max(),
            added: Vec::new(),
            removed: Vec::new(),
            flushed: BTreeMap::new(),
            committed_ms: now_ms(),
        };
        match self.log.try_create(store, 0, &v0).await? {
            true => {
                let mut state = ManifestState::default();
                state.apply(&v0);
                Ok(state)
            }
            false => {
                let state = self.load(store).await?;
                if state.columns == specs {
                    Ok(state)
                } else {
                    Err(TableError::AlreadyExists(self.log.dir().to_owned()))
                }
            }
        }
    }

    /// Reads the table's current state: the newest checkpoint, then every version after it.
    /// When what the listing named is gone before it is read (another node's garbage
    /// collection moved on), it lists again: a vanished object never reads as a missing
    /// table or an older state.
    pub(crate) async fn load(&self, store: &dyn ObjectStore) -> Result<ManifestState, TableError> {
        const ATTEMPTS: usize = 5;
        for _ in 0..ATTEMPTS {
            let listing = self.log.list(store).await?;
            let Some(latest) = listing.latest() else {
                return Err(TableError::NotFound(self.log.dir().to_owned()));
            };
            let (mut state, mut next) = match listing.checkpoint_at_or_below(latest) {
                Some(v) => {
                    match read_json::<ManifestState>(store, &self.log.checkpoint_path(v)).await? {
                        Some(state) => {
                            let next = state.version + 1;
                            (state, next)
                        }
                        // Collected since the listing.
                        None => continue,
                    }
                }
                None => (ManifestState::default(), 0),
            };
            // Versions may have landed after the listing: read on until one is missing.
            while let Some(v) = self.log.read::<Version>(store, next).await? {
                state.apply(&v);
                next += 1;
            }
            if next == 0 || next <= latest {
                // A listed version is gone: collected since the listing.
                continue;
            }
            return Ok(state);
        }
        Err(TableError::CorruptManifest {
            path: self.log.dir().to_owned(),
            reason: format!("its versions kept changing under {ATTEMPTS} readings; retry later"),
        })
    }

    /// Reads versions after `state.version` written by other writers and applies them.
    /// With `check_floor`, a state whose next version may have been collected away (it is
    /// below the log's floor) is replaced by a full load.
    pub(crate) async fn refresh(
        &self,
        store: &dyn ObjectStore,
        state: &mut ManifestState,
        check_floor: bool,
    ) -> Result<bool, TableError> {
        let mut changed = false;
        while let Some(v) = self.log.read::<Version>(store, state.version + 1).await? {
            state.apply(&v);
            changed = true;
        }
        if !changed && check_floor && state.version + 1 < self.log.floor(store).await? {
            *state = self.load(store).await?;
            changed = true;
        }
        Ok(changed)
    }

    /// Commits `change` as the next version after `state`, retrying past versions other
    /// writers win, and returns the new state (which includes their changes too).
    pub(crate) async fn commit(
        &self,
        store: &dyn ObjectStore,
        state: &ManifestState,
        change: &Change,
    ) -> Result<ManifestState, TableError> {
        let mut state = state.clone();
        // Never create a version below the floor: that number may have existed.
        if state.version + 1 < self.log.floor(store).await? {
            state = self.load(store).await?;
        }
        let tag = new_tag();
        loop {
            if let Some(gone) = change
                .removed
                .iter()
                .find(|p| !state.files.iter().any(|f| &f.path == *p))
            {
                return Err(TableError::Conflict(format!(
                    "file {gone} was removed by another writer"
                )));
            }
            if let Some((node, lsn)) = &change.flushed_below {
                let covered = state.flushed.get(node).copied().unwrap_or(0);
                if covered >= *lsn {
                    return Err(TableError::Conflict(format!(
                        "log position {covered} of node {node} is flushed already"
                    )));
                }
            }
            let shape = match &change.shape {
                Some((_, schema_id, _)) if state.schema_id >= *schema_id => {
                    if change.added.is_empty() && change.removed.is_empty() {
                        return Ok(state);
                    }
                    None
                }
                other => other.clone(),
            };
            let v = Version {
                version: state.version + 1,
                tag: tag.clone(),
                schema_id: shape.as_ref().map(|s| s.1),
                last_column_id: shape.as_ref().map(|s| s.2),
                columns: shape.map(|s| s.0),
                added: change.added.clone(),
                removed: change.removed.clone(),
                flushed: change.flushed.clone(),
                committed_ms: now_ms(),
            };
            if self.log.try_create(store, v.version, &v).await? {
                state.apply(&v);
                if v.version.is_multiple_of(self.checkpoint_interval) {
                    // Best effort: a missing checkpoint only makes opening read more versions.
                    let _ = self
                        .log
                        .write_checkpoint(store, state.version, &state)
                        .await;
                }
                return Ok(state);
            }
            // Another writer took this version: fold it (and any after it) in, and go again.
            self.refresh(store, &mut state, false).await?;
        }
    }
}

/// Columns as the manifest stores them, with their ids.
pub(crate) fn column_specs(columns: &[Column], ids: &[i32]) -> Vec<ColumnSpec> {
    columns
        .iter()
        .zip(ids)
        .map(|(c, id)| ColumnSpec {
            id: Some(*id),
            name: c.name.clone(),
            data_type: c.data_type.as_str().to_owned(),
        })
        .collect()
}

#[cfg(test)]
mod shapes {
    use super::*;

    fn shape(version: u64, schema_id: i32, names: &[&str]) -> Version {
        let columns = names
            .iter()
            .enumerate()
            .map(|(i, name)| ColumnSpec {
                id: Some(crate::catalog::position_id(i)),
                name: (*name).to_owned(),
                data_type: "int".into(),
            })
            .collect();
        Version {
            version,
            tag: String::new(),
            columns: Some(columns),
            schema_id: Some(schema_id),
            last_column_id: None,
            added: Vec::new(),
            removed: Vec::new(),
            flushed: BTreeMap::new(),
            committed_ms: 0,
        }
    }

    /// Each change of shape keeps the one before under its schema id, oldest first, the
    /// newest [`MAX_PAST_SHAPES`] of them; a version of the same schema id keeps none.
    #[test]
    fn past_shapes_are_kept_newest_last_and_bounded() {
        let mut state = ManifestState::default();
        state.apply(&shape(0, 0, &["a"]));
        assert!(state.past_shapes.is_empty());
        state.apply(&shape(1, 1, &["a", "b"]));
        state.apply(&shape(2, 1, &["a", "b"]));
        let kept: Vec<(i32, usize)> = state
            .past_shapes
            .iter()
            .map(|p| (p.schema_id, p.columns.len()))
            .collect();
        assert_eq!(kept, [(0, 1)]);
        for id in 2..=100 {
            state.apply(&shape(u64::try_from(id).unwrap_or(0) + 1, id, &["a"]));
        }
        assert_eq!(state.past_shapes.len(), MAX_PAST_SHAPES);
        assert_eq!(state.past_shapes.first().map(|p| p.schema_id), Some(36));
        assert_eq!(state.past_shapes.last().map(|p| p.schema_id), Some(99));
        assert_eq!(state.schema_id, 100);
    }
}
