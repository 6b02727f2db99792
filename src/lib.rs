//! sluice: a database service for schema-checked ingest.
//!
//! Table rows arrive as NDJSON, are checked column by column against the table's types
//! ([`types`]) and decoded straight into Arrow record batches ([`ingest`]); stream appends
//! follow the Durable Streams protocol ([`stream`]). Both ride one commit log ([`log`]) and
//! are acknowledged only once they are durable; queries see them at once ([`query`]).
//!
//! # Public API
//!
//! Embedders open a [`Database`] ([`db`]) and serve it with [`http::router`] and
//! [`http::serve`]; [`config`] reads the server's settings and [`cli`] is the command-line
//! client. Every error says its class ([`error::Classify`]): what kind of failure, whether
//! anything may have been applied, and whether to retry. The component modules ([`log`],
//! [`table`], [`stream`], [`catalog`], [`node`], [`storage`]) are public for the integration
//! tests and benches, which drive them directly; within every module, items are
//! `pub(crate)` unless something outside the crate uses them. The `testing` feature adds the
//! test hooks: failures injected into the log ([`log::LogConfig`]'s `fail_hook`), a
//! simulated power loss (`storage::journal`) and the object-store probe's fault switches
//! ([`storage::probe`]).
//!
//! # One table row, from HTTP to disk
//!
//! 1. `POST /v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/ingest` reaches
//!    `http/ingest.rs` (`ingest_table`): authenticated (`http/mod.rs`), admitted within the
//!    in-flight byte budget, its body read within the size limit.
//! 2. [`Database::ingest`] (`db/mod.rs`) resolves the table in the [`catalog`], decompresses,
//!    and calls `Database::insert_rows`, the one write path of table rows (ScopeQL and SQL
//!    `INSERT` come here too, from `db/statements.rs`): the table's [`ingest::Decoder`]
//!    (`ingest/decoder.rs`, `ingest/builder.rs`) checks every field against its column and
//!    builds one Arrow batch, all-or-nothing; computed columns are filled.
//! 3. [`table::Tables::append`] (`table/mod.rs`) encodes the batch as Arrow IPC
//!    (`table/files.rs`) and appends it to the [`log::CommitLog`] (`log/mod.rs`): the log's
//!    writer thread groups concurrent appends, writes their frames to the active segment
//!    (`log/segment.rs`, `data/log/{lsn:020}.log`) and fsyncs. After the sync, on the writer
//!    thread, the batch joins the table's unflushed set in memory: queries see it
//!    (`query/provider.rs`). Past the memory budget the oldest unflushed batches are
//!    spilled: they stay in the log only, and queries and flushes read them back from it. Before answering, `Database::confirm_table` checks that the
//!    catalog still names the same table: one dropped or replaced meanwhile (by this node or
//!    another) answers 404 or 409, and its rows, committed to the dropped table, are never
//!    visible. Otherwise the request is answered.
//! 4. Later a flush (`table/mod.rs`, on the maintenance timer, past a size once a burst of
//!    appends is over, or past an age) writes the oldest unflushed batches as one Parquet
//!    file, `tables/{id}/data/{uuid}.parquet`, and commits it
//!    to the table's manifest (`table/manifest.rs`), a versioned object
//!    (`storage/versioned.rs`) at `tables/{id}/_log/{v:020}.json`, with the log position it
//!    covers. Then the batches leave the unflushed set and the `tables` consumer releases the log up to
//!    that position; a segment is deleted once every consumer has released it.
//! 5. The new manifest version is shown to the tables' observer, the Iceberg view
//!    (`IcebergViews` in `iceberg/mod.rs`, which `db` wires in; tables know nothing else of
//!    it), and published as an Iceberg snapshot:
//!    `tables/{id}/metadata/v{n}.metadata.json` and its Avro manifest list and manifest, which
//!    the read-only REST catalog at `/iceberg` (`http/iceberg.rs`) hands to other engines.
//!
//! # One stream append, from HTTP to disk
//!
//! 1. `POST /v1/stream/{name}` (or `/{bucket}/{stream}`) reaches `http/streams.rs`, where the
//!    one handler set of both URL layouts parses the wire form (headers, offsets) into an
//!    [`stream::AppendRequest`].
//! 2. [`stream::Streams::append`] (`stream/mod.rs`) takes the stream's admission lock and asks
//!    `stream/admit.rs`, a pure function of the stream's state, what the append does
//!    (producer sequence, `Stream-Seq`, closed streams): a duplicate is answered without
//!    writing, anything else becomes one log record (`stream/codec.rs`).
//! 3. The record goes to the same [`log::CommitLog`], in the same group commits as table
//!    rows. After the fsync the change is applied to the stream's in-memory state
//!    (`stream/state.rs`) on the writer thread, readers waiting on it wake, and the append is
//!    answered.
//! 4. A checkpoint (`stream/cold.rs`) seals the in-memory records of every stream into one
//!    object, `streams/{node}/data/{lsn:020}-{tag}.bin`, writes a snapshot of every stream's
//!    state, `streams/{node}/snapshots/{lsn:020}.json`, and only then releases the log for
//!    the `streams` consumer.
//!
//! Every object path is named in one place, `storage/paths.rs`; on local disk, objects are
//! written by `storage/local.rs` (staged, fsynced, renamed, directory synced). A node's
//! identity and epoch (`node.rs`) fence its commits against a second process with the same
//! id.
#![deny(missing_docs, unreachable_pub)]
#![warn(clippy::unwrap_used)]
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod catalog;
pub mod cli;
pub mod config;
pub mod db;
pub mod error;
pub mod http;
pub(crate) mod iceberg;
pub mod ingest;
pub mod log;
pub(crate) mod metrics;
pub mod node;
pub mod query;
pub mod storage;
pub mod stream;
pub(crate) mod subscriptions;
pub mod table;
pub mod types;

pub use db::{Database, DbConfig, OpenError};

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
