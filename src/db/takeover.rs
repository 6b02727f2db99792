//! Taking over the logs of dead nodes (`durability = "object-store"`).
//!
//! Under object-store durability a node's acknowledged writes are in the object store
//! (`log::remote`), so they survive the node's disk. Every such node watches the heartbeats
//! of its peers ([`crate::node::peer_beats`]); when one that writes its log to the object
//! store stands still for a whole lease (by this node's clock, never by comparing clocks),
//! the node takes the id over:
//!
//! 1. It claims the id's next epoch ([`Node::take_over`]): a conditional create, so exactly
//!    one node wins, and the claim fences the old owner (its heartbeat and manifest commits
//!    check for a later epoch, and its lease ran out before the watch could end).
//! 2. It fences the old epochs' logs in the object store and reads back every group not yet
//!    released ([`crate::log::recover_remote`]).
//! 3. It hosts the id: a commit log of its own for the id (local cache under
//!    `hosted/{id}-{epoch}/`, groups to the id's object-store log), the id's tables replayed
//!    and flushed at once under the id's position in each manifest (so each row lands
//!    exactly once, whoever flushed it before), and the id's streams loaded from their
//!    snapshot and the log: their offsets, producer state and data stay as they were, and
//!    this node serves them from now on ([`Database::stream_engine`]). Its subscriptions are
//!    loaded and served too, fed by every engine this node serves; they rescan the id's
//!    engine from their stored watermark, so no wake the dead node owed is lost.
//! 4. An id with no stream and no subscription left is retired: its heartbeat says so, and
//!    no node takes it over again. Otherwise the host renews its heartbeat like its own; if the host dies too,
//!    another node takes the id over from the host in the same way.
//!
//! A clean shutdown releases every hosted id (after a checkpoint and a flush), so another
//! node, or this one after its restart, takes it over after a lease.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use super::{Database, OpenError};
use crate::log::{CommitLog, Durability, LogConfig, recover_remote};
use crate::node::{Node, NodeError, PeerBeat, peer_beats};
use crate::stream::{StreamError, Streams};
use crate::table::Tables;

/// A node id this process took over and serves.
pub(crate) struct Hosted {
    node: Arc<Node>,
    log: CommitLog,
    tables: Arc<Tables>,
    streams: Streams,
    stop: tokio::sync::watch::Sender<bool>,
    dir: PathBuf,
}

/// A peer's heartbeat as last seen, and since when it has not moved.
struct Watched {
    beat: PeerBeat,
    since: Instant,
    /// The latest epoch claimed of the id, as far as this process knows: the one a
    /// takeover fences (a claim whose owner never wrote a heartbeat gets a lease too).
    epoch: u64,
}

/// The ids this process hosts, and the peers it watches.
#[derive(Default)]
pub(crate) struct Takeovers {
    hosted: RwLock<Vec<Arc<Hosted>>>,
    watched: Mutex<HashMap<String, Watched>>,
    /// Where the live peers answer (from their heartbeats), for forwarded stream requests.
    peer_urls: RwLock<Vec<String>>,
    /// Streams found on a peer: name -> (its URL, when found).
    owners: Mutex<HashMap<String, (String, Instant)>>,
    /// One takeover pass at a time; when the last one read the heartbeats.
    pass: tokio::sync::Mutex<Option<Instant>>,
}

impl Takeovers {
    /// The hosted ids this process still owns (a fenced one lost its id to another
    /// process, and serves nothing).
    fn hosted(&self) -> Vec<Arc<Hosted>> {
        self.hosted
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|h| !h.node.is_fenced())
            .cloned()
            .collect()
    }

    /// Stops and forgets the hosted ids another process took from this one; returns them.
    fn drop_fenced(&self) -> Vec<String> {
        let fenced: Vec<Arc<Hosted>> = {
            let mut hosted = self.hosted.write().unwrap_or_else(|p| p.into_inner());
            let (fenced, kept) = hosted.drain(..).partition(|h| h.node.is_fenced());
            *hosted = kept;
            fenced
        };
        let mut ids = Vec::new();
        for h in fenced {
            tracing::warn!(node = %h.node.id(), "another process took over a node id this one hosted; its streams are served there");
            let _ = h.stop.send(true);
            h.streams.shutdown();
            h.log.close();
            let _ = std::fs::remove_dir_all(&h.dir);
            ids.push(h.node.id().to_owned());
        }
        ids
    }

    fn hosts(&self, id: &str) -> bool {
        self.hosted().iter().any(|h| h.node.id() == id)
    }

    /// The peers whose heartbeat stood still for `lease` since this process first saw it.
    /// Each with the epoch to take over from.
    fn due(&self, beats: Vec<PeerBeat>, lease: std::time::Duration) -> Vec<(PeerBeat, u64)> {
        let mut watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        watched.retain(|id, _| beats.iter().any(|b| b.id == *id));
        let mut due = Vec::new();
        for beat in beats {
            match watched.get_mut(&beat.id) {
                Some(w) if w.beat == beat => {
                    if w.since.elapsed() >= lease {
                        due.push((beat, w.epoch));
                    }
                }
                _ => {
                    watched.insert(
                        beat.id.clone(),
                        Watched {
                            epoch: beat.epoch,
                            beat,
                            since: Instant::now(),
                        },
                    );
                }
            }
        }
        due
    }

    /// A takeover of `id` found a later claim than the one it meant to fence: that claim's
    /// owner gets a whole lease to write its heartbeat before it counts as dead too.
    fn claimed_meanwhile(&self, id: &str, epoch: u64) {
        let mut watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = watched.get_mut(id) {
            w.epoch = w.epoch.max(epoch);
            w.since = Instant::now();
        }
    }
}

impl Database {
    /// The stream engine that holds stream `name`: this node's own when it has the stream
    /// (it also creates new streams), else a hosted id's that has it.
    pub fn stream_engine(&self, name: &str) -> Streams {
        if self.streams.contains(name) {
            return self.streams.clone();
        }
        for hosted in self.takeovers.hosted() {
            if hosted.streams.contains(name) {
                return hosted.streams.clone();
            }
        }
        self.streams.clone()
    }

    /// The live streams this process serves (its own and its hosted ids') that `request`
    /// asks for, in name order, within its limits; the second value says whether more
    /// matched.
    ///
    /// A listing walks every stream this process holds: it runs on the blocking pool, one
    /// at a time, so listings cost the threads that serve requests nothing and take at most
    /// one core between them.
    pub(crate) async fn list_streams(
        self: &Arc<Self>,
        request: crate::stream::ListRequest,
    ) -> Result<(Vec<crate::stream::StreamSummary>, bool), StreamError> {
        // The turn goes with the walk: a listing given up meanwhile does not end its turn
        // before its walk does.
        let turn = Arc::clone(&self.listings)
            .acquire_owned()
            .await
            .map_err(|e| StreamError::Task(e.to_string()))?;
        let db = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let listed = db.list_streams_now(&request);
            drop(turn);
            listed
        })
        .await
        .map_err(|e| StreamError::Task(format!("listing streams: {e}")))
    }

    fn list_streams_now(
        &self,
        request: &crate::stream::ListRequest,
    ) -> (Vec<crate::stream::StreamSummary>, bool) {
        let mut listings = Vec::new();
        if !self.node.is_fenced() {
            listings.push(self.streams.list(request));
        }
        for hosted in self.takeovers.hosted() {
            listings.push(hosted.streams.list(request));
        }
        crate::stream::merge_listings(
            listings,
            request.limit,
            request.max_producers,
            |s| &s.name,
            |s| s.producers.len(),
        )
    }

    /// Resolves once this node was fenced under object-store durability: another process
    /// took its id over (it could not renew its lease in time), so it serves nothing of its
    /// own any more and should exit; restarted, it starts under a new id. Never resolves
    /// under other durabilities.
    pub async fn fenced(&self) {
        if self.config.durability != Durability::ObjectStore {
            return std::future::pending().await;
        }
        while !self.node.is_fenced() {
            tokio::time::sleep(self.node.heartbeat_interval()).await;
        }
    }

    /// How long a node may go without renewing its heartbeat before it is taken over.
    pub(crate) fn node_lease(&self) -> std::time::Duration {
        self.config.node_lease
    }

    /// The hosted id whose engine holds stream `name`, when this node's own does not.
    pub(crate) fn hosted_id_of(&self, name: &str) -> Option<String> {
        if self.streams.contains(name) {
            return None;
        }
        self.takeovers
            .hosted()
            .iter()
            .find(|h| h.streams.contains(name))
            .map(|h| h.node.id().to_owned())
    }

    /// Whether this process hosts node id `id` (took it over and still holds it).
    pub(crate) fn hosts_node(&self, id: &str) -> bool {
        self.takeovers.hosts(id)
    }

    /// Whether hosted node id `id` holds stream `name`.
    pub(crate) fn hosted_stream(&self, id: &str, name: &str) -> bool {
        self.takeovers
            .hosted()
            .iter()
            .any(|h| h.node.id() == id && h.streams.contains(name))
    }

    /// Whether stream `name` is served by this process (its own or a hosted id's).
    pub(crate) fn serves_stream(&self, name: &str) -> bool {
        // A fenced node's streams are another process's now: asking the peers finds it.
        (self.streams.contains(name) && !self.node.is_fenced())
            || self
                .takeovers
                .hosted()
                .iter()
                .any(|h| h.streams.contains(name))
    }

    /// The URLs of the live peers (object-store durability), from their heartbeats.
    pub(crate) fn peer_urls(&self) -> Vec<String> {
        if self.config.durability != Durability::ObjectStore {
            return Vec::new();
        }
        self.takeovers
            .peer_urls
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The peer URL stream `name` was last found at, if found within a lease.
    pub(crate) fn cached_stream_owner(&self, name: &str) -> Option<String> {
        let owners = self
            .takeovers
            .owners
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        owners
            .get(name)
            .filter(|(_, at)| at.elapsed() < self.config.node_lease)
            .map(|(url, _)| url.clone())
    }

    /// Remembers (or, with `None`, forgets) where stream `name` is served.
    pub(crate) fn note_stream_owner(&self, name: &str, url: Option<&str>) {
        let mut owners = self
            .takeovers
            .owners
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match url {
            Some(url) => {
                // Bounded: names come from clients.
                if owners.len() >= 100_000 {
                    owners.clear();
                }
                owners.insert(name.to_owned(), (url.to_owned(), Instant::now()));
            }
            None => {
                owners.remove(name);
            }
        }
    }

    /// The ids this process took over and serves.
    pub fn hosted_ids(&self) -> Vec<String> {
        self.takeovers
            .hosted()
            .iter()
            .map(|h| h.node.id().to_owned())
            .collect()
    }

    /// One pass of the watch over peers: takes over every peer whose log is in the object
    /// store and whose heartbeat stood still for a whole lease. Only under object-store
    /// durability; errors are retried at the next pass.
    pub async fn take_over_dead_nodes(&self) {
        if self.config.durability != Durability::ObjectStore || self.node.is_fenced() {
            return;
        }
        let mut last_pass = self.takeovers.pass.lock().await;
        for id in self.takeovers.drop_fenced() {
            self.subscriptions.detach(&id, false).await;
        }
        let lease = self.config.node_lease;
        let started = Instant::now();
        let read = peer_beats(&self.storage).await;
        // A watcher that could not look for a while (the store stalled or failed, or this
        // process was paused or starved) cannot tell a dead peer from one that could not
        // write either: every peer's lease starts again.
        let blind = last_pass.is_none_or(|at| started.duration_since(at) > lease * 3 / 4)
            || started.elapsed() > lease / 2;
        *last_pass = Some(started);
        if read.is_err() || blind {
            self.takeovers
                .watched
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
        }
        let beats = match read {
            Ok(beats) => beats,
            Err(e) => {
                tracing::debug!(error = %e, "reading peer heartbeats failed; retrying later");
                return;
            }
        };
        let mut urls: Vec<String> = beats
            .iter()
            .filter(|b| b.wal && !b.retired && b.id != self.node.id())
            .filter_map(|b| b.url.clone())
            .filter(|u| Some(u) != self.config.advertise_url.as_ref())
            .collect();
        urls.sort();
        urls.dedup();
        *self
            .takeovers
            .peer_urls
            .write()
            .unwrap_or_else(|p| p.into_inner()) = urls;
        let candidates: Vec<PeerBeat> = beats
            .into_iter()
            .filter(|b| {
                b.wal && !b.retired && b.id != self.node.id() && !self.takeovers.hosts(&b.id)
            })
            .collect();
        for (beat, epoch) in self.takeovers.due(candidates, self.config.node_lease) {
            let id = beat.id.clone();
            match self.take_over(&id, epoch).await {
                Ok(true) => tracing::info!(node = %id, "took over a dead node's log"),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(node = %id, error = %e, "taking over a dead node failed; retrying later");
                }
            }
        }
    }

    /// Takes node `id` over (see the module docs); `false` when another process claimed it
    /// first.
    async fn take_over(&self, id: &str, dead_epoch: u64) -> Result<bool, OpenError> {
        let lease = self.config.node_lease;
        let Some(node) =
            Node::take_over(self.storage.clone(), id, dead_epoch, lease, self.node.id()).await?
        else {
            self.takeovers.claimed_meanwhile(id, dead_epoch + 1);
            return Ok(false);
        };
        if let Some(url) = &self.config.advertise_url {
            node.set_url(url);
        }
        let node = Arc::new(node);
        // The id's heartbeat moves while its log is read back and replayed; the beat stops
        // as this function returns.
        let _beating = crate::node::keep_beating(node.clone());
        let (remote, replay) = recover_remote(self.storage.store().clone(), id, node.epoch())
            .await
            .map_err(NodeError::from)?;
        let dir = self
            .config
            .data_dir
            .join("hosted")
            .join(format!("{id}-{}", node.epoch()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|source| OpenError::DataDir {
                path: dir.display().to_string(),
                source,
            })?;
        }
        let mut log_config = LogConfig::new(dir.join("log"));
        log_config.durability = Durability::ObjectStore;
        log_config.max_log_bytes = self.config.max_log_bytes;
        log_config.segment_bytes = self.config.log_segment_bytes;
        log_config.consumers = vec!["tables".into(), "streams".into()];
        let (log, _) = CommitLog::open(log_config)?;
        log.attach_remote(remote, lease / 2);
        let opened = async {
            log.advance_to(node.lsn_base()).await?;
            // The newest catalog: a table the dead node wrote to may have been dropped since.
            self.catalog.reload().await?;
            let live = self.catalog.storage_ids().await;
            let tables = Arc::new(
                Tables::open_observed(
                    log.clone(),
                    &replay,
                    self.storage.clone(),
                    node.clone(),
                    self.config.tables.clone(),
                    self.config.gc_grace,
                    Some(&live),
                    Some(Arc::new(self.iceberg_views())),
                )
                .await?,
            );
            // The dead node's rows go to their tables now, under its position in each
            // manifest: a batch it flushed already is skipped.
            tables.flush_due(true).await?;
            let streams = Streams::open(
                log.clone(),
                &replay,
                self.storage.clone(),
                node.clone(),
                self.config.streams.clone(),
            )
            .await?;
            Ok::<_, OpenError>((tables, streams))
        }
        .await;
        let (tables, streams) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                log.close();
                return Err(e);
            }
        };
        let subscriptions = match self.subscriptions.load(node.clone()).await {
            Ok(loaded) => loaded,
            Err(e) => {
                log.close();
                return Err(OpenError::Subscriptions(e.to_string()));
            }
        };
        if streams.len() == 0 && subscriptions.is_empty() {
            // Nothing left to serve: the id is retired, and its log released.
            let _ = streams.checkpoint(true).await;
            log.close();
            node.retire(log.last_lsn()).await?;
            let _ = std::fs::remove_dir_all(&dir);
            return Ok(true);
        }
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let hosted = Arc::new(Hosted {
            node: node.clone(),
            log: log.clone(),
            tables: tables.clone(),
            streams: streams.clone(),
            stop,
            dir,
        });
        let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let tick = self.config.maintenance_interval;
        tokio::spawn(
            tables
                .clone()
                .run_maintenance(tick, stopped(stop_rx.clone())),
        );
        tokio::spawn(
            streams
                .clone()
                .run_maintenance(tick, stopped(stop_rx.clone())),
        );
        tokio::spawn(crate::node::run_heartbeat(
            node.clone(),
            log.clone(),
            stopped(stop_rx),
        ));
        // Subscriptions watch the engine before it takes any append through this process
        // (hosting it routes requests to it): no change falls before where they start.
        self.subscriptions.attach(subscriptions, streams);
        self.takeovers
            .hosted
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(hosted);
        Ok(true)
    }

    /// Garbage collection of the hosted ids' streams.
    pub(super) async fn collect_hosted_garbage(&self) -> Result<crate::storage::GcReport, String> {
        let mut report = crate::storage::GcReport::default();
        for hosted in self.takeovers.hosted() {
            if hosted.node.is_fenced() {
                continue;
            }
            report.add(
                hosted
                    .streams
                    .collect_garbage(self.config.gc_grace)
                    .await
                    .map_err(|e| e.to_string())?,
            );
        }
        Ok(report)
    }

    /// Seals, flushes and releases every hosted id (part of [`Database::shutdown`]).
    pub(super) async fn release_hosted(&self) {
        let hosted: Vec<Arc<Hosted>> = std::mem::take(
            &mut *self
                .takeovers
                .hosted
                .write()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for h in hosted {
            let _ = h.stop.send(true);
            self.subscriptions.detach(h.node.id(), true).await;
            if let Err(e) = h.streams.checkpoint(true).await {
                tracing::warn!(node = %h.node.id(), error = %e, "checkpoint of a hosted node at close failed (its log is in the object store)");
            }
            if let Err(e) = h.tables.flush_due(true).await {
                tracing::warn!(node = %h.node.id(), error = %e, "flush of a hosted node at close failed (its log is in the object store)");
            }
            h.streams.shutdown();
            h.log.close();
            if !h.node.is_fenced()
                && let Err(e) = h.node.heartbeat(h.log.last_lsn(), true).await
            {
                tracing::warn!(node = %h.node.id(), error = %e, "could not release a hosted node id");
            }
            let _ = std::fs::remove_dir_all(&h.dir);
        }
    }
}
