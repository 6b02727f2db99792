//! The real `sluice` binary as a user runs it: start, ingest, SIGTERM (which flushes), restart.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};

use serde_json::{Value, json};

use crate::common;

fn spawn(dir: &std::path::Path, port: u16) -> Child {
    common::sluice_serve(dir, port)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

async fn wait_healthy(_client: &reqwest::Client, port: u16) {
    tokio::task::spawn_blocking(move || common::wait_healthy(port))
        .await
        .unwrap();
}

#[tokio::test]
async fn sigterm_flushes_and_a_restart_serves_the_rows() {
    let dir = std::env::temp_dir().join(format!("sluice-process-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let client = reqwest::Client::new();
    let port = common::free_port();
    let mut child = spawn(&dir, port);
    wait_healthy(&client, port).await;
    let base = format!("http://127.0.0.1:{port}");
    let r = client
        .post(format!("{base}/v1/statements"))
        .json(&json!({"statement": "CREATE TABLE t (a int, s string)"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "finished");
    let r = client
        .post(format!(
            "{base}/v1/catalog/databases/scopedb/schemas/public/tables/t/ingest"
        ))
        .header("content-type", "application/x-ndjson")
        .body("{\"a\":1,\"s\":\"x\"}\n{\"a\":2,\"s\":\"y\"}\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = child.wait().unwrap();
    assert!(exit.success(), "clean exit on SIGTERM: {exit:?}");
    let mut log = String::new();
    if let Some(stderr) = child.stderr.take() {
        for line in BufReader::new(stderr).lines() {
            log.push_str(&line.unwrap());
            log.push('\n');
        }
    }
    assert!(log.contains("shutting down"), "{log}");
    // The shutdown flush wrote the rows as Parquet.
    let tables = dir.join("objects/tables");
    let parquet = std::fs::read_dir(&tables)
        .unwrap()
        .flat_map(|t| {
            std::fs::read_dir(t.unwrap().path().join("data"))
                .into_iter()
                .flatten()
        })
        .count();
    assert_eq!(parquet, 1);

    let port = common::free_port();
    let mut child = spawn(&dir, port);
    wait_healthy(&client, port).await;
    let r = client
        .post(format!("http://127.0.0.1:{port}/v1/statements"))
        .json(&json!({"statement": "SELECT a, s FROM t ORDER BY a"}))
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["result_set"]["rows"], json!([["1", "x"], ["2", "y"]]));
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

#[test]
fn refuses_a_public_address_without_api_keys() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["serve", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(std::env::temp_dir().join("sluice-never"))
        .env_remove("SLUICE_API_KEYS")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not loopback"), "{stderr}");
}

/// The binary as a user starts it, with no setting at all: `--print-config` says it syncs,
/// and it does: its sync counter moves with every acknowledged write. (A kill loop alone
/// cannot tell: `kill -9` keeps the page cache, so it passes with `durability = "none"`.)
#[tokio::test]
async fn the_default_configuration_syncs_every_acknowledged_write() {
    let dir = common::temp_dir("default-syncs");
    let printed = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["serve", "--print-config", "--data-dir"])
        .arg(&dir)
        .env_remove("SLUICE_DURABILITY")
        .env_remove("SLUICE_CONFIG")
        .output()
        .unwrap();
    assert!(printed.status.success());
    let text = String::from_utf8_lossy(&printed.stdout);
    assert!(
        text.lines().any(|l| l.trim() == "durability = \"fsync\""),
        "{text}"
    );
    let port = common::free_port();
    let mut child = common::sluice_serve(&dir, port)
        .env_remove("SLUICE_DURABILITY")
        .env_remove("SLUICE_CONFIG")
        .spawn()
        .unwrap();
    let client = reqwest::Client::new();
    wait_healthy(&client, port).await;
    let base = format!("http://127.0.0.1:{port}");
    let syncs = || common::metric(&client, &base, "sluice_log_syncs_total");
    common::statement(&client, &base, "CREATE TABLE t (id int)").await;
    let r = client
        .put(format!("{base}/v1/stream/synced"))
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    for i in 0..5 {
        let before = syncs().await;
        let r = client
            .post(format!(
                "{base}/v1/catalog/databases/scopedb/schemas/public/tables/t/ingest"
            ))
            .header("content-type", "application/x-ndjson")
            .body(format!("{{\"id\":{i}}}\n"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let after_row = syncs().await;
        assert!(
            after_row > before,
            "an acknowledged row was not synced ({before} -> {after_row})"
        );
        let r = client
            .post(format!("{base}/v1/stream/synced"))
            .header("content-type", "text/plain")
            .body(format!("append {i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
        let after_append = syncs().await;
        assert!(
            after_append > after_row,
            "an acknowledged append was not synced ({after_row} -> {after_append})"
        );
    }
    child.kill().unwrap();
    child.wait().unwrap();
}
