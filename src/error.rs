//! How every failure is classified, once, where it is raised: what kind of failure it is,
//! whether anything of the request may have been applied, and whether (and when) the same
//! request may succeed if sent again. `http/error.rs` turns a class into a status and the
//! `{code, message, details}` body in one table, so the same class gets the same answer on
//! every route (ingest, streams, statements).
//!
//! | kind | status | code | retry |
//! | --- | --- | --- | --- |
//! | [`Kind::Invalid`] | 400 | `bad_request` | no |
//! | [`Kind::Syntax`] | 400 | `syntax_error` | no |
//! | [`Kind::Unsupported`] | 400 | `unsupported_statement` | no |
//! | [`Kind::TooComplex`] | 400 | `statement_too_complex` | no |
//! | [`Kind::QueryFailed`] | 400 | `query_error` | no |
//! | [`Kind::InvalidRows`] | 422 | `invalid_schema` | no |
//! | [`Kind::TooLarge`] | 413 | `payload_too_large` | no |
//! | [`Kind::ResultTooLarge`] | 413 | `result_too_large` | no |
//! | [`Kind::UnsupportedMedia`] | 415 | `unsupported_media_type` | no |
//! | [`Kind::NotFound`] | 404 | `not_found` | no |
//! | [`Kind::Gone`] | 410 | `gone` | no |
//! | [`Kind::Conflict`] | 409 | `conflict` | no |
//! | [`Kind::PreconditionFailed`] | 412 | `precondition_failed` | no |
//! | [`Kind::StaleEpoch`] | 403 | `stale_epoch` | no |
//! | [`Kind::OutOfRange`] | 416 | `offset_beyond_tail` | no |
//! | [`Kind::TooMany`] | 429 | `too_many_requests` | no |
//! | [`Kind::Timeout`] | 408 | `statement_timeout` | no |
//! | [`Kind::Cancelled`] | 499 | `cancelled` | no |
//! | [`Kind::Unavailable`] | 503 | `service_unavailable` | after `Retry-After` |
//! | [`Kind::Internal`] | 500 | `internal_server_error` | no |
//!
//! Whether anything was applied is [`Applied`]: `rejected` (nothing was, whatever the
//! status) or `unknown` (it may have been: reconcile before sending it again).

use crate::catalog::CatalogError;
use crate::db::{AdmissionTimeout, IngestFailure};
use crate::ingest::IngestError;
use crate::log::LogError;
use crate::node::NodeError;
use crate::query::QueryError;
use crate::query::statements::SubmitError;
use crate::stream::StreamError;
use crate::table::TableError;

/// What kind of failure an error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The request is malformed or breaks a rule.
    Invalid,
    /// A statement that does not parse.
    Syntax,
    /// A statement kind sluice does not run.
    Unsupported,
    /// A statement nested too deeply or too long to parse safely.
    TooComplex,
    /// The query engine refused or failed the query.
    QueryFailed,
    /// Rows the table's column checks refuse.
    InvalidRows,
    /// A body over its limit.
    TooLarge,
    /// A statement result over its limit.
    ResultTooLarge,
    /// A content type or encoding that is not accepted.
    UnsupportedMedia,
    /// No such table, stream, statement, ….
    NotFound,
    /// Deleted, and still held by others (a stream that forks read).
    Gone,
    /// The state does not allow it (closed stream, sequence gap, concurrent change, …).
    Conflict,
    /// A precondition the request carried does not hold (`If-Match`, incarnation).
    PreconditionFailed,
    /// An idempotent producer's epoch is older than the stored one.
    StaleEpoch,
    /// A read offset past the end.
    OutOfRange,
    /// A configured count would be exceeded (streams, producers).
    TooMany,
    /// A statement ran longer than it may.
    Timeout,
    /// A statement was cancelled.
    Cancelled,
    /// The server cannot take it now: backpressure, storage down, shutting down.
    Unavailable,
    /// Anything else.
    Internal,
}

/// Whether a failed request may have been applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Nothing of it was applied.
    Rejected,
    /// It may have been applied.
    Unknown,
}

/// An error's class: enough to answer it the same way on every route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorClass {
    /// What kind of failure.
    pub kind: Kind,
    /// Whether anything may have been applied.
    pub applied: Applied,
    /// When set, the same request may succeed after this many seconds.
    pub retry_after: Option<u64>,
    /// For refusals that applied nothing because the server could not take them now, why
    /// (the streams protocol names it in `x-sluice-not-applied`).
    pub cause: Option<&'static str>,
}

impl ErrorClass {
    /// A refusal that applied nothing and will not succeed as it is.
    pub(crate) const fn rejected(kind: Kind) -> Self {
        ErrorClass {
            kind,
            applied: Applied::Rejected,
            retry_after: None,
            cause: None,
        }
    }

    /// A refusal that applied nothing and may succeed in a second.
    pub(crate) const fn retry(cause: &'static str) -> Self {
        ErrorClass {
            kind: Kind::Unavailable,
            applied: Applied::Rejected,
            retry_after: Some(1),
            cause: Some(cause),
        }
    }

    /// A failure after which the request may or may not have been applied.
    pub(crate) const fn unknown(kind: Kind) -> Self {
        ErrorClass {
            kind,
            applied: Applied::Unknown,
            retry_after: None,
            cause: None,
        }
    }

    /// Whether the same request may be sent again as it is (nothing was applied and the
    /// server said when).
    pub fn is_retryable(&self) -> bool {
        self.applied == Applied::Rejected && self.retry_after.is_some()
    }
}

/// Errors that know their class.
pub trait Classify {
    /// The error's class.
    fn class(&self) -> ErrorClass;
}

impl Classify for LogError {
    fn class(&self) -> ErrorClass {
        match self {
            LogError::Full { .. } => ErrorClass::retry("LogDiskPressure"),
            // A write failed: the log takes nothing more until the server restarts.
            LogError::Poisoned => ErrorClass {
                retry_after: None,
                ..ErrorClass::retry("LogUnavailable")
            },
            LogError::Closed => ErrorClass::retry("ShuttingDown"),
            LogError::LeaseExpired => ErrorClass::retry("LeaseExpired"),
            // Refused unwritten: its premise, an earlier write, failed.
            LogError::EarlierFailed => ErrorClass::retry("EarlierWriteFailed"),
            LogError::LeaseLapsed => ErrorClass::unknown(Kind::Unavailable),
            LogError::Fenced => ErrorClass {
                retry_after: None,
                ..ErrorClass::retry("Fenced")
            },
            LogError::RecordTooLarge(_) => ErrorClass::rejected(Kind::TooLarge),
            // A write or sync that failed, or a writer that stopped without answering: the
            // record may be in the log after a restart.
            LogError::Io { .. } | LogError::WriterGone => ErrorClass::unknown(Kind::Internal),
            LogError::Corrupt { .. }
            | LogError::Locked(_)
            | LogError::UnknownConsumer(_)
            | LogError::NotInLog(_) => ErrorClass::rejected(Kind::Internal),
        }
    }
}

impl Classify for NodeError {
    fn class(&self) -> ErrorClass {
        match self {
            NodeError::Fenced(_) => ErrorClass {
                retry_after: None,
                ..ErrorClass::retry("Fenced")
            },
            NodeError::Storage(_) => ErrorClass::retry("StorageUnavailable"),
            _ => ErrorClass::rejected(Kind::Internal),
        }
    }
}

impl Classify for CatalogError {
    fn class(&self) -> ErrorClass {
        match self {
            CatalogError::NotFound { .. } => ErrorClass::rejected(Kind::NotFound),
            CatalogError::Invalid(_) => ErrorClass::rejected(Kind::Invalid),
            CatalogError::Stale { .. } => ErrorClass::rejected(Kind::PreconditionFailed),
            CatalogError::Destructive(_)
            | CatalogError::Unsupported(_)
            | CatalogError::Conflict
            | CatalogError::Replaced(_) => ErrorClass::rejected(Kind::Conflict),
            // A catalog change whose create failed ambiguously may have landed.
            CatalogError::Storage(_) => ErrorClass {
                applied: Applied::Unknown,
                ..ErrorClass::retry("StorageUnavailable")
            },
            CatalogError::Corrupt { .. } => ErrorClass::rejected(Kind::Internal),
        }
    }
}

impl Classify for TableError {
    fn class(&self) -> ErrorClass {
        match self {
            TableError::Backpressure { .. } => ErrorClass::retry("TableBackpressure"),
            TableError::Log(e) => e.class(),
            TableError::Node(e) => e.class(),
            TableError::NotFound(_) => ErrorClass::rejected(Kind::NotFound),
            TableError::SchemaMismatch { .. } | TableError::AlreadyExists(_) => {
                ErrorClass::rejected(Kind::Internal)
            }
            TableError::Conflict(_) => ErrorClass::rejected(Kind::Conflict),
            // A request meets these before its rows reach the log (loading the table,
            // encoding the batch, decoding on a blocking thread) or while reading: nothing
            // of it was applied. (Flushes and compactions meet them too; no request waits
            // for those.)
            TableError::Storage(_) => ErrorClass::retry("StorageUnavailable"),
            TableError::CorruptManifest { .. } | TableError::Encoding(_) | TableError::Task(_) => {
                ErrorClass::rejected(Kind::Internal)
            }
        }
    }
}

impl Classify for IngestError {
    fn class(&self) -> ErrorClass {
        ErrorClass::rejected(match self {
            IngestError::InvalidRows(_) => Kind::InvalidRows,
            IngestError::TooManyRows { .. } | IngestError::BodyTooLarge { .. } => Kind::TooLarge,
            IngestError::UnsupportedEncoding(_) => Kind::UnsupportedMedia,
            IngestError::Decompression { .. } => Kind::Invalid,
        })
    }
}

impl Classify for IngestFailure {
    fn class(&self) -> ErrorClass {
        match self {
            IngestFailure::Input(e) => e.class(),
            IngestFailure::Catalog(e) => ErrorClass {
                applied: Applied::Rejected,
                ..e.class()
            },
            IngestFailure::Computed { .. } => ErrorClass::rejected(Kind::InvalidRows),
            IngestFailure::Table(e) => e.class(),
            IngestFailure::Admission(e) => e.class(),
        }
    }
}

impl Classify for AdmissionTimeout {
    fn class(&self) -> ErrorClass {
        ErrorClass::retry("BodyAdmission")
    }
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
                ..ErrorClass::retry("StreamStateFull")
            },
            StreamError::Log(e) => e.class(),
            // Reads of sealed data and checkpoints: nothing is written by the request.
            StreamError::Storage(_) => ErrorClass::retry("StorageUnavailable"),
            StreamError::Corrupt(_) => ErrorClass::rejected(Kind::Internal),
        }
    }
}

impl Classify for SubmitError {
    fn class(&self) -> ErrorClass {
        match self {
            SubmitError::Busy(_) => ErrorClass::retry("StatementsBusy"),
        }
    }
}

impl Classify for QueryError {
    fn class(&self) -> ErrorClass {
        match self {
            QueryError::Syntax { .. } => ErrorClass::rejected(Kind::Syntax),
            QueryError::TooComplex(_) => ErrorClass::rejected(Kind::TooComplex),
            QueryError::Unsupported(_) => ErrorClass::rejected(Kind::Unsupported),
            QueryError::Query(_) => ErrorClass::rejected(Kind::QueryFailed),
            QueryError::Rows(e) => e.class(),
            QueryError::Write(e) => e.class(),
            QueryError::Invalid(_) => ErrorClass::rejected(Kind::Invalid),
            QueryError::Catalog(e) => e.class(),
            QueryError::Table(e) => e.class(),
            QueryError::ResultTooLarge { .. } => ErrorClass::rejected(Kind::ResultTooLarge),
            QueryError::Timeout(_) => ErrorClass::rejected(Kind::Timeout),
            QueryError::Panicked { wrote: false } => ErrorClass::rejected(Kind::Internal),
            QueryError::Panicked { wrote: true } => ErrorClass::unknown(Kind::Internal),
            // A statement is cancelled only before it writes anything (see
            // `query::statements`).
            QueryError::Cancelled => ErrorClass::rejected(Kind::Cancelled),
        }
    }
}
