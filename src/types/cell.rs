//! The statements API's cell form: every value as a JSON string, or null.
//!
//! Numbers and booleans print as text, timestamps as RFC 3339 in UTC, intervals as ISO 8601
//! durations, JSON columns as their stored JSON text and binary as lower-case hex.

use std::fmt::Write as _;

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
    if array.is_null(row) {
        return None;
    }
    let mut out = String::new();
    match array.data_type() {
        DataType::Int64 => {
            let _ = write!(out, "{}", array.as_primitive::<Int64Type>().value(row));
        }
        DataType::UInt64 => {
            let _ = write!(out, "{}", array.as_primitive::<UInt64Type>().value(row));
        }
        DataType::Float64 => out = format_float(array.as_primitive::<Float64Type>().value(row)),
        DataType::Boolean => {
            out.push_str(if array.as_boolean().value(row) {
                "true"
            } else {
                "false"
            });
        }
        DataType::Utf8 => out.push_str(array.as_string::<i32>().value(row)),
        DataType::LargeUtf8 => out.push_str(array.as_string::<i64>().value(row)),
        DataType::Utf8View => out.push_str(array.as_string_view().value(row)),
        DataType::Timestamp(TimeUnit::Nanosecond, _) => write_timestamp(
            &mut out,
            array.as_primitive::<TimestampNanosecondType>().value(row),
        ),
        DataType::Duration(TimeUnit::Nanosecond) => write_interval(
            &mut out,
            array.as_primitive::<DurationNanosecondType>().value(row),
        ),
        DataType::Binary => write_hex(&mut out, array.as_binary::<i32>().value(row)),
        DataType::LargeBinary => write_hex(&mut out, array.as_binary::<i64>().value(row)),
        DataType::BinaryView => write_hex(&mut out, array.as_binary_view().value(row)),
        _ => {
            // Types outside sluice's mapping (query results can produce them, such as Int32
            // from SQL literals) print through Arrow's own display.
            let formatter = ArrayFormatter::try_new(array.as_ref(), &FormatOptions::default());
            match formatter {
                Ok(f) => {
                    let _ = write!(out, "{}", f.value(row));
                }
                Err(e) => out = format!("<{e}>"),
            }
        }
    }
    Some(out)
}

fn write_hex(out: &mut String, bytes: &[u8]) {
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
}
