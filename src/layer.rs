//! [`IdempotencyLayer`] and its configuration.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, Response, StatusCode, request::Parts};
use tower_layer::Layer;

pub use crate::config::scope_digest;
use crate::config::{Config, KeySource};
use crate::error::ConfigError;
use crate::fingerprint::{self, Fingerprint};
pub use crate::key::IDEMPOTENCY_KEY;
use crate::rejection::Rejection;
use crate::response::ReplayedHeaders;
use crate::service::Idempotency;

/// Applies [`Idempotency`] to a service: retries of a request with the same idempotency key
/// run the handler once and get the same answer.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// /// The authenticated account, inserted into the request's extensions by the
/// /// authentication layer (which runs before this one).
/// #[derive(Clone)]
/// struct Account { id: String }
///
/// # fn main() -> Result<(), tower_idempotency::ConfigError> {
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     // Keys are per account: no client can replay another's answer.
///     .with_scope(|parts| parts.extensions.get::<Account>().map(|a| a.id.clone()))
///     .with_scope_required(true)
///     // Settings that could switch the protection off are refused where they are given.
///     .with_ttl(Duration::from_secs(24 * 3600))?
///     .with_lease(Duration::from_secs(30));
/// # let _ = layer;
/// # Ok(()) }
/// ```
///
/// See the [crate documentation](crate) for the behaviour and every setting's default.
///
/// # Panics
///
/// Not when it is built, nor on any setting. On a Tokio runtime built without its time
/// driver (a `runtime::Builder` without `enable_time` or `enable_all`), Tokio's timer panics
/// at the first keyed request whose handler or store call waits: the layer renews leases and
/// bounds store calls with it, and Tokio offers no way to ask whether a runtime has one.
/// With no Tokio runtime at all (another executor), nothing panics: see
/// [Runtime](crate#how-it-works) in the crate documentation.
#[derive(Clone, Debug)]
pub struct IdempotencyLayer<St> {
    store: St,
    config: Arc<Config>,
    /// Whether this layer warned that it has no scope (once per layer, not per service).
    warned: Arc<AtomicBool>,
}

impl<St> IdempotencyLayer<St> {
    /// A layer that keeps its keys in `store`, with the default settings.
    pub fn new(store: St) -> Self {
        Self {
            store,
            config: Arc::new(Config::default()),
            warned: Arc::default(),
        }
    }

    /// The store this layer uses.
    pub fn store(&self) -> &St {
        &self.store
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        // Another configuration: it warns on its own.
        self.warned = Arc::default();
        self
    }

    /// The header that carries the key. Default `Idempotency-Key`; a webhook receiver may use
    /// `webhook-id` (Standard Webhooks) or `X-GitHub-Delivery`.
    pub fn with_header(self, header: HeaderName) -> Self {
        self.with(|c| c.key_source = KeySource::Header(header))
    }

    /// Takes the key from the request head with a function instead of a header, for senders
    /// that identify a delivery some other way (a query parameter, a header that must be
    /// combined with another). `None` is a missing key. The result is validated like a header
    /// value (1 to 255 visible ASCII characters bare, or a quoted string that may also hold
    /// spaces), so a bad value is a `400`.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // GitHub names each delivery in X-GitHub-Delivery; key on event and delivery.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_key_from(|parts| {
    ///     let event = parts.headers.get("x-github-event")?.to_str().ok()?;
    ///     let id = parts.headers.get("x-github-delivery")?.to_str().ok()?;
    ///     Some(format!("{event}:{id}"))
    /// });
    /// # let _ = layer;
    /// ```
    pub fn with_key_from<F>(self, key: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.with(|c| c.key_source = KeySource::Fn(Arc::new(key)))
    }

    /// The methods the layer covers. Default `POST` and `PATCH`; requests with other methods
    /// pass through untouched, without allocation or store access.
    ///
    /// # Errors
    ///
    /// [`ConfigError::NoMethods`] for an empty list: the layer would protect nothing.
    pub fn with_methods(
        self,
        methods: impl IntoIterator<Item = Method>,
    ) -> Result<Self, ConfigError> {
        let methods: Vec<Method> = methods.into_iter().collect();
        if methods.is_empty() {
            return Err(ConfigError::NoMethods);
        }
        Ok(self.with(|c| c.methods = methods))
    }

    /// Whether a covered request without a key is rejected with `400` (default `true`) or
    /// passed through unprotected (`false`).
    pub fn with_key_required(self, required: bool) -> Self {
        self.with(|c| c.key_required = required)
    }

    /// How long a claim holds a key before another request may take it over (default 30 s).
    ///
    /// While the handler runs, the layer renews the lease every third of it (plain mode;
    /// transactional mode holds the key with its transaction instead), so a slow handler is
    /// not taken over while its process is alive and reaches the store. A lease runs out
    /// under a running handler only when no renewal succeeds for about two thirds of it: the
    /// store cannot be reached, or answers slower than a third of the lease, or the process
    /// (or the thread polling the request) stalls that long. Then another request may take
    /// the key over; the handler learns it from the [`Lease`](crate::Lease) in its request's
    /// extensions, and its answer is not stored over the new owner's. Choose the lease much
    /// longer than a renewal can take.
    ///
    /// A key in progress is kept for as long as its lease holds, even when that is longer
    /// than the [TTL](Self::with_ttl).
    ///
    /// Values below 10 ms (zero included) are raised to 10 ms: a lease of zero would let
    /// every duplicate take a running key over at once, which is no protection at all.
    pub fn with_lease(self, lease: Duration) -> Self {
        self.with(|c| c.lease = lease.max(Duration::from_millis(10)))
    }

    /// How long a key is remembered (default 24 h). After it, the key counts as new.
    ///
    /// A completed key is remembered for the TTL from its completion. A key in progress is
    /// never forgotten while its lease holds, whatever the TTL: a handler that runs longer
    /// than the TTL (or a TTL shorter than the [lease](Self::with_lease)) still runs once,
    /// and its answer is then replayed for the TTL.
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroTtl`] for a TTL of zero: no answer would ever be replayed.
    pub fn with_ttl(self, ttl: Duration) -> Result<Self, ConfigError> {
        if ttl.is_zero() {
            return Err(ConfigError::ZeroTtl);
        }
        Ok(self.with(|c| c.ttl = ttl))
    }

    /// The longest the layer waits for one store call (default 5 s): a claim, the storing of
    /// an answer, a release, a renewal; in transactional mode, the claim's statements and the
    /// commit. Waiting for a pooled connection counts: an exhausted pool or a stalled network
    /// is answered within this bound.
    ///
    /// A claim that does not answer in time is answered `503` with `Retry-After` (the handler
    /// did not run; a retry with the same key is safe). When the storing of an answer times
    /// out, the client still gets the answer and the key waits for its lease (plain mode), or
    /// — in transactional mode, where the answer commits with the handler's writes — the
    /// client gets `503` and a retry replays if the commit happened and runs if it did not.
    /// Values below 10 ms are raised to 10 ms.
    ///
    /// Keep the Postgres store's own bounds
    /// ([`PostgresStore::with_statement_timeout`](crate::PostgresStore::with_statement_timeout))
    /// at or below this one, so the database gives up on a statement the layer gave up on.
    pub fn with_store_timeout(self, timeout: Duration) -> Self {
        self.with(|c| c.store_timeout = timeout.max(Duration::from_millis(10)))
    }

    /// The largest request body accepted on a keyed request, in bytes (default 1 MiB).
    /// Larger bodies are answered `413` and nothing is stored. `0` accepts keyed requests
    /// with an empty body only.
    pub fn with_max_request_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_request_body = bytes)
    }

    /// The largest response body stored for replay, in bytes (default 1 MiB).
    ///
    /// A larger answer still reaches the client whole (the buffered head, then the rest as the
    /// handler streams it). Its key is completed with the status and headers only, so a
    /// repeat never runs the handler again: it is answered `409` with a problem document of
    /// type `response-not-stored` that names the original status.
    ///
    /// `0` keeps no body: an answer with an empty body is replayed whole, and any other
    /// answer's retry gets that `409` (the handler never runs twice).
    pub fn with_max_response_body(self, bytes: usize) -> Self {
        self.with(|c| c.max_response_body = bytes)
    }

    /// Whether `5xx` answers are stored and replayed (default `false`: the key is released,
    /// so a retry runs the handler again — the handler failed, and retrying is what the client
    /// should do). Ignored once [`with_store_when`](Self::with_store_when) decides.
    pub fn with_store_server_errors(self, store: bool) -> Self {
        self.with(|c| c.store_policy.server_errors = store)
    }

    /// Which answers are stored and replayed to retries, decided on the status and headers the
    /// handler answered with. An answer not stored **releases the key**: the client gets it,
    /// and a retry runs the handler again (in transactional mode, its writes are rolled back,
    /// as for a `5xx`).
    ///
    /// By default every `2xx`, `3xx` and `4xx` answer is stored except `408 Request Timeout`,
    /// `429 Too Many Requests` and `499` (the call was cancelled: gRPC's `CANCELLED`), which
    /// say "not now" rather than "no": stored, a client rate-limited once would be
    /// rate-limited on every retry for the whole TTL. `5xx` answers
    /// are not stored ([`with_store_server_errors`](Self::with_store_server_errors)). A
    /// predicate given here replaces that whole rule, `5xx` included.
    ///
    /// ```
    /// use http::{HeaderMap, StatusCode};
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // Store successes only: every failure, 4xx included, may be retried.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_store_when(|status: StatusCode, _: &HeaderMap| status.is_success());
    /// # let _ = layer;
    /// ```
    pub fn with_store_when<F>(self, store: F) -> Self
    where
        F: Fn(StatusCode, &HeaderMap) -> bool + Send + Sync + 'static,
    {
        self.with(|c| c.store_policy.when = Some(Arc::new(store)))
    }

    /// Whether `Set-Cookie` headers are stored and replayed (default `false`; see
    /// [`is_replayable_header`](crate::response::is_replayable_header)).
    pub fn with_replayed_set_cookie(self, keep: bool) -> Self {
        self.with(|c| c.keep_set_cookie = keep)
    }

    /// Which response headers are stored and replayed (default: all but those never
    /// replayed — hop-by-hop, `Date`, `Content-Length` and the credential-like
    /// `Authentication-Info`, `Proxy-Authentication-Info` and `Set-Cookie`; see
    /// [`ReplayedHeaders`]). An allowlist
    /// (`ReplayedHeaders::only([header::LOCATION])`) keeps a handler's new headers from being
    /// replayed by surprise; a denylist (`ReplayedHeaders::all_but([…])`) drops per-response
    /// ones such as a request id. `Content-Type` is always replayed.
    pub fn with_replayed_headers(self, policy: ReplayedHeaders) -> Self {
        self.with(|c| c.replayed_headers = policy)
    }

    /// Request headers whose values are part of the fingerprint, in addition to the method,
    /// path, query and body (default none). Name headers that change what the request does,
    /// such as `Content-Type` or an API version header.
    pub fn with_fingerprint_headers(self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.with(|c| c.fingerprint_headers = headers.into_iter().collect())
    }

    /// Fingerprints JSON bodies by their meaning instead of their bytes (feature `json`, on
    /// by default): a retry whose JSON has its members in another order or other whitespace
    /// is a replay, not a `422`; a different value is still a `422`. Fields named by JSON
    /// Pointer and headers can be left out. Bodies that are not JSON (by `Content-Type`, or
    /// not valid) are compared by their bytes as before. See [`JsonFingerprint`].
    ///
    /// Replaces a [fingerprint function](Self::with_fingerprint_fn) set before. Keys stored
    /// with the raw fingerprint stay valid for requests whose body is not read as JSON;
    /// a JSON retry of a key stored before the change gets `422`.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, JsonFingerprint, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_json_fingerprint(JsonFingerprint::new().exclude("/metadata/request_id")?);
    /// # let _ = layer;
    /// # Ok::<(), tower_idempotency::fingerprint::InvalidPointer>(())
    /// ```
    ///
    /// [`JsonFingerprint`]: crate::JsonFingerprint
    #[cfg(feature = "json")]
    #[cfg_attr(docsrs, doc(cfg(feature = "json")))]
    pub fn with_json_fingerprint(self, json: fingerprint::JsonFingerprint) -> Self {
        self.with(|c| c.fingerprint = fingerprint::Method::Json(Arc::new(json)))
    }

    /// Fingerprints requests with your function, given the request head and the whole body:
    /// two requests with one key are the same request when it returns the same
    /// [`Fingerprint`]. It replaces the layer's fingerprint entirely (method, path, query,
    /// headers and body): include what must not change between a request and its retry.
    /// [`fingerprint::fingerprint`](crate::fingerprint::fingerprint) and
    /// [`JsonFingerprint::fingerprint`](crate::JsonFingerprint::fingerprint) compute the
    /// built-in ones, to delegate to.
    ///
    /// It runs once per keyed request, after the body is read and before the store is asked,
    /// on the task that polls the request: keep it cheap and never block. Stores see a digest
    /// of its result behind a tag of its own, so it never collides with a built-in
    /// fingerprint. Replaces a [JSON fingerprint](Self::with_json_fingerprint) set before.
    ///
    /// ```
    /// use sha2::{Digest, Sha256};
    /// use tower_idempotency::{Fingerprint, IdempotencyLayer, MemoryStore};
    ///
    /// // The path and the body, but not the query (a cache-busting parameter, say).
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_fingerprint_fn(|parts, body| {
    ///     let mut hash = Sha256::new();
    ///     hash.update(parts.uri.path().as_bytes());
    ///     hash.update([0]);
    ///     hash.update(body);
    ///     Fingerprint::from_bytes(hash.finalize().into())
    /// });
    /// # let _ = layer;
    /// ```
    pub fn with_fingerprint_fn<F>(self, f: F) -> Self
    where
        F: Fn(&Parts, &[u8]) -> Fingerprint + Send + Sync + 'static,
    {
        self.with(|c| c.fingerprint = fingerprint::Method::Fn(Arc::new(f)))
    }

    /// Derives the scope of a request's key from the **authenticated principal**: the account,
    /// tenant or user that your authentication layer (outside this one) established, as it
    /// put it into the request's extensions.
    ///
    /// Records are stored per (scope, key), so two clients that send the same key never see
    /// each other's answers. `None` (and the default, no scope function) is the shared scope,
    /// the same as `Some("")`; [`with_scope_required`](Self::with_scope_required) rejects such
    /// requests instead.
    ///
    /// Stores never see the scope itself but its [`scope_digest`]: 64 hex characters (the
    /// shared scope stays `""`). So a scope of any length works, and nothing of it is kept in
    /// the store in plain text.
    ///
    /// Scope on a stable identifier of the principal, **never on a raw credential** (the
    /// `Authorization` header, an API token, a session cookie): a credential changes when it
    /// is refreshed, and a retry with the new one would find a new scope and run the handler
    /// again; and the digest of a weak credential can be guessed back. See the Security
    /// section of the crate docs.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// /// Set by your authentication layer, which runs before this one.
    /// #[derive(Clone)]
    /// struct Principal { account_id: u64 }
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_scope(|parts| {
    ///         let principal = parts.extensions.get::<Principal>()?;
    ///         Some(format!("account:{}", principal.account_id))
    ///     })
    ///     // No principal (a route your authentication let through): `401`, not the
    ///     // shared scope.
    ///     .with_scope_required(true);
    /// # let _ = layer;
    /// ```
    pub fn with_scope<F>(self, scope: F) -> Self
    where
        F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.with(|c| c.scope = Some(Arc::new(scope)))
    }

    /// Whether a keyed request without a scope is rejected (default `false`: it uses the
    /// shared scope).
    ///
    /// With `true`, a covered request with a key whose scope function returns `None` or an
    /// empty scope (or any keyed request, when no scope function is set) is answered
    /// `401 Unauthorized` with a problem document of type
    /// [`missing-scope`](crate::problems#missing-scope) ([`Rejection::MissingScope`]),
    /// before its body is read or the store is asked. The scope is the authenticated
    /// principal, so a request without one is not authenticated, which a client fixes by
    /// authenticating: `401`, rather than `400` (nothing in the request itself is malformed)
    /// or `403` (no principal was refused). Your authentication layer normally rejects such
    /// requests first; this keeps a route it lets through by mistake from sharing one key
    /// space among all its clients. The layer does not know your authentication scheme, so
    /// its `401` carries no `WWW-Authenticate` challenge: add one with
    /// [`with_rejection_handler`](Self::with_rejection_handler) where clients expect it.
    pub fn with_scope_required(self, required: bool) -> Self {
        self.with(|c| c.scope_required = required)
    }

    /// Says explicitly that all clients share one key space: no scope function, and no
    /// warning about it.
    ///
    /// A layer without a scope logs a `WARN` event when it is first applied to a service
    /// (once per layer), since a shared key space lets a client that learns another's key
    /// read that client's stored answer. Call this where one key space is right: a service
    /// with a single client, or keys that are already unique per client (the delivery ID of
    /// a single webhook sender). It removes a scope function set before, and turns
    /// [`with_scope_required`](Self::with_scope_required) off.
    pub fn with_shared_scope(self) -> Self {
        self.with(|c| {
            c.scope = None;
            c.scope_required = false;
            c.shared_scope = true;
        })
    }

    /// Whether dropping a keyed request's response future (the client disconnected, a
    /// timeout layer outside this one gave up) cancels its handler (default `false`).
    ///
    /// By default a keyed request runs in a Tokio task of its own (`tokio::spawn`) and the
    /// response future waits for it, so once its key is claimed the handler **runs to its
    /// end** even if the client is gone, and its answer is stored (in transactional mode:
    /// committed). A retry meanwhile gets `409`, and after it the stored answer: a handler is
    /// never cut at an arbitrary `.await` and run again from the start. A panic in the handler
    /// still releases the key and resumes in the response future. The task costs one spawn
    /// per keyed request; Tokio task-locals of outer layers are not visible inside it (the
    /// tracing span is carried over). Outside a Tokio runtime the request runs inline.
    ///
    /// With `true`, the request runs inline in the response future, as plain Tower
    /// middleware does: dropping it drops the handler wherever it waits. In plain mode the
    /// key is then released (in the background), so a retry runs the handler again from the
    /// start; in transactional mode the transaction rolls back. In plain mode a request
    /// dropped after its handler answered still has its answer read and stored (in a task),
    /// but one dropped while its claim is on the way back leaves the key to its lease: a
    /// retry gets `409` until the lease runs out. Choose it for handlers that are safe to cut
    /// at any `.await` and expensive to finish for nobody.
    pub fn with_cancel_on_disconnect(self, cancel: bool) -> Self {
        self.with(|c| c.cancel_on_disconnect = cancel)
    }

    /// Lets a duplicate of a request still in flight wait up to `max` for the first one's
    /// answer, instead of getting `409` at once (default: no wait).
    ///
    /// A client that timed out and retried while its first request still runs then gets
    /// that request's answer as a replay (`Idempotent-Replayed: true`) as soon as it is
    /// stored. When the first request fails instead (a `5xx`, an error, a panic: its key is
    /// released), the waiters claim the key again and exactly one of them runs the handler;
    /// the others wait on for that one. When `max` runs out first, the duplicate gets the
    /// `409` with `Retry-After` it gets without this setting. A `max` of zero turns waiting
    /// off; one of 30 years or more (`Duration::MAX`) waits as long as it takes: until the
    /// answer, or until the first request's lease runs out and a waiter takes the key over.
    ///
    /// A waiter holds no store connection while it waits: it sleeps until its store says the
    /// key changed ([`Store::watch`](crate::Store::watch)), then claims again.
    /// [`MemoryStore`](crate::MemoryStore) wakes waiters in its process;
    /// [`PostgresStore`](crate::PostgresStore) wakes them in every process sharing the
    /// database (`LISTEN/NOTIFY`; see
    /// [`with_notifications`](crate::PostgresStore::with_notifications)).
    /// A store that cannot tell makes waiters claim again at growing intervals; every waiter
    /// also claims again at least once a second, which covers a first request whose process
    /// died. Works in plain and transactional mode.
    ///
    /// Waiting is bounded by [`with_max_waiters`](Self::with_max_waiters). Keep `max` well
    /// below your clients' own timeout, or their retry gives up before the answer comes.
    pub fn with_wait_for_completion(self, max: Duration) -> Self {
        self.with(|c| c.wait_for_completion = (!max.is_zero()).then_some(max))
    }

    /// The most duplicates that wait at once
    /// ([`with_wait_for_completion`](Self::with_wait_for_completion)), across every service
    /// this layer makes (default 1024). One more gets `409` at once; `0` lets none wait, as
    /// if waiting were off.
    pub fn with_max_waiters(self, max: usize) -> Self {
        self.with(|c| c.max_waiters = max)
    }

    /// Renders the layer's own answers (400, 401, 409, 413, 422, 503) differently. The default
    /// is [`Rejection::to_response`].
    pub fn with_rejection_handler<F>(self, render: F) -> Self
    where
        F: Fn(&Rejection) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.with(|c| c.rejection = Some(Arc::new(render)))
    }
}

impl<S, St: Clone> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        let config = &self.config;
        if config.scope.is_none()
            && !config.shared_scope
            && !self.warned.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                "idempotency layer without a scope: all clients share one key space, so a \
                 client that learns another's key gets its stored answer; set `with_scope` \
                 (the authenticated principal), or `with_shared_scope()` to say that this is \
                 intended"
            );
        }
        Idempotency::new(inner, self.store.clone(), self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    /// Durations at their edges have a documented meaning, never a trap: a lease or store
    /// timeout of zero is raised to 10 ms (a zero lease would let every duplicate take a
    /// running key over), a wait of zero is no wait.
    #[test]
    fn durations_at_their_edges_have_their_documented_meaning() {
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .with_lease(Duration::ZERO)
            .with_store_timeout(Duration::ZERO)
            .with_wait_for_completion(Duration::ZERO);
        assert_eq!(layer.config.lease, Duration::from_millis(10));
        assert_eq!(layer.config.store_timeout, Duration::from_millis(10));
        assert_eq!(layer.config.wait_for_completion, None);
    }
}
