//! `POST .../tables/{table}/ingest` (NDJSON rows) and `POST /v1/ingest` (the `scopeql load`
//! form).

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use serde::Deserialize;
use serde_json::{Value, json};

use super::body::{decode_body, read_body};
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
    axum::Extension(principal): axum::Extension<super::Principal>,
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
    // Held until the rows are committed: the body, its decoded form and the batch made of it.
    let mut reservation = state
        .db
        .body_reservation(super::body_owner(&state, &principal));
    let raw = read_body(body, limit, &mut reservation).await?;
    let body = decode_body(raw, encoding, limit, &mut reservation).await?;
    let rows = state
        .db
        .ingest(&db, &schema, &table, body, ContentEncoding::Identity)
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
    axum::Extension(principal): axum::Extension<super::Principal>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    if !super::is_json_request(&headers) {
        return Err(super::not_json());
    }
    let encoding = encoding(&headers)?;
    // The rows are inside a JSON string: allow for escaping overhead on top of the limit.
    let limit = state.db.limits().max_body_bytes;
    let mut reservation = state
        .db
        .body_reservation(super::body_owner(&state, &principal));
    let raw = read_body(body, limit.saturating_mul(2), &mut reservation).await?;
    let plain = decode_body(raw, encoding, limit.saturating_mul(2), &mut reservation).await?;
    // The rows string the parse makes is about as large as the JSON it comes from.
    reservation
        .grow_to(reservation.bytes().saturating_add(plain.len()))
        .await
        .map_err(|e| ApiError::of(&e))?;
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
