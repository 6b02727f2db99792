//! A node's identity, claimed in object storage so that it can be neither lost nor shared.
//!
//! A node is one data directory. Its id names its commit-log positions in table manifests
//! (`flushed[node]`) and its stream objects, so two processes must never write under one id,
//! and a directory must never silently change its id while its log holds records.
//!
//! - **Local identity.** `node.json` in the data directory holds the id and the epoch the
//!   directory last claimed; it is written with fsync of the file and the directory before it
//!   is used. A missing, empty or unreadable identity beside a log that holds records refuses
//!   to start ([`NodeError::MissingIdentity`]): a new id would replay records already flushed
//!   under the old one. The commit log locks the directory while a process uses it, and a
//!   node claims its id only with the log open.
//! - **Claims.** Each start claims the next *epoch* of the id with a conditional create of
//!   `nodes/{id}/epochs/{epoch:020}.json`: two processes cannot claim the same epoch. A
//!   directory whose id has been claimed by a later epoch than its own was superseded (a
//!   copy of it, or it was replaced) and refuses to start ([`NodeError::Superseded`]).
//! - **Liveness.** The owner of an epoch writes `nodes/{id}/heartbeat.json` every quarter of
//!   the lease; before claiming, a start waits until the last owner is known gone: it shut
//!   down cleanly, or it is this directory's own previous run on this boot of this machine
//!   (the directory lock proves it dead), or its heartbeat stays still for a whole lease. A
//!   heartbeat that moves means another live process holds the id
//!   ([`NodeError::InUse`]): a copied data directory is refused, never merged. A directory
//!   whose log ends before the last position its id is known to have made durable is a stale
//!   copy and is refused ([`NodeError::StaleCopy`]).
//! - **Fencing.** A running node checks, at every heartbeat and before every manifest commit
//!   and stream snapshot, that no later epoch exists; once one does it is fenced: its log
//!   refuses appends and it commits nothing more.
//! - **LSN spaces.** Epoch `e` appends from LSN `e << 48`, so records written by two
//!   copies of one directory in different epochs never share an LSN, and a flushed position
//!   of one epoch never covers another epoch's records.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt as _, PutPayload};
use serde::{Deserialize, Serialize};

use crate::error::{Cause, Classify, ErrorClass, Kind};
use crate::log::{EPOCH_SHIFT, Lsn, lsn_base};
use crate::storage::journal::SyncJournal;
use crate::storage::versioned::{Tagged, VersionError, VersionLog};
use crate::storage::{Storage, paths};

/// A file `sluice repair` leaves in the data directory: the log was cut on purpose, so the
/// next start does not take it for a stale copy.
pub const REPAIRED_MARKER: &str = "REPAIRED";

/// Why a node could not take its identity.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A file of the data directory could not be read or written.
    #[error("node identity file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The log holds records but the node's identity is gone.
    #[error(
        "data directory {dir}: the commit log holds records but node.json is {problem}; \
         starting under a new id would apply flushed records twice. Restore node.json (the \
         ids this store knows are under nodes/ in the object store), or move the log \
         directory aside to start empty (its unflushed records are then not applied)"
    )]
    MissingIdentity {
        /// The data directory.
        dir: String,
        /// What is wrong with the identity file.
        problem: String,
    },
    /// A later epoch of this id was claimed after this directory last ran.
    #[error(
        "node {id} was taken over by another process (epoch {latest}) after this data \
         directory last ran (epoch {local}): this directory is an old copy or was replaced, \
         and its log is not applied. Start the directory that claimed epoch {latest} instead; \
         keep this one until you have checked that nothing it holds is needed"
    )]
    Superseded {
        /// The node id.
        id: String,
        /// This directory's epoch.
        local: u64,
        /// The latest claimed epoch.
        latest: u64,
    },
    /// A live process holds the id.
    #[error(
        "node {id} is in use by another running process (its heartbeat moved {ago_ms} ms ago); \
         was this data directory copied? A copy needs its own node.json"
    )]
    InUse {
        /// The node id.
        id: String,
        /// How long ago its heartbeat was written.
        ago_ms: u64,
    },
    /// The log ends before a position the node made durable.
    #[error(
        "data directory {dir}: its log ends at LSN {log_last}, but node {id} had made LSN \
         {known} durable, so acknowledged writes are missing from it: either this is an older \
         copy of the node's directory (start the newest copy instead, and keep this one: its \
         unflushed writes live only in its log), or records were cut from its log (a disk \
         fault; `sluice repair --data-dir DIR` accepts the shorter log, losing what was cut, \
         and the next start goes ahead)"
    )]
    StaleCopy {
        /// The data directory.
        dir: String,
        /// The node id.
        id: String,
        /// The log's last LSN.
        log_last: Lsn,
        /// The last durable LSN the node reported.
        known: Lsn,
    },
    /// The directory claimed its id in an object store that is not this one.
    #[error(
        "node {id} (epoch {epoch}) has no claim in this object store: is --object-store the \
         store this data directory ran with? Its log is not applied here"
    )]
    UnknownToStore {
        /// The node id.
        id: String,
        /// This directory's epoch.
        epoch: u64,
    },
    /// Too many restarts for the LSN space.
    #[error("node {0} has used every epoch; start it with a new data directory")]
    EpochsExhausted(String),
    /// This node was fenced.
    #[error("node {0} was fenced: another process took over its id")]
    Fenced(String),
    /// Object storage failed.
    #[error("object store error while claiming the node identity: {0}")]
    Storage(#[from] object_store::Error),
}

impl Classify for NodeError {
    fn class(&self) -> ErrorClass {
        match self {
            NodeError::Fenced(_) => ErrorClass {
                retry_after: None,
                ..ErrorClass::retry(Cause::Fenced)
            },
            NodeError::Storage(_) => ErrorClass::retry(Cause::StorageUnavailable),
            _ => ErrorClass::rejected(Kind::Internal),
        }
    }
}

/// The identity file.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LocalIdentity {
    id: String,
    epoch: u64,
}

/// An epoch claim object.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Claim {
    epoch: u64,
    token: String,
    claimed_at_ms: u64,
    /// The claimer's machine boot and data directory (empty for a takeover, and in claims
    /// of older versions): a start that finds its own directory's claim of this boot with
    /// no heartbeat after it knows that claimer is dead (it holds the directory's lock).
    #[serde(default)]
    boot: String,
    #[serde(default)]
    dir: String,
}

impl Tagged for Claim {
    fn tag(&self) -> &str {
        &self.token
    }
}

/// The heartbeat object.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Heartbeat {
    epoch: u64,
    at_ms: u64,
    /// The owner shut down cleanly.
    released: bool,
    /// The last LSN the owner had made durable.
    last_lsn: Lsn,
    /// The owner's machine boot and data directory.
    boot: String,
    dir: String,
    /// The owner writes its log to the object store (`durability = "object-store"`): once
    /// it is gone, another node may take its log over.
    #[serde(default)]
    wal: bool,
    /// Nothing of this id is left to take over: no stream, no record to replay.
    #[serde(default)]
    retired: bool,
    /// Where the process serving the id answers (stream requests are forwarded there).
    #[serde(default)]
    url: Option<String>,
}

/// What a starting node knows of its log.
#[derive(Debug, Clone, Copy)]
pub struct LogState {
    /// Whether the log holds any record.
    pub has_records: bool,
    /// Its last LSN (0 when empty).
    pub last_lsn: Lsn,
    /// Whether its records are fsynced before they count (then a shorter log than the last
    /// heartbeat reported means a stale copy).
    pub synced: bool,
    /// Whether its groups are written to the object store before they count
    /// (`durability = "object-store"`): then other nodes may take the id over once its
    /// heartbeat stops.
    pub remote: bool,
}

/// This process's ownership of a node id.
pub struct Node {
    id: String,
    epoch: u64,
    storage: Storage,
    lease: Duration,
    boot: String,
    dir: String,
    /// The log is written to the object store.
    wal: bool,
    /// Where this process answers, for peers that forward stream requests.
    url: std::sync::OnceLock<String>,
    fenced: AtomicBool,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.id)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// This machine's current boot (Linux: the kernel's boot id); empty when unknown, and then
/// no earlier owner is taken for this directory's own previous run.
fn boot_id() -> String {
    // A test build can play a reboot (after a simulated power loss).
    #[cfg(feature = "testing")]
    if let Ok(boot) = std::env::var("SLUICE_TEST_BOOT_ID") {
        return boot;
    }
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// What tells this data directory from a copy of it: its path together with the device and
/// inode of the directory itself. A copy (another directory on this machine, or one mounted
/// at the same path in another container) has other ones; the same directory after a
/// restart has the same. Empty when unknown: then no earlier owner is taken for this
/// directory's own previous run.
fn directory_identity(data_dir: &Path) -> String {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(path) = std::fs::canonicalize(data_dir) else {
        return String::new();
    };
    match std::fs::metadata(&path) {
        Ok(meta) => format!("{}@{}:{}", path.display(), meta.dev(), meta.ino()),
        Err(_) => String::new(),
    }
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> NodeError + '_ {
    move |source| NodeError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Writes `bytes` to `path` durably: a temporary file, fsynced, renamed into place, and the
/// directory fsynced.
pub(crate) fn write_durably(
    path: &Path,
    bytes: &[u8],
    journal: Option<&SyncJournal>,
) -> std::io::Result<()> {
    use std::io::Write as _;
    if let Some(journal) = journal {
        journal.check_alive()?;
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)?;
    if let Some(journal) = journal {
        journal.created(path);
        journal.synced(path, bytes.len() as u64);
    }
    std::fs::File::open(dir)?.sync_all()?;
    if let Some(journal) = journal {
        journal.dir_synced(dir);
    }
    Ok(())
}

/// A failed claim, as the node's error.
fn claim_error(e: VersionError) -> NodeError {
    match e {
        VersionError::Storage(e) => NodeError::Storage(e),
        e @ (VersionError::Corrupt { .. } | VersionError::BelowFloor { .. }) => {
            NodeError::Storage(object_store::Error::Generic {
                store: "claims",
                source: e.to_string().into(),
            })
        }
    }
}

fn claim_path(id: &str, epoch: u64) -> ObjectPath {
    VersionLog::new(paths::node_epochs(id)).path(epoch)
}

fn heartbeat_path(id: &str) -> ObjectPath {
    ObjectPath::from(paths::node_heartbeat(id))
}

/// Reads a JSON object; `None` when it does not exist (or cannot be parsed: an object that
/// is not ours proves nothing).
async fn read_json<T: for<'de> Deserialize<'de>>(
    storage: &Storage,
    path: &ObjectPath,
) -> Result<Option<T>, object_store::Error> {
    match storage.store().get(path).await {
        Ok(r) => Ok(serde_json::from_slice(&r.bytes().await?).ok()),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The latest epoch claimed for `id`.
async fn latest_epoch(storage: &Storage, id: &str) -> Result<Option<u64>, object_store::Error> {
    match VersionLog::new(paths::node_epochs(id))
        .list(storage.store().as_ref())
        .await
    {
        Ok(listing) => Ok(listing.latest()),
        Err(VersionError::Storage(e)) => Err(e),
        Err(VersionError::Corrupt { .. } | VersionError::BelowFloor { .. }) => Ok(None),
    }
}

/// Reads the directory's identity: `Ok(None)` when there is none, an error string when it is
/// there but unusable. A `node_id` file of older versions is read as epoch 0.
fn read_local(data_dir: &Path) -> Result<Option<LocalIdentity>, String> {
    let path = data_dir.join("node.json");
    match std::fs::read(&path) {
        Ok(bytes) => {
            let identity: LocalIdentity =
                serde_json::from_slice(&bytes).map_err(|e| format!("unreadable ({e})"))?;
            if identity.id.is_empty() || !valid_id(&identity.id) {
                return Err("holding no valid id".into());
            }
            return Ok(Some(identity));
        }
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(format!("unreadable ({e})"));
        }
        Err(_) => {}
    }
    match std::fs::read_to_string(data_dir.join("node_id")) {
        Ok(text) if valid_id(text.trim()) => Ok(Some(LocalIdentity {
            id: text.trim().to_owned(),
            epoch: 0,
        })),
        Ok(_) => Err("missing, and node_id is empty or invalid".into()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("missing, and node_id is unreadable ({e})")),
    }
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl Node {
    /// Takes this data directory's node identity for a new epoch (see the module docs).
    /// `lease` is how long a silent heartbeat takes to mean its owner is gone. The caller
    /// holds the directory's commit log open (and so its lock).
    pub async fn claim(
        data_dir: &Path,
        storage: Storage,
        log: LogState,
        lease: Duration,
        journal: Option<&SyncJournal>,
    ) -> Result<Node, NodeError> {
        let dir = directory_identity(data_dir);
        let (id, local_epoch) = match read_local(data_dir) {
            Ok(Some(identity)) => (identity.id, Some(identity.epoch)),
            Ok(None) if !log.has_records => (uuid::Uuid::new_v4().simple().to_string(), None),
            Ok(None) => {
                return Err(NodeError::MissingIdentity {
                    dir,
                    problem: "missing".into(),
                });
            }
            Err(problem) if log.has_records => {
                return Err(NodeError::MissingIdentity { dir, problem });
            }
            // Nothing to replay: whatever was there, start afresh.
            Err(_) => (uuid::Uuid::new_v4().simple().to_string(), None),
        };
        let boot = boot_id();
        let latest = latest_epoch(&storage, &id).await?;
        if latest.is_none() && local_epoch.is_some_and(|e| e > 0) && log.has_records {
            // This directory claimed its id in a store; this store has never seen it.
            return Err(NodeError::UnknownToStore {
                id,
                epoch: local_epoch.unwrap_or(0),
            });
        }
        // `sluice repair` cut records out of the log: it is shorter than what the node had
        // made durable, on purpose.
        let repaired_marker = data_dir.join(REPAIRED_MARKER);
        let repaired = repaired_marker.exists();
        if let Some(latest) = latest {
            let superseded = match local_epoch {
                Some(local) => latest > local,
                None => true,
            };
            if superseded && log.has_records {
                return Err(NodeError::Superseded {
                    id,
                    local: local_epoch.unwrap_or(0),
                    latest,
                });
            }
            let last = wait_until_gone(&storage, &id, latest, &boot, &dir, lease).await?;
            if let Some(known) = last
                && log.synced
                && !superseded
                && !repaired
                && known > log.last_lsn
            {
                return Err(NodeError::StaleCopy {
                    dir,
                    id,
                    log_last: log.last_lsn,
                    known,
                });
            }
        }
        // The next epoch; when this directory recorded an epoch whose claim never landed,
        // that one (no epoch is skipped: a skipped epoch would fence no one).
        let epoch = match (latest, local_epoch) {
            (Some(l), Some(local)) if local == l + 1 => local,
            _ => latest.max(local_epoch).unwrap_or(0) + 1,
        };
        if epoch >= 1 << (64 - EPOCH_SHIFT) {
            return Err(NodeError::EpochsExhausted(id));
        }
        // The directory records the epoch before it is claimed: if the process dies between
        // the two, the next start finds its own claim (or none), never a stranger's.
        let identity = serde_json::to_vec(&LocalIdentity {
            id: id.clone(),
            epoch,
        })
        .unwrap_or_default();
        let identity_path = data_dir.join("node.json");
        write_durably(&identity_path, &identity, journal).map_err(io_error(&identity_path))?;
        let claim = Claim {
            epoch,
            token: uuid::Uuid::new_v4().simple().to_string(),
            claimed_at_ms: now_ms(),
            boot: boot.clone(),
            dir: dir.clone(),
        };
        // The versioned-object protocol: a conditional create, settled by the tag on an
        // ambiguous answer.
        let claimed = VersionLog::new(paths::node_epochs(&id))
            .try_create(storage.store().as_ref(), epoch, &claim)
            .await
            .map_err(claim_error)?;
        if !claimed {
            return Err(NodeError::InUse { id, ago_ms: 0 });
        }
        if repaired {
            let _ = std::fs::remove_file(&repaired_marker);
        }
        let node = Node {
            id,
            epoch,
            storage,
            lease,
            boot,
            dir,
            wal: log.remote,
            url: std::sync::OnceLock::new(),
            fenced: AtomicBool::new(false),
        };
        node.heartbeat(log.last_lsn, false).await?;
        Ok(node)
    }

    /// Takes over node `id` for this process, whose owner of epoch `dead_epoch` is gone (its
    /// heartbeat stood still for a lease): claims exactly the next epoch, which fences every
    /// earlier owner. `None` when another process claimed that epoch first (another taker, or
    /// the owner restarting): then the heartbeat seen was stale, and nothing is taken.
    /// `host` names this process in the heartbeat.
    pub(crate) async fn take_over(
        storage: Storage,
        id: &str,
        dead_epoch: u64,
        lease: Duration,
        host: &str,
    ) -> Result<Option<Node>, NodeError> {
        if !valid_id(id) {
            return Ok(None);
        }
        let epoch = dead_epoch + 1;
        if epoch >= 1 << (64 - EPOCH_SHIFT) {
            return Err(NodeError::EpochsExhausted(id.to_owned()));
        }
        let claim = Claim {
            epoch,
            token: uuid::Uuid::new_v4().simple().to_string(),
            claimed_at_ms: now_ms(),
            boot: String::new(),
            dir: String::new(),
        };
        let claimed = VersionLog::new(paths::node_epochs(id))
            .try_create(storage.store().as_ref(), epoch, &claim)
            .await
            .map_err(claim_error)?;
        if !claimed {
            return Ok(None);
        }
        let node = Node {
            id: id.to_owned(),
            epoch,
            storage,
            lease,
            boot: boot_id(),
            dir: format!("hosted by {host}"),
            wal: true,
            url: std::sync::OnceLock::new(),
            fenced: AtomicBool::new(false),
        };
        node.heartbeat(0, false).await?;
        Ok(Some(node))
    }

    /// Names where this process answers in the id's heartbeats from now on.
    pub(crate) fn set_url(&self, url: &str) {
        let _ = self.url.set(url.to_owned());
    }

    /// The epoch this process claimed.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Writes the heartbeat of an id nothing is left of: no node takes it over again.
    pub(crate) async fn retire(&self, last_lsn: Lsn) -> Result<(), NodeError> {
        self.write_heartbeat(last_lsn, true, true).await
    }

    /// The node id.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// The first LSN of this epoch's appends.
    pub fn lsn_base(&self) -> Lsn {
        lsn_base(self.epoch)
    }

    /// How often the heartbeat runs.
    pub(crate) fn heartbeat_interval(&self) -> Duration {
        (self.lease / 4).max(Duration::from_millis(10))
    }

    /// Whether this node was fenced.
    pub(crate) fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::Acquire)
    }

    /// Checks that this process still owns the id: no later epoch was claimed. Fails (and
    /// fences the node for good) when one was. Callers check before committing anything
    /// other nodes or a restart will read.
    pub(crate) async fn ensure_current(&self) -> Result<(), NodeError> {
        if self.is_fenced() {
            return Err(NodeError::Fenced(self.id.clone()));
        }
        let next = claim_path(&self.id, self.epoch + 1);
        let claimed = match self.storage.store().head(&next).await {
            Ok(_) => true,
            Err(object_store::Error::NotFound { .. }) => false,
            Err(e) => return Err(e.into()),
        };
        // The next claim may be gone (garbage collection keeps only the latest ones after a
        // long pause of this process): a later owner's heartbeat says so too.
        let later_heartbeat = read_json::<Heartbeat>(&self.storage, &heartbeat_path(&self.id))
            .await?
            .is_some_and(|h| h.epoch > self.epoch);
        if claimed || later_heartbeat {
            self.fenced.store(true, Ordering::Release);
            tracing::error!(
                node = %self.id,
                epoch = self.epoch,
                "another process claimed this node id; this node stops writing"
            );
            return Err(NodeError::Fenced(self.id.clone()));
        }
        Ok(())
    }

    /// Checks ownership and writes the heartbeat (`released` at a clean shutdown).
    pub(crate) async fn heartbeat(&self, last_lsn: Lsn, released: bool) -> Result<(), NodeError> {
        self.write_heartbeat(last_lsn, released, false).await
    }

    async fn write_heartbeat(
        &self,
        last_lsn: Lsn,
        released: bool,
        retired: bool,
    ) -> Result<(), NodeError> {
        self.ensure_current().await?;
        let beat = Heartbeat {
            epoch: self.epoch,
            at_ms: now_ms(),
            released,
            last_lsn,
            boot: self.boot.clone(),
            dir: self.dir.clone(),
            wal: self.wal,
            retired,
            url: self.url.get().cloned(),
        };
        let body = serde_json::to_vec(&beat).unwrap_or_default();
        self.storage
            .store()
            .put(&heartbeat_path(&self.id), PutPayload::from(body))
            .await?;
        Ok(())
    }
}

impl Node {
    /// Deletes this id's claims older than the previous epoch once older than `grace` (the
    /// latest claims are what a starting process compares itself with).
    pub(crate) async fn collect_garbage(
        &self,
        grace: Duration,
    ) -> Result<crate::storage::GcReport, NodeError> {
        use futures::TryStreamExt as _;
        let mut report = crate::storage::GcReport::default();
        let cutoff = crate::storage::gc::cutoff(grace);
        let listed: Vec<object_store::ObjectMeta> = self
            .storage
            .store()
            .list(Some(&ObjectPath::from(paths::node_epochs(&self.id))))
            .try_collect()
            .await?;
        for meta in listed {
            let epoch: Option<u64> = meta
                .location
                .filename()
                .and_then(|n| n.strip_suffix(".json"))
                .and_then(|n| n.parse().ok());
            if epoch.is_some_and(|e| e + 1 < self.epoch)
                && meta.last_modified < cutoff
                && self.storage.store().delete(&meta.location).await.is_ok()
            {
                report.objects += 1;
                report.bytes += meta.size;
            }
        }
        Ok(report)
    }
}

/// Waits until the owner of `epoch` is known to be gone; returns the last LSN it reported.
async fn wait_until_gone(
    storage: &Storage,
    id: &str,
    epoch: u64,
    boot: &str,
    dir: &str,
    lease: Duration,
) -> Result<Option<Lsn>, NodeError> {
    let Some(first) = read_json::<Heartbeat>(storage, &heartbeat_path(id)).await? else {
        return Ok(None);
    };
    if first.epoch != epoch {
        // The owner of the latest epoch never wrote a heartbeat: it died while claiming,
        // or it is claiming now; give it a lease to show itself, unless it is this
        // directory's own previous run on this boot (killed between its claim and its first
        // heartbeat: the lock we hold proves it is no longer running).
        if first.epoch > epoch {
            return Ok(Some(first.last_lsn));
        }
        let claim = VersionLog::new(paths::node_epochs(id))
            .read::<Claim>(storage.store().as_ref(), epoch)
            .await
            .map_err(claim_error)?;
        if claim
            .is_some_and(|c| !boot.is_empty() && !dir.is_empty() && c.boot == boot && c.dir == dir)
        {
            return Ok(Some(first.last_lsn));
        }
    } else if first.released
        || (!boot.is_empty() && !dir.is_empty() && first.boot == boot && first.dir == dir)
    {
        // A clean shutdown, or this directory's own previous run on this boot (the lock
        // we hold proves it is no longer running).
        return Ok(Some(first.last_lsn));
    }
    tracing::warn!(
        node = %id,
        epoch,
        lease_ms = lease.as_millis() as u64,
        "the last owner of this node id may still be running: waiting up to a lease for its \
         heartbeat to stand still"
    );
    let started = Instant::now();
    let poll = (lease / 8).max(Duration::from_millis(10));
    while started.elapsed() < lease {
        tokio::time::sleep(poll).await;
        let now = read_json::<Heartbeat>(storage, &heartbeat_path(id)).await?;
        if let Some(now) = now
            && (now.at_ms != first.at_ms || now.epoch != first.epoch)
        {
            if now.released && now.epoch == epoch {
                return Ok(Some(now.last_lsn));
            }
            return Err(NodeError::InUse {
                id: id.to_owned(),
                ago_ms: now_ms().saturating_sub(now.at_ms),
            });
        }
    }
    Ok((first.epoch == epoch).then_some(first.last_lsn))
}

/// Runs the heartbeat until `shutdown` resolves; fences `log` when the node loses its id.
pub(crate) async fn run_heartbeat(
    node: Arc<Node>,
    log: crate::log::CommitLog,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let tick = node.heartbeat_interval();
    crate::every(tick, shutdown, || {
        let node = node.clone();
        let log = log.clone();
        async move {
            let started = Instant::now();
            match node.heartbeat(log.last_lsn(), false).await {
                // Acknowledge for half a lease from before the renewal: the heartbeat other
                // nodes saw is at least that old, and they wait a whole lease after it.
                Ok(()) => log.renew_lease(started + node.lease / 2),
                Err(NodeError::Fenced(_)) => log.fence(),
                Err(e) => tracing::warn!(error = %e, "node heartbeat failed; retrying"),
            }
        }
    })
    .await;
}

/// Keeps `node`'s heartbeat moving until the returned sender is dropped: while a log is
/// read back and replayed (at a start, or a takeover), which may take longer than a lease,
/// so that no watcher takes the id over meanwhile. The beats carry no LSN; only
/// object-store durability uses this (it does not compare heartbeat LSNs with the log).
pub(crate) fn keep_beating(node: Arc<Node>) -> tokio::sync::watch::Sender<()> {
    let (beating, mut stopped) = tokio::sync::watch::channel(());
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stopped.changed() => break,
                _ = tokio::time::sleep(node.heartbeat_interval()) => {
                    let _ = node.heartbeat(0, false).await;
                }
            }
        }
    });
    beating
}

/// What a node watching its peers reads of one node id's heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerBeat {
    /// The id.
    pub(crate) id: String,
    /// The epoch that wrote the heartbeat, and when (by its writer's clock: compared only
    /// with itself, never with ours).
    pub(crate) epoch: u64,
    pub(crate) at_ms: u64,
    /// The id's log is in the object store, so it can be taken over.
    pub(crate) wal: bool,
    /// Nothing of the id is left to take over.
    pub(crate) retired: bool,
    /// Where the process serving the id answers.
    pub(crate) url: Option<String>,
}

/// The heartbeat of every node id in the store.
pub(crate) async fn peer_beats(storage: &Storage) -> Result<Vec<PeerBeat>, object_store::Error> {
    let listed = storage
        .store()
        .list_with_delimiter(Some(&ObjectPath::from("nodes")))
        .await?;
    let ids: Vec<String> = listed
        .common_prefixes
        .iter()
        .filter_map(|prefix| prefix.filename().filter(|id| valid_id(id)))
        .map(str::to_owned)
        .collect();
    // Read at once, so a pass stays short however many ids the bucket has seen.
    use futures::{StreamExt as _, TryStreamExt as _};
    let beats: Vec<Option<PeerBeat>> = futures::stream::iter(ids)
        .map(|id| async move { peer_beat(storage, &id).await })
        .buffer_unordered(16)
        .try_collect()
        .await?;
    Ok(beats.into_iter().flatten().collect())
}

/// The heartbeat of node id `id`, if it has one.
pub(crate) async fn peer_beat(
    storage: &Storage,
    id: &str,
) -> Result<Option<PeerBeat>, object_store::Error> {
    Ok(read_json::<Heartbeat>(storage, &heartbeat_path(id))
        .await?
        .map(|beat| PeerBeat {
            id: id.to_owned(),
            epoch: beat.epoch,
            at_ms: beat.at_ms,
            wal: beat.wal,
            retired: beat.retired,
            url: beat.url,
        }))
}
