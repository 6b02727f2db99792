//! Query tests in a sqllogictest-style format: every `testdata/queries/*.slt` file runs against
//! a fresh database, SQL and ScopeQL side by side over the same data.
//!
//! ```text
//! statement ok            a statement that must succeed
//! <statement>
//!
//! ingest <table>          NDJSON rows appended to scopedb.public.<table>
//! <rows>
//!
//! query [rowsort]         a statement and its rows: cells joined by '|', NULL for null
//! <statement>
//! ----
//! <rows>
//!
//! query error <text>      a statement that must fail with <text> in its message
//! <statement>
//! ```
//! Blocks are separated by blank lines; lines starting with `#` are comments.

use std::path::Path;

use sluice::db::{Database, DbConfig};
use sluice::ingest::ContentEncoding;

struct Block {
    line: usize,
    header: String,
    body: Vec<String>,
    expected: Option<Vec<String>>,
}

fn blocks(text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut current: Option<Block> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_end();
        if line.starts_with('#') {
            continue;
        }
        if line.is_empty() {
            out.extend(current.take());
            continue;
        }
        match &mut current {
            None => {
                current = Some(Block {
                    line: i + 1,
                    header: line.to_owned(),
                    body: Vec::new(),
                    expected: None,
                })
            }
            Some(b) if line == "----" => b.expected = Some(Vec::new()),
            Some(b) => match &mut b.expected {
                Some(rows) => rows.push(line.to_owned()),
                None => b.body.push(line.to_owned()),
            },
        }
    }
    out.extend(current);
    out
}

async fn run_file(path: &Path) -> Vec<String> {
    let dir = std::env::temp_dir().join(format!(
        "sluice-slt-{}-{}",
        std::process::id(),
        path.file_stem().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let text = std::fs::read_to_string(path).unwrap();
    let mut failures = Vec::new();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    for block in blocks(&text) {
        let at = format!("{name}:{}", block.line);
        let statement = block.body.join("\n");
        let words: Vec<&str> = block.header.split_whitespace().collect();
        match words.as_slice() {
            ["statement", "ok"] => {
                if let Err(e) = db.execute(&statement).await {
                    failures.push(format!("{at}: statement failed: {e}"));
                }
            }
            ["ingest", table] => {
                let body = bytes::Bytes::from(format!("{statement}\n"));
                if let Err(e) = db
                    .ingest("scopedb", "public", table, body, ContentEncoding::Identity)
                    .await
                {
                    failures.push(format!("{at}: ingest failed: {e}"));
                }
            }
            ["query", "error", rest @ ..] => match db.execute(&statement).await {
                Ok(_) => failures.push(format!("{at}: expected an error, the statement succeeded")),
                Err(e) => {
                    let want = rest.join(" ");
                    if !e.to_string().contains(&want) {
                        failures.push(format!("{at}: error {e:?} does not contain {want:?}"));
                    }
                }
            },
            ["query", mode @ ..] => match db.execute(&statement).await {
                Err(e) => failures.push(format!("{at}: query failed: {e}")),
                Ok(result) => {
                    let mut got: Vec<String> = result.rows.iter().map(|r| row_text(r)).collect();
                    let mut want = block.expected.clone().unwrap_or_default();
                    if mode == ["rowsort"] {
                        got.sort();
                        want.sort();
                    }
                    if got != want {
                        failures.push(format!(
                            "{at}: rows differ\n  want: {want:?}\n  got:  {got:?}"
                        ));
                    }
                }
            },
            _ => failures.push(format!("{at}: unknown block header {:?}", block.header)),
        }
    }
    failures
}

/// The scan's page pruning in `EXPLAIN ANALYZE` text: the metric's text, and the rows before
/// and after the page index ("N total → M matched").
fn page_rows(text: &str) -> (&str, &str, &str) {
    let pruned = text
        .split("page_index_rows_pruned=")
        .nth(1)
        .and_then(|rest| rest.split(" matched").next())
        .expect("the scan reports page pruning");
    let (total, matched) = pruned.split_once(" total → ").expect("N total → M matched");
    (pruned, total, matched)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_files() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/queries");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "slt"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .slt files in {}", dir.display());
    let mut failures = Vec::new();
    for f in &files {
        failures.extend(run_file(f).await);
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A result row as the sqllogictest files write it: cells joined by `|`, null as `NULL`.
fn row_text(row: &[Option<String>]) -> String {
    row.iter()
        .map(|c| c.clone().unwrap_or_else(|| "NULL".into()))
        .collect::<Vec<_>>()
        .join("|")
}

/// A fresh database in a scratch directory named after `name`, with a table `t` of
/// `columns`.
async fn database_with_t(
    name: &str,
    columns: &str,
) -> (std::path::PathBuf, std::sync::Arc<Database>) {
    let dir = std::env::temp_dir().join(format!("sluice-slt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    db.execute(&format!("CREATE TABLE t ({columns})"))
        .await
        .unwrap();
    (dir, db)
}

/// NDJSON rows appended to the table `t`.
async fn ingest_t(db: &Database, body: String) {
    db.ingest(
        "scopedb",
        "public",
        "t",
        bytes::Bytes::from(body),
        ContentEncoding::Identity,
    )
    .await
    .unwrap();
}

/// The text of `EXPLAIN ANALYZE` of `sql`: the plan with each operator's metrics.
async fn explain_analyze(db: &Database, sql: &str) -> String {
    let plan = db.execute(&format!("EXPLAIN ANALYZE {sql}")).await.unwrap();
    plan.rows
        .iter()
        .flatten()
        .flatten()
        .cloned()
        .collect::<Vec<_>>()
        .join("\n")
}

/// A top-N query ordered by two columns over several Parquet files: the answer is the
/// brute-force one, and the scan prunes pages with the top-N's threshold (DataFusion alone
/// prunes pages only with single-column predicates, and the threshold names both columns).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_n_by_two_columns_prunes_pages_and_answers_right() {
    let (dir, db) = database_with_t("top-n", "k int, latency float").await;
    // Six files of 20,000 rows (three pages a column each), flushed in turn. Each file's
    // first page holds its top latencies (999.9 nine times, keys ascending; k falls from
    // file to file), the other pages lower ones: every row group may hold an answer (so
    // row-group statistics prune nothing), and every page but the first of a file scanned
    // after the threshold is known holds none.
    let mut all: Vec<(i64, i64)> = Vec::new(); // (latency in tenths, k)
    for file in 0..6i64 {
        let mut body = String::new();
        for i in 0..20_000i64 {
            let tenths = if i < 8_192 {
                9_000 + (i * 37) % 1_000
            } else {
                (i * 37) % 5_000
            };
            let k = (5 - file) * 20_000 + i;
            all.push((tenths, k));
            body.push_str(&format!(
                "{{\"k\":{k},\"latency\":{}.{}}}\n",
                tenths / 10,
                tenths % 10
            ));
        }
        ingest_t(&db, body).await;
        db.tables().flush_due(true).await.unwrap();
    }
    all.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let want: Vec<String> = all[..10]
        .iter()
        .map(|(tenths, k)| format!("{k}|{}.{}", tenths / 10, tenths % 10))
        .collect();

    let sql = "SELECT k, latency FROM t ORDER BY latency DESC, k LIMIT 10";
    let result = db.execute(sql).await.unwrap();
    let got: Vec<String> = result
        .rows
        .iter()
        .map(|row| {
            row.iter()
                .map(|c| c.clone().unwrap_or_default())
                .collect::<Vec<_>>()
                .join("|")
        })
        .collect();
    assert_eq!(got, want);

    let text = explain_analyze(&db, sql).await;
    let (pruned, total, matched) = page_rows(&text);
    assert_ne!(total, matched, "no page was pruned: {pruned}\n{text}");
    // Each batch reaches the top-N thinned to its own top 10 by latency (and ties).
    assert!(text.contains("BatchTopNExec: fetch=10"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The latest rows by a timestamp column, over eight Parquet files written in time order:
/// the answers in either direction, with nulls first or last, are the brute-force ones
/// (one older file has null times, which no file's bounds may hide), and the newest first
/// scan reads at most two files' rows, where reading oldest first read them all: the ranges
/// carry their time bounds, so the scan starts with the newest and prunes the rest whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latest_rows_read_the_newest_files_first_and_answer_right() {
    let (dir, db) = database_with_t("latest", "ts timestamp, k int").await;
    let at = |s: i64| {
        format!(
            "2026-01-{:02}T{:02}:{:02}:{:02}Z",
            1 + s / 86_400,
            s / 3_600 % 24,
            s / 60 % 60,
            s % 60
        )
    };
    const FILES: i64 = 8;
    const ROWS: i64 = 20_000;
    // (time in seconds, or none; k), k unique.
    let mut all: Vec<(Option<i64>, i64)> = Vec::new();
    for file in 0..FILES {
        let mut body = String::new();
        for i in 0..ROWS {
            let k = file * ROWS + i;
            // File 2 has a null time on every 1000th row; times never repeat.
            if file == 2 && i % 1_000 == 7 {
                all.push((None, k));
                body.push_str(&format!("{{\"k\":{k}}}\n"));
            } else {
                all.push((Some(k), k));
                body.push_str(&format!("{{\"ts\":\"{}\",\"k\":{k}}}\n", at(k)));
            }
        }
        ingest_t(&db, body).await;
        db.tables().flush_due(true).await.unwrap();
    }
    let ks = |sql: String| {
        let db = &db;
        async move {
            let result = db.execute(&sql).await.unwrap();
            result
                .rows
                .iter()
                .map(|row| row[0].clone().unwrap_or_default())
                .collect::<Vec<_>>()
        }
    };
    for (order, descending, nulls_first) in [
        ("DESC", true, true),
        ("DESC NULLS LAST", true, false),
        ("ASC", false, false),
        ("ASC NULLS FIRST", false, true),
    ] {
        let mut want = all.clone();
        want.sort_by(|a, b| {
            let by_time = match (a.0, b.0) {
                (None, None) => std::cmp::Ordering::Equal,
                (None, Some(_)) if nulls_first => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (Some(_), None) if nulls_first => std::cmp::Ordering::Greater,
                (Some(_), None) => std::cmp::Ordering::Less,
                (Some(x), Some(y)) if descending => y.cmp(&x),
                (Some(x), Some(y)) => x.cmp(&y),
            };
            by_time.then(a.1.cmp(&b.1))
        });
        let want: Vec<String> = want[..30].iter().map(|(_, k)| k.to_string()).collect();
        let got = ks(format!("SELECT k FROM t ORDER BY ts {order}, k LIMIT 30")).await;
        assert_eq!(got, want, "ORDER BY ts {order}");
    }

    // The bounds and the count of the times agree with a scan that a filter on `k` forces.
    let cells = |sql: &'static str| {
        let db = &db;
        async move { db.execute(sql).await.unwrap().rows[0].clone() }
    };
    let unfiltered = cells("SELECT min(ts), max(ts), count(ts), count(*) FROM t").await;
    let scanned = cells("SELECT min(ts), max(ts), count(ts), count(*) FROM t WHERE k >= 0").await;
    assert_eq!(unfiltered, scanned);
    assert_eq!(unfiltered[2].as_deref(), Some("159980"));
    // Unflushed rows, one newer than every file and one with no time, count as well.
    let newest = FILES * ROWS + 5;
    ingest_t(
        &db,
        format!(
            "{{\"ts\":\"{}\",\"k\":{newest}}}\n{{\"k\":{}}}\n",
            at(newest),
            newest + 1
        ),
    )
    .await;
    let with_unflushed = cells("SELECT min(ts), max(ts), count(ts), count(*) FROM t").await;
    assert_eq!(
        with_unflushed,
        cells("SELECT min(ts), max(ts), count(ts), count(*) FROM t WHERE k >= 0").await
    );
    assert_eq!(with_unflushed[2].as_deref(), Some("159981"));
    assert_eq!(with_unflushed[3].as_deref(), Some("160002"));

    let sql = "SELECT ts, k FROM t ORDER BY ts DESC NULLS LAST LIMIT 20";
    let text = explain_analyze(&db, sql).await;
    let scan = text
        .lines()
        .find(|l| l.contains("DataSourceExec"))
        .expect("a scan");
    let rows: f64 = scan
        .split("output_rows=")
        .nth(1)
        .and_then(|rest| rest.split([',', ']']).next())
        .map(|n| match n.strip_suffix(" K") {
            Some(k) => k.parse::<f64>().map(|k| k * 1_000.0),
            None => n.parse::<f64>(),
        })
        .expect("the scan reports its rows")
        .expect("a number of rows");
    assert!(
        rows <= (2 * ROWS) as f64,
        "the scan read {rows} of {} rows:\n{text}",
        FILES * ROWS
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Casts that do not keep order, in filters, top-N orders and aggregates over a subquery,
/// answer as a scan with nothing pruned does: a time of day (rows at 23:00 on one day and
/// 01:00 on the next, in one row group or in two of one range: the cast bounds are 23:00 and
/// 01:00, and DataFusion pruned both away for `> 12:00`), text (`…00Z` sorts after
/// `…00.5Z`), a number as a boolean (-5 and 5 are true, 0 false), and a timestamp as a local
/// date in a zone whose clocks fall back across midnight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn casts_that_do_not_keep_order_prune_nothing() {
    for row_group_rows in [1, 1024] {
        let name = format!("casts-{row_group_rows}");
        let dir = std::env::temp_dir().join(format!("sluice-slt-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut config = DbConfig::new(&dir);
        config.tables.row_group_rows = row_group_rows;
        let db = Database::open(config).await.unwrap();
        db.execute("CREATE TABLE t (ts timestamp, k int)")
            .await
            .unwrap();
        ingest_t(
            &db,
            "{\"ts\":\"2026-01-01T23:00:00Z\",\"k\":1}\n\
             {\"ts\":\"2026-01-02T01:00:00Z\",\"k\":-5}\n\
             {\"ts\":\"2026-01-02T01:00:00.5Z\",\"k\":0}\n\
             {\"ts\":\"2026-01-02T01:00:01Z\",\"k\":5}\n"
                .into(),
        )
        .await;
        db.tables().flush_due(true).await.unwrap();
        let rows = |sql: &'static str| {
            let db = &db;
            async move {
                let result = db.execute(sql).await.unwrap();
                result
                    .rows
                    .iter()
                    .map(|row| row.iter().map(|c| c.clone().unwrap_or_default()).collect())
                    .collect::<Vec<Vec<String>>>()
            }
        };
        let cases: [(&str, &str); 5] = [
            (
                "SELECT k FROM t WHERE CAST(ts AS TIME) > CAST('12:00:00' AS TIME)",
                "1",
            ),
            (
                "SELECT k FROM t ORDER BY CAST(ts AS TIME) DESC, k LIMIT 1",
                "1",
            ),
            (
                "SELECT max(x) FROM (SELECT CAST(ts AS TIME) AS x FROM t)",
                "23:00:00",
            ),
            (
                "SELECT max(x) FROM (SELECT CAST(ts AS VARCHAR) AS x FROM t)",
                "2026-01-02T01:00:01Z",
            ),
            ("SELECT k FROM t WHERE CAST(k AS BOOLEAN) = false", "0"),
        ];
        for (sql, want) in cases {
            assert_eq!(
                rows(sql).await,
                [[want.to_owned()]],
                "{sql}, row groups of {row_group_rows} rows"
            );
        }
        // A local date goes back where clocks fall back across midnight: St. John's, 00:01
        // on 2005-10-30 became 23:01 on the 29th.
        db.execute("CREATE TABLE z (ts timestamp, k int)")
            .await
            .unwrap();
        db.ingest(
            "scopedb",
            "public",
            "z",
            bytes::Bytes::from(
                "{\"ts\":\"2005-10-30T02:30:30Z\",\"k\":1}\n\
                 {\"ts\":\"2005-10-30T02:31:30Z\",\"k\":2}\n",
            ),
            ContentEncoding::Identity,
        )
        .await
        .unwrap();
        db.tables().flush_due(true).await.unwrap();
        let sql = "SELECT k FROM z \
                   WHERE CAST(ts AT TIME ZONE 'America/St_Johns' AS DATE) = '2005-10-29'";
        assert_eq!(
            rows(sql).await,
            [["2".to_owned()]],
            "{sql}, row groups of {row_group_rows} rows"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A filter reaches the scan once: the scan's predicate, which prunes row groups and
/// pages, holds each of its conjuncts once (it held them twice, from the table's filters and
/// from DataFusion's pushdown of the filter above, and every pruning step evaluated both),
/// and it still prunes pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_prunes_the_scan_once() {
    let (dir, db) = database_with_t("filter-once", "k int, s string").await;
    let body: String = (0..20_000)
        .map(|k| format!("{{\"k\":{k},\"s\":\"v{}\"}}\n", k % 3))
        .collect();
    ingest_t(&db, body).await;
    db.tables().flush_due(true).await.unwrap();
    let sql = "SELECT k FROM t WHERE k >= 19990 AND s = 'v1' ORDER BY k";
    let result = db.execute(sql).await.unwrap();
    let got: Vec<String> = result.rows.iter().map(|r| row_text(r)).collect();
    let want: Vec<String> = (19_990..20_000)
        .filter(|k| k % 3 == 1)
        .map(|k| k.to_string())
        .collect();
    assert_eq!(got, want);
    let text = explain_analyze(&db, sql).await;
    let predicate = text
        .split(" predicate=")
        .nth(1)
        .and_then(|rest| rest.split(", pruning_predicate=").next())
        .expect("the scan has a predicate");
    assert_eq!(predicate.matches(">= 19990").count(), 1, "{predicate}");
    assert_eq!(predicate.matches("= v1").count(), 1, "{predicate}");
    let (pruned, total, matched) = page_rows(&text);
    assert_ne!(total, matched, "no page was pruned: {pruned}\n{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rows that arrive with two stretches of time interleaved (two loaders, say) are written in
/// time order within their row group, so a one-second window reads the one page of its time:
/// in arrival order each page spans both stretches, and the page index kept two of the three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_time_window_reads_the_pages_of_its_time() {
    let (dir, db) = database_with_t("time-order", "ts timestamp, k int").await;
    let at = |s: i64| {
        format!(
            "2026-01-01T{:02}:{:02}:{:02}Z",
            s / 3_600,
            s / 60 % 60,
            s % 60
        )
    };
    // Row k: second k / 2 of the first stretch (even k) or of one 40,000 s later (odd k).
    let body: String = (0..20_000i64)
        .map(|k| {
            let second = k / 2 + if k % 2 == 1 { 40_000 } else { 0 };
            format!("{{\"ts\":\"{}\",\"k\":{k}}}\n", at(second))
        })
        .collect();
    ingest_t(&db, body).await;
    db.tables().flush_due(true).await.unwrap();
    let sql = format!(
        "SELECT k FROM t WHERE ts >= '{}' AND ts < '{}' ORDER BY k",
        at(5_000),
        at(5_001)
    );
    let result = db.execute(&sql).await.unwrap();
    let got: Vec<String> = result.rows.iter().map(|r| row_text(r)).collect();
    assert_eq!(got, vec!["10000".to_owned()]);
    let text = explain_analyze(&db, &sql).await;
    let (pruned, _, matched) = page_rows(&text);
    assert_eq!(
        matched, "8.19 K",
        "one page of 8,192 rows: {pruned}\n{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `count(*)` without a filter is answered from the manifest's row counts and the unflushed
/// batches, with no scan, and agrees with a scan; with a filter, or counting a column, it
/// scans. Rows come from two flushed files and unflushed batches, then from three files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_star_from_row_counts_agrees_with_a_scan() {
    let (dir, db) = database_with_t("count", "k int, s string").await;
    let ingest = |from: i64, to: i64| {
        let body: String = (from..to)
            .map(|k| {
                if k % 7 == 0 {
                    format!("{{\"k\":{k}}}\n")
                } else {
                    format!("{{\"k\":{k},\"s\":\"v{}\"}}\n", k % 3)
                }
            })
            .collect();
        ingest_t(&db, body)
    };
    let cell = |sql: &'static str| {
        let db = &db;
        async move {
            let result = db.execute(sql).await.unwrap();
            result.rows[0][0].clone().unwrap()
        }
    };
    let plan = |sql: &'static str| {
        let db = &db;
        async move {
            let plan = db.execute(&format!("EXPLAIN {sql}")).await.unwrap();
            plan.rows[1][1].clone().unwrap()
        }
    };
    ingest(0, 1000).await;
    db.tables().flush_due(true).await.unwrap();
    ingest(1000, 2500).await;
    db.tables().flush_due(true).await.unwrap();
    ingest(2500, 2600).await;
    ingest(2600, 2610).await;
    for round in 0..2 {
        assert_eq!(
            cell("SELECT count(*) FROM t").await,
            "2610",
            "round {round}"
        );
        let physical = plan("SELECT count(*) FROM t").await;
        assert!(
            !physical.contains("DataSourceExec"),
            "count(*) scanned: {physical}"
        );
        // Counting a column counts its non-null values: a scan.
        assert_eq!(cell("SELECT count(s) FROM t").await, "2237");
        assert_eq!(cell("SELECT count(*) FROM t WHERE k >= 900").await, "1710");
        assert_eq!(cell("SELECT count(*) FROM t WHERE s IS NULL").await, "373");
        assert!(
            plan("SELECT count(*) FROM t WHERE k >= 900")
                .await
                .contains("DataSourceExec")
        );
        // The unflushed rows become a third file; the counts stay.
        db.tables().flush_due(true).await.unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Grouping by string columns read as Parquet dictionaries (`KeyedPartialAggregateExec
/// reading dictionaries of [...]`) answers as the rows say: over files with dictionaries of
/// their own, with nulls and empty strings, with a filter that drops every row of some
/// values (no group may appear for them), with two keys and with aggregates of other
/// columns, and for a column of 2,000 values that hands over to DataFusion mid-batch.
/// A column read by the filter or an aggregate is not read as a dictionary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouping_by_dictionaries_answers_as_the_rows_say() {
    use std::collections::BTreeMap;
    let (dir, db) = database_with_t("dictionaries", "k int, s string, u string, m string").await;
    const FILES: i64 = 4;
    const ROWS: i64 = 9_000;
    // (k, s, u, m); s is null on every 11th row, and in file 1 its values differ.
    let mut all: Vec<(i64, Option<String>, String, String)> = Vec::new();
    for file in 0..FILES {
        let mut body = String::new();
        for i in 0..ROWS {
            let k = file * ROWS + i;
            let s = match (k % 11, file) {
                (0, _) => None,
                (1, _) => Some(String::new()),
                // Rows with k % 5 == 4 are the only ones with "gone-..." values.
                _ if k % 5 == 4 => Some(format!("gone-{}", k % 3)),
                (_, 1) => Some(format!("fïle1-{}", k % 4)),
                _ => Some(format!("s{}", k % 6)),
            };
            let u = format!("u{}", k % 3);
            let m = format!("m{}", (k * 7919) % 2_000);
            let mut row = serde_json::json!({ "k": k, "u": u, "m": m });
            if let Some(s) = &s {
                row["s"] = serde_json::json!(s);
            }
            body.push_str(&format!("{row}\n"));
            all.push((k, s, u, m));
        }
        ingest_t(&db, body).await;
        db.tables().flush_due(true).await.unwrap();
    }
    let rows = |sql: String| {
        let db = &db;
        async move {
            let result = db.execute(&sql).await.unwrap();
            let mut rows: Vec<String> = result.rows.iter().map(|r| row_text(r)).collect();
            rows.sort();
            rows
        }
    };
    let text = |s: &Option<String>| s.clone().unwrap_or_else(|| "NULL".into());
    let sorted = |map: BTreeMap<String, i64>| {
        let mut rows: Vec<String> = map.into_iter().map(|(k, n)| format!("{k}|{n}")).collect();
        rows.sort();
        rows
    };

    // With one core DataFusion plans a single aggregate, not a partial one, and nothing is
    // rewritten; the answers are checked all the same.
    let rewrites = std::thread::available_parallelism().map_or(1, usize::from) > 1;
    let read_as_dictionaries = |sql: &'static str, columns: &'static str| {
        let db = &db;
        async move {
            let plan = explain_analyze(db, sql).await;
            let wanted = format!("reading dictionaries of [{columns}]");
            assert!(!rewrites || plan.contains(&wanted), "{sql}: {plan}");
            plan
        }
    };
    read_as_dictionaries("SELECT s, count(*) FROM t GROUP BY s", "s").await;
    let mut want = BTreeMap::new();
    for (_, s, _, _) in &all {
        *want.entry(text(s)).or_default() += 1;
    }
    assert_eq!(
        rows("SELECT s, count(*) FROM t GROUP BY s".into()).await,
        sorted(want)
    );

    // The filter drops every "gone-..." row: no group for them, not even of count 0.
    let mut want = BTreeMap::new();
    for (k, s, _, _) in &all {
        if k % 5 != 4 {
            *want.entry(text(s)).or_default() += 1;
        }
    }
    let sql = "SELECT s, count(*) FROM t WHERE k % 5 <> 4 GROUP BY s";
    read_as_dictionaries(sql, "s").await;
    assert_eq!(rows(sql.into()).await, sorted(want));

    // Two keys, a sum of another column, a filter.
    let mut want: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for (k, s, u, _) in &all {
        if k % 3 != 1 {
            let entry = want.entry(format!("{}|{u}", text(s))).or_default();
            entry.0 += 1;
            entry.1 += k;
        }
    }
    let want: Vec<String> = want
        .into_iter()
        .map(|(key, (n, sum))| format!("{key}|{n}|{sum}"))
        .collect();
    let sql = "SELECT s, u, count(*), sum(k) FROM t WHERE k % 3 <> 1 GROUP BY s, u";
    read_as_dictionaries(sql, "s, u").await;
    assert_eq!(rows(sql.into()).await, want);

    // count(DISTINCT ...) groups by the column, with no aggregate.
    let distinct: std::collections::HashSet<_> = all.iter().filter_map(|r| r.1.clone()).collect();
    assert_eq!(
        rows("SELECT count(DISTINCT s) FROM t".into()).await,
        [distinct.len().to_string()]
    );

    // 2,000 values in each file's dictionary, in no order: a batch brings more new values
    // than the operator keeps, and the rest goes to DataFusion, the dictionary cast back.
    let mut want = BTreeMap::new();
    let mut sums: BTreeMap<String, i64> = BTreeMap::new();
    for (k, _, _, m) in &all {
        *want.entry(m.clone()).or_default() += 1;
        *sums.entry(m.clone()).or_default() += k;
    }
    let plan = read_as_dictionaries("SELECT m, count(*) FROM t GROUP BY m", "m").await;
    assert!(!rewrites || !plan.contains("handed_over=0"), "{plan}");
    assert_eq!(
        rows("SELECT m, count(*) FROM t GROUP BY m".into()).await,
        sorted(want)
    );
    assert_eq!(
        rows("SELECT m, sum(k) FROM t GROUP BY m".into()).await,
        sorted(sums)
    );

    // A key the filter or an aggregate reads is read as the table's type.
    let plan = explain_analyze(&db, "SELECT s, count(*) FROM t WHERE s <> 's1' GROUP BY s").await;
    assert!(!plan.contains("reading dictionaries"), "{plan}");
    let sql = "SELECT u, count(s) FROM t GROUP BY u";
    read_as_dictionaries(sql, "u").await;
    let mut want = BTreeMap::new();
    for (_, s, u, _) in &all {
        *want.entry(u.clone()).or_default() += i64::from(s.is_some());
    }
    assert_eq!(rows(sql.into()).await, sorted(want));

    // One column under two names, one a key and one read by an aggregate (found by review:
    // the scan read both as dictionaries, and the FILTER compared a dictionary to a view).
    let mut want = BTreeMap::new();
    for (_, s, _, _) in &all {
        *want.entry(text(s)).or_default() += i64::from(s.as_deref() == Some("s1"));
    }
    let sql = "SELECT a, count(*) FILTER (WHERE b = 's1') FROM (SELECT s AS a, s AS b FROM t) x GROUP BY a";
    let plan = explain_analyze(&db, sql).await;
    assert!(!plan.contains("reading dictionaries"), "{plan}");
    assert_eq!(rows(sql.into()).await, sorted(want));
    let mut want = BTreeMap::new();
    for (_, s, _, _) in &all {
        *want.entry(text(s)).or_default() += s.as_ref().map_or(0, |s| s.chars().count() as i64);
    }
    let sql =
        "SELECT a, coalesce(sum(length(b)), 0) FROM (SELECT s AS a, s AS b FROM t) x GROUP BY a";
    assert_eq!(rows(sql.into()).await, sorted(want));

    // With unflushed rows the table is a union of files and batches: no rewrite, same answer.
    ingest_t(&db, "{\"k\":-1,\"s\":\"s1\"}\n{\"k\":-2}\n".into()).await;
    let mut want = BTreeMap::new();
    for (_, s, _, _) in &all {
        *want.entry(text(s)).or_default() += 1;
    }
    *want.entry("s1".into()).or_default() += 1;
    *want.entry("NULL".into()).or_default() += 1;
    assert_eq!(
        rows("SELECT s, count(*) FROM t GROUP BY s".into()).await,
        sorted(want)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A statement sent again reuses its plan while the catalog is unchanged: the reused plan
/// reads the files and batches the table has when it runs (flushed, compacted, unflushed),
/// and `now()` is the time the statement runs, not the time it was first planned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_plan_answers_for_when_it_runs() {
    let (dir, db) = database_with_t("reuse", "ts timestamp, k int").await;
    let count = "SELECT count(*), sum(k) FROM t WHERE k >= 0";
    let answer = |db: std::sync::Arc<Database>| async move {
        let r = db.execute(count).await.unwrap();
        r.rows[0].clone()
    };
    let mut want = (0i64, 0i64);
    for round in 0..4i64 {
        let body: String = (0..1000)
            .map(|i| {
                format!(
                    "{{\"ts\":\"2026-10-23T09:00:00Z\",\"k\":{}}}\n",
                    round * 1000 + i
                )
            })
            .collect();
        ingest_t(&db, body).await;
        want.0 += 1000;
        want.1 += (0..1000).map(|i| round * 1000 + i).sum::<i64>();
        let expected = vec![Some(want.0.to_string()), Some(want.1.to_string())];
        // Unflushed, then flushed: the same text each time.
        assert_eq!(
            answer(db.clone()).await,
            expected,
            "round {round}, unflushed"
        );
        db.tables().flush_due(true).await.unwrap();
        assert_eq!(answer(db.clone()).await, expected, "round {round}, flushed");
    }

    for now in [
        "SELECT CAST(now() AS BIGINT)",
        // A table function's arguments are evaluated while the statement is planned.
        "SELECT CAST(value AS BIGINT) FROM generate_series(now(), now(), INTERVAL '1 second')",
        "SELECT max(CAST(now() AS BIGINT) + k) FROM t WHERE k >= 0",
    ] {
        let first = db.execute(now).await.unwrap().rows[0][0].clone();
        let mut changed = false;
        for _ in 0..4 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            changed |= db.execute(now).await.unwrap().rows[0][0] != first;
        }
        assert!(changed, "now() was frozen into a reused plan: {now}");
    }

    // The answer's column types are those of the statement as planned (field metadata the
    // optimizer does not keep: a union's fields carry its first input's), first and reused.
    db.execute("CREATE TABLE types (o object, s string)")
        .await
        .unwrap();
    for (sql, want) in [
        (
            "SELECT s AS c FROM types UNION ALL SELECT o FROM types",
            "string",
        ),
        (
            "SELECT CASE WHEN false THEN s ELSE o END AS c FROM types",
            "string",
        ),
        ("SELECT coalesce(o) AS c FROM types", "string"),
        ("SELECT o AS c FROM types", "object"),
    ] {
        for run in ["first", "reused"] {
            let fields = db.execute(sql).await.unwrap().fields;
            assert_eq!(fields[0].data_type, want, "{sql} ({run})");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Filters on interval and uint columns prune row groups and pages of files, which store
/// both as plain INT64 (the Iceberg views' `long`): an `INTERVAL` literal (the planner casts
/// the column to an interval to compare) as much as a duration, on either side; and the
/// answers are the brute-force ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interval_and_uint_filters_prune_files_that_store_them_as_int64() {
    let (dir, db) = database_with_t("interval-pruning", "k int, u uint, d interval").await;
    // Two files of 20,000 rows: k, u and d (in seconds) rise together, 0 to 39,999.
    for file in 0..2 {
        let body: String = (file * 20_000..(file + 1) * 20_000)
            .map(|k| format!("{{\"k\":{k},\"u\":{k},\"d\":\"PT{k}S\"}}\n"))
            .collect();
        ingest_t(&db, body).await;
        db.tables().flush_due(true).await.unwrap();
    }
    // The files hold signed INT64 without the unsigned annotation, Iceberg's `long`.
    let data = std::fs::read_dir(dir.join("objects/tables"))
        .unwrap()
        .map(|e| e.unwrap().path().join("data"))
        .find(|p| p.exists())
        .unwrap();
    for file in std::fs::read_dir(data).unwrap() {
        use parquet::file::reader::FileReader as _;
        let bytes = bytes::Bytes::from(std::fs::read(file.unwrap().path()).unwrap());
        let reader = parquet::file::reader::SerializedFileReader::new(bytes).unwrap();
        let schema = reader.metadata().file_metadata().schema_descr_ptr();
        for column in [1, 2] {
            let leaf = schema.column(column);
            assert_eq!(leaf.physical_type(), parquet::basic::Type::INT64);
            let signed = match leaf.logical_type_ref() {
                None => true,
                Some(parquet::basic::LogicalType::Integer(int)) => int.is_signed,
                Some(_) => false,
            };
            assert!(signed, "{}: {:?}", leaf.name(), leaf.logical_type_ref());
        }
    }
    for (filter, count) in [
        ("d > INTERVAL '35000 seconds'", 4_999),
        ("INTERVAL '35000 seconds' < d", 4_999),
        ("d <= INTERVAL '500 seconds'", 501),
        ("d = INTERVAL '35000 seconds'", 1),
        (
            "d > arrow_cast(35000000000000, 'Duration(Nanosecond)')",
            4_999,
        ),
        ("u > 35000", 4_999),
        ("u <= 500", 501),
    ] {
        let sql = format!("SELECT count(*) FROM t WHERE {filter}");
        let result = db.execute(&sql).await.unwrap();
        assert_eq!(
            result.rows[0][0].as_deref(),
            Some(count.to_string().as_str()),
            "{filter}"
        );
        let text = explain_analyze(&db, &sql).await;
        assert!(
            text.contains("row_groups_pruned_statistics=2 total → 1 matched"),
            "{filter}: a file's row group is pruned\n{text}"
        );
        let (pruned, total, matched) = page_rows(&text);
        assert_ne!(
            total, matched,
            "{filter}: no page was pruned: {pruned}\n{text}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
