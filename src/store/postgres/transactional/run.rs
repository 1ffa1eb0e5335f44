//! How transactional mode runs a keyed request: the key claimed in the request's
//! transaction, the handler in it, the answer committed with its writes.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use sqlx::{AssertSqlSafe, Row};
use tokio::sync::Mutex;
use tower_service::Service;

use crate::answer::{answer_taken, render, to_store};
use crate::body::{RequestBody, ResponseBody};
use crate::error::{BoxError, StoreError};
use crate::mode::Sealed;
use crate::outcome::{
    InFlightGauge, Operation, Outcome, Taken, log_store_error, record, store_call,
};
use crate::rejection::Rejection;
use crate::request::{Keyed, Prepared, prepare};
use crate::response::StoredResponse;
use crate::store::postgres::db_error;
use crate::store::postgres::sqlstate::{
    IN_FAILED_TRANSACTION, LOCK_NOT_AVAILABLE, is_serialization_failure, sqlstate_is,
};
use crate::wait::claim_or_wait;

use super::*;

/// The placeholder record of a key claimed in the request's transaction.
pub(super) struct Placeholder {
    /// Its row id.
    pub(super) row: String,
    pub(super) scope: String,
    pub(super) key: String,
    /// The server process of the transaction's connection.
    pub(super) backend: Option<i32>,
    /// Whether the transaction runs at `READ COMMITTED` (each statement sees what was
    /// committed before it).
    pub(super) read_committed: bool,
}

/// Opens the request's transaction with the key claimed in it (`Ok(Ok(_))`), or says who
/// holds the key (`Ok(Err(taken))`).
pub(super) async fn claim(
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

pub(super) async fn rollback(tx: Option<OpenTx>, notify: Option<i64>) {
    if let Some(tx) = tx {
        tx.rollback(notify).await;
    }
}

/// How the completion ended.
pub(super) enum Completion {
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
pub(super) async fn complete(
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
    if !sqlstate_is(&err, IN_FAILED_TRANSACTION) {
        // Rolled back before the client hears of it: the key's lock goes with the
        // transaction, so a retry sent the moment the 503 arrives finds the key free (rolled
        // back in the background, it could meet the key still held and get 409).
        tx.rollback(notify).await;
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
            tx.rollback(notify).await;
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
