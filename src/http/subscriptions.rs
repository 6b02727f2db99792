//! Stream subscriptions, the protocol's reserved `/v1/stream/__ds/` APIs: a subscription
//! watches streams (by pattern, or listed), and when one of them receives data it wakes its
//! consumer: a webhook (a signed POST; the consumer acks through a callback) or a pull-wake
//! stream (an event appended there; a worker claims the wake, acks and releases it).
//!
//! Wakes carry a generation; an ack for a generation that is no longer current is fenced (409).
//! Subscriptions are durable: every change (a subscription made or removed, streams linked or
//! unlinked, acks) is written to `subscriptions/{node}.json` in the object store before it
//! is answered, and a restart loads them back (definitions, links, acked offsets and
//! generations; a wake that was in flight is raised again for what is still unacked).
//!
//! Everything keyed by client input is bounded ([`SubscriptionLimits`]): subscriptions per
//! server, streams linked to one, pattern length and wildcards (the matcher is iterative,
//! linear in the name for each part of the pattern). Webhooks only reach outside addresses:
//! the host is resolved, every address is checked against private, loopback, link-local,
//! shared, documentation, multicast and reserved ranges (and the IPv4 inside mapped, NAT64
//! and 6to4 IPv6 addresses), the request goes to the checked address, redirects are not
//! followed, and few deliveries run at once. `webhook_allowed_networks` opens ranges on
//! purpose (a consumer on the same machine, tests).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bytes::Bytes;
use ring::signature::{Ed25519KeyPair, KeyPair as _};
use serde_json::{Value, json};

use super::streams::{format_offset, parse_offset};
use crate::stream::{AppendRequest, Streams};

const PREFIX: &str = "__ds/";

/// Longest subscription id, in bytes.
const MAX_ID_BYTES: usize = 256;

/// Largest subscription request body, in bytes.
const MAX_BODY_BYTES: usize = 64 << 10;

/// Whether a linked name could be a stream's (the protocol layout's rules).
fn valid_stream_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 1024
        && !name.bytes().any(|b| b < 0x20 || b == 0x7f)
        && name
            .split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

impl Subscription {
    /// What it holds in memory and in the stored object, roughly.
    fn stored_bytes(&self) -> usize {
        self.definition.to_string().len() + self.links.keys().map(|k| k.len() + 32).sum::<usize>()
    }
}

/// Longest wake lease a subscription may ask for.
const MAX_LEASE: Duration = Duration::from_secs(3600);

fn b64url(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// An error in the subscription APIs' own shape: `{"error": {"code", "message"}}`.
fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        axum::Json(json!({"error": {"code": code, "message": message.into()}})),
    )
        .into_response()
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Webhook { url: String },
    PullWake { wake_stream: String },
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Link {
    explicit: bool,
    acked: u64,
    #[serde(skip)]
    tail: u64,
}

/// A subscription as it is stored.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct StoredSubscription {
    id: String,
    definition: Value,
    links: BTreeMap<String, Link>,
    generation: u64,
}

/// Everything that is stored.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Stored {
    subscriptions: Vec<StoredSubscription>,
}

#[derive(Debug, Clone)]
struct Wake {
    id: String,
    generation: u64,
    token: String,
    /// The streams and tails the wake was raised for.
    streams: Vec<(String, u64)>,
    holder: Option<String>,
    lease_until: Option<Instant>,
}

#[derive(Debug)]
struct Subscription {
    id: String,
    kind: Kind,
    pattern: Option<String>,
    lease_ttl: Duration,
    description: Option<String>,
    /// The definition as given, for idempotent re-creation.
    definition: Value,
    links: BTreeMap<String, Link>,
    generation: u64,
    wake: Option<Wake>,
}

/// The subscriptions of one server.
pub(crate) struct Subscriptions {
    subs: Mutex<HashMap<String, Subscription>>,
    key: Ed25519KeyPair,
    kid: String,
    streams: Streams,
    limits: SubscriptionLimits,
    /// Webhook deliveries in flight.
    deliveries: Arc<tokio::sync::Semaphore>,
    /// Where the subscriptions are stored.
    storage: crate::storage::Storage,
    path: object_store::path::Path,
    /// Bumped by every change; the last revision written is kept beside the writer lock,
    /// so an older state never overwrites a newer one.
    revision: std::sync::atomic::AtomicU64,
    written: tokio::sync::Mutex<u64>,
}

impl std::fmt::Debug for Subscriptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriptions")
            .field("kid", &self.kid)
            .finish()
    }
}

/// Bounds on subscriptions, and the networks webhooks may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionLimits {
    /// Subscriptions per server.
    pub max_subscriptions: usize,
    /// Streams linked to one subscription (listed, or matched by its pattern).
    pub max_links: usize,
    /// Longest pattern, in bytes.
    pub max_pattern_bytes: usize,
    /// Most wildcards (`*`, `**`) in a pattern.
    pub max_wildcards: usize,
    /// Webhook deliveries in flight at once.
    pub max_deliveries: usize,
    /// Bytes of definitions and linked stream names all subscriptions may hold together.
    pub max_stored_bytes: usize,
    /// Networks webhooks may reach although they are not public (`127.0.0.0/8`, …).
    pub webhook_allowed_networks: Vec<Network>,
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
        }
    }
}

/// An IP network, `address/prefix` (a bare address is a network of one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Network {
    address: IpAddr,
    prefix: u8,
}

impl std::str::FromStr for Network {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (address, prefix) = match text.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text.trim(), None),
        };
        let address: IpAddr = address
            .parse()
            .map_err(|_| format!("{text:?} is not an IP address or network"))?;
        let max = if address.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{text:?}: the prefix must be 0 to {max}"))?,
            None => max,
        };
        Ok(Network { address, prefix })
    }
}

impl Network {
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.address, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// Whether an IPv4 address is on the public internet: not private, loopback, link-local,
/// shared (CGNAT), documentation, benchmarking, multicast, reserved or broadcast.
fn public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0
        || a == 10
        || a == 127
        || (a == 100 && (64..128).contains(&b))
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 168)
        || (a == 192 && b == 0 && (c == 0 || c == 2))
        || (a == 192 && b == 88 && c == 99)
        || (a == 198 && (b == 18 || b == 19))
        || (a == 198 && b == 51 && c == 100)
        || (a == 203 && b == 0 && c == 113)
        || a >= 224)
}

/// Whether an IPv6 address is on the public internet. Addresses that carry an IPv4 address
/// (mapped, compatible, NAT64, 6to4) are judged by it.
fn public_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    let embedded = |hi: usize| {
        Ipv4Addr::new(
            (s[hi] >> 8) as u8,
            s[hi] as u8,
            (s[hi + 1] >> 8) as u8,
            s[hi + 1] as u8,
        )
    };
    if s[..5] == [0; 5] && (s[5] == 0xffff || s[5] == 0) {
        // ::ffff:a.b.c.d (mapped), ::a.b.c.d (compatible), ::, ::1
        return public_v4(embedded(6)) && !(s[5] == 0 && s[6] == 0);
    }
    if s[..4] == [0; 4] && s[4] == 0xffff && s[5] == 0 {
        // ::ffff:0:a.b.c.d (IPv4-translated)
        return public_v4(embedded(6));
    }
    if s[0] == 0x64 && s[1] == 0xff9b {
        // NAT64: 64:ff9b::/96 carries the IPv4 address last; 64:ff9b:1::/48 (local use)
        // carries it where its operator chose, so it is refused whole.
        return s[2] != 1 && public_v4(embedded(6));
    }
    if s[0] == 0x2002 {
        // 6to4: the IPv4 address is in the next 32 bits.
        return public_v4(embedded(1));
    }
    !((s[0] & 0xfe00) == 0xfc00 // unique local fc00::/7
        || (s[0] & 0xffc0) == 0xfe80 // link-local fe80::/10
        || (s[0] & 0xffc0) == 0xfec0 // site-local fec0::/10
        || (s[0] & 0xff00) == 0xff00 // multicast
        || (s[0] == 0x2001 && s[1] < 0x0200) // protocol assignments, Teredo 2001::/23
        || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
        || (s[0] == 0x0100 && s[1..4] == [0, 0, 0])) // discard 100::/64
}

/// Whether a webhook may be sent to `ip`: a public address, or one in an allowed network.
pub(crate) fn webhook_address_allowed(ip: IpAddr, allowed: &[Network]) -> bool {
    if allowed.iter().any(|n| n.contains(ip)) {
        return true;
    }
    match ip {
        IpAddr::V4(v4) => public_v4(v4),
        IpAddr::V6(v6) => public_v6(v6),
    }
}

/// A pattern part: literal text, `*` (within one path segment) or `**` (across segments).
#[derive(Debug, PartialEq, Eq)]
enum Part<'a> {
    Text(&'a [u8]),
    Star,
    DoubleStar,
}

fn parts(pattern: &str) -> Vec<Part<'_>> {
    let p = pattern.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < p.len() {
        if p[i] == b'*' {
            if p.get(i + 1) == Some(&b'*') {
                out.push(Part::DoubleStar);
                i += 2;
            } else {
                out.push(Part::Star);
                i += 1;
            }
        } else {
            let end = p[i..]
                .iter()
                .position(|b| *b == b'*')
                .map_or(p.len(), |e| i + e);
            out.push(Part::Text(&p[i..end]));
            i = end;
        }
    }
    out
}

/// `*` matches within one path segment, `**` across segments. Iterative: the set of name
/// positions reachable after each part, so the work is (parts × name length), whatever the
/// pattern.
fn glob(pattern: &str, path: &str) -> bool {
    let s = path.as_bytes();
    let mut reach = vec![false; s.len() + 1];
    reach[0] = true;
    for part in parts(pattern) {
        let mut next = vec![false; s.len() + 1];
        match part {
            Part::Text(t) => {
                for i in (0..=s.len()).filter(|i| reach[*i]) {
                    if s[i..].starts_with(t) {
                        next[i + t.len()] = true;
                    }
                }
            }
            Part::Star => {
                // From each reachable position, on to the end of its segment.
                let mut open = false;
                for i in 0..=s.len() {
                    open |= reach[i];
                    next[i] = open;
                    if i < s.len() && s[i] == b'/' {
                        open = false;
                    }
                }
            }
            Part::DoubleStar => {
                if let Some(first) = reach.iter().position(|r| *r) {
                    next[first..].iter_mut().for_each(|n| *n = true);
                }
            }
        }
        reach = next;
        if !reach.iter().any(|r| *r) {
            return false;
        }
    }
    reach[s.len()]
}

/// Checks a pattern against the limits.
fn check_pattern(pattern: &str, limits: &SubscriptionLimits) -> Result<(), String> {
    if pattern.len() > limits.max_pattern_bytes {
        return Err(format!(
            "pattern is longer than {} bytes",
            limits.max_pattern_bytes
        ));
    }
    let wildcards = parts(pattern)
        .iter()
        .filter(|p| **p != Part::Text(b""))
        .filter(|p| !matches!(p, Part::Text(_)))
        .count();
    if wildcards > limits.max_wildcards {
        return Err(format!(
            "pattern has {wildcards} wildcards; at most {} are allowed",
            limits.max_wildcards
        ));
    }
    Ok(())
}

/// Webhook targets must be plain http(s) URLs; an address given literally must be one a
/// webhook may reach. Names are resolved and checked at each delivery.
fn webhook_url_allowed(url: &str, allowed: &[Network]) -> bool {
    let Ok(parsed) = reqwest::Url::parse(url) else {
        return false;
    };
    if !matches!(parsed.scheme(), "http" | "https")
        || !parsed.username().is_empty()
        || parsed.password().is_some()
    {
        return false;
    }
    match parsed.host() {
        Some(url::Host::Ipv4(ip)) => webhook_address_allowed(IpAddr::V4(ip), allowed),
        Some(url::Host::Ipv6(ip)) => webhook_address_allowed(IpAddr::V6(ip), allowed),
        Some(url::Host::Domain(d)) => !d.is_empty(),
        None => false,
    }
}

/// The address a webhook delivery connects to: the URL's host resolved, every address it
/// resolves to checked (a name that resolves to any inside address is refused).
async fn webhook_target(url: &reqwest::Url, allowed: &[Network]) -> Result<SocketAddr, String> {
    let port = url.port_or_known_default().unwrap_or(80);
    let addresses: Vec<SocketAddr> = match url.host() {
        Some(url::Host::Ipv4(ip)) => vec![SocketAddr::new(IpAddr::V4(ip), port)],
        Some(url::Host::Ipv6(ip)) => vec![SocketAddr::new(IpAddr::V6(ip), port)],
        Some(url::Host::Domain(d)) => tokio::net::lookup_host((d, port))
            .await
            .map_err(|e| format!("cannot resolve {d}: {e}"))?
            .collect(),
        None => Vec::new(),
    };
    if let Some(bad) = addresses
        .iter()
        .find(|a| !webhook_address_allowed(a.ip(), allowed))
    {
        return Err(format!("{} is not an address webhooks may reach", bad.ip()));
    }
    addresses
        .into_iter()
        .next()
        .ok_or_else(|| "the webhook host has no address".to_owned())
}

/// The answer when subscriptions would hold more than `limit` bytes.
fn too_much_stored(stored: usize, limit: usize) -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "TOO_MUCH_STORED",
        format!("subscriptions hold {stored} bytes; the limit is {limit}"),
    )
}

/// Whether a request path is a wake callback (`.../subscriptions/{id}/callback`, `/ack`,
/// `/release`), which the wake's own token authorizes.
pub(crate) fn is_wake_callback(path: &str) -> bool {
    let Some(rest) = path
        .strip_prefix("/v1/stream/")
        .and_then(|r| r.strip_prefix(PREFIX))
    else {
        return false;
    };
    let Some(rest) = rest.strip_prefix("subscriptions/") else {
        return false;
    };
    matches!(
        rest.split_once('/').map(|(_, tail)| tail),
        Some("callback" | "ack" | "release")
    )
}

impl Subscriptions {
    /// Subscriptions over `streams`, with a fresh signing key, loaded from `storage` (this
    /// node's object `subscriptions/{node}.json`).
    pub(crate) async fn new(
        streams: Streams,
        limits: SubscriptionLimits,
        storage: crate::storage::Storage,
        node: &str,
    ) -> Result<Arc<Subscriptions>, String> {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).map_err(|e| e.to_string())?;
        let key = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).map_err(|e| e.to_string())?;
        let subs = Arc::new(Subscriptions {
            subs: Mutex::new(HashMap::new()),
            kid: format!("ds_{}", &token()[..16]),
            key,
            streams: streams.clone(),
            deliveries: Arc::new(tokio::sync::Semaphore::new(limits.max_deliveries.max(1))),
            limits,
            storage,
            path: object_store::path::Path::from(crate::storage::paths::subscriptions(node)),
            revision: std::sync::atomic::AtomicU64::new(0),
            written: tokio::sync::Mutex::new(0),
        });
        // A store that does not answer now may a moment later; starting without the stored
        // subscriptions would lose them at the next change (it writes the set whole).
        let mut attempt = 0;
        loop {
            match subs.load().await {
                Ok(()) => break,
                Err(e) if attempt < 5 => {
                    attempt += 1;
                    tracing::warn!(error = %e, "loading subscriptions failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
                }
                Err(e) => return Err(e),
            }
        }
        // Wake subscribers as streams receive data.
        let watcher = subs.clone();
        let mut changes = streams.changes();
        tokio::spawn(async move {
            loop {
                match changes.recv().await {
                    Ok(name) => watcher.changed(&name).await,
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                }
            }
        });
        // Wakes that were pending when the server stopped are raised again.
        let names: Vec<String> = subs
            .subs()
            .values()
            .flat_map(|s| s.links.keys().cloned())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let restart = subs.clone();
        tokio::spawn(async move {
            for name in names {
                restart.changed(&name).await;
            }
        });
        Ok(subs)
    }

    /// Loads the stored subscriptions.
    async fn load(&self) -> Result<(), String> {
        use object_store::ObjectStoreExt as _;
        let bytes = match self.storage.store().get(&self.path).await {
            Ok(r) => r.bytes().await.map_err(|e| e.to_string())?,
            Err(object_store::Error::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(format!("cannot load subscriptions: {e}")),
        };
        let stored: Stored = serde_json::from_slice(&bytes)
            .map_err(|e| format!("subscriptions object {} is unreadable: {e}", self.path))?;
        let mut all = self.subs();
        for s in stored.subscriptions {
            let mut definition = s.definition;
            let base = definition["__base"].clone();
            let sub = match parse_subscription(&s.id, &definition, &self.limits, true) {
                Ok(sub) => sub,
                Err(_) => {
                    tracing::warn!(subscription = %s.id, "stored subscription is no longer valid; dropped");
                    continue;
                }
            };
            definition["__base"] = base;
            all.insert(
                s.id.clone(),
                Subscription {
                    definition,
                    links: s.links,
                    generation: s.generation,
                    ..sub
                },
            );
        }
        Ok(())
    }

    /// Writes every subscription to the object store; returns once this state (or a newer
    /// one) is durable.
    async fn persist(&self) -> Result<(), String> {
        use object_store::ObjectStoreExt as _;
        use std::sync::atomic::Ordering;
        let (revision, body) = {
            let all = self.subs();
            let revision = self.revision.fetch_add(1, Ordering::AcqRel) + 1;
            let stored = Stored {
                subscriptions: all
                    .values()
                    .map(|s| StoredSubscription {
                        id: s.id.clone(),
                        definition: s.definition.clone(),
                        links: s.links.clone(),
                        generation: s.generation,
                    })
                    .collect(),
            };
            (
                revision,
                serde_json::to_vec(&stored).map_err(|e| e.to_string())?,
            )
        };
        let mut written = self.written.lock().await;
        if *written >= revision {
            return Ok(());
        }
        self.storage
            .store()
            .put(&self.path, body.into())
            .await
            .map_err(|e| format!("cannot store subscriptions: {e}"))?;
        *written = revision;
        Ok(())
    }

    fn subs(&self) -> std::sync::MutexGuard<'_, HashMap<String, Subscription>> {
        self.subs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn jwks(&self) -> Value {
        json!({"keys": [{
            "kty": "OKP", "crv": "Ed25519", "alg": "EdDSA", "use": "sig",
            "kid": self.kid, "x": b64url(self.key.public_key().as_ref()),
        }]})
    }

    /// A stream received data: raise a wake for every subscription watching it that has none.
    async fn changed(self: &Arc<Self>, name: &str) {
        if self.subs().is_empty() {
            return;
        }
        let tail = match self.streams.get(name).await {
            Ok(s) => s.info().tail,
            Err(_) => return,
        };
        let mut linked = false;
        let mut deliveries = Vec::new();
        {
            let mut subs = self.subs();
            for sub in subs.values_mut() {
                let watched = sub.links.get(name).is_some_and(|l| l.explicit)
                    || sub.pattern.as_deref().is_some_and(|p| glob(p, name));
                if !watched {
                    continue;
                }
                if !sub.links.contains_key(name) && sub.links.len() >= self.limits.max_links {
                    tracing::warn!(
                        subscription = %sub.id,
                        "subscription links {} streams, its limit; {name} is not linked",
                        self.limits.max_links
                    );
                    continue;
                }
                linked |= !sub.links.contains_key(name);
                let link = sub.links.entry(name.to_owned()).or_insert(Link {
                    explicit: false,
                    acked: 0,
                    tail: 0,
                });
                link.tail = link.tail.max(tail);
                if sub.wake.is_none() {
                    sub.generation += 1;
                    let wake = Wake {
                        id: token(),
                        generation: sub.generation,
                        token: token(),
                        streams: sub
                            .links
                            .iter()
                            .filter(|(_, l)| l.tail > l.acked)
                            .map(|(p, l)| (p.clone(), l.tail))
                            .collect(),
                        holder: None,
                        lease_until: None,
                    };
                    deliveries.push((sub.id.clone(), sub.kind.clone(), wake.clone()));
                    sub.wake = Some(wake);
                }
            }
        }
        // New links and generations are stored: a restart raises the same wakes again and
        // never reuses a generation.
        if (linked || !deliveries.is_empty())
            && let Err(e) = self.persist().await
        {
            tracing::warn!(error = %e, "subscription changes not stored");
        }
        for (id, kind, wake) in deliveries {
            match kind {
                Kind::Webhook { url } => {
                    // Deliveries run beside the watcher, a bounded number at a time: a slow
                    // consumer holds up neither the watcher nor other subscriptions.
                    let this = self.clone();
                    tokio::spawn(async move {
                        let Ok(_permit) = this.deliveries.clone().acquire_owned().await else {
                            return;
                        };
                        this.notify(&id, &url, &wake).await;
                    });
                }
                Kind::PullWake { wake_stream } => {
                    let event = json!({
                        "subscription_id": id,
                        "wake_id": wake.id,
                        "generation": wake.generation,
                        "streams": wake.streams.iter().map(|(p, t)| json!({"path": p, "tail_offset": format_offset(*t)})).collect::<Vec<_>>(),
                    });
                    let _ = self
                        .streams
                        .append(AppendRequest {
                            name: wake_stream,
                            content_type: Some("application/json".into()),
                            body: Bytes::from(event.to_string()),
                            close: false,
                            producer: None,
                            stream_seq: None,
                            incarnation: None,
                        })
                        .await;
                }
            }
        }
    }

    /// Brings the tails of a subscription's linked streams up to date (the change watcher runs
    /// behind the appends; a claim must not miss data that is already there). Streams join a
    /// pattern subscription when they change after it was made, as the watcher sees them.
    async fn refresh_tails(&self, id: &str) {
        let names: Vec<String> = match self.subs().get(id) {
            Some(sub) => sub.links.keys().cloned().collect(),
            None => return,
        };
        let mut tails = Vec::new();
        for name in names {
            if let Ok(stream) = self.streams.get(&name).await {
                tails.push((name, stream.info().tail));
            }
        }
        if let Some(sub) = self.subs().get_mut(id) {
            for (name, tail) in tails {
                let link = sub.links.entry(name).or_insert(Link {
                    explicit: false,
                    acked: 0,
                    tail: 0,
                });
                link.tail = link.tail.max(tail);
            }
        }
    }

    fn streams_json(&self, sub: &Subscription, streams: &[(String, u64)]) -> Vec<Value> {
        streams
            .iter()
            .map(|(p, t)| {
                let pending = sub.links.get(p).is_some_and(|l| l.tail > l.acked);
                json!({"path": p, "tail_offset": format_offset(*t), "has_pending": pending})
            })
            .collect()
    }

    /// Posts a signed notification; a `{"done": true}` answer acks the whole wake.
    async fn notify(&self, id: &str, url: &str, wake: &Wake) {
        let (body, base) = {
            let subs = self.subs();
            let Some(sub) = subs.get(id) else { return };
            let base = sub.definition["__base"].as_str().unwrap_or("").to_owned();
            let body = json!({
                "subscription_id": id,
                "callback_url": format!("{base}/v1/stream/{PREFIX}subscriptions/{id}/callback"),
                "callback_token": wake.token,
                "wake_id": wake.id,
                "generation": wake.generation,
                "streams": self.streams_json(sub, &wake.streams),
            });
            (body.to_string(), base)
        };
        let _ = base;
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let signature = self.key.sign(format!("{t}.{body}").as_bytes());
        let header = format!(
            "t={t},kid={},ed25519={}",
            self.kid,
            b64url(signature.as_ref())
        );
        let answer = match self.webhook_client(url).await {
            Ok((client, url)) => {
                client
                    .post(url)
                    .header("content-type", "application/json")
                    .header("webhook-signature", header)
                    .body(body)
                    .send()
                    .await
            }
            Err(reason) => {
                tracing::warn!(subscription = id, %reason, "webhook not delivered");
                return;
            }
        };
        let done = match answer {
            Ok(r) => r.json::<Value>().await.is_ok_and(|v| v["done"] == true),
            Err(e) => {
                tracing::warn!(subscription = id, error = %e, "webhook delivery failed");
                false
            }
        };
        if done {
            let acks: Vec<(String, u64)> = wake.streams.clone();
            if self
                .finish(id, &wake.id, wake.generation, &acks, true)
                .is_ok()
                && let Err(e) = self.persist().await
            {
                tracing::warn!(subscription = id, error = %e, "acks not stored");
            }
        }
    }

    /// A client that connects only to the checked address of `url` and follows no redirect.
    async fn webhook_client(&self, url: &str) -> Result<(reqwest::Client, reqwest::Url), String> {
        let parsed = reqwest::Url::parse(url).map_err(|e| e.to_string())?;
        let target = webhook_target(&parsed, &self.limits.webhook_allowed_networks).await?;
        let mut builder = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy();
        if let Some(url::Host::Domain(d)) = parsed.host() {
            builder = builder.resolve(d, target);
        }
        let client = builder.build().map_err(|e| e.to_string())?;
        Ok((client, parsed))
    }

    /// Applies acks to the current wake; `done` ends it. `Err` when the wake is not current.
    fn finish(
        &self,
        id: &str,
        wake_id: &str,
        generation: u64,
        acks: &[(String, u64)],
        done: bool,
    ) -> Result<bool, ()> {
        let mut subs = self.subs();
        let sub = subs.get_mut(id).ok_or(())?;
        let current = sub
            .wake
            .as_ref()
            .is_some_and(|w| w.id == wake_id && w.generation == generation);
        if !current {
            return Err(());
        }
        for (path, offset) in acks {
            if let Some(link) = sub.links.get_mut(path) {
                link.acked = link.acked.max(*offset);
            }
        }
        if done {
            sub.wake = None;
        }
        Ok(sub.links.values().any(|l| l.tail > l.acked))
    }

    fn describe(&self, sub: &Subscription) -> Value {
        let mut v = json!({
            "id": sub.id,
            "type": match sub.kind { Kind::Webhook { .. } => "webhook", Kind::PullWake { .. } => "pull-wake" },
            "lease_ttl_ms": sub.lease_ttl.as_millis() as u64,
            "streams": sub.links.iter().map(|(p, l)| json!({
                "path": p,
                "link_type": if l.explicit { "explicit" } else { "pattern" },
                "acked_offset": format_offset(l.acked),
                "tail_offset": format_offset(l.tail),
            })).collect::<Vec<_>>(),
        });
        if let Some(p) = &sub.pattern {
            v["pattern"] = json!(p);
        }
        if let Some(d) = &sub.description {
            v["description"] = json!(d);
        }
        let base = sub.definition["__base"].as_str().unwrap_or("");
        match &sub.kind {
            Kind::Webhook { url } => {
                v["webhook"] = json!({"url": url, "signing": {
                    "alg": "ed25519", "kid": self.kid,
                    "jwks_url": format!("{base}/v1/stream/{PREFIX}jwks.json"),
                }});
            }
            Kind::PullWake { wake_stream } => v["wake_stream"] = json!(wake_stream),
        }
        v
    }
}

/// Whether a stream name is in the reserved namespace.
pub(super) fn reserved(name: &str) -> bool {
    name.starts_with(PREFIX)
}

/// The wake token a callback presents: `Stream-Wake-Token`, or (the protocol's way) the
/// bearer token of `Authorization` when no API key needs that header.
fn wake_token(headers: &HeaderMap) -> Option<&str> {
    if let Some(t) = headers
        .get("stream-wake-token")
        .and_then(|v| v.to_str().ok())
    {
        return Some(t.trim());
    }
    headers
        .get("authorization")?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// Whether a presented wake token is the wake's, compared in constant time.
fn token_matches(wake: &Wake, presented: Option<&str>) -> bool {
    use subtle::ConstantTimeEq as _;
    presented.is_some_and(|p| {
        p.len() == wake.token.len() && bool::from(p.as_bytes().ct_eq(wake.token.as_bytes()))
    })
}

fn acks(body: &Value) -> Vec<(String, u64)> {
    body["acks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| {
            Some((
                a["stream"].as_str()?.to_owned(),
                parse_offset(a["offset"].as_str()?)?,
            ))
        })
        .collect()
}

/// Routes a request under `/v1/stream/__ds/`.
pub(super) async fn handle(
    subs: &Subscriptions,
    method: &axum::http::Method,
    name: &str,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    use axum::http::Method;
    let rest = &name[PREFIX.len()..];
    if rest == "jwks.json" && method == Method::GET {
        return (
            [("content-type", "application/jwk-set+json")],
            subs.jwks().to_string(),
        )
            .into_response();
    }
    let Some(rest) = rest.strip_prefix("subscriptions/") else {
        return error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such reserved API");
    };
    let (id, tail) = rest.split_once('/').unwrap_or((rest, ""));
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return error(
            StatusCode::BAD_REQUEST,
            "INVALID",
            format!("a subscription id is 1 to {MAX_ID_BYTES} bytes"),
        );
    }
    let body: Value = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(b) if b.is_empty() => Value::Null,
        // A JSON body must say so: a page could send a text/plain one without asking.
        Ok(_) if !super::is_json_request(headers) => {
            return error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UNSUPPORTED_MEDIA_TYPE",
                "send the body as Content-Type: application/json",
            );
        }
        Ok(b) => match serde_json::from_slice(&b) {
            Ok(v) => v,
            Err(e) => return error(StatusCode::BAD_REQUEST, "INVALID_JSON", e.to_string()),
        },
        Err(e) => return error(StatusCode::BAD_REQUEST, "INVALID_BODY", e.to_string()),
    };
    let mutates = matches!(
        (method.clone(), tail),
        (Method::PUT, "")
            | (Method::DELETE, _)
            | (Method::POST, "streams")
            | (Method::POST, "callback")
            | (Method::POST, "ack")
            | (Method::POST, "claim")
    );
    let response = dispatch(subs, method, id, tail, headers, body).await;
    if mutates
        && response.status().is_success()
        && let Err(e) = subs.persist().await
    {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "NOT_DURABLE",
            format!("the change was applied but could not be stored: {e}"),
        );
    }
    response
}

async fn dispatch(
    subs: &Subscriptions,
    method: &axum::http::Method,
    id: &str,
    tail: &str,
    headers: &HeaderMap,
    body: Value,
) -> Response {
    use axum::http::Method;
    match (method.clone(), tail) {
        (Method::PUT, "") => put(subs, id, headers, body),
        (Method::GET, "") => match subs.subs().get(id) {
            Some(sub) => axum::Json(subs.describe(sub)).into_response(),
            None => error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such subscription"),
        },
        (Method::DELETE, "") => match subs.subs().remove(id) {
            Some(_) => StatusCode::NO_CONTENT.into_response(),
            None => error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such subscription"),
        },
        (Method::POST, "streams") => {
            let mut all = subs.subs();
            let stored: usize = all.values().map(Subscription::stored_bytes).sum();
            let Some(sub) = all.get_mut(id) else {
                return error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such subscription");
            };
            let names: Vec<&str> = body["streams"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str())
                .collect();
            if let Some(bad) = names.iter().find(|n| !valid_stream_name(n)) {
                return error(
                    StatusCode::BAD_REQUEST,
                    "INVALID",
                    format!("{bad:?} is not a stream name"),
                );
            }
            let added: BTreeSet<&str> = names
                .into_iter()
                .filter(|s| !sub.links.contains_key(*s))
                .collect();
            if sub.links.len() + added.len() > subs.limits.max_links {
                return error(
                    StatusCode::BAD_REQUEST,
                    "TOO_MANY_STREAMS",
                    format!(
                        "a subscription links at most {} streams",
                        subs.limits.max_links
                    ),
                );
            }
            let more: usize = added.iter().map(|n| n.len() + 32).sum();
            if stored + more > subs.limits.max_stored_bytes {
                return too_much_stored(stored, subs.limits.max_stored_bytes);
            }
            for s in body["streams"].as_array().into_iter().flatten() {
                if let Some(p) = s.as_str() {
                    let link = sub.links.entry(p.to_owned()).or_insert(Link {
                        explicit: true,
                        acked: 0,
                        tail: 0,
                    });
                    link.explicit = true;
                }
            }
            StatusCode::NO_CONTENT.into_response()
        }
        (Method::DELETE, t) if t.starts_with("streams/") => {
            let path = &t["streams/".len()..];
            match subs.subs().get_mut(id) {
                Some(sub) => {
                    sub.links.remove(path);
                    StatusCode::NO_CONTENT.into_response()
                }
                None => error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such subscription"),
            }
        }
        (Method::POST, "callback") | (Method::POST, "ack") => {
            let authorized = subs
                .subs()
                .get(id)
                .and_then(|s| s.wake.as_ref())
                .is_some_and(|w| token_matches(w, wake_token(headers)));
            let wake_id = body["wake_id"].as_str().unwrap_or("");
            let generation = body["generation"].as_u64().unwrap_or(0);
            if !authorized {
                return error(
                    StatusCode::CONFLICT,
                    "FENCED",
                    "this wake is no longer current",
                );
            }
            match subs.finish(id, wake_id, generation, &acks(&body), body["done"] == true) {
                Ok(next) => axum::Json(json!({"ok": true, "next_wake": next})).into_response(),
                Err(()) => error(
                    StatusCode::CONFLICT,
                    "FENCED",
                    "this wake is no longer current",
                ),
            }
        }
        (Method::POST, "claim") => {
            subs.refresh_tails(id).await;
            claim(subs, id, &body)
        }
        (Method::POST, "release") => {
            let mut all = subs.subs();
            let Some(sub) = all.get_mut(id) else {
                return error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such subscription");
            };
            let current = sub.wake.as_ref().is_some_and(|w| {
                token_matches(w, wake_token(headers))
                    && body["wake_id"].as_str() == Some(w.id.as_str())
            });
            if !current {
                return error(
                    StatusCode::CONFLICT,
                    "FENCED",
                    "this wake is no longer current",
                );
            }
            if let Some(w) = sub.wake.as_mut() {
                w.holder = None;
                w.lease_until = None;
            }
            StatusCode::NO_CONTENT.into_response()
        }
        _ => error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such reserved API"),
    }
}

/// Why a definition was refused: status, code, message.
type Refusal = (StatusCode, &'static str, String);

/// A subscription from its definition (a `PUT` body, or a stored one: `stored` skips the
/// checks that depend on the moment, such as how many subscriptions exist).
fn parse_subscription(
    id: &str,
    body: &Value,
    limits: &SubscriptionLimits,
    stored: bool,
) -> Result<Subscription, Refusal> {
    if let Some(pattern) = body["pattern"].as_str()
        && let Err(message) = check_pattern(pattern, limits)
    {
        return Err((StatusCode::BAD_REQUEST, "INVALID_PATTERN", message));
    }
    let listed = body["streams"].as_array().map_or(0, Vec::len);
    if listed > limits.max_links && !stored {
        return Err((
            StatusCode::BAD_REQUEST,
            "TOO_MANY_STREAMS",
            format!("a subscription links at most {} streams", limits.max_links),
        ));
    }
    let kind = match body["type"].as_str() {
        Some("webhook") => {
            let url = body["webhook"]["url"].as_str().unwrap_or("");
            // A stored subscription keeps its URL when the allowed networks change: every
            // delivery checks the addresses it would reach anyway.
            if !stored && !webhook_url_allowed(url, &limits.webhook_allowed_networks) {
                return Err((
                    StatusCode::BAD_REQUEST,
                    "WEBHOOK_URL_REJECTED",
                    format!("webhook URL {url:?} is not allowed (private network or not http)"),
                ));
            }
            Kind::Webhook {
                url: url.to_owned(),
            }
        }
        Some("pull-wake") => match body["wake_stream"].as_str() {
            Some(s) => Kind::PullWake {
                wake_stream: s.to_owned(),
            },
            None => {
                return Err((
                    StatusCode::BAD_REQUEST,
                    "INVALID",
                    "pull-wake needs wake_stream".into(),
                ));
            }
        },
        _ => {
            return Err((
                StatusCode::BAD_REQUEST,
                "INVALID",
                "type must be webhook or pull-wake".into(),
            ));
        }
    };
    let explicit: BTreeSet<String> = body["streams"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect();
    if let Some(bad) = explicit.iter().find(|n| !valid_stream_name(n)) {
        return Err((
            StatusCode::BAD_REQUEST,
            "INVALID",
            format!("{bad:?} is not a stream name"),
        ));
    }
    Ok(Subscription {
        id: id.to_owned(),
        kind,
        pattern: body["pattern"].as_str().map(str::to_owned),
        lease_ttl: Duration::from_millis(body["lease_ttl_ms"].as_u64().unwrap_or(30_000))
            .min(MAX_LEASE),
        description: body["description"].as_str().map(str::to_owned),
        definition: body.clone(),
        links: explicit
            .into_iter()
            .map(|p| {
                (
                    p,
                    Link {
                        explicit: true,
                        acked: 0,
                        tail: 0,
                    },
                )
            })
            .collect(),
        generation: 0,
        wake: None,
    })
}

fn put(subs: &Subscriptions, id: &str, headers: &HeaderMap, body: Value) -> Response {
    let mut sub = match parse_subscription(id, &body, &subs.limits, false) {
        Ok(sub) => sub,
        Err((status, code, message)) => return error(status, code, message),
    };
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    sub.definition["__base"] = json!(format!("http://{host}"));
    let mut all = subs.subs();
    if let Some(existing) = all.get(id) {
        let mut same = existing.definition.clone();
        same["__base"] = sub.definition["__base"].clone();
        return if same == sub.definition {
            (StatusCode::OK, axum::Json(subs.describe(existing))).into_response()
        } else {
            error(
                StatusCode::CONFLICT,
                "CONFLICT",
                "subscription exists with another definition",
            )
        };
    }
    let stored: usize = all.values().map(Subscription::stored_bytes).sum();
    if stored + sub.stored_bytes() > subs.limits.max_stored_bytes {
        return too_much_stored(stored, subs.limits.max_stored_bytes);
    }
    if all.len() >= subs.limits.max_subscriptions {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "TOO_MANY_SUBSCRIPTIONS",
            format!(
                "this server keeps at most {} subscriptions",
                subs.limits.max_subscriptions
            ),
        );
    }
    let described = subs.describe(&sub);
    all.insert(id.to_owned(), sub);
    (StatusCode::CREATED, axum::Json(described)).into_response()
}

fn claim(subs: &Subscriptions, id: &str, body: &Value) -> Response {
    let worker = body["worker"].as_str().unwrap_or("").to_owned();
    let mut all = subs.subs();
    let Some(sub) = all.get_mut(id) else {
        return error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such subscription");
    };
    let now = Instant::now();
    if let Some(w) = &sub.wake
        && let (Some(holder), Some(until)) = (&w.holder, w.lease_until)
        && until > now
        && *holder != worker
    {
        return (
            StatusCode::CONFLICT,
            axum::Json(json!({"error": {
                "code": "ALREADY_CLAIMED",
                "message": "another worker holds this wake",
                "current_holder": holder,
            }})),
        )
            .into_response();
    }
    let pending: Vec<(String, u64)> = sub
        .links
        .iter()
        .filter(|(_, l)| l.tail > l.acked)
        .map(|(p, l)| (p.clone(), l.tail))
        .collect();
    if sub.wake.is_none() {
        if pending.is_empty() {
            return StatusCode::NO_CONTENT.into_response();
        }
        sub.generation += 1;
        sub.wake = Some(Wake {
            id: token(),
            generation: sub.generation,
            token: token(),
            streams: pending.clone(),
            holder: None,
            lease_until: None,
        });
    }
    let lease = sub.lease_ttl;
    let Some(w) = sub.wake.as_mut() else {
        return StatusCode::NO_CONTENT.into_response();
    };
    w.holder = Some(worker);
    w.lease_until = Some(now + lease);
    w.streams = pending;
    let answer = json!({
        "wake_id": w.id,
        "generation": w.generation,
        "token": w.token,
        "streams": w.streams.iter().map(|(p, t)| json!({"path": p, "tail_offset": format_offset(*t)})).collect::<Vec<_>>(),
    });
    axum::Json(answer).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob("events/*", "events/a"));
        assert!(!glob("events/*", "events/a/b"));
        assert!(glob("events/**", "events/a/b"));
        assert!(!glob("events/*", "other/a"));
    }

    #[test]
    fn globs_are_linear_and_bounded() {
        assert!(glob("**", "a/b/c"));
        assert!(glob("a/*/c", "a/b/c"));
        assert!(!glob("a/*/c", "a/b/x/c"));
        assert!(glob("a/**/c", "a/b/x/c"));
        assert!(glob("*a*b*", "xaybz"));
        assert!(!glob("*a*b*", "xbyaz"));
        // Many stars against a long name that almost matches: linear, answered at once.
        let name = format!("{}/", "a".repeat(10_000));
        assert!(!glob(&format!("{}b", "*a".repeat(1000)), &name));
        let limits = SubscriptionLimits::default();
        assert!(check_pattern(&"*".repeat(64), &limits).is_err());
        assert!(check_pattern(&"a".repeat(1000), &limits).is_err());
        assert!(check_pattern("events/**", &limits).is_ok());
    }

    #[test]
    fn webhook_targets() {
        let none: &[Network] = &[];
        assert!(webhook_url_allowed("https://example.com/hook", none));
        assert!(webhook_url_allowed("http://8.8.8.8/hook", none));
        assert!(!webhook_url_allowed("ftp://example.com/", none));
        assert!(!webhook_url_allowed("http://user:pw@example.com/", none));
        for url in [
            "http://127.0.0.1:9/hook",
            "http://10.0.0.1/hook",
            "http://192.168.1.2/hook",
            "http://172.16.0.1/",
            "http://100.64.0.1/",
            "http://169.254.169.254/latest/meta-data",
            "http://0.0.0.0/",
            "http://[::1]/",
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:10.0.0.1]/",
            "http://[::ffff:169.254.169.254]/",
            "http://[::ffff:0:127.0.0.1]/",
            "http://[64:ff9b:1::808:808]/",
            "http://[64:ff9b::a00:1]/",
            "http://[2002:a00:1::]/",
            "http://[fd00::1]/",
            "http://[fe80::1]/",
            "http://[ff02::1]/",
            "http://[::]/",
            "http://224.0.0.1/",
            "http://255.255.255.255/",
        ] {
            assert!(!webhook_url_allowed(url, none), "{url} is allowed");
        }
        let loopback: Vec<Network> = vec!["127.0.0.0/8".parse().unwrap()];
        assert!(webhook_url_allowed("http://127.0.0.1:9/hook", &loopback));
        assert!(!webhook_url_allowed("http://10.0.0.1/hook", &loopback));
        assert!("300.0.0.0/8".parse::<Network>().is_err());
        assert!("10.0.0.0/33".parse::<Network>().is_err());
    }

    #[test]
    fn wake_callbacks_are_recognized_by_path() {
        assert!(is_wake_callback(
            "/v1/stream/__ds/subscriptions/s1/callback"
        ));
        assert!(is_wake_callback("/v1/stream/__ds/subscriptions/s1/ack"));
        assert!(!is_wake_callback("/v1/stream/__ds/subscriptions/s1/claim"));
        assert!(!is_wake_callback("/v1/stream/__ds/subscriptions/s1"));
        assert!(!is_wake_callback("/v1/stream/events/callback"));
    }
}
