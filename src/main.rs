//! The `sluice` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sluice::config::{FileConfig, Overrides, ServeConfig};
use sluice::db::Database;
use sluice::http::{AppState, router};

#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version,
    about = "A database service for schema-checked ingest"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the server.
    ///
    /// Examples:
    ///   sluice serve
    ///   sluice serve --listen 0.0.0.0:6543 --api-key "$KEY" --object-store s3://bucket/db
    Serve(ServeArgs),
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address to listen on [default: 127.0.0.1:6543]
    #[arg(long, env = "SLUICE_LISTEN")]
    listen: Option<String>,
    /// Directory for the commit log and, by default, the object store [default: ./data]
    #[arg(long, env = "SLUICE_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Object store URL: a directory, file:///dir, s3://bucket/prefix or memory://
    #[arg(long, env = "SLUICE_OBJECT_STORE")]
    object_store: Option<String>,
    /// An API key clients must send as `Authorization: Bearer KEY` (repeatable)
    #[arg(long = "api-key", env = "SLUICE_API_KEYS", value_delimiter = ',')]
    api_keys: Vec<String>,
    /// Commit log durability: fsync (default) or none (unsafe: a crash loses acknowledged writes)
    #[arg(long, env = "SLUICE_DURABILITY")]
    durability: Option<String>,
    /// How long a stream long-poll read waits for data before answering 204 [default: 30000]
    #[arg(long, env = "SLUICE_LONG_POLL_TIMEOUT_MS")]
    long_poll_timeout_ms: Option<u64>,
    /// A TOML configuration file; flags and SLUICE_* variables override it
    #[arg(long, env = "SLUICE_CONFIG")]
    config: Option<PathBuf>,
    /// Log format: text (default) or json (one object per line)
    #[arg(long, env = "SLUICE_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    /// Print the effective configuration (API keys masked) and exit
    #[arg(long)]
    print_config: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => match serve(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(message) => {
                eprintln!("sluice: {message}");
                ExitCode::FAILURE
            }
        },
    }
}

fn serve(args: ServeArgs) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    match args.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
    let file = match &args.config {
        Some(path) => Some(FileConfig::read(path).map_err(|e| e.to_string())?),
        None => None,
    };
    let overrides = Overrides {
        listen: args.listen,
        data_dir: args.data_dir,
        object_store: args.object_store,
        api_keys: args.api_keys,
        durability: args.durability,
        long_poll_timeout_ms: args.long_poll_timeout_ms,
    };
    let config = ServeConfig::resolve(overrides, file).map_err(|e| e.to_string())?;
    if args.print_config {
        println!("{}", config.describe());
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(run(config))
}

async fn run(config: ServeConfig) -> Result<(), String> {
    let db = Database::open(config.db.clone())
        .await
        .map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!(
        listen = %local,
        data_dir = %config.db.data_dir.display(),
        auth = !config.api_keys.is_empty(),
        "sluice is serving"
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let maintenance = tokio::spawn(db.clone().run_maintenance({
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }));
    let state = AppState::new(db.clone(), config.api_keys.clone())
        .with_long_poll_timeout(config.long_poll_timeout);
    let app = router(state);
    let streams = db.streams().clone();
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            // Live stream readers (SSE, long-poll) end so the server can drain.
            streams.shutdown();
        })
        .await;
    tracing::info!("shutting down: flushing tables and closing the log");
    let _ = stop_tx.send(true);
    let _ = maintenance.await;
    let closed = db.close().await;
    served.map_err(|e| format!("server error: {e}"))?;
    closed.map_err(|e| format!("flush at shutdown failed (data is safe in the log): {e}"))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate => {}
    }
}
