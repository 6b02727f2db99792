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
pub mod http;
pub mod ingest;
pub mod log;
pub mod metrics;
pub mod query;
pub mod storage;
pub mod stream;
pub mod table;
pub mod types;
