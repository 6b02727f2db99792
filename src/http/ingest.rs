//! `POST .../tables/{table}/ingest` (NDJSON rows) and `POST /v1/ingest` (the `scopeql load`
//! form).

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::Outcome;
use super::{ApiError, AppState};
use crate::catalog::{DEFAULT_DATABASE, DEFAULT_SCHEMA};
use crate::ingest::ContentEncoding;

/// Content types accepted for NDJSON bodies (parameters such as `charset` are ignored).
const NDJSON_TYPES: &[&str] = &[
    "application/x-ndjson",
    "application/ndjson",
    "application/jsonl",
    "application/x-jsonlines",
    "application/jsonlines",
    "application/json",
    "text/plain",
];

/// Reads a request body of at most `limit` bytes, answering 413 past it.
///
/// Past the limit the rest of the body, up to [`MAX_DRAIN_BYTES`] more (and at most its limit's
/// worth), is read and dropped before the 413 goes out. A client sends its whole body before
/// it reads the answer; had the server answered and closed mid-body, the client's next write
/// failed (a broken pipe) and it never saw the 413. The body's deadline bounds the draining
/// as it bounds the reading. A body whose declared length is past what would be drained is
/// refused at once, unread.
///
/// Frames are copied into one buffer as they come: kept as they came, a body sent in
/// one-byte chunks held a 32-byte handle (and a share of a read buffer) for every byte.
///
/// The buffer is reserved up front as [`body_reservation`] says.
pub(super) async fn read_body(
    body: Body,
    limit: usize,
    budgeted: usize,
) -> Result<bytes::Bytes, ApiError> {
    let drain = MAX_DRAIN_BYTES.min(limit);
    let declared = usize::try_from(http_body::Body::size_hint(&body).lower()).unwrap_or(usize::MAX);
    if declared > limit.saturating_add(drain) {
        return Err(body_too_large(limit));
    }
    let mut frames = body.into_data_stream();
    let mut read = bytes::BytesMut::with_capacity(body_reservation(declared, limit, budgeted));
    while let Some(frame) = frames.next().await {
        let frame = frame.map_err(|e| body_error(&e))?;
        if read.len().saturating_add(frame.len()) > limit {
            drop(read);
            let mut dropped = frame.len();
            while dropped < drain {
                match frames.next().await {
                    Some(Ok(more)) => dropped = dropped.saturating_add(more.len()),
                    _ => break,
                }
            }
            return Err(body_too_large(limit));
        }
        read.extend_from_slice(&frame);
    }
    Ok(read.freeze())
}

/// What a body buffer is reserved for before any byte arrives: the declared length, up to
/// 1 MiB or up to `budgeted` bytes, whichever is more, where `budgeted` is what ingest
/// admission granted the body of its budget
/// ([`IngestAdmission::granted_bytes`](crate::db::IngestAdmission::granted_bytes)). Past that
/// the buffer grows as bytes come, so a client that declares much and sends little holds
/// little beyond what was budgeted. A body declared past its limit gets its 413 once drained:
/// nothing is reserved. (Grown by doubling from 1 MiB, a 16 MiB body was copied 15 MiB over,
/// and held 24 MiB at its last growth.)
fn body_reservation(declared: usize, limit: usize, budgeted: usize) -> usize {
    if declared > limit {
        0
    } else {
        declared.min(budgeted.max(1 << 20))
    }
}

/// At most this many bytes past its limit are read of a body refused as too large: enough
/// for a client to finish a body somewhat over the limit and read the 413, not a way to make
/// the server read without end.
const MAX_DRAIN_BYTES: usize = 64 << 20;

/// The 413 of a body past `limit` bytes.
fn body_too_large(limit: usize) -> ApiError {
    ApiError::payload_too_large(format!("request body is larger than {limit} bytes"))
        .outcome(Outcome::Rejected)
}

/// The answer to a body that could not be read: 408 past its deadline, else 400.
fn body_error(e: &axum::Error) -> ApiError {
    // The cause can sit several wrappers deep (axum's error, the body's).
    let mut chain = std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |s| {
        s.source()
    });
    match chain.find_map(|cause| cause.downcast_ref::<super::deadline::BodyDeadline>()) {
        Some(deadline) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            deadline.to_string(),
        )
        .outcome(Outcome::Rejected),
        None => ApiError::bad_request(format!("could not read the request body: {e}"))
            .outcome(Outcome::Rejected),
    }
}

/// What a body will take once read and decompressed, for ingest admission: its length when
/// plain and known, else the limit.
fn admission_size(headers: &HeaderMap, encoding: ContentEncoding, limit: usize) -> usize {
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    match (encoding, length) {
        (ContentEncoding::Identity, Some(n)) => n.min(limit),
        _ => limit,
    }
}

pub(super) fn encoding(headers: &HeaderMap) -> Result<ContentEncoding, ApiError> {
    let value = headers
        .get(header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?"));
    ContentEncoding::from_header(value).map_err(|e| {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            e.to_string(),
        )
        .outcome(Outcome::Rejected)
    })
}

pub(super) async fn ingest_table(
    State(state): State<AppState>,
    Path((db, schema, table)): Path<(String, String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let essence = ct
            .to_str()
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if !NDJSON_TYPES.contains(&essence.as_str()) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("content type {essence:?} is not NDJSON; send application/x-ndjson"),
            )
            .outcome(Outcome::Rejected));
        }
    }
    let encoding = encoding(&headers)?;
    let limit = state.db.limits().max_body_bytes;
    let admitted = state
        .db
        .admit_ingest(admission_size(&headers, encoding, limit))
        .await;
    let body = read_body(body, limit, admitted.granted_bytes()).await?;
    let rows = state
        .db
        .ingest(&db, &schema, &table, body, encoding)
        .await?;
    Ok(Json(
        json!({"status": "committed", "num_rows_inserted": rows}),
    ))
}

/// The body `scopeql load` sends.
#[derive(Debug, Deserialize)]
pub(super) struct LegacyIngest {
    data: LegacyData,
    statement: String,
}

#[derive(Debug, Deserialize)]
struct LegacyData {
    #[serde(default)]
    format: Option<String>,
    rows: String,
}

/// Reads the target of `INSERT INTO name`.
fn insert_target(statement: &str) -> Option<(String, String, String)> {
    let mut words = statement.split_whitespace();
    let (insert, into, name) = (words.next()?, words.next()?, words.next()?);
    if !insert.eq_ignore_ascii_case("INSERT")
        || !into.eq_ignore_ascii_case("INTO")
        || words.next().is_some()
    {
        return None;
    }
    let parts: Vec<String> = name
        .trim_end_matches(';')
        .split('.')
        .map(|p| p.trim_matches('`').trim_matches('"').to_owned())
        .collect();
    match parts.as_slice() {
        [t] => Some((DEFAULT_DATABASE.into(), DEFAULT_SCHEMA.into(), t.clone())),
        [s, t] => Some((DEFAULT_DATABASE.into(), s.clone(), t.clone())),
        [d, s, t] => Some((d.clone(), s.clone(), t.clone())),
        _ => None,
    }
}

pub(super) async fn ingest_statement(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    if !super::is_json_request(&headers) {
        return Err(super::not_json());
    }
    let encoding = encoding(&headers)?;
    // The rows are inside a JSON string: allow for escaping overhead on top of the limit.
    let limit = state.db.limits().max_body_bytes;
    let admitted = state
        .db
        .admit_ingest(admission_size(&headers, encoding, limit.saturating_mul(2)))
        .await;
    let raw = read_body(body, limit.saturating_mul(2), admitted.granted_bytes()).await?;
    let plain = crate::ingest::decompress(&raw, encoding, limit.saturating_mul(2))
        .map_err(|e| ApiError::from(crate::db::IngestFailure::Input(e)))?;
    let request: LegacyIngest = serde_json::from_slice(&plain).map_err(|e| {
        ApiError::bad_request(format!("expected {{\"data\":{{\"format\":\"json\",\"rows\":\"...\"}},\"statement\":\"INSERT INTO t\"}}: {e}"))
            .outcome(Outcome::Rejected)
    })?;
    if let Some(format) = &request.data.format
        && !format.eq_ignore_ascii_case("json")
    {
        return Err(ApiError::bad_request(format!(
            "data format {format:?} is not supported; use json"
        ))
        .outcome(Outcome::Rejected));
    }
    let (db, schema, table) = insert_target(&request.statement).ok_or_else(|| {
        ApiError::bad_request("statement must be INSERT INTO <table>").outcome(Outcome::Rejected)
    })?;
    let rows = state
        .db
        .ingest(
            &db,
            &schema,
            &table,
            request.data.rows.into_bytes().into(),
            ContentEncoding::Identity,
        )
        .await?;
    Ok(Json(json!({"num_rows_inserted": rows})))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reservation follows the declared length within what admission granted, never
    /// less than a megabyte of it, and nothing for a body that will be refused.
    #[test]
    fn a_body_reserves_what_it_declares_within_what_was_granted() {
        const MIB: usize = 1 << 20;
        let limit = 16 * MIB;
        // Granted its whole declared length: all of it, at once.
        assert_eq!(body_reservation(16 * MIB, limit, 16 * MIB), 16 * MIB);
        assert_eq!(body_reservation(5 * MIB, limit, 5 * MIB), 5 * MIB);
        // Nothing granted (bodies outside ingest admission): the old megabyte at most.
        assert_eq!(body_reservation(16 * MIB, limit, 0), MIB);
        assert_eq!(body_reservation(1000, limit, 0), 1000);
        // Granted less than it declares (a budget smaller than the body): what was granted.
        assert_eq!(body_reservation(16 * MIB, limit, 4 * MIB), 4 * MIB);
        // A chunked body declares nothing: nothing is reserved.
        assert_eq!(body_reservation(0, limit, 16 * MIB), 0);
        // Declared past the limit: it will be refused, nothing is reserved.
        assert_eq!(body_reservation(limit + 1, limit, 16 * MIB), 0);
        assert_eq!(body_reservation(usize::MAX, limit, usize::MAX), 0);
    }

    /// A body in many frames (one byte each) comes back whole and in order; one byte past
    /// the limit, or a declared length past what would be drained, is a 413.
    #[tokio::test]
    async fn bodies_are_read_whole_or_refused_past_the_limit() {
        let bytes: Vec<u8> = (0..=255u8).collect();
        let frames = futures::stream::iter(
            bytes
                .iter()
                .map(|b| Ok::<_, std::io::Error>(bytes::Bytes::copy_from_slice(&[*b])))
                .collect::<Vec<_>>(),
        );
        let read = read_body(Body::from_stream(frames), 256, 0)
            .await
            .expect("read");
        assert_eq!(read.as_ref(), bytes.as_slice());

        let over = read_body(Body::from(vec![1u8; 257]), 256, 0).await;
        assert_eq!(
            over.err().map(|e| e.status),
            Some(StatusCode::PAYLOAD_TOO_LARGE)
        );
        let far_over = read_body(Body::from(vec![1u8; 513]), 256, 0).await;
        assert_eq!(
            far_over.err().map(|e| e.status),
            Some(StatusCode::PAYLOAD_TOO_LARGE)
        );
        let empty = read_body(Body::empty(), 256, 0).await.expect("read");
        assert!(empty.is_empty());
    }
}
