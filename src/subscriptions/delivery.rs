//! Delivering a wake: a signed POST to a webhook, or an event appended to a pull-wake
//! stream. One task per delivery, at most `max_deliveries` at once (the dispatcher holds a
//! permit for each); how it went goes back to the registry, which schedules what follows
//! (a retry, the lease, the next wake).
//!
//! A webhook's answer is read up to [`MAX_ANSWER_BYTES`] and the connection dropped after:
//! its status is what counts (2xx delivered), and a short `{"done": true}` body acks every
//! stream the wake named. The request goes through the one webhook client
//! ([`super::network::webhook_client`]: a 10 s deadline, no redirect, no proxy, only
//! addresses its resolver checked). The body is signed: `webhook-signature: t={unix seconds},kid={key id},ed25519={base64url signature of
//! "{t}.{body}"}`.

use std::sync::{Arc, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use bytes::Bytes;
use serde::Deserialize;

use super::Target;
use super::registry::{Delivered, Due, Registry};
use crate::stream::{AppendRequest, Streams};

/// Most bytes of a webhook's answer read.
pub(super) const MAX_ANSWER_BYTES: usize = 4 << 10;

/// Delivers wake `due` of `registry` and reports how it went.
pub(super) async fn deliver(
    registry: Arc<Registry>,
    due: Due,
    engines: Arc<RwLock<Vec<Streams>>>,
    client: reqwest::Client,
    public_url: Arc<str>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let outcome = attempt(&registry, &due, &engines, &client, &public_url).await;
    if let Err(reason) = &outcome {
        tracing::debug!(subscription = %due.id, %reason, "wake not delivered; retrying later");
    }
    registry
        .state()
        .delivered(&due.id, &due.wake_id, &outcome, Instant::now());
    drop(permit);
}

async fn attempt(
    registry: &Registry,
    due: &Due,
    engines: &RwLock<Vec<Streams>>,
    client: &reqwest::Client,
    public_url: &str,
) -> Result<Delivered, String> {
    // The wake's generation is stored before anyone hears of it.
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
