//! Keys and what they may do: read, write and admin roles, and keys never reaching the logs.

mod common;

use std::io::Read as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;
use sluice::db::{Database, DbConfig};

#[tokio::test]
async fn each_role_does_what_it_may_and_nothing_more() {
    let dir = common::temp_dir("roles");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let keys = vec![
        "read=r-key".to_owned(),
        "write=w-key".into(),
        "a-key".into(),
    ];
    let (addr, _task) = common::serve(db, keys).await;
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let statement = |key: &str, sql: &str| {
        client
            .post(format!("{base}/v1/statements"))
            .bearer_auth(key)
            .json(&json!({"statement": sql}))
            .send()
    };
    let ingest = |key: &str| {
        client
            .post(format!(
                "{base}/v1/catalog/databases/scopedb/schemas/public/tables/t/ingest"
            ))
            .bearer_auth(key)
            .header("content-type", "application/x-ndjson")
            .body("{\"a\":1}\n")
            .send()
    };
    let status = |r: reqwest::Response| r.status().as_u16();

    // No key, a wrong key: 401 everywhere but health.
    let r = client
        .get(format!("{base}/v1/catalog"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(status(statement("nope", "SELECT 1").await.unwrap()), 401);
    assert_eq!(
        client
            .get(format!("{base}/v1/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );

    // Only admin creates tables; read and write keys are refused, with nothing applied.
    for key in ["r-key", "w-key"] {
        let r = statement(key, "CREATE TABLE t (a int)").await.unwrap();
        assert_eq!(r.status(), 403);
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["code"], "forbidden");
        assert_eq!(body["details"]["status"], "rejected");
    }
    assert_eq!(
        status(statement("a-key", "CREATE TABLE t (a int)").await.unwrap()),
        200
    );

    // Ingest: write and admin.
    assert_eq!(status(ingest("r-key").await.unwrap()), 403);
    assert_eq!(status(ingest("w-key").await.unwrap()), 200);
    assert_eq!(status(ingest("a-key").await.unwrap()), 200);

    // Queries: everyone; ScopeQL INSERT INTO needs write.
    for key in ["r-key", "w-key", "a-key"] {
        assert_eq!(
            status(statement(key, "SELECT count(*) FROM t").await.unwrap()),
            200
        );
        assert_eq!(status(statement(key, "SHOW TABLES").await.unwrap()), 200);
    }
    assert_eq!(
        status(
            statement("r-key", "FROM t SELECT a INSERT INTO t")
                .await
                .unwrap()
        ),
        403
    );

    // The catalog: read with any key, change with admin only.
    let table = format!("{base}/v1/catalog/databases/scopedb/schemas/public/tables/t");
    for key in ["r-key", "w-key"] {
        let r = client.get(&table).bearer_auth(key).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let r = client
            .delete(format!("{table}?allow_destructive=true"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
        assert_eq!(
            status(statement(key, "DROP TABLE t").await.unwrap()),
            403,
            "{key} dropped a table"
        );
    }

    // Streams: read reads, write creates and appends, admin deletes.
    let stream = format!("{base}/v1/stream/roles");
    let put = |key: &str| {
        client
            .put(&stream)
            .bearer_auth(key)
            .header("content-type", "text/plain")
            .send()
    };
    assert_eq!(status(put("r-key").await.unwrap()), 403);
    assert_eq!(status(put("w-key").await.unwrap()), 201);
    let append = |key: &str| {
        client
            .post(&stream)
            .bearer_auth(key)
            .header("content-type", "text/plain")
            .body("x")
            .send()
    };
    assert_eq!(status(append("r-key").await.unwrap()), 403);
    assert_eq!(status(append("w-key").await.unwrap()), 204);
    let r = client
        .get(&stream)
        .bearer_auth("r-key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.text().await.unwrap(), "x");
    let delete = |key: &str| client.delete(&stream).bearer_auth(key).send();
    assert_eq!(status(delete("w-key").await.unwrap()), 403);
    assert_eq!(status(delete("a-key").await.unwrap()), 204);

    // The table still has exactly the two rows the permitted keys wrote.
    let r: serde_json::Value = statement("r-key", "SELECT count(*) FROM t")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["result_set"]["rows"][0][0], "2");
}

#[test]
fn keys_never_reach_the_logs() {
    let dir = common::temp_dir("key-logs");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(&dir)
        .args([
            "--api-key",
            "write=sekrit-write-key",
            "--api-key",
            "sekrit-admin-key",
        ])
        .env("SLUICE_LOG", "trace")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        for _ in 0..200 {
            if client.get(format!("{base}/v1/health")).send().await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for key in ["sekrit-admin-key", "sekrit-write-key", "sekrit-wrong-key"] {
            let _ = client
                .post(format!("{base}/v1/statements"))
                .bearer_auth(key)
                .json(&json!({"statement": "CREATE TABLE k (a int)"}))
                .send()
                .await
                .unwrap();
        }
    });
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    child.wait().unwrap();
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(log.contains("answered"), "requests were logged: {log}");
    assert!(!log.contains("sekrit"), "a key reached the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_wait_their_turn() {
    use std::io::Write as _;
    let dir = common::temp_dir("conn-limit");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let listener = sluice::http::LimitedListener::new(tcp, 2);
    let app = sluice::http::router(sluice::http::AppState::new(db, vec![]));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let answer = tokio::task::spawn_blocking(move || {
        // Two idle connections take both slots.
        let first = std::net::TcpStream::connect(addr).unwrap();
        let _second = std::net::TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let mut third = std::net::TcpStream::connect(addr).unwrap();
        third
            .write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        third
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut buf = [0u8; 64];
        let early = third.read(&mut buf);
        assert!(
            early.is_err(),
            "a third connection was served while two were open"
        );
        // One closes: the waiting one is accepted and answered.
        drop(first);
        third
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut answer = String::new();
        third.read_to_string(&mut answer).unwrap();
        answer
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_or_missing_request_headers_are_cut_off() {
    use std::io::Write as _;
    let dir = common::temp_dir("header-timeout");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    // Two slots only: if cut-off connections kept theirs, the last request would never run.
    let listener = sluice::http::LimitedListener::new(tcp, 2);
    let app = sluice::http::router(sluice::http::AppState::new(db, vec![]));
    tokio::spawn(sluice::http::serve(
        listener,
        app,
        Duration::from_millis(500),
        std::future::pending(),
    ));
    let answer = tokio::task::spawn_blocking(move || {
        let closed_soon = |s: &mut std::net::TcpStream| {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut out = Vec::new();
            // EOF (or a reset) well before the 10 s read timeout means the server cut it.
            match s.read_to_end(&mut out) {
                Ok(_) => String::from_utf8_lossy(&out).into_owned(),
                Err(e) => {
                    assert_ne!(e.kind(), std::io::ErrorKind::WouldBlock, "never cut off");
                    String::new()
                }
            }
        };
        // Nothing at all.
        let mut idle = std::net::TcpStream::connect(addr).unwrap();
        let said = closed_soon(&mut idle);
        assert!(
            said.is_empty() || said.starts_with("HTTP/1.1 408"),
            "{said}"
        );
        // Headers a line at a time, slower than the deadline allows.
        let mut slow = std::net::TcpStream::connect(addr).unwrap();
        slow.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
            .unwrap();
        for _ in 0..4 {
            std::thread::sleep(Duration::from_millis(200));
            if slow.write_all(b"X-Slow: 1\r\n").is_err() {
                break;
            }
        }
        let said = closed_soon(&mut slow);
        assert!(
            said.is_empty() || said.starts_with("HTTP/1.1 408"),
            "{said}"
        );
        // The slots are free again.
        let mut ok = std::net::TcpStream::connect(addr).unwrap();
        ok.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        closed_soon(&mut ok)
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}
