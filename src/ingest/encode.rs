//! Arrow rows back into the NDJSON form ingest reads, so that rows a statement produces
//! (`INSERT INTO t VALUES|SELECT`, ScopeQL's `INSERT INTO`) pass exactly the same column
//! checks as rows sent to the ingest endpoint: there is one decoder and one set of rules.
//!
//! Each value is written in the spelling the decoder accepts for the target column's type:
//! numbers and booleans as JSON literals, timestamps and dates of any unit as RFC 3339 strings
//! (an instant or duration outside nanoseconds' range is refused, never rounded, wrapped or
//! made NULL, as arrow's casts would), intervals as
//! ISO 8601 durations (SQL intervals too, a day counted as 24 hours; months, which have no
//! fixed length, are refused), binary as base64, and text as a JSON string, except that text
//! bound for an `object`, `array` or `any` column is taken as the JSON text it holds, which
//! must be exactly one JSON value (it is checked before it is written, so it cannot spill
//! into the row around it), and text bound for a `binary` column is its UTF-8 bytes, as SQL
//! casts it. Bytes go only into `binary` columns; non-finite floats are written so that the
//! decoder refuses them.

use std::io::Write as _;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Date32Type, Date64Type, DurationMicrosecondType, DurationMillisecondType,
    DurationNanosecondType, DurationSecondType, Float16Type, Float32Type, Float64Type, Int8Type,
    Int16Type, Int32Type, Int64Type, IntervalDayTimeType, IntervalMonthDayNanoType,
    TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType,
    TimestampSecondType, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_cast::display::{ArrayFormatter, FormatOptions};
use arrow_schema::{DataType, IntervalUnit, TimeUnit};

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

/// Why a value could not be written out: the row (counted over all batches of one call) and
/// column, as ingest reports a row error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("row {row}, column {column}: {message}")]
pub(crate) struct EncodeError {
    /// Zero-based index of the row among the rows written by this call.
    pub row: usize,
    /// The table column.
    pub column: String,
    /// What is wrong.
    pub message: String,
}

/// A value that cannot be written is refused as a row, as ingest refuses one.
impl From<EncodeError> for super::IngestError {
    fn from(e: EncodeError) -> Self {
        super::IngestError::InvalidRows(super::RowErrors {
            errors: vec![super::RowError {
                row_index: e.row,
                column: Some(e.column),
                message: e.message,
            }],
            truncated: false,
        })
    }
}

/// Appends the rows of `batch` to `out` as NDJSON objects, source column `i` written as the
/// field `targets[i].name`. Nulls are written as `null`. `first_row` is the index of the
/// batch's first row among all rows being written (for errors).
pub(crate) fn write_ndjson(
    batch: &RecordBatch,
    targets: &[Target],
    first_row: usize,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    let names: Vec<String> = targets
        .iter()
        .map(|t| serde_json::to_string(&t.name).unwrap_or_else(|_| "\"\"".into()))
        .collect();
    // Dictionary-encoded columns are written as their values.
    let columns: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .zip(targets)
        .map(|(column, target)| match column.data_type() {
            DataType::Dictionary(_, values) => {
                arrow_cast::cast(column, values).map_err(|e| EncodeError {
                    row: first_row,
                    column: target.name.clone(),
                    message: e.to_string(),
                })
            }
            _ => Ok(column.clone()),
        })
        .collect::<Result<_, _>>()?;
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
            write_value(column, row, target, out, &mut text).map_err(|message| EncodeError {
                row: first_row + row,
                column: target.name.clone(),
                message,
            })?;
        }
        out.extend_from_slice(b"}\n");
    }
    Ok(())
}

/// `value * factor`, or an error saying the instant or duration is out of range (arrow's
/// casts return NULL or, for `Date64`, overflow unchecked; a value is never changed here).
fn scaled(value: i64, factor: i64) -> Result<i64, String> {
    value
        .checked_mul(factor)
        .ok_or_else(|| "out of the range of nanoseconds since 1970 (years 1677 to 2262)".into())
}

/// Nanoseconds per unit.
fn nanos_per(unit: TimeUnit) -> i64 {
    match unit {
        TimeUnit::Second => 1_000_000_000,
        TimeUnit::Millisecond => 1_000_000,
        TimeUnit::Microsecond => 1_000,
        TimeUnit::Nanosecond => 1,
    }
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
) -> Result<(), String> {
    if column.is_null(row) {
        out.extend_from_slice(b"null");
        return Ok(());
    }
    macro_rules! int {
        ($t:ty) => {{
            let _ = write!(out, "{}", column.as_primitive::<$t>().value(row));
        }};
    }
    macro_rules! float {
        ($v:expr) => {{
            let v: f64 = $v;
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
        DataType::Float16 => float!(f64::from(
            column.as_primitive::<Float16Type>().value(row).to_f32()
        )),
        DataType::Float32 => float!(f64::from(column.as_primitive::<Float32Type>().value(row))),
        DataType::Float64 => float!(column.as_primitive::<Float64Type>().value(row)),
        DataType::Decimal32(..)
        | DataType::Decimal64(..)
        | DataType::Decimal128(..)
        | DataType::Decimal256(..) => {
            let formatter = ArrayFormatter::try_new(column.as_ref(), &FormatOptions::default())
                .map_err(|e| e.to_string())?;
            let _ = std::fmt::Write::write_fmt(text, format_args!("{}", formatter.value(row)));
            // `6.00` is the integer 6, as a float 6.0 is written `6`: trailing zeros of the
            // scale say nothing about the value.
            let value = if text.contains('.') {
                text.trim_end_matches('0').trim_end_matches('.')
            } else {
                text.as_str()
            };
            out.extend_from_slice(value.as_bytes());
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
            let s = match column.data_type() {
                DataType::Utf8 => column.as_string::<i32>().value(row),
                DataType::LargeUtf8 => column.as_string::<i64>().value(row),
                _ => column.as_string_view().value(row),
            };
            if target.data_type.is_json() {
                check_one_json_value(s)?;
                out.extend_from_slice(s.as_bytes());
            } else if target.data_type == ColumnType::Binary {
                // Text cast to bytes is its UTF-8, as SQL casts it (not base64 it may hold).
                json_string(out, &encode_base64(s.as_bytes()));
            } else {
                json_string(out, s);
            }
        }
        DataType::Timestamp(unit, _) => {
            let v = match unit {
                TimeUnit::Second => column.as_primitive::<TimestampSecondType>().value(row),
                TimeUnit::Millisecond => {
                    column.as_primitive::<TimestampMillisecondType>().value(row)
                }
                TimeUnit::Microsecond => {
                    column.as_primitive::<TimestampMicrosecondType>().value(row)
                }
                TimeUnit::Nanosecond => column.as_primitive::<TimestampNanosecondType>().value(row),
            };
            write_timestamp(text, scaled(v, nanos_per(*unit))?);
            json_string(out, text);
        }
        DataType::Date32 => {
            let days = i64::from(column.as_primitive::<Date32Type>().value(row));
            write_timestamp(text, scaled(days, 86_400_000_000_000)?);
            json_string(out, text);
        }
        DataType::Date64 => {
            let millis = column.as_primitive::<Date64Type>().value(row);
            write_timestamp(text, scaled(millis, 1_000_000)?);
            json_string(out, text);
        }
        DataType::Duration(unit) => {
            let v = match unit {
                TimeUnit::Second => column.as_primitive::<DurationSecondType>().value(row),
                TimeUnit::Millisecond => {
                    column.as_primitive::<DurationMillisecondType>().value(row)
                }
                TimeUnit::Microsecond => {
                    column.as_primitive::<DurationMicrosecondType>().value(row)
                }
                TimeUnit::Nanosecond => column.as_primitive::<DurationNanosecondType>().value(row),
            };
            write_interval(text, scaled(v, nanos_per(*unit))?);
            json_string(out, text);
        }
        DataType::Interval(IntervalUnit::MonthDayNano | IntervalUnit::DayTime) => {
            let (months, days, nanos) = match column.data_type() {
                DataType::Interval(IntervalUnit::MonthDayNano) => {
                    let v = column.as_primitive::<IntervalMonthDayNanoType>().value(row);
                    (v.months, v.days, v.nanoseconds)
                }
                _ => {
                    let v = column.as_primitive::<IntervalDayTimeType>().value(row);
                    (0, v.days, i64::from(v.milliseconds) * 1_000_000)
                }
            };
            // A month has no fixed length; a day of UTC has (sluice intervals are durations).
            if months != 0 {
                return Err(
                    "an interval of months has no fixed length; write it in days or less".into(),
                );
            }
            let nanos = i64::from(days)
                .checked_mul(86_400_000_000_000)
                .and_then(|d| d.checked_add(nanos))
                .ok_or_else(|| "the interval is out of range".to_owned())?;
            write_interval(text, nanos);
            json_string(out, text);
        }
        DataType::Binary
        | DataType::LargeBinary
        | DataType::BinaryView
        | DataType::FixedSizeBinary(_) => {
            if target.data_type != ColumnType::Binary {
                return Err(format!(
                    "bytes cannot be inserted into a {} column; convert them first",
                    target.data_type
                ));
            }
            let bytes = match column.data_type() {
                DataType::Binary => column.as_binary::<i32>().value(row),
                DataType::LargeBinary => column.as_binary::<i64>().value(row),
                DataType::BinaryView => column.as_binary_view().value(row),
                _ => column.as_fixed_size_binary().value(row),
            };
            json_string(out, &encode_base64(bytes));
        }
        DataType::Null => out.extend_from_slice(b"null"),
        other => {
            return Err(format!(
                "values of type {other} cannot be inserted; cast them to a sluice type"
            ));
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
        write_ndjson(&batch, &targets, 0, &mut out).unwrap();
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
        let err = write_ndjson(&sneaky, &targets[1..], 0, &mut Vec::new()).unwrap_err();
        assert_eq!(err.column, "o");
    }

    fn one_column(array: ArrayRef, data_type: ColumnType) -> Result<String, EncodeError> {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "c",
            array.data_type().clone(),
            true,
        )]));
        let batch = RecordBatch::try_new(schema, vec![array]).unwrap();
        let target = Target {
            name: "c".into(),
            data_type,
        };
        let mut out = Vec::new();
        write_ndjson(&batch, &[target], 0, &mut out)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn values_are_written_as_sql_casts_them_or_refused() {
        use arrow_array::types::IntervalMonthDayNano;
        use arrow_array::{BinaryArray, Float64Array, IntervalMonthDayNanoArray};
        // Text bound for bytes is its UTF-8, not base64 it may hold.
        let text = Arc::new(StringArray::from(vec!["hi"]));
        assert_eq!(
            one_column(text, ColumnType::Binary).unwrap(),
            "{\"c\":\"aGk=\"}\n"
        );
        // Bytes go only into a binary column.
        let bytes: ArrayRef = Arc::new(BinaryArray::from(vec![&b"hi"[..]]));
        assert_eq!(
            one_column(bytes.clone(), ColumnType::Binary).unwrap(),
            "{\"c\":\"aGk=\"}\n"
        );
        assert!(one_column(bytes, ColumnType::String).is_err());
        // SQL's intervals of days and less are durations; months are refused.
        let day = IntervalMonthDayNano::new(0, 1, 1_000_000_000);
        let interval = Arc::new(IntervalMonthDayNanoArray::from(vec![day]));
        assert_eq!(
            one_column(interval, ColumnType::Interval).unwrap(),
            "{\"c\":\"PT24H1S\"}\n"
        );
        let month = Arc::new(IntervalMonthDayNanoArray::from(vec![
            IntervalMonthDayNano::new(1, 0, 0),
        ]));
        assert!(one_column(month, ColumnType::Interval).is_err());
        // A half-precision NaN is not written as a number.
        let nan = Arc::new(Float64Array::from(vec![f64::NAN])) as ArrayRef;
        let nan = arrow_cast::cast(&nan, &DataType::Float16).unwrap();
        assert_eq!(
            one_column(nan, ColumnType::Float).unwrap(),
            "{\"c\":\"NaN\"}\n"
        );
    }

    #[test]
    fn decimals_lose_their_trailing_zeros_and_dictionaries_their_keys() {
        use arrow_array::{Decimal128Array, DictionaryArray, types::Int32Type};
        let decimals = Decimal128Array::from(vec![600, 150, -10, 0])
            .with_precision_and_scale(10, 2)
            .unwrap();
        assert_eq!(
            one_column(Arc::new(decimals), ColumnType::Float).unwrap(),
            "{\"c\":6}\n{\"c\":1.5}\n{\"c\":-0.1}\n{\"c\":0}\n"
        );
        let dictionary: DictionaryArray<Int32Type> = vec!["x", "y", "x"].into_iter().collect();
        assert_eq!(
            one_column(Arc::new(dictionary), ColumnType::String).unwrap(),
            "{\"c\":\"x\"}\n{\"c\":\"y\"}\n{\"c\":\"x\"}\n"
        );
    }

    #[test]
    fn instants_and_durations_beyond_nanoseconds_are_refused_not_changed() {
        use arrow_array::{
            Date32Array, Date64Array, DurationSecondArray, TimestampMillisecondArray,
            TimestampSecondArray,
        };
        // Year 3000 as days, milliseconds and seconds; 10^10 seconds as a duration.
        let far: Vec<ArrayRef> = vec![
            Arc::new(Date32Array::from(vec![376_200])),
            Arc::new(Date64Array::from(vec![32_503_680_000_000])),
            Arc::new(TimestampSecondArray::from(vec![32_503_680_000])),
            Arc::new(TimestampMillisecondArray::from(vec![32_503_680_000_000])),
        ];
        for array in far {
            let err = one_column(array, ColumnType::Timestamp).unwrap_err();
            assert!(err.message.contains("out of the range"), "{err}");
        }
        let long = Arc::new(DurationSecondArray::from(vec![10_000_000_000]));
        assert!(one_column(long, ColumnType::Interval).is_err());
        // Within range, every unit is exact.
        let day = Arc::new(Date64Array::from(vec![86_400_000]));
        assert_eq!(
            one_column(day, ColumnType::Timestamp).unwrap(),
            "{\"c\":\"1970-01-02T00:00:00Z\"}\n"
        );
        // Errors name the row among all rows written.
        let schema = Arc::new(Schema::new(vec![Field::new("c", DataType::Date64, true)]));
        let batch =
            RecordBatch::try_new(schema, vec![Arc::new(Date64Array::from(vec![0, i64::MAX]))])
                .unwrap();
        let target = Target {
            name: "c".into(),
            data_type: ColumnType::Timestamp,
        };
        let err = write_ndjson(&batch, &[target], 10, &mut Vec::new()).unwrap_err();
        assert_eq!((err.row, err.column.as_str()), (11, "c"));
    }
}
