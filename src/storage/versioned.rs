//! Versioned objects: the one protocol by which sluice changes shared state in object storage
//! (the catalog, each table's manifest).
//!
//! A versioned object is a directory of numbered JSON objects, `{dir}/{version:020}.json`,
//! each written with a conditional create, the only coordination primitive: two writers racing
//! for the same version cannot both win. Every attempt carries a random tag, so an ambiguous
//! outcome (an error after the request may have reached the store) is settled by reading the
//! version back: our tag means we won ([`VersionLog::try_create`]).
//!
//! A log may hold checkpoints (`{version:020}.checkpoint.json`, the whole state at that
//! version) so that readers start there, and a floor: garbage collection deletes versions
//! below the floor, and first raises the floor, so a reader whose next version is missing can
//! tell "no new version" from "collected away, reload" ([`VersionLog::floor`]). The floor is
//! the highest of the marks `{version:020}.floor`, each created once: it never moves back,
//! whoever raises it. A writer never creates a version below the floor (that number may have
//! existed), and a version it created that the floor has passed since counts as lost.

use futures::TryStreamExt as _;
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A version's random attempt tag, which says who wrote it.
pub(crate) trait Tagged {
    fn tag(&self) -> &str;
}

/// Why a versioned object could not be read or written.
#[derive(Debug, thiserror::Error)]
pub(crate) enum VersionError {
    /// Object storage failed.
    #[error("object store error: {0}")]
    Storage(#[from] object_store::Error),
    /// An object that cannot be parsed.
    #[error("{path} is unreadable: {reason}")]
    Corrupt {
        /// The object.
        path: String,
        /// Why.
        reason: String,
    },
}

/// What a listing of a log found.
#[derive(Debug, Default)]
pub(crate) struct Listing {
    /// Versions, ascending.
    pub(crate) versions: Vec<(u64, ObjectMeta)>,
    /// Checkpoints, ascending.
    pub(crate) checkpoints: Vec<(u64, ObjectMeta)>,
}

impl Listing {
    /// The newest version.
    pub(crate) fn latest(&self) -> Option<u64> {
        self.versions.last().map(|(v, _)| *v)
    }

    /// The newest checkpoint at or below `version`.
    pub(crate) fn checkpoint_at_or_below(&self, version: u64) -> Option<u64> {
        self.checkpoints
            .iter()
            .rev()
            .map(|(v, _)| *v)
            .find(|v| *v <= version)
    }
}

/// One versioned object's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VersionLog {
    dir: String,
}

/// Reads and parses a JSON object; `None` when it does not exist.
pub(crate) async fn read_json<T: DeserializeOwned>(
    store: &dyn ObjectStore,
    path: &Path,
) -> Result<Option<T>, VersionError> {
    let bytes = match store.get(path).await {
        Ok(result) => result.bytes().await?,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| VersionError::Corrupt {
            path: path.to_string(),
            reason: e.to_string(),
        })
}

fn encode<T: Serialize>(path: &Path, value: &T) -> Result<Vec<u8>, VersionError> {
    serde_json::to_vec(value).map_err(|e| VersionError::Corrupt {
        path: path.to_string(),
        reason: e.to_string(),
    })
}

impl VersionLog {
    /// The log in directory `dir` (no trailing slash).
    pub(crate) fn new(dir: impl Into<String>) -> Self {
        VersionLog { dir: dir.into() }
    }

    /// The directory.
    pub(crate) fn dir(&self) -> &str {
        &self.dir
    }

    /// The object of version `v`.
    pub(crate) fn path(&self, v: u64) -> Path {
        Path::from(format!("{}/{v:020}.json", self.dir))
    }

    /// The checkpoint object of version `v`.
    pub(crate) fn checkpoint_path(&self, v: u64) -> Path {
        Path::from(format!("{}/{v:020}.checkpoint.json", self.dir))
    }

    fn floor_path(&self, v: u64) -> Path {
        Path::from(format!("{}/{v:020}.floor", self.dir))
    }

    /// Version `v`, if it exists.
    pub(crate) async fn read<T: DeserializeOwned>(
        &self,
        store: &dyn ObjectStore,
        v: u64,
    ) -> Result<Option<T>, VersionError> {
        read_json(store, &self.path(v)).await
    }

    /// Writes version `value` as number `v` if no version `v` exists. `Ok(true)`: this
    /// attempt's version is there; `Ok(false)`: someone else's is. An ambiguous failure is
    /// settled by reading the version back and comparing tags; if that read fails too, the
    /// original error is returned (the outcome is unknown).
    pub(crate) async fn try_create<T: Serialize + DeserializeOwned + Tagged>(
        &self,
        store: &dyn ObjectStore,
        v: u64,
        value: &T,
    ) -> Result<bool, VersionError> {
        let path = self.path(v);
        let body = encode(&path, value)?;
        let options = PutOptions::from(PutMode::Create);
        match store.put_opts(&path, PutPayload::from(body), options).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => {
                // Lost the race, or won it on an earlier attempt whose answer was lost.
                Ok(self
                    .read::<T>(store, v)
                    .await?
                    .is_some_and(|w| w.tag() == value.tag()))
            }
            Err(e) => match self.read::<T>(store, v).await {
                Ok(Some(written)) => Ok(written.tag() == value.tag()),
                // Not there: the attempt did not land.
                Ok(None) | Err(_) => Err(e.into()),
            },
        }
    }

    /// Writes a checkpoint of the state at version `v` (overwrites: every writer of it
    /// writes the same state).
    pub(crate) async fn write_checkpoint<T: Serialize>(
        &self,
        store: &dyn ObjectStore,
        v: u64,
        state: &T,
    ) -> Result<(), VersionError> {
        let path = self.checkpoint_path(v);
        let body = encode(&path, state)?;
        store.put(&path, PutPayload::from(body)).await?;
        Ok(())
    }

    /// Every version and checkpoint in the directory.
    pub(crate) async fn list(&self, store: &dyn ObjectStore) -> Result<Listing, VersionError> {
        let listed: Vec<ObjectMeta> = store
            .list(Some(&Path::from(self.dir.as_str())))
            .try_collect()
            .await?;
        let mut listing = Listing::default();
        for meta in listed {
            let Some(name) = meta.location.filename() else {
                continue;
            };
            if let Some(n) = name.strip_suffix(".checkpoint.json") {
                if let Ok(v) = n.parse::<u64>() {
                    listing.checkpoints.push((v, meta));
                }
            } else if let Some(n) = name.strip_suffix(".json")
                && let Ok(v) = n.parse::<u64>()
            {
                listing.versions.push((v, meta));
            }
        }
        listing.versions.sort_by_key(|(v, _)| *v);
        listing.checkpoints.sort_by_key(|(v, _)| *v);
        Ok(listing)
    }

    /// The floor: versions below it may have been collected away (0 when none were).
    pub(crate) async fn floor(&self, store: &dyn ObjectStore) -> Result<u64, VersionError> {
        let marks: Vec<ObjectMeta> = store
            .list(Some(&Path::from(self.dir.as_str())))
            .try_collect()
            .await?;
        Ok(marks
            .iter()
            .filter_map(|m| m.location.filename()?.strip_suffix(".floor")?.parse().ok())
            .max()
            .unwrap_or(0))
    }

    /// Raises the floor to `version` (before versions below it are deleted), and removes the
    /// marks below it.
    pub(crate) async fn raise_floor(
        &self,
        store: &dyn ObjectStore,
        version: u64,
    ) -> Result<(), VersionError> {
        let current = self.floor(store).await?;
        if current >= version {
            return Ok(());
        }
        let options = PutOptions::from(PutMode::Create);
        match store
            .put_opts(&self.floor_path(version), PutPayload::new(), options)
            .await
        {
            Ok(_)
            | Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        if current > 0 {
            let _ = store.delete(&self.floor_path(current)).await;
        }
        Ok(())
    }
}
