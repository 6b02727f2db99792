//! Column types and the checks every value of each type must pass.
//!
//! A sluice table column has one of eleven types (`int uint float boolean string timestamp
//! interval binary object array any`). This module maps each to its Arrow form, records the
//! sluice type in the Arrow field metadata (so it survives Parquet round trips), and holds the
//! value rules of the ingest contract as small pure functions that the decoder, the statements
//! API and the tests share.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};

pub mod cell;
pub mod json;
pub mod number;
pub mod temporal;

/// Arrow field metadata key holding a column's sluice type name.
pub(crate) const SLUICE_TYPE_KEY: &str = "sluice.type";
/// Arrow field metadata key of the canonical extension type name.
pub(crate) const EXTENSION_NAME_KEY: &str = "ARROW:extension:name";
/// Arrow field metadata key of the canonical extension type's metadata.
pub(crate) const EXTENSION_METADATA_KEY: &str = "ARROW:extension:metadata";
/// The canonical Arrow extension type for UTF-8 columns that hold JSON text.
pub(crate) const JSON_EXTENSION_NAME: &str = "arrow.json";

/// The type of a table column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ColumnType {
    /// Signed 64-bit integer.
    Int,
    /// Unsigned 64-bit integer (ingest accepts `0..=i64::MAX`).
    UInt,
    /// 64-bit IEEE 754 float, always finite.
    Float,
    /// `true` or `false`.
    Boolean,
    /// UTF-8 text.
    String,
    /// An instant, nanoseconds since the Unix epoch in UTC.
    Timestamp,
    /// A fixed duration in nanoseconds.
    Interval,
    /// Bytes (base64 in JSON input).
    Binary,
    /// A JSON object.
    Object,
    /// A JSON array.
    Array,
    /// Any JSON value.
    Any,
}

impl ColumnType {
    /// Every column type, in the contract's order.
    pub const ALL: [ColumnType; 11] = [
        ColumnType::Int,
        ColumnType::UInt,
        ColumnType::Float,
        ColumnType::Boolean,
        ColumnType::String,
        ColumnType::Timestamp,
        ColumnType::Interval,
        ColumnType::Binary,
        ColumnType::Object,
        ColumnType::Array,
        ColumnType::Any,
    ];

    /// The type's name as the catalog and the statements API spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            ColumnType::Int => "int",
            ColumnType::UInt => "uint",
            ColumnType::Float => "float",
            ColumnType::Boolean => "boolean",
            ColumnType::String => "string",
            ColumnType::Timestamp => "timestamp",
            ColumnType::Interval => "interval",
            ColumnType::Binary => "binary",
            ColumnType::Object => "object",
            ColumnType::Array => "array",
            ColumnType::Any => "any",
        }
    }

    /// Whether values of this type are stored as JSON text.
    pub fn is_json(self) -> bool {
        matches!(
            self,
            ColumnType::Object | ColumnType::Array | ColumnType::Any
        )
    }

    /// The Arrow data type that holds this column.
    pub fn arrow_type(self) -> DataType {
        match self {
            ColumnType::Int => DataType::Int64,
            ColumnType::UInt => DataType::UInt64,
            ColumnType::Float => DataType::Float64,
            ColumnType::Boolean => DataType::Boolean,
            ColumnType::String | ColumnType::Object | ColumnType::Array | ColumnType::Any => {
                DataType::Utf8
            }
            ColumnType::Timestamp => DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
            ColumnType::Interval => DataType::Duration(TimeUnit::Nanosecond),
            ColumnType::Binary => DataType::Binary,
        }
    }

    /// A nullable Arrow field for a column of this type, with the sluice type (and for JSON
    /// columns the `arrow.json` extension type) in its metadata.
    pub fn arrow_field(self, name: &str) -> Field {
        let mut metadata = HashMap::from([(SLUICE_TYPE_KEY.to_owned(), self.as_str().to_owned())]);
        if self.is_json() {
            metadata.insert(
                EXTENSION_NAME_KEY.to_owned(),
                JSON_EXTENSION_NAME.to_owned(),
            );
            metadata.insert(EXTENSION_METADATA_KEY.to_owned(), "{}".to_owned());
        }
        Field::new(name, self.arrow_type(), true).with_metadata(metadata)
    }

    /// Reads a column's sluice type back from its Arrow field metadata.
    pub fn from_field(field: &Field) -> Option<ColumnType> {
        field.metadata().get(SLUICE_TYPE_KEY)?.parse().ok()
    }
}

impl fmt::Display for ColumnType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A type name that is not one of sluice's column types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown column type {name:?}; expected one of int, uint, float, boolean, string, timestamp, interval, binary, object, array, any"
)]
pub struct UnknownTypeError {
    /// The name that was given.
    pub name: String,
}

impl FromStr for ColumnType {
    type Err = UnknownTypeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        ColumnType::ALL
            .into_iter()
            .find(|t| t.as_str() == lower)
            .ok_or_else(|| UnknownTypeError { name: s.to_owned() })
    }
}

/// One column of a table as the ingest path sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Column name, matched exactly against NDJSON field names.
    pub name: String,
    /// Column type.
    pub data_type: ColumnType,
    /// A computed column is filled by the server; input must omit it.
    pub computed: bool,
}

impl Column {
    /// An ordinary (input) column.
    pub fn new(name: impl Into<String>, data_type: ColumnType) -> Self {
        Column {
            name: name.into(),
            data_type,
            computed: false,
        }
    }

    /// A computed column, which ingest input must omit.
    pub fn computed(name: impl Into<String>, data_type: ColumnType) -> Self {
        Column {
            computed: true,
            ..Column::new(name, data_type)
        }
    }
}

/// The Arrow schema of these columns, in order.
pub(crate) fn arrow_schema<'a>(columns: impl IntoIterator<Item = &'a Column>) -> SchemaRef {
    let fields: Vec<Field> = columns
        .into_iter()
        .map(|c| c.data_type.arrow_field(&c.name))
        .collect();
    Arc::new(Schema::new(fields))
}

/// Why a JSON value does not fit its column.
///
/// The `Display` text says what was wrong and what was expected; it becomes the `message` of a
/// row error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ValueError {
    /// The JSON kind of the value is not one the column accepts.
    #[error("expected {expected}, found {found}")]
    WrongKind {
        /// What the column accepts.
        expected: &'static str,
        /// The JSON kind that was given.
        found: &'static str,
    },
    /// An int or uint column got a number token with a fraction or an exponent.
    #[error(
        "expected an integer token, found {token:?} (decimal points and exponents are not accepted)"
    )]
    NotAnIntegerToken {
        /// The token as written.
        token: String,
    },
    /// An integer token outside the column's range.
    #[error("integer {token} is out of range {min}..={max}")]
    IntegerOutOfRange {
        /// The token as written.
        token: String,
        /// Smallest accepted value.
        min: i128,
        /// Largest accepted value.
        max: i128,
    },
    /// A float token that is not finite as a 64-bit float, or underflows to zero.
    #[error("float {token} {problem}")]
    FloatNotRepresentable {
        /// The token as written.
        token: String,
        /// What went wrong.
        problem: &'static str,
    },
    /// A timestamp string that is not RFC 3339 or does not fit.
    #[error(
        "invalid timestamp {text:?}: {problem}; expected RFC 3339 such as \"2026-10-23T09:00:00Z\""
    )]
    InvalidTimestamp {
        /// The string value.
        text: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// An interval string that is not a fixed ISO 8601 duration or does not fit.
    #[error(
        "invalid interval {text:?}: {problem}; expected an ISO 8601 duration of hours, minutes and seconds such as \"PT1H2M3.5S\""
    )]
    InvalidInterval {
        /// The string value.
        text: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// A binary string that is not canonical padded standard base64.
    #[error(
        "invalid binary value: {problem}; expected canonical padded standard base64 such as \"aGVsbG8=\""
    )]
    InvalidBase64 {
        /// What is wrong with it.
        problem: String,
    },
    /// A string with an escaped lone surrogate, which UTF-8 cannot hold.
    #[error(
        "string contains an unpaired surrogate escape \\u{code:04X}, which cannot be stored as UTF-8"
    )]
    UnpairedSurrogate {
        /// The surrogate code unit.
        code: u16,
    },
    /// The value is not valid JSON, or breaks a rule for nested JSON.
    #[error("{0}")]
    Json(#[from] json::JsonError),
}

/// Decodes a binary column's value, canonical, padded, standard-alphabet base64, into
/// `out`, appending.
///
/// Non-canonical trailing bits, missing padding and the URL-safe alphabet are rejected.
pub(crate) fn decode_base64_into(text: &[u8], out: &mut Vec<u8>) -> Result<(), ValueError> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode_vec(text, out)
        .map_err(|e| ValueError::InvalidBase64 {
            problem: e.to_string(),
        })
}

/// Encodes bytes as canonical padded standard base64.
pub fn encode_base64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Arrow field metadata key of a column's id (see [`crate::catalog`]'s column ids): the
/// Parquet writer stores it as the file schema's field id, which Iceberg readers map by.
pub(crate) const FIELD_ID_KEY: &str = "PARQUET:field_id";

/// The Arrow schema of these columns, in order, each field carrying its column id
/// ([`FIELD_ID_KEY`]).
pub(crate) fn arrow_schema_with_ids<'a>(
    columns: impl IntoIterator<Item = &'a Column>,
    ids: &[i32],
) -> SchemaRef {
    let fields: Vec<Field> = columns
        .into_iter()
        .zip(ids)
        .map(|(c, id)| with_field_id(c.data_type.arrow_field(&c.name), *id))
        .collect();
    Arc::new(Schema::new(fields))
}

/// `field` carrying column id `id`.
pub(crate) fn with_field_id(field: Field, id: i32) -> Field {
    let mut metadata = field.metadata().clone();
    metadata.insert(FIELD_ID_KEY.to_owned(), id.to_string());
    field.with_metadata(metadata)
}

/// The column ids of a schema's fields: each field's [`FIELD_ID_KEY`], or for a field
/// without one (written before ids existed, when a table's columns never changed) its
/// position from 1.
pub(crate) fn field_ids(schema: &Schema) -> Vec<i32> {
    schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            f.metadata()
                .get(FIELD_ID_KEY)
                .and_then(|id| id.parse().ok())
                .unwrap_or_else(|| i32::try_from(i + 1).unwrap_or(i32::MAX))
        })
        .collect()
}

/// `batch` (written under any earlier shape of its table) read as `target`, column by id
/// ([`field_ids`]): a column `batch` lacks (added since) is NULL, a column `target` lacks
/// (dropped since) is left out, a renamed one keeps its values; a column whose type differs
/// only in representation (a string as a view, an interval as `Int64`) is cast.
pub(crate) fn project_by_id(
    batch: &arrow_array::RecordBatch,
    target: &SchemaRef,
) -> Result<arrow_array::RecordBatch, arrow_schema::ArrowError> {
    let source = field_ids(batch.schema_ref());
    let columns = target
        .fields()
        .iter()
        .zip(field_ids(target))
        .map(|(field, id)| match source.iter().position(|s| *s == id) {
            Some(i) => {
                let column = batch.column(i);
                if column.data_type() == field.data_type() {
                    Ok(column.clone())
                } else {
                    arrow_cast::cast(column, field.data_type())
                }
            }
            None => Ok(arrow_array::new_null_array(
                field.data_type(),
                batch.num_rows(),
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    arrow_array::RecordBatch::try_new_with_options(
        target.clone(),
        columns,
        &arrow_array::RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_read_by_column_id() {
        use arrow_array::{Array as _, Int64Array, RecordBatch, StringArray};
        let old = arrow_schema_with_ids(
            &[
                Column::new("a", ColumnType::Int),
                Column::new("b", ColumnType::String),
            ],
            &[1, 2],
        );
        let batch = RecordBatch::try_new(
            old,
            vec![
                Arc::new(Int64Array::from(vec![1, 2])),
                Arc::new(StringArray::from(vec!["x", "y"])),
            ],
        )
        .unwrap();
        // a renamed to a2; b dropped, and a new b (id 3) of another type.
        let now = arrow_schema_with_ids(
            &[
                Column::new("b", ColumnType::Int),
                Column::new("a2", ColumnType::Int),
            ],
            &[3, 1],
        );
        let read = project_by_id(&batch, &now).unwrap();
        assert_eq!(read.schema(), now);
        assert_eq!(read.column(0).null_count(), 2);
        assert_eq!(
            read.column(1).as_ref(),
            &Int64Array::from(vec![1, 2]) as &dyn arrow_array::Array
        );
    }

    #[test]
    fn base64_must_be_canonical_padded_and_standard() {
        let decode = |text: &str| {
            let mut out = Vec::new();
            decode_base64_into(text.as_bytes(), &mut out).map(|()| out)
        };
        assert_eq!(decode("aGVsbG8=").unwrap(), b"hello");
        assert!(decode("aGVsbG8").is_err(), "padding missing");
        assert!(decode("aGVsbG9=").is_err(), "non-zero trailing bits");
        assert!(decode("_-8=").is_err(), "URL-safe alphabet");
        assert_eq!(encode_base64(b"hello"), "aGVsbG8=");
    }
}
