//! The layer's settings as a request sees them: [`Config`], shared by the service and every
//! mode, and the scope's digest.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, Response, StatusCode, request::Parts};
use sha2::{Digest, Sha256};

use crate::fingerprint;
use crate::key::IDEMPOTENCY_KEY;
use crate::rejection::Rejection;
use crate::response::ReplayedHeaders;

/// The default bound of one store call ([`IdempotencyLayer::with_store_timeout`]).
pub(crate) const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// The default cap on duplicates waiting at once ([`IdempotencyLayer::with_max_waiters`]).
pub(crate) const DEFAULT_MAX_WAITERS: usize = 1024;

type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
pub(crate) type KeyFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Where the key of a request comes from.
#[derive(Clone)]
pub(crate) enum KeySource {
    Header(HeaderName),
    Fn(Arc<KeyFn>),
}
type RejectionFn = dyn Fn(&Rejection) -> Response<Bytes> + Send + Sync;
type StoreWhenFn = dyn Fn(StatusCode, &HeaderMap) -> bool + Send + Sync;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) key_source: KeySource,
    pub(crate) methods: Vec<Method>,
    pub(crate) key_required: bool,
    pub(crate) lease: Duration,
    pub(crate) ttl: Duration,
    pub(crate) store_timeout: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    /// Which answers are stored.
    pub(crate) store_policy: StorePolicy,
    pub(crate) keep_set_cookie: bool,
    pub(crate) replayed_headers: ReplayedHeaders,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    /// How the body (and head) are fingerprinted: raw bytes, canonical JSON, or a function.
    pub(crate) fingerprint: fingerprint::Method,
    pub(crate) scope: Option<Arc<ScopeFn>>,
    pub(crate) scope_required: bool,
    pub(crate) shared_scope: bool,
    pub(crate) cancel_on_disconnect: bool,
    pub(crate) rejection: Option<Arc<RejectionFn>>,
    /// How long a duplicate of a key in flight waits for the first request (`None`: 409 at
    /// once).
    pub(crate) wait_for_completion: Option<Duration>,
    pub(crate) max_waiters: usize,
    /// The duplicates waiting now, across every service this layer made.
    pub(crate) waiters: Arc<AtomicUsize>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            key_source: KeySource::Header(IDEMPOTENCY_KEY),
            methods: vec![Method::POST, Method::PATCH],
            key_required: true,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(24 * 3600),
            store_timeout: DEFAULT_STORE_TIMEOUT,
            max_request_body: 1024 * 1024,
            max_response_body: 1024 * 1024,
            store_policy: StorePolicy::default(),
            keep_set_cookie: false,
            replayed_headers: ReplayedHeaders::default(),
            fingerprint_headers: Vec::new(),
            fingerprint: fingerprint::Method::Raw,
            scope: None,
            scope_required: false,
            shared_scope: false,
            cancel_on_disconnect: false,
            rejection: None,
            wait_for_completion: None,
            max_waiters: DEFAULT_MAX_WAITERS,
            waiters: Arc::default(),
        }
    }
}

impl Config {
    pub(crate) fn covers(&self, method: &Method) -> bool {
        self.methods.iter().any(|m| m == method)
    }

    /// The scope of a request as stores see it: `""` (the shared scope), or the digest of
    /// what the scope function returned. `Err` when a scope is required and there is none.
    pub(crate) fn scope_of(&self, parts: &Parts) -> Result<String, Rejection> {
        match self.scope.as_ref().and_then(|f| f(parts)) {
            Some(scope) if !scope.is_empty() => Ok(scope_digest(&scope)),
            _ if self.scope_required => Err(Rejection::MissingScope),
            _ => Ok(String::new()),
        }
    }

    pub(crate) fn reject(&self, rejection: &Rejection) -> Response<Bytes> {
        match &self.rejection {
            Some(f) => f(rejection),
            None => rejection.to_response(),
        }
    }
}

/// Which answers are stored ([`IdempotencyLayer::with_store_when`],
/// [`IdempotencyLayer::with_store_server_errors`]).
#[derive(Clone, Default)]
pub(crate) struct StorePolicy {
    pub(crate) when: Option<Arc<StoreWhenFn>>,
    pub(crate) server_errors: bool,
}

impl StorePolicy {
    /// Whether an answer with this status and these headers is stored (and replayed to
    /// retries), or the key released so that a retry runs the handler again. For a gRPC
    /// answer the status is the one its `grpc-status` stands for (see `crate::grpc`).
    pub(crate) fn stores(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        match &self.when {
            Some(f) => f(status, headers),
            None if status.is_server_error() => self.server_errors,
            // "Not now", not "no": 408, 429, and 499 (the call was cancelled).
            None => !matches!(status.as_u16(), 408 | 429 | 499),
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field(
                "key_source",
                &match &self.key_source {
                    KeySource::Header(h) => h.as_str(),
                    KeySource::Fn(_) => "<fn>",
                },
            )
            .field("methods", &self.methods)
            .field("key_required", &self.key_required)
            .field("lease", &self.lease)
            .field("ttl", &self.ttl)
            .field("store_timeout", &self.store_timeout)
            .field("max_request_body", &self.max_request_body)
            .field("max_response_body", &self.max_response_body)
            .field("store_server_errors", &self.store_policy.server_errors)
            .field("store_when", &self.store_policy.when.is_some())
            .field("keep_set_cookie", &self.keep_set_cookie)
            .field("replayed_headers", &self.replayed_headers)
            .field("fingerprint_headers", &self.fingerprint_headers)
            .field("fingerprint", &self.fingerprint)
            .field("scope", &self.scope.is_some())
            .field("scope_required", &self.scope_required)
            .field("shared_scope", &self.shared_scope)
            .field("cancel_on_disconnect", &self.cancel_on_disconnect)
            .field("rejection", &self.rejection.is_some())
            .field("wait_for_completion", &self.wait_for_completion)
            .field("max_waiters", &self.max_waiters)
            .finish()
    }
}

/// The scope of a key as stores keep it: `""` for the shared scope (an empty `scope`),
/// otherwise the lowercase hex SHA-256 of `scope` behind a domain-separating prefix, 64 ASCII
/// characters.
///
/// The layer hands stores this digest, never the text its scope function returned, so a
/// scope of any length fits a store's index and the store never holds what the scope was
/// made of. Use it to find a scope's records in a store, e.g. in the `scope` column of
/// Postgres's `tower_idempotency_keys`.
///
/// ```
/// let digest = tower_idempotency::scope_digest("account-42");
/// assert_eq!(digest.len(), 64);
/// assert_eq!(tower_idempotency::scope_digest(""), "");
/// ```
pub fn scope_digest(scope: &str) -> String {
    if scope.is_empty() {
        return String::new();
    }
    let mut hash = Sha256::new();
    hash.update(b"tower-idempotency scope\0");
    hash.update(scope.as_bytes());
    crate::hex::encode(&hash.finalize())
}
