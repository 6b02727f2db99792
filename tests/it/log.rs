//! Commit log: append and reopen, group commit under concurrency, torn tails, corruption,
//! truncation, budgets, and injected I/O failures.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sluice::log::{CommitLog, Durability, FailPoint, LogConfig, LogError, Lsn, Record, RecordKind};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-log-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    files.sort();
    files
}

fn payload(i: u64) -> Vec<u8> {
    format!("record {i} {}", "x".repeat((i % 300) as usize)).into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_appends_are_group_committed_and_survive_reopen() {
    let dir = temp_dir("concurrent");
    let (log, replay) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    assert!(replay.is_empty());
    let mut tasks = Vec::new();
    for task in 0..64u64 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            for i in 0..20 {
                let id = task * 1000 + i;
                let lsn = log
                    .append(RecordKind::TableBatch, payload(id))
                    .await
                    .unwrap();
                acked.push((lsn, id));
            }
            acked
        }));
    }
    let mut acked: BTreeMap<Lsn, u64> = BTreeMap::new();
    for t in tasks {
        for (lsn, id) in t.await.unwrap() {
            assert!(acked.insert(lsn, id).is_none(), "LSN {lsn} given twice");
        }
    }
    let stats = log.stats();
    let (records, groups, syncs) = (
        stats.records.load(Ordering::Relaxed),
        stats.groups.load(Ordering::Relaxed),
        stats.syncs.load(Ordering::Relaxed),
    );
    assert_eq!(records, 1280);
    assert_eq!(groups, syncs);
    assert!(
        groups < records,
        "{groups} groups for {records} records: no grouping happened"
    );
    log.close();

    let (_log, replay) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    assert_eq!(replay.len(), 1280);
    let lsns: Vec<Lsn> = replay.iter().map(|r| r.lsn).collect();
    assert_eq!(lsns, (1..=1280).collect::<Vec<_>>());
    for record in &replay {
        assert_eq!(record.payload, payload(acked[&record.lsn]));
        assert_eq!(record.kind, RecordKind::TableBatch);
    }
}

/// A group is held back only if tasks woken from outside the workers of the runtime that
/// opened the log were still queued when the last sync ended, and never for long: on an idle
/// runtime no group is held (appends from inside it or from outside); with the only worker
/// blocked and tasks queued behind it, every append after the first is held, and each is
/// still acknowledged within seconds; once the queue is drained, nothing is held again.
#[test]
fn groups_are_held_only_while_the_runtime_is_behind_and_never_for_long() {
    /// Unblocks the worker however the test ends: a runtime's drop waits for its workers.
    struct Release(Arc<AtomicBool>);
    impl Drop for Release {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }

    let dir = temp_dir("hold");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let release = Release(Arc::new(AtomicBool::new(false)));
    let (log, _) = runtime
        .block_on(async { CommitLog::open(LogConfig::new(&dir)) })
        .unwrap();
    // Appends are awaited from a thread of their own, outside the log's runtime.
    let caller = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let append = |i: u64| {
        let acked = caller.block_on(async {
            let append = log.append(RecordKind::TableBatch, payload(i));
            tokio::time::timeout(std::time::Duration::from_secs(10), append).await
        });
        acked
            .unwrap_or_else(|_| panic!("append {i} not acknowledged in 10 s"))
            .unwrap();
    };
    let held = || log.stats().groups_held.load(Ordering::Relaxed);
    for i in 0..10 {
        append(i);
    }
    // A task of the log's own runtime: each answer wakes it through the runtime's queue,
    // after the sync that covered it was looked at.
    let on_runtime = log.clone();
    runtime
        .block_on(runtime.spawn(async move {
            for i in 10..20 {
                on_runtime
                    .append(RecordKind::TableBatch, payload(i))
                    .await
                    .unwrap();
            }
        }))
        .unwrap();
    assert_eq!(held(), 0, "groups held on an idle runtime");

    let (running_tx, running_rx) = std::sync::mpsc::channel();
    runtime.spawn({
        let release = release.0.clone();
        async move {
            running_tx.send(()).unwrap();
            // Blocks the only worker, as a long computation would.
            while !release.load(Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    });
    running_rx.recv().unwrap();
    // Spawned from outside the runtime, these wait in its queue behind the blocked worker.
    for _ in 0..4 {
        runtime.spawn(async {});
    }
    for i in 20..40 {
        append(i);
    }
    // The first append's group found the queue empty before it; every later one was held.
    assert_eq!(held(), 19, "groups held behind a busy runtime");
    drop(release);
    while runtime.metrics().global_queue_depth() > 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // The last sync found the queue full, but it is empty now: nothing to hold for.
    append(40);
    assert_eq!(held(), 19, "a group held after the workers caught up");
    log.close();

    let (_log, replay) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    let payloads: Vec<Vec<u8>> = replay.into_iter().map(|r| r.payload).collect();
    assert_eq!(payloads, (0..41).map(payload).collect::<Vec<_>>());
}

#[test]
fn appends_continue_after_reopen_and_kinds_round_trip() {
    let dir = temp_dir("reopen");
    let (log, _) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    assert_eq!(
        log.append_blocking(RecordKind::Metadata, b"create".to_vec())
            .unwrap(),
        1
    );
    assert_eq!(
        log.append_blocking(RecordKind::StreamAppend, b"hello".to_vec())
            .unwrap(),
        2
    );
    log.close();
    assert!(matches!(
        log.append_blocking(RecordKind::Metadata, vec![]),
        Err(LogError::Closed)
    ));
    let (log, replay) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    assert_eq!(
        replay,
        vec![
            Record {
                lsn: 1,
                kind: RecordKind::Metadata,
                payload: b"create".to_vec()
            },
            Record {
                lsn: 2,
                kind: RecordKind::StreamAppend,
                payload: b"hello".to_vec()
            },
        ]
    );
    assert_eq!(
        log.append_blocking(RecordKind::TableBatch, vec![]).unwrap(),
        3
    );
}

/// Every way a crash can cut the last segment short leaves exactly the whole records before
/// the cut, and the log goes on from there.
#[test]
fn torn_tails_are_cut_at_every_possible_length() {
    let dir = temp_dir("torn");
    let mut config = LogConfig::new(&dir);
    // Larger than the records; what the open segment is preallocated to.
    config.segment_bytes = 4096;
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    for i in 0..5 {
        log.append_blocking(RecordKind::TableBatch, payload(i))
            .unwrap();
    }
    log.close();
    let segment = segments(&dir).pop().unwrap();
    let full = fs::read(&segment).unwrap();
    // Record boundaries, from a clean read.
    let mut ends = vec![0usize];
    for i in 0..5 {
        ends.push(ends[i] + 17 + payload(i as u64).len());
    }
    assert_eq!(*ends.last().unwrap(), full.len());
    for cut in 0..full.len() {
        fs::write(&segment, &full[..cut]).unwrap();
        let (log, replay) = CommitLog::open(config.clone()).unwrap();
        let whole = ends.iter().filter(|&&e| e <= cut).count() - 1;
        assert_eq!(replay.len(), whole, "cut at {cut}");
        for (i, r) in replay.iter().enumerate() {
            assert_eq!(r.payload, payload(i as u64));
        }
        // Cut at the last whole record; the space after it (preallocated again for the
        // appends to come) holds nothing of the torn one.
        let repaired = fs::read(&segment).unwrap();
        assert_eq!(
            &repaired[..ends[whole]],
            &full[..ends[whole]],
            "cut at {cut}"
        );
        assert!(
            repaired[ends[whole]..].iter().all(|&b| b == 0),
            "cut at {cut}: repaired"
        );
        // The cut bytes are kept beside the segment.
        if cut > ends[whole] {
            let name = segment.file_name().unwrap().to_str().unwrap();
            let kept = segment.with_file_name(format!("{name}.torn-{}", ends[whole]));
            assert_eq!(
                fs::read(&kept).unwrap(),
                &full[ends[whole]..cut],
                "cut at {cut}"
            );
            // As an operator may; a later cut at the same offset would otherwise keep its
            // bytes under a new name beside this one.
            fs::remove_file(&kept).unwrap();
        }
        assert_eq!(
            log.append_blocking(RecordKind::Metadata, vec![1]).unwrap(),
            whole as u64 + 1
        );
        log.close();
    }
}

/// A crash leaves the active segment at its preallocated size: records, then zeros. The zeros
/// are a clean end (nothing torn, nothing kept aside); a torn record before them is cut and
/// kept with everything after it; appends go on right after the last record.
#[test]
fn a_crash_in_a_preallocated_segment_ends_it_at_its_last_record() {
    let dir = temp_dir("prealloc");
    let mut config = LogConfig::new(&dir);
    config.segment_bytes = 1 << 20;
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    for i in 0..5 {
        log.append_blocking(RecordKind::TableBatch, payload(i))
            .unwrap();
    }
    let segment = segments(&dir).pop().unwrap();
    // What a crash now would leave on disk (the log is still open).
    let mut crashed = fs::read(&segment).unwrap();
    let records_end: usize = (0..5).map(|i| 17 + payload(i).len()).sum();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    assert_eq!(crashed.len(), 1 << 20, "the open segment is preallocated");
    crashed.resize(crashed.len().max(1 << 20), 0);
    assert!(crashed[records_end..].iter().all(|&b| b == 0));
    log.close();
    assert_eq!(
        fs::metadata(&segment).unwrap().len() as usize,
        records_end,
        "a clean close gives the unused space back"
    );

    let kept = |dir: &Path| {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains(".torn-"))
            .collect::<Vec<_>>()
    };
    // Zeros after the last record: a clean end.
    fs::write(&segment, &crashed).unwrap();
    let (log, replay) = CommitLog::open(config.clone()).unwrap();
    assert_eq!(replay.len(), 5);
    assert!(kept(&dir).is_empty(), "nothing torn: {:?}", kept(&dir));
    assert_eq!(
        log.append_blocking(RecordKind::Metadata, b"next".to_vec())
            .unwrap(),
        6
    );
    log.close();
    let (log, replay) = CommitLog::open(config.clone()).unwrap();
    assert_eq!(replay.len(), 6);
    assert_eq!(replay[5].payload, b"next");
    log.close();

    // Part of a record, then zeros: the part is cut and kept (the zeros too, as read).
    let mut torn = crashed.clone();
    let partial = [9u8, 0, 0, 0, 0xab, 0xcd, 0xef, 0x01, 3, 6];
    torn[records_end..records_end + partial.len()].copy_from_slice(&partial);
    fs::write(&segment, &torn).unwrap();
    let (log, replay) = CommitLog::open(config.clone()).unwrap();
    assert_eq!(replay.len(), 5);
    let aside = kept(&dir);
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(fs::read(&aside[0]).unwrap(), &torn[records_end..]);
    assert_eq!(
        log.append_blocking(RecordKind::Metadata, vec![]).unwrap(),
        6
    );
    log.close();
}

/// Damage in an acknowledged record is corruption even when the records after it end in zero
/// bytes (an Arrow stream's end marker does; so does an empty payload's frame), with and
/// without preallocated space after them; and zeros at the end of a segment other than the
/// last are damage too.
#[test]
fn damage_before_records_ending_in_zeros_or_zeros_after_a_closed_segment_refuse_to_open() {
    let dir = temp_dir("zero-ended");
    let mut config = LogConfig::new(&dir);
    config.segment_bytes = 1 << 20;
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    let payloads: [&[u8]; 4] = [
        b"first record",
        b"second",
        b"arrow end \xff\xff\xff\xff\0\0\0\0",
        b"",
    ];
    for p in payloads {
        log.append_blocking(RecordKind::TableBatch, p.to_vec())
            .unwrap();
    }
    let segment = segments(&dir).pop().unwrap();
    let crashed = fs::read(&segment).unwrap();
    log.close();
    let closed = fs::read(&segment).unwrap();
    for image in [&closed, &crashed] {
        let mut damaged = image.clone();
        damaged[20] ^= 0x01; // inside the first record's payload
        fs::write(&segment, &damaged).unwrap();
        match CommitLog::open(config.clone()) {
            Err(LogError::Corrupt { offset: 0, .. }) => {}
            Err(e) => panic!("expected corruption at 0, got {e}"),
            Ok(_) => panic!("damage before acknowledged records was cut as a torn tail"),
        }
    }

    // Several segments, then zeros after the first one's records.
    let dir = temp_dir("zero-closed");
    let mut config = LogConfig::new(&dir);
    config.segment_bytes = 300;
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    for i in 0..20 {
        log.append_blocking(RecordKind::TableBatch, payload(i))
            .unwrap();
    }
    log.close();
    let files = segments(&dir);
    assert!(files.len() > 2, "several segments");
    let mut first = fs::read(&files[0]).unwrap();
    let records_end = first.len();
    first.resize(records_end + 4096, 0);
    fs::write(&files[0], &first).unwrap();
    match CommitLog::open(config.clone()) {
        Err(LogError::Corrupt { offset, .. }) => assert_eq!(offset as usize, records_end),
        Err(e) => panic!("expected corruption, got {e}"),
        Ok(_) => panic!("zeros after a closed segment's records were taken as its end"),
    }
}

#[test]
fn a_flipped_bit_in_the_tail_record_cuts_it_but_before_the_tail_refuses_to_open() {
    let dir = temp_dir("corrupt");
    let mut config = LogConfig::new(&dir);
    config.segment_bytes = 300;
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    for i in 0..40 {
        log.append_blocking(RecordKind::TableBatch, payload(i))
            .unwrap();
    }
    log.close();
    let files = segments(&dir);
    assert!(files.len() > 2, "several segments");

    // Damage inside the last segment's last record: that record is cut off.
    let last = files.last().unwrap();
    let mut bytes = fs::read(last).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0x40;
    fs::write(last, &bytes).unwrap();
    let (log, replay) = CommitLog::open(config.clone()).unwrap();
    assert_eq!(replay.len(), 39);
    log.close();

    // Damage in an earlier segment: acknowledged data would be lost, so opening fails.
    let mut bytes = fs::read(&files[0]).unwrap();
    bytes[20] ^= 0x01;
    fs::write(&files[0], &bytes).unwrap();
    match CommitLog::open(config) {
        Err(LogError::Corrupt { offset, .. }) => assert_eq!(offset, 0),
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn truncation_deletes_only_segments_below_the_durable_position() {
    let dir = temp_dir("truncate");
    let mut config = LogConfig::new(&dir);
    config.segment_bytes = 2000;
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    for i in 0..100 {
        log.append_blocking(RecordKind::TableBatch, payload(i))
            .unwrap();
    }
    let before = segments(&dir).len();
    let bytes_before = log.disk_bytes();
    assert!(before > 3);
    assert_eq!(log.truncate_before(1).unwrap(), 0);
    let deleted = log.truncate_before(50).unwrap();
    assert!(deleted > 0);
    assert!(log.disk_bytes() < bytes_before);
    log.close();
    let (_log, replay) = CommitLog::open(config).unwrap();
    // Everything from LSN 50 on is still there, and the log starts at a segment boundary.
    let first = replay.first().unwrap().lsn;
    assert!(first <= 50 && first > 1, "first {first}");
    assert_eq!(replay.last().unwrap().lsn, 100);
    let lsns: Vec<Lsn> = replay.iter().map(|r| r.lsn).collect();
    assert_eq!(lsns, (first..=100).collect::<Vec<_>>());
}

#[test]
fn over_budget_appends_are_refused_and_apply_nothing() {
    let dir = temp_dir("budget");
    let mut config = LogConfig::new(&dir);
    config.max_log_bytes = 500;
    config.segment_bytes = 200;
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    let mut acked = 0;
    loop {
        match log.append_blocking(RecordKind::TableBatch, vec![7; 100]) {
            Ok(_) => acked += 1,
            Err(e) => {
                assert!(matches!(e, LogError::Full { .. }), "{e}");
                assert!(sluice::error::Classify::class(&e).is_retryable());
                break;
            }
        }
    }
    // Freeing segments lets appends in again.
    assert!(log.truncate_before(acked).unwrap() > 0);
    log.append_blocking(RecordKind::TableBatch, vec![7; 100])
        .unwrap();
    log.close();
    let (_log, replay) = CommitLog::open(config).unwrap();
    assert_eq!(replay.last().unwrap().lsn, acked + 1);
}

#[test]
fn a_failed_sync_fails_its_group_poisons_the_log_and_restart_recovers() {
    let dir = temp_dir("failsync");
    let fail = Arc::new(AtomicBool::new(false));
    let mut config = LogConfig::new(&dir);
    let hook_flag = fail.clone();
    config.fail_hook = Some(Arc::new(move |point| {
        (point == FailPoint::BeforeSync && hook_flag.load(Ordering::SeqCst))
            .then(|| std::io::Error::other("injected fsync failure"))
    }));
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    log.append_blocking(RecordKind::TableBatch, b"acked".to_vec())
        .unwrap();
    fail.store(true, Ordering::SeqCst);
    let err = log
        .append_blocking(RecordKind::TableBatch, b"unacked".to_vec())
        .unwrap_err();
    assert!(err.to_string().contains("injected fsync failure"), "{err}");
    fail.store(false, Ordering::SeqCst);
    assert!(matches!(
        log.append_blocking(RecordKind::TableBatch, b"after".to_vec()),
        Err(LogError::Poisoned)
    ));
    log.close();
    let (_log, replay) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    // The acknowledged record is there; the failed one is there whole or not at all.
    assert_eq!(replay[0].payload, b"acked");
    assert!(replay.len() <= 2);
    if let Some(r) = replay.get(1) {
        assert_eq!(r.payload, b"unacked");
    }
}

#[test]
fn a_failed_write_applies_nothing() {
    let dir = temp_dir("failwrite");
    let mut config = LogConfig::new(&dir);
    config.fail_hook = Some(Arc::new(|point| {
        (point == FailPoint::BeforeWrite).then(|| std::io::Error::other("injected write failure"))
    }));
    let (log, _) = CommitLog::open(config).unwrap();
    assert!(
        log.append_blocking(RecordKind::TableBatch, b"x".to_vec())
            .is_err()
    );
    log.close();
    let (_log, replay) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    assert!(replay.is_empty());
}

#[test]
fn durability_none_still_orders_and_reopens() {
    let dir = temp_dir("nosync");
    let mut config = LogConfig::new(&dir);
    config.durability = Durability::None;
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    for i in 0..10 {
        log.append_blocking(RecordKind::TableBatch, payload(i))
            .unwrap();
    }
    assert_eq!(log.stats().syncs.load(Ordering::Relaxed), 0);
    log.close();
    let (_log, replay) = CommitLog::open(config).unwrap();
    assert_eq!(replay.len(), 10);
}

#[test]
fn stray_files_are_ignored() {
    let dir = temp_dir("stray");
    fs::create_dir_all(&dir).unwrap();
    fs::File::create(dir.join("notes.txt"))
        .unwrap()
        .write_all(b"hi")
        .unwrap();
    let (log, replay) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    assert!(replay.is_empty());
    assert_eq!(
        log.append_blocking(RecordKind::Metadata, vec![]).unwrap(),
        1
    );
}

#[test]
fn damage_before_a_complete_later_group_refuses_to_open_and_repair_moves_it_aside() {
    let dir = temp_dir("midsegment");
    let config = LogConfig::new(&dir);
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    // One segment, many groups (each blocking append is its own group).
    for i in 0..20 {
        log.append_blocking(RecordKind::TableBatch, payload(i))
            .unwrap();
    }
    log.close();
    let files = segments(&dir);
    assert_eq!(files.len(), 1);
    // Flip a bit in the payload of the fifth record: acknowledged records follow it.
    let mut bytes = fs::read(&files[0]).unwrap();
    let mut at = 0usize;
    for _ in 0..4 {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        at += 17 + len;
    }
    let damaged_at = at as u64;
    bytes[at + 20] ^= 0x10;
    fs::write(&files[0], &bytes).unwrap();
    match CommitLog::open(config.clone()) {
        Err(LogError::Corrupt { offset, path }) => {
            assert_eq!(offset, damaged_at);
            assert_eq!(path, files[0]);
        }
        other => panic!("expected Corrupt, got {:?}", other.map(|_| ())),
    }
    let moved = sluice::log::repair(&dir).unwrap();
    assert_eq!(moved.len(), 1);
    assert_eq!(moved[0].offset, damaged_at);
    assert!(moved[0].moved_to.exists());
    let (_log, replay) = CommitLog::open(config).unwrap();
    assert_eq!(replay.len(), 4);
}

#[test]
fn a_torn_final_group_is_cut_even_when_its_later_records_survived() {
    let dir = temp_dir("torn-group");
    let config = LogConfig::new(&dir);
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    for i in 0..5 {
        log.append_blocking(RecordKind::TableBatch, payload(i))
            .unwrap();
    }
    log.close();
    // A last group of three records, written by hand as the writer frames a group (only the
    // last record marked as its end), then its first record damaged: the power went out
    // before the group was synced, so nothing of it was acknowledged.
    let files = segments(&dir);
    let mut bytes = fs::read(&files[0]).unwrap();
    let start = bytes.len();
    for (i, lsn) in (6..9).enumerate() {
        let body = payload(100 + lsn);
        let kind = RecordKind::TableBatch as u8 | if i == 2 { 0x80 } else { 0 };
        let mut crc = crc32c::crc32c(&[kind]);
        crc = crc32c::crc32c_append(crc, &lsn.to_le_bytes());
        crc = crc32c::crc32c_append(crc, &body);
        bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&crc.to_le_bytes());
        bytes.push(kind);
        bytes.extend_from_slice(&lsn.to_le_bytes());
        bytes.extend_from_slice(&body);
    }
    bytes[start + 20] ^= 0x10;
    fs::write(&files[0], &bytes).unwrap();
    let (_log, replay) = CommitLog::open(config).unwrap();
    assert_eq!(replay.len(), 5);
}

#[test]
fn only_declared_consumers_release_and_segments_wait_for_all_of_them() {
    let dir = temp_dir("consumers");
    let mut config = LogConfig::new(&dir);
    config.segment_bytes = 300;
    config.consumers = vec!["tables".into(), "streams".into()];
    let (log, _) = CommitLog::open(config.clone()).unwrap();
    assert!(matches!(
        log.consumer("other"),
        Err(LogError::UnknownConsumer(_))
    ));
    for i in 0..40 {
        log.append_blocking(RecordKind::TableBatch, payload(i))
            .unwrap();
    }
    let before = segments(&dir).len();
    // One consumer alone releases nothing: the other still needs everything.
    let tables = log.consumer("tables").unwrap();
    assert_eq!(tables.release_before(40).unwrap(), 0);
    assert_eq!(segments(&dir).len(), before);
    let streams = log.consumer("streams").unwrap();
    assert!(streams.release_before(40).unwrap() > 0);
    log.close();
}

#[tokio::test]
async fn advancing_starts_a_new_segment_at_the_epochs_first_lsn() {
    let dir = temp_dir("advance");
    let (log, _) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    assert_eq!(
        log.append(RecordKind::Metadata, b"a".to_vec())
            .await
            .unwrap(),
        1
    );
    assert_eq!(log.advance_to(1 << 48).await.unwrap(), 1 << 48);
    assert_eq!(
        log.append(RecordKind::Metadata, b"b".to_vec())
            .await
            .unwrap(),
        1 << 48
    );
    log.fence();
    assert!(matches!(
        log.append(RecordKind::Metadata, b"c".to_vec()).await,
        Err(LogError::Fenced)
    ));
    log.close();
    let (_log, replay) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    let lsns: Vec<Lsn> = replay.iter().map(|r| r.lsn).collect();
    assert_eq!(lsns, vec![1, 1 << 48]);
}

/// A log moved on to a new epoch that wrote nothing there reopens at that epoch's position,
/// not at the last record of the epoch before: a node reports the position it reached as
/// durable, and a reopened log that fell short of it would be taken for a stale copy (a start
/// that wrote nothing made the next start refuse).
#[tokio::test]
async fn a_log_advanced_with_no_record_since_reopens_where_it_was_advanced_to() {
    let dir = temp_dir("advance-empty");
    let (log, _) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    let first = log
        .append(RecordKind::Metadata, b"a".to_vec())
        .await
        .unwrap();
    assert_eq!(log.advance_to(2 << 48).await.unwrap(), 2 << 48);
    let reached = log.last_lsn();
    assert_eq!(reached, (2 << 48) - 1);
    log.close();
    for round in 0..3 {
        let (log, replay) = CommitLog::open(LogConfig::new(&dir)).unwrap();
        assert_eq!(
            replay.iter().map(|r| r.lsn).collect::<Vec<_>>(),
            vec![first]
        );
        assert!(
            log.last_lsn() >= reached,
            "round {round}: reopened at {} after reaching {reached}",
            log.last_lsn()
        );
        // The next epoch moves on again, writing nothing (a start stopped before any write).
        let next = (3 + round as u64) << 48;
        assert_eq!(log.advance_to(next).await.unwrap(), next);
        log.close();
    }
    let (log, _) = CommitLog::open(LogConfig::new(&dir)).unwrap();
    assert_eq!(log.last_lsn(), (5 << 48) - 1);
    log.close();
}
