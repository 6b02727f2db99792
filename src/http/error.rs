//! Every error answer: an HTTP status and the flat `{code, message, details}` body. Errors
//! arrive classified ([`crate::error`]); [`status_and_code`] is the one table from a class
//! to its status and code, so the same class gets the same answer on every route.
//!
//! A refusal that applied nothing for a [`Cause`] names it on every route: sluice's name in
//! [`NOT_APPLIED`] and `details.cause`, and, where the stream Append contract has a name for
//! the same cause, that name in [`CONTRACT_NOT_APPLIED`] and in the body's top-level `error`
//! (the contract's "JSON `error`").

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::catalog::CatalogError;
use crate::db::IngestFailure;
pub(crate) use crate::error::Applied as Outcome;
use crate::error::{Applied, Cause, Classify, ErrorClass, Kind};
use crate::ingest::IngestError;
use crate::query::QueryError;

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
    /// The cause of a refusal that applied nothing; the stream Append contract's name for it
    /// is the body's top-level `error`.
    pub(crate) cause: Option<Cause>,
}

/// The header that names sluice's cause of a refusal that applied nothing.
pub(crate) const NOT_APPLIED: &str = "x-sluice-not-applied";

/// The header the stream Append contract names the same cause in, with its own name for it.
pub(crate) const CONTRACT_NOT_APPLIED: &str = "x-ursula-not-applied";

impl ApiError {
    pub(crate) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            details: Map::new(),
            retry_after_seconds: None,
            headers: Vec::new(),
            cause: None,
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

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        internal(message.into())
    }

    pub(crate) fn payload_too_large(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }
}

impl ApiError {
    /// The `{code, message, details}` body, with `error` when the contract names the cause.
    pub(crate) fn body(&self) -> Value {
        let mut body = json!({
            "code": self.code,
            "message": self.message,
            "details": Value::Object(self.details.clone()),
        });
        if let Some(name) = self.cause.and_then(Cause::contract_name) {
            body["error"] = json!(name);
        }
        body
    }
}

/// The `{code, message, details}` body of an error answer, kept with the answer.
#[derive(Debug, Clone)]
pub(crate) struct ErrorBody(pub(crate) Value);

impl IntoResponse for ApiError {
    fn into_response(mut self) -> Response {
        // A refusal of the request as sent (4xx) applied nothing, whichever route gave it.
        if self.status.is_client_error() && !self.details.contains_key("status") {
            self.details.insert("status".into(), json!("rejected"));
        }
        let body = self.body();
        let mut response = (self.status, axum::Json(&body)).into_response();
        // The body as a value too, for a router whose protocol adds its own error shape
        // (the Iceberg routes): it extends this rather than parsing what was rendered.
        response.extensions_mut().insert(ErrorBody(body));
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

fn internal(message: String) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal_server_error",
        message,
    )
}

/// The one table from an error's kind to its status and code (see [`crate::error`]).
pub(crate) fn status_and_code(kind: Kind) -> (StatusCode, &'static str) {
    match kind {
        Kind::Invalid => (StatusCode::BAD_REQUEST, "bad_request"),
        Kind::Syntax => (StatusCode::BAD_REQUEST, "syntax_error"),
        Kind::Unsupported => (StatusCode::BAD_REQUEST, "unsupported_statement"),
        Kind::TooComplex => (StatusCode::BAD_REQUEST, "statement_too_complex"),
        Kind::QueryFailed => (StatusCode::BAD_REQUEST, "query_error"),
        Kind::InvalidRows => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_schema"),
        Kind::ResourcesExhausted => (StatusCode::UNPROCESSABLE_ENTITY, "resources_exhausted"),
        Kind::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
        Kind::ResultTooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "result_too_large"),
        Kind::UnsupportedMedia => (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type"),
        Kind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
        Kind::Gone => (StatusCode::GONE, "gone"),
        Kind::Conflict => (StatusCode::CONFLICT, "conflict"),
        Kind::PreconditionFailed => (StatusCode::PRECONDITION_FAILED, "precondition_failed"),
        Kind::StaleEpoch => (StatusCode::FORBIDDEN, "stale_epoch"),
        Kind::OutOfRange => (StatusCode::RANGE_NOT_SATISFIABLE, "offset_beyond_tail"),
        Kind::TooMany => (StatusCode::TOO_MANY_REQUESTS, "too_many_requests"),
        Kind::Timeout => (StatusCode::REQUEST_TIMEOUT, "statement_timeout"),
        Kind::Cancelled => (
            StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            "cancelled",
        ),
        Kind::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable"),
        Kind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal_server_error"),
    }
}

/// The details every classified answer carries: `status` (`rejected` or `unknown`),
/// `retry_after_seconds` when the same request may succeed later, and `cause` when a refusal
/// that applied nothing has one.
pub(crate) fn class_details(class: &ErrorClass) -> Map<String, Value> {
    let mut details = Map::new();
    details.insert(
        "status".into(),
        json!(match class.applied {
            Applied::Rejected => "rejected",
            Applied::Unknown => "unknown",
        }),
    );
    if let Some(seconds) = class.retry_after {
        details.insert("retry_after_seconds".into(), json!(seconds));
    }
    if let Some(cause) = not_applied_cause(class) {
        details.insert("cause".into(), json!(cause.name()));
    }
    details
}

/// The cause a refusal names: only one that applied nothing names one.
fn not_applied_cause(class: &ErrorClass) -> Option<Cause> {
    match class.applied {
        Applied::Rejected => class.cause,
        Applied::Unknown => None,
    }
}

impl ApiError {
    /// The answer to an error of this class: its status and code from the one table, its
    /// details, `Retry-After`, and the cause of a refusal that applied nothing in
    /// [`NOT_APPLIED`] and, with the contract's name, [`CONTRACT_NOT_APPLIED`] and `error`.
    pub(crate) fn classified(class: ErrorClass, message: String) -> ApiError {
        let (status, code) = status_and_code(class.kind);
        let mut error = ApiError::new(status, code, message);
        error.details = class_details(&class);
        error.retry_after_seconds = class.retry_after;
        if let Some(cause) = not_applied_cause(&class) {
            error = error.header(NOT_APPLIED, cause.name());
            if let Some(name) = cause.contract_name() {
                error = error.header(CONTRACT_NOT_APPLIED, name);
            }
            error.cause = Some(cause);
        }
        error
    }

    /// The answer to a classified error.
    pub(crate) fn of<E: Classify + std::fmt::Display>(e: &E) -> ApiError {
        ApiError::classified(e.class(), e.to_string())
    }
}

impl From<CatalogError> for ApiError {
    fn from(e: CatalogError) -> Self {
        ApiError::of(&e)
    }
}

impl ApiError {
    /// Adds which rows failed and why, when `e` is about invalid rows.
    fn with_rows(mut self, e: &IngestError) -> Self {
        if let IngestError::InvalidRows(rows) = e {
            self.message = "input does not match the table schema".into();
            let row_errors: Vec<Value> = rows
                .errors
                .iter()
                .map(
                    |r| json!({"row_index": r.row_index, "column": r.column, "message": r.message}),
                )
                .collect();
            self.details
                .insert("row_errors".into(), Value::Array(row_errors));
            self.details
                .insert("row_errors_truncated".into(), json!(rows.truncated));
        }
        self
    }
}

impl From<&IngestFailure> for ApiError {
    fn from(e: &IngestFailure) -> Self {
        match e {
            IngestFailure::Input(input) => ApiError::of(e).with_rows(input),
            _ => ApiError::of(e),
        }
    }
}

impl From<IngestFailure> for ApiError {
    fn from(e: IngestFailure) -> Self {
        ApiError::from(&e)
    }
}

/// A statement's failure, as its own answer or inside a statement's payload: an `INSERT`'s
/// rows failing answer as ingest's do.
impl From<&QueryError> for ApiError {
    fn from(e: &QueryError) -> Self {
        match e {
            QueryError::Write(failure) => ApiError::from(failure),
            QueryError::Rows(input) => ApiError::of(e).with_rows(input),
            _ => ApiError::of(e),
        }
    }
}

impl From<QueryError> for ApiError {
    fn from(e: QueryError) -> Self {
        ApiError::from(&e)
    }
}

/// The framework's own error answers (an extractor's rejection of a path, query or body; a
/// method a route does not serve) arrive as plain text or empty. This middleware gives them
/// the `{code, message, details}` body every other error has, keeping their status and
/// headers (such as `Allow`).
pub(super) async fn uniform_errors(head: bool, response: Response) -> Response {
    let status = response.status();
    let plain = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_none_or(|t| t.as_bytes().starts_with(b"text/plain"));
    if head || !plain || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (parts, body) = response.into_parts();
    // The framework's messages are a line; more is not a message.
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let code = match status {
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        s if s.is_server_error() => "internal_server_error",
        _ => "bad_request",
    };
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_lowercase()
    } else {
        text
    };
    let mut answer = ApiError::new(status, code, message).into_response();
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            answer.headers_mut().insert(name.clone(), value.clone());
        }
    }
    answer
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderMap;

    use super::*;

    /// The answer's headers and body, as a client sees them.
    async fn rendered(class: ErrorClass) -> (StatusCode, HeaderMap, Value) {
        let response = ApiError::classified(class, "why".into()).into_response();
        let (parts, body) = response.into_parts();
        let body = axum::body::to_bytes(body, 4096).await.expect("body");
        let body: Value = serde_json::from_slice(&body).expect("JSON body");
        (parts.status, parts.headers, body)
    }

    /// A refusal that applied nothing names its cause in sluice's header and the body's
    /// details, and, where the stream Append contract has a name for it, in the contract's
    /// header and the body's `error`.
    #[tokio::test]
    async fn a_refusal_names_its_cause_in_both_vocabularies() {
        let (status, headers, body) = rendered(ErrorClass::retry(Cause::LogDiskPressure)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(headers[NOT_APPLIED], "LogDiskPressure");
        assert_eq!(headers[CONTRACT_NOT_APPLIED], "WalDiskPressure");
        assert_eq!(headers[header::RETRY_AFTER], "1");
        assert_eq!(body["error"], "WalDiskPressure");
        assert_eq!(
            body["details"],
            json!({"status": "rejected", "retry_after_seconds": 1, "cause": "LogDiskPressure"})
        );
        for (cause, contract) in [
            (Cause::BodyAdmission, "IngressBodyBytesLimitReached"),
            (Cause::OwnerUnavailable, "GroupNotHosted"),
            (Cause::ShuttingDown, "NotLeader"),
            (Cause::LeaseExpired, "NotLeader"),
            (Cause::Fenced, "NotLeader"),
            (Cause::OwnerMoved, "GroupNotHosted"),
        ] {
            let (_, headers, body) = rendered(ErrorClass::retry(cause)).await;
            assert_eq!(headers[NOT_APPLIED], cause.name());
            assert_eq!(headers[CONTRACT_NOT_APPLIED], contract);
            assert_eq!(body["error"], contract);
        }
    }

    /// A cause the contract has no name for is named in sluice's vocabulary only; an answer
    /// whose request may have been applied names no cause at all.
    #[tokio::test]
    async fn only_a_refusal_that_applied_nothing_names_a_cause() {
        let (_, headers, body) = rendered(ErrorClass::retry(Cause::EarlierWriteFailed)).await;
        assert_eq!(headers[NOT_APPLIED], "EarlierWriteFailed");
        assert!(headers.get(CONTRACT_NOT_APPLIED).is_none());
        assert!(body.get("error").is_none(), "{body}");
        let maybe_applied = ErrorClass {
            applied: Applied::Unknown,
            ..ErrorClass::retry(Cause::StorageUnavailable)
        };
        let (_, headers, body) = rendered(maybe_applied).await;
        assert!(headers.get(NOT_APPLIED).is_none());
        assert!(headers.get(CONTRACT_NOT_APPLIED).is_none());
        assert!(body.get("error").is_none(), "{body}");
        assert!(body["details"].get("cause").is_none(), "{body}");
        assert_eq!(body["details"]["status"], "unknown");
    }
}
