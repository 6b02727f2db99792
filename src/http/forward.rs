//! Requests for streams another node serves, forwarded to it (object-store durability).
//!
//! A stream is served by one process: the node that created it, or the node that took that
//! node's id over (`db::takeover`). A request for a stream this process does not serve is
//! looked up on the live peers, whose heartbeats name their URLs: a `HEAD` of the stream on
//! each, and the one answering `200` serves it (remembered for a lease). The request is then
//! sent there with its method, path, query, headers (the API key included: the owner checks
//! it again) and body, and the answer is relayed as it comes, long-polls and SSE included.
//! A catch-up read the owner's snapshot reaches is not forwarded: this node answers it from
//! the object store (`sealed_read` in `http::streams`).
//!
//! Invariants:
//! - A forwarded request carries [`FORWARDED`] and is never forwarded again, so no request
//!   bounces between nodes; a client that sends the header only gets this node's own answer.
//! - The target is always a peer's URL from the object store, never anything a client
//!   names: the client's path is appended to it, its host is never used.
//! - A create of a name no peer serves is served here, after its claim (`db::names`) says
//!   where: a name another node owns is created there.
//! - The `Location` of a create made on a peer names the host the client used: the peer
//!   builds it from the `Host` it was reached at, and this node puts its own request's
//!   `Host` in its place as it relays the answer. No node takes a host from a header a
//!   client can send (`X-Forwarded-Host`, `Forwarded`).

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse as _, Response};
use bytes::Bytes;

use super::AppState;
use super::error::ApiError;
use crate::error::{ErrorClass, Kind};

/// The header that marks a forwarded request.
pub(super) const FORWARDED: &str = "sluice-forwarded";

/// How long a peer may take to say whether it serves a stream.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a peer may take to list its streams.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// The client the forwarding uses: no proxy from the environment, no redirects followed.
pub(super) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(PROBE_TIMEOUT)
        .build()
        .unwrap_or_default()
}

/// Headers that belong to one connection, not to the request or answer.
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
    )
}

/// A `Location` the peer answered, with the peer's host replaced by the one this node's
/// client used (`None` for any other header, or a value that is not an absolute `http` URL).
fn relayed_location(
    header: &HeaderName,
    value: &HeaderValue,
    client: &HeaderMap,
) -> Option<HeaderValue> {
    if header != axum::http::header::LOCATION {
        return None;
    }
    let rest = value.to_str().ok()?.strip_prefix("http://")?;
    let path = &rest[rest.find('/').unwrap_or(rest.len())..];
    let host = client
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    HeaderValue::from_str(&format!("http://{host}{path}")).ok()
}

/// The peer that serves stream `name`, when this process does not and a peer does.
pub(super) async fn owner(state: &AppState, name: &str, headers: &HeaderMap) -> Option<String> {
    if headers.contains_key(FORWARDED) || state.db.serves_stream(name) {
        return None;
    }
    if let Some(url) = state.db.cached_stream_owner(name) {
        return Some(url);
    }
    let peers = state.db.peer_urls();
    if peers.is_empty() {
        return None;
    }
    let probes = peers.iter().map(|peer| async move {
        let mut url = reqwest::Url::parse(peer).ok()?;
        url.path_segments_mut()
            .ok()?
            .pop_if_empty()
            .extend(["v1", "stream"])
            .extend(name.split('/'));
        let mut request = state
            .forward_client
            .head(url)
            .header(FORWARDED, "1")
            .timeout(PROBE_TIMEOUT);
        if let Some(auth) = headers.get(axum::http::header::AUTHORIZATION) {
            request = request.header(axum::http::header::AUTHORIZATION, auth);
        }
        let answer = request.send().await.ok()?;
        (answer.status() == StatusCode::OK).then(|| peer.clone())
    });
    let found = futures::future::join_all(probes)
        .await
        .into_iter()
        .flatten()
        .next();
    if let Some(url) = &found {
        state.db.note_stream_owner(name, Some(url));
    }
    found
}

/// Every live peer's own streams for a `GET /v1/streams` with `query`: each peer's
/// listing and whether it was truncated, `None` for a peer that did not answer.
pub(super) async fn list_on_peers(
    state: &AppState,
    query: &str,
    headers: &HeaderMap,
) -> Vec<Option<(Vec<serde_json::Value>, bool)>> {
    let peers = state.db.peer_urls();
    let listings = peers.iter().map(|peer| async move {
        let mut request = state
            .forward_client
            .get(format!("{peer}/v1/streams?{query}"))
            .header(FORWARDED, "1")
            .timeout(LIST_TIMEOUT);
        if let Some(auth) = headers.get(axum::http::header::AUTHORIZATION) {
            request = request.header(axum::http::header::AUTHORIZATION, auth);
        }
        let answer = request.send().await.ok()?;
        if answer.status() != StatusCode::OK {
            return None;
        }
        let mut listing: serde_json::Value = answer.json().await.ok()?;
        let truncated = listing["truncated"].as_bool().unwrap_or(false);
        match listing["streams"].take() {
            serde_json::Value::Array(streams) => Some((streams, truncated)),
            _ => None,
        }
    });
    futures::future::join_all(listings).await
}

/// Sends the request to `peer` and relays its answer.
pub(super) async fn forward(
    state: &AppState,
    name: &str,
    peer: &str,
    method: Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let url = format!("{peer}{path}");
    let mut request = state
        .forward_client
        .request(method.clone(), &url)
        .header(FORWARDED, "1");
    for (header, value) in headers {
        // The host and length are the new request's own.
        if !hop_by_hop(header)
            && header != axum::http::header::HOST
            && header != axum::http::header::CONTENT_LENGTH
            && header.as_str() != FORWARDED
        {
            request = request.header(header, value);
        }
    }
    if !body.is_empty() {
        request = request.body(body);
    }
    // A paused owner's kernel still accepts the connection: the answer's head must come
    // within a bound (a few leases: by then the owner answers or was taken over), except for
    // live reads, whose head comes when there is data or the long-poll ends.
    let live = uri.query().is_some_and(|q| q.contains("live="));
    let bound = (state.db.node_lease() * 3).max(Duration::from_secs(30));
    let sent = if live {
        request
            .send()
            .await
            .map_err(|e| (e.is_connect(), e.to_string()))
    } else {
        match tokio::time::timeout(bound, request.send()).await {
            Ok(sent) => sent.map_err(|e| (e.is_connect(), e.to_string())),
            Err(_) => Err((false, format!("no answer in {bound:?}"))),
        }
    };
    let answer = match sent {
        Ok(answer) => answer,
        Err((refused, e)) => {
            // The owner may have died: look it up afresh next time.
            state.db.note_stream_owner(name, None);
            // A read, or a write the owner never received, may simply be sent again.
            let class = if method == Method::GET || method == Method::HEAD || refused {
                ErrorClass::retry("OwnerUnavailable")
            } else {
                ErrorClass::unknown(Kind::Unavailable)
            };
            return ApiError::classified(
                class,
                format!("the node serving stream {name:?} did not answer: {e}"),
            )
            .into_response();
        }
    };
    if answer.status() == StatusCode::NOT_FOUND
        || answer.status() == StatusCode::SERVICE_UNAVAILABLE
    {
        // Moved or deleted since it was found there (or the owner cannot serve it now): look
        // it up afresh next time.
        state.db.note_stream_owner(name, None);
    }
    let mut response = Response::builder().status(answer.status());
    if let Some(out) = response.headers_mut() {
        for (header, value) in answer.headers() {
            if hop_by_hop(header) {
                continue;
            }
            let value = relayed_location(header, value, headers).unwrap_or_else(|| value.clone());
            out.append(header, value);
        }
    }
    response
        .body(Body::from_stream(answer.bytes_stream()))
        .unwrap_or_else(|e| ApiError::internal(e.to_string()).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A relayed `Location` keeps the peer's path and takes the client's host; other
    /// headers pass as they are.
    #[test]
    fn a_relayed_location_names_the_clients_host() {
        let mut client = HeaderMap::new();
        client.insert(
            axum::http::header::HOST,
            HeaderValue::from_static("sluice.example:6543"),
        );
        let location = HeaderValue::from_static("http://10.0.0.7:6543/v1/stream/a/b");
        assert_eq!(
            relayed_location(&axum::http::header::LOCATION, &location, &client),
            Some(HeaderValue::from_static(
                "http://sluice.example:6543/v1/stream/a/b"
            ))
        );
        assert_eq!(
            relayed_location(&axum::http::header::ETAG, &location, &client),
            None
        );
        assert_eq!(
            relayed_location(&axum::http::header::LOCATION, &location, &HeaderMap::new()),
            Some(HeaderValue::from_static("http://localhost/v1/stream/a/b"))
        );
    }
}
