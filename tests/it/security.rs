//! Keys and what they may do: read, write and admin roles, and keys never reaching the logs.

use crate::common;

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
    let listener =
        sluice::http::LimitedListener::new(tcp, sluice::http::ConnectionLimits::total(2));
    let app = sluice::http::router(sluice::http::AppState::new(db, vec![]));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let answer = tokio::task::spawn_blocking(move || {
        // Two idle connections take both slots.
        let first = std::net::TcpStream::connect(addr).unwrap();
        let _second = std::net::TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let mut third = std::net::TcpStream::connect(addr).unwrap();
        third
            .write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
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
    let listener =
        sluice::http::LimitedListener::new(tcp, sluice::http::ConnectionLimits::total(2));
    let app = sluice::http::router(sluice::http::AppState::new(db, vec![]));
    tokio::spawn(sluice::http::serve(
        listener,
        app,
        Duration::from_millis(500),
        Duration::from_secs(30),
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
        slow.write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n")
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
        ok.write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .unwrap();
        closed_soon(&mut ok)
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

// ---- attacks, each through the real binary ------------------------------------------------

use common::Server;

const KEYS: [&str; 6] = [
    "--api-key",
    "read=r-key",
    "--api-key",
    "write=w-key",
    "--api-key",
    "admin=a-key",
];

async fn submit(base: &str, key: &str, text: &str) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/statements"))
        .bearer_auth(key)
        .json(&json!({"statement": text}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// The statement's payload once it is no longer running (a debug build on a busy machine
/// can take longer than a submit waits; a statement whose planning takes long runs at the
/// lowest priority, so beside the hostile-function test it may take minutes: this waits five).
async fn finished(base: &str, key: &str, mut body: serde_json::Value) -> serde_json::Value {
    let client = reqwest::Client::new();
    for _ in 0..3000 {
        if body["status"] != "running" {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let id = body["statement_id"].as_str().unwrap().to_owned();
        body = client
            .get(format!("{base}/v1/statements/{id}"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    }
    panic!("statement still running: {body}");
}

/// A refusal: a 4xx in the `{code, message, details}` form saying nothing was applied.
fn assert_refused(status: u16, body: &serde_json::Value, what: &str) {
    assert!((400..500).contains(&status), "{what}: {status} {body}");
    assert!(
        body["code"].is_string() && body["message"].is_string(),
        "{what}: {body}"
    );
    assert_eq!(body["details"]["status"], "rejected", "{what}: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_are_authorized_by_what_they_do_and_never_reach_the_host() {
    let mut server = Server::start("attack-sql", &KEYS, "");
    let base = server.base.clone();
    let target = server.dir.join("written-by-sql.csv");
    let t = target.display();
    let (status, _) = submit(&base, "a-key", "CREATE TABLE t (a int)").await;
    assert_eq!(status, 200);
    // Every spelling that once slipped past a first-word check, from every key.
    let attacks = [
        format!("COPY (SELECT 1) TO '{t}'"),
        format!("; COPY (SELECT 1) TO '{t}'"),
        format!("/* x */ COPY (SELECT 1) TO '{t}'"),
        format!("/* /* nested */ */ COPY (SELECT 1) TO '{t}'"),
        format!("EXPLAIN ANALYZE COPY (SELECT 1) TO '{t}'"),
        format!("EXPLAIN COPY (SELECT 1) TO '{t}'"),
        format!("COPY t TO '{t}' STORED AS CSV"),
        "COPY (SELECT 1) TO 'sluice://data/catalog/00000000000000000009.json'".into(),
        format!("CREATE EXTERNAL TABLE x STORED AS CSV LOCATION '{t}'"),
        "CREATE VIEW v AS SELECT 1".into(),
        "SET datafusion.execution.target_partitions = 1".into(),
        "EXPLAIN ANALYZE INSERT INTO t VALUES (1)".into(),
        "INSERT INTO t VALUES (1) RETURNING a".into(),
        "DELETE FROM t".into(),
    ];
    for key in ["r-key", "w-key", "a-key"] {
        for text in &attacks {
            let (status, body) = submit(&base, key, text).await;
            assert_refused(status, &body, text);
        }
    }
    assert!(!target.exists(), "a statement wrote a host file");
    // Reading files by naming them finds nothing: only sluice's tables are reachable.
    let (_, body) = submit(&base, "r-key", "SELECT * FROM '/etc/passwd'").await;
    assert_eq!(body["status"], "failed", "{body}");
    // A read key may read (EXPLAIN ANALYZE of a query included), not write.
    let (status, body) = submit(&base, "r-key", "EXPLAIN ANALYZE SELECT count(*) FROM t").await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("finished")),
        "{body}"
    );
    for text in [
        "INSERT INTO t VALUES (1)",
        "VALUES (1) SELECT column1 AS a INSERT INTO t",
    ] {
        let (status, body) = submit(&base, "r-key", text).await;
        assert_eq!(status, 403, "{text}: {body}");
        assert_eq!(body["details"]["status"], "rejected");
    }
    let (status, body) = submit(&base, "w-key", "INSERT INTO t VALUES (1), (2)").await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("finished")),
        "{body}"
    );
    let (_, body) = submit(&base, "r-key", "SELECT count(*) FROM t").await;
    assert_eq!(body["result_set"]["rows"][0][0], "2", "{body}");
    assert!(server.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deeply_nested_statements_are_refused_and_the_server_stays_up() {
    let mut server = Server::start("attack-depth", &KEYS, "");
    let base = server.base.clone();
    let deep = [
        format!("SELECT {}1{}", "(".repeat(5000), ")".repeat(5000)),
        format!("FROM t SELECT {}1{}", "(".repeat(5000), ")".repeat(5000)),
        format!("SELECT {}", vec!["1"; 20_000].join("+")),
        format!("SELECT 1 WHERE {}", vec!["1=1"; 5000].join(" OR ")),
        format!("SELECT {}true", "NOT ".repeat(5000)),
        format!("VALUES (1) SELECT {}", vec!["1"; 20_000].join("+")),
        format!("FROM t SELECT v{}", "['a']".repeat(5000)),
        format!("SELECT 'a\\' || {} || '", vec!["1"; 20_000].join("+")),
    ];
    for text in &deep {
        let (status, body) = submit(&base, "r-key", text).await;
        assert_refused(status, &body, &text[..40]);
        assert_eq!(body["code"], "statement_too_complex", "{body}");
        assert!(server.alive(), "{} crashed the server", &text[..40]);
    }
    // Within the limit, deep expressions run (on the statement threads' large stacks).
    let (status, body) = submit(
        &base,
        "r-key",
        &format!("SELECT {}", vec!["1"; 900].join("+")),
    )
    .await;
    assert_eq!(status, 200);
    let body = finished(&base, "r-key", body).await;
    assert_eq!(body["result_set"]["rows"][0][0], "900", "{body}");
    // A computed column's expression is held to a stricter depth.
    let deep_column = json!({"name": "c", "columns": [
        {"name": "a", "data_type": "int"},
        {"name": "b", "data_type": "int", "expression": vec!["a"; 500].join("+")}
    ]});
    let r = reqwest::Client::new()
        .put(format!(
            "{base}/v1/catalog/databases/scopedb/schemas/public/tables/c"
        ))
        .bearer_auth("a-key")
        .json(&deep_column)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(server.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_belong_to_the_key_that_made_them() {
    let server = Server::start("attack-owner", &KEYS, "");
    let base = server.base.clone();
    let client = reqwest::Client::new();
    let with_id = |key: &'static str, text: &'static str| {
        client
            .post(format!("{base}/v1/statements"))
            .bearer_auth(key)
            .json(
                &json!({"statement": text, "statement_id": "0190aaaa-0000-7000-8000-000000000001"}),
            )
            .send()
    };
    // A reader picks the id an admin will use next: the admin's statement is its own.
    let reader: serde_json::Value = with_id("r-key", "SELECT 'reader' AS who")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(reader["result_set"]["rows"][0][0], "reader");
    let admin: serde_json::Value = with_id("a-key", "SELECT 'admin' AS who")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(admin["result_set"]["rows"][0][0], "admin", "{admin}");
    // Each key sees its own; no key sees or cancels another's.
    let fetch = |key: &'static str, path: &str| {
        client
            .get(format!("{base}/v1/statements/{path}"))
            .bearer_auth(key)
            .send()
    };
    let mine: serde_json::Value = fetch("r-key", "0190aaaa-0000-7000-8000-000000000001")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(mine["result_set"]["rows"][0][0], "reader");
    let theirs = admin["statement_id"].as_str().unwrap().to_owned();
    let (_, own) = submit(&base, "a-key", "SELECT 1").await;
    let own_id = own["statement_id"].as_str().unwrap().to_owned();
    assert_eq!(fetch("w-key", &own_id).await.unwrap().status(), 404);
    let cancel = client
        .post(format!("{base}/v1/statements/{own_id}/cancel"))
        .bearer_auth("r-key")
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), 404);
    assert_eq!(fetch("a-key", &theirs).await.unwrap().status(), 200);
}

/// A result's size is what its JSON weighs, escapes and nested values included (not its
/// Arrow size): a row of control characters or a list of booleans renders several times
/// larger than it is held. Many fetches of a kept result with a string larger than a piece
/// each get it whole (written a part at a time), and of one with a large list (written
/// whole) take turns within the render budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_are_limited_by_what_their_json_weighs() {
    let mut server = Server::start("attack-rendered", &[], "max_result_bytes = 4000000\n");
    let base = server.base.clone();
    for statement in [
        // 700 KB held, 4.2 MB as JSON (`\u0001` for each).
        "SELECT repeat(chr(1), 700000)",
        // About 125 KB held, 6 MB as JSON (`true, ` for each).
        "SELECT array_repeat(true, 1000000)",
        // One dictionary value, repeated in every row.
        "SELECT arrow_cast(repeat('\"', 2000), 'Dictionary(Int32, Utf8)') \
         FROM generate_series(1, 1000)",
    ] {
        let (_, body) = submit(&base, "", statement).await;
        let body = finished(&base, "", body).await;
        assert_eq!(body["status"], "failed", "{statement}: {body}");
        assert_eq!(body["error"]["code"], "result_too_large", "{body}");
    }
    // 3 MB as JSON: within the limit, and a row of many pieces.
    let (_, body) = submit(&base, "", "SELECT repeat(chr(1), 500000) AS s").await;
    let body = finished(&base, "", body).await;
    assert_eq!(body["status"], "finished", "{body}");
    let id = body["statement_id"].as_str().unwrap().to_owned();
    let client = reqwest::Client::new();
    let fetches = (0..8).map(|_| client.get(format!("{base}/v1/statements/{id}")).send());
    for answer in futures::future::join_all(fetches).await {
        let body: serde_json::Value = answer.unwrap().json().await.unwrap();
        let cell = body["result_set"]["rows"][0][0].as_str().unwrap();
        assert_eq!(cell.len(), 500000);
        assert!(cell.bytes().all(|b| b == 1));
    }
    // A list of 1.2 MB as JSON: a cell written whole, within the render budget.
    let (_, body) = submit(&base, "", "SELECT array_repeat(1, 400000) AS l").await;
    let body = finished(&base, "", body).await;
    assert_eq!(body["status"], "finished", "{body}");
    let id = body["statement_id"].as_str().unwrap().to_owned();
    let fetches = (0..4).map(|_| client.get(format!("{base}/v1/statements/{id}")).send());
    for answer in futures::future::join_all(fetches).await {
        let body: serde_json::Value = answer.unwrap().json().await.unwrap();
        let cell = body["result_set"]["rows"][0][0].as_str().unwrap();
        assert_eq!(cell.matches('1').count(), 400000);
    }
    let (_, body) = submit(&base, "", "SELECT 1").await;
    assert_eq!(body["result_set"]["rows"][0][0], "1", "{body}");
    assert!(server.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_memory_time_and_kept_statements_are_bounded() {
    let config = "max_result_rows = 1000\nstatement_timeout_seconds = 1\n\
                  query_memory_bytes = 4000000\nmax_kept_statements = 3\n";
    let mut server = Server::start("attack-limits", &[], config);
    let base = server.base.clone();
    let (_, body) = submit(&base, "", "SELECT * FROM generate_series(1, 100000)").await;
    assert_eq!(body["status"], "failed", "{body}");
    assert_eq!(body["error"]["code"], "result_too_large", "{body}");
    let (_, body) = submit(
        &base,
        "",
        "SELECT count(*) FROM generate_series(1, 100000000000)",
    )
    .await;
    let id = body["statement_id"].as_str().unwrap().to_owned();
    let mut status = body["status"].as_str().unwrap_or("").to_owned();
    let client = reqwest::Client::new();
    for _ in 0..100 {
        if status != "running" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let b: serde_json::Value = client
            .get(format!("{base}/v1/statements/{id}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        status = b["status"].as_str().unwrap_or("").to_owned();
        if status == "failed" {
            assert_eq!(b["error"]["code"], "statement_timeout", "{b}");
        }
    }
    assert_eq!(status, "failed");
    let (_, body) = submit(
        &base,
        "",
        "SELECT v, count(*) FROM (SELECT value % 1000000 AS v FROM generate_series(1, 3000000)) GROUP BY v ORDER BY v LIMIT 1",
    )
    .await;
    assert_eq!(body["status"], "failed", "{body}");
    assert_eq!(body["error"]["code"], "resources_exhausted", "{body}");
    // Only the last few finished statements are kept.
    let (_, first) = submit(&base, "", "SELECT 1").await;
    for _ in 0..5 {
        submit(&base, "", "SELECT 2").await;
    }
    let first = first["statement_id"].as_str().unwrap();
    let r = client
        .get(format!("{base}/v1/statements/{first}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert!(server.alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_pages_cannot_drive_a_server_without_keys() {
    let server = Server::start("attack-browser", &[], "");
    let base = server.base.clone();
    let client = reqwest::Client::new();
    // JSON endpoints refuse bodies a page could send without asking (text/plain, none).
    for content_type in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        None,
    ] {
        let mut r = client
            .post(format!("{base}/v1/statements"))
            .body(r#"{"statement": "CREATE TABLE pwned (a int)"}"#);
        if let Some(ct) = content_type {
            r = r.header("content-type", ct);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 415, "{content_type:?}");
    }
    let r = client
        .put(format!("{base}/v1/catalog/databases/pwned"))
        .header("content-type", "text/plain")
        .body(r#"{"name": "pwned"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    // DNS rebinding: a name that is not ours.
    let r = client
        .get(format!("{base}/v1/catalog"))
        .header("host", "attacker.example:6543")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 421);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["code"], "host_not_allowed");
    for host in ["localhost:1", "127.0.0.1", "[::1]:5"] {
        let r = client
            .get(format!("{base}/v1/catalog"))
            .header("host", host)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{host}");
    }
    // A page of another origin cannot write, to the API or to streams.
    let evil = "https://attacker.example";
    let r = client
        .post(format!("{base}/v1/statements"))
        .header("origin", evil)
        .json(&json!({"statement": "CREATE TABLE pwned (a int)"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    for (method, path) in [
        (reqwest::Method::PUT, "/v1/stream/page"),
        (reqwest::Method::POST, "/v1/stream/page"),
        (reqwest::Method::DELETE, "/v1/stream/page"),
        (reqwest::Method::PUT, "/bucket/page"),
    ] {
        let r = client
            .request(method.clone(), format!("{base}{path}"))
            .header("origin", evil)
            .header("content-type", "text/plain")
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{method} {path}");
    }
    // Nothing was created; stream answers grant no origin.
    let (_, tables) = submit(&base, "", "SHOW TABLES").await;
    assert_eq!(tables["result_set"]["metadata"]["num_rows"], 0, "{tables}");
    let r = client
        .put(format!("{base}/v1/stream/page"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = client
        .get(format!("{base}/v1/stream/page"))
        .header("origin", evil)
        .send()
        .await
        .unwrap();
    assert!(r.headers().get("access-control-allow-origin").is_none());
    // The same page's own origin (the console) may write.
    let r = client
        .post(format!("{base}/v1/statements"))
        .header("origin", &base)
        .json(&json!({"statement": "SELECT 1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    drop(server);
    // With an allowed origin configured, its pages get CORS answers.
    let server = Server::start("attack-cors", &["--cors-origin", "https://app.example"], "");
    let r = client
        .get(format!("{}/v1/stream/x", server.base))
        .header("origin", "https://app.example")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.headers().get("access-control-allow-origin").unwrap(),
        "https://app.example"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_streams_never_run_on_the_servers_origin() {
    let server = Server::start("attack-html", &[], "");
    let client = reqwest::Client::new();
    let url = format!("{}/v1/stream/page.html", server.base);
    let r = client
        .put(&url)
        .header("content-type", "text/html")
        .body("<script>fetch('/v1/statements')</script>")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = client.get(&url).send().await.unwrap();
    let h = r.headers();
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert!(
        h["content-security-policy"]
            .to_str()
            .unwrap()
            .starts_with("sandbox")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_methods_create_no_metric_series() {
    let server = Server::start("attack-metrics", &KEYS, "");
    let client = reqwest::Client::new();
    for i in 0..50 {
        let method = reqwest::Method::from_bytes(format!("X{i}Y").as_bytes()).unwrap();
        let _ = client
            .request(method, format!("{}/v1/nothing/{i}", server.base))
            .send()
            .await
            .unwrap();
    }
    let metrics = client
        .get(format!("{}/metrics", server.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!metrics.contains("X1Y"), "a made-up method became a label");
    assert!(metrics.contains("method=\"OTHER\""), "{metrics}");
}

/// A loopback HTTP server that records each request's first line and answers `answer`.
async fn receiver(answer: &'static str) -> (String, tokio::sync::mpsc::UnboundedReceiver<String>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let n = socket.read(&mut buf).await.unwrap_or(0);
                let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
                let _ = socket.write_all(answer.as_bytes()).await;
            });
        }
    });
    (url, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_reach_only_allowed_addresses_and_follow_no_redirect() {
    // Without an allowed network, loopback and every inside address are refused at once...
    let server = Server::start("attack-webhook", &[], "");
    let client = reqwest::Client::new();
    let sub = |base: &str, id: &str| format!("{base}/v1/stream/__ds/subscriptions/{id}");
    for (i, url) in [
        "http://127.0.0.1:9/hook",
        "http://[::ffff:127.0.0.1]:9/hook",
        "http://[::ffff:10.0.0.1]/hook",
        "http://100.64.0.1/hook",
        "http://169.254.169.254/latest",
        "http://[fd00::1]/hook",
        "http://[fe80::1]/hook",
        "http://0.0.0.0:9/hook",
    ]
    .iter()
    .enumerate()
    {
        let r = client
            .put(sub(&server.base, &format!("s{i}")))
            .json(&json!({"type": "webhook", "pattern": "events/*", "webhook": {"url": url}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{url}");
    }
    // ...and a name that resolves to loopback is refused when delivering: nothing connects.
    let (url, mut hits) = receiver("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").await;
    let named = url.replace("127.0.0.1", "localhost");
    let r = client
        .put(sub(&server.base, "named"))
        .json(&json!({"type": "webhook", "pattern": "events/*", "webhook": {"url": named}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    client
        .put(format!("{}/v1/stream/events/a", server.base))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        hits.try_recv().is_err(),
        "a webhook reached loopback by name"
    );
    drop(server);

    // With loopback allowed (as a test or a local consumer would), a redirect is not followed.
    let server = Server::start(
        "attack-redirect",
        &["--webhook-allowed-network", "127.0.0.0/8"],
        "",
    );
    let (target, mut target_hits) =
        receiver("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").await;
    let redirect: &'static str = Box::leak(
        format!(
            "HTTP/1.1 307 Temporary Redirect\r\nlocation: {target}\r\ncontent-length: 0\r\n\r\n"
        )
        .into_boxed_str(),
    );
    let (hook, mut hook_hits) = receiver(redirect).await;
    let r = client
        .put(sub(&server.base, "redirected"))
        .json(&json!({"type": "webhook", "pattern": "events/*", "webhook": {"url": hook}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    client
        .put(format!("{}/v1/stream/events/b", server.base))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), hook_hits.recv())
        .await
        .expect("the webhook was delivered")
        .unwrap();
    assert!(first.starts_with("POST /hook"), "{first}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(target_hits.try_recv().is_err(), "a redirect was followed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_callbacks_work_with_api_keys_and_patterns_are_bounded() {
    let mut args = KEYS.to_vec();
    args.extend(["--webhook-allowed-network", "127.0.0.0/8"]);
    let mut server = Server::start("attack-callback", &args, "");
    let client = reqwest::Client::new();
    let sub = format!("{}/v1/stream/__ds/subscriptions/cb", server.base);
    // Patterns of many wildcards are refused; the matcher never backtracks.
    let r = client
        .put(&sub)
        .bearer_auth("w-key")
        .json(&json!({"type": "pull-wake", "wake_stream": "w", "pattern": "*".repeat(200)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let (hook, mut hits) = receiver("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").await;
    let r = client
        .put(&sub)
        .bearer_auth("w-key")
        .json(&json!({"type": "webhook", "pattern": "*a*a*a*a*a*a*a*b", "webhook": {"url": hook}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let long = format!("{}/v1/stream/{}", server.base, "a".repeat(4000));
    client
        .put(&long)
        .bearer_auth("w-key")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert!(server.alive());
    let r = client
        .put(sub.replace("/cb", "/cb2"))
        .bearer_auth("w-key")
        .json(&json!({"type": "webhook", "pattern": "events/*", "webhook": {"url": hook}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    client
        .put(format!("{}/v1/stream/events/x", server.base))
        .bearer_auth("w-key")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    let request = tokio::time::timeout(Duration::from_secs(10), hits.recv())
        .await
        .expect("the webhook was delivered")
        .unwrap();
    let body = request.split("\r\n\r\n").nth(1).unwrap();
    let notification: serde_json::Value = serde_json::from_str(body).unwrap();
    // The consumer holds no API key: the wake token authorizes its callback.
    let r = client
        .post(notification["callback_url"].as_str().unwrap())
        .bearer_auth(notification["callback_token"].as_str().unwrap())
        .json(&json!({"wake_id": notification["wake_id"], "generation": notification["generation"], "done": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    // A wrong token is fenced; the API key itself is no wake token.
    let r = client
        .post(notification["callback_url"].as_str().unwrap())
        .bearer_auth("a-key")
        .json(&json!({"wake_id": notification["wake_id"], "generation": notification["generation"], "done": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
}

/// A failed statement's error may quote a value the statement made (a failed cast names the
/// string): what is kept and sent is cut to a few KiB, however large the value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_statements_error_text_is_bounded() {
    let server = Server::start("error-text", &[], "");
    let base = server.base.clone();
    let (status, body) = submit(&base, "", "SELECT CAST(repeat('x', 5000000) AS INT)").await;
    assert_eq!(status, 200, "{body}");
    let body = finished(&base, "", body).await;
    assert_eq!(body["status"], "failed", "{body}");
    let text = body.to_string();
    assert!(
        text.len() < 32 << 10,
        "the failed statement's answer holds {} bytes",
        text.len()
    );
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("bytes elided")),
        "{}",
        &text[..text.len().min(2000)]
    );
}
