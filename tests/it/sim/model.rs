//! What the simulator's clients know: every write they sent and the class of its answer, and
//! the checks of what a server serves against it.
//!
//! Each write is `Committed` (a 2xx: it must be served exactly once, at its acknowledged place,
//! with the values sent), `Refused` (an answer that says nothing was applied, or a request that
//! never reached a server: it must never be served) or `Unknown` (no answer, one that says it
//! may have been applied, or still in flight: served at most once). A write is in the model as
//! `Unknown` from before it is sent, so a read during load may see it. After a restart of a
//! single node an unknown write is settled by what the server serves then: every process that
//! could apply it is gone, and nothing that was not replayed at the start can appear later.

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
    pub digest: Digest,
}

/// What a batch's rows hold, summed: a row served with other values than were sent (a column
/// cut, a timestamp rounded, a note swapped) changes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Digest {
    pub min_id: u64,
    pub max_id: u64,
    /// The notes' lengths, summed.
    pub note_bytes: u64,
    /// Each timestamp's nanoseconds since the epoch modulo [`TS_MODULUS`], summed.
    pub ts_sum: u64,
}

/// The modulus of [`Digest::ts_sum`] (a prime, so every nanosecond counts).
pub const TS_MODULUS: u64 = 1_000_000_007;

/// Most rows one batch holds (ids of batch `b` are `b * ROWS_PER_BATCH + i`).
pub const ROWS_PER_BATCH: u64 = 1000;

/// Batch and message numbers of lane `k` start at `k * LANE_SPAN`: each lane numbers its own
/// writes, so a seed's rerun names the same writes in its messages.
pub const LANE_SPAN: u64 = 1 << 24;

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
    /// Each plain message's padding length (its body is `{"n": n, "pad": "p" * len}`).
    pub pads: BTreeMap<u64, u32>,
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
            pads: BTreeMap::new(),
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
        self.pads.clear();
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
    /// Each lane's last batch and message number (see [`LANE_SPAN`]).
    pub last_batch: BTreeMap<u64, u64>,
    pub last_message: BTreeMap<u64, u64>,
    /// Broken promises, each with what the client saw.
    pub violations: Vec<String>,
    /// Answers by class, for the report.
    pub answers: BTreeMap<&'static str, u64>,
    /// Rows and messages acknowledged since the start, counted as the answers come (never
    /// less after a drop or a delete, unlike [`Model::committed`]): the measure of progress.
    pub acknowledged: (u64, u64),
    /// The last requests and their answers, printed with a failure.
    pub recent: std::collections::VecDeque<String>,
    /// When the run started (the times in `recent` count from it).
    pub started: Option<std::time::Instant>,
}

/// How many requests [`Model::recent`] keeps.
const RECENT: usize = 20_000;

impl Model {
    pub fn violation(&mut self, what: String) {
        eprintln!("VIOLATION: {what}");
        self.violations.push(what);
    }

    /// Notes a request and its answer (see [`Model::recent`]).
    pub fn note(&mut self, what: String) {
        let started = *self.started.get_or_insert_with(std::time::Instant::now);
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent
            .push_back(format!("{:>8.3}s {what}", started.elapsed().as_secs_f64()));
    }

    /// The noted requests that name `needle` (all of them when it is empty), oldest first.
    pub fn recent_about(&self, needles: &[String]) -> String {
        self.recent
            .iter()
            .filter(|r| needles.is_empty() || needles.iter().any(|n| r.contains(n.as_str())))
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn count(&mut self, what: &'static str) {
        *self.answers.entry(what).or_default() += 1;
    }

    pub fn new_batch(&mut self, lane: u64) -> u64 {
        let last = self.last_batch.entry(lane).or_default();
        *last += 1;
        lane * LANE_SPAN + *last
    }

    pub fn new_message(&mut self, lane: u64) -> u64 {
        let last = self.last_message.entry(lane).or_default();
        *last += 1;
        lane * LANE_SPAN + *last
    }

    /// Unknown writes, after a single node's restart and a check that passed: what is served
    /// now was replayed, and nothing else can appear later.
    pub fn settle(&mut self, served: &Served) {
        for (table, model) in &mut self.tables {
            let Some(present) = served.batches.get(table) else {
                continue;
            };
            for (b, batch) in &mut model.batches {
                if batch.class == Class::Unknown {
                    batch.class = if present.contains(b) {
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

/// What a check found wrong: `safety` never holds for a correct server, whenever it is read;
/// `missing` (an acknowledged write not served yet) may hold for a while where reads converge
/// (another node's rows before its flush, a dead node's before its takeover).
#[derive(Debug, Default)]
pub struct Problems {
    pub safety: Vec<String>,
    pub missing: Vec<String>,
}

impl Problems {
    pub fn is_empty(&self) -> bool {
        self.safety.is_empty() && self.missing.is_empty()
    }

    pub fn all(&self) -> String {
        self.safety
            .iter()
            .chain(&self.missing)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// One batch as a table serves it: its rows, distinct ids and digest.
#[derive(Debug, Clone, Copy)]
pub struct ServedBatch {
    pub b: u64,
    pub rows: u64,
    pub distinct: u64,
    pub digest: Digest,
}

/// One table's rows by batch against the model. With `complete`, every acknowledged batch
/// must be there (a check after the writes stopped); without, only what is served is checked
/// (a read while writes go on).
pub fn check_table(
    name: &str,
    model: &TableModel,
    served: &[ServedBatch],
    complete: bool,
    problems: &mut Problems,
) -> BTreeSet<u64> {
    let mut present = BTreeSet::new();
    let safety = &mut problems.safety;
    for s in served {
        let b = s.b;
        present.insert(b);
        if s.rows != s.distinct {
            safety.push(format!("{name}: a row of batch {b} is served twice"));
        }
        match model.batches.get(&b) {
            Some(batch) => {
                if s.rows != batch.rows {
                    safety.push(format!(
                        "{name}: batch {b} is served partly ({} of {} rows)",
                        s.rows, batch.rows
                    ));
                } else if s.digest != batch.digest {
                    safety.push(format!(
                        "{name}: batch {b} is served with other values than were sent: {:?}, \
                         sent {:?}",
                        s.digest, batch.digest
                    ));
                }
                if batch.class == Class::Refused {
                    safety.push(format!(
                        "{name}: batch {b} is served, but its answer said nothing was applied"
                    ));
                }
            }
            None if model.gone.contains(&b) => safety.push(format!(
                "{name}: batch {b} of a dropped table is served again"
            )),
            None => safety.push(format!("{name}: batch {b} is served, but nobody sent it")),
        }
    }
    if complete {
        for (b, batch) in &model.batches {
            if batch.class == Class::Committed && !present.contains(b) {
                problems.missing.push(format!(
                    "{name}: acknowledged batch {b} ({} rows) is lost",
                    batch.rows
                ));
            }
        }
    }
    present
}

/// One message read back from a stream.
#[derive(Debug)]
pub enum Line {
    /// `{"n": n, "pad": ...}`, with the padding's length (`None`: not all `p`s).
    Plain(u64, Option<u32>),
    Produced {
        incarnation: u64,
        seq: u64,
    },
}

/// One stream's content (each message with its end offset) and whether it is closed, against
/// the model; returns the plain messages' end offsets. With `complete`, every acknowledged
/// message must be there.
pub fn check_stream(
    model: &StreamModel,
    served: Option<(Vec<(Line, u64)>, bool)>,
    complete: bool,
    problems: &mut Problems,
) -> BTreeMap<u64, u64> {
    let name = &model.name;
    let mut plain = BTreeMap::new();
    let Some((lines, closed)) = served else {
        match model.presence {
            Presence::Absent | Presence::Unsure(_) => {}
            Presence::Open | Presence::Closed => problems
                .missing
                .push(format!("stream {name}: gone, but it was never deleted")),
        }
        return plain;
    };
    let (safety, missing) = (&mut problems.safety, &mut problems.missing);
    match model.presence {
        Presence::Absent => safety.push(format!(
            "stream {name}: served, but its delete was acknowledged"
        )),
        Presence::Open if closed => {
            safety.push(format!("stream {name}: closed, but no close was ever sent"))
        }
        Presence::Closed if !closed => missing.push(format!(
            "stream {name}: open, but its close was acknowledged"
        )),
        _ => {}
    }
    let mut produced = BTreeMap::new();
    for (line, end) in lines {
        match line {
            Line::Plain(n, pad) => {
                if plain.insert(n, end).is_some() {
                    safety.push(format!("stream {name}: message {n} is served twice"));
                }
                if let Some(sent) = model.pads.get(&n)
                    && pad != Some(*sent)
                {
                    safety.push(format!(
                        "stream {name}: message {n} is served with another body than was sent"
                    ));
                }
                match model.messages.get(&n) {
                    Some(Message::Refused) => safety.push(format!(
                        "stream {name}: message {n} is served, but its answer said nothing was \
                         applied"
                    )),
                    Some(_) => {}
                    None if model.gone.contains(&n) => safety.push(format!(
                        "stream {name}: message {n} of a deleted incarnation is served again"
                    )),
                    None => safety.push(format!(
                        "stream {name}: message {n} is served, but nobody sent it"
                    )),
                }
            }
            Line::Produced { incarnation, seq } => {
                if incarnation != model.incarnation {
                    safety.push(format!(
                        "stream {name}: producer message {seq} of incarnation {incarnation} is \
                         served in incarnation {}",
                        model.incarnation
                    ));
                }
                if produced.insert(seq, end).is_some() {
                    safety.push(format!(
                        "stream {name}: producer sequence {seq} landed twice"
                    ));
                }
            }
        }
    }
    for (n, message) in &model.messages {
        if let Message::Committed(offset) = message {
            match plain.get(n) {
                None if complete => {
                    missing.push(format!("stream {name}: acknowledged message {n} is lost"))
                }
                Some(end) if end != offset => safety.push(format!(
                    "stream {name}: message {n} ends at {end}, but was acknowledged at {offset}"
                )),
                _ => {}
            }
        }
    }
    for (seq, offset) in &model.producer.acked {
        match (produced.get(seq), offset) {
            (None, _) if complete => missing.push(format!(
                "stream {name}: acknowledged producer sequence {seq} is lost"
            )),
            (Some(end), Some(offset)) if end != offset => safety.push(format!(
                "stream {name}: producer sequence {seq} ends at {end}, but was acknowledged at \
                 {offset}"
            )),
            _ => {}
        }
    }
    for seq in produced.keys() {
        if !model.producer.acked.contains_key(seq) && model.producer.pending != Some(*seq) {
            safety.push(format!(
                "stream {name}: producer sequence {seq} is served, but was never sent or was \
                 refused"
            ));
        }
    }
    plain
}
