//! How phased mode runs a keyed request: the claim, the handler with its lease renewed, and
//! the answer stored in the last phase (or the claim ended).

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex as SyncMutex};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use sqlx::{AssertSqlSafe, Row};
use tokio::sync::Mutex;
use tokio::time::Instant;
use tower_service::Service;

use crate::answer::{answer_taken, render, to_store};
use crate::body::{RequestBody, ResponseBody};
use crate::config::Config;
use crate::error::{BoxError, StoreError};
use crate::lease::Lease;
use crate::mode::Sealed;
use crate::outcome::{
    InFlightGauge, Operation, Outcome, acquired_or_taken, end_in_background, lease_lost,
    log_store_error, record, store_call,
};
use crate::rejection::Rejection;
use crate::request::{Keyed, Prepared, prepare};
use crate::response::StoredResponse;
use crate::store::PostgresStore;
use crate::store::listen::wake_statement;
use crate::store::postgres::db_error;
use crate::store::postgres::phases::{
    self, Recorded, complete_statement, read_statement, yield_statement,
};
use crate::store::postgres::sqlstate::{
    IN_FAILED_TRANSACTION, NOT_HELD, is_serialization_failure, sqlstate_is,
};
use crate::store::{ClaimRequest, Store};
use crate::transactional::{CompletionBatch, IsolationLevel, run_completion};
use crate::wait::claim_or_wait;

use super::Phased;
use super::completer;
use super::steps::{Inner, LastTx, Phases};

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
    let release = phases.recorded().is_empty() && !phases.inner.uncertain.load(Ordering::SeqCst);
    if end_claim(phases, notify, release, true).await {
        return;
    }
    // The store did not answer: go on trying while the lease lasts (the statement is fenced
    // by the token, so a late one can end nothing but this claim).
    let phases = phases.clone();
    end_in_background(Instant::now() + phases.inner.lease, move || {
        let phases = phases.clone();
        Box::pin(async move { end_claim(&phases, notify, release, false).await })
    });
}

/// Ends the claim: releases it (`release`: no step committed, none uncertain), or ends its
/// lease and keeps its committed steps for the retry, which takes the key over at once.
/// Whether the store did; a failure is logged (`loud`: as an error, else at debug).
async fn end_claim(phases: &Phases, notify: Option<i64>, release: bool, loud: bool) -> bool {
    let inner = &phases.inner;
    let store = &inner.store;
    let failed = |e: &StoreError, what: &'static str| {
        if loud {
            log_store_error(e, what);
        } else {
            tracing::debug!(error = e as &dyn std::error::Error, "idempotency: {what}");
        }
    };
    if release {
        let release = store.release(&inner.scope, &inner.key, inner.token);
        return match store_call(Operation::Release, inner.store_timeout, release).await {
            Ok(_) => {
                tracing::debug!("idempotency key released");
                true
            }
            Err(e) => {
                failed(&e, "release a key; trying again while its lease lasts");
                false
            }
        };
    }
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
        Ok(_) => {
            tracing::debug!("idempotency claim ended; its committed phases are kept");
            true
        }
        Err(e) => {
            failed(&e, "end a claim; trying again while its lease lasts");
            false
        }
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

/// Renews the claim's lease every third of it while the handler runs; skipped while a fenced
/// phase's transaction holds the record locked (its fence extended the lease, and its lock
/// keeps every other request out).
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
    // registered while the handler ran: look for them after the commit, in a statement of its
    // own. After the COMMIT it runs in an implicit transaction of its own, whose snapshot is
    // its statement's at any level, and which no error can leave open on the connection (an
    // explicit `BEGIN` there would stay aborted, and go back to the pool so, were the
    // wake-up to fail).
    let (wake_in, wake_after) = match notify {
        Some(hash) if read_committed => (Some(hash), None),
        other => (None, other),
    };
    let mut sql = complete_statement(phases.held(), ttl, stored, fenced, wake_in)?;
    sql.push_str("; COMMIT");
    if let Some(hash) = wake_after {
        sql.push_str("; ");
        sql.push_str(&wake_statement(hash));
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
        Err(e) if sqlstate_is(&e, IN_FAILED_TRANSACTION) => {
            // The handler left its last phase aborted: none of its writes can commit. Roll
            // them back and store its answer alone (the steps before stay committed).
            tx.rollback(None).await;
            let sql = complete_statement(phases.held(), ttl, stored, false, notify)?;
            match sqlx::raw_sql(AssertSqlSafe(sql))
                .execute(phases.inner.store.pool())
                .await
            {
                Ok(_) => Ok(Completion::StoredAlone),
                Err(e) if sqlstate_is(&e, NOT_HELD) => Ok(Completion::LeaseLost),
                Err(e) => Ok(Completion::Failed(e)),
            }
        }
        Err(e) if sqlstate_is(&e, NOT_HELD) => {
            tx.rollback_later();
            Ok(Completion::LeaseLost)
        }
        Err(e) => {
            // Rolled back before the claim is ended and the client answered: the record's
            // lock (a fenced phase's) goes with it, so the end of the claim does not wait for
            // it and a retry the moment the 503 arrives can take the key over.
            tx.rollback(None).await;
            Ok(Completion::Failed(e))
        }
    }
}

/// The answer to a request the completer runs again that cannot resume its record: `409`,
/// and the handler does not run.
fn not_resumed<B: Body>(config: &Config, why: &'static str) -> Response<ResponseBody<B>> {
    tracing::warn!(
        why,
        "completer: a request run again was not run; its record's phases stay"
    );
    render(
        config,
        &Rejection::InFlight {
            retry_after: Duration::from_secs(1),
        },
    )
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
        let resumption = parts.extensions.remove::<completer::Resumption>();
        if let Some(resumption) = &resumption
            && (resumption.scope != scope || resumption.key != key.as_str())
        {
            return Ok(not_resumed(
                &config,
                "its scope or key is not its record's (a credential or the layer's settings \
                 changed)",
            ));
        }
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
        if resumption.is_some() && !takeover {
            // The completer's record is gone (completed and purged, or expired): this claim
            // is a new one, and running it would run every committed step again.
            let release = store.release(&scope, &key, token);
            if let Err(e) = store_call(Operation::Release, config.store_timeout, release).await {
                log_store_error(&e, "release a key; it stays locked until its lease ends");
            }
            return Ok(not_resumed(&config, "its record is no longer there"));
        }
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
                steps: Mutex::new(()),
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
            let run = poll_fn(|cx| {
                if let Poll::Ready(done) = handled.as_mut().poll(cx) {
                    return Poll::Ready(done);
                }
                if let Some(task) = &mut renewal
                    && task.as_mut().poll(cx).is_ready()
                {
                    renewal = None;
                }
                Poll::Pending
            });
            // The bound needs the runtime's timer too.
            match self.handler_timeout {
                Some(bound) if tokio::runtime::Handle::try_current().is_ok() => {
                    tokio::time::timeout(bound, run).await.ok()
                }
                _ => Some(run.await),
            }
            // The handler's future is dropped here, with any `TxConn` it held.
        };
        guard.phases = None;
        let Some(handled) = handled else {
            tracing::warn!(
                timeout = ?self.handler_timeout,
                "idempotency: the handler ran past its time bound; stopped, its open phase \
                 rolled back (its committed steps stay), answered 503"
            );
            abandon(&phases, notify).await;
            return Ok(render(&config, &Rejection::HandlerTimedOut));
        };
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
        if resumption.is_some() && stored.answer.status().is_client_error() {
            // The completer's re-run of a kept request answered 4xx: most likely the kept
            // credential has expired or the application changed, not the client's mistake.
            // Stored, it would be replayed over the committed steps for the whole TTL; kept
            // as they are, the client's retry resumes them.
            tracing::warn!(
                status = stored.answer.status().as_u16(),
                "completer: a request run again answered 4xx; nothing stored, its committed \
                 phases stay for the client's retry"
            );
            abandon(&phases, notify).await;
            return Ok(response);
        }
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
                Ok(Err(e)) if sqlstate_is(&e, NOT_HELD) => {
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
