//! Partial aggregation keyed by what repeats within a batch.
//!
//! Log tables are grouped by a few low-cardinality columns: service, name, status.
//! DataFusion's partial aggregate hashes and compares every row's value; for a `Utf8View`
//! string that is about 12 ns a row, most of the CPU of `count(DISTINCT name)` or a count by
//! service. Yet a batch decoded from a dictionary-encoded Parquet page repeats a handful of
//! values, and every repeat of one value has the same 16-byte view, since each points at that
//! value's one copy in the dictionary's buffer. An integer or timestamp column's repeats are
//! equal integers.
//!
//! [`KeyedGrouping`] replaces a partial `AggregateExec` whose group keys all have such raw
//! keys ([`KeyKind`]) and whose aggregates keep fixed-size states (count, and sum, avg, min
//! and max of primitives) with a [`KeyedPartialAggregateExec`], which:
//! - maps each row's raw key to the id of its value in that column ([`KeyColumn`]):
//!   - a fixed-width value's bits index a dense array of ids when the column's values lie
//!     within [`DENSE_SLOTS`] of each other (status codes), else a [`RawKeyTable`];
//!   - a view is looked up in a [`RawKeyTable`] that lives for one batch (a view names a
//!     place in that batch's buffers). A view not found there, and every view once a batch
//!     has missed [`VIEW_MISSES_PER_BATCH`] (a filter or coalescer copied each string, so no
//!     view repeats), is found by a seeded hash of its bytes, checked against the value;
//!   - a value found by neither is new, and gets its id from the column's interner, which
//!     maps each value to its id and is the only word on it;
//!   - a string column that the operator's Parquet scan reads as a dictionary
//!     ([`dictionary_scan`], for keys nothing else reads) maps each dictionary value a row
//!     uses to its id once per dictionary, and each row through its key; a `count(*)` by one
//!     such column counts rows by key;
//! - with several group columns, maps each row's tuple of value ids to a group id: through
//!   a dense array indexed by the ids in mixed radix ([`Combos`]) while the columns' value
//!   counts multiply to at most [`DENSE_SLOTS`], else through a second [`RawKeyTable`] of
//!   the ids packed into one key; both live as long as the operator;
//! - counts rows itself for `count(*)` ([`Aggregate::Rows`]), feeds DataFusion's own groups
//!   accumulators with these group ids for every other aggregate, and emits the partial
//!   states that the replaced operator would.
//!
//! Invariants:
//! - The output has the replaced operator's schema, and for every group the same merged
//!   states. A partial aggregate's output may name a group more than once, because the final
//!   aggregate merges its input; that is what makes the hand-over below correct.
//! - State is bounded by [`Limits`]. When a batch brings too many new values (its values do
//!   not repeat, so the tables would only add work), or the groups or the bytes of their key
//!   values pass their bounds, the
//!   operator emits what it has and hands the rest of its input, from the batch it did not
//!   take, to the replaced `AggregateExec`: DataFusion's own path, with its memory accounting,
//!   spilling, and skipping of partial aggregation for keys that do not repeat.
//! - A batch is either aggregated whole or handed over whole: nothing is counted twice or
//!   dropped.
//! - What a hand-over may change is where a floating-point sum (`sum` or `avg` of floats,
//!   and `avg` of integers, which DataFusion sums as floats) is split into partial sums, and
//!   so its last bits, as DataFusion's own plan does: it merges partial sums in the order
//!   partitions deliver them.

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};

use arrow_array::cast::AsArray;
use arrow_array::types::Int32Type;
use arrow_array::{
    Array, ArrayRef, BinaryViewArray, DictionaryArray, Int64Array, RecordBatch, StringArray,
    UInt32Array,
};
use arrow_schema::{DataType, SchemaRef};
use arrow_select::filter::{filter_record_batch, prep_null_mask_filter};
use datafusion::arrow::array::ArrayData;
use datafusion::common::ScalarValue;
use datafusion::common::hash_utils::RandomState;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::expressions::Literal;
use datafusion::physical_expr::utils::collect_columns;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, aggregate_expressions};
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, InputOrderMode, PlanProperties,
    SendableRecordBatchStream,
};
use futures::stream::BoxStream;

use super::dictionary_scan::dictionary_scan;
use super::provider::cast_to;
use futures::{StreamExt, TryStreamExt};

/// At most this many group columns: their value ids (`u32` each) pack into one `u128`.
const MAX_KEY_COLUMNS: usize = 4;

/// When a [`KeyedPartialAggregateExec`] gives up its input to the operator it replaced.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Groups kept before handing over (a partial aggregate with more gains little).
    max_groups: usize,
    /// Bytes of distinct key values kept before handing over (values can be long strings;
    /// DataFusion's own aggregate accounts for them in its memory pool, and spills).
    max_value_bytes: usize,
    /// New values a batch of any size may bring without handing over.
    min_new_values: usize,
    /// A batch may bring more than `min_new_values` new values if they are at most one row
    /// in this many: a key column whose values do not repeat gains nothing from its tables.
    rows_per_new_value: usize,
}

impl Limits {
    /// The limits the server plans with.
    pub(crate) const DEFAULT: Limits = Limits {
        max_groups: 1 << 14,
        max_value_bytes: 64 << 20,
        min_new_values: 64,
        rows_per_new_value: 8,
    };

    /// The new values a batch of `rows` rows may bring.
    fn new_values(&self, rows: usize) -> usize {
        self.min_new_values
            .max(rows / self.rows_per_new_value.max(1))
    }
}

/// The physical optimizer rule that puts a [`KeyedPartialAggregateExec`] in place of every
/// partial aggregate it can run (see the module documentation).
#[derive(Debug)]
pub(crate) struct KeyedGrouping {
    limits: Limits,
}

impl KeyedGrouping {
    /// The rule, with these limits for the operators it plans.
    pub(crate) fn new(limits: Limits) -> Self {
        KeyedGrouping { limits }
    }
}

impl PhysicalOptimizerRule for KeyedGrouping {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(agg) = node.downcast_ref::<AggregateExec>() else {
                return Ok(Transformed::no(node));
            };
            if !keyed(agg)? {
                return Ok(Transformed::no(node));
            }
            let exec = KeyedPartialAggregateExec::new(Arc::new(agg.clone()), self.limits)
                .reading_dictionaries()?;
            Ok(Transformed::yes(Arc::new(exec) as Arc<dyn ExecutionPlan>))
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "sluice_keyed_grouping"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Whether a [`KeyedPartialAggregateExec`] can run `agg`: a partial aggregate of plain
/// `GROUP BY` keys with raw keys, unordered input, no limit, and aggregates with fixed-size
/// groups accumulators.
fn keyed(agg: &AggregateExec) -> Result<bool> {
    if *agg.mode() != AggregateMode::Partial
        || agg.limit_options().is_some()
        || !agg.dynamic_expressions_produced().is_empty()
        || *agg.input_order_mode() != InputOrderMode::Linear
    {
        return Ok(false);
    }
    let group_by = agg.group_expr();
    if !group_by.is_single()
        || group_by.expr().is_empty()
        || group_by.expr().len() > MAX_KEY_COLUMNS
        || !group_by.null_expr().is_empty()
    {
        return Ok(false);
    }
    let input = agg.input().schema();
    for (expr, _) in group_by.expr() {
        if KeyKind::of(&expr.data_type(&input)?).is_none() {
            return Ok(false);
        }
    }
    for aggregate in agg.aggr_expr() {
        if aggregate.is_distinct()
            || !aggregate.order_bys().is_empty()
            || !aggregate.groups_accumulator_supported()
        {
            return Ok(false);
        }
        // count keeps an Int64 whatever it counts; the others keep a value of their
        // argument's type, of fixed size only for primitives.
        let fixed_size = match aggregate.fun().name() {
            "count" => true,
            "sum" | "avg" | "min" | "max" => {
                let mut primitive = true;
                for argument in aggregate.expressions() {
                    primitive &= argument.data_type(&input)?.is_primitive();
                }
                primitive
            }
            _ => false,
        };
        if !fixed_size {
            return Ok(false);
        }
    }
    Ok(true)
}

/// How a group column's values give raw keys: equal raw keys in one batch are equal values.
#[derive(Debug, Clone, Copy, PartialEq)]
enum KeyKind {
    /// A view array's 16-byte views: a short value inline, a long one by prefix, buffer and
    /// offset (two views of one value may differ; the interner joins them).
    View,
    /// A fixed-width value of this many bytes (integers, dates, times, timestamps,
    /// durations), zero-extended, so that their order as raw keys is the order of their
    /// bits. Floats are left out (`0.0` and `-0.0` differ in their bits), and so are
    /// decimals (their signed order is not that of their bits).
    Fixed(usize),
}

impl KeyKind {
    fn of(data_type: &DataType) -> Option<KeyKind> {
        use DataType::*;
        Some(match data_type {
            Utf8View | BinaryView => KeyKind::View,
            Int8 | UInt8 => KeyKind::Fixed(1),
            Int16 | UInt16 => KeyKind::Fixed(2),
            Int32 | UInt32 | Date32 | Time32(_) => KeyKind::Fixed(4),
            Int64 | UInt64 | Date64 | Time64(_) | Timestamp(_, _) | Duration(_) => {
                KeyKind::Fixed(8)
            }
            _ => return None,
        })
    }

    /// The raw keys of `array`'s rows: the views themselves, or the values' bits.
    fn raw_keys<'a>(&self, array: &'a ArrayRef, data: &'a ArrayData) -> Result<RawKeys<'a>> {
        let data_type = array.data_type();
        match self {
            KeyKind::View => match data_type {
                DataType::Utf8View => Ok(RawKeys::Wide(array.as_string_view().views())),
                DataType::BinaryView => Ok(RawKeys::Wide(array.as_binary_view().views())),
                other => Err(mistyped(other)),
            },
            KeyKind::Fixed(width) => {
                // Every fixed-width primitive array keeps its values in its first buffer.
                let values = data.buffers().first().ok_or_else(|| mistyped(data_type))?;
                let range = data.offset()..data.offset() + data.len();
                let keys = match width {
                    1 => values.typed_data::<u8>().get(range).map(RawKeys::U8),
                    2 => values.typed_data::<u16>().get(range).map(RawKeys::U16),
                    4 => values.typed_data::<u32>().get(range).map(RawKeys::U32),
                    8 => values.typed_data::<u64>().get(range).map(RawKeys::U64),
                    _ => None,
                };
                keys.ok_or_else(|| mistyped(data_type))
            }
        }
    }
}

/// A batch's raw keys, at their own width (widened to `u128` only one at a time).
enum RawKeys<'a> {
    U8(&'a [u8]),
    U16(&'a [u16]),
    U32(&'a [u32]),
    U64(&'a [u64]),
    Wide(&'a [u128]),
}

/// A raw key at its own width.
trait RawKey: Copy {
    /// Whether keys of this width are fixed-width values, which may go in [`DenseIds`]
    /// (views never do).
    const FIXED: bool;

    fn wide(self) -> u128;

    /// The key's low 64 bits: all of a fixed-width value's.
    fn low64(self) -> u64;
}

macro_rules! raw_key {
    ($fixed:expr => $($t:ty),*) => {$(
        impl RawKey for $t {
            const FIXED: bool = $fixed;

            #[inline(always)]
            fn wide(self) -> u128 {
                self as u128
            }

            #[inline(always)]
            fn low64(self) -> u64 {
                self as u64
            }
        }
    )*};
}

raw_key!(true => u8, u16, u32, u64);
raw_key!(false => u128);

/// A string column read as a dictionary (`dictionary_scan`): the array, and its values.
fn as_dictionary(array: &ArrayRef) -> Result<(&DictionaryArray<Int32Type>, &StringArray)> {
    let dictionary = array
        .as_dictionary_opt::<Int32Type>()
        .ok_or_else(|| mistyped(array.data_type()))?;
    let strings = dictionary
        .values()
        .as_string_opt::<i32>()
        .ok_or_else(|| mistyped(array.data_type()))?;
    Ok((dictionary, strings))
}

/// Whether two string arrays are one: the same buffers, offset and length. Each batch a
/// Parquet reader or a filter makes of one column chunk's dictionary has an array of its
/// own, over the chunk's one copy of the values. (The first array is held while this is
/// asked, so its buffers cannot have been freed and their addresses taken again.)
fn same_strings(a: &ArrayRef, b: &ArrayRef) -> bool {
    match (a.as_string_opt::<i32>(), b.as_string_opt::<i32>()) {
        (Some(a), Some(b)) => {
            a.len() == b.len()
                && a.offsets().inner().inner().as_ptr() == b.offsets().inner().inner().as_ptr()
                && a.values().as_ptr() == b.values().as_ptr()
                && a.nulls().map(|n| n.buffer().as_ptr()) == b.nulls().map(|n| n.buffer().as_ptr())
                && a.nulls().map(|n| n.offset()) == b.nulls().map(|n| n.offset())
        }
        _ => false,
    }
}

fn mistyped(data_type: &DataType) -> DataFusionError {
    DataFusionError::Internal(format!(
        "keyed grouping planned for a column it cannot read ({data_type})"
    ))
}

/// An open-addressing table from raw keys to ids, cleared in constant time (each slot
/// carries the generation it was written in).
#[derive(Debug)]
struct RawKeyTable {
    /// A slot's key, id and generation side by side: a lookup reads one place in memory.
    slots: Vec<RawKeySlot>,
    generation: u32,
    len: usize,
    /// 64 less the log2 of the slot count: a slot is the top bits of the key's hash.
    shift: u32,
}

/// One slot of a [`RawKeyTable`]. The key is kept as two `u64`s so that a slot takes 24
/// bytes (a `u128` would align it to 32).
#[derive(Debug, Clone, Copy, Default)]
struct RawKeySlot {
    key: [u64; 2],
    id: u32,
    generation: u32,
}

fn split(key: u128) -> [u64; 2] {
    [key as u64, (key >> 64) as u64]
}

impl RawKeyTable {
    fn new() -> Self {
        RawKeyTable::with_capacity(64)
    }

    fn with_capacity(slots: usize) -> Self {
        RawKeyTable {
            slots: vec![RawKeySlot::default(); slots],
            generation: 1,
            len: 0,
            shift: 64 - slots.trailing_zeros(),
        }
    }

    fn clear(&mut self) {
        self.len = 0;
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            self.slots.iter_mut().for_each(|slot| slot.generation = 0);
            self.generation = 1;
        }
    }

    #[inline]
    fn slot(&self, key: [u64; 2]) -> usize {
        // Fibonacci hashing: the top bits of the product depend on every bit of the key
        // (the low ones would not: ids packed at bit 32 would all share a slot).
        let folded = key[0] ^ key[1].rotate_left(29);
        (folded.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// The id of `key`, or the slot where it would go.
    #[inline]
    fn find(&self, key: u128) -> Result<u32, usize> {
        let key = split(key);
        let mask = self.slots.len() - 1;
        let mut at = self.slot(key);
        loop {
            let slot = self.slots[at];
            if slot.generation != self.generation {
                return Err(at);
            }
            if slot.key == key {
                return Ok(slot.id);
            }
            at = (at + 1) & mask;
        }
    }

    /// The keys in the table and their ids.
    fn entries(&self) -> impl Iterator<Item = (u128, u32)> + '_ {
        (self.slots.iter())
            .filter(|slot| slot.generation == self.generation)
            .map(|slot| {
                (
                    u128::from(slot.key[0]) | u128::from(slot.key[1]) << 64,
                    slot.id,
                )
            })
    }

    /// The most slots any key in the table is from its own.
    #[cfg(test)]
    fn longest_probe(&self) -> usize {
        let mask = self.slots.len() - 1;
        (self.slots.iter().enumerate())
            .filter(|(_, slot)| slot.generation == self.generation)
            .map(|(at, slot)| at.wrapping_sub(self.slot(slot.key)) & mask)
            .max()
            .unwrap_or(0)
    }

    #[inline]
    fn get(&self, key: u128) -> Option<u32> {
        self.find(key).ok()
    }

    /// Adds `key` (which must not be in the table).
    fn insert(&mut self, key: u128, id: u32) {
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        if let Err(at) = self.find(key) {
            self.slots[at] = RawKeySlot {
                key: split(key),
                id,
                generation: self.generation,
            };
            self.len += 1;
        }
    }

    fn grow(&mut self) {
        let mut bigger = RawKeyTable::with_capacity(self.slots.len() * 2);
        for (key, id) in self.entries() {
            bigger.insert(key, id);
        }
        *self = bigger;
    }
}

/// After this many rows of a batch whose views missed their table, the rest of the batch
/// skips that table: its views do not repeat (a filter or coalescer copied the strings), and
/// each value is found by its bytes' hash instead.
const VIEW_MISSES_PER_BATCH: usize = 256;

/// One group column: its values so far, by id, and the tables that find a row's id.
#[derive(Debug)]
struct KeyColumn {
    kind: KeyKind,
    /// The values seen so far and their ids: the only word on which id a value has.
    ids: HashMap<ScalarValue, u32>,
    values: Vec<ScalarValue>,
    /// How many of `values` belong to batches that were aggregated.
    committed: usize,
    /// The bytes `values` and `ids` take.
    value_bytes: usize,
    /// Raw key to id. For fixed-width values it lives as long as the column (the raw key is
    /// the value); for views, one batch (a view names a place in that batch's buffers).
    raw: RawKeyTable,
    /// For views: the hash of a value's bytes to the id of the first value seen with it
    /// (checked against the value's bytes; another value with that hash goes to `ids`).
    by_hash: RawKeyTable,
    hasher: RandomState,
    /// For fixed-width values within [`DENSE_SLOTS`] of each other: the id of each, by its
    /// distance from the least (in place of `raw`, and faster: no hash, no probe).
    dense: Option<DenseIds>,
    /// The values have been too far apart for `dense`.
    sparse: bool,
    /// For a column read as a dictionary (`dictionary_scan`): the last batch's dictionary
    /// values and the id of each ([`DenseIds::ABSENT`] until a row uses it). The batches of
    /// one Parquet column chunk share their dictionary's buffers ([`same_strings`]), so its
    /// values are looked up once.
    dictionary: Option<(ArrayRef, Vec<u32>)>,
}

/// The most slots [`DenseIds`] takes (256 KiB of ids).
const DENSE_SLOTS: usize = 1 << 16;

/// Ids of fixed-width values by their distance from `base`.
#[derive(Debug)]
struct DenseIds {
    base: u128,
    ids: Vec<u32>,
}

impl DenseIds {
    /// No value has this slot's key yet.
    const ABSENT: u32 = u32::MAX;

    fn end(&self) -> u128 {
        self.base + self.ids.len() as u128
    }

    fn covers(&self, key: u128) -> bool {
        self.base <= key && key < self.end()
    }

    #[inline]
    fn get(&self, key: u128) -> Option<u32> {
        let slot = usize::try_from(key.wrapping_sub(self.base)).ok()?;
        self.ids
            .get(slot)
            .copied()
            .filter(|&id| id != DenseIds::ABSENT)
    }

    fn set(&mut self, key: u128, id: u32) {
        if let Ok(slot) = usize::try_from(key.wrapping_sub(self.base))
            && let Some(entry) = self.ids.get_mut(slot)
        {
            *entry = id;
        }
    }

    fn entries(&self) -> impl Iterator<Item = (u128, u32)> + '_ {
        (self.ids.iter().enumerate())
            .filter(|(_, id)| **id != DenseIds::ABSENT)
            .map(|(slot, &id)| (self.base + slot as u128, id))
    }
}

impl KeyColumn {
    fn new(kind: KeyKind, seed: u64) -> Self {
        KeyColumn {
            kind,
            ids: HashMap::new(),
            values: Vec::new(),
            committed: 0,
            value_bytes: 0,
            raw: RawKeyTable::new(),
            by_hash: RawKeyTable::new(),
            hasher: RandomState::with_seed(seed),
            dense: None,
            sparse: false,
            dictionary: None,
        }
    }

    fn intern(&mut self, array: &ArrayRef, row: usize) -> Result<u32> {
        let value = ScalarValue::try_from_array(array, row)?;
        if let Some(&id) = self.ids.get(&value) {
            return Ok(id);
        }
        self.insert(value)
    }

    /// Gives a value not in `ids` the next id.
    fn insert(&mut self, value: ScalarValue) -> Result<u32> {
        let id = u32::try_from(self.values.len())
            .map_err(|_| DataFusionError::Internal("too many keyed groups".into()))?;
        // Kept twice: in `values`, and as a key of `ids`.
        self.value_bytes += 2 * value.size();
        self.values.push(value.clone());
        self.ids.insert(value, id);
        Ok(id)
    }

    /// Fills `out` with the value id of each row of `array`. Returns false, with `out`
    /// incomplete, once the batch has brought more than `max_new` new values (over all
    /// columns, counted in `new`).
    fn value_ids(
        &mut self,
        array: &ArrayRef,
        out: &mut Vec<u32>,
        new: &mut usize,
        max_new: usize,
    ) -> Result<bool> {
        out.clear();
        out.resize(array.len(), 0);
        if let DataType::Dictionary(..) = array.data_type() {
            return self.dictionary_value_ids(array, out, new, max_new);
        }
        let data = array.to_data();
        match self.kind.raw_keys(array, &data)? {
            RawKeys::U8(keys) => self.value_ids_of(array, keys, out, new, max_new),
            RawKeys::U16(keys) => self.value_ids_of(array, keys, out, new, max_new),
            RawKeys::U32(keys) => self.value_ids_of(array, keys, out, new, max_new),
            RawKeys::U64(keys) => self.value_ids_of(array, keys, out, new, max_new),
            RawKeys::Wide(keys) => self.value_ids_of(array, keys, out, new, max_new),
        }
    }

    /// [`KeyColumn::value_ids`] for a string column read as a dictionary: each dictionary
    /// value a row uses is looked up once (as the `Utf8View` value the column's type has),
    /// and each row's id is its key's.
    fn dictionary_value_ids(
        &mut self,
        array: &ArrayRef,
        out: &mut [u32],
        new: &mut usize,
        max_new: usize,
    ) -> Result<bool> {
        let (dictionary, strings) = as_dictionary(array)?;
        let mut ids = self.dictionary_ids(dictionary.values());
        let keys = dictionary.keys().values();
        // Each row's id by its key, in a loop without branches; a row whose key has no id
        // yet (the first batches of a dictionary) is found below.
        let mut absent = false;
        for (out, &key) in out.iter_mut().zip(keys.iter()) {
            let slot = usize::try_from(key).unwrap_or(usize::MAX);
            let id = ids.get(slot).copied().unwrap_or(DenseIds::ABSENT);
            absent |= id == DenseIds::ABSENT;
            *out = id;
        }
        let nulls = array.logical_nulls();
        if absent {
            for (row, (out, &key)) in out.iter_mut().zip(keys.iter()).enumerate() {
                if *out != DenseIds::ABSENT || nulls.as_ref().is_some_and(|n| n.is_null(row)) {
                    continue;
                }
                let slot = usize::try_from(key).map_err(|_| mistyped(array.data_type()))?;
                match self.dictionary_id(&mut ids, strings, slot, new, max_new)? {
                    Some(id) => *out = id,
                    None => return Ok(false),
                }
            }
        }
        if let Some(nulls) = nulls.filter(|n| n.null_count() > 0) {
            let null_id = self.null_id()?;
            for row in (0..out.len()).filter(|&row| nulls.is_null(row)) {
                out[row] = null_id;
            }
        }
        self.dictionary = Some((Arc::clone(dictionary.values()), ids));
        Ok(true)
    }

    /// For a column read as a dictionary, and only `count(*)` to compute: each group's rows
    /// in `array`, counted by dictionary key (no id per row). None once the batch has
    /// brought more than `max_new` new values.
    fn dictionary_counts(
        &mut self,
        array: &ArrayRef,
        by_key: &mut Vec<i64>,
        new: &mut usize,
        max_new: usize,
    ) -> Result<Option<Vec<(u32, i64)>>> {
        let (dictionary, strings) = as_dictionary(array)?;
        let keys = dictionary.keys().values();
        by_key.clear();
        by_key.resize(strings.len(), 0);
        count_rows(by_key, keys, |key| {
            usize::try_from(key).unwrap_or(usize::MAX)
        });
        // A null row's key is counted above and taken back here.
        let mut nulls = 0;
        if let Some(n) = array.logical_nulls() {
            for row in (0..keys.len()).filter(|&row| n.is_null(row)) {
                nulls += 1;
                let slot = keys.get(row).and_then(|&k| usize::try_from(k).ok());
                if let Some(count) = slot.and_then(|slot| by_key.get_mut(slot)) {
                    *count -= 1;
                }
            }
        }
        if by_key.iter().sum::<i64>() + nulls != keys.len() as i64 {
            return Err(mistyped(array.data_type()));
        }
        let mut ids = self.dictionary_ids(dictionary.values());
        let mut counted = Vec::new();
        for (slot, &count) in by_key.iter().enumerate().filter(|(_, count)| **count > 0) {
            match self.dictionary_id(&mut ids, strings, slot, new, max_new)? {
                Some(id) => counted.push((id, count)),
                None => return Ok(None),
            }
        }
        if nulls > 0 {
            counted.push((self.null_id()?, nulls));
        }
        self.dictionary = Some((Arc::clone(dictionary.values()), ids));
        Ok(Some(counted))
    }

    /// The ids of `values`' entries known so far: kept from the last batch if it had the same
    /// dictionary, else none ([`DenseIds::ABSENT`]).
    fn dictionary_ids(&mut self, values: &ArrayRef) -> Vec<u32> {
        match self.dictionary.take() {
            Some((cached, ids)) if same_strings(&cached, values) => ids,
            _ => vec![DenseIds::ABSENT; values.len()],
        }
    }

    /// The id of dictionary entry `slot` of `strings`, found once per dictionary (`ids`);
    /// None if it is new and the batch has brought more than `max_new` new values.
    #[inline]
    fn dictionary_id(
        &mut self,
        ids: &mut [u32],
        strings: &StringArray,
        slot: usize,
        new: &mut usize,
        max_new: usize,
    ) -> Result<Option<u32>> {
        let id = ids
            .get_mut(slot)
            .ok_or_else(|| mistyped(strings.data_type()))?;
        if *id == DenseIds::ABSENT {
            let value = ScalarValue::Utf8View(Some(strings.value(slot).to_owned()));
            *id = match self.ids.get(&value) {
                Some(&known) => known,
                None => {
                    *new += 1;
                    if *new > max_new {
                        return Ok(None);
                    }
                    self.insert(value)?
                }
            };
        }
        Ok(Some(*id))
    }

    /// The id of the null value of a string column read as a dictionary.
    fn null_id(&mut self) -> Result<u32> {
        let null = ScalarValue::Utf8View(None);
        match self.ids.get(&null) {
            Some(&id) => Ok(id),
            None => self.insert(null),
        }
    }

    /// [`KeyColumn::value_ids`] for raw keys of one width.
    fn value_ids_of<K: RawKey>(
        &mut self,
        array: &ArrayRef,
        keys: &[K],
        out: &mut [u32],
        new: &mut usize,
        max_new: usize,
    ) -> Result<bool> {
        let views = match array.data_type() {
            DataType::Utf8View => Some(array.as_string_view().clone().to_binary_view()),
            DataType::BinaryView => Some(array.as_binary_view().clone()),
            _ => None,
        };
        if views.is_some() {
            self.raw.clear();
        }
        let mut rows = RowIds {
            array,
            views: views.as_ref(),
            new,
            max_new,
            view_misses: 0,
        };
        let within = match array.logical_nulls() {
            None => self.resolve(&mut rows, keys, |_| false, out)?,
            Some(nulls) => self.resolve(&mut rows, keys, |row| nulls.is_null(row), out)?,
        };
        Ok(within)
    }

    /// The loop of [`KeyColumn::value_ids`], for one way of telling null rows: runs of rows
    /// found in a table ([`KeyColumn::found_run`]), each ended by a row that needs more.
    #[inline(always)]
    fn resolve<K: RawKey>(
        &mut self,
        rows: &mut RowIds<'_>,
        keys: &[K],
        is_null: impl Fn(usize) -> bool,
        out: &mut [u32],
    ) -> Result<bool> {
        let mut null_id = None;
        let mut row = 0;
        while row < keys.len() {
            row = self.found_run(keys, row, &is_null, out, rows.view_misses);
            let Some(&key) = keys.get(row) else {
                break;
            };
            out[row] = if is_null(row) {
                match null_id {
                    Some(id) => id,
                    None => {
                        let id = self.intern(rows.array, row)?;
                        null_id = Some(id);
                        id
                    }
                }
            } else {
                match self.missed(rows, row, key.wide())? {
                    Some(id) => id,
                    None => return Ok(false),
                }
            };
            row += 1;
        }
        Ok(true)
    }

    /// Fills `out` from `start` for as long as rows are not null and their raw keys are in
    /// `dense` or `raw`; returns the first row that is not. The table is only read here, so
    /// its fields stay in registers. There is no shortcut for a run of one key: on values in
    /// no order its branch is mispredicted on most rows, and costs more than the table.
    #[inline(always)]
    fn found_run<K: RawKey>(
        &self,
        keys: &[K],
        start: usize,
        is_null: &impl Fn(usize) -> bool,
        out: &mut [u32],
        view_misses: usize,
    ) -> usize {
        if K::FIXED
            && let Some(dense) = &self.dense
        {
            // A fixed-width key is at most 64 bits wide, and so is `base` (the least key it
            // was fitted to). A key below `base` wraps around to a slot past the end.
            let base = dense.base as u64;
            let ids = dense.ids.as_slice();
            // Slices from `start`, zipped: an iterator skipped to `start` kept its state on
            // the stack, in a loop of a few instructions.
            let rest = keys.get(start..).unwrap_or_default();
            let out = out.get_mut(start..).unwrap_or_default();
            for (i, (&key, out)) in rest.iter().zip(out).enumerate() {
                let slot = usize::try_from(key.low64().wrapping_sub(base)).unwrap_or(usize::MAX);
                *out = match ids.get(slot) {
                    Some(&id) if id != DenseIds::ABSENT && !is_null(start + i) => id,
                    _ => return start + i,
                };
            }
            return keys.len();
        }
        if view_misses > VIEW_MISSES_PER_BATCH {
            return start;
        }
        let rest = keys.get(start..).unwrap_or_default();
        let out = out.get_mut(start..).unwrap_or_default();
        for (i, (&key, out)) in rest.iter().zip(out).enumerate() {
            *out = match self.raw.get(key.wide()) {
                Some(id) if !is_null(start + i) => id,
                _ => return start + i,
            };
        }
        keys.len()
    }

    /// The id of a row whose raw key was not in `raw`, or None if the batch has brought too
    /// many new values.
    fn missed(&mut self, rows: &mut RowIds<'_>, row: usize, key: u128) -> Result<Option<u32>> {
        let Some(views) = rows.views else {
            // A fixed-width key out of `dense`'s range widens it, or moves its ids to `raw`.
            self.fit_dense(key);
            let found = match &self.dense {
                Some(dense) => dense.get(key),
                None => self.raw.get(key),
            };
            if let Some(id) = found {
                return Ok(Some(id));
            }
            // A fixed-width value in neither table is new.
            if !rows.count_new() {
                return Ok(None);
            }
            let id = self.intern(rows.array, row)?;
            match &mut self.dense {
                Some(dense) => dense.set(key, id),
                None => self.raw.insert(key, id),
            }
            return Ok(Some(id));
        };
        let bytes = views.value(row);
        let hash = u128::from(self.hasher.hash_one(bytes));
        let id = match self.by_hash.get(hash) {
            Some(id) if value_bytes(&self.values[id as usize]) == Some(bytes) => id,
            Some(_) => self.intern(rows.array, row)?,
            None => {
                if !rows.count_new() {
                    return Ok(None);
                }
                let id = self.intern(rows.array, row)?;
                self.by_hash.insert(hash, id);
                id
            }
        };
        rows.view_misses += 1;
        if rows.view_misses <= VIEW_MISSES_PER_BATCH {
            self.raw.insert(key, id);
        }
        Ok(Some(id))
    }

    /// Widens `dense` to hold the fixed-width `key`, or gives it up (for `raw`, with what it
    /// held) when that would take more than [`DENSE_SLOTS`] slots. It at least doubles when
    /// it widens, so keys that creep upwards (timestamps) widen it a few times, not each.
    fn fit_dense(&mut self, key: u128) {
        if self.sparse {
            return;
        }
        let Some(key_end) = key.checked_add(1) else {
            return self.go_sparse();
        };
        let (base, end) = match &self.dense {
            Some(dense) if dense.covers(key) => return,
            Some(dense) => {
                let (low, high) = (dense.base.min(key), dense.end().max(key_end));
                let size = (high - low).max(2 * dense.ids.len() as u128);
                let size = size.min(DENSE_SLOTS as u128).max(high - low);
                if key < dense.base {
                    (high.saturating_sub(size), high)
                } else {
                    (low, low.saturating_add(size))
                }
            }
            None => (key, key_end),
        };
        if end - base > DENSE_SLOTS as u128 {
            return self.go_sparse();
        }
        let old = self.dense.take();
        let mut dense = DenseIds {
            base,
            ids: vec![DenseIds::ABSENT; (end - base) as usize],
        };
        if let Some(old) = old {
            for (key, id) in old.entries() {
                dense.set(key, id);
            }
        }
        self.dense = Some(dense);
    }

    /// Gives up `dense` for good, moving its ids to `raw`.
    fn go_sparse(&mut self) {
        self.sparse = true;
        if let Some(old) = self.dense.take() {
            for (key, id) in old.entries() {
                self.raw.insert(key, id);
            }
        }
    }

    /// Forgets the values first seen in a batch that is handed over (the tables are not
    /// used again: after a hand-over, a grouping only emits).
    fn roll_back(&mut self) {
        self.dictionary = None;
        let committed = self.committed;
        self.values.truncate(committed);
        self.ids.retain(|_, id| (*id as usize) < committed);
    }

    fn commit(&mut self) {
        self.committed = self.values.len();
    }

    fn distinct_values(&self) -> Result<ArrayRef> {
        ScalarValue::iter_to_array(self.values.iter().cloned())
    }
}

/// What [`KeyColumn::value_ids`] keeps while it walks one batch's rows.
struct RowIds<'a> {
    array: &'a ArrayRef,
    /// The column's views as bytes, for view columns.
    views: Option<&'a BinaryViewArray>,
    /// New values this batch, over all columns.
    new: &'a mut usize,
    max_new: usize,
    /// Rows of this batch whose view was not in the column's `raw` table.
    view_misses: usize,
}

impl RowIds<'_> {
    /// Counts one more new value; false if that is too many.
    fn count_new(&mut self) -> bool {
        *self.new += 1;
        *self.new <= self.max_new
    }
}

/// The bytes of a string or binary view value.
fn value_bytes(value: &ScalarValue) -> Option<&[u8]> {
    match value {
        ScalarValue::Utf8View(Some(s)) => Some(s.as_bytes()),
        ScalarValue::BinaryView(Some(b)) => Some(b.as_slice()),
        _ => None,
    }
}

/// One aggregate's partial state.
enum Aggregate {
    /// A `count` of a non-null literal (`count(*)`): each group's rows, counted here. Its
    /// state is DataFusion's count's: one `Int64` per group.
    Rows(Vec<i64>),
    /// Any other: DataFusion's groups accumulator.
    Accumulated(Accumulated),
}

impl Aggregate {
    fn new(
        aggregate: &AggregateFunctionExpr,
        arguments: Vec<Arc<dyn PhysicalExpr>>,
        filter: Option<Arc<dyn PhysicalExpr>>,
    ) -> Result<Self> {
        let counts_rows = aggregate.fun().name() == "count"
            && !aggregate.is_distinct()
            && filter.is_none()
            && arguments.iter().all(|argument| {
                argument
                    .downcast_ref::<Literal>()
                    .is_some_and(|literal| !literal.value().is_null())
            })
            && matches!(aggregate.state_fields()?.as_slice(),
                [field] if *field.data_type() == DataType::Int64);
        Ok(if counts_rows {
            Aggregate::Rows(Vec::new())
        } else {
            Aggregate::Accumulated(Accumulated {
                accumulator: aggregate.create_groups_accumulator()?,
                arguments,
                filter,
            })
        })
    }

    /// Every group's partial state, in the order of group ids; the state is emptied.
    fn state(&mut self, groups: usize) -> Result<Vec<ArrayRef>> {
        match self {
            Aggregate::Rows(counts) => {
                counts.resize(groups, 0);
                Ok(vec![Arc::new(Int64Array::from(std::mem::take(counts)))])
            }
            Aggregate::Accumulated(accumulated) => accumulated.accumulator.state(EmitTo::All),
        }
    }
}

/// With at most this many groups, [`count_rows`] counts in lanes.
const LANE_GROUPS: usize = 256;

/// Adds one to each row's group's count (`group` reads a row's group from `groups`).
///
/// With few groups, one value is on most rows (a status code of 200): one counter would be
/// a chain of increments through memory, each waiting for the one before. Four lanes of
/// counters, taken by turns, are four chains in flight.
fn count_rows<T: Copy>(counts: &mut [i64], groups: &[T], group: impl Fn(T) -> usize) {
    if counts.len() > LANE_GROUPS {
        for &g in groups {
            if let Some(count) = counts.get_mut(group(g)) {
                *count += 1;
            }
        }
        return;
    }
    let mut lanes = [[0i64; LANE_GROUPS]; 4];
    let mut quads = groups.chunks_exact(4);
    for quad in &mut quads {
        for (lane, &g) in lanes.iter_mut().zip(quad) {
            if let Some(count) = lane.get_mut(group(g)) {
                *count += 1;
            }
        }
    }
    for &g in quads.remainder() {
        if let Some(count) = lanes[0].get_mut(group(g)) {
            *count += 1;
        }
    }
    for (g, count) in counts.iter_mut().enumerate() {
        *count += lanes.iter().map(|lane| lane[g]).sum::<i64>();
    }
}

/// DataFusion's groups accumulator for one aggregate, and what it is fed.
struct Accumulated {
    accumulator: Box<dyn GroupsAccumulator>,
    arguments: Vec<Arc<dyn PhysicalExpr>>,
    filter: Option<Arc<dyn PhysicalExpr>>,
}

impl Accumulated {
    fn update(&mut self, batch: &RecordBatch, groups: &[usize], total: usize) -> Result<()> {
        let rows = batch.num_rows();
        let values = self
            .arguments
            .iter()
            .map(|e| e.evaluate(batch).and_then(|v| v.into_array(rows)))
            .collect::<Result<Vec<_>>>()?;
        let filter = self
            .filter
            .as_ref()
            .map(|f| f.evaluate(batch).and_then(|v| v.into_array(rows)))
            .transpose()?;
        let filter = match &filter {
            Some(f) => Some(f.as_boolean_opt().ok_or_else(|| {
                DataFusionError::Internal("an aggregate's filter is not boolean".into())
            })?),
            None => None,
        };
        self.accumulator
            .update_batch(&values, groups, filter, total)
    }
}

/// What to do after a batch.
#[derive(Debug, PartialEq)]
enum Step {
    /// Take the next batch.
    Continue,
    /// Hand the input over, from the next batch on.
    HandOverNext,
    /// Hand the input over, from the batch just given (which was not aggregated).
    HandOverThis,
}

/// Group ids by the value id of each group column: the slot of value ids `(v0, v1, ...)` is
/// `v0 * strides[0] + v1 * strides[1] + ...`, where each column's stride is the product of
/// the radixes before it, and each radix is more than any value id of its column.
struct Combos {
    radixes: Vec<usize>,
    strides: Vec<usize>,
    /// By slot: the group id, or [`DenseIds::ABSENT`].
    groups: Vec<u32>,
}

/// Value ids of a row's group columns (at most [`MAX_KEY_COLUMNS`]), packed into one key.
fn pack(ids: impl Iterator<Item = u32>) -> u128 {
    ids.enumerate()
        .fold(0, |packed, (c, id)| packed | u128::from(id) << (32 * c))
}

/// A partial aggregation in progress.
struct Grouping {
    group_exprs: Vec<Arc<dyn PhysicalExpr>>,
    columns: Vec<KeyColumn>,
    /// Packed value ids to group id; used with several group columns when `combos` is not.
    groups: RawKeyTable,
    /// Group ids by value ids in mixed radix; used with several group columns while their
    /// value counts multiply to at most [`DENSE_SLOTS`] (no hash, no probe).
    combos: Option<Combos>,
    /// The value counts have multiplied past [`DENSE_SLOTS`]: `groups` is used from then on.
    combos_given_up: bool,
    /// For each group column, each group's value id; used with several group columns.
    group_values: Vec<Vec<u32>>,
    group_count: usize,
    value_ids: Vec<Vec<u32>>,
    /// Each row's group id, when an aggregate needs them as `usize` (with one group column
    /// and only `count(*)`, rows are counted straight from `value_ids`).
    group_indices: Vec<usize>,
    /// Rows by dictionary key, when `count(*)` is counted by key
    /// ([`KeyColumn::dictionary_counts`]).
    by_key: Vec<i64>,
    aggregates: Vec<Aggregate>,
    limits: Limits,
}

impl Grouping {
    fn new(agg: &AggregateExec, limits: Limits) -> Result<Self> {
        let input = agg.input().schema();
        let mut group_exprs = Vec::new();
        let mut columns = Vec::new();
        // Hashes of view values are seeded per query, so that no one can choose values
        // that collide (a collision is still answered right, but slowly).
        let seed = std::collections::hash_map::RandomState::new().hash_one(0u64);
        for (expr, _) in agg.group_expr().expr() {
            let data_type = expr.data_type(&input)?;
            let kind = KeyKind::of(&data_type).ok_or_else(|| mistyped(&data_type))?;
            group_exprs.push(Arc::clone(expr));
            columns.push(KeyColumn::new(kind, seed));
        }
        let arguments = aggregate_expressions(
            agg.aggr_expr(),
            agg.mode(),
            agg.group_expr().num_group_exprs(),
        )?;
        let aggregates = agg
            .aggr_expr()
            .iter()
            .zip(arguments)
            .zip(agg.filter_expr().iter())
            .map(|((aggregate, arguments), filter)| {
                Aggregate::new(aggregate, arguments, filter.clone())
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Grouping {
            group_exprs,
            value_ids: vec![Vec::new(); columns.len()],
            group_values: vec![Vec::new(); columns.len()],
            columns,
            groups: RawKeyTable::new(),
            combos: None,
            combos_given_up: false,
            group_count: 0,
            group_indices: Vec::new(),
            by_key: Vec::new(),
            aggregates,
            limits,
        })
    }

    fn aggregate(&mut self, batch: &RecordBatch) -> Result<Step> {
        let rows = batch.num_rows();
        let keys = self
            .group_exprs
            .iter()
            .map(|e| e.evaluate(batch).and_then(|v| v.into_array(rows)))
            .collect::<Result<Vec<_>>>()?;
        let max_new = self.limits.new_values(rows);
        if let ([column], [array]) = (self.columns.as_mut_slice(), keys.as_slice())
            && let DataType::Dictionary(..) = array.data_type()
            && (self.aggregates.iter()).all(|a| matches!(a, Aggregate::Rows(_)))
        {
            let mut new = 0;
            let Some(counted) =
                column.dictionary_counts(array, &mut self.by_key, &mut new, max_new)?
            else {
                column.roll_back();
                return Ok(Step::HandOverThis);
            };
            self.group_count = column.values.len();
            column.commit();
            for aggregate in &mut self.aggregates {
                if let Aggregate::Rows(counts) = aggregate {
                    counts.resize(self.group_count, 0);
                    for &(id, rows) in &counted {
                        if let Some(count) = counts.get_mut(id as usize) {
                            *count += rows;
                        }
                    }
                }
            }
            return Ok(self.next_step());
        }
        let mut new = 0;
        for ((column, array), ids) in self.columns.iter_mut().zip(&keys).zip(&mut self.value_ids) {
            if !column.value_ids(array, ids, &mut new, max_new)? {
                self.columns.iter_mut().for_each(KeyColumn::roll_back);
                return Ok(Step::HandOverThis);
            }
        }
        self.group_indices.clear();
        if let [ids] = self.value_ids.as_slice() {
            if (self.aggregates.iter()).any(|a| matches!(a, Aggregate::Accumulated(_))) {
                self.group_indices.extend(ids.iter().map(|&id| id as usize));
            }
            self.group_count = self.columns[0].values.len();
        } else {
            self.fit_combos();
            self.group_combos(rows)?;
        }
        for aggregate in &mut self.aggregates {
            match aggregate {
                Aggregate::Rows(counts) => {
                    counts.resize(self.group_count, 0);
                    match self.value_ids.as_slice() {
                        [ids] => count_rows(counts, ids, |id| id as usize),
                        _ => count_rows(counts, &self.group_indices, |group| group),
                    }
                }
                Aggregate::Accumulated(accumulated) => {
                    accumulated.update(batch, &self.group_indices, self.group_count)?
                }
            }
        }
        self.columns.iter_mut().for_each(KeyColumn::commit);
        Ok(self.next_step())
    }

    /// What follows a batch that was aggregated: the next, or a hand-over once the groups
    /// or their values pass their bounds.
    fn next_step(&self) -> Step {
        let value_bytes: usize = self.columns.iter().map(|c| c.value_bytes).sum();
        if self.group_count > self.limits.max_groups || value_bytes > self.limits.max_value_bytes {
            Step::HandOverNext
        } else {
            Step::Continue
        }
    }

    /// Each row's group, with several group columns, through `groups`: the row's value ids
    /// packed into one key.
    fn group_packed(&mut self, rows: usize) -> Result<()> {
        for row in 0..rows {
            let packed = pack(self.value_ids.iter().map(|ids| ids[row]));
            let group = match self.groups.get(packed) {
                Some(group) => group as usize,
                None => {
                    let group = self.new_group(|ids| ids[row])?;
                    self.groups.insert(packed, group);
                    group as usize
                }
            };
            self.group_indices.push(group);
        }
        Ok(())
    }

    /// Each row's group, with several group columns, through `combos` (through `groups` once
    /// it is given up).
    fn group_combos(&mut self, rows: usize) -> Result<()> {
        let Some(mut combos) = self.combos.take() else {
            return self.group_packed(rows);
        };
        // Each row's slot, a column at a time (loops the compiler can vectorize).
        let mut slots = std::mem::take(&mut self.group_indices);
        slots.resize(rows, 0);
        for (ids, &stride) in self.value_ids.iter().zip(&combos.strides) {
            for (slot, &id) in slots.iter_mut().zip(ids) {
                *slot += id as usize * stride;
            }
        }
        let mut grouped = Ok(());
        for (row, slot) in slots.iter_mut().enumerate() {
            let Some(entry) = combos.groups.get_mut(*slot) else {
                grouped = Err(DataFusionError::Internal(
                    "a value id past its radix".into(),
                ));
                break;
            };
            if *entry == DenseIds::ABSENT {
                match self.new_group(|ids| ids[row]) {
                    Ok(group) => *entry = group,
                    Err(e) => {
                        grouped = Err(e);
                        break;
                    }
                }
            }
            *slot = *entry as usize;
        }
        self.group_indices = slots;
        self.combos = Some(combos);
        grouped
    }

    /// A new group for the row whose value id in each column `id_of` reads; its id.
    fn new_group(&mut self, id_of: impl Fn(&[u32]) -> u32) -> Result<u32> {
        let group = u32::try_from(self.group_count)
            .map_err(|_| DataFusionError::Internal("too many keyed groups".into()))?;
        for (values, ids) in self.group_values.iter_mut().zip(&self.value_ids) {
            values.push(id_of(ids));
        }
        self.group_count += 1;
        Ok(group)
    }

    /// Lays `combos` out again when a column has more values than its radix, or gives it up
    /// (for `groups`, with every group so far) when the radixes would multiply past
    /// [`DENSE_SLOTS`].
    fn fit_combos(&mut self) {
        if self.combos_given_up {
            return;
        }
        let counts = self.columns.iter().map(|c| c.values.len());
        if let Some(combos) = &self.combos
            && counts
                .clone()
                .zip(&combos.radixes)
                .all(|(n, &radix)| n <= radix)
        {
            return;
        }
        let old = self.combos.as_ref().map(|c| c.radixes.clone());
        let radixes: Vec<usize> = counts
            .enumerate()
            .map(|(c, n)| {
                let radix = old.as_ref().map_or(0, |old| old[c]);
                if n <= radix {
                    radix
                } else {
                    n.next_power_of_two()
                }
            })
            .collect();
        let mut strides = Vec::with_capacity(radixes.len());
        let mut slots = Some(1usize);
        for &radix in &radixes {
            strides.push(slots.unwrap_or(0));
            slots = slots.and_then(|s| s.checked_mul(radix.max(1)));
        }
        let Some(slots) = slots.filter(|&s| s <= DENSE_SLOTS) else {
            self.combos = None;
            self.combos_given_up = true;
            for group in 0..self.group_count {
                let packed = pack(self.group_values.iter().map(|ids| ids[group]));
                self.groups.insert(packed, group as u32);
            }
            return;
        };
        let mut groups = vec![DenseIds::ABSENT; slots];
        for (group, entry) in (0..self.group_count).map(|g| (g, self.slot_of(g, &strides))) {
            if let Some(entry) = groups.get_mut(entry) {
                *entry = group as u32;
            }
        }
        self.combos = Some(Combos {
            radixes,
            strides,
            groups,
        });
    }

    /// The slot of `group`'s value ids under `strides`.
    fn slot_of(&self, group: usize, strides: &[usize]) -> usize {
        (self.group_values.iter().zip(strides))
            .map(|(ids, &stride)| ids[group] as usize * stride)
            .sum()
    }

    /// Every group's keys and partial states, in batches of at most `batch_size` rows.
    fn emit(&mut self, schema: &SchemaRef, batch_size: usize) -> Result<Vec<RecordBatch>> {
        if self.group_count == 0 {
            return Ok(Vec::new());
        }
        let mut columns = Vec::new();
        if let [column] = self.columns.as_slice() {
            columns.push(column.distinct_values()?);
        } else {
            for (column, values) in self.columns.iter().zip(&mut self.group_values) {
                let ids = UInt32Array::from(std::mem::take(values));
                columns.push(arrow_select::take::take(
                    &column.distinct_values()?,
                    &ids,
                    None,
                )?);
            }
        }
        for aggregate in &mut self.aggregates {
            columns.extend(aggregate.state(self.group_count)?);
        }
        let batch = RecordBatch::try_new(Arc::clone(schema), columns)?;
        let batch_size = batch_size.max(1);
        Ok((0..batch.num_rows())
            .step_by(batch_size)
            .map(|start| batch.slice(start, batch_size.min(batch.num_rows() - start)))
            .collect())
    }
}

/// A partial `AggregateExec` run by raw keys (see the module documentation); it hands over to
/// the `AggregateExec` it replaced when its keys do not repeat.
///
/// When the aggregate's input is a `FilterExec`, this operator reads the filter's input and
/// filters each batch itself. `FilterExec` coalesces what it keeps into full batches, which
/// copies strings to new buffers: every string then has a view of its own, and `KeyColumn`'s
/// first table finds none.
#[derive(Debug)]
pub(crate) struct KeyedPartialAggregateExec {
    agg: Arc<AggregateExec>,
    /// The aggregate's input, when it is a filter this operator applies.
    filter: Option<Arc<FilterExec>>,
    /// The source's Parquet scan with group columns read as dictionaries
    /// ([`dictionary_scan`]), read in place of the source; and those columns' names.
    scan: Option<(Arc<dyn ExecutionPlan>, Vec<String>)>,
    limits: Limits,
    metrics: ExecutionPlanMetricsSet,
}

impl KeyedPartialAggregateExec {
    /// Runs `agg`, and its input's filter if it has one without a limit.
    fn new(agg: Arc<AggregateExec>, limits: Limits) -> Self {
        let filter = agg
            .input()
            .downcast_ref::<FilterExec>()
            .filter(|filter| filter.fetch().is_none())
            .map(|filter| Arc::new(filter.clone()));
        KeyedPartialAggregateExec {
            agg,
            filter,
            scan: None,
            limits,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// The plan that the aggregate (and its filter) read.
    fn source(&self) -> &Arc<dyn ExecutionPlan> {
        match &self.filter {
            Some(filter) => filter.input(),
            None => self.agg.input(),
        }
    }

    /// The plan whose batches this operator reads: the source, or its dictionary scan.
    fn input(&self) -> &Arc<dyn ExecutionPlan> {
        match &self.scan {
            Some((scan, _)) => scan,
            None => self.source(),
        }
    }

    /// This operator reading its string group columns as dictionaries where the source is a
    /// Parquet scan that can give them so ([`dictionary_scan`]). A column qualifies if the
    /// operator reads it only as a group key: no aggregate, aggregate filter or row filter
    /// reads it.
    fn reading_dictionaries(mut self) -> Result<Self> {
        let input = self.agg.input().schema();
        let mut read_otherwise: Vec<usize> = Vec::new();
        for aggregate in self.agg.aggr_expr() {
            for argument in aggregate.expressions() {
                read_otherwise.extend(collect_columns(&argument).iter().map(Column::index));
            }
        }
        for filter in self.agg.filter_expr().iter().flatten() {
            read_otherwise.extend(collect_columns(filter).iter().map(Column::index));
        }
        let mut keys = Vec::new();
        for (expr, _) in self.agg.group_expr().expr() {
            match expr.downcast_ref::<Column>() {
                Some(column) if expr.data_type(&input)? == DataType::Utf8View => {
                    keys.push(column.index())
                }
                _ => read_otherwise.extend(collect_columns(expr).iter().map(Column::index)),
            }
        }
        keys.retain(|k| !read_otherwise.contains(k));
        // The keys' columns in the source's output: through the filter's projection, and not
        // read by its predicate.
        let mut columns = Vec::new();
        let mut names = Vec::new();
        for key in keys {
            let column = match &self.filter {
                Some(filter) => {
                    let column = match filter.projection() {
                        Some(projection) => projection.get(key).copied(),
                        None => Some(key),
                    };
                    match column {
                        Some(c)
                            if !collect_columns(filter.predicate())
                                .iter()
                                .any(|p| p.index() == c) =>
                        {
                            c
                        }
                        _ => continue,
                    }
                }
                None => key,
            };
            if !columns.contains(&column) {
                columns.push(column);
                names.push(input.field(key).name().clone());
            }
        }
        if let Some(scan) = dictionary_scan(self.source(), &columns)? {
            self.scan = Some((scan, names));
        }
        Ok(self)
    }
}

/// `agg` (and its input's `filter`, if it is applied with it) over another source.
fn over_source(
    agg: &Arc<AggregateExec>,
    filter: Option<&Arc<FilterExec>>,
    source: Arc<dyn ExecutionPlan>,
) -> Result<Arc<dyn ExecutionPlan>> {
    let input = match filter {
        Some(filter) => (Arc::clone(filter) as Arc<dyn ExecutionPlan>)
            .replace_children(vec![source], recompute())?,
        None => source,
    };
    (Arc::clone(agg) as Arc<dyn ExecutionPlan>).replace_children(vec![input], recompute())
}

impl DisplayAs for KeyedPartialAggregateExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        if t == DisplayFormatType::TreeRender {
            // Lines of `key=value`: the aggregate's, then the filter's.
            self.agg.fmt_as(t, f)?;
            if let Some(filter) = &self.filter {
                writeln!(f)?;
                filter.fmt_as(t, f)?;
            }
            return Ok(());
        }
        write!(f, "KeyedPartialAggregateExec")?;
        if let Some((_, names)) = &self.scan {
            write!(f, " reading dictionaries of [{}]", names.join(", "))?;
        }
        write!(f, " of ")?;
        self.agg.fmt_as(t, f)?;
        if let Some(filter) = &self.filter {
            write!(f, ", of ")?;
            filter.fmt_as(t, f)?;
        }
        Ok(())
    }
}

impl ExecutionPlan for KeyedPartialAggregateExec {
    fn name(&self) -> &str {
        "KeyedPartialAggregateExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.agg.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![self.input()]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        let recursion = self.agg.apply_expressions(f)?;
        match &self.filter {
            Some(filter) if recursion != TreeNodeRecursion::Stop => filter.apply_expressions(f),
            _ => Ok(recursion),
        }
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let [source] = <[_; 1]>::try_from(children)
            .map_err(|_| DataFusionError::Internal("a keyed aggregate has one child".into()))?;
        if let Some((scan, names)) = &self.scan {
            // The dictionary scan, made anew (its state reset, say): the aggregate and filter
            // stay as planned over the scan it replaced.
            if source.schema() != scan.schema() {
                return Err(DataFusionError::Internal(
                    "a keyed aggregate's dictionary scan was replaced by another plan".into(),
                ));
            }
            return Ok(Arc::new(KeyedPartialAggregateExec {
                agg: Arc::clone(&self.agg),
                filter: self.filter.clone(),
                scan: Some((source, names.clone())),
                limits: self.limits,
                metrics: ExecutionPlanMetricsSet::new(),
            }));
        }
        let plan = over_source(&self.agg, self.filter.as_ref(), source)?;
        let Some(agg) = plan.downcast_ref::<AggregateExec>() else {
            return Err(DataFusionError::Internal(
                "an aggregate with new children is no longer an aggregate".into(),
            ));
        };
        // Over another source the aggregate may no longer be one this operator can run (its
        // input sorted on the keys, say, or keys of another type).
        if !keyed(agg)? {
            return Ok(plan);
        }
        let filter = match &self.filter {
            Some(_) => agg
                .input()
                .downcast_ref::<FilterExec>()
                .cloned()
                .map(Arc::new),
            None => None,
        };
        Ok(Arc::new(KeyedPartialAggregateExec {
            agg: Arc::new(agg.clone()),
            filter,
            scan: None,
            limits: self.limits,
            metrics: ExecutionPlanMetricsSet::new(),
        }))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let mut input = self.input().execute(partition, Arc::clone(&context))?;
        // What the replaced operator reads, should the rest be handed over to it.
        let source_schema = self.scan.as_ref().map(|_| self.source().schema());
        let schema = self.agg.schema();
        let batch_size = context.session_config().batch_size();
        let mut grouping = Grouping::new(&self.agg, self.limits)?;
        let agg = Arc::clone(&self.agg);
        let filter = self.filter.clone();
        let baseline = BaselineMetrics::new(&self.metrics, partition);
        let handed_over: Count =
            MetricBuilder::new(&self.metrics).counter("handed_over", partition);
        let output_schema = Arc::clone(&schema);
        let output = futures::stream::once(async move {
            while let Some(batch) = input.next().await {
                let batch = batch?;
                let step = {
                    let _timer = baseline.elapsed_compute().timer();
                    match &filter {
                        Some(filter) => grouping.aggregate(&filtered(filter, &batch)?)?,
                        None => grouping.aggregate(&batch)?,
                    }
                };
                if step == Step::Continue {
                    continue;
                }
                handed_over.add(1);
                let ours = grouping.emit(&output_schema, batch_size)?;
                baseline.record_output(ours.iter().map(RecordBatch::num_rows).sum());
                let first = (step == Step::HandOverThis).then_some(batch);
                let (first, input) = match &source_schema {
                    Some(schema) => {
                        let first = first.map(|b| cast_to(&b, schema)).transpose()?;
                        let restore = Arc::clone(schema);
                        let restored = input.map(move |b| b.and_then(|b| cast_to(&b, &restore)));
                        let input: SendableRecordBatchStream =
                            Box::pin(RecordBatchStreamAdapter::new(Arc::clone(schema), restored));
                        (first, input)
                    }
                    None => (first, input),
                };
                let rest = hand_over(&agg, filter.as_ref(), first, input, context)?;
                // The rows of the handed-over part count as this operator's output too.
                let counted = baseline.clone();
                let rest = rest.inspect(move |batch| {
                    if let Ok(batch) = batch {
                        counted.record_output(batch.num_rows());
                    }
                });
                let output: Batches = futures::stream::iter(ours.into_iter().map(Ok))
                    .chain(rest)
                    .boxed();
                return Ok(output);
            }
            let ours = grouping.emit(&output_schema, batch_size)?;
            baseline.record_output(ours.iter().map(RecordBatch::num_rows).sum());
            baseline.done();
            let output: Batches = futures::stream::iter(ours.into_iter().map(Ok)).boxed();
            Ok::<_, DataFusionError>(output)
        })
        .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, output)))
    }
}

/// What `filter` passes on from `batch`: the rows its predicate keeps (not where it is
/// null), with its projection. Unlike `FilterExec`, no rows are coalesced into batches of
/// their own, which would copy strings to new buffers.
fn filtered(filter: &FilterExec, batch: &RecordBatch) -> Result<RecordBatch> {
    let keep = filter
        .predicate()
        .evaluate(batch)
        .and_then(|v| v.into_array(batch.num_rows()))?;
    let keep = keep
        .as_boolean_opt()
        .ok_or_else(|| DataFusionError::Internal("a filter's predicate is not boolean".into()))?;
    let keep = match keep.null_count() {
        0 => keep.clone(),
        _ => prep_null_mask_filter(keep),
    };
    let projected = match filter.projection() {
        Some(projection) => batch.project(projection)?,
        None => batch.clone(),
    };
    Ok(filter_record_batch(&projected, &keep)?)
}

/// A partition's output batches.
type Batches = BoxStream<'static, Result<RecordBatch>>;

/// Runs `agg` (the replaced `AggregateExec`, and the filter applied with it) over `first`
/// and then the rest of `input`.
fn hand_over(
    agg: &Arc<AggregateExec>,
    filter: Option<&Arc<FilterExec>>,
    first: Option<RecordBatch>,
    input: SendableRecordBatchStream,
    context: Arc<TaskContext>,
) -> Result<SendableRecordBatchStream> {
    let schema = input.schema();
    let batches = futures::stream::iter(first.map(Ok)).chain(input);
    let handed = HandedInput {
        schema: Arc::clone(&schema),
        stream: Mutex::new(Some(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&schema),
            batches,
        )))),
    };
    let source =
        StreamingTableExec::try_new(schema, vec![Arc::new(handed)], None, [], false, None)?;
    over_source(agg, filter, Arc::new(source))?.execute(0, context)
}

/// Children replaced, and the plan's properties computed again from them.
pub(crate) fn recompute() -> ReplaceChildrenOptions {
    ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute)
}

/// The rest of an input, as a partition that can be executed once.
struct HandedInput {
    schema: SchemaRef,
    stream: Mutex<Option<SendableRecordBatchStream>>,
}

impl fmt::Debug for HandedInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandedInput").finish_non_exhaustive()
    }
}

impl PartitionStream for HandedInput {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let taken = self
            .stream
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        taken.unwrap_or_else(|| {
            let error = DataFusionError::Internal("a handed-over input was read twice".into());
            Box::pin(RecordBatchStreamAdapter::new(
                Arc::clone(&self.schema),
                futures::stream::once(async move { Err(error) }),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::PrimitiveArray;
    use arrow_array::builder::{Float64Builder, Int32Builder, Int64Builder, StringViewBuilder};
    use arrow_array::types::TimestampNanosecondType;
    use arrow_schema::{Field, Schema, TimeUnit};
    use datafusion::arrow::util::pretty::pretty_format_batches;
    use datafusion::datasource::MemTable;
    use datafusion::execution::session_state::SessionStateBuilder;
    use datafusion::physical_plan::collect;
    use datafusion::prelude::{SessionConfig, SessionContext};

    /// Three partitions of four batches: `s` a few strings (long ones too) with nulls,
    /// deduplicated as a Parquet dictionary page decodes them; `h` a string of its own on
    /// every row; `u` three strings, each row's a copy of its own; `w` three thousand values; `n`, `d`, `t` and `v` small ranges with nulls.
    fn events() -> MemTable {
        let schema = Arc::new(Schema::new(vec![
            Field::new("s", DataType::Utf8View, true),
            Field::new("h", DataType::Utf8View, false),
            Field::new("u", DataType::Utf8View, false),
            Field::new("n", DataType::Int64, true),
            Field::new("d", DataType::Int32, false),
            Field::new("w", DataType::Int64, false),
            Field::new(
                "t",
                DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
                false,
            ),
            Field::new("v", DataType::Float64, true),
        ]));
        let names = [
            Some("alpha"),
            Some("a service name longer than twelve bytes"),
            None,
            Some("checkout-service-long"),
            Some("beta"),
        ];
        let mut state = 42u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            state >> 33
        };
        let mut row = 0i64;
        let mut partitions = Vec::new();
        for _ in 0..3 {
            let mut batches = Vec::new();
            for _ in 0..4 {
                let mut s = StringViewBuilder::new().with_deduplicate_strings();
                let mut h = StringViewBuilder::new();
                let mut u = StringViewBuilder::new();
                let (mut n, mut d, mut w) = (
                    Int64Builder::new(),
                    Int32Builder::new(),
                    Int64Builder::new(),
                );
                let mut t = Vec::new();
                let mut v = Float64Builder::new();
                for _ in 0..1000 {
                    let r = next();
                    s.append_option(names[(r % 5) as usize]);
                    h.append_value(format!("trace-{row:020}"));
                    u.append_value(
                        ["GET /api/v1/orders", "POST /api/v1/carts", "GET /health"]
                            [(r / 5 % 3) as usize],
                    );
                    n.append_option((r % 11 != 0).then_some((r % 7) as i64));
                    d.append_value((r % 3) as i32);
                    w.append_value((r % 3000) as i64);
                    t.push(1_790_000_000_000_000_000 + row * 7_000_000_000);
                    v.append_option((r % 13 != 0).then_some((r % 1000) as f64));
                    row += 1;
                }
                let t = PrimitiveArray::<TimestampNanosecondType>::from(t).with_timezone("UTC");
                let columns: Vec<ArrayRef> = vec![
                    Arc::new(s.finish()),
                    Arc::new(h.finish()),
                    Arc::new(u.finish()),
                    Arc::new(n.finish()),
                    Arc::new(d.finish()),
                    Arc::new(w.finish()),
                    Arc::new(t),
                    Arc::new(v.finish()),
                ];
                batches.push(RecordBatch::try_new(Arc::clone(&schema), columns).unwrap());
            }
            partitions.push(batches);
        }
        MemTable::try_new(schema, partitions).unwrap()
    }

    fn context(rule: Option<Limits>) -> SessionContext {
        session("t", events(), rule, 3, 8192)
    }

    /// A session with `table` as `name`, planning with the rule (and these limits) if any.
    pub(super) fn session(
        name: &str,
        table: MemTable,
        rule: Option<Limits>,
        target_partitions: usize,
        batch_size: usize,
    ) -> SessionContext {
        let config = SessionConfig::new()
            .with_target_partitions(target_partitions)
            .with_batch_size(batch_size);
        let mut state = SessionStateBuilder::new()
            .with_config(config)
            .with_default_features();
        if let Some(limits) = rule {
            state = state.with_physical_optimizer_rule(Arc::new(KeyedGrouping::new(limits)));
        }
        let ctx = SessionContext::new_with_state(state.build());
        ctx.register_table(name, Arc::new(table)).unwrap();
        ctx
    }

    /// The answer, the plan, and how many partitions handed over.
    pub(super) async fn run(ctx: &SessionContext, sql: &str) -> (String, String, usize) {
        let plan = ctx
            .sql(sql)
            .await
            .unwrap()
            .create_physical_plan()
            .await
            .unwrap();
        let batches = collect(Arc::clone(&plan), ctx.task_ctx()).await.unwrap();
        let answer = pretty_format_batches(&batches).unwrap().to_string();
        let shown = datafusion::physical_plan::displayable(plan.as_ref())
            .indent(false)
            .to_string();
        fn handed(plan: &Arc<dyn ExecutionPlan>) -> usize {
            let own = if plan.name() == "KeyedPartialAggregateExec" {
                plan.metrics()
                    .and_then(|m| m.sum_by_name("handed_over"))
                    .map_or(0, |v| v.as_usize())
            } else {
                0
            };
            own + plan.children().into_iter().map(handed).sum::<usize>()
        }
        (answer, shown, handed(&plan))
    }

    /// Every query answers as DataFusion's own partial aggregate does: with the keyed path
    /// throughout, and with limits so small that partitions hand over mid-input (both after a
    /// batch that made too many groups and from a batch whose keys do not repeat).
    #[tokio::test]
    async fn keyed_grouping_answers_as_datafusion_does() {
        let reference = context(None);
        let keyed = context(Some(Limits::DEFAULT));
        let small = Limits {
            max_groups: 100,
            max_value_bytes: 64 << 20,
            min_new_values: 8,
            rows_per_new_value: 8,
        };
        let tight = context(Some(small));
        // (query, hands over with the default limits, hands over with the small ones)
        let queries = [
            (
                "SELECT s, count(*), count(v), sum(v), avg(v), min(v), max(v) FROM t GROUP BY s ORDER BY s",
                false,
                false,
            ),
            (
                "SELECT s, n, count(*), sum(n), max(t) FROM t GROUP BY s, n ORDER BY s, n",
                false,
                false,
            ),
            ("SELECT count(DISTINCT s) FROM t", false, false),
            (
                "SELECT count(DISTINCT n) AS k FROM t WHERE s IS NOT NULL",
                false,
                false,
            ),
            (
                "SELECT h, count(*) FROM t GROUP BY h ORDER BY h",
                true,
                true,
            ),
            // Views that do not repeat (each row's string copied), of values that do.
            (
                "SELECT u, count(*), max(v) FROM t GROUP BY u ORDER BY u",
                false,
                false,
            ),
            (
                "SELECT u, s, count(*) FROM t WHERE n >= 2 GROUP BY u, s ORDER BY u, s",
                false,
                false,
            ),
            // Filters applied by the keyed aggregate: a predicate that is null on some rows,
            // one that rejects whole batches, and one whose rejected rows would make an
            // aggregate's argument fail (so it must filter before it evaluates).
            (
                "SELECT s, n, count(*), max(v) FROM t WHERE v > 500 GROUP BY s, n ORDER BY s, n",
                false,
                false,
            ),
            (
                "SELECT d, count(*) FROM t WHERE w < 3 AND t < '2026-09-23T12:00:00Z' GROUP BY d ORDER BY d",
                false,
                false,
            ),
            (
                "SELECT s, sum(100 / n) FROM t WHERE n <> 0 GROUP BY s ORDER BY s",
                false,
                false,
            ),
            (
                "SELECT h, count(*) FROM t WHERE d = 1 GROUP BY h ORDER BY h",
                true,
                true,
            ),
            (
                "SELECT w, count(*), max(t), min(d) FROM t GROUP BY w ORDER BY w",
                true,
                true,
            ),
            (
                "SELECT date_trunc('hour', t) AS hr, n, count(*) FROM t GROUP BY hr, n ORDER BY hr, n",
                false,
                false,
            ),
            (
                "SELECT s, count(*) FILTER (WHERE n > 3), sum(v) FILTER (WHERE n < 2) FROM t GROUP BY s ORDER BY s",
                false,
                false,
            ),
            (
                "SELECT s, count(*) FROM t WHERE n > 100 GROUP BY s ORDER BY s",
                false,
                false,
            ),
            (
                "SELECT s, d, n, w % 3 AS m, count(*), sum(v) FROM t GROUP BY s, d, n, m ORDER BY s, d, n, m",
                false,
                true,
            ),
            (
                "SELECT n, count(*) FROM t GROUP BY n HAVING count(*) > 10 ORDER BY n",
                false,
                false,
            ),
            // Negative keys: far apart as raw bits, so not dense.
            (
                "SELECT n - 3 AS k, d - 1 AS e, count(*) FROM t GROUP BY k, e ORDER BY k, e",
                false,
                false,
            ),
        ];
        for (sql, hands_over, hands_over_small) in queries {
            let (expected, _, _) = run(&reference, sql).await;
            let (_, plan, _) = run(&keyed, sql).await;
            // The keyed aggregate applies a filter beneath it itself.
            assert_eq!(
                plan.contains(", of FilterExec"),
                sql.contains("FROM t WHERE"),
                "{sql}\n{plan}"
            );
            for (limits, ctx, hands_over) in [
                ("default", &keyed, hands_over),
                ("small", &tight, hands_over_small),
            ] {
                let (answer, plan, handed) = run(ctx, sql).await;
                assert!(
                    answer == expected,
                    "{sql} ({limits} limits): another answer\n{plan}"
                );
                assert!(plan.contains("KeyedPartialAggregateExec"), "{sql}\n{plan}");
                assert_eq!(
                    handed > 0,
                    hands_over,
                    "{sql}: {handed} handed over ({limits} limits)\n{plan}"
                );
            }
        }
        // Not keyed: a float key, a distinct aggregate beside another, a string aggregate.
        for sql in [
            "SELECT v, count(*) FROM t GROUP BY v ORDER BY v",
            "SELECT s, count(DISTINCT n), count(*) FROM t GROUP BY s ORDER BY s",
            "SELECT n, max(s) FROM t GROUP BY n ORDER BY n",
        ] {
            let (expected, _, _) = run(&reference, sql).await;
            let (answer, plan, _) = run(&keyed, sql).await;
            assert!(answer == expected, "{sql}: another answer");
            assert!(!plan.contains("KeyedPartialAggregateExec"), "{sql}\n{plan}");
        }
    }

    #[test]
    fn raw_key_table_keeps_ids_across_growth_and_forgets_them_on_clear() {
        let mut table = RawKeyTable::new();
        for key in 0..1000u128 {
            table.insert(key << 70 | key, key as u32);
        }
        for key in 0..1000u128 {
            assert_eq!(table.get(key << 70 | key), Some(key as u32));
        }
        assert_eq!(table.get(5000), None);
        table.clear();
        assert_eq!(table.get(1 << 70 | 1), None);
        table.insert(7, 3);
        assert_eq!(table.get(7), Some(3));
        // Value ids packed as several group columns pack them: no long runs of probes.
        let mut packed = RawKeyTable::new();
        for a in 0..64u128 {
            for b in 0..64u128 {
                packed.insert(a | b << 32, (a * 64 + b) as u32);
            }
        }
        assert!(packed.longest_probe() < 32, "{}", packed.longest_probe());
        assert_eq!(packed.get(5 | 9 << 32), Some(5 * 64 + 9));
    }

    /// Fixed-width keys through `dense` as it widens both ways, keys that wrap around below
    /// its base, and the move to `raw` when they spread too far: every row gets its own
    /// value's id, and a value keeps its id.
    #[test]
    fn dense_ids_widen_and_give_way_to_raw() {
        let mut column = KeyColumn::new(KeyKind::Fixed(8), 0);
        let batches: Vec<(Vec<u64>, bool)> = vec![
            (vec![500, 200, 404, 200, 500], true),
            (vec![100, 200, 700, 99], true),
            ((1000..1400).rev().collect(), true),
            ((1..60).chain(0..1).collect(), true),
            (vec![u64::MAX, 5, 200], false),
            (vec![5, u64::MAX, 404, 70_000, 1 << 40, 500], false),
        ];
        let (mut out, mut new) = (Vec::new(), 0);
        for (keys, dense) in batches {
            let array: ArrayRef = Arc::new(arrow_array::UInt64Array::from(keys.clone()));
            assert!(
                column
                    .value_ids(&array, &mut out, &mut new, usize::MAX)
                    .unwrap()
            );
            column.commit();
            assert_eq!(column.dense.is_some(), dense, "{keys:?}");
            for (key, &id) in keys.iter().zip(&out) {
                assert_eq!(column.values[id as usize], ScalarValue::UInt64(Some(*key)));
            }
        }
        assert_eq!(column.values.len(), column.ids.len());
    }
}

#[cfg(test)]
mod edges {
    //! Edge values and batches against DataFusion's own plan.
    use super::tests::{run, session};
    use super::*;
    use arrow_array::{
        Decimal128Array, Float64Array, Int8Array, StringViewArray, TimestampMillisecondArray,
        UInt64Array,
    };
    use arrow_schema::{Field, Schema, TimeUnit};
    use datafusion::datasource::MemTable;
    use datafusion::prelude::SessionContext;

    fn ctx(
        parts: &[Vec<RecordBatch>],
        schema: SchemaRef,
        rule: Option<Limits>,
        target: usize,
    ) -> SessionContext {
        let table = MemTable::try_new(schema, parts.to_vec()).unwrap();
        session("r", table, rule, target, 8192)
    }

    async fn answer(ctx: &SessionContext, sql: &str) -> (String, String) {
        let (answer, plan, _) = run(ctx, sql).await;
        (answer, plan)
    }

    async fn compare(
        parts: Vec<Vec<RecordBatch>>,
        schema: SchemaRef,
        sqls: &[&str],
        target: usize,
    ) {
        let small = Limits {
            max_groups: 4,
            max_value_bytes: 1 << 20,
            min_new_values: 2,
            rows_per_new_value: 8,
        };
        compare_with(parts, schema, sqls, target, &[Limits::DEFAULT, small]).await
    }

    async fn compare_with(
        parts: Vec<Vec<RecordBatch>>,
        schema: SchemaRef,
        sqls: &[&str],
        target: usize,
        all: &[Limits],
    ) {
        let reference = ctx(&parts, Arc::clone(&schema), None, target);
        for sql in sqls {
            let (expected, _) = answer(&reference, sql).await;
            for &limits in all {
                let keyed = ctx(&parts, Arc::clone(&schema), Some(limits), target);
                let (got, plan) = answer(&keyed, sql).await;
                assert!(
                    got == expected,
                    "{sql} {limits:?}\nexpected\n{expected}\ngot\n{got}\n{plan}"
                );
            }
        }
    }

    /// Two group columns whose values grow batch by batch: the mixed-radix table of groups is
    /// laid out again as radixes grow, then given up for the hash table past its slots, with
    /// the groups it held; nulls are a value of their own.
    #[tokio::test]
    async fn groups_of_several_columns_move_from_radix_table_to_hash_table() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::UInt64, true),
            Field::new("b", DataType::Utf8View, true),
        ]));
        let batch = |values: u64, rows: u64| {
            let a = UInt64Array::from_iter((0..rows).map(|r| (r % 7 != 3).then_some(r % values)));
            let b = StringViewArray::from_iter(
                (0..rows).map(|r| (r % 11 != 5).then(|| format!("v{}", (r * 7 + 3) % values))),
            );
            RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(a), Arc::new(b)]).unwrap()
        };
        let parts = vec![vec![
            batch(3, 50),
            batch(5, 200),
            batch(40, 2000),
            batch(300, 20_000),
            batch(6, 100),
            batch(700, 20_000),
        ]];
        let wide = Limits {
            max_groups: 1 << 20,
            max_value_bytes: 1 << 30,
            min_new_values: 1 << 20,
            rows_per_new_value: 1,
        };
        let sqls = [
            "SELECT a, b, count(*), sum(a) FROM r GROUP BY a, b ORDER BY a, b",
            "SELECT b, a, count(*) FROM r WHERE a > 2 GROUP BY b, a ORDER BY b, a",
        ];
        // Two partitions: with one, DataFusion plans a single-mode aggregate, never keyed.
        let reference = ctx(&parts, Arc::clone(&schema), None, 2);
        for sql in sqls {
            let (expected, _) = answer(&reference, sql).await;
            for limits in [wide, Limits::DEFAULT] {
                let keyed = ctx(&parts, Arc::clone(&schema), Some(limits), 2);
                let (got, plan) = answer(&keyed, sql).await;
                assert!(plan.contains("KeyedPartialAggregateExec"), "{sql}\n{plan}");
                assert!(
                    got == expected,
                    "{sql} {limits:?}\n{expected}\n{got}\n{plan}"
                );
            }
        }
    }

    /// Negative decimals (not keyed: their order is not that of their bits) and a mix of
    /// signs in one batch.
    #[tokio::test]
    async fn negative_decimal_keys_answer_as_datafusion_does() {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "k",
            DataType::Decimal128(10, 2),
            true,
        )]));
        let b = |v: &[Option<i128>]| {
            let k = Decimal128Array::from(v.to_vec())
                .with_precision_and_scale(10, 2)
                .unwrap();
            RecordBatch::try_new(Arc::clone(&schema), vec![Arc::new(k) as ArrayRef]).unwrap()
        };
        let parts = vec![
            vec![
                b(&[Some(-1), Some(-1), None, Some(-2)]),
                b(&[Some(1), Some(-1), Some(0)]),
            ],
            vec![b(&[Some(5)])],
        ];
        compare(
            parts,
            schema,
            &["SELECT k, count(*) FROM r GROUP BY k ORDER BY k"],
            2,
        )
        .await;
    }

    #[tokio::test]
    async fn edge_values_and_batches_answer_as_datafusion_does() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("u", DataType::UInt64, true),
            Field::new("i", DataType::Int8, true),
            Field::new("s", DataType::Utf8View, true),
            Field::new(
                "ts",
                DataType::Timestamp(TimeUnit::Millisecond, Some("+05:00".into())),
                true,
            ),
            Field::new("f", DataType::Float64, true),
        ]));
        let mk = |u: Vec<Option<u64>>,
                  i: Vec<Option<i8>>,
                  s: Vec<Option<&str>>,
                  ts: Vec<Option<i64>>,
                  f: Vec<Option<f64>>| {
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(UInt64Array::from(u)) as ArrayRef,
                    Arc::new(Int8Array::from(i)),
                    Arc::new(StringViewArray::from(s)),
                    Arc::new(TimestampMillisecondArray::from(ts).with_timezone("+05:00")),
                    Arc::new(Float64Array::from(f)),
                ],
            )
            .unwrap()
        };
        let big = mk(
            vec![
                Some(u64::MAX),
                Some(0),
                None,
                Some(1 << 63),
                Some(u64::MAX),
                Some(5),
                Some(6),
                Some(7),
            ],
            vec![
                Some(-128),
                Some(127),
                None,
                Some(-1),
                Some(0),
                Some(-128),
                Some(3),
                None,
            ],
            vec![
                Some(""),
                None,
                Some("a very long string value here"),
                Some("a very long string value here"),
                Some(""),
                Some("x"),
                None,
                Some("y"),
            ],
            vec![
                Some(-5),
                Some(0),
                None,
                Some(i64::MAX),
                Some(i64::MIN),
                Some(-5),
                Some(1),
                Some(2),
            ],
            vec![
                Some(1e16),
                Some(-0.0),
                Some(0.0),
                None,
                Some(f64::NAN),
                Some(1.0),
                Some(1.0),
                Some(1.0),
            ],
        );
        // Sliced batches (nonzero offsets), an empty batch, and a zero-length slice.
        let parts = vec![
            vec![big.slice(1, 5), big.slice(0, 0), big.slice(3, 5)],
            vec![big.clone(), big.slice(7, 1)],
            vec![],
        ];
        let sqls = [
            "SELECT u, count(*), sum(f), min(i), max(ts) FROM r GROUP BY u ORDER BY u",
            "SELECT i, count(f), avg(f) FROM r GROUP BY i ORDER BY i",
            "SELECT s, count(*) FROM r GROUP BY s ORDER BY s",
            "SELECT ts, count(*) FROM r GROUP BY ts ORDER BY ts",
            "SELECT u, i, s, ts, count(*), max(f) FROM r GROUP BY u, i, s, ts ORDER BY u, i, s, ts",
            "SELECT s, count(*) FROM r WHERE u > 100 GROUP BY s ORDER BY s",
            "SELECT i, count(*) FILTER (WHERE f > 0), sum(u) FILTER (WHERE s IS NULL) FROM r GROUP BY i ORDER BY i",
            "SELECT count(DISTINCT s), count(DISTINCT u) FROM r",
            "SELECT u, count(*) FROM r WHERE 1 = 0 GROUP BY u",
            "SELECT arrow_typeof(ts), count(*) FROM r GROUP BY ts ORDER BY ts",
        ];
        compare(parts.clone(), Arc::clone(&schema), &sqls, 3).await;
        compare(parts, schema, &sqls, 2).await;
    }
}

#[cfg(test)]
mod fuzz {
    //! Random tables against DataFusion's own plan.
    use super::tests::{run, session};
    use super::*;
    use arrow_array::builder::{
        BinaryViewBuilder, Date32Builder, Float64Builder, Int16Builder, StringViewBuilder,
        UInt64Builder,
    };
    use arrow_schema::{Field, Schema};
    use datafusion::datasource::MemTable;
    use datafusion::prelude::SessionContext;

    fn table(seed: u64) -> (SchemaRef, Vec<Vec<RecordBatch>>) {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int16, true),
            Field::new("b", DataType::Utf8View, true),
            Field::new("c", DataType::UInt64, true),
            Field::new("d", DataType::Date32, false),
            Field::new("e", DataType::BinaryView, true),
            Field::new("x", DataType::Float64, true),
        ]));
        let mut state = seed;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            state >> 33
        };
        let words = [
            "",
            "a",
            "bb",
            "twelve-bytes",
            "thirteen-byte",
            "a much longer value for views",
            "x",
        ];
        let mut parts = Vec::new();
        for _ in 0..3 {
            let mut batches = Vec::new();
            for _ in 0..12 {
                let rows = (next() % 300) as usize;
                let dedup = next() % 2 == 0;
                let spread = 1 + next() % 200;
                let mut b = if dedup {
                    StringViewBuilder::new().with_deduplicate_strings()
                } else {
                    StringViewBuilder::new()
                };
                let mut e = BinaryViewBuilder::new();
                let (mut a, mut c, mut d, mut x) = (
                    Int16Builder::new(),
                    UInt64Builder::new(),
                    Date32Builder::new(),
                    Float64Builder::new(),
                );
                for _ in 0..rows {
                    let r = next();
                    a.append_option((r % 9 != 0).then_some((r % 11) as i16 - 5));
                    if r % 7 == 0 {
                        b.append_null()
                    } else if r % 5 == 0 {
                        b.append_value(format!("w{}", r % spread))
                    } else {
                        b.append_value(words[(r % 7) as usize])
                    }
                    c.append_option((r % 13 != 0).then_some(if r % 2 == 0 {
                        u64::MAX - r % 4
                    } else {
                        r % spread
                    }));
                    d.append_value((r % 3) as i32 * 40000 - 40000 + (r % spread) as i32);
                    if r % 6 == 0 {
                        e.append_null()
                    } else {
                        e.append_value(&[(r % 4) as u8, 0xff][..((r % 3) as usize).min(2)])
                    }
                    x.append_option((r % 10 != 0).then_some((r % 100) as f64));
                }
                let batch = RecordBatch::try_new(
                    Arc::clone(&schema),
                    vec![
                        Arc::new(a.finish()) as ArrayRef,
                        Arc::new(b.finish()),
                        Arc::new(c.finish()),
                        Arc::new(d.finish()),
                        Arc::new(e.finish()),
                        Arc::new(x.finish()),
                    ],
                )
                .unwrap();
                let off = if rows > 10 { (next() % 5) as usize } else { 0 };
                batches.push(batch.slice(off, rows - off));
            }
            parts.push(batches);
        }
        (schema, parts)
    }

    fn ctx(schema: &SchemaRef, parts: &[Vec<RecordBatch>], rule: Option<Limits>) -> SessionContext {
        let table = MemTable::try_new(Arc::clone(schema), parts.to_vec()).unwrap();
        session("r", table, rule, 3, 64)
    }

    async fn answer(ctx: &SessionContext, sql: &str) -> (String, String) {
        let (answer, plan, _) = run(ctx, sql).await;
        (answer, plan)
    }

    #[tokio::test]
    async fn random_tables_answer_as_datafusion_does() {
        let sqls = [
            "SELECT a, count(*), count(x), sum(c), min(d), max(x) FROM r GROUP BY a ORDER BY a",
            "SELECT b, count(*), sum(a), min(c), max(c) FROM r GROUP BY b ORDER BY b",
            "SELECT c, count(*) FROM r GROUP BY c ORDER BY c",
            "SELECT d, count(*), sum(a) FROM r GROUP BY d ORDER BY d",
            "SELECT e, count(*) FROM r GROUP BY e ORDER BY e",
            "SELECT a, b, count(*), min(x) FROM r GROUP BY a, b ORDER BY a, b",
            "SELECT b, c, d, e, count(*) FROM r GROUP BY b, c, d, e ORDER BY b, c, d, e",
            "SELECT a, b, c, d, count(*) FILTER (WHERE x > 50), sum(a) FILTER (WHERE b IS NULL) FROM r GROUP BY a, b, c, d ORDER BY a, b, c, d",
            "SELECT count(DISTINCT b), count(DISTINCT c) FROM r",
            "SELECT a, count(DISTINCT b) FROM r GROUP BY a ORDER BY a",
            "SELECT a + 1 AS k, count(*) FROM r WHERE a IS NULL OR a > 0 GROUP BY k ORDER BY k",
            "SELECT b, count(*) FROM r WHERE c > 100 GROUP BY b ORDER BY b",
        ];
        let limits = [
            Limits::DEFAULT,
            Limits {
                max_groups: 3,
                max_value_bytes: 1 << 20,
                min_new_values: 1,
                rows_per_new_value: 1000,
            },
            Limits {
                max_groups: 50,
                max_value_bytes: 1 << 20,
                min_new_values: 5,
                rows_per_new_value: 4,
            },
            Limits {
                max_groups: 1000,
                max_value_bytes: 1 << 20,
                min_new_values: 20,
                rows_per_new_value: 8,
            },
            // Hands over on the bytes of the key values.
            Limits {
                max_groups: 1000,
                max_value_bytes: 300,
                min_new_values: 1000,
                rows_per_new_value: 1,
            },
        ];
        for seed in 0..4u64 {
            let (schema, parts) = table(seed);
            let reference = ctx(&schema, &parts, None);
            for sql in sqls {
                let (expected, _) = answer(&reference, sql).await;
                for l in limits {
                    let (got, plan) = answer(&ctx(&schema, &parts, Some(l)), sql).await;
                    assert!(
                        got == expected,
                        "seed {seed} {sql} {l:?}\nexpected\n{expected}\ngot\n{got}\n{plan}"
                    );
                }
            }
        }
    }

    #[tokio::test]
    async fn plans_that_are_not_keyed_still_answer() {
        let (schema, parts) = table(9);
        let reference = ctx(&schema, &parts, None);
        let keyed = ctx(&schema, &parts, Some(Limits::DEFAULT));
        for sql in [
            // A limit on the aggregate itself (which groups is not fixed: so only counted).
            "SELECT count(*) FROM (SELECT b FROM r GROUP BY b LIMIT 2)",
            "SELECT a, b, count(*) FROM r GROUP BY GROUPING SETS ((a), (b), (a, b))",
            "SELECT a, b, count(*) FROM r GROUP BY ROLLUP (a, b)",
            "SELECT a, array_agg(x ORDER BY x) FROM r GROUP BY a",
            "SELECT a, first_value(x ORDER BY c) FROM r GROUP BY a",
            "SELECT a, max(x) AS m FROM r GROUP BY a ORDER BY m DESC, a LIMIT 2",
            "SELECT a, sum(DISTINCT c) FROM r GROUP BY a",
            "SELECT a, count(DISTINCT b) FILTER (WHERE x > 3) FROM r GROUP BY a",
            "SELECT a, sum(c), count(DISTINCT b) FROM r GROUP BY a",
            "SELECT DISTINCT b FROM r",
            "SELECT a, median(x) FROM r GROUP BY a",
            "SELECT a, bit_and(c) FROM r GROUP BY a",
            "SELECT a, avg(c) FROM r GROUP BY a",
        ] {
            // Sorted, since some have no ORDER BY.
            let sorted = |s: String| {
                let mut lines: Vec<String> = s.lines().map(str::to_owned).collect();
                lines.sort();
                lines
            };
            let (expected, _) = answer(&reference, sql).await;
            let (got, plan) = answer(&keyed, sql).await;
            assert!(sorted(got) == sorted(expected), "{sql}\n{plan}");
        }
    }
}

#[cfg(test)]
mod paths {
    //! Cases for the counting, dense and mixed-radix paths at their edges (each against
    //! DataFusion's own plan, with the keyed operator asserted in the plan).
    use super::tests::{run, session};
    use super::*;
    use arrow_array::{Int8Array, Int64Array, StringViewArray, UInt16Array, UInt64Array};
    use arrow_buffer::{NullBuffer, ScalarBuffer};
    use arrow_schema::{Field, Schema};
    use datafusion::datasource::MemTable;

    async fn compare(
        schema: SchemaRef,
        parts: Vec<Vec<RecordBatch>>,
        sqls: &[&str],
        limits: &[Limits],
    ) {
        for target in [2, 3] {
            let table = MemTable::try_new(Arc::clone(&schema), parts.clone()).unwrap();
            let reference = session("r", table, None, target, 8192);
            for sql in sqls {
                let (expected, _, _) = run(&reference, sql).await;
                for &l in limits {
                    let table = MemTable::try_new(Arc::clone(&schema), parts.clone()).unwrap();
                    let keyed = session("r", table, Some(l), target, 8192);
                    let (got, plan, handed) = run(&keyed, sql).await;
                    assert!(plan.contains("KeyedPartial"), "{plan}");
                    assert!(
                        got == expected,
                        "{sql} {l:?} handed {handed}\nexpected\n{expected}\ngot\n{got}\n{plan}"
                    );
                }
            }
        }
    }

    const WIDE: Limits = Limits {
        max_groups: 1 << 22,
        max_value_bytes: 1 << 30,
        min_new_values: 1 << 22,
        rows_per_new_value: 1,
    };

    /// Groups cross LANE_GROUPS mid-stream; null slots hold garbage equal to real keys and
    /// far-away keys.
    #[tokio::test]
    async fn lanes_boundary_and_garbage_under_nulls() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::UInt16, true),
            Field::new("i", DataType::Int8, true),
            Field::new("x", DataType::Int64, true),
        ]));
        let mk = |k: Vec<u16>, kn: Vec<bool>, i: Vec<i8>, inul: Vec<bool>| {
            let n = k.len();
            let k = UInt16Array::new(ScalarBuffer::from(k), Some(NullBuffer::from(kn)));
            let i = Int8Array::new(ScalarBuffer::from(i), Some(NullBuffer::from(inul)));
            let x = Int64Array::from_iter_values((0..n as i64).map(|v| v % 5));
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![Arc::new(k) as ArrayRef, Arc::new(i), Arc::new(x)],
            )
            .unwrap()
        };
        let mut batches = Vec::new();
        for (lo, hi) in [
            (0u16, 250u16),
            (250, 256),
            (256, 257),
            (100, 300),
            (65000, 65535),
        ] {
            let k: Vec<u16> = (lo..hi).chain(lo..hi).collect();
            let valid: Vec<bool> = (0..k.len()).map(|r| r % 3 != 0).collect();
            // garbage under nulls: real keys, and 65535
            let k: Vec<u16> = k
                .iter()
                .enumerate()
                .map(|(r, &v)| {
                    if r % 3 == 0 {
                        if r % 2 == 0 { 65535 } else { 5 }
                    } else {
                        v
                    }
                })
                .collect();
            let i: Vec<i8> = (0..k.len())
                .map(|r| if r % 4 == 0 { -128 } else { (r % 7) as i8 - 3 })
                .collect();
            let ivalid: Vec<bool> = (0..k.len()).map(|r| r % 4 != 0 && r % 11 != 0).collect();
            batches.push(mk(k, valid, i, ivalid));
        }
        let parts = vec![batches.clone(), batches.iter().rev().cloned().collect()];
        let sqls = [
            "SELECT k, count(*) FROM r GROUP BY k ORDER BY k",
            "SELECT k, count(*), sum(x), count(1) FILTER (WHERE x > 2) FROM r GROUP BY k ORDER BY k",
            "SELECT i, count(*), count(i) FROM r GROUP BY i ORDER BY i",
            "SELECT k, i, count(*), count(NULL), sum(x) FROM r GROUP BY k, i ORDER BY k, i",
        ];
        let small = Limits {
            max_groups: 255,
            max_value_bytes: 1 << 20,
            min_new_values: 300,
            rows_per_new_value: 1,
        };
        let small2 = Limits {
            max_groups: 1000,
            max_value_bytes: 1 << 20,
            min_new_values: 10,
            rows_per_new_value: 100,
        };
        compare(
            schema,
            parts,
            &sqls,
            &[Limits::DEFAULT, WIDE, small, small2],
        )
        .await;
    }

    /// Combos laid out again, then given up, then a batch handed over.
    #[tokio::test]
    async fn combos_give_up_then_hand_over() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::UInt64, true),
            Field::new("b", DataType::Int64, true),
            Field::new("s", DataType::Utf8View, true),
            Field::new("x", DataType::Int64, true),
        ]));
        let mk = |rows: u64, av: u64, bv: u64, shift: u64| {
            let a = UInt64Array::from_iter(
                (0..rows).map(|r| (r % 13 != 1).then_some(u64::MAX - (r * 7 + shift) % av)),
            );
            let b = Int64Array::from_iter(
                (0..rows).map(|r| (r % 17 != 2).then_some(-(((r * 3 + shift) % bv) as i64))),
            );
            let s = StringViewArray::from_iter(
                (0..rows).map(|r| (r % 5 != 0).then(|| format!("s{}", r % 3))),
            );
            let x = Int64Array::from_iter((0..rows).map(|r| (r % 4 != 0).then_some(r as i64)));
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(a) as ArrayRef,
                    Arc::new(b),
                    Arc::new(s),
                    Arc::new(x),
                ],
            )
            .unwrap()
        };
        let parts = vec![
            vec![
                mk(100, 3, 2, 0),
                mk(1000, 30, 20, 1),
                mk(5000, 300, 200, 2),
                mk(5000, 300, 300, 3),
                mk(200, 3, 3, 4),
                mk(50000, 5000, 5000, 5),
            ],
            vec![
                mk(10, 1, 1, 0),
                mk(3000, 256, 256, 0),
                mk(3000, 257, 256, 0),
                mk(100, 2, 2, 9),
            ],
        ];
        let sqls = [
            "SELECT a, b, count(*), sum(x), count(x) FILTER (WHERE x > 10) FROM r GROUP BY a, b ORDER BY a, b",
            "SELECT b, s, a, count(*) FROM r GROUP BY b, s, a ORDER BY b, s, a",
            "SELECT a, b, count(*) FROM r WHERE x IS NOT NULL GROUP BY a, b ORDER BY a, b",
        ];
        let mid = Limits {
            max_groups: 70000,
            max_value_bytes: 1 << 30,
            min_new_values: 400,
            rows_per_new_value: 1,
        };
        let mid2 = Limits {
            max_groups: 20000,
            max_value_bytes: 1 << 30,
            min_new_values: 1 << 20,
            rows_per_new_value: 1,
        };
        compare(schema, parts, &sqls, &[Limits::DEFAULT, WIDE, mid, mid2]).await;
    }
}
