//! Stream append load: 256-byte messages to 100 streams over HTTP, against `sluice serve`
//! (fsync per group commit, the default) and the protocol's Node reference server (its durable
//! file-backed store, which fdatasyncs every append), in the same run on the same machine.
//!
//! Run: `cargo bench --bench streams` (installs the reference server with `npm ci` into
//! `benches/reference-server/node_modules` on first use). Settings by environment:
//! `BENCH_CONNECTIONS` (default 64), `BENCH_SECONDS` (default 10), `BENCH_STREAMS` (100).

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use support::harness::{Server, env_or, free_port, scratch, selected, start_sluice, wait_ready};

const MESSAGE_BYTES: usize = 256;

fn start_reference() -> Server {
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
    let data = scratch("reference");
    let child = Command::new("node")
        .arg("server.mjs")
        .arg(port.to_string())
        .arg(&data)
        .current_dir(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("node starts");
    wait_ready(port);
    Server {
        name: "reference (node, file-backed)",
        child,
        base: format!("http://127.0.0.1:{port}"),
        dir: data,
    }
}

struct Result {
    appends: usize,
    seconds: f64,
    p50: Duration,
    p99: Duration,
    p999: Duration,
    errors: usize,
}

impl Result {
    fn rate(&self) -> f64 {
        self.appends as f64 / self.seconds
    }
}

async fn load(base: &str, streams: usize, connections: usize, seconds: u64) -> Result {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(connections)
        .build()
        .expect("client");
    for s in 0..streams {
        let r = client
            .put(format!("{base}/v1/stream/bench-{s}"))
            .header("content-type", "application/octet-stream")
            .send()
            .await
            .expect("create");
        assert!(r.status().is_success(), "create: {}", r.status());
    }
    let body = bytes::Bytes::from(vec![b'x'; MESSAGE_BYTES]);
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..connections {
        let client = client.clone();
        let body = body.clone();
        let stop = stop.clone();
        let measuring = measuring.clone();
        let base = base.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0;
            let mut i = c;
            while !stop.load(Ordering::Relaxed) {
                let url = format!("{base}/v1/stream/bench-{}", i % streams);
                i += connections;
                let started = Instant::now();
                let ok = match client
                    .post(&url)
                    .header("content-type", "application/octet-stream")
                    .body(body.clone())
                    .send()
                    .await
                {
                    Ok(r) => r.status().is_success(),
                    Err(_) => false,
                };
                if measuring.load(Ordering::Relaxed) {
                    if ok {
                        latencies.push(started.elapsed());
                    } else {
                        errors += 1;
                    }
                }
            }
            (latencies, errors)
        }));
    }
    // Warm up (connections, allocations), then measure.
    tokio::time::sleep(Duration::from_secs(2)).await;
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    measuring.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let mut errors = 0;
    for t in tasks {
        let (l, e) = t.await.expect("task");
        all.extend(l);
        errors += e;
    }
    all.sort();
    let pick = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    Result {
        appends: all.len(),
        seconds: elapsed,
        p50: pick(0.50),
        p99: pick(0.99),
        p999: pick(0.999),
        errors,
    }
}

fn report(name: &str, r: &Result) {
    println!(
        "{name:<32} {:>10.0} appends/s  {:>6.1} MB/s  p50 {:>7.2} ms  p99 {:>7.2} ms  p999 {:>7.2} ms  errors {}",
        r.rate(),
        r.rate() * MESSAGE_BYTES as f64 / 1e6,
        r.p50.as_secs_f64() * 1e3,
        r.p99.as_secs_f64() * 1e3,
        r.p999.as_secs_f64() * 1e3,
        r.errors,
    );
}

fn main() {
    // `cargo bench` passes --bench; a filter that does not name this bench skips it.
    if !selected("streams") {
        return;
    }
    let connections = env_or("BENCH_CONNECTIONS", 64);
    let seconds = env_or("BENCH_SECONDS", 10) as u64;
    let streams = env_or("BENCH_STREAMS", 100);
    let runtime = support::harness::runtime();
    println!(
        "stream appends: {MESSAGE_BYTES}-byte messages to {streams} streams, {connections} connections, {seconds} s each"
    );
    let sluice = start_sluice();
    let ours = runtime.block_on(load(&sluice.base, streams, connections, seconds));
    drop(sluice);
    report("sluice (fsync per group)", &ours);
    let reference = start_reference();
    let theirs = runtime.block_on(load(&reference.base, streams, connections, seconds));
    report(reference.name, &theirs);
    drop(reference);
    println!(
        "ratio: sluice {:.2}x the reference server's appends/s; p99 {:.2}x lower",
        ours.rate() / theirs.rate().max(1e-9),
        theirs.p99.as_secs_f64() / ours.p99.as_secs_f64().max(1e-9),
    );
}
