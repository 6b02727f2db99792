//! Crash loop: the real `sluice serve` under mixed load (table ingest from several clients, an
//! idempotent stream producer, queries), killed with SIGKILL at random moments and restarted.
//! After every restart: the server starts; every acknowledged row is queryable exactly once and
//! nothing unacknowledged appears twice; every acknowledged stream message is readable once, at
//! its acknowledged offset; a producer's retries of unacknowledged appends land at most once.
//!
//! Short form (CI): 10 cycles. Long form: `SLUICE_CRASH_CYCLES=100 cargo test --test crash --
//! --nocapture` (prints the figures). `SLUICE_CRASH_SEED` replays a run.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

fn spawn(dir: &std::path::Path, port: u16) -> Child {
    common::sluice_serve(dir, port).spawn().unwrap()
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
#[derive(Default)]
struct Ledger {
    /// Row ids acknowledged (200).
    acked_rows: BTreeSet<i64>,
    /// Row ids whose request got no answer (the kill came mid-request).
    unknown_rows: BTreeSet<i64>,
    /// Producer sequence -> acknowledged Stream-Next-Offset (None for a duplicate answer).
    acked_messages: BTreeMap<u64, Option<u64>>,
}

async fn ingest_client(
    base: String,
    client: reqwest::Client,
    next_id: Arc<AtomicI64>,
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        let first = next_id.fetch_add(10, Ordering::Relaxed);
        let ids: Vec<i64> = (first..first + 10).collect();
        let body: String = ids
            .iter()
            .map(|i| format!("{{\"id\":{i},\"note\":\"row {i}\"}}\n"))
            .collect();
        let r = client
            .post(format!(
                "{base}/v1/catalog/databases/scopedb/schemas/public/tables/c/ingest"
            ))
            .header("content-type", "application/x-ndjson")
            .body(body)
            .send()
            .await;
        let mut l = ledger.lock().unwrap();
        match r {
            Ok(r) if r.status() == 200 => l.acked_rows.extend(ids),
            // Refused with nothing applied (503 while the log is busy, say).
            Ok(r) if r.status().is_client_error() || r.status() == 503 => {}
            _ => {
                l.unknown_rows.extend(ids);
                return;
            }
        }
    }
}

/// Appends `{"s": seq}` with producer headers; an append without an answer is retried with the
/// same sequence number after the restart (it must land at most once).
async fn producer(
    base: String,
    client: reqwest::Client,
    next_seq: Arc<AtomicI64>,
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        let seq = next_seq.load(Ordering::Relaxed) as u64;
        let r = client
            .post(format!("{base}/v1/stream/crash"))
            .header("content-type", "application/json")
            .header("producer-id", "crash-producer")
            .header("producer-epoch", "0")
            .header("producer-seq", seq.to_string())
            .body(json!({"s": seq}).to_string())
            .send()
            .await;
        match r {
            Ok(r) if r.status() == 200 || r.status() == 204 => {
                let offset = r
                    .headers()
                    .get("stream-next-offset")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.split_once('_'))
                    .and_then(|(_, b)| b.parse().ok());
                let duplicate = r.status() == 204;
                ledger
                    .lock()
                    .unwrap()
                    .acked_messages
                    .insert(seq, if duplicate { None } else { offset });
                next_seq.fetch_add(1, Ordering::Relaxed);
            }
            // 503: nothing applied, try the same sequence again.
            Ok(r) if r.status() == 503 => tokio::time::sleep(Duration::from_millis(20)).await,
            Ok(r) => panic!("producer append {seq}: {}", r.status()),
            // No answer: retried with the same sequence once the server is back.
            Err(_) => return,
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
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    answered
}

/// Checks every invariant against what the server serves now.
async fn verify(client: &reqwest::Client, base: &str, ledger: &Ledger) {
    let r = common::statement(client, base, "SELECT id FROM c").await;
    assert_eq!(r["status"], "finished", "{r}");
    let ids: Vec<i64> = r["result_set"]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row[0].as_str().unwrap().parse().unwrap())
        .collect();
    let distinct: BTreeSet<i64> = ids.iter().copied().collect();
    assert_eq!(distinct.len(), ids.len(), "a row is visible twice");
    let missing: Vec<&i64> = ledger.acked_rows.difference(&distinct).collect();
    assert!(missing.is_empty(), "acknowledged rows lost: {missing:?}");
    let strays: Vec<&i64> = distinct
        .iter()
        .filter(|i| !ledger.acked_rows.contains(i) && !ledger.unknown_rows.contains(i))
        .collect();
    assert!(strays.is_empty(), "rows nobody sent: {strays:?}");
    // The stream, as stored: one message per line; its end offset is where the line ends.
    let body = client
        .get(format!("{base}/v1/stream/crash"))
        .header("accept", "application/x-ndjson")
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let mut at = 0u64;
    let mut seen = BTreeMap::new();
    for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        at += line.len() as u64 + 1;
        let m: Value = serde_json::from_slice(line).unwrap();
        let seq = m["s"].as_u64().unwrap();
        assert!(
            seen.insert(seq, at).is_none(),
            "producer append {seq} landed twice"
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_at_random_moments_it_loses_nothing_acknowledged() {
    let cycles: usize = std::env::var("SLUICE_CRASH_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
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
    println!("crash loop: {cycles} cycles, seed {seed}");
    let mut rng = Rng(seed);
    let dir = common::temp_dir("crash");
    let port = common::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let mut server = spawn(&dir, port);
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
    let next_id = Arc::new(AtomicI64::new(0));
    let next_seq = Arc::new(AtomicI64::new(0));
    let mut restarts = Vec::new();
    let mut queries = 0;
    for cycle in 0..cycles {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for _ in 0..3 {
            tasks.push(tokio::spawn(ingest_client(
                base.clone(),
                client.clone(),
                next_id.clone(),
                ledger.clone(),
                stop.clone(),
            )));
        }
        tasks.push(tokio::spawn(producer(
            base.clone(),
            client.clone(),
            next_seq.clone(),
            ledger.clone(),
            stop.clone(),
        )));
        let query_task = tokio::spawn(querier(base.clone(), client.clone(), stop.clone()));
        tokio::time::sleep(Duration::from_millis(rng.between(150, 900))).await;
        server.kill().unwrap();
        server.wait().unwrap();
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
        queries += query_task.await.unwrap();
        server = spawn(&dir, port);
        restarts.push(wait_healthy(port).await);
        let snapshot = {
            let l = ledger.lock().unwrap();
            Ledger {
                acked_rows: l.acked_rows.clone(),
                unknown_rows: l.unknown_rows.clone(),
                acked_messages: l.acked_messages.clone(),
            }
        };
        verify(&client, &base, &snapshot).await;
        println!(
            "cycle {cycle}: {} rows acknowledged, {} unknown, {} stream appends acknowledged",
            snapshot.acked_rows.len(),
            snapshot.unknown_rows.len(),
            snapshot.acked_messages.len()
        );
    }
    let l = ledger.lock().unwrap();
    let slowest = restarts.iter().max().copied().unwrap_or_default();
    println!(
        "crash loop done: {cycles} kills, {} rows and {} stream appends acknowledged, {} rows \
         unknown, {queries} queries answered, slowest restart {slowest:?}",
        l.acked_rows.len(),
        l.acked_messages.len(),
        l.unknown_rows.len()
    );
    assert!(l.acked_rows.len() > cycles * 10, "the load did not run");
    assert!(l.acked_messages.len() > cycles, "the producer did not run");
    drop(l);
    let _ = server.kill();
    let _ = server.wait();
}
