//! [`IdempotentClientLayer`] and its configuration.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, StatusCode};
use tower_layer::Layer;

use super::config::ClientConfig;
use super::retry::{ConnectionErrors, RetryStatuses};
use super::service::IdempotentClient;
use crate::error::ConfigError;
use crate::key::IDEMPOTENCY_KEY;
use crate::key::{KeyError, Purpose};

/// The default bound on attempts per call ([`IdempotentClientLayer::with_max_attempts`]).
const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// The default bound on one attempt ([`IdempotentClientLayer::with_attempt_timeout`]).
const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// The default bound on a whole call ([`IdempotentClientLayer::with_deadline`]).
const DEFAULT_DEADLINE: Duration = Duration::from_secs(10);
/// The default backoff: the first retry waits up to this, each next one up to twice as long…
const DEFAULT_BASE_DELAY: Duration = Duration::from_millis(100);
/// …but never more than this ([`IdempotentClientLayer::with_backoff`]).
const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(2);
/// The default limit of a buffered request body ([`IdempotentClientLayer::with_max_request_body`]).
const DEFAULT_MAX_BODY: usize = 1024 * 1024;

/// Applies [`IdempotentClient`] to an outbound HTTP client: every request gets an
/// idempotency key, and lost answers, `409` in progress, `429`, `502`, `503` and `504` are
/// retried with that same key.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::client::IdempotentClientLayer;
///
/// let layer = IdempotentClientLayer::new("charge")?
///     .with_max_attempts(4)
///     .with_deadline(Duration::from_secs(20));
/// # let _ = layer;
/// # Ok::<(), tower_idempotency::KeyError>(())
/// ```
///
/// `C` decides which errors of the inner service are retried: [`ConnectionErrors`] unless
/// set with [`with_error_classifier`](Self::with_error_classifier). See the
/// [module documentation](crate::client) for which key is sent, what is retried and every
/// setting's default.
pub struct IdempotentClientLayer<C = ConnectionErrors> {
    pub(crate) config: Arc<ClientConfig>,
    pub(crate) classifier: Arc<C>,
}

impl<C> Clone for IdempotentClientLayer<C> {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
            classifier: self.classifier.clone(),
        }
    }
}

impl<C> fmt::Debug for IdempotentClientLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentClientLayer")
            .field("config", &self.config)
            .field("classifier", &std::any::type_name::<C>())
            .finish()
    }
}

impl IdempotentClientLayer {
    /// A layer whose calls derive their key from the incoming request's with `purpose`
    /// (`<incoming key>:<purpose>`, see [`IdempotencyKey::derive`](crate::IdempotencyKey::derive)),
    /// with the default settings.
    ///
    /// # Errors
    ///
    /// [`KeyError::InvalidPurpose`] when `purpose` is empty, longer than 64 characters, not
    /// visible ASCII, or contains `:` — checked here, so a call never fails on it later.
    pub fn new(purpose: &str) -> Result<Self, KeyError> {
        Ok(Self {
            config: Arc::new(ClientConfig {
                purpose: Purpose::new(purpose)?,
                header: IDEMPOTENCY_KEY,
                max_attempts: DEFAULT_MAX_ATTEMPTS,
                attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
                deadline: DEFAULT_DEADLINE,
                base_delay: DEFAULT_BASE_DELAY,
                max_delay: DEFAULT_MAX_DELAY,
                max_body: DEFAULT_MAX_BODY,
                retry_statuses: RetryStatuses::default(),
            }),
            classifier: Arc::new(ConnectionErrors),
        })
    }
}

impl<C> IdempotentClientLayer<C> {
    fn with(mut self, f: impl FnOnce(&mut ClientConfig)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The header that carries the key (default `Idempotency-Key`).
    pub fn with_header(self, header: HeaderName) -> Self {
        self.with(|c| c.header = header)
    }

    /// The most attempts one call makes, the first included (default 5). `0` counts as `1`:
    /// no retries.
    pub fn with_max_attempts(self, attempts: u32) -> Self {
        self.with(|c| c.max_attempts = attempts.max(1))
    }

    /// The longest one attempt may take to answer (its status and headers; default 5 s).
    /// An attempt past it is dropped and counts as a lost answer: retried with the same key.
    /// Values below 1 ms are raised to 1 ms.
    pub fn with_attempt_timeout(self, timeout: Duration) -> Self {
        self.with(|c| c.attempt_timeout = timeout.max(Duration::from_millis(1)))
    }

    /// The longest a whole call may take, from its first attempt: attempts and the waits
    /// between them (default 10 s). No attempt runs past it, and no retry starts whose wait
    /// would reach it: the call returns its last answer or error instead. Values below 1 ms
    /// are raised to 1 ms.
    pub fn with_deadline(self, deadline: Duration) -> Self {
        self.with(|c| c.deadline = deadline.max(Duration::from_millis(1)))
    }

    /// The exponential backoff between attempts (default 100 ms, at most 2 s): before retry
    /// `n` (1, 2, …) the call waits a random time between zero and
    /// `min(max, base × 2^(n-1))` ("full jitter", so that clients turned away together do not
    /// come back together) — or the answer's `Retry-After`, when that is longer.
    pub fn with_backoff(self, base: Duration, max: Duration) -> Self {
        self.with(|c| {
            c.base_delay = base;
            c.max_delay = max.max(base);
        })
    }

    /// The largest request body, in bytes, that the layer buffers to send again (default
    /// 1 MiB). A larger body is an error ([`ClientError::BodyTooLarge`](super::ClientError)),
    /// and nothing is sent.
    pub fn with_max_request_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_body = bytes)
    }

    /// The statuses whose answers are retried with the same key, instead of being the call's
    /// answer (default `409`, `429`, `502`, `503`, `504`).
    ///
    /// A `409` among them is retried only when it carries a `Retry-After`, as the server
    /// layer's `request-in-progress` does: a `409` without one is final (the server layer's
    /// `response-not-stored`, a handler's own conflict). The others are retried with or
    /// without it. An empty set retries no answer: only errors the
    /// [classifier](Self::with_error_classifier) calls transient, and attempts past their
    /// timeout.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// // Also retry a 500: this server's handlers may fail without saying "later".
    /// let layer = IdempotentClientLayer::new("charge")?.with_retry_statuses([
    ///     StatusCode::CONFLICT,
    ///     StatusCode::TOO_MANY_REQUESTS,
    ///     StatusCode::INTERNAL_SERVER_ERROR,
    ///     StatusCode::SERVICE_UNAVAILABLE,
    /// ])?;
    ///
    /// // A success is never retried: refused here, not at the first call.
    /// let refused = IdempotentClientLayer::new("charge")?.with_retry_statuses([StatusCode::OK]);
    /// assert_eq!(
    ///     refused.err(),
    ///     Some(tower_idempotency::ConfigError::NotRetryable(StatusCode::OK))
    /// );
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::NotRetryable`], naming the first status that is not a `4xx` or a `5xx` (a
    /// `1xx`, a `2xx` success, a `3xx` redirect, or one of `600` to `999`).
    pub fn with_retry_statuses(
        self,
        statuses: impl IntoIterator<Item = StatusCode>,
    ) -> Result<Self, ConfigError> {
        let statuses = RetryStatuses::new(statuses)?;
        Ok(self.with(|c| c.retry_statuses = statuses))
    }

    /// Which errors of the inner service are retried with the same key (default
    /// [`ConnectionErrors`]: a connection refused, reset or closed before the answer, and
    /// timeouts; never an error that fails the same way every time, such as an invalid URI
    /// or a refused TLS handshake). Any other error is the call's outcome after one attempt:
    /// [`ClientError::Inner`](super::ClientError::Inner).
    ///
    /// The inner service's error type is the client's own choice, so the layer cannot know
    /// every error that is worth another attempt; give a closure over that type (write the
    /// parameter's type), or any [`ClassifyError`](super::ClassifyError):
    ///
    /// ```
    /// use hyper_util::client::legacy::{Client, Error};
    /// use hyper_util::rt::TokioExecutor;
    /// use tower::Layer as _;
    /// use tower_idempotency::client::{ConnectionErrors, IdempotentClientLayer, ReplayBody};
    ///
    /// // Also retry every error of hyper-util's connector (a name that did not resolve, say).
    /// let layer = IdempotentClientLayer::new("charge")?
    ///     .with_error_classifier(|e: &Error| e.is_connect() || ConnectionErrors::matches(e));
    /// # let _rt = tokio::runtime::Builder::new_current_thread().build()?;
    /// # let _guard = _rt.enter();
    /// let client = layer.layer(Client::builder(TokioExecutor::new()).build_http::<ReplayBody>());
    /// # let _ = client;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_error_classifier<D>(self, classifier: D) -> IdempotentClientLayer<D> {
        IdempotentClientLayer {
            config: self.config,
            classifier: Arc::new(classifier),
        }
    }
}

impl<S, C> Layer<S> for IdempotentClientLayer<C> {
    type Service = IdempotentClient<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentClient::new(inner, self.config.clone(), self.classifier.clone())
    }
}
