//! Where everything lives in the object store: the one place that names object paths.
//!
//! Every path is relative to the database root (the local `objects/` directory, or the S3
//! prefix):
//!
//! | path | what | written by |
//! |------|------|------------|
//! | `catalog/{v:020}.json`, `.checkpoint.json`, `.floor` | catalog versions | [`crate::catalog`] through [`super::versioned`] |
//! | `nodes/{id}/epochs/{e:020}.json` | a node id's epoch claims | [`crate::node`] through [`super::versioned`] |
//! | `nodes/{id}/heartbeat.json` | the running epoch's heartbeat | [`crate::node`] |
//! | `nodes/{id}/wal/{lsn:020}.wal` | groups of node `id`'s commit log, and fences (durability `object-store`) | `log::remote` |
//! | `tables/{id}/_log/{v:020}.json`, … | a table's manifest versions | `table::manifest` through [`super::versioned`] |
//! | `tables/{id}/data/{uuid}.parquet` | a table's data files | [`crate::table`] (flush, compaction) |
//! | `tables/{id}/metadata/…`, `tables/{id}/metadata-v2/…` | the table's Iceberg views, format versions 3 and 2 (metadata JSON, Avro manifests) | [`crate::iceberg`] |
//! | `streams/{node}/data/{lsn:020}-{tag}.bin` | sealed stream records | `stream::cold` (checkpoint) |
//! | `streams/{node}/snapshots/{lsn:020}.json` | every stream's state at `lsn` | `stream::cold` (checkpoint) |
//! | `stream-names/{sha256(name)}/{v:020}.json`, `.floor` | which node id owns a stream name (durability `object-store`) | `db::names` through [`super::versioned`] |
//! | `subscriptions/{node}/subs/{sha256(id)}.json` | one of node `node`'s subscriptions | [`crate::subscriptions`] |
//! | `subscriptions/{node}/watermarks.json` | how far node `node`'s subscriptions have seen each engine's changes | [`crate::subscriptions`] |
//! | `subscriptions/{node}/signing-key.json` | the key node `node`'s webhooks are signed with | [`crate::subscriptions`] |
//! | `subscriptions/{node}.json` | the earlier layout of a node's subscriptions, read once and moved | [`crate::subscriptions`] |
//!
//! Ids and node names are checked before they reach a path (table ids by the table module,
//! node ids by [`crate::node`]): none holds a `/`.

/// The catalog's versions.
pub(crate) const CATALOG: &str = "catalog";

/// Every table's directory.
pub(crate) const TABLES: &str = "tables";

/// The epoch claims of node `id`.
pub(crate) fn node_epochs(id: &str) -> String {
    format!("nodes/{id}/epochs")
}

/// The heartbeat of node `id`.
pub(crate) fn node_heartbeat(id: &str) -> String {
    format!("nodes/{id}/heartbeat.json")
}

/// The commit log of node `id` in the object store (`log::remote`).
pub(crate) fn node_wal(id: &str) -> String {
    format!("nodes/{id}/wal")
}

/// Everything of table `id`.
pub(crate) fn table(id: &str) -> String {
    format!("{TABLES}/{id}")
}

/// Table `id`'s manifest versions.
pub(crate) fn table_manifest(id: &str) -> String {
    format!("{TABLES}/{id}/_log")
}

/// Table `id`'s data files.
pub(crate) fn table_data(id: &str) -> String {
    format!("{TABLES}/{id}/data")
}

/// A new, unique data file of table `id`.
pub(crate) fn new_table_data_file(id: &str) -> String {
    format!(
        "{}/{}.parquet",
        table_data(id),
        uuid::Uuid::new_v4().simple()
    )
}

/// The claims of the stream name whose SHA-256 is `hash` (hex).
pub(crate) fn stream_name(hash: &str) -> String {
    format!("stream-names/{hash}")
}

/// Everything of node `node`'s streams.
pub(crate) fn streams(node: &str) -> String {
    format!("streams/{node}")
}

/// The sealed-record objects of node `node`'s streams.
pub(crate) fn stream_data(node: &str) -> String {
    format!("{}/data", streams(node))
}

/// A new, unique sealed-record object whose records end at `lsn` (a checkpoint that only
/// rewrites has the LSN of the last one: the tag keeps them apart).
pub(crate) fn new_stream_data_object(node: &str, lsn: u64) -> String {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    format!("{}/{lsn:020}-{}.bin", stream_data(node), &tag[..8])
}

/// The stream snapshots of node `node`.
pub(crate) fn stream_snapshots(node: &str) -> String {
    format!("{}/snapshots", streams(node))
}

/// The snapshot of node `node`'s streams at `lsn`.
pub(crate) fn stream_snapshot(node: &str, lsn: u64) -> String {
    format!("{}/{lsn:020}.json", stream_snapshots(node))
}

/// The stream checkpoint deltas of node `node`.
pub(crate) fn stream_deltas(node: &str) -> String {
    format!("{}/deltas", streams(node))
}

/// Delta `seq` over node `node`'s snapshot at `base`: the streams that changed since the
/// checkpoint before it.
pub(crate) fn stream_delta(node: &str, base: u64, seq: u64) -> String {
    format!("{}/{base:020}-{seq:010}.json", stream_deltas(node))
}

/// Node `node`'s subscriptions, one object each.
pub(crate) fn subscriptions(node: &str) -> String {
    format!("subscriptions/{node}/subs")
}

/// Node `node`'s subscription of key `key` (a digest of its id: ids are client input).
pub(crate) fn subscription(node: &str, key: &str) -> String {
    format!("{}/{key}.json", subscriptions(node))
}

/// How far node `node`'s subscriptions have seen each stream engine's changes.
pub(crate) fn subscription_watermarks(node: &str) -> String {
    format!("subscriptions/{node}/watermarks.json")
}

/// The key node `node`'s webhooks are signed with.
pub(crate) fn subscription_signing_key(node: &str) -> String {
    format!("subscriptions/{node}/signing-key.json")
}

/// Node `node`'s subscriptions in the earlier layout (one object for all).
pub(crate) fn legacy_subscriptions(node: &str) -> String {
    format!("subscriptions/{node}.json")
}

/// Where the earlier layout's object is moved when some of its subscriptions did not
/// convert (made at `millis`, Unix milliseconds).
pub(crate) fn legacy_subscriptions_unconverted(node: &str, millis: u128) -> String {
    format!("subscriptions/{node}.unconverted-{millis}.json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_follow_the_documented_layout() {
        assert_eq!(table_manifest("t1"), "tables/t1/_log");
        assert!(new_table_data_file("t1").starts_with("tables/t1/data/"));
        assert!(new_table_data_file("t1").ends_with(".parquet"));
        assert_ne!(new_table_data_file("t1"), new_table_data_file("t1"));
        assert_eq!(node_epochs("n"), "nodes/n/epochs");
        assert_eq!(node_heartbeat("n"), "nodes/n/heartbeat.json");
        let object = new_stream_data_object("n", 7);
        assert!(object.starts_with("streams/n/data/00000000000000000007-"));
        assert!(object.ends_with(".bin"));
        assert_eq!(
            stream_snapshot("n", 7),
            "streams/n/snapshots/00000000000000000007.json"
        );
        assert_eq!(subscription("n", "k"), "subscriptions/n/subs/k.json");
        assert_eq!(
            subscription_watermarks("n"),
            "subscriptions/n/watermarks.json"
        );
        assert_eq!(legacy_subscriptions("n"), "subscriptions/n.json");
        assert_eq!(
            legacy_subscriptions_unconverted("n", 7),
            "subscriptions/n.unconverted-7.json"
        );
    }
}
