//! Incremental stream checkpoints through the real binary: a checkpoint writes what changed
//! (a delta a fraction of the base's size), and a server killed with SIGKILL between
//! checkpoints comes back from the base, its deltas and the log with every acknowledged
//! change: appended data, deleted, created and closed streams, and producers' sequences.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::common::{self, Server};

/// Waits until a checkpoint that began after every change so far was written: two in a row,
/// each after an append to stream `tick` (a checkpoint writes only when something changed).
async fn checkpoints(client: &reqwest::Client, base: &str) {
    for _ in 0..2 {
        let start = common::metric(client, base, "sluice_stream_checkpoints_total").await;
        assert_eq!(post(client, base, "tick", ".", None, false).await, 204);
        let started = Instant::now();
        while common::metric(client, base, "sluice_stream_checkpoints_total").await < start + 1.0 {
            assert!(started.elapsed() < Duration::from_secs(30), "no checkpoint");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The producer's append `seq` to stream `s0999`, acknowledged and added to the model.
async fn produce(
    client: &reqwest::Client,
    base: &str,
    model: &mut BTreeMap<String, (String, bool)>,
    seq: u64,
) {
    let text = format!("p{seq};");
    let status = post(client, base, "s0999", &text, Some(("prod", seq)), false).await;
    assert_eq!(status, 200);
    if let Some((content, _)) = model.get_mut("s0999") {
        content.push_str(&text);
    }
}

/// Sizes of the objects under `dir`, by name.
fn objects(dir: &std::path::Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(meta) = entry.metadata() {
                out.insert(path.display().to_string(), meta.len());
            }
        }
    }
    out
}

async fn put(client: &reqwest::Client, base: &str, name: &str, body: &str) -> u16 {
    client
        .put(format!("{base}/v1/stream/{name}"))
        .header("content-type", "text/plain")
        .body(body.to_owned())
        .send()
        .await
        .expect("create")
        .status()
        .as_u16()
}

async fn post(
    client: &reqwest::Client,
    base: &str,
    name: &str,
    body: &str,
    producer: Option<(&str, u64)>,
    close: bool,
) -> u16 {
    let mut r = client
        .post(format!("{base}/v1/stream/{name}"))
        .header("content-type", "text/plain")
        .body(body.to_owned());
    if let Some((id, seq)) = producer {
        r = r
            .header("producer-id", id)
            .header("producer-epoch", "0")
            .header("producer-seq", seq.to_string());
    }
    if close {
        r = r.header("stream-closed", "true");
    }
    r.send().await.expect("append").status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_write_what_changed_and_a_killed_server_loads_it_all() {
    // Small log segments, so that what a checkpoint covers leaves the log and a restart
    // must find it in the base and its deltas; checkpoints every 0.3 s.
    let config = "log_segment_bytes = 65536\nstream_checkpoint_interval_seconds = 0.3\n\
                  maintenance_interval_seconds = 0.1\n";
    let mut server = Server::start("deltas", &[], config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    let filler = "f".repeat(4000);
    // The model: each live stream's content and whether it is closed.
    let mut model: BTreeMap<String, (String, bool)> = BTreeMap::new();
    assert_eq!(put(&client, &base, "tick", "").await, 201);
    for i in 0..1000 {
        let name = format!("s{i:04}");
        assert_eq!(put(&client, &base, &name, "start;").await, 201);
        model.insert(name, ("start;".into(), false));
    }
    checkpoints(&client, &base).await;
    let streams_dir = server.dir.join("data/objects/streams");
    let mut deleted = Vec::new();
    let mut seq = 0;
    for round in 0..4 {
        let before = objects(&streams_dir);
        // A few changes: appends (one through a producer, one big enough to roll log
        // segments), a delete, a create, a close.
        let a = format!("s{:04}", round * 7 + 1);
        let text = format!("r{round};");
        assert_eq!(post(&client, &base, &a, &text, None, false).await, 204);
        model.get_mut(&a).unwrap().0.push_str(&text);
        produce(&client, &base, &mut model, seq).await;
        for _ in 0..20 {
            assert_eq!(
                post(&client, &base, "s0998", &filler, None, false).await,
                204
            );
            model.get_mut("s0998").unwrap().0.push_str(&filler);
        }
        let gone = format!("s{:04}", 500 + round);
        let r = client
            .delete(format!("{base}/v1/stream/{gone}"))
            .send()
            .await
            .expect("delete");
        assert_eq!(r.status(), 204);
        model.remove(&gone);
        deleted.push(gone);
        let new = format!("new{round}");
        assert_eq!(put(&client, &base, &new, "fresh;").await, 201);
        model.insert(new, ("fresh;".into(), false));
        let closed = format!("s{:04}", 800 + round);
        assert_eq!(post(&client, &base, &closed, "", None, true).await, 204);
        model.get_mut(&closed).unwrap().1 = true;
        // Two checkpoints: the changes are in one, and the log up to it is released.
        checkpoints(&client, &base).await;
        let after = objects(&streams_dir);
        let bases: Vec<u64> = after
            .iter()
            .filter(|(k, _)| k.contains("/snapshots/"))
            .map(|(_, v)| *v)
            .collect();
        let deltas: Vec<(String, u64)> = after
            .iter()
            .filter(|(k, _)| k.contains("/deltas/") && !before.contains_key(*k))
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        let largest_base = bases.iter().copied().max().unwrap_or(0);
        println!("round {round}: base {largest_base} bytes; new deltas {deltas:?}");
        assert!(
            largest_base > 100_000,
            "a base of 1000 streams: {largest_base}"
        );
        for (name, size) in &deltas {
            assert!(
                *size * 20 < largest_base,
                "delta {name} of {size} bytes for a few changes"
            );
        }
        // Killed between checkpoints, with one more acknowledged append in the log only.
        seq += 1;
        produce(&client, &base, &mut model, seq).await;
        server.restart();
        // Everything acknowledged is there.
        for (name, (content, closed)) in &model {
            let r = client
                .get(format!("{base}/v1/stream/{name}?offset=-1"))
                .send()
                .await
                .expect("read");
            assert_eq!(r.status(), 200, "{name} after restart {round}");
            let is_closed = r.headers().get("stream-closed").is_some();
            assert_eq!(&r.text().await.expect("body"), content, "{name}");
            assert_eq!(is_closed, *closed, "{name} closed");
        }
        for name in &deleted {
            let r = client
                .get(format!("{base}/v1/stream/{name}?offset=-1"))
                .send()
                .await
                .expect("read");
            assert_eq!(r.status(), 404, "{name} was deleted");
        }
        // The producer's last append is a duplicate, the next one is new.
        assert_eq!(
            post(&client, &base, "s0999", "dup", Some(("prod", seq)), false).await,
            204
        );
        seq += 1;
        produce(&client, &base, &mut model, seq).await;
        seq += 1;
    }
}

/// Waits until a checkpoint is written after the change just made (or one that was being
/// written when it was made).
async fn one_checkpoint(client: &reqwest::Client, base: &str) {
    let start = common::metric(client, base, "sluice_stream_checkpoints_total").await;
    let started = Instant::now();
    while common::metric(client, base, "sluice_stream_checkpoints_total").await < start + 1.0 {
        assert!(started.elapsed() < Duration::from_secs(30), "no checkpoint");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_appended_at_every_checkpoint_keeps_deltas_and_extents_small() {
    use futures::StreamExt as _;
    // Checkpoints every 0.1 s; a stream with 1000 producers, then one byte through one of
    // them before each of 60 checkpoints. Each delta holds that producer and the extents
    // that changed (not the stream's 1000 producers, nor one extent per checkpoint so far),
    // the extents are merged and counted in the stream state, and a killed server loads it
    // all.
    let config = "log_segment_bytes = 65536\nstream_checkpoint_interval_seconds = 0.1\n\
                  maintenance_interval_seconds = 0.05\n";
    let mut server = Server::start("patches", &[], config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    assert_eq!(put(&client, &base, "many", "").await, 201);
    assert_eq!(put(&client, &base, "tick", "").await, 201);
    // Sealed extents count in the stream state: "tick" gets one or two (two appends, two
    // checkpoints; its state has nothing else that grows).
    let empty = common::metric(&client, &base, "sluice_stream_state_bytes").await;
    checkpoints(&client, &base).await;
    let sealed = common::metric(&client, &base, "sluice_stream_state_bytes").await;
    println!("stream state {empty} -> {sealed} bytes with tick's extents");
    assert!(sealed - empty >= 100.0, "the extents are not counted");
    let statuses: Vec<u16> = futures::stream::iter(0..1000)
        .map(|i| {
            let (client, base) = (client.clone(), base.clone());
            async move {
                let id = format!("producer-{i:04}");
                post(&client, &base, "many", "x", Some((id.as_str(), 0)), false).await
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let mut content = "x".repeat(1000);
    checkpoints(&client, &base).await;
    let state_before = common::metric(&client, &base, "sluice_stream_state_bytes").await;
    let streams_dir = server.dir.join("data/objects/streams");
    let before = objects(&streams_dir);
    let largest_base = before
        .iter()
        .filter(|(k, _)| k.contains("/snapshots/") || k.contains("/deltas/"))
        .map(|(_, v)| *v)
        .max()
        .unwrap_or(0);
    assert!(
        largest_base > 50_000,
        "1000 producers in {largest_base} bytes"
    );
    for seq in 1..=60u64 {
        let status = post(
            &client,
            &base,
            "many",
            "y",
            Some(("producer-0007", seq)),
            false,
        )
        .await;
        assert_eq!(status, 200);
        content.push('y');
        one_checkpoint(&client, &base).await;
    }
    let after = objects(&streams_dir);
    let deltas: Vec<(&String, &u64)> = after
        .iter()
        .filter(|(k, _)| k.contains("/deltas/") && !before.contains_key(*k))
        .collect();
    assert!(deltas.len() >= 30, "{} new deltas", deltas.len());
    let largest = deltas.iter().map(|(_, v)| **v).max().unwrap_or(0);
    println!(
        "{} new deltas, the largest {largest} bytes (the base {largest_base})",
        deltas.len()
    );
    for (name, size) in &deltas {
        assert!(**size < 4096, "delta {name} of {size} bytes for one byte");
    }
    // Extents count in the stream state, and stay few: one per checkpoint would be 60.
    let state_after = common::metric(&client, &base, "sluice_stream_state_bytes").await;
    let grown = state_after - state_before;
    println!("stream state {state_before} -> {state_after} bytes");
    assert!(
        grown < 12.0 * 200.0,
        "the stream state grew by {grown} bytes"
    );
    // Killed, and back from the base, its deltas and the log: all data, and the producers.
    server.restart();
    let r = client
        .get(format!("{base}/v1/stream/many?offset=-1"))
        .send()
        .await
        .expect("read");
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.expect("body"), content);
    assert_eq!(
        post(
            &client,
            &base,
            "many",
            "dup",
            Some(("producer-0007", 60)),
            false
        )
        .await,
        204
    );
    assert_eq!(
        post(
            &client,
            &base,
            "many",
            "dup",
            Some(("producer-0999", 0)),
            false
        )
        .await,
        204
    );
    assert_eq!(
        post(
            &client,
            &base,
            "many",
            "z",
            Some(("producer-0999", 1)),
            false
        )
        .await,
        200
    );
    let restarted = common::metric(&client, &base, "sluice_stream_state_bytes").await;
    assert_eq!(
        restarted, state_after,
        "the state counts as it did before the restart"
    );
}
