//! Admission of an append: what a `POST` does to a stream, decided from the stream's state
//! alone, as a pure function (no log, no locks; the caller holds the stream's admission lock
//! and commits the [`Op`] it returns). The order of the checks is the protocol's precedence:
//! a deleted stream, the incarnation precondition, an empty body, then a closed stream (where
//! a producer's retry is still answered as a duplicate and a fenced producer still learns its
//! epoch is stale), the content type, the producer's sequence, and `Stream-Seq`.

use super::codec::Op;
use super::state::{ProducerCheck, StreamState};
use super::{AppendOutcome, AppendRequest, StreamError, encode_body};

/// What an append comes to.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Admission {
    /// Commit this record.
    Commit(Op),
    /// Answer without writing anything (a producer's duplicate, a repeated close).
    Answer(AppendOutcome),
}

/// Decides an append against the stream's state; see the module docs.
pub(super) fn append(
    s: &StreamState,
    req: &AppendRequest,
    max_producers: usize,
) -> Result<Admission, StreamError> {
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
    let producer = req.producer.as_ref().map(|p| (p, s.check_producer(p)));
    let duplicate = |last_seq: u64, next: Option<u64>, epoch: u64| {
        Admission::Answer(AppendOutcome::Duplicate {
            next,
            closed: s.closed,
            epoch,
            last_seq,
            incarnation: s.incarnation.clone(),
        })
    };
    if s.closed {
        match &producer {
            Some((p, ProducerCheck::Duplicate { last_seq, next })) => {
                return Ok(duplicate(*last_seq, next.or(Some(s.tail)), p.epoch));
            }
            Some((_, ProducerCheck::StaleEpoch { current })) => {
                return Err(StreamError::StaleEpoch { current: *current });
            }
            _ => {}
        }
        if req.body.is_empty() && req.producer.is_none() {
            // Closing a closed stream again is idempotent.
            return Ok(Admission::Answer(AppendOutcome::Appended {
                next: s.tail,
                closed: true,
                closed_now: false,
                producer: None,
                incarnation: s.incarnation.clone(),
            }));
        }
        return Err(StreamError::Closed { tail: s.tail });
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
                tail: s.tail,
            });
        }
    }
    match producer {
        Some((p, ProducerCheck::Accept))
            if !s.producers.contains_key(&p.id) && s.producers.len() >= max_producers =>
        {
            return Err(StreamError::TooManyProducers(max_producers));
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
            return Err(StreamError::SequenceGap { expected, received });
        }
        Some((_, ProducerCheck::Accept)) | None => {}
    }
    if let (Some(given), Some(last)) = (&req.stream_seq, &s.stream_seq)
        && given.as_bytes() <= last.as_bytes()
    {
        return Err(StreamError::StreamSeqConflict {
            given: given.clone(),
            last: last.clone(),
            tail: s.tail,
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
        }
    }

    fn producer(epoch: u64, seq: u64) -> Option<ProducerTuple> {
        Some(ProducerTuple {
            id: "p".into(),
            epoch,
            seq,
        })
    }

    fn commit(s: &mut StreamState, r: &AppendRequest) {
        match append(s, r, 10).unwrap() {
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
            append(&s, &r, 10),
            Err(StreamError::BadRequest(_))
        ));
        r.incarnation = Some("other".into());
        assert!(matches!(
            append(&s, &r, 10),
            Err(StreamError::IncarnationMismatch { .. })
        ));
        let mut r = req("x");
        r.content_type = Some("application/json".into());
        assert!(matches!(
            append(&s, &r, 10),
            Err(StreamError::ContentTypeMismatch { .. })
        ));
        // Closed beats content type.
        s.closed = true;
        assert!(matches!(
            append(&s, &r, 10),
            Err(StreamError::Closed { .. })
        ));
        // Closing again is answered, not written.
        let mut close = req("");
        close.close = true;
        assert!(matches!(
            append(&s, &close, 10),
            Ok(Admission::Answer(AppendOutcome::Appended {
                closed_now: false,
                ..
            }))
        ));
        s.gone = true;
        assert!(matches!(append(&s, &close, 10), Err(StreamError::NotFound)));
    }

    #[test]
    fn producers_are_checked_once_whether_the_stream_is_open_or_closed() {
        let mut s = stream();
        let mut r = req("a");
        r.producer = producer(1, 0);
        commit(&mut s, &r);
        // A retry is a duplicate, open or closed; an older epoch is stale, open or closed.
        assert!(matches!(
            append(&s, &r, 10),
            Ok(Admission::Answer(AppendOutcome::Duplicate { .. }))
        ));
        let mut stale = req("b");
        stale.producer = producer(0, 0);
        assert!(matches!(
            append(&s, &stale, 10),
            Err(StreamError::StaleEpoch { current: 1 })
        ));
        let mut gap = req("c");
        gap.producer = producer(1, 5);
        assert!(matches!(
            append(&s, &gap, 10),
            Err(StreamError::SequenceGap {
                expected: 1,
                received: 5
            })
        ));
        let mut new_epoch = req("d");
        new_epoch.producer = producer(2, 3);
        assert!(matches!(
            append(&s, &new_epoch, 10),
            Err(StreamError::NewEpochNotAtZero)
        ));
        s.closed = true;
        assert!(matches!(
            append(&s, &r, 10),
            Ok(Admission::Answer(AppendOutcome::Duplicate {
                closed: true,
                ..
            }))
        ));
        assert!(matches!(
            append(&s, &stale, 10),
            Err(StreamError::StaleEpoch { .. })
        ));
        assert!(matches!(
            append(&s, &gap, 10),
            Err(StreamError::Closed { .. })
        ));
        // A new producer past the cap is refused.
        let s = stream();
        let mut other = req("e");
        other.producer = producer(0, 0);
        assert!(matches!(
            append(&s, &other, 0),
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
            append(&s, &r, 10),
            Err(StreamError::StreamSeqConflict { .. })
        ));
        r.stream_seq = Some("c".into());
        assert!(matches!(append(&s, &r, 10), Ok(Admission::Commit(_))));
    }
}
