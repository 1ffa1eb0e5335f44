//! Transactional mode: the key's record and the handler's writes commit in one Postgres
//! transaction (feature `postgres`).
//!
//! In plain mode the key's record and the handler's own writes are committed separately: a
//! crash between the two either skips work or does it twice, and no lease can fix that. In
//! transactional mode the layer opens a transaction, claims the key in it, hands it to the
//! handler ([`IdempotentTx`]), stores the answer in it and **commits before it answers**:
//!
//! - the client sees a success only if it was committed, together with the key;
//! - a `5xx` answer, a handler error or a panic rolls everything back: nothing is stored and
//!   a retry runs the handler again (a request whose client went away still runs to its end
//!   and commits, unless
//!   [`with_cancel_on_disconnect`](crate::IdempotencyLayer::with_cancel_on_disconnect));
//! - a failed commit gives the client `503` and nothing is stored;
//! - a concurrent duplicate gets `409` at once: the claim takes a transaction-scoped
//!   advisory lock with `pg_try_advisory_xact_lock`, which never waits (also when its payload
//!   differs: the first request's fingerprint is not visible before it commits, so the
//!   `422` comes with the retry);
//! - a process that dies mid-request leaves nothing behind: its connection drops, Postgres
//!   rolls back and releases the lock, and the retry runs at once (no lease to wait for).
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use tower_idempotency::{IdempotencyLayer, IdempotentTx, PostgresStore};
//!
//! async fn pay(tx: IdempotentTx) -> Result<(http::StatusCode, &'static str), http::StatusCode> {
//!     let mut conn = tx.conn().await.map_err(|_| http::StatusCode::INTERNAL_SERVER_ERROR)?;
//!     sqlx::query("INSERT INTO payments (amount_cents) VALUES (500)")
//!         .execute(&mut *conn)
//!         .await
//!         .map_err(|_| http::StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok((http::StatusCode::CREATED, "paid")) // committed with the key, or not at all
//! }
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), tower_idempotency::StoreError> {
//! let store = PostgresStore::new(pool);
//! store.migrate().await?;
//! let app: Router = Router::new()
//!     .route("/payments", post(pay))
//!     .layer(IdempotencyLayer::new(store.transactional()));
//! # Ok(()) }
//! ```
//!
//! (The `IdempotentTx` extractor needs the `axum` feature; without it, read the
//! [`IdempotentTx`] from the request's extensions.)
//!
//! # Round trips
//!
//! A new key costs the same round trips as the handler's own transaction would: the claim
//! travels in one message with `BEGIN` and the completion in one message with `COMMIT`
//! (simple-query batches; the key, the scope and the answer are written into them as
//! escaped string and hex constants). A replay costs two: the claim, which finds the record
//! and ends, and the read of the record. After the commit, the completion's batch opens an
//! empty transaction that sqlx rolls back as the connection returns to the pool (it keeps
//! sqlx's count of open transactions true; see `completion_batch` in the source). The claim
//! is the function `tower_idempotency_claim_in_tx` that [`PostgresStore::migrate`] creates.
//!
//! Each keyed request holds one pooled connection for as long as its handler runs: size the
//! pool for the concurrency of your idempotent routes. Work that leaves the database (a call to
//! a payment provider) is not rolled back; pass it a [derived key](crate::IdempotencyKey::derive)
//! so that the other side deduplicates the retry.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use sha2::{Digest, Sha256};
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row, Transaction};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};
use tower_service::Service;

use crate::body::{RequestBody, ResponseBody};
use crate::error::{BoxError, StoreError};
use crate::mode::{Keyed, Mode, Sealed};
use crate::rejection::Rejection;
use crate::response::StoredResponse;
use crate::service::{
    Outcome, Prepared, Taken, answer_taken, log_store_error, prepare, record, render, to_store,
};
use crate::store::PostgresStore;
use crate::store::postgres::{db_error, decode_response, millis, status_column};

/// A [`PostgresStore`] in transactional mode; made by
/// [`PostgresStore::transactional`]. Use it as the layer's store:
/// `IdempotencyLayer::new(store.transactional())`.
#[derive(Clone, Debug)]
pub struct Transactional {
    store: PostgresStore,
}

impl PostgresStore {
    /// This store in transactional mode: the key's record and the handler's writes (made
    /// through [`IdempotentTx`]) commit in one transaction. See [`crate::transactional`].
    pub fn transactional(&self) -> Transactional {
        Transactional {
            store: self.clone(),
        }
    }
}

impl Transactional {
    /// The store underneath (for purging, or for a plain-mode layer on the same table).
    pub fn store(&self) -> &PostgresStore {
        &self.store
    }
}

impl Mode for Transactional {}

/// The transaction of a keyed request in transactional mode, for the handler's own writes.
///
/// The layer inserts it into the request's extensions (and, with the `axum` feature, it is
/// an extractor). Clone it freely; all clones share the one transaction. The layer commits it
/// after the handler answers (or rolls it back, on a `5xx` or an error): never commit it
/// yourself, and do not keep a [`TxConn`] beyond the handler.
#[derive(Clone)]
pub struct IdempotentTx {
    slot: Arc<Mutex<Option<Transaction<'static, Postgres>>>>,
}

/// A borrowed connection inside the request's transaction; use `&mut *conn` as a sqlx
/// executor.
pub type TxConn<'a> = MappedMutexGuard<'a, PgConnection>;

/// The request's transaction is no longer available: the layer already committed or rolled
/// it back (the handler kept the handle past its answer).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the idempotent request's transaction has already ended")]
pub struct TxFinished;

impl IdempotentTx {
    /// Locks the transaction's connection for a statement or a few. Statements of one request
    /// run one at a time.
    ///
    /// # Errors
    ///
    /// [`TxFinished`] when the layer already ended the transaction.
    pub async fn conn(&self) -> Result<TxConn<'_>, TxFinished> {
        MutexGuard::try_map(self.slot.lock().await, |tx| tx.as_deref_mut()).map_err(|_| TxFinished)
    }

    fn take(&self) -> Option<Transaction<'static, Postgres>> {
        // `try_lock` fails only if the handler still holds a `TxConn` after answering (it
        // moved one into a task that outlives it); the transaction is then not ours to end.
        self.slot.try_lock().ok().and_then(|mut tx| tx.take())
    }
}

impl std::fmt::Debug for IdempotentTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTx").finish_non_exhaustive()
    }
}

/// What the claim found when the key was not free, read after its batch failed: the record
/// (plain `SELECT`, outside any transaction).
const TX_READ: &str = "
SELECT k.fingerprint, k.lease_token,
       (extract(epoch FROM k.lease_expires_at - now()) * 1000)::bigint AS lease_left_ms,
       k.response_status, k.response_headers, k.response_body
  FROM tower_idempotency_keys AS k
 WHERE k.scope = $1 AND k.key = $2 AND k.expires_at > now()";

/// SQLSTATEs raised by the claim function (`migrations/0003_transactional_claim.sql`).
const IN_FLIGHT: &str = "TI001";
const HAS_RECORD: &str = "TI002";

/// The keys table's primary key: the completion's insert violates it when a plain-mode
/// request claimed the key after this transaction's claim looked.
const KEYS_PKEY: &str = "tower_idempotency_keys_pkey";

/// How often a claim whose record vanished between the batch and the read (expired and
/// purged in that instant) is tried again before answering "in flight".
const CLAIM_ATTEMPTS: usize = 3;

/// The `Retry-After` of a key held by another transaction (its end is not known).
const HELD_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The advisory lock of a (scope, key): 64 bits of its SHA-256.
fn lock_id(scope: &str, key: &str) -> i64 {
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

/// What [`TX_READ`] found: the key taken, or (`None`) free again.
fn classify(row: Option<&PgRow>, fingerprint: &[u8]) -> Result<Option<Taken>, StoreError> {
    let Some(row) = row else {
        return Ok(None);
    };
    let fp: Vec<u8> = row.try_get("fingerprint")?;
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

/// The SQLSTATE of a database error.
fn sqlstate(err: &sqlx::Error) -> Option<std::borrow::Cow<'_, str>> {
    err.as_database_error().and_then(|db| db.code())
}

/// Appends `bytes` to `sql` as an expression of type `bytea`. Only hex digits are copied into
/// the statement, so no value can change its meaning.
fn push_bytea(sql: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    sql.reserve(bytes.len() * 2 + 24);
    sql.push_str("decode('");
    for &b in bytes {
        sql.push(char::from(HEX[usize::from(b >> 4)]));
        sql.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    sql.push_str("','hex')");
}

/// Appends `text` to `sql` as a string constant, `E'…'` with quotes and backslashes doubled.
///
/// An escape-string constant reads the same whatever `standard_conforming_strings` says, and
/// sqlx always sets `client_encoding` to UTF-8, in which no byte of a multibyte character is
/// a quote or a backslash. A NUL would end the statement early (the protocol's strings are
/// NUL-terminated); Postgres text cannot hold one anyway, so it is an error here too. (Hex
/// with `convert_from` would need no escaping, but costs the server milliseconds per call.)
fn push_text(sql: &mut String, text: &str) -> Result<(), StoreError> {
    if text.contains('\0') {
        return Err(StoreError::backend(
            "a scope or key contains a NUL character",
        ));
    }
    sql.reserve(text.len() + 3);
    sql.push_str("E'");
    for c in text.chars() {
        match c {
            '\'' => sql.push_str("''"),
            '\\' => sql.push_str("\\\\"),
            c => sql.push(c),
        }
    }
    sql.push('\'');
    Ok(())
}

/// The claim batch: the claim first, then `BEGIN`. Both run in one transaction: the claim in
/// the implicit transaction of the simple query, which `BEGIN` turns into the explicit one
/// (keeping its advisory lock). When the claim raises, `BEGIN` never runs and the
/// connection is left outside any transaction, as the pool expects it.
fn claim_batch(scope: &str, key: &str, fingerprint: &[u8]) -> Result<String, StoreError> {
    let mut sql = String::with_capacity(160 + 4 * (scope.len() + key.len() + fingerprint.len()));
    sql.push_str("SELECT tower_idempotency_claim_in_tx(");
    sql.push_str(&lock_id(scope, key).to_string());
    sql.push(',');
    push_text(&mut sql, scope)?;
    sql.push(',');
    push_text(&mut sql, key)?;
    sql.push(',');
    push_bytea(&mut sql, fingerprint);
    sql.push_str("); BEGIN");
    Ok(sql)
}

/// The completion batch: the answer inserted, `COMMIT`, then `BEGIN` of an empty transaction.
///
/// The claim deleted any stale record, so a plain `INSERT` stores the answer; should a
/// plain-mode request on the same table have claimed the key since, the insert violates the
/// primary key, the rest of the batch is skipped and nothing commits.
///
/// sqlx's `Transaction` counts the transactions it opened; once the `COMMIT` ran inside the
/// batch it would still count this one as open, and roll it back when dropped. The trailing
/// `BEGIN` opens the (empty) transaction that rollback ends: it takes no snapshot and no
/// transaction id, and sqlx flushes the rollback as the connection goes back to the pool,
/// off the request's path. If the insert or the commit fails, the rest of the batch is
/// skipped and that same rollback ends the failed transaction.
fn completion_batch(
    scope: &str,
    key: &str,
    fingerprint: &[u8],
    ttl: Duration,
    stored: &StoredResponse,
) -> Result<String, StoreError> {
    let status = status_column(stored)?;
    let headers = stored.encode_headers();
    let body = stored.body();
    let body_len = body.map_or(0, |b| b.len());
    let mut sql = String::with_capacity(
        400 + 2 * (scope.len() + key.len() + fingerprint.len() + headers.len() + body_len),
    );
    sql.push_str(
        "INSERT INTO tower_idempotency_keys (scope, key, fingerprint, expires_at, \
         completed_at, response_status, response_headers, response_body) VALUES (",
    );
    push_text(&mut sql, scope)?;
    sql.push(',');
    push_text(&mut sql, key)?;
    sql.push(',');
    push_bytea(&mut sql, fingerprint);
    sql.push_str(",now()+");
    sql.push_str(&millis(ttl).to_string());
    sql.push_str("*interval '1 millisecond',now(),");
    sql.push_str(&status.to_string());
    sql.push(',');
    push_bytea(&mut sql, &headers);
    sql.push(',');
    match body {
        Some(body) => push_bytea(&mut sql, body),
        None => sql.push_str("NULL"),
    }
    sql.push_str("); COMMIT; BEGIN");
    Ok(sql)
}

/// Whether `err` says that the completion's insert found the key's record taken.
fn stored_first(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .is_some_and(|db| db.is_unique_violation() && db.constraint() == Some(KEYS_PKEY))
}

/// Opens the request's transaction with the key claimed in it (`Ok(Ok(tx))`), or says who
/// holds the key (`Ok(Err(taken))`).
async fn claim(
    store: &PostgresStore,
    scope: &str,
    key: &str,
    fingerprint: &[u8],
) -> Result<Result<Transaction<'static, Postgres>, Taken>, StoreError> {
    // Shared by the attempts (a clone is a reference count).
    let batch: Arc<str> = claim_batch(scope, key, fingerprint)?.into();
    for _ in 0..CLAIM_ATTEMPTS {
        // In a task of its own: if the request is dropped while the batch is in flight, the
        // task still finishes it, and the transaction it opened is rolled back when the task's
        // output is dropped. (A `begin` dropped half-way would put a connection back into the
        // pool with a transaction open that sqlx does not know about.)
        let pool = store.pool().clone();
        let statement = AssertSqlSafe(batch.clone());
        let begun = tokio::spawn(async move { pool.begin_with(statement).await })
            .await
            .map_err(StoreError::backend)?;
        let err = match begun {
            Ok(tx) => return Ok(Ok(tx)),
            Err(err) => err,
        };
        match sqlstate(&err).as_deref() {
            Some(IN_FLIGHT) => return Ok(Err(Taken::InFlight(HELD_RETRY_AFTER))),
            Some(HAS_RECORD) => {}
            _ => return Err(db_error(err)),
        }
        let row = sqlx::query(TX_READ)
            .bind(scope)
            .bind(key)
            .fetch_optional(store.pool())
            .await
            .map_err(db_error)?;
        if let Some(taken) = classify(row.as_ref(), fingerprint)? {
            return Ok(Err(taken));
        }
        // Expired (or abandoned) between the batch and the read: claim again.
    }
    Ok(Err(Taken::InFlight(HELD_RETRY_AFTER)))
}

async fn rollback(tx: Option<Transaction<'static, Postgres>>) {
    if let Some(tx) = tx
        && let Err(e) = tx.rollback().await
    {
        // The connection is gone, which rolls back too.
        tracing::debug!(error = &e as &dyn std::error::Error, "rollback failed");
    }
}

// See `mode::private`: the sealed trait's method uses crate-private types by design.
#[allow(private_interfaces)]
impl Sealed for Transactional {
    async fn execute<S, ReqBody, ResBody>(
        self,
        keyed: Keyed,
        mut inner: S,
        req: Request<ReqBody>,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Error>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Body<Data = Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Send + 'static,
    {
        let Keyed { config, key } = keyed;
        let Prepared {
            mut parts,
            scope,
            fingerprint,
            buffered,
        } = match prepare(&config, req).await {
            Ok(prepared) => prepared,
            Err(rejected) => return Ok(rejected),
        };
        let unavailable = |err: StoreError, what: &'static str| {
            record(Outcome::StoreError);
            log_store_error(&err, what);
            render(&config, &Rejection::StoreUnavailable)
        };

        let claimed = claim(&self.store, &scope, key.as_str(), fingerprint.as_bytes()).await;
        let tx = match claimed {
            Ok(Ok(tx)) => tx,
            Ok(Err(taken)) => return Ok(answer_taken(&config, taken)),
            Err(e) => return Ok(unavailable(e, "claim a key; answered 503")),
        };
        record(Outcome::Executed);

        // From here a drop (client gone, panic) drops the transaction: sqlx rolls it back
        // and Postgres releases the advisory lock.
        let handle = IdempotentTx {
            slot: Arc::new(Mutex::new(Some(tx))),
        };
        parts.extensions.insert(key.clone());
        parts.extensions.insert(handle.clone());
        let req = Request::from_parts(
            parts,
            RequestBody::buffered(buffered.chunks, buffered.trailers),
        );
        let response = match inner.call(req).await {
            Ok(r) => r,
            Err(e) => {
                rollback(handle.take()).await;
                return Err(e);
            }
        };
        let (response, stored) = to_store(&config, response).await;
        let Some(stored) = stored else {
            // A 5xx, or a body that failed: roll the handler's writes back.
            rollback(handle.take()).await;
            return Ok(response);
        };

        let batch = match completion_batch(
            &scope,
            key.as_str(),
            fingerprint.as_bytes(),
            config.ttl,
            &stored,
        ) {
            Ok(batch) => batch,
            Err(e) => {
                rollback(handle.take()).await;
                return Ok(unavailable(
                    e,
                    "store the answer; rolled back, answered 503",
                ));
            }
        };
        let Some(mut tx) = handle.take() else {
            tracing::error!(
                "the handler kept the idempotent transaction past its answer; rolled back"
            );
            return Ok(render(&config, &Rejection::StoreUnavailable));
        };
        let completed = sqlx::raw_sql(AssertSqlSafe(batch)).execute(&mut *tx).await;
        // Committed or failed, the batch leaves an empty or a failed transaction for `tx`'s
        // drop to roll back (see `completion_batch`).
        drop(tx);
        match completed {
            Ok(_) => Ok(response),
            // A plain-mode request on the same table claimed the key in the meantime.
            Err(e) if stored_first(&e) => {
                Ok(answer_taken(&config, Taken::InFlight(HELD_RETRY_AFTER)))
            }
            Err(e) => Ok(unavailable(
                db_error(e),
                "store the answer and commit; rolled back, answered 503",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_are_escaped() {
        let mut sql = String::new();
        push_text(&mut sql, r"it's a \ back'slash").unwrap();
        assert_eq!(sql, r"E'it''s a \\ back''slash'");
        let mut sql = String::new();
        push_bytea(&mut sql, &[0x00, 0x7f, 0xff, b'\'']);
        assert_eq!(sql, "decode('007fff27','hex')");
        assert!(push_text(&mut String::new(), "nul\0").is_err());
    }

    #[test]
    fn batches_end_as_the_transaction_bookkeeping_expects() {
        let claim = claim_batch("t", "k", &[1, 2]).unwrap();
        assert!(claim.starts_with("SELECT tower_idempotency_claim_in_tx("));
        assert!(claim.ends_with("); BEGIN"));
        let stored = StoredResponse::new(
            http::StatusCode::CREATED,
            http::HeaderMap::new(),
            Bytes::from_static(b"{}"),
        );
        let done = completion_batch("t", "k", &[1, 2], Duration::from_secs(1), &stored).unwrap();
        assert!(done.starts_with("INSERT INTO tower_idempotency_keys "));
        assert!(done.contains(",now()+1000*interval '1 millisecond',now(),201,"));
        assert!(done.ends_with(",decode('7b7d','hex')); COMMIT; BEGIN"));
    }

    #[test]
    fn lock_ids_separate_scope_and_key() {
        assert_eq!(lock_id("a", "bc"), lock_id("a", "bc"));
        assert_ne!(lock_id("a", "bc"), lock_id("ab", "c"));
        assert_ne!(lock_id("", "k"), lock_id("t", "k"));
    }
}
