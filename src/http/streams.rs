//! The Durable Streams protocol over HTTP, in both URL layouts: `/v1/stream/{name...}` (the
//! protocol's) and `/{bucket}/{stream}` (Ursula's). Both address the same streams: the
//! stream `s` of bucket `b` is the stream named `b/s`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::json;

use super::held::{AnswerBudget, Share, held};
use super::{ApiError, AppState, forward};
use crate::db::NamePlace;
use crate::error::{Applied, Cause, Classify as _, ErrorClass, Kind};
use crate::stream::{
    AppendOutcome, AppendRequest, CreateRequest, ForkRequest, Lifetime, MAX_APPEND_BYTES,
    MAX_PRODUCER_NUMBER, MAX_TOKEN_BYTES, ProducerTuple, ReadResult, Stream, StreamError,
    StreamInfo, Streams,
};

const NEXT_OFFSET: &str = "stream-next-offset";
const UP_TO_DATE: &str = "stream-up-to-date";
const CLOSED: &str = "stream-closed";
const CURSOR: &str = "stream-cursor";
const INCARNATION: &str = "stream-incarnation";
const TTL: &str = "stream-ttl";
const EXPIRES_AT: &str = "stream-expires-at";
const PRODUCER_ID: &str = "producer-id";
const PRODUCER_EPOCH: &str = "producer-epoch";
const PRODUCER_SEQ: &str = "producer-seq";

/// Most data one catch-up answer carries unless `max_bytes` says less.
const DEFAULT_READ_BYTES: usize = 8 << 20;
/// Most data one SSE data event carries.
const SSE_EVENT_BYTES: usize = 1 << 20;

/// What stream read answers (catch-up, long-poll, SSE events) hold at once, rendered and not
/// yet read by their clients, across every connection. An answer takes its share before it
/// reads: as much of what it asks for as is free, at least [`READ_FLOOR_BYTES`] (waited for
/// at most [`READ_WAIT`], then 503 `AnswerMemory` with `Retry-After`), and reads no more than
/// its share, so many readers (or readers that do not read) get shorter answers rather than
/// each holding its own copy of the stream.
pub(super) const READ_ANSWER_BYTES: usize = 256 << 20;

/// The least share a read answer waits for.
const READ_FLOOR_BYTES: usize = 64 << 10;

/// How long a read answer waits for its share.
const READ_WAIT: Duration = Duration::from_secs(10);

/// What an answer's syntax adds to the data it carries (a JSON array's brackets).
const READ_SLACK_BYTES: usize = 1 << 10;

/// A share of the read budget for an answer of up to `want` bytes of data, and the data
/// it may carry.
async fn read_share(state: &AppState, want: usize) -> Result<(Share, usize), ApiError> {
    let (share, granted) = state
        .read_budget
        .grant(
            want + READ_SLACK_BYTES,
            READ_FLOOR_BYTES.min(want + READ_SLACK_BYTES),
            READ_WAIT,
        )
        .await
        .ok_or_else(answer_memory)?;
    Ok((
        share,
        granted.saturating_sub(READ_SLACK_BYTES).clamp(1, want),
    ))
}

/// The answer `render` makes, within its share: a body larger than the share (one record
/// larger than it goes whole) waits for a share of its own first, the smaller share given
/// up meanwhile (a reader never waits for more while it holds some). `need` is at most what
/// the body takes; the share kept is what it takes.
async fn held_answer(
    state: &AppState,
    mut share: Share,
    need: usize,
    render: impl FnOnce() -> Vec<u8>,
) -> Result<Bytes, ApiError> {
    if need > share.num_permits() * 1024 {
        drop(share);
        share = state
            .read_budget
            .hold_within(need, READ_WAIT)
            .await
            .ok_or_else(answer_memory)?;
    }
    let body = render();
    AnswerBudget::fit(&mut share, body.len());
    Ok(held(body, share))
}

/// The refusal of a read whose answer finds no room.
fn answer_memory() -> ApiError {
    ApiError::classified(
        ErrorClass::retry(Cause::AnswerMemory),
        "answers not yet read by their clients hold the memory for stream reads; retry shortly"
            .into(),
    )
}

/// At most what [`render`] makes of `result`.
fn rendered_len(result: &ReadResult) -> usize {
    // A JSON array's brackets; its commas take the place of the messages' newlines.
    result.records.iter().map(Bytes::len).sum::<usize>() + 2
}

/// At most what [`sse_data`] and a control event make of `records`.
fn sse_len(encoding: SseEncoding, records: &[Bytes]) -> usize {
    let bytes: usize = records.iter().map(Bytes::len).sum::<usize>() + 2;
    let payload = match encoding {
        SseEncoding::Base64 => bytes.div_ceil(3) * 4,
        // Text that is not UTF-8 is replaced, three bytes for one at most.
        _ if records.iter().all(|r| std::str::from_utf8(r).is_ok()) => bytes,
        _ => bytes * 3,
    };
    // Each line of the payload is a `data:` field of its own.
    let lines = 1 + records
        .iter()
        .map(|r| r.iter().filter(|b| matches!(b, b'\r' | b'\n')).count())
        .sum::<usize>();
    payload + 6 * lines + 512
}

// ---- wire forms ------------------------------------------------------------------------

pub use crate::stream::format_offset;
pub(crate) use crate::stream::parse_offset;

/// Normalizes a content type: split on `;`, trim, drop empty parts, lowercase, join `"; "`.
fn normalize_content_type(raw: &str) -> String {
    raw.split(';')
        .map(|p| p.trim().to_ascii_lowercase())
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether a string is an incarnation token this server could have issued.
fn valid_incarnation(token: &str) -> bool {
    token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Headers every stream answer carries: browser safety and CORS.
///
/// Stored content never runs on the server's origin: every answer says `nosniff` and
/// `Content-Security-Policy: sandbox` (a `text/html` stream renders, if at all, as an opaque
/// origin with no scripts). CORS answers go only to the origins `cors_origins` allows;
/// preflights always list the protocol's methods and headers (they reveal nothing).
/// Preflights are answered here (`204`, never reaching `answer`); every other request is
/// answered by `answer`.
pub(super) async fn stream_headers(
    state: &AppState,
    request: Request,
    answer: impl AsyncFnOnce(Request) -> Response,
) -> Response {
    let preflight = request.method() == Method::OPTIONS;
    let origin = request
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .filter(|o| super::origin_allowed(&state.browser, o))
        .map(str::to_owned);
    let mut response = if preflight {
        StatusCode::NO_CONTENT.into_response()
    } else {
        answer(request).await
    };
    let h = response.headers_mut();
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        "content-security-policy",
        HeaderValue::from_static("sandbox; default-src 'none'"),
    );
    h.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static(if origin.is_some() {
            "cross-origin"
        } else {
            "same-origin"
        }),
    );
    if let Some(origin) = origin {
        if let Ok(v) = HeaderValue::from_str(&origin) {
            h.insert("access-control-allow-origin", v);
        }
        h.insert(header::VARY, HeaderValue::from_static("origin"));
        h.insert(
            "access-control-expose-headers",
            HeaderValue::from_static(
                "stream-next-offset, stream-cursor, stream-up-to-date, stream-closed, \
                 stream-incarnation, stream-ttl, stream-expires-at, producer-epoch, producer-seq, \
                 producer-expected-seq, producer-received-seq, stream-sse-data-encoding, \
                 x-sluice-not-applied, x-ursula-not-applied, etag, content-type, location",
            ),
        );
    }
    if preflight {
        h.insert(
            "access-control-allow-methods",
            HeaderValue::from_static("GET, POST, PUT, DELETE, HEAD, OPTIONS"),
        );
        h.insert(
            "access-control-allow-headers",
            HeaderValue::from_static(
                "content-type, authorization, if-none-match, stream-seq, stream-ttl, \
                 stream-expires-at, stream-closed, stream-incarnation, producer-id, \
                 producer-epoch, producer-seq, stream-forked-from, stream-fork-offset, \
                 stream-fork-sub-offset, stream-wake-token",
            ),
        );
        h.insert("access-control-max-age", HeaderValue::from_static("86400"));
    }
    response
}

/// A stream name from the protocol layout.
fn protocol_name(name: &str) -> Result<String, ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 1024
        && !name.bytes().any(|b| b < 0x20 || b == 0x7f)
        && name
            .split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..");
    if ok {
        Ok(name.to_owned())
    } else {
        Err(ApiError::bad_request(format!(
            "invalid stream name {name:?}"
        )))
    }
}

/// Checks a bucket id of the Ursula layout. `__ds` is refused: `__ds/{stream}` is the
/// protocol's reserved namespace, which no stream may be created in.
fn check_bucket(bucket: &str) -> Result<(), ApiError> {
    let ok = (4..=64).contains(&bucket.len())
        && !is_reserved(&format!("{bucket}/"))
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "invalid bucket id {bucket:?}: use 4 to 64 of a-z, 0-9, '_' and '-', not __ds"
        )))
    }
}

/// A stream name from the Ursula layout.
fn bucket_name(bucket: &str, stream: &str) -> Result<String, ApiError> {
    check_bucket(bucket)?;
    let ok = !stream.is_empty()
        && stream.len() <= 122
        && !stream.contains(['/', '\0'])
        && !stream.contains("..")
        && !stream.starts_with('$');
    if !ok {
        return Err(ApiError::bad_request(format!(
            "invalid stream id {stream:?}: at most 122 bytes, no '/', NUL or '..', not starting with '$'"
        )));
    }
    Ok(format!("{bucket}/{stream}"))
}

/// Resolves a `Stream-Forked-From` value (a path from the server root, or a URL) to a name.
fn source_name(value: &str) -> Result<String, ApiError> {
    let path = match value.find("://") {
        Some(i) => value[i + 3..]
            .find('/')
            .map_or("/", |j| &value[i + 3 + j..]),
        None => value,
    };
    let path = path.split(['?', '#']).next().unwrap_or(path);
    if let Some(name) = path.strip_prefix("/v1/stream/") {
        return protocol_name(name);
    }
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    match (parts.next(), parts.next()) {
        (Some(bucket), Some(stream)) => bucket_name(bucket, stream),
        _ => Err(ApiError::bad_request(format!(
            "Stream-Forked-From {value:?} names no stream"
        ))),
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, ApiError> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(Some)
            .map_err(|_| ApiError::bad_request(format!("header {name} is not visible ASCII"))),
    }
}

/// Parses a plain decimal: no sign, no leading zeros, no dot, no exponent.
fn plain_decimal(text: &str) -> Option<u64> {
    let canonical = text == "0" || (!text.starts_with('0') && !text.is_empty());
    if canonical && text.bytes().all(|b| b.is_ascii_digit()) {
        text.parse().ok()
    } else {
        None
    }
}

fn content_type(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(raw) = header_str(headers, "content-type")? else {
        return Ok(None);
    };
    let normalized = normalize_content_type(raw);
    if normalized.is_empty() {
        return Ok(None);
    }
    let media = normalized.split(';').next().unwrap_or("").trim();
    let token = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b))
    };
    match media.split_once('/') {
        Some((t, sub)) if token(t) && token(sub) => Ok(Some(normalized)),
        _ => Err(ApiError::bad_request(format!(
            "invalid Content-Type {raw:?}"
        ))),
    }
}

fn closed_flag(headers: &HeaderMap) -> Result<bool, ApiError> {
    Ok(header_str(headers, CLOSED)?.is_some_and(|v| v.eq_ignore_ascii_case("true")))
}

fn incarnation(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    match header_str(headers, INCARNATION)? {
        None => Ok(None),
        Some(v) if valid_incarnation(v) => Ok(Some(v.to_owned())),
        Some(v) => Err(ApiError::bad_request(format!(
            "malformed Stream-Incarnation {v:?}"
        ))),
    }
}

fn lifetime(headers: &HeaderMap) -> Result<Lifetime, ApiError> {
    let ttl = header_str(headers, TTL)?;
    let expires = header_str(headers, EXPIRES_AT)?;
    if ttl.is_some() && expires.is_some() {
        return Err(ApiError::bad_request(
            "Stream-TTL and Stream-Expires-At cannot both be set",
        ));
    }
    let mut lifetime = Lifetime::default();
    if let Some(t) = ttl {
        lifetime.ttl_secs = Some(plain_decimal(t).ok_or_else(|| {
            ApiError::bad_request(format!(
                "invalid Stream-TTL {t:?}: use plain decimal seconds"
            ))
        })?);
    }
    if let Some(e) = expires {
        let nanos = crate::types::temporal::parse_timestamp(e.as_bytes()).map_err(|_| {
            ApiError::bad_request(format!("invalid Stream-Expires-At {e:?}: use RFC 3339"))
        })?;
        lifetime.expires_at = Some(e.to_owned());
        lifetime.expires_at_ms = Some(nanos.div_euclid(1_000_000));
    }
    Ok(lifetime)
}

fn producer(headers: &HeaderMap) -> Result<Option<ProducerTuple>, ApiError> {
    let id = header_str(headers, PRODUCER_ID)?;
    let epoch = header_str(headers, PRODUCER_EPOCH)?;
    let seq = header_str(headers, PRODUCER_SEQ)?;
    let (id, epoch, seq) = match (id, epoch, seq) {
        (None, None, None) => return Ok(None),
        (Some(id), Some(epoch), Some(seq)) => (id, epoch, seq),
        _ => {
            return Err(ApiError::bad_request(
                "Producer-Id, Producer-Epoch and Producer-Seq go together",
            ));
        }
    };
    if id.is_empty() || id.len() > MAX_TOKEN_BYTES {
        return Err(ApiError::bad_request(format!(
            "Producer-Id must be 1 to {MAX_TOKEN_BYTES} bytes"
        )));
    }
    // A decimal integer in its one spelling: digits only, no leading zero ("01" is not 1).
    let number = |name: &str, text: &str| {
        (text.bytes().all(|b| b.is_ascii_digit()) && (text == "0" || !text.starts_with('0')))
            .then(|| text.parse::<u64>().ok())
            .flatten()
            .filter(|n| !text.is_empty() && *n <= MAX_PRODUCER_NUMBER)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "{name} must be an integer from 0 to {MAX_PRODUCER_NUMBER}"
                ))
            })
    };
    Ok(Some(ProducerTuple {
        id: id.to_owned(),
        epoch: number("Producer-Epoch", epoch)?,
        seq: number("Producer-Seq", seq)?,
    }))
}

fn stream_seq(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    match header_str(headers, "stream-seq")? {
        None => Ok(None),
        Some(v)
            if !v.is_empty()
                && v.len() <= MAX_TOKEN_BYTES
                && v.bytes().all(|b| (0x20..0x7f).contains(&b)) =>
        {
            Ok(Some(v.to_owned()))
        }
        Some(_) => Err(ApiError::bad_request(format!(
            "Stream-Seq must be 1 to {MAX_TOKEN_BYTES} bytes of printable ASCII"
        ))),
    }
}

fn fork(headers: &HeaderMap) -> Result<Option<ForkRequest>, ApiError> {
    let from = header_str(headers, "stream-forked-from")?;
    let offset = header_str(headers, "stream-fork-offset")?;
    let sub = header_str(headers, "stream-fork-sub-offset")?;
    let Some(from) = from else {
        if sub.is_some() || offset.is_some() {
            return Err(ApiError::bad_request(
                "Stream-Fork-Offset and Stream-Fork-Sub-Offset need Stream-Forked-From",
            ));
        }
        return Ok(None);
    };
    let offset =
        match offset {
            None => None,
            Some(o) => Some(parse_offset(o).ok_or_else(|| {
                ApiError::bad_request(format!("invalid Stream-Fork-Offset {o:?}"))
            })?),
        };
    let sub_offset = match sub {
        None => None,
        Some(s) => Some(plain_decimal(s).ok_or_else(|| {
            ApiError::bad_request(format!("invalid Stream-Fork-Sub-Offset {s:?}"))
        })?),
    };
    Ok(Some(ForkRequest {
        source: source_name(from)?,
        offset,
        sub_offset,
    }))
}

/// Reads a create's or append's body within [`MAX_APPEND_BYTES`] and the request-body
/// budget; the reservation is held until the request is answered. A body still arriving when
/// the server begins to stop is refused ([`StreamError::ShuttingDown`], 503): a stopping
/// server waits for the requests it serves, and a body that trickles in would hold it up.
async fn body_bytes(
    state: &AppState,
    owner: Option<&super::Owner>,
    body: Body,
) -> Result<(Bytes, crate::db::BodyReservation), ApiError> {
    let mut reservation = state.db.body_reservation(owner);
    let read = async move {
        let bytes = super::body::read_body(body, MAX_APPEND_BYTES, &mut reservation).await?;
        Ok::<_, ApiError>((bytes, reservation))
    };
    let mut closing = state.db.streams().closing();
    tokio::select! {
        // A body that is whole is served, stopping or not: the log takes writes until the
        // server has answered every request it read.
        biased;
        read = read => read,
        _ = closing.wait_for(|stopping| *stopping) => Err(StreamError::ShuttingDown.into()),
    }
}

/// Headers of appends that Ursula removed in 0.6.0 (its release notes: "`Stream-Record-Match`
/// on an append answers `400`"); an append that carries one is refused, not served as if the
/// condition held.
const REMOVED_APPEND_HEADERS: &[&str] = &["stream-record-match"];

fn set(headers: &mut HeaderMap, name: &'static str, value: impl AsRef<str>) {
    if let Ok(v) = HeaderValue::from_str(value.as_ref()) {
        headers.insert(HeaderName::from_static(name), v);
    }
}

fn offset_error(e: ApiError, tail: u64) -> ApiError {
    e.header(NEXT_OFFSET, format_offset(tail))
}

impl From<StreamError> for ApiError {
    fn from(e: StreamError) -> Self {
        // The class decides status, code and outcome; the protocol adds its headers.
        let error = ApiError::of(&e);
        match e {
            StreamError::Closed { tail } => offset_error(error, tail).header(CLOSED, "true"),
            StreamError::ContentTypeMismatch { tail, .. }
            | StreamError::StreamSeqConflict { tail, .. } => offset_error(error, tail),
            StreamError::StaleEpoch { current } => {
                error.header(PRODUCER_EPOCH, current.to_string())
            }
            StreamError::SequenceGap {
                expected,
                received,
                tail,
            } => offset_error(error, tail)
                .header("producer-expected-seq", expected.to_string())
                .header("producer-received-seq", received.to_string()),
            StreamError::IncarnationMismatch { current } => error.header(INCARNATION, current),
            // Which budget is full (a key's share of it when the answer is 429), its size
            // and what is held of it.
            StreamError::StateFull { what, budget, held }
            | StreamError::KeyShareFull { what, budget, held } => {
                let mut error = error;
                error.details.insert("budget_of".into(), json!(what));
                error.details.insert("budget_bytes".into(), json!(budget));
                error.details.insert("held_bytes".into(), json!(held));
                error
            }
            _ => error,
        }
    }
}

/// Metadata headers of a stream.
fn info_headers(headers: &mut HeaderMap, info: &StreamInfo) {
    set(headers, "content-type", &info.content_type);
    set(headers, NEXT_OFFSET, format_offset(info.tail));
    set(headers, INCARNATION, &info.incarnation);
    if info.closed {
        set(headers, CLOSED, "true");
    }
    if let Some(ttl) = info.lifetime.ttl_secs {
        set(headers, TTL, ttl.to_string());
    }
    if let Some(at) = &info.lifetime.expires_at {
        set(headers, EXPIRES_AT, at);
    }
}

// ---- routes: one handler set for both layouts ------------------------------------------

/// Serves the reserved `__ds/` namespace (subscriptions).
async fn reserved(
    state: &AppState,
    principal: Option<&super::Principal>,
    method: Method,
    name: &str,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let mut reservation = state
        .db
        .body_reservation(principal.and_then(|p| super::body_owner(state, p)));
    super::subscriptions::handle(
        state.db.subscriptions(),
        principal,
        &method,
        name,
        headers,
        body,
        &mut reservation,
    )
    .await
}

/// Who made a request, as `authenticate` found it.
type Caller = Option<axum::Extension<super::Principal>>;

fn is_reserved(name: &str) -> bool {
    super::subscriptions::reserved(name)
}

/// What a stream route addresses: a stream, named from either URL layout
/// (`/v1/stream/{name...}` or `/{bucket}/{stream}`, the stream `{bucket}/{stream}`), or the
/// protocol layout's reserved `__ds/` namespace (subscriptions).
pub(super) enum Target {
    Stream(String),
    Reserved(String),
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Target {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let Path(params) =
            Path::<std::collections::HashMap<String, String>>::from_request_parts(parts, state)
                .await
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
        if let Some(name) = params.get("name") {
            return if is_reserved(name) {
                Ok(Target::Reserved(name.clone()))
            } else {
                Ok(Target::Stream(protocol_name(name)?))
            };
        }
        match (params.get("bucket"), params.get("stream")) {
            (Some(bucket), Some(stream)) => Ok(Target::Stream(bucket_name(bucket, stream)?)),
            _ => Err(ApiError::bad_request("no stream named")),
        }
    }
}

/// The answer of the peer that serves stream `name`, when another node does
/// ([`forward`]); otherwise the body back, for this node to serve the request.
async fn at_owner(
    state: &AppState,
    owner: Option<&super::Owner>,
    name: &str,
    method: Method,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
    body: Body,
) -> Result<Result<Response, Body>, ApiError> {
    let peer = match forward::owner(state, name, headers).await {
        Some(peer) => peer,
        // No live process said it serves the stream. A create claims its name itself; any
        // other request asks the name's claim, so that a stream whose owner is between
        // processes (dead, not yet taken over) answers "retry", not "not found".
        None if method == Method::PUT || state.db.serves_stream(name) => {
            return Ok(Err(body));
        }
        // Forwarded here by a peer that took this process for the stream's owner, but the
        // stream is not served here: it moved (deleted and created again elsewhere, taken
        // over, or this address now answers for a new process). A stream whose name is
        // claimed elsewhere is not "not found": the peer is told to look again.
        None if headers.contains_key(forward::FORWARDED) => {
            return match state.db.locate_stream_name(name).await {
                Ok(Some(NamePlace::At(_))) => Err(ApiError::classified(
                    ErrorClass::retry(Cause::OwnerMoved),
                    format!("stream {name:?} is served by another node now"),
                )),
                Ok(Some(NamePlace::Here) | None) => Ok(Err(body)),
                Err(e) => Err(ApiError::of(&e)),
            };
        }
        None => match state
            .db
            .locate_stream_name(name)
            .await
            .map_err(|e| ApiError::of(&e))?
        {
            Some(NamePlace::At(peer)) => {
                state.db.note_stream_owner(name, Some(&peer));
                peer
            }
            Some(NamePlace::Here) | None => return Ok(Err(body)),
        },
    };
    let (body, _reservation) = body_bytes(state, owner, body).await?;
    Ok(Ok(forward::forward(
        state, name, &peer, method, uri, headers, body,
    )
    .await))
}

pub(super) async fn put(
    State(state): State<AppState>,
    target: Target,
    axum::Extension(principal): axum::Extension<super::Principal>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    body: Body,
) -> Result<Response, ApiError> {
    match target {
        Target::Reserved(name) => {
            Ok(reserved(&state, Some(&principal), Method::PUT, &name, &headers, body).await)
        }
        Target::Stream(name) => {
            let owner = super::body_owner(&state, &principal);
            match at_owner(&state, owner, &name, Method::PUT, &uri, &headers, body).await? {
                Ok(answer) => Ok(answer),
                Err(body) => create(&state, owner, name, &headers, &uri, body).await,
            }
        }
    }
}

pub(super) async fn post(
    State(state): State<AppState>,
    target: Target,
    axum::Extension(principal): axum::Extension<super::Principal>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    body: Body,
) -> Result<Response, ApiError> {
    match target {
        Target::Reserved(name) => Ok(reserved(
            &state,
            Some(&principal),
            Method::POST,
            &name,
            &headers,
            body,
        )
        .await),
        Target::Stream(name) => {
            let owner = super::body_owner(&state, &principal);
            match at_owner(&state, owner, &name, Method::POST, &uri, &headers, body).await? {
                Ok(answer) => Ok(answer),
                Err(body) => append(&state, owner, name, &headers, body).await,
            }
        }
    }
}

pub(super) async fn get(
    State(state): State<AppState>,
    principal: Caller,
    target: Target,
    headers: HeaderMap,
    uri: axum::http::Uri,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    match target {
        Target::Reserved(name) => {
            let principal = principal.as_ref().map(|p| &p.0);
            Ok(reserved(
                &state,
                principal,
                Method::GET,
                &name,
                &headers,
                Body::empty(),
            )
            .await)
        }
        Target::Stream(name) => {
            if let Some(answer) = sealed_read(&state, &name, &headers, query.as_deref()).await? {
                return Ok(answer);
            }
            match at_owner(
                &state,
                None,
                &name,
                Method::GET,
                &uri,
                &headers,
                Body::empty(),
            )
            .await?
            {
                Ok(answer) => Ok(answer),
                Err(_) => read(&state, name, &headers, query.as_deref()).await,
            }
        }
    }
}

pub(super) async fn head_stream(
    State(state): State<AppState>,
    target: Target,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Result<Response, ApiError> {
    match target {
        Target::Reserved(_) => Err(ApiError::not_found("no stream here")),
        Target::Stream(name) => {
            match at_owner(
                &state,
                None,
                &name,
                Method::HEAD,
                &uri,
                &headers,
                Body::empty(),
            )
            .await?
            {
                Ok(answer) => Ok(answer),
                Err(_) => head(&state, name).await,
            }
        }
    }
}

pub(super) async fn delete_stream(
    State(state): State<AppState>,
    principal: Caller,
    target: Target,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Result<Response, ApiError> {
    match target {
        Target::Reserved(name) => {
            let principal = principal.as_ref().map(|p| &p.0);
            Ok(reserved(
                &state,
                principal,
                Method::DELETE,
                &name,
                &headers,
                Body::empty(),
            )
            .await)
        }
        Target::Stream(name) => {
            match at_owner(
                &state,
                None,
                &name,
                Method::DELETE,
                &uri,
                &headers,
                Body::empty(),
            )
            .await?
            {
                Ok(answer) => Ok(answer),
                Err(_) => delete(&state, name, &headers).await,
            }
        }
    }
}

/// `PUT /{bucket}`: buckets are namespaces; creating one stores nothing.
pub(super) async fn put_bucket(Path(bucket): Path<String>) -> Result<Response, ApiError> {
    check_bucket(&bucket)?;
    Ok(StatusCode::CREATED.into_response())
}

// ---- operations ------------------------------------------------------------------------

async fn create(
    state: &AppState,
    owner: Option<&super::Owner>,
    name: String,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
    body: Body,
) -> Result<Response, ApiError> {
    let (content_type, lifetime, closed, fork, incarnation) = (
        content_type(headers)?,
        lifetime(headers)?,
        closed_flag(headers)?,
        fork(headers)?,
        incarnation(headers)?,
    );
    let (body, _reservation) = body_bytes(state, owner, body).await?;
    let request = CreateRequest {
        key: owner.cloned(),
        name,
        content_type,
        lifetime,
        closed,
        fork,
        incarnation,
        body,
    };
    let forwarded = headers.contains_key(forward::FORWARDED);
    // A fork is made where its source is served.
    if let Some(fork) = &request.fork
        && let Some(peer) = forward::owner(state, &fork.source, headers).await
    {
        let body = request.body.clone();
        return Ok(
            forward::forward(state, &request.name, &peer, Method::PUT, uri, headers, body).await,
        );
    }
    let name_lock = state.db.lock_stream_name(&request.name).await;
    let hosted = request
        .fork
        .as_ref()
        .and_then(|f| state.db.hosted_id_of(&f.source));
    let incarnation = crate::stream::new_incarnation();
    match state
        .db
        .claim_stream_name(&request.name, hosted.as_deref(), &incarnation)
        .await
        .map_err(|e| ApiError::of(&e))?
    {
        NamePlace::Here => {}
        NamePlace::At(_) if request.fork.is_some() => {
            return Err(ApiError::classified(
                ErrorClass::rejected(Kind::Conflict),
                format!(
                    "stream {:?} exists on another node than its fork source {:?}",
                    request.name,
                    request.fork.as_ref().map_or("", |f| f.source.as_str())
                ),
            ));
        }
        NamePlace::At(peer) if !forwarded => {
            drop(name_lock);
            state.db.note_stream_owner(&request.name, Some(&peer));
            let body = request.body.clone();
            return Ok(forward::forward(
                state,
                &request.name,
                &peer,
                Method::PUT,
                uri,
                headers,
                body,
            )
            .await);
        }
        NamePlace::At(_) => {
            // The claim moved between the node that forwarded here and this one.
            return Err(ApiError::classified(
                ErrorClass::retry(Cause::OwnerUnavailable),
                format!("stream {:?} is moving between nodes", request.name),
            ));
        }
    }
    // A fork lives with its source (a hosted id's stream forks into that id's engine).
    let engine = match &request.fork {
        Some(fork) => state.db.stream_engine(&fork.source),
        None => state.db.stream_engine(&request.name),
    };
    let name = request.name.clone();
    let created = engine.create_as(request, incarnation).await;
    if created.is_err()
        && !engine.contains(&name)
        && let Err(e) = state.db.release_stream_name(&name).await
    {
        tracing::warn!(stream = %name, error = %e, "could not release the name of a stream that was not created");
    }
    drop(name_lock);
    let (created, info) = created?;
    let mut response = if created {
        StatusCode::CREATED.into_response()
    } else {
        StatusCode::OK.into_response()
    };
    let h = response.headers_mut();
    info_headers(h, &info);
    if created {
        // The host the request was sent to (checked at the edge: one `Host`, allowed where
        // names are checked). A forwarding node puts its client's host in its place as it
        // relays the answer; no header a client sends (`X-Forwarded-Host`, `Forwarded`)
        // names it.
        let host = header_str(headers, "host")?.unwrap_or("localhost");
        set(h, "location", format!("http://{host}{}", uri.path()));
    }
    Ok(response)
}

async fn append(
    state: &AppState,
    owner: Option<&super::Owner>,
    name: String,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    if let Some(removed) = REMOVED_APPEND_HEADERS
        .iter()
        .find(|h| headers.contains_key(**h))
    {
        return Err(ApiError::bad_request(format!(
            "header {removed} is not supported on an append (removed from the protocol)"
        )));
    }
    let (content_type, close, producer, stream_seq, incarnation) = (
        content_type(headers)?,
        closed_flag(headers)?,
        producer(headers)?,
        stream_seq(headers)?,
        incarnation(headers)?,
    );
    let (body, _reservation) = body_bytes(state, owner, body).await?;
    let request = AppendRequest {
        key: owner.cloned(),
        name,
        content_type,
        close,
        producer,
        stream_seq,
        incarnation,
        body,
    };
    let with_body = !request.body.is_empty();
    let outcome = state
        .db
        .stream_engine(&request.name)
        .append(request)
        .await?;
    let mut response = StatusCode::NO_CONTENT.into_response();
    let h = response.headers_mut();
    match outcome {
        AppendOutcome::Appended {
            next,
            closed,
            producer,
            incarnation,
            ..
        } => {
            set(h, NEXT_OFFSET, format_offset(next));
            set(h, INCARNATION, incarnation);
            if closed {
                set(h, CLOSED, "true");
            }
            if let Some(p) = producer {
                set(h, PRODUCER_EPOCH, p.epoch.to_string());
                set(h, PRODUCER_SEQ, p.seq.to_string());
                if with_body {
                    *response.status_mut() = StatusCode::OK;
                }
            }
        }
        AppendOutcome::Duplicate {
            next,
            closed,
            epoch,
            last_seq,
            incarnation,
        } => {
            if let Some(next) = next {
                set(h, NEXT_OFFSET, format_offset(next));
                set(h, INCARNATION, incarnation);
            }
            if closed {
                set(h, CLOSED, "true");
            }
            set(h, PRODUCER_EPOCH, epoch.to_string());
            set(h, PRODUCER_SEQ, last_seq.to_string());
        }
    }
    Ok(response)
}

async fn head(state: &AppState, name: String) -> Result<Response, ApiError> {
    let stream = state.db.stream_engine(&name).get(&name).await?;
    let info = stream.info();
    let mut response = StatusCode::OK.into_response();
    let h = response.headers_mut();
    info_headers(h, &info);
    set(h, "cache-control", "no-store");
    set(
        h,
        "etag",
        etag(&info.incarnation, "-1", info.tail, info.closed),
    );
    Ok(response)
}

async fn delete(state: &AppState, name: String, headers: &HeaderMap) -> Result<Response, ApiError> {
    let token = incarnation(headers)?;
    let db = state.db.clone();
    // One task: a client that goes away does not stop the delete between its steps.
    tokio::spawn(async move { delete_now(&db, &name, token.as_deref()).await })
        .await
        .map_err(|e| ApiError::internal(format!("the delete failed: {e}")))??;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Deletes stream `name` served here. Under object-store durability its claim first stops
/// naming its incarnation (`db::names`), so from the moment it can be gone no other node
/// reads its sealed data from a snapshot taken before; then it is deleted, then its name is
/// released. Any step cut short leaves it safe: a claim without an incarnation only sends
/// reads to the owner, and a retried delete that finds the stream gone still releases it.
async fn delete_now(
    db: &crate::db::Database,
    name: &str,
    token: Option<&str>,
) -> Result<(), ApiError> {
    let _name_lock = db.lock_stream_name(name).await;
    let engine = db.stream_engine(name);
    // The precondition is checked before the claim changes (appends never change the
    // incarnation, and deletes and creates of the name wait for the lock held here).
    let current = engine.get(name).await.ok().map(|s| s.info().incarnation);
    if let Some(current) = &current {
        if let Some(token) = token
            && token != current
        {
            return Err(StreamError::IncarnationMismatch {
                current: current.clone(),
            }
            .into());
        }
        db.name_stream_incarnation(name, None)
            .await
            .map_err(|e| ApiError::of(&e))?;
    }
    let deleted = engine.delete(name, token).await;
    // A delete that surely applied nothing names the stream's incarnation again (one that
    // may yet be applied, from a log record whose write is in doubt, must not).
    if let Err(e) = &deleted
        && e.class().applied == Applied::Rejected
        && let Some(current) = &current
        && engine.get(name).await.is_ok()
        && let Err(e) = db.name_stream_incarnation(name, Some(current)).await
    {
        // Safe as it is: other nodes send the stream's reads to this one.
        tracing::warn!(stream = %name, error = %e, "could not name a stream's incarnation again after its delete failed");
    }
    if matches!(deleted, Ok(()) | Err(StreamError::NotFound))
        && let Err(e) = db.release_stream_name(name).await
    {
        // The name stays this node's: a later create of it is made here.
        tracing::warn!(stream = %name, error = %e, "could not release a deleted stream's name");
    }
    Ok(deleted?)
}

fn etag(incarnation: &str, start: &str, next: u64, closed: bool) -> String {
    let closed = if closed { ":c" } else { "" };
    format!("\"{incarnation}:{start}:{}{closed}\"", format_offset(next))
}

/// Where a read starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadFrom {
    Start,
    Now,
    At(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Live {
    No,
    LongPoll,
    Sse,
}

struct ReadQuery {
    from: Option<(ReadFrom, String)>,
    live: Live,
    cursor: Option<String>,
    max_bytes: usize,
}

fn read_query(query: Option<&str>) -> Result<ReadQuery, ApiError> {
    let mut offsets = Vec::new();
    let mut live = Live::No;
    let mut cursor = None;
    let mut max_bytes = DEFAULT_READ_BYTES;
    for (key, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match key.as_ref() {
            "offset" => offsets.push(value.into_owned()),
            "live" => {
                live = match value.as_ref() {
                    "long-poll" => Live::LongPoll,
                    "sse" => Live::Sse,
                    "" | "false" => Live::No,
                    other => {
                        return Err(ApiError::bad_request(format!(
                            "live must be long-poll or sse, not {other:?}"
                        )));
                    }
                }
            }
            "cursor" => cursor = Some(value.into_owned()),
            "max_bytes" => {
                max_bytes = plain_decimal(&value)
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|n| *n > 0)
                    .ok_or_else(|| ApiError::bad_request("max_bytes must be a positive integer"))?
                    .min(DEFAULT_READ_BYTES);
            }
            _ => {}
        }
    }
    if offsets.len() > 1 {
        return Err(ApiError::bad_request("offset may be given only once"));
    }
    let from = match offsets.pop() {
        None => None,
        Some(text) => {
            let from =
                match text.as_str() {
                    "-1" => ReadFrom::Start,
                    "now" => ReadFrom::Now,
                    other => ReadFrom::At(parse_offset(other).ok_or_else(|| {
                        ApiError::bad_request(format!("malformed offset {other:?}"))
                    })?),
                };
            Some((from, text))
        }
    };
    if live != Live::No && from.is_none() {
        return Err(ApiError::bad_request(
            "live reads need an offset (-1, now, or a Stream-Next-Offset)",
        ));
    }
    Ok(ReadQuery {
        from,
        live,
        cursor,
        max_bytes,
    })
}

/// The body of a read: JSON streams answer a JSON array of their messages (or NDJSON when
/// asked), other streams their bytes.
fn render(result: &ReadResult, ndjson: bool) -> Vec<u8> {
    let size: usize = result.records.iter().map(|r| r.len()).sum();
    if !crate::stream::is_json_content_type(&result.content_type) || ndjson {
        let mut out = Vec::with_capacity(size);
        for r in &result.records {
            out.extend_from_slice(r);
        }
        return out;
    }
    json_array(&result.records, size)
}

fn json_array(records: &[Bytes], size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(size + 2);
    out.push(b'[');
    let mut first = true;
    for record in records {
        for message in record.split(|b| *b == b'\n').filter(|m| !m.is_empty()) {
            if !first {
                out.push(b',');
            }
            first = false;
            out.extend_from_slice(message);
        }
    }
    out.push(b']');
    out
}

fn wants_ndjson(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/x-ndjson"))
}

async fn read(
    state: &AppState,
    name: String,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<Response, ApiError> {
    let q = read_query(query)?;
    let streams = state.db.stream_engine(&name);
    let stream = streams.get(&name).await?;
    stream.touch();
    match q.live {
        Live::Sse => return Ok(sse(state, stream, &q)),
        Live::LongPoll => return long_poll(state, stream, &q, headers).await,
        Live::No => {}
    }
    let ndjson = wants_ndjson(headers);
    let (from, start_text) = q.from.clone().unwrap_or((ReadFrom::Start, "-1".to_owned()));
    if from == ReadFrom::Now {
        let info = stream.info();
        let mut response = if crate::stream::is_json_content_type(&info.content_type) && !ndjson {
            (StatusCode::OK, "[]").into_response()
        } else {
            StatusCode::OK.into_response()
        };
        let h = response.headers_mut();
        data_headers(h, &info.content_type, ndjson);
        set(h, NEXT_OFFSET, format_offset(info.tail));
        set(h, INCARNATION, &info.incarnation);
        set(h, UP_TO_DATE, "true");
        set(h, "cache-control", "no-store");
        if info.closed {
            set(h, CLOSED, "true");
        }
        return Ok(response);
    }
    let offset = match from {
        ReadFrom::At(o) => o,
        _ => 0,
    };
    let (share, granted) = read_share(state, q.max_bytes).await?;
    let result = streams.read(&stream, offset, granted).await?;
    read_answer(state, share, &result, &start_text, headers, ndjson).await
}

/// A catch-up read of a stream another node owns, answered here from the sealed data in
/// that node's newest snapshot on object storage ([`crate::db::Database::read_sealed`]):
/// `None` when this process serves the stream, the read is live or from `now`, or the
/// snapshot does not reach the offset (the owner answers then: it alone knows the tail of
/// a stream that is not closed).
async fn sealed_read(
    state: &AppState,
    name: &str,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<Option<Response>, ApiError> {
    if headers.contains_key(forward::FORWARDED) || state.db.serves_stream(name) {
        return Ok(None);
    }
    let q = read_query(query)?;
    if q.live != Live::No {
        return Ok(None);
    }
    let (from, start_text) = q.from.unwrap_or((ReadFrom::Start, "-1".to_owned()));
    let offset = match from {
        ReadFrom::Start => 0,
        ReadFrom::At(offset) => offset,
        ReadFrom::Now => return Ok(None),
    };
    // The share is taken once there is something to answer: most such reads find nothing
    // to read here (this node does not serve the stream, or is not in a cluster) and go on.
    let Some(result) = state.db.read_sealed(name, offset, q.max_bytes).await else {
        return Ok(None);
    };
    let share = state
        .read_budget
        .hold_within(rendered_len(&result), READ_WAIT)
        .await
        .ok_or_else(answer_memory)?;
    read_answer(
        state,
        share,
        &result,
        &start_text,
        headers,
        wants_ndjson(headers),
    )
    .await
    .map(Some)
}

/// The answer to a catch-up read: its data, or `304` when the client holds this answer.
async fn read_answer(
    state: &AppState,
    share: Share,
    result: &ReadResult,
    start_text: &str,
    headers: &HeaderMap,
    ndjson: bool,
) -> Result<Response, ApiError> {
    let tag = etag(
        &result.incarnation,
        start_text,
        result.next,
        result.closed_at_tail,
    );
    if headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == tag)
    {
        let mut response = StatusCode::NOT_MODIFIED.into_response();
        set(response.headers_mut(), "etag", tag);
        return Ok(response);
    }
    let body = held_answer(state, share, rendered_len(result), || {
        render(result, ndjson)
    })
    .await?;
    let mut response = (StatusCode::OK, body).into_response();
    let h = response.headers_mut();
    result_headers(h, result, ndjson);
    set(h, "etag", tag);
    Ok(response)
}

fn data_headers(h: &mut HeaderMap, content_type: &str, ndjson: bool) {
    if ndjson && crate::stream::is_json_content_type(content_type) {
        set(h, "content-type", "application/x-ndjson");
    } else {
        set(h, "content-type", content_type);
    }
}

fn result_headers(h: &mut HeaderMap, result: &ReadResult, ndjson: bool) {
    data_headers(h, &result.content_type, ndjson);
    set(h, NEXT_OFFSET, format_offset(result.next));
    set(h, INCARNATION, &result.incarnation);
    if result.up_to_date {
        set(h, UP_TO_DATE, "true");
    }
    if result.closed_at_tail {
        set(h, CLOSED, "true");
    }
}

/// The cursor a live answer carries, so caches collapse requests into 20-second intervals;
/// a client that already holds the current interval gets a later one (with jitter), so its
/// next request is not a cache hit of this one.
fn response_cursor(client: Option<&str>) -> String {
    const EPOCH_MS: i64 = 1_728_432_000_000; // 2024-10-09T00:00:00Z
    const INTERVAL_MS: i64 = 20_000;
    let current = (crate::stream::now_ms() - EPOCH_MS).max(0) / INTERVAL_MS;
    match client.and_then(|c| c.parse::<i64>().ok()) {
        Some(c) if c >= current => {
            let random = (uuid::Uuid::new_v4().as_u128() % 3600) as i64 + 1;
            let jitter = (random * 1000).div_euclid(INTERVAL_MS).max(1);
            (c + jitter).to_string()
        }
        _ => current.to_string(),
    }
}

fn start_offset(stream: &Stream, from: ReadFrom) -> u64 {
    match from {
        ReadFrom::Start => 0,
        ReadFrom::Now => stream.info().tail,
        ReadFrom::At(o) => o,
    }
}

async fn long_poll(
    state: &AppState,
    stream: Arc<Stream>,
    q: &ReadQuery,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let streams = state.db.stream_engine(stream.name());
    let _live = state.metrics.live_reader();
    let ndjson = wants_ndjson(headers);
    let (from, _) = q.from.clone().unwrap_or((ReadFrom::Start, "-1".to_owned()));
    let offset = start_offset(&stream, from);
    let deadline = tokio::time::Instant::now() + state.long_poll_timeout;
    let mut changes = stream.subscribe();
    let mut closing = streams.closing();
    let cursor = response_cursor(q.cursor.as_deref());
    loop {
        changes.borrow_and_update();
        let (share, granted) = read_share(state, q.max_bytes).await?;
        let result = streams.read(&stream, offset, granted).await?;
        if !result.records.is_empty() {
            let need = rendered_len(&result);
            let body = held_answer(state, share, need, || render(&result, ndjson)).await?;
            let mut response = (StatusCode::OK, body).into_response();
            let h = response.headers_mut();
            result_headers(h, &result, ndjson);
            set(h, CURSOR, &cursor);
            return Ok(response);
        }
        // Nothing to send: no share is held while waiting.
        drop(share);
        let timed_out = if result.closed_at_tail {
            false
        } else {
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return Err(StreamError::NotFound.into());
                    }
                    // Deleted while waiting?
                    streams.get(stream.name()).await?;
                    stream.touch();
                    continue;
                }
                _ = tokio::time::sleep_until(deadline) => true,
                _ = shutting_down(&mut closing) => true,
            }
        };
        let mut response = StatusCode::NO_CONTENT.into_response();
        let h = response.headers_mut();
        set(h, NEXT_OFFSET, format_offset(result.next));
        set(h, INCARNATION, &result.incarnation);
        set(h, UP_TO_DATE, "true");
        set(h, CURSOR, &cursor);
        if result.closed_at_tail || (timed_out && stream.info().closed) {
            set(h, CLOSED, "true");
        }
        return Ok(response);
    }
}

/// How SSE data events carry the stream's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SseEncoding {
    Json,
    Text,
    Base64,
}

fn sse_encoding(content_type: &str) -> SseEncoding {
    if crate::stream::is_json_content_type(content_type) {
        SseEncoding::Json
    } else if content_type.starts_with("text/") {
        SseEncoding::Text
    } else {
        SseEncoding::Base64
    }
}

/// Writes one SSE event; every line of the payload gets its own `data:` field, so no byte of
/// the payload can end the event or start another (CR, LF and CRLF all split lines).
fn sse_event(out: &mut Vec<u8>, event: &str, payload: &str) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(event.as_bytes());
    out.push(b'\n');
    let mut rest = payload;
    loop {
        let cut = rest.find(['\r', '\n']);
        let (line, next) = match cut {
            Some(i) => {
                let skip = if rest[i..].starts_with("\r\n") { 2 } else { 1 };
                (&rest[..i], Some(&rest[i + skip..]))
            }
            None => (rest, None),
        };
        out.extend_from_slice(b"data:");
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
        match next {
            Some(n) => rest = n,
            None => break,
        }
    }
    out.push(b'\n');
}

fn sse_data(out: &mut Vec<u8>, encoding: SseEncoding, records: &[Bytes]) {
    let size: usize = records.iter().map(|r| r.len()).sum();
    let payload = match encoding {
        SseEncoding::Json => String::from_utf8_lossy(&json_array(records, size)).into_owned(),
        SseEncoding::Text => {
            let joined: Vec<u8> = records.iter().flat_map(|r| r.iter().copied()).collect();
            String::from_utf8_lossy(&joined).into_owned()
        }
        SseEncoding::Base64 => {
            let joined: Vec<u8> = records.iter().flat_map(|r| r.iter().copied()).collect();
            base64::engine::general_purpose::STANDARD.encode(joined)
        }
    };
    sse_event(out, "data", &payload);
}

enum Wake {
    Changed,
    KeepAlive,
    End,
}

/// Resolves once the server starts shutting down.
async fn shutting_down(closing: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = closing.wait_for(|c| *c).await;
}

struct SseState {
    /// The read budget each event takes its share of.
    state: AppState,
    streams: Streams,
    stream: Arc<Stream>,
    changes: tokio::sync::watch::Receiver<u64>,
    closing: tokio::sync::watch::Receiver<bool>,
    offset: u64,
    encoding: SseEncoding,
    client_cursor: Option<String>,
    keep_alive: Duration,
    first: bool,
    done: bool,
    /// Counts this reader as live until the event stream is dropped.
    _live: crate::metrics::LiveReader,
}

impl SseState {
    fn control(&self, out: &mut Vec<u8>, next: u64, up_to_date: bool, closed: bool) {
        let body = if closed {
            json!({"streamNextOffset": format_offset(next), "streamClosed": true})
        } else if up_to_date {
            json!({
                "streamNextOffset": format_offset(next),
                "streamCursor": response_cursor(self.client_cursor.as_deref()),
                "upToDate": true,
            })
        } else {
            json!({
                "streamNextOffset": format_offset(next),
                "streamCursor": response_cursor(self.client_cursor.as_deref()),
            })
        };
        sse_event(out, "control", &body.to_string());
    }

    /// The next piece of the event stream, or `None` when it ends.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        loop {
            self.changes.borrow_and_update();
            // An event's data is at most its share's half: base64 and the event's lines
            // take up to about a half more. No share in time ends the events (the client
            // reconnects from the last offset it got).
            let (share, granted) = read_share(&self.state, 2 * SSE_EVENT_BYTES).await.ok()?;
            let result = match self
                .streams
                .read(&self.stream, self.offset, (granted / 2).max(1))
                .await
            {
                Ok(r) => r,
                Err(_) => return None,
            };
            let closed = result.closed_at_tail;
            self.offset = result.next;
            if closed || !result.records.is_empty() || self.first {
                self.first = false;
                self.done = closed;
                let need = sse_len(self.encoding, &result.records);
                let event = || {
                    let mut out = Vec::new();
                    if !result.records.is_empty() {
                        sse_data(&mut out, self.encoding, &result.records);
                    }
                    self.control(&mut out, result.next, closed || result.up_to_date, closed);
                    out
                };
                return held_answer(&self.state, share, need, event).await.ok();
            }
            // Nothing to send: the share is not held while waiting.
            drop(share);
            let wake = tokio::select! {
                changed = self.changes.changed() => {
                    if changed.is_err() { Wake::End } else { Wake::Changed }
                }
                _ = tokio::time::sleep(self.keep_alive) => Wake::KeepAlive,
                _ = shutting_down(&mut self.closing) => Wake::End,
            };
            match wake {
                Wake::Changed if !self.stream.info_gone() => self.stream.touch(),
                Wake::Changed | Wake::End => return None,
                Wake::KeepAlive => {
                    let mut out = Vec::new();
                    self.control(&mut out, self.offset, true, false);
                    return Some(Bytes::from(out));
                }
            }
        }
    }
}

fn sse(state: &AppState, stream: Arc<Stream>, q: &ReadQuery) -> Response {
    let streams = state.db.stream_engine(stream.name());
    let (from, _) = q.from.clone().unwrap_or((ReadFrom::Start, "-1".to_owned()));
    let info = stream.info();
    let encoding = sse_encoding(&info.content_type);
    let sse_state = SseState {
        state: state.clone(),
        changes: stream.subscribe(),
        closing: streams.closing(),
        offset: start_offset(&stream, from),
        streams,
        stream,
        encoding,
        client_cursor: q.cursor.clone(),
        keep_alive: state.long_poll_timeout,
        first: true,
        done: false,
        _live: state.metrics.live_reader(),
    };
    let events = futures::stream::unfold(sse_state, |mut s| async move {
        let chunk = s.next_chunk().await?;
        Some((Ok::<_, std::convert::Infallible>(chunk), s))
    });
    let mut response = Response::new(Body::from_stream(events));
    let h = response.headers_mut();
    set(h, "content-type", "text/event-stream");
    set(h, "cache-control", "no-cache");
    set(h, INCARNATION, &info.incarnation);
    if encoding == SseEncoding::Base64 {
        set(h, "stream-sse-data-encoding", "base64");
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_payload_lines_cannot_forge_events() {
        let mut out = Vec::new();
        sse_event(&mut out, "data", "a\r\n\r\nevent: control\rdata: x\nb");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "event: data\ndata:a\ndata:\ndata:event: control\ndata:data: x\ndata:b\n\n"
        );
    }

    #[test]
    fn offsets_sort_as_strings() {
        let a = format_offset(9);
        let b = format_offset(10);
        assert!(a < b);
        assert_eq!(parse_offset(&b), Some(10));
        for bad in ["", "1", "_1", "1_", "0_1a", "1_5", "0,1", "-1"] {
            assert_eq!(parse_offset(bad), None, "{bad}");
        }
    }

    #[test]
    fn content_types_normalize() {
        assert_eq!(
            normalize_content_type(" Application/JSON ;; Charset=UTF-8 "),
            "application/json; charset=utf-8"
        );
    }

    #[test]
    fn names_in_both_layouts() {
        assert_eq!(source_name("/v1/stream/a/b").unwrap(), "a/b");
        assert_eq!(source_name("/demo/hello").unwrap(), "demo/hello");
        assert_eq!(source_name("http://127.0.0.1:1/v1/stream/x").unwrap(), "x");
        assert!(protocol_name("a/../b").is_err());
        assert!(bucket_name("ab", "s").is_err());
        assert!(bucket_name("__ds", "subscriptions").is_err());
        assert_eq!(bucket_name("__ds0", "s").unwrap(), "__ds0/s");
        assert!(bucket_name("demo", "$x").is_err());
    }

    #[test]
    fn plain_decimals() {
        assert_eq!(plain_decimal("0"), Some(0));
        assert_eq!(plain_decimal("60"), Some(60));
        for bad in ["", "00060", "+60", "60.5", "1e3", "-1", " 1"] {
            assert_eq!(plain_decimal(bad), None, "{bad}");
        }
    }
}

/// Query parameters of `GET /v1/streams`.
#[derive(Debug, Default, serde::Deserialize)]
pub(super) struct ListParams {
    #[serde(default)]
    prefix: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    after: Option<String>,
}

/// Most streams one listing answers.
const MAX_LIST: usize = 10_000;

/// Most idempotent producers one listing answers (the first stream's are listed whatever
/// their count): a listing's size is bounded whatever the streams hold.
const MAX_LISTED_PRODUCERS: usize = 10_000;

/// `GET /v1/streams`: the live streams in name order, with their metadata and producers.
///
/// Under object-store durability the listing is the cluster's: the streams this process
/// serves and those every live peer serves (asked with the same query; `incomplete` says
/// some peer did not answer).
pub(super) async fn list(
    State(state): State<AppState>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
    params: Result<axum::extract::Query<ListParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let axum::extract::Query(params) =
        params.map_err(|e| ApiError::bad_request(format!("bad query: {}", e.body_text())))?;
    let limit = params.limit.unwrap_or(1000);
    if limit == 0 || limit > MAX_LIST {
        return Err(ApiError::bad_request(format!(
            "limit must be 1 to {MAX_LIST}"
        )));
    }
    let request = crate::stream::ListRequest {
        prefix: params.prefix.unwrap_or_default(),
        after: params.after,
        limit,
        max_producers: MAX_LISTED_PRODUCERS,
    };
    let (streams, mut truncated) = state.db.list_streams(request).await?;
    let mut streams: Vec<serde_json::Value> = streams
        .into_iter()
        .map(|s| {
            json!({
                "name": s.name,
                "content_type": s.info.content_type,
                "next_offset": format_offset(s.info.tail),
                "bytes": s.info.tail,
                "closed": s.info.closed,
                "ttl_seconds": s.info.lifetime.ttl_secs,
                "expires_at": s.info.lifetime.expires_at,
                "forked_from": s.forked_from,
                "producers": s.producers.iter().map(|p| json!({
                    "id": p.id, "epoch": p.epoch, "last_seq": p.last_seq,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let mut incomplete = false;
    if !headers.contains_key(forward::FORWARDED) {
        let peers = forward::list_on_peers(&state, query.as_deref().unwrap_or(""), &headers).await;
        let mut listings = vec![(std::mem::take(&mut streams), truncated)];
        for listing in peers {
            match listing {
                Some(listed) => listings.push(listed),
                None => incomplete = true,
            }
        }
        (streams, truncated) = crate::stream::merge_listings(
            listings,
            limit,
            MAX_LISTED_PRODUCERS,
            |s| s["name"].as_str().unwrap_or_default(),
            |s| s["producers"].as_array().map_or(0, Vec::len),
        );
    }
    let mut answer = json!({"streams": streams, "truncated": truncated});
    if incomplete {
        answer["incomplete"] = json!(true);
    }
    Ok(axum::Json(answer).into_response())
}
