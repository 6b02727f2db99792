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

    /// Adds an admitted append's effect (as [`StreamState::apply_append`] will apply it):
    /// `bytes` stored, a close, its producer and `Stream-Seq`. Returns the tail after it.
    pub(super) fn add(
        &mut self,
        applied: &StreamState,
        bytes: u64,
        close: bool,
        producer: Option<&ProducerTuple>,
        stream_seq: Option<&String>,
    ) -> u64 {
        self.tail += bytes;
        if let Some(p) = producer {
            let tail = self.tail;
            self.producers
                .entry(p.id.clone())
                .or_insert_with(|| {
                    applied
                        .standing(&p.id)
                        .map(std::borrow::Cow::into_owned)
                        .unwrap_or_default()
                })
                .record(p, tail);
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

/// The caps a new producer is held to.
#[derive(Debug, Clone, Copy)]
pub(super) struct Caps {
    /// Producers per stream.
    pub(super) max_producers: usize,
    /// Bytes left in the server's producer and state budgets (the least of the two).
    pub(super) producer_room: u64,
    /// The server's producer budget (for the refusal's message).
    pub(super) producer_budget: u64,
    /// For an append of a key: bytes left in its share of both budgets (the least).
    pub(super) key_room: Option<u64>,
    /// A key's share of the producer budget (for the refusal's message).
    pub(super) key_budget: u64,
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
    match producer {
        Some((p, ProducerCheck::Accept))
            if view.producer(&p.id).is_none() && view.producer_count() >= max_producers =>
        {
            return Err(StreamError::TooManyProducers(max_producers));
        }
        Some((p, ProducerCheck::Accept))
            if view.producer(&p.id).is_none()
                && caps
                    .key_room
                    .is_some_and(|room| super::state::producer_cost(&p.id) > room) =>
        {
            return Err(StreamError::KeyShareFull {
                what: "producer state",
                budget: caps.key_budget,
            });
        }
        Some((p, ProducerCheck::Accept))
            if view.producer(&p.id).is_none()
                && super::state::producer_cost(&p.id) > caps.producer_room =>
        {
            return Err(StreamError::StateFull {
                what: "producer state",
                budget: caps.producer_budget,
            });
        }
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

    fn caps(max_producers: usize) -> Caps {
        Caps {
            max_producers,
            producer_room: u64::MAX,
            producer_budget: u64::MAX,
            key_room: None,
            key_budget: u64::MAX,
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
            producer_room: crate::stream::state::producer_cost("p") - 1,
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
            producer_room: 0,
            ..caps(10)
        };
        assert!(matches!(
            append(&view, &next, &none_left),
            Ok(Admission::Commit(_))
        ));
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
        closing.add(&applied, 0, true, None, None);
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
        assert_eq!(applied.producers.get("p"), pending.producers.get("p"));
    }
}
