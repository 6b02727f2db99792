//! `POST /v1/statements`, `GET /v1/statements/{id}`, `POST /v1/statements/{id}/cancel`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse as _, Response};
use serde::Deserialize;
use serde_json::json;

use super::error::Outcome;
use super::held::{AnswerBudget, held};
use super::{ApiError, AppState};
use crate::query::StatementOutput;
use crate::query::statements::{Owner, Statement, StatementState, SubmitError};
use crate::query::{Access, QueryError};
use crate::types::cell::{CellWriter, JsonBuffer, TextForm, escape_into, hex_into};
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
    // reader that stops reading holds one piece (about 64 KiB, or one list, map or struct
    // value if that is larger) until the write times out.
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

/// Cells other than text (written whole) up to this size render on the thread that serves
/// the answer; a result with a larger one renders its pieces on the blocking pool, within
/// the [`RenderBudget`]. Strings and binary values are written a part at a time, a piece
/// holding [`PIECE_BYTES`] of them whatever their size.
const LARGE_CELL_BYTES: usize = 1 << 20;

/// Where rendering a result stands: the next row, the column in it and, within a text cell
/// begun in an earlier piece, the next byte of its value.
#[derive(Debug, Clone, Copy, Default)]
struct RowCursor {
    batch: usize,
    row: usize,
    column: usize,
    /// The next byte of a text cell begun earlier (0: the cell is not begun).
    offset: usize,
    /// The row's `[` is written.
    in_row: bool,
    /// A row was written (the next one follows a comma).
    any: bool,
}

impl RowCursor {
    /// Past every row.
    const END: RowCursor = RowCursor {
        batch: usize::MAX,
        row: 0,
        column: 0,
        offset: 0,
        in_row: false,
        any: true,
    };
}

/// Renders `output`'s rows from `cursor` until the piece holds [`PIECE_BYTES`] or the rows
/// end (empty then): cells straight into the piece (none built on its own), a long string
/// or binary value a part at a time across pieces.
fn render_piece(output: &StatementOutput, cursor: &mut RowCursor) -> Vec<u8> {
    // A piece ends a little past its size (a cell's last escape, a row's closing bracket).
    let mut piece = Vec::with_capacity(PIECE_BYTES + 64);
    while piece.len() < PIECE_BYTES && !past_the_rows(output, cursor) {
        let Some(batch) = output.batches.get(cursor.batch) else {
            break;
        };
        let cells: Vec<CellWriter<'_>> = batch.columns().iter().map(CellWriter::new).collect();
        while piece.len() < PIECE_BYTES && cursor.row < batch.num_rows() {
            render_row(&mut piece, &cells, cursor);
        }
    }
    piece
}

/// Moves `cursor` past empty batches; whether it is past every row.
fn past_the_rows(output: &StatementOutput, cursor: &mut RowCursor) -> bool {
    while let Some(batch) = output.batches.get(cursor.batch) {
        if cursor.row < batch.num_rows() {
            return false;
        }
        cursor.batch += 1;
        cursor.row = 0;
    }
    true
}

/// Writes row `cursor.row` from where `cursor` stands until the row ends (the cursor then
/// at the next row) or the piece is full (the cursor where to go on).
fn render_row(piece: &mut Vec<u8>, cells: &[CellWriter<'_>], cursor: &mut RowCursor) {
    let row = cursor.row;
    if !cursor.in_row {
        if cursor.any {
            piece.push(b',');
        }
        cursor.any = true;
        piece.push(b'[');
        cursor.in_row = true;
    }
    while let Some(cell) = cells.get(cursor.column) {
        if cursor.offset == 0 && cursor.column > 0 {
            piece.push(b',');
        }
        if cell.is_null(row) {
            piece.extend_from_slice(b"null");
        } else if let Some((bytes, form)) = cell.text(row) {
            if cursor.offset == 0 {
                piece.push(b'"');
            }
            // Parts small enough that even the longest escapes (six bytes for one) keep
            // the piece near its size.
            let mut at = cursor.offset;
            while at < bytes.len() {
                let room = PIECE_BYTES.saturating_sub(piece.len());
                // A cell stops only once a part of it is written (`at` > 0 says it is
                // begun: its comma and quote are not written again).
                if room == 0 && at > 0 {
                    cursor.offset = at;
                    return;
                }
                let end = match form {
                    TextForm::Escaped => at + (room / 6).max(1),
                    TextForm::Hex => at + (room / 2).max(1),
                }
                .min(bytes.len());
                match form {
                    TextForm::Escaped => escape_into(piece, &bytes[at..end]),
                    TextForm::Hex => hex_into(piece, &bytes[at..end]),
                }
                at = end;
            }
            piece.push(b'"');
        } else {
            piece.push(b'"');
            cell.write(&mut JsonBuffer(piece), row);
            piece.push(b'"');
        }
        cursor.column += 1;
        cursor.offset = 0;
        if piece.len() >= PIECE_BYTES && cursor.column < cells.len() {
            return;
        }
    }
    piece.push(b']');
    cursor.row += 1;
    cursor.column = 0;
    cursor.in_row = false;
}

/// What results with large cells that are not text (written whole) may take in rendered
/// pieces at once, across every fetch: the largest result there can be (`max_result_bytes`),
/// so that any cell can be rendered, and many fetches of huge cells take turns rather than
/// each holding its own. A piece holds its share until the connection has written it.
#[derive(Debug, Clone)]
pub(super) struct RenderBudget(AnswerBudget);

impl RenderBudget {
    /// A budget for results of up to `max_result_bytes`.
    pub(super) fn new(max_result_bytes: usize) -> Self {
        RenderBudget(AnswerBudget::new(max_result_bytes))
    }

    /// The next piece of `output`'s rows from `cursor` and the cursor after it, or `None`
    /// past the last row.
    async fn render(
        &self,
        output: &Arc<StatementOutput>,
        mut cursor: RowCursor,
    ) -> Result<Option<(bytes::Bytes, RowCursor)>, std::io::Error> {
        if output.rendered.largest_whole_cell <= LARGE_CELL_BYTES {
            let piece = render_piece(output, &mut cursor);
            return Ok((!piece.is_empty()).then(|| (bytes::Bytes::from(piece), cursor)));
        }
        if past_the_rows(output, &mut cursor) {
            return Ok(None);
        }
        let fail = |e: String| std::io::Error::other(format!("rendering the result failed: {e}"));
        let mut share = self
            .0
            .hold(output.rendered.largest_whole_cell + PIECE_BYTES)
            .await
            .ok_or_else(|| fail("the render budget is closed".into()))?;
        let output = Arc::clone(output);
        // The share goes with the rendering: a fetch given up meanwhile (its answer dropped)
        // does not give it back before the piece it pays for is gone.
        let rendered = tokio::task::spawn_blocking(move || {
            let mut piece = render_piece(&output, &mut cursor);
            // What the budget charged is what the piece holds, not a doubled capacity.
            piece.shrink_to_fit();
            AnswerBudget::fit(&mut share, piece.len());
            (!piece.is_empty()).then(|| (held(piece, share), cursor))
        })
        .await
        .map_err(|e| fail(e.to_string()))?;
        Ok(rendered)
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

    /// A result of several batches, with rows of hostile text and binary values larger
    /// than a piece, and values of every length around a piece's size (so that pieces end
    /// at every kind of place: in an escape, in a UTF-8 character, between cells).
    fn output() -> StatementOutput {
        let schema = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, true),
            Field::new("s", DataType::Utf8, true),
            Field::new("b", DataType::Binary, true),
        ]));
        let batch = |start: i64, rows: Vec<(Option<String>, Option<Vec<u8>>)>| {
            let n: ArrayRef = Arc::new(Int64Array::from_iter((start..).take(rows.len()).map(Some)));
            let s: ArrayRef = Arc::new(StringArray::from_iter(rows.iter().map(|r| r.0.clone())));
            let b: ArrayRef = Arc::new(arrow_array::BinaryArray::from_iter(
                rows.iter().map(|r| r.1.clone()),
            ));
            RecordBatch::try_new(Arc::clone(&schema), vec![n, s, b]).unwrap()
        };
        // Lengths around a piece's size, from a fixed seed.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |below: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % below as u64) as usize
        };
        let mixed: Vec<(Option<String>, Option<Vec<u8>>)> = (0..120)
            .map(|_| {
                let text: String = (0..next(PIECE_BYTES / 2))
                    .map(|_| ['a', 'é', '\u{1}', '"', '😀'][next(5)])
                    .collect();
                let bytes = vec![0xa5; next(PIECE_BYTES)];
                (Some(text), (next(4) > 0).then_some(bytes))
            })
            .collect();
        let batches = vec![
            batch(
                0,
                (0..5000)
                    .map(|i| (Some(format!("\"{i}\u{1}")), Some(vec![i as u8])))
                    .collect(),
            ),
            batch(5000, vec![]),
            batch(
                5000,
                vec![
                    (
                        Some("\n".repeat(3 * PIECE_BYTES)),
                        Some(vec![0xab; PIECE_BYTES + 3]),
                    ),
                    (None, None),
                    (Some("é".repeat(PIECE_BYTES)), Some(Vec::new())),
                ],
            ),
            batch(5003, mixed),
            batch(5123, vec![(Some(String::new()), None)]),
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
            // A piece ends once it is full, within a long value too; only a cell that is
            // not text (here an integer) is written whole past it.
            assert!(piece.len() <= PIECE_BYTES + 32, "{}", piece.len());
            pieces += 1;
            rendered.extend_from_slice(&piece);
        }
        rendered.push(b']');
        assert!(pieces >= 40, "{pieces}");
        let rows: Vec<Vec<Option<String>>> = serde_json::from_slice(&rendered).unwrap();
        assert_eq!(rows, output.to_result().rows);
        // The count puts a comma after each row; the answer between them.
        assert_eq!(output.rendered.bytes, rendered.len() - 2 + 1);
        assert_eq!(output.rendered.largest_whole_cell, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_cells_render_within_the_budget_and_give_it_back() {
        let output = Arc::new(output());
        // Room for one large piece at a time.
        let budget = RenderBudget::new(LARGE_CELL_BYTES + 1 + PIECE_BYTES);
        let mut cursor = RowCursor::default();
        let mut held = Vec::new();
        let mut rendered = b"[".to_vec();
        // The path of a result with a large cell that is not text, for these rows.
        let output = {
            let mut big = (*output).clone();
            big.rendered.largest_whole_cell = LARGE_CELL_BYTES + 1;
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
        assert_eq!(
            budget.0.free_bytes(),
            (LARGE_CELL_BYTES + 1 + PIECE_BYTES).div_ceil(1024) * 1024
        );
    }
}
