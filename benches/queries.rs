//! Thirteen typical verification and log-analytics queries: sluice's statements API (HTTP, JSON answers)
//! against DuckDB on the same Parquet files, in the same run. Both answers are compared, so a
//! fast wrong answer fails the bench.
//!
//! The bench loads the seeded file of the ingest bench (`target/bench-data/`, generated when
//! missing) into a fresh `sluice serve`, waits until every row is in Parquet and the file set
//! is stable (no flush or compaction running), then times each query: one warm-up, then the
//! median of `BENCH_REPEAT` runs. DuckDB reads the table's Parquet files as
//! `GET .../stats?files=true` lists them.
//!
//! Run: `cargo bench --bench queries` (installs DuckDB into `.tools/venv` on first use).
//! Settings: `BENCH_BYTES` (default 1 GiB), `BENCH_REPEAT` (9), `BENCH_SEED` (42),
//! `BENCH_ROUNDS` (5: in each round every query runs on both sides back to back, which side
//! first alternating between rounds; each query's median ratio over the rounds is the figure).

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::harness;

/// A query as each side spells it, and which result columns the two must agree on (text
/// compare; floats within 1e-9 relative). `{point}`/`{point_end}` are the middle second of
/// the file's time span, `{from}`/`{to}` its middle quarter (the generator writes 50 rows a
/// second from 2026-10-23T09:00:00Z), so every size of file has rows to find.
struct Query {
    name: &'static str,
    sluice: &'static str,
    duckdb: &'static str,
    compare: &'static [usize],
}

const QUERIES: &[Query] = &[
    Query {
        name: "point lookup (1 s of one service)",
        sluice: "SELECT time, service, name, status, latency FROM events \
                 WHERE time >= '{point}' AND time < '{point_end}' \
                 AND service = 'checkout' ORDER BY time",
        duckdb: "SELECT time, service, name, status, latency FROM events \
                 WHERE time >= '{point}' AND time < '{point_end}' \
                 AND service = 'checkout' ORDER BY time",
        compare: &[1, 2, 3, 4],
    },
    Query {
        name: "count by service, a quarter of the time",
        sluice: "SELECT service, count(*) AS n FROM events \
                 WHERE time >= '{from}' AND time < '{to}' \
                 GROUP BY service ORDER BY service",
        duckdb: "SELECT service, count(*) AS n FROM events \
                 WHERE time >= '{from}' AND time < '{to}' \
                 GROUP BY service ORDER BY service",
        compare: &[0, 1],
    },
    Query {
        name: "errors per hour",
        sluice: "SELECT date_trunc('hour', time) AS hour, count(*) AS n FROM events \
                 WHERE status = 500 GROUP BY 1 ORDER BY 1",
        duckdb: "SELECT date_trunc('hour', time) AS hour, count(*) AS n FROM events \
                 WHERE status = 500 GROUP BY 1 ORDER BY 1",
        compare: &[1],
    },
    Query {
        name: "top 10 slowest failures",
        sluice: "SELECT time, service, latency FROM events WHERE status = 500 \
                 ORDER BY latency DESC, time LIMIT 10",
        duckdb: "SELECT time, service, latency FROM events WHERE status = 500 \
                 ORDER BY latency DESC, time LIMIT 10",
        compare: &[1, 2],
    },
    Query {
        name: "JSON field: failures by region",
        sluice: "SELECT json_get_str(var, 'region') AS region, count(*) AS n FROM events \
                 WHERE status = 500 GROUP BY 1 ORDER BY 1",
        duckdb: "SELECT json_extract_string(var, '$.region') AS region, count(*) AS n FROM events \
                 WHERE status = 500 GROUP BY 1 ORDER BY 1",
        compare: &[0, 1],
    },
    Query {
        name: "count all rows",
        sluice: "SELECT count(*) AS n FROM events",
        duckdb: "SELECT count(*) AS n FROM events",
        compare: &[0],
    },
    Query {
        name: "distinct event names",
        sluice: "SELECT count(DISTINCT name) AS n FROM events",
        duckdb: "SELECT count(DISTINCT name) AS n FROM events",
        compare: &[0],
    },
    Query {
        name: "count by name",
        sluice: "SELECT name, count(*) AS n FROM events GROUP BY name ORDER BY name",
        duckdb: "SELECT name, count(*) AS n FROM events GROUP BY name ORDER BY name",
        compare: &[0, 1],
    },
    Query {
        name: "latency by service",
        sluice: "SELECT service, avg(latency) AS mean, max(latency) AS slowest FROM events \
                 GROUP BY service ORDER BY service",
        duckdb: "SELECT service, avg(latency) AS mean, max(latency) AS slowest FROM events \
                 GROUP BY service ORDER BY service",
        compare: &[0, 1, 2],
    },
    Query {
        name: "count by status",
        sluice: "SELECT status, count(*) AS n FROM events GROUP BY status ORDER BY status",
        duckdb: "SELECT status, count(*) AS n FROM events GROUP BY status ORDER BY status",
        compare: &[0, 1],
    },
    Query {
        name: "text search in messages",
        sluice: "SELECT count(*) AS n FROM events WHERE message LIKE '%upstream returned%'",
        duckdb: "SELECT count(*) AS n FROM events WHERE message LIKE '%upstream returned%'",
        compare: &[0],
    },
    Query {
        name: "latest 20 events",
        sluice: "SELECT time, service, name FROM events ORDER BY time DESC, service, name LIMIT 20",
        duckdb: "SELECT time, service, name FROM events ORDER BY time DESC, service, name LIMIT 20",
        compare: &[1, 2],
    },
    Query {
        name: "failures by service and name",
        sluice: "SELECT service, name, count(*) AS n FROM events WHERE status >= 400 \
                 GROUP BY service, name ORDER BY n DESC, service, name LIMIT 10",
        duckdb: "SELECT service, name, count(*) AS n FROM events WHERE status >= 400 \
                 GROUP BY service, name ORDER BY n DESC, service, name LIMIT 10",
        compare: &[0, 1, 2],
    },
];

/// `sql` with the time placeholders filled in for a file of `rows` rows.
fn with_times(sql: &str, rows: u64) -> String {
    let start = chrono::DateTime::from_timestamp(1_792_746_000, 0).expect("start time");
    let span = i64::try_from(rows / 50).expect("span");
    let at = |secs: i64| {
        (start + chrono::Duration::seconds(secs))
            .format("%Y-%m-%dT%H:%M:%SZ")
            .to_string()
    };
    sql.replace("{point_end}", &at(span / 2 + 1))
        .replace("{point}", &at(span / 2))
        .replace("{from}", &at(span * 3 / 8))
        .replace("{to}", &at(span * 5 / 8))
}

fn same_cell(a: &Value, b: &Value) -> bool {
    match (a.as_str(), b.as_str()) {
        (Some(x), Some(y)) if x == y => true,
        (Some(x), Some(y)) => match (x.parse::<f64>(), y.parse::<f64>()) {
            (Ok(p), Ok(q)) => (p - q).abs() <= 1e-9 * p.abs().max(q.abs()).max(1.0),
            _ => false,
        },
        _ => a == b,
    }
}

fn main() {
    if !harness::selected("queries") {
        return;
    }
    let bytes = harness::env_or("BENCH_BYTES", 1 << 30) as u64;
    let repeat = harness::env_or("BENCH_REPEAT", 9);
    let seed = harness::env_or("BENCH_SEED", 42) as u64;
    let (file, rows) = harness::events_file(bytes, seed);
    let runtime = harness::runtime();
    let server = harness::start_sluice();
    let client = reqwest::Client::new();
    let base = server.base.clone();
    let files: Vec<String> = runtime.block_on(async {
        harness::create_events_table(&client, &base).await;
        let load = harness::load(&base, &file, 16 << 20, 4).await;
        assert_eq!(load.rows, rows);
        // Every row in Parquet, and the same files for 3 s (compaction done).
        let mut last = Value::Null;
        let mut stable_since = Instant::now();
        loop {
            let s = harness::table_stats(&client, &base, true).await;
            if s["file_list"] != last {
                last = s["file_list"].clone();
                stable_since = Instant::now();
            } else if s["unflushed_rows"] == 0 && stable_since.elapsed() > Duration::from_secs(3) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        last.as_array()
            .expect("file list")
            .iter()
            .map(|f| {
                // The default object store: `objects/` under the data directory.
                server
                    .dir
                    .join("objects")
                    .join(f["path"].as_str().expect("path"))
                    .display()
                    .to_string()
            })
            .collect()
    });
    let parquet: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).expect("listed file exists").len())
        .sum();
    // The machine's noise moves single measurements by 10-20 %: each query's figure is its
    // median ratio over the rounds.
    let rounds = harness::env_or("BENCH_ROUNDS", 5).max(1);
    println!(
        "queries: {rows} rows in {} Parquet files ({:.0} MiB); median of {repeat} runs after a warm-up, {rounds} rounds",
        files.len(),
        parquet as f64 / (1 << 20) as f64
    );
    // Per query: (sluice ms, DuckDB ms) of every round.
    let mut timings: Vec<Vec<(f64, f64)>> = vec![Vec::new(); QUERIES.len()];
    let mut rows_answered = vec![0; QUERIES.len()];
    for round in 0..rounds {
        for (i, q) in QUERIES.iter().enumerate() {
            // The two sides of a query run one right after the other (the server is idle
            // while DuckDB runs), the first side alternating between rounds: a burst of the
            // machine's noise then lands on both sides of one query, or on one side of one
            // round, not on every query of one side.
            let ours = || {
                let sql = with_times(q.sluice, rows);
                runtime.block_on(async {
                    harness::statement(&client, &base, &sql).await;
                    let mut times = Vec::new();
                    let mut answer = Value::Null;
                    for _ in 0..repeat {
                        let started = Instant::now();
                        answer = harness::statement(&client, &base, &sql).await;
                        times.push(started.elapsed().as_secs_f64() * 1e3);
                    }
                    times.sort_by(f64::total_cmp);
                    (times[times.len() / 2], answer["result_set"]["rows"].clone())
                })
            };
            let theirs = || {
                let spec = json!({
                    "files": files,
                    "repeat": repeat,
                    "queries": [{"name": q.name, "sql": with_times(q.duckdb, rows)}],
                });
                harness::duckdb_peer(&["query"], &spec)
            };
            let ((ms, answer), theirs) = if round % 2 == 0 {
                let ours = ours();
                (ours, theirs())
            } else {
                let theirs = theirs();
                (ours(), theirs)
            };
            let duck = &theirs[q.name];
            let duck_ms = duck["median_ms"].as_f64().expect("median");
            let a = answer.as_array().expect("sluice rows");
            let b = duck["rows"].as_array().expect("duckdb rows");
            assert_eq!(a.len(), b.len(), "{}: row counts differ", q.name);
            assert!(!a.is_empty(), "{}: the query matched nothing", q.name);
            for (ra, rb) in a.iter().zip(b) {
                for &c in q.compare {
                    assert!(
                        same_cell(&ra[c], &rb[c]),
                        "{}: answers differ: {ra} vs {rb}",
                        q.name
                    );
                }
            }
            timings[i].push((ms, duck_ms));
            rows_answered[i] = a.len();
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut worst: f64 = 0.0;
    let mut log_sum = 0.0;
    println!(
        "{:<36} {:>10} {:>10} {:>8} {:>17} {:>6}",
        "query", "sluice ms", "duckdb ms", "ratio", "rounds' ratios", "rows"
    );
    for (i, q) in QUERIES.iter().enumerate() {
        let ratios: Vec<f64> = timings[i].iter().map(|(s, d)| s / d).collect();
        let ratio = median(ratios.clone());
        worst = worst.max(ratio);
        log_sum += ratio.ln();
        let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        println!(
            "{:<36} {:>10.1} {:>10.1} {:>7.2}x {:>17} {:>6}",
            q.name,
            median(timings[i].iter().map(|t| t.0).collect()),
            median(timings[i].iter().map(|t| t.1).collect()),
            ratio,
            each.join(" "),
            rows_answered[i]
        );
    }
    println!(
        "geometric mean of the median ratios: {:.2}x; worst: {worst:.2}x (goal: every query at most 1.0x DuckDB's time)",
        (log_sum / QUERIES.len() as f64).exp()
    );
    drop(server);
}
