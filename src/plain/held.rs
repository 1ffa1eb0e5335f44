//! A claimed key held while its handler runs: its lease renewed, its answer stored or the
//! key released (also when the request is dropped).

use std::task::Context;
use std::time::Duration;

use tokio::time::Instant;

use crate::key::IdempotencyKey;
use crate::outcome::{Operation, end_in_background, lease_lost, log_store_error, store_call};
use crate::response::StoredResponse;
use crate::store::{LeaseToken, Store};

use super::BoxTask;
use crate::lease::Lease;

/// The renewal of a claimed key's lease while its handler runs.
pub(super) enum Renewal {
    /// Not started: most handlers answer at their first poll.
    Idle,
    Running(BoxTask),
    /// Ended, as the lease was lost, or never started, for want of a timer (outside a Tokio
    /// runtime); never polled again.
    Done,
}

/// Polls the renewal of the lease (made at the first call), which renews it every third of
/// it while the handler runs, until the lease is lost.
pub(super) fn poll_renewal<St: Store>(
    guard: &ReleaseGuard<St>,
    renewal: &mut Renewal,
    signal: &Lease,
    lease: Duration,
    cx: &mut Context<'_>,
) {
    if let Renewal::Idle = renewal
        && let Some(held) = &guard.held
    {
        // Renewals need the runtime's timer. Outside a Tokio runtime (another executor polls
        // the request) there is none: the lease is not renewed, and a handler that outlives it
        // may see its key taken over (the layer documents it).
        *renewal = if tokio::runtime::Handle::try_current().is_ok() {
            Renewal::Running(Box::pin(renew(held.clone(), lease, signal.clone())))
        } else {
            Renewal::Done
        };
    }
    if let Renewal::Running(task) = renewal
        && task.as_mut().poll(cx).is_ready()
    {
        *renewal = Renewal::Done;
    }
}

/// Renews the lease every third of it; marks it lost (and ends) when the store says the key
/// is no longer this claim's, and marks it lost (renewing on) when no renewal succeeded for a
/// whole lease since the last one that did (or the claim) was sent.
async fn renew<St: Store>(held: Held<St>, lease: Duration, signal: Lease) {
    let Held {
        store,
        scope,
        key,
        token,
        claimed_at,
        timeout,
        ..
    } = held;
    let period = lease / 3;
    let mut confirmed = claimed_at;
    loop {
        tokio::time::sleep(period).await;
        let sent = Instant::now();
        // A renewal slower than a period counts as failed: the next one is due.
        let renewal = store.renew(&scope, &key, token, lease);
        match store_call(Operation::Renew, period.min(timeout), renewal).await {
            Ok(true) => {
                confirmed = sent;
                tracing::trace!("idempotency lease renewed");
            }
            Ok(false) => {
                if signal.lose() {
                    lease_lost();
                    tracing::warn!(
                        "idempotency lease lost: another request holds the key now (the lease \
                         ran out, or the key expired); the handler runs on, and its answer will \
                         not be stored over the other request's"
                    );
                } else {
                    tracing::debug!("idempotency lease lost: another request holds the key now");
                }
                return;
            }
            // Tried again at the next period; the lease outlives two missed renewals.
            Err(err) => log_store_error(&err, "renew a lease"),
        }
        if confirmed.elapsed() >= lease && signal.lose() {
            lease_lost();
            tracing::warn!(
                "idempotency lease may have run out: no renewal succeeded for a whole lease, so \
                 another request may take the key over while this handler runs"
            );
        }
    }
}

#[derive(Clone)]
pub(super) struct Held<St> {
    pub(super) store: St,
    pub(super) scope: String,
    pub(super) key: IdempotencyKey,
    pub(super) token: LeaseToken,
    /// When the claim was sent: the lease runs from some moment after it.
    pub(super) claimed_at: Instant,
    /// The claim's lease.
    pub(super) lease: Duration,
    /// The layer's bound on one store call.
    pub(super) timeout: Duration,
}

/// Releases a claimed key on drop (in a task), unless its `held` was taken.
pub(super) struct ReleaseGuard<St: Store> {
    pub(super) held: Option<Held<St>>,
}

impl<St: Store> Held<St> {
    /// Stores the answer. On failure the key is not released (the work was done): it is left
    /// to its lease, so a retry cannot run the handler twice while the store is failing.
    pub(super) async fn complete(self, stored: &StoredResponse, ttl: Duration) {
        let complete = self
            .store
            .complete(&self.scope, &self.key, self.token, stored, ttl);
        match store_call(Operation::Complete, self.timeout, complete).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                "idempotency lease was lost while the handler ran (another request took the key \
                 over); this answer was not stored"
            ),
            Err(err) => log_store_error(
                &err,
                "store the answer; the client gets it, the key waits for its lease",
            ),
        }
    }

    /// Releases the key; when the store does not answer, tries again in the background
    /// while the lease lasts ([`end_in_background`]). The release is fenced by the token: a
    /// late one can free nothing but this claim.
    pub(super) async fn release(self) {
        if self.try_release(true).await {
            return;
        }
        let until = self.claimed_at + self.lease;
        end_in_background(until, move || {
            let held = self.clone();
            Box::pin(async move { held.try_release(false).await })
        });
    }

    /// One release; whether the store made it. A failure is logged (`loud`: as an error).
    async fn try_release(&self, loud: bool) -> bool {
        let release = self.store.release(&self.scope, &self.key, self.token);
        match store_call(Operation::Release, self.timeout, release).await {
            Ok(_) => {
                tracing::debug!("idempotency key released");
                true
            }
            Err(err) if loud => {
                log_store_error(&err, "release a key; trying again while its lease lasts");
                false
            }
            Err(err) => {
                tracing::debug!(
                    error = &err as &dyn std::error::Error,
                    "idempotency: release a key; trying again while its lease lasts"
                );
                false
            }
        }
    }
}

impl<St: Store> Drop for ReleaseGuard<St> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            // Dropped mid-request: the client went away or the handler panicked. Release in the
            // background; without a runtime the lease frees the key when it runs out.
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                tracing::debug!("idempotent request dropped before it finished; releasing its key");
                handle.spawn(held.release());
            }
        }
    }
}
