//! The HTTP API: routes, authentication and request ids. Each API is a module that maps
//! requests to the database's typed calls and errors to answers.

mod catalog;
mod console;
mod deadline;
mod error;
mod ingest;
mod listener;
mod serve;
mod statements;
mod streams;
mod subscriptions;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use subtle::ConstantTimeEq as _;

use crate::db::Database;
use crate::metrics::{Metrics, RequestLabels, RouteLabels};
use crate::query::statements::Statements;
pub(crate) use error::ApiError;
pub use listener::{LimitedListener, LimitedStream};
pub use serve::serve;

/// Shared state of the HTTP handlers.
#[derive(Debug, Clone)]
pub struct AppState {
    db: Arc<Database>,
    statements: Arc<Statements>,
    api_keys: Arc<Vec<ApiKey>>,
    long_poll_timeout: Duration,
    body_timeout: Duration,
    metrics: Arc<Metrics>,
    subscriptions: Option<Arc<subscriptions::Subscriptions>>,
}

impl AppState {
    /// State over an open database; with no keys, requests are not authenticated.
    pub fn new(db: Arc<Database>, api_keys: Vec<String>) -> Self {
        AppState {
            metrics: Arc::new(Metrics::new(&db)),
            subscriptions: subscriptions::Subscriptions::new(db.streams().clone()),
            db,
            statements: Arc::new(Statements::default()),
            api_keys: Arc::new(api_keys.iter().map(|k| parse_key(k)).collect()),
            long_poll_timeout: crate::config::DEFAULT_LONG_POLL_TIMEOUT,
            body_timeout: crate::config::DEFAULT_BODY_TIMEOUT,
        }
    }

    /// Sets how long a request body may take to arrive before the request answers 408.
    pub fn with_body_timeout(mut self, timeout: Duration) -> Self {
        self.body_timeout = timeout;
        self
    }

    /// Sets how long a stream long-poll read waits for data before answering 204.
    pub fn with_long_poll_timeout(mut self, timeout: Duration) -> Self {
        self.long_poll_timeout = timeout;
        self
    }
}

/// Largest JSON request body (statements, catalog definitions), after decompression.
const MAX_JSON_BODY_BYTES: usize = 16 << 20;

/// Reads a JSON request body, undoing its `Content-Encoding` (clients compress statements and
/// catalog definitions too), within [`MAX_JSON_BODY_BYTES`].
pub(crate) async fn read_json<T: serde::de::DeserializeOwned>(
    headers: &axum::http::HeaderMap,
    body: axum::body::Body,
    expected: &str,
) -> Result<T, ApiError> {
    let encoding = ingest::encoding(headers)?;
    let raw = ingest::read_body(body, MAX_JSON_BODY_BYTES).await?;
    let plain = crate::ingest::decompress(&raw, encoding, MAX_JSON_BODY_BYTES)
        .map_err(|e| ApiError::from(crate::db::IngestFailure::Input(e)))?;
    serde_json::from_slice(&plain)
        .map_err(|e| ApiError::bad_request(format!("request body must be {expected}: {e}")))
}

/// What a key may do; each role includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Read the catalog, query, read streams.
    Read,
    /// Also ingest rows and create and append to streams.
    Write,
    /// Also change the catalog (create, replace, drop) and delete streams.
    Admin,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Read => "read",
            Role::Write => "write",
            Role::Admin => "admin",
        }
    }
}

/// A configured key: `read=KEY`, `write=KEY`, `admin=KEY`, or a bare `KEY` (admin).
#[derive(Clone)]
struct ApiKey {
    role: Role,
    key: String,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Keys never reach a log, even through Debug.
        write!(f, "ApiKey({}, <masked>)", self.role.name())
    }
}

fn parse_key(spec: &str) -> ApiKey {
    for (prefix, role) in [
        ("read=", Role::Read),
        ("write=", Role::Write),
        ("admin=", Role::Admin),
    ] {
        if let Some(key) = spec.strip_prefix(prefix) {
            return ApiKey {
                role,
                key: key.to_owned(),
            };
        }
    }
    ApiKey {
        role: Role::Admin,
        key: spec.to_owned(),
    }
}

/// The role of a presented key: every configured key is compared in constant time, without
/// stopping at a match.
fn key_role(keys: &[ApiKey], presented: &str) -> Option<Role> {
    keys.iter().fold(None, |found, k| {
        let equal = k.key.len() == presented.len()
            && bool::from(k.key.as_bytes().ct_eq(presented.as_bytes()));
        if equal { Some(k.role) } else { found }
    })
}

/// The least role a request needs, by method and route. Statements are checked again by
/// what they do (see [`statements`]).
fn required_role(method: &axum::http::Method, route: &str) -> Role {
    use axum::http::Method;
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return Role::Read;
    }
    if route.starts_with("/v1/statements") {
        return Role::Read;
    }
    if route.ends_with("/ingest") {
        return Role::Write;
    }
    if route.starts_with("/v1/catalog") || *method == Method::DELETE {
        return Role::Admin;
    }
    // Stream (and bucket) creates and appends.
    Role::Write
}

async fn authenticate(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    // Without keys there is no authentication (the server then listens on loopback only).
    let mut role = Role::Admin;
    // CORS preflights carry no credentials by design; they reveal nothing.
    if !state.api_keys.is_empty() && request.method() != axum::http::Method::OPTIONS {
        let presented = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        role = match presented.and_then(|key| key_role(&state.api_keys, key)) {
            Some(role) => role,
            None => return ApiError::unauthorized().into_response(),
        };
        let route = request
            .extensions()
            .get::<MatchedPath>()
            .map_or("", |p| p.as_str());
        let needed = required_role(request.method(), route);
        if role < needed {
            return ApiError::forbidden(role, needed).into_response();
        }
    }
    request.extensions_mut().insert(role);
    next.run(request).await
}

/// Gives every answer an `x-request-id` (the client's, or a new one), runs the request in a
/// span (method, route, request id), logs its answer (status, latency) and counts it.
async fn observe(State(state): State<AppState>, request: Request, next: Next) -> Response {
    use tracing::Instrument as _;
    let id = request
        .headers()
        .get("x-request-id")
        .filter(|v| v.len() <= 128 && v.to_str().is_ok())
        .cloned()
        .unwrap_or_else(|| {
            HeaderValue::from_str(&uuid::Uuid::new_v4().simple().to_string())
                .unwrap_or(HeaderValue::from_static("0"))
        });
    let method = request.method().as_str().to_owned();
    // The route template, never the raw path: names in paths would explode the label space.
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_owned();
    let span = tracing::info_span!(
        "request",
        method = %method,
        route = %route,
        request_id = id.to_str().unwrap_or(""),
    );
    let started = std::time::Instant::now();
    let mut response = next.run(request).instrument(span.clone()).await;
    let elapsed = started.elapsed();
    let status = response.status().as_u16();
    let latency_ms = elapsed.as_secs_f64() * 1e3;
    // Every answer at debug (the default `info` filter keeps busy servers quiet); server
    // errors always.
    span.in_scope(|| {
        if status >= 500 {
            tracing::warn!(status, latency_ms, "answered");
        } else {
            tracing::debug!(status, latency_ms, "answered");
        }
    });
    state
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            method: method.clone(),
            route: route.clone(),
            status,
        })
        .inc();
    state
        .metrics
        .request_seconds
        .get_or_create(&RouteLabels { method, route })
        .observe(elapsed.as_secs_f64());
    response.headers_mut().insert("x-request-id", id);
    response
}

/// The OpenAPI document of this API (`schema/openapi.json`), served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../../schema/openapi.json");

/// Every route this router serves, as `(method, OpenAPI path template)`. `tests/openapi.rs`
/// checks it against both the router and the OpenAPI document, so neither can drift.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/v1/health"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/"),
    ("GET", "/console.js"),
    ("GET", "/console.css"),
    ("GET", "/v1/catalog"),
    ("PUT", "/v1/catalog"),
    ("GET", "/v1/catalog/databases/{db}"),
    ("PUT", "/v1/catalog/databases/{db}"),
    ("DELETE", "/v1/catalog/databases/{db}"),
    ("GET", "/v1/catalog/databases/{db}/schemas/{schema}"),
    ("PUT", "/v1/catalog/databases/{db}/schemas/{schema}"),
    ("DELETE", "/v1/catalog/databases/{db}/schemas/{schema}"),
    (
        "GET",
        "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}",
    ),
    (
        "PUT",
        "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}",
    ),
    (
        "DELETE",
        "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}",
    ),
    (
        "POST",
        "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/ingest",
    ),
    (
        "GET",
        "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/stats",
    ),
    ("POST", "/v1/ingest"),
    ("POST", "/v1/statements"),
    ("GET", "/v1/statements/{id}"),
    ("POST", "/v1/statements/{id}/cancel"),
    ("GET", "/v1/streams"),
    ("PUT", "/v1/stream/{name}"),
    ("POST", "/v1/stream/{name}"),
    ("GET", "/v1/stream/{name}"),
    ("HEAD", "/v1/stream/{name}"),
    ("DELETE", "/v1/stream/{name}"),
    ("OPTIONS", "/v1/stream/{name}"),
    ("PUT", "/{bucket}"),
    ("OPTIONS", "/{bucket}"),
    ("PUT", "/{bucket}/{stream}"),
    ("POST", "/{bucket}/{stream}"),
    ("GET", "/{bucket}/{stream}"),
    ("HEAD", "/{bucket}/{stream}"),
    ("DELETE", "/{bucket}/{stream}"),
    ("OPTIONS", "/{bucket}/{stream}"),
];

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
        .into_response()
}

async fn health() -> impl IntoResponse {
    axum::Json(serde_json::json!({"status": "ok"}))
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint")
}

/// The router of the whole API.
pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/catalog", get(catalog::get_root).put(catalog::put_root))
        .route(
            "/v1/catalog/databases/{db}",
            get(catalog::get_database)
                .put(catalog::put_database)
                .delete(catalog::delete_database),
        )
        .route(
            "/v1/catalog/databases/{db}/schemas/{schema}",
            get(catalog::get_schema)
                .put(catalog::put_schema)
                .delete(catalog::delete_schema),
        )
        .route(
            "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}",
            get(catalog::get_table)
                .put(catalog::put_table)
                .delete(catalog::delete_table),
        )
        .route(
            "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/ingest",
            post(ingest::ingest_table),
        )
        .route("/v1/ingest", post(ingest::ingest_statement))
        .route("/v1/statements", post(statements::submit))
        .route("/v1/statements/{id}", get(statements::fetch))
        .route("/v1/statements/{id}/cancel", post(statements::cancel))
        .route(
            "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/stats",
            get(catalog::get_table_stats),
        )
        .route("/v1/streams", get(streams::list))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    let streams = Router::new()
        .route(
            "/v1/stream/{*name}",
            put(streams::put_protocol)
                .post(streams::post_protocol)
                .get(streams::get_protocol)
                .head(streams::head_protocol)
                .delete(streams::delete_protocol)
                .options(async || ()),
        )
        .route("/{bucket}", put(streams::put_bucket).options(async || ()))
        .route(
            "/{bucket}/{stream}",
            put(streams::put_bucket_stream)
                .post(streams::post_bucket_stream)
                .get(streams::get_bucket_stream)
                .head(streams::head_bucket_stream)
                .delete(streams::delete_bucket_stream)
                .options(async || ()),
        )
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .route_layer(middleware::from_fn(streams::stream_headers));
    Router::new()
        .route("/v1/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .route("/", get(console::index))
        .route("/console.js", get(console::script))
        .route("/console.css", get(console::style))
        .merge(api)
        .merge(streams)
        .fallback(not_found)
        // Bodies are read with the ingest limits in the handlers, which answer 413 themselves.
        .layer(DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(
            state.clone(),
            deadline::body_deadline,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// Whether an address is loopback (where an unauthenticated server may listen).
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}
