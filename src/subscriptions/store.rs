//! How subscriptions are stored: one object per subscription, a watermark object and the
//! signing key, all under `subscriptions/{node}/` (see `storage/paths.rs`).
//!
//! Formats (JSON, `format` 1):
//! - `subs/{key}.json`, `key` the first 32 hex digits of SHA-256 of the id:
//!   `{"format", "id", "owner", "definition", "base_url", "links": {name: {"explicit",
//!   "acked", "incarnation"?}}, "since": {node id: lsn}, "generation"}`: `links` holds the
//!   listed streams and those with something acked (a pattern's other links are found again
//!   by the rescan), `since` each engine's position when the subscription was made,
//!   `generation` the end of the block of generations reserved (a restart hands out the
//!   ones after it). The definition is the typed [`Definition`],
//!   never the request's JSON, so an object nests a fixed few levels whatever a client sent.
//! - `watermarks.json`: `{"format", "engines": {node id: lsn}}`: each engine's position when
//!   the registry first watched it; a restart rescans every stream changed after it.
//! - `signing-key.json`: `{"format", "pkcs8"}` (base64), created once with a conditional
//!   create.
//!
//! Nothing is written that this module could not load back: [`encode`] decodes what it
//! encoded and refuses objects over [`MAX_OBJECT_BYTES`], the most [`Store::load`] reads.
//! The earlier layout, one object `subscriptions/{node}.json` for all, is read once and
//! written out in this layout. Then it is deleted when every subscription in it was
//! written out; when some could not be (no usable type, too large to store), it is moved
//! aside first, to `subscriptions/{node}.unconverted-{unix ms}.json`, and logged: nothing
//! that was not converted is deleted, and what was converted is not read again (a
//! subscription deleted since would come back).
//!
//! Every request to the store waits at most the store timeout
//! ([`super::SubscriptionLimits::store_timeout`]); past it the request fails as
//! unavailable, and its caller retries later.

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine as _;
use futures::{StreamExt as _, TryStreamExt as _};
use object_store::path::Path;
use object_store::{ObjectStoreExt as _, PutMode, PutOptions, PutPayload};
use ring::signature::{Ed25519KeyPair, KeyPair as _};
use serde::{Deserialize, Serialize};

use super::{Definition, LEGACY_OWNER, SubscriptionError, Target};
use crate::log::Lsn;
use crate::storage::{Storage, paths};

/// Largest subscription object written or read.
pub(super) const MAX_OBJECT_BYTES: usize = 32 << 20;

/// The format this module writes.
const FORMAT: u32 = 1;

/// One subscription as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct StoredSubscription {
    pub(super) format: u32,
    pub(super) id: String,
    pub(super) owner: String,
    pub(super) definition: Definition,
    /// Unused: what earlier versions took from a request's `Host`; wakes carry the live
    /// node's advertise URL instead. Written empty, kept for older readers.
    #[serde(default)]
    pub(super) base_url: String,
    pub(super) links: BTreeMap<String, StoredLink>,
    /// Each engine's position when the subscription was made.
    #[serde(default)]
    pub(super) since: BTreeMap<String, Lsn>,
    pub(super) generation: u64,
}

/// A linked stream as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct StoredLink {
    pub(super) explicit: bool,
    pub(super) acked: u64,
    /// The incarnation `acked` refers to (a stream deleted and created again starts over).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) incarnation: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct StoredWatermarks {
    format: u32,
    engines: BTreeMap<String, Lsn>,
}

#[derive(Debug, Serialize, Deserialize)]
struct StoredKey {
    format: u32,
    pkcs8: String,
}

/// The stored form of a subscription, checked to load back the same under the loader's
/// limits.
pub(super) fn encode(sub: &StoredSubscription) -> Result<Vec<u8>, String> {
    let bytes = serde_json::to_vec(sub).map_err(|e| e.to_string())?;
    if bytes.len() > MAX_OBJECT_BYTES {
        return Err(format!(
            "the subscription would be stored as {} bytes; at most {MAX_OBJECT_BYTES} load",
            bytes.len()
        ));
    }
    match decode(&bytes) {
        Ok(back) if back == *sub => Ok(bytes),
        Ok(_) => Err("the stored form does not load back the same".into()),
        Err(e) => Err(format!("the stored form does not load back: {e}")),
    }
}

fn decode(bytes: &[u8]) -> Result<StoredSubscription, String> {
    let sub: StoredSubscription = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    if sub.format != FORMAT {
        return Err(format!("unknown format {}", sub.format));
    }
    Ok(sub)
}

/// The object key of subscription `id`: ids are client input, object names are not.
pub(super) fn key(id: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, id.as_bytes());
    digest.as_ref()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// An object read whole.
enum Read {
    Bytes(Vec<u8>),
    Missing,
    TooLarge(u64),
}

/// What [`Store::load`] found.
#[derive(Debug, Default)]
pub(super) struct Loaded {
    pub(super) subscriptions: Vec<StoredSubscription>,
    /// `None` when none were stored (a new node, or the earlier layout).
    pub(super) watermarks: Option<BTreeMap<String, Lsn>>,
}

/// A node's stored subscriptions.
#[derive(Debug, Clone)]
pub(super) struct Store {
    storage: Storage,
    node: String,
    /// Longest wait for one request.
    timeout: std::time::Duration,
}

fn storage_error(e: object_store::Error) -> SubscriptionError {
    SubscriptionError::Unavailable(format!("subscription storage: {e}"))
}

impl Store {
    pub(super) fn new(storage: Storage, node: &str, timeout: std::time::Duration) -> Store {
        Store {
            storage,
            node: node.to_owned(),
            timeout,
        }
    }

    /// `request` (to the store, about `path`), failed as unavailable when it does not
    /// finish within the timeout.
    async fn bounded<T>(
        &self,
        path: &Path,
        request: impl std::future::Future<Output = T>,
    ) -> Result<T, SubscriptionError> {
        tokio::time::timeout(self.timeout, request)
            .await
            .map_err(|_| {
                SubscriptionError::Unavailable(format!(
                    "subscription storage: no answer about {path} within {} ms",
                    self.timeout.as_millis()
                ))
            })
    }

    /// Writes `bytes` at `path`.
    async fn put(&self, path: &Path, bytes: Vec<u8>) -> Result<(), SubscriptionError> {
        self.bounded(
            path,
            self.storage.store().put(path, PutPayload::from(bytes)),
        )
        .await?
        .map_err(storage_error)?;
        Ok(())
    }

    /// Deletes the object at `path` (done when there is none).
    async fn delete_object(&self, path: &Path) -> Result<(), SubscriptionError> {
        match self
            .bounded(path, self.storage.store().delete(path))
            .await?
        {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(storage_error(e)),
        }
    }

    /// Writes subscription `id`'s stored form (from [`encode`]).
    pub(super) async fn write(&self, id: &str, bytes: Vec<u8>) -> Result<(), SubscriptionError> {
        self.put(
            &Path::from(paths::subscription(&self.node, &key(id))),
            bytes,
        )
        .await
    }

    /// Deletes subscription `id`'s object (done when there is none).
    pub(super) async fn delete(&self, id: &str) -> Result<(), SubscriptionError> {
        self.delete_object(&Path::from(paths::subscription(&self.node, &key(id))))
            .await
    }

    pub(super) async fn write_watermarks(
        &self,
        engines: &BTreeMap<String, Lsn>,
    ) -> Result<(), SubscriptionError> {
        let body = serde_json::to_vec(&StoredWatermarks {
            format: FORMAT,
            engines: engines.clone(),
        })
        .map_err(|e| SubscriptionError::Unavailable(e.to_string()))?;
        self.put(
            &Path::from(paths::subscription_watermarks(&self.node)),
            body,
        )
        .await
    }

    /// Reads an object whole, if it exists and holds at most `limit` bytes.
    async fn read(&self, path: &Path, limit: usize) -> Result<Read, SubscriptionError> {
        let read = async {
            let got = match self.storage.store().get(path).await {
                Ok(got) => got,
                Err(object_store::Error::NotFound { .. }) => return Ok(Read::Missing),
                Err(e) => return Err(storage_error(e)),
            };
            if usize::try_from(got.meta.size).unwrap_or(usize::MAX) > limit {
                return Ok(Read::TooLarge(got.meta.size));
            }
            Ok(Read::Bytes(
                got.bytes().await.map_err(storage_error)?.to_vec(),
            ))
        };
        self.bounded(path, read).await?
    }

    /// An object that must be read whole (or be missing).
    async fn read_small(
        &self,
        path: &Path,
        limit: usize,
    ) -> Result<Option<Vec<u8>>, SubscriptionError> {
        match self.read(path, limit).await? {
            Read::Bytes(bytes) => Ok(Some(bytes)),
            Read::Missing => Ok(None),
            Read::TooLarge(size) => Err(SubscriptionError::Unavailable(format!(
                "{path} holds {size} bytes; at most {limit} are read"
            ))),
        }
    }

    /// Loads every stored subscription and the watermarks. An object that does not decode
    /// is skipped (and logged), not deleted; a store that does not answer fails the load.
    pub(super) async fn load(&self) -> Result<Loaded, SubscriptionError> {
        let mut loaded = Loaded::default();
        let dir = Path::from(paths::subscriptions(&self.node));
        let listed: Vec<object_store::ObjectMeta> = self
            .bounded(&dir, self.storage.store().list(Some(&dir)).try_collect())
            .await?
            .map_err(storage_error)?;
        let reads = futures::stream::iter(listed.into_iter().map(|meta| async move {
            let read = self.read(&meta.location, MAX_OBJECT_BYTES).await;
            (meta.location, read)
        }))
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
        for (location, read) in reads {
            match read? {
                Read::Bytes(bytes) => match decode(&bytes) {
                    Ok(sub) => loaded.subscriptions.push(sub),
                    Err(e) => {
                        tracing::error!(object = %location, error = %e, "a stored subscription does not load; it is skipped and left in place");
                    }
                },
                Read::Missing => {}
                Read::TooLarge(size) => {
                    tracing::error!(object = %location, size, "a stored subscription is too large to load; it is skipped and left in place");
                }
            }
        }
        let path = Path::from(paths::subscription_watermarks(&self.node));
        if let Some(bytes) = self.read_small(&path, 16 << 20).await? {
            match serde_json::from_slice::<StoredWatermarks>(&bytes) {
                Ok(w) if w.format == FORMAT => loaded.watermarks = Some(w.engines),
                Ok(w) => {
                    tracing::error!(object = %path, format = w.format, "unknown watermark format; every engine is rescanned")
                }
                Err(e) => {
                    tracing::error!(object = %path, error = %e, "watermarks do not load; every engine is rescanned")
                }
            }
        }
        self.migrate_legacy(&mut loaded).await?;
        Ok(loaded)
    }

    /// Moves the earlier layout's subscriptions into this one: each written as an object,
    /// then the old object deleted, or, when some did not convert, moved aside (never
    /// deleted with what it alone holds). Ones already moved (a move cut short) are kept as
    /// moved.
    async fn migrate_legacy(&self, loaded: &mut Loaded) -> Result<(), SubscriptionError> {
        let path = Path::from(paths::legacy_subscriptions(&self.node));
        let Some(bytes) = self.read_small(&path, 64 << 20).await? else {
            return Ok(());
        };
        let legacy: legacy::Stored = match serde_json::from_slice(&bytes) {
            Ok(legacy) => legacy,
            Err(e) => {
                tracing::error!(object = %path, error = %e, "the earlier layout's subscriptions do not load; they are left in place");
                return Ok(());
            }
        };
        let mut unconverted = Vec::new();
        for old in legacy.subscriptions {
            if loaded.subscriptions.iter().any(|s| s.id == old.id) {
                continue;
            }
            let id = old.id.clone();
            let Some(sub) = old.into_stored() else {
                unconverted.push(id);
                continue;
            };
            let encoded = match encode(&sub) {
                Ok(encoded) => encoded,
                Err(e) => {
                    tracing::error!(subscription = %sub.id, error = %e, "an earlier subscription cannot be stored in this layout; it is kept in the earlier layout's object, moved aside");
                    unconverted.push(id);
                    continue;
                }
            };
            self.write(&sub.id, encoded).await?;
            loaded.subscriptions.push(sub);
        }
        if !unconverted.is_empty() {
            let millis = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            let aside = Path::from(paths::legacy_subscriptions_unconverted(&self.node, millis));
            self.put(&aside, bytes).await?;
            tracing::error!(object = %path, kept = %aside, ids = ?unconverted, "earlier subscriptions did not convert to this layout; the earlier object is kept, moved aside, for someone to look at");
        }
        self.delete_object(&path).await
    }

    /// The node's signing key: the stored one, or a new one stored first (a conditional
    /// create: two processes racing agree on one key).
    pub(super) async fn signing_key(&self) -> Result<Arc<SigningKey>, SubscriptionError> {
        let path = Path::from(paths::subscription_signing_key(&self.node));
        for _ in 0..3 {
            if let Some(bytes) = self.read_small(&path, 64 << 10).await? {
                let stored: StoredKey = serde_json::from_slice(&bytes).map_err(|e| {
                    SubscriptionError::Unavailable(format!("{path} does not load: {e}"))
                })?;
                let pkcs8 = base64::engine::general_purpose::STANDARD
                    .decode(stored.pkcs8)
                    .map_err(|e| {
                        SubscriptionError::Unavailable(format!("{path} does not load: {e}"))
                    })?;
                return SigningKey::from_pkcs8(&pkcs8).map(Arc::new);
            }
            let rng = ring::rand::SystemRandom::new();
            let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng)
                .map_err(|e| SubscriptionError::Unavailable(format!("key generation: {e}")))?;
            let body = serde_json::to_vec(&StoredKey {
                format: FORMAT,
                pkcs8: base64::engine::general_purpose::STANDARD.encode(pkcs8.as_ref()),
            })
            .map_err(|e| SubscriptionError::Unavailable(e.to_string()))?;
            let create = self.storage.store().put_opts(
                &path,
                PutPayload::from(body),
                PutOptions::from(PutMode::Create),
            );
            match self.bounded(&path, create).await? {
                Ok(_) => return SigningKey::from_pkcs8(pkcs8.as_ref()).map(Arc::new),
                // Another process stored one first (or an earlier attempt landed): read it.
                Err(
                    object_store::Error::AlreadyExists { .. }
                    | object_store::Error::Precondition { .. },
                ) => {}
                Err(e) => return Err(storage_error(e)),
            }
        }
        Err(SubscriptionError::Unavailable(format!(
            "{path}: no signing key could be stored or read"
        )))
    }
}

/// An Ed25519 key webhooks are signed with, and its id.
pub(crate) struct SigningKey {
    pair: Ed25519KeyPair,
    kid: String,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("kid", &self.kid)
            .finish()
    }
}

impl SigningKey {
    pub(super) fn from_pkcs8(pkcs8: &[u8]) -> Result<SigningKey, SubscriptionError> {
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8)
            .map_err(|e| SubscriptionError::Unavailable(format!("signing key: {e}")))?;
        let digest = ring::digest::digest(&ring::digest::SHA256, pair.public_key().as_ref());
        let kid = format!(
            "ds_{}",
            digest.as_ref()[..8]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        );
        Ok(SigningKey { pair, kid })
    }

    /// The key's id (`ds_` and 16 hex digits of its public key's digest).
    pub(crate) fn kid(&self) -> &str {
        &self.kid
    }

    /// The public key's 32 bytes.
    pub(crate) fn public_key(&self) -> &[u8] {
        self.pair.public_key().as_ref()
    }

    pub(super) fn sign(&self, message: &[u8]) -> Vec<u8> {
        self.pair.sign(message).as_ref().to_vec()
    }
}

/// The earlier layout (`subscriptions/{node}.json`), read only to move it.
mod legacy {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    use super::{FORMAT, LEGACY_OWNER, StoredLink, StoredSubscription, Target};

    #[derive(Deserialize)]
    pub(super) struct Stored {
        pub(super) subscriptions: Vec<Subscription>,
    }

    #[derive(Deserialize)]
    pub(super) struct Subscription {
        pub(super) id: String,
        definition: Definition,
        links: BTreeMap<String, Link>,
        generation: u64,
    }

    #[derive(Deserialize)]
    struct Link {
        explicit: bool,
        acked: u64,
    }

    /// The definition as a request gave it, plus the `__base` the server added; anything
    /// else in it is ignored.
    #[derive(Deserialize)]
    struct Definition {
        #[serde(rename = "type")]
        kind: Option<String>,
        pattern: Option<String>,
        #[serde(default)]
        streams: Vec<String>,
        webhook: Option<Webhook>,
        wake_stream: Option<String>,
        lease_ttl_ms: Option<u64>,
        description: Option<String>,
        #[serde(rename = "__base")]
        base: Option<String>,
    }

    #[derive(Deserialize)]
    struct Webhook {
        url: String,
    }

    impl Subscription {
        pub(super) fn into_stored(self) -> Option<StoredSubscription> {
            let d = self.definition;
            let target = match (d.kind.as_deref(), d.webhook, d.wake_stream) {
                (Some("webhook"), Some(w), _) => Target::Webhook { url: w.url },
                (Some("pull-wake"), _, Some(s)) => Target::PullWake { wake_stream: s },
                _ => {
                    tracing::error!(subscription = %self.id, "an earlier subscription has no usable type; it is not converted");
                    return None;
                }
            };
            let mut streams = d.streams;
            streams.sort();
            streams.dedup();
            Some(StoredSubscription {
                format: FORMAT,
                id: self.id,
                owner: LEGACY_OWNER.to_owned(),
                definition: super::Definition::new(
                    target,
                    d.pattern,
                    streams,
                    d.lease_ttl_ms,
                    d.description,
                ),
                base_url: d.base.unwrap_or_default(),
                links: self
                    .links
                    .into_iter()
                    .map(|(name, l)| {
                        (
                            name,
                            StoredLink {
                                explicit: l.explicit,
                                acked: l.acked,
                                incarnation: None,
                            },
                        )
                    })
                    .collect(),
                since: BTreeMap::new(),
                generation: self.generation,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StoredSubscription {
        StoredSubscription {
            format: FORMAT,
            id: "s".into(),
            owner: "local".into(),
            definition: Definition::new(
                Target::Webhook {
                    url: "https://example.com/h".into(),
                },
                Some("events/*".into()),
                vec!["a".into()],
                Some(1000),
                Some("d".into()),
            ),
            base_url: "http://localhost".into(),
            links: BTreeMap::from([(
                "a".to_owned(),
                StoredLink {
                    explicit: true,
                    acked: 3,
                    incarnation: Some("i".into()),
                },
            )]),
            since: BTreeMap::from([("n".to_owned(), 5)]),
            generation: 7,
        }
    }

    #[test]
    fn what_is_stored_loads_back() {
        let sub = sample();
        let bytes = encode(&sub).unwrap();
        assert_eq!(decode(&bytes).unwrap(), sub);
        // Keys are digests: fixed length, no client text.
        assert_eq!(key("../../x").len(), 32);
        assert_ne!(key("a"), key("b"));
    }

    #[tokio::test]
    async fn earlier_subscriptions_that_do_not_convert_are_kept_aside_never_deleted() {
        let storage =
            Storage::from_store(Arc::new(object_store::memory::InMemory::new()), "memory://");
        let store = Store::new(storage.clone(), "n", std::time::Duration::from_secs(10));
        let legacy = r#"{"subscriptions":[
            {"id":"good","definition":{"type":"pull-wake","wake_stream":"w","pattern":"e/*"},"links":{},"generation":1},
            {"id":"bad","definition":{"type":"carrier-pigeon"},"links":{},"generation":1}]}"#;
        let old = Path::from(paths::legacy_subscriptions("n"));
        storage
            .store()
            .put(&old, PutPayload::from(legacy.as_bytes().to_vec()))
            .await
            .unwrap();
        let loaded = store.load().await.unwrap();
        let ids: Vec<&str> = loaded.subscriptions.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["good"]);
        // The earlier object is moved aside whole: `bad` lives on there, nowhere else.
        assert!(matches!(
            storage.store().get(&old).await,
            Err(object_store::Error::NotFound { .. })
        ));
        let listed: Vec<object_store::ObjectMeta> = storage
            .store()
            .list(Some(&Path::from("subscriptions")))
            .try_collect()
            .await
            .unwrap();
        let aside: Vec<&object_store::ObjectMeta> = listed
            .iter()
            .filter(|m| {
                m.location
                    .as_ref()
                    .starts_with("subscriptions/n.unconverted-")
            })
            .collect();
        assert_eq!(aside.len(), 1, "{listed:?}");
        let kept = storage
            .store()
            .get(&aside[0].location)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(&kept[..], legacy.as_bytes());
        // What was converted is not converted again: deleted, it stays deleted.
        store.delete("good").await.unwrap();
        assert!(store.load().await.unwrap().subscriptions.is_empty());
    }

    #[test]
    fn the_earlier_layout_is_read_whatever_a_definition_held() {
        // A definition nested as deep as the request parser allowed, wrapped two levels
        // deeper by the earlier layout's file: its unknown field is skipped.
        let deep = format!("{}1{}", "[".repeat(126), "]".repeat(126));
        let text = format!(
            r#"{{"subscriptions":[{{"id":"s","definition":{{"type":"pull-wake","wake_stream":"w","pattern":"events/*","x":{deep},"__base":"http://h"}},"links":{{"events/a":{{"explicit":false,"acked":5}}}},"generation":3}}]}}"#
        );
        let legacy: legacy::Stored = serde_json::from_str(&text).unwrap();
        let sub = legacy
            .subscriptions
            .into_iter()
            .next()
            .unwrap()
            .into_stored()
            .unwrap();
        assert_eq!(sub.base_url, "http://h");
        assert_eq!(sub.owner, LEGACY_OWNER);
        assert_eq!(sub.links["events/a"].acked, 5);
        assert!(encode(&sub).is_ok());
    }
}
