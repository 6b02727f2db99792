//! The `sluice` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use sluice::config::{FileConfig, Overrides, ServeConfig};
use sluice::db::Database;
use sluice::http::{AppState, router};

/// mimalloc: thread-local free lists instead of glibc's locked arenas. On the request path
/// glibc's `malloc`/`free` (and their lock hand-offs) were about a quarter of the server's
/// CPU; see benches/README.md, "Streams".
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Stream NDJSON (files or stdin; plain, gzip or zstd) into a table, in batches of at most
    /// 8 MiB and 200,000 rows over a few connections, in bounded memory.
    ///
    /// Retries 429/503 with backoff; never re-sends a batch whose outcome is unknown (it names
    /// those for you to reconcile). Prints the offset to resume from after every batch and at
    /// the end; Ctrl-C stops reading, waits for the batches in flight and prints it too.
    /// Exits 1 if any batch was rejected (after printing its row errors with input and line)
    /// or could not be taken (busy or unreachable; resume to send it), 2 if any outcome is
    /// unknown, 130 if interrupted.
    ///
    /// Examples:
    ///   sluice ingest events.ndjson --table scopedb.public.events
    ///   sluice ingest day1.ndjson.gz day2.ndjson.zst --table scopedb.public.events --connections 8
    ///   zcat big.ndjson.gz | sluice ingest - --table scopedb.public.events
    ///   sluice ingest big.ndjson --table scopedb.public.events --resume-from 1073741824
    Ingest(IngestArgs),
    /// Run a SQL or ScopeQL statement and print its result.
    ///
    /// Examples:
    ///   sluice query "SELECT count(*) FROM events"
    ///   sluice query "FROM events WHERE service = 'checkout' SELECT time, name" --format csv
    Query(QueryArgs),
    /// List the catalog's tables with their columns.
    ///
    /// Example:
    ///   sluice tables
    Tables(ClientArgs),
    /// Make a data directory whose commit log is damaged start again.
    ///
    /// `sluice serve` refuses to start when a log record before the log's tail fails its
    /// checksum, naming the segment and offset: the records after it were acknowledged.
    /// This cuts each damaged segment at the damaged record and keeps the bytes from there
    /// on beside it as `<segment>.corrupt-<offset>`; the records in them are not replayed.
    /// Stop the server first.
    ///
    /// Example:
    ///   sluice repair --data-dir ./data
    Repair(RepairArgs),
}

#[derive(Debug, clap::Args)]
struct RepairArgs {
    /// The data directory [default: ./data]
    #[arg(long, env = "SLUICE_DATA_DIR", default_value = "data")]
    data_dir: PathBuf,
}

#[derive(Debug, clap::Args)]
struct ClientArgs {
    /// The server's base URL
    #[arg(long, env = "SLUICE_ENDPOINT", default_value = "http://127.0.0.1:6543")]
    endpoint: String,
    /// API key, sent as `Authorization: Bearer KEY`
    #[arg(long, env = "SLUICE_API_KEY")]
    api_key: Option<String>,
}

impl ClientArgs {
    fn endpoint(&self) -> sluice::cli::Endpoint {
        sluice::cli::Endpoint {
            url: self.endpoint.clone(),
            api_key: self.api_key.clone(),
        }
    }
}

#[derive(Debug, clap::Args)]
struct IngestArgs {
    /// NDJSON inputs, plain, gzip or zstd: files, or - for standard input
    #[arg(required = true)]
    inputs: Vec<std::ffi::OsString>,
    /// The table, as db.schema.table
    #[arg(long)]
    table: String,
    /// Concurrent requests (at most 64)
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Most rows per batch (at most 200,000)
    #[arg(long, default_value_t = sluice::cli::BATCH_ROWS)]
    batch_rows: usize,
    /// Skip this many bytes of the (decompressed) inputs: the offset an interrupted run
    /// printed ("resume from N")
    #[arg(long, default_value_t = 0)]
    resume_from: u64,
    /// Skip these bytes too, as START-END (repeatable): batches an earlier run settled past
    /// its resume offset, as it prints them
    #[arg(long, value_parser = parse_range)]
    skip: Vec<(u64, u64)>,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Debug, clap::Args)]
struct QueryArgs {
    /// The statement (SQL, or ScopeQL starting with FROM or VALUES)
    statement: String,
    /// Output format
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Format {
    Table,
    Csv,
    Json,
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
    /// Commit log durability: fsync (default), object-store (each group commit written to the object store before it is acknowledged; dead nodes' logs are taken over) or none (unsafe: a crash loses acknowledged writes)
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
    /// A host name the server answers to besides loopback and localhost (repeatable)
    #[arg(
        long = "allowed-host",
        env = "SLUICE_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    allowed_hosts: Vec<String>,
    /// The URL other nodes reach this one at, for stream requests they forward to it
    /// (object-store durability) [default: http://LISTEN when it names one address]
    #[arg(long, env = "SLUICE_ADVERTISE_URL")]
    advertise_url: Option<String>,
    /// An origin whose web pages may call the API, or * (repeatable)
    #[arg(
        long = "cors-origin",
        env = "SLUICE_CORS_ORIGINS",
        value_delimiter = ','
    )]
    cors_origins: Vec<String>,
    /// A network webhooks may reach although it is not public, e.g. 127.0.0.0/8 (repeatable)
    #[arg(
        long = "webhook-allowed-network",
        env = "SLUICE_WEBHOOK_ALLOWED_NETWORKS",
        value_delimiter = ','
    )]
    webhook_allowed_networks: Vec<String>,
    /// Seconds an object no live version references is kept before garbage collection
    /// deletes it (longer than the statement timeout) [default: 600]
    #[arg(long, env = "SLUICE_GC_GRACE_SECONDS")]
    gc_grace_seconds: Option<f64>,
    /// Seconds a node's heartbeat must stay still before another process may take over its
    /// node id [default: 10]
    #[arg(long, env = "SLUICE_NODE_LEASE_SECONDS")]
    node_lease_seconds: Option<f64>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    no_transparent_huge_pages();
    let cli = Cli::parse();
    match cli.command {
        Command::Ingest(args) => client(ingest(args)),
        Command::Query(args) => client(query(args)),
        Command::Tables(args) => client(tables(args)),
        Command::Repair(args) => repair(&args),
        Command::Serve(args) => match serve(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(message) => {
                eprintln!("sluice: {message}");
                ExitCode::FAILURE
            }
        },
    }
}

fn repair(args: &RepairArgs) -> ExitCode {
    match sluice::log::repair(&args.data_dir.join("log")) {
        Ok(moved) if moved.is_empty() => {
            println!("the commit log is whole; nothing to repair");
            ExitCode::SUCCESS
        }
        Ok(moved) => {
            // The log is shorter than what the node had made durable, on purpose: the next
            // start must not take it for a stale copy.
            let marker = args.data_dir.join(sluice::node::REPAIRED_MARKER);
            if let Err(e) = std::fs::write(&marker, b"") {
                eprintln!("sluice: cannot write {}: {e}", marker.display());
                return ExitCode::FAILURE;
            }
            for m in moved {
                println!(
                    "cut {} at byte {}; {} bytes (the records from there on, not replayed) kept in {}",
                    m.segment.display(),
                    m.offset,
                    m.bytes,
                    m.moved_to.display()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs a client command on a small runtime; its error is printed, its code returned.
fn client(command: impl std::future::Future<Output = Result<ExitCode, String>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sluice: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(command) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("sluice: {message}");
            ExitCode::FAILURE
        }
    };
    // An interrupted `ingest` leaves its reader blocked on a pipe or terminal: do not wait
    // for it.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    code
}

async fn ingest(args: IngestArgs) -> Result<ExitCode, String> {
    use sluice::cli::{BatchOutcome, IngestOptions, Input};
    let options = IngestOptions {
        table: args.table,
        inputs: args.inputs.iter().map(|a| Input::parse(a)).collect(),
        connections: args.connections,
        batch_rows: args.batch_rows.clamp(1, sluice::cli::BATCH_ROWS),
        resume_from: args.resume_from,
        skip: args.skip,
    };
    let report = sluice::cli::ingest(&args.client.endpoint(), options)
        .await
        .map_err(|e| e.to_string())?;
    let mut rejected = 0;
    let mut not_applied = 0;
    let mut unknown = Vec::new();
    for (batch, outcome) in &report.outcomes {
        let lines = format!(
            "{}:{}-{} (bytes {}-{})",
            batch.input, batch.first_line, batch.last_line, batch.start, batch.end
        );
        match outcome {
            BatchOutcome::Committed(_) => {}
            BatchOutcome::Rejected(messages) => {
                rejected += 1;
                eprintln!("rejected: {lines} (nothing of it was applied)");
                for m in messages {
                    eprintln!("{m}");
                }
            }
            BatchOutcome::NotApplied(e) => {
                not_applied += 1;
                eprintln!("not applied: {lines}: {e}");
            }
            BatchOutcome::Unknown(_) => unknown.push(lines),
        }
    }
    println!(
        "{} rows committed in {} batches; {} rejected; {} unknown{}",
        report.rows,
        report.outcomes.len(),
        rejected,
        unknown.len(),
        if not_applied > 0 {
            format!("; {not_applied} not applied (the server could not take them)")
        } else {
            String::new()
        }
    );
    if !unknown.is_empty() {
        eprintln!(
            "reconcile these batches before sending them again (they may have been applied):"
        );
        for u in &unknown {
            eprintln!("  {u}");
        }
    }
    if let Some(why) = &report.stopped {
        eprintln!("stopped: {why}");
    }
    if report.interrupted || report.stopped.is_some() {
        let skips: String = report
            .skip
            .iter()
            .map(|(s, e)| format!(" --skip {s}-{e}"))
            .collect();
        println!(
            "resume from {0}: sluice ingest ... --resume-from {0}{skips}",
            report.resume_from
        );
    }
    Ok(if report.interrupted {
        ExitCode::from(130)
    } else if !unknown.is_empty() {
        ExitCode::from(2)
    } else if rejected > 0 || not_applied > 0 || report.stopped.is_some() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// `START-END`, two byte offsets.
fn parse_range(text: &str) -> Result<(u64, u64), String> {
    let (start, end) = text
        .split_once('-')
        .ok_or_else(|| format!("{text:?}: use START-END"))?;
    let number = |s: &str| s.parse::<u64>().map_err(|e| format!("{text:?}: {e}"));
    let (start, end) = (number(start)?, number(end)?);
    if start > end {
        return Err(format!("{text:?}: START is after END"));
    }
    Ok((start, end))
}

async fn query(args: QueryArgs) -> Result<ExitCode, String> {
    let set = sluice::cli::query(&args.client.endpoint(), &args.statement)
        .await
        .map_err(|e| e.to_string())?;
    let format = match args.format {
        Format::Table => sluice::cli::OutputFormat::Table,
        Format::Csv => sluice::cli::OutputFormat::Csv,
        Format::Json => sluice::cli::OutputFormat::Json,
    };
    print!("{}", sluice::cli::render(&set, format));
    Ok(ExitCode::SUCCESS)
}

async fn tables(args: ClientArgs) -> Result<ExitCode, String> {
    let list = sluice::cli::tables(&args.endpoint())
        .await
        .map_err(|e| e.to_string())?;
    print!("{list}");
    Ok(ExitCode::SUCCESS)
}

/// Turns transparent huge pages off for this process. mimalloc asks for them (`MADV_HUGEPAGE`)
/// on its segments and gives freed memory back after a few milliseconds, so memory that
/// cycles (request buffers, a stream's records until its checkpoint, ingest's batches) was
/// faulted in again as whole 2 MiB pages, each zeroed first: `clear_page_erms` under
/// `do_huge_pmd_anonymous_page` took a large share of the server's CPU under appends, and
/// ingest used about half as much CPU again with them as without (figures in
/// benches/README.md, "Transparent huge pages off"). Databases commonly run without them for
/// the same reasons (latency of the zeroing, memory held by partly used huge pages).
fn no_transparent_huge_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `PR_SET_THP_DISABLE` takes integer arguments only (passed as the `unsigned long`
    // the kernel reads) and sets a flag of this process's memory map, which children inherit
    // (the server starts none). A refusal leaves huge pages as they were, which costs speed
    // only, so its result is not needed; so does a kernel before 5.0, where the flag covers
    // only mappings made without `MADV_HUGEPAGE`.
    unsafe {
        let (on, unused) = (1 as libc::c_ulong, 0 as libc::c_ulong);
        libc::prctl(libc::PR_SET_THP_DISABLE, on, unused, unused, unused);
    }
}

/// Holds glibc's malloc to two arenas. By default it opens up to eight per core, and each
/// keeps the memory freed into it: with ingest handing 16 MiB buffers between runtime and
/// blocking threads, that retention alone took the server's peak RSS past 570 MiB where two
/// arenas stay near 440 MiB (`cargo bench --bench ingest`), at no cost in throughput.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets an allocator parameter; it is called before the runtime
    // starts any thread, and a refused setting (return value 0) leaves the default in place.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

fn serve(args: ServeArgs) -> Result<(), String> {
    limit_malloc_arenas();
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
        allowed_hosts: args.allowed_hosts,
        advertise_url: args.advertise_url,
        cors_origins: args.cors_origins,
        webhook_allowed_networks: args.webhook_allowed_networks,
        gc_grace_seconds: args.gc_grace_seconds,
        node_lease_seconds: args.node_lease_seconds,
    };
    #[allow(unused_mut)]
    let mut config = ServeConfig::resolve(overrides, file).map_err(|e| e.to_string())?;
    // A test build's fault hook (never in a release build): record every write and sync of
    // the data directory, for a test to apply a power loss after killing this process.
    #[cfg(feature = "testing")]
    if let Some(path) = std::env::var_os("SLUICE_TEST_SYNC_RECORD") {
        let journal = sluice::storage::journal::SyncJournal::recording(std::path::Path::new(&path))
            .map_err(|e| format!("SLUICE_TEST_SYNC_RECORD: {e}"))?;
        config.db.sync_journal = Some(std::sync::Arc::new(journal));
    }
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
    // Before the first answer: a SIGTERM sent once the server answers (its health check,
    // say) must stop it cleanly. A handler set up only when the accept loop first polls its
    // stop signal could come after a connection was already served, and the signal's default
    // action would end the process. (Until here, during replay, the default action is a
    // kill, which the log is made to survive.)
    let signals = ShutdownSignals::new()?;
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
        .with_long_poll_timeout(config.long_poll_timeout)
        .with_body_timeout(config.body_timeout)
        .with_min_body_rate(config.min_body_rate)
        .with_browser_policy(config.browser.clone())
        .with_statement_limits(config.statements);
    let app = router(state);
    let streams = db.streams().clone();
    let listener = sluice::http::LimitedListener::new(
        listener,
        sluice::http::ConnectionLimits {
            total: config.max_connections,
            per_peer: config.max_connections_per_peer,
            write_timeout: config.response_write_timeout,
        },
    );
    let fenced = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopping = {
        let (db, fenced) = (db.clone(), fenced.clone());
        async move {
            tokio::select! {
                _ = signals.wait() => {}
                _ = db.fenced() => {
                    tracing::error!("this node was fenced: another node took over its id after it could not renew its lease; exiting (restarted, it rejoins under a new id)");
                    fenced.store(true, std::sync::atomic::Ordering::Release);
                }
            }
            // Live stream readers (SSE, long-poll) end so the server can drain.
            streams.shutdown();
        }
    };
    sluice::http::serve(
        listener,
        app,
        config.header_timeout,
        config.shutdown_timeout,
        stopping,
    )
    .await;
    tracing::info!("shutting down: flushing tables and closing the log");
    let _ = stop_tx.send(true);
    let _ = maintenance.await;
    let closed = db.shutdown().await;
    if fenced.load(std::sync::atomic::Ordering::Acquire) {
        return Err(
            "this node was fenced (another node took over its id after it could not \
             renew its lease); restart it to rejoin under a new id"
                .into(),
        );
    }
    closed.map_err(|e| format!("flush at shutdown failed (data is safe in the log): {e}"))
}

/// SIGINT and SIGTERM, listened for from the moment this is made (a signal that comes
/// earlier than [`ShutdownSignals::wait`] is kept for it).
struct ShutdownSignals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn new() -> Result<Self, String> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let listen = |kind: SignalKind, name: &str| {
                signal(kind).map_err(|e| format!("cannot listen for {name}: {e}"))
            };
            Ok(ShutdownSignals {
                interrupt: listen(SignalKind::interrupt(), "SIGINT")?,
                terminate: listen(SignalKind::terminate(), "SIGTERM")?,
            })
        }
        #[cfg(not(unix))]
        Ok(ShutdownSignals {})
    }

    /// Until the first signal.
    async fn wait(mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
        #[cfg(not(unix))]
        {
            let _ = &mut self;
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
