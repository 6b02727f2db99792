//! Durable append-only streams (the Durable Streams protocol) on the shared commit log.
//!
//! Every change to a stream is one commit-log record ([`codec::Op`]); it is applied to the
//! in-memory state on the log's writer thread once the `fsync` covering it is done, and only
//! then acknowledged. Producer state and `Stream-Seq` ride in the same record as the data they
//! admit, so they commit atomically with it. Appends to one stream are admitted one at a time
//! (each stream has its own admission lock), but the lock is not held while a record waits
//! for its sync: the next append is admitted against what the appends in flight will leave
//! (`admit::Pending`), and its record is chained to theirs (`log::Chain`), so the
//! log writes it only if it wrote them. Many appends to one stream thus share a group
//! commit, as appends to different streams do. An answer or refusal that the appends in
//! flight would decide (a producer's duplicate, a closed stream) waits until they are
//! durable and is decided on the applied state.
//!
//! Readers look at the applied state only and never take the admission lock; long-poll and
//! SSE readers wait on a per-stream version counter that each apply bumps.
//!
//! Each apply that adds data also notes the stream's name in the engine's change set, before
//! the engine's applied LSN moves past it, and every stream keeps the LSN of its last change
//! (in snapshots too): subscriptions take the set ([`Streams::take_changes`]) and never miss
//! a change. The set is bounded; past the bound it records only that it overflowed, and the
//! reader rescans by LSN ([`Streams::changed_since`]), as it does after a restart.
//!
//! Data lives in memory ("hot") until a checkpoint (`cold`) seals it into objects on
//! object storage ("cold") and writes the state of the streams that changed (a delta over
//! the last full snapshot, or a new full snapshot); the log is then released up to it.
//! Reads stitch cold and hot data transparently. On open, the newest snapshot and its
//! deltas are loaded and the log records after them are replayed.
//!
//! Memory is bounded in bytes as well as counts: every stream's state (its strings,
//! producer entries and sealed extents, estimated as [`state::StreamState::footprint`])
//! counts against [`StreamsConfig::max_state_bytes`], producers also against
//! [`StreamsConfig::max_producer_bytes`]; the counts change only where changes apply (and
//! where producers expire, and where a checkpoint seals or merges extents), so replay
//! counts as live does. Producers idle longer than
//! [`StreamsConfig::producer_expiry`] are retired: only their last epoch and sequence stay
//! (a small record counted in the stream state), so their old appends are still
//! recognized.
//!
//! Each API key holds at most half of either budget ([`Footprint`]): a stream's own state
//! counts against the key that created it, a producer entry against the key whose append
//! created it or last kept it going, and a retired producer's record
//! ([`state::RETIRED_ENTRY_BYTES`]) against the key its entry counted against, until the
//! producer comes back, the record is evicted (past the cap per stream, or by that key to
//! make room for a producer it adds or takes over on the stream, once the append is
//! admitted otherwise) or the stream goes. Keys are held
//! in memory only: what a restart replays or loads counts against no key.
//!
//! The module's seams: `api` (requests, answers, errors), `admit` (what an append does to a
//! stream, a pure function of its state), `state` (one stream's state and how each committed
//! change applies to it, live or in replay), `codec` (the log records), `cold` (checkpoints,
//! sealed objects, garbage collection), `json` (JSON message text); this file holds the engine
//! that ties them to the log. Wire forms (offsets as text, headers) are `http/`'s.

mod admit;
mod api;
pub(crate) mod codec;
mod cold;
pub mod json;
mod state;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::watch;

pub use api::{
    AppendOutcome, AppendRequest, CreateRequest, ForkRequest, ListRequest, MAX_APPEND_BYTES,
    MAX_PRODUCER_NUMBER, MAX_TOKEN_BYTES, ProducerSummary, ReadResult, StreamError, StreamInfo,
    StreamSummary, format_offset,
};
pub(crate) use api::{keep_within_producers, merge_listings, parse_offset};
pub use codec::{ForkSpec, Lifetime, Op, ProducerTuple};
use cold::ColdStore;
pub(crate) use json::JsonTextError;
use state::{Chunk, KeyRelease, StreamState};

use crate::log::{Chain, CommitLog, LogConsumer, Lsn, Record, RecordKind};
use crate::node::Node;
use crate::storage::Storage;

/// What another node's snapshot says to a read of one of its streams
/// ([`Streams::read_sealed`]).
#[derive(Debug)]
pub(crate) enum SealedRead {
    /// Its answer.
    Read(ReadResult),
    /// It holds none of the stream's data from this offset on: the owner answers.
    Reach(u64),
}

/// Settings of the stream engine.
#[derive(Debug, Clone)]
pub struct StreamsConfig {
    /// Streams beyond this many are refused with [`StreamError::TooManyStreams`].
    pub max_streams: usize,
    /// Producers per stream beyond this many are refused.
    pub max_producers_per_stream: usize,
    /// Bytes all streams' state may hold (strings, producers; not their data), estimated;
    /// a create past it is refused with [`StreamError::StateFull`].
    pub max_state_bytes: u64,
    /// Bytes all streams' producer entries may hold, estimated; a new producer past it is
    /// refused with [`StreamError::StateFull`].
    pub max_producer_bytes: u64,
    /// A producer with no append for this long is forgotten (and treated as new if it comes
    /// back, as the protocol allows).
    pub producer_expiry: Duration,
    /// A checkpoint runs once this many bytes are held in memory...
    pub checkpoint_bytes: u64,
    /// ...or this long after the last one, if anything changed.
    pub checkpoint_interval: Duration,
    /// Bytes of cold data kept in the read cache.
    pub cache_bytes: u64,
    /// Names of streams that received data held for subscriptions ([`Streams::take_changes`])
    /// before the engine stops recording names and tells its reader to rescan instead.
    pub max_pending_changes: usize,
}

impl Default for StreamsConfig {
    fn default() -> Self {
        StreamsConfig {
            max_streams: 1_000_000,
            max_producers_per_stream: 10_000,
            max_state_bytes: 1 << 30,
            max_producer_bytes: 256 << 20,
            producer_expiry: Duration::from_secs(24 * 3600),
            checkpoint_bytes: 64 << 20,
            checkpoint_interval: Duration::from_secs(10),
            cache_bytes: 64 << 20,
            max_pending_changes: 100_000,
        }
    }
}

/// One stream's handle.
#[derive(Debug)]
pub struct Stream {
    name: String,
    /// The API key that created it (in this process): its own state counts against that
    /// key's share ([`Footprint`]).
    key: Option<Arc<str>>,
    state: RwLock<StreamState>,
    /// Admission lock: one append (or delete) decided at a time, against the applied state
    /// and what the appends in flight leave.
    admit: tokio::sync::Mutex<Pipeline>,
    /// Appends submitted to the log and not yet answered.
    in_flight: AtomicUsize,
    /// Told when `in_flight` falls to zero.
    drained: tokio::sync::Notify,
    /// Bumped by every apply; readers wait on it.
    version: watch::Sender<u64>,
    /// When it was last read or written (for sliding TTLs), in ms since the epoch.
    last_access_ms: AtomicI64,
}

impl Stream {
    fn new(name: String, state: StreamState, key: Option<Arc<str>>) -> Arc<Stream> {
        Arc::new(Stream {
            name,
            key,
            state: RwLock::new(state),
            admit: tokio::sync::Mutex::new(Pipeline::default()),
            in_flight: AtomicUsize::new(0),
            drained: tokio::sync::Notify::new(),
            version: watch::channel(0).0,
            last_access_ms: AtomicI64::new(now_ms()),
        })
    }

    /// Waits until no append is in flight. The caller holds the admission lock, so none
    /// starts meanwhile.
    async fn drain(&self) {
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.in_flight.load(Ordering::Acquire) == 0 {
                return;
            }
            drained.await;
        }
    }

    /// Counts an append answered; the last one in flight wakes [`Stream::drain`].
    fn landed(&self) {
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.drained.notify_waiters();
        }
    }

    fn read_state(&self) -> std::sync::RwLockReadGuard<'_, StreamState> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_state(&self) -> std::sync::RwLockWriteGuard<'_, StreamState> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// The stream's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// A receiver that changes whenever the stream does (data, close, delete).
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Metadata.
    pub fn info(&self) -> StreamInfo {
        let s = self.read_state();
        StreamInfo {
            content_type: s.content_type.clone(),
            tail: s.tail,
            closed: s.closed,
            incarnation: s.incarnation.clone(),
            lifetime: s.lifetime.clone(),
        }
    }

    /// Whether the stream was deleted (or soft-deleted) since this handle was taken.
    pub(crate) fn info_gone(&self) -> bool {
        let s = self.read_state();
        s.gone || s.soft_deleted
    }

    /// Renews a sliding TTL.
    pub(crate) fn touch(&self) {
        self.last_access_ms.store(now_ms(), Ordering::Relaxed);
    }

    fn expired(&self, now: i64) -> bool {
        let s = self.read_state();
        if let Some(at) = s.lifetime.expires_at_ms
            && now >= at
        {
            return true;
        }
        if let Some(ttl) = s.lifetime.ttl_secs {
            let last = self.last_access_ms.load(Ordering::Relaxed);
            let window = i64::try_from(ttl.saturating_mul(1000)).unwrap_or(i64::MAX);
            if now >= last.saturating_add(window) {
                return true;
            }
        }
        false
    }
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The clock producer idleness is judged on (ms): the wall clock when the process started,
/// advanced by a monotonic clock since, so a wall-clock jump while it runs neither expires
/// producers early nor keeps them forever. Across a restart it is as good as the wall
/// clock; expiry only retires a producer ([`state::Retired`]), so an early one changes no
/// answer but a duplicate's offset.
pub(crate) fn producer_clock_ms() -> i64 {
    static START: std::sync::OnceLock<(std::time::Instant, i64)> = std::sync::OnceLock::new();
    let (at, wall) = START.get_or_init(|| (std::time::Instant::now(), now_ms()));
    wall.saturating_add(i64::try_from(at.elapsed().as_millis()).unwrap_or(i64::MAX))
}

/// The length of a [`new_incarnation`] (a UUID's 32 hex digits), counted in a stream's state.
const INCARNATION_BYTES: u64 = 32;

pub(crate) fn new_incarnation() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

struct Registry {
    streams: HashMap<String, Arc<Stream>>,
}

/// What all streams' state counts against the stream-state and producer budgets; changed
/// only where a change applies (and by producer expiry and checkpoints), so replay counts
/// as live does.
///
/// Each API key may hold at most half of either budget ([`KEY_SHARE`]), so one key cannot
/// take the room other keys' streams and producers need: a stream's own state (everything
/// but its producer entries and retired producer records) counts against the key that
/// created it; a producer entry against the key whose append created it or last kept it
/// going (an append of another key takes the entry over, admitted against that key's
/// shares); a retired producer's record against the key its entry counted against, until
/// the record goes. What was replayed or loaded counts against no key (keys are not
/// stored), only against the budgets.
#[derive(Debug, Default)]
struct Footprint {
    /// [`StreamState::footprint`] of every stream, producers included.
    state_bytes: AtomicU64,
    /// [`StreamState::producer_bytes`] of every stream.
    producer_bytes: AtomicU64,
    /// What each key's streams, producer entries and retired producer records count (keys
    /// are the configured keys' names, never client input, so the map is as small as the
    /// configuration).
    keys: Mutex<HashMap<Arc<str>, KeyUse>>,
}

/// What one key's share of the budgets holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct KeyUse {
    /// Counted against `max_state_bytes`: its streams' own state, its producer entries and
    /// its retired producers' records.
    state: u64,
    /// Counted against `max_producer_bytes`: its producer entries.
    producers: u64,
}

/// The share of each budget one key may hold: a half, as for request bodies.
const KEY_SHARE: u64 = 2;

/// How often the maintenance loop sweeps every stream for idle producers.
const MAINTENANCE_SWEEP: Duration = Duration::from_secs(60);

/// How often creates refused by a full server may sweep every stream for idle producers.
const FULL_SWEEP: Duration = Duration::from_secs(1);

/// A byte budget as a request finds it: the server's and, for a request of a key, the key's
/// share of it.
struct Room {
    server: admit::Budget,
    key: Option<admit::Budget>,
}

impl Room {
    /// Whether `adds` bytes fit: the key's share is checked first (a key past its share is
    /// refused as its own excess, not as the server's).
    fn check(&self, adds: u64) -> Result<(), StreamError> {
        if let Some(share) = &self.key {
            share.check(adds)?;
        }
        self.server.check(adds)
    }
}

impl Footprint {
    /// Counts a change of one stream, created by `key`, from `before` to `after`
    /// ([`counted`], zeros for none). Producer entries and retired producer records count
    /// against the keys whose appends created them ([`Footprint::producer_added`],
    /// [`Footprint::release`]), not the stream's creator.
    fn change(&self, key: Option<&Arc<str>>, before: Counted, after: Counted) {
        adjust(&self.state_bytes, before.footprint, after.footprint);
        adjust(&self.producer_bytes, before.producers, after.producers);
        if let Some(key) = key {
            let own_before = before.own();
            let own_after = after.own();
            if own_before != own_after {
                self.key_use(key, |u| {
                    u.state = (u.state + own_after).saturating_sub(own_before);
                });
            }
        }
    }

    /// Counts a producer entry of `cost` that `key`'s append created.
    fn producer_added(&self, key: &Arc<str>, cost: u64) {
        self.key_use(key, |u| {
            u.state += cost;
            u.producers += cost;
        });
    }

    /// Stops counting (some of) producer entries and retired producer records that keys'
    /// appends created. A key is never released more than it holds (logged as an error if
    /// it were: the counts would have drifted from what the streams hold; never a panic, on
    /// the log writer's thread).
    fn release(&self, released: &[KeyRelease]) {
        for r in released {
            self.key_use(&r.key, |u| {
                if u.state < r.state || u.producers < r.producers {
                    tracing::error!(key = %r.key, held = ?u, released = ?r, "a key's stream-state count drifted below what it releases");
                }
                u.state = u.state.saturating_sub(r.state);
                u.producers = u.producers.saturating_sub(r.producers);
            });
        }
    }

    fn key_use(&self, key: &Arc<str>, change: impl FnOnce(&mut KeyUse)) {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let entry = keys.entry(key.clone()).or_default();
        change(entry);
        if *entry == KeyUse::default() {
            keys.remove(key);
        }
    }

    /// What `key` holds now.
    fn held_by(&self, key: &str) -> KeyUse {
        let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.get(key).copied().unwrap_or_default()
    }
}

fn adjust(counter: &AtomicU64, before: u64, after: u64) {
    if after >= before {
        counter.fetch_add(after - before, Ordering::Relaxed);
    } else {
        let less = before - after;
        let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_sub(less))
        });
    }
}

/// What a stream counts against the budgets.
#[derive(Debug, Default, Clone, Copy)]
struct Counted {
    /// [`StreamState::footprint`].
    footprint: u64,
    /// [`StreamState::producer_bytes`].
    producers: u64,
    /// [`StreamState::retired_bytes`].
    retired: u64,
}

impl Counted {
    /// What counts against the stream's creator: all but its producers and retired
    /// producers.
    fn own(&self) -> u64 {
        self.footprint
            .saturating_sub(self.producers)
            .saturating_sub(self.retired)
    }
}

/// What stream `name` counts now.
fn counted(name: &str, s: &StreamState) -> Counted {
    Counted {
        footprint: s.footprint(name),
        producers: s.producer_bytes,
        retired: s.retired_bytes(),
    }
}

/// Work counters of the stream engine (for metrics).
#[derive(Debug, Default)]
pub(crate) struct StreamStats {
    /// Appends committed that carried data.
    pub appends: AtomicU64,
    /// Their bytes, as stored.
    pub append_bytes: AtomicU64,
    /// Checkpoints that wrote a snapshot.
    pub checkpoints: AtomicU64,
    /// Sweeps of every stream for idle producers.
    pub producer_sweeps: AtomicU64,
}

struct Inner {
    stats: StreamStats,
    /// Names of streams that received data since the last [`Streams::take_changes`].
    changes: std::sync::Mutex<ChangeSet>,
    log: CommitLog,
    consumer: LogConsumer,
    config: StreamsConfig,
    registry: RwLock<Registry>,
    /// The LSN of the last stream change applied.
    applied_lsn: AtomicU64,
    /// Creates and deletes, one at a time.
    meta: tokio::sync::Mutex<()>,
    cold: ColdStore,
    closing: watch::Sender<bool>,
    /// This node's ownership of its id, checked before every snapshot.
    node: Arc<Node>,
    /// What the streams' state counts against its budgets.
    footprint: Footprint,
    /// When producers were last swept for expiry.
    last_expiry: std::sync::Mutex<std::time::Instant>,
    /// After the last sweep, the producer clock (ms) before which no producer it left can
    /// be idle past the expiry: a refused create does not sweep again before then.
    next_expiry_ms: AtomicI64,
}

/// What admission decided for an append.
// Made once per append and taken apart at once: boxing the commit would only add an
// allocation to every append.
#[allow(clippy::large_enum_variant)]
enum Admitted {
    /// Commit `op` (encoded as `payload`); once it is durable, the stream ends at `next`
    /// and is `closed` or not.
    Commit {
        op: Op,
        payload: Vec<u8>,
        /// Bytes it stores.
        stored: u64,
        next: u64,
        closed: bool,
        incarnation: String,
    },
    /// Answer without writing.
    Answer(AppendOutcome),
}

/// A stream's appends in flight, as admission sees them (held under its admission lock).
#[derive(Debug, Default)]
struct Pipeline {
    /// The log chain the records in flight are on.
    chain: Arc<Chain>,
    /// What they leave; `None` when the applied state is all there is.
    pending: Option<admit::Pending>,
}

impl Pipeline {
    /// Forgets what is in flight when it no longer matters: when nothing is (the applied
    /// state holds it all), or when a record of the chain failed (the log writes none of the
    /// later ones, so the applied state is all there will be; later records go on a new
    /// chain).
    fn settle(&mut self, in_flight: usize) {
        if self.chain.is_broken() {
            self.chain = Arc::new(Chain::default());
            self.pending = None;
        } else if in_flight == 0 {
            self.pending = None;
        }
    }
}

/// The stream engine. Cheap to clone.
#[derive(Clone)]
pub struct Streams {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams")
            .field("config", &self.inner.config)
            .finish()
    }
}

/// The names of streams that received data since a reader last took them
/// ([`Streams::take_changes`]), at most [`StreamsConfig::max_pending_changes`] of them.
#[derive(Debug, Default)]
struct ChangeSet {
    names: std::collections::HashSet<String>,
    /// More streams changed than the set may hold: the names were dropped, and the reader
    /// rescans by LSN ([`Streams::changed_since`]).
    overflowed: bool,
}

/// Where a stream stands, for subscriptions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StreamMark {
    pub(crate) tail: u64,
    pub(crate) incarnation: String,
    /// The LSN of its last data change (closes and producer-only appends leave it).
    pub(crate) changed_lsn: Lsn,
}

impl StreamMark {
    fn of(s: &StreamState) -> Option<StreamMark> {
        (!s.gone && !s.soft_deleted).then(|| StreamMark {
            tail: s.tail,
            incarnation: s.incarnation.clone(),
            changed_lsn: s.data_lsn,
        })
    }
}

/// What changed in an engine since the last [`Streams::take_changes`].
#[derive(Debug)]
pub(crate) struct ChangeBatch {
    /// Every change up to this LSN is covered: named here, or (after an overflow) found by
    /// [`Streams::changed_since`].
    pub(crate) upto: Lsn,
    /// The streams that received data; `None` when there were too many to hold, and the
    /// reader must rescan what changed since the batch before.
    pub(crate) names: Option<Vec<String>>,
}

impl Inner {
    /// Runs `shed` on `stream`'s state `s` (producers retired, retired records dropped) and
    /// counts what it frees: in the budgets, in the creator's share, and in the shares of
    /// the keys it adds to its release list. Returns what `shed` returns (how many went).
    fn shed(
        &self,
        stream: &Stream,
        s: &mut StreamState,
        shed: impl FnOnce(&mut StreamState, &mut Vec<KeyRelease>) -> usize,
    ) -> usize {
        let was = counted(&stream.name, s);
        let mut released = Vec::new();
        let gone = shed(s, &mut released);
        self.footprint
            .change(stream.key.as_ref(), was, counted(&stream.name, s));
        self.footprint.release(&released);
        if gone > 0 {
            self.cold.touch(&stream.name);
        }
        gone
    }

    /// Records that stream `name` received data. Runs in `apply`, before `applied_lsn`
    /// moves past the change.
    fn note_change(&self, name: &str) {
        let mut set = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        if set.overflowed || set.names.contains(name) {
            return;
        }
        if set.names.len() >= self.config.max_pending_changes {
            set.overflowed = true;
            set.names = std::collections::HashSet::new();
            return;
        }
        set.names.insert(name.to_owned());
    }

    fn registry(&self) -> std::sync::RwLockReadGuard<'_, Registry> {
        self.registry.read().unwrap_or_else(|p| p.into_inner())
    }

    fn registry_mut(&self) -> std::sync::RwLockWriteGuard<'_, Registry> {
        self.registry.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies a durable change; runs in LSN order (live on the log writer, as `key` asked,
    /// or in replay, with no key).
    fn apply(&self, lsn: Lsn, op: Op, key: Option<&Arc<str>>) {
        match op {
            Op::Append {
                name,
                incarnation,
                data,
                close,
                producer,
                stream_seq,
            } => {
                let registry = self.registry();
                if let Some(stream) = registry.streams.get(&name) {
                    let mut s = stream.write_state();
                    // A record of an older incarnation (deleted since) changes nothing.
                    if s.incarnation == incarnation && !s.gone {
                        let data_added = data.as_ref().is_some_and(|d| !d.is_empty());
                        let before = counted(&name, &s);
                        let applied =
                            s.apply_append_by(lsn, data, close, producer, stream_seq, key);
                        self.footprint
                            .change(stream.key.as_ref(), before, counted(&name, &s));
                        if let (Some(key), Some(cost)) = (key, applied.created) {
                            self.footprint.producer_added(key, cost);
                        }
                        self.footprint.release(applied.released.as_slice());
                        if data_added {
                            self.note_change(&name);
                        }
                    }
                    drop(s);
                    stream.bump();
                }
                // After the change is noted: a reader that sees this LSN applied finds the
                // name in the change set (see `Streams::take_changes`).
                self.applied_lsn.store(lsn, Ordering::Release);
            }
            Op::Create {
                name,
                incarnation,
                content_type,
                lifetime,
                closed,
                fork,
                prefix,
                initial,
            } => {
                let mut registry = self.registry_mut();
                if registry.streams.contains_key(&name) {
                    remove_stream(&mut registry, &name, &self.footprint, &self.cold);
                }
                let mut state =
                    StreamState::new(incarnation, content_type, lifetime, fork.clone(), lsn);
                if let Some(f) = &fork {
                    if let Some(source) = registry.streams.get(&f.source) {
                        let mut src = source.write_state();
                        if src.incarnation == f.source_incarnation && !src.gone {
                            state.chunks = src.prefix_chunks(f.offset);
                            state.recount_extents();
                            src.ref_count += 1;
                            self.cold.touch(&f.source);
                        }
                    }
                    state.tail = f.offset;
                }
                if let Some(prefix) = prefix {
                    state.push(prefix);
                }
                if let Some(initial) = initial {
                    state.push(initial);
                }
                state.closed = closed;
                self.footprint
                    .change(key, Counted::default(), counted(&name, &state));
                if state.tail > 0 {
                    self.note_change(&name);
                }
                registry
                    .streams
                    .insert(name.clone(), Stream::new(name, state, key.cloned()));
                self.applied_lsn.store(lsn, Ordering::Release);
            }
            Op::Delete { name, incarnation } => {
                let mut registry = self.registry_mut();
                let soft = match registry.streams.get(&name) {
                    Some(stream) => {
                        let mut s = stream.write_state();
                        if s.incarnation != incarnation || s.gone {
                            None
                        } else if s.ref_count > 0 {
                            s.soft_deleted = true;
                            s.applied_lsn = lsn;
                            drop(s);
                            stream.bump();
                            Some(true)
                        } else {
                            Some(false)
                        }
                    }
                    None => None,
                };
                if soft == Some(false) {
                    remove_stream(&mut registry, &name, &self.footprint, &self.cold);
                }
                self.applied_lsn.store(lsn, Ordering::Release);
            }
        }
    }
}

/// Removes a stream and releases its hold on its fork source, removing sources that were
/// deleted and held only by it (cascading up the chain).
fn remove_stream(registry: &mut Registry, name: &str, footprint: &Footprint, cold: &ColdStore) {
    let mut next = Some(name.to_owned());
    while let Some(name) = next.take() {
        let Some(stream) = registry.streams.remove(&name) else {
            break;
        };
        cold.touch(&name);
        let mut s = stream.write_state();
        footprint.change(stream.key.as_ref(), counted(&name, &s), Counted::default());
        footprint.release(&s.take_key_holdings());
        s.gone = true;
        let fork = s.fork.clone();
        drop(s);
        stream.bump();
        if let Some(f) = fork
            && let Some(source) = registry.streams.get(&f.source)
        {
            let mut src = source.write_state();
            if src.incarnation == f.source_incarnation {
                cold.touch(&f.source);
                src.ref_count = src.ref_count.saturating_sub(1);
                if src.ref_count == 0 && src.soft_deleted {
                    next = Some(f.source.clone());
                }
            }
        }
    }
}

/// Runs a mutation to its end even when its caller stops waiting (a client that hung up,
/// a request timeout). A create or delete holds its lock until its record is applied or has
/// failed; an append counts itself in flight (`Stream::in_flight`) until its record is
/// applied or has failed, and the next decision on its stream stands on what it leaves
/// (`Pipeline`) until then. Were either cancelled while its record was in flight, the
/// record could still be applied after the next decision was made without it: a retry of
/// the same idempotent append would be admitted again and logged a second time.
///
/// The mutation runs on the caller's task, and moves to a task of its own only if the
/// caller stops waiting ([`Finish`]): a task per append (its cell, its scheduling and the
/// wake of the waiting handler) was a measurable share of the server's CPU under many
/// connections. As when it was a task, a mutation that panics answers
/// [`LogError::WriterGone`] rather than unwinding its caller (an HTTP connection, a
/// subscription's wake delivery).
///
/// [`LogError::WriterGone`]: crate::log::LogError::WriterGone
async fn to_completion<T: Send + 'static>(
    mutation: impl std::future::Future<Output = Result<T, StreamError>> + Send + 'static,
) -> Result<T, StreamError> {
    use futures::FutureExt as _;
    let mutation = std::panic::AssertUnwindSafe(mutation).catch_unwind();
    // The runtime is the one polling this, taken now: a caller dropped on a thread outside
    // it still has the rest finished there.
    Finish(Some(Box::pin(mutation)), tokio::runtime::Handle::current())
        .await
        .unwrap_or(Err(StreamError::Log(crate::log::LogError::WriterGone)))
}

/// A future that, dropped before it is done, is finished on a task of its own on the
/// runtime it was made on (or dropped with that runtime, when that is what is stopping).
struct Finish<F>(Option<std::pin::Pin<Box<F>>>, tokio::runtime::Handle)
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static;

impl<F> std::future::Future for Finish<F>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        // Out while it is polled: one that panics is dropped in the unwinding, not finished
        // later.
        let Some(mut mutation) = self.0.take() else {
            return std::task::Poll::Pending;
        };
        let polled = mutation.as_mut().poll(cx);
        if polled.is_pending() {
            self.0 = Some(mutation);
        }
        polled
    }
}

impl<F> Drop for Finish<F>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        if let Some(rest) = self.0.take() {
            self.1.spawn(rest);
        }
    }
}

impl Streams {
    /// Opens the stream engine: loads the newest snapshot from `storage`, then replays the
    /// stream records of `replay` that came after it.
    pub(crate) async fn open(
        log: CommitLog,
        replay: &[Record],
        storage: Storage,
        node: Arc<Node>,
        config: StreamsConfig,
    ) -> Result<Streams, StreamError> {
        let consumer = log.consumer("streams")?;
        let cold = ColdStore::new(storage, node.id(), config.cache_bytes);
        let snapshot = cold.load_snapshot().await?;
        let (streams, snapshot_lsn) = match snapshot {
            Some((lsn, streams)) => (streams, lsn),
            None => (HashMap::new(), 0),
        };
        let footprint = Footprint::default();
        for (name, state) in &streams {
            footprint.change(None, Counted::default(), counted(name, state));
        }
        let inner = Arc::new(Inner {
            footprint,
            last_expiry: std::sync::Mutex::new(std::time::Instant::now()),
            next_expiry_ms: AtomicI64::new(0),
            stats: StreamStats::default(),
            changes: std::sync::Mutex::new(ChangeSet::default()),
            log,
            consumer,
            config,
            registry: RwLock::new(Registry {
                streams: streams
                    .into_iter()
                    .map(|(name, state)| {
                        let stream = Stream::new(name.clone(), state, None);
                        (name, stream)
                    })
                    .collect(),
            }),
            applied_lsn: AtomicU64::new(snapshot_lsn),
            meta: tokio::sync::Mutex::new(()),
            cold,
            closing: watch::channel(false).0,
            node,
        });
        inner.cold.set_snapshot_lsn(snapshot_lsn);
        for record in replay {
            if record.lsn <= snapshot_lsn
                || !matches!(record.kind, RecordKind::StreamAppend | RecordKind::Metadata)
            {
                continue;
            }
            let op = Op::decode(Bytes::from(record.payload.clone()))
                .map_err(|e| StreamError::Corrupt(format!("log record {}: {e}", record.lsn)))?;
            inner.apply(record.lsn, op, None);
        }
        let streams = Streams { inner };
        // Producers the snapshot holds that have been idle too long since.
        streams.expire_producers(Duration::ZERO);
        Ok(streams)
    }

    /// The streams that received data (appends, and creates with a first body) since the
    /// last call, and the LSN up to which that holds. Lossless: when more streams changed
    /// than [`StreamsConfig::max_pending_changes`], the batch says so instead of naming
    /// them, and the reader rescans with [`Streams::changed_since`].
    pub(crate) fn take_changes(&self) -> ChangeBatch {
        // `apply` notes a change before it moves `applied_lsn` past it (with release
        // ordering): everything up to the LSN read here is in the set taken next.
        let upto = self.inner.applied_lsn.load(Ordering::Acquire);
        let taken =
            std::mem::take(&mut *self.inner.changes.lock().unwrap_or_else(|p| p.into_inner()));
        ChangeBatch {
            upto,
            names: (!taken.overflowed).then(|| taken.names.into_iter().collect()),
        }
    }

    /// The LSN of the last change applied: every change at or below it is in the change set
    /// or was taken from it.
    pub(crate) fn applied_lsn(&self) -> Lsn {
        self.inner.applied_lsn.load(Ordering::Acquire)
    }

    /// The live streams with data whose last change is past `lsn` (a stream loaded from a
    /// snapshot written before the per-stream LSN was kept counts as changed at the
    /// snapshot's LSN), with where they stand. A scan of every stream: for rescans after a
    /// restart, a takeover or an overflow.
    pub(crate) fn changed_since(&self, lsn: Lsn) -> Vec<(String, StreamMark)> {
        let registry = self.inner.registry();
        registry
            .streams
            .iter()
            .filter_map(|(name, stream)| {
                let mark = StreamMark::of(&stream.read_state())?;
                (mark.tail > 0 && mark.changed_lsn > lsn).then(|| (name.clone(), mark))
            })
            .collect()
    }

    /// Where live stream `name` stands, from memory (an expired stream that no request
    /// deleted yet still answers).
    pub(crate) fn mark_of(&self, name: &str) -> Option<StreamMark> {
        StreamMark::of(&self.lookup(name)?.read_state())
    }

    /// The node id whose streams these are.
    pub(crate) fn node_id(&self) -> &str {
        self.inner.node.id()
    }

    /// Work counters.
    pub(crate) fn stats(&self) -> &StreamStats {
        &self.inner.stats
    }

    /// Tells long-poll and SSE readers to finish (server shutdown).
    pub fn shutdown(&self) {
        self.inner.closing.send_replace(true);
    }

    /// A receiver that turns `true` at shutdown.
    pub(crate) fn closing(&self) -> watch::Receiver<bool> {
        self.inner.closing.subscribe()
    }

    /// How many streams exist (soft-deleted ones included).
    pub(crate) fn len(&self) -> usize {
        self.inner.registry().streams.len()
    }

    /// Up to `request.limit` live streams whose names start with `request.prefix` (after
    /// `request.after`), in name order, with their metadata and producers (what a console
    /// or an operator lists), within `request.max_producers`. The second value says whether
    /// more streams matched.
    pub fn list(&self, request: &ListRequest) -> (Vec<StreamSummary>, bool) {
        let now = now_ms();
        let after = |name: &str| request.after.as_deref().is_none_or(|a| name > a);
        let mut matching: Vec<Arc<Stream>> = {
            let registry = self.inner.registry();
            registry
                .streams
                .iter()
                .filter(|(name, _)| name.starts_with(&request.prefix) && after(name))
                .map(|(_, s)| s.clone())
                .collect()
        };
        matching.retain(|s| {
            let state = s.read_state();
            !state.soft_deleted && !state.gone
        });
        // Expired streams are deleted by the next request that touches them; they are not
        // listed meanwhile.
        matching.retain(|s| !s.expired(now));
        let limit = request.limit;
        let mut more = matching.len() > limit;
        // The first `limit` names, without sorting every match.
        if more {
            matching.select_nth_unstable_by(limit, |a, b| a.name.cmp(&b.name));
            matching.truncate(limit);
        }
        matching.sort_by(|a, b| a.name.cmp(&b.name));
        more |= keep_within_producers(
            &mut matching,
            |s| s.read_state().producers.len(),
            request.max_producers,
        );
        let summaries = matching
            .iter()
            .take(limit)
            .map(|stream| {
                let s = stream.read_state();
                let mut producers: Vec<ProducerSummary> = s
                    .producers
                    .iter()
                    .map(|(id, p)| ProducerSummary {
                        id: id.clone(),
                        epoch: p.epoch,
                        last_seq: p.last_seq,
                    })
                    .collect();
                producers.sort_by(|a, b| a.id.cmp(&b.id));
                StreamSummary {
                    name: stream.name.clone(),
                    info: StreamInfo {
                        content_type: s.content_type.clone(),
                        tail: s.tail,
                        closed: s.closed,
                        incarnation: s.incarnation.clone(),
                        lifetime: s.lifetime.clone(),
                    },
                    forked_from: s.fork.as_ref().map(|f| f.source.clone()),
                    producers,
                }
            })
            .collect();
        (summaries, more)
    }

    /// Whether this engine holds a stream of this name (a soft-deleted one included).
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.lookup(name).is_some_and(|s| !s.read_state().gone)
    }

    fn lookup(&self, name: &str) -> Option<Arc<Stream>> {
        self.inner.registry().streams.get(name).cloned()
    }

    /// The stream, if it exists and has not expired (an expired one is deleted now).
    /// Soft-deleted streams answer [`StreamError::Gone`].
    pub async fn get(&self, name: &str) -> Result<Arc<Stream>, StreamError> {
        let stream = self.lookup(name).ok_or(StreamError::NotFound)?;
        if stream.expired(now_ms()) {
            let (this, expired) = (self.clone(), stream.clone());
            to_completion(async move {
                let _meta = this.inner.meta.lock().await;
                this.expire_locked(&expired).await
            })
            .await?;
        }
        let s = stream.read_state();
        if s.gone {
            return Err(StreamError::NotFound);
        }
        if s.soft_deleted {
            return Err(StreamError::Gone);
        }
        drop(s);
        Ok(stream)
    }

    /// Deletes an expired stream (soft-deleting it while forks read it). Holds `meta`.
    async fn expire_locked(&self, stream: &Arc<Stream>) -> Result<(), StreamError> {
        let incarnation = {
            let s = stream.read_state();
            if s.gone || s.soft_deleted {
                return Ok(());
            }
            s.incarnation.clone()
        };
        let _admit = stream.admit.lock().await;
        self.commit(
            RecordKind::Metadata,
            Op::Delete {
                name: stream.name.clone(),
                incarnation,
            },
            None,
        )
        .await?;
        Ok(())
    }

    /// Logs `op` and applies it once it is durable. Callers hold the stream's `admit` (or
    /// `meta`) lock across this, and run under [`to_completion`], so the lock is held until
    /// the record is applied or has failed.
    async fn commit(
        &self,
        kind: RecordKind,
        op: Op,
        key: Option<Arc<str>>,
    ) -> Result<Lsn, StreamError> {
        let payload = op.encode();
        let inner = self.inner.clone();
        let lsn = self
            .inner
            .log
            .append_applied(kind, payload, move |lsn| inner.apply(lsn, op, key.as_ref()))
            .await?;
        Ok(lsn)
    }

    /// Creates a stream (`PUT`). Returns whether it was new, and its metadata.
    pub async fn create(&self, req: CreateRequest) -> Result<(bool, StreamInfo), StreamError> {
        self.create_as(req, new_incarnation()).await
    }

    /// [`Streams::create`], where a new stream gets incarnation `incarnation` (its name's
    /// claim names it before the stream is made).
    pub(crate) async fn create_as(
        &self,
        req: CreateRequest,
        incarnation: String,
    ) -> Result<(bool, StreamInfo), StreamError> {
        let this = self.clone();
        to_completion(async move { this.create_now(req, incarnation).await }).await
    }

    async fn create_now(
        &self,
        req: CreateRequest,
        incarnation: String,
    ) -> Result<(bool, StreamInfo), StreamError> {
        let _meta = self.inner.meta.lock().await;
        if let Some(existing) = self.lookup(&req.name) {
            if existing.expired(now_ms()) {
                self.expire_locked(&existing).await?;
            }
            let s = existing.read_state();
            if s.soft_deleted && !s.gone {
                return Err(StreamError::NameHeld);
            }
            if !s.gone {
                if let Some(token) = &req.incarnation
                    && *token != s.incarnation
                {
                    return Err(StreamError::IncarnationMismatch {
                        current: s.incarnation.clone(),
                    });
                }
                return if same_config(&s, &req) {
                    drop(s);
                    existing.touch();
                    Ok((false, existing.info()))
                } else {
                    Err(StreamError::ConfigConflict)
                };
            }
        }
        if self.inner.registry().streams.len() >= self.inner.config.max_streams {
            return Err(StreamError::TooManyStreams(self.inner.config.max_streams));
        }
        // Its strings at least (the state budget counts them twice for the name).
        let adds = state::STREAM_ENTRY_BYTES
            + 2 * req.name.len() as u64
            + INCARNATION_BYTES
            + req.content_type.as_ref().map_or(0, |c| c.len() as u64);
        match self.state_room(req.key.as_deref()).check(adds) {
            Ok(()) => {}
            // Only a full server sweeps every stream for idle producers, and at most once a
            // second: a key past its own share must not make every create wait on a sweep
            // (its idle producers go at the next periodic one), nor may creates refused
            // one after another by a full server each sweep every stream.
            Err(StreamError::StateFull { .. }) => {
                self.expire_producers(FULL_SWEEP);
                self.state_room(req.key.as_deref()).check(adds)?;
            }
            Err(e) => return Err(e),
        }
        let mut content_type = req.content_type.clone();
        let mut lifetime = req.lifetime.clone();
        let mut fork = None;
        let mut prefix = None;
        if let Some(f) = &req.fork {
            let (spec, source_type, source_lifetime, sub_prefix) = self.resolve_fork(f).await?;
            if let Some(ct) = &content_type {
                if media_type(ct) != media_type(&source_type) {
                    return Err(StreamError::ForkConflict(format!(
                        "content type {ct:?} does not match the source's {source_type:?}"
                    )));
                }
            } else {
                content_type = Some(source_type);
            }
            if lifetime.ttl_secs.is_none() && lifetime.expires_at.is_none() {
                lifetime = source_lifetime;
            }
            fork = Some(spec);
            prefix = sub_prefix;
        }
        let content_type = content_type.unwrap_or_else(|| "application/octet-stream".into());
        let initial = if req.body.is_empty() {
            None
        } else {
            encode_body(&content_type, &req.body, true)?
        };
        let op = Op::Create {
            name: req.name.clone(),
            incarnation,
            content_type,
            lifetime,
            closed: req.closed,
            fork,
            prefix,
            initial,
        };
        self.commit(RecordKind::Metadata, op, req.key.clone())
            .await?;
        let stream = self.lookup(&req.name).ok_or(StreamError::NotFound)?;
        Ok((true, stream.info()))
    }

    /// Checks a fork request against its source; returns the fork's spec, the source's
    /// content type and lifetime, and the materialized sub-offset prefix.
    async fn resolve_fork(
        &self,
        f: &ForkRequest,
    ) -> Result<(ForkSpec, String, Lifetime, Option<Bytes>), StreamError> {
        let source = match self.lookup(&f.source) {
            Some(s) if !s.read_state().gone && !s.expired(now_ms()) => s,
            _ => return Err(StreamError::NotFound),
        };
        let (incarnation, content_type, lifetime, tail) = {
            let s = source.read_state();
            if s.soft_deleted {
                return Err(StreamError::ForkConflict(
                    "the source stream was deleted".into(),
                ));
            }
            (
                s.incarnation.clone(),
                s.content_type.clone(),
                s.lifetime.clone(),
                s.tail,
            )
        };
        let sub = f.sub_offset.unwrap_or(0);
        if sub > 0 && f.offset.is_none() {
            return Err(StreamError::BadRequest(
                "Stream-Fork-Sub-Offset above 0 needs Stream-Fork-Offset".into(),
            ));
        }
        let offset = f.offset.unwrap_or(tail);
        if offset > tail {
            return Err(StreamError::BadRequest(
                "Stream-Fork-Offset is beyond the source's tail".into(),
            ));
        }
        let prefix = if sub > 0 {
            let records = self.records_from(&source, offset, 1).await?;
            let Some(first) = records.records.into_iter().next() else {
                return Err(StreamError::BadRequest(
                    "Stream-Fork-Sub-Offset: the source has no data past the fork offset".into(),
                ));
            };
            Some(sub_prefix(&first, sub, state::is_json(&content_type))?)
        } else {
            None
        };
        Ok((
            ForkSpec {
                source: f.source.clone(),
                source_incarnation: incarnation,
                offset,
                sub_offset: sub,
            },
            content_type,
            lifetime,
            prefix,
        ))
    }

    /// Appends to a stream and/or closes it (`POST`).
    pub async fn append(&self, req: AppendRequest) -> Result<AppendOutcome, StreamError> {
        let this = self.clone();
        to_completion(async move { this.append_now(req).await }).await
    }

    async fn append_now(&self, req: AppendRequest) -> Result<AppendOutcome, StreamError> {
        let stream = self.get(&req.name).await?;
        let mut pipeline = stream.admit.lock().await;
        stream.touch();
        pipeline.settle(stream.in_flight.load(Ordering::Acquire));
        let mut decided = self.admit_append(&stream, &mut pipeline, &req, 0);
        if !matches!(decided, Ok(Admitted::Commit { .. })) && pipeline.pending.is_some() {
            // An answer or a refusal must not stand on appends that may yet fail: wait for
            // them, and decide on what is durable.
            stream.drain().await;
            pipeline.settle(0);
            decided = self.admit_append(&stream, &mut pipeline, &req, 0);
        }
        if matches!(
            decided,
            Err(StreamError::TooManyProducers(_)
                | StreamError::StateFull { .. }
                | StreamError::KeyShareFull { .. })
        ) && self.expire_stream_producers(&stream) > 0
        {
            // Room made by producers idle past their expiry: decide again.
            decided = self.admit_append(&stream, &mut pipeline, &req, 0);
        }
        if let (
            Err(StreamError::KeyShareFull {
                what: admit::STATE,
                budget,
                held,
            }),
            Some(p),
            Some(key),
        ) = (&decided, &req.producer, &req.key)
        {
            // The key's share of the stream state is full: its own oldest retired records on
            // this stream make room for its new producer, if they can. The append is decided
            // with that room first, and the records go only when it is admitted whole: a
            // refusal for another reason (a stream-seq conflict, the server's budget) drops
            // none. (A log that then fails the write leaves them gone with nothing appended;
            // such a log refuses every write.)
            // What the entry adds to the share: its cost, less its own retired record's
            // when the key made it (that record goes as the entry comes, and is not one of
            // the records evicted here).
            let freed = stream
                .read_state()
                .freed_by_new_entry(&p.id, Some(&**key))
                .1;
            let adds = state::producer_cost(&p.id).saturating_sub(freed);
            let need = (held + adds).saturating_sub(*budget);
            if self.can_evict_own_retired(&stream, key, &p.id, need) {
                let refused = decided;
                let with_room = self.admit_append(&stream, &mut pipeline, &req, need);
                decided = match with_room {
                    Ok(Admitted::Commit { .. })
                        if self.evict_own_retired(&stream, key, &p.id, need) == 0 =>
                    {
                        // A sweep on another thread took the records meanwhile: the room is
                        // not there. Nothing was submitted; the pipeline held only this
                        // append (it was settled empty before a refusal).
                        pipeline.pending = None;
                        refused
                    }
                    other => other,
                };
            }
        }
        let (op, payload, stored, next, closed, incarnation) = match decided? {
            Admitted::Commit {
                op,
                payload,
                stored,
                next,
                closed,
                incarnation,
            } => (op, payload, stored, next, closed, incarnation),
            Admitted::Answer(outcome) => return Ok(outcome),
        };
        let inner = self.inner.clone();
        let key = req.key.clone();
        let submitted = match self.inner.log.submit_chained(
            RecordKind::StreamAppend,
            payload,
            move |lsn| inner.apply(lsn, op, key.as_ref()),
            pipeline.chain.clone(),
        ) {
            Ok(submitted) => submitted,
            Err(e) => {
                // Not submitted, but already counted in what the pipeline leaves: forget
                // that once what is in flight has landed.
                stream.drain().await;
                pipeline.pending = None;
                return Err(e.into());
            }
        };
        // Counted until it lands. This runs under `to_completion`, never dropped midway: an
        // append uncounted while its record could still be written would let the next
        // decision stand on a state without it.
        stream.in_flight.fetch_add(1, Ordering::AcqRel);
        drop(pipeline);
        let durable = submitted.durable().await;
        stream.landed();
        durable?;
        if stored > 0 {
            self.inner.stats.appends.fetch_add(1, Ordering::Relaxed);
            self.inner
                .stats
                .append_bytes
                .fetch_add(stored, Ordering::Relaxed);
        }
        Ok(AppendOutcome::Appended {
            next,
            closed,
            closed_now: req.close,
            producer: req.producer,
            incarnation,
        })
    }

    /// The stream-state budget as a request of `key` finds it: the server's, and (for a
    /// key) its share.
    fn state_room(&self, key: Option<&str>) -> Room {
        self.rooms(key).0
    }

    /// The stream-state and producer budgets as a request of `key` finds them.
    fn rooms(&self, key: Option<&str>) -> (Room, Room) {
        let (config, footprint) = (&self.inner.config, &self.inner.footprint);
        let held = key.map(|k| footprint.held_by(k));
        let room = |what, budget: u64, server: &AtomicU64, of_key: fn(&KeyUse) -> u64| Room {
            server: admit::Budget {
                what,
                budget,
                held: server.load(Ordering::Relaxed),
                share: false,
            },
            key: held.as_ref().map(|h| admit::Budget {
                what,
                budget: budget / KEY_SHARE,
                held: of_key(h),
                share: true,
            }),
        };
        (
            room(
                admit::STATE,
                config.max_state_bytes,
                &footprint.state_bytes,
                |h| h.state,
            ),
            room(
                admit::PRODUCERS,
                config.max_producer_bytes,
                &footprint.producer_bytes,
                |h| h.producers,
            ),
        )
    }

    /// The caps a producer entry is held to: the server's producer and state budgets, and
    /// for an append of `key`, its share of each.
    fn producer_caps(&self, key: Option<&str>) -> admit::Caps {
        let (state, producers) = self.rooms(key);
        admit::Caps {
            max_producers: self.inner.config.max_producers_per_stream,
            server: [producers.server, state.server],
            key: producers.key.zip(state.key).map(|(p, s)| [p, s]),
        }
    }

    /// Decides an append against the stream's applied state and its pipeline; a commit is
    /// added to what the pipeline leaves (the caller submits it, or forgets the pipeline).
    ///
    /// `room` is stream state the key is about to free (its own retired records): its share
    /// is held to what it holds less that.
    fn admit_append(
        &self,
        stream: &Stream,
        pipeline: &mut Pipeline,
        req: &AppendRequest,
        room: u64,
    ) -> Result<Admitted, StreamError> {
        let s = stream.read_state();
        let view = admit::View {
            applied: &s,
            pending: pipeline.pending.as_ref(),
        };
        // A key's share matters only to an append that may add a producer entry: others
        // take no lock for it.
        let mut caps = self.producer_caps(req.producer.as_ref().and(req.key.as_deref()));
        if room > 0 {
            // The records' bytes leave the server's stream state too.
            if let Some([_, state]) = &mut caps.key {
                state.held = state.held.saturating_sub(room);
            }
            caps.server[1].held = caps.server[1].held.saturating_sub(room);
        }
        let op = match admit::append(&view, req, &caps)? {
            admit::Admission::Commit(op) => op,
            admit::Admission::Answer(outcome) => return Ok(Admitted::Answer(outcome)),
        };
        let Op::Append {
            data,
            close,
            producer,
            stream_seq,
            ..
        } = &op
        else {
            return Err(StreamError::BadRequest("not an append".into()));
        };
        // Encoded before it counts as pending: from here on nothing may stop the caller
        // from submitting it.
        let payload = op.encode();
        let pending = pipeline
            .pending
            .get_or_insert_with(|| admit::Pending::over(&s));
        let stored = data.as_ref().map_or(0, |d| d.len() as u64);
        let next = pending.add(
            &s,
            stored,
            *close,
            producer.as_ref(),
            stream_seq.as_ref(),
            req.key.as_ref(),
        );
        Ok(Admitted::Commit {
            stored,
            next,
            closed: pending.closed(),
            incarnation: s.incarnation.clone(),
            op,
            payload,
        })
    }

    /// Deletes a stream (`DELETE`); while forks read it, it is soft-deleted.
    pub async fn delete(&self, name: &str, incarnation: Option<&str>) -> Result<(), StreamError> {
        let (this, name) = (self.clone(), name.to_owned());
        let incarnation = incarnation.map(str::to_owned);
        to_completion(async move { this.delete_now(&name, incarnation.as_deref()).await }).await
    }

    async fn delete_now(&self, name: &str, incarnation: Option<&str>) -> Result<(), StreamError> {
        let _meta = self.inner.meta.lock().await;
        let stream = self.lookup(name).ok_or(StreamError::NotFound)?;
        if stream.expired(now_ms()) {
            self.expire_locked(&stream).await?;
            let soft = stream.read_state().soft_deleted;
            return Err(if soft {
                StreamError::Gone
            } else {
                StreamError::NotFound
            });
        }
        let _admit = stream.admit.lock().await;
        let current = {
            let s = stream.read_state();
            if s.gone {
                return Err(StreamError::NotFound);
            }
            if s.soft_deleted {
                return Err(StreamError::Gone);
            }
            s.incarnation.clone()
        };
        if let Some(token) = incarnation
            && token != current
        {
            return Err(StreamError::IncarnationMismatch { current });
        }
        self.commit(
            RecordKind::Metadata,
            Op::Delete {
                name: name.to_owned(),
                incarnation: current,
            },
            None,
        )
        .await?;
        Ok(())
    }

    /// Reads up to about `max_bytes` from offset `from` (whole records; at least one).
    pub async fn read(
        &self,
        stream: &Arc<Stream>,
        from: u64,
        max_bytes: usize,
    ) -> Result<ReadResult, StreamError> {
        {
            let s = stream.read_state();
            if from > s.tail {
                return Err(StreamError::OffsetBeyondTail);
            }
        }
        self.records_from(stream, from, max_bytes).await
    }

    async fn records_from(
        &self,
        stream: &Arc<Stream>,
        from: u64,
        max_bytes: usize,
    ) -> Result<ReadResult, StreamError> {
        // Plan under the lock (cheap clones), fetch cold data without it.
        let (plan, content_type, incarnation) = {
            let s = stream.read_state();
            let first = s.chunks.partition_point(|c| c.end() <= from);
            let plan: Vec<Chunk> = s.chunks[first..].to_vec();
            (plan, s.content_type.clone(), s.incarnation.clone())
        };
        let (records, mut next) = self.collect(plan, from, max_bytes).await?;
        let s = stream.read_state();
        // With no data past `from`, the reader is at the tail (gaps at fork points included).
        if records.is_empty() {
            next = from.max(next);
            if s.tail > next && s.chunks.last().is_none_or(|c| c.end() <= from) {
                next = s.tail;
            }
        }
        let up_to_date = next >= s.tail;
        Ok(ReadResult {
            records,
            next,
            up_to_date,
            closed_at_tail: s.closed && up_to_date,
            content_type,
            incarnation,
        })
    }

    /// The records of `plan` from offset `from` on, up to about `max_bytes` (whole records,
    /// at least one; the first cut at `from`), and the offset after them (`from` if none).
    async fn collect(
        &self,
        plan: Vec<Chunk>,
        from: u64,
        max_bytes: usize,
    ) -> Result<(Vec<Bytes>, u64), StreamError> {
        let mut records = Vec::new();
        let mut next = from;
        let mut bytes = 0usize;
        'chunks: for chunk in plan {
            let pieces = match chunk {
                Chunk::Hot(r) => vec![(r.start, r.end, r.data)],
                Chunk::Cold(extent) => self.inner.cold.read_extent(&extent).await?,
            };
            for (start, end, data) in pieces {
                if end <= from {
                    continue;
                }
                if !records.is_empty() && bytes + data.len() > max_bytes {
                    break 'chunks;
                }
                let data = if start < from {
                    data.slice(usize::try_from(from - start).unwrap_or(data.len())..)
                } else {
                    data
                };
                bytes += data.len();
                records.push(data);
                next = end;
            }
        }
        Ok((records, next))
    }

    /// Reads stream `name` of another node, `node`, from that node's newest snapshot: up to
    /// about `max_bytes` of its sealed data from offset `from`, when the snapshot holds the
    /// stream as incarnation `incarnation` (its name's claim says which is current) with
    /// data past `from`. Otherwise where its sealed data ends (0 when it has none here, or
    /// an object it points into is gone, collected after a newer snapshot): the owner
    /// answers then. The answer says the
    /// reader is at the tail only at the end of a closed stream; otherwise only the owner
    /// knows the tail.
    pub(crate) async fn read_sealed(
        &self,
        node: &str,
        name: &str,
        incarnation: &str,
        from: u64,
        max_bytes: usize,
    ) -> Result<SealedRead, StreamError> {
        let Some(view) = self.inner.cold.sealed_view(node, name).await? else {
            return Ok(SealedRead::Reach(0));
        };
        if view.incarnation != incarnation {
            return Ok(SealedRead::Reach(0));
        }
        if view.closed_tail == Some(from) {
            // The end of a closed stream: nothing more will come.
            return Ok(SealedRead::Read(ReadResult {
                records: Vec::new(),
                next: from,
                up_to_date: true,
                closed_at_tail: true,
                content_type: view.content_type,
                incarnation: view.incarnation,
            }));
        }
        let first = view.extents.partition_point(|e| e.end <= from);
        let plan: Vec<Chunk> = view.extents[first..]
            .iter()
            .cloned()
            .map(Chunk::Cold)
            .collect();
        let (records, next) = match self.collect(plan, from, max_bytes).await {
            Ok(read) => read,
            Err(StreamError::Storage(e)) => {
                tracing::debug!(stream = %name, node = %node, error = %e, "sealed data not readable here; the owner answers");
                return Ok(SealedRead::Reach(0));
            }
            Err(e) => return Err(e),
        };
        if records.is_empty() {
            return Ok(SealedRead::Reach(view.extents.last().map_or(0, |e| e.end)));
        }
        let at_end = view.closed_tail == Some(next);
        Ok(SealedRead::Read(ReadResult {
            records,
            next,
            up_to_date: at_end,
            closed_at_tail: at_end,
            content_type: view.content_type,
            incarnation: view.incarnation,
        }))
    }

    /// Runs a checkpoint if enough has changed (or `force`): seals in-memory data into an
    /// object, writes a snapshot and releases the log behind it.
    pub async fn checkpoint(&self, force: bool) -> Result<bool, StreamError> {
        cold::checkpoint(self, force).await
    }

    /// Deletes expired streams no request touched (they are deleted lazily otherwise), then
    /// the objects no stream references any more, after the grace period.
    pub(crate) async fn collect_garbage(
        &self,
        grace: Duration,
    ) -> Result<crate::storage::GcReport, StreamError> {
        let now = now_ms();
        let expired: Vec<Arc<Stream>> = self
            .inner
            .registry()
            .streams
            .values()
            .filter(|s| s.expired(now))
            .cloned()
            .collect();
        for stream in expired {
            let _meta = self.inner.meta.lock().await;
            self.expire_locked(&stream).await?;
        }
        cold::collect_garbage(self, grace).await
    }

    /// Checkpoints on a timer until `shutdown` resolves. The final checkpoint is
    /// [`crate::db::Database::shutdown`]'s.
    pub(crate) async fn run_maintenance(
        self,
        tick: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        crate::every(tick, shutdown, || async {
            self.expire_producers(MAINTENANCE_SWEEP);
            if let Err(e) = self.checkpoint(false).await {
                tracing::warn!(error = %e, "stream checkpoint failed; retrying later");
            }
        })
        .await;
    }

    /// Retires producers idle longer than [`StreamsConfig::producer_expiry`], unless the
    /// last sweep began less than `every` ago (a sweep takes every stream's lock in turn:
    /// the maintenance loop sweeps once a minute, a create refused by a full server at most
    /// once a second); returns how many were retired. A retired producer's entry
    /// (its id and receipts) goes; its last epoch and sequence stay ([`state::Retired`],
    /// at most `max_producers_per_stream` per stream, the oldest retired go first), so a
    /// retry of an append it made is still a duplicate (204, without its original offset),
    /// never a second append, and it may go on where it stopped. Snapshots written after
    /// it hold the retired record; a restart from an older one brings the entry back until
    /// the next sweep, which only keeps it longer.
    pub(crate) fn expire_producers(&self, every: Duration) -> usize {
        let inner = &self.inner;
        // A refused create sweeps only when some producer may be due: the last sweep left
        // none idle that long, and producers made since are younger.
        if every == FULL_SWEEP && producer_clock_ms() < inner.next_expiry_ms.load(Ordering::Relaxed)
        {
            return 0;
        }
        {
            let Ok(mut last) = inner.last_expiry.lock() else {
                return 0;
            };
            if last.elapsed() < every {
                return 0;
            }
            *last = std::time::Instant::now();
        }
        inner.stats.producer_sweeps.fetch_add(1, Ordering::Relaxed);
        let expiry = i64::try_from(inner.config.producer_expiry.as_millis()).unwrap_or(i64::MAX);
        let now = producer_clock_ms();
        let before = now.saturating_sub(expiry);
        let max_retired = inner.config.max_producers_per_stream;
        let registry = inner.registry();
        let mut forgotten = 0;
        let mut oldest_left = i64::MAX;
        for stream in registry.streams.values() {
            let mut s = stream.write_state();
            if s.producers.values().any(|p| p.last_ms < before) {
                forgotten += inner.shed(stream, &mut s, |s, released| {
                    s.expire_producers_releasing(before, now, max_retired, released)
                });
            }
            if let Some(oldest) = s.producers.values().map(|p| p.last_ms).min() {
                oldest_left = oldest_left.min(oldest);
            }
        }
        // Producers made since began at `now` or later.
        inner.next_expiry_ms.store(
            oldest_left.min(now).saturating_add(expiry),
            Ordering::Relaxed,
        );
        forgotten
    }

    /// Forgets the producers of one stream idle past their expiry (a new producer found it
    /// full); returns how many.
    fn expire_stream_producers(&self, stream: &Stream) -> usize {
        let inner = &self.inner;
        let expiry = i64::try_from(inner.config.producer_expiry.as_millis()).unwrap_or(i64::MAX);
        let now = producer_clock_ms();
        let max_retired = inner.config.max_producers_per_stream;
        let mut s = stream.write_state();
        if s.gone {
            // Released when it went: nothing of it counts any more.
            return 0;
        }
        inner.shed(stream, &mut s, |s, released| {
            s.expire_producers_releasing(now.saturating_sub(expiry), now, max_retired, released)
        })
    }

    /// Drops the oldest retired records on `stream` of producers `key` made (never producer
    /// `id`'s), enough to free `need` bytes of its share, or none if they cannot
    /// ([`StreamState::evict_retired_of`]); returns how many went.
    fn evict_own_retired(&self, stream: &Stream, key: &str, id: &str, need: u64) -> usize {
        let mut s = stream.write_state();
        if s.gone {
            return 0;
        }
        let keep = state::producer_key(id);
        self.inner.shed(stream, &mut s, |s, released| {
            s.evict_retired_of(key, keep, need, released)
        })
    }

    /// Whether [`Streams::evict_own_retired`] would free `need` bytes now.
    fn can_evict_own_retired(&self, stream: &Stream, key: &str, id: &str, need: u64) -> bool {
        let s = stream.read_state();
        !s.gone && s.can_evict_retired_of(key, state::producer_key(id), need)
    }

    /// What `key` holds of the budgets now: `(stream-state bytes, producer bytes)`.
    #[cfg(feature = "testing")]
    pub fn key_use(&self, key: &str) -> (u64, u64) {
        let held = self.inner.footprint.held_by(key);
        (held.state, held.producers)
    }

    /// Retires the producers idle past their expiry now (what the maintenance loop does
    /// every minute); returns how many.
    #[cfg(feature = "testing")]
    pub fn expire_idle_producers(&self) -> usize {
        self.expire_producers(Duration::ZERO)
    }

    /// Counts what each key holds afresh from the streams (their creators' own state, their
    /// producer entries and retired records) and compares it with the running counts; an
    /// error names the first key that differs.
    #[cfg(feature = "testing")]
    pub fn audit_key_use(&self) -> Result<(), String> {
        let mut recount: HashMap<Arc<str>, KeyUse> = HashMap::new();
        for (name, stream) in &self.inner.registry().streams {
            let s = stream.read_state();
            if let Some(key) = &stream.key {
                recount.entry(key.clone()).or_default().state += counted(name, &s).own();
            }
            for (id, p) in &s.producers {
                if let Some(key) = &p.key {
                    let u = recount.entry(key.clone()).or_default();
                    u.state += state::producer_cost(id);
                    u.producers += state::producer_cost(id);
                }
            }
            for r in s.retired.values() {
                if let Some(key) = &r.key {
                    recount.entry(key.clone()).or_default().state += state::RETIRED_ENTRY_BYTES;
                }
            }
        }
        recount.retain(|_, u| *u != KeyUse::default());
        let counted = self
            .inner
            .footprint
            .keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for key in recount.keys().chain(counted.keys()) {
            let (want, got) = (recount.get(key), counted.get(key));
            if want != got {
                return Err(format!("key {key}: counted {got:?}, recounted {want:?}"));
            }
        }
        Ok(())
    }

    /// Bytes the streams' state and their producers count against their budgets.
    pub(crate) fn footprint(&self) -> (u64, u64) {
        let f = &self.inner.footprint;
        (
            f.state_bytes.load(Ordering::Relaxed),
            f.producer_bytes.load(Ordering::Relaxed),
        )
    }

    /// Bytes of stream data held only in memory and the log.
    pub fn hot_bytes(&self) -> u64 {
        self.inner
            .registry()
            .streams
            .values()
            .map(|s| s.read_state().hot_bytes)
            .sum()
    }
}

/// Whether a create matches an existing stream's configuration (idempotent `PUT`).
fn same_config(s: &StreamState, req: &CreateRequest) -> bool {
    let content_type = match (&req.content_type, &req.fork) {
        (Some(ct), _) => *ct == s.content_type,
        (None, Some(_)) => true,
        (None, None) => s.content_type == "application/octet-stream",
    };
    let fork = match (&req.fork, &s.fork) {
        (None, None) => true,
        (Some(r), Some(f)) => {
            r.source == f.source
                && r.offset.is_none_or(|o| o == f.offset)
                && r.sub_offset.unwrap_or(0) == f.sub_offset
        }
        _ => false,
    };
    let lifetime = if req.fork.is_some()
        && req.lifetime.ttl_secs.is_none()
        && req.lifetime.expires_at.is_none()
    {
        true
    } else {
        req.lifetime.ttl_secs == s.lifetime.ttl_secs
            && req.lifetime.expires_at == s.lifetime.expires_at
    };
    content_type && fork && lifetime && req.closed == s.closed
}

/// The media type of a normalized content type (what precedes any parameter).
fn media_type(content_type: &str) -> &str {
    content_type.split(';').next().unwrap_or("").trim()
}

/// Whether a normalized content type is a JSON stream's (`application/json`).
pub(crate) fn is_json_content_type(content_type: &str) -> bool {
    state::is_json(content_type)
}

/// Turns a request body into record bytes: JSON streams keep one compact message per line.
/// `None` when a create's body is an empty JSON array (no message).
fn encode_body(
    content_type: &str,
    body: &[u8],
    create: bool,
) -> Result<Option<Bytes>, StreamError> {
    if !state::is_json(content_type) {
        return Ok(Some(Bytes::copy_from_slice(body)));
    }
    let messages = json::split_messages(body)?;
    if messages.is_empty() {
        return if create {
            Ok(None)
        } else {
            Err(JsonTextError::EmptyArray.into())
        };
    }
    let mut out = Vec::with_capacity(body.len() + messages.len());
    for m in messages {
        out.extend_from_slice(&m);
        out.push(b'\n');
    }
    Ok(Some(Bytes::from(out)))
}

/// The first `sub` bytes (or, for JSON, messages) of a record.
fn sub_prefix(record: &Bytes, sub: u64, json: bool) -> Result<Bytes, StreamError> {
    let sub = usize::try_from(sub).unwrap_or(usize::MAX);
    if json {
        let mut end = 0;
        for _ in 0..sub {
            match record[end..].iter().position(|b| *b == b'\n') {
                Some(i) => end += i + 1,
                None => {
                    return Err(StreamError::BadRequest(
                        "Stream-Fork-Sub-Offset exceeds the message count of the append".into(),
                    ));
                }
            }
        }
        Ok(record.slice(..end))
    } else if sub > record.len() {
        Err(StreamError::BadRequest(
            "Stream-Fork-Sub-Offset exceeds the length of the append".into(),
        ))
    } else {
        Ok(record.slice(..sub))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_prefixes() {
        let r = Bytes::from_static(b"{\"a\":1}\n2\n3\n");
        assert_eq!(&sub_prefix(&r, 2, true).unwrap()[..], b"{\"a\":1}\n2\n");
        assert!(sub_prefix(&r, 4, true).is_err());
        assert_eq!(&sub_prefix(&r, 3, false).unwrap()[..], b"{\"a");
    }
}
