//! The web console in a real browser: the real binary with an API key, Debian's Chromium driven
//! by playwright-core (`tests/console/console.test.mjs`). The script ingests, queries, tails a
//! stream and saves screenshots under `CARGO_TARGET_TMPDIR/console/`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

const KEY: &str = "console-test-key";
const STREAM: &str = "console/demo";
const CHROMIUM: &str = "/usr/bin/chromium";

fn node_project() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/console");
    assert!(
        dir.join("node_modules/playwright-core").exists() && Path::new(CHROMIUM).exists(),
        "the browser test needs Debian's chromium and playwright-core: run the tests with \
         `bash tests/run.sh`, which installs both"
    );
    dir
}

/// The seed row the verification query reads, plus 24 hourly rows of another service.
fn seed_rows() -> String {
    let mut rows = vec![
        r#"{"time":"2026-10-23T09:00:00Z","service":"checkout","name":"payment_failed","message":"Credit card gateway timed out","var":{"region":"apac","gateway":"credit_card"}}"#.to_owned(),
    ];
    for hour in 0..24 {
        rows.push(format!(
            r#"{{"time":"2026-10-23T{hour:02}:00:00Z","service":"web","name":"page_view","message":"view","var":{{"hour":{hour}}}}}"#
        ));
    }
    rows.join("\n")
}

async fn seed(base: &str) {
    let client = reqwest::Client::new();
    let auth = format!("Bearer {KEY}");
    let table = format!("{base}/v1/catalog/databases/scopedb/schemas/public/tables/events");
    let r = client
        .put(&table)
        .header("authorization", &auth)
        .json(&common::events_def())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let r = client
        .post(format!("{table}/ingest"))
        .header("authorization", &auth)
        .header("content-type", "application/x-ndjson")
        .body(seed_rows())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let stream = format!("{base}/v1/stream/{STREAM}");
    let r = client
        .put(&stream)
        .header("authorization", &auth)
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    for seq in 0..2 {
        let r = client
            .post(&stream)
            .header("authorization", &auth)
            .header("content-type", "application/json")
            .header("producer-id", "console-test-producer")
            .header("producer-epoch", "0")
            .header("producer-seq", seq.to_string())
            .body(format!(r#"{{"before":"the page opened","seq":{seq}}}"#))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    }
}

#[tokio::test]
async fn console_works_in_a_real_browser() {
    let project = node_project();
    let dir = common::temp_dir("console");
    let port = common::free_port();
    let mut server = common::sluice_serve(&dir, port)
        .args(["--api-key", KEY])
        .spawn()
        .unwrap();
    common::wait_healthy(port);
    let base = format!("http://127.0.0.1:{port}");
    seed(&base).await;
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console");
    let _ = std::fs::remove_dir_all(&out);
    let status = tokio::task::spawn_blocking({
        let base = base.clone();
        let out = out.clone();
        move || {
            Command::new("node")
                .current_dir(&project)
                .arg("console.test.mjs")
                .env("SLUICE_URL", base)
                .env("SLUICE_KEY", KEY)
                .env("SLUICE_STREAM", STREAM)
                .env("OUT_DIR", out)
                .env("CHROMIUM", CHROMIUM)
                .status()
                .expect("node runs")
        }
    })
    .await
    .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(status.success(), "the browser test failed: {status}");
    for shot in ["tables.png", "query.png", "query-chart.png", "streams.png"] {
        let path = out.join(shot);
        let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        assert!(size > 10_000, "{} is missing or empty", path.display());
    }
    println!("screenshots: {}", out.display());
    let _ = std::fs::remove_dir_all(&dir);
}
