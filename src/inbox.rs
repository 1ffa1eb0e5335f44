//! An inbox for message consumers: each message's ID and its work commit in one Postgres
//! transaction (feature `postgres`).
//!
//! Message brokers deliver at least once: a consumer that committed its work but lost the
//! acknowledgement (a crash, a dropped channel, a rebalance) gets the message again. The inbox
//! makes the redelivery harmless. [`Inbox::process`] opens a transaction, records
//! `(consumer, message_id)` in `tower_idempotency_processed_messages` with
//! `INSERT … ON CONFLICT DO NOTHING`, runs the work on the same transaction and commits:
//!
//! - a new message: the work runs and commits together with its ID →
//!   [`Delivery::Processed`];
//! - a message already committed: nothing runs → [`Delivery::Duplicate`];
//! - two consumers racing on one message: the second one's insert waits for the first's
//!   transaction, then sees `Duplicate` if it committed, or does the work itself if it rolled
//!   back;
//! - the work fails, or the process dies: everything rolls back, and the redelivery runs it
//!   again;
//! - the work returns `Ok` after a statement of it failed (it caught a unique violation,
//!   say): Postgres aborted the transaction, so nothing can commit →
//!   [`InboxError::Aborted`], and the redelivery runs it again. Recover from an expected
//!   failure in a savepoint (`sqlx::Connection::begin` on the work's connection: the inbox's
//!   transaction is sqlx's own, so that makes a savepoint) instead. The connections of the
//!   HTTP layer's transactional and phased modes are not: there, send `SAVEPOINT` in SQL.
//!
//! Any `default_transaction_isolation` works. Under `repeatable read` and `serializable`, a
//! delivery whose snapshot was taken before a racing delivery of the same message committed
//! gets a serialization failure (40001) from the insert of the ID; the inbox checks that the
//! ID is committed and answers [`Delivery::Duplicate`].
//!
//! **Acknowledge after `process` returns**, never before: an acknowledgement sent before the
//! commit loses the message if the process dies in between; one sent after it can only be lost
//! itself, and then the inbox turns the redelivery into a `Duplicate`. Acknowledge
//! `Duplicate` deliveries too, or the broker keeps redelivering them.
//!
//! ```no_run
//! use tower_idempotency::inbox::{Delivery, Inbox};
//!
//! # async fn run(pool: sqlx::PgPool, message_id: &str, amount: i64) -> Result<(), Box<dyn std::error::Error>> {
//! let inbox = Inbox::new(pool);
//! inbox.migrate().await?;
//! let outcome = inbox
//!     .process("charges", message_id, async |conn: &mut sqlx::PgConnection| {
//!         sqlx::query("UPDATE accounts SET balance = balance - $1 WHERE id = 1")
//!             .bind(amount)
//!             .execute(conn)
//!             .await
//!     })
//!     .await?;
//! if let Delivery::Duplicate = outcome {
//!     tracing::info!(message_id, "redelivered message skipped");
//! }
//! // now acknowledge the message
//! # Ok(()) }
//! ```
//!
//! # Retention
//!
//! [`purge_older_than`](Inbox::purge_older_than) deletes old IDs in bounded batches. The
//! retention must cover the broker's longest redelivery window: the queue's message retention,
//! plus any dead-letter queue that may be replayed into the consumer later. An ID purged before
//! its last redelivery is processed again.

use std::time::Duration;

use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};

/// Begins a transaction on `pool`, in a task of its own. sqlx's `begin`, dropped while its
/// `BEGIN` is on its way (a delivery cancelled, a timeout around it), gives the connection
/// back to the pool with the transaction the server opened meanwhile still open; every
/// statement the pool sends on it after that runs in a transaction nobody ends, holding its
/// locks. In a task the `BEGIN` runs to its end whatever happens to the caller, and a
/// transaction nobody takes is rolled back as any dropped one is. Without a runtime it runs
/// in place.
pub(crate) async fn begin(
    pool: &PgPool,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, sqlx::Error> {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return pool.begin().await;
    };
    let pool = pool.clone();
    runtime
        .spawn(async move { pool.begin().await })
        .await
        .unwrap_or(Err(sqlx::Error::WorkerCrashed))
}

mod commit;
mod consumer;
mod daily;
mod dead;
mod delivery;
mod lease;
mod order;
mod transient;

use commit::{
    commit_unless_aborted, commit_unless_aborted_by, commit_unless_finish_undone,
    take_over_an_expired_claim,
};
pub use consumer::Consumer;
pub use daily::{DailyInbox, MAX_DAYS_AHEAD, MAX_RETENTION_DAYS, Maintenance};
pub use dead::DeadLetter;
pub use delivery::{Message, Outcome, Settle};
pub use lease::{Claim, MessageLease};
pub use order::Ordered;
pub use transient::is_transient_database_error;

use crate::error::StoreError;
use crate::store::postgres::sqlstate::{IN_FAILED_TRANSACTION, SERIALIZATION_FAILURE, sqlstate_is};
use crate::store::postgres::{db_error, migrate, millis};
use crate::store::sql::{Lit, fill};

/// Whether [`Inbox::process`] ran the work.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Delivery<T> {
    /// A new message: the work ran and committed with the message's ID.
    Processed(T),
    /// The message was processed before; the work did not run.
    Duplicate,
}

/// Why [`Inbox::process`] failed. Nothing was committed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError<E> {
    /// The work returned an error; its transaction was rolled back.
    #[error("message work failed")]
    Work(#[source] E),
    /// The database failed (begin, insert, the check before the commit, or the commit); the
    /// transaction was rolled back.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The message ID is empty or longer than 1024 bytes.
    #[error("message IDs must be 1 to 1024 bytes long")]
    InvalidMessageId,
    /// An ordering key that is empty or longer than 1024 bytes
    /// ([`Inbox::process_in_order`], [`MessageLease::commit_in_order`]).
    #[error("ordering keys must be 1 to 1024 bytes long")]
    InvalidOrderKey,
    /// The message's day has no partition in a [`DailyInbox`], or lies below the first day
    /// it keeps (a day it dropped once, which it never makes again): it was first sent
    /// longer ago than the retention (its ID may have been dropped), or further ahead than
    /// the partitions made. Nothing ran. Park or log it; do not apply it without the inbox.
    #[error("the message's day is outside the daily inbox's partitions; nothing was applied")]
    OutsideRetention,
    /// Another worker holds the message under a lease ([`Inbox::claim`]) that has not run
    /// out: do not acknowledge; let the broker deliver it again after `retry_after`.
    #[error("the message is being processed by another worker; retry after {retry_after:?}")]
    InProgress {
        /// How long until the other worker's lease runs out.
        retry_after: Duration,
    },
    /// The lease of a [`MessageLease`] was lost: another worker took the message over after
    /// the lease ran out. Nothing was committed; do not acknowledge.
    #[error("the message's lease was lost to another worker; nothing was committed")]
    LeaseLost,
    /// The work returned `Ok`, but its transaction could no longer commit: a statement in it
    /// failed and the work carried on (Postgres aborts the whole transaction at the first
    /// failed statement), or the work ended the transaction itself. Nothing was committed.
    ///
    /// To recover from an expected failure inside the work (a unique violation, say), run
    /// the statement in a savepoint (`sqlx::Connection::begin` on the work's connection),
    /// or avoid the failure (`INSERT … ON CONFLICT`).
    #[error(
        "the message's transaction was aborted by a failed statement that the work did not \
         report; nothing was committed"
    )]
    Aborted,
}

/// The processed-message table of a consumer group, in Postgres. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Inbox {
    pool: PgPool,
    lock_timeout: Duration,
}

const MAX_MESSAGE_ID: usize = 1024;

/// Records the message ID, waiting at most the inbox's lock timeout (`$3`, ms) for a
/// concurrent delivery of the same message; the work's own `lock_timeout` is put back after.
const RECORD: &str = "
SELECT tower_idempotency_record_message($1, $2, $3) AS recorded";

/// As [`RECORD`], and for a new ID the ordering key `$4`'s position moved to `$5` if it is
/// below it: [`RECORDED`], [`RECORDED_STALE`], or 0 when the ID was recorded before.
const RECORD_AT: &str = "
SELECT tower_idempotency_record_message($1, $2, $3, $4, $5) AS recorded";

/// [`RECORD_AT`]: the ID recorded, and the position moved (or, [`RECORD`], the ID recorded).
const RECORDED: i16 = 1;
/// [`RECORD_AT`]: the ID recorded, and the message at or below the position.
const RECORDED_STALE: i16 = 2;

/// The default [`Inbox::with_lock_timeout`].
const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether the ID is recorded (processed, or held by a leased claim), as the statement's
/// transaction sees it.
const STILL_RECORDED: &str = "
SELECT EXISTS (SELECT 1 FROM tower_idempotency_processed_messages
                WHERE consumer = $1 AND message_id = $2)";

/// Whether the ID is recorded as processed, as the statement's transaction sees it: the check
/// before the commit of [`Inbox::process`]. Not a leased claim: when the transaction took over
/// the claim of a worker that died, the claim's row was committed before it, so work that
/// ended the transaction left that row behind, and only its lease token (not cleared now)
/// tells that the takeover went with the transaction.
const STILL_PROCESSED: &str = "
SELECT EXISTS (SELECT 1 FROM tower_idempotency_processed_messages
                WHERE consumer = $1 AND message_id = $2 AND lease_token IS NULL)";

/// The message's row as a fresh statement sees it: processed (`leased` false), or held by a
/// leased claim ([`Inbox::claim`]) and for how much longer (`lease_left_ms`, zero once the
/// lease ran out).
const LOOK: &str = "
SELECT lease_token IS NOT NULL AS leased,
       greatest(0, (extract(epoch FROM lease_expires_at - tower_idempotency_now()) * 1000)::bigint)
           AS lease_left_ms
  FROM tower_idempotency_processed_messages
 WHERE consumer = $1 AND message_id = $2";

/// How long the leased claim in a row of [`LOOK`] still holds the message; `None` when the
/// row is a processed message.
fn lease_left(row: &sqlx::postgres::PgRow) -> Result<Option<Duration>, StoreError> {
    if !row.try_get::<bool, _>("leased").map_err(db_error)? {
        return Ok(None);
    }
    let left: i64 = row.try_get("lease_left_ms").map_err(db_error)?;
    Ok(Some(Duration::from_millis(left.unsigned_abs())))
}

/// Deletes up to `$2` IDs older than `$1` ms, oldest first, found by walking the
/// `processed_at` index and deleted by their row addresses, so that no batch scans the table
/// (see the store's purge).
const PURGE: &str = "
DELETE FROM tower_idempotency_processed_messages
 WHERE ctid = ANY (ARRAY(
       SELECT ctid FROM tower_idempotency_processed_messages
        WHERE processed_at < tower_idempotency_now() - $1::float8 * interval '1 millisecond'
          AND (lease_token IS NULL OR lease_expires_at <= tower_idempotency_now())
        ORDER BY processed_at
        LIMIT $2
          FOR UPDATE SKIP LOCKED))";

impl Inbox {
    /// An inbox on `pool`. Run [`migrate`](Inbox::migrate) (or
    /// [`PostgresStore::migrate`](crate::PostgresStore::migrate): the same migrations) first.
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
        }
    }

    /// How long [`process`](Inbox::process) waits for another delivery of the same message
    /// that is being processed right now (default 5 s; zero waits as long as it takes).
    /// When the other delivery commits in time, this one is [`Delivery::Duplicate`]; when it
    /// does not, this one fails with [`InboxError::Store`] and nothing is committed: do not
    /// acknowledge it, and the broker's redelivery finds the ID committed (or runs the work,
    /// if the other delivery failed).
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// The pool this inbox uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates or upgrades the crate's tables; see
    /// [`PostgresStore::migrate`](crate::PostgresStore::migrate).
    ///
    /// # Errors
    ///
    /// As [`PostgresStore::migrate`](crate::PostgresStore::migrate).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate(&self.pool).await
    }

    /// Runs `work` for a message unless `consumer` already processed `message_id`, recording
    /// the ID in the same transaction as the work. Acknowledge the message after this returns
    /// `Ok` (either variant).
    ///
    /// `work` gets the transaction's connection: do every write of the message through it.
    ///
    /// # Errors
    ///
    /// [`InboxError::Work`] when `work` fails, [`InboxError::Aborted`] when it returned `Ok`
    /// but a statement of it failed (or it ended the transaction), [`InboxError::Store`] when
    /// the database fails; in every case nothing was committed, so do not acknowledge: let
    /// the broker redeliver.
    pub async fn process<T, E, F>(
        &self,
        consumer: &str,
        message_id: &str,
        work: F,
    ) -> Result<Delivery<T>, InboxError<E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        Ok(
            match self.process_at(consumer, message_id, None, work).await? {
                Delivery::Processed(Ordered::Applied(out)) => Delivery::Processed(out),
                // Cannot happen: without a position nothing is stale. Answered as a commit that
                // did not happen rather than a panic.
                Delivery::Processed(Ordered::Stale) => return Err(InboxError::Aborted),
                Delivery::Duplicate => Delivery::Duplicate,
            },
        )
    }

    /// As [`process`](Self::process), and with `order` (a key and the message's position
    /// in it) the key's position moved in the same transaction: a message at or below it is
    /// recorded as processed without running the work (`Processed(Stale)`).
    pub(crate) async fn process_at<T, E, F>(
        &self,
        consumer: &str,
        message_id: &str,
        order: Option<(&str, i64)>,
        work: F,
    ) -> Result<Delivery<Ordered<T>>, InboxError<E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        if message_id.is_empty() || message_id.len() > MAX_MESSAGE_ID {
            return Err(InboxError::InvalidMessageId);
        }
        if let Some((key, _)) = order {
            order::check_key(key)?;
        }
        let (consumer_lit, id_lit) = (Lit::Text(consumer), Lit::Text(message_id));
        let bound = Lit::Int(millis(self.lock_timeout));
        let record = match order {
            None => fill(RECORD, &[consumer_lit, id_lit, bound])?,
            Some((key, position)) => fill(
                RECORD_AT,
                &[
                    consumer_lit,
                    id_lit,
                    bound,
                    Lit::Text(key),
                    Lit::Int(position),
                ],
            )?,
        };
        let mut attempts = 0;
        let mut tx = loop {
            let mut tx = begin(&self.pool).await.map_err(db_error)?;
            // Waits only if another transaction inserted the same ID (or moved the key's
            // position) and has not ended yet. Sent over the simple protocol (no prepared
            // statement: see `crate::store::sql`).
            let recorded = match sqlx::raw_sql(AssertSqlSafe(record.as_str()))
                .fetch_one(&mut *tx)
                .await
            {
                Ok(row) if order.is_some() => row.try_get::<i16, _>("recorded"),
                Ok(row) => row.try_get::<bool, _>("recorded").map(i16::from),
                // Repeatable read or serializable: a delivery of the same message (or of
                // the same key) committed after this transaction's snapshot, so the conflict
                // is an error, not a no-op.
                Err(err) if sqlstate_is(&err, SERIALIZATION_FAILURE) => {
                    tx.rollback().await.map_err(db_error)?;
                    match self.duplicate_or(consumer, message_id, err).await {
                        // Not this message: another one of its key moved the position. The
                        // work has not run: begin again.
                        Err(InboxError::Store(_))
                            if order.is_some() && attempts + 1 < order::ADVANCE_ATTEMPTS =>
                        {
                            attempts += 1;
                            continue;
                        }
                        other => return other,
                    }
                }
                Err(err) => return Err(db_error(err).into()),
            }
            .map_err(db_error)?;
            match recorded {
                RECORDED => break tx,
                // Recorded as processed: a redelivery is a duplicate.
                RECORDED_STALE => {
                    tx.commit().await.map_err(db_error)?;
                    return Ok(Delivery::Processed(Ordered::Stale));
                }
                _ => {}
            }
            if !take_over_an_expired_claim(&mut tx, consumer, message_id).await? {
                tx.rollback().await.map_err(db_error)?;
                return Ok(Delivery::Duplicate);
            }
            // A leased claim whose worker died, taken over: the ID is this transaction's.
            let Some(order) = order else {
                break tx;
            };
            match order::advance_in(tx, consumer, order, &mut attempts).await? {
                order::Moved::Go(tx) => break tx,
                order::Moved::Stale(tx) => {
                    tx.commit().await.map_err(db_error)?;
                    return Ok(Delivery::Processed(Ordered::Stale));
                }
                order::Moved::Again => {}
            }
        };
        // On error the transaction is dropped, which rolls it back.
        let out = work(&mut tx).await.map_err(InboxError::Work)?;
        // A COMMIT in an aborted transaction rolls back and still succeeds (with the tag
        // ROLLBACK, which sqlx does not check), and sqlx does not expose the connection's
        // transaction status: ask the transaction before committing. In an aborted one this
        // statement fails with 25P02; its answer says whether the ID is still recorded as
        // processed in the transaction (work that ended the transaction itself took the ID,
        // or its takeover of a dead worker's claim, with it). One round trip; sending it
        // together with the COMMIT would mean a COMMIT behind the back of sqlx's transaction
        // bookkeeping.
        commit_unless_aborted(tx, consumer, message_id).await?;
        Ok(Delivery::Processed(Ordered::Applied(out)))
    }

    /// After a serialization failure on the insert of the ID: [`Delivery::Duplicate`] when
    /// the ID is committed (a concurrent delivery processed the message),
    /// [`InboxError::InProgress`] when a leased claim holds it, else the failure.
    async fn duplicate_or<T, E>(
        &self,
        consumer: &str,
        message_id: &str,
        failure: sqlx::Error,
    ) -> Result<Delivery<T>, InboxError<E>> {
        // A statement of its own: a fresh snapshot, whatever the isolation level.
        let still = fill(
            STILL_RECORDED,
            &[Lit::Text(consumer), Lit::Text(message_id)],
        )?;
        let row = sqlx::raw_sql(AssertSqlSafe(still))
            .fetch_one(&self.pool)
            .await
            .map_err(db_error)?;
        let committed: bool = row.try_get(0).map_err(db_error)?;
        if !committed {
            return Err(db_error(failure).into());
        }
        let look = fill(LOOK, &[Lit::Text(consumer), Lit::Text(message_id)])?;
        let row = sqlx::raw_sql(AssertSqlSafe(look))
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        match row.as_ref().map(lease_left).transpose()?.flatten() {
            Some(left) => Err(InboxError::InProgress {
                retry_after: left.max(Duration::from_millis(1)),
            }),
            None => Ok(Delivery::Duplicate),
        }
    }

    /// Deletes the IDs processed more than `age` ago, at most `batch_size` per statement,
    /// until none are left, and then the failure counts of messages last failed more than
    /// `age` ago and not parked (a [`Consumer`]'s; dead letters are kept). Returns how many
    /// IDs were deleted.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the database fails.
    pub async fn purge_older_than(
        &self,
        age: Duration,
        batch_size: usize,
    ) -> Result<u64, StoreError> {
        let batch = i64::try_from(batch_size.max(1)).unwrap_or(i64::MAX);
        let mut deleted = 0;
        loop {
            let purge = fill(PURGE, &[Lit::Int(millis(age)), Lit::Int(batch)])?;
            let done = sqlx::raw_sql(AssertSqlSafe(purge))
                .execute(&self.pool)
                .await
                .map_err(db_error)?;
            deleted += done.rows_affected();
            if done.rows_affected() < batch.unsigned_abs() {
                break;
            }
        }
        dead::purge_failures(self, millis(age), batch).await?;
        Ok(deleted)
    }
}
