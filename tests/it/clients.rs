//! Real, unmodified clients against a real server on loopback: the `scopedb-client` crate and
//! the `scopeql` CLI (installed from PyPI by `tests/run.sh` into `.tools/`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use serde_json::{Value, json};
use sluice::db::{Database, DbConfig};

use crate::common;

use common::events_def;
const KEY: &str = "client-test-key";

async fn start() -> (SocketAddr, Arc<Database>) {
    let dir = common::temp_dir("clients");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let (addr, _task) = common::serve(db.clone(), vec![KEY.to_owned()]).await;
    (addr, db)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopedb_client_crate_appends_reads_the_catalog_and_queries() {
    let (addr, db) = start().await;
    db.mutate_catalog(
        &sluice::catalog::CatalogPath::Table("scopedb".into(), "public".into(), "events".into()),
        Some(events_def()),
        sluice::catalog::MutateOptions::default(),
    )
    .await
    .unwrap();
    let client = scopedb_client::Client::builder(format!("http://{addr}"))
        .api_key(KEY)
        .build()
        .unwrap();

    // Append (the SDK sends zstd bodies and checks num_rows_inserted).
    let table = client
        .table("events")
        .with_database("scopedb")
        .with_schema("public");
    let rows = [
        json!({"time": "2026-10-23T09:00:00Z", "service": "checkout", "name": "payment_failed",
               "message": "Credit card gateway timed out", "var": {"gateway": "credit_card"}}),
        json!({"time": "2026-10-23T09:00:01Z", "service": "search", "name": "request",
               "message": "ok", "var": {}}),
    ];
    let ndjson = rows
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join("\n");
    let result = table.append(ndjson).await.unwrap();
    assert_eq!(result.num_rows_inserted, 2);

    // A bad row is a definite rejection to the SDK (4xx with details.status = rejected).
    let err = table.append("{\"time\": 5}".to_owned()).await.unwrap_err();
    let details = err.append_details().expect("append details");
    assert_eq!(
        details.status,
        scopedb_client::AppendOutcome::Failed,
        "{err:?}"
    );

    // The catalog.
    let catalog = client.catalog().get().await.unwrap();
    assert_eq!(catalog.definition.databases[0].name, "scopedb");
    let schema = client
        .catalog()
        .schema("scopedb", "public")
        .get()
        .await
        .unwrap();
    assert_eq!(schema.definition.tables[0].name, "events");
    // A table's definition read and put back through the SDK (a dry run): both answers
    // parse in its typed, unknown-field-refusing shape.
    let resource = table.catalog();
    let snapshot = resource.get().await.unwrap();
    assert_eq!(snapshot.definition.columns[0].name, "time");
    let preview = resource
        .apply(
            &snapshot.definition,
            scopedb_client::CatalogOptions {
                dry_run: true,
                expected_version: Some(snapshot.version),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(!preview.destructive);
    assert_eq!(preview.after.as_ref(), Some(&snapshot.definition));

    // Statements, both the one-shot query and a submitted handle.
    let result = client
        .query("SELECT service, name FROM scopedb.public.events ORDER BY time")
        .await
        .unwrap();
    let objects = result.into_objects().unwrap();
    assert_eq!(objects.len(), 2);
    assert!(
        format!("{:?}", objects[0]).contains("payment_failed"),
        "{objects:?}"
    );
    let mut handle = client
        .statement("SELECT count(*) AS n FROM events")
        .submit()
        .await
        .unwrap();
    let result = handle.wait().await.unwrap();
    let objects = result.into_objects().unwrap();
    assert!(format!("{objects:?}").contains('2'), "{objects:?}");
}

/// The scopeql binary: `SLUICE_SCOPEQL`, or the one `tests/run.sh` installs.
fn scopeql() -> PathBuf {
    if let Some(p) = std::env::var_os("SLUICE_SCOPEQL") {
        return PathBuf::from(p);
    }
    let installed = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/venv/bin/scopeql");
    assert!(
        installed.exists(),
        "scopeql is not installed: run the tests with `bash tests/run.sh`, which installs it into .tools/"
    );
    installed
}

fn run_scopeql(addr: SocketAddr, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(scopeql())
        .args(args)
        .env(
            "SCOPEQL_CONFIG_CONNECTIONS_DEFAULT_ENDPOINT",
            format!("http://{addr}"),
        )
        .env("SCOPEQL_CONFIG_CONNECTIONS_DEFAULT_AUTH", "api_key")
        .env("SCOPEQL_CONFIG_CONNECTIONS_DEFAULT_API_KEY", KEY)
        .env("HOME", std::env::temp_dir())
        .output()
        .expect("run scopeql");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopeql_cli_runs_ddl_queries_and_loads() {
    let (addr, _db) = start().await;
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        run_scopeql(addr, &["run", "--format", "json", "SELECT 1 AS ok"])
    })
    .await
    .unwrap();
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v, json!([{"ok": 1}]));

    let (ok, _, err) = tokio::task::spawn_blocking(move || {
        run_scopeql(
            addr,
            &[
                "run",
                "CREATE TABLE events (time timestamp, service string, n int, var object)",
            ],
        )
    })
    .await
    .unwrap();
    assert!(ok, "{err}");

    let dir = std::env::temp_dir().join(format!("sluice-scopeql-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rows.json");
    std::fs::write(
        &file,
        "{\"time\":\"2026-10-23T09:00:00Z\",\"service\":\"checkout\",\"n\":1,\"var\":{\"gateway\":\"credit_card\"}}\n{\"time\":\"2026-10-23T09:00:01Z\",\"service\":\"search\",\"n\":2,\"var\":{}}\n",
    )
    .unwrap();
    let path = file.to_str().unwrap().to_owned();
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        run_scopeql(
            addr,
            &[
                "load",
                "--file",
                &path,
                "--format",
                "json",
                "--transform",
                "INSERT INTO events",
            ],
        )
    })
    .await
    .unwrap();
    assert!(ok, "{out}{err}");
    assert!(out.contains("2 rows"), "{out}");

    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        run_scopeql(
            addr,
            &[
                "run",
                "--format",
                "json",
                "SELECT service, n FROM events ORDER BY n",
            ],
        )
    })
    .await
    .unwrap();
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v,
        json!([{"service": "checkout", "n": 1}, {"service": "search", "n": 2}])
    );

    // The table evolves from the CLI too, and a ScopeQL pipeline reads the new shape.
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        run_scopeql(
            addr,
            &[
                "run",
                "ALTER TABLE events ADD COLUMN region string COMMENT 'added later'",
            ],
        )
    })
    .await
    .unwrap();
    assert!(ok, "{out}{err}");
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        run_scopeql(
            addr,
            &[
                "run",
                "--format",
                "json",
                "FROM events WHERE n = 1 SELECT service, region",
            ],
        )
    })
    .await
    .unwrap();
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v, json!([{"service": "checkout", "region": null}]));

    // A failing statement makes scopeql fail with the server's message.
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        run_scopeql(addr, &["run", "SELECT missing_column FROM events"])
    })
    .await
    .unwrap();
    assert!(!ok);
    assert!(
        format!("{out}{err}").contains("missing_column"),
        "{out}{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopeql_cli_runs_the_seed_verification_query() {
    let (addr, _db) = start().await;
    let (ok, _, err) = tokio::task::spawn_blocking(move || {
        run_scopeql(
            addr,
            &["run", "CREATE TABLE scopedb.public.events (time timestamp, service string, name string, message string, var object)"],
        )
    })
    .await
    .unwrap();
    assert!(ok, "{err}");
    let r = reqwest::Client::new()
        .post(format!("http://{addr}/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest"))
        .bearer_auth(KEY)
        .header("content-type", "application/x-ndjson")
        .body("{\"time\":\"2026-10-23T09:00:00Z\",\"service\":\"checkout\",\"name\":\"payment_failed\",\"message\":\"Credit card gateway timed out\",\"var\":{\"region\":\"apac\",\"gateway\":\"credit_card\"}}\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seed = "FROM events\nWHERE time = '2026-10-23T09:00:00Z'::timestamp\n  AND service = 'checkout'\n  AND name = 'payment_failed'\nSELECT time, name, message, var['gateway']::string AS gateway\nLIMIT 10";
    let (ok, out, err) =
        tokio::task::spawn_blocking(move || run_scopeql(addr, &["run", "--format", "json", seed]))
            .await
            .unwrap();
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["name"], "payment_failed", "{out}");
    assert_eq!(v[0]["message"], "Credit card gateway timed out");
    assert_eq!(v[0]["gateway"], "credit_card");
}
