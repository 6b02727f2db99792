//! Stream subscriptions, the protocol's reserved `/v1/stream/__ds/` APIs: a subscription
//! watches streams (by pattern, or listed), and when one of them receives data it wakes its
//! consumer: a webhook (a signed POST; the consumer acks through a callback) or a pull-wake
//! stream (an event appended there; a worker claims the wake, acks and releases it).
//!
//! Wakes carry a generation; an ack for a generation that is no longer current is fenced (409).
//! Subscriptions live in memory: they do not survive a restart (the streams do).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bytes::Bytes;
use ring::signature::{Ed25519KeyPair, KeyPair as _};
use serde_json::{Value, json};

use crate::stream::{AppendRequest, Streams, format_offset};

const PREFIX: &str = "__ds/";

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

#[derive(Debug, Clone)]
struct Link {
    explicit: bool,
    acked: u64,
    tail: u64,
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
    http: reqwest::Client,
    streams: Streams,
}

impl std::fmt::Debug for Subscriptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriptions")
            .field("kid", &self.kid)
            .finish()
    }
}

/// `*` matches within one path segment, `**` across segments.
fn glob(pattern: &str, path: &str) -> bool {
    fn go(p: &[u8], s: &[u8]) -> bool {
        match p.first() {
            None => s.is_empty(),
            Some(b'*') if p.get(1) == Some(&b'*') => (0..=s.len()).any(|i| go(&p[2..], &s[i..])),
            Some(b'*') => (0..=s.len())
                .take_while(|i| *i == 0 || s[i - 1] != b'/')
                .any(|i| go(&p[1..], &s[i..])),
            Some(c) => s.first() == Some(c) && go(&p[1..], &s[1..]),
        }
    }
    go(pattern.as_bytes(), path.as_bytes())
}

/// Webhook targets must be http(s) and not private-network addresses (loopback is allowed,
/// for consumers on the same machine).
fn webhook_url_allowed(url: &str) -> bool {
    let Ok(parsed) = reqwest::Url::parse(url) else {
        return false;
    };
    if !matches!(parsed.scheme(), "http" | "https") {
        return false;
    }
    match parsed.host() {
        Some(url::Host::Ipv4(ip)) => {
            ip.is_loopback() || !(ip.is_private() || ip.is_link_local() || ip.is_unspecified())
        }
        Some(url::Host::Ipv6(ip)) => {
            let ip = IpAddr::V6(ip);
            ip.is_loopback() || !ip.is_unspecified()
        }
        Some(url::Host::Domain(_)) => true,
        None => false,
    }
}

impl Subscriptions {
    /// Subscriptions over `streams`, with a fresh signing key.
    pub(crate) fn new(streams: Streams) -> Option<Arc<Subscriptions>> {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng).ok()?;
        let key = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).ok()?;
        let subs = Arc::new(Subscriptions {
            subs: Mutex::new(HashMap::new()),
            kid: format!("ds_{}", &token()[..16]),
            key,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .ok()?,
            streams: streams.clone(),
        });
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
        Some(subs)
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
    async fn changed(&self, name: &str) {
        if self.subs().is_empty() {
            return;
        }
        let tail = match self.streams.get(name).await {
            Ok(s) => s.info().tail,
            Err(_) => return,
        };
        let mut deliveries = Vec::new();
        {
            let mut subs = self.subs();
            for sub in subs.values_mut() {
                let watched = sub.links.get(name).is_some_and(|l| l.explicit)
                    || sub.pattern.as_deref().is_some_and(|p| glob(p, name));
                if !watched {
                    continue;
                }
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
        for (id, kind, wake) in deliveries {
            match kind {
                Kind::Webhook { url } => self.notify(&id, &url, &wake).await,
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
        let answer = self
            .http
            .post(url)
            .header("content-type", "application/json")
            .header("webhook-signature", header)
            .body(body)
            .send()
            .await;
        let done = match answer {
            Ok(r) => r.json::<Value>().await.is_ok_and(|v| v["done"] == true),
            Err(e) => {
                tracing::warn!(subscription = id, error = %e, "webhook delivery failed");
                false
            }
        };
        if done {
            let acks: Vec<(String, u64)> = wake.streams.clone();
            let _ = self.finish(id, &wake.id, wake.generation, &acks, true);
        }
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

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("authorization")?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

fn acks(body: &Value) -> Vec<(String, u64)> {
    body["acks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| {
            Some((
                a["stream"].as_str()?.to_owned(),
                crate::stream::parse_offset(a["offset"].as_str()?)?,
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
    let body: Value = match axum::body::to_bytes(body, 1 << 20).await {
        Ok(b) if b.is_empty() => Value::Null,
        Ok(b) => match serde_json::from_slice(&b) {
            Ok(v) => v,
            Err(e) => return error(StatusCode::BAD_REQUEST, "INVALID_JSON", e.to_string()),
        },
        Err(e) => return error(StatusCode::BAD_REQUEST, "INVALID_BODY", e.to_string()),
    };
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
            let Some(sub) = all.get_mut(id) else {
                return error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such subscription");
            };
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
                .is_some_and(|w| Some(w.token.as_str()) == bearer(headers));
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
                Some(w.token.as_str()) == bearer(headers)
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

fn put(subs: &Subscriptions, id: &str, headers: &HeaderMap, body: Value) -> Response {
    let kind = match body["type"].as_str() {
        Some("webhook") => {
            let url = body["webhook"]["url"].as_str().unwrap_or("");
            if !webhook_url_allowed(url) {
                return error(
                    StatusCode::BAD_REQUEST,
                    "WEBHOOK_URL_REJECTED",
                    format!("webhook URL {url:?} is not allowed (private network or not http)"),
                );
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
                return error(
                    StatusCode::BAD_REQUEST,
                    "INVALID",
                    "pull-wake needs wake_stream",
                );
            }
        },
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "INVALID",
                "type must be webhook or pull-wake",
            );
        }
    };
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    let mut definition = body.clone();
    definition["__base"] = json!(format!("http://{host}"));
    let mut all = subs.subs();
    if let Some(existing) = all.get(id) {
        let mut same = existing.definition.clone();
        same["__base"] = definition["__base"].clone();
        return if same == definition {
            (StatusCode::OK, axum::Json(subs.describe(existing))).into_response()
        } else {
            error(
                StatusCode::CONFLICT,
                "CONFLICT",
                "subscription exists with another definition",
            )
        };
    }
    let explicit: BTreeSet<String> = body["streams"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect();
    let sub = Subscription {
        id: id.to_owned(),
        kind,
        pattern: body["pattern"].as_str().map(str::to_owned),
        lease_ttl: Duration::from_millis(body["lease_ttl_ms"].as_u64().unwrap_or(30_000)),
        description: body["description"].as_str().map(str::to_owned),
        definition,
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
    };
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
    if let Some(w) = &sub.wake {
        if let (Some(holder), Some(until)) = (&w.holder, w.lease_until) {
            if until > now && *holder != worker {
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
        }
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
    fn webhook_targets() {
        assert!(webhook_url_allowed("http://127.0.0.1:9/hook"));
        assert!(webhook_url_allowed("https://example.com/hook"));
        assert!(!webhook_url_allowed("http://10.0.0.1/hook"));
        assert!(!webhook_url_allowed("http://192.168.1.2/hook"));
        assert!(!webhook_url_allowed("ftp://example.com/"));
    }
}
