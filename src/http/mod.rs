//! The HTTP API: routes, authentication and request ids. Each API is a module that maps
//! requests to the database's typed calls and errors to answers.

mod body;
mod catalog;
mod console;
mod deadline;
mod error;
mod forward;
mod held;
mod iceberg;
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
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq as _;

use crate::db::Database;
use crate::metrics::{Metrics, RequestLabels, RouteLabels};
use crate::query::statements::{Owner, StatementLimits, Statements};
pub(crate) use error::ApiError;
pub use listener::{ConnectionLimits, LimitedListener, LimitedStream};
pub use serve::serve;
pub use streams::format_offset;

/// Default pace a request body must keep up after its first seconds, in bytes per second.
pub(crate) const DEFAULT_MIN_BODY_RATE: u64 = 1024;

/// Default time a request body may take to arrive.
pub(crate) const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(120);

/// Default long-poll wait.
pub(crate) const DEFAULT_LONG_POLL_TIMEOUT: Duration = Duration::from_secs(30);

/// Which requests a browser may make, and which names the server answers to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BrowserPolicy {
    /// `Host` names (besides loopback addresses, `localhost` and the listen address) the
    /// server answers to. Without API keys, any other `Host` is refused, so that a web page
    /// cannot reach the server through DNS rebinding; with keys, only when this is set.
    pub allowed_hosts: Vec<String>,
    /// Origins (`https://app.example.com`, or `*`) whose pages may call the API: their
    /// requests get CORS answers. Writes from any other origin are refused.
    pub cors_origins: Vec<String>,
    /// The address the server listens on (its literal is always an allowed `Host`).
    pub listen: Option<SocketAddr>,
}

/// Shared state of the HTTP handlers: one pointer, so that the per-request copies every layer
/// and handler takes cost one reference count, not one per field.
#[derive(Debug, Clone)]
pub struct AppState(Arc<Shared>);

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What [`AppState`] points to.
#[derive(Debug, Clone)]
pub struct Shared {
    db: Arc<Database>,
    statements: Arc<Statements>,
    api_keys: Arc<Vec<ApiKey>>,
    long_poll_timeout: Duration,
    body_timeout: Duration,
    /// Bytes per second a request body must keep up (0: no pace; see [`deadline`]).
    min_body_rate: u64,
    metrics: Arc<Metrics>,
    browser: Arc<BrowserPolicy>,
    /// The owner of every request when no keys are configured.
    local_owner: Owner,
    /// Sends stream requests to the peer that serves the stream ([`forward`]).
    forward_client: reqwest::Client,
    /// What results with large cells may take in rendered pieces at once.
    render_budget: statements::RenderBudget,
    /// What stream read answers not yet written may hold at once.
    read_budget: held::AnswerBudget,
}

impl AppState {
    /// State over an open database; with no keys, requests are not authenticated.
    pub fn new(db: Arc<Database>, api_keys: Vec<String>) -> Self {
        AppState(Arc::new(Shared {
            render_budget: statements::RenderBudget::new(db.max_result_bytes()),
            read_budget: held::AnswerBudget::new(streams::READ_ANSWER_BYTES),
            metrics: Arc::new(Metrics::new(&db)),
            db,
            statements: Arc::new(Statements::new(StatementLimits::default())),
            api_keys: Arc::new(api_keys.iter().map(|k| parse_key(k)).collect()),
            long_poll_timeout: DEFAULT_LONG_POLL_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            min_body_rate: DEFAULT_MIN_BODY_RATE,
            browser: Arc::new(BrowserPolicy::default()),
            local_owner: Arc::from(crate::subscriptions::LEGACY_OWNER),
            forward_client: forward::client(),
        }))
    }

    /// The state to change while the server is being set up (copied if already shared).
    fn setup(&mut self) -> &mut Shared {
        Arc::make_mut(&mut self.0)
    }

    /// Sets which hosts and origins browsers may use (see [`BrowserPolicy`]).
    pub fn with_browser_policy(mut self, policy: BrowserPolicy) -> Self {
        self.setup().browser = Arc::new(policy);
        self
    }

    /// Sets the bounds on running and kept statements.
    pub fn with_statement_limits(mut self, limits: StatementLimits) -> Self {
        self.setup().statements = Arc::new(Statements::new(limits));
        self
    }

    /// Sets how long a request body may take to arrive before the request answers 408.
    pub fn with_body_timeout(mut self, timeout: Duration) -> Self {
        self.setup().body_timeout = timeout;
        self
    }

    /// Sets the pace a request body must keep up, in bytes per second after its first
    /// seconds (0: none), before the request answers 408 (see [`deadline`]).
    pub fn with_min_body_rate(mut self, bytes_per_second: u64) -> Self {
        self.setup().min_body_rate = bytes_per_second;
        self
    }

    /// Sets how long a stream long-poll read waits for data before answering 204.
    pub fn with_long_poll_timeout(mut self, timeout: Duration) -> Self {
        self.setup().long_poll_timeout = timeout;
        self
    }
}

/// Largest JSON request body (statements, catalog definitions), after decompression.
const MAX_JSON_BODY_BYTES: usize = 16 << 20;

/// Whether a request says its body is JSON (`application/json` or a `+json` type). JSON
/// endpoints require it: a browser can send `text/plain` (or no type) from any page without
/// asking the server first, but not `application/json`.
pub(crate) fn is_json_request(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// The answer to a JSON endpoint's request whose body is not declared JSON.
pub(crate) fn not_json() -> ApiError {
    ApiError::new(
        axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        "send the body as Content-Type: application/json",
    )
    .outcome(error::Outcome::Rejected)
}

/// Reads a JSON request body, undoing its `Content-Encoding` (clients compress statements and
/// catalog definitions too), within [`MAX_JSON_BODY_BYTES`] and the request-body budget
/// (held while the body is read, decoded and parsed), under the share of `owner` (the
/// request's key, [`body_owner`]) where it has one.
pub(crate) async fn read_json<T: serde::de::DeserializeOwned>(
    state: &AppState,
    owner: Option<&Owner>,
    headers: &axum::http::HeaderMap,
    body: axum::body::Body,
    expected: &str,
) -> Result<T, ApiError> {
    if !is_json_request(headers) {
        return Err(not_json());
    }
    let encoding = ingest::encoding(headers)?;
    let mut reservation = state.db.body_reservation(owner);
    let raw = body::read_body(body, MAX_JSON_BODY_BYTES, &mut reservation).await?;
    let plain = body::decode_body(raw, encoding, MAX_JSON_BODY_BYTES, &mut reservation).await?;
    serde_json::from_slice(&plain)
        .map_err(|e| ApiError::bad_request(format!("request body must be {expected}: {e}")))
}

/// What a key may do; each role includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Role {
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

/// Who made a request: the role of its key, and the subject its statements and
/// subscriptions belong to.
#[derive(Debug, Clone)]
pub(crate) struct Principal {
    pub(crate) role: Role,
    /// The key's subject ([`key_subject`]: derived from the key, the same across restarts
    /// and reorderings of the configuration, never the key itself), or `local` without
    /// keys. Empty for a request no key authenticated (a wake callback, which its handler
    /// authorizes by the wake's token).
    pub(crate) owner: Owner,
}

/// The subject of a key: `key-` and 16 hex digits of PBKDF2-HMAC-SHA256 of the key (a fixed
/// salt, 10,000 rounds). Subscriptions store it as their owner, so it must not change while
/// the key does not, and must not give the key away to someone who reads the bucket.
fn key_subject(key: &str) -> Owner {
    let mut digest = [0u8; 8];
    ring::pbkdf2::derive(
        ring::pbkdf2::PBKDF2_HMAC_SHA256,
        std::num::NonZeroU32::MIN.saturating_add(9_999),
        b"sluice key subject",
        key.as_bytes(),
        &mut digest,
    );
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    Arc::from(format!("key-{hex}"))
}

/// The owner whose share of the request-body budget a request's body counts against: its
/// key's name when keys are configured (so one key cannot take the whole budget), none
/// without keys (one trusted local user).
pub(crate) fn body_owner<'a>(state: &AppState, principal: &'a Principal) -> Option<&'a Owner> {
    (!state.api_keys.is_empty()).then_some(&principal.owner)
}

/// A configured key: `read=KEY`, `write=KEY`, `admin=KEY`, or a bare `KEY` (admin).
#[derive(Clone)]
struct ApiKey {
    role: Role,
    key: String,
    owner: Owner,
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
                owner: key_subject(key),
            };
        }
    }
    ApiKey {
        role: Role::Admin,
        key: spec.to_owned(),
        owner: key_subject(spec),
    }
}

/// The principal of a presented key: every configured key is compared in constant time,
/// without stopping at a match.
fn key_principal(keys: &[ApiKey], presented: &str) -> Option<Principal> {
    keys.iter().fold(None, |found, k| {
        let equal = k.key.len() == presented.len()
            && bool::from(k.key.as_bytes().ct_eq(presented.as_bytes()));
        if equal {
            Some(Principal {
                role: k.role,
                owner: k.owner.clone(),
            })
        } else {
            found
        }
    })
}

/// The least role a request needs, by method and route (and path, for the reserved
/// subscription APIs, which share the stream routes). Statements are checked again by what
/// they do (see [`statements`]); subscriptions by whose they are.
fn required_role(method: &axum::http::Method, route: &str, path: &str) -> Role {
    use axum::http::Method;
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return Role::Read;
    }
    if subscriptions::is_reserved_path(path) {
        // A subscription's owner deletes it; other keys see none of it.
        return Role::Write;
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

async fn authenticate(state: &AppState, mut request: Request, next: Next) -> Response {
    // Without keys there is no authentication (the server then listens on loopback only,
    // and [`browser_refusal`] keeps web pages out).
    let mut principal = Principal {
        role: Role::Admin,
        owner: state.local_owner.clone(),
    };
    // CORS preflights carry no credentials by design; they reveal nothing. Wake callbacks
    // (a webhook consumer's ack, a worker's ack or release) are authorized by the wake's own
    // token, which their handler checks; a consumer need not hold an API key. The webhook
    // signing keys (`jwks.json`) are public keys, for consumers without a key too.
    let exempt = request.method() == axum::http::Method::OPTIONS
        || (request.method() == axum::http::Method::POST
            && subscriptions::is_wake_callback(request.uri().path()))
        || subscriptions::is_public_keys(request.method(), request.uri().path());
    if !state.api_keys.is_empty() && exempt {
        // Authenticated by nothing: the least role, and a subject that owns nothing.
        principal = Principal {
            role: Role::Read,
            owner: Arc::from(""),
        };
    } else if !state.api_keys.is_empty() {
        let presented = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        principal = match presented.and_then(|key| key_principal(&state.api_keys, key)) {
            Some(p) => p,
            None => return ApiError::unauthorized().into_response(),
        };
        let route = request
            .extensions()
            .get::<MatchedPath>()
            .map_or("", |p| p.as_str());
        let needed = required_role(request.method(), route, request.uri().path());
        if principal.role < needed {
            return ApiError::forbidden(principal.role, needed).into_response();
        }
    }
    request.extensions_mut().insert(principal.role);
    request.extensions_mut().insert(principal);
    next.run(request).await
}

/// The host part of a `Host` header value (without port; IPv6 without brackets), lowercased.
fn host_name(value: &str) -> String {
    let value = value.trim();
    let host = if let Some(rest) = value.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        value.rsplit_once(':').map_or(value, |(h, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                value
            }
        })
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// Whether the server answers to this `Host`: loopback addresses, `localhost` (and names
/// under it), the listen address and configured names.
fn host_allowed(policy: &BrowserPolicy, value: &str) -> bool {
    let host = host_name(value);
    if host == "localhost" || host.ends_with(".localhost") {
        return true;
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>()
        && (ip.is_loopback() || policy.listen.is_some_and(|l| l.ip() == ip))
    {
        return true;
    }
    policy
        .allowed_hosts
        .iter()
        .any(|h| h.eq_ignore_ascii_case(&host))
}

/// Whether pages of `origin` may call the API cross-origin (the CORS setting).
pub(crate) fn origin_allowed(policy: &BrowserPolicy, origin: &str) -> bool {
    policy
        .cors_origins
        .iter()
        .any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
}

/// The host names a request is addressed to: every `Host` header, and the authority of an
/// absolute-form request target (`GET http://name/path`). A request is judged by all of
/// them, never by the first alone.
fn addressed_hosts(request: &Request) -> impl Iterator<Item = &str> {
    request
        .headers()
        .get_all(header::HOST)
        .iter()
        .map(|v| v.to_str().unwrap_or("\u{fffd}"))
        .chain(request.uri().authority().map(|a| a.as_str()))
}

/// The refusal (400) of a request that carries more than one `Host` header: HTTP/1.1 asks
/// servers to refuse it (RFC 9112, 3.2), and two hosts cannot both be the one it is for.
fn host_refusal(request: &Request) -> Option<Response> {
    (request.headers().get_all(header::HOST).iter().count() > 1).then(|| {
        ApiError::bad_request("the request carries more than one Host header")
            .outcome(error::Outcome::Rejected)
            .into_response()
    })
}

/// Keeps web pages from driving the server: refuses requests addressed to a host name it does
/// not serve (DNS rebinding; checked without keys, or whenever names are configured), and
/// writes sent by a page of another origin that the CORS setting does not allow (a page can
/// send a form or a `no-cors` request anywhere; browsers name its origin in `Origin`).
fn browser_refusal(state: &AppState, request: &Request) -> Option<Response> {
    let policy = &state.browser;
    let headers = request.headers();
    let health = request.uri().path() == "/v1/health";
    if (state.api_keys.is_empty() || !policy.allowed_hosts.is_empty())
        && !health
        && let Some(host) = addressed_hosts(request).find(|host| !host_allowed(policy, host))
    {
        return Some(
            ApiError::new(
                axum::http::StatusCode::MISDIRECTED_REQUEST,
                "host_not_allowed",
                format!(
                    "this server does not answer to host {:?}; add it to allowed_hosts",
                    host_name(host)
                ),
            )
            .outcome(error::Outcome::Rejected)
            .into_response(),
        );
    }
    let safe = matches!(
        *request.method(),
        axum::http::Method::GET | axum::http::Method::HEAD | axum::http::Method::OPTIONS
    );
    if !safe && let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("null");
        let same = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .is_some_and(|host| {
                origin.eq_ignore_ascii_case(&format!("http://{host}"))
                    || origin.eq_ignore_ascii_case(&format!("https://{host}"))
            });
        if !same && !origin_allowed(policy, origin) {
            return Some(ApiError::new(
                    axum::http::StatusCode::FORBIDDEN,
                    "origin_not_allowed",
                    format!(
                        "requests from pages of {origin:?} are not allowed; add the origin to cors_origins"
                    ),
                )
                .outcome(error::Outcome::Rejected)
                .into_response());
        }
    }
    None
}

/// A metric label for a method: the standard ones by name, everything else as `OTHER`, so
/// that made-up methods cannot create series.
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        _ => "OTHER",
    }
}

/// A new request id: 32 hex digits, a random prefix chosen once per process and a counter.
/// Unique within the process and, by the prefix, across processes in practice; and made
/// without a system call (a random UUID per request is a `getrandom` call each).
fn new_request_id() -> HeaderValue {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static PREFIX: OnceLock<u64> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let prefix = *PREFIX.get_or_init(|| uuid::Uuid::new_v4().as_u64_pair().0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let value = (u128::from(prefix) << 64) | u128::from(count);
    let mut digits = [0u8; 32];
    for (i, d) in digits.iter_mut().enumerate() {
        let nibble = (value >> (124 - 4 * i)) as u8 & 0xf;
        *d = b"0123456789abcdef"[usize::from(nibble)];
    }
    HeaderValue::from_bytes(&digits).unwrap_or(HeaderValue::from_static("0"))
}

/// The `'static` name of a route template the router serves (`"unmatched"` for anything
/// else), so that metric labels are neither allocated per request nor made from client input.
fn route_label(route: Option<&MatchedPath>) -> &'static str {
    use std::collections::HashSet;
    use std::sync::OnceLock;
    static ROUTES: OnceLock<HashSet<&'static str>> = OnceLock::new();
    let Some(route) = route else {
        return "unmatched";
    };
    let known = ROUTES.get_or_init(|| {
        [open_routes(), api_routes(), stream_routes()]
            .into_iter()
            .flat_map(|r| r.table.into_iter().map(|(_, path)| path))
            .collect()
    });
    known.get(route.as_str()).copied().unwrap_or("unmatched")
}

/// What every request goes through, once, around the routes: an `x-request-id` (the
/// client's, or a new one); a span (method, request id; the route once known); the browser
/// checks ([`browser_refusal`]); the header limit ([`deadline::headers_refusal`]) and the
/// body deadline ([`deadline::body_deadline`]); the routes; the one error body for the framework's own
/// rejections ([`error::uniform_errors`]); then its answer logged (status, latency) and
/// counted.
///
/// This runs as the outer router's only handler, not as layers on every route: axum clones a
/// route's whole layer stack for each request it serves, and boxes each layer's future.
async fn edge(state: AppState, routes: Router, request: Request) -> Response {
    use tower_service::Service as _;
    use tracing::Instrument as _;
    let id = request
        .headers()
        .get("x-request-id")
        .filter(|v| v.len() <= 128 && v.to_str().is_ok())
        .cloned()
        .unwrap_or_else(new_request_id);
    let method = method_label(request.method());
    let span = tracing::info_span!(
        "request",
        method,
        route = tracing::field::Empty,
        request_id = id.to_str().unwrap_or(""),
    );
    let started = std::time::Instant::now();
    let answer = async {
        if let Some(refusal) = host_refusal(&request)
            .or_else(|| browser_refusal(&state, &request))
            .or_else(|| deadline::headers_refusal(&request))
        {
            return refusal;
        }
        let request = deadline::body_deadline(&state, request);
        let head = request.method() == axum::http::Method::HEAD;
        let under_iceberg = request.uri().path().starts_with("/iceberg/v1/");
        let mut routes = routes;
        let response = match routes.call(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
        let response = error::uniform_errors(head, response).await;
        // By the route that answered (a stream bucket may be called `iceberg`); by the path
        // when none did (no such route or method under the catalog).
        let iceberg = match response.extensions().get::<MatchedPath>() {
            Some(route) => route.as_str().starts_with("/iceberg/"),
            None => under_iceberg,
        };
        if iceberg {
            iceberg::error_model(head, response)
        } else {
            response
        }
    };
    let mut response = answer.instrument(span.clone()).await;
    let elapsed = started.elapsed();
    let status = response.status().as_u16();
    // The route template ([`gate`] names it), never the raw path: names in paths would
    // explode the label space.
    let route = route_label(response.extensions().get::<MatchedPath>());
    span.record("route", route);
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
            method,
            route,
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

/// Which checks a group of routes needs from [`gate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    /// Health, metrics, the OpenAPI document, the console: no key.
    Open,
    /// The catalog, ingest and statements: a key with the route's role.
    Api,
    /// The streams: a key with the route's role, and the stream answers' headers
    /// ([`streams::stream_headers`]).
    Streams,
}

/// The one layer on the routes, run after routing: authenticates (by the matched route's
/// role) and names the matched route on the answer, for [`edge`]'s metrics and logs.
async fn gate(
    State((state, gate)): State<(AppState, Gate)>,
    request: Request,
    next: Next,
) -> Response {
    let matched = request.extensions().get::<MatchedPath>().cloned();
    let mut response = match gate {
        Gate::Open => next.run(request).await,
        Gate::Api => authenticate(&state, request, next).await,
        Gate::Streams => {
            streams::stream_headers(&state, request, async |request| {
                authenticate(&state, request, next).await
            })
            .await
        }
    };
    if let Some(matched) = matched {
        response.extensions_mut().insert(matched);
    }
    response
}

/// The OpenAPI document of this API (`schema/openapi.json`), served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../../schema/openapi.json");

/// A router under construction that records every `(method, path)` it is given: the route
/// list ([`routes`]) is the router's own, never a copy kept by hand.
struct Routes {
    router: Router<AppState>,
    table: Vec<(&'static str, &'static str)>,
}

impl Routes {
    fn new() -> Self {
        Routes {
            router: Router::new(),
            table: Vec::new(),
        }
    }

    /// Serves `path` with `handler` for `method` (one of GET, HEAD, PUT, POST, DELETE,
    /// OPTIONS).
    fn add<H, T>(mut self, method: &'static str, path: &'static str, handler: H) -> Self
    where
        H: axum::handler::Handler<T, AppState>,
        T: 'static,
    {
        let filter = match method {
            "GET" => axum::routing::MethodFilter::GET,
            "HEAD" => axum::routing::MethodFilter::HEAD,
            "PUT" => axum::routing::MethodFilter::PUT,
            "POST" => axum::routing::MethodFilter::POST,
            "DELETE" => axum::routing::MethodFilter::DELETE,
            _ => axum::routing::MethodFilter::OPTIONS,
        };
        self.table.push((method, path));
        self.router = self.router.route(path, axum::routing::on(filter, handler));
        self
    }

    /// The Iceberg catalog's namespace and table routes: `[namespaces, a namespace, its
    /// tables, a table]`, without or with the specification's prefix (which names the view:
    /// [`iceberg`]).
    fn iceberg(self, [namespaces, namespace, tables, table]: [&'static str; 4]) -> Self {
        self.add("GET", namespaces, iceberg::list_namespaces)
            .add("GET", namespace, iceberg::get_namespace)
            .add("HEAD", namespace, iceberg::head_namespace)
            .add("GET", tables, iceberg::list_tables)
            .add("GET", table, iceberg::load_table)
            .add("HEAD", table, iceberg::head_table)
    }

    /// The stream handlers, at one of the two URL layouts ([`streams::Target`] names the
    /// stream from either).
    fn streams(self, path: &'static str) -> Self {
        self.add("PUT", path, streams::put)
            .add("POST", path, streams::post)
            .add("GET", path, streams::get)
            .add("HEAD", path, streams::head_stream)
            .add("DELETE", path, streams::delete_stream)
            .add("OPTIONS", path, async || ())
    }
}

/// The authenticated API (catalog, ingest, statements, stream listing).
fn api_routes() -> Routes {
    let table = "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}";
    Routes::new()
        .add("GET", "/v1/catalog", catalog::get_root)
        .add("PUT", "/v1/catalog", catalog::put_root)
        .add("GET", "/v1/catalog/databases/{db}", catalog::get_database)
        .add("PUT", "/v1/catalog/databases/{db}", catalog::put_database)
        .add(
            "DELETE",
            "/v1/catalog/databases/{db}",
            catalog::delete_database,
        )
        .add(
            "GET",
            "/v1/catalog/databases/{db}/schemas/{schema}",
            catalog::get_schema,
        )
        .add(
            "PUT",
            "/v1/catalog/databases/{db}/schemas/{schema}",
            catalog::put_schema,
        )
        .add(
            "DELETE",
            "/v1/catalog/databases/{db}/schemas/{schema}",
            catalog::delete_schema,
        )
        .add("GET", table, catalog::get_table)
        .add("PUT", table, catalog::put_table)
        .add("DELETE", table, catalog::delete_table)
        .add(
            "POST",
            "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/ingest",
            ingest::ingest_table,
        )
        .add(
            "GET",
            "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/stats",
            catalog::get_table_stats,
        )
        .add("POST", "/v1/ingest", ingest::ingest_statement)
        .add("POST", "/v1/statements", statements::submit)
        .add("GET", "/v1/statements/{id}", statements::fetch)
        .add("POST", "/v1/statements/{id}/cancel", statements::cancel)
        .add("GET", "/v1/streams", streams::list)
        .add("GET", "/iceberg/v1/config", iceberg::config)
        .iceberg([
            "/iceberg/v1/namespaces",
            "/iceberg/v1/namespaces/{namespace}",
            "/iceberg/v1/namespaces/{namespace}/tables",
            "/iceberg/v1/namespaces/{namespace}/tables/{table}",
        ])
        .iceberg([
            "/iceberg/v1/{prefix}/namespaces",
            "/iceberg/v1/{prefix}/namespaces/{namespace}",
            "/iceberg/v1/{prefix}/namespaces/{namespace}/tables",
            "/iceberg/v1/{prefix}/namespaces/{namespace}/tables/{table}",
        ])
}

/// The streams, in both URL layouts.
fn stream_routes() -> Routes {
    Routes::new()
        .streams("/v1/stream/{*name}")
        .add("PUT", "/{bucket}", streams::put_bucket)
        .add("OPTIONS", "/{bucket}", async || ())
        .streams("/{bucket}/{stream}")
}

/// What needs no key: health, metrics, the OpenAPI document and the console.
fn open_routes() -> Routes {
    Routes::new()
        .add("GET", "/v1/health", health)
        .add("GET", "/metrics", metrics)
        .add("GET", "/openapi.json", openapi)
        .add("GET", "/", console::index)
        .add("GET", "/console.js", console::script)
        .add("GET", "/console.css", console::style)
}

/// Every route the router serves, as `(method, OpenAPI path template)`, from the router's
/// own construction. `tests/it/openapi.rs` checks the OpenAPI document against it.
pub fn routes() -> Vec<(&'static str, String)> {
    let mut all = open_routes().table;
    all.extend(api_routes().table);
    all.extend(stream_routes().table);
    // The router writes a catch-all parameter `{*name}`; OpenAPI writes `{name}`.
    all.into_iter()
        .map(|(method, path)| (method, path.replace("{*", "{")))
        .collect()
}

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

/// The router of the whole API: one edge handler around the routes.
pub fn router(state: AppState) -> Router {
    let gated = |routes: Routes, gate_kind: Gate| {
        routes.router.route_layer(middleware::from_fn_with_state(
            (state.clone(), gate_kind),
            gate,
        ))
    };
    let routes: Router = gated(open_routes(), Gate::Open)
        .merge(gated(api_routes(), Gate::Api))
        .merge(gated(stream_routes(), Gate::Streams))
        .fallback(not_found)
        .with_state(state.clone());
    // No handler reads its body through an extractor with axum's default body limit: bodies
    // are read with the ingest limits in the handlers, which answer 413 themselves.
    Router::new().fallback(move |request: Request| edge(state.clone(), routes.clone(), request))
}
