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

use crate::common;

use common::free_port;

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
        Node::start_with_env(data_dir, object_store, &[]).await
    }

    async fn start_with_env(data_dir: &Path, object_store: &str, env: &[(&str, String)]) -> Node {
        Node::start_configured(
            data_dir,
            object_store,
            env,
            "flush_interval_seconds = 0.3\nstream_checkpoint_interval_seconds = 0.5\n",
        )
        .await
    }

    async fn start_configured(
        data_dir: &Path,
        object_store: &str,
        env: &[(&str, String)],
        config_text: &str,
    ) -> Node {
        Node::start_at(free_port(), data_dir, object_store, env, config_text).await
    }

    /// A node on `port` (a restart at the address of a process that is gone).
    async fn start_at(
        port: u16,
        data_dir: &Path,
        object_store: &str,
        env: &[(&str, String)],
        config_text: &str,
    ) -> Node {
        let config = data_dir.with_extension("toml");
        std::fs::write(&config, config_text).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .envs(env.iter().map(|(k, v)| (k, v)))
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
        // Up to a minute: a debug build starting beside other tests on two cores can be slow.
        for _ in 0..1200 {
            if let Ok(r) = client.get(format!("{}/v1/health", node.base)).send().await
                && r.status() == 200
            {
                return node;
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

/// A private SeaweedFS S3 server (the `weed` that `tests/run.sh` installs), on free ports, so a
/// test can stop and restart it without disturbing the shared one.
struct Seaweed {
    child: Option<Child>,
    dir: PathBuf,
    ports: Vec<u16>,
}

impl Seaweed {
    const KEY: &str = "outage-key";
    const SECRET: &str = "outage-secret";
    const BUCKET: &str = "outage-bucket";

    fn start(dir: &Path) -> Seaweed {
        let mut s = Seaweed {
            child: None,
            dir: dir.to_owned(),
            ports: (0..10).map(|_| free_port()).collect(),
        };
        s.restart();
        s
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports[6])
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", Self::KEY.to_owned()),
            ("AWS_SECRET_ACCESS_KEY", Self::SECRET.to_owned()),
            ("AWS_ALLOW_HTTP", "true".to_owned()),
            ("AWS_REGION", "us-east-1".to_owned()),
        ]
    }

    fn restart(&mut self) {
        let weed = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/venv/bin/weed");
        assert!(
            weed.exists(),
            "SeaweedFS is not installed: run the tests with `bash tests/run.sh`"
        );
        let p = &self.ports;
        let child = Command::new(weed)
            .arg("mini")
            .arg(format!("-dir={}", self.dir.display()))
            .args([
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-webdav=false",
                "-admin.ui=false",
                "-master.telemetry=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
            ])
            .arg(format!("-master.port={}", p[0]))
            .arg(format!("-master.port.grpc={}", p[1]))
            .arg(format!("-volume.port={}", p[2]))
            .arg(format!("-volume.port.grpc={}", p[3]))
            .arg(format!("-filer.port={}", p[4]))
            .arg(format!("-filer.port.grpc={}", p[5]))
            .arg(format!("-s3.port={}", p[6]))
            .arg(format!("-s3.port.grpc={}", p[7]))
            .arg(format!("-admin.port={}", p[8]))
            .arg(format!("-admin.port.grpc={}", p[9]))
            .arg(format!("-bucket={}", Self::BUCKET))
            .env("AWS_ACCESS_KEY_ID", Self::KEY)
            .env("AWS_SECRET_ACCESS_KEY", Self::SECRET)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        for _ in 0..240 {
            let code = Command::new("curl")
                .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-I"])
                .args(["--aws-sigv4", "aws:amz:us-east-1:s3", "--user"])
                .arg(format!("{}:{}", Self::KEY, Self::SECRET))
                .arg(format!("{}/{}", self.endpoint(), Self::BUCKET))
                .output()
                .unwrap();
            if code.stdout == b"200" {
                return;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        panic!("private SeaweedFS did not start");
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What a load task saw: acknowledged keys, and keys whose outcome is unknown.
#[derive(Default)]
struct Acks {
    acked: Vec<i64>,
    unknown: Vec<i64>,
}

// Two workers: starting and stopping SeaweedFS blocks one while the load keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_outage_during_load_loses_nothing_acknowledged() {
    let mut s3 = Seaweed::start(&temp_dir("outage-s3"));
    let url = format!("s3://{}/db", Seaweed::BUCKET);
    let node_dir = temp_dir("outage-node");
    let node = Node::start_with_env(&node_dir, &url, &s3.env()).await;
    node.statement("CREATE TABLE t (id int, s string)").await;
    let client = reqwest::Client::new();
    let stream_url = format!("{}/v1/stream/outage", node.base);
    let r = client
        .put(&stream_url)
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Acknowledged writes so far, rows and messages together.
    let progress = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let rows = {
        let base = node.base.clone();
        let stop = stop.clone();
        let progress = progress.clone();
        tokio::spawn(async move {
            let mut acks = Acks::default();
            let mut next = 0i64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let ids = next..next + 20;
                next += 20;
                match ingest(&base, "t", ids.clone()).await.as_u16() {
                    200 => {
                        acks.acked.extend(ids);
                        progress.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    503 | 429 => {}
                    _ => acks.unknown.extend(ids),
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            acks
        })
    };
    let messages = {
        let client = client.clone();
        let stream_url = stream_url.clone();
        let stop = stop.clone();
        let progress = progress.clone();
        tokio::spawn(async move {
            let mut acks = Acks::default();
            let mut n = 0i64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = client
                    .post(&stream_url)
                    .header("content-type", "application/json")
                    .body(format!("{{\"n\":{n}}}"))
                    .send()
                    .await;
                match r.map(|r| r.status().as_u16()) {
                    Ok(204) => {
                        acks.acked.push(n);
                        progress.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Ok(503) => {}
                    _ => acks.unknown.push(n),
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            acks
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    s3.kill();
    // Writes keep committing into the log while the store is away.
    let before = progress.load(std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = progress.load(std::sync::atomic::Ordering::Relaxed) - before;
    assert!(
        during > 20,
        "only {during} writes acknowledged during the outage"
    );
    s3.restart();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rows = rows.await.unwrap();
    let messages = messages.await.unwrap();
    assert!(
        rows.acked.len() > 20 && messages.acked.len() > 20,
        "the load barely ran: {} rows, {} messages",
        rows.acked.len(),
        messages.acked.len()
    );
    // Every acknowledged row is queryable exactly once; nothing else appears.
    let acked = rows.acked.len() as i64;
    node.wait_count("SELECT count(*) FROM t", acked).await;
    node.wait_count("SELECT count(DISTINCT id) FROM t", acked)
        .await;
    // Every acknowledged message is readable once, in order.
    let body: Vec<serde_json::Value> = client
        .get(&stream_url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let read: Vec<i64> = body.iter().map(|m| m["n"].as_i64().unwrap()).collect();
    assert!(messages.unknown.is_empty() || read.len() >= messages.acked.len());
    let acked_messages: Vec<i64> = read
        .iter()
        .copied()
        .filter(|n| !messages.unknown.contains(n))
        .collect();
    assert_eq!(acked_messages, messages.acked);
    // And after a restart, from the bucket and the log.
    node.stop();
    let node = Node::start_with_env(&node_dir, &url, &s3.env()).await;
    node.wait_count("SELECT count(DISTINCT id) FROM t", acked)
        .await;
    node.stop();
}

/// Object-store durability with a 2 s lease.
fn cluster_env() -> Vec<(&'static str, String)> {
    vec![
        ("SLUICE_DURABILITY", "object-store".into()),
        ("SLUICE_NODE_LEASE_SECONDS", "2".into()),
    ]
}

/// Settings that keep a node's writes in its log (no flush, no stream checkpoint for ten
/// minutes): what another node recovers then comes from the log in the object store.
const NO_FLUSH: &str = "flush_interval_seconds = 600\nstream_checkpoint_interval_seconds = 600\n";

/// Appends `body` to stream `name` on `base` as producer `p`, epoch 0, sequence `seq`.
async fn produce(base: &str, name: &str, seq: u64, body: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/v1/stream/{name}"))
        .header("content-type", "text/plain")
        .header("Producer-Id", "p")
        .header("Producer-Epoch", "0")
        .header("Producer-Seq", seq.to_string())
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
}

/// The whole of stream `name` on `base`, and its tail, if it answers: read as clients do,
/// from `Stream-Next-Offset` to the next until an answer says `Stream-Up-To-Date` (a node
/// answers what the owner's snapshot holds itself, and that answer never says it).
///
/// A JSON stream answers each read with an array of its messages, so the arrays of several
/// reads are joined into one: a read from another node's snapshot is not marked up to date
/// (only the owner knows the tail), and the read after it may well be an empty `[]`.
async fn read_stream(base: &str, name: &str) -> Option<(String, String)> {
    let mut data = String::new();
    let mut messages: Option<Vec<Value>> = None;
    let mut offset = "-1".to_owned();
    loop {
        let r = reqwest::Client::new()
            .get(format!("{base}/v1/stream/{name}?offset={offset}"))
            .send()
            .await
            .ok()?;
        if r.status() != 200 {
            return None;
        }
        let header = |h: &str| Some(r.headers().get(h)?.to_str().ok()?.to_owned());
        let next = header("Stream-Next-Offset")?;
        let up_to_date = header("Stream-Up-To-Date").is_some_and(|v| v == "true");
        let json = header("Content-Type").is_some_and(|v| v.starts_with("application/json"));
        let body = r.text().await.ok()?;
        if json {
            let read: Vec<Value> = serde_json::from_str(&body).expect("a JSON read is an array");
            messages.get_or_insert_default().extend(read);
        } else {
            data.push_str(&body);
        }
        if up_to_date {
            if let Some(messages) = messages {
                data = Value::Array(messages).to_string();
            }
            return Some((data, next));
        }
        offset = next;
    }
}

/// Waits until `base` serves stream `name` (a minute at most).
async fn wait_stream(base: &str, name: &str) -> (String, String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(read) = read_stream(base, name).await {
            return read;
        }
        assert!(
            Instant::now() < deadline,
            "{base} never served stream {name}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_dead_nodes_acknowledged_writes_survive_its_disk() {
    let url = s3_url("takeover");
    let env = cluster_env();
    let dir_a = temp_dir("takeover-a");
    let a = Node::start_configured(&dir_a, &url, &env, NO_FLUSH).await;
    let b = Node::start_with_env(&temp_dir("takeover-b"), &url, &env).await;
    a.statement("CREATE TABLE t (id int, s string)").await;
    // Rows and stream appends, all acknowledged by A and still only in its log.
    for k in 0..10 {
        assert_eq!(a.ingest("t", k * 100..(k + 1) * 100).await, 200);
    }
    let r = reqwest::Client::new()
        .put(format!("{}/v1/stream/orders", a.base))
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let mut expected = String::new();
    let mut offsets = Vec::new();
    for seq in 0..50u64 {
        let message = format!("message {seq};");
        let r = produce(&a.base, "orders", seq, &message).await;
        assert!(r.status().is_success(), "append {seq}: {}", r.status());
        offsets.push(
            r.headers()["Stream-Next-Offset"]
                .to_str()
                .unwrap()
                .to_owned(),
        );
        expected.push_str(&message);
    }
    // While A lives, B forwards requests for A's stream to A.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = produce(&b.base, "orders", 50, "message 50;").await;
        if r.status().is_success() {
            offsets.push(
                r.headers()["Stream-Next-Offset"]
                    .to_str()
                    .unwrap()
                    .to_owned(),
            );
            break;
        }
        // Until B sees A's heartbeat: retry, never "not found" (the stream exists).
        assert_eq!(r.status(), 503, "an append through B");
        assert!(Instant::now() < deadline, "B never forwarded to A");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    expected.push_str("message 50;");
    assert_eq!(wait_stream(&b.base, "orders").await.0, expected);
    // A dies with its disk.
    drop(a);
    std::fs::remove_dir_all(&dir_a).unwrap();
    // B takes A's log over: every acknowledged row exactly once...
    b.wait_count("SELECT count(*) FROM t", 1000).await;
    b.wait_count("SELECT count(DISTINCT id) FROM t", 1000).await;
    // ...and every message at its offset, with the producer's state.
    let (data, next) = wait_stream(&b.base, "orders").await;
    assert_eq!(data, expected);
    assert_eq!(&next, offsets.last().unwrap());
    let duplicate = produce(&b.base, "orders", 50, "message 50;").await;
    assert_eq!(
        duplicate.status(),
        204,
        "a retry of the last append is a duplicate"
    );
    let gap = produce(&b.base, "orders", 52, "skipped").await;
    assert_eq!(gap.status(), 409, "a skipped sequence number is refused");
    let next_append = produce(&b.base, "orders", 51, "message 51;").await;
    assert!(
        next_append.status().is_success(),
        "{}",
        next_append.status()
    );
    expected.push_str("message 51;");
    let (data, _) = wait_stream(&b.base, "orders").await;
    assert_eq!(data, expected);
    // The taken-over stream forks like any other.
    let r = reqwest::Client::new()
        .put(format!("{}/v1/stream/orders-copy", b.base))
        .header("content-type", "text/plain")
        .header("Stream-Forked-From", "/v1/stream/orders")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    assert_eq!(wait_stream(&b.base, "orders-copy").await.0, expected);
    // Nothing doubles later (B flushes and checkpoints what it took over).
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(b.count("SELECT count(*) FROM t").await, Some(1000));
    b.stop();
}

#[tokio::test]
async fn a_fenced_node_makes_no_write_visible() {
    let url = s3_url("fenced");
    let env = cluster_env();
    let dir_a = temp_dir("fenced-a");
    let a = Node::start_configured(&dir_a, &url, &env, NO_FLUSH).await;
    let b = Node::start_with_env(&temp_dir("fenced-b"), &url, &env).await;
    a.statement("CREATE TABLE t (id int, s string)").await;
    assert_eq!(a.ingest("t", 0..100).await, 200);
    let r = reqwest::Client::new()
        .put(format!("{}/v1/stream/log", a.base))
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert!(
        produce(&a.base, "log", 0, "kept;")
            .await
            .status()
            .is_success()
    );
    // A is paused past its lease; B takes its log over.
    let pid = a.child.id().to_string();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    let (data, _) = wait_stream(&b.base, "log").await;
    assert_eq!(data, "kept;");
    b.wait_count("SELECT count(*) FROM t", 100).await;
    // A wakes up: it commits nothing more. Appends it is sent fail (or are forwarded to
    // the stream's new owner); exactly those that succeeded are in the stream, in order.
    // Once it learns it was fenced it exits, so that its supervisor restarts it.
    Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    let mut a = a;
    let client = reqwest::Client::new();
    let mut expected = String::from("kept;");
    let mut seq = 1u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(status) = a.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the fenced node never exited");
        let message = format!("after {seq};");
        let appended = client
            .post(format!("{}/v1/stream/log", a.base))
            .header("content-type", "text/plain")
            .header("Producer-Id", "p")
            .header("Producer-Epoch", "0")
            .header("Producer-Seq", seq.to_string())
            .body(message.clone())
            .send()
            .await;
        if appended.is_ok_and(|r| r.status().is_success()) {
            expected.push_str(&message);
            seq += 1;
        }
        let rows = client
            .post(format!(
                "{}/v1/catalog/databases/scopedb/schemas/public/tables/t/ingest",
                a.base
            ))
            .header("content-type", "application/x-ndjson")
            .body("{\"id\": 1000, \"s\": \"late\"}\n")
            .send()
            .await;
        assert!(
            !rows.is_ok_and(|r| r.status().is_success()),
            "a fenced node acknowledged rows"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        !exit.success(),
        "a fenced node exits with a failure: {exit}"
    );
    let (data, _) = wait_stream(&b.base, "log").await;
    assert_eq!(data, expected);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(b.count("SELECT count(*) FROM t").await, Some(100));
    // Restarted with its directory, the fenced node starts afresh under a new id (its
    // directory is only a cache) and applies nothing twice.
    drop(a);
    let a = Node::start_configured(&dir_a, &url, &env, NO_FLUSH).await;
    assert_eq!(a.ingest("t", 200..210).await, 200);
    a.wait_count("SELECT count(*) FROM t", 110).await;
    a.stop();
    b.wait_count("SELECT count(*) FROM t", 110).await;
    assert_eq!(wait_stream(&b.base, "log").await.0, expected);
    b.stop();
}

#[tokio::test]
async fn a_restart_replays_the_log_from_the_object_store() {
    let url = s3_url("replay");
    let env = cluster_env();
    let dir = temp_dir("replay-a");
    let a = Node::start_configured(&dir, &url, &env, NO_FLUSH).await;
    a.statement("CREATE TABLE t (id int, s string)").await;
    for k in 0..5 {
        assert_eq!(a.ingest("t", k * 100..(k + 1) * 100).await, 200);
    }
    // Killed with its rows only in its log; its local log is emptied too: what counts is
    // the copy in the store.
    drop(a);
    for entry in std::fs::read_dir(dir.join("log")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "log") {
            std::fs::write(&path, b"").unwrap();
        }
    }
    let a = Node::start_configured(&dir, &url, &env, NO_FLUSH).await;
    a.wait_count("SELECT count(*) FROM t", 500).await;
    a.wait_count("SELECT count(DISTINCT id) FROM t", 500).await;
    a.stop();
}

/// `PUT` of stream `name` on `base` with content type `content_type`.
async fn create_stream(base: &str, name: &str, content_type: &str) -> reqwest::StatusCode {
    let r = reqwest::Client::new()
        .put(format!("{base}/v1/stream/{name}"))
        .header("content-type", content_type)
        .send()
        .await
        .unwrap();
    if r.status() == 201 {
        // Wherever it was made, the new stream's address is the one the client used.
        assert_eq!(
            r.headers()["location"].to_str().unwrap(),
            format!("{base}/v1/stream/{name}")
        );
    }
    r.status()
}

/// Appends `body` to stream `name` on `base`, with no producer.
async fn append_plain(
    base: &str,
    name: &str,
    content_type: &str,
    body: String,
) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{base}/v1/stream/{name}"))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap()
}

/// The names `GET /v1/streams` on `base` lists.
async fn listed_streams(base: &str) -> Vec<String> {
    let listing: Value = reqwest::get(format!("{base}/v1/streams"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listing.get("incomplete"), None, "{listing}");
    listing["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn one_stream_name_is_one_stream_across_nodes() {
    let url = s3_url("names");
    let env = cluster_env();
    let a = Node::start_with_env(&temp_dir("names-a"), &url, &env).await;
    let b = Node::start_with_env(&temp_dir("names-b"), &url, &env).await;
    // Each node learns the other's URL from its heartbeat: wait until B forwards to A.
    assert_eq!(create_stream(&a.base, "probe", "text/plain").await, 201);
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_stream(&b.base, "probe").await.is_none() {
        assert!(Instant::now() < deadline, "B never forwarded to A");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Both nodes create the same new names at the same moment: one stream each.
    let names: Vec<String> = (0..10).map(|i| format!("race-{i}")).collect();
    for name in &names {
        let (on_a, on_b) = tokio::join!(
            create_stream(&a.base, name, "text/plain"),
            create_stream(&b.base, name, "text/plain")
        );
        let mut statuses = [on_a.as_u16(), on_b.as_u16()];
        statuses.sort();
        assert_eq!(
            statuses,
            [200, 201],
            "{name}: one create, one idempotent repeat"
        );
        for (k, node) in [&a, &b, &a].iter().enumerate() {
            let r = append_plain(&node.base, name, "text/plain", format!("{k};")).await;
            assert!(
                r.status().is_success(),
                "{name}: append {k}: {}",
                r.status()
            );
        }
        assert_eq!(read_stream(&a.base, name).await.unwrap().0, "0;1;2;");
        assert_eq!(read_stream(&b.base, name).await.unwrap().0, "0;1;2;");
    }
    // A create with another configuration conflicts, whichever node it reaches.
    assert_eq!(
        create_stream(&a.base, "race-1", "application/json").await,
        409
    );
    assert_eq!(
        create_stream(&b.base, "race-1", "application/json").await,
        409
    );
    // Either node lists the cluster's streams.
    let mut all = names.clone();
    all.push("probe".into());
    all.sort();
    assert_eq!(listed_streams(&a.base).await, all);
    assert_eq!(listed_streams(&b.base).await, all);
    // A deleted name is free again: deleted through one node, created through the other.
    for name in &names[..3] {
        let r = reqwest::Client::new()
            .delete(format!("{}/v1/stream/{name}", b.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204, "delete {name}");
        assert_eq!(read_stream(&a.base, name).await, None);
        assert_eq!(create_stream(&a.base, name, "application/json").await, 201);
        let r = append_plain(&b.base, name, "application/json", "[1]".into()).await;
        assert!(
            r.status().is_success(),
            "append to re-created {name}: {}",
            r.status()
        );
        assert_eq!(read_stream(&b.base, name).await.unwrap().0, "[1]");
    }
    a.stop();
    b.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_client_writes_through_a_non_owner_across_the_owners_death() {
    let project = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/conformance");
    assert!(
        project
            .join("node_modules/@durable-streams/client")
            .exists(),
        "the Node test packages are not installed: run the tests with `bash tests/run.sh`"
    );
    let url = s3_url("client");
    let env = cluster_env();
    let dir_a = temp_dir("client-a");
    let a = Node::start_configured(&dir_a, &url, &env, NO_FLUSH).await;
    let b = Node::start_with_env(&temp_dir("client-b"), &url, &env).await;
    // A owns the stream; the client only ever talks to B.
    assert_eq!(
        create_stream(&a.base, "relay", "application/json").await,
        201
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_stream(&b.base, "relay").await.is_none() {
        assert!(Instant::now() < deadline, "B never forwarded to A");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let stream_url = format!("{}/v1/stream/relay", b.base);
    let (summary, status, killed) = tokio::task::spawn_blocking(move || {
        use std::io::BufRead as _;
        let mut script = Command::new("node")
            .current_dir(&project)
            .arg("producer-restart.mjs")
            .env("STREAM_URL", stream_url)
            .env("TOTAL", "2000")
            .stdout(Stdio::piped())
            .spawn()
            .expect("node runs");
        let stdout = std::io::BufReader::new(script.stdout.take().unwrap());
        let mut a = Some(a);
        let mut summary = String::new();
        for line in stdout.lines() {
            let line = line.unwrap();
            if line == "HALF" {
                // The owner dies with its disk while appends are in flight through B.
                drop(a.take());
                std::fs::remove_dir_all(&dir_a).unwrap();
            } else if line.starts_with('{') {
                summary = line;
            }
        }
        (summary, script.wait().unwrap(), a.is_none())
    })
    .await
    .unwrap();
    assert!(killed, "the producer never reached half way");
    let summary: Value = serde_json::from_str(&summary).expect("summary line");
    assert_eq!(summary["received"], 2000, "{summary}");
    assert_eq!(summary["inOrder"], true, "{summary}");
    assert_eq!(summary["errors"], 0, "{summary}");
    assert!(status.success());
    b.stop();
}

/// Object-store durability with a lease long enough that nobody takes a node over during a
/// test.
fn long_lease_env() -> Vec<(&'static str, String)> {
    vec![
        ("SLUICE_DURABILITY", "object-store".into()),
        ("SLUICE_NODE_LEASE_SECONDS", "30".into()),
    ]
}

/// One catch-up read of stream `name` on `base` from `offset`: status, body, next offset,
/// and whether the answer says the reader is at the tail.
async fn read_from(base: &str, name: &str, offset: &str) -> (u16, String, String, bool) {
    let r = reqwest::Client::new()
        .get(format!("{base}/v1/stream/{name}?offset={offset}"))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let header = |h: &str| {
        r.headers()
            .get(h)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let next = header("Stream-Next-Offset");
    let up_to_date = header("Stream-Up-To-Date") == "true";
    (status, r.text().await.unwrap(), next, up_to_date)
}

#[tokio::test]
async fn any_node_reads_sealed_stream_data_from_the_object_store() {
    let url = s3_url("sealed");
    let env = long_lease_env();
    let dir_a = temp_dir("sealed-a");
    // The owner seals its streams only when it stops or starts.
    let a = Node::start_configured(&dir_a, &url, &env, NO_FLUSH).await;
    let b = Node::start_with_env(&temp_dir("sealed-b"), &url, &env).await;
    let sealed: String = (0..20).map(|i| format!("k{i};")).collect();
    assert_eq!(create_stream(&a.base, "kept", "text/plain").await, 201);
    for i in 0..20 {
        let r = append_plain(&a.base, "kept", "text/plain", format!("k{i};")).await;
        assert_eq!(r.status(), 204);
    }
    for name in ["gone", "source"] {
        assert_eq!(create_stream(&a.base, name, "text/plain").await, 201);
        let r = append_plain(&a.base, name, "text/plain", "old;".into()).await;
        assert_eq!(r.status(), 204);
    }
    let r = reqwest::Client::new()
        .put(format!("{}/v1/stream/fork", a.base))
        .header("Stream-Forked-From", "/v1/stream/source")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = reqwest::Client::new()
        .put(format!("{}/v1/stream/closed", a.base))
        .header("content-type", "text/plain")
        .header("Stream-Closed", "true")
        .body("last;")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let cut: Vec<String> = (0..8).map(|i| format!("cut-{i}")).collect();
    for name in &cut {
        assert_eq!(create_stream(&a.base, name, "text/plain").await, 201);
        let r = append_plain(&a.base, name, "text/plain", "old;".into()).await;
        assert_eq!(r.status(), 204);
    }
    // A stops (sealing everything into a snapshot) and starts again under its id.
    a.stop();
    let a = Node::start_configured(&dir_a, &url, &env, NO_FLUSH).await;
    let (status, body, tail, up_to_date) = read_from(&a.base, "kept", "-1").await;
    assert_eq!(
        (status, body.as_str(), up_to_date),
        (200, sealed.as_str(), true)
    );
    // B answers from A's snapshot: all of it, but without claiming the tail (only the
    // owner knows it).
    assert_eq!(
        read_from(&b.base, "kept", "-1").await,
        (200, sealed.clone(), tail.clone(), false)
    );
    // A read from the middle of a record starts there, as the owner's does.
    let (status, body, next, _) =
        read_from(&b.base, "kept", "0000000000000000_0000000000000001").await;
    assert_eq!((status, next.as_str()), (200, tail.as_str()), "{body}");
    assert_eq!(body, sealed[1..]);
    // Past the snapshot, the owner answers: new data, and the tail.
    let r = append_plain(&a.base, "kept", "text/plain", "k20;".into()).await;
    assert_eq!(r.status(), 204);
    let (status, body, _, up_to_date) = read_from(&b.base, "kept", &tail).await;
    assert_eq!((status, body.as_str(), up_to_date), (200, "k20;", true));
    // A deleted stream is not read from the snapshot that still holds it, nor is the old
    // incarnation of a name made again, nor a stream deleted while a fork still reads it.
    for name in ["gone", "source"] {
        let r = reqwest::Client::new()
            .delete(format!("{}/v1/stream/{name}", a.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204, "delete {name}");
        let on_a = read_from(&a.base, name, "-1").await.0;
        assert!(on_a >= 400, "{name} on A: {on_a}");
        assert_eq!(read_from(&b.base, name, "-1").await.0, on_a, "{name} on B");
    }
    assert_eq!(create_stream(&a.base, "gone", "text/plain").await, 201);
    let r = append_plain(&a.base, "gone", "text/plain", "new;".into()).await;
    assert_eq!(r.status(), 204);
    let (status, body, _, up_to_date) = read_from(&b.base, "gone", "-1").await;
    assert_eq!((status, body.as_str(), up_to_date), (200, "new;", true));
    // The fork's own view of its source's sealed data is the fork's to serve.
    let (status, body, _, _) = read_from(&b.base, "fork", "-1").await;
    assert_eq!((status, body.as_str()), (200, "old;"));
    // Deletes whose clients give up at once, at several moments: whatever A answers for
    // the stream afterwards, B answers too (a delete cut short is retried, as clients do).
    let client = reqwest::Client::new();
    for (i, name) in cut.iter().enumerate() {
        let _ = client
            .delete(format!("{}/v1/stream/{name}", a.base))
            .timeout(Duration::from_millis(1 + 3 * i as u64))
            .send()
            .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        if read_from(&a.base, name, "-1").await.0 == 200 {
            let r = client
                .delete(format!("{}/v1/stream/{name}", a.base))
                .send()
                .await
                .unwrap();
            assert!(
                [204, 404].contains(&r.status().as_u16()),
                "{name}: {}",
                r.status()
            );
        }
        assert_eq!(read_from(&a.base, name, "-1").await.0, 404, "{name} on A");
        assert_eq!(read_from(&b.base, name, "-1").await.0, 404, "{name} on B");
    }
    // A dies (no takeover within its lease): B still serves the sealed data from the
    // object store, the end of a closed stream included, and says "retry" for what only
    // A's log holds.
    drop(a);
    let (status, body, end, up_to_date) = read_from(&b.base, "closed", "-1").await;
    assert_eq!((status, body.as_str(), up_to_date), (200, "last;", true));
    let r = client
        .get(format!("{}/v1/stream/closed?offset={end}", b.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["Stream-Closed"], "true");
    assert_eq!(r.headers()["Stream-Up-To-Date"], "true");
    assert_eq!(r.headers()["Stream-Next-Offset"].to_str().unwrap(), end);
    assert_eq!(r.text().await.unwrap(), "");
    assert_eq!(
        read_from(&b.base, "kept", "-1").await,
        (200, sealed.clone(), tail.clone(), false)
    );
    let r = reqwest::Client::new()
        .get(format!("{}/v1/stream/kept?offset={tail}", b.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    b.stop();
}

#[tokio::test]
async fn sealed_reads_follow_a_snapshot_rewritten_in_place() {
    let url = s3_url("rewritten");
    let env = long_lease_env();
    // The owner checkpoints, collects and copies live data out of mostly dead objects
    // within about a second.
    let quick = "flush_interval_seconds = 600\nstream_checkpoint_interval_seconds = 0.5\n\
                 gc_grace_seconds = 1\nmaintenance_interval_seconds = 0.3\n";
    let a = Node::start_configured(&temp_dir("rewritten-a"), &url, &env, quick).await;
    let b = Node::start_with_env(&temp_dir("rewritten-b"), &url, &env).await;
    let small: Vec<String> = (0..5).map(|i| format!("small-{i}")).collect();
    let large: Vec<String> = (0..3).map(|i| format!("large-{i}")).collect();
    for name in small.iter().chain(&large) {
        assert_eq!(create_stream(&a.base, name, "text/plain").await, 201);
    }
    for name in &small {
        let r = append_plain(&a.base, name, "text/plain", format!("{name};")).await;
        assert_eq!(r.status(), 204);
    }
    for name in &large {
        let r = append_plain(&a.base, name, "text/plain", "x".repeat(200_000)).await;
        assert_eq!(r.status(), 204);
    }
    // Once A's snapshot holds the streams, B answers from it.
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_from(&b.base, &small[0], "-1").await.3 {
        assert!(Instant::now() < deadline, "A never sealed its streams");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The large streams go: A's next snapshot drops them, its collection marks their
    // object mostly dead, and the checkpoint after copies the small streams' data out of it
    // and writes the snapshot of the same position again; the old object is then deleted.
    // B keeps reading meanwhile, so it holds a view of every snapshot as it comes.
    for name in &large {
        let r = reqwest::Client::new()
            .delete(format!("{}/v1/stream/{name}", a.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204);
    }
    let until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < until {
        assert_eq!(read_from(&b.base, &small[0], "-1").await.0, 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // With A dead, B serves the other small streams from the rewritten snapshot's objects.
    drop(a);
    for name in &small[1..] {
        let (status, body, _, _) = read_from(&b.base, name, "-1").await;
        assert_eq!((status, body), (200, format!("{name};")), "{name}");
    }
    b.stop();
}

/// Subscriptions survive their node's death: a burst lands on A while every delivery fails,
/// A is killed, and B (which takes A over) delivers a wake for every watched stream that
/// received data. After the takeover, appends to A's streams through B wake A's
/// subscriptions and B's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn subscriptions_wake_for_every_stream_across_a_takeover() {
    use crate::subscriptions::{Answer, Burst, Receiver, run_all};
    let url = s3_url("subscription-takeover");
    // A longer lease than the other cluster tests: the burst keeps the store busy, and A
    // must renew its lease through it until it is killed.
    let env = vec![
        ("SLUICE_DURABILITY", "object-store".to_owned()),
        ("SLUICE_NODE_LEASE_SECONDS", "6".to_owned()),
    ];
    let config = |extra: &str| {
        format!(
            "{extra}webhook_allowed_networks = [\"127.0.0.0/8\"]\nmax_subscriptions = 5000\n\
             max_pending_stream_changes = 64\n"
        )
    };
    let receiver = Receiver::start(Answer::Fail).await;
    let dir_a = temp_dir("subscription-takeover-a");
    let a = Node::start_configured(&dir_a, &url, &env, &config(NO_FLUSH)).await;
    let b = Node::start_configured(
        &temp_dir("subscription-takeover-b"),
        &url,
        &env,
        &config("flush_interval_seconds = 0.3\nstream_checkpoint_interval_seconds = 0.5\n"),
    )
    .await;
    // 1,000 streams in 50 groups, 1,000 pattern subscriptions and 50 listing ones on A.
    let burst = Burst::new(50, 20, 1000, 50);
    burst.subscribe(&a.base, &receiver.url).await;
    // B's own subscription watches one of A's groups: it sees those streams once B serves
    // them.
    let r = reqwest::Client::new()
        .put(format!("{}/v1/stream/__ds/subscriptions/on-b", b.base))
        .json(
            &json!({"type": "webhook", "pattern": "burst/g0/*", "webhook": {"url": receiver.url}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    burst.append(&a.base, 0).await;
    burst.append(&a.base, 1).await;
    // A dies with every wake undelivered.
    drop(a);
    std::fs::remove_dir_all(&dir_a).unwrap();
    receiver.answer(Answer::Done);
    let started = Instant::now();
    receiver
        .wait_for(&burst.expected(), Duration::from_secs(300))
        .await;
    println!("takeover: every wake by {:?}", started.elapsed());
    // A's subscriptions are served by B now.
    let r = reqwest::Client::new()
        .get(format!("{}/v1/stream/__ds/subscriptions/sub-0", b.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Appends through B to A's streams wake A's subscriptions and B's own.
    let group: Vec<String> = (0..20).map(|s| format!("burst/g0/s{s}")).collect();
    let client = reqwest::Client::new();
    let answers = run_all(
        group
            .iter()
            .map(|name| {
                client
                    .post(format!("{}/v1/stream/{name}", b.base))
                    .header("content-type", "text/plain")
                    .body("after the takeover;")
            })
            .collect(),
        16,
    )
    .await;
    let mut expected = std::collections::BTreeMap::new();
    for answer in answers {
        let (name, tail) = crate::subscriptions::answered_tail(&answer);
        for (sub, watched) in &burst.watches {
            if watched.contains(&name) {
                expected.insert((sub.clone(), name.clone()), tail);
            }
        }
        expected.insert(("on-b".to_owned(), name), tail);
    }
    receiver.wait_for(&expected, Duration::from_secs(60)).await;
    b.stop();
}

/// A request a peer forwards to an address where the stream's owner no longer answers (here:
/// the owner was killed and a new process with an empty data directory, so a new node id,
/// started at the same address before anyone took the old id over) is refused as "retry"
/// (503, `Retry-After`, nothing applied), never answered "not found" for a stream that
/// exists; once the old id is taken over, the stream answers again with everything.
#[tokio::test]
async fn a_request_forwarded_to_a_restarted_owners_address_answers_retry_not_not_found() {
    let url = s3_url("forward-moved");
    // A lease long enough that B still remembers A's address, and nobody has taken A's id
    // over yet, when the new process answers there.
    let env = vec![
        ("SLUICE_DURABILITY", "object-store".to_owned()),
        ("SLUICE_NODE_LEASE_SECONDS", "10".to_owned()),
    ];
    let dir_a = temp_dir("forward-moved-a");
    let port_a = free_port();
    let a = Node::start_at(port_a, &dir_a, &url, &env, NO_FLUSH).await;
    let b = Node::start_with_env(&temp_dir("forward-moved-b"), &url, &env).await;
    assert_eq!(
        create_stream(&a.base, "moving", "text/plain").await,
        reqwest::StatusCode::CREATED
    );
    // B learns that A serves it (and remembers it for a lease).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut expected = String::new();
    loop {
        let r = append_plain(&b.base, "moving", "text/plain", "m0;".into()).await;
        if r.status() == 204 {
            expected.push_str("m0;");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "B never forwarded to A: {}",
            r.status()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A dies; a new process with an empty directory takes its address.
    drop(a);
    std::fs::remove_dir_all(&dir_a).unwrap();
    let a2 = Node::start_at(port_a, &temp_dir("forward-moved-a2"), &url, &env, NO_FLUSH).await;
    let mut retries = 0;
    let mut n = 1;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline && n < 4 {
        let body = format!("m{n};");
        let r = append_plain(&b.base, "moving", "text/plain", body.clone()).await;
        match r.status().as_u16() {
            204 => {
                expected.push_str(&body);
                n += 1;
            }
            503 => {
                assert!(r.headers().contains_key("retry-after"));
                let answer: Value = r.json().await.unwrap();
                assert_eq!(answer["details"]["status"], "rejected", "{answer}");
                retries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            status => panic!(
                "an append to a stream that exists answered {status}: {}",
                r.text().await.unwrap()
            ),
        }
    }
    assert_eq!(n, 4, "the stream never answered again after its owner died");
    println!("{retries} appends were answered \"retry\" while the stream moved");
    assert_eq!(wait_stream(&b.base, "moving").await.0, expected);
    assert_eq!(wait_stream(&a2.base, "moving").await.0, expected);
    drop(a2);
    b.stop();
}

/// A table created through one node is there at once for a query through another (which
/// reads the catalog again when a statement names a table it does not know), not only after
/// its next catalog refresh.
#[tokio::test]
async fn a_table_created_on_one_node_is_queryable_on_another_at_once() {
    let url = s3_url("create-then-query");
    // Catalog refreshes far apart: only the statement's own look can find the table.
    let config = "flush_interval_seconds = 0.3\nmaintenance_interval_seconds = 60\n";
    let a = Node::start_configured(&temp_dir("cq-a"), &url, &[], config).await;
    let b = Node::start_configured(&temp_dir("cq-b"), &url, &[], config).await;
    for i in 0..3 {
        a.statement(&format!("CREATE TABLE fresh{i} (id int)"))
            .await;
        let r = b.statement(&format!("SELECT count(*) FROM fresh{i}")).await;
        assert_eq!(r["status"], "finished", "{r}");
        let r = b
            .statement(&format!(
                "INSERT INTO scopedb.public.fresh{i} VALUES (1), (2)"
            ))
            .await;
        assert_eq!(r["status"], "finished", "{r}");
        assert_eq!(
            b.count(&format!("SELECT count(*) FROM fresh{i}")).await,
            Some(2)
        );
    }
    a.stop();
    b.stop();
}
