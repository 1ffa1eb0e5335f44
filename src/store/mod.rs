//! Where keys live: the [`Store`] contract, [`MemoryStore`], (feature `postgres`)
//! [`PostgresStore`] and (feature `redis`) [`RedisStore`].
//!
//! A store keeps one record per (scope, key). A record is either **in progress** (a request
//! holds it under a lease and a fencing token) or **completed** (it holds the response to
//! replay). An expired record counts as absent. When a record expires:
//!
//! - in progress: never while its lease holds. A claim makes it live for
//!   `max(ttl, lease)`, and each [`renew`](Store::renew) extends its life to at least the
//!   new lease's end, so a TTL shorter than the lease (or than the handler takes) cannot
//!   let a running key be claimed again;
//! - completed: the TTL given to [`complete`](Store::complete), counted from the
//!   completion (not from the claim).
//!
//! The contract every store keeps:
//!
//! - [`claim`](Store::claim) is one atomic operation. Of all the requests that claim the same
//!   absent key at once, exactly one gets [`ClaimOutcome::Acquired`].
//! - An in-progress record whose lease ran out may be taken over by a request with the same
//!   fingerprint; it gets a new token, and the old token stops working.
//! - [`complete`](Store::complete), [`release`](Store::release) and [`renew`](Store::renew)
//!   act only while the token still holds the record, so a stale owner can never overwrite the
//!   work of the request that took over. A token holds its in-progress record until a claim
//!   replaces it (a takeover, or a new claim of the expired record) or it is released or
//!   purged: an owner whose lease ran out while nobody claimed the key can still renew or
//!   complete it.
//! - A fingerprint mismatch is reported before anything else, for a record in any state.
//!
//! The shared behaviour suite in `tests/` runs against every store of this crate; a store of
//! your own should pass the same checks.

use std::future::Future;
use std::time::Duration;

use crate::error::{ConfigError, StoreError};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::response::StoredResponse;

#[cfg(feature = "postgres")]
pub(crate) mod listen;
mod memory;
mod notify;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "postgres")]
pub(crate) mod sql;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod subscriber;

#[cfg(feature = "redis")]
pub use self::redis::RedisStore;
pub use memory::{MemoryStore, WhenFull};
pub use notify::{KeyNotifier, KeyWatch};
#[cfg(feature = "postgres")]
pub use postgres::{ClaimStrategy, PostgresStore};

/// The fencing token of a claimed key.
///
/// Tokens are unique across all claims of a store (never reused, not even after a key is
/// released and claimed again), so a token identifies one claim.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct LeaseToken(i64);

impl LeaseToken {
    /// Wraps a raw token (for store implementations).
    pub const fn from_raw(raw: i64) -> Self {
        Self(raw)
    }

    /// The raw token (for store implementations).
    pub const fn into_raw(self) -> i64 {
        self.0
    }
}

/// The arguments of [`Store::claim`].
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The scope the key belongs to (`""` when the layer has no scope function).
    pub scope: &'a str,
    /// The key.
    pub key: &'a IdempotencyKey,
    /// The fingerprint of the request.
    pub fingerprint: Fingerprint,
    /// How long the claim holds the key before another request may take it over.
    pub lease: Duration,
    /// How long the record lives. While in progress it lives at least as long as its lease:
    /// the claim makes it live `max(ttl, lease)`, and [`Store::renew`] extends that to the
    /// new lease's end. Once completed, it lives the TTL given to [`Store::complete`].
    pub ttl: Duration,
}

/// What [`Store::claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimOutcome {
    /// The caller now holds the key: run the handler, then complete or release.
    Acquired {
        /// The fencing token of this claim.
        token: LeaseToken,
        /// `true` when the key was taken over from a request whose lease ran out.
        takeover: bool,
    },
    /// Another request holds the key and its lease has not run out.
    InFlight {
        /// How long until the lease runs out.
        retry_after: Duration,
    },
    /// The key was completed with the same fingerprint: replay this response.
    Completed(StoredResponse),
    /// The key is in use (in progress or completed) with another fingerprint.
    Mismatch,
}

/// The storage behind the layer.
///
/// Implementations are cheap to clone (a pool or an `Arc`). Async methods return
/// `impl Future + Send`, so they can be awaited in any Tower service.
pub trait Store: Clone + Send + Sync + 'static {
    /// Atomically claims the key, or reports why it cannot be claimed.
    fn claim(
        &self,
        request: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send;

    /// Stores the response of a claimed key and marks it completed for `ttl` from now
    /// (whatever was left of the in-progress record's life).
    ///
    /// Returns `false` (and changes nothing) when `token` no longer holds the key.
    fn complete(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes an in-progress record, so the next request with the key runs the handler.
    ///
    /// Returns `false` (and changes nothing) when `token` no longer holds the key.
    fn release(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Extends the lease of a claimed key to `lease` from now, and the record's life to at
    /// least the lease's end.
    ///
    /// Returns `false` when `token` no longer holds the key.
    fn renew(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Subscribes to the changes of a key, for a duplicate that waits for the first
    /// request's answer
    /// ([`with_wait_for_completion`](crate::IdempotencyLayer::with_wait_for_completion)).
    ///
    /// The returned [`KeyWatch`] finishes when the key's record may have changed after this
    /// call — completed or released, by a request in this process or (for a store shared by
    /// several) in any other; spurious wake-ups are fine, the waiter claims the key again. A
    /// store keeps a [`KeyNotifier`] for this and calls it from
    /// [`complete`](Self::complete) and [`release`](Self::release).
    ///
    /// The default, `None`, says the store cannot tell: waiters then claim the key again at
    /// growing intervals (20 ms doubling up to 500 ms) until it is free or their bound runs
    /// out. Either way a waiter also claims again at least once a second, which covers a
    /// first request whose process died.
    fn watch(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> impl Future<Output = Result<Option<KeyWatch>, StoreError>> + Send {
        let _ = (scope, key);
        std::future::ready(Ok(None))
    }

    /// Deletes expired records, at most `batch_size` per statement (or lock), until none are
    /// left. Returns how many were deleted.
    fn purge_expired(
        &self,
        batch_size: usize,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// Spawns a task that calls [`Store::purge_expired`] every `every`, deleting in batches of
/// `batch_size`. Failures are logged and retried at the next tick. Abort the returned handle
/// to stop it.
///
/// # Errors
///
/// Refused where it is called, not in a task that would stop purging unseen:
/// [`ConfigError::ZeroPurgePeriod`], [`ConfigError::ZeroPurgeBatch`], and
/// [`ConfigError::NoRuntime`] outside a Tokio runtime. (The runtime must have its time
/// driver enabled, as `#[tokio::main]` and `Runtime::new` do.)
pub fn spawn_purge_task<St: Store>(
    store: St,
    every: Duration,
    batch_size: usize,
) -> Result<tokio::task::JoinHandle<()>, ConfigError> {
    if every.is_zero() {
        return Err(ConfigError::ZeroPurgePeriod);
    }
    if batch_size == 0 {
        return Err(ConfigError::ZeroPurgeBatch);
    }
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| ConfigError::NoRuntime)?;
    Ok(runtime.spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match store.purge_expired(batch_size).await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(deleted = n, "purged expired idempotency keys"),
                Err(e) => tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "purging expired idempotency keys failed"
                ),
            }
        }
    }))
}
