//! Delivering a wake: a signed POST to a webhook, or an event appended to a pull-wake
//! stream. One task per delivery, at most `max_deliveries` at once and of them at most
//! half for one owner (key) ([`Slots`]: the task holds a [`Slot`]); how it went goes back
//! to the registry, which schedules what follows (a retry, the lease, the next wake).
//!
//! A delivery never waits on the store without bound: the wake's generation is stored
//! first, within `store_timeout` (the store's own deadline, [`super::store`]); a store that
//! does not answer fails the attempt, which is retried with backoff, and frees the slot.
//!
//! A webhook's answer is read up to [`MAX_ANSWER_BYTES`] and the connection dropped after:
//! its status is what counts (2xx delivered), and a short `{"done": true}` body acks every
//! stream the wake named. The request goes through the one webhook client
//! ([`super::network::webhook_client`]: a 10 s deadline, no redirect, no proxy, only
//! addresses its resolver checked). The body is signed: `webhook-signature: t={unix seconds},kid={key id},ed25519={base64url signature of
//! "{t}.{body}"}`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use bytes::Bytes;
use serde::Deserialize;

use super::Target;
use super::registry::{Delivered, Due, Registry};
use crate::stream::{AppendRequest, Streams};

/// Most bytes of a webhook's answer read.
pub(super) const MAX_ANSWER_BYTES: usize = 4 << 10;

/// Deliveries in flight: at most `total` at once, and at most `share` (half, as with the
/// other per-key caps) for one owner, so that one key's slow webhooks never hold every
/// slot while other keys' wakes wait. A wake whose owner is at its share stays due and is
/// started by a later round.
#[derive(Debug)]
pub(super) struct Slots {
    total: usize,
    share: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    owners: HashMap<Arc<str>, usize>,
}

/// One delivery's hold on [`Slots`], given back when dropped.
#[derive(Debug)]
pub(super) struct Slot {
    slots: Arc<Slots>,
    owner: Arc<str>,
}

impl Slots {
    /// At most `total` (at least one) deliveries at once.
    pub(super) fn new(total: usize) -> Arc<Slots> {
        let total = total.max(1);
        Arc::new(Slots {
            total,
            share: super::registry::owner_share(total),
            held: Mutex::new(Held::default()),
        })
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Slots free now (for anyone).
    pub(super) fn free(&self) -> usize {
        self.total.saturating_sub(self.held().total)
    }

    /// A slot for a delivery of `owner`'s, unless every slot is taken or `owner` holds its
    /// share.
    pub(super) fn take(self: &Arc<Self>, owner: &Arc<str>) -> Option<Slot> {
        let mut held = self.held();
        let of_owner = held.owners.get(owner).copied().unwrap_or(0);
        if held.total >= self.total || of_owner >= self.share {
            return None;
        }
        held.total += 1;
        held.owners.insert(owner.clone(), of_owner + 1);
        Some(Slot {
            slots: self.clone(),
            owner: owner.clone(),
        })
    }
}

impl Slots {
    /// Slots `owner` holds now.
    #[cfg(test)]
    pub(super) fn held_by(&self, owner: &str) -> usize {
        self.held().owners.get(owner).copied().unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.slots.held();
        held.total = held.total.saturating_sub(1);
        if let Some(n) = held.owners.get_mut(&self.owner) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.owners.remove(&self.owner);
            }
        }
    }
}

/// Delivers wake `due` of `registry` and reports how it went.
pub(super) async fn deliver(
    registry: Arc<Registry>,
    due: Due,
    engines: Arc<RwLock<Vec<Streams>>>,
    client: reqwest::Client,
    public_url: Arc<str>,
    slot: Slot,
) {
    let outcome = attempt(&registry, &due, &engines, &client, &public_url).await;
    if let Err(reason) = &outcome {
        tracing::debug!(subscription = %due.id, %reason, "wake not delivered; retrying later");
    }
    registry
        .state()
        .delivered(&due.id, &due.wake_id, &outcome, Instant::now());
    drop(slot);
}

async fn attempt(
    registry: &Registry,
    due: &Due,
    engines: &RwLock<Vec<Streams>>,
    client: &reqwest::Client,
    public_url: &str,
) -> Result<Delivered, String> {
    // The wake's generation is stored before anyone hears of it (the store's deadline
    // bounds the wait).
    registry.persist(&due.id).await.map_err(|e| e.to_string())?;
    // Streams deleted since they were linked have nothing to read: settled first, so that a
    // wake never names (and never comes again and again for) a stream that is gone.
    let pending = registry.state().pending_names(&due.id);
    let marks = {
        let engines = engines.read().unwrap_or_else(|p| p.into_inner());
        super::tails_in(&engines, pending.iter().cloned())
    };
    registry.state().settle(&due.id, &pending, &marks);
    let payload = registry
        .state()
        .payload(&due.id, &due.wake_id, public_url)
        .ok_or_else(|| "the wake ended: nothing is pending".to_owned())?;
    match payload.target {
        Target::Webhook { url } => {
            let signature = signature(registry, &payload.body);
            post_webhook(
                client,
                &url,
                payload.body,
                signature,
                &registry.limits().webhook_allowed_networks,
            )
            .await
        }
        Target::PullWake { wake_stream } => {
            let engine = {
                let engines = engines.read().unwrap_or_else(|p| p.into_inner());
                engines
                    .iter()
                    .find(|e| e.contains(&wake_stream))
                    .or_else(|| engines.first())
                    .cloned()
            };
            let engine = engine.ok_or_else(|| "no stream engine".to_owned())?;
            engine
                .append(AppendRequest {
                    name: wake_stream.clone(),
                    content_type: Some("application/json".into()),
                    body: Bytes::from(payload.body),
                    close: false,
                    producer: None,
                    stream_seq: None,
                    incarnation: None,
                })
                .await
                .map_err(|e| format!("wake stream {wake_stream:?}: {e}"))?;
            Ok(Delivered::Posted)
        }
    }
}

fn signature(registry: &Registry, body: &str) -> String {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let signed = registry.key().sign(format!("{t}.{body}").as_bytes());
    format!(
        "t={t},kid={},ed25519={}",
        registry.key().kid(),
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(signed)
    )
}

/// A webhook's answer, when it is short JSON.
#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    done: bool,
}

async fn post_webhook(
    client: &reqwest::Client,
    url: &str,
    body: String,
    signature: String,
    allowed: &[super::Network],
) -> Result<Delivered, String> {
    let parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
    super::network::check_target(&parsed, allowed)?;
    let mut response = client
        .post(parsed)
        .header("content-type", "application/json")
        .header("webhook-signature", signature)
        .body(body)
        .send()
        .await
        .map_err(|e| format!("webhook delivery failed: {e}"))?;
    let status = response.status();
    let answer = read_bounded(&mut response, MAX_ANSWER_BYTES).await;
    // The rest of a longer answer is never read: dropping the answer closes the connection.
    drop(response);
    if !status.is_success() {
        return Err(format!("the webhook answered {status}"));
    }
    let done = answer
        .and_then(|b| serde_json::from_slice::<Answer>(&b).ok())
        .is_some_and(|a| a.done);
    Ok(if done {
        Delivered::WebhookDone
    } else {
        Delivered::Webhook
    })
}

/// The answer's body when it is at most `limit` bytes; `None` when it is longer or breaks
/// off.
async fn read_bounded(response: &mut reqwest::Response, limit: usize) -> Option<Vec<u8>> {
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return None;
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.ok()? {
        if body.len() + chunk.len() > limit {
            return None;
        }
        body.extend_from_slice(&chunk);
    }
    Some(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_owner_holds_at_most_half_of_the_slots_and_gets_them_back() {
        let slots = Slots::new(4);
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let first = slots.take(&a).unwrap();
        let second = slots.take(&a).unwrap();
        assert!(slots.take(&a).is_none(), "a holds its share");
        assert_eq!(slots.free(), 2);
        let others = [slots.take(&b).unwrap(), slots.take(&b).unwrap()];
        assert!(slots.take(&b).is_none());
        drop(first);
        assert!(slots.take(&b).is_none(), "b holds its share");
        let again = slots.take(&a).unwrap();
        assert!(slots.take(&Arc::from("c")).is_none(), "every slot is taken");
        drop((second, again, others));
        assert_eq!(slots.free(), 4);
        assert!(slots.held().owners.is_empty());
        // One slot in all: its one owner may hold it.
        let one = Slots::new(1);
        let only = one.take(&a).unwrap();
        assert!(one.take(&b).is_none());
        drop(only);
        assert!(one.take(&b).is_some());
    }
}
