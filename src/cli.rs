//! The client side of the `sluice` command: `ingest`, `query` and `tables` against a running
//! server, over the same HTTP APIs as every other client.

use std::io::{BufRead as _, BufReader, IsTerminal as _, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Most bytes per ingest batch (the server's limit is 16 MiB).
pub(crate) const BATCH_BYTES: usize = 8 << 20;
/// Most rows per ingest batch.
pub const BATCH_ROWS: usize = 200_000;

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The server could not be reached or answered something unreadable.
    #[error("{0}")]
    Http(String),
    /// The server refused the request.
    #[error("{status}: {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// Its message.
        message: String,
    },
    /// A statement failed.
    #[error("statement failed: {0}")]
    Statement(String),
    /// Bad arguments.
    #[error("{0}")]
    Usage(String),
}

/// Where the server is and how to authenticate.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// Base URL, e.g. `http://127.0.0.1:6543`.
    pub url: String,
    /// API key, sent as `Authorization: Bearer`.
    pub api_key: Option<String>,
}

impl Endpoint {
    fn client() -> Result<reqwest::Client, CliError> {
        reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| CliError::Http(e.to_string()))
    }

    fn auth(&self, r: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => r.bearer_auth(key),
            None => r,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url.trim_end_matches('/'))
    }
}

async fn json_body(r: reqwest::Response) -> Result<(u16, Value), CliError> {
    let status = r.status().as_u16();
    let bytes = r.bytes().await.map_err(|e| CliError::Http(e.to_string()))?;
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Ok((status, value))
}

fn message(body: &Value) -> String {
    body["message"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| body.to_string())
}

/// How `query` prints a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    /// An aligned table with the column types under the names.
    Table,
    /// CSV with a header row.
    Csv,
    /// One JSON object per row.
    Json,
}

/// A finished statement's result: `(name, type)` columns and rows of cells.
#[derive(Debug, Clone, PartialEq)]
pub struct ResultSet {
    /// Column names and sluice types.
    pub columns: Vec<(String, String)>,
    /// Rows; every cell a string or null.
    pub rows: Vec<Vec<Option<String>>>,
}

/// Runs a SQL or ScopeQL statement to completion.
pub async fn query(endpoint: &Endpoint, statement: &str) -> Result<ResultSet, CliError> {
    let client = Endpoint::client()?;
    let r = endpoint
        .auth(client.post(endpoint.url("/v1/statements")))
        .json(&serde_json::json!({"statement": statement, "format": "json"}))
        .send()
        .await
        .map_err(|e| CliError::Http(e.to_string()))?;
    let (status, mut body) = json_body(r).await?;
    if status >= 400 {
        return Err(CliError::Refused {
            status,
            message: message(&body),
        });
    }
    // A long statement answers with its id first; poll it.
    while body["status"] == "running" || body["status"] == "pending" {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let id = body["statement_id"].as_str().unwrap_or_default().to_owned();
        let r = endpoint
            .auth(client.get(endpoint.url(&format!("/v1/statements/{id}"))))
            .send()
            .await
            .map_err(|e| CliError::Http(e.to_string()))?;
        body = json_body(r).await?.1;
    }
    if body["status"] != "finished" {
        return Err(CliError::Statement(
            body["message"]
                .as_str()
                .map_or_else(|| body.to_string(), str::to_owned),
        ));
    }
    let set = &body["result_set"];
    let columns = set["metadata"]["fields"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| {
            (
                f["name"].as_str().unwrap_or_default().to_owned(),
                f["data_type"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let rows = set["rows"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|row| {
            row.as_array()
                .into_iter()
                .flatten()
                .map(|c| c.as_str().map(str::to_owned))
                .collect()
        })
        .collect();
    Ok(ResultSet { columns, rows })
}

/// Formats a result set.
pub fn render(set: &ResultSet, format: OutputFormat) -> String {
    match format {
        OutputFormat::Table => render_table(set),
        OutputFormat::Csv => {
            let mut out = String::new();
            let line = |cells: Vec<String>| cells.join(",") + "\n";
            out += &line(set.columns.iter().map(|(n, _)| csv_cell(n)).collect());
            for row in &set.rows {
                out += &line(
                    row.iter()
                        .map(|c| c.as_deref().map(csv_cell).unwrap_or_default())
                        .collect(),
                );
            }
            out
        }
        OutputFormat::Json => {
            let mut out = String::new();
            for row in &set.rows {
                let object: serde_json::Map<String, Value> = set
                    .columns
                    .iter()
                    .zip(row)
                    .map(|((name, _), cell)| {
                        (
                            name.clone(),
                            cell.clone().map_or(Value::Null, Value::String),
                        )
                    })
                    .collect();
                out += &Value::Object(object).to_string();
                out.push('\n');
            }
            out
        }
    }
}

fn csv_cell(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

fn render_table(set: &ResultSet) -> String {
    let cell = |c: &Option<String>| c.clone().unwrap_or_else(|| "NULL".into());
    let mut widths: Vec<usize> = set
        .columns
        .iter()
        .map(|(n, t)| n.chars().count().max(t.chars().count()))
        .collect();
    for row in &set.rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell(c).chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        padded.join(" | ").trim_end().to_owned() + "\n"
    };
    let mut out = line(set.columns.iter().map(|(n, _)| n.clone()).collect());
    out += &line(set.columns.iter().map(|(_, t)| t.clone()).collect());
    out += &(widths
        .iter()
        .map(|w| "-".repeat(*w))
        .collect::<Vec<_>>()
        .join("-+-")
        + "\n");
    for row in &set.rows {
        out += &line(row.iter().map(cell).collect());
    }
    out += &format!(
        "({} row{})\n",
        set.rows.len(),
        if set.rows.len() == 1 { "" } else { "s" }
    );
    out
}

/// The catalog's tables as `db.schema.table (col type, ...)` lines.
pub async fn tables(endpoint: &Endpoint) -> Result<String, CliError> {
    let client = Endpoint::client()?;
    let r = endpoint
        .auth(client.get(endpoint.url("/v1/catalog")))
        .send()
        .await
        .map_err(|e| CliError::Http(e.to_string()))?;
    let (status, body) = json_body(r).await?;
    if status >= 400 {
        return Err(CliError::Refused {
            status,
            message: message(&body),
        });
    }
    let mut out = String::new();
    let list = |v: &Value, key: &str| v[key].as_array().cloned().unwrap_or_default();
    for db in list(&body, "databases") {
        for schema in list(&db, "schemas") {
            for table in list(&schema, "tables") {
                let columns: Vec<String> = list(&table, "columns")
                    .iter()
                    .map(|c| {
                        format!(
                            "{} {}",
                            c["name"].as_str().unwrap_or_default(),
                            c["data_type"].as_str().unwrap_or_default()
                        )
                    })
                    .collect();
                out += &format!(
                    "{}.{}.{} ({})\n",
                    db["name"].as_str().unwrap_or_default(),
                    schema["name"].as_str().unwrap_or_default(),
                    table["name"].as_str().unwrap_or_default(),
                    columns.join(", ")
                );
            }
        }
    }
    Ok(out)
}

/// A batch of NDJSON lines from one file.
#[derive(Debug, Clone)]
pub struct Batch {
    /// The file.
    pub file: PathBuf,
    /// 1-based line numbers of its first and last line.
    pub first_line: u64,
    /// Last line.
    pub last_line: u64,
    /// Rows (non-blank lines).
    pub rows: u64,
    /// The NDJSON body.
    pub body: Vec<u8>,
    /// Line number of each row, for mapping the server's `row_index` back to the file.
    row_lines: Vec<u64>,
}

/// Splits a file (plain or gzip) into batches of at most `max_bytes` and `max_rows`.
pub(crate) fn batches(
    path: &Path,
    max_bytes: usize,
    max_rows: usize,
) -> Result<Vec<Batch>, CliError> {
    let read_error = |source| CliError::Read {
        path: path.display().to_string(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(read_error)?;
    let mut magic = [0u8; 2];
    let n = file.read(&mut magic).map_err(read_error)?;
    let file = std::fs::File::open(path).map_err(read_error)?;
    let reader: Box<dyn std::io::Read> = if n == 2 && magic == [0x1f, 0x8b] {
        Box::new(flate2::read::MultiGzDecoder::new(file))
    } else {
        Box::new(file)
    };
    let mut out = Vec::new();
    let mut current: Option<Batch> = None;
    let mut line_no = 0u64;
    for line in BufReader::new(reader).split(b'\n') {
        let line = line.map_err(read_error)?;
        line_no += 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if line.len() + 1 > max_bytes {
            return Err(CliError::Usage(format!(
                "{}: line {line_no} is longer than a batch may be ({max_bytes} bytes)",
                path.display()
            )));
        }
        let full = current.as_ref().is_some_and(|b| {
            b.body.len() + line.len() + 1 > max_bytes || b.rows as usize >= max_rows
        });
        if full {
            out.extend(current.take());
        }
        let batch = current.get_or_insert_with(|| Batch {
            file: path.to_owned(),
            first_line: line_no,
            last_line: line_no,
            rows: 0,
            body: Vec::new(),
            row_lines: Vec::new(),
        });
        batch.body.extend_from_slice(&line);
        batch.body.push(b'\n');
        batch.rows += 1;
        batch.last_line = line_no;
        batch.row_lines.push(line_no);
    }
    out.extend(current);
    Ok(out)
}

/// What became of one batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchOutcome {
    /// Committed.
    Committed(u64),
    /// Refused, nothing applied; the messages (row errors with file line numbers).
    Rejected(Vec<String>),
    /// Possibly applied: reconcile before sending it again.
    Unknown(String),
}

/// The result of `sluice ingest`.
#[derive(Debug, Default)]
pub struct IngestReport {
    /// Rows committed.
    pub rows: u64,
    /// Batches per outcome, in file order: `(batch, outcome)`.
    pub outcomes: Vec<(Batch, BatchOutcome)>,
}

impl IngestReport {}

async fn send_batch(
    client: &reqwest::Client,
    endpoint: &Endpoint,
    url: &str,
    batch: &Batch,
) -> BatchOutcome {
    let mut delay = Duration::from_millis(200);
    for attempt in 0.. {
        let sent = endpoint
            .auth(client.post(url))
            .header("content-type", "application/x-ndjson")
            .body(batch.body.clone())
            .send()
            .await;
        let response = match sent {
            Ok(r) => r,
            // Nothing reached the server: safe to try again.
            Err(e) if e.is_connect() && attempt < 8 => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(10));
                continue;
            }
            Err(e) if e.is_connect() => return BatchOutcome::Rejected(vec![e.to_string()]),
            Err(e) => return BatchOutcome::Unknown(e.to_string()),
        };
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let (status, body) = match json_body(response).await {
            Ok(x) => x,
            Err(e) => return BatchOutcome::Unknown(e.to_string()),
        };
        match status {
            200 => return BatchOutcome::Committed(body["num_rows_inserted"].as_u64().unwrap_or(0)),
            429 | 503 if attempt < 8 => {
                let wait = retry_after.map_or(delay, Duration::from_secs).max(delay);
                tokio::time::sleep(wait).await;
                delay = (delay * 2).min(Duration::from_secs(10));
            }
            _ if body["details"]["status"] == "unknown"
                || status >= 500 && body["details"]["status"] != "rejected" =>
            {
                return BatchOutcome::Unknown(format!("{status}: {}", message(&body)));
            }
            _ => {
                let mut messages = vec![format!("{status}: {}", message(&body))];
                for e in body["details"]["row_errors"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    let index = e["row_index"].as_u64().unwrap_or(0) as usize;
                    let line = batch.row_lines.get(index).copied().unwrap_or(0);
                    messages.push(format!(
                        "  {}:{line}: {}{}",
                        batch.file.display(),
                        e["column"]
                            .as_str()
                            .map(|c| format!("column {c}: "))
                            .unwrap_or_default(),
                        e["message"].as_str().unwrap_or_default()
                    ));
                }
                if body["details"]["row_errors_truncated"] == true {
                    messages.push("  (more row errors not listed)".into());
                }
                return BatchOutcome::Rejected(messages);
            }
        }
    }
    BatchOutcome::Unknown("gave up retrying".into())
}

/// Streams files into `db.schema.table` over `connections` concurrent requests, in batches of
/// at most `BATCH_BYTES` and `batch_rows`. Progress goes to stderr: a bar on a terminal, one
/// line per batch otherwise.
pub async fn ingest(
    endpoint: &Endpoint,
    table: &str,
    files: &[PathBuf],
    connections: usize,
    batch_rows: usize,
) -> Result<IngestReport, CliError> {
    let parts: Vec<&str> = table.split('.').collect();
    let [db, schema, name] = parts.as_slice() else {
        return Err(CliError::Usage(format!(
            "--table {table:?}: use db.schema.table"
        )));
    };
    let url = endpoint.url(&format!(
        "/v1/catalog/databases/{db}/schemas/{schema}/tables/{name}/ingest"
    ));
    let mut all = Vec::new();
    for f in files {
        all.extend(batches(f, BATCH_BYTES, batch_rows.min(BATCH_ROWS))?);
    }
    let total_bytes: u64 = all.iter().map(|b| b.body.len() as u64).sum();
    let total_rows: u64 = all.iter().map(|b| b.rows).sum();
    let bar = if std::io::stderr().is_terminal() {
        let bar = indicatif::ProgressBar::new(total_bytes);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        Some(bar)
    } else {
        None
    };
    let client = Endpoint::client()?;
    let started = Instant::now();
    let semaphore = Arc::new(tokio::sync::Semaphore::new(connections.max(1)));
    let mut tasks = Vec::new();
    for batch in all {
        let permit = semaphore
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| CliError::Http(e.to_string()))?;
        let client = client.clone();
        let endpoint = endpoint.clone();
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let outcome = send_batch(&client, &endpoint, &url, &batch).await;
            drop(permit);
            (batch, outcome)
        }));
    }
    let mut report = IngestReport::default();
    let mut done_bytes = 0u64;
    for task in tasks {
        let (batch, outcome) = task.await.map_err(|e| CliError::Http(e.to_string()))?;
        done_bytes += batch.body.len() as u64;
        if let BatchOutcome::Committed(rows) = outcome {
            report.rows += rows;
        }
        let summary = format!(
            "{}:{}-{}: {}",
            batch.file.display(),
            batch.first_line,
            batch.last_line,
            match &outcome {
                BatchOutcome::Committed(r) => format!("committed {r} rows"),
                BatchOutcome::Rejected(_) => "REJECTED (nothing applied)".into(),
                BatchOutcome::Unknown(e) =>
                    format!("UNKNOWN outcome ({e}): reconcile before resending"),
            }
        );
        match &bar {
            Some(bar) => {
                bar.set_position(done_bytes);
                bar.set_message(format!("{} of {total_rows} rows", report.rows));
                if !matches!(outcome, BatchOutcome::Committed(_)) {
                    bar.println(summary);
                }
            }
            None => {
                let secs = started.elapsed().as_secs_f64().max(1e-3);
                eprintln!(
                    "{summary} [{} of {total_rows} rows, {:.1} MB/s]",
                    report.rows,
                    done_bytes as f64 / secs / 1e6
                );
            }
        }
        report.outcomes.push((batch, outcome));
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(report)
}
