//! Store errors, and settings refused where they are given.

use std::error::Error as StdError;

/// A boxed error, the cause carried by [`StoreError::Backend`].
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// An error from an idempotency store.
///
/// The layer never turns a store error into a service error: it answers `503 Service
/// Unavailable` (before the handler runs) or logs it (after), as the crate docs describe.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend failed: a connection, a query, a pool timeout. The cause is kept.
    #[error("idempotency store backend failed")]
    Backend(#[source] BoxError),
    /// A stored record could not be decoded.
    #[error("stored idempotency record is corrupt: {0}")]
    Corrupt(String),
    /// The store's schema is missing or older than this crate needs (run `migrate()`).
    #[error("idempotency store schema is not ready: {0}")]
    Schema(String),
    /// The store did not answer within the layer's bound
    /// ([`with_store_timeout`](crate::IdempotencyLayer::with_store_timeout)), or the
    /// database cancelled the store's statement at its own bound (`statement_timeout`,
    /// `lock_timeout`). Whether a write that timed out took effect is unknown.
    #[error("idempotency store did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The store is full: it holds as many records or bytes as it may, and none it may drop
    /// (see [`MemoryStore`](crate::MemoryStore)'s limits). Like any store error before the
    /// handler runs, the layer answers it `503` with `Retry-After`.
    #[error("idempotency store is full")]
    Full,
    /// The backend is configured in a way that breaks the store's guarantees (a Redis that
    /// evicts keys: see
    /// [`RedisStore::check_eviction_policy`](crate::RedisStore::check_eviction_policy)).
    #[error("idempotency store is misconfigured: {0}")]
    Misconfigured(String),
}

/// A setting refused where it was given: it would have turned the layer's protection off, or
/// made a task fail later where nobody looks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A time to live of zero ([`with_ttl`](crate::IdempotencyLayer::with_ttl)): every
    /// answer would be forgotten as it is stored, and every retry would run the handler again.
    #[error("the idempotency TTL must be longer than zero: with zero no retry is ever replayed")]
    ZeroTtl,
    /// No method to cover ([`with_methods`](crate::IdempotencyLayer::with_methods)): every
    /// request would pass through unprotected.
    #[error("the idempotency layer must cover at least one method")]
    NoMethods,
    /// A purge period of zero ([`spawn_purge_task`](crate::store::spawn_purge_task)).
    #[error("the purge period must be longer than zero")]
    ZeroPurgePeriod,
    /// A purge batch of zero records ([`spawn_purge_task`](crate::store::spawn_purge_task)):
    /// nothing would ever be purged.
    #[error("the purge batch must hold at least one record")]
    ZeroPurgeBatch,
    /// A status given to
    /// [`IdempotentClientLayer::with_retry_statuses`](crate::client::IdempotentClientLayer::with_retry_statuses)
    /// that is not a `4xx` or a `5xx`. Only those say that a request failed: a `1xx` is not a
    /// final answer, a `2xx` is the success the call waits for, and a `3xx` points elsewhere
    /// (sending the same request again gets the same redirect).
    #[error("status {0} cannot be retried: only 4xx and 5xx answers say that a request failed")]
    NotRetryable(http::StatusCode),
    /// [`spawn_purge_task`](crate::store::spawn_purge_task) was called outside a Tokio
    /// runtime.
    #[error("the purge task needs a Tokio runtime (with its time driver enabled)")]
    NoRuntime,
    /// A consumer name that is empty or longer than 200 bytes
    /// ([`Consumer::new`](crate::inbox::Consumer::new)): it keys every message ID and
    /// position of the consumer, and labels its metrics.
    #[error("a consumer's name must be 1 to 200 bytes long")]
    InvalidConsumerName,
    /// A message lease of zero ([`Consumer::with_lease`](crate::inbox::Consumer::with_lease)):
    /// every claim would run out as it is taken, and a redelivery would start the work again
    /// while it runs.
    #[error("a message lease must be longer than zero")]
    ZeroLease,
    /// No attempt allowed before a message is parked
    /// ([`Consumer::with_max_failures`](crate::inbox::Consumer::with_max_failures)): every
    /// message would be parked without its work ever running.
    #[error("a consumer must allow at least one failed attempt before it parks a message")]
    ZeroMaxFailures,
    /// A retention of zero ([`DailyInbox::new`](crate::inbox::DailyInbox::new)): every
    /// message ID would be dropped as it is recorded.
    #[error("an inbox's retention must be longer than zero")]
    ZeroRetention,
    /// A retention of more than [`MAX_RETENTION_DAYS`](crate::inbox::MAX_RETENTION_DAYS)
    /// days ([`DailyInbox::new`](crate::inbox::DailyInbox::new)): a partition a day, made at
    /// once by the first `maintain`, and a day's name past what the calendar names.
    #[error("an inbox's retention may be at most {max_days} days")]
    RetentionTooLong {
        /// The longest retention, in days.
        max_days: u32,
    },
    /// More than [`MAX_DAYS_AHEAD`](crate::inbox::MAX_DAYS_AHEAD) days made ahead
    /// ([`DailyInbox::with_days_ahead`](crate::inbox::DailyInbox::with_days_ahead)): a
    /// partition each, made by every `maintain`.
    #[error("an inbox may make partitions at most {max} days ahead")]
    TooManyDaysAhead {
        /// The most days ahead.
        max: u32,
    },
}

impl StoreError {
    /// Wraps a backend error.
    pub fn backend(err: impl Into<BoxError>) -> Self {
        Self::Backend(err.into())
    }
}

#[cfg(feature = "postgres")]
impl From<sqlx::Error> for StoreError {
    fn from(err: sqlx::Error) -> Self {
        Self::Backend(Box::new(err))
    }
}
