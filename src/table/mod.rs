//! Tables: committed batches, in memory or in the commit log, until they are flushed as
//! Parquet to object storage.
//!
//! An append goes to the commit log; once durable, the batch joins the table's unflushed set
//! (on the log's writer thread, in LSN order, so the set is always a gap-free run of the
//! table's newest records) and is visible to queries at once. A flush writes the oldest unflushed
//! batches as one Parquet file, commits it to the table's manifest together with the log
//! position it covers, and only then drops the batches from the set: a query's
//! [`TableSnapshot`] sees every committed row exactly once, in a file or unflushed. After a
//! restart, the log records past the manifest's position for this node are replayed; earlier
//! ones are already in files.
//!
//! Unflushed batches are held in memory up to [`TableConfig::max_unflushed_bytes`] over all
//! tables. Past it, the oldest are spilled: their decoded form leaves memory and they are read
//! back from the log's local segments (their records are there until the flush that covers
//! them: the log is released only below every table's oldest unflushed record) by queries
//! ([`SpilledBatches`]) and flushes, up to [`TableConfig::max_spilled_bytes`]; past both
//! budgets, appends wait for flushes. The spilled batches of a table are always the oldest of
//! its set (a prefix). A reader of spilled batches holds their records (`LogHold`) until it
//! is done, even if a flush takes the batches from the set meanwhile. So a burst of appends is
//! acknowledged from the log and memory alone: while appends keep coming
//! ([`TableConfig::flush_quiet`]) and the spill budget has room, flushes wait for the burst's
//! end (an age limit holds anyway), and a flush then decodes a budget's worth at a time.
//!
//! Small batches coalesce: a committed batch smaller than [`COALESCE_BELOW_BYTES`] joins the
//! newest entry of the set when that entry is in memory, of the same schema, itself still under
//! that size, and not taken by a flush under way (`Unflushed::cut`). One entry then holds the
//! rows of several records, in LSN order, and keeps their LSNs: memory, spills and flushes
//! follow rows and bytes, not requests (a one-row batch alone costs its arrays' overhead, about
//! a kilobyte). An entry's rows are a few runs (batches) joined as Timsort joins its runs
//! (`push_run`): batches that join wait as runs of their own (`Unflushed::pending`, fewer
//! than `PENDING_RUNS`) until enough wait or the entry reaches its size, then are copied
//! into one run together, so as an entry grows on the log's writer thread, each of its rows is
//! copied about log2(rows) times, not once for every batch that joins. A trim leaves one run,
//! none waiting. An entry's size counts its runs, waiting or joined, and its per-record index
//! (`lsns`, `ends`); over the memory budget, waiting batches are joined before any entry is
//! spilled (`TableState::join_waiting`). A flush takes whole entries and
//! covers up to the last record of the last one it took; an entry a flush took takes no more
//! records (unless that flush failed before its commit was sent: then no manifest can cover
//! it), so every position this process commits is the last LSN of an entry. A position
//! committed by another process under the same node id (a commit of a node that stalled past
//! its lease, landing after a taker replayed and coalesced the same records differently) may
//! fall inside an entry: the install then trims the entry to the records past it
//! (`Unflushed::trim_through`).
//!
//! The manifest decides, never memory: whenever a manifest state is installed (a flush's own
//! commit, or a refresh that reads versions written since), the unflushed batches that its
//! position for this node covers leave memory in the same step, under the table's lock. So a
//! query never sees a row twice, and a flush whose commit landed although its answer was lost
//! (an ambiguous outcome) cannot write those rows again: a flush commits only if the
//! manifest's position for this node is still below the first record it holds.
//!
//! Compaction merges small files into one through a manifest commit that removes them; its
//! output is deleted only when its commit is known to have lost. A flush and a compaction of
//! one table may run at once (the maintenance loop runs compactions beside its flushes); their
//! commits, each with its install and Iceberg publication, take turns, and each commits on the
//! newest installed state, so neither undoes the other. Before a commit that other nodes or a
//! restart will read, the node checks it still owns its id ([`crate::node`]).

mod files;
mod gc;
pub(crate) mod manifest;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use object_store::ObjectStoreExt as _;
use object_store::path::Path;

use crate::error::{Cause, Classify, ErrorClass, Kind};
use crate::log::{CommitLog, LogConsumer, LogError, Lsn, Record, RecordKind};
use crate::node::{Node, NodeError};
use crate::storage::{Storage, paths};
use crate::types::Column;
pub(crate) use files::dictionary_pages_only;
use manifest::{Change, Manifest};
pub(crate) use manifest::{DataFile, ManifestState};

/// Why a table operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// No table with this id.
    #[error("table {0} does not exist")]
    NotFound(String),
    /// A table with this id exists with other columns.
    #[error("table {0} already exists with different columns")]
    AlreadyExists(String),
    /// The batch's schema is not the table's.
    #[error("batch schema does not match table {table}: {reason}")]
    SchemaMismatch {
        /// The table.
        table: String,
        /// The difference.
        reason: String,
    },
    /// Unflushed batches are past both the memory and the spill budget; retry once a flush
    /// has caught up.
    #[error(
        "too many unflushed bytes to append to table {table}: {bytes} held in memory over all tables (budget {budget}), and the spill budget is used up; retry later"
    )]
    Backpressure {
        /// The table.
        table: String,
        /// Unflushed bytes held in memory, all tables together.
        bytes: usize,
        /// The memory budget.
        budget: usize,
    },
    /// The commit log refused or failed the append.
    #[error(transparent)]
    Log(#[from] LogError),
    /// Object storage failed.
    #[error("object store error: {0}")]
    Storage(#[source] object_store::Error),
    /// A manifest object that cannot be read.
    #[error("manifest object {path} is unreadable: {reason}")]
    CorruptManifest {
        /// The object.
        path: String,
        /// Why.
        reason: String,
    },
    /// A concurrent manifest change made this one impossible (compaction of a file another
    /// writer already compacted).
    #[error("manifest conflict: {0}")]
    Conflict(String),
    /// Encoding or decoding Arrow or Parquet data failed.
    #[error("data encoding error: {0}")]
    Encoding(String),
    /// A background task could not run.
    #[error("task failed: {0}")]
    Task(String),
    /// This node does not own its id any more (or could not check).
    #[error(transparent)]
    Node(#[from] NodeError),
}

impl Classify for TableError {
    fn class(&self) -> ErrorClass {
        match self {
            TableError::Backpressure { .. } => ErrorClass::retry(Cause::TableBackpressure),
            TableError::Log(e) => e.class(),
            TableError::Node(e) => e.class(),
            TableError::NotFound(_) => ErrorClass::rejected(Kind::NotFound),
            TableError::SchemaMismatch { .. } | TableError::AlreadyExists(_) => {
                ErrorClass::rejected(Kind::Internal)
            }
            TableError::Conflict(_) => ErrorClass::rejected(Kind::Conflict),
            // A request meets these before its rows reach the log (loading the table,
            // encoding the batch, decoding on a blocking thread) or while reading: nothing
            // of it was applied. (Flushes and compactions meet them too; no request waits
            // for those.)
            TableError::Storage(_) => ErrorClass::retry(Cause::StorageUnavailable),
            TableError::CorruptManifest { .. } | TableError::Encoding(_) | TableError::Task(_) => {
                ErrorClass::rejected(Kind::Internal)
            }
        }
    }
}

/// Tuning of table storage.
#[derive(Debug, Clone)]
pub struct TableConfig {
    /// Flush a table once its unflushed batches hold this many bytes.
    pub flush_bytes: usize,
    /// Flush a table once its oldest unflushed batch is this old.
    pub flush_interval: Duration,
    /// Hold at most this many bytes of unflushed batches in memory, all tables together.
    /// Past it, the oldest are spilled (dropped from memory and read back from the commit
    /// log when a query or a flush needs them) while `max_spilled_bytes` allows, and appends
    /// wait for flushes after that.
    pub max_unflushed_bytes: usize,
    /// How many bytes (decoded size) of unflushed batches all tables together may keep in
    /// the commit log only. 0 turns spilling off. Not used when the log's local segments
    /// are only a cache (`Durability::ObjectStore`).
    pub max_spilled_bytes: usize,
    /// While appends come less than this far apart (a burst), a table over `flush_bytes`
    /// is not flushed yet as long as its batches can be spilled (up to half of
    /// `max_spilled_bytes`): the burst is acknowledged from the log and memory, and its
    /// Parquet is written once it has passed. The age limit `flush_interval` holds anyway.
    pub flush_quiet: Duration,
    /// How long an append over `max_unflushed_bytes` waits for flushes before it is refused.
    pub headroom_wait: Duration,
    /// Rows per Parquet row group.
    pub row_group_rows: usize,
    /// Compact once a table has this many files smaller than half the target.
    pub compact_min_files: usize,
    /// Target size of a compacted file.
    pub compact_target_bytes: u64,
    /// Write a manifest checkpoint every this many versions.
    pub checkpoint_interval: u64,
}

impl Default for TableConfig {
    fn default() -> Self {
        TableConfig {
            flush_bytes: 32 << 20,
            flush_interval: Duration::from_secs(10),
            max_unflushed_bytes: 64 << 20,
            max_spilled_bytes: 1 << 30,
            flush_quiet: Duration::from_millis(500),
            headroom_wait: Duration::from_secs(10),
            row_group_rows: 128 * 1024,
            compact_min_files: 8,
            compact_target_bytes: 64 << 20,
            checkpoint_interval: 10,
        }
    }
}

/// What a query reads of a table at one moment: its files and its unflushed batches, which
/// together hold every committed row exactly once.
#[derive(Debug, Clone)]
pub struct TableSnapshot {
    /// The table's Arrow schema.
    pub schema: SchemaRef,
    /// Parquet files, paths relative to the database root.
    pub files: Vec<DataFile>,
    /// Committed batches not yet in a file that are spilled: read back from the commit
    /// log. They come before `batches` in commit order.
    pub spilled: Option<SpilledBatches>,
    /// Committed batches not yet in a file and held in memory, in commit order.
    pub batches: Vec<RecordBatch>,
    /// The manifest version of `files`.
    pub version: u64,
}

impl TableSnapshot {
    /// Rows in files, spilled and in memory.
    pub fn num_rows(&self) -> u64 {
        self.files.iter().map(|f| f.rows).sum::<u64>()
            + self.spilled.as_ref().map_or(0, SpilledBatches::rows)
            + self
                .batches
                .iter()
                .map(|b| b.num_rows() as u64)
                .sum::<u64>()
    }
}

/// Unflushed batches of a snapshot that are read back from the commit log. While this (or a
/// clone) lives, their log records are kept.
#[derive(Clone)]
pub struct SpilledBatches {
    table: String,
    lsns: Arc<[Lsn]>,
    rows: u64,
    log: CommitLog,
    reads: Arc<AtomicU64>,
    _kept: Arc<LogHold>,
}

impl std::fmt::Debug for SpilledBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpilledBatches")
            .field("table", &self.table)
            .field("batches", &self.lsns.len())
            .field("rows", &self.rows)
            .finish()
    }
}

impl SpilledBatches {
    /// Their rows.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// How many batches.
    pub fn len(&self) -> usize {
        self.lsns.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.lsns.is_empty()
    }

    /// Reads them back, in commit order, one at a time (blocking file I/O: call from a
    /// blocking thread).
    pub fn read(&self) -> impl Iterator<Item = Result<RecordBatch, TableError>> + Send + use<> {
        let mut reader = self.log.reader();
        let table = self.table.clone();
        let kept = self._kept.clone();
        let lsns = self.lsns.clone();
        let reads = self.reads.clone();
        (0..lsns.len()).map(move |i| {
            // The records stay in the log while the reader lives.
            let _kept = &kept;
            let reader = reader.as_mut().ok_or_else(|| {
                TableError::Task("spilled batches need the commit log's local segments".into())
            })?;
            read_spilled(reader, &table, lsns[i], &reads)
        })
    }
}

/// One spilled batch of `table`, read back from the log.
fn read_spilled(
    reader: &mut crate::log::LogReader,
    table: &str,
    lsn: Lsn,
    reads: &AtomicU64,
) -> Result<RecordBatch, TableError> {
    let record = reader.read(lsn)?;
    if record.kind != RecordKind::TableBatch {
        return Err(TableError::Encoding(format!(
            "log record {lsn} is not a table batch"
        )));
    }
    let (id, batch) = files::decode_record(&record.payload)?;
    if id != table {
        return Err(TableError::Encoding(format!(
            "log record {lsn} belongs to table {id}, not {table}"
        )));
    }
    reads.fetch_add(1, Ordering::Relaxed);
    Ok(batch)
}

/// Log records kept for a reader of spilled batches: while it lives, the tables' release of
/// the log stops below `lsn` (`Tables::release_log`).
struct LogHold {
    holds: Arc<Mutex<BTreeMap<u64, Lsn>>>,
    key: u64,
}

impl LogHold {
    fn new(holds: &Arc<Mutex<BTreeMap<u64, Lsn>>>, next: &AtomicU64, lsn: Lsn) -> LogHold {
        let key = next.fetch_add(1, Ordering::Relaxed);
        holds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, lsn);
        LogHold {
            holds: holds.clone(),
            key,
        }
    }
}

impl Drop for LogHold {
    fn drop(&mut self) {
        self.holds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

/// Size and state figures of one table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Parquet files.
    pub files: usize,
    /// Bytes in Parquet files.
    pub file_bytes: u64,
    /// Rows in Parquet files.
    pub file_rows: u64,
    /// Unflushed batches.
    pub unflushed_batches: usize,
    /// Bytes of unflushed batches (decoded size, in memory or spilled).
    pub unflushed_bytes: usize,
    /// Of those, bytes of batches spilled: read back from the commit log when needed.
    pub spilled_bytes: usize,
    /// Rows in unflushed batches.
    pub unflushed_rows: u64,
}

/// A batch smaller than this joins the newest unflushed entry of its table while that entry
/// is smaller than this too (see the module docs): the copy each join makes stays small, and
/// an entry of one-row batches holds hundreds of rows.
pub(crate) const COALESCE_BELOW_BYTES: usize = 32 << 10;

/// Most files a compaction pass writes again to leave out a dropped column
/// ([`Tables::compact`]): a table with many such files loses the column from all of them
/// over a few passes, and a pass stays short.
const RESHAPED_PER_PASS: usize = 8;

/// One entry of a table's unflushed set: the rows of one or more consecutive records of the
/// table (coalesced small batches), in memory or spilled.
struct Unflushed {
    /// The records whose rows it holds, ascending (one, unless small batches coalesced).
    lsns: Vec<Lsn>,
    /// For each record of `lsns`, the number of the entry's rows up to and including its own.
    ends: Vec<usize>,
    /// The decoded rows, in order, as runs (see [`push_run`]); `None` once spilled (its
    /// records are read back from the log).
    runs: Option<Vec<Run>>,
    /// How many of the newest runs are batches that joined and were not copied into a run
    /// yet (see [`push_run`]).
    pending: usize,
    rows: usize,
    /// Its decoded size.
    bytes: usize,
    /// When its first batch joined the set (for `flush_interval`).
    at: Instant,
    /// Taken by a flush's cut: it takes no more records (the flush covers up to its last).
    cut: bool,
}

impl Unflushed {
    /// Its first record: the log keeps records from here while it is unflushed.
    fn first_lsn(&self) -> Lsn {
        self.lsns.first().copied().unwrap_or(0)
    }

    /// The memory of its per-record index (`lsns` and `ends`), part of its size: for an
    /// entry of one-row records, as much as a narrow table's rows.
    fn index_bytes(&self) -> usize {
        (self.lsns.capacity() + self.ends.capacity()) * std::mem::size_of::<u64>()
    }

    /// Its size in memory as its runs and index measure it now (0 for its runs once
    /// spilled).
    fn measured_bytes(&self) -> usize {
        self.runs.iter().flatten().map(|r| r.bytes).sum::<usize>() + self.index_bytes()
    }

    /// Its last record: a flush that took it covers up to here.
    fn last_lsn(&self) -> Lsn {
        self.lsns.last().copied().unwrap_or(0)
    }

    /// Drops the rows of its records at or below `covered` (in files now), keeping the
    /// rest; returns its size before and after.
    fn trim_through(&mut self, covered: Lsn) -> (usize, usize) {
        let before = self.bytes;
        let gone = self.lsns.partition_point(|&lsn| lsn <= covered);
        let Some(&rows_gone) = gone.checked_sub(1).and_then(|i| self.ends.get(i)) else {
            return (before, before);
        };
        self.lsns.drain(..gone);
        self.ends.drain(..gone);
        self.lsns.shrink_to_fit();
        self.ends.shrink_to_fit();
        for end in &mut self.ends {
            *end -= rows_gone;
        }
        let kept = self.rows - rows_gone;
        self.bytes = match &mut self.runs {
            Some(runs) => {
                // The kept rows, copied out of their runs, so the dropped rows' buffers go too.
                let mut skip = rows_gone;
                let mut slices = Vec::with_capacity(runs.len());
                for run in runs.iter() {
                    let n = run.batch.num_rows();
                    if skip >= n {
                        skip -= n;
                        continue;
                    }
                    slices.push(run.batch.slice(skip, n - skip));
                    skip = 0;
                }
                let compacted = copied(&slices);
                *runs = match compacted {
                    Some(batch) => vec![Run::fresh(batch)],
                    // Not joined (cannot happen for runs of one schema): the slices
                    // themselves, their size counted in full.
                    None => slices.into_iter().map(Run::fresh).collect(),
                };
                self.pending = 0;
                self.measured_bytes()
            }
            // Spilled: its records are read back from the log, so what it stands for is a
            // share of the spilled bytes.
            None => before.saturating_mul(kept) / self.rows.max(1),
        };
        self.rows = kept;
        (before, self.bytes)
    }
}

/// Consecutive rows of an unflushed entry held as one batch, with its size in memory.
struct Run {
    batch: RecordBatch,
    bytes: usize,
}

impl Run {
    /// A run of a batch that owns its buffers (not a view of a shared one).
    fn fresh(batch: RecordBatch) -> Run {
        let bytes = batch.get_array_memory_size();
        Run { batch, bytes }
    }
}

/// `batches` (of one schema) copied into one batch of fresh buffers of their rows' size.
/// (`concat_batches` hands a lone batch back as it is, a view that keeps its whole buffers:
/// an empty view is added to make it copy.)
fn copied(batches: &[RecordBatch]) -> Option<RecordBatch> {
    let first = batches.first()?;
    let empty = first.slice(0, 0);
    let mut all: Vec<&RecordBatch> = batches.iter().collect();
    if all.len() == 1 {
        all.push(&empty);
    }
    arrow_select::concat::concat_batches(&first.schema(), all).ok()
}

/// How many batches that joined an entry wait before they are copied into one run: a copy
/// of a few rows costs mostly its per-column setup, so batches of a row or two are joined
/// a few dozen at a time, each row copied once there.
const PENDING_RUNS: usize = 32;

/// Over the memory budget, an entry's waiting batches are joined before anything is spilled
/// when at least this many wait. While appends keep the total over the budget, each may then
/// copy the newest batches again, as every append did before batches waited; such appends
/// wait for flushes anyway. A higher bar spilled entries of a few rows each under a small
/// budget (their waiting batches counted in full).
const JOIN_BEFORE_SPILL: usize = 2;

/// Appends `run` to an entry's runs, the newest `*pending` of which are batches not joined
/// yet. Once [`PENDING_RUNS`] batches wait, or `close` says the entry takes no more, they are
/// copied into one run in one step, and that run joins its older neighbours as Timsort keeps
/// its stack of runs: every run holds more rows than the next two together, and more than the
/// next one. The joined runs' row counts fall at least as fast as Fibonacci numbers from the
/// oldest on, so an entry of `k` rows holds at most about `1.44 log2(k)` runs and fewer than
/// [`PENDING_RUNS`] waiting batches, whatever the sizes of the batches that joined it, and
/// each row is copied about `log2(k)` times as the entry grows, not once for every batch that
/// joins it. Runs that cannot be joined stay apart (still in order).
fn push_run(runs: &mut Vec<Run>, pending: &mut usize, run: Run, close: bool) {
    runs.push(run);
    *pending += 1;
    if *pending < PENDING_RUNS && !close {
        return;
    }
    join_waiting_runs(runs, pending);
}

/// Copies the newest `*pending` runs of `runs` (batches waiting, see [`push_run`]) into one
/// run, which then joins its older neighbours.
fn join_waiting_runs(runs: &mut Vec<Run>, pending: &mut usize) {
    let waiting = (*pending).min(runs.len());
    *pending = 0;
    if waiting > 1 {
        let at = runs.len() - waiting;
        let batches: Vec<&RecordBatch> = runs[at..].iter().map(|r| &r.batch).collect();
        let Ok(joined) = arrow_select::concat::concat_batches(batches[0].schema_ref(), batches)
        else {
            // Not joined (cannot happen for batches of one schema): they stay runs of
            // their own, in order.
            return;
        };
        runs.truncate(at);
        runs.push(Run::fresh(joined));
    }
    join_runs(runs);
}

/// Joins the newest runs of `runs` with their neighbours until Timsort's invariant holds.
fn join_runs(runs: &mut Vec<Run>) {
    loop {
        let mut newest = [0usize; 4];
        for (slot, r) in newest.iter_mut().zip(runs.iter().rev()) {
            *slot = r.batch.num_rows();
        }
        let rows = &newest[..runs.len().min(4)];
        // `rows[0]` is the newest run's, `rows[1]` the one before it, and so on.
        let join =
            match *rows {
                [c, b, a, ..] if a <= b + c || rows.get(3).is_some_and(|&z| z <= a + b) => {
                    if a < c { 2 } else { 1 }
                }
                [c, b, ..] if b <= c => 1,
                _ => return,
            };
        // Join the run `join` places before the newest with the one after it.
        let at = runs.len() - 1 - join;
        let (older, newer) = (&runs[at].batch, &runs[at + 1].batch);
        let Ok(joined) = arrow_select::concat::concat_batches(&older.schema(), [older, newer])
        else {
            return;
        };
        runs.splice(at..at + 2, [Run::fresh(joined)]);
    }
}

/// Invariant: the spilled batches are a prefix of `unflushed` (the oldest are spilled
/// first), `spilled` of them, holding `spilled_bytes`; the rest, holding `held_bytes`, are
/// in memory.
struct TableState {
    manifest: ManifestState,
    unflushed: VecDeque<Unflushed>,
    held_bytes: usize,
    spilled: usize,
    spilled_bytes: usize,
    /// When an append of this table last started (for `flush_quiet`).
    last_append: Option<Instant>,
}

impl TableState {
    /// Installs a manifest state and, in the same step, drops the unflushed batches whose
    /// records its position for `node` covers: they are in its files now.
    fn install(&mut self, manifest: ManifestState, node: &str) {
        if manifest.version < self.manifest.version {
            return;
        }
        let covered = manifest.flushed.get(node).copied().unwrap_or(0);
        while self
            .unflushed
            .front()
            .is_some_and(|u| u.last_lsn() <= covered)
        {
            if let Some(u) = self.unflushed.pop_front() {
                if u.runs.is_some() {
                    self.held_bytes = self.held_bytes.saturating_sub(u.bytes);
                } else {
                    self.spilled = self.spilled.saturating_sub(1);
                    self.spilled_bytes = self.spilled_bytes.saturating_sub(u.bytes);
                }
            }
        }
        // A position inside the oldest entry left (see the module docs): its covered
        // records go, the rest stay.
        if let Some(front) = self.unflushed.front_mut()
            && front.first_lsn() <= covered
        {
            let in_memory = front.runs.is_some();
            let (before, after) = front.trim_through(covered);
            let total = if in_memory {
                &mut self.held_bytes
            } else {
                &mut self.spilled_bytes
            };
            *total = total.saturating_sub(before) + after;
        }
        self.manifest = manifest;
    }

    /// Frees the entries a flush's cut took first (`fresh`: their last records, ascending)
    /// when the flush failed before its commit: no manifest covers them, so the newest may
    /// take records again.
    fn uncut(&mut self, fresh: &[Lsn]) {
        for u in self.unflushed.iter_mut() {
            if fresh.binary_search(&u.last_lsn()).is_ok() {
                u.cut = false;
            }
        }
    }

    /// Bytes of unflushed batches, in memory or spilled.
    fn unflushed_bytes(&self) -> usize {
        self.held_bytes + self.spilled_bytes
    }

    /// Copies the batches waiting in its entries in memory into runs (see [`push_run`]),
    /// where at least [`JOIN_BEFORE_SPILL`] wait: before an entry is spilled for the memory
    /// budget, the memory that joining them frees is taken first (a batch of a few rows alone
    /// costs its arrays' overhead). Entries a flush has cut are left: the flush holds their
    /// runs, so a copy would take memory, not free it, and they go when it commits.
    fn join_waiting(&mut self) {
        for u in self.unflushed.iter_mut().skip(self.spilled) {
            if u.pending < JOIN_BEFORE_SPILL || u.cut {
                continue;
            }
            let Some(runs) = &mut u.runs else {
                continue;
            };
            join_waiting_runs(runs, &mut u.pending);
            let bytes = u.measured_bytes();
            self.held_bytes = self.held_bytes.saturating_sub(u.bytes) + bytes;
            u.bytes = bytes;
        }
    }

    /// Spills the oldest batch held in memory; returns its size (0: none is held).
    fn spill_one(&mut self) -> usize {
        let Some(u) = self.unflushed.get_mut(self.spilled) else {
            return 0;
        };
        if u.runs.take().is_none() {
            return 0;
        }
        self.spilled += 1;
        self.held_bytes = self.held_bytes.saturating_sub(u.bytes);
        self.spilled_bytes += u.bytes;
        u.bytes
    }
}

struct Table {
    id: String,
    manifest: Manifest,
    state: Mutex<TableState>,
    /// One flush of this table at a time on this node (a flush takes the oldest unflushed
    /// batches).
    flushing: tokio::sync::Mutex<()>,
    /// One compaction of this table at a time on this node.
    compacting: tokio::sync::Mutex<()>,
    /// This node's commits to the table's manifest, each with its install and the Iceberg
    /// publication that follows it, one at a time. A flush and a compaction run side by side
    /// (a compaction must not hold up the flushes that appends over the budget wait for);
    /// each commits on the newest installed state, and taking turns keeps the views that
    /// commits publish in version order, so that each carries the snapshots of the one
    /// before. (Garbage collection and catalog loads publish too, outside this lock; a
    /// publication never goes back to an older version.)
    committing: Arc<tokio::sync::Mutex<()>>,
    /// When a refresh last checked the manifest's floor (see [`Manifest::refresh`]).
    floor_checked: Mutex<Option<Instant>>,
    /// The last batch schema an append found labelled (see [`Tables::append`]): the batches of
    /// a table's ingest share their schema, so its check runs once per shape.
    labelled: Mutex<Option<SchemaRef>>,
    /// Encodes the table's log records.
    records: files::RecordEncoder,
}

/// How often a refresh that finds nothing new checks whether its state fell below the
/// manifest's floor (versions collected away).
const FLOOR_CHECK_INTERVAL: Duration = Duration::from_secs(30);

impl Table {
    /// A table of this manifest state, nothing unflushed.
    fn new(id: &str, manifest: Manifest, state: ManifestState) -> Table {
        Table {
            id: id.to_owned(),
            manifest,
            state: Mutex::new(TableState {
                manifest: state,
                unflushed: VecDeque::new(),
                held_bytes: 0,
                spilled: 0,
                spilled_bytes: 0,
                last_append: None,
            }),
            flushing: tokio::sync::Mutex::new(()),
            compacting: tokio::sync::Mutex::new(()),
            committing: Arc::new(tokio::sync::Mutex::new(())),
            floor_checked: Mutex::new(None),
            labelled: Mutex::new(None),
            records: files::RecordEncoder::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TableState> {
        // A panic while holding the lock leaves plain data behind; keep serving it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a committed batch of `bytes` in memory to the unflushed set, joined to the
    /// newest entry when both are small (see the module docs).
    fn push(&self, lsn: Lsn, batch: RecordBatch, bytes: usize) {
        let rows = batch.num_rows();
        let mut state = self.lock();
        let spilled = state.spilled;
        let len = state.unflushed.len();
        if bytes < COALESCE_BELOW_BYTES
            && len > spilled
            && let Some(tail) = state.unflushed.back_mut()
            && !tail.cut
            && tail.bytes < COALESCE_BELOW_BYTES
            && let Some(runs) = &mut tail.runs
            && runs
                .first()
                .is_some_and(|run| run.batch.schema_ref() == batch.schema_ref())
        {
            let before = tail.bytes;
            // An entry this batch takes to the size past which it takes no more joins its
            // waiting batches now (once joined they may be small enough to take more).
            let close = before + bytes >= COALESCE_BELOW_BYTES;
            push_run(runs, &mut tail.pending, Run { batch, bytes }, close);
            tail.rows += rows;
            tail.lsns.push(lsn);
            tail.ends.push(tail.rows);
            tail.bytes = tail.measured_bytes();
            let after = tail.bytes;
            state.held_bytes = state.held_bytes.saturating_sub(before) + after;
            return;
        }
        let mut entry = Unflushed {
            lsns: vec![lsn],
            ends: vec![rows],
            runs: Some(vec![Run { batch, bytes }]),
            pending: 1,
            rows,
            bytes,
            at: Instant::now(),
            cut: false,
        };
        entry.bytes += entry.index_bytes();
        state.held_bytes += entry.bytes;
        state.unflushed.push_back(entry);
    }
}

/// Checks that a table id is safe to use in object paths.
fn check_id(id: &str) -> Result<(), TableError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(TableError::NotFound(format!("{id:?} (invalid table id)")))
    }
}

/// What a table's committed versions are shown to: the Iceberg view ([`crate::iceberg`]
/// implements it; `db` wires it in). Tables know nothing of that view beyond this.
#[async_trait::async_trait]
pub(crate) trait ManifestObserver: Send + Sync {
    /// Table `id` installed `state` (a flush or a compaction committed it): show it. Best
    /// effort: the commit stands either way, and the next install or collection shows it
    /// again.
    async fn installed(&self, id: &str, state: &ManifestState);

    /// Garbage collection of table `id` is about to judge its objects against `state`: show
    /// `state`, then answer which of the observer's own objects nothing it keeps references.
    async fn collectable(&self, id: &str, state: &ManifestState)
    -> Result<Collectable, TableError>;
}

/// What a [`ManifestObserver`] lets garbage collection delete.
#[derive(Debug, Default)]
pub(crate) struct Collectable {
    /// Its own objects no longer referenced, with their sizes.
    pub(crate) objects: Vec<(String, u64)>,
    /// Whether it showed the state whole: when not, what it still shows may reference any
    /// data file of the table, so none is deleted.
    pub(crate) complete: bool,
}

/// All tables of one node: appends, snapshots, flushes and compaction.
pub struct Tables {
    log: CommitLog,
    consumer: LogConsumer,
    storage: Storage,
    node: Arc<Node>,
    config: TableConfig,
    tables: RwLock<HashMap<String, Arc<Table>>>,
    stats: OpStats,
    /// Woken by an append that takes a table past `flush_bytes`, so the flush starts at
    /// once rather than on the next tick (which would let memory grow by a tick's ingest).
    flush_wanted: tokio::sync::Notify,
    /// Woken after every flush: ingest waiting for memory headroom looks again.
    flushed: tokio::sync::Notify,
    /// How many times `flushed` was woken (see [`Tables::freed_memory`]).
    freed: AtomicU64,
    /// `freed` as it was when an append last waited its whole `headroom_wait` for headroom
    /// in vain (`u64::MAX`: never): until a flush frees memory again, appends over the
    /// budget are refused at once.
    stalled_at: AtomicU64,
    /// How long garbage collection keeps unreferenced objects.
    gc_grace: Duration,
    /// Objects garbage collection has seen unreferenced.
    gc: Mutex<crate::storage::gc::Unreferenced>,
    /// Whether batches may be spilled: the log's local segments are its records.
    spills: bool,
    /// Log records readers of spilled batches still need, by reader.
    holds: Arc<Mutex<BTreeMap<u64, Lsn>>>,
    next_hold: AtomicU64,
    /// Held while batches are chosen and spilled (`spill_over_budget`).
    spilling: Mutex<()>,
    /// Shown every committed version (the Iceberg view); none in tests of tables alone.
    observer: Option<Arc<dyn ManifestObserver>>,
}

/// Work counters of flushes and compactions (for metrics).
#[derive(Debug, Default)]
pub struct OpStats {
    /// Flushes that wrote a file.
    pub flushes: AtomicU64,
    /// Their total time, in nanoseconds.
    pub flush_nanos: AtomicU64,
    /// Unflushed batches spilled (see [`TableConfig::max_spilled_bytes`]).
    pub spills: AtomicU64,
    /// Spilled batches read back from the log, by queries and flushes.
    pub spilled_reads: Arc<AtomicU64>,
    /// Compactions that wrote a file.
    pub compactions: AtomicU64,
    /// Their total time, in nanoseconds.
    pub compaction_nanos: AtomicU64,
}

impl std::fmt::Debug for Tables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tables")
            .field("node", &self.node.id())
            .field("storage", &self.storage.url())
            .finish()
    }
}

impl Tables {
    /// Opens the table engine over `log` and `storage`, replaying the table records of
    /// `replay` (the records [`CommitLog::open`] returned) that no Parquet file holds yet.
    ///
    /// `node` names this node's log in manifests (see [`crate::node`]). `live` holds the
    /// storage ids of the tables the catalog names (`None`: every table whose manifest
    /// exists): the records of any other table are skipped, as that table was dropped since
    /// they were written, and its storage, whatever garbage collection has left of it so
    /// far, is never read. (A node ingests only into tables its catalog names, and the
    /// catalog only moves forward, so a table missing from the newest catalog stays dropped.)
    pub async fn open(
        log: CommitLog,
        replay: &[Record],
        storage: Storage,
        node: Arc<Node>,
        config: TableConfig,
        gc_grace: Duration,
        live: Option<&std::collections::HashSet<String>>,
    ) -> Result<Tables, TableError> {
        Self::open_observed(log, replay, storage, node, config, gc_grace, live, None).await
    }

    /// [`Tables::open`], showing every committed version to `observer` (the Iceberg view).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn open_observed(
        log: CommitLog,
        replay: &[Record],
        storage: Storage,
        node: Arc<Node>,
        config: TableConfig,
        gc_grace: Duration,
        live: Option<&std::collections::HashSet<String>>,
        observer: Option<Arc<dyn ManifestObserver>>,
    ) -> Result<Tables, TableError> {
        let consumer = log.consumer("tables")?;
        let spills = log.reader().is_some() && config.max_spilled_bytes > 0;
        let tables = Tables {
            log,
            consumer,
            storage,
            node,
            config,
            tables: RwLock::new(HashMap::new()),
            stats: OpStats::default(),
            flush_wanted: tokio::sync::Notify::new(),
            flushed: tokio::sync::Notify::new(),
            freed: AtomicU64::new(0),
            stalled_at: AtomicU64::new(u64::MAX),
            gc_grace,
            gc: Mutex::new(crate::storage::gc::Unreferenced::default()),
            spills,
            holds: Arc::new(Mutex::new(BTreeMap::new())),
            next_hold: AtomicU64::new(0),
            spilling: Mutex::new(()),
            observer,
        };
        for record in replay.iter().filter(|r| r.kind == RecordKind::TableBatch) {
            let (id, batch) = files::decode_record(&record.payload)?;
            if live.is_some_and(|live| !live.contains(&id)) {
                continue;
            }
            let table = match tables.get(&id) {
                Some(t) => t,
                None => match tables.open_table(&id).await {
                    Ok(t) => t,
                    // A table dropped since: its records have nowhere to go.
                    Err(TableError::NotFound(_)) => continue,
                    Err(e) => return Err(e),
                },
            };
            let covered = table
                .lock()
                .manifest
                .flushed
                .get(tables.node.id())
                .copied()
                .unwrap_or(0);
            if record.lsn > covered {
                // Decoded from the record, its arrays share one buffer, which
                // `get_array_memory_size` would count once for each of them.
                table.push(record.lsn, batch, record.payload.len());
                // Replay holds what an append would: past the memory budget, batches stay
                // in the log only.
                tables.spill_over_budget();
            }
        }
        tables.release_log()?;
        Ok(tables)
    }

    fn get(&self, id: &str) -> Option<Arc<Table>> {
        self.tables
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    fn insert(
        &self,
        id: &str,
        manifest: Manifest,
        state: ManifestState,
    ) -> Result<Arc<Table>, TableError> {
        state.schema()?;
        let table = Arc::new(Table::new(id, manifest, state));
        let mut tables = self.tables.write().unwrap_or_else(|p| p.into_inner());
        Ok(tables.entry(id.to_owned()).or_insert(table).clone())
    }

    /// Forgets a dropped table whose storage garbage collection removed (its unflushed
    /// batches, if any, belong to no table).
    fn forget_table(&self, id: &str) {
        self.tables
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }

    /// Creates a table with these columns (computed ones included: batches carry their
    /// values), with ids = positions from 1. Creating an existing table with the same columns
    /// is a no-op.
    pub async fn create_table(&self, id: &str, columns: &[Column]) -> Result<(), TableError> {
        let ids: Vec<i32> = (0..columns.len())
            .map(crate::catalog::position_id)
            .collect();
        self.create_table_shaped(id, columns, &ids, 0).await
    }

    /// [`Tables::create_table`] with the columns' ids `ids` and schema id `schema_id` (a
    /// table whose catalog columns changed before its storage was created).
    pub(crate) async fn create_table_shaped(
        &self,
        id: &str,
        columns: &[Column],
        ids: &[i32],
        schema_id: i32,
    ) -> Result<(), TableError> {
        check_id(id)?;
        let manifest = Manifest::new(id, self.config.checkpoint_interval);
        let state = manifest
            .create(self.storage.store().as_ref(), columns, ids, schema_id)
            .await?;
        if self.get(id).is_none() {
            self.insert(id, manifest, state)?;
        }
        Ok(())
    }

    /// Opens a table that exists in object storage (created by this or another node).
    async fn open_table(&self, id: &str) -> Result<Arc<Table>, TableError> {
        check_id(id)?;
        if let Some(t) = self.get(id) {
            return Ok(t);
        }
        let manifest = Manifest::new(id, self.config.checkpoint_interval);
        let state = manifest.load(self.storage.store().as_ref()).await?;
        self.insert(id, manifest, state)
    }

    async fn table(&self, id: &str) -> Result<Arc<Table>, TableError> {
        match self.get(id) {
            Some(t) => Ok(t),
            None => self.open_table(id).await,
        }
    }

    /// The Arrow schema of a table: its current shape, each field with its column id.
    pub async fn schema(&self, id: &str) -> Result<SchemaRef, TableError> {
        self.table(id).await?.lock().manifest.schema()
    }

    /// Commits a new shape of a table (its catalog's columns changed): its columns, their
    /// ids, its schema id and the highest column id it ever gave. A no-op when the manifest's
    /// schema id is that one or newer already. No data file is rewritten.
    pub(crate) async fn set_shape(
        &self,
        id: &str,
        columns: &[Column],
        ids: &[i32],
        schema_id: i32,
        last_column_id: i32,
    ) -> Result<(), TableError> {
        let table = self.table(id).await?;
        if table.lock().manifest.schema_id >= schema_id {
            return Ok(());
        }
        let change = Change {
            shape: Some((
                manifest::column_specs(columns, ids),
                schema_id,
                last_column_id,
            )),
            ..Change::default()
        };
        let _committing = table.committing.lock().await;
        self.node.ensure_current().await?;
        let manifest = table.lock().manifest.clone();
        let committed = table
            .manifest
            .commit(self.storage.store().as_ref(), &manifest, &change)
            .await?;
        table.lock().install(committed.clone(), self.node.id());
        self.show(id, &committed).await;
        Ok(())
    }

    /// Appends a batch: durable in the commit log and visible to snapshots when this returns.
    /// Returns the batch's log position.
    ///
    /// When the batches held in memory over all tables are past their budget and the spill
    /// budget is used up, waits for flushes (`headroom_wait`), then is refused with nothing
    /// applied ([`TableError::Backpressure`]); refused too when the log is over its byte
    /// budget.
    pub async fn append(&self, id: &str, batch: RecordBatch) -> Result<Lsn, TableError> {
        let table = self.table(id).await?;
        // A batch of any shape of the table is kept (a change of its columns may land while
        // the batch is checked): readers map its columns by id. Its columns must carry ids,
        // distinct ones, and sluice types; a batch without ids must be of the current shape
        // (it takes its ids).
        let mismatch = |reason: String| TableError::SchemaMismatch {
            table: id.to_owned(),
            reason,
        };
        let schema = batch.schema();
        let known = table
            .labelled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|known| Arc::ptr_eq(known, &schema));
        let labelled = known
            || schema.fields().iter().all(|f| {
                f.metadata().contains_key(crate::types::FIELD_ID_KEY)
                    && crate::types::ColumnType::from_field(f).is_some()
            });
        let batch = if labelled {
            if !known {
                let mut seen = std::collections::HashSet::new();
                if !crate::types::field_ids(&schema)
                    .into_iter()
                    .all(|id| seen.insert(id))
                {
                    return Err(mismatch("two columns have one column id".into()));
                }
                *table.labelled.lock().unwrap_or_else(|p| p.into_inner()) = Some(schema);
            }
            batch
        } else {
            let shape = table.lock().manifest.schema()?;
            let same = batch.schema().fields().len() == shape.fields().len()
                && batch
                    .schema()
                    .fields()
                    .iter()
                    .zip(shape.fields())
                    .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
            if !same {
                return Err(mismatch(format!(
                    "expected {shape:?}, got {:?}",
                    batch.schema()
                )));
            }
            RecordBatch::try_new(shape, batch.columns().to_vec())
                .map_err(|e| mismatch(e.to_string()))?
        };
        // Marked before the batch can be pushed: a flush pass never takes the first batch of
        // a burst for a lone one.
        table.lock().last_append = Some(Instant::now());
        // The budget is for all tables together: it bounds the server's memory, however many
        // tables are written at once. Over it, an append waits for flushes rather than grow
        // or refuse; only flushes stuck for long (object storage down) end in a refusal.
        // Appends that waited go ahead together, overshooting by at most what ingest
        // admission lets in at once. Once an append waited its whole patience with no flush
        // done meanwhile, the tables cannot keep up (object storage down, say): appends over
        // the budget are refused at once, so clients back off rather than pile up, until a
        // flush frees memory again.
        if !self.has_headroom() {
            let freed = self.freed.load(Ordering::SeqCst);
            let stalled = self.stalled_at.load(Ordering::SeqCst) == freed;
            if stalled || !self.wait_for_headroom(self.config.headroom_wait).await {
                if !stalled {
                    self.stalled_at.store(freed, Ordering::SeqCst);
                }
                return Err(TableError::Backpressure {
                    table: id.to_owned(),
                    bytes: self.held_total(),
                    budget: self.config.max_unflushed_bytes,
                });
            }
        }
        let payload = table.records.encode(id, &batch)?;
        let bytes = batch.get_array_memory_size();
        let applied = table.clone();
        let lsn = self
            .log
            .append_applied(RecordKind::TableBatch, payload, move |lsn| {
                applied.push(lsn, batch, bytes);
            })
            .await?;
        self.spill_over_budget();
        // Within a burst that may be deferred, the loop would find nothing to do.
        if table.lock().unflushed_bytes() >= self.config.flush_bytes && !self.may_defer() {
            self.flush_wanted.notify_one();
        }
        Ok(lsn)
    }

    /// What a query reads of the table now.
    pub async fn snapshot(&self, id: &str) -> Result<TableSnapshot, TableError> {
        let table = self.table(id).await?;
        let state = table.lock();
        // One pass: every unflushed batch is read from memory or from the log, once.
        let (mut lsns, mut spilled_rows, mut batches) = (Vec::new(), 0u64, Vec::new());
        for u in &state.unflushed {
            match &u.runs {
                Some(runs) => batches.extend(runs.iter().map(|r| r.batch.clone())),
                None => {
                    lsns.extend_from_slice(&u.lsns);
                    spilled_rows += u.rows as u64;
                }
            }
        }
        let spilled = lsns.first().copied().map(|first| SpilledBatches {
            table: id.to_owned(),
            lsns: lsns.into(),
            rows: spilled_rows,
            log: self.log.clone(),
            reads: self.stats.spilled_reads.clone(),
            // Taken under the table's lock: a flush that takes these batches out of the set
            // after this cannot release their records before the hold is seen.
            _kept: Arc::new(LogHold::new(&self.holds, &self.next_hold, first)),
        });
        Ok(TableSnapshot {
            schema: state.manifest.schema()?,
            files: state
                .manifest
                .files
                .iter()
                .map(|f| DataFile {
                    field_ids: state.manifest.file_field_ids(f),
                    ..f.clone()
                })
                .collect(),
            spilled,
            batches,
            version: state.manifest.version,
        })
    }

    /// Size figures of a table.
    pub async fn stats(&self, id: &str) -> Result<TableStats, TableError> {
        let table = self.table(id).await?;
        let state = table.lock();
        Ok(TableStats {
            files: state.manifest.files.len(),
            file_bytes: state.manifest.files.iter().map(|f| f.bytes).sum(),
            file_rows: state.manifest.files.iter().map(|f| f.rows).sum(),
            unflushed_batches: state.unflushed.len(),
            unflushed_bytes: state.unflushed_bytes(),
            spilled_bytes: state.spilled_bytes,
            unflushed_rows: state.unflushed.iter().map(|u| u.rows as u64).sum(),
        })
    }

    /// Ids of the tables this node has open.
    pub(crate) fn open_tables(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .tables
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        ids.sort();
        ids
    }

    /// Reads manifest versions other nodes committed to a table since this node last looked.
    pub async fn refresh(&self, id: &str) -> Result<(), TableError> {
        let table = self.table(id).await?;
        let mut manifest = table.lock().manifest.clone();
        let check_floor = {
            let mut checked = table
                .floor_checked
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let due = checked.is_none_or(|at| at.elapsed() >= FLOOR_CHECK_INTERVAL);
            if due {
                *checked = Some(Instant::now());
            }
            due
        };
        if table
            .manifest
            .refresh(self.storage.store().as_ref(), &mut manifest, check_floor)
            .await?
        {
            // Our own flush, committed with its answer lost, takes its rows out of memory here
            // (as does a flush superseded by that commit): appends waiting for headroom look
            // again.
            table.lock().install(manifest, self.node.id());
            self.freed_memory();
        }
        Ok(())
    }

    /// Flushes a table's unflushed batches to Parquet: one file, or one for each part of
    /// the spilled batches that fits the memory budget. Returns the last file, if any, once
    /// its Iceberg view is published too.
    pub async fn flush(&self, id: &str) -> Result<Option<DataFile>, TableError> {
        self.flush_publishing(id, Publish::Await, true).await
    }

    /// Flushes the table's oldest unflushed batches (see `flush_once`); with `whole`, again
    /// until every batch unflushed at the call is in a file.
    async fn flush_publishing(
        &self,
        id: &str,
        publish: Publish,
        whole: bool,
    ) -> Result<Option<DataFile>, TableError> {
        let table = self.table(id).await?;
        let until = table.lock().unflushed.back().map(Unflushed::last_lsn);
        let mut last = None;
        let mut front = None;
        loop {
            let started = Instant::now();
            let Some((file, through)) = self.flush_once(id, publish).await? else {
                // Nothing left, or a cut superseded by a commit of ours that landed (its rows
                // left the set): go on for what is left of the call's batches.
                let now = table.lock().unflushed.front().map(Unflushed::first_lsn);
                let left = now.is_some_and(|lsn| until.is_some_and(|until| lsn <= until));
                // Again only while each pass moves the set on.
                if whole && left && now != front {
                    front = now;
                    continue;
                }
                return Ok(last);
            };
            self.stats.flushes.fetch_add(1, Ordering::Relaxed);
            self.stats
                .flush_nanos
                .fetch_add(elapsed_nanos(started), Ordering::Relaxed);
            last = Some(file);
            if !whole || until.is_none_or(|until| through >= until) {
                return Ok(last);
            }
        }
    }

    /// Flush and compaction counters.
    pub fn op_stats(&self) -> &OpStats {
        &self.stats
    }

    /// Waits until all tables together hold at most the unflushed budget in memory (spilling
    /// what the spill budget allows), or `patience` passes (then the append that follows
    /// answers backpressure as before). Returns whether there is headroom.
    pub(crate) async fn wait_for_headroom(&self, patience: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            // Registered before the check, so a flush between the two is not missed.
            let flushed = self.flushed.notified();
            tokio::pin!(flushed);
            flushed.as_mut().enable();
            if self.has_headroom() {
                return true;
            }
            self.flush_wanted.notify_one();
            if tokio::time::timeout_at(deadline, flushed).await.is_err() {
                return false;
            }
        }
    }

    /// Wakes appends waiting for headroom after a commit took batches out of memory; appends
    /// over the budget wait for flushes again.
    fn freed_memory(&self) {
        self.freed.fetch_add(1, Ordering::SeqCst);
        self.flushed.notify_waiters();
    }

    /// Whether the batches held in memory are within the budget, once what is over it has
    /// been spilled as far as the spill budget allows.
    fn has_headroom(&self) -> bool {
        self.spill_over_budget() <= self.config.max_unflushed_bytes
    }

    /// Bytes of unflushed batches held in memory, all open tables together.
    fn held_total(&self) -> usize {
        let tables = self.tables.read().unwrap_or_else(|p| p.into_inner());
        tables.values().map(|t| t.lock().held_bytes).sum()
    }

    /// Bytes of spilled batches, all open tables together.
    fn spilled_total(&self) -> usize {
        let tables = self.tables.read().unwrap_or_else(|p| p.into_inner());
        tables.values().map(|t| t.lock().spilled_bytes).sum()
    }

    /// How many bytes may be spilled over all tables: `max_spilled_bytes`, and at most half
    /// the log's disk budget (spilled records keep the log from being released).
    fn spill_budget(&self) -> usize {
        let log_half = usize::try_from(self.log.max_bytes() / 2).unwrap_or(usize::MAX);
        self.config.max_spilled_bytes.min(log_half)
    }

    /// Whether flushes of tables in a burst may wait for its end: batches can be spilled,
    /// less than half the spill budget is, and the log is less than half full.
    fn may_defer(&self) -> bool {
        self.spills
            && self.spilled_total() < self.spill_budget() / 2
            && self.log.disk_bytes() < self.log.max_bytes() / 2
    }

    /// Spills the oldest batches held in memory, of all tables (by LSN), while more than the
    /// budget is held and the spill budget has room. The records are in the log already: a
    /// batch is pushed only once its record is durable (or written, with
    /// `Durability::None`). Returns the bytes held in memory then, all tables together.
    fn spill_over_budget(&self) -> usize {
        // Within the budget (most appends), nothing to decide: no turn to wait for.
        let held = self.held_total();
        if !self.spills || held <= self.config.max_unflushed_bytes {
            return held;
        }
        // One at a time: callers deciding on the same totals would spill too much.
        let _spilling = self.spilling.lock().unwrap_or_else(|p| p.into_inner());
        let tables: Vec<Arc<Table>> = {
            let tables = self.tables.read().unwrap_or_else(|p| p.into_inner());
            tables.values().cloned().collect()
        };
        let budget = self.spill_budget();
        for t in &tables {
            t.lock().join_waiting();
        }
        loop {
            let (mut held, mut spilled) = (0, 0);
            let mut oldest: Option<(Lsn, &Arc<Table>)> = None;
            for t in &tables {
                let state = t.lock();
                held += state.held_bytes;
                spilled += state.spilled_bytes;
                if let Some(first_held) = state.unflushed.get(state.spilled)
                    && oldest.is_none_or(|(lsn, _)| first_held.first_lsn() < lsn)
                {
                    oldest = Some((first_held.first_lsn(), t));
                }
            }
            if held <= self.config.max_unflushed_bytes || spilled >= budget {
                return held;
            }
            let Some((_, table)) = oldest else {
                return held;
            };
            if table.lock().spill_one() == 0 {
                return held;
            }
            self.stats.spills.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Unflushed bytes (in memory or spilled) of every open table, by table id.
    pub(crate) fn unflushed_by_table(&self) -> Vec<(String, u64)> {
        let tables = self.tables.read().unwrap_or_else(|p| p.into_inner());
        tables
            .iter()
            .map(|(id, t)| (id.clone(), t.lock().unflushed_bytes() as u64))
            .collect()
    }

    /// Flushes the table's oldest unflushed batches to one file: all of them, but of the
    /// spilled ones only as many as the memory budget holds decoded (at least one). Returns
    /// the file and the last LSN it covers.
    async fn flush_once(
        &self,
        id: &str,
        publish: Publish,
    ) -> Result<Option<(DataFile, Lsn)>, TableError> {
        let table = self.table(id).await?;
        let flushing = table.flushing.lock().await;
        // The cut: a prefix of what is unflushed now. Appends may go on; they land after it.
        let chunk = self.config.max_unflushed_bytes.max(self.config.flush_bytes);
        let cut = {
            let mut state = table.lock();
            let spilled = state.spilled;
            let mut taken: Vec<(Vec<Lsn>, Option<Vec<RecordBatch>>)> = Vec::new();
            let mut bytes = 0;
            // The entries this cut is the first to take (by last record, which a cut entry
            // keeps): no commit can have covered up to them yet.
            let mut fresh = Vec::new();
            for u in state.unflushed.iter_mut() {
                // With spilled batches in it, the cut is at most a budget's worth: what the
                // flush decodes besides what memory holds.
                if spilled > 0 && !taken.is_empty() && bytes + u.bytes > chunk {
                    break;
                }
                bytes += u.bytes;
                // Its rows are this flush's now: a later batch starts an entry of its own.
                if !u.cut {
                    fresh.push(u.last_lsn());
                }
                u.cut = true;
                let runs = u
                    .runs
                    .as_ref()
                    .map(|runs| runs.iter().map(|r| r.batch.clone()).collect::<Vec<_>>());
                taken.push((u.lsns.clone(), runs));
            }
            let first = taken.first().and_then(|(lsns, _)| lsns.first().copied());
            let last = taken.last().and_then(|(lsns, _)| lsns.last().copied());
            match (first, last) {
                (Some(first), Some(last)) => {
                    // A refresh may take these batches out of memory (an earlier commit of
                    // ours that landed): their records stay until this flush is done.
                    let kept = LogHold::new(&self.holds, &self.next_hold, first);
                    Some((taken, first, last, kept, fresh))
                }
                _ => None,
            }
        };
        let Some((taken, first_lsn, last_lsn, kept, fresh)) = cut else {
            if let Publish::Await = publish {
                // The loop's last flush of this table may still be publishing its view
                // (`Publish::Behind`): a caller that awaits gets it published too.
                drop(table.committing.lock().await);
            }
            return Ok(None);
        };
        // Until its commit is attempted, a failure leaves no trace in the manifest: the
        // entries this cut took first may take records again (an entry some earlier commit
        // may cover, ambiguous, stays cut).
        let prepared: Result<_, TableError> = async {
            let mut reader = self.log.reader();
            let table_id = id.to_owned();
            let reads = self.stats.spilled_reads.clone();
            let (file, written) = self
                .write_data_file(&table, move || {
                    let mut batches = Vec::with_capacity(taken.len());
                    for (lsns, batch) in taken {
                        match batch {
                            Some(runs) => batches.extend(runs),
                            None => {
                                let reader = reader.as_mut().ok_or_else(|| {
                                    TableError::Task(
                                        "spilled batches need the commit log's local segments"
                                            .into(),
                                    )
                                })?;
                                for lsn in lsns {
                                    batches.push(read_spilled(reader, &table_id, lsn, &reads)?);
                                }
                            }
                        }
                    }
                    Ok(batches)
                })
                .await?;
            let committing = table.committing.clone().lock_owned().await;
            self.node.ensure_current().await?;
            // Measured from the upload's start (the object's age as garbage collection sees
            // it), not from the cut: encoding a large cut (a taken-over node's whole log) on a
            // busy machine may take longer than the deadline, and a clock that counted it
            // would fail every retry alike.
            if written.elapsed() > self.commit_deadline() {
                // Garbage collection may take a file this old for an orphan: write it again.
                return Err(TableError::Task(
                    "the flushed file waited too long for its commit".into(),
                ));
            }
            Ok((file, committing))
        }
        .await;
        let (file, committing) = match prepared {
            Ok(prepared) => prepared,
            Err(e) => {
                table.lock().uncut(&fresh);
                return Err(e);
            }
        };
        let node = self.node.id().to_owned();
        let change = Change {
            added: vec![file.clone()],
            removed: Vec::new(),
            flushed: BTreeMap::from([(node.clone(), last_lsn)]),
            // Rows of this cut already in a file (an earlier commit that landed with its
            // answer lost) must not be written twice.
            flushed_below: Some((node.clone(), first_lsn)),
            shape: None,
        };
        // The newest state: a compaction may have committed since the cut.
        let manifest = table.lock().manifest.clone();
        let committed = match table
            .manifest
            .commit(self.storage.store().as_ref(), &manifest, &change)
            .await
        {
            Ok(committed) => committed,
            Err(TableError::Conflict(reason)) => {
                // Our file was never referenced: no commit of ours landed.
                let _ = self
                    .storage
                    .store()
                    .delete(&Path::from(file.path.as_str()))
                    .await;
                self.refresh(id).await?;
                tracing::info!(table = %id, %reason, "flush superseded; rows already in files");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        // Swap in one step: the file appears and its batches leave together.
        table.lock().install(committed.clone(), &node);
        self.freed_memory();
        // The next flush may cut and encode while this one's view is published; its commit
        // waits for the publication.
        drop(flushing);
        // The batches are in the file now: their records need no keeping.
        drop(kept);
        self.release_log()?;
        match publish {
            Publish::Await => self.show(id, &committed).await,
            Publish::Behind => {
                let (observer, id) = (self.observer.clone(), id.to_owned());
                tokio::spawn(async move {
                    if let Some(observer) = observer {
                        observer.installed(&id, &committed).await;
                    }
                    drop(committing);
                });
            }
        }
        Ok(Some((file, last_lsn)))
    }

    /// Writes the batches `make` produces (on a blocking thread: encoding is CPU work) as a
    /// new Parquet object of `table`, and returns its manifest entry.
    async fn write_data_file(
        &self,
        table: &Table,
        make: impl FnOnce() -> Result<Vec<RecordBatch>, TableError> + Send + 'static,
    ) -> Result<(DataFile, Instant), TableError> {
        let path = paths::new_table_data_file(&table.id);
        let (current, last_column_id) = {
            let state = table.lock();
            (state.manifest.schema()?, state.manifest.last_column_id())
        };
        let row_group_rows = self.config.row_group_rows;
        let (bytes, file) = tokio::task::spawn_blocking(move || {
            let batches = make()?;
            let inputs: Vec<SchemaRef> = batches.iter().map(RecordBatch::schema).collect();
            let shape = files::written_shape(&current, last_column_id, &inputs);
            let batches = files::project_all(&batches, &shape)?;
            files::write_parquet(&shape, &batches, row_group_rows, path)
        })
        .await
        .map_err(|e| TableError::Task(e.to_string()))??;
        let mut file = file;
        table.lock().manifest.omit_default_field_ids(&mut file);
        let put = self.put_data_file(&file, bytes).await?;
        Ok((file, put))
    }

    async fn fetch(&self, path: &str) -> Result<bytes::Bytes, TableError> {
        self.storage
            .store()
            .get(&Path::from(path))
            .await
            .map_err(TableError::Storage)?
            .bytes()
            .await
            .map_err(TableError::Storage)
    }

    /// Uploads a data file; returns when the upload began, the earliest its object's
    /// modification time can be (what garbage collection ages orphans by).
    async fn put_data_file(
        &self,
        file: &DataFile,
        bytes: bytes::Bytes,
    ) -> Result<Instant, TableError> {
        let began = Instant::now();
        self.storage
            .store()
            .put(&Path::from(file.path.as_str()), bytes.into())
            .await
            .map_err(TableError::Storage)?;
        Ok(began)
    }

    /// Flushes every table that is over its size or age threshold (or every table with
    /// unflushed data when `all` is set, as at shutdown). Returns how many files were written,
    /// once the Iceberg views of every flush so far are published, the maintenance loop's
    /// included (shutdown and the release of a hosted node call this last).
    pub async fn flush_due(&self, all: bool) -> Result<usize, TableError> {
        let flushed = self.flush_due_publishing(all, Publish::Await).await;
        self.published().await;
        flushed
    }

    /// Waits until no Iceberg publication of a flush is pending: each holds its table's
    /// commits until it is done.
    async fn published(&self) {
        let open: Vec<Arc<Table>> = self
            .tables
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for table in open {
            drop(table.committing.lock().await);
        }
    }

    /// With `all`, flushes every unflushed batch of every table; otherwise the oldest part
    /// of each table that is due (see `flush_once`).
    async fn flush_due_publishing(&self, all: bool, publish: Publish) -> Result<usize, TableError> {
        // Over the memory budget with the spill budget used up, every table with unflushed
        // rows is due.
        let over = !self.has_headroom();
        // A table in a burst of appends waits for its end while batches can be spilled (with
        // half the spill budget left for the time its flushes take after); its oldest batch
        // reaching `flush_interval` makes it due all the same.
        let may_defer = self.may_defer();
        let due: Vec<String> = {
            let tables = self.tables.read().unwrap_or_else(|p| p.into_inner());
            tables
                .values()
                .filter(|t| {
                    let state = t.lock();
                    let Some(oldest) = state.unflushed.front() else {
                        return false;
                    };
                    let burst = state
                        .last_append
                        .is_some_and(|at| at.elapsed() < self.config.flush_quiet);
                    all || over
                        || oldest.at.elapsed() >= self.config.flush_interval
                        || (!(burst && may_defer)
                            && (state.spilled > 0
                                || state.unflushed_bytes() >= self.config.flush_bytes))
                })
                .map(|t| t.id.clone())
                .collect()
        };
        let mut written = 0;
        let mut first_error = None;
        for id in due {
            match self.flush_publishing(&id, publish, all).await {
                Ok(Some(_)) => written += 1,
                Ok(None) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        // A table flushes a part of its spilled batches at a time: the loop comes back for
        // the rest at once.
        if written > 0 && first_error.is_none() && self.spilled_total() > 0 {
            self.flush_wanted.notify_one();
        }
        // Records of other consumers (streams) move the log on while no table flushes: tell
        // the log on every pass how far tables need it.
        if let Err(e) = self.release_log() {
            first_error.get_or_insert(e);
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(written),
        }
    }

    /// Merges a table's small files into one when it has enough of them. Returns the new file.
    /// Then writes again, in the current shape, up to [`RESHAPED_PER_PASS`] files that still
    /// hold a column the table dropped (see [`files::rewrite_parquet`]).
    pub async fn compact(&self, id: &str) -> Result<Option<DataFile>, TableError> {
        let started = Instant::now();
        let written = self.compact_once(id).await?;
        if written.is_some() {
            self.stats.compactions.fetch_add(1, Ordering::Relaxed);
            self.stats
                .compaction_nanos
                .fetch_add(elapsed_nanos(started), Ordering::Relaxed);
        }
        for _ in 0..RESHAPED_PER_PASS {
            let started = Instant::now();
            match self.reshape_once(id).await {
                Ok(Some(_)) => {}
                Ok(None) => break,
                // Another node's rewrite of the same file, say: the next pass picks again.
                Err(error) => {
                    tracing::debug!(table = %id, %error, "rewriting a file without a dropped column failed");
                    break;
                }
            }
            self.stats.compactions.fetch_add(1, Ordering::Relaxed);
            self.stats
                .compaction_nanos
                .fetch_add(elapsed_nanos(started), Ordering::Relaxed);
        }
        Ok(written)
    }

    /// Writes one file that holds a column the table dropped again without it, if there is
    /// one. Returns the new file.
    async fn reshape_once(&self, id: &str) -> Result<Option<DataFile>, TableError> {
        let table = self.table(id).await?;
        let _compacting = table.compacting.lock().await;
        let manifest = table.lock().manifest.clone();
        // One of them at random: nodes sharing the table rarely pick the same file, and a
        // file that fails to be written again holds up none of the others.
        let holding: Vec<&DataFile> = manifest
            .files
            .iter()
            .filter(|f| manifest.holds_dropped_column(f))
            .collect();
        if holding.is_empty() {
            return Ok(None);
        }
        let pick = uuid::Uuid::new_v4().as_u128() % holding.len() as u128;
        let old = holding[usize::try_from(pick).unwrap_or(0)].clone();
        let current = manifest.schema()?;
        let last_column_id = manifest.last_column_id();
        let bytes = self.fetch(&old.path).await?;
        let path = paths::new_table_data_file(&table.id);
        let row_group_rows = self.config.row_group_rows;
        let (bytes, mut file) = tokio::task::spawn_blocking(move || {
            files::rewrite_parquet(bytes, &current, last_column_id, row_group_rows, path)
        })
        .await
        .map_err(|e| TableError::Task(e.to_string()))??;
        if file.rows != old.rows {
            return Err(TableError::Encoding(format!(
                "{} holds {} rows, its manifest entry says {}",
                old.path, file.rows, old.rows
            )));
        }
        manifest.omit_default_field_ids(&mut file);
        let written = self.put_data_file(&file, bytes).await?;
        self.commit_rewrite(&table, id, file, written, vec![old.path])
            .await
    }

    async fn compact_once(&self, id: &str) -> Result<Option<DataFile>, TableError> {
        let table = self.table(id).await?;
        let _compacting = table.compacting.lock().await;
        let manifest = table.lock().manifest.clone();
        let small_limit = self.config.compact_target_bytes / 2;
        let mut picked: Vec<DataFile> = Vec::new();
        let mut total = 0u64;
        for f in manifest.files.iter().filter(|f| f.bytes < small_limit) {
            if total + f.bytes > self.config.compact_target_bytes && picked.len() >= 2 {
                break;
            }
            total += f.bytes;
            picked.push(f.clone());
        }
        // Enough small files, or at least two that make half a target-sized file.
        let enough = picked.len() >= self.config.compact_min_files
            || total >= self.config.compact_target_bytes / 2;
        if picked.len() < 2 || !enough {
            return Ok(None);
        }
        // Files of full row groups are spliced together as they are (about a memory copy),
        // fetched one at a time; many small row groups (a table written slowly) are worth
        // decoding and re-encoding into full ones, and that is cheap because they are small.
        let rows: u64 = picked.iter().map(|f| f.rows).sum();
        let group_rows = self.config.row_group_rows.max(1) as u64;
        let groups: u64 = picked.iter().map(|f| f.rows.div_ceil(group_rows)).sum();
        let mut spliced = None;
        // Only files in the current shape are spliced: any other is read and written again
        // in it (compaction writes the current shape).
        let current = manifest.schema()?;
        let current_ids: BTreeMap<String, i32> = current
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .zip(crate::types::field_ids(&current))
            .collect();
        let current_shape = picked
            .iter()
            .all(|f| manifest.file_field_ids(f) == current_ids);
        if current_shape && rows >= groups.max(1) * (group_rows / 4) {
            let size: u64 = picked.iter().map(|f| f.bytes).sum();
            let mut splicer = files::Splicer::new(usize::try_from(size).unwrap_or(0));
            let mut same_schema = true;
            for f in &picked {
                let bytes = self.fetch(&f.path).await?;
                let (back, appended) = tokio::task::spawn_blocking(move || {
                    let appended = splicer.append(&bytes);
                    (splicer, appended)
                })
                .await
                .map_err(|e| TableError::Task(e.to_string()))?;
                splicer = back;
                if !appended? {
                    same_schema = false;
                    break;
                }
            }
            if same_schema {
                spliced = Some(
                    tokio::task::spawn_blocking(move || splicer.finish())
                        .await
                        .map_err(|e| TableError::Task(e.to_string()))??,
                );
            }
        }
        let (file, written) = match spliced {
            Some(bytes) => {
                let mut time_ranges: BTreeMap<String, (i64, i64)> = BTreeMap::new();
                for f in &picked {
                    for (column, &(lo, hi)) in &f.time_ranges {
                        let range = time_ranges.entry(column.clone()).or_insert((lo, hi));
                        range.0 = range.0.min(lo);
                        range.1 = range.1.max(hi);
                    }
                }
                let mut file = DataFile {
                    path: paths::new_table_data_file(&table.id),
                    rows,
                    bytes: bytes.len() as u64,
                    time_ranges,
                    field_ids: current_ids,
                };
                manifest.omit_default_field_ids(&mut file);
                let put = self.put_data_file(&file, bytes).await?;
                (file, put)
            }
            None => {
                let mut inputs = Vec::with_capacity(picked.len());
                for f in &picked {
                    inputs.push(self.fetch(&f.path).await?);
                }
                self.write_data_file(&table, move || files::read_parquet(&inputs))
                    .await?
            }
        };
        let removed = picked.iter().map(|f| f.path.clone()).collect();
        self.commit_rewrite(&table, id, file, written, removed)
            .await
    }

    /// Commits `file` (uploaded at `written`) in place of the files `removed`: the end of a
    /// compaction. Called holding the table's compaction lock.
    async fn commit_rewrite(
        &self,
        table: &Table,
        id: &str,
        file: DataFile,
        written: Instant,
        removed: Vec<String>,
    ) -> Result<Option<DataFile>, TableError> {
        let change = Change {
            added: vec![file.clone()],
            removed,
            flushed: BTreeMap::new(),
            flushed_below: None,
            shape: None,
        };
        let _committing = table.committing.lock().await;
        self.node.ensure_current().await?;
        if written.elapsed() > self.commit_deadline() {
            // Garbage collection may take a file this old for an orphan; it collects it.
            return Err(TableError::Task(
                "the compacted file waited too long for its commit".into(),
            ));
        }
        // The newest state: flushes go on while a compaction works. Its files are checked
        // against the state the commit lands on.
        let manifest = table.lock().manifest.clone();
        let committed = match table
            .manifest
            .commit(self.storage.store().as_ref(), &manifest, &change)
            .await
        {
            Ok(c) => c,
            Err(e @ TableError::Conflict(_)) => {
                // Known lost: the merged file was never referenced; remove it.
                let _ = self
                    .storage
                    .store()
                    .delete(&Path::from(file.path.as_str()))
                    .await;
                return Err(e);
            }
            // Any other failure may have landed: the file stays, and garbage collection
            // removes it after the grace period if no version references it.
            Err(e) => return Err(e),
        };
        // Replaced files stay in object storage: snapshots taken before this commit may
        // still read them. Garbage collection reclaims them after the grace period.
        table.lock().install(committed.clone(), self.node.id());
        self.show(id, &committed).await;
        Ok(Some(file))
    }

    /// Shows a committed version to the observer (the Iceberg view), if there is one.
    async fn show(&self, id: &str, state: &ManifestState) {
        if let Some(observer) = &self.observer {
            observer.installed(id, state).await;
        }
    }

    /// The table's newest manifest state, read from the object store (so commits of other
    /// nodes are in it).
    pub(crate) async fn newest_state(&self, id: &str) -> Result<ManifestState, TableError> {
        self.refresh(id).await?;
        let state = self.table(id).await?.lock().manifest.clone();
        Ok(state)
    }

    /// Tells the log which records tables still need: those of unflushed batches.
    fn release_log(&self) -> Result<(), TableError> {
        // Read the tail first: a record applied while the tables are scanned is at or past it.
        let tail = self.log.last_lsn() + 1;
        let tables = self.tables.read().unwrap_or_else(|p| p.into_inner());
        let unflushed = tables
            .values()
            .filter_map(|t| t.lock().unflushed.front().map(Unflushed::first_lsn))
            .min();
        drop(tables);
        // After the tables: a hold taken under a table's lock before that table gave the
        // batches up is seen here.
        let held = self
            .holds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .copied()
            .min();
        let oldest = unflushed.into_iter().chain(held).min();
        self.consumer
            .release_before(oldest.unwrap_or(tail).min(tail))?;
        Ok(())
    }

    /// Runs flushes (and compactions) on a timer until `shutdown` resolves. Errors are
    /// retried on the next tick. Compaction passes run beside the flushes; once `shutdown`
    /// resolves, the loop returns after the pass under way and the Iceberg publications of
    /// its flushes. Dropped before that (a simulated crash), it stops the pass with it. The
    /// final flush is [`crate::db::Database::shutdown`]'s.
    pub async fn run_maintenance(
        self: Arc<Self>,
        tick: Duration,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let mut interval = tokio::time::interval(tick);
        // Compactions run beside the flushes, one pass at a time: a flush waited for a whole
        // pass before, and appends over the unflushed budget with it.
        let mut compactions: Option<AbortOnDrop> = None;
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = self.flush_wanted.notified() => {
                    let _ = self.flush_due_publishing(false, Publish::Behind).await;
                }
                _ = interval.tick() => {
                    let _ = self.flush_due_publishing(false, Publish::Behind).await;
                    if compactions.as_ref().is_none_or(|pass| pass.0.is_finished()) {
                        let tables = self.clone();
                        compactions = Some(AbortOnDrop(tokio::spawn(async move {
                            for id in tables.open_tables() {
                                let _ = tables.compact(&id).await;
                            }
                        })));
                    }
                }
            }
        }
        if let Some(mut pass) = compactions {
            let _ = (&mut pass.0).await;
        }
        // The Iceberg views the loop's flushes publish on tasks of their own are done before
        // it returns.
        self.published().await;
    }
}

/// A task aborted when its handle is dropped: the maintenance loop's compaction pass stops
/// with the loop, as it did when it ran inside it.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Whether a flush waits for its Iceberg view to be published before it returns.
#[derive(Clone, Copy)]
enum Publish {
    /// Published before the flush returns (a caller may read the view next).
    Await,
    /// Published on a task of its own, holding the table's commits until it is done: the
    /// maintenance loop's next flush may cut and encode meanwhile.
    Behind,
}

fn elapsed_nanos(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Array as _, Int64Array};

    fn ids(from: i64, to: i64) -> RecordBatch {
        let schema = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
            "id",
            arrow_schema::DataType::Int64,
            false,
        )]));
        let column = Arc::new(Int64Array::from_iter_values(from..to));
        RecordBatch::try_new(schema, vec![column]).expect("batch")
    }

    fn entry(lsns: &[Lsn], ends: &[usize], batch: Option<RecordBatch>, bytes: usize) -> Unflushed {
        Unflushed {
            lsns: lsns.to_vec(),
            ends: ends.to_vec(),
            rows: ends.last().copied().unwrap_or(0),
            runs: batch.map(|batch| vec![Run { batch, bytes }]),
            pending: 0,
            bytes,
            at: Instant::now(),
            cut: false,
        }
    }

    fn id_values(batch: &RecordBatch) -> Vec<i64> {
        let column = batch.column(0);
        let column = column.as_any().downcast_ref::<Int64Array>().expect("ids");
        column.values().to_vec()
    }

    fn covering(version: u64, lsn: Lsn) -> ManifestState {
        ManifestState {
            version,
            flushed: BTreeMap::from([("n".to_owned(), lsn)]),
            ..ManifestState::default()
        }
    }

    fn held_ids(state: &TableState) -> Vec<i64> {
        let mut out = Vec::new();
        for u in &state.unflushed {
            for run in u.runs.iter().flatten() {
                out.extend(id_values(&run.batch));
            }
        }
        out
    }

    /// A covered position inside a coalesced entry (a commit of another process under this
    /// node's id that grouped the records otherwise) drops exactly the covered records' rows:
    /// none read twice, none lost.
    #[test]
    fn a_position_inside_a_coalesced_entry_trims_it() {
        // Records 10..=13 hold rows 0, 1-2, 3, 4-5; record 14 holds 6-7.
        let first = ids(0, 6);
        let second = ids(6, 8);
        let (a, b) = (
            first.get_array_memory_size(),
            second.get_array_memory_size(),
        );
        let mut state = TableState {
            manifest: ManifestState::default(),
            unflushed: VecDeque::from([
                entry(&[10, 11, 12, 13], &[1, 3, 4, 6], Some(first), a),
                entry(&[14], &[2], Some(second), b),
            ]),
            held_bytes: a + b,
            spilled: 0,
            spilled_bytes: 0,
            last_append: None,
        };
        state.install(covering(1, 9), "n");
        assert_eq!(held_ids(&state), (0..8).collect::<Vec<_>>());
        state.install(covering(2, 11), "n");
        assert_eq!(held_ids(&state), (3..8).collect::<Vec<_>>());
        let front = &state.unflushed[0];
        assert_eq!(
            (front.lsns.as_slice(), front.ends.as_slice()),
            (&[12, 13][..], &[1, 3][..])
        );
        assert_eq!(front.rows, 3);
        let sizes: usize = state.unflushed.iter().map(|u| u.bytes).sum();
        assert_eq!(state.held_bytes, sizes);
        state.install(covering(3, 13), "n");
        assert_eq!(held_ids(&state), vec![6, 7]);
        assert_eq!(state.held_bytes, b);
        state.install(covering(4, 14), "n");
        assert!(state.unflushed.is_empty());
        assert_eq!(state.held_bytes, 0);
    }

    /// A spilled entry is trimmed to the records past the position (its rows are read back
    /// by LSN), and the spilled bytes follow.
    #[test]
    fn a_position_inside_a_spilled_entry_trims_its_records() {
        let mut state = TableState {
            manifest: ManifestState::default(),
            unflushed: VecDeque::from([entry(&[10, 11, 12], &[2, 4, 6], None, 600)]),
            held_bytes: 0,
            spilled: 1,
            spilled_bytes: 600,
            last_append: None,
        };
        state.install(covering(1, 10), "n");
        let front = &state.unflushed[0];
        assert_eq!(
            (front.lsns.as_slice(), front.ends.as_slice()),
            (&[11, 12][..], &[2, 4][..])
        );
        assert_eq!(
            (front.rows, front.bytes, state.spilled_bytes),
            (4, 400, 400)
        );
        assert_eq!(state.spilled, 1);
    }

    /// Small batches joining an entry are held as runs whose row counts follow the binary
    /// form of the entry's rows (each row copied about log2 of them times, not once per
    /// joining batch), keep their order, and count their bytes.
    #[test]
    fn runs_of_an_entry_join_as_a_binary_counter() {
        let mut runs = Vec::new();
        for (k, id) in (0..1000i64).enumerate() {
            let batch = ids(id, id + 1);
            let bytes = batch.get_array_memory_size();
            push_run(&mut runs, &mut 0, Run { batch, bytes }, true);
            let rows = k + 1;
            assert_eq!(runs.len(), rows.count_ones() as usize, "after {rows} rows");
        }
        let counts: Vec<usize> = runs.iter().map(|r| r.batch.num_rows()).collect();
        assert_eq!(counts, vec![512, 256, 128, 64, 32, 8]);
        let held: Vec<i64> = runs.iter().flat_map(|r| id_values(&r.batch)).collect();
        assert_eq!(held, (0..1000).collect::<Vec<_>>());
        for run in &runs {
            assert_eq!(run.bytes, run.batch.get_array_memory_size());
        }
    }

    /// Batches that join an entry wait until `PENDING_RUNS` of them do (or the entry
    /// closes), then are copied into one run at once: runs of `PENDING_RUNS` rows join as a
    /// binary counter, the waiting batches stay in order behind them, and a close joins them.
    #[test]
    fn joining_batches_wait_and_are_copied_together() {
        let (mut runs, mut pending) = (Vec::new(), 0);
        for (k, id) in (0..1000i64).enumerate() {
            let batch = ids(id, id + 1);
            let bytes = batch.get_array_memory_size();
            push_run(&mut runs, &mut pending, Run { batch, bytes }, false);
            let rows = k + 1;
            assert_eq!(pending, rows % PENDING_RUNS, "after {rows} rows");
            let joined = (rows / PENDING_RUNS).count_ones() as usize;
            assert_eq!(runs.len(), joined + pending, "after {rows} rows");
        }
        let counts: Vec<usize> = runs.iter().map(|r| r.batch.num_rows()).collect();
        assert_eq!(counts[..5], [512, 256, 128, 64, 32]);
        assert_eq!(counts[5..], [1; 1000 % PENDING_RUNS]);
        let held: Vec<i64> = runs.iter().flat_map(|r| id_values(&r.batch)).collect();
        assert_eq!(held, (0..1000).collect::<Vec<_>>());
        // The entry closes: what waited is one run of its own, and the rows are in order.
        let batch = ids(1000, 1001);
        let bytes = batch.get_array_memory_size();
        push_run(&mut runs, &mut pending, Run { batch, bytes }, true);
        let counts: Vec<usize> = runs.iter().map(|r| r.batch.num_rows()).collect();
        assert_eq!((counts, pending), (vec![512, 256, 128, 64, 32, 9], 0));
        let held: Vec<i64> = runs.iter().flat_map(|r| id_values(&r.batch)).collect();
        assert_eq!(held, (0..1001).collect::<Vec<_>>());
        for run in &runs {
            assert_eq!(run.bytes, run.batch.get_array_memory_size());
        }
    }

    /// Batches of falling sizes, then a large one, then small ones of mixed sizes: the joined
    /// runs keep Timsort's invariant (each holds more rows than the next two together), so an
    /// entry stays a few runs and fewer than `PENDING_RUNS` waiting batches, in order.
    #[test]
    fn runs_stay_few_whatever_the_sizes_of_the_batches() {
        let (mut runs, mut pending) = (Vec::new(), 0);
        let mut next = 0i64;
        let mut sizes: Vec<i64> = (1..=40).rev().collect();
        sizes.push(800);
        sizes.extend((1..=300).map(|i| i % 7 + 1));
        for n in sizes {
            let batch = ids(next, next + n);
            next += n;
            let bytes = batch.get_array_memory_size();
            push_run(&mut runs, &mut pending, Run { batch, bytes }, false);
            assert!(pending < PENDING_RUNS);
            let counts: Vec<usize> = runs[..runs.len() - pending]
                .iter()
                .map(|r| r.batch.num_rows())
                .collect();
            for w in counts.windows(2) {
                assert!(w[0] > w[1], "{counts:?}");
            }
            for w in counts.windows(3) {
                assert!(w[0] > w[1] + w[2], "{counts:?}");
            }
            let bound = 1.45 * (next as f64).log2() + 2.0;
            assert!(counts.len() as f64 <= bound, "{counts:?}");
        }
        let held: Vec<i64> = runs.iter().flat_map(|r| id_values(&r.batch)).collect();
        assert_eq!(held, (0..next).collect::<Vec<_>>());
    }

    /// A covered position inside an entry of several runs keeps exactly the later rows, in
    /// one run.
    #[test]
    fn a_position_inside_an_entry_of_runs_trims_across_them() {
        let mut runs = Vec::new();
        for id in 0..7i64 {
            let batch = ids(id, id + 1);
            let bytes = batch.get_array_memory_size();
            push_run(&mut runs, &mut 0, Run { batch, bytes }, true);
        }
        assert_eq!(runs.len(), 3);
        let bytes: usize = runs.iter().map(|r| r.bytes).sum();
        let mut u = entry(&[1, 2, 3, 4, 5, 6, 7], &[1, 2, 3, 4, 5, 6, 7], None, bytes);
        u.runs = Some(runs);
        let mut state = TableState {
            manifest: ManifestState::default(),
            unflushed: VecDeque::from([u]),
            held_bytes: bytes,
            spilled: 0,
            spilled_bytes: 0,
            last_append: None,
        };
        state.install(covering(1, 5), "n");
        assert_eq!(held_ids(&state), vec![5, 6]);
        assert_eq!(state.held_bytes, state.unflushed[0].bytes);
        assert_eq!(state.unflushed[0].runs.as_ref().map(Vec::len), Some(1));
    }

    /// A batch of ids `from..to` beside a text column of `pad` bytes a row (a wider row);
    /// `nullable` ids make a schema other than the rest's.
    fn padded(from: i64, to: i64, pad: usize, nullable: bool) -> RecordBatch {
        let schema = Arc::new(arrow_schema::Schema::new(vec![
            arrow_schema::Field::new("id", arrow_schema::DataType::Int64, nullable),
            arrow_schema::Field::new("pad", arrow_schema::DataType::Utf8, false),
        ]));
        let text = "x".repeat(pad);
        let ids = Arc::new(Int64Array::from_iter_values(from..to));
        let pads = Arc::new(arrow_array::StringArray::from_iter_values(
            (from..to).map(|_| text.as_str()),
        ));
        RecordBatch::try_new(schema, vec![ids, pads]).expect("batch")
    }

    /// Checks a table's unflushed set against the records it was given (`log`: each record's
    /// ids) past the covered position: every row once, in order, whether in memory or
    /// spilled; each entry's index, runs, waiting count and size consistent; the table's
    /// totals the sum of its entries'; an entry that took records of others bounded in size.
    fn check_unflushed(state: &TableState, log: &BTreeMap<Lsn, (i64, i64)>, covered: Lsn) {
        let want_lsns: Vec<Lsn> = log.range(covered + 1..).map(|(&l, _)| l).collect();
        let want_ids: Vec<i64> = log
            .range(covered + 1..)
            .flat_map(|(_, &(from, to))| from..to)
            .collect();
        let (mut lsns, mut got, mut held, mut spilled_bytes, mut spilled) =
            (Vec::new(), Vec::new(), 0, 0, 0);
        for (k, u) in state.unflushed.iter().enumerate() {
            assert!(!u.lsns.is_empty(), "entry {k} without records");
            lsns.extend_from_slice(&u.lsns);
            // The records' own rows, as a reader of the log would see them.
            let mut end = 0;
            let mut rows_of_records = Vec::new();
            for (i, lsn) in u.lsns.iter().enumerate() {
                let (from, to) = log[lsn];
                end += usize::try_from(to - from).expect("rows");
                assert_eq!(u.ends[i], end, "entry {k}: ends {:?}", u.ends);
                rows_of_records.extend(from..to);
            }
            assert_eq!(u.rows, end, "entry {k}: rows");
            match &u.runs {
                Some(runs) => {
                    let ids: Vec<i64> = runs.iter().flat_map(|r| id_values(&r.batch)).collect();
                    assert!(ids == rows_of_records, "entry {k}: runs against records");
                    assert!(
                        u.pending <= runs.len() && u.pending < PENDING_RUNS,
                        "entry {k}: {} waiting of {} runs",
                        u.pending,
                        runs.len()
                    );
                    for run in runs {
                        assert_eq!(run.bytes, run.batch.get_array_memory_size(), "entry {k}");
                    }
                    let runs_bytes: usize = runs.iter().map(|r| r.bytes).sum();
                    assert_eq!(u.bytes, runs_bytes + u.index_bytes(), "entry {k}: size");
                    if u.lsns.len() > 1 {
                        assert!(
                            u.bytes < 2 * COALESCE_BELOW_BYTES,
                            "entry {k} of {} records: {} bytes",
                            u.lsns.len(),
                            u.bytes
                        );
                    }
                    held += u.bytes;
                }
                None => {
                    assert_eq!(spilled, k, "entry {k} spilled after one in memory");
                    spilled += 1;
                    spilled_bytes += u.bytes;
                }
            }
            got.extend(rows_of_records);
        }
        assert_eq!(lsns, want_lsns, "records held");
        let wrong = got.iter().zip(&want_ids).position(|(g, w)| g != w);
        assert!(
            wrong.is_none() && got.len() == want_ids.len(),
            "rows held: {} of {}, first wrong at {wrong:?}",
            got.len(),
            want_ids.len()
        );
        assert_eq!(
            (state.held_bytes, state.spilled_bytes, state.spilled),
            (held, spilled_bytes, spilled),
            "totals"
        );
    }

    /// Small batches of random sizes (now and then a large one, or one of another schema)
    /// coalesce while the set is spilled, cut by flushes that fail (`uncut`) or commit, cut
    /// and left ambiguous, and trimmed by positions inside entries (a takeover): after every
    /// step each committed row is held exactly once, in order, and the sizes add up.
    #[test]
    fn coalescing_keeps_every_row_once_in_order_through_spills_cuts_and_trims() {
        for seed in 1..=12u64 {
            let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut next = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let table = Table::new("t", Manifest::new("t", 10), ManifestState::default());
            let mut log = BTreeMap::new();
            let (mut id, mut covered, mut version) = (0i64, 0, 0);
            for lsn in 1..=3000u64 {
                let n = match next(100) {
                    0 => 4096 + next(2000) as i64,
                    1..=9 => 1 + next(300) as i64,
                    _ => 1 + next(3) as i64,
                };
                let pad = match next(4) {
                    0 | 1 => 0,
                    2 => next(200) as usize,
                    _ => 500 + next(1500) as usize,
                };
                let batch = padded(id, id + n, pad, next(50) == 0);
                log.insert(lsn, (id, id + n));
                id += n;
                let bytes = batch.get_array_memory_size();
                table.push(lsn, batch, bytes);
                let mut state = table.lock();
                match next(400) {
                    // Past the memory budget: the oldest in memory is spilled, after the
                    // waiting batches are joined (or only joined).
                    0..=2 => {
                        state.join_waiting();
                        state.spill_one();
                    }
                    22..=25 => state.join_waiting(),
                    // A flush cuts everything, then fails before its commit.
                    3..=10 => {
                        let mut fresh = Vec::new();
                        for u in state.unflushed.iter_mut() {
                            if !u.cut {
                                fresh.push(u.last_lsn());
                            }
                            u.cut = true;
                        }
                        state.uncut(&fresh);
                    }
                    // A flush cuts everything, its outcome unknown: the entries stay cut.
                    11 => {
                        for u in state.unflushed.iter_mut() {
                            u.cut = true;
                        }
                    }
                    // A commit covering whole entries (this node's flush).
                    12 | 13 => {
                        let len = state.unflushed.len() as u64;
                        if let Some(u) = state.unflushed.get(next(len) as usize) {
                            covered = u.last_lsn();
                            version += 1;
                            state.install(covering(version, covered), "n");
                        }
                    }
                    // A position inside an entry: another process's commit under this id.
                    14..=21 => {
                        covered = (covered + 1 + next(lsn - covered)).min(lsn);
                        version += 1;
                        state.install(covering(version, covered), "n");
                    }
                    _ => {}
                }
                check_unflushed(&state, &log, covered);
            }
        }
    }

    /// A position inside an entry whose newest batches wait to be joined (a takeover) keeps
    /// the later rows as one joined run with none waiting; batches that join it afterwards
    /// wait and are joined behind those rows, in order, and the sizes still add up.
    #[test]
    fn a_trim_inside_waiting_batches_keeps_them_in_order() {
        let table = Table::new("t", Manifest::new("t", 10), ManifestState::default());
        let push = |lsn: Lsn| {
            let batch = ids(lsn as i64, lsn as i64 + 1);
            let bytes = batch.get_array_memory_size();
            table.push(lsn, batch, bytes);
        };
        (1..=10).for_each(push);
        {
            let state = table.lock();
            assert_eq!(state.unflushed.len(), 1);
            let runs = state.unflushed[0].runs.as_ref().map(Vec::len);
            assert_eq!((runs, state.unflushed[0].pending), (Some(10), 10));
        }
        table.lock().install(covering(1, 4), "n");
        {
            let state = table.lock();
            assert_eq!(held_ids(&state), (5..=10).collect::<Vec<_>>());
            let runs = state.unflushed[0].runs.as_ref().map(Vec::len);
            assert_eq!((runs, state.unflushed[0].pending), (Some(1), 0));
        }
        (11..=50).for_each(push);
        let state = table.lock();
        assert_eq!(held_ids(&state), (5..=50).collect::<Vec<_>>());
        let u = &state.unflushed[0];
        // The 32 batches after the trim are joined at the 32nd, then with the kept run (not
        // larger than them); the last 8 wait.
        let counts: Vec<usize> = u
            .runs
            .iter()
            .flatten()
            .map(|r| r.batch.num_rows())
            .collect();
        assert_eq!(
            (counts, u.pending),
            ([vec![6 + 32], vec![1; 8]].concat(), 8)
        );
        let runs: usize = u.runs.iter().flatten().map(|r| r.bytes).sum();
        assert_eq!(u.bytes, runs + u.index_bytes());
        assert_eq!(state.held_bytes, u.bytes);
    }

    /// The rows a trim keeps of one run are copied out of it: the dropped rows' buffers go,
    /// and the entry's size says so.
    #[test]
    fn a_trim_inside_one_run_frees_the_dropped_rows() {
        let batch = ids(0, 1024);
        let bytes = batch.get_array_memory_size();
        let lsns: Vec<Lsn> = (1..=1024).collect();
        let ends: Vec<usize> = (1..=1024).collect();
        let mut state = TableState {
            manifest: ManifestState::default(),
            unflushed: VecDeque::from([entry(&lsns, &ends, Some(batch), bytes)]),
            held_bytes: bytes,
            spilled: 0,
            spilled_bytes: 0,
            last_append: None,
        };
        state.install(covering(1, 1020), "n");
        assert_eq!(held_ids(&state), vec![1020, 1021, 1022, 1023]);
        let kept = state.unflushed[0].bytes;
        assert!(kept * 16 < bytes, "{kept} bytes kept of {bytes}");
        assert_eq!(state.held_bytes, kept);
    }
}

/// Coalescing and column ids: entries join only batches of one shape, so each entry is read
/// and flushed by its own columns' ids.
#[cfg(test)]
mod coalescing {
    use super::*;
    use arrow_array::Int64Array;

    /// A one-row batch of one `long` column named `name` with column id `id`.
    fn labelled(name: &str, id: i32, value: i64) -> RecordBatch {
        let field = crate::types::with_field_id(
            arrow_schema::Field::new(name, arrow_schema::DataType::Int64, true),
            id,
        );
        let schema = Arc::new(arrow_schema::Schema::new(vec![field]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(vec![value]))]).expect("batch")
    }

    fn table() -> Table {
        Table::new("t", Manifest::new("t", 10), ManifestState::default())
    }

    /// An entry of one-row records counts its per-record index too: its size is its runs'
    /// arrays and its `lsns` and `ends`, and the table's held bytes are the entries' sizes.
    #[test]
    fn an_entry_of_small_records_counts_its_index() {
        let table = table();
        for lsn in 1..=500 {
            let batch = labelled("b", 1, lsn as i64);
            let bytes = batch.get_array_memory_size();
            table.push(lsn, batch, bytes);
        }
        let state = table.lock();
        let entry = &state.unflushed[0];
        assert_eq!(entry.lsns.len(), 500);
        let arrays: usize = entry
            .runs
            .as_ref()
            .expect("in memory")
            .iter()
            .map(|r| r.bytes)
            .sum();
        assert!(entry.index_bytes() >= 500 * 16, "{}", entry.index_bytes());
        assert_eq!(entry.bytes, arrays + entry.index_bytes());
        let entries: usize = state.unflushed.iter().map(|u| u.bytes).sum();
        assert_eq!(state.held_bytes, entries);
    }

    /// Small batches of one shape join one entry; a batch whose column has another id (the
    /// same name and type, after a drop and re-add) or another name (a rename) starts its
    /// own entry, and the entries keep their batches' ids.
    #[test]
    fn small_batches_of_other_column_ids_never_join() {
        let table = table();
        for (lsn, batch) in [
            (1, labelled("b", 2, 1)),
            (2, labelled("b", 2, 2)),
            (3, labelled("b", 3, 3)),
            (4, labelled("b2", 3, 4)),
            (5, labelled("b2", 3, 5)),
        ] {
            let bytes = batch.get_array_memory_size();
            table.push(lsn, batch, bytes);
        }
        let state = table.lock();
        let entries: Vec<(Vec<Lsn>, Vec<i32>, Vec<String>)> = state
            .unflushed
            .iter()
            .map(|u| {
                let schema = u
                    .runs
                    .as_ref()
                    .and_then(|r| r.first())
                    .expect("in memory")
                    .batch
                    .schema();
                let names = schema.fields().iter().map(|f| f.name().clone()).collect();
                (u.lsns.clone(), crate::types::field_ids(&schema), names)
            })
            .collect();
        assert_eq!(
            entries,
            [
                (vec![1, 2], vec![2], vec!["b".to_owned()]),
                (vec![3], vec![3], vec!["b".to_owned()]),
                (vec![4, 5], vec![3], vec!["b2".to_owned()]),
            ]
        );
    }
}
