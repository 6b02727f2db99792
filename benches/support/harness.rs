//! What the end-to-end benches share: processes on loopback, the data file, the DuckDB peer,
//! a loader that sends NDJSON in bounded batches, and a peak-RSS sampler.

use std::io::{BufWriter, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// A setting from the environment, or its default.
pub fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The load generator's runtime.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Whether `cargo bench` was asked for this bench (a filter that does not name it skips it).
pub fn selected(name: &str) -> bool {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    args.is_empty() || args.iter().any(|a| name.contains(a.as_str()))
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A fresh directory under the temp dir for one server's data.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

pub fn wait_ready(port: u16) {
    for _ in 0..400 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("server on port {port} did not start");
}

/// A server process, killed (and its data removed) when dropped.
pub struct Server {
    pub name: &'static str,
    pub child: Child,
    pub base: String,
    pub dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `sluice serve` (this build's binary) on a free port with a fresh data directory and its
/// embedded defaults.
pub fn start_sluice() -> Server {
    let port = free_port();
    let dir = scratch("sluice");
    let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(&dir)
        .env("SLUICE_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("sluice starts");
    wait_ready(port);
    Server {
        name: "sluice",
        child,
        base: format!("http://127.0.0.1:{port}"),
        dir,
    }
}

/// The events table of the generated rows, created through the catalog API.
pub async fn create_events_table(client: &reqwest::Client, base: &str) {
    let columns: Vec<Value> = super::event_columns()
        .iter()
        .map(|c| json!({"name": c.name, "data_type": c.data_type.to_string()}))
        .collect();
    let r = client
        .put(format!(
            "{base}/v1/catalog/databases/scopedb/schemas/public/tables/events"
        ))
        .json(&json!({"name": "events", "comment": null, "columns": columns}))
        .send()
        .await
        .expect("create table");
    assert!(r.status().is_success(), "create table: {}", r.status());
}

/// The table's figures from `GET .../stats` (`?files=true` adds the file list).
pub async fn table_stats(client: &reqwest::Client, base: &str, files: bool) -> Value {
    client
        .get(format!(
            "{base}/v1/catalog/databases/scopedb/schemas/public/tables/events/stats?files={files}"
        ))
        .send()
        .await
        .expect("stats")
        .json()
        .await
        .expect("stats body")
}

/// Runs a statement to its end and returns the finished payload.
pub async fn statement(client: &reqwest::Client, base: &str, sql: &str) -> Value {
    let mut v: Value = client
        .post(format!("{base}/v1/statements"))
        .json(&json!({"statement": sql, "format": "json"}))
        .send()
        .await
        .expect("submit")
        .json()
        .await
        .expect("statement body");
    while v["status"] == "running" || v["status"] == "pending" {
        let id = v["statement_id"].as_str().expect("id").to_owned();
        v = client
            .get(format!("{base}/v1/statements/{id}?format=json"))
            .send()
            .await
            .expect("poll")
            .json()
            .await
            .expect("statement body");
    }
    assert_eq!(v["status"], "finished", "{sql}: {v}");
    v
}

/// The seeded NDJSON file of about `bytes` bytes (generated once, kept under
/// `target/bench-data/`), and its row count.
pub fn events_file(bytes: u64, seed: u64) -> (PathBuf, u64) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-data");
    std::fs::create_dir_all(&dir).expect("bench-data dir");
    let path = dir.join(format!("events-{seed}-{bytes}.ndjson"));
    let rows_path = path.with_extension("rows");
    if let (Ok(_), Ok(rows)) = (
        std::fs::metadata(&path),
        std::fs::read_to_string(&rows_path),
    ) && let Ok(rows) = rows.trim().parse()
    {
        return (path, rows);
    }
    let started = Instant::now();
    let partial = path.with_extension("partial");
    let mut out =
        BufWriter::with_capacity(1 << 20, std::fs::File::create(&partial).expect("create"));
    let mut rng = super::Rng::new(seed);
    let mut line = String::with_capacity(512);
    let (mut written, mut rows) = (0u64, 0u64);
    while written < bytes {
        line.clear();
        super::push_event(&mut rng, rows, &mut line);
        out.write_all(line.as_bytes()).expect("write");
        written += line.len() as u64;
        rows += 1;
    }
    out.flush().expect("flush");
    drop(out);
    std::fs::rename(&partial, &path).expect("rename");
    std::fs::write(&rows_path, rows.to_string()).expect("rows file");
    eprintln!(
        "generated {} ({rows} rows, {written} bytes) in {:.1} s",
        path.display(),
        started.elapsed().as_secs_f64()
    );
    (path, rows)
}

/// What a load sent and how long it took.
#[derive(Debug, Default)]
pub struct LoadReport {
    pub bytes: u64,
    pub rows: u64,
    pub batches: u64,
    pub retries: u64,
    pub seconds: f64,
}

/// Sends `file` to the events table's ingest endpoint in batches of at most `batch_bytes`
/// (cut at line ends) over `connections` concurrent requests, retrying 429/503 answers after
/// their `Retry-After`. Returns once every batch is acknowledged (durable and queryable).
pub async fn load(base: &str, file: &Path, batch_bytes: usize, connections: usize) -> LoadReport {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(connections)
        .build()
        .expect("client");
    let url = format!("{base}/v1/catalog/databases/scopedb/schemas/public/tables/events/ingest");
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(connections);
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    let file = file.to_owned();
    let started = Instant::now();
    // The reader: a thread that cuts the file into batches ending at a newline.
    let reader = std::thread::spawn(move || {
        let mut f = std::fs::File::open(&file).expect("open data file");
        let mut carry: Vec<u8> = Vec::new();
        loop {
            let mut buf = std::mem::take(&mut carry);
            let have = buf.len();
            buf.resize(batch_bytes, 0);
            let mut filled = have;
            while filled < batch_bytes {
                let n = f.read(&mut buf[filled..]).expect("read data file");
                if n == 0 {
                    break;
                }
                filled += n;
            }
            buf.truncate(filled);
            if buf.is_empty() {
                break;
            }
            let cut = if filled < batch_bytes {
                filled
            } else {
                buf.iter()
                    .rposition(|&b| b == b'\n')
                    .expect("a line fits a batch")
                    + 1
            };
            carry = buf[cut..].to_vec();
            buf.truncate(cut);
            if tx.blocking_send(bytes::Bytes::from(buf)).is_err() {
                break;
            }
        }
    });
    let totals = Arc::new([
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
        AtomicU64::new(0),
    ]);
    let mut workers = Vec::new();
    for _ in 0..connections {
        let (client, url, rx, totals) = (client.clone(), url.clone(), rx.clone(), totals.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let Some(body) = rx.lock().await.recv().await else {
                    break;
                };
                loop {
                    let r = client
                        .post(&url)
                        .header("content-type", "application/x-ndjson")
                        .body(body.clone())
                        .send()
                        .await
                        .expect("ingest request");
                    let status = r.status().as_u16();
                    if status == 503 || status == 429 {
                        let wait = r
                            .headers()
                            .get("retry-after")
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse::<f64>().ok())
                            .unwrap_or(1.0);
                        totals[3].fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_secs_f64(wait.min(1.0))).await;
                        continue;
                    }
                    let text = r.text().await.expect("ingest answer");
                    assert_eq!(status, 200, "ingest: {text}");
                    let v: Value = serde_json::from_str(&text).expect("ingest json");
                    totals[0].fetch_add(body.len() as u64, Ordering::Relaxed);
                    totals[1].fetch_add(
                        v["num_rows_inserted"].as_u64().unwrap_or(0),
                        Ordering::Relaxed,
                    );
                    totals[2].fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }));
    }
    for w in workers {
        w.await.expect("worker");
    }
    reader.join().expect("reader");
    LoadReport {
        bytes: totals[0].load(Ordering::Relaxed),
        rows: totals[1].load(Ordering::Relaxed),
        batches: totals[2].load(Ordering::Relaxed),
        retries: totals[3].load(Ordering::Relaxed),
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// CPU seconds (user + system) a process has used so far.
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces) start at its closing paren.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the paren; the
    // kernel counts them in USER_HZ, 100 on Linux.
    (ticks(11) + ticks(12)) / 100.0
}

/// Samples a process's resident set every 50 ms; `stop` returns the peak seen and the
/// kernel's own high-water mark (`VmHWM`).
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    pid: u32,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

impl RssSampler {
    pub fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, peak) = (stop.clone(), peak.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(kib) = status_kib(pid, "VmRSS:") {
                        peak.fetch_max(kib * 1024, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        };
        RssSampler {
            stop,
            peak,
            pid,
            thread: Some(thread),
        }
    }

    /// (peak sampled RSS, VmHWM), in bytes.
    pub fn stop(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let hwm = status_kib(self.pid, "VmHWM:").unwrap_or(0) * 1024;
        (self.peak.load(Ordering::Relaxed), hwm)
    }
}

/// The Python of `.tools/venv` with DuckDB installed in it (installed on first use).
pub fn duckdb_python() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let venv = root.join(".tools/venv");
    let python = venv.join("bin/python");
    if !python.exists() {
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 runs");
        assert!(status.success(), "python3 -m venv failed");
    }
    let has = Command::new(&python)
        .args(["-c", "import duckdb"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        eprintln!("installing duckdb {DUCKDB_VERSION} into .tools/venv");
        let status = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .arg(format!("duckdb=={DUCKDB_VERSION}"))
            .status()
            .expect("pip runs");
        assert!(status.success(), "pip install duckdb failed");
    }
    python
}

/// The DuckDB release the peer measurements use.
pub const DUCKDB_VERSION: &str = "2.0.1";

/// Runs `benches/duckdb_peer.py` with `args` and stdin `input`; returns its JSON answer.
pub fn duckdb_peer(args: &[&str], input: &Value) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/duckdb_peer.py");
    let mut child = Command::new(duckdb_python())
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("duckdb peer starts");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.to_string().as_bytes())
        .expect("write spec");
    let out = child.wait_with_output().expect("duckdb peer runs");
    assert!(out.status.success(), "duckdb peer failed");
    serde_json::from_slice(&out.stdout).expect("duckdb peer answers JSON")
}

/// Sum of the sizes of the files under `dir` whose name ends with `suffix`.
pub fn bytes_under(dir: &Path, suffix: &str) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().ends_with(suffix) {
                total += e.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
    }
    total
}
