//! sluice on a real S3 server (SeaweedFS, which `tests/run.sh` starts): the real binary with
//! `--object-store s3://...`. A bucket is a database: a node with an empty data directory sees
//! every table and flushed row, and two nodes can write one table at once.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

fn s3_url(name: &str) -> String {
    let base = std::env::var("SLUICE_TEST_S3_URL").expect(
        "SLUICE_TEST_S3_URL is not set: run the tests with `bash tests/run.sh`, which starts \
         a SeaweedFS S3 server",
    );
    format!("{base}/{name}-{}", std::process::id())
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-s3-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Node {
    child: Child,
    base: String,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    async fn start(data_dir: &Path, object_store: &str) -> Node {
        let port = free_port();
        let config = data_dir.with_extension("toml");
        std::fs::write(&config, "flush_interval_seconds = 0.3\n").unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--object-store", object_store])
            .arg("--config")
            .arg(&config)
            .env_remove("SLUICE_API_KEYS")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let node = Node {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let client = reqwest::Client::new();
        for _ in 0..400 {
            if let Ok(r) = client.get(format!("{}/v1/health", node.base)).send().await {
                if r.status() == 200 {
                    return node;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("sluice on {object_store} did not become healthy");
    }

    /// SIGTERM (which flushes), then wait for the exit.
    fn stop(mut self) {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "sluice exited with {status}");
    }

    async fn statement(&self, sql: &str) -> Value {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/statements", self.base))
            .json(&json!({"statement": sql, "format": "json"}))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let body: Value = r.json().await.unwrap();
        assert!(status.is_success(), "{sql}: {status} {body}");
        body
    }

    async fn count(&self, sql: &str) -> Option<i64> {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/statements", self.base))
            .json(&json!({"statement": sql, "format": "json"}))
            .send()
            .await
            .ok()?;
        if !r.status().is_success() {
            return None;
        }
        let body: Value = r.json().await.ok()?;
        body["result_set"]["rows"][0][0].as_str()?.parse().ok()
    }

    async fn ingest(&self, table: &str, ids: std::ops::Range<i64>) -> reqwest::StatusCode {
        ingest(&self.base, table, ids).await
    }

    /// Waits until `sql` counts `expected`.
    async fn wait_count(&self, sql: &str, expected: i64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = None;
        while Instant::now() < deadline {
            last = self.count(sql).await;
            if last == Some(expected) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("{sql} on {}: {last:?}, expected {expected}", self.base);
    }
}

/// Ingests rows `{"id": i, "s": "row i"}` for every `i` in `ids`.
async fn ingest(base: &str, table: &str, ids: std::ops::Range<i64>) -> reqwest::StatusCode {
    let body: String = ids
        .map(|i| format!("{{\"id\":{i},\"s\":\"row {i}\"}}\n"))
        .collect();
    reqwest::Client::new()
        .post(format!(
            "{base}/v1/catalog/databases/scopedb/schemas/public/tables/{table}/ingest"
        ))
        .header("content-type", "application/x-ndjson")
        .body(body)
        .send()
        .await
        .unwrap()
        .status()
}

#[tokio::test]
async fn ingest_query_restart_with_an_empty_data_directory() {
    let url = s3_url("restart");
    let first = Node::start(&temp_dir("restart-a"), &url).await;
    first.statement("CREATE TABLE t (id int, s string)").await;
    assert_eq!(first.ingest("t", 0..500).await, 200);
    first.wait_count("SELECT count(*) FROM t", 500).await;
    first.stop();
    // A new node: its own, empty data directory; everything comes from the bucket.
    let second = Node::start(&temp_dir("restart-b"), &url).await;
    second
        .wait_count("SELECT count(DISTINCT id) FROM t WHERE s LIKE 'row %'", 500)
        .await;
    assert_eq!(second.ingest("t", 500..600).await, 200);
    second.wait_count("SELECT count(*) FROM t", 600).await;
    second.stop();
}

#[tokio::test]
async fn two_nodes_write_one_table_through_one_bucket() {
    let url = s3_url("two-nodes");
    let a = Node::start(&temp_dir("two-a"), &url).await;
    let b = Node::start(&temp_dir("two-b"), &url).await;
    a.statement("CREATE TABLE shared (id int, s string)").await;
    // B learns of the table from the bucket (its ingest refreshes the catalog).
    let deadline = Instant::now() + Duration::from_secs(30);
    while b.ingest("shared", 0..1).await != 200 {
        assert!(Instant::now() < deadline, "node B never saw the table");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Both nodes commit batches to the same table at once; each flushes its own rows and
    // commits manifest versions through the conditional create.
    let writer = |node: &Node, start: i64| {
        let base = node.base.clone();
        async move {
            for k in 0..20 {
                let from = start + k * 50;
                assert_eq!(ingest(&base, "shared", from..from + 50).await, 200);
            }
        }
    };
    tokio::join!(writer(&a, 1_000), writer(&b, 10_000));
    let total = 1 + 2 * 20 * 50;
    for node in [&a, &b] {
        node.wait_count("SELECT count(DISTINCT id) FROM shared", total)
            .await;
        node.wait_count("SELECT count(*) FROM shared", total).await;
    }
    a.stop();
    b.stop();
}
