//! One node id's subscriptions: their state in memory ([`State`], plain data and the rules
//! that change it) and the [`Registry`] that stores it.
//!
//! Invariants:
//! - A subscription's `version` counts its stored changes and `written` the last version
//!   stored; `version > written` means its object is behind ("dirty"). Every change that
//!   must survive a restart (links, acks, generations) bumps `version`.
//! - A wake's generation is stored before the wake is delivered or claimed: a restart never
//!   hands out a generation twice.
//! - `cursors[engine]` is how far the engine's changes were applied to the links in memory;
//!   the stored watermark moves to a cursor only after every subscription dirtied up to it
//!   was written ([`Registry::flush`]). A restart rescans each engine from its watermark.
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
use crate::stream::format_offset;

/// Most streams one wake names.
pub(super) const MAX_WAKE_STREAMS: usize = 1000;

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
    base_url: String,
    links: BTreeMap<String, Link>,
    generation: u64,
    wake: Option<Wake>,
    version: u64,
    written: u64,
    bytes: usize,
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
            base_url: stored.base_url,
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
            generation: stored.generation,
            definition: stored.definition,
            wake: None,
            version: 0,
            written: 0,
            bytes: 0,
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
            base_url: self.base_url.clone(),
            links: self
                .links
                .iter()
                .map(|(name, l)| {
                    (
                        name.clone(),
                        StoredLink {
                            explicit: l.explicit,
                            acked: l.acked,
                            incarnation: l.incarnation.clone(),
                        },
                    )
                })
                .collect(),
            generation: self.generation,
        }
    }

    /// What the subscription costs besides its links.
    fn base_bytes(&self) -> usize {
        self.id.len() + self.base_url.len() + self.definition.bytes() + 256
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
    /// sparing the scan). Bumps the generation, which must be stored before delivery.
    fn raise(&mut self, known_pending: bool, now: Instant) -> bool {
        if self.wake.is_some() || !(known_pending || self.pending()) {
            return false;
        }
        self.generation += 1;
        self.version += 1;
        self.wake = Some(Wake {
            id: token(),
            generation: self.generation,
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

    /// Takes in fresh tails of linked streams; `true` when a stored field changed.
    fn note_tails(&mut self, tails: &HashMap<String, (u64, String)>) -> bool {
        let mut changed = false;
        for (name, link) in self.links.iter_mut() {
            if let Some((tail, incarnation)) = tails.get(name) {
                changed |= link.note(*tail, incarnation);
            }
        }
        if changed {
            self.version += 1;
        }
        changed
    }

    fn view(&self, caller: &Caller, key: &SigningKey) -> View {
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
                    jwks_url: format!("{}{RESERVED_PREFIX}jwks.json", self.base_url),
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

/// Every subscription of one node id, in memory.
#[derive(Debug, Default)]
pub(super) struct State {
    subs: HashMap<String, Sub>,
    /// Removed; their objects are deleted at the next write.
    deleted: HashSet<String>,
    /// How far each attached engine's changes are applied to the links in memory.
    cursors: HashMap<String, Lsn>,
    /// As last stored (or loaded).
    watermarks: BTreeMap<String, Lsn>,
    stored_bytes: usize,
    /// Links a pattern matched but the limits did not leave room for.
    refused_links: u64,
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
        base_url: &str,
        tails: &HashMap<String, (u64, String)>,
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
            base_url: base_url.to_owned(),
            links: definition
                .streams
                .iter()
                .map(|name| (name.clone(), Link::new(true)))
                .collect(),
            definition,
            generation: 0,
            wake: None,
            version: 1,
            written: 0,
            bytes: 0,
        };
        sub.bytes = sub.base_bytes() + sub.links.keys().map(|n| link_bytes(n)).sum::<usize>();
        if self.stored_bytes + sub.bytes > limits.max_stored_bytes {
            return Err(SubscriptionError::TooMuchStored {
                stored: self.stored_bytes,
                limit: limits.max_stored_bytes,
            });
        }
        // What is accepted must load back after a restart.
        store::encode(&sub.stored()).map_err(SubscriptionError::Invalid)?;
        sub.note_tails(tails);
        sub.raise(false, now);
        self.stored_bytes += sub.bytes;
        self.deleted.remove(id);
        self.subs.insert(id.to_owned(), sub);
        Ok(true)
    }

    pub(super) fn view(
        &self,
        caller: &Caller,
        id: &str,
        key: &SigningKey,
    ) -> Result<View, SubscriptionError> {
        Ok(self.get(caller, id)?.view(caller, key))
    }

    pub(super) fn delete(&mut self, caller: &Caller, id: &str) -> Result<(), SubscriptionError> {
        self.get(caller, id)?;
        if let Some(sub) = self.subs.remove(id) {
            self.stored_bytes = self.stored_bytes.saturating_sub(sub.bytes);
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
        tails: &HashMap<String, (u64, String)>,
        limits: &SubscriptionLimits,
        now: Instant,
    ) -> Result<(), SubscriptionError> {
        let stored = self.stored_bytes;
        let sub = self.get_mut(caller, id)?;
        let added: HashSet<&String> = names
            .iter()
            .filter(|n| !sub.links.contains_key(*n))
            .collect();
        if sub.links.len() + added.len() > limits.max_links {
            return Err(SubscriptionError::TooManyStreams(limits.max_links));
        }
        let more: usize = added.iter().map(|n| link_bytes(n)).sum();
        if stored + more > limits.max_stored_bytes {
            return Err(SubscriptionError::TooMuchStored {
                stored,
                limit: limits.max_stored_bytes,
            });
        }
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
        Ok(())
    }

    pub(super) fn remove_stream(
        &mut self,
        caller: &Caller,
        id: &str,
        name: &str,
    ) -> Result<(), SubscriptionError> {
        let sub = self.get_mut(caller, id)?;
        if sub.links.remove(name).is_some() {
            let freed = link_bytes(name);
            sub.bytes = sub.bytes.saturating_sub(freed);
            sub.version += 1;
            self.stored_bytes = self.stored_bytes.saturating_sub(freed);
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

    /// Stream `name` has (at least) `tail` bytes as incarnation `incarnation`: links it to
    /// the subscriptions whose pattern matches, and raises their wakes.
    pub(super) fn observe(
        &mut self,
        name: &str,
        tail: u64,
        incarnation: &str,
        limits: &SubscriptionLimits,
        now: Instant,
    ) {
        let State {
            subs,
            stored_bytes,
            refused_links,
            ..
        } = self;
        for sub in subs.values_mut() {
            // A subscription never wakes itself with its own wake events.
            if sub.wake_stream() == Some(name) {
                continue;
            }
            if !sub.links.contains_key(name) {
                if !sub.pattern.as_ref().is_some_and(|p| p.matches(name)) {
                    continue;
                }
                let cost = link_bytes(name);
                if sub.links.len() >= limits.max_links
                    || *stored_bytes + cost > limits.max_stored_bytes
                {
                    *refused_links += 1;
                    continue;
                }
                sub.links.insert(name.to_owned(), Link::new(false));
                sub.bytes += cost;
                *stored_bytes += cost;
                sub.version += 1;
            }
            let Some(link) = sub.links.get_mut(name) else {
                continue;
            };
            if link.note(tail, incarnation) {
                sub.version += 1;
            }
            let pending = link.pending();
            sub.raise(pending, now);
        }
    }

    /// Takes in fresh tails for every subscription (after a restart or a takeover).
    pub(super) fn note_all_tails(&mut self, tails: &HashMap<String, (u64, String)>, now: Instant) {
        for sub in self.subs.values_mut() {
            sub.note_tails(tails);
            sub.raise(false, now);
        }
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
        tails: &HashMap<String, (u64, String)>,
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
        apply_acks(sub, acks);
        let lease = sub.lease();
        if done {
            sub.wake = None;
            sub.raise(false, now);
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
        tails: &HashMap<String, (u64, String)>,
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
        if sub.wake.is_none() && !sub.raise(false, now) {
            return Ok(None);
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

    /// The wakes due for delivery now, oldest first, at most `limit`; each is marked as
    /// being delivered. A pull-wake claim whose lease ran out frees its wake first.
    pub(super) fn take_due(&mut self, now: Instant, limit: usize) -> Vec<Due> {
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
            .take(limit)
            .filter_map(|(_, sub)| {
                let w = sub.wake.as_mut()?;
                w.delivering = true;
                Some(Due {
                    id: sub.id.clone(),
                    wake_id: w.id.clone(),
                })
            })
            .collect()
    }

    /// What to send for wake `wake_id` of `id`: its pending streams now (remembered as what
    /// the wake named), signed by the caller. `None` when the wake is no longer current.
    pub(super) fn payload(&mut self, id: &str, wake_id: &str) -> Option<Payload> {
        let sub = self.subs.get_mut(id)?;
        let streams = sub.pending_streams();
        let w = sub.wake.as_mut().filter(|w| w.id == wake_id)?;
        w.streams = streams;
        let body = match &sub.definition.target {
            Target::Webhook { .. } => json!({
                "subscription_id": sub.id,
                "callback_url": format!(
                    "{}{RESERVED_PREFIX}subscriptions/{}/callback",
                    sub.base_url,
                    encode_segment(&sub.id)
                ),
                "callback_token": w.token,
                "wake_id": w.id,
                "generation": w.generation,
                "streams": w.streams.iter().map(|(p, t)| json!({
                    "path": p, "tail_offset": format_offset(*t), "has_pending": true,
                })).collect::<Vec<_>>(),
            }),
            Target::PullWake { .. } => json!({
                "subscription_id": sub.id,
                "wake_id": w.id,
                "generation": w.generation,
                "streams": w.streams.iter().map(|(p, t)| json!({
                    "path": p, "tail_offset": format_offset(*t),
                })).collect::<Vec<_>>(),
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

    /// The watermarks to store once everything dirty now is written: the stored ones, moved
    /// to the cursors of the attached engines.
    pub(super) fn next_watermarks(&self) -> BTreeMap<String, Lsn> {
        let mut next = self.watermarks.clone();
        for (engine, lsn) in &self.cursors {
            next.insert(engine.clone(), *lsn);
        }
        next
    }

    pub(super) fn watermarks_stored(&mut self, watermarks: BTreeMap<String, Lsn>) {
        self.watermarks = watermarks;
    }

    pub(super) fn watermarks_stored_are(&self, watermarks: &BTreeMap<String, Lsn>) -> bool {
        self.watermarks == *watermarks
    }
}

/// What storing one subscription takes.
#[derive(Debug)]
pub(super) enum ToStore {
    Write(u64, Vec<u8>),
    Delete,
    Nothing,
}

fn apply_acks(sub: &mut Sub, acks: &[(String, u64)]) {
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
        let store = Store::new(storage, node.id());
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

    /// Writes every subscription whose object is behind, deletes removed ones, then moves
    /// the stored watermarks to the cursors that held when it began.
    pub(super) async fn flush(&self) -> Result<(), SubscriptionError> {
        let _flushing = self.flushing.lock().await;
        let (next, dirty, deleted) = {
            let state = self.state();
            let next = state.next_watermarks();
            let (dirty, deleted) = state.dirty();
            if dirty.is_empty() && deleted.is_empty() && state.watermarks_stored_are(&next) {
                return Ok(());
            }
            (next, dirty, deleted)
        };
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
        if !self.state().watermarks_stored_are(&next) {
            self.store.write_watermarks(&next).await?;
            self.state().watermarks_stored(next);
        }
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

    fn no_tails() -> HashMap<String, (u64, String)> {
        HashMap::new()
    }

    #[test]
    fn data_raises_a_wake_that_ends_only_when_acked_to_the_tail() {
        let limits = SubscriptionLimits::default();
        let now = Instant::now();
        let mut state = State::default();
        let alice = caller("alice", false);
        assert!(
            state
                .create(
                    &alice,
                    "s",
                    webhook("events/*"),
                    "http://h",
                    &no_tails(),
                    &limits,
                    now
                )
                .unwrap()
        );
        state.observe("events/a", 10, "i1", &limits, now);
        state.observe("other/a", 10, "i1", &limits, now);
        let due = state.take_due(now, 10);
        assert_eq!(due.len(), 1);
        let payload = state.payload("s", &due[0].wake_id).unwrap();
        assert!(payload.body.contains("events/a"), "{}", payload.body);
        assert!(!payload.body.contains("other/a"));
        // More data while the wake is out; the consumer says done for what it was told.
        state.observe("events/b", 5, "i1", &limits, now);
        state.delivered("s", &due[0].wake_id, &Ok(Delivered::WebhookDone), now);
        // events/b is still pending: a new wake, with a new generation, at once.
        let again = state.take_due(now, 10);
        assert_eq!(again.len(), 1);
        assert_ne!(again[0].wake_id, due[0].wake_id);
        let payload = state.payload("s", &again[0].wake_id).unwrap();
        assert!(payload.body.contains("events/b"));
        assert!(!payload.body.contains("events/a"));
    }

    #[test]
    fn failed_deliveries_are_tried_again_later() {
        let limits = SubscriptionLimits::default();
        let now = Instant::now();
        let mut state = State::default();
        let alice = caller("alice", false);
        state
            .create(
                &alice,
                "s",
                webhook("e/*"),
                "http://h",
                &no_tails(),
                &limits,
                now,
            )
            .unwrap();
        state.observe("e/a", 1, "i", &limits, now);
        let due = state.take_due(now, 10);
        assert!(state.take_due(now, 10).is_empty(), "being delivered");
        state.delivered("s", &due[0].wake_id, &Err("refused".into()), now);
        assert!(state.take_due(now, 10).is_empty(), "backing off");
        assert_eq!(state.take_due(now + Duration::from_secs(2), 10).len(), 1);
    }

    #[test]
    fn a_subscription_is_its_owners() {
        let limits = SubscriptionLimits::default();
        let now = Instant::now();
        let mut state = State::default();
        let alice = caller("alice", false);
        let bob = caller("bob", false);
        let admin = caller("root", true);
        state
            .create(
                &alice,
                "s",
                webhook("e/*"),
                "http://h",
                &no_tails(),
                &limits,
                now,
            )
            .unwrap();
        let key = signing_key();
        assert!(matches!(
            state.view(&bob, "s", &key),
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
                "http://h",
                &no_tails(),
                &limits,
                now
            ),
            Err(SubscriptionError::Conflict)
        ));
        let TargetView::Webhook { url, redacted, .. } =
            state.view(&alice, "s", &key).unwrap().target
        else {
            panic!("a webhook")
        };
        assert!(url.contains("token=secret") && !redacted);
        let TargetView::Webhook { url, redacted, .. } =
            state.view(&admin, "s", &key).unwrap().target
        else {
            panic!("a webhook")
        };
        assert!(!url.contains("secret") && redacted, "{url}");
        state.delete(&admin, "s").unwrap();
    }

    #[test]
    fn acks_never_pass_the_tail_and_a_recreated_stream_starts_over() {
        let limits = SubscriptionLimits::default();
        let now = Instant::now();
        let mut state = State::default();
        let alice = caller("alice", false);
        state
            .create(
                &alice,
                "s",
                webhook("e/*"),
                "http://h",
                &no_tails(),
                &limits,
                now,
            )
            .unwrap();
        state.observe("e/a", 10, "i1", &limits, now);
        let due = state.take_due(now, 1);
        let (token, generation) = {
            let w = state.subs["s"].wake.as_ref().unwrap();
            (w.token.clone(), w.generation)
        };
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
        state.observe("e/a", 4, "i2", &limits, now);
        assert_eq!(state.subs["s"].links["e/a"].acked, 0);
        assert_eq!(state.take_due(now, 1).len(), 1);
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
                "http://h",
                &no_tails(),
                &limits,
                now,
            )
            .unwrap();
        for i in 0..5 {
            state.observe(&format!("e/{i}"), 1, "i", &limits, now);
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
            .create(&alice, "p", def, "http://h", &no_tails(), &limits, now)
            .unwrap();
        // Its own wake stream never wakes it.
        state.observe("w", 5, "i", &limits, now);
        assert!(state.subs["p"].wake.is_none());
        assert!(
            state
                .claim(&alice, "p", "w1", &no_tails(), now)
                .unwrap()
                .is_none()
        );
        state.observe("e/a", 5, "i", &limits, now);
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
        assert_eq!(state.take_due(later, 10).len(), 1);
        let again = state
            .claim(&alice, "p", "w2", &no_tails(), later)
            .unwrap()
            .unwrap();
        assert_eq!(again.wake_id, claim.wake_id);
    }

    fn signing_key() -> SigningKey {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = ring::signature::Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
        SigningKey::from_pkcs8(pkcs8.as_ref()).unwrap()
    }
}
