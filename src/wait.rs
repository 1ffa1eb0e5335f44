//! Duplicates that wait for the first request's answer instead of getting `409`
//! ([`IdempotencyLayer::with_wait_for_completion`](crate::IdempotencyLayer::with_wait_for_completion)).
//!
//! A duplicate of a key in flight subscribes to the key's changes ([`Store::watch`]), claims
//! the key again (a change between its first claim and its subscription is not missed), and
//! sleeps until the store says the key changed — or, as a safety net for a first request
//! whose process died (it never says anything), until a recheck is due. Then it claims
//! again: a completed key is replayed, a released one is claimed by exactly one waiter (the
//! claim is atomic), and one still in flight is waited for again, until the bound runs out.
//! A waiter holds no store connection while it sleeps.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::config::Config;
use crate::error::StoreError;
use crate::key::IdempotencyKey;
use crate::outcome::{Operation, Taken, store_call};
use crate::store::Store;

/// The longest a waiter sleeps between two claims when its store says when keys change: a
/// safety net for a first request that will never say it finished (its process died; in
/// plain mode its lease then runs out, in transactional mode its transaction is rolled
/// back), and for a wake-up lost on the way (a listener that reconnected).
const RECHECK: Duration = Duration::from_secs(1);

/// The first and the longest pause between two claims when the store cannot say when keys
/// change ([`Store::watch`] returned `None`): the waiter claims again with exponential
/// backoff.
const POLL_FIRST: Duration = Duration::from_millis(20);
const POLL_MAX: Duration = Duration::from_millis(500);

/// The longest wait: a bound past it (`Duration::MAX`, "as long as it takes") is this one,
/// as the clock cannot hold a deadline that far (adding it to now would overflow).
const LONGEST_WAIT: Duration = Duration::from_secs(30 * 365 * 24 * 3600);

/// A waiter's place under the layer's cap ([`IdempotencyLayer::with_max_waiters`]).
///
/// [`IdempotencyLayer::with_max_waiters`]: crate::IdempotencyLayer::with_max_waiters
struct Place(Arc<AtomicUsize>);

impl Place {
    fn take(count: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(count.clone()))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How a wait ended, for the counter `tower_idempotency_waits_total` (feature `metrics`).
fn waited(result: &'static str) {
    tracing::debug!(
        result,
        "idempotency: a duplicate waited for the first request"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_idempotency_waits_total", "result" => result).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}

/// Claims a key; when it is in flight and the layer lets duplicates wait, waits (up to the
/// layer's bound) for the first request to finish, claiming again after each change.
///
/// `claim` is one claim of the mode (plain or transactional): what it holds, or who holds
/// the key. The store is asked for changes through `store`.
pub(crate) async fn claim_or_wait<St, A, F, Fut>(
    config: &Config,
    store: &St,
    scope: &str,
    key: &IdempotencyKey,
    mut claim: F,
) -> Result<Result<A, Taken>, StoreError>
where
    St: Store,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Result<A, Taken>, StoreError>>,
{
    let first = claim().await?;
    let (Some(bound), Err(Taken::InFlight(_))) = (config.wait_for_completion, &first) else {
        return Ok(first);
    };
    // Outside a Tokio runtime there is no timer to bound the wait with.
    if bound.is_zero() || tokio::runtime::Handle::try_current().is_err() {
        return Ok(first);
    }
    let Some(_place) = Place::take(&config.waiters, config.max_waiters) else {
        waited("full");
        return Ok(first);
    };
    let deadline = Instant::now() + bound.min(LONGEST_WAIT);
    let mut pause = POLL_FIRST;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // Subscribed before the claim, so a change after the claim wakes this waiter.
        let watch = tokio::time::timeout(
            left,
            store_call(
                Operation::Watch,
                config.store_timeout,
                store.watch(scope, key),
            ),
        )
        .await;
        let watch = match watch {
            Ok(Ok(watch)) => watch,
            // Without a subscription the waiter polls (below).
            Ok(Err(err)) => {
                tracing::debug!(
                    error = &err as &dyn std::error::Error,
                    "idempotency: cannot watch a key; polling it instead"
                );
                None
            }
            Err(_) => None,
        };
        let retry = match claim().await? {
            Err(Taken::InFlight(retry)) => retry,
            Ok(acquired) => {
                waited("acquired");
                return Ok(Ok(acquired));
            }
            Err(Taken::Completed(stored)) => {
                waited("replayed");
                return Ok(Err(Taken::Completed(stored)));
            }
            Err(other) => {
                waited("other");
                return Ok(Err(other));
            }
        };
        let now = Instant::now();
        if now >= deadline {
            waited("timed_out");
            return Ok(Err(Taken::InFlight(retry)));
        }
        match watch {
            Some(watch) => {
                let recheck = (now + retry.clamp(POLL_FIRST, RECHECK)).min(deadline);
                // Woken, or the recheck is due: either way, claim again.
                let _ = tokio::time::timeout_at(recheck, watch).await;
            }
            None => {
                tokio::time::sleep_until((now + pause).min(deadline)).await;
                pause = (pause * 2).min(POLL_MAX);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_holds_and_places_come_back() {
        let count = Arc::new(AtomicUsize::new(0));
        let a = Place::take(&count, 2).unwrap();
        let _b = Place::take(&count, 2).unwrap();
        assert!(Place::take(&count, 2).is_none());
        drop(a);
        assert!(Place::take(&count, 2).is_some());
    }
}
