//! The HTTP edge of subscriptions (the protocol's reserved `/v1/stream/__ds/` APIs): parses
//! a request into a typed call of [`crate::subscriptions::Subscriptions`] (through the
//! database) and renders its answer. Errors keep the protocol's shape,
//! `{"error": {"code", "message", "details"}}`: the code is the protocol's, the status comes
//! from the error's class through the one table in `http/error.rs`, `details` is every
//! classified answer's (`status`, `retry_after_seconds`).
//!
//! | request | call |
//! | --- | --- |
//! | `GET __ds/jwks.json` | the signing keys |
//! | `PUT`, `GET`, `DELETE __ds/subscriptions/{id}` | create or confirm, read, delete |
//! | `POST __ds/subscriptions/{id}/streams`, `DELETE …/streams/{name}` | link, unlink |
//! | `POST __ds/subscriptions/{id}/callback` or `/ack` | a consumer's acks (wake token) |
//! | `POST __ds/subscriptions/{id}/claim` | a worker claims the wake |
//! | `POST __ds/subscriptions/{id}/release` | the worker gives it back (wake token) |
//!
//! Bodies are at most 64 KiB of JSON, declared `application/json`, read into typed structs
//! through the server's body reader, within the request-body budget. A wake callback (which
//! no API key authorizes) is read only once its token matches a current wake of the id:
//! anyone else is answered 409 `FENCED` with nothing read.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use super::{Principal, Role};
use crate::db::BodyReservation;
use crate::error::{Applied, Classify, ErrorClass, Kind};
use crate::stream::{format_offset, parse_offset};
use crate::subscriptions::{
    Ack, Caller, ClaimView, Definition, RESERVED_PREFIX, SubscriptionError, Subscriptions, Target,
    TargetView, View, streams_json,
};

/// The reserved namespace, as a stream name starts.
const PREFIX: &str = "__ds/";

/// Largest request body, in bytes.
const MAX_BODY_BYTES: usize = 64 << 10;

/// Longest worker name, in bytes.
const MAX_WORKER_BYTES: usize = 256;

/// Whether a stream name is in the reserved namespace.
pub(super) fn reserved(name: &str) -> bool {
    name.starts_with(PREFIX)
}

/// Whether a request path is a wake callback (`.../subscriptions/{id}/callback`, `/ack`,
/// `/release`), which the wake's own token authorizes, never an API key.
pub(crate) fn is_wake_callback(path: &str) -> bool {
    let Some(rest) = path
        .strip_prefix(RESERVED_PREFIX)
        .and_then(|r| r.strip_prefix("subscriptions/"))
    else {
        return false;
    };
    matches!(
        rest.split_once('/').map(|(_, tail)| tail),
        Some("callback" | "ack" | "release")
    )
}

/// Whether a request is for the webhook signing keys (`GET __ds/jwks.json`): public keys,
/// which a consumer needs without holding an API key.
pub(crate) fn is_public_keys(method: &Method, path: &str) -> bool {
    *method == Method::GET
        && path
            .strip_prefix(RESERVED_PREFIX)
            .is_some_and(|rest| rest == "jwks.json")
}

/// Whether a request path is under the reserved namespace.
pub(super) fn is_reserved_path(path: &str) -> bool {
    path.starts_with(RESERVED_PREFIX)
}

/// What the edge itself refuses, before any call.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    #[error("the body is not JSON: {0}")]
    Json(String),
    #[error("{0}")]
    Invalid(String),
    #[error("send the body as Content-Type: application/json")]
    Media,
    #[error("no such reserved API")]
    UnknownApi,
}

impl Classify for RequestError {
    fn class(&self) -> ErrorClass {
        ErrorClass::rejected(match self {
            RequestError::Json(_) | RequestError::Invalid(_) => Kind::Invalid,
            RequestError::Media => Kind::UnsupportedMedia,
            RequestError::UnknownApi => Kind::NotFound,
        })
    }
}

impl RequestError {
    fn code(&self) -> &'static str {
        match self {
            RequestError::Json(_) => "INVALID_JSON",
            RequestError::Invalid(_) => "INVALID",
            RequestError::Media => "UNSUPPORTED_MEDIA_TYPE",
            RequestError::UnknownApi => "NOT_FOUND",
        }
    }
}

/// An error in the protocol's shape.
fn error_answer(
    code: &str,
    class: ErrorClass,
    message: String,
    extra: Map<String, Value>,
) -> Response {
    let (status, _) = super::error::status_and_code(class.kind);
    let mut error = Map::new();
    error.insert("code".into(), json!(code));
    error.insert("message".into(), json!(message));
    error.insert(
        "details".into(),
        Value::Object(super::error::class_details(&class)),
    );
    error.extend(extra);
    let mut response = (status, axum::Json(json!({ "error": error }))).into_response();
    if let Some(seconds) = class.retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    if let (Applied::Rejected, Some(cause)) = (class.applied, class.cause) {
        response.headers_mut().insert(
            "x-sluice-not-applied",
            HeaderValue::from_static(cause.name()),
        );
    }
    response
}

impl IntoResponse for SubscriptionError {
    fn into_response(self) -> Response {
        let mut extra = Map::new();
        if let SubscriptionError::AlreadyClaimed { holder } = &self {
            extra.insert("current_holder".into(), json!(holder));
        }
        error_answer(self.code(), self.class(), self.to_string(), extra)
    }
}

impl IntoResponse for RequestError {
    fn into_response(self) -> Response {
        error_answer(self.code(), self.class(), self.to_string(), Map::new())
    }
}

/// A `PUT` body: a subscription's definition.
#[derive(Debug, Deserialize)]
struct DefinitionBody {
    #[serde(rename = "type")]
    kind: KindName,
    pattern: Option<String>,
    #[serde(default)]
    streams: Vec<String>,
    webhook: Option<WebhookBody>,
    wake_stream: Option<String>,
    lease_ttl_ms: Option<u64>,
    description: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum KindName {
    Webhook,
    PullWake,
}

#[derive(Debug, Deserialize)]
struct WebhookBody {
    url: String,
}

#[derive(Debug, Deserialize)]
struct StreamsBody {
    streams: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct AckBody {
    wake_id: String,
    generation: u64,
    #[serde(default)]
    acks: Vec<AckItem>,
    #[serde(default)]
    done: bool,
}

#[derive(Debug, Deserialize)]
struct AckItem {
    stream: String,
    offset: String,
}

#[derive(Debug, Deserialize)]
struct ClaimBody {
    #[serde(default)]
    worker: String,
}

#[derive(Debug, Deserialize)]
struct ReleaseBody {
    wake_id: String,
    generation: Option<u64>,
}

impl DefinitionBody {
    fn into_definition(self) -> Result<Definition, RequestError> {
        let target = match self.kind {
            KindName::Webhook => Target::Webhook {
                url: self
                    .webhook
                    .ok_or_else(|| RequestError::Invalid("a webhook needs webhook.url".into()))?
                    .url,
            },
            KindName::PullWake => Target::PullWake {
                wake_stream: self
                    .wake_stream
                    .ok_or_else(|| RequestError::Invalid("pull-wake needs wake_stream".into()))?,
            },
        };
        Ok(Definition::new(
            target,
            self.pattern,
            self.streams,
            self.lease_ttl_ms,
            self.description,
        ))
    }
}

impl AckBody {
    fn into_ack(self) -> Result<Ack, RequestError> {
        let acks = self
            .acks
            .into_iter()
            .map(|a| match parse_offset(&a.offset) {
                Some(offset) => Ok((a.stream, offset)),
                None => Err(RequestError::Invalid(format!(
                    "{:?} is not an offset of this server",
                    a.offset
                ))),
            })
            .collect::<Result<_, _>>()?;
        Ok(Ack {
            wake_id: self.wake_id,
            generation: self.generation,
            acks,
            done: self.done,
        })
    }
}

/// Reads a typed JSON body (an empty one reads as `{}`), within [`MAX_BODY_BYTES`] and the
/// request-body budget.
async fn read_body<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Body,
    reservation: &mut BodyReservation,
) -> Result<T, Failure> {
    let bytes = super::body::read_body(body, MAX_BODY_BYTES, reservation)
        .await
        .map_err(Failure::Body)?;
    if bytes.is_empty() {
        return serde_json::from_slice(b"{}")
            .map_err(|e| RequestError::Invalid(e.to_string()).into());
    }
    // A JSON body must say so: a page could send a text/plain one without asking.
    if !super::is_json_request(headers) {
        return Err(RequestError::Media.into());
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        match e.classify() {
            serde_json::error::Category::Data => RequestError::Invalid(e.to_string()),
            _ => RequestError::Json(e.to_string()),
        }
        .into()
    })
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
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

fn caller(principal: Option<&Principal>) -> Caller {
    match principal {
        Some(p) => Caller {
            subject: p.owner.clone(),
            admin: p.role == Role::Admin,
        },
        None => Caller {
            subject: std::sync::Arc::from(""),
            admin: false,
        },
    }
}

/// Serves a request under `/v1/stream/__ds/` (`name` is the stream name, `__ds/...`).
pub(super) async fn handle(
    subscriptions: &Subscriptions,
    principal: Option<&Principal>,
    method: &Method,
    name: &str,
    headers: &HeaderMap,
    body: Body,
    reservation: &mut BodyReservation,
) -> Response {
    let rest = &name[PREFIX.len().min(name.len())..];
    if rest == "jwks.json" && *method == Method::GET {
        return jwks(subscriptions);
    }
    let Some(rest) = rest.strip_prefix("subscriptions/") else {
        return RequestError::UnknownApi.into_response();
    };
    let (id, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let caller = caller(principal);
    let request = Request {
        subscriptions,
        caller: &caller,
        method,
        id,
        tail,
        headers,
    };
    match dispatch(request, body, reservation).await {
        Ok(response) => response,
        Err(Failure::Request(e)) => e.into_response(),
        Err(Failure::Call(e)) => e.into_response(),
        Err(Failure::Body(e)) => e.into_response(),
    }
}

/// Why a request failed: at the edge, in the call, or reading the body.
enum Failure {
    Request(RequestError),
    Call(SubscriptionError),
    Body(super::ApiError),
}

/// What a request names.
struct Request<'a> {
    subscriptions: &'a Subscriptions,
    caller: &'a Caller,
    method: &'a Method,
    id: &'a str,
    tail: &'a str,
    headers: &'a HeaderMap,
}

impl From<RequestError> for Failure {
    fn from(e: RequestError) -> Self {
        Failure::Request(e)
    }
}

impl From<SubscriptionError> for Failure {
    fn from(e: SubscriptionError) -> Self {
        Failure::Call(e)
    }
}

async fn dispatch(
    request: Request<'_>,
    body: Body,
    reservation: &mut BodyReservation,
) -> Result<Response, Failure> {
    let Request {
        subscriptions,
        caller,
        method,
        id,
        tail,
        headers,
    } = request;
    // A wake callback is authorized by its token alone: checked before a byte is read.
    if *method == Method::POST
        && matches!(tail, "callback" | "ack" | "release")
        && !subscriptions.wake_token_current(id, wake_token(headers))
    {
        return Err(SubscriptionError::Fenced.into());
    }
    match (method.clone(), tail) {
        (Method::PUT, "") => {
            let definition = read_body::<DefinitionBody>(headers, body, reservation)
                .await?
                .into_definition()?;
            let (created, view) = subscriptions.put(caller, id, definition).await?;
            let status = if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            Ok((status, axum::Json(render_view(&view))).into_response())
        }
        (Method::GET, "") => {
            let view = subscriptions.get(caller, id)?;
            Ok(axum::Json(render_view(&view)).into_response())
        }
        (Method::DELETE, "") => {
            subscriptions.delete(caller, id).await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        (Method::POST, "streams") => {
            let request: StreamsBody = read_body(headers, body, reservation).await?;
            subscriptions
                .add_streams(caller, id, request.streams)
                .await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        (Method::DELETE, t) if t.starts_with("streams/") => {
            subscriptions
                .remove_stream(caller, id, &t["streams/".len()..])
                .await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        (Method::POST, "callback" | "ack") => {
            let ack = read_body::<AckBody>(headers, body, reservation)
                .await?
                .into_ack()?;
            let next = subscriptions.ack(id, wake_token(headers), ack).await?;
            Ok(axum::Json(json!({"ok": true, "next_wake": next})).into_response())
        }
        (Method::POST, "claim") => {
            let request: ClaimBody = read_body(headers, body, reservation).await?;
            if request.worker.len() > MAX_WORKER_BYTES {
                return Err(RequestError::Invalid(format!(
                    "a worker name is at most {MAX_WORKER_BYTES} bytes"
                ))
                .into());
            }
            match subscriptions.claim(caller, id, &request.worker).await? {
                Some(claimed) => Ok(axum::Json(render_claim(&claimed)).into_response()),
                None => Ok(StatusCode::NO_CONTENT.into_response()),
            }
        }
        (Method::POST, "release") => {
            let request: ReleaseBody = read_body(headers, body, reservation).await?;
            subscriptions.release(
                id,
                wake_token(headers),
                &request.wake_id,
                request.generation,
            )?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        _ => Err(RequestError::UnknownApi.into()),
    }
}

fn jwks(subscriptions: &Subscriptions) -> Response {
    let keys: Vec<Value> = subscriptions
        .public_keys()
        .into_iter()
        .map(|k| {
            json!({
                "kty": "OKP", "crv": "Ed25519", "alg": "EdDSA", "use": "sig", "kid": k.kid,
                "x": base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(k.key),
            })
        })
        .collect();
    (
        [(header::CONTENT_TYPE, "application/jwk-set+json")],
        json!({ "keys": keys }).to_string(),
    )
        .into_response()
}

fn render_view(view: &View) -> Value {
    let mut out = Map::new();
    out.insert("id".into(), json!(view.id));
    out.insert("lease_ttl_ms".into(), json!(view.lease_ttl_ms));
    out.insert(
        "streams".into(),
        view.streams
            .iter()
            .map(|l| {
                json!({
                    "path": l.path,
                    "link_type": if l.explicit { "explicit" } else { "pattern" },
                    "acked_offset": format_offset(l.acked),
                    "tail_offset": format_offset(l.tail),
                })
            })
            .collect(),
    );
    if let Some(p) = &view.pattern {
        out.insert("pattern".into(), json!(p));
    }
    if let Some(d) = &view.description {
        out.insert("description".into(), json!(d));
    }
    if view.overflowed {
        out.insert("overflowed".into(), json!(true));
    }
    match &view.target {
        TargetView::Webhook {
            url,
            redacted,
            kid,
            jwks_url,
        } => {
            out.insert("type".into(), json!("webhook"));
            let mut webhook = json!({
                "url": url,
                "signing": {"alg": "ed25519", "kid": kid, "jwks_url": jwks_url},
            });
            if *redacted && let Some(w) = webhook.as_object_mut() {
                w.insert("url_redacted".into(), json!(true));
            }
            out.insert("webhook".into(), webhook);
        }
        TargetView::PullWake { wake_stream } => {
            out.insert("type".into(), json!("pull-wake"));
            out.insert("wake_stream".into(), json!(wake_stream));
        }
    }
    Value::Object(out)
}

fn render_claim(claimed: &ClaimView) -> Value {
    json!({
        "wake_id": claimed.wake_id,
        "generation": claimed.generation,
        "token": claimed.token,
        "streams": streams_json(&claimed.streams, None),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wake_callbacks_are_recognized_by_path() {
        assert!(is_wake_callback(
            "/v1/stream/__ds/subscriptions/s1/callback"
        ));
        assert!(is_wake_callback("/v1/stream/__ds/subscriptions/s1/ack"));
        assert!(is_wake_callback("/v1/stream/__ds/subscriptions/s1/release"));
        assert!(!is_wake_callback("/v1/stream/__ds/subscriptions/s1/claim"));
        assert!(!is_wake_callback("/v1/stream/__ds/subscriptions/s1"));
        assert!(!is_wake_callback("/v1/stream/events/callback"));
    }

    #[test]
    fn the_signing_keys_are_public() {
        assert!(is_public_keys(&Method::GET, "/v1/stream/__ds/jwks.json"));
        assert!(!is_public_keys(&Method::PUT, "/v1/stream/__ds/jwks.json"));
        assert!(!is_public_keys(&Method::GET, "/v1/stream/__ds/jwks.json/x"));
        assert!(!is_public_keys(
            &Method::GET,
            "/v1/stream/__ds/subscriptions/s"
        ));
    }

    #[test]
    fn definitions_are_typed() {
        let body: DefinitionBody = serde_json::from_str(
            r#"{"type": "webhook", "webhook": {"url": "https://e.com/h"}, "lease_ttl_ms": 5, "extra": {"deep": [1]}}"#,
        )
        .unwrap();
        let d = body.into_definition().unwrap();
        assert_eq!(d.lease_ttl_ms, 1000, "held to the shortest lease");
        assert!(serde_json::from_str::<DefinitionBody>(r#"{"type": "smoke"}"#).is_err());
        let no_url: DefinitionBody = serde_json::from_str(r#"{"type": "webhook"}"#).unwrap();
        assert!(no_url.into_definition().is_err());
    }
}
