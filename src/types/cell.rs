//! The statements API's cell form: every value as a JSON string, or null.
//!
//! Numbers and booleans print as text, timestamps as RFC 3339 in UTC, intervals as ISO 8601
//! durations, JSON columns as their stored JSON text and binary as lower-case hex.

use std::fmt;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    DurationNanosecondType, Float64Type, Int64Type, TimestampNanosecondType, UInt64Type,
};
use arrow_array::{Array, ArrayRef};
use arrow_cast::display::{ArrayFormatter, FormatOptions};
use arrow_schema::{DataType, TimeUnit};

use super::number::format_float;
use super::temporal::{write_interval, write_timestamp};

/// Formats row `row` of `array` in the cell form, or `None` for SQL NULL.
///
/// The Arrow data type decides the form; `object`/`array`/`any` columns are Utf8 and print as
/// the JSON text they hold. Types sluice does not store print through Arrow's display.
///
/// ```
/// use std::sync::Arc;
/// use arrow_array::{ArrayRef, Int64Array};
/// use sluice::types::cell::format_cell;
/// let a: ArrayRef = Arc::new(Int64Array::from(vec![Some(42), None]));
/// assert_eq!(format_cell(&a, 0).as_deref(), Some("42"));
/// assert_eq!(format_cell(&a, 1), None);
/// ```
pub fn format_cell(array: &ArrayRef, row: usize) -> Option<String> {
    let cells = CellWriter::new(array);
    if cells.is_null(row) {
        return None;
    }
    let mut out = String::new();
    cells.write(&mut out, row);
    Some(out)
}

/// Writes the cells of one column in the cell form, straight into any [`fmt::Write`]: made
/// once for a column and used for many of its rows, so a large value (a long string, a
/// list of a million items) is never first built as a `String` of its own.
pub(crate) struct CellWriter<'a> {
    array: &'a ArrayRef,
    /// Arrow's display, for the types sluice does not store (or why it cannot display).
    display: Option<Result<ArrayFormatter<'a>, arrow_schema::ArrowError>>,
    /// Which rows are SQL NULL.
    nulls: Nulls,
}

/// How a column says which rows are SQL NULL: by its null buffer, or logically (a column of
/// the null type has none, a dictionary's key can point at a null value). The logical form is
/// made only where it differs, since making it walks the column.
enum Nulls {
    Buffer,
    All,
    Logical(Option<arrow_buffer::NullBuffer>),
}

impl<'a> CellWriter<'a> {
    /// A writer of `array`'s cells.
    pub(crate) fn new(array: &'a ArrayRef) -> Self {
        let display = match array.data_type() {
            DataType::Int64
            | DataType::UInt64
            | DataType::Float64
            | DataType::Boolean
            | DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Timestamp(TimeUnit::Nanosecond, _)
            | DataType::Duration(TimeUnit::Nanosecond)
            | DataType::Binary
            | DataType::LargeBinary
            | DataType::BinaryView => None,
            // Types outside sluice's mapping (query results can produce them, such as Int32
            // from SQL literals) print through Arrow's own display.
            _ => Some(ArrayFormatter::try_new(
                array.as_ref(),
                &FormatOptions::default(),
            )),
        };
        CellWriter {
            array,
            display,
            nulls: match array.data_type() {
                DataType::Null => Nulls::All,
                DataType::Dictionary(..)
                    if array
                        .as_any_dictionary_opt()
                        .is_some_and(|d| d.values().logical_null_count() == 0) =>
                {
                    Nulls::Buffer
                }
                DataType::Dictionary(..) | DataType::RunEndEncoded(..) => {
                    Nulls::Logical(array.logical_nulls())
                }
                _ => Nulls::Buffer,
            },
        }
    }

    /// Whether row `row` is SQL NULL (which [`CellWriter::write`] does not write).
    pub(crate) fn is_null(&self, row: usize) -> bool {
        match &self.nulls {
            Nulls::Buffer => self.array.is_null(row),
            Nulls::All => true,
            Nulls::Logical(nulls) => nulls.as_ref().is_some_and(|n| n.is_null(row)),
        }
    }

    /// Writes row `row`'s value (nothing for SQL NULL).
    pub(crate) fn write(&self, out: &mut impl fmt::Write, row: usize) {
        if self.is_null(row) {
            return;
        }
        let array = self.array;
        // A writer that fails stops taking text: what it got is all there is to write.
        let _ = match (&self.display, array.data_type()) {
            (Some(Ok(display)), _) => write!(out, "{}", display.value(row)),
            (Some(Err(e)), _) => write!(out, "<{e}>"),
            (None, DataType::Int64) => {
                write!(out, "{}", array.as_primitive::<Int64Type>().value(row))
            }
            (None, DataType::UInt64) => {
                write!(out, "{}", array.as_primitive::<UInt64Type>().value(row))
            }
            (None, DataType::Float64) => out.write_str(&format_float(
                array.as_primitive::<Float64Type>().value(row),
            )),
            (None, DataType::Boolean) => out.write_str(if array.as_boolean().value(row) {
                "true"
            } else {
                "false"
            }),
            (None, DataType::Utf8) => out.write_str(array.as_string::<i32>().value(row)),
            (None, DataType::LargeUtf8) => out.write_str(array.as_string::<i64>().value(row)),
            (None, DataType::Utf8View) => out.write_str(array.as_string_view().value(row)),
            (None, DataType::Timestamp(TimeUnit::Nanosecond, _)) => {
                let mut text = String::new();
                write_timestamp(
                    &mut text,
                    array.as_primitive::<TimestampNanosecondType>().value(row),
                );
                out.write_str(&text)
            }
            (None, DataType::Duration(TimeUnit::Nanosecond)) => {
                let mut text = String::new();
                write_interval(
                    &mut text,
                    array.as_primitive::<DurationNanosecondType>().value(row),
                );
                out.write_str(&text)
            }
            (None, DataType::Binary) => write_hex(out, array.as_binary::<i32>().value(row)),
            (None, DataType::LargeBinary) => write_hex(out, array.as_binary::<i64>().value(row)),
            (None, DataType::BinaryView) => write_hex(out, array.as_binary_view().value(row)),
            (None, _) => Ok(()),
        };
    }
}

/// How a text cell's bytes are written: escaped as a JSON string's contents, or as hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TextForm {
    /// A string's bytes, escaped.
    Escaped,
    /// Binary bytes, two hex digits each.
    Hex,
}

impl<'a> CellWriter<'a> {
    /// Row `row`'s bytes and their form, for a column of strings or binary (whose cells can
    /// be written a part at a time, from any byte on); `None` for other columns.
    pub(crate) fn text(&self, row: usize) -> Option<(&'a [u8], TextForm)> {
        if self.display.is_some() {
            return None;
        }
        let array = self.array;
        Some(match array.data_type() {
            DataType::Utf8 => (
                array.as_string::<i32>().value(row).as_bytes(),
                TextForm::Escaped,
            ),
            DataType::LargeUtf8 => (
                array.as_string::<i64>().value(row).as_bytes(),
                TextForm::Escaped,
            ),
            DataType::Utf8View => (
                array.as_string_view().value(row).as_bytes(),
                TextForm::Escaped,
            ),
            DataType::Binary => (array.as_binary::<i32>().value(row), TextForm::Hex),
            DataType::LargeBinary => (array.as_binary::<i64>().value(row), TextForm::Hex),
            DataType::BinaryView => (array.as_binary_view().value(row), TextForm::Hex),
            _ => return None,
        })
    }
}

impl CellWriter<'_> {
    /// The length of row `row`'s value as [`CellWriter::write`] writes it, when that is
    /// known without writing it (integers and booleans, which need no escapes).
    fn known_len(&self, row: usize) -> Option<usize> {
        let digits = |n: u64| n.checked_ilog10().map_or(1, |d| d as usize + 1);
        match (&self.display, self.array.data_type()) {
            (None, DataType::Int64) => {
                let n = self.array.as_primitive::<Int64Type>().value(row);
                Some(digits(n.unsigned_abs()) + usize::from(n < 0))
            }
            (None, DataType::UInt64) => {
                Some(digits(self.array.as_primitive::<UInt64Type>().value(row)))
            }
            (None, DataType::Boolean) => Some(if self.array.as_boolean().value(row) {
                4
            } else {
                5
            }),
            _ => None,
        }
    }
}

/// Where a row of the statements API's JSON goes: raw JSON syntax by [`JsonSink::raw`], a
/// string's contents through [`fmt::Write`], which escapes them as `serde_json` does.
pub(crate) trait JsonSink: fmt::Write + Sized {
    /// Takes JSON syntax as it is.
    fn raw(&mut self, bytes: &[u8]);

    /// Takes row `row` of `cell`'s column (not null).
    fn cell(&mut self, cell: &CellWriter<'_>, row: usize) {
        cell.write(self, row);
    }
}

/// How many bytes each byte of a string's contents takes once escaped for JSON: two for a
/// quote, a backslash and the control characters with a short escape, six (`\u00XX`) for the
/// other control characters, one for the rest (UTF-8 goes as it is).
pub(crate) const ESCAPED_LEN: [u8; 256] = {
    let mut table = [1u8; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = 6;
        b += 1;
    }
    table[b'"' as usize] = 2;
    table[b'\\' as usize] = 2;
    table[0x08] = 2;
    table[0x0c] = 2;
    table[b'\n' as usize] = 2;
    table[b'\r' as usize] = 2;
    table[b'\t' as usize] = 2;
    table
};

/// A [`JsonSink`] that appends to a buffer.
pub(crate) struct JsonBuffer<'a>(pub(crate) &'a mut Vec<u8>);

impl fmt::Write for JsonBuffer<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        escape_into(self.0, s.as_bytes());
        Ok(())
    }
}

/// Appends `bytes` escaped as a JSON string's contents, as `serde_json` escapes them. Any
/// run of a string's bytes may be escaped on its own (UTF-8 goes through as it is), so a
/// long string can be written a part at a time.
pub(crate) fn escape_into(out: &mut Vec<u8>, bytes: &[u8]) {
    let mut plain = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if ESCAPED_LEN[usize::from(b)] == 1 {
            continue;
        }
        out.extend_from_slice(&bytes[plain..i]);
        plain = i + 1;
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            _ => {
                out.extend_from_slice(b"\\u00");
                out.push(HEX_DIGITS[usize::from(b >> 4)]);
                out.push(HEX_DIGITS[usize::from(b & 0xf)]);
            }
        }
    }
    out.extend_from_slice(&bytes[plain..]);
}

/// Appends `bytes` as lower-case hex.
pub(crate) fn hex_into(out: &mut Vec<u8>, bytes: &[u8]) {
    out.reserve(bytes.len() * 2);
    for b in bytes {
        out.push(HEX_DIGITS[usize::from(b >> 4)]);
        out.push(HEX_DIGITS[usize::from(b & 0xf)]);
    }
}

const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

impl JsonSink for JsonBuffer<'_> {
    fn raw(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
}

/// A [`JsonSink`] that only counts what [`JsonBuffer`] would append. It stops taking text
/// (a write fails) once the count passes its limit, so counting a huge value costs no
/// more than counting the limit.
pub(crate) struct JsonLength {
    /// Bytes counted.
    pub(crate) bytes: usize,
    /// The largest cell counted that is not text (one written whole, never in parts).
    pub(crate) largest_whole_cell: usize,
    limit: usize,
}

impl JsonLength {
    /// A count that stops taking text once it passes `limit`.
    pub(crate) fn up_to(limit: usize) -> Self {
        JsonLength {
            bytes: 0,
            largest_whole_cell: 0,
            limit,
        }
    }

    /// Whether the count passed its limit.
    pub(crate) fn over(&self) -> bool {
        self.bytes > self.limit
    }
}

impl fmt::Write for JsonLength {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let escaped: usize = s
            .as_bytes()
            .iter()
            .map(|&b| usize::from(ESCAPED_LEN[usize::from(b)]))
            .sum();
        self.bytes = self.bytes.saturating_add(escaped);
        if self.over() { Err(fmt::Error) } else { Ok(()) }
    }
}

impl JsonSink for JsonLength {
    fn raw(&mut self, bytes: &[u8]) {
        self.bytes = self.bytes.saturating_add(bytes.len());
    }

    fn cell(&mut self, cell: &CellWriter<'_>, row: usize) {
        // Past the limit nothing more is counted: the count's answer is known.
        if self.over() {
            return;
        }
        // Counted without being formatted where the length is known: a large numeric
        // result is counted at a few nanoseconds a value.
        if let Some(len) = cell.known_len(row) {
            self.bytes = self.bytes.saturating_add(len);
            return;
        }
        let before = self.bytes;
        cell.write(self, row);
        if cell.text(row).is_none() {
            self.largest_whole_cell = self.largest_whole_cell.max(self.bytes - before);
        }
    }
}

/// Writes row `row` of the columns `cells` write as the statements API's JSON row: an array
/// of the cells, each a string or `null`.
pub(crate) fn write_json_row(sink: &mut impl JsonSink, cells: &[CellWriter<'_>], row: usize) {
    sink.raw(b"[");
    for (i, cell) in cells.iter().enumerate() {
        if i > 0 {
            sink.raw(b",");
        }
        if cell.is_null(row) {
            sink.raw(b"null");
        } else {
            sink.raw(b"\"");
            sink.cell(cell, row);
            sink.raw(b"\"");
        }
    }
    sink.raw(b"]");
}

fn write_hex(out: &mut impl fmt::Write, bytes: &[u8]) -> fmt::Result {
    // In pieces of a small buffer: a large value is never built whole.
    let mut text = [0u8; 512];
    for piece in bytes.chunks(text.len() / 2) {
        for (i, b) in piece.iter().enumerate() {
            text[2 * i] = HEX_DIGITS[usize::from(b >> 4)];
            text[2 * i + 1] = HEX_DIGITS[usize::from(b & 0xf)];
        }
        // Hex digits are ASCII.
        out.write_str(std::str::from_utf8(&text[..2 * piece.len()]).map_err(|_| fmt::Error)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;
    use std::sync::Arc;

    use arrow_array::builder::{BooleanBuilder, ListBuilder};
    use arrow_array::{ArrayRef, DictionaryArray, StringArray, types::Int32Type};

    use super::*;

    /// Every byte a string can hold (each ASCII character, and UTF-8 beyond it).
    fn hostile_text() -> String {
        let mut text: String = (0u8..0x80).map(char::from).collect();
        text.push_str("é\u{2028}😀\\\"");
        text
    }

    #[test]
    fn strings_escape_as_serde_json_escapes_them_and_are_counted_exactly() {
        let text = hostile_text();
        let mut out = Vec::new();
        JsonBuffer(&mut out).write_str(&text).unwrap();
        let expected = serde_json::to_string(&text).unwrap();
        assert_eq!(
            String::from_utf8(out.clone()).unwrap(),
            expected[1..expected.len() - 1]
        );
        let mut count = JsonLength::up_to(usize::MAX);
        count.write_str(&text).unwrap();
        assert_eq!(count.bytes, out.len());
    }

    #[test]
    fn rows_render_as_json_arrays_of_cells_and_count_as_written() {
        let text = hostile_text();
        let strings: ArrayRef = Arc::new(StringArray::from(vec![Some(text.as_str()), None]));
        let mut list = ListBuilder::new(BooleanBuilder::new());
        list.values().append_slice(&[true, false, true]);
        list.append(true);
        list.append(false);
        let list: ArrayRef = Arc::new(list.finish());
        let keys = arrow_array::Int32Array::from(vec![0, 0]);
        let values: ArrayRef = Arc::new(StringArray::from(vec!["\u{1}\"x"]));
        let dictionary: ArrayRef =
            Arc::new(DictionaryArray::<Int32Type>::try_new(keys, values).unwrap());
        let ints: ArrayRef = Arc::new(arrow_array::Int64Array::from(vec![i64::MIN, -1]));
        let uints: ArrayRef = Arc::new(arrow_array::UInt64Array::from(vec![u64::MAX, 0]));
        let booleans: ArrayRef = Arc::new(arrow_array::BooleanArray::from(vec![false, true]));
        let columns = [strings, list, dictionary, ints, uints, booleans];
        let cells: Vec<CellWriter<'_>> = columns.iter().map(CellWriter::new).collect();
        for row in 0..2 {
            let mut out = Vec::new();
            write_json_row(&mut JsonBuffer(&mut out), &cells, row);
            let parsed: Vec<Option<String>> = serde_json::from_slice(&out).unwrap();
            let expected: Vec<Option<String>> =
                columns.iter().map(|c| format_cell(c, row)).collect();
            assert_eq!(parsed, expected);
            let mut count = JsonLength::up_to(usize::MAX);
            write_json_row(&mut count, &cells, row);
            assert_eq!(count.bytes, out.len(), "row {row}");
        }
        assert_eq!(
            format_cell(&columns[1], 0).as_deref(),
            Some("[true, false, true]")
        );
        // Null logically, without a null buffer of their own: `null`, not `""`.
        let none: ArrayRef = Arc::new(arrow_array::NullArray::new(1));
        let keys = arrow_array::Int32Array::from(vec![0]);
        let values: ArrayRef = Arc::new(StringArray::from(vec![None::<&str>]));
        let null_value: ArrayRef =
            Arc::new(DictionaryArray::<Int32Type>::try_new(keys, values).unwrap());
        for column in [none, null_value] {
            assert_eq!(format_cell(&column, 0), None);
            let cells = [CellWriter::new(&column)];
            let mut out = Vec::new();
            write_json_row(&mut JsonBuffer(&mut out), &cells, 0);
            assert_eq!(out, b"[null]");
        }
    }

    #[test]
    fn a_count_past_its_limit_counts_no_further_cell() {
        let text: ArrayRef = Arc::new(StringArray::from(vec!["x".repeat(100)]));
        let cells: Vec<CellWriter<'_>> = (0..3).map(|_| CellWriter::new(&text)).collect();
        let mut count = JsonLength::up_to(10);
        write_json_row(&mut count, &cells, 0);
        assert!(count.over());
        // The first cell, its quotes and the row's syntax; the others' text is not read.
        assert!(count.bytes < 130, "{}", count.bytes);
    }

    #[test]
    fn a_count_stops_taking_text_past_its_limit() {
        let mut count = JsonLength::up_to(10);
        assert!(count.write_str("0123456789").is_ok());
        assert!(!count.over());
        assert!(count.write_str("\u{1}").is_err());
        assert!(count.over());
    }
}
