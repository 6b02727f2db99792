//! The commit log: every acknowledged write, durable before its answer.
//!
//! Records are appended to segment files under one directory. Each record is framed with its
//! length and a CRC32C, and carries a log sequence number ([`Lsn`]) that orders all writes of
//! the server. One writer thread takes every pending append, writes them together and covers
//! them with one `fdatasync` (group commit); an append returns its LSN only after the sync that
//! covers it.
//!
//! On open, the log is scanned from its first segment: a torn or corrupt record at the tail of
//! the last segment (a crash mid-write) is cut off; anything else that fails its checksum stops
//! the open with an error, because data after it was acknowledged. The records found are
//! handed back for replay. Segments whose records are all made durable elsewhere (flushed to
//! object storage) are deleted with [`CommitLog::truncate_before`].
//!
//! Frame layout (little endian):
//!
//! ```text
//! | len: u32 | crc32c: u32 | kind: u8 | lsn: u64 | payload: len bytes |
//! ```
//! The CRC covers kind, lsn and payload.

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

use segment::{Segment, SegmentScan};

/// A log sequence number: the position of a record in the log, starting at 1.
pub type Lsn = u64;

/// Bytes of a frame header: length, CRC, kind, LSN.
pub const FRAME_HEADER_BYTES: usize = 4 + 4 + 1 + 8;

/// The largest payload one record may carry.
pub const MAX_RECORD_BYTES: usize = 256 << 20;

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

impl RecordKind {
    fn from_byte(b: u8) -> Option<RecordKind> {
        match b {
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
pub type FailHook = Arc<dyn Fn(FailPoint) -> Option<io::Error> + Send + Sync>;

/// Settings of a commit log.
#[derive(Clone)]
pub struct LogConfig {
    /// Directory of the segment files.
    pub dir: PathBuf,
    /// A segment is closed and a new one started past this size.
    pub segment_bytes: u64,
    /// When appends are synced.
    pub durability: Durability,
    /// Appends are refused with [`LogError::Full`] while the log's files hold more than this.
    pub max_log_bytes: u64,
    /// Failure injection for tests.
    pub fail_hook: Option<FailHook>,
}

impl LogConfig {
    /// Defaults: 64 MiB segments, fsync per group, 4 GiB log budget, no failure injection.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        LogConfig {
            dir: dir.into(),
            segment_bytes: 64 << 20,
            durability: Durability::Fsync,
            max_log_bytes: 4 << 30,
            fail_hook: None,
        }
    }
}

impl std::fmt::Debug for LogConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogConfig")
            .field("dir", &self.dir)
            .field("segment_bytes", &self.segment_bytes)
            .field("durability", &self.durability)
            .field("max_log_bytes", &self.max_log_bytes)
            .field("fail_hook", &self.fail_hook.is_some())
            .finish()
    }
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
        "commit log segment {path} is corrupt at byte {offset}, before its tail; refusing to drop acknowledged data"
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
    /// A payload over [`MAX_RECORD_BYTES`].
    #[error("record of {0} bytes is larger than the commit log accepts")]
    RecordTooLarge(usize),
    /// An earlier write or sync failed; after a failed sync the page cache cannot be trusted,
    /// so the log refuses appends until it is reopened.
    #[error("commit log is unavailable after an earlier I/O failure; restart to recover")]
    Poisoned,
    /// The log was closed.
    #[error("commit log is closed")]
    Closed,
}

impl LogError {
    fn io(path: &Path, source: io::Error) -> Self {
        LogError::Io {
            path: path.to_owned(),
            source,
        }
    }

    /// Whether the caller may retry the same append later (the log applied nothing).
    pub fn is_retryable(&self) -> bool {
        matches!(self, LogError::Full { .. })
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
}

/// Work to run on the writer thread once a record is durable, before it is acknowledged.
pub type ApplyFn = Box<dyn FnOnce(Lsn) + Send>;

struct Append {
    kind: RecordKind,
    payload: Vec<u8>,
    apply: Option<ApplyFn>,
    done: oneshot::Sender<Result<Lsn, LogError>>,
}

enum Msg {
    Append(Append),
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
    stats: LogStats,
    /// For each consumer, the LSN below which it needs no record any more.
    consumers: Mutex<HashMap<String, Lsn>>,
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
        let mut paths = segment::list(&config.dir)?;
        let mut records = Vec::new();
        let mut closed = Vec::new();
        let mut next_lsn: Lsn = 1;
        let mut total_bytes = 0u64;
        let last_index = paths.len().checked_sub(1);
        for (i, (first_lsn, path)) in paths.iter().enumerate() {
            let SegmentScan {
                valid_len,
                file_len,
            } = segment::scan(path, &mut records, next_lsn.max(*first_lsn))?;
            if valid_len < file_len {
                if Some(i) != last_index {
                    return Err(LogError::Corrupt {
                        path: path.clone(),
                        offset: valid_len,
                    });
                }
                // A torn tail: the crash came mid-write, and nothing past it was acknowledged.
                segment::truncate(path, valid_len)?;
            }
            if let Some(last) = records.last() {
                next_lsn = last.lsn + 1;
            } else {
                next_lsn = next_lsn.max(*first_lsn);
            }
            total_bytes += valid_len;
            if Some(i) != last_index {
                closed.push((*first_lsn, path.clone(), valid_len));
            }
        }
        // Continue in the last segment, or start the first one.
        let active = match paths.pop() {
            Some((first_lsn, path)) => Segment::open_append(&path, first_lsn)?,
            None => Segment::create(&config.dir, next_lsn)?,
        };
        if config.durability == Durability::Fsync {
            segment::sync_dir(&config.dir)?;
        }
        let shared = Arc::new(Shared {
            config,
            closed: Mutex::new(closed),
            bytes: AtomicU64::new(total_bytes),
            active_first: AtomicU64::new(active.first_lsn()),
            last_lsn: AtomicU64::new(next_lsn - 1),
            poisoned: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            stats: LogStats::default(),
            consumers: Mutex::new(HashMap::new()),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let writer_shared = shared.clone();
        let writer = thread::Builder::new()
            .name("sluice-log-writer".into())
            .spawn(move || writer_loop(writer_shared, rx, active, next_lsn))
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
        let done = self.submit(kind, payload, None)?;
        done.await.map_err(|_| LogError::Closed)?
    }

    /// Appends one record and, once it is durable, runs `apply` with its LSN on the writer
    /// thread before acknowledging it.
    ///
    /// `apply` calls run in LSN order across all appenders, so state built by them (a table's
    /// unflushed batches, a stream's tail) always holds a gap-free prefix of the log. `apply`
    /// must be quick and must not block: it holds up every append behind it.
    pub async fn append_applied(
        &self,
        kind: RecordKind,
        payload: Vec<u8>,
        apply: impl FnOnce(Lsn) + Send + 'static,
    ) -> Result<Lsn, LogError> {
        let done = self.submit(kind, payload, Some(Box::new(apply)))?;
        done.await.map_err(|_| LogError::Closed)?
    }

    /// Blocking [`CommitLog::append`], for callers outside an async runtime.
    pub fn append_blocking(&self, kind: RecordKind, payload: Vec<u8>) -> Result<Lsn, LogError> {
        let done = self.submit(kind, payload, None)?;
        done.blocking_recv().map_err(|_| LogError::Closed)?
    }

    fn submit(
        &self,
        kind: RecordKind,
        payload: Vec<u8>,
        apply: Option<ApplyFn>,
    ) -> Result<oneshot::Receiver<Result<Lsn, LogError>>, LogError> {
        if payload.len() > MAX_RECORD_BYTES {
            return Err(LogError::RecordTooLarge(payload.len()));
        }
        if self.shared.closing.load(Ordering::Acquire) {
            return Err(LogError::Closed);
        }
        if self.shared.poisoned.load(Ordering::Acquire) {
            return Err(LogError::Poisoned);
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
                done,
            }))
            .map_err(|_| LogError::Closed)?;
        Ok(rx)
    }

    /// Registers a consumer of the log's records (tables, streams). Segments are deleted only
    /// below the position every registered consumer has released. A new consumer needs
    /// everything from the first record on.
    pub fn consumer(&self, name: &str) -> LogConsumer {
        if let Ok(mut consumers) = self.shared.consumers.lock() {
            consumers.entry(name.to_owned()).or_insert(0);
        }
        LogConsumer {
            log: self.clone(),
            name: name.to_owned(),
        }
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
            self.shared.bytes.fetch_sub(size, Ordering::AcqRel);
            deleted += 1;
        }
        Ok(deleted)
    }

    /// The last LSN that is durable and applied (0 for an empty log).
    pub fn last_lsn(&self) -> Lsn {
        self.shared.last_lsn.load(Ordering::Acquire)
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
        if let Ok(mut writer) = self.writer.lock() {
            if let Some(handle) = writer.take() {
                let _ = handle.join();
            }
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
            let entry = consumers.entry(self.name.clone()).or_insert(0);
            *entry = (*entry).max(lsn);
            consumers.values().copied().min().unwrap_or(0)
        };
        self.log.truncate_before(floor)
    }

    /// The log itself.
    pub fn log(&self) -> &CommitLog {
        &self.log
    }
}

/// The writer thread: take every waiting append, write them, sync once, answer them all.
fn writer_loop(
    shared: Arc<Shared>,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    mut active: Segment,
    mut next_lsn: Lsn,
) {
    let mut group: Vec<Append> = Vec::new();
    let mut stop = false;
    while !stop {
        let Some(first) = rx.blocking_recv() else {
            break;
        };
        let mut next = Some(first);
        while let Some(msg) = next.take().or_else(|| rx.try_recv().ok()) {
            match msg {
                Msg::Append(append) => group.push(append),
                Msg::Close => {
                    stop = true;
                    break;
                }
            }
        }
        if group.is_empty() {
            continue;
        }
        if shared.poisoned.load(Ordering::Acquire) {
            for append in group.drain(..) {
                let _ = append.done.send(Err(LogError::Poisoned));
            }
            continue;
        }
        let result = write_group(&shared, &mut active, &group, next_lsn);
        match result {
            Ok(()) => {
                for append in group.drain(..) {
                    if let Some(apply) = append.apply {
                        apply(next_lsn);
                    }
                    shared.last_lsn.store(next_lsn, Ordering::Release);
                    let _ = append.done.send(Ok(next_lsn));
                    next_lsn += 1;
                }
            }
            Err(e) => {
                // After a failed write or sync, the file's state is unknown: stop appending.
                shared.poisoned.store(true, Ordering::Release);
                let message = e.to_string();
                for append in group.drain(..) {
                    let _ = append.done.send(Err(LogError::Io {
                        path: active.path().to_owned(),
                        source: io::Error::other(message.clone()),
                    }));
                }
            }
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
    if active.len() >= config.segment_bytes {
        // Roll: the full segment is synced already (every group is), so close it and start
        // the next one at this group's first LSN.
        let next = Segment::create(&config.dir, first_lsn)?;
        if config.durability == Durability::Fsync {
            segment::sync_dir(&config.dir)?;
        }
        let old = std::mem::replace(active, next);
        if let Ok(mut closed) = shared.closed.lock() {
            closed.push((old.first_lsn(), old.path().to_owned(), old.len()));
        }
        shared.active_first.store(first_lsn, Ordering::Release);
    }
    let headers: Vec<[u8; FRAME_HEADER_BYTES]> = group
        .iter()
        .enumerate()
        .map(|(i, append)| {
            segment::frame_header(first_lsn + i as u64, append.kind, &append.payload)
        })
        .collect();
    let mut slices: Vec<IoSlice<'_>> = headers
        .iter()
        .zip(group)
        .flat_map(|(header, append)| [IoSlice::new(header), IoSlice::new(&append.payload)])
        .collect();
    let bytes: usize = slices.iter().map(|s| s.len()).sum();
    if let Some(hook) = &config.fail_hook {
        if let Some(e) = hook(FailPoint::BeforeWrite) {
            return Err(LogError::io(active.path(), e));
        }
    }
    active.write_all_vectored(&mut slices)?;
    shared.bytes.fetch_add(bytes as u64, Ordering::AcqRel);
    if let Some(hook) = &config.fail_hook {
        if let Some(e) = hook(FailPoint::BeforeSync) {
            return Err(LogError::io(active.path(), e));
        }
    }
    if config.durability == Durability::Fsync {
        let started = Instant::now();
        active.sync_data()?;
        let elapsed = started.elapsed().min(Duration::from_secs(3600));
        shared.stats.syncs.fetch_add(1, Ordering::Relaxed);
        shared
            .stats
            .sync_nanos
            .fetch_add(elapsed.as_nanos() as u64, Ordering::Relaxed);
    }
    shared.stats.groups.fetch_add(1, Ordering::Relaxed);
    shared
        .stats
        .records
        .fetch_add(group.len() as u64, Ordering::Relaxed);
    Ok(())
}
