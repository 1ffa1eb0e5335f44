//! [`Lease`]: whether a keyed request's handler still holds its key.

use std::fmt;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// The lease of a keyed request in plain mode, for its handler: whether the request still
/// holds its key.
///
/// The layer inserts it into the request's extensions (plain mode only: in transactional
/// mode the key is held by the request's transaction, which nothing can take over). While
/// the handler runs, the layer renews the lease every third of its length
/// ([`with_lease`](crate::IdempotencyLayer::with_lease)). The lease is **lost** when
///
/// - a renewal finds that the request no longer holds the key: another request took it
///   over after the lease ran out, or the key's record expired (a handler slower than the
///   TTL); or
/// - no renewal has succeeded for a whole lease (the store could not be reached, or
///   answered slower than a third of the lease, for about two thirds of it; or the process
///   stalled): another request may take the key over at any moment.
///
/// Once lost, a lease stays lost. The handler is not cancelled: it runs on, and its client
/// gets its answer, but that answer is stored only if no other request claimed the key
/// meanwhile (completing takes the claim's fencing token). A handler with work still to do
/// can stop early, or pass its work on with a [derived key](crate::IdempotencyKey::derive)
/// so that the other side deduplicates it:
///
/// ```
/// use http::{Request, StatusCode};
/// use tower_idempotency::Lease;
///
/// async fn charge<B>(req: Request<B>) -> StatusCode {
///     let lease = req.extensions().get::<Lease>().cloned();
///     let work = async { /* the slow part */ StatusCode::CREATED };
///     match lease {
///         Some(lease) => tokio::select! {
///             answer = work => answer,
///             // Another request may be running this one's work now: stop here. A 5xx
///             // stores nothing (and releases the key if this request still holds it).
///             () = lease.lost() => StatusCode::SERVICE_UNAVAILABLE,
///         },
///         None => work.await,
///     }
/// }
/// # let _ = charge::<()>;
/// ```
#[derive(Clone)]
pub struct Lease {
    state: Arc<LeaseState>,
}

struct LeaseState {
    lost: AtomicBool,
    notify: Notify,
}

impl Lease {
    pub(crate) fn new() -> Self {
        Self {
            state: Arc::new(LeaseState {
                lost: AtomicBool::new(false),
                notify: Notify::new(),
            }),
        }
    }

    /// Whether the lease is lost: another request holds the key, or may take it over.
    pub fn is_lost(&self) -> bool {
        self.state.lost.load(Ordering::Acquire)
    }

    /// Waits until the lease is lost (returns at once if it is); to `select!` on while the
    /// handler works. It never returns while the lease holds.
    pub async fn lost(&self) {
        let mut notified = pin!(self.state.notify.notified());
        loop {
            // Registered before the flag is read, so a loss in between is not missed.
            notified.as_mut().enable();
            if self.is_lost() {
                return;
            }
            notified.as_mut().await;
            notified.set(self.state.notify.notified());
        }
    }

    /// Marks the lease lost and wakes the waiters; `true` if it was not lost before.
    pub(crate) fn lose(&self) -> bool {
        let first = !self.state.lost.swap(true, Ordering::AcqRel);
        if first {
            self.state.notify.notify_waiters();
        }
        first
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("lost", &self.is_lost())
            .finish()
    }
}
