//! The client half: an outbound layer that sends an idempotency key and retries safely.
//!
//! The server layer makes a retry safe; the caller still has to send a key, and retry with
//! *the same* key. [`IdempotentClientLayer`] does that for any outbound
//! `tower::Service<http::Request<ReplayBody>>` — hyper-util's client, or a stack on top of it.
//!
//! ```no_run
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use tower::{Layer as _, ServiceExt as _};
//! use tower_idempotency::IdempotencyKey;
//! use tower_idempotency::client::{IdempotentClientLayer, ReplayBody};
//!
//! # async fn charge(incoming: IdempotencyKey) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! // Made once, cloned per call.
//! let http = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
//! let provider = IdempotentClientLayer::new("charge")?.layer(http);
//!
//! // In a handler behind the server layer: `incoming` is the request's key (extracted, or
//! // taken from its extensions). Put it into the outbound request's extensions…
//! let mut request = http::Request::post("http://provider.internal/charges")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"amount_cents": 1999}"#)))?;
//! request.extensions_mut().insert(incoming);
//! // …and it is sent as `Idempotency-Key: <incoming key>:charge`, on every attempt.
//! let response = provider.clone().oneshot(request).await?;
//! # let _ = response;
//! # Ok(()) }
//! ```
//!
//! # Which key
//!
//! Every request through the layer is a keyed call, whatever its method: put the layer on
//! the client you make changing calls with (a `GET` with a key is harmless — servers ignore
//! the key on methods they do not cover — but it is buffered and retried like the others).
//! One key per logical call, the same on every attempt:
//!
//! 1. an `Idempotency-Key` header the caller set is kept as it is;
//! 2. otherwise, when the request's extensions hold an [`IdempotencyKey`] (the incoming
//!    request's, which the server layer puts there for handlers), the key
//!    [derived](IdempotencyKey::derive) from it with the layer's purpose:
//!    `<incoming key>:<purpose>`, or its hashed form for long keys. A retry of the incoming
//!    request derives the same key, so the other side deduplicates across *those* retries
//!    too — also after a crash of the caller;
//! 3. otherwise a fresh random key: 128 bits from the operating system's random source, as
//!    32 hex digits. It covers the retries of this call only.
//!
//! # What is retried
//!
//! | attempt's outcome | retried |
//! |---|---|
//! | the inner service failed because the connection failed or was lost: refused, reset, closed before the answer, timed out ([`ConnectionErrors`]) | yes |
//! | any other error of the inner service: an invalid URI, a refused TLS handshake, a name that does not resolve, an error type the classifier does not know | no: [`ClientError::Inner`] after that attempt |
//! | no answer within the attempt timeout | yes |
//! | `409` with `Retry-After` (the server layer's `request-in-progress`: an earlier attempt with this key still runs) | yes, after its `Retry-After` if that is longer than the backoff |
//! | `409` without `Retry-After` (the server layer's `response-not-stored`, a handler's own conflict) | no: it is the call's answer |
//! | `429`, `503` | yes, after the answer's `Retry-After` if it is longer than the backoff |
//! | `502`, `504` (a gateway lost the answer) | yes |
//! | any other answer: `2xx`, `3xx`, `400`, `404`, `422`, other `4xx`, `500` and other `5xx` | no: it is the call's answer |
//!
//! A request that carries a key is safe to send again whatever happened to the last one:
//! the server either never saw it, or runs it once and replays its answer. What is retried
//! is what a later attempt can change. A connection that failed or an answer that was lost
//! may go through next time; an invalid URI or a certificate the client does not trust fails
//! the same way every time, and is returned at once. A `422` means the key was used with
//! another request, and a `409` that does not say "later" is final — sending either again
//! cannot help. A `500` is returned rather than retried at once; the key makes a later call
//! with it safe.
//!
//! **Statuses.** [`with_retry_statuses`](IdempotentClientLayer::with_retry_statuses)
//! replaces the set (only `4xx` and `5xx`; anything else is refused with
//! [`ConfigError::NotRetryable`](crate::ConfigError::NotRetryable) when the layer is configured; an empty set retries no answer).
//! A `409` in the set is retried only when it carries a `Retry-After`. The server layer's
//! `409 request-in-progress` always does, and its `409 response-not-stored` never does; the
//! header, not the problem document's `type`, is what the client reads, because the
//! response body is the inner service's and is returned untouched (reading it would consume
//! it). A server that renders its rejections itself (`with_rejection_handler`) must keep
//! `Retry-After` on its in-progress `409` for clients to retry it.
//!
//! **`Retry-After`** is read as delta-seconds (`Retry-After: 3`) or as an HTTP-date (RFC 9110:
//! `Wed, 21 Oct 2015 07:28:00 GMT`, or either obsolete form), the date measured against this
//! machine's clock (a date already past asks for no wait). Either way it is bounded by the
//! call's limits below: a retry whose wait would reach the deadline is not made.
//!
//! **Errors.** The inner service's error type is generic, so the layer cannot know every
//! error that is worth another attempt. By default ([`ConnectionErrors`]) it retries only
//! errors whose `source()` chain says that the connection failed or was lost — a
//! `std::io::Error` of a connection kind (refused, reset, aborted, broken pipe, timed out,
//! unreachable), or a `hyper::Error` for a connection closed before the answer or a request
//! never sent — and returns every other error after one attempt. This needs an error type
//! that is a `std::error::Error` (hyper-util's is); for another (tower's `BoxError`), or to
//! retry more or less, give a classifier with
//! [`with_error_classifier`](IdempotentClientLayer::with_error_classifier).
//!
//! Attempts are spaced by exponential backoff with full jitter (a random wait between zero
//! and `min(2 s, 100 ms × 2^(n-1))` before retry `n`). The call stops at
//! [`with_max_attempts`](IdempotentClientLayer::with_max_attempts) (default 5) or at its
//! [`with_deadline`](IdempotentClientLayer::with_deadline) (default 10 s from the first
//! attempt), whichever comes first: no attempt runs past the deadline, and no retry starts
//! whose wait (a `Retry-After: 3600`, say) would reach it. Then the last outcome is the
//! call's: the last answer as `Ok` (a `503`, say), or the last error
//! ([`ClientError::Inner`], [`ClientError::TimedOut`]).
//!
//! The request body is read once, up to
//! [`with_max_request_body`](IdempotentClientLayer::with_max_request_body) (default 1 MiB),
//! and sent byte for byte on every attempt ([`ReplayBody`]); a larger body is
//! [`ClientError::BodyTooLarge`] and nothing is sent. The response is the inner service's,
//! untouched.
//!
//! Timers are Tokio's (`tokio::time`, so paused time in tests applies). Outside a Tokio
//! runtime a call makes one attempt, without timeout or retry.
//!
//! # Configuration
//!
//! | setter | default |
//! |---|---|
//! | [`new`](IdempotentClientLayer::new)`(purpose)` | — (the purpose of derived keys; checked here) |
//! | [`with_header`](IdempotentClientLayer::with_header) | `Idempotency-Key` |
//! | [`with_max_attempts`](IdempotentClientLayer::with_max_attempts) | 5 |
//! | [`with_attempt_timeout`](IdempotentClientLayer::with_attempt_timeout) | 5 s |
//! | [`with_deadline`](IdempotentClientLayer::with_deadline) | 10 s |
//! | [`with_backoff`](IdempotentClientLayer::with_backoff) | 100 ms, at most 2 s |
//! | [`with_max_request_body`](IdempotentClientLayer::with_max_request_body) | 1 MiB |
//! | [`with_retry_statuses`](IdempotentClientLayer::with_retry_statuses) | `409` (with `Retry-After`), `429`, `502`, `503`, `504` |
//! | [`with_error_classifier`](IdempotentClientLayer::with_error_classifier) | [`ConnectionErrors`] |
//!
//! Choose the deadline within what your own caller waits for you, and, when the call runs
//! in a handler behind the server layer in transactional mode, mind that the handler holds
//! its transaction (a pool connection) for as long as the call takes.
//!
//! # Observability
//!
//! Each call runs in a `tracing` span `idempotent_client` (DEBUG) with the `purpose`, the
//! `key` and the number of `attempts`; each attempt that fails or is retried is a DEBUG event
//! with its number and `reason` (`error`, `timeout`, or the retried status: `409`, `429`,
//! `502`, `503`, `504` by default), and a call that gives up is a WARN event. With the `metrics` feature, never with a key as a
//! label:
//!
//! | metric | kind | what |
//! |---|---|---|
//! | `tower_idempotency_client_attempts_total{purpose}` | counter | attempts sent |
//! | `tower_idempotency_client_retries_total{purpose,reason}` | counter | retries, by the reason above |
//! | `tower_idempotency_client_calls_total{purpose,outcome}` | counter | calls: `answered` (an answer that is not retried), `failed` (an error that is not retried), `exhausted` (the bounds were hit; the last outcome returned), `not_sent` (the body was too large or unreadable) |

mod body;
mod config;
mod future;
mod layer;
mod retry;
mod service;

use std::time::Duration;

pub use body::ReplayBody;
pub use future::ResponseFuture;
pub use layer::IdempotentClientLayer;
pub use retry::{ClassifyError, ConnectionErrors};
pub use service::IdempotentClient;

use crate::error::BoxError;
#[cfg(doc)]
use crate::key::IdempotencyKey;

/// Why an [`IdempotentClient`] call returned no answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError<E> {
    /// The inner service failed (the cause is kept): with an error the classifier does not
    /// call transient, on that attempt; with a transient one, on the last attempt the bounds
    /// allowed. `attempts` is `0` when it failed to become ready before the first.
    #[error("the outbound call failed after {attempts} attempt(s)")]
    Inner {
        /// The inner service's error.
        #[source]
        source: E,
        /// Attempts made.
        attempts: u32,
    },
    /// The last attempt got no answer within `after` (the attempt timeout, or what was left
    /// of the deadline).
    #[error("the outbound call got no answer within {after:?} (attempt {attempts})")]
    TimedOut {
        /// How long the last attempt waited.
        after: Duration,
        /// Attempts made.
        attempts: u32,
    },
    /// The request body is larger than the layer's limit: nothing was sent.
    #[error("the request body is larger than {limit} bytes: not sent")]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The request body could not be read: nothing was sent.
    #[error("the request body could not be read: not sent")]
    Body(#[source] BoxError),
    /// No random key could be drawn (the operating system's random source failed): nothing
    /// was sent.
    #[error("no random idempotency key could be drawn: not sent")]
    Random(#[source] BoxError),
}

impl<E> ClientError<E> {
    /// How many attempts were sent (`0`: none).
    pub fn attempts(&self) -> u32 {
        match self {
            Self::Inner { attempts, .. } | Self::TimedOut { attempts, .. } => *attempts,
            Self::BodyTooLarge { .. } | Self::Body(_) | Self::Random(_) => 0,
        }
    }
}
