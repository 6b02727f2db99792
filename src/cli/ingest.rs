//! `sluice ingest`: NDJSON from files or stdin into a table, streamed.
//!
//! Memory stays bounded whatever the input's size: a reader thread cuts the input into
//! batches (at most [`BATCH_BYTES`] and `batch_rows` each) and hands them over a channel one
//! deep, so at most `connections + 3` batch bodies exist at once (in flight, one waiting for
//! a connection, one in the channel, one being cut). Their buffers are reused ([`BodyPool`])
//! rather than freed and allocated again, so what the allocator keeps of freed memory does
//! not add to them. Requests that finished wait to be settled in input order behind an older
//! one still running; at most `2 * connections` are unsettled (sent, outcome not yet taken in
//! order), so a stalled request holds back no more than that.
//! Plain, gzip and zstd inputs are told apart by their first bytes, so stdin (`-`) works too.
//!
//! **Offsets and resuming.** The inputs, decompressed and taken in order, are one sequence
//! of bytes; every batch is a run of whole lines of it. Outcomes are settled in input order,
//! and the *resume offset* is the end of the longest settled prefix: every batch before it
//! was committed or refused for what it holds (422, 413; refused batches are listed with
//! their lines, to be fixed and sent on their own). It is printed after every batch and at
//! the end. Any other answer (unreachable, busy past every retry, a missing table, a key
//! without the role) applied nothing but ends the prefix, and so does an unknown outcome
//! (the connection broke after the batch was sent): the run then **stops** sending, lets the
//! batches in flight settle, and prints `--resume-from OFFSET` with a `--skip START-END` for
//! every batch settled past the offset, so that the printed command sends each row once
//! (an unknown batch is sent again: the command names it to reconcile first). An
//! interrupted run (Ctrl-C, SIGTERM) stops reading, waits for the batches in flight and
//! prints the same; a second Ctrl-C exits at once. If the command itself is killed
//! (`kill -9`), the batches in flight after the last printed offset have unknown outcomes.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, IsTerminal as _, Read};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{CliError, Endpoint, json_body, message};

/// Most concurrent requests (`--connections`); each may hold a batch of [`BATCH_BYTES`].
pub(crate) const MAX_CONNECTIONS: usize = 64;
/// Most bytes per ingest batch (the server's limit is 16 MiB).
pub(crate) const BATCH_BYTES: usize = 8 << 20;
/// Most rows per ingest batch.
pub const BATCH_ROWS: usize = 200_000;

/// Where NDJSON comes from: a file, or standard input (`-`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// A file, plain, gzip or zstd.
    File(PathBuf),
    /// Standard input, plain, gzip or zstd.
    Stdin,
}

impl Input {
    /// `-` is standard input; anything else a file.
    pub fn parse(arg: &std::ffi::OsStr) -> Input {
        if arg == "-" {
            Input::Stdin
        } else {
            Input::File(PathBuf::from(arg))
        }
    }

    fn name(&self) -> String {
        match self {
            Input::File(path) => path.display().to_string(),
            Input::Stdin => "<stdin>".into(),
        }
    }
}

/// How `sluice ingest` runs.
#[derive(Debug, Clone)]
pub struct IngestOptions {
    /// The table, as `db.schema.table`.
    pub table: String,
    /// The inputs, in order.
    pub inputs: Vec<Input>,
    /// Requests in flight at once (1 to 64; values outside are taken as the nearest).
    pub connections: usize,
    /// Most rows per batch (at most [`BATCH_ROWS`]).
    pub batch_rows: usize,
    /// Bytes of the (decompressed) inputs to skip: a resume offset an earlier run printed.
    pub resume_from: u64,
    /// Further byte ranges `(start, end)` to skip: batches an earlier run settled past its
    /// resume offset (it prints them as `--skip START-END`).
    pub skip: Vec<(u64, u64)>,
}

/// Where a batch is in the inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchInfo {
    /// The input's name (a path, or `<stdin>`).
    pub input: String,
    /// 1-based line numbers of its first and last line within the input.
    pub first_line: u64,
    /// Last line.
    pub last_line: u64,
    /// Rows (non-blank lines).
    pub rows: u64,
    /// Offset of its first byte in the inputs' sequence (see the module doc).
    pub start: u64,
    /// Offset just past its last line.
    pub end: u64,
}

/// What became of one batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchOutcome {
    /// Committed.
    Committed(u64),
    /// Refused for what it holds, nothing applied; the messages (row errors with input line
    /// numbers). Sending it again as it is would be refused again.
    Rejected(Vec<String>),
    /// Not applied, but only because the server could not take it (unreachable, or busy
    /// past every retry): it may be sent again, so the resume offset stops before it.
    NotApplied(String),
    /// Possibly applied: reconcile before sending it again.
    Unknown(String),
}

/// The result of `sluice ingest`.
#[derive(Debug, Default)]
pub struct IngestReport {
    /// Rows committed.
    pub rows: u64,
    /// Every batch sent, in input order, with its outcome.
    pub outcomes: Vec<(BatchInfo, BatchOutcome)>,
    /// Where a later run resumes (see the module doc).
    pub resume_from: u64,
    /// Byte ranges past `resume_from` that a later run must skip: batches settled (committed
    /// or refused for their content) after the resumable prefix ended, and the earlier run's
    /// own skips past it. Sorted, not overlapping.
    pub skip: Vec<(u64, u64)>,
    /// Why the run stopped before the end of its inputs without being interrupted (a batch
    /// the server could not take, or one whose outcome is unknown; or an input that could
    /// not be read). Nothing further was sent.
    pub stopped: Option<String>,
    /// The run was interrupted before the end of its inputs.
    pub interrupted: bool,
}

/// A batch with its body, as the reader cuts it.
struct Batch {
    info: BatchInfo,
    /// The NDJSON body (handed to the request as it is sent, and then empty).
    body: Vec<u8>,
    /// Line number of each row, for mapping the server's `row_index` back to the input.
    row_lines: Vec<u64>,
    /// Raw (possibly compressed) input bytes read when the batch was cut, for progress.
    raw_read: u64,
}

/// Batch bodies' buffers, reused. A body goes to its request as [`bytes::Bytes`] that own
/// the buffer; when the last of them is dropped (the request and any retry are done with
/// it), the buffer comes back here for the next batch the reader cuts.
///
/// Why: the reader allocates each 8 MiB body on its thread and the runtime frees it on
/// another. Under mimalloc (the binary's allocator) such frees are taken back by the owning
/// thread only later, and freed memory is given back to the system after a delay, so a 2 GiB
/// load peaked at 84-107 MiB resident where its live bodies held at most 56 MiB. Reused, the
/// bodies are not freed: they are the pages of the buffers alive at once (a buffer keeps the
/// pages earlier batches touched). The rest (line numbers, the reader's line and input
/// buffers) is small beside them.
#[derive(Clone)]
struct BodyPool {
    free: Arc<Mutex<Vec<Vec<u8>>>>,
    /// Most buffers kept: as many as can be alive at once.
    keep: usize,
}

impl BodyPool {
    fn new(keep: usize) -> BodyPool {
        BodyPool {
            free: Arc::new(Mutex::new(Vec::new())),
            keep,
        }
    }

    /// An empty buffer of [`BATCH_BYTES`]' capacity: a returned one, or a new one (whose
    /// pages the rows do not reach are never touched). Batches never grow it.
    fn take(&self) -> Vec<u8> {
        let returned = self
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        returned.unwrap_or_else(|| Vec::with_capacity(BATCH_BYTES))
    }

    /// `body` as `Bytes` that return it here once dropped (clones are free, for retries).
    fn bytes(&self, body: Vec<u8>) -> bytes::Bytes {
        bytes::Bytes::from_owner(PooledBody {
            body,
            pool: self.clone(),
        })
    }
}

/// A body lent to a request; see [`BodyPool`].
struct PooledBody {
    body: Vec<u8>,
    pool: BodyPool,
}

impl AsRef<[u8]> for PooledBody {
    fn as_ref(&self) -> &[u8] {
        &self.body
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        let mut body = std::mem::take(&mut self.body);
        if body.capacity() < BATCH_BYTES {
            return;
        }
        body.clear();
        let mut free = self
            .pool
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if free.len() < self.pool.keep {
            free.push(body);
        }
    }
}

/// Counts the raw bytes read from an input, for progress.
struct Counted<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Opens an input and undoes its compression, told by its first bytes.
fn open(input: &Input, raw: Arc<AtomicU64>) -> Result<Box<dyn BufRead + Send>, CliError> {
    let read_error = |source| CliError::Read {
        path: input.name(),
        source,
    };
    let source: Box<dyn Read + Send> = match input {
        Input::File(path) => Box::new(std::fs::File::open(path).map_err(read_error)?),
        Input::Stdin => Box::new(std::io::stdin()),
    };
    let mut reader = BufReader::with_capacity(
        1 << 20,
        Counted {
            inner: source,
            count: raw,
        },
    );
    let head = reader.fill_buf().map_err(read_error)?;
    Ok(if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::bufread::MultiGzDecoder::new(reader),
        ))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        let decoder = zstd::stream::read::Decoder::with_buffer(reader).map_err(read_error)?;
        Box::new(BufReader::with_capacity(1 << 20, decoder))
    } else {
        Box::new(reader)
    })
}

/// The byte ranges a run skips: `[0, resume_from)` and the `skip` ranges, sorted; empty
/// ones dropped. Overlapping ranges are a usage error.
fn skip_ranges(options: &IngestOptions) -> Result<VecDeque<(u64, u64)>, CliError> {
    let mut ranges: Vec<(u64, u64)> = std::iter::once((0, options.resume_from))
        .chain(options.skip.iter().copied())
        .filter(|(s, e)| s < e)
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(CliError::Usage(format!(
                "skipped ranges overlap: {}-{} and {}-{}",
                pair[0].0, pair[0].1, pair[1].0, pair[1].1
            )));
        }
    }
    Ok(ranges.into())
}

/// True for a line of JSON whitespace only (what the server skips between rows).
fn blank(line: &[u8]) -> bool {
    line.iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
}

/// Reads the inputs in order, skips the ranges of [`skip_ranges`] (whole lines only), cuts
/// the rest into batches and sends them on `out` (blocking while it is full). Stops early
/// when the receiver is gone.
fn read_batches(
    options: &IngestOptions,
    raw: Arc<AtomicU64>,
    out: &tokio::sync::mpsc::Sender<Batch>,
    bodies: &BodyPool,
) -> Result<(), CliError> {
    let max_rows = options.batch_rows.clamp(1, BATCH_ROWS);
    let mut ranges = skip_ranges(options)?;
    let not_a_line_end = |at: u64| {
        CliError::Usage(format!(
            "--resume-from/--skip: byte {at} is not the end of a line of these inputs"
        ))
    };
    // Offset of the next byte in the inputs' sequence.
    let mut offset = 0u64;
    // While skipping: where the skipped range ends.
    let mut skip_end: Option<u64> = None;
    for input in &options.inputs {
        let name = input.name();
        let read_error = |source| CliError::Read {
            path: name.clone(),
            source,
        };
        let mut reader = open(input, raw.clone())?;
        let mut line_no = 0u64;
        let mut current: Option<Batch> = None;
        let mut line = Vec::new();
        loop {
            line.clear();
            // Lines are read whole up to the batch limit, never beyond it.
            let n = (&mut reader)
                .take(BATCH_BYTES as u64 + 1)
                .read_until(b'\n', &mut line)
                .map_err(read_error)?;
            if n == 0 {
                break;
            }
            let complete = line.last() == Some(&b'\n');
            if skip_end.is_none()
                && let Some(&(start, end)) = ranges.front()
            {
                if start == offset {
                    ranges.pop_front();
                    skip_end = Some(end);
                    // A batch never spans a skipped range.
                    if let Some(batch) = current.take()
                        && send(out, batch, &raw).is_err()
                    {
                        return Ok(());
                    }
                } else if start < offset + n as u64 {
                    return Err(not_a_line_end(start));
                }
            }
            if let Some(end) = skip_end {
                // Skipping: whole lines only, counted for line numbers.
                if offset + n as u64 > end {
                    return Err(not_a_line_end(end));
                }
                offset += n as u64;
                line_no += u64::from(complete);
                if offset == end {
                    skip_end = None;
                    // Where skipping ends, a line must end (or the input).
                    if !complete && !reader.fill_buf().map_err(read_error)?.is_empty() {
                        return Err(not_a_line_end(end));
                    }
                }
                continue;
            }
            // A row is its line and a newline; the reader stops one byte past the limit.
            let row_bytes = n + usize::from(!complete);
            if row_bytes > BATCH_BYTES {
                return Err(CliError::Usage(format!(
                    "{name}: line {} is longer than a batch may be ({BATCH_BYTES} bytes)",
                    line_no + 1
                )));
            }
            line_no += 1;
            let start = offset;
            offset += n as u64;
            if blank(&line) {
                if let Some(batch) = &mut current {
                    batch.info.end = offset;
                }
                continue;
            }
            let full = current.as_ref().is_some_and(|b| {
                b.body.len() + row_bytes > BATCH_BYTES || b.info.rows as usize >= max_rows
            });
            if full
                && let Some(batch) = current.take()
                && send(out, batch, &raw).is_err()
            {
                return Ok(());
            }
            let batch = current.get_or_insert_with(|| Batch {
                info: BatchInfo {
                    input: name.clone(),
                    first_line: line_no,
                    last_line: line_no,
                    rows: 0,
                    start,
                    end: start,
                },
                // At the batch limit, never grown: no reallocation copies or fragments.
                body: bodies.take(),
                row_lines: Vec::new(),
                raw_read: 0,
            });
            batch.body.extend_from_slice(&line);
            if !complete {
                batch.body.push(b'\n');
            }
            batch.info.rows += 1;
            batch.info.last_line = line_no;
            batch.info.end = offset;
            batch.row_lines.push(line_no);
        }
        if let Some(batch) = current.take()
            && send(out, batch, &raw).is_err()
        {
            return Ok(());
        }
    }
    if skip_end.is_some() || !ranges.is_empty() {
        return Err(CliError::Usage(format!(
            "--resume-from/--skip: beyond the end of these inputs ({offset} bytes)"
        )));
    }
    Ok(())
}

fn send(
    out: &tokio::sync::mpsc::Sender<Batch>,
    mut batch: Batch,
    raw: &AtomicU64,
) -> Result<(), ()> {
    batch.raw_read = raw.load(Ordering::Relaxed);
    out.blocking_send(batch).map_err(|_| ())
}

/// Sends one batch, retrying while the server says nothing was applied and to retry.
async fn send_batch(
    client: &reqwest::Client,
    endpoint: &Endpoint,
    url: &str,
    batch: &mut Batch,
    bodies: &BodyPool,
) -> BatchOutcome {
    // `Bytes` makes a retry's body free; the batch keeps no copy.
    let body = bodies.bytes(std::mem::take(&mut batch.body));
    let mut delay = Duration::from_millis(200);
    for attempt in 0.. {
        let sent = endpoint
            .auth(client.post(url))
            .header("content-type", "application/x-ndjson")
            .body(body.clone())
            .send()
            .await;
        let response = match sent {
            Ok(r) => r,
            // Nothing reached the server: safe to try again.
            Err(e) if e.is_connect() && attempt < 8 => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(10));
                continue;
            }
            Err(e) if e.is_connect() => return BatchOutcome::NotApplied(e.to_string()),
            Err(e) => return BatchOutcome::Unknown(e.to_string()),
        };
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let (status, body) = match json_body(response).await {
            Ok(x) => x,
            Err(e) => return BatchOutcome::Unknown(e.to_string()),
        };
        match status {
            200 => return BatchOutcome::Committed(body["num_rows_inserted"].as_u64().unwrap_or(0)),
            429 | 503 if attempt < 8 && body["details"]["status"] != "unknown" => {
                let wait = retry_after.map_or(delay, Duration::from_secs).max(delay);
                tokio::time::sleep(wait).await;
                delay = (delay * 2).min(Duration::from_secs(10));
            }
            _ if body["details"]["status"] == "unknown"
                || status >= 500 && body["details"]["status"] != "rejected" =>
            {
                return BatchOutcome::Unknown(format!("{status}: {}", message(&body)));
            }
            // Refused for what the batch holds: sending it again would be refused again.
            413 | 422 => {
                let mut messages = vec![format!("{status}: {}", message(&body))];
                for e in body["details"]["row_errors"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    // The server counts rows, the command lines: they agree unless a line
                    // holds two objects or a broken one runs into the next, so the batch's
                    // lines are named too.
                    let row = e["row_index"].as_u64().unwrap_or(0);
                    let place = match batch.row_lines.get(row as usize) {
                        Some(line) => format!("{}:{line}", batch.info.input),
                        None => format!(
                            "{}:{}-{} (row {row})",
                            batch.info.input, batch.info.first_line, batch.info.last_line
                        ),
                    };
                    messages.push(format!(
                        "  {place}: {}{}",
                        e["column"]
                            .as_str()
                            .map(|c| format!("column {c}: "))
                            .unwrap_or_default(),
                        e["message"].as_str().unwrap_or_default()
                    ));
                }
                if body["details"]["row_errors_truncated"] == true {
                    messages.push("  (more row errors not listed)".into());
                }
                return BatchOutcome::Rejected(messages);
            }
            // Anything else applied nothing but says nothing against the rows (a busy or
            // failing server, a missing table, a key without the role): the run stops and
            // a resume sends the batch again.
            _ => return BatchOutcome::NotApplied(format!("{status}: {}", message(&body))),
        }
    }
    BatchOutcome::Unknown("gave up retrying".into())
}

/// Progress on stderr: a bar (or, for stdin, a counter) with rate and ETA on a terminal, a
/// line per batch otherwise.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    /// The offset this run started from (for the rate).
    from: u64,
}

impl Progress {
    fn new(inputs: &[Input], from: u64) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress {
                bar: None,
                started: Instant::now(),
                from,
            };
        }
        let sizes: Option<u64> = inputs
            .iter()
            .map(|i| match i {
                Input::File(path) => std::fs::metadata(path).ok().map(|m| m.len()),
                Input::Stdin => None,
            })
            .sum();
        let (bar, template) = match sizes {
            Some(total) => (
                indicatif::ProgressBar::new(total),
                "{bar:30} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
            ),
            None => (
                indicatif::ProgressBar::new_spinner(),
                "{spinner} {bytes} {binary_bytes_per_sec} {msg}",
            ),
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(template)
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Progress {
            bar: Some(bar),
            started: Instant::now(),
            from,
        }
    }

    fn settled(&self, batch: &Batch, outcome: &BatchOutcome, report: &IngestReport) {
        let info = &batch.info;
        let summary = format!(
            "{}:{}-{}: {}",
            info.input,
            info.first_line,
            info.last_line,
            match outcome {
                BatchOutcome::Committed(r) => format!("committed {r} rows"),
                BatchOutcome::Rejected(_) => "REJECTED (nothing applied)".into(),
                BatchOutcome::NotApplied(e) => format!("NOT APPLIED ({e}): resume to send it"),
                BatchOutcome::Unknown(e) =>
                    format!("UNKNOWN outcome ({e}): reconcile before resending"),
            }
        );
        match &self.bar {
            Some(bar) => {
                bar.set_position(batch.raw_read);
                bar.set_message(format!(
                    "{} rows, resume from {}",
                    report.rows, report.resume_from
                ));
                if !matches!(outcome, BatchOutcome::Committed(_)) {
                    bar.println(summary);
                }
            }
            None => {
                let secs = self.started.elapsed().as_secs_f64().max(1e-3);
                eprintln!(
                    "{summary} [{} rows, {:.1} MB/s, resume from {}]",
                    report.rows,
                    info.end.saturating_sub(self.from) as f64 / secs / 1e6,
                    report.resume_from
                );
            }
        }
    }

    fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Waits for SIGINT or SIGTERM.
async fn interrupted() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

type InFlight = tokio::task::JoinHandle<(Batch, BatchOutcome)>;

/// What the settled outcomes say so far.
#[derive(Default)]
struct Settled {
    /// Set once a batch may be sent again (not applied, or its outcome unknown): why. From
    /// there the resume offset stays put, and batches settled after it are to be skipped.
    broken: Option<String>,
    /// Batches settled past the resume offset (committed or refused for their content).
    beyond: Vec<(u64, u64)>,
}

impl Settled {
    fn settle(
        &mut self,
        batch: Batch,
        outcome: BatchOutcome,
        report: &mut IngestReport,
        progress: &Progress,
    ) {
        let info = &batch.info;
        match &outcome {
            BatchOutcome::Committed(rows) => report.rows += rows,
            BatchOutcome::Rejected(_) => {}
            BatchOutcome::NotApplied(why) | BatchOutcome::Unknown(why) => {
                if self.broken.is_none() {
                    self.broken = Some(format!(
                        "{}:{}-{}: {why}",
                        info.input, info.first_line, info.last_line
                    ));
                }
            }
        }
        let done = matches!(
            outcome,
            BatchOutcome::Committed(_) | BatchOutcome::Rejected(_)
        );
        if self.broken.is_none() {
            report.resume_from = info.end;
        } else if done {
            self.beyond.push((info.start, info.end));
        }
        progress.settled(&batch, &outcome, report);
        report.outcomes.push((batch.info, outcome));
    }
}

/// What the ingest loop does next.
enum Step {
    /// A batch from the reader (`None`: the inputs are done).
    Next(Option<Batch>),
    /// The oldest request finished.
    Settled(Result<(Batch, BatchOutcome), tokio::task::JoinError>),
    /// SIGINT or SIGTERM.
    Stop,
}

/// Streams the inputs into the table over `connections` concurrent requests (see the module
/// doc). Progress goes to stderr.
pub async fn ingest(endpoint: &Endpoint, options: IngestOptions) -> Result<IngestReport, CliError> {
    let parts: Vec<&str> = options.table.split('.').collect();
    let [db, schema, name] = parts.as_slice() else {
        return Err(CliError::Usage(format!(
            "--table {:?}: use db.schema.table",
            options.table
        )));
    };
    if options
        .inputs
        .iter()
        .filter(|i| **i == Input::Stdin)
        .count()
        > 1
    {
        return Err(CliError::Usage("stdin (-) can be read only once".into()));
    }
    let url = endpoint.url(&format!(
        "/v1/catalog/databases/{db}/schemas/{schema}/tables/{name}/ingest"
    ));
    let client = Endpoint::client()?;
    let connections = options.connections.clamp(1, MAX_CONNECTIONS);
    // Finished requests wait behind an unfinished older one to be settled in input order;
    // past this many unsettled, no more is sent until the oldest settles.
    let unsettled_max = 2 * connections;
    let progress = Progress::new(&options.inputs, options.resume_from);
    let raw = Arc::new(AtomicU64::new(0));
    // While `connections` are in flight, one batch waits for a connection, one in the channel
    // and the reader cuts the next: at most `connections + 3` bodies (8 MiB each) exist.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Batch>(1);
    let bodies = BodyPool::new(connections + 3);
    let reader = {
        let options = options.clone();
        let raw = raw.clone();
        let bodies = bodies.clone();
        tokio::task::spawn_blocking(move || read_batches(&options, raw, &tx, &bodies))
    };
    let semaphore = Arc::new(tokio::sync::Semaphore::new(connections));
    let mut report = IngestReport {
        resume_from: options.resume_from,
        ..IngestReport::default()
    };
    // Batches sent and not yet settled, in input order.
    let mut in_flight: VecDeque<InFlight> = VecDeque::new();
    let mut settled = Settled::default();
    let stop = interrupted();
    tokio::pin!(stop);
    loop {
        if settled.broken.is_some() {
            // Past a batch that may be sent again, nothing more is sent: each batch sent
            // now could only add to what a resume must skip.
            break;
        }
        let step = tokio::select! {
            batch = rx.recv(), if in_flight.len() < unsettled_max => Step::Next(batch),
            _ = &mut stop => Step::Stop,
            // The oldest request finished: settle it (outcomes settle in input order).
            done = async {
                match in_flight.front_mut() {
                    Some(task) => task.await,
                    None => std::future::pending().await,
                }
            }, if !in_flight.is_empty() => Step::Settled(done),
        };
        let batch = match step {
            Step::Settled(done) => {
                in_flight.pop_front();
                let (batch, outcome) = done.map_err(|e| CliError::Http(e.to_string()))?;
                settled.settle(batch, outcome, &mut report, &progress);
                continue;
            }
            Step::Stop => {
                report.interrupted = true;
                break;
            }
            Step::Next(None) => break,
            Step::Next(Some(batch)) => batch,
        };
        let permit = tokio::select! {
            permit = semaphore.clone().acquire_owned() => {
                permit.map_err(|e| CliError::Http(e.to_string()))?
            }
            _ = &mut stop => {
                report.interrupted = true;
                break;
            }
        };
        let client = client.clone();
        let endpoint = endpoint.clone();
        let url = url.clone();
        let bodies = bodies.clone();
        in_flight.push_back(tokio::spawn(async move {
            let mut batch = batch;
            let outcome = send_batch(&client, &endpoint, &url, &mut batch, &bodies).await;
            drop(permit);
            // Only the error messages needed the line numbers.
            batch.row_lines = Vec::new();
            (batch, outcome)
        }));
    }
    if report.interrupted {
        // A second Ctrl-C ends the command at once (the batches in flight then have
        // unknown outcomes, after the last offset printed).
        tokio::spawn(async {
            interrupted().await;
            eprintln!("interrupted again: exiting; batches in flight have unknown outcomes");
            std::process::exit(130);
        });
    }
    // Stop the reader (it sees the channel closed) and settle what is in flight.
    drop(rx);
    while let Some(task) = in_flight.pop_front() {
        let (batch, outcome) = task.await.map_err(|e| CliError::Http(e.to_string()))?;
        settled.settle(batch, outcome, &mut report, &progress);
    }
    progress.finish();
    report.stopped = settled.broken.take();
    // Skips the next run needs: this run's own past the new resume offset, then what
    // settled past it.
    let resume = report.resume_from;
    let mut skip: Vec<(u64, u64)> = options
        .skip
        .iter()
        .copied()
        .filter(|&(s, e)| s < e && s >= resume)
        .chain(settled.beyond)
        .collect();
    skip.sort_unstable();
    for (s, e) in skip {
        match report.skip.last_mut() {
            Some(last) if last.1 == s => last.1 = e,
            _ => report.skip.push((s, e)),
        }
    }
    // An interrupted or stopped run does not wait for its reader (it may be blocked on a
    // terminal or pipe); otherwise the reader's error, if any, is the run's.
    if !report.interrupted && report.stopped.is_none() {
        match reader.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => report.stopped = Some(e.to_string()),
            Err(e) => report.stopped = Some(e.to_string()),
        }
    }
    Ok(report)
}
