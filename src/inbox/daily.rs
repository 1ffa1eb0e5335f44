//! The inbox in daily partitions: retention by dropping a day's partition, not by deleting
//! its rows.
//!
//! A purge deletes old IDs row by row: at tens of millions of messages a day that is as much
//! WAL as the inserts were, dead rows for vacuum to find, and a table that never shrinks.
//! [`DailyInbox`] keeps the IDs in `tower_idempotency_processed_messages_daily`, partitioned
//! by day, and [`DailyInbox::maintain`] detaches and drops whole days past the retention.
//!
//! **Why duplicates across partitions are still caught.** A partitioned table's primary key
//! must include the partition key, so it is unique within one partition only. The day is
//! therefore not the time the message is processed (a redelivery after midnight would land in
//! another partition and be applied again) but a function of the message itself: the UTC day
//! the producer first sent the logical message (`sent_at`), carried unchanged by every
//! delivery and every republish of it (a header the producer sets once with the ID, the
//! timestamp of a UUIDv7 ID). All deliveries of one message land in one partition, where the
//! primary key catches every duplicate at every isolation level, as the unpartitioned table's
//! does. A message whose day has no partition (older than the retention, so its ID may have
//! been dropped; or further ahead than the partitions made) is refused with
//! [`InboxError::OutsideRetention`] and never applied.
//!
//! **A day once dropped stays dropped.** `tower_idempotency_daily_floor` keeps the first day
//! that may still hold IDs. [`DailyInbox::maintain`] raises it to the first day of its
//! retention before it drops anything below, never lowers it, and never makes a partition
//! below it; every delivery reads it in the statement that records its ID and refuses a
//! message of a day below it, whatever partitions exist. So a longer retention set later, a
//! second instance with a longer one, or a database clock that jumped ahead and back cannot
//! make a dropped day again and apply its messages a second time: a raised retention keeps
//! the days from the floor on longer, and reaches its full length as they age.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};

use super::{Delivery, InboxError, MAX_MESSAGE_ID, commit_unless_aborted_by};
use crate::error::{ConfigError, StoreError};
use crate::store::postgres::sqlstate::{
    CHECK_VIOLATION, DUPLICATE_TABLE, INVALID_OBJECT_DEFINITION, SERIALIZATION_FAILURE, sqlstate_is,
};
use crate::store::postgres::{db_error, migrate, millis};
use crate::store::sql::{Lit, fill};

/// The partitioned table; each partition is this name and `_YYYYMMDD`.
const TABLE: &str = "tower_idempotency_processed_messages_daily";

/// Records the message's ID in its day's partition unless the day is below the floor,
/// waiting at most `$4` ms for a concurrent delivery of the same message; the work's own
/// `lock_timeout` is put back after. The floor is read in the statement that records, with
/// its snapshot: `recorded` (the ID is new, and this transaction's), and `dropped` (the day is
/// below the floor: nothing was recorded).
const RECORD: &str = "
SELECT set_config('tower_idempotency.lock_timeout', current_setting('lock_timeout'), true);
SELECT set_config('lock_timeout', $4::text || 'ms', true);
WITH floor AS (
    SELECT EXISTS (SELECT 1 FROM tower_idempotency_daily_floor
                    WHERE first_day > DATE '1970-01-01' + $3::integer) AS dropped),
inserted AS (
    INSERT INTO tower_idempotency_processed_messages_daily (consumer, message_id, day)
    SELECT $1, $2, DATE '1970-01-01' + $3::integer FROM floor WHERE NOT floor.dropped
    ON CONFLICT (consumer, message_id, day) DO NOTHING
    RETURNING 1)
SELECT (SELECT count(*) FROM inserted) = 1 AS recorded, (SELECT dropped FROM floor) AS dropped;
SELECT set_config('lock_timeout', current_setting('tower_idempotency.lock_timeout'), true)";

/// Whether the ID is recorded, as the statement's transaction sees it.
const STILL_RECORDED: &str = "
SELECT EXISTS (SELECT 1 FROM tower_idempotency_processed_messages_daily
                WHERE consumer = $1 AND message_id = $2 AND day = DATE '1970-01-01' + $3::integer)";

/// Today by the database's clock, as days since 1970-01-01 (UTC).
const TODAY: &str = "
SELECT ((tower_idempotency_now() AT TIME ZONE 'UTC')::date - DATE '1970-01-01') AS today";

/// Raises the floor to `$1` (days since 1970-01-01) unless it is higher; returns the floor,
/// as days since 1970-01-01. The row is locked until the statement commits, so of two
/// concurrent raises the later one returns the higher floor.
const RAISE_FLOOR: &str = "
INSERT INTO tower_idempotency_daily_floor AS f (only_row, first_day)
VALUES (true, DATE '1970-01-01' + $1::integer)
ON CONFLICT (only_row) DO UPDATE
   SET first_day = greatest(f.first_day, EXCLUDED.first_day)
RETURNING (f.first_day - DATE '1970-01-01') AS first_day";

/// How often a raise of the floor that lost a race with another instance's (a serialization
/// failure, at `REPEATABLE READ` or `SERIALIZABLE`) is tried again.
const RAISE_ATTEMPTS: usize = 4;

/// The partitions, and whether a detach of each is pending (an interrupted
/// `DETACH … CONCURRENTLY`).
const PARTITIONS: &str = "
SELECT c.relname::text AS name, i.inhdetachpending AS pending
  FROM pg_catalog.pg_inherits i
  JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'tower_idempotency_processed_messages_daily'::regclass";

/// The message IDs of a consumer group in daily partitions, for retention by dropping a
/// day's partition instead of deleting its rows. Cheap to clone.
///
/// **Why duplicates across partitions are still caught.** A partitioned table's primary key
/// must include the partition key, so it is unique within one partition only. The day is
/// therefore not the time the message is processed but a function of the message: the UTC
/// day its producer first sent it (`sent_at` of [`process`](Self::process)), which every
/// delivery and republish carries unchanged. All deliveries of one message land in one
/// partition, where the primary key catches every duplicate at every isolation level. A
/// message whose day has no partition (past the retention, or too far ahead) is refused with
/// [`InboxError::OutsideRetention`] and never applied.
#[derive(Clone, Debug)]
pub struct DailyInbox {
    pool: PgPool,
    retention_days: u32,
    ahead_days: u32,
    lock_timeout: Duration,
}

/// What [`DailyInbox::maintain`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Maintenance {
    /// The partitions created.
    pub created: Vec<String>,
    /// The partitions detached and dropped.
    pub dropped: Vec<String>,
}

/// The civil date (year, month, day) of `days` since 1970-01-01 (proleptic Gregorian).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    // In range by construction: 1 ≤ day ≤ 31, 1 ≤ month ≤ 12.
    (
        year,
        u32::try_from(month).unwrap_or(1),
        u32::try_from(day).unwrap_or(1),
    )
}

/// The partition of `days` since 1970-01-01.
fn partition_name(days: i64) -> String {
    let (y, m, d) = civil(days);
    format!("{TABLE}_{y:04}{m:02}{d:02}")
}

/// The day a partition's name says, as days since 1970-01-01; `None` for another name.
fn partition_day(name: &str) -> Option<i64> {
    let digits = name.strip_prefix(TABLE)?.strip_prefix('_')?;
    if digits.len() != 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (y, m, d) = (
        digits[..4].parse::<i64>().ok()?,
        digits[4..6].parse::<u32>().ok()?,
        digits[6..].parse::<u32>().ok()?,
    );
    // Inverse of `civil`, by search around the estimate: names are the crate's own.
    let estimate = (y - 1970) * 365 + (y - 1969) / 4;
    (estimate - 400..estimate + 400).find(|&n| civil(n) == (y, m, d))
}

/// Days since 1970-01-01 of `at` (UTC); `None` before 1970 or absurdly far ahead.
fn day_of(at: SystemTime) -> Option<i32> {
    let secs = at.duration_since(UNIX_EPOCH).ok()?.as_secs();
    i32::try_from(secs / 86_400).ok()
}

/// The longest retention a [`DailyInbox`] takes, in days (ten years): one partition a day.
pub const MAX_RETENTION_DAYS: u32 = 3660;

/// The most days ahead a [`DailyInbox`] makes partitions
/// ([`DailyInbox::with_days_ahead`]).
pub const MAX_DAYS_AHEAD: u32 = 31;

impl DailyInbox {
    /// An inbox on `pool` that keeps message IDs for `retention` (whole days, rounded up: a
    /// message first sent longer ago than that may be refused) and makes partitions 3 days
    /// ahead. Run [`migrate`](Self::migrate) and [`maintain`](Self::maintain) first, and
    /// `maintain` at least daily after (see [`spawn_maintenance`](Self::spawn_maintenance)).
    ///
    /// The retention must cover the broker's longest redelivery window: the queue's
    /// retention, plus any dead-letter queue that may be replayed.
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroRetention`] when `retention` is zero,
    /// [`ConfigError::RetentionTooLong`] past [`MAX_RETENTION_DAYS`].
    pub fn new(pool: PgPool, retention: Duration) -> Result<Self, ConfigError> {
        if retention.is_zero() {
            return Err(ConfigError::ZeroRetention);
        }
        let days = retention.as_secs().div_ceil(86_400).max(1);
        let retention_days = u32::try_from(days)
            .ok()
            .filter(|&days| days <= MAX_RETENTION_DAYS)
            .ok_or(ConfigError::RetentionTooLong {
                max_days: MAX_RETENTION_DAYS,
            })?;
        Ok(Self {
            pool,
            retention_days,
            ahead_days: 3,
            lock_timeout: Duration::from_secs(5),
        })
    }

    /// How many days ahead of today [`maintain`](Self::maintain) makes partitions (default
    /// 3, at most [`MAX_DAYS_AHEAD`]): a message whose producer's clock is further ahead is
    /// refused until then.
    ///
    /// # Errors
    ///
    /// [`ConfigError::TooManyDaysAhead`] past [`MAX_DAYS_AHEAD`].
    pub fn with_days_ahead(mut self, days: u32) -> Result<Self, ConfigError> {
        if days > MAX_DAYS_AHEAD {
            return Err(ConfigError::TooManyDaysAhead {
                max: MAX_DAYS_AHEAD,
            });
        }
        self.ahead_days = days;
        Ok(self)
    }

    /// How long [`process`](Self::process) waits for a concurrent delivery of the same
    /// message (default 5 s), as [`Inbox::with_lock_timeout`](super::Inbox::with_lock_timeout).
    #[must_use]
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// The pool this inbox uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates or upgrades the crate's tables
    /// ([`PostgresStore::migrate`](crate::PostgresStore::migrate)).
    ///
    /// # Errors
    ///
    /// As [`PostgresStore::migrate`](crate::PostgresStore::migrate).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate(&self.pool).await
    }

    /// Makes the partitions of the retention's days up to the days ahead, and detaches and
    /// drops those before it (`DETACH PARTITION … CONCURRENTLY`: deliveries go on meanwhile;
    /// an interrupted detach is finished on the next call). Idempotent: run it at least once
    /// a day, from one process or several.
    ///
    /// A day once dropped is never made again (see [`DailyInbox`]): first the floor is raised
    /// to the first day of the retention (it is never lowered), then every partition below
    /// the floor is dropped, and only days from the floor on are made. So a retention raised
    /// later keeps the days from the floor on longer but does not bring older ones back; of
    /// instances with different retentions, the shortest one's floor holds for all of them;
    /// and after the database's clock jumped ahead and back, messages of the days the jump
    /// dropped, and of days below the floor it set, are refused
    /// ([`InboxError::OutsideRetention`]) until the clock catches up.
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the database fails; what was done before stays done.
    pub async fn maintain(&self) -> Result<Maintenance, StoreError> {
        let today: i32 = sqlx::raw_sql(TODAY)
            .fetch_one(&self.pool)
            .await
            .and_then(|row| row.try_get("today"))
            .map_err(db_error)?;
        let today = i64::from(today);
        // No day before 1970 is ever used (`day_of`).
        let wanted = (today - i64::from(self.retention_days) + 1).max(0);
        // Raised, and committed, before anything is dropped: a delivery that reads the floor
        // after the raise refuses the days below it, a partition of one of them is left to
        // no delivery, and one made meanwhile by an instance that read a lower floor is
        // dropped on the next call.
        let first = self.raise_floor(wanted).await?;
        let last = today + i64::from(self.ahead_days);
        let mut done = Maintenance::default();
        let rows = sqlx::raw_sql(PARTITIONS)
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        let mut existing = Vec::new();
        for row in &rows {
            let name: String = row.try_get("name").map_err(db_error)?;
            let pending: bool = row.try_get("pending").map_err(db_error)?;
            let Some(day) = partition_day(&name) else {
                continue;
            };
            if day < first {
                let detach = if pending { "FINALIZE" } else { "CONCURRENTLY" };
                // Each its own statement: a concurrent detach cannot run in a transaction.
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "ALTER TABLE {TABLE} DETACH PARTITION {name} {detach}"
                )))
                .execute(&self.pool)
                .await
                .map_err(db_error)?;
                sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE IF EXISTS {name}")))
                    .execute(&self.pool)
                    .await
                    .map_err(db_error)?;
                done.dropped.push(name);
            } else {
                existing.push(day);
            }
        }
        for day in first..=last {
            if existing.contains(&day) {
                continue;
            }
            let (from, to) = (civil(day), civil(day + 1));
            let sql = format!(
                "CREATE TABLE IF NOT EXISTS {name} PARTITION OF {TABLE} \
                 FOR VALUES FROM ('{:04}-{:02}-{:02}') TO ('{:04}-{:02}-{:02}')",
                from.0,
                from.1,
                from.2,
                to.0,
                to.1,
                to.2,
                name = partition_name(day),
            );
            match sqlx::raw_sql(AssertSqlSafe(sql)).execute(&self.pool).await {
                Ok(_) => done.created.push(partition_name(day)),
                // Another process made it between the look and the create.
                Err(e)
                    if sqlstate_is(&e, DUPLICATE_TABLE)
                        || sqlstate_is(&e, INVALID_OBJECT_DEFINITION) => {}
                Err(e) => return Err(db_error(e)),
            }
        }
        Ok(done)
    }

    /// Raises the floor to `wanted` unless it is higher, and returns it (days since
    /// 1970-01-01).
    async fn raise_floor(&self, wanted: i64) -> Result<i64, StoreError> {
        let raise = fill(RAISE_FLOOR, &[Lit::Int(wanted)])?;
        let mut attempt = 1;
        loop {
            match sqlx::raw_sql(AssertSqlSafe(raise.as_str()))
                .fetch_one(&self.pool)
                .await
                .and_then(|row| row.try_get::<i32, _>("first_day"))
            {
                Ok(first) => return Ok(i64::from(first)),
                // Another instance raised it after this statement's snapshot.
                Err(e) if sqlstate_is(&e, SERIALIZATION_FAILURE) && attempt < RAISE_ATTEMPTS => {
                    attempt += 1;
                }
                Err(e) => return Err(db_error(e)),
            }
        }
    }

    /// Runs [`maintain`](Self::maintain) now and then every `every` in a background task,
    /// logging failures (the next run tries again).
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroPurgePeriod`] for a zero period, [`ConfigError::NoRuntime`]
    /// outside a Tokio runtime.
    pub fn spawn_maintenance(
        &self,
        every: Duration,
    ) -> Result<tokio::task::JoinHandle<()>, ConfigError> {
        if every.is_zero() {
            return Err(ConfigError::ZeroPurgePeriod);
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| ConfigError::NoRuntime)?;
        let inbox = self.clone();
        Ok(runtime.spawn(async move {
            loop {
                if let Err(e) = inbox.maintain().await {
                    tracing::warn!(
                        error = &e as &dyn std::error::Error,
                        "could not maintain the daily inbox's partitions"
                    );
                }
                tokio::time::sleep(every).await;
            }
        }))
    }

    /// As [`Inbox::process`](super::Inbox::process), in the partition of the day the
    /// producer first sent the message (`sent_at`: the same for every delivery and republish
    /// of it; see [`DailyInbox`]).
    ///
    /// # Errors
    ///
    /// [`InboxError::OutsideRetention`] when `sent_at`'s day has no partition (nothing ran),
    /// and as [`Inbox::process`](super::Inbox::process).
    pub async fn process<T, E, F>(
        &self,
        consumer: &str,
        message_id: &str,
        sent_at: SystemTime,
        work: F,
    ) -> Result<Delivery<T>, InboxError<E>>
    where
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        if message_id.is_empty() || message_id.len() > MAX_MESSAGE_ID {
            return Err(InboxError::InvalidMessageId);
        }
        let day = day_of(sent_at).ok_or(InboxError::OutsideRetention)?;
        let record = fill(
            RECORD,
            &[
                Lit::Text(consumer),
                Lit::Text(message_id),
                Lit::Int(i64::from(day)),
                Lit::Int(millis(self.lock_timeout)),
            ],
        )?;
        let mut tx = super::begin(&self.pool).await.map_err(db_error)?;
        let (recorded, dropped) = match sqlx::raw_sql(AssertSqlSafe(record))
            .fetch_all(&mut *tx)
            .await
        {
            // The row of the statement that records (the others set `lock_timeout`).
            Ok(rows) => match rows
                .iter()
                .find_map(|r| Some((r.try_get::<bool, _>("recorded").ok()?, r)))
            {
                Some((recorded, row)) => (
                    recorded,
                    row.try_get::<bool, _>("dropped").map_err(db_error)?,
                ),
                None => {
                    return Err(StoreError::backend(
                        "the daily inbox's record statement answered no row",
                    )
                    .into());
                }
            },
            Err(e) if sqlstate_is(&e, CHECK_VIOLATION) => {
                return Err(InboxError::OutsideRetention);
            }
            Err(e) if sqlstate_is(&e, SERIALIZATION_FAILURE) => {
                tx.rollback().await.map_err(db_error)?;
                return self.duplicate_or(consumer, message_id, day, e).await;
            }
            Err(e) => return Err(db_error(e).into()),
        };
        if !recorded {
            tx.rollback().await.map_err(db_error)?;
            // Below the floor: its day was dropped, so whether it was seen is unknown.
            if dropped {
                return Err(InboxError::OutsideRetention);
            }
            return Ok(Delivery::Duplicate);
        }
        let out = work(&mut tx).await.map_err(InboxError::Work)?;
        let check = fill(
            STILL_RECORDED,
            &[
                Lit::Text(consumer),
                Lit::Text(message_id),
                Lit::Int(i64::from(day)),
            ],
        )?;
        commit_unless_aborted_by(tx, check).await?;
        Ok(Delivery::Processed(out))
    }

    /// After a serialization failure on the insert: [`Delivery::Duplicate`] when the ID is
    /// committed, else the failure.
    async fn duplicate_or<T, E>(
        &self,
        consumer: &str,
        message_id: &str,
        day: i32,
        failure: sqlx::Error,
    ) -> Result<Delivery<T>, InboxError<E>> {
        let still = fill(
            STILL_RECORDED,
            &[
                Lit::Text(consumer),
                Lit::Text(message_id),
                Lit::Int(i64::from(day)),
            ],
        )?;
        let committed: bool = sqlx::raw_sql(AssertSqlSafe(still))
            .fetch_one(&self.pool)
            .await
            .and_then(|row| row.try_get(0))
            .map_err(db_error)?;
        if committed {
            Ok(Delivery::Duplicate)
        } else {
            Err(db_error(failure).into())
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn civil_dates_and_partition_names_round_trip() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(20_792), (2026, 12, 5));
        assert_eq!(civil(11_016), (2000, 2, 29));
        for day in [0, 59, 365, 11_016, 20_792, 30_000, 60_000] {
            assert_eq!(partition_day(&partition_name(day)), Some(day), "{day}");
        }
        assert_eq!(
            partition_day("tower_idempotency_processed_messages_daily_x"),
            None
        );
        assert_eq!(partition_day("other_20261205"), None);
        assert_eq!(day_of(UNIX_EPOCH + Duration::from_secs(86_399)), Some(0));
        assert_eq!(day_of(UNIX_EPOCH + Duration::from_secs(86_400)), Some(1));
    }
}
