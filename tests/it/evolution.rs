//! Schema evolution through the real binary: a table with flushed, compacted and unflushed
//! rows taken through an added column, a rename, a drop and a new column that reuses the
//! dropped one's name (of another type), with writers ingesting throughout; every
//! acknowledged row read back right by SQL, after a restart, by pyiceberg and Daft through
//! the Iceberg view, and (on the shared S3 server) by a second node sharing the bucket, which
//! writes throughout too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::common::{free_port, metric};

/// Flushes every 0.2 s and compacts two files: rows are flushed, compacted and unflushed at
/// every step.
const CONFIG: &str = "flush_interval_seconds = 0.2\nmaintenance_interval_seconds = 0.1\n\
                      compact_min_files = 2\nstream_checkpoint_interval_seconds = 0.5\n";

/// As [`CONFIG`], and never compacts: the files of every shape stay as they were written.
const NO_COMPACTION: &str = "flush_interval_seconds = 0.2\nmaintenance_interval_seconds = 0.1\n\
                             compact_min_files = 100000\n";

struct Node {
    child: Child,
    base: String,
    port: u16,
    data_dir: PathBuf,
    object_store: Option<String>,
    config: &'static str,
}

impl Node {
    fn spawn(port: u16, data_dir: &Path, object_store: Option<&str>, text: &'static str) -> Node {
        let config = data_dir.with_extension("toml");
        std::fs::write(&config, text).unwrap();
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
            config: text,
        }
    }

    fn start(name: &str, object_store: Option<&str>) -> Node {
        Node::start_with(name, object_store, CONFIG)
    }

    fn start_with(name: &str, object_store: Option<&str>, config: &'static str) -> Node {
        let dir = super::common::temp_dir(name);
        std::fs::create_dir_all(&dir).unwrap();
        Node::spawn(free_port(), &dir, object_store, config)
    }

    /// SIGKILL, then the same node again on its data.
    fn restart(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        let again = Node::spawn(
            self.port,
            &self.data_dir,
            self.object_store.as_deref(),
            self.config,
        );
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

/// The first id the second node's writer sends.
const SECOND_IDS: i64 = 1_000_000_000;

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
    acked: Arc<Mutex<BTreeMap<i64, usize>>>,
) {
    let client = reqwest::Client::new();
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
                let mut acked = acked.lock().unwrap();
                for id in next..next + 5 {
                    acked.insert(id, now);
                }
                next += 5;
            }
            422 => tokio::time::sleep(Duration::from_millis(5)).await,
            other => panic!("ingest answered {other}: {}", r.text().await.unwrap()),
        }
    }
}

/// Right after change `step`: every row acknowledged before it (`before`, this node's), read
/// by `SELECT *` in the new shape, from files of older shapes, compacted ones and memory.
async fn check_step(node: &Node, before: &BTreeMap<i64, usize>, step: usize) {
    let rows = node.rows("SELECT * FROM t ORDER BY id").await;
    let mut rows = rows.into_iter().filter(|r| {
        r[0].as_str()
            .and_then(|id| id.parse::<i64>().ok())
            .is_some_and(|id| before.contains_key(&id))
    });
    for (id, written) in before {
        let mut want = vec![json!(id.to_string()), json!(format!("a{id}"))];
        match step {
            1 | 2 if matches!(written, 1 | 2) => want.push(json!(format!("old{id}"))),
            1 | 2 | 4 => want.push(Value::Null),
            _ => {}
        }
        assert_eq!(rows.next(), Some(want), "after step {step}");
    }
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
    // The schema history: one schema per change, each with its columns' ids.
    assert_eq!(seen["current_schema_id"], 4);
    assert_eq!(
        seen["schemas"],
        json!({
            "0": [[1, "id", "long"], [2, "a", "string"]],
            "1": [[1, "id", "long"], [2, "a", "string"], [3, "b", "string"]],
            "2": [[1, "id", "long"], [2, "a2", "string"], [3, "b", "string"]],
            "3": [[1, "id", "long"], [2, "a2", "string"]],
            "4": [[1, "id", "long"], [2, "a2", "string"], [4, "b", "long"]],
        })
    );
    assert_eq!(seen["rows"].as_array().unwrap().len(), want.len());
    assert_eq!(seen["rows"], json!(want), "pyiceberg");
    assert_eq!(seen["readers"]["daft"]["rows"], json!(want), "daft");
}

/// The changes, each after rows of the step before were flushed (and compacted) and while
/// the writers go on; then the checks. `second` writes too, and reads everything back.
async fn evolve(first: &mut Node, second: Option<&Node>) {
    let compacting = first.config != NO_COMPACTION;
    first.statement("CREATE TABLE t (id int, a string)").await;
    let step = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(BTreeMap::new()));
    let mut writers = vec![tokio::spawn(writer(
        first.base.clone(),
        0,
        step.clone(),
        stop.clone(),
        acked.clone(),
    ))];
    if let Some(second) = second {
        writers.push(tokio::spawn(writer(
            second.base.clone(),
            SECOND_IDS,
            step.clone(),
            stop.clone(),
            acked.clone(),
        )));
    }
    let changes = [
        "ALTER TABLE t ADD COLUMN b string COMMENT 'to be dropped'",
        "ALTER TABLE t RENAME COLUMN a TO a2",
        "ALTER TABLE t DROP COLUMN b",
        "ALTER TABLE t ADD COLUMN IF NOT EXISTS b int",
    ];
    for (i, change) in changes.iter().enumerate() {
        // Files of this shape (two flushes), and (if it compacts) a compaction since the step
        // before.
        let deadline = Instant::now() + Duration::from_secs(60);
        let client = reqwest::Client::new();
        let flushes = "sluice_table_flushes_total";
        let compactions = "sluice_table_compactions_total";
        let (f0, c0) = (
            metric(&client, &first.base, flushes).await,
            metric(&client, &first.base, compactions).await,
        );
        while metric(&client, &first.base, flushes).await < f0 + 2.0
            || (compacting && metric(&client, &first.base, compactions).await < c0 + 1.0)
        {
            assert!(
                Instant::now() < deadline,
                "no flushes and compaction before step {i}: {}",
                first.stats("t").await
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let before: BTreeMap<i64, usize> = acked
            .lock()
            .unwrap()
            .range(..SECOND_IDS)
            .map(|(k, v)| (*k, *v))
            .collect();
        first.statement(change).await;
        step.store(i + 1, Ordering::SeqCst);
        check_step(first, &before, i + 1).await;
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    let acked = acked.lock().unwrap().clone();
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
async fn files_of_every_shape_are_read_by_column_id() {
    let mut node = Node::start_with("evolve-files", None, NO_COMPACTION);
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

/// A column dropped from the middle of a table stays in the files written before (legal
/// Iceberg), and Daft 0.7 misreads the columns after it in such a file ("failed to fill
/// whole buffer"): the maintenance pass writes each such file again without the column,
/// whatever its size and with no compaction due, and every reader reads the table, the
/// rows of the old files (flushed and large) and of the new shape alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_column_dropped_from_the_middle_leaves_every_file() {
    let node = Node::start_with("evolve-middle", None, NO_COMPACTION);
    node.statement("CREATE TABLE t (id int, b string, c int)")
        .await;
    let client = reqwest::Client::new();
    let ingest = |rows: std::ops::Range<i64>, with_b: bool| {
        let body: String = rows
            .map(|id| {
                let row = if with_b {
                    json!({"id": id, "b": format!("b{id}"), "c": id * 10})
                } else {
                    json!({"id": id, "c": id * 10})
                };
                format!("{row}\n")
            })
            .collect();
        let request = client
            .post(format!(
                "{}/v1/catalog/databases/scopedb/schemas/public/tables/t/ingest",
                node.base
            ))
            .header("content-type", "application/x-ndjson")
            .body(body);
        async move {
            let r = request.send().await.unwrap();
            assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        }
    };
    // Two files holding `b`.
    ingest(0..3000, true).await;
    wait_flushed(&node).await;
    ingest(3000..3010, true).await;
    wait_flushed(&node).await;
    let files_before = node.stats("t").await["files"].as_u64().unwrap();
    assert!(files_before >= 2, "{}", node.stats("t").await);
    let compactions = "sluice_table_compactions_total";
    let c0 = metric(&client, &node.base, compactions).await;
    node.statement("ALTER TABLE t DROP COLUMN b").await;
    ingest(3010..3020, false).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(&client, &node.base, compactions).await < c0 + files_before as f64 {
        assert!(
            Instant::now() < deadline,
            "the files holding b were not written again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Each file was written again on its own: no merge (compaction is off). The rows
    // ingested after the drop are one file more once flushed.
    wait_flushed(&node).await;
    assert_eq!(
        node.stats("t").await["files"].as_u64(),
        Some(files_before + 1)
    );
    let want: Vec<Value> = (0..3020)
        .map(|id| json!({"id": id, "c": id * 10}))
        .collect();
    let seen = super::iceberg::read(&node.base, "none", "t", None, "daft,duckdb");
    assert_eq!(seen["rows"], json!(want), "pyiceberg");
    assert_eq!(seen["readers"]["daft"]["rows"], json!(want), "daft");
    assert_eq!(seen["readers"]["duckdb"]["rows"], json!(want), "duckdb");
    let rows = node.rows("SELECT count(*), sum(c) FROM t").await;
    assert_eq!(
        rows,
        [[
            json!("3020"),
            json!((0..3020).map(|i| i * 10).sum::<i64>().to_string())
        ]]
    );
    let _ = std::fs::remove_dir_all(&node.data_dir);
}

/// Refreshes the catalog only every 30 s: what another node sees at once, it sees by looking.
const SLOW_REFRESH: &str = "maintenance_interval_seconds = 30\n";

/// A node that did not make a change checks rows under the newest shape at once: no window
/// where it refuses a field another node's `ALTER` added or renamed, or takes a row under a
/// column's old meaning (names swapped, a name dropped and added again: the value would land
/// in another column, or in the dropped one and out of sight); it refuses what no shape
/// takes. Two nodes on the shared S3 server, the second refreshing its catalog only every
/// 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_node_checks_rows_under_the_newest_shape() {
    let base = std::env::var("SLUICE_TEST_S3_URL").expect(
        "SLUICE_TEST_S3_URL is not set: run the tests with `bash tests/run.sh`, which starts \
         a SeaweedFS S3 server",
    );
    let url = format!("{base}/evolve-newest-{}", std::process::id());
    let first = Node::start_with("evolve-newest-a", Some(&url), SLOW_REFRESH);
    first.statement("CREATE TABLE u (id int)").await;
    let second = Node::start_with("evolve-newest-b", Some(&url), SLOW_REFRESH);
    let client = reqwest::Client::new();
    let ingest = |body: &'static str| {
        client
            .post(format!(
                "{}/v1/catalog/databases/scopedb/schemas/public/tables/u/ingest",
                second.base
            ))
            .header("content-type", "application/x-ndjson")
            .body(body)
            .send()
    };
    assert_eq!(ingest("{\"id\": 1}\n").await.unwrap().status(), 200);
    first.statement("ALTER TABLE u ADD COLUMN z int").await;
    assert_eq!(
        ingest("{\"id\": 2, \"z\": 20}\n").await.unwrap().status(),
        200
    );
    first.statement("ALTER TABLE u RENAME COLUMN z TO w").await;
    assert_eq!(
        ingest("{\"id\": 3, \"w\": 30}\n").await.unwrap().status(),
        200
    );
    // No shape takes these: refused, nothing written.
    for bad in [
        "{\"id\": 4, \"z\": 40}\n",
        "{\"id\": 5, \"w\": \"x\"}\n",
        "{\"id\": 6\n",
    ] {
        let r = ingest(bad).await.unwrap();
        assert_eq!(r.status(), 422, "{bad}: {}", r.text().await.unwrap());
    }
    let rows = second.rows("SELECT id, w FROM u ORDER BY id").await;
    assert_eq!(
        rows,
        [
            [json!("1"), Value::Null],
            [json!("2"), json!("20")],
            [json!("3"), json!("30")]
        ]
    );
    // Rows that fit the second node's old shape too, sent after changes another node made.
    first.statement("ALTER TABLE u ADD COLUMN v int").await;
    assert_eq!(
        ingest("{\"id\": 7, \"v\": 70, \"w\": 71}\n")
            .await
            .unwrap()
            .status(),
        200
    );
    swap_v_and_w(&first).await;
    first.statement("ALTER TABLE u DROP COLUMN id").await;
    first.statement("ALTER TABLE u ADD COLUMN id int").await;
    assert_eq!(
        ingest("{\"id\": 8, \"v\": 80, \"w\": 81}\n")
            .await
            .unwrap()
            .status(),
        200
    );
    let rows = second
        .rows("SELECT id, v, w FROM u WHERE w IS NOT NULL ORDER BY v")
        .await;
    assert_eq!(
        rows,
        [
            [Value::Null, json!("71"), json!("70")],
            [json!("8"), json!("80"), json!("81")]
        ]
    );
    // Statements on the second node follow at once too: DESCRIBE, and INSERT by name and by
    // position, right after another swap.
    swap_v_and_w(&first).await;
    let described: Vec<String> = second
        .rows("DESCRIBE u")
        .await
        .iter()
        .map(|r| r[0].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(described, ["w", "v", "id"]);
    swap_v_and_w(&first).await;
    let inserted = second
        .statement("INSERT INTO u (id, v, w) VALUES (9, 90, 91)")
        .await;
    assert_eq!(inserted["status"], "finished", "{inserted}");
    swap_v_and_w(&first).await;
    let inserted = second
        .statement("INSERT INTO u VALUES (100, 101, 10)")
        .await;
    assert_eq!(inserted["status"], "finished", "{inserted}");
    let rows = second
        .rows("SELECT id, v, w FROM u WHERE id IN (9, 10) ORDER BY id")
        .await;
    // Row 9's values swapped names with the last swap: they were written to the columns
    // then named v and w.
    assert_eq!(
        rows,
        [
            [json!("9"), json!("91"), json!("90")],
            [json!("10"), json!("101"), json!("100")]
        ]
    );
    // A table dropped and created again under its name on the first node: the second
    // node's rows go to the new one.
    first.statement("CREATE TABLE r (a int)").await;
    let into_r = |body: &'static str| {
        client
            .post(format!(
                "{}/v1/catalog/databases/scopedb/schemas/public/tables/r/ingest",
                second.base
            ))
            .header("content-type", "application/x-ndjson")
            .body(body)
            .send()
    };
    assert_eq!(into_r("{\"a\": 1}\n").await.unwrap().status(), 200);
    first.statement("DROP TABLE r").await;
    first.statement("CREATE TABLE r (b string)").await;
    let r = into_r("{\"b\": \"new\"}\n").await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(second.rows("SELECT * FROM r").await, [[json!("new")]]);
}

/// Swaps the names of table `u`'s columns `v` and `w` on `node` (three renames).
async fn swap_v_and_w(node: &Node) {
    for change in [
        "ALTER TABLE u RENAME COLUMN v TO tmp",
        "ALTER TABLE u RENAME COLUMN w TO v",
        "ALTER TABLE u RENAME COLUMN tmp TO w",
    ] {
        node.statement(change).await;
    }
}

/// Concurrent `ALTER`s of one table, each of its own column, all land: a statement that loses
/// the race for a catalog version tries again on the newest (no client gave a precondition, so
/// none answers one failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_alters_of_one_table_all_land() {
    let node = Node::start_with("evolve-concurrent", None, NO_COMPACTION);
    node.statement("CREATE TABLE t (id int)").await;
    let client = reqwest::Client::new();
    let alters = (0..12).map(|i| {
        let (client, base) = (client.clone(), node.base.clone());
        tokio::spawn(async move {
            let sql = format!("ALTER TABLE t ADD COLUMN c{i} int");
            super::common::statement(&client, &base, &sql).await
        })
    });
    for alter in futures::future::join_all(alters).await {
        let body = alter.unwrap();
        assert_eq!(body["status"], "finished", "{body}");
    }
    let described = node.rows("DESCRIBE t").await;
    assert_eq!(described.len(), 13, "{described:?}");
    let _ = std::fs::remove_dir_all(&node.data_dir);
}

/// Sends `sql` to the statements API; its status and body.
async fn run(client: &reqwest::Client, base: &str, sql: &str) -> (u16, Value) {
    let r = client
        .post(format!("{base}/v1/statements"))
        .json(&json!({"statement": sql}))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// `GET {url}`'s JSON answer.
async fn get_json(client: &reqwest::Client, url: &str) -> Value {
    client.get(url).send().await.unwrap().json().await.unwrap()
}

/// `PUT {url}{query}` with `body`: the status and the JSON answer.
async fn put_json(client: &reqwest::Client, url: &str, body: Value, query: &str) -> (u16, Value) {
    let r = client
        .put(format!("{url}{query}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test]
async fn the_catalog_put_and_alter_table_follow_the_same_rules() {
    let node = Node::start("evolve-rules", None);
    let client = reqwest::Client::new();
    let url = format!(
        "{}/v1/catalog/databases/scopedb/schemas/public/tables/r",
        node.base
    );
    let put = |body: Value, query: &'static str| put_json(&client, &url, body, query);
    let col = |name: &str, t: &str| json!({"name": name, "data_type": t});
    let (status, _) = put(
        json!({"name": "r", "columns": [col("a", "int"), col("b", "string")]}),
        "",
    )
    .await;
    assert_eq!(status, 200);
    // Adding is not destructive; a dry run shows the new column's id and writes nothing.
    let added =
        json!({"name": "r", "columns": [col("a", "int"), col("b", "string"), col("c", "array")]});
    let (status, m) = put(added.clone(), "?dry_run=true&with_ids=true").await;
    assert_eq!((status, m["destructive"].clone()), (200, json!(false)));
    assert_eq!(m["after"]["columns"][2]["id"], 3);
    assert_eq!(m["after"]["schema_id"], 1);
    // Unasked, the answer is ScopeDB-shaped: no ids (clients that refuse unknown fields).
    let (status, m) = put(added.clone(), "?dry_run=true").await;
    assert_eq!(status, 200);
    assert_eq!(m["after"]["columns"], added["columns"], "{m}");
    assert!(m["after"].get("schema_id").is_none(), "{m}");
    let stored = get_json(&client, &url).await;
    assert_eq!(
        stored["columns"],
        json!([col("a", "int"), col("b", "string")])
    );
    assert!(stored.get("last_column_id").is_none(), "{stored}");
    assert_eq!(put(added, "").await.0, 200);
    // Dropping needs allow_destructive.
    let dropped = json!({"name": "r", "columns": [col("a", "int"), col("c", "array")]});
    let (status, body) = put(dropped.clone(), "").await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("column scopedb.public.r.b")
    );
    assert_eq!(put(dropped, "?allow_destructive=true").await.0, 200);
    // A rename names the column by id; a name without an id that was dropped is new.
    let (status, m) = put(
        json!({"name": "r", "columns": [
            {"id": 1, "name": "a1", "data_type": "int"}, col("c", "array"), col("b", "int")
        ]}),
        "?with_ids=true",
    )
    .await;
    assert_eq!(
        (status, m["destructive"].clone()),
        (200, json!(false)),
        "{m}"
    );
    let ids: Vec<(String, i64)> = m["after"]["columns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_owned(),
                c["id"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(ids, [("a1".into(), 1), ("c".into(), 3), ("b".into(), 4)]);
    assert_eq!(m["after"]["last_column_id"], 4);
    // A type change (409, as any change the catalog does not make), an unknown id, a bad
    // name, too many columns (400): refused, nothing applied.
    for (body, says) in [
        (
            json!({"name": "r", "columns": [{"id": 1, "name": "a1", "data_type": "string"}]}),
            "changing the type",
        ),
        (
            json!({"name": "r", "columns": [{"id": 9, "name": "z", "data_type": "int"}]}),
            "names id 9",
        ),
        (
            json!({"name": "r", "columns": [col("a1", "int"), col("1x", "int")]}),
            "must start with a letter",
        ),
        (
            json!({"name": "r", "columns": [col("a1", "int"), col("A1", "int")]}),
            "compared without case",
        ),
        (
            json!({"name": "r", "columns": (0..1001).map(|i| col(&format!("c{i}"), "int")).collect::<Vec<_>>()}),
            "at most 1000",
        ),
    ] {
        let (status, answer) = put(body, "?allow_destructive=true").await;
        let want = if says == "changing the type" {
            409
        } else {
            400
        };
        assert_eq!(status, want, "{answer}");
        assert!(
            answer["message"].as_str().unwrap().contains(says),
            "{answer}"
        );
        assert_eq!(answer["details"]["status"], "rejected", "{answer}");
    }
    let with_ids = format!("{url}?with_ids=true");
    let before = get_json(&client, &with_ids).await;
    // The statements, with sluice's type names.
    for (sql, status, says) in [
        (
            "ALTER TABLE r ADD COLUMN tags array COMMENT 'labels'",
            200,
            "altered",
        ),
        (
            "ALTER TABLE r ADD COLUMN IF NOT EXISTS tags int",
            200,
            "exists",
        ),
        ("ALTER TABLE r ADD COLUMN tags int", 400, "already exists"),
        (
            "ALTER TABLE r ADD COLUMN TAGS int",
            400,
            "compared without case",
        ),
        (
            "ALTER TABLE r ADD COLUMN IF NOT EXISTS TAGS int",
            200,
            "column scopedb.public.r.tags exists",
        ),
        (
            "ALTER TABLE r ADD COLUMN `1x` int",
            400,
            "must start with a letter",
        ),
        ("ALTER TABLE r DROP COLUMN nope", 404, "does not exist"),
        (
            "ALTER TABLE r DROP COLUMN IF EXISTS nope",
            200,
            "nothing to drop",
        ),
        (
            "ALTER TABLE r RENAME COLUMN c TO tags",
            400,
            "already exists",
        ),
        ("ALTER TABLE r RENAME COLUMN c TO c2", 200, "altered"),
        (
            "ALTER TABLE r ALTER COLUMN c2 SET COMMENT 'json'",
            200,
            "altered",
        ),
        (
            "ALTER TABLE r ALTER COLUMN tags DROP COMMENT",
            200,
            "altered",
        ),
        ("ALTER TABLE r DROP COLUMN b", 200, "altered"),
        ("ALTER TABLE nope ADD COLUMN x int", 404, "does not exist"),
    ] {
        let (got, body) = run(&client, &node.base, sql).await;
        assert_eq!(got, 200, "{sql}: {body}");
        // A failed statement answers its error in the body.
        let code = match status {
            200 => Value::Null,
            400 => json!("bad_request"),
            _ => json!("not_found"),
        };
        assert_eq!(body["error"]["code"], code, "{sql}: {body}");
        assert!(body.to_string().contains(says), "{sql}: {body}");
    }
    let after = node.rows("DESCRIBE r").await;
    assert_eq!(
        after,
        [
            vec![json!("a1"), json!("int"), Value::Null, Value::Null],
            vec![json!("c2"), json!("array"), json!("json"), Value::Null],
            vec![json!("tags"), json!("array"), Value::Null, Value::Null],
        ]
    );
    let now = get_json(&client, &with_ids).await;
    assert_eq!(now["last_column_id"], 5);
    assert_eq!(now["schema_id"], before["schema_id"].as_i64().unwrap() + 5);
    // A row with the new columns is accepted; one with the dropped column is refused.
    let ingest = |body: &'static str| {
        let client = client.clone();
        let url = format!("{url}/ingest");
        async move {
            client
                .post(url)
                .body(body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(ingest(r#"{"a1": 1, "c2": [1], "tags": ["x"]}"#).await, 200);
    assert_eq!(ingest(r#"{"a1": 2, "b": 3}"#).await, 422);
    let _ = std::fs::remove_dir_all(&node.data_dir);
}

/// Computed columns are added and dropped through the catalog `PUT`: a new one is filled in
/// rows written after it (older rows, flushed or not, read NULL), ingest must still omit it,
/// dropping it needs `allow_destructive`, and one added again under the dropped name starts
/// empty with its new expression.
#[tokio::test]
async fn computed_columns_are_added_and_dropped() {
    let node = Node::start("evolve-computed", None);
    let client = reqwest::Client::new();
    let url = format!(
        "{}/v1/catalog/databases/scopedb/schemas/public/tables/t",
        node.base
    );
    let put = |columns: Value, query: &'static str| {
        put_json(
            &client,
            &url,
            json!({"name": "t", "columns": columns}),
            query,
        )
    };
    let ingest = |body: &'static str| {
        let (client, url) = (client.clone(), format!("{url}/ingest"));
        async move {
            let r = client.post(url).body(body).send().await.unwrap();
            r.status().as_u16()
        }
    };
    let id = json!({"name": "id", "data_type": "int"});
    assert_eq!(put(json!([id]), "").await.0, 200);
    assert_eq!(ingest(r#"{"id": 1}"#).await, 200);
    wait_flushed(&node).await;
    assert_eq!(ingest(r#"{"id": 2}"#).await, 200);
    let twice = json!({"name": "twice", "data_type": "int", "expression": "id * 2"});
    let (status, m) = put(json!([id, twice]), "").await;
    assert_eq!(
        (status, m["destructive"].clone()),
        (200, json!(false)),
        "{m}"
    );
    assert_eq!(ingest(r#"{"id": 3}"#).await, 200);
    assert_eq!(ingest(r#"{"id": 4, "twice": 8}"#).await, 422);
    let s = |v: &str| json!(v);
    assert_eq!(
        node.rows("SELECT id, twice FROM t ORDER BY id").await,
        [
            vec![s("1"), Value::Null],
            vec![s("2"), Value::Null],
            vec![s("3"), s("6")],
        ]
    );
    // Dropping it is destructive.
    let (status, body) = put(json!([id]), "").await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(put(json!([id]), "?allow_destructive=true").await.0, 200);
    assert_eq!(
        node.rows("SELECT * FROM t ORDER BY id").await,
        [vec![s("1")], vec![s("2")], vec![s("3")]]
    );
    // Added again under its name, with another expression: a new column.
    let thrice = json!({"name": "twice", "data_type": "int", "expression": "id * 3"});
    let (status, m) = put(json!([id, thrice]), "?with_ids=true").await;
    assert_eq!(status, 200, "{m}");
    assert_eq!(m["after"]["columns"][1]["id"], 3, "{m}");
    assert_eq!(ingest(r#"{"id": 5}"#).await, 200);
    assert_eq!(
        node.rows("SELECT id, twice FROM t ORDER BY id").await,
        [
            vec![s("1"), Value::Null],
            vec![s("2"), Value::Null],
            vec![s("3"), Value::Null],
            vec![s("5"), s("15")],
        ]
    );
    let _ = std::fs::remove_dir_all(&node.data_dir);
}
