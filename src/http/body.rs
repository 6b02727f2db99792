//! Reading request bodies within their limits and the request-body budget.
//!
//! Every body an endpoint buffers (ingest, stream creates and appends, JSON requests) is read
//! here, into a [`BodyReservation`] that grows as its bytes arrive: the buffer grows in steps
//! and each step is reserved before it is allocated, so what a body holds is what it sent
//! (never what it declared or might send). Decompressed output is reserved the same way,
//! step by step, before it is decoded ([`decode_body`]). A body that finds no room within
//! the request's admission wait answers 503 with `Retry-After` and nothing applied; one that
//! arrives too slowly is cut by its pace ([`super::deadline`]) and answers 408. Either way
//! its reservation is given back when the request ends.

use axum::body::Body;
use axum::http::StatusCode;
use bytes::Bytes;
use futures::StreamExt as _;

use super::ApiError;
use super::error::Outcome;
use crate::db::BodyReservation;
use crate::ingest::{ContentEncoding, Decompressor};

/// At most this many bytes past its limit are read of a body refused as too large: enough
/// for a client to finish a body somewhat over the limit and read the 413, not a way to make
/// the server read without end.
const MAX_DRAIN_BYTES: usize = 64 << 20;

/// The first step of a body buffer whose length is not declared.
const FIRST_STEP: usize = 64 << 10;

/// How much decompressed output is decoded (and reserved) per step.
const DECODE_STEP: usize = 1 << 20;

/// Reads a request body of at most `limit` bytes, answering 413 past it, reserving what it
/// holds in `reservation` as it comes (see the module docs).
///
/// The buffer grows to the next step before the bytes that need it are copied: the declared
/// length at once when enough of it already arrived to make that the next step, else by
/// doubling (from [`FIRST_STEP`]), never past the declared length or the limit. So a body
/// holds at most twice what it sent, and a declared body ends in a buffer of its exact
/// size.
///
/// Past the limit the rest of the body, up to [`MAX_DRAIN_BYTES`] more (and at most its
/// limit's worth), is read and dropped before the 413 goes out, holding nothing: a client
/// sends its whole body before it reads the answer; had the server answered and closed
/// mid-body, the client's next write failed (a broken pipe) and it never saw the 413. The
/// body's deadline and pace bound the draining as they bound the reading. A body whose
/// declared length is past what would be drained is refused at once, unread.
///
/// Frames are copied into one buffer as they come: kept as they came, a body sent in
/// one-byte chunks held a 32-byte handle (and a share of a read buffer) for every byte.
pub(super) async fn read_body(
    body: Body,
    limit: usize,
    reservation: &mut BodyReservation,
) -> Result<Bytes, ApiError> {
    let drain = MAX_DRAIN_BYTES.min(limit);
    let hint = http_body::Body::size_hint(&body);
    let declared = usize::try_from(hint.lower()).unwrap_or(usize::MAX);
    if declared > limit.saturating_add(drain) {
        return Err(body_too_large(limit));
    }
    // The most the buffer will need: the exact length when it is declared and within the
    // limit, else the limit.
    let ceiling = match hint.exact() {
        Some(exact) if declared <= limit && exact == declared as u64 => declared,
        _ => limit,
    };
    let mut frames = body.into_data_stream();
    let mut read: Vec<u8> = Vec::new();
    while let Some(frame) = frames.next().await {
        let frame = frame.map_err(|e| body_error(&e))?;
        let needed = read.len().saturating_add(frame.len());
        if needed > limit {
            drop(read);
            reservation.release();
            let mut dropped = frame.len();
            while dropped < drain {
                match frames.next().await {
                    Some(Ok(more)) => dropped = dropped.saturating_add(more.len()),
                    _ => break,
                }
            }
            return Err(body_too_large(limit));
        }
        if needed > read.capacity() {
            let step = needed
                .max(read.capacity().saturating_mul(2))
                .max(FIRST_STEP)
                .min(ceiling.max(needed));
            reservation
                .grow_to(step)
                .await
                .map_err(|e| ApiError::of(&e))?;
            read.reserve_exact(step - read.len());
        }
        read.extend_from_slice(&frame);
    }
    Ok(Bytes::from(read))
}

/// Undoes a body's `Content-Encoding` within `limit` bytes of output, reserving each step of
/// output (on top of the raw body's bytes) before decoding it, off the I/O threads.
pub(super) async fn decode_body(
    raw: Bytes,
    encoding: ContentEncoding,
    limit: usize,
    reservation: &mut BodyReservation,
) -> Result<Bytes, ApiError> {
    let input = |e: crate::ingest::IngestError| ApiError::from(crate::db::IngestFailure::Input(e));
    if encoding == ContentEncoding::Identity {
        if raw.len() > limit {
            return Err(input(crate::ingest::IngestError::BodyTooLarge { limit }));
        }
        return Ok(raw);
    }
    let raw_len = raw.len();
    let mut decoder = Decompressor::new(raw, encoding, limit).map_err(input)?;
    loop {
        reservation
            .grow_to(
                raw_len
                    .saturating_add(decoder.len())
                    .saturating_add(DECODE_STEP),
            )
            .await
            .map_err(|e| ApiError::of(&e))?;
        let (back, done) = tokio::task::spawn_blocking(move || {
            let done = decoder.step(DECODE_STEP);
            (decoder, done)
        })
        .await
        .map_err(|e| ApiError::internal(format!("decompression stopped: {e}")))?;
        decoder = back;
        if done.map_err(input)? {
            return Ok(Bytes::from(decoder.into_output()));
        }
    }
}

/// The 413 of a body past `limit` bytes.
fn body_too_large(limit: usize) -> ApiError {
    ApiError::payload_too_large(format!("request body is larger than {limit} bytes"))
        .outcome(Outcome::Rejected)
}

/// The answer to a body that could not be read: 408 past its deadline or behind its pace,
/// else 400.
fn body_error(e: &axum::Error) -> ApiError {
    use super::deadline::{BodyDeadline, BodyTooSlow};
    // The cause can sit several wrappers deep (axum's error, the body's).
    let chain = || {
        std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |s| {
            s.source()
        })
    };
    let late = chain().find_map(|cause| {
        cause
            .downcast_ref::<BodyDeadline>()
            .map(ToString::to_string)
            .or_else(|| cause.downcast_ref::<BodyTooSlow>().map(ToString::to_string))
    });
    match late {
        Some(message) => ApiError::new(StatusCode::REQUEST_TIMEOUT, "request_timeout", message)
            .outcome(Outcome::Rejected),
        None => ApiError::bad_request(format!("could not read the request body: {e}"))
            .outcome(Outcome::Rejected),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::{BodyBudget, DbConfig};

    fn budget(bytes: usize) -> BodyBudget {
        let mut config = DbConfig::new("unused");
        config.ingest_inflight_bytes = bytes;
        config.ingest_admission_timeout = std::time::Duration::from_millis(50);
        BodyBudget::new(&config)
    }

    /// A body in many frames (one byte each) comes back whole and in order; one byte past
    /// the limit, or a declared length past what would be drained, is a 413 that holds
    /// nothing of the budget.
    #[tokio::test]
    async fn bodies_are_read_whole_or_refused_past_the_limit() {
        let budget = budget(1 << 20);
        let bytes: Vec<u8> = (0..=255u8).collect();
        let frames = futures::stream::iter(
            bytes
                .iter()
                .map(|b| Ok::<_, std::io::Error>(Bytes::copy_from_slice(&[*b])))
                .collect::<Vec<_>>(),
        );
        let mut held = budget.reservation(None);
        let read = read_body(Body::from_stream(frames), 256, &mut held)
            .await
            .expect("read");
        assert_eq!(read.as_ref(), bytes.as_slice());

        let mut held = budget.reservation(None);
        let over = read_body(Body::from(vec![1u8; 257]), 256, &mut held).await;
        assert_eq!(
            over.err().map(|e| e.status),
            Some(StatusCode::PAYLOAD_TOO_LARGE)
        );
        assert_eq!(held.bytes(), 0);
        let far_over = read_body(Body::from(vec![1u8; 513]), 256, &mut held).await;
        assert_eq!(
            far_over.err().map(|e| e.status),
            Some(StatusCode::PAYLOAD_TOO_LARGE)
        );
        let empty = read_body(Body::empty(), 256, &mut held)
            .await
            .expect("read");
        assert!(empty.is_empty());
    }

    /// A body without a declared length reserves in steps as it arrives: a few bytes hold
    /// the first step, not the limit; a declared body ends reserved at its exact size.
    #[tokio::test]
    async fn a_body_reserves_what_arrived_not_its_limit() {
        let budget = budget(64 << 20);
        let limit = 16 << 20;
        let chunked = futures::stream::iter(vec![Ok::<_, std::io::Error>(Bytes::from_static(
            b"{\"a\":1}\n",
        ))]);
        let mut held = budget.reservation(None);
        read_body(Body::from_stream(chunked), limit, &mut held)
            .await
            .expect("read");
        assert_eq!(held.bytes(), FIRST_STEP);
        // Half a megabyte in 1000-byte frames: at most twice what came.
        let frames = futures::stream::iter(
            (0..512).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 1000]))),
        );
        let mut held = budget.reservation(None);
        let read = read_body(Body::from_stream(frames), limit, &mut held)
            .await
            .expect("read");
        assert_eq!(read.len(), 512_000);
        assert!(held.bytes() <= 2 * 512_000 + 1024, "{}", held.bytes());
        // Declared: its exact size.
        let mut held = budget.reservation(None);
        read_body(Body::from(vec![b'y'; 3 << 20]), limit, &mut held)
            .await
            .expect("read");
        assert_eq!(held.bytes(), 3 << 20);
    }

    /// A body that finds no room within the admission wait answers 503, nothing applied.
    #[tokio::test]
    async fn no_room_answers_503() {
        let budget = budget(128 << 10);
        let mut hog = budget.reservation(None);
        hog.grow_to(128 << 10).await.expect("room");
        let mut held = budget.reservation(None);
        let refused = read_body(Body::from(vec![b'z'; 1000]), 1 << 20, &mut held)
            .await
            .expect_err("no room");
        assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refused.retry_after_seconds, Some(1));
    }

    /// Decompressed output is reserved as it is decoded, on top of the raw body.
    #[tokio::test]
    async fn decoded_bytes_are_reserved_in_steps() {
        use std::io::Write as _;
        let budget = budget(64 << 20);
        let data = vec![b'q'; 3 << 20];
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(&data).expect("gzip");
        let packed = Bytes::from(enc.finish().expect("gzip"));
        let raw_len = packed.len();
        let mut held = budget.reservation(None);
        let plain = decode_body(packed, ContentEncoding::Gzip, 16 << 20, &mut held)
            .await
            .expect("decoded");
        assert_eq!(plain.len(), data.len());
        // Every step reserved before it was decoded: the output and one step more.
        assert!(held.bytes() >= raw_len + data.len());
        assert!(held.bytes() <= raw_len + data.len() + 2 * DECODE_STEP);
    }
}
