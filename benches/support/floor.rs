//! Floor servers: HTTP servers that do nothing but answer (or only the least any server must
//! do), so that a run shows what its machine allows before any server's own work.
//!
//! A bench starts them as child processes (its own executable, run again with [`FLOOR_ENV`]
//! set; [`start`]), so their CPU is measured like any other server's. All run a tokio
//! multi-thread runtime with one worker per core, as `sluice serve` does. Nothing is stored.
//!
//! For the streams bench, answering every request at once: `PUT` with `201 Created`, anything
//! else with `204 No Content` and a `Stream-Next-Offset` header.
//!
//! - `raw`: reads each request's head up to its blank line, skips `Content-Length` bytes of
//!   body, writes a fixed answer. No HTTP library: the least a server over tokio's sockets
//!   can spend per request.
//! - `hyper`: the same answers from hyper's HTTP/1.1 server, set up as `sluice serve` sets it
//!   up (a header-read timeout on tokio's timer), each body read whole; no router, middleware,
//!   authentication or storage.
//!
//! For the ingest bench, answering `PUT` (the table's creation) with `200 OK` and each posted
//! batch with `200 OK` and `{"num_rows_inserted": N}`, on the `hyper` server above:
//!
//! Both admit at most 32 MiB of bodies at once, by their declared length before they are
//! read, as `sluice serve`'s ingest admission does on its defaults.
//!
//! - `receive`: each body read whole and its lines counted; what receiving the bench's load
//!   over loopback HTTP costs.
//! - `decode`: each body read whole and then decoded by sluice's own [`Decoder`] on tokio's
//!   blocking pool; the batch is dropped. What receiving the load and running the checks the ingest contract
//!   asks for costs, without the commit log, the table or Parquet.
//!
//! The bench executables use sluice's allocator (mimalloc), and a floor server turns
//! transparent huge pages off for itself as `sluice` does (`src/main.rs`), so the floors
//! allocate as sluice does.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use sluice::ingest::{Decoder, Limits};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::harness::{Server, free_port, scratch, wait_ready};

/// The environment variable that makes the bench executable a floor server:
/// `raw:PORT` or `hyper:PORT`.
pub const FLOOR_ENV: &str = "BENCH_FLOOR_SERVE";

const CREATED: &[u8] = b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n";
const APPENDED: &[u8] =
    b"HTTP/1.1 204 No Content\r\nstream-next-offset: 0000000000000000_0000000000000000\r\n\r\n";

/// What a floor server does with a request.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Raw,
    Hyper,
    Receive,
    Decode,
}

impl Kind {
    fn parse(kind: &str) -> Kind {
        match kind {
            "raw" => Kind::Raw,
            "hyper" => Kind::Hyper,
            "receive" => Kind::Receive,
            "decode" => Kind::Decode,
            other => panic!("no floor server {other:?}"),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Kind::Raw => "floor (raw tokio sockets, no HTTP library)",
            Kind::Hyper => "floor (hyper, no router or handler)",
            Kind::Receive => "floor (hyper, bodies received and dropped)",
            Kind::Decode => "floor (hyper, bodies decoded by sluice's decoder and dropped)",
        }
    }
}

/// The floor server `kind` (`raw`, `hyper`, `receive` or `decode`): this bench's executable
/// run again, on a free port, until the returned server is dropped.
pub fn start(kind: &str) -> Server {
    let name = Kind::parse(kind).describe();
    let port = free_port();
    let exe = std::env::current_exe().expect("the bench's own executable");
    let child = Command::new(exe)
        .env(FLOOR_ENV, format!("{kind}:{port}"))
        .stdout(Stdio::null())
        .spawn()
        .expect("the floor server starts");
    wait_ready(port);
    Server {
        name,
        child,
        base: format!("http://127.0.0.1:{port}"),
        dir: scratch(&format!("floor-{kind}")),
    }
}

/// Bodies the `decode` floor reads and decodes at once, in MiB: `ingest_inflight_bytes` of
/// `sluice serve`'s defaults.
const DECODE_INFLIGHT_MIB: u32 = 32;

/// Serves as the floor server `spec` names (`KIND:PORT`) until killed.
pub fn serve(spec: &str) {
    let (kind, port) = spec.split_once(':').expect("a floor spec is KIND:PORT");
    let kind = Kind::parse(kind);
    let port: u16 = port.parse().expect("a port number");
    no_transparent_huge_pages();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let ingest = Arc::new(IngestFloor {
        decoder: (kind == Kind::Decode).then(|| Decoder::new(&super::event_columns())),
        admission: Semaphore::new(DECODE_INFLIGHT_MIB as usize),
    });
    runtime.block_on(async move {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port)))
            .await
            .expect("bind");
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                // As `sluice serve` does: a lasting error (out of descriptors) must not spin a
                // worker, whose CPU would count as the floor's.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let _ = socket.set_nodelay(true);
            match kind {
                Kind::Raw => drop(tokio::spawn(serve_raw(socket))),
                Kind::Hyper => drop(tokio::spawn(serve_hyper(socket))),
                Kind::Receive | Kind::Decode => {
                    drop(tokio::spawn(serve_ingest(socket, ingest.clone())))
                }
            }
        }
    });
}

/// One connection of the `raw` floor server.
async fn serve_raw(mut socket: TcpStream) {
    let mut buf = Vec::with_capacity(8192);
    let mut chunk = vec![0u8; 8192];
    loop {
        // A whole head, then its body.
        let head_end = loop {
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .split("\r\n")
            .find_map(|line| line.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let put = head.starts_with("put ");
        while buf.len() < head_end + length {
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..head_end + length);
        let answer = if put { CREATED } else { APPENDED };
        if socket.write_all(answer).await.is_err() {
            return;
        }
    }
}

/// One connection of the `hyper` floor server.
async fn serve_hyper(socket: TcpStream) {
    use http_body_util::{BodyExt as _, Empty};
    use hyper::{Method, Request, Response, StatusCode, body::Incoming};
    let service = hyper::service::service_fn(|request: Request<Incoming>| async move {
        let put = request.method() == Method::PUT;
        // The body read whole, as sluice's handlers read it.
        let _ = request.into_body().collect().await;
        let mut response = Response::new(Empty::<bytes::Bytes>::new());
        if put {
            *response.status_mut() = StatusCode::CREATED;
        } else {
            *response.status_mut() = StatusCode::NO_CONTENT;
            response.headers_mut().insert(
                "stream-next-offset",
                hyper::header::HeaderValue::from_static("0000000000000000_0000000000000000"),
            );
        }
        Ok::<_, Infallible>(response)
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10))
        .serve_connection(hyper_util::rt::TokioIo::new(socket), service)
        .await;
}

/// The ingest floors' state: the decoder (`decode` only) and the admission of bodies.
struct IngestFloor {
    decoder: Option<Decoder>,
    /// Permits in MiB of declared body length.
    admission: Semaphore,
}

/// One connection of the `receive` or `decode` floor server.
async fn serve_ingest(socket: TcpStream, floor: Arc<IngestFloor>) {
    use http_body_util::{BodyExt as _, Full};
    use hyper::{Method, Request, Response, StatusCode, body::Incoming};
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let floor = floor.clone();
        async move {
            let answer = |status: StatusCode, body: String| {
                let mut response = Response::new(Full::new(bytes::Bytes::from(body)));
                *response.status_mut() = status;
                Ok::<_, Infallible>(response)
            };
            if request.method() != Method::POST {
                let _ = request.into_body().collect().await;
                return answer(StatusCode::OK, "{}".to_owned());
            }
            let declared = request
                .headers()
                .get(hyper::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(u64::MAX);
            let mib = declared
                .div_ceil(1 << 20)
                .clamp(1, DECODE_INFLIGHT_MIB as u64) as u32;
            let Ok(_admitted) = floor.admission.acquire_many(mib).await else {
                return answer(StatusCode::SERVICE_UNAVAILABLE, "{}".to_owned());
            };
            let body = match request.into_body().collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(e) => return answer(StatusCode::BAD_REQUEST, e.to_string()),
            };
            let rows = if floor.decoder.is_some() {
                let floor = floor.clone();
                tokio::task::spawn_blocking(move || {
                    let decoder = floor.decoder.as_ref().map(|d| {
                        d.decode(&body, &Limits::default())
                            .map(|batch| batch.num_rows())
                    });
                    decoder.unwrap_or(Ok(0))
                })
                .await
                .map_err(|e| e.to_string())
                .and_then(|decoded| decoded.map_err(|e| e.to_string()))
            } else {
                Ok(body.iter().filter(|b| **b == b'\n').count())
            };
            match rows {
                Ok(rows) => answer(StatusCode::OK, format!("{{\"num_rows_inserted\":{rows}}}")),
                Err(e) => answer(StatusCode::BAD_REQUEST, e),
            }
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10))
        .serve_connection(hyper_util::rt::TokioIo::new(socket), service)
        .await;
}

/// What `sluice` does first (`src/main.rs`): no transparent huge pages for this process.
fn no_transparent_huge_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `PR_SET_THP_DISABLE` takes integer arguments only and sets a flag of this
    // process's memory map; a refusal leaves huge pages as they were, which costs speed only.
    unsafe {
        let (on, unused) = (1 as libc::c_ulong, 0 as libc::c_ulong);
        libc::prctl(libc::PR_SET_THP_DISABLE, on, unused, unused, unused);
    }
}
