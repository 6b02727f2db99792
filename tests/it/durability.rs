//! What the storage engine promises, tried at its thresholds: log release with two consumers
//! across quick restarts, a simulated power loss, a node identity lost or shared, ambiguous
//! commits, a catalog that changed on another node, garbage collection under churn and with
//! two nodes, subscriptions across restarts, and a damaged log.

use crate::common;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;
use sluice::db::{Database, DbConfig, OpenError};
use sluice::ingest::ContentEncoding;
use sluice::log::Durability;
use sluice::node::NodeError;
use sluice::storage::Storage;
use sluice::storage::journal::SyncJournal;
use sluice::storage::probe::{Probe, ProbedStore};
use sluice::stream::{AppendRequest, CreateRequest, Lifetime};

/// The database settings `sluice serve --data-dir DIR` runs with (no other flag, variable
/// or file), made small enough for a test as [`config`] makes them.
fn served_defaults(dir: &Path) -> DbConfig {
    let overrides = sluice::config::Overrides {
        data_dir: Some(dir.to_owned()),
        ..Default::default()
    };
    let mut c = sluice::config::ServeConfig::resolve(overrides, None)
        .unwrap()
        .db;
    let small = config(dir);
    c.log_segment_bytes = small.log_segment_bytes;
    c.node_lease = small.node_lease;
    c.gc_grace = small.gc_grace;
    c
}

/// Settings small enough that segments roll, flushes and checkpoints happen in a test.
fn config(dir: &Path) -> DbConfig {
    let mut c = DbConfig::new(dir);
    c.log_segment_bytes = 4096;
    c.node_lease = Duration::from_millis(400);
    c.gc_grace = Duration::from_secs(1);
    c
}

async fn ingest(db: &Database, table: &str, ids: std::ops::Range<i64>) -> Result<usize, String> {
    let body: String = ids
        .map(|i| format!("{{\"id\":{i},\"note\":\"{}\"}}\n", "n".repeat(200)))
        .collect();
    db.ingest(
        "scopedb",
        "public",
        table,
        Bytes::from(body),
        ContentEncoding::Identity,
    )
    .await
    .map_err(|e| e.to_string())
}

async fn ids(db: &Database, table: &str) -> Vec<i64> {
    let r = db
        .execute(&format!("SELECT id FROM {table} ORDER BY id"))
        .await
        .unwrap();
    r.rows
        .iter()
        .map(|row| row[0].as_deref().unwrap().parse().unwrap())
        .collect()
}

fn create_stream(name: &str) -> CreateRequest {
    CreateRequest {
        name: name.into(),
        content_type: Some("text/plain".into()),
        lifetime: Lifetime::default(),
        closed: false,
        fork: None,
        body: Bytes::new(),
        incarnation: None,
        key: None,
    }
}

fn append(name: &str, body: String) -> AppendRequest {
    AppendRequest {
        name: name.into(),
        content_type: Some("text/plain".into()),
        body: Bytes::from(body),
        close: false,
        producer: None,
        stream_seq: None,
        incarnation: None,
        key: None,
    }
}

async fn stream_text(db: &Database, name: &str) -> String {
    let streams = db.streams();
    let stream = streams.get(name).await.unwrap();
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let r = streams.read(&stream, at, 1 << 20).await.unwrap();
        for record in &r.records {
            out.extend_from_slice(record);
        }
        at = r.next;
        if r.up_to_date {
            break;
        }
    }
    String::from_utf8(out).unwrap()
}

/// Stops a database as a crash would: the log is closed where it is; nothing is flushed,
/// checkpointed or released.
/// An in-memory object store behind a fault probe.
fn probed_store() -> (Arc<Probe>, Storage) {
    let probe = Arc::new(Probe::default());
    let store = Arc::new(ProbedStore::new(
        Arc::new(object_store::memory::InMemory::new()),
        probe.clone(),
    ));
    (probe, Storage::from_store(store, "memory-probed://"))
}

fn crash(db: Arc<Database>) {
    db.log().close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_survive_log_release_by_tables_and_two_quick_restarts() {
    let dir = common::temp_dir("two-restarts");
    let mut c = config(&dir);
    c.streams.checkpoint_interval = Duration::from_secs(3600);
    c.streams.checkpoint_bytes = u64::MAX;
    let db = Database::open(c.clone()).await.unwrap();
    db.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    db.streams().create(create_stream("s")).await.unwrap();
    let mut expected = String::new();
    for i in 0..20 {
        let line = format!("message {i}\n");
        db.streams()
            .append(append("s", line.clone()))
            .await
            .unwrap();
        expected.push_str(&line);
    }
    // Table ingest fills many segments; flushes release the log as far as tables go.
    for round in 0..10 {
        ingest(&db, "t", round * 20..round * 20 + 20).await.unwrap();
        db.tables().flush_due(true).await.unwrap();
    }
    assert!(
        db.log()
            .stats()
            .segments_rolled
            .load(std::sync::atomic::Ordering::Relaxed)
            > 5
    );
    crash(db);
    for restart in 0..2 {
        // Opening releases the log as far as the tables need it: the streams, which have
        // checkpointed nothing, must keep theirs.
        let db = Database::open(c.clone()).await.unwrap();
        assert_eq!(stream_text(&db, "s").await, expected, "restart {restart}");
        assert_eq!(ids(&db, "t").await, (0..200).collect::<Vec<_>>());
        crash(db);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_loss_loses_nothing_acknowledged_unless_durability_is_none() {
    for durability in [Durability::Fsync, Durability::None] {
        let dir = common::temp_dir("power-loss");
        let journal = Arc::new(SyncJournal::new());
        // The settings `sluice serve` resolves with no flag, variable or file: the first round
        // runs the server's own default durability, whatever it becomes.
        let mut c = served_defaults(&dir);
        assert_eq!(
            c.durability,
            Durability::Fsync,
            "the server's default durability no longer syncs"
        );
        c.durability = durability;
        c.sync_journal = Some(journal.clone());
        let db = Database::open(c.clone()).await.unwrap();
        db.execute("CREATE TABLE t (id int, note string)")
            .await
            .unwrap();
        db.streams().create(create_stream("s")).await.unwrap();
        let mut acked = 0;
        let mut text = String::new();
        for round in 0..6 {
            ingest(&db, "t", round * 10..round * 10 + 10).await.unwrap();
            acked += 10;
            let line = format!("append {round}\n");
            db.streams()
                .append(append("s", line.clone()))
                .await
                .unwrap();
            text.push_str(&line);
            if round % 2 == 0 {
                db.tables().flush_due(true).await.unwrap();
                db.streams().checkpoint(true).await.unwrap();
            }
        }
        // The machine loses power: what was not synced is gone.
        journal.power_loss().unwrap();
        crash(db);
        let db = Database::open({
            let mut c = c.clone();
            c.sync_journal = None;
            c
        })
        .await;
        match durability {
            Durability::Fsync => {
                let db = db.unwrap();
                assert_eq!(ids(&db, "t").await, (0..acked).collect::<Vec<_>>());
                assert_eq!(stream_text(&db, "s").await, text);
            }
            Durability::None => {
                // Without syncs the loss is real: the test can tell.
                let kept = match &db {
                    Ok(db) => match db.execute("SELECT count(*) FROM t").await {
                        Ok(r) => r.rows[0][0].as_deref().unwrap().parse::<i64>().unwrap(),
                        Err(_) => 0,
                    },
                    Err(_) => 0,
                };
                assert!(kept < acked, "durability none kept all {acked} rows");
            }
            Durability::ObjectStore => unreachable!("this test runs fsync and none only"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emptied_node_id_refuses_to_start_rather_than_apply_rows_twice() {
    let dir = common::temp_dir("empty-id");
    let c = config(&dir);
    let db = Database::open(c.clone()).await.unwrap();
    db.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    ingest(&db, "t", 0..10).await.unwrap();
    db.tables().flush_due(true).await.unwrap();
    crash(db);
    // What a power loss can leave of a file written without fsync.
    std::fs::write(dir.join("node.json"), b"").unwrap();
    match Database::open(c.clone()).await {
        Err(OpenError::Node(NodeError::MissingIdentity { .. })) => {}
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
    std::fs::remove_file(dir.join("node.json")).unwrap();
    assert!(matches!(
        Database::open(c.clone()).await,
        Err(OpenError::Node(NodeError::MissingIdentity { .. }))
    ));
}

/// Copies a directory tree (the data directory, minus nothing).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// A node's default store (`objects/` in its data directory) is its own: it trusts its
/// catalog without looking at the store, so no other node may name that directory as its
/// store, whether the node runs or not (a lock would not keep out a node on another machine
/// through a network mount), and the refusal says why. The node itself may name it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_other_node_opens_a_nodes_default_store() {
    let root = common::temp_dir("private-store");
    let a_dir = root.join("a");
    let a = Database::open(config(&a_dir)).await.unwrap();
    a.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    let mut b = config(&root.join("b"));
    b.object_store = Some(format!("file://{}", a_dir.join("objects").display()));
    let refused = Database::open(b.clone()).await.expect_err("refused");
    let message = refused.to_string();
    assert!(
        message.contains("another node's default store"),
        "{message}"
    );
    // The refusal changed nothing: the node goes on.
    assert_eq!(ingest(&a, "t", 0..3).await, Ok(3));
    a.shutdown().await.unwrap();
    // Shut down, the node changes its catalog no more: a node opened on the directory since
    // would not look for the change.
    let late = a.execute("CREATE TABLE u (id int)").await;
    assert!(late.is_err(), "{late:?}");
    drop(a);
    let refused = Database::open(b)
        .await
        .expect_err("refused while the node is down");
    assert!(refused.to_string().contains("default store"), "{refused}");

    // Named by its own node, the directory is that node's default store all the same.
    let mut named = config(&a_dir);
    named.object_store = Some(a_dir.join("objects").display().to_string());
    let a = Database::open(named).await.unwrap();
    assert_eq!(ids(&a, "t").await, (0..3).collect::<Vec<_>>());
    let mut c = config(&root.join("c"));
    c.object_store = Some(root.join("shared").display().to_string());
    let c = Database::open(c).await.unwrap();
    a.shutdown().await.unwrap();
    c.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_data_directory_is_fenced_never_merged() {
    let root = common::temp_dir("clone");
    let store = root.join("objects");
    let original = root.join("a");
    let copy = root.join("b");
    let with_store = |dir: &Path| {
        let mut c = config(dir);
        c.object_store = Some(store.display().to_string());
        c
    };
    let db = Database::open(with_store(&original)).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let maintenance = tokio::spawn(db.clone().run_maintenance(async {
        let _ = stopped.await;
    }));
    db.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    ingest(&db, "t", 0..10).await.unwrap();
    db.tables().flush_due(true).await.unwrap();
    ingest(&db, "t", 10..16).await.unwrap();
    // The directory is copied while its server runs.
    copy_dir(&original, &copy);
    let _ = std::fs::remove_file(copy.join("log").join("LOCK"));
    // The copy cannot start while the original's heartbeat moves.
    match Database::open(with_store(&copy)).await {
        Err(OpenError::Node(NodeError::InUse { .. })) => {}
        other => panic!("expected InUse, got {:?}", other.map(|_| ())),
    }
    // The original goes on; then it dies without a goodbye.
    ingest(&db, "t", 16..20).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = stop.send(());
    maintenance.abort();
    crash(db);
    // Its copy holds less of the log than the node had made durable: refused, not merged.
    match Database::open(with_store(&copy)).await {
        Err(OpenError::Node(NodeError::StaleCopy { .. })) => {}
        other => panic!("expected StaleCopy, got {:?}", other.map(|_| ())),
    }
    // The original restarts with every acknowledged row, once.
    let db = Database::open(with_store(&original)).await.unwrap();
    assert_eq!(ids(&db, "t").await, (0..20).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_whose_commit_landed_unseen_does_not_write_its_rows_again() {
    let dir = common::temp_dir("ambiguous-flush");
    let (probe, storage) = probed_store();
    let c = config(&dir);
    let db = Database::open_with_storage(c.clone(), storage.clone())
        .await
        .unwrap();
    db.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    ingest(&db, "t", 0..10).await.unwrap();
    // The manifest version lands; its answer and the read-back are both lost.
    probe.lose_create_answers_unverified(1);
    assert!(db.tables().flush_due(true).await.is_err());
    assert_eq!(ids(&db, "t").await, (0..10).collect::<Vec<_>>());
    // The next flush finds its rows already in a file.
    db.tables().flush_due(true).await.unwrap();
    assert_eq!(ids(&db, "t").await, (0..10).collect::<Vec<_>>());
    let stats = db.table_stats("scopedb", "public", "t").await.unwrap();
    assert_eq!(
        (stats.files, stats.file_rows, stats.unflushed_rows),
        (1, 10, 0)
    );
    ingest(&db, "t", 10..15).await.unwrap();
    db.tables().flush_due(true).await.unwrap();
    crash(db);
    let db = Database::open_with_storage(c, storage).await.unwrap();
    assert_eq!(ids(&db, "t").await, (0..15).collect::<Vec<_>>());
}

/// Catalog versions in the store (`catalog/{v:020}.json`).
async fn catalog_versions(storage: &Storage) -> usize {
    use futures::TryStreamExt as _;
    let listed: Vec<object_store::ObjectMeta> = storage
        .store()
        .list(Some(&object_store::path::Path::from("catalog")))
        .try_collect()
        .await
        .unwrap();
    listed
        .iter()
        .filter(|m| {
            let name = m.location.filename().unwrap_or("");
            name.ends_with(".json") && !name.ends_with(".checkpoint.json")
        })
        .count()
}

/// The catalog commits through the same versioned-object protocol as the manifest (the
/// flush and compaction cases around this one): a change whose answer is lost is applied
/// once; one whose outcome stays unknown is answered as such, and the retry finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalog_change_whose_answer_was_lost_is_applied_exactly_once() {
    use sluice::error::{Applied, Classify as _};
    let dir = common::temp_dir("ambiguous-ddl");
    let (probe, storage) = probed_store();
    let c = config(&dir);
    let db = Database::open_with_storage(c.clone(), storage.clone())
        .await
        .unwrap();
    assert_eq!(catalog_versions(&storage).await, 1);
    // The version lands, its answer is lost, the read-back settles it.
    probe.lose_create_answers(1);
    db.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    assert_eq!(catalog_versions(&storage).await, 2, "applied once");
    ingest(&db, "t", 0..3).await.unwrap();
    // The version lands; the answer and the read-back are both lost.
    probe.lose_create_answers_unverified(1);
    let err = db
        .execute("CREATE TABLE u (id int, note string)")
        .await
        .unwrap_err();
    assert_eq!(err.class().applied, Applied::Unknown, "{err}");
    // The retry sees the change landed: it is not applied again.
    match db.execute("CREATE TABLE u (id int, note string)").await {
        Ok(_) => {}
        Err(e) => assert!(e.to_string().contains("already exists"), "{e}"),
    }
    assert_eq!(catalog_versions(&storage).await, 3, "applied once");
    ingest(&db, "u", 0..2).await.unwrap();
    assert_eq!(ids(&db, "u").await, vec![0, 1]);
    crash(db);
    let db = Database::open_with_storage(c, storage.clone())
        .await
        .unwrap();
    assert_eq!(ids(&db, "t").await, vec![0, 1, 2]);
    assert_eq!(ids(&db, "u").await, vec![0, 1]);
    assert_eq!(catalog_versions(&storage).await, 3);
}

/// A table whose catalog entry commits while its storage cannot be written is created: the
/// answer is success (never "rejected" for a change that landed), and the first write
/// creates the storage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_created_table_whose_storage_write_fails_is_still_created() {
    let dir = common::temp_dir("create-storage-down");
    let (probe, storage) = probed_store();
    let db = Database::open_with_storage(config(&dir), storage)
        .await
        .unwrap();
    probe.fail_writes_under(Some("tables/"));
    db.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    let (_, failed) = probe.counts();
    assert!(failed > 0, "the storage write was not attempted");
    let stats = db.table_stats("scopedb", "public", "t").await.unwrap();
    assert_eq!(stats.file_rows + stats.unflushed_rows, 0);
    probe.fail_writes_under(None);
    // Queries read it as empty, as its storage does not exist yet.
    assert!(ids(&db, "t").await.is_empty());
    db.execute("CREATE TABLE u (id int)").await.unwrap();
    db.execute("INSERT INTO u SELECT id FROM t").await.unwrap();
    ingest(&db, "t", 0..3).await.unwrap();
    assert_eq!(ids(&db, "t").await, vec![0, 1, 2]);
    db.tables().flush_due(true).await.unwrap();
    assert_eq!(ids(&db, "t").await, vec![0, 1, 2]);
}

/// A database whose table `t` has three flushed files of ten rows each (ids 0..30), and that
/// compacts two or more small files; returns it and the table's id.
async fn three_small_files(c: &DbConfig, storage: &Storage) -> (Arc<Database>, String) {
    let mut c = c.clone();
    c.tables.compact_min_files = 2;
    let db = Database::open_with_storage(c, storage.clone())
        .await
        .unwrap();
    db.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    for round in 0..3 {
        ingest(&db, "t", round * 10..round * 10 + 10).await.unwrap();
        db.tables().flush_due(true).await.unwrap();
    }
    let id = db
        .catalog()
        .table("scopedb", "public", "t")
        .await
        .unwrap()
        .id;
    (db, id)
}

/// A flush goes ahead while a compaction of the same table is under way (its reads of the
/// files it merges hang), and the compaction then commits on top of the flush's version:
/// every row once, before and after a restart. Before, one lock held both, and appends over
/// the unflushed budget waited out every compaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_goes_ahead_while_a_compaction_of_its_table_is_under_way() {
    let dir = common::temp_dir("flush-beside-compaction");
    let (probe, storage) = probed_store();
    let c = config(&dir);
    let (db, id) = three_small_files(&c, &storage).await;
    probe.hold_reads_under(Some(&format!("tables/{id}/data/")));
    let compaction = {
        let (db, id) = (db.clone(), id.clone());
        tokio::spawn(async move { db.tables().compact(&id).await })
    };
    let mut waited = 0;
    while probe.reads_held() == 0 && waited < 1000 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
    }
    assert!(probe.reads_held() > 0, "the compaction reads its files");
    ingest(&db, "t", 30..45).await.unwrap();
    let flushed = tokio::time::timeout(Duration::from_secs(30), db.tables().flush(&id))
        .await
        .expect("the flush waited for the compaction")
        .unwrap()
        .expect("a file");
    assert_eq!(flushed.rows, 15);
    assert!(
        !compaction.is_finished(),
        "the compaction is still under way"
    );
    probe.hold_reads_under(None);
    let merged = compaction.await.unwrap().unwrap().expect("compacted");
    assert_eq!(merged.rows, 30);
    let stats = db.table_stats("scopedb", "public", "t").await.unwrap();
    assert_eq!(
        (stats.files, stats.file_rows, stats.unflushed_rows),
        (2, 45, 0)
    );
    assert_eq!(ids(&db, "t").await, (0..45).collect::<Vec<_>>());
    crash(db);
    let db = Database::open_with_storage(c, storage).await.unwrap();
    let stats = db.table_stats("scopedb", "public", "t").await.unwrap();
    assert_eq!((stats.files, stats.file_rows), (2, 45));
    assert_eq!(ids(&db, "t").await, (0..45).collect::<Vec<_>>());
}

/// A flush's commit deadline (half the grace period: garbage collection may take an older
/// unreferenced file for an orphan) counts from the file's upload, not from the cut: a cut
/// that takes longer to encode than the deadline (a taken-over node's whole log, a busy
/// machine) must still land, or every retry fails alike and its rows are never flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_slower_to_encode_than_its_commit_deadline_still_lands() {
    let dir = common::temp_dir("slow-encode");
    let (_probe, storage) = probed_store();
    let mut c = config(&dir);
    c.gc_grace = Duration::from_millis(200);
    c.tables.flush_bytes = 1 << 30;
    c.tables.max_unflushed_bytes = 1 << 30;
    c.tables.flush_interval = Duration::from_secs(3600);
    let db = Database::open_with_storage(c.clone(), storage.clone())
        .await
        .unwrap();
    db.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    // Tens of MB in one cut: encoding it takes far longer than the 100 ms deadline.
    for part in 0..6 {
        ingest(&db, "t", part * 50_000..(part + 1) * 50_000)
            .await
            .unwrap();
    }
    let started = std::time::Instant::now();
    db.tables().flush_due(true).await.unwrap();
    println!("flushed 300,000 rows in {:?}", started.elapsed());
    let stats = db.table_stats("scopedb", "public", "t").await.unwrap();
    assert_eq!((stats.file_rows, stats.unflushed_rows), (300_000, 0));
    crash(db);
    let db = Database::open_with_storage(c, storage).await.unwrap();
    let stats = db.table_stats("scopedb", "public", "t").await.unwrap();
    assert_eq!((stats.file_rows, stats.unflushed_rows), (300_000, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_whose_commit_may_have_landed_keeps_its_file() {
    let dir = common::temp_dir("ambiguous-compaction");
    let (probe, storage) = probed_store();
    let c = config(&dir);
    let (db, id) = three_small_files(&c, &storage).await;
    probe.lose_create_answers_unverified(1);
    assert!(db.tables().compact(&id).await.is_err());
    db.refresh().await;
    // The commit landed: the table is one merged file, and that file is there to read.
    let stats = db.table_stats("scopedb", "public", "t").await.unwrap();
    assert_eq!((stats.files, stats.file_rows), (1, 30));
    assert_eq!(ids(&db, "t").await, (0..30).collect::<Vec<_>>());
    crash(db);
    let db = Database::open_with_storage(c, storage).await.unwrap();
    assert_eq!(ids(&db, "t").await, (0..30).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_are_never_acknowledged_into_a_table_another_node_dropped_or_replaced() {
    let root = common::temp_dir("stale-catalog");
    let store = root.join("objects");
    let node = |name: &str| {
        let mut c = config(&root.join(name));
        c.object_store = Some(store.display().to_string());
        c
    };
    let a = Database::open(node("a")).await.unwrap();
    let b = Database::open(node("b")).await.unwrap();
    a.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    ingest(&b, "t", 0..5).await.unwrap();
    a.execute("DROP TABLE t").await.unwrap();
    // No maintenance tick has run on b: it still thinks t is there.
    let refused = ingest(&b, "t", 5..10).await.unwrap_err();
    assert!(refused.contains("does not exist"), "{refused}");
    a.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    b.execute("SELECT 1").await.unwrap();
    // b resolves t to its old storage id until it looks again; the answer says so.
    ingest(&b, "t", 10..15).await.unwrap();
    a.execute("DROP TABLE t").await.unwrap();
    a.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    // b looks at the catalog before it checks rows: the table made again before the
    // request began is the one its rows go to, never the dropped one's storage.
    ingest(&b, "t", 15..20).await.unwrap();
    ingest(&b, "t", 20..25).await.unwrap();
    b.tables().flush_due(true).await.unwrap();
    a.refresh().await;
    assert_eq!(ids(&a, "t").await, (15..25).collect::<Vec<_>>());
}

/// Producers of one key cycled through expiry on another key's stream: the stream's creator
/// holds what its stream alone holds, the key that made the producers holds their retired
/// records, every running count matches a recount from the streams, and all of it is
/// released when the stream goes.
#[tokio::test]
async fn retired_producers_count_against_the_key_that_made_them() {
    use sluice::stream::ProducerTuple;
    let dir = common::temp_dir("retired-keys");
    let mut c = config(&dir);
    c.streams.producer_expiry = Duration::from_millis(1);
    let db = Database::open(c).await.unwrap();
    let streams = db.streams();
    let (w1, w2): (Arc<str>, Arc<str>) = (Arc::from("w1"), Arc::from("w2"));
    let mut create = create_stream("victim");
    create.key = Some(w1.clone());
    streams.create(create).await.unwrap();
    let alone = streams.key_use("w1");
    assert!(alone.0 > 0, "{alone:?}");
    for round in 0..5 {
        for p in 0..4 {
            let mut a = append("victim", "x".into());
            a.key = Some(w2.clone());
            a.producer = Some(ProducerTuple {
                id: format!("p{round}-{p}"),
                epoch: 0,
                seq: 0,
            });
            streams.append(a).await.unwrap();
        }
        streams.audit_key_use().unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(streams.expire_idle_producers(), 4, "round {round}");
        streams.audit_key_use().unwrap();
        assert_eq!(streams.key_use("w1"), alone, "round {round}");
    }
    assert_eq!(streams.key_use("w2"), (20 * 96, 0));
    streams.delete("victim", None).await.unwrap();
    streams.audit_key_use().unwrap();
    assert_eq!(streams.key_use("w1"), (0, 0));
    assert_eq!(streams.key_use("w2"), (0, 0));
}

/// Bytes of the files under `dir`.
fn bytes_under(dir: &Path) -> u64 {
    let mut total = 0;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                total += bytes_under(&path);
            } else {
                total += entry.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_churn_storage_stays_near_the_live_bytes_and_nothing_live_is_collected() {
    let dir = common::temp_dir("churn");
    let mut c = config(&dir);
    c.tables.compact_min_files = 3;
    c.tables.checkpoint_interval = 3;
    let db = Database::open(c.clone()).await.unwrap();
    db.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    let mut next = 0;
    let mut kept_stream = String::new();
    db.streams().create(create_stream("kept")).await.unwrap();
    for round in 0..12 {
        ingest(&db, "t", next..next + 50).await.unwrap();
        next += 50;
        db.tables().flush_due(true).await.unwrap();
        let id = db
            .catalog()
            .table("scopedb", "public", "t")
            .await
            .unwrap()
            .id;
        db.tables().compact(&id).await.unwrap();
        // A table dropped and made again, and short-lived streams.
        db.execute("DROP TABLE IF EXISTS scratch").await.unwrap();
        db.execute("CREATE TABLE scratch (id int, note string)")
            .await
            .unwrap();
        ingest(&db, "scratch", 0..50).await.unwrap();
        db.tables().flush_due(true).await.unwrap();
        let name = format!("gone-{round}");
        db.streams().create(create_stream(&name)).await.unwrap();
        db.streams()
            .append(append(&name, "x".repeat(4000)))
            .await
            .unwrap();
        let line = format!("{}\n", "k".repeat(100));
        db.streams()
            .append(append("kept", line.clone()))
            .await
            .unwrap();
        kept_stream.push_str(&line);
        db.streams().checkpoint(true).await.unwrap();
        db.streams().delete(&name, None).await.unwrap();
        db.collect_garbage().await;
    }
    // Past the grace period, everything unreferenced goes (stream objects mostly holding
    // deleted streams are copied out of by a checkpoint first).
    for _ in 0..4 {
        db.collect_garbage().await;
        db.streams().checkpoint(true).await.unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    db.collect_garbage().await;
    let objects = dir.join("objects");
    let mut live_tables = 0;
    for t in ["t", "scratch"] {
        live_tables += db
            .table_stats("scopedb", "public", t)
            .await
            .unwrap()
            .file_bytes;
    }
    // The Iceberg views' metadata is collected too: each view of each table keeps its
    // newest metadata, the hint, the current snapshot's two Avro files and at most a few
    // objects still inside their grace period, however many versions the churn made.
    let mut iceberg_bytes = 0;
    for table in std::fs::read_dir(objects.join("tables")).unwrap().flatten() {
        for view in ["metadata", "metadata-v2"] {
            let metadata = table.path().join(view);
            let count = std::fs::read_dir(&metadata).map_or(0, |d| d.count());
            assert!(count <= 8, "{} holds {count} objects", metadata.display());
            iceberg_bytes += bytes_under(&metadata);
        }
    }
    let table_bytes = bytes_under(&objects.join("tables")) - iceberg_bytes;
    assert!(
        table_bytes as f64 <= live_tables as f64 * 1.5,
        "tables hold {table_bytes} bytes (and {iceberg_bytes} of Iceberg metadata) for \
         {live_tables} live"
    );
    let stream_bytes = bytes_under(&objects.join("streams"));
    let live_stream = kept_stream.len() as u64;
    assert!(
        (stream_bytes as f64) <= live_stream as f64 * 1.5 + 4096.0,
        "streams hold {stream_bytes} bytes for {live_stream} live"
    );
    // The catalog keeps its newest versions and those inside the grace period, however
    // many changes the churn made (two a round).
    let catalog_versions = std::fs::read_dir(objects.join("catalog"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .count();
    assert!(
        catalog_versions <= 12,
        "the catalog keeps {catalog_versions} versions after {} changes",
        2 * 12 + 2
    );
    // The commit log keeps only what is not yet durable elsewhere: its released segments
    // are gone (segments are 4 KiB here; the churn wrote about 60 times that).
    let log_bytes = bytes_under(&dir.join("log"));
    assert!(
        log_bytes <= 16 * 4096,
        "the log directory holds {log_bytes} bytes after everything was flushed and \
         checkpointed"
    );
    println!("churn: {catalog_versions} catalog versions, {log_bytes} bytes of log");
    assert!(
        db.gc_stats()
            .objects
            .load(std::sync::atomic::Ordering::Relaxed)
            > 20
    );
    crash(db);
    let db = Database::open(c).await.unwrap();
    assert_eq!(ids(&db, "t").await, (0..next).collect::<Vec<_>>());
    assert_eq!(ids(&db, "scratch").await, (0..50).collect::<Vec<_>>());
    assert_eq!(stream_text(&db, "kept").await, kept_stream);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_collecting_garbage_never_delete_what_the_other_uses() {
    let root = common::temp_dir("gc-two-nodes");
    let store = root.join("objects");
    let node = |name: &str| {
        let mut c = config(&root.join(name));
        c.object_store = Some(store.display().to_string());
        c.tables.compact_min_files = 2;
        c
    };
    let a = Database::open(node("a")).await.unwrap();
    let b = Database::open(node("b")).await.unwrap();
    a.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    let mut expected = BTreeSet::new();
    for round in 0..8i64 {
        let (writer, other) = if round % 2 == 0 { (&a, &b) } else { (&b, &a) };
        ingest(writer, "t", round * 100..round * 100 + 20)
            .await
            .unwrap();
        expected.extend(round * 100..round * 100 + 20);
        writer.tables().flush_due(true).await.unwrap();
        other.refresh().await;
        let id = writer
            .catalog()
            .table("scopedb", "public", "t")
            .await
            .unwrap()
            .id;
        let _ = writer.tables().compact(&id).await;
        a.collect_garbage().await;
        b.collect_garbage().await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        for db in [&a, &b] {
            db.refresh().await;
            let got: BTreeSet<i64> = ids(db, "t").await.into_iter().collect();
            assert_eq!(got, expected, "round {round}");
        }
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    a.collect_garbage().await;
    b.collect_garbage().await;
    for db in [&a, &b] {
        db.refresh().await;
        let got: Vec<i64> = ids(db, "t").await;
        assert_eq!(got.len(), expected.len(), "a row twice or lost");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_survive_restarts() {
    let dir = common::temp_dir("subscriptions");
    let c = config(&dir);
    let db = Database::open(c.clone()).await.unwrap();
    let (addr, task) = common::serve(db.clone(), vec![]).await;
    let client = reqwest::Client::new();
    let sub = format!("http://{addr}/v1/stream/__ds/subscriptions/durable");
    let definition = json!({"type": "pull-wake", "pattern": "events/*", "wake_stream": "wake", "lease_ttl_ms": 1000});
    client
        .put(format!("http://{addr}/v1/stream/wake"))
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    let r = client.put(&sub).json(&definition).send().await.unwrap();
    assert_eq!(r.status(), 201);
    client
        .put(format!("http://{addr}/v1/stream/events/a"))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let claim: serde_json::Value = client
        .post(format!("{sub}/claim"))
        .json(&json!({"worker": "w"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let tail = claim["streams"][0]["tail_offset"]
        .as_str()
        .unwrap()
        .to_owned();
    let r = client
        .post(format!("{sub}/ack"))
        .bearer_auth(claim["token"].as_str().unwrap())
        .json(
            &json!({"wake_id": claim["wake_id"], "generation": claim["generation"],
                      "acks": [{"stream": "events/a", "offset": tail}], "done": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    task.abort();
    crash(db);
    let db = Database::open(c).await.unwrap();
    let (addr, _task) = common::serve(db, vec![]).await;
    let sub = format!("http://{addr}/v1/stream/__ds/subscriptions/durable");
    let got: serde_json::Value = client.get(&sub).send().await.unwrap().json().await.unwrap();
    assert_eq!(got["id"], "durable", "{got}");
    assert_eq!(got["streams"][0]["acked_offset"], tail, "{got}");
    // The same definition again is the same subscription.
    let r = client.put(&sub).json(&definition).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

/// A dropped table's records in the log are skipped at a restart, whatever garbage collection
/// left of its storage: here a flush that raced the collection of the dropped table left a
/// manifest version whose predecessors are gone (found by the lifecycle simulator: the next
/// start read that manifest for the replay and refused to start).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_tables_remnants_never_stop_a_start() {
    let dir = common::temp_dir("dropped-remnants");
    let c = config(&dir);
    let db = Database::open(c.clone()).await.unwrap();
    db.execute("CREATE TABLE gone (id int, note string)")
        .await
        .unwrap();
    db.execute("CREATE TABLE kept (id int, note string)")
        .await
        .unwrap();
    ingest(&db, "gone", 0..10).await.unwrap();
    ingest(&db, "kept", 0..10).await.unwrap();
    let id = db
        .catalog()
        .table("scopedb", "public", "gone")
        .await
        .unwrap()
        .id;
    db.execute("DROP TABLE gone").await.unwrap();
    crash(db);
    // What the race leaves: version 0 collected, a version 1 created after it.
    let log_dir = dir.join("objects").join("tables").join(&id).join("_log");
    let v0 = log_dir.join(format!("{:020}.json", 0));
    let text = std::fs::read_to_string(&v0).unwrap();
    std::fs::remove_file(&v0).unwrap();
    std::fs::write(
        log_dir.join(format!("{:020}.json", 1)),
        text.replace("\"version\":0", "\"version\":1"),
    )
    .unwrap();
    let db = Database::open(c.clone()).await.unwrap();
    assert_eq!(ids(&db, "kept").await, (0..10).collect::<Vec<_>>());
    assert!(db.execute("SELECT count(*) FROM gone").await.is_err());
    crash(db);
}

/// A start killed between its epoch claim and its first heartbeat leaves a claim with no
/// heartbeat after it: the next start of the same directory knows that claimer for its own
/// dead run (it holds the directory's lock) and goes ahead at once, instead of waiting a
/// whole lease for a heartbeat that cannot come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_killed_right_after_its_claim_does_not_hold_up_the_next() {
    let dir = common::temp_dir("claim-no-beat");
    let mut c = config(&dir);
    c.node_lease = Duration::from_secs(40);
    let db = Database::open(c.clone()).await.unwrap();
    db.execute("CREATE TABLE t (id int, note string)")
        .await
        .unwrap();
    ingest(&db, "t", 0..5).await.unwrap();
    crash(db);
    // What the killed start left: node.json at epoch 2 and its claim, no heartbeat of it.
    let identity: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("node.json")).unwrap()).unwrap();
    let id = identity["id"].as_str().unwrap().to_owned();
    let epoch = identity["epoch"].as_u64().unwrap();
    let epochs = dir.join("objects").join("nodes").join(&id).join("epochs");
    let mut claim: serde_json::Value =
        serde_json::from_slice(&std::fs::read(epochs.join(format!("{epoch:020}.json"))).unwrap())
            .unwrap();
    assert!(
        claim["dir"].as_str().is_some_and(|d| !d.is_empty()),
        "a claim names its directory: {claim}"
    );
    claim["epoch"] = (epoch + 1).into();
    claim["token"] = "killed-before-its-heartbeat".into();
    std::fs::write(
        epochs.join(format!("{:020}.json", epoch + 1)),
        claim.to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("node.json"),
        serde_json::json!({"id": id, "epoch": epoch + 1}).to_string(),
    )
    .unwrap();
    let started = std::time::Instant::now();
    let db = Database::open(c.clone()).await.unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "the start waited {took:?}, as if another process might still hold the id"
    );
    assert_eq!(ids(&db, "t").await, (0..5).collect::<Vec<_>>());
    crash(db);
}

/// What keys hold stays what the streams hold while charges move: a key appending to
/// another key's producer entry takes it over, and a key out of stream-state room drops its
/// own oldest retired records to make room for a new producer; all of it released when the
/// stream goes.
#[tokio::test]
async fn moved_and_evicted_producer_charges_match_a_recount() {
    use sluice::stream::ProducerTuple;
    let dir = common::temp_dir("moved-charges");
    let mut c = config(&dir);
    c.streams.producer_expiry = Duration::from_millis(1);
    c.streams.max_state_bytes = 8192;
    let db = Database::open(c).await.unwrap();
    let streams = db.streams();
    let (w1, w2): (Arc<str>, Arc<str>) = (Arc::from("w1"), Arc::from("w2"));
    let mut create = create_stream("s");
    create.key = Some(w1.clone());
    streams.create(create).await.unwrap();
    let produce = |key: &Arc<str>, id: String, seq: u64| {
        let mut a = append("s", "x".into());
        a.key = Some(key.clone());
        a.producer = Some(ProducerTuple { id, epoch: 0, seq });
        a
    };
    // w2 keeps w1's producer going: the entry is w2's from then on.
    streams
        .append(produce(&w1, "shared".into(), 0))
        .await
        .unwrap();
    let with_entry = streams.key_use("w1");
    streams
        .append(produce(&w2, "shared".into(), 1))
        .await
        .unwrap();
    streams.audit_key_use().unwrap();
    assert!(
        streams.key_use("w1").1 == 0 && with_entry.1 > 0,
        "{with_entry:?}"
    );
    assert_eq!(streams.key_use("w2").1, with_entry.1);
    // w1 cycles fresh producer ids through expiry until its retired records fill its
    // share (4096): each new one still gets in, and the counts match after each.
    for i in 0..60 {
        tokio::time::sleep(Duration::from_millis(3)).await;
        streams
            .append(produce(&w1, format!("session-{i}"), 0))
            .await
            .unwrap_or_else(|e| panic!("session {i}: {e}"));
        streams.audit_key_use().unwrap();
        assert!(streams.key_use("w1").0 <= 4096);
    }
    streams.delete("s", None).await.unwrap();
    streams.audit_key_use().unwrap();
    assert_eq!(streams.key_use("w1"), (0, 0));
    assert_eq!(streams.key_use("w2"), (0, 0));
}
