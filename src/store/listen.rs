//! Wake-ups across processes for [`PostgresStore`](super::PostgresStore).
//!
//! A waiting duplicate registers its key's hash in `tower_idempotency_waiting` (created by
//! `PostgresStore::migrate`) for a while. Plain mode's completions and releases look the hash up in
//! their own statement; transactional mode's completions in theirs at `READ COMMITTED`, and above
//! it right after the commit, in a `READ COMMITTED` transaction of their own (the request's
//! snapshot dates from before the waiter came); rollbacks right after they end. Either sends
//! `NOTIFY tower_idempotency, '<key hash>'` only when the hash is there. One listening connection
//! per store (not taken from the application's pool) wakes the waiting duplicates of its process.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::sync::watch;

use super::notify::{KeyNotifier, KeyWatch};
use crate::key::IdempotencyKey;

/// The channel of the store's notifications.
pub(crate) const CHANNEL: &str = "tower_idempotency";

/// How long the listener rests after it failed to connect or lost its connection.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// How long a registration in `tower_idempotency_waiting` lasts. A waiter registers again each
/// time it goes back to sleep (at least once a second), so this only has to outlast a sleep;
/// rows past it are left to the purge.
const REGISTRATION: Duration = Duration::from_secs(60);

/// The statement that wakes the waiters of a key: a `NOTIFY` only when a
/// waiter registered the key's hash. Sent in the transaction of the change, so it is
/// delivered when that commits.
pub(crate) fn wake_statement(hash: i64) -> String {
    format!("SELECT tower_idempotency_wake({hash})")
}

/// The statement that registers a waiter for the key whose hash is `hash`, for
/// [`REGISTRATION`]. Its values are written in and it goes over the simple query protocol: a
/// bound statement is parsed in one flight and bound in the next, and behind a pooler in
/// transaction mode the next can reach another server connection, where the unnamed statement
/// does not exist.
fn register_statement(hash: i64) -> String {
    format!(
        "INSERT INTO tower_idempotency_waiting AS w (hash, until) \
         VALUES ({hash}, tower_idempotency_now() + interval '{} milliseconds') \
         ON CONFLICT (hash) DO UPDATE SET until = greatest(w.until, excluded.until)",
        REGISTRATION.as_millis()
    )
}

/// Deletes the registrations past their time.
pub(crate) const PURGE_WAITING: &str =
    "DELETE FROM tower_idempotency_waiting WHERE until <= tower_idempotency_now()";

/// How long a waiter waits for the listener to listen (the first waiter of a process, while
/// it connects) before it polls instead.
const READY_WAIT: Duration = Duration::from_secs(1);

/// The wake-ups of one store (shared by its clones).
pub(crate) struct PgNotifier {
    keys: KeyNotifier,
    /// Where the listening connection connects: the pool's server, unless set otherwise
    /// (behind a pooler in transaction mode, `LISTEN` needs a direct connection).
    options: PgConnectOptions,
    /// Whether the listener is listening now.
    listening: Arc<watch::Sender<bool>>,
    /// The listener task, started by the first waiter, aborted when the store is dropped.
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl PgNotifier {
    pub(crate) fn new(options: PgConnectOptions) -> Self {
        Self {
            keys: KeyNotifier::new(),
            options,
            listening: Arc::new(watch::Sender::new(false)),
            task: Mutex::new(None),
        }
    }

    /// Subscribes to the key's changes once the listener listens, and registers the key as
    /// waited for; `None` when the listener does not listen within a second (the waiter then
    /// polls) or there is no runtime to run it in.
    pub(crate) async fn watch(
        &self,
        pool: &PgPool,
        scope: &str,
        key: &IdempotencyKey,
    ) -> Result<Option<KeyWatch>, sqlx::Error> {
        if self.start().is_none() {
            return Ok(None);
        }
        let mut listening = self.listening.subscribe();
        if !matches!(
            tokio::time::timeout(READY_WAIT, listening.wait_for(|on| *on)).await,
            Ok(Ok(_))
        ) {
            return Ok(None);
        }
        let hash = KeyNotifier::key_hash(scope, key);
        // Watching before registering: a change notified once the registration is visible
        // reaches this watch.
        let watch = self.keys.watch_hash(hash);
        // One simple query, in its own implicit transaction: safe behind a pooler.
        sqlx::raw_sql(AssertSqlSafe(register_statement(hash.cast_signed())))
            .execute(pool)
            .await?;
        Ok(Some(watch))
    }

    /// Starts the listener task if it is not running.
    fn start(&self) -> Option<()> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        // A poisoned lock means a panic while starting; the slot itself is still sound.
        let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
        if task.as_ref().is_none_or(|t| t.is_finished()) {
            *task = Some(runtime.spawn(listen(
                self.options.clone(),
                self.keys.clone(),
                self.listening.clone(),
            )));
        }
        Some(())
    }
}

impl std::fmt::Debug for PgNotifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgNotifier")
            .field("listening", &*self.listening.borrow())
            .finish_non_exhaustive()
    }
}

impl Drop for PgNotifier {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().ok().and_then(Option::take) {
            task.abort();
        }
    }
}

/// Listens on [`CHANNEL`] for good: wakes the waiters of each key named, and every waiter
/// after a lost connection (their wake-ups may have been lost with it).
async fn listen(options: PgConnectOptions, keys: KeyNotifier, listening: Arc<watch::Sender<bool>>) {
    // One connection of its own, without the application pool's timeouts.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .max_lifetime(None)
        .idle_timeout(None)
        .connect_lazy_with(options);
    // Whether the last attempt failed too: an outage is logged as a warning once.
    let mut failing = false;
    loop {
        let listener = match PgListener::connect_with(&pool).await {
            Ok(mut listener) => listener.listen(CHANNEL).await.map(|()| listener),
            Err(err) => Err(err),
        };
        let mut listener = match listener {
            Ok(listener) => listener,
            Err(err) => {
                if failing {
                    tracing::debug!(
                        error = &err as &dyn std::error::Error,
                        "idempotency: still cannot listen for finished keys"
                    );
                } else {
                    tracing::warn!(
                        error = &err as &dyn std::error::Error,
                        "idempotency: cannot listen for finished keys; waiting duplicates \
                         poll meanwhile"
                    );
                }
                failing = true;
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            }
        };
        failing = false;
        listening.send_replace(true);
        // Whatever changed before this point was not heard: every waiter claims again.
        keys.notify_all();
        loop {
            match listener.try_recv().await {
                Ok(Some(notification)) => {
                    // The payload is the hash as Postgres' `bigint` prints it.
                    if let Ok(hash) = notification.payload().parse::<i64>() {
                        keys.notify_hash(hash.cast_unsigned());
                    }
                }
                // The connection was lost and made again (listening again): what was sent
                // meanwhile is lost, so every waiter claims again.
                Ok(None) => keys.notify_all(),
                Err(err) => {
                    tracing::warn!(
                        error = &err as &dyn std::error::Error,
                        "idempotency: lost the connection that listens for finished keys"
                    );
                    break;
                }
            }
        }
        listening.send_replace(false);
        keys.notify_all();
        tokio::time::sleep(RECONNECT_PAUSE).await;
    }
}
