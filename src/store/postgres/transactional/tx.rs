//! [`IdempotentTx`]: the request's transaction as the handler borrows it, and the open
//! transaction the layer holds.

use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres};
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

use crate::error::StoreError;
use crate::store::listen::wake_statement;

use super::*;

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
///
/// Never call `sqlx::Connection::begin` (or `Acquire::begin`) on this connection. The layer
/// opened the transaction with its own `BEGIN`, which sqlx does not count, so sqlx sends a
/// second `BEGIN` (Postgres only warns) and the `commit()` or `rollback()` of what it returns,
/// or its drop, ends the *layer's* transaction: the key's record commits or rolls back in the
/// middle of the handler, a duplicate can take the key over and run it again, and the
/// statements after it run outside any transaction. For a nested transaction, send
/// `SAVEPOINT name`, `ROLLBACK TO SAVEPOINT name` and `RELEASE SAVEPOINT name` yourself.
#[derive(Clone)]
pub struct IdempotentTx {
    pub(super) slot: Arc<Mutex<Option<OpenTx>>>,
    /// The server process of the transaction's connection (`pg_backend_pid()`), to end the
    /// transaction from another connection when a handler never lets go of a [`TxConn`].
    pub(super) backend: Option<i32>,
}

/// A borrowed connection inside the request's transaction; use `&mut *conn` as a sqlx
/// executor. Never `begin` a sqlx transaction on it: see [`IdempotentTx`].
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
    pub(super) fn take(&self) -> Result<Option<OpenTx>, TxUnavailable> {
        let mut slot = self.slot.try_lock().map_err(|_| TxUnavailable::InUse)?;
        Ok(slot.take())
    }

    /// Rolls the transaction back and wakes the key's waiters; or, when a `TxConn` of it is
    /// still held, ends it once that is dropped, in the background: after `bound` at the
    /// latest, by ending its server process from another connection.
    pub(super) async fn roll_back(
        &self,
        notify: Option<i64>,
        bound: Option<Duration>,
        pool: &PgPool,
    ) {
        match self.take() {
            Ok(tx) => rollback(tx, notify).await,
            Err(_) => self.roll_back_when_released(notify, bound, pool.clone()),
        }
    }

    pub(super) fn roll_back_when_released(
        &self,
        notify: Option<i64>,
        bound: Option<Duration>,
        pool: PgPool,
    ) {
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
