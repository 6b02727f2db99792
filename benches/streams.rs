//! The request path under load: 256-byte stream appends spread over 100 streams, and small
//! table-ingest requests (1 and 10 rows), over HTTP/1.1 keep-alive connections.
//!
//! Small requests (one event per request, as many apps send them) are measured against the
//! stream append in the same run: one sluice per round takes 256-byte appends, 1-row and
//! 10-row NDJSON ingests in turn, at each ingest connection count, and the figures are the
//! server's CPU per ingest over its CPU per append, the 1-row p99, the non-2xx answers, and
//! the unflushed set's bytes per row (the server's own figure, read after each 1-row run)
//! over the rows' size as one decoded Arrow batch.
//!
//! Peers, in the same run on the same machine: the Durable Streams protocol's Node reference
//! server in memory (one thread, nothing durable: the cost of the protocol alone) and with its
//! durable file-backed store (fdatasync per append, coalesced); and two floor servers
//! (`support::floor`), which answer every request at once and store nothing, one over raw
//! tokio sockets and one over hyper, to show what HTTP over loopback alone costs on the
//! machine. sluice runs its embedded defaults: fsync per group commit, every 204 durable.
//!
//! The load comes from this process, on one thread, over raw sockets: each connection writes a
//! prepared request and reads the whole answer before the next (no pipelining), so the load
//! generator's own cost per request is a write and a read, and the same for every server. The
//! figures per server: requests/s, p50/p99/p99.9 latency, errors, and the server's CPU time per
//! request (user + system, from `/proc`, over the measured window only).
//!
//! Run: `cargo bench --bench streams` (installs the reference server with `npm ci` into
//! `benches/reference-server/node_modules` on first use). Settings by environment:
//! `BENCH_CONNECTIONS` (default `32,256,1024`), `BENCH_SECONDS` (default 10),
//! `BENCH_STREAMS` (100), `BENCH_INGEST_CONNECTIONS` (default `32,256`), `BENCH_ROUNDS` (3:
//! each round starts the five servers afresh, one after another, in one order in odd rounds
//! (sluice first) and the reverse in even ones (sluice last); the ratios printed are medians
//! over the rounds, with each round's). `BENCH_PART=small` runs only the small requests.

mod support;

// sluice's allocator (`src/main.rs`), for the floor servers this executable also runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use support::harness::{
    Server, cpu_seconds, create_events_table, env_or, free_port, scratch, selected, start_sluice,
    table_stats, wait_ready,
};

const MESSAGE_BYTES: usize = 256;
const WARMUP: Duration = Duration::from_secs(2);

fn start_reference(durable: bool) -> Server {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/reference-server");
    if !dir.join("node_modules/@durable-streams/server").exists() {
        let status = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
            .current_dir(&dir)
            .status()
            .expect("npm runs");
        assert!(status.success(), "npm ci failed in {}", dir.display());
    }
    let port = free_port();
    let data = scratch(if durable {
        "reference-file"
    } else {
        "reference-memory"
    });
    let mut command = Command::new("node");
    command.arg("server.mjs").arg(port.to_string());
    if durable {
        command.arg(&data);
    }
    let child = command
        .current_dir(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("node starts");
    wait_ready(port);
    Server {
        name: if durable {
            "reference (node, file-backed)"
        } else {
            "reference (node, in memory)"
        },
        child,
        base: format!("http://127.0.0.1:{port}"),
        dir: data,
    }
}

/// What one load run measured.
struct Measured {
    requests: usize,
    seconds: f64,
    /// Latencies of the successful requests, sorted.
    latencies: Vec<Duration>,
    errors: usize,
    /// Server CPU seconds over the measured window.
    server_cpu: f64,
    /// The load generator's (this process's) CPU seconds over the measured window.
    loader_cpu: f64,
}

impl Measured {
    fn rate(&self) -> f64 {
        self.requests as f64 / self.seconds
    }

    fn quantile(&self, q: f64) -> Duration {
        let all = &self.latencies;
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    }

    fn cpu_micros_per_request(&self) -> f64 {
        self.server_cpu * 1e6 / self.requests.max(1) as f64
    }
}

/// Reads one HTTP/1.1 response from `stream` into `buf` (cleared first) and returns its
/// status. Handles `Content-Length`, chunked bodies and bodiless statuses: what the servers
/// measured here answer.
async fn read_response(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<u16> {
    buf.clear();
    let header_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        read_more(stream, buf).await?;
    };
    let head = std::str::from_utf8(&buf[..header_end]).map_err(std::io::Error::other)?;
    let status: u16 = head
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("no status"))?;
    let mut length = None;
    let mut chunked = false;
    for line in head.split("\r\n").skip(1) {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if name.eq_ignore_ascii_case("content-length") {
            length = value.trim().parse::<usize>().ok();
        } else if name.eq_ignore_ascii_case("transfer-encoding") && value.contains("chunked") {
            chunked = true;
        }
    }
    if status == 204 || status == 304 || status < 200 {
        return Ok(status);
    }
    if chunked {
        // Chunks until the last (size 0) and its trailing CRLF.
        let mut at = header_end;
        loop {
            let line_end = loop {
                if let Some(p) = buf[at..].windows(2).position(|w| w == b"\r\n") {
                    break at + p;
                }
                read_more(stream, buf).await?;
            };
            let size_text =
                std::str::from_utf8(&buf[at..line_end]).map_err(std::io::Error::other)?;
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(std::io::Error::other)?;
            let next = line_end + 2 + size + 2;
            while buf.len() < next {
                read_more(stream, buf).await?;
            }
            at = next;
            if size == 0 {
                return Ok(status);
            }
        }
    }
    let end = header_end + length.unwrap_or(0);
    while buf.len() < end {
        read_more(stream, buf).await?;
    }
    Ok(status)
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<()> {
    let mut chunk = [0u8; 4096];
    let n = stream.read(&mut chunk).await?;
    if n == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    buf.extend_from_slice(&chunk[..n]);
    Ok(())
}

/// Runs `connections` keep-alive connections against `addr`, each sending the prepared
/// requests in turn (connection `c` starts at request `c`), for a warm-up and then `seconds`
/// measured.
async fn blast(
    addr: SocketAddr,
    server_pid: u32,
    requests: Arc<Vec<Vec<u8>>>,
    connections: usize,
    seconds: u64,
) -> Measured {
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..connections {
        let requests = requests.clone();
        let stop = stop.clone();
        let measuring = measuring.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0usize;
            let mut buf = Vec::with_capacity(4096);
            let mut stream = match TcpStream::connect(addr).await {
                Ok(s) => s,
                Err(_) => return (latencies, 1),
            };
            let _ = stream.set_nodelay(true);
            let mut i = c;
            while !stop.load(Ordering::Relaxed) {
                let request = &requests[i % requests.len()];
                i += connections;
                let started = Instant::now();
                let outcome = match stream.write_all(request).await {
                    Ok(()) => read_response(&mut stream, &mut buf).await,
                    Err(e) => Err(e),
                };
                let ok = matches!(outcome, Ok(200..=299));
                if measuring.load(Ordering::Relaxed) {
                    if ok {
                        latencies.push(started.elapsed());
                    } else {
                        errors += 1;
                    }
                }
                if outcome.is_err() {
                    // The connection is in an unknown state: start a new one.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    match TcpStream::connect(addr).await {
                        Ok(s) => stream = s,
                        Err(_) => break,
                    }
                    let _ = stream.set_nodelay(true);
                }
            }
            (latencies, errors)
        }));
    }
    tokio::time::sleep(WARMUP).await;
    let cpu_before = cpu_seconds(server_pid);
    let loader_before = cpu_seconds(std::process::id());
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let server_cpu = cpu_seconds(server_pid) - cpu_before;
    let loader_cpu = cpu_seconds(std::process::id()) - loader_before;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await.expect("load task");
        latencies.extend(l);
        errors += e;
    }
    latencies.sort();
    Measured {
        requests: latencies.len(),
        seconds: elapsed,
        latencies,
        errors,
        server_cpu,
        loader_cpu,
    }
}

/// [`blast`] at each of `counts` connections in turn, each reported as it ends under
/// `label(connections)`, in `unit`s (and rows, for more than one a request).
async fn blast_each(
    server: &Server,
    requests: &Arc<Vec<Vec<u8>>>,
    counts: &[usize],
    seconds: u64,
    label: impl Fn(usize) -> String,
    unit: &str,
    rows_per_request: usize,
) -> Vec<Measured> {
    let mut runs = Vec::with_capacity(counts.len());
    for &connections in counts {
        let m = blast(
            address(&server.base),
            server.child.id(),
            requests.clone(),
            connections,
            seconds,
        )
        .await;
        report(&label(connections), unit, rows_per_request, &m);
        runs.push(m);
    }
    runs
}

fn address(base: &str) -> SocketAddr {
    base.trim_start_matches("http://")
        .parse()
        .expect("a base URL of an IP address and port")
}

/// Prepared `POST` requests, one per path, each with `body`.
fn posts(base: &str, paths: &[String], content_type: &str, bodies: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let host = base.trim_start_matches("http://");
    paths
        .iter()
        .enumerate()
        .map(|(i, path)| {
            let body = &bodies[i % bodies.len()];
            let mut request = format!(
                "POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            request.extend_from_slice(body);
            request
        })
        .collect()
}

async fn create_streams(base: &str, streams: usize) {
    let client = reqwest::Client::new();
    for s in 0..streams {
        let r = client
            .put(format!("{base}/v1/stream/bench-{s}"))
            .header("content-type", "application/octet-stream")
            .send()
            .await
            .expect("create");
        assert!(r.status().is_success(), "create: {}", r.status());
    }
}

fn report(name: &str, unit: &str, rows_per_request: usize, m: &Measured) {
    let rows = if rows_per_request > 1 {
        format!("  {:>9.0} rows/s", m.rate() * rows_per_request as f64)
    } else {
        String::new()
    };
    println!(
        "  {name:<34} {:>9.0} {unit}/s{rows}  p50 {:>6.2} ms  p99 {:>6.2} ms  p99.9 {:>6.2} ms  CPU/req: server {:>5.1} us, load {:>4.1} us  errors {}",
        m.rate(),
        m.quantile(0.50).as_secs_f64() * 1e3,
        m.quantile(0.99).as_secs_f64() * 1e3,
        m.quantile(0.999).as_secs_f64() * 1e3,
        m.cpu_micros_per_request(),
        m.loader_cpu * 1e6 / m.requests.max(1) as f64,
        m.errors,
    );
}

/// `values`' median, then each value, as "1.23x (1.20x, 1.23x, 1.31x)".
fn median_of(values: &[f64], unit: &str) -> String {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let each: Vec<String> = values.iter().map(|v| format!("{v:.2}{unit}")).collect();
    format!(
        "{:.2}{unit} ({})",
        sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN),
        each.join(", ")
    )
}

/// Per round, `ours`' rate over `theirs'` at the `i`th connection count.
fn rate_ratios(ours: &[Vec<Measured>], theirs: &[Vec<Measured>], i: usize) -> Vec<f64> {
    ours.iter()
        .zip(theirs)
        .map(|(o, t)| o[i].rate() / t[i].rate().max(1e-9))
        .collect()
}

fn connection_counts(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect()
}

fn main() {
    if let Ok(spec) = std::env::var(support::floor::FLOOR_ENV) {
        return support::floor::serve(&spec);
    }
    // `cargo bench` passes --bench; a filter that does not name this bench skips it.
    if !selected("streams") {
        return;
    }
    let counts = connection_counts("BENCH_CONNECTIONS", "32,256,1024");
    let ingest_counts = connection_counts("BENCH_INGEST_CONNECTIONS", "32,256");
    let seconds = env_or("BENCH_SECONDS", 10) as u64;
    let streams = env_or("BENCH_STREAMS", 100);
    let rounds = env_or("BENCH_ROUNDS", 3).max(1);
    // The load generator: one thread.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if std::env::var("BENCH_PART").is_ok_and(|part| part == "small") {
        return small_requests(&runtime, &ingest_counts, seconds, streams, rounds);
    }
    println!(
        "stream appends: {MESSAGE_BYTES}-byte messages to {streams} streams, {seconds} s measured after {} s of warm-up, load from one thread",
        WARMUP.as_secs()
    );
    let paths: Vec<String> = (0..streams)
        .map(|s| format!("/v1/stream/bench-{s}"))
        .collect();
    let message = vec![vec![b'x'; MESSAGE_BYTES]];

    // The machine's noise (other tenants, the disk) moves one run by 20-40 %: rounds start
    // every server afresh, alternate which side goes first, and the figures are the medians
    // over the rounds, printed with every round's.
    let starters: [fn() -> Server; 5] = [
        start_sluice,
        || start_reference(false),
        || start_reference(true),
        || support::floor::start("raw"),
        || support::floor::start("hyper"),
    ];
    // Per server: its name and, per round, one measurement per connection count.
    let mut results: Vec<(&'static str, Vec<Vec<Measured>>)> = Vec::new();
    for round in 1..=rounds {
        println!("round {round} of {rounds}");
        // Odd rounds in the order of `starters`, even ones in reverse: sluice first, then
        // last, and each peer's place alternates too (its distance from sluice stays).
        let mut order: Vec<usize> = (0..starters.len()).collect();
        if round % 2 == 0 {
            order.reverse();
        }
        let mut measured: Vec<Option<(&'static str, Vec<Measured>)>> =
            (0..starters.len()).map(|_| None).collect();
        for which in order {
            let server = starters[which]();
            runtime.block_on(create_streams(&server.base, streams));
            let requests = Arc::new(posts(
                &server.base,
                &paths,
                "application/octet-stream",
                &message,
            ));
            let name = if server.name == "sluice" {
                "sluice (fsync per group)"
            } else {
                server.name
            };
            println!("{name}:");
            let runs = runtime.block_on(blast_each(
                &server,
                &requests,
                &counts,
                seconds,
                |connections| format!("{connections} connections"),
                "appends",
                1,
            ));
            measured[which] = Some((name, runs));
        }
        for (which, m) in measured.into_iter().enumerate() {
            let Some((name, runs)) = m else { continue };
            match results.get_mut(which) {
                Some((_, all)) => all.push(runs),
                None => results.push((name, vec![runs])),
            }
        }
    }
    let ours = &results[0].1;
    println!("ratios over {rounds} rounds (median, then each round's):");
    for (name, theirs) in &results[1..] {
        for (i, connections) in counts.iter().enumerate() {
            let rates = rate_ratios(ours, theirs, i);
            let p99s: Vec<f64> = ours
                .iter()
                .zip(theirs)
                .map(|(o, t)| {
                    t[i].quantile(0.99).as_secs_f64() / o[i].quantile(0.99).as_secs_f64().max(1e-9)
                })
                .collect();
            println!(
                "  {connections:>5} connections: sluice {} {name}'s appends/s; its p99 {} sluice's",
                median_of(&rates, "x"),
                median_of(&p99s, "x"),
            );
        }
    }
    // The floors against the in-memory reference: what a server doing no work at all shows
    // against it on this machine and with this load generator.
    let reference = &results[1];
    for (name, floor) in &results[3..] {
        for (i, connections) in counts.iter().enumerate() {
            let rates = rate_ratios(floor, &reference.1, i);
            println!(
                "  {connections:>5} connections: {name} {} {}'s appends/s",
                median_of(&rates, "x"),
                reference.0,
            );
        }
    }
    if let (Some(at_256), Some(last)) = (
        counts.iter().position(|&c| c == 256),
        counts.len().checked_sub(1),
    ) {
        let scaling: Vec<f64> = ours
            .iter()
            .map(|runs| runs[last].rate() / runs[at_256].rate().max(1e-9))
            .collect();
        println!(
            "sluice at {} connections: {} its rate at 256",
            counts[last],
            median_of(&scaling, "x"),
        );
    }
    if let Some(at_32) = counts.iter().position(|&c| c == 32) {
        let p99s: Vec<f64> = ours
            .iter()
            .map(|runs| runs[at_32].quantile(0.99).as_secs_f64() * 1e3)
            .collect();
        println!("sluice p99 at 32 connections: {}", median_of(&p99s, " ms"));
    }

    small_requests(&runtime, &ingest_counts, seconds, streams, rounds);
}

/// What one round of [`small_requests`] shows at one connection count.
struct SmallFigures {
    /// Server CPU per 1-row ingest over its CPU per append.
    one_row_cpu: f64,
    /// Server CPU per 10-row ingest over its CPU per append.
    ten_rows_cpu: f64,
    /// The 1-row ingests' p99 latency, in milliseconds.
    one_row_p99_ms: f64,
    /// Unflushed bytes per row after the 1-row ingests, over the rows' Arrow size.
    memory: f64,
    /// Answers other than 2xx, of all three kinds.
    errors: usize,
}

/// One request kind of [`small_requests`].
struct Workload {
    name: &'static str,
    requests: Arc<Vec<Vec<u8>>>,
    rows: usize,
}

/// Waits until the events table holds no unflushed rows (its flushes are due within the
/// flush interval, 10 s by default), then until the server is idle (under 5 % of a core over
/// half a second: the streams' background work after appends, such as moving their data to
/// the object store, is done), at most a minute each.
async fn drain(client: &reqwest::Client, base: &str, server: u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while table_stats(client, base, false).await["unflushed_rows"].as_f64() != Some(0.0) {
        assert!(
            std::time::Instant::now() < deadline,
            "the events table did not drain within a minute"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let before = cpu_seconds(server);
        tokio::time::sleep(Duration::from_millis(500)).await;
        if cpu_seconds(server) - before < 0.025 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the server did not go idle within a minute"
        );
    }
}

/// Small requests as apps send them, one event per request: 1-row and 10-row NDJSON ingests
/// into the events table against 256-byte stream appends, all to one sluice per round, at
/// each of `counts` connections, in an order that turns around every round. Per round and
/// connection count: the server's CPU per 1-row (10-row) ingest over its CPU per append, and
/// after each 1-row run the unflushed set's bytes per row (the server's own figure) over what
/// the same rows take as one decoded Arrow batch.
fn small_requests(
    runtime: &tokio::runtime::Runtime,
    counts: &[usize],
    seconds: u64,
    streams: usize,
    rounds: usize,
) {
    let path = "/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest";
    let paths: Vec<String> = (0..streams)
        .map(|s| format!("/v1/stream/bench-{s}"))
        .collect();
    let bodies = |rows: usize| -> Vec<Vec<u8>> {
        let mut rng = support::Rng::new(7);
        (0..256)
            .map(|b| {
                let mut body = String::new();
                for r in 0..rows {
                    support::push_event(&mut rng, (b * rows + r) as u64, &mut body);
                }
                body.into_bytes()
            })
            .collect()
    };
    let (one_row, ten_rows) = (bodies(1), bodies(10));
    // The rows' own Arrow size: the 1-row bodies decoded as one batch, copied into buffers
    // of its size (the decoder's builders leave spare capacity; `concat_batches` of one
    // batch alone would hand it back as it is, hence the empty one).
    let arrow_per_row = {
        let decoder = sluice::ingest::Decoder::new(&support::event_columns());
        let batch = decoder
            .decode(&one_row.concat(), &sluice::ingest::Limits::default())
            .expect("bench rows decode");
        let batch =
            arrow_select::concat::concat_batches(&batch.schema(), [&batch, &batch.slice(0, 0)])
                .expect("one batch concatenates");
        batch.get_array_memory_size() as f64 / batch.num_rows().max(1) as f64
    };
    println!(
        "small requests into one sluice (fsync per group): 256-byte appends to {streams} streams, 1-row and 10-row ingests into the events table; {seconds} s measured after {} s of warm-up each; the rows' Arrow size as one batch: {arrow_per_row:.0} bytes/row",
        WARMUP.as_secs()
    );
    let client = reqwest::Client::new();
    // Per round, per connection count.
    let mut figures: Vec<Vec<SmallFigures>> = Vec::new();
    for round in 1..=rounds {
        println!("round {round} of {rounds}");
        let sluice = start_sluice();
        runtime.block_on(create_streams(&sluice.base, streams));
        runtime.block_on(create_events_table(&client, &sluice.base));
        let ingests = |name, bodies: &[Vec<u8>], rows| Workload {
            name,
            requests: Arc::new(posts(
                &sluice.base,
                &vec![path.to_owned(); bodies.len()],
                "application/x-ndjson",
                bodies,
            )),
            rows,
        };
        let workloads = [
            Workload {
                name: "256-byte appends",
                requests: Arc::new(posts(
                    &sluice.base,
                    &paths,
                    "application/octet-stream",
                    &[vec![b'x'; MESSAGE_BYTES]],
                )),
                rows: 1,
            },
            ingests("1-row ingests", &one_row, 1),
            ingests("10-row ingests", &ten_rows, 10),
        ];
        let mut order: Vec<usize> = (0..workloads.len()).collect();
        if round % 2 == 0 {
            order.reverse();
        }
        let mut per_count = Vec::new();
        for &connections in counts {
            let mut measured: Vec<Option<Measured>> = (0..workloads.len()).map(|_| None).collect();
            let mut memory = f64::NAN;
            for &which in &order {
                let w = &workloads[which];
                // The deferred work of an earlier load would be billed to this one (the
                // flushes of the 10-row load's rows, ten times a 1-row load's; the streams'
                // work after appends): the table is drained and the server idle first, so
                // the window holds this load's work alone (with its own deferred work done
                // within the window).
                runtime.block_on(drain(&client, &sluice.base, sluice.child.id()));
                let m = runtime.block_on(blast(
                    address(&sluice.base),
                    sluice.child.id(),
                    w.requests.clone(),
                    connections,
                    seconds,
                ));
                report(
                    &format!("{}, {connections} connections", w.name),
                    "requests",
                    w.rows,
                    &m,
                );
                if which == 1 {
                    let stats = runtime.block_on(table_stats(&client, &sluice.base, false));
                    let (bytes, rows) = (
                        stats["unflushed_bytes"].as_f64().unwrap_or(0.0),
                        stats["unflushed_rows"].as_f64().unwrap_or(0.0),
                    );
                    println!(
                        "    unflushed after it: {rows:.0} rows in {} entries, {bytes:.0} bytes ({:.0} bytes/row, {} spilled)",
                        stats["unflushed_batches"],
                        bytes / rows.max(1.0),
                        stats["spilled_bytes"],
                    );
                    memory = bytes / rows.max(1.0) / arrow_per_row;
                }
                measured[which] = Some(m);
            }
            let [Some(append), Some(one), Some(ten)] = measured.as_slice() else {
                unreachable!("every workload ran");
            };
            let per_append = append.cpu_micros_per_request().max(1e-9);
            per_count.push(SmallFigures {
                one_row_cpu: one.cpu_micros_per_request() / per_append,
                ten_rows_cpu: ten.cpu_micros_per_request() / per_append,
                one_row_p99_ms: one.quantile(0.99).as_secs_f64() * 1e3,
                memory,
                errors: append.errors + one.errors + ten.errors,
            });
        }
        figures.push(per_count);
    }
    println!("small requests over {rounds} rounds (median, then each round's):");
    for (i, connections) in counts.iter().enumerate() {
        let each = |f: fn(&SmallFigures) -> f64| -> Vec<f64> {
            figures.iter().map(|round| f(&round[i])).collect()
        };
        let errors: usize = figures.iter().map(|round| round[i].errors).sum();
        println!(
            "  {connections:>4} connections: server CPU per 1-row ingest {} an append's, per 10-row ingest {}; 1-row p99 {}; unflushed bytes per row {} the rows' Arrow size; non-2xx answers {errors}",
            median_of(&each(|f| f.one_row_cpu), "x"),
            median_of(&each(|f| f.ten_rows_cpu), "x"),
            median_of(&each(|f| f.one_row_p99_ms), " ms"),
            median_of(&each(|f| f.memory), "x"),
        );
    }
}
