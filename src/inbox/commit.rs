//! How the work's transaction ends: committed only while the message's ID is still in it, and
//! a leased claim whose lease ran out taken over inside it.

use std::time::Duration;

use sqlx::{AssertSqlSafe, PgConnection, Row};

use super::*;

/// Takes over a leased claim whose lease ran out (its worker died), in the transaction of
/// [`Inbox::process`].
const TAKE_OVER: &str = "
UPDATE tower_idempotency_processed_messages
   SET lease_token = NULL, lease_expires_at = NULL, processed_at = tower_idempotency_now()
 WHERE consumer = $1 AND message_id = $2
   AND lease_token IS NOT NULL AND lease_expires_at <= tower_idempotency_now()";

/// When the ID was not recorded because a row holds it: `true` when that row was a leased
/// claim whose lease ran out, now taken over in `tx`; [`InboxError::InProgress`] when its
/// lease still holds; `false` when the message was processed.
pub(super) async fn take_over_an_expired_claim<E>(
    tx: &mut PgConnection,
    consumer: &str,
    message_id: &str,
) -> Result<bool, InboxError<E>> {
    let key = [Lit::Text(consumer), Lit::Text(message_id)];
    let look = fill(LOOK, &key)?;
    let row = sqlx::raw_sql(AssertSqlSafe(look))
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error)?;
    let Some(left) = row.as_ref().map(lease_left).transpose()?.flatten() else {
        return Ok(false);
    };
    if !left.is_zero() {
        return Err(InboxError::InProgress { retry_after: left });
    }
    let take = fill(TAKE_OVER, &key)?;
    let taken = sqlx::raw_sql(AssertSqlSafe(take))
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    if taken.rows_affected() == 1 {
        Ok(true)
    } else {
        Err(InboxError::InProgress {
            retry_after: Duration::from_secs(1),
        })
    }
}

/// Commits the work's transaction of [`Inbox::process`] if the message's ID is still recorded
/// as processed in it; else (the work swallowed a failed statement, which aborted the
/// transaction, or ended the transaction itself) drops it, which rolls it back, and answers
/// [`InboxError::Aborted`].
pub(super) async fn commit_unless_aborted<E>(
    tx: sqlx::Transaction<'_, sqlx::Postgres>,
    consumer: &str,
    message_id: &str,
) -> Result<(), InboxError<E>> {
    let check = fill(
        STILL_PROCESSED,
        &[Lit::Text(consumer), Lit::Text(message_id)],
    )?;
    commit_unless_aborted_by(tx, check).await
}

/// Whether the claim's row is processed and its current version was written by transaction
/// `$3` (its `xmin`, as the statement that finished the claim returned it).
const STILL_FINISHED: &str = "
SELECT EXISTS (SELECT 1 FROM tower_idempotency_processed_messages
                WHERE consumer = $1 AND message_id = $2 AND lease_token IS NULL
                  AND xmin = $3::xid)";

/// Commits the work's transaction of [`MessageLease::commit`] if the finish of the claim
/// (written by transaction `xid`) is still the row's current version; else rolls it back
/// and answers [`InboxError::Aborted`].
///
/// The claim's row was committed when the message was claimed, so asking whether the row
/// exists says nothing about the work's transaction: after work that rolled it back, the
/// check runs in a transaction of its own and finds the claim. Nor is "processed" enough:
/// the lease may have run out meanwhile, and another worker finished the claim in a
/// transaction of its own. Only the version written by this transaction's finish tells
/// that the finish, and the work with it, is still there: uncommitted in it, or (work that
/// committed the transaction itself) committed with the work.
pub(super) async fn commit_unless_finish_undone<E>(
    tx: sqlx::Transaction<'_, sqlx::Postgres>,
    consumer: &str,
    message_id: &str,
    xid: &str,
) -> Result<(), InboxError<E>> {
    let check = fill(
        STILL_FINISHED,
        &[Lit::Text(consumer), Lit::Text(message_id), Lit::Text(xid)],
    )?;
    commit_unless_aborted_by(tx, check).await
}

/// Commits the work's transaction if `check` (a statement answering one `bool`: whether what
/// the transaction wrote before the work is still in it) says so; else rolls it back and
/// answers [`InboxError::Aborted`], as [`commit_unless_aborted`].
///
/// The check goes over the simple protocol, its values written into it (`fill`): one round
/// trip, where an unnamed bound statement takes two (sqlx describes it before it binds), and
/// no named statement that a transaction pooler would strand on its server connection.
pub(super) async fn commit_unless_aborted_by<E>(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    check: String,
) -> Result<(), InboxError<E>> {
    let pending = match sqlx::raw_sql(AssertSqlSafe(check))
        .fetch_one(&mut *tx)
        .await
    {
        Ok(row) => row.try_get::<bool, _>(0).map_err(db_error)?,
        Err(err) if sqlstate_is(&err, IN_FAILED_TRANSACTION) => false,
        Err(err) => return Err(db_error(err).into()),
    };
    if !pending {
        return Err(InboxError::Aborted);
    }
    tx.commit().await.map_err(db_error)?;
    Ok(())
}
