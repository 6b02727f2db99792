//! Floor servers for the streams bench: HTTP servers that do nothing but answer, so that a
//! run shows what HTTP over loopback costs on its machine before any server's own work.
//!
//! The bench starts them as child processes (this bench's own executable, run again with
//! [`FLOOR_ENV`] set), so their CPU is measured like any other server's. Both run a tokio
//! multi-thread runtime with one worker per core, as `sluice serve` does, and answer every
//! request at once: `PUT` with `201 Created`, anything else with `204 No Content` and a
//! `Stream-Next-Offset` header. Nothing is stored.
//!
//! - `raw`: reads each request's head up to its blank line, skips `Content-Length` bytes of
//!   body, writes a fixed answer. No HTTP library: the least a server over tokio's sockets
//!   can spend per request.
//! - `hyper`: the same answers from hyper's HTTP/1.1 server, set up as `sluice serve` sets it
//!   up (a header-read timeout on tokio's timer), each body read whole; no router, middleware,
//!   authentication or storage.
//!
//! The bench executable uses sluice's allocator (mimalloc), and a floor server turns
//! transparent huge pages off for itself as `sluice` does (`src/main.rs`), so the floors
//! allocate as sluice does.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// The environment variable that makes the bench executable a floor server:
/// `raw:PORT` or `hyper:PORT`.
pub const FLOOR_ENV: &str = "BENCH_FLOOR_SERVE";

const CREATED: &[u8] = b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n";
const APPENDED: &[u8] =
    b"HTTP/1.1 204 No Content\r\nstream-next-offset: 0000000000000000_0000000000000000\r\n\r\n";

/// Serves as the floor server `spec` names (`raw:PORT` or `hyper:PORT`) until killed.
pub fn serve(spec: &str) {
    let (kind, port) = spec.split_once(':').expect("a floor spec is KIND:PORT");
    let port: u16 = port.parse().expect("a port number");
    no_transparent_huge_pages();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let hyper = match kind {
        "raw" => false,
        "hyper" => true,
        other => panic!("no floor server {other:?}"),
    };
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
            if hyper {
                tokio::spawn(serve_hyper(socket));
            } else {
                tokio::spawn(serve_raw(socket));
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
