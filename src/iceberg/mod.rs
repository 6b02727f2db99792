//! The Apache Iceberg views of every table: metadata derived from the table's manifest,
//! written next to its data, so that engines that read Iceberg read sluice tables in place.
//! Two views ([`View`]) list the same data files:
//!
//! - **v3** (format version 3, in `metadata/`): timestamps are `timestamptz_ns`, exactly what
//!   the files hold; row lineage (`first-row-id`, `next-row-id`) is given.
//! - **v2** (format version 2, in `metadata-v2/`), for readers that do not know the v3 types
//!   yet (DuckDB 1.4, older JVM engines): timestamps are `timestamptz`, microseconds. The data
//!   files still hold `TIMESTAMP(NANOS)`; a reader converts them to microseconds as it reads
//!   (dropping the last three digits), and the manifests' bounds of those columns are in
//!   microseconds: the lower bound floored, the upper bound rounded up, so that they hold
//!   every value a reader makes of the file's, whether it floors or truncates, and a
//!   reader that compares its microsecond literal with the files' nanoseconds never prunes
//!   a file holding a time in its last, partial microsecond.
//!
//! The manifest ([`crate::table::manifest`]) stays the source of truth; everything here is
//! derived from it and can be written again from it at any time ([`publish`], which
//! publishes both views). Objects of a view, under `tables/{id}/{dir}/` (`dir` is
//! [`View::dir`]):
//!
//! | object | what |
//! |--------|------|
//! | `v{n}.metadata.json` | table metadata number `n` (a counter of publications, not the manifest version) |
//! | `version-hint.text` | the newest `n` (a hint for readers that open a directory; sluice itself lists) |
//! | `snap-{v:020}-{place}.avro` | the manifest list of the snapshot of manifest version `v` |
//! | `{v:020}-{place}-m0.avro` | its one manifest: every file live at version `v` |
//!
//! (`place` tags the database root's location, which the Avro objects name in absolute
//! URIs, and the manifests' layout revision: a moved data directory, or a release that
//! writes manifests differently, gets new ones.) Only names of these shapes are the view's:
//! metadata numbers are canonical decimals below [`MAX_METADATA_NUMBER`]. Any other name in
//! the directory (another program's, a damaged one, a number at or past the limit) is
//! foreign: never taken for the view's metadata and never collected.
//!
//! A manifest entry gives each data file's `record_count`, `value_counts` (every column:
//! the file's row count, nulls included, as the spec counts them), `null_value_counts`
//! (an empty map: sluice does not count nulls, and a missing entry is "unknown" to
//! readers) and the lower and upper bounds of its timestamp columns (maps always present,
//! empty when there are none): readers such as Polars read these maps for every filtered
//! scan and fail on a missing one.
//!
//! Invariants (of each view; the two are published alike from the same manifest state):
//! - **A snapshot per manifest version**, with snapshot id and sequence number `v` (versions
//!   only grow), the same in both views. Its manifest lists exactly the files live at `v`:
//!   those `v` added as `ADDED`, the others as `EXISTING` with the version that added them. A
//!   snapshot's objects depend on the manifest state alone (and the Avro sync marker is
//!   derived from the path), so two nodes that publish the same version write the same
//!   bytes.
//! - **Publication is a conditional create** of `v{n+1}.metadata.json` after reading `v{n}`:
//!   one writer wins each number, a loser reads again. Metadata never goes back to an older
//!   manifest version.
//! - **History is carried only from the metadata of the previous manifest version** (or a
//!   rewrite of the same one). After a gap (a committing node died before publishing), the
//!   history starts again at the current snapshot: a snapshot is listed only if every later
//!   snapshot up to the current one is, so each listed snapshot's successor time is the time
//!   its files stopped being current.
//! - **Expiry agrees with garbage collection**, in both views: a snapshot is dropped once its
//!   successor was committed more than half the grace period ago. One publication judges
//!   both views at the same instant, so the two list the same snapshots. A data file is deleted only
//!   after the collector has seen it unreferenced by the manifest for the whole grace period
//!   ([`crate::table`]'s collection), so every snapshot that lists it has been expired for at
//!   least half the grace period by then (with clocks of the nodes within half the grace
//!   period of each other). Collection publishes both views before it deletes data files
//!   (and deletes none when either fails), so expired snapshots leave the metadata even when
//!   no new version comes; metadata objects that the newest metadata of their view no
//!   longer references are collected after the grace period like any other object.
//! - **The views stand apart**: each is published, loaded and collected on its own, so a
//!   failure of one (storage, a damaged directory, metadata numbers used up) never stops
//!   the other's loads, publications or metadata collection.
//! - **Field ids** are the columns' ids ([`crate::catalog`]; positions from 1 for tables
//!   created before ids), and the schema id is the table's (each change of its columns is a
//!   new one; `last-column-id` is the highest id the table ever gave). Parquet files carry
//!   their columns' ids; the name mapping in the table properties
//!   (`schema.name-mapping.default`) resolves the columns of files written before field ids
//!   (the table's first columns). A file's `value_counts` and bounds name the current
//!   columns it holds, by id.
//! - **Types**: timestamp is `timestamptz_ns` in v3 and `timestamptz` in v2 (see above); int
//!   and uint are `long` (a uint column only ever holds `0..=i64::MAX`: ingest and `INSERT`
//!   refuse larger values, so `long` holds every value exactly, and files written since
//!   store it as a signed INT64, the Parquet type of `long`); interval is `long` nanoseconds;
//!   float `double`; boolean; string; binary; object, array and any are `string` (their JSON
//!   text).

mod avro;

use std::collections::HashSet;
use std::time::Duration;

use futures::TryStreamExt as _;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt as _, PutMode, PutOptions, PutPayload};
use serde_json::{Value, json};

use crate::storage::{Storage, paths};
use crate::table::{Collectable, ManifestObserver, ManifestState, TableError};
use crate::types::{Column, ColumnType};
use avro::Encoder;

/// One of the two Iceberg views of every table (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum View {
    /// Format version 3, nanosecond timestamps: the view of record.
    V3,
    /// Format version 2, microsecond timestamps: for readers without the v3 types.
    V2,
}

impl View {
    /// Both views, in the order they are published.
    pub(crate) const ALL: [View; 2] = [View::V3, View::V2];

    /// The Iceberg format version of the view's metadata.
    pub(crate) fn format_version(self) -> u8 {
        match self {
            View::V3 => 3,
            View::V2 => 2,
        }
    }

    /// The directory of the view's objects under the table's directory.
    pub(crate) fn dir(self) -> &'static str {
        match self {
            View::V3 => "metadata",
            View::V2 => "metadata-v2",
        }
    }
}

/// The table property naming the manifest version a metadata file was derived from.
const MANIFEST_VERSION_PROPERTY: &str = "sluice.manifest-version";

/// The table property naming the [`LAYOUT`] a metadata file's Avro objects were written in.
const LAYOUT_PROPERTY: &str = "sluice.iceberg-layout";

/// The revision of what the manifests hold, raised whenever that changes (2: statistics
/// maps always present, v2 upper time bounds rounded up). Metadata of another layout is
/// published over like metadata of another location, with new Avro objects (the layout is
/// in their place tag): a table upgraded without a new commit gets the new manifests too.
const LAYOUT: &str = "2";

/// The Iceberg type of a column type in `view` (see the module docs for why).
pub(crate) fn iceberg_type(view: View, t: ColumnType) -> &'static str {
    match t {
        ColumnType::Int | ColumnType::UInt | ColumnType::Interval => "long",
        ColumnType::Float => "double",
        ColumnType::Boolean => "boolean",
        ColumnType::String | ColumnType::Object | ColumnType::Array | ColumnType::Any => "string",
        ColumnType::Timestamp => match view {
            View::V3 => "timestamptz_ns",
            View::V2 => "timestamptz",
        },
        ColumnType::Binary => "binary",
    }
}

fn field_doc(view: View, t: ColumnType) -> Option<&'static str> {
    match t {
        ColumnType::Timestamp if view == View::V2 => Some(
            "sluice timestamp: the data files hold nanoseconds; this view reads them as \
             microseconds, the last three digits dropped (the v3 view has them all)",
        ),
        ColumnType::Interval => Some("sluice interval: a duration in nanoseconds"),
        ColumnType::Object => Some("sluice object: JSON text"),
        ColumnType::Array => Some("sluice array: JSON text"),
        ColumnType::Any => Some("sluice any: JSON text"),
        ColumnType::UInt => Some("sluice uint: 0 through 9223372036854775807"),
        _ => None,
    }
}

/// The table's current schema (its schema id, its columns with their ids) in `view`.
fn schema_json(view: View, columns: &[Column], state: &ManifestState) -> Value {
    shape_json(view, columns, &state.column_ids(), state.schema_id)
}

/// Every schema the view lists: the table's earlier shapes the manifest keeps (each under
/// its schema id, as snapshots written under it name it), then the current one. An earlier
/// shape that no longer parses is left out (the current one is checked when the table
/// loads).
fn schemas_json(view: View, columns: &[Column], state: &ManifestState) -> Vec<Value> {
    let mut schemas: Vec<Value> = state
        .past_shapes
        .iter()
        .filter(|p| p.schema_id != state.schema_id)
        .filter_map(|p| {
            let (columns, ids) = p.columns().ok()?;
            Some(shape_json(view, &columns, &ids, p.schema_id))
        })
        .collect();
    schemas.push(schema_json(view, columns, state));
    schemas
}

/// A schema: `columns` with their `ids`, under `schema_id`, in `view`.
fn shape_json(view: View, columns: &[Column], ids: &[i32], schema_id: i32) -> Value {
    let fields: Vec<Value> = columns
        .iter()
        .zip(ids)
        .map(|(c, id)| {
            let mut field = json!({
                "id": id,
                "name": c.name,
                "required": false,
                "type": iceberg_type(view, c.data_type),
            });
            if let Some(doc) = field_doc(view, c.data_type) {
                field["doc"] = json!(doc);
            }
            field
        })
        .collect();
    json!({"type": "struct", "schema-id": schema_id, "fields": fields})
}

/// The name mapping that gives files without field ids their columns' ids: such files hold
/// the table's first columns, with ids = positions from 1 (a first column dropped since is
/// listed too, with its id, which the schema no longer has: its values are never read, and
/// a new column that took its name does not get them). Columns added since are listed by
/// their names where no first column had that name.
fn name_mapping(columns: &[Column], state: &ManifestState) -> String {
    let first: Vec<(i32, String)> = match state.first_columns.is_empty() {
        true => columns
            .iter()
            .enumerate()
            .map(|(i, c)| (crate::catalog::position_id(i), c.name.clone()))
            .collect(),
        false => state
            .first_columns
            .iter()
            .enumerate()
            .map(|(i, name)| (crate::catalog::position_id(i), name.clone()))
            .collect(),
    };
    let mut mapping: Vec<Value> = first
        .iter()
        .map(|(id, name)| json!({"field-id": id, "names": [name]}))
        .collect();
    for (c, id) in columns.iter().zip(state.column_ids()) {
        if !first.iter().any(|(i, name)| *i == id || *name == c.name) {
            mapping.push(json!({"field-id": id, "names": [c.name]}));
        }
    }
    Value::Array(mapping).to_string()
}

/// The metadata directory of table `id`'s `view`.
fn metadata_dir(view: View, id: &str) -> String {
    format!("{}/{}", paths::table(id), view.dir())
}

fn metadata_file(view: View, id: &str, n: u64) -> String {
    format!("{}/v{n}.metadata.json", metadata_dir(view, id))
}

fn version_hint(view: View, id: &str) -> String {
    format!("{}/version-hint.text", metadata_dir(view, id))
}

/// The Avro objects of a snapshot are named by the version and by `place`
/// ([`place_tag`]): they hold absolute locations, so a table whose root moved gets new
/// ones instead of reusing the old.
fn manifest_list(view: View, id: &str, version: u64, place: &str) -> String {
    format!("{}/snap-{version:020}-{place}.avro", metadata_dir(view, id))
}

fn manifest(view: View, id: &str, version: u64, place: &str) -> String {
    format!("{}/{version:020}-{place}-m0.avro", metadata_dir(view, id))
}

/// 16 bytes from `text` by two FNV-1a passes: stable across builds and platforms (unlike
/// std's hasher), for names and markers that must come out the same on every node.
fn stable_hash_128(text: &str) -> [u8; 16] {
    let fnv = |basis: u64| {
        text.bytes().fold(basis, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&fnv(0xcbf2_9ce4_8422_2325).to_le_bytes());
    out[8..].copy_from_slice(&fnv(0x6c62_272e_07bb_0142).to_le_bytes());
    out
}

/// A short tag of the location the Avro objects name and of their [`LAYOUT`].
fn place_tag(location: &str) -> String {
    let hash = stable_hash_128(&format!("{location}#{LAYOUT}"));
    format!(
        "{:02x}{:02x}{:02x}{:02x}",
        hash[0], hash[1], hash[2], hash[3]
    )
}

/// The version and place tag of a manifest list's object name.
fn manifest_list_name(name: &str) -> Option<(u64, &str)> {
    let (version, place) = name
        .strip_prefix("snap-")?
        .strip_suffix(".avro")?
        .split_once('-')?;
    Some((version.parse().ok()?, place))
}

/// The number `n` of a metadata object's name `v{n}.metadata.json`.
/// Only names this module writes count: canonical digits (no sign, no leading zero), and
/// numbers below [`MAX_METADATA_NUMBER`] (this module never writes one at or past it, so
/// such a name is foreign, and taking it for the newest would leave no number to follow).
fn metadata_number(name: &str) -> Option<u64> {
    let digits = name.strip_prefix('v')?.strip_suffix(".metadata.json")?;
    let n: u64 = digits.parse().ok()?;
    (n < MAX_METADATA_NUMBER && n.to_string() == digits).then_some(n)
}

/// The bound of metadata numbers, never reached (at a publication a second, over a hundred
/// years).
const MAX_METADATA_NUMBER: u64 = 1 << 32;

/// The version of a snapshot's Avro object name (`snap-{v}-{place}.avro` or
/// `{v}-{place}-m0.avro`).
fn avro_version(name: &str) -> Option<u64> {
    let rest = name.strip_suffix(".avro")?;
    let digits = match rest.strip_prefix("snap-") {
        Some(list) => list.split_once('-')?.0,
        None => rest.strip_suffix("-m0")?.split_once('-')?.0,
    };
    digits.parse().ok()
}

/// The newest published metadata of a table's view.
#[derive(Debug, Clone)]
pub(crate) struct Published {
    /// The view it is of.
    pub view: View,
    /// Its number.
    pub number: u64,
    /// Its URI, as readers name it.
    pub location: String,
    /// The table metadata.
    pub metadata: Value,
}

impl Published {
    /// The manifest version it was derived from.
    fn manifest_version(&self) -> Option<u64> {
        self.metadata["properties"][MANIFEST_VERSION_PROPERTY]
            .as_str()?
            .parse()
            .ok()
    }

    /// The snapshots it lists, in order.
    fn snapshots(&self) -> Vec<Value> {
        self.metadata["snapshots"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The objects (paths relative to the database root) this metadata needs: itself, the
    /// hint, and every listed snapshot's manifest list and manifest.
    pub(crate) fn referenced(&self, id: &str) -> HashSet<String> {
        let view = self.view;
        let mut keep =
            HashSet::from([metadata_file(view, id, self.number), version_hint(view, id)]);
        for s in self.snapshots() {
            let name = s["manifest-list"]
                .as_str()
                .and_then(|uri| uri.rsplit('/').next());
            if let Some((v, place)) = name.and_then(manifest_list_name) {
                keep.insert(manifest_list(view, id, v, place));
                keep.insert(manifest(view, id, v, place));
            }
        }
        keep
    }
}

/// What publishing both views of a table gave: each view's newest metadata, or why that
/// view failed (the other stands on its own).
#[derive(Debug)]
pub(crate) struct Views {
    pub v3: Result<Published, TableError>,
    pub v2: Result<Published, TableError>,
}

impl Views {
    /// The outcome for `view`.
    pub(crate) fn get(&self, view: View) -> Result<&Published, &TableError> {
        match view {
            View::V3 => self.v3.as_ref(),
            View::V2 => self.v2.as_ref(),
        }
    }
}

fn storage_error(e: object_store::Error) -> TableError {
    TableError::Storage(e)
}

/// Reads the newest metadata of table `id`'s `view`, if any was published.
pub(crate) async fn latest(
    storage: &Storage,
    view: View,
    id: &str,
) -> Result<Option<Published>, TableError> {
    const ATTEMPTS: usize = 5;
    let store = storage.store();
    for _ in 0..ATTEMPTS {
        let listed: Vec<_> = store
            .list(Some(&Path::from(metadata_dir(view, id))))
            .try_collect()
            .await
            .map_err(storage_error)?;
        let Some(number) = listed
            .iter()
            .filter_map(|m| m.location.filename().and_then(metadata_number))
            .max()
        else {
            return Ok(None);
        };
        let path = metadata_file(view, id, number);
        let bytes = match store.get(&Path::from(path.as_str())).await {
            Ok(r) => r.bytes().await.map_err(storage_error)?,
            // Collected since the listing (a newer one exists): list again.
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(storage_error(e)),
        };
        // Derived data: an unreadable newest metadata (a torn write without fsync, another
        // writer) is written over by the next publication rather than stopping every load
        // and collection of the table. Its `Null` carries no history and no version.
        let metadata: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            tracing::warn!(%path, error = %e, "unreadable Iceberg metadata; publishing anew");
            Value::Null
        });
        return Ok(Some(Published {
            view,
            number,
            location: storage.location_of(&path),
            metadata,
        }));
    }
    Err(TableError::Conflict(format!(
        "the Iceberg metadata of table {id} kept changing under {ATTEMPTS} readings; retry"
    )))
}

/// Makes the newest metadata of both views of table `id` describe `state`, with expired
/// snapshots dropped (`grace` is the garbage-collection grace period), and returns each
/// view's outcome ([`publish_view`]). Both views judge expiry at one instant, so from the
/// same history they keep the same snapshots. A failure of one view is that view's alone
/// (garbage collection deletes no data file unless both succeeded).
pub(crate) async fn publish(
    storage: &Storage,
    id: &str,
    state: &ManifestState,
    grace: Duration,
) -> Views {
    let now = crate::table::manifest::now_ms();
    let (v3, v2) = tokio::join!(
        publish_at(storage, View::V3, id, state, grace, now),
        publish_at(storage, View::V2, id, state, grace, now),
    );
    Views { v3, v2 }
}

/// Makes the newest metadata of table `id`'s `view` describe `state` (see [`publish`]) and
/// returns it. Writes nothing when the newest metadata is already that (or is newer).
/// Metadata that names another location (the data directory moved) is replaced, with only
/// the current snapshot.
pub(crate) async fn publish_view(
    storage: &Storage,
    view: View,
    id: &str,
    state: &ManifestState,
    grace: Duration,
) -> Result<Published, TableError> {
    publish_at(
        storage,
        view,
        id,
        state,
        grace,
        crate::table::manifest::now_ms(),
    )
    .await
}

/// [`publish_view`] judging expiry at `now_ms`. It runs on a task of its own: a panic in
/// this derived, best-effort work must not take its caller down (a flush, a compaction, a
/// collection pass, a catalog load), nor the other view's publication.
async fn publish_at(
    storage: &Storage,
    view: View,
    id: &str,
    state: &ManifestState,
    grace: Duration,
    now_ms: u64,
) -> Result<Published, TableError> {
    let (storage, id, state) = (storage.clone(), id.to_owned(), state.clone());
    tokio::spawn(async move { publish_here(&storage, view, &id, &state, grace, now_ms).await })
        .await
        .map_err(|e| TableError::Task(format!("publishing the Iceberg {view:?} view: {e}")))?
}

async fn publish_here(
    storage: &Storage,
    view: View,
    id: &str,
    state: &ManifestState,
    grace: Duration,
    now: u64,
) -> Result<Published, TableError> {
    const ATTEMPTS: usize = 8;
    let columns = state.table_columns()?;
    let location = storage.location_of(&paths::table(id));
    let mut wrote_snapshot = false;
    for _ in 0..ATTEMPTS {
        let current = latest(storage, view, id).await?;
        if let Some(c) = &current
            && let Some(from) = c.manifest_version()
            && from > state.version
        {
            // Another node published a newer version: never go back. Unless the manifest
            // has no such version (metadata restored or copied from elsewhere): then the
            // metadata is wrong and is written over, or its snapshots would never expire.
            let version =
                crate::storage::versioned::VersionLog::new(paths::table_manifest(id)).path(from);
            match storage.store().head(&version).await {
                Ok(_) => return Ok(c.clone()),
                Err(object_store::Error::NotFound { .. }) => {
                    tracing::warn!(table = %id, from, "Iceberg metadata names a manifest version that does not exist; publishing anew");
                }
                Err(e) => return Err(storage_error(e)),
            }
        }
        let same_place = current.as_ref().is_some_and(|c| {
            c.metadata["location"].as_str() == Some(location.as_str())
                && c.metadata["properties"][LAYOUT_PROPERTY].as_str() == Some(LAYOUT)
                && c.manifest_version() <= Some(state.version)
        });
        let carried: Vec<Value> = match &current {
            Some(c) if same_place => {
                let from = c.manifest_version();
                let listed = c.snapshots();
                let count = listed.len();
                let expired = expire(listed, now, grace);
                if from == Some(state.version) && expired.len() == count {
                    return Ok(c.clone());
                }
                match from {
                    Some(v) if v == state.version || v + 1 == state.version => expired,
                    _ => Vec::new(),
                }
            }
            _ => Vec::new(),
        };
        let carried_current = carried
            .last()
            .and_then(|s| s["snapshot-id"].as_u64())
            .is_some_and(|s| s == state.version);
        let mut snapshots = carried;
        if state.version > 0 && !carried_current {
            if !wrote_snapshot {
                write_snapshot_objects(storage, view, id, &columns, state).await?;
                wrote_snapshot = true;
            }
            let parent = snapshots.last().and_then(|s| s["snapshot-id"].as_u64());
            let mut snapshot = snapshot_json(storage, view, id, state, parent, now);
            // Snapshot times never go back (readers refuse a snapshot log out of order), even
            // when the committing nodes' clocks disagree.
            if let Some(previous) = snapshots.last().and_then(|s| s["timestamp-ms"].as_u64())
                && snapshot["timestamp-ms"].as_u64() < Some(previous)
            {
                snapshot["timestamp-ms"] = json!(previous);
            }
            snapshots.push(snapshot);
            let over = snapshots.len().saturating_sub(MAX_SNAPSHOTS);
            snapshots.drain(..over);
        }
        let number = match &current {
            None => 1,
            Some(c) => c.number + 1,
        };
        if number >= MAX_METADATA_NUMBER {
            // Only a foreign name at the last number gets here: the view cannot go on (a
            // number past it would not be taken for the newest), the other view can.
            return Err(TableError::CorruptManifest {
                path: metadata_file(view, id, number - 1),
                reason: "the Iceberg metadata numbers of this view are used up".into(),
            });
        }
        let metadata = metadata_json(view, &location, id, &columns, state, &snapshots, now);
        let path = metadata_file(view, id, number);
        let body = serde_json::to_vec_pretty(&metadata)
            .map_err(|e| TableError::Encoding(e.to_string()))?;
        match put_new(storage.store().as_ref(), &path, body).await? {
            true => {
                // A hint for readers that open the directory (best effort; sluice lists).
                let _ = storage
                    .store()
                    .put(
                        &Path::from(version_hint(view, id)),
                        PutPayload::from(number.to_string()),
                    )
                    .await;
                return Ok(Published {
                    view,
                    number,
                    location: storage.location_of(&path),
                    metadata,
                });
            }
            // Another writer took this number: read what won and decide again.
            false => continue,
        }
    }
    Err(TableError::Conflict(format!(
        "the Iceberg metadata of table {id} kept changing under {ATTEMPTS} attempts; retry"
    )))
}

/// At most this many snapshots are listed (the newest): a busy table commits a version per
/// flush, and every metadata file lists its snapshots. Dropping a snapshot early is always
/// safe (garbage collection only relies on snapshots being dropped late enough).
const MAX_SNAPSHOTS: usize = 64;

/// The snapshots still inside their retention: the current (last) one, and each whose
/// successor was committed less than half the grace period ago, at most
/// [`MAX_SNAPSHOTS`]. The result is the suffix after the last expired snapshot, so it stays
/// a run of consecutive versions.
fn expire(snapshots: Vec<Value>, now_ms: u64, grace: Duration) -> Vec<Value> {
    let keep_ms = u64::try_from((grace / 2).as_millis()).unwrap_or(u64::MAX);
    let mut first_kept = snapshots.len().saturating_sub(MAX_SNAPSHOTS);
    for (i, pair) in snapshots.windows(2).enumerate() {
        let successor_ms = pair[1]["timestamp-ms"].as_u64().unwrap_or(0);
        if successor_ms.saturating_add(keep_ms) <= now_ms {
            first_kept = first_kept.max(i + 1);
        }
    }
    snapshots.into_iter().skip(first_kept).collect()
}

/// Creates `path` unless it exists: `Ok(false)` if it did (or another writer won).
async fn put_new(store: &dyn ObjectStore, path: &str, body: Vec<u8>) -> Result<bool, TableError> {
    let options = PutOptions::from(PutMode::Create);
    match store
        .put_opts(&Path::from(path), PutPayload::from(body), options)
        .await
    {
        Ok(_) => Ok(true),
        Err(object_store::Error::AlreadyExists { .. })
        | Err(object_store::Error::Precondition { .. }) => Ok(false),
        Err(e) => Err(storage_error(e)),
    }
}

fn snapshot_json(
    storage: &Storage,
    view: View,
    id: &str,
    state: &ManifestState,
    parent: Option<u64>,
    now_ms: u64,
) -> Value {
    let change = &state.last_change;
    let total_rows: u64 = state.files.iter().map(|f| f.rows).sum();
    let operation = match (change.added_files, change.removed_files) {
        (_, 0) => "append",
        (_, _) if change.added_rows == change.removed_rows => "replace",
        _ => "overwrite",
    };
    let timestamp = match change.committed_ms {
        0 => now_ms,
        t => t,
    };
    let mut snapshot = json!({
        "snapshot-id": state.version,
        "sequence-number": state.version,
        "timestamp-ms": timestamp,
        "manifest-list": storage.location_of(&manifest_list(
            view,
            id,
            state.version,
            &place_tag(&storage.location_of(""))
        )),
        "summary": {
            "operation": operation,
            "added-data-files": change.added_files.to_string(),
            "added-records": change.added_rows.to_string(),
            "deleted-data-files": change.removed_files.to_string(),
            "deleted-records": change.removed_rows.to_string(),
            "total-data-files": state.files.len().to_string(),
            "total-records": total_rows.to_string(),
            "total-delete-files": "0",
            "total-position-deletes": "0",
            "total-equality-deletes": "0",
        },
        "schema-id": state.schema_id,
    });
    if view == View::V3 {
        snapshot["first-row-id"] = json!(first_row_id(state));
        snapshot["added-rows"] = json!(change.added_rows);
    }
    if let Some(parent) = parent {
        snapshot["parent-snapshot-id"] = json!(parent);
    }
    snapshot
}

fn metadata_json(
    view: View,
    location: &str,
    id: &str,
    columns: &[Column],
    state: &ManifestState,
    snapshots: &[Value],
    now_ms: u64,
) -> Value {
    let current = snapshots.last().and_then(|s| s["snapshot-id"].as_u64());
    let snapshot_log: Vec<Value> = snapshots
        .iter()
        .map(|s| json!({"snapshot-id": s["snapshot-id"], "timestamp-ms": s["timestamp-ms"]}))
        .collect();
    let mut refs = serde_json::Map::new();
    if let Some(current) = current {
        refs.insert(
            "main".into(),
            json!({"snapshot-id": current, "type": "branch"}),
        );
    }
    let mut metadata = json!({
        "format-version": view.format_version(),
        "table-uuid": table_uuid(view, id),
        "location": location,
        "last-sequence-number": state.version,
        // Never before the newest snapshot (readers refuse that).
        "last-updated-ms": snapshots
            .iter()
            .filter_map(|s| s["timestamp-ms"].as_u64())
            .fold(now_ms, u64::max),
        "last-column-id": state.last_column_id(),
        "current-schema-id": state.schema_id,
        "schemas": schemas_json(view, columns, state),
        "default-spec-id": 0,
        "partition-specs": [{"spec-id": 0, "fields": []}],
        "last-partition-id": 999,
        "default-sort-order-id": 0,
        "sort-orders": [{"order-id": 0, "fields": []}],
        "properties": {
            "schema.name-mapping.default": name_mapping(columns, state),
            "write.format.default": "parquet",
            "sluice.table-id": id,
            MANIFEST_VERSION_PROPERTY: state.version.to_string(),
            LAYOUT_PROPERTY: LAYOUT,
        },
        // -1 for none, as Iceberg's Java library writes it: DuckDB refuses a null here,
        // and other readers take -1 for none.
        "current-snapshot-id": current.map_or(-1, to_i64),
        "refs": refs,
        "snapshots": snapshots,
        "snapshot-log": snapshot_log,
        "metadata-log": [],
        "statistics": [],
        "partition-statistics": [],
    });
    if view == View::V3 {
        metadata["next-row-id"] = json!(state.next_row_id);
    }
    metadata
}

/// The row id of the first row the state's last change added (v3's row lineage).
fn first_row_id(state: &ManifestState) -> u64 {
    state.next_row_id - state.last_change.added_rows.min(state.next_row_id)
}

/// A stable UUID for table `id` in `view`. In v3 the id itself when it is one, else one
/// derived from it; in v2 one derived from the id and the view: the two views are two
/// Iceberg tables whose schemas give one field id two types (`timestamptz_ns`,
/// `timestamptz`), and a reader that caches metadata by table UUID must not take one for
/// the other.
fn table_uuid(view: View, id: &str) -> String {
    if view == View::V3
        && let Ok(u) = uuid::Uuid::try_parse(id)
    {
        return u.hyphenated().to_string();
    }
    let seed = match view {
        View::V3 => id.to_owned(),
        View::V2 => format!("{id}/{}", view.dir()),
    };
    uuid::Builder::from_random_bytes(stable_hash_128(&seed))
        .into_uuid()
        .hyphenated()
        .to_string()
}

/// The Avro writer schema of a manifest entry of `view`: the fields sluice fills (readers
/// resolve by field id; the others are optional and read as null). The two versions differ
/// only in v3's `first_row_id`.
fn manifest_entry_schema(view: View) -> Value {
    let optional_long = |name: &str, id: i32| json!({"name": name, "type": ["null", "long"], "default": null, "field-id": id});
    // An Iceberg map keyed by field id, as Avro writes it: an array of key-value records.
    let id_map = |name: &str, id: i32, key: i32, value: i32, value_type: &str| {
        json!({"name": name, "field-id": id, "default": null, "type": ["null", {
            "type": "array",
            "logicalType": "map",
            "items": {
                "type": "record",
                "name": format!("k{key}_v{value}"),
                "fields": [
                    {"name": "key", "type": "int", "field-id": key},
                    {"name": "value", "type": value_type, "field-id": value},
                ],
            },
        }]})
    };
    let mut data_file = vec![
        json!({"name": "content", "type": "int", "field-id": 134}),
        json!({"name": "file_path", "type": "string", "field-id": 100}),
        json!({"name": "file_format", "type": "string", "field-id": 101}),
        json!({"name": "partition", "field-id": 102,
         "type": {"type": "record", "name": "r102", "fields": []}}),
        json!({"name": "record_count", "type": "long", "field-id": 103}),
        json!({"name": "file_size_in_bytes", "type": "long", "field-id": 104}),
        id_map("value_counts", 109, 119, 120, "long"),
        id_map("null_value_counts", 110, 121, 122, "long"),
        id_map("lower_bounds", 125, 126, 127, "bytes"),
        id_map("upper_bounds", 128, 129, 130, "bytes"),
    ];
    if view == View::V3 {
        data_file.push(optional_long("first_row_id", 142));
    }
    json!({
        "type": "record",
        "name": "manifest_entry",
        "fields": [
            {"name": "status", "type": "int", "field-id": 0},
            optional_long("snapshot_id", 1),
            optional_long("sequence_number", 3),
            optional_long("file_sequence_number", 4),
            {"name": "data_file", "field-id": 2, "type": {
                "type": "record",
                "name": "r2",
                "fields": data_file,
            }},
        ],
    })
}

/// The Avro writer schema of a manifest list entry of `view` (v3 adds `first_row_id`).
fn manifest_list_schema(view: View) -> Value {
    let field = |name: &str, t: &str, id: i32| json!({"name": name, "type": t, "field-id": id});
    let mut fields = vec![
        field("manifest_path", "string", 500),
        field("manifest_length", "long", 501),
        field("partition_spec_id", "int", 502),
        field("content", "int", 517),
        field("sequence_number", "long", 515),
        field("min_sequence_number", "long", 516),
        field("added_snapshot_id", "long", 503),
        field("added_files_count", "int", 504),
        field("existing_files_count", "int", 505),
        field("deleted_files_count", "int", 506),
        field("added_rows_count", "long", 512),
        field("existing_rows_count", "long", 513),
        field("deleted_rows_count", "long", 514),
    ];
    if view == View::V3 {
        fields.push(
            json!({"name": "first_row_id", "type": ["null", "long"], "default": null, "field-id": 520}),
        );
    }
    json!({"type": "record", "name": "manifest_file", "fields": fields})
}

/// The bounds in `view` of a timestamp column whose values lie in `lo..=hi` nanoseconds, as
/// Iceberg's single-value serialization (little-endian `long`). In v2 they are
/// microseconds: the lower floored and the upper rounded up, which holds every value a
/// reader makes of the file's nanoseconds whether it floors or truncates them, and every
/// time in the last, partial microsecond (a filter on microseconds never prunes a file
/// that holds one). No overflow: `i64::MAX` nanoseconds round up to far below `i64::MAX`
/// microseconds.
fn time_bounds(view: View, lo: i64, hi: i64) -> ([u8; 8], [u8; 8]) {
    let (lo, hi) = match view {
        View::V3 => (lo, hi),
        View::V2 => (
            lo.div_euclid(1_000),
            hi.div_euclid(1_000) + i64::from(hi.rem_euclid(1_000) != 0),
        ),
    };
    (lo.to_le_bytes(), hi.to_le_bytes())
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Writes the manifest and the manifest list of the snapshot of `state.version` (unless they
/// exist: their content depends on the state alone).
async fn write_snapshot_objects(
    storage: &Storage,
    view: View,
    id: &str,
    columns: &[Column],
    state: &ManifestState,
) -> Result<(), TableError> {
    let v = state.version;
    let ids = state.column_ids();
    let timestamp_ids: Vec<i32> = columns
        .iter()
        .zip(&ids)
        .filter(|(c, _)| c.data_type == ColumnType::Timestamp)
        .map(|(_, id)| *id)
        .collect();
    let mut records = Vec::with_capacity(state.files.len());
    let (mut added, mut existing) = ((0i64, 0i64), (0i64, 0i64));
    let mut min_sequence = v;
    for f in &state.files {
        let lineage = state.lineage.get(&f.path);
        // Files of a state read from an old checkpoint: added at an unknown version.
        let added_in = lineage.map_or(0, |l| l.version);
        let is_added = added_in == v;
        let counter = if is_added { &mut added } else { &mut existing };
        counter.0 += 1;
        counter.1 += to_i64(f.rows);
        min_sequence = min_sequence.min(added_in);
        let mut lower = Vec::new();
        let mut upper = Vec::new();
        // By id: the file's names are those of the shape it was written in.
        let file_ids = state.file_field_ids(f);
        let column_ids: Vec<i32> = ids
            .iter()
            .copied()
            .filter(|id| file_ids.values().any(|f| f == id))
            .collect();
        for (name, (lo, hi)) in &f.time_ranges {
            if let Some(&field) = file_ids.get(name.as_str())
                && timestamp_ids.contains(&field)
            {
                let (lo, hi) = time_bounds(view, *lo, *hi);
                lower.push((field, lo));
                upper.push((field, hi));
            }
        }
        // Every map present (empty when there is nothing to say): readers of filtered
        // scans (Polars) look entries up in each and fail on a missing map.
        let bound = |e: &mut Encoder, items: &[(i32, [u8; 8])]| {
            e.optional(Some(items), |e, items| {
                e.array(items, |e, (key, value)| {
                    e.long(i64::from(*key)).bytes(value);
                });
            });
        };
        let mut e = Encoder::default();
        e.long(if is_added { 1 } else { 0 })
            // snapshot_id, sequence_number, file_sequence_number.
            .optional_long(Some(to_i64(if added_in == 0 { v } else { added_in })))
            .optional_long(Some(to_i64(added_in)))
            .optional_long(Some(to_i64(added_in)))
            // data_file: content 0 (data), path, format, the empty partition.
            .long(0)
            .string(&storage.location_of(&f.path))
            .string("PARQUET")
            .long(to_i64(f.rows))
            .long(to_i64(f.bytes))
            // value_counts: every column holds a value (or a null) per row.
            .optional(Some(&column_ids), |e, ids| {
                e.array(ids, |e, id| {
                    e.long(i64::from(*id)).long(to_i64(f.rows));
                });
            })
            // null_value_counts: not counted, so no entry (unknown).
            .optional(Some(&[] as &[i32]), |e, ids| {
                e.array(ids, |_, _| {});
            });
        bound(&mut e, &lower);
        bound(&mut e, &upper);
        if view == View::V3 {
            e.optional_long(lineage.map(|l| to_i64(l.first_row_id)));
        }
        records.push(e.into_bytes());
    }
    let schema = schema_json(view, columns, state).to_string();
    let place = place_tag(&storage.location_of(""));
    let manifest_path = manifest(view, id, v, &place);
    let manifest_bytes = avro::container(
        &manifest_entry_schema(view),
        &[
            ("schema", schema),
            ("schema-id", state.schema_id.to_string()),
            ("partition-spec", "[]".into()),
            ("partition-spec-id", "0".into()),
            ("format-version", view.format_version().to_string()),
            ("content", "data".into()),
        ],
        &records,
        &manifest_path,
    );
    let manifest_length = to_i64(manifest_bytes.len() as u64);
    put_new(storage.store().as_ref(), &manifest_path, manifest_bytes).await?;

    let mut entry = Encoder::default();
    entry
        .string(&storage.location_of(&manifest_path))
        .long(manifest_length)
        .long(0)
        .long(0)
        .long(to_i64(v))
        .long(to_i64(min_sequence))
        .long(to_i64(v))
        .long(added.0)
        .long(existing.0)
        .long(0)
        .long(added.1)
        .long(existing.1)
        .long(0);
    let list_path = manifest_list(view, id, v, &place);
    let mut list_metadata = vec![
        ("snapshot-id", v.to_string()),
        ("sequence-number", v.to_string()),
        ("format-version", view.format_version().to_string()),
    ];
    if view == View::V3 {
        entry.optional_long(None);
        list_metadata.push(("first-row-id", first_row_id(state).to_string()));
    }
    let list_bytes = avro::container(
        &manifest_list_schema(view),
        &list_metadata,
        &[entry.into_bytes()],
        &list_path,
    );
    put_new(storage.store().as_ref(), &list_path, list_bytes).await?;
    Ok(())
}

/// The objects under the metadata directory of table `id`'s view that `latest` is of, with
/// their sizes, for garbage collection: everything but what `latest` references is a
/// candidate.
pub(crate) async fn collectable(
    storage: &Storage,
    id: &str,
    latest: &Published,
) -> Result<Vec<(String, u64)>, TableError> {
    let view = latest.view;
    let keep = latest.referenced(id);
    // The hint is written after each publication without a condition, so racing publishers
    // can leave it naming an older number: set it right before that one can be collected
    // (collection runs several times per grace period).
    let hint = Path::from(version_hint(view, id));
    let hinted = match storage.store().get(&hint).await {
        Ok(r) => r.bytes().await.ok(),
        Err(_) => None,
    };
    let wanted = latest.number.to_string();
    if hinted.as_deref() != Some(wanted.as_bytes()) {
        storage
            .store()
            .put(&hint, PutPayload::from(wanted))
            .await
            .map_err(storage_error)?;
    }
    let listed: Vec<_> = storage
        .store()
        .list(Some(&Path::from(metadata_dir(view, id))))
        .try_collect()
        .await
        .map_err(storage_error)?;
    // A snapshot's Avro objects at or above the oldest listed snapshot may be named by a
    // publication under way (one that found them written by an earlier attempt): only those
    // below it are never named again.
    let oldest_listed = latest
        .snapshots()
        .iter()
        .filter_map(|s| s["snapshot-id"].as_u64())
        .min()
        .or(latest.manifest_version())
        .unwrap_or(0);
    Ok(listed
        .into_iter()
        .filter(|m| !keep.contains(m.location.as_ref()))
        .filter(|m| {
            let Some(name) = m.location.filename() else {
                return false;
            };
            if let Some(n) = metadata_number(name) {
                // Never a newer publication than the one read (written since the reading).
                n < latest.number
            } else if let Some(v) = avro_version(name) {
                v < oldest_listed
            } else {
                // Not ours (the hint is kept above): left alone.
                false
            }
        })
        .map(|m| (m.location.to_string(), m.size))
        .collect())
}

/// Both views of every table, kept up to date as an observer of their manifests.
#[derive(Debug, Clone)]
pub(crate) struct IcebergViews {
    storage: Storage,
    /// Garbage collection's grace period: snapshots expire past it.
    grace: Duration,
}

impl IcebergViews {
    pub(crate) fn new(storage: Storage, grace: Duration) -> Self {
        IcebergViews { storage, grace }
    }

    /// Table `id`'s `view` made to describe `state` ([`publish_view`]).
    pub(crate) async fn view(
        &self,
        view: View,
        id: &str,
        state: &ManifestState,
    ) -> Result<Published, TableError> {
        publish_view(&self.storage, view, id, state, self.grace).await
    }
}

#[async_trait::async_trait]
impl ManifestObserver for IcebergViews {
    async fn installed(&self, id: &str, state: &ManifestState) {
        let views = publish(&self.storage, id, state, self.grace).await;
        for view in View::ALL {
            if let Err(e) = views.get(view) {
                tracing::debug!(table = %id, ?view, error = %e, "publishing the Iceberg view failed");
            }
        }
    }

    /// Each view's own objects are collected whenever that view was published (one view's
    /// trouble does not stop the other's collection); the state counts as shown whole only
    /// when both were.
    async fn collectable(
        &self,
        id: &str,
        state: &ManifestState,
    ) -> Result<Collectable, TableError> {
        let published = publish(&self.storage, id, state, self.grace).await;
        let mut shown = Collectable {
            objects: Vec::new(),
            complete: true,
        };
        for view in View::ALL {
            match published.get(view) {
                Ok(view) => shown
                    .objects
                    .extend(collectable(&self.storage, id, view).await?),
                Err(e) => {
                    shown.complete = false;
                    tracing::warn!(table = %id, ?view, error = %e, "the Iceberg view could not be published; no data file of the table is collected until it is");
                }
            }
        }
        Ok(shown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(id: u64, ts: u64) -> Value {
        json!({"snapshot-id": id, "timestamp-ms": ts})
    }

    #[test]
    fn a_snapshot_expires_half_a_grace_period_after_its_successor() {
        let grace = Duration::from_secs(10);
        let list = vec![snapshot(1, 0), snapshot(2, 1_000), snapshot(3, 9_000)];
        let ids = |v: Vec<Value>| -> Vec<u64> {
            v.iter().filter_map(|s| s["snapshot-id"].as_u64()).collect()
        };
        // Snapshot 1 was superseded at 1 s: kept until 6 s.
        assert_eq!(ids(expire(list.clone(), 5_999, grace)), [1, 2, 3]);
        assert_eq!(ids(expire(list.clone(), 6_000, grace)), [2, 3]);
        // Snapshot 2 was superseded at 9 s: kept until 14 s; the current one always.
        assert_eq!(ids(expire(list.clone(), 14_000, grace)), [3]);
        assert_eq!(ids(expire(list, u64::MAX, grace)), [3]);
        // However recent, no more than the newest MAX_SNAPSHOTS.
        let many: Vec<Value> = (1..=100).map(|v| snapshot(v, 1_000)).collect();
        let kept = ids(expire(many, 0, grace));
        assert_eq!(kept.len(), MAX_SNAPSHOTS);
        assert_eq!(kept.last(), Some(&100));
    }

    #[test]
    fn manifest_list_names_give_back_version_and_place() {
        let place = place_tag("file:///data/objects");
        assert_eq!(place.len(), 8);
        assert_ne!(place, place_tag("file:///moved/objects"));
        let path = manifest_list(View::V3, "t", 7, &place);
        let name = path.rsplit('/').next().unwrap();
        assert_eq!(manifest_list_name(name), Some((7, place.as_str())));
        assert_eq!(manifest_list_name("v3.metadata.json"), None);
    }

    #[test]
    fn metadata_numbers_come_only_from_metadata_names() {
        assert_eq!(metadata_number("v12.metadata.json"), Some(12));
        assert_eq!(metadata_number("v.metadata.json"), None);
        assert_eq!(metadata_number("snap-00000000000000000001.avro"), None);
        assert_eq!(metadata_number("version-hint.text"), None);
        // Only canonical names this module writes: a stray name is not the newest.
        assert_eq!(metadata_number("v+99.metadata.json"), None);
        assert_eq!(metadata_number("v007.metadata.json"), None);
        assert_eq!(metadata_number("v0.metadata.json"), Some(0));
        assert_eq!(
            metadata_number(&format!("v{}.metadata.json", u64::MAX)),
            None
        );
        // Numbers at or past the bound are foreign: none could be followed.
        assert_eq!(
            metadata_number(&format!("v{}.metadata.json", MAX_METADATA_NUMBER - 1)),
            Some(MAX_METADATA_NUMBER - 1)
        );
        assert_eq!(
            metadata_number(&format!("v{}.metadata.json", MAX_METADATA_NUMBER)),
            None
        );
        assert_eq!(
            avro_version("snap-00000000000000000007-0a1b2c3d.avro"),
            Some(7)
        );
        assert_eq!(
            avro_version("00000000000000000007-0a1b2c3d-m0.avro"),
            Some(7)
        );
        assert_eq!(avro_version("v7.metadata.json"), None);
    }

    #[test]
    fn v2_time_bounds_hold_every_microsecond_a_reader_makes() {
        let bounds = |view, lo, hi| {
            let (lo, hi) = time_bounds(view, lo, hi);
            (i64::from_le_bytes(lo), i64::from_le_bytes(hi))
        };
        assert_eq!(bounds(View::V3, -1_001, 1_999), (-1_001, 1_999));
        // Whether a reader truncates (-1 ns to 0 µs) or floors (to -1 µs), its value lies
        // within the bounds.
        assert_eq!(bounds(View::V2, -1, -1), (-1, 0));
        assert_eq!(bounds(View::V2, -1_001, -1_001), (-2, -1));
        // The upper bound rounds up: a time in a partial microsecond is below it.
        assert_eq!(bounds(View::V2, -1_001, 1_999), (-2, 2));
        assert_eq!(bounds(View::V2, 1_000, 1_001), (1, 2));
        assert_eq!(bounds(View::V2, 1_000, 2_000), (1, 2));
        assert_eq!(
            bounds(View::V2, i64::MIN, i64::MAX),
            (i64::MIN.div_euclid(1_000), i64::MAX / 1_000 + 1)
        );
    }

    #[test]
    fn table_uuids_are_stable() {
        assert_eq!(table_uuid(View::V3, "abc"), table_uuid(View::V3, "abc"));
        assert_ne!(table_uuid(View::V3, "abc"), table_uuid(View::V3, "abd"));
        assert!(uuid::Uuid::try_parse(&table_uuid(View::V3, "abc")).is_ok());
        assert!(uuid::Uuid::try_parse(&table_uuid(View::V2, "abc")).is_ok());
        let id = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            table_uuid(View::V3, id),
            "01234567-89ab-cdef-0123-456789abcdef"
        );
        // Each view is a table of its own.
        assert_ne!(table_uuid(View::V2, id), table_uuid(View::V3, id));
        assert_eq!(table_uuid(View::V2, id), table_uuid(View::V2, id));
    }
}
