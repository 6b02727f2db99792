//! Crash loop: the real `sluice serve` under mixed load (table ingest from several clients, an
//! idempotent stream producer, queries), killed with SIGKILL at random moments over lifetimes
//! from a fraction of a second to several seconds (tens in the long form), sometimes twice in
//! quick succession, and restarted. Settings are small enough that between kills the server
//! flushes Parquet, spills unflushed batches past its memory budget to the log and reads them
//! back, compacts, rolls and releases log segments, checkpoints streams and collects garbage;
//! the test reads the server's counters before each kill and fails if any of those never
//! happened.
//!
//! After every restart: the server takes writes again (a server that refuses everything
//! fails the test); every acknowledged row is queryable exactly once and nothing
//! unacknowledged appears twice; every acknowledged stream message is readable once, at its
//! acknowledged offset; a producer's retries of unacknowledged appends land at most once. The
//! producer shares its stream with writers that append concurrently (no producer headers),
//! so appends to the one stream are pipelined behind each other's syncs when the kill comes;
//! each of their messages is there once if it was acknowledged, at most once if its answer
//! was lost, and never if it was refused.
//! During load every answer is 200/204, or a refusal that applied nothing (503 with
//! `Retry-After` and `rejected`); any other answer fails the test.
//!
//! Short form (CI): 12 cycles. Long form, with the default 64 MiB segments and lifetimes up to
//! 30 s: `SLUICE_CRASH_LONG=1 SLUICE_CRASH_CYCLES=100 cargo test --release --test it crash:: --
//! --nocapture` (prints the figures). `SLUICE_CRASH_SEED` replays a run.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

/// The counters the loop needs to see move.
const COUNTERS: [&str; 9] = [
    "sluice_table_flushes_total",
    "sluice_table_spills_total",
    "sluice_table_spilled_reads_total",
    "sluice_table_compactions_total",
    "sluice_log_segments_rolled_total",
    "sluice_log_segments_deleted_total",
    "sluice_stream_checkpoints_total",
    "sluice_gc_deleted_objects_total",
    "sluice_log_records_total",
];

struct Profile {
    long: bool,
    /// Note bytes per row (rows are the bulk of the log).
    note: usize,
    /// Rows per ingest request: ids `b * batch .. (b + 1) * batch` for batch number `b`.
    batch: i64,
    /// Pause of each ingest client between requests (the long form paces its load so that
    /// its data stays within the disk and its checks within memory over a long run).
    ingest_pause: Duration,
    /// Pause of the stream producer between appends.
    append_pause: Duration,
}

fn config_file(dir: &std::path::Path, profile: &Profile) -> std::path::PathBuf {
    let path = dir.join("crash.toml");
    let text = if profile.long {
        // Default segment size; everything else short enough that it happens between kills.
        "flush_interval_seconds = 2\nstream_checkpoint_interval_seconds = 2\n\
         gc_grace_seconds = 5\nmaintenance_interval_seconds = 0.25\ncompact_min_files = 4\n\
         manifest_checkpoint_interval = 5\nmax_unflushed_bytes = 1048576\nflush_quiet_ms = 500\n"
    } else {
        "log_segment_bytes = 131072\nflush_bytes = 262144\nflush_interval_seconds = 0.4\n\
         stream_checkpoint_interval_seconds = 0.4\ngc_grace_seconds = 1\n\
         maintenance_interval_seconds = 0.1\ncompact_min_files = 3\n\
         manifest_checkpoint_interval = 4\nmax_unflushed_bytes = 131072\nflush_quiet_ms = 150\n"
    };
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(&path, text).unwrap();
    path
}

fn spawn(dir: &std::path::Path, port: u16, config: &std::path::Path) -> Child {
    common::sluice_serve(&dir.join("data"), port)
        .arg("--config")
        .arg(config)
        .spawn()
        .unwrap()
}

/// Waits for the restarted server without blocking the runtime's other tasks.
async fn wait_healthy(port: u16) -> Duration {
    tokio::task::spawn_blocking(move || common::wait_healthy(port))
        .await
        .unwrap()
}

/// A tiny deterministic generator (the run's seed is printed, so a failure can be replayed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

/// What the clients know.
#[derive(Default, Clone)]
struct Ledger {
    /// Batches of rows acknowledged (200), by number (see [`Profile::batch`]).
    acked_batches: BTreeSet<i64>,
    /// Batches whose request got no answer (the kill came mid-request).
    unknown_batches: BTreeSet<i64>,
    /// Producer sequence -> acknowledged Stream-Next-Offset (None for a duplicate answer).
    acked_messages: BTreeMap<u64, Option<u64>>,
    /// A concurrent writer's message number -> its acknowledged Stream-Next-Offset.
    acked_writes: BTreeMap<u64, u64>,
    /// Writers' messages whose request got no answer.
    unknown_writes: BTreeSet<u64>,
}

/// Refusals that applied nothing, by kind.
#[derive(Default)]
struct Refusals {
    ingest_503: AtomicU64,
    append_503: AtomicU64,
}

/// Checks that a 503 says nothing was applied; panics on any other non-success answer.
async fn refusal(what: &str, r: reqwest::Response) {
    let status = r.status();
    let retry_after = r.headers().get("retry-after").is_some();
    let not_applied = r.headers().get("x-sluice-not-applied").is_some();
    let body: Value = r.json().await.unwrap_or(Value::Null);
    assert_eq!(status, 503, "{what}: unexpected answer {status}: {body}");
    assert!(retry_after, "{what}: 503 without Retry-After: {body}");
    assert!(
        body["details"]["status"] == "rejected" || not_applied,
        "{what}: 503 that does not say nothing was applied: {body}"
    );
}

fn rows_body(ids: &[i64], note: usize) -> String {
    ids.iter()
        .map(|i| format!("{{\"id\":{i},\"note\":\"{}\"}}\n", "n".repeat(note)))
        .collect()
}

/// The body of batch number `b`.
fn batch_body(b: i64, profile: &Profile) -> String {
    let ids: Vec<i64> = (b * profile.batch..(b + 1) * profile.batch).collect();
    rows_body(&ids, profile.note)
}

async fn ingest_client(
    base: String,
    client: reqwest::Client,
    next_batch: Arc<AtomicI64>,
    ledger: Arc<Mutex<Ledger>>,
    refusals: Arc<Refusals>,
    stop: Arc<AtomicBool>,
    profile: Arc<Profile>,
) {
    while !stop.load(Ordering::Relaxed) {
        let b = next_batch.fetch_add(1, Ordering::Relaxed);
        let r = client
            .post(format!(
                "{base}/v1/catalog/databases/scopedb/schemas/public/tables/c/ingest"
            ))
            .header("content-type", "application/x-ndjson")
            .body(batch_body(b, &profile))
            .send()
            .await;
        match r {
            Ok(r) if r.status() == 200 => {
                ledger.lock().unwrap().acked_batches.insert(b);
            }
            Ok(r) => {
                refusal("ingest", r).await;
                refusals.ingest_503.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(_) => {
                ledger.lock().unwrap().unknown_batches.insert(b);
                return;
            }
        }
        tokio::time::sleep(profile.ingest_pause).await;
    }
}

/// Appends `{"s": seq}` with producer headers; an append without an answer is retried with the
/// same sequence number after the restart (it must land at most once). Returns whether it
/// got any answer at all.
async fn produce_one(
    base: &str,
    client: &reqwest::Client,
    next_seq: &AtomicI64,
    ledger: &Mutex<Ledger>,
    refusals: &Refusals,
) -> Result<bool, ()> {
    let seq = next_seq.load(Ordering::Relaxed) as u64;
    let r = client
        .post(format!("{base}/v1/stream/crash"))
        .header("content-type", "application/json")
        .header("producer-id", "crash-producer")
        .header("producer-epoch", "0")
        .header("producer-seq", seq.to_string())
        .body(json!({"s": seq, "pad": "p".repeat(150)}).to_string())
        .send()
        .await;
    match r {
        Ok(r) if r.status() == 200 || r.status() == 204 => {
            let offset = next_offset(&r);
            let duplicate = r.status() == 204;
            ledger
                .lock()
                .unwrap()
                .acked_messages
                .insert(seq, if duplicate { None } else { offset });
            next_seq.fetch_add(1, Ordering::Relaxed);
            Ok(true)
        }
        Ok(r) => {
            refusal(&format!("producer append {seq}"), r).await;
            refusals.append_503.fetch_add(1, Ordering::Relaxed);
            Ok(false)
        }
        Err(_) => Err(()),
    }
}

async fn producer(
    base: String,
    client: reqwest::Client,
    next_seq: Arc<AtomicI64>,
    ledger: Arc<Mutex<Ledger>>,
    refusals: Arc<Refusals>,
    stop: Arc<AtomicBool>,
    pause: Duration,
) {
    while !stop.load(Ordering::Relaxed) {
        match produce_one(&base, &client, &next_seq, &ledger, &refusals).await {
            Ok(true) => tokio::time::sleep(pause).await,
            Ok(false) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(()) => return,
        }
    }
}

/// The byte offset in a `Stream-Next-Offset` answer.
fn next_offset(r: &reqwest::Response) -> Option<u64> {
    r.headers()
        .get("stream-next-offset")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once('_'))
        .and_then(|(_, b)| b.parse().ok())
}

/// Appends `{"w": n}` for a fresh number `n` each time, with no producer headers, to the
/// producer's stream, alongside the other writers and the producer.
async fn writer(
    base: String,
    client: reqwest::Client,
    next_write: Arc<AtomicI64>,
    ledger: Arc<Mutex<Ledger>>,
    refusals: Arc<Refusals>,
    stop: Arc<AtomicBool>,
    pause: Duration,
) {
    while !stop.load(Ordering::Relaxed) {
        let n = next_write.fetch_add(1, Ordering::Relaxed) as u64;
        let r = client
            .post(format!("{base}/v1/stream/crash"))
            .header("content-type", "application/json")
            .body(json!({"w": n, "pad": "w".repeat(100)}).to_string())
            .send()
            .await;
        match r {
            Ok(r) if r.status() == 204 => {
                let offset = next_offset(&r).expect("an append's answer names its offset");
                ledger.lock().unwrap().acked_writes.insert(n, offset);
                tokio::time::sleep(pause).await;
            }
            Ok(r) => {
                refusal(&format!("write {n}"), r).await;
                refusals.append_503.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(_) => {
                ledger.lock().unwrap().unknown_writes.insert(n);
                return;
            }
        }
    }
}

async fn querier(base: String, client: reqwest::Client, stop: Arc<AtomicBool>) -> u64 {
    let mut answered = 0;
    while !stop.load(Ordering::Relaxed) {
        let r = client
            .post(format!("{base}/v1/statements"))
            .json(&json!({"statement": "SELECT count(*) FROM c"}))
            .send()
            .await;
        match r {
            Ok(r) => {
                assert_eq!(r.status(), 200);
                answered += 1;
            }
            Err(_) => return answered,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    answered
}

/// The server's counters now (they start from zero at each start).
async fn counters(client: &reqwest::Client, base: &str) -> Option<BTreeMap<&'static str, u64>> {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let mut out = BTreeMap::new();
    for name in COUNTERS {
        let value = text
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        out.insert(name, value);
    }
    Some(out)
}

/// Checks every invariant against what the server serves now.
async fn verify(client: &reqwest::Client, base: &str, ledger: &Ledger, profile: &Profile) {
    // One row per batch number present (a request is all-or-nothing, so a batch is whole or
    // absent): its row count and distinct ids say whether a row is missing or doubled.
    let per_batch = format!(
        "SELECT id / {batch} AS b, count(*) AS n, count(DISTINCT id) AS d FROM c \
         GROUP BY id / {batch}",
        batch = profile.batch
    );
    let r = common::statement(client, base, &per_batch).await;
    assert_eq!(r["status"], "finished", "{r}");
    let number = |v: &Value| -> i64 { v.as_str().unwrap().parse().unwrap() };
    let mut present = BTreeSet::new();
    for row in r["result_set"]["rows"].as_array().unwrap() {
        let (b, n, d) = (number(&row[0]), number(&row[1]), number(&row[2]));
        assert_eq!(n, d, "a row of batch {b} is visible twice");
        assert_eq!(n, profile.batch, "batch {b} is partly visible ({n} rows)");
        assert!(
            ledger.acked_batches.contains(&b) || ledger.unknown_batches.contains(&b),
            "rows nobody sent: batch {b}"
        );
        present.insert(b);
    }
    let missing: Vec<&i64> = ledger.acked_batches.difference(&present).collect();
    assert!(missing.is_empty(), "acknowledged batches lost: {missing:?}");
    // The stream, as stored, read to its end a page at a time: one message per line; its
    // end offset is where the line ends.
    let mut body = Vec::new();
    let mut offset = "-1".to_owned();
    loop {
        let r = client
            .get(format!("{base}/v1/stream/crash?offset={offset}"))
            .header("accept", "application/x-ndjson")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "the stream is gone");
        let up_to_date = r.headers().contains_key("stream-up-to-date");
        let next = r.headers()["stream-next-offset"]
            .to_str()
            .unwrap()
            .to_owned();
        body.extend_from_slice(&r.bytes().await.unwrap());
        if up_to_date {
            break;
        }
        offset = next;
    }
    let mut at = 0u64;
    let mut seen = BTreeMap::new();
    let mut written = BTreeMap::new();
    for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        at += line.len() as u64 + 1;
        let m: Value = serde_json::from_slice(line).unwrap();
        if let Some(n) = m["w"].as_u64() {
            assert!(written.insert(n, at).is_none(), "write {n} landed twice");
            assert!(
                ledger.acked_writes.contains_key(&n) || ledger.unknown_writes.contains(&n),
                "write {n} is there, but it was refused"
            );
            continue;
        }
        let seq = m["s"].as_u64().unwrap();
        assert!(
            seen.insert(seq, at).is_none(),
            "producer append {seq} landed twice"
        );
    }
    for (n, offset) in &ledger.acked_writes {
        assert_eq!(
            written.get(n),
            Some(offset),
            "acknowledged write {n} is lost or not at its acknowledged offset"
        );
    }
    for (seq, offset) in &ledger.acked_messages {
        let end = seen.get(seq);
        assert!(end.is_some(), "acknowledged append {seq} lost");
        if let Some(o) = offset {
            assert_eq!(
                end,
                Some(o),
                "append {seq} is not at its acknowledged offset"
            );
        }
    }
}

/// After a restart the server must take a row and a stream append (within 15 s; a server
/// that refuses everything fails here).
async fn takes_writes(
    client: &reqwest::Client,
    base: &str,
    next_batch: &AtomicI64,
    next_seq: &AtomicI64,
    ledger: &Mutex<Ledger>,
    refusals: &Refusals,
    profile: &Profile,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let b = next_batch.fetch_add(1, Ordering::Relaxed);
        let r = client
            .post(format!(
                "{base}/v1/catalog/databases/scopedb/schemas/public/tables/c/ingest"
            ))
            .header("content-type", "application/x-ndjson")
            .body(batch_body(b, profile))
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            ledger.lock().unwrap().acked_batches.insert(b);
            break;
        }
        refusal("ingest after restart", r).await;
        assert!(
            std::time::Instant::now() < deadline,
            "no ingest accepted after a restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    loop {
        match produce_one(base, client, next_seq, ledger, refusals).await {
            Ok(true) => break,
            Ok(false) => {}
            Err(()) => panic!("no answer to an append after a restart"),
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no append accepted after a restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_random_moments_it_loses_nothing_acknowledged() {
    let long = std::env::var("SLUICE_CRASH_LONG").is_ok_and(|v| v == "1");
    let cycles: usize = std::env::var("SLUICE_CRASH_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let seed: u64 = std::env::var("SLUICE_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    let profile = Arc::new(if long {
        Profile {
            long,
            note: 400,
            batch: 200,
            ingest_pause: Duration::from_millis(25),
            append_pause: Duration::from_millis(10),
        }
    } else {
        Profile {
            long,
            note: 100,
            batch: 20,
            ingest_pause: Duration::ZERO,
            append_pause: Duration::ZERO,
        }
    });
    println!("crash loop: {cycles} cycles, seed {seed}, long form {long}");
    let mut rng = Rng(seed);
    let dir = common::temp_dir("crash");
    let config = config_file(&dir, &profile);
    let port = common::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut server = spawn(&dir, port, &config);
    wait_healthy(port).await;
    common::statement(&client, &base, "CREATE TABLE c (id int, note string)").await;
    let r = client
        .put(format!("{base}/v1/stream/crash"))
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let refusals = Arc::new(Refusals::default());
    let next_batch = Arc::new(AtomicI64::new(0));
    let next_seq = Arc::new(AtomicI64::new(0));
    let next_write = Arc::new(AtomicI64::new(0));
    let mut totals: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut restarts = Vec::new();
    let mut double_restarts = 0;
    let mut queries = 0;
    for cycle in 0..cycles {
        // Mostly short lives, some long enough for everything to happen, sometimes a kill
        // right after the start.
        let roll = if cycle == 1 { 0 } else { rng.between(0, 10) };
        let life = match roll {
            0 if cycle > 0 => 0,
            1..=2 => {
                if long {
                    rng.between(5_000, 30_000)
                } else {
                    rng.between(2_000, 4_000)
                }
            }
            _ => rng.between(100, 1_500),
        };
        if life == 0 {
            // A quick double restart: killed as soon as it is up, then started again.
            server.kill().unwrap();
            server.wait().unwrap();
            server = spawn(&dir, port, &config);
            wait_healthy(port).await;
            double_restarts += 1;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for _ in 0..3 {
            tasks.push(tokio::spawn(ingest_client(
                base.clone(),
                client.clone(),
                next_batch.clone(),
                ledger.clone(),
                refusals.clone(),
                stop.clone(),
                profile.clone(),
            )));
        }
        tasks.push(tokio::spawn(producer(
            base.clone(),
            client.clone(),
            next_seq.clone(),
            ledger.clone(),
            refusals.clone(),
            stop.clone(),
            profile.append_pause,
        )));
        for _ in 0..3 {
            tasks.push(tokio::spawn(writer(
                base.clone(),
                client.clone(),
                next_write.clone(),
                ledger.clone(),
                refusals.clone(),
                stop.clone(),
                profile.append_pause,
            )));
        }
        let query_task = tokio::spawn(querier(base.clone(), client.clone(), stop.clone()));
        // Read the counters along the way: the last reading before the kill counts.
        let mut last = None;
        let until = std::time::Instant::now() + Duration::from_millis(life.max(50));
        while std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if let Some(c) = counters(&client, &base).await {
                last = Some(c);
            }
        }
        server.kill().unwrap();
        server.wait().unwrap();
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
        queries += query_task.await.unwrap();
        for (name, value) in last.unwrap_or_default() {
            *totals.entry(name).or_default() += value;
        }
        server = spawn(&dir, port, &config);
        restarts.push(wait_healthy(port).await);
        let snapshot = ledger.lock().unwrap().clone();
        verify(&client, &base, &snapshot, &profile).await;
        takes_writes(
            &client,
            &base,
            &next_batch,
            &next_seq,
            &ledger,
            &refusals,
            &profile,
        )
        .await;
        println!(
            "cycle {cycle}: lived {life} ms; {} rows acknowledged, {} unknown, {} stream appends \
             and {} concurrent writes acknowledged",
            snapshot.acked_batches.len() as i64 * profile.batch,
            snapshot.unknown_batches.len() as i64 * profile.batch,
            snapshot.acked_messages.len(),
            snapshot.acked_writes.len()
        );
    }
    let l = ledger.lock().unwrap().clone();
    let slowest = restarts.iter().max().copied().unwrap_or_default();
    println!(
        "crash loop done: {cycles} kills ({double_restarts} quick double restarts), {} rows \
         and {} stream appends acknowledged, {} rows unknown, {queries} queries answered, \
         {} ingest and {} append refusals (503, nothing applied), slowest restart {slowest:?}",
        l.acked_batches.len() as i64 * profile.batch,
        l.acked_messages.len(),
        l.unknown_batches.len() as i64 * profile.batch,
        refusals.ingest_503.load(Ordering::Relaxed),
        refusals.append_503.load(Ordering::Relaxed),
    );
    println!("between kills: {totals:?}");
    assert!(l.acked_batches.len() > cycles, "the load did not run");
    assert!(l.acked_messages.len() > cycles, "the producer did not run");
    assert!(l.acked_writes.len() > cycles, "the writers did not run");
    println!(
        "{} concurrent writes acknowledged, {} unknown",
        l.acked_writes.len(),
        l.unknown_writes.len()
    );
    for name in COUNTERS {
        assert!(
            totals.get(name).copied().unwrap_or(0) > 0,
            "{name} never moved between kills: the loop did not reach that threshold"
        );
    }
    let _ = server.kill();
    let _ = server.wait();
}
