//! The two contracts sluice was built from, statement by statement on the wire:
//! `testdata/contracts/wire.toml` holds one row per statement of `table-ingest.md` (ScopeDB's
//! Append rows over HTTP) and `stream-append.md` (Ursula's stream Append), and of the Append
//! section of `durable-streams.md` (what the protocol adds to Ursula's Append), and
//! [`every_statement_of_the_two_contracts_holds_on_the_wire`] runs every row against the real
//! `sluice serve` on loopback. The file's header says how a row reads.
//!
//! Rows share one server per profile (`[server.*]` in the table) unless they need their own
//! (`fresh`); stream rows run once per URL layout (`/{bucket}/{stream}` and
//! `/v1/stream/{name}`), each on a stream of its own; table rows keep apart by a key column
//! holding the row's tag. A row that does not hold fails the test with its id; none is
//! skipped. A row with no requests must say why: a deliberate difference (`differs`, which
//! the README's list must name), or the test that covers it where the binary alone cannot
//! (`covered_by`, checked to exist). A malformed row (an unknown key, a step of no kind or two,
//! a key its kind ignores, a value of the wrong type, an unknown layout or profile) fails as a
//! row, as does a server that does not start; nothing in a row panics the runner. A write step
//! with `until` is sent again only while its answer says it applied nothing.
//!
//! The refusal headers of every kind of 503 an Append route gives (log disk pressure, the
//! request-body budget, an owner that is gone, a server that is stopping) are rows of the
//! table, on both layouts, for `POST` and `PUT`; [`every_kind_of_append_refusal_has_a_row`]
//! keeps a kind from dropping out of it. The one statement the binary cannot be driven to
//! (an outcome that is `unknown`) is [`an_ingest_whose_log_write_failed_answers_unknown`],
//! through the log's fault hook, which only a server in this process has.

use std::collections::HashMap;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::common;

/// The table of statements.
const TABLE: &str = include_str!("../../testdata/contracts/wire.toml");

/// This file, for checking that the tests rows name in `covered_by` exist.
const THIS_FILE: &str = include_str!("contracts.rs");

/// The README, which lists every row that states a deliberate difference.
const README: &str = include_str!("../../README.md");

/// The API key every server of the table runs with; requests carry it as the contracts'
/// examples do (`Authorization: Bearer <api-key>`).
const KEY: &str = "wire-contract-key";

/// Where the catalog's tables are, for `{tables}` in a row.
const TABLES: &str = "/v1/catalog/databases/scopedb/schemas/public/tables";

/// How long a row's step may retry (`until`) before its last answer counts.
const UNTIL: Duration = Duration::from_secs(30);

/// The nodes of one server profile, by name; the first is where a step without `node` goes.
/// Dropped, it stops them and removes their data.
struct Server {
    nodes: Vec<(String, Node)>,
}

/// One `sluice serve` process of a profile.
type Node = common::Server;

impl Drop for Server {
    fn drop(&mut self) {
        for (_, node) in self.nodes.drain(..) {
            let dir = node.dir.clone();
            drop(node);
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Server {
    fn node(&mut self, name: Option<&str>) -> Result<&mut Node, String> {
        match name {
            None => self.nodes.first_mut().map(|(_, n)| n),
            Some(name) => self
                .nodes
                .iter_mut()
                .find(|(n, _)| n == name)
                .map(|(_, n)| n),
        }
        .ok_or_else(|| format!("no node {name:?}"))
    }
}

/// Starts the nodes of server profile `name` (`[server.name]`: `config` for its file,
/// `args` for its flags, `nodes` to run several on one object store, `object_store = "s3"`
/// for the test S3 server) and creates the table's catalog tables on the first.
async fn start_server(name: &str, profile: &Value, tables: &Value) -> Result<Server, String> {
    let node_names: Vec<String> = match &profile["nodes"] {
        Value::Null => vec!["main".to_owned()],
        Value::Array(names) if !names.is_empty() => names
            .iter()
            .map(|n| n.as_str().map(str::to_owned))
            .collect::<Option<_>>()
            .ok_or_else(|| format!("server {name}: nodes must be names"))?,
        other => {
            return Err(format!(
                "server {name}: nodes must be a list of names: {other}"
            ));
        }
    };
    let mut args: Vec<String> = vec!["--api-key".into(), KEY.into()];
    match profile["object_store"].as_str() {
        None => {}
        Some("s3") => {
            let base = std::env::var("SLUICE_TEST_S3_URL").map_err(|_| {
                "SLUICE_TEST_S3_URL is not set: the table's cluster rows run two nodes on a \
                 shared S3 server; run the tests with `bash tests/run.sh`"
                    .to_owned()
            })?;
            let unique = common::temp_dir("wire-s3");
            let unique = unique
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            args.extend(["--object-store".into(), format!("{base}/{unique}-{name}")]);
        }
        Some(other) => return Err(format!("unknown object_store {other:?} in server {name}")),
    }
    for arg in profile["args"].as_array().into_iter().flatten() {
        let arg = arg
            .as_str()
            .ok_or_else(|| format!("server {name}: args must be strings"))?;
        args.push(arg.to_owned());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let config = profile["config"].as_str().unwrap_or("");
    let mut nodes = Vec::new();
    for node in node_names {
        nodes.push((
            node.clone(),
            common::Server::start(&format!("wire-{name}-{node}"), &args, config),
        ));
    }
    let server = Server { nodes };
    let client = client();
    let base = &server.nodes[0].1.base;
    for (table, def) in tables.as_object().into_iter().flatten() {
        let r = client
            .put(format!("{base}{TABLES}/{table}"))
            .bearer_auth(KEY)
            .json(&json!({"name": table, "comment": null, "columns": def["columns"]}))
            .send()
            .await
            .map_err(|e| format!("creating table {table}: {e}"))?;
        if r.status() != 200 {
            return Err(format!("creating table {table}: {}", r.status()));
        }
    }
    Ok(server)
}

/// A connection per request: a server may close a connection whose request it refused
/// before reading all of it, and reusing a pooled one would race that close.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap_or_default()
}

/// An answer, from reqwest or read off a held connection.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.header_values(name).into_iter().next()
    }

    /// Every value the answer carries for header `name`, in order.
    fn header_values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// Whether the answer says it applied nothing (sluice's refusal header), so sending the
    /// request again cannot write it twice.
    fn applied_nothing(&self) -> bool {
        self.header("x-sluice-not-applied").is_some()
    }

    fn describe(&self) -> String {
        let body = String::from_utf8_lossy(&self.body);
        let body: String = body.chars().take(600).collect();
        format!("{} {:?} {body}", self.status, self.headers)
    }
}

/// What one row run knows: its variables (`{name}` in any string of a step) and the
/// connections it holds open.
struct Run {
    vars: HashMap<String, String>,
    holds: HashMap<String, tokio::net::TcpStream>,
}

impl Run {
    /// `text` with every `{name}` of a known variable replaced; other braces stay.
    fn subst(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let after = &rest[open + 1..];
            let name_len = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            match self.vars.get(&after[..name_len]) {
                Some(value) if after[name_len..].starts_with('}') => {
                    out.push_str(value);
                    rest = &after[name_len + 1..];
                }
                _ => {
                    out.push('{');
                    rest = after;
                }
            }
        }
        out.push_str(rest);
        out
    }

    /// `value` with [`Run::subst`] applied to every string in it.
    fn subst_value(&self, value: &Value) -> Value {
        match value {
            Value::String(s) => Value::String(self.subst(s)),
            Value::Array(a) => Value::Array(a.iter().map(|v| self.subst_value(v)).collect()),
            Value::Object(m) => Value::Object(
                m.iter()
                    .map(|(k, v)| (k.clone(), self.subst_value(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
}

/// Checks that `actual` holds everything `expected` says: objects by their keys (others may
/// be there too), arrays element by element, `"*"` for any value but null, else equality.
fn subset(expected: &Value, actual: &Value, path: &str) -> Result<(), String> {
    match expected {
        Value::String(s) if s == "*" => {
            if actual.is_null() {
                Err(format!("{path}: missing"))
            } else {
                Ok(())
            }
        }
        Value::Object(fields) => {
            for (k, v) in fields {
                subset(
                    v,
                    actual.get(k).unwrap_or(&Value::Null),
                    &format!("{path}/{k}"),
                )?;
            }
            Ok(())
        }
        Value::Array(items) => match actual.as_array() {
            Some(actual) if actual.len() == items.len() => {
                for (i, (e, a)) in items.iter().zip(actual).enumerate() {
                    subset(e, a, &format!("{path}/{i}"))?;
                }
                Ok(())
            }
            _ => Err(format!("{path}: expected {expected}, found {actual}")),
        },
        _ if expected == actual => Ok(()),
        _ => Err(format!("{path}: expected {expected}, found {actual}")),
    }
}

/// Checks an answer against a step's `expect`, then takes its `capture`s.
fn check(answer: &Answer, expect: &Value, run: &mut Run, step: &Value) -> Result<(), String> {
    let fail = |what: String| Err(format!("{what}; answer: {}", answer.describe()));
    match &expect["status"] {
        Value::Null => {}
        status if status.as_u64() == Some(u64::from(answer.status)) => {}
        Value::Number(status) => {
            return fail(format!("status {} instead of {status}", answer.status));
        }
        other => return Err(format!("expect.status must be an integer, not {other}")),
    }
    for (name, value) in expect["headers"].as_object().into_iter().flatten() {
        let value = value
            .as_str()
            .ok_or_else(|| format!("expect.headers.{name} must be a string"))?;
        // Every value sent under the name must hold, so a duplicated header can't hide.
        let values = answer.header_values(name);
        if values.is_empty() {
            return fail(format!("no header {name}"));
        }
        if value != "*"
            && let Some(got) = values.iter().find(|got| **got != value)
        {
            return fail(format!(
                "header {name}: {got:?} instead of {value:?} (all values: {values:?})"
            ));
        }
    }
    for name in expect["absent"].as_array().into_iter().flatten() {
        let name = name.as_str().ok_or("expect.absent must list names")?;
        if answer.header(name).is_some() {
            return fail(format!("header {name} should be absent"));
        }
    }
    match &expect["body"] {
        Value::Null => {}
        Value::String(body) if answer.body == body.as_bytes() => {}
        Value::String(body) => return fail(format!("body is not {body:?}")),
        other => return Err(format!("expect.body must be a string, not {other}")),
    }
    if expect["empty"].as_bool() == Some(true) && !answer.body.is_empty() {
        return fail("body is not empty".into());
    }
    for part in expect["contains"].as_array().into_iter().flatten() {
        let part = part.as_str().ok_or("expect.contains must list texts")?;
        if !String::from_utf8_lossy(&answer.body).contains(part) {
            return fail(format!("body does not contain {part:?}"));
        }
    }
    let wants_json = ["json", "json_exact", "json_absent"]
        .iter()
        .any(|k| !expect[*k].is_null());
    if wants_json {
        let Ok(body) = serde_json::from_slice::<Value>(&answer.body) else {
            return fail("body is not JSON".into());
        };
        if !expect["json"].is_null()
            && let Err(e) = subset(&expect["json"], &body, "")
        {
            return fail(e);
        }
        if !expect["json_exact"].is_null() && expect["json_exact"] != body {
            return fail(format!("body is not exactly {}", expect["json_exact"]));
        }
        for key in expect["json_absent"].as_array().into_iter().flatten() {
            let key = key.as_str().ok_or("expect.json_absent must list keys")?;
            if body.get(key).is_some() {
                return fail(format!("body has key {key}"));
            }
        }
    }
    for (var, from) in step["capture"].as_object().into_iter().flatten() {
        let from = from
            .as_str()
            .ok_or("capture must name a header or a pointer")?;
        let value = if from.starts_with('/') {
            let body: Value = serde_json::from_slice(&answer.body).unwrap_or(Value::Null);
            body.pointer(from).map(|v| match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
        } else {
            answer.header(from).map(str::to_owned)
        };
        match value {
            Some(v) => {
                run.vars.insert(var.clone(), v);
            }
            None => return fail(format!("nothing to capture as {var} from {from}")),
        }
    }
    Ok(())
}

/// Splits a step's `req` ("METHOD path") into its method and path; `ingest = "table"` is
/// short for `req = "POST {tables}/table/ingest"`.
fn request_line(run: &Run, step: &Value) -> Result<(reqwest::Method, String), String> {
    let req = match step["ingest"].as_str() {
        Some(table) => format!("POST {TABLES}/{table}/ingest"),
        None => run.subst(step["req"].as_str().ok_or("a request step needs req")?),
    };
    let (method, path) = req
        .split_once(' ')
        .ok_or_else(|| format!("req {req:?} is not METHOD path"))?;
    Ok((
        method.parse().map_err(|_| format!("bad method {method}"))?,
        path.to_owned(),
    ))
}

/// The bytes of a body spec (`common::build_bytes`), or why the spec is not one.
fn bytes_of(spec: &Value) -> Result<Vec<u8>, String> {
    std::panic::catch_unwind(|| common::build_bytes(spec))
        .map_err(|_| format!("not a body spec: {spec}"))
}

/// The headers a step sends, with values built from their specs.
fn step_headers(run: &Run, step: &Value) -> Result<Vec<(String, Vec<u8>)>, String> {
    let mut headers = Vec::new();
    if step["auth"].as_bool() != Some(false) {
        headers.push((
            "authorization".to_owned(),
            format!("Bearer {KEY}").into_bytes(),
        ));
    }
    let fields = step["headers"].as_object();
    if step["ingest"].is_string() && fields.is_none_or(|h| !h.contains_key("content-type")) {
        headers.push(("content-type".to_owned(), b"application/x-ndjson".to_vec()));
    }
    for (name, spec) in fields.into_iter().flatten() {
        headers.push((name.clone(), bytes_of(&run.subst_value(spec))?));
    }
    Ok(headers)
}

/// The body a step sends: `body` (a spec) or `json` (sent as JSON).
fn step_body(run: &Run, step: &Value) -> Result<Option<Vec<u8>>, String> {
    if !step["json"].is_null() {
        return Ok(Some(
            run.subst_value(&step["json"]).to_string().into_bytes(),
        ));
    }
    if step["body"].is_null() {
        return Ok(None);
    }
    bytes_of(&run.subst_value(&step["body"])).map(Some)
}

/// Sends one HTTP step and reads its whole answer (two minutes at most).
async fn send(node: &Node, run: &Run, step: &Value) -> Result<Answer, String> {
    let (method, path) = request_line(run, step)?;
    let mut request = client().request(method, format!("{}{path}", node.base));
    for (name, value) in step_headers(run, step)? {
        let value = reqwest::header::HeaderValue::from_bytes(&value)
            .map_err(|e| format!("header {name}: {e}"))?;
        request = request.header(name, value);
    }
    if !step["json"].is_null() {
        request = request.header("content-type", "application/json");
    }
    if let Some(body) = step_body(run, step)? {
        request = request.body(body);
    }
    let response = tokio::time::timeout(Duration::from_secs(120), async {
        let response = request.send().await?;
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let body = response.bytes().await?.to_vec();
        Ok::<_, reqwest::Error>(Answer {
            status,
            headers,
            body,
        })
    })
    .await
    .map_err(|_| "no whole answer in two minutes".to_owned())?;
    response.map_err(|e| format!("request failed: {e}"))
}

/// Runs a statement (`query`) and returns the statement's final payload as an answer.
async fn query(node: &Node, run: &Run, step: &Value) -> Result<Answer, String> {
    let sql = run.subst(step["query"].as_str().ok_or("query must be a statement")?);
    let client = client();
    let r = client
        .post(format!("{}/v1/statements", node.base))
        .bearer_auth(KEY)
        .json(&json!({"statement": sql}))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let mut status = r.status().as_u16();
    let mut body: Value = r.json().await.map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while body["status"] == "running" && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let id = body["statement_id"].as_str().unwrap_or_default().to_owned();
        let r = client
            .get(format!("{}/v1/statements/{id}", node.base))
            .bearer_auth(KEY)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        status = r.status().as_u16();
        body = r.json().await.map_err(|e| e.to_string())?;
    }
    Ok(Answer {
        status,
        headers: Vec::new(),
        body: body.to_string().into_bytes(),
    })
}

/// Opens a connection that sends a request's head declaring `length` body bytes and the
/// bytes of `send`, and keeps it open (a body still arriving).
async fn hold(node: &Node, run: &Run, step: &Value) -> Result<tokio::net::TcpStream, String> {
    let (method, path) = request_line(run, step)?;
    let length = step["length"].as_u64().ok_or("a hold needs length")?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1:{}\r\ncontent-length: {length}\r\n",
        node.port
    )
    .into_bytes();
    for (name, value) in step_headers(run, step)? {
        head.extend_from_slice(name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(&value);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    head.extend_from_slice(&bytes_of(&run.subst_value(&step["send"]))?);
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", node.port))
        .await
        .map_err(|e| e.to_string())?;
    stream.write_all(&head).await.map_err(|e| e.to_string())?;
    Ok(stream)
}

/// The body of a chunked answer if `raw` holds all of it (through the last chunk and the
/// trailers' end), or why it is not a chunked body.
fn dechunk(mut raw: &[u8]) -> Result<Option<Vec<u8>>, String> {
    let mut body = Vec::new();
    loop {
        let Some(line_end) = raw.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let size_text = String::from_utf8_lossy(&raw[..line_end]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            // Trailers (none expected) end with an empty line.
            return Ok(raw.windows(2).position(|w| w == b"\r\n").map(|_| body));
        }
        if raw.len() < size + 2 {
            return Ok(None);
        }
        body.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

/// Reads the answer of a held connection (a minute at most): status line, headers and a
/// body of its `content-length`, or chunked.
async fn answer_of(stream: &mut tokio::net::TcpStream) -> Result<Answer, String> {
    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), async {
        let mut buf = [0u8; 4096];
        loop {
            if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&raw[..end]).into_owned();
                let field = |name: &str| {
                    head.lines()
                        .filter_map(|l| l.split_once(':'))
                        .find(|(n, _)| n.trim().eq_ignore_ascii_case(name))
                        .map(|(_, v)| v.trim().to_ascii_lowercase())
                };
                if field("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
                    if let Some(body) = dechunk(&raw[end + 4..])? {
                        return Ok((head, body));
                    }
                } else {
                    let length = match field("content-length") {
                        None => 0,
                        Some(v) => v
                            .parse::<usize>()
                            .map_err(|_| format!("bad content-length {v:?}"))?,
                    };
                    if raw.len() >= end + 4 + length {
                        return Ok((head, raw[end + 4..end + 4 + length].to_vec()));
                    }
                }
            }
            match stream.read(&mut buf).await {
                Ok(0) => return Err(format!("the connection closed after {raw:?}")),
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                Err(e) => return Err(format!("reading the answer: {e}")),
            }
        }
    })
    .await
    .map_err(|_| "no answer on the held connection in a minute".to_owned())??;
    let (head, body) = read;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line in {head:?}"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok(Answer {
        status,
        headers,
        body,
    })
}

/// Runs one step of a row.
async fn run_step(server: &mut Server, run: &mut Run, step: &Value) -> Result<(), String> {
    if let Some(ms) = step["sleep_ms"].as_u64() {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        return Ok(());
    }
    let node_name = step["node"].as_str();
    if let Some(signal) = step["signal"].as_str() {
        let node = server.node(node_name)?;
        match signal {
            "KILL" => node.child.kill().map_err(|e| e.to_string())?,
            "TERM" => {
                let pid = node.child.id().to_string();
                let status = Command::new("kill")
                    .args(["-TERM", &pid])
                    .status()
                    .map_err(|e| e.to_string())?;
                if !status.success() {
                    return Err(format!("kill -TERM {pid} failed"));
                }
            }
            other => return Err(format!("unknown signal {other}")),
        }
        return Ok(());
    }
    if step["exits"].as_bool() == Some(true) {
        let node = server.node(node_name)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match node.child.try_wait().map_err(|e| e.to_string())? {
                Some(status) if status.success() => return Ok(()),
                Some(status) => return Err(format!("the server exited with {status}")),
                None if Instant::now() > deadline => {
                    return Err("the server did not exit in 30 s".into());
                }
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    if let Some(name) = step["release"].as_str() {
        run.holds
            .remove(name)
            .ok_or_else(|| format!("no held connection {name}"))?;
        return Ok(());
    }
    if let Some(name) = step["hold"].as_str() {
        let stream = hold(server.node(node_name)?, run, step).await?;
        run.holds.insert(name.to_owned(), stream);
        return Ok(());
    }
    if let Some(name) = step["answer_of"].as_str() {
        let expect = run.subst_value(&step["expect"]);
        let stream = run
            .holds
            .get_mut(name)
            .ok_or_else(|| format!("no held connection {name}"))?;
        let answer = answer_of(stream).await?;
        return check(&answer, &expect, run, step);
    }
    let times = step["repeat"].as_u64().unwrap_or(1);
    let until = step["until"].as_bool() == Some(true);
    // Reads and statements may be sent again freely (a statement step runs SELECTs).
    let safe = step["query"].is_string()
        || request_line(run, step).is_ok_and(|(method, _)| {
            method == reqwest::Method::GET || method == reqwest::Method::HEAD
        });
    for i in 0..times {
        run.vars.insert("i".into(), i.to_string());
        let expect = run.subst_value(&step["expect"]);
        let started = Instant::now();
        let mut last: Option<String> = None;
        loop {
            let node = server.node(node_name)?;
            let answer = if step["query"].is_string() {
                query(node, run, step).await
            } else {
                send(node, run, step).await
            };
            // A write is sent again only when its answer says it applied nothing; one that
            // may have applied (or whose answer never came) fails the step as it is.
            let again = match &answer {
                Ok(a) => safe || a.applied_nothing(),
                Err(_) => safe,
            };
            let result = answer.and_then(|a| {
                if step["query"].is_string() {
                    check_query(&a, &expect)
                } else {
                    check(&a, &expect, run, step)
                }
            });
            match result {
                Err(e) if until && started.elapsed() < UNTIL && again => {
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) if until && !again => {
                    return Err(format!(
                        "{e} (not sent again: the write may have applied; earlier: {last:?})"
                    ));
                }
                Err(e) if times > 1 => return Err(format!("repetition {i}: {e}")),
                other => {
                    other?;
                    break;
                }
            }
        }
    }
    Ok(())
}

/// Checks a statement's payload: it finished, with exactly the rows `expect.rows` lists.
fn check_query(answer: &Answer, expect: &Value) -> Result<(), String> {
    let body: Value = serde_json::from_slice(&answer.body).map_err(|e| e.to_string())?;
    if answer.status != 200 || body["status"] != "finished" {
        return Err(format!(
            "the statement did not finish: {}",
            answer.describe()
        ));
    }
    let rows = &body["result_set"]["rows"];
    if !expect["rows"].is_null() && *rows != expect["rows"] {
        return Err(format!("rows {rows} instead of {}", expect["rows"]));
    }
    Ok(())
}

/// The keys a row, a step and an expectation may have: a misspelt one would check nothing.
const ROW_KEYS: &[&str] = &[
    "id",
    "spec",
    "section",
    "says",
    "differs",
    "covered_by",
    "server",
    "fresh",
    "layouts",
    "create",
    "do",
];

/// The kinds of step, each by the key that makes it one, with the keys it may have besides
/// (a key that a kind ignores, such as an `expect` on a `sleep_ms`, would check nothing).
const STEP_KINDS: &[(&str, &[&str])] = &[
    (
        "req",
        &[
            "headers", "body", "json", "auth", "node", "repeat", "until", "expect", "capture",
        ],
    ),
    (
        "ingest",
        &[
            "headers", "body", "json", "auth", "node", "repeat", "until", "expect", "capture",
        ],
    ),
    ("query", &["node", "repeat", "until", "expect"]),
    (
        "hold",
        &["req", "ingest", "headers", "auth", "node", "length", "send"],
    ),
    ("answer_of", &["expect", "capture"]),
    ("release", &[]),
    ("signal", &["node"]),
    ("exits", &["node"]),
    ("sleep_ms", &[]),
];
const EXPECT_KEYS: &[&str] = &[
    "status",
    "headers",
    "absent",
    "body",
    "empty",
    "contains",
    "json",
    "json_exact",
    "json_absent",
    "rows",
];

/// The URL layouts a stream row runs on, and the one a table row runs on.
const LAYOUTS: &[&str] = &["ursula", "protocol", "none"];

/// Fails on a key of `value` (an object, or nothing) that `known` does not list.
fn known_keys(value: &Value, known: &[&str], id: &str) -> Result<(), String> {
    match value.as_object() {
        Some(fields) => match fields.keys().find(|k| !known.contains(&k.as_str())) {
            Some(key) => Err(format!("{id}: unknown key {key:?} in {value}")),
            None => Ok(()),
        },
        None if value.is_null() => Ok(()),
        None => Err(format!("{id}: expected a table, found {value}")),
    }
}

/// Fails unless `value` is absent or of the type `is` accepts.
fn typed(value: &Value, is: fn(&Value) -> bool, what: &str, id: &str) -> Result<(), String> {
    if value.is_null() || is(value) {
        Ok(())
    } else {
        Err(format!("{id}: {what}, not {value}"))
    }
}

fn strings(value: &Value) -> bool {
    value
        .as_array()
        .is_some_and(|a| a.iter().all(Value::is_string))
}

fn string_map(value: &Value) -> bool {
    value
        .as_object()
        .is_some_and(|m| m.values().all(Value::is_string))
}

/// Checks one step's shape: one kind, only that kind's keys, values of the right types.
fn check_step(step: &Value, id: &str) -> Result<(), String> {
    let kinds: Vec<&str> = STEP_KINDS
        .iter()
        .map(|(kind, _)| *kind)
        .filter(|kind| !step[*kind].is_null())
        .collect();
    let kind = match kinds.as_slice() {
        [one] => *one,
        ["req" | "ingest", "hold"] => "hold",
        _ => {
            return Err(format!(
                "{id}: a step must be exactly one kind of step: {step}"
            ));
        }
    };
    let allowed: Vec<&str> = STEP_KINDS
        .iter()
        .find(|(k, _)| *k == kind)
        .map(|(k, rest)| std::iter::once(*k).chain(rest.iter().copied()).collect())
        .unwrap_or_default();
    known_keys(step, &allowed, id)?;
    let expect = &step["expect"];
    known_keys(expect, EXPECT_KEYS, id)?;
    typed(&step["req"], Value::is_string, "req is \"METHOD path\"", id)?;
    typed(
        &step["ingest"],
        Value::is_string,
        "ingest names a table",
        id,
    )?;
    typed(&step["query"], Value::is_string, "query is a statement", id)?;
    typed(&step["node"], Value::is_string, "node is a name", id)?;
    typed(
        &step["repeat"],
        |v| v.as_u64().is_some_and(|n| n >= 1),
        "repeat is a count",
        id,
    )?;
    typed(
        &step["until"],
        Value::is_boolean,
        "until is true or false",
        id,
    )?;
    typed(
        &step["auth"],
        Value::is_boolean,
        "auth is true or false",
        id,
    )?;
    typed(&step["length"], Value::is_u64, "length is a byte count", id)?;
    typed(
        &step["release"],
        Value::is_string,
        "release names a hold",
        id,
    )?;
    typed(
        &step["answer_of"],
        Value::is_string,
        "answer_of names a hold",
        id,
    )?;
    typed(&step["hold"], Value::is_string, "hold is a name", id)?;
    typed(
        &step["signal"],
        |v| v == "TERM" || v == "KILL",
        "signal is TERM or KILL",
        id,
    )?;
    typed(
        &step["exits"],
        |v| *v == Value::Bool(true),
        "exits is true",
        id,
    )?;
    typed(
        &step["sleep_ms"],
        Value::is_u64,
        "sleep_ms is milliseconds",
        id,
    )?;
    typed(
        &step["capture"],
        string_map,
        "capture maps names to sources",
        id,
    )?;
    typed(
        &expect["status"],
        |v| v.as_u64().is_some_and(|s| (100..600).contains(&s)),
        "expect.status is an HTTP status (an integer)",
        id,
    )?;
    typed(
        &expect["headers"],
        string_map,
        "expect.headers are strings",
        id,
    )?;
    typed(&expect["absent"], strings, "expect.absent lists names", id)?;
    typed(
        &expect["body"],
        Value::is_string,
        "expect.body is a text",
        id,
    )?;
    typed(
        &expect["empty"],
        |v| *v == Value::Bool(true),
        "expect.empty is true",
        id,
    )?;
    typed(
        &expect["contains"],
        strings,
        "expect.contains lists texts",
        id,
    )?;
    typed(
        &expect["json_absent"],
        strings,
        "expect.json_absent lists keys",
        id,
    )?;
    if kind == "hold" && step["req"].is_null() && step["ingest"].is_null() {
        return Err(format!("{id}: a hold needs req or ingest: {step}"));
    }
    if matches!(kind, "req" | "ingest" | "answer_of") && expect["status"].is_null() {
        return Err(format!("{id}: a request step must expect a status: {step}"));
    }
    if kind == "query" && expect["rows"].is_null() {
        return Err(format!("{id}: a query step must expect its rows: {step}"));
    }
    if kind != "query" && !expect["rows"].is_null() {
        return Err(format!("{id}: only a query step expects rows: {step}"));
    }
    Ok(())
}

/// Where a `covered_by` test is: `contracts::name` in this file, or `src/....rs::name` in the
/// crate's sources.
fn test_exists(test: &str) -> bool {
    if let Some(name) = test.strip_prefix("contracts::") {
        return THIS_FILE.contains(&format!("fn {name}()"));
    }
    let Some((file, name)) = test.rsplit_once("::") else {
        return false;
    };
    file.starts_with("src/")
        && file.ends_with(".rs")
        && std::fs::read_to_string(format!("{}/{file}", env!("CARGO_MANIFEST_DIR")))
            .is_ok_and(|text| text.contains(&format!("fn {name}()")))
}

/// Checks a row's shape before it runs: the fields a reader needs to check it against the
/// text, and either requests or a stated reason for having none.
fn check_row(
    row: &Value,
    profiles: &Value,
    ids: &mut std::collections::HashSet<String>,
) -> Result<(), String> {
    let id = row["id"].as_str().ok_or("a row without id")?;
    if !ids.insert(id.to_owned()) {
        return Err(format!("{id}: id used twice"));
    }
    let spec = row["spec"].as_str().unwrap_or("");
    if !matches!(spec, "table-ingest" | "stream-append" | "durable-streams") {
        return Err(format!(
            "{id}: spec must be table-ingest, stream-append or durable-streams"
        ));
    }
    for field in ["section", "says"] {
        if row[field].as_str().is_none_or(str::is_empty) {
            return Err(format!("{id}: no {field}"));
        }
    }
    known_keys(row, ROW_KEYS, id)?;
    for field in ["differs", "covered_by", "server", "create"] {
        typed(
            &row[field],
            |v| v.as_str().is_some_and(|s| !s.is_empty()),
            field,
            id,
        )?;
    }
    typed(
        &row["fresh"],
        Value::is_boolean,
        "fresh is true or false",
        id,
    )?;
    typed(&row["do"], Value::is_array, "do lists steps", id)?;
    if !row["layouts"].is_null() {
        let layouts = row["layouts"]
            .as_array()
            .filter(|l| !l.is_empty())
            .ok_or_else(|| format!("{id}: layouts lists one layout at least"))?;
        for layout in layouts {
            if !layout.as_str().is_some_and(|l| LAYOUTS.contains(&l)) {
                return Err(format!(
                    "{id}: unknown layout {layout} (one of {LAYOUTS:?})"
                ));
            }
            if (layout == "none") != (spec == "table-ingest") {
                return Err(format!("{id}: layout {layout} is not for a {spec} row"));
            }
        }
    }
    let profile = row["server"].as_str().unwrap_or("default");
    if !profiles[profile].is_object() {
        return Err(format!("{id}: no server profile {profile}"));
    }
    for step in row["do"].as_array().into_iter().flatten() {
        check_step(step, id)?;
    }
    let steps = row["do"].as_array().map_or(0, Vec::len);
    if steps == 0 && row["differs"].is_null() && row["covered_by"].is_null() {
        return Err(format!(
            "{id}: a row without requests must say why (differs or covered_by)"
        ));
    }
    if row["differs"].is_string() && !README.contains(&format!("`{id}`")) {
        return Err(format!(
            "{id}: states a deliberate difference the README's list does not name"
        ));
    }
    if let Some(test) = row["covered_by"].as_str()
        && !test_exists(test)
    {
        return Err(format!(
            "{id}: covered_by names no test (contracts::name or src/file.rs::name): {test}"
        ));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_statement_of_the_two_contracts_holds_on_the_wire() {
    let table: Value = toml::from_str(TABLE).expect("wire.toml parses");
    let rows = table["row"].as_array().expect("rows");
    let profiles = &table["server"];
    let mut servers: HashMap<String, Server> = HashMap::new();
    let mut ids = std::collections::HashSet::new();
    let mut failures = Vec::new();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    let (mut runs, mut differences, mut covered) = (0, 0, 0);
    let mut slowest: Vec<(Duration, String)> = Vec::new();
    // Rows whose id starts with this, and no others, when set (for working on a few rows);
    // never in CI, where every row must run.
    let only = std::env::var("SLUICE_WIRE_ROWS").ok();
    if let Some(prefix) = &only {
        eprintln!(
            "\n*** SLUICE_WIRE_ROWS={prefix:?}: ONLY the rows whose id starts with it run; the \
             others are NOT checked ***\n"
        );
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            failures.push(format!(
                "SLUICE_WIRE_ROWS={prefix:?} is set under CI=true: every row must run there"
            ));
        }
    }
    for row in rows {
        if let Err(e) = check_row(row, profiles, &mut ids) {
            failures.push(e);
            continue;
        }
        let (Some(id), Some(spec)) = (row["id"].as_str(), row["spec"].as_str()) else {
            continue;
        };
        *counts.entry(spec).or_default() += 1;
        differences += usize::from(!row["differs"].is_null());
        covered += usize::from(!row["covered_by"].is_null());
        let steps = row["do"].as_array().cloned().unwrap_or_default();
        if steps.is_empty() || only.as_deref().is_some_and(|p| !id.starts_with(p)) {
            continue;
        }
        // check_row made sure these are known layouts.
        let layouts: Vec<String> = match row["layouts"].as_array() {
            Some(l) => l
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            None if spec != "table-ingest" => vec!["ursula".into(), "protocol".into()],
            None => vec!["none".into()],
        };
        let profile_name = row["server"].as_str().unwrap_or("default");
        let profile = &profiles[profile_name];
        for layout in layouts {
            runs += 1;
            let started = Instant::now();
            let tag = id.replace(['.', '-'], "_");
            let stream = format!(
                "{}-{}",
                id.replace(['.', '_'], "-"),
                &layout[..1.min(layout.len())]
            );
            let path = match layout.as_str() {
                "protocol" => format!("/v1/stream/wire/{stream}"),
                _ => format!("/wire/{stream}"),
            };
            let mut run = Run {
                vars: HashMap::from([
                    ("t".into(), tag),
                    ("s".into(), stream.clone()),
                    ("stream".into(), path),
                    ("tables".into(), TABLES.into()),
                ]),
                holds: HashMap::new(),
            };
            let mut fresh = None;
            let server = if row["fresh"].as_bool() == Some(true) {
                match start_server(profile_name, profile, &table["tables"]).await {
                    Ok(started) => fresh.insert(started),
                    Err(e) => {
                        failures.push(format!("{id} [{layout}]: {e}"));
                        continue;
                    }
                }
            } else {
                if !servers.contains_key(profile_name) {
                    match start_server(profile_name, profile, &table["tables"]).await {
                        Ok(started) => {
                            servers.insert(profile_name.to_owned(), started);
                        }
                        Err(e) => {
                            failures.push(format!("{id} [{layout}]: {e}"));
                            continue;
                        }
                    }
                }
                match servers.get_mut(profile_name) {
                    Some(server) => server,
                    None => continue,
                }
            };
            let mut all = Vec::new();
            if let Some(content_type) = row["create"].as_str() {
                all.push(json!({
                    "req": "PUT {stream}",
                    "headers": {"content-type": content_type},
                    "expect": {"status": 201},
                }));
            }
            all.extend(steps.iter().cloned());
            for (n, step) in all.iter().enumerate() {
                if let Err(e) = run_step(server, &mut run, step).await {
                    failures.push(format!("{id} [{layout}] step {n}: {e}"));
                    break;
                }
            }
            slowest.push((started.elapsed(), format!("{id} [{layout}]")));
        }
    }
    slowest.sort_by_key(|run| std::cmp::Reverse(run.0));
    for (took, run) in slowest.iter().take(8) {
        println!("  {took:>8.2?}  {run}");
    }
    if let Some(prefix) = &only {
        eprintln!(
            "\n*** only the rows whose id starts with {prefix:?} ran (SLUICE_WIRE_ROWS); the \
             others were NOT checked ***\n"
        );
    }
    let total: usize = counts.values().sum();
    println!(
        "wire contracts: {total} rows (table-ingest.md {}, stream-append.md {}, durable-streams.md \
         {}), {runs} runs; {differences} rows state a deliberate difference, {covered} are \
         covered by a named test",
        counts.get("table-ingest").copied().unwrap_or(0),
        counts.get("stream-append").copied().unwrap_or(0),
        counts.get("durable-streams").copied().unwrap_or(0),
    );
    assert!(
        failures.is_empty(),
        "{} of the contracts' rows do not hold:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// `table-ingest.md`: "`unknown`: The request may have committed." An ingest whose log write
/// failed (it may be in the log after a restart) answers 500 with `details.status:
/// "unknown"` and no cause; the binary cannot be made to fail a write, so this runs the server
/// in this process with the log's fault hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_whose_log_write_failed_answers_unknown() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = common::temp_dir("wire-unknown");
    let failing = Arc::new(AtomicBool::new(false));
    let mut config = sluice::db::DbConfig::new(&dir);
    let hook = failing.clone();
    config.log_fail_hook = Some(Arc::new(move |point| {
        (point == sluice::log::FailPoint::BeforeSync && hook.load(Ordering::SeqCst))
            .then(|| std::io::Error::other("disk gone"))
    }));
    let db = sluice::db::Database::open(config).await.unwrap();
    let (addr, _task) = common::serve(db, vec![]).await;
    let base = format!("http://{addr}");
    let client = client();
    common::statement(&client, &base, "CREATE TABLE u (k string)").await;
    failing.store(true, Ordering::SeqCst);
    let r = client
        .post(format!("{base}{TABLES}/u/ingest"))
        .header("content-type", "application/x-ndjson")
        .body("{\"k\":\"a\"}\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
    assert!(r.headers().get("x-ursula-not-applied").is_none());
    assert!(r.headers().get("x-sluice-not-applied").is_none());
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["details"]["status"], "unknown", "{body}");
    assert!(body.get("error").is_none(), "{body}");
}

/// Every cause sluice names, with the contract's name for it where it has one; a new cause
/// fails to compile here until it is listed (and so checked below).
fn every_cause() -> Vec<sluice::error::Cause> {
    use sluice::error::Cause::*;
    let all = vec![
        LogDiskPressure,
        LogUnavailable,
        ShuttingDown,
        LeaseExpired,
        EarlierWriteFailed,
        Fenced,
        StorageUnavailable,
        TableBackpressure,
        StatementsBusy,
        StatementMemory,
        OwnerUnavailable,
        OwnerMoved,
        BodyAdmission,
        StreamStateFull,
        AnswerMemory,
    ];
    for cause in &all {
        match cause {
            LogDiskPressure | LogUnavailable | ShuttingDown | LeaseExpired | EarlierWriteFailed
            | Fenced | StorageUnavailable | TableBackpressure | StatementsBusy
            | StatementMemory | OwnerUnavailable | OwnerMoved | BodyAdmission | StreamStateFull
            | AnswerMemory => {}
        }
    }
    all
}

/// The route and method of a step (`stream` for the Append routes of a row's stream,
/// `ingest` for a table's ingest, `other` else); an `answer_of` step's are its hold's.
fn route_of(row: &Value, step: &Value) -> (String, String) {
    let step = match step["answer_of"].as_str() {
        Some(name) => row["do"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["hold"].as_str() == Some(name))
            .unwrap_or(&Value::Null),
        None => step,
    };
    if step["ingest"].is_string() {
        return ("ingest".into(), "POST".into());
    }
    let req = step["req"].as_str().unwrap_or("");
    let (method, path) = req.split_once(' ').unwrap_or(("", ""));
    let route = if path.starts_with("{stream}") && !path.contains('?') {
        "stream"
    } else {
        "other"
    };
    (route.into(), method.into())
}

/// Every kind of 503 an Append route gives has a row in the table that expects its cause in
/// both headers and the body's `error`, with `Retry-After`, for `POST` and `PUT` on both
/// layouts: log disk pressure, the request-body budget, an owner that is gone and a server
/// that is stopping. Every 503 step on an Append route either expects the refusal headers
/// (it applied nothing) or expects `x-ursula-not-applied` absent. Every other cause sluice
/// names has a row saying why the binary is not driven to it: a unit test that covers its
/// name (`covered_by`), or the difference (`differs`). A kind whose row is dropped or
/// loosened fails here.
#[test]
fn every_kind_of_append_refusal_has_a_row() {
    let table: Value = toml::from_str(TABLE).expect("wire.toml parses");
    let rows = table["row"].as_array().expect("rows");
    let mut provoked = std::collections::BTreeSet::new();
    let mut problems = Vec::new();
    for row in rows {
        let id = row["id"].as_str().unwrap_or("?");
        let layouts: Vec<&str> = match row["layouts"].as_array() {
            Some(l) => l.iter().filter_map(Value::as_str).collect(),
            None if row["spec"] == "table-ingest" => vec!["none"],
            None => vec!["ursula", "protocol"],
        };
        for step in row["do"].as_array().into_iter().flatten() {
            let expect = &step["expect"];
            if expect["status"] != 503 {
                continue;
            }
            let (route, method) = route_of(row, step);
            let headers = &expect["headers"];
            let Some(sluice) = headers["x-sluice-not-applied"].as_str() else {
                let unmarked = expect["absent"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|h| h == "x-ursula-not-applied"));
                if route == "stream" && !unmarked {
                    problems.push(format!(
                        "{id}: a 503 on {method} {route} that expects neither the refusal \
                         headers nor x-ursula-not-applied absent"
                    ));
                }
                continue;
            };
            let Some(cause) = every_cause().into_iter().find(|c| c.name() == sluice) else {
                problems.push(format!("{id}: no cause {sluice}"));
                continue;
            };
            match cause.contract_name() {
                Some(name) => {
                    if headers["x-ursula-not-applied"] != name
                        || headers["retry-after"] != "1"
                        || expect["json"]["error"] != name
                        || expect["json"]["details"]["status"] != "rejected"
                    {
                        problems.push(format!(
                            "{id}: a 503 {sluice} must expect x-ursula-not-applied and error = \
                             {name}, retry-after = 1 and details.status = rejected"
                        ));
                    }
                }
                None => problems.push(format!("{id}: {sluice} has no contract name")),
            }
            for layout in &layouts {
                provoked.insert(format!("{route} {method} {sluice} {layout}"));
            }
        }
    }
    let mut expected = std::collections::BTreeSet::new();
    for cause in [
        "LogDiskPressure",
        "BodyAdmission",
        "OwnerUnavailable",
        "ShuttingDown",
    ] {
        for method in ["POST", "PUT"] {
            for layout in ["ursula", "protocol"] {
                expected.insert(format!("stream {method} {cause} {layout}"));
            }
        }
    }
    expected.insert("ingest POST LogDiskPressure none".to_owned());
    for missing in expected.difference(&provoked) {
        problems.push(format!("no row provokes {missing}"));
    }
    // The causes no row provokes: a row covers or states each (its text names the cause).
    for cause in every_cause() {
        let name = cause.name();
        if provoked.iter().any(|k| k.split(' ').nth(2) == Some(name)) {
            continue;
        }
        let explained = rows.iter().any(|row| {
            let text = format!("{} {}", row["says"], row["differs"]);
            let word = |t: &str| {
                t.split(|c: char| !c.is_ascii_alphanumeric())
                    .any(|w| w == name)
            };
            match cause.contract_name() {
                // A name the contract has: a unit test that renders it.
                Some(_) => row["covered_by"].is_string() && word(&text),
                // None: the difference, stated.
                None => row["differs"].is_string() && word(&text),
            }
        });
        if !explained {
            problems.push(format!(
                "no row covers (mapped) or states (unmapped) the cause {name}"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The runner refuses a malformed row instead of running less than it says: each of these
/// rows is refused by `check_row` with its reason.
#[test]
fn a_malformed_row_is_refused() {
    let profiles = json!({"default": {"config": ""}});
    let ok_step = json!({"req": "GET {stream}", "expect": {"status": 200}});
    let row = |extra: Value| {
        let mut row = json!({
            "id": "x.row", "spec": "stream-append", "section": "s", "says": "t",
            "do": [ok_step.clone()],
        });
        if let (Some(row), Some(extra)) = (row.as_object_mut(), extra.as_object()) {
            row.extend(extra.clone());
        }
        row
    };
    let mut ids = std::collections::HashSet::new();
    assert_eq!(check_row(&row(json!({})), &profiles, &mut ids), Ok(()));
    for (bad, why) in [
        (json!({"layouts": []}), "one layout at least"),
        (json!({"layouts": ["ursla"]}), "unknown layout"),
        (json!({"layouts": [""]}), "unknown layout"),
        (json!({"layouts": ["none"]}), "not for a stream-append row"),
        (json!({"server": "nope"}), "no server profile"),
        (
            json!({"do": [{"req": "GET {stream}", "expect": {"status": "200"}}]}),
            "an integer",
        ),
        (
            json!({"do": [{"req": "GET {stream}", "expect": {"status": 200, "body": 5}}]}),
            "a text",
        ),
        (
            json!({"do": [{"sleep_ms": 10, "expect": {"status": 200}}]}),
            "unknown key",
        ),
        (
            json!({"do": [{"release": "h", "node": "a"}]}),
            "unknown key",
        ),
        (
            json!({"do": [{"req": "GET {stream}", "query": "SELECT 1", "expect": {"status": 200}}]}),
            "exactly one kind",
        ),
        (
            json!({"do": [{"req": "GET {stream}", "expect": {"status": 200, "headers": {"a": 1}}}]}),
            "strings",
        ),
        (json!({"do": [{"signal": "HUP"}]}), "TERM or KILL"),
        (json!({"differs": "x"}), "README"),
        (
            json!({"do": [], "covered_by": "contracts::no_such_test"}),
            "names no test",
        ),
    ] {
        ids.clear();
        let result = check_row(&row(bad.clone()), &profiles, &mut ids);
        assert!(
            result.as_ref().is_err_and(|e| e.contains(why)),
            "{bad}: {result:?}, expected an error saying {why:?}"
        );
    }
}

/// A chunked answer read off a held connection is its chunks' bytes, once all have come.
#[test]
fn a_chunked_answer_is_read_whole() {
    assert_eq!(
        dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
        Ok(Some(b"abcde".to_vec()))
    );
    assert_eq!(dechunk(b"3\r\nabc\r\n2\r\nd"), Ok(None));
    assert_eq!(dechunk(b"3\r\nabc\r\n0\r\n"), Ok(None));
    assert!(dechunk(b"zz\r\n").is_err());
}
