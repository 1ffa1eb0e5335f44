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
//! - a failed commit gives the client `503` with `Retry-After` and nothing is stored (also
//!   when the commit fails because the handler's own work conflicted with another
//!   transaction under `SERIALIZABLE`);
//! - a handler that answers after one of its statements failed (it caught a unique
//!   violation and answered its own `409`, say) left the transaction *aborted*: none of its
//!   writes can commit. The layer rolls them back to a savepoint it set before the handler
//!   ran, stores the handler's answer with the key, commits that, and gives the client the
//!   handler's answer; a retry replays it. (Roll back to a savepoint of your own to keep
//!   the writes made before the failure.)
//! - a concurrent duplicate gets `409` at once: the claim takes a transaction-scoped
//!   advisory lock with `pg_try_advisory_xact_lock`, which never waits (also when its payload
//!   differs: the first request's fingerprint is not visible before it commits, so the
//!   `422` comes with the retry);
//! - a process that dies mid-request leaves nothing behind: its connection drops, Postgres
//!   rolls back and releases the lock, and the retry runs at once (no lease to wait for).
//!
//! # Isolation levels
//!
//! The request's transaction has the connection's default isolation level unless
//! [`Transactional::with_isolation`] sets one. Every level keeps the guarantee — the handler
//! runs once per key — because the claim never decides from a snapshot alone: under the key's
//! lock it inserts the key's record, and the unique check of that insert sees every committed
//! record; one committed after the transaction's snapshot (`REPEATABLE READ`,
//! `SERIALIZABLE`) makes the claim start over, and the retry replays it. Under `SERIALIZABLE`
//! the layer's own reads happen outside the request's transaction and its completion finds
//! its record by row id, so the layer takes no predicate locks that would make requests with
//! different keys fail each other.
//!
//! # Session settings
//!
//! Everything the layer writes into its statements is ASCII: keys are ASCII, scopes reach the
//! store as a hex digest, answers as hex. Any other text is sent as hex and converted on the
//! server. So a pooled connection that application code left in another `client_encoding`
//! (SJIS, BIG5, GBK) or with `backslash_quote` or `standard_conforming_strings` changed cannot
//! change what a statement means.
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
//! escaped string and hex constants). A replay costs one: the claim's message, whose first
//! look returns the record; the transaction it opened is rolled back after the answer.
//! Replays, in-flight keys and mismatches make the server raise no error, so they leave
//! nothing in its log. The claim and the completion are the functions
//! `tower_idempotency_claim_tx` and `tower_idempotency_complete_tx` that
//! [`PostgresStore::migrate`] creates.
//!
//! The layer runs the transaction with its own `BEGIN` and `COMMIT` on a pooled connection;
//! should the request be dropped with the transaction open (a panic), the connection is
//! closed rather than returned to the pool, and Postgres rolls the transaction back. A
//! plain-mode request on the same table that claims a key while a transactional request
//! holds it waits for that transaction, then sees its outcome.
//!
//! Each keyed request holds one pooled connection for as long as its handler runs: size the
//! pool for the concurrency of your idempotent routes. A handler runs at most
//! [`Transactional::with_handler_timeout`] (30 s by default); past it the layer stops it and
//! rolls its transaction back, so a hung handler cannot hold its key and its connection. Work that leaves the database (a call to
//! a payment provider) is not rolled back; pass it a [derived key](crate::IdempotencyKey::derive)
//! so that the other side deduplicates the retry.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use sha2::{Digest, Sha256};
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Row};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};
use tower_service::Service;

use crate::answer::{answer_taken, render, to_store};
use crate::body::{RequestBody, ResponseBody};
use crate::error::{BoxError, StoreError};
use crate::mode::{Mode, Sealed};
use crate::outcome::{
    InFlightGauge, Operation, Outcome, Taken, log_store_error, record, store_call,
};
use crate::rejection::Rejection;
use crate::request::{Keyed, Prepared, prepare};
use crate::response::StoredResponse;
use crate::store::PostgresStore;
use crate::store::listen::wake_statement;
use crate::store::postgres::{
    LOCK_NOT_AVAILABLE, db_error, decode_response, is_serialization_failure, millis, sqlstate_is,
    status_column,
};
use crate::store::sql::{push_bounds, push_bytea, push_text};
use crate::wait::claim_or_wait;

/// A [`PostgresStore`] in transactional mode; made by
/// [`PostgresStore::transactional`]. Use it as the layer's store:
/// `IdempotencyLayer::new(store.transactional())`.
#[derive(Clone, Debug)]
pub struct Transactional {
    store: PostgresStore,
    isolation: Option<IsolationLevel>,
    handler_timeout: Option<Duration>,
}

/// How long a handler may run in transactional mode unless
/// [`Transactional::with_handler_timeout`] says otherwise.
pub const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(30);

/// The isolation level of the transaction that transactional mode opens for a request
/// ([`Transactional::with_isolation`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IsolationLevel {
    /// `READ COMMITTED`, Postgres's default.
    ReadCommitted,
    /// `REPEATABLE READ`.
    RepeatableRead,
    /// `SERIALIZABLE`.
    Serializable,
}

impl IsolationLevel {
    pub(crate) fn begin(self) -> &'static str {
        match self {
            Self::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Self::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Self::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }
}

impl PostgresStore {
    /// This store in transactional mode: the key's record and the handler's writes (made
    /// through [`IdempotentTx`]) commit in one transaction. See [`crate::transactional`].
    pub fn transactional(&self) -> Transactional {
        Transactional {
            store: self.clone(),
            isolation: None,
            handler_timeout: Some(DEFAULT_HANDLER_TIMEOUT),
        }
    }
}

impl Transactional {
    /// The store underneath (for purging, or for a plain-mode layer on the same table).
    pub fn store(&self) -> &PostgresStore {
        &self.store
    }

    /// The isolation level of each request's transaction. By default the transaction has the
    /// connection's default level (`default_transaction_isolation`: the server's, the
    /// database's or the role's setting, or the connection's options), as any `BEGIN` would.
    ///
    /// The layer is correct at every level: the handler runs once per key under `READ
    /// COMMITTED`, `REPEATABLE READ` and `SERIALIZABLE` alike, and under `SERIALIZABLE` the
    /// layer's own statements never make requests with different keys fail each other. A
    /// serialization failure caused by the handler's own work surfaces as the handler's
    /// statement failing (the handler decides the answer) or at the commit, which the layer
    /// answers `503` with `Retry-After`, having stored nothing.
    pub fn with_isolation(mut self, level: IsolationLevel) -> Self {
        self.isolation = Some(level);
        self
    }

    /// The longest a handler may run, from the claim to its answer's last byte (default
    /// [`DEFAULT_HANDLER_TIMEOUT`], 30 s; `Duration::ZERO`: no bound).
    ///
    /// While a handler runs, its request holds the key and a pooled connection with a
    /// transaction open: a handler that hangs (a remote call without a timeout, a lock that
    /// never comes) would hold both until the process restarts, and every retry of the key
    /// would get `409`. Past this bound the layer stops the handler (drops its future), rolls
    /// its transaction back, frees the key and answers `503`
    /// [`handler-timed-out`](crate::problems#handler-timed-out) with `Retry-After`; nothing
    /// of the handler's was committed, and a retry runs it again. A handler that moved a
    /// [`TxConn`] into a task of its own gets the same bound once more to drop it; then the
    /// layer ends the transaction from another connection (`pg_terminate_backend`).
    ///
    /// Work that leaves the database (a payment provider) is not undone by the rollback: give
    /// it a [derived key](crate::IdempotencyKey::derive) and a timeout shorter than this one.
    ///
    /// On the server, `idle_in_transaction_session_timeout` ends a transaction that waits
    /// between statements for too long (a process that hangs outside the layer's reach); set
    /// it for the application's role a little above this bound, so that it only acts when the
    /// layer cannot: `ALTER ROLE app SET idle_in_transaction_session_timeout = '35s'`.
    pub fn with_handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = (!timeout.is_zero()).then_some(timeout);
        self
    }
}

impl Mode for Transactional {}

/// The transaction of a keyed request in transactional mode, for the handler's own writes.
///
/// The layer inserts it into the request's extensions (and, with the `axum` feature, it is
/// an extractor). Clone it freely; all clones share the one transaction. The layer commits it
/// after the handler answers (or rolls it back, on a `5xx` or an error): never commit or roll
/// it back yourself, and do not keep a [`TxConn`] beyond the handler.
///
/// A statement that fails leaves a Postgres transaction *aborted*: nothing the handler wrote
/// before can commit any more. To recover from an expected error (a unique violation you turn
/// into your own `409`) and keep earlier writes, wrap the statement in a `SAVEPOINT` and roll
/// back to it. If the handler answers after a failure without doing so, the layer rolls its
/// writes back and stores the handler's answer on its own (see [`crate::transactional`]).
#[derive(Clone)]
pub struct IdempotentTx {
    slot: Arc<Mutex<Option<OpenTx>>>,
    /// The server process of the transaction's connection (`pg_backend_pid()`), to end the
    /// transaction from another connection when a handler never lets go of a [`TxConn`].
    backend: Option<i32>,
}

/// A borrowed connection inside the request's transaction; use `&mut *conn` as a sqlx
/// executor.
pub type TxConn<'a> = MappedMutexGuard<'a, PgConnection>;

/// Why [`IdempotentTx::conn`] gave no connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TxUnavailable {
    /// The layer already committed or rolled the transaction back (the handler kept the
    /// handle past its answer, or past [`Transactional::with_handler_timeout`]).
    #[error("the idempotent request's transaction has already ended")]
    Finished,
    /// A [`TxConn`] of this transaction is still held: drop it first. (Waiting for it could
    /// never end when the caller holds it itself.)
    #[error("the idempotent request's transaction is in use: a TxConn of it is still held")]
    InUse,
}

impl IdempotentTx {
    /// Borrows the transaction's connection for a statement or a few. Statements of one
    /// request run one at a time: hold one `TxConn` at a time, and drop it before asking for
    /// the next. This never waits.
    ///
    /// # Errors
    ///
    /// [`TxUnavailable::InUse`] while another `TxConn` of the transaction is held (by this
    /// task or another one of the handler's), [`TxUnavailable::Finished`] when the layer
    /// already ended the transaction.
    pub async fn conn(&self) -> Result<TxConn<'_>, TxUnavailable> {
        let slot = self.slot.try_lock().map_err(|_| TxUnavailable::InUse)?;
        MutexGuard::try_map(slot, |tx| tx.as_mut().and_then(|tx| tx.conn.as_deref_mut()))
            .map_err(|_| TxUnavailable::Finished)
    }

    /// Takes the transaction to end it; `Err` while the handler still holds a `TxConn` (it
    /// moved one into a task that outlives its answer).
    fn take(&self) -> Result<Option<OpenTx>, TxUnavailable> {
        let mut slot = self.slot.try_lock().map_err(|_| TxUnavailable::InUse)?;
        Ok(slot.take())
    }

    /// Rolls the transaction back and wakes the key's waiters; or, when a `TxConn` of it is
    /// still held, ends it once that is dropped, in the background: after `bound` at the
    /// latest, by ending its server process from another connection.
    async fn roll_back(&self, notify: Option<i64>, bound: Option<Duration>, pool: &PgPool) {
        match self.take() {
            Ok(tx) => rollback(tx, notify).await,
            Err(_) => self.roll_back_when_released(notify, bound, pool.clone()),
        }
    }

    fn roll_back_when_released(&self, notify: Option<i64>, bound: Option<Duration>, pool: PgPool) {
        tracing::error!(
            "idempotency: the handler still holds a TxConn of its transaction after its answer \
             (it moved one into a task of its own): the transaction stays open and holds the \
             key until that is dropped, then it is rolled back"
        );
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // Without a runtime, the transaction ends when the last handle goes: its
            // connection is closed and Postgres rolls it back.
            return;
        };
        let slot = self.slot.clone();
        let backend = self.backend;
        runtime.spawn(async move {
            let released = slot.clone().lock_owned();
            let guard = match bound {
                Some(bound) => tokio::time::timeout(bound, released).await.ok(),
                None => Some(released.await),
            };
            if let Some(mut guard) = guard {
                let tx = guard.take();
                drop(guard);
                rollback(tx, notify).await;
                return;
            }
            // Still held past the bound: end the transaction from outside. The connection
            // stays out of the pool (it is closed when the handler lets go of it), so the
            // server process is still this transaction's.
            let Some(pid) = backend else { return };
            let ended = sqlx::raw_sql(AssertSqlSafe(format!("SELECT pg_terminate_backend({pid})")))
                .execute(&pool)
                .await;
            match ended {
                Ok(_) => tracing::warn!(
                    pid,
                    "idempotency: ended a transaction whose handler held a TxConn past the \
                     handler timeout; its key is free"
                ),
                Err(e) => tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    pid,
                    "idempotency: could not end a transaction whose handler holds a TxConn; \
                     it holds its key until the TxConn is dropped"
                ),
            }
            // Keep the slot (and so the connection, marked to close) until the end.
            drop(slot);
        });
    }
}

impl std::fmt::Debug for IdempotentTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTx").finish_non_exhaustive()
    }
}

/// A pooled connection with a transaction open on it, which must never go back to the pool
/// open. The layer manages the transaction with its own statements (so that the claim's
/// answer comes back in the same message as `BEGIN`); sqlx's pool does not know about it.
/// Dropped while still holding the connection (a panic, a dropped request), it closes the
/// connection: Postgres rolls the transaction back and releases its locks.
pub(crate) struct OpenTx {
    pub(crate) conn: Option<PoolConnection<Postgres>>,
    /// The layer's bound on one store call: a rollback that takes longer closes the
    /// connection instead (Postgres then rolls back on its own).
    pub(crate) bound: Duration,
}

impl OpenTx {
    /// Rolls the transaction back and returns the connection to the pool (closing it if the
    /// rollback fails).
    /// Rolls back; then notifies `notify` (a payload) on the store's channel, to wake the
    /// waiters of the key this transaction held.
    pub(crate) async fn rollback(mut self, notify: Option<i64>) {
        let bound = self.bound;
        let rolled_back = async {
            let conn = self.conn()?;
            match notify {
                None => sqlx::raw_sql("ROLLBACK").execute(conn).await?,
                Some(hash) => {
                    let sql = format!("ROLLBACK; {}", wake_statement(hash));
                    sqlx::raw_sql(AssertSqlSafe(sql)).execute(conn).await?
                }
            };
            Ok::<_, StoreError>(())
        };
        match tokio::time::timeout(bound, rolled_back).await {
            Ok(Ok(())) => self.ended(),
            // Dropping `self` closes the connection: no transaction goes back to the pool.
            Ok(Err(e)) => tracing::debug!(error = &e as &dyn std::error::Error, "rollback failed"),
            Err(_) => tracing::debug!("rollback timed out; closing the connection"),
        }
    }

    /// Rolls back off the request's path.
    pub(crate) fn rollback_later(self) {
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::spawn(self.rollback(None));
        }
        // Without a runtime, the drop closes the connection instead.
    }

    /// The transaction ended (committed): the connection goes back to the pool as it is.
    pub(crate) fn ended(mut self) {
        drop(self.conn.take());
    }

    pub(crate) fn conn(&mut self) -> Result<&mut PgConnection, StoreError> {
        self.conn
            .as_deref_mut()
            .ok_or_else(|| StoreError::backend("the transaction's connection is gone"))
    }
}

impl Drop for OpenTx {
    fn drop(&mut self) {
        if let Some(conn) = &mut self.conn {
            conn.close_on_drop();
        }
    }
}

/// The name of the savepoint set right after the claim, before the handler runs.
const HANDLER_SAVEPOINT: &str = "tower_idempotency_handler";

/// How often a claim is tried again when it lost a race (a record committed after its
/// snapshot, or one that vanished between two looks) before answering "in flight".
const CLAIM_ATTEMPTS: usize = 3;

/// The `Retry-After` of a key held by another transaction (its end is not known).
const HELD_RETRY_AFTER: Duration = Duration::from_secs(1);

/// SQLSTATE 25P02: a statement was sent in a transaction that an earlier error aborted.
pub(crate) const IN_FAILED_TRANSACTION: &str = "25P02";

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

/// What a record returned by the claim batch means for this request: the key taken, or
/// (`None`) free again.
fn classify(row: &PgRow, fingerprint: &[u8]) -> Result<Option<Taken>, StoreError> {
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

/// The SQLSTATE of a database error.
pub(crate) fn sqlstate(err: &sqlx::Error) -> Option<std::borrow::Cow<'_, str>> {
    err.as_database_error().and_then(|db| db.code())
}

/// The record's columns, as the claim function returns them.
const RECORD_COLUMNS: &str = "k.fingerprint, k.lease_token, \
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
fn claim_batch(
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
fn checked_row_id(row: &str) -> Result<&str, StoreError> {
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
fn completion_batch(
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
        sql.push_str("; BEGIN ISOLATION LEVEL READ COMMITTED; SELECT tower_idempotency_wake(");
        sql.push_str(&hash.to_string());
        sql.push_str("); COMMIT");
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

/// The placeholder record of a key claimed in the request's transaction.
struct Placeholder {
    /// Its row id.
    row: String,
    scope: String,
    key: String,
    /// The server process of the transaction's connection.
    backend: Option<i32>,
    /// Whether the transaction runs at `READ COMMITTED` (each statement sees what was
    /// committed before it).
    read_committed: bool,
}

/// Opens the request's transaction with the key claimed in it (`Ok(Ok(_))`), or says who
/// holds the key (`Ok(Err(taken))`).
async fn claim(
    tx_mode: &Transactional,
    scope: &str,
    key: &str,
    fingerprint: &[u8],
    bound: Duration,
) -> Result<Result<(OpenTx, Placeholder), Taken>, StoreError> {
    let bounds = tx_mode.store.bounds();
    let batch = claim_batch(scope, key, fingerprint, tx_mode.isolation, bounds)?;
    for _ in 0..CLAIM_ATTEMPTS {
        let conn = tx_mode.store.pool().acquire().await.map_err(db_error)?;
        // From here a drop (the request went away mid-batch) closes the connection, so no
        // transaction can go back to the pool open.
        let mut tx = OpenTx {
            conn: Some(conn),
            bound,
        };
        let rows = sqlx::raw_sql(AssertSqlSafe(batch.as_str()))
            .fetch_all(tx.conn()?)
            .await;
        let rows = match rows {
            Ok(rows) => rows,
            // A record committed after this transaction's snapshot (REPEATABLE READ,
            // SERIALIZABLE): claim again; the look will find it. The connection is closed
            // (by the drop), which also ends the failed transaction.
            Err(e) if is_serialization_failure(&e) => continue,
            // Another transaction holds the key's row past the store's lock timeout (a purge's
            // batch, a plain-mode claim's takeover): the key is in flight, as plain mode says.
            Err(e) if sqlstate_is(&e, LOCK_NOT_AVAILABLE) => {
                tx.rollback_later();
                return Ok(Err(Taken::InFlight(HELD_RETRY_AFTER)));
            }
            Err(e) => return Err(tx_mode.store.error(e)),
        };
        let step = |name: &str| {
            rows.iter()
                .find(|r| r.try_get::<&str, _>("step").ok() == Some(name))
        };
        if let Some(look) = step("look")
            && let Some(taken) = classify(look, fingerprint)?
        {
            tx.rollback_later();
            return Ok(Err(taken));
        }
        let Some(claim) = step("claim") else {
            return Err(StoreError::Corrupt("the claim returned no row".into()));
        };
        let outcome: &str = claim.try_get("outcome")?;
        match outcome {
            "acquired" => {
                let row: String = claim.try_get("claimed_row")?;
                let placeholder = Placeholder {
                    row,
                    scope: scope.to_owned(),
                    key: key.to_owned(),
                    backend: claim.try_get("backend").ok(),
                    read_committed: claim.try_get::<&str, _>("isolation").ok()
                        == Some("read committed"),
                };
                return Ok(Ok((tx, placeholder)));
            }
            "held" => {
                tx.rollback_later();
                return Ok(Err(Taken::InFlight(HELD_RETRY_AFTER)));
            }
            _ => {
                let taken = classify(claim, fingerprint)?;
                tx.rollback_later();
                if let Some(taken) = taken {
                    return Ok(Err(taken));
                }
                // Gone (released or purged) between the insert and the read: claim again.
            }
        }
    }
    Ok(Err(Taken::InFlight(HELD_RETRY_AFTER)))
}

async fn rollback(tx: Option<OpenTx>, notify: Option<i64>) {
    if let Some(tx) = tx {
        tx.rollback(notify).await;
    }
}

/// How the completion ended.
enum Completion {
    /// The key and the handler's writes committed.
    Committed,
    /// The handler's writes were rolled back (it left the transaction aborted); its answer was
    /// stored with the key.
    StoredAlone,
    /// Nothing committed.
    Failed(sqlx::Error),
}

/// Stores the answer and commits. If the handler left the transaction aborted (a statement
/// failed and was not rolled back to a savepoint), its writes cannot commit: they are rolled
/// back to the savepoint set before it ran, and its answer is stored with the key alone, in
/// the same transaction (the key's lock is never let go in between).
async fn complete(
    mut tx: OpenTx,
    claimed: &Placeholder,
    ttl: Duration,
    stored: &StoredResponse,
    bounds: (Duration, Duration),
    notify: Option<i64>,
) -> Result<Completion, StoreError> {
    let batch = completion_batch(claimed, ttl, stored, false, bounds, notify)?;
    let done = run_completion(tx.conn()?, batch).await;
    let err = match done {
        Ok(_) => {
            tx.ended();
            return Ok(Completion::Committed);
        }
        Err(e) => e,
    };
    if sqlstate(&err).as_deref() != Some(IN_FAILED_TRANSACTION) {
        tx.rollback_later();
        return Ok(Completion::Failed(err));
    }
    let batch = completion_batch(claimed, ttl, stored, true, bounds, notify)?;
    let done = run_completion(tx.conn()?, batch).await;
    Ok(match done {
        Ok(_) => {
            tx.ended();
            Completion::StoredAlone
        }
        Err(e) => {
            tx.rollback_later();
            Completion::Failed(e)
        }
    })
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

        let claim = || {
            let claim = claim(
                &self,
                &scope,
                key.as_str(),
                fingerprint.as_bytes(),
                config.store_timeout,
            );
            store_call(Operation::Claim, config.store_timeout, claim)
        };
        let claimed = claim_or_wait(&config, &self.store, &scope, &key, claim).await;
        let (tx, placeholder) = match claimed {
            Ok(Ok(claimed)) => claimed,
            Ok(Err(taken)) => return Ok(answer_taken(&config, taken)),
            Err(e) => return Ok(unavailable(e, "claim a key; answered 503")),
        };
        record(Outcome::Executed);
        let _in_flight = InFlightGauge::start();

        // From here a drop (a panic, or a request dropped with run-to-completion off) drops
        // the transaction: its connection is closed, Postgres rolls it back and releases the
        // key's lock.
        let handle = IdempotentTx {
            slot: Arc::new(Mutex::new(Some(tx))),
            backend: placeholder.backend,
        };
        parts.extensions.insert(key.clone());
        parts.extensions.insert(handle.clone());
        let req = Request::from_parts(
            parts,
            RequestBody::buffered(buffered.chunks, buffered.trailers),
        );
        // Rolled back: the key is free again, and its waiters (if the store wakes them)
        // claim it.
        let notify = self.store.notification(&scope, &key);
        let bound = self.handler_timeout;
        let pool = self.store.pool();
        let handled = async {
            let response = inner.call(req).await?;
            Ok(to_store(&config, response).await)
        };
        let handled = match bound {
            Some(bound) => tokio::time::timeout(bound, handled).await,
            None => Ok(handled.await),
        };
        let (mut response, stored) = match handled {
            Ok(Ok(handled)) => handled,
            Ok(Err(e)) => {
                handle.roll_back(notify, bound, pool).await;
                return Err(e);
            }
            // The handler's future is dropped: whatever `TxConn` it held in it is let go.
            Err(_) => {
                tracing::warn!(
                    timeout = ?bound,
                    "idempotency: the handler ran past its time bound; stopped, its \
                     transaction rolled back, answered 503"
                );
                handle.roll_back(notify, bound, pool).await;
                return Ok(render(&config, &Rejection::HandlerTimedOut));
            }
        };
        let Some(stored) = stored else {
            // A 5xx, or a body that failed: roll the handler's writes back.
            handle.roll_back(notify, bound, pool).await;
            return Ok(response);
        };
        let tx = match handle.take() {
            Ok(Some(tx)) => tx,
            // Nothing committed: the answer is not the client's to keep.
            Ok(None) | Err(_) => {
                handle.roll_back(notify, bound, pool).await;
                return Ok(render(&config, &Rejection::StoreUnavailable));
            }
        };
        let bounds = self.store.bounds();
        let completion = complete(tx, &placeholder, config.ttl, &stored.answer, bounds, notify);
        // A timeout here leaves the outcome unknown: the connection is closed with the
        // transaction (dropped with the completion), and the COMMIT, if the server got it,
        // may have happened. The client gets 503; its retry replays the answer if it did,
        // and runs the handler if it did not.
        match store_call(Operation::Commit, config.store_timeout, completion).await {
            Ok(Completion::Committed) => {
                stored.restore(&mut response);
                Ok(response)
            }
            Ok(Completion::StoredAlone) => {
                tracing::warn!(
                    status = stored.answer.status().as_u16(),
                    "the idempotent handler answered after a statement of its transaction \
                     failed: its writes were rolled back, and its answer was stored with the key"
                );
                stored.restore(&mut response);
                Ok(response)
            }
            // The handler's own work conflicted with another transaction's, found at the
            // commit: nothing committed, and a retry may well succeed.
            Ok(Completion::Failed(e)) if is_serialization_failure(&e) => Ok(unavailable(
                db_error(e),
                "commit (serialization failure); rolled back, answered 503",
            )),
            Ok(Completion::Failed(e)) => Ok(unavailable(
                self.store.error(e),
                "store the answer and commit; rolled back, answered 503",
            )),
            Err(e) => Ok(unavailable(
                e,
                "store the answer; rolled back, answered 503",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_open_and_end_the_transaction_themselves() {
        let unbounded = (Duration::ZERO, Duration::ZERO);
        let claim = claim_batch("t", "k", &[1, 2], None, unbounded).unwrap();
        assert!(claim.starts_with("BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY; SELECT 'look'"));
        assert!(claim.contains("; COMMIT; BEGIN; SELECT set_config("));
        assert!(claim.contains(
            "true); SELECT 'claim' AS step, c.*, pg_backend_pid() AS backend, \
                 current_setting('transaction_isolation') AS isolation \
                 FROM tower_idempotency_claim_tx("
        ));
        assert!(claim.contains(",E't',E'k',decode('0102','hex')) AS c; SELECT set_config("));
        assert!(claim.ends_with("true); SAVEPOINT tower_idempotency_handler"));
        let serializable = claim_batch(
            "t",
            "k",
            &[1],
            Some(IsolationLevel::Serializable),
            unbounded,
        )
        .unwrap();
        assert!(serializable.contains("; COMMIT; BEGIN ISOLATION LEVEL SERIALIZABLE; SELECT"));
        // The store's bounds hold for the look and the claim, and are put back after it.
        let bounded = (Duration::from_secs(5), Duration::from_secs(1));
        let claim = claim_batch("t", "k", &[1], None, bounded).unwrap();
        let set = "SET LOCAL statement_timeout = 5000; SET LOCAL lock_timeout = 1000; ";
        assert_eq!(claim.matches(set).count(), 2, "{claim}");
        let restored = claim.find("set_config('statement_timeout'").unwrap();
        assert!(restored > claim.find("tower_idempotency_claim_tx").unwrap());
        let stored = StoredResponse::new(
            http::StatusCode::CREATED,
            http::HeaderMap::new(),
            Bytes::from_static(b"{}"),
        );
        let placeholder = Placeholder {
            row: "(0,7)".into(),
            scope: "t".into(),
            key: "k".into(),
            backend: None,
            read_committed: false,
        };
        let ttl = Duration::from_secs(1);
        let done = completion_batch(&placeholder, ttl, &stored, false, unbounded, None).unwrap();
        assert_eq!(done.through_commit, 2);
        assert_eq!(
            done.sql,
            "SELECT tower_idempotency_complete_tx('(0,7)',E't',E'k',1000,201::smallint,\
             decode('','hex'),decode('7b7d','hex')); COMMIT"
        );
        let again = completion_batch(&placeholder, ttl, &stored, true, bounded, Some(42)).unwrap();
        assert_eq!(again.through_commit, 5);
        let again = again.sql;
        assert!(again.starts_with(
            "ROLLBACK TO SAVEPOINT tower_idempotency_handler; SET LOCAL statement_timeout = 5000; \
             SET LOCAL lock_timeout = 1000; SELECT "
        ));
        // Above READ COMMITTED the wake-up comes after the request's COMMIT, in a transaction
        // of its own that sees the waiters registered while the handler ran.
        assert!(again.ends_with(
            ",decode('7b7d','hex')); COMMIT; BEGIN ISOLATION LEVEL READ COMMITTED; \
             SELECT tower_idempotency_wake(42); COMMIT"
        ));
        // At READ COMMITTED the completion's own statement looks, with a snapshot of its own.
        let read_committed = Placeholder {
            read_committed: true,
            ..placeholder
        };
        let rc =
            completion_batch(&read_committed, ttl, &stored, false, unbounded, Some(42)).unwrap();
        assert_eq!(rc.through_commit, 2);
        assert!(
            rc.sql.ends_with(",decode('7b7d','hex'),42); COMMIT"),
            "{}",
            rc.sql
        );
    }

    #[test]
    fn row_ids_are_checked_before_they_reach_a_statement() {
        assert!(checked_row_id("(12,3)").is_ok());
        for bad in [
            "",
            "()",
            "(1,)",
            "(,1)",
            "(1,2",
            "(1,2);DROP",
            "(1;2)",
            "('1',2)",
        ] {
            assert!(checked_row_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn lock_ids_separate_scope_and_key() {
        assert_eq!(lock_id("a", "bc"), lock_id("a", "bc"));
        assert_ne!(lock_id("a", "bc"), lock_id("ab", "c"));
        assert_ne!(lock_id("", "k"), lock_id("t", "k"));
    }
}
