//! Server metrics in the Prometheus (OpenMetrics) text format, through `prometheus-client`.
//!
//! Requests and their latency are recorded by the HTTP layer as they are answered; everything
//! else (ingested and rejected rows, stream appends, commit-log work, unflushed bytes per
//! table, flush and compaction time, object-store errors) is read from the database's own
//! counters on each scrape by a collector, so it cannot drift from what the database did.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::db::Database;

/// Labels of an HTTP request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    /// HTTP method.
    pub method: &'static str,
    /// The route template (`/v1/stream/{*name}`), never the raw path.
    pub route: &'static str,
    /// Status code.
    pub status: u16,
}

/// Labels of a route.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RouteLabels {
    /// HTTP method.
    pub method: &'static str,
    /// The route template.
    pub route: &'static str,
}

/// Labels naming a table.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TableLabels {
    table: String,
}

/// The metrics one server records.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    /// Requests answered, by method, route and status.
    pub requests: Family<RequestLabels, Counter>,
    /// Request latency, by method and route.
    pub request_seconds: Family<RouteLabels, Histogram>,
    /// Live stream readers (SSE and long-poll) now open.
    pub live_readers: Arc<AtomicI64>,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.0005, 2.0, 16)
}

impl Metrics {
    /// Metrics for `db` (held weakly: the metrics never keep a closed database alive).
    pub(crate) fn new(db: &Arc<Database>) -> Metrics {
        let mut registry = Registry::with_prefix("sluice");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by method, route and status",
            requests.clone(),
        );
        let request_seconds = Family::<RouteLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(latency_buckets())
        });
        registry.register(
            "http_request_duration_seconds",
            "Time to answer an HTTP request (to the first byte of a streamed answer)",
            request_seconds.clone(),
        );
        let live_readers = Arc::new(AtomicI64::new(0));
        registry.register_collector(Box::new(StateCollector {
            db: Arc::downgrade(db),
            live_readers: live_readers.clone(),
        }));
        Metrics {
            registry,
            requests,
            request_seconds,
            live_readers,
        }
    }

    /// The text exposition.
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail; an encoder error would be a bug in a collector.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        out
    }

    /// Counts a live reader for as long as the guard lives.
    pub(crate) fn live_reader(&self) -> LiveReader {
        self.live_readers.fetch_add(1, Ordering::Relaxed);
        LiveReader(self.live_readers.clone())
    }
}

/// Held while a live reader is open.
#[derive(Debug)]
pub(crate) struct LiveReader(Arc<AtomicI64>);

impl Drop for LiveReader {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Reads the database's state on each scrape.
#[derive(Debug)]
struct StateCollector {
    db: Weak<Database>,
    live_readers: Arc<AtomicI64>,
}

fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstCounter::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), std::fmt::Error> {
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        gauge(
            &mut encoder,
            "stream_live_readers",
            "Open SSE and long-poll stream readers",
            self.live_readers.load(Ordering::Relaxed),
        )?;
        let Some(db) = self.db.upgrade() else {
            return Ok(());
        };
        let ingest = db.ingest_stats();
        counter(
            &mut encoder,
            "ingest_rows",
            "Rows committed by table ingest",
            ingest.rows.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "ingest_bytes",
            "Decoded NDJSON bytes of committed table inserts (after decompression)",
            ingest.bytes.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "ingest_row_errors",
            "Row errors reported by ingest requests refused for invalid rows (at most 100 per request)",
            ingest.rejected_rows.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "stream_checkpoints",
            "Stream checkpoints that sealed data and wrote a snapshot",
            db.streams().stats().checkpoints.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "stream_producer_sweeps",
            "Sweeps of every stream for producers idle past their expiry",
            db.streams().stats().producer_sweeps.load(Ordering::Relaxed),
        )?;
        let log_stats = db.log().stats();
        counter(
            &mut encoder,
            "log_segments_rolled",
            "Commit-log segments closed because they were full",
            log_stats.segments_rolled.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "log_segments_deleted",
            "Commit-log segments deleted once every consumer had released them",
            log_stats.segments_deleted.load(Ordering::Relaxed),
        )?;
        let gc = db.gc_stats();
        counter(
            &mut encoder,
            "gc_deleted_objects",
            "Objects garbage collection deleted (unreferenced for the grace period)",
            gc.objects.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "gc_deleted_bytes",
            "Bytes of the objects garbage collection deleted",
            gc.bytes.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "gc_failures",
            "Garbage collections that failed part-way (retried at the next interval)",
            gc.failures.load(Ordering::Relaxed),
        )?;
        let streams = db.streams().stats();
        counter(
            &mut encoder,
            "stream_appends",
            "Stream appends committed",
            streams.appends.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "stream_append_bytes",
            "Bytes of committed stream appends (as stored)",
            streams.append_bytes.load(Ordering::Relaxed),
        )?;
        let log = db.log().stats();
        let records = log.records.load(Ordering::Relaxed);
        let groups = log.groups.load(Ordering::Relaxed);
        counter(
            &mut encoder,
            "log_records",
            "Commit-log records written",
            records,
        )?;
        counter(
            &mut encoder,
            "log_groups",
            "Commit-log group commits (records per group = log_records / log_groups)",
            groups,
        )?;
        counter(
            &mut encoder,
            "log_groups_held",
            "Group commits held back (about 1 ms at most) while the runtime's workers were behind",
            log.groups_held.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "log_syncs",
            "fdatasync calls of the commit log",
            log.syncs.load(Ordering::Relaxed),
        )?;
        let sync_seconds = ConstCounter::new(log.sync_nanos.load(Ordering::Relaxed) as f64 / 1e9);
        sync_seconds.encode(encoder.encode_descriptor(
            "log_sync_seconds",
            "Time spent in commit-log fdatasync (latency per sync = this / log_syncs)",
            None,
            sync_seconds.metric_type(),
        )?)?;
        gauge(
            &mut encoder,
            "log_disk_bytes",
            "Bytes of commit-log segments on disk",
            i64::try_from(db.log().disk_bytes()).unwrap_or(i64::MAX),
        )?;
        gauge(
            &mut encoder,
            "request_body_bytes_held",
            "Bytes of the request-body budget (ingest_inflight_bytes) held by bodies being read and decoded",
            i64::try_from(db.body_bytes_held()).unwrap_or(i64::MAX),
        )?;
        gauge(
            &mut encoder,
            "stream_hot_bytes",
            "Stream bytes held in memory and the log, not yet sealed into object storage",
            i64::try_from(db.streams().hot_bytes()).unwrap_or(i64::MAX),
        )?;
        gauge(
            &mut encoder,
            "streams",
            "Streams that exist",
            i64::try_from(db.streams().len()).unwrap_or(i64::MAX),
        )?;
        let (state_bytes, producer_bytes) = db.streams().footprint();
        gauge(
            &mut encoder,
            "stream_state_bytes",
            "Bytes the streams' state counts against max_stream_state_bytes (estimated; producers included, data not)",
            i64::try_from(state_bytes).unwrap_or(i64::MAX),
        )?;
        gauge(
            &mut encoder,
            "stream_producer_bytes",
            "Bytes the streams' idempotent producers count against max_producer_bytes (estimated)",
            i64::try_from(producer_bytes).unwrap_or(i64::MAX),
        )?;
        let tables = db.tables().unflushed_by_table();
        let family = Family::<TableLabels, prometheus_client::metrics::gauge::Gauge>::default();
        for (table, bytes) in tables {
            family
                .get_or_create(&TableLabels { table })
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        family.encode(encoder.encode_descriptor(
            "table_unflushed_bytes",
            "Bytes of committed table batches not yet flushed to Parquet, by table id",
            None,
            family.metric_type(),
        )?)?;
        let ops = db.tables().op_stats();
        let seconds = |nanos: &std::sync::atomic::AtomicU64| {
            ConstCounter::new(nanos.load(Ordering::Relaxed) as f64 / 1e9)
        };
        counter(
            &mut encoder,
            "table_flushes",
            "Table flushes that wrote a Parquet file",
            ops.flushes.load(Ordering::Relaxed),
        )?;
        let flush = seconds(&ops.flush_nanos);
        flush.encode(encoder.encode_descriptor(
            "table_flush_seconds",
            "Time spent in table flushes (per flush = this / table_flushes)",
            None,
            flush.metric_type(),
        )?)?;
        counter(
            &mut encoder,
            "table_spills",
            "Unflushed table batches spilled: dropped from memory, read back from the commit log",
            ops.spills.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "table_spilled_reads",
            "Spilled table batches read back from the commit log (by queries and flushes)",
            ops.spilled_reads.load(Ordering::Relaxed),
        )?;
        counter(
            &mut encoder,
            "table_compactions",
            "Table compactions that wrote a Parquet file",
            ops.compactions.load(Ordering::Relaxed),
        )?;
        let compaction = seconds(&ops.compaction_nanos);
        compaction.encode(encoder.encode_descriptor(
            "table_compaction_seconds",
            "Time spent in table compactions (per compaction = this / table_compactions)",
            None,
            compaction.metric_type(),
        )?)?;
        counter(
            &mut encoder,
            "object_store_errors",
            "Object-store requests that failed (flushes, compactions, manifests, checkpoints)",
            db.storage_errors(),
        )?;
        Ok(())
    }
}
