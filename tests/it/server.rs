//! The server over real HTTP on loopback: catalog, ingest (every status), statements, auth,
//! restart with unflushed data.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Value, json};
use sluice::db::{Database, DbConfig};

use crate::common;

use common::{events_def, serve};

/// A server running in this process on a free port.
struct Server {
    addr: SocketAddr,
    db: Arc<Database>,
    dir: PathBuf,
    task: tokio::task::JoinHandle<()>,
    client: reqwest::Client,
    key: Option<String>,
}

fn temp_dir() -> PathBuf {
    common::temp_dir("server")
}

impl Server {
    async fn start_in(dir: PathBuf, keys: Vec<String>) -> Server {
        Server::start_with(DbConfig::new(&dir), keys).await
    }

    async fn start_with(config: DbConfig, keys: Vec<String>) -> Server {
        let dir = config.data_dir.clone();
        let db = Database::open(config).await.unwrap();
        let (addr, task) = serve(db.clone(), keys.clone()).await;
        Server {
            addr,
            db,
            dir,
            task,
            client: reqwest::Client::new(),
            key: keys.into_iter().next(),
        }
    }

    async fn start() -> Server {
        Server::start_in(temp_dir(), Vec::new()).await
    }

    /// Stops serving without flushing: the unflushed rows live only in the commit log.
    async fn crash(self) -> PathBuf {
        self.task.abort();
        let _ = self.task.await;
        self.db.log().close();
        self.dir
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.client.request(method, self.url(path));
        match &self.key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    async fn ingest(&self, table: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let r = self
            .request(
                reqwest::Method::POST,
                &format!("/v1/catalog/databases/scopedb/schemas/public/tables/{table}/ingest"),
            )
            .header("content-type", "application/x-ndjson")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Submits a statement that may fail; the answer must be 200.
    async fn submit(&self, statement: &str) -> Value {
        let r = self
            .request(reqwest::Method::POST, "/v1/statements")
            .json(&json!({"statement": statement}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }

    async fn sql(&self, statement: &str) -> Value {
        let r = self
            .request(reqwest::Method::POST, "/v1/statements")
            .json(&json!({"statement": statement, "format": "json"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["status"], "finished", "{statement}: {v}");
        v
    }

    async fn create_events(&self) {
        let r = self
            .request(
                reqwest::Method::PUT,
                "/v1/catalog/databases/scopedb/schemas/public/tables/events",
            )
            .json(&events_def())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    }
}

const SEED_ROW: &str = r#"{"time":"2026-10-23T09:00:00Z","service":"checkout","name":"payment_failed","message":"Credit card gateway timed out","var":{"region":"apac","gateway":"credit_card"}}"#;

fn rows(n: usize, from: usize) -> String {
    (from..from + n)
        .map(|i| {
            format!(
                "{{\"time\":\"2026-10-23T09:00:{:02}Z\",\"service\":\"s{}\",\"name\":\"n{i}\",\"message\":\"m\",\"var\":{{\"i\":{i}}}}}\n",
                i % 60,
                i % 3
            )
        })
        .collect()
}

async fn count(server: &Server) -> i64 {
    let v = server
        .sql("SELECT count(*) AS n FROM scopedb.public.events")
        .await;
    v["result_set"]["rows"][0][0]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn health_catalog_and_the_seed_example() {
    let s = Server::start().await;
    let health = s.client.get(s.url("/v1/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert!(health.headers().contains_key("x-request-id"));

    // The default database and schema exist.
    let r = s
        .request(reqwest::Method::GET, "/v1/catalog")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let etag = r.headers()["etag"].to_str().unwrap().to_owned();
    let root: Value = r.json().await.unwrap();
    assert_eq!(root["databases"][0]["name"], "scopedb");
    assert_eq!(root["databases"][0]["schemas"][0]["name"], "public");

    // Create the seed's table; the answer says what changed.
    let r = s
        .request(
            reqwest::Method::PUT,
            "/v1/catalog/databases/scopedb/schemas/public/tables/events",
        )
        .header("if-match", &etag)
        .json(&events_def())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let m: Value = r.json().await.unwrap();
    assert_eq!(m["before"], Value::Null);
    assert_eq!(m["after"]["name"], "events");
    assert_eq!(m["destructive"], false);

    // A stale ETag is refused.
    let r = s
        .request(
            reqwest::Method::PUT,
            "/v1/catalog/databases/scopedb/schemas/public/tables/other",
        )
        .header("if-match", &etag)
        .json(&json!({"name": "other", "columns": [{"name": "a", "data_type": "int"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 412);
    assert_eq!(
        r.json::<Value>().await.unwrap()["code"],
        "precondition_failed"
    );

    // The seed's append, then a query that sees it at once.
    let (status, body) = s.ingest("events", format!("{SEED_ROW}\n")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"status": "committed", "num_rows_inserted": 1}));
    let v = s
        .sql("SELECT time, name, message, var FROM events WHERE service = 'checkout'")
        .await;
    let rs = &v["result_set"];
    assert_eq!(rs["metadata"]["num_rows"], 1);
    assert_eq!(
        rs["metadata"]["fields"],
        json!([{"name":"time","data_type":"timestamp"},{"name":"name","data_type":"string"},
               {"name":"message","data_type":"string"},{"name":"var","data_type":"object"}])
    );
    assert_eq!(
        rs["rows"][0],
        json!([
            "2026-10-23T09:00:00Z",
            "payment_failed",
            "Credit card gateway timed out",
            "{\"region\":\"apac\",\"gateway\":\"credit_card\"}"
        ])
    );
    for key in [
        "total_percentage",
        "nanos_from_submitted",
        "skipped_uncompressed_bytes",
    ] {
        assert!(v["progress"].get(key).is_some(), "progress.{key}");
    }
}

#[tokio::test]
async fn ingest_refusals_have_their_statuses_and_apply_nothing() {
    let s = Server::start().await;
    s.create_events().await;

    // 422 with row errors.
    let (status, body) = s
        .ingest("events", "{\"time\":\"2026-10-23\"}\n{\"nope\":1}\n")
        .await;
    assert_eq!(status, 422);
    assert_eq!(body["code"], "invalid_schema");
    assert_eq!(body["details"]["status"], "rejected");
    assert_eq!(body["details"]["row_errors"][0]["row_index"], 0);
    assert_eq!(body["details"]["row_errors"][0]["column"], "time");
    assert_eq!(body["details"]["row_errors"][1]["column"], "nope");
    assert_eq!(body["details"]["row_errors_truncated"], false);

    // 404 unknown table.
    let (status, body) = s.ingest("missing", format!("{SEED_ROW}\n")).await;
    assert_eq!(status, 404);
    assert_eq!(body["details"]["status"], "rejected");

    // 415 wrong content type and unknown encoding.
    let r = s
        .request(
            reqwest::Method::POST,
            "/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest",
        )
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("{SEED_ROW}\n"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    let r = s
        .request(
            reqwest::Method::POST,
            "/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest",
        )
        .header("content-type", "application/x-ndjson")
        .header("content-encoding", "br")
        .body(format!("{SEED_ROW}\n"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);

    // 413: 16 MiB + 1 byte, and 200,001 rows.
    let mut big = vec![b' '; 16 * 1024 * 1024 + 1];
    big[..SEED_ROW.len()].copy_from_slice(SEED_ROW.as_bytes());
    let (status, body) = s.ingest("events", big).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["details"]["status"], "rejected");
    let many = "{}\n".repeat(200_001);
    let (status, _) = s.ingest("events", many).await;
    assert_eq!(status, 413);
    // Exactly at the limits is accepted.
    let (status, body) = s.ingest("events", "{}\n".repeat(200_000)).await;
    assert_eq!((status, &body["num_rows_inserted"]), (200, &json!(200_000)));

    // A gzip bomb: 64 MiB of spaces in about 64 KiB, refused after 16 MiB of output.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&vec![b' '; 64 << 20]).unwrap();
    let bomb = gz.finish().unwrap();
    assert!(bomb.len() < 1 << 20);
    let r = s
        .request(
            reqwest::Method::POST,
            "/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest",
        )
        .header("content-type", "application/x-ndjson")
        .header("content-encoding", "gzip")
        .body(bomb)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(count(&s).await, 200_000, "nothing refused was applied");
}

#[tokio::test]
async fn gzip_and_zstd_bodies_commit() {
    let s = Server::start().await;
    s.create_events().await;
    let body = rows(100, 0);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(body.as_bytes()).unwrap();
    let zst = zstd::encode_all(body.as_bytes(), 3).unwrap();
    for (encoding, packed) in [("gzip", gz.finish().unwrap()), ("zstd", zst)] {
        let r = s
            .request(
                reqwest::Method::POST,
                "/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest",
            )
            .header("content-type", "application/x-ndjson")
            .header("content-encoding", encoding)
            .body(packed)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.json::<Value>().await.unwrap()["num_rows_inserted"], 100);
    }
    assert_eq!(count(&s).await, 200);
}

#[tokio::test]
async fn concurrent_ingests_into_one_table_all_land() {
    let s = Arc::new(Server::start().await);
    s.create_events().await;
    let mut tasks = Vec::new();
    for client in 0..8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            for batch in 0..5 {
                let (status, body) = s
                    .ingest("events", rows(50, (client * 5 + batch) * 50))
                    .await;
                assert_eq!(status, 200, "{body}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(count(&s).await, 2000);
    let v = s.sql("SELECT count(DISTINCT name) AS n FROM events").await;
    assert_eq!(v["result_set"]["rows"][0][0], "2000");
}

#[tokio::test]
async fn restart_with_unflushed_data_keeps_every_row() {
    let s = Server::start().await;
    s.create_events().await;
    assert_eq!(s.ingest("events", rows(30, 0)).await.0, 200);
    s.db.tables().flush_due(true).await.unwrap();
    assert_eq!(s.ingest("events", rows(20, 30)).await.0, 200);
    let dir = s.crash().await;
    let s = Server::start_in(dir, Vec::new()).await;
    assert_eq!(count(&s).await, 50);
    let v = s.sql("SELECT count(DISTINCT name) FROM events").await;
    assert_eq!(v["result_set"]["rows"][0][0], "50", "no row twice");
}

#[tokio::test]
async fn statements_ddl_errors_and_cancel() {
    let s = Server::start().await;
    s.sql("CREATE TABLE logs (ts timestamp, level string, n int, payload any)")
        .await;
    let v = s.sql("SHOW TABLES").await;
    assert_eq!(
        v["result_set"]["rows"][0],
        json!(["scopedb", "public", "logs"])
    );
    let v = s.sql("DESCRIBE TABLE scopedb.public.logs").await;
    assert_eq!(v["result_set"]["rows"][3][1], "any");
    let (status, _) = s
        .ingest(
            "logs",
            "{\"ts\":\"2026-01-01T00:00:00Z\",\"level\":\"warn\",\"n\":5,\"payload\":[1,\"x\"]}\n",
        )
        .await;
    assert_eq!(status, 200);
    let v = s.sql("SELECT level, n + 1 AS m, payload FROM logs").await;
    assert_eq!(
        v["result_set"]["rows"][0],
        json!(["warn", "6", "[1,\"x\"]"])
    );

    // A failed statement carries message and error.
    let r = s
        .request(reqwest::Method::POST, "/v1/statements")
        .json(&json!({"statement": "SELECT nope FROM logs", "statement_id": "my-id"}))
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["status"], "failed");
    assert_eq!(v["statement_id"], "my-id");
    assert!(v["message"].as_str().unwrap().contains("nope"));
    assert_eq!(v["error"]["code"], "query_error");
    let v: Value = s
        .request(reqwest::Method::GET, "/v1/statements/my-id?format=json")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["status"], "failed");
    let r = s
        .request(reqwest::Method::GET, "/v1/statements/unknown")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v = s.sql("DROP TABLE logs").await;
    assert_eq!(v["status"], "finished");
    let r = s
        .request(reqwest::Method::POST, "/v1/statements/my-id/cancel")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn api_keys_are_required_when_configured() {
    let s = Server::start_in(temp_dir(), vec!["secret-key".into()]).await;
    let r = s.client.get(s.url("/v1/catalog")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = s
        .client
        .get(s.url("/v1/catalog"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["code"], "unauthorized");
    let r = s
        .client
        .get(s.url("/v1/catalog"))
        .bearer_auth("secret-key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Health stays open for liveness probes.
    assert_eq!(
        s.client
            .get(s.url("/v1/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test]
async fn destructive_catalog_changes_need_permission() {
    let s = Server::start().await;
    s.create_events().await;
    let path = "/v1/catalog/databases/scopedb/schemas/public/tables/events";
    let r = s
        .request(reqwest::Method::DELETE, path)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let r = s
        .request(
            reqwest::Method::DELETE,
            &format!("{path}?allow_destructive=true&dry_run=true"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let m: Value = r.json().await.unwrap();
    assert_eq!(
        (m["destructive"].clone(), m["after"].clone()),
        (json!(true), Value::Null)
    );
    // The dry run changed nothing.
    assert_eq!(
        s.request(reqwest::Method::GET, path)
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let r = s
        .request(
            reqwest::Method::DELETE,
            &format!("{path}?allow_destructive=true"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        s.request(reqwest::Method::GET, path)
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    // A body whose name does not match the path is refused.
    let r = s
        .request(
            reqwest::Method::PUT,
            "/v1/catalog/databases/scopedb/schemas/public/tables/x",
        )
        .json(&events_def())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn computed_columns_are_filled_at_ingest() {
    let s = Server::start().await;
    let r = s
        .request(
            reqwest::Method::PUT,
            "/v1/catalog/databases/scopedb/schemas/public/tables/c",
        )
        .json(&json!({"name": "c", "columns": [
            {"name": "a", "data_type": "int"},
            {"name": "double_a", "data_type": "int", "expression": "a * 2"}
        ]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    assert_eq!(s.ingest("c", "{\"a\":21}\n").await.0, 200);
    let (status, body) = s.ingest("c", "{\"a\":1,\"double_a\":2}\n").await;
    assert_eq!(status, 422, "{body}");
    let v = s.sql("SELECT a, double_a FROM c").await;
    assert_eq!(v["result_set"]["rows"], json!([["21", "42"]]));
    // A bad expression is refused when the table is defined.
    let r = s
        .request(
            reqwest::Method::PUT,
            "/v1/catalog/databases/scopedb/schemas/public/tables/d",
        )
        .json(&json!({"name": "d", "columns": [
            {"name": "a", "data_type": "int"},
            {"name": "b", "data_type": "int", "expression": "no_such_column + 1"}
        ]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

/// A computed value obeys its column's type as an input value would, on ingest and on INSERT
/// alike (the same answer): it never turns into NULL or into something the type refuses.
#[tokio::test]
async fn computed_values_obey_their_column_types() {
    let s = Server::start().await;
    // Each would have been truncated, rounded, wrapped or reinterpreted by a cast.
    let cases = [
        ("uint", "a - 10"),
        ("object", "'not json'"),
        ("array", "'{}'"),
        ("float", "a / 0.0"),
        ("timestamp", "'garbage'"),
        ("int", "a / 2.0"),
        ("int", "CAST(a AS DECIMAL(10,2)) / 2"),
        ("uint", "-0.5"),
        ("uint", "CAST('18446744073709551615' AS BIGINT UNSIGNED)"),
        ("float", "9007199254740993"),
        ("timestamp", "'2024-01-01'"),
        ("timestamp", "a"),
        ("boolean", "'yes'"),
        ("timestamp", "to_timestamp_seconds(10000000000)"),
        ("interval", "INTERVAL '1 month'"),
    ];
    for (i, (data_type, expression)) in cases.iter().enumerate() {
        let name = format!("cv{i}");
        let r = s
            .request(
                reqwest::Method::PUT,
                &format!("/v1/catalog/databases/scopedb/schemas/public/tables/{name}"),
            )
            .json(&json!({"name": name, "columns": [
                {"name": "a", "data_type": "int"},
                {"name": "c", "data_type": data_type, "expression": expression}
            ]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
        let (status, body) = s.ingest(&name, "{\"a\":3}\n").await;
        assert_eq!(status, 422, "{data_type} = {expression}: {body}");
        assert_eq!(body["code"], "invalid_schema", "{body}");
        assert_eq!(body["details"]["row_errors"][0]["column"], "c", "{body}");
        let v = s
            .submit(&format!("INSERT INTO {name} (a) VALUES (3)"))
            .await;
        assert_eq!(v["status"], "failed", "{v}");
        assert_eq!(v["error"]["code"], body["code"], "{v}");
        assert_eq!(v["error"]["details"]["status"], "rejected", "{v}");
        let v = s.sql(&format!("SELECT count(*) FROM {name}")).await;
        assert_eq!(v["result_set"]["rows"][0][0], "0", "{v}");
    }
    // JSON text of the right kind is stored compact.
    let r = s
        .request(
            reqwest::Method::PUT,
            "/v1/catalog/databases/scopedb/schemas/public/tables/cj",
        )
        .json(&json!({"name": "cj", "columns": [
            {"name": "a", "data_type": "int"},
            {"name": "o", "data_type": "object",
             "expression": "'{ \"x\" : ' || CAST(a AS VARCHAR) || ' }'"}
        ]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    assert_eq!(s.ingest("cj", "{\"a\":3}\n").await.0, 200);
    let v = s.sql("SELECT o FROM cj").await;
    assert_eq!(v["result_set"]["rows"], json!([["{\"x\":3}"]]));
    // Exact values of the type are stored as they are.
    let r = s
        .request(
            reqwest::Method::PUT,
            "/v1/catalog/databases/scopedb/schemas/public/tables/ce",
        )
        .json(&json!({"name": "ce", "columns": [
            {"name": "a", "data_type": "int"},
            {"name": "i", "data_type": "int", "expression": "a * 2.0"},
            {"name": "f", "data_type": "float", "expression": "a / 2"},
            {"name": "t", "data_type": "timestamp", "expression": "to_timestamp_seconds(a)"},
            {"name": "d", "data_type": "interval", "expression": "INTERVAL '1 day'"}
        ]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    assert_eq!(s.ingest("ce", "{\"a\":3}\n").await.0, 200);
    let v = s.sql("SELECT i, f, t, d FROM ce").await;
    assert_eq!(
        v["result_set"]["rows"],
        json!([["6", "1", "1970-01-01T00:00:03Z", "PT24H"]]),
        "{v}"
    );
}

#[tokio::test]
async fn statement_inserts_take_the_ingest_path() {
    let s = Server::start().await;
    let r = s
        .request(
            reqwest::Method::PUT,
            "/v1/catalog/databases/scopedb/schemas/public/tables/dst",
        )
        .json(&json!({"name": "dst", "columns": [
            {"name": "a", "data_type": "int"},
            {"name": "b", "data_type": "int", "expression": "a * 2"},
            {"name": "t", "data_type": "timestamp"},
            {"name": "o", "data_type": "object"}
        ]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    s.sql("CREATE TABLE src (a int)").await;
    assert_eq!(s.ingest("src", "{\"a\":1}\n{\"a\":2}\n").await.0, 200);
    // ScopeQL INSERT INTO: computed columns are filled, as at ingest.
    let v = s.sql("FROM src SELECT a INSERT INTO dst").await;
    assert_eq!(v["result_set"]["rows"], json!([["2"]]), "{v}");
    // SQL INSERT ... VALUES and ... SELECT, with and without a column list.
    let v = s
        .sql("INSERT INTO dst (a, t, o) VALUES (10, '2026-10-23T09:00:00Z', '{\"k\": [1]}')")
        .await;
    assert_eq!(v["status"], "finished", "{v}");
    let v = s.sql("INSERT INTO dst SELECT a + 100 FROM src").await;
    assert_eq!(v["result_set"]["rows"], json!([["2"]]), "{v}");
    // Unquoted names fold to lower case, as in the statement's own query; quoted ones do not.
    let v = s.sql("INSERT INTO DST (A) VALUES (1000)").await;
    assert_eq!(v["status"], "finished", "{v}");
    let v = s.submit("INSERT INTO \"DST\" (a) VALUES (1)").await;
    assert_eq!(v["status"], "failed", "{v}");
    let v = s.sql("SELECT a, b, t, o FROM dst ORDER BY a").await;
    assert_eq!(
        v["result_set"]["rows"],
        json!([
            ["1", "2", null, null],
            ["2", "4", null, null],
            ["10", "20", "2026-10-23T09:00:00Z", "{\"k\":[1]}"],
            ["101", "202", null, null],
            ["102", "204", null, null],
            ["1000", "2000", null, null]
        ])
    );
    // The same checks as ingest: a value a column refuses fails the whole insert.
    for bad in [
        "INSERT INTO dst (a) VALUES (1), (1.5)",
        "INSERT INTO dst (t) VALUES ('yesterday')",
        "INSERT INTO dst (o) VALUES ('[1]')",
        "INSERT INTO dst (o) VALUES ('1, \"a\": 2')",
        "INSERT INTO dst (b) VALUES (1)",
        "INSERT INTO dst (nope) VALUES (1)",
        "INSERT INTO dst (a, a) VALUES (1, 2)",
        "INSERT INTO dst (a) VALUES (1, 2)",
    ] {
        let v = s.submit(bad).await;
        assert_eq!(v["status"], "failed", "{bad}: {v}");
    }
    // A value that cannot be a value of its column is a row error, as at ingest: never a
    // NULL, a wrapped instant or a truncated number.
    for bad in [
        "INSERT INTO dst (t) VALUES (DATE '3000-01-01')",
        "INSERT INTO dst (t) SELECT to_timestamp_seconds(10000000000)",
        "INSERT INTO dst (t) SELECT arrow_cast(to_timestamp_seconds(10000000000), 'Timestamp(Millisecond, None)')",
        "INSERT INTO dst (a, o) VALUES (1, '{}'), (2, 'not json')",
    ] {
        let v = s.submit(bad).await;
        assert_eq!(v["status"], "failed", "{bad}: {v}");
        assert_eq!(v["error"]["code"], "invalid_schema", "{bad}: {v}");
        let row = &v["error"]["details"]["row_errors"][0];
        assert!(row["column"] == "t" || row["column"] == "o", "{bad}: {v}");
    }
    let v = s
        .submit("INSERT INTO dst (a, o) VALUES (1, '{}'), (2, 'not json')")
        .await;
    assert_eq!(
        v["error"]["details"]["row_errors"][0]["row_index"], 1,
        "{v}"
    );
    assert_eq!(
        s.sql("SELECT count(*) FROM dst").await["result_set"]["rows"][0][0],
        "6"
    );
    // A plain query creates nothing: reading a table never writes.
    let metrics = s
        .request(reqwest::Method::GET, "/metrics")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("sluice_ingest_rows_total 8"),
        "inserts count as ingest"
    );
}

#[tokio::test]
async fn legacy_ingest_endpoint_takes_glued_rows() {
    let s = Server::start().await;
    s.create_events().await;
    let rows = r#"{"service":"a"}{"service":"b"}"#;
    let r = s
        .request(reqwest::Method::POST, "/v1/ingest")
        .json(&json!({"data": {"format": "json", "rows": rows}, "statement": "INSERT INTO events"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"num_rows_inserted": 2})
    );
    assert_eq!(count(&s).await, 2);
}

#[tokio::test]
async fn backpressure_answers_503_with_retry_after_and_applies_nothing() {
    let mut config = DbConfig::new(temp_dir());
    config.tables.max_unflushed_bytes = 1;
    config.tables.max_spilled_bytes = 0;
    // No flush runs here, so the wait for headroom runs out.
    config.tables.headroom_wait = std::time::Duration::from_millis(200);
    let s = Server::start_with(config, Vec::new()).await;
    s.create_events().await;
    assert_eq!(s.ingest("events", rows(10, 0)).await.0, 200);
    let r = s
        .request(
            reqwest::Method::POST,
            "/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest",
        )
        .header("content-type", "application/x-ndjson")
        .body(rows(10, 10))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["code"], "service_unavailable");
    assert_eq!(body["details"]["status"], "rejected");
    assert_eq!(count(&s).await, 10);
    // Once a flush catches up, the same batch goes in.
    s.db.tables().flush_due(true).await.unwrap();
    assert_eq!(s.ingest("events", rows(10, 10)).await.0, 200);
    assert_eq!(count(&s).await, 20);
}

/// Once an append waited its whole patience for a flush that never came, the tables cannot
/// keep up: appends over the budget are refused at once (503, `Retry-After`, nothing applied)
/// rather than each waiting as long and piling up; a flush lets them in again.
#[tokio::test]
async fn a_table_that_cannot_keep_up_refuses_at_once() {
    let mut config = DbConfig::new(temp_dir());
    config.tables.max_unflushed_bytes = 1;
    config.tables.max_spilled_bytes = 0;
    // No flush runs here.
    let patience = std::time::Duration::from_secs(3);
    config.tables.headroom_wait = patience;
    let s = Server::start_with(config, Vec::new()).await;
    s.create_events().await;
    assert_eq!(s.ingest("events", rows(10, 0)).await.0, 200);
    let started = std::time::Instant::now();
    assert_eq!(s.ingest("events", rows(10, 10)).await.0, 503);
    assert!(
        started.elapsed() >= patience,
        "the first waited its patience"
    );
    // Then every append over the budget is refused at once: eight of them answer in less
    // time than one wait.
    let started = std::time::Instant::now();
    let refused = (0..8).map(|i| s.ingest("events", rows(10, 20 + 10 * i)));
    for (status, body) in futures::future::join_all(refused).await {
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["details"]["status"], "rejected", "{body}");
        assert_eq!(body["details"]["retry_after_seconds"], 1, "{body}");
    }
    assert!(started.elapsed() < patience, "{:?}", started.elapsed());
    assert_eq!(count(&s).await, 10);
    // A flush frees memory: appends go in again.
    s.db.tables().flush_due(true).await.unwrap();
    assert_eq!(s.ingest("events", rows(10, 10)).await.0, 200);
    assert_eq!(count(&s).await, 20);
}

#[tokio::test]
async fn queries_read_spilled_batches_back_from_the_log() {
    // A memory budget every batch exceeds: each is spilled once committed.
    let mut config = DbConfig::new(temp_dir());
    config.tables.max_unflushed_bytes = 1;
    let s = Server::start_with(config, Vec::new()).await;
    s.create_events().await;
    for b in 0..5 {
        assert_eq!(s.ingest("events", rows(100, b * 100)).await.0, 200);
    }
    let stats: Value = s
        .request(
            reqwest::Method::GET,
            "/v1/catalog/databases/scopedb/schemas/public/tables/events/stats",
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["unflushed_batches"], 5, "{stats}");
    assert_eq!(stats["spilled_bytes"], stats["unflushed_bytes"], "{stats}");
    assert_eq!(count(&s).await, 500);
    let v = s
        .sql("SELECT service, count(*) FROM events GROUP BY service ORDER BY service")
        .await;
    assert_eq!(
        v["result_set"]["rows"],
        json!([["s0", "167"], ["s1", "167"], ["s2", "166"]])
    );
    let v = s.sql("SELECT name FROM events WHERE name = 'n432'").await;
    assert_eq!(v["result_set"]["rows"], json!([["n432"]]));
    // A scan stopped early (a limit) leaves the rest unread, and the table as it was.
    let v = s.sql("SELECT name FROM events LIMIT 3").await;
    assert_eq!(v["result_set"]["rows"].as_array().unwrap().len(), 3);
    // Flushed: the same answers from Parquet.
    s.db.tables().flush_due(true).await.unwrap();
    assert_eq!(count(&s).await, 500);
    let metrics = s
        .request(reqwest::Method::GET, "/metrics")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("sluice_table_spills_total 5"), "{metrics}");
}

#[tokio::test]
async fn the_same_error_class_gets_the_same_answer_on_ingest_streams_and_statements() {
    // A full log: every write is refused with nothing applied, retry in a second.
    let mut config = DbConfig::new(temp_dir());
    config.max_log_bytes = 64 * 1024;
    let s = Server::start_with(config, Vec::new()).await;
    s.create_events().await;
    let r = s
        .request(reqwest::Method::PUT, "/v1/stream/full")
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let mut i = 0;
    let ingest = loop {
        let r = s
            .request(
                reqwest::Method::POST,
                "/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest",
            )
            .header("content-type", "application/x-ndjson")
            .body(rows(200, i * 200))
            .send()
            .await
            .unwrap();
        if r.status() != 200 {
            break r;
        }
        i += 1;
        assert!(i < 1000, "the log never filled");
    };
    assert_eq!(ingest.status(), 503);
    assert_eq!(ingest.headers()["retry-after"], "1");
    assert_eq!(ingest.headers()["x-sluice-not-applied"], "LogDiskPressure");
    assert_eq!(ingest.headers()["x-ursula-not-applied"], "WalDiskPressure");
    let ingest: Value = ingest.json().await.unwrap();
    let append = s
        .request(reqwest::Method::POST, "/v1/stream/full")
        .header("content-type", "text/plain")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(append.status(), 503);
    assert_eq!(append.headers()["retry-after"], "1");
    assert_eq!(append.headers()["x-sluice-not-applied"], "LogDiskPressure");
    assert_eq!(append.headers()["x-ursula-not-applied"], "WalDiskPressure");
    let append: Value = append.json().await.unwrap();
    let statement = s.submit("INSERT INTO events (service) VALUES ('x')").await;
    assert_eq!(statement["status"], "failed", "{statement}");
    let statement = &statement["error"];
    for answer in [&ingest, &append, statement] {
        assert_eq!(answer["code"], "service_unavailable", "{answer}");
        assert_eq!(
            answer["details"],
            json!({"status": "rejected", "retry_after_seconds": 1, "cause": "LogDiskPressure"}),
            "{answer}"
        );
        // The stream Append contract's name for the same cause.
        assert_eq!(answer["error"], "WalDiskPressure", "{answer}");
    }
}

#[tokio::test]
async fn ingest_waits_for_flushes_instead_of_refusing() {
    // A budget every batch exceeds, spilling off: each ingest must wait for the flush of
    // the one before.
    let mut config = DbConfig::new(temp_dir());
    config.tables.max_unflushed_bytes = 1;
    config.tables.max_spilled_bytes = 0;
    let s = Server::start_with(config, Vec::new()).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let maintenance = tokio::spawn(s.db.clone().run_maintenance(async move {
        let _ = stopped.await;
    }));
    s.create_events().await;
    let mut clients = Vec::new();
    for c in 0..4 {
        let (client, url) = (
            s.client.clone(),
            s.url("/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest"),
        );
        clients.push(tokio::spawn(async move {
            for b in 0..5 {
                let r = client
                    .post(&url)
                    .header("content-type", "application/x-ndjson")
                    .body(rows(10, (c * 5 + b) * 10))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(count(&s).await, 200);
    assert!(
        s.db.tables()
            .op_stats()
            .flushes
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 2
    );
    let _ = stop.send(());
    maintenance.await.unwrap();
}

#[tokio::test]
async fn long_statements_run_asynchronously_and_can_be_cancelled() {
    let s = Server::start().await;
    let r = s
        .request(reqwest::Method::POST, "/v1/statements")
        .json(&json!({
            "statement": "SELECT count(*) FROM generate_series(1, 100000000000) a JOIN generate_series(1, 10) b ON a.value = b.value",
            "statement_id": "long-one"
        }))
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["status"], "running", "{v}");
    let v: Value = s
        .request(reqwest::Method::POST, "/v1/statements/long-one/cancel")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["status"], "cancelled");
    assert!(v["message"].is_string());
    let v: Value = s
        .request(reqwest::Method::GET, "/v1/statements/long-one")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["status"], "cancelled");
}

#[tokio::test]
async fn time_filters_prune_files_without_losing_rows() {
    let s = Server::start().await;
    s.create_events().await;
    // Three files an hour apart, plus unflushed rows.
    for hour in 0..3 {
        let body: String = (0..10)
            .map(|i| {
                format!("{{\"time\":\"2026-10-23T0{hour}:00:{i:02}Z\",\"service\":\"h{hour}\"}}\n")
            })
            .collect();
        assert_eq!(s.ingest("events", body).await.0, 200);
        s.db.tables().flush_due(true).await.unwrap();
    }
    assert_eq!(
        s.ingest(
            "events",
            "{\"time\":\"2026-10-23T01:30:00Z\",\"service\":\"mem\"}\n"
        )
        .await
        .0,
        200
    );
    let cases = [
        ("time >= '2026-10-23T01:00:00Z'::timestamp", 21),
        ("time < '2026-10-23T01:00:00Z'::timestamp", 10),
        ("time = '2026-10-23T02:00:05Z'::timestamp", 1),
        (
            "time BETWEEN '2026-10-23T01:00:00Z'::timestamp AND '2026-10-23T01:59:59Z'::timestamp",
            11,
        ),
        ("'2026-10-23T02:00:00Z'::timestamp <= time", 10),
        (
            "time > '2026-10-23T05:00:00Z'::timestamp OR service = 'h0'",
            10,
        ),
    ];
    for (filter, want) in cases {
        let v = s
            .sql(&format!("SELECT count(*) FROM events WHERE {filter}"))
            .await;
        assert_eq!(v["result_set"]["rows"][0][0], want.to_string(), "{filter}");
    }
    // The scan of a one-hour range opens one of the three files.
    let v = s
        .sql("EXPLAIN SELECT count(*) FROM events WHERE time >= '2026-10-23T02:00:00Z'::timestamp")
        .await;
    let plan = v["result_set"]["rows"].to_string();
    assert_eq!(plan.matches(".parquet").count(), 1, "{plan}");
}
