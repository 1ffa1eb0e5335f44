//! Phased mode: the key is claimed and committed first, the handler runs with no transaction
//! open, and its work commits in short phases with recovery points; the last phase commits
//! with the key's answer (feature `postgres`).
//!
//! Transactional mode holds one transaction, and one pooled connection, for the whole
//! handler: right for work that stays in the database, wrong for a handler that calls out (a
//! payment provider, an e-mail service). Its transaction would sit `idle in transaction` for
//! the whole remote call, holding locks and a connection, and behind a pooler in transaction
//! mode a server connection too. Phased mode holds none of them while the handler waits:
//!
//! 1. **The claim** is committed on its own, as in plain mode: the key gets an in-progress
//!    record with a lease and a fencing token; the lease is renewed while the handler runs.
//!    A duplicate gets `409` (or waits, with
//!    [`with_wait_for_completion`](crate::IdempotencyLayer::with_wait_for_completion)).
//!    A new key's claim commits without waiting for its WAL flush: it is a lease, not a
//!    result, and every phase after it is fenced by its token and flushed, which flushes the
//!    claim with it. A database crash that loses a claim loses no answer and no phase: the
//!    request that held it has its next phase refused, and a retry claims the key anew.
//! 2. **Phases**: [`Phases::step`] runs a piece of the handler's database work in a short
//!    transaction of its own and commits it together with a **recovery point**, the step's
//!    name and a small state (a payment's ID, say). No transaction is open between steps:
//!    call the provider there, with a [derived key](crate::IdempotencyKey::derive).
//! 3. **The last phase**: [`Phases::tx`] opens the transaction that commits with the answer.
//!    The handler writes its final changes in it and answers; the layer stores the answer in
//!    that transaction and commits, so the writes and the answer commit together. A handler
//!    that never calls it has its answer stored on its own.
//!
//! A request that dies between phases (a crash, a `5xx`, an error) leaves its committed steps
//! on the key's record. The retry with the same key and payload takes the key over (at once
//! after a `5xx` or an error, after the lease after a crash) and runs the handler again from
//! the top: each step that committed before returns its recorded state without running, so
//! the work resumes after the last committed step. Work between steps runs again: it must be
//! idempotent itself, as a call with a derived key is.
//!
//! Every phase is fenced by the claim's token: once another request took the key over (the
//! lease ran out), a step of the first request commits nothing and reports
//! [`PhaseError::LeaseLost`], and its last phase is rolled back when the layer stores the
//! answer (the client gets `503`; its retry replays the other request's answer).
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use tower_idempotency::{IdempotencyLayer, PostgresStore, phased::Phases};
//!
//! async fn pay(phases: Phases) -> Result<(http::StatusCode, String), http::StatusCode> {
//!     let fail = |_| http::StatusCode::SERVICE_UNAVAILABLE;
//!     // The first phase, committed with its recovery point: the payment is pending.
//!     let id: i64 = phases
//!         .step("pending", async |conn| {
//!             sqlx::query_scalar("INSERT INTO payments (status) VALUES ('pending') RETURNING id")
//!                 .fetch_one(conn)
//!                 .await
//!         })
//!         .await
//!         .map_err(fail)?;
//!     // No transaction is open: call the provider, with a key derived from the request's.
//!     let charge = format!("ch_{id}"); // provider.charge(phases.key().derive("charge")).await
//!     // The last phase: its writes commit with the answer.
//!     let mut tx = phases.tx().await.map_err(|_| http::StatusCode::SERVICE_UNAVAILABLE)?;
//!     sqlx::query("UPDATE payments SET status = 'charged', charge = $1 WHERE id = $2")
//!         .bind(&charge)
//!         .bind(id)
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|_| http::StatusCode::SERVICE_UNAVAILABLE)?;
//!     Ok((http::StatusCode::CREATED, charge))
//! }
//!
//! # async fn run(pool: sqlx::PgPool) -> Result<(), tower_idempotency::StoreError> {
//! let store = PostgresStore::new(pool);
//! store.migrate().await?;
//! let app: Router = Router::new()
//!     .route("/payments", post(pay))
//!     .layer(IdempotencyLayer::new(store.phased()));
//! # Ok(()) }
//! ```
//!
//! (The [`Phases`] extractor needs the `axum` feature; without it, read the [`Phases`] from
//! the request's extensions.)
//!
//! # What each outcome leaves
//!
//! | the handler | the key | a retry |
//! |---|---|---|
//! | answers `2xx`/`4xx` | completed with the answer, in the last phase's commit | replays it |
//! | answers `5xx`, fails, or is dropped | claim ended, committed steps kept (none: record deleted) | runs at once, resuming after the last step |
//! | its process dies | held until the lease runs out | after the lease, resumes after the last step |
//! | the last phase's commit fails | nothing of it committed; `503` with `Retry-After` | resumes after the last step |
//!
//! # Isolation levels
//!
//! Each phase's transaction has the connection's default isolation level, or the one
//! [`Phased::with_isolation`] sets. At `READ COMMITTED` a phase locks the key's record only
//! with its last statement, just before its commit, and the lease is renewed while it works.
//! At `REPEATABLE READ` and `SERIALIZABLE` the fence statement that opens a phase locks the
//! record and extends the lease before anything else, so no renewal can commit between the
//! phase's snapshot and its update of the record, and none is tried until the phase ends
//! (no other request can take the locked record over meanwhile). Either way a phase that
//! works longer than the lease keeps the key, and each step's commit extends the lease, and
//! the record's life with it, from the moment it commits. The layer's statements add no
//! serialization failures of their own at any level.
//!
//! # Connections
//!
//! The claim, each step and the last phase take a pooled connection for as long as their
//! statements run, and no longer: between them (while the provider is called) the request
//! holds none. Recovery points are bounded: the names and states of one key take at most
//! 64 KiB ([`PhaseError::StateTooLarge`]).

use std::sync::Arc;
use std::sync::atomic::AtomicU8;
use std::time::Duration;

use crate::mode::Mode;
use crate::store::PostgresStore;
use crate::transactional::{DEFAULT_HANDLER_TIMEOUT, IsolationLevel};

/// A [`PostgresStore`] in phased mode; made by [`PostgresStore::phased`]. Use it as the
/// layer's store: `IdempotencyLayer::new(store.phased())`. See [`crate::phased`].
#[derive(Clone, Debug)]
pub struct Phased {
    store: PostgresStore,
    isolation: Option<IsolationLevel>,
    /// The connections' default isolation level, once a phase found it (when
    /// [`Phased::with_isolation`] set none): [`LEVEL_UNKNOWN`] or a [`level_code`].
    default_level: Arc<AtomicU8>,
    /// The largest request kept for a completer ([`Phased::with_resumable_requests`]).
    resumable: Option<usize>,
    /// The longest a handler may run ([`Phased::with_handler_timeout`]).
    handler_timeout: Option<Duration>,
}

/// [`Phased::default_level`] before a phase found the level.
const LEVEL_UNKNOWN: u8 = 0;

/// An isolation level as [`Phased::default_level`] keeps it.
fn level_code(level: IsolationLevel) -> u8 {
    match level {
        IsolationLevel::ReadCommitted => 1,
        IsolationLevel::RepeatableRead => 2,
        IsolationLevel::Serializable => 3,
    }
}

/// The level `transaction_isolation` names.
fn level_named(name: &str) -> Option<IsolationLevel> {
    match name {
        "read committed" | "read uncommitted" => Some(IsolationLevel::ReadCommitted),
        "repeatable read" => Some(IsolationLevel::RepeatableRead),
        "serializable" => Some(IsolationLevel::Serializable),
        _ => None,
    }
}

impl PostgresStore {
    /// This store in phased mode: the key is claimed first, the handler commits its work in
    /// phases with recovery points and calls out with no transaction open, and its last
    /// phase commits with the answer. See [`crate::phased`].
    pub fn phased(&self) -> Phased {
        Phased {
            store: self.clone(),
            isolation: None,
            default_level: Arc::new(AtomicU8::new(LEVEL_UNKNOWN)),
            resumable: None,
            handler_timeout: Some(DEFAULT_HANDLER_TIMEOUT),
        }
    }
}

impl Phased {
    /// The store underneath.
    pub fn store(&self) -> &PostgresStore {
        &self.store
    }

    /// The isolation level of each phase's transaction (by default the connection's
    /// default). Every level keeps the guarantees; see [`crate::phased`].
    pub fn with_isolation(mut self, level: IsolationLevel) -> Self {
        self.isolation = Some(level);
        self
    }

    /// Keeps each request (method, path, headers and body, encoded) with its key's record
    /// from its first step until it completes, so that a completer
    /// ([`Phased::complete_abandoned`], [`spawn_completer`]) can run it again when its process
    /// died and no retry came. Requests of more than `max_bytes` encoded are not kept (their
    /// retries still resume).
    ///
    /// The kept headers include the request's credentials (the completer must present them
    /// again for the layer's scope and the handler's authorization): they stay in the keys
    /// table until the key completes. Turn this on only where that is acceptable.
    pub fn with_resumable_requests(mut self, max_bytes: usize) -> Self {
        self.resumable = Some(max_bytes);
        self
    }

    /// The longest a handler may run, from the claim to its answer's last byte (default
    /// [`DEFAULT_HANDLER_TIMEOUT`], 30 s; `Duration::ZERO`: no bound).
    ///
    /// A handler that hangs in its last phase holds a pooled connection with a transaction
    /// open, and locks: at `REPEATABLE READ` and `SERIALIZABLE` the key's record itself, so
    /// every retry would get `409` until the process restarts. Past this bound the layer
    /// stops the handler (drops its future, and the phase's transaction with it, which
    /// Postgres rolls back), ends the claim and answers `503`
    /// [`handler-timed-out`](crate::problems#handler-timed-out) with `Retry-After`. The steps
    /// that committed stay, and the retry resumes after them; a step whose commit was under
    /// way when the handler was stopped keeps the claim until its lease runs out (it may have
    /// committed).
    ///
    /// Give the handler's remote calls timeouts shorter than this one: a remote call stopped
    /// half-way is repeated by the retry, with its [derived key](crate::IdempotencyKey::derive).
    pub fn with_handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = (!timeout.is_zero()).then_some(timeout);
        self
    }
}

impl Mode for Phased {}

mod completer;

pub use completer::{CompleterRun, spawn_completer};

mod run;
mod state;
mod steps;

pub use state::PhaseState;
pub use steps::{PhaseError, Phases};
