//! sluice: a database service for schema-checked ingest.
//!
//! Table rows arrive as NDJSON, are checked column by column against the table's types
//! ([`types`]) and decoded straight into Arrow record batches ([`ingest`]).
#![deny(missing_docs, unreachable_pub)]
#![warn(clippy::unwrap_used)]
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod catalog;
pub mod cli;
pub mod config;
pub mod db;
pub mod error;
pub mod http;
pub mod ingest;
pub mod log;
pub mod metrics;
pub mod node;
pub mod query;
pub mod storage;
pub mod stream;
pub mod table;
pub mod types;

/// Runs `work` every `tick` (the first time at once) until `shutdown` resolves; a round that
/// is under way when it does finishes first.
pub(crate) async fn every<F, Fut>(
    tick: std::time::Duration,
    shutdown: impl std::future::Future<Output = ()>,
    mut work: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    tokio::pin!(shutdown);
    let mut interval = tokio::time::interval(tick);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = interval.tick() => work().await,
        }
    }
}
