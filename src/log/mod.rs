//! The commit log: every acknowledged write, durable before its answer.
//!
//! Records are appended to segment files under one directory. Each record is framed with its
//! length and a CRC32C, and carries a log sequence number ([`Lsn`]) that orders all writes of
//! the server. One writer thread takes every pending append, writes them together and covers
//! them with one `fdatasync` (group commit); an append returns its LSN only after the sync that
//! covers it. Under [`Durability::ObjectStore`] the group is instead written to the object
//! store as one object (`log::remote`) before any append in it returns, and the local segments are
//! only a cache. Under [`Durability::Fsync`], if tasks woken from outside the workers of the
//! runtime that opened the log are still queued when a sync ends (the workers are behind), the
//! next group is held back until they are taken, for about a millisecond at most, so that
//! groups grow with load instead of costing a sync per few appends
//! (`hold_while_workers_are_behind`).
//!
//! On open, the log is scanned from its first segment. A record that is torn or fails its
//! checksum is a torn tail, and is cut off, only when nothing acknowledged can follow it: it
//! is in the last segment, and no complete group follows it (the last record of every group
//! carries a group-end mark, and a group is written only after the one before it was synced,
//! so a valid record after a later group end proves that the damaged record was
//! acknowledged). Anything else stops the open with [`LogError::Corrupt`], naming the segment
//! and offset: acknowledged data is never dropped silently (`sluice repair` moves the damaged
//! part aside). A cut torn tail is kept too, in `{segment}.torn-{offset}` beside the segment
//! (an operator may delete these files). The records found are handed back for replay.
//!
//! Segments are released by the log's consumers (tables, streams), declared when the log is
//! opened ([`LogConfig::consumers`]): a segment is deleted only once every declared consumer
//! has made all its records durable elsewhere ([`LogConsumer::release_before`]), so one
//! consumer can never release what another still needs, whatever order they start in.
//!
//! LSNs only grow. A node starting a new ownership epoch moves the log on to the epoch's first
//! LSN ([`CommitLog::advance_to`]), in a new segment, so that records of different epochs
//! never share an LSN.
//!
//! Frame layout (little endian):
//!
//! ```text
//! | len: u32 | crc32c: u32 | kind: u8 | lsn: u64 | payload: len bytes |
//! ```
//! The CRC covers kind, lsn and payload. The kind byte's top bit marks the last record of a
//! group commit.

mod remote;
mod segment;

use std::collections::HashMap;
use std::fs;
use std::io::{self, IoSlice};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::error::{Cause, Classify, ErrorClass, Kind};
pub(crate) use remote::{RemoteLog, recover as recover_remote};
use segment::{Segment, SegmentScan};

/// A log sequence number: the position of a record in the log, starting at 1.
pub type Lsn = u64;

/// Bytes of a frame header: length, CRC, kind, LSN.
pub(crate) const FRAME_HEADER_BYTES: usize = 4 + 4 + 1 + 8;

/// The largest payload one record may carry.
pub(crate) const MAX_RECORD_BYTES: usize = 256 << 20;

/// What a record holds; the payload's format belongs to the module that wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RecordKind {
    /// A table batch: table id and Arrow IPC bytes.
    TableBatch = 1,
    /// A stream append: stream id, bytes, producer and `Stream-Seq` state.
    StreamAppend = 2,
    /// A metadata change (stream create, close, delete).
    Metadata = 3,
}

/// The kind byte's flag on the last record of a group commit.
pub(crate) const GROUP_END: u8 = 0x80;

impl RecordKind {
    fn from_byte(b: u8) -> Option<RecordKind> {
        match b & !GROUP_END {
            1 => Some(RecordKind::TableBatch),
            2 => Some(RecordKind::StreamAppend),
            3 => Some(RecordKind::Metadata),
            _ => None,
        }
    }
}

/// One record read back from the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its position.
    pub lsn: Lsn,
    /// What it holds.
    pub kind: RecordKind,
    /// Its bytes.
    pub payload: Vec<u8>,
}

/// When appends are made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// `fdatasync` once per group of appends, before any of them is acknowledged (default).
    #[default]
    Fsync,
    /// Never sync: the OS writes the data back when it likes. A machine crash or power loss
    /// loses acknowledged writes. Unsafe; for tests and throwaway data only.
    None,
    /// Each group is written to the object store as one object before any of it is
    /// acknowledged (`log::remote`); local segments are a cache and are not synced. Needs a
    /// remote log attached (`CommitLog::attach_remote`) before the first append.
    ObjectStore,
}

/// A place where a test can make the log fail, to exercise crash and fault handling
/// deterministically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailPoint {
    /// Before a group's records are written.
    BeforeWrite,
    /// After a group is written, before it is synced.
    BeforeSync,
}

/// Decides, at each [`FailPoint`], whether the log fails there with an I/O error.
#[cfg(feature = "testing")]
pub type FailHook = Arc<dyn Fn(FailPoint) -> Option<io::Error> + Send + Sync>;

/// Settings of a commit log.
#[derive(Clone)]
pub struct LogConfig {
    /// Directory of the segment files.
    pub dir: PathBuf,
    /// A segment is closed and a new one started past this size.
    pub segment_bytes: u64,
    /// Whether new segments are preallocated to `segment_bytes` when groups are synced (the
    /// default), so that a sync carries only data. Off only to measure what it saves.
    pub preallocate: bool,
    /// When appends are synced.
    pub durability: Durability,
    /// Appends are refused with [`LogError::Full`] while the log's files hold more than this.
    pub max_log_bytes: u64,
    /// Failure injection for tests.
    #[cfg(feature = "testing")]
    pub fail_hook: Option<FailHook>,
    /// The consumers that release the log (see [`CommitLog::consumer`]); a segment is
    /// deleted only when every one of them has released it. Empty: only
    /// [`CommitLog::truncate_before`] deletes segments.
    pub consumers: Vec<String>,
    /// Records what the log's syncs made durable, for simulated power loss (tests).
    #[cfg(feature = "testing")]
    pub journal: Option<Arc<crate::storage::journal::SyncJournal>>,
}

impl LogConfig {
    /// Defaults: 64 MiB segments, fsync per group, 4 GiB log budget, no consumers, no
    /// failure injection.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        LogConfig {
            dir: dir.into(),
            segment_bytes: 64 << 20,
            preallocate: true,
            durability: Durability::Fsync,
            max_log_bytes: 4 << 30,
            #[cfg(feature = "testing")]
            fail_hook: None,
            consumers: Vec::new(),
            #[cfg(feature = "testing")]
            journal: None,
        }
    }

    /// How much of a new segment to preallocate: the segment size when groups are synced (so
    /// that a sync carries only data), nothing otherwise.
    fn preallocate_bytes(&self) -> u64 {
        match self.durability {
            Durability::Fsync if self.preallocate => self.segment_bytes,
            _ => 0,
        }
    }

    /// The error a test injects at `point`, if any.
    fn fail_at(&self, point: FailPoint) -> Option<io::Error> {
        #[cfg(feature = "testing")]
        if let Some(hook) = &self.fail_hook {
            return hook(point);
        }
        let _ = point;
        None
    }

    /// The journal of syncs, when a test simulates power loss.
    fn journal(&self) -> Option<&crate::storage::journal::SyncJournal> {
        #[cfg(feature = "testing")]
        return self.journal.as_deref();
        #[cfg(not(feature = "testing"))]
        None
    }
}

impl std::fmt::Debug for LogConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogConfig")
            .field("dir", &self.dir)
            .field("segment_bytes", &self.segment_bytes)
            .field("durability", &self.durability)
            .field("max_log_bytes", &self.max_log_bytes)
            .field("consumers", &self.consumers)
            .finish_non_exhaustive()
    }
}

/// Bits of an LSN below the epoch.
pub(crate) const EPOCH_SHIFT: u32 = 48;

/// The first LSN of an epoch.
pub(crate) fn lsn_base(epoch: u64) -> Lsn {
    epoch << EPOCH_SHIFT
}

/// The epoch whose LSN space holds `lsn`.
pub(crate) fn epoch_of(lsn: Lsn) -> u64 {
    lsn >> EPOCH_SHIFT
}

/// Why the log could not open or append.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A file operation failed.
    #[error("commit log I/O error on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A record before the tail fails its checksum: acknowledged data is damaged.
    #[error(
        "commit log segment {path} is corrupt at byte {offset}, before its tail; refusing to drop acknowledged data (`sluice repair` moves the damaged part aside)"
    )]
    Corrupt {
        /// The segment.
        path: PathBuf,
        /// Offset of the bad record.
        offset: u64,
    },
    /// The log holds more bytes than its budget; retry once flushes have freed segments.
    #[error("commit log is full ({bytes} bytes on disk, budget {budget}); retry later")]
    Full {
        /// Bytes in the log's files.
        bytes: u64,
        /// The budget.
        budget: u64,
    },
    /// A payload over `MAX_RECORD_BYTES`.
    #[error("record of {0} bytes is larger than the commit log accepts")]
    RecordTooLarge(usize),
    /// An earlier write or sync failed; after a failed sync the page cache cannot be trusted,
    /// so the log refuses appends until it is reopened.
    #[error("commit log is unavailable after an earlier I/O failure; restart to recover")]
    Poisoned,
    /// The log was closed (nothing was written).
    #[error("commit log is closed")]
    Closed,
    /// The writer stopped without answering an append it had taken: the record may be in
    /// the log after a restart.
    #[error("commit log writer stopped before answering")]
    WriterGone,
    /// This node no longer owns its log: another process claimed its node id.
    #[error("this node was fenced: another process took over its node id; nothing more is written")]
    Fenced,
    /// The node could not renew its lease in time, so it acknowledges nothing until it has:
    /// another node may be taking its log over. Nothing was written.
    #[error("this node could not renew its lease in the object store; retry shortly")]
    LeaseExpired,
    /// The group was written, but the node's lease ran out while it was being written (a
    /// very slow store, or a paused process): another node may have taken the log over
    /// meanwhile, so whether the write counts is unknown.
    #[error(
        "this node's lease ran out while the write was in flight; it may or may not have been applied"
    )]
    LeaseLapsed,
    /// The record was decided against the effects of an earlier record (of the same
    /// stream) that the log failed to write, or cannot tell counts: it was not written
    /// either. Nothing was applied; the request may be sent again.
    #[error("an earlier write this one depends on failed; nothing was written")]
    EarlierFailed,
    /// Another process (or another open log in this one) uses the directory.
    #[error("commit log {0} is in use by another sluice process")]
    Locked(PathBuf),
    /// A record asked for by LSN is not in the log's local segments (released, or not
    /// written yet).
    #[error("record {0} is not in the commit log")]
    NotInLog(Lsn),
    /// A consumer that was not declared when the log was opened.
    #[error("commit log consumer {0:?} was not declared when the log was opened")]
    UnknownConsumer(String),
}

impl Classify for LogError {
    fn class(&self) -> ErrorClass {
        match self {
            LogError::Full { .. } => ErrorClass::retry(Cause::LogDiskPressure),
            // A write failed: the log takes nothing more until the server restarts.
            LogError::Poisoned => ErrorClass {
                retry_after: None,
                ..ErrorClass::retry(Cause::LogUnavailable)
            },
            LogError::Closed => ErrorClass::retry(Cause::ShuttingDown),
            LogError::LeaseExpired => ErrorClass::retry(Cause::LeaseExpired),
            // Refused unwritten: its premise, an earlier write, failed.
            LogError::EarlierFailed => ErrorClass::retry(Cause::EarlierWriteFailed),
            LogError::LeaseLapsed => ErrorClass::unknown(Kind::Unavailable),
            LogError::Fenced => ErrorClass {
                retry_after: None,
                ..ErrorClass::retry(Cause::Fenced)
            },
            LogError::RecordTooLarge(_) => ErrorClass::rejected(Kind::TooLarge),
            // A write or sync that failed, or a writer that stopped without answering: the
            // record may be in the log after a restart.
            LogError::Io { .. } | LogError::WriterGone => ErrorClass::unknown(Kind::Internal),
            LogError::Corrupt { .. }
            | LogError::Locked(_)
            | LogError::UnknownConsumer(_)
            | LogError::NotInLog(_) => ErrorClass::rejected(Kind::Internal),
        }
    }
}

impl LogError {
    fn io(path: &Path, source: io::Error) -> Self {
        LogError::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// Counters of the log's work, for metrics and benches.
#[derive(Debug, Default)]
pub struct LogStats {
    /// Records appended.
    pub records: AtomicU64,
    /// Groups written (one sync each under [`Durability::Fsync`]).
    pub groups: AtomicU64,
    /// Syncs issued.
    pub syncs: AtomicU64,
    /// Total nanoseconds spent in syncs.
    pub sync_nanos: AtomicU64,
    /// Segments closed because they were full (or an epoch began).
    pub segments_rolled: AtomicU64,
    /// Segments deleted once every consumer released them.
    pub segments_deleted: AtomicU64,
    /// Groups held back while the runtime's workers were behind.
    pub groups_held: AtomicU64,
}

impl LogStats {
    /// Counts one sync (an `fdatasync`, or a group written to the object store) begun at
    /// `started`.
    fn count_sync(&self, started: Instant) {
        let elapsed = started.elapsed().min(Duration::from_secs(3600));
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.sync_nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
    }
}

/// Work to run on the writer thread once a record is durable, before it is acknowledged.
pub(crate) type ApplyFn = Box<dyn FnOnce(Lsn) + Send>;

/// Records that were decided one after another, each against the effects of the ones before
/// it, and submitted before those were durable (a stream's pipelined appends). Once the log
/// fails one of them (does not write it, or cannot tell whether it counts), it writes none
/// of the later ones: they fail with [`LogError::EarlierFailed`], so the log never holds a
/// record whose premise it lacks.
///
/// The writer takes records in the order they were submitted, so by the time it reaches a
/// record, every record of its chain submitted before it has been written (and applied) or
/// has broken the chain.
#[derive(Debug, Default)]
pub(crate) struct Chain {
    broken: AtomicBool,
}

impl Chain {
    /// Whether a record of the chain failed: nothing submitted on it since will be written.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }
}

/// A record handed to the writer: [`Submitted::durable`] waits for its outcome.
#[derive(Debug)]
pub(crate) struct Submitted(oneshot::Receiver<Result<Lsn, LogError>>);

impl Submitted {
    /// Waits until the record is durable (and applied); returns its LSN.
    pub(crate) async fn durable(self) -> Result<Lsn, LogError> {
        self.0.await.map_err(|_| LogError::WriterGone)?
    }
}

struct Append {
    kind: RecordKind,
    payload: Vec<u8>,
    apply: Option<ApplyFn>,
    chain: Option<Arc<Chain>>,
    done: oneshot::Sender<Result<Lsn, LogError>>,
}

impl Append {
    /// Whether an earlier record of its chain failed.
    fn chain_broken(&self) -> bool {
        self.chain.as_deref().is_some_and(Chain::is_broken)
    }

    /// Answers `error`: the record is not acknowledged (not written, or not known to count).
    /// No later record of its chain is written.
    fn fail(self, error: LogError) {
        if let Some(chain) = &self.chain {
            chain.broken.store(true, Ordering::Release);
        }
        let _ = self.done.send(Err(error));
    }
}

enum Msg {
    Append(Append),
    /// Continue at this LSN (at least), in a new segment.
    Advance(Lsn, oneshot::Sender<Result<Lsn, LogError>>),
    /// Finish the appends before this message, then stop.
    Close,
}

struct Shared {
    config: LogConfig,
    /// Closed segments: (first LSN, path, size), oldest first.
    closed: Mutex<Vec<(Lsn, PathBuf, u64)>>,
    /// Bytes in all segment files.
    bytes: AtomicU64,
    /// First LSN of the active segment: where the last closed segment ends.
    active_first: AtomicU64,
    /// The last durable (and applied) LSN.
    last_lsn: AtomicU64,
    poisoned: AtomicBool,
    closing: AtomicBool,
    fenced: AtomicBool,
    /// The directory's lock, released when the log closes.
    lock: Mutex<Option<fs::File>>,
    stats: LogStats,
    /// For each consumer, the LSN below which it needs no record any more.
    consumers: Mutex<HashMap<String, Lsn>>,
    /// The object-store copy, under [`Durability::ObjectStore`].
    remote: std::sync::OnceLock<Arc<RemoteLog>>,
    /// Until when (nanoseconds after `opened`) the node's lease lets it acknowledge writes
    /// (only with a remote log).
    lease_until: AtomicU64,
    /// How long past `lease_until` a group may still be acknowledged once written: the rest
    /// of the lease (nanoseconds). A takeover waits a whole lease from the last renewal.
    lease_slack: AtomicU64,
    opened: Instant,
}

/// The commit log. Cheap to clone; appends from any task are grouped by one writer thread.
#[derive(Clone)]
pub struct CommitLog {
    tx: mpsc::UnboundedSender<Msg>,
    shared: Arc<Shared>,
    writer: Arc<Mutex<Option<thread::JoinHandle<()>>>>,
}

impl std::fmt::Debug for CommitLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommitLog")
            .field("config", &self.shared.config)
            .finish()
    }
}

impl CommitLog {
    /// Opens (or creates) the log in `config.dir`, repairs a torn tail, and returns the log
    /// and every record in it, in LSN order, for replay.
    pub fn open(config: LogConfig) -> Result<(CommitLog, Vec<Record>), LogError> {
        fs::create_dir_all(&config.dir).map_err(|e| LogError::io(&config.dir, e))?;
        // One process at a time: the lock lives until the log is closed (or the process ends).
        let lock_path = config.dir.join("LOCK");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| LogError::io(&lock_path, e))?;
        // A lock just released may still be held for a moment by a copy of its descriptor
        // in a child process between its fork and its exec (close-on-exec closes it then):
        // wait out that moment before calling the directory in use.
        let mut attempts = 0;
        while lock.try_lock().is_err() {
            attempts += 1;
            if attempts > 20 {
                return Err(LogError::Locked(config.dir.clone()));
            }
            thread::sleep(std::time::Duration::from_millis(50));
        }
        let mut paths = segment::list(&config.dir)?;
        let mut records = Vec::new();
        let mut closed = Vec::new();
        let mut next_lsn: Lsn = 1;
        let mut total_bytes = 0u64;
        let last_index = paths.len().checked_sub(1);
        let mut last_len = 0;
        for (i, (first_lsn, path)) in paths.iter().enumerate() {
            let SegmentScan {
                valid_len,
                written_len,
                file_len,
                complete_group_after,
            } = segment::scan(path, &mut records, next_lsn.max(*first_lsn))?;
            let last = Some(i) == last_index;
            // Only the last segment may end in unwritten (zero) space: every other one was cut
            // to its records, durably, before the log moved on.
            let end = if last { written_len } else { file_len };
            if valid_len < end {
                if !last || complete_group_after {
                    return Err(LogError::Corrupt {
                        path: path.clone(),
                        offset: valid_len,
                    });
                }
                // A torn tail: the crash came mid-write, and nothing past it was acknowledged.
                // The cut bytes are kept beside the segment all the same.
                let (aside, bytes) =
                    segment::cut_keeping_tail(path, valid_len, "torn", config.journal())?;
                tracing::warn!(
                    segment = %path.display(),
                    offset = valid_len,
                    bytes,
                    kept_in = %aside.display(),
                    "cut a torn tail off the commit log (an unacknowledged write the crash interrupted)"
                );
            }
            if let Some(journal) = config.journal() {
                journal.existing(path, valid_len);
            }
            // The log reaches at least the start of its newest segment, also when that segment
            // holds no record yet (a start that moved the log on to its epoch's first LSN and
            // wrote nothing): `records` is every segment's so far, so its last record may be
            // an earlier segment's.
            next_lsn = next_lsn.max(*first_lsn);
            if let Some(last) = records.last() {
                next_lsn = next_lsn.max(last.lsn + 1);
            }
            total_bytes += valid_len;
            if Some(i) != last_index {
                closed.push((*first_lsn, path.clone(), valid_len));
            } else {
                last_len = valid_len;
            }
        }
        // Continue in the last segment, or start the first one.
        let preallocate = config.preallocate_bytes();
        let active = match paths.pop() {
            Some((first_lsn, path)) => {
                Segment::open_append(&path, first_lsn, last_len, preallocate, config.journal())?
            }
            None => Segment::create(&config.dir, next_lsn, preallocate, config.journal())?,
        };
        if config.durability == Durability::Fsync {
            segment::sync_dir(&config.dir, config.journal())?;
        }
        // Every declared consumer starts needing the whole log.
        let consumers: HashMap<String, Lsn> =
            config.consumers.iter().map(|c| (c.clone(), 0)).collect();
        let shared = Arc::new(Shared {
            config,
            closed: Mutex::new(closed),
            bytes: AtomicU64::new(total_bytes),
            active_first: AtomicU64::new(active.first_lsn()),
            last_lsn: AtomicU64::new(next_lsn - 1),
            poisoned: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            fenced: AtomicBool::new(false),
            lock: Mutex::new(Some(lock)),
            stats: LogStats::default(),
            consumers: Mutex::new(consumers),
            remote: std::sync::OnceLock::new(),
            lease_until: AtomicU64::new(0),
            lease_slack: AtomicU64::new(0),
            opened: Instant::now(),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let writer_shared = shared.clone();
        let writer = thread::Builder::new()
            .name("sluice-log-writer".into())
            .spawn({
                // The runtime the log is opened on runs the tasks that append to it.
                let runtime = tokio::runtime::Handle::try_current()
                    .ok()
                    .map(|handle| handle.metrics());
                move || writer_loop(writer_shared, rx, active, next_lsn, runtime)
            })
            .map_err(|e| LogError::io(&shared.config.dir, e))?;
        Ok((
            CommitLog {
                tx,
                shared,
                writer: Arc::new(Mutex::new(Some(writer))),
            },
            records,
        ))
    }

    /// Appends one record and waits until it is durable; returns its LSN.
    ///
    /// Fails with nothing applied when the log is over its byte budget
    /// ([`LogError::Full`], retryable) or poisoned by an earlier I/O failure. A failed write or
    /// sync answers an error for every append of its group: those records may or may not be in
    /// the log after a restart, but none is half-written.
    pub async fn append(&self, kind: RecordKind, payload: Vec<u8>) -> Result<Lsn, LogError> {
        self.submit(kind, payload, None, None)?.durable().await
    }

    /// Appends one record and, once it is durable, runs `apply` with its LSN on the writer
    /// thread before acknowledging it.
    ///
    /// `apply` calls run in LSN order across all appenders, so state built by them (a table's
    /// unflushed batches, a stream's tail) always holds a gap-free prefix of the log. `apply`
    /// must be quick and must not block: it holds up every append behind it.
    pub(crate) async fn append_applied(
        &self,
        kind: RecordKind,
        payload: Vec<u8>,
        apply: impl FnOnce(Lsn) + Send + 'static,
    ) -> Result<Lsn, LogError> {
        self.submit(kind, payload, Some(Box::new(apply)), None)?
            .durable()
            .await
    }

    /// [`CommitLog::append_applied`] in two steps: hands the record to the writer now, on
    /// `chain` (see [`Chain`]), and returns what waits for its outcome. Records are written
    /// in the order of their submissions, so a caller that submits under a lock orders its
    /// records by that lock without holding it until they are durable.
    pub(crate) fn submit_chained(
        &self,
        kind: RecordKind,
        payload: Vec<u8>,
        apply: impl FnOnce(Lsn) + Send + 'static,
        chain: Arc<Chain>,
    ) -> Result<Submitted, LogError> {
        self.submit(kind, payload, Some(Box::new(apply)), Some(chain))
    }

    /// Blocking [`CommitLog::append`], for callers outside an async runtime.
    pub fn append_blocking(&self, kind: RecordKind, payload: Vec<u8>) -> Result<Lsn, LogError> {
        self.submit(kind, payload, None, None)?
            .0
            .blocking_recv()
            .map_err(|_| LogError::WriterGone)?
    }

    fn submit(
        &self,
        kind: RecordKind,
        payload: Vec<u8>,
        apply: Option<ApplyFn>,
        chain: Option<Arc<Chain>>,
    ) -> Result<Submitted, LogError> {
        if payload.len() > MAX_RECORD_BYTES {
            return Err(LogError::RecordTooLarge(payload.len()));
        }
        if self.shared.closing.load(Ordering::Acquire) {
            return Err(LogError::Closed);
        }
        if self.shared.poisoned.load(Ordering::Acquire) {
            return Err(LogError::Poisoned);
        }
        if self.shared.fenced.load(Ordering::Acquire) {
            return Err(LogError::Fenced);
        }
        let bytes = self.shared.bytes.load(Ordering::Acquire);
        if bytes > self.shared.config.max_log_bytes {
            return Err(LogError::Full {
                bytes,
                budget: self.shared.config.max_log_bytes,
            });
        }
        let (done, rx) = oneshot::channel();
        self.tx
            .send(Msg::Append(Append {
                kind,
                payload,
                apply,
                chain,
                done,
            }))
            .map_err(|_| LogError::Closed)?;
        Ok(Submitted(rx))
    }

    /// The handle of a consumer declared in [`LogConfig::consumers`]. Segments are deleted
    /// only below the position every declared consumer has released; each starts needing
    /// everything from the first record on.
    pub fn consumer(&self, name: &str) -> Result<LogConsumer, LogError> {
        let consumers = self
            .shared
            .consumers
            .lock()
            .map_err(|_| LogError::Poisoned)?;
        if !consumers.contains_key(name) {
            return Err(LogError::UnknownConsumer(name.to_owned()));
        }
        Ok(LogConsumer {
            log: self.clone(),
            name: name.to_owned(),
        })
    }

    /// Moves the log on so that the next record's LSN is at least `lsn`, starting a new
    /// segment there; returns the next LSN. A node calls it once, before any append, when it
    /// starts a new ownership epoch.
    pub async fn advance_to(&self, lsn: Lsn) -> Result<Lsn, LogError> {
        let (done, rx) = oneshot::channel();
        self.tx
            .send(Msg::Advance(lsn, done))
            .map_err(|_| LogError::Closed)?;
        rx.await.map_err(|_| LogError::WriterGone)?
    }

    /// Attaches the object-store copy every group is written to before it is acknowledged
    /// ([`Durability::ObjectStore`]); call before the first append. `lease` is how long the
    /// first acknowledgements may go on without [`CommitLog::renew_lease`].
    /// A group written by then but whose write ends more than `lease` after it is
    /// answered [`LogError::LeaseLapsed`].
    pub(crate) fn attach_remote(&self, remote: RemoteLog, lease: Duration) {
        let slack = lease.as_nanos().min(u128::from(u64::MAX)) as u64;
        self.shared.lease_slack.store(slack, Ordering::Release);
        self.renew_lease(Instant::now() + lease);
        let _ = self.shared.remote.set(Arc::new(remote));
    }

    /// The object-store copy, if one is attached.
    pub(crate) fn remote(&self) -> Option<&Arc<RemoteLog>> {
        self.shared.remote.get()
    }

    /// Lets the log acknowledge writes until `until` (the node renewed its lease). Under a
    /// remote log, a group that would be written later is refused with
    /// [`LogError::LeaseExpired`].
    pub(crate) fn renew_lease(&self, until: Instant) {
        let nanos = until
            .saturating_duration_since(self.shared.opened)
            .as_nanos()
            .min(u128::from(u64::MAX)) as u64;
        self.shared.lease_until.fetch_max(nanos, Ordering::AcqRel);
    }

    /// Stops all appends for good: this node lost ownership of its log.
    pub fn fence(&self) {
        self.shared.fenced.store(true, Ordering::Release);
    }

    /// Deletes every closed segment whose records all have LSNs below `lsn`: the caller has
    /// made them durable elsewhere. Returns how many segments were deleted. Prefer
    /// [`LogConsumer::release_before`], which respects every consumer.
    pub fn truncate_before(&self, lsn: Lsn) -> Result<usize, LogError> {
        let mut closed = self.shared.closed.lock().map_err(|_| LogError::Poisoned)?;
        let mut deleted = 0;
        // A closed segment ends where the next one begins.
        while !closed.is_empty() {
            let next_first = closed
                .get(1)
                .map_or_else(|| self.shared.active_first.load(Ordering::Acquire), |s| s.0);
            if next_first > lsn {
                break;
            }
            let (_, path, size) = closed.remove(0);
            fs::remove_file(&path).map_err(|e| LogError::io(&path, e))?;
            if let Some(journal) = self.shared.config.journal() {
                journal.removed(&path);
            }
            self.shared
                .stats
                .segments_deleted
                .fetch_add(1, Ordering::Relaxed);
            self.shared.bytes.fetch_sub(size, Ordering::AcqRel);
            deleted += 1;
        }
        drop(closed);
        if let Some(remote) = self.shared.remote.get() {
            remote.release(lsn);
        }
        Ok(deleted)
    }

    /// The last LSN that is durable and applied (0 for an empty log).
    pub fn last_lsn(&self) -> Lsn {
        self.shared.last_lsn.load(Ordering::Acquire)
    }

    /// A reader of records still in the local segments (see [`LogReader`]); `None` when the
    /// local segments are only a cache of an object-store log.
    pub(crate) fn reader(&self) -> Option<LogReader> {
        if self.shared.remote.get().is_some()
            || self.shared.config.durability == Durability::ObjectStore
        {
            return None;
        }
        Some(LogReader {
            shared: self.shared.clone(),
            at: None,
        })
    }

    /// The log's disk budget ([`LogConfig::max_log_bytes`]).
    pub(crate) fn max_bytes(&self) -> u64 {
        self.shared.config.max_log_bytes
    }

    /// Bytes currently in the log's files.
    pub fn disk_bytes(&self) -> u64 {
        self.shared.bytes.load(Ordering::Acquire)
    }

    /// The log's work counters.
    pub fn stats(&self) -> &LogStats {
        &self.shared.stats
    }

    /// Stops the writer after the appends already submitted, and waits for it.
    pub fn close(&self) {
        // Clones keep the channel open, so the writer is told to stop explicitly.
        self.shared.closing.store(true, Ordering::Release);
        let _ = self.tx.send(Msg::Close);
        if let Ok(mut writer) = self.writer.lock()
            && let Some(handle) = writer.take()
        {
            let _ = handle.join();
        }
        if let Ok(mut lock) = self.shared.lock.lock() {
            lock.take();
        }
    }
}

/// Reads records back from the log's local segments, by LSN, moving forward: a table batch
/// whose decoded form left memory is read from here (`crate::table`, "spilled" batches).
///
/// Reads in ascending LSN order cost one buffered pass over the segments they fall in (the
/// records between are skipped by their lengths, small ones within the buffer); a read
/// behind the last one starts its segment over. Only records already applied when the reader
/// was made may be asked for (its buffer may hold the active segment's unwritten zeros past
/// them), and only while some consumer still needs them (the caller keeps them from being
/// released). Each record's checksum is verified again.
pub(crate) struct LogReader {
    shared: Arc<Shared>,
    /// The segment read last: its first LSN, its file, and the offset and LSN of the next
    /// record in it.
    at: Option<ReaderAt>,
}

struct ReaderAt {
    first_lsn: Lsn,
    path: PathBuf,
    file: io::BufReader<fs::File>,
    offset: u64,
    next_lsn: Lsn,
}

/// Buffer of a [`LogReader`]: many small records (stream appends) are skipped within it.
const READER_BUFFER_BYTES: usize = 256 << 10;

impl LogReader {
    /// The record at `lsn`, read from its segment (blocking I/O).
    pub(crate) fn read(&mut self, lsn: Lsn) -> Result<Record, LogError> {
        use std::io::Read as _;
        let first_lsn = self.segment_of(lsn)?;
        let reuse = self
            .at
            .as_ref()
            .is_some_and(|at| at.first_lsn == first_lsn && at.next_lsn <= lsn);
        if !reuse {
            let path = segment::segment_path(&self.shared.config.dir, first_lsn);
            let file = fs::File::open(&path).map_err(|e| LogError::io(&path, e))?;
            self.at = Some(ReaderAt {
                first_lsn,
                path,
                file: io::BufReader::with_capacity(READER_BUFFER_BYTES, file),
                offset: 0,
                next_lsn: first_lsn,
            });
        }
        let Some(at) = self.at.as_mut() else {
            return Err(LogError::Closed);
        };
        let result = (|| loop {
            // A record that is not where the segment says (a short file, another LSN, a bad
            // checksum) is damage; other I/O errors are what they are.
            let damaged = |at: &ReaderAt| LogError::Corrupt {
                path: at.path.clone(),
                offset: at.offset,
            };
            let failed = |at: &ReaderAt, e: io::Error| match e.kind() {
                io::ErrorKind::UnexpectedEof => damaged(at),
                _ => LogError::io(&at.path, e),
            };
            let mut header = [0u8; FRAME_HEADER_BYTES];
            at.file.read_exact(&mut header).map_err(|e| failed(at, e))?;
            let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
            let mut lsn_bytes = [0u8; 8];
            lsn_bytes.copy_from_slice(&header[9..17]);
            let found = Lsn::from_le_bytes(lsn_bytes);
            if len > MAX_RECORD_BYTES || found < at.next_lsn || found > lsn {
                return Err(damaged(at));
            }
            if found < lsn {
                at.file
                    .seek_relative(len as i64)
                    .map_err(|e| failed(at, e))?;
                at.offset += (FRAME_HEADER_BYTES + len) as u64;
                at.next_lsn = found + 1;
                continue;
            }
            let mut frame = vec![0u8; FRAME_HEADER_BYTES + len];
            frame[..FRAME_HEADER_BYTES].copy_from_slice(&header);
            at.file
                .read_exact(&mut frame[FRAME_HEADER_BYTES..])
                .map_err(|e| failed(at, e))?;
            let Some((record, _, _)) = segment::decode_at(&frame, 0) else {
                return Err(damaged(at));
            };
            at.offset += frame.len() as u64;
            at.next_lsn = found + 1;
            return Ok(record);
        })();
        if result.is_err() {
            // Its position is unknown now: the next read starts the segment over.
            self.at = None;
        }
        result
    }

    /// The first LSN of the segment holding `lsn`.
    fn segment_of(&self, lsn: Lsn) -> Result<Lsn, LogError> {
        // (Not checked against `last_lsn`: a record is applied, and may be read, just before
        // `last_lsn` moves past it.)
        if lsn == 0 {
            return Err(LogError::NotInLog(lsn));
        }
        let closed = self.shared.closed.lock().map_err(|_| LogError::Poisoned)?;
        let active_first = self.shared.active_first.load(Ordering::Acquire);
        if lsn >= active_first {
            return Ok(active_first);
        }
        closed
            .iter()
            .rev()
            .find(|(first, _, _)| *first <= lsn)
            .map(|(first, _, _)| *first)
            .ok_or(LogError::NotInLog(lsn))
    }
}

/// What [`repair`] moved aside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovedAside {
    /// The segment that was cut.
    pub segment: PathBuf,
    /// Where it was cut: the damaged record's offset.
    pub offset: u64,
    /// The file now holding the bytes from that offset on.
    pub moved_to: PathBuf,
    /// How many bytes were moved.
    pub bytes: u64,
}

/// Makes a log that refuses to open for corruption open again: each damaged segment is cut at
/// the damaged record, and the bytes from there on are kept in
/// `{segment}.corrupt-{offset}` beside it (for inspection; the log ignores them). The records
/// in those bytes, acknowledged ones included, are not replayed. Returns what was moved.
pub fn repair(dir: &Path) -> Result<Vec<MovedAside>, LogError> {
    let mut moved = Vec::new();
    loop {
        let mut config = LogConfig::new(dir);
        // Repair needs no free space.
        config.preallocate = false;
        match CommitLog::open(config) {
            Ok((log, _)) => {
                log.close();
                return Ok(moved);
            }
            Err(LogError::Corrupt { path, offset }) => {
                let (aside, bytes) = segment::cut_keeping_tail(&path, offset, "corrupt", None)?;
                moved.push(MovedAside {
                    segment: path,
                    offset,
                    moved_to: aside,
                    bytes,
                });
            }
            Err(e) => return Err(e),
        }
    }
}

/// One consumer's handle on the log: it says how much of the log it still needs.
#[derive(Debug, Clone)]
pub struct LogConsumer {
    log: CommitLog,
    name: String,
}

impl LogConsumer {
    /// Says that this consumer needs no record below `lsn` any more (it made them durable
    /// elsewhere), and deletes the segments no consumer needs. Returns how many were deleted.
    pub fn release_before(&self, lsn: Lsn) -> Result<usize, LogError> {
        let floor = {
            let mut consumers = self
                .log
                .shared
                .consumers
                .lock()
                .map_err(|_| LogError::Poisoned)?;
            if let Some(entry) = consumers.get_mut(&self.name) {
                *entry = (*entry).max(lsn);
            }
            consumers.values().copied().min().unwrap_or(0)
        };
        self.log.truncate_before(floor)
    }
}

/// The writer thread: take every waiting append, write them, sync once, answer them all.
fn writer_loop(
    shared: Arc<Shared>,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    mut active: Segment,
    mut next_lsn: Lsn,
    runtime: Option<tokio::runtime::RuntimeMetrics>,
) {
    let mut group: Vec<Append> = Vec::new();
    let mut stop = false;
    // Only syncs are held for: an object-store group's put dwarfs a millisecond, and its
    // client's own tasks are woken from this thread into the queue looked at.
    let pace = runtime.filter(|_| shared.config.durability == Durability::Fsync);
    // Whether tasks were still queued for the runtime's workers when the last group's sync
    // ended (see `hold_while_workers_are_behind`).
    let mut behind = false;
    while !stop {
        let Some(first) = rx.blocking_recv() else {
            break;
        };
        if behind
            && matches!(first, Msg::Append(_))
            && let Some(runtime) = &pace
        {
            hold_while_workers_are_behind(&shared, runtime);
        }
        behind = false;
        let mut next = Some(first);
        let mut advance_to = None;
        while let Some(msg) = next.take().or_else(|| rx.try_recv().ok()) {
            match msg {
                Msg::Append(append) => group.push(append),
                Msg::Advance(lsn, done) => {
                    // Appends before it are written first, in their own group.
                    advance_to = Some((lsn, done));
                    break;
                }
                Msg::Close => {
                    stop = true;
                    break;
                }
            }
        }
        if !group.is_empty() {
            behind = write_and_answer(
                &shared,
                &mut active,
                &mut group,
                &mut next_lsn,
                pace.as_ref(),
            );
        }
        if let Some((lsn, done)) = advance_to {
            let _ = done.send(advance(&shared, &mut active, &mut next_lsn, lsn));
        }
    }
    // A clean stop leaves the segment as long as its records (the next open preallocates
    // again).
    trim_last(&active);
}

/// How long a group is held back for the runtime's workers at most
/// ([`hold_while_workers_are_behind`]).
const HOLD_LIMIT: Duration = Duration::from_millis(1);

/// How often a held group looks at the runtime's queue again.
const HOLD_STEP: Duration = Duration::from_micros(200);

/// Holds the next group back until no task woken from outside the runtime's workers waits
/// for one (the multi-thread runtime's injection queue is empty), for [`HOLD_LIMIT`] at most
/// plus one step's scheduling delay. Called under [`Durability::Fsync`] only, for a group that
/// starts with an append, if tasks were still queued when the last group's sync ended.
///
/// Why: the writer answers each group from its own thread, so the handlers it wakes go to
/// that queue, as do tasks other threads wake (wakes on the workers themselves, from I/O and
/// timers, do not show there). Tasks still queued after a whole write and sync mean the
/// workers are behind: clients whose next appends would join the next group are still
/// waiting for a worker, and a sync started now would carry the few appends that made it.
/// Each sync costs a device round trip and tens of microseconds of CPU (the VM's exits, the
/// completion's interrupt, the wakes), so holding the group while the queue drains lets
/// groups grow with load instead of shrinking as clients are added. When the workers keep
/// up, the queue is empty long before a sync ends, nothing is held, and commit latency stays
/// one sync. Only holds that find the queue not yet empty are counted
/// ([`LogStats::groups_held`]).
fn hold_while_workers_are_behind(shared: &Shared, runtime: &tokio::runtime::RuntimeMetrics) {
    if runtime.global_queue_depth() == 0 {
        return;
    }
    shared.stats.groups_held.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    loop {
        let left = HOLD_LIMIT.saturating_sub(started.elapsed());
        if left.is_zero() {
            break;
        }
        thread::sleep(left.min(HOLD_STEP));
        if runtime.global_queue_depth() == 0 {
            break;
        }
    }
}

/// Starts a new segment at `lsn` (if the log is not there yet) and continues from it.
fn advance(
    shared: &Shared,
    active: &mut Segment,
    next_lsn: &mut Lsn,
    lsn: Lsn,
) -> Result<Lsn, LogError> {
    if lsn <= *next_lsn {
        return Ok(*next_lsn);
    }
    if shared.poisoned.load(Ordering::Acquire) {
        return Err(LogError::Poisoned);
    }
    let config = &shared.config;
    let journal = config.journal();
    active.trim(true, journal)?;
    let next = Segment::create(&config.dir, lsn, config.preallocate_bytes(), journal)?;
    if config.durability == Durability::Fsync {
        segment::sync_dir(&config.dir, journal)?;
    }
    let old = std::mem::replace(active, next);
    if old.len() == 0 {
        // Nothing was ever written to it: it need not stay.
        let path = old.path().to_owned();
        drop(old);
        fs::remove_file(&path).map_err(|e| LogError::io(&path, e))?;
        if let Some(journal) = journal {
            journal.removed(&path);
        }
    } else if let Ok(mut closed) = shared.closed.lock() {
        shared.active_first.store(lsn, Ordering::Release);
        closed.push((old.first_lsn(), old.path().to_owned(), old.len()));
    }
    shared.active_first.store(lsn, Ordering::Release);
    *next_lsn = lsn;
    shared.last_lsn.store(lsn - 1, Ordering::Release);
    Ok(lsn)
}

/// Gives the last segment's unused preallocated space back when the log stops. A failure
/// costs only disk space (the space reads as zeros, the last segment's clean end), so it is
/// logged, not fatal.
fn trim_last(segment: &Segment) {
    if let Err(e) = segment.trim(false, None) {
        tracing::warn!(error = %e, "could not give back a log segment's unused space");
    }
}

/// Writes a group, syncs it, applies and answers every append in it. Returns whether
/// tasks were queued for `runtime`'s workers when the sync ended.
fn write_and_answer(
    shared: &Shared,
    active: &mut Segment,
    group: &mut Vec<Append>,
    next_lsn: &mut Lsn,
    runtime: Option<&tokio::runtime::RuntimeMetrics>,
) -> bool {
    if group.iter().any(Append::chain_broken) {
        // Decided against records the log failed to write: not written either.
        for append in std::mem::take(group) {
            if append.chain_broken() {
                append.fail(LogError::EarlierFailed);
            } else {
                group.push(append);
            }
        }
        if group.is_empty() {
            return false;
        }
    }
    if shared.poisoned.load(Ordering::Acquire) {
        for append in group.drain(..) {
            append.fail(LogError::Poisoned);
        }
        return false;
    }
    let now = || {
        Instant::now()
            .saturating_duration_since(shared.opened)
            .as_nanos()
            .min(u128::from(u64::MAX)) as u64
    };
    if shared.remote.get().is_some() {
        // A node whose lease may have run out acknowledges nothing: another node may be
        // taking its log over. Nothing is written, so the log stays usable.
        let fenced = shared.fenced.load(Ordering::Acquire);
        if fenced || now() >= shared.lease_until.load(Ordering::Acquire) {
            for append in group.drain(..) {
                append.fail(if fenced {
                    LogError::Fenced
                } else {
                    LogError::LeaseExpired
                });
            }
            return false;
        }
    }
    match write_group(shared, active, group, *next_lsn) {
        Ok(()) => {
            // Looked at before this group's answers add to the queue.
            let behind = runtime.is_some_and(|r| r.global_queue_depth() > 0);
            // The lease may have run out while the group was written to the store (a pause
            // longer than the rest of the lease): a taker may have fenced the log and
            // collected the fence since, so the group's fate is unknown. It is in this
            // log, so it is applied here like any other; it is just not acknowledged, and
            // no later record of its chains is written (their premise is as uncertain).
            let lapsed = shared.remote.get().is_some()
                && now()
                    >= shared
                        .lease_until
                        .load(Ordering::Acquire)
                        .saturating_add(shared.lease_slack.load(Ordering::Acquire));
            for mut append in group.drain(..) {
                let lsn = *next_lsn;
                if let Some(apply) = append.apply.take() {
                    apply(lsn);
                }
                shared.last_lsn.store(lsn, Ordering::Release);
                *next_lsn += 1;
                if lapsed {
                    append.fail(LogError::LeaseLapsed);
                } else {
                    let _ = append.done.send(Ok(lsn));
                }
            }
            if shared.config.durability == Durability::Fsync {
                // After the answers, which need not wait for it.
                active.uncache_synced();
            }
            behind
        }
        Err(LogError::Fenced) => {
            // Another process fenced this epoch's log in the object store: the group was
            // not written there and never will be.
            shared.fenced.store(true, Ordering::Release);
            shared.poisoned.store(true, Ordering::Release);
            for append in group.drain(..) {
                append.fail(LogError::Fenced);
            }
            false
        }
        Err(e) => {
            // After a failed write or sync, the file's state is unknown: stop appending.
            shared.poisoned.store(true, Ordering::Release);
            let message = e.to_string();
            for append in group.drain(..) {
                append.fail(LogError::Io {
                    path: active.path().to_owned(),
                    source: io::Error::other(message.clone()),
                });
            }
            false
        }
    }
}

fn write_group(
    shared: &Shared,
    active: &mut Segment,
    group: &[Append],
    first_lsn: Lsn,
) -> Result<(), LogError> {
    let config = &shared.config;
    let journal = config.journal();
    if let Some(journal) = journal {
        journal
            .check_alive()
            .map_err(|e| LogError::io(active.path(), e))?;
    }
    if active.len() >= config.segment_bytes {
        // Roll: the full segment is synced already (every group is); cut it to its records,
        // durably, then start the next one at this group's first LSN.
        active.trim(true, journal)?;
        let next = Segment::create(&config.dir, first_lsn, config.preallocate_bytes(), journal)?;
        if config.durability == Durability::Fsync {
            segment::sync_dir(&config.dir, journal)?;
        }
        let old = std::mem::replace(active, next);
        if let Ok(mut closed) = shared.closed.lock() {
            // Under the lock, before the segment is listed as closed: a release running now
            // must see where it ends.
            shared.active_first.store(first_lsn, Ordering::Release);
            closed.push((old.first_lsn(), old.path().to_owned(), old.len()));
        }
        shared.stats.segments_rolled.fetch_add(1, Ordering::Relaxed);
    }
    let headers: Vec<[u8; FRAME_HEADER_BYTES]> = group
        .iter()
        .enumerate()
        .map(|(i, append)| {
            let end = i + 1 == group.len();
            segment::frame_header(first_lsn + i as u64, append.kind, end, &append.payload)
        })
        .collect();
    let mut slices: Vec<IoSlice<'_>> = headers
        .iter()
        .zip(group)
        .flat_map(|(header, append)| [IoSlice::new(header), IoSlice::new(&append.payload)])
        .collect();
    let bytes: usize = slices.iter().map(|s| s.len()).sum();
    if let Some(e) = config.fail_at(FailPoint::BeforeWrite) {
        return Err(LogError::io(active.path(), e));
    }
    active.write_all_vectored(&mut slices)?;
    shared.bytes.fetch_add(bytes as u64, Ordering::AcqRel);
    if let Some(e) = config.fail_at(FailPoint::BeforeSync) {
        return Err(LogError::io(active.path(), e));
    }
    if config.durability == Durability::Fsync {
        let started = Instant::now();
        active.sync_data(journal)?;
        shared.stats.count_sync(started);
    }
    if let Some(remote) = shared.remote.get() {
        let started = Instant::now();
        let mut body = Vec::with_capacity(bytes);
        for (header, append) in headers.iter().zip(group) {
            body.extend_from_slice(header);
            body.extend_from_slice(&append.payload);
        }
        let last_lsn = first_lsn + group.len() as u64 - 1;
        remote
            .ship(first_lsn, last_lsn, bytes::Bytes::from(body))
            .map_err(|e| match e {
                remote::ShipError::Fenced => LogError::Fenced,
                remote::ShipError::Store(message) => LogError::io(
                    active.path(),
                    io::Error::other(format!("object store: {message}")),
                ),
            })?;
        shared.stats.count_sync(started);
    }
    shared.stats.groups.fetch_add(1, Ordering::Relaxed);
    shared
        .stats
        .records
        .fetch_add(group.len() as u64, Ordering::Relaxed);
    Ok(())
}
