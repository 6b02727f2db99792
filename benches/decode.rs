//! Decoder throughput: sluice's typed decoder against arrow-json's `Decoder` on the same
//! NDJSON body, in the same run.
//!
//! `cargo bench --bench decode` runs the criterion measurements and then prints a side-by-side
//! summary (MB/s of each and their ratio) from interleaved runs, so machine noise hits both.
//!
//! It then weighs what the commit log could hold to replay a decoded batch (issue 21): the
//! Arrow IPC stream it writes (uncompressed), the same with LZ4 or zstd buffers, or the
//! validated body itself, which replay would decode again. For each: bytes against the body,
//! and the CPU to write it and to read it back, in MB of body per second of one core.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use arrow_ipc::CompressionType;
use arrow_ipc::writer::IpcWriteOptions;
use arrow_json::ReaderBuilder;
use arrow_schema::{DataType, Field, Fields, Schema, TimeUnit};
use criterion::{Criterion, Throughput};
use sluice::ingest::{Decoder, Limits};

const ROWS: u64 = 100_000;

/// The closest Arrow schema arrow-json can read the same rows into. It checks less: binary
/// and interval stay strings, and the object becomes a struct of known fields.
fn arrow_json_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        // "+00:00" rather than "UTC": arrow-json resolves named zones only with chrono-tz.
        Field::new(
            "time",
            DataType::Timestamp(TimeUnit::Nanosecond, Some("+00:00".into())),
            true,
        ),
        Field::new("service", DataType::Utf8, true),
        Field::new("name", DataType::Utf8, true),
        Field::new("message", DataType::Utf8, true),
        Field::new("status", DataType::Int64, true),
        Field::new("latency", DataType::Float64, true),
        Field::new("ok", DataType::Boolean, true),
        Field::new("trace", DataType::Utf8, true),
        Field::new("elapsed", DataType::Utf8, true),
        Field::new(
            "var",
            DataType::Struct(Fields::from(vec![
                Field::new("region", DataType::Utf8, true),
                Field::new("attempt", DataType::Int64, true),
                Field::new("gateway", DataType::Utf8, true),
            ])),
            true,
        ),
    ]))
}

fn sluice_decode(decoder: &Decoder, body: &[u8], limits: &Limits) -> usize {
    match decoder.decode(body, limits) {
        Ok(batch) => batch.num_rows(),
        Err(e) => panic!("bench body must decode: {e}"),
    }
}

fn arrow_json_decode(schema: &Arc<Schema>, body: &[u8]) -> usize {
    let mut decoder = ReaderBuilder::new(schema.clone())
        .with_batch_size(8192)
        .build_decoder()
        .expect("arrow-json decoder");
    let mut rows = 0;
    let mut rest = body;
    while !rest.is_empty() {
        let used = decoder.decode(rest).expect("arrow-json decode");
        rest = &rest[used..];
        if let Some(batch) = decoder.flush().expect("arrow-json flush") {
            rows += batch.num_rows();
        }
    }
    if let Some(batch) = decoder.flush().expect("arrow-json flush") {
        rows += batch.num_rows();
    }
    rows
}

/// `batch` as an Arrow IPC stream (schema + batch), as the commit log's table records hold it.
fn ipc_encode(batch: &RecordBatch, compression: Option<CompressionType>) -> Vec<u8> {
    let options = IpcWriteOptions::default()
        .try_with_compression(compression)
        .expect("IPC compression is built in");
    let mut out = Vec::with_capacity(batch.get_array_memory_size());
    let mut writer =
        arrow_ipc::writer::StreamWriter::try_new_with_options(&mut out, &batch.schema(), options)
            .expect("IPC writer");
    writer.write(batch).expect("IPC write");
    writer.finish().expect("IPC finish");
    drop(writer);
    out
}

fn ipc_decode(bytes: &[u8]) -> usize {
    arrow_ipc::reader::StreamReader::try_new(bytes, None)
        .expect("IPC reader")
        .map(|b| b.expect("IPC batch").num_rows())
        .sum()
}

/// What the commit log could hold for one batch: size and CPU each way, best of `rounds`.
fn log_payloads(decoder: &Decoder, body: &[u8], limits: &Limits, rounds: usize) {
    let mb = body.len() as f64 / 1e6;
    let batch = decoder
        .decode(body, limits)
        .expect("bench body must decode");
    println!("what the commit log holds for a batch (best of {rounds} runs, one thread):");
    println!(
        "  {:<22} {:>9} {:>16} {:>16}",
        "payload", "of body", "write MB/s", "replay MB/s"
    );
    let mut best_decode = f64::MAX;
    for _ in 0..rounds {
        let t = Instant::now();
        sluice_decode(decoder, body, limits);
        best_decode = best_decode.min(t.elapsed().as_secs_f64());
    }
    // The body itself: written as it came, decoded again (checks included) on replay.
    println!(
        "  {:<22} {:>8.2}x {:>16} {:>16.0}",
        "NDJSON body",
        1.0,
        "(no encoding)",
        mb / best_decode
    );
    for (name, compression) in [
        ("Arrow IPC", None),
        ("Arrow IPC + LZ4 frame", Some(CompressionType::LZ4_FRAME)),
        ("Arrow IPC + zstd", Some(CompressionType::ZSTD)),
    ] {
        let (mut best_write, mut best_read, mut len) = (f64::MAX, f64::MAX, 0);
        for _ in 0..rounds {
            let t = Instant::now();
            let bytes = ipc_encode(&batch, compression);
            best_write = best_write.min(t.elapsed().as_secs_f64());
            len = bytes.len();
            let t = Instant::now();
            assert_eq!(ipc_decode(&bytes), batch.num_rows());
            best_read = best_read.min(t.elapsed().as_secs_f64());
        }
        println!(
            "  {name:<22} {:>8.2}x {:>16.0} {:>16.0}",
            len as f64 / body.len() as f64,
            mb / best_write,
            mb / best_read
        );
    }
}

fn main() {
    let body = support::events_ndjson(ROWS, 42);
    let body = body.as_bytes();
    let limits = Limits {
        max_body_bytes: 1 << 30,
        max_rows: 1 << 30,
        ..Limits::default()
    };
    let decoder = Decoder::new(&support::event_columns()).with_parallelism(1);
    let parallel = Decoder::new(&support::event_columns());
    let schema = arrow_json_schema();
    assert_eq!(sluice_decode(&decoder, body, &limits), ROWS as usize);
    assert_eq!(arrow_json_decode(&schema, body), ROWS as usize);
    let mb = body.len() as f64 / 1e6;
    println!(
        "body: {ROWS} rows, {:.1} MB, {:.0} bytes/row",
        mb,
        body.len() as f64 / ROWS as f64
    );

    let mut criterion = Criterion::default()
        .configure_from_args()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    {
        let mut group = criterion.benchmark_group("decode");
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function("sluice", |b| {
            b.iter(|| sluice_decode(&decoder, body, &limits))
        });
        group.bench_function("sluice-parallel", |b| {
            b.iter(|| sluice_decode(&parallel, body, &limits))
        });
        group.bench_function("arrow-json", |b| {
            b.iter(|| arrow_json_decode(&schema, body))
        });
        group.finish();
    }
    criterion.final_summary();

    // Side by side: alternate the two so that both see the same machine state; best of N.
    let rounds = 15;
    let (mut best_sluice, mut best_parallel, mut best_arrow) = (f64::MAX, f64::MAX, f64::MAX);
    for _ in 0..rounds {
        let t = Instant::now();
        sluice_decode(&decoder, body, &limits);
        best_sluice = best_sluice.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        sluice_decode(&parallel, body, &limits);
        best_parallel = best_parallel.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        arrow_json_decode(&schema, body);
        best_arrow = best_arrow.min(t.elapsed().as_secs_f64());
    }
    let (s, p, a) = (mb / best_sluice, mb / best_parallel, mb / best_arrow);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
    println!("side by side (best of {rounds} interleaved runs):");
    println!(
        "  sluice, 1 thread     {s:8.1} MB/s  {:10.0} rows/s",
        ROWS as f64 / best_sluice
    );
    println!(
        "  sluice, {threads} threads    {p:8.1} MB/s  {:10.0} rows/s",
        ROWS as f64 / best_parallel
    );
    println!(
        "  arrow-json, 1 thread {a:8.1} MB/s  {:10.0} rows/s",
        ROWS as f64 / best_arrow
    );
    println!("  ratio sluice 1 thread / arrow-json:  {:.2}x", s / a);
    println!(
        "  ratio sluice {threads} threads / arrow-json: {:.2}x",
        p / a
    );
    log_payloads(&decoder, body, &limits, 7);
}
