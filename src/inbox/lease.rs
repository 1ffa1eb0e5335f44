//! Leased claims of messages, for work that calls out ([`Inbox::claim`]).

use std::time::Duration;

use sqlx::{AssertSqlSafe, PgConnection, Row};

use super::order::{ADVANCE_ATTEMPTS, check_key, raced};
use super::{
    Inbox, InboxError, LOOK, MAX_MESSAGE_ID, Ordered, commit_unless_finish_undone, lease_left,
};
use crate::error::StoreError;
use crate::store::postgres::sqlstate::{SERIALIZATION_FAILURE, sqlstate_is};
use crate::store::postgres::{db_error, millis};
use crate::store::sql::{Lit, fill};

/// What [`Inbox::claim`] found.
#[derive(Debug)]
#[must_use]
pub enum Claim {
    /// This worker holds the message now: do its remote work, then
    /// [`commit`](MessageLease::commit) its database work with the message's ID.
    Acquired(MessageLease),
    /// The message was processed before: acknowledge it, and do nothing.
    Duplicate,
    /// Another worker holds the message under a lease that has not run out: do not work on it
    /// and do not acknowledge it; ask the broker to deliver it again after `retry_after`
    /// (JetStream: `nak` with that delay; RabbitMQ: reject and requeue after it).
    InProgress {
        /// How long until the other worker's lease runs out.
        retry_after: Duration,
    },
}

/// A message claimed with a lease ([`Inbox::claim`]). While it is held, a redelivery of the
/// message is told [`Claim::InProgress`], and no connection is held.
///
/// End it with [`commit`](Self::commit) (the work and the ID commit together) or
/// [`release`](Self::release) (the next delivery works on it at once). Dropped without
/// either, it is released in the background.
#[derive(Debug)]
pub struct MessageLease {
    inbox: Inbox,
    consumer: String,
    message_id: String,
    token: i64,
    lease: Duration,
    /// The ordering key's applied position as the claim read it ([`Inbox::claim_at`]).
    applied: Option<i64>,
    ended: bool,
}

/// The upsert of a claim, without its `RETURNING`: a new row with a token and the lease's
/// end, or a row whose lease ran out (a worker that died) taken over. `$1` consumer, `$2`
/// message ID, `$3` lease (ms).
macro_rules! claim_upsert {
    () => {
        "
INSERT INTO tower_idempotency_processed_messages AS m
       (consumer, message_id, lease_token, lease_expires_at)
VALUES ($1, $2, nextval('tower_idempotency_lease_token_seq'),
        tower_idempotency_now() + $3::float8 * interval '1 millisecond')
ON CONFLICT (consumer, message_id) DO UPDATE
   SET lease_token = EXCLUDED.lease_token, lease_expires_at = EXCLUDED.lease_expires_at,
       processed_at = tower_idempotency_now()
 WHERE m.lease_token IS NOT NULL AND m.lease_expires_at <= tower_idempotency_now()
"
    };
}

/// Claims a message ([`claim_upsert`]). Returns the token, or no row when the message is
/// processed or held.
const CLAIM: &str = concat!(claim_upsert!(), "RETURNING m.lease_token AS token");

/// As [`CLAIM`], and the ordering key `$4`'s applied position read in the same statement.
const CLAIM_AT: &str = concat!(
    claim_upsert!(),
    "RETURNING m.lease_token AS token,
          (SELECT p.position FROM tower_idempotency_positions AS p
            WHERE p.consumer = $1 AND p.key = $4) AS position"
);

/// As [`FINISH`], and the ordering key `$4`'s position moved to `$5` if it is below it, in
/// one statement: `finished` is 0 when the lease was lost (nothing moved), `advanced` 0 when
/// the message is stale. The key's row is locked either way.
const FINISH_AT: &str = "
WITH finished AS (
    UPDATE tower_idempotency_processed_messages
       SET lease_token = NULL, lease_expires_at = NULL, processed_at = tower_idempotency_now()
     WHERE consumer = $1 AND message_id = $2 AND lease_token = $3
    RETURNING xmin::text AS xid),
advanced AS (
    INSERT INTO tower_idempotency_positions AS p (consumer, key, position)
    SELECT $1, $4, $5 FROM finished
    ON CONFLICT (consumer, key) DO UPDATE
       SET position = EXCLUDED.position, updated_at = tower_idempotency_now()
     WHERE p.position < EXCLUDED.position
    RETURNING 1)
SELECT (SELECT count(*) FROM finished) AS finished, (SELECT count(*) FROM advanced) AS advanced,
       (SELECT xid FROM finished) AS xid";

/// Extends the lease the token holds.
const RENEW: &str = "
UPDATE tower_idempotency_processed_messages
   SET lease_expires_at = tower_idempotency_now() + $4::float8 * interval '1 millisecond'
 WHERE consumer = $1 AND message_id = $2 AND lease_token = $3";

/// Gives the message back.
const RELEASE: &str = "
DELETE FROM tower_idempotency_processed_messages
 WHERE consumer = $1 AND message_id = $2 AND lease_token = $3";

/// Turns the claim into a processed message, inside the work's transaction (its first
/// statement: it locks the row, so no takeover can commit before the work does). Returns the
/// new version's `xmin`, the transaction's ID, for the check before the commit
/// ([`commit_unless_finish_undone`]); no row when the lease was lost.
const FINISH: &str = "
UPDATE tower_idempotency_processed_messages
   SET lease_token = NULL, lease_expires_at = NULL, processed_at = tower_idempotency_now()
 WHERE consumer = $1 AND message_id = $2 AND lease_token = $3
RETURNING xmin::text AS xid";

/// How often a claim that lost a race (the row changed between two statements) is tried
/// again before the message counts as held.
const CLAIM_ATTEMPTS: usize = 4;

impl Inbox {
    /// Claims `message_id` for `consumer` with a lease, committed at once, for work that
    /// calls out (a payment provider, another service): the remote call runs with no
    /// transaction open, and the database work commits with the ID afterwards
    /// ([`MessageLease::commit`]).
    ///
    /// A redelivery while the lease holds is told [`Claim::InProgress`], so it does not start
    /// the same work a second time; once the lease runs out (the worker died), the next
    /// delivery takes the message over. The work's remote calls must carry a key derived
    /// from the message ID, since a takeover runs them again.
    ///
    /// # Errors
    ///
    /// [`InboxError::InvalidMessageId`], or [`InboxError::Store`] when the database fails.
    pub async fn claim<E>(
        &self,
        consumer: &str,
        message_id: &str,
        lease: Duration,
    ) -> Result<Claim, InboxError<E>> {
        self.claim_at(consumer, message_id, lease, None).await
    }

    /// As [`claim`](Self::claim), and with `order_key` the key's applied position read in the
    /// same statement ([`MessageLease::applied`]).
    pub(super) async fn claim_at<E>(
        &self,
        consumer: &str,
        message_id: &str,
        lease: Duration,
        order_key: Option<&str>,
    ) -> Result<Claim, InboxError<E>> {
        if message_id.is_empty() || message_id.len() > MAX_MESSAGE_ID {
            return Err(InboxError::InvalidMessageId);
        }
        let key = [Lit::Text(consumer), Lit::Text(message_id)];
        let claim = match order_key {
            None => fill(CLAIM, &[key[0], key[1], Lit::Int(millis(lease))])?,
            Some(order_key) => fill(
                CLAIM_AT,
                &[
                    key[0],
                    key[1],
                    Lit::Int(millis(lease)),
                    Lit::Text(order_key),
                ],
            )?,
        };
        let look = fill(LOOK, &key)?;
        for _ in 0..CLAIM_ATTEMPTS {
            // One statement each, over the simple protocol (pooler-safe); a fresh snapshot each.
            let claimed = sqlx::raw_sql(AssertSqlSafe(claim.as_str()))
                .fetch_optional(&self.pool)
                .await;
            match claimed {
                Ok(Some(row)) => {
                    return Ok(Claim::Acquired(MessageLease {
                        inbox: self.clone(),
                        consumer: consumer.to_owned(),
                        message_id: message_id.to_owned(),
                        token: row.try_get("token").map_err(db_error)?,
                        lease,
                        applied: match order_key {
                            Some(_) => row.try_get("position").map_err(db_error)?,
                            None => None,
                        },
                        ended: false,
                    }));
                }
                Ok(None) => {}
                // REPEATABLE READ or SERIALIZABLE by default: a row committed after the
                // statement's snapshot. Look again with a new one.
                Err(e) if sqlstate_is(&e, SERIALIZATION_FAILURE) => continue,
                Err(e) => return Err(db_error(e).into()),
            }
            let row = sqlx::raw_sql(AssertSqlSafe(look.as_str()))
                .fetch_optional(&self.pool)
                .await
                .map_err(db_error)?;
            match row.as_ref().map(lease_left).transpose()? {
                // Released or purged between the two statements: claim again.
                None => {}
                Some(None) => return Ok(Claim::Duplicate),
                Some(Some(left)) if !left.is_zero() => {
                    return Ok(Claim::InProgress { retry_after: left });
                }
                // The lease ran out between the two statements: take it over.
                Some(Some(_)) => {}
            }
        }
        Ok(Claim::InProgress {
            retry_after: Duration::from_secs(1),
        })
    }
}

impl MessageLease {
    /// The message's ID.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    /// The ordering key's applied position as the claim read it, when the claim was made
    /// for an ordered message.
    pub(super) fn applied(&self) -> Option<i64> {
        self.applied
    }

    /// The lease's length, as claimed.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    fn args(&self) -> [Lit<'_>; 3] {
        [
            Lit::Text(&self.consumer),
            Lit::Text(&self.message_id),
            Lit::Int(self.token),
        ]
    }

    /// Extends the lease to its length from now, for work that outlasts it. Returns `false`
    /// when the lease was lost (another worker took the message over): stop, the other
    /// worker's result is the one that commits.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the database fails.
    pub async fn renew(&self) -> Result<bool, StoreError> {
        let [consumer, id, token] = self.args();
        let sql = fill(RENEW, &[consumer, id, token, Lit::Int(millis(self.lease))])?;
        let done = sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.inbox.pool)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }

    /// Gives the message back: the next delivery works on it at once.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the database fails (the lease then frees it when it runs out).
    pub async fn release(mut self) -> Result<(), StoreError> {
        self.ended = true;
        let sql = fill(RELEASE, &self.args())?;
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.inbox.pool)
            .await
            .map_err(db_error)?;
        Ok(())
    }

    /// Runs `work` in a transaction that also records the message as processed, and commits
    /// both, while the lease still holds the message. Acknowledge the message after this
    /// returns `Ok`: it does only when the work's writes committed with the message's ID.
    /// Work that ended the transaction itself (a `ROLLBACK`) and returned `Ok` is
    /// [`InboxError::Aborted`], although the claim's row was committed before the work
    /// began.
    ///
    /// # Errors
    ///
    /// [`InboxError::LeaseLost`] when another worker took the message over (nothing ran),
    /// [`InboxError::Work`], [`InboxError::Aborted`] and [`InboxError::Store`] as in
    /// [`Inbox::process`]. In every case nothing was committed, and the lease is released
    /// (unless it was lost), so the redelivery works on the message at once: do not
    /// acknowledge.
    pub async fn commit<T, E, F>(self, work: F) -> Result<T, InboxError<E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        match self.end(None, work).await? {
            Ordered::Applied(out) => Ok(out),
            // Cannot happen: without a position the work always runs. Answered as a
            // commit that did not happen rather than a panic.
            Ordered::Stale => Err(InboxError::Aborted),
        }
    }

    /// As [`commit`](Self::commit), in order: the message is at `position` of the ordering
    /// key `key` (an account, an entity; see [`Ordered`]). When the consumer applied that
    /// position or a later one of the key before, the work does not run, the message is
    /// recorded as processed (a redelivery is a `Duplicate`), and this is
    /// [`Ordered::Stale`]; else the work runs and the key's position moves to `position`, in
    /// one commit with the work and the message's ID. Acknowledge the message after this
    /// returns `Ok` (either variant).
    ///
    /// # Errors
    ///
    /// [`InboxError::InvalidOrderKey`], and as [`commit`](Self::commit).
    pub async fn commit_in_order<T, E, F>(
        self,
        key: &str,
        position: i64,
        work: F,
    ) -> Result<Ordered<T>, InboxError<E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        check_key(key)?;
        self.end(Some((key, position)), work).await
    }

    /// Commits, and ends the lease unless the commit failed otherwise than by losing it: then
    /// the drop releases it in the background.
    async fn end<T, E, F>(
        mut self,
        order: Option<(&str, i64)>,
        work: F,
    ) -> Result<Ordered<T>, InboxError<E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        self.commit_keeping(order, work).await
    }

    async fn commit_inner<T, E, F>(
        &self,
        order: Option<(&str, i64)>,
        work: F,
    ) -> Result<Ordered<T>, InboxError<E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        let mut attempts = 0;
        let (mut tx, xid) = loop {
            let Some((key, position)) = order else {
                break self.finish().await?;
            };
            let mut tx = super::begin(&self.inbox.pool).await.map_err(db_error)?;
            let [consumer, id, token] = self.args();
            let sql = fill(
                FINISH_AT,
                &[consumer, id, token, Lit::Text(key), Lit::Int(position)],
            )?;
            match sqlx::raw_sql(AssertSqlSafe(sql)).fetch_one(&mut *tx).await {
                Ok(row) => {
                    let finished: i64 = row.try_get("finished").map_err(db_error)?;
                    let advanced: i64 = row.try_get("advanced").map_err(db_error)?;
                    if finished != 1 {
                        // Dropped: rolled back.
                        return Err(InboxError::LeaseLost);
                    }
                    if advanced == 1 {
                        let xid: String = row.try_get("xid").map_err(db_error)?;
                        break (tx, xid);
                    }
                    // Recorded as processed: a redelivery is a duplicate.
                    tx.commit().await.map_err(db_error)?;
                    return Ok(Ordered::Stale);
                }
                // REPEATABLE READ or SERIALIZABLE: another delivery of the key moved its
                // position after this transaction's snapshot. The finish rolls back with it
                // (the claim is still held) and the work has not run: begin again.
                Err(e) if sqlstate_is(&e, SERIALIZATION_FAILURE) => {
                    tx.rollback().await.map_err(db_error)?;
                    attempts += 1;
                    if attempts >= ADVANCE_ATTEMPTS {
                        return Err(InboxError::Store(raced()));
                    }
                }
                Err(e) => return Err(db_error(e).into()),
            }
        };
        let out = work(&mut tx).await.map_err(InboxError::Work)?;
        commit_unless_finish_undone(tx, &self.consumer, &self.message_id, &xid).await?;
        Ok(Ordered::Applied(out))
    }

    /// Opens a transaction whose first statement turns the claim into a processed message
    /// (and locks its row), or [`InboxError::LeaseLost`]. Returns the transaction and its ID,
    /// as the finished row's `xmin`.
    pub(super) async fn finish<E>(
        &self,
    ) -> Result<(sqlx::Transaction<'static, sqlx::Postgres>, String), InboxError<E>> {
        let mut tx = super::begin(&self.inbox.pool).await.map_err(db_error)?;
        // Over the simple protocol: one round trip (see `commit_unless_aborted_by`).
        let sql = fill(FINISH, &self.args())?;
        let finished = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error)?;
        let Some(row) = finished else {
            return Err(InboxError::LeaseLost);
        };
        let xid: String = row.try_get("xid").map_err(db_error)?;
        Ok((tx, xid))
    }

    /// As [`commit_in_order`](Self::commit_in_order) (`order` given) or
    /// [`commit`](Self::commit), keeping the lease when the work fails, so that the caller
    /// can count the failure under it.
    pub(super) async fn commit_keeping<T, E, F>(
        &mut self,
        order: Option<(&str, i64)>,
        work: F,
    ) -> Result<Ordered<T>, InboxError<E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        let outcome = self.commit_inner(order, work).await;
        if matches!(outcome, Ok(_) | Err(InboxError::LeaseLost)) {
            self.ended = true;
        }
        outcome
    }

    /// Marks the lease as ended: its drop releases nothing.
    pub(super) fn ended(&mut self) {
        self.ended = true;
    }

    /// The consumer the message was claimed for.
    pub(super) fn consumer(&self) -> &str {
        &self.consumer
    }
}

impl Drop for MessageLease {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // The lease frees the message when it runs out.
            return;
        };
        let Ok(sql) = fill(RELEASE, &self.args()) else {
            return;
        };
        let pool = self.inbox.pool.clone();
        runtime.spawn(async move {
            if let Err(e) = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&pool).await {
                tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "could not release a message lease; it frees the message when it runs out"
                );
            }
        });
    }
}
