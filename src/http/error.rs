//! Every error answer: an HTTP status and the flat `{code, message, details}` body.

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::catalog::CatalogError;
use crate::db::IngestFailure;
use crate::ingest::IngestError;
use crate::log::LogError;
use crate::query::QueryError;
use crate::table::TableError;

/// Whether a refused write may have been applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Nothing was applied.
    Rejected,
    /// It may have been applied.
    Unknown,
}

/// An error answer.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) code: &'static str,
    pub(crate) message: String,
    pub(crate) details: Map<String, Value>,
    pub(crate) retry_after_seconds: Option<u64>,
    /// Headers the answer carries besides the body (protocol state such as offsets).
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            details: Map::new(),
            retry_after_seconds: None,
            headers: Vec::new(),
        }
    }

    /// Adds `details.status` for write endpoints.
    pub(crate) fn outcome(mut self, outcome: Outcome) -> Self {
        let s = match outcome {
            Outcome::Rejected => "rejected",
            Outcome::Unknown => "unknown",
        };
        self.details.insert("status".into(), json!(s));
        self
    }

    /// Adds a header to the answer (skipped if the value is not a valid header value).
    pub(crate) fn header(mut self, name: &'static str, value: impl AsRef<str>) -> Self {
        if let Ok(v) = HeaderValue::from_str(value.as_ref()) {
            self.headers.push((HeaderName::from_static(name), v));
        }
        self
    }

    pub(crate) fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after_seconds = Some(seconds);
        self
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub(crate) fn unauthorized() -> Self {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or invalid API key; send Authorization: Bearer <key>",
        )
    }

    pub(crate) fn forbidden(role: super::Role, needed: super::Role) -> Self {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "this key has the {} role; this needs {}",
                role.name(),
                needed.name()
            ),
        )
        .outcome(Outcome::Rejected)
    }

    /// 503 with `Retry-After`: too much is running; nothing was applied.
    pub(crate) fn busy(message: impl Into<String>) -> Self {
        service_unavailable(message.into()).outcome(Outcome::Rejected)
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        internal(message.into())
    }

    pub(crate) fn payload_too_large(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "code": self.code,
            "message": self.message,
            "details": Value::Object(self.details),
        });
        let mut response = (self.status, axum::Json(body)).into_response();
        for (name, value) in self.headers {
            response.headers_mut().insert(name, value);
        }
        if let Some(seconds) = self.retry_after_seconds {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

fn service_unavailable(message: String) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        message,
    )
    .retry_after(1)
}

fn internal(message: String) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_server_error",
        message,
    )
}

impl From<CatalogError> for ApiError {
    fn from(e: CatalogError) -> Self {
        let message = e.to_string();
        match e {
            CatalogError::NotFound { .. } => ApiError::not_found(message),
            CatalogError::Invalid(_) => ApiError::bad_request(message),
            CatalogError::Stale { .. } => ApiError::new(
                StatusCode::PRECONDITION_FAILED,
                "precondition_failed",
                message,
            ),
            CatalogError::Destructive(_)
            | CatalogError::Unsupported(_)
            | CatalogError::Conflict
            | CatalogError::Replaced(_) => ApiError::new(StatusCode::CONFLICT, "conflict", message),
            CatalogError::Storage(_) | CatalogError::Corrupt { .. } => service_unavailable(message),
        }
    }
}

fn from_table(e: TableError) -> ApiError {
    let message = e.to_string();
    match e {
        TableError::Backpressure { .. } | TableError::Log(LogError::Full { .. }) => {
            service_unavailable(message).outcome(Outcome::Rejected)
        }
        TableError::Log(LogError::Poisoned) | TableError::Log(LogError::RecordTooLarge(_)) => {
            service_unavailable(message).outcome(Outcome::Rejected)
        }
        TableError::NotFound(_) => ApiError::not_found(message).outcome(Outcome::Rejected),
        TableError::SchemaMismatch { .. } => internal(message).outcome(Outcome::Rejected),
        // The log write may have happened: the client must reconcile.
        _ => internal(message).outcome(Outcome::Unknown),
    }
}

impl From<IngestFailure> for ApiError {
    fn from(e: IngestFailure) -> Self {
        match e {
            IngestFailure::Input(input) => {
                let message = input.to_string();
                match input {
                    IngestError::InvalidRows(rows) => {
                        let mut err = ApiError::new(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            "invalid_schema",
                            "input does not match the table schema",
                        )
                        .outcome(Outcome::Rejected);
                        let row_errors: Vec<Value> = rows
                            .errors
                            .iter()
                            .map(|r| json!({"row_index": r.row_index, "column": r.column, "message": r.message}))
                            .collect();
                        err.details
                            .insert("row_errors".into(), Value::Array(row_errors));
                        err.details
                            .insert("row_errors_truncated".into(), json!(rows.truncated));
                        err
                    }
                    IngestError::TooManyRows { .. } | IngestError::BodyTooLarge { .. } => {
                        ApiError::payload_too_large(message).outcome(Outcome::Rejected)
                    }
                    IngestError::UnsupportedEncoding(_) => ApiError::new(
                        StatusCode::UNSUPPORTED_MEDIA_TYPE,
                        "unsupported_media_type",
                        message,
                    )
                    .outcome(Outcome::Rejected),
                    IngestError::Decompression { .. } => {
                        ApiError::bad_request(message).outcome(Outcome::Rejected)
                    }
                }
            }
            IngestFailure::Catalog(c) => ApiError::from(c).outcome(Outcome::Rejected),
            IngestFailure::Computed { .. } => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_schema",
                e.to_string(),
            )
            .outcome(Outcome::Rejected),
            IngestFailure::Table(t) => from_table(t),
        }
    }
}

impl From<QueryError> for ApiError {
    fn from(e: QueryError) -> Self {
        match e {
            QueryError::Catalog(c) => c.into(),
            QueryError::Table(t) => from_table(t),
            QueryError::TooComplex(m) => {
                ApiError::new(StatusCode::BAD_REQUEST, "statement_too_complex", m)
            }
            QueryError::Unsupported(m) => {
                ApiError::new(StatusCode::BAD_REQUEST, "unsupported_statement", m)
            }
            other => ApiError::bad_request(other.to_string()),
        }
    }
}
