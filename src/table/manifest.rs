//! A table's manifest: its versions as a create-next log of small JSON files in object storage.
//!
//! Version `n` lives at `tables/{id}/_log/{n:020}.json` and is written with a conditional
//! create, the only coordination primitive: two writers racing for the same version cannot
//! both win. A loser reads what won, folds it into its state and tries the next version. Each
//! attempt carries a random tag, so an ambiguous outcome (a timeout after the request went out)
//! is resolved by reading the version back: our tag means we won. Every few versions a
//! checkpoint (`{n:020}.checkpoint.json`) holds the whole state, so opening a table reads the
//! last checkpoint and the versions after it, not the whole history.

use std::collections::BTreeMap;

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};

use super::TableError;
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
}

/// A column as the manifest stores it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnSpec {
    /// Column name.
    pub name: String,
    /// sluice type name.
    pub data_type: String,
}

/// One manifest version: what changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Version {
    /// Its number.
    pub version: u64,
    /// Random tag of the attempt that wrote it.
    pub tag: String,
    /// The table's stored columns (set by version 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub columns: Option<Vec<ColumnSpec>>,
    /// Files added.
    #[serde(default)]
    pub added: Vec<DataFile>,
    /// Paths of files removed (compacted away).
    #[serde(default)]
    pub removed: Vec<String>,
    /// Per writing node, the commit-log position all of whose table records are now in files.
    #[serde(default)]
    pub flushed: BTreeMap<String, u64>,
}

/// The folded state of a table at one version.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestState {
    /// The version this state is at.
    pub version: u64,
    /// The stored columns.
    pub columns: Vec<ColumnSpec>,
    /// Live files, in the order they were added.
    pub files: Vec<DataFile>,
    /// Per node, the log position covered by files.
    pub flushed: BTreeMap<String, u64>,
}

impl ManifestState {
    /// Applies one version on top of this state.
    pub fn apply(&mut self, v: &Version) {
        self.version = v.version;
        if let Some(columns) = &v.columns {
            self.columns = columns.clone();
        }
        if !v.removed.is_empty() {
            self.files.retain(|f| !v.removed.contains(&f.path));
        }
        self.files.extend(v.added.iter().cloned());
        for (node, lsn) in &v.flushed {
            let entry = self.flushed.entry(node.clone()).or_insert(0);
            *entry = (*entry).max(*lsn);
        }
    }

    /// The stored columns as sluice columns.
    pub fn table_columns(&self) -> Result<Vec<Column>, TableError> {
        self.columns
            .iter()
            .map(|c| {
                let t: ColumnType =
                    c.data_type
                        .parse()
                        .map_err(|_| TableError::CorruptManifest {
                            path: "columns".into(),
                            reason: format!("unknown column type {:?}", c.data_type),
                        })?;
                Ok(Column::new(c.name.clone(), t))
            })
            .collect()
    }
}

/// What a commit wants to change.
#[derive(Debug, Clone, Default)]
pub struct Change {
    /// Files to add.
    pub added: Vec<DataFile>,
    /// Files to remove; the commit fails with [`TableError::Conflict`] if another writer
    /// removed any of them first.
    pub removed: Vec<String>,
    /// Log positions now covered.
    pub flushed: BTreeMap<String, u64>,
}

/// Manifest access for one table.
#[derive(Debug, Clone)]
pub struct Manifest {
    dir: String,
    checkpoint_interval: u64,
}

fn version_path(dir: &str, v: u64) -> Path {
    Path::from(format!("{dir}/{v:020}.json"))
}

fn checkpoint_path(dir: &str, v: u64) -> Path {
    Path::from(format!("{dir}/{v:020}.checkpoint.json"))
}

fn new_tag() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

impl Manifest {
    /// The manifest of the table stored under `table_dir` (e.g. `tables/{id}`).
    pub fn new(table_dir: &str, checkpoint_interval: u64) -> Self {
        Manifest {
            dir: format!("{table_dir}/_log"),
            checkpoint_interval: checkpoint_interval.max(1),
        }
    }

    /// Creates the table: version 0 with its columns (computed ones too: they are stored).
    /// Fails with
    /// [`TableError::AlreadyExists`] if version 0 is there (with other columns; the same
    /// columns answer the existing state, so a retried create is harmless).
    pub async fn create(
        &self,
        store: &dyn ObjectStore,
        columns: &[Column],
    ) -> Result<ManifestState, TableError> {
        let specs: Vec<ColumnSpec> = columns
            .iter()
            .map(|c| ColumnSpec {
                name: c.name.clone(),
                data_type: c.data_type.as_str().to_owned(),
            })
            .collect();
        let v0 = Version {
            version: 0,
            tag: new_tag(),
            columns: Some(specs.clone()),
            added: Vec::new(),
            removed: Vec::new(),
            flushed: BTreeMap::new(),
        };
        match self.try_put(store, &v0).await? {
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
                    Err(TableError::AlreadyExists(self.dir.clone()))
                }
            }
        }
    }

    /// Writes version `v` if it does not exist. `Ok(true)`: ours; `Ok(false)`: someone
    /// else's. An ambiguous failure is settled by reading the version back and comparing tags.
    async fn try_put(&self, store: &dyn ObjectStore, v: &Version) -> Result<bool, TableError> {
        let path = version_path(&self.dir, v.version);
        let body = serde_json::to_vec(v).map_err(|e| TableError::CorruptManifest {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
        let options = PutOptions::from(PutMode::Create);
        match store.put_opts(&path, PutPayload::from(body), options).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => {
                // Lost the race, or won it on an earlier attempt whose answer was lost.
                Ok(self
                    .read_version(store, v.version)
                    .await?
                    .is_some_and(|w| w.tag == v.tag))
            }
            Err(e) => match self.read_version(store, v.version).await {
                Ok(Some(written)) => Ok(written.tag == v.tag),
                // Not there: the attempt did not land; report the original failure.
                Ok(None) => Err(TableError::Storage(e)),
                Err(_) => Err(TableError::Storage(e)),
            },
        }
    }

    async fn read_version(
        &self,
        store: &dyn ObjectStore,
        v: u64,
    ) -> Result<Option<Version>, TableError> {
        read_json(store, &version_path(&self.dir, v)).await
    }

    /// Reads the table's current state: the newest checkpoint, then every version after it.
    pub async fn load(&self, store: &dyn ObjectStore) -> Result<ManifestState, TableError> {
        use futures::TryStreamExt as _;
        let listed: Vec<object_store::ObjectMeta> = store
            .list(Some(&Path::from(self.dir.as_str())))
            .try_collect()
            .await
            .map_err(TableError::Storage)?;
        let mut latest_checkpoint: Option<u64> = None;
        let mut any_version = false;
        for meta in &listed {
            let Some(name) = meta.location.filename() else {
                continue;
            };
            if let Some(n) = name.strip_suffix(".checkpoint.json") {
                if let Ok(v) = n.parse::<u64>() {
                    latest_checkpoint = latest_checkpoint.max(Some(v));
                }
            } else if name.ends_with(".json") {
                any_version = true;
            }
        }
        if !any_version {
            return Err(TableError::NotFound(self.dir.clone()));
        }
        let (mut state, mut next) = match latest_checkpoint {
            Some(v) => {
                match read_json::<ManifestState>(store, &checkpoint_path(&self.dir, v)).await? {
                    Some(state) => (state, v + 1),
                    None => (ManifestState::default(), 0),
                }
            }
            None => (ManifestState::default(), 0),
        };
        while let Some(v) = self.read_version(store, next).await? {
            state.apply(&v);
            next += 1;
        }
        if next == 0 {
            return Err(TableError::NotFound(self.dir.clone()));
        }
        Ok(state)
    }

    /// Reads versions after `state.version` written by other writers and applies them.
    pub async fn refresh(
        &self,
        store: &dyn ObjectStore,
        state: &mut ManifestState,
    ) -> Result<bool, TableError> {
        let mut changed = false;
        while let Some(v) = self.read_version(store, state.version + 1).await? {
            state.apply(&v);
            changed = true;
        }
        Ok(changed)
    }

    /// Commits `change` as the next version after `state`, retrying past versions other
    /// writers win, and returns the new state (which includes their changes too).
    pub async fn commit(
        &self,
        store: &dyn ObjectStore,
        state: &ManifestState,
        change: &Change,
    ) -> Result<ManifestState, TableError> {
        let mut state = state.clone();
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
            let v = Version {
                version: state.version + 1,
                tag: tag.clone(),
                columns: None,
                added: change.added.clone(),
                removed: change.removed.clone(),
                flushed: change.flushed.clone(),
            };
            if self.try_put(store, &v).await? {
                state.apply(&v);
                if v.version % self.checkpoint_interval == 0 {
                    // Best effort: a missing checkpoint only makes opening read more versions.
                    let _ = self.write_checkpoint(store, &state).await;
                }
                return Ok(state);
            }
            // Another writer took this version: fold it (and any after it) in, and go again.
            self.refresh(store, &mut state).await?;
        }
    }

    async fn write_checkpoint(
        &self,
        store: &dyn ObjectStore,
        state: &ManifestState,
    ) -> Result<(), TableError> {
        let path = checkpoint_path(&self.dir, state.version);
        let body = serde_json::to_vec(state).map_err(|e| TableError::CorruptManifest {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
        store
            .put(&path, PutPayload::from(body))
            .await
            .map(|_| ())
            .map_err(TableError::Storage)
    }
}

/// Reads and parses a JSON object; `None` when it does not exist.
async fn read_json<T: for<'de> Deserialize<'de>>(
    store: &dyn ObjectStore,
    path: &Path,
) -> Result<Option<T>, TableError> {
    let bytes = match store.get(path).await {
        Ok(result) => result.bytes().await.map_err(TableError::Storage)?,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(TableError::Storage(e)),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| TableError::CorruptManifest {
            path: path.to_string(),
            reason: e.to_string(),
        })
}
