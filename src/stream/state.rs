//! The state of one stream and how each change applies to it.
//!
//! The same `apply_*` functions run for a live append (on the log's writer thread, once the
//! record is durable) and for replay after a restart, so the two cannot drift apart.

use bytes::Bytes;
use std::borrow::Cow;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::codec::{ForkSpec, Lifetime, ProducerTuple};
use crate::log::Lsn;

/// How many recent appends per producer keep their `Stream-Next-Offset`, so a duplicate can
/// answer with the offset its original got.
pub(crate) const RECEIPT_WINDOW: usize = 16;

/// Appended bytes still held in memory (and in the commit log).
#[derive(Debug, Clone)]
pub(crate) struct HotRecord {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) data: Bytes,
}

/// A run of records sealed into an object on object storage.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct ColdExtent {
    /// The object holding it.
    pub(crate) key: String,
    /// Where its chunk starts in the object, and how long the chunk is.
    pub(crate) pos: u64,
    pub(crate) len: u64,
    /// The stream offsets it covers; `end` may be below the chunk's own last record when a
    /// fork shares only part of it.
    pub(crate) start: u64,
    pub(crate) end: u64,
}

/// A piece of a stream's data, in offset order.
#[derive(Debug, Clone)]
pub(crate) enum Chunk {
    Hot(HotRecord),
    Cold(ColdExtent),
}

impl Chunk {
    pub(crate) fn end(&self) -> u64 {
        match self {
            Chunk::Hot(r) => r.end,
            Chunk::Cold(c) => c.end,
        }
    }
}

/// What one producer's entry holds in memory besides its id (the map entry, its state, a
/// full receipt window and its slot in the set of producers changed since the last
/// checkpoint), for the producer-bytes budget.
pub(crate) const PRODUCER_ENTRY_BYTES: u64 = 480;

/// What one sealed extent holds in memory besides its object's key (its chunk slot and
/// offsets), for the stream-state budget.
pub(crate) const EXTENT_ENTRY_BYTES: u64 = 64;

/// The bytes a sealed extent counts against the stream-state budget.
pub(crate) fn extent_cost(e: &ColdExtent) -> u64 {
    EXTENT_ENTRY_BYTES + e.key.len() as u64
}

/// What one stream holds in memory besides its strings, producers and data (its handle,
/// locks, version channel, registry entry), for the stream-state budget.
pub(crate) const STREAM_ENTRY_BYTES: u64 = 1280;

/// The bytes producer `id`'s entry counts against the producer-bytes budget (its id is held
/// twice: as the entry's key and in the change set).
pub(crate) fn producer_cost(id: &str) -> u64 {
    PRODUCER_ENTRY_BYTES + 2 * id.len() as u64
}

/// Bytes a key's share stops counting (see `Footprint` in the stream module): a producer
/// entry or retired record of a key that went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyRelease {
    pub(crate) key: Arc<str>,
    /// Against the stream-state budget.
    pub(crate) state: u64,
    /// Against the producer budget.
    pub(crate) producers: u64,
}

impl KeyRelease {
    /// One retired record of a producer `key` made.
    fn retired(key: Arc<str>) -> Self {
        KeyRelease {
            key,
            state: RETIRED_ENTRY_BYTES,
            producers: 0,
        }
    }
}

/// What [`StreamState::apply_append_by`] changed in what keys hold.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct AppliedBy {
    /// The cost of the producer entry that counts against the append's key from now on:
    /// one it created, or another key's (or no key's) entry it appended to.
    pub(crate) created: Option<u64>,
    /// What stops counting against another key: a retired record of the producer's earlier
    /// life, no longer kept, or the entry now counted against the append's key.
    pub(crate) released: Option<KeyRelease>,
}

/// What one retired producer's record holds in memory (its map key, epoch, sequence, time,
/// the API key that made it, and the map slot with its control byte at the map's load
/// factor), for the stream-state budget.
pub(crate) const RETIRED_ENTRY_BYTES: u64 = 96;

/// What is kept of a producer once it expires: its last epoch and sequence, under
/// [`producer_key`] of its id, so a retry of an append it made is still a duplicate (204)
/// and never appended a second time. Only the duplicate's original offset is forgotten.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Retired {
    pub(crate) epoch: u64,
    pub(crate) last_seq: u64,
    /// When it was retired ([`super::producer_clock_ms`]); the oldest go first when a
    /// stream holds more than its cap.
    pub(crate) at_ms: i64,
    /// The API key its producer's entry counted against ([`ProducerState::key`]): the
    /// record's [`RETIRED_ENTRY_BYTES`] count against that key's share until the record
    /// goes. In memory only, as that key is.
    #[serde(skip)]
    pub(crate) key: Option<Arc<str>>,
}

impl Retired {
    /// The record as checkpoints store it (without its key, kept in memory only).
    pub(crate) fn stored(&self) -> Retired {
        Retired {
            epoch: self.epoch,
            last_seq: self.last_seq,
            at_ms: self.at_ms,
            key: None,
        }
    }

    /// What its key gets back when the record goes.
    fn release(self) -> Option<KeyRelease> {
        self.key.map(KeyRelease::retired)
    }
}

/// The key a retired producer is kept under: the first 128 bits of the SHA-256 of its id
/// (stable across restarts, and no client can pick an id that lands on another's).
pub(crate) fn producer_key(id: &str) -> u128 {
    let digest = ring::digest::digest(&ring::digest::SHA256, id.as_bytes());
    let mut key = [0u8; 16];
    key.copy_from_slice(&digest.as_ref()[..16]);
    u128::from_be_bytes(key)
}

/// An idempotent producer's state on one stream.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct ProducerState {
    pub(crate) epoch: u64,
    pub(crate) last_seq: u64,
    /// `(seq, Stream-Next-Offset)` of the latest appends, oldest first.
    pub(crate) receipts: VecDeque<(u64, u64)>,
    /// When an append of it was last applied (ms since the epoch; a replayed append counts
    /// as applied when it is replayed, which only keeps it longer). 0 in snapshots written
    /// before producers expired: such entries count from when they are loaded.
    #[serde(default)]
    pub(crate) last_ms: i64,
    /// The API key (its name) whose append created the entry, whose share of the producer
    /// and stream-state budgets it counts against; `None` when requests are not
    /// authenticated, and for entries replayed or loaded (kept in memory only).
    #[serde(skip)]
    pub(crate) key: Option<Arc<str>>,
}

impl ProducerState {
    /// What a producer's tuple means against its stored state (`None`: a producer not seen
    /// on the stream).
    pub(crate) fn check(state: Option<&ProducerState>, p: &ProducerTuple) -> ProducerCheck {
        let Some(state) = state else {
            return if p.seq == 0 {
                ProducerCheck::Accept
            } else {
                ProducerCheck::Gap {
                    expected: 0,
                    received: p.seq,
                }
            };
        };
        if p.epoch < state.epoch {
            return ProducerCheck::StaleEpoch {
                current: state.epoch,
            };
        }
        if p.epoch > state.epoch {
            return if p.seq == 0 {
                ProducerCheck::Accept
            } else {
                ProducerCheck::NewEpochNotAtZero
            };
        }
        if p.seq <= state.last_seq {
            let next = state
                .receipts
                .iter()
                .find(|(seq, _)| *seq == p.seq)
                .map(|(_, next)| *next);
            return ProducerCheck::Duplicate {
                last_seq: state.last_seq,
                next,
            };
        }
        if p.seq == state.last_seq + 1 {
            ProducerCheck::Accept
        } else {
            ProducerCheck::Gap {
                expected: state.last_seq + 1,
                received: p.seq,
            }
        }
    }

    /// Records an admitted append of `p` that ends the stream at `next`.
    pub(crate) fn record(&mut self, p: &ProducerTuple, next: u64) {
        if self.epoch != p.epoch {
            self.receipts.clear();
        }
        self.epoch = p.epoch;
        self.last_seq = p.seq;
        self.last_ms = super::producer_clock_ms();
        self.receipts.push_back((p.seq, next));
        while self.receipts.len() > RECEIPT_WINDOW {
            self.receipts.pop_front();
        }
    }
}

/// What a producer's `(epoch, seq)` means against the stored state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ProducerCheck {
    /// Admit the append.
    Accept,
    /// Already admitted: answer as a duplicate.
    Duplicate { last_seq: u64, next: Option<u64> },
    /// The epoch is older than the stored one.
    StaleEpoch { current: u64 },
    /// A new epoch must start at sequence 0.
    NewEpochNotAtZero,
    /// A sequence number was skipped.
    Gap { expected: u64, received: u64 },
}

/// Everything known about one stream; guarded by its `RwLock`.
#[derive(Debug, Clone)]
pub(crate) struct StreamState {
    pub(crate) incarnation: String,
    pub(crate) content_type: String,
    pub(crate) lifetime: Lifetime,
    pub(crate) closed: bool,
    /// The producer tuple whose append closed the stream, for idempotent retries of it.
    pub(crate) closed_by: Option<ProducerTuple>,
    pub(crate) stream_seq: Option<String>,
    pub(crate) producers: HashMap<String, ProducerState>,
    /// What `producers` counts against the producer-bytes budget ([`producer_cost`] each).
    pub(crate) producer_bytes: u64,
    /// Producers that expired, by [`producer_key`]: counted in the stream-state budget
    /// ([`RETIRED_ENTRY_BYTES`] each), not as producers; each against the key that made its
    /// producer ([`Retired::key`]), not against the stream's creator.
    pub(crate) retired: HashMap<u128, Retired>,
    pub(crate) fork: Option<ForkSpec>,
    /// Live forks that read this stream's prefix.
    pub(crate) ref_count: u32,
    /// Deleted while forks still exist: answers 410 until the last fork goes.
    pub(crate) soft_deleted: bool,
    /// Removed (deleted or replaced); holders of the handle must look it up again.
    pub(crate) gone: bool,
    pub(crate) tail: u64,
    /// Its data: sealed extents first, then records not sealed yet.
    pub(crate) chunks: Vec<Chunk>,
    pub(crate) hot_bytes: u64,
    /// What the sealed extents in `chunks` count against the stream-state budget
    /// ([`extent_cost`] each; see [`StreamState::recount_extents`]).
    pub(crate) extent_bytes: u64,
    /// The LSN of the last change applied (data, close, producer state).
    pub(crate) applied_lsn: Lsn,
    /// The LSN of the last change that added data (or of the create): what subscriptions
    /// rescan by, so that a close or a producer-only append is no news to them.
    pub(crate) data_lsn: Lsn,
    /// Producers (by id) and retired producers (by key) added, changed or removed since the
    /// last checkpoint took this stream: what its next delta entry holds of them.
    pub(crate) changed_producers: HashSet<String>,
    pub(crate) changed_retired: HashSet<u128>,
    /// Whether the checkpoints in the store hold this incarnation as it was when last taken
    /// (its sealed extents there are `chunks`' cold ones): its next delta entry may then
    /// hold only what changed. False for a new stream and after a checkpoint that may not
    /// have landed.
    pub(crate) stored: bool,
}

/// Whether a content type (normalized) is a JSON stream's.
pub(crate) fn is_json(content_type: &str) -> bool {
    content_type.split(';').next().map(str::trim) == Some("application/json")
}

impl StreamState {
    pub(crate) fn new(
        incarnation: String,
        content_type: String,
        lifetime: Lifetime,
        fork: Option<ForkSpec>,
        lsn: Lsn,
    ) -> Self {
        StreamState {
            incarnation,
            content_type,
            lifetime,
            closed: false,
            closed_by: None,
            stream_seq: None,
            producers: HashMap::new(),
            producer_bytes: 0,
            retired: HashMap::new(),
            fork,
            ref_count: 0,
            soft_deleted: false,
            gone: false,
            tail: 0,
            chunks: Vec::new(),
            hot_bytes: 0,
            extent_bytes: 0,
            applied_lsn: lsn,
            data_lsn: lsn,
            changed_producers: HashSet::new(),
            changed_retired: HashSet::new(),
            stored: false,
        }
    }

    /// Counts the sealed extents in `chunks` afresh (after they were replaced: loaded,
    /// shared by a fork, sealed or merged by a checkpoint).
    pub(crate) fn recount_extents(&mut self) {
        self.extent_bytes = self
            .chunks
            .iter()
            .map(|c| match c {
                Chunk::Cold(e) => extent_cost(e),
                Chunk::Hot(_) => 0,
            })
            .sum();
    }

    /// Appends a record at the tail.
    pub(crate) fn push(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        let start = self.tail;
        let end = start + data.len() as u64;
        self.hot_bytes += data.len() as u64;
        self.chunks.push(Chunk::Hot(HotRecord { start, end, data }));
        self.tail = end;
    }

    /// The chunks a fork at `offset` shares: every record that ends at or before it.
    pub(crate) fn prefix_chunks(&self, offset: u64) -> Vec<Chunk> {
        let mut out = Vec::new();
        for chunk in &self.chunks {
            match chunk {
                Chunk::Hot(r) if r.end <= offset => out.push(chunk.clone()),
                Chunk::Hot(_) => break,
                Chunk::Cold(c) if c.end <= offset => out.push(chunk.clone()),
                Chunk::Cold(c) if c.start < offset => {
                    // Records of the extent past the offset are dropped when it is read.
                    let mut view = c.clone();
                    view.end = offset;
                    out.push(Chunk::Cold(view));
                    break;
                }
                Chunk::Cold(_) => break,
            }
        }
        out
    }

    /// What the stream's state counts against the stream-state budget, producers and sealed
    /// extents included (its data is bounded by the checkpoint and log budgets instead).
    pub(crate) fn footprint(&self, name: &str) -> u64 {
        let strings = 2 * name.len()
            + self.incarnation.len()
            + self.content_type.len()
            + self.stream_seq.as_ref().map_or(0, String::len)
            + self.fork.as_ref().map_or(0, |f| f.source.len());
        STREAM_ENTRY_BYTES
            + strings as u64
            + self.producer_bytes
            + self.retired.len() as u64 * RETIRED_ENTRY_BYTES
            + self.extent_bytes
    }

    /// What the stream's retired producer records count ([`RETIRED_ENTRY_BYTES`] each).
    pub(crate) fn retired_bytes(&self) -> u64 {
        self.retired.len() as u64 * RETIRED_ENTRY_BYTES
    }

    /// What the keys that made the stream's producers hold of it (their entries and retired
    /// records), to release when the stream goes: taken, so that the keys are released
    /// once however often this runs.
    pub(crate) fn take_key_holdings(&mut self) -> Vec<KeyRelease> {
        let producers = self.producers.iter_mut().filter_map(|(id, p)| {
            Some(KeyRelease {
                key: p.key.take()?,
                state: producer_cost(id),
                producers: producer_cost(id),
            })
        });
        let retired = self
            .retired
            .values_mut()
            .filter_map(|r| r.key.take().map(KeyRelease::retired));
        producers.chain(retired).collect()
    }

    /// Producer `id`'s standing on the stream: its entry, or what is kept of it if it
    /// expired (no receipts: a duplicate then answers without its original offset).
    pub(crate) fn standing(&self, id: &str) -> Option<Cow<'_, ProducerState>> {
        if let Some(state) = self.producers.get(id) {
            return Some(Cow::Borrowed(state));
        }
        if self.retired.is_empty() {
            return None;
        }
        self.retired.get(&producer_key(id)).map(|r| {
            Cow::Owned(ProducerState {
                epoch: r.epoch,
                last_seq: r.last_seq,
                receipts: VecDeque::new(),
                last_ms: 0,
                key: None,
            })
        })
    }

    /// Stream-state bytes a new entry of producer `id` frees as it comes: the retired record
    /// of its earlier life goes then ([`StreamState::apply_append_by`]). `(server, share)`:
    /// the server's stream state gets the record's bytes back, and so does `key`'s share when
    /// `key` made the record. Nothing when `id` has an entry, or no record.
    pub(crate) fn freed_by_new_entry(&self, id: &str, key: Option<&str>) -> (u64, u64) {
        if self.retired.is_empty() || self.producers.contains_key(id) {
            return (0, 0);
        }
        match self.retired.get(&producer_key(id)) {
            Some(record) if key.is_some() && record.key.as_deref() == key => {
                (RETIRED_ENTRY_BYTES, RETIRED_ENTRY_BYTES)
            }
            Some(_) => (RETIRED_ENTRY_BYTES, 0),
            None => (0, 0),
        }
    }

    /// Counts `producers` afresh (after loading them), giving entries without a time
    /// `now_ms`.
    pub(crate) fn recount_producers(&mut self, now_ms: i64) {
        self.producer_bytes = 0;
        for (id, state) in &mut self.producers {
            if state.last_ms == 0 {
                state.last_ms = now_ms;
            }
            self.producer_bytes += producer_cost(id);
        }
    }

    /// Retires producers whose last append was applied before `before_ms` (at `now_ms`):
    /// their entries go, a [`Retired`] record of each stays, at most `max_retired` on the
    /// stream (the oldest retired go first). Returns how many were retired.
    #[cfg(test)]
    pub(crate) fn expire_producers(
        &mut self,
        before_ms: i64,
        now_ms: i64,
        max_retired: usize,
    ) -> usize {
        self.expire_producers_releasing(before_ms, now_ms, max_retired, &mut Vec::new())
    }

    /// [`StreamState::expire_producers`], adding to `released` the key and cost of every
    /// retired entry a key created.
    pub(crate) fn expire_producers_releasing(
        &mut self,
        before_ms: i64,
        now_ms: i64,
        max_retired: usize,
        released: &mut Vec<KeyRelease>,
    ) -> usize {
        let mut freed = 0;
        let mut gone = Vec::new();
        let mut changed = Vec::new();
        self.producers.retain(|id, state| {
            let keep = state.last_ms >= before_ms;
            if !keep {
                let cost = producer_cost(id);
                freed += cost;
                // The key keeps its retired record's bytes, and gets the rest back.
                if let Some(key) = &state.key {
                    released.push(KeyRelease {
                        key: key.clone(),
                        state: cost.saturating_sub(RETIRED_ENTRY_BYTES),
                        producers: cost,
                    });
                }
                changed.push(id.clone());
                gone.push((
                    producer_key(id),
                    Retired {
                        epoch: state.epoch,
                        last_seq: state.last_seq,
                        at_ms: now_ms,
                        key: state.key.take(),
                    },
                ));
            }
            keep
        });
        self.producer_bytes -= freed;
        self.changed_producers.extend(changed);
        let count = gone.len();
        for (key, record) in gone {
            self.changed_retired.insert(key);
            // A record under the same key (loaded beside the entry it came back as) is
            // replaced: its key gets its bytes back.
            if let Some(old) = self.retired.insert(key, record) {
                released.extend(old.release());
            }
        }
        if self.retired.len() > max_retired {
            let mut by_age: Vec<(i64, u128)> =
                self.retired.iter().map(|(k, r)| (r.at_ms, *k)).collect();
            by_age.sort_unstable();
            let excess = self.retired.len() - max_retired;
            for (_, key) in by_age.into_iter().take(excess) {
                self.drop_retired(key, released);
            }
        }
        count
    }

    /// Drops retired record `key`; the key that made its producer gets its bytes back.
    fn drop_retired(&mut self, key: u128, released: &mut Vec<KeyRelease>) {
        if let Some(record) = self.retired.remove(&key) {
            self.changed_retired.insert(key);
            released.extend(record.release());
        }
    }

    /// Makes room in `key`'s share for a new producer (`keep`: its id's [`producer_key`]) by
    /// dropping the oldest retired records on this stream of producers `key` made, as many
    /// as free `need` bytes, never `keep`'s own: only `key`'s own producers lose what told a
    /// retry of their old appends from a new append. Drops none when they could not free
    /// `need`. Adds what `key` gets back to `released`; returns how many went.
    pub(crate) fn evict_retired_of(
        &mut self,
        key: &str,
        keep: u128,
        need: u64,
        released: &mut Vec<KeyRelease>,
    ) -> usize {
        let Some(count) = self.retired_to_evict(key, keep, need) else {
            return 0;
        };
        let mut own: Vec<(i64, u128)> = self
            .retired
            .iter()
            .filter(|(k, r)| **k != keep && r.key.as_deref() == Some(key))
            .map(|(k, r)| (r.at_ms, *k))
            .collect();
        own.sort_unstable();
        for (_, k) in own.into_iter().take(count) {
            self.drop_retired(k, released);
        }
        count
    }

    /// Whether [`StreamState::evict_retired_of`] would free `need` bytes now.
    pub(crate) fn can_evict_retired_of(&self, key: &str, keep: u128, need: u64) -> bool {
        self.retired_to_evict(key, keep, need).is_some()
    }

    /// How many of `key`'s retired records (never `keep`'s) free `need` bytes, when there
    /// are that many.
    fn retired_to_evict(&self, key: &str, keep: u128, need: u64) -> Option<usize> {
        let count = usize::try_from(need.div_ceil(RETIRED_ENTRY_BYTES)).ok()?;
        let own = self
            .retired
            .iter()
            .filter(|(k, r)| **k != keep && r.key.as_deref() == Some(key))
            .take(count)
            .count();
        (count > 0 && own == count).then_some(count)
    }

    /// Applies an admitted append (or close).
    #[cfg(test)]
    pub(crate) fn apply_append(
        &mut self,
        lsn: Lsn,
        data: Option<Bytes>,
        close: bool,
        producer: Option<ProducerTuple>,
        stream_seq: Option<String>,
    ) {
        self.apply_append_by(lsn, data, close, producer, stream_seq, None);
    }

    /// [`StreamState::apply_append`] of an append `key` asked for: the producer entry it
    /// creates or appends to is `key`'s from now on, and its cost is returned (to count
    /// against `key`'s share), with what stops counting against another key: the retired
    /// record of the producer's earlier life that goes, or the entry's cost when it was
    /// another key's.
    pub(crate) fn apply_append_by(
        &mut self,
        lsn: Lsn,
        data: Option<Bytes>,
        close: bool,
        producer: Option<ProducerTuple>,
        stream_seq: Option<String>,
        key: Option<&Arc<str>>,
    ) -> AppliedBy {
        let mut created = None;
        let mut released = None;
        if let Some(data) = data
            && !data.is_empty()
        {
            self.push(data);
            self.data_lsn = lsn;
        }
        if let Some(p) = &producer {
            let tail = self.tail;
            match self.producers.get_mut(&p.id) {
                Some(state) => {
                    state.record(p, tail);
                    // Another key's append keeps the entry alive: it counts against that
                    // key from now on (admitted against its share as a new entry is).
                    if let Some(key) = key
                        && state.key.as_deref() != Some(&**key)
                    {
                        let cost = producer_cost(&p.id);
                        released = state.key.replace(key.clone()).map(|old| KeyRelease {
                            key: old,
                            state: cost,
                            producers: cost,
                        });
                        created = Some(cost);
                    }
                }
                None => {
                    let mut state = ProducerState::default();
                    state.record(p, tail);
                    if let Some(key) = key {
                        state.key = Some(key.clone());
                        created = Some(producer_cost(&p.id));
                    }
                    self.producers.insert(p.id.clone(), state);
                    self.producer_bytes += producer_cost(&p.id);
                    if !self.retired.is_empty() {
                        let key = producer_key(&p.id);
                        if let Some(record) = self.retired.remove(&key) {
                            self.changed_retired.insert(key);
                            released = record.release();
                        }
                    }
                }
            }
            if !self.changed_producers.contains(&p.id) {
                self.changed_producers.insert(p.id.clone());
            }
        }
        if let Some(seq) = stream_seq {
            self.stream_seq = Some(seq);
        }
        if close && !self.closed {
            self.closed = true;
            self.closed_by = producer;
        }
        self.applied_lsn = lsn;
        AppliedBy { created, released }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(s: &StreamState, p: &ProducerTuple) -> ProducerCheck {
        ProducerState::check(s.producers.get(&p.id), p)
    }

    fn tuple(epoch: u64, seq: u64) -> ProducerTuple {
        ProducerTuple {
            id: "p".into(),
            epoch,
            seq,
        }
    }

    #[test]
    fn producer_rules() {
        let mut s = StreamState::new(
            "i".into(),
            "text/plain".into(),
            Lifetime::default(),
            None,
            1,
        );
        assert_eq!(
            check(&s, &tuple(0, 1)),
            ProducerCheck::Gap {
                expected: 0,
                received: 1
            }
        );
        assert_eq!(check(&s, &tuple(0, 0)), ProducerCheck::Accept);
        s.apply_append(
            2,
            Some(Bytes::from_static(b"ab")),
            false,
            Some(tuple(0, 0)),
            None,
        );
        s.apply_append(
            3,
            Some(Bytes::from_static(b"cd")),
            false,
            Some(tuple(0, 1)),
            None,
        );
        assert_eq!(
            check(&s, &tuple(0, 0)),
            ProducerCheck::Duplicate {
                last_seq: 1,
                next: Some(2)
            }
        );
        assert_eq!(
            check(&s, &tuple(0, 3)),
            ProducerCheck::Gap {
                expected: 2,
                received: 3
            }
        );
        assert_eq!(check(&s, &tuple(1, 1)), ProducerCheck::NewEpochNotAtZero);
        s.apply_append(
            4,
            Some(Bytes::from_static(b"e")),
            false,
            Some(tuple(1, 0)),
            None,
        );
        assert_eq!(
            check(&s, &tuple(0, 2)),
            ProducerCheck::StaleEpoch { current: 1 }
        );
        assert_eq!(s.tail, 5);
    }

    /// Producers are counted as they come and go; only those idle since before the cut
    /// are retired, and a retired one is still known by its last epoch and sequence: a
    /// retry of an append it made is a duplicate (never a second append), it may go on
    /// where it stopped, and the oldest retired go first past the cap.
    #[test]
    fn producers_are_counted_and_retire_only_when_idle() {
        let mut s = StreamState::new(
            "i".into(),
            "text/plain".into(),
            Lifetime::default(),
            None,
            1,
        );
        let base = s.footprint("name");
        s.apply_append(
            2,
            Some(Bytes::from_static(b"a")),
            false,
            Some(tuple(0, 0)),
            None,
        );
        let other = ProducerTuple {
            id: "other".into(),
            epoch: 0,
            seq: 0,
        };
        s.apply_append(
            3,
            Some(Bytes::from_static(b"b")),
            false,
            Some(other.clone()),
            None,
        );
        assert_eq!(
            s.producer_bytes,
            producer_cost("p") + producer_cost("other")
        );
        assert_eq!(s.footprint("name"), base + s.producer_bytes);
        // A producer seen again counts once.
        s.apply_append(
            4,
            Some(Bytes::from_static(b"c")),
            false,
            Some(tuple(0, 1)),
            None,
        );
        assert_eq!(s.producers.len(), 2);
        // "other" idle since long ago, "p" just now: only "other" goes.
        if let Some(o) = s.producers.get_mut("other") {
            o.last_ms = 1;
        }
        let now = super::super::producer_clock_ms();
        assert_eq!(s.expire_producers(now - 60_000, now, 10), 1);
        assert_eq!(s.producer_bytes, producer_cost("p"));
        assert_eq!(
            s.footprint("name"),
            base + producer_cost("p") + RETIRED_ENTRY_BYTES
        );
        assert_eq!(
            check(&s, &tuple(0, 1)),
            ProducerCheck::Duplicate {
                last_seq: 1,
                next: Some(3)
            }
        );
        let standing = |s: &StreamState, t: &ProducerTuple| {
            ProducerState::check(s.standing(&t.id).as_deref(), t)
        };
        // A retry of its last append is a duplicate (offset forgotten), a later one a gap,
        // the next one goes on.
        assert!(!s.producers.contains_key("other"));
        assert_eq!(
            standing(&s, &other),
            ProducerCheck::Duplicate {
                last_seq: 0,
                next: None
            }
        );
        let skip = ProducerTuple {
            seq: 2,
            ..other.clone()
        };
        assert_eq!(
            standing(&s, &skip),
            ProducerCheck::Gap {
                expected: 1,
                received: 2
            }
        );
        let next = ProducerTuple {
            seq: 1,
            ..other.clone()
        };
        assert_eq!(standing(&s, &next), ProducerCheck::Accept);
        s.apply_append(5, Some(Bytes::from_static(b"d")), false, Some(next), None);
        assert!(s.retired.is_empty());
        assert_eq!(s.producers["other"].last_seq, 1);
        // Past the cap, the oldest retired go first.
        for (i, id) in ["x", "y", "z"].into_iter().enumerate() {
            let t = ProducerTuple {
                id: id.into(),
                epoch: 0,
                seq: 0,
            };
            s.apply_append(
                6 + i as u64,
                Some(Bytes::from_static(b"e")),
                false,
                Some(t),
                None,
            );
            if let Some(p) = s.producers.get_mut(id) {
                p.last_ms = 1;
            }
            assert_eq!(s.expire_producers(2, 100 + i as i64, 2), 1);
        }
        assert_eq!(s.retired.len(), 2);
        assert!(!s.retired.contains_key(&producer_key("x")));
        assert!(s.retired.contains_key(&producer_key("z")));
        // Loaded without a time: counted from the load.
        if let Some(p) = s.producers.get_mut("p") {
            p.last_ms = 0;
        }
        s.recount_producers(42);
        assert_eq!(s.producers["p"].last_ms, 42);
        // "p" and "other" (back after its retirement) are live; retired records are not
        // producer bytes.
        assert_eq!(
            s.producer_bytes,
            producer_cost("p") + producer_cost("other")
        );
    }

    /// A keyed producer that retires leaves its retired record counted against its own
    /// key (not the stream's creator): the key gets its entry's cost back but the record's;
    /// the record's bytes come back when the producer returns, when the record is evicted
    /// past the cap, and when the stream goes.
    #[test]
    fn retired_records_count_against_the_key_that_made_the_producer() {
        let key: Arc<str> = Arc::from("w2");
        let mut s = StreamState::new(
            "i".into(),
            "text/plain".into(),
            Lifetime::default(),
            None,
            1,
        );
        let append = |s: &mut StreamState, lsn: u64, id: &str, released: &mut Vec<KeyRelease>| {
            let p = ProducerTuple {
                id: id.into(),
                epoch: 0,
                seq: lsn,
            };
            let applied = s.apply_append_by(lsn, None, false, Some(p), None, Some(&key));
            released.extend(applied.released);
            applied.created
        };
        let mut released = Vec::new();
        for (lsn, id) in [(0, "a"), (1, "b"), (2, "c")] {
            assert_eq!(
                append(&mut s, lsn, id, &mut released),
                Some(producer_cost(id))
            );
        }
        assert!(released.is_empty());
        for p in s.producers.values_mut() {
            p.last_ms = 1;
        }
        // All three retire; the cap keeps two records: the third's bytes come back whole.
        assert_eq!(s.expire_producers_releasing(2, 100, 2, &mut released), 3);
        let back = |released: &[KeyRelease]| {
            released.iter().fold((0, 0), |(st, pr), r| {
                assert_eq!(&*r.key, "w2");
                (st + r.state, pr + r.producers)
            })
        };
        let costs: u64 = ["a", "b", "c"].iter().map(|id| producer_cost(id)).sum();
        assert_eq!(back(&released), (costs - 2 * RETIRED_ENTRY_BYTES, costs));
        assert!(s.retired.values().all(|r| r.key.as_deref() == Some("w2")));
        assert_eq!(s.retired_bytes(), 2 * RETIRED_ENTRY_BYTES);
        // What the key still holds of the stream: its two records.
        assert_eq!(
            back(&s.clone().take_key_holdings()),
            (2 * RETIRED_ENTRY_BYTES, 0)
        );
        // One comes back: its record's bytes are released, its new entry counted as created.
        let kept = s.retired.keys().next().copied().unwrap();
        let id = ["a", "b", "c"]
            .into_iter()
            .find(|id| producer_key(id) == kept)
            .unwrap();
        released.clear();
        assert_eq!(
            append(&mut s, 9, id, &mut released),
            Some(producer_cost(id))
        );
        assert_eq!(back(&released), (RETIRED_ENTRY_BYTES, 0));
        // Taken when the stream goes: released once, however often it is taken.
        assert_eq!(
            back(&s.take_key_holdings()),
            (producer_cost(id) + RETIRED_ENTRY_BYTES, producer_cost(id))
        );
        assert_eq!(s.take_key_holdings(), Vec::new());
    }

    /// A key out of room drops its own oldest retired records on the stream, as many as it
    /// needs and never the record of the producer it makes room for; none when its records
    /// there cannot free what it needs, and never another key's.
    #[test]
    fn a_key_evicts_only_its_own_oldest_retired_records() {
        let mut s = StreamState::new(
            "i".into(),
            "text/plain".into(),
            Lifetime::default(),
            None,
            1,
        );
        let (w1, w2): (Arc<str>, Arc<str>) = (Arc::from("w1"), Arc::from("w2"));
        for (at, id, key) in [
            (1, "old", &w1),
            (2, "other", &w2),
            (3, "mid", &w1),
            (4, "new", &w1),
        ] {
            s.retired.insert(
                producer_key(id),
                Retired {
                    epoch: 0,
                    last_seq: 0,
                    at_ms: at,
                    key: Some(key.clone()),
                },
            );
        }
        let mut released = Vec::new();
        // Three records' worth is more than w1's two others ("new" is kept): none go.
        let keep = producer_key("new");
        assert_eq!(
            s.evict_retired_of("w1", keep, 2 * RETIRED_ENTRY_BYTES + 1, &mut released),
            0
        );
        assert_eq!((s.retired.len(), released.len()), (4, 0));
        // One record's worth: w1's oldest goes, and w1 gets its bytes back.
        assert_eq!(s.evict_retired_of("w1", keep, 1, &mut released), 1);
        assert!(!s.retired.contains_key(&producer_key("old")));
        assert!(s.changed_retired.contains(&producer_key("old")));
        assert_eq!(released, vec![KeyRelease::retired(w1.clone())]);
        // Then the next oldest of w1's; w2's older record stays.
        assert_eq!(s.evict_retired_of("w1", keep, 1, &mut released), 1);
        assert!(!s.retired.contains_key(&producer_key("mid")));
        assert!(s.retired.contains_key(&producer_key("other")));
        assert!(s.retired.contains_key(&keep));
        assert_eq!(s.evict_retired_of("w1", keep, 1, &mut released), 0);
    }

    #[test]
    fn prefix_takes_whole_records_up_to_the_offset() {
        let mut s = StreamState::new(
            "i".into(),
            "text/plain".into(),
            Lifetime::default(),
            None,
            1,
        );
        s.push(Bytes::from_static(b"abc"));
        s.push(Bytes::from_static(b"de"));
        assert_eq!(s.prefix_chunks(3).len(), 1);
        assert_eq!(s.prefix_chunks(4).len(), 1);
        assert_eq!(s.prefix_chunks(5).len(), 2);
        assert_eq!(s.prefix_chunks(0).len(), 0);
    }
}
