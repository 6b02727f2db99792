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
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3).map_err(encoding)?))
        .set_statistics_enabled(EnabledStatistics::Page)
        .set_max_row_group_row_count(Some(row_group_rows.max(1)))
        .build();
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
