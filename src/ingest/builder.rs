//! Column builders: plain vectors the decoder appends checked values to, turned into Arrow
//! arrays at the end without copying.

use std::sync::Arc;

use arrow_array::{
    ArrayRef, BinaryArray, BooleanArray, DurationNanosecondArray, Float64Array, Int64Array,
    StringArray, TimestampNanosecondArray, UInt64Array,
};
use arrow_buffer::{BooleanBufferBuilder, Buffer, NullBufferBuilder, OffsetBuffer, ScalarBuffer};

use crate::types::ColumnType;

/// The values of one column, by storage shape.
pub(super) enum Values {
    Int(Vec<i64>),
    UInt(Vec<u64>),
    Float(Vec<f64>),
    Boolean(BooleanBufferBuilder),
    Timestamp(Vec<i64>),
    Interval(Vec<i64>),
    /// UTF-8 text: `string` and the JSON types.
    Text {
        offsets: Vec<i32>,
        data: Vec<u8>,
    },
    Binary {
        offsets: Vec<i32>,
        data: Vec<u8>,
    },
}

/// One column being built: values plus validity.
pub(super) struct ColumnBuilder {
    pub(super) values: Values,
    nulls: NullBufferBuilder,
}

impl ColumnBuilder {
    /// A builder sized for about `rows` rows and `bytes` bytes of variable-width data.
    pub(super) fn new(data_type: ColumnType, rows: usize, bytes: usize) -> Self {
        let offsets = || {
            let mut o = Vec::with_capacity(rows + 1);
            o.push(0);
            o
        };
        let values = match data_type {
            ColumnType::Int => Values::Int(Vec::with_capacity(rows)),
            ColumnType::UInt => Values::UInt(Vec::with_capacity(rows)),
            ColumnType::Float => Values::Float(Vec::with_capacity(rows)),
            ColumnType::Boolean => Values::Boolean(BooleanBufferBuilder::new(rows)),
            ColumnType::Timestamp => Values::Timestamp(Vec::with_capacity(rows)),
            ColumnType::Interval => Values::Interval(Vec::with_capacity(rows)),
            ColumnType::String | ColumnType::Object | ColumnType::Array | ColumnType::Any => {
                Values::Text {
                    offsets: offsets(),
                    data: Vec::with_capacity(bytes),
                }
            }
            ColumnType::Binary => Values::Binary {
                offsets: offsets(),
                data: Vec::with_capacity(bytes),
            },
        };
        ColumnBuilder {
            values,
            nulls: NullBufferBuilder::new(rows),
        }
    }

    /// Marks the value just appended as valid.
    #[inline]
    pub(super) fn valid(&mut self) {
        self.nulls.append_non_null();
    }

    /// Appends SQL NULL.
    #[inline]
    pub(super) fn push_null(&mut self) {
        match &mut self.values {
            Values::Int(v) | Values::Timestamp(v) | Values::Interval(v) => v.push(0),
            Values::UInt(v) => v.push(0),
            Values::Float(v) => v.push(0.0),
            Values::Boolean(b) => b.append(false),
            Values::Text { offsets, data } | Values::Binary { offsets, data } => {
                offsets.push(data.len() as i32);
            }
        }
        self.nulls.append_null();
    }

    /// Finishes the column as an Arrow array.
    ///
    /// The decoder keeps an invariant this relies on: every value appended to a text column is
    /// valid UTF-8 (it appends only validated JSON string content, decoded escapes without
    /// lone surrogates, and compact JSON text).
    pub(super) fn finish(mut self) -> ArrayRef {
        let nulls = self.nulls.finish();
        match self.values {
            Values::Int(v) => Arc::new(Int64Array::new(ScalarBuffer::from(v), nulls)),
            Values::UInt(v) => Arc::new(UInt64Array::new(ScalarBuffer::from(v), nulls)),
            Values::Float(v) => Arc::new(Float64Array::new(ScalarBuffer::from(v), nulls)),
            Values::Boolean(mut b) => Arc::new(BooleanArray::new(b.finish(), nulls)),
            Values::Timestamp(v) => Arc::new(
                TimestampNanosecondArray::new(ScalarBuffer::from(v), nulls).with_timezone("UTC"),
            ),
            Values::Interval(v) => {
                Arc::new(DurationNanosecondArray::new(ScalarBuffer::from(v), nulls))
            }
            Values::Text { offsets, data } => {
                debug_assert!(std::str::from_utf8(&data).is_ok());
                // SAFETY: offsets start at 0 and are pushed as `data.len()` after each value,
                // so they are non-decreasing and in bounds (`data` stays below i32::MAX bytes
                // because the decoder refuses bodies larger than that and never expands text).
                let offsets = unsafe { OffsetBuffer::new_unchecked(ScalarBuffer::from(offsets)) };
                // SAFETY: the decoder appends only UTF-8 (see above), and every offset is at a
                // value boundary, so each value is valid UTF-8.
                Arc::new(unsafe {
                    StringArray::new_unchecked(offsets, Buffer::from_vec(data), nulls)
                })
            }
            Values::Binary { offsets, data } => {
                // SAFETY: as for text, offsets are non-decreasing and within `data`.
                let offsets = unsafe { OffsetBuffer::new_unchecked(ScalarBuffer::from(offsets)) };
                Arc::new(BinaryArray::new(offsets, Buffer::from_vec(data), nulls))
            }
        }
    }
}
