//! Admission of an append: what a `POST` does to a stream, decided from the stream's state
//! alone, as a pure function (no log, no locks; the caller holds the stream's admission lock
//! and commits the [`Op`] it returns). The order of the checks is the protocol's precedence:
//! a deleted stream, the incarnation precondition, an empty body, then a closed stream (where
//! a producer's retry is still answered as a duplicate and a fenced producer still learns its
//! epoch is stale), the content type, the producer's sequence, and `Stream-Seq`.
//!
//! Appends are pipelined: the next one is admitted while those before it wait for their
//! sync. The state it is admitted against ([`View`]) is the applied state with [`Pending`]
//! over it: the tail, closedness, `Stream-Seq` and producers that the appends in flight
//! will leave. Only a [`Admission::Commit`] may be decided against pending appends (its
//! record is chained to theirs in the log, so it is written only if they are); an answer or
//! a refusal must stand on durable state, so the caller decides those again once nothing is
//! in flight.

use std::collections::HashMap;
use std::sync::Arc;

use super::codec::{Op, ProducerTuple};
use super::state::{ProducerCheck, ProducerState, StreamState};
use super::{AppendOutcome, AppendRequest, StreamError, encode_body};

/// What the appends in flight (admitted, not yet applied) make of a stream, over its applied
/// state.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Pending {
    tail: u64,
    closed: bool,
    stream_seq: Option<String>,
    /// The producers the appends in flight name, as they will be.
    producers: HashMap<String, ProducerState>,
}

impl Pending {
    /// Nothing in flight over `applied`.
    pub(super) fn over(applied: &StreamState) -> Self {
        Pending {
            tail: applied.tail,
            closed: applied.closed,
            stream_seq: applied.stream_seq.clone(),
            producers: HashMap::new(),
        }
    }

    /// Adds an admitted append's effect (as [`StreamState::apply_append_by`] will apply
    /// it for `key`): `bytes` stored, a close, its producer (whose entry is then `key`'s)
    /// and `Stream-Seq`. Returns the tail after it.
    pub(super) fn add(
        &mut self,
        applied: &StreamState,
        bytes: u64,
        close: bool,
        producer: Option<&ProducerTuple>,
        stream_seq: Option<&String>,
        key: Option<&Arc<str>>,
    ) -> u64 {
        self.tail += bytes;
        if let Some(p) = producer {
            let tail = self.tail;
            let entry = self.producers.entry(p.id.clone()).or_insert_with(|| {
                applied
                    .standing(&p.id)
                    .map(std::borrow::Cow::into_owned)
                    .unwrap_or_default()
            });
            entry.record(p, tail);
            if let Some(key) = key {
                entry.key = Some(key.clone());
            }
        }
        if let Some(seq) = stream_seq {
            self.stream_seq = Some(seq.clone());
        }
        self.closed |= close;
        self.tail
    }

    /// Whether the stream is closed once the appends in flight are applied.
    pub(super) fn closed(&self) -> bool {
        self.closed
    }
}

/// The state an append is admitted against: the applied state, and what the appends in
/// flight make of it.
#[derive(Debug, Clone, Copy)]
pub(super) struct View<'a> {
    pub(super) applied: &'a StreamState,
    pub(super) pending: Option<&'a Pending>,
}

impl View<'_> {
    fn tail(&self) -> u64 {
        self.pending.map_or(self.applied.tail, |p| p.tail)
    }

    fn closed(&self) -> bool {
        self.pending.map_or(self.applied.closed, |p| p.closed)
    }

    fn stream_seq(&self) -> Option<&String> {
        match self.pending {
            Some(p) => p.stream_seq.as_ref(),
            None => self.applied.stream_seq.as_ref(),
        }
    }

    fn producer(&self, id: &str) -> Option<&ProducerState> {
        self.pending
            .and_then(|p| p.producers.get(id))
            .or_else(|| self.applied.producers.get(id))
    }

    /// What a producer's tuple is checked against: its entry, or what is kept of it if it
    /// expired.
    fn standing(&self, id: &str) -> Option<std::borrow::Cow<'_, ProducerState>> {
        match self.producer(id) {
            Some(state) => Some(std::borrow::Cow::Borrowed(state)),
            None => self.applied.standing(id),
        }
    }

    /// How many producers the stream has, counting those only appends in flight name.
    fn producer_count(&self) -> usize {
        let added = self.pending.map_or(0, |p| {
            p.producers
                .keys()
                .filter(|id| !self.applied.producers.contains_key(*id))
                .count()
        });
        self.applied.producers.len() + added
    }
}

/// What an append comes to.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Admission {
    /// Commit this record.
    Commit(Op),
    /// Answer without writing anything (a producer's duplicate, a repeated close).
    Answer(AppendOutcome),
}

/// One byte budget as a request finds it: the server's, or a key's share of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Budget {
    /// What it holds: [`STATE`] or [`PRODUCERS`].
    pub(super) what: &'static str,
    /// Its size in bytes.
    pub(super) budget: u64,
    /// What is held of it.
    pub(super) held: u64,
    /// A key's share (refused as the key's own excess, 429) rather than the server's.
    pub(super) share: bool,
}

/// The stream-state budget's name in refusals.
pub(super) const STATE: &str = "stream state";
/// The producer budget's name in refusals.
pub(super) const PRODUCERS: &str = "producer state";

impl Budget {
    /// Whether `adds` more bytes fit; the refusal names the budget, its size and what is
    /// held of it.
    pub(super) fn check(&self, adds: u64) -> Result<(), StreamError> {
        if adds <= self.budget.saturating_sub(self.held) {
            return Ok(());
        }
        let (what, budget, held) = (self.what, self.budget, self.held);
        Err(if self.share {
            StreamError::KeyShareFull { what, budget, held }
        } else {
            StreamError::StateFull { what, budget, held }
        })
    }
}

/// The caps a producer entry is held to.
#[derive(Debug, Clone, Copy)]
pub(super) struct Caps {
    /// Producers per stream.
    pub(super) max_producers: usize,
    /// The server's producer and stream-state budgets.
    pub(super) server: [Budget; 2],
    /// For an append of a key: its shares of the same budgets.
    pub(super) key: Option<[Budget; 2]>,
}

/// Decides an append against the stream's state; see the module docs.
pub(super) fn append(
    view: &View<'_>,
    req: &AppendRequest,
    caps: &Caps,
) -> Result<Admission, StreamError> {
    let max_producers = caps.max_producers;
    let s = view.applied;
    if s.gone {
        return Err(StreamError::NotFound);
    }
    if s.soft_deleted {
        return Err(StreamError::Gone);
    }
    if let Some(token) = &req.incarnation
        && *token != s.incarnation
    {
        return Err(StreamError::IncarnationMismatch {
            current: s.incarnation.clone(),
        });
    }
    if req.body.is_empty() && !req.close {
        return Err(StreamError::BadRequest(
            "empty body; only a close (Stream-Closed: true) may have no body".into(),
        ));
    }
    // The producer's standing, decided once.
    let (closed, tail) = (view.closed(), view.tail());
    let producer = req
        .producer
        .as_ref()
        .map(|p| (p, ProducerState::check(view.standing(&p.id).as_deref(), p)));
    let duplicate = |last_seq: u64, next: Option<u64>, epoch: u64| {
        Admission::Answer(AppendOutcome::Duplicate {
            next,
            closed,
            epoch,
            last_seq,
            incarnation: s.incarnation.clone(),
        })
    };
    if closed {
        match &producer {
            Some((p, ProducerCheck::Duplicate { last_seq, next })) => {
                return Ok(duplicate(*last_seq, next.or(Some(tail)), p.epoch));
            }
            Some((_, ProducerCheck::StaleEpoch { current })) => {
                return Err(StreamError::StaleEpoch { current: *current });
            }
            _ => {}
        }
        if req.body.is_empty() && req.producer.is_none() {
            // Closing a closed stream again is idempotent.
            return Ok(Admission::Answer(AppendOutcome::Appended {
                next: tail,
                closed: true,
                closed_now: false,
                producer: None,
                incarnation: s.incarnation.clone(),
            }));
        }
        return Err(StreamError::Closed { tail });
    }
    if !req.body.is_empty() {
        let Some(ct) = &req.content_type else {
            return Err(StreamError::BadRequest(
                "Content-Type is required on an append with a body".into(),
            ));
        };
        if *ct != s.content_type {
            return Err(StreamError::ContentTypeMismatch {
                given: ct.clone(),
                expected: s.content_type.clone(),
                tail,
            });
        }
    }
    if let Some((p, ProducerCheck::Accept)) = &producer {
        let entry = view.producer(&p.id);
        let cost = super::state::producer_cost(&p.id);
        if entry.is_none() && view.producer_count() >= max_producers {
            return Err(StreamError::TooManyProducers(max_producers));
        }
        // The entry counts against the append's key from now on when it is new, or was
        // another key's (or no key's): the key's shares must hold it. Only a new entry
        // adds to the server's budgets. A new entry of a producer whose retired record is
        // kept replaces that record: the stream state it adds is its cost less the record's
        // (to the server, and to the key's share when the key made the record). (An entry
        // an append in flight makes has taken the record's place already.)
        let (freed_server, freed_share) = match entry {
            None => view.applied.freed_by_new_entry(&p.id, req.key.as_deref()),
            Some(_) => (0, 0),
        };
        let adds = |budget: &Budget, freed: u64| match budget.what {
            STATE => cost.saturating_sub(freed),
            _ => cost,
        };
        if let (Some(key), Some(shares)) = (&req.key, &caps.key)
            && entry.is_none_or(|e| e.key.as_deref() != Some(&**key))
        {
            for share in shares {
                share.check(adds(share, freed_share))?;
            }
        }
        if entry.is_none() {
            for budget in &caps.server {
                budget.check(adds(budget, freed_server))?;
            }
        }
    }
    match producer {
        Some((p, ProducerCheck::Duplicate { last_seq, next })) => {
            return Ok(duplicate(last_seq, next, p.epoch));
        }
        Some((_, ProducerCheck::StaleEpoch { current })) => {
            return Err(StreamError::StaleEpoch { current });
        }
        Some((_, ProducerCheck::NewEpochNotAtZero)) => {
            return Err(StreamError::NewEpochNotAtZero);
        }
        Some((_, ProducerCheck::Gap { expected, received })) => {
            return Err(StreamError::SequenceGap {
                expected,
                received,
                tail,
            });
        }
        Some((_, ProducerCheck::Accept)) | None => {}
    }
    if let (Some(given), Some(last)) = (&req.stream_seq, view.stream_seq())
        && given.as_bytes() <= last.as_bytes()
    {
        return Err(StreamError::StreamSeqConflict {
            given: given.clone(),
            last: last.clone(),
            tail,
        });
    }
    let data = if req.body.is_empty() {
        None
    } else {
        encode_body(&s.content_type, &req.body, false)?
    };
    Ok(Admission::Commit(Op::Append {
        name: req.name.clone(),
        incarnation: s.incarnation.clone(),
        data,
        close: req.close,
        producer: req.producer.clone(),
        stream_seq: req.stream_seq.clone(),
    }))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::stream::codec::{Lifetime, ProducerTuple};

    fn stream() -> StreamState {
        StreamState::new(
            "i1".into(),
            "text/plain".into(),
            Lifetime::default(),
            None,
            0,
        )
    }

    fn req(body: &str) -> AppendRequest {
        AppendRequest {
            name: "s".into(),
            content_type: Some("text/plain".into()),
            body: Bytes::from(body.to_owned()),
            close: false,
            producer: None,
            stream_seq: None,
            incarnation: None,
            key: None,
        }
    }

    fn producer(epoch: u64, seq: u64) -> Option<ProducerTuple> {
        Some(ProducerTuple {
            id: "p".into(),
            epoch,
            seq,
        })
    }

    /// The producer and stream-state budgets with `room` bytes left in each.
    fn budgets(room: u64, share: bool) -> [Budget; 2] {
        [PRODUCERS, STATE].map(|what| Budget {
            what,
            budget: 1 << 20,
            held: (1 << 20) - room,
            share,
        })
    }

    fn caps(max_producers: usize) -> Caps {
        Caps {
            max_producers,
            server: budgets(1 << 20, false),
            key: None,
        }
    }

    /// A new producer past the room left in the server's budgets is refused; one already
    /// known is not (its entry is counted already).
    #[test]
    fn new_producers_need_room_in_the_budget() {
        let mut s = StreamState::new(
            "i".into(),
            "text/plain".into(),
            crate::stream::Lifetime::default(),
            None,
            1,
        );
        let view = View {
            applied: &s,
            pending: None,
        };
        let first = AppendRequest {
            producer: producer(0, 0),
            ..req("a")
        };
        let tight = Caps {
            server: budgets(crate::stream::state::producer_cost("p") - 1, false),
            ..caps(10)
        };
        assert!(matches!(
            append(&view, &first, &tight),
            Err(StreamError::StateFull { .. })
        ));
        commit(&mut s, &first);
        let view = View {
            applied: &s,
            pending: None,
        };
        let next = AppendRequest {
            producer: producer(0, 1),
            ..req("b")
        };
        let none_left = Caps {
            server: budgets(0, false),
            ..caps(10)
        };
        assert!(matches!(
            append(&view, &next, &none_left),
            Ok(Admission::Commit(_))
        ));
    }

    /// A key's append that makes a producer entry count against it (a new one, or one
    /// another key made) is held to its shares, and the refusal names the share that is
    /// full, its size and what the key holds of it; its own entry is not held to them.
    #[test]
    fn an_entry_that_becomes_a_keys_is_held_to_its_shares() {
        let mut s = stream();
        let (w1, w2): (Arc<str>, Arc<str>) = (Arc::from("w1"), Arc::from("w2"));
        let cost = crate::stream::state::producer_cost("p");
        let as_key = |key: &Arc<str>, seq: u64| AppendRequest {
            producer: producer(0, seq),
            key: Some(key.clone()),
            ..req("a")
        };
        let full = |what: &'static str| {
            let mut shares = budgets(1 << 20, true);
            for share in &mut shares {
                if share.what == what {
                    share.held = share.budget - cost + 1;
                }
            }
            Caps {
                key: Some(shares),
                ..caps(10)
            }
        };
        let decide_as = |s: &StreamState, r: &AppendRequest, caps: &Caps| {
            let view = View {
                applied: s,
                pending: None,
            };
            append(&view, r, caps)
        };
        for what in [PRODUCERS, STATE] {
            match decide_as(&s, &as_key(&w1, 0), &full(what)) {
                Err(StreamError::KeyShareFull {
                    what: named,
                    budget,
                    held,
                }) => assert_eq!((named, budget, held), (what, 1 << 20, (1 << 20) - cost + 1)),
                other => panic!("{what}: {other:?}"),
            }
        }
        let applied = s.apply_append_by(2, None, false, producer(0, 0), None, Some(&w1));
        assert_eq!(applied.created, Some(cost));
        // w1's own entry: nothing new counts against it.
        assert!(decide_as(&s, &as_key(&w1, 1), &full(STATE)).is_ok());
        // w2 keeping w1's entry alive takes it over: held to w2's shares.
        assert!(matches!(
            decide_as(&s, &as_key(&w2, 1), &full(PRODUCERS)),
            Err(StreamError::KeyShareFull {
                what: PRODUCERS,
                ..
            })
        ));
        assert!(decide_as(&s, &as_key(&w2, 1), &caps(10)).is_ok());
        let applied = s.apply_append_by(3, None, false, producer(0, 1), None, Some(&w2));
        assert_eq!(applied.created, Some(cost));
        assert_eq!(
            applied.released.map(|r| (r.key, r.state, r.producers)),
            Some((w1, cost, cost))
        );
        assert_eq!(s.producers["p"].key.as_deref(), Some("w2"));
    }

    /// A producer back from retirement replaces its retired record: the record's bytes come
    /// back as its new entry comes, to the server's stream state and to the share of the key
    /// that made the record, so an entry that fits only with them is admitted, and no more.
    #[test]
    fn a_producer_back_from_retirement_is_charged_its_entry_less_its_record() {
        use crate::stream::state::{KeyRelease, RETIRED_ENTRY_BYTES, producer_cost};
        let mut s = stream();
        let (w1, w2): (Arc<str>, Arc<str>) = (Arc::from("w1"), Arc::from("w2"));
        let cost = producer_cost("p");
        s.apply_append_by(2, None, false, producer(0, 0), None, Some(&w1));
        assert_eq!(s.expire_producers(i64::MAX, 7, 10), 1);
        assert!(s.producers.is_empty() && s.retired.len() == 1);
        let back_as = |key: &Arc<str>| AppendRequest {
            producer: producer(0, 1),
            key: Some(key.clone()),
            ..req("a")
        };
        // `room` left in the key's stream-state share (or, without `share`, the server's).
        let with_room = |room: u64, share: bool| {
            let mut tight = budgets(1 << 20, share);
            tight[1].held = tight[1].budget - room;
            match share {
                true => Caps {
                    key: Some(tight),
                    ..caps(10)
                },
                false => Caps {
                    server: tight,
                    ..caps(10)
                },
            }
        };
        let decide_as = |r: &AppendRequest, caps: &Caps| {
            let view = View {
                applied: &s,
                pending: None,
            };
            append(&view, r, caps)
        };
        let just = cost - RETIRED_ENTRY_BYTES;
        assert!(decide_as(&back_as(&w1), &with_room(just, true)).is_ok());
        assert!(matches!(
            decide_as(&back_as(&w1), &with_room(just - 1, true)),
            Err(StreamError::KeyShareFull { what: STATE, .. })
        ));
        // w2 did not make the record: its share gets none of it back.
        assert!(matches!(
            decide_as(&back_as(&w2), &with_room(just, true)),
            Err(StreamError::KeyShareFull { what: STATE, .. })
        ));
        assert!(decide_as(&back_as(&w2), &with_room(cost, true)).is_ok());
        // The server's stream state gets it back whoever comes.
        for key in [&w1, &w2] {
            assert!(decide_as(&back_as(key), &with_room(just, false)).is_ok());
            assert!(matches!(
                decide_as(&back_as(key), &with_room(just - 1, false)),
                Err(StreamError::StateFull { what: STATE, .. })
            ));
        }
        // Applied, the entry counts its cost against w1 and the record's bytes come back.
        let applied = s.apply_append_by(3, None, false, producer(0, 1), None, Some(&w1));
        assert_eq!(applied.created, Some(cost));
        assert_eq!(
            applied.released,
            Some(KeyRelease {
                key: w1,
                state: RETIRED_ENTRY_BYTES,
                producers: 0,
            })
        );
        assert!(s.retired.is_empty());
    }

    fn decide(
        s: &StreamState,
        r: &AppendRequest,
        max_producers: usize,
    ) -> Result<Admission, StreamError> {
        let view = View {
            applied: s,
            pending: None,
        };
        append(&view, r, &caps(max_producers))
    }

    fn commit(s: &mut StreamState, r: &AppendRequest) {
        match decide(s, r, 10).unwrap() {
            Admission::Commit(Op::Append {
                data,
                close,
                producer,
                stream_seq,
                ..
            }) => s.apply_append(1, data, close, producer, stream_seq),
            other => panic!("expected a commit, got {other:?}"),
        }
    }

    #[test]
    fn precedence_of_refusals() {
        let mut s = stream();
        let mut r = req("");
        assert!(matches!(
            decide(&s, &r, 10),
            Err(StreamError::BadRequest(_))
        ));
        r.incarnation = Some("other".into());
        assert!(matches!(
            decide(&s, &r, 10),
            Err(StreamError::IncarnationMismatch { .. })
        ));
        let mut r = req("x");
        r.content_type = Some("application/json".into());
        assert!(matches!(
            decide(&s, &r, 10),
            Err(StreamError::ContentTypeMismatch { .. })
        ));
        // Closed beats content type.
        s.closed = true;
        assert!(matches!(
            decide(&s, &r, 10),
            Err(StreamError::Closed { .. })
        ));
        // Closing again is answered, not written.
        let mut close = req("");
        close.close = true;
        assert!(matches!(
            decide(&s, &close, 10),
            Ok(Admission::Answer(AppendOutcome::Appended {
                closed_now: false,
                ..
            }))
        ));
        s.gone = true;
        assert!(matches!(decide(&s, &close, 10), Err(StreamError::NotFound)));
    }

    #[test]
    fn producers_are_checked_once_whether_the_stream_is_open_or_closed() {
        let mut s = stream();
        let mut r = req("a");
        r.producer = producer(1, 0);
        commit(&mut s, &r);
        // A retry is a duplicate, open or closed; an older epoch is stale, open or closed.
        assert!(matches!(
            decide(&s, &r, 10),
            Ok(Admission::Answer(AppendOutcome::Duplicate { .. }))
        ));
        let mut stale = req("b");
        stale.producer = producer(0, 0);
        assert!(matches!(
            decide(&s, &stale, 10),
            Err(StreamError::StaleEpoch { current: 1 })
        ));
        let mut gap = req("c");
        gap.producer = producer(1, 5);
        assert!(matches!(
            decide(&s, &gap, 10),
            Err(StreamError::SequenceGap {
                expected: 1,
                received: 5,
                ..
            })
        ));
        let mut new_epoch = req("d");
        new_epoch.producer = producer(2, 3);
        assert!(matches!(
            decide(&s, &new_epoch, 10),
            Err(StreamError::NewEpochNotAtZero)
        ));
        s.closed = true;
        assert!(matches!(
            decide(&s, &r, 10),
            Ok(Admission::Answer(AppendOutcome::Duplicate {
                closed: true,
                ..
            }))
        ));
        assert!(matches!(
            decide(&s, &stale, 10),
            Err(StreamError::StaleEpoch { .. })
        ));
        assert!(matches!(
            decide(&s, &gap, 10),
            Err(StreamError::Closed { .. })
        ));
        // A new producer past the cap is refused.
        let s = stream();
        let mut other = req("e");
        other.producer = producer(0, 0);
        assert!(matches!(
            decide(&s, &other, 0),
            Err(StreamError::TooManyProducers(0))
        ));
    }

    #[test]
    fn stream_seq_must_grow() {
        let mut s = stream();
        let mut r = req("a");
        r.stream_seq = Some("b".into());
        commit(&mut s, &r);
        assert!(matches!(
            decide(&s, &r, 10),
            Err(StreamError::StreamSeqConflict { .. })
        ));
        r.stream_seq = Some("c".into());
        assert!(matches!(decide(&s, &r, 10), Ok(Admission::Commit(_))));
    }

    #[test]
    fn appends_in_flight_are_admitted_against_what_they_leave() {
        let mut applied = stream();
        let mut first = req("ab");
        first.producer = producer(0, 0);
        first.stream_seq = Some("a".into());
        let mut pending = Pending::over(&applied);
        let next = pending.add(
            &applied,
            2,
            false,
            first.producer.as_ref(),
            first.stream_seq.as_ref(),
            None,
        );
        assert_eq!(next, 2);
        let view = View {
            applied: &applied,
            pending: Some(&pending),
        };
        // The producer's next sequence number is admitted, its retry is a duplicate that
        // answers the offset the first append will have, and a gap counts from it.
        let mut second = req("cd");
        second.producer = producer(0, 1);
        assert!(matches!(
            append(&view, &second, &caps(10)),
            Ok(Admission::Commit(_))
        ));
        assert!(matches!(
            append(&view, &first, &caps(10)),
            Ok(Admission::Answer(AppendOutcome::Duplicate {
                next: Some(2),
                last_seq: 0,
                ..
            }))
        ));
        let mut gap = req("x");
        gap.producer = producer(0, 2);
        assert!(matches!(
            append(&view, &gap, &caps(10)),
            Err(StreamError::SequenceGap {
                expected: 1,
                received: 2,
                ..
            })
        ));
        // Stream-Seq must grow past the one in flight.
        let mut seq = req("x");
        seq.stream_seq = Some("a".into());
        assert!(matches!(
            append(&view, &seq, &caps(10)),
            Err(StreamError::StreamSeqConflict { tail: 2, .. })
        ));
        // The producer cap counts the producers only appends in flight name.
        let mut other = req("y");
        other.producer = Some(ProducerTuple {
            id: "q".into(),
            epoch: 0,
            seq: 0,
        });
        assert!(matches!(
            append(&view, &other, &caps(1)),
            Err(StreamError::TooManyProducers(1))
        ));
        assert!(matches!(
            append(&view, &other, &caps(2)),
            Ok(Admission::Commit(_))
        ));
        // A close in flight closes the stream for what comes after it.
        let mut closing = pending.clone();
        closing.add(&applied, 0, true, None, None, None);
        let view = View {
            applied: &applied,
            pending: Some(&closing),
        };
        assert!(matches!(
            append(&view, &second, &caps(10)),
            Err(StreamError::Closed { tail: 2 })
        ));
        // Nothing of it touched the applied state; once the first append is applied, the
        // two agree.
        assert_eq!(applied.tail, 0);
        assert!(applied.producers.is_empty());
        commit(&mut applied, &first);
        assert_eq!(applied.tail, pending.tail);
        assert_eq!(applied.stream_seq, pending.stream_seq);
        // (Each stamps the producer with the clock when it ran: a millisecond may pass.)
        let unstamped = |p: Option<&ProducerState>| {
            p.map(|p| ProducerState {
                last_ms: 0,
                ..p.clone()
            })
        };
        assert_eq!(
            unstamped(applied.producers.get("p")),
            unstamped(pending.producers.get("p"))
        );
    }
}
