//! [`IdempotentClient`], the service the client layer produces, and its retry loop.

use std::fmt;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body::Body;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument as _;

use super::ClientError;
use super::body::{ReplayBody, read_body};
use super::future::ResponseFuture;
use super::layer::ClientConfig;
use crate::error::BoxError;
use crate::key::IdempotencyKey;

/// Middleware for an outbound HTTP client: sends every request with an idempotency key and
/// retries it, with that same key, when its answer is lost or says "later". Made by
/// [`IdempotentClientLayer`](super::IdempotentClientLayer).
///
/// The inner service receives the request with a [`ReplayBody`] (the caller's body, buffered
/// once); the response comes back as the inner service made it. See the
/// [module documentation](crate::client).
#[derive(Clone, Debug)]
pub struct IdempotentClient<S> {
    inner: S,
    config: Arc<ClientConfig>,
}

impl<S> IdempotentClient<S> {
    pub(crate) fn new(inner: S, config: Arc<ClientConfig>) -> Self {
        Self { inner, config }
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

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotentClient<S>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: fmt::Display + Send + 'static,
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
        let span = tracing::debug_span!(
            "idempotent_client",
            purpose = config.purpose.as_str(),
            key = tracing::field::Empty,
            attempts = tracing::field::Empty,
        );
        // Fields are recorded on this span, never on `Span::current()`: with this span
        // filtered out, the current one may be the server layer's, which has a `key` too.
        let future = call(inner, config, req, span.clone()).instrument(span);
        ResponseFuture::new(Box::pin(future))
    }
}

/// Why an attempt is retried: the `reason` of its tracing event and metrics counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    /// The inner service failed: the connection was refused, reset or closed before the
    /// answer, or any other error.
    Error,
    /// No answer within the attempt's timeout.
    Timeout,
    /// An answer with a retryable status (`409`, `429`, `502`, `503`, `504`).
    Status(StatusCode),
}

impl Reason {
    fn as_str(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::Status(status) => match status.as_u16() {
                409 => "409",
                429 => "429",
                502 => "502",
                503 => "503",
                504 => "504",
                _ => "status",
            },
        }
    }
}

/// Whether an answer with `status` is worth another attempt with the same key.
///
/// - `409`: the server still runs an earlier attempt with this key (the server layer's
///   `request-in-progress`); a later attempt gets its answer.
/// - `429` and `503`: the server asks to come back later; it did not act on the request.
/// - `502` and `504`: a gateway lost its upstream's answer: a lost answer, like a closed
///   connection, which the key makes safe to retry.
///
/// Never another `4xx`: the request is wrong (`400`), the key was used for another request
/// (`422`), the route is missing (`404`); sending it again gets the same answer. Never `500`
/// and other `5xx` either: a server that fails without saying "later" is not helped by being
/// asked again at once (the key makes a later call with it safe; the server layer releases
/// keys whose answer was a `5xx`).
fn retryable(status: StatusCode) -> bool {
    matches!(status.as_u16(), 409 | 429 | 502 | 503 | 504)
}

/// A `Retry-After` in delta-seconds (`Retry-After: 3`). An HTTP-date is not read: the
/// backoff applies instead.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?;
    value.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// How an attempt ended, when it is not the call's answer.
enum Failed<B, E> {
    Answer(Response<B>),
    Error(E),
    TimedOut(Duration),
}

/// The call: reads the body, picks the key, and runs attempts until one gets an answer that
/// is not retried, or a bound is reached.
async fn call<S, ReqBody, ResBody>(
    mut svc: S,
    config: Arc<ClientConfig>,
    req: Request<ReqBody>,
    span: tracing::Span,
) -> Result<Response<ResBody>, ClientError<S::Error>>
where
    S: Service<Request<ReplayBody>, Response = Response<ResBody>>,
    S::Error: fmt::Display,
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
            Some(Ok(response)) if !retryable(response.status()) => {
                tracing::debug!(attempt, status = %response.status(), "attempt answered");
                record_call("answered", &config);
                span.record("attempts", attempt);
                return Ok(response);
            }
            Some(Ok(response)) => (
                Reason::Status(response.status()),
                retry_after(response.headers()),
                Failed::Answer(response),
            ),
            Some(Err(e)) => {
                tracing::debug!(attempt, error = %e, "attempt failed");
                (Reason::Error, None, Failed::Error(e))
            }
            None => (Reason::Timeout, None, Failed::TimedOut(limit)),
        };

        // Wait for the backoff, or for what the server asked, whichever is longer; but give
        // up when the attempts are spent, or when the wait would reach the deadline.
        let delay = backoff(&config, attempt).max(wait_at_least.unwrap_or_default());
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
            "reason" => reason.as_str()
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
    fn only_409_429_502_503_504_are_retried() {
        for code in 100..600u16 {
            let status = StatusCode::from_u16(code).unwrap();
            assert_eq!(
                retryable(status),
                [409, 429, 502, 503, 504].contains(&code),
                "{code}"
            );
        }
    }

    #[test]
    fn retry_after_is_read_in_delta_seconds_only() {
        let mut headers = HeaderMap::new();
        assert_eq!(retry_after(&headers), None);
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static(" 3 "));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(3)));
        headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&headers), None);
    }

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
