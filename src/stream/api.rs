//! The stream engine's API: what requests carry, what they answer, and why they fail.
//! Wire forms (headers) belong to `http/`; offsets as text are here ([`format_offset`]),
//! because subscriptions write them into webhook bodies and wake events too.

use std::sync::Arc;

use bytes::Bytes;

use super::codec::{Lifetime, ProducerTuple};
use super::json::JsonTextError;
use crate::error::{Cause, Classify, ErrorClass, Kind};
use crate::log::LogError;

/// An offset as clients see it: `{epoch:016}_{bytes:016}`, which sorts as a string in
/// offset order (the epoch part is always 0).
pub fn format_offset(offset: u64) -> String {
    format!("{:016}_{:016}", 0, offset)
}

/// Parses an offset [`format_offset`] wrote.
pub(crate) fn parse_offset(text: &str) -> Option<u64> {
    let (epoch, bytes) = text.split_once('_')?;
    if epoch.is_empty()
        || bytes.is_empty()
        || !epoch.bytes().all(|b| b.is_ascii_digit())
        || !bytes.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    if epoch.parse::<u64>().ok()? != 0 {
        return None;
    }
    bytes.parse().ok()
}

/// Largest append body (32 MiB).
pub const MAX_APPEND_BYTES: usize = 32 << 20;

/// Longest `Producer-Id` and `Stream-Seq` value.
pub const MAX_TOKEN_BYTES: usize = 256;

/// Largest value of `Producer-Epoch` and `Producer-Seq` (2^53 - 1).
pub const MAX_PRODUCER_NUMBER: u64 = (1 << 53) - 1;

/// Why a stream operation did not happen. Every variant but [`StreamError::Log`] (when
/// the write may have reached the log) applied nothing.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// No such stream (or it expired).
    #[error("stream not found")]
    NotFound,
    /// The stream was deleted but forks still read it.
    #[error("stream was deleted; forks still read it")]
    Gone,
    /// A request the protocol refuses.
    #[error("{0}")]
    BadRequest(String),
    /// The body is not acceptable JSON message text.
    #[error(transparent)]
    Json(#[from] JsonTextError),
    /// The stream is closed.
    #[error("stream is closed")]
    Closed {
        /// Its final offset.
        tail: u64,
    },
    /// The content type differs from the stream's.
    #[error("content type {given:?} does not match the stream's {expected:?}")]
    ContentTypeMismatch {
        /// Given.
        given: String,
        /// The stream's.
        expected: String,
        /// The stream's tail.
        tail: u64,
    },
    /// `Stream-Seq` is not greater than the stored one.
    #[error("Stream-Seq {given:?} is not greater than the last accepted {last:?}")]
    StreamSeqConflict {
        /// Given.
        given: String,
        /// Stored.
        last: String,
        /// The stream's tail.
        tail: u64,
    },
    /// A create whose settings differ from the existing stream's.
    #[error("stream exists with a different configuration")]
    ConfigConflict,
    /// The name is held by a deleted stream that forks still read.
    #[error("the name is held by a deleted stream that forks still read")]
    NameHeld,
    /// The fork source cannot be forked.
    #[error("{0}")]
    ForkConflict(String),
    /// `Producer-Epoch` is older than the stored one.
    #[error("producer epoch is stale; current epoch is {current}")]
    StaleEpoch {
        /// The stored epoch.
        current: u64,
    },
    /// A new epoch did not start at sequence 0.
    #[error("a new producer epoch must start at sequence 0")]
    NewEpochNotAtZero,
    /// A producer sequence number was skipped.
    #[error("producer sequence gap: expected {expected}, received {received}")]
    SequenceGap {
        /// The next expected sequence.
        expected: u64,
        /// The one received.
        received: u64,
        /// The stream's tail (`Stream-Next-Offset` of the 409).
        tail: u64,
    },
    /// `Stream-Incarnation` names another incarnation.
    #[error("stream incarnation does not match")]
    IncarnationMismatch {
        /// The current token.
        current: String,
    },
    /// The read offset is past the tail.
    #[error("offset is beyond the tail of the stream")]
    OffsetBeyondTail,
    /// Too many streams.
    #[error("too many streams (limit {0})")]
    TooManyStreams(usize),
    /// Too many producers on this stream.
    #[error("too many producers on this stream (limit {0})")]
    TooManyProducers(usize),
    /// The server's budget for stream state (or producer entries) is used up.
    #[error(
        "the server's {what} budget cannot hold this ({held} of its {budget} bytes are held); nothing was applied"
    )]
    StateFull {
        /// `stream state` or `producer state`.
        what: &'static str,
        /// The budget, in bytes.
        budget: u64,
        /// What the server holds of it.
        held: u64,
    },
    /// The asking key holds its whole share of the stream-state (or producer) budget: other
    /// keys keep the rest.
    #[error(
        "this key's share of the server's {what} budget cannot hold this ({held} of the share's {budget} bytes are held by the key); nothing was applied"
    )]
    KeyShareFull {
        /// `stream state` or `producer state`: the share that is full.
        what: &'static str,
        /// The key's share, in bytes.
        budget: u64,
        /// What the key holds of it.
        held: u64,
    },
    /// The commit log refused or failed.
    #[error(transparent)]
    Log(#[from] LogError),
    /// Object storage failed while reading cold data or checkpointing.
    #[error("object storage: {0}")]
    Storage(String),
    /// A snapshot or sealed object is unreadable.
    #[error("stream data is corrupt: {0}")]
    Corrupt(String),
    /// Work run on a task of its own failed (it panicked); nothing was changed.
    #[error("a task failed: {0}")]
    Task(String),
    /// The server began to stop while the request's body was still arriving: it is not
    /// served (a stopping server waits for the requests it serves, and a body that trickles
    /// in would hold it up).
    #[error("the server is shutting down; send the request again to a running server")]
    ShuttingDown,
}

impl Classify for StreamError {
    fn class(&self) -> ErrorClass {
        match self {
            StreamError::NotFound => ErrorClass::rejected(Kind::NotFound),
            StreamError::Gone => ErrorClass::rejected(Kind::Gone),
            StreamError::BadRequest(_) | StreamError::Json(_) | StreamError::NewEpochNotAtZero => {
                ErrorClass::rejected(Kind::Invalid)
            }
            StreamError::Closed { .. }
            | StreamError::ContentTypeMismatch { .. }
            | StreamError::StreamSeqConflict { .. }
            | StreamError::ConfigConflict
            | StreamError::NameHeld
            | StreamError::ForkConflict(_)
            | StreamError::SequenceGap { .. } => ErrorClass::rejected(Kind::Conflict),
            StreamError::StaleEpoch { .. } => ErrorClass::rejected(Kind::StaleEpoch),
            StreamError::IncarnationMismatch { .. } => {
                ErrorClass::rejected(Kind::PreconditionFailed)
            }
            StreamError::OffsetBeyondTail => ErrorClass::rejected(Kind::OutOfRange),
            StreamError::TooManyStreams(_) | StreamError::TooManyProducers(_) => {
                ErrorClass::rejected(Kind::TooMany)
            }
            // The server's budget, not this request: room comes back as streams are
            // deleted or expire and producers expire.
            StreamError::StateFull { .. } => ErrorClass {
                retry_after: Some(60),
                ..ErrorClass::retry(Cause::StreamStateFull)
            },
            // This key's own excess: room comes back as its streams are deleted or expire,
            // its producers expire, and its retired producers' records go (the cap per
            // stream, the producer's return, the stream's delete; not with time alone).
            StreamError::KeyShareFull { .. } => ErrorClass {
                kind: Kind::TooMany,
                retry_after: Some(60),
                ..ErrorClass::retry(Cause::StreamStateFull)
            },
            StreamError::Log(e) => e.class(),
            // Reads of sealed data and checkpoints: nothing is written by the request.
            StreamError::Storage(_) => ErrorClass::retry(Cause::StorageUnavailable),
            StreamError::ShuttingDown => ErrorClass::retry(Cause::ShuttingDown),
            StreamError::Corrupt(_) | StreamError::Task(_) => ErrorClass::rejected(Kind::Internal),
        }
    }
}

/// A stream's metadata as answers report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamInfo {
    /// Normalized content type.
    pub content_type: String,
    /// Offset after the last byte.
    pub tail: u64,
    /// Closed for appends.
    pub closed: bool,
    /// Incarnation token.
    pub incarnation: String,
    /// TTL or expiry.
    pub lifetime: Lifetime,
}

/// What a listing of streams asks for.
#[derive(Debug, Clone, Default)]
pub struct ListRequest {
    /// Names that start with this.
    pub prefix: String,
    /// Names after this one (where the listing before stopped).
    pub after: Option<String>,
    /// Most streams listed.
    pub limit: usize,
    /// Most idempotent producers listed in all (their streams'); the first stream is listed
    /// whole whatever its count (at most `max_producers_per_stream`).
    pub max_producers: usize,
}

/// Keeps the first of `listed` (in name order) whose producers together stay within
/// `max_producers`, at least one; says whether any went.
pub(crate) fn keep_within_producers<T>(
    listed: &mut Vec<T>,
    producers: impl Fn(&T) -> usize,
    max_producers: usize,
) -> bool {
    let mut total = 0usize;
    let kept = listed
        .iter()
        .position(|s| {
            total = total.saturating_add(producers(s));
            total > max_producers
        })
        .map_or(listed.len(), |over| over.max(1));
    let cut = kept < listed.len();
    listed.truncate(kept);
    cut
}

/// Listings of several sources (each in name order, each with whether it stopped short)
/// as one in name order, each name once, within `limit` streams and `max_producers` (see
/// [`keep_within_producers`]). What follows the first name where a source stopped short is
/// left out: that source's streams after it are not known, so a listing that goes on from
/// the last name shown would skip them. The second value says whether anything was left
/// out or any source stopped short.
pub(crate) fn merge_listings<T>(
    listings: Vec<(Vec<T>, bool)>,
    limit: usize,
    max_producers: usize,
    name: impl Fn(&T) -> &str,
    producers: impl Fn(&T) -> usize,
) -> (Vec<T>, bool) {
    let mut truncated = listings.iter().any(|(_, t)| *t);
    let bound: Option<String> = listings
        .iter()
        .filter(|(_, t)| *t)
        .filter_map(|(l, _)| l.last().map(|s| name(s).to_owned()))
        .min();
    let mut merged: Vec<T> = listings.into_iter().flat_map(|(l, _)| l).collect();
    merged.sort_by(|a, b| name(a).cmp(name(b)));
    merged.dedup_by(|a, b| name(a) == name(b));
    if let Some(bound) = bound {
        merged.retain(|s| name(s) <= bound.as_str());
    }
    if merged.len() > limit {
        merged.truncate(limit);
        truncated = true;
    }
    truncated |= keep_within_producers(&mut merged, producers, max_producers);
    (merged, truncated)
}

/// One stream as a listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSummary {
    /// The stream's name.
    pub name: String,
    /// Its metadata.
    pub info: StreamInfo,
    /// The stream it was forked from, if a fork.
    pub forked_from: Option<String>,
    /// Its idempotent producers, by id.
    pub producers: Vec<ProducerSummary>,
}

/// An idempotent producer's position on one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerSummary {
    /// `Producer-Id`.
    pub id: String,
    /// The current `Producer-Epoch`.
    pub epoch: u64,
    /// The last `Producer-Seq` admitted in that epoch.
    pub last_seq: u64,
}

/// A fork request's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForkRequest {
    /// Source stream name.
    pub source: String,
    /// `Stream-Fork-Offset`, if given.
    pub offset: Option<u64>,
    /// `Stream-Fork-Sub-Offset`, if given.
    pub sub_offset: Option<u64>,
}

/// A `PUT`.
#[derive(Debug, Clone)]
pub struct CreateRequest {
    /// Stream name.
    pub name: String,
    /// Normalized content type; `None` means the default (or, for a fork, the source's).
    pub content_type: Option<String>,
    /// TTL or expiry.
    pub lifetime: Lifetime,
    /// `Stream-Closed: true`.
    pub closed: bool,
    /// Fork parameters.
    pub fork: Option<ForkRequest>,
    /// The first append.
    pub body: Bytes,
    /// `Stream-Incarnation` precondition.
    pub incarnation: Option<String>,
    /// The name of the API key asking, whose share of the stream-state and producer budgets
    /// what it creates counts against; `None` when requests are not authenticated.
    pub key: Option<Arc<str>>,
}

/// A `POST`.
#[derive(Debug, Clone)]
pub struct AppendRequest {
    /// Stream name.
    pub name: String,
    /// Normalized content type of the body, if given.
    pub content_type: Option<String>,
    /// The bytes.
    pub body: Bytes,
    /// `Stream-Closed: true`.
    pub close: bool,
    /// Producer headers.
    pub producer: Option<ProducerTuple>,
    /// `Stream-Seq`.
    pub stream_seq: Option<String>,
    /// `Stream-Incarnation` precondition.
    pub incarnation: Option<String>,
    /// The name of the API key asking, whose share of the stream-state and producer budgets
    /// what it creates counts against; `None` when requests are not authenticated.
    pub key: Option<Arc<str>>,
}

/// What an accepted `POST` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AppendOutcome {
    /// Appended (or closed) now.
    Appended {
        /// Offset after the append.
        next: u64,
        /// The stream is closed now.
        closed: bool,
        /// This request closed it.
        closed_now: bool,
        /// The accepted producer tuple.
        producer: Option<ProducerTuple>,
        /// Incarnation.
        incarnation: String,
    },
    /// A producer retry of something already appended.
    Duplicate {
        /// The original's `Stream-Next-Offset`, while remembered.
        next: Option<u64>,
        /// The stream is closed.
        closed: bool,
        /// Producer epoch.
        epoch: u64,
        /// The highest accepted sequence number.
        last_seq: u64,
        /// Incarnation.
        incarnation: String,
    },
}

/// Data read from a stream.
#[derive(Debug, Clone)]
pub struct ReadResult {
    /// Records, in order (for JSON streams, each holds one message per line).
    pub records: Vec<Bytes>,
    /// Offset after the data returned.
    pub next: u64,
    /// `next` is the tail.
    pub up_to_date: bool,
    /// The stream is closed and `next` is its tail.
    pub closed_at_tail: bool,
    /// The stream's content type.
    pub content_type: String,
    /// Its incarnation.
    pub incarnation: String,
}

#[cfg(test)]
mod tests {
    use super::keep_within_producers;

    #[test]
    fn merged_listings_stop_where_a_source_stopped_short() {
        use super::merge_listings;
        let merge = |listings: Vec<(Vec<&'static str>, bool)>, limit: usize| {
            merge_listings(listings, limit, usize::MAX, |s| s, |_| 0)
        };
        // The first source stopped after a1 (its a2 is not known): b1 cannot come before it.
        let merged = merge(
            vec![(vec!["a1"], true), (vec!["b1"], false), (vec!["a0"], false)],
            10,
        );
        assert_eq!(merged, (vec!["a0", "a1"], true));
        let merged = merge(vec![(vec!["a1"], false), (vec!["b1"], false)], 10);
        assert_eq!(merged, (vec!["a1", "b1"], false));
        // A source that stopped short with nothing listed bounds nothing it did not show.
        let merged = merge(vec![(vec![], true), (vec!["b1"], false)], 10);
        assert_eq!(merged, (vec!["b1"], true));
        // Each name once; past the limit, cut and truncated.
        let merged = merge(vec![(vec!["a", "c"], false), (vec!["a", "b"], false)], 2);
        assert_eq!(merged, (vec!["a", "b"], true));
        // Within the producers: the first kept whatever its count.
        let merged = merge_listings(
            vec![(vec![("a", 8), ("b", 8)], false)],
            10,
            10,
            |s| s.0,
            |s| s.1,
        );
        assert_eq!(merged, (vec![("a", 8)], true));
    }

    #[test]
    fn a_listing_keeps_the_streams_whose_producers_fit_and_always_the_first() {
        let mut listed = vec![3usize, 4, 2, 1];
        assert!(keep_within_producers(&mut listed, |n| *n, 9));
        assert_eq!(listed, [3, 4, 2]);
        let mut listed = vec![3usize, 4, 2, 1];
        assert!(!keep_within_producers(&mut listed, |n| *n, 10));
        assert_eq!(listed.len(), 4);
        let mut listed = vec![50usize, 1];
        assert!(keep_within_producers(&mut listed, |n| *n, 10));
        assert_eq!(listed, [50]);
        let mut listed: Vec<usize> = Vec::new();
        assert!(!keep_within_producers(&mut listed, |n| *n, 0));
    }
}
