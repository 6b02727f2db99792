//! Stream names owned across the cluster (`durability = "object-store"`).
//!
//! Under object-store durability any node serves any stream by forwarding to the process
//! that serves it (`http::forward`), so a name must belong to one node id in the whole
//! cluster: two nodes creating the same new name at the same moment must make one stream,
//! not two. Every name ever created there has a versioned object
//! (`stream-names/{sha256(name)}`, [`crate::storage::versioned`]) whose latest version names
//! the node id that owns it, or none:
//!
//! - A create claims the name before the stream is made ([`Database::claim_stream_name`]).
//!   A free name (no version, or a released one), or one whose owner id is retired (taken
//!   over with no stream left, so it holds nothing), is claimed by creating the next
//!   version: the conditional create settles races, so exactly one node wins. A name owned
//!   by this node's id, or by an id it hosts, is created here. A name owned by a live
//!   peer's id is created there: the request goes to the URL in that id's heartbeat, which
//!   names the process serving the id (its taker, after a takeover).
//! - A delete at the owner releases the name once the stream is gone
//!   ([`Database::release_stream_name`]).
//! - Creates and deletes of one name in one process run one at a time
//!   ([`Database::lock_stream_name`]), so a release never follows a create that came after
//!   its delete.
//!
//! - A version also names the incarnation of the stream it was claimed for, so other nodes
//!   can tell the stream in the owner's snapshot is the current one
//!   ([`Database::sealed_stream_owner`]). A create that makes a new stream under a claim of
//!   its own id writes a version with the new incarnation; a delete first writes one without
//!   ([`Database::name_stream_incarnation`]), so a stream deleted in any log is never
//!   named by its claim, and a snapshot older than the delete is never read for it.
//!
//! Invariants: a version names a node id, never a URL (the URL is looked up when used, so a
//! takeover moves every name of the id at once); a name is never taken from an id that is
//! not retired, except by the process that holds that id.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use object_store::ObjectStoreExt as _;
use ring::digest::{SHA256, digest};
use serde::{Deserialize, Serialize};

use super::Database;
use crate::error::{Cause, Classify, ErrorClass, Kind};
use crate::log::Durability;
use crate::node::{PeerBeat, peer_beat};
use crate::storage::paths;
use crate::storage::versioned::{Tagged, VersionError, VersionLog};
use crate::stream::SealedRead;

/// One version of a name's claim.
#[derive(Debug, Serialize, Deserialize)]
struct NameClaim {
    /// The attempt's random tag ([`Tagged`]).
    tag: String,
    /// The stream name (the object's path holds only its hash).
    name: String,
    /// The owning node id; `None` once released.
    node: Option<String>,
    /// The incarnation of the owner's stream of this name, when known: set by the create
    /// that made it, cleared before any delete of it (one that leaves it held for its forks
    /// included). Other nodes read the stream's sealed data only while the owner's snapshot
    /// holds this incarnation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    incarnation: Option<String>,
}

impl Tagged for NameClaim {
    fn tag(&self) -> &str {
        &self.tag
    }
}

/// A change to a claim of this process's ([`Database::change_own_claim`]).
#[derive(Debug, Clone, Copy)]
enum ClaimChange<'a> {
    /// The name is free: no owner, no incarnation.
    Release,
    /// The owner stays; the claim names this incarnation (or none).
    Incarnation(Option<&'a str>),
}

/// Where a stream of a claimed name is created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NamePlace {
    /// In this process.
    Here,
    /// At the peer answering at this URL.
    At(String),
}

/// Why a name could not be claimed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NameError {
    /// Object storage failed.
    #[error("stream name registry: {0}")]
    Storage(#[from] VersionError),
    /// The name's owner is between processes (dead and not yet taken over, or being taken
    /// over).
    #[error("stream name {name:?} belongs to node {node}, which is not answering now")]
    OwnerUnavailable {
        /// The name.
        name: String,
        /// Its owner.
        node: String,
    },
    /// Two names with the same SHA-256.
    #[error("stream names {0:?} and {1:?} collide")]
    Collision(String, String),
}

impl Classify for NameError {
    fn class(&self) -> ErrorClass {
        match self {
            // No stream was made: a claim that landed unseen is this node's, which a later
            // create here or anywhere (forwarded here) uses as its own.
            NameError::Storage(_) => ErrorClass::retry(Cause::StorageUnavailable),
            NameError::OwnerUnavailable { .. } => ErrorClass::retry(Cause::OwnerUnavailable),
            NameError::Collision(..) => ErrorClass::rejected(Kind::Conflict),
        }
    }
}

/// How many times a claim is retried after losing a race.
const CLAIM_ATTEMPTS: usize = 8;

/// How long a read that another node's snapshot did not answer is remembered.
const MISS_MEMORY: Duration = Duration::from_secs(1);

/// Names whose misses are remembered at most (names come from clients).
const MAX_MISSES: usize = 4096;

/// Where other nodes' snapshots stopped answering reads of a stream lately, by its name: a
/// read from that offset on, within [`MISS_MEMORY`], goes straight to the owner, without
/// the three store requests that would find the same (a client polling a stream's tail
/// through a non-owner). Sending a read to the owner is always right, so a remembered miss
/// costs at most a read the owner answers that a snapshot could have.
#[derive(Default)]
pub(crate) struct SealedMisses(std::sync::Mutex<HashMap<String, (u64, Instant)>>);

impl SealedMisses {
    /// Whether a read of `name` from `from` goes to the owner without a look.
    fn skips(&self, name: &str, from: u64, now: Instant) -> bool {
        self.0
            .lock()
            .ok()
            .and_then(|misses| misses.get(name).copied())
            .is_some_and(|(reach, at)| now.duration_since(at) < MISS_MEMORY && from >= reach)
    }

    /// A look at `now` found no sealed data of `name` from offset `reach` on.
    fn remember(&self, name: &str, reach: u64, now: Instant) {
        let Ok(mut misses) = self.0.lock() else {
            return;
        };
        if misses.len() >= MAX_MISSES && !misses.contains_key(name) {
            misses.retain(|_, (_, at)| now.duration_since(*at) < MISS_MEMORY);
            if misses.len() >= MAX_MISSES {
                misses.clear();
            }
        }
        misses.insert(name.to_owned(), (reach, now));
    }
}

/// Locks serializing creates and deletes of one name, by its hash: a fixed number, since
/// names come from clients.
pub(crate) struct NameLocks([tokio::sync::Mutex<()>; 64]);

impl Default for NameLocks {
    fn default() -> Self {
        NameLocks(std::array::from_fn(|_| tokio::sync::Mutex::new(())))
    }
}

/// The SHA-256 of `name`, in hex.
fn name_hash(name: &str) -> String {
    use std::fmt::Write as _;
    digest(&SHA256, name.as_bytes()).as_ref().iter().fold(
        String::with_capacity(64),
        |mut hex, b| {
            let _ = write!(hex, "{b:02x}");
            hex
        },
    )
}

fn claims(name: &str) -> VersionLog {
    VersionLog::new(paths::stream_name(&name_hash(name)))
}

impl Database {
    fn registers_names(&self) -> bool {
        self.config.durability == Durability::ObjectStore
    }

    /// Serializes this process's creates and deletes of stream `name`: hold the guard
    /// across the claim (or the release) and the change to the stream.
    pub(crate) async fn lock_stream_name(&self, name: &str) -> tokio::sync::MutexGuard<'_, ()> {
        let hash = digest(&SHA256, name.as_bytes());
        let locks = &self.names.0;
        let stripe = usize::from(hash.as_ref()[0]) % locks.len();
        locks[stripe].lock().await
    }

    /// The latest claim of `name`: its version and content (`None`, `None` when it never
    /// had one). Retried when the latest version is collected while being read.
    async fn latest_claim(
        &self,
        log: &VersionLog,
        name: &str,
    ) -> Result<(Option<u64>, Option<NameClaim>), NameError> {
        let store = self.storage.store().as_ref();
        for _ in 0..CLAIM_ATTEMPTS {
            let Some(v) = log.list(store).await?.latest() else {
                return Ok((None, None));
            };
            if let Some(claim) = log.read::<NameClaim>(store, v).await? {
                if claim.name != name {
                    return Err(NameError::Collision(claim.name, name.to_owned()));
                }
                return Ok((Some(v), Some(claim)));
            }
        }
        Err(NameError::Storage(VersionError::Corrupt {
            path: log.dir().to_owned(),
            reason: "the latest version kept disappearing".into(),
        }))
    }

    /// Writes version `v` of `name`'s claim, owned by `node`; `false` when another writer
    /// got there first. Older versions are collected.
    async fn write_claim(
        &self,
        log: &VersionLog,
        v: u64,
        name: &str,
        node: Option<&str>,
        incarnation: Option<&str>,
    ) -> Result<bool, NameError> {
        let store = self.storage.store().as_ref();
        let claim = NameClaim {
            tag: uuid::Uuid::new_v4().simple().to_string(),
            name: name.to_owned(),
            node: node.map(str::to_owned),
            incarnation: incarnation.map(str::to_owned),
        };
        match log.try_create(store, v, &claim).await {
            Ok(true) => {}
            Ok(false) | Err(VersionError::BelowFloor { .. }) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
        // Only the latest version counts: raise the floor (a writer with an older view
        // then loses) and delete the ones below. Best effort.
        if v > 1
            && log.raise_floor(store, v).await.is_ok()
            && let Ok(listing) = log.list(store).await
        {
            for (old, _) in listing.versions.iter().filter(|(old, _)| *old < v) {
                let _ = store.delete(&log.path(*old)).await;
            }
        }
        Ok(true)
    }

    /// Claims stream `name` for a create (under [`Database::lock_stream_name`]): says
    /// whether the stream is made here or at a peer. `hosted` names the hosted id whose
    /// engine will hold the stream (a fork of one of its streams); otherwise it is this
    /// node's own. A stream made here gets incarnation `incarnation`, which the claim
    /// names. Without object-store durability every stream is made here.
    pub(crate) async fn claim_stream_name(
        &self,
        name: &str,
        hosted: Option<&str>,
        incarnation: &str,
    ) -> Result<NamePlace, NameError> {
        if !self.registers_names() {
            return Ok(NamePlace::Here);
        }
        let own = hosted.unwrap_or(self.node.id());
        if hosted.is_none() && self.node.is_fenced() {
            // Another process holds this node's id: nothing is created here any more (the
            // process exits and restarts under a new id).
            return Err(NameError::OwnerUnavailable {
                name: name.to_owned(),
                node: own.to_owned(),
            });
        }
        let log = claims(name);
        for _ in 0..CLAIM_ATTEMPTS {
            let (latest, claim) = self.latest_claim(&log, name).await?;
            // Falls through when the name is free to claim.
            match claim.and_then(|c| c.node) {
                None => {}
                // The stream exists: the create finds it (and makes nothing).
                Some(id) if id == own && self.holds_stream(&id, name) => {
                    return Ok(NamePlace::Here);
                }
                // The name is ours but its stream is gone (its release failed): the claim
                // names the new stream's incarnation.
                Some(id) if id == own => {}
                Some(id) if self.hosted_stream(&id, name) => return Ok(NamePlace::Here),
                // A claim a hosted id made for a stream it never made (it died between the
                // two): this process holds the id, so it may move the name to its own.
                Some(id) if self.hosts_node(&id) => {}
                Some(id) => {
                    if let Some(place) = self.peer_place(name, id).await? {
                        return Ok(place);
                    }
                }
            }
            let next = latest.map_or(1, |v| v + 1);
            if self
                .write_claim(&log, next, name, Some(own), Some(incarnation))
                .await?
            {
                return Ok(NamePlace::Here);
            }
        }
        Err(NameError::OwnerUnavailable {
            name: name.to_owned(),
            node: "(contended)".into(),
        })
    }

    /// Where stream `name` lives when no process answered for it: `None` when it is
    /// nobody's (never created, released, or its owner retired) or this process's own
    /// (so a request for it is answered here), the URL of the process serving its owner
    /// id otherwise, and [`NameError::OwnerUnavailable`] when that id has no process now.
    pub(crate) async fn locate_stream_name(
        &self,
        name: &str,
    ) -> Result<Option<NamePlace>, NameError> {
        if !self.registers_names() {
            return Ok(None);
        }
        let (_, claim) = self.latest_claim(&claims(name), name).await?;
        let Some(id) = claim.and_then(|c| c.node) else {
            return Ok(None);
        };
        if (id == self.node.id() && !self.node.is_fenced()) || self.hosts_node(&id) {
            return Ok(None);
        }
        self.peer_place(name, id).await
    }

    /// Where the process serving peer id `id`, which owns stream `name`, answers: `None`
    /// when the id is retired (it holds nothing, so the name is free), and
    /// [`NameError::OwnerUnavailable`] when no other process serves the id now.
    async fn peer_place(&self, name: &str, id: String) -> Result<Option<NamePlace>, NameError> {
        match peer_beat(&self.storage, &id)
            .await
            .map_err(VersionError::from)?
        {
            Some(beat) if beat.retired => Ok(None),
            Some(PeerBeat { url: Some(url), .. })
                if Some(&url) != self.config.advertise_url.as_ref() =>
            {
                Ok(Some(NamePlace::At(url)))
            }
            _ => Err(NameError::OwnerUnavailable {
                name: name.to_owned(),
                node: id,
            }),
        }
    }

    /// Releases stream `name` after it was deleted here (under
    /// [`Database::lock_stream_name`]): another node may create it from now on. A name
    /// whose stream is still held here (soft-deleted, a fork's source) stays claimed.
    pub(crate) async fn release_stream_name(&self, name: &str) -> Result<(), NameError> {
        if self.stream_engine(name).contains(name) {
            return Ok(());
        }
        self.change_own_claim(name, ClaimChange::Release).await
    }

    /// Makes the claim of stream `name`, served here, name incarnation `incarnation`
    /// (under [`Database::lock_stream_name`]). `None` before the stream is deleted, so no
    /// other node reads its sealed data from a snapshot taken before the delete; the
    /// stream's own incarnation again when the delete did not happen. Nothing to do when
    /// the claim names it already.
    pub(crate) async fn name_stream_incarnation(
        &self,
        name: &str,
        incarnation: Option<&str>,
    ) -> Result<(), NameError> {
        self.change_own_claim(name, ClaimChange::Incarnation(incarnation))
            .await
    }

    /// Writes the next version of `name`'s claim with `change`, when the claim is this
    /// process's (its own id, unless fenced, or a hosted id's); retried when another
    /// writer gets there first. Nothing to do without object-store durability, or when the
    /// name has no claim or another id's.
    async fn change_own_claim(&self, name: &str, change: ClaimChange<'_>) -> Result<(), NameError> {
        if !self.registers_names() {
            return Ok(());
        }
        let own = self.node.id();
        let log = claims(name);
        for _ in 0..CLAIM_ATTEMPTS {
            let (Some(latest), Some(claim)) = self.latest_claim(&log, name).await? else {
                return Ok(());
            };
            let id = match claim.node {
                Some(id) if (id == own && !self.node.is_fenced()) || self.hosts_node(&id) => id,
                _ => return Ok(()),
            };
            let (node, incarnation) = match change {
                ClaimChange::Release => (None, None),
                ClaimChange::Incarnation(named) if claim.incarnation.as_deref() == named => {
                    return Ok(());
                }
                ClaimChange::Incarnation(named) => (Some(id.as_str()), named),
            };
            if self
                .write_claim(&log, latest + 1, name, node, incarnation)
                .await?
            {
                return Ok(());
            }
        }
        Err(NameError::OwnerUnavailable {
            name: name.to_owned(),
            node: "(contended)".into(),
        })
    }

    /// The node id that owns stream `name` and the incarnation its claim names, when the
    /// name is another node's (not this process's, nor an id it hosts) and names one:
    /// that node's snapshot may answer reads of the stream's sealed data
    /// ([`crate::stream::Streams::read_sealed`]).
    pub(crate) async fn sealed_stream_owner(
        &self,
        name: &str,
    ) -> Result<Option<(String, String)>, NameError> {
        if !self.registers_names() {
            return Ok(None);
        }
        let (_, claim) = self.latest_claim(&claims(name), name).await?;
        Ok(claim.and_then(|c| match (c.node, c.incarnation) {
            (Some(id), Some(incarnation)) if id != self.node.id() && !self.hosts_node(&id) => {
                Some((id, incarnation))
            }
            _ => None,
        }))
    }

    /// A read of stream `name`'s sealed data from offset `from` when another node owns it,
    /// answered from the owner's newest snapshot ([`Database::sealed_stream_owner`],
    /// [`crate::stream::Streams::read_sealed`]); `None` when the owner must answer.
    pub(crate) async fn read_sealed(
        &self,
        name: &str,
        from: u64,
        max_bytes: usize,
    ) -> Option<crate::stream::ReadResult> {
        if !self.registers_names() || self.serves_stream(name) {
            return None;
        }
        let now = Instant::now();
        if self.sealed_misses.skips(name, from, now) {
            return None;
        }
        let (id, incarnation) = match self.sealed_stream_owner(name).await {
            Ok(Some(owner)) => owner,
            Ok(None) => {
                self.sealed_misses.remember(name, 0, now);
                return None;
            }
            Err(e) => {
                tracing::debug!(stream = %name, error = %e, "name claim not readable; the owner answers");
                return None;
            }
        };
        match self
            .streams
            .read_sealed(&id, name, &incarnation, from, max_bytes)
            .await
        {
            Ok(SealedRead::Read(read)) => Some(read),
            Ok(SealedRead::Reach(reach)) => {
                self.sealed_misses.remember(name, reach, now);
                None
            }
            Err(e) => {
                tracing::warn!(stream = %name, node = %id, error = %e, "sealed data not readable; the owner answers");
                None
            }
        }
    }

    /// Whether the engine of node id `id` (this node's own, or one it hosts) holds a
    /// stream named `name`.
    fn holds_stream(&self, id: &str, name: &str) -> bool {
        if id == self.node.id() {
            self.streams.contains(name)
        } else {
            self.hosted_stream(id, name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remembered_miss_skips_reads_from_its_offset_on_for_a_while() {
        let misses = SealedMisses::default();
        let t0 = Instant::now();
        assert!(!misses.skips("s", 0, t0), "nothing remembered yet");
        misses.remember("s", 100, t0);
        assert!(misses.skips("s", 100, t0));
        assert!(misses.skips("s", 250, t0 + MISS_MEMORY / 2));
        assert!(
            !misses.skips("s", 99, t0),
            "the snapshot answers below its reach"
        );
        assert!(!misses.skips("other", 100, t0));
        assert!(
            !misses.skips("s", 100, t0 + MISS_MEMORY),
            "a miss is forgotten"
        );
        // Names come from clients: the memory never holds more than its bound.
        for i in 0..MAX_MISSES * 3 {
            misses.remember(&format!("n{i}"), 0, t0);
        }
        assert!(misses.0.lock().unwrap().len() <= MAX_MISSES);
        // Full of fresh misses, the newest is still remembered.
        assert!(misses.skips(&format!("n{}", MAX_MISSES * 3 - 1), 0, t0));
    }

    #[test]
    fn every_name_is_one_path_segment_of_fixed_length() {
        for name in ["a", "a/b", "../../etc", &"x".repeat(1024), "ünï/çødé"] {
            let hash = name_hash(name);
            assert_eq!(hash.len(), 64);
            assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()), "{hash}");
        }
        assert_ne!(name_hash("a/b"), name_hash("a%2Fb"));
        assert_eq!(
            name_hash("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
