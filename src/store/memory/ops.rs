//! The memory store's operations on a key: claim, complete, release, renew, watch, purge.

use std::time::Duration;

use crate::error::StoreError;
use crate::key::IdempotencyKey;
use crate::response::StoredResponse;
use crate::store::{ClaimOutcome, ClaimRequest, KeyWatch, LeaseToken, Store};

use super::*;

impl Store for MemoryStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let bytes = record_bytes(req.scope, req.key);
        let usage = &self.inner.usage;
        // Whether room for a new record is reserved already (after the store was full).
        let mut reserved = false;
        loop {
            let (hash, i, mut shard) = self.shard(req.scope, req.key);
            let now = self.now();
            self.sweep(i, &mut shard, now, SWEEP_PER_CLAIM, Sweep::Answers);
            let fresh = |takeover: bool| {
                let token = next_token();
                let entry = Entry {
                    fingerprint: req.fingerprint,
                    // An in-progress record lives at least as long as its lease.
                    expires_at: after(now, req.ttl.max(req.lease)),
                    id: token.into_raw(),
                    place: 0,
                    state: State::InProgress {
                        lease_until: after(now, req.lease),
                    },
                };
                (entry, ClaimOutcome::Acquired { token, takeover })
            };
            let Shard { records, index } = &mut *shard;
            let existing = records
                .get_mut(hash)
                .and_then(|slot| slot.find_mut(req.scope, req.key));
            if let Some(record) = existing {
                if reserved {
                    usage.unreserve(bytes);
                }
                let e = &mut record.entry;
                // Replaces the record in place: same key, so only its answer's bytes go.
                let mut replace = |e: &mut Entry, takeover| {
                    let (entry, outcome) = fresh(takeover);
                    index.remove(e);
                    let was_completed = matches!(e.state, State::Completed(_));
                    usage.freed(0, e.answer_bytes());
                    *e = entry;
                    index.insert(hash, e);
                    if was_completed {
                        self.inner.fronts.reset(i, index);
                    }
                    outcome
                };
                if e.expires_at <= now {
                    // Expired: count it as absent and reuse its slot.
                    return Ok(replace(e, false));
                }
                if e.fingerprint != req.fingerprint {
                    return Ok(ClaimOutcome::Mismatch);
                }
                return match &e.state {
                    State::Completed(answer) => Ok(ClaimOutcome::Completed(answer.decode()?)),
                    State::InProgress { lease_until } if *lease_until > now => {
                        Ok(ClaimOutcome::InFlight {
                            retry_after: Duration::from_nanos(*lease_until - now),
                        })
                    }
                    State::InProgress { .. } => Ok(replace(e, true)),
                };
            }
            if reserved || usage.try_reserve(bytes) {
                let (mut entry, outcome) = fresh(false);
                index.insert(hash, &mut entry);
                let record = Record {
                    scope: req.scope.into(),
                    key: req.key.clone(),
                    entry,
                };
                records.add(hash, record);
                return Ok(outcome);
            }
            // Full: make room with no shard locked, then look again (the key may have been
            // claimed meanwhile).
            drop(shard);
            if !self.make_room(bytes) {
                count_rejected();
                return Err(StoreError::Full);
            }
            reserved = true;
        }
    }

    async fn complete(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let done = self.with_held(scope, key, token, |held, now| match held {
            Some(Held {
                entry: e,
                index,
                hash,
                shard,
            }) => {
                index.remove(e);
                e.state = State::Completed(Answer::encode(response));
                e.expires_at = after(now, ttl);
                index.insert(hash, e);
                self.inner.fronts.added(shard, e.expires_at);
                self.inner.usage.grew(e.answer_bytes());
                true
            }
            None => false,
        });
        if done {
            self.inner.notifier.notify(scope, key);
        }
        Ok(done)
    }

    async fn release(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> Result<bool, StoreError> {
        let (hash, _, mut shard) = self.shard(scope, key);
        let held = shard.records.get(hash).is_some_and(|slot| {
            slot.records()
                .iter()
                .any(|r| r.is(scope, key) && r.entry.holds(token))
        });
        if !held {
            return Ok(false);
        }
        if let Some(record) = shard.take(hash, token.into_raw()) {
            shard.index.remove(&record.entry);
            drop(shard);
            self.inner.usage.freed(1, record.bytes());
        }
        self.inner.notifier.notify(scope, key);
        Ok(true)
    }

    async fn watch(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> Result<Option<KeyWatch>, StoreError> {
        Ok(Some(self.inner.notifier.watch(scope, key)))
    }

    async fn renew(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.with_held(scope, key, token, |held, now| match held {
            Some(Held {
                entry: e,
                index,
                hash,
                ..
            }) => {
                let until = after(now, lease);
                // In-progress records are indexed at their lease's end: the record moves.
                index.remove(e);
                if let State::InProgress { lease_until } = &mut e.state {
                    *lease_until = until;
                }
                // The record lives at least as long as the lease it now holds.
                e.expires_at = e.expires_at.max(until);
                index.insert(hash, e);
                true
            }
            None => false,
        }))
    }

    async fn purge_expired(&self, batch_size: usize) -> Result<u64, StoreError> {
        let batch = batch_size.max(1);
        let mut deleted = 0u64;
        for (i, shard) in self.inner.shards.iter().enumerate() {
            loop {
                // At most `batch` records per hold of the lock, taken from the front of the
                // expiry index: a purge never scans a shard, nor stalls its requests.
                let swept = self.sweep(i, &mut lock(shard), self.now(), batch, Sweep::Expired);
                deleted += swept.removed as u64;
                if swept.steps < batch {
                    break;
                }
            }
        }
        Ok(deleted)
    }
}
