//! Garbage collection of everything the database keeps in object storage, on a timer: table
//! files and manifest versions ([`crate::table`]), dropped tables, stream objects of deleted
//! and expired streams ([`crate::stream`]), old catalog versions ([`crate::catalog`]) and old
//! node claims ([`crate::node`]). Each module decides what it no longer references; every
//! object is kept for the grace period after it was seen unreferenced.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::Database;
use crate::storage::GcReport;

/// Totals of garbage collection since the database opened (for metrics).
#[derive(Debug, Default)]
pub struct GcStats {
    /// Objects deleted.
    pub objects: AtomicU64,
    /// Their bytes.
    pub bytes: AtomicU64,
    /// Collections that failed part-way (they are retried at the next interval).
    pub failures: AtomicU64,
}

impl Database {
    /// How often garbage collection runs: a quarter of the grace period, within 1 s to 60 s.
    pub(crate) fn gc_interval(&self) -> Duration {
        (self.config.gc_grace / 4).clamp(Duration::from_secs(1), Duration::from_secs(60))
    }

    /// Runs one garbage collection over everything; errors leave the rest for the next run.
    pub async fn collect_garbage(&self) -> GcReport {
        let grace = self.config.gc_grace;
        let mut report = GcReport::default();
        let mut failed = false;
        let mut note = |what: &str, result: Result<GcReport, String>| match result {
            Ok(r) => report.add(r),
            Err(e) => {
                failed = true;
                tracing::debug!(%what, error = %e, "garbage collection failed; retrying later");
            }
        };
        if !self.node.is_fenced() {
            // Table storage is listed before the catalog is loaded: a table's storage is only
            // created after the catalog version that names it.
            let tables = match self.tables.stored_ids().await {
                Ok(stored) => match self.catalog.reload().await {
                    Ok(()) => {
                        let live = self.catalog.storage_ids().await;
                        self.tables
                            .collect_garbage(&stored, &live)
                            .await
                            .map_err(|e| e.to_string())
                    }
                    Err(e) => Err(e.to_string()),
                },
                Err(e) => Err(e.to_string()),
            };
            note("tables", tables);
            note(
                "streams",
                self.streams
                    .collect_garbage(grace)
                    .await
                    .map_err(|e| e.to_string()),
            );
            note(
                "catalog",
                self.catalog
                    .collect_garbage(grace)
                    .await
                    .map_err(|e| e.to_string()),
            );
            note(
                "node",
                self.node
                    .collect_garbage(grace)
                    .await
                    .map_err(|e| e.to_string()),
            );
            if let Some(remote) = self.log.remote() {
                note(
                    "log fences",
                    remote
                        .collect_fences(grace)
                        .await
                        .map_err(|e| e.to_string()),
                );
            }
            note("hosted streams", self.collect_hosted_garbage().await);
        }
        self.gc_stats
            .objects
            .fetch_add(report.objects, Ordering::Relaxed);
        self.gc_stats
            .bytes
            .fetch_add(report.bytes, Ordering::Relaxed);
        if failed {
            self.gc_stats.failures.fetch_add(1, Ordering::Relaxed);
        }
        if report.objects > 0 {
            tracing::debug!(
                objects = report.objects,
                bytes = report.bytes,
                "garbage collected"
            );
        }
        report
    }

    /// Garbage collection totals.
    pub fn gc_stats(&self) -> &GcStats {
        &self.gc_stats
    }
}
