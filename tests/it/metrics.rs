//! `/metrics` after a known workload: every counter moved by exactly what the workload did.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;
use sluice::db::{Database, DbConfig};

/// Parses the exposition into `name{labels}` -> value.
fn scrape(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            Some((key.to_owned(), value.parse().ok()?))
        })
        .collect()
}

async fn metrics(client: &reqwest::Client, base: &str) -> HashMap<String, f64> {
    let r = client.get(format!("{base}/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    scrape(&r.text().await.unwrap())
}

fn get(m: &HashMap<String, f64>, key: &str) -> f64 {
    *m.get(key).unwrap_or(&0.0)
}

#[tokio::test]
async fn counters_move_by_what_the_workload_did() {
    let dir = common::temp_dir("metrics");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let (addr, _task) = common::serve(db.clone(), vec![]).await;
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{base}/v1/statements"))
        .json(&json!({"statement": "CREATE TABLE m (a int, s string)"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let before = metrics(&client, &base).await;

    let ingest = format!("{base}/v1/catalog/databases/scopedb/schemas/public/tables/m/ingest");
    let good = "{\"a\":1,\"s\":\"x\"}\n{\"a\":2,\"s\":\"y\"}\n{\"a\":3,\"s\":\"z\"}\n";
    for _ in 0..2 {
        let r = client
            .post(&ingest)
            .header("content-type", "application/x-ndjson")
            .body(good)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let bad = "{\"a\":\"no\"}\n{\"a\":1}\n{\"a\":1.5}\n";
    let r = client
        .post(&ingest)
        .header("content-type", "application/x-ndjson")
        .body(bad)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
    let stream = format!("{base}/v1/stream/metrics-s");
    client
        .put(&stream)
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    for body in ["one", "three"] {
        let r = client
            .post(&stream)
            .header("content-type", "text/plain")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
    }
    // A live reader stays open while we scrape.
    let sse = client
        .get(format!("{stream}?offset=now&live=sse"))
        .send()
        .await
        .unwrap();
    assert_eq!(sse.status(), 200);
    tokio::time::sleep(Duration::from_millis(100)).await;

    let after = metrics(&client, &base).await;
    let delta = |key: &str| get(&after, key) - get(&before, key);
    assert_eq!(delta("sluice_ingest_rows_total"), 6.0);
    assert_eq!(delta("sluice_ingest_bytes_total"), 2.0 * good.len() as f64);
    assert_eq!(delta("sluice_ingest_row_errors_total"), 2.0);
    assert_eq!(delta("sluice_stream_appends_total"), 2.0);
    assert_eq!(delta("sluice_stream_append_bytes_total"), 8.0);
    let route = "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/ingest";
    assert_eq!(
        delta(&format!(
            "sluice_http_requests_total{{method=\"POST\",route=\"{route}\",status=\"200\"}}"
        )),
        2.0
    );
    assert_eq!(
        delta(&format!(
            "sluice_http_requests_total{{method=\"POST\",route=\"{route}\",status=\"422\"}}"
        )),
        1.0
    );
    assert_eq!(
        delta(
            "sluice_http_requests_total{method=\"POST\",route=\"/v1/stream/{*name}\",status=\"204\"}"
        ),
        2.0
    );
    // One log record per commit: 2 ingests, the stream create, 2 appends.
    assert_eq!(delta("sluice_log_records_total"), 5.0);
    assert!(delta("sluice_log_syncs_total") >= 1.0);
    assert_eq!(get(&after, "sluice_stream_live_readers"), 1.0);
    let id = db
        .catalog()
        .table("scopedb", "public", "m")
        .await
        .unwrap()
        .id;
    let unflushed = get(
        &after,
        &format!("sluice_table_unflushed_bytes{{table=\"{id}\"}}"),
    );
    assert!(unflushed > 0.0, "{unflushed}");
    drop(sse);
    // Once flushed, nothing is unflushed and one flush is counted.
    db.tables().flush_due(true).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let flushed = metrics(&client, &base).await;
    assert_eq!(
        get(
            &flushed,
            &format!("sluice_table_unflushed_bytes{{table=\"{id}\"}}")
        ),
        0.0
    );
    assert_eq!(get(&flushed, "sluice_table_flushes_total"), 1.0);
    assert_eq!(get(&flushed, "sluice_stream_live_readers"), 0.0);
    assert_eq!(get(&flushed, "sluice_object_store_errors_total"), 0.0);
}
