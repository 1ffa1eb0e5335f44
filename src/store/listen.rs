//! Wake-ups across processes for [`PostgresStore`](super::PostgresStore).
//!
//! A waiting duplicate registers its key's hash in `tower_idempotency_waiting` (created by
//! `PostgresStore::migrate`) for a while. Plain mode's completions and releases look the hash up in
//! their own statement; transactional mode's completions in theirs at `READ COMMITTED`, and above
//! it right after the commit, in a `READ COMMITTED` transaction of their own (the request's
//! snapshot dates from before the waiter came); rollbacks right after they end. Either sends
//! `NOTIFY tower_idempotency, '<key hash>'` only when the hash is there. One listening connection
//! per store (not taken from the application's pool) wakes the waiting duplicates of its process.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

use super::notify::{KeyNotifier, KeyWatch};
use super::subscriber::{Feed, Heard, Subscriber};
use crate::error::BoxError;
use crate::key::IdempotencyKey;

/// The channel of the store's notifications.
pub(crate) const CHANNEL: &str = "tower_idempotency";

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

/// The wake-ups of one store (shared by its clones).
pub(crate) struct PgNotifier {
    subscriber: Subscriber,
    /// Where the listening connection connects: the pool's server, unless set otherwise
    /// (behind a pooler in transaction mode, `LISTEN` needs a direct connection).
    options: PgConnectOptions,
}

impl PgNotifier {
    pub(crate) fn new(options: PgConnectOptions) -> Self {
        Self {
            subscriber: Subscriber::new(),
            options,
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
        if !self
            .subscriber
            .ready(|| PgFeed::new(self.options.clone()))
            .await
        {
            return Ok(None);
        }
        let hash = KeyNotifier::key_hash(scope, key);
        // Watching before registering: a change notified once the registration is visible
        // reaches this watch.
        let watch = self.subscriber.keys().watch_hash(hash);
        // One simple query, in its own implicit transaction: safe behind a pooler.
        sqlx::raw_sql(AssertSqlSafe(register_statement(hash.cast_signed())))
            .execute(pool)
            .await?;
        Ok(Some(watch))
    }
}

impl std::fmt::Debug for PgNotifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgNotifier")
            .field("listening", &self.subscriber.hearing())
            .finish_non_exhaustive()
    }
}

/// The listening connection: one of its own, without the application pool's timeouts,
/// listening on [`CHANNEL`].
struct PgFeed {
    pool: PgPool,
}

impl PgFeed {
    fn new(options: PgConnectOptions) -> Self {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .max_lifetime(None)
            .idle_timeout(None)
            .connect_lazy_with(options);
        Self { pool }
    }
}

impl Feed for PgFeed {
    const WHAT: &'static str = "listen for finished keys";
    type Open = PgListener;

    async fn open(&mut self) -> Result<PgListener, BoxError> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(CHANNEL).await?;
        Ok(listener)
    }

    async fn next(listener: &mut PgListener) -> Heard {
        loop {
            match listener.try_recv().await {
                Ok(Some(notification)) => {
                    // The payload is the hash as Postgres' `bigint` prints it.
                    if let Ok(hash) = notification.payload().parse::<i64>() {
                        return Heard::Key(hash.cast_unsigned());
                    }
                }
                // The connection was lost and made again (listening again): what was sent
                // meanwhile is lost.
                Ok(None) => return Heard::Gap,
                Err(err) => return Heard::Lost(Some(Box::new(err))),
            }
        }
    }
}
