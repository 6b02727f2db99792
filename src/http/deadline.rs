//! A deadline on reading request bodies, so a client that trickles its body (slowloris) cannot
//! hold a request open for ever: past the deadline the body errors and the handler answers 408.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::response::{IntoResponse as _, Response};
use http_body::Frame;

use super::AppState;

/// The error a body reports once its deadline passed.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub(crate) struct BodyDeadline(pub(crate) Duration);

/// A body that errors once `deadline` passed while it waits for data. The timer is armed
/// only when the body first has to wait: most bodies arrive with their headers, and then no
/// timer is set at all.
struct Deadlined {
    inner: Body,
    deadline: tokio::time::Instant,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    limit: Duration,
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
            return Poll::Ready(frame.map(|r| r.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(BodyDeadline(this.limit)))));
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

/// Puts the deadline on the request's body.
pub(super) fn body_deadline(state: &AppState, request: Request) -> Request {
    let limit = state.body_timeout;
    request.map(|inner| {
        Body::new(Deadlined {
            inner,
            deadline: tokio::time::Instant::now() + limit,
            sleep: None,
            limit,
        })
    })
}
