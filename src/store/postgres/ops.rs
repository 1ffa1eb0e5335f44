//! The Postgres store's operations on a key: claim, complete, release, renew, watch, purge.

use std::time::Duration;

use sqlx::Row;

use super::*;
use crate::error::StoreError;
use crate::store::sql::Lit;

impl Store for PostgresStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        for _ in 0..CLAIM_ATTEMPTS {
            // Under REPEATABLE READ or SERIALIZABLE (the connection's default isolation level),
            // an insert that meets a record committed after its statement's snapshot fails
            // with a serialization failure: a concurrent claim won. Like a lost race under
            // READ COMMITTED, that is claimed again, with a new snapshot that sees the record.
            let decision = match self.look_and_insert(&req).await {
                Err(e) if lost_race(&e) => Decision::Retry,
                // Another transaction holds the key's row (a transactional-mode request on
                // the same key) longer than the store's lock timeout: the key is in use.
                Err(e) if waited_for_lock(&e) => return Ok(held_elsewhere()),
                other => other?,
            };
            match decision {
                Decision::Done(outcome) => return Ok(outcome),
                Decision::Retry => {}
                Decision::TakeOver { abandoned } => {
                    match self
                        .rows(TAKEOVER, &claim_args(&req, self.lock_timeout))
                        .await
                    {
                        Ok(rows) => {
                            let token = match rows.first() {
                                Some(row) => row.try_get::<Option<i64>, _>("lease_token")?,
                                None => None,
                            };
                            if let Some(token) = token {
                                return Ok(acquired(token, abandoned));
                            }
                        }
                        Err(e) if lost_race(&e) => {}
                        Err(e) if waited_for_lock(&e) => return Ok(held_elsewhere()),
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        // Every attempt lost a race to another claimer, which therefore holds the key now.
        Ok(held_elsewhere())
    }

    async fn complete(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let status = status_column(response)?;
        let headers = response.encode_headers();
        let args = [
            Lit::Text(scope),
            Lit::Text(key.as_str()),
            Lit::Int(token.into_raw()),
            Lit::Int(millis(ttl)),
            Lit::Int(i64::from(status)),
            Lit::Bytes(&headers),
            Lit::MaybeBytes(response.body().map(|b| &b[..])),
            Lit::Int(millis(self.lock_timeout)),
            Lit::Int(self.notification(scope, key).unwrap_or_default()),
        ];
        let done = match (self.prepared, &self.notifier) {
            (false, Some(_)) => {
                let mut bare_args = args;
                // The bare statement's `$8` is the key's hash: the lock bound is a setting.
                bare_args[7] = bare_args[8];
                self.execute_bare_token_statement(&COMPLETE_BARE_WAKE, &bare_args[..8])
                    .await?
            }
            (false, None) => {
                self.execute_bare_token_statement(&COMPLETE_BARE, &args[..7])
                    .await?
            }
            (true, Some(_)) => self.execute_token_statement(COMPLETE_WAKE, &args).await?,
            (true, None) => self.execute_token_statement(COMPLETE, &args[..8]).await?,
        };
        Ok(done == 1)
    }

    async fn release(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> Result<bool, StoreError> {
        let args = [
            Lit::Text(scope),
            Lit::Text(key.as_str()),
            Lit::Int(token.into_raw()),
            Lit::Int(millis(self.lock_timeout)),
            Lit::Int(self.notification(scope, key).unwrap_or_default()),
        ];
        let done = match self.notifier {
            Some(_) => self.execute_token_statement(RELEASE_WAKE, &args).await?,
            None => self.execute_token_statement(RELEASE, &args[..4]).await?,
        };
        Ok(done == 1)
    }

    async fn renew(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let args = [
            Lit::Text(scope),
            Lit::Text(key.as_str()),
            Lit::Int(token.into_raw()),
            Lit::Int(millis(lease)),
            Lit::Int(millis(self.lock_timeout)),
        ];
        let done = self.execute_token_statement(RENEW, &args).await?;
        Ok(done == 1)
    }

    async fn watch(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> Result<Option<KeyWatch>, StoreError> {
        match &self.notifier {
            Some(notifier) => notifier
                .watch(&self.pool, scope, key)
                .await
                .map_err(|e| self.error(e)),
            None => Ok(None),
        }
    }

    async fn purge_expired(&self, batch_size: usize) -> Result<u64, StoreError> {
        let batch = i64::try_from(batch_size.max(1)).unwrap_or(i64::MAX);
        let rendered = self.rendered().await?;
        // The waiting duplicates' registrations past their time (few: one per key waited for).
        self.execute(&rendered.purge_waiting, &[]).await?;
        let mut deleted = 0;
        loop {
            let started = std::time::Instant::now();
            let done = self.execute(&rendered.purge, &[Lit::Int(batch)]).await?;
            deleted += done;
            if done < batch.unsigned_abs() {
                return Ok(deleted);
            }
            if self.purge_duty < 1.0 {
                let rest = started.elapsed().mul_f64(1.0 / self.purge_duty - 1.0);
                tokio::time::sleep(rest).await;
            }
        }
    }
}
