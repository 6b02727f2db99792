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
//! | [`Kind::ResourcesExhausted`] | 422 | `resources_exhausted` | no |
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
//!
//! A refusal that applied nothing because the server could not take the request now names its
//! [`Cause`]: sluice's name for it (`x-sluice-not-applied`, `details.cause`) and, where the
//! stream Append contract (`stream-append.md`, Ursula's) has a name that means the same thing,
//! that name too (`x-ursula-not-applied` and the body's `error`):
//!
//! | cause | contract name | when |
//! | --- | --- | --- |
//! | [`Cause::LogDiskPressure`] | `WalDiskPressure` | the commit log holds `max_log_bytes` |
//! | [`Cause::BodyAdmission`] | `IngressBodyBytesLimitReached` | request bodies hold the budget for them (`ingest_inflight_bytes`) past the admission wait |
//! | [`Cause::OwnerUnavailable`] | `GroupNotHosted` | no live process serves the stream (its node died, or did not answer the forwarded request) |
//! | [`Cause::OwnerMoved`] | `GroupNotHosted` | a forwarded request reached a node that no longer serves the stream |
//! | [`Cause::ShuttingDown`] | `NotLeader` | this process is stopping: it serves nothing more |
//! | [`Cause::LeaseExpired`] | `NotLeader` | this node has not renewed its lease; it writes again once it has |
//! | [`Cause::Fenced`] | `NotLeader` | another node took this node's id over |
//! | [`Cause::LogUnavailable`] | | a write of the log failed; it takes nothing until a restart |
//! | [`Cause::EarlierWriteFailed`] | | an append this one was decided after failed |
//! | [`Cause::StreamStateFull`] | | stream state or producers hold their byte budget |
//! | [`Cause::StorageUnavailable`] | | the object store did not answer |
//! | [`Cause::TableBackpressure`] | | a table's unflushed data is over its budget |
//! | [`Cause::StatementsBusy`] | | too many statements are running |
//! | [`Cause::StatementMemory`] | | other statements hold the server's statement memory |
//! | [`Cause::AnswerMemory`] | | answers not yet read by their clients hold the memory for them |
//!
//! The contract's other names (`RaftLogPressure`, `ColdBackpressure`,
//! `RaftUncommittedBackpressure`) are refusals of a Raft group and its cold tier, which sluice
//! does not have.

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
    /// A statement that needs more memory (or work in one call) than a statement may
    /// have, whatever else runs: it fails the same way when sent again.
    ResourcesExhausted,
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
    /// For refusals that applied nothing because the server could not take them now, why.
    pub cause: Option<Cause>,
}

/// Why a refusal that applied nothing could not be taken now (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The commit log's files hold `max_log_bytes`.
    LogDiskPressure,
    /// A write of the commit log failed: it takes nothing more until the server restarts.
    LogUnavailable,
    /// The server is stopping.
    ShuttingDown,
    /// This node has not renewed its lease in time; it writes again once it has.
    LeaseExpired,
    /// An append this one was decided after failed, so this one was not written.
    EarlierWriteFailed,
    /// Another node took this node's id over.
    Fenced,
    /// The object store did not answer.
    StorageUnavailable,
    /// A table's unflushed data stayed over its budget.
    TableBackpressure,
    /// Too many statements are running.
    StatementsBusy,
    /// Other statements hold the server's statement memory.
    StatementMemory,
    /// Answers not yet read by their clients hold the memory for them (stream reads).
    AnswerMemory,
    /// No live process serves the stream: its owner died (and was not taken over yet), or did
    /// not answer a forwarded request it never received.
    OwnerUnavailable,
    /// A request forwarded here by a peer found the stream served by another node now (it
    /// moved): the peer looks it up again.
    OwnerMoved,
    /// Request bodies held the whole request-body budget (`ingest_inflight_bytes`) for the
    /// whole admission wait.
    BodyAdmission,
    /// Stream state or producer entries hold their byte budget.
    StreamStateFull,
}

impl Cause {
    /// sluice's name for it (`x-sluice-not-applied`, `details.cause`).
    pub fn name(self) -> &'static str {
        match self {
            Cause::LogDiskPressure => "LogDiskPressure",
            Cause::LogUnavailable => "LogUnavailable",
            Cause::ShuttingDown => "ShuttingDown",
            Cause::LeaseExpired => "LeaseExpired",
            Cause::EarlierWriteFailed => "EarlierWriteFailed",
            Cause::Fenced => "Fenced",
            Cause::StorageUnavailable => "StorageUnavailable",
            Cause::TableBackpressure => "TableBackpressure",
            Cause::StatementsBusy => "StatementsBusy",
            Cause::AnswerMemory => "AnswerMemory",
            Cause::StatementMemory => "StatementMemory",
            Cause::OwnerUnavailable => "OwnerUnavailable",
            Cause::OwnerMoved => "OwnerMoved",
            Cause::BodyAdmission => "BodyAdmission",
            Cause::StreamStateFull => "StreamStateFull",
        }
    }

    /// The stream Append contract's name for the same cause (`x-ursula-not-applied` and the
    /// body's `error`), where it has one.
    pub fn contract_name(self) -> Option<&'static str> {
        match self {
            Cause::LogDiskPressure => Some("WalDiskPressure"),
            Cause::BodyAdmission => Some("IngressBodyBytesLimitReached"),
            Cause::OwnerUnavailable | Cause::OwnerMoved => Some("GroupNotHosted"),
            Cause::ShuttingDown | Cause::LeaseExpired | Cause::Fenced => Some("NotLeader"),
            Cause::LogUnavailable
            | Cause::EarlierWriteFailed
            | Cause::StreamStateFull
            | Cause::StorageUnavailable
            | Cause::TableBackpressure
            | Cause::StatementsBusy
            | Cause::StatementMemory
            | Cause::AnswerMemory => None,
        }
    }
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
    pub(crate) const fn retry(cause: Cause) -> Self {
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
