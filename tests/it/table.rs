//! Table storage conformance: the same suite against every object-store backend (a local
//! directory and memory; S3 when `SLUICE_TEST_S3_URL` is set).
//!
//! Every test appends rows with unique ids and checks, from a snapshot (Parquet files read back
//! from the store plus unflushed batches), that each acknowledged id is there exactly once.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use object_store::ObjectStoreExt as _;
use object_store::path::Path;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use sluice::ingest::{Decoder, Limits};
use sluice::log::{CommitLog, LogConfig};
use sluice::node::{LogState, Node};
use sluice::storage::Storage;
use sluice::storage::probe::{Probe, ProbedStore};
use sluice::table::{TableConfig, TableError, TableSnapshot, Tables};
use sluice::types::{Column, ColumnType};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// One test's world: a data directory for logs and a store that outlives "restarts".
struct World {
    dir: PathBuf,
    storage: Storage,
}

fn world(backend: &str) -> World {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("sluice-table-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let storage = match backend {
        "memory" => Storage::open("memory://").unwrap(),
        "local" => Storage::open(dir.join("objects").to_str().unwrap()).unwrap(),
        "s3" => {
            let base = std::env::var("SLUICE_TEST_S3_URL").expect("SLUICE_TEST_S3_URL");
            Storage::open(&format!("{base}/table-{}-{n}", std::process::id())).unwrap()
        }
        other => panic!("unknown backend {other}"),
    };
    World { dir, storage }
}

impl World {
    /// Opens (or reopens, after a "crash") node `node`'s log and table engine.
    async fn open(&self, node: &str, config: TableConfig) -> (CommitLog, Tables) {
        open_tables(
            LogConfig::new(self.dir.join(node)),
            self.storage.clone(),
            config,
        )
        .await
    }
}

/// A node over the log `log_config` describes (its directory is the node's data directory),
/// as the database opens one: the log, the node's claim of its id, then the tables.
async fn open_tables(
    mut log_config: LogConfig,
    storage: Storage,
    config: TableConfig,
) -> (CommitLog, Tables) {
    log_config.consumers = vec!["tables".into()];
    let dir = log_config.dir.clone();
    let (log, replay) = CommitLog::open(log_config).unwrap();
    let node = Node::claim(
        &dir,
        storage.clone(),
        LogState {
            has_records: !replay.is_empty(),
            last_lsn: log.last_lsn(),
            synced: true,
            remote: false,
        },
        std::time::Duration::from_secs(1),
        None,
    )
    .await
    .unwrap();
    log.advance_to(node.lsn_base()).await.unwrap();
    let tables = Tables::open(
        log.clone(),
        &replay,
        storage,
        Arc::new(node),
        config,
        std::time::Duration::from_secs(600),
        None,
    )
    .await
    .unwrap();
    (log, tables)
}

fn columns() -> Vec<Column> {
    vec![
        Column::new("id", ColumnType::Int),
        Column::new("time", ColumnType::Timestamp),
        Column::new("note", ColumnType::String),
        Column::new("took", ColumnType::Interval),
        Column::new("var", ColumnType::Object),
        Column::new("blob", ColumnType::Binary),
    ]
}

/// A batch with ids `from..to`, through the real decoder.
fn batch(from: i64, to: i64) -> RecordBatch {
    let mut body = String::new();
    for id in from..to {
        body.push_str(&format!(
            "{{\"id\":{id},\"time\":\"2026-10-23T09:{:02}:00Z\",\"note\":\"row {id}\",\"took\":\"PT{id}S\",\"var\":{{\"k\":[{id}]}},\"blob\":\"AAE=\"}}\n",
            id % 60
        ));
    }
    Decoder::new(&columns())
        .decode(body.as_bytes(), &Limits::default())
        .unwrap()
}

/// Every id in a snapshot, reading its Parquet files from the store.
async fn ids(storage: &Storage, snapshot: &TableSnapshot) -> Vec<i64> {
    let mut out = Vec::new();
    let mut push = |b: &RecordBatch| {
        let col = b.column_by_name("id").unwrap().as_primitive::<Int64Type>();
        out.extend(col.values().iter().copied());
    };
    for f in &snapshot.files {
        let bytes = storage
            .store()
            .get(&Path::from(f.path.as_str()))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(bytes.len() as u64, f.bytes);
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
            .unwrap()
            .build()
            .unwrap();
        for b in reader {
            push(&b.unwrap());
        }
    }
    if let Some(spilled) = snapshot.spilled.clone() {
        let read =
            tokio::task::spawn_blocking(move || spilled.read().collect::<Result<Vec<_>, _>>())
                .await
                .unwrap()
                .expect("spilled batches read back from the log");
        for b in &read {
            push(b);
        }
    }
    for b in &snapshot.batches {
        push(b);
    }
    out
}

/// Asserts the table holds exactly the ids `0..n`, each once.
async fn assert_exactly(storage: &Storage, tables: &Tables, table: &str, n: i64) {
    let snapshot = tables.snapshot(table).await.unwrap();
    let mut got = ids(storage, &snapshot).await;
    got.sort_unstable();
    assert_eq!(got.len() as i64, n, "row count");
    assert_eq!(got, (0..n).collect::<Vec<_>>(), "each id exactly once");
    assert_eq!(snapshot.num_rows() as i64, n);
}

async fn append_flush_reopen(backend: &str) {
    let w = world(backend);
    let (log, tables) = w.open("node-a", TableConfig::default()).await;
    tables.create_table("t1", &columns()).await.unwrap();
    tables.append("t1", batch(0, 10)).await.unwrap();
    // Visible at once, before any flush.
    assert_exactly(&w.storage, &tables, "t1", 10).await;
    let file = tables.flush("t1").await.unwrap().expect("a file");
    assert_eq!(file.rows, 10);
    assert_eq!(file.time_ranges["time"].0, 1_792_746_000_000_000_000);
    let s = tables.snapshot("t1").await.unwrap();
    assert_eq!((s.files.len(), s.batches.len()), (1, 0));
    tables.append("t1", batch(10, 25)).await.unwrap();
    assert_exactly(&w.storage, &tables, "t1", 25).await;
    // "Crash": drop everything without flushing the second batch.
    log.close();
    drop(tables);
    let (log, tables) = w.open("node-a", TableConfig::default()).await;
    assert_exactly(&w.storage, &tables, "t1", 25).await;
    let s = tables.snapshot("t1").await.unwrap();
    assert_eq!(
        (s.files.len(), s.batches.len()),
        (1, 1),
        "flushed rows are not replayed"
    );
    tables.flush_due(true).await.unwrap();
    log.close();
    drop(tables);
    let (_log, tables) = w.open("node-a", TableConfig::default()).await;
    assert_exactly(&w.storage, &tables, "t1", 25).await;
    assert_eq!(tables.snapshot("t1").await.unwrap().batches.len(), 0);
}

async fn parquet_keeps_types_and_metadata(backend: &str) {
    let w = world(backend);
    let (_log, tables) = w.open("n", TableConfig::default()).await;
    tables.create_table("typed", &columns()).await.unwrap();
    let original = batch(0, 5);
    tables.append("typed", original.clone()).await.unwrap();
    let file = tables.flush("typed").await.unwrap().unwrap();
    let bytes = w
        .storage
        .store()
        .get(&Path::from(file.path.as_str()))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
        .unwrap()
        .build()
        .unwrap();
    let back: Vec<RecordBatch> = reader.map(|b| b.unwrap()).collect();
    assert_eq!(back.len(), 1);
    // The file's schema is what Iceberg readers take: each column has its field id (its
    // position from 1) and its sluice type; an interval is Int64 nanoseconds and JSON is
    // plain Utf8 (no Arrow Duration, no extension type).
    let file_schema = back[0].schema();
    for (i, (field, column)) in file_schema.fields().iter().zip(columns()).enumerate() {
        let metadata = field.metadata();
        assert_eq!(
            metadata.get("PARQUET:field_id"),
            Some(&(i + 1).to_string()),
            "{}",
            field.name()
        );
        assert_eq!(
            metadata.get("sluice.type").map(String::as_str),
            Some(column.data_type.as_str())
        );
        assert!(!metadata.contains_key("ARROW:extension:name"));
    }
    assert_eq!(
        file_schema.field_with_name("took").unwrap().data_type(),
        &arrow_schema::DataType::Int64
    );
    // Cast back to the table's types (as the query scan does), the values are the originals.
    let columns: Vec<ArrayRef> = back[0]
        .columns()
        .iter()
        .zip(original.schema().fields())
        .map(|(c, f)| arrow_cast::cast(c, f.data_type()).unwrap())
        .collect();
    let restored = RecordBatch::try_new(original.schema(), columns).unwrap();
    assert_eq!(restored, original, "values survive Parquet");
}

async fn concurrent_appends_and_flushes(backend: &str) {
    let w = world(backend);
    let (log, tables) = w.open("n", TableConfig::default()).await;
    let tables = Arc::new(tables);
    tables.create_table("busy", &columns()).await.unwrap();
    let mut tasks = Vec::new();
    for task in 0..16i64 {
        let tables = tables.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..10 {
                let from = (task * 10 + i) * 5;
                tables.append("busy", batch(from, from + 5)).await.unwrap();
            }
        }));
    }
    let flusher = {
        let tables = tables.clone();
        tokio::spawn(async move {
            for _ in 0..20 {
                tables.flush("busy").await.unwrap();
                tokio::task::yield_now().await;
            }
        })
    };
    for t in tasks {
        t.await.unwrap();
    }
    flusher.await.unwrap();
    assert_exactly(&w.storage, &tables, "busy", 800).await;
    tables.flush("busy").await.unwrap();
    assert_exactly(&w.storage, &tables, "busy", 800).await;
    log.close();
    let (_log, tables) = w.open("n", TableConfig::default()).await;
    assert_exactly(&w.storage, &tables, "busy", 800).await;
}

async fn two_writers_race_for_manifest_versions(backend: &str) {
    let w = world(backend);
    let (_la, a) = w.open("node-a", TableConfig::default()).await;
    let (_lb, b) = w.open("node-b", TableConfig::default()).await;
    a.create_table("shared", &columns()).await.unwrap();
    // The second node's create sees the same columns and succeeds without a new version.
    b.create_table("shared", &columns()).await.unwrap();
    let (a, b) = (Arc::new(a), Arc::new(b));
    let mut tasks = Vec::new();
    for (node, tables) in [(0i64, a.clone()), (1, b.clone())] {
        tasks.push(tokio::spawn(async move {
            for round in 0..6i64 {
                let from = (round * 2 + node) * 10;
                tables
                    .append("shared", batch(from, from + 10))
                    .await
                    .unwrap();
                tables.flush("shared").await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Each node knows its own commits and those it raced past; a refresh brings the rest.
    a.refresh("shared").await.unwrap();
    b.refresh("shared").await.unwrap();
    let sa = a.snapshot("shared").await.unwrap();
    let sb = b.snapshot("shared").await.unwrap();
    assert_eq!(sa.version, 12, "one version per flush, none lost or forked");
    assert_eq!(sa.files, sb.files);
    assert_exactly(&w.storage, &a, "shared", 120).await;
    // A third node opening the table from storage alone sees everything.
    let (_lc, c) = w.open("node-c", TableConfig::default()).await;
    assert_exactly(&w.storage, &c, "shared", 120).await;
    // A create with other columns is refused.
    let other = vec![Column::new("x", ColumnType::String)];
    assert!(matches!(
        c.create_table("shared", &other).await,
        Err(TableError::AlreadyExists(_))
    ));
}

async fn compaction_during_reads(backend: &str) {
    // Files of tiny row groups are re-encoded into one group; files of full row groups (8
    // rows each here) are spliced as they are, keeping their groups.
    for (row_group_rows, groups) in [(128 * 1024, 1), (8, 12)] {
        compact_with(backend, row_group_rows, groups).await;
    }
}

async fn compact_with(backend: &str, row_group_rows: usize, expected_groups: usize) {
    let w = world(backend);
    let config = TableConfig {
        compact_min_files: 4,
        row_group_rows,
        ..TableConfig::default()
    };
    let (_log, tables) = w.open("n", config.clone()).await;
    tables.create_table("small", &columns()).await.unwrap();
    for i in 0..6i64 {
        tables
            .append("small", batch(i * 10, i * 10 + 10))
            .await
            .unwrap();
        tables.flush("small").await.unwrap();
    }
    tables.append("small", batch(60, 70)).await.unwrap();
    let before = tables.snapshot("small").await.unwrap();
    assert_eq!(before.files.len(), 6);
    let merged = tables.compact("small").await.unwrap().expect("compacted");
    assert_eq!(merged.rows, 60);
    let bytes = w
        .storage
        .store()
        .get(&Path::from(merged.path.as_str()))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(merged.bytes, bytes.len() as u64);
    let reader = ParquetRecordBatchReaderBuilder::try_new(bytes).unwrap();
    assert_eq!(reader.metadata().num_row_groups(), expected_groups);
    // The merged file keeps the file schema (field ids and sluice types; see
    // `parquet_keeps_types_and_metadata`) and the time range of its inputs.
    let table_schema = tables.schema("small").await.unwrap();
    for (i, (file, table)) in reader
        .schema()
        .fields()
        .iter()
        .zip(table_schema.fields())
        .enumerate()
    {
        assert_eq!(file.name(), table.name());
        assert_eq!(
            file.metadata().get("PARQUET:field_id"),
            Some(&(i + 1).to_string())
        );
        assert_eq!(
            file.metadata().get("sluice.type"),
            table.metadata().get("sluice.type")
        );
    }
    let ranges: Vec<_> = before.files.iter().map(|f| f.time_ranges["time"]).collect();
    let lo = ranges.iter().map(|r| r.0).min().unwrap();
    let hi = ranges.iter().map(|r| r.1).max().unwrap();
    assert_eq!(merged.time_ranges["time"], (lo, hi));
    let after = tables.snapshot("small").await.unwrap();
    assert_eq!(after.files.len(), 1);
    assert_exactly(&w.storage, &tables, "small", 70).await;
    // A snapshot taken before the compaction still reads its (replaced) files.
    let mut old = ids(&w.storage, &before).await;
    old.sort_unstable();
    assert_eq!(old, (0..70).collect::<Vec<_>>());
    // Nothing more to compact; a reopen reads the compacted state (through a checkpoint once
    // there are enough versions).
    assert!(tables.compact("small").await.unwrap().is_none());
    let (_l2, reopened) = w.open("n2", config).await;
    assert_exactly(&w.storage, &reopened, "small", 60).await;
}

async fn checkpoints_bound_what_opening_reads(backend: &str) {
    let w = world(backend);
    let config = TableConfig {
        checkpoint_interval: 5,
        ..TableConfig::default()
    };
    let (_log, tables) = w.open("n", config.clone()).await;
    tables.create_table("cp", &columns()).await.unwrap();
    for i in 0..12i64 {
        tables.append("cp", batch(i, i + 1)).await.unwrap();
        tables.flush("cp").await.unwrap();
    }
    let store = w.storage.store();
    for v in [5u64, 10] {
        let path = Path::from(format!("tables/cp/_log/{v:020}.checkpoint.json"));
        store.head(&path).await.expect("checkpoint written");
    }
    // Delete the versions the checkpoint covers: opening must not need them.
    for v in 0..=10u64 {
        store
            .delete(&Path::from(format!("tables/cp/_log/{v:020}.json")))
            .await
            .unwrap();
    }
    let (_l2, other) = w.open("other", config).await;
    let snapshot = other.snapshot("cp").await.unwrap();
    assert_eq!(snapshot.version, 12);
    assert_exactly(&w.storage, &other, "cp", 12).await;
}

async fn backpressure_applies_nothing(backend: &str) {
    // Spilling off: the memory budget alone.
    backpressure_applies_nothing_with(backend, 0).await;
    // The spill budget taken by the first batch.
    backpressure_applies_nothing_with(backend, 1).await;
}

async fn backpressure_applies_nothing_with(backend: &str, max_spilled_bytes: usize) {
    let w = world(backend);
    let config = TableConfig {
        max_unflushed_bytes: 1,
        max_spilled_bytes,
        // Nothing flushes here: the wait for headroom runs out.
        headroom_wait: std::time::Duration::from_millis(100),
        ..TableConfig::default()
    };
    let (_log, tables) = w.open("n", config).await;
    tables.create_table("bp", &columns()).await.unwrap();
    tables.append("bp", batch(0, 10)).await.unwrap();
    // With spilling on, the first batch is spilled (which takes the spill budget), and the
    // second is held in memory.
    let accepted = if max_spilled_bytes > 0 { 20 } else { 10 };
    if max_spilled_bytes > 0 {
        tables.append("bp", batch(10, 20)).await.unwrap();
    }
    let err = tables
        .append("bp", batch(accepted, accepted + 10))
        .await
        .unwrap_err();
    assert!(sluice::error::Classify::class(&err).is_retryable(), "{err}");
    assert!(matches!(err, TableError::Backpressure { .. }));
    assert_exactly(&w.storage, &tables, "bp", accepted).await;
    tables.flush("bp").await.unwrap();
    tables
        .append("bp", batch(accepted, accepted + 10))
        .await
        .unwrap();
    assert_exactly(&w.storage, &tables, "bp", accepted + 10).await;
}

/// A memory budget every batch is over: each is spilled once appended.
fn spilling() -> TableConfig {
    TableConfig {
        max_unflushed_bytes: 1,
        ..TableConfig::default()
    }
}

/// Spilled batches are read back from the log by snapshots and flushes, across segment
/// rollovers, and by a snapshot taken before a flush released the log; after crashes in quick
/// succession they are replayed (and spilled again) with every row exactly once.
async fn spilled_batches_are_read_back_from_the_log(backend: &str) {
    let w = world(backend);
    let mut config = LogConfig::new(w.dir.join("spill"));
    // A record is larger than a segment: every group rolls the log.
    config.segment_bytes = 4096;
    let (log, tables) = open_tables(config.clone(), w.storage.clone(), spilling()).await;
    tables.create_table("s", &columns()).await.unwrap();
    for i in 0..20 {
        tables
            .append("s", batch(i * 10, i * 10 + 10))
            .await
            .unwrap();
    }
    let stats = tables.stats("s").await.unwrap();
    assert!(stats.spilled_bytes > 0);
    assert_eq!(
        stats.spilled_bytes, stats.unflushed_bytes,
        "every batch spilled"
    );
    let before = tables.snapshot("s").await.unwrap();
    assert!(before.batches.is_empty());
    assert_eq!(before.spilled.as_ref().map(|s| s.len()), Some(20));
    assert_exactly(&w.storage, &tables, "s", 200).await;
    let on_disk = log.disk_bytes();
    let file = tables.flush("s").await.unwrap().expect("a file");
    assert_eq!(file.rows, 200);
    assert_eq!(tables.stats("s").await.unwrap().unflushed_batches, 0);
    // The snapshot from before the flush still reads its spilled batches: their segments
    // stay while it lives.
    let mut old = ids(&w.storage, &before).await;
    old.sort_unstable();
    assert_eq!(old, (0..200).collect::<Vec<_>>());
    assert!(log.disk_bytes() >= on_disk / 2, "released under a reader");
    drop(before);
    tables.flush_due(false).await.unwrap();
    assert!(
        log.disk_bytes() < on_disk / 2,
        "{on_disk} -> {}",
        log.disk_bytes()
    );
    assert_exactly(&w.storage, &tables, "s", 200).await;
    // Spilled batches at a crash, and again right after the restart.
    for i in 20..40 {
        tables
            .append("s", batch(i * 10, i * 10 + 10))
            .await
            .unwrap();
    }
    log.close();
    drop(tables);
    let (log, tables) = open_tables(config.clone(), w.storage.clone(), spilling()).await;
    assert_eq!(
        tables.stats("s").await.unwrap().spilled_bytes,
        tables.stats("s").await.unwrap().unflushed_bytes,
        "replayed batches are spilled too"
    );
    assert_exactly(&w.storage, &tables, "s", 400).await;
    log.close();
    drop(tables);
    let (log, tables) = open_tables(config.clone(), w.storage.clone(), spilling()).await;
    assert_exactly(&w.storage, &tables, "s", 400).await;
    tables.flush("s").await.unwrap();
    log.close();
    drop(tables);
    let (_log, tables) = open_tables(config, w.storage.clone(), TableConfig::default()).await;
    assert_exactly(&w.storage, &tables, "s", 400).await;
    assert_eq!(tables.stats("s").await.unwrap().unflushed_batches, 0);
}

/// A flush decodes spilled batches a budget's worth at a time: one file each.
async fn spilled_batches_flush_a_budget_at_a_time(backend: &str) {
    let w = world(backend);
    let size = batch(0, 10).get_array_memory_size();
    let config = TableConfig {
        // Three batches a file (the larger of the two budgets).
        flush_bytes: size * 3 + size / 2,
        ..spilling()
    };
    let (_log, tables) = w.open("chunks", config).await;
    tables.create_table("c", &columns()).await.unwrap();
    for i in 0..10 {
        tables
            .append("c", batch(i * 10, i * 10 + 10))
            .await
            .unwrap();
    }
    tables.flush("c").await.unwrap();
    let snapshot = tables.snapshot("c").await.unwrap();
    assert!(snapshot.spilled.is_none() && snapshot.batches.is_empty());
    assert!(snapshot.files.len() >= 3, "{} files", snapshot.files.len());
    assert!(snapshot.files.iter().all(|f| f.rows <= 40));
    assert_exactly(&w.storage, &tables, "c", 100).await;
}

async fn wrong_schema_and_missing_tables_are_refused(backend: &str) {
    let w = world(backend);
    let (_log, tables) = w.open("n", TableConfig::default()).await;
    tables.create_table("t", &columns()).await.unwrap();
    let other: ArrayRef = Arc::new(StringArray::from(vec!["x"]));
    let wrong = RecordBatch::try_from_iter([("id", other)]).unwrap();
    assert!(matches!(
        tables.append("t", wrong).await,
        Err(TableError::SchemaMismatch { .. })
    ));
    let ok: ArrayRef = Arc::new(Int64Array::from(vec![1]));
    let batch = RecordBatch::try_from_iter([("id", ok)]).unwrap();
    assert!(matches!(
        tables.append("nope", batch).await,
        Err(TableError::NotFound(_))
    ));
    assert!(matches!(
        tables.create_table("../escape", &columns()).await,
        Err(TableError::NotFound(_))
    ));
    assert_exactly(&w.storage, &tables, "t", 0).await;
}

/// Crash consistency: whatever a crash leaves at the log's tail, after restart every
/// acknowledged batch is present exactly once and no partial batch appears.
async fn crash_at_every_log_tail_length(backend: &str) {
    let w = world(backend);
    let (log, tables) = w.open("crash", TableConfig::default()).await;
    tables.create_table("c", &columns()).await.unwrap();
    tables.append("c", batch(0, 10)).await.unwrap();
    tables.flush("c").await.unwrap();
    for i in 1..4 {
        tables
            .append("c", batch(i * 10, i * 10 + 10))
            .await
            .unwrap();
    }
    log.close();
    drop(tables);
    let dir = w.dir.join("crash");
    let segment = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap();
    let full = std::fs::read(&segment).unwrap();
    // Simulate the crash of an unacknowledged fifth append at every point of its write: the
    // four acknowledged batches must all be there, once, whatever the tail holds.
    let (log, tables) = w.open("crash", TableConfig::default()).await;
    tables.append("c", batch(40, 50)).await.unwrap();
    log.close();
    drop(tables);
    let with_fifth = std::fs::read(&segment).unwrap();
    let step = ((with_fifth.len() - full.len()) / 40).max(1);
    let mut cut = full.len();
    while cut < with_fifth.len() {
        std::fs::write(&segment, &with_fifth[..cut]).unwrap();
        let (log, tables) = w.open("crash", TableConfig::default()).await;
        assert_exactly(&w.storage, &tables, "c", 40).await;
        log.close();
        cut += step;
    }
    std::fs::write(&segment, &with_fifth).unwrap();
    let (_log, tables) = w.open("crash", TableConfig::default()).await;
    assert_exactly(&w.storage, &tables, "c", 50).await;
}

async fn log_segments_are_released_after_flush(backend: &str) {
    let w = world(backend);
    let dir = w.dir.join("seg");
    let mut config = LogConfig::new(&dir);
    config.segment_bytes = 4096;
    let (log, tables) =
        open_tables(config.clone(), w.storage.clone(), TableConfig::default()).await;
    tables.create_table("s", &columns()).await.unwrap();
    for i in 0..20 {
        tables
            .append("s", batch(i * 10, i * 10 + 10))
            .await
            .unwrap();
    }
    let before = log.disk_bytes();
    tables.flush("s").await.unwrap();
    assert!(
        log.disk_bytes() < before / 2,
        "{} -> {}",
        before,
        log.disk_bytes()
    );
    log.close();
    drop(tables);
    let (_log, tables) = open_tables(config, w.storage.clone(), TableConfig::default()).await;
    assert_exactly(&w.storage, &tables, "s", 200).await;
}

/// One-row batches coalesce in memory (the set's entries and bytes follow rows, not
/// requests), and every row is read exactly once through flushes cut while appends go on,
/// spills of coalesced entries, and crashes that replay them.
async fn small_batches_coalesce_and_every_row_is_read_once(backend: &str) {
    const ROWS: i64 = 3000;
    let w = world(backend);
    let single = batch(0, 1).get_array_memory_size();
    let (log, tables) = w.open("small", TableConfig::default()).await;
    let tables = Arc::new(tables);
    tables.create_table("t", &columns()).await.unwrap();
    // 30 writers of one-row batches; a flush cut in the middle of them.
    let append_range = |from: i64, to: i64| {
        let tables = tables.clone();
        tokio::spawn(async move {
            let writers: Vec<_> = (0..30)
                .map(|w| {
                    let tables = tables.clone();
                    tokio::spawn(async move {
                        let mut id = from + w;
                        while id < to {
                            tables.append("t", batch(id, id + 1)).await.unwrap();
                            id += 30;
                        }
                    })
                })
                .collect();
            for writer in writers {
                writer.await.unwrap();
            }
        })
    };
    append_range(0, ROWS / 2).await.unwrap();
    let more = append_range(ROWS / 2, ROWS);
    let flushed = tables.flush("t").await.unwrap().expect("a file");
    more.await.unwrap();
    assert!(flushed.rows >= (ROWS / 2) as u64, "{}", flushed.rows);
    let stats = tables.stats("t").await.unwrap();
    println!(
        "{} unflushed rows in {} entries, {} bytes (a one-row batch alone: {single} bytes)",
        stats.unflushed_rows, stats.unflushed_batches, stats.unflushed_bytes
    );
    assert!(stats.unflushed_rows > 0);
    assert!(
        stats.unflushed_batches as u64 * 20 <= stats.unflushed_rows,
        "one-row batches did not coalesce: {} entries for {} rows",
        stats.unflushed_batches,
        stats.unflushed_rows
    );
    assert!(
        stats.unflushed_bytes as u64 * 4 <= stats.unflushed_rows * single as u64,
        "memory follows requests: {} bytes for {} rows",
        stats.unflushed_bytes,
        stats.unflushed_rows
    );
    assert_exactly(&w.storage, &tables, "t", ROWS).await;
    // A crash: the records replay, coalesced again, and then spill under a small budget.
    log.close();
    drop(tables);
    let small_budget = TableConfig {
        max_unflushed_bytes: 8 << 10,
        ..TableConfig::default()
    };
    let (log, tables) = w.open("small", small_budget.clone()).await;
    let stats = tables.stats("t").await.unwrap();
    assert!(stats.spilled_bytes > 0, "replayed entries spilled");
    assert!(stats.unflushed_batches as u64 * 20 <= stats.unflushed_rows);
    assert_exactly(&w.storage, &tables, "t", ROWS).await;
    for id in ROWS..ROWS + 100 {
        tables.append("t", batch(id, id + 1)).await.unwrap();
    }
    assert_exactly(&w.storage, &tables, "t", ROWS + 100).await;
    tables.flush("t").await.unwrap();
    assert_exactly(&w.storage, &tables, "t", ROWS + 100).await;
    log.close();
    drop(tables);
    let (_log, tables) = w.open("small", small_budget).await;
    assert_exactly(&w.storage, &tables, "t", ROWS + 100).await;
}

macro_rules! conformance {
    ($backend:ident, $name:literal) => {
        mod $backend {
            macro_rules! case {
                ($test:ident) => {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $test() {
                        super::$test($name).await;
                    }
                };
            }
            case!(append_flush_reopen);
            case!(parquet_keeps_types_and_metadata);
            case!(concurrent_appends_and_flushes);
            case!(two_writers_race_for_manifest_versions);
            case!(compaction_during_reads);
            case!(checkpoints_bound_what_opening_reads);
            case!(backpressure_applies_nothing);
            case!(wrong_schema_and_missing_tables_are_refused);
            case!(crash_at_every_log_tail_length);
            case!(log_segments_are_released_after_flush);
            case!(spilled_batches_are_read_back_from_the_log);
            case!(spilled_batches_flush_a_budget_at_a_time);
            case!(small_batches_coalesce_and_every_row_is_read_once);
        }
    };
}

conformance!(local, "local");
conformance!(memory, "memory");
conformance!(s3, "s3");

/// The maintenance loop of `tables` on a 10 ms tick, running until the sender is used.
fn maintenance(
    tables: &Arc<Tables>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(tables.clone().run_maintenance(
        std::time::Duration::from_millis(10),
        async move {
            let _ = stopped.await;
        },
    ));
    (stop, task)
}

/// The maintenance loop flushes while a compaction of its pass is under way (the reads of
/// the files it merges hang): appends over the unflushed budget would otherwise wait it out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_flushes_while_a_compaction_is_under_way() {
    let w = world("memory");
    let (faults, storage) = faulty(&w);
    let config = TableConfig {
        flush_interval: std::time::Duration::from_millis(50),
        compact_min_files: 2,
        ..TableConfig::default()
    };
    let (_log, tables) = open_tables(LogConfig::new(w.dir.join("beside")), storage, config).await;
    let tables = Arc::new(tables);
    tables.create_table("busy", &columns()).await.unwrap();
    for round in 0..3 {
        tables
            .append("busy", batch(round * 10, round * 10 + 10))
            .await
            .unwrap();
        tables.flush("busy").await.unwrap();
    }
    faults.hold_reads_under(Some("tables/busy/data/"));
    let (stop, task) = maintenance(&tables);
    for _ in 0..500 {
        if faults.reads_held() > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(
        faults.reads_held() > 0,
        "the loop's compaction reads its files"
    );
    tables.append("busy", batch(30, 45)).await.unwrap();
    for _ in 0..1000 {
        if tables.stats("busy").await.unwrap().unflushed_batches == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let stats = tables.stats("busy").await.unwrap();
    assert_eq!(
        (stats.files, stats.unflushed_batches),
        (4, 0),
        "flushed beside the compaction"
    );
    assert!(faults.reads_held() > 0, "the compaction is still under way");
    faults.hold_reads_under(None);
    stop.send(()).unwrap();
    // The loop returns once its compaction pass is done (a second pass may have merged the
    // flush's file too).
    task.await.unwrap();
    assert!(tables.stats("busy").await.unwrap().files <= 2);
    assert_exactly(&w.storage, &tables, "busy", 45).await;
}

/// The world's store behind a [`ProbedStore`].
fn faulty(w: &World) -> (Arc<Probe>, Storage) {
    let faults = Arc::new(Probe::default());
    let store = ProbedStore::new(w.storage.store().clone(), faults.clone());
    (faults, Storage::from_store(Arc::new(store), "faulty://"))
}

#[tokio::test]
async fn an_object_store_outage_defers_flushes_and_loses_nothing() {
    let w = world("memory");
    let (faults, storage) = faulty(&w);
    let (_log, tables) = open_tables(
        LogConfig::new(w.dir.join("outage")),
        storage.clone(),
        TableConfig::default(),
    )
    .await;
    tables.create_table("t", &columns()).await.unwrap();
    tables.append("t", batch(0, 10)).await.unwrap();
    tables.flush("t").await.unwrap();
    faults.set_down(true);
    // Appends keep committing into the log while the store is down; flushes fail and retry.
    for i in 1..10i64 {
        tables
            .append("t", batch(i * 10, i * 10 + 10))
            .await
            .unwrap();
        assert!(tables.flush("t").await.is_err());
    }
    assert!(tables.flush_due(true).await.is_err());
    assert_eq!(tables.stats("t").await.unwrap().unflushed_rows, 90);
    faults.set_down(false);
    // Back: one flush writes everything that waited, exactly once.
    assert_eq!(tables.flush_due(true).await.unwrap(), 1);
    assert_exactly(&storage, &tables, "t", 100).await;
    let (_l2, fresh) = w.open("reader", TableConfig::default()).await;
    assert_exactly(&w.storage, &fresh, "t", 100).await;
    assert!(faults.counts().1 > 0);
}

/// A flush that fails before its commit (the store is down) leaves no entry frozen: small
/// batches appended between the failed attempts go on joining one entry, and the flush after
/// the outage writes each row once.
#[tokio::test]
async fn flushes_failing_before_their_commit_leave_small_batches_coalescing() {
    const ROWS: i64 = 40;
    let w = world("memory");
    let (faults, storage) = faulty(&w);
    let (_log, tables) = open_tables(
        LogConfig::new(w.dir.join("outage-small")),
        storage.clone(),
        TableConfig::default(),
    )
    .await;
    tables.create_table("t", &columns()).await.unwrap();
    faults.set_down(true);
    for id in 0..ROWS {
        tables.append("t", batch(id, id + 1)).await.unwrap();
        assert!(tables.flush("t").await.is_err());
    }
    let stats = tables.stats("t").await.unwrap();
    assert_eq!(stats.unflushed_rows, ROWS as u64);
    assert_eq!(
        stats.unflushed_batches, 1,
        "each failed flush left its cut entry frozen"
    );
    faults.set_down(false);
    assert_eq!(tables.flush_due(true).await.unwrap(), 1);
    assert_exactly(&storage, &tables, "t", ROWS).await;
    let (_l2, fresh) = w.open("reader", TableConfig::default()).await;
    assert_exactly(&w.storage, &fresh, "t", ROWS).await;
}

/// A flush whose commit landed with its answer lost (and not read back) leaves its entry
/// cut; a later flush that takes that entry again and fails before its commit leaves it cut
/// too (only entries it cut first are given back to coalescing): a small batch appended then
/// starts an entry of its own, and once the manifest is read again every row is there once.
#[tokio::test]
async fn a_failed_flush_gives_back_only_the_entries_it_cut_first() {
    let w = world("memory");
    let (faults, storage) = faulty(&w);
    let (_log, tables) = open_tables(
        LogConfig::new(w.dir.join("cut-twice")),
        storage.clone(),
        TableConfig::default(),
    )
    .await;
    tables.create_table("t", &columns()).await.unwrap();
    for id in 0..5 {
        tables.append("t", batch(id, id + 1)).await.unwrap();
    }
    assert_eq!(tables.stats("t").await.unwrap().unflushed_batches, 1);
    // The commit lands; its answer, and the read that would settle it, are lost.
    faults.lose_create_answers_unverified(1);
    assert!(tables.flush("t").await.is_err());
    // The next flush takes the same entry again and fails writing its file.
    faults.fail_writes_under(Some("tables/t/data/"));
    assert!(tables.flush("t").await.is_err());
    faults.fail_writes_under(None);
    tables.append("t", batch(5, 6)).await.unwrap();
    assert_eq!(
        tables.stats("t").await.unwrap().unflushed_batches,
        2,
        "the entry a landed commit covers took a new row"
    );
    tables.refresh("t").await.unwrap();
    tables.flush_due(true).await.unwrap();
    assert_exactly(&storage, &tables, "t", 6).await;
    let (_l2, fresh) = w.open("reader", TableConfig::default()).await;
    assert_exactly(&w.storage, &fresh, "t", 6).await;
}

/// Small batches of mixed sizes coalesce into entries of several runs, the oldest entries
/// spilled: a snapshot reads every row once and in commit order (spilled entries, then each
/// entry's runs in order), unsorted.
#[tokio::test]
async fn coalesced_and_spilled_small_batches_read_in_commit_order() {
    let w = world("memory");
    let config = TableConfig {
        max_unflushed_bytes: 64 << 10,
        ..TableConfig::default()
    };
    let (_log, tables) = w.open("order", config).await;
    tables.create_table("t", &columns()).await.unwrap();
    let mut next = 0i64;
    for i in 0..400i64 {
        let n = [1, 7, 2, 5, 3, 1, 9][(i % 7) as usize];
        tables.append("t", batch(next, next + n)).await.unwrap();
        next += n;
    }
    let snapshot = tables.snapshot("t").await.unwrap();
    assert!(snapshot.spilled.is_some(), "the oldest entries spilled");
    assert!(!snapshot.batches.is_empty(), "the newest held in memory");
    let stats = tables.stats("t").await.unwrap();
    assert!(
        stats.unflushed_batches < 400 && (snapshot.batches.len() as u64) > 1,
        "coalesced into entries of runs: {stats:?}"
    );
    assert_eq!(
        ids(&w.storage, &snapshot).await,
        (0..next).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn ambiguous_manifest_creates_are_settled_by_reading_back() {
    let w = world("memory");
    let (faults, storage) = faulty(&w);
    let (_log, tables) = open_tables(
        LogConfig::new(w.dir.join("amb")),
        storage.clone(),
        TableConfig::default(),
    )
    .await;
    faults.lose_create_answers(1);
    tables.create_table("t", &columns()).await.unwrap();
    for i in 0..5i64 {
        tables
            .append("t", batch(i * 10, i * 10 + 10))
            .await
            .unwrap();
        faults.lose_create_answers(1);
        // The create lands but its answer is lost: the flush must still count it once.
        tables.flush("t").await.unwrap();
    }
    let snapshot = tables.snapshot("t").await.unwrap();
    assert_eq!(snapshot.version, 5, "no version forked or repeated");
    assert_exactly(&storage, &tables, "t", 50).await;
    let (_l2, fresh) = w.open("reader", TableConfig::default()).await;
    assert_exactly(&w.storage, &fresh, "t", 50).await;
}

#[tokio::test]
async fn maintenance_flushes_by_age_and_shutdown_flushes_the_rest() {
    let w = world("memory");
    let config = TableConfig {
        flush_interval: std::time::Duration::from_millis(50),
        ..TableConfig::default()
    };
    let (_log, tables) = w.open("m", config).await;
    let tables = Arc::new(tables);
    tables.create_table("aged", &columns()).await.unwrap();
    tables.append("aged", batch(0, 10)).await.unwrap();
    let (stop, task) = maintenance(&tables);
    // Wait (bounded) for the age-triggered flush.
    for _ in 0..500 {
        if tables.stats("aged").await.unwrap().files == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(tables.stats("aged").await.unwrap().files, 1);
    tables.append("aged", batch(10, 20)).await.unwrap();
    stop.send(()).unwrap();
    task.await.unwrap();
    // Maintenance stops without a final flush: that is the database's one shutdown's.
    assert_eq!(tables.stats("aged").await.unwrap().unflushed_batches, 1);
    tables.flush_due(true).await.unwrap();
    let stats = tables.stats("aged").await.unwrap();
    assert_eq!(
        (stats.files, stats.unflushed_batches),
        (2, 0),
        "shutdown flushed the rest"
    );
    assert_exactly(&w.storage, &tables, "aged", 20).await;
}

/// During a burst of appends (less than `flush_quiet` apart), a table past `flush_bytes` is
/// not flushed while its batches can be spilled; once the burst is over it is, spilled
/// batches first, and every row is in a file once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_flushes_after_a_burst() {
    let w = world("memory");
    let config = TableConfig {
        flush_bytes: 1,
        flush_quiet: std::time::Duration::from_secs(3),
        ..spilling()
    };
    let (_log, tables) = w.open("burst", config).await;
    let tables = Arc::new(tables);
    tables.create_table("b", &columns()).await.unwrap();
    let (stop, task) = maintenance(&tables);
    for i in 0..20 {
        tables
            .append("b", batch(i * 10, i * 10 + 10))
            .await
            .unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let during = tables.stats("b").await.unwrap();
    assert_eq!(
        (during.files, during.unflushed_batches),
        (0, 20),
        "no flush during the burst"
    );
    // After the quiet time, the loop flushes it all (bounded wait).
    for _ in 0..1000 {
        if tables.stats("b").await.unwrap().unflushed_batches == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let after = tables.stats("b").await.unwrap();
    assert_eq!(
        after.unflushed_batches, 0,
        "flushed once the burst was over"
    );
    assert!(after.files >= 1);
    stop.send(()).unwrap();
    task.await.unwrap();
    assert_exactly(&w.storage, &tables, "b", 200).await;
}

/// A burst longer than `flush_interval` is flushed during it all the same: the age limit
/// holds for the oldest batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_flushes_aged_batches_within_a_burst() {
    let w = world("memory");
    let config = TableConfig {
        flush_bytes: 1,
        flush_interval: std::time::Duration::from_millis(300),
        flush_quiet: std::time::Duration::from_secs(60),
        ..spilling()
    };
    let (_log, tables) = w.open("aged-burst", config).await;
    let tables = Arc::new(tables);
    tables.create_table("a", &columns()).await.unwrap();
    let (stop, task) = maintenance(&tables);
    let mut files_during = 0;
    for i in 0..100 {
        tables
            .append("a", batch(i * 10, i * 10 + 10))
            .await
            .unwrap();
        files_during = tables.stats("a").await.unwrap().files;
        if files_during > 0 {
            // The burst goes on a little, over the flushed part.
            for j in i + 1..i + 5 {
                tables
                    .append("a", batch(j * 10, j * 10 + 10))
                    .await
                    .unwrap();
            }
            stop.send(()).unwrap();
            task.await.unwrap();
            let n = (i + 5) * 10;
            assert_exactly(&w.storage, &tables, "a", n).await;
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("no flush within a 2 s burst with a 300 ms age limit ({files_during} files)");
}

/// Replayed batches count their record's size against the memory budget: decoded from one
/// IPC body, their arrays share a buffer that per-array sizes would count many times over
/// (and spill, or flush one record a file, for nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_batches_count_their_real_size() {
    let w = world("memory");
    let (log, tables) = w.open("sized", TableConfig::default()).await;
    tables.create_table("r", &columns()).await.unwrap();
    for i in 0..10 {
        tables
            .append("r", batch(i * 1000, i * 1000 + 1000))
            .await
            .unwrap();
    }
    let held = tables.stats("r").await.unwrap().unflushed_bytes;
    log.close();
    drop(tables);
    let config = TableConfig {
        max_unflushed_bytes: held * 2,
        ..TableConfig::default()
    };
    let (_log, tables) = w.open("sized", config).await;
    let stats = tables.stats("r").await.unwrap();
    assert_eq!(stats.unflushed_batches, 10);
    assert_eq!(stats.spilled_bytes, 0, "{stats:?} (held {held} before)");
    assert_exactly(&w.storage, &tables, "r", 10_000).await;
}
