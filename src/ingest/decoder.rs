//! The typed NDJSON decoder: one pass from bytes into Arrow buffers.

use std::collections::HashMap;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;

use super::builder::{ColumnBuilder, Values};
use super::{IngestError, Limits, RowError, RowErrors};
use crate::types::json::{Discard, JsonError, JsonKind, Scanner, short_eq, unescape_into};
use crate::types::number::{float_value, int_value, uint_value};
use crate::types::temporal::{parse_interval, parse_timestamp};
use crate::types::{Column, ColumnType, ValueError, arrow_schema, decode_base64_into};

/// Bodies are split for parallel decoding only into chunks of at least this many bytes.
const PARALLEL_MIN_CHUNK_BYTES: usize = 2 << 20;

/// Offsets that split `body` into about `parts` chunks, each starting at a row: 0, the split
/// points, and `body.len()`.
///
/// A split point is just after a line break between `}` and `{` (`}\n{` or `}\r\n{`). In
/// valid JSON that sequence cannot occur inside a row: strings hold no raw line breaks, and
/// inside an array or object a `,` or `:` must separate a `}` from a following `{`. Invalid
/// input may split elsewhere, but then a chunk fails and the body is decoded in one piece.
fn row_boundaries(body: &[u8], parts: usize) -> Vec<usize> {
    let mut bounds = vec![0];
    for k in 1..parts {
        let target = (body.len() / parts * k).max(bounds[bounds.len() - 1]);
        let found = body[target..]
            .iter()
            .enumerate()
            .filter(|(_, b)| **b == b'\n')
            .map(|(i, _)| target + i)
            .find(|&nl| {
                let before = if nl > 0 && body[nl - 1] == b'\r' {
                    nl.checked_sub(2)
                } else {
                    nl.checked_sub(1)
                };
                before.is_some_and(|b| body[b] == b'}') && body.get(nl + 1) == Some(&b'{')
            });
        match found {
            Some(nl) => bounds.push(nl + 1),
            None => break,
        }
    }
    bounds.push(body.len());
    bounds
}

/// Where a row's field goes.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// An input column, by its index among input columns.
    Input(usize),
    /// A computed column: input must omit it.
    Computed,
}

/// A decoder for one table's rows. Build it once per table definition and reuse it: it holds
/// the column lookup and the Arrow schema.
#[derive(Debug, Clone)]
pub struct Decoder {
    schema: SchemaRef,
    /// Input columns in definition order.
    inputs: Vec<(Box<[u8]>, ColumnType)>,
    /// Field name to target, for every column of the table.
    by_name: HashMap<Box<[u8]>, Target>,
    /// Threads one large body may be decoded on.
    parallelism: usize,
}

/// Why reading one field's value failed.
enum FieldError {
    /// The value was consumed but breaks a column rule: record it, go on with the row.
    Value(ValueError),
    /// The JSON itself is broken: the rest of the row cannot be read.
    Syntax(JsonError),
}

impl From<JsonError> for FieldError {
    fn from(e: JsonError) -> Self {
        FieldError::Syntax(e)
    }
}

impl From<ValueError> for FieldError {
    fn from(e: ValueError) -> Self {
        FieldError::Value(e)
    }
}

/// Broken JSON in a row: the rest of the row cannot be read.
struct Abort {
    error: JsonError,
    /// The input column whose value was being read, if any.
    column: Option<usize>,
}

impl From<JsonError> for Abort {
    fn from(error: JsonError) -> Self {
        Abort {
            error,
            column: None,
        }
    }
}

/// Per-request decoding state.
struct Run<'d, 'a> {
    decoder: &'d Decoder,
    scanner: Scanner<'a>,
    builders: Vec<ColumnBuilder>,
    /// For each input column, the last row (plus one) that set it.
    seen: Vec<usize>,
    scratch: Vec<u8>,
    errors: RowErrors,
    max_errors: usize,
}

impl Decoder {
    /// A decoder for a table with these columns (computed ones included: input must omit them).
    pub fn new(columns: &[Column]) -> Self {
        let inputs: Vec<(Box<[u8]>, ColumnType)> = columns
            .iter()
            .filter(|c| !c.computed)
            .map(|c| (c.name.as_bytes().into(), c.data_type))
            .collect();
        let mut by_name = HashMap::new();
        let mut input_index = 0;
        for c in columns {
            let target = if c.computed {
                Target::Computed
            } else {
                input_index += 1;
                Target::Input(input_index - 1)
            };
            by_name.insert(c.name.as_bytes().into(), target);
        }
        Decoder {
            schema: arrow_schema(columns.iter().filter(|c| !c.computed)),
            inputs,
            by_name,
            parallelism: std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
        }
    }

    /// The Arrow schema of the batches this decoder produces (input columns only).
    pub(crate) fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Decodes a whole (decompressed) body into one batch, or returns every problem found.
    ///
    /// Rows are JSON objects separated by any JSON whitespace (NDJSON with LF or CRLF, blank
    /// lines skipped) or by nothing at all (`{"a":1}{"a":2}`).
    ///
    /// Bodies of several MiB are split at row boundaries and decoded on up to
    /// [`Decoder::with_parallelism`] threads; the result, including every error reported, is
    /// the same as decoding the body in one piece.
    pub fn decode(&self, body: &[u8], limits: &Limits) -> Result<RecordBatch, IngestError> {
        let max_body = limits.max_body_bytes.min(i32::MAX as usize);
        if body.len() > max_body {
            return Err(IngestError::BodyTooLarge { limit: max_body });
        }
        let parts = self.parallelism.min(body.len() / PARALLEL_MIN_CHUNK_BYTES);
        if parts > 1
            && let Some(batch) = self.decode_parallel(body, limits, parts)
        {
            return batch;
        }
        self.decode_chunk(body, limits)
    }

    /// Sets how many threads one large body may be decoded on (at least 1).
    pub fn with_parallelism(mut self, threads: usize) -> Self {
        self.parallelism = threads.max(1);
        self
    }

    /// Decodes `parts` row-aligned chunks of `body` on scoped threads. `None` when the body
    /// cannot be split, or when any chunk fails: the caller then decodes the whole body in one
    /// piece, so error reports (row indexes, the cap) are exactly the sequential ones.
    fn decode_parallel(
        &self,
        body: &[u8],
        limits: &Limits,
        parts: usize,
    ) -> Option<Result<RecordBatch, IngestError>> {
        let bounds = row_boundaries(body, parts);
        if bounds.len() < 3 {
            return None;
        }
        let results: Vec<Option<Result<RecordBatch, IngestError>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = bounds
                .windows(2)
                .map(|w| {
                    let chunk = &body[w[0]..w[1]];
                    scope.spawn(move || self.decode_chunk(chunk, limits))
                })
                .collect();
            handles.into_iter().map(|h| h.join().ok()).collect()
        });
        let mut batches = Vec::with_capacity(results.len());
        for result in results {
            batches.push(result?.ok()?);
        }
        let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
        if rows > limits.max_rows {
            return Some(Err(IngestError::TooManyRows {
                limit: limits.max_rows,
            }));
        }
        arrow_select::concat::concat_batches(&self.schema, &batches)
            .ok()
            .map(Ok)
    }

    /// Decodes a body (or a row-aligned chunk of one) on the calling thread.
    fn decode_chunk(&self, body: &[u8], limits: &Limits) -> Result<RecordBatch, IngestError> {
        // Row count is not known yet; guess from the body size (rows are rarely under 32 bytes).
        let row_guess = (body.len() / 64).clamp(16, limits.max_rows.max(16));
        let per_column_bytes = body.len() / self.inputs.len().max(1);
        let mut run = Run {
            decoder: self,
            scanner: Scanner::new(body),
            builders: self
                .inputs
                .iter()
                .map(|(_, t)| {
                    let bytes =
                        if matches!(t, ColumnType::String | ColumnType::Binary) || t.is_json() {
                            per_column_bytes
                        } else {
                            0
                        };
                    ColumnBuilder::new(*t, row_guess, bytes)
                })
                .collect(),
            seen: vec![0; self.inputs.len()],
            scratch: Vec::new(),
            errors: RowErrors::default(),
            max_errors: limits.max_row_errors,
        };
        let rows = run.rows(limits.max_rows)?;
        if !run.errors.errors.is_empty() || run.errors.truncated {
            return Err(IngestError::InvalidRows(run.errors));
        }
        let columns = run
            .builders
            .into_iter()
            .map(ColumnBuilder::finish)
            .collect();
        let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(rows));
        RecordBatch::try_new_with_options(self.schema.clone(), columns, &options).map_err(|e| {
            // Unreachable unless a builder lost count; report it as a row-less request error
            // rather than panicking.
            IngestError::InvalidRows(RowErrors {
                errors: vec![RowError {
                    row_index: 0,
                    column: None,
                    message: format!("internal error assembling the batch: {e}"),
                }],
                truncated: false,
            })
        })
    }

    fn column_name(&self, column: usize) -> String {
        String::from_utf8_lossy(&self.inputs[column].0).into_owned()
    }

    /// Finds the column a key names: first the column after the previous one (rows usually
    /// list fields in the same order), then the map.
    #[inline]
    fn lookup(&self, key: &[u8], hint: usize) -> Option<Target> {
        if let Some((name, _)) = self.inputs.get(hint)
            && short_eq(name, key)
        {
            return Some(Target::Input(hint));
        }
        self.by_name.get(key).copied()
    }
}

impl Run<'_, '_> {
    /// Reads every row; returns the row count.
    fn rows(&mut self, max_rows: usize) -> Result<usize, IngestError> {
        let mut row = 0;
        loop {
            self.scanner.skip_ws();
            if self.scanner.peek().is_none() {
                return Ok(row);
            }
            if row == max_rows {
                return Err(IngestError::TooManyRows { limit: max_rows });
            }
            if let Err(abort) = self.row(row) {
                let column = abort.column.map(|c| self.decoder.column_name(c));
                self.error(row, column, abort.error.to_string());
                // Resynchronise at the next line; with no line break left the rest is lost.
                let input = self.scanner.input();
                let from = abort.error.offset.min(input.len());
                match input[from..].iter().position(|&b| b == b'\n') {
                    Some(p) => self.scanner.set_pos(from + p + 1),
                    None => return Ok(row + 1),
                }
            }
            row += 1;
            if self.errors.truncated {
                return Ok(row);
            }
        }
    }

    fn error(&mut self, row_index: usize, column: Option<String>, message: String) {
        if self.errors.errors.len() < self.max_errors {
            self.errors.errors.push(RowError {
                row_index,
                column,
                message,
            });
        } else {
            self.errors.truncated = true;
        }
    }

    /// Reads one row: a JSON object whose keys name columns.
    fn row(&mut self, row: usize) -> Result<(), Abort> {
        let stamp = row + 1;
        if self.scanner.peek() != Some(b'{') {
            let kind = self.scanner.value(&mut Discard, 0)?;
            self.error(
                row,
                None,
                format!("a row must be a JSON object, found {}", kind.describe()),
            );
            return Ok(());
        }
        self.scanner.expect(b'{')?;
        self.scanner.skip_ws();
        let mut hint = 0;
        if self.scanner.peek() == Some(b'}') {
            self.scanner.expect(b'}')?;
        } else {
            loop {
                self.scanner.skip_ws();
                if self.scanner.peek() != Some(b'"') {
                    // Let `expect` produce the error for the byte found.
                    self.scanner.expect(b'"')?;
                }
                let key = self.scanner.string()?;
                let target = if key.escaped {
                    self.scratch.clear();
                    unescape_into(key.content, &mut self.scratch, true).ok();
                    self.decoder.by_name.get(self.scratch.as_slice()).copied()
                } else {
                    self.decoder.lookup(key.content, hint)
                };
                self.scanner.expect(b':')?;
                self.scanner.skip_ws();
                match target {
                    Some(Target::Input(column)) if self.seen[column] != stamp => {
                        self.seen[column] = stamp;
                        hint = column + 1;
                        self.field(row, column)?;
                    }
                    other => {
                        let name = if key.escaped {
                            String::from_utf8_lossy(&self.scratch).into_owned()
                        } else {
                            String::from_utf8_lossy(key.content).into_owned()
                        };
                        let message = match other {
                            None => "unknown field: the table has no such column".to_owned(),
                            Some(Target::Computed) => {
                                "computed column: input must omit it, the server fills it"
                                    .to_owned()
                            }
                            Some(Target::Input(_)) => "duplicate key in row".to_owned(),
                        };
                        self.scanner.value(&mut Discard, 1)?;
                        self.error(row, Some(name), message);
                    }
                }
                self.scanner.skip_ws();
                match self.scanner.peek() {
                    Some(b',') => self.scanner.expect(b',')?,
                    _ => {
                        self.scanner.expect(b'}')?;
                        break;
                    }
                }
            }
        }
        for (column, seen) in self.seen.iter().enumerate() {
            if *seen != stamp {
                self.builders[column].push_null();
            }
        }
        Ok(())
    }

    /// Reads one field's value into its column, recording a value error if it breaks a rule.
    fn field(&mut self, row: usize, column: usize) -> Result<(), Abort> {
        match self.read_value(column) {
            Ok(()) => Ok(()),
            Err(FieldError::Syntax(error)) => Err(Abort {
                error,
                column: Some(column),
            }),
            Err(FieldError::Value(e)) => {
                self.error(row, Some(self.decoder.column_name(column)), e.to_string());
                Ok(())
            }
        }
    }

    /// Consumes a value that has the wrong kind and describes the mismatch.
    fn wrong_kind(&mut self, expected: &'static str) -> FieldError {
        match self.scanner.value(&mut Discard, 1) {
            Ok(found) => FieldError::Value(ValueError::WrongKind {
                expected,
                found: found.describe(),
            }),
            Err(e) => FieldError::Syntax(e),
        }
    }

    fn read_value(&mut self, column: usize) -> Result<(), FieldError> {
        let column_type = self.decoder.inputs[column].1;
        let Some(first) = self.scanner.peek() else {
            return Err(FieldError::Syntax(self.scanner.unexpected()));
        };
        if first == b'n' {
            self.scanner.literal()?;
            self.builders[column].push_null();
            return Ok(());
        }
        let kind = JsonKind::from_first_byte(first);
        let builder = &mut self.builders[column];
        match (&mut builder.values, kind) {
            (Values::Int(v), Some(JsonKind::Number)) => {
                let n = self.scanner.number()?;
                v.push(int_value(n.text, n.is_integer)?);
            }
            (Values::UInt(v), Some(JsonKind::Number)) => {
                let n = self.scanner.number()?;
                v.push(uint_value(n.text, n.is_integer)?);
            }
            (Values::Float(v), Some(JsonKind::Number)) => {
                let n = self.scanner.number()?;
                v.push(float_value(n.text, n.is_integer)?);
            }
            (Values::Boolean(b), Some(JsonKind::Boolean)) => {
                let word = self.scanner.literal()?;
                b.append(word == b"true");
            }
            (Values::Text { offsets, data }, Some(JsonKind::String))
                if column_type == ColumnType::String =>
            {
                let s = self.scanner.string()?;
                if s.escaped {
                    unescape_into(s.content, data, false)
                        .map_err(|code| ValueError::UnpairedSurrogate { code })?;
                } else {
                    data.extend_from_slice(s.content);
                }
                offsets.push(data.len() as i32);
            }
            (Values::Timestamp(v), Some(JsonKind::String)) => {
                let s = self.scanner.string()?;
                let text = unescaped(s.content, s.escaped, &mut self.scratch);
                v.push(parse_timestamp(text)?);
            }
            (Values::Interval(v), Some(JsonKind::String)) => {
                let s = self.scanner.string()?;
                let text = unescaped(s.content, s.escaped, &mut self.scratch);
                v.push(parse_interval(text)?);
            }
            (Values::Binary { offsets, data }, Some(JsonKind::String)) => {
                let s = self.scanner.string()?;
                let text = unescaped(s.content, s.escaped, &mut self.scratch);
                let before = data.len();
                if let Err(e) = decode_base64_into(text, data) {
                    data.truncate(before);
                    return Err(e.into());
                }
                offsets.push(data.len() as i32);
            }
            (Values::Text { offsets, data }, Some(found))
                if column_type == ColumnType::Any
                    || (column_type == ColumnType::Object && found == JsonKind::Object)
                    || (column_type == ColumnType::Array && found == JsonKind::Array) =>
            {
                // A broken rule inside the value (a duplicate key, say) stops the scan there,
                // so it aborts the row like a syntax error, attributed to this column.
                self.scanner.compact_value(data, 0)?;
                offsets.push(data.len() as i32);
            }
            _ => return Err(self.wrong_kind(expected_for(column_type))),
        }
        self.builders[column].valid();
        Ok(())
    }
}

/// The string's text with escapes decoded (into `scratch` when it has any).
fn unescaped<'s>(content: &'s [u8], escaped: bool, scratch: &'s mut Vec<u8>) -> &'s [u8] {
    if !escaped {
        return content;
    }
    scratch.clear();
    // Lone surrogates cannot be part of a valid timestamp, interval or base64 text anyway; the
    // parser will refuse the resulting bytes.
    unescape_into(content, scratch, true).ok();
    scratch
}

fn expected_for(column_type: ColumnType) -> &'static str {
    match column_type {
        ColumnType::Int => "an integer (int)",
        ColumnType::UInt => "a non-negative integer (uint)",
        ColumnType::Float => "a number (float)",
        ColumnType::Boolean => "true or false (boolean)",
        ColumnType::String => "a string",
        ColumnType::Timestamp => "an RFC 3339 timestamp string",
        ColumnType::Interval => "an ISO 8601 duration string",
        ColumnType::Binary => "a base64 string (binary)",
        ColumnType::Object => "a JSON object",
        ColumnType::Array => "a JSON array",
        ColumnType::Any => "any JSON value",
    }
}
