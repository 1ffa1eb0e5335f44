//! The task that carries key changes from other processes to this process's waiting
//! duplicates, for the stores shared by several processes: Postgres (`LISTEN`) and Redis
//! (`SUBSCRIBE`). One connection per store, opened by the first waiter (never while nobody
//! waits), made again after it is lost; every waiter wakes whenever changes may have gone
//! unheard, and claims its key again.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::notify::KeyNotifier;
use crate::error::BoxError;

/// How long the task rests after it failed to connect or lost its connection.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// How long a waiter waits for the task to hear (the first waiter of a process, while it
/// connects) before it polls instead.
const READY_WAIT: Duration = Duration::from_secs(1);

/// What a [`Feed`] heard.
pub(crate) enum Heard {
    /// A key changed: the waiters of its hash wake.
    Key(u64),
    /// Changes may have gone unheard (the connection was made again underneath): every
    /// waiter wakes.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Gap,
    /// The connection is lost.
    Lost(Option<BoxError>),
}

/// A connection on which a store hears key changes.
pub(crate) trait Feed: Send + 'static {
    /// What the task does with it, for the logs ("listen for finished keys").
    const WHAT: &'static str;
    /// An open connection, subscribed.
    type Open: Send;
    /// Opens a connection and subscribes.
    fn open(&mut self) -> impl Future<Output = Result<Self::Open, BoxError>> + Send;
    /// Waits for the next change heard on `open`.
    fn next(open: &mut Self::Open) -> impl Future<Output = Heard> + Send;
}

/// The wake-ups of one store (shared by its clones): its waiters' [`KeyNotifier`] and the
/// task that feeds it.
pub(crate) struct Subscriber {
    keys: KeyNotifier,
    /// Whether the task hears changes now.
    hearing: Arc<watch::Sender<bool>>,
    /// The task, started by the first waiter, aborted when the store is dropped.
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Subscriber {
    pub(crate) fn new() -> Self {
        Self {
            keys: KeyNotifier::new(),
            hearing: Arc::new(watch::Sender::new(false)),
            task: Mutex::new(None),
        }
    }

    /// The notifier the task wakes waiters through.
    pub(crate) fn keys(&self) -> &KeyNotifier {
        &self.keys
    }

    /// Whether the task hears changes: started with `feed` if it is not running, waited for
    /// up to a second. `false` when it does not hear within that (the waiter then polls) or
    /// there is no runtime to run it in.
    pub(crate) async fn ready<F: Feed>(&self, feed: impl FnOnce() -> F) -> bool {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        {
            // A poisoned lock means a panic while starting; the slot itself is still sound.
            let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
            if task.as_ref().is_none_or(|t| t.is_finished()) {
                *task = Some(runtime.spawn(run(feed(), self.keys.clone(), self.hearing.clone())));
            }
        }
        let mut hearing = self.hearing.subscribe();
        matches!(
            tokio::time::timeout(READY_WAIT, hearing.wait_for(|on| *on)).await,
            Ok(Ok(_))
        )
    }

    /// Whether the task hears changes now.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn hearing(&self) -> bool {
        *self.hearing.borrow()
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().ok().and_then(Option::take) {
            task.abort();
        }
    }
}

/// Hears `feed` for good: wakes the waiters of each key heard, and every waiter when the
/// connection is made or lost (changes may have gone unheard meanwhile).
async fn run<F: Feed>(mut feed: F, keys: KeyNotifier, hearing: Arc<watch::Sender<bool>>) {
    // Whether the last attempt failed too: an outage is logged as a warning once.
    let mut failing = false;
    loop {
        let mut open = match feed.open().await {
            Ok(open) => open,
            Err(err) => {
                if failing {
                    tracing::debug!(
                        error = &*err as &dyn std::error::Error,
                        "idempotency: still cannot {}",
                        F::WHAT
                    );
                } else {
                    tracing::warn!(
                        error = &*err as &dyn std::error::Error,
                        "idempotency: cannot {}; waiting duplicates poll meanwhile",
                        F::WHAT
                    );
                }
                failing = true;
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            }
        };
        failing = false;
        hearing.send_replace(true);
        // Whatever changed before this point was not heard: every waiter claims again.
        keys.notify_all();
        loop {
            match F::next(&mut open).await {
                Heard::Key(hash) => keys.notify_hash(hash),
                Heard::Gap => keys.notify_all(),
                Heard::Lost(err) => {
                    match err {
                        Some(err) => tracing::warn!(
                            error = &*err as &dyn std::error::Error,
                            "idempotency: lost the connection to {}",
                            F::WHAT
                        ),
                        None => tracing::warn!("idempotency: lost the connection to {}", F::WHAT),
                    }
                    break;
                }
            }
        }
        hearing.send_replace(false);
        keys.notify_all();
        tokio::time::sleep(RECONNECT_PAUSE).await;
    }
}
