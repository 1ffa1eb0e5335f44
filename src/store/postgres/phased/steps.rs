//! [`Phases`]: the handler's steps and its last phase, each fenced by the claim's token.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::Duration;

use bytes::Bytes;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, Row};
use tokio::sync::{Mutex, MutexGuard, OwnedMutexGuard};

use crate::error::StoreError;
use crate::key::IdempotencyKey;
use crate::lease::Lease;
use crate::outcome::{Operation, lease_lost, store_call};
use crate::store::LeaseToken;
use crate::store::PostgresStore;
use crate::store::postgres::db_error;
use crate::store::postgres::phases::{
    self, MAX_PHASES_BYTES, Recorded, begin_batch, fence_batch, record_batch,
};
use crate::store::postgres::sqlstate::{IN_FAILED_TRANSACTION, NOT_HELD, sqlstate_is};
use crate::transactional::{CompletionBatch, IsolationLevel, OpenTx, TxConn, run_completion};

use super::{PhaseState, level_code, level_named};

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
    /// transaction; nothing was committed. (Roll back to a savepoint of your own, set with
    /// SQL `SAVEPOINT`, to go on after an expected failure.)
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
    /// An earlier step of this request may or may not have committed (its commit timed out,
    /// or its connection broke before the answer), so no later phase of this request runs:
    /// running one could repeat that step's work, or record over it. Answer with a `5xx`:
    /// the claim is kept, and the retry, which reads the key's record, resumes after what
    /// did commit.
    #[error("an earlier step's commit has an unknown outcome; this request can go no further")]
    Uncertain,
}

/// The phases of a keyed request in phased mode: its steps with their recovery points, and
/// its last transaction, committed with the answer. See [`crate::phased`].
///
/// The layer inserts it into the request's extensions (and, with the `axum` feature, it is
/// an extractor). Clones share the request's phases.
#[derive(Clone)]
pub struct Phases {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) store: PostgresStore,
    pub(super) scope: String,
    pub(super) key: IdempotencyKey,
    pub(super) token: LeaseToken,
    pub(super) lease: Duration,
    pub(super) store_timeout: Duration,
    pub(super) begin: &'static str,
    pub(super) isolation: Option<IsolationLevel>,
    pub(super) default_level: Arc<AtomicU8>,
    pub(super) signal: Lease,
    /// The step a resumed request found last committed.
    pub(super) resumed_after: Option<String>,
    /// Every committed step, oldest first: those found on the record, then this request's.
    pub(super) recorded: SyncMutex<Recorded>,
    /// Held while a fenced phase's transaction (`REPEATABLE READ`, `SERIALIZABLE`) holds the
    /// key's record locked: renewals wait their turn (the phase's fence extended the lease,
    /// and a renewal committed during the phase would fail its update of the record with a
    /// serialization failure). A `READ COMMITTED` phase locks nothing until its commit, and
    /// the renewals go on.
    pub(super) row: Arc<Mutex<()>>,
    /// Held by a step from its look at the recorded steps to its commit: steps of one request
    /// run one at a time, so a step of a name already committed never runs again.
    pub(super) steps: Mutex<()>,
    /// The last phase's transaction, once opened.
    pub(super) last: Mutex<Option<LastTx>>,
    /// The request, encoded, to keep with the first step ([`Phased::with_resumable_requests`]);
    /// `None` once kept.
    pub(super) request: SyncMutex<Option<Vec<u8>>>,
    /// A step's commit failed with its outcome unknown: it may have committed.
    pub(super) uncertain: std::sync::atomic::AtomicBool,
}

pub(super) struct LastTx {
    pub(super) tx: OpenTx,
    pub(super) read_committed: bool,
    /// Opened by [`fence_batch`]: the record is found by the row id it kept.
    pub(super) fenced: bool,
    /// The record's lock, while a fenced transaction holds it.
    pub(super) _row: Option<OwnedMutexGuard<()>>,
}

/// A phase's transaction, as [`Phases::open`] opened it.
struct Opened {
    tx: OpenTx,
    /// Opened by [`fence_batch`].
    fenced: bool,
    read_committed: bool,
    row: Option<OwnedMutexGuard<()>>,
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

    pub(super) fn recorded(&self) -> std::sync::MutexGuard<'_, Recorded> {
        // Poisoned only by a panic while the lock was held; the list is still whole (every
        // change is one push).
        self.inner
            .recorded
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) fn held(&self) -> (&str, &str, i64) {
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
    /// Never call `sqlx::Connection::begin` (or `Acquire::begin`) on `work`'s connection: the
    /// layer opened the phase's transaction with its own `BEGIN`, which sqlx does not count, so
    /// the `commit()` or `rollback()` of what sqlx returns, or its drop, ends the phase's
    /// transaction, and the step's recovery point then commits apart from its writes (after a
    /// rollback: recorded without them, so the retry skips work that never committed). For a
    /// nested transaction, send `SAVEPOINT name`, `ROLLBACK TO SAVEPOINT name` and
    /// `RELEASE SAVEPOINT name` yourself. The same holds for [`Phases::tx`]'s connection.
    ///
    /// # Errors
    ///
    /// [`PhaseError::Work`] when `work` fails, [`PhaseError::LeaseLost`] when another request
    /// holds the key now, [`PhaseError::Aborted`] when `work` returned `Ok` after one of its
    /// statements failed, [`PhaseError::StateTooLarge`], [`PhaseError::Misuse`] and
    /// [`PhaseError::Store`]; in each of these cases nothing of the phase committed, except
    /// for a [`PhaseError::Store`] from the commit itself, whose outcome is unknown.
    /// [`PhaseError::Uncertain`] when an earlier step's commit had an unknown outcome: no
    /// later phase of the request runs.
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
        if let Some(done) = self.done(name) {
            return done;
        }
        if self
            .inner
            .last
            .try_lock()
            .map_or(true, |last| last.is_some())
        {
            return Err(PhaseError::Misuse("a step after the last phase was opened"));
        }
        let _step = self.inner.steps.lock().await;
        // A step of the same name may have committed while this one waited its turn.
        if let Some(done) = self.done(name) {
            return done;
        }
        let Opened {
            mut tx,
            fenced,
            row: _row,
            ..
        } = self.open().await?;
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
        // From here until the server's answer, the step may commit without this request
        // knowing: a timeout, a dropped future or a broken connection leaves it uncertain, and
        // an uncertain claim is never released (had the step committed, a release would let
        // the retry run it again). Only a known outcome clears it.
        self.inner.uncertain.store(true, Ordering::SeqCst);
        let committed = store_call(Operation::Commit, self.inner.store_timeout, async {
            Ok(run_completion(tx.conn()?, batch).await)
        })
        .await?;
        if committed.as_ref().is_ok()
            || committed
                .as_ref()
                .is_err_and(|e| sqlstate_is(e, IN_FAILED_TRANSACTION) || sqlstate_is(e, NOT_HELD))
        {
            self.inner.uncertain.store(false, Ordering::SeqCst);
        }
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
            Err(e) if sqlstate_is(&e, IN_FAILED_TRANSACTION) => {
                tx.rollback(None).await;
                Err(PhaseError::Aborted)
            }
            Err(e) if sqlstate_is(&e, NOT_HELD) => {
                tx.rollback(None).await;
                self.lose();
                Err(PhaseError::LeaseLost)
            }
            // The commit's outcome is unknown (the connection broke while it ran): the step
            // may have committed, so the claim stays (`uncertain`), and no later phase of
            // this request runs.
            Err(e) => Err(PhaseError::Store(db_error(e))),
        }
    }

    /// The state of the step `name` when it has committed.
    fn done<T: PhaseState, E>(&self, name: &str) -> Option<Result<T, PhaseError<E>>> {
        let state = self
            .recorded()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, state)| state.clone())?;
        Some(T::from_state(&state).ok_or(PhaseError::Misuse(
            "a recorded step state does not decode as the type asked for",
        )))
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
            let opened = self.open().await?;
            *last = Some(LastTx {
                tx: opened.tx,
                read_committed: opened.read_committed,
                fenced: opened.fenced,
                _row: opened.row,
            });
        }
        MutexGuard::try_map(last, |last| {
            last.as_mut().and_then(|last| last.tx.conn.as_deref_mut())
        })
        .map_err(|_| PhaseError::Unavailable)
    }

    /// Marks the lease lost (once).
    pub(super) fn lose(&self) {
        if self.inner.signal.lose() {
            lease_lost();
        }
    }

    /// Opens a phase's transaction. At `READ COMMITTED` a bare `BEGIN`: the phase's statements
    /// on the record refuse a lost lease at its end (`NOT_HELD`), which rolls the phase back,
    /// and renewals go on meanwhile. Above it, the fence, which locks the record and extends
    /// the lease first, with `row` held until the transaction ends: a renewal committed
    /// between the phase's snapshot and its update of the record would fail that update.
    async fn open<E>(&self) -> Result<Opened, PhaseError<E>> {
        if self.inner.signal.is_lost() {
            return Err(PhaseError::LeaseLost);
        }
        if self.inner.uncertain.load(Ordering::SeqCst) {
            return Err(PhaseError::Uncertain);
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
            // A look at the token here would tell the handler of a lost lease sooner, for
            // 100 µs of database CPU per request (BENCHMARKS.md).
            Some(IsolationLevel::ReadCommitted) => {
                let (tx, _) = self.begin_with(self.inner.begin.to_owned()).await?;
                Ok(Opened {
                    tx,
                    fenced: false,
                    read_committed: true,
                    row: None,
                })
            }
            Some(_) => self.fence().await,
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
                if level != IsolationLevel::ReadCommitted {
                    tx.rollback(None).await;
                    return self.fence().await;
                }
                Ok(Opened {
                    tx,
                    fenced: false,
                    read_committed: true,
                    row: None,
                })
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

    /// Opens a phase's transaction with its fence (`REPEATABLE READ`, `SERIALIZABLE`), holding
    /// `row` (no renewal runs until the transaction ends).
    async fn fence<E>(&self) -> Result<Opened, PhaseError<E>> {
        let row = self.inner.row.clone().lock_owned().await;
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
            Ok((tx, true)) => Ok(Opened {
                tx,
                fenced: true,
                read_committed: false,
                row: Some(row),
            }),
            Ok((tx, false)) => {
                tx.rollback(None).await;
                self.lose();
                Err(PhaseError::LeaseLost)
            }
            Err(e) => Err(PhaseError::Store(e)),
        }
    }
}
