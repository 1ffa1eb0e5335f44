//! [`Idempotency`], the service the layer produces.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, header};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use crate::answer::render;
use crate::body::{RequestBody, ResponseBody};
use crate::config::{Config, KeySource};
use crate::error::BoxError;
use crate::future::{BoxResponseFuture, ResponseFuture};
use crate::key::IdempotencyKey;
use crate::mode::{Mode, Sealed};
use crate::outcome::{Outcome, record};
use crate::rejection::Rejection;
use crate::request::Keyed;

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
