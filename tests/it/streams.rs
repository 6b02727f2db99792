//! Durable streams: the protocol's conformance suite and the real client against the real
//! binary, and what the suite does not cover (incarnations, byte-exact JSON text, the nesting
//! limit, producer state across restarts, cold reads after log truncation).

use crate::common;

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use sluice::db::{Database, DbConfig};
use sluice::storage::Storage;
use sluice::storage::probe::{Probe, ProbedStore};
use sluice::stream::{
    AppendOutcome, AppendRequest, CreateRequest, ForkRequest, Lifetime, ProducerTuple, StreamError,
};

fn node_project() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/conformance");
    assert!(
        dir.join("node_modules/@durable-streams/client").exists(),
        "the Node test packages are not installed: run the tests with `bash tests/run.sh`, \
         which installs them into tests/conformance/node_modules"
    );
    dir
}

fn spawn_server(dir: &std::path::Path, port: u16) -> Child {
    common::sluice_serve(dir, port)
        .args(["--long-poll-timeout-ms", "2000"])
        // The suite's webhook receivers listen on loopback, which webhooks may not reach
        // unless it is allowed.
        .args(["--webhook-allowed-network", "127.0.0.0/8"])
        .spawn()
        .unwrap()
}

#[test]
fn durable_streams_conformance_suite_passes() {
    let project = node_project();
    let dir = common::temp_dir("conformance");
    let port = common::free_port();
    let mut server = spawn_server(&dir, port);
    common::wait_healthy(port);
    let report = dir.join("vitest-report.json");
    let status = Command::new("node")
        .current_dir(&project)
        .args([
            "node_modules/vitest/vitest.mjs",
            "run",
            "--reporter=dot",
            "--reporter=json",
        ])
        .arg(format!("--outputFile.json={}", report.display()))
        .env("CONFORMANCE_TEST_URL", format!("http://127.0.0.1:{port}"))
        .env("LONG_POLL_TIMEOUT_MS", "2000")
        .env("SUBSCRIPTIONS", "1")
        .status()
        .expect("node runs");
    let _ = server.kill();
    let _ = server.wait();
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&report).expect("vitest wrote its report")).unwrap();
    let failed: Vec<String> = report["testResults"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|file| {
            file["assertionResults"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|t| t["status"] == "failed")
        .map(|t| t["fullName"].as_str().unwrap_or("").to_owned())
        .collect();
    assert!(failed.is_empty(), "failed conformance tests: {failed:#?}");
    assert!(status.success(), "vitest exited with {status}");
    // All of it, the opt-in subscription tests included.
    assert_eq!(
        report["numPassedTests"], 338,
        "{}",
        report["numPassedTests"]
    );
    assert_eq!(report["numFailedTests"], 0);
}

#[test]
fn real_client_delivers_exactly_once_across_a_server_kill() {
    let project = node_project();
    let dir = common::temp_dir("client-restart");
    let port = common::free_port();
    let mut server = spawn_server(&dir, port);
    common::wait_healthy(port);
    let mut script = Command::new("node")
        .current_dir(&project)
        .arg("producer-restart.mjs")
        .env(
            "STREAM_URL",
            format!("http://127.0.0.1:{port}/v1/stream/restart-test"),
        )
        .env("TOTAL", "3000")
        .stdout(Stdio::piped())
        .spawn()
        .expect("node runs");
    let stdout = BufReader::new(script.stdout.take().unwrap());
    let mut summary = String::new();
    let mut restarted = false;
    for line in stdout.lines() {
        let line = line.unwrap();
        if line == "HALF" && !restarted {
            // SIGKILL: no flush, no goodbye; requests are in flight.
            server.kill().unwrap();
            server.wait().unwrap();
            server = spawn_server(&dir, port);
            restarted = true;
        } else if line.starts_with('{') {
            summary = line;
        }
    }
    let status = script.wait().unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(restarted, "the producer never reached half way");
    let summary: serde_json::Value = serde_json::from_str(&summary).expect("summary line");
    assert_eq!(summary["received"], 3000, "{summary}");
    assert_eq!(summary["inOrder"], true, "{summary}");
    assert_eq!(summary["errors"], 0, "{summary}");
    assert!(status.success());
}

async fn open(dir: &std::path::Path) -> Arc<Database> {
    let mut config = DbConfig::new(dir);
    // Small segments, so checkpoints can release (delete) them.
    config.log_segment_bytes = 64 << 10;
    config.streams.checkpoint_interval = Duration::from_secs(3600);
    Database::open(config).await.unwrap()
}

fn create(name: &str, content_type: &str) -> CreateRequest {
    CreateRequest {
        name: name.into(),
        content_type: Some(content_type.into()),
        lifetime: Lifetime::default(),
        closed: false,
        fork: None,
        body: Bytes::new(),
        incarnation: None,
        key: None,
    }
}

fn append(name: &str, body: &[u8]) -> AppendRequest {
    AppendRequest {
        name: name.into(),
        content_type: Some("text/plain".into()),
        body: Bytes::copy_from_slice(body),
        close: false,
        producer: None,
        stream_seq: None,
        incarnation: None,
        key: None,
    }
}

fn produced(name: &str, body: &[u8], epoch: u64, seq: u64) -> AppendRequest {
    AppendRequest {
        producer: Some(ProducerTuple {
            id: "p".into(),
            epoch,
            seq,
        }),
        ..append(name, body)
    }
}

async fn read_all(db: &Database, name: &str) -> Vec<u8> {
    let streams = db.streams();
    let stream = streams.get(name).await.unwrap();
    let mut out = Vec::new();
    let mut from = 0;
    loop {
        let r = streams.read(&stream, from, 1 << 20).await.unwrap();
        for record in &r.records {
            out.extend_from_slice(record);
        }
        from = r.next;
        if r.up_to_date {
            return out;
        }
    }
}

#[tokio::test]
async fn producer_state_and_stream_settings_survive_restarts() {
    let dir = common::temp_dir("stream-restart");
    for checkpoint in [false, true] {
        let _ = std::fs::remove_dir_all(&dir);
        {
            let db = open(&dir).await;
            let s = db.streams();
            let mut req = create("s", "text/plain");
            req.lifetime.ttl_secs = Some(3600);
            s.create(req).await.unwrap();
            for seq in 0..3 {
                let mut r = produced("s", format!("m{seq}").as_bytes(), 1, seq);
                r.stream_seq = Some(format!("00{seq}"));
                s.append(r).await.unwrap();
            }
            let mut close = append("s", b"");
            close.close = true;
            s.append(close).await.unwrap();
            if checkpoint {
                assert!(s.checkpoint(true).await.unwrap());
                assert_eq!(s.hot_bytes(), 0);
            }
            // No clean shutdown: whatever is not in a snapshot comes back from the log.
            db.log().close();
        }
        let db = open(&dir).await;
        let s = db.streams();
        assert_eq!(
            read_all(&db, "s").await,
            b"m0m1m2",
            "checkpoint={checkpoint}"
        );
        let info = s.get("s").await.unwrap().info();
        assert!(info.closed);
        assert_eq!(info.lifetime.ttl_secs, Some(3600));
        assert_eq!(info.tail, 6);
        // The retry of the last append is recognized, with its original offset.
        match s.append(produced("s", b"m2", 1, 2)).await.unwrap() {
            AppendOutcome::Duplicate { next, last_seq, .. } => {
                assert_eq!((next, last_seq), (Some(6), 2));
            }
            other => panic!("expected a duplicate, got {other:?}"),
        }
        assert!(matches!(
            s.append(produced("s", b"x", 1, 3)).await,
            Err(StreamError::Closed { .. })
        ));
        db.shutdown().await.unwrap();
    }
    // Producer fencing survives a restart too (on an open stream).
    let _ = std::fs::remove_dir_all(&dir);
    {
        let db = open(&dir).await;
        db.streams()
            .create(create("f", "text/plain"))
            .await
            .unwrap();
        db.streams()
            .append(produced("f", b"a", 3, 0))
            .await
            .unwrap();
        let mut seq = append("f", b"b");
        seq.stream_seq = Some("m".into());
        db.streams().append(seq).await.unwrap();
        db.log().close();
    }
    let db = open(&dir).await;
    let s = db.streams();
    assert!(matches!(
        s.append(produced("f", b"z", 2, 0)).await,
        Err(StreamError::StaleEpoch { current: 3 })
    ));
    assert!(matches!(
        s.append(produced("f", b"z", 3, 2)).await,
        Err(StreamError::SequenceGap {
            expected: 1,
            received: 2,
            ..
        })
    ));
    let mut stale = append("f", b"c");
    stale.stream_seq = Some("a".into());
    assert!(matches!(
        s.append(stale).await,
        Err(StreamError::StreamSeqConflict { .. })
    ));
    db.shutdown().await.unwrap();
}

#[tokio::test]
async fn cold_reads_after_the_log_is_truncated() {
    let dir = common::temp_dir("stream-cold");
    let mut expected = Vec::new();
    {
        let db = open(&dir).await;
        let s = db.streams();
        s.create(create("c", "text/plain")).await.unwrap();
        for i in 0..1200 {
            let body = format!("{i:05}:{}|", "y".repeat(i % 700));
            expected.extend_from_slice(body.as_bytes());
            s.append(append("c", body.as_bytes())).await.unwrap();
            if i == 600 {
                // Half the data sealed, half still hot.
                s.checkpoint(true).await.unwrap();
            }
        }
        let before = db.log().disk_bytes();
        assert!(s.checkpoint(true).await.unwrap());
        assert_eq!(s.hot_bytes(), 0);
        // What a maintenance pass does for tables: they hold nothing, so they release all.
        db.tables().flush_due(false).await.unwrap();
        // Tables hold no log records, so the sealed segments are deleted.
        assert!(
            db.log().disk_bytes() < before / 4,
            "log kept {} of {before} bytes",
            db.log().disk_bytes()
        );
        assert_eq!(read_all(&db, "c").await, expected);
        // A fork at a sub-offset inside sealed data.
        let mut fork = create("c-fork", "text/plain");
        fork.fork = Some(ForkRequest {
            source: "c".into(),
            // After the second record ("00000:|", "00001:y|"), plus 3 bytes of the third.
            offset: Some(15),
            sub_offset: Some(3),
        });
        s.create(fork).await.unwrap();
        db.shutdown().await.unwrap();
    }
    let db = open(&dir).await;
    assert_eq!(read_all(&db, "c").await, expected);
    assert_eq!(read_all(&db, "c-fork").await, expected[..18].to_vec());
    // Reads from an offset inside the sealed range start there.
    let s = db.streams();
    let stream = s.get("c").await.unwrap();
    let r = s.read(&stream, 7, 1 << 20).await.unwrap();
    assert_eq!(&r.records[0][..], &expected[7..15]);
    db.shutdown().await.unwrap();
}

#[tokio::test]
async fn checkpoints_wait_out_an_object_store_outage() {
    let dir = common::temp_dir("stream-outage");
    let faults = Arc::new(Probe::default());
    let store = Arc::new(object_store::memory::InMemory::new());
    let storage = || {
        Storage::from_store(
            Arc::new(ProbedStore::new(store.clone(), faults.clone())),
            "faulty://",
        )
    };
    let config = || {
        let mut c = DbConfig::new(&dir);
        c.log_segment_bytes = 64 << 10;
        c
    };
    let mut expected = Vec::new();
    {
        let db = Database::open_with_storage(config(), storage())
            .await
            .unwrap();
        let s = db.streams();
        s.create(create("o", "text/plain")).await.unwrap();
        faults.set_down(true);
        // Appends go on into the log; the checkpoint fails and keeps everything in memory.
        for i in 0..300 {
            let body = format!("{i:04}{}", "z".repeat(200));
            expected.extend_from_slice(body.as_bytes());
            s.append(append("o", body.as_bytes())).await.unwrap();
        }
        assert!(matches!(
            s.checkpoint(true).await,
            Err(StreamError::Storage(_))
        ));
        // The failures show in the object-store error count (sluice_object_store_errors_total).
        assert!(db.storage_errors() > 0);
        assert_eq!(s.hot_bytes(), expected.len() as u64);
        assert_eq!(read_all(&db, "o").await, expected);
        faults.set_down(false);
        assert!(s.checkpoint(true).await.unwrap());
        assert_eq!(s.hot_bytes(), 0);
        assert_eq!(read_all(&db, "o").await, expected);
        db.log().close();
    }
    let db = Database::open_with_storage(config(), storage())
        .await
        .unwrap();
    assert_eq!(read_all(&db, "o").await, expected);
    db.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_full_log_refuses_appends_until_a_checkpoint_frees_it() {
    let dir = common::temp_dir("stream-full");
    let faults = Arc::new(Probe::default());
    let store = Arc::new(object_store::memory::InMemory::new());
    let mut config = DbConfig::new(&dir);
    config.log_segment_bytes = 16 << 10;
    config.max_log_bytes = 64 << 10;
    let storage = Storage::from_store(Arc::new(ProbedStore::new(store, faults.clone())), "f://");
    let db = Database::open_with_storage(config, storage).await.unwrap();
    let s = db.streams();
    s.create(create("full", "text/plain")).await.unwrap();
    faults.set_down(true);
    let body = vec![b'q'; 1000];
    let mut accepted = 0u64;
    let refusal = loop {
        match s.append(append("full", &body)).await {
            Ok(_) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 1000, "the log budget never applied");
    };
    assert!(matches!(
        refusal,
        StreamError::Log(sluice::log::LogError::Full { .. })
    ));
    // Nothing of the refused append was applied.
    let tail = s.get("full").await.unwrap().info().tail;
    assert_eq!(tail, accepted * 1000);
    // The store is back: a checkpoint seals the data and frees the log; appends resume.
    faults.set_down(false);
    assert!(s.checkpoint(true).await.unwrap());
    db.tables().flush_due(false).await.unwrap();
    s.append(append("full", &body)).await.unwrap();
    assert_eq!(
        read_all(&db, "full").await.len() as u64,
        (accepted + 1) * 1000
    );
    db.shutdown().await.unwrap();
}

async fn http_server() -> (String, reqwest::Client) {
    let dir = common::temp_dir("stream-http");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let (addr, _task) = common::serve(db, vec![]).await;
    (format!("http://{addr}"), reqwest::Client::new())
}

/// A listing is in name order and bounded; one that stopped goes on from its last name.
#[tokio::test]
async fn listings_go_on_after_the_last_name_listed() {
    let (base, client) = http_server().await;
    for name in ["l/c", "l/a", "other", "l/b"] {
        let r = client
            .put(format!("{base}/v1/stream/{name}"))
            .header("content-type", "text/plain")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "{name}");
    }
    let r = client
        .post(format!("{base}/v1/stream/l/a"))
        .header("content-type", "text/plain")
        .header("producer-id", "p1")
        .header("producer-epoch", "0")
        .header("producer-seq", "0")
        .body("x")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let list = |query: &'static str| {
        let client = client.clone();
        let url = format!("{base}/v1/streams?{query}");
        async move {
            let listing: serde_json::Value =
                client.get(url).send().await.unwrap().json().await.unwrap();
            let names: Vec<String> = listing["streams"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["name"].as_str().unwrap().to_owned())
                .collect();
            (names, listing)
        }
    };
    let (names, listing) = list("prefix=l/&limit=2").await;
    assert_eq!(names, ["l/a", "l/b"]);
    assert_eq!(listing["truncated"], true);
    assert_eq!(listing["streams"][0]["producers"][0]["id"], "p1");
    let (names, listing) = list("prefix=l/&limit=2&after=l/b").await;
    assert_eq!(names, ["l/c"]);
    assert_eq!(listing["truncated"], false);
    let (names, _) = list("after=l/c").await;
    assert_eq!(names, ["other"]);
    let (names, _) = list("after=zzz").await;
    assert!(names.is_empty());
}

#[tokio::test]
async fn incarnation_preconditions() {
    let (base, client) = http_server().await;
    let url = format!("{base}/demo/incarnations");
    let r = client
        .put(&url)
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let first = r.headers()["stream-incarnation"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(client.delete(&url).send().await.unwrap().status(), 204);
    let r = client
        .put(&url)
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    let second = r.headers()["stream-incarnation"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_ne!(first, second);
    // The old token: 412, the current token in the answer, nothing appended.
    let r = client
        .post(&url)
        .header("content-type", "text/plain")
        .header("stream-incarnation", &first)
        .body("stale")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 412);
    assert_eq!(r.headers()["stream-incarnation"], second.as_str());
    let r = client
        .post(&url)
        .header("content-type", "text/plain")
        .header("stream-incarnation", "not-a-token")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = client
        .post(&url)
        .header("content-type", "text/plain")
        .header("stream-incarnation", &second)
        .body("fresh")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    assert_eq!(r.headers()["stream-incarnation"], second.as_str());
    // A delete with the old token changes nothing.
    let r = client
        .delete(&url)
        .header("stream-incarnation", &first)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 412);
    let body = client.get(&url).send().await.unwrap().text().await.unwrap();
    assert_eq!(body, "fresh");
    // Both layouts address the same stream.
    let body = client
        .get(format!("{base}/v1/stream/demo/incarnations"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(body, "fresh");
}

#[tokio::test]
async fn json_messages_are_kept_byte_for_byte() {
    let (base, client) = http_server().await;
    let url = format!("{base}/v1/stream/json-text");
    client
        .put(&url)
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    let body =
        "[ {\"b\" : 1.50e3, \"a\": \"\\ud800 \\u00e9\", \"b\" : 1e400},\n\t-0.0 , \"x\\/y\" ]";
    let r = client
        .post(&url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let text = client.get(&url).send().await.unwrap().text().await.unwrap();
    assert_eq!(
        text,
        r#"[{"b":1.50e3,"a":"\ud800 \u00e9","b":1e400},-0.0,"x\/y"]"#
    );
    let ndjson = client
        .get(&url)
        .header("accept", "application/x-ndjson")
        .send()
        .await
        .unwrap();
    assert_eq!(ndjson.headers()["content-type"], "application/x-ndjson");
    assert_eq!(
        ndjson.text().await.unwrap(),
        "{\"b\":1.50e3,\"a\":\"\\ud800 \\u00e9\",\"b\":1e400}\n-0.0\n\"x\\/y\"\n"
    );
}

#[tokio::test]
async fn json_nesting_is_limited_to_127_levels() {
    let (base, client) = http_server().await;
    let url = format!("{base}/v1/stream/deep");
    client
        .put(&url)
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    let nested = |n: usize| format!("{}0{}", "{\"k\":".repeat(n), "}".repeat(n));
    let post = |body: String| {
        client
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    assert_eq!(post(nested(127)).await.unwrap().status(), 204);
    let r = post(nested(128)).await.unwrap();
    assert_eq!(r.status(), 400);
    let error: serde_json::Value = r.json().await.unwrap();
    assert_eq!(error["details"]["status"], "rejected");
    // In a batch, the outer array is not a level of its messages.
    assert_eq!(
        post(format!("[{}]", nested(127))).await.unwrap().status(),
        204
    );
    assert_eq!(
        post(format!("[{}]", nested(128))).await.unwrap().status(),
        400
    );
    // Nothing of the refused bodies was appended.
    let head = client.head(&url).send().await.unwrap();
    let tail = head.headers()["stream-next-offset"]
        .to_str()
        .unwrap()
        .to_owned();
    let len = 2 * (nested(127).len() + 1) as u64;
    assert_eq!(tail, sluice::http::format_offset(len));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_whose_caller_gave_up_is_not_doubled_by_its_retry() {
    let dir = common::temp_dir("stream-abandoned-append");
    let (db, slow) = slow_syncing(&dir, 400).await;
    let streams = db.streams();
    streams.create(create("s", "text/plain")).await.unwrap();
    streams.append(produced("s", b"0;", 0, 0)).await.unwrap();
    // The client gives up on seq 1 while its record is being made durable (a timeout, a
    // hung-up connection), and sends it again at once.
    slow.store(true, Ordering::SeqCst);
    give_up_on(
        streams.append(produced("s", b"1;", 0, 1)),
        "the first attempt",
    )
    .await;
    let retry = streams.append(produced("s", b"1;", 0, 1)).await.unwrap();
    assert!(
        matches!(retry, AppendOutcome::Duplicate { .. }),
        "the retry of an append that landed is a duplicate: {retry:?}"
    );
    slow.store(false, Ordering::SeqCst);
    streams.append(produced("s", b"2;", 0, 2)).await.unwrap();
    assert_eq!(read_all(&db, "s").await, b"0;1;2;");
    db.shutdown().await.unwrap();
}

/// Gives up on `mutation` after 50 ms, as a client that times out or hangs up does, and
/// checks that it was still in flight then (its sync made slow by [`slow_syncing`]).
async fn give_up_on<T>(mutation: impl std::future::Future<Output = T>, what: &str) {
    let abandoned = tokio::time::timeout(Duration::from_millis(50), mutation).await;
    assert!(abandoned.is_err(), "{what} was still in flight");
}

/// A database whose log sleeps `sleep_ms` before each sync while the returned flag is set.
async fn slow_syncing(dir: &std::path::Path, sleep_ms: u64) -> (Arc<Database>, Arc<AtomicBool>) {
    let slow = Arc::new(AtomicBool::new(false));
    let mut config = DbConfig::new(dir);
    let hook_slow = slow.clone();
    config.log_fail_hook = Some(Arc::new(move |point| {
        if point == sluice::log::FailPoint::BeforeSync && hook_slow.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(sleep_ms));
        }
        None
    }));
    (Database::open(config).await.unwrap(), slow)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_to_one_stream_in_flight_together_share_syncs_and_each_lands_once() {
    let dir = common::temp_dir("stream-pipelined");
    let (db, slow) = slow_syncing(&dir, 100).await;
    let streams = db.streams().clone();
    streams.create(create("s", "text/plain")).await.unwrap();
    slow.store(true, Ordering::SeqCst);
    let groups = db.log().stats().groups.load(Ordering::Relaxed);
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let streams = streams.clone();
            tokio::spawn(async move {
                let body = format!("{i:02};");
                let outcome = streams.append(append("s", body.as_bytes())).await.unwrap();
                (body, outcome)
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            (body, AppendOutcome::Appended { next, .. }) => answers.push((next, body)),
            (_, other) => panic!("expected an append, got {other:?}"),
        }
    }
    slow.store(false, Ordering::SeqCst);
    // One at a time, each append would have waited for a sync of its own.
    let syncs = db.log().stats().groups.load(Ordering::Relaxed) - groups;
    assert!(syncs <= 8, "{syncs} syncs for 32 appends to one stream");
    // Each answer names the end of its own record, and every record is there once.
    let check = |data: &[u8]| {
        assert_eq!(data.len(), 32 * 3);
        for (next, body) in &answers {
            let end = *next as usize;
            assert_eq!(
                &data[end - 3..end],
                body.as_bytes(),
                "the record ending at {end}"
            );
        }
    };
    let mut ends: Vec<u64> = answers.iter().map(|(next, _)| *next).collect();
    ends.sort();
    assert_eq!(ends, (1..=32).map(|i| i * 3).collect::<Vec<u64>>());
    check(&read_all(&db, "s").await);
    // The log replays them the same way.
    db.shutdown().await.unwrap();
    drop(db);
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    check(&read_all(&db, "s").await);
    db.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_an_append_in_flight_is_answered_once_that_append_is_durable() {
    let dir = common::temp_dir("stream-retry-in-flight");
    let (db, slow) = slow_syncing(&dir, 300).await;
    let streams = db.streams().clone();
    streams.create(create("s", "text/plain")).await.unwrap();
    streams.append(produced("s", b"0;", 0, 0)).await.unwrap();
    slow.store(true, Ordering::SeqCst);
    let send = |delay: u64| {
        let streams = streams.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            let outcome = streams.append(produced("s", b"1;", 0, 1)).await.unwrap();
            // What is durable (and applied) when the answer comes.
            let tail = streams.get("s").await.unwrap().info().tail;
            (outcome, tail)
        })
    };
    // The same append twice, the second while the first waits for its sync.
    let (a, b) = (send(0), send(50));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    slow.store(false, Ordering::SeqCst);
    let ((appended, _), (duplicate, durable_then)) = match (&a.0, &b.0) {
        (AppendOutcome::Duplicate { .. }, _) => (b, a),
        _ => (a, b),
    };
    assert!(
        matches!(appended, AppendOutcome::Appended { next: 4, .. }),
        "{appended:?}"
    );
    // The duplicate's answer says the append is there: not before it is durable.
    assert!(
        matches!(duplicate, AppendOutcome::Duplicate { next: Some(4), .. }),
        "{duplicate:?}"
    );
    assert_eq!(
        durable_then, 4,
        "the duplicate was answered before the append was durable"
    );
    assert_eq!(read_all(&db, "s").await, b"0;1;");
    db.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_caller_gave_up_holds_its_lock_until_applied() {
    let dir = common::temp_dir("stream-abandoned-create");
    let (db, slow) = slow_syncing(&dir, 400).await;
    let streams = db.streams();
    slow.store(true, Ordering::SeqCst);
    give_up_on(streams.create(create("s", "text/plain")), "the create").await;
    // A delete sent at once waits for the create's lock, so it finds the stream.
    let deleted = streams.delete("s", None).await;
    assert!(deleted.is_ok(), "{deleted:?}");
    slow.store(false, Ordering::SeqCst);
    assert!(matches!(streams.get("s").await, Err(StreamError::NotFound)));
    db.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_whose_caller_gave_up_holds_its_lock_until_applied() {
    let dir = common::temp_dir("stream-abandoned-delete");
    let (db, slow) = slow_syncing(&dir, 400).await;
    let streams = db.streams();
    streams.create(create("s", "text/plain")).await.unwrap();
    streams.append(append("s", b"a;")).await.unwrap();
    slow.store(true, Ordering::SeqCst);
    give_up_on(streams.delete("s", None), "the delete").await;
    // An append sent at once waits for the delete's admission lock: it must not be
    // acknowledged into a stream that the delete then removes.
    let after = streams.append(append("s", b"b;")).await;
    assert!(matches!(after, Err(StreamError::NotFound)), "{after:?}");
    slow.store(false, Ordering::SeqCst);
    db.shutdown().await.unwrap();
}

/// The rest of an append whose caller gave up is finished on the runtime it started on, even
/// when the caller is dropped on a thread with no runtime: dropped midway, it would stay
/// counted in flight and its stream's next decisions would wait for it for ever.
#[test]
fn an_append_dropped_off_the_runtime_is_still_finished() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = common::temp_dir("stream-dropped-off-runtime");
    let (db, slow) = rt.block_on(slow_syncing(&dir, 400));
    let streams = db.streams().clone();
    rt.block_on(async {
        streams.create(create("s", "text/plain")).await.unwrap();
        streams.append(produced("s", b"0;", 0, 0)).await.unwrap();
    });
    slow.store(true, Ordering::SeqCst);
    let mut first = Box::pin(streams.append(produced("s", b"1;", 0, 1)));
    let polled =
        rt.block_on(async { tokio::time::timeout(Duration::from_millis(50), &mut first).await });
    assert!(polled.is_err(), "the first attempt was still in flight");
    // Dropped where no runtime is current (a plain thread).
    std::thread::scope(|scope| {
        scope.spawn(move || drop(first));
    });
    let retry = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(5),
            streams.append(produced("s", b"1;", 0, 1)),
        )
        .await
    });
    slow.store(false, Ordering::SeqCst);
    assert!(
        retry.is_ok(),
        "the retry hung: the dropped append stays counted in flight for ever"
    );
    rt.block_on(async { db.shutdown().await.unwrap() });
}
