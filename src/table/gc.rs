//! Garbage collection of table storage: Parquet files no live manifest version references
//! (replaced by compaction, or written by a flush or compaction whose commit never landed),
//! manifest versions below a checkpoint, and the whole storage of dropped tables.
//!
//! Nothing is deleted the moment it stops being referenced: an object is deleted only after
//! this node has seen it unreferenced, in a freshly loaded manifest, for the whole grace
//! period. Queries that started before (on this node or another) finish within it (the grace
//! period is longer than the statement timeout), and an object another node is about to
//! commit is at most a few seconds old when it first looks unreferenced: a flush or compaction
//! does not commit a file older than half the grace period ([`Tables::commit_deadline`]).
//! Manifest versions are deleted only below the newest checkpoint and when older than the
//! grace period, after the log's floor is raised past them.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::TryStreamExt as _;
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStoreExt as _};

use super::{TableError, Tables};
use crate::storage::gc::{GcReport, Unreferenced, cutoff};
use crate::storage::paths;

async fn list(tables: &Tables, prefix: &str) -> Result<Vec<ObjectMeta>, TableError> {
    tables
        .storage
        .store()
        .list(Some(&Path::from(prefix)))
        .try_collect()
        .await
        .map_err(TableError::Storage)
}

impl Tables {
    /// The longest a written file may wait for its commit: half the grace period, so that
    /// garbage collection (which deletes files unreferenced for the whole grace period) never
    /// deletes a file a commit is about to reference.
    pub(crate) fn commit_deadline(&self) -> Duration {
        self.gc_grace / 2
    }

    async fn delete(&self, path: &str, size: u64, report: &mut GcReport) {
        match self.storage.store().delete(&Path::from(path)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                report.objects += 1;
                report.bytes += size;
            }
            Err(e) => tracing::debug!(%path, error = %e, "garbage collection: delete failed"),
        }
    }

    /// The ids of every table with storage in the object store.
    pub(crate) async fn stored_ids(&self) -> Result<Vec<String>, TableError> {
        let listed = self
            .storage
            .store()
            .list_with_delimiter(Some(&Path::from(paths::TABLES)))
            .await
            .map_err(TableError::Storage)?;
        Ok(listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_owned))
            .collect())
    }

    /// Collects the garbage of the tables `stored` (listed by [`Tables::stored_ids`]):
    /// `live_ids` are the storage ids the catalog names, loaded after that listing; storage
    /// of any other id is a dropped table's. (A table's storage is created after the catalog
    /// version naming it, so a listed id missing from a later catalog was dropped.)
    pub(crate) async fn collect_garbage(
        &self,
        stored: &[String],
        live_ids: &HashSet<String>,
    ) -> Result<GcReport, TableError> {
        let mut report = GcReport::default();
        let mut failed = None;
        for id in stored {
            if live_ids.contains(id) {
                // One table failing must not stop the collection of the others.
                match self.collect_table(id).await {
                    Ok(r) => report.add(r),
                    Err(e) => {
                        tracing::debug!(table = %id, error = %e, "garbage collection of a table failed");
                        self.unreferenced()
                            .forget_scope(&format!("{}/", paths::table(id)));
                        failed.get_or_insert(e);
                    }
                }
            }
        }
        // Dropped tables: everything under their directory, once they have stayed dropped
        // for the grace period.
        let dropped: Vec<&str> = stored
            .iter()
            .filter(|id| !live_ids.contains(*id))
            .map(String::as_str)
            .collect();
        let due = {
            let keys: Vec<String> = dropped.iter().map(|id| format!("dropped:{id}")).collect();
            self.unreferenced()
                .due("dropped:", keys.iter().map(String::as_str), self.gc_grace)
        };
        for key in due {
            let id = key.trim_start_matches("dropped:");
            for meta in list(self, &paths::table(id)).await? {
                self.delete(meta.location.as_ref(), meta.size, &mut report)
                    .await;
            }
            self.forget_table(id);
            self.unreferenced().forget(&key);
        }
        match failed {
            // What could be collected was; the failure is reported (and retried next time).
            Some(e) if report.objects == 0 => Err(e),
            _ => Ok(report),
        }
    }

    fn unreferenced(&self) -> std::sync::MutexGuard<'_, Unreferenced> {
        self.gc.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One live table: files no version references, and versions below the checkpoint.
    async fn collect_table(&self, id: &str) -> Result<GcReport, TableError> {
        let mut report = GcReport::default();
        let table = self.table(id).await?;
        // A fresh, full view: nothing is judged unreferenced from a stale state.
        let state = table.manifest.load(self.storage.store().as_ref()).await?;
        table.lock().install(state.clone(), self.node.id());
        // The observer (the Iceberg view) first: what it stops showing leaves it before
        // any file it listed can be due. No data file is deleted unless it showed this
        // state whole; its own objects are collected whenever it answers.
        let mut sizes: HashMap<String, u64> = HashMap::new();
        let mut candidates: Vec<String> = Vec::new();
        let shown_whole = match &self.observer {
            Some(observer) => {
                let shown = observer.collectable(id, &state).await?;
                for (path, size) in shown.objects {
                    candidates.push(path.clone());
                    sizes.insert(path, size);
                }
                shown.complete
            }
            None => true,
        };
        if shown_whole {
            let live: HashSet<&str> = state.files.iter().map(|f| f.path.as_str()).collect();
            for meta in list(self, &paths::table_data(id)).await? {
                let path = meta.location.to_string();
                if !live.contains(path.as_str()) {
                    candidates.push(path.clone());
                    sizes.insert(path, meta.size);
                }
            }
        }
        let scope = format!("{}/", paths::table(id));
        let due =
            self.unreferenced()
                .due(&scope, candidates.iter().map(String::as_str), self.gc_grace);
        for path in due {
            self.delete(&path, sizes.get(&path).copied().unwrap_or(0), &mut report)
                .await;
            self.unreferenced().forget(&path);
        }
        // Manifest versions below the newest checkpoint, once older than the grace period.
        let log = table.manifest.log();
        let listing = log.list(self.storage.store().as_ref()).await?;
        let Some(checkpoint) = listing.checkpoint_at_or_below(state.version) else {
            return Ok(report);
        };
        let cutoff = cutoff(self.gc_grace);
        let old = |meta: &ObjectMeta| meta.last_modified < cutoff;
        let versions: Vec<&ObjectMeta> = listing
            .versions
            .iter()
            .filter(|(v, m)| *v < checkpoint && old(m))
            .map(|(_, m)| m)
            .collect();
        let checkpoints: Vec<&ObjectMeta> = listing
            .checkpoints
            .iter()
            .filter(|(v, m)| *v < checkpoint && old(m))
            .map(|(_, m)| m)
            .collect();
        if versions.is_empty() && checkpoints.is_empty() {
            return Ok(report);
        }
        log.raise_floor(self.storage.store().as_ref(), checkpoint)
            .await?;
        for meta in versions.into_iter().chain(checkpoints) {
            self.delete(meta.location.as_ref(), meta.size, &mut report)
                .await;
        }
        Ok(report)
    }
}
