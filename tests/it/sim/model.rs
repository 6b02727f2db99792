//! What the simulator's clients know: every write they sent and the class of its answer, and
//! the checks of what a server serves against it.
//!
//! Each write is `Committed` (a 2xx: it must be served exactly once, at its acknowledged place),
//! `Refused` (an answer that says nothing was applied, or a request that never left the client:
//! it must never be served) or `Unknown` (no answer, or one that says it may have been applied:
//! served at most once). After a restart of a single node an unknown write is settled by what
//! the server serves then: nothing that was not replayed at the start can appear later.

use std::collections::{BTreeMap, BTreeSet};

/// The class of one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Committed,
    Refused,
    Unknown,
}

/// One batch of rows: `rows` rows with ids `b * ROWS_PER_BATCH ..`, all in column `b`.
#[derive(Debug, Clone, Copy)]
pub struct Batch {
    pub rows: u64,
    pub class: Class,
}

/// Most rows one batch holds (ids of batch `b` are `b * ROWS_PER_BATCH + i`).
pub const ROWS_PER_BATCH: u64 = 1000;

/// A table that is never dropped, or the scratch table's current generation.
#[derive(Debug, Default, Clone)]
pub struct TableModel {
    pub batches: BTreeMap<u64, Batch>,
    /// Batches of dropped generations: never to be served again.
    pub gone: BTreeSet<u64>,
}

/// Whether a table or stream exists, as far as the clients know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    Absent,
    Open,
    Closed,
    /// A create, drop, close or delete got no answer: settled by looking.
    Unsure(Structural),
}

/// A change whose outcome is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Structural {
    Create,
    Drop,
    Close,
}

/// One message of a stream (`{"n": n}`, or a producer's `{"q": seq}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// Acknowledged, with the stream's end offset right after it.
    Committed(u64),
    Refused,
    Unknown,
}

/// An idempotent producer of one stream incarnation.
#[derive(Debug, Default, Clone)]
pub struct ProducerModel {
    /// The next sequence number to use.
    pub next_seq: u64,
    /// Acknowledged sequence numbers, with their end offset (`None` for an answer that said
    /// "duplicate": it landed, by an earlier attempt whose answer was lost).
    pub acked: BTreeMap<u64, Option<u64>>,
    /// A sequence number sent without a settled answer: resent, with the same body, until
    /// it is answered.
    pub pending: Option<u64>,
}

/// A stream as its clients know it.
#[derive(Debug, Clone)]
pub struct StreamModel {
    pub name: String,
    pub presence: Presence,
    /// Creates so far: a producer's messages name their incarnation.
    pub incarnation: u64,
    /// Plain messages of the current incarnation.
    pub messages: BTreeMap<u64, Message>,
    /// Messages of deleted incarnations: never to be served again.
    pub gone: BTreeSet<u64>,
    pub producer: ProducerModel,
}

impl StreamModel {
    pub fn new(name: &str) -> StreamModel {
        StreamModel {
            name: name.to_owned(),
            presence: Presence::Absent,
            incarnation: 0,
            messages: BTreeMap::new(),
            gone: BTreeSet::new(),
            producer: ProducerModel::default(),
        }
    }

    /// A create was acknowledged (or seen to have happened): a new, empty incarnation.
    pub fn created(&mut self) {
        self.retire_messages();
        self.incarnation += 1;
        self.producer = ProducerModel::default();
        self.presence = Presence::Open;
    }

    /// A delete was acknowledged (or seen to have happened).
    pub fn deleted(&mut self) {
        self.retire_messages();
        self.producer = ProducerModel::default();
        self.presence = Presence::Absent;
    }

    fn retire_messages(&mut self) {
        let messages = std::mem::take(&mut self.messages);
        self.gone.extend(messages.into_keys());
    }
}

/// Everything the clients know, and what went wrong.
#[derive(Debug, Default)]
pub struct Model {
    pub tables: BTreeMap<String, TableModel>,
    /// The scratch table (created and dropped by one client): its presence.
    pub scratch: Option<Presence>,
    pub streams: BTreeMap<String, StreamModel>,
    pub next_batch: u64,
    pub next_message: u64,
    /// Broken promises, each with what the client saw.
    pub violations: Vec<String>,
    /// Answers by class, for the report.
    pub answers: BTreeMap<&'static str, u64>,
}

impl Model {
    pub fn violation(&mut self, what: String) {
        eprintln!("VIOLATION: {what}");
        self.violations.push(what);
    }

    pub fn count(&mut self, what: &'static str) {
        *self.answers.entry(what).or_default() += 1;
    }

    pub fn new_batch(&mut self) -> u64 {
        let b = self.next_batch;
        self.next_batch += 1;
        b
    }

    pub fn new_message(&mut self) -> u64 {
        let n = self.next_message;
        self.next_message += 1;
        n
    }

    /// Unknown writes, after a single node's restart and a check that passed: what is served
    /// now was replayed, and nothing else can appear later.
    pub fn settle(&mut self, served: &Served) {
        for (table, model) in &mut self.tables {
            for (b, batch) in &mut model.batches {
                if batch.class == Class::Unknown {
                    let there = served.batches.get(table).is_some_and(|s| s.contains(b));
                    batch.class = if there {
                        Class::Committed
                    } else {
                        Class::Refused
                    };
                }
            }
        }
        for (name, stream) in &mut self.streams {
            let Some(at) = served.messages.get(name) else {
                continue;
            };
            for (n, message) in &mut stream.messages {
                if *message == Message::Unknown {
                    *message = match at.get(n) {
                        Some(end) => Message::Committed(*end),
                        None => Message::Refused,
                    };
                }
            }
        }
    }

    /// Batches and messages still of unknown outcome.
    pub fn unknowns(&self) -> (usize, usize) {
        let batches = self
            .tables
            .values()
            .flat_map(|t| t.batches.values())
            .filter(|b| b.class == Class::Unknown)
            .count();
        let messages = self
            .streams
            .values()
            .flat_map(|s| s.messages.values())
            .filter(|m| **m == Message::Unknown)
            .count();
        (batches, messages)
    }

    /// Rows and messages acknowledged so far.
    pub fn committed(&self) -> (u64, u64) {
        let rows = self
            .tables
            .values()
            .flat_map(|t| t.batches.values())
            .filter(|b| b.class == Class::Committed)
            .map(|b| b.rows)
            .sum();
        let messages = self
            .streams
            .values()
            .map(|s| {
                s.messages
                    .values()
                    .filter(|m| matches!(m, Message::Committed(_)))
                    .count() as u64
                    + s.producer.acked.len() as u64
            })
            .sum();
        (rows, messages)
    }
}

/// What a server serves, as read by a check.
#[derive(Debug, Default)]
pub struct Served {
    /// Table -> batch numbers present (each one whole and once: checked while reading).
    pub batches: BTreeMap<String, BTreeSet<u64>>,
    /// Stream -> plain message -> its end offset.
    pub messages: BTreeMap<String, BTreeMap<u64, u64>>,
}

/// One table's rows by batch: `(b, rows, distinct ids)`.
pub fn check_table(
    name: &str,
    model: &TableModel,
    rows: &[(u64, u64, u64)],
    problems: &mut Vec<String>,
) -> BTreeSet<u64> {
    let mut present = BTreeSet::new();
    for &(b, n, distinct) in rows {
        present.insert(b);
        if n != distinct {
            problems.push(format!("{name}: a row of batch {b} is served twice"));
        }
        match model.batches.get(&b) {
            Some(batch) => {
                if n != batch.rows {
                    problems.push(format!(
                        "{name}: batch {b} is served partly ({n} of {} rows)",
                        batch.rows
                    ));
                }
                if batch.class == Class::Refused {
                    problems.push(format!(
                        "{name}: batch {b} is served, but its answer said nothing was applied"
                    ));
                }
            }
            None if model.gone.contains(&b) => problems.push(format!(
                "{name}: batch {b} of a dropped table is served again"
            )),
            None => problems.push(format!("{name}: batch {b} is served, but nobody sent it")),
        }
    }
    for (b, batch) in &model.batches {
        if batch.class == Class::Committed && !present.contains(b) {
            problems.push(format!(
                "{name}: acknowledged batch {b} ({} rows) is lost",
                batch.rows
            ));
        }
    }
    present
}

/// One message read back from a stream.
#[derive(Debug)]
pub enum Line {
    Plain(u64),
    Produced { incarnation: u64, seq: u64 },
}

/// One stream's content (each message with its end offset) and whether it is closed, against
/// the model; returns the plain messages' end offsets.
pub fn check_stream(
    model: &StreamModel,
    served: Option<(Vec<(Line, u64)>, bool)>,
    problems: &mut Vec<String>,
) -> BTreeMap<u64, u64> {
    let name = &model.name;
    let mut plain = BTreeMap::new();
    let Some((lines, closed)) = served else {
        match model.presence {
            Presence::Absent | Presence::Unsure(_) => {}
            Presence::Open | Presence::Closed => {
                problems.push(format!("stream {name}: gone, but it was never deleted"))
            }
        }
        return plain;
    };
    match model.presence {
        Presence::Absent => problems.push(format!(
            "stream {name}: served, but its delete was acknowledged"
        )),
        Presence::Open if closed => {
            problems.push(format!("stream {name}: closed, but no close was ever sent"))
        }
        Presence::Closed if !closed => problems.push(format!(
            "stream {name}: open, but its close was acknowledged"
        )),
        _ => {}
    }
    let mut produced = BTreeMap::new();
    for (line, end) in lines {
        match line {
            Line::Plain(n) => {
                if plain.insert(n, end).is_some() {
                    problems.push(format!("stream {name}: message {n} is served twice"));
                }
                match model.messages.get(&n) {
                    Some(Message::Refused) => problems.push(format!(
                        "stream {name}: message {n} is served, but its answer said nothing was applied"
                    )),
                    Some(_) => {}
                    None if model.gone.contains(&n) => problems.push(format!(
                        "stream {name}: message {n} of a deleted incarnation is served again"
                    )),
                    None => problems.push(format!(
                        "stream {name}: message {n} is served, but nobody sent it"
                    )),
                }
            }
            Line::Produced { incarnation, seq } => {
                if incarnation != model.incarnation {
                    problems.push(format!(
                        "stream {name}: producer message {seq} of incarnation {incarnation} is \
                         served in incarnation {}",
                        model.incarnation
                    ));
                }
                if produced.insert(seq, end).is_some() {
                    problems.push(format!(
                        "stream {name}: producer sequence {seq} landed twice"
                    ));
                }
            }
        }
    }
    for (n, message) in &model.messages {
        if let Message::Committed(offset) = message {
            match plain.get(n) {
                None => problems.push(format!("stream {name}: acknowledged message {n} is lost")),
                Some(end) if end != offset => problems.push(format!(
                    "stream {name}: message {n} ends at {end}, but was acknowledged at {offset}"
                )),
                Some(_) => {}
            }
        }
    }
    for (seq, offset) in &model.producer.acked {
        match (produced.get(seq), offset) {
            (None, _) => problems.push(format!(
                "stream {name}: acknowledged producer sequence {seq} is lost"
            )),
            (Some(end), Some(offset)) if end != offset => problems.push(format!(
                "stream {name}: producer sequence {seq} ends at {end}, but was acknowledged at {offset}"
            )),
            _ => {}
        }
    }
    for seq in produced.keys() {
        if !model.producer.acked.contains_key(seq) && model.producer.pending != Some(*seq) {
            problems.push(format!(
                "stream {name}: producer sequence {seq} is served, but was never sent or was refused"
            ));
        }
    }
    plain
}
