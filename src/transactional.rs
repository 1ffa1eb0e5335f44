//! Transactional mode: the key's record and the handler's writes commit in one Postgres
//! transaction (feature `postgres`).
//!
//! In plain mode the key's record and the handler's own writes are committed separately: a
//! crash between the two either skips work or does it twice, and no lease can fix that. In
//! transactional mode the layer opens a transaction, claims the key in it, hands it to the
//! handler ([`IdempotentTx`]), stores the answer in it and **commits before it answers**:
//!
//! - the client sees a success only if it was committed, together with the key;
//! - a `5xx` answer, a handler error, a panic or a dropped request rolls everything back:
//!   nothing is stored and a retry runs the handler again;
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
use sqlx::{PgConnection, Postgres, Row, Transaction};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};
use tower_service::Service;

use crate::body::{RequestBody, ResponseBody};
use crate::error::{BoxError, StoreError};
use crate::mode::{Keyed, Mode, Sealed};
use crate::rejection::Rejection;
use crate::response::StoredResponse;
use crate::service::{
    Outcome, Prepared, log_store_error, prepare, record, render, replay, to_store,
};
use crate::store::PostgresStore;
use crate::store::postgres::{decode_response, millis, status_column};

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

/// The lock and the record in one statement. `pg_try_advisory_xact_lock` never waits: a
/// concurrent duplicate learns at once that the key is taken. Advisory locks are global to
/// the database, so the lock id mixes in the table's oid: stores in two schemas of one
/// database never block each other. The record is read with the
/// statement's snapshot, taken before the lock; the rare request that reads it just before
/// another commits is caught by [`TX_COMPLETE`], whose insert then conflicts.
const TX_CLAIM: &str = "
SELECT pg_try_advisory_xact_lock($1 # 'tower_idempotency_keys'::regclass::oid::bigint) AS locked,
       k.fingerprint, k.lease_token,
       (extract(epoch FROM k.lease_expires_at - now()) * 1000)::bigint AS lease_left_ms,
       k.response_status, k.response_headers, k.response_body
  FROM (SELECT 1) AS one
  LEFT JOIN tower_idempotency_keys AS k
         ON k.scope = $2 AND k.key = $3 AND k.expires_at > now()";

/// Stores the answer in the request's transaction. It replaces only an expired record or an
/// abandoned plain-mode claim; a live record (a concurrent request that committed first)
/// leaves it unchanged, and the transaction is rolled back.
const TX_COMPLETE: &str = "
INSERT INTO tower_idempotency_keys AS k
       (scope, key, fingerprint, expires_at, completed_at,
        response_status, response_headers, response_body)
VALUES ($1, $2, $3, now() + $4::float8 * interval '1 millisecond', now(), $5, $6, $7)
ON CONFLICT (scope, key) DO UPDATE
   SET fingerprint = EXCLUDED.fingerprint, lease_token = NULL, lease_expires_at = NULL,
       expires_at = EXCLUDED.expires_at, created_at = now(), completed_at = now(),
       response_status = EXCLUDED.response_status,
       response_headers = EXCLUDED.response_headers,
       response_body = EXCLUDED.response_body
 WHERE k.expires_at <= now()
    OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= now())";

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

enum Found {
    Free,
    Locked,
    Mismatch,
    InFlight(Duration),
    Completed(StoredResponse),
}

fn found(row: &PgRow, fingerprint: &[u8]) -> Result<Found, StoreError> {
    if !row.try_get::<bool, _>("locked")? {
        return Ok(Found::Locked);
    }
    let Some(fp) = row.try_get::<Option<Vec<u8>>, _>("fingerprint")? else {
        return Ok(Found::Free);
    };
    if fp != fingerprint {
        return Ok(Found::Mismatch);
    }
    if row.try_get::<Option<i64>, _>("lease_token")?.is_some() {
        // A plain-mode claim on the same table: live, or abandoned by a dead process.
        let left = row.try_get::<Option<i64>, _>("lease_left_ms")?.unwrap_or(0);
        return Ok(match u64::try_from(left) {
            Ok(ms) if ms > 0 => Found::InFlight(Duration::from_millis(ms)),
            _ => Found::Free,
        });
    }
    Ok(Found::Completed(decode_response(row)?))
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

        let mut tx = match self.store.pool().begin().await {
            Ok(tx) => tx,
            Err(e) => return Ok(unavailable(e.into(), "begin a transaction; answered 503")),
        };
        let claimed = sqlx::query(TX_CLAIM)
            .bind(lock_id(&scope, key.as_str()))
            .bind(&scope)
            .bind(key.as_str())
            .fetch_one(&mut *tx)
            .await
            .map_err(crate::store::postgres::db_error)
            .and_then(|row| found(&row, fingerprint.as_bytes()));
        let answered = match claimed {
            Ok(Found::Free) => None,
            Ok(Found::Locked) => {
                record(Outcome::InFlight);
                let retry_after = Duration::from_secs(1);
                Some(render(&config, &Rejection::InFlight { retry_after }))
            }
            Ok(Found::InFlight(retry_after)) => {
                record(Outcome::InFlight);
                Some(render(&config, &Rejection::InFlight { retry_after }))
            }
            Ok(Found::Mismatch) => {
                record(Outcome::Mismatch);
                Some(render(&config, &Rejection::KeyReused))
            }
            Ok(Found::Completed(stored)) => {
                record(Outcome::Replayed);
                Some(replay(&config, stored))
            }
            Err(e) => Some(unavailable(e, "claim a key; answered 503")),
        };
        if let Some(answer) = answered {
            rollback(Some(tx)).await;
            return Ok(answer);
        }
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

        let Some(mut tx) = handle.take() else {
            tracing::error!(
                "the handler kept the idempotent transaction past its answer; rolled back"
            );
            return Ok(render(&config, &Rejection::StoreUnavailable));
        };
        let completed = match status_column(&stored) {
            Ok(status) => sqlx::query(TX_COMPLETE)
                .bind(&scope)
                .bind(key.as_str())
                .bind(&fingerprint.as_bytes()[..])
                .bind(millis(config.ttl))
                .bind(status)
                .bind(stored.encode_headers())
                .bind(stored.body().map(|b| &b[..]))
                .execute(&mut *tx)
                .await
                .map_err(StoreError::from),
            Err(e) => Err(e),
        };
        match completed {
            Ok(done) if done.rows_affected() == 1 => {}
            Ok(_) => {
                // Another request with this key committed first (see TX_CLAIM).
                rollback(Some(tx)).await;
                record(Outcome::InFlight);
                return Ok(render(
                    &config,
                    &Rejection::InFlight {
                        retry_after: Duration::from_secs(1),
                    },
                ));
            }
            Err(e) => {
                rollback(Some(tx)).await;
                return Ok(unavailable(
                    e,
                    "store the answer; rolled back, answered 503",
                ));
            }
        }
        if let Err(e) = tx.commit().await {
            return Ok(unavailable(e.into(), "commit; answered 503"));
        }
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_ids_separate_scope_and_key() {
        assert_eq!(lock_id("a", "bc"), lock_id("a", "bc"));
        assert_ne!(lock_id("a", "bc"), lock_id("ab", "c"));
        assert_ne!(lock_id("", "k"), lock_id("t", "k"));
    }
}
