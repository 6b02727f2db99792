//! Helpers shared by the integration tests that run a server in this process.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};
use sluice::db::Database;
use sluice::http::{AppState, router};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh, empty directory under the system temp dir, unique to this process and call.
pub fn temp_dir(prefix: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("sluice-{prefix}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Serves `db` over HTTP on a free loopback port.
pub async fn serve(
    db: Arc<Database>,
    keys: Vec<String>,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(AppState::new(db, keys));
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (addr, task)
}

/// The seed's `events` table definition.
pub fn events_def() -> Value {
    json!({"name": "events", "comment": null, "columns": [
        {"name": "time", "data_type": "timestamp"},
        {"name": "service", "data_type": "string"},
        {"name": "name", "data_type": "string"},
        {"name": "message", "data_type": "string"},
        {"name": "var", "data_type": "object"}
    ]})
}

/// A free loopback port (for a server process started next).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `sluice serve` on `127.0.0.1:port` with data in `dir`, no API keys, output discarded; add
/// arguments or environment before spawning.
pub fn sluice_serve(dir: &std::path::Path, port: u16) -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    command
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(dir)
        .env_remove("SLUICE_API_KEYS")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    command
}

/// Waits until the server on `port` answers its health check (30 s at most); returns how long
/// that took.
pub fn wait_healthy(port: u16) -> std::time::Duration {
    use std::io::{Read as _, Write as _};
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_secs(30) {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(
                b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            );
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            if out.starts_with("HTTP/1.1 200") {
                return started.elapsed();
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("the server on port {port} did not become healthy");
}

/// Builds a request body (or header value) from its spec, as the test corpora write them
/// (`testdata/bad-input/cases.json`, `testdata/contracts/wire.toml`):
/// - a string: its bytes; `{"text": s}` the same; `{"hex": "7b22"}` the bytes it spells;
/// - `{"repeat": {"text": s, "times": n}}`: `s` n times;
/// - `{"nest": {"depth": n, "open", "close", "prefix", "middle", "suffix"}}`: `open` and
///   `close` n times each around `middle`;
/// - `{"pad_to": {"bytes": n, "head", "fill", "tail"}}`: `head`, then `fill` (one byte)
///   repeated, then `tail`, exactly n bytes in all;
/// - `{"gzip": spec}`: the gzip of what `spec` builds; `{"gzip_zeros": n}`: n zero bytes,
///   gzipped; `{"gzip_truncated": s}`, `{"zstd_truncated": s}`: the first half of `s`
///   compressed.
pub fn build_bytes(spec: &Value) -> Vec<u8> {
    use std::io::Write as _;
    let gzip = |bytes: &[u8], level| {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), level);
        enc.write_all(bytes).unwrap();
        enc.finish().unwrap()
    };
    if let Some(s) = spec.as_str() {
        return s.as_bytes().to_vec();
    }
    if let Some(t) = spec["text"].as_str() {
        return t.as_bytes().to_vec();
    }
    if let Some(h) = spec["hex"].as_str() {
        return (0..h.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
            .collect();
    }
    if let Some(r) = spec.get("repeat") {
        return r["text"]
            .as_str()
            .unwrap()
            .repeat(r["times"].as_u64().unwrap() as usize)
            .into_bytes();
    }
    if let Some(n) = spec.get("nest") {
        let depth = n["depth"].as_u64().unwrap() as usize;
        let s = |k: &str| n[k].as_str().unwrap_or("").to_owned();
        return format!(
            "{}{}{}{}{}",
            s("prefix"),
            s("open").repeat(depth),
            s("middle"),
            s("close").repeat(depth),
            s("suffix")
        )
        .into_bytes();
    }
    if let Some(p) = spec.get("pad_to") {
        let s = |k: &str| p[k].as_str().unwrap_or("").as_bytes().to_vec();
        let (head, fill, tail) = (s("head"), s("fill"), s("tail"));
        let bytes = p["bytes"].as_u64().unwrap() as usize;
        assert_eq!(fill.len(), 1, "pad_to fills with one byte: {spec}");
        let padding = bytes
            .checked_sub(head.len() + tail.len())
            .unwrap_or_else(|| panic!("pad_to {bytes} is shorter than its head and tail"));
        let mut out = head;
        out.resize(out.len() + padding, fill[0]);
        out.extend_from_slice(&tail);
        return out;
    }
    if let Some(inner) = spec.get("gzip") {
        return gzip(&build_bytes(inner), flate2::Compression::fast());
    }
    if let Some(n) = spec["gzip_zeros"].as_u64() {
        return gzip(&vec![0u8; n as usize], flate2::Compression::best());
    }
    if let Some(t) = spec["gzip_truncated"].as_str() {
        let full = gzip(t.as_bytes(), flate2::Compression::fast());
        return full[..full.len() / 2].to_vec();
    }
    if let Some(t) = spec["zstd_truncated"].as_str() {
        let full = zstd::encode_all(t.as_bytes(), 3).unwrap();
        return full[..full.len() / 2].to_vec();
    }
    panic!("unknown body spec {spec}");
}

/// Runs `sql` through `POST /v1/statements` on the server at `base`; the answer must be 200.
/// A statement still running when the submit answers is fetched until it is not. Returns the
/// statement payload.
pub async fn statement(client: &reqwest::Client, base: &str, sql: &str) -> Value {
    let r = client
        .post(format!("{base}/v1/statements"))
        .json(&json!({"statement": sql}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let mut body: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{sql}: {body}");
    while body["status"] == "running" {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let id = body["statement_id"].as_str().unwrap().to_owned();
        let r = client
            .get(format!("{base}/v1/statements/{id}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{sql}");
        body = r.json().await.unwrap();
    }
    body
}

/// A `sluice serve` process for one test; killed when dropped.
pub struct Server {
    /// The process.
    pub child: std::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// Its directory (data under `data/`).
    pub dir: std::path::PathBuf,
    /// Its port, and the arguments it was started with.
    pub port: u16,
    args: Vec<String>,
}

impl Server {
    /// Starts the binary with `args` and, if given, a config file with `config` (TOML).
    pub fn start(name: &str, args: &[&str], config: &str) -> Server {
        let dir = temp_dir(name);
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        let mut args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        if !config.is_empty() {
            let path = dir.join("sluice.toml");
            std::fs::write(&path, config).unwrap();
            args.extend(["--config".to_owned(), path.display().to_string()]);
        }
        let child = sluice_serve(&dir.join("data"), port)
            .args(&args)
            .spawn()
            .unwrap();
        wait_healthy(port);
        Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
            port,
            args,
        }
    }

    /// Kills the process (SIGKILL) and starts it again on the same data, port and settings.
    pub fn restart(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        self.child = sluice_serve(&self.dir.join("data"), self.port)
            .args(&self.args)
            .spawn()
            .unwrap();
        wait_healthy(self.port);
    }

    /// The process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// A field of the process's `/proc/PID/status` in bytes (`VmRSS`, `VmHWM`: its resident
    /// memory now, and at its peak).
    pub fn memory(&self, field: &str) -> u64 {
        process_memory(self.child.id(), field).unwrap_or_else(|| panic!("no {field}"))
    }
}

/// A memory field of process `pid`'s `/proc/PID/status` in bytes (`VmRSS`, `VmHWM`); `None`
/// once the process is gone.
pub fn process_memory(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of metric `name` (its full name, labels included) on the server at `base`.
pub async fn metric(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}
