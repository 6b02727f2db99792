//! The client side of the `sluice` command: `ingest`, `query` and `tables` against a running
//! server, over the same HTTP APIs as every other client.

use std::time::Duration;

use serde_json::Value;

mod ingest;

pub use ingest::{BATCH_ROWS, BatchInfo, BatchOutcome, IngestOptions, IngestReport, Input, ingest};

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
