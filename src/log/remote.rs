//! The commit log's copy in object storage, for `durability = "object-store"`.
//!
//! Under this durability every group commit is written to the object store as one object
//! before any append in it is acknowledged; the local segments are then only a cache (they
//! are not synced). A node whose disk is lost loses nothing acknowledged: whoever claims its
//! id next ([`crate::node`]) reads the objects back and replays them.
//!
//! Layout, under `nodes/{id}/wal/` (named in [`crate::storage::paths`]):
//! - `{first_lsn:020}.wal`: one group, its records framed exactly as in a segment file.
//! - `{lsn:020}.wal` holding [`FENCE`]: a fence. It takes the key the fenced epoch's next
//!   group would have, so that group can never be written.
//!
//! Invariants:
//! - **Objects are created, never overwritten.** A group is written with a conditional
//!   create under the key of its first LSN. An answer that was lost is settled by reading the
//!   key back: our own bytes mean the write landed; anything else (a fence) means this epoch
//!   was fenced, and the group is answered with an error, never acknowledged.
//! - **One writer per epoch, in LSN order.** The log's writer thread ships one group at a
//!   time, so an epoch's next key is always one past the last LSN of its newest object, or
//!   the epoch's first LSN when it has written nothing.
//! - **Recovery fences before it reads.** A process that claims an epoch of an id
//!   ([`recover`]) creates a fence at the next key of every earlier epoch that has objects,
//!   and of the latest few that have none, before it trusts its listing: a paused process of
//!   such an epoch that wakes up finds its next key taken, and its group is never
//!   acknowledged. Had the old process won the race for the key, the recovery reads that
//!   group too and fences one further.
//! - **Release deletes below the consumers' floor**, except the newest object of the epoch
//!   that is writing (whose last LSN names the next key) and fences; garbage collection
//!   deletes fences of earlier epochs after the grace period.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt as _, TryStreamExt as _};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload};

use super::{Lsn, Record, epoch_of, lsn_base, segment};
use crate::storage::paths;

/// The body of a fence object.
pub(crate) const FENCE: &[u8] = b"SLUICE-WAL-FENCE\n";

/// How many epochs before the claimed one are fenced even when they wrote nothing.
const FENCE_EMPTY_EPOCHS: u64 = 8;

/// How long a group's write is retried before the log gives up on it.
const SHIP_ATTEMPTS: u32 = 8;

/// Why a group could not be written to the object store.
#[derive(Debug)]
pub(super) enum ShipError {
    /// Another process fenced this epoch: the group was not written and never will be.
    Fenced,
    /// The store kept failing; the group may or may not have landed.
    Store(String),
}

/// The commit log's object-store copy, for one node id and epoch.
pub(crate) struct RemoteLog {
    store: Arc<dyn ObjectStore>,
    dir: String,
    epoch: u64,
    runtime: tokio::runtime::Handle,
    /// Data objects written or found and not yet deleted: `first LSN -> last LSN`.
    objects: Arc<Mutex<BTreeMap<Lsn, Lsn>>>,
    /// A deletion pass is running.
    deleting: Arc<AtomicBool>,
}

impl std::fmt::Debug for RemoteLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteLog")
            .field("dir", &self.dir)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

fn object_path(dir: &str, first: Lsn) -> ObjectPath {
    ObjectPath::from(format!("{dir}/{first:020}.wal"))
}

fn first_lsn_of(path: &ObjectPath) -> Option<Lsn> {
    path.filename()?.strip_suffix(".wal")?.parse().ok()
}

/// The records framed in one object; `None` when it is not a whole run of valid frames
/// with consecutive LSNs from `first`.
fn decode_object(bytes: &[u8], first: Lsn) -> Option<Vec<Record>> {
    let mut records = Vec::new();
    let mut pos = 0;
    let mut expected = first;
    while pos < bytes.len() {
        let (record, next, _) = segment::decode_at(bytes, pos)?;
        if record.lsn != expected {
            return None;
        }
        expected += 1;
        records.push(record);
        pos = next;
    }
    (!records.is_empty()).then_some(records)
}

/// What one key holds.
enum Found {
    Fence,
    Data(Vec<Record>),
}

async fn read_object(
    store: &dyn ObjectStore,
    path: &ObjectPath,
    first: Lsn,
) -> Result<Option<(Found, Bytes)>, object_store::Error> {
    let bytes = match store.get(path).await {
        Ok(r) => r.bytes().await?,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    if bytes.starts_with(FENCE) {
        return Ok(Some((Found::Fence, bytes)));
    }
    match decode_object(&bytes, first) {
        Some(records) => Ok(Some((Found::Data(records), bytes))),
        None => Err(object_store::Error::Generic {
            store: "wal",
            source: format!("commit log object {path} is not a valid group of records").into(),
        }),
    }
}

impl RemoteLog {
    /// The object key of the group starting at `first`.
    fn path(&self, first: Lsn) -> ObjectPath {
        object_path(&self.dir, first)
    }

    /// Writes one group (`body`: its framed records, LSNs `first..=last`) and returns once it
    /// is in the store. Blocks: runs on the log's writer thread.
    pub(super) fn ship(&self, first: Lsn, last: Lsn, body: Bytes) -> Result<(), ShipError> {
        let path = self.path(first);
        let store = self.store.clone();
        let result = self.runtime.block_on(async move {
            let mut delay = Duration::from_millis(50);
            let mut last_error = String::new();
            for attempt in 0..SHIP_ATTEMPTS {
                if attempt > 0 {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
                let options = PutOptions::from(PutMode::Create);
                match store
                    .put_opts(&path, PutPayload::from(body.clone()), options)
                    .await
                {
                    Ok(_) => return Ok(()),
                    Err(e) => {
                        let conflict = matches!(
                            e,
                            object_store::Error::AlreadyExists { .. }
                                | object_store::Error::Precondition { .. }
                        );
                        // Settle by reading back: our own bytes mean an earlier attempt
                        // landed; other bytes mean a fence took the key.
                        match store.get(&path).await {
                            Ok(r) => match r.bytes().await {
                                Ok(found) if found == body => return Ok(()),
                                Ok(_) => return Err(ShipError::Fenced),
                                Err(read) => last_error = format!("{e}; reading back: {read}"),
                            },
                            Err(object_store::Error::NotFound { .. }) if !conflict => {
                                last_error = e.to_string();
                            }
                            Err(read) => last_error = format!("{e}; reading back: {read}"),
                        }
                    }
                }
            }
            Err(ShipError::Store(last_error))
        });
        if result.is_ok()
            && let Ok(mut objects) = self.objects.lock()
        {
            objects.insert(first, last);
        }
        result
    }

    /// Deletes, in the background, the objects whose records all lie below `floor` (every
    /// consumer made them durable elsewhere), keeping the newest object of this epoch.
    pub(super) fn release(&self, floor: Lsn) {
        let doomed: Vec<Lsn> = {
            let Ok(objects) = self.objects.lock() else {
                return;
            };
            let newest_here = objects
                .iter()
                .rev()
                .find(|(first, _)| epoch_of(**first) == self.epoch)
                .map(|(first, _)| *first);
            objects
                .iter()
                .filter(|(first, last)| **last < floor && Some(**first) != newest_here)
                .map(|(first, _)| *first)
                .collect()
        };
        if doomed.is_empty() || self.deleting.swap(true, Ordering::AcqRel) {
            return;
        }
        let store = self.store.clone();
        let dir = self.dir.clone();
        let deleting = self.deleting.clone();
        let objects = self.objects.clone();
        self.runtime.spawn(async move {
            for first in doomed {
                match store.delete(&object_path(&dir, first)).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                        if let Ok(mut objects) = objects.lock() {
                            objects.remove(&first);
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "deleting a released commit log object failed; retrying at the next release");
                        break;
                    }
                }
            }
            deleting.store(false, Ordering::Release);
        });
    }

    /// Deletes fences of earlier epochs written more than `grace` ago (a process of such an
    /// epoch that was paused that long has long found itself fenced by its lease).
    pub(crate) async fn collect_fences(
        &self,
        grace: Duration,
    ) -> Result<crate::storage::GcReport, object_store::Error> {
        let mut report = crate::storage::GcReport::default();
        let cutoff = crate::storage::gc::cutoff(grace);
        let listed: Vec<object_store::ObjectMeta> = self
            .store
            .list(Some(&ObjectPath::from(self.dir.as_str())))
            .try_collect()
            .await?;
        for meta in listed {
            let Some(first) = first_lsn_of(&meta.location) else {
                continue;
            };
            if epoch_of(first) >= self.epoch
                || meta.last_modified >= cutoff
                || meta.size != FENCE.len() as u64
                || self.objects.lock().map_or(true, |o| o.contains_key(&first))
            {
                continue;
            }
            if matches!(
                read_object(self.store.as_ref(), &meta.location, first).await,
                Ok(Some((Found::Fence, _)))
            ) && self.store.delete(&meta.location).await.is_ok()
            {
                report.objects += 1;
                report.bytes += meta.size;
            }
        }
        Ok(report)
    }
}

/// Reads back node `id`'s commit log from the object store for a process that has just
/// claimed `epoch` of it: fences every earlier epoch (see the module docs), then returns the
/// records of every group ever acknowledged and not yet released, in LSN order, and the
/// remote log that continues it for `epoch`.
pub(crate) async fn recover(
    store: Arc<dyn ObjectStore>,
    id: &str,
    epoch: u64,
) -> Result<(RemoteLog, Vec<Record>), object_store::Error> {
    let dir = paths::node_wal(id);
    let listed: Vec<object_store::ObjectMeta> = store
        .list(Some(&ObjectPath::from(dir.as_str())))
        .try_collect()
        .await?;
    let mut keys: Vec<Lsn> = listed
        .iter()
        .filter_map(|m| first_lsn_of(&m.location))
        .filter(|first| epoch_of(*first) < epoch)
        .collect();
    keys.sort_unstable();
    // Read every object (a few at a time).
    let fetched: Vec<(Lsn, Option<(Found, Bytes)>)> = futures::stream::iter(keys)
        .map(|first| {
            let store = store.clone();
            let path = object_path(&dir, first);
            async move {
                let found = read_object(store.as_ref(), &path, first).await?;
                Ok::<_, object_store::Error>((first, found))
            }
        })
        .buffered(16)
        .try_collect()
        .await?;
    let mut groups: BTreeMap<Lsn, Vec<Record>> = BTreeMap::new();
    // Per epoch: the key its next group would take, or `None` once it is fenced.
    let mut next_key: BTreeMap<u64, Option<Lsn>> = BTreeMap::new();
    for (first, found) in fetched {
        match found {
            Some((Found::Data(records), _)) => {
                let last = records.last().map_or(first, |r| r.lsn);
                let entry = next_key.entry(epoch_of(first)).or_insert(Some(first));
                if entry.is_some() {
                    *entry = Some(last + 1);
                }
                groups.insert(first, records);
            }
            Some((Found::Fence, _)) => {
                next_key.insert(epoch_of(first), None);
            }
            // Released since it was listed.
            None => {}
        }
    }
    for q in epoch.saturating_sub(FENCE_EMPTY_EPOCHS).max(1)..epoch {
        next_key.entry(q).or_insert(Some(lsn_base(q)));
    }
    for (_, key) in next_key {
        let Some(mut key) = key else { continue };
        // The fenced epoch's process may win the race for the key: then its group is read
        // and the fence goes one further.
        loop {
            let path = object_path(&dir, key);
            let options = PutOptions::from(PutMode::Create);
            match store
                .put_opts(&path, PutPayload::from_static(FENCE), options)
                .await
            {
                Ok(_) => break,
                Err(
                    object_store::Error::AlreadyExists { .. }
                    | object_store::Error::Precondition { .. },
                ) => {}
                Err(e) => {
                    // An ambiguous answer: read the key back below.
                    tracing::debug!(error = %e, "writing a commit log fence failed; reading back");
                }
            }
            match read_object(store.as_ref(), &path, key).await? {
                Some((Found::Fence, _)) => break,
                Some((Found::Data(records), _)) => {
                    let last = records.last().map_or(key, |r| r.lsn);
                    groups.insert(key, records);
                    key = last + 1;
                }
                None => {
                    return Err(object_store::Error::Generic {
                        store: "wal",
                        source: format!("could not write the commit log fence {path}").into(),
                    });
                }
            }
        }
    }
    let objects: BTreeMap<Lsn, Lsn> = groups
        .iter()
        .map(|(first, records)| (*first, records.last().map_or(*first, |r| r.lsn)))
        .collect();
    let records: Vec<Record> = groups.into_values().flatten().collect();
    let remote = RemoteLog {
        store,
        dir,
        epoch,
        runtime: tokio::runtime::Handle::current(),
        objects: Arc::new(Mutex::new(objects)),
        deleting: Arc::new(AtomicBool::new(false)),
    };
    Ok((remote, records))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::RecordKind;

    fn group(first: Lsn, n: u64) -> Bytes {
        let mut body = Vec::new();
        for lsn in first..first + n {
            let payload = lsn.to_le_bytes();
            let header =
                segment::frame_header(lsn, RecordKind::Metadata, lsn + 1 == first + n, &payload);
            body.extend_from_slice(&header);
            body.extend_from_slice(&payload);
        }
        Bytes::from(body)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_recovery_fences_the_old_epoch_and_reads_every_group() {
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        // Epoch 1 writes two groups.
        let (old, records) = recover(store.clone(), "n", 1).await.unwrap();
        assert!(records.is_empty());
        let base = lsn_base(1);
        let old = Arc::new(old);
        let writer = old.clone();
        tokio::task::spawn_blocking(move || {
            writer.ship(base, base + 2, group(base, 3)).unwrap();
            writer.ship(base + 3, base + 3, group(base + 3, 1)).unwrap();
        })
        .await
        .unwrap();
        // Epoch 2 claims the id: it reads both groups and fences epoch 1.
        let (_new, records) = recover(store.clone(), "n", 2).await.unwrap();
        let lsns: Vec<Lsn> = records.iter().map(|r| r.lsn).collect();
        assert_eq!(lsns, vec![base, base + 1, base + 2, base + 3]);
        // The old epoch's next group is refused, and never read by a later recovery.
        let writer = old.clone();
        let refused = tokio::task::spawn_blocking(move || {
            writer.ship(base + 4, base + 4, group(base + 4, 1))
        })
        .await
        .unwrap();
        assert!(matches!(refused, Err(ShipError::Fenced)));
        let (_third, records) = recover(store.clone(), "n", 3).await.unwrap();
        assert_eq!(records.len(), 4);
    }

    /// A log under [`crate::log::Durability::ObjectStore`] in a fresh directory named after
    /// `name`, on epoch 1 of node "n" in `store`, with `lease` to acknowledge writes.
    async fn leased_log(
        store: Arc<dyn ObjectStore>,
        name: &str,
        lease: std::time::Duration,
    ) -> (crate::log::CommitLog, std::path::PathBuf) {
        use crate::log::{CommitLog, Durability, LogConfig};
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut config = LogConfig::new(dir.join("log"));
        config.durability = Durability::ObjectStore;
        let (log, _) = CommitLog::open(config).unwrap();
        log.advance_to(lsn_base(1)).await.unwrap();
        let (remote, _) = recover(store, "n", 1).await.unwrap();
        log.attach_remote(remote, lease);
        (log, dir)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_written_after_the_lease_ran_out_is_not_acknowledged() {
        use crate::log::LogError;
        use crate::storage::probe::{Probe, ProbedStore};
        let probe = Arc::new(Probe::default());
        let store: Arc<dyn ObjectStore> = Arc::new(ProbedStore::new(
            Arc::new(object_store::memory::InMemory::new()),
            probe.clone(),
        ));
        let lease = std::time::Duration::from_millis(300);
        let (log, dir) = leased_log(store, "sluice-lapsed", lease).await;
        // Acknowledged while the lease holds.
        let first = log.append(RecordKind::Metadata, vec![1]).await.unwrap();
        // A write slower than the rest of the lease: written, applied, not acknowledged.
        probe.delay_writes(lease * 3);
        let lapsed = log.append(RecordKind::Metadata, vec![2]).await;
        assert!(matches!(lapsed, Err(LogError::LeaseLapsed)), "{lapsed:?}");
        assert_eq!(log.last_lsn(), first + 1, "the group is in the log");
        // Nothing more is written until the lease is renewed.
        probe.delay_writes(std::time::Duration::ZERO);
        let refused = log.append(RecordKind::Metadata, vec![3]).await;
        assert!(
            matches!(refused, Err(LogError::LeaseExpired)),
            "{refused:?}"
        );
        log.renew_lease(std::time::Instant::now() + lease);
        assert_eq!(
            log.append(RecordKind::Metadata, vec![4]).await.unwrap(),
            first + 2
        );
        log.close();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resent_group_that_landed_counts_as_written() {
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let (log, _) = recover(store.clone(), "n", 1).await.unwrap();
        let base = lsn_base(1);
        let log = Arc::new(log);
        let writer = log.clone();
        tokio::task::spawn_blocking(move || {
            writer.ship(base, base, group(base, 1)).unwrap();
            // The same bytes again: an earlier attempt whose answer was lost.
            writer.ship(base, base, group(base, 1)).unwrap();
        })
        .await
        .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_chained_to_one_the_log_refused_is_not_written() {
        use crate::log::{Chain, LogError};
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let lease = std::time::Duration::from_millis(200);
        let (log, dir) = leased_log(store, "sluice-chain", lease).await;
        let chain = Arc::new(Chain::default());
        let first = log
            .submit_chained(RecordKind::StreamAppend, vec![1], |_| {}, chain.clone())
            .unwrap()
            .durable()
            .await
            .unwrap();
        assert!(!chain.is_broken());
        // The lease runs out: the next record of the chain is refused, nothing written (a
        // refusal that leaves the log usable)...
        tokio::time::sleep(lease * 2).await;
        let refused = log
            .submit_chained(RecordKind::StreamAppend, vec![2], |_| {}, chain.clone())
            .unwrap();
        // ...and one submitted behind it, decided against it, is not written once the lease
        // is back either, while a record of another chain is.
        let behind = log
            .submit_chained(RecordKind::StreamAppend, vec![3], |_| {}, chain.clone())
            .unwrap();
        let refused = refused.durable().await;
        assert!(
            matches!(refused, Err(LogError::LeaseExpired)),
            "{refused:?}"
        );
        assert!(chain.is_broken());
        log.renew_lease(std::time::Instant::now() + lease * 10);
        let applied = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let later = {
            let applied = applied.clone();
            log.submit_chained(
                RecordKind::StreamAppend,
                vec![4],
                move |_| applied.store(true, std::sync::atomic::Ordering::SeqCst),
                chain.clone(),
            )
            .unwrap()
        };
        let other = log
            .submit_chained(
                RecordKind::StreamAppend,
                vec![5],
                |_| {},
                Arc::new(Chain::default()),
            )
            .unwrap();
        let behind = behind.durable().await;
        assert!(
            matches!(
                behind,
                Err(LogError::LeaseExpired | LogError::EarlierFailed)
            ),
            "{behind:?}"
        );
        let later = later.durable().await;
        assert!(matches!(later, Err(LogError::EarlierFailed)), "{later:?}");
        assert!(!applied.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(other.durable().await.unwrap(), first + 1);
        assert_eq!(
            log.last_lsn(),
            first + 1,
            "only the other chain's record was written"
        );
        log.close();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
