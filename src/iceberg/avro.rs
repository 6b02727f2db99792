//! The few Avro encodings Iceberg's manifest lists and manifests need: an object container
//! file (header, one block of records, no codec) and the binary encoding of the primitive
//! values, unions with null, arrays and records that those files hold.
//!
//! Format (Avro 1.11 specification, "Object Container Files"): the magic `Obj\x01`; the file
//! metadata as an Avro `map<bytes>` (which must hold `avro.schema`, the writer's schema as
//! JSON; `avro.codec` is `null`, no compression); a 16-byte sync marker; then blocks, each a
//! `long` record count, a `long` byte size, the records, and the sync marker again. `long` and
//! `int` are zig-zag varints; strings and bytes are a `long` length and the bytes; a union is
//! the branch's index as a `long` and then the value; an array is blocks of a `long` count and
//! the items, ended by a zero count. Records are their fields in the schema's order.
//!
//! The encoding here is deterministic: the sync marker is derived from the content's
//! identity, so writing the same snapshot twice gives the same bytes (two nodes publishing one
//! manifest version agree byte for byte).

/// An Avro binary encoder over a growing buffer.
#[derive(Debug, Default)]
pub(crate) struct Encoder {
    out: Vec<u8>,
}

impl Encoder {
    /// A `long` (or `int`): zig-zag, then base-128 varint.
    pub(crate) fn long(&mut self, v: i64) -> &mut Self {
        let mut z = ((v << 1) ^ (v >> 63)) as u64;
        loop {
            let byte = (z & 0x7f) as u8;
            z >>= 7;
            if z == 0 {
                self.out.push(byte);
                break;
            }
            self.out.push(byte | 0x80);
        }
        self
    }

    /// `bytes`: length, then the bytes.
    pub(crate) fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.long(i64::try_from(v.len()).unwrap_or(i64::MAX));
        self.out.extend_from_slice(v);
        self
    }

    /// `string`: as `bytes`, UTF-8.
    pub(crate) fn string(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }

    /// A `["null", T]` union: index 0 for null, index 1 and the value from `some`.
    pub(crate) fn optional<T>(
        &mut self,
        v: Option<T>,
        some: impl FnOnce(&mut Self, T),
    ) -> &mut Self {
        match v {
            None => {
                self.long(0);
            }
            Some(v) => {
                self.long(1);
                some(self, v);
            }
        }
        self
    }

    /// A `["null", "long"]` union.
    pub(crate) fn optional_long(&mut self, v: Option<i64>) -> &mut Self {
        self.optional(v, |e, v| {
            e.long(v);
        })
    }

    /// An array (one block of all items, then the end).
    pub(crate) fn array<T>(
        &mut self,
        items: &[T],
        mut item: impl FnMut(&mut Self, &T),
    ) -> &mut Self {
        if !items.is_empty() {
            self.long(i64::try_from(items.len()).unwrap_or(i64::MAX));
            for i in items {
                item(self, i);
            }
        }
        self.long(0)
    }

    /// The encoded bytes.
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.out
    }
}

/// An object container file of `records` (each already encoded by the writer schema
/// `schema`), with `metadata` beside the schema, and a sync marker derived from `seed`.
pub(crate) fn container(
    schema: &serde_json::Value,
    metadata: &[(&str, String)],
    records: &[Vec<u8>],
    seed: &str,
) -> Vec<u8> {
    let sync = sync_marker(seed);
    let schema = schema.to_string();
    let mut header = Encoder::default();
    header.out.extend_from_slice(b"Obj\x01");
    let mut entries: Vec<(&str, &[u8])> =
        vec![("avro.schema", schema.as_bytes()), ("avro.codec", b"null")];
    entries.extend(metadata.iter().map(|(k, v)| (*k, v.as_bytes())));
    header.array(&entries, |e, (key, value)| {
        e.string(key).bytes(value);
    });
    header.out.extend_from_slice(&sync);
    let mut out = header.into_bytes();
    if !records.is_empty() {
        let size: usize = records.iter().map(Vec::len).sum();
        let mut block = Encoder::default();
        block
            .long(i64::try_from(records.len()).unwrap_or(i64::MAX))
            .long(i64::try_from(size).unwrap_or(i64::MAX));
        out.extend_from_slice(&block.into_bytes());
        for r in records {
            out.extend_from_slice(r);
        }
        out.extend_from_slice(&sync);
    }
    out
}

fn sync_marker(seed: &str) -> [u8; 16] {
    super::stable_hash_128(seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longs_are_zigzag_varints() {
        let enc = |v: i64| {
            let mut e = Encoder::default();
            e.long(v);
            e.into_bytes()
        };
        assert_eq!(enc(0), [0x00]);
        assert_eq!(enc(-1), [0x01]);
        assert_eq!(enc(1), [0x02]);
        assert_eq!(enc(-64), [0x7f]);
        assert_eq!(enc(64), [0x80, 0x01]);
        assert_eq!(enc(i64::MAX).len(), 10);
        assert_eq!(enc(i64::MIN).len(), 10);
    }

    #[test]
    fn a_container_has_magic_metadata_sync_and_one_block() {
        let schema = serde_json::json!({"type": "record", "name": "r", "fields": [
            {"name": "x", "type": "long"}
        ]});
        let mut rec = Encoder::default();
        rec.long(5);
        let file = container(&schema, &[("k", "v".into())], &[rec.into_bytes()], "seed");
        assert!(file.starts_with(b"Obj\x01"));
        let sync = sync_marker("seed");
        // The sync marker follows the header and ends the one block.
        assert!(file.ends_with(&sync));
        let first = file.windows(16).position(|w| w == sync).expect("sync");
        // Block: count 1 (0x02), size 1 (0x02), the record (5 = 0x0a), sync.
        assert_eq!(&file[first + 16..first + 19], &[0x02, 0x02, 0x0a]);
        assert_eq!(file.len(), first + 16 + 3 + 16);
        assert_ne!(sync_marker("a"), sync_marker("b"));
    }
}
