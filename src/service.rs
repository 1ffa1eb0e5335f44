//! [`Idempotency`], the service the layer produces.

use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, header, request::Parts};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{Chunks, RequestBody, ResponseBody};
use crate::error::{BoxError, StoreError};
use crate::fingerprint::{Fingerprint, Fingerprinter};
use crate::future::{BoxResponseFuture, ResponseFuture};
use crate::grpc;
use crate::key::IdempotencyKey;
use crate::layer::{Config, KeySource, StorePolicy};
use crate::mode::{Keyed, Mode, Sealed};
use crate::rejection::Rejection;
use crate::response::{
    IDEMPOTENT_REPLAYED, ReplayedHeaders, StoredResponse, keeps_every_header, replayable_headers,
};
use crate::store::{ClaimOutcome, LeaseToken};

/// Middleware that runs each keyed request's handler once and replays its answer to
/// retries. Made by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// The inner service receives the request with a [`RequestBody`]; its response body is
/// wrapped in a [`ResponseBody`]. Both carry `Bytes` frames, like hyper's and axum's bodies.
#[derive(Clone, Debug)]
pub struct Idempotency<S, St> {
    inner: S,
    store: St,
    config: Arc<Config>,
}

impl<S, St> Idempotency<S, St> {
    pub(crate) fn new(inner: S, store: St, config: Arc<Config>) -> Self {
        Self {
            inner,
            store,
            config,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the middleware, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Mode,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        if !self.config.covers(req.method()) {
            return ResponseFuture::passthrough(self.inner.call(req.map(RequestBody::passthrough)));
        }
        let (req, key) = read_key(req, &self.config);
        let key = match key {
            Ok(Some(key)) => key,
            Ok(None) => {
                return ResponseFuture::passthrough(
                    self.inner.call(req.map(RequestBody::passthrough)),
                );
            }
            Err(rejection) => {
                record(Outcome::Rejected);
                tracing::debug!(reason = rejection.code(), "idempotency: request rejected");
                return ResponseFuture::ready(render(&self.config, &rejection));
            }
        };
        if let Some(len) = content_length(req.headers())
            && len > self.config.max_request_body as u64
        {
            record(Outcome::Rejected);
            return ResponseFuture::ready(render(
                &self.config,
                &Rejection::BodyTooLarge {
                    limit: self.config.max_request_body,
                },
            ));
        }
        // The service that was driven to readiness is the one that must be called; leave a
        // clone in its place (see the tower-service docs on `Clone` services).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        // No subscriber wants a DEBUG span (none is installed, or they filter at INFO): making,
        // entering and dropping a disabled one would be work for nothing.
        let span = if tracing::level_enabled!(tracing::Level::DEBUG) {
            tracing::debug_span!("idempotency", key = %key, outcome = tracing::field::Empty)
        } else {
            tracing::Span::none()
        };
        let keyed = Keyed {
            config: self.config.clone(),
            key,
        };
        let run = Sealed::execute(self.store.clone(), keyed, inner, req);
        // By default the request runs in a task of its own as soon as it has to wait, which a
        // dropped response future (the client went away) does not cancel: a handler, once
        // started, runs to its end. One that answers at once never needs the task.
        if !self.config.cancel_on_disconnect
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            // The task keeps the span of the caller (an outer trace layer's), as polling in
            // place would. Without one (no subscriber, or none at this level) the future is not
            // wrapped: the wrapper would be moved, polled and dropped for nothing.
            let span = if !span.is_disabled() {
                span
            } else if tracing::dispatcher::has_been_set() {
                tracing::Span::current()
            } else {
                tracing::Span::none()
            };
            let future: BoxResponseFuture<ResBody, S::Error> = if span.is_none() {
                Box::pin(run)
            } else {
                Box::pin(run.instrument(span))
            };
            return ResponseFuture::detached(future, runtime, spawn_keyed::<ResBody, S::Error>);
        }
        if span.is_disabled() {
            ResponseFuture::keyed(Box::pin(run))
        } else {
            ResponseFuture::keyed(Box::pin(run.instrument(span)))
        }
    }
}

/// Spawns a keyed request's future (see [`ResponseFuture::detached`]).
fn spawn_keyed<B, E>(
    runtime: &tokio::runtime::Handle,
    future: BoxResponseFuture<B, E>,
) -> tokio::task::JoinHandle<Result<Response<ResponseBody<B>>, E>>
where
    B: Body + Send + 'static,
    B::Error: Send + 'static,
    E: Send + 'static,
{
    runtime.spawn(future)
}

/// The key of a covered request: `Ok(None)` when it has none and none is required.
fn read_key<B>(
    req: Request<B>,
    config: &Config,
) -> (Request<B>, Result<Option<IdempotencyKey>, Rejection>) {
    let found = match &config.key_source {
        KeySource::Header(name) => {
            let mut values = req.headers().get_all(name).iter();
            match (values.next(), values.next()) {
                (None, _) => Ok(None),
                (Some(_), Some(_)) => Err(Rejection::MultipleKeys {
                    header: name.clone(),
                }),
                (Some(v), None) => IdempotencyKey::from_header(v).map(Some).map_err(|error| {
                    Rejection::InvalidKey {
                        error,
                        header: Some(name.clone()),
                    }
                }),
            }
        }
        KeySource::Fn(f) => {
            let (parts, body) = req.into_parts();
            let key = f(&parts);
            let found = key
                .map(|k| {
                    IdempotencyKey::parse(&k).map_err(|error| Rejection::InvalidKey {
                        error,
                        header: None,
                    })
                })
                .transpose();
            return (Request::from_parts(parts, body), missing(found, config));
        }
    };
    (req, missing(found, config))
}

fn missing(
    found: Result<Option<IdempotencyKey>, Rejection>,
    config: &Config,
) -> Result<Option<IdempotencyKey>, Rejection> {
    match found {
        Ok(None) if config.key_required => Err(Rejection::MissingKey {
            header: match &config.key_source {
                KeySource::Header(name) => Some(name.clone()),
                KeySource::Fn(_) => None,
            },
        }),
        other => other,
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

pub(crate) fn render<B: Body>(config: &Config, rejection: &Rejection) -> Response<ResponseBody<B>> {
    config.reject(rejection).map(ResponseBody::full)
}

/// What happened to a keyed request: the `outcome` of its tracing span and metrics counter.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Outcome {
    /// The handler ran (key acquired fresh).
    Executed,
    /// The handler ran after taking over a key whose lease ran out.
    Takeover,
    /// A stored answer was replayed.
    Replayed,
    /// Answered 409: the first request is still running.
    InFlight,
    /// Answered 422: the key was used with another request.
    Mismatch,
    /// Answered 503: the store failed before the handler ran.
    StoreError,
    /// Answered 400, 401 or 413 before the store was asked.
    Rejected,
}

/// Names the values of an enum for tracing and metrics: `as_str`, and (feature `metrics`)
/// `label`, the name as a label under `$key` in a static, so that recording it allocates
/// nothing. (`metrics::counter!(name, "key" => value)` with a value that is not a literal
/// builds a `Vec` of labels at every call: a keyed request would pay two or three.)
macro_rules! named {
    ($ty:ident, $key:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            // `Operation`'s is read by metrics only.
            #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
            pub(crate) fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $name),+
                }
            }

            #[cfg(feature = "metrics")]
            fn label(self) -> &'static [metrics::Label] {
                match self {
                    $(Self::$variant => {
                        static LABEL: [metrics::Label; 1] =
                            [metrics::Label::from_static_parts($key, $name)];
                        &LABEL
                    }),+
                }
            }
        }
    };
}

named!(Outcome, "outcome", {
    Executed => "executed",
    Takeover => "takeover",
    Replayed => "replayed",
    InFlight => "in_flight",
    Mismatch => "mismatch",
    StoreError => "store_error",
    Rejected => "rejected",
});

/// A store call, as [`store_call`] names it in metrics (the label `operation`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Operation {
    /// The claim of a key.
    Claim,
    /// Storing the answer (plain mode).
    Complete,
    /// Giving a key back.
    Release,
    /// Renewing a lease.
    Renew,
    /// Transactional mode's completion.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Commit,
    /// A waiting duplicate's wait for the key to change.
    Watch,
}

named!(Operation, "operation", {
    Claim => "claim",
    Complete => "complete",
    Release => "release",
    Renew => "renew",
    Commit => "commit",
    Watch => "watch",
});

/// Where the crate's metrics come from, as `metrics::counter!` would say it.
#[cfg(feature = "metrics")]
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// A key whose record is there already, as a claim found it.
pub(crate) enum Taken {
    /// Completed: its answer is replayed.
    Completed(StoredResponse),
    /// Another request holds it: retry after this long.
    InFlight(Duration),
    /// Reused with another payload.
    Mismatch,
}

/// A store's claim outcome as a mode reads it: the key acquired (its token, and whether it
/// was taken over), or taken.
pub(crate) fn acquired_or_taken(outcome: ClaimOutcome) -> Result<(LeaseToken, bool), Taken> {
    match outcome {
        ClaimOutcome::Acquired { token, takeover } => Ok((token, takeover)),
        ClaimOutcome::Completed(stored) => Err(Taken::Completed(stored)),
        ClaimOutcome::InFlight { retry_after } => Err(Taken::InFlight(retry_after)),
        ClaimOutcome::Mismatch => Err(Taken::Mismatch),
    }
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

pub(crate) fn record(outcome: Outcome) {
    // Recorded into the request's span, which exists only when DEBUG is enabled (otherwise
    // the current span is some outer one, not ours to write to).
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        tracing::Span::current().record("outcome", outcome.as_str());
    }
    tracing::debug!(outcome = outcome.as_str(), "idempotency outcome");
    #[cfg(feature = "metrics")]
    metrics::with_recorder(|recorder| {
        let key =
            metrics::Key::from_static_parts("tower_idempotency_requests_total", outcome.label());
        recorder.register_counter(&key, &METADATA).increment(1);
    });
}

/// Runs one store call (`operation` names it in metrics), bounded by the layer's store
/// timeout: a call that does not answer in time is dropped and becomes
/// [`StoreError::Timeout`].
pub(crate) async fn store_call<T>(
    operation: Operation,
    limit: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    #[cfg(feature = "metrics")]
    let started = std::time::Instant::now();
    // A call answered at its first poll (the memory store's always are) needs no timer:
    // arming one reads the clock and takes a reference to the runtime's timer, which costs a
    // keyed request more than the memory store's work. The bound starts after that poll,
    // which returned at once.
    let mut call = std::pin::pin!(call);
    let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
    let result = match first {
        Poll::Ready(result) => result,
        // Outside a Tokio runtime (a keyed request polled by another executor) there is no
        // timer to bound the call with: it runs unbounded, as the store itself allows.
        Poll::Pending if tokio::runtime::Handle::try_current().is_err() => call.await,
        Poll::Pending => match tokio::time::timeout(limit, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(limit)),
        },
    };
    #[cfg(feature = "metrics")]
    {
        let seconds = started.elapsed().as_secs_f64();
        metrics::with_recorder(|recorder| {
            let key = metrics::Key::from_static_parts(
                "tower_idempotency_store_call_seconds",
                operation.label(),
            );
            recorder.register_histogram(&key, &METADATA).record(seconds);
        });
        if let Err(err) = &result {
            let kind = if matches!(err, StoreError::Timeout(_)) {
                "timeout"
            } else {
                "error"
            };
            metrics::counter!(
                "tower_idempotency_store_errors_total",
                "operation" => operation.as_str(),
                "kind" => kind
            )
            .increment(1);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = operation;
    result
}

/// A keyed request whose handler runs, from its claim until its answer is stored (or its key
/// released), counted in the gauge `tower_idempotency_in_flight` (feature `metrics`).
pub(crate) struct InFlightGauge(());

impl InFlightGauge {
    pub(crate) fn start() -> Self {
        #[cfg(feature = "metrics")]
        metrics::gauge!("tower_idempotency_in_flight").increment(1.0);
        Self(())
    }
}

impl Drop for InFlightGauge {
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        metrics::gauge!("tower_idempotency_in_flight").decrement(1.0);
    }
}

/// A claim lost its key while its handler ran (its lease ran out and another request may
/// take the key over): the counter `tower_idempotency_leases_lost_total` (feature
/// `metrics`). Worth an alert: it means renewals failed for most of a lease.
pub(crate) fn lease_lost() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_idempotency_leases_lost_total").increment(1);
}

pub(crate) fn log_store_error(err: &StoreError, what: &'static str) {
    // A full store is a capacity limit working as configured (and counted by the store),
    // not a failure: a warning, not an error.
    if matches!(err, StoreError::Full) {
        tracing::warn!(
            error = err as &dyn std::error::Error,
            "idempotency store is full: failed to {what}"
        );
        return;
    }
    tracing::error!(
        error = err as &dyn std::error::Error,
        "idempotency store failed to {what}"
    );
}

/// A request body read in full: its chunks (small ones coalesced) and trailers.
pub(crate) struct Buffered {
    pub(crate) chunks: Chunks,
    pub(crate) trailers: Option<Box<HeaderMap>>,
}

/// A keyed request, read and fingerprinted, ready to claim (transactional mode).
#[cfg(feature = "postgres")]
pub(crate) struct Prepared {
    pub(crate) parts: Parts,
    pub(crate) scope: String,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) buffered: Buffered,
}

/// Reads the body of a request (up to the limit) and fingerprints the request; a request that
/// cannot be read is answered here.
#[cfg(feature = "postgres")]
pub(crate) async fn prepare<ReqBody, ResBody>(
    config: &Config,
    req: Request<ReqBody>,
) -> Result<Prepared, Response<ResponseBody<ResBody>>>
where
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body,
{
    let (parts, body) = req.into_parts();
    let (scope, fingerprint, buffered) = read_request(config, &parts, body).await?;
    Ok(Prepared {
        parts,
        scope,
        fingerprint,
        buffered,
    })
}

/// [`prepare`] for a request whose head stays with the caller: derives the scope (as stores
/// see it: its digest), reads the body and fingerprints the request.
pub(crate) async fn read_request<ReqBody, ResBody>(
    config: &Config,
    parts: &Parts,
    body: ReqBody,
) -> Result<(String, Fingerprint, Buffered), Response<ResponseBody<ResBody>>>
where
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body,
{
    let scope = config.scope_of(parts).map_err(|rejection| {
        record(Outcome::Rejected);
        render(config, &rejection)
    })?;
    let headers = &config.fingerprint_headers;
    let mut fingerprinter = Fingerprinter::new(parts, headers, &config.fingerprint);
    match read_body(body, &mut fingerprinter, config.max_request_body).await {
        Ok(mut buffered) => {
            let chunks = &mut buffered.chunks;
            // A fingerprint that needs the whole body at once gets it as one `Bytes`, which
            // then stays the body the handler reads.
            let fingerprint = fingerprinter.finish(parts, headers, || {
                let whole = std::mem::take(chunks).into_bytes();
                if !whole.is_empty() {
                    chunks.push(whole.clone());
                }
                whole
            });
            Ok((scope, fingerprint, buffered))
        }
        Err(rejection) => {
            record(Outcome::Rejected);
            Err(render(config, &rejection))
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
            // Polled after it finished: the layer never does.
            None => return Poll::Pending,
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

async fn read_body<B>(
    body: B,
    fingerprinter: &mut Fingerprinter,
    limit: usize,
) -> Result<Buffered, Rejection>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = pin!(body);
    let mut chunks = Chunks::default();
    let mut trailers: Option<Box<HeaderMap>> = None;
    let mut len = 0usize;
    while let Some(frame) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let frame = frame.map_err(|e| {
            let e: BoxError = e.into();
            tracing::debug!(
                error = &*e as &dyn std::error::Error,
                "reading the request body failed"
            );
            Rejection::UnreadableBody
        })?;
        match frame.into_data() {
            Ok(data) => {
                len = len.saturating_add(data.len());
                if len > limit {
                    return Err(Rejection::BodyTooLarge { limit });
                }
                fingerprinter.update(&data);
                if !data.is_empty() {
                    chunks.push(data);
                }
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers.get_or_insert_with(Box::default).extend(t);
                }
            }
        }
    }
    Ok(Buffered { chunks, trailers })
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
