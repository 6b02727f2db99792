//! Parquet scans that hand string columns to a grouping as dictionaries.
//!
//! sluice writes low-cardinality strings (service, name, region) as Parquet dictionary pages.
//! A scan reads them as `Utf8View`: every row's 16-byte view is gathered from the page's
//! dictionary, and a grouping then finds each row's group by that view. Read as an Arrow
//! `Dictionary(Int32, Utf8)` instead, a row is its dictionary key; the values are decoded
//! once per column chunk and shared by all of that chunk's batches, so a grouping maps the
//! few values to groups once and each row through an array of ids (see
//! `grouping::KeyColumn`).
//!
//! [`dictionary_scan`] rewrites a table's Parquet scan ([`crate::query::provider`]) so that
//! chosen output columns come as dictionaries. It is used only under a keyed partial
//! aggregate that groups by those columns and reads them for nothing else; everything above
//! that operator still sees the table's types.
//!
//! Invariants:
//! - A column is read as a dictionary only if, in every file the scan reads, every column
//!   chunk of it looks dictionary-encoded ([`all_pages_dictionary`]: by its encoding
//!   statistics, or else by a small dictionary page), and only if the scan's predicate does
//!   not read it (the predicate was planned against `Utf8View`). This is for speed: a chunk
//!   whose dictionary overflowed into plain pages makes the reader build a dictionary by
//!   hashing each value, and the answer is the same either way.
//! - The rewritten scan reads the same files, ranges, rows and predicate; only the chosen
//!   columns' types differ. Each file's Arrow schema is given to the reader (from its footer,
//!   [`FileFooter`]) with those columns as dictionaries.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow_schema::{DataType, Field, FieldRef, Schema, SchemaRef};
use datafusion::datasource::physical_plan::{
    FileGroup, FileScanConfig, FileScanConfigBuilder, FileSource as _, ParquetSource,
};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::Result;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::expressions::Column;
use parquet::arrow::parquet_to_arrow_schema;
use parquet::file::metadata::{ColumnChunkMetaData, ParquetMetaData};

use crate::table::dictionary_pages_only;

/// A scanned file's footer, attached to its ranges by the table provider, so that a rewrite
/// can tell how each column was encoded and what Arrow schema the file has.
#[derive(Debug, Clone)]
pub(crate) struct FileFooter(pub(crate) Arc<ParquetMetaData>);

/// The type a dictionary-read string column has.
fn dictionary_type() -> DataType {
    DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8))
}

/// `plan`, a table's Parquet scan, with its output columns `columns` read as
/// [`dictionary_type`]; `None` when it is not such a scan or a column does not qualify (see
/// the module documentation), or when a table column of `columns` is also projected to an
/// output not in `columns` (the rewrite is by table column, and the caller reads only
/// `columns` as dictionaries).
pub(crate) fn dictionary_scan(
    plan: &Arc<dyn ExecutionPlan>,
    columns: &[usize],
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    if columns.is_empty() {
        return Ok(None);
    }
    let Some(config) = plan
        .downcast_ref::<DataSourceExec>()
        .and_then(|exec| exec.data_source().downcast_ref::<FileScanConfig>())
    else {
        return Ok(None);
    };
    let Some(source) = config.file_source().downcast_ref::<ParquetSource>() else {
        return Ok(None);
    };
    let table = config.file_source().table_schema().table_schema().clone();
    if !config.table_partition_cols().is_empty() {
        return Ok(None);
    }
    // The scan's output columns, as columns of the table (a computed projection: no rewrite).
    let Some(projection) = config.file_source().projection() else {
        return Ok(None);
    };
    let mut projected = Vec::new();
    for expr in projection.iter() {
        let Some(column) = expr.expr.downcast_ref::<Column>() else {
            return Ok(None);
        };
        projected.push(column.index());
    }
    let predicate = source.filter();
    let read_by_predicate: HashSet<usize> = predicate
        .as_ref()
        .map(|p| collect_columns(p).iter().map(Column::index).collect())
        .unwrap_or_default();
    let mut chosen = HashSet::new();
    for &output in columns {
        let Some(&index) = projected.get(output) else {
            return Ok(None);
        };
        if table.field(index).data_type() != &DataType::Utf8View
            || read_by_predicate.contains(&index)
        {
            return Ok(None);
        }
        chosen.insert(table.field(index).name().clone());
    }
    // A chosen column projected more than once (`SELECT s AS a, s AS b`) is read as a
    // dictionary at every place: each must be one the caller asked for.
    for (output, &index) in projected.iter().enumerate() {
        if chosen.contains(table.field(index).name()) && !columns.contains(&output) {
            return Ok(None);
        }
    }
    // Every file's Arrow schema, with the chosen columns as dictionaries.
    let mut hints: HashMap<String, SchemaRef> = HashMap::new();
    let mut groups = Vec::with_capacity(config.file_groups.len());
    for group in &config.file_groups {
        let mut files = Vec::with_capacity(group.len());
        for file in group.iter() {
            let path = file.object_meta.location.to_string();
            let hint = match hints.get(&path) {
                Some(hint) => Arc::clone(hint),
                None => {
                    let Some(footer) = file.extensions.get::<FileFooter>() else {
                        return Ok(None);
                    };
                    let Some(hint) = file_schema(&footer.0, &chosen) else {
                        return Ok(None);
                    };
                    hints.insert(path, Arc::clone(&hint));
                    hint
                }
            };
            files.push(file.clone().with_arrow_schema(hint));
        }
        groups.push(FileGroup::new(files));
    }
    let fields: Vec<FieldRef> = table
        .fields()
        .iter()
        .map(|f| match chosen.contains(f.name()) {
            true => Arc::new(f.as_ref().clone().with_data_type(dictionary_type())),
            false => Arc::clone(f),
        })
        .collect();
    let schema = Arc::new(Schema::new_with_metadata(fields, table.metadata().clone()));
    let mut rewritten = ParquetSource::new(schema)
        .with_table_parquet_options(source.table_parquet_options().clone());
    if let Some(factory) = source.parquet_file_reader_factory() {
        rewritten = rewritten.with_parquet_file_reader_factory(Arc::clone(factory));
    }
    if let Some(predicate) = predicate {
        rewritten = rewritten.with_predicate(predicate);
    }
    let config = FileScanConfigBuilder::from(config.clone())
        .with_source(Arc::new(rewritten))
        .with_projection_indices(Some(projected))?
        .with_file_groups(groups)
        .build();
    Ok(Some(DataSourceExec::from_data_source(config)))
}

/// The Arrow schema of the file with this footer, with the columns named in `chosen` as
/// [`dictionary_type`]; `None` if one of them is not a string column whose every data page
/// is dictionary-encoded.
fn file_schema(footer: &ParquetMetaData, chosen: &HashSet<String>) -> Option<SchemaRef> {
    let file = footer.file_metadata();
    let schema = parquet_to_arrow_schema(file.schema_descr(), file.key_value_metadata()).ok()?;
    let mut found = 0;
    let mut fields = Vec::with_capacity(schema.fields().len());
    for field in schema.fields() {
        if !chosen.contains(field.name()) {
            fields.push(Arc::clone(field));
            continue;
        }
        if field.data_type() != &DataType::Utf8 {
            return None;
        }
        // A top-level string column is one leaf, by the same name.
        let leaf = file
            .schema_descr()
            .columns()
            .iter()
            .position(|c| c.path().parts() == [field.name().as_str()])?;
        for group in footer.row_groups() {
            if !all_pages_dictionary(group.columns().get(leaf)?) {
                return None;
            }
        }
        found += 1;
        fields.push(Arc::new(
            Field::clone(field).with_data_type(dictionary_type()),
        ));
    }
    (found == chosen.len())
        .then(|| Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone())))
}

/// The most bytes a column chunk's dictionary page may take, as stored, for the chunk to
/// count as dictionary-encoded when it has no encoding statistics (see
/// [`all_pages_dictionary`]).
const SMALL_DICTIONARY_PAGE: i64 = 64 << 10;

/// Whether every data page of `column` is dictionary-encoded, as its encoding statistics
/// say. Files that compaction merged carry none (their footers are rebuilt without them);
/// for them, a chunk counts as dictionary-encoded if its dictionary page is small. A
/// Parquet writer falls back to plain pages only once the dictionary has grown to its page
/// size limit (1 MiB), so a chunk with a page of at most [`SMALL_DICTIONARY_PAGE`] stored
/// bytes fell back only if the dictionary compressed more than 16 times. Getting this
/// wrong costs speed, never an answer: the reader builds a dictionary for plain pages too.
fn all_pages_dictionary(column: &ColumnChunkMetaData) -> bool {
    if let Some(only) = dictionary_pages_only(column) {
        return only;
    }
    let Some(dictionary_page) = column.dictionary_page_offset() else {
        return false;
    };
    let stored = column.data_page_offset() - dictionary_page;
    (0..=SMALL_DICTIONARY_PAGE).contains(&stored)
}
