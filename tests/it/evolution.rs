//! Schema evolution through the real binary: a table with flushed, compacted and unflushed
//! rows taken through an added column, a rename, a drop and a new column that reuses the
//! dropped one's name (of another type), with writers ingesting throughout; every
//! acknowledged row read back right by SQL, after a restart, by pyiceberg and Daft through
//! the Iceberg view, and (on the shared S3 server) by a second node sharing the bucket, which
//! writes throughout too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::common::{free_port, metric};

/// Flushes every 0.2 s and compacts two files: rows are flushed, compacted and unflushed at
/// every step.
const CONFIG: &str = "flush_interval_seconds = 0.2\nmaintenance_interval_seconds = 0.1\n\
                      compact_min_files = 2\nstream_checkpoint_interval_seconds = 0.5\n";

struct Node {
    child: Child,
    base: String,
    port: u16,
    data_dir: PathBuf,
    object_store: Option<String>,
}

impl Node {
    fn spawn(port: u16, data_dir: &Path, object_store: Option<&str>) -> Node {
        let config = data_dir.with_extension("toml");
        std::fs::write(&config, CONFIG).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
        command
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--config")
            .arg(&config)
            .env_remove("SLUICE_API_KEYS")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(url) = object_store {
            command.args(["--object-store", url]);
        }
        let child = command.spawn().unwrap();
        super::common::wait_healthy(port);
        Node {
            child,
            base: format!("http://127.0.0.1:{port}"),
            port,
            data_dir: data_dir.to_owned(),
            object_store: object_store.map(str::to_owned),
        }
    }

    fn start(name: &str, object_store: Option<&str>) -> Node {
        let dir = super::common::temp_dir(name);
        std::fs::create_dir_all(&dir).unwrap();
        Node::spawn(free_port(), &dir, object_store)
    }

    /// SIGKILL, then the same node again on its data.
    fn restart(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let again = Node::spawn(self.port, &self.data_dir, self.object_store.as_deref());
        let old = std::mem::replace(self, again);
        std::mem::forget(old);
    }

    async fn statement(&self, sql: &str) -> Value {
        super::common::statement(&reqwest::Client::new(), &self.base, sql).await
    }

    async fn rows(&self, sql: &str) -> Vec<Vec<Value>> {
        let body = self.statement(sql).await;
        serde_json::from_value(body["result_set"]["rows"].clone()).unwrap()
    }

    async fn stats(&self, table: &str) -> Value {
        reqwest::get(format!(
            "{}/v1/catalog/databases/scopedb/schemas/public/tables/{table}/stats",
            self.base
        ))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The shapes the writers send rows in, one for each step of the changes.
fn row(step: usize, id: i64) -> Value {
    match step {
        0 => json!({"id": id, "a": format!("a{id}")}),
        1 => json!({"id": id, "a": format!("a{id}"), "b": format!("old{id}")}),
        2 => json!({"id": id, "a2": format!("a{id}"), "b": format!("old{id}")}),
        3 => json!({"id": id, "a2": format!("a{id}")}),
        _ => json!({"id": id, "a2": format!("a{id}"), "b": id}),
    }
}

/// What a row acknowledged in `step` reads as at the end: `[id, a2, b]` (every cell as text;
/// only the last step's `b` is the new column's).
fn expected(id: i64, step: usize) -> Vec<Value> {
    let b = if step == 4 {
        json!(id.to_string())
    } else {
        Value::Null
    };
    vec![json!(id.to_string()), json!(format!("a{id}")), b]
}

/// Sends batches of five rows to `base` in the current step's shape until `stop`: a batch
/// refused because its shape is no longer the table's (422) is sent again in the new one.
/// Returns each acknowledged id with the step it was sent in.
async fn writer(
    base: String,
    first_id: i64,
    step: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) -> BTreeMap<i64, usize> {
    let client = reqwest::Client::new();
    let mut acked = BTreeMap::new();
    let mut next = first_id;
    while !stop.load(Ordering::SeqCst) {
        let now = step.load(Ordering::SeqCst);
        let body: String = (next..next + 5)
            .map(|id| format!("{}\n", row(now, id)))
            .collect();
        let r = client
            .post(format!(
                "{base}/v1/catalog/databases/scopedb/schemas/public/tables/t/ingest"
            ))
            .header("content-type", "application/x-ndjson")
            .body(body)
            .send()
            .await
            .unwrap();
        match r.status().as_u16() {
            200 => {
                for id in next..next + 5 {
                    acked.insert(id, now);
                }
                next += 5;
            }
            422 => tokio::time::sleep(Duration::from_millis(5)).await,
            other => panic!("ingest answered {other}: {}", r.text().await.unwrap()),
        }
    }
    acked
}

/// Waits until table `t` on `node` has files and no unflushed rows.
async fn wait_flushed(node: &Node) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = node.stats("t").await;
        if stats["unflushed_rows"] == 0 && stats["files"].as_u64() > Some(0) {
            return;
        }
        assert!(Instant::now() < deadline, "never flushed: {stats}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every acknowledged row, as SQL on `node` must read it (another node's rows once it has
/// read their files: their count is waited for).
async fn check_sql(node: &Node, acked: &BTreeMap<i64, usize>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut rows = node.rows("SELECT id, a2, b FROM t ORDER BY id").await;
    while rows.len() < acked.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        rows = node.rows("SELECT id, a2, b FROM t ORDER BY id").await;
    }
    let want: Vec<Vec<Value>> = acked.iter().map(|(id, s)| expected(*id, *s)).collect();
    assert_eq!(rows.len(), want.len(), "row count on {}", node.base);
    for (got, want) in rows.iter().zip(&want) {
        assert_eq!(got, want, "on {}", node.base);
    }
    // The column list is the current shape, in order; the old `b` is gone for good.
    let described = node.rows("DESCRIBE t").await;
    let names: Vec<(&str, &str)> = described
        .iter()
        .map(|r| (r[0].as_str().unwrap(), r[1].as_str().unwrap()))
        .collect();
    assert_eq!(names, [("id", "int"), ("a2", "string"), ("b", "int")]);
}

/// The Iceberg view read by pyiceberg and Daft: the current schema with its ids, and every
/// acknowledged row.
fn check_iceberg(node: &Node, acked: &BTreeMap<i64, usize>) {
    let seen = super::iceberg::read(&node.base, "none", "t", None, "daft");
    let want: Vec<Value> = acked
        .iter()
        .map(|(id, s)| {
            let b = if *s == 4 { json!(id) } else { Value::Null };
            json!({"id": id, "a2": format!("a{id}"), "b": b})
        })
        .collect();
    assert_eq!(
        seen["iceberg_types"],
        json!({"id": "long", "a2": "string", "b": "long"})
    );
    assert_eq!(seen["rows"].as_array().unwrap().len(), want.len());
    assert_eq!(seen["rows"], json!(want), "pyiceberg");
    assert_eq!(seen["readers"]["daft"]["rows"], json!(want), "daft");
}

/// The changes, each after rows of the step before were flushed (and compacted) and while
/// the writers go on; then the checks. `second` writes too, and reads everything back.
async fn evolve(first: &mut Node, second: Option<&Node>) {
    first.statement("CREATE TABLE t (id int, a string)").await;
    let step = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = vec![tokio::spawn(writer(
        first.base.clone(),
        0,
        step.clone(),
        stop.clone(),
    ))];
    if let Some(second) = second {
        writers.push(tokio::spawn(writer(
            second.base.clone(),
            1_000_000_000,
            step.clone(),
            stop.clone(),
        )));
    }
    let changes = [
        "ALTER TABLE t ADD COLUMN b string COMMENT 'to be dropped'",
        "ALTER TABLE t RENAME COLUMN a TO a2",
        "ALTER TABLE t DROP COLUMN b",
        "ALTER TABLE t ADD COLUMN IF NOT EXISTS b int",
    ];
    for (i, change) in changes.iter().enumerate() {
        // Files of this shape (two flushes), and a compaction since the step before.
        let deadline = Instant::now() + Duration::from_secs(60);
        let client = reqwest::Client::new();
        let flushes = "sluice_table_flushes_total";
        let compactions = "sluice_table_compactions_total";
        let (f0, c0) = (
            metric(&client, &first.base, flushes).await,
            metric(&client, &first.base, compactions).await,
        );
        while metric(&client, &first.base, flushes).await < f0 + 2.0
            || metric(&client, &first.base, compactions).await < c0 + 1.0
        {
            assert!(
                Instant::now() < deadline,
                "no flushes and compaction before step {i}: {}",
                first.stats("t").await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        first.statement(change).await;
        step.store(i + 1, Ordering::SeqCst);
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    stop.store(true, Ordering::SeqCst);
    let mut acked = BTreeMap::new();
    for w in writers {
        acked.extend(w.await.unwrap());
    }
    for s in 0..=4 {
        assert!(
            acked.values().any(|v| *v == s),
            "no row was acknowledged in step {s}"
        );
    }
    // Unflushed rows are read as they are (in memory, of several shapes); another node's
    // once flushed.
    if let Some(second) = second {
        wait_flushed(second).await;
        check_sql(second, &acked).await;
    }
    check_sql(first, &acked).await;
    // The log replayed after a kill: batches of every shape.
    first.restart();
    check_sql(first, &acked).await;
    wait_flushed(first).await;
    if let Some(second) = second {
        wait_flushed(second).await;
        check_sql(second, &acked).await;
    }
    check_sql(first, &acked).await;
    check_iceberg(first, &acked);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_table_changes_shape_under_ingest_and_every_row_reads_back() {
    let mut node = Node::start("evolve", None);
    evolve(&mut node, None).await;
    let _ = std::fs::remove_dir_all(&node.data_dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_on_one_bucket_follow_every_change() {
    let base = std::env::var("SLUICE_TEST_S3_URL").expect(
        "SLUICE_TEST_S3_URL is not set: run the tests with `bash tests/run.sh`, which starts \
         a SeaweedFS S3 server",
    );
    let url = format!("{base}/evolve-{}", std::process::id());
    let mut first = Node::start("evolve-s3-a", Some(&url));
    let second = Node::start("evolve-s3-b", Some(&url));
    evolve(&mut first, Some(&second)).await;
}
