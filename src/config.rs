//! Server configuration: flags override environment variables (`SLUICE_*`), which override an
//! optional TOML file, which overrides the defaults.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::db::DbConfig;
use crate::http::{
    BrowserPolicy, DEFAULT_BODY_TIMEOUT, DEFAULT_LONG_POLL_TIMEOUT, DEFAULT_MIN_BODY_RATE,
};
use crate::ingest::Limits;
use crate::log::Durability;
use crate::query::statements::StatementLimits;

/// Why the configuration is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid.
    #[error("config file {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A value is not acceptable.
    #[error("invalid {name}: {message}")]
    Invalid {
        /// The setting.
        name: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// The TOML file's settings; every one optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Address to listen on.
    pub listen: Option<String>,
    /// Data directory (commit log, node id, and the default object store).
    pub data_dir: Option<PathBuf>,
    /// Object store URL.
    pub object_store: Option<String>,
    /// API keys.
    pub api_keys: Option<Vec<String>>,
    /// `fsync` (default) or `none` (unsafe).
    pub durability: Option<String>,
    /// Largest decompressed ingest body.
    pub max_body_bytes: Option<usize>,
    /// Most rows per ingest request.
    pub max_rows: Option<usize>,
    /// Commit log disk budget.
    pub max_log_bytes: Option<u64>,
    /// Flush a table past this many unflushed bytes.
    pub flush_bytes: Option<usize>,
    /// Flush a table whose oldest unflushed batch is this many seconds old.
    pub flush_interval_seconds: Option<f64>,
    /// Unflushed bytes held in memory over all tables; past it the oldest are spilled (see
    /// `max_spilled_bytes`), and once that budget is used up too, ingest waits for flushes
    /// (and answers 503 when they do not come within 10 s).
    pub max_unflushed_bytes: Option<usize>,
    /// Past `max_unflushed_bytes`, unflushed batches up to this many bytes over all tables
    /// are kept in the commit log only (spilled) and read back from it; 0 turns that off.
    pub max_spilled_bytes: Option<usize>,
    /// While appends come less than this far apart, flushes of tables past `flush_bytes`
    /// wait (as long as batches can be spilled), in milliseconds.
    pub flush_quiet_ms: Option<u64>,
    /// Request-body bytes held at once while bodies are read and decoded, reserved as
    /// they arrive; a body that finds no room waits.
    pub ingest_inflight_bytes: Option<usize>,
    /// The longest a request waits in all for room in `ingest_inflight_bytes` before it
    /// answers 503, in seconds.
    pub ingest_admission_timeout_seconds: Option<f64>,
    /// Bytes per second a request body must keep up after its first 10 seconds, else it
    /// answers 408 (0: no minimum).
    pub min_body_bytes_per_second: Option<u64>,
    /// How long a long-poll read waits for data before answering 204, in milliseconds.
    pub long_poll_timeout_ms: Option<u64>,
    /// Seal stream data into object storage at least this often, in seconds.
    pub stream_checkpoint_interval_seconds: Option<f64>,
    /// How long a request body may take to arrive before the request answers 408, in seconds.
    pub request_body_timeout_seconds: Option<f64>,
    /// Most client connections open at once.
    pub max_connections: Option<usize>,
    /// Most client connections open at once from one address.
    pub max_connections_per_peer: Option<usize>,
    /// How long a client may take to send a request's headers, in seconds.
    pub header_timeout_seconds: Option<f64>,
    /// How long an answer's write may make no progress (the client reads nothing) before
    /// the connection is closed, in seconds.
    pub response_write_timeout_seconds: Option<f64>,
    /// How long a shutdown waits for open requests to finish, in seconds.
    pub shutdown_timeout_seconds: Option<f64>,
    /// Host names the server answers to besides loopback, `localhost` and its listen address.
    pub allowed_hosts: Option<Vec<String>>,
    /// The URL other nodes reach this one at (stream requests are forwarded to their owner).
    pub advertise_url: Option<String>,
    /// Origins whose web pages may call the API (`*` for any).
    pub cors_origins: Option<Vec<String>>,
    /// Networks webhooks may reach although they are not public (`127.0.0.0/8`).
    pub webhook_allowed_networks: Option<Vec<String>>,
    /// Bytes all running statements may hold together, and one statement at most.
    pub query_memory_bytes: Option<usize>,
    /// Longest a statement may run, in seconds.
    pub statement_timeout_seconds: Option<f64>,
    /// Most rows a statement result may hold.
    pub max_result_rows: Option<usize>,
    /// Most bytes a statement result may hold.
    pub max_result_bytes: Option<usize>,
    /// Statements running at once.
    pub max_running_statements: Option<usize>,
    /// Finished statements kept for fetching.
    pub max_kept_statements: Option<usize>,
    /// Bytes of finished statements' results kept for fetching.
    pub max_kept_result_bytes: Option<usize>,
    /// Streams per server.
    pub max_streams: Option<usize>,
    /// Idempotent producers per stream.
    pub max_producers_per_stream: Option<usize>,
    /// Bytes all streams' state (names, producers, ...; not their data) may hold.
    pub max_stream_state_bytes: Option<u64>,
    /// Bytes all streams' idempotent producer entries may hold.
    pub max_producer_bytes: Option<u64>,
    /// Seconds after its last append an idempotent producer is forgotten.
    pub producer_expiry_seconds: Option<f64>,
    /// Subscriptions per server.
    pub max_subscriptions: Option<usize>,
    /// Names of changed streams a stream engine holds for subscriptions before it has them
    /// rescan instead.
    pub max_pending_stream_changes: Option<usize>,
    /// How long unreferenced objects are kept before garbage collection deletes them.
    pub gc_grace_seconds: Option<f64>,
    /// How long a node's heartbeat must stay still before another process may take its id.
    pub node_lease_seconds: Option<f64>,
    /// Commit-log segment size (segments are the unit of log release).
    pub log_segment_bytes: Option<u64>,
    /// How often flushes, compactions, checkpoints and catalog refreshes are considered.
    pub maintenance_interval_seconds: Option<f64>,
    /// Write a manifest checkpoint every this many versions.
    pub manifest_checkpoint_interval: Option<u64>,
    /// Compact a table once it has this many small files.
    pub compact_min_files: Option<usize>,
}

impl FileConfig {
    /// Reads a TOML config file.
    pub fn read(path: &Path) -> Result<FileConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.display().to_string(),
            message: e.to_string(),
        })
    }
}

/// Settings given on the command line or in the environment (`None` where absent).
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// `--listen` / `SLUICE_LISTEN`.
    pub listen: Option<String>,
    /// `--data-dir` / `SLUICE_DATA_DIR`.
    pub data_dir: Option<PathBuf>,
    /// `--object-store` / `SLUICE_OBJECT_STORE`.
    pub object_store: Option<String>,
    /// `--api-key` (repeated) / `SLUICE_API_KEYS` (comma-separated).
    pub api_keys: Vec<String>,
    /// `--durability` / `SLUICE_DURABILITY`.
    pub durability: Option<String>,
    /// `--long-poll-timeout-ms` / `SLUICE_LONG_POLL_TIMEOUT_MS`.
    pub long_poll_timeout_ms: Option<u64>,
    /// `--allowed-host` (repeated) / `SLUICE_ALLOWED_HOSTS` (comma-separated).
    pub allowed_hosts: Vec<String>,
    /// `--advertise-url` / `SLUICE_ADVERTISE_URL`.
    pub advertise_url: Option<String>,
    /// `--cors-origin` (repeated) / `SLUICE_CORS_ORIGINS` (comma-separated).
    pub cors_origins: Vec<String>,
    /// `--webhook-allowed-network` (repeated) / `SLUICE_WEBHOOK_ALLOWED_NETWORKS`.
    pub webhook_allowed_networks: Vec<String>,
    /// `--gc-grace-seconds` / `SLUICE_GC_GRACE_SECONDS`.
    pub gc_grace_seconds: Option<f64>,
    /// `--node-lease-seconds` / `SLUICE_NODE_LEASE_SECONDS`.
    pub node_lease_seconds: Option<f64>,
}

/// Everything `sluice serve` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// API keys (empty: no authentication, loopback only).
    pub api_keys: Vec<String>,
    /// The database settings.
    pub db: DbConfig,
    /// How long a long-poll read waits before answering 204.
    pub long_poll_timeout: Duration,
    /// How long a request body may take to arrive.
    pub body_timeout: Duration,
    /// Bytes per second a request body must keep up after its first seconds (0: none).
    pub min_body_rate: u64,
    /// Most client connections open at once.
    pub max_connections: usize,
    /// Most client connections open at once from one address.
    pub max_connections_per_peer: usize,
    /// How long a client may take to send a request's headers (idle keep-alive included).
    pub header_timeout: Duration,
    /// How long an answer's write may make no progress before the connection is closed.
    pub response_write_timeout: Duration,
    /// How long a shutdown waits for open requests to finish.
    pub shutdown_timeout: Duration,
    /// Which hosts and origins browsers may use.
    pub browser: BrowserPolicy,
    /// Bounds on running and kept statements.
    pub statements: StatementLimits,
}

/// Default time a client may take to send its request headers.
pub(crate) const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Default connection limit.
pub(crate) const DEFAULT_MAX_CONNECTIONS: usize = 10_000;

/// Default for `max_connections_per_peer`: a tenth of the default connection limit.
pub(crate) const DEFAULT_MAX_CONNECTIONS_PER_PEER: usize = 1_000;

/// Default for `response_write_timeout_seconds`.
pub(crate) const DEFAULT_RESPONSE_WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// Default for `shutdown_timeout_seconds`.
pub(crate) const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

impl ServeConfig {
    /// The effective configuration as TOML-like lines, API keys masked.
    pub fn describe(&self) -> String {
        let db = &self.db;
        let masked: Vec<String> = self
            .api_keys
            .iter()
            .map(|_| "\"<masked>\"".to_owned())
            .collect();
        let object_store = db
            .object_store
            .clone()
            .unwrap_or_else(|| db.data_dir.join("objects").display().to_string());
        format!(
            "listen = \"{}\"\ndata_dir = \"{}\"\nobject_store = \"{}\"\napi_keys = [{}]\n\
             durability = \"{}\"\nmax_body_bytes = {}\nmax_rows = {}\nmax_log_bytes = {}\n\
             flush_bytes = {}\nflush_interval_seconds = {}\nmax_unflushed_bytes = {}\n\
             max_spilled_bytes = {}\nflush_quiet_ms = {}\n\
             ingest_inflight_bytes = {}\ningest_admission_timeout_seconds = {}\n\
             min_body_bytes_per_second = {}\n\
             long_poll_timeout_ms = {}\nstream_checkpoint_interval_seconds = {}\n\
             request_body_timeout_seconds = {}\nmax_connections = {}\nmax_connections_per_peer = {}\n\
             header_timeout_seconds = {}\nresponse_write_timeout_seconds = {}\n\
             shutdown_timeout_seconds = {}\n\
             allowed_hosts = {:?}\ncors_origins = {:?}\nwebhook_allowed_networks = {}\n\
             query_memory_bytes = {}\nstatement_timeout_seconds = {}\nmax_result_rows = {}\n\
             max_result_bytes = {}\nmax_running_statements = {}\nmax_kept_statements = {}\n\
             max_kept_result_bytes = {}\nmax_streams = {}\nmax_producers_per_stream = {}\n\
             max_stream_state_bytes = {}\nmax_producer_bytes = {}\nproducer_expiry_seconds = {}\n\
             max_subscriptions = {}\nmax_pending_stream_changes = {}\ngc_grace_seconds = {}\n\
             node_lease_seconds = {}\n\
             log_segment_bytes = {}\nmaintenance_interval_seconds = {}",
            self.listen,
            db.data_dir.display(),
            object_store,
            masked.join(", "),
            match db.durability {
                Durability::Fsync => "fsync",
                Durability::None => "none",
                Durability::ObjectStore => "object-store",
            },
            db.limits.max_body_bytes,
            db.limits.max_rows,
            db.max_log_bytes,
            db.tables.flush_bytes,
            db.tables.flush_interval.as_secs_f64(),
            db.tables.max_unflushed_bytes,
            db.tables.max_spilled_bytes,
            db.tables.flush_quiet.as_millis(),
            db.ingest_inflight_bytes,
            db.ingest_admission_timeout.as_secs_f64(),
            self.min_body_rate,
            self.long_poll_timeout.as_millis(),
            db.streams.checkpoint_interval.as_secs_f64(),
            self.body_timeout.as_secs_f64(),
            self.max_connections,
            self.max_connections_per_peer,
            self.header_timeout.as_secs_f64(),
            self.response_write_timeout.as_secs_f64(),
            self.shutdown_timeout.as_secs_f64(),
            self.browser.allowed_hosts,
            self.browser.cors_origins,
            db.subscriptions.webhook_allowed_networks.len(),
            db.query.memory_bytes,
            db.query.timeout.as_secs_f64(),
            db.query.max_result_rows,
            db.query.max_result_bytes,
            self.statements.max_running,
            self.statements.max_retained,
            self.statements.max_retained_bytes,
            db.streams.max_streams,
            db.streams.max_producers_per_stream,
            db.streams.max_state_bytes,
            db.streams.max_producer_bytes,
            db.streams.producer_expiry.as_secs_f64(),
            db.subscriptions.max_subscriptions,
            db.streams.max_pending_changes,
            db.gc_grace.as_secs_f64(),
            db.node_lease.as_secs_f64(),
            db.log_segment_bytes,
            db.maintenance_interval.as_secs_f64(),
        )
    }
}

/// Default listen address of every ScopeDB client.
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:6543";

impl ServeConfig {
    /// Resolves the configuration from overrides and an optional file.
    pub fn resolve(
        overrides: Overrides,
        file: Option<FileConfig>,
    ) -> Result<ServeConfig, ConfigError> {
        let file = file.unwrap_or_default();
        let listen_text = overrides
            .listen
            .or(file.listen)
            .unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
        let listen: SocketAddr = listen_text.parse().map_err(|e| ConfigError::Invalid {
            name: "listen address",
            message: format!("{listen_text:?}: {e}"),
        })?;
        let data_dir = overrides
            .data_dir
            .or(file.data_dir)
            .unwrap_or_else(|| PathBuf::from("data"));
        let mut db = DbConfig::new(data_dir);
        db.object_store = overrides.object_store.or(file.object_store);
        // Other nodes forward stream requests here; a listen address that names one
        // interface names it, a wildcard one does not.
        db.advertise_url = match overrides.advertise_url.or(file.advertise_url) {
            Some(url) => {
                let parsed = reqwest::Url::parse(&url).ok().filter(|u| {
                    matches!(u.scheme(), "http" | "https")
                        && u.host().is_some()
                        && u.path() == "/"
                        && u.query().is_none()
                });
                if parsed.is_none() {
                    return Err(ConfigError::Invalid {
                        name: "advertise_url",
                        message: format!("{url:?}: an http(s) URL with a host and no path"),
                    });
                }
                Some(url.trim_end_matches('/').to_owned())
            }
            None if !listen.ip().is_unspecified() => Some(format!("http://{listen}")),
            None => None,
        };
        db.durability = match overrides.durability.or(file.durability).as_deref() {
            None | Some("fsync") => Durability::Fsync,
            Some("none") => Durability::None,
            Some("object-store") => Durability::ObjectStore,
            Some(other) => {
                return Err(ConfigError::Invalid {
                    name: "durability",
                    message: format!("{other:?}; use fsync, object-store or none"),
                });
            }
        };
        db.limits = Limits {
            max_body_bytes: file
                .max_body_bytes
                .unwrap_or(Limits::DEFAULT.max_body_bytes),
            max_rows: file.max_rows.unwrap_or(Limits::DEFAULT.max_rows),
            ..Limits::DEFAULT
        };
        if let Some(b) = file.max_log_bytes {
            db.max_log_bytes = b;
        }
        if let Some(b) = file.flush_bytes {
            db.tables.flush_bytes = b;
        }
        if let Some(s) = file.flush_interval_seconds {
            if !(s.is_finite() && s > 0.0) {
                return Err(ConfigError::Invalid {
                    name: "flush_interval_seconds",
                    message: "must be a positive number".into(),
                });
            }
            db.tables.flush_interval = Duration::from_secs_f64(s);
        }
        if let Some(b) = file.max_unflushed_bytes {
            db.tables.max_unflushed_bytes = b;
        }
        if let Some(b) = file.max_spilled_bytes {
            db.tables.max_spilled_bytes = b;
        }
        if let Some(ms) = file.flush_quiet_ms {
            db.tables.flush_quiet = Duration::from_millis(ms);
        }
        if let Some(b) = file.ingest_inflight_bytes {
            db.ingest_inflight_bytes = b;
        }
        if let Some(s) = file.ingest_admission_timeout_seconds {
            if !(s.is_finite() && s > 0.0 && s < 1e9) {
                return Err(ConfigError::Invalid {
                    name: "ingest_admission_timeout_seconds",
                    message: "must be a positive number of seconds".into(),
                });
            }
            db.ingest_admission_timeout = Duration::from_secs_f64(s);
        }
        if let Some(s) = file.stream_checkpoint_interval_seconds {
            if !(s.is_finite() && s > 0.0) {
                return Err(ConfigError::Invalid {
                    name: "stream_checkpoint_interval_seconds",
                    message: "must be a positive number".into(),
                });
            }
            db.streams.checkpoint_interval = Duration::from_secs_f64(s);
        }
        let long_poll_timeout = match overrides.long_poll_timeout_ms.or(file.long_poll_timeout_ms) {
            Some(0) => {
                return Err(ConfigError::Invalid {
                    name: "long-poll timeout",
                    message: "must be at least 1 ms".into(),
                });
            }
            Some(ms) => Duration::from_millis(ms),
            None => DEFAULT_LONG_POLL_TIMEOUT,
        };
        let body_timeout = match file.request_body_timeout_seconds {
            Some(s) if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s),
            Some(_) => {
                return Err(ConfigError::Invalid {
                    name: "request_body_timeout_seconds",
                    message: "must be a positive number".into(),
                });
            }
            None => DEFAULT_BODY_TIMEOUT,
        };
        let seconds =
            |name: &'static str, value: Option<f64>| -> Result<Option<Duration>, ConfigError> {
                match value {
                    Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => {
                        Ok(Some(Duration::from_secs_f64(s)))
                    }
                    Some(_) => Err(ConfigError::Invalid {
                        name,
                        message: "must be a positive number of seconds".into(),
                    }),
                    None => Ok(None),
                }
            };
        if let Some(d) = seconds(
            "gc_grace_seconds",
            overrides.gc_grace_seconds.or(file.gc_grace_seconds),
        )? {
            db.gc_grace = d;
        }
        if let Some(d) = seconds(
            "node_lease_seconds",
            overrides.node_lease_seconds.or(file.node_lease_seconds),
        )? {
            db.node_lease = d;
        }
        if let Some(d) = seconds(
            "maintenance_interval_seconds",
            file.maintenance_interval_seconds,
        )? {
            db.maintenance_interval = d;
        }
        if let Some(b) = file.log_segment_bytes {
            if b < 4096 {
                return Err(ConfigError::Invalid {
                    name: "log_segment_bytes",
                    message: "must be at least 4096".into(),
                });
            }
            db.log_segment_bytes = b;
        }
        if let Some(n) = file.manifest_checkpoint_interval {
            db.tables.checkpoint_interval = n.max(1);
        }
        if let Some(n) = file.compact_min_files {
            db.tables.compact_min_files = n.max(2);
        }
        let positive =
            |name: &'static str, value: Option<usize>| -> Result<Option<usize>, ConfigError> {
                match value {
                    Some(0) => Err(ConfigError::Invalid {
                        name,
                        message: "must be at least 1".into(),
                    }),
                    other => Ok(other),
                }
            };
        if let Some(b) = positive("query_memory_bytes", file.query_memory_bytes)? {
            db.query.memory_bytes = b;
        }
        if let Some(s) = file.statement_timeout_seconds {
            if !(s.is_finite() && s > 0.0) {
                return Err(ConfigError::Invalid {
                    name: "statement_timeout_seconds",
                    message: "must be a positive number".into(),
                });
            }
            db.query.timeout = Duration::from_secs_f64(s);
        }
        if let Some(n) = positive("max_result_rows", file.max_result_rows)? {
            db.query.max_result_rows = n;
        }
        if let Some(n) = positive("max_result_bytes", file.max_result_bytes)? {
            db.query.max_result_bytes = n;
        }
        if let Some(n) = positive("max_streams", file.max_streams)? {
            db.streams.max_streams = n;
        }
        if let Some(n) = positive("max_producers_per_stream", file.max_producers_per_stream)? {
            db.streams.max_producers_per_stream = n;
        }
        if let Some(n) = file.max_stream_state_bytes {
            db.streams.max_state_bytes = n;
        }
        if let Some(n) = file.max_producer_bytes {
            db.streams.max_producer_bytes = n;
        }
        if let Some(d) = seconds("producer_expiry_seconds", file.producer_expiry_seconds)? {
            db.streams.producer_expiry = d;
        }
        let mut statements = StatementLimits::default();
        if let Some(n) = positive("max_running_statements", file.max_running_statements)? {
            statements.max_running = n;
        }
        if let Some(n) = positive("max_kept_statements", file.max_kept_statements)? {
            statements.max_retained = n;
        }
        if let Some(n) = positive("max_kept_result_bytes", file.max_kept_result_bytes)? {
            statements.max_retained_bytes = n;
        }
        if let Some(n) = positive(
            "max_pending_stream_changes",
            file.max_pending_stream_changes,
        )? {
            db.streams.max_pending_changes = n;
        }
        let subscriptions = &mut db.subscriptions;
        if let Some(n) = positive("max_subscriptions", file.max_subscriptions)? {
            subscriptions.max_subscriptions = n;
        }
        let networks = if overrides.webhook_allowed_networks.is_empty() {
            file.webhook_allowed_networks.unwrap_or_default()
        } else {
            overrides.webhook_allowed_networks
        };
        subscriptions.webhook_allowed_networks = networks
            .iter()
            .filter(|n| !n.trim().is_empty())
            .map(|n| {
                n.parse().map_err(|message| ConfigError::Invalid {
                    name: "webhook_allowed_networks",
                    message,
                })
            })
            .collect::<Result<_, _>>()?;
        let list = |flags: Vec<String>, file: Option<Vec<String>>| -> Vec<String> {
            let values = if flags.is_empty() {
                file.unwrap_or_default()
            } else {
                flags
            };
            values
                .into_iter()
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
                .collect()
        };
        let mut allowed_hosts = list(overrides.allowed_hosts, file.allowed_hosts);
        // Peers forward stream requests to the advertised URL: its host is this server's.
        if !allowed_hosts.is_empty()
            && let Some(host) = db
                .advertise_url
                .as_deref()
                .and_then(|u| reqwest::Url::parse(u).ok())
                .and_then(|u| u.host_str().map(str::to_owned))
        {
            allowed_hosts.push(host);
        }
        let browser = BrowserPolicy {
            allowed_hosts,
            cors_origins: list(overrides.cors_origins, file.cors_origins),
            listen: Some(listen),
        };
        let api_keys: Vec<String> = if overrides.api_keys.is_empty() {
            file.api_keys.unwrap_or_default()
        } else {
            overrides.api_keys
        };
        let api_keys: Vec<String> = api_keys
            .into_iter()
            .map(|k| k.trim().to_owned())
            .filter(|k| !k.is_empty())
            .collect();
        if api_keys.is_empty() && !listen.ip().is_loopback() {
            return Err(ConfigError::Invalid {
                name: "listen address",
                message: format!(
                    "{listen} is not loopback; configure API keys (--api-key or SLUICE_API_KEYS) to listen there"
                ),
            });
        }
        Ok(ServeConfig {
            listen,
            api_keys,
            db,
            long_poll_timeout,
            body_timeout,
            min_body_rate: file
                .min_body_bytes_per_second
                .unwrap_or(DEFAULT_MIN_BODY_RATE),
            max_connections: match file.max_connections {
                Some(0) => {
                    return Err(ConfigError::Invalid {
                        name: "max_connections",
                        message: "must be at least 1".into(),
                    });
                }
                Some(n) => n,
                None => DEFAULT_MAX_CONNECTIONS,
            },
            header_timeout: match file.header_timeout_seconds {
                Some(s) if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s),
                Some(_) => {
                    return Err(ConfigError::Invalid {
                        name: "header_timeout_seconds",
                        message: "must be a positive number".into(),
                    });
                }
                None => DEFAULT_HEADER_TIMEOUT,
            },
            max_connections_per_peer: match file.max_connections_per_peer {
                Some(0) => {
                    return Err(ConfigError::Invalid {
                        name: "max_connections_per_peer",
                        message: "must be at least 1".into(),
                    });
                }
                Some(n) => n,
                None => DEFAULT_MAX_CONNECTIONS_PER_PEER,
            },
            response_write_timeout: seconds(
                "response_write_timeout_seconds",
                file.response_write_timeout_seconds,
            )?
            .unwrap_or(DEFAULT_RESPONSE_WRITE_TIMEOUT),
            shutdown_timeout: seconds("shutdown_timeout_seconds", file.shutdown_timeout_seconds)?
                .unwrap_or(DEFAULT_SHUTDOWN_TIMEOUT),
            browser,
            statements,
        })
    }
}
