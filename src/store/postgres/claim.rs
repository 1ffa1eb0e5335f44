//! How a claim is decided: the strategy's statements, the record it found classified, and
//! phased mode's claim whose commit does not wait for its flush.

use std::time::Duration;

use sqlx::Row;
use sqlx::postgres::PgRow;

use super::*;
use crate::error::StoreError;
use crate::store::sql::Lit;

impl PostgresStore {
    pub(super) async fn read(&self, req: &ClaimRequest<'_>) -> Result<Option<PgRow>, StoreError> {
        let args = claim_args(req, self.lock_timeout);
        let rows = if self.prepared {
            self.rows(READ_CALL, &args).await?
        } else {
            self.run_named(&READ, &args[..3]).await?
        };
        Ok(rows.into_iter().next())
    }

    /// The token of a fresh claim, or `None` when the key exists.
    pub(super) async fn insert(&self, req: &ClaimRequest<'_>) -> Result<Option<i64>, StoreError> {
        if !self.prepared {
            return self.insert_named(req, &INSERT).await;
        }
        match self
            .rows(INSERT_CALL, &claim_args(req, self.lock_timeout))
            .await?
            .first()
        {
            Some(row) => Ok(row.try_get("inserted")?),
            None => Err(StoreError::Corrupt("the insert returned no row".into())),
        }
    }

    /// `insert` ([`INSERT`] or [`LEASE_INSERT`]) with a token no crash can hand out twice
    /// ([`unrepeatable_token`]): the token, or `None` when the key exists.
    async fn insert_named(
        &self,
        req: &ClaimRequest<'_>,
        insert: &Bare,
    ) -> Result<Option<i64>, StoreError> {
        let token = unrepeatable_token()?;
        let mut args = claim_args(req, self.lock_timeout);
        // `$6`: the token instead of the lock timeout, which the message's settings carry.
        args[5] = Lit::Int(token);
        let inserted = !self.run_named(insert, &args).await?.is_empty();
        Ok(inserted.then_some(token))
    }

    /// Runs a statement that acts on a claimed key (complete, release, renew) and returns the
    /// rows it changed. Under REPEATABLE READ or SERIALIZABLE (the connection's default), such
    /// a statement fails with a serialization failure when the row changed after its snapshot
    /// (a renewal still in flight as the answer is stored); it is run again, with a new
    /// snapshot: the token condition decides anew.
    pub(super) async fn execute_token_statement(
        &self,
        template: &'static str,
        args: &[Lit<'_>],
    ) -> Result<u64, StoreError> {
        changed_on_retry(|| async move {
            let rows = self.rows(template, args).await?;
            let changed = match rows.first() {
                Some(row) => row.try_get::<i64, _>("changed")?,
                None => 0,
            };
            Ok(changed.unsigned_abs())
        })
        .await
    }

    /// [`execute_token_statement`](Self::execute_token_statement) for a [`Bare`] statement,
    /// which returns a row per record it changed.
    pub(super) async fn execute_bare_token_statement(
        &self,
        bare: &Bare,
        args: &[Lit<'_>],
    ) -> Result<u64, StoreError> {
        changed_on_retry(|| async move {
            let rows = self.run_named(bare, args).await?;
            Ok(u64::try_from(rows.len()).unwrap_or(u64::MAX))
        })
        .await
    }

    /// One attempt of the claim's first step, as the strategy sends it.
    pub(super) async fn look_and_insert(
        &self,
        req: &ClaimRequest<'_>,
    ) -> Result<Decision, StoreError> {
        Ok(match self.strategy {
            ClaimStrategy::Combined => {
                let rows = self
                    .rows(CLAIM, &claim_args(req, self.lock_timeout))
                    .await?;
                let row = rows
                    .first()
                    .ok_or_else(|| StoreError::Corrupt("the claim returned no row".into()))?;
                match row.try_get::<Option<i64>, _>("inserted")? {
                    Some(token) => Decision::Done(acquired(token, false)),
                    None => decide(row, req)?,
                }
            }
            ClaimStrategy::ReadFirst => self.read_first(req).await?,
            ClaimStrategy::InsertFirst => self.insert_first(req).await?,
            ClaimStrategy::Adaptive => {
                let decision = if self.workload.reads_first() {
                    self.read_first(req).await?
                } else {
                    self.insert_first(req).await?
                };
                // Any claim but a fresh insert met a record: a replay, a key in flight or
                // reused, one to take over, or one a concurrent claim inserted first.
                let found = !matches!(decision, Decision::Done(ClaimOutcome::Acquired { .. }));
                self.workload.record(found);
                decision
            }
        })
    }

    /// The read; the insert when the key has no record.
    async fn read_first(&self, req: &ClaimRequest<'_>) -> Result<Decision, StoreError> {
        Ok(match self.read(req).await? {
            Some(row) => decide(&row, req)?,
            None => match self.insert(req).await? {
                Some(token) => Decision::Done(acquired(token, false)),
                None => Decision::Retry,
            },
        })
    }

    /// The insert; the read when the key has a record.
    async fn insert_first(&self, req: &ClaimRequest<'_>) -> Result<Decision, StoreError> {
        Ok(match self.insert(req).await? {
            Some(token) => Decision::Done(acquired(token, false)),
            None => match self.read(req).await? {
                Some(row) => decide(&row, req)?,
                // Deleted between the two statements (released or purged).
                None => Decision::Retry,
            },
        })
    }

    /// The claim of phased mode: a new key's record is inserted by a transaction whose commit
    /// does not wait for its WAL flush, with a token no crash can hand out twice; a key that
    /// has a record is claimed as [`Store::claim`] claims it.
    ///
    /// A phased claim is a lease, not a result: nothing is answered from it, and every phase
    /// after it commits fenced by its token and waits for its own flush, which flushes the
    /// claim's earlier WAL with it. A crash that loses the claim therefore loses nothing that
    /// was answered or committed after it: the request that held it finds its next phase
    /// refused (the key has no record, or another request's token), and a retry claims the
    /// key anew (`tests/database_crash.rs`). What the flush would have cost is a wait on the
    /// WAL for every request before its handler starts (BENCHMARKS.md).
    pub(crate) async fn claim_lease(
        &self,
        req: ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        match self.insert_named(&req, &LEASE_INSERT).await {
            Ok(Some(token)) => Ok(acquired(token, false)),
            // The key has a record: replay, refuse or take it over as any claim does.
            Ok(None) => self.claim(req).await,
            Err(e) if waited_for_lock(&e) => Ok(held_elsewhere()),
            Err(e) => Err(e),
        }
    }
}

/// Runs `statement` (the rows it changed), again after a lost serialization race, up to
/// [`CLAIM_ATTEMPTS`] times in all.
async fn changed_on_retry<F, Fut>(mut statement: F) -> Result<u64, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<u64, StoreError>>,
{
    let mut attempts = 1;
    loop {
        match statement().await {
            Err(e) if lost_race(&e) && attempts < CLAIM_ATTEMPTS => attempts += 1,
            other => return other,
        }
    }
}

/// The arguments of the claim's statements: `$1` scope, `$2` key, `$3` fingerprint, `$4`
/// lease (ms), `$5` time to live (ms).
pub(super) fn claim_args<'a>(req: &'a ClaimRequest<'a>, lock_timeout: Duration) -> [Lit<'a>; 6] {
    [
        Lit::Text(req.scope),
        Lit::Text(req.key.as_str()),
        Lit::Bytes(req.fingerprint.as_bytes()),
        Lit::Int(millis(req.lease)),
        // An in-progress record lives at least as long as its lease.
        Lit::Int(millis(req.ttl.max(req.lease))),
        Lit::Int(millis(lock_timeout)),
    ]
}

/// How often a claim that lost a race is run again before giving up with "in flight".
pub(super) const CLAIM_ATTEMPTS: usize = 4;

pub(super) enum Decision {
    Done(ClaimOutcome),
    /// The record is expired or abandoned: take it over ([`TAKEOVER`]).
    TakeOver {
        /// `false` when the old record had merely expired (that is a new claim).
        abandoned: bool,
    },
    /// No record in our snapshot, yet the insert conflicted: a concurrent insert won. Claim
    /// again.
    Retry,
}

/// Classifies the record read by [`CLAIM`] or [`READ`] (without an `inserted` token).
pub(super) fn decide(row: &PgRow, req: &ClaimRequest<'_>) -> Result<Decision, StoreError> {
    let Some(fingerprint) = row.try_get::<Option<Vec<u8>>, _>("fingerprint")? else {
        return Ok(Decision::Retry);
    };
    if row.try_get::<Option<bool>, _>("claimable")? == Some(true) {
        let expired: Option<bool> = row.try_get("expired")?;
        return Ok(Decision::TakeOver {
            abandoned: expired == Some(false),
        });
    }
    if fingerprint != req.fingerprint.as_bytes() {
        return Ok(Decision::Done(ClaimOutcome::Mismatch));
    }
    if row.try_get::<Option<i64>, _>("lease_token")?.is_some() {
        let left: Option<i64> = row.try_get("lease_left_ms")?;
        let left = u64::try_from(left.unwrap_or(0)).unwrap_or(0);
        return Ok(Decision::Done(ClaimOutcome::InFlight {
            retry_after: Duration::from_millis(left),
        }));
    }
    Ok(Decision::Done(ClaimOutcome::Completed(decode_response(
        row,
    )?)))
}

/// The key is held by another request (or transaction): "in flight", retry in a second.
pub(super) fn held_elsewhere() -> ClaimOutcome {
    ClaimOutcome::InFlight {
        retry_after: Duration::from_secs(1),
    }
}

pub(super) fn acquired(token: i64, takeover: bool) -> ClaimOutcome {
    ClaimOutcome::Acquired {
        token: LeaseToken::from_raw(token),
        takeover,
    }
}
