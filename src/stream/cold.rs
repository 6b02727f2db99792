//! Cold stream data and checkpoints.
//!
//! A checkpoint takes a consistent cut of every stream (no change applies while it is
//! taken), seals all in-memory records into one data object, writes the state of the
//! streams that changed since the last checkpoint, pointing into the data objects, and only
//! then releases the commit log up to the cut. Restart loads the newest snapshot, the
//! deltas over it, and replays the log after them.
//!
//! Checkpoints are incremental: most write a *delta*, an entry for each stream that changed
//! since the checkpoint before (appended, created, closed, deleted, its producers
//! forgotten, its forks' count changed) and the names of those removed, so their cost grows
//! with what changed, not with how many streams there are. A stream the chain holds already
//! (same incarnation, as the last checkpoint known to have landed left it) is written as a
//! *patch*: its small fields, the producers and retired producers changed since (set or
//! removed), and its extents past the first `extents_kept` (the ones the chain holds and
//! memory still has); so a delta's cost grows with the producers and extents that changed,
//! not with how many a stream holds. New streams, and every stream a checkpoint took whose
//! delta may not have landed, are written whole. Deltas of version 1 hold only whole
//! streams, and load as before. A full *snapshot* (a new base) is
//! written when there is none yet, when deltas since the base add up to half its size (or
//! [`MAX_DELTAS`] of them), and when objects are being rewritten; loading thus reads at most
//! about one and a half times a snapshot's bytes.
//!
//! A delta is made with a conditional create under the next sequence number of its base;
//! the sequence moves on after every attempt, so an attempt whose answer was lost but that
//! landed is never overwritten, and one that exists already makes the next number be tried.
//! Until a delta is known to have landed, the streams it holds stay marked changed, so the
//! next delta holds them too, whole: every delta holds every change since the last one known
//! to have landed, and a patch only ever follows a checkpoint known to have landed with the
//! extents it keeps. Applying a base's deltas in sequence order, whichever of them landed,
//! thus gives the state at the last one.
//!
//! Extents are merged: a checkpoint that seals a stream's new records reads back the run of
//! small extents just before them and seals it again with them, into its own object, as one
//! extent (see [`merge_from`]: the run is contiguous, each extent at most twice what joined
//! so far, the whole at most [`MERGE_MAX_BYTES`], the reads of one checkpoint bounded). A
//! stream appended at every checkpoint thus holds a logarithmic number of small extents, not
//! one per checkpoint; every extent counts in its stream's state budget. The objects merged
//! out of stay while the store's chain (or memory) points into them, and then for the grace
//! period, as any unreferenced object does, so a reader on another node holding an older
//! checkpoint still finds them.
//!
//! Garbage collection deletes data objects no stream's sealed extents point into (those of
//! deleted and expired streams) and superseded snapshots, once they have stayed so for the
//! grace period; it runs under the checkpoint lock, so a checkpoint's new object is never
//! judged between its write and its snapshot's. An object whose live extents hold less than
//! half of it is marked, and the next checkpoint copies those extents into its own object
//! (they are read back and sealed again like hot records), so one small live stream cannot
//! keep a large object of deleted ones alive.
//!
//! Object layout, under `streams/{node}/` (named in [`crate::storage::paths`]):
//! - `data/{lsn:020}-{tag}.bin` (`data/{lsn:020}.bin` before the tag was added): chunks, one
//!   per run of sealed records of one stream:
//!   `| count: u32 | start: u64 | count × end: u64 | record bytes |` (little endian).
//! - `snapshots/{lsn:020}.json`: the state of every stream at `lsn` (a base).
//! - `deltas/{base:020}-{seq:010}.json`: delta `seq` over the base at `base`: its `lsn`,
//!   the streams changed since the delta before (`streams` whole, `patches` as changes),
//!   and the names removed since. Applied in that order: removals, whole streams, patches.
//!
//! Other nodes read a node's sealed data too ([`ColdStore::sealed_view`]): under
//! object-store durability any node answers a read of a stream another node owns from that
//! node's newest snapshot, as far as the snapshot reaches. A view is used only for a stream
//! whose name's claim (`db::names`) names that node and the snapshot's incarnation, so a
//! view never answers for a stream deleted or made again since: sealed records of one
//! incarnation never change, and an object a view points into that was collected since makes
//! the read go to the owner instead.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use futures::TryStreamExt as _;
use object_store::path::Path;
use object_store::{ObjectStoreExt as _, PutPayload};

use super::codec::{ForkSpec, Lifetime, ProducerTuple};
use super::state::{Chunk, ColdExtent, ProducerState, Retired, StreamState};
use super::{StreamError, Streams};
use crate::log::Lsn;
use crate::storage::Storage;
use crate::storage::gc::{GcReport, Unreferenced};
use crate::storage::paths;

/// Records of one sealed chunk: `(start, end, bytes)`.
type Records = Arc<Vec<(u64, u64, Bytes)>>;

/// Object storage access for stream data, with a small cache of fetched chunks.
pub(super) struct ColdStore {
    storage: Storage,
    /// The node whose streams these are (objects under [`paths::streams`]).
    node: String,
    cache: Mutex<Cache>,
    snapshot_lsn: AtomicU64,
    last_checkpoint: Mutex<Instant>,
    checkpoint_lock: tokio::sync::Mutex<()>,
    /// Objects garbage collection has seen unreferenced.
    unreferenced: Mutex<Unreferenced>,
    /// Objects mostly holding data of deleted streams: the next checkpoint copies what is
    /// still live out of them into its own object, so they stop being referenced.
    rewrite: Mutex<std::collections::HashSet<String>>,
    /// Other nodes' newest checkpoints, as views of their streams, by node id, with the
    /// listings each was read from.
    views: Mutex<HashMap<String, (ViewSource, StreamViews)>>,
    /// Held while a snapshot is read into a view, so concurrent readers wait for one read.
    view_load: tokio::sync::Mutex<()>,
    /// Where the chain of checkpoints stands: its base and deltas.
    chain: Mutex<ChainState>,
    /// Streams changed since the last checkpoint in ways their applied LSN does not show
    /// (removed, a fork's count, producers forgotten), by name.
    touched: Mutex<std::collections::HashSet<String>>,
}

/// The objects a view of another node's streams was read from: its newest snapshot and the
/// deltas over it.
#[derive(Debug, Clone, PartialEq)]
struct ViewSource {
    snapshot: object_store::ObjectMeta,
    deltas: usize,
    last_delta: Option<object_store::ObjectMeta>,
}

/// A base snapshot and the deltas written over it.
#[derive(Debug, Default, Clone, Copy)]
struct ChainState {
    /// The base's LSN (0: none yet).
    base: Lsn,
    /// Its size.
    base_bytes: u64,
    /// The sequence number the next delta tries.
    next_seq: u64,
    /// Deltas known over the base, and their bytes.
    deltas: u64,
    delta_bytes: u64,
}

/// A full snapshot is written instead of a delta once this many deltas are over its base.
const MAX_DELTAS: u64 = 1000;

/// The streams that changed between two checkpoints.
#[derive(serde::Serialize, serde::Deserialize)]
struct Delta {
    version: u32,
    base: Lsn,
    seq: u64,
    lsn: Lsn,
    /// Streams written whole: new ones, and those whose stored state is not known.
    streams: Vec<SnapshotStream>,
    removed: Vec<String>,
    /// Streams written as their changes over the state the chain holds (version 2; version
    /// 1 deltas have none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    patches: Vec<StreamPatch>,
}

/// The changes of one stream over the state the chain before holds of the same
/// incarnation: its small fields whole, the producers and retired producers that changed
/// (set or removed), and its extents past the first `extents_kept` (a checkpoint only
/// appends extents and merges a run of the last ones).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct StreamPatch {
    name: String,
    incarnation: String,
    content_type: String,
    lifetime: Lifetime,
    closed: bool,
    closed_by: Option<ProducerTuple>,
    stream_seq: Option<String>,
    fork: Option<ForkSpec>,
    ref_count: u32,
    soft_deleted: bool,
    tail: u64,
    applied_lsn: Lsn,
    /// The LSN of its last data change (see `StreamState::data_lsn`).
    #[serde(default)]
    data_lsn: Option<Lsn>,
    producers: Vec<(String, ProducerState)>,
    producers_removed: Vec<String>,
    retired: Vec<(String, Retired)>,
    retired_removed: Vec<String>,
    extents_kept: usize,
    extents: Vec<ColdExtent>,
}

/// Applies one delta to the streams of the chain before it (see the module docs).
fn apply_delta(
    streams: &mut HashMap<String, SnapshotStream>,
    delta: Delta,
) -> Result<(), StreamError> {
    for name in &delta.removed {
        streams.remove(name);
    }
    for s in delta.streams {
        streams.insert(s.name.clone(), s);
    }
    for p in delta.patches {
        let Some(s) = streams
            .get_mut(&p.name)
            .filter(|s| s.incarnation == p.incarnation)
        else {
            return Err(StreamError::Corrupt(format!(
                "delta {} over {}: a change of stream {} the chain does not hold",
                delta.seq, delta.base, p.name
            )));
        };
        if p.extents_kept > s.extents.len() {
            return Err(StreamError::Corrupt(format!(
                "delta {} over {}: stream {} keeps {} extents of {}",
                delta.seq,
                delta.base,
                p.name,
                p.extents_kept,
                s.extents.len()
            )));
        }
        s.content_type = p.content_type;
        s.lifetime = p.lifetime;
        s.closed = p.closed;
        s.closed_by = p.closed_by;
        s.stream_seq = p.stream_seq;
        s.fork = p.fork;
        s.ref_count = p.ref_count;
        s.soft_deleted = p.soft_deleted;
        s.tail = p.tail;
        s.applied_lsn = Some(p.applied_lsn);
        s.data_lsn = p.data_lsn.or(s.data_lsn);
        if !p.producers.is_empty() || !p.producers_removed.is_empty() {
            let changed: std::collections::HashSet<&str> = p
                .producers_removed
                .iter()
                .map(String::as_str)
                .chain(p.producers.iter().map(|(id, _)| id.as_str()))
                .collect();
            s.producers.retain(|(id, _)| !changed.contains(id.as_str()));
            s.producers.extend(p.producers);
        }
        if !p.retired.is_empty() || !p.retired_removed.is_empty() {
            let changed: std::collections::HashSet<&str> = p
                .retired_removed
                .iter()
                .map(String::as_str)
                .chain(p.retired.iter().map(|(key, _)| key.as_str()))
                .collect();
            s.retired.retain(|(key, _)| !changed.contains(key.as_str()));
            s.retired.extend(p.retired);
        }
        s.extents.truncate(p.extents_kept);
        s.extents.extend(p.extents);
    }
    Ok(())
}

/// One node's streams as its newest snapshot has them, by name.
type StreamViews = Arc<HashMap<String, SealedView>>;

/// Views of this many other nodes are kept (one is dropped for each that comes past it).
const MAX_VIEWS: usize = 256;

/// A stream of another node as its newest snapshot has it: what a read of its sealed data
/// needs. Only streams that live until deleted have one (a TTL or expiry is the owner's to
/// judge, and a read renews it there).
#[derive(Debug, Clone)]
pub(super) struct SealedView {
    pub(super) incarnation: String,
    pub(super) content_type: String,
    /// Its sealed data, in offset order.
    pub(super) extents: Vec<ColdExtent>,
    /// Its tail, when it is closed there (no incarnation grows after its close).
    pub(super) closed_tail: Option<u64>,
}

struct Cache {
    capacity: u64,
    bytes: u64,
    map: HashMap<(String, u64), Records>,
    order: VecDeque<(String, u64)>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Snapshot {
    version: u32,
    lsn: Lsn,
    streams: Vec<SnapshotStream>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct SnapshotStream {
    name: String,
    incarnation: String,
    content_type: String,
    lifetime: Lifetime,
    closed: bool,
    closed_by: Option<ProducerTuple>,
    stream_seq: Option<String>,
    producers: Vec<(String, ProducerState)>,
    /// Retired producers: `(key, state)`, the key as 32 hex digits.
    #[serde(default)]
    retired: Vec<(String, Retired)>,
    fork: Option<ForkSpec>,
    ref_count: u32,
    soft_deleted: bool,
    tail: u64,
    extents: Vec<ColdExtent>,
    /// The LSN of the stream's last change (snapshots written before it was kept lack it:
    /// the stream then counts as changed at the snapshot's LSN).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    applied_lsn: Option<Lsn>,
    /// The LSN of the stream's last data change (checkpoints written before it was kept
    /// lack it: the stream then counts as changed at its last change, as above).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    data_lsn: Option<Lsn>,
}

fn storage_error(e: object_store::Error) -> StreamError {
    StreamError::Storage(e.to_string())
}

impl ColdStore {
    pub(super) fn new(storage: Storage, node: &str, cache_bytes: u64) -> Self {
        ColdStore {
            storage,
            node: node.to_owned(),
            cache: Mutex::new(Cache {
                capacity: cache_bytes,
                bytes: 0,
                map: HashMap::new(),
                order: VecDeque::new(),
            }),
            snapshot_lsn: AtomicU64::new(0),
            last_checkpoint: Mutex::new(Instant::now()),
            checkpoint_lock: tokio::sync::Mutex::new(()),
            unreferenced: Mutex::new(Unreferenced::default()),
            rewrite: Mutex::new(std::collections::HashSet::new()),
            views: Mutex::new(HashMap::new()),
            view_load: tokio::sync::Mutex::new(()),
            chain: Mutex::new(ChainState::default()),
            touched: Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// Marks stream `name` changed for the next checkpoint (see [`ColdStore::touched`]).
    pub(super) fn touch(&self, name: &str) {
        if let Ok(mut touched) = self.touched.lock()
            && !touched.contains(name)
        {
            touched.insert(name.to_owned());
        }
    }

    /// The newest base of node `node` with its deltas applied: the state at its last delta
    /// (see the module docs), and the chain it came from.
    /// The deltas of node `node` over its snapshot at `base`, in order, with their listings.
    async fn list_deltas(
        &self,
        node: &str,
        base: Lsn,
    ) -> Result<Vec<(u64, object_store::ObjectMeta)>, StreamError> {
        let prefix = format!("{}/{base:020}-", paths::stream_deltas(node));
        let dir = Path::from(paths::stream_deltas(node));
        let mut deltas: Vec<(u64, object_store::ObjectMeta)> = self
            .storage
            .store()
            .list(Some(&dir))
            .try_collect::<Vec<_>>()
            .await
            .map_err(storage_error)?
            .into_iter()
            .filter_map(|m| {
                let seq = m
                    .location
                    .as_ref()
                    .strip_prefix(&prefix)?
                    .strip_suffix(".json")?
                    .parse()
                    .ok()?;
                Some((seq, m))
            })
            .collect();
        deltas.sort_by_key(|(seq, _)| *seq);
        Ok(deltas)
    }

    async fn read_chain(&self, node: &str) -> Result<Option<(Snapshot, ChainState)>, StreamError> {
        let Some((base, listed)) = self.newest_snapshot(node).await? else {
            return Ok(None);
        };
        let mut snapshot = self.read_snapshot(node, base).await?;
        let mut chain = ChainState {
            base,
            base_bytes: listed.size,
            next_seq: 1,
            deltas: 0,
            delta_bytes: 0,
        };
        let deltas = self.list_deltas(node, base).await?;
        if deltas.is_empty() {
            return Ok(Some((snapshot, chain)));
        }
        let mut streams: HashMap<String, SnapshotStream> = std::mem::take(&mut snapshot.streams)
            .into_iter()
            .map(|s| (s.name.clone(), s))
            .collect();
        for (seq, meta) in deltas {
            let bytes = self
                .storage
                .store()
                .get(&meta.location)
                .await
                .map_err(storage_error)?
                .bytes()
                .await
                .map_err(storage_error)?;
            let delta: Delta = serde_json::from_slice(&bytes)
                .map_err(|e| StreamError::Corrupt(format!("delta {}: {e}", meta.location)))?;
            let lsn = delta.lsn;
            apply_delta(&mut streams, delta)?;
            snapshot.lsn = snapshot.lsn.max(lsn);
            chain.next_seq = seq + 1;
            chain.deltas += 1;
            chain.delta_bytes += meta.size;
        }
        snapshot.streams = streams.into_values().collect();
        Ok(Some((snapshot, chain)))
    }

    pub(super) fn set_snapshot_lsn(&self, lsn: Lsn) {
        self.snapshot_lsn.store(lsn, Ordering::Release);
    }

    fn snapshot_path(&self, lsn: Lsn) -> Path {
        Path::from(paths::stream_snapshot(&self.node, lsn))
    }

    /// The LSN of node `node`'s newest snapshot, and its object's listing (a checkpoint
    /// that only moved extents out of objects being rewritten writes the snapshot of the
    /// same LSN again: its listing tells the two apart).
    async fn newest_snapshot(
        &self,
        node: &str,
    ) -> Result<Option<(Lsn, object_store::ObjectMeta)>, StreamError> {
        let dir = Path::from(paths::stream_snapshots(node));
        let listed: Vec<object_store::ObjectMeta> = self
            .storage
            .store()
            .list(Some(&dir))
            .try_collect()
            .await
            .map_err(storage_error)?;
        Ok(listed
            .into_iter()
            .filter_map(|m| {
                let lsn: Lsn = m.location.filename()?.strip_suffix(".json")?.parse().ok()?;
                Some((lsn, m))
            })
            .max_by_key(|(lsn, _)| *lsn))
    }

    async fn read_snapshot(&self, node: &str, lsn: Lsn) -> Result<Snapshot, StreamError> {
        let path = Path::from(paths::stream_snapshot(node, lsn));
        let bytes = self
            .storage
            .store()
            .get(&path)
            .await
            .map_err(storage_error)?
            .bytes()
            .await
            .map_err(storage_error)?;
        serde_json::from_slice(&bytes)
            .map_err(|e| StreamError::Corrupt(format!("snapshot {path}: {e}")))
    }

    /// Stream `name` of node `node` as that node's newest checkpoint has it (its newest
    /// snapshot with the deltas over it), if the checkpoint holds it and it lives until
    /// deleted. The newest snapshot and its deltas are listed on every call; they are read
    /// only when they changed.
    pub(super) async fn sealed_view(
        &self,
        node: &str,
        name: &str,
    ) -> Result<Option<SealedView>, StreamError> {
        let Some((lsn, listed)) = self.newest_snapshot(node).await? else {
            return Ok(None);
        };
        // What the view was read from: the snapshot's listing and its deltas' (a delta is
        // written once under a new name, so the last one's listing tells a chain apart).
        let deltas = self.list_deltas(node, lsn).await?;
        let read_from = ViewSource {
            snapshot: listed,
            deltas: deltas.len(),
            last_delta: deltas.last().map(|(_, m)| m.clone()),
        };
        let cached = || {
            self.views.lock().ok().and_then(|views| {
                views
                    .get(node)
                    .filter(|(read, _)| *read == read_from)
                    .map(|(_, view)| view.clone())
            })
        };
        if let Some(view) = cached() {
            return Ok(view.get(name).cloned());
        }
        let _loading = self.view_load.lock().await;
        let view = match cached() {
            Some(view) => view,
            None => {
                let Some((snapshot, _)) = self.read_chain(node).await? else {
                    return Ok(None);
                };
                let view: HashMap<String, SealedView> = snapshot
                    .streams
                    .into_iter()
                    .filter(|s| {
                        !s.soft_deleted
                            && s.lifetime.ttl_secs.is_none()
                            && s.lifetime.expires_at_ms.is_none()
                    })
                    .map(|s| {
                        let view = SealedView {
                            incarnation: s.incarnation,
                            content_type: s.content_type,
                            extents: s.extents,
                            closed_tail: s.closed.then_some(s.tail),
                        };
                        (s.name, view)
                    })
                    .collect();
                let view = Arc::new(view);
                if let Ok(mut views) = self.views.lock() {
                    if views.len() >= MAX_VIEWS
                        && !views.contains_key(node)
                        && let Some(other) = views.keys().next().cloned()
                    {
                        views.remove(&other);
                    }
                    views.insert(node.to_owned(), (read_from, view.clone()));
                }
                view
            }
        };
        Ok(view.get(name).cloned())
    }

    /// Loads the newest snapshot: its LSN and every stream's state.
    pub(super) async fn load_snapshot(
        &self,
    ) -> Result<Option<(Lsn, HashMap<String, StreamState>)>, StreamError> {
        let Some((snapshot, chain)) = self.read_chain(&self.node).await? else {
            return Ok(None);
        };
        if let Ok(mut c) = self.chain.lock() {
            *c = chain;
        }
        let streams = snapshot
            .streams
            .into_iter()
            .map(|s| {
                let mut state = StreamState::new(
                    s.incarnation,
                    s.content_type,
                    s.lifetime,
                    s.fork,
                    s.applied_lsn.unwrap_or(snapshot.lsn),
                );
                state.data_lsn = s.data_lsn.unwrap_or(state.applied_lsn);
                state.closed = s.closed;
                state.closed_by = s.closed_by;
                state.stream_seq = s.stream_seq;
                state.producers = s.producers.into_iter().collect();
                state.recount_producers(super::producer_clock_ms());
                state.retired = s
                    .retired
                    .into_iter()
                    .filter_map(|(key, r)| Some((u128::from_str_radix(&key, 16).ok()?, r)))
                    .collect();
                state.ref_count = s.ref_count;
                state.soft_deleted = s.soft_deleted;
                state.tail = s.tail;
                state.chunks = s.extents.into_iter().map(Chunk::Cold).collect();
                state.recount_extents();
                state.stored = true;
                (s.name, state)
            })
            .collect();
        Ok(Some((snapshot.lsn, streams)))
    }

    /// The records of a sealed extent (fetched, or from the cache).
    pub(super) async fn read_extent(
        &self,
        extent: &ColdExtent,
    ) -> Result<Vec<(u64, u64, Bytes)>, StreamError> {
        let cache_key = (extent.key.clone(), extent.pos);
        let cached = self
            .cache
            .lock()
            .ok()
            .and_then(|c| c.map.get(&cache_key).cloned());
        let records = match cached {
            Some(r) => r,
            None => {
                let path = Path::from(extent.key.as_str());
                let bytes = self
                    .storage
                    .store()
                    .get_range(&path, extent.pos..extent.pos + extent.len)
                    .await
                    .map_err(storage_error)?;
                let records: Records = Arc::new(decode_chunk(&bytes).ok_or_else(|| {
                    StreamError::Corrupt(format!("chunk at {} of {}", extent.pos, extent.key))
                })?);
                if let Ok(mut cache) = self.cache.lock() {
                    cache.insert(cache_key, records.clone(), bytes.len() as u64);
                }
                records
            }
        };
        Ok(records
            .iter()
            .filter(|(start, end, _)| *end <= extent.end && *start >= extent.start)
            .cloned()
            .collect())
    }
}

impl Cache {
    fn insert(&mut self, key: (String, u64), records: Records, size: u64) {
        if size > self.capacity || self.map.contains_key(&key) {
            return;
        }
        while self.bytes + size > self.capacity {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(r) = self.map.remove(&old) {
                self.bytes -= r.iter().map(|(_, _, b)| b.len() as u64).sum::<u64>();
            }
        }
        self.bytes += records.iter().map(|(_, _, b)| b.len() as u64).sum::<u64>();
        self.order.push_back(key.clone());
        self.map.insert(key, records);
    }
}

/// How many bytes [`encode_chunk`] appends for `records`.
fn chunk_len(records: &[(u64, u64, Bytes)]) -> usize {
    let data: usize = records.iter().map(|(_, _, d)| d.len()).sum();
    4 + 8 + 8 * records.len() + data
}

/// Appends one chunk (a run of consecutive records) to `out`.
fn encode_chunk(out: &mut Vec<u8>, records: &[(u64, u64, Bytes)]) {
    out.extend_from_slice(&(records.len() as u32).to_le_bytes());
    let start = records.first().map_or(0, |r| r.0);
    out.extend_from_slice(&start.to_le_bytes());
    for (_, end, _) in records {
        out.extend_from_slice(&end.to_le_bytes());
    }
    for (_, _, data) in records {
        out.extend_from_slice(data);
    }
}

fn decode_chunk(bytes: &Bytes) -> Option<Vec<(u64, u64, Bytes)>> {
    let u64_at = |at: usize| -> Option<u64> {
        let b = bytes.get(at..at + 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Some(u64::from_le_bytes(a))
    };
    let count = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let mut start = u64_at(4)?;
    let header = 12usize.checked_add(count.checked_mul(8)?)?;
    let mut at = header;
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let end = u64_at(12 + i * 8)?;
        let len = usize::try_from(end.checked_sub(start)?).ok()?;
        let data = bytes.get(at..at.checked_add(len)?)?;
        out.push((start, end, bytes.slice_ref(data)));
        at += len;
        start = end;
    }
    (at == bytes.len()).then_some(out)
}

/// Runs of consecutive hot records in a stream's chunks, as `(first chunk, records)`.
fn hot_runs(chunks: &[Chunk]) -> Vec<Vec<(u64, u64, Bytes)>> {
    let mut runs = Vec::new();
    let mut run: Vec<(u64, u64, Bytes)> = Vec::new();
    for chunk in chunks {
        match chunk {
            Chunk::Hot(r) if run.last().is_none_or(|last| last.1 == r.start) => {
                run.push((r.start, r.end, r.data.clone()));
            }
            Chunk::Hot(r) => {
                runs.push(std::mem::take(&mut run));
                run.push((r.start, r.end, r.data.clone()));
            }
            Chunk::Cold(_) => {
                if !run.is_empty() {
                    runs.push(std::mem::take(&mut run));
                }
            }
        }
    }
    if !run.is_empty() {
        runs.push(run);
    }
    runs
}

/// Replaces the chunks an extent now holds (hot records, and extents of an object being
/// rewritten) with the extent; returns the hot bytes freed.
fn seal(chunks: &mut Vec<Chunk>, extent: &ColdExtent) -> u64 {
    let mut freed = 0;
    let mut out = Vec::with_capacity(chunks.len());
    let mut placed = false;
    for chunk in chunks.drain(..) {
        let inside = match &chunk {
            Chunk::Hot(r) => r.start >= extent.start && r.end <= extent.end,
            Chunk::Cold(c) => c.key != extent.key && c.start >= extent.start && c.end <= extent.end,
        };
        if !inside {
            out.push(chunk);
            continue;
        }
        if let Chunk::Hot(r) = &chunk {
            freed += r.data.len() as u64;
        }
        if !placed {
            out.push(Chunk::Cold(extent.clone()));
            placed = true;
        }
    }
    *chunks = out;
    freed
}

/// A merged extent holds at most this many bytes of stream data: larger extents are never
/// read back to be merged.
const MERGE_MAX_BYTES: u64 = 4 << 20;

/// What one checkpoint reads back to merge extents, at most: the streams past it merge at a
/// later checkpoint.
#[derive(Debug)]
struct MergeBudget {
    bytes: u64,
    reads: usize,
}

impl Default for MergeBudget {
    fn default() -> Self {
        MergeBudget {
            bytes: 64 << 20,
            reads: 256,
        }
    }
}

/// Where the run of sealed extents starts that a checkpoint reads back and seals again with
/// the stream's new records, as one extent (`chunks.len()`: none). Walking back from the
/// new records, an extent joins while it is contiguous with them, holds at most twice what
/// joined so far and keeps the run within [`MERGE_MAX_BYTES`]: so extents grow
/// geometrically, a stream appended at every checkpoint holds a number of small extents
/// logarithmic in its data (not one per checkpoint), and each byte is copied a logarithmic
/// number of times. Reads are charged to `budget`.
fn merge_from(chunks: &[Chunk], budget: &mut MergeBudget) -> usize {
    let mut from = chunks.len();
    let mut joined = 0u64;
    while let Some(Chunk::Hot(r)) = from.checked_sub(1).map(|i| &chunks[i]) {
        joined += r.end - r.start;
        from -= 1;
    }
    if joined == 0 {
        return chunks.len();
    }
    let mut next_start = match chunks.get(from) {
        Some(Chunk::Hot(r)) => r.start,
        _ => return chunks.len(),
    };
    while let Some(Chunk::Cold(e)) = from.checked_sub(1).map(|i| &chunks[i]) {
        let size = e.end.saturating_sub(e.start);
        if e.end != next_start
            || size > joined.saturating_mul(2)
            || joined + size > MERGE_MAX_BYTES
            || budget.reads == 0
            || e.len > budget.bytes
        {
            break;
        }
        budget.reads -= 1;
        budget.bytes -= e.len;
        joined += size;
        next_start = e.start;
        from -= 1;
    }
    // Only sealed extents count: the new records are at the tail.
    while chunks.get(from).is_some_and(|c| matches!(c, Chunk::Hot(_))) {
        from += 1;
    }
    from
}

/// Stream `name`'s entry in a delta as the changes over what the chain holds of it: its
/// extents after those it shares with the chain (the sealed extents in memory, as the last
/// checkpoint left them), and the producers changed since.
fn patch(name: &str, s: &StreamState, extents: Vec<ColdExtent>) -> StreamPatch {
    let stored = s.chunks.iter().filter_map(|c| match c {
        Chunk::Cold(e) => Some(e),
        Chunk::Hot(_) => None,
    });
    let extents_kept = stored
        .zip(&extents)
        .take_while(|(old, new)| old == new)
        .count();
    let mut producers = Vec::new();
    let mut producers_removed = Vec::new();
    for id in &s.changed_producers {
        match s.producers.get(id) {
            Some(state) => producers.push((id.clone(), state.clone())),
            None => producers_removed.push(id.clone()),
        }
    }
    let mut retired = Vec::new();
    let mut retired_removed = Vec::new();
    for key in &s.changed_retired {
        match s.retired.get(key) {
            Some(r) => retired.push((format!("{key:032x}"), r.stored())),
            None => retired_removed.push(format!("{key:032x}")),
        }
    }
    StreamPatch {
        name: name.to_owned(),
        incarnation: s.incarnation.clone(),
        content_type: s.content_type.clone(),
        lifetime: s.lifetime.clone(),
        closed: s.closed,
        closed_by: s.closed_by.clone(),
        stream_seq: s.stream_seq.clone(),
        fork: s.fork.clone(),
        ref_count: s.ref_count,
        soft_deleted: s.soft_deleted,
        tail: s.tail,
        applied_lsn: s.applied_lsn,
        data_lsn: Some(s.data_lsn),
        producers,
        producers_removed,
        retired,
        retired_removed,
        extents: extents.into_iter().skip(extents_kept).collect(),
        extents_kept,
    }
}

/// The chunks to seal: the stream's own, with extents of objects being rewritten and the
/// extents from `merge_from` on read back as records (only extents whose records cover them
/// whole: fork views cut mid-record stay).
async fn with_rewrites(
    cold: &ColdStore,
    chunks: &[Chunk],
    rewrite: &std::collections::HashSet<String>,
    merge_from: usize,
) -> Result<Vec<Chunk>, StreamError> {
    let mut out = Vec::with_capacity(chunks.len());
    for (i, chunk) in chunks.iter().enumerate() {
        match chunk {
            Chunk::Cold(e) if i >= merge_from || rewrite.contains(&e.key) => {
                let records = cold.read_extent(e).await?;
                let whole = records.first().is_some_and(|r| r.0 == e.start)
                    && records.last().is_some_and(|r| r.1 == e.end)
                    && records.windows(2).all(|w| w[0].1 == w[1].0);
                if whole {
                    out.extend(records.into_iter().map(|(start, end, data)| {
                        Chunk::Hot(super::state::HotRecord { start, end, data })
                    }));
                } else {
                    out.push(chunk.clone());
                }
            }
            other => out.push(other.clone()),
        }
    }
    Ok(out)
}

pub(super) async fn checkpoint(streams: &Streams, force: bool) -> Result<bool, StreamError> {
    let inner = &streams.inner;
    let cold = &inner.cold;
    let _one = cold.checkpoint_lock.lock().await;
    let snapshot_lsn = cold.snapshot_lsn.load(Ordering::Acquire);
    // Read the log's tail before the applied position: a stream record at or below the
    // tail has been applied by then.
    let log_tail = inner.log.last_lsn();
    let rewrite = cold.rewrite.lock().map(|r| r.clone()).unwrap_or_default();
    let touched_any = cold.touched.lock().map(|t| !t.is_empty()).unwrap_or(true);
    if inner.applied_lsn.load(Ordering::Acquire) == snapshot_lsn
        && rewrite.is_empty()
        && !touched_any
    {
        // No stream changed since the snapshot: streams need none of the log.
        inner.consumer.release_before(log_tail + 1)?;
        return Ok(false);
    }
    if !force && rewrite.is_empty() {
        let since = cold
            .last_checkpoint
            .lock()
            .map(|t| t.elapsed())
            .unwrap_or_default();
        if streams.hot_bytes() < inner.config.checkpoint_bytes
            && since < inner.config.checkpoint_interval
        {
            return Ok(false);
        }
    }
    let chain = cold.chain.lock().map(|c| *c).unwrap_or_default();
    let full = chain.base == 0
        || !rewrite.is_empty()
        || chain.deltas >= MAX_DELTAS
        || chain.delta_bytes > chain.base_bytes / 2;
    // A consistent cut: no change applies while the registry is write-locked. A delta
    // takes the streams changed since the last checkpoint: applied since, holding records
    // not sealed yet, or touched otherwise.
    let (lsn, captured, removed, touched) = {
        let registry = inner.registry_mut();
        let lsn = inner.applied_lsn.load(Ordering::Acquire);
        let touched = cold
            .touched
            .lock()
            .map(|mut t| std::mem::take(&mut *t))
            .unwrap_or_default();
        // The producers each stream changed are taken with it: what changes from here on
        // goes to the next checkpoint.
        let captured: Vec<(String, Arc<super::Stream>, StreamState)> = registry
            .streams
            .iter()
            .filter_map(|(name, s)| {
                let mut state = s.write_state();
                let changed = full
                    || state.applied_lsn > snapshot_lsn
                    || state.hot_bytes > 0
                    || state.chunks.iter().any(|c| matches!(c, Chunk::Hot(_)))
                    || touched.contains(name);
                if !changed {
                    return None;
                }
                let taken = state.clone();
                state.changed_producers.clear();
                state.changed_retired.clear();
                Some((name.clone(), s.clone(), taken))
            })
            .collect();
        let removed: Vec<String> = touched
            .iter()
            .filter(|name| !registry.streams.contains_key(*name))
            .cloned()
            .collect();
        (lsn, captured, removed, touched)
    };
    let written = write_checkpoint(streams, &rewrite, lsn, &captured, removed, full, chain).await;
    if written.is_err() {
        // Not known to have landed: the next checkpoint holds these changes too, and these
        // streams whole (what the store holds of them is not known).
        if let Ok(mut t) = cold.touched.lock() {
            t.extend(touched);
        }
        for (_, stream, taken) in &captured {
            let mut s = stream.write_state();
            if s.incarnation == taken.incarnation {
                s.stored = false;
            }
        }
        return written;
    }
    if let Ok(mut pending) = cold.rewrite.lock() {
        pending.retain(|k| !rewrite.contains(k));
    }
    if let Ok(mut t) = cold.last_checkpoint.lock() {
        *t = Instant::now();
    }
    inner.consumer.release_before(lsn + 1)?;
    // An older base is superseded by a new one, with its deltas (data objects stay:
    // extents still point into them; garbage collection deletes the deltas).
    if full && chain.base > 0 && chain.base < lsn {
        let _ = cold
            .storage
            .store()
            .delete(&cold.snapshot_path(chain.base))
            .await;
    }
    written
}

/// Seals the captured streams' records and writes their state, as a new base (`full`) or
/// as the next delta of `chain`; then swaps the sealed records for their extents in memory.
async fn write_checkpoint(
    streams: &Streams,
    rewrite: &std::collections::HashSet<String>,
    lsn: Lsn,
    captured: &[(String, Arc<super::Stream>, StreamState)],
    removed: Vec<String>,
    full: bool,
    chain: ChainState,
) -> Result<bool, StreamError> {
    let inner = &streams.inner;
    let cold = &inner.cold;
    let key = paths::new_stream_data_object(&cold.node, lsn);
    let mut sealable = Vec::with_capacity(captured.len());
    let mut merge_budget = MergeBudget::default();
    for (_, _, state) in captured {
        let merge_from = merge_from(&state.chunks, &mut merge_budget);
        sealable.push(with_rewrites(cold, &state.chunks, rewrite, merge_from).await?);
    }
    // Copying tens of MiB is CPU work: off the runtime's threads, into a buffer of the
    // object's size (grown by doubling, it was copied again at every step, each time into
    // fresh pages).
    let runs: Vec<Vec<Vec<(u64, u64, Bytes)>>> =
        sealable.iter().map(|chunks| hot_runs(chunks)).collect();
    let object_key = key.clone();
    let (object, sealed) = tokio::task::spawn_blocking(move || {
        let size = runs.iter().flatten().map(|run| chunk_len(run)).sum();
        let mut object = Vec::with_capacity(size);
        let mut sealed: Vec<Vec<ColdExtent>> = Vec::with_capacity(runs.len());
        for stream_runs in &runs {
            let mut extents = Vec::with_capacity(stream_runs.len());
            for run in stream_runs {
                let pos = object.len() as u64;
                encode_chunk(&mut object, run);
                extents.push(ColdExtent {
                    key: object_key.clone(),
                    pos,
                    len: object.len() as u64 - pos,
                    start: run.first().map_or(0, |r| r.0),
                    end: run.last().map_or(0, |r| r.1),
                });
            }
            sealed.push(extents);
        }
        (object, sealed)
    })
    .await
    .map_err(|e| StreamError::Storage(format!("the checkpoint's encoding stopped: {e}")))?;
    let store = cold.storage.store();
    if !object.is_empty() {
        store
            .put(&Path::from(key.as_str()), PutPayload::from(object))
            .await
            .map_err(storage_error)?;
    }
    let mut states: Vec<SnapshotStream> = Vec::new();
    let mut patches: Vec<StreamPatch> = Vec::new();
    for (((name, _, s), extents), sealable) in captured.iter().zip(&sealed).zip(&sealable) {
        let mut chunks = sealable.clone();
        for extent in extents {
            seal(&mut chunks, extent);
        }
        let extents: Vec<ColdExtent> = chunks
            .into_iter()
            .filter_map(|c| match c {
                Chunk::Cold(e) => Some(e),
                Chunk::Hot(_) => None,
            })
            .collect();
        if !full && s.stored {
            patches.push(patch(name, s, extents));
        } else {
            states.push(SnapshotStream {
                name: name.clone(),
                incarnation: s.incarnation.clone(),
                content_type: s.content_type.clone(),
                lifetime: s.lifetime.clone(),
                closed: s.closed,
                closed_by: s.closed_by.clone(),
                stream_seq: s.stream_seq.clone(),
                producers: s
                    .producers
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                retired: s
                    .retired
                    .iter()
                    .map(|(k, r)| (format!("{k:032x}"), r.stored()))
                    .collect(),
                fork: s.fork.clone(),
                ref_count: s.ref_count,
                soft_deleted: s.soft_deleted,
                tail: s.tail,
                applied_lsn: Some(s.applied_lsn),
                data_lsn: Some(s.data_lsn),
                extents,
            });
        }
    }
    // A fenced node's snapshot would overwrite the new owner's view of these streams.
    inner
        .node
        .ensure_current()
        .await
        .map_err(|e| StreamError::Storage(e.to_string()))?;
    let next_chain = if full {
        let body = serde_json::to_vec(&Snapshot {
            version: 1,
            lsn,
            streams: states,
        })
        .map_err(|e| StreamError::Corrupt(format!("snapshot encoding: {e}")))?;
        let size = body.len() as u64;
        store
            .put(&cold.snapshot_path(lsn), PutPayload::from(body))
            .await
            .map_err(storage_error)?;
        ChainState {
            base: lsn,
            base_bytes: size,
            // A base written again at the same LSN (only objects were rewritten) keeps the
            // numbers its deltas used: they are never reused.
            next_seq: if chain.base == lsn { chain.next_seq } else { 1 },
            deltas: 0,
            delta_bytes: 0,
        }
    } else {
        let mut delta = Delta {
            version: 2,
            base: chain.base,
            seq: chain.next_seq,
            lsn,
            streams: states,
            removed,
            patches,
        };
        let mut next = chain;
        loop {
            let body = serde_json::to_vec(&delta)
                .map_err(|e| StreamError::Corrupt(format!("delta encoding: {e}")))?;
            let size = body.len() as u64;
            let path = Path::from(paths::stream_delta(&cold.node, delta.base, delta.seq));
            let created = store
                .put_opts(
                    &path,
                    PutPayload::from(body),
                    object_store::PutMode::Create.into(),
                )
                .await;
            // Whatever the answer, this number was tried: the next delta takes another.
            next.next_seq = delta.seq + 1;
            if let Ok(mut c) = cold.chain.lock() {
                c.next_seq = next.next_seq;
            }
            match created {
                Ok(_) => {
                    next.deltas += 1;
                    next.delta_bytes += size;
                    break next;
                }
                // An attempt whose answer was lost landed under this number: the next.
                Err(object_store::Error::AlreadyExists { .. })
                    if delta.seq < chain.next_seq + 64 =>
                {
                    delta.seq += 1;
                }
                Err(e) => return Err(storage_error(e)),
            }
        }
    };
    if let Ok(mut c) = cold.chain.lock() {
        *c = next_chain;
    }
    // The state is durable: swap the sealed records (and the extents merged) for their
    // extents in memory.
    for ((name, stream, captured_state), extents) in captured.iter().zip(&sealed) {
        let mut s = stream.write_state();
        if s.incarnation != captured_state.incarnation || s.gone {
            continue;
        }
        s.stored = true;
        if extents.is_empty() {
            continue;
        }
        let before = super::counted(name, &s);
        for extent in extents {
            let freed = seal(&mut s.chunks, extent);
            s.hot_bytes = s.hot_bytes.saturating_sub(freed);
        }
        s.recount_extents();
        inner
            .footprint
            .change(stream.key.as_ref(), before, super::counted(name, &s));
    }
    cold.set_snapshot_lsn(lsn);
    inner.stats.checkpoints.fetch_add(1, Ordering::Relaxed);
    Ok(true)
}

/// Deletes this node's stream objects that nothing references any more (see the module
/// docs).
pub(super) async fn collect_garbage(
    streams: &Streams,
    grace: std::time::Duration,
) -> Result<GcReport, StreamError> {
    let result = collect_garbage_once(streams, grace).await;
    if result.is_err() {
        // What this pass did not look at may have been referenced meanwhile.
        let cold = &streams.inner.cold;
        if let Ok(mut u) = cold.unreferenced.lock() {
            u.forget_scope(&format!("{}/", paths::streams(&cold.node)));
        }
    }
    result
}

async fn collect_garbage_once(
    streams: &Streams,
    grace: std::time::Duration,
) -> Result<GcReport, StreamError> {
    let inner = &streams.inner;
    let cold = &inner.cold;
    let _one = cold.checkpoint_lock.lock().await;
    // Every sealed extent a stream points into: (object, position, length).
    let extents: Vec<(String, u64, u64)> = {
        let registry = inner.registry();
        registry
            .streams
            .values()
            .flat_map(|s| {
                s.read_state()
                    .chunks
                    .iter()
                    .filter_map(|c| match c {
                        Chunk::Cold(e) => Some((e.key.clone(), e.pos, e.len)),
                        Chunk::Hot(_) => None,
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let mut referenced: std::collections::HashSet<&str> =
        extents.iter().map(|(k, _, _)| k.as_str()).collect();
    let base = cold.chain.lock().map(|c| c.base).unwrap_or_default();
    let latest = cold.snapshot_path(base).to_string();
    let store = cold.storage.store();
    let listed: Vec<object_store::ObjectMeta> = store
        .list(Some(&Path::from(paths::streams(&cold.node))))
        .try_collect()
        .await
        .map_err(storage_error)?;
    let data_dir = format!("{}/", paths::stream_data(&cold.node));
    let snapshot_dir = format!("{}/", paths::stream_snapshots(&cold.node));
    let delta_dir = format!("{}/", paths::stream_deltas(&cold.node));
    // The newest base in the store with its deltas is what a restart loads: what it points
    // into stays, even if this node's memory moved on (a snapshot or delta that landed
    // although its write answered with an error).
    let (stored_keys, newest_base) = match cold.read_chain(&cold.node).await {
        Ok(Some((snapshot, chain))) => (
            snapshot
                .streams
                .into_iter()
                .flat_map(|s| s.extents.into_iter().map(|e| e.key))
                .collect::<Vec<String>>(),
            chain.base,
        ),
        Ok(None) => (Vec::new(), 0),
        // A base deleted between its listing and its read fails this pass; the next looks
        // again.
        Err(e) => return Err(e),
    };
    let newest_name = cold.snapshot_path(newest_base).to_string();
    // Deltas over the bases kept stay; those over superseded bases go.
    let live_delta = |key: &str| {
        [base, newest_base]
            .iter()
            .any(|b| key.starts_with(&format!("{delta_dir}{b:020}-")))
    };
    referenced.extend(stored_keys.iter().map(String::as_str));
    let sizes: HashMap<String, u64> = listed
        .iter()
        .map(|m| (m.location.to_string(), m.size))
        .collect();
    let candidates: Vec<&str> = sizes
        .keys()
        .map(String::as_str)
        .filter(|k| {
            (k.starts_with(&data_dir) && !referenced.contains(k))
                || (k.starts_with(&snapshot_dir) && *k != latest && *k != newest_name)
                || (k.starts_with(&delta_dir) && !live_delta(k))
        })
        .collect();
    // Objects whose live extents hold less than half their bytes are copied out of by the
    // next checkpoint, after which they are unreferenced.
    let mut live: HashMap<&str, u64> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for (key, pos, len) in &extents {
        if seen.insert((key.as_str(), *pos)) {
            *live.entry(key.as_str()).or_default() += len;
        }
    }
    if let Ok(mut pending) = cold.rewrite.lock() {
        for (key, bytes) in &live {
            if sizes.get(*key).is_some_and(|size| bytes * 2 < *size) {
                pending.insert((*key).to_owned());
            }
        }
    }
    let scope = format!("{}/", paths::streams(&cold.node));
    let due = cold
        .unreferenced
        .lock()
        .map(|mut u| u.due(&scope, candidates, grace))
        .unwrap_or_default();
    let mut report = GcReport::default();
    for key in due {
        match store.delete(&Path::from(key.as_str())).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                report.objects += 1;
                report.bytes += sizes.get(&key).copied().unwrap_or(0);
                if let Ok(mut u) = cold.unreferenced.lock() {
                    u.forget(&key);
                }
            }
            Err(e) => tracing::debug!(%key, error = %e, "garbage collection: delete failed"),
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::state::HotRecord;

    fn extent(key: &str, start: u64, end: u64) -> ColdExtent {
        ColdExtent {
            key: key.into(),
            pos: 0,
            len: 12 + 8 + (end - start),
            start,
            end,
        }
    }

    fn hot(start: u64, end: u64) -> Chunk {
        Chunk::Hot(HotRecord {
            start,
            end,
            data: Bytes::from(vec![b'x'; (end - start) as usize]),
        })
    }

    /// What a checkpoint leaves of `chunks` when it merges from `from`: the extents before,
    /// then one extent holding the rest.
    fn sealed(chunks: &[Chunk], from: usize, key: &str) -> Vec<Chunk> {
        let first_hot = chunks
            .iter()
            .position(|c| matches!(c, Chunk::Hot(_)))
            .unwrap_or(chunks.len());
        let from = from.min(first_hot);
        let mut out: Vec<Chunk> = chunks[..from].to_vec();
        let start = match &chunks[from] {
            Chunk::Cold(e) => e.start,
            Chunk::Hot(r) => r.start,
        };
        let end = chunks.last().map_or(start, Chunk::end);
        out.push(Chunk::Cold(extent(key, start, end)));
        out
    }

    /// A stream appended one byte before each of 10,000 checkpoints holds a logarithmic
    /// number of extents (one per checkpoint without merging), and each byte is copied a
    /// logarithmic number of times; big extents are never read back, and a checkpoint's
    /// reads stop at its budget.
    #[test]
    fn extents_merge_geometrically() {
        let mut chunks: Vec<Chunk> = Vec::new();
        let mut copied = 0u64;
        let mut most = 0;
        for i in 0..10_000u64 {
            chunks.push(hot(i, i + 1));
            let from = merge_from(&chunks, &mut MergeBudget::default());
            copied += chunks[from..]
                .iter()
                .map(|c| match c {
                    Chunk::Cold(e) => e.end - e.start,
                    Chunk::Hot(_) => 0,
                })
                .sum::<u64>();
            chunks = sealed(&chunks, from, &format!("o{i}"));
            most = most.max(chunks.len());
            // Contiguous, whole.
            assert!(chunks.windows(2).all(|w| match (&w[0], &w[1]) {
                (Chunk::Cold(a), Chunk::Cold(b)) => a.end == b.start,
                _ => false,
            }));
        }
        assert_eq!(chunks.last().map(Chunk::end), Some(10_000));
        println!(
            "{} extents, at most {most}, {copied} bytes copied",
            chunks.len()
        );
        assert!(most <= 30, "{most} extents");
        assert!(copied <= 10_000 * 20, "{copied} bytes copied");
        // A run of big extents stays: a new record is sealed on its own.
        let big = MERGE_MAX_BYTES;
        let chunks = vec![
            Chunk::Cold(extent("a", 0, big)),
            Chunk::Cold(extent("b", big, 2 * big)),
            hot(2 * big, 2 * big + 1),
        ];
        assert_eq!(merge_from(&chunks, &mut MergeBudget::default()), 3);
        // Nothing new: nothing merged.
        let chunks = vec![
            Chunk::Cold(extent("a", 0, 1)),
            Chunk::Cold(extent("b", 1, 2)),
        ];
        assert_eq!(merge_from(&chunks, &mut MergeBudget::default()), 2);
        // Not contiguous (a fork's view cut short): not merged.
        let chunks = vec![Chunk::Cold(extent("a", 0, 1)), hot(2, 3)];
        assert_eq!(merge_from(&chunks, &mut MergeBudget::default()), 2);
        // The budget: one read left, one extent joins.
        let chunks = vec![
            Chunk::Cold(extent("a", 0, 1)),
            Chunk::Cold(extent("b", 1, 2)),
            hot(2, 4),
        ];
        let mut budget = MergeBudget {
            bytes: 1 << 20,
            reads: 1,
        };
        assert_eq!(merge_from(&chunks, &mut budget), 1);
        assert_eq!(budget.reads, 0);
        assert_eq!(merge_from(&chunks, &mut budget), 3);
    }

    fn stream(name: &str, producers: usize) -> StreamState {
        let mut s = StreamState::new(
            format!("inc-{name}"),
            "text/plain".into(),
            Lifetime::default(),
            None,
            1,
        );
        for i in 0..producers {
            let p = ProducerTuple {
                id: format!("p{i}"),
                epoch: 0,
                seq: 0,
            };
            s.apply_append(
                2 + i as u64,
                Some(Bytes::from_static(b"a")),
                false,
                Some(p),
                None,
            );
        }
        s
    }

    /// A stream's whole entry as a snapshot holds it (producers and retired sorted, to
    /// compare).
    fn whole(name: &str, s: &StreamState, extents: Vec<ColdExtent>) -> serde_json::Value {
        let mut producers: Vec<(String, ProducerState)> = s
            .producers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        producers.sort_by(|a, b| a.0.cmp(&b.0));
        let mut retired: Vec<(String, Retired)> = s
            .retired
            .iter()
            .map(|(k, r)| (format!("{k:032x}"), r.stored()))
            .collect();
        retired.sort_by(|a, b| a.0.cmp(&b.0));
        let entry = SnapshotStream {
            name: name.into(),
            incarnation: s.incarnation.clone(),
            content_type: s.content_type.clone(),
            lifetime: s.lifetime.clone(),
            closed: s.closed,
            closed_by: s.closed_by.clone(),
            stream_seq: s.stream_seq.clone(),
            producers,
            retired,
            fork: s.fork.clone(),
            ref_count: s.ref_count,
            soft_deleted: s.soft_deleted,
            tail: s.tail,
            extents,
            applied_lsn: Some(s.applied_lsn),
            data_lsn: Some(s.data_lsn),
        };
        serde_json::to_value(&entry).unwrap()
    }

    fn sorted(mut s: SnapshotStream) -> serde_json::Value {
        s.producers.sort_by(|a, b| a.0.cmp(&b.0));
        s.retired.sort_by(|a, b| a.0.cmp(&b.0));
        serde_json::to_value(&s).unwrap()
    }

    /// A patch holds only the producers and extents that changed, and applied over the
    /// stored entry gives the stream's whole entry: producers added, appended again,
    /// expired (retired) and back from retirement; extents appended and a run merged.
    #[test]
    fn a_patch_holds_what_changed_and_applies_to_the_whole_state() {
        let mut s = stream("s", 2000);
        let stored = vec![extent("o1", 0, 1000), extent("o2", 1000, 2000)];
        s.chunks = stored.iter().cloned().map(Chunk::Cold).collect();
        s.changed_producers.clear();
        let mut chain: HashMap<String, SnapshotStream> = HashMap::new();
        chain.insert(
            "s".into(),
            serde_json::from_value(whole("s", &s, stored.clone())).unwrap(),
        );
        // Changes: p1 appends, p2 expires, a new producer, one byte of data.
        let p1 = ProducerTuple {
            id: "p1".into(),
            epoch: 0,
            seq: 1,
        };
        s.apply_append(9000, Some(Bytes::from_static(b"b")), false, Some(p1), None);
        if let Some(p) = s.producers.get_mut("p2") {
            p.last_ms = 1;
        }
        assert_eq!(s.expire_producers(2, 3, 100), 1);
        let fresh = ProducerTuple {
            id: "fresh".into(),
            epoch: 0,
            seq: 0,
        };
        s.apply_append(9001, None, false, Some(fresh), None);
        // The checkpoint merged o2 with the new byte into o3.
        let extents = vec![extent("o1", 0, 1000), extent("o3", 1000, 2001)];
        let p = patch("s", &s, extents.clone());
        assert_eq!(p.extents_kept, 1);
        assert_eq!(p.extents, vec![extent("o3", 1000, 2001)]);
        assert_eq!(p.producers.len(), 2);
        assert_eq!(p.producers_removed, vec!["p2".to_owned()]);
        assert_eq!(p.retired.len(), 1);
        let delta = Delta {
            version: 2,
            base: 1,
            seq: 1,
            lsn: 9001,
            streams: Vec::new(),
            removed: Vec::new(),
            patches: vec![p],
        };
        let body = serde_json::to_vec(&delta).unwrap();
        assert!(body.len() < 4096, "a patch of {} bytes", body.len());
        let delta: Delta = serde_json::from_slice(&body).unwrap();
        apply_delta(&mut chain, delta).unwrap();
        assert_eq!(sorted(chain.remove("s").unwrap()), whole("s", &s, extents));
        // The retired producer comes back: its retired record goes in the next patch.
        s.changed_producers.clear();
        s.changed_retired.clear();
        let back = ProducerTuple {
            id: "p2".into(),
            epoch: 0,
            seq: 1,
        };
        s.apply_append(9002, None, false, Some(back), None);
        let p = patch("s", &s, Vec::new());
        assert_eq!(p.retired_removed.len(), 1);
        assert_eq!(p.producers.len(), 1);
    }

    /// A patch of a stream the chain does not hold (or holds another incarnation of) is
    /// refused, never applied to the wrong state.
    #[test]
    fn a_patch_of_another_incarnation_is_corrupt() {
        let s = stream("s", 1);
        let mut chain: HashMap<String, SnapshotStream> = HashMap::new();
        let mut other = whole("s", &s, Vec::new());
        other["incarnation"] = "older".into();
        chain.insert("s".into(), serde_json::from_value(other).unwrap());
        let delta = Delta {
            version: 2,
            base: 1,
            seq: 1,
            lsn: 3,
            streams: Vec::new(),
            removed: Vec::new(),
            patches: vec![patch("s", &s, Vec::new())],
        };
        assert!(matches!(
            apply_delta(&mut chain, delta),
            Err(StreamError::Corrupt(_))
        ));
    }

    /// A delta as version 1 wrote it (whole streams only; no `patches`) still loads.
    #[test]
    fn a_version_1_delta_loads() {
        let v1 = r#"{"version":1,"base":10,"seq":3,"lsn":42,
            "streams":[{"name":"a","incarnation":"i1","content_type":"text/plain",
              "lifetime":{"ttl_secs":null,"expires_at":null,"expires_at_ms":null},
              "closed":true,"closed_by":null,"stream_seq":"7",
              "producers":[["p",{"epoch":1,"last_seq":4,"receipts":[[4,9]],"last_ms":5}]],
              "retired":[["0000000000000000000000000000abcd",{"epoch":0,"last_seq":2,"at_ms":6}]],
              "fork":null,"ref_count":0,"soft_deleted":false,"tail":9,
              "extents":[{"key":"streams/n/data/00000000000000000040.bin","pos":0,"len":29,
                "start":0,"end":9}],"applied_lsn":41}],
            "removed":["gone"]}"#;
        let delta: Delta = serde_json::from_str(v1).unwrap();
        assert!(delta.patches.is_empty());
        let mut chain: HashMap<String, SnapshotStream> = HashMap::new();
        let gone = stream("gone", 0);
        chain.insert(
            "gone".into(),
            serde_json::from_value(whole("gone", &gone, Vec::new())).unwrap(),
        );
        apply_delta(&mut chain, delta).unwrap();
        assert!(!chain.contains_key("gone"));
        let a = &chain["a"];
        assert!(a.closed);
        assert_eq!(a.producers[0].1.last_seq, 4);
        assert_eq!(a.retired.len(), 1);
        assert_eq!(a.extents[0].end, 9);
        assert_eq!(a.applied_lsn, Some(41));
    }

    #[test]
    fn chunks_round_trip() {
        let records = vec![
            (5, 8, Bytes::from_static(b"abc")),
            (8, 9, Bytes::from_static(b"d")),
        ];
        let mut out = Vec::new();
        encode_chunk(&mut out, &records);
        assert_eq!(out.len(), chunk_len(&records));
        let bytes = Bytes::from(out);
        assert_eq!(decode_chunk(&bytes).unwrap(), records);
        for cut in 0..bytes.len() {
            assert!(decode_chunk(&bytes.slice(..cut)).is_none());
        }
    }
}
