//! `POST /v1/statements`, `GET /v1/statements/{id}`, `POST /v1/statements/{id}/cancel`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse as _, Response};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::Outcome;
use super::{ApiError, AppState};
use crate::query::StatementOutput;
use crate::query::statements::{Owner, Statement, StatementState, SubmitError};
use crate::query::{Access, QueryError};
use crate::types::cell::{CellWriter, JsonBuffer, write_json_row};
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
fn payload(statement: &Statement, budget: &RenderBudget) -> Response {
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
    let rows = futures::stream::unfold(
        (output, RowCursor::default(), budget.clone()),
        |(output, cursor, budget)| async move {
            let (piece, cursor) = match budget.render(&output, cursor).await {
                Ok(Some(rendered)) => rendered,
                Ok(None) => return None,
                Err(e) => return Some((Err(e), (output, RowCursor::END, budget))),
            };
            Some((Ok(piece), (output, cursor, budget)))
        },
    );
    let tail = futures::stream::once(async { Ok(bytes::Bytes::from_static(b"]}}")) });
    use futures::StreamExt as _;
    let body = axum::body::Body::from_stream(head.chain(rows).chain(tail));
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// About how much of a result one piece of an answer renders.
const PIECE_BYTES: usize = 64 * 1024;

/// Rows up to this size render on the thread that serves the answer, a piece at a time;
/// a result with a larger row renders its pieces on the blocking pool, within the
/// [`RenderBudget`].
const LARGE_ROW_BYTES: usize = 1 << 20;

/// Where rendering a result stands: the next row to write, and whether one was written.
#[derive(Debug, Clone, Copy, Default)]
struct RowCursor {
    batch: usize,
    row: usize,
    any: bool,
}

impl RowCursor {
    /// Past every row.
    const END: RowCursor = RowCursor {
        batch: usize::MAX,
        row: 0,
        any: true,
    };
}

/// Renders `output`'s rows from `cursor` until the piece holds [`PIECE_BYTES`] or the rows
/// end (empty then), each row straight into the piece (no cell built on its own).
fn render_piece(output: &StatementOutput, cursor: &mut RowCursor) -> Vec<u8> {
    let mut piece = Vec::new();
    while piece.len() < PIECE_BYTES {
        let Some(batch) = output.batches.get(cursor.batch) else {
            break;
        };
        if cursor.row >= batch.num_rows() {
            cursor.batch += 1;
            cursor.row = 0;
            continue;
        }
        let cells: Vec<CellWriter<'_>> = batch.columns().iter().map(CellWriter::new).collect();
        while piece.len() < PIECE_BYTES && cursor.row < batch.num_rows() {
            if cursor.any {
                piece.push(b',');
            }
            cursor.any = true;
            write_json_row(&mut JsonBuffer(&mut piece), &cells, cursor.row);
            cursor.row += 1;
        }
    }
    piece
}

/// What results with large rows may take in rendered pieces at once, across every fetch,
/// in KiB: the largest result there can be (`max_result_bytes`), so that any row can be
/// rendered, and many fetches of huge rows take turns rather than each holding its own.
/// A piece holds its share until the connection has written it.
#[derive(Debug, Clone)]
pub(super) struct RenderBudget {
    kib: Arc<Semaphore>,
    capacity_kib: u32,
}

impl RenderBudget {
    /// A budget for results of up to `max_result_bytes`.
    pub(super) fn new(max_result_bytes: usize) -> Self {
        let capacity_kib = u32::try_from(max_result_bytes.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .clamp(1, u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
        RenderBudget {
            kib: Arc::new(Semaphore::new(capacity_kib as usize)),
            capacity_kib,
        }
    }

    /// The next piece of `output`'s rows from `cursor` and the cursor after it, or `None`
    /// past the last row.
    async fn render(
        &self,
        output: &Arc<StatementOutput>,
        mut cursor: RowCursor,
    ) -> Result<Option<(bytes::Bytes, RowCursor)>, std::io::Error> {
        if output.rendered.largest_row <= LARGE_ROW_BYTES {
            let piece = render_piece(output, &mut cursor);
            return Ok((!piece.is_empty()).then(|| (bytes::Bytes::from(piece), cursor)));
        }
        let fail = |e: String| std::io::Error::other(format!("rendering the result failed: {e}"));
        let need = u32::try_from((output.rendered.largest_row + PIECE_BYTES).div_ceil(1024))
            .unwrap_or(u32::MAX)
            .min(self.capacity_kib);
        let held = Arc::clone(&self.kib)
            .acquire_many_owned(need)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let output = Arc::clone(output);
        let (piece, cursor) = tokio::task::spawn_blocking(move || {
            let piece = render_piece(&output, &mut cursor);
            (piece, cursor)
        })
        .await
        .map_err(|e| fail(e.to_string()))?;
        if piece.is_empty() {
            return Ok(None);
        }
        Ok(Some((
            bytes::Bytes::from_owner(HeldPiece { piece, _held: held }),
            cursor,
        )))
    }
}

/// A rendered piece with its share of the [`RenderBudget`], given back when the piece is
/// dropped (written out, or the answer abandoned).
struct HeldPiece {
    piece: Vec<u8>,
    _held: OwnedSemaphorePermit,
}

impl AsRef<[u8]> for HeldPiece {
    fn as_ref(&self) -> &[u8] {
        &self.piece
    }
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
    Ok(payload(&statement, &state.render_budget))
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
    Ok(payload(&statement, &state.render_budget))
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
    Ok(payload(&statement, &state.render_budget))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    use arrow_schema::{DataType, Field, Schema};

    use super::*;

    /// A result of several batches, with rows of hostile text larger than a piece.
    fn output() -> StatementOutput {
        let schema = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
        ]));
        let batch = |start: i64, texts: Vec<Option<String>>| {
            let n: ArrayRef =
                Arc::new(Int64Array::from_iter((start..).take(texts.len()).map(Some)));
            let s: ArrayRef = Arc::new(StringArray::from(texts));
            RecordBatch::try_new(Arc::clone(&schema), vec![n, s]).unwrap()
        };
        let batches = vec![
            batch(0, (0..5000).map(|i| Some(format!("\"{i}\u{1}"))).collect()),
            batch(5000, vec![]),
            batch(5000, vec![Some("\n".repeat(3 * PIECE_BYTES)), None]),
            batch(5002, vec![Some("é".into())]),
        ];
        StatementOutput::new(schema, batches)
    }

    #[test]
    fn pieces_render_every_row_once_in_order_and_measure_as_counted() {
        let output = output();
        let mut cursor = RowCursor::default();
        let mut rendered = b"[".to_vec();
        let mut pieces = 0;
        loop {
            let piece = render_piece(&output, &mut cursor);
            if piece.is_empty() {
                break;
            }
            // A piece ends at the first row that takes it past its size.
            assert!(
                piece.len() < PIECE_BYTES + 7 * PIECE_BYTES,
                "{}",
                piece.len()
            );
            pieces += 1;
            rendered.extend_from_slice(&piece);
        }
        rendered.push(b']');
        assert!(pieces >= 3, "{pieces}");
        let rows: Vec<Vec<Option<String>>> = serde_json::from_slice(&rendered).unwrap();
        assert_eq!(rows, output.to_result().rows);
        // The count puts a comma after each row; the answer between them.
        assert_eq!(output.rendered.bytes, rendered.len() - 2 + 1);
        assert_eq!(output.rendered.largest_row, 6 * PIECE_BYTES + 12);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_rows_render_within_the_budget_and_give_it_back() {
        let output = Arc::new(output());
        // Room for one large piece at a time.
        let budget = RenderBudget::new(output.rendered.largest_row + PIECE_BYTES);
        let mut cursor = RowCursor::default();
        let mut held = Vec::new();
        let mut rendered = b"[".to_vec();
        // Force the large-row path whatever the rows' size.
        let output = if output.rendered.largest_row > LARGE_ROW_BYTES {
            output
        } else {
            let mut big = (*output).clone();
            big.rendered.largest_row = LARGE_ROW_BYTES + 1;
            Arc::new(big)
        };
        let first = budget.render(&output, cursor).await.unwrap().unwrap();
        cursor = first.1;
        rendered.extend_from_slice(&first.0);
        held.push(first.0);
        // The first piece is not written out yet: the next waits for it.
        let waiting = tokio::time::timeout(
            std::time::Duration::from_millis(200),
            budget.render(&output, cursor),
        )
        .await;
        assert!(
            waiting.is_err(),
            "a second large piece was rendered beside the first"
        );
        held.clear();
        while let Some((piece, next)) = budget.render(&output, cursor).await.unwrap() {
            rendered.extend_from_slice(&piece);
            cursor = next;
        }
        rendered.push(b']');
        let rows: Vec<Vec<Option<String>>> = serde_json::from_slice(&rendered).unwrap();
        assert_eq!(rows, output.to_result().rows);
        assert_eq!(budget.kib.available_permits(), budget.capacity_kib as usize);
    }
}
