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
//!   the writes made before the failure: SQL `SAVEPOINT` and `ROLLBACK TO SAVEPOINT`, never
//!   `sqlx::Connection::begin` on the request's connection, which would end the layer's
//!   transaction; see [`IdempotentTx`].)
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

use std::time::Duration;

use crate::mode::Mode;
use crate::store::PostgresStore;

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

mod batches;
mod run;
mod tx;

use batches::*;
use run::*;

pub(crate) use batches::{CompletionBatch, run_completion};
pub(crate) use tx::OpenTx;
pub use tx::{IdempotentTx, TxConn, TxUnavailable};

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::response::StoredResponse;

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
        assert!(
            claim.contains(",E't',E'k',pg_catalog.decode('0102','hex')) AS c; SELECT set_config(")
        );
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
             pg_catalog.decode('','hex'),pg_catalog.decode('7b7d','hex')); COMMIT"
        );
        let again = completion_batch(&placeholder, ttl, &stored, true, bounded, Some(42)).unwrap();
        assert_eq!(again.through_commit, 5);
        let again = again.sql;
        assert!(again.starts_with(
            "ROLLBACK TO SAVEPOINT tower_idempotency_handler; SET LOCAL statement_timeout = 5000; \
             SET LOCAL lock_timeout = 1000; SELECT "
        ));
        // Above READ COMMITTED the wake-up comes after the request's COMMIT, in an implicit
        // transaction of its own that sees the waiters registered while the handler ran.
        assert!(again.ends_with(
            ",pg_catalog.decode('7b7d','hex')); COMMIT; SELECT tower_idempotency_wake(42)"
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
            rc.sql
                .ends_with(",pg_catalog.decode('7b7d','hex'),42); COMMIT"),
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
