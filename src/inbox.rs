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
//!   again.
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

use sqlx::{PgConnection, PgPool};

use crate::error::StoreError;
use crate::store::postgres::{db_error, migrate, millis};

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
    /// The database failed (begin, insert or commit); the transaction was rolled back.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The message ID is empty or longer than 1024 bytes.
    #[error("message IDs must be 1 to 1024 bytes long")]
    InvalidMessageId,
}

/// The processed-message table of a consumer group, in Postgres. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Inbox {
    pool: PgPool,
}

const MAX_MESSAGE_ID: usize = 1024;

const RECORD: &str = "
INSERT INTO tower_idempotency_processed_messages (consumer, message_id)
VALUES ($1, $2)
ON CONFLICT (consumer, message_id) DO NOTHING";

const PURGE: &str = "
DELETE FROM tower_idempotency_processed_messages
 WHERE (consumer, message_id) IN (
       SELECT consumer, message_id FROM tower_idempotency_processed_messages
        WHERE processed_at < now() - $1::float8 * interval '1 millisecond'
        LIMIT $2
          FOR UPDATE SKIP LOCKED)";

impl Inbox {
    /// An inbox on `pool`. Run [`migrate`](Inbox::migrate) (or
    /// [`PostgresStore::migrate`](crate::PostgresStore::migrate): the same migrations) first.
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
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
    /// [`InboxError::Work`] when `work` fails, [`InboxError::Store`] when the database does;
    /// either way nothing was committed, so do not acknowledge: let the broker redeliver.
    pub async fn process<T, E, F>(
        &self,
        consumer: &str,
        message_id: &str,
        work: F,
    ) -> Result<Delivery<T>, InboxError<E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        if message_id.is_empty() || message_id.len() > MAX_MESSAGE_ID {
            return Err(InboxError::InvalidMessageId);
        }
        let mut tx = self.pool.begin().await.map_err(db_error)?;
        // Waits only if another transaction inserted the same ID and has not ended yet.
        let recorded = sqlx::query(RECORD)
            .bind(consumer)
            .bind(message_id)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        if recorded.rows_affected() == 0 {
            tx.rollback().await.map_err(db_error)?;
            return Ok(Delivery::Duplicate);
        }
        // On error the transaction is dropped, which rolls it back.
        let out = work(&mut tx).await.map_err(InboxError::Work)?;
        tx.commit().await.map_err(db_error)?;
        Ok(Delivery::Processed(out))
    }

    /// Deletes the IDs processed more than `age` ago, at most `batch_size` per statement,
    /// until none are left. Returns how many were deleted.
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
            let done = sqlx::query(PURGE)
                .bind(millis(age))
                .bind(batch)
                .execute(&self.pool)
                .await
                .map_err(db_error)?;
            deleted += done.rows_affected();
            if done.rows_affected() < batch.unsigned_abs() {
                return Ok(deleted);
            }
        }
    }
}
