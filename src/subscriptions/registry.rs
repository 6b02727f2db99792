//! One node id's subscriptions: their state in memory ([`State`], plain data and the rules
//! that change it) and the [`Registry`] that stores it.
//!
//! Invariants:
//! - A subscription's `version` counts changes to its stored form and `written` the last
//!   version stored; `version > written` means its object is behind ("dirty"). What is
//!   stored is what cannot be found again: the definition, listed links, acked offsets (with
//!   the incarnation they belong to) and the generation block. A link a pattern made and
//!   nothing acked is not stored: after a restart the rescan links it again.
//! - Generations are handed out from blocks of [`GENERATION_BLOCK`]: the end of the block is
//!   what is stored, and it is stored before a wake of the block is delivered or claimed. A
//!   restart goes on after the stored end, so a generation is never handed out twice (and a
//!   wake costs no write of its own).
//! - `cursors[engine]` is how far the engine's changes were applied to the links in memory.
//!   `watermarks[engine]` is where the registry started watching the engine, stored before
//!   anything of the engine is applied: a restart (or the node that takes this one over)
//!   rescans every stream changed after it, skipping, for each subscription, streams whose
//!   last change is older than the subscription (`since`). Until it is stored,
//!   `starts[engine]` holds it: taken when the registry and the engine first meet (at
//!   open, at a takeover, before the engine takes any append through this process) and no
//!   later than any subscription's `since` for the engine, so every change a subscription
//!   must hear of is past it. The first watch of an engine rescans from it, and the start
//!   stays until its store succeeds (a failed store keeps it, the next round retries):
//!   no change is consumed without being observed or kept for a rescan.
//! - A link is pending while its tail is past its acked offset; a subscription with a
//!   pending link always has a wake (raised when the link became pending, or when the
//!   previous wake ended), so no data goes unannounced.
//! - At most [`MAX_WAKE_STREAMS`] streams are named in one wake; the rest come in the next.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use super::matching::{self, Pattern};
use super::store::{self, SigningKey, Store, StoredLink, StoredSubscription};
use super::{
    Caller, ClaimView, Definition, LinkView, RESERVED_PREFIX, SubscriptionError,
    SubscriptionLimits, Target, TargetView, View,
};
use crate::log::Lsn;
use crate::node::Node;
use crate::stream::StreamMark;

/// Most streams one wake names.
pub(super) const MAX_WAKE_STREAMS: usize = 1000;

/// How many generations one stored write reserves.
const GENERATION_BLOCK: u64 = 1024;

/// Longest wait before a failed delivery is tried again.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// What a link costs in the stored object and in memory, roughly (its name may double when
/// escaped).
fn link_bytes(name: &str) -> usize {
    2 * name.len() + 96
}

/// A stream a subscription watches.
#[derive(Debug, Clone)]
struct Link {
    explicit: bool,
    acked: u64,
    incarnation: Option<String>,
    /// The newest tail seen (not stored: found again after a restart).
    tail: u64,
}

impl Link {
    fn new(explicit: bool) -> Link {
        Link {
            explicit,
            acked: 0,
            incarnation: None,
            tail: 0,
        }
    }

    /// Takes in the stream's tail and incarnation; `true` when what is stored changed (a
    /// stream deleted and created again starts over at 0).
    fn note(&mut self, tail: u64, incarnation: &str) -> bool {
        match &self.incarnation {
            Some(i) if i == incarnation => {
                self.tail = self.tail.max(tail);
                false
            }
            known => {
                let recreated = known.is_some() || self.acked > tail;
                self.incarnation = Some(incarnation.to_owned());
                if recreated {
                    self.acked = 0;
                    self.tail = tail;
                } else {
                    self.tail = self.tail.max(tail);
                }
                true
            }
        }
    }

    fn pending(&self) -> bool {
        self.tail > self.acked
    }

    /// What is stored of it: listed links, and links with something acked.
    fn stored(&self) -> Option<StoredLink> {
        (self.explicit || self.acked > 0).then(|| StoredLink {
            explicit: self.explicit,
            acked: self.acked,
            incarnation: self.incarnation.clone(),
        })
    }
}

/// A subscription's current wake.
#[derive(Debug)]
struct Wake {
    id: String,
    generation: u64,
    token: String,
    /// The streams and tails it named when last delivered or claimed.
    streams: Vec<(String, u64)>,
    /// When to deliver it (again); `None` while a consumer holds it.
    due: Option<Instant>,
    /// Failed deliveries in a row.
    attempts: u32,
    /// A delivery task has it.
    delivering: bool,
    /// The pull-wake worker that claimed it, and until when.
    holder: Option<String>,
    lease_until: Option<Instant>,
}

fn token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// One subscription in memory.
#[derive(Debug)]
struct Sub {
    id: String,
    owner: Arc<str>,
    definition: Definition,
    pattern: Option<Pattern>,
    links: BTreeMap<String, Link>,
    /// Each engine's position when the subscription was made: a rescan skips streams whose
    /// last change is older.
    since: BTreeMap<String, Lsn>,
    /// The last generation handed out.
    generation: u64,
    /// The end of the block of generations reserved (what is stored).
    reserved: u64,
    wake: Option<Wake>,
    version: u64,
    written: u64,
    bytes: usize,
    /// A stream its pattern matched was not linked for lack of room (its links, its
    /// owner's share, the node's bytes): linked by the rescan after room frees (and by the
    /// rescan after a restart).
    overflowed: bool,
}

/// What one owner's subscriptions hold of a registry.
#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    subs: usize,
    bytes: usize,
}

/// What one owner (key) may hold of a node's cap: half, as with request bodies, so that
/// one key never leaves another without room.
pub(super) fn owner_share(cap: usize) -> usize {
    (cap / 2).max(1)
}

/// Whether `cost` more bytes fit the node's cap and `owner`'s share.
fn room_for(
    stored_bytes: usize,
    owners: &HashMap<Arc<str>, Usage>,
    owner: &Arc<str>,
    cost: usize,
    limits: &SubscriptionLimits,
) -> Result<(), SubscriptionError> {
    if stored_bytes + cost > limits.max_stored_bytes {
        return Err(SubscriptionError::TooMuchStored {
            stored: stored_bytes,
            limit: limits.max_stored_bytes,
        });
    }
    let held = owners.get(owner).map_or(0, |u| u.bytes);
    let share = owner_share(limits.max_stored_bytes);
    if held + cost > share {
        return Err(SubscriptionError::TooMuchStored {
            stored: held,
            limit: share,
        });
    }
    Ok(())
}

/// Adds `bytes` (and `subs`) to `owner`'s usage; negative to free.
fn charge(owners: &mut HashMap<Arc<str>, Usage>, owner: &Arc<str>, subs: isize, bytes: isize) {
    let usage = owners.entry(owner.clone()).or_default();
    usage.subs = usage.subs.saturating_add_signed(subs);
    usage.bytes = usage.bytes.saturating_add_signed(bytes);
    if usage.subs == 0 && usage.bytes == 0 {
        owners.remove(owner);
    }
}

fn signed(n: usize) -> isize {
    isize::try_from(n).unwrap_or(isize::MAX)
}

impl Sub {
    fn from_stored(stored: StoredSubscription) -> Sub {
        // Stored patterns were accepted under the limits of their time.
        let pattern = stored
            .definition
            .pattern
            .as_deref()
            .and_then(|p| Pattern::parse(p, None).ok());
        let mut sub = Sub {
            id: stored.id,
            owner: Arc::from(stored.owner),
            pattern,
            links: stored
                .links
                .into_iter()
                .map(|(name, l)| {
                    (
                        name,
                        Link {
                            explicit: l.explicit,
                            acked: l.acked,
                            incarnation: l.incarnation,
                            tail: 0,
                        },
                    )
                })
                .collect(),
            since: stored.since,
            // A restart goes on after every generation an earlier run may have used.
            generation: stored.generation,
            reserved: stored.generation,
            definition: stored.definition,
            wake: None,
            version: 0,
            written: 0,
            bytes: 0,
            overflowed: false,
        };
        sub.bytes = sub.base_bytes() + sub.links.keys().map(|n| link_bytes(n)).sum::<usize>();
        sub
    }

    fn stored(&self) -> StoredSubscription {
        StoredSubscription {
            format: 1,
            id: self.id.clone(),
            owner: self.owner.to_string(),
            definition: self.definition.clone(),
            // Where consumers reach the server is the live node's, set at delivery.
            base_url: String::new(),
            links: self
                .links
                .iter()
                .filter_map(|(name, l)| Some((name.clone(), l.stored()?)))
                .collect(),
            since: self.since.clone(),
            generation: self.reserved,
        }
    }

    /// What the subscription costs besides its links.
    fn base_bytes(&self) -> usize {
        self.id.len() + self.definition.bytes() + 256
    }

    fn wake_stream(&self) -> Option<&str> {
        match &self.definition.target {
            Target::PullWake { wake_stream } => Some(wake_stream),
            Target::Webhook { .. } => None,
        }
    }

    fn lease(&self) -> Duration {
        Duration::from_millis(self.definition.lease_ttl_ms)
    }

    fn pending(&self) -> bool {
        self.links.values().any(Link::pending)
    }

    /// Raises a wake when there is none and a link is pending (`known_pending` says one is,
    /// sparing the scan). Takes the next generation, reserving a new block (to be stored
    /// before delivery) when the stored one is used up.
    fn raise(&mut self, known_pending: bool, now: Instant) -> bool {
        if self.wake.is_some() || !(known_pending || self.pending()) {
            return false;
        }
        let generation = self.next_generation();
        self.wake = Some(Wake {
            id: token(),
            generation,
            token: token(),
            streams: Vec::new(),
            due: Some(now),
            attempts: 0,
            delivering: false,
            holder: None,
            lease_until: None,
        });
        true
    }

    /// The next generation, reserving a new block (to be stored before it is used) when the
    /// stored one is used up.
    fn next_generation(&mut self) -> u64 {
        self.generation += 1;
        if self.generation > self.reserved {
            self.reserved = self.generation.saturating_add(GENERATION_BLOCK - 1);
            self.version += 1;
        }
        self.generation
    }

    /// The pending streams and their tails, at most [`MAX_WAKE_STREAMS`].
    fn pending_streams(&self) -> Vec<(String, u64)> {
        self.links
            .iter()
            .filter(|(_, l)| l.pending())
            .take(MAX_WAKE_STREAMS)
            .map(|(p, l)| (p.clone(), l.tail))
            .collect()
    }

    fn accessible(&self, caller: &Caller) -> bool {
        caller.admin || *self.owner == *caller.subject
    }

    /// Takes in fresh tails of linked streams.
    fn note_tails(&mut self, tails: &HashMap<String, StreamMark>) {
        let mut changed = false;
        for (name, link) in self.links.iter_mut() {
            if let Some(mark) = tails.get(name) {
                changed |= note_stored(link, mark);
            }
        }
        if changed {
            self.version += 1;
        }
    }

    /// `base` is where consumers reach the server now (see [`State::payload`]).
    fn view(&self, caller: &Caller, key: &SigningKey, base: &str) -> View {
        let target = match &self.definition.target {
            Target::Webhook { url } => {
                let (url, redacted) = if *self.owner == *caller.subject {
                    (url.clone(), false)
                } else {
                    super::network::redacted_url(url)
                };
                TargetView::Webhook {
                    url,
                    redacted,
                    kid: key.kid().to_owned(),
                    jwks_url: format!("{base}{RESERVED_PREFIX}jwks.json"),
                }
            }
            Target::PullWake { wake_stream } => TargetView::PullWake {
                wake_stream: wake_stream.clone(),
            },
        };
        View {
            id: self.id.clone(),
            target,
            pattern: self.definition.pattern.clone(),
            description: self.definition.description.clone(),
            lease_ttl_ms: self.definition.lease_ttl_ms,
            overflowed: self.overflowed,
            streams: self
                .links
                .iter()
                .map(|(path, l)| LinkView {
                    path: path.clone(),
                    explicit: l.explicit,
                    acked: l.acked,
                    tail: l.tail,
                })
                .collect(),
        }
    }
}

/// How a delivery went.
#[derive(Debug)]
pub(super) enum Delivered {
    /// A webhook answered 2xx and `{"done": true}`: the wake's streams are acked.
    WebhookDone,
    /// A webhook answered 2xx: the consumer acks through the callback within the lease.
    Webhook,
    /// A pull-wake event was appended to the wake stream.
    Posted,
}

/// What a delivery sends.
#[derive(Debug)]
pub(super) struct Payload {
    pub(super) target: Target,
    pub(super) body: String,
}

/// A wake due for delivery.
#[derive(Debug)]
pub(super) struct Due {
    pub(super) id: String,
    pub(super) wake_id: String,
}

/// Which subscriptions may watch a stream, so that a change is matched against those only:
/// the ones that list it, and the ones whose pattern's literal head starts its name.
#[derive(Debug, Default)]
struct Index {
    /// Listed stream name -> the subscriptions that list it.
    listed: HashMap<String, HashSet<String>>,
    /// Pattern head -> the subscriptions with a pattern of that head.
    heads: HashMap<String, HashSet<String>>,
    /// How many heads there are of each length.
    head_lengths: BTreeMap<usize, usize>,
}

impl Index {
    fn add_listed(&mut self, id: &str, name: &str) {
        self.listed
            .entry(name.to_owned())
            .or_default()
            .insert(id.to_owned());
    }

    fn remove_listed(&mut self, id: &str, name: &str) {
        if let Some(ids) = self.listed.get_mut(name) {
            ids.remove(id);
            if ids.is_empty() {
                self.listed.remove(name);
            }
        }
    }

    fn add(&mut self, sub: &Sub) {
        if let Some(head) = sub.pattern.as_ref().map(Pattern::head) {
            let ids = self.heads.entry(head.to_owned()).or_default();
            if ids.is_empty() {
                *self.head_lengths.entry(head.len()).or_default() += 1;
            }
            ids.insert(sub.id.clone());
        }
        for (name, link) in &sub.links {
            if link.explicit {
                self.add_listed(&sub.id, name);
            }
        }
    }

    fn remove(&mut self, sub: &Sub) {
        if let Some(head) = sub.pattern.as_ref().map(Pattern::head)
            && let Some(ids) = self.heads.get_mut(head)
        {
            ids.remove(&sub.id);
            if ids.is_empty() {
                self.heads.remove(head);
                if let Some(n) = self.head_lengths.get_mut(&head.len()) {
                    *n -= 1;
                    if *n == 0 {
                        self.head_lengths.remove(&head.len());
                    }
                }
            }
        }
        for (name, link) in &sub.links {
            if link.explicit {
                self.remove_listed(&sub.id, name);
            }
        }
    }

    /// The subscriptions that may watch stream `name` (one lookup per distinct head length,
    /// at most the longest pattern's bytes).
    fn candidates(&self, name: &str) -> Vec<String> {
        let mut found: HashSet<&String> = HashSet::new();
        if let Some(ids) = self.listed.get(name) {
            found.extend(ids);
        }
        for len in self.head_lengths.keys().take_while(|l| **l <= name.len()) {
            if let Some(head) = name.get(..*len)
                && let Some(ids) = self.heads.get(head)
            {
                found.extend(ids);
            }
        }
        found.into_iter().cloned().collect()
    }
}

/// Every subscription of one node id, in memory.
#[derive(Debug, Default)]
pub(super) struct State {
    subs: HashMap<String, Sub>,
    index: Index,
    /// Removed; their objects are deleted at the next write.
    deleted: HashSet<String>,
    /// How far each attached engine's changes are applied to the links in memory.
    cursors: HashMap<String, Lsn>,
    /// Where this registry started watching each engine (as stored).
    watermarks: BTreeMap<String, Lsn>,
    /// Where this registry starts watching engines whose watermark is not stored yet.
    starts: HashMap<String, Lsn>,
    stored_bytes: usize,
    /// What each owner holds (against [`owner_share`] of the caps).
    owners: HashMap<Arc<str>, Usage>,
    /// Links a pattern matched but the limits did not leave room for.
    refused_links: u64,
    /// Room was freed since the last [`State::take_rescan`].
    freed: bool,
}

fn backoff(attempts: u32) -> Duration {
    Duration::from_secs(1u64 << attempts.saturating_sub(1).min(6)).min(MAX_BACKOFF)
}

impl State {
    fn get(&self, caller: &Caller, id: &str) -> Result<&Sub, SubscriptionError> {
        self.subs
            .get(id)
            .filter(|s| s.accessible(caller))
            .ok_or(SubscriptionError::NotFound)
    }

    fn get_mut(&mut self, caller: &Caller, id: &str) -> Result<&mut Sub, SubscriptionError> {
        self.subs
            .get_mut(id)
            .filter(|s| s.accessible(caller))
            .ok_or(SubscriptionError::NotFound)
    }

    /// Whether `caller` may reach subscription `id` (`false` when there is none).
    pub(super) fn accessible(&self, caller: &Caller, id: &str) -> bool {
        self.subs.get(id).is_some_and(|s| s.accessible(caller))
    }

    /// Whether `token` is the token of subscription `id`'s current wake.
    pub(super) fn wake_token_matches(&self, id: &str, token: Option<&str>) -> bool {
        self.subs
            .get(id)
            .and_then(|s| s.wake.as_ref())
            .is_some_and(|w| token_matches(&w.token, token))
    }

    /// Every subscription id.
    pub(super) fn ids(&self) -> Vec<String> {
        self.subs.keys().cloned().collect()
    }

    pub(super) fn contains(&self, id: &str) -> bool {
        self.subs.contains_key(id)
    }

    pub(super) fn len(&self) -> usize {
        self.subs.len()
    }

    /// Creates subscription `id` (`true`), or finds the same one (`false`): the caller's,
    /// with an equal definition. Another definition, or another key's subscription, is a
    /// conflict.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn create(
        &mut self,
        caller: &Caller,
        id: &str,
        definition: Definition,
        since: BTreeMap<String, Lsn>,
        tails: &HashMap<String, StreamMark>,
        limits: &SubscriptionLimits,
        now: Instant,
    ) -> Result<bool, SubscriptionError> {
        if let Some(existing) = self.subs.get(id) {
            return if existing.accessible(caller) && existing.definition == definition {
                Ok(false)
            } else {
                Err(SubscriptionError::Conflict)
            };
        }
        if self.subs.len() >= limits.max_subscriptions {
            return Err(SubscriptionError::TooManySubscriptions(
                limits.max_subscriptions,
            ));
        }
        let share = owner_share(limits.max_subscriptions);
        if self.owners.get(&caller.subject).map_or(0, |u| u.subs) >= share {
            return Err(SubscriptionError::TooManySubscriptions(share));
        }
        let pattern = match definition.pattern.as_deref() {
            Some(p) => Some(
                Pattern::parse(p, Some((limits.max_pattern_bytes, limits.max_wildcards)))
                    .map_err(|e| SubscriptionError::InvalidPattern(e.to_string()))?,
            ),
            None => None,
        };
        let mut sub = Sub {
            id: id.to_owned(),
            owner: caller.subject.clone(),
            pattern,
            links: definition
                .streams
                .iter()
                .map(|name| (name.clone(), Link::new(true)))
                .collect(),
            since,
            definition,
            generation: 0,
            reserved: 0,
            wake: None,
            version: 1,
            written: 0,
            bytes: 0,
            overflowed: false,
        };
        sub.bytes = sub.base_bytes() + sub.links.keys().map(|n| link_bytes(n)).sum::<usize>();
        room_for(
            self.stored_bytes,
            &self.owners,
            &sub.owner,
            sub.bytes,
            limits,
        )?;
        // What is accepted must load back after a restart.
        store::encode(&sub.stored()).map_err(SubscriptionError::Invalid)?;
        sub.note_tails(tails);
        sub.raise(false, now);
        self.stored_bytes += sub.bytes;
        charge(&mut self.owners, &sub.owner, 1, signed(sub.bytes));
        self.deleted.remove(id);
        self.index.add(&sub);
        self.subs.insert(id.to_owned(), sub);
        Ok(true)
    }

    pub(super) fn view(
        &self,
        caller: &Caller,
        id: &str,
        key: &SigningKey,
        base: &str,
    ) -> Result<View, SubscriptionError> {
        Ok(self.get(caller, id)?.view(caller, key, base))
    }

    pub(super) fn delete(&mut self, caller: &Caller, id: &str) -> Result<(), SubscriptionError> {
        self.get(caller, id)?;
        if let Some(sub) = self.subs.remove(id) {
            self.index.remove(&sub);
            self.stored_bytes = self.stored_bytes.saturating_sub(sub.bytes);
            charge(&mut self.owners, &sub.owner, -1, -signed(sub.bytes));
            self.freed = true;
            self.deleted.insert(id.to_owned());
        }
        Ok(())
    }

    /// Links `names` explicitly.
    pub(super) fn add_streams(
        &mut self,
        caller: &Caller,
        id: &str,
        names: &[String],
        tails: &HashMap<String, StreamMark>,
        limits: &SubscriptionLimits,
        now: Instant,
    ) -> Result<(), SubscriptionError> {
        let stored = self.stored_bytes;
        let sub = self
            .subs
            .get_mut(id)
            .filter(|s| s.accessible(caller))
            .ok_or(SubscriptionError::NotFound)?;
        let added: HashSet<&String> = names
            .iter()
            .filter(|n| !sub.links.contains_key(*n))
            .collect();
        if sub.links.len() + added.len() > limits.max_links {
            return Err(SubscriptionError::TooManyStreams(limits.max_links));
        }
        let more: usize = added.iter().map(|n| link_bytes(n)).sum();
        room_for(stored, &self.owners, &sub.owner, more, limits)?;
        for name in names {
            sub.links
                .entry(name.clone())
                .or_insert_with(|| Link::new(true))
                .explicit = true;
        }
        sub.bytes += more;
        sub.version += 1;
        sub.note_tails(tails);
        sub.raise(false, now);
        self.stored_bytes += more;
        charge(&mut self.owners, &sub.owner, 0, signed(more));
        for name in names {
            self.index.add_listed(id, name);
        }
        Ok(())
    }

    pub(super) fn remove_stream(
        &mut self,
        caller: &Caller,
        id: &str,
        name: &str,
    ) -> Result<(), SubscriptionError> {
        let sub = self.get_mut(caller, id)?;
        let Some(link) = sub.links.remove(name) else {
            return Ok(());
        };
        let freed = link_bytes(name);
        sub.bytes = sub.bytes.saturating_sub(freed);
        sub.version += 1;
        let owner = sub.owner.clone();
        self.stored_bytes = self.stored_bytes.saturating_sub(freed);
        charge(&mut self.owners, &owner, 0, -signed(freed));
        self.freed = true;
        if link.explicit {
            self.index.remove_listed(id, name);
        }
        Ok(())
    }

    /// The names a subscription links (for a refresh of their tails).
    pub(super) fn linked(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<Vec<String>, SubscriptionError> {
        Ok(self.get(caller, id)?.links.keys().cloned().collect())
    }

    /// Every linked name of every subscription.
    pub(super) fn all_linked(&self) -> HashSet<String> {
        self.subs
            .values()
            .flat_map(|s| s.links.keys().cloned())
            .collect()
    }

    /// Stream `name` of engine `engine` stands at `mark`: links it to the subscriptions
    /// whose pattern matches, and raises their wakes. In a rescan, a subscription is not
    /// linked to a stream whose last change is older than the subscription.
    pub(super) fn observe(
        &mut self,
        engine: &str,
        name: &str,
        mark: &StreamMark,
        rescan: bool,
        limits: &SubscriptionLimits,
        now: Instant,
    ) {
        let State {
            subs,
            index,
            stored_bytes,
            owners,
            refused_links,
            ..
        } = self;
        for id in index.candidates(name) {
            let Some(sub) = subs.get_mut(&id) else {
                continue;
            };
            // A subscription never wakes itself with its own wake events.
            if sub.wake_stream() == Some(name) {
                continue;
            }
            if !sub.links.contains_key(name) {
                if !sub.pattern.as_ref().is_some_and(|p| p.matches(name))
                    || (rescan
                        && sub
                            .since
                            .get(engine)
                            .is_some_and(|s| mark.changed_lsn <= *s))
                {
                    continue;
                }
                let cost = link_bytes(name);
                if sub.links.len() >= limits.max_links
                    || room_for(*stored_bytes, owners, &sub.owner, cost, limits).is_err()
                {
                    // Linked by the rescan that follows freed room, or a restart.
                    *refused_links += 1;
                    sub.overflowed = true;
                    continue;
                }
                // Not stored until something is acked: a rescan finds it again.
                sub.links.insert(name.to_owned(), Link::new(false));
                sub.bytes += cost;
                *stored_bytes += cost;
                charge(owners, &sub.owner, 0, signed(cost));
            }
            let Some(link) = sub.links.get_mut(name) else {
                continue;
            };
            if note_stored(link, mark) {
                sub.version += 1;
            }
            let pending = link.pending();
            sub.raise(pending, now);
        }
    }

    /// Takes in fresh tails for every subscription (after a restart or a takeover).
    pub(super) fn note_all_tails(&mut self, tails: &HashMap<String, StreamMark>, now: Instant) {
        for sub in self.subs.values_mut() {
            sub.note_tails(tails);
            sub.raise(false, now);
        }
    }

    /// Whether the engines should be rescanned for streams overflowed subscriptions' patterns
    /// match: room was freed since the last call and a subscription overflowed. Their marks
    /// are cleared; the rescan sets them again where room is still short.
    pub(super) fn take_rescan(&mut self) -> bool {
        if !std::mem::take(&mut self.freed) {
            return false;
        }
        let mut any = false;
        for sub in self.subs.values_mut() {
            any |= std::mem::take(&mut sub.overflowed);
        }
        any
    }

    /// How many pattern links the limits refused since the last call.
    pub(super) fn take_refused_links(&mut self) -> u64 {
        std::mem::take(&mut self.refused_links)
    }

    pub(super) fn cursor(&self, engine: &str) -> Option<Lsn> {
        self.cursors.get(engine).copied()
    }

    pub(super) fn watermark(&self, engine: &str) -> Option<Lsn> {
        self.watermarks.get(engine).copied()
    }

    /// Where this registry watches engine `engine` from: its stored watermark, or the start
    /// not stored yet.
    pub(super) fn watched_from(&self, engine: &str) -> Option<Lsn> {
        self.watermark(engine)
            .or_else(|| self.starts.get(engine).copied())
    }

    /// Notes that this registry watches engine `engine`, whose applied LSN is `applied`
    /// now: unless it has a watermark or a start for it already, it starts at `applied`,
    /// or earlier at the earliest `since` a subscription holds for the engine (a
    /// subscription made before the watermark was stored: changes after it are news to
    /// it). Returns where the registry watches the engine from.
    pub(super) fn begin_watch(&mut self, engine: &str, applied: Lsn) -> Lsn {
        if let Some(from) = self.watched_from(engine) {
            return from;
        }
        let start = self
            .subs
            .values()
            .filter_map(|s| s.since.get(engine).copied())
            .fold(applied, Lsn::min);
        self.starts.insert(engine.to_owned(), start);
        start
    }

    pub(super) fn set_cursor(&mut self, engine: &str, lsn: Lsn) {
        self.cursors.insert(engine.to_owned(), lsn);
    }

    /// Forgets the cursors of engines no longer served (their watermarks stay stored).
    pub(super) fn keep_cursors(&mut self, engines: &HashSet<&str>) {
        self.cursors.retain(|e, _| engines.contains(e.as_str()));
    }

    /// Applies a consumer's acks to the current wake; `done` ends it. Acks never pass the
    /// stream's tail as last seen (`tails` holds fresher ones). Returns whether anything is
    /// still pending (another wake follows).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn ack(
        &mut self,
        id: &str,
        token: Option<&str>,
        wake_id: &str,
        generation: u64,
        acks: &[(String, u64)],
        done: bool,
        tails: &HashMap<String, StreamMark>,
        now: Instant,
    ) -> Result<bool, SubscriptionError> {
        let sub = self.subs.get_mut(id).ok_or(SubscriptionError::Fenced)?;
        let current = sub.wake.as_ref().is_some_and(|w| {
            token_matches(&w.token, token) && w.id == wake_id && w.generation == generation
        });
        if !current {
            return Err(SubscriptionError::Fenced);
        }
        sub.note_tails(tails);
        let progress = apply_acks(sub, acks);
        let lease = sub.lease();
        if done {
            sub.wake = None;
            if sub.raise(false, now)
                && !progress
                && let Some(w) = sub.wake.as_mut()
            {
                // Done without acking anything that was pending: the next wake waits a
                // lease rather than following at once, again and again.
                w.due = Some(now + lease);
            }
        } else if let Some(w) = sub.wake.as_mut()
            && w.holder.is_none()
            && !w.delivering
        {
            // A webhook consumer that acks is alive: its lease starts again.
            w.due = Some(now + lease);
        } else if let Some(w) = sub.wake.as_mut()
            && w.holder.is_some()
        {
            w.lease_until = Some(now + lease);
        }
        Ok(sub.pending())
    }

    /// A worker claims the subscription's wake (raising one when streams are pending).
    /// `None`: nothing is pending.
    pub(super) fn claim(
        &mut self,
        caller: &Caller,
        id: &str,
        worker: &str,
        tails: &HashMap<String, StreamMark>,
        now: Instant,
    ) -> Result<Option<ClaimView>, SubscriptionError> {
        let sub = self.get_mut(caller, id)?;
        sub.note_tails(tails);
        if let Some(w) = &sub.wake
            && let (Some(holder), Some(until)) = (&w.holder, w.lease_until)
            && until > now
            && holder != worker
        {
            return Err(SubscriptionError::AlreadyClaimed {
                holder: holder.clone(),
            });
        }
        let fresh = sub.wake.is_none();
        if fresh && !sub.raise(false, now) {
            return Ok(None);
        }
        if !fresh {
            // Each claim is a new holding: a worker whose lease ran out (or that released
            // it) is fenced by a new generation and token.
            let generation = sub.next_generation();
            if let Some(w) = sub.wake.as_mut() {
                w.generation = generation;
                w.token = token();
            }
        }
        let lease = sub.lease();
        let streams = sub.pending_streams();
        let Some(w) = sub.wake.as_mut() else {
            return Ok(None);
        };
        w.holder = Some(worker.to_owned());
        w.lease_until = Some(now + lease);
        w.due = None;
        w.streams = streams.clone();
        Ok(Some(ClaimView {
            wake_id: w.id.clone(),
            generation: w.generation,
            token: w.token.clone(),
            streams,
        }))
    }

    /// The claiming worker gives the wake back: it is announced again for another.
    pub(super) fn release(
        &mut self,
        id: &str,
        token: Option<&str>,
        wake_id: &str,
        generation: Option<u64>,
        now: Instant,
    ) -> Result<(), SubscriptionError> {
        let w = self
            .subs
            .get_mut(id)
            .and_then(|s| s.wake.as_mut())
            .filter(|w| {
                token_matches(&w.token, token)
                    && w.id == wake_id
                    && generation.is_none_or(|g| g == w.generation)
            })
            .ok_or(SubscriptionError::Fenced)?;
        w.holder = None;
        w.lease_until = None;
        w.due = Some(now);
        Ok(())
    }

    /// The wakes due for delivery now, oldest first, each that `admit` lets go (given its
    /// owner: a delivery slot, or `None` to leave the wake due for a later round); each
    /// taken is marked as being delivered. A pull-wake claim whose lease ran out frees its
    /// wake first.
    pub(super) fn take_due<T>(
        &mut self,
        now: Instant,
        mut admit: impl FnMut(&Arc<str>) -> Option<T>,
    ) -> Vec<(Due, T)> {
        let mut due: Vec<(Instant, &mut Sub)> = Vec::new();
        for sub in self.subs.values_mut() {
            let Some(w) = sub.wake.as_mut() else {
                continue;
            };
            if w.holder.is_some() && w.lease_until.is_some_and(|until| until <= now) {
                w.holder = None;
                w.lease_until = None;
                w.due = Some(now);
            }
            if let Some(at) = w.due
                && at <= now
                && !w.delivering
            {
                due.push((at, sub));
            }
        }
        due.sort_by_key(|(at, _)| *at);
        due.into_iter()
            .filter_map(|(_, sub)| {
                let w = sub.wake.as_mut()?;
                let admitted = admit(&sub.owner)?;
                w.delivering = true;
                Some((
                    Due {
                        id: sub.id.clone(),
                        wake_id: w.id.clone(),
                    },
                    admitted,
                ))
            })
            .collect()
    }

    /// [`State::take_due`] with at most `limit` taken, whoever owns them.
    #[cfg(test)]
    pub(super) fn take_due_n(&mut self, now: Instant, limit: usize) -> Vec<Due> {
        let mut left = limit;
        self.take_due(now, |_| {
            left = left.checked_sub(1)?;
            Some(())
        })
        .into_iter()
        .map(|(due, ())| due)
        .collect()
    }

    /// Whether subscription `id` has a wake (raised, out, or claimed).
    #[cfg(test)]
    pub(super) fn has_wake(&self, id: &str) -> bool {
        self.subs.get(id).is_some_and(|s| s.wake.is_some())
    }

    /// The pending streams of `id`, to look up before a delivery ([`State::settle`]).
    pub(super) fn pending_names(&self, id: &str) -> Vec<String> {
        self.subs.get(id).map_or_else(Vec::new, |sub| {
            sub.links
                .iter()
                .filter(|(_, l)| l.pending())
                .map(|(name, _)| name.clone())
                .collect()
        })
    }

    /// Takes in where `id`'s pending streams stand (`marks`): the ones no engine holds any
    /// more were deleted, and have nothing to read. A listed one starts over (at 0 when it
    /// is created again); one a pattern linked is unlinked.
    pub(super) fn settle(
        &mut self,
        id: &str,
        pending: &[String],
        marks: &HashMap<String, StreamMark>,
    ) {
        let State {
            subs,
            stored_bytes,
            owners,
            freed,
            ..
        } = self;
        let Some(sub) = subs.get_mut(id) else {
            return;
        };
        let mut changed = false;
        for name in pending {
            if let Some(mark) = marks.get(name) {
                if let Some(link) = sub.links.get_mut(name) {
                    changed |= note_stored(link, mark);
                }
                continue;
            }
            let Some(link) = sub.links.get_mut(name) else {
                continue;
            };
            if link.explicit {
                let before = link.stored();
                *link = Link::new(true);
                changed |= link.stored() != before;
            } else if let Some(gone) = sub.links.remove(name) {
                changed |= gone.stored().is_some();
                let cost = link_bytes(name);
                sub.bytes = sub.bytes.saturating_sub(cost);
                *stored_bytes = stored_bytes.saturating_sub(cost);
                charge(owners, &sub.owner, 0, -signed(cost));
                *freed = true;
            }
        }
        if changed {
            sub.version += 1;
        }
    }

    /// What to send for wake `wake_id` of `id`: its pending streams now (remembered as what
    /// the wake named). `None` when the wake is no longer current, or (ending it) when
    /// nothing is pending any more. `base` is where consumers reach the server now: the
    /// configured advertise URL of the process delivering (after a takeover, the live
    /// node's), or empty (the callback URL is then a path on the server that sent it);
    /// never a client's `Host` header.
    pub(super) fn payload(&mut self, id: &str, wake_id: &str, base: &str) -> Option<Payload> {
        let sub = self.subs.get_mut(id)?;
        let streams = sub.pending_streams();
        if streams.is_empty() {
            if sub.wake.as_ref().is_some_and(|w| w.id == wake_id) {
                sub.wake = None;
            }
            return None;
        }
        let w = sub.wake.as_mut().filter(|w| w.id == wake_id)?;
        w.streams = streams;
        let body = match &sub.definition.target {
            Target::Webhook { .. } => json!({
                "subscription_id": sub.id,
                "callback_url": format!(
                    "{base}{RESERVED_PREFIX}subscriptions/{}/callback",
                    encode_segment(&sub.id)
                ),
                "callback_token": w.token,
                "wake_id": w.id,
                "generation": w.generation,
                "streams": super::streams_json(&w.streams, Some(true)),
            }),
            Target::PullWake { .. } => json!({
                "subscription_id": sub.id,
                "wake_id": w.id,
                "generation": w.generation,
                "streams": super::streams_json(&w.streams, None),
            }),
        };
        Some(Payload {
            target: sub.definition.target.clone(),
            body: body.to_string(),
        })
    }

    /// Records how delivering wake `wake_id` of `id` went.
    pub(super) fn delivered(
        &mut self,
        id: &str,
        wake_id: &str,
        outcome: &Result<Delivered, String>,
        now: Instant,
    ) {
        let Some(sub) = self.subs.get_mut(id) else {
            return;
        };
        let lease = sub.lease();
        let Some(w) = sub.wake.as_mut().filter(|w| w.id == wake_id) else {
            return;
        };
        w.delivering = false;
        match outcome {
            Ok(Delivered::WebhookDone) => {
                let acks = std::mem::take(&mut w.streams);
                apply_acks(sub, &acks);
                sub.wake = None;
                sub.raise(false, now);
            }
            Ok(Delivered::Webhook) => {
                w.attempts = 0;
                // Delivered again if the consumer neither acks nor finishes within its lease.
                w.due = Some(now + lease);
            }
            Ok(Delivered::Posted) => {
                w.attempts = 0;
                if w.holder.is_none() && w.due.is_some_and(|d| d <= now) {
                    // Announced: workers claim it from the event.
                    w.due = None;
                }
            }
            Err(_) => {
                w.attempts = w.attempts.saturating_add(1);
                w.due = Some(now + backoff(w.attempts));
            }
        }
    }

    /// The subscriptions whose objects are behind, and the removed ones still stored.
    pub(super) fn dirty(&self) -> (Vec<String>, Vec<String>) {
        (
            self.subs
                .values()
                .filter(|s| s.version > s.written)
                .map(|s| s.id.clone())
                .collect(),
            self.deleted.iter().cloned().collect(),
        )
    }

    /// What storing `id` takes now: its stored form and the version it is, or a delete.
    pub(super) fn to_store(&self, id: &str) -> Result<ToStore, SubscriptionError> {
        match self.subs.get(id) {
            Some(sub) if sub.version > sub.written => Ok(ToStore::Write(
                sub.version,
                store::encode(&sub.stored()).map_err(SubscriptionError::Unavailable)?,
            )),
            Some(_) => Ok(ToStore::Nothing),
            None if self.deleted.contains(id) => Ok(ToStore::Delete),
            None => Ok(ToStore::Nothing),
        }
    }

    pub(super) fn stored(&mut self, id: &str, what: &ToStore) {
        match what {
            ToStore::Write(version, _) => {
                if let Some(sub) = self.subs.get_mut(id) {
                    sub.written = sub.written.max(*version);
                }
            }
            ToStore::Delete => {
                if !self.subs.contains_key(id) {
                    self.deleted.remove(id);
                }
            }
            ToStore::Nothing => {}
        }
    }

    /// The watermarks with engine `engine` added at `lsn`.
    pub(super) fn watermarks_with(&self, engine: &str, lsn: Lsn) -> BTreeMap<String, Lsn> {
        let mut next = self.watermarks.clone();
        next.insert(engine.to_owned(), lsn);
        next
    }

    pub(super) fn watermarks_stored(&mut self, watermarks: BTreeMap<String, Lsn>) {
        self.starts
            .retain(|engine, _| !watermarks.contains_key(engine));
        self.watermarks = watermarks;
    }
}

/// What storing one subscription takes.
#[derive(Debug)]
pub(super) enum ToStore {
    Write(u64, Vec<u8>),
    Delete,
    Nothing,
}

/// Takes a stream's mark into a link; `true` when what is stored of the link changed.
fn note_stored(link: &mut Link, mark: &StreamMark) -> bool {
    let before = link.stored();
    link.note(mark.tail, &mark.incarnation);
    link.stored() != before
}

/// Applies acks (never past a link's tail); `true` when any moved.
fn apply_acks(sub: &mut Sub, acks: &[(String, u64)]) -> bool {
    let mut changed = false;
    for (path, offset) in acks {
        if let Some(link) = sub.links.get_mut(path) {
            let acked = (*offset).min(link.tail).max(link.acked);
            changed |= acked != link.acked;
            link.acked = acked;
        }
    }
    if changed {
        sub.version += 1;
    }
    changed
}

/// Whether a presented wake token is the wake's, compared in constant time.
fn token_matches(token: &str, presented: Option<&str>) -> bool {
    use subtle::ConstantTimeEq as _;
    presented
        .is_some_and(|p| p.len() == token.len() && bool::from(p.as_bytes().ct_eq(token.as_bytes())))
}

/// A path segment with everything but unreserved characters percent-encoded.
fn encode_segment(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// One node id's subscriptions: the state, and where it is stored.
pub(crate) struct Registry {
    node: Arc<Node>,
    store: Store,
    key: Arc<SigningKey>,
    limits: Arc<SubscriptionLimits>,
    state: Mutex<State>,
    /// Writes of one subscription's object, one at a time (striped by id).
    stripes: Vec<tokio::sync::Mutex<()>>,
    /// One flush at a time.
    flushing: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("node", &self.node.id())
            .finish_non_exhaustive()
    }
}

const STRIPES: usize = 16;

impl Registry {
    /// Loads node `node`'s subscriptions.
    pub(super) async fn load(
        storage: crate::storage::Storage,
        node: Arc<Node>,
        limits: Arc<SubscriptionLimits>,
    ) -> Result<Registry, SubscriptionError> {
        let store = Store::new(storage, node.id(), limits.store_timeout);
        let loaded = store.load().await?;
        let key = store.signing_key().await?;
        let mut state = State {
            watermarks: loaded.watermarks.unwrap_or_default(),
            ..State::default()
        };
        for stored in loaded.subscriptions {
            let mut sub = Sub::from_stored(stored);
            // Written as loaded.
            sub.version = 1;
            sub.written = 1;
            state.stored_bytes += sub.bytes;
            charge(&mut state.owners, &sub.owner, 1, signed(sub.bytes));
            state.index.add(&sub);
            state.subs.insert(sub.id.clone(), sub);
        }
        Ok(Registry {
            node,
            store,
            key,
            limits,
            state: Mutex::new(state),
            stripes: (0..STRIPES).map(|_| tokio::sync::Mutex::new(())).collect(),
            flushing: tokio::sync::Mutex::new(()),
        })
    }

    pub(super) fn node_id(&self) -> &str {
        self.node.id()
    }

    pub(super) fn is_fenced(&self) -> bool {
        self.node.is_fenced()
    }

    pub(super) fn key(&self) -> &Arc<SigningKey> {
        &self.key
    }

    pub(super) fn limits(&self) -> &SubscriptionLimits {
        &self.limits
    }

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn is_empty(&self) -> bool {
        self.state().len() == 0
    }

    fn stripe(&self, id: &str) -> &tokio::sync::Mutex<()> {
        let digest = ring::digest::digest(&ring::digest::SHA256, id.as_bytes());
        let index = usize::from(digest.as_ref()[0]) % STRIPES;
        &self.stripes[index]
    }

    /// Stores subscription `id` as it is now (or deletes its object, if it was removed);
    /// returns once that state, or a newer one, is stored.
    pub(super) async fn persist(&self, id: &str) -> Result<(), SubscriptionError> {
        let _writing = self.stripe(id).lock().await;
        let what = self.state().to_store(id)?;
        if matches!(what, ToStore::Nothing) {
            return Ok(());
        }
        // A fenced node's write would overwrite the new owner's.
        if self.node.is_fenced() {
            return Err(SubscriptionError::Unavailable(format!(
                "node {} was taken over; its subscriptions are served elsewhere",
                self.node.id()
            )));
        }
        match &what {
            ToStore::Write(_, bytes) => self.store.write(id, bytes.clone()).await?,
            ToStore::Delete => self.store.delete(id).await?,
            ToStore::Nothing => {}
        }
        self.state().stored(id, &what);
        Ok(())
    }

    /// Writes every subscription whose object is behind, and deletes removed ones.
    pub(super) async fn flush(&self) -> Result<(), SubscriptionError> {
        let _flushing = self.flushing.lock().await;
        let (dirty, deleted) = self.state().dirty();
        if dirty.is_empty() && deleted.is_empty() {
            return Ok(());
        }
        self.node
            .ensure_current()
            .await
            .map_err(|e| SubscriptionError::Unavailable(e.to_string()))?;
        let writes = dirty
            .into_iter()
            .chain(deleted)
            .map(|id| async move { self.persist(&id).await });
        let results: Vec<Result<(), SubscriptionError>> = futures::StreamExt::collect(
            futures::StreamExt::buffer_unordered(futures::stream::iter(writes), 8),
        )
        .await;
        results.into_iter().collect::<Result<Vec<()>, _>>()?;
        Ok(())
    }

    /// Stores that this registry watches engine `engine` from `lsn` on (before anything of
    /// the engine is applied, so that a restart rescans from there).
    pub(super) async fn watch_from(&self, engine: &str, lsn: Lsn) -> Result<(), SubscriptionError> {
        if self.node.is_fenced() {
            return Err(SubscriptionError::Unavailable(format!(
                "node {} was taken over",
                self.node.id()
            )));
        }
        let next = self.state().watermarks_with(engine, lsn);
        self.store.write_watermarks(&next).await?;
        self.state().watermarks_stored(next);
        Ok(())
    }

    /// The limits' refusals since the last call, logged.
    pub(super) fn log_refusals(&self) {
        let refused = self.state().take_refused_links();
        if refused > 0 {
            tracing::warn!(
                node = %self.node.id(),
                refused,
                max_links = self.limits.max_links,
                max_stored_bytes = self.limits.max_stored_bytes,
                "streams matched subscription patterns but were not linked: the subscriptions are at their limits"
            );
        }
    }
}

/// Whether `name` could be linked, for requests that list names.
pub(super) fn check_names(names: &[String]) -> Result<(), SubscriptionError> {
    match names.iter().find(|n| !matching::valid_stream_name(n)) {
        Some(bad) => Err(SubscriptionError::Invalid(format!(
            "{bad:?} is not a stream name"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(subject: &str, admin: bool) -> Caller {
        Caller {
            subject: Arc::from(subject),
            admin,
        }
    }

    fn webhook(pattern: &str) -> Definition {
        Definition::new(
            Target::Webhook {
                url: "https://example.com/h?token=secret".into(),
            },
            Some(pattern.into()),
            Vec::new(),
            Some(1000),
            None,
        )
    }

    /// A state holding alice's webhook subscription `s` of `pattern`.
    fn subscribed(pattern: &str) -> (State, Caller, SubscriptionLimits, Instant) {
        let limits = SubscriptionLimits::default();
        let now = Instant::now();
        let mut state = State::default();
        let alice = caller("alice", false);
        let created = state
            .create(
                &alice,
                "s",
                webhook(pattern),
                BTreeMap::new(),
                &no_tails(),
                &limits,
                now,
            )
            .unwrap();
        assert!(created);
        (state, alice, limits, now)
    }

    /// The current wake of `s`: its token and generation.
    fn current(state: &State) -> (String, u64) {
        let w = state.subs["s"].wake.as_ref().unwrap();
        (w.token.clone(), w.generation)
    }

    fn no_tails() -> HashMap<String, StreamMark> {
        HashMap::new()
    }

    fn mark(tail: u64, incarnation: &str) -> StreamMark {
        StreamMark {
            tail,
            incarnation: incarnation.to_owned(),
            changed_lsn: 1,
        }
    }

    #[test]
    fn data_raises_a_wake_that_ends_only_when_acked_to_the_tail() {
        let (mut state, _, limits, now) = subscribed("events/*");
        state.observe("n", "events/a", &mark(10, "i1"), false, &limits, now);
        state.observe("n", "other/a", &mark(10, "i1"), false, &limits, now);
        let due = state.take_due_n(now, 10);
        assert_eq!(due.len(), 1);
        let payload = state.payload("s", &due[0].wake_id, "http://n").unwrap();
        assert!(payload.body.contains("events/a"), "{}", payload.body);
        assert!(!payload.body.contains("other/a"));
        // More data while the wake is out; the consumer says done for what it was told.
        state.observe("n", "events/b", &mark(5, "i1"), false, &limits, now);
        state.delivered("s", &due[0].wake_id, &Ok(Delivered::WebhookDone), now);
        // events/b is still pending: a new wake, with a new generation, at once.
        let again = state.take_due_n(now, 10);
        assert_eq!(again.len(), 1);
        assert_ne!(again[0].wake_id, due[0].wake_id);
        let payload = state.payload("s", &again[0].wake_id, "http://n").unwrap();
        assert!(payload.body.contains("events/b"));
        assert!(!payload.body.contains("events/a"));
    }

    #[test]
    fn wakes_carry_the_delivering_nodes_url_never_a_stored_host() {
        let (mut state, alice, limits, now) = subscribed("e/*");
        // An object an earlier version stored with a client's `Host` in it.
        let mut stored = state.subs["s"].stored();
        stored.base_url = "http://evil.example".into();
        state.subs.insert("s".into(), Sub::from_stored(stored));
        state.observe("n", "e/a", &mark(1, "i"), false, &limits, now);
        let due = state.take_due_n(now, 10);
        let payload = state
            .payload("s", &due[0].wake_id, "http://live:7")
            .unwrap();
        let body: serde_json::Value = serde_json::from_str(&payload.body).unwrap();
        assert_eq!(
            body["callback_url"],
            "http://live:7/v1/stream/__ds/subscriptions/s/callback"
        );
        let view = state
            .view(&alice, "s", &signing_key(), "http://live:7")
            .unwrap();
        let TargetView::Webhook { jwks_url, .. } = view.target else {
            panic!("a webhook")
        };
        assert_eq!(jwks_url, "http://live:7/v1/stream/__ds/jwks.json");
        assert!(state.subs["s"].stored().base_url.is_empty());
    }

    #[test]
    fn a_callback_finds_its_wake_in_whichever_registry_holds_it_and_owners_see_a_clash() {
        // The same id on this node and on one it took over, each with a wake out.
        let (mut own, alice, limits, now) = subscribed("e/*");
        let (mut taken, _, _, _) = subscribed("e/*");
        own.observe("n1", "e/a", &mark(1, "i"), false, &limits, now);
        taken.observe("n2", "e/b", &mark(1, "i"), false, &limits, now);
        let wake_id = taken.take_due_n(now, 1)[0].wake_id.clone();
        let (token, generation) = current(&taken);
        let holders = [std::cell::RefCell::new(own), std::cell::RefCell::new(taken)];
        let acks = vec![("e/b".to_owned(), 1)];
        let next = super::super::on_current_wake(&holders, |state| {
            state.borrow_mut().ack(
                "s",
                Some(&token),
                &wake_id,
                generation,
                &acks,
                true,
                &no_tails(),
                now,
            )
        })
        .unwrap();
        assert!(!next);
        assert!(
            holders[1].borrow().subs["s"].wake.is_none(),
            "the taken-over copy's wake is done"
        );
        assert!(
            holders[0].borrow().subs["s"].wake.is_some(),
            "the own copy's is untouched"
        );
        // A token of neither is fenced.
        let fenced = super::super::on_current_wake(&holders, |state| {
            state
                .borrow_mut()
                .release("s", Some("nope"), &wake_id, None, now)
        });
        assert!(matches!(fenced, Err(SubscriptionError::Fenced)));
        // The owner's requests do not pick one copy silently; another key sees only its own.
        let reach = |c: &Caller| {
            holders
                .iter()
                .map(|h| (h, h.borrow().accessible(c, "s")))
                .collect::<Vec<_>>()
        };
        assert!(matches!(
            super::super::owned_by(reach(&alice)),
            Err(SubscriptionError::DuplicateId)
        ));
        holders[0].borrow_mut().subs.get_mut("s").unwrap().owner = Arc::from("bob");
        let picked = super::super::owned_by(reach(&alice)).unwrap().unwrap();
        assert!(std::ptr::eq(picked, &holders[1]));
    }

    #[test]
    fn one_key_never_silences_another_and_an_overflow_is_linked_once_room_frees() {
        let limits = SubscriptionLimits {
            max_subscriptions: 4,
            max_stored_bytes: 8_000,
            ..SubscriptionLimits::default()
        };
        let now = Instant::now();
        let mut state = State::default();
        let (alice, bob) = (caller("alice", false), caller("bob", false));
        let make = |state: &mut State, who: &Caller, id: &str, pattern: &str| {
            state.create(
                who,
                id,
                webhook(pattern),
                BTreeMap::new(),
                &no_tails(),
                &limits,
                now,
            )
        };
        make(&mut state, &alice, "a1", "a/*").unwrap();
        make(&mut state, &alice, "a2", "x/*").unwrap();
        // Alice holds her half of the subscriptions: Bob still makes his.
        assert!(matches!(
            make(&mut state, &alice, "a3", "y/*"),
            Err(SubscriptionError::TooManySubscriptions(2))
        ));
        make(&mut state, &bob, "b1", "b/*").unwrap();
        // Alice's pattern fills her half of the bytes; Bob's still links.
        let mut n = 0;
        while !state.subs["a1"].overflowed {
            state.observe(
                "n",
                &format!("a/{n:040}"),
                &mark(1, "i"),
                false,
                &limits,
                now,
            );
            n += 1;
        }
        assert!(state.owners[&alice.subject].bytes <= owner_share(limits.max_stored_bytes));
        state.observe("n", "b/new", &mark(1, "i"), false, &limits, now);
        assert!(state.subs["b1"].links.contains_key("b/new"));
        // The overflow shows, and is linked once room frees (a rescan).
        let key = signing_key();
        assert!(state.view(&alice, "a1", &key, "").unwrap().overflowed);
        assert!(!state.take_rescan(), "no room freed yet");
        state.delete(&alice, "a2").unwrap();
        let first = format!("a/{:040}", 0);
        state.remove_stream(&alice, "a1", &first).unwrap();
        assert!(state.take_rescan());
        let missed = format!("a/{:040}", n - 1);
        state.observe("n", &missed, &mark(1, "i"), true, &limits, now);
        assert!(state.subs["a1"].links.contains_key(&missed));
        assert!(!state.view(&alice, "a1", &key, "").unwrap().overflowed);
    }

    #[test]
    fn each_claim_fences_the_holder_before_it() {
        let limits = SubscriptionLimits::default();
        let now = Instant::now();
        let mut state = State::default();
        let alice = caller("alice", false);
        let pull = Definition::new(
            Target::PullWake {
                wake_stream: "wakes".into(),
            },
            Some("e/*".into()),
            Vec::new(),
            Some(1000),
            None,
        );
        state
            .create(
                &alice,
                "s",
                pull,
                BTreeMap::new(),
                &no_tails(),
                &limits,
                now,
            )
            .unwrap();
        state.observe("n", "e/a", &mark(3, "i"), false, &limits, now);
        let first = state
            .claim(&alice, "s", "w1", &no_tails(), now)
            .unwrap()
            .unwrap();
        // w1's lease runs out; w2 claims the same wake.
        let later = now + Duration::from_secs(2);
        let second = state
            .claim(&alice, "s", "w2", &no_tails(), later)
            .unwrap()
            .unwrap();
        assert_eq!(first.wake_id, second.wake_id);
        assert!(second.generation > first.generation);
        assert_ne!(first.token, second.token);
        // The stale worker's ack is fenced; the holder's is taken.
        let ack = |token: &str, generation: u64, state: &mut State| {
            state.ack(
                "s",
                Some(token),
                &first.wake_id,
                generation,
                &[("e/a".to_owned(), 3)],
                true,
                &no_tails(),
                later,
            )
        };
        assert!(matches!(
            ack(&first.token, first.generation, &mut state),
            Err(SubscriptionError::Fenced)
        ));
        assert!(!ack(&second.token, second.generation, &mut state).unwrap());
    }

    #[test]
    fn failed_deliveries_are_tried_again_later() {
        let (mut state, _, limits, now) = subscribed("e/*");
        state.observe("n", "e/a", &mark(1, "i"), false, &limits, now);
        let due = state.take_due_n(now, 10);
        assert!(state.take_due_n(now, 10).is_empty(), "being delivered");
        state.delivered("s", &due[0].wake_id, &Err("refused".into()), now);
        assert!(state.take_due_n(now, 10).is_empty(), "backing off");
        assert_eq!(state.take_due_n(now + Duration::from_secs(2), 10).len(), 1);
    }

    #[test]
    fn a_subscription_is_its_owners() {
        let (mut state, alice, limits, now) = subscribed("e/*");
        let bob = caller("bob", false);
        let admin = caller("root", true);
        let key = signing_key();
        assert!(matches!(
            state.view(&bob, "s", &key, ""),
            Err(SubscriptionError::NotFound)
        ));
        assert!(matches!(
            state.delete(&bob, "s"),
            Err(SubscriptionError::NotFound)
        ));
        assert!(matches!(
            state.claim(&bob, "s", "w", &no_tails(), now),
            Err(SubscriptionError::NotFound)
        ));
        // The same definition from another key is no confirmation: the id is taken.
        assert!(matches!(
            state.create(
                &bob,
                "s",
                webhook("e/*"),
                BTreeMap::new(),
                &no_tails(),
                &limits,
                now
            ),
            Err(SubscriptionError::Conflict)
        ));
        let TargetView::Webhook { url, redacted, .. } =
            state.view(&alice, "s", &key, "").unwrap().target
        else {
            panic!("a webhook")
        };
        assert!(url.contains("token=secret") && !redacted);
        let TargetView::Webhook { url, redacted, .. } =
            state.view(&admin, "s", &key, "").unwrap().target
        else {
            panic!("a webhook")
        };
        assert!(!url.contains("secret") && redacted, "{url}");
        state.delete(&admin, "s").unwrap();
    }

    #[test]
    fn acks_never_pass_the_tail_and_a_recreated_stream_starts_over() {
        let (mut state, _, limits, now) = subscribed("e/*");
        state.observe("n", "e/a", &mark(10, "i1"), false, &limits, now);
        let due = state.take_due_n(now, 1);
        let (token, generation) = current(&state);
        // An ack far past the tail stops at the tail.
        let next = state
            .ack(
                "s",
                Some(&token),
                &due[0].wake_id,
                generation,
                &[("e/a".into(), u64::MAX)],
                true,
                &no_tails(),
                now,
            )
            .unwrap();
        assert!(!next);
        assert_eq!(state.subs["s"].links["e/a"].acked, 10);
        // A stale generation is fenced.
        assert!(matches!(
            state.ack(
                "s",
                Some(&token),
                &due[0].wake_id,
                generation,
                &[],
                true,
                &no_tails(),
                now
            ),
            Err(SubscriptionError::Fenced)
        ));
        // Deleted and created again, with less data than was acked: pending from 0.
        state.observe("n", "e/a", &mark(4, "i2"), false, &limits, now);
        assert_eq!(state.subs["s"].links["e/a"].acked, 0);
        assert_eq!(state.take_due_n(now, 1).len(), 1);
    }

    #[test]
    fn pattern_links_stop_at_the_limits_and_say_so() {
        let limits = SubscriptionLimits {
            max_links: 2,
            ..SubscriptionLimits::default()
        };
        let now = Instant::now();
        let mut state = State::default();
        state
            .create(
                &caller("a", false),
                "s",
                webhook("e/*"),
                BTreeMap::new(),
                &no_tails(),
                &limits,
                now,
            )
            .unwrap();
        for i in 0..5 {
            state.observe("n", &format!("e/{i}"), &mark(1, "i"), false, &limits, now);
        }
        assert_eq!(state.subs["s"].links.len(), 2);
        assert_eq!(state.take_refused_links(), 3);
    }

    #[test]
    fn a_claimed_wake_is_held_for_its_lease_and_freed_after() {
        let limits = SubscriptionLimits::default();
        let now = Instant::now();
        let mut state = State::default();
        let alice = caller("alice", false);
        let def = Definition::new(
            Target::PullWake {
                wake_stream: "w".into(),
            },
            Some("e/*".into()),
            Vec::new(),
            Some(1000),
            None,
        );
        state
            .create(&alice, "p", def, BTreeMap::new(), &no_tails(), &limits, now)
            .unwrap();
        // Its own wake stream never wakes it.
        state.observe("n", "w", &mark(5, "i"), false, &limits, now);
        assert!(state.subs["p"].wake.is_none());
        assert!(
            state
                .claim(&alice, "p", "w1", &no_tails(), now)
                .unwrap()
                .is_none()
        );
        state.observe("n", "e/a", &mark(5, "i"), false, &limits, now);
        let claim = state
            .claim(&alice, "p", "w1", &no_tails(), now)
            .unwrap()
            .unwrap();
        assert!(matches!(
            state.claim(&alice, "p", "w2", &no_tails(), now),
            Err(SubscriptionError::AlreadyClaimed { .. })
        ));
        // After the lease, the wake is announced again, and another worker may claim it.
        let later = now + Duration::from_secs(2);
        assert_eq!(state.take_due_n(later, 10).len(), 1);
        let again = state
            .claim(&alice, "p", "w2", &no_tails(), later)
            .unwrap()
            .unwrap();
        assert_eq!(again.wake_id, claim.wake_id);
    }

    #[test]
    fn what_a_pattern_links_is_stored_once_acked_and_found_again_by_a_rescan() {
        let limits = SubscriptionLimits::default();
        let now = Instant::now();
        let mut state = State::default();
        let alice = caller("alice", false);
        state
            .create(
                &alice,
                "s",
                webhook("e/*"),
                BTreeMap::from([("n".to_owned(), 10)]),
                &no_tails(),
                &limits,
                now,
            )
            .unwrap();
        state.subs.get_mut("s").unwrap().written = state.subs["s"].version;
        // A rescan skips a stream last changed before the subscription was made...
        let old = StreamMark {
            changed_lsn: 9,
            ..mark(5, "i")
        };
        state.observe("n", "e/old", &old, true, &limits, now);
        assert!(!state.subs["s"].links.contains_key("e/old"));
        // ...and links one changed after. The link alone dirties nothing (a generation
        // block, once, does: it is stored before the first wake goes out).
        let new = StreamMark {
            changed_lsn: 11,
            ..mark(5, "i")
        };
        state.observe("n", "e/new", &new, true, &limits, now);
        assert!(state.subs["s"].links.contains_key("e/new"));
        assert!(state.subs["s"].stored().links.is_empty());
        let reserved = state.subs["s"].stored().generation;
        assert!(reserved >= GENERATION_BLOCK);
        // Acked, it is stored.
        let due = state.take_due_n(now, 1);
        state.payload("s", &due[0].wake_id, "http://n").unwrap();
        state.delivered("s", &due[0].wake_id, &Ok(Delivered::WebhookDone), now);
        assert_eq!(state.subs["s"].stored().links["e/new"].acked, 5);
        // The next wakes take generations from the same stored block.
        for tail in 6..10 {
            state.observe("n", "e/new", &mark(tail, "i"), false, &limits, now);
            let due = state.take_due_n(now, 1);
            state.payload("s", &due[0].wake_id, "http://n").unwrap();
            state.delivered("s", &due[0].wake_id, &Ok(Delivered::WebhookDone), now);
        }
        assert_eq!(state.subs["s"].stored().generation, reserved);
    }

    #[test]
    fn done_without_progress_waits_and_deleted_streams_end_their_wakes() {
        let (mut state, _, limits, now) = subscribed("e/*");
        state.observe("n", "e/a", &mark(10, "i"), false, &limits, now);
        let due = state.take_due_n(now, 1);
        state.payload("s", &due[0].wake_id, "http://n").unwrap();
        let (token, generation) = current(&state);
        // Done, acking nothing: the data is still pending, and the next wake waits a lease.
        let next = state
            .ack(
                "s",
                Some(&token),
                &due[0].wake_id,
                generation,
                &[],
                true,
                &no_tails(),
                now,
            )
            .unwrap();
        assert!(next);
        assert!(state.take_due_n(now, 1).is_empty());
        let later = now + Duration::from_secs(2);
        let due = state.take_due_n(later, 1);
        assert_eq!(due.len(), 1);
        // The stream was deleted meanwhile: the wake ends without a delivery, and none
        // follows.
        let pending = state.pending_names("s");
        state.settle("s", &pending, &no_tails());
        assert!(state.payload("s", &due[0].wake_id, "http://n").is_none());
        assert!(
            state
                .take_due_n(later + Duration::from_secs(60), 1)
                .is_empty()
        );
        assert!(!state.subs["s"].links.contains_key("e/a"));
    }

    fn signing_key() -> SigningKey {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = ring::signature::Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
        SigningKey::from_pkcs8(pkcs8.as_ref()).unwrap()
    }
}
