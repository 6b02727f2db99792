//! Table data encodings: log records (table id + Arrow IPC) and Parquet files.

use std::collections::BTreeMap;

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::TimestampNanosecondType;
use arrow_schema::{DataType, SchemaRef};
use bytes::Bytes;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use super::TableError;
use super::manifest::DataFile;

fn encoding(e: impl std::fmt::Display) -> TableError {
    TableError::Encoding(e.to_string())
}

/// A table-batch log record: `| id_len: u16 | id | Arrow IPC stream (schema + batch) |`.
pub(super) fn encode_record(table_id: &str, batch: &RecordBatch) -> Result<Vec<u8>, TableError> {
    let id = table_id.as_bytes();
    let id_len = u16::try_from(id.len()).map_err(encoding)?;
    let mut out = Vec::with_capacity(2 + id.len() + batch.get_array_memory_size());
    out.extend_from_slice(&id_len.to_le_bytes());
    out.extend_from_slice(id);
    let mut writer =
        arrow_ipc::writer::StreamWriter::try_new(&mut out, &batch.schema()).map_err(encoding)?;
    writer.write(batch).map_err(encoding)?;
    writer.finish().map_err(encoding)?;
    drop(writer);
    Ok(out)
}

/// Reads a record written by [`encode_record`].
pub(super) fn decode_record(payload: &[u8]) -> Result<(String, RecordBatch), TableError> {
    let bad = || TableError::Encoding("truncated table record".into());
    let id_len = u16::from_le_bytes([
        *payload.first().ok_or_else(bad)?,
        *payload.get(1).ok_or_else(bad)?,
    ]);
    let id_end = 2 + usize::from(id_len);
    let id = std::str::from_utf8(payload.get(2..id_end).ok_or_else(bad)?).map_err(encoding)?;
    let reader =
        arrow_ipc::reader::StreamReader::try_new(&payload[id_end..], None).map_err(encoding)?;
    let schema = reader.schema();
    let batches: Vec<RecordBatch> = reader.collect::<Result<_, _>>().map_err(encoding)?;
    let batch = match batches.len() {
        1 => batches.into_iter().next().ok_or_else(bad)?,
        _ => arrow_select::concat::concat_batches(&schema, &batches).map_err(encoding)?,
    };
    Ok((id.to_owned(), batch))
}

/// Writes batches as one Parquet file (zstd, page statistics, `row_group_rows` per group,
/// the Arrow schema with sluice's field metadata embedded). Returns the bytes and the file's
/// manifest entry for `path`.
pub(super) fn write_parquet(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    row_group_rows: usize,
    path: String,
) -> Result<(Bytes, DataFile), TableError> {
    let props = writer_properties(Some(schema), row_group_rows)?;
    let mut out = Vec::new();
    let mut writer =
        ArrowWriter::try_new(&mut out, schema.clone(), Some(props)).map_err(encoding)?;
    let mut rows = 0u64;
    let mut time_ranges: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for batch in batches {
        writer.write(batch).map_err(encoding)?;
        rows += batch.num_rows() as u64;
        for (field, column) in schema.fields().iter().zip(batch.columns()) {
            if !matches!(field.data_type(), DataType::Timestamp(_, _)) {
                continue;
            }
            let values = column.as_primitive::<TimestampNanosecondType>();
            if let (Some(lo), Some(hi)) = (
                arrow_arith::aggregate::min(values),
                arrow_arith::aggregate::max(values),
            ) {
                let entry = time_ranges.entry(field.name().clone()).or_insert((lo, hi));
                entry.0 = entry.0.min(lo);
                entry.1 = entry.1.max(hi);
            }
        }
    }
    writer.close().map_err(encoding)?;
    let bytes = Bytes::from(out);
    let file = DataFile {
        path,
        rows,
        bytes: bytes.len() as u64,
        time_ranges,
    };
    Ok((bytes, file))
}

/// The writer settings of every Parquet file sluice writes. zstd level 1: on event data it
/// costs about half the CPU of level 3 for files a few percent larger. Dictionary encoding
/// is off for types whose values rarely repeat (timestamps, floats, durations, binary):
/// the writer would hash a whole dictionary page's worth of them in every row group only to
/// fall back to plain encoding. Binary and JSON columns get no min/max statistics: no filter
/// prunes by the byte order of JSON text or of opaque bytes, and computing them costs a
/// comparison of every value.
fn writer_properties(
    schema: Option<&SchemaRef>,
    row_group_rows: usize,
) -> Result<WriterProperties, TableError> {
    let mut builder = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(1).map_err(encoding)?))
        .set_statistics_enabled(EnabledStatistics::Page)
        .set_max_row_group_row_count(Some(row_group_rows.max(1)));
    for field in schema.map(|s| s.fields().iter()).into_iter().flatten() {
        let unique = matches!(
            field.data_type(),
            DataType::Timestamp(_, _)
                | DataType::Float64
                | DataType::Duration(_)
                | DataType::Binary
        );
        if unique {
            builder = builder
                .set_column_dictionary_enabled(ColumnPath::from(field.name().as_str()), false);
        }
        let json = field
            .metadata()
            .get(crate::types::SLUICE_TYPE_KEY)
            .is_some_and(|t| matches!(t.as_str(), "object" | "array" | "any"));
        if json || matches!(field.data_type(), DataType::Binary) {
            builder = builder.set_column_statistics_enabled(
                ColumnPath::from(field.name().as_str()),
                EnabledStatistics::None,
            );
        }
    }
    Ok(builder.build())
}

/// Concatenates Parquet files by copying their encoded column chunks, without decoding or
/// re-encoding: row groups, statistics and page indexes carry over, so merging costs about a
/// memory copy. Files are appended one at a time, so only the output and the file being
/// appended are in memory.
pub(super) struct Splicer {
    /// The output's expected size (the inputs' sizes summed), reserved up front so the buffer
    /// does not pass through doubling copies (a transient of twice the output).
    capacity: usize,
    writer: Option<parquet::file::writer::SerializedFileWriter<Vec<u8>>>,
    /// The first file's schema and key-value metadata (the embedded Arrow schema with
    /// sluice's field metadata); every later file must match both.
    first: Option<(
        parquet::schema::types::SchemaDescPtr,
        Option<Vec<parquet::file::metadata::KeyValue>>,
    )>,
}

impl Splicer {
    pub(super) fn new(capacity: usize) -> Self {
        Splicer {
            capacity,
            writer: None,
            first: None,
        }
    }

    /// Appends every row group of `input`. `Ok(false)` when its schema is not the first
    /// file's (nothing of it was appended; the caller re-encodes instead).
    pub(super) fn append(&mut self, input: &Bytes) -> Result<bool, TableError> {
        use parquet::column::writer::ColumnCloseResult;
        use parquet::file::metadata::{PageIndexPolicy, ParquetMetaDataReader};
        use parquet::file::writer::SerializedFileWriter;

        let meta = ParquetMetaDataReader::new()
            .with_page_index_policy(PageIndexPolicy::Optional)
            .parse_and_finish(input)
            .map_err(encoding)?;
        let schema = meta.file_metadata().schema_descr_ptr();
        let kv = meta.file_metadata().key_value_metadata().cloned();
        match &self.first {
            Some((s, k)) if s.root_schema() != schema.root_schema() || *k != kv => {
                return Ok(false);
            }
            Some(_) => {}
            None => {
                let mut writer = SerializedFileWriter::new(
                    Vec::with_capacity(self.capacity),
                    schema.root_schema_ptr(),
                    std::sync::Arc::new(writer_properties(None, usize::MAX)?),
                )
                .map_err(encoding)?;
                for kv in kv.iter().flatten() {
                    writer.append_key_value_metadata(kv.clone());
                }
                self.writer = Some(writer);
                self.first = Some((schema, kv));
            }
        }
        let writer = self
            .writer
            .as_mut()
            .ok_or_else(|| TableError::Encoding("splicer has no writer".into()))?;
        for (g, group) in meta.row_groups().iter().enumerate() {
            let column_indexes = meta.column_index().and_then(|c| c.get(g));
            let offset_indexes = meta.offset_index().and_then(|o| o.get(g));
            let mut group_writer = writer.next_row_group().map_err(encoding)?;
            for (c, column) in group.columns().iter().enumerate() {
                let close = ColumnCloseResult {
                    bytes_written: u64::try_from(column.compressed_size()).map_err(encoding)?,
                    rows_written: u64::try_from(group.num_rows()).map_err(encoding)?,
                    metadata: column.clone(),
                    bloom_filter: None,
                    column_index: column_indexes.and_then(|r| r.get(c)).cloned(),
                    offset_index: offset_indexes.and_then(|r| r.get(c)).cloned(),
                };
                group_writer.append_column(input, close).map_err(encoding)?;
            }
            group_writer.close().map_err(encoding)?;
        }
        Ok(true)
    }

    /// The spliced file.
    pub(super) fn finish(self) -> Result<Bytes, TableError> {
        let writer = self
            .writer
            .ok_or_else(|| TableError::Encoding("nothing was spliced".into()))?;
        Ok(Bytes::from(writer.into_inner().map_err(encoding)?))
    }
}

/// Reads whole Parquet files into batches (for compaction).
pub(super) fn read_parquet(files: &[Bytes]) -> Result<Vec<RecordBatch>, TableError> {
    let mut batches = Vec::new();
    for bytes in files {
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes.clone())
            .map_err(encoding)?
            .with_batch_size(64 * 1024)
            .build()
            .map_err(encoding)?;
        for batch in reader {
            batches.push(batch.map_err(encoding)?);
        }
    }
    Ok(batches)
}
