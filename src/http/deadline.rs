//! A deadline on reading request bodies, so a client that trickles its body (slowloris) cannot
//! hold a request open for ever: past the deadline the body errors and the handler answers 408.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use http_body::Frame;

use super::AppState;

/// The error a body reports once its deadline passed.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub(crate) struct BodyDeadline(pub(crate) Duration);

struct Deadlined {
    inner: Body,
    sleep: Pin<Box<tokio::time::Sleep>>,
    limit: Duration,
}

impl http_body::Body for Deadlined {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(BodyDeadline(self.limit)))));
        }
        Pin::new(&mut self.inner)
            .poll_frame(cx)
            .map(|f| f.map(|r| r.map_err(Into::into)))
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

/// Refuses requests with oversized headers (431), and puts the deadline on every request's
/// body.
pub(super) async fn body_deadline(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let header_bytes: usize = request
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if header_bytes > MAX_HEADER_BYTES {
        return super::ApiError::new(
            axum::http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            format!("request headers are limited to {MAX_HEADER_BYTES} bytes"),
        )
        .outcome(super::error::Outcome::Rejected)
        .into_response();
    }
    let limit = state.body_timeout;
    let request = request.map(|inner| {
        Body::new(Deadlined {
            inner,
            sleep: Box::pin(tokio::time::sleep(limit)),
            limit,
        })
    });
    next.run(request).await
}
