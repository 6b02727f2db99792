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
    /// This writer created the version, but garbage collection raised the floor past it
    /// meanwhile (the writer's view was older than the grace period): readers will never
    /// see it, so it counts as lost, like a lost race (nothing it holds took effect), and
    /// the writer retries from a fresh read. The orphan version is deleted at once.
    #[error("{path} was created below the floor")]
    BelowFloor {
        /// The version.
        path: String,
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
    /// original error is returned (the outcome is unknown). A version this attempt created
    /// that the floor has passed is [`VersionError::BelowFloor`].
    pub(crate) async fn try_create<T: Serialize + DeserializeOwned + Tagged>(
        &self,
        store: &dyn ObjectStore,
        v: u64,
        value: &T,
    ) -> Result<bool, VersionError> {
        let won = self.create_or_read_back(store, v, value).await?;
        if won && self.floor(store).await? > v {
            // No reader looks below the floor, so the version is garbage: remove it now
            // (best effort; collection removes what is left below the floor anyway).
            let _ = store.delete(&self.path(v)).await;
            return Err(VersionError::BelowFloor {
                path: self.path(v).to_string(),
            });
        }
        Ok(won)
    }

    async fn create_or_read_back<T: Serialize + DeserializeOwned + Tagged>(
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

#[cfg(test)]
mod tests {
    //! The protocol against a store that loses answers ([`crate::storage::probe`]); the
    //! catalog and the manifest run the same cases through the database
    //! (`tests/it/durability.rs`, `tests/it/table.rs`).
    use std::sync::Arc;

    use object_store::memory::InMemory;

    use super::*;
    use crate::storage::probe::{Probe, ProbedStore};

    #[derive(Debug, serde::Serialize, serde::Deserialize)]
    struct V {
        tag: String,
    }

    impl Tagged for V {
        fn tag(&self) -> &str {
            &self.tag
        }
    }

    fn v(tag: &str) -> V {
        V { tag: tag.into() }
    }

    fn store() -> (Arc<Probe>, ProbedStore) {
        let probe = Arc::new(Probe::default());
        let store = ProbedStore::new(Arc::new(InMemory::new()), probe.clone());
        (probe, store)
    }

    #[tokio::test]
    async fn of_two_writers_of_one_version_exactly_one_wins() {
        let (_, store) = store();
        let log = VersionLog::new("x");
        assert!(log.try_create(&store, 1, &v("a")).await.unwrap());
        assert!(!log.try_create(&store, 1, &v("b")).await.unwrap());
        // The winner retrying (its first answer lost) still learns it won.
        assert!(log.try_create(&store, 1, &v("a")).await.unwrap());
        let read: V = log.read(&store, 1).await.unwrap().unwrap();
        assert_eq!(read.tag, "a");
    }

    #[tokio::test]
    async fn a_lost_answer_is_settled_by_reading_back() {
        let (probe, store) = store();
        let log = VersionLog::new("x");
        probe.lose_create_answers(1);
        assert!(
            log.try_create(&store, 1, &v("a")).await.unwrap(),
            "landed: ours"
        );
        assert_eq!(probe.counts().1, 1, "the answer was lost");
        // The next writer of version 1 loses; version 2 is free for it.
        assert!(!log.try_create(&store, 1, &v("b")).await.unwrap());
        assert!(log.try_create(&store, 2, &v("b")).await.unwrap());
        assert_eq!(log.list(&store).await.unwrap().latest(), Some(2));
    }

    #[tokio::test]
    async fn an_unsettled_outcome_is_an_error_and_a_retry_settles_it() {
        let (probe, store) = store();
        let log = VersionLog::new("x");
        probe.lose_create_answers_unverified(1);
        let first = log.try_create(&store, 1, &v("a")).await;
        assert!(
            matches!(first, Err(VersionError::Storage(_))),
            "unknown outcome: {first:?}"
        );
        // It did land; the same attempt (same tag) retried finds it is ours, another
        // writer's attempt finds it is not.
        assert!(!log.try_create(&store, 1, &v("b")).await.unwrap());
        assert!(log.try_create(&store, 1, &v("a")).await.unwrap());
    }

    #[tokio::test]
    async fn the_floor_only_rises_and_a_version_created_below_it_is_lost() {
        let (_, store) = store();
        let log = VersionLog::new("x");
        for n in 1..=6 {
            assert!(log.try_create(&store, n, &v(&n.to_string())).await.unwrap());
        }
        log.raise_floor(&store, 5).await.unwrap();
        log.raise_floor(&store, 3).await.unwrap();
        assert_eq!(log.floor(&store).await.unwrap(), 5);
        // Versions 1..5 collected; a writer with a view older than that creates version 2.
        for n in 1..5 {
            store.delete(&log.path(n)).await.unwrap();
        }
        let stale = log.try_create(&store, 2, &v("stale")).await;
        assert!(
            matches!(stale, Err(VersionError::BelowFloor { .. })),
            "{stale:?}"
        );
        // The orphan is not left behind.
        assert!(store.head(&log.path(2)).await.is_err());
        assert!(log.try_create(&store, 7, &v("7")).await.unwrap());
    }
}
