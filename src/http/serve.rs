//! The server loop: HTTP/1.1 connections from a [`LimitedListener`], each with a deadline for
//! its request headers (so a client that sends headers slowly, or nothing at all, cannot hold a
//! connection and its slot), a read buffer bounded near the header limit (so an unfinished
//! head costs at most that), and a graceful shutdown that lets open requests finish within a
//! bound.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::serve::Listener as _;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

use super::LimitedListener;

/// What a connection's read buffer may hold beyond [`super::deadline::MAX_HEADER_BYTES`]
/// (the request line, and the start of a body or a pipelined request read with a head).
const READ_BUFFER_SLACK: usize = 16 << 10;

/// The most header fields a request may carry (hyper's default, made explicit).
const MAX_HEADERS: usize = 100;

/// Serves `app` until `shutdown` resolves, then waits for open connections to finish their
/// requests, at most `drain` (connections still open then are dropped).
pub async fn serve(
    mut listener: LimitedListener,
    app: Router,
    header_timeout: Duration,
    drain: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (io, _addr) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            // Hyper buffers an unfinished head up to this (its default is ~400 KiB): a head
            // past it is refused (431) as it arrives, not once it is whole.
            .max_buf_size(super::deadline::MAX_HEADER_BYTES + READ_BUFFER_SLACK)
            .max_headers(MAX_HEADERS)
            .serve_connection(TokioIo::new(io), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            ?drain,
            "shutdown: connections still open after the drain timeout are dropped"
        );
    }
}
