//! Hostile and malformed input (`testdata/bad-input/cases.json`): each request gets its
//! documented 4xx, changes nothing, and the server stays healthy; a body trickled slower than
//! the body deadline is cut off with 408.

use crate::common;

use std::io::{Read as _, Write as _};
use std::time::Duration;

use serde_json::Value;
use sluice::db::{Database, DbConfig};
use sluice::http::{AppState, router};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_request_gets_its_documented_status_and_the_server_stays_up() {
    let corpus: Value =
        serde_json::from_str(include_str!("../../testdata/bad-input/cases.json")).unwrap();
    let dir = common::temp_dir("bad-input");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let (addr, _task) = common::serve(db.clone(), vec![]).await;
    let base = format!("http://{addr}");
    // A connection per request: the server may close one whose request it refused before
    // reading all of it, and reusing a pooled one would race that close.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    for sql in ["CREATE TABLE t (a int, s string)", "CREATE TABLE j (v any)"] {
        common::statement(&client, &base, sql).await;
    }
    let r = client
        .put(format!("{base}/v1/stream/bad-json"))
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let cases = corpus["cases"].as_array().unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut request = client.request(
            case["method"].as_str().unwrap().parse().unwrap(),
            format!("{base}{}", case["path"].as_str().unwrap()),
        );
        for (k, v) in case["headers"].as_object().unwrap() {
            request = request.header(k.as_str(), common::build_bytes(v));
        }
        let response = request
            .body(common::build_bytes(&case["body"]))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let body = response.text().await.unwrap_or_default();
        if u64::from(status) != case["status"].as_u64().unwrap() {
            failures.push(format!(
                "{name}: {status} (expected {}) {body}",
                case["status"]
            ));
        }
        // Every refusal, whichever layer gives it, has the one error body and says nothing
        // was applied.
        let error: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        if !(error["code"].is_string()
            && error["message"].is_string()
            && error["details"]["status"] == "rejected")
        {
            failures.push(format!("{name}: not the error body: {body}"));
        }
        let health = client
            .get(format!("{base}/v1/health"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("unhealthy after {name}: {e}"));
        assert_eq!(health.status(), 200, "unhealthy after {name}");
    }
    assert!(failures.is_empty(), "{failures:#?}");
    // Nothing of any of it was applied.
    let r = common::statement(
        &client,
        &base,
        "SELECT (SELECT count(*) FROM t) + (SELECT count(*) FROM j)",
    )
    .await;
    assert_eq!(r["result_set"]["rows"][0][0], "0");
    let info = db.streams().get("bad-json").await.unwrap().info();
    assert_eq!(info.tail, 0);
    assert!(db.streams().get("ttl-bad").await.is_err());
    println!("{} hostile requests refused as documented", cases.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_is_cut_off_at_the_deadline() {
    let dir = common::temp_dir("slowloris");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(AppState::new(db, vec![]).with_body_timeout(Duration::from_millis(800)));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let answer = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(
            b"POST /v1/statements HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
              Content-Length: 1000\r\n\r\n{\"statement\":",
        )
        .unwrap();
        // A byte now and then, never the whole body.
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(400));
            let _ = s.write_all(b" ");
        }
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
}
