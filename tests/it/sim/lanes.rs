//! The simulation's clients: lanes of operations, each lane a sequence drawn from its own
//! generator, run side by side against the nodes until told to stop; and the check of what the
//! nodes serve against the model.
//!
//! Every answer is classified as the contracts promise a client may read it: 2xx committed;
//! an answer that says nothing was applied (4xx, or 503 with `Retry-After` and
//! `details.status: "rejected"`), or a request that never reached the server, refused; no
//! answer, or one that says it may have been applied, unknown. An answer outside that (a 500,
//! a 503 that says neither, a refusal the operation cannot get) is itself a violation.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use super::Rng;
use super::model::{
    Batch, Class, Digest, Line, Message, Model, Presence, Problems, ROWS_PER_BATCH, Served,
    ServedBatch, StreamModel, Structural, TS_MODULUS, TableModel, check_stream, check_table,
};

/// The tables every node serves, never dropped.
pub const TABLES: [&str; 2] = ["t0", "t1"];
/// The table one lane creates and drops again and again.
pub const SCRATCH: &str = "s";
/// The stream every writer lane appends to (never closed or deleted).
pub const SHARED: &str = "shared";

const COLUMNS: &str = "(b int, id int, note string, ts timestamp)";

/// What every lane shares.
#[derive(Clone)]
pub struct Ctx {
    pub client: reqwest::Client,
    /// The nodes' URLs; a lane picks one per request.
    pub bases: Arc<Vec<String>>,
    pub model: Arc<Mutex<Model>>,
    pub stop: Arc<AtomicBool>,
    /// Whether a lane may create and drop the scratch table (one node only: another node sees
    /// a catalog change at its next refresh).
    pub scratch: bool,
}

impl Ctx {
    fn model(&self) -> std::sync::MutexGuard<'_, Model> {
        self.model.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn base(&self, rng: &mut Rng) -> String {
        self.bases[rng.below(self.bases.len() as u64) as usize].clone()
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// One answer, classified.
#[derive(Debug)]
enum Answer {
    Ok {
        status: u16,
        headers: reqwest::header::HeaderMap,
        body: Vec<u8>,
    },
    Refused {
        status: u16,
        body: Value,
    },
    /// The request never reached a server (connection refused): nothing applied.
    NotSent,
    /// No answer, or one that says it may have been applied (what the client saw, for a
    /// debugger's eyes).
    #[allow(dead_code)]
    Unknown(String),
}

impl Answer {
    fn class(&self) -> Class {
        match self {
            Answer::Ok { .. } => Class::Committed,
            Answer::Refused { .. } | Answer::NotSent => Class::Refused,
            Answer::Unknown(_) => Class::Unknown,
        }
    }
}

/// Sends a request and classifies its answer (see the module docs).
async fn send(ctx: &Ctx, what: &str, request: reqwest::RequestBuilder) -> Answer {
    let (client, request) = request.build_split();
    let request = match request {
        Ok(request) => request,
        Err(e) => return Answer::Unknown(e.to_string()),
    };
    let what = &format!("{what} via {}", request.url().authority());
    let answer = classify(ctx, what, client, request).await;
    let outcome = match &answer {
        Answer::Ok { status, .. } => status.to_string(),
        Answer::Refused { status, body } => format!("{status} {}", body["message"]),
        Answer::NotSent => "not sent".into(),
        Answer::Unknown(e) => format!("unknown ({})", e.chars().take(120).collect::<String>()),
    };
    ctx.model().note(format!("{what}: {outcome}"));
    answer
}

async fn classify(
    ctx: &Ctx,
    what: &str,
    client: reqwest::Client,
    request: reqwest::Request,
) -> Answer {
    let response = match client.execute(request).await {
        Ok(r) => r,
        Err(e) if e.is_connect() => {
            ctx.model().count("not sent");
            return Answer::NotSent;
        }
        Err(e) => {
            ctx.model().count("no answer");
            return Answer::Unknown(e.to_string());
        }
    };
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = match response.bytes().await {
        Ok(body) => body.to_vec(),
        Err(e) => {
            ctx.model().count("no answer");
            return Answer::Unknown(format!("{status}, body cut: {e}"));
        }
    };
    if (200..300).contains(&status) {
        ctx.model().count("2xx");
        return Answer::Ok {
            status,
            headers,
            body,
        };
    }
    let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let text = String::from_utf8_lossy(&body).into_owned();
    let said = parsed["details"]["status"].as_str().unwrap_or("");
    let mut model = ctx.model();
    if parsed["code"].as_str().is_none() || parsed["message"].as_str().is_none() {
        model.violation(format!(
            "{what}: {status} without the error shape {{code, message, details}}: {text}"
        ));
    }
    match status {
        503 => {
            match said {
                "rejected" => {
                    // A refusal that applied nothing says when to send it again, unless this
                    // process will take nothing more (it was fenced, or its log failed): then
                    // the request is for another node, or for this one after its restart.
                    let permanent =
                        text.contains("was fenced") || text.contains("restart to recover");
                    if !headers.contains_key("retry-after") && !permanent {
                        model.violation(format!("{what}: 503 without Retry-After: {text}"));
                    }
                    model.count("503 rejected");
                    Answer::Refused {
                        status,
                        body: parsed,
                    }
                }
                "unknown" => {
                    model.count("503 unknown");
                    Answer::Unknown(text)
                }
                _ => {
                    model.violation(format!(
                        "{what}: 503 that says neither rejected nor unknown: {text}"
                    ));
                    Answer::Unknown(text)
                }
            }
        }
        400..=499 => {
            if said != "rejected" {
                model.violation(format!(
                    "{what}: {status} that does not say nothing was applied: {text}"
                ));
            }
            model.count("4xx");
            Answer::Refused {
                status,
                body: parsed,
            }
        }
        _ => {
            model.violation(format!("{what}: unexpected answer {status}: {text}"));
            Answer::Unknown(text)
        }
    }
}

/// 2026-12-06T10:00:00Z in nanoseconds since the epoch: every row's timestamp is after it.
const BASE_NS: u64 = 1_796_551_200_000_000_000;

/// The `i`th row of batch `b` sent as NDJSON: its text and its timestamp (with the batch
/// number in its nanoseconds, so a rounded timestamp changes the batch's digest).
fn ndjson_row(b: u64, i: u64, pad: usize) -> (String, u64) {
    let (minute, second, nanos) = (i % 60, b % 60, b % 1_000_000_000);
    let text = format!(
        "{{\"b\":{b},\"id\":{},\"note\":\"{}\",\"ts\":\"2026-12-06T10:{minute:02}:{second:02}.{nanos:09}Z\"}}",
        b * ROWS_PER_BATCH + i,
        "n".repeat(pad),
    );
    (
        text,
        BASE_NS + minute * 60_000_000_000 + second * 1_000_000_000 + nanos,
    )
}

/// The NDJSON lines of batch `b` and their digest; with `bad`, one row has an id that is not
/// a number (the batch must be refused whole).
fn ndjson_batch(b: u64, rows: u64, pad: usize, bad: bool) -> (Vec<String>, Digest) {
    let mut digest = Digest {
        min_id: b * ROWS_PER_BATCH,
        max_id: b * ROWS_PER_BATCH + rows - 1,
        ..Digest::default()
    };
    let lines = (0..rows)
        .map(|i| {
            let (text, ts) = ndjson_row(b, i, pad);
            digest.note_bytes += pad as u64;
            digest.ts_sum += ts % TS_MODULUS;
            if bad && i == rows / 2 {
                format!("{{\"b\":{b},\"id\":\"x{i}\",\"note\":\"bad\"}}")
            } else {
                text
            }
        })
        .collect();
    (lines, digest)
}

fn gzip(text: &str) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(text.as_bytes()).unwrap();
    encoder.finish().unwrap()
}

fn ingest_url(base: &str, table: &str) -> String {
    format!("{base}/v1/catalog/databases/scopedb/schemas/public/tables/{table}/ingest")
}

/// Runs a statement to its end (fetching it while it is running); the answer of the last
/// request. A statement that failed is answered 200 with `"status": "failed"` and the error
/// in the body, classified as any error answer is.
async fn statement(ctx: &Ctx, base: &str, what: &str, sql: &str) -> Answer {
    let answer = run_statement(ctx, base, what, sql).await;
    let Answer::Ok { body, .. } = &answer else {
        return answer;
    };
    let parsed: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    if parsed["status"] != "failed" {
        return answer;
    }
    let error = &parsed["error"];
    let text = error.to_string();
    let mut model = ctx.model();
    match error["details"]["status"].as_str() {
        Some("rejected") => {
            model.count("statement failed, rejected");
            let status = match error["code"].as_str() {
                Some("service_unavailable" | "resources_exhausted") => 503,
                _ => 400,
            };
            Answer::Refused {
                status,
                body: error.clone(),
            }
        }
        Some("unknown") => {
            model.count("statement failed, unknown");
            Answer::Unknown(text)
        }
        _ => {
            model.violation(format!(
                "{what}: a failed statement that says neither rejected nor unknown: {text}"
            ));
            Answer::Unknown(text)
        }
    }
}

async fn run_statement(ctx: &Ctx, base: &str, what: &str, sql: &str) -> Answer {
    let mut answer = send(
        ctx,
        what,
        ctx.client
            .post(format!("{base}/v1/statements"))
            .json(&json!({"statement": sql})),
    )
    .await;
    for _ in 0..600 {
        let Answer::Ok { body, .. } = &answer else {
            return answer;
        };
        let parsed: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        if parsed["status"] != "running" {
            return answer;
        }
        let Some(id) = parsed["statement_id"].as_str() else {
            return answer;
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        answer = send(
            ctx,
            what,
            ctx.client.get(format!("{base}/v1/statements/{id}")),
        )
        .await;
    }
    answer
}

/// Whether a statement's answer says it finished.
fn finished(answer: &Answer) -> bool {
    match answer {
        Answer::Ok { body, .. } => {
            serde_json::from_slice::<Value>(body).is_ok_and(|v| v["status"] == "finished")
        }
        _ => false,
    }
}

/// One batch into `table` by one of the ways rows come in (the ingest route plain or gzip,
/// `/v1/ingest`, a SQL `INSERT`); with a small chance, a batch with a bad row, which must be
/// refused whole. The batch is in the model as unknown before it is sent (a read may see it
/// before its answer comes). Returns the class of its answer.
async fn ingest(ctx: &Ctx, lane: u64, rng: &mut Rng, base: &str, table: &str) -> Class {
    let b = ctx.model().new_batch(lane);
    let count = if rng.chance(10) {
        rng.between(100, 400)
    } else {
        rng.between(1, 40)
    };
    let pad = rng.between(20, 300) as usize;
    let way = rng.below(10);
    let bad = way < 8 && rng.chance(4);
    let what = format!("batch {b} into {table}");
    if way == 9 {
        let rows = count.min(30);
        let values: Vec<String> = (0..rows)
            .map(|i| {
                format!(
                    "({b}, {}, '{}', '2026-12-06T10:00:00Z')",
                    b * ROWS_PER_BATCH + i,
                    "v".repeat(pad)
                )
            })
            .collect();
        let digest = Digest {
            min_id: b * ROWS_PER_BATCH,
            max_id: b * ROWS_PER_BATCH + rows - 1,
            note_bytes: rows * pad as u64,
            ts_sum: rows * (BASE_NS % TS_MODULUS),
        };
        in_flight(ctx, table, b, rows, digest);
        let sql = format!("INSERT INTO {table} VALUES {}", values.join(", "));
        let answer = statement(ctx, base, &what, &sql).await;
        if let Answer::Ok { body, .. } = &answer
            && !finished(&answer)
        {
            ctx.model().violation(format!(
                "{what}: an INSERT answered 200 but did not finish: {}",
                String::from_utf8_lossy(body)
            ));
        }
        return record_batch(ctx, table, b, answer, false, &what);
    }
    let (lines, digest) = ndjson_batch(b, count, pad, bad);
    in_flight(ctx, table, b, count, digest);
    let body = lines.join("\n") + "\n";
    let request = match way {
        0..=5 => ctx
            .client
            .post(ingest_url(base, table))
            .header("content-type", "application/x-ndjson")
            .body(body),
        6 | 7 => ctx
            .client
            .post(ingest_url(base, table))
            .header("content-type", "application/x-ndjson")
            .header("content-encoding", "gzip")
            .body(gzip(&body)),
        _ => ctx.client.post(format!("{base}/v1/ingest")).json(&json!({
            "data": {"format": "json", "rows": body},
            "statement": format!("INSERT INTO {table}"),
        })),
    };
    let answer = send(ctx, &what, request).await;
    record_batch(ctx, table, b, answer, bad, &what)
}

/// A batch about to be sent: in the model as unknown.
fn in_flight(ctx: &Ctx, table: &str, b: u64, rows: u64, digest: Digest) {
    if let Some(t) = ctx.model().tables.get_mut(table) {
        t.batches.insert(
            b,
            Batch {
                rows,
                class: Class::Unknown,
                digest,
            },
        );
    }
}

fn record_batch(ctx: &Ctx, table: &str, b: u64, answer: Answer, bad: bool, what: &str) -> Class {
    let class = answer.class();
    let mut model = ctx.model();
    match &answer {
        Answer::Ok { .. } if bad => {
            model.violation(format!("{what}: a batch with a bad row was committed"));
        }
        Answer::Refused { status: 422, .. } if bad => {}
        Answer::Refused { status: 503, .. } => {}
        Answer::Refused { status, body, .. } => {
            model.violation(format!("{what}: refused with {status}: {body}"));
        }
        _ => {}
    }
    if let Some(batch) = model
        .tables
        .get_mut(table)
        .and_then(|t| t.batches.get_mut(&b))
    {
        batch.class = class;
        if class == Class::Committed {
            let rows = batch.rows;
            model.acknowledged.0 += rows;
        }
    }
    class
}

/// A table lane: batches into the tables that are never dropped.
pub async fn table_lane(ctx: Ctx, lane: u64, mut rng: Rng) {
    while !ctx.stopped() {
        let base = ctx.base(&mut rng);
        let table = TABLES[rng.below(TABLES.len() as u64) as usize];
        if ingest(&ctx, lane, &mut rng, &base, table).await == Class::Refused {
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
}

/// Looks at whether the scratch table exists, to settle a create or drop without an answer.
async fn settle_scratch(ctx: &Ctx, base: &str) {
    let Some(Presence::Unsure(change)) = ctx.model().scratch else {
        return;
    };
    let url = format!("{base}/v1/catalog/databases/scopedb/schemas/public/tables/{SCRATCH}");
    let Ok(r) = ctx.client.get(url).send().await else {
        return;
    };
    let exists = match r.status().as_u16() {
        200 => true,
        404 => false,
        _ => return,
    };
    let mut model = ctx.model();
    model.scratch = Some(if exists {
        Presence::Open
    } else {
        Presence::Absent
    });
    if !exists && change == Structural::Drop {
        drop_scratch_batches(&mut model);
    }
}

fn drop_scratch_batches(model: &mut Model) {
    if let Some(t) = model.tables.get_mut(SCRATCH) {
        let batches = std::mem::take(&mut t.batches);
        t.gone.extend(batches.into_keys());
    }
}

/// The catalog lane: creates the scratch table, fills it, drops it, creates it again.
pub async fn catalog_lane(ctx: Ctx, lane: u64, mut rng: Rng) {
    // One node: another would see the catalog change only at its next refresh.
    let base = ctx.bases[0].clone();
    while !ctx.stopped() {
        settle_scratch(&ctx, &base).await;
        let presence = ctx.model().scratch;
        match presence {
            Some(Presence::Absent) | None => {
                let sql = if rng.chance(50) {
                    format!("CREATE TABLE {SCRATCH} {COLUMNS}")
                } else {
                    format!("CREATE TABLE IF NOT EXISTS scopedb.public.{SCRATCH} {COLUMNS}")
                };
                let answer = statement(&ctx, &base, "create the scratch table", &sql).await;
                let mut model = ctx.model();
                match answer {
                    Answer::Ok { .. } => model.scratch = Some(Presence::Open),
                    Answer::Unknown(_) => {
                        model.scratch = Some(Presence::Unsure(Structural::Create))
                    }
                    Answer::Refused { status: 503, .. } | Answer::NotSent => {}
                    Answer::Refused { status, body, .. } => model.violation(format!(
                        "create the scratch table: refused with {status}: {body}"
                    )),
                }
            }
            Some(Presence::Open) if rng.chance(8) => {
                let answer = statement(
                    &ctx,
                    &base,
                    "drop the scratch table",
                    &format!("DROP TABLE {SCRATCH}"),
                )
                .await;
                let mut model = ctx.model();
                match answer {
                    Answer::Ok { .. } => {
                        model.scratch = Some(Presence::Absent);
                        drop_scratch_batches(&mut model);
                    }
                    Answer::Unknown(_) => model.scratch = Some(Presence::Unsure(Structural::Drop)),
                    Answer::Refused { status: 503, .. } | Answer::NotSent => {}
                    Answer::Refused { status, body, .. } => model.violation(format!(
                        "drop the scratch table: refused with {status}: {body}"
                    )),
                }
            }
            Some(Presence::Open) => {
                if ingest(&ctx, lane, &mut rng, &base, SCRATCH).await == Class::Refused {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
            }
            Some(Presence::Closed | Presence::Unsure(_)) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The byte offset in a `Stream-Next-Offset`.
fn next_offset(headers: &reqwest::header::HeaderMap) -> Option<u64> {
    headers
        .get("stream-next-offset")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once('_'))
        .and_then(|(_, b)| b.parse().ok())
}

fn stream_url(base: &str, name: &str) -> String {
    format!("{base}/v1/stream/{name}")
}

/// Looks at a stream whose create, close or delete got no answer.
async fn settle_stream(ctx: &Ctx, base: &str, name: &str) {
    let change = match ctx.model().streams.get(name).map(|s| s.presence) {
        Some(Presence::Unsure(change)) => change,
        _ => return,
    };
    // Settled by sending the change again, not by looking: a change whose answer was lost
    // may still be under way at the stream's owner (a forwarding node died while the owner
    // went on), so what a look sees now may be undone a moment later. Sent again, the change
    // has happened once its answer comes, whichever attempt made it.
    change_stream(ctx, base, name, change, true).await;
}

/// A plain append of a fresh message `{"n": n}`, in the model as unknown before it is sent.
async fn append(ctx: &Ctx, lane: u64, rng: &mut Rng, base: &str, name: &str) -> Class {
    let pad = rng.between(10, 400) as usize;
    let n = {
        let mut model = ctx.model();
        let n = model.new_message(lane);
        if let Some(stream) = model.streams.get_mut(name) {
            stream.messages.insert(n, Message::Unknown);
            stream.pads.insert(n, pad as u32);
        }
        n
    };
    let what = format!("message {n} to stream {name}");
    let answer = send(
        ctx,
        &what,
        ctx.client
            .post(stream_url(base, name))
            .header("content-type", "application/json")
            .body(json!({"n": n, "pad": "p".repeat(pad)}).to_string()),
    )
    .await;
    let class = answer.class();
    let mut model = ctx.model();
    let closed = model
        .streams
        .get(name)
        .is_some_and(|s| s.presence == Presence::Closed);
    let message = match &answer {
        Answer::Ok { headers, .. } => match next_offset(headers) {
            Some(end) => Message::Committed(end),
            None => {
                model.violation(format!("{what}: acknowledged without Stream-Next-Offset"));
                Message::Unknown
            }
        },
        Answer::Refused { status: 409, .. } if closed => Message::Refused,
        Answer::Refused { status: 503, .. } | Answer::NotSent => Message::Refused,
        Answer::Refused { status, body, .. } => {
            model.violation(format!("{what}: refused with {status}: {body}"));
            Message::Refused
        }
        Answer::Unknown(_) => Message::Unknown,
    };
    if matches!(message, Message::Committed(_)) {
        model.acknowledged.1 += 1;
    }
    if closed && matches!(message, Message::Committed(_)) {
        model.violation(format!(
            "{what}: appended to a stream whose close was acknowledged"
        ));
    }
    if let Some(stream) = model.streams.get_mut(name)
        && stream.messages.contains_key(&n)
    {
        stream.messages.insert(n, message);
    }
    class
}

/// The stream's producer appends its next sequence number (or resends one without a settled
/// answer, with the same body). The sequence number is pending (it may be served) from
/// before it is sent until an answer settles it.
async fn produce(ctx: &Ctx, base: &str, name: &str) -> Class {
    let (seq, incarnation, retry) = {
        let mut model = ctx.model();
        let Some(stream) = model.streams.get_mut(name) else {
            return Class::Refused;
        };
        match stream.producer.pending {
            Some(seq) => (seq, stream.incarnation, true),
            None => {
                let seq = stream.producer.next_seq;
                stream.producer.pending = Some(seq);
                (seq, stream.incarnation, false)
            }
        }
    };
    let what = format!("producer sequence {seq} to stream {name}");
    let answer = send(
        ctx,
        &what,
        ctx.client
            .post(stream_url(base, name))
            .header("content-type", "application/json")
            .header("producer-id", format!("p-{name}"))
            .header("producer-epoch", "0")
            .header("producer-seq", seq.to_string())
            .body(json!({"q": seq, "i": incarnation, "pad": "q".repeat(120)}).to_string()),
    )
    .await;
    let class = answer.class();
    let mut model = ctx.model();
    if class == Class::Committed {
        model.acknowledged.1 += 1;
    }
    let mut problem = None;
    {
        let Some(stream) = model.streams.get_mut(name) else {
            return class;
        };
        if stream.incarnation != incarnation {
            return class;
        }
        let producer = &mut stream.producer;
        match &answer {
            Answer::Ok {
                status: 200,
                headers,
                ..
            } => {
                let end = next_offset(headers);
                if end.is_none() {
                    problem = Some(format!("{what}: acknowledged without Stream-Next-Offset"));
                }
                producer.acked.insert(seq, end);
                producer.pending = None;
                producer.next_seq = seq + 1;
            }
            Answer::Ok { status: 204, .. } if retry => {
                producer.acked.insert(seq, None);
                producer.pending = None;
                producer.next_seq = seq + 1;
            }
            Answer::Ok { status, .. } => {
                problem = Some(format!("{what}: answered {status} for a first attempt"));
                producer.acked.insert(seq, None);
                producer.pending = None;
                producer.next_seq = seq + 1;
            }
            // Resent with the same body until an answer settles it (a refusal too: the number
            // stays the producer's next).
            Answer::Unknown(_) | Answer::Refused { status: 503, .. } | Answer::NotSent => {}
            Answer::Refused { status: 409, .. } if stream.presence == Presence::Closed => {
                producer.pending = None;
            }
            Answer::Refused { status, body, .. } => {
                problem = Some(format!("{what}: refused with {status}: {body}"));
            }
        }
    }
    if let Some(problem) = problem {
        model.violation(problem);
    }
    class
}

/// A stream lane: creates, appends to (plain and as its producer), closes, deletes and creates
/// again the streams it owns.
pub async fn stream_lane(ctx: Ctx, lane: u64, mut rng: Rng, names: Vec<String>) {
    while !ctx.stopped() {
        let base = ctx.base(&mut rng);
        let name = names[rng.below(names.len() as u64) as usize].clone();
        settle_stream(&ctx, &base, &name).await;
        let presence = ctx.model().streams.get(&name).map(|s| s.presence);
        let class = match presence {
            Some(Presence::Absent) => {
                change_stream(&ctx, &base, &name, Structural::Create, false).await
            }
            Some(Presence::Open) => match rng.below(100) {
                0..=59 => append(&ctx, lane, &mut rng, &base, &name).await,
                60..=93 => produce(&ctx, &base, &name).await,
                94..=96 => change_stream(&ctx, &base, &name, Structural::Close, false).await,
                _ => change_stream(&ctx, &base, &name, Structural::Drop, false).await,
            },
            Some(Presence::Closed) => match rng.below(10) {
                0..=2 => append(&ctx, lane, &mut rng, &base, &name).await,
                _ => change_stream(&ctx, &base, &name, Structural::Drop, false).await,
            },
            Some(Presence::Unsure(_)) | None => Class::Refused,
        };
        if class == Class::Refused {
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
}

/// A writer lane of the shared stream: plain appends, and, when it is the first, the shared
/// stream's producer.
pub async fn shared_lane(ctx: Ctx, lane: u64, mut rng: Rng, producer: bool) {
    while !ctx.stopped() {
        let base = ctx.base(&mut rng);
        let class = if producer && rng.chance(40) {
            produce(&ctx, &base, SHARED).await
        } else {
            append(&ctx, lane, &mut rng, &base, SHARED).await
        };
        if class == Class::Refused {
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
}

/// Creates, closes or deletes stream `name` (`again`: resent to settle an earlier attempt
/// whose answer was lost, so "already there" or "already gone" answers are what it expects).
async fn change_stream(
    ctx: &Ctx,
    base: &str,
    name: &str,
    change: Structural,
    again: bool,
) -> Class {
    let (request, what) = match change {
        Structural::Create => (
            ctx.client
                .put(stream_url(base, name))
                .header("content-type", "application/json"),
            format!("create stream {name}"),
        ),
        Structural::Drop => (
            ctx.client.delete(stream_url(base, name)),
            format!("delete stream {name}"),
        ),
        Structural::Close => (
            ctx.client
                .post(stream_url(base, name))
                .header("content-type", "application/json")
                .header("stream-closed", "true"),
            format!("close stream {name}"),
        ),
    };
    let what = if again { format!("{what} again") } else { what };
    let answer = send(ctx, &what, request).await;
    let class = answer.class();
    let mut model = ctx.model();
    let mut problem = None;
    if let Some(stream) = model.streams.get_mut(name) {
        match (change, &answer) {
            (Structural::Create, Answer::Ok { status: 201, .. }) => stream.created(),
            // The same configuration again: made by the attempt whose answer was lost.
            (Structural::Create, Answer::Ok { .. }) if again => stream.created(),
            (Structural::Create, Answer::Ok { status, .. }) => {
                problem = Some(format!("{what}: {status} for a stream that did not exist"));
                stream.presence = Presence::Unsure(Structural::Create);
            }
            (Structural::Drop, Answer::Ok { .. }) => stream.deleted(),
            (Structural::Drop, Answer::Refused { status: 404, .. }) if again => stream.deleted(),
            (Structural::Close, Answer::Ok { .. }) => stream.presence = Presence::Closed,
            (_, Answer::Unknown(_)) => stream.presence = Presence::Unsure(change),
            (_, Answer::Refused { status: 503, .. } | Answer::NotSent) => {}
            (_, Answer::Refused { status, body }) => {
                problem = Some(format!("{what}: refused with {status}: {body}"));
            }
        }
    }
    if let Some(problem) = problem {
        model.violation(problem);
    }
    class
}

/// A query lane: statements over the tables while everything else runs; each must answer,
/// and what a table serves meanwhile is checked for safety (nothing twice, partly, altered,
/// refused or unsent).
pub async fn query_lane(ctx: Ctx, mut rng: Rng) {
    const QUERIES: [&str; 4] = [
        "SELECT count(*) FROM t0",
        "SELECT b, count(*) AS n FROM t1 GROUP BY b ORDER BY n DESC LIMIT 3",
        "FROM t0 WHERE id % 7 = 0 AGGREGATE count() AS n",
        "SELECT max(ts), min(id) FROM t1 WHERE note LIKE 'n%'",
    ];
    while !ctx.stopped() {
        let base = ctx.base(&mut rng);
        if rng.chance(25) {
            let table = TABLES[rng.below(TABLES.len() as u64) as usize];
            let mut problems = Problems::default();
            if let Ok(served) = read_table(&ctx.client, &base, table).await {
                let model = ctx.model().tables.get(table).cloned().unwrap_or_default();
                check_table(table, &model, &served, false, &mut problems);
            }
            for problem in problems.safety {
                ctx.model()
                    .violation(format!("read during load from {base}: {problem}"));
            }
            continue;
        }
        let sql = QUERIES[rng.below(QUERIES.len() as u64) as usize];
        let mut answer = statement(&ctx, &base, sql, sql).await;
        if let Answer::Refused { body, .. } = &answer
            && body["message"]
                .as_str()
                .is_some_and(|m| m.contains("Failed to fetch metadata"))
        {
            // The settings' grace period (a second, shorter than the statement timeout: the
            // server warns at start) lets a file the node's view still names be collected
            // once compaction replaced it; a query planned afresh a moment later must work.
            ctx.model().count("query met a collected file");
            tokio::time::sleep(Duration::from_millis(500)).await;
            answer = statement(&ctx, &base, sql, sql).await;
        }
        match &answer {
            Answer::Ok { body, .. } if !finished(&answer) => ctx.model().violation(format!(
                "{sql}: answered 200 but did not finish: {}",
                String::from_utf8_lossy(body)
            )),
            Answer::Refused { status, body, .. } if *status != 503 => ctx
                .model()
                .violation(format!("{sql}: refused with {status}: {body}")),
            Answer::NotSent | Answer::Refused { .. } => {
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A reader lane: reads the shared stream from the start while it is written and checks what
/// it is served for safety (nothing twice, altered, refused, unsent, or at another place than
/// acknowledged).
pub async fn reader_lane(ctx: Ctx, mut rng: Rng) {
    while !ctx.stopped() {
        let base = ctx.base(&mut rng);
        if let Ok(content) = read_stream(&ctx.client, &base, SHARED).await {
            let model = ctx.model().streams.get(SHARED).cloned();
            if let Some(model) = model {
                let mut problems = Problems::default();
                check_stream(&model, content, false, &mut problems);
                for problem in problems.safety {
                    ctx.model()
                        .violation(format!("read during load from {base}: {problem}"));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.between(50, 400))).await;
    }
}

/// Sends one statement and follows it until it is no longer running.
async fn run_query(
    client: &reqwest::Client,
    base: &str,
    sql: &str,
) -> Result<(reqwest::StatusCode, Value), String> {
    let r = client
        .post(format!("{base}/v1/statements"))
        .json(&json!({"statement": sql}))
        .send()
        .await
        .map_err(|e| format!("{sql}: {e}"))?;
    let status = r.status();
    let mut body: Value = r.json().await.map_err(|e| format!("{sql}: {e}"))?;
    for _ in 0..1200 {
        if body["status"] != "running" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let id = body["statement_id"].as_str().unwrap_or_default().to_owned();
        body = client
            .get(format!("{base}/v1/statements/{id}"))
            .send()
            .await
            .map_err(|e| format!("{sql}: {e}"))?
            .json()
            .await
            .map_err(|e| format!("{sql}: {e}"))?;
    }
    Ok((status, body))
}

/// Rows of a query's answer as strings (each cell is a string or null).
async fn query(
    client: &reqwest::Client,
    base: &str,
    sql: &str,
) -> Result<Vec<Vec<Option<String>>>, String> {
    // A failure the server calls retryable (a file collected under the statement after a
    // compaction replaced it: the settings' grace period is a second) is sent again, as a
    // client does; anything else is the answer.
    let mut attempts = 0;
    let (status, body) = loop {
        let (status, body) = run_query(client, base, sql).await?;
        let retryable = status == 503
            || (body["status"] == "failed"
                && body["error"]["details"]["retry_after_seconds"].is_u64());
        attempts += 1;
        if !retryable || attempts == 10 {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    if status != 200 || body["status"] != "finished" {
        return Err(format!("{sql}: {status} {body}"));
    }
    let rows = body["result_set"]["rows"]
        .as_array()
        .ok_or_else(|| format!("{sql}: no rows in {body}"))?;
    Ok(rows
        .iter()
        .map(|row| {
            row.as_array()
                .map(|cells| {
                    cells
                        .iter()
                        .map(|c| c.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        })
        .collect())
}

/// A table's rows by batch: counts and digest (see [`Digest`]).
async fn read_table(
    client: &reqwest::Client,
    base: &str,
    table: &str,
) -> Result<Vec<ServedBatch>, String> {
    let sql = format!(
        "SELECT b, count(*), count(DISTINCT id), min(id), max(id), sum(length(note)), \
         sum(CAST(ts AS BIGINT) % {TS_MODULUS}) FROM {table} GROUP BY b"
    );
    let rows = query(client, base, &sql).await?;
    rows.iter()
        .map(|row| {
            let number = |i: usize| -> Result<u64, String> {
                row.get(i)
                    .and_then(|c| c.as_deref())
                    .and_then(|c| c.parse().ok())
                    .ok_or_else(|| format!("{table}: a row with a missing or odd value: {row:?}"))
            };
            Ok(ServedBatch {
                b: number(0)?,
                rows: number(1)?,
                distinct: number(2)?,
                digest: Digest {
                    min_id: number(3)?,
                    max_id: number(4)?,
                    note_bytes: number(5)?,
                    ts_sum: number(6)?,
                },
            })
        })
        .collect()
}

/// A stream read to its end a page at a time (`None` when it does not exist): each message
/// with the offset right after it, and whether the stream is closed.
async fn read_stream(
    client: &reqwest::Client,
    base: &str,
    name: &str,
) -> Result<Option<(Vec<(Line, u64)>, bool)>, String> {
    let mut lines = Vec::new();
    let mut offset = "-1".to_owned();
    let mut at = 0u64;
    for _ in 0..100_000 {
        let r = client
            .get(format!("{}?offset={offset}", stream_url(base, name)))
            .header("accept", "application/x-ndjson")
            .send()
            .await
            .map_err(|e| format!("read stream {name}: {e}"))?;
        match r.status().as_u16() {
            200 => {}
            404 if offset == "-1" => return Ok(None),
            status => {
                let text = r.text().await.unwrap_or_default();
                return Err(format!("read stream {name} at {offset}: {status} {text}"));
            }
        }
        let up_to_date = r.headers().contains_key("stream-up-to-date");
        let closed = r.headers().contains_key("stream-closed");
        let next = r
            .headers()
            .get("stream-next-offset")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let body = r
            .bytes()
            .await
            .map_err(|e| format!("read stream {name}: {e}"))?;
        for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            at += line.len() as u64 + 1;
            let m: Value = serde_json::from_slice(line)
                .map_err(|e| format!("stream {name}: a message that is not JSON ({e})"))?;
            let parsed = match (m["n"].as_u64(), m["q"].as_u64(), m["i"].as_u64()) {
                (Some(n), _, _) => {
                    let pad = m["pad"]
                        .as_str()
                        .filter(|p| p.bytes().all(|b| b == b'p'))
                        .map(|p| p.len() as u32);
                    Line::Plain(n, pad)
                }
                (None, Some(seq), Some(incarnation)) => Line::Produced { incarnation, seq },
                _ => return Err(format!("stream {name}: a message nobody wrote: {m}")),
            };
            lines.push((parsed, at));
        }
        if up_to_date || closed && next == offset {
            return Ok(Some((lines, closed)));
        }
        offset = next;
    }
    Err(format!("read stream {name}: no end"))
}

/// Settles every create, close or delete without an answer by looking at what is there.
pub async fn settle_structure(ctx: &Ctx, base: &str) {
    settle_scratch(ctx, base).await;
    let names: Vec<String> = ctx.model().streams.keys().cloned().collect();
    for name in names {
        settle_stream(ctx, base, &name).await;
    }
}

/// Compares what `base` serves with the model, after the writes stopped; the problems found,
/// or what is served.
pub async fn check(ctx: &Ctx, base: &str) -> Result<Served, Problems> {
    settle_structure(ctx, base).await;
    let (tables, scratch, streams): (BTreeMap<String, TableModel>, _, Vec<StreamModel>) = {
        let model = ctx.model();
        (
            model.tables.clone(),
            model.scratch,
            model.streams.values().cloned().collect(),
        )
    };
    let mut problems = Problems::default();
    let mut served = Served::default();
    for (name, table) in &tables {
        if name == SCRATCH {
            match scratch {
                Some(Presence::Open) => {}
                Some(Presence::Absent) | None => {
                    match query(&ctx.client, base, &format!("SELECT count(*) FROM {name}")).await {
                        Ok(_) => problems.safety.push(format!(
                            "table {name}: served, but its drop was acknowledged"
                        )),
                        Err(e) if !e.contains("not found") => {
                            problems.missing.push(format!("table {name}: {e}"))
                        }
                        Err(_) => {}
                    }
                    continue;
                }
                _ => {
                    problems.missing.push(format!(
                        "table {name}: its create or drop is still unsettled"
                    ));
                    continue;
                }
            }
        }
        match read_table(&ctx.client, base, name).await {
            Ok(rows) => {
                let present = check_table(name, table, &rows, true, &mut problems);
                served.batches.insert(name.clone(), present);
            }
            Err(e) => problems.missing.push(format!("table {name}: {e}")),
        }
    }
    for stream in &streams {
        match read_stream(&ctx.client, base, &stream.name).await {
            Ok(content) => {
                let at = check_stream(stream, content, true, &mut problems);
                served.messages.insert(stream.name.clone(), at);
            }
            Err(e) => problems.missing.push(e),
        }
    }
    if problems.is_empty() {
        Ok(served)
    } else {
        Err(problems)
    }
}

/// Creates the tables and the shared stream a run starts with; the model starts knowing
/// them.
pub async fn setup(ctx: &Ctx, stream_names: &[String]) -> Result<(), String> {
    let base = ctx.bases[0].clone();
    for table in TABLES {
        let sql = format!("CREATE TABLE IF NOT EXISTS {table} {COLUMNS}");
        query(&ctx.client, &base, &sql).await?;
        ctx.model()
            .tables
            .insert(table.to_owned(), TableModel::default());
    }
    if ctx.scratch {
        let mut model = ctx.model();
        model
            .tables
            .insert(SCRATCH.to_owned(), TableModel::default());
        model.scratch = Some(Presence::Absent);
    }
    let r = ctx
        .client
        .put(stream_url(&base, SHARED))
        .header("content-type", "application/json")
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if r.status() != 201 {
        return Err(format!("create the shared stream: {}", r.status()));
    }
    let mut model = ctx.model();
    let mut shared = StreamModel::new(SHARED);
    shared.created();
    model.streams.insert(SHARED.to_owned(), shared);
    for name in stream_names {
        model.streams.insert(name.clone(), StreamModel::new(name));
    }
    Ok(())
}

/// The lanes of one stretch of load, each with its own generator forked from `rng` and its own
/// number (the same lane has the same number in every stretch).
pub fn start_lanes(
    ctx: &Ctx,
    rng: &mut Rng,
    stream_names: &[String],
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut lanes = Vec::new();
    for lane in 0..3 {
        lanes.push(tokio::spawn(table_lane(ctx.clone(), lane, rng.fork())));
    }
    if ctx.scratch {
        lanes.push(tokio::spawn(catalog_lane(ctx.clone(), 3, rng.fork())));
    }
    let half = stream_names.len().div_ceil(2).max(1);
    for (i, names) in stream_names.chunks(half).enumerate() {
        lanes.push(tokio::spawn(stream_lane(
            ctx.clone(),
            4 + i as u64,
            rng.fork(),
            names.to_vec(),
        )));
    }
    lanes.push(tokio::spawn(shared_lane(ctx.clone(), 6, rng.fork(), true)));
    lanes.push(tokio::spawn(shared_lane(ctx.clone(), 7, rng.fork(), false)));
    lanes.push(tokio::spawn(query_lane(ctx.clone(), rng.fork())));
    lanes.push(tokio::spawn(reader_lane(ctx.clone(), rng.fork())));
    lanes
}

/// Stops the lanes and waits for their last requests.
pub async fn stop_lanes(ctx: &Ctx, lanes: Vec<tokio::task::JoinHandle<()>>) {
    ctx.stop.store(true, Ordering::Relaxed);
    for lane in lanes {
        if let Err(e) = lane.await {
            ctx.model()
                .violation(format!("a client lane panicked: {e}"));
        }
    }
    ctx.stop.store(false, Ordering::Relaxed);
}

/// Batches and messages the model holds, for a progress line.
pub fn summary(model: &Model) -> String {
    let (rows, messages) = model.committed();
    let (unknown_batches, unknown_messages) = model.unknowns();
    let batches: usize = model.tables.values().map(|t| t.batches.len()).sum();
    format!(
        "{rows} rows and {messages} messages acknowledged ({batches} batches sent; \
         {unknown_batches} batches and {unknown_messages} messages still unknown) over {} \
         tables and {} streams; answers {:?}",
        model.tables.len(),
        model.streams.len(),
        model.answers
    )
}
