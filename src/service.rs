//! [`Idempotency`], the service the layer produces.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, header, request::Parts};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{Chunks, RequestBody, ResponseBody};
use crate::error::{BoxError, StoreError};
use crate::fingerprint::{Fingerprint, Fingerprinter};
use crate::future::ResponseFuture;
use crate::key::IdempotencyKey;
use crate::layer::{Config, KeySource};
use crate::mode::{Keyed, Mode, Sealed};
use crate::rejection::Rejection;
use crate::response::{IDEMPOTENT_REPLAYED, StoredResponse, replayable_headers};
use crate::store::{ClaimOutcome, ClaimRequest, LeaseToken, Store};

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
        let span = tracing::debug_span!("idempotency", key = %key, outcome = tracing::field::Empty);
        let keyed = Keyed {
            config: self.config.clone(),
            key,
        };
        let run = Sealed::execute(self.store.clone(), keyed, inner, req);
        // Without a subscriber that wants the span, entering and leaving it at every poll is
        // work for nothing.
        if span.is_disabled() {
            ResponseFuture::keyed(Box::pin(run))
        } else {
            ResponseFuture::keyed(Box::pin(run.instrument(span)))
        }
    }
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
                (Some(_), Some(_)) => Err(Rejection::MultipleKeys),
                (Some(v), None) => IdempotencyKey::from_header(v)
                    .map(Some)
                    .map_err(Rejection::InvalidKey),
            }
        }
        KeySource::Fn(f) => {
            let (parts, body) = req.into_parts();
            let key = f(&parts);
            let found = key
                .map(|k| IdempotencyKey::parse(&k).map_err(Rejection::InvalidKey))
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
        Ok(None) if config.key_required => Err(Rejection::MissingKey),
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
    /// Answered 400 or 413 before the store was asked.
    Rejected,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Takeover => "takeover",
            Self::Replayed => "replayed",
            Self::InFlight => "in_flight",
            Self::Mismatch => "mismatch",
            Self::StoreError => "store_error",
            Self::Rejected => "rejected",
        }
    }
}

pub(crate) fn record(outcome: Outcome) {
    tracing::Span::current().record("outcome", outcome.as_str());
    tracing::debug!(outcome = outcome.as_str(), "idempotency outcome");
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_idempotency_requests_total", "outcome" => outcome.as_str())
        .increment(1);
}

pub(crate) fn log_store_error(err: &StoreError, what: &'static str) {
    tracing::error!(
        error = err as &dyn std::error::Error,
        "idempotency store failed to {what}"
    );
}

/// A request body read in full: its chunks (not copied), trailers and fingerprint input.
pub(crate) struct Buffered {
    pub(crate) chunks: Chunks,
    pub(crate) trailers: Option<HeaderMap>,
}

enum Collected<B: Body> {
    Complete(Bytes),
    TooLarge(Chunks, std::pin::Pin<Box<B>>),
    Failed(Chunks, B::Error),
}

/// Plain mode: claim the key in the store, run the handler, store its answer.
pub(crate) async fn run_plain<St, S, ReqBody, ResBody>(
    store: St,
    keyed: Keyed,
    mut inner: S,
    req: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    St: Store,
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes>,
{
    let Keyed { config, key } = keyed;
    let config = &*config;
    let Prepared {
        mut parts,
        scope,
        fingerprint,
        buffered,
    } = match prepare(config, req).await {
        Ok(prepared) => prepared,
        Err(rejected) => return Ok(rejected),
    };
    let claim = ClaimRequest {
        scope: &scope,
        key: &key,
        fingerprint,
        lease: config.lease,
        ttl: config.ttl,
    };
    let (token, takeover) = match store.claim(claim).await {
        Ok(ClaimOutcome::Acquired { token, takeover }) => (token, takeover),
        Ok(ClaimOutcome::Completed(stored)) => {
            record(Outcome::Replayed);
            return Ok(replay(config, stored));
        }
        Ok(ClaimOutcome::InFlight { retry_after }) => {
            record(Outcome::InFlight);
            return Ok(render(config, &Rejection::InFlight { retry_after }));
        }
        Ok(ClaimOutcome::Mismatch) => {
            record(Outcome::Mismatch);
            return Ok(render(config, &Rejection::KeyReused));
        }
        Err(err) => {
            record(Outcome::StoreError);
            log_store_error(&err, "claim a key; answered 503");
            return Ok(render(config, &Rejection::StoreUnavailable));
        }
    };
    record(if takeover {
        Outcome::Takeover
    } else {
        Outcome::Executed
    });

    // From here the key is ours. If this future is dropped (client gone) or unwinds (the
    // handler panicked), the guard releases the key so a retry is not locked out.
    let mut guard = ReleaseGuard {
        held: Some(Held {
            store,
            scope,
            key: key.clone(),
            token,
        }),
    };
    parts.extensions.insert(key);
    let req = Request::from_parts(
        parts,
        RequestBody::buffered(buffered.chunks, buffered.trailers),
    );

    let work = async {
        let response = inner.call(req).await?;
        Ok(to_store(config, response).await)
    };
    let outcome = renewing(work, &guard, config.lease).await;
    match outcome {
        Ok((response, Some(stored))) => {
            // The handler's work is done: from here on, a dropped request must not release
            // the key (a retry would run the handler twice). The answer is stored by a task
            // of its own, which finishes even if this future is dropped while waiting.
            if let Some(held) = guard.held.take() {
                let ttl = config.ttl;
                let mut completion = Box::pin(async move { held.complete(&stored, ttl).await });
                // Most stores finish at the first poll (the memory store always does);
                // only a pending completion moves to a task of its own.
                let first = poll_fn(|cx| Poll::Ready(completion.as_mut().poll(cx))).await;
                if first.is_pending()
                    && let Err(e) = tokio::spawn(completion).await
                {
                    tracing::error!(
                        error = &e as &dyn std::error::Error,
                        "storing the answer panicked"
                    );
                }
            }
            Ok(response)
        }
        // A 5xx, a failed response body, or a handler error: nothing is stored and the
        // key is released, so a retry runs the handler again.
        Ok((response, None)) => {
            guard.release().await;
            Ok(response)
        }
        Err(err) => {
            guard.release().await;
            Err(err)
        }
    }
}

/// A keyed request, read and fingerprinted, ready to claim.
pub(crate) struct Prepared {
    pub(crate) parts: Parts,
    pub(crate) scope: String,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) buffered: Buffered,
}

/// Derives the scope, reads the body (up to the limit) and fingerprints the request; a
/// request that cannot be read is answered here.
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
    let scope = config
        .scope
        .as_ref()
        .and_then(|f| f(&parts))
        .unwrap_or_default();
    let mut fingerprinter = Fingerprinter::new(&parts, &config.fingerprint_headers);
    match read_body(body, &mut fingerprinter, config.max_request_body).await {
        Ok(buffered) => Ok(Prepared {
            parts,
            scope,
            fingerprint: fingerprinter.finish(),
            buffered,
        }),
        Err(rejection) => {
            record(Outcome::Rejected);
            Err(render(config, &rejection))
        }
    }
}

/// The handler's answer for the client, and what to store of it: `None` for a `5xx` (unless
/// configured otherwise) and for a body that failed, which release the key instead.
pub(crate) async fn to_store<ResBody>(
    config: &Config,
    response: Response<ResBody>,
) -> (Response<ResponseBody<ResBody>>, Option<StoredResponse>)
where
    ResBody: Body<Data = Bytes>,
{
    if response.status().is_server_error() && !config.store_server_errors {
        return (response.map(ResponseBody::inner), None);
    }
    let (parts, body) = response.into_parts();
    let (body, stored) = match collect(body, config.max_response_body).await {
        Collected::Complete(bytes) => {
            let headers = replayable_headers(&parts.headers, config.keep_set_cookie);
            let stored = StoredResponse::new(parts.status, headers, bytes.clone());
            (ResponseBody::full(bytes), Some(stored))
        }
        Collected::TooLarge(head, rest) => {
            let headers = replayable_headers(&parts.headers, config.keep_set_cookie);
            let stored = StoredResponse::without_body(parts.status, headers);
            (ResponseBody::prefixed(head, rest), Some(stored))
        }
        Collected::Failed(head, err) => (ResponseBody::failed(head, err), None),
    };
    (Response::from_parts(parts, body), stored)
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
    let mut trailers = None;
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
                    trailers.get_or_insert_with(HeaderMap::new).extend(t);
                }
            }
        }
    }
    Ok(Buffered { chunks, trailers })
}

/// Reads a response body up to `limit` bytes. Trailers are not kept.
async fn collect<B: Body<Data = Bytes>>(body: B, limit: usize) -> Collected<B> {
    let mut body = Box::pin(body);
    let mut chunks = Chunks::default();
    let mut len = 0usize;
    loop {
        match poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
            None => break,
            Some(Err(e)) => return Collected::Failed(chunks, e),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data()
                    && !data.is_empty()
                {
                    len = len.saturating_add(data.len());
                    chunks.push(data);
                    if len > limit {
                        return Collected::TooLarge(chunks, body);
                    }
                }
            }
        }
    }
    Collected::Complete(chunks.into_bytes())
}

pub(crate) fn replay<B: Body>(
    config: &Config,
    stored: StoredResponse,
) -> Response<ResponseBody<B>> {
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
    let mut res = Response::new(ResponseBody::full(body));
    *res.status_mut() = status;
    *res.headers_mut() = headers;
    res
}

/// Runs `work`, renewing the key's lease every third of it until `work` finishes.
async fn renewing<St: Store, T>(
    work: impl Future<Output = T>,
    guard: &ReleaseGuard<St>,
    lease: Duration,
) -> T {
    let Some(held) = &guard.held else {
        return work.await;
    };
    let renew = async {
        let period = lease / 3;
        loop {
            tokio::time::sleep(period).await;
            match held
                .store
                .renew(&held.scope, &held.key, held.token, lease)
                .await
            {
                Ok(true) => tracing::trace!("idempotency lease renewed"),
                Ok(false) => {
                    tracing::warn!("idempotency lease lost: another request took the key over");
                    return std::future::pending().await;
                }
                // Try again at the next period; the lease outlives two missed renewals.
                Err(err) => log_store_error(&err, "renew a lease"),
            }
        }
    };
    let mut work = pin!(work);
    let mut renew = pin!(renew);
    poll_fn(|cx| {
        if let Poll::Ready(out) = work.as_mut().poll(cx) {
            return Poll::Ready(out);
        }
        let _: Poll<()> = renew.as_mut().poll(cx);
        Poll::Pending
    })
    .await
}

struct Held<St> {
    store: St,
    scope: String,
    key: IdempotencyKey,
    token: LeaseToken,
}

/// Releases a claimed key unless disarmed: explicitly (awaited), or on drop (spawned).
struct ReleaseGuard<St: Store> {
    held: Option<Held<St>>,
}

impl<St: Store> ReleaseGuard<St> {
    async fn release(&mut self) {
        if let Some(held) = self.held.take() {
            held.release().await;
        }
    }
}

impl<St: Store> Held<St> {
    /// Stores the answer. On failure the key is not released (the work was done): it is left
    /// to its lease, so a retry cannot run the handler twice while the store is failing.
    async fn complete(self, stored: &StoredResponse, ttl: Duration) {
        match self
            .store
            .complete(&self.scope, &self.key, self.token, stored, ttl)
            .await
        {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                "idempotency lease was lost while the handler ran (another request took the key \
                 over); this answer was not stored"
            ),
            Err(err) => log_store_error(
                &err,
                "store the answer; the client gets it, the key waits for its lease",
            ),
        }
    }

    async fn release(self) {
        match self.store.release(&self.scope, &self.key, self.token).await {
            Ok(_) => tracing::debug!("idempotency key released"),
            Err(err) => {
                log_store_error(&err, "release a key; it stays locked until its lease ends")
            }
        }
    }
}

impl<St: Store> Drop for ReleaseGuard<St> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            // Dropped mid-request: the client went away or the handler panicked. Release in the
            // background; without a runtime the lease frees the key when it runs out.
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                tracing::debug!("idempotent request dropped before it finished; releasing its key");
                handle.spawn(held.release());
            }
        }
    }
}
