//! Failed attempts and parked messages (dead letters).
//!
//! Each failed attempt of a message's work is counted in
//! `tower_idempotency_message_failures`, in a statement of its own after the work's
//! transaction rolled back (a crash in between loses one count: the message is then tried
//! once more, never once less). A message whose work failed as often as the consumer allows
//! is parked: in one transaction its claim becomes a processed message and its failure row
//! gets `parked_at` and the payload, so it is acknowledged, never applied, and kept for a
//! person to look at ([`Inbox::dead_letters`]).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::{AssertSqlSafe, Row};

use super::{Inbox, InboxError, MessageLease};
use crate::error::StoreError;
use crate::store::postgres::db_error;
use crate::store::sql::{Lit, fill};

/// The longest reason kept, in bytes; a longer one is cut at a character boundary.
const MAX_REASON: usize = 2048;

/// Counts a failed attempt and keeps its reason; returns the attempts so far.
const FAIL: &str = "
INSERT INTO tower_idempotency_message_failures AS f (consumer, message_id, attempts, reason)
VALUES ($1, $2, 1, $3)
ON CONFLICT (consumer, message_id) DO UPDATE
   SET attempts = f.attempts + 1, reason = EXCLUDED.reason,
       last_failed_at = tower_idempotency_now()
RETURNING attempts";

/// Records a parked message's ID as processed, unless it is recorded.
const RECORD_PARKED: &str = "
INSERT INTO tower_idempotency_processed_messages (consumer, message_id)
VALUES ($1, $2)
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING true AS recorded";

/// Parks the message, in the transaction that records it as processed.
const PARK: &str = "
UPDATE tower_idempotency_message_failures
   SET parked_at = tower_idempotency_now(), payload = $3
 WHERE consumer = $1 AND message_id = $2";

/// Deletes up to `$2` failure counts last updated more than `$1` ms ago, of messages that
/// were not parked (dead letters stay until someone removes them).
const PURGE_FAILURES: &str = "
DELETE FROM tower_idempotency_message_failures
 WHERE ctid = ANY (ARRAY(
       SELECT ctid FROM tower_idempotency_message_failures
        WHERE parked_at IS NULL
          AND last_failed_at < tower_idempotency_now() - $1::float8 * interval '1 millisecond'
        LIMIT $2
          FOR UPDATE SKIP LOCKED))";

/// The consumer's parked messages, oldest first.
const DEAD_LETTERS: &str = "
SELECT message_id, attempts, reason, payload,
       (extract(epoch FROM parked_at) * 1000)::bigint AS parked_at_ms
  FROM tower_idempotency_message_failures
 WHERE consumer = $1 AND parked_at IS NOT NULL
 ORDER BY parked_at, message_id
 LIMIT $2";

/// A parked message ([`Inbox::dead_letters`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The message's ID.
    pub message_id: String,
    /// How many attempts of its work failed.
    pub attempts: u32,
    /// The last attempt's reason.
    pub reason: String,
    /// The message's payload, when the consumer gave it.
    pub payload: Option<Vec<u8>>,
    /// When it was parked, by the database's clock.
    pub parked_at: SystemTime,
}

/// `reason`, cut to [`MAX_REASON`] bytes at a character boundary.
pub(super) fn bounded(reason: &str) -> &str {
    if reason.len() <= MAX_REASON {
        return reason;
    }
    let mut end = MAX_REASON;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

/// Counts a failed attempt of the message's work; returns the attempts so far.
pub(super) async fn record_failure(
    inbox: &Inbox,
    consumer: &str,
    message_id: &str,
    reason: &str,
) -> Result<u32, StoreError> {
    let sql = fill(
        FAIL,
        &[
            Lit::Text(consumer),
            Lit::Text(message_id),
            Lit::Text(bounded(reason)),
        ],
    )?;
    let row = sqlx::raw_sql(AssertSqlSafe(sql))
        .fetch_one(&inbox.pool)
        .await
        .map_err(db_error)?;
    let attempts: i32 = row.try_get("attempts").map_err(db_error)?;
    Ok(attempts.unsigned_abs())
}

/// Parks a message nobody holds: records its ID as processed and its failure row as parked,
/// in one commit. `false` when the ID was recorded meanwhile (another delivery processed or
/// claimed it): nothing is parked.
pub(super) async fn park_unclaimed(
    inbox: &Inbox,
    consumer: &str,
    message_id: &str,
    payload: Option<&[u8]>,
) -> Result<bool, StoreError> {
    let mut tx = super::begin(&inbox.pool).await.map_err(db_error)?;
    let sql = fill(RECORD_PARKED, &[Lit::Text(consumer), Lit::Text(message_id)])?;
    let recorded = sqlx::raw_sql(AssertSqlSafe(sql))
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error)?;
    if recorded.is_none() {
        tx.rollback().await.map_err(db_error)?;
        return Ok(false);
    }
    mark_parked(&mut tx, consumer, message_id, payload).await?;
    tx.commit().await.map_err(db_error)?;
    Ok(true)
}

/// Marks the failure row of the message parked, with `payload`, in `tx`.
async fn mark_parked(
    tx: &mut sqlx::PgConnection,
    consumer: &str,
    message_id: &str,
    payload: Option<&[u8]>,
) -> Result<(), StoreError> {
    let sql = fill(
        PARK,
        &[
            Lit::Text(consumer),
            Lit::Text(message_id),
            Lit::MaybeBytes(payload),
        ],
    )?;
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    Ok(())
}

/// Parks the leased message: records it as processed and its failure row as parked, with
/// `payload`, in one commit.
pub(super) async fn park<E>(
    mut lease: MessageLease,
    payload: Option<&[u8]>,
) -> Result<(), InboxError<E>> {
    let (mut tx, _) = lease.finish().await?;
    lease.ended();
    mark_parked(&mut tx, lease.consumer(), lease.message_id(), payload).await?;
    tx.commit().await.map_err(db_error)?;
    Ok(())
}

/// Deletes the failure counts of messages not parked and last failed more than `age_ms` ago,
/// `batch` per statement; returns how many.
pub(super) async fn purge_failures(
    inbox: &Inbox,
    age_ms: i64,
    batch: i64,
) -> Result<u64, StoreError> {
    let mut deleted = 0;
    loop {
        let sql = fill(PURGE_FAILURES, &[Lit::Int(age_ms), Lit::Int(batch)])?;
        let done = sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&inbox.pool)
            .await
            .map_err(db_error)?;
        deleted += done.rows_affected();
        if done.rows_affected() < batch.unsigned_abs() {
            return Ok(deleted);
        }
    }
}

impl Inbox {
    /// Up to `limit` messages `consumer` parked (their work failed as often as its
    /// [`Consumer`](super::Consumer) allows), oldest first: the consumer's dead letters.
    /// Their IDs are recorded as processed, so a redelivery is a duplicate; to apply one
    /// after fixing its cause, publish it again under a new ID.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the database fails.
    pub async fn dead_letters(
        &self,
        consumer: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let sql = fill(DEAD_LETTERS, &[Lit::Text(consumer), Lit::Int(limit)])?;
        let rows = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        rows.iter()
            .map(|row| {
                let attempts: i32 = row.try_get("attempts")?;
                let parked_at: i64 = row.try_get("parked_at_ms")?;
                Ok(DeadLetter {
                    message_id: row.try_get("message_id")?,
                    attempts: attempts.unsigned_abs(),
                    reason: row.try_get("reason")?,
                    payload: row.try_get("payload")?,
                    parked_at: UNIX_EPOCH + Duration::from_millis(parked_at.unsigned_abs()),
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(db_error)
    }
}
