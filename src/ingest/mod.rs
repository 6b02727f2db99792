//! Table ingest: request bodies to Arrow record batches.
//!
//! [`Decoder`] takes a body (NDJSON, or JSON values glued together with no separator) and a
//! table's columns, checks every field against its column's type in one pass straight into
//! Arrow buffers, and returns one `RecordBatch` or every row error (up to a cap). It is
//! all-or-nothing: one bad row rejects the request. [`decompress()`] undoes `gzip`/`zstd`
//! content encodings under the same byte limit.
//!
//! ```
//! use sluice::ingest::{Decoder, Limits};
//! use sluice::types::{Column, ColumnType};
//!
//! let decoder = Decoder::new(&[
//!     Column::new("time", ColumnType::Timestamp),
//!     Column::new("n", ColumnType::Int),
//! ]);
//! let batch = decoder
//!     .decode(b"{\"time\":\"2026-10-23T09:00:00Z\",\"n\":1}\n{\"n\":2}\n", &Limits::default())
//!     .unwrap();
//! assert_eq!(batch.num_rows(), 2);
//!
//! let err = decoder.decode(b"{\"n\":1.5}\n", &Limits::default()).unwrap_err();
//! assert!(matches!(err, sluice::ingest::IngestError::InvalidRows(_)));
//! ```

mod builder;
mod decoder;
mod decompress;
pub(crate) mod encode;

pub use decoder::Decoder;
pub(crate) use decompress::Decompressor;
pub use decompress::{ContentEncoding, decompress};

use crate::catalog::CatalogError;
use crate::error::{Applied, Cause, Classify, ErrorClass, Kind};
use crate::table::TableError;
use std::fmt;
use std::time::Duration;

/// The limits a request is checked against while it is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted body, after decompression, in bytes.
    pub max_body_bytes: usize,
    /// Most rows in one request.
    pub max_rows: usize,
    /// Most row errors reported; past it `row_errors_truncated` is set.
    pub max_row_errors: usize,
}

impl Limits {
    /// The contract's limits: 16 MiB of uncompressed body, 200,000 rows, 100 row errors.
    pub(crate) const DEFAULT: Limits = Limits {
        max_body_bytes: 16 * 1024 * 1024,
        max_rows: 200_000,
        max_row_errors: 100,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// One problem with one row of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowError {
    /// Zero-based index of the row among the request's rows (blank lines are not rows).
    pub row_index: usize,
    /// The column (or unknown field) the problem is in; `None` for row-level problems.
    pub column: Option<String>,
    /// What was wrong and what was expected.
    pub message: String,
}

impl fmt::Display for RowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.column {
            Some(c) => write!(f, "row {}, column {c:?}: {}", self.row_index, self.message),
            None => write!(f, "row {}: {}", self.row_index, self.message),
        }
    }
}

/// The row errors of a rejected request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RowErrors {
    /// The errors, in input order, at most [`Limits::max_row_errors`] of them.
    pub errors: Vec<RowError>,
    /// Whether more errors were found than are listed.
    pub truncated: bool,
}

/// Why an ingest request did not commit.
#[derive(Debug, thiserror::Error)]
pub enum IngestFailure {
    /// The body or its rows were refused; nothing was applied.
    #[error(transparent)]
    Input(#[from] IngestError),
    /// No such table.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// A computed column's expression failed on this batch; nothing was applied.
    #[error("computed column {column}: {message}")]
    Computed {
        /// The column.
        column: String,
        /// What failed.
        message: String,
    },
    /// Storage refused (retryable backpressure, nothing applied) or failed (outcome unknown).
    #[error(transparent)]
    Table(#[from] TableError),
    /// No room in the request-body budget came in time; nothing was applied.
    #[error(transparent)]
    Admission(#[from] AdmissionTimeout),
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

/// Why a body was not admitted.
#[derive(Debug, thiserror::Error)]
#[error(
    "the server is holding as many request bodies as it may ({budget} bytes); no room came within {waited:?}"
)]
pub struct AdmissionTimeout {
    /// How long the request waited in all.
    pub waited: Duration,
    /// The budget, in bytes.
    pub budget: usize,
}

impl Classify for AdmissionTimeout {
    fn class(&self) -> ErrorClass {
        ErrorClass::retry(Cause::BodyAdmission)
    }
}

/// Why a request body was not turned into a batch. Nothing of it is applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IngestError {
    /// Some rows do not match the table schema (or are not JSON).
    #[error("input does not match the table schema ({} row error{}{})",
        .0.errors.len(),
        if .0.errors.len() == 1 { "" } else { "s" },
        if .0.truncated { ", more omitted" } else { "" })]
    InvalidRows(RowErrors),
    /// More rows than the limit.
    #[error("request has more than {limit} rows; split it into smaller batches")]
    TooManyRows {
        /// The row limit.
        limit: usize,
    },
    /// The (decompressed) body is larger than the limit.
    #[error(
        "request body is larger than {limit} bytes after decompression; split it into smaller batches"
    )]
    BodyTooLarge {
        /// The byte limit.
        limit: usize,
    },
    /// A `Content-Encoding` other than identity, gzip or zstd.
    #[error("unsupported content encoding {0:?}; use gzip, zstd or none")]
    UnsupportedEncoding(String),
    /// A compressed body that does not decompress.
    #[error("request body is not valid {encoding} data: {reason}")]
    Decompression {
        /// The encoding that was declared.
        encoding: &'static str,
        /// What the decompressor said.
        reason: String,
    },
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
