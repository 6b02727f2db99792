//! The byte format of stream records in the commit log.
//!
//! Every stream change is one log record: creates and deletes as [`RecordKind::Metadata`],
//! appends and closes as [`RecordKind::StreamAppend`]. A record carries everything its apply
//! needs (the admitted data, the producer and `Stream-Seq` state it commits), so replay after
//! a restart rebuilds exactly the state the live apply built.
//!
//! Layout: a one-byte tag, then fields in order. Integers are little-endian `u64`; strings and
//! byte strings are a `u32` length then the bytes; optional fields a presence byte first.
//!
//! [`RecordKind::Metadata`]: crate::log::RecordKind::Metadata
//! [`RecordKind::StreamAppend`]: crate::log::RecordKind::StreamAppend

use bytes::Bytes;

/// A producer's admitted `(id, epoch, seq)`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProducerTuple {
    /// `Producer-Id`.
    pub id: String,
    /// `Producer-Epoch`.
    pub epoch: u64,
    /// `Producer-Seq`.
    pub seq: u64,
}

/// Where a fork takes its prefix from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ForkSpec {
    /// The source stream's name.
    pub source: String,
    /// The source's incarnation when the fork was made.
    pub source_incarnation: String,
    /// The source offset the fork shares up to.
    pub offset: u64,
    /// `Stream-Fork-Sub-Offset` as the client gave it (0 when absent).
    pub sub_offset: u64,
}

/// Lifetime settings of a stream.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Lifetime {
    /// Sliding TTL in seconds (`Stream-TTL`).
    pub ttl_secs: Option<u64>,
    /// Absolute expiry as the client wrote it (`Stream-Expires-At`).
    pub expires_at: Option<String>,
    /// The same, in milliseconds since the epoch.
    pub expires_at_ms: Option<i64>,
}

/// One stream change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// A stream is created (replacing an expired one of the same name).
    Create {
        /// The stream's name.
        name: String,
        /// Its new incarnation token.
        incarnation: String,
        /// Normalized content type.
        content_type: String,
        /// TTL or expiry.
        lifetime: Lifetime,
        /// Created closed.
        closed: bool,
        /// Fork source, if a fork.
        fork: Option<ForkSpec>,
        /// Materialized sub-offset prefix of a fork (its first own record).
        prefix: Option<Bytes>,
        /// The first append, already checked (and for JSON, split into lines).
        initial: Option<Bytes>,
    },
    /// Data appended and/or the stream closed.
    Append {
        /// The stream's name.
        name: String,
        /// The incarnation the append was admitted against.
        incarnation: String,
        /// The bytes (for JSON streams, one compact message per line); `None` for close-only.
        data: Option<Bytes>,
        /// Closes the stream after the data.
        close: bool,
        /// The producer state this append commits.
        producer: Option<ProducerTuple>,
        /// The new `Stream-Seq` value.
        stream_seq: Option<String>,
    },
    /// A stream is deleted (soft-deleted while forks still read it).
    Delete {
        /// The stream's name.
        name: String,
        /// The incarnation deleted.
        incarnation: String,
    },
}

/// A record that does not decode: the log holds something this version did not write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stream record is malformed at byte {at}")]
pub struct DecodeError {
    /// Where decoding stopped.
    pub at: usize,
}

const CREATE: u8 = 1;
const APPEND: u8 = 2;
const DELETE: u8 = 3;

impl Op {
    /// Encodes the change as a log payload.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer(Vec::new());
        match self {
            Op::Create {
                name,
                incarnation,
                content_type,
                lifetime,
                closed,
                fork,
                prefix,
                initial,
            } => {
                w.u8(CREATE);
                w.str(name);
                w.str(incarnation);
                w.str(content_type);
                w.opt(lifetime.ttl_secs.as_ref(), |w, v| w.u64(*v));
                w.opt(lifetime.expires_at.as_ref(), |w, v| w.str(v));
                w.opt(lifetime.expires_at_ms.as_ref(), |w, v| w.u64(*v as u64));
                w.u8(u8::from(*closed));
                w.opt(fork.as_ref(), |w, f| {
                    w.str(&f.source);
                    w.str(&f.source_incarnation);
                    w.u64(f.offset);
                    w.u64(f.sub_offset);
                });
                w.opt(prefix.as_ref(), |w, b| w.bytes(b));
                w.opt(initial.as_ref(), |w, b| w.bytes(b));
            }
            Op::Append {
                name,
                incarnation,
                data,
                close,
                producer,
                stream_seq,
            } => {
                w.u8(APPEND);
                w.str(name);
                w.str(incarnation);
                w.u8(u8::from(*close));
                w.opt(producer.as_ref(), |w, p| {
                    w.str(&p.id);
                    w.u64(p.epoch);
                    w.u64(p.seq);
                });
                w.opt(stream_seq.as_ref(), |w, s| w.str(s));
                // Data last: it is the bulk of the record.
                w.opt(data.as_ref(), |w, b| w.bytes(b));
            }
            Op::Delete { name, incarnation } => {
                w.u8(DELETE);
                w.str(name);
                w.str(incarnation);
            }
        }
        w.0
    }

    /// Decodes a log payload; byte strings share the payload's buffer.
    pub fn decode(payload: Bytes) -> Result<Op, DecodeError> {
        let mut r = Reader {
            buf: payload,
            at: 0,
        };
        let op = match r.u8()? {
            CREATE => Op::Create {
                name: r.str()?,
                incarnation: r.str()?,
                content_type: r.str()?,
                lifetime: Lifetime {
                    ttl_secs: r.opt(|r| r.u64())?,
                    expires_at: r.opt(|r| r.str())?,
                    expires_at_ms: r.opt(|r| r.u64().map(|v| v as i64))?,
                },
                closed: r.u8()? != 0,
                fork: r.opt(|r| {
                    Ok(ForkSpec {
                        source: r.str()?,
                        source_incarnation: r.str()?,
                        offset: r.u64()?,
                        sub_offset: r.u64()?,
                    })
                })?,
                prefix: r.opt(|r| r.bytes())?,
                initial: r.opt(|r| r.bytes())?,
            },
            APPEND => {
                let name = r.str()?;
                let incarnation = r.str()?;
                let close = r.u8()? != 0;
                let producer = r.opt(|r| {
                    Ok(ProducerTuple {
                        id: r.str()?,
                        epoch: r.u64()?,
                        seq: r.u64()?,
                    })
                })?;
                let stream_seq = r.opt(|r| r.str())?;
                let data = r.opt(|r| r.bytes())?;
                Op::Append {
                    name,
                    incarnation,
                    data,
                    close,
                    producer,
                    stream_seq,
                }
            }
            DELETE => Op::Delete {
                name: r.str()?,
                incarnation: r.str()?,
            },
            _ => return Err(DecodeError { at: 0 }),
        };
        if r.at != r.buf.len() {
            return Err(DecodeError { at: r.at });
        }
        Ok(op)
    }
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        // Lengths fit: a record is at most the log's record limit, far below 4 GiB.
        self.0.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    fn opt<T>(&mut self, v: Option<&T>, f: impl FnOnce(&mut Self, &T)) {
        match v {
            Some(v) => {
                self.u8(1);
                f(self, v);
            }
            None => self.u8(0),
        }
    }
}

struct Reader {
    buf: Bytes,
    at: usize,
}

impl Reader {
    fn take(&mut self, n: usize) -> Result<Bytes, DecodeError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.buf.len())
            .ok_or(DecodeError { at: self.at })?;
        let out = self.buf.slice(self.at..end);
        self.at = end;
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&b);
        Ok(u64::from_le_bytes(a))
    }
    fn bytes(&mut self) -> Result<Bytes, DecodeError> {
        let b = self.take(4)?;
        let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        self.take(len)
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        let at = self.at;
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError { at })
    }
    fn opt<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, DecodeError>,
    ) -> Result<Option<T>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => f(self).map(Some),
            _ => Err(DecodeError { at: self.at - 1 }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_round_trip() {
        let ops = [
            Op::Create {
                name: "b/s".into(),
                incarnation: "i1".into(),
                content_type: "application/json".into(),
                lifetime: Lifetime {
                    ttl_secs: Some(60),
                    expires_at: None,
                    expires_at_ms: Some(-5),
                },
                closed: true,
                fork: Some(ForkSpec {
                    source: "a".into(),
                    source_incarnation: "i0".into(),
                    offset: 7,
                    sub_offset: 2,
                }),
                prefix: Some(Bytes::from_static(b"1\n2\n")),
                initial: None,
            },
            Op::Append {
                name: "b/s".into(),
                incarnation: "i1".into(),
                data: Some(Bytes::from_static(b"hello")),
                close: false,
                producer: Some(ProducerTuple {
                    id: "p".into(),
                    epoch: 1,
                    seq: 2,
                }),
                stream_seq: Some("007".into()),
            },
            Op::Delete {
                name: "x".into(),
                incarnation: "i".into(),
            },
        ];
        for op in ops {
            let bytes = Bytes::from(op.encode());
            assert_eq!(Op::decode(bytes.clone()).unwrap(), op);
            // Every truncation is an error, never a panic.
            for cut in 0..bytes.len() {
                assert!(Op::decode(bytes.slice(..cut)).is_err());
            }
        }
    }
}
