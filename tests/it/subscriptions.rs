//! Subscriptions against the real binary: no watched stream that receives data goes without a
//! wake (a burst of thousands of streams and subscriptions, across a SIGKILL and a restart),
//! limits that hold after a restart, bounded webhook answers and deliveries, and whose a
//! subscription is. The takeover case is in `s3.rs` (it needs the S3 server); the protocol's
//! own subscription tests run in `streams.rs`.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::process::Child;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use serde_json::{Value, json};

/// What the webhook receiver answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// 503: the delivery failed; the server tries again later.
    Fail = 0,
    /// 200 `{"done": true}`: the wake's streams are acked.
    Done = 1,
}

/// A webhook consumer on loopback that records, for every subscription and stream, the
/// highest tail offset a wake it answered `done` to named.
#[derive(Clone)]
pub(crate) struct Receiver {
    pub(crate) url: String,
    answer: Arc<AtomicU8>,
    seen: Arc<Mutex<HashMap<(String, String), u64>>>,
    pub(crate) requests: Arc<AtomicU64>,
}

/// The byte offset in an offset this server wrote (`{epoch:016}_{bytes:016}`).
pub(crate) fn offset_bytes(offset: &str) -> u64 {
    offset
        .split_once('_')
        .and_then(|(_, b)| b.parse().ok())
        .unwrap_or_else(|| panic!("{offset:?} is not an offset"))
}

impl Receiver {
    pub(crate) async fn start(answer: Answer) -> Receiver {
        let receiver = Receiver {
            url: String::new(),
            answer: Arc::new(AtomicU8::new(answer as u8)),
            seen: Arc::default(),
            requests: Arc::default(),
        };
        let state = receiver.clone();
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(move |body: bytes::Bytes| {
                let state = state.clone();
                async move { state.take(&body) }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Receiver { url, ..receiver }
    }

    fn take(&self, body: &[u8]) -> (axum::http::StatusCode, String) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if self.answer.load(Ordering::Acquire) == Answer::Fail as u8 {
            return (axum::http::StatusCode::SERVICE_UNAVAILABLE, String::new());
        }
        let wake: Value = serde_json::from_slice(body).unwrap();
        let id = wake["subscription_id"].as_str().unwrap().to_owned();
        let mut seen = self.seen.lock().unwrap();
        for stream in wake["streams"].as_array().unwrap() {
            let path = stream["path"].as_str().unwrap().to_owned();
            let tail = offset_bytes(stream["tail_offset"].as_str().unwrap());
            let entry = seen.entry((id.clone(), path)).or_default();
            *entry = (*entry).max(tail);
        }
        (
            axum::http::StatusCode::OK,
            json!({"done": true}).to_string(),
        )
    }

    pub(crate) fn answer(&self, answer: Answer) {
        self.answer.store(answer as u8, Ordering::Release);
    }

    /// Waits until, for every `(subscription, stream)` of `expected`, a wake named the
    /// stream at (at least) the given tail; fails naming what is missing.
    pub(crate) async fn wait_for(
        &self,
        expected: &BTreeMap<(String, String), u64>,
        within: Duration,
    ) {
        let deadline = Instant::now() + within;
        loop {
            let missing: Vec<(&(String, String), u64, Option<u64>)> = {
                let seen = self.seen.lock().unwrap();
                expected
                    .iter()
                    .filter_map(|(key, tail)| {
                        let got = seen.get(key).copied();
                        (got < Some(*tail)).then_some((key, *tail, got))
                    })
                    .collect()
            };
            if missing.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {} watched (subscription, stream) pairs never got a wake for their data; \
                 the first: {:?}",
                missing.len(),
                expected.len(),
                &missing[..missing.len().min(5)]
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// The stream a write went to, and the tail it left (`Stream-Next-Offset`).
pub(crate) fn answered_tail(answer: &reqwest::Response) -> (String, u64) {
    let name = answer.url().path()["/v1/stream/".len()..].to_owned();
    let tail = offset_bytes(answer.headers()["stream-next-offset"].to_str().unwrap());
    (name, tail)
}

/// The server under test: the real binary on a loopback port, with a config file.
pub(crate) struct Server {
    child: Child,
    pub(crate) base: String,
    port: u16,
    dir: std::path::PathBuf,
    args: Vec<String>,
}

impl Server {
    pub(crate) fn start(name: &str, config: &str, args: &[&str]) -> Server {
        let dir = common::temp_dir(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("sluice.toml"), config).unwrap();
        let port = common::free_port();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let child = Server::spawn(&dir, port, &args);
        Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            port,
            dir,
            args,
        }
    }

    fn spawn(dir: &std::path::Path, port: u16, args: &[String]) -> Child {
        let child = common::sluice_serve(&dir.join("data"), port)
            .arg("--config")
            .arg(dir.join("sluice.toml"))
            .args(args)
            .spawn()
            .unwrap();
        common::wait_healthy(port);
        child
    }

    /// SIGKILL (nothing is flushed or stored on the way out), then the same binary, data
    /// and port again, with `args` instead of the first start's.
    pub(crate) fn kill_and_restart(&mut self, args: Option<&[&str]>) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        if let Some(args) = args {
            self.args = args.iter().map(|a| a.to_string()).collect();
        }
        self.child = Server::spawn(&self.dir, self.port, &self.args);
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `requests` with `concurrency` in flight; each must answer 2xx. A 503 with
/// `Retry-After` (a node that could not renew its lease in time on a busy machine, a store
/// that did not answer) is sent again, as a client does. Returns the answers.
pub(crate) async fn run_all(
    requests: Vec<reqwest::RequestBuilder>,
    concurrency: usize,
) -> Vec<reqwest::Response> {
    futures::stream::iter(requests.into_iter().map(|r| async move {
        for _ in 0..40 {
            let again = r.try_clone().unwrap();
            let response = again.send().await.unwrap();
            let status = response.status();
            if status.is_success() {
                return response;
            }
            let retry = status == 503 && response.headers().contains_key("retry-after");
            assert!(retry, "{status}: {:?}", response.text().await);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        panic!("a request answered 503 for 20 s");
    }))
    .buffer_unordered(concurrency)
    .collect()
    .await
}

/// A burst: `groups` × `per_group` streams, and subscriptions watching them: `per_group`
/// pattern subscriptions per group (`burst/g{g}/*`) and `listed` subscriptions that list ten
/// streams each.
pub(crate) struct Burst {
    pub(crate) groups: usize,
    pub(crate) per_group: usize,
    pub(crate) patterned: usize,
    pub(crate) listed: usize,
    /// Which streams each subscription watches.
    pub(crate) watches: BTreeMap<String, Vec<String>>,
    /// The tail each stream was acknowledged at last.
    pub(crate) tails: Arc<Mutex<HashMap<String, u64>>>,
}

impl Burst {
    pub(crate) fn new(groups: usize, per_group: usize, patterned: usize, listed: usize) -> Burst {
        let stream = |g: usize, s: usize| format!("burst/g{g}/s{s}");
        let mut watches = BTreeMap::new();
        for i in 0..patterned {
            let g = i % groups;
            watches.insert(
                format!("sub-{i}"),
                (0..per_group).map(|s| stream(g, s)).collect(),
            );
        }
        for i in 0..listed {
            watches.insert(
                format!("listed-{i}"),
                (0..10)
                    .map(|k| stream((i + k) % groups, (i + 3 * k) % per_group))
                    .collect(),
            );
        }
        Burst {
            groups,
            per_group,
            patterned,
            listed,
            watches,
            tails: Arc::default(),
        }
    }

    pub(crate) fn streams(&self) -> Vec<String> {
        (0..self.groups)
            .flat_map(|g| (0..self.per_group).map(move |s| format!("burst/g{g}/s{s}")))
            .collect()
    }

    /// Creates the subscriptions on `base`, all waking `hook`.
    pub(crate) async fn subscribe(&self, base: &str, hook: &str) {
        let client = reqwest::Client::new();
        let mut requests = Vec::new();
        for i in 0..self.patterned {
            requests.push(
                client
                    .put(format!("{base}/v1/stream/__ds/subscriptions/sub-{i}"))
                    .json(&json!({"type": "webhook", "pattern": format!("burst/g{}/*", i % self.groups),
                                  "webhook": {"url": hook}, "lease_ttl_ms": 5000})),
            );
        }
        for i in 0..self.listed {
            let streams = &self.watches[&format!("listed-{i}")];
            requests.push(
                client
                    .put(format!("{base}/v1/stream/__ds/subscriptions/listed-{i}"))
                    .json(&json!({"type": "webhook", "streams": streams,
                                  "webhook": {"url": hook}, "lease_ttl_ms": 5000})),
            );
        }
        run_all(requests, 16).await;
    }

    /// Appends `round` to every stream on `base` (creating them in round 0), many at once,
    /// and notes each stream's acknowledged tail.
    pub(crate) async fn append(&self, base: &str, round: usize) {
        let client = reqwest::Client::new();
        let requests: Vec<reqwest::RequestBuilder> = self
            .streams()
            .into_iter()
            .map(|name| {
                let url = format!("{base}/v1/stream/{name}");
                let body = format!("{name} round {round};");
                let request = if round == 0 {
                    client.put(url)
                } else {
                    client.post(url)
                };
                request.header("content-type", "text/plain").body(body)
            })
            .collect();
        let answers = run_all(requests, 32).await;
        let mut tails = self.tails.lock().unwrap();
        for answer in answers {
            let (name, tail) = answered_tail(&answer);
            let entry = tails.entry(name).or_default();
            *entry = (*entry).max(tail);
        }
    }

    /// Creates `count` more streams in every group (`burst/g{g}/new-{round}-{i}`), which
    /// only the groups' patterns watch, on `base`.
    pub(crate) async fn create_more(&mut self, base: &str, round: usize, count: usize) {
        let mut names = Vec::new();
        for g in 0..self.groups {
            for i in 0..count {
                names.push((g, format!("burst/g{g}/new-{round}-{i}")));
            }
        }
        let client = reqwest::Client::new();
        let requests = names
            .iter()
            .map(|(_, name)| {
                client
                    .put(format!("{base}/v1/stream/{name}"))
                    .header("content-type", "text/plain")
                    .body(format!("{name};"))
            })
            .collect();
        let answers = run_all(requests, 32).await;
        for (g, name) in &names {
            for i in (0..self.patterned).filter(|i| i % self.groups == *g) {
                if let Some(watched) = self.watches.get_mut(&format!("sub-{i}")) {
                    watched.push(name.clone());
                }
            }
        }
        let mut tails = self.tails.lock().unwrap();
        for answer in answers {
            let (name, tail) = answered_tail(&answer);
            tails.insert(name, tail);
        }
    }

    /// Every watched `(subscription, stream)` and the stream's tail now.
    pub(crate) fn expected(&self) -> BTreeMap<(String, String), u64> {
        let tails = self.tails.lock().unwrap();
        self.watches
            .iter()
            .flat_map(|(sub, streams)| {
                streams
                    .iter()
                    .filter_map(|s| Some(((sub.clone(), s.clone()), *tails.get(s)?)))
            })
            .collect()
    }
}

const BURST_CONFIG: &str = "webhook_allowed_networks = [\"127.0.0.0/8\"]\n\
     max_subscriptions = 5000\n\
     # A burst changes far more streams than this: the subscriptions rescan by log position.\n\
     max_pending_stream_changes = 64\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_wakes_every_watched_stream_also_across_a_kill() {
    let receiver = Receiver::start(Answer::Done).await;
    let mut server = Server::start("subscription-burst", BURST_CONFIG, &[]);
    // 2,000 streams in 100 groups; 2,000 pattern subscriptions (20 per group) and 100 that
    // list streams: 41,000 watched pairs.
    let mut burst = Burst::new(100, 20, 2000, 100);
    let started = Instant::now();
    burst.subscribe(&server.base, &receiver.url).await;
    let subscribed = started.elapsed();
    burst.append(&server.base, 0).await;
    burst.append(&server.base, 1).await;
    let appended = started.elapsed();
    receiver
        .wait_for(&burst.expected(), Duration::from_secs(300))
        .await;
    println!(
        "burst: {} subscriptions in {subscribed:?}, 4,000 writes by {appended:?}, every wake by {:?} ({} webhook requests)",
        burst.watches.len(),
        started.elapsed(),
        receiver.requests.load(Ordering::Relaxed)
    );

    // Now the consumer fails every delivery, a second burst lands on every stream and on
    // 500 new ones, and the server is killed at once: nothing of it was delivered, and the
    // new streams' links (nothing acked) were never stored: the restart finds them again.
    receiver.answer(Answer::Fail);
    burst.append(&server.base, 2).await;
    burst.create_more(&server.base, 2, 5).await;
    server.kill_and_restart(None);
    receiver.answer(Answer::Done);
    let restarted = Instant::now();
    receiver
        .wait_for(&burst.expected(), Duration::from_secs(300))
        .await;
    println!("after the kill: every wake by {:?}", restarted.elapsed());
}

/// A definition nested as deep as the request parser allows (and deeper, in fields a
/// definition does not have) is accepted and loads after a restart: what is stored is the
/// typed definition. The subscription keeps working: a stream it watches wakes it after the
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_accepted_loads_after_a_restart() {
    let receiver = Receiver::start(Answer::Done).await;
    let mut server = Server::start(
        "subscription-depth",
        "webhook_allowed_networks = [\"127.0.0.0/8\"]\n",
        &[],
    );
    let client = reqwest::Client::new();
    let base = server.base.clone();
    let sub = |id: &str| format!("{base}/v1/stream/__ds/subscriptions/{id}");
    let nested = |depth: usize| {
        format!(
            r#"{{"type": "webhook", "pattern": "deep/*", "webhook": {{"url": "{}"}}, "x": {}1{}}}"#,
            receiver.url,
            "[".repeat(depth),
            "]".repeat(depth)
        )
    };
    let r = client
        .put(sub("deep"))
        .header("content-type", "application/json")
        .body(nested(126))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    // Deeper still in a field the definition does not have: skipped without recursion,
    // and not stored.
    let r = client
        .put(sub("deeper"))
        .header("content-type", "application/json")
        .body(nested(10_000))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    // Nesting where the definition has a string, and a body that is not JSON: refused.
    let r = client
        .put(sub("typed"))
        .header("content-type", "application/json")
        .body(nested(3).replace("\"x\"", "\"description\""))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "INVALID", "{body}");
    assert_eq!(body["error"]["details"]["status"], "rejected", "{body}");
    let r = client
        .put(sub("broken"))
        .header("content-type", "application/json")
        .body("{\"type\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "INVALID_JSON", "{body}");
    // Other subscriptions are there too: one bad one must not take them with it.
    let r = client
        .put(sub("plain"))
        .json(&json!({"type": "webhook", "pattern": "plain/*", "webhook": {"url": receiver.url}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);

    let started = Instant::now();
    server.kill_and_restart(None);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the restart took {:?}",
        started.elapsed()
    );
    for id in ["deep", "deeper", "plain"] {
        let r = client.get(sub(id)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{id} after the restart");
    }
    let r = client
        .put(format!("{}/v1/stream/deep/a", server.base))
        .header("content-type", "text/plain")
        .body("data")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let expected = BTreeMap::from([(("deep".to_owned(), "deep/a".to_owned()), 4)]);
    receiver.wait_for(&expected, Duration::from_secs(30)).await;
}

/// The resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    kib * 1024
}

/// A webhook consumer on loopback that answers every request with `head` and then `body`
/// bytes as fast as it can (or, with `head` empty, never answers). Counts the connections it
/// holds open, and the most at once.
async fn raw_receiver(
    head: &'static str,
    body: u64,
) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let open = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (open_c, most_c) = (open.clone(), most.clone());
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (open, most) = (open_c.clone(), most_c.clone());
            tokio::spawn(async move {
                let now = open.fetch_add(1, Ordering::AcqRel) + 1;
                most.fetch_max(now, Ordering::AcqRel);
                let mut buf = vec![0u8; 64 << 10];
                let _ = socket.read(&mut buf).await;
                if head.is_empty() {
                    // Never answer; the server gives up after its deadline.
                    let _ = socket.read(&mut buf).await;
                } else if socket.write_all(head.as_bytes()).await.is_ok() {
                    let chunk = vec![b'x'; 1 << 20];
                    let chunked = head.contains("chunked");
                    let mut sent = 0u64;
                    while sent < body {
                        let written = if chunked {
                            let mut framed = format!("{:x}\r\n", chunk.len()).into_bytes();
                            framed.extend_from_slice(&chunk);
                            framed.extend_from_slice(b"\r\n");
                            socket.write_all(&framed).await
                        } else {
                            socket.write_all(&chunk).await
                        };
                        if written.is_err() {
                            break;
                        }
                        sent += chunk.len() as u64;
                    }
                }
                open.fetch_sub(1, Ordering::AcqRel);
            });
        }
    });
    (url, open, most)
}

/// A webhook that answers with a huge body costs the server nothing (it reads a few KiB and
/// hangs up), and consumers that never answer hold at most `max_deliveries` deliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_answers_and_deliveries_are_bounded() {
    const HUGE: u64 = 256 << 20;
    let (sized, _, _) =
        raw_receiver("HTTP/1.1 200 OK\r\ncontent-length: 268435456\r\n\r\n", HUGE).await;
    let (chunked, _, _) = raw_receiver(
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        HUGE,
    )
    .await;
    let (silent, _, most_silent) = raw_receiver("", 0).await;
    let server = Server::start(
        "subscription-bounds",
        "webhook_allowed_networks = [\"127.0.0.0/8\"]\n",
        &[],
    );
    let client = reqwest::Client::new();
    let put = |id: String, pattern: &str, url: &str| {
        client
            .put(format!("{}/v1/stream/__ds/subscriptions/{id}", server.base))
            .json(&json!({"type": "webhook", "pattern": pattern, "webhook": {"url": url}, "lease_ttl_ms": 1000}))
    };
    let mut requests = vec![
        put("sized".into(), "flood/*", &sized),
        put("chunked".into(), "flood/*", &chunked),
    ];
    for i in 0..60 {
        requests.push(put(format!("silent-{i}"), "silent/*", &silent));
    }
    run_all(requests, 8).await;
    let wake = |name: &str| {
        client
            .put(format!("{}/v1/stream/{name}", server.base))
            .header("content-type", "text/plain")
            .body("x")
    };
    let before = rss(server.pid());
    run_all(vec![wake("flood/a")], 1).await;
    // The flood webhooks answer 200 without `done`: each is delivered again every lease
    // (a second), answered with 256 MiB each time.
    let mut peak = before;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        peak = peak.max(rss(server.pid()));
    }
    let grown = peak.saturating_sub(before);
    assert!(
        grown < 64 << 20,
        "the server grew by {} MiB while webhooks answered 256 MiB each",
        grown >> 20
    );
    // Sixty consumers that never answer: at most 16 deliveries are held at once.
    run_all(vec![wake("silent/a")], 1).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let most = most_silent.load(Ordering::Acquire);
    assert!(
        (8..=16).contains(&most),
        "{most} deliveries to a silent consumer at once (at most 16 may be in flight)"
    );
    println!(
        "bounds: resident {} MiB before, {} MiB at most after; {most} silent deliveries at once",
        before >> 20,
        peak >> 20
    );
}

const KEYS: [&str; 8] = [
    "--api-key",
    "read=r-key",
    "--api-key",
    "write=w-key",
    "--api-key",
    "write=w2-key",
    "--api-key",
    "admin=a-key",
];

/// A subscription belongs to the key that made it: other keys get 404 (and 409 for its id),
/// an admin sees it without its URL's secrets, and the owner stays the owner across a
/// restart with the keys configured in another order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_is_its_keys_and_its_secrets_stay_with_it() {
    let mut server = Server::start(
        "subscription-owners",
        "webhook_allowed_networks = [\"127.0.0.0/8\"]\n",
        &KEYS,
    );
    let client = reqwest::Client::new();
    let sub = format!("{}/v1/stream/__ds/subscriptions/mine", server.base);
    let hook = "http://127.0.0.1:9/hook?token=s3cret";
    let definition = json!({"type": "pull-wake", "wake_stream": "wakes", "pattern": "owned/*"});
    let webhook = json!({"type": "webhook", "pattern": "owned/*", "webhook": {"url": hook}});
    let r = client
        .put(&sub)
        .bearer_auth("w-key")
        .header("host", "localhost:1")
        .json(&webhook)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["webhook"]["url"], hook, "the owner sees its URL");

    // Another write key, and a read key: nothing of it exists for them.
    for key in ["w2-key", "r-key"] {
        let r = client.get(&sub).bearer_auth(key).send().await.unwrap();
        assert_eq!(r.status(), 404, "{key} read another key's subscription");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "NOT_FOUND");
        assert_eq!(body["error"]["details"]["status"], "rejected");
        assert!(!body.to_string().contains("s3cret"));
    }
    let w2 = |r: reqwest::RequestBuilder| r.bearer_auth("w2-key");
    let r = w2(client.delete(&sub)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let r = w2(client.post(format!("{sub}/streams")))
        .json(&json!({"streams": ["owned/x"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = w2(client.post(format!("{sub}/claim")))
        .json(&json!({"worker": "thief"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = w2(client.delete(format!("{sub}/streams/owned%2Fx")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // Its id cannot be taken over, with the same definition or another.
    for def in [&webhook, &definition] {
        let r = w2(client.put(&sub)).json(def).send().await.unwrap();
        assert_eq!(r.status(), 409);
    }
    // A callback needs the wake's token, not a key.
    let r = client
        .post(format!("{sub}/callback"))
        .bearer_auth("made-up")
        .json(&json!({"wake_id": "w", "generation": 1, "done": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    // An admin sees it, without the URL's secret.
    let r = client.get(&sub).bearer_auth("a-key").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["webhook"]["url"], "http://127.0.0.1:9/…", "{body}");
    assert_eq!(body["webhook"]["url_redacted"], true);
    // A wake callback with a token of no current wake is refused before its body is read:
    // a body that never ends is answered at once.
    let endless = futures::stream::once(async { Ok::<_, std::io::Error>(vec![b'{'; 10]) })
        .chain(futures::stream::pending());
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        client
            .post(format!("{sub}/callback"))
            .header("stream-wake-token", "not-a-token")
            .header("content-type", "application/json")
            .body(reqwest::Body::wrap_stream(endless))
            .send(),
    )
    .await
    .expect("answered without reading the body")
    .unwrap();
    assert_eq!(r.status(), 409);
    // The keys URL is the server's advertised one, whatever Host the PUT named; the keys
    // themselves need no API key.
    let jwks = format!("{}/v1/stream/__ds/jwks.json", server.base);
    assert_eq!(
        body["webhook"]["signing"]["jwks_url"],
        jwks.as_str(),
        "{body}"
    );
    let r = client.get(&jwks).send().await.unwrap();
    assert_eq!(r.status(), 200, "the signing keys are public");
    let keys: Value = r.json().await.unwrap();
    assert!(!keys["keys"].as_array().unwrap().is_empty(), "{keys}");

    // The owner is the key, wherever it is configured.
    let reordered = [
        KEYS[6], KEYS[7], KEYS[4], KEYS[5], KEYS[2], KEYS[3], KEYS[0], KEYS[1],
    ];
    server.kill_and_restart(Some(&reordered));
    let r = client.get(&sub).bearer_auth("w-key").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["webhook"]["url"], hook);
    let r = client.get(&sub).bearer_auth("w2-key").send().await.unwrap();
    assert_eq!(r.status(), 404);
    // The owner (a write key) deletes it.
    let r = client
        .delete(&sub)
        .bearer_auth("w-key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = client.get(&sub).bearer_auth("a-key").send().await.unwrap();
    assert_eq!(r.status(), 404);
}
