//! Table data encodings: log records (table id + Arrow IPC) and Parquet files.

use std::collections::BTreeMap;
use std::hash::BuildHasher as _;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::TimestampNanosecondType;
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::{DataType, SchemaRef};
use bytes::Bytes;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::arrow_writer::{ArrowColumnChunk, ArrowColumnWriter, compute_leaves};
use parquet::basic::{Compression, Encoding, PageType, ZstdLevel};
use parquet::file::metadata::ColumnChunkMetaData;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use super::TableError;
use super::manifest::DataFile;

fn encoding(e: impl std::fmt::Display) -> TableError {
    TableError::Encoding(e.to_string())
}

/// Batches of less array memory than this are encoded with the kept schema message (see
/// [`RecordEncoder`]).
const SMALL_RECORD_BYTES: usize = 32 << 10;

/// Writes table-batch log records: `| id_len: u16 | id | Arrow IPC stream (schema + batch) |`.
///
/// Keeps the last schema's IPC message for small batches: a batch of few rows spent most of
/// its encoding on the schema's flatbuffer, the same for every record of a table. Buffers
/// are padded to 8 bytes, not the IPC writer's default 64: a record of one row carried more
/// padding than data. (Readers take any alignment: the IPC reader copies a buffer it needs
/// aligned.)
#[derive(Default)]
pub(super) struct RecordEncoder {
    /// The last schema encoded, with its message as written. A schema with dictionaries is
    /// not kept (their ids are assigned while the schema is encoded).
    schema: std::sync::Mutex<Option<(SchemaRef, Arc<[u8]>)>>,
}

impl RecordEncoder {
    /// The record of `batch` of table `table_id`.
    pub(super) fn encode(
        &self,
        table_id: &str,
        batch: &RecordBatch,
    ) -> Result<Vec<u8>, TableError> {
        use arrow_ipc::writer::{
            DictionaryTracker, IpcDataGenerator, IpcWriteOptions, StreamWriter, write_message,
        };
        let id = table_id.as_bytes();
        let id_len = u16::try_from(id.len()).map_err(encoding)?;
        let options =
            IpcWriteOptions::try_new(8, false, arrow_ipc::MetadataVersion::V5).map_err(encoding)?;
        let mut out = Vec::with_capacity(2 + id.len() + batch.get_array_memory_size());
        out.extend_from_slice(&id_len.to_le_bytes());
        out.extend_from_slice(id);
        let schema = batch.schema_ref();
        let has_dictionaries = |schema: &SchemaRef| {
            schema
                .flattened_fields()
                .iter()
                .any(|f| matches!(f.data_type(), DataType::Dictionary(..)))
        };
        // Large batches go through the stream writer, which writes their buffers straight
        // into the record: the generator's message is a copy of them, copied again. The
        // schema's share of their encoding is small anyway.
        let small = batch.get_array_memory_size() < SMALL_RECORD_BYTES;
        let cached = if small {
            let mut kept = self.schema.lock().unwrap_or_else(|p| p.into_inner());
            match &mut *kept {
                // (`Arc`s compare by pointer first.) The batch's `Arc` is kept: later batches
                // of its plan match by pointer. Only a schema without dictionaries is kept, so
                // a match needs no walk of its fields.
                Some((known, message)) if known == schema => {
                    *known = schema.clone();
                    Some(message.clone())
                }
                _ if has_dictionaries(schema) => None,
                _ => {
                    let mut message = Vec::new();
                    let encoded = IpcDataGenerator::default()
                        .schema_to_bytes_with_dictionary_tracker(
                            schema,
                            &mut DictionaryTracker::new(false),
                            &options,
                        );
                    write_message(&mut message, encoded, &options).map_err(encoding)?;
                    let message: Arc<[u8]> = message.into();
                    *kept = Some((schema.clone(), message.clone()));
                    Some(message)
                }
            }
        } else {
            None
        };
        match cached {
            Some(message) => {
                out.extend_from_slice(&message);
                let (dictionaries, encoded) = IpcDataGenerator::default()
                    .encode(
                        batch,
                        &mut DictionaryTracker::new(false),
                        &options,
                        &mut Default::default(),
                    )
                    .map_err(encoding)?;
                if !dictionaries.is_empty() {
                    return Err(TableError::Encoding(
                        "a batch without dictionaries encoded some".into(),
                    ));
                }
                write_message(&mut out, encoded, &options).map_err(encoding)?;
                // The end-of-stream marker: a continuation and a zero length.
                out.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
            }
            None => {
                let mut writer = StreamWriter::try_new_with_options(&mut out, schema, options)
                    .map_err(encoding)?;
                writer.write(batch).map_err(encoding)?;
                writer.finish().map_err(encoding)?;
            }
        }
        Ok(out)
    }
}

/// Reads a record written by [`RecordEncoder`].
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

/// Writes batches as one Parquet file (zstd, or none for chunks of few values
/// ([`few_values`]); page statistics, `row_group_rows` per group,
/// each group's rows in time order ([`time_order`]), the Arrow schema with sluice's field
/// metadata embedded). Returns the bytes and the file's manifest entry for `path`.
///
/// Columns are encoded in parallel: a flush is otherwise one core's work while ingest waits
/// on it for memory headroom, so the encoder, not the decoder, would set the ingest rate.
pub(super) fn write_parquet(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    row_group_rows: usize,
    path: String,
) -> Result<(Bytes, DataFile), TableError> {
    let props = writer_properties(Some(schema), row_group_rows, zstd()?)?;
    let file_schema = file_schema(schema);
    let (mut file, factory) = ArrowWriter::try_new(Vec::new(), file_schema.clone(), Some(props))
        .and_then(ArrowWriter::into_serialized_writer)
        .map_err(encoding)?;
    // Writers of the same columns that compress nothing, for chunks of few values
    // ([`few_values`]); their own file (an empty buffer) is dropped unwritten.
    let plain = writer_properties(Some(schema), row_group_rows, Compression::UNCOMPRESSED)?;
    let (_, plain_factory) = ArrowWriter::try_new(Vec::new(), file_schema.clone(), Some(plain))
        .and_then(ArrowWriter::into_serialized_writer)
        .map_err(encoding)?;
    let groups = row_groups(batches, row_group_rows.max(1));
    let time = time_column(schema);
    let orders: Vec<Option<Vec<(usize, usize)>>> = groups
        .iter()
        .map(|group| time.and_then(|time| time_order(group, time)))
        .collect();
    let mut jobs = Vec::with_capacity(groups.len() * schema.fields().len());
    for (index, (group, order)) in groups.iter().zip(&orders).enumerate() {
        let mut writers = factory
            .create_column_writers(index)
            .map_err(encoding)?
            .into_iter();
        let mut plain_writers = plain_factory
            .create_column_writers(index)
            .map_err(encoding)?
            .into_iter();
        for (column, field) in schema.fields().iter().enumerate() {
            let leaves = leaf_count(field.data_type());
            let plain: Vec<ArrowColumnWriter> = plain_writers.by_ref().take(leaves).collect();
            jobs.push(ColumnJob {
                group,
                order: order.as_deref(),
                column,
                writers: writers.by_ref().take(leaves).collect(),
                uncompressed: dictionary_candidate(field.data_type()).then_some(plain),
            });
        }
    }
    let mut chunks = encode_columns(&file_schema, jobs)?.into_iter();
    for group in &groups {
        let mut row_group = file.next_row_group().map_err(encoding)?;
        for chunk in chunks.by_ref().take(schema.fields().len()).flatten() {
            chunk
                .append_to_row_group(&mut row_group)
                .map_err(encoding)?;
        }
        let written = row_group.close().map_err(encoding)?;
        let expected: usize = group.iter().map(RecordBatch::num_rows).sum();
        if written.num_rows() != expected as i64 {
            return Err(TableError::Encoding(format!(
                "row group holds {} rows, expected {expected}",
                written.num_rows()
            )));
        }
    }
    let out = file.into_inner().map_err(encoding)?;
    let mut time_ranges: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for batch in batches {
        widen_time_ranges(&mut time_ranges, schema, batch);
    }
    let rows = batches.iter().map(|b| b.num_rows() as u64).sum();
    Ok(data_file(schema, path, Bytes::from(out), rows, time_ranges))
}

/// Widens `ranges` (each timestamp column's lowest and highest value) by `batch`'s values.
fn widen_time_ranges(
    ranges: &mut BTreeMap<String, (i64, i64)>,
    schema: &SchemaRef,
    batch: &RecordBatch,
) {
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        if !matches!(field.data_type(), DataType::Timestamp(_, _)) {
            continue;
        }
        let values = column.as_primitive::<TimestampNanosecondType>();
        if let (Some(lo), Some(hi)) = (
            arrow_arith::aggregate::min(values),
            arrow_arith::aggregate::max(values),
        ) {
            let entry = ranges.entry(field.name().clone()).or_insert((lo, hi));
            entry.0 = entry.0.min(lo);
            entry.1 = entry.1.max(hi);
        }
    }
}

/// The manifest entry of a file of `schema` at `path`.
fn data_file(
    schema: &SchemaRef,
    path: String,
    bytes: Bytes,
    rows: u64,
    time_ranges: BTreeMap<String, (i64, i64)>,
) -> (Bytes, DataFile) {
    let field_ids = schema
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .zip(crate::types::field_ids(schema))
        .collect();
    let file = DataFile {
        path,
        rows,
        bytes: bytes.len() as u64,
        time_ranges,
        field_ids,
    };
    (bytes, file)
}

/// Writes the Parquet file `bytes` again in the table's `current` shape (see
/// [`written_shape`]: a dropped column is left out, a column newer than `last_column_id`
/// kept), one row group at a time, each in the order it has: memory holds one batch of
/// decoded rows and the new file, whatever the file's size. Returns the new file's bytes
/// and its manifest entry for `path`.
///
/// This is how a file written before a column was dropped loses the column: a file whose
/// field ids include one the current schema lacks is legal Iceberg, but some readers
/// (Daft 0.7) misread the columns that follow it.
pub(super) fn rewrite_parquet(
    bytes: Bytes,
    current: &SchemaRef,
    last_column_id: i32,
    row_group_rows: usize,
    path: String,
) -> Result<(Bytes, DataFile), TableError> {
    use parquet::arrow::arrow_reader::ArrowReaderMetadata;
    let metadata = ArrowReaderMetadata::load(&bytes, Default::default()).map_err(encoding)?;
    let shape = written_shape(current, last_column_id, &[metadata.schema().clone()]);
    let file_schema = file_schema(&shape);
    let props = writer_properties(Some(&shape), row_group_rows, zstd()?)?;
    let mut writer =
        ArrowWriter::try_new(Vec::new(), file_schema.clone(), Some(props)).map_err(encoding)?;
    let mut time_ranges = BTreeMap::new();
    let mut rows = 0u64;
    for group in 0..metadata.metadata().num_row_groups() {
        let reader =
            ParquetRecordBatchReaderBuilder::new_with_metadata(bytes.clone(), metadata.clone())
                .with_row_groups(vec![group])
                .with_batch_size(64 * 1024)
                .build()
                .map_err(encoding)?;
        for batch in reader {
            let batch =
                crate::types::project_by_id(&batch.map_err(encoding)?, &shape).map_err(encoding)?;
            widen_time_ranges(&mut time_ranges, &shape, &batch);
            rows += batch.num_rows() as u64;
            let columns = batch
                .columns()
                .iter()
                .map(file_column)
                .collect::<Result<Vec<_>, _>>()?;
            let batch = RecordBatch::try_new(file_schema.clone(), columns).map_err(encoding)?;
            writer.write(&batch).map_err(encoding)?;
        }
        // A row group of the old file is one of the new: its rows stay in time order.
        writer.flush().map_err(encoding)?;
    }
    let out = writer.into_inner().map_err(encoding)?;
    Ok(data_file(&shape, path, Bytes::from(out), rows, time_ranges))
}

/// The schema a Parquet file is written with (and embeds), which every Iceberg reader of
/// the table's views ([`crate::iceberg`]) accepts: each column carries its Iceberg field id
/// (`PARQUET:field_id`, which the Parquet writer puts in the file's schema: the column's id,
/// [`crate::types::field_ids`]) and its sluice
/// type (`sluice.type`); an interval is `Int64` nanoseconds (readers refuse Arrow's
/// `Duration`); a uint is `Int64`, a plain signed INT64 in Parquet, the type the Iceberg
/// specification gives `long` (Iceberg has no unsigned types, and Java's and C++'s readers
/// refuse the `UINT_64` annotation; a uint only ever holds `0..=i64::MAX`, so the bits are
/// the same); JSON columns are plain `Utf8` (no `arrow.json` extension, which readers also
/// refuse). Queries read files as the table's schema, casting back ([`crate::query`]'s
/// scan), and [`file_column`] turns a table column into its file type.
pub(super) fn file_schema(schema: &SchemaRef) -> SchemaRef {
    let ids = crate::types::field_ids(schema);
    let fields: Vec<arrow_schema::FieldRef> = schema
        .fields()
        .iter()
        .zip(ids)
        .map(|(f, id)| {
            let mut metadata = f.metadata().clone();
            metadata.remove(crate::types::EXTENSION_NAME_KEY);
            metadata.remove(crate::types::EXTENSION_METADATA_KEY);
            metadata.insert(
                parquet::arrow::PARQUET_FIELD_ID_META_KEY.to_owned(),
                id.to_string(),
            );
            let data_type = match f.data_type() {
                DataType::Duration(_) | DataType::UInt64 => DataType::Int64,
                other => other.clone(),
            };
            Arc::new(
                arrow_schema::Field::new(f.name(), data_type, f.is_nullable())
                    .with_metadata(metadata),
            )
        })
        .collect();
    Arc::new(arrow_schema::Schema::new_with_metadata(
        fields,
        schema.metadata().clone(),
    ))
}

/// A column as its file type (see [`file_schema`]): a duration's or a uint's values
/// reinterpreted as `Int64` (no copy: a uint never exceeds `i64::MAX`, which ingest and
/// `INSERT` check); anything else as it is.
fn file_column(column: &arrow_array::ArrayRef) -> Result<arrow_array::ArrayRef, TableError> {
    if let Some(values) = column.as_primitive_opt::<arrow_array::types::UInt64Type>()
        && arrow_arith::aggregate::max(values).is_some_and(|m| i64::try_from(m).is_err())
    {
        return Err(TableError::Encoding(
            "a uint value above 9223372036854775807 cannot be written".into(),
        ));
    }
    match column.data_type() {
        DataType::Duration(_) | DataType::UInt64 => Ok(arrow_array::make_array(
            column
                .to_data()
                .into_builder()
                .data_type(DataType::Int64)
                .build()
                .map_err(encoding)?,
        )),
        _ => Ok(column.clone()),
    }
}

/// One column of one row group to encode: the batches of the group and the writers of the
/// column's Parquet leaves (one for every flat column).
struct ColumnJob<'a> {
    group: &'a [RecordBatch],
    /// The order to write the group's rows in ([`time_order`]), if not the order they have.
    order: Option<&'a [(usize, usize)]>,
    column: usize,
    writers: Vec<ArrowColumnWriter>,
    /// Writers of the column's leaf that compress nothing, for a column that may be written
    /// so ([`dictionary_candidate`], [`few_values`]).
    uncompressed: Option<Vec<ArrowColumnWriter>>,
}

/// How many rows of a column [`encode_columns`] gathers into time order at a time: a page's
/// worth (see [`writer_properties`]).
const GATHER_ROWS: usize = 8192;

/// `columns` (a row group's pieces of one column, as file columns) written by `writers`
/// (one for each of the column's Parquet leaves), in `order` if given; the closed chunks.
fn write_chunks(
    field: &arrow_schema::Field,
    mut writers: Vec<ArrowColumnWriter>,
    columns: &[ArrayRef],
    order: Option<&[(usize, usize)]>,
) -> Result<Vec<ArrowColumnChunk>, TableError> {
    let pieces: Box<dyn Iterator<Item = Result<ArrayRef, TableError>>> = match order {
        None => Box::new(columns.iter().cloned().map(Ok)),
        Some(order) => {
            let sources: Vec<&dyn Array> = columns.iter().map(AsRef::as_ref).collect();
            Box::new(order.chunks(GATHER_ROWS).map(move |rows| {
                arrow_select::interleave::interleave(&sources, rows).map_err(encoding)
            }))
        }
    };
    for column in pieces {
        let column = column?;
        let leaves = compute_leaves(field, &column).map_err(encoding)?;
        if leaves.len() != writers.len() {
            return Err(TableError::Encoding(format!(
                "column {} has {} Parquet leaves, the writer expected {}",
                field.name(),
                leaves.len(),
                writers.len()
            )));
        }
        for (writer, leaf) in writers.iter_mut().zip(&leaves) {
            writer.write(leaf).map_err(encoding)?;
        }
    }
    writers
        .into_iter()
        .map(|w| w.close().map_err(encoding))
        .collect()
}

/// Whether a table column of this type is one Parquet leaf that [`writer_properties`]
/// dictionary-encodes (not a `Duration`, whose file type is `Int64`: its dictionary is
/// off), so that it may be written uncompressed ([`few_values`]).
fn dictionary_candidate(data_type: &DataType) -> bool {
    use DataType::*;
    matches!(
        data_type,
        Utf8 | LargeUtf8
            | Utf8View
            | Int8
            | Int16
            | Int32
            | Int64
            | UInt8
            | UInt16
            | UInt32
            | UInt64
            | Date32
            | Date64
    )
}

/// A column chunk with at most this many distinct values in its sample ([`few_values`]) is
/// written uncompressed: its data pages are then dictionary indices of a few bits (at most
/// 5 if the sample saw every value; [`small_uncompressed`] bounds them if it did not).
const FEW_VALUES: usize = 32;

/// The most bytes of distinct values, and of dictionary page, that a column chunk written
/// uncompressed may have ([`few_values`], [`small_uncompressed`]).
const SMALL_DICTIONARY: usize = 16 << 10;

/// About how many rows of a column chunk [`few_values`] looks at.
const SAMPLED_ROWS: usize = 4096;

/// Whether a row group's column (its pieces, as file columns) looks to hold few and short
/// distinct values: at most [`FEW_VALUES`] among about [`SAMPLED_ROWS`] rows spread evenly
/// over it (nulls are not values), of at most [`SMALL_DICTIONARY`] bytes together. Such a
/// chunk is written dictionary-encoded and uncompressed, and kept so if it came out small
/// ([`small_uncompressed`]); else it is written again, compressed.
///
/// Why: its data pages are then runs and bit-packed indices of a few bits, which zstd
/// barely shrinks (a low-cardinality column takes a few bits a row; left uncompressed, such
/// columns make a file hardly larger), while a query pays a zstd frame, with its
/// tables, for every page of 8,192 rows it reads: a large part of the time of a count
/// grouped by such a column. What zstd would still have saved is bounded by the check
/// after writing: a byte a row in all. A sample that missed values costs a second encoding
/// of the chunk, or bytes within that bound.
fn few_values(columns: &[ArrayRef]) -> bool {
    let rows: usize = columns.iter().map(|c| c.len()).sum();
    // Odd, so that values repeating with a period of a power of two are all seen.
    let step = (rows / SAMPLED_ROWS) | 1;
    // Keyed, so that values chosen to collide cannot pass for few.
    let hasher = std::hash::RandomState::new();
    let mut seen = std::collections::HashSet::with_capacity(FEW_VALUES + 1);
    let mut value_bytes = 0;
    // The sampled row's index in the next piece.
    let mut next = 0;
    for column in columns {
        // A primitive column's values, read as bytes (only if a row of it is sampled).
        let mut data = None;
        while next < column.len() {
            let row = next;
            next += step;
            if column.is_null(row) {
                continue;
            }
            let value: &[u8] = match column.data_type() {
                DataType::Utf8 => column.as_string::<i32>().value(row).as_bytes(),
                DataType::LargeUtf8 => column.as_string::<i64>().value(row).as_bytes(),
                DataType::Utf8View => column.as_string_view().value(row).as_bytes(),
                data_type => {
                    let Some(width) = data_type.primitive_width() else {
                        return false;
                    };
                    let data = data.get_or_insert_with(|| column.to_data());
                    let start = (data.offset() + row) * width;
                    let bytes = (data.buffers().first()).and_then(|b| b.get(start..start + width));
                    let Some(bytes) = bytes else {
                        return false;
                    };
                    bytes
                }
            };
            if seen.insert(hasher.hash_one(value)) {
                value_bytes += value.len();
            }
            if seen.len() > FEW_VALUES || value_bytes > SMALL_DICTIONARY {
                return false;
            }
        }
        next -= column.len();
    }
    true
}

/// Whether a chunk written uncompressed for [`few_values`] is kept: every data page
/// dictionary-encoded, a dictionary page of at most [`SMALL_DICTIONARY`] bytes, and at most
/// a byte a row in all (dictionary, indices, levels and page headers), so that a small row
/// group keeps no large dictionary uncompressed. A sample that missed values gives a chunk
/// that fails this unless it is still that small.
fn small_uncompressed(chunk: &ArrowColumnChunk) -> bool {
    let close = chunk.close();
    if dictionary_pages_only(&close.metadata) != Some(true) {
        return false;
    }
    let Some(pages) = &close.offset_index else {
        return false;
    };
    let data: i64 = (pages.page_locations().iter())
        .map(|p| i64::from(p.compressed_page_size))
        .sum();
    let bytes = close.metadata.compressed_size();
    let rows = i64::try_from(close.rows_written).unwrap_or(i64::MAX);
    (0..=SMALL_DICTIONARY as i64).contains(&(bytes - data)) && bytes <= rows
}

/// Whether every data page of a column chunk is dictionary-encoded, by the chunk's page
/// encoding statistics; `None` when the chunk has none. `false` for a chunk with no
/// dictionary page. The chunks [`write_parquet`] encodes carry these statistics; the footer
/// of a file [`Splicer`] merged does not.
pub(crate) fn dictionary_pages_only(column: &ColumnChunkMetaData) -> Option<bool> {
    let dictionary =
        |e: Encoding| matches!(e, Encoding::PLAIN_DICTIONARY | Encoding::RLE_DICTIONARY);
    if column.dictionary_page_offset().is_none() {
        return Some(false);
    }
    if let Some(mask) = column.page_encoding_stats_mask() {
        return Some(
            mask.is_only(Encoding::PLAIN_DICTIONARY) || mask.is_only(Encoding::RLE_DICTIONARY),
        );
    }
    column.page_encoding_stats().map(|stats| {
        stats
            .iter()
            .filter(|s| matches!(s.page_type, PageType::DATA_PAGE | PageType::DATA_PAGE_V2))
            .all(|s| dictionary(s.encoding))
    })
}

/// A job's encoded chunks, or why it failed.
type EncodedColumn = Result<Vec<ArrowColumnChunk>, TableError>;

/// Encodes every job, on up to as many threads as there are cores, and returns the encoded
/// chunks of each job in the jobs' order.
fn encode_columns(
    schema: &SchemaRef,
    jobs: Vec<ColumnJob<'_>>,
) -> Result<Vec<Vec<ArrowColumnChunk>>, TableError> {
    let encode = |job: ColumnJob<'_>| -> Result<Vec<ArrowColumnChunk>, TableError> {
        let field = schema.field(job.column);
        let columns = job
            .group
            .iter()
            .map(|batch| file_column(batch.column(job.column)))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(plain) = job.uncompressed
            && few_values(&columns)
        {
            let chunks = write_chunks(field, plain, &columns, job.order)?;
            if chunks.iter().all(small_uncompressed) {
                return Ok(chunks);
            }
        }
        write_chunks(field, job.writers, &columns, job.order)
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(jobs.len());
    if threads <= 1 {
        return jobs.into_iter().map(encode).collect();
    }
    // Workers take the next job in order; each result lands in its job's slot.
    let count = jobs.len();
    let queue = std::sync::Mutex::new(jobs.into_iter().enumerate());
    let slots: Vec<std::sync::Mutex<Option<EncodedColumn>>> =
        (0..count).map(|_| std::sync::Mutex::new(None)).collect();
    let work = || {
        loop {
            let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
            let Some((index, job)) = next else { break };
            let result = encode(job);
            let failed = result.is_err();
            *slots[index].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
            if failed {
                break;
            }
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
    slots
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .unwrap_or_else(|| Err(TableError::Encoding("a column was not encoded".into())))
        })
        .collect()
}

/// The column a table's files keep their rows ordered by within each row group: its first
/// timestamp column, if it has one.
fn time_column(schema: &SchemaRef) -> Option<usize> {
    schema
        .fields()
        .iter()
        .position(|f| matches!(f.data_type(), DataType::Timestamp(_, _)))
}

/// The order to write a row group's rows in: by the time column (nulls first, rows of one
/// time in the order they came), as (batch, row) positions in `group`; `None` when they are
/// in that order already (or the column is not nanoseconds, which no table has).
///
/// Why: rows reach a flush in commit order, and concurrent loaders interleave stretches of
/// different times, so a page of an unsorted group spans the time between two stretches
/// and the page index cannot narrow a time filter to it. In time order each page covers a
/// narrow time range: a one-second lookup on the 1 GiB bench decoded 42,310 rows of each
/// column for 6 before, and 16,384 (two pages) after. Only row order within a group changes:
/// the file's rows, row groups and time range stay the same. Each column is gathered in this
/// order by the job that encodes it ([`encode_columns`]), a page's worth at a time, so the
/// gathering runs on the encoders' threads and holds no second copy of the group.
fn time_order(group: &[RecordBatch], time: usize) -> Option<Vec<(usize, usize)>> {
    let mut keys = Vec::with_capacity(group.iter().map(RecordBatch::num_rows).sum());
    for (b, batch) in group.iter().enumerate() {
        let column = batch
            .column(time)
            .as_primitive_opt::<TimestampNanosecondType>()?;
        keys.extend(
            column
                .iter()
                .enumerate()
                .map(|(row, value)| (value, b, row)),
        );
    }
    if keys.is_sorted_by_key(|(value, _, _)| *value) {
        return None;
    }
    // Stable: rows of one time keep their commit order. Runs already in order (each loaded
    // stretch) make this close to a merge.
    keys.sort_by_key(|(value, _, _)| *value);
    Some(keys.into_iter().map(|(_, b, row)| (b, row)).collect())
}

/// The batches cut into row groups of `rows` rows (the last may be shorter); slices share
/// the batches' buffers.
fn row_groups(batches: &[RecordBatch], rows: usize) -> Vec<Vec<RecordBatch>> {
    let mut groups = Vec::new();
    let mut group = Vec::new();
    let mut filled = 0;
    for batch in batches {
        let mut offset = 0;
        while offset < batch.num_rows() {
            let take = (rows - filled).min(batch.num_rows() - offset);
            group.push(batch.slice(offset, take));
            offset += take;
            filled += take;
            if filled == rows {
                groups.push(std::mem::take(&mut group));
                filled = 0;
            }
        }
    }
    if !group.is_empty() {
        groups.push(group);
    }
    groups
}

/// How many Parquet leaf columns an Arrow type becomes.
fn leaf_count(data_type: &DataType) -> usize {
    match data_type {
        DataType::Struct(fields) => fields.iter().map(|f| leaf_count(f.data_type())).sum(),
        DataType::List(f)
        | DataType::LargeList(f)
        | DataType::ListView(f)
        | DataType::LargeListView(f)
        | DataType::FixedSizeList(f, _)
        | DataType::Map(f, _) => leaf_count(f.data_type()),
        DataType::Dictionary(_, value) => leaf_count(value),
        _ => 1,
    }
}

/// The compression of Parquet files: zstd at level 1, which on event data costs about half
/// the CPU of level 3 for files a few percent larger.
fn zstd() -> Result<Compression, TableError> {
    Ok(Compression::ZSTD(ZstdLevel::try_new(1).map_err(encoding)?))
}

/// The writer settings of every Parquet file sluice writes, with `compression` (see [`zstd`],
/// and [`few_values`] for chunks written uncompressed). Dictionary encoding
/// is off for types whose values rarely repeat (timestamps, floats, durations, binary):
/// the writer would hash a whole dictionary page's worth of them in every row group only to
/// fall back to plain encoding. Binary and JSON columns get no min/max statistics: no filter
/// prunes by the byte order of JSON text or of opaque bytes, and computing them costs a
/// comparison of every value.
///
/// Timestamps are delta-encoded (`DELTA_BINARY_PACKED`) and not compressed: events arrive
/// nearly in time order, so the deltas pack tighter than zstd packs the plain values (on the
/// bench data 4.0 bytes a value against 5.8) and zstd finds nothing left in them. Pages hold
/// at most 8,192 rows, so the page index can narrow a point lookup to a few thousand rows
/// per column rather than the ~25,000 a 1 MiB page of timestamps holds.
///
/// Binary values are written `DELTA_LENGTH_BYTE_ARRAY`: their lengths delta-packed ahead of
/// their bytes, where `PLAIN` puts four bytes of length before every value. Binary columns
/// tend to hold ids and hashes of one length, whose lengths then pack to nothing, and whose
/// bytes zstd cannot shrink: on the bench's `trace` (nine random bytes a row) the column
/// took 41.8 MiB plain and zstd-compressed, and 35.9 MiB this way (its raw bytes: 35.7).
fn writer_properties(
    schema: Option<&SchemaRef>,
    row_group_rows: usize,
    compression: Compression,
) -> Result<WriterProperties, TableError> {
    let mut builder = WriterProperties::builder()
        .set_compression(compression)
        .set_statistics_enabled(EnabledStatistics::Page)
        .set_max_row_group_row_count(Some(row_group_rows.max(1)))
        .set_data_page_row_count_limit(8192);
    for field in schema.map(|s| s.fields().iter()).into_iter().flatten() {
        let path = || ColumnPath::from(field.name().as_str());
        let unique = matches!(
            field.data_type(),
            DataType::Timestamp(_, _)
                | DataType::Float64
                | DataType::Duration(_)
                | DataType::Binary
        );
        if unique {
            builder = builder.set_column_dictionary_enabled(path(), false);
        }
        if matches!(field.data_type(), DataType::Timestamp(_, _)) {
            builder = builder
                .set_column_encoding(path(), Encoding::DELTA_BINARY_PACKED)
                .set_column_compression(path(), Compression::UNCOMPRESSED);
        }
        if matches!(field.data_type(), DataType::Binary) {
            builder = builder.set_column_encoding(path(), Encoding::DELTA_LENGTH_BYTE_ARRAY);
        }
        let json = field
            .metadata()
            .get(crate::types::SLUICE_TYPE_KEY)
            .is_some_and(|t| matches!(t.as_str(), "object" | "array" | "any"));
        if json || matches!(field.data_type(), DataType::Binary) {
            builder = builder.set_column_statistics_enabled(path(), EnabledStatistics::None);
        }
    }
    Ok(builder.build())
}

/// Whether a Parquet column carries an unsigned integer annotation (the logical type, or
/// the older converted type).
fn unsigned(column: &parquet::schema::types::ColumnDescriptor) -> bool {
    use parquet::basic::{ConvertedType, LogicalType};
    matches!(column.logical_type_ref(), Some(LogicalType::Integer(int)) if !int.is_signed)
        || matches!(
            column.converted_type(),
            ConvertedType::UINT_8
                | ConvertedType::UINT_16
                | ConvertedType::UINT_32
                | ConvertedType::UINT_64
        )
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
    /// file's, or is one sluice no longer writes (an unsigned annotation): nothing of it was
    /// appended; the caller re-encodes instead.
    pub(super) fn append(&mut self, input: &Bytes) -> Result<bool, TableError> {
        use parquet::column::writer::ColumnCloseResult;
        use parquet::file::metadata::{PageIndexPolicy, ParquetMetaDataReader};
        use parquet::file::writer::SerializedFileWriter;

        let meta = ParquetMetaDataReader::new()
            .with_page_index_policy(PageIndexPolicy::Optional)
            .parse_and_finish(input)
            .map_err(encoding)?;
        let schema = meta.file_metadata().schema_descr_ptr();
        if schema.columns().iter().any(|c| unsigned(c)) {
            // Written before uints were plain INT64: Iceberg readers refuse the unsigned
            // annotation (Polars; Iceberg-Java's schema conversion), so such a file is not
            // copied on as it is; the caller re-encodes it in the current file schema.
            return Ok(false);
        }
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
                    std::sync::Arc::new(writer_properties(None, usize::MAX, zstd()?)?),
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

/// The shape a file of `inputs` (batches or files of a table, of any of its shapes) is
/// written in: the table's `current` columns, in order, then any column of the inputs that
/// is newer than the shape this node knows (an id above `last_column_id`: another node's
/// catalog added it, and its manifest commit has not been read yet), so that no value is
/// lost. A column the table dropped (an id at or below `last_column_id` that `current` lacks)
/// is left out. A newer column whose name is taken is written as `{name}#{id}`: readers map
/// by id.
pub(super) fn written_shape(
    current: &SchemaRef,
    last_column_id: i32,
    inputs: &[SchemaRef],
) -> SchemaRef {
    let mut ids = crate::types::field_ids(current);
    let mut fields: Vec<arrow_schema::FieldRef> = current.fields().iter().cloned().collect();
    for input in inputs {
        for (field, id) in input.fields().iter().zip(crate::types::field_ids(input)) {
            if id <= last_column_id || ids.contains(&id) {
                continue;
            }
            let Some(t) = crate::types::ColumnType::from_field(field) else {
                continue;
            };
            let name = if fields.iter().any(|f| f.name() == field.name()) {
                format!("{}#{id}", field.name())
            } else {
                field.name().clone()
            };
            ids.push(id);
            fields.push(Arc::new(crate::types::with_field_id(
                t.arrow_field(&name),
                id,
            )));
        }
    }
    Arc::new(arrow_schema::Schema::new(fields))
}

/// `batches` read as `shape` (see [`crate::types::project_by_id`]).
pub(super) fn project_all(
    batches: &[RecordBatch],
    shape: &SchemaRef,
) -> Result<Vec<RecordBatch>, TableError> {
    batches
        .iter()
        .map(|b| crate::types::project_by_id(b, shape).map_err(encoding))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Int64Array, StringArray, TimestampNanosecondArray};
    use arrow_schema::{Field, Schema, TimeUnit};
    use parquet::file::reader::{FileReader, SerializedFileReader};

    use super::*;

    fn batch(schema: &SchemaRef, from: i64, rows: i64) -> RecordBatch {
        let ids: Vec<i64> = (from..from + rows).collect();
        let columns: Vec<ArrayRef> = vec![
            Arc::new(
                TimestampNanosecondArray::from(ids.iter().map(|i| i * 1_000).collect::<Vec<_>>())
                    .with_timezone("UTC"),
            ),
            Arc::new(Int64Array::from(ids.clone())),
            Arc::new(StringArray::from_iter(
                ids.iter().map(|i| (i % 3 != 0).then(|| format!("row {i}"))),
            )),
        ];
        RecordBatch::try_new(schema.clone(), columns).expect("batch")
    }

    fn three_columns() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new(
                "time",
                DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
                false,
            ),
            Field::new("id", DataType::Int64, false),
            Field::new("text", DataType::Utf8, true),
        ]))
    }

    /// A table record as the IPC stream writer makes it (8-byte alignment).
    fn stream_record(table: &str, b: &RecordBatch) -> Vec<u8> {
        let mut stream = (table.len() as u16).to_le_bytes().to_vec();
        stream.extend_from_slice(table.as_bytes());
        let options =
            arrow_ipc::writer::IpcWriteOptions::try_new(8, false, arrow_ipc::MetadataVersion::V5)
                .expect("options");
        let mut writer = arrow_ipc::writer::StreamWriter::try_new_with_options(
            &mut stream,
            b.schema_ref(),
            options,
        )
        .expect("writer");
        writer.write(b).expect("write");
        writer.finish().expect("finish");
        drop(writer);
        stream
    }

    /// A record written with the kept schema message is the same bytes as the IPC stream
    /// writer's, and reads back as the batch; a batch with dictionaries (never kept), a slice
    /// and a new schema too.
    #[test]
    fn records_with_the_kept_schema_read_back() {
        use arrow_array::DictionaryArray;
        use arrow_array::types::Int32Type;
        let schema = three_columns();
        let encoder = RecordEncoder::default();
        let wide = batch(&schema, 0, 100);
        for b in [batch(&schema, 0, 1), wide.slice(40, 7), wide.clone()] {
            let kept = encoder.encode("t1", &b).expect("encode");
            assert_eq!(
                kept,
                stream_record("t1", &b),
                "the kept schema message changes nothing"
            );
            let (id, read) = decode_record(&kept).expect("decode");
            assert_eq!(id, "t1");
            assert_eq!(read, b);
        }
        // Another schema replaces the kept one.
        let other: SchemaRef = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, true)]));
        let b = RecordBatch::try_new(other.clone(), vec![Arc::new(Int64Array::from(vec![1, 2]))])
            .expect("batch");
        assert_eq!(
            decode_record(&encoder.encode("t2", &b).expect("encode"))
                .expect("decode")
                .1,
            b
        );
        let dictionary: DictionaryArray<Int32Type> = vec!["x", "y", "x"].into_iter().collect();
        let dict_schema: SchemaRef = Arc::new(Schema::new(vec![Field::new(
            "d",
            dictionary.data_type().clone(),
            false,
        )]));
        let b = RecordBatch::try_new(dict_schema, vec![Arc::new(dictionary)]).expect("batch");
        for _ in 0..2 {
            let (_, read) =
                decode_record(&encoder.encode("t3", &b).expect("encode")).expect("decode");
            assert_eq!(read, b);
        }
    }

    /// Records of every sluice type, with the column ids a table's batches carry: one row, no
    /// row, slices at odd offsets, a schema equal by value in another `Arc`, and a batch past
    /// the small-record size (written by the stream writer): each is the stream writer's
    /// bytes and reads back as written, schema included.
    #[test]
    fn records_of_every_type_and_size_read_back_as_written() {
        use crate::types::{Column, ColumnType};
        let columns = vec![
            Column::new("time", ColumnType::Timestamp),
            Column::new("i", ColumnType::Int),
            Column::new("u", ColumnType::UInt),
            Column::new("f", ColumnType::Float),
            Column::new("b", ColumnType::Boolean),
            Column::new("s", ColumnType::String),
            Column::new("d", ColumnType::Interval),
            Column::new("bin", ColumnType::Binary),
            Column::new("o", ColumnType::Object),
            Column::new("a", ColumnType::Array),
            Column::new("any", ColumnType::Any),
        ];
        let ids: Vec<i32> = (1..=columns.len() as i32).map(|i| i * 3).collect();
        let schema = crate::types::arrow_schema_with_ids(&columns, &ids);
        let decoder = crate::ingest::Decoder::new(&columns);
        let rows = |n: usize| -> RecordBatch {
            let body: String = (0..n)
                .map(|i| {
                    format!(
                        "{{\"time\":\"2026-10-23T09:00:{:02}Z\",\"i\":{},\"u\":{i},\"f\":{i}.5,\
                         \"b\":{},\"s\":\"row {i}\",\"d\":\"PT{i}S\",\"bin\":\"AAEC\",\
                         \"o\":{{\"k\":{i}}},\"a\":[{i},\"x\"],\"any\":{}}}\n",
                        i % 60,
                        -(i as i64),
                        i % 2 == 0,
                        if i % 3 == 0 {
                            "null".to_owned()
                        } else {
                            i.to_string()
                        },
                    )
                })
                .collect();
            let batch = decoder
                .decode(body.as_bytes(), &crate::ingest::Limits::default())
                .expect("rows decode");
            batch.with_schema(schema.clone()).expect("same columns")
        };
        let encoder = RecordEncoder::default();
        let wide = rows(3000);
        assert!(
            wide.get_array_memory_size() >= SMALL_RECORD_BYTES,
            "a large batch too"
        );
        let equal_elsewhere = rows(2)
            .with_schema(Arc::new((*schema).clone()))
            .expect("same schema");
        for b in [
            rows(1),
            rows(0),
            wide.slice(7, 3),
            wide.slice(1001, 0),
            equal_elsewhere,
            rows(5),
            wide.clone(),
            wide.slice(13, 2900),
            rows(1),
        ] {
            let record = encoder.encode("tbl", &b).expect("encode");
            assert_eq!(record, stream_record("tbl", &b), "{} rows", b.num_rows());
            let (id, read) = decode_record(&record).expect("decode");
            assert_eq!(id, "tbl");
            assert_eq!(read, b);
            assert_eq!(read.schema(), schema, "field metadata kept");
        }
    }

    /// Row groups cut across batch boundaries, columns encoded on several threads: the file
    /// holds every row in order, in groups of the configured size.
    #[test]
    fn parallel_encoding_keeps_rows_and_row_groups() {
        let schema = three_columns();
        let batches = vec![
            batch(&schema, 0, 5),
            batch(&schema, 5, 7),
            batch(&schema, 12, 3),
            batch(&schema, 15, 0),
            batch(&schema, 15, 1),
        ];
        let (bytes, file) =
            write_parquet(&schema, &batches, 4, "t/data/x.parquet".into()).expect("written");
        assert_eq!(file.rows, 16);
        assert_eq!(file.bytes, bytes.len() as u64);
        assert_eq!(file.time_ranges.get("time"), Some(&(0, 15_000)));

        let reader = SerializedFileReader::new(bytes.clone()).expect("parquet");
        let groups: Vec<i64> = reader
            .metadata()
            .row_groups()
            .iter()
            .map(|g| g.num_rows())
            .collect();
        assert_eq!(groups, vec![4, 4, 4, 4]);

        let read = read_parquet(&[bytes]).expect("read back");
        let read = arrow_select::concat::concat_batches(&schema, &read).expect("concat");
        let expected = arrow_select::concat::concat_batches(&schema, &batches).expect("concat");
        assert_eq!(read, expected);
    }

    /// Rows that reach a flush out of time order are written in time order within each row
    /// group (nulls first, rows of one time in the order they came), and every row is kept:
    /// the groups hold the same rows as before, and the file's time range is unchanged.
    #[test]
    fn each_row_group_is_written_in_time_order() {
        let schema: SchemaRef = Arc::new(Schema::new(vec![
            Field::new(
                "time",
                DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
                true,
            ),
            Field::new("id", DataType::Int64, false),
        ]));
        let make = |times: &[Option<i64>], from: i64| {
            let ids: Vec<i64> = (from..from + times.len() as i64).collect();
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(TimestampNanosecondArray::from(times.to_vec()).with_timezone("UTC")),
                    Arc::new(Int64Array::from(ids)),
                ],
            )
            .expect("batch")
        };
        // Two loaders' stretches interleaved, a tie across batches, a null; groups of 4.
        let batches = vec![
            make(&[Some(50), Some(60), Some(70)], 0),
            make(&[Some(50), Some(20), Some(60), None, Some(30)], 3),
            make(&[Some(5), Some(5)], 8),
        ];
        let (bytes, file) =
            write_parquet(&schema, &batches, 4, "t/data/x.parquet".into()).expect("written");
        assert_eq!(file.rows, 10);
        assert_eq!(file.time_ranges.get("time"), Some(&(5, 70)));
        let read = read_parquet(&[bytes]).expect("read back");
        let read = arrow_select::concat::concat_batches(&schema, &read).expect("concat");
        let times: Vec<Option<i64>> = read
            .column(0)
            .as_primitive::<TimestampNanosecondType>()
            .iter()
            .collect();
        let ids: Vec<i64> = read
            .column(1)
            .as_primitive::<arrow_array::types::Int64Type>()
            .values()
            .to_vec();
        // Group 1: ids 0..4 (50, 60, 70, 50: the tie keeps id 0 first); group 2: ids 4..8
        // (20, 60, null, 30); group 3: ids 8, 9 (5, 5), already in order.
        assert_eq!(
            times,
            vec![
                Some(50),
                Some(50),
                Some(60),
                Some(70),
                None,
                Some(20),
                Some(30),
                Some(60),
                Some(5),
                Some(5),
            ]
        );
        assert_eq!(ids, vec![0, 3, 1, 2, 6, 4, 7, 5, 8, 9]);
    }

    /// Columns of few short values are written dictionary-encoded and uncompressed, the
    /// others compressed; so is a column whose sampled rows hold few values but whose
    /// other rows overflow the dictionary, or need wide indices. Every value reads back.
    #[test]
    fn chunks_of_few_values_are_written_uncompressed() {
        let names = ["level", "status", "text", "long", "overflow", "wide"];
        let types = [
            DataType::Utf8,
            DataType::Int64,
            DataType::Utf8,
            DataType::Utf8,
            DataType::Utf8,
            DataType::Utf8View,
        ];
        let schema: SchemaRef = Arc::new(Schema::new(
            (names.iter().zip(types))
                .map(|(name, data_type)| Field::new(*name, data_type, true))
                .collect::<Vec<_>>(),
        ));
        let rows = 100_000;
        let step = (rows / SAMPLED_ROWS) | 1;
        let level = StringArray::from_iter(
            (0..rows).map(|i| (i % 7 != 0).then(|| ["debug", "info", "warn"][i % 3])),
        );
        let status = Int64Array::from_iter_values((0..rows).map(|i| [200, 404, 500][i % 3]));
        let text = StringArray::from_iter_values((0..rows).map(|i| format!("event {i:08}")));
        // Ten values, but 20 KiB of them.
        let long = StringArray::from_iter_values((0..rows).map(|i| format!("{:02048}", i % 10)));
        // One value on every sampled row; between them, distinct values past the dictionary
        // page's limit (1 MiB), or 1,500 short ones (a small dictionary, 11-bit indices).
        let sampled = |i: usize, other: String| {
            if i.is_multiple_of(step) {
                "same".into()
            } else {
                other
            }
        };
        let overflow =
            StringArray::from_iter_values((0..rows).map(|i| sampled(i, format!("{i:040}"))));
        let wide = arrow_array::StringViewArray::from_iter_values(
            (0..rows).map(|i| sampled(i, format!("{:04}", i % 1500))),
        );
        let columns: Vec<ArrayRef> = vec![
            Arc::new(level),
            Arc::new(status),
            Arc::new(text),
            Arc::new(long),
            Arc::new(overflow),
            Arc::new(wide),
        ];
        let batch = RecordBatch::try_new(schema.clone(), columns).expect("batch");
        let batches = vec![batch.slice(0, 30_000), batch.slice(30_000, rows - 30_000)];
        let (bytes, _) =
            write_parquet(&schema, &batches, rows, "t/data/x.parquet".into()).expect("written");

        let reader = SerializedFileReader::new(bytes.clone()).expect("parquet");
        let group = reader.metadata().row_group(0);
        let written: Vec<(&str, Compression)> = names
            .iter()
            .zip(group.columns())
            .map(|(name, c)| (*name, c.compression()))
            .collect();
        let zstd = zstd().expect("zstd");
        assert_eq!(
            written,
            vec![
                ("level", Compression::UNCOMPRESSED),
                ("status", Compression::UNCOMPRESSED),
                ("text", zstd),
                ("long", zstd),
                ("overflow", zstd),
                ("wide", zstd),
            ]
        );
        let read = read_parquet(&[bytes]).expect("read back");
        let read = arrow_select::concat::concat_batches(&schema, &read).expect("concat");
        assert_eq!(read, batch);

        // A small row group: 32 values of 400 bytes are few, but more than a byte a row.
        let schema: SchemaRef = Arc::new(Schema::new(vec![Field::new("v", DataType::Utf8, false)]));
        let values = StringArray::from_iter_values((0..500).map(|i| format!("{:0400}", i % 32)));
        let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(values)]).expect("batch");
        let (bytes, _) = write_parquet(&schema, std::slice::from_ref(&batch), 500, "t/x".into())
            .expect("written");
        let reader = SerializedFileReader::new(bytes.clone()).expect("parquet");
        assert_eq!(reader.metadata().row_group(0).column(0).compression(), zstd);
        let read = read_parquet(&[bytes]).expect("read back");
        let read = arrow_select::concat::concat_batches(&schema, &read).expect("concat");
        assert_eq!(read, batch);
    }

    /// A group whose batches hold an interval column as `Duration` (the table's type) and as
    /// `Int64` (the file type, as compaction reads newer files back) is put in time order as
    /// well: each batch's column becomes its file type before the rows are gathered.
    #[test]
    fn rows_of_mixed_interval_types_are_put_in_time_order() {
        use arrow_array::DurationNanosecondArray;
        let time = Field::new(
            "time",
            DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
            false,
        );
        let table: SchemaRef = Arc::new(Schema::new(vec![
            time.clone(),
            Field::new("took", DataType::Duration(TimeUnit::Nanosecond), false),
        ]));
        let times = |t: Vec<i64>| -> ArrayRef {
            Arc::new(TimestampNanosecondArray::from(t).with_timezone("UTC"))
        };
        let old = RecordBatch::try_new(
            table.clone(),
            vec![
                times(vec![30, 10]),
                Arc::new(DurationNanosecondArray::from(vec![3, 1])),
            ],
        )
        .expect("batch");
        let as_file = Arc::new(Schema::new(vec![
            time,
            Field::new("took", DataType::Int64, false),
        ]));
        let new = RecordBatch::try_new(
            as_file,
            vec![times(vec![20]), Arc::new(Int64Array::from(vec![2]))],
        )
        .expect("batch");
        let (bytes, _) =
            write_parquet(&table, &[old, new], 8, "t/data/x.parquet".into()).expect("written");
        let read = read_parquet(&[bytes]).expect("read back");
        let read = arrow_select::concat::concat_batches(&read[0].schema(), &read).expect("concat");
        let took: Vec<i64> = read
            .column(1)
            .as_primitive::<arrow_array::types::Int64Type>()
            .values()
            .to_vec();
        assert_eq!(took, vec![1, 2, 3]);
    }
}
