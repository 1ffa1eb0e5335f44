//! [`IdempotentClient`], the service the client layer produces, and its retry loop.

use std::fmt;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use http::{HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument as _;

use super::ClientError;
use super::body::{ReplayBody, read_body};
use super::config::ClientConfig;
use super::future::ResponseFuture;
use super::retry::{ClassifyError, ConnectionErrors, retry_answer};
use crate::error::BoxError;
use crate::key::IdempotencyKey;

/// Middleware for an outbound HTTP client: sends every request with an idempotency key and
/// retries it, with that same key, when its answer is lost or says "later". Made by
/// [`IdempotentClientLayer`](super::IdempotentClientLayer).
///
/// The inner service receives the request with a [`ReplayBody`] (the caller's body, buffered
/// once); the response comes back as the inner service made it. `C` decides which of the
/// inner service's errors are retried ([`ConnectionErrors`] by default). See the
/// [module documentation](crate::client).
pub struct IdempotentClient<S, C = ConnectionErrors> {
    inner: S,
    config: Arc<ClientConfig>,
    classifier: Arc<C>,
}

impl<S: Clone, C> Clone for IdempotentClient<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
            classifier: self.classifier.clone(),
        }
    }
}

impl<S: fmt::Debug, C> fmt::Debug for IdempotentClient<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentClient")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .field("classifier", &std::any::type_name::<C>())
            .finish()
    }
}

impl<S, C> IdempotentClient<S, C> {
    pub(crate) fn new(inner: S, config: Arc<ClientConfig>, classifier: Arc<C>) -> Self {
        Self {
            inner,
            config,
            classifier,
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

impl<S, C, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotentClient<S, C>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: fmt::Display + Send + 'static,
    C: ClassifyError<S::Error> + Send + Sync + 'static,
    ReqBody: Body + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = ClientError<S::Error>;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|source| ClientError::Inner {
                source,
                attempts: 0,
            })
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The service that was driven to readiness is the one that must be called; leave a
        // clone in its place (see the tower-service docs on `Clone` services).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        let classifier = self.classifier.clone();
        let span = tracing::debug_span!(
            "idempotent_client",
            purpose = config.purpose.as_str(),
            key = tracing::field::Empty,
            attempts = tracing::field::Empty,
        );
        // Fields are recorded on this span, never on `Span::current()`: with this span
        // filtered out, the current one may be the server layer's, which has a `key` too.
        let future = call(inner, config, classifier, req, span.clone()).instrument(span);
        ResponseFuture::new(Box::pin(future))
    }
}

/// Why an attempt is retried: the `reason` of its tracing event and metrics counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    /// The inner service failed with an error the classifier calls transient: the
    /// connection was refused, reset or closed before the answer, by default.
    Error,
    /// No answer within the attempt's timeout.
    Timeout,
    /// An answer with a retried status (`409` in progress, `429`, `502`, `503`, `504` by
    /// default).
    Status(StatusCode),
}

impl Reason {
    /// The label: `error`, `timeout`, or the status's three digits.
    fn as_str(&self) -> &str {
        match self {
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::Status(status) => status.as_str(),
        }
    }
}

/// How an attempt ended, when it is not the call's answer.
enum Failed<B, E> {
    Answer(Response<B>),
    Error(E),
    TimedOut(Duration),
}

/// The call: reads the body, picks the key, and runs attempts until one gets an answer that
/// is not retried, or a bound is reached.
async fn call<S, C, ReqBody, ResBody>(
    mut svc: S,
    config: Arc<ClientConfig>,
    classifier: Arc<C>,
    req: Request<ReqBody>,
    span: tracing::Span,
) -> Result<Response<ResBody>, ClientError<S::Error>>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>>,
    S::Error: fmt::Display,
    C: ClassifyError<S::Error>,
    ReqBody: Body,
    ReqBody::Error: Into<BoxError>,
{
    let (mut parts, body) = req.into_parts();
    let prepared = match read_body(body, config.max_body).await {
        Ok(body) => pick_key(&config, &mut parts, &span).map(|()| body),
        Err(e) => Err(e),
    };
    let body = match prepared {
        Ok(body) => body,
        Err(e) => {
            record_call("not_sent", &config);
            tracing::debug!(error = %e, "idempotent call not sent");
            return Err(e);
        }
    };

    // Outside a Tokio runtime there is no timer: one attempt, unbounded, and no retry.
    let timers = tokio::runtime::Handle::try_current().is_ok();
    let started = timers.then(Instant::now);
    let mut attempt: u32 = 0;
    loop {
        attempt += 1;
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "tower_idempotency_client_attempts_total",
            "purpose" => config.purpose.as_str().to_owned()
        )
        .increment(1);
        let request = Request::from_parts(parts.clone(), body.clone());
        let first = attempt == 1;
        let exchange = async {
            // The first attempt uses the service the caller drove to readiness; each later
            // one waits for it to be ready again.
            if !first {
                poll_fn(|cx| svc.poll_ready(cx)).await?;
            }
            svc.call(request).await
        };
        let limit = match started {
            Some(started) => config
                .attempt_timeout
                .min(config.deadline.saturating_sub(started.elapsed())),
            None => Duration::MAX,
        };
        let outcome = if timers {
            tokio::time::timeout(limit, exchange).await.ok()
        } else {
            Some(exchange.await)
        };
        let (reason, wait_at_least, failed) = match outcome {
            Some(Ok(response)) => {
                let status = response.status();
                let Some(wait) = retry_answer(
                    &config.retry_statuses,
                    status,
                    response.headers(),
                    SystemTime::now(),
                ) else {
                    tracing::debug!(attempt, %status, "attempt answered");
                    record_call("answered", &config);
                    span.record("attempts", attempt);
                    return Ok(response);
                };
                (Reason::Status(status), wait, Failed::Answer(response))
            }
            Some(Err(e)) if !classifier.is_transient(&e) => {
                tracing::debug!(attempt, error = %e, "attempt failed; the error is not retried");
                record_call("failed", &config);
                span.record("attempts", attempt);
                return Err(ClientError::Inner {
                    source: e,
                    attempts: attempt,
                });
            }
            Some(Err(e)) => {
                tracing::debug!(attempt, error = %e, "attempt failed");
                (Reason::Error, Duration::ZERO, Failed::Error(e))
            }
            None => (Reason::Timeout, Duration::ZERO, Failed::TimedOut(limit)),
        };

        // Wait for the backoff, or for what the server asked, whichever is longer; but give
        // up when the attempts are spent, or when the wait would reach the deadline.
        let delay = backoff(&config, attempt).max(wait_at_least);
        let remaining = started.map(|s| config.deadline.saturating_sub(s.elapsed()));
        let give_up = attempt >= config.max_attempts || remaining.is_none_or(|r| delay >= r);
        span.record("attempts", attempt);
        if give_up {
            tracing::warn!(
                attempt,
                reason = reason.as_str(),
                purpose = config.purpose.as_str(),
                "idempotent call gave up: attempts or deadline spent"
            );
            record_call("exhausted", &config);
            return match failed {
                Failed::Answer(response) => Ok(response),
                Failed::Error(source) => Err(ClientError::Inner {
                    source,
                    attempts: attempt,
                }),
                Failed::TimedOut(after) => Err(ClientError::TimedOut {
                    after,
                    attempts: attempt,
                }),
            };
        }
        drop(failed);
        tracing::debug!(
            attempt,
            reason = reason.as_str(),
            delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            "retrying with the same key"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "tower_idempotency_client_retries_total",
            "purpose" => config.purpose.as_str().to_owned(),
            "reason" => reason.as_str().to_owned()
        )
        .increment(1);
        tokio::time::sleep(delay).await;
    }
}

/// Puts the call's key into its header, unless the caller set one: derived from the key in
/// the request's extensions (the server layer puts the incoming request's key there), or
/// else a fresh random one.
fn pick_key<E>(
    config: &ClientConfig,
    parts: &mut http::request::Parts,
    span: &tracing::Span,
) -> Result<(), ClientError<E>> {
    if let Some(own) = parts.headers.get(&config.header) {
        if let Ok(own) = own.to_str() {
            span.record("key", own);
        }
        return Ok(());
    }
    let key = match parts.extensions.get::<IdempotencyKey>() {
        Some(incoming) => incoming.derive_for(&config.purpose),
        None => IdempotencyKey::random().map_err(|e| ClientError::Random(Box::new(e)))?,
    };
    span.record("key", key.as_str());
    parts
        .headers
        .insert(config.header.clone(), HeaderValue::from(key));
    Ok(())
}

/// The wait before retry `attempt` (1 after the first attempt): a random time between zero
/// and `min(max, base × 2^(attempt-1))` ("full jitter").
fn backoff(config: &ClientConfig, attempt: u32) -> Duration {
    let exp = attempt.saturating_sub(1).min(31);
    let ceiling = config
        .base_delay
        .saturating_mul(1u32 << exp)
        .min(config.max_delay);
    let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
    if nanos == 0 {
        return Duration::ZERO;
    }
    // Without a random number (the OS source failed) the whole ceiling: slower, never faster.
    let random = getrandom::u64().unwrap_or(u64::MAX);
    Duration::from_nanos(random % nanos.saturating_add(1))
}

fn record_call(outcome: &'static str, config: &ClientConfig) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "tower_idempotency_client_calls_total",
        "purpose" => config.purpose.as_str().to_owned(),
        "outcome" => outcome
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (outcome, config);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::IdempotentClientLayer;

    #[test]
    fn backoff_is_jittered_below_a_doubling_capped_ceiling() {
        let layer = IdempotentClientLayer::new("p")
            .unwrap()
            .with_backoff(Duration::from_millis(100), Duration::from_millis(1000));
        let config = &layer.config;
        for (attempt, ceiling) in [
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 800),
            (5, 1000),
            (40, 1000),
        ] {
            let delays: Vec<Duration> = (0..200).map(|_| backoff(config, attempt)).collect();
            assert!(
                delays.iter().all(|d| *d <= Duration::from_millis(ceiling)),
                "attempt {attempt}: {delays:?}"
            );
            // Jittered: not all the same.
            assert!(delays.iter().any(|d| *d != delays[0]), "attempt {attempt}");
        }
    }
}
