//! Idempotency-Key middleware for Tower and axum: a client that retries a `POST` (a timeout,
//! a lost response, a double click) gets the answer of the first attempt instead of a second
//! charge, email or shipment.
//!
//! # Quick start
//!
//! ```
//! use axum::{Extension, Router, routing::post};
//! use tower_idempotency::{IdempotencyKey, IdempotencyLayer, MemoryStore};
//!
//! /// Who is calling: inserted into the request's extensions by your authentication layer.
//! #[derive(Clone)]
//! struct Principal {
//!     account_id: String,
//! }
//!
//! async fn create_payment(
//!     Extension(key): Extension<IdempotencyKey>, // or `key: IdempotencyKey`, feature "axum"
//!     body: String,
//! ) -> (http::StatusCode, String) {
//!     // Runs once per key; retries get this exact answer back.
//!     (http::StatusCode::CREATED, format!("paid with {key}: {body}"))
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new()
//!     .route("/payments", post(create_payment))
//!     .layer(
//!         IdempotencyLayer::new(MemoryStore::new())
//!             // Keys belong to the authenticated account, so no client can replay another's
//!             // answer. Never scope on a raw credential such as the Authorization header.
//!             .with_scope(|req| req.extensions.get::<Principal>().map(|p| p.account_id.clone()))
//!             // No principal: `401`, instead of one key space shared by all such requests.
//!             .with_scope_required(true),
//!     );
//! // .layer(your_authentication_layer): added after, so it runs first and sets `Principal`.
//! # use tower::ServiceExt;
//! # let req = || {
//! #     let mut req = http::Request::post("/payments")
//! #         .header("idempotency-key", "k1").body(axum::body::Body::from("x")).unwrap();
//! #     req.extensions_mut().insert(Principal { account_id: "acct_1".into() });
//! #     req
//! # };
//! # let first = app.clone().oneshot(req()).await.unwrap();
//! # assert_eq!(first.status(), 201);
//! # let again = app.oneshot(req()).await.unwrap();
//! # assert_eq!(again.headers()["idempotent-replayed"], "true");
//! // axum::serve(listener, app).await?;
//! # }
//! ```
//!
//! For several instances of a service, keep the keys in Postgres with [`PostgresStore`]
//! (feature `postgres`, on by default).
//!
//! # How it works
//!
//! For each request whose method is covered (default `POST` and `PATCH`), the layer reads the
//! `Idempotency-Key` header (draft-ietf-httpapi-idempotency-key-header-07), reads the body
//! (up to a limit) and computes a SHA-256 [`Fingerprint`] of the method, path, query and body.
//! Then it **claims** the key in the store, in one atomic operation, which finds the key in
//! one of these states:
//!
//! | state of (scope, key) | answer |
//! |---|---|
//! | absent, or expired (completed longer ago than the TTL; in progress, it never expires while its lease runs) | the key is claimed *in progress* under a lease; the handler runs |
//! | in progress, lease running | `409 Conflict` with `Retry-After: 1`; handler not run (or, with [`with_wait_for_completion`](IdempotencyLayer::with_wait_for_completion), the duplicate waits, bounded, and gets the first's answer replayed) |
//! | in progress, lease ran out (its process died, or could not renew it) | taken over with a new fencing token; the handler runs |
//! | completed | the stored status, headers and body replayed with `Idempotent-Replayed: true`; handler not run |
//! | any, with another fingerprint | `422 Unprocessable Content`; handler not run; record unchanged |
//!
//! When the handler answers, the layer stores its answer (2xx, 3xx and 4xx but `408`, `429`
//! and `499`; 5xx only with
//! [`with_store_server_errors`](IdempotencyLayer::with_store_server_errors); any rule with
//! [`with_store_when`](IdempotencyLayer::with_store_when)) and the key becomes *completed* for
//! the TTL. An answer not stored (a `5xx`, a `408`, `429` or `499`), a handler error or a panic
//! **releases** the key, so a retry runs the handler again (the panic goes on in the response
//! future).
//!
//! A keyed request runs in a Tokio task of its own: once its key is claimed, the handler
//! **runs to its end even if the client goes away** (the response future is dropped), and
//! its answer is stored (in transactional mode, committed); a retry meanwhile gets `409`,
//! and after it the stored answer. So a handler is never cut at an arbitrary `.await` and
//! then run again from the start.
//! [`with_cancel_on_disconnect(true)`](IdempotencyLayer::with_cancel_on_disconnect) runs the
//! request inline instead: a dropped request cuts the handler and releases the key.
//!
//! **Runtime.** On Tokio the runtime must have its time driver (`#[tokio::main]`,
//! `#[tokio::test]` and `Runtime::new` enable it; a `Builder` needs `enable_time` or
//! `enable_all`): leases are renewed and store calls bounded with Tokio's timer, which panics
//! on a runtime built without it, and Tokio offers no way to ask before. Polled by another
//! executor, with no Tokio runtime at all, a keyed request runs inline, every path of it
//! (a handler or store call that waits, a failed answer's release): the store calls are not
//! bounded, the lease is not renewed (a handler that outlives it may see its key taken over),
//! and the answer is stored before the response is returned. The Postgres and Redis stores
//! need a Tokio runtime of their own (sqlx's and redis' drivers).
//!
//! While the handler runs, the layer renews the lease every third of it. A lease runs out
//! under a live process only when no renewal succeeds for about two thirds of it (the store
//! unreachable or slower than a third of the lease, or the process stalled); the handler
//! then finds its [`Lease`] lost (in its request's extensions) and may stop. Completing and
//! releasing need the claim's fencing token, so a request whose key was taken over can never
//! overwrite the new owner's result.
//!
//! | request | answer |
//! |---|---|
//! | covered method, no key (key required, the default) | `400`; with [`with_key_required(false)`](IdempotencyLayer::with_key_required) passed through unprotected |
//! | key empty, over 255 characters, not visible ASCII (a quoted key may also hold spaces), or badly quoted | `400` |
//! | key as a quoted string (`"abc"`) or bare (`abc`) | accepted; the same key |
//! | the key header more than once | `400` |
//! | a key, but no scope, with [`with_scope_required(true)`](IdempotencyLayer::with_scope_required) | `401`; handler not run, nothing stored |
//! | body over the limit (default 1 MiB) | `413`; nothing stored |
//! | store unreachable, or a [`MemoryStore`] full (by default) | `503` with `Retry-After: 1`; handler not run (fail closed) |
//! | method not covered (`GET`, `HEAD`, `OPTIONS`, `PUT`, `DELETE` by default) | passed through untouched: no allocation, no store access |
//!
//! Every answer of the layer's own is an RFC 9457 `application/problem+json` document; see
//! [`problems`] and [`Rejection`].
//!
//! ## When storing the answer fails
//!
//! If the store fails *after* the handler ran, the client still gets the handler's real
//! answer and the failure is logged as an error. The key is not released (the work was done)
//! but left to its lease: a retry in that window gets `409`, a retry after it runs the handler
//! again. Handlers whose work leaves the database should pass a [derived
//! key](IdempotencyKey::derive) on, so the other side deduplicates that retry.
//!
//! ## Responses too large to store
//!
//! Answers whose body exceeds [`with_max_response_body`](IdempotencyLayer::with_max_response_body)
//! (default 1 MiB) still reach the client whole. The key is completed with the status and
//! headers only; a repeat is answered `409` with a problem of type `response-not-stored`
//! carrying `original_status`, and the handler is never run twice.
//!
//! ## Replayed headers
//!
//! Replays carry the stored headers except hop-by-hop headers, `Date` (a replay is a new
//! message), `Content-Length` (recomputed) and, by default, `Set-Cookie`: a cookie is usually
//! a credential, and replaying it hands it to whoever retries with the key. Response trailers
//! (gRPC's `grpc-status`, for one) are stored with the answer and replayed after its body; a
//! gRPC answer is stored or not on the HTTP status its `grpc-status` stands for (the README's
//! "gRPC (tonic)" section).
//!
//! # Stores
//!
//! - [`MemoryStore`]: in-process, for development, tests and single-process services. Bounded
//!   (1,000,000 records and 1 GiB by default; when full it fails closed, or evicts completed
//!   answers: [`WhenFull`]), and it removes expired answers on its own as it is used.
//! - [`PostgresStore`]: one table shared by every instance; run
//!   [`migrate`](PostgresStore::migrate) at start. Times are computed by Postgres, so
//!   instances with skewed clocks agree. A replay costs one statement, a first request two
//!   (with the default [`ClaimStrategy`]).
//! - `RedisStore` (feature `redis`): a single Redis or a Redis Cluster shared by every
//!   instance, plain mode only. Each operation is one Lua script on the server, with the
//!   server's clock; a replay and a claim each cost one round trip. Redis replicates
//!   asynchronously: a master's failover can lose a completion (its retry then runs again)
//!   unless completions wait for replicas (`with_wait_replicas`).
//! - Your own: implement [`Store`].
//!
//! Expired keys are deleted by [`Store::purge_expired`] in bounded batches; [`spawn_purge_task`]
//! runs it periodically. The Postgres store needs it; the memory store does not (a purge
//! there also removes expired in-progress records its claims leave to their owners).
//!
//! # Choosing a mode
//!
//! | your handler's work | use |
//! |---|---|
//! | leaves the database (a payment provider, an email, another service) | **plain mode**: `IdempotencyLayer::new(store)`, and pass [`IdempotencyKey::derive`]d keys to the other side |
//! | is writes to the same Postgres database | **transactional mode**: `IdempotencyLayer::new(pg_store.transactional())`; the handler writes through [`IdempotentTx`], and the key and the writes commit together ([`transactional`]) |
//! | consumes a message queue | the **inbox**: [`inbox::Inbox::process`] records the message ID and runs the work in one transaction; acknowledge after it returns |
//! | receives webhooks | either mode, keyed on the sender's delivery ID: [`with_header`](IdempotencyLayer::with_header)`("webhook-id")` (Standard Webhooks), `X-GitHub-Delivery`, or [`with_key_from`](IdempotencyLayer::with_key_from); duplicates get the stored `2xx`, so the sender stops retrying |
//!
//! In plain mode the key's record and the handler's writes commit separately: if the process
//! dies between the handler's commit and the key's, the lease runs out and a retry runs the
//! handler again. Transactional mode closes that window: a crash leaves both or neither.
//!
//! Both modes keep their guarantee at every isolation level (`READ COMMITTED`, `REPEATABLE
//! READ`, `SERIALIZABLE`, as `default_transaction_isolation` or, in transactional mode,
//! [`Transactional::with_isolation`]); [GUARANTEES.md] states the guarantee of each mode and
//! names, for every situation, the test that proves it.
//!
//! [GUARANTEES.md]: https://docs.rs/crate/tower-idempotency/latest/source/GUARANTEES.md
//!
//! # Configuration
//!
//! | setter | default |
//! |---|---|
//! | [`with_header`](IdempotencyLayer::with_header) / [`with_key_from`](IdempotencyLayer::with_key_from) | `Idempotency-Key` |
//! | [`with_methods`](IdempotencyLayer::with_methods) | `POST`, `PATCH` |
//! | [`with_key_required`](IdempotencyLayer::with_key_required) | `true` |
//! | [`with_scope`](IdempotencyLayer::with_scope) | none (one shared scope, with a warning; [`with_shared_scope`](IdempotencyLayer::with_shared_scope) says it is intended) |
//! | [`with_scope_required`](IdempotencyLayer::with_scope_required) | `false` |
//! | [`with_lease`](IdempotencyLayer::with_lease) | 30 s |
//! | [`with_ttl`](IdempotencyLayer::with_ttl) | 24 h |
//! | [`with_max_request_body`](IdempotencyLayer::with_max_request_body) | 1 MiB |
//! | [`with_max_response_body`](IdempotencyLayer::with_max_response_body) | 1 MiB |
//! | [`with_store_server_errors`](IdempotencyLayer::with_store_server_errors) | `false` |
//! | [`with_store_when`](IdempotencyLayer::with_store_when) | every answer but `408`, `429`, `499` and `5xx` |
//! | [`with_replayed_set_cookie`](IdempotencyLayer::with_replayed_set_cookie) | `false` |
//! | [`with_fingerprint_headers`](IdempotencyLayer::with_fingerprint_headers) | none |
//! | [`with_json_fingerprint`](IdempotencyLayer::with_json_fingerprint) (feature `json`) / [`with_fingerprint_fn`](IdempotencyLayer::with_fingerprint_fn) | the raw bytes of the body |
//! | [`with_cancel_on_disconnect`](IdempotencyLayer::with_cancel_on_disconnect) | `false`: a started handler runs to its end |
//! | [`with_wait_for_completion`](IdempotencyLayer::with_wait_for_completion) | none: a duplicate of a request in flight gets `409` at once |
//! | [`with_max_waiters`](IdempotencyLayer::with_max_waiters) | 1024 waiting duplicates per layer |
//! | [`with_rejection_handler`](IdempotencyLayer::with_rejection_handler) | problem+json |
//!
//! # JSON bodies
//!
//! By default the fingerprint covers the body's bytes, so a client that rebuilds its JSON on
//! a retry (members in another order, other whitespace) gets `422`. With
//! [`with_json_fingerprint`](IdempotencyLayer::with_json_fingerprint) (feature `json`, on by
//! default, no dependencies) a JSON body is fingerprinted by its canonical form (RFC 8785,
//! with numbers kept exact where a double would round them): the same object is a replay,
//! another value still `422`. Fields named by JSON Pointer (`/metadata/request_id`) and
//! named headers can be left out; a body that is not JSON, or not of a JSON `Content-Type`,
//! falls back to its raw bytes. [`with_fingerprint_fn`](IdempotencyLayer::with_fingerprint_fn)
//! takes a function of your own instead. See `JsonFingerprint`.
//!
//! ```
//! # #[cfg(feature = "json")] {
//! use tower_idempotency::{IdempotencyLayer, JsonFingerprint, MemoryStore};
//!
//! let layer = IdempotencyLayer::new(MemoryStore::new())
//!     .with_json_fingerprint(JsonFingerprint::new().exclude("/metadata/request_id").unwrap());
//! # let _ = layer;
//! # }
//! ```
//!
//! # Layer ordering
//!
//! Put authentication **outside** (before) this layer, so the scope function sees the
//! authenticated principal and unauthenticated requests never claim keys. Put body-limit and
//! decompression layers outside too, so the fingerprint covers the body the handler sees.
//! With axum, [`Router::layer`](https://docs.rs/axum/latest/axum/struct.Router.html#method.layer)
//! wraps every route; `route_layer` only matched routes (so unknown paths answer `404`, not
//! `400`).
//!
//! # Handlers
//!
//! The layer inserts the [`IdempotencyKey`] into the request's extensions; with the `axum`
//! feature it is also an extractor (`IdempotencyKey`, or `Option<IdempotencyKey>`). Use
//! [`IdempotencyKey::derive`] to pass a key on to a payment provider: `<key>:charge`. In
//! plain mode the extensions also hold the request's [`Lease`], which says whether another
//! request may have taken the key over.
//!
//! # The client half
//!
//! The caller must send a key, and retry with the same one. [`IdempotentClientLayer`] does
//! it for outbound clients (any `tower::Service<http::Request<_>>`, such as hyper-util's):
//! it sends the key derived from the incoming request's (`<key>:charge`, when the outbound
//! request's extensions hold the [`IdempotencyKey`]), or one the caller set, or a fresh
//! random one; and it retries that same key with exponential backoff and jitter on lost
//! answers (connection errors, timeouts), `409` (honouring `Retry-After`), `429`, `502`,
//! `503` and `504` — never on `400`, `422` or another `4xx` — within a bound of attempts
//! and of total time. See [`client`].
//!
//! # Security
//!
//! - **Always set a scope.** Without [`with_scope`](IdempotencyLayer::with_scope) all
//!   clients share one key space: a client that learns or guesses another's key gets that
//!   client's stored answer (which may hold personal or payment data), and can block another
//!   client's request with `409`/`422`. A layer without a scope logs a `WARN` when it is
//!   applied, unless [`with_shared_scope`](IdempotencyLayer::with_shared_scope) says so.
//! - **Scope on the authenticated principal**: the account or tenant your authentication
//!   layer established and put into the request's extensions. Authenticate before this
//!   layer. Never scope on a header the client sets freely, nor on a raw credential (the
//!   `Authorization` header, an API token): a refreshed token would make a retry a new
//!   request, and a weak credential could be guessed back from its digest.
//!   [`with_scope_required(true)`](IdempotencyLayer::with_scope_required) answers `401` to a
//!   keyed request without a principal instead of putting it in the shared scope.
//! - Stores keep a fixed-size [`scope_digest`] (SHA-256, 64 hex characters), never the scope
//!   itself: a scope of any length fits, and the store does not hold what it was made of.
//! - Keys should be unguessable (a UUIDv4 or 128 random bits); the layer cannot enforce it.
//! - Stored answers are kept for the TTL in the store: protect the store like the data
//!   itself, and keep the TTL no longer than clients retry.
//! - `Set-Cookie` is not replayed by default (see above).
//! - Bodies are read up to the request limit before the handler runs; keep it small.
//!
//! # Observability
//!
//! Each keyed request runs in a `tracing` span `idempotency` with the key and an `outcome`
//! field (`executed`, `takeover`, `replayed`, `in_flight`, `mismatch`, `store_error`,
//! `rejected`). With the `metrics` feature the layer reports, never with a key or a scope
//! as a label:
//!
//! | metric | kind | what |
//! |---|---|---|
//! | `tower_idempotency_requests_total{outcome}` | counter | the outcomes above; the replay rate shows how often clients retry |
//! | `tower_idempotency_in_flight` | gauge | keyed requests whose handler runs (in transactional mode, each holds a pool connection) |
//! | `tower_idempotency_store_call_seconds{operation}` | histogram | each store call (`claim`, `complete`, `release`, `renew`, `commit`), as the layer waited for it |
//! | `tower_idempotency_store_errors_total{operation,kind}` | counter | store calls that failed (`kind` `error`) or hit the store timeout (`timeout`) |
//! | `tower_idempotency_leases_lost_total` | counter | handlers that lost their key's lease while running (renewals failed for most of a lease) |
//!
//! The README's "Deploying" section says what to alert on.

#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod answer;
pub mod body;
pub mod client;
mod config;
mod error;
#[cfg(feature = "axum")]
mod extract;
pub mod fingerprint;
pub mod future;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod grpc;
mod hex;
#[cfg(feature = "postgres")]
pub mod inbox;
#[cfg(feature = "json")]
mod json;
mod key;
mod layer;
mod lease;
pub mod message_id;
mod mode;
mod outcome;
#[cfg(feature = "postgres")]
pub use store::postgres::phased;
mod plain;
pub mod rejection;
mod request;
pub mod response;
mod service;
pub mod store;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
#[cfg(feature = "postgres")]
pub use store::postgres::transactional;
mod wait;

pub use client::{ClientError, IdempotentClient, IdempotentClientLayer};
pub use error::{BoxError, ConfigError, StoreError};
#[cfg(feature = "axum")]
pub use extract::MissingIdempotencyKey;
#[cfg(all(feature = "axum", feature = "postgres"))]
pub use extract::{MissingIdempotentTx, MissingPhases};
pub use fingerprint::Fingerprint;
#[cfg(feature = "json")]
pub use fingerprint::JsonFingerprint;
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use layer::{IDEMPOTENCY_KEY, IdempotencyLayer, scope_digest};
pub use lease::Lease;
pub use mode::Mode;
#[cfg(feature = "postgres")]
pub use phased::{PhaseError, PhaseState, Phased, Phases};
pub use rejection::Rejection;
pub use response::{IDEMPOTENT_REPLAYED, ReplayedHeaders, StoredResponse};
pub use service::Idempotency;
#[cfg(feature = "redis")]
pub use store::RedisStore;
pub use store::{
    ClaimOutcome, ClaimRequest, LeaseToken, MemoryStore, Store, WhenFull, spawn_purge_task,
};
#[cfg(feature = "postgres")]
pub use store::{ClaimStrategy, PostgresStore};
#[cfg(feature = "postgres")]
pub use transactional::{
    DEFAULT_HANDLER_TIMEOUT, IdempotentTx, IsolationLevel, Transactional, TxConn, TxUnavailable,
};

pub mod problems {
    //! The problem types of the layer's own answers (RFC 9457 `type` URIs point here).
    //!
    //! Every body is `application/problem+json` with `type`, `title`, `status` and `detail`.
    //!
    //! ## missing-key
    //! `400`: a covered request has no key: no `Idempotency-Key`, or no value in the header
    //! the layer was configured to read. The `detail` names that header.
    //!
    //! ## invalid-key
    //! `400`: the key is empty, longer than 255 characters, not visible ASCII (a quoted key
    //! may also hold spaces), or not a well-formed quoted string.
    //!
    //! ## multiple-keys
    //! `400`: the key header was sent more than once.
    //!
    //! ## unreadable-body
    //! `400`: the request body could not be read.
    //!
    //! ## body-too-large
    //! `413`: the body is larger than the layer's limit.
    //!
    //! ## request-in-progress
    //! `409` with `Retry-After: 1`: the first request with this key has not finished. The hint
    //! is the smallest `Retry-After` there is: the layer cannot know when the first request will
    //! answer (what is left of its lease, renewed while the handler runs, is no estimate of it),
    //! and most handlers answer within a second. A client may wait longer between retries.
    //!
    //! ## key-reused
    //! `422`: the key was used with a different method, path, query or body.
    //!
    //! ## response-not-stored
    //! `409`: the request with this key was processed, but its answer was too large to
    //! store. Carries `original_status`. The request is not processed again.
    //!
    //! ## store-unavailable
    //! `503` with `Retry-After`: the idempotency store failed, before the request ran or
    //! while its outcome was recorded (then it may have completed). It is safe to retry with
    //! the same key: the retry replays the answer if the request completed, and runs it
    //! otherwise.
    //!
    //! ## handler-timed-out
    //! `503` with `Retry-After`: the handler ran longer than the layer's bound
    //! ([`Transactional::with_handler_timeout`](crate::Transactional::with_handler_timeout),
    //! [`Phased::with_handler_timeout`](crate::Phased::with_handler_timeout)) and was stopped;
    //! its open transaction was rolled back (in transactional mode nothing of it was
    //! committed; in phased mode the retry resumes after its committed steps), and the key is
    //! free again. Safe to retry with the same key.
    //!
    //! ## missing-scope
    //! `401`: the layer requires a scope (the authenticated principal; see
    //! [`with_scope_required`](crate::IdempotencyLayer::with_scope_required)) and the request
    //! has none. The request was not processed; authenticate and retry with the same key.
}

/// The consumers guide's examples, compiled as doc tests.
#[cfg(all(doctest, feature = "postgres"))]
#[doc = include_str!("../docs/consumers.md")]
pub struct ConsumersGuideDoctests;

/// The README's examples, compiled as doc tests.
#[cfg(all(doctest, feature = "axum", feature = "postgres"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
