//! The layer's answers: the handler's answer read and kept for the store, a stored answer
//! replayed, a rejection rendered.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response};
use http_body::Body;

use crate::body::{Chunks, ResponseBody};
use crate::config::{Config, StorePolicy};
use crate::future::polled_after_finishing;
use crate::grpc;
use crate::outcome::{Outcome, Taken, record};
use crate::rejection::Rejection;
use crate::response::{
    IDEMPOTENT_REPLAYED, ReplayedHeaders, StoredResponse, keeps_every_header, replayable_headers,
};

pub(crate) fn render<B: Body>(config: &Config, rejection: &Rejection) -> Response<ResponseBody<B>> {
    config.reject(rejection).map(ResponseBody::full)
}

/// The longest `Retry-After` hint of a `409` while the first request runs: 1 s, the smallest
/// whole second. A store knows when the first request's lease runs out, not when its handler
/// will answer; the lease is renewed while the handler runs, so what is left of it (up to all
/// of it, 30 s by default) says nothing about when the answer will be there to replay.
const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The layer's answer to a request whose key is taken (recorded as its outcome).
pub(crate) fn answer_taken<B: Body>(config: &Config, taken: Taken) -> Response<ResponseBody<B>> {
    match taken {
        Taken::Completed(stored) => {
            record(Outcome::Replayed);
            replay(config, stored)
        }
        Taken::InFlight(retry_after) => {
            record(Outcome::InFlight);
            let retry_after = retry_after.min(IN_FLIGHT_RETRY_AFTER);
            render(config, &Rejection::InFlight { retry_after })
        }
        Taken::Mismatch => {
            record(Outcome::Mismatch);
            render(config, &Rejection::KeyReused)
        }
    }
}

/// Reads the handler's answer: the response for the client, and what to store of it.
///
/// Nothing is stored (`None`) for an answer the layer does not store ([`Config::stores`]: by
/// default a `5xx`, `408` and `429`) and for a body that failed: those release the key
/// instead.
pub(crate) fn to_store<B: Body>(config: &Config, response: Response<B>) -> ToStore<B> {
    let grpc = grpc::is_grpc(response.headers());
    // A gRPC answer's outcome is its `grpc-status`: in the headers of a trailers-only answer,
    // else in the trailers, read with the body (below).
    let status = grpc
        .then(|| grpc::status_in(response.headers()))
        .flatten()
        .unwrap_or(response.status());
    if !config.store_policy.stores(status, response.headers()) {
        return ToStore(Some(Answer::Unstored(response)));
    }
    let (parts, body) = response.into_parts();
    ToStore(Some(Answer::Reading {
        parts,
        body: Box::pin(body),
        chunks: Chunks::default(),
        trailers: None,
        len: 0,
        limit: config.max_response_body,
        keep_set_cookie: config.keep_set_cookie,
        policy: config.replayed_headers.clone(),
        grpc: grpc.then(|| config.store_policy.clone()),
    }))
}

/// The future of [`to_store`].
pub(crate) struct ToStore<B: Body>(Option<Answer<B>>);

enum Answer<B: Body> {
    Unstored(Response<B>),
    /// Reads the body up to `limit` bytes, and its trailers, which are stored with it.
    Reading {
        parts: http::response::Parts,
        body: Pin<Box<B>>,
        chunks: Chunks,
        trailers: Option<Box<HeaderMap>>,
        len: usize,
        limit: usize,
        keep_set_cookie: bool,
        policy: ReplayedHeaders,
        /// A gRPC answer: whether it is stored is decided again on the `grpc-status` of its
        /// trailers.
        grpc: Option<StorePolicy>,
    },
}

// The response is moved, never pinned: only its body is polled, from its own box.
impl<B: Body> Unpin for ToStore<B> {}

/// How reading an answer ended.
enum Read<E> {
    Complete,
    TooLarge,
    Failed(E),
}

/// An answer to store, read by [`ToStore`].
///
/// When every header of the response is stored, the response lends them to the stored answer
/// and goes to the client without them until [`Keep::restore`] gives them back: after the
/// store is done with the answer, that takes no copy (a store that keeps a clone of the answer
/// gets one made).
pub(crate) struct Keep {
    pub(crate) answer: StoredResponse,
    lent: bool,
}

impl Keep {
    /// Gives `response` back the headers it lent, if it did. Call it once the store no longer
    /// holds the answer, and before the response leaves the layer.
    pub(crate) fn restore<B>(self, response: &mut Response<B>) {
        if self.lent {
            *response.headers_mut() = self.answer.into_headers();
        }
    }
}

impl<B: Body<Data = Bytes>> Future for ToStore<B> {
    /// The response for the client (without its headers when it lent them to the [`Keep`]),
    /// and what to store of it.
    type Output = (Response<ResponseBody<B>>, Option<Keep>);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let read = match &mut self.0 {
            None => return polled_after_finishing(),
            Some(Answer::Unstored(_)) => Read::Complete,
            Some(Answer::Reading {
                body,
                chunks,
                trailers,
                len,
                limit,
                ..
            }) => loop {
                match ready!(body.as_mut().poll_frame(cx)) {
                    None => break Read::Complete,
                    Some(Err(e)) => break Read::Failed(e),
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => {
                            if data.is_empty() {
                                continue;
                            }
                            *len = len.saturating_add(data.len());
                            chunks.push(data);
                            if *len > *limit {
                                break Read::TooLarge;
                            }
                        }
                        Err(frame) => {
                            if let Ok(t) = frame.into_trailers() {
                                trailers.get_or_insert_with(Box::default).extend(t);
                            }
                        }
                    },
                }
            },
        };
        let Some(answer) = self.0.take() else {
            return Poll::Pending;
        };
        Poll::Ready(match answer {
            Answer::Unstored(response) => (response.map(ResponseBody::inner), None),
            Answer::Reading {
                parts,
                body,
                chunks,
                trailers,
                keep_set_cookie,
                policy,
                grpc,
                ..
            } => {
                let mut parts = parts;
                // A gRPC call that failed in a way its retry may not (its `grpc-status` stands
                // for a status the policy does not store): released, as that status would be.
                if let (Read::Complete, Some(policy), Some(status)) =
                    (&read, &grpc, trailers.as_deref().and_then(grpc::status_in))
                    && !policy.stores(status, &parts.headers)
                {
                    let body = ResponseBody::full_with_trailers(chunks.into_bytes(), trailers);
                    return Poll::Ready((Response::from_parts(parts, body), None));
                }
                // An answer whose headers are all stored lends them to what is stored (most
                // do): the response gets them back once the store is done with it (see
                // `Keep`), instead of a copy of the map.
                let lend = keeps_every_header(&parts.headers, keep_set_cookie, &policy);
                let mut stored = |body| {
                    let headers = if lend {
                        std::mem::take(&mut parts.headers)
                    } else {
                        replayable_headers(&parts.headers, keep_set_cookie, &policy)
                    };
                    let answer = match body {
                        Some(bytes) => StoredResponse::new(parts.status, headers, bytes),
                        None => StoredResponse::without_body(parts.status, headers),
                    };
                    Keep { answer, lent: lend }
                };
                let (body, stored) = match read {
                    Read::Complete => {
                        let bytes = chunks.into_bytes();
                        let mut stored = stored(Some(bytes.clone()));
                        if let Some(trailers) = &trailers {
                            stored.answer = stored.answer.with_trailers((**trailers).clone());
                        }
                        (
                            ResponseBody::full_with_trailers(bytes, trailers),
                            Some(stored),
                        )
                    }
                    Read::TooLarge => {
                        let stored = stored(None);
                        (ResponseBody::prefixed(chunks, body), Some(stored))
                    }
                    Read::Failed(err) => (ResponseBody::failed(chunks, err), None),
                };
                (Response::from_parts(parts, body), stored)
            }
        })
    }
}

pub(crate) fn replay<B: Body>(
    config: &Config,
    stored: StoredResponse,
) -> Response<ResponseBody<B>> {
    let trailers = stored.trailers().cloned();
    let (status, mut headers, body) = stored.into_parts();
    let Some(body) = body else {
        return render(
            config,
            &Rejection::ResponseNotStored {
                original_status: status,
            },
        );
    };
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let mut res = Response::new(ResponseBody::full_with_trailers(
        body,
        trailers.map(Box::new),
    ));
    *res.status_mut() = status;
    *res.headers_mut() = headers;
    res
}
