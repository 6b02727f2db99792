//! Arrow rows back into the NDJSON form ingest reads, so that rows a statement produces
//! (`INSERT INTO t VALUES|SELECT`, ScopeQL's `INSERT INTO`) pass exactly the same column
//! checks as rows sent to the ingest endpoint: there is one decoder and one set of rules.
//!
//! Each value is written in the spelling the decoder accepts for the target column's type:
//! numbers and booleans as JSON literals, timestamps as RFC 3339 strings, intervals as
//! ISO 8601 durations, binary as base64, and text as a JSON string, except that text bound
//! for an `object`, `array` or `any` column is taken as the JSON text it holds, which must be
//! exactly one JSON value (it is checked before it is written, so it cannot spill into the
//! row around it).

use std::io::Write as _;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    DurationNanosecondType, Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type,
    Int64Type, TimestampNanosecondType, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_cast::display::{ArrayFormatter, FormatOptions};
use arrow_schema::{DataType, TimeUnit};

use crate::types::json::{Discard, Scanner};
use crate::types::number::format_float;
use crate::types::temporal::{write_interval, write_timestamp};
use crate::types::{ColumnType, encode_base64};

/// Where one source column goes: the table column's name and type.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The table column.
    pub name: String,
    /// Its type.
    pub data_type: ColumnType,
}

/// Why rows could not be written out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("column {column}: {message}")]
pub(crate) struct EncodeError {
    /// The table column.
    pub column: String,
    /// What is wrong.
    pub message: String,
}

/// Appends the rows of `batch` to `out` as NDJSON objects, source column `i` written as the
/// field `targets[i].name`. Nulls are written as `null`.
pub(crate) fn write_ndjson(
    batch: &RecordBatch,
    targets: &[Target],
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    let columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .zip(targets)
        .map(|(c, t)| normalize(c, t))
        .collect::<Result<_, _>>()?;
    let names: Vec<String> = targets
        .iter()
        .map(|t| serde_json::to_string(&t.name).unwrap_or_else(|_| "\"\"".into()))
        .collect();
    let mut text = String::new();
    for row in 0..batch.num_rows() {
        out.push(b'{');
        for (i, (column, target)) in columns.iter().zip(targets).enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(names[i].as_bytes());
            out.push(b':');
            text.clear();
            write_value(column, row, target, out, &mut text)?;
        }
        out.extend_from_slice(b"}\n");
    }
    Ok(())
}

/// Casts temporal columns of other units to nanoseconds, the unit the writers below know.
fn normalize(column: &ArrayRef, target: &Target) -> Result<ArrayRef, EncodeError> {
    let to = match column.data_type() {
        DataType::Timestamp(unit, tz) if *unit != TimeUnit::Nanosecond => {
            DataType::Timestamp(TimeUnit::Nanosecond, tz.clone())
        }
        DataType::Date32 | DataType::Date64 => {
            DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into()))
        }
        DataType::Duration(unit) if *unit != TimeUnit::Nanosecond => {
            DataType::Duration(TimeUnit::Nanosecond)
        }
        _ => return Ok(column.clone()),
    };
    arrow_cast::cast(column, &to).map_err(|e| EncodeError {
        column: target.name.clone(),
        message: e.to_string(),
    })
}

fn json_string(out: &mut Vec<u8>, s: &str) {
    // Serializing a str cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

fn write_value(
    column: &ArrayRef,
    row: usize,
    target: &Target,
    out: &mut Vec<u8>,
    text: &mut String,
) -> Result<(), EncodeError> {
    if column.is_null(row) {
        out.extend_from_slice(b"null");
        return Ok(());
    }
    let fail = |message: String| EncodeError {
        column: target.name.clone(),
        message,
    };
    macro_rules! int {
        ($t:ty) => {{
            let _ = write!(out, "{}", column.as_primitive::<$t>().value(row));
        }};
    }
    macro_rules! float {
        ($t:ty) => {{
            let v = f64::from(column.as_primitive::<$t>().value(row));
            if v.is_finite() {
                out.extend_from_slice(format_float(v).as_bytes());
            } else {
                // Not a JSON number: the decoder reports it as the wrong kind of value.
                json_string(out, &v.to_string());
            }
        }};
    }
    match column.data_type() {
        DataType::Boolean => {
            out.extend_from_slice(if column.as_boolean().value(row) {
                b"true"
            } else {
                b"false"
            });
        }
        DataType::Int8 => int!(Int8Type),
        DataType::Int16 => int!(Int16Type),
        DataType::Int32 => int!(Int32Type),
        DataType::Int64 => int!(Int64Type),
        DataType::UInt8 => int!(UInt8Type),
        DataType::UInt16 => int!(UInt16Type),
        DataType::UInt32 => int!(UInt32Type),
        DataType::UInt64 => int!(UInt64Type),
        DataType::Float16 => {
            let v = f64::from(column.as_primitive::<Float16Type>().value(row).to_f32());
            out.extend_from_slice(format_float(v).as_bytes());
        }
        DataType::Float32 => float!(Float32Type),
        DataType::Float64 => float!(Float64Type),
        DataType::Decimal32(..)
        | DataType::Decimal64(..)
        | DataType::Decimal128(..)
        | DataType::Decimal256(..) => {
            let formatter = ArrayFormatter::try_new(column.as_ref(), &FormatOptions::default())
                .map_err(|e| fail(e.to_string()))?;
            let _ = write!(out, "{}", formatter.value(row));
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
            let s = match column.data_type() {
                DataType::Utf8 => column.as_string::<i32>().value(row),
                DataType::LargeUtf8 => column.as_string::<i64>().value(row),
                _ => column.as_string_view().value(row),
            };
            if target.data_type.is_json() {
                check_one_json_value(s).map_err(fail)?;
                out.extend_from_slice(s.as_bytes());
            } else {
                json_string(out, s);
            }
        }
        DataType::Timestamp(TimeUnit::Nanosecond, _) => {
            write_timestamp(
                text,
                column.as_primitive::<TimestampNanosecondType>().value(row),
            );
            json_string(out, text);
        }
        DataType::Duration(TimeUnit::Nanosecond) => {
            write_interval(
                text,
                column.as_primitive::<DurationNanosecondType>().value(row),
            );
            json_string(out, text);
        }
        DataType::Binary => json_string(out, &encode_base64(column.as_binary::<i32>().value(row))),
        DataType::LargeBinary => {
            json_string(out, &encode_base64(column.as_binary::<i64>().value(row)));
        }
        DataType::BinaryView => {
            json_string(out, &encode_base64(column.as_binary_view().value(row)));
        }
        DataType::FixedSizeBinary(_) => {
            json_string(
                out,
                &encode_base64(column.as_fixed_size_binary().value(row)),
            );
        }
        DataType::Null => out.extend_from_slice(b"null"),
        other => {
            return Err(fail(format!(
                "values of type {other} cannot be inserted; cast them to a sluice type"
            )));
        }
    }
    Ok(())
}

/// Checks that `s` is exactly one JSON value (surrounding whitespace allowed).
fn check_one_json_value(s: &str) -> Result<(), String> {
    let mut scanner = Scanner::new(s.as_bytes());
    scanner.skip_ws();
    scanner
        .value(&mut Discard, 0)
        .map_err(|e| format!("not JSON text: {e}"))?;
    scanner.skip_ws();
    if scanner.pos() != s.len() {
        return Err("not JSON text: more than one value".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{Int32Array, StringArray};
    use arrow_schema::{Field, Schema};

    use super::*;

    #[test]
    fn text_for_json_columns_is_one_value_or_refused() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int32, true),
            Field::new("o", DataType::Utf8, true),
        ]));
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int32Array::from(vec![Some(1), None])),
                Arc::new(StringArray::from(vec![Some("{\"k\": [1]}"), None])),
            ],
        )
        .unwrap();
        let targets = [
            Target {
                name: "a".into(),
                data_type: ColumnType::Int,
            },
            Target {
                name: "o".into(),
                data_type: ColumnType::Object,
            },
        ];
        let mut out = Vec::new();
        write_ndjson(&batch, &targets, &mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"a\":1,\"o\":{\"k\": [1]}}\n{\"a\":null,\"o\":null}\n"
        );
        // Text that would close the object and add a field of its own is refused.
        let sneaky = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("o", DataType::Utf8, true)])),
            vec![Arc::new(StringArray::from(vec!["1, \"a\": 2"]))],
        )
        .unwrap();
        let err = write_ndjson(&sneaky, &targets[1..], &mut Vec::new()).unwrap_err();
        assert_eq!(err.column, "o");
    }
}
