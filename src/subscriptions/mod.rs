//! Stream subscriptions, the Durable Streams protocol's reserved `/v1/stream/__ds/` APIs: a
//! subscription watches streams (by pattern, or listed) and, when one of them receives data,
//! wakes its consumer: a webhook (a signed POST; the consumer acks through a callback) or a
//! pull-wake stream (an event appended there; a worker claims the wake, acks, releases).
//! `http/subscriptions.rs` parses requests and renders answers; everything else is here.
//!
//! # Who holds what
//! Subscriptions belong to a node id, like streams: node `n`'s are stored under
//! `subscriptions/{n}/` ([`store`]) and held in memory by a [`registry::Registry`]. A
//! process holds its own id's registry and, after taking a dead node over, that node's
//! (`db/takeover.rs` attaches and releases it with the node's streams). New subscriptions go
//! to the process's own registry; requests name a subscription by id, found in any registry
//! the process holds. Ids are unique per node id, not cluster-wide: after a takeover the
//! same id may be in two registries. Wake callbacks then find the registry whose current
//! wake matches the wake id and token; an owner's other requests answer 409
//! `DUPLICATE_ID` (never act on one copy silently) until a `DELETE` removes every copy. Every registry watches every stream engine the
//! process serves: its own and the ones it took over.
//!
//! # No missed wakes
//! Wakes are at least once. The argument, step by step:
//! 1. Every stream engine notes the name of each stream that receives data in its change set
//!    before its applied LSN moves past the change, and keeps the LSN of each stream's last
//!    data change (in checkpoints too; a close or a producer-only append leaves it)
//!    ([`crate::stream::Streams::take_changes`]). The set is bounded; past the bound the
//!    engine only records that it overflowed.
//! 2. A dispatcher round ([`Subscriptions`]) takes each engine's changes and hands them to
//!    every registry: a stream a subscription's pattern matches is linked, its tail noted,
//!    and a wake raised when a link's tail passes its acked offset. After an overflow the
//!    registry rescans the engine for streams changed since its cursor instead; after a
//!    restart or a takeover, and the first time it watches an engine, for streams changed
//!    since it started watching the engine (its watermark: taken when registry and engine
//!    meet, before the engine takes an append through this process, and no later than any
//!    subscription's creation; kept until stored, so a failed store loses no batch), leaving
//!    out, per subscription, streams last changed before the subscription was made.
//! 3. A subscription with pending data always has a wake: raised when data arrives, and
//!    again when a wake ends (done) with data still pending. A wake is delivered until it
//!    is done: failed deliveries are retried with backoff (1 s doubling to 60 s), a webhook
//!    consumer that does not finish within its lease gets the wake again, and a pull-wake
//!    claim whose lease runs out (or that is released) is announced again.
//! 4. What cannot be found again is stored: a subscription's definition and listed streams
//!    (before the API answers), acked offsets (within a flush, 1 s), the block a wake's
//!    generation comes from (before the wake is delivered or claimed), and where the
//!    registry started watching each engine (before anything of it is applied). Links a
//!    pattern made are not stored until something is acked: after a restart each stored
//!    link's tail is read again, the engines are rescanned from where the registry started
//!    watching them, and every pending link gets a wake (with a new generation). The same
//!    happens on the node that takes a dead node over.
//!
//! # Limits that hold after a restart
//! Everything keyed by client input is bounded ([`SubscriptionLimits`]): subscriptions per
//! node, streams linked to one (listed, or matched by its pattern), bytes all of them hold,
//! and of both caps at most half for one key (owner), so that one key never leaves another
//! without room. A stream a pattern matches that finds no room is not linked: the
//! subscription is marked overflowed (its `GET` says so) and, once room is freed, the
//! dispatcher rescans the engines and links it then (as a restart does). Pattern length
//! and wildcards are bounded too (the matcher is linear, [`matching`]). What is accepted is stored in a typed form checked
//! to load back under the loader's own limits ([`store::encode`]). A wake names at most
//! [`registry::MAX_WAKE_STREAMS`] streams; at most `max_deliveries` deliveries run at once
//! (one key's at most half of them, [`delivery::Slots`]), each reading at most [`delivery::MAX_ANSWER_BYTES`] of a webhook's answer (its status is
//! what counts, and a `{"done": true}` body acks the wake). No request to the store waits
//! longer than `store_timeout`: a store that hangs fails the request, and what needed it
//! (a delivery, a round's watermark) is retried later instead of stalling every delivery.
//!
//! # Ownership and secrecy
//! A subscription belongs to the key that made it ([`Caller::subject`]): any other key gets
//! 404 for it (and 409 for a `PUT` of its id), unless it is an admin key. A webhook URL is
//! shown whole only to the owner; anyone else (admins too) sees only its origin,
//! `scheme://host[:port]/…` ([`network::redacted_url`]). Wake callbacks (ack, release) are authorized by the wake's
//! token, never by a key. Without API keys (a server on loopback only) every request is the
//! one local user, subject `local`, who owns every subscription made then; subscriptions
//! stored by an earlier version belong to `local` too. Configured keys later, they are
//! visible to admin keys only.
//!
//! # Webhooks stay outside
//! See [`network`]: every address a webhook host resolves to is checked before the client
//! connects to it, literal addresses at every delivery, and redirects are not followed. Webhooks are
//! signed with the node's Ed25519 key, stored with its subscriptions (so signatures keep
//! their key id across restarts and takeovers); `jwks.json` lists the keys of every
//! registry the process holds.

mod delivery;
mod matching;
mod network;
mod registry;
mod store;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use network::Network;

use crate::error::{Applied, Classify, ErrorClass, Kind};
use crate::log::Lsn;
use crate::node::Node;
use crate::storage::Storage;
use crate::stream::{StreamMark, Streams};
use registry::Registry;

/// Where the reserved APIs live, from the server root.
pub(crate) const RESERVED_PREFIX: &str = "/v1/stream/__ds/";

/// The owner of subscriptions made without keys, and of those an earlier version stored.
pub(crate) const LEGACY_OWNER: &str = "local";

/// Longest subscription id, in bytes.
pub(crate) const MAX_ID_BYTES: usize = 256;

/// The lease a subscription gets when it names none, and the shortest and longest it may.
const DEFAULT_LEASE_MS: u64 = 30_000;
const MIN_LEASE_MS: u64 = 1_000;
const MAX_LEASE_MS: u64 = 3_600_000;

/// How often the dispatcher takes the engines' changes and starts due deliveries.
const ROUND: Duration = Duration::from_millis(50);

/// How often subscriptions whose objects are behind (acks, mostly) are written.
const FLUSH: Duration = Duration::from_secs(1);

/// Bounds on subscriptions, and the networks webhooks may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionLimits {
    /// Subscriptions per node.
    pub max_subscriptions: usize,
    /// Streams linked to one subscription (listed, or matched by its pattern).
    pub max_links: usize,
    /// Longest pattern, in bytes.
    pub max_pattern_bytes: usize,
    /// Most wildcards (`*`, `**`) in a pattern.
    pub max_wildcards: usize,
    /// Webhook deliveries and wake-stream appends in flight at once (one key holds at
    /// most half of them).
    pub max_deliveries: usize,
    /// Bytes of definitions and linked stream names one node's subscriptions may hold.
    pub max_stored_bytes: usize,
    /// Networks webhooks may reach although they are not public (`127.0.0.0/8`, …).
    pub webhook_allowed_networks: Vec<Network>,
    /// Longest wait for one request to the object store (a write of a subscription or of
    /// the watermarks, a read at load): past it the request fails as unavailable and what
    /// needed it is retried later, so a store that hangs stalls no delivery and no round.
    pub store_timeout: Duration,
}

impl Default for SubscriptionLimits {
    fn default() -> Self {
        SubscriptionLimits {
            max_subscriptions: 1000,
            max_links: 10_000,
            max_pattern_bytes: 256,
            max_wildcards: 8,
            max_deliveries: 16,
            max_stored_bytes: 16 << 20,
            webhook_allowed_networks: Vec::new(),
            store_timeout: Duration::from_secs(10),
        }
    }
}

/// Whom a subscription wakes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub(crate) enum Target {
    /// A signed POST to this URL.
    Webhook {
        /// The URL.
        url: String,
    },
    /// An event appended to this stream.
    PullWake {
        /// The stream.
        wake_stream: String,
    },
}

/// What a subscription was created with; two `PUT`s with equal definitions are one
/// subscription.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Definition {
    pub(crate) target: Target,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) pattern: Option<String>,
    /// Streams listed at creation (sorted, each once).
    #[serde(default)]
    pub(crate) streams: Vec<String>,
    pub(crate) lease_ttl_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) description: Option<String>,
}

impl Definition {
    /// A definition; the lease is held to 1 s … 1 h (30 s when none is given).
    pub(crate) fn new(
        target: Target,
        pattern: Option<String>,
        mut streams: Vec<String>,
        lease_ttl_ms: Option<u64>,
        description: Option<String>,
    ) -> Definition {
        streams.sort();
        streams.dedup();
        Definition {
            target,
            pattern,
            streams,
            lease_ttl_ms: lease_ttl_ms
                .unwrap_or(DEFAULT_LEASE_MS)
                .clamp(MIN_LEASE_MS, MAX_LEASE_MS),
            description,
        }
    }

    /// What it costs in memory and in the stored object, roughly.
    fn bytes(&self) -> usize {
        let target = match &self.target {
            Target::Webhook { url } => url.len(),
            Target::PullWake { wake_stream } => wake_stream.len(),
        };
        target
            + self.pattern.as_ref().map_or(0, String::len)
            + self.description.as_ref().map_or(0, |d| 2 * d.len())
            + self.streams.iter().map(|s| 2 * s.len() + 4).sum::<usize>()
    }
}

/// Who makes a request: a subject (the key's identity, or `local` without keys) and
/// whether it may see and change every subscription (an admin key).
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    pub(crate) subject: Arc<str>,
    pub(crate) admin: bool,
}

/// A subscription as its readers see it.
#[derive(Debug, Clone)]
pub(crate) struct View {
    pub(crate) id: String,
    pub(crate) target: TargetView,
    pub(crate) pattern: Option<String>,
    pub(crate) description: Option<String>,
    pub(crate) lease_ttl_ms: u64,
    /// A stream its pattern matched is not linked for lack of room (retried when room frees).
    pub(crate) overflowed: bool,
    pub(crate) streams: Vec<LinkView>,
}

/// Whom a subscription wakes, as its readers see it.
#[derive(Debug, Clone)]
pub(crate) enum TargetView {
    Webhook {
        /// The URL, without its secrets unless the reader owns the subscription.
        url: String,
        /// Whether secrets were taken out.
        redacted: bool,
        kid: String,
        jwks_url: String,
    },
    PullWake {
        wake_stream: String,
    },
}

/// A linked stream, as readers see it.
#[derive(Debug, Clone)]
pub(crate) struct LinkView {
    pub(crate) path: String,
    /// Listed (rather than matched by the pattern).
    pub(crate) explicit: bool,
    pub(crate) acked: u64,
    pub(crate) tail: u64,
}

/// A claimed wake.
#[derive(Debug, Clone)]
pub(crate) struct ClaimView {
    pub(crate) wake_id: String,
    pub(crate) generation: u64,
    pub(crate) token: String,
    pub(crate) streams: Vec<(String, u64)>,
}

/// A consumer's acks for a wake.
#[derive(Debug, Clone)]
pub(crate) struct Ack {
    pub(crate) wake_id: String,
    pub(crate) generation: u64,
    /// Streams and the offsets read up to.
    pub(crate) acks: Vec<(String, u64)>,
    /// The consumer is finished with the wake.
    pub(crate) done: bool,
}

/// A signing key as `jwks.json` lists it.
#[derive(Debug, Clone)]
pub(crate) struct PublicKey {
    pub(crate) kid: String,
    pub(crate) key: Vec<u8>,
}

/// Why a subscription request failed. [`SubscriptionError::code`] is the protocol's code;
/// the class ([`Classify`]) gives the status.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum SubscriptionError {
    /// No such subscription (or another key's).
    #[error("no such subscription")]
    NotFound,
    /// A request the protocol refuses.
    #[error("{0}")]
    Invalid(String),
    /// A pattern over the limits.
    #[error("{0}")]
    InvalidPattern(String),
    /// A webhook URL that is not http(s) or points where webhooks may not go.
    #[error("webhook URL {0:?} is not allowed (not http(s), user info, or a private network)")]
    WebhookUrlRejected(String),
    /// More linked streams than a subscription may have.
    #[error("a subscription links at most {0} streams")]
    TooManyStreams(usize),
    /// More subscriptions than a node keeps.
    #[error("at most {0} subscriptions here (one key holds at most half of the server's)")]
    TooManySubscriptions(usize),
    /// More bytes than subscriptions may hold together.
    #[error("subscriptions hold {stored} bytes; the limit is {limit}")]
    TooMuchStored { stored: usize, limit: usize },
    /// The id is taken by another definition, or another key's subscription.
    #[error("a subscription with this id exists with another definition")]
    Conflict,
    /// The wake (its id, generation or token) is not current.
    #[error("this wake is no longer current")]
    Fenced,
    /// The id names subscriptions of two node ids this process serves (its own and one it
    /// took over, made while they ran apart): a `DELETE` removes every copy.
    #[error(
        "this id names subscriptions of several node ids this server serves; DELETE removes every copy"
    )]
    DuplicateId,
    /// Another worker holds the wake.
    #[error("another worker holds this wake")]
    AlreadyClaimed { holder: String },
    /// Applied in memory, but the store did not take it (it is written again later).
    #[error("the change was applied but is not stored yet: {0}")]
    NotDurable(String),
    /// The store or the node cannot take it now; nothing was applied.
    #[error("{0}")]
    Unavailable(String),
}

impl SubscriptionError {
    /// The protocol's error code.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            SubscriptionError::NotFound => "NOT_FOUND",
            SubscriptionError::Invalid(_) => "INVALID",
            SubscriptionError::InvalidPattern(_) => "INVALID_PATTERN",
            SubscriptionError::WebhookUrlRejected(_) => "WEBHOOK_URL_REJECTED",
            SubscriptionError::TooManyStreams(_) => "TOO_MANY_STREAMS",
            SubscriptionError::TooManySubscriptions(_) => "TOO_MANY_SUBSCRIPTIONS",
            SubscriptionError::TooMuchStored { .. } => "TOO_MUCH_STORED",
            SubscriptionError::Conflict => "CONFLICT",
            SubscriptionError::Fenced => "FENCED",
            SubscriptionError::DuplicateId => "DUPLICATE_ID",
            SubscriptionError::AlreadyClaimed { .. } => "ALREADY_CLAIMED",
            SubscriptionError::NotDurable(_) => "NOT_DURABLE",
            SubscriptionError::Unavailable(_) => "UNAVAILABLE",
        }
    }
}

impl Classify for SubscriptionError {
    fn class(&self) -> ErrorClass {
        match self {
            SubscriptionError::NotFound => ErrorClass::rejected(Kind::NotFound),
            SubscriptionError::Invalid(_)
            | SubscriptionError::InvalidPattern(_)
            | SubscriptionError::WebhookUrlRejected(_)
            | SubscriptionError::TooManyStreams(_) => ErrorClass::rejected(Kind::Invalid),
            SubscriptionError::TooManySubscriptions(_)
            | SubscriptionError::TooMuchStored { .. } => ErrorClass::rejected(Kind::TooMany),
            SubscriptionError::Conflict
            | SubscriptionError::DuplicateId
            | SubscriptionError::Fenced
            | SubscriptionError::AlreadyClaimed { .. } => ErrorClass::rejected(Kind::Conflict),
            SubscriptionError::NotDurable(_) => ErrorClass {
                applied: Applied::Unknown,
                ..ErrorClass::retry(crate::error::Cause::StorageUnavailable)
            },
            SubscriptionError::Unavailable(_) => {
                ErrorClass::retry(crate::error::Cause::StorageUnavailable)
            }
        }
    }
}

/// Streams as wakes and claims name them: `[{"path", "tail_offset"}]`, and `has_pending`
/// when given.
pub(crate) fn streams_json(
    streams: &[(String, u64)],
    has_pending: Option<bool>,
) -> serde_json::Value {
    streams
        .iter()
        .map(|(path, tail)| {
            let mut stream = serde_json::Map::new();
            stream.insert("path".into(), path.as_str().into());
            stream.insert(
                "tail_offset".into(),
                crate::stream::format_offset(*tail).into(),
            );
            if let Some(pending) = has_pending {
                stream.insert("has_pending".into(), pending.into());
            }
            serde_json::Value::Object(stream)
        })
        .collect()
}

fn not_durable(e: SubscriptionError) -> SubscriptionError {
    SubscriptionError::NotDurable(e.to_string())
}

/// A registry loaded for a node id this process takes over, not yet attached.
#[derive(Debug)]
pub(crate) struct LoadedRegistry(Arc<Registry>);

impl LoadedRegistry {
    /// Whether it holds no subscription.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Where a test holds `put`: it says it got there, then waits to be let go.
#[cfg(test)]
struct Pause {
    reached: tokio::sync::oneshot::Sender<()>,
    resume: tokio::sync::oneshot::Receiver<()>,
}

/// Every subscription this process holds, and the dispatcher that feeds them.
pub(crate) struct Subscriptions {
    storage: Storage,
    limits: Arc<SubscriptionLimits>,
    /// The own node's registry first, then those of node ids taken over.
    registries: RwLock<Vec<Arc<Registry>>>,
    /// The stream engines the process serves: its own first.
    engines: Arc<RwLock<Vec<Streams>>>,
    /// Deliveries in flight.
    deliveries: Arc<delivery::Slots>,
    /// What webhooks are sent with.
    client: reqwest::Client,
    /// One dispatcher round at a time.
    round: tokio::sync::Mutex<()>,
    /// Stops the background loops.
    stop: tokio::sync::watch::Sender<bool>,
    /// Where consumers reach this process (its configured advertise URL, no trailing
    /// slash), or empty: callback and key URLs are then paths on the server.
    public_url: Arc<str>,
    /// A test's pause in `put`, between reading the tails and creating the subscription.
    #[cfg(test)]
    put_pause: std::sync::Mutex<Option<Pause>>,
}

impl std::fmt::Debug for Subscriptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriptions")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Where `names` stand, in whichever engine holds them.
fn tails_in(
    engines: &[Streams],
    names: impl IntoIterator<Item = String>,
) -> HashMap<String, StreamMark> {
    names
        .into_iter()
        .filter_map(|name| {
            let found = engines.iter().find_map(|e| e.mark_of(&name))?;
            Some((name, found))
        })
        .collect()
}

/// Where `names` stand in `engine` (names it no longer holds left out).
fn resolve(engine: &Streams, names: Vec<String>) -> Vec<(String, StreamMark)> {
    names
        .into_iter()
        .filter_map(|name| {
            let mark = engine.mark_of(&name)?;
            Some((name, mark))
        })
        .collect()
}

/// Checks an id: 1 to [`MAX_ID_BYTES`] bytes, no control characters.
fn check_id(id: &str) -> Result<(), SubscriptionError> {
    if id.is_empty() || id.len() > MAX_ID_BYTES || id.chars().any(char::is_control) {
        return Err(SubscriptionError::Invalid(format!(
            "a subscription id is 1 to {MAX_ID_BYTES} bytes without control characters"
        )));
    }
    Ok(())
}

impl Subscriptions {
    /// Loads node `node`'s subscriptions over its engine `streams`, and starts the
    /// dispatcher and the flusher (they stop at [`Subscriptions::close`], or when this is
    /// dropped).
    pub(crate) async fn open(
        storage: Storage,
        node: Arc<Node>,
        streams: Streams,
        limits: SubscriptionLimits,
        public_url: Option<String>,
    ) -> Result<Arc<Subscriptions>, SubscriptionError> {
        let subscriptions = Self::load_own(storage, node, streams, limits, public_url).await?;
        let weak = Arc::downgrade(&subscriptions);
        tokio::spawn(run_rounds(weak.clone(), subscriptions.stop.subscribe()));
        tokio::spawn(run_flushes(weak, subscriptions.stop.subscribe()));
        Ok(subscriptions)
    }

    /// [`Subscriptions::open`] without the background loops.
    async fn load_own(
        storage: Storage,
        node: Arc<Node>,
        streams: Streams,
        limits: SubscriptionLimits,
        public_url: Option<String>,
    ) -> Result<Arc<Subscriptions>, SubscriptionError> {
        let limits = Arc::new(limits);
        let client = network::webhook_client(&limits.webhook_allowed_networks)
            .map_err(SubscriptionError::Unavailable)?;
        let own = Registry::load(storage.clone(), node, limits.clone()).await?;
        // Before the dispatcher takes any change (and before any request).
        own.state()
            .begin_watch(streams.node_id(), streams.applied_lsn());
        let subscriptions = Arc::new(Subscriptions {
            storage,
            client,
            deliveries: delivery::Slots::new(limits.max_deliveries),
            limits,
            registries: RwLock::new(vec![Arc::new(own)]),
            engines: Arc::new(RwLock::new(vec![streams])),
            round: tokio::sync::Mutex::new(()),
            stop: tokio::sync::watch::channel(false).0,
            public_url: Arc::from(public_url.unwrap_or_default().trim_end_matches('/')),
            #[cfg(test)]
            put_pause: std::sync::Mutex::new(None),
        });
        Ok(subscriptions)
    }

    fn registries(&self) -> Vec<Arc<Registry>> {
        self.registries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|r| !r.is_fenced())
            .cloned()
            .collect()
    }

    fn engines(&self) -> Vec<Streams> {
        self.engines
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The registries holding subscription `id` (after a takeover an id may be in two).
    fn holders(&self, id: &str) -> Vec<Arc<Registry>> {
        self.registries()
            .into_iter()
            .filter(|r| r.state().contains(id))
            .collect()
    }

    /// The registry a caller's request for `id` acts on (see [`owned_by`]).
    fn find(&self, caller: &Caller, id: &str) -> Result<Option<Arc<Registry>>, SubscriptionError> {
        owned_by(
            self.holders(id)
                .into_iter()
                .map(|r| {
                    let accessible = r.state().accessible(caller, id);
                    (r, accessible)
                })
                .collect(),
        )
    }

    fn own(&self) -> Result<Arc<Registry>, SubscriptionError> {
        self.registries()
            .into_iter()
            .next()
            .ok_or_else(|| SubscriptionError::Unavailable("this node was taken over".into()))
    }

    fn tails(&self, names: impl IntoIterator<Item = String>) -> HashMap<String, StreamMark> {
        tails_in(&self.engines(), names)
    }

    /// Loads the subscriptions of node id `node`, which this process is taking over.
    pub(crate) async fn load(&self, node: Arc<Node>) -> Result<LoadedRegistry, SubscriptionError> {
        Ok(LoadedRegistry(Arc::new(
            Registry::load(self.storage.clone(), node, self.limits.clone()).await?,
        )))
    }

    /// Serves a taken-over node id's subscriptions and stream engine from now on (its
    /// registry rescans every engine from its watermarks at the next round). Called before
    /// the engine takes any append through this process: every registry starts watching
    /// it no later than here.
    pub(crate) fn attach(&self, registry: LoadedRegistry, streams: Streams) {
        let clashes: Vec<String> = {
            let loaded = registry.0.state();
            self.registries()
                .iter()
                .flat_map(|r| r.state().ids())
                .filter(|id| loaded.contains(id))
                .collect()
        };
        if !clashes.is_empty() {
            tracing::warn!(node = %registry.0.node_id(), ids = ?clashes, "subscription ids of a taken-over node id are also this server's; their owners' requests answer 409 DUPLICATE_ID until a DELETE removes the copies (wake callbacks still find their wake)");
        }
        for held in self.registries() {
            held.state()
                .begin_watch(streams.node_id(), streams.applied_lsn());
        }
        {
            let mut loaded = registry.0.state();
            for engine in self.engines().iter().chain(std::iter::once(&streams)) {
                loaded.begin_watch(engine.node_id(), engine.applied_lsn());
            }
        }
        self.engines
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(streams);
        self.registries
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(registry.0);
    }

    /// Stops serving node id `node`'s subscriptions and engine (another process took it,
    /// or this one releases it); with `flush`, what is dirty is written first.
    pub(crate) async fn detach(&self, node: &str, flush: bool) {
        let _round = self.round.lock().await;
        let removed: Vec<Arc<Registry>> = {
            let mut registries = self.registries.write().unwrap_or_else(|p| p.into_inner());
            let (removed, kept) = registries.drain(..).partition(|r| r.node_id() == node);
            *registries = kept;
            removed
        };
        self.engines
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|e| e.node_id() != node);
        if flush {
            for registry in removed {
                if let Err(e) = registry.flush().await {
                    tracing::warn!(node, error = %e, "subscriptions of a released node id not stored; the next owner raises their wakes again");
                }
            }
        }
    }

    /// Stops the loops, takes the engines' last changes and stores everything (part of the
    /// database's shutdown).
    pub(crate) async fn close(&self) {
        self.stop.send_replace(true);
        self.round().await;
        for registry in self.registries() {
            if let Err(e) = registry.flush().await {
                tracing::warn!(node = %registry.node_id(), error = %e, "subscriptions not stored at shutdown; a restart raises their wakes again");
            }
        }
    }

    /// One dispatcher round: every engine's changes to every registry, then the deliveries
    /// that are due.
    async fn round(&self) {
        let _round = self.round.lock().await;
        let engines = self.engines();
        let registries = self.registries();
        let served: HashSet<&str> = engines.iter().map(Streams::node_id).collect();
        for registry in &registries {
            let mut state = registry.state();
            state.keep_cursors(&served);
            // Where a registry starts watching an engine is taken when they meet (`open`,
            // `attach`); this only covers a pair that met otherwise, before its changes
            // are taken.
            for engine in &engines {
                state.begin_watch(engine.node_id(), engine.applied_lsn());
            }
        }
        for engine in &engines {
            let batch = engine.take_changes();
            let names = batch.names.map(|names| resolve(engine, names));
            for registry in &registries {
                self.feed(registry, engine, batch.upto, names.as_deref())
                    .await;
            }
        }
        for registry in &registries {
            if registry.state().take_rescan() {
                self.rescan(registry, &engines).await;
            }
            registry.log_refusals();
        }
        self.start_deliveries(&registries);
    }

    /// Hands one engine's changes to one registry: the batch's names, or a rescan (the
    /// registry just attached to the engine, or the batch overflowed).
    async fn feed(
        &self,
        registry: &Registry,
        engine: &Streams,
        upto: Lsn,
        names: Option<&[(String, StreamMark)]>,
    ) {
        let id = engine.node_id();
        let (cursor, watermark, from) = {
            let state = registry.state();
            (
                state.cursor(id),
                state.watermark(id),
                state.watched_from(id),
            )
        };
        match cursor {
            None => {
                // Newly attached (at start, or after a takeover): every link's tail afresh,
                // then every stream changed since the registry started watching the engine
                // (the batch taken this round included: its changes are past that start).
                // The first time, the start is stored before anything is applied; until
                // that succeeds nothing is applied and the start is kept, so the next round
                // rescans from it again and the batch taken now is not lost.
                let Some(from) = from else {
                    tracing::error!(node = %registry.node_id(), engine = %id, "no position to watch an engine from; retrying");
                    return;
                };
                if watermark.is_none()
                    && let Err(e) = registry.watch_from(id, from).await
                {
                    tracing::warn!(node = %registry.node_id(), engine = %id, error = %e, "cannot store where subscriptions start watching an engine; retrying");
                    return;
                }
                let linked = registry.state().all_linked();
                let tails = tails_in(std::slice::from_ref(engine), linked);
                registry.state().note_all_tails(&tails, Instant::now());
                let changed = engine.changed_since(from);
                self.observe(registry, id, &changed, true).await;
            }
            Some(cursor) => match names {
                Some(names) => self.observe(registry, id, names, false).await,
                None => {
                    let changed = engine.changed_since(cursor);
                    self.observe(registry, id, &changed, false).await;
                }
            },
        }
        registry.state().set_cursor(id, upto);
    }

    /// Room was freed in a registry with overflowed subscriptions: every stream changed since
    /// it started watching each engine is matched again (links already made only take in
    /// their tails).
    async fn rescan(&self, registry: &Registry, engines: &[Streams]) {
        for engine in engines {
            let Some(from) = registry.state().watched_from(engine.node_id()) else {
                continue;
            };
            let changed = engine.changed_since(from);
            self.observe(registry, engine.node_id(), &changed, true)
                .await;
        }
    }

    /// Applies changed streams of engine `engine` to a registry, a slice at a time (other
    /// tasks run between).
    async fn observe(
        &self,
        registry: &Registry,
        engine: &str,
        changed: &[(String, StreamMark)],
        rescan: bool,
    ) {
        for slice in changed.chunks(512) {
            {
                let now = Instant::now();
                let mut state = registry.state();
                for (name, mark) in slice {
                    state.observe(engine, name, mark, rescan, registry.limits(), now);
                }
            }
            tokio::task::yield_now().await;
        }
    }

    /// Starts the deliveries that are due, within the slots for deliveries in flight (and
    /// each owner's share of them: a wake whose owner holds its share waits for a later
    /// round).
    fn start_deliveries(&self, registries: &[Arc<Registry>]) {
        for registry in registries {
            if self.deliveries.free() == 0 {
                return;
            }
            let due = registry
                .state()
                .take_due(Instant::now(), |owner| self.deliveries.take(owner));
            for (wake, slot) in due {
                tokio::spawn(delivery::deliver(
                    registry.clone(),
                    wake,
                    self.engines.clone(),
                    self.client.clone(),
                    self.public_url.clone(),
                    slot,
                ));
            }
        }
    }

    /// Writes what is dirty in every registry.
    async fn flush(&self) -> Result<(), SubscriptionError> {
        let mut result = Ok(());
        for registry in self.registries() {
            if let Err(e) = registry.flush().await {
                result = Err(e);
            }
        }
        result
    }

    fn check_definition(&self, d: &Definition) -> Result<(), SubscriptionError> {
        match &d.target {
            Target::Webhook { url } => {
                if !network::url_allowed(url, &self.limits.webhook_allowed_networks) {
                    return Err(SubscriptionError::WebhookUrlRejected(url.clone()));
                }
            }
            Target::PullWake { wake_stream } => {
                if !matching::valid_stream_name(wake_stream) {
                    return Err(SubscriptionError::Invalid(format!(
                        "wake_stream {wake_stream:?} is not a stream name"
                    )));
                }
            }
        }
        if d.streams.len() > self.limits.max_links {
            return Err(SubscriptionError::TooManyStreams(self.limits.max_links));
        }
        registry::check_names(&d.streams)
    }

    /// Creates subscription `id` (`true`), or confirms the caller's subscription of the
    /// same definition (`false`); either way it is stored when this answers.
    pub(crate) async fn put(
        &self,
        caller: &Caller,
        id: &str,
        definition: Definition,
    ) -> Result<(bool, View), SubscriptionError> {
        check_id(id)?;
        self.check_definition(&definition)?;
        let registry = match self.find(caller, id)? {
            Some(registry) => registry,
            None => self.own()?,
        };
        // No dispatcher round between reading the tails and `since` and the subscription
        // being there: a change a round took in between would find no subscription, and
        // the tails read before it would never learn of it.
        let round = self.round.lock().await;
        let tails = self.tails(definition.streams.iter().cloned());
        let since = self
            .engines()
            .iter()
            .map(|e| (e.node_id().to_owned(), e.applied_lsn()))
            .collect();
        #[cfg(test)]
        self.pause_in_put().await;
        let created = registry.state().create(
            caller,
            id,
            definition,
            since,
            &tails,
            &self.limits,
            Instant::now(),
        )?;
        drop(round);
        registry.persist(id).await.map_err(not_durable)?;
        let view = registry
            .state()
            .view(caller, id, registry.key(), &self.public_url)?;
        Ok((created, view))
    }

    /// Waits where a test asked `put` to (see [`Pause`]).
    #[cfg(test)]
    async fn pause_in_put(&self) {
        let pause = self
            .put_pause
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(pause) = pause {
            let _ = pause.reached.send(());
            let _ = pause.resume.await;
        }
    }

    /// Subscription `id`, as `caller` may see it.
    pub(crate) fn get(&self, caller: &Caller, id: &str) -> Result<View, SubscriptionError> {
        let registry = self.find(caller, id)?.ok_or(SubscriptionError::NotFound)?;
        let state = registry.state();
        state.view(caller, id, registry.key(), &self.public_url)
    }

    /// Deletes subscription `id` (every copy the caller may reach, when a takeover brought
    /// two); its objects are gone when this answers.
    pub(crate) async fn delete(&self, caller: &Caller, id: &str) -> Result<(), SubscriptionError> {
        let reachable: Vec<Arc<Registry>> = self
            .holders(id)
            .into_iter()
            .filter(|r| r.state().accessible(caller, id))
            .collect();
        if reachable.is_empty() {
            return Err(SubscriptionError::NotFound);
        }
        for registry in reachable {
            registry.state().delete(caller, id)?;
            registry.persist(id).await.map_err(not_durable)?;
        }
        Ok(())
    }

    /// Links `names` to subscription `id` explicitly.
    pub(crate) async fn add_streams(
        &self,
        caller: &Caller,
        id: &str,
        names: Vec<String>,
    ) -> Result<(), SubscriptionError> {
        if names.len() > self.limits.max_links {
            return Err(SubscriptionError::TooManyStreams(self.limits.max_links));
        }
        registry::check_names(&names)?;
        let registry = self.find(caller, id)?.ok_or(SubscriptionError::NotFound)?;
        // As in `put`: no round between reading the tails and the links being there.
        let round = self.round.lock().await;
        let tails = self.tails(names.iter().cloned());
        registry
            .state()
            .add_streams(caller, id, &names, &tails, &self.limits, Instant::now())?;
        drop(round);
        registry.persist(id).await.map_err(not_durable)
    }

    /// Unlinks stream `name` from subscription `id`.
    pub(crate) async fn remove_stream(
        &self,
        caller: &Caller,
        id: &str,
        name: &str,
    ) -> Result<(), SubscriptionError> {
        let registry = self.find(caller, id)?.ok_or(SubscriptionError::NotFound)?;
        registry.state().remove_stream(caller, id, name)?;
        registry.persist(id).await.map_err(not_durable)
    }

    /// A consumer acks (and may finish) the current wake of `id`, presenting the wake's
    /// token. Returns whether more is pending (another wake follows). An ack the store does
    /// not take at once is written later; lost in a crash, it costs a repeated wake.
    pub(crate) async fn ack(
        &self,
        id: &str,
        token: Option<&str>,
        ack: Ack,
    ) -> Result<bool, SubscriptionError> {
        let tails = self.tails(ack.acks.iter().map(|(name, _)| name.clone()));
        let (registry, next) = on_current_wake(&self.holders(id), |registry| {
            let next = registry.state().ack(
                id,
                token,
                &ack.wake_id,
                ack.generation,
                &ack.acks,
                ack.done,
                &tails,
                Instant::now(),
            )?;
            Ok((registry.clone(), next))
        })?;
        if let Err(e) = registry.persist(id).await {
            tracing::warn!(subscription = id, error = %e, "an ack is not stored yet; it is written later");
        }
        Ok(next)
    }

    /// Worker `worker` claims the wake of pull-wake subscription `id`: `None` when nothing
    /// is pending. The wake's generation is stored when this answers.
    pub(crate) async fn claim(
        &self,
        caller: &Caller,
        id: &str,
        worker: &str,
    ) -> Result<Option<ClaimView>, SubscriptionError> {
        let registry = self.find(caller, id)?.ok_or(SubscriptionError::NotFound)?;
        // The dispatcher runs behind the appends: a claim sees the data already there.
        let linked = registry.state().linked(caller, id)?;
        let tails = self.tails(linked);
        let claimed = registry
            .state()
            .claim(caller, id, worker, &tails, Instant::now())?;
        registry.persist(id).await.map_err(not_durable)?;
        Ok(claimed)
    }

    /// The claiming worker releases the wake of `id`, presenting its token.
    pub(crate) fn release(
        &self,
        id: &str,
        token: Option<&str>,
        wake_id: &str,
        generation: Option<u64>,
    ) -> Result<(), SubscriptionError> {
        on_current_wake(&self.holders(id), |registry| {
            registry
                .state()
                .release(id, token, wake_id, generation, Instant::now())
        })
    }

    /// Whether `token` is the token of a current wake of subscription `id` (in any registry
    /// holding it): a wake callback is read no further when it is not.
    pub(crate) fn wake_token_current(&self, id: &str, token: Option<&str>) -> bool {
        self.holders(id)
            .iter()
            .any(|r| r.state().wake_token_matches(id, token))
    }

    /// The keys webhooks are signed with (every registry's).
    pub(crate) fn public_keys(&self) -> Vec<PublicKey> {
        self.registries()
            .iter()
            .map(|r| PublicKey {
                kid: r.key().kid().to_owned(),
                key: r.key().public_key().to_vec(),
            })
            .collect()
    }
}

/// Calls `call` on each registry holding a subscription until one answers other than
/// [`SubscriptionError::Fenced`]: a wake callback names its wake by wake id and token, so
/// the registry whose current wake it is takes it, whichever node id it belongs to. A
/// registry that is not the wake's changes nothing when it answers `Fenced`.
fn on_current_wake<R, T>(
    holders: &[R],
    mut call: impl FnMut(&R) -> Result<T, SubscriptionError>,
) -> Result<T, SubscriptionError> {
    for holder in holders {
        match call(holder) {
            Err(SubscriptionError::Fenced) => continue,
            other => return other,
        }
    }
    Err(SubscriptionError::Fenced)
}

/// Of the holders of an id, each with whether the caller may reach its copy, the one a
/// caller's request acts on: the one copy it may reach; none reachable, the first (which
/// answers 404, or 409 to a `PUT`); several reachable (a takeover brought the same id from
/// two node ids), [`SubscriptionError::DuplicateId`] rather than acting on either
/// silently.
fn owned_by<R>(holders: Vec<(R, bool)>) -> Result<Option<R>, SubscriptionError> {
    let reachable = holders.iter().filter(|(_, ok)| *ok).count();
    if reachable > 1 {
        return Err(SubscriptionError::DuplicateId);
    }
    let first_reachable = holders.iter().position(|(_, ok)| *ok).unwrap_or(0);
    Ok(holders
        .into_iter()
        .nth(first_reachable)
        .map(|(holder, _)| holder))
}

/// Runs `work` on what `subscriptions` still points to every `tick`, until the stop signal
/// (or until the subscriptions are dropped, which drops the signal's sender).
async fn run_every<F, Fut>(
    tick: Duration,
    subscriptions: Weak<Subscriptions>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    mut work: F,
) where
    F: FnMut(Arc<Subscriptions>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let stopped = async move {
        let _ = stop.wait_for(|stop| *stop).await;
    };
    crate::every(tick, stopped, || {
        let round = subscriptions.upgrade().map(&mut work);
        async move {
            if let Some(round) = round {
                round.await;
            }
        }
    })
    .await;
}

async fn run_rounds(subscriptions: Weak<Subscriptions>, stop: tokio::sync::watch::Receiver<bool>) {
    run_every(
        ROUND,
        subscriptions,
        stop,
        |s| async move { s.round().await },
    )
    .await;
}

async fn run_flushes(subscriptions: Weak<Subscriptions>, stop: tokio::sync::watch::Receiver<bool>) {
    let warned = std::sync::Mutex::new(None::<Instant>);
    let warned = &warned;
    run_every(FLUSH, subscriptions, stop, |s| async move {
        if let Err(e) = s.flush().await {
            let mut last = warned.lock().unwrap_or_else(|p| p.into_inner());
            if last.is_none_or(|at| at.elapsed() > Duration::from_secs(30)) {
                tracing::warn!(error = %e, "subscription changes not stored yet; retrying");
                *last = Some(Instant::now());
            } else {
                tracing::debug!(error = %e, "subscription changes not stored yet; retrying");
            }
        }
    })
    .await;
}

#[cfg(all(test, feature = "testing"))]
mod tests;
