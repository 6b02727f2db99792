//! Commit-log appends with fsync at 1, 16 and 256 concurrent appenders (256-byte records), and
//! table flush throughput (Arrow bytes turned into Parquet on object storage per second).
//!
//! `cargo bench --bench storage` runs the criterion measurements, then prints appends/s,
//! fsyncs/s and flush MB/s from runs of fixed size.

mod support;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use sluice::ingest::{Decoder, Limits};
use sluice::log::{CommitLog, LogConfig, RecordKind};
use sluice::storage::Storage;
use sluice::table::{TableConfig, Tables};

const RECORD: [u8; 256] = [7; 256];

fn bench_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `appenders` tasks append `per_task` records each; returns the elapsed time.
async fn append_round(log: &CommitLog, appenders: usize, per_task: usize) -> Duration {
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(appenders);
    for _ in 0..appenders {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..per_task {
                log.append(RecordKind::StreamAppend, RECORD.to_vec())
                    .await
                    .expect("append");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    started.elapsed()
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut criterion = Criterion::default()
        .configure_from_args()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));

    let dir = bench_dir("log");
    let (log, _) = CommitLog::open(LogConfig::new(&dir)).expect("open log");
    let levels = [1usize, 16, 256];
    {
        let mut group = criterion.benchmark_group("log_append_fsync");
        for &appenders in &levels {
            let per_task = (1024 / appenders).max(4);
            group.throughput(Throughput::Elements((appenders * per_task) as u64));
            group.bench_function(format!("{appenders}_appenders"), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        total += runtime.block_on(append_round(&log, appenders, per_task));
                    }
                    total
                })
            });
        }
        group.finish();
    }

    // Flush: Arrow batches of event rows to Parquet in an in-memory object store.
    let columns = support::event_columns();
    let body = support::events_ndjson(50_000, 7);
    let batch = Decoder::new(&columns)
        .decode(
            body.as_bytes(),
            &Limits {
                max_body_bytes: 1 << 30,
                ..Limits::default()
            },
        )
        .expect("decode");
    let arrow_bytes = batch.get_array_memory_size();
    let flush_dir = bench_dir("flush");
    let mut flush_config = LogConfig::new(&flush_dir);
    flush_config.consumers = vec!["tables".into()];
    let (flush_log, replay) = CommitLog::open(flush_config).expect("open log");
    let storage = Storage::open("memory://").expect("memory store");
    let node = runtime
        .block_on(sluice::node::Node::claim(
            &flush_dir,
            storage.clone(),
            sluice::node::LogState {
                has_records: !replay.is_empty(),
                last_lsn: flush_log.last_lsn(),
                synced: true,
                remote: false,
            },
            Duration::from_secs(1),
            None,
        ))
        .expect("node");
    let tables = Arc::new(
        runtime
            .block_on(Tables::open(
                flush_log,
                &replay,
                storage,
                Arc::new(node),
                TableConfig::default(),
                Duration::from_secs(600),
                None,
            ))
            .expect("tables"),
    );
    runtime
        .block_on(tables.create_table("events", &columns))
        .expect("create");
    {
        let mut group = criterion.benchmark_group("table_flush");
        group.throughput(Throughput::Bytes(arrow_bytes as u64));
        group.bench_function("events_50k_rows", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    runtime
                        .block_on(tables.append("events", batch.clone()))
                        .expect("append");
                    let started = Instant::now();
                    runtime.block_on(tables.flush("events")).expect("flush");
                    total += started.elapsed();
                }
                total
            })
        });
        group.finish();
    }
    criterion.final_summary();

    println!("summary (fixed-size runs):");
    for &appenders in &levels {
        let per_task = (4096 / appenders).max(16);
        let syncs_before = log.stats().syncs.load(Ordering::Relaxed);
        let elapsed = runtime.block_on(append_round(&log, appenders, per_task));
        let syncs = log.stats().syncs.load(Ordering::Relaxed) - syncs_before;
        let appends = (appenders * per_task) as f64;
        println!(
            "  log, {appenders:>3} appenders: {:>9.0} appends/s  {:>7.0} fsyncs/s  {:>6.1} appends per fsync",
            appends / elapsed.as_secs_f64(),
            syncs as f64 / elapsed.as_secs_f64(),
            appends / syncs.max(1) as f64,
        );
    }
    preallocation(&runtime);
    let rounds = 5;
    let mut best = f64::MAX;
    let mut parquet_bytes = 0;
    for _ in 0..rounds {
        runtime
            .block_on(tables.append("events", batch.clone()))
            .expect("append");
        let started = Instant::now();
        let file = runtime
            .block_on(tables.flush("events"))
            .expect("flush")
            .expect("file");
        best = best.min(started.elapsed().as_secs_f64());
        parquet_bytes = file.bytes;
    }
    println!(
        "  flush: {:.1} MB/s of Arrow data ({:.1} MB Arrow -> {:.1} MB Parquet, NDJSON {:.1} MB; best of {rounds})",
        arrow_bytes as f64 / 1e6 / best,
        arrow_bytes as f64 / 1e6,
        parquet_bytes as f64 / 1e6,
        body.len() as f64 / 1e6,
    );
    log.close();
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(flush_dir);
}

/// Preallocated segments (the default) against segments that grow with every group, in the
/// same run: appends/s and the mean time of one `fdatasync`, rounds alternating.
fn preallocation(runtime: &tokio::runtime::Runtime) {
    let open = |preallocate: bool| {
        let dir = bench_dir(if preallocate { "prealloc" } else { "growing" });
        let mut config = LogConfig::new(&dir);
        config.preallocate = preallocate;
        let (log, _) = CommitLog::open(config).expect("open log");
        (log, dir)
    };
    let (preallocated, dir_a) = open(true);
    let (growing, dir_b) = open(false);
    println!("  preallocated segments against growing ones (3 alternating rounds each):");
    for appenders in [1usize, 16] {
        let per_task = (2048 / appenders).max(16);
        let mut figures = [(0.0f64, 0u64, 0u64); 2];
        for _ in 0..3 {
            for (i, log) in [&preallocated, &growing].into_iter().enumerate() {
                let syncs = log.stats().syncs.load(Ordering::Relaxed);
                let nanos = log.stats().sync_nanos.load(Ordering::Relaxed);
                let elapsed = runtime.block_on(append_round(log, appenders, per_task));
                figures[i].0 += elapsed.as_secs_f64();
                figures[i].1 += log.stats().syncs.load(Ordering::Relaxed) - syncs;
                figures[i].2 += log.stats().sync_nanos.load(Ordering::Relaxed) - nanos;
            }
        }
        let appends = (3 * appenders * per_task) as f64;
        let rate = |f: (f64, u64, u64)| appends / f.0;
        let sync_ms = |f: (f64, u64, u64)| f.2 as f64 / f.1.max(1) as f64 / 1e6;
        println!(
            "    {appenders:>2} appenders: preallocated {:>7.0} appends/s, {:.3} ms per fdatasync; growing {:>7.0} appends/s, {:.3} ms; {:.2}x the appends/s",
            rate(figures[0]),
            sync_ms(figures[0]),
            rate(figures[1]),
            sync_ms(figures[1]),
            rate(figures[0]) / rate(figures[1]),
        );
    }
    preallocated.close();
    growing.close();
    let _ = std::fs::remove_dir_all(dir_a);
    let _ = std::fs::remove_dir_all(dir_b);
}
