//! The messages transactional mode sends: the claim with its `BEGIN`, the completion with
//! its `COMMIT`, and how their answers are read.

use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, Row};

use crate::error::StoreError;
use crate::outcome::Taken;
use crate::response::StoredResponse;
use crate::store::postgres::{decode_response, millis, status_column};
use crate::store::sql::{push_bounds, push_bytea, push_text};

use super::*;

/// The name of the savepoint set right after the claim, before the handler runs.
pub(super) const HANDLER_SAVEPOINT: &str = "tower_idempotency_handler";

/// How often a claim is tried again when it lost a race (a record committed after its
/// snapshot, or one that vanished between two looks) before answering "in flight".
pub(super) const CLAIM_ATTEMPTS: usize = 3;

/// The `Retry-After` of a key held by another transaction (its end is not known).
pub(super) const HELD_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The advisory lock of a (scope, key): 64 bits of its SHA-256.
pub(super) fn lock_id(scope: &str, key: &str) -> i64 {
    let mut h = Sha256::new();
    h.update(b"tower-idempotency\0");
    h.update((scope.len() as u64).to_be_bytes());
    h.update(scope.as_bytes());
    h.update(key.as_bytes());
    let d = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    i64::from_be_bytes(first)
}

/// What a record returned by the claim batch means for this request: the key taken, or
/// (`None`) free again.
pub(super) fn classify(row: &PgRow, fingerprint: &[u8]) -> Result<Option<Taken>, StoreError> {
    let Some(fp) = row.try_get::<Option<Vec<u8>>, _>("fingerprint")? else {
        return Ok(None);
    };
    if fp != fingerprint {
        return Ok(Some(Taken::Mismatch));
    }
    if row.try_get::<Option<i64>, _>("lease_token")?.is_some() {
        // A plain-mode claim on the same table: live, or abandoned by a dead process.
        let left = row.try_get::<Option<i64>, _>("lease_left_ms")?.unwrap_or(0);
        return Ok(match u64::try_from(left) {
            Ok(ms) if ms > 0 => Some(Taken::InFlight(Duration::from_millis(ms))),
            _ => None,
        });
    }
    Ok(Some(Taken::Completed(decode_response(row)?)))
}

/// The record's columns, as the claim function returns them.
pub(super) const RECORD_COLUMNS: &str = "k.fingerprint, k.lease_token, \
     (extract(epoch FROM k.lease_expires_at - tower_idempotency_now()) * 1000)::bigint AS lease_left_ms, \
     k.response_status, k.response_headers, k.response_body";

/// The claim batch, one message:
///
/// 1. a look at the key's record in a `READ COMMITTED`, read-only transaction of its own,
///    which returns a live record (completed, claimed in plain mode, or with another payload)
///    without taking any lock — so concurrent replays never see each other as "in flight" —
///    and, being outside the request's transaction, takes no predicate locks in it under
///    `SERIALIZABLE`;
/// 2. `BEGIN` of the request's transaction (at the configured isolation level);
/// 3. the claim (`tower_idempotency_claim_tx`) in it: the advisory lock, the
///    placeholder record, or the record that holds the key;
/// 4. a savepoint, so that a handler that leaves the transaction aborted can still have its
///    answer stored with the key.
///
/// When the look finds a live record the claim's outcome is ignored and the transaction
/// rolled back. No statement raises an error for a replay, an in-flight key or a mismatch, so
/// the server logs none.
pub(super) fn claim_batch(
    scope: &str,
    key: &str,
    fingerprint: &[u8],
    isolation: Option<IsolationLevel>,
    (statement_timeout, lock_timeout): (Duration, Duration),
) -> Result<String, StoreError> {
    let mut s_arg = String::with_capacity(scope.len() + 8);
    push_text(&mut s_arg, scope)?;
    let mut k_arg = String::with_capacity(key.len() + 8);
    push_text(&mut k_arg, key)?;
    let mut fp_arg = String::with_capacity(2 * fingerprint.len() + 24);
    push_bytea(&mut fp_arg, fingerprint);

    let mut sql = String::with_capacity(900 + 2 * (s_arg.len() + k_arg.len() + fp_arg.len()));
    sql.push_str("BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY; ");
    push_bounds(&mut sql, statement_timeout, lock_timeout);
    sql.push_str("SELECT 'look' AS step, ");
    sql.push_str(RECORD_COLUMNS);
    sql.push_str(" FROM tower_idempotency_keys AS k WHERE k.scope = ");
    sql.push_str(&s_arg);
    sql.push_str(" AND k.key = ");
    sql.push_str(&k_arg);
    sql.push_str(
        " AND k.expires_at > tower_idempotency_now() \
         AND (k.lease_token IS NULL OR k.lease_expires_at > tower_idempotency_now() \
         OR k.fingerprint <> ",
    );
    sql.push_str(&fp_arg);
    sql.push_str("); COMMIT; ");
    sql.push_str(isolation.map_or("BEGIN", IsolationLevel::begin));
    // The store's bounds hold for the claim only: the settings in force before are kept in
    // two settings of the crate's own and put back before the handler's statements.
    sql.push_str(
        "; SELECT set_config('tower_idempotency.statement_timeout', \
         current_setting('statement_timeout'), true), \
         set_config('tower_idempotency.lock_timeout', current_setting('lock_timeout'), true); ",
    );
    push_bounds(&mut sql, statement_timeout, lock_timeout);
    sql.push_str(
        "SELECT 'claim' AS step, c.*, pg_backend_pid() AS backend, \
         current_setting('transaction_isolation') AS isolation FROM tower_idempotency_claim_tx(",
    );
    sql.push_str(&lock_id(scope, key).to_string());
    for arg in [&s_arg, &k_arg, &fp_arg] {
        sql.push(',');
        sql.push_str(arg);
    }
    sql.push_str(
        ") AS c; SELECT set_config('statement_timeout', \
         current_setting('tower_idempotency.statement_timeout'), true), \
         set_config('lock_timeout', current_setting('tower_idempotency.lock_timeout'), true); \
         SAVEPOINT ",
    );
    sql.push_str(HANDLER_SAVEPOINT);
    Ok(sql)
}

/// The placeholder's row id as the claim returned it (`(block,offset)`), checked to be only
/// that before it is written into a statement.
pub(super) fn checked_row_id(row: &str) -> Result<&str, StoreError> {
    let inner = row
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .and_then(|r| r.split_once(','));
    match inner {
        Some((block, offset))
            if !block.is_empty()
                && !offset.is_empty()
                && block
                    .bytes()
                    .chain(offset.bytes())
                    .all(|b| b.is_ascii_digit()) =>
        {
            Ok(row)
        }
        _ => Err(StoreError::Corrupt(format!(
            "the claim returned an invalid row id {row:?}"
        ))),
    }
}

/// The completion, one message: the placeholder becomes the completed record (its times
/// taken when this statement runs), then `COMMIT`; `rollback_handler` first rolls the
/// handler's writes back to the savepoint (the handler left the transaction aborted).
///
/// With `notify`, the completion also wakes the key's waiters. Under `READ COMMITTED` it looks
/// for them in the request's transaction, in the completion's statement, whose snapshot is
/// taken then. Under `REPEATABLE READ` and `SERIALIZABLE` it looks **after** the commit, in a
/// `READ COMMITTED` transaction of its own: inside the request's transaction the look would
/// read the snapshot taken before the handler ran, blind to every waiter that registered since
/// (left to its recheck), and under `SERIALIZABLE` it would tie the request to every
/// registration. (That transaction costs a `READ COMMITTED` request a third of a minimal
/// transaction's throughput, measured in BENCHMARKS.md, so it is kept for the levels that
/// need it.)
pub(super) fn completion_batch(
    claimed: &Placeholder,
    ttl: Duration,
    stored: &StoredResponse,
    rollback_handler: bool,
    (statement_timeout, lock_timeout): (Duration, Duration),
    notify: Option<i64>,
) -> Result<CompletionBatch, StoreError> {
    let status = status_column(stored)?;
    let headers = stored.encode_headers();
    let body = stored.body();
    let body_len = body.map_or(0, |b| b.len());
    let mut sql = String::with_capacity(
        380 + 2 * (claimed.scope.len() + claimed.key.len() + headers.len() + body_len),
    );
    let mut statements = 0;
    if rollback_handler {
        sql.push_str("ROLLBACK TO SAVEPOINT ");
        sql.push_str(HANDLER_SAVEPOINT);
        sql.push_str("; ");
        statements += 1;
    }
    // The handler is done: the store's bounds hold for the rest of the transaction.
    statements += push_bounds(&mut sql, statement_timeout, lock_timeout);
    sql.push_str("SELECT tower_idempotency_complete_tx('");
    sql.push_str(checked_row_id(&claimed.row)?);
    sql.push_str("',");
    push_text(&mut sql, &claimed.scope)?;
    sql.push(',');
    push_text(&mut sql, &claimed.key)?;
    sql.push(',');
    sql.push_str(&millis(ttl).to_string());
    sql.push(',');
    sql.push_str(&status.to_string());
    sql.push_str("::smallint,");
    push_bytea(&mut sql, &headers);
    sql.push(',');
    match body {
        Some(body) => push_bytea(&mut sql, body),
        None => sql.push_str("NULL"),
    }
    let after_commit = match notify {
        Some(hash) if claimed.read_committed => {
            sql.push(',');
            sql.push_str(&hash.to_string());
            None
        }
        other => other,
    };
    sql.push_str("); COMMIT");
    // The completion and the commit.
    statements += 2;
    if let Some(hash) = after_commit {
        // A statement of its own after the COMMIT: an implicit transaction, whose snapshot is
        // the statement's at any level and which no error can leave open on the connection
        // (an explicit `BEGIN` there would stay aborted, and go back to the pool so, were the
        // wake-up to fail).
        sql.push_str("; ");
        sql.push_str(&crate::store::listen::wake_statement(hash));
    }
    Ok(CompletionBatch {
        sql,
        through_commit: statements,
    })
}

/// A completion's message.
pub(crate) struct CompletionBatch {
    pub(crate) sql: String,
    /// How many of its statements end with the request's `COMMIT`: a failure reported after
    /// that many statements completed is the wake-up's, and the transaction did commit.
    pub(crate) through_commit: usize,
}

/// Runs a completion's message; `Ok` once the request's transaction committed (a wake-up that
/// failed after it is only logged: its waiters claim again at their recheck).
pub(crate) async fn run_completion(
    conn: &mut PgConnection,
    batch: CompletionBatch,
) -> Result<(), sqlx::Error> {
    let mut results = sqlx::raw_sql(AssertSqlSafe(batch.sql)).fetch_many(conn);
    let mut completed = 0;
    while let Some(item) = std::future::poll_fn(|cx| results.as_mut().poll_next(cx)).await {
        match item {
            Ok(sqlx::Either::Left(_)) => completed += 1,
            Ok(sqlx::Either::Right(_)) => {}
            Err(e) if completed >= batch.through_commit => {
                tracing::debug!(
                    error = &e as &dyn std::error::Error,
                    "idempotency: committed, but could not wake the key's waiters; they claim \
                     again at their recheck"
                );
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
