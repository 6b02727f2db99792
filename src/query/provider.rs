//! A sluice table as a DataFusion table: its Parquet files plus its unflushed batches.

use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{DataType, Field, FieldRef, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::ScalarValue;
use datafusion::common::stats::Precision;
use datafusion::datasource::TableProvider;
use datafusion::datasource::TableType;
use datafusion::datasource::listing::PartitionedFile;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::datasource::physical_plan::parquet::CachedParquetFileReaderFactory;
use datafusion::datasource::physical_plan::parquet::metadata::DFParquetMetadata;
use datafusion::datasource::physical_plan::{FileGroup, FileScanConfigBuilder, ParquetSource};
use datafusion::datasource::source::DataSourceExec;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::{BinaryExpr, Expr, Operator, TableProviderFilterPushDown};
use datafusion::physical_expr::expressions::Column as PhysicalColumn;
use datafusion::physical_expr_adapter::{
    DefaultPhysicalExprAdapterFactory, PhysicalExprAdapter, PhysicalExprAdapterFactory,
};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::SendableRecordBatchStream;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::projection::{ProjectionExec, ProjectionExpr};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
use datafusion::physical_plan::union::UnionExec;
use parquet::basic::{LogicalType, TimestampType};
use parquet::file::metadata::{ParquetMetaData, RowGroupMetaData};
use parquet::file::statistics::Statistics;

use crate::query::dictionary_scan::FileFooter;
use crate::table::{DataFile, SpilledBatches, Tables};

/// How a scan maps the table's columns to a file's: DataFusion's adapter, shown each file
/// column with the metadata and nullability of the table's column of the same name and type.
///
/// Files differ from the table's schema in field metadata (the Iceberg field ids of files
/// written since the Iceberg view, [`crate::iceberg`]) and, for intervals and uints, in type
/// (`Int64`; see `table::files::file_schema`). DataFusion casts every column whose field
/// differs in anything, metadata included: a difference in metadata alone must not cost a
/// cast. A difference in type is cast, and a comparison with a literal still prunes row
/// groups and pages: DataFusion casts the literal to the file's type (or the statistics to
/// the table's), which is exact for `Int64` read as `Duration` or as `UInt64` of the values
/// sluice writes. (A filter on an interval column with an `INTERVAL` literal is turned into
/// one on the `Duration` first: `query::pruning`.)
#[derive(Debug)]
struct FileColumns;

impl PhysicalExprAdapterFactory for FileColumns {
    fn create(
        &self,
        logical_file_schema: SchemaRef,
        physical_file_schema: SchemaRef,
    ) -> Result<Arc<dyn PhysicalExprAdapter>> {
        let fields: Vec<FieldRef> = physical_file_schema
            .fields()
            .iter()
            .map(|f| match logical_file_schema.field_with_name(f.name()) {
                Ok(table) if table.data_type() == f.data_type() => Arc::new(
                    f.as_ref()
                        .clone()
                        .with_metadata(table.metadata().clone())
                        .with_nullable(table.is_nullable()),
                ),
                _ => f.clone(),
            })
            .collect();
        let physical = Arc::new(Schema::new_with_metadata(
            fields,
            physical_file_schema.metadata().clone(),
        ));
        DefaultPhysicalExprAdapterFactory.create(logical_file_schema, physical)
    }
}

/// The object-store URL under which DataFusion reads a sluice database's files.
pub(crate) const STORE_URL: &str = "sluice://data/";

/// One table, read through [`Tables::snapshot`] at scan time.
#[derive(Debug)]
pub(crate) struct SluiceTable {
    id: String,
    /// The stored schema with strings and bytes as views (see [`SluiceTable::new`]).
    schema: SchemaRef,
    tables: Arc<Tables>,
}

impl SluiceTable {
    /// The table `id` whose stored schema is `stored`.
    ///
    /// Queries see string and binary columns as views (`Utf8View`, `BinaryView`): the
    /// Parquet reader then points into each page's dictionary instead of copying every
    /// value out of it, and grouping and comparing short strings works on the 16-byte views.
    /// Unflushed batches are cast to match when scanned ([`cast_to`]).
    pub(crate) fn new(id: String, stored: &SchemaRef, tables: Arc<Tables>) -> Self {
        let fields: Vec<Field> = stored
            .fields()
            .iter()
            .map(|f| {
                let data_type = match f.data_type() {
                    DataType::Utf8 => DataType::Utf8View,
                    DataType::Binary => DataType::BinaryView,
                    other => other.clone(),
                };
                f.as_ref().clone().with_data_type(data_type)
            })
            .collect();
        SluiceTable {
            id,
            schema: Arc::new(Schema::new_with_metadata(fields, stored.metadata().clone())),
            tables,
        }
    }
}

/// `batch` with each column cast to the type `schema` gives it (an unflushed batch's stored
/// types to the query's views; a dictionary scan's batch back to the scan it replaced).
pub(crate) fn cast_to(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    let columns = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(
            |(column, field)| match column.data_type() == field.data_type() {
                true => Ok(Arc::clone(column)),
                false => arrow_cast::cast(column, field.data_type()),
            },
        )
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}

#[async_trait]
impl TableProvider for SluiceTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        // Filters prune files and row groups; DataFusion still applies them to rows.
        Ok(vec![TableProviderFilterPushDown::Inexact; filters.len()])
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let snapshot = match self.tables.snapshot(&self.id).await {
            Ok(snapshot) => snapshot,
            // In the catalog, its storage not created yet (a failed write after the catalog
            // change, or a crash between the two): it reads as empty.
            Err(crate::table::TableError::NotFound(_)) => crate::table::TableSnapshot {
                schema: self.schema.clone(),
                files: Vec::new(),
                spilled: None,
                batches: Vec::new(),
                version: 0,
            },
            Err(e) => return Err(DataFusionError::External(Box::new(e))),
        };
        let mut inputs: Vec<Arc<dyn ExecutionPlan>> = Vec::new();
        // Files whose columns are the table's by name and id are scanned (and pruned) as the
        // table; each other shape (written before a column was renamed, dropped, or its name
        // reused) is scanned as its own view of the table's columns, renamed back above it.
        let ids = crate::types::field_ids(&self.schema);
        let mut aligned: Vec<&DataFile> = Vec::new();
        let mut shapes: Vec<(SchemaRef, Vec<&DataFile>)> = Vec::new();
        for f in &snapshot.files {
            match file_view(&self.schema, &ids, &f.field_ids) {
                None => {
                    if may_match(f, filters) {
                        aligned.push(f);
                    }
                }
                Some(view) => match shapes.iter_mut().find(|(v, _)| *v == view) {
                    Some((_, files)) => files.push(f),
                    None => shapes.push((view, vec![f])),
                },
            }
        }
        if let Some(scan) = self
            .parquet_scan(state, &self.schema, aligned, projection, filters, limit)
            .await?
        {
            inputs.push(scan);
        }
        for (view, files) in shapes {
            let Some(scan) = self
                .parquet_scan(state, &view, files, projection, &[], limit)
                .await?
            else {
                continue;
            };
            let columns: Vec<usize> = match projection {
                Some(p) => p.clone(),
                None => (0..self.schema.fields().len()).collect(),
            };
            let exprs: Vec<ProjectionExpr> = columns
                .iter()
                .enumerate()
                .map(|(i, c)| ProjectionExpr {
                    expr: Arc::new(PhysicalColumn::new(view.field(*c).name(), i)),
                    alias: self.schema.field(*c).name().clone(),
                })
                .collect();
            inputs.push(Arc::new(ProjectionExec::try_new(exprs, scan)?));
        }
        if let Some(spilled) = snapshot.spilled {
            let scan = SpilledScan {
                batches: spilled,
                schema: self.schema.clone(),
            };
            inputs.push(Arc::new(StreamingTableExec::try_new(
                self.schema.clone(),
                vec![Arc::new(scan)],
                projection,
                Vec::new(),
                false,
                None,
            )?));
        }
        if !snapshot.batches.is_empty() {
            let batches = snapshot
                .batches
                .iter()
                .map(|b| Ok(crate::types::project_by_id(b, &self.schema)?))
                .collect::<Result<Vec<_>>>()?;
            inputs.push(MemorySourceConfig::try_new_exec(
                &[batches],
                self.schema.clone(),
                projection.cloned(),
            )?);
        }
        match inputs.len() {
            0 => {
                let projected = match projection {
                    Some(p) => Arc::new(self.schema.project(p)?),
                    None => self.schema.clone(),
                };
                Ok(Arc::new(EmptyExec::new(projected)))
            }
            1 => Ok(inputs.remove(0)),
            _ => UnionExec::try_new(inputs),
        }
    }
}

impl SluiceTable {
    /// The scan of Parquet `files` as `schema` (the table's, or a view of it that names its
    /// columns as these files do: see [`file_view`]); pruned by `filters` (none for a view:
    /// the filters name the table's columns). `None` when no row group may match.
    async fn parquet_scan(
        &self,
        state: &dyn Session,
        schema: &SchemaRef,
        files: Vec<&DataFile>,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        if files.is_empty() {
            return Ok(None);
        }
        // Footers and page indexes come from the runtime's cache. Filters are not pushed
        // into the Parquet reader: on the query bench, row-level pushdown made the
        // typical filters (a quarter or a fifth of the rows) 1.5 to 2 times slower, and
        // helped only the JSON extraction. The scan's predicate (which prunes row groups
        // and pages) is not set here: DataFusion's physical filter pushdown gives the
        // scan the conjuncts of the filter above it, and a predicate set here as well
        // was evaluated twice in every pruning step.
        let store = state
            .runtime_env()
            .object_store(ObjectStoreUrl::parse(STORE_URL)?)?;
        let footers = state.runtime_env().cache_manager.get_file_metadata_cache();
        let source = ParquetSource::new(schema.clone())
            .with_parquet_file_reader_factory(Arc::new(CachedParquetFileReaderFactory::new(
                store.clone(),
                footers.clone(),
            )))
            // sluice writes no bloom filters: looking for them is wasted work per row group.
            .with_bloom_filter_on_read(false);
        let mut builder =
            FileScanConfigBuilder::new(ObjectStoreUrl::parse(STORE_URL)?, Arc::new(source))
                .with_projection_indices(projection.cloned())?
                .with_limit(limit)
                .with_expr_adapter(Some(Arc::new(FileColumns)));
        // Whether every file's footer was read (a file that cannot be read must fail the
        // query as it would fail a scan, not be counted from the manifest).
        let mut readable = true;
        // About four ranges a partition when whole files are read (see `scan_ranges`).
        let total: u64 = files.iter().map(|f| f.bytes).sum();
        let rows: u64 = files.iter().map(|f| f.rows).sum();
        let partitions = state.config().target_partitions().max(1);
        let range_bytes = (total / (4 * partitions as u64)).max(MIN_RANGE_BYTES);
        let mut ranges = Vec::new();
        for f in files {
            let file = PartitionedFile::new(f.path.clone(), f.bytes);
            // Footers come from (and stay in) the runtime's cache; a file whose footer
            // cannot be read is scanned whole and fails there.
            let metadata = DFParquetMetadata::new(store.as_ref(), &file.object_meta)
                .with_file_metadata_cache(Some(footers.clone()))
                .fetch_metadata()
                .await;
            let Ok(metadata) = metadata else {
                readable = false;
                ranges.push((file, f.bytes));
                continue;
            };
            for range in scan_ranges(&metadata, schema, filters, range_bytes) {
                let (start, end) = (range.start, range.end);
                let statistics = range.statistics(schema);
                let mut range = file
                    .clone()
                    .with_range(start as i64, end as i64)
                    .with_statistics(Arc::new(statistics));
                // For a grouping that reads strings as dictionaries (`dictionary_scan`).
                range.extensions.insert(FileFooter(Arc::clone(&metadata)));
                ranges.push((range, end - start));
            }
        }
        // The manifest's row counts: with no filter every row of every file is read, so
        // the count is exact and `count(*)` is answered from it without reading a page.
        // (Not the footers' bounds of timestamp columns for `min(time)`: DataFusion
        // carries exact bounds through any cast, and a time of day's are not a cast's.)
        let mut statistics = datafusion::common::Statistics::new_unknown(schema);
        statistics.num_rows = match usize::try_from(rows) {
            Ok(rows) if readable && filters.is_empty() => Precision::Exact(rows),
            Ok(rows) => Precision::Inexact(rows),
            Err(_) => Precision::Absent,
        };
        builder = builder.with_statistics(statistics);
        // No range: no row group of any file may match.
        if !ranges.is_empty() {
            builder = builder.with_file_groups(contiguous_groups(ranges, partitions));
            return Ok(Some(DataSourceExec::from_data_source(builder.build())));
        }
        Ok(None)
    }
}

/// The table's columns (`table`, with ids `ids`) as a file whose columns have the ids
/// `file` (by name) holds them: `None` when the file names each of its columns the table
/// has by the table's name for it (and holds no other under a name the table uses), so it
/// reads as the table; else the table's schema with each column renamed to the file's name
/// for its id, or to a name no column can have when the file lacks it (it reads as NULL).
fn file_view(
    table: &SchemaRef,
    ids: &[i32],
    file: &std::collections::BTreeMap<String, i32>,
) -> Option<SchemaRef> {
    let aligned = file.iter().all(|(name, id)| match table.index_of(name) {
        Ok(i) => ids.get(i) == Some(id),
        Err(_) => !ids.contains(id),
    });
    if aligned {
        return None;
    }
    let fields: Vec<Field> = table
        .fields()
        .iter()
        .zip(ids)
        .map(|(f, id)| {
            let name = file
                .iter()
                .find(|(_, file_id)| *file_id == id)
                .map_or_else(|| format!("absent column {id}"), |(name, _)| name.clone());
            f.as_ref().clone().with_name(name)
        })
        .collect();
    Some(Arc::new(Schema::new_with_metadata(
        fields,
        table.metadata().clone(),
    )))
}

/// A table's spilled batches, read back from the commit log while the scan goes: a blocking
/// thread reads and decodes them one at a time, at most two ahead of the scan (one waiting
/// in the channel, one being read).
#[derive(Debug)]
struct SpilledScan {
    batches: SpilledBatches,
    schema: SchemaRef,
}

/// The reading thread of a [`SpilledScan`]: its batches, and its end.
struct SpilledReader {
    rx: tokio::sync::mpsc::Receiver<Result<RecordBatch>>,
    thread: tokio::task::JoinHandle<()>,
}

impl PartitionStream for SpilledScan {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _: Arc<TaskContext>) -> SendableRecordBatchStream {
        let start = Some((self.batches.clone(), self.schema.clone()));
        // The reading thread starts at the first poll (inside the query's runtime); it stops
        // once the scan is dropped or a read fails. A thread that ended without sending
        // every batch (a panic) fails the scan rather than end it short.
        let stream = futures::stream::unfold(
            (start, None::<SpilledReader>),
            |(start, reader)| async move {
                let mut reader = match (reader, start) {
                    (Some(reader), _) => reader,
                    (None, Some((batches, schema))) => {
                        let (tx, rx) = tokio::sync::mpsc::channel(1);
                        let thread = tokio::task::spawn_blocking(move || {
                            for batch in batches.read() {
                                let batch = batch
                                    .map_err(|e| DataFusionError::External(Box::new(e)))
                                    .and_then(|b| Ok(crate::types::project_by_id(&b, &schema)?));
                                let failed = batch.is_err();
                                if tx.blocking_send(batch).is_err() || failed {
                                    return;
                                }
                            }
                        });
                        SpilledReader { rx, thread }
                    }
                    (None, None) => return None,
                };
                match reader.rx.recv().await {
                    Some(next) => Some((next, (None, Some(reader)))),
                    None => match (&mut reader.thread).await {
                        Ok(()) => None,
                        Err(e) => Some((
                            Err(DataFusionError::Execution(format!(
                                "reading spilled batches back from the log failed: {e}"
                            ))),
                            (None, None),
                        )),
                    },
                }
            },
        );
        Box::pin(RecordBatchStreamAdapter::new(self.schema.clone(), stream))
    }
}

/// `ranges` (each with its size in bytes), in order, as at most `groups` groups of
/// consecutive ranges of about equal size. A partition reads its group's ranges one after
/// the other, so a filter that tightens as the query runs (a top-N's threshold) prunes the
/// pages of all but the first. (DataFusion re-splits scans of at least
/// `repartition_file_min_size` bytes evenly by size, keeping the order; smaller ones it
/// would read with a partition for each range.)
fn contiguous_groups(ranges: Vec<(PartitionedFile, u64)>, groups: usize) -> Vec<FileGroup> {
    let mut left: u64 = ranges.iter().map(|(_, bytes)| bytes).sum();
    let mut groups_left = groups.clamp(1, ranges.len().max(1));
    let mut out = Vec::new();
    let mut current = Vec::new();
    let mut current_bytes = 0;
    let count = ranges.len();
    for (i, (range, bytes)) in ranges.into_iter().enumerate() {
        current.push(range);
        current_bytes += bytes;
        // Close the group once it holds its share of what is left, or when every group
        // still to fill needs one of the ranges left.
        let ranges_left = count - i - 1;
        if groups_left > 1
            && (current_bytes * groups_left as u64 >= left || ranges_left < groups_left)
        {
            out.push(FileGroup::new(std::mem::take(&mut current)));
            left -= current_bytes;
            current_bytes = 0;
            groups_left -= 1;
        }
    }
    if !current.is_empty() {
        out.push(FileGroup::new(current));
    }
    out
}

/// The smallest byte range a scan is cut into (see [`scan_ranges`]): opening a range costs
/// a fraction of a millisecond.
const MIN_RANGE_BYTES: u64 = 4 << 20;

/// Whether a file may hold rows matching every filter, judged by its timestamp ranges.
fn may_match(file: &DataFile, filters: &[Expr]) -> bool {
    let ranges = |column: &str| file.time_ranges.get(column).copied();
    filters.iter().all(|f| may_match_one(&ranges, f))
}

/// Whether rows whose timestamp columns lie within the ranges `ranges` gives (`None`: not
/// known) may match `filter`.
fn may_match_one(ranges: &dyn Fn(&str) -> Option<(i64, i64)>, filter: &Expr) -> bool {
    let Expr::BinaryExpr(BinaryExpr { left, op, right }) = filter else {
        return true;
    };
    match op {
        Operator::And => return may_match_one(ranges, left) && may_match_one(ranges, right),
        Operator::Or => return may_match_one(ranges, left) || may_match_one(ranges, right),
        _ => {}
    }
    // column op literal, or literal op column (flipped).
    let (column, op, value) = match (left.as_ref(), right.as_ref()) {
        (Expr::Column(c), Expr::Literal(v, _)) => (c, *op, v),
        (Expr::Literal(v, _), Expr::Column(c)) => match op.swap() {
            Some(flipped) => (c, flipped, v),
            None => return true,
        },
        _ => return true,
    };
    let Some((min, max)) = ranges(&column.name) else {
        return true;
    };
    let Some(v) = timestamp_nanos(value) else {
        return true;
    };
    match op {
        Operator::Eq => min <= v && v <= max,
        Operator::Lt => min < v,
        Operator::LtEq => min <= v,
        Operator::Gt => max > v,
        Operator::GtEq => max >= v,
        _ => true,
    }
}

/// A byte range of a file to scan: consecutive whole row groups.
#[derive(Debug, Clone, PartialEq)]
struct ScanRange {
    start: u64,
    end: u64,
    /// Rows in its row groups.
    rows: u64,
    /// For each timestamp column (by its index in the table schema), the smallest and
    /// largest value and the number of nulls in the range, from the row groups' statistics;
    /// `None` if a row group has none.
    times: Vec<(usize, Option<TimeStatistics>)>,
}

/// What a Parquet column chunk's statistics say of a timestamp column.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TimeStatistics {
    min: i64,
    max: i64,
    nulls: u64,
}

impl TimeStatistics {
    /// Of one column chunk, if its statistics hold a minimum, a maximum and a null count
    /// (a chunk of nulls only has no minimum: then `None`, which prunes nothing).
    fn of(statistics: Option<&Statistics>) -> Option<Self> {
        match statistics? {
            Statistics::Int64(s) => Some(TimeStatistics {
                min: *s.min_opt()?,
                max: *s.max_opt()?,
                nulls: s.null_count_opt()?,
            }),
            _ => None,
        }
    }

    fn merge(self, other: Self) -> Self {
        TimeStatistics {
            min: self.min.min(other.min),
            max: self.max.max(other.max),
            nulls: self.nulls + other.nulls,
        }
    }
}

impl ScanRange {
    /// DataFusion's statistics of the range, over the whole table schema: its exact row
    /// count, and its timestamp columns' bounds and null counts, marked inexact; nothing of
    /// the other columns.
    ///
    /// With them, a top-N query on a timestamp column (`ORDER BY time DESC LIMIT 20`, the
    /// most common question asked of logs) reads the most promising ranges first: the scan
    /// hands its ranges to the partitions from one queue, ordered by these minimums, and
    /// each range opened once the top-N's threshold is past its row groups skips them.
    /// Without them the ranges came oldest first, and the threshold tightened only as the
    /// newest data came.
    ///
    /// The bounds are exact (the row groups' own statistics; a range is whole row groups),
    /// but are given as inexact so that DataFusion does not prune ranges or answer
    /// aggregates with them: it carries exact bounds through any cast, and the bounds of
    /// `CAST(time AS TIME)` are not the cast bounds (a range from 23:00 one day to 01:00 the
    /// next was pruned for `CAST(time AS TIME) > '12:00'`). Ordering only needs inexact ones.
    fn statistics(&self, schema: &Schema) -> datafusion::common::Statistics {
        let mut statistics = datafusion::common::Statistics::new_unknown(schema);
        statistics.num_rows =
            usize::try_from(self.rows).map_or(Precision::Absent, Precision::Exact);
        for &(column, bounds) in &self.times {
            let (Some(bounds), Some(field)) = (bounds, schema.fields().get(column)) else {
                continue;
            };
            let DataType::Timestamp(TimeUnit::Nanosecond, tz) = field.data_type() else {
                continue;
            };
            let at =
                |v: i64| Precision::Inexact(ScalarValue::TimestampNanosecond(Some(v), tz.clone()));
            let c = &mut statistics.column_statistics[column];
            c.min_value = at(bounds.min);
            c.max_value = at(bounds.max);
            c.null_count =
                usize::try_from(bounds.nulls).map_or(Precision::Absent, Precision::Inexact);
        }
        statistics
    }
}

/// The byte ranges of a file to scan for `filters`: the runs of consecutive row groups
/// whose time statistics may match, cut at row-group boundaries into ranges of about
/// `range_bytes` (a range is never empty; a row group larger than that is a range of its
/// own). Empty when no row group may match.
///
/// DataFusion opens each range on its own and shares the ranges among partitions by size.
/// Two things follow. Rows a time filter keeps are shared evenly, where DataFusion's own
/// split of whole files by bytes, made before it prunes row groups, left one partition
/// with most of them (63/37 on the query bench's count by service). And filters that
/// tighten while the query runs (a top-N's threshold) prune the pages of every range opened
/// after they have tightened: with one range per file, the first, and largest, file of each
/// partition was read whole.
fn scan_ranges(
    metadata: &ParquetMetaData,
    schema: &Schema,
    filters: &[Expr],
    range_bytes: u64,
) -> Vec<ScanRange> {
    let leaves = metadata.file_metadata().schema_descr();
    // Timestamp columns by name, with their index in the table and their leaf in the file:
    // every one of the table's, in its order, whatever the file holds (ranges of different
    // files are merged column by column), with no leaf where the file has none of
    // nanosecond timestamps by that name (a column added since, or one of another type).
    let time_columns: Vec<(&str, usize, Option<usize>)> = schema
        .fields()
        .iter()
        .enumerate()
        .filter(|(_, f)| matches!(f.data_type(), DataType::Timestamp(_, _)))
        .map(|(column, f)| {
            let name = f.name().as_str();
            let leaf = (0..leaves.num_columns()).find(|&i| {
                let leaf = leaves.column(i);
                leaf.path().string() == name
                    && matches!(
                        leaf.logical_type_ref(),
                        Some(LogicalType::Timestamp(TimestampType {
                            unit: parquet::basic::TimeUnit::NANOS,
                            ..
                        }))
                    )
            });
            (name, column, leaf)
        })
        .collect();
    let mut ranges: Vec<ScanRange> = Vec::new();
    // Whether the last range ends at the row group before this one.
    let mut extends = false;
    for group in metadata.row_groups() {
        let times: Vec<(usize, Option<TimeStatistics>)> = time_columns
            .iter()
            .map(|&(_, column, leaf)| {
                let statistics = leaf.and_then(|leaf| group.column(leaf).statistics());
                (column, TimeStatistics::of(statistics))
            })
            .collect();
        let time_range = |column: &str| {
            let i = time_columns
                .iter()
                .position(|(name, _, _)| *name == column)?;
            times[i].1.map(|t| (t.min, t.max))
        };
        if !filters.iter().all(|f| may_match_one(&time_range, f)) {
            extends = false;
            continue;
        }
        let (start, end) = row_group_bytes(group);
        let rows = u64::try_from(group.num_rows()).unwrap_or(0);
        match ranges.last_mut() {
            Some(last) if extends && last.end == start && last.end - last.start < range_bytes => {
                last.end = end;
                last.rows += rows;
                for ((_, range), (_, group)) in last.times.iter_mut().zip(times) {
                    *range = range.zip(group).map(|(r, g)| r.merge(g));
                }
            }
            _ => ranges.push(ScanRange {
                start,
                end,
                rows,
                times,
            }),
        }
        extends = true;
    }
    ranges
}

/// The byte range a row group's column chunks occupy in its file.
fn row_group_bytes(group: &RowGroupMetaData) -> (u64, u64) {
    group.columns().iter().fold((u64::MAX, 0), |(lo, hi), c| {
        let (offset, length) = c.byte_range();
        (lo.min(offset), hi.max(offset + length))
    })
}

fn timestamp_nanos(value: &ScalarValue) -> Option<i64> {
    match value {
        ScalarValue::TimestampNanosecond(Some(v), _) => Some(*v),
        ScalarValue::TimestampMicrosecond(Some(v), _) => v.checked_mul(1_000),
        ScalarValue::TimestampMillisecond(Some(v), _) => v.checked_mul(1_000_000),
        ScalarValue::TimestampSecond(Some(v), _) => v.checked_mul(1_000_000_000),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use arrow_array::{ArrayRef, Int64Array, TimestampNanosecondArray};
    use datafusion::prelude::{col, lit};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;
    use parquet::file::reader::{FileReader, SerializedFileReader};

    use super::*;

    fn at(nanos: i64) -> Expr {
        lit(ScalarValue::TimestampNanosecond(
            Some(nanos),
            Some("UTC".into()),
        ))
    }

    /// `batch` written as a Parquet file in row groups of `rows_per_group` rows.
    fn parquet_file(
        batch: &RecordBatch,
        rows_per_group: usize,
    ) -> SerializedFileReader<bytes::Bytes> {
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(rows_per_group))
            .build();
        let mut bytes = Vec::new();
        let mut writer = ArrowWriter::try_new(&mut bytes, batch.schema(), Some(props)).unwrap();
        writer.write(batch).unwrap();
        writer.close().unwrap();
        SerializedFileReader::new(bytes::Bytes::from(bytes)).unwrap()
    }

    /// Groups are consecutive, hold about equal bytes, and are never empty.
    #[test]
    fn contiguous_groups_share_bytes_in_order() {
        let grouped = |sizes: &[u64], groups: usize| -> Vec<Vec<String>> {
            let ranges = sizes
                .iter()
                .enumerate()
                .map(|(i, &bytes)| (PartitionedFile::new(format!("f{i}"), bytes), bytes))
                .collect();
            contiguous_groups(ranges, groups)
                .iter()
                .map(|g| {
                    g.iter()
                        .map(|f| f.object_meta.location.to_string())
                        .collect()
                })
                .collect()
        };
        assert_eq!(grouped(&[10, 10, 10, 10], 2), [["f0", "f1"], ["f2", "f3"]]);
        // A large first range is a group of its own; the rest share the other.
        assert_eq!(
            grouped(&[30, 5, 5], 2),
            [
                vec!["f0".to_owned()],
                vec!["f1".to_owned(), "f2".to_owned()]
            ]
        );
        // More groups than ranges: one range each.
        assert_eq!(grouped(&[1, 2], 4), [["f0"], ["f1"]]);
        assert_eq!(grouped(&[1, 2, 3], 1), [["f0", "f1", "f2"]]);
        assert!(grouped(&[], 2).is_empty());
    }

    /// Five row groups of four rows, times 0..20: the ranges cover exactly the row groups a
    /// time filter may match, in runs no longer than asked, and nothing when none may.
    #[test]
    fn ranges_cover_the_row_groups_a_time_filter_keeps() {
        let schema = Arc::new(Schema::new(vec![
            Field::new(
                "time",
                DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
                false,
            ),
            Field::new("n", DataType::Int64, false),
        ]));
        let columns: Vec<ArrayRef> = vec![
            Arc::new(TimestampNanosecondArray::from_iter_values(0..20).with_timezone("UTC")),
            Arc::new(Int64Array::from_iter_values(0..20)),
        ];
        let batch = RecordBatch::try_new(schema.clone(), columns).unwrap();
        let reader = parquet_file(&batch, 4);
        let metadata = reader.metadata();
        assert_eq!(metadata.num_row_groups(), 5);
        // A row group's two column chunks lie one after the other: `time`, then `n`.
        let group_span = |i: usize| {
            let group = metadata.row_group(i);
            let (start, _) = group.column(0).byte_range();
            let (offset, length) = group.column(1).byte_range();
            (start, offset + length)
        };

        let ranges = |filters: &[Expr], range_bytes: u64| -> Vec<(u64, u64)> {
            scan_ranges(metadata, &schema, filters, range_bytes)
                .iter()
                .map(|r| (r.start, r.end))
                .collect()
        };
        let all = (group_span(0).0, group_span(4).1);

        // Times 5..11 are in groups 1 (4..8) and 2 (8..12): one range, or one a group.
        let window = [col("time").gt_eq(at(5)), col("time").lt(at(11))];
        assert_eq!(
            ranges(&window, u64::MAX),
            [(group_span(1).0, group_span(2).1)]
        );
        assert_eq!(ranges(&window, 1), [group_span(1), group_span(2)]);

        // Past the end: nothing to read.
        assert_eq!(ranges(&[col("time").gt(at(19))], u64::MAX), []);

        // A filter on another column, or none, says nothing about row groups: all of them,
        // cut where a range has reached the size asked for.
        let other = [col("n").eq(lit(3i64))];
        assert_eq!(ranges(&other, u64::MAX), [all]);
        assert_eq!(ranges(&[], u64::MAX), [all]);
        let two_groups = group_span(1).1 - group_span(0).0;
        assert_eq!(
            ranges(&[], two_groups),
            [
                (group_span(0).0, group_span(1).1),
                (group_span(2).0, group_span(3).1),
                group_span(4)
            ]
        );
        // OR of two windows: the two runs, with the groups between them left out.
        let either = [col("time").lt(at(2)).or(col("time").gt_eq(at(18)))];
        assert_eq!(ranges(&either, u64::MAX), [group_span(0), group_span(4)]);

        // Each range knows its rows and its times' bounds, merged over its row groups.
        let cut = scan_ranges(metadata, &schema, &[], two_groups);
        let times = |min, max| vec![(0, Some(TimeStatistics { min, max, nulls: 0 }))];
        assert_eq!(
            cut.iter()
                .map(|r| (r.rows, r.times.clone()))
                .collect::<Vec<_>>(),
            [(8, times(0, 7)), (8, times(8, 15)), (4, times(16, 19))]
        );
        // As DataFusion's statistics: the bounds of `time` (inexact, so that nothing is
        // pruned by them), nothing of `n`.
        let statistics = cut[1].statistics(&schema);
        assert_eq!(statistics.num_rows, Precision::Exact(8));
        let time = &statistics.column_statistics[0];
        let nanos = |v| {
            Precision::Inexact(ScalarValue::TimestampNanosecond(
                Some(v),
                Some("UTC".into()),
            ))
        };
        assert_eq!((&time.min_value, &time.max_value), (&nanos(8), &nanos(15)));
        assert_eq!(time.null_count, Precision::Inexact(0));
        assert_eq!(statistics.column_statistics[1].min_value, Precision::Absent);
    }

    /// A file without the table's timestamp column, or with a column of that name that holds
    /// no timestamps, gives no bounds for it (an `Int64`'s statistics are not nanoseconds),
    /// and its ranges still list every timestamp column of the table, in the table's order.
    #[test]
    fn a_file_without_the_timestamp_column_gives_no_bounds() {
        let file_schema = Arc::new(Schema::new(vec![Field::new("ts", DataType::Int64, false)]));
        let batch = RecordBatch::try_new(
            file_schema.clone(),
            vec![Arc::new(Int64Array::from_iter_values(0..4))],
        )
        .unwrap();
        let reader = parquet_file(&batch, 1024);
        let nanos = DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into()));
        let table = Schema::new(vec![
            Field::new("other", nanos.clone(), true),
            Field::new("ts", nanos, true),
        ]);
        let ranges = scan_ranges(reader.metadata(), &table, &[], u64::MAX);
        assert_eq!(ranges.len(), 1);
        assert_eq!(ranges[0].times, [(0, None), (1, None)]);
        // Nor does a filter on it prune anything.
        let past_all = [col("ts").gt(at(1_000))];
        assert_eq!(
            scan_ranges(reader.metadata(), &table, &past_all, u64::MAX).len(),
            1
        );
    }

    /// A range with a row group of nulls only has no bounds for that column (the chunk's
    /// statistics hold no minimum), so nothing is pruned or ordered by them.
    #[test]
    fn a_range_with_a_null_only_row_group_has_no_time_bounds() {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "time",
            DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
            true,
        )]));
        let times =
            TimestampNanosecondArray::from(vec![Some(5), Some(6), None, None]).with_timezone("UTC");
        let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(times)]).unwrap();
        let reader = parquet_file(&batch, 2);
        let whole = scan_ranges(reader.metadata(), &schema, &[], u64::MAX);
        assert_eq!(whole.len(), 1);
        assert_eq!(whole[0].times, [(0, None)]);
        let statistics = whole[0].statistics(&schema);
        assert_eq!(statistics.column_statistics[0].max_value, Precision::Absent);
        // Cut at every row group, the first keeps its bounds.
        let cut = scan_ranges(reader.metadata(), &schema, &[], 1);
        assert_eq!(
            cut[0].times,
            [(
                0,
                Some(TimeStatistics {
                    min: 5,
                    max: 6,
                    nulls: 0
                })
            )]
        );
        assert_eq!(cut[1].times, [(0, None)]);
    }
}
