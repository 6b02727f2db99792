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
