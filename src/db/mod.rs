//! One sluice database: the commit log, the catalog, the tables and the query engine, wired
//! together. The HTTP layer calls this API; so can tests and embedders.
//!
//! `Database` owns the one write path for table rows: `Database::insert_rows` decodes and
//! checks NDJSON against the table's columns, fills computed columns and commits the batch to
//! the log. HTTP ingest, SQL `INSERT` and ScopeQL `INSERT INTO` all end there
//! (`statements` turns a statement's rows into that NDJSON form). Catalog changes go
//! through [`Database::mutate_catalog`], which checks computed-column expressions and
//! creates the storage of new tables. The query engine only reads.
//!
//! `Database` also owns the subscriptions ([`crate::subscriptions`]): opened with it (its
//! own node's), fed by its stream engines and those it takes over (`takeover.rs` attaches
//! and releases a taken-over node's subscriptions with its streams), and stored at
//! [`Database::shutdown`].

mod admission;
mod gc;
mod names;
mod statements;
mod takeover;

pub use crate::ingest::{AdmissionTimeout, IngestFailure};
pub use crate::subscriptions::{Network, SubscriptionLimits};
#[cfg(test)]
pub(crate) use admission::BodyBudget;
pub(crate) use admission::BodyReservation;
pub(crate) use gc::GcStats;
pub(crate) use names::NamePlace;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::SchemaRef;
use datafusion::common::DFSchema;
use datafusion::physical_expr::PhysicalExpr;

use crate::catalog::{
    Catalog, CatalogError, CatalogPath, Look, MutateOptions, Mutation, ResolvedTable,
};
use crate::iceberg::{IcebergViews, Published, View};
use crate::ingest::{ContentEncoding, Decoder, IngestError, Limits, decompress};
use crate::log::{CommitLog, Durability, LogConfig, LogError};
use crate::node::{LogState, Node, NodeError};
use crate::query::{QueryEngine, QueryError, QueryLimits};
use crate::storage::probe::{Probe, ProbedStore};
use crate::storage::{Storage, StorageError};
use crate::stream::{StreamError, Streams, StreamsConfig};
use crate::subscriptions::Subscriptions;
use crate::table::{TableConfig, TableError, TableStats, Tables};
use crate::types::{Column, ColumnType};

/// Settings of a database.
#[derive(Clone)]
pub struct DbConfig {
    /// Local directory for the commit log and the node id.
    pub data_dir: PathBuf,
    /// Object store URL; `None` means a directory `objects/` under `data_dir`.
    pub object_store: Option<String>,
    /// Ingest limits.
    pub limits: Limits,
    /// Commit log durability.
    pub durability: Durability,
    /// Commit log byte budget.
    pub max_log_bytes: u64,
    /// Commit log segment size (segments are the unit of log truncation).
    pub log_segment_bytes: u64,
    /// Table storage tuning.
    pub tables: TableConfig,
    /// How often flushes, compactions and stream checkpoints are considered.
    pub maintenance_interval: Duration,
    /// Stream engine settings.
    pub streams: StreamsConfig,
    /// Bounds on subscriptions, and the networks webhooks may reach.
    pub subscriptions: SubscriptionLimits,
    /// Failure injection for the commit log (tests: failing or slow writes and syncs).
    #[cfg(feature = "testing")]
    pub log_fail_hook: Option<crate::log::FailHook>,
    /// Request-body bytes that may be held at once while bodies are read and decoded,
    /// reserved as their bytes arrive (see `admission`); a body that finds no room waits,
    /// and TCP pushes back on its client.
    pub ingest_inflight_bytes: usize,
    /// The longest a request waits, in all, for room in `ingest_inflight_bytes`; then it
    /// answers 503 with nothing applied.
    pub ingest_admission_timeout: Duration,
    /// What one statement may use: memory, time, result size.
    pub query: QueryLimits,
    /// How long a node's heartbeat must stay still before another process may take over its
    /// id (see [`crate::node`]).
    pub node_lease: Duration,
    /// The URL other nodes reach this one at (stream requests are forwarded to their owner).
    pub advertise_url: Option<String>,
    /// How long an object no live version references is kept before garbage collection
    /// deletes it (queries and other nodes may still be reading it).
    pub gc_grace: Duration,
    /// Records what the log and the local store made durable, for simulated power loss
    /// (tests only).
    #[cfg(feature = "testing")]
    pub sync_journal: Option<Arc<crate::storage::journal::SyncJournal>>,
}

impl std::fmt::Debug for DbConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbConfig")
            .field("data_dir", &self.data_dir)
            .field("object_store", &self.object_store)
            .field("durability", &self.durability)
            .field("max_log_bytes", &self.max_log_bytes)
            .field("log_segment_bytes", &self.log_segment_bytes)
            .field("tables", &self.tables)
            .field("streams", &self.streams)
            .field("subscriptions", &self.subscriptions)
            .finish_non_exhaustive()
    }
}

impl DbConfig {
    /// Defaults for a data directory.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        DbConfig {
            data_dir: data_dir.into(),
            object_store: None,
            limits: Limits::default(),
            durability: Durability::Fsync,
            max_log_bytes: 4 << 30,
            log_segment_bytes: 64 << 20,
            tables: TableConfig::default(),
            maintenance_interval: Duration::from_secs(1),
            streams: StreamsConfig::default(),
            subscriptions: SubscriptionLimits::default(),
            #[cfg(feature = "testing")]
            log_fail_hook: None,
            ingest_inflight_bytes: 32 << 20,
            ingest_admission_timeout: Duration::from_secs(10),
            query: QueryLimits::default(),
            node_lease: Duration::from_secs(10),
            advertise_url: None,
            gc_grace: Duration::from_secs(600),
            #[cfg(feature = "testing")]
            sync_journal: None,
        }
    }
}

/// Why a database could not open.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The data directory is unusable.
    #[error("data directory {path}: {source}")]
    DataDir {
        /// The directory.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Object storage could not be set up.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The commit log could not open.
    #[error(transparent)]
    Log(#[from] LogError),
    /// The catalog could not load.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// Table storage could not open or replay.
    #[error(transparent)]
    Table(#[from] TableError),
    /// Streams could not load their snapshot or replay.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// The query engine could not start.
    #[error(transparent)]
    Query(#[from] QueryError),
    /// The node could not take its identity.
    #[error(transparent)]
    Node(#[from] crate::node::NodeError),
    /// The stored subscriptions could not load.
    #[error("subscriptions: {0}")]
    Subscriptions(String),
}

/// Work counters of table ingest (for metrics).
#[derive(Debug, Default)]
pub(crate) struct IngestStats {
    /// Rows committed.
    pub rows: std::sync::atomic::AtomicU64,
    /// Decoded NDJSON bytes of committed inserts (after gzip/zstd; an INSERT statement counts
    /// the NDJSON its rows were written as).
    pub bytes: std::sync::atomic::AtomicU64,
    /// Row errors of requests refused for invalid rows.
    pub rejected_rows: std::sync::atomic::AtomicU64,
}

/// A computed column compiled against a table's input columns.
struct ComputedColumn {
    /// Its index in the stored schema.
    index: usize,
    /// Its name.
    name: String,
    /// Its type: its values obey the same rules as input values of that type.
    data_type: ColumnType,
    expr: Arc<dyn PhysicalExpr>,
    /// A decoder of this one column, which checks its values (see `ComputedColumn::values`).
    check: Decoder,
}

/// A table's ingest path: decoder plus computed columns, built once per table definition.
struct IngestPlan {
    decoder: Decoder,
    stored_schema: SchemaRef,
    computed: Vec<ComputedColumn>,
}

/// One open sluice database.
pub struct Database {
    log: CommitLog,
    node: Arc<Node>,
    storage: Storage,
    catalog: Arc<Catalog>,
    tables: Arc<Tables>,
    streams: Streams,
    /// Subscriptions of this node and of the node ids it took over.
    subscriptions: Arc<Subscriptions>,
    engine: QueryEngine,
    config: DbConfig,
    probe: Arc<Probe>,
    ingest_stats: IngestStats,
    gc_stats: GcStats,
    /// Each table's ingest plan, by storage id, with the schema id it was compiled for.
    plans: Mutex<HashMap<String, (i32, Arc<IngestPlan>)>>,
    /// Admission of request bodies ([`DbConfig::ingest_inflight_bytes`]).
    body_budget: admission::BodyBudget,
    /// Dead nodes' ids this process took over (object-store durability).
    takeovers: takeover::Takeovers,
    /// Creates and deletes of one stream name, one at a time.
    names: names::NameLocks,
    /// Reads of other nodes' streams their snapshots did not answer lately.
    sealed_misses: names::SealedMisses,
    /// Listings of streams, one at a time ([`Database::list_streams`]).
    listings: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Database")
            .field("data_dir", &self.config.data_dir)
            .field("storage", &self.storage.url())
            .finish()
    }
}

impl DbConfig {
    /// The journal of syncs, when a test simulates power loss.
    fn journal(&self) -> Option<Arc<crate::storage::journal::SyncJournal>> {
        #[cfg(feature = "testing")]
        return self.sync_journal.clone();
        #[cfg(not(feature = "testing"))]
        None
    }
}

impl Database {
    /// Opens the database: object storage, the commit log (replaying it), the catalog and the
    /// tables.
    pub async fn open(config: DbConfig) -> Result<Arc<Database>, OpenError> {
        // Objects are synced under object-store durability too: a local-directory store is
        // then what holds the log.
        let sync = config.durability != Durability::None;
        let journal = config.journal();
        let own = config.data_dir.join("objects");
        let storage = match &config.object_store {
            Some(url) => match crate::storage::local_dir(url) {
                // This node's default store, named: it is held alone all the same.
                Some(dir) if same_dir(dir, &own) => Storage::local_private(&own, sync, journal)?,
                // Another node's default store (beside its identity): that node trusts its
                // catalog without looking at the store, and a lock may not keep out a node on
                // another machine (through a network mount), so it is never shared.
                Some(dir)
                    if dir.parent().is_some_and(|p| p.join("node.json").exists())
                        && dir.file_name().is_some_and(|n| n == "objects") =>
                {
                    return Err(OpenError::Storage(StorageError::InUse {
                        path: dir.display().to_string(),
                        reason: "it is another node's default store (inside its data \
                                 directory), which no other node may name as its store; give \
                                 the nodes that share a store a directory of its own",
                    }));
                }
                _ => Storage::open_with(url, sync, journal)?,
            },
            None => Storage::local_private(&own, sync, journal)?,
        };
        Self::open_with_storage(config, storage).await
    }

    /// Opens the database over a given store (tests wrap stores to inject faults);
    /// `config.object_store` is not consulted.
    pub async fn open_with_storage(
        config: DbConfig,
        storage: Storage,
    ) -> Result<Arc<Database>, OpenError> {
        std::fs::create_dir_all(&config.data_dir).map_err(|source| OpenError::DataDir {
            path: config.data_dir.display().to_string(),
            source,
        })?;
        if config.gc_grace <= config.query.timeout {
            // A query may then find a file it planned to read already collected (it fails;
            // nothing is lost, as the file's rows live on in the files that replaced it).
            tracing::warn!(
                gc_grace_seconds = config.gc_grace.as_secs_f64(),
                statement_timeout_seconds = config.query.timeout.as_secs_f64(),
                "the garbage-collection grace period is not longer than the statement timeout: \
                 long queries may fail when compaction replaces the files they read"
            );
        }
        // Every request to the store passes the probe, which counts errors for metrics.
        let probe = Arc::new(Probe::default());
        let storage = storage.layered(Arc::new(ProbedStore::new(
            storage.store().clone(),
            probe.clone(),
        )));
        let mut log_config = LogConfig::new(config.data_dir.join("log"));
        log_config.durability = config.durability;
        log_config.max_log_bytes = config.max_log_bytes;
        log_config.segment_bytes = config.log_segment_bytes;
        #[cfg(feature = "testing")]
        {
            log_config.fail_hook = config.log_fail_hook.clone();
            log_config.journal = config.sync_journal.clone();
        }
        // Both consumers are declared before anything is released: a segment goes only when
        // the tables and the streams have both made its records durable elsewhere.
        log_config.consumers = vec!["tables".into(), "streams".into()];
        let (log, replay) = CommitLog::open(log_config.clone())?;
        // A failed open closes the log again: it holds the directory's lock.
        let opened = Self::open_over_log(
            config.clone(),
            storage.clone(),
            probe.clone(),
            log.clone(),
            replay,
        )
        .await;
        match opened {
            Err(OpenError::Node(
                e @ (NodeError::Superseded { .. }
                | NodeError::MissingIdentity { .. }
                | NodeError::UnknownToStore { .. }
                | NodeError::InUse { .. }),
            )) if config.durability == Durability::ObjectStore => {
                // Under object-store durability the directory is only a cache: what it
                // held that counts is in the store, and another node takes its id over.
                // Start afresh under a new id.
                log.close();
                tracing::warn!(error = %e, "the data directory's node identity cannot be used; under object-store durability it is a cache, so this node starts under a new id");
                let reset = |path: &std::path::Path| -> Result<(), OpenError> {
                    let removed = if path.is_dir() {
                        std::fs::remove_dir_all(path)
                    } else {
                        std::fs::remove_file(path)
                    };
                    match removed {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                            Err(OpenError::DataDir {
                                path: path.display().to_string(),
                                source: e,
                            })
                        }
                        _ => Ok(()),
                    }
                };
                reset(&config.data_dir.join("log"))?;
                reset(&config.data_dir.join("node.json"))?;
                reset(&config.data_dir.join("node_id"))?;
                let (log, replay) = CommitLog::open(log_config)?;
                let opened = Self::open_over_log(config, storage, probe, log.clone(), replay).await;
                if opened.is_err() {
                    log.close();
                }
                opened
            }
            Err(e) => {
                log.close();
                Err(e)
            }
            Ok(db) => Ok(db),
        }
    }

    /// The rest of opening, once the log is open: the node's identity, the catalog, the
    /// tables and streams (replaying the log), the query engine.
    async fn open_over_log(
        config: DbConfig,
        storage: Storage,
        probe: Arc<Probe>,
        log: CommitLog,
        replay: Vec<crate::log::Record>,
    ) -> Result<Arc<Database>, OpenError> {
        let node = Arc::new(
            Node::claim(
                &config.data_dir,
                storage.clone(),
                LogState {
                    // An empty log that ever held records has moved past LSN 0: its
                    // identity matters as much (its streams and subscriptions are named by it).
                    has_records: !replay.is_empty() || log.last_lsn() > 0,
                    last_lsn: log.last_lsn(),
                    synced: config.durability == Durability::Fsync,
                    remote: config.durability == Durability::ObjectStore,
                },
                config.node_lease,
                config.journal().as_deref(),
            )
            .await?,
        );
        if let Some(url) = &config.advertise_url {
            node.set_url(url);
        }
        // Local caches of ids an earlier run hosted: those ids are taken over afresh.
        let hosted_cache = config.data_dir.join("hosted");
        if hosted_cache.exists()
            && let Err(e) = std::fs::remove_dir_all(&hosted_cache)
        {
            tracing::warn!(dir = %hosted_cache.display(), error = %e, "could not remove the cache of hosted ids");
        }
        // Reading the log back and replaying it may take longer than a lease: the heartbeat
        // moves meanwhile, so no peer takes this node over while it starts.
        let _beating = (config.durability == Durability::ObjectStore)
            .then(|| crate::node::keep_beating(node.clone()));
        // Under object-store durability, what counts is the log in the store: the local
        // one may lack groups (a lost disk) or hold groups never acknowledged.
        let replay = if config.durability == Durability::ObjectStore {
            let (remote, records) =
                crate::log::recover_remote(storage.store().clone(), node.id(), node.epoch())
                    .await
                    .map_err(NodeError::from)?;
            log.attach_remote(remote, config.node_lease / 2);
            records
        } else {
            replay
        };
        // This epoch's records start past every LSN an earlier epoch could have used.
        log.advance_to(node.lsn_base()).await?;
        let catalog = Arc::new(Catalog::open(storage.clone()).await?);
        let live = catalog.storage_ids().await;
        let tables = Arc::new(
            Tables::open_observed(
                log.clone(),
                &replay,
                storage.clone(),
                node.clone(),
                config.tables.clone(),
                config.gc_grace,
                Some(&live),
                Some(Arc::new(IcebergViews::new(
                    storage.clone(),
                    config.gc_grace,
                ))),
            )
            .await?,
        );
        let streams = Streams::open(
            log.clone(),
            &replay,
            storage.clone(),
            node.clone(),
            config.streams.clone(),
        )
        .await?;
        let subscriptions = Subscriptions::open(
            storage.clone(),
            node.clone(),
            streams.clone(),
            config.subscriptions.clone(),
            config.advertise_url.clone(),
        )
        .await
        .map_err(|e| OpenError::Subscriptions(e.to_string()))?;
        let engine = QueryEngine::new(
            catalog.clone(),
            tables.clone(),
            storage.clone(),
            config.query,
        )?;
        let body_budget = admission::BodyBudget::new(&config);
        Ok(Arc::new(Database {
            log,
            node,
            storage,
            catalog,
            tables,
            streams,
            subscriptions,
            engine,
            config,
            probe,
            ingest_stats: IngestStats::default(),
            gc_stats: GcStats::default(),
            plans: Mutex::new(HashMap::new()),
            body_budget,
            takeovers: takeover::Takeovers::default(),
            names: names::NameLocks::default(),
            sealed_misses: names::SealedMisses::default(),
            listings: Arc::new(tokio::sync::Semaphore::new(1)),
        }))
    }

    /// The Iceberg views of the tables, over this node's storage.
    fn iceberg_views(&self) -> IcebergViews {
        IcebergViews::new(self.storage.clone(), self.config.gc_grace)
    }

    /// Table `id`'s Iceberg `view`, made to describe the table's newest manifest state
    /// (commits of other nodes included); that view alone: the other's trouble is not this
    /// load's.
    pub(crate) async fn iceberg_view(&self, id: &str, view: View) -> Result<Published, TableError> {
        let state = self.tables.newest_state(id).await?;
        self.iceberg_views().view(view, id, &state).await
    }

    /// The catalog.
    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// The node id this process runs as.
    #[cfg(test)]
    pub(crate) fn node(&self) -> &Arc<Node> {
        &self.node
    }

    /// The tables.
    pub fn tables(&self) -> &Arc<Tables> {
        &self.tables
    }

    /// Ingest counters.
    pub(crate) fn ingest_stats(&self) -> &IngestStats {
        &self.ingest_stats
    }

    /// The object store.
    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Object-store requests that failed since the database opened.
    pub fn storage_errors(&self) -> u64 {
        self.probe.errors()
    }

    /// The streams.
    pub fn streams(&self) -> &Streams {
        &self.streams
    }

    /// The subscriptions (the protocol's reserved `__ds` APIs).
    pub(crate) fn subscriptions(&self) -> &Subscriptions {
        &self.subscriptions
    }

    /// The largest result a statement may give, in bytes of the statements API's JSON.
    pub(crate) fn max_result_bytes(&self) -> usize {
        self.config.query.max_result_bytes
    }

    /// The ingest limits.
    pub(crate) fn limits(&self) -> &Limits {
        &self.config.limits
    }

    /// The commit log.
    pub fn log(&self) -> &CommitLog {
        &self.log
    }

    /// Runs flushes, compactions, stream checkpoints, catalog refreshes, the node's
    /// heartbeat and garbage collection until `shutdown` resolves. Then call
    /// [`Database::shutdown`] (once), which seals and flushes what is left.
    pub async fn run_maintenance(
        self: Arc<Self>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let tick = self.config.maintenance_interval;
        let tables = self
            .tables
            .clone()
            .run_maintenance(tick, stopped(stop_rx.clone()));
        let streams = self
            .streams
            .clone()
            .run_maintenance(tick, stopped(stop_rx.clone()));
        let refresh = {
            let db = self.clone();
            crate::every(tick, stopped(stop_rx.clone()), move || {
                let db = db.clone();
                async move { db.refresh().await }
            })
        };
        let heartbeat = crate::node::run_heartbeat(
            self.node.clone(),
            self.log.clone(),
            stopped(stop_rx.clone()),
        );
        let takeovers = {
            let db = self.clone();
            let tick = (self.config.node_lease / 4).max(std::time::Duration::from_millis(50));
            crate::every(tick, stopped(stop_rx.clone()), move || {
                let db = db.clone();
                async move { db.take_over_dead_nodes().await }
            })
        };
        let gc = {
            let db = self.clone();
            crate::every(self.gc_interval(), stopped(stop_rx), move || {
                let db = db.clone();
                async move {
                    db.collect_garbage().await;
                }
            })
        };
        let signal = async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        };
        tokio::join!(tables, streams, refresh, heartbeat, takeovers, gc, signal);
    }

    /// Picks up what other nodes sharing the object store committed: new catalog versions
    /// and new manifest versions of the open tables. Failures are retried on the next call.
    pub async fn refresh(&self) {
        if let Err(e) = self.catalog.refresh().await {
            tracing::debug!(error = %e, "catalog refresh failed");
        }
        for id in self.tables.open_tables() {
            if let Err(e) = self.tables.refresh(&id).await {
                tracing::debug!(table = %id, error = %e, "manifest refresh failed");
            }
        }
        self.sync_shapes().await;
    }

    /// The one shutdown: stores the subscriptions, seals stream data, flushes every table,
    /// closes the commit log and releases the node's id (a restart anywhere may claim it at
    /// once). Stop maintenance first.
    pub async fn shutdown(&self) -> Result<(), TableError> {
        // The last changes reach the subscriptions, and they are stored.
        self.subscriptions.close().await;
        self.release_hosted().await;
        if let Err(e) = self.streams.checkpoint(true).await {
            tracing::warn!(error = %e, "stream checkpoint at close failed (data is safe in the log)");
        }
        let result = self.tables.flush_due(true).await;
        self.log.close();
        self.catalog.release_store().await;
        if !self.node.is_fenced()
            && let Err(e) = self.node.heartbeat(self.log.last_lsn(), true).await
        {
            tracing::warn!(error = %e, "could not release the node id; a restart elsewhere waits a lease");
        }
        result.map(|_| ())
    }

    /// Replaces the catalog subtree at `path` (see `Catalog::mutate`) after checking the
    /// computed-column expressions of every table in the new subtree, and creates storage for
    /// the tables it adds.
    pub async fn mutate_catalog(
        &self,
        path: &CatalogPath,
        value: Option<serde_json::Value>,
        options: MutateOptions<'_>,
    ) -> Result<Mutation, QueryError> {
        if let Some(v) = &value {
            for def in crate::catalog::tables_in(path, v)? {
                check_table_def(&def)?;
            }
        }
        let m = self.catalog.mutate(path, value, options).await?;
        // The change is committed: from here the answer is success. Storage that cannot be
        // created now is created by the first write (a table without storage reads as empty).
        for (_, id, def) in &m.created_tables {
            let created = match crate::catalog::table_columns(def) {
                Ok(columns) => self
                    .tables
                    .create_table_shaped(id, &columns, &def.column_ids(), def.schema_id())
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(error) = created {
                tracing::warn!(table = %id, %error, "table storage not created yet; the first write creates it");
            }
        }
        // A change of columns reaches the table's manifest (and its Iceberg view) now; if it
        // cannot, the next catalog refresh of any node that has the table open commits it.
        for (_, id, def) in &m.changed_tables {
            if let Err(error) = self.sync_shape(id, def).await {
                tracing::warn!(table = %id, %error, "table shape not committed to its manifest yet; a refresh commits it");
            }
        }
        Ok(m)
    }

    /// Commits the catalog's shape of table `id` (`def`) to its manifest, if the manifest's
    /// is older (see `Tables::set_shape`). A table without storage has nothing to change.
    async fn sync_shape(
        &self,
        id: &str,
        def: &crate::catalog::TableDef,
    ) -> Result<(), IngestFailure> {
        let columns = crate::catalog::table_columns(def)?;
        match self
            .tables
            .set_shape(
                id,
                &columns,
                &def.column_ids(),
                def.schema_id(),
                def.last_column_id(),
            )
            .await
        {
            Err(TableError::NotFound(_)) => Ok(()),
            other => Ok(other?),
        }
    }

    /// [`Database::sync_shape`] for every table this node has open.
    async fn sync_shapes(&self) {
        let open: std::collections::HashSet<String> =
            self.tables.open_tables().into_iter().collect();
        for t in self.catalog.tables().await {
            if open.contains(&t.id)
                && let Err(error) = self.sync_shape(&t.id, &t.def).await
            {
                tracing::debug!(table = %t.id, %error, "table shape not committed yet");
            }
        }
    }

    fn plan(&self, table: &ResolvedTable) -> Result<Arc<IngestPlan>, IngestFailure> {
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        let schema_id = table.def.schema_id();
        if let Some((compiled, p)) = plans.get(&table.id)
            && *compiled == schema_id
        {
            return Ok(p.clone());
        }
        let columns = table.columns()?;
        let plan = Arc::new(compile_plan(&table.def, &columns)?);
        plans.insert(table.id.clone(), (schema_id, plan.clone()));
        Ok(plan)
    }

    /// Ingests a request body into `db.schema.table`: decompress (within the limit), then
    /// `Database::insert_rows`. Returns the row count once the rows are durable and visible.
    pub async fn ingest(
        &self,
        db: &str,
        schema: &str,
        table: &str,
        body: bytes::Bytes,
        encoding: ContentEncoding,
    ) -> Result<usize, IngestFailure> {
        let resolved = self.resolve_table(db, schema, table).await?;
        let limits = self.config.limits;
        let body = match encoding {
            ContentEncoding::Identity => body,
            _ => {
                // Decompressing is CPU work: keep it off the I/O threads.
                tokio::task::spawn_blocking(move || {
                    decompress(&body, encoding, limits.max_body_bytes)
                })
                .await
                .map_err(|e| IngestFailure::Table(TableError::Task(e.to_string())))??
                .into()
            }
        };
        self.insert_rows(&resolved, body, limits, Shape::Newest)
            .await
    }

    /// A reservation of request-body bytes, holding nothing yet: it grows as the body
    /// arrives (see `admission`). `owner` (a key's name, when keys are configured) puts it
    /// under that key's share too.
    pub(crate) fn body_reservation(&self, owner: Option<&Arc<str>>) -> BodyReservation {
        self.body_budget.reservation(owner)
    }

    /// Waits (within [`DbConfig::ingest_admission_timeout`]) until `bytes` of the request-body
    /// budget are held for work that decodes a body-sized input (an `INSERT`'s rows).
    pub(crate) async fn admit_ingest(
        &self,
        bytes: usize,
    ) -> Result<BodyReservation, AdmissionTimeout> {
        let mut reservation = self.body_budget.reservation(None);
        reservation.grow_to(bytes).await?;
        Ok(reservation)
    }

    /// Bytes of the request-body budget held now.
    pub(crate) fn body_bytes_held(&self) -> usize {
        self.body_budget.held_bytes()
    }

    /// Finds a table by name, looking at the shared catalog again when this node does not know
    /// it: another node sharing the object store may have created it since our last look.
    pub(crate) async fn resolve_table(
        &self,
        db: &str,
        schema: &str,
        table: &str,
    ) -> Result<ResolvedTable, CatalogError> {
        match self.catalog.table(db, schema, table).await {
            Err(CatalogError::NotFound { .. }) => {
                self.catalog.refresh().await?;
                self.catalog.table(db, schema, table).await
            }
            found => found,
        }
    }

    /// Size and state figures of a table, by name.
    pub async fn table_stats(
        &self,
        db: &str,
        schema: &str,
        table: &str,
    ) -> Result<TableStats, IngestFailure> {
        let resolved = self.resolve_table(db, schema, table).await?;
        match self.tables.stats(&resolved.id).await {
            // In the catalog, storage not created yet (see `mutate_catalog`): empty.
            Err(TableError::NotFound(_)) => Ok(TableStats::default()),
            other => Ok(other?),
        }
    }

    /// The Parquet files of a table now, by name (what a query of it reads besides the
    /// unflushed batches).
    pub(crate) async fn table_files(
        &self,
        db: &str,
        schema: &str,
        table: &str,
    ) -> Result<Vec<crate::table::DataFile>, IngestFailure> {
        let resolved = self.resolve_table(db, schema, table).await?;
        match self.tables.snapshot(&resolved.id).await {
            Err(TableError::NotFound(_)) => Ok(Vec::new()),
            other => Ok(other?.files),
        }
    }

    /// The one write path of table rows: decode and check `ndjson` against the table's columns
    /// (all-or-nothing), fill computed columns, commit the batch to the log. Returns the row
    /// count once the rows are durable and visible. Counts the work for metrics.
    ///
    /// With [`Shape::Newest`], the rows are checked against the table's newest shape (see
    /// [`Database::newest_table`]); with [`Shape::AsResolved`] (rows written for `table`'s
    /// columns, by position or name, as `INSERT` writes them), a table whose shape changed
    /// since is refused as a conflict, nothing applied.
    pub(crate) async fn insert_rows(
        &self,
        table: &ResolvedTable,
        ndjson: bytes::Bytes,
        limits: Limits,
        shape: Shape,
    ) -> Result<usize, IngestFailure> {
        use std::sync::atomic::Ordering::Relaxed;
        let size = ndjson.len() as u64;
        let newer = self.newest_table(table, std::time::Instant::now()).await?;
        let newest = newer.as_ref().unwrap_or(table);
        if shape == Shape::AsResolved
            && (newest.id != table.id || !same_columns(&newest.def, &table.def))
        {
            return Err(CatalogError::Conflict.into());
        }
        let result = self.insert_rows_uncounted(newest, ndjson, limits).await;
        match &result {
            Ok(rows) => {
                self.ingest_stats.rows.fetch_add(*rows as u64, Relaxed);
                self.ingest_stats.bytes.fetch_add(size, Relaxed);
            }
            Err(IngestFailure::Input(IngestError::InvalidRows(rows))) => {
                self.ingest_stats
                    .rejected_rows
                    .fetch_add(rows.errors.len() as u64, Relaxed);
            }
            Err(_) => {}
        }
        result
    }

    /// The table named as `table` is in the newest catalog version committed before `since`
    /// (a change another node acknowledged before a request began is seen by it: rows that
    /// fit an older shape would mean other columns under it, after names were swapped or a
    /// name dropped and added again). One small read of the store, shared by concurrent
    /// callers; then the table is read again from this node's catalog whether or not that
    /// read found a newer version (a refresh may have landed since `table` was resolved),
    /// unless this node still holds the version `table` was read from (`None`: it is the
    /// newest). A table dropped and created again under the name is the new one. When the
    /// store does not answer, this node's catalog is what there is: ingest goes on while the
    /// store is down (when no node can change the catalog), and is logged.
    pub(crate) async fn newest_table(
        &self,
        table: &ResolvedTable,
        since: std::time::Instant,
    ) -> Result<Option<ResolvedTable>, CatalogError> {
        self.catch_up_catalog(since).await?;
        if self.catalog.version().await == table.version {
            return Ok(None);
        }
        self.catalog
            .table(&table.database, &table.schema, &table.def.name)
            .await
            .map(Some)
    }

    /// Reads the catalog versions committed before `since` that this node has not read yet
    /// (see [`Catalog::changed_since`]). When the store does not answer the look, this
    /// node's catalog is what there is (logged): while the store is down no node can change
    /// the catalog. When the look found a newer version that cannot be read (within
    /// [`CATCH_UP_TIMEOUT`]), the caller is refused, retryable, nothing applied: it would
    /// act on a catalog known to be stale.
    pub(crate) async fn catch_up_catalog(
        &self,
        since: std::time::Instant,
    ) -> Result<(), CatalogError> {
        let found = self.catalog.changed_since(since).await;
        match found {
            Look::Unchanged => Ok(()),
            Look::Failed => {
                tracing::debug!("catalog look failed: this node's version is used");
                Ok(())
            }
            Look::Denied => Err(CatalogError::Behind(
                "the store refused the look for a newer version".into(),
            )),
            Look::Newer { .. } | Look::Collected => {
                let read = self.catalog.catch_up(found, since);
                match tokio::time::timeout(CATCH_UP_TIMEOUT, read).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(CatalogError::Behind(e.to_string())),
                    Err(_) => Err(CatalogError::Behind(format!(
                        "a newer version was not read within {CATCH_UP_TIMEOUT:?}"
                    ))),
                }
            }
        }
    }

    async fn insert_rows_uncounted(
        &self,
        resolved: &ResolvedTable,
        ndjson: bytes::Bytes,
        limits: Limits,
    ) -> Result<usize, IngestFailure> {
        if ndjson.len() > limits.max_body_bytes {
            return Err(IngestError::BodyTooLarge {
                limit: limits.max_body_bytes,
            }
            .into());
        }
        let plan = self.plan(resolved)?;
        let inline = ndjson.len() <= INLINE_DECODE_BYTES;
        let decode = move || -> Result<RecordBatch, IngestFailure> {
            let input = plan.decoder.decode(&ndjson, &limits)?;
            plan.complete(input)
        };
        let batch = if inline {
            decode()?
        } else {
            // Decoding is CPU work: keep it off the I/O threads.
            tokio::task::spawn_blocking(decode)
                .await
                .map_err(|e| IngestFailure::Table(TableError::Task(e.to_string())))??
        };
        let rows = batch.num_rows();
        if rows > 0 {
            match self.tables.append(&resolved.id, batch.clone()).await {
                Err(TableError::NotFound(_)) => {
                    // Catalog entry without storage yet (a crash between the two): create it.
                    self.tables
                        .create_table_shaped(
                            &resolved.id,
                            &resolved.columns()?,
                            &resolved.def.column_ids(),
                            resolved.def.schema_id(),
                        )
                        .await?;
                    self.tables.append(&resolved.id, batch).await?;
                }
                other => {
                    other?;
                }
            }
            self.confirm_table(resolved, std::time::Instant::now())
                .await?;
        }
        Ok(rows)
    }

    /// Checks, after rows were committed to `table` and before they are acknowledged, that
    /// the table is still the one the catalog names: this node or another may have dropped
    /// or replaced it since it was resolved. One small read of the catalog's next version
    /// (shared by concurrent ingests), then a comparison with the catalog in memory.
    async fn confirm_table(
        &self,
        table: &ResolvedTable,
        committed: std::time::Instant,
    ) -> Result<(), CatalogError> {
        // A newer version in the store than this node holds: read it first. (The catalog
        // this node holds may already be newer than the one the table was resolved in: the
        // comparison below is made in any case.)
        // The rows are durable; a drop another node commits meanwhile is found only if the
        // store answers (while it does not, no node can commit one). When it refuses, or a
        // newer version cannot be read, the rows may have gone into a table that was dropped
        // or replaced: not acknowledged, their outcome unknown.
        if let Err(e) = self.catch_up_catalog(committed).await {
            return Err(CatalogError::Storage(object_store::Error::Generic {
                store: "catalog",
                source: format!("rows committed, but {e}").into(),
            }));
        }
        if self.catalog.version().await == table.version {
            return Ok(());
        }
        match self
            .catalog
            .table(&table.database, &table.schema, &table.def.name)
            .await
        {
            Ok(now) if now.id == table.id => Ok(()),
            Ok(_) => Err(CatalogError::Replaced(table.qualified_name())),
            Err(e @ CatalogError::NotFound { .. }) => Err(e),
            Err(_) => Ok(()),
        }
    }

    /// The query engine.
    pub(crate) fn engine(&self) -> &QueryEngine {
        &self.engine
    }
}

/// Whether two paths name one directory (both resolved; an unresolvable path names none).
fn same_dir(a: &std::path::Path, b: &std::path::Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// How long [`Database::catch_up_catalog`] may take to read the catalog versions a look
/// found.
const CATCH_UP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether two definitions of a table have the same columns (names, ids, types and
/// expressions, in order; comments aside).
fn same_columns(a: &crate::catalog::TableDef, b: &crate::catalog::TableDef) -> bool {
    fn key(d: &crate::catalog::TableDef) -> Vec<(&str, i32, &str, Option<&str>)> {
        d.columns
            .iter()
            .zip(d.column_ids())
            .map(|(c, id)| (&*c.name, id, &*c.data_type, c.expression.as_deref()))
            .collect()
    }
    key(a) == key(b)
}

/// Which shape of a table [`Database::insert_rows`] checks rows against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// The newest: the rows name their columns (an ingest body).
    Newest,
    /// The one the rows were written for (an `INSERT`'s, mapped to columns before its source
    /// query ran): a change since is a conflict.
    AsResolved,
}

/// Bodies up to this size are decoded on the request's own thread: a few rows decode in
/// microseconds, less than handing them to the blocking pool and back (a contended lock, a
/// wake-up and a thread switch each way were most of a one-row request's cost). Larger bodies
/// go to the blocking pool, so that the I/O threads stay free.
const INLINE_DECODE_BYTES: usize = 16 << 10;

/// Deepest a computed column's expression may nest (see [`crate::query::expression_depth`]).
const MAX_COMPUTED_DEPTH: usize = 64;

/// The most a computed column's function call, or a constant copied to every row of a batch,
/// may take: the largest `INSERT` (a batch of rows is at most an ingest body, 16 MiB, or an
/// `INSERT` of 128 MiB).
const COMPUTED_BYTES: usize = 128 << 20;

/// Checks that a table definition's computed-column expressions compile.
pub(crate) fn check_table_def(def: &crate::catalog::TableDef) -> Result<(), CatalogError> {
    compile_plan(def, &crate::catalog::table_columns(def)?).map(|_| ())
}

/// Compiles a table's ingest plan: its decoder, and its computed columns as physical
/// expressions over the input columns.
fn compile_plan(
    def: &crate::catalog::TableDef,
    columns: &[Column],
) -> Result<IngestPlan, CatalogError> {
    let decoder = Decoder::new(columns);
    let stored_schema = crate::types::arrow_schema_with_ids(columns, &def.column_ids());
    let input_schema = decoder.schema().clone();
    let mut computed = Vec::new();
    // Functions guarded as in statements: a write key's rows must not size an allocation
    // unchecked (`repeat(a, b)` with `b` from the rows).
    let ctx = crate::query::guarded_context(COMPUTED_BYTES);
    let df_schema = DFSchema::try_from(input_schema.as_ref().clone())
        .map_err(|e| CatalogError::Invalid(e.to_string()))?;
    for (index, c) in def.columns.iter().enumerate() {
        let Some(sql) = &c.expression else {
            continue;
        };
        // Expressions are compiled and evaluated on request threads: keep them shallow.
        let depth = crate::query::expression_depth(sql);
        if depth > MAX_COMPUTED_DEPTH {
            return Err(CatalogError::Invalid(format!(
                "column {} expression nests about {depth} levels deep; the limit is {MAX_COMPUTED_DEPTH}",
                c.name
            )));
        }
        let invalid = |e: datafusion::error::DataFusionError| {
            CatalogError::Invalid(format!(
                "column {} expression {sql:?}: {}",
                c.name,
                e.strip_backtrace()
            ))
        };
        let expr = ctx.parse_sql_expr(sql, &df_schema).map_err(invalid)?;
        // A computed column is a function of its own row: no subqueries.
        let subquery = datafusion::common::tree_node::TreeNode::exists(&expr, |e| {
            Ok(matches!(
                e,
                datafusion::logical_expr::Expr::ScalarSubquery(_)
                    | datafusion::logical_expr::Expr::InSubquery(_)
                    | datafusion::logical_expr::Expr::Exists(_)
            ))
        })
        .unwrap_or(true);
        if subquery {
            return Err(CatalogError::Invalid(format!(
                "column {} expression {sql:?}: subqueries are not allowed; a computed column is computed from its own row",
                c.name
            )));
        }
        let expr =
            crate::query::guarded_expression(expr, &df_schema, COMPUTED_BYTES).map_err(invalid)?;
        let expr = ctx
            .create_physical_expr(expr, &df_schema)
            .map_err(invalid)?;
        let data_type = columns
            .get(index)
            .map(|c| c.data_type)
            .ok_or_else(|| CatalogError::Invalid(format!("column {} has no type", c.name)))?;
        computed.push(ComputedColumn {
            index,
            name: c.name.clone(),
            data_type,
            expr,
            check: Decoder::new(&[Column::new(c.name.clone(), data_type)]),
        });
    }
    Ok(IngestPlan {
        decoder,
        stored_schema,
        computed,
    })
}

impl ComputedColumn {
    /// The column's values as its type stores them, under exactly the rules input values of
    /// that type obey: the expression's values are written in ingest's NDJSON form
    /// (`ingest/encode.rs`, as an `INSERT` writes its rows) and decoded by a decoder of this
    /// one column. A value that is not exactly a value of the type (1.5 for an `int`, an
    /// integer for a `timestamp`, `'yes'` for a `boolean`) fails the batch with a row error
    /// naming the column; nothing is truncated, rounded or made NULL.
    fn values(&self, value: &ArrayRef) -> Result<ArrayRef, IngestFailure> {
        let field = arrow_schema::Field::new(&self.name, value.data_type().clone(), true);
        let batch = RecordBatch::try_new(
            Arc::new(arrow_schema::Schema::new(vec![field])),
            vec![value.clone()],
        )
        .map_err(|e| self.failed(e.to_string()))?;
        let target = crate::ingest::encode::Target {
            name: self.name.clone(),
            data_type: self.data_type,
        };
        let mut body = Vec::new();
        crate::ingest::encode::write_ndjson(&batch, &[target], 0, &mut body)
            .map_err(|e| IngestFailure::Input(e.into()))?;
        let limits = Limits {
            max_body_bytes: usize::MAX,
            max_rows: usize::MAX,
            ..Limits::DEFAULT
        };
        let decoded = self.check.decode(&body, &limits)?;
        Ok(decoded.column(0).clone())
    }

    fn failed(&self, message: String) -> IngestFailure {
        IngestFailure::Computed {
            column: self.name.clone(),
            message,
        }
    }
}

impl IngestPlan {
    /// Adds the computed columns to a decoded batch, in definition order.
    fn complete(&self, input: RecordBatch) -> Result<RecordBatch, IngestFailure> {
        if self.computed.is_empty() {
            // The stored schema: the same columns, with their ids. (`with_schema` would
            // compare every field's metadata with the decoder's, per request.)
            return RecordBatch::try_new(self.stored_schema.clone(), input.columns().to_vec())
                .map_err(|e| IngestFailure::Computed {
                    column: String::new(),
                    message: e.to_string(),
                });
        }
        let rows = input.num_rows();
        let mut inputs = input.columns().iter();
        let mut columns: Vec<ArrayRef> = Vec::with_capacity(self.stored_schema.fields().len());
        for (index, field) in self.stored_schema.fields().iter().enumerate() {
            let fail = |message: String| IngestFailure::Computed {
                column: field.name().clone(),
                message,
            };
            match self.computed.iter().find(|c| c.index == index) {
                Some(c) => {
                    let value = c
                        .expr
                        .evaluate(&input)
                        .map_err(|e| fail(e.strip_backtrace()))?;
                    // A constant is copied to every row.
                    if let datafusion::logical_expr::ColumnarValue::Scalar(v) = &value
                        && v.size().saturating_mul(rows) > COMPUTED_BYTES
                    {
                        return Err(fail(format!(
                            "its value takes {} bytes, {rows} times; a batch's column may take \
                             {COMPUTED_BYTES}",
                            v.size()
                        )));
                    }
                    let value = value
                        .into_array(rows)
                        .map_err(|e| fail(e.strip_backtrace()))?;
                    columns.push(c.values(&value)?);
                }
                None => match inputs.next() {
                    Some(a) => columns.push(a.clone()),
                    None => return Err(fail("input column missing".into())),
                },
            }
        }
        RecordBatch::try_new(self.stored_schema.clone(), columns).map_err(|e| {
            IngestFailure::Computed {
                column: String::new(),
                message: e.to_string(),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check before rows are acknowledged: while this node holds the version a table was
    /// resolved in, it stands; once a drop, or a drop and a create under the name, landed after
    /// the resolution (here on this node, as it does between an ingest's commit and its
    /// answer), the rows are refused whichever way the versions went.
    #[tokio::test]
    async fn a_table_dropped_after_it_was_resolved_is_not_confirmed() {
        let dir = std::env::temp_dir().join(format!("sluice-confirm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let db = Database::open(DbConfig::new(&dir)).await.expect("open");
        db.execute("CREATE TABLE t (id int)").await.expect("create");
        let resolved = db.resolve_table("scopedb", "public", "t").await.expect("t");
        let now = std::time::Instant::now;
        db.confirm_table(&resolved, now()).await.expect("unchanged");
        // Another table changes the version, not what `t` names.
        db.execute("CREATE TABLE u (id int)").await.expect("create");
        db.confirm_table(&resolved, now())
            .await
            .expect("t unchanged");
        db.execute("DROP TABLE t").await.expect("drop");
        assert!(matches!(
            db.confirm_table(&resolved, now()).await,
            Err(CatalogError::NotFound { .. })
        ));
        db.execute("CREATE TABLE t (id int)")
            .await
            .expect("create again");
        assert!(matches!(
            db.confirm_table(&resolved, now()).await,
            Err(CatalogError::Replaced(_))
        ));
        db.shutdown().await.expect("shutdown");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
