//! `POST /v1/statements`, `GET /v1/statements/{id}`, `POST /v1/statements/{id}/cancel`.

use std::time::{Duration, SystemTime};

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse as _, Response};
use serde::Deserialize;
use serde_json::json;

use super::error::Outcome;
use super::{ApiError, AppState};
use crate::query::statements::{Owner, Statement, StatementState, SubmitError};
use crate::query::{Access, QueryError};
use crate::types::cell::format_cell;
use crate::types::temporal::format_timestamp;

/// How long a submit waits for its statement before answering `running`.
const SUBMIT_WAIT: Duration = Duration::from_secs(5);

/// A statement submission; unknown fields are ignored.
#[derive(Debug, Deserialize)]
pub(super) struct Submit {
    statement: String,
    #[serde(default)]
    statement_id: Option<String>,
}

fn created_at(t: SystemTime) -> String {
    let nanos = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64 * 1_000_000);
    format_timestamp(nanos)
}

/// The status payload of a statement.
fn payload(statement: &Statement) -> Response {
    let state = statement.state();
    let elapsed = statement.elapsed_nanos();
    let rows = match &state {
        StatementState::Finished(r) => r.num_rows() as u64,
        _ => 0,
    };
    let done = !matches!(state, StatementState::Running);
    let progress = json!({
        "total_percentage": if done { 100.0 } else { 0.0 },
        "nanos_from_submitted": elapsed,
        "nanos_from_started": elapsed,
        "compute_seconds": elapsed as f64 / 1e9,
        "total_stages": 1,
        "total_partitions": 1,
        "total_rows": rows,
        "total_compressed_bytes": 0,
        "total_uncompressed_bytes": 0,
        "scanned_stages": if done { 1 } else { 0 },
        "scanned_partitions": if done { 1 } else { 0 },
        "scanned_rows": rows,
        "scanned_compressed_bytes": 0,
        "scanned_uncompressed_bytes": 0,
        "skipped_partitions": 0,
        "skipped_rows": 0,
        "skipped_compressed_bytes": 0,
        "skipped_uncompressed_bytes": 0,
    });
    let mut body = json!({
        "statement_id": statement.id,
        "created_at": created_at(statement.created_at),
        "progress": progress,
    });
    let mut result = None;
    match state {
        StatementState::Running => body["status"] = json!("running"),
        StatementState::Finished(output) => {
            body["status"] = json!("finished");
            result = Some(output);
        }
        StatementState::Failed(error) => {
            // The same code and details any other route gives this error.
            let error = ApiError::from(&*error);
            body["status"] = json!("failed");
            body["message"] = json!(error.message);
            body["error"] = error.body();
        }
        StatementState::Cancelled => {
            let error = ApiError::from(&QueryError::Cancelled);
            body["status"] = json!("cancelled");
            body["message"] = json!(error.message);
            body["error"] = error.body();
        }
    }
    let mut out = match serde_json::to_vec(&body) {
        Ok(v) => v,
        Err(e) => return ApiError::internal(e.to_string()).into_response(),
    };
    let Some(output) = result else {
        return ([(header::CONTENT_TYPE, "application/json")], out).into_response();
    };
    // The result set is the payload's last member, rendered piece by piece as the answer
    // goes out: a large result is never rendered whole in memory, once or per fetch, and a
    // reader that stops reading holds one piece (one row, if a row is larger).
    let metadata = json!({
        "fields": output
            .fields()
            .into_iter()
            .map(|f| json!({"name": f.name, "data_type": f.data_type}))
            .collect::<Vec<_>>(),
        "num_rows": output.num_rows(),
    });
    out.pop(); // the closing brace
    out.extend_from_slice(b",\"result_set\":{\"format\":\"json\",\"metadata\":");
    out.extend_from_slice(metadata.to_string().as_bytes());
    out.extend_from_slice(b",\"rows\":[");
    let head = futures::stream::once(async move { Ok(bytes::Bytes::from(out)) });
    const PIECE_BYTES: usize = 64 * 1024;
    let rows = futures::stream::unfold(
        (output, 0usize, 0usize, false),
        |(output, mut batch_at, mut row_at, mut any)| async move {
            let mut chunk = Vec::new();
            while chunk.len() < PIECE_BYTES {
                let Some(batch) = output.batches.get(batch_at) else {
                    break;
                };
                if row_at >= batch.num_rows() {
                    batch_at += 1;
                    row_at = 0;
                    continue;
                }
                if any {
                    chunk.push(b',');
                }
                any = true;
                let cells: Vec<Option<String>> = batch
                    .columns()
                    .iter()
                    .map(|c| format_cell(c, row_at))
                    .collect();
                if serde_json::to_writer(&mut chunk, &cells).is_err() {
                    chunk.extend_from_slice(b"null");
                }
                row_at += 1;
            }
            if chunk.is_empty() {
                return None;
            }
            Some((
                Ok::<_, std::convert::Infallible>(bytes::Bytes::from(chunk)),
                (output, batch_at, row_at, any),
            ))
        },
    );
    let tail = futures::stream::once(async { Ok(bytes::Bytes::from_static(b"]}}")) });
    use futures::StreamExt as _;
    let body = axum::body::Body::from_stream(head.chain(rows).chain(tail));
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The owner of the statements a request may see: the key it presented.
fn owner(principal: &super::Principal) -> Owner {
    principal.owner.clone()
}

pub(super) async fn submit(
    State(state): State<AppState>,
    axum::Extension(principal): axum::Extension<super::Principal>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let request: Submit = super::read_json(
        &state,
        super::body_owner(&state, &principal),
        &headers,
        body,
        "{\"statement\": \"...\"}",
    )
    .await?;
    if let Some(id) = &request.statement_id
        && (id.is_empty() || id.len() > 128)
    {
        return Err(ApiError::bad_request(
            "statement_id must be 1 to 128 characters",
        ));
    }
    let owner = owner(&principal);
    // Parsed once: what the parse says decides the role the statement needs, and the same
    // parse is what runs. A read key cannot insert, a write key cannot create or drop.
    let work = match state.db.prepare(&request.statement).await {
        Ok(prepared) => {
            let needed = match prepared.access() {
                Access::Read => super::Role::Read,
                Access::Write => super::Role::Write,
                Access::Admin => super::Role::Admin,
            };
            if principal.role < needed {
                return Err(ApiError::forbidden(principal.role, needed));
            }
            let db = state.db.clone();
            futures::future::Either::Left(async move { db.run(prepared).await })
        }
        // Statements refused for what they are answer at once, with nothing run.
        Err(e @ (QueryError::TooComplex(_) | QueryError::Unsupported(_))) => {
            return Err(ApiError::from(e).outcome(Outcome::Rejected));
        }
        // Statements that do not parse fail as statements, as clients expect.
        Err(e) => futures::future::Either::Right(async move { Err(e) }),
    };
    // Work that cancelled statements left running counts too: cancel-and-resubmit cannot
    // get past the limit.
    if state.db.engine().in_flight() >= state.statements.limits().max_running {
        let busy = SubmitError::Busy(state.statements.limits().max_running);
        return Err(ApiError::of(&busy));
    }
    let statement = state
        .statements
        .submit(&owner, request.statement_id, work)
        .map_err(|e| ApiError::of(&e))?;
    statement.wait(SUBMIT_WAIT).await;
    Ok(payload(&statement))
}

pub(super) async fn fetch(
    State(state): State<AppState>,
    axum::Extension(principal): axum::Extension<super::Principal>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let statement = state
        .statements
        .get(&owner(&principal), &id)
        .ok_or_else(|| ApiError::not_found(format!("statement {id} does not exist")))?;
    // A short wait saves a polling client a round trip when the result is about to be ready.
    statement.wait(Duration::from_millis(20)).await;
    Ok(payload(&statement))
}

pub(super) async fn cancel(
    State(state): State<AppState>,
    axum::Extension(principal): axum::Extension<super::Principal>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let statement = state
        .statements
        .cancel(&owner(&principal), &id)
        .ok_or_else(|| ApiError::not_found(format!("statement {id} does not exist")))?;
    Ok(payload(&statement))
}
