//! The Redis store's operations on a key: claim, complete, release, renew, watch, purge.

use std::time::Duration;

use ::redis::Value;

use crate::error::StoreError;
use crate::key::IdempotencyKey;
use crate::response::StoredResponse;
use crate::store::{ClaimOutcome, ClaimRequest, KeyWatch, LeaseToken, Store};

use super::*;

impl Store for RedisStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let keys = self.keys(req.scope, req.key);
        let lease = millis(req.lease).to_string();
        // An in-progress record lives at least as long as its lease.
        let life = millis(req.ttl.max(req.lease)).to_string();
        let grace = millis(self.grace).to_string();
        let reply: Vec<Value> = self
            .run(
                &self.scripts.claim,
                &keys,
                &[
                    req.fingerprint.as_bytes(),
                    lease.as_bytes(),
                    life.as_bytes(),
                    grace.as_bytes(),
                ],
            )
            .await?;
        decode_claim(&reply)
    }

    async fn complete(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let keys = self.keys(scope, key);
        let token = token.into_raw().to_string();
        let ttl = millis(ttl).to_string();
        let status = response.status().as_u16().to_string();
        let headers = response.encode_headers();
        let body = response.body().map(|b| &b[..]);
        let grace = millis(self.grace).to_string();
        let (channel, message) = self.wake(scope, key);
        let done: Value = self
            .run(
                &self.scripts.complete,
                &keys,
                &[
                    token.as_bytes(),
                    ttl.as_bytes(),
                    status.as_bytes(),
                    &headers,
                    body.unwrap_or_default(),
                    if body.is_some() { b"1" } else { b"0" },
                    grace.as_bytes(),
                    channel.as_bytes(),
                    message.as_bytes(),
                    if self.wait.is_some() { b"1" } else { b"0" },
                ],
            )
            .await?;
        match done {
            Value::Int(0) => Ok(false),
            Value::Int(1) => Ok(true),
            // Stored, by the master of the replication ID named (when asked to wait for its
            // replicas; empty when the server was not a master).
            Value::BulkString(server) => {
                let server = String::from_utf8_lossy(&server);
                self.wait_replicas(&server, &keys.0).await?;
                Ok(true)
            }
            _ => Err(corrupt("completion")),
        }
    }

    async fn release(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> Result<bool, StoreError> {
        let keys = self.keys(scope, key);
        let token = token.into_raw().to_string();
        let grace = millis(self.grace).to_string();
        let (channel, message) = self.wake(scope, key);
        let done: i64 = self
            .run(
                &self.scripts.release,
                &keys,
                &[
                    token.as_bytes(),
                    grace.as_bytes(),
                    channel.as_bytes(),
                    message.as_bytes(),
                ],
            )
            .await?;
        Ok(done == 1)
    }

    async fn renew(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let keys = self.keys(scope, key);
        let token = token.into_raw().to_string();
        let lease = millis(lease).to_string();
        let grace = millis(self.grace).to_string();
        let done: i64 = self
            .run(
                &self.scripts.renew,
                &keys,
                &[token.as_bytes(), lease.as_bytes(), grace.as_bytes()],
            )
            .await?;
        Ok(done == 1)
    }

    async fn watch(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> Result<Option<KeyWatch>, StoreError> {
        match &self.notifier {
            Some(notifier) => Ok(notifier.watch(scope, key).await),
            None => Ok(None),
        }
    }

    /// Deletes the in-progress records past their logical end (completed records leave by
    /// Redis's own expiry), `SCAN`ning the store's prefix on each master, `batch_size` keys
    /// a step.
    async fn purge_expired(&self, batch_size: usize) -> Result<u64, StoreError> {
        let grace = millis(self.grace).to_string();
        let mut deleted = 0;
        for node in self.masters().await? {
            let mut cursor = 0;
            loop {
                let (next, records) = self.scan(node.as_ref(), cursor, batch_size.max(1)).await?;
                for record in records {
                    let Some(stem) = record.strip_suffix(":r") else {
                        continue;
                    };
                    let keys = (record.clone(), format!("{stem}:f"));
                    let done: i64 = self
                        .run(&self.scripts.purge, &keys, &[grace.as_bytes()])
                        .await?;
                    deleted += done.unsigned_abs();
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(deleted)
    }
}
