//! Deadlines on reading request bodies, so a client that trickles its body (slowloris)
//! cannot hold a request open: a body errors (the handler answers 408) once
//! `request_body_timeout_seconds` passed since the request came, or once it arrives slower
//! than `min_body_bytes_per_second` after a grace of [`PACE_GRACE`].
//!
//! The pace counts only the time the server waits for the client: the time from a read that
//! found no data to the data's arrival. Time the handler spends elsewhere between reads
//! (waiting for room in the body budget, decoding) is the server's, and a client whose
//! bytes wait in the socket meanwhile is not blamed for it. Each byte that arrived buys
//! `1 / min_body_bytes_per_second` more seconds.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::response::{IntoResponse as _, Response};
use http_body::Frame;
use tokio::time::Instant;

use super::AppState;

/// How long a body may take before its pace is judged.
pub(crate) const PACE_GRACE: Duration = Duration::from_secs(10);

/// The error a body reports once its deadline passed.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub(crate) struct BodyDeadline(pub(crate) Duration);

/// The error a body reports once it arrived slower than its pace allows.
#[derive(Debug, thiserror::Error)]
#[error(
    "the request body arrived slower than {0} bytes per second (after the first {secs} s)",
    secs = PACE_GRACE.as_secs()
)]
pub(crate) struct BodyTooSlow(pub(crate) u64);

/// A body that errors once its deadline passed or its pace fell behind, while it waits for
/// data. The timer is armed only when the body has to wait: most bodies arrive with their
/// headers, and then no timer is set at all.
struct Deadlined {
    inner: Body,
    deadline: Instant,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    limit: Duration,
    /// Bytes per second the body must keep up after [`PACE_GRACE`] (0: no pace).
    min_rate: u64,
    /// Bytes that arrived.
    received: u64,
    /// Time spent waiting for the client, and since when it is being waited for now.
    client_time: Duration,
    waiting_since: Option<Instant>,
}

impl Deadlined {
    /// When the current wait for data must end: the body's deadline, or where its pace
    /// runs out.
    fn wake_at(&self, since: Instant) -> (Instant, bool) {
        if self.min_rate == 0 {
            return (self.deadline, false);
        }
        let earned = PACE_GRACE
            .saturating_add(Duration::from_secs_f64(
                self.received as f64 / self.min_rate as f64,
            ))
            .saturating_sub(self.client_time);
        let paced = since.checked_add(earned).unwrap_or(self.deadline);
        if paced < self.deadline {
            (paced, true)
        } else {
            (self.deadline, false)
        }
    }
}

impl http_body::Body for Deadlined {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            if let Some(since) = this.waiting_since.take() {
                this.client_time = this.client_time.saturating_add(since.elapsed());
            }
            if let Some(Ok(data)) = frame.as_ref().map(|f| f.as_ref().map(Frame::data_ref)) {
                this.received = this
                    .received
                    .saturating_add(data.map_or(0, |d| d.len() as u64));
            }
            return Poll::Ready(frame.map(|r| r.map_err(Into::into)));
        }
        let starts = this.waiting_since.is_none();
        let since = *this.waiting_since.get_or_insert_with(Instant::now);
        let (wake, paced) = this.wake_at(since);
        match &mut this.sleep {
            Some(sleep) if starts => sleep.as_mut().reset(wake),
            Some(_) => {}
            None => this.sleep = Some(Box::pin(tokio::time::sleep_until(wake))),
        }
        if let Some(sleep) = &mut this.sleep
            && sleep.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Some(Err(if paced {
                Box::new(BodyTooSlow(this.min_rate))
            } else {
                Box::new(BodyDeadline(this.limit))
            })));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The most header bytes (names and values) a request may carry.
pub(crate) const MAX_HEADER_BYTES: usize = 64 << 10;

/// The refusal (431) of a request whose headers are over [`MAX_HEADER_BYTES`].
pub(super) fn headers_refusal(request: &Request) -> Option<Response> {
    let header_bytes: usize = request
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    (header_bytes > MAX_HEADER_BYTES).then(|| {
        super::ApiError::new(
            axum::http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            format!("request headers are limited to {MAX_HEADER_BYTES} bytes"),
        )
        .outcome(super::error::Outcome::Rejected)
        .into_response()
    })
}

/// Puts the deadline and the pace on the request's body.
pub(super) fn body_deadline(state: &AppState, request: Request) -> Request {
    let limit = state.body_timeout;
    let min_rate = state.min_body_rate;
    request.map(|inner| {
        Body::new(Deadlined {
            inner,
            deadline: Instant::now() + limit,
            sleep: None,
            limit,
            min_rate,
            received: 0,
            client_time: Duration::ZERO,
            waiting_since: None,
        })
    })
}
