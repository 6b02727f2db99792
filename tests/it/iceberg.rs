//! The Iceberg views of tables (format version 3, and the version-2 compatibility view),
//! read by four independent readers from PyPI through sluice's REST catalog at `/iceberg`
//! (`tests/iceberg/read_table.py`, installed by `tests/run.sh`): pyiceberg, Daft, Polars'
//! `scan_iceberg` and DuckDB 1.4.4 (ATTACH of the catalog), on the local directory and on
//! the S3 server the tests run; snapshot expiry agreeing with garbage collection in both
//! views; files without field ids read through the name mapping; the catalog's keys, roles
//! and prefixes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice::db::{Database, DbConfig};

use super::common;

/// The Python that runs the readers: `SLUICE_PYTHON`, or the one `tests/run.sh` installs.
fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("SLUICE_PYTHON") {
        return PathBuf::from(p);
    }
    let installed = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/venv/bin/python");
    assert!(
        installed.exists(),
        "{} is missing: run the tests with `bash tests/run.sh`, which installs pyiceberg and Daft",
        installed.display()
    );
    installed
}

/// The readers besides pyiceberg that a full read runs (`tests/iceberg/read_table.py`).
const ALL_READERS: &str = "daft,polars,duckdb";

/// Runs the readers (pyiceberg, and `readers`) on `scopedb.public.table` through the catalog
/// at `base`, in the view `warehouse` names (the default view for `None`), and returns what
/// they saw.
pub(super) fn read(
    base: &str,
    key: &str,
    table: &str,
    warehouse: Option<&str>,
    readers: &str,
) -> Value {
    read_filtered(base, key, table, warehouse, readers, None, None)
}

/// [`read`], and with `time_filter` (an instant) the count of rows with `t` at or before it
/// by pyiceberg, Polars and DuckDB, which prune files by the manifests' bounds; with
/// `time_after` (an instant) pyiceberg's count of rows with `t` after it.
fn read_filtered(
    base: &str,
    key: &str,
    table: &str,
    warehouse: Option<&str>,
    readers: &str,
    time_filter: Option<&str>,
    time_after: Option<&str>,
) -> Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/iceberg/read_table.py");
    let mut command = std::process::Command::new(python());
    command
        .arg(script)
        .arg(format!("{base}/iceberg"))
        .arg("scopedb.public")
        .arg(table)
        .args(["--token", key, "--readers", readers]);
    if let Some(warehouse) = warehouse {
        command.args(["--warehouse", warehouse]);
    }
    if let Some(instant) = time_filter {
        command.args(["--time-filter", instant]);
    }
    if let Some(instant) = time_after {
        command.args(["--time-after", instant]);
    }
    if let (Ok(id), Ok(secret)) = (
        std::env::var("AWS_ACCESS_KEY_ID"),
        std::env::var("AWS_SECRET_ACCESS_KEY"),
    ) {
        command.args(["--s3-key", &id, &secret]);
    }
    let out = command.output().expect("python runs");
    assert!(
        out.status.success(),
        "the readers failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the readers print JSON")
}

const ALL_TYPES: &str = r#"{"name": "all_types", "columns": [
    {"name": "i", "data_type": "int"},
    {"name": "u", "data_type": "uint"},
    {"name": "f", "data_type": "float"},
    {"name": "b", "data_type": "boolean"},
    {"name": "s", "data_type": "string"},
    {"name": "t", "data_type": "timestamp"},
    {"name": "d", "data_type": "interval"},
    {"name": "bin", "data_type": "binary"},
    {"name": "o", "data_type": "object"},
    {"name": "a", "data_type": "array"},
    {"name": "x", "data_type": "any"}
]}"#;

/// Row `n` of the all-types table as NDJSON, and as the readers print it (timestamps and
/// intervals as integer nanoseconds, binary as base64, JSON columns as their text).
fn row(n: i64) -> (String, Value) {
    if n % 3 == 2 {
        // Nulls everywhere but the key.
        let line = json!({"i": n, "u": null, "f": null, "b": null, "s": null, "t": null,
            "d": null, "bin": null, "o": null, "a": null, "x": null});
        let mut expected = line.clone();
        expected["i"] = json!(n);
        return (line.to_string(), expected);
    }
    let u: u64 = if n % 2 == 0 {
        i64::MAX as u64
    } else {
        n as u64
    };
    // 2024-01-02T03:04:05.123456789Z plus n seconds and n nanoseconds.
    let t = 1_704_164_645_123_456_789i64 + n * 1_000_000_001;
    let line = json!({
        "i": -n * 1_000_000_000_000,
        "u": u,
        "f": n as f64 / 4.0,
        "b": n % 2 == 0,
        "s": format!("héllo {n} \u{1F600}"),
        "t": format!("2024-01-02T03:04:{:02}.{:09}Z", 5 + n, 123_456_789 + n),
        "d": format!("PT{n}.000000001S"),
        "bin": "AAEC/w==",
        "o": {"k": [n, "v"], "nested": {"z": null}},
        "a": [n, true, "x"],
        "x": if n % 2 == 0 { json!("text") } else { json!(n) },
    });
    let expected = json!({
        "i": -n * 1_000_000_000_000,
        "u": u,
        "f": n as f64 / 4.0,
        "b": n % 2 == 0,
        "s": format!("héllo {n} \u{1F600}"),
        "t": t,
        "d": n * 1_000_000_000 + 1,
        "bin": {"base64": "AAEC/w=="},
        "o": {"k": [n, "v"], "nested": {"z": null}},
        "a": [n, true, "x"],
        "x": if n % 2 == 0 { json!("text") } else { json!(n) },
    });
    (line.to_string(), expected)
}

/// Rows at the extremes of every type, as NDJSON, and as the readers print them: the
/// smallest and largest int, uint, float, timestamp (1677-09-21 and 2262-04-11 in
/// nanoseconds) and interval; a time a nanosecond before 1970 (which the v2 view turns into
/// microseconds); the empty string, binary, object and array; text that needs escaping.
fn extreme_rows() -> Vec<(String, Value)> {
    let rows = [
        (
            json!({"i": i64::MIN, "u": 0, "f": -f64::MAX, "b": false, "s": "",
                "t": "1677-09-21T00:12:43.145224192Z", "d": "-PT9223372036.854775808S",
                "bin": "", "o": {}, "a": [], "x": "\"quoted\"\n\u{0}"}),
            json!({"t": i64::MIN, "d": i64::MIN, "bin": {"base64": ""},
                "x": "\"quoted\"\n\u{0}"}),
        ),
        (
            json!({"i": i64::MAX, "u": i64::MAX, "f": f64::MAX, "b": true,
                "s": "tab\t \"q\" \\ 𝄞", "t": "2262-04-11T23:47:16.854775807Z",
                "d": "PT9223372036.854775807S", "bin": "/w==", "o": {"a": {"b": [null]}},
                "a": [[], {}], "x": -0.5}),
            json!({"t": i64::MAX, "d": i64::MAX, "bin": {"base64": "/w=="}}),
        ),
        (
            json!({"i": 1_000_000, "u": 1, "f": 5e-324, "b": true, "s": "x",
                "t": "1969-12-31T23:59:59.999999999Z", "d": "PT0.000000001S", "bin": "AA==",
                "o": {"k": 1}, "a": [1], "x": {"k": [1, 2]}}),
            json!({"t": -1, "d": 1, "bin": {"base64": "AA=="}}),
        ),
    ];
    rows.into_iter()
        .map(|(line, changed)| {
            let mut expected = line.clone();
            for (k, v) in changed.as_object().unwrap() {
                expected[k] = v.clone();
            }
            (line.to_string(), expected)
        })
        .collect()
}

/// The rows a reader printed (`seen` holds `rows`), JSON columns parsed (their text is the
/// readers' value), ordered by the key.
fn seen_rows(seen: &Value) -> Vec<Value> {
    let mut rows: Vec<Value> = seen["rows"].as_array().expect("rows").clone();
    for r in &mut rows {
        for column in ["o", "a", "x"] {
            if let Some(text) = r[column].as_str() {
                r[column] = serde_json::from_str(text).expect("JSON text");
            }
        }
    }
    rows.sort_by_key(|r| r["i"].as_i64());
    rows
}

/// The rows as a reader of the v2 view gets them from `expected` (the v3 view's): timestamps
/// in microseconds, the nanoseconds dropped toward zero (pyiceberg, Daft, DuckDB) or, with
/// `floor`, toward the past (Polars): the two differ by a microsecond for times before 1970
/// that are not whole microseconds.
fn in_microseconds(expected: &[Value], floor: bool) -> Vec<Value> {
    expected
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if let Some(t) = r["t"].as_i64() {
                r["t"] = json!(if floor {
                    t.div_euclid(1_000)
                } else {
                    t / 1_000
                });
            }
            r
        })
        .collect()
}

/// Checks what every reader saw of the all-types table in one view (`warehouse`: `None` for
/// the default, v3, or `"v2"`) against `expected` (as the v3 view gives it), and returns one
/// line for each reader saying what it returned.
fn check_readers(seen: &Value, warehouse: Option<&str>, expected: &[Value]) -> Vec<String> {
    let v2 = warehouse == Some("v2");
    let unit = if v2 { "us" } else { "ns" };
    let want_of = |floor: bool| {
        if v2 {
            in_microseconds(expected, floor)
        } else {
            expected.to_vec()
        }
    };
    let want = want_of(false);
    let view = if v2 { "v2" } else { "v3" };
    assert_eq!(seen["format_version"], if v2 { 2 } else { 3 });
    assert!(
        seen["metadata_location"].as_str().unwrap().contains(if v2 {
            "/metadata-v2/v"
        } else {
            "/metadata/v"
        }),
        "{}",
        seen["metadata_location"]
    );
    let time = if v2 { "timestamptz" } else { "timestamptz_ns" };
    assert_eq!(
        seen["iceberg_types"],
        json!({"i": "long", "u": "long", "f": "double", "b": "boolean", "s": "string",
            "t": time, "d": "long", "bin": "binary", "o": "string", "a": "string",
            "x": "string"})
    );
    // Files written since uints are plain INT64 give pyiceberg `int64` (as `long` says).
    assert_eq!(
        seen["arrow_types"],
        json!({"i": "int64", "u": "int64", "f": "double", "b": "bool", "s": "string",
            "t": format!("timestamp[{unit}, tz=UTC]"), "d": "int64", "bin": "binary",
            "o": "string", "a": "string", "x": "string"})
    );
    let mut lines = Vec::new();
    assert_eq!(
        seen_rows(seen),
        want,
        "pyiceberg reads the {view} view's rows"
    );
    lines.push(format!(
        "{view}: pyiceberg: {} rows as ingested, t {}",
        want.len(),
        seen["arrow_types"]["t"]
    ));
    for reader in ["daft", "polars", "duckdb"] {
        let got = &seen["readers"][reader];
        if reader == "duckdb" && !v2 {
            // DuckDB 1.4.4 does not know the v3 types: the reason the v2 view exists.
            let error = got["error"].as_str().unwrap_or_default();
            assert!(error.contains("timestamptz_ns"), "{got}");
            lines.push(format!("{view}: duckdb: refused: {error}"));
            continue;
        }
        assert!(got.get("error").is_none(), "{reader} on {view}: {got}");
        let t_type = got["types"]["t"].as_str().unwrap_or_default();
        assert!(
            t_type.starts_with(&format!("timestamp[{unit}")),
            "{reader} on {view}: t is {t_type}"
        );
        let mut rows = seen_rows(got);
        let mut want = want_of(reader == "polars");
        if reader == "duckdb" {
            // DuckDB takes a timestamp of i64::MAX nanoseconds (2262-04-11T23:47:16.854775807Z)
            // for its `infinity`, and hands that over as i64::MAX microseconds.
            for (r, w) in rows.iter_mut().zip(&mut want) {
                if r["i"] == json!(i64::MAX) {
                    assert_eq!(r["t"], json!(i64::MAX), "duckdb's infinity");
                    r["t"] = w["t"].clone();
                }
            }
        }
        // Readers hand binary and text over in their own Arrow types; the values compare.
        assert_eq!(rows, want, "{reader} reads the {view} view's rows");
        lines.push(format!(
            "{view}: {reader}: {} rows as ingested, t {t_type}",
            rows.len()
        ));
    }
    lines
}

struct Served {
    db: Arc<Database>,
    base: String,
    client: reqwest::Client,
}

impl Served {
    async fn start(config: DbConfig) -> Served {
        let db = Database::open(config).await.unwrap();
        let keys = vec!["read=r-key".to_owned(), "a-key".into()];
        let (addr, _task) = common::serve(db.clone(), keys).await;
        Served {
            db,
            base: format!("http://{addr}"),
            client: reqwest::Client::new(),
        }
    }

    async fn create(&self, def: &str) -> String {
        let def: Value = serde_json::from_str(def).unwrap();
        let name = def["name"].as_str().unwrap().to_owned();
        let r = self
            .client
            .put(format!(
                "{}/v1/catalog/databases/scopedb/schemas/public/tables/{name}",
                self.base
            ))
            .bearer_auth("a-key")
            .json(&def)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        self.db
            .catalog()
            .table("scopedb", "public", &name)
            .await
            .unwrap()
            .id
    }

    /// Creates the table `def` defines, ingests `rows` (NDJSON) and flushes them into a
    /// file; returns the table's storage id.
    async fn create_with_file(&self, def: &str, rows: &str) -> String {
        let id = self.create(def).await;
        let name = serde_json::from_str::<Value>(def).unwrap()["name"]
            .as_str()
            .unwrap()
            .to_owned();
        self.ingest(&name, rows.to_owned()).await;
        self.db.tables().flush(&id).await.unwrap().unwrap();
        id
    }

    async fn ingest(&self, table: &str, body: String) {
        let r = self
            .client
            .post(format!(
                "{}/v1/catalog/databases/scopedb/schemas/public/tables/{table}/ingest",
                self.base
            ))
            .bearer_auth("a-key")
            .header("content-type", "application/x-ndjson")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    }

    /// The table's live files, as the readers name them (URIs end with the object path).
    async fn live_files(&self, table: &str) -> BTreeSet<String> {
        let stats = self
            .db
            .table_stats("scopedb", "public", table)
            .await
            .unwrap();
        assert_eq!(stats.unflushed_rows, 0);
        let r: Value = self
            .client
            .get(format!(
                "{}/v1/catalog/databases/scopedb/schemas/public/tables/{table}/stats?files=true",
                self.base
            ))
            .bearer_auth("r-key")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        r["file_list"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["path"].as_str().unwrap().to_owned())
            .collect()
    }
}

/// The readers' file URIs match the table's live files (relative object paths) one to one.
fn assert_files(seen: &Value, live: &BTreeSet<String>, location: &str) {
    let seen: BTreeSet<String> = seen["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_owned())
        .collect();
    let expected: BTreeSet<String> = live.iter().map(|p| format!("{location}/{p}")).collect();
    assert_eq!(
        seen, expected,
        "the current snapshot lists exactly the live files"
    );
}

async fn every_type_reads_back_before_and_after_compaction(
    mut config: DbConfig,
    location: impl Fn(&Path) -> String,
    storage: &str,
) {
    config.tables.compact_min_files = 2;
    let data_dir = config.data_dir.clone();
    let served = Served::start(config).await;
    let location = location(&data_dir);
    let id = served.create(ALL_TYPES).await;
    let mut expected = Vec::new();
    let mut counts = Vec::new();
    // Each file's range of `t` (nanoseconds), as the manifests' bounds must hold it.
    let mut file_ranges = Vec::new();
    for batch in 0..3 {
        let mut body = String::new();
        let mut batch_rows = Vec::new();
        for n in batch * 4..batch * 4 + 4 {
            batch_rows.push(row(n));
        }
        // The extremes in the last file: the first two hold only times of 2024, so a
        // filter on times prunes them by their bounds.
        if batch == 2 {
            batch_rows.extend(extreme_rows());
        }
        for (line, value) in batch_rows {
            body.push_str(&line);
            body.push('\n');
            expected.push(value);
        }
        file_ranges.push(time_range(&expected[counts.last().copied().unwrap_or(0)..]));
        served.ingest("all_types", body).await;
        assert!(served.db.tables().flush(&id).await.unwrap().is_some());
        counts.push(expected.len());
    }
    expected.sort_by_key(|r| r["i"].as_i64());
    let mut report = Vec::new();

    let old = served.live_files("all_types").await;
    // Rows at or before 2024-01-02T03:04:07.5Z: rows 0 and 1, and the two extremes before
    // 1970, whichever way a reader turns nanoseconds into microseconds. Bounds of the wrong
    // unit (or rounded the wrong way) would prune the first file and lose rows 0 and 1.
    let instant = "2024-01-02T03:04:07.500000+00:00";
    let until = expected
        .iter()
        .filter(|r| {
            r["t"]
                .as_i64()
                .is_some_and(|t| t <= 1_704_164_647_500_000_000)
        })
        .count();
    assert_eq!(until, 4);
    // Row 3, the last of the first file, is at 2024-01-02T03:04:08.123456792Z: in the v2
    // view 08.123456. pyiceberg compares a filter's microseconds with the files' own
    // nanoseconds, so it finds row 3 after 08.123456; an upper bound of the first file
    // rounded down to 08.123456 would prune that file and lose the row.
    let after_instant = "2024-01-02T03:04:08.123456+00:00";
    let after_ns = 1_704_164_648_123_456_000i64;
    let after_count = expected
        .iter()
        .filter(|r| r["t"].as_i64().is_some_and(|t| t > after_ns))
        .count();
    let mut snapshots_of_views = Vec::new();
    for warehouse in [None, Some("v2")] {
        let v2 = warehouse == Some("v2");
        let before = read_filtered(
            &served.base,
            "r-key",
            "all_types",
            warehouse,
            ALL_READERS,
            Some(instant),
            v2.then_some(after_instant),
        );
        for line in check_readers(&before, warehouse, &expected) {
            report.push(format!("{storage} before compaction: {line}"));
        }
        check_filters(&before, v2, until, after_count);
        report.push(format!(
            "{storage} before compaction: {}",
            filter_report(v2, until, instant, after_count, after_instant)
        ));
        assert_eq!(before["t_bounds"], time_bounds(&file_ranges, v2));
        snapshots_of_views.push(before["snapshots"].clone());
        assert_eq!(before["snapshots"], json!([1, 2, 3]));
        assert_eq!(
            before["snapshot_rows"],
            json!({"1": counts[0], "2": counts[1], "3": counts[2]})
        );
        // Both views list the same data files.
        assert_files(&before, &old, &location);
        assert_eq!(before["namespaces"], json!([["scopedb"]]));
        assert_eq!(before["child_namespaces"], json!([["scopedb", "public"]]));
        assert_eq!(
            before["tables"],
            json!([["scopedb", "public", "all_types"]])
        );
    }

    assert!(served.db.tables().compact(&id).await.unwrap().is_some());
    let live = served.live_files("all_types").await;
    assert_eq!(live.len(), 1);
    assert!(live.is_disjoint(&old));
    // Both views list the same snapshots, in the same order.
    assert_eq!(snapshots_of_views[0], snapshots_of_views[1]);
    snapshots_of_views.clear();
    for warehouse in [None, Some("v2")] {
        let v2 = warehouse == Some("v2");
        let after = read_filtered(
            &served.base,
            "r-key",
            "all_types",
            warehouse,
            ALL_READERS,
            Some(instant),
            v2.then_some(after_instant),
        );
        for line in check_readers(&after, warehouse, &expected) {
            report.push(format!("{storage} after compaction: {line}"));
        }
        check_filters(&after, v2, until, after_count);
        // The compacted file's bounds cover every row.
        assert_eq!(after["t_bounds"], time_bounds(&[time_range(&expected)], v2));
        snapshots_of_views.push(after["snapshots"].clone());
        assert_files(&after, &live, &location);
        assert_eq!(after["snapshots"], json!([1, 2, 3, 4]));
        // The snapshots before compaction still read, from the files compaction replaced.
        assert_eq!(
            after["snapshot_rows"],
            json!({"1": counts[0], "2": counts[1], "3": counts[2], "4": counts[2]})
        );
    }
    assert_eq!(snapshots_of_views[0], snapshots_of_views[1]);
    for line in report {
        println!("iceberg readers: {line}");
    }
}

/// Checks the filtered counts of a read of the all-types table (see
/// [`every_type_reads_back_before_and_after_compaction`]): `until` rows at or before the
/// first instant for every reader of the v2 view, `after` rows after the second for
/// pyiceberg; in v3, where pyiceberg 0.12 binds no literal to a `timestamptz_ns` (and Polars
/// hands its filter to pyiceberg), the refusal.
fn check_filters(seen: &Value, v2: bool, until: usize, after: usize) {
    let polars = &seen["readers"]["polars"]["filtered_count"];
    if v2 {
        assert_eq!(seen["filtered_count"], until, "pyiceberg");
        assert_eq!(*polars, until, "polars: {polars}");
        assert_eq!(seen["readers"]["duckdb"]["filtered_count"], until, "duckdb");
        assert_eq!(seen["after_count"], after, "pyiceberg, after");
    } else {
        for refusal in [&seen["filtered_count"], polars] {
            let error = refusal["error"].as_str().unwrap_or_default();
            assert!(error.contains("timestamptz_ns"), "{refusal}");
        }
    }
}

/// The line of the test's report on [`check_filters`].
fn filter_report(v2: bool, until: usize, instant: &str, after: usize, after_at: &str) -> String {
    if v2 {
        format!(
            "v2: pyiceberg, polars and duckdb: {until} rows at or before {instant}; \
             pyiceberg: {after} rows after {after_at}"
        )
    } else {
        "v3: pyiceberg and polars refuse a time filter (no timestamptz_ns literals)".into()
    }
}

/// The smallest and largest `t` (nanoseconds) of `rows`.
fn time_range(rows: &[Value]) -> (i64, i64) {
    let times = rows.iter().filter_map(|r| r["t"].as_i64());
    let lo = times.clone().min().expect("a time");
    (lo, times.max().expect("a time"))
}

/// The bounds of `t` a reader must see in the manifests of files holding the times
/// `ranges`, ordered as `read_table.py` prints them: nanoseconds in v3; in v2 microseconds,
/// the lower floored and the upper rounded up, so that they hold every value a reader makes
/// of the nanoseconds, whether it floors or truncates, and no microsecond filter prunes a
/// file holding a row in its last partial microsecond.
fn time_bounds(ranges: &[(i64, i64)], v2: bool) -> Value {
    let mut bounds: Vec<(i64, i64)> = ranges
        .iter()
        .map(|&(lo, hi)| {
            if v2 {
                (
                    lo.div_euclid(1_000),
                    hi.div_euclid(1_000) + i64::from(hi.rem_euclid(1_000) != 0),
                )
            } else {
                (lo, hi)
            }
        })
        .collect();
    bounds.sort();
    json!(
        bounds
            .iter()
            .map(|&(lo, hi)| json!([lo, hi]))
            .collect::<Vec<_>>()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_readers_read_every_type_in_both_views_from_the_local_directory() {
    let dir = common::temp_dir("iceberg-local");
    every_type_reads_back_before_and_after_compaction(
        DbConfig::new(&dir),
        |dir| {
            let objects = std::fs::canonicalize(dir.join("objects")).unwrap();
            format!("file://{}", objects.display())
        },
        "local",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_readers_read_every_type_in_both_views_from_s3() {
    let base = std::env::var("SLUICE_TEST_S3_URL").expect(
        "SLUICE_TEST_S3_URL is not set: run the tests with `bash tests/run.sh`, which starts \
         a SeaweedFS S3 server",
    );
    let url = format!("{base}/iceberg-{}", std::process::id());
    let mut config = DbConfig::new(common::temp_dir("iceberg-s3"));
    config.object_store = Some(url.clone());
    every_type_reads_back_before_and_after_compaction(config, move |_| url.clone(), "s3").await;
}

/// The Python blocks of the README's Iceberg section, in order: the pyiceberg (Daft,
/// Polars) recipe and the DuckDB one.
fn readme_recipes() -> Vec<String> {
    let readme = include_str!("../../README.md");
    let start = readme
        .find("## Iceberg view")
        .expect("the README's Iceberg section");
    let section = &readme[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    section
        .split("```python\n")
        .skip(1)
        .filter_map(|block| block.split("\n```").next())
        .map(str::to_owned)
        .collect()
}

/// Runs a README recipe as written, its placeholders filled in: sluice's address and a read
/// key, and for S3 (`s3` holds the key id, the secret and the endpoint's host and port) the
/// bucket's credentials; without S3 the lines for S3 are left out. `check` is appended, and
/// what it prints is the answer.
fn run_recipe(recipe: &str, base: &str, s3: Option<(&str, &str, &str)>, check: &str) -> String {
    let host = base.trim_start_matches("http://");
    let mut code = String::new();
    for line in recipe.lines() {
        let mut line = line
            .replace("HOST:6543", host)
            .replace("'KEY'", "'r-key'")
            .replace("\"KEY\"", "\"r-key\"");
        match s3 {
            Some((id, secret, endpoint)) => {
                line = line
                    .replacen('…', id, 1)
                    .replacen('…', secret, 1)
                    .replace("S3HOST:PORT", endpoint);
            }
            None if line.contains('…') => continue,
            None => {}
        }
        code.push_str(&line);
        code.push('\n');
    }
    code.push_str(check);
    let out = std::process::Command::new(python())
        .args(["-c", &code])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "the recipe failed: {}\n{code}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout.lines().last().unwrap_or_default().trim().to_owned()
}

/// The README's recipes, run as written against a served table: pyiceberg, Daft and
/// Polars in both views, DuckDB (ATTACH of the catalog with the key) in the v2 view.
async fn the_readme_recipes_read_a_table(config: DbConfig, s3: Option<(&str, &str, &str)>) {
    let served = Served::start(config).await;
    served
        .create_with_file(
            r#"{"name": "events", "columns": [{"name": "time", "data_type": "timestamp"},
                {"name": "n", "data_type": "uint"}]}"#,
            "{\"time\":\"2026-01-01T00:00:00.000000001Z\",\"n\":1}\n{\"n\":2}\n{\"time\":\"1969-12-31T23:59:59.999999999Z\",\"n\":3}\n",
        )
        .await;
    let recipes = readme_recipes();
    assert_eq!(recipes.len(), 2, "{recipes:?}");
    let (python_readers, duckdb) = (&recipes[0], &recipes[1]);
    assert!(python_readers.contains("warehouse=\"v2\""));
    let counts = "print(rows.num_rows, df.count_rows(), lf.height, sorted(rows['n'].to_pylist()))";
    for view in ["v2", "v3"] {
        let recipe = python_readers.replace("warehouse=\"v2\"", &format!("warehouse=\"{view}\""));
        let answer = run_recipe(&recipe, &served.base, s3, counts);
        assert_eq!(answer, "3 3 3 [1, 2, 3]", "{view}");
    }
    let count = "print(con.sql('SELECT count(*), sum(n) FROM sluice.\"scopedb.public\".events').fetchall())";
    assert_eq!(run_recipe(duckdb, &served.base, s3, count), "[(3, 6)]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_recipes_read_a_table_in_the_local_directory() {
    let dir = common::temp_dir("iceberg-readme");
    the_readme_recipes_read_a_table(DbConfig::new(&dir), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_recipes_read_a_table_on_s3() {
    let base = std::env::var("SLUICE_TEST_S3_URL").expect(
        "SLUICE_TEST_S3_URL is not set: run the tests with `bash tests/run.sh`, which starts \
         a SeaweedFS S3 server",
    );
    let mut config = DbConfig::new(common::temp_dir("iceberg-readme-s3"));
    config.object_store = Some(format!("{base}/iceberg-readme-{}", std::process::id()));
    let id = std::env::var("AWS_ACCESS_KEY_ID").expect("AWS_ACCESS_KEY_ID");
    let secret = std::env::var("AWS_SECRET_ACCESS_KEY").expect("AWS_SECRET_ACCESS_KEY");
    let endpoint = std::env::var("AWS_ENDPOINT").expect("AWS_ENDPOINT");
    let endpoint = endpoint.trim_start_matches("http://");
    the_readme_recipes_read_a_table(config, Some((&id, &secret, endpoint))).await;
}

/// The newest metadata of a table in a local data directory: its snapshot ids.
fn listed_snapshots(metadata_dir: &Path) -> Vec<u64> {
    let metadata: Value =
        serde_json::from_slice(&std::fs::read(newest_metadata(metadata_dir)).unwrap()).unwrap();
    metadata["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshot-id"].as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_collection_never_deletes_a_file_a_listed_snapshot_reads() {
    let dir = common::temp_dir("iceberg-gc");
    let grace = Duration::from_secs(4);
    let mut config = DbConfig::new(&dir);
    config.gc_grace = grace;
    config.tables.compact_min_files = 2;
    let served = Served::start(config).await;
    let id = served
        .create(r#"{"name": "g", "columns": [{"name": "i", "data_type": "int"}]}"#)
        .await;
    let mut files_at = Vec::new();
    for n in 0..2 {
        served.ingest("g", format!("{{\"i\":{n}}}\n")).await;
        served.db.tables().flush(&id).await.unwrap();
        files_at.push(served.live_files("g").await);
    }
    served.db.tables().compact(&id).await.unwrap().unwrap();
    files_at.push(served.live_files("g").await);
    let objects = dir.join("objects");
    // Both views: v3's and v2's metadata.
    let metadata_dirs =
        ["metadata", "metadata-v2"].map(|d| objects.join(format!("tables/{id}/{d}")));
    for dir in &metadata_dirs {
        assert_eq!(listed_snapshots(dir), [1, 2, 3]);
    }
    // Both views list the same snapshots (ids, times and order) after compaction.
    let same_snapshots = || {
        let [v3, v2] = metadata_dirs.each_ref().map(|d| listed_snapshot_times(d));
        assert_eq!(v3, v2, "the two views list different snapshots");
        v3
    };
    assert_eq!(same_snapshots().len(), 3);
    let compacted_away: Vec<PathBuf> = files_at[1].iter().map(|p| objects.join(p)).collect();

    // Collect repeatedly through and past the grace period: whatever the newest metadata of
    // either view lists, the files of those snapshots exist.
    let started = Instant::now();
    let mut expired_at = [None, None];
    let mut deleted_at = None;
    while started.elapsed() < grace * 4 && deleted_at.is_none() {
        served.db.collect_garbage().await;
        // And through expiry.
        same_snapshots();
        for (view, dir) in metadata_dirs.iter().enumerate() {
            let listed = listed_snapshots(dir);
            for snapshot in &listed {
                for path in &files_at[usize::try_from(*snapshot).unwrap() - 1] {
                    assert!(
                        objects.join(path).exists(),
                        "snapshot {snapshot} is listed in {} but its file {path} is gone",
                        dir.display()
                    );
                }
            }
            if listed == [3] && expired_at[view].is_none() {
                expired_at[view] = Some(started.elapsed());
            }
        }
        if compacted_away.iter().all(|p| !p.exists()) {
            deleted_at = Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let deleted_at = deleted_at.expect("the compacted files are collected");
    assert!(deleted_at >= grace, "{deleted_at:?}");
    for expired_at in expired_at {
        let expired_at = expired_at.expect("snapshots 1 and 2 expire in both views");
        assert!(
            expired_at >= grace / 2 - Duration::from_millis(500),
            "{expired_at:?}"
        );
        assert!(expired_at < deleted_at);
    }
    // The expired snapshots' manifest lists go too, after their own grace period, in both.
    let snap = |dir: &Path, v: u64| {
        std::fs::read_dir(dir).unwrap().any(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.starts_with(&format!("snap-{v:020}-"))
        })
    };
    let until = Instant::now() + grace * 2;
    while metadata_dirs.iter().any(|d| snap(d, 1)) && Instant::now() < until {
        served.db.collect_garbage().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for dir in &metadata_dirs {
        assert!(!snap(dir, 1), "{}", dir.display());
        assert!(snap(dir, 3), "{}", dir.display());
    }
    assert_eq!(
        same_snapshots().iter().map(|s| s.0).collect::<Vec<_>>(),
        [3]
    );
}

/// The newest metadata of a table in a local data directory: its snapshots' ids and times,
/// in the order listed.
fn listed_snapshot_times(metadata_dir: &Path) -> Vec<(u64, u64)> {
    let metadata: Value =
        serde_json::from_slice(&std::fs::read(newest_metadata(metadata_dir)).unwrap()).unwrap();
    metadata["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["snapshot-id"].as_u64().unwrap(),
                s["timestamp-ms"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Loads `table` through the REST catalog under `prefix` (`"v2"`, `"v3"`): the status and
/// the answer.
async fn load_view(served: &Served, prefix: &str, table: &str) -> (u16, Value) {
    let r = served
        .client
        .get(format!(
            "{}/iceberg/v1/{prefix}/namespaces/scopedb%1Fpublic/tables/{table}",
            served.base
        ))
        .bearer_auth("r-key")
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_metadata_names_are_left_alone_and_one_view_never_blocks_the_other() {
    let dir = common::temp_dir("iceberg-foreign");
    let grace = Duration::from_secs(2);
    let mut config = DbConfig::new(&dir);
    config.gc_grace = grace;
    let served = Served::start(config).await;
    let id = served
        .create(r#"{"name": "f", "columns": [{"name": "i", "data_type": "int"}]}"#)
        .await;
    served.ingest("f", "{\"i\":1}\n".into()).await;
    served.db.tables().flush(&id).await.unwrap().unwrap();
    let objects = dir.join("objects");
    let v2_dir = objects.join(format!("tables/{id}/metadata-v2"));
    let first = newest_metadata(&v2_dir);

    // Names with numbers at or past the largest sluice writes (another program's, or
    // damage), holding metadata that looks like sluice's: not sluice's, so never the newest
    // and never collected.
    let foreign: Vec<PathBuf> = [1u64 << 32, (1 << 32) + 1, u64::MAX]
        .iter()
        .map(|n| v2_dir.join(format!("v{n}.metadata.json")))
        .collect();
    for path in &foreign {
        std::fs::copy(&first, path).unwrap();
    }
    for n in 2..=3 {
        served.ingest("f", format!("{{\"i\":{n}}}\n")).await;
        served.db.tables().flush(&id).await.unwrap().unwrap();
        for prefix in ["v3", "v2"] {
            let (status, answer) = load_view(&served, prefix, "f").await;
            assert_eq!(status, 200, "{prefix}: {answer}");
            assert_eq!(answer["metadata"]["current-snapshot-id"], n, "{prefix}");
        }
    }
    for warehouse in [None, Some("v2")] {
        let seen = read(&served.base, "r-key", "f", warehouse, "");
        assert_eq!(seen["rows"], json!([{"i": 1}, {"i": 2}, {"i": 3}]));
    }
    // Collection goes on for both views: replaced metadata goes after the grace period,
    // the foreign files stay.
    let until = Instant::now() + grace * 4;
    while first.exists() && Instant::now() < until {
        served.db.collect_garbage().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!first.exists(), "replaced v2 metadata is collected");
    for path in &foreign {
        assert!(path.exists(), "{} was deleted", path.display());
    }

    // A view whose numbers are used up (a name at the last number): its publication fails,
    // and the other view goes on.
    std::fs::copy(
        newest_metadata(&v2_dir),
        v2_dir.join(format!("v{}.metadata.json", (1u64 << 32) - 1)),
    )
    .unwrap();
    served.ingest("f", "{\"i\":4}\n".into()).await;
    served.db.tables().flush(&id).await.unwrap().unwrap();
    let (status, answer) = load_view(&served, "v3", "f").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["metadata"]["current-snapshot-id"], 4);
    let (status, answer) = load_view(&served, "v2", "f").await;
    assert_eq!(status, 500, "{answer}");
    // Collection still collects the healthy view's replaced metadata.
    let v3_dir = objects.join(format!("tables/{id}/metadata"));
    let v3_old = newest_metadata(&v3_dir);
    served.ingest("f", "{\"i\":5}\n".into()).await;
    served.db.tables().flush(&id).await.unwrap().unwrap();
    let seen = read(&served.base, "r-key", "f", None, "");
    assert_eq!(
        seen["rows"],
        json!([{"i": 1}, {"i": 2}, {"i": 3}, {"i": 4}, {"i": 5}])
    );
    let until = Instant::now() + grace * 4;
    while v3_old.exists() && Instant::now() < until {
        served.db.collect_garbage().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !v3_old.exists(),
        "the v3 view's replaced metadata is collected"
    );
}

/// Whether any column of the Parquet file at `path` carries an unsigned integer annotation.
fn has_unsigned_columns(path: &Path) -> bool {
    use parquet::basic::{ConvertedType, LogicalType};
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let reader = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    schema.columns().iter().any(|c| {
        matches!(c.logical_type_ref(), Some(LogicalType::Integer(int)) if !int.is_signed)
            || c.converted_type() == ConvertedType::UINT_64
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_rewrites_files_with_unsigned_columns() {
    use parquet::arrow::ArrowWriter;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    let dir = common::temp_dir("iceberg-unsigned");
    let mut config = DbConfig::new(&dir);
    config.tables.compact_min_files = 2;
    // Rows in full row groups: compaction would splice the files as they are.
    config.tables.row_group_rows = 2;
    let served = Served::start(config).await;
    let id = served
        .create(r#"{"name": "w", "columns": [{"name": "i", "data_type": "int"}, {"name": "u", "data_type": "uint"}]}"#)
        .await;
    let objects = dir.join("objects");
    for batch in 0..2i64 {
        let body: String = (batch * 4..batch * 4 + 4)
            .map(|n| format!("{{\"i\":{n},\"u\":{}}}\n", i64::MAX - n))
            .collect();
        served.ingest("w", body).await;
        served.db.tables().flush(&id).await.unwrap().unwrap();
    }
    // Rewrite both files as sluice wrote them before uints were plain INT64: `u` as
    // Arrow's UInt64, which Parquet annotates as unsigned.
    for file in served.live_files("w").await {
        let path = objects.join(file);
        let bytes = bytes::Bytes::from(std::fs::read(&path).unwrap());
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
            .unwrap()
            .build()
            .unwrap();
        let batches: Vec<_> = reader.map(Result::unwrap).collect();
        let old = batches[0].schema();
        let schema = Arc::new(arrow_schema::Schema::new_with_metadata(
            old.fields()
                .iter()
                .map(|f| match f.name().as_str() {
                    "u" => f
                        .as_ref()
                        .clone()
                        .with_data_type(arrow_schema::DataType::UInt64),
                    _ => f.as_ref().clone(),
                })
                .collect::<Vec<_>>(),
            old.metadata().clone(),
        ));
        let props = parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(2))
            .build();
        let mut out = Vec::new();
        let mut writer = ArrowWriter::try_new(&mut out, schema.clone(), Some(props)).unwrap();
        for b in batches {
            let columns: Vec<_> = b
                .columns()
                .iter()
                .zip(schema.fields())
                .map(|(c, f)| arrow_cast::cast(c, f.data_type()).unwrap())
                .collect();
            writer
                .write(&arrow_array::RecordBatch::try_new(schema.clone(), columns).unwrap())
                .unwrap();
        }
        writer.close().unwrap();
        std::fs::write(&path, &out).unwrap();
        assert!(has_unsigned_columns(&path));
    }
    let rows: Vec<Value> = (0..8i64)
        .map(|n| json!({"i": n, "u": i64::MAX - n}))
        .collect();
    let before = read(&served.base, "r-key", "w", Some("v2"), "polars");
    let refused = before["readers"]["polars"]["error"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(!refused.is_empty(), "Polars reads unsigned files: {before}");
    println!("iceberg unsigned: polars before compaction: {refused}");

    served.db.tables().compact(&id).await.unwrap().unwrap();
    let live = served.live_files("w").await;
    assert_eq!(live.len(), 1);
    let compacted = objects.join(live.first().unwrap());
    assert!(
        !has_unsigned_columns(&compacted),
        "the compacted file keeps the unsigned annotation"
    );
    for warehouse in [None, Some("v2")] {
        let seen = read(&served.base, "r-key", "w", warehouse, "polars");
        assert_eq!(seen_rows(&seen), rows, "pyiceberg");
        let polars = &seen["readers"]["polars"];
        assert!(polars.get("error").is_none(), "{polars}");
        assert_eq!(seen_rows(polars), rows, "polars");
    }
}

/// Loads a table through the REST catalog; returns the answer.
async fn load(served: &Served, table: &str) -> Value {
    let r = served
        .client
        .get(format!(
            "{}/iceberg/v1/namespaces/scopedb%1Fpublic/tables/{table}",
            served.base
        ))
        .bearer_auth("r-key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_is_rebuilt_when_lost_and_when_the_data_directory_moves() {
    let dir = common::temp_dir("iceberg-moved");
    let served = Served::start(DbConfig::new(&dir)).await;
    let id = served
        .create(r#"{"name": "r", "columns": [{"name": "i", "data_type": "int"}]}"#)
        .await;
    for n in 0..2 {
        served.ingest("r", format!("{{\"i\":{n}}}\n")).await;
        served.db.tables().flush(&id).await.unwrap().unwrap();
    }
    let first = load(&served, "r").await;
    assert_eq!(first["metadata"]["current-snapshot-id"], 2);
    served.db.shutdown().await.unwrap();
    drop(served);

    // The whole data directory moves: the view names the new place, with new Avro objects.
    let moved = common::temp_dir("iceberg-moved-to");
    std::fs::rename(&dir, &moved).unwrap();
    let served = Served::start(DbConfig::new(&moved)).await;
    let objects = std::fs::canonicalize(moved.join("objects")).unwrap();
    let answer = load(&served, "r").await;
    let location = answer["metadata-location"].as_str().unwrap();
    assert!(
        location.starts_with(&format!("file://{}/", objects.display())),
        "{location}"
    );
    assert_eq!(answer["metadata"]["current-snapshot-id"], 2);
    let seen = read(&served.base, "r-key", "r", None, "");
    assert_eq!(seen["rows"], json!([{"i": 0}, {"i": 1}]));

    // All of it lost: garbage collection's pass (which also runs at start) writes it again
    // from the manifest, and so does a load.
    let metadata = objects.join(format!("tables/{id}/metadata"));
    std::fs::remove_dir_all(&metadata).unwrap();
    served.db.collect_garbage().await;
    assert_eq!(listed_snapshots(&metadata), [2]);
    std::fs::remove_dir_all(&metadata).unwrap();
    let answer = load(&served, "r").await;
    assert_eq!(answer["metadata"]["current-snapshot-id"], 2);
    let seen = read(&served.base, "r-key", "r", None, "");
    assert_eq!(seen["rows"], json!([{"i": 0}, {"i": 1}]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_without_field_ids_are_read_through_the_name_mapping() {
    use parquet::arrow::ArrowWriter;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    let dir = common::temp_dir("iceberg-mapping");
    let served = Served::start(DbConfig::new(&dir)).await;
    served
        .create_with_file(
            r#"{"name": "m", "columns": [{"name": "i", "data_type": "int"},
                {"name": "s", "data_type": "string"}, {"name": "t", "data_type": "timestamp"}]}"#,
            "{\"i\":1,\"s\":\"a\",\"t\":\"2026-01-01T00:00:00.000000001Z\"}\n{\"i\":2,\"s\":null,\"t\":null}\n",
        )
        .await;
    // Rewrite the file as sluice wrote files before the Iceberg view: no field ids.
    let path = dir
        .join("objects")
        .join(served.live_files("m").await.pop_first().unwrap());
    let bytes = bytes::Bytes::from(std::fs::read(&path).unwrap());
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
        .unwrap()
        .build()
        .unwrap();
    let batches: Vec<_> = reader.map(Result::unwrap).collect();
    let schema = Arc::new(arrow_schema::Schema::new(
        batches[0]
            .schema()
            .fields()
            .iter()
            .map(|f| {
                let mut metadata = f.metadata().clone();
                metadata.remove("PARQUET:field_id");
                f.as_ref().clone().with_metadata(metadata)
            })
            .collect::<Vec<_>>(),
    ));
    let mut out = Vec::new();
    let mut writer = ArrowWriter::try_new(&mut out, schema.clone(), None).unwrap();
    for b in batches {
        writer
            .write(
                &arrow_array::RecordBatch::try_new(schema.clone(), b.columns().to_vec()).unwrap(),
            )
            .unwrap();
    }
    writer.close().unwrap();
    assert!(!String::from_utf8_lossy(&out).contains("field_id"));
    std::fs::write(&path, &out).unwrap();

    // Rows by `i`: a file keeps its rows in time order, the null time first.
    let seen = read(&served.base, "r-key", "m", None, "");
    assert_eq!(
        seen_rows(&seen),
        vec![
            json!({"i": 1, "s": "a", "t": 1_767_225_600_000_000_001i64}),
            json!({"i": 2, "s": null, "t": null}),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_is_read_only_and_keyed() {
    let dir = common::temp_dir("iceberg-keys");
    let served = Served::start(DbConfig::new(&dir)).await;
    served
        .create(r#"{"name": "k", "columns": [{"name": "i", "data_type": "int"}]}"#)
        .await;
    let client = &served.client;
    let url = |p: &str| format!("{}/iceberg/v1{p}", served.base);
    let table = "/namespaces/scopedb%1Fpublic/tables/k";
    // No key, a wrong key: 401.
    for path in ["/config", "/namespaces", table] {
        assert_eq!(client.get(url(path)).send().await.unwrap().status(), 401);
        let r = client
            .get(url(path))
            .bearer_auth("nope")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
        // The refusal comes before the catalog's handlers, in its error model all the same.
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["type"], "NotAuthorizedException", "{body}");
        assert_eq!(body["code"], "unauthorized");
    }
    // The read role reads; a table in an empty namespace reads with no snapshot.
    let r = client
        .get(url(table))
        .bearer_auth("r-key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["metadata"]["current-snapshot-id"], -1);
    assert!(
        body["metadata-location"]
            .as_str()
            .unwrap()
            .starts_with("file:///")
    );
    let head = client
        .head(url(table))
        .bearer_auth("r-key")
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 204);
    // Missing things: 404 with the specification's error model beside ours.
    for (path, kind) in [
        (
            "/namespaces/scopedb%1Fpublic/tables/missing",
            "NoSuchTableException",
        ),
        ("/namespaces/nodb%1Fpublic/tables/k", "NoSuchTableException"),
        ("/namespaces/nodb", "NoSuchNamespaceException"),
        (
            "/namespaces/scopedb%1Fpublic%1Fdeeper",
            "NoSuchNamespaceException",
        ),
        (
            "/namespaces/scopedb%1Fnone/tables",
            "NoSuchNamespaceException",
        ),
    ] {
        let r = client
            .get(url(path))
            .bearer_auth("r-key")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{path}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["type"], kind, "{path}: {body}");
        assert_eq!(body["error"]["code"], 404);
        assert_eq!(body["code"], "not_found");
    }
    // A stream bucket may be called `iceberg`: its answers keep the streams' own form.
    let r = client
        .put(format!("{}/iceberg", served.base))
        .bearer_auth("a-key")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let r = client
        .get(format!("{}/iceberg/nostream", served.base))
        .bearer_auth("r-key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let body: Value = r.json().await.unwrap();
    assert!(body.get("error").is_none(), "{body}");
    let missing = client
        .head(url("/namespaces/scopedb%1Fpublic/tables/missing"))
        .bearer_auth("r-key")
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    // Nothing writes: the catalog's write routes do not exist (405), for any key; a read key
    // is refused a write method before that (403).
    for (key, status) in [("r-key", 403), ("a-key", 405)] {
        let r = client
            .post(url("/namespaces"))
            .bearer_auth(key)
            .json(&json!({"namespace": ["x"]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{key}");
        let r = client
            .post(url(table))
            .bearer_auth(key)
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{key}");
        let r = client
            .delete(url(table))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{key}");
    }
}

/// The views are chosen by warehouse and prefix: the configuration hands out prefix `v2`
/// for warehouse `v2` (and `v3` for `v3`, none without one); prefixed routes answer as the
/// unprefixed ones do, keys and roles alike, with the view the prefix names; any other
/// warehouse or prefix is not found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_serves_each_view_under_its_prefix() {
    let dir = common::temp_dir("iceberg-prefix");
    let served = Served::start(DbConfig::new(&dir)).await;
    let id = served
        .create_with_file(
            r#"{"name": "k", "columns": [{"name": "t", "data_type": "timestamp"}]}"#,
            "{\"t\":\"2026-01-01T00:00:00.000000001Z\"}\n",
        )
        .await;
    let client = &served.client;
    let get = |path: &str, key: Option<&str>| {
        let mut r = client.get(format!("{}/iceberg/v1{path}", served.base));
        if let Some(key) = key {
            r = r.bearer_auth(key);
        }
        r.send()
    };
    for (query, overrides) in [
        ("", json!({})),
        ("?warehouse=", json!({})),
        ("?warehouse=v2", json!({"prefix": "v2"})),
        ("?warehouse=v3", json!({"prefix": "v3"})),
    ] {
        let r = get(&format!("/config{query}"), Some("r-key"))
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{query}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["overrides"], overrides, "{query}");
    }
    let r = get("/config?warehouse=v4", Some("r-key")).await.unwrap();
    assert_eq!(r.status(), 404);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "NotFoundException", "{body}");

    let table = "/namespaces/scopedb%1Fpublic/tables/k";
    let mut uuids = BTreeSet::new();
    for (prefix, version, time) in [
        ("", 3, "timestamptz_ns"),
        ("/v3", 3, "timestamptz_ns"),
        ("/v2", 2, "timestamptz"),
    ] {
        let r = get(&format!("{prefix}{table}"), Some("r-key"))
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{prefix}");
        let body: Value = r.json().await.unwrap();
        let metadata = &body["metadata"];
        assert_eq!(metadata["format-version"], version, "{prefix}");
        let field = &metadata["schemas"][0]["fields"][0];
        assert_eq!(field["type"], time, "{prefix}");
        assert_eq!(metadata["current-snapshot-id"], 1);
        uuids.insert((version, metadata["table-uuid"].as_str().unwrap().to_owned()));
        // The v2 view has no row lineage; v3 numbers rows.
        assert_eq!(metadata.get("next-row-id").is_some(), version == 3);
        let dir = if version == 2 {
            "metadata-v2"
        } else {
            "metadata"
        };
        assert!(
            body["metadata-location"]
                .as_str()
                .unwrap()
                .contains(&format!("/tables/{id}/{dir}/v")),
            "{body}"
        );
        for path in [
            "/namespaces",
            "/namespaces/scopedb",
            "/namespaces/scopedb/tables",
            table,
        ] {
            let path = format!("{prefix}{path}");
            assert_eq!(get(&path, None).await.unwrap().status(), 401, "{path}");
            assert_eq!(
                get(&path, Some("r-key")).await.unwrap().status(),
                200,
                "{path}"
            );
            let head = client
                .head(format!("{}/iceberg/v1{path}", served.base))
                .bearer_auth("r-key")
                .send()
                .await
                .unwrap();
            // Lists have no HEAD route: the GET's answer, without its body.
            let list = path.ends_with("/namespaces") || path.ends_with("/tables");
            let want = if list { 200 } else { 204 };
            assert_eq!(head.status(), want, "HEAD {path}");
        }
        // Nothing writes under a prefix either.
        let r = client
            .post(format!("{}/iceberg/v1{prefix}/namespaces", served.base))
            .bearer_auth("r-key")
            .json(&json!({"namespace": ["x"]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{prefix}");
    }
    // A table with no snapshot yet reads empty, with every reader, in both views.
    served
        .create(r#"{"name": "e", "columns": [{"name": "t", "data_type": "timestamp"}]}"#)
        .await;
    for warehouse in [None, Some("v2")] {
        let seen = read(&served.base, "r-key", "e", warehouse, ALL_READERS);
        assert_eq!(seen["snapshots"], json!([]));
        assert_eq!(seen["rows"], json!([]));
        for reader in ["daft", "polars", "duckdb"] {
            let got = &seen["readers"][reader];
            if reader == "duckdb" && warehouse.is_none() {
                assert!(got["error"].as_str().unwrap().contains("timestamptz_ns"));
            } else {
                assert_eq!(got["rows"], json!([]), "{reader} {warehouse:?}: {got}");
            }
        }
    }
    // One UUID a view, the same under both v3 routes; the views' differ (two Iceberg
    // tables whose schemas give field 1 different types).
    assert_eq!(uuids.len(), 2, "{uuids:?}");
    assert_ne!(uuids.first().unwrap().1, uuids.last().unwrap().1);
    for path in [
        "/v4/namespaces",
        "/v4/namespaces/scopedb",
        &format!("/x{table}"),
    ] {
        let r = get(path, Some("r-key")).await.unwrap();
        assert_eq!(r.status(), 404, "{path}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["type"], "NotFoundException", "{path}: {body}");
    }
}

/// Readers while a table is flushed, compacted and collected with a short grace period: each
/// read through the catalog sees a whole prefix of the flushed rows (no file missing, none
/// twice), never fails on a collected file, and the metadata stays bounded. CI form: a few
/// reads; long form (`SLUICE_ICEBERG_LONG=1`): 60 reads over a few minutes of churn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_during_flushes_compactions_and_collection_see_whole_prefixes() {
    use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

    let long = std::env::var("SLUICE_ICEBERG_LONG").is_ok_and(|v| v == "1");
    let reads = if long { 60 } else { 5 };
    let dir = common::temp_dir("iceberg-churn");
    let mut config = DbConfig::new(&dir);
    config.gc_grace = Duration::from_secs(6);
    config.tables.compact_min_files = 3;
    let served = Arc::new(Served::start(config).await);
    let id = served
        .create(r#"{"name": "c", "columns": [{"name": "i", "data_type": "int"}]}"#)
        .await;
    // Rows flushed, and rows ingested (a flush may publish them before the writer counts
    // them flushed: a read can see up to the ingested count).
    let flushed = Arc::new(AtomicI64::new(0));
    let ingested = Arc::new(AtomicI64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (served, flushed, ingested, stop, id) = (
            served.clone(),
            flushed.clone(),
            ingested.clone(),
            stop.clone(),
            id.clone(),
        );
        tokio::spawn(async move {
            let mut next = 0i64;
            while !stop.load(Ordering::Relaxed) {
                let body: String = (next..next + 20)
                    .map(|i| format!("{{\"i\":{i}}}\n"))
                    .collect();
                served.ingest("c", body).await;
                next += 20;
                ingested.store(next, Ordering::SeqCst);
                served.db.tables().flush(&id).await.unwrap();
                flushed.store(next, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let maintenance = {
        let (served, stop, id) = (served.clone(), stop.clone(), id.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                served.db.tables().compact(&id).await.unwrap();
                served.db.collect_garbage().await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };
    let check = |seen: &Value, lo: i64, hi: i64| {
        let mut ids: Vec<i64> = seen["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["i"].as_i64().unwrap())
            .collect();
        ids.sort_unstable();
        let k = ids.len() as i64;
        assert_eq!(ids, (0..k).collect::<Vec<_>>(), "a whole prefix, once each");
        assert!(
            lo <= k && k <= hi,
            "{k} rows read, {lo} flushed before the read, {hi} ingested after it"
        );
        assert!(seen["snapshots"].as_array().unwrap().len() <= 64);
    };
    for _ in 0..reads {
        let lo = flushed.load(Ordering::SeqCst);
        let base = served.base.clone();
        let seen = tokio::task::spawn_blocking(move || read(&base, "r-key", "c", None, ""))
            .await
            .unwrap();
        check(&seen, lo, ingested.load(Ordering::SeqCst));
    }
    stop.store(true, Ordering::Relaxed);
    writer.await.unwrap();
    maintenance.await.unwrap();
    let all = flushed.load(Ordering::SeqCst);
    let base = served.base.clone();
    let seen = tokio::task::spawn_blocking(move || read(&base, "r-key", "c", None, ""))
        .await
        .unwrap();
    check(&seen, all, all);
    println!("iceberg churn: {reads} reads, {all} rows flushed, last read saw every one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_view_is_published_anew_and_never_stops_flushing() {
    // A data directory whose path needs quoting in a URL: locations name it as it is.
    let dir = common::temp_dir("iceberg damaged").join("sp ace %41 é");
    let served = Served::start(DbConfig::new(&dir)).await;
    let id = served
        .create(r#"{"name": "d", "columns": [{"name": "i", "data_type": "int"}]}"#)
        .await;
    served.ingest("d", "{\"i\":1}\n".into()).await;
    served.db.tables().flush(&id).await.unwrap().unwrap();
    let seen = read(&served.base, "r-key", "d", None, "");
    assert_eq!(seen["rows"], json!([{"i": 1}]));
    let objects = std::fs::canonicalize(dir.join("objects")).unwrap();
    assert!(
        seen["files"][0]
            .as_str()
            .unwrap()
            .starts_with(&format!("file://{}/", objects.display())),
        "{seen}"
    );

    // The newest metadata torn (written without fsync, or by another program): the next
    // publication replaces it; loads, flushes and collection go on.
    let metadata = objects.join(format!("tables/{id}/metadata"));
    std::fs::write(newest_metadata(&metadata), b"").unwrap();
    served.ingest("d", "{\"i\":2}\n".into()).await;
    served.db.tables().flush(&id).await.unwrap().unwrap();
    let seen = read(&served.base, "r-key", "d", None, "");
    assert_eq!(seen["rows"], json!([{"i": 1}, {"i": 2}]));
    std::fs::write(newest_metadata(&metadata), b"{not json").unwrap();
    let r = load(&served, "d").await;
    assert_eq!(r["metadata"]["current-snapshot-id"], 2);
    served.db.collect_garbage().await;
    assert_eq!(listed_snapshots(&metadata), [2]);

    // Names that are not this module's (a sign, leading zeros, a number no publication
    // reaches) are not taken for the newest metadata.
    let newest = newest_metadata(&metadata);
    for stray in [
        format!("v{}.metadata.json", u64::MAX),
        "v+99.metadata.json".into(),
        "v0099.metadata.json".into(),
    ] {
        std::fs::copy(&newest, metadata.join(stray)).unwrap();
    }
    served.ingest("d", "{\"i\":3}\n".into()).await;
    served.db.tables().flush(&id).await.unwrap().unwrap();
    assert_eq!(
        load(&served, "d").await["metadata"]["current-snapshot-id"],
        3
    );

    // Metadata that names a manifest version the table does not have (restored or copied
    // from elsewhere) is published over, so its snapshots cannot outlive their files.
    let mut bogus: Value =
        serde_json::from_slice(&std::fs::read(newest_metadata(&metadata)).unwrap()).unwrap();
    bogus["properties"]["sluice.manifest-version"] = json!("50");
    let number: u64 = newest_metadata(&metadata)
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .trim_start_matches('v')
        .trim_end_matches(".metadata.json")
        .parse()
        .unwrap();
    std::fs::write(
        metadata.join(format!("v{}.metadata.json", number + 1)),
        bogus.to_string(),
    )
    .unwrap();
    served.ingest("d", "{\"i\":4}\n".into()).await;
    served.db.tables().flush(&id).await.unwrap().unwrap();
    let r = load(&served, "d").await;
    assert_eq!(r["metadata"]["current-snapshot-id"], 4);
    assert_eq!(r["metadata"]["properties"]["sluice.manifest-version"], "4");
    served.db.collect_garbage().await;
    let seen = read(&served.base, "r-key", "d", None, "");
    assert_eq!(
        seen["rows"],
        json!([{"i": 1}, {"i": 2}, {"i": 3}, {"i": 4}])
    );
}

/// The newest metadata file of a table in a local data directory (of the names sluice
/// writes: canonical numbers below 2^32).
fn newest_metadata(metadata_dir: &Path) -> PathBuf {
    let newest = std::fs::read_dir(metadata_dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let n = name
                .strip_prefix('v')?
                .strip_suffix(".metadata.json")?
                .parse::<u64>()
                .ok()?;
            (n < 1 << 32 && name == format!("v{n}.metadata.json")).then_some(n)
        })
        .max()
        .unwrap();
    metadata_dir.join(format!("v{newest}.metadata.json"))
}
