//! Positions: applying each ordering key's messages in order, and where to resume.
//!
//! A consumer keeps, per ordering key (an account, an entity, a partition), the last position
//! it applied: a producer's per-key sequence, a stream sequence, a partition's offset. The
//! work's transaction moves it forward together with the work's writes, and only forward, so a
//! message at or below it is [`Ordered::Stale`] and its work never runs. The row of the key is
//! locked by the move, so two deliveries of one key never apply out of order: the second one
//! waits for the first's commit and then sees the new position.
//!
//! Where the broker itself orders a partition (a Kafka partition, a JetStream stream read by
//! one worker), [`Inbox::process_in_order`] keeps no message IDs at all: the position is the
//! whole record, one row per partition, and [`Inbox::position`] says where to resume when the
//! partition is assigned.

use sqlx::{AssertSqlSafe, PgConnection, Row};

use super::{Inbox, InboxError, MAX_MESSAGE_ID, commit_unless_aborted_by};
use crate::error::StoreError;
use crate::store::postgres::db_error;
use crate::store::postgres::sqlstate::{SERIALIZATION_FAILURE, sqlstate_is};
use crate::store::sql::{Lit, fill};

/// Whether a message in order was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Ordered<T> {
    /// The message was past its key's position: the work ran and committed, and the position
    /// moved to the message's.
    Applied(T),
    /// The message was at or below its key's position (applied before, or overtaken by a
    /// later one): the work did not run. Acknowledge it.
    Stale,
}

/// The longest ordering key, in bytes.
pub(super) const MAX_ORDER_KEY: usize = MAX_MESSAGE_ID;

/// The position of a key.
const POSITION: &str = "
SELECT position FROM tower_idempotency_positions WHERE consumer = $1 AND key = $2";

/// Moves the key's position to `$3` if it is below it, and locks the key's row either way
/// (a conflicting row is locked even when the update's condition fails). Returns a row when
/// it moved.
pub(super) const ADVANCE: &str = "
INSERT INTO tower_idempotency_positions AS p (consumer, key, position)
VALUES ($1, $2, $3)
ON CONFLICT (consumer, key) DO UPDATE
   SET position = EXCLUDED.position, updated_at = tower_idempotency_now()
 WHERE p.position < EXCLUDED.position
RETURNING true AS advanced";

/// Whether the key's position is the message's, as the transaction sees it: the check before
/// the commit that the work left the transaction usable.
const STILL_ADVANCED: &str = "
SELECT EXISTS (SELECT 1 FROM tower_idempotency_positions
                WHERE consumer = $1 AND key = $2 AND position = $3)";

/// What [`advance_in`] found.
pub(super) enum Moved {
    /// The position moved: go on with the work in the transaction.
    Go(sqlx::Transaction<'static, sqlx::Postgres>),
    /// The message is stale: the transaction is left to the caller (to commit what it
    /// recorded before, or roll back).
    Stale(sqlx::Transaction<'static, sqlx::Postgres>),
    /// A race lost under `REPEATABLE READ` or `SERIALIZABLE`: rolled back; begin again.
    Again,
}

/// Moves the key's position in `tx` ([`advance`]), counting lost races in `attempts` and
/// failing after [`ADVANCE_ATTEMPTS`] of them.
pub(super) async fn advance_in<E>(
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    consumer: &str,
    (key, position): (&str, i64),
    attempts: &mut usize,
) -> Result<Moved, InboxError<E>> {
    match advance(&mut tx, consumer, key, position).await? {
        Advance::Moved => Ok(Moved::Go(tx)),
        Advance::Stale => Ok(Moved::Stale(tx)),
        Advance::Raced if *attempts + 1 < ADVANCE_ATTEMPTS => {
            *attempts += 1;
            tx.rollback().await.map_err(db_error)?;
            Ok(Moved::Again)
        }
        Advance::Raced => Err(InboxError::Store(raced())),
    }
}

/// The error after [`ADVANCE_ATTEMPTS`] lost races.
pub(super) fn raced() -> StoreError {
    StoreError::backend(format!(
        "the position's row was moved by concurrent transactions {ADVANCE_ATTEMPTS} times \
         in a row (serialization failures)"
    ))
}

/// Refuses an ordering key that is empty or too long.
pub(super) fn check_key<E>(key: &str) -> Result<(), InboxError<E>> {
    if key.is_empty() || key.len() > MAX_ORDER_KEY {
        return Err(InboxError::InvalidOrderKey);
    }
    Ok(())
}

/// How often a transaction whose move of a position lost a race under `REPEATABLE READ` or
/// `SERIALIZABLE` is begun again (the work has not run yet) before the failure is returned.
/// Each lost race means another delivery of the key committed, so with fewer than this many
/// deliveries of one key at once every one of them ends.
pub(super) const ADVANCE_ATTEMPTS: usize = 32;

/// What [`advance`] found.
pub(super) enum Advance {
    /// The position moved to the message's.
    Moved,
    /// The position is at or past the message's.
    Stale,
    /// Under `REPEATABLE READ` or `SERIALIZABLE`, another transaction moved the position
    /// after this one's snapshot (SQLSTATE 40001): the transaction is aborted; begin it again.
    Raced,
}

/// Moves the key's position in `tx`, its first statement on the key.
pub(super) async fn advance(
    tx: &mut PgConnection,
    consumer: &str,
    key: &str,
    position: i64,
) -> Result<Advance, StoreError> {
    // Over the simple protocol: one round trip (see `commit_unless_aborted_by`).
    let sql = fill(
        ADVANCE,
        &[Lit::Text(consumer), Lit::Text(key), Lit::Int(position)],
    )?;
    let row = sqlx::raw_sql(AssertSqlSafe(sql))
        .fetch_optional(&mut *tx)
        .await;
    match row {
        Ok(Some(_)) => Ok(Advance::Moved),
        Ok(None) => Ok(Advance::Stale),
        Err(e) if sqlstate_is(&e, SERIALIZATION_FAILURE) => Ok(Advance::Raced),
        Err(e) => Err(db_error(e)),
    }
}

impl Inbox {
    /// The last position `consumer` applied for `key`, or `None` when it applied none: where
    /// to resume when a partition is assigned (seek to the next position), or what a
    /// projection has caught up to.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the database fails.
    pub async fn position(&self, consumer: &str, key: &str) -> Result<Option<i64>, StoreError> {
        let sql = fill(POSITION, &[Lit::Text(consumer), Lit::Text(key)])?;
        let row = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        row.map(|r| r.try_get::<i64, _>("position"))
            .transpose()
            .map_err(db_error)
    }

    /// Runs `work` for the message at `position` of `key` unless `consumer` applied that
    /// position (or a later one) before, moving the position in the same transaction as the
    /// work. No message ID is recorded: where the broker delivers each key's messages in
    /// order (a Kafka partition, a JetStream stream with one worker), the position alone
    /// tells a redelivery, in one row per key. Acknowledge (or commit the offset) after this
    /// returns `Ok`.
    ///
    /// A message that arrives after a later one of its key was applied is
    /// [`Ordered::Stale`] too: use [`Inbox::process`] (IDs) where a key's messages may arrive
    /// out of order and each must be applied.
    ///
    /// # Errors
    ///
    /// [`InboxError::InvalidOrderKey`], and as [`Inbox::process`]: nothing was committed, do
    /// not acknowledge.
    pub async fn process_in_order<T, E, F>(
        &self,
        consumer: &str,
        key: &str,
        position: i64,
        work: F,
    ) -> Result<Ordered<T>, InboxError<E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        check_key(key)?;
        let mut attempts = 0;
        let mut tx = loop {
            let tx = super::begin(&self.pool).await.map_err(db_error)?;
            match advance_in(tx, consumer, (key, position), &mut attempts).await? {
                Moved::Go(tx) => break tx,
                Moved::Stale(tx) => {
                    tx.rollback().await.map_err(db_error)?;
                    return Ok(Ordered::Stale);
                }
                Moved::Again => {}
            }
        };
        let out = work(&mut tx).await.map_err(InboxError::Work)?;
        let check = fill(
            STILL_ADVANCED,
            &[Lit::Text(consumer), Lit::Text(key), Lit::Int(position)],
        )?;
        commit_unless_aborted_by(tx, check).await?;
        Ok(Ordered::Applied(out))
    }
}
