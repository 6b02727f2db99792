//! End-to-end ingest, side by side with DuckDB in the same run.
//!
//! A seeded NDJSON file of about 1 GiB (the decoder bench's row shape) is sent to a running
//! `sluice serve` (its embedded defaults) in batches of at most 16 MiB over several
//! connections; the clock stops when the last batch is acknowledged, i.e. durable in the
//! commit log and queryable. The bench then checks `count(*)`, waits until every row is in
//! Parquet, and reports MB/s, rows/s, the server's peak RSS and the Parquet bytes. DuckDB
//! converts the same file to Parquet (zstd) with explicit column types.
//!
//! Every round also loads the file into two floor servers (`support::floor`), with the same
//! loader: `receive` (bodies received and dropped) and `decode` (bodies decoded by sluice's own
//! decoder, then dropped): what the load over loopback HTTP, and the load plus the checks the
//! ingest contract asks for, cost on the machine of the run, before the commit log, the table
//! and Parquet.
//!
//! Run: `cargo bench --bench ingest` (installs DuckDB into `.tools/venv` with pip on first use).
//! Settings: `BENCH_BYTES` (default 1 GiB), `BENCH_CONNECTIONS` (4), `BENCH_BATCH_BYTES`
//! (16 MiB), `BENCH_SEED` (42), `BENCH_ROUNDS` (3: rounds alternate the two sides; the median
//! ratio is the figure).

mod support;

// sluice's allocator (`src/main.rs`), for the floor servers this executable also runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, Instant};

use support::harness::{self, RssSampler};

/// The floor servers every round loads, in this order in odd rounds and the reverse in even ones.
const FLOORS: [&str; 2] = ["receive", "decode"];

fn main() {
    if let Ok(spec) = std::env::var(support::floor::FLOOR_ENV) {
        return support::floor::serve(&spec);
    }
    if !harness::selected("ingest") {
        return;
    }
    let bytes = harness::env_or("BENCH_BYTES", 1 << 30) as u64;
    let connections = harness::env_or("BENCH_CONNECTIONS", 4);
    let batch_bytes = harness::env_or("BENCH_BATCH_BYTES", 16 << 20);
    let seed = harness::env_or("BENCH_SEED", 42) as u64;
    let (file, rows) = harness::events_file(bytes, seed);
    let file_bytes = std::fs::metadata(&file).expect("data file").len();
    let mb = file_bytes as f64 / 1e6;
    println!(
        "end-to-end ingest: {} ({rows} rows, {mb:.0} MB), {connections} connections, batches of at most {} MiB",
        file.display(),
        batch_bytes >> 20
    );
    let runtime = harness::runtime();
    // The machine's noise (other tenants, the disk) moves one run's ratio by 10-20 %; rounds
    // alternate the two sides and the median ratio is the figure.
    let rounds = harness::env_or("BENCH_ROUNDS", 3).max(1);
    let mut ratios = Vec::with_capacity(rounds);
    let mut floor_ratios: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); FLOORS.len()];
    // Not counted: one load into the `receive` floor first, so that the first round does
    // not alone pay for the file's pages and the loader's first buffers (its loader used
    // 2-6 times the CPU of later rounds').
    println!("warm-up (not counted)");
    floor_round(&runtime, "receive", &file, rows, batch_bytes, connections);
    for round in 1..=rounds {
        println!("round {round} of {rounds}");
        let (ratio, duck_seconds) =
            one_round(&runtime, &file, file_bytes, rows, batch_bytes, connections);
        ratios.push(ratio);
        let mut order: Vec<usize> = (0..FLOORS.len()).collect();
        if round % 2 == 0 {
            order.reverse();
        }
        for which in order {
            let seconds = floor_round(
                &runtime,
                FLOORS[which],
                &file,
                rows,
                batch_bytes,
                connections,
            );
            floor_ratios[which].push(duck_seconds / seconds);
        }
    }
    let median = |ratios: &mut Vec<f64>| {
        ratios.sort_by(f64::total_cmp);
        (ratios[rounds / 2], ratios[0], ratios[rounds - 1])
    };
    let (mid, min, max) = median(&mut ratios);
    println!(
        "median ratio over {rounds} rounds: sluice {mid:.2}x DuckDB's throughput to acknowledged (min {min:.2}x, max {max:.2}x; goal: at least 1.5x)",
    );
    for (kind, ratios) in FLOORS.iter().zip(&mut floor_ratios) {
        let (mid, min, max) = median(ratios);
        println!(
            "median ratio over {rounds} rounds: floor {kind} {mid:.2}x DuckDB's throughput (min {min:.2}x, max {max:.2}x)",
        );
    }
}

/// Loads the file into the floor server `kind` with the same loader as sluice's; prints and
/// returns the seconds until the last batch was answered.
fn floor_round(
    runtime: &tokio::runtime::Runtime,
    kind: &str,
    file: &std::path::Path,
    rows: u64,
    batch_bytes: usize,
    connections: usize,
) -> f64 {
    let server = support::floor::start(kind);
    let client = reqwest::Client::new();
    runtime.block_on(harness::create_events_table(&client, &server.base));
    let pid = server.child.id();
    let cpu_before = harness::cpu_seconds(pid);
    let load = runtime.block_on(harness::load(&server.base, file, batch_bytes, connections));
    let cpu = harness::cpu_seconds(pid) - cpu_before;
    assert_eq!(load.rows, rows, "the floor {kind} counted every row");
    let mb = load.bytes as f64 / 1e6;
    println!(
        "floor {kind:<8}{:>7.1} MB/s {:>10.0} rows/s  ({:.1} s; server CPU {cpu:.1} core-s, {:.2} per GB)  {}",
        mb / load.seconds,
        rows as f64 / load.seconds,
        load.seconds,
        cpu / (mb / 1e3),
        server.name,
    );
    load.seconds
}

/// One run of each side; returns sluice's throughput to acknowledged over DuckDB's, and
/// DuckDB's seconds.
fn one_round(
    runtime: &tokio::runtime::Runtime,
    file: &std::path::Path,
    file_bytes: u64,
    rows: u64,
    batch_bytes: usize,
    connections: usize,
) -> (f64, f64) {
    let mb = file_bytes as f64 / 1e6;
    // sluice
    let server = harness::start_sluice();
    let client = reqwest::Client::new();
    runtime.block_on(harness::create_events_table(&client, &server.base));
    let pid = server.child.id();
    let cpu_before = harness::cpu_seconds(pid);
    let sampler = RssSampler::start(pid);
    let loader_before = harness::cpu_seconds(std::process::id());
    let load = runtime.block_on(harness::load(&server.base, file, batch_bytes, connections));
    let cpu_at_ack = harness::cpu_seconds(pid) - cpu_before;
    let loader_cpu = harness::cpu_seconds(std::process::id()) - loader_before;
    let flush_started = Instant::now();
    let counted = runtime.block_on(harness::statement(
        &client,
        &server.base,
        "SELECT count(*) FROM events",
    ));
    let counted: u64 = counted["result_set"]["rows"][0][0]
        .as_str()
        .and_then(|c| c.parse().ok())
        .expect("count");
    assert_eq!(counted, rows, "every row acknowledged is queryable");
    assert_eq!(load.rows, rows);
    // Parquet is written in the background; wait for the last flush.
    let stats = runtime.block_on(async {
        loop {
            let s = harness::table_stats(&client, &server.base, false).await;
            if s["unflushed_rows"] == 0 {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let all_in_parquet = load.seconds + flush_started.elapsed().as_secs_f64();
    let cpu = harness::cpu_seconds(pid) - cpu_before;
    let metrics = runtime.block_on(async {
        client
            .get(format!("{}/metrics", server.base))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text")
    });
    let metric = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    let (peak_rss, hwm) = sampler.stop();
    let parquet_bytes = stats["file_bytes"].as_u64().unwrap_or(0);
    drop(server);

    // DuckDB
    let out = std::env::temp_dir().join(format!(
        "sluice-bench-duckdb-{}.parquet",
        std::process::id()
    ));
    let duck = harness::duckdb_peer(
        &[
            "convert",
            file.to_str().expect("utf-8 path"),
            out.to_str().expect("utf-8 path"),
        ],
        &serde_json::Value::Null,
    );
    let _ = std::fs::remove_file(&out);
    let duck_seconds = duck["seconds"].as_f64().expect("seconds");
    assert_eq!(duck["rows"].as_u64(), Some(rows), "DuckDB read every row");

    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "sluice   ack      {:>7.1} MB/s {:>10.0} rows/s  ({:.1} s; {} batches, {} retried after 503)",
        mb / load.seconds,
        rows as f64 / load.seconds,
        load.seconds,
        load.batches,
        load.retries,
    );
    println!(
        "sluice   parquet  {:>7.1} MB/s {:>10.0} rows/s  ({:.1} s until every row was in Parquet)",
        mb / all_in_parquet,
        rows as f64 / all_in_parquet,
        all_in_parquet,
    );
    println!(
        "duckdb   parquet  {:>7.1} MB/s {:>10.0} rows/s  ({:.1} s, {} threads)",
        mb / duck_seconds,
        rows as f64 / duck_seconds,
        duck_seconds,
        duck["threads"],
    );
    let duck_cpu = duck["cpu_seconds"].as_f64().unwrap_or(f64::NAN);
    println!(
        "CPU: sluice server {cpu:.1} core-s ({:.2} per GB) until all in Parquet; DuckDB {duck_cpu:.1} core-s ({:.2} per GB)",
        cpu / (mb / 1e3),
        duck_cpu / (mb / 1e3),
    );
    println!(
        "CPU until acknowledged: sluice server {cpu_at_ack:.1} core-s ({:.2} cores busy), the bench's loader {loader_cpu:.1} core-s ({:.2} cores)",
        cpu_at_ack / load.seconds,
        loader_cpu / load.seconds,
    );
    println!(
        "sluice work: {} Parquet files now; {} flushes ({:.1} s), {} compactions ({:.1} s); {} log syncs ({:.1} s)",
        stats["files"],
        metric("sluice_table_flushes_total"),
        metric("sluice_table_flush_seconds_total"),
        metric("sluice_table_compactions_total"),
        metric("sluice_table_compaction_seconds_total"),
        metric("sluice_log_syncs_total"),
        metric("sluice_log_sync_seconds_total"),
    );
    println!(
        "server peak RSS {:.0} MiB (sampled; VmHWM {:.0} MiB); DuckDB peak RSS {:.0} MiB",
        mib(peak_rss),
        mib(hwm),
        mib(duck["peak_rss_bytes"].as_u64().unwrap_or(0)),
    );
    println!(
        "Parquet: sluice {:.1} MiB = {:.1} % of the NDJSON; DuckDB {:.1} MiB = {:.1} %",
        mib(parquet_bytes),
        100.0 * parquet_bytes as f64 / file_bytes as f64,
        mib(duck["parquet_bytes"].as_u64().unwrap_or(0)),
        100.0 * duck["parquet_bytes"].as_f64().unwrap_or(0.0) / file_bytes as f64,
    );
    println!(
        "ratio: sluice {:.2}x DuckDB's throughput to acknowledged (durable, queryable); {:.2}x to all in Parquet",
        duck_seconds / load.seconds,
        duck_seconds / all_in_parquet,
    );
    (duck_seconds / load.seconds, duck_seconds)
}
