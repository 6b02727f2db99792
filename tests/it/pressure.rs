//! Pressure: a full log disk while the object store is down, and a slow fsync. The server answers
//! 503 with `Retry-After` and nothing applied, stays up, and recovers on its own.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice::db::{Database, DbConfig};
use sluice::log::FailPoint;
use sluice::storage::Storage;
use sluice::storage::probe::{Probe, ProbedStore};

fn rows(first: i64, n: i64) -> String {
    (first..first + n)
        .map(|i| format!("{{\"id\":{i},\"pad\":\"{}\"}}\n", "p".repeat(200)))
        .collect()
}

async fn count(client: &reqwest::Client, base: &str) -> (i64, i64) {
    let r = common::statement(client, base, "SELECT count(*), count(DISTINCT id) FROM t").await;
    let cell = |i: usize| {
        r["result_set"]["rows"][0][i]
            .as_str()
            .unwrap()
            .parse()
            .unwrap()
    };
    (cell(0), cell(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_log_answers_503_with_nothing_applied_and_recovers_on_its_own() {
    let dir = common::temp_dir("pressure-full");
    let probe = Arc::new(Probe::default());
    let store = ProbedStore::new(
        Arc::new(object_store::memory::InMemory::new()),
        probe.clone(),
    );
    let mut config = DbConfig::new(&dir);
    config.max_log_bytes = 512 << 10;
    config.log_segment_bytes = 32 << 10;
    config.maintenance_interval = Duration::from_millis(100);
    config.tables.flush_interval = Duration::from_millis(100);
    config.streams.checkpoint_interval = Duration::from_millis(100);
    let db = Database::open_with_storage(config, Storage::from_store(Arc::new(store), "p://"))
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let maintenance = tokio::spawn(db.clone().run_maintenance(async {
        let _ = stopped.await;
    }));
    let (addr, _task) = common::serve(db.clone(), vec![]).await;
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    common::statement(&client, &base, "CREATE TABLE t (id int, pad string)").await;
    client
        .put(format!("{base}/v1/stream/pressure"))
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    let ingest = format!("{base}/v1/catalog/databases/scopedb/schemas/public/tables/t/ingest");
    let post = |first: i64| {
        client
            .post(&ingest)
            .header("content-type", "application/x-ndjson")
            .body(rows(first, 100))
            .send()
    };

    // The store goes away: flushes fail, the log fills, and then writes are refused.
    probe.set_down(true);
    let mut acked = 0i64;
    let refusal = loop {
        let r = post(acked).await.unwrap();
        if r.status() == 200 {
            acked += 100;
            assert!(acked < 100_000, "the log budget never applied");
            continue;
        }
        break r;
    };
    assert_eq!(refusal.status(), 503);
    assert_eq!(refusal.headers()["retry-after"], "1");
    let body: Value = refusal.json().await.unwrap();
    assert_eq!(body["details"]["status"], "rejected", "{body}");
    let append = client
        .post(format!("{base}/v1/stream/pressure"))
        .header("content-type", "text/plain")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(append.status(), 503);
    assert_eq!(append.headers()["x-sluice-not-applied"], "LogDiskPressure");
    assert_eq!(append.headers()["retry-after"], "1");
    // Still up, still answering reads from memory.
    let health = client
        .get(format!("{base}/v1/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(count(&client, &base).await, (acked, acked));

    // The store is back: maintenance flushes, the log is released, writes are taken again,
    // with nobody stepping in.
    probe.set_down(false);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = post(acked).await.unwrap();
        if r.status() == 200 {
            acked += 100;
            break;
        }
        assert_eq!(r.status(), 503);
        assert!(Instant::now() < deadline, "the server did not recover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let append = client
        .post(format!("{base}/v1/stream/pressure"))
        .header("content-type", "text/plain")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(append.status(), 204);
    assert_eq!(count(&client, &base).await, (acked, acked));
    let _ = stop.send(());
    maintenance.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_fsync_slows_writes_but_refuses_and_loses_nothing() {
    let dir = common::temp_dir("pressure-slow");
    let mut config = DbConfig::new(&dir);
    config.log_fail_hook = Some(Arc::new(|point| {
        if point == FailPoint::BeforeSync {
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }));
    let db = Database::open(config).await.unwrap();
    let (addr, _task) = common::serve(db, vec![]).await;
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    common::statement(&client, &base, "CREATE TABLE t (id int, pad string)").await;
    let mut tasks = Vec::new();
    for c in 0..8i64 {
        let client = client.clone();
        let url = format!("{base}/v1/catalog/databases/scopedb/schemas/public/tables/t/ingest");
        tasks.push(tokio::spawn(async move {
            for b in 0..10 {
                let r = client
                    .post(&url)
                    .header("content-type", "application/x-ndjson")
                    .body(rows(c * 10_000 + b * 100, 100))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
            }
        }));
    }
    // Reads that do not touch the log stay answered meanwhile.
    let health = client
        .get(format!("{base}/v1/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(count(&client, &base).await, (8_000, 8_000));
}
