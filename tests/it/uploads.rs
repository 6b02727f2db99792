//! Uploads no client can hold hostage, and requests judged by every host they name: each
//! through the real binary on loopback.
//!
//! - Bodies reserve the request-body budget as their bytes arrive: clients trickling chunked
//!   (and declared) bodies into both ingest routes and a stream hold next to nothing, and a
//!   normal one-row ingest from another connection is answered at once.
//! - A body slower than `min_body_bytes_per_second` (after its grace) is cut with 408 long
//!   before the body timeout, and gives back what it held.
//! - The wait for room is bounded (503 with `Retry-After`, nothing applied), and one key
//!   cannot take the whole budget: another key still gets in.
//! - One write key cannot fill the stream-state or producer budgets; a refusal names the
//!   budget that is full; a key taking over another key's producer pays for it; a key
//!   cycling producer ids makes room with its own oldest retired records; creates refused by
//!   a full server sweep for idle producers at most once a second.
//! - Two `Host` headers answer 400; a host in an absolute-form target is judged too; a
//!   client's forwarding headers never set the host of a create's `Location`.

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{self, Server};

fn addr(server: &Server) -> SocketAddr {
    server
        .base
        .trim_start_matches("http://")
        .parse()
        .expect("loopback address")
}

/// Sends `head` (request line and headers, no blank line) with a body that never ends: a
/// byte a second (chunked, or raw when `chunked` is false) until the server answers or
/// closes, or `stop` is set. Returns what the server said and when, after the first byte.
fn trickle(
    addr: SocketAddr,
    head: String,
    chunked: bool,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(String, Duration)> {
    std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.write_all(format!("{head}\r\n\r\n").as_bytes())
            .expect("headers");
        s.set_read_timeout(Some(Duration::from_millis(1000)))
            .expect("timeout");
        let started = Instant::now();
        let mut said = Vec::new();
        while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(150) {
            let byte: &[u8] = if chunked { b"1\r\n{\r\n" } else { b"{" };
            if s.write_all(byte).is_err() {
                break;
            }
            let mut buf = [0u8; 4096];
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    said.extend_from_slice(&buf[..n]);
                    if said.windows(4).any(|w| w == b"\r\n\r\n") {
                        // The head is in; the rest of a short answer follows at once.
                        s.set_read_timeout(Some(Duration::from_millis(500))).ok();
                        let _ = s.read_to_end(&mut said);
                        break;
                    }
                }
                Err(_) => {} // nothing yet: one more byte
            }
        }
        (
            String::from_utf8_lossy(&said).into_owned(),
            started.elapsed(),
        )
    })
}

async fn create_events(client: &reqwest::Client, base: &str, key: Option<&str>) {
    let mut put = client
        .put(format!(
            "{base}/v1/catalog/databases/scopedb/schemas/public/tables/events"
        ))
        .json(&common::events_def());
    if let Some(key) = key {
        put = put.bearer_auth(key);
    }
    let r = put.send().await.expect("create table");
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
}

const ROW: &str =
    r#"{"time":"2026-10-23T09:00:00Z","service":"s","name":"n","message":"m","var":{}}"#;

/// One normal one-row ingest; its status and how long it took.
async fn one_row(client: &reqwest::Client, base: &str, key: Option<&str>) -> (u16, Duration) {
    let started = Instant::now();
    let mut post = client
        .post(format!(
            "{base}/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest"
        ))
        .header("content-type", "application/x-ndjson")
        .body(format!("{ROW}\n"));
    if let Some(key) = key {
        post = post.bearer_auth(key);
    }
    let r = post.send().await.expect("ingest");
    (r.status().as_u16(), started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_upload_costs_the_others_nothing() {
    // The defaults: 32 MiB of bodies at once, 1 KiB/s after 10 s, 120 s to arrive.
    let server = Server::start("trickle", &[], "");
    let base = server.base.clone();
    let client = reqwest::Client::new();
    create_events(&client, &base, None).await;
    let r = client
        .put(format!("{base}/v1/stream/trickled"))
        .header("content-type", "text/plain")
        .send()
        .await
        .expect("create stream");
    assert_eq!(r.status(), 201);
    let stop = Arc::new(AtomicBool::new(false));
    let at = addr(&server);
    let table = "POST /v1/catalog/databases/scopedb/schemas/public/tables/events/ingest HTTP/1.1\r\n\
                 Host: localhost\r\nContent-Type: application/x-ndjson";
    let legacy = "POST /v1/ingest HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json";
    let stream = "POST /v1/stream/trickled HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain";
    let mut tricklers = Vec::new();
    // Chunked bodies into both ingest routes (twice each: two such held all ingest before),
    // a gzip body (its decoded size unknown), one declaring the whole 16 MiB limit, and a
    // stream append.
    for (head, chunked) in [
        (format!("{table}\r\nTransfer-Encoding: chunked"), true),
        (format!("{table}\r\nTransfer-Encoding: chunked"), true),
        (format!("{legacy}\r\nTransfer-Encoding: chunked"), true),
        (format!("{legacy}\r\nTransfer-Encoding: chunked"), true),
        (
            format!("{table}\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked"),
            true,
        ),
        (format!("{table}\r\nContent-Length: 16777216"), false),
        (format!("{stream}\r\nTransfer-Encoding: chunked"), true),
    ] {
        tricklers.push(trickle(at, head, chunked, stop.clone()));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // While they trickle: normal ingests from other connections are answered promptly, and
    // the tricklers hold next to nothing of the budget.
    let mut latencies = Vec::new();
    for _ in 0..5 {
        let (status, took) = one_row(&client, &base, None).await;
        assert_eq!(status, 200);
        latencies.push(took);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let held = common::metric(&client, &base, "sluice_request_body_bytes_held").await;
    println!(
        "one-row ingest latencies beside 7 trickling uploads: {latencies:?}; held {held} bytes"
    );
    for took in &latencies {
        assert!(
            *took < Duration::from_secs(5),
            "a normal ingest waited {took:?} behind trickling uploads"
        );
    }
    assert!(held <= f64::from(1 << 20), "tricklers hold {held} bytes");
    // Each trickler is cut by its pace (10 s of grace, then 1 KiB/s): 408, well before the
    // 120 s body timeout, and gives back what it held.
    for t in tricklers {
        let (said, after) = tokio::task::spawn_blocking(move || t.join().expect("trickler"))
            .await
            .expect("join");
        println!(
            "trickler cut after {after:?}: {}",
            said.lines().next().unwrap_or("")
        );
        assert!(said.starts_with("HTTP/1.1 408"), "{said}");
        assert!(said.contains("\"status\":\"rejected\""), "{said}");
        assert!(after < Duration::from_secs(30), "cut only after {after:?}");
    }
    stop.store(true, Ordering::Relaxed);
    assert_eq!(
        common::metric(&client, &base, "sluice_request_body_bytes_held").await,
        0.0
    );
    // Nothing of theirs was applied: the five rows only, and an empty stream.
    let rows = common::statement(&client, &base, "SELECT count(*) FROM events").await;
    assert_eq!(rows["result_set"]["rows"][0][0], "5");
    let r = client
        .get(format!("{base}/v1/stream/trickled?offset=-1"))
        .send()
        .await
        .expect("read");
    assert_eq!(r.text().await.expect("body"), "");
}

/// A body that sends `sent` bytes of the `declared` length at once and then nothing: it
/// holds what it sent until the server answers (returned) or `stop`.
fn stall(addr: SocketAddr, key: Option<&str>, sent: usize) -> std::thread::JoinHandle<String> {
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        let head = format!(
            "POST /v1/catalog/databases/scopedb/schemas/public/tables/events/ingest HTTP/1.1\r\n\
             Host: localhost\r\n{auth}Content-Type: application/x-ndjson\r\n\
             Content-Length: {}\r\n\r\n",
            sent * 2
        );
        s.write_all(head.as_bytes()).expect("head");
        s.write_all(&vec![b' '; sent]).expect("body");
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let mut said = String::new();
        let _ = s.read_to_string(&mut said);
        said
    })
}

async fn wait_held(client: &reqwest::Client, base: &str, at_least: f64) {
    let started = Instant::now();
    while common::metric(client, base, "sluice_request_body_bytes_held").await < at_least {
        assert!(started.elapsed() < Duration::from_secs(60), "never held");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_waits_are_bounded_and_one_key_cannot_take_the_budget() {
    // A 2 MiB budget, 1 s of waiting, no pace (the stalled bodies stay), bodies time out
    // after 20 s.
    let config = "ingest_inflight_bytes = 2097152\ningest_admission_timeout_seconds = 1\n\
                  min_body_bytes_per_second = 0\nrequest_body_timeout_seconds = 20\n";
    let server = Server::start(
        "admission",
        &[
            "--api-key",
            "admin=a-key",
            "--api-key",
            "write=w1",
            "--api-key",
            "write=w2",
        ],
        config,
    );
    let base = server.base.clone();
    let client = reqwest::Client::new();
    create_events(&client, &base, Some("a-key")).await;
    let at = addr(&server);
    // Key w1 stalls a body past half the budget: it holds its share (1 MiB) and no more.
    let hog = stall(at, Some("w1"), 1536 << 10);
    wait_held(&client, &base, f64::from(1 << 20)).await;
    // w1 gets no more within the wait: 503, Retry-After, nothing applied.
    let started = Instant::now();
    let r = client
        .post(format!(
            "{base}/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest"
        ))
        .bearer_auth("w1")
        .header("content-type", "application/x-ndjson")
        .body(format!("{ROW}\n"))
        .send()
        .await
        .expect("ingest");
    let waited = started.elapsed();
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.headers().get("retry-after").map(|v| v.to_str().unwrap()),
        Some("1")
    );
    let body: Value = r.json().await.expect("json");
    assert_eq!(body["code"], "service_unavailable");
    assert_eq!(body["details"]["status"], "rejected");
    println!("refused after {waited:?}: {body}");
    assert!(waited < Duration::from_secs(10), "waited {waited:?}");
    // Another key still gets in at once.
    let (status, took) = one_row(&client, &base, Some("w2")).await;
    assert_eq!(status, 200);
    println!("another key's ingest beside the stalled one: {took:?}");
    // A second stalled key takes the rest: now anyone waits, and is refused in bounded time.
    let hog2 = stall(at, Some("w2"), 1536 << 10);
    wait_held(&client, &base, f64::from(2 << 20)).await;
    let (status, took) = one_row(&client, &base, Some("a-key")).await;
    assert_eq!(status, 503, "the budget is full");
    assert!(took < Duration::from_secs(10), "waited {took:?}");
    // The stalled bodies end at their timeout; the budget is whole again.
    for h in [hog, hog2] {
        let said = tokio::task::spawn_blocking(move || h.join().expect("stall"))
            .await
            .expect("join");
        assert!(said.starts_with("HTTP/1.1 408"), "{said}");
    }
    assert_eq!(
        common::metric(&client, &base, "sluice_request_body_bytes_held").await,
        0.0
    );
    let (status, _) = one_row(&client, &base, Some("w1")).await;
    assert_eq!(status, 200);
    let mut auth = reqwest::header::HeaderMap::new();
    auth.insert(
        "authorization",
        reqwest::header::HeaderValue::from_static("Bearer a-key"),
    );
    let admin = reqwest::Client::builder()
        .default_headers(auth)
        .build()
        .expect("client");
    let rows = common::statement(&admin, &base, "SELECT count(*) FROM events").await;
    assert_eq!(rows["result_set"]["rows"][0][0], "2");
}

/// Sends raw request bytes; the server's whole answer.
fn raw(addr: SocketAddr, request: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.write_all(request.as_bytes()).expect("request");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut said = String::new();
    let _ = s.read_to_string(&mut said);
    said
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_judged_by_every_host_they_name() {
    let server = Server::start("hosts", &[], "");
    let at = addr(&server);
    let answers = tokio::task::spawn_blocking(move || {
        [
            // Two Host headers, the first allowed: refused, whichever comes first.
            "GET /v1/catalog HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
            "GET /v1/catalog HTTP/1.1\r\nHost: evil.example\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            "GET /v1/health HTTP/1.1\r\nHost: localhost\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            // An absolute-form target naming another host.
            "GET http://evil.example/v1/catalog HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            // The same, naming this host: served.
            "GET http://localhost/v1/catalog HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        ]
        .map(|request| raw(at, request))
    })
    .await
    .expect("requests");
    for two in &answers[..3] {
        assert!(two.starts_with("HTTP/1.1 400"), "{two}");
        assert!(two.contains("more than one Host"), "{two}");
    }
    assert!(answers[3].starts_with("HTTP/1.1 421"), "{}", answers[3]);
    assert!(answers[4].starts_with("HTTP/1.1 200"), "{}", answers[4]);

    // A client's forwarding headers (and the marker peers use) never name the Location.
    let client = reqwest::Client::new();
    for (i, (name, value)) in [
        ("x-forwarded-host", "evil.example"),
        ("forwarded", "host=evil.example"),
    ]
    .into_iter()
    .enumerate()
    {
        let r = client
            .put(format!("{}/v1/stream/located-{i}", server.base))
            .header(name, value)
            .header("sluice-forwarded", "1")
            .send()
            .await
            .expect("create");
        assert_eq!(r.status(), 201);
        let location = r.headers()["location"]
            .to_str()
            .expect("location")
            .to_owned();
        let port = at.port();
        assert_eq!(
            location,
            format!("http://127.0.0.1:{port}/v1/stream/located-{i}")
        );
    }
}

/// An append with producer headers; its status and the answer's headers.
async fn produce(
    client: &reqwest::Client,
    base: &str,
    stream: &str,
    id: &str,
    seq: u64,
) -> (u16, reqwest::header::HeaderMap) {
    let r = client
        .post(format!("{base}/v1/stream/{stream}"))
        .header("content-type", "text/plain")
        .header("producer-id", id)
        .header("producer-epoch", "0")
        .header("producer-seq", seq.to_string())
        .body(format!("{id}:{seq};"))
        .send()
        .await
        .expect("append");
    (r.status().as_u16(), r.headers().clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_producers_expire_and_byte_budgets_hold() {
    // Producers forgotten after 3 s idle, at most 5 per stream; producer entries within
    // 4 KiB in all (8 of these ids), stream state within 12 KiB.
    let config = "producer_expiry_seconds = 3\nmax_producers_per_stream = 5\n\
                  max_producer_bytes = 4096\nmax_stream_state_bytes = 12288\n\
                  stream_checkpoint_interval_seconds = 1\n";
    let mut server = Server::start("producers", &[], config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    for name in ["junk", "other"] {
        let r = client
            .put(format!("{base}/v1/stream/{name}"))
            .header("content-type", "text/plain")
            .send()
            .await
            .expect("create");
        assert_eq!(r.status(), 201);
    }
    // Five junk producers fill the stream; a sixth is refused (429), nothing applied.
    for i in 0..5 {
        assert_eq!(
            produce(&client, &base, "junk", &format!("j{i}"), 0).await.0,
            200
        );
    }
    let (status, _) = produce(&client, &base, "junk", "late", 0).await;
    assert_eq!(status, 429);
    // A producer that keeps appending stays known past the expiry; its retries are
    // duplicates.
    let started = Instant::now();
    let mut seq = 0;
    assert_eq!(produce(&client, &base, "other", "live", 0).await.0, 200);
    while started.elapsed() < Duration::from_millis(4500) {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        seq += 1;
        assert_eq!(produce(&client, &base, "other", "live", seq).await.0, 200);
    }
    assert_eq!(produce(&client, &base, "other", "live", seq).await.0, 204);
    // The junk producers were idle past the expiry: a new producer gets in.
    let (status, _) = produce(&client, &base, "junk", "late", 0).await;
    assert_eq!(status, 200);
    // An expired producer is retired, not forgotten: a retry of the append it made is a
    // duplicate (204), never appended a second time, and a skipped sequence is a gap.
    let (status, _) = produce(&client, &base, "junk", "j1", 0).await;
    assert_eq!(status, 204);
    let (status, headers) = produce(&client, &base, "junk", "j1", 2).await;
    assert_eq!(status, 409);
    assert_eq!(headers["producer-expected-seq"], "1");
    // The producer budget: 4 KiB holds a few more entries, then 503 with Retry-After.
    let mut refused = None;
    for i in 0..10 {
        // Spread over both streams, under their count cap.
        let stream = if i % 2 == 0 { "junk" } else { "other" };
        let (status, headers) = produce(&client, &base, stream, &format!("b{i}"), 0).await;
        if status != 200 {
            refused = Some((i, status, headers));
            break;
        }
    }
    let (admitted, status, headers) = refused.expect("the producer budget never filled");
    println!("{admitted} producers admitted before the 4 KiB producer budget was full");
    assert_eq!(status, 503);
    assert_eq!(headers["retry-after"], "60");
    assert_eq!(headers["x-sluice-not-applied"], "StreamStateFull");
    let producer_bytes = common::metric(&client, &base, "sluice_stream_producer_bytes").await;
    assert!(producer_bytes <= 4096.0, "{producer_bytes}");
    // The state budget: creates are refused once it is full.
    let mut created = 0;
    let status = loop {
        let r = client
            .put(format!("{base}/v1/stream/s{created}"))
            .send()
            .await
            .expect("create");
        if r.status() != 201 {
            break r.status().as_u16();
        }
        created += 1;
        assert!(created < 100, "the state budget never filled");
    };
    println!("{created} more streams before the 12 KiB state budget was full");
    assert_eq!(status, 503);
    let state_bytes = common::metric(&client, &base, "sluice_stream_state_bytes").await;
    assert!(state_bytes <= 12288.0, "{state_bytes}");
    // The live producer's state survives a restart; the forgotten ones stay forgotten once
    // a checkpoint was taken after they were (before it, the log would bring them back
    // with a fresh expiry: never fewer producers than were known, never more than that).
    let checkpoints = common::metric(&client, &base, "sluice_stream_checkpoints_total").await;
    while common::metric(&client, &base, "sluice_stream_checkpoints_total").await
        < checkpoints + 1.0
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    seq += 1;
    assert_eq!(produce(&client, &base, "other", "live", seq).await.0, 200);
    server.restart();
    assert_eq!(produce(&client, &base, "other", "live", seq).await.0, 204);
    let after = common::metric(&client, &base, "sluice_stream_producer_bytes").await;
    assert!(after > 0.0 && after <= 4096.0, "{after}");
    // Retired producers are kept across the restart too: still a duplicate, and the
    // stream holds each junk append once.
    assert_eq!(produce(&client, &base, "junk", "j2", 0).await.0, 204);
    let body = client
        .get(format!("{base}/v1/stream/junk?offset=-1"))
        .send()
        .await
        .expect("read")
        .text()
        .await
        .expect("body");
    for i in 0..5 {
        assert_eq!(body.matches(&format!("j{i}:0;")).count(), 1, "{body}");
    }
}

/// The resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Opens a connection and sends a request head that grows to `bytes` and never ends; the
/// connection is returned open (or closed by the server).
fn unfinished_header(addr: SocketAddr, bytes: usize) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_write_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = s.write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nX-Pad: ");
    let piece = vec![b'a'; 8 << 10];
    let mut sent = 0;
    while sent < bytes && s.write_all(&piece).is_ok() {
        sent += piece.len();
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_header_is_refused_before_it_is_buffered() {
    let server = Server::start("header-buffer", &[], "");
    let (at, pid) = (addr(&server), server.child.id());
    let base = server.base.clone();
    let said = tokio::task::spawn_blocking(move || {
        // One: refused (431) or closed long before its header timeout (30 s).
        let mut s = unfinished_header(at, 400 << 10);
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut said = Vec::new();
        let timed_out = matches!(
            s.read_to_end(&mut said),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
        );
        (timed_out, String::from_utf8_lossy(&said).into_owned())
    })
    .await
    .expect("join");
    let (timed_out, said) = said;
    assert!(
        !timed_out && (said.is_empty() || said.starts_with("HTTP/1.1 431")),
        "an unfinished 400 KB header was kept: {said:?}"
    );
    // Many: the server does not buffer them (hyper's default would keep ~400 KB each).
    let before = rss_kib(pid);
    let open = tokio::task::spawn_blocking(move || {
        (0..200)
            .map(|_| unfinished_header(at, 400 << 10))
            .collect::<Vec<_>>()
    })
    .await
    .expect("join");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = rss_kib(pid).saturating_sub(before);
    println!("RSS grew by {grown} KiB with 200 unfinished 400 KB headers");
    assert!(grown < 30 << 10, "RSS grew by {grown} KiB");
    let r = reqwest::get(format!("{base}/v1/health"))
        .await
        .expect("health");
    assert_eq!(r.status(), 200);
    drop(open);
}

/// A body to `path` (JSON, declared twice as long) that sends `sent` bytes at once and then
/// nothing: what the server answered, and when.
fn hold_json(
    addr: SocketAddr,
    key: &str,
    path: &str,
    sent: usize,
) -> std::thread::JoinHandle<(String, Duration)> {
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        sent * 2
    );
    std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.write_all(head.as_bytes()).expect("head");
        s.write_all(&vec![b' '; sent]).expect("body");
        let started = Instant::now();
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let mut said = String::new();
        let _ = s.read_to_string(&mut said);
        (said, started.elapsed())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_key_holding_statement_bodies_stalls_no_one() {
    // A 2 MiB budget, 2 s of waiting, a pace of 1 KiB/s, bodies time out after 60 s.
    let config = "ingest_inflight_bytes = 2097152\ningest_admission_timeout_seconds = 2\n\
                  min_body_bytes_per_second = 1024\nrequest_body_timeout_seconds = 60\n";
    let server = Server::start(
        "statement-bodies",
        &[
            "--api-key",
            "admin=a-key",
            "--api-key",
            "read=r1",
            "--api-key",
            "write=w1",
        ],
        config,
    );
    let base = server.base.clone();
    let client = reqwest::Client::new();
    create_events(&client, &base, Some("a-key")).await;
    let at = addr(&server);
    // The read key sends 1.5 MiB of two statement bodies each and goes quiet: it holds its
    // share (1 MiB) at most, never the whole budget.
    let hogs: Vec<_> = (0..2)
        .map(|_| hold_json(at, "r1", "/v1/statements", 1536 << 10))
        .collect();
    // At least half its share (on a loaded machine the peak of the share may pass between
    // two looks; what it holds beside another key's ingest is what the test is about).
    wait_held(&client, &base, f64::from(1 << 19)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = common::metric(&client, &base, "sluice_request_body_bytes_held").await;
    println!("a read key's two stalled statement bodies hold {held} bytes");
    assert!(held <= f64::from(1 << 20), "{held}");
    // Another key's ingest is answered at once.
    let (status, took) = one_row(&client, &base, Some("w1")).await;
    println!("another key's ingest beside them: {status} in {took:?}");
    assert_eq!(status, 200);
    assert!(took < Duration::from_secs(2), "waited {took:?}");
    // Sending much at once banks no time: quiet past the grace, the bodies are cut (408,
    // or 503 for the one that found no room in the key's share) long before their timeout.
    for h in hogs {
        let (said, took) = tokio::task::spawn_blocking(move || h.join().expect("hold"))
            .await
            .expect("join");
        println!(
            "stalled body answered after {took:?}: {}",
            said.lines().next().unwrap_or("")
        );
        assert!(
            said.starts_with("HTTP/1.1 408") || said.starts_with("HTTP/1.1 503"),
            "{said}"
        );
        assert!(took < Duration::from_secs(25), "held for {took:?}");
    }
}

/// Stream `big` of 8 MiB, in eight appends.
async fn eight_mib_stream(base: &str) {
    let client = reqwest::Client::new();
    let r = client
        .put(format!("{base}/v1/stream/big"))
        .header("content-type", "application/octet-stream")
        .send()
        .await
        .expect("create");
    assert_eq!(r.status(), 201);
    for _ in 0..8 {
        let r = client
            .post(format!("{base}/v1/stream/big"))
            .header("content-type", "application/octet-stream")
            .body(vec![b'x'; 1 << 20])
            .send()
            .await
            .expect("append");
        assert!(r.status().is_success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_its_answer_is_cut_off() {
    let config = "response_write_timeout_seconds = 2\n";
    let server = Server::start("slow-reader", &[], config);
    let base = server.base.clone();
    eight_mib_stream(&base).await;
    let at = addr(&server);
    let received = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(at).expect("connect");
        // Two reads of 8 MiB each, pipelined: more than the kernel's socket buffers hold.
        let get = "GET /v1/stream/big?offset=-1 HTTP/1.1\r\nHost: localhost\r\n\r\n";
        s.write_all(get.repeat(2).as_bytes()).expect("requests");
        // Read nothing for longer than the write timeout, then all there is.
        std::thread::sleep(Duration::from_secs(6));
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut got = 0usize;
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            got += n;
        }
        got
    })
    .await
    .expect("join");
    println!("a client that read nothing for 6 s then got {received} bytes of 2 x 8 MiB");
    assert!(received < 16 << 20, "the whole answer waited for it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_result_goes_out_in_pieces_that_read_back_whole() {
    // 60,000 rows of ~30 bytes: several batches, each cut into pieces of about 64 KiB.
    // Every row arrives once, in order, and the payload parses whole (no comma lost or
    // doubled at a piece's or a batch's edge).
    let server = Server::start("pieces", &[], "");
    let client = reqwest::Client::new();
    let body = common::statement(
        &client,
        &server.base,
        "SELECT value, repeat('x', 20) AS pad FROM generate_series(1, 60000) ORDER BY value",
    )
    .await;
    assert_eq!(body["status"], "finished", "{body}");
    let rows = body["result_set"]["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 60000);
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row[0], Value::from((i + 1).to_string()), "row {i}");
        assert_eq!(row[1], Value::from("x".repeat(20)), "row {i}");
    }
    assert_eq!(body["result_set"]["metadata"]["num_rows"], 60000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_never_reads_cannot_hold_up_shutdown() {
    // The write timeout alone would keep the connection for ten minutes: the stop must end
    // it within `shutdown_timeout_seconds`, flush, and exit cleanly.
    let config = "response_write_timeout_seconds = 600\nshutdown_timeout_seconds = 3\n";
    let mut server = Server::start("stuck-reader", &[], config);
    let base = server.base.clone();
    eight_mib_stream(&base).await;
    let mut stuck = std::net::TcpStream::connect(addr(&server)).expect("connect");
    let get = "GET /v1/stream/big?offset=-1 HTTP/1.1\r\nHost: localhost\r\n\r\n";
    stuck.write_all(get.repeat(2).as_bytes()).expect("requests");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stopped = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(120);
    let exit = loop {
        if let Some(exit) = server.child.try_wait().expect("wait") {
            break exit;
        }
        assert!(
            Instant::now() < deadline,
            "still running 120 s after SIGTERM with a reader that never reads"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("stopped {:?} after SIGTERM: {exit:?}", stopped.elapsed());
    assert!(exit.success(), "clean exit: {exit:?}");
    drop(stuck);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_from_many_addresses_make_room_for_a_request() {
    // Every slot held by connections that never send a byte, from as many addresses as
    // there are slots (so no per-peer cap applies), under a header timeout of two minutes:
    // a request that arrives is answered at once, a silent connection closed for it.
    let config = "max_connections = 20\nmax_connections_per_peer = 20\n\
                  header_timeout_seconds = 120\n";
    let server = Server::start("silent-flood", &[], config);
    let at = addr(&server);
    let mut silent = Vec::new();
    for i in 0..24u8 {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind(SocketAddr::from(([127, 0, 1, 1 + i], 0)))
            .expect("bind");
        silent.push(socket.connect(at).await.expect("connect"));
    }
    // A connection that started a request and one that finished one stay open.
    let mut started = std::net::TcpStream::connect(at).expect("connect");
    started
        .write_all(b"GET /v1/health HTTP/1.1\r\n")
        .expect("partial request");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let client = reqwest::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .build()
        .expect("client");
    for _ in 0..5 {
        let asked = Instant::now();
        let r = tokio::time::timeout(
            Duration::from_secs(60),
            client.get(format!("{}/v1/health", server.base)).send(),
        )
        .await
        .expect("a request waited a minute behind silent connections")
        .expect("health");
        assert_eq!(r.status(), 200);
        println!("answered in {:?} with every slot silent", asked.elapsed());
    }
    // The started request is still served.
    started
        .write_all(b"Host: localhost\r\nConnection: close\r\n\r\n")
        .expect("rest of the request");
    started
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut answer = String::new();
    let _ = started.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_from_one_peer_cannot_take_every_slot() {
    let config = "max_connections = 20\nmax_connections_per_peer = 5\n";
    let server = Server::start("peers", &[], config);
    let at = addr(&server);
    // 30 idle connections from 127.0.0.1: five are kept, the rest closed at once.
    let idle: Vec<_> = (0..30)
        .map(|_| std::net::TcpStream::connect(at).expect("connect"))
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Another address on loopback is served at once.
    let other = reqwest::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let started = Instant::now();
    let r = other
        .get(format!("{}/v1/health", server.base))
        .send()
        .await
        .expect("health beside 30 idle connections");
    println!("health beside 30 idle connections: {:?}", started.elapsed());
    assert_eq!(r.status(), 200);
    drop(idle);
}

/// An append of producer `id` as `key`: `(status, body)`.
async fn produce_as(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    stream: &str,
    id: impl AsRef<str>,
) -> (u16, Value) {
    produce_seq_as(client, base, key, stream, id.as_ref(), 0).await
}

/// [`produce_as`] with sequence number `seq` (epoch 0).
async fn produce_seq_as(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    stream: &str,
    id: &str,
    seq: u64,
) -> (u16, Value) {
    let r = client
        .post(format!("{base}/v1/stream/{stream}"))
        .bearer_auth(key)
        .header("content-type", "text/plain")
        .header("producer-id", id)
        .header("producer-epoch", "0")
        .header("producer-seq", seq.to_string())
        .body(format!("{id};"))
        .send()
        .await
        .expect("append");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Sends `request(0)`, `request(1)`, ... until one is not admitted (not 2xx): how many were,
/// and the refusal's status and body. Fails past `at_most` admitted.
async fn until_refused<F, R>(what: &str, at_most: usize, mut request: F) -> (usize, u16, Value)
where
    F: FnMut(usize) -> R,
    R: std::future::Future<Output = (u16, Value)>,
{
    for admitted in 0..=at_most {
        let (status, body) = request(admitted).await;
        if !(200..300).contains(&status) {
            return (admitted, status, body);
        }
    }
    panic!("{what}: never refused in {at_most}");
}

/// Starts the binary as `name` with write keys `w1` and `w2` (and `extra` arguments).
fn start_with_two_keys(name: &str, extra: &[&str], config: &str) -> Server {
    let mut args = vec!["--api-key", "write=w1", "--api-key", "write=w2"];
    args.extend_from_slice(extra);
    Server::start(name, &args, config)
}

/// Asserts that `body` refuses for a full budget named `what` of `budget` bytes, `held`
/// bytes of which are held (a range: what is held may vary with the names involved).
fn assert_budget_full(body: &Value, what: &str, budget: u64, held: std::ops::RangeInclusive<u64>) {
    let details = &body["details"];
    assert_eq!(details["status"], "rejected", "{body}");
    assert_eq!(details["budget_of"], what, "{body}");
    assert_eq!(details["budget_bytes"], budget, "{body}");
    let got = details["held_bytes"].as_u64().unwrap_or(u64::MAX);
    assert!(held.contains(&got), "held {got}, not in {held:?}: {body}");
}

/// Creates stream `name` as `key`; its status and body.
async fn create_as(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    name: impl AsRef<str>,
) -> (u16, Value) {
    let r = client
        .put(format!("{base}/v1/stream/{}", name.as_ref()))
        .bearer_auth(key)
        .header("content-type", "text/plain")
        .send()
        .await
        .expect("create");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_write_key_cannot_fill_the_stream_state_or_producer_budgets() {
    // Producer entries within 4 KiB in all, stream state within 16 KiB: each key may hold
    // half of each. Producers idle for 3 s expire.
    let config = "max_producers_per_stream = 1000\nmax_producer_bytes = 4096\n\
                  max_stream_state_bytes = 16384\nproducer_expiry_seconds = 3\n";
    let server = start_with_two_keys("key-shares", &["--api-key", "admin=a"], config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    assert_eq!(create_as(&client, &base, "w1", "shared").await.0, 201);

    // w1 adds producers until it is refused: 429 for its own share, nothing applied.
    let (admitted, status, body) = until_refused("w1's producers", 200, |i| {
        produce_as(&client, &base, "w1", "shared", format!("w1-{i}"))
    })
    .await;
    assert_eq!(status, 429, "{body}");
    println!("w1 held {admitted} producers before its share was full: {body}");
    assert_eq!(body["code"], "too_many_requests", "{body}");
    // Its producer share is what is full, and the answer says so: a next producer (about
    // 490 bytes) does not fit in what is left of the 2048.
    assert_budget_full(&body, "producer state", 2048, 1560..=2048);
    let held = common::metric(&client, &base, "sluice_stream_producer_bytes").await;
    assert!(
        held <= 2048.0,
        "one key holds {held} producer bytes, past half of 4096"
    );

    // w2, on the same stream and on a stream of its own, still has its whole share.
    assert_eq!(create_as(&client, &base, "w2", "mine").await.0, 201);
    for i in 0..admitted {
        let stream = if i % 2 == 0 { "shared" } else { "mine" };
        let (status, body) = produce_as(&client, &base, "w2", stream, &format!("w2-{i}")).await;
        assert_eq!(status, 200, "w2's producer {i}: {body}");
    }

    // Streams: w1 creates until refused (429), and w2 can still create.
    let (created, status, body) = until_refused("w1's creates", 500, |i| {
        create_as(&client, &base, "w1", format!("w1-s{i}"))
    })
    .await;
    assert_eq!(status, 429, "{body}");
    // A create needs at least 1280 bytes of the 8192 of its stream-state share.
    assert_budget_full(&body, "stream state", 8192, 6912..=8192);
    println!("w1 created {created} more streams before its share was full");
    let (status, body) = create_as(&client, &base, "w2", "w2-s0").await;
    assert_eq!(status, 201, "{body}");

    // What w1 created comes back to its share once deleted (by an admin: deletes are theirs).
    for i in 0..created {
        let r = client
            .delete(format!("{base}/v1/stream/w1-s{i}"))
            .bearer_auth("a")
            .send()
            .await
            .expect("delete");
        assert_eq!(r.status(), 204);
    }
    let (status, body) = create_as(&client, &base, "w1", "w1-again").await;
    assert_eq!(status, 201, "{body}");

    // So do its producers once they expired: refused at first, w1's next producer makes the
    // stream forget its idle ones, and gets in.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (status, body) = produce_as(&client, &base, "w1", "shared", "w1-late").await;
    assert_eq!(status, 200, "{body}");
    let held = common::metric(&client, &base, "sluice_stream_producer_bytes").await;
    assert!(held <= 4096.0, "{held}");
}

/// A key whose stream-state share is full is refused a new producer for that share, not its
/// producer share; and a key that uses a fresh Producer-Id per session, whose retired
/// producers' records fill its share, still gets new producers: its own oldest retired
/// records on the stream make room (only its own oldest producers' retries stop being
/// recognized), while its recent ones are still recognized.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_cycling_producer_ids_makes_room_with_its_own_oldest_retired_records() {
    // Stream state within 8 KiB (4 KiB a key), producers idle for 0.1 s retire.
    let config = "max_producers_per_stream = 1000\nmax_producer_bytes = 65536\n\
                  max_stream_state_bytes = 8192\nproducer_expiry_seconds = 0.1\n";
    let server = start_with_two_keys("retired-share", &[], config);
    let base = server.base.clone();
    let client = reqwest::Client::new();

    // w2 fills its stream-state share with streams: its next create, and its next producer,
    // are refused for that share (the producer share, 32 KiB, is far from full).
    let (_, status, create_refusal) = until_refused("w2's creates", 10, |i| {
        create_as(&client, &base, "w2", format!("w2-s{i}"))
    })
    .await;
    assert_eq!(status, 429, "{create_refusal}");
    assert_budget_full(&create_refusal, "stream state", 4096, 2816..=4096);
    let held = create_refusal["details"]["held_bytes"]
        .as_u64()
        .unwrap_or(0);
    let (status, body) = produce_as(&client, &base, "w2", "w2-s0", "w2-p").await;
    assert_eq!(status, 429, "{body}");
    assert_budget_full(&body, "stream state", 4096, held..=held);

    // w1 uses a fresh producer id per session on its stream. Past about 25 retired records
    // its share would be full; every new producer still gets in.
    assert_eq!(create_as(&client, &base, "w1", "s").await.0, 201);
    let r = client
        .post(format!("{base}/v1/stream/s"))
        .bearer_auth("w1")
        .header("content-type", "text/plain")
        .header("stream-seq", "m")
        .body("x")
        .send()
        .await
        .expect("append");
    assert_eq!(r.status(), 204);
    let sessions = 60;
    for i in 0..sessions {
        let (status, body) = produce_as(&client, &base, "w1", "s", &format!("session-{i}")).await;
        assert_eq!(status, 200, "session {i}: {body}");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // A refusal of w2 on `s` retires w1's idle last session there. Then a new producer of
    // w1 that its records could make room for, refused for another reason (a stream-seq
    // behind the stream's), drops none of them.
    let (status, body) = produce_as(&client, &base, "w2", "s", "w2-p").await;
    assert_eq!(status, 429, "{body}");
    let state = "sluice_stream_state_bytes";
    let before = common::metric(&client, &base, state).await;
    let r = client
        .post(format!("{base}/v1/stream/s"))
        .bearer_auth("w1")
        .header("content-type", "text/plain")
        .header("producer-id", "behind")
        .header("producer-epoch", "0")
        .header("producer-seq", "0")
        .header("stream-seq", "a")
        .body("y")
        .send()
        .await
        .expect("append");
    assert_eq!(r.status(), 409);
    assert_eq!(common::metric(&client, &base, state).await, before);
    // A retry of a recent session's append is still recognized (204, not appended again);
    // the oldest session's records made room, so its retry is taken as new.
    let recent = format!("session-{}", sessions - 5);
    let (status, body) = produce_as(&client, &base, "w1", "s", &recent).await;
    assert_eq!(status, 204, "{body}");
    let (status, body) = produce_as(&client, &base, "w1", "s", "session-0").await;
    assert_eq!(status, 200, "{body}");
    let state = common::metric(&client, &base, "sluice_stream_state_bytes").await;
    assert!(state <= 8192.0, "{state}");
}

/// A key that appends to another key's producer entry keeps it alive at its own charge:
/// the entry counts against the appending key from then on (the other key gets the room
/// back), and is refused when the appending key's share cannot hold it (nothing applied).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_appending_to_another_keys_producer_takes_its_charge() {
    // Producer entries within 4 KiB (2 KiB a key, four entries of about 490 bytes).
    let config = "max_producers_per_stream = 1000\nmax_producer_bytes = 4096\n\
                  max_stream_state_bytes = 65536\nproducer_expiry_seconds = 3600\n";
    let server = start_with_two_keys("producer-takeover", &[], config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    assert_eq!(create_as(&client, &base, "w1", "s").await.0, 201);
    let (admitted, _, body) = until_refused("w1's producers", 10, |i| {
        produce_as(&client, &base, "w1", "s", format!("w1-{i}"))
    })
    .await;
    assert_budget_full(&body, "producer state", 2048, 1560..=2048);
    assert_eq!(admitted, 4);

    // w2 keeps w1's first producer going: it is w2's now, and w1 has room for one more.
    let (status, body) = produce_seq_as(&client, &base, "w2", "s", "w1-0", 1).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = produce_as(&client, &base, "w1", "s", "w1-4").await;
    assert_eq!(status, 200, "{body}");

    // w2 fills its share with producers of its own: then it may not take another of w1's,
    // and nothing of that append was applied (w1's next sequence number is still 1).
    let (own, _, body) = until_refused("w2's producers", 10, |i| {
        produce_as(&client, &base, "w2", "s", format!("w2-{i}"))
    })
    .await;
    assert_budget_full(&body, "producer state", 2048, 1560..=2048);
    assert_eq!(own, 3);
    let (status, body) = produce_seq_as(&client, &base, "w2", "s", "w1-1", 1).await;
    assert_eq!(status, 429, "{body}");
    assert_budget_full(&body, "producer state", 2048, 1560..=2048);
    let (status, body) = produce_seq_as(&client, &base, "w1", "s", "w1-1", 1).await;
    assert_eq!(status, 200, "{body}");
}

/// Creates refused one after another by a full server sweep every stream for idle
/// producers at most once a second, and only when some producer may be idle past the
/// expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_refused_by_a_full_server_sweep_at_most_once_a_second() {
    let config = "max_stream_state_bytes = 16384\nproducer_expiry_seconds = 3\n";
    let server = Server::start("full-sweeps", &[], config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    assert_eq!(create_as(&client, &base, "none", "p").await.0, 201);
    assert_eq!(produce_as(&client, &base, "none", "p", "idle").await.0, 200);
    let (_, status, body) = until_refused("creates", 50, |i| {
        create_as(&client, &base, "none", format!("s{i}"))
    })
    .await;
    assert_eq!(status, 503, "{body}");
    assert_budget_full(&body, "stream state", 16384, 14848..=16384);
    let sweeps = "sluice_stream_producer_sweeps_total";
    let refused = |n: usize, tag: &'static str| {
        let (client, base) = (client.clone(), base.clone());
        async move {
            let before = common::metric(&client, &base, sweeps).await;
            let started = Instant::now();
            for i in 0..n {
                let (status, body) = create_as(&client, &base, "none", &format!("{tag}{i}")).await;
                // (The room a sweep frees may take one create.)
                assert!(status == 503 || status == 201, "{status} {body}");
            }
            let elapsed = started.elapsed().as_secs_f64();
            let swept = common::metric(&client, &base, sweeps).await - before;
            println!("{n} refused creates in {elapsed:.2} s swept {swept} times");
            (swept, elapsed)
        }
    };
    // The producer is idle past the expiry: the first refusal sweeps, no other in the second.
    tokio::time::sleep(Duration::from_millis(3100)).await;
    let first = Instant::now();
    let (swept, elapsed) = refused(40, "first").await;
    assert!(swept >= 1.0, "no sweep");
    assert!(
        swept <= elapsed.floor() + 1.0,
        "{swept} sweeps in {elapsed:.2} s"
    );
    // A second later no producer can be idle that long (the one there was is retired, any
    // made since is younger than the expiry): refusals do not sweep at all.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let swept = refused(10, "second").await.0;
    // (The sweep ran after `first`: until 3 s after it no producer can be due.)
    if first.elapsed() < Duration::from_secs(3) {
        assert_eq!(swept, 0.0);
    } else {
        println!("the machine was too slow to check that nothing swept");
    }
}

/// Stream readers that ask for a large read and never read the answer hold no more than the
/// read budget (256 MiB) between them, not a copy each; a reader meanwhile gets its data or
/// a 503 that says why and when to come back, and all of it once they are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_readers_that_do_not_read_hold_no_more_than_the_read_budget() {
    let server = Server::start("read-budget", &[], "");
    let (at, pid) = (addr(&server), server.child.id());
    let base = server.base.clone();
    let client = reqwest::Client::new();
    let url = format!("{base}/v1/stream/fan");
    let r = client
        .put(&url)
        .header("content-type", "application/octet-stream")
        .send()
        .await
        .expect("create");
    assert_eq!(r.status(), 201);
    for _ in 0..2 {
        let r = client
            .post(&url)
            .header("content-type", "application/octet-stream")
            .body(vec![7u8; 4 << 20])
            .send()
            .await
            .expect("append");
        assert!(r.status().is_success(), "{}", r.status());
    }
    let start = rss_kib(pid);
    let before = start;
    let open = readers_that_do_not_read(at, 100, "/v1/stream/fan?offset=-1").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let grown = rss_kib(pid).saturating_sub(before);
    println!("RSS grew by {grown} KiB with 100 readers of 8 MiB that do not read");
    // Without the budget: 100 answers of 8 MiB each (800 MiB).
    assert!(grown < 400 << 10, "RSS grew by {grown} KiB");
    let r = client
        .get(format!("{url}?offset=-1"))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .expect("read");
    match r.status().as_u16() {
        200 => assert!(!r.bytes().await.expect("body").is_empty()),
        503 => {
            assert!(r.headers().contains_key("retry-after"));
            assert_eq!(r.headers()["x-sluice-not-applied"], "AnswerMemory");
        }
        other => panic!("a read beside them answered {other}"),
    }
    drop(open);
    // Their shares come back as their connections go.
    let mut whole = 0;
    for _ in 0..50 {
        let r = client
            .get(format!("{url}?offset=-1"))
            .send()
            .await
            .expect("read");
        if r.status() == 200 {
            whole = r.bytes().await.expect("body").len();
            if whole == 8 << 20 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(whole, 8 << 20);
    // Long-polls waiting at the tail hold nothing; woken by one large append, they hold no
    // more than the budget between them (a share too small for the record waits for one
    // that fits, holding nothing meanwhile).
    let open = readers_that_do_not_read(at, 150, "/v1/stream/fan?offset=now&live=long-poll").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Waiting, they leave the whole budget to a catch-up read.
    let r = client
        .get(format!("{url}?offset=-1"))
        .send()
        .await
        .expect("read");
    assert_eq!(r.status(), 200);
    assert_eq!(r.bytes().await.expect("body").len(), 8 << 20);
    let r = client
        .post(&url)
        .header("content-type", "application/octet-stream")
        .body(vec![9u8; 6 << 20])
        .send()
        .await
        .expect("append");
    assert!(r.status().is_success(), "{}", r.status());
    tokio::time::sleep(Duration::from_secs(3)).await;
    // (Measured from before the readers above: what they freed stays in the process.)
    let grown = rss_kib(pid).saturating_sub(start);
    println!("RSS grew by {grown} KiB with 150 long-polls woken by 6 MiB that do not read");
    // Without the budget: 150 answers of 6 MiB (900 MiB).
    assert!(grown < 400 << 10, "RSS grew by {grown} KiB");
    drop(open);
    // Readers that ask for one byte get a record of 6 MiB whole: each waits for a share
    // that fits it before it is rendered, rather than rendering it beside a small one.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let offset = next_offset(&client, &url).await;
    let path = format!("/v1/stream/fan?offset={offset}&max_bytes=1");
    let open = readers_that_do_not_read(at, 120, &path).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let grown = rss_kib(pid).saturating_sub(start);
    println!("RSS grew by {grown} KiB with 120 readers of one byte of a 6 MiB record");
    // Without the wait: 120 records of 6 MiB (720 MiB).
    assert!(grown < 400 << 10, "RSS grew by {grown} KiB");
    drop(open);
}

/// `n` connections that each ask for `path` and never read the answer, with a small receive
/// buffer (the kernel takes little of each answer off the server).
async fn readers_that_do_not_read(
    at: SocketAddr,
    n: usize,
    path: &str,
) -> Vec<tokio::net::TcpStream> {
    let mut open = Vec::new();
    for _ in 0..n {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(4096).expect("buffer");
        let mut s = socket.connect(at).await.expect("connect");
        let ask = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n");
        tokio::io::AsyncWriteExt::write_all(&mut s, ask.as_bytes())
            .await
            .expect("ask");
        open.push(s);
    }
    open
}

/// The offset of the last record of the stream at `url` (8 MiB in: the test's third).
async fn next_offset(client: &reqwest::Client, url: &str) -> String {
    let r = client
        .get(format!("{url}?offset=-1&max_bytes=8388608"))
        .send()
        .await
        .expect("read");
    r.headers()["stream-next-offset"]
        .to_str()
        .expect("offset")
        .to_owned()
}
