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
//! [`Phased::with_isolation`] sets. The fence statement that opens a phase locks the key's
//! record before anything else, so no lease renewal can commit between the phase's snapshot
//! and its update of the record; the layer's statements add no serialization failures of
//! their own at any level.
//!
//! # Connections
//!
//! The claim, each step and the last phase take a pooled connection for as long as their
//! statements run, and no longer: between them (while the provider is called) the request
//! holds none. Recovery points are bounded: the names and states of one key take at most
//! 64 KiB ([`PhaseError::StateTooLarge`]).

use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex as SyncMutex};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, Row};
use tokio::sync::{Mutex, MutexGuard, OwnedMutexGuard};
use tokio::time::Instant;
use tower_service::Service;

use crate::answer::{answer_taken, render, to_store};
use crate::body::{RequestBody, ResponseBody};
use crate::error::{BoxError, StoreError};
use crate::key::IdempotencyKey;
use crate::mode::{Mode, Sealed};
use crate::outcome::{
    InFlightGauge, Operation, Outcome, acquired_or_taken, lease_lost, log_store_error, record,
    store_call,
};
use crate::plain::Lease;
use crate::rejection::Rejection;
use crate::request::{Keyed, Prepared, prepare};
use crate::response::StoredResponse;
use crate::store::PostgresStore;
use crate::store::listen::wake_statement;
use crate::store::postgres::phases::{
    self, MAX_PHASES_BYTES, NOT_HELD, Recorded, begin_batch, complete_statement, fence_batch,
    read_statement, record_batch, yield_statement,
};
use crate::store::postgres::{db_error, is_serialization_failure};
use crate::store::{ClaimRequest, LeaseToken, Store};
use crate::transactional::{
    CompletionBatch, IN_FAILED_TRANSACTION, IsolationLevel, OpenTx, TxConn, run_completion,
    sqlstate,
};
use crate::wait::claim_or_wait;

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
}

impl Mode for Phased {}

mod completer;

pub use completer::{CompleterRun, spawn_completer};

/// A value a step records as its state, to be given back when a retry resumes after it.
///
/// Implemented for `()`, byte and text buffers, integers, `bool` and pairs of them. For a
/// struct, record what the later phases need to find the rest (an ID), or encode it yourself
/// into `Vec<u8>` (with serde, say).
pub trait PhaseState: Sized {
    /// The state's bytes.
    fn to_state(&self) -> Vec<u8>;
    /// The value back from its bytes; `None` when they are not one.
    fn from_state(state: &[u8]) -> Option<Self>;
}

impl PhaseState for () {
    fn to_state(&self) -> Vec<u8> {
        Vec::new()
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        state.is_empty().then_some(())
    }
}

impl PhaseState for Vec<u8> {
    fn to_state(&self) -> Vec<u8> {
        self.clone()
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        Some(state.to_vec())
    }
}

impl PhaseState for Bytes {
    fn to_state(&self) -> Vec<u8> {
        self.to_vec()
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        Some(Bytes::copy_from_slice(state))
    }
}

impl PhaseState for String {
    fn to_state(&self) -> Vec<u8> {
        self.as_bytes().to_vec()
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        String::from_utf8(state.to_vec()).ok()
    }
}

impl PhaseState for bool {
    fn to_state(&self) -> Vec<u8> {
        vec![u8::from(*self)]
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        match state {
            [0] => Some(false),
            [1] => Some(true),
            _ => None,
        }
    }
}

macro_rules! int_state {
    ($($t:ty),*) => {$(
        impl PhaseState for $t {
            fn to_state(&self) -> Vec<u8> {
                self.to_be_bytes().to_vec()
            }
            fn from_state(state: &[u8]) -> Option<Self> {
                state.try_into().ok().map(<$t>::from_be_bytes)
            }
        }
    )*};
}
int_state!(i32, i64, u32, u64, i128, u128);

impl<A: PhaseState, B: PhaseState> PhaseState for (A, B) {
    fn to_state(&self) -> Vec<u8> {
        let a = self.0.to_state();
        let b = self.1.to_state();
        // A state longer than u32::MAX cannot be recorded anyway (the bound is 64 KiB): the
        // length saturates, and decoding such a pair fails.
        let len = u32::try_from(a.len()).unwrap_or(u32::MAX);
        let mut out = Vec::with_capacity(4 + a.len() + b.len());
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&a);
        out.extend_from_slice(&b);
        out
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        let (len, rest) = state.split_first_chunk::<4>()?;
        let len = usize::try_from(u32::from_be_bytes(*len)).ok()?;
        let (a, b) = rest.split_at_checked(len)?;
        Some((A::from_state(a)?, B::from_state(b)?))
    }
}

/// Why a phase committed nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PhaseError<E = Infallible> {
    /// The step's work returned an error; its transaction was rolled back.
    #[error("the phase's work failed")]
    Work(#[source] E),
    /// The claim's lease was lost: another request took the key over (this one ran past its
    /// lease without renewing it). Nothing was committed, and nothing more can be: answer
    /// with an error (the other request's answer is the one that is stored).
    #[error("the idempotency key's lease was lost to another request; nothing was committed")]
    LeaseLost,
    /// The work returned `Ok` but a statement of it had failed, which aborted the
    /// transaction; nothing was committed. (Roll back to a savepoint of your own to go on
    /// after an expected failure.)
    #[error("the phase's transaction was aborted by a failed statement; nothing was committed")]
    Aborted,
    /// The recorded states of the key would take more than 64 KiB.
    #[error("the phases' recorded states would take more than {MAX_PHASES_BYTES} bytes")]
    StateTooLarge,
    /// A step name is empty or longer than 255 bytes, a step was taken after the last phase
    /// was opened, or a resumed step's recorded state does not decode as the type asked for
    /// (the handler changed between the attempts).
    #[error("phases misused: {0}")]
    Misuse(&'static str),
    /// The last phase's connection is in use (a [`TxConn`] of it is still held), or its
    /// transaction already ended.
    #[error("the last phase's transaction is in use or has ended")]
    Unavailable,
    /// The database failed; the phase's transaction was rolled back (or, when the commit
    /// itself failed, its outcome is unknown: the retry finds out).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The phases of a keyed request in phased mode: its steps with their recovery points, and
/// its last transaction, committed with the answer. See [`crate::phased`].
///
/// The layer inserts it into the request's extensions (and, with the `axum` feature, it is
/// an extractor). Clones share the request's phases.
#[derive(Clone)]
pub struct Phases {
    inner: Arc<Inner>,
}

struct Inner {
    store: PostgresStore,
    scope: String,
    key: IdempotencyKey,
    token: LeaseToken,
    lease: Duration,
    store_timeout: Duration,
    begin: &'static str,
    isolation: Option<IsolationLevel>,
    default_level: Arc<AtomicU8>,
    signal: Lease,
    /// The step a resumed request found last committed.
    resumed_after: Option<String>,
    /// Every committed step, oldest first: those found on the record, then this request's.
    recorded: SyncMutex<Recorded>,
    /// Held while a phase's transaction holds the key's record (renewals wait their turn:
    /// the record is locked, and the phase's fence extended the lease).
    row: Arc<Mutex<()>>,
    /// The last phase's transaction, once opened.
    last: Mutex<Option<LastTx>>,
    /// The request, encoded, to keep with the first step ([`Phased::with_resumable_requests`]);
    /// `None` once kept.
    request: SyncMutex<Option<Vec<u8>>>,
    /// A step's commit failed with its outcome unknown: it may have committed.
    uncertain: std::sync::atomic::AtomicBool,
}

struct LastTx {
    tx: OpenTx,
    read_committed: bool,
    /// Opened by [`fence_batch`]: the record is found by the row id it kept.
    fenced: bool,
    _row: OwnedMutexGuard<()>,
}

impl std::fmt::Debug for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Phases")
            .field("key", &self.inner.key)
            .field("resumed_after", &self.inner.resumed_after)
            .finish_non_exhaustive()
    }
}

/// The longest step name.
const MAX_NAME: usize = 255;

impl Phases {
    /// The request's idempotency key (derive the keys of remote calls from it).
    pub fn key(&self) -> &IdempotencyKey {
        &self.inner.key
    }

    /// The last step committed by an earlier attempt of this request, when this one resumes
    /// it; `None` for a first attempt (or one whose predecessors committed no step).
    pub fn recovery_point(&self) -> Option<&str> {
        self.inner.resumed_after.as_deref()
    }

    /// Whether the step `name` has committed (in this attempt or an earlier one).
    pub fn is_done(&self, name: &str) -> bool {
        self.recorded().iter().any(|(n, _)| n == name)
    }

    /// The lease of the request's claim: [`Lease::is_lost`] tells the handler another
    /// request may have taken the key over.
    pub fn lease(&self) -> &Lease {
        &self.inner.signal
    }

    fn recorded(&self) -> std::sync::MutexGuard<'_, Recorded> {
        // Poisoned only by a panic while the lock was held; the list is still whole (every
        // change is one push).
        self.inner
            .recorded
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn held(&self) -> (&str, &str, i64) {
        (
            &self.inner.scope,
            self.inner.key.as_str(),
            self.inner.token.into_raw(),
        )
    }

    /// Runs a phase: `work` gets a connection in a transaction of its own; its writes commit
    /// together with the step's recovery point (`name` and the state `work` returns), and the
    /// state is returned. Run remote calls between steps, never in one.
    ///
    /// When an earlier attempt of the request committed this step, `work` does not run: the
    /// recorded state is returned. Names identify steps within a request: give each step its
    /// own.
    ///
    /// # Errors
    ///
    /// [`PhaseError::Work`] when `work` fails, [`PhaseError::LeaseLost`] when another request
    /// holds the key now, [`PhaseError::Aborted`] when `work` returned `Ok` after one of its
    /// statements failed, [`PhaseError::StateTooLarge`], [`PhaseError::Misuse`] and
    /// [`PhaseError::Store`]. In every case nothing of the phase committed.
    pub async fn step<T, E, F>(&self, name: &str, work: F) -> Result<T, PhaseError<E>>
    where
        T: PhaseState,
        F: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
    {
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(PhaseError::Misuse(
                "a step name must be 1 to 255 bytes long",
            ));
        }
        let done = self
            .recorded()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, state)| state.clone());
        if let Some(state) = done {
            return T::from_state(&state).ok_or(PhaseError::Misuse(
                "a recorded step state does not decode as the type asked for",
            ));
        }
        if self
            .inner
            .last
            .try_lock()
            .map_or(true, |last| last.is_some())
        {
            return Err(PhaseError::Misuse("a step after the last phase was opened"));
        }
        let _row = self.inner.row.lock().await;
        let (mut tx, fenced, _) = self.open().await?;
        let conn = tx.conn()?;
        let value = match work(conn).await {
            Ok(value) => value,
            Err(e) => {
                tx.rollback(None).await;
                return Err(PhaseError::Work(e));
            }
        };
        let state = value.to_state();
        let mut phases = self.recorded().clone();
        phases.push((name.to_owned(), Bytes::from(state)));
        let encoded = match phases::encode(&phases) {
            Ok(encoded) => encoded,
            Err(_) => {
                tx.rollback(None).await;
                return Err(PhaseError::StateTooLarge);
            }
        };
        let request = self
            .inner
            .request
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        let batch = record_batch(
            self.held(),
            &encoded,
            request.as_deref(),
            self.inner.lease,
            fenced,
            self.inner.store.bounds(),
        )?;
        // Every statement of the message up to and with the COMMIT: an error reported after
        // them (a notification meant for a listener that a pooler's shared connection still
        // carries) comes after the commit.
        let (sql, through_commit) = batch;
        let batch = CompletionBatch {
            sql,
            through_commit,
        };
        let committed = store_call(Operation::Commit, self.inner.store_timeout, async {
            Ok(run_completion(tx.conn()?, batch).await)
        })
        .await?;
        match committed {
            Ok(_) => {
                tx.ended();
                *self.recorded() = phases;
                if request.is_some() {
                    *self
                        .inner
                        .request
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
                }
                Ok(value)
            }
            Err(e) if sqlstate(&e).as_deref() == Some(IN_FAILED_TRANSACTION) => {
                tx.rollback(None).await;
                Err(PhaseError::Aborted)
            }
            Err(e) if sqlstate(&e).as_deref() == Some(NOT_HELD) => {
                tx.rollback(None).await;
                self.lose();
                Err(PhaseError::LeaseLost)
            }
            Err(e) => {
                // The commit's outcome is unknown (the connection broke while it ran): the
                // step may have committed, so the claim must not be released with it.
                self.inner.uncertain.store(true, Ordering::Relaxed);
                Err(PhaseError::Store(db_error(e)))
            }
        }
    }

    /// Opens (or returns) the last phase's transaction: the handler writes its final changes
    /// through it, and the layer stores the answer in it and commits after the handler
    /// answers (or rolls it back, on a `5xx` or an error). Hold one [`TxConn`] at a time and
    /// never keep it beyond the handler; take no step after this.
    ///
    /// # Errors
    ///
    /// [`PhaseError::LeaseLost`] when the lease is known to be lost already (a renewal found
    /// another request holding the key), [`PhaseError::Unavailable`] while a `TxConn` of it
    /// is held, [`PhaseError::Store`]. A lease lost later is found when the layer stores the
    /// answer: the last phase is rolled back and the client gets `503`.
    pub async fn tx(&self) -> Result<TxConn<'_>, PhaseError> {
        let mut last = self
            .inner
            .last
            .try_lock()
            .map_err(|_| PhaseError::Unavailable)?;
        if last.is_none() {
            let row = self.inner.row.clone().lock_owned().await;
            let (tx, fenced, read_committed) = self.open().await?;
            *last = Some(LastTx {
                tx,
                read_committed,
                fenced,
                _row: row,
            });
        }
        MutexGuard::try_map(last, |last| {
            last.as_mut().and_then(|last| last.tx.conn.as_deref_mut())
        })
        .map_err(|_| PhaseError::Unavailable)
    }

    /// Marks the lease lost (once).
    fn lose(&self) {
        if self.inner.signal.lose() {
            lease_lost();
        }
    }

    /// Opens a phase's transaction (its caller holds `row`, so no renewal runs meanwhile):
    /// plain `BEGIN` below `SERIALIZABLE`, else with the fence. Returns the transaction,
    /// whether it is fenced, and whether it is `READ COMMITTED`.
    async fn open<E>(&self) -> Result<(OpenTx, bool, bool), PhaseError<E>> {
        if self.inner.signal.is_lost() {
            return Err(PhaseError::LeaseLost);
        }
        let level = self.inner.isolation.or_else(|| {
            let code = self.inner.default_level.load(Ordering::Relaxed);
            [
                IsolationLevel::ReadCommitted,
                IsolationLevel::RepeatableRead,
                IsolationLevel::Serializable,
            ]
            .into_iter()
            .find(|&level| level_code(level) == code)
        });
        match level {
            Some(IsolationLevel::Serializable) => Ok((self.fence().await?, true, false)),
            // A level below SERIALIZABLE: a bare `BEGIN`. The phase's statements on the record
            // refuse a lost lease at its end (`NOT_HELD`), which rolls the phase back; a look
            // at the token here would tell the handler sooner, for a tenth of a payment
            // handler's throughput (BENCHMARKS.md).
            Some(level) => {
                let (tx, _) = self.begin_with(self.inner.begin.to_owned()).await?;
                Ok((tx, false, level == IsolationLevel::ReadCommitted))
            }
            // The connections' default is not known yet: look (once per layer).
            None => {
                let batch = begin_batch(self.inner.begin, self.held())?;
                let (tx, rows) = self.begin_with(batch).await?;
                let look = rows.iter().find_map(|r| {
                    let level = r.try_get::<String, _>("transaction_isolation").ok()?;
                    Some((level_named(&level)?, r.try_get::<bool, _>("held").ok()?))
                });
                let Some((level, held)) = look else {
                    tx.rollback(None).await;
                    return Err(PhaseError::Store(StoreError::Corrupt(
                        "the phase's look returned no level".into(),
                    )));
                };
                self.inner
                    .default_level
                    .store(level_code(level), Ordering::Relaxed);
                if !held {
                    tx.rollback(None).await;
                    self.lose();
                    return Err(PhaseError::LeaseLost);
                }
                if level == IsolationLevel::Serializable {
                    tx.rollback(None).await;
                    return Ok((self.fence().await?, true, false));
                }
                Ok((tx, false, level == IsolationLevel::ReadCommitted))
            }
        }
    }

    /// Takes a pooled connection and sends `sql`, which opens a transaction.
    async fn begin_with<E>(&self, sql: String) -> Result<(OpenTx, Vec<PgRow>), PhaseError<E>> {
        let store = &self.inner.store;
        let bound = self.inner.store_timeout;
        let opened = store_call(Operation::Claim, bound, async {
            let conn = store.pool().acquire().await.map_err(db_error)?;
            let mut tx = OpenTx {
                conn: Some(conn),
                bound,
            };
            let rows = sqlx::raw_sql(AssertSqlSafe(sql))
                .fetch_all(tx.conn()?)
                .await
                .map_err(|e| store.error(e))?;
            Ok((tx, rows))
        })
        .await?;
        Ok(opened)
    }

    /// Opens a phase's transaction with its fence (`SERIALIZABLE`).
    async fn fence<E>(&self) -> Result<OpenTx, PhaseError<E>> {
        let store = &self.inner.store;
        let bound = self.inner.store_timeout;
        let batch = fence_batch(
            self.inner.begin,
            self.held(),
            self.inner.lease,
            store.bounds(),
        )?;
        let opened = store_call(Operation::Claim, bound, async {
            let conn = store.pool().acquire().await.map_err(db_error)?;
            let mut tx = OpenTx {
                conn: Some(conn),
                bound,
            };
            let rows = sqlx::raw_sql(AssertSqlSafe(batch))
                .fetch_all(tx.conn()?)
                .await
                .map_err(|e| store.error(e))?;
            let held = rows.iter().any(|r| r.try_get::<bool, _>("held").is_ok());
            Ok((tx, held))
        })
        .await;
        match opened {
            Ok((tx, true)) => Ok(tx),
            Ok((tx, false)) => {
                tx.rollback(None).await;
                self.lose();
                Err(PhaseError::LeaseLost)
            }
            Err(e) => Err(PhaseError::Store(e)),
        }
    }
}

/// How the request's claim ends when the handler did not answer with something to store.
async fn abandon(phases: &Phases, notify: Option<i64>) {
    match phases.inner.last.try_lock() {
        Ok(mut last) => {
            if let Some(last) = last.take() {
                last.tx.rollback(None).await;
            }
        }
        Err(_) => {
            // A `TxConn` of the last phase is held past the handler: its transaction keeps
            // the record locked until it is dropped (then its connection closes and
            // Postgres rolls it back); the lease frees the key after that.
            tracing::error!(
                "idempotency: a TxConn of the last phase is held past the handler; the key \
                 stays held until it is dropped"
            );
            return;
        }
    }
    let inner = &phases.inner;
    let store = &inner.store;
    if phases.recorded().is_empty() && !inner.uncertain.load(Ordering::Relaxed) {
        let release = store.release(&inner.scope, &inner.key, inner.token);
        match store_call(Operation::Release, inner.store_timeout, release).await {
            Ok(_) => tracing::debug!("idempotency key released"),
            Err(e) => log_store_error(&e, "release a key; it stays locked until its lease ends"),
        }
        return;
    }
    // Steps committed: keep them for the retry, which takes the key over at once.
    let ended = async {
        let mut sql = yield_statement(phases.held())?;
        if let Some(hash) = notify {
            sql.push_str("; ");
            sql.push_str(&wake_statement(hash));
        }
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .map_err(|e| store.error(e))
    };
    match store_call(Operation::Release, inner.store_timeout, ended).await {
        Ok(_) => tracing::debug!("idempotency claim ended; its committed phases are kept"),
        Err(e) => log_store_error(&e, "end a claim; it stays held until its lease ends"),
    }
}

/// Ends the claim in the background when the request is dropped mid-way.
struct AbandonOnDrop {
    phases: Option<Phases>,
    notify: Option<i64>,
}

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        if let Some(phases) = self.phases.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let notify = self.notify;
            runtime.spawn(async move { abandon(&phases, notify).await });
        }
    }
}

/// Renews the claim's lease every third of it while the handler runs; skipped while a
/// phase's transaction holds the record (its fence extended the lease, and its lock keeps
/// every other request out).
async fn renew(phases: Phases) {
    let inner = &phases.inner;
    let period = inner.lease / 3;
    let mut confirmed = Instant::now();
    loop {
        tokio::time::sleep(period).await;
        let Ok(_row) = inner.row.try_lock() else {
            confirmed = Instant::now();
            continue;
        };
        let sent = Instant::now();
        let renewal = inner
            .store
            .renew(&inner.scope, &inner.key, inner.token, inner.lease);
        match store_call(Operation::Renew, period.min(inner.store_timeout), renewal).await {
            Ok(true) => confirmed = sent,
            Ok(false) => {
                if inner.signal.lose() {
                    lease_lost();
                    tracing::warn!(
                        "idempotency lease lost: another request holds the key now; this \
                         request's phases commit nothing more"
                    );
                }
                return;
            }
            Err(e) => log_store_error(&e, "renew a lease"),
        }
        if confirmed.elapsed() >= inner.lease && inner.signal.lose() {
            lease_lost();
            tracing::warn!(
                "idempotency lease may have run out: no renewal succeeded for a whole lease"
            );
        }
    }
}

/// Reads the recorded phases of a record taken over.
async fn read_phases(
    store: &PostgresStore,
    held: (&str, &str, i64),
) -> Result<Recorded, StoreError> {
    let sql = read_statement(held)?;
    let rows = sqlx::raw_sql(AssertSqlSafe(sql))
        .fetch_all(store.pool())
        .await
        .map_err(|e| store.error(e))?;
    match rows.first() {
        Some(row) => match row.try_get::<Option<Vec<u8>>, _>("phases")? {
            Some(bytes) => phases::decode(&bytes),
            None => Ok(Vec::new()),
        },
        None => Ok(Vec::new()),
    }
}

/// How the last phase ended.
enum Completion {
    Committed,
    /// The handler left the transaction aborted: its writes were rolled back and its answer
    /// and its answer stored alone.
    StoredAlone,
    /// The token no longer holds the record; nothing committed.
    LeaseLost,
    Failed(sqlx::Error),
}

/// Stores the answer in the last phase's transaction and commits.
async fn complete_last(
    phases: &Phases,
    last: LastTx,
    ttl: Duration,
    stored: &StoredResponse,
    notify: Option<i64>,
) -> Result<Completion, StoreError> {
    let LastTx {
        mut tx,
        read_committed,
        fenced,
        _row,
    } = last;
    // At READ COMMITTED the completion wakes the waiters itself (its statement's snapshot sees
    // every registration); above it, the transaction's snapshot predates the waiters that
    // registered while the handler ran: look for them after the commit.
    let (wake_in, wake_after) = match notify {
        Some(hash) if read_committed => (Some(hash), None),
        other => (None, other),
    };
    let mut sql = complete_statement(phases.held(), ttl, stored, fenced, wake_in)?;
    sql.push_str("; COMMIT");
    if let Some(hash) = wake_after {
        sql.push_str("; BEGIN ISOLATION LEVEL READ COMMITTED; ");
        sql.push_str(&wake_statement(hash));
        sql.push_str("; COMMIT");
    }
    // The completion and the COMMIT: an error reported after both (the wake-up's, or a
    // notification meant for a listener that a pooler's shared connection still carries)
    // comes after the commit.
    let batch = CompletionBatch {
        sql,
        through_commit: 2,
    };
    let done = run_completion(tx.conn()?, batch).await;
    match done {
        Ok(_) => {
            tx.ended();
            Ok(Completion::Committed)
        }
        Err(e) if sqlstate(&e).as_deref() == Some(IN_FAILED_TRANSACTION) => {
            // The handler left its last phase aborted: none of its writes can commit. Roll
            // them back and store its answer alone (the steps before stay committed).
            tx.rollback(None).await;
            let sql = complete_statement(phases.held(), ttl, stored, false, notify)?;
            match sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(phases.inner.store.pool())
                .await
            {
                Ok(_) => Ok(Completion::StoredAlone),
                Err(e) if sqlstate(&e).as_deref() == Some(NOT_HELD) => Ok(Completion::LeaseLost),
                Err(e) => Ok(Completion::Failed(e)),
            }
        }
        Err(e) if sqlstate(&e).as_deref() == Some(NOT_HELD) => {
            tx.rollback_later();
            Ok(Completion::LeaseLost)
        }
        Err(e) => {
            tx.rollback_later();
            Ok(Completion::Failed(e))
        }
    }
}

// See `mode::private`: the sealed trait's method uses crate-private types by design.
#[allow(private_interfaces)]
impl Sealed for Phased {
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
            mut buffered,
        } = match prepare(&config, req).await {
            Ok(prepared) => prepared,
            Err(rejected) => return Ok(rejected),
        };
        let kept_request = self
            .resumable
            .and_then(|max| completer::keep_request(&parts, &mut buffered, max));
        let unavailable = |err: StoreError, what: &'static str| {
            record(Outcome::StoreError);
            log_store_error(&err, what);
            render(&config, &Rejection::StoreUnavailable)
        };
        let store = &self.store;
        let request = ClaimRequest {
            scope: &scope,
            key: &key,
            fingerprint,
            lease: config.lease,
            ttl: config.ttl,
        };
        let claim = || {
            let call = store_call(
                Operation::Claim,
                config.store_timeout,
                store.claim_lease(request),
            );
            async move { Ok(acquired_or_taken(call.await?)) }
        };
        let (token, takeover) = match claim_or_wait(&config, store, &scope, &key, claim).await {
            Ok(Ok(claimed)) => claimed,
            Ok(Err(taken)) => return Ok(answer_taken(&config, taken)),
            Err(e) => return Ok(unavailable(e, "claim a key; answered 503")),
        };
        record(if takeover {
            Outcome::Takeover
        } else {
            Outcome::Executed
        });
        let _in_flight = InFlightGauge::start();
        let notify = store.notification(&scope, &key);
        let held = (scope.as_str(), key.as_str(), token.into_raw());
        let recorded = if takeover {
            match store_call(
                Operation::Claim,
                config.store_timeout,
                read_phases(store, held),
            )
            .await
            {
                Ok(recorded) => recorded,
                // The key stays held until its lease runs out; the retry after it reads the
                // phases again.
                Err(e) => return Ok(unavailable(e, "read a key's phases; answered 503")),
            }
        } else {
            Vec::new()
        };
        let phases = Phases {
            inner: Arc::new(Inner {
                store: store.clone(),
                scope: scope.clone(),
                key: key.clone(),
                token,
                lease: config.lease,
                store_timeout: config.store_timeout,
                begin: self.isolation.map_or("BEGIN", IsolationLevel::begin),
                isolation: self.isolation,
                default_level: self.default_level.clone(),
                signal: Lease::new(),
                resumed_after: recorded.last().map(|(name, _)| name.clone()),
                recorded: SyncMutex::new(recorded),
                row: Arc::new(Mutex::new(())),
                last: Mutex::new(None),
                request: SyncMutex::new(kept_request),
                uncertain: std::sync::atomic::AtomicBool::new(false),
            }),
        };
        if let Some(point) = phases.recovery_point() {
            tracing::debug!(
                recovery_point = point,
                "idempotent request resumes its phases"
            );
        }
        let mut guard = AbandonOnDrop {
            phases: Some(phases.clone()),
            notify,
        };
        parts.extensions.insert(key.clone());
        parts.extensions.insert(phases.inner.signal.clone());
        parts.extensions.insert(phases.clone());
        let req = Request::from_parts(
            parts,
            RequestBody::buffered(buffered.chunks, buffered.trailers),
        );
        let handled = async {
            let response = inner.call(req).await?;
            Ok(to_store(&config, response).await)
        };
        let handled = {
            let mut handled = pin!(handled);
            // Renewals need the runtime's timer; outside a Tokio runtime the lease is not
            // renewed (as in plain mode).
            let mut renewal = tokio::runtime::Handle::try_current()
                .is_ok()
                .then(|| Box::pin(renew(phases.clone())));
            poll_fn(|cx| {
                if let Poll::Ready(done) = handled.as_mut().poll(cx) {
                    return Poll::Ready(done);
                }
                if let Some(task) = &mut renewal
                    && task.as_mut().poll(cx).is_ready()
                {
                    renewal = None;
                }
                Poll::Pending
            })
            .await
        };
        guard.phases = None;
        let (mut response, stored) = match handled {
            Ok(handled) => handled,
            Err(e) => {
                abandon(&phases, notify).await;
                return Err(e);
            }
        };
        let Some(stored) = stored else {
            // A 5xx, or a body that failed: nothing is stored, the committed steps are kept.
            abandon(&phases, notify).await;
            return Ok(response);
        };
        let last = match phases.inner.last.try_lock() {
            Ok(mut last) => last.take(),
            Err(_) => {
                // The handler kept a `TxConn` of its last phase past its answer: nothing can
                // commit, and the answer is not the client's to keep.
                tracing::error!(
                    "idempotency: the handler still holds a TxConn of its last phase after its \
                     answer; nothing was committed, answered 503"
                );
                return Ok(render(&config, &Rejection::StoreUnavailable));
            }
        };
        let Some(last) = last else {
            // No last phase: the answer is stored on its own.
            let completed = async {
                let sql = complete_statement(held, config.ttl, &stored.answer, false, notify)?;
                Ok(sqlx::raw_sql(AssertSqlSafe(sql))
                    .execute(store.pool())
                    .await)
            };
            match store_call(Operation::Complete, config.store_timeout, completed).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) if sqlstate(&e).as_deref() == Some(NOT_HELD) => {
                    phases.lose();
                    tracing::warn!(
                        "idempotency lease was lost while the handler ran (another request \
                         took the key over); this answer was not stored"
                    );
                }
                Ok(Err(e)) => log_store_error(
                    &store.error(e),
                    "store the answer; the client gets it, the key waits for its lease",
                ),
                Err(e) => log_store_error(
                    &e,
                    "store the answer; the client gets it, the key waits for its lease",
                ),
            }
            stored.restore(&mut response);
            return Ok(response);
        };
        let completion = complete_last(&phases, last, config.ttl, &stored.answer, notify);
        match store_call(Operation::Commit, config.store_timeout, completion).await {
            Ok(Completion::Committed) => {
                stored.restore(&mut response);
                Ok(response)
            }
            Ok(Completion::StoredAlone) => {
                tracing::warn!(
                    status = stored.answer.status().as_u16(),
                    "the idempotent handler answered after a statement of its last phase \
                     failed: that phase's writes were rolled back, and its answer was stored \
                     with the key"
                );
                stored.restore(&mut response);
                Ok(response)
            }
            Ok(Completion::LeaseLost) => {
                phases.lose();
                Ok(unavailable(
                    StoreError::backend("the lease was lost before the last phase committed"),
                    "commit the last phase (lease lost); rolled back, answered 503",
                ))
            }
            Ok(Completion::Failed(e)) => {
                abandon(&phases, notify).await;
                if is_serialization_failure(&e) {
                    Ok(unavailable(
                        db_error(e),
                        "commit the last phase (serialization failure); rolled back, answered 503",
                    ))
                } else {
                    Ok(unavailable(
                        store.error(e),
                        "commit the last phase; rolled back, answered 503",
                    ))
                }
            }
            Err(e) => Ok(unavailable(e, "commit the last phase; answered 503")),
        }
    }
}
