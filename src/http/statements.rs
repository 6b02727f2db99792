//! `POST /v1/statements`, `GET /v1/statements/{id}`, `POST /v1/statements/{id}/cancel`.

use std::time::{Duration, SystemTime};

use axum::Json;
use axum::extract::{Path, State};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ApiError, AppState};
use crate::query::statements::{Statement, StatementState};
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
fn payload(statement: &Statement) -> Value {
    let state = statement.state();
    let elapsed = statement.elapsed_nanos();
    let rows = match &state {
        StatementState::Finished(r) => r.rows.len() as u64,
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
    match state {
        StatementState::Running => body["status"] = json!("running"),
        StatementState::Finished(result) => {
            body["status"] = json!("finished");
            let fields: Vec<Value> = result
                .fields
                .iter()
                .map(|f| json!({"name": f.name, "data_type": f.data_type}))
                .collect();
            body["result_set"] = json!({
                "metadata": {"fields": fields, "num_rows": result.rows.len()},
                "format": "json",
                "rows": result.rows,
            });
        }
        StatementState::Failed { code, message } => {
            body["status"] = json!("failed");
            body["message"] = json!(message);
            body["error"] = json!({"code": code, "message": message});
        }
        StatementState::Cancelled => {
            body["status"] = json!("cancelled");
            body["message"] = json!("statement cancelled");
        }
    }
    body
}

pub(super) async fn submit(
    State(state): State<AppState>,
    role: Option<axum::Extension<super::Role>>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<Json<Value>, ApiError> {
    let request: Submit = super::read_json(&headers, body, "{\"statement\": \"...\"}").await?;
    // What the statement does decides the role it needs: a read key cannot insert, a write
    // key cannot create or drop.
    let role = role.map_or(super::Role::Admin, |r| r.0);
    let needed = match crate::query::QueryEngine::access(&request.statement) {
        crate::query::Access::Read => super::Role::Read,
        crate::query::Access::Write => super::Role::Write,
        crate::query::Access::Admin => super::Role::Admin,
    };
    if role < needed {
        return Err(ApiError::forbidden(role, needed));
    }
    if let Some(id) = &request.statement_id {
        if id.is_empty() || id.len() > 128 {
            return Err(ApiError::bad_request(
                "statement_id must be 1 to 128 characters",
            ));
        }
    }
    let statement = state.statements.submit(
        state.db.engine().clone(),
        request.statement,
        request.statement_id,
    );
    statement.wait(SUBMIT_WAIT).await;
    Ok(Json(payload(&statement)))
}

pub(super) async fn fetch(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let statement = state
        .statements
        .get(&id)
        .ok_or_else(|| ApiError::not_found(format!("statement {id} does not exist")))?;
    // A short wait saves a polling client a round trip when the result is about to be ready.
    statement.wait(Duration::from_millis(20)).await;
    Ok(Json(payload(&statement)))
}

pub(super) async fn cancel(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let statement = state
        .statements
        .cancel(&id)
        .ok_or_else(|| ApiError::not_found(format!("statement {id} does not exist")))?;
    Ok(Json(payload(&statement)))
}
