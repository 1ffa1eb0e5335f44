use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::{ClaimOutcome, ClaimRequest, LeaseToken, Store};
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::response::StoredResponse;

const SHARDS: usize = 16;

/// An in-process store: the default for development, tests and single-process services.
///
/// Records live in memory, in sharded maps behind short-lived locks (never held across an
/// `.await`). Everything is lost when the process exits, and two processes do not see each
/// other's keys: run several instances against [`PostgresStore`](crate::PostgresStore).
///
/// Times come from Tokio's clock, so tests can use `tokio::time::pause`.
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    shards: [Mutex<Shard>; SHARDS],
    hasher: std::hash::RandomState,
}

/// Records by scope, then key: lookups borrow `&str`s, so only an insert allocates.
type Shard = HashMap<Box<str>, HashMap<Box<str>, Entry>>;

struct Entry {
    fingerprint: Fingerprint,
    expires_at: Instant,
    state: State,
}

enum State {
    InProgress {
        token: LeaseToken,
        lease_until: Instant,
    },
    Completed(StoredResponse),
}

/// Tokens are unique per process, across all memory stores.
static NEXT_TOKEN: AtomicI64 = AtomicI64::new(1);

fn next_token() -> LeaseToken {
    LeaseToken::from_raw(NEXT_TOKEN.fetch_add(1, Ordering::Relaxed))
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .finish()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of records held, expired ones included until they are purged.
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| lock(s).values().map(HashMap::len).sum::<usize>())
            .sum()
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, scope: &str, key: &IdempotencyKey) -> MutexGuard<'_, Shard> {
        // Reducing modulo SHARDS keeps the value below 16; the truncation is the point.
        #[allow(clippy::cast_possible_truncation)]
        let i = (self.inner.hasher.hash_one((scope, key.as_str())) % SHARDS as u64) as usize;
        lock(&self.inner.shards[i])
    }

    fn with_entry<T>(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        f: impl FnOnce(Option<&mut Entry>, Instant) -> T,
    ) -> T {
        let mut shard = self.shard(scope, key);
        let now = Instant::now();
        let entry = shard
            .get_mut(scope)
            .and_then(|keys| keys.get_mut(key.as_str()))
            .filter(|e| e.expires_at > now);
        f(entry, now)
    }
}

/// A poisoned shard only means another thread panicked while holding the lock; every
/// mutation below leaves the map consistent at each step, so the data is still valid.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Store for MemoryStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let mut shard = self.shard(req.scope, req.key);
        let now = Instant::now();
        let fresh = |takeover: bool| {
            let token = next_token();
            let entry = Entry {
                fingerprint: req.fingerprint,
                expires_at: now + req.ttl,
                state: State::InProgress {
                    token,
                    lease_until: now + req.lease,
                },
            };
            (entry, ClaimOutcome::Acquired { token, takeover })
        };
        let existing = shard
            .get_mut(req.scope)
            .and_then(|keys| keys.get_mut(req.key.as_str()));
        match existing {
            Some(e) if e.expires_at > now => {
                if e.fingerprint != req.fingerprint {
                    return Ok(ClaimOutcome::Mismatch);
                }
                match &e.state {
                    State::Completed(resp) => Ok(ClaimOutcome::Completed(resp.clone())),
                    State::InProgress { lease_until, .. } if *lease_until > now => {
                        Ok(ClaimOutcome::InFlight {
                            retry_after: *lease_until - now,
                        })
                    }
                    State::InProgress { .. } => {
                        let (entry, outcome) = fresh(true);
                        *e = entry;
                        Ok(outcome)
                    }
                }
            }
            // Expired: count it as absent and reuse its slot.
            Some(e) => {
                let (entry, outcome) = fresh(false);
                *e = entry;
                Ok(outcome)
            }
            None => {
                let (entry, outcome) = fresh(false);
                let keys = match shard.get_mut(req.scope) {
                    Some(keys) => keys,
                    None => shard.entry(req.scope.into()).or_default(),
                };
                keys.insert(req.key.as_str().into(), entry);
                Ok(outcome)
            }
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
        Ok(self.with_entry(scope, key, |entry, now| match entry {
            Some(e) if matches!(e.state, State::InProgress { token: t, .. } if t == token) => {
                e.state = State::Completed(response.clone());
                e.expires_at = now + ttl;
                true
            }
            _ => false,
        }))
    }

    async fn release(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> Result<bool, StoreError> {
        let mut shard = self.shard(scope, key);
        let Some(keys) = shard.get_mut(scope) else {
            return Ok(false);
        };
        let held = matches!(
            keys.get(key.as_str()),
            Some(Entry { state: State::InProgress { token: t, .. }, .. }) if *t == token
        );
        if held {
            keys.remove(key.as_str());
            if keys.is_empty() {
                shard.remove(scope);
            }
        }
        Ok(held)
    }

    async fn renew(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.with_entry(scope, key, |entry, now| match entry {
            Some(Entry {
                state:
                    State::InProgress {
                        token: t,
                        lease_until,
                    },
                ..
            }) if *t == token => {
                *lease_until = now + lease;
                true
            }
            _ => false,
        }))
    }

    async fn purge_expired(&self, batch_size: usize) -> Result<u64, StoreError> {
        let batch = batch_size.max(1);
        let mut deleted = 0u64;
        for shard in &self.inner.shards {
            loop {
                // Bounded work per lock, so a purge never stalls requests on that shard.
                let mut map = lock(shard);
                let now = Instant::now();
                let mut budget = batch;
                map.retain(|_, keys| {
                    keys.retain(|_, e| {
                        if budget > 0 && e.expires_at <= now {
                            budget -= 1;
                            false
                        } else {
                            true
                        }
                    });
                    !keys.is_empty()
                });
                let n = batch - budget;
                deleted += n as u64;
                if n < batch {
                    break;
                }
            }
        }
        Ok(deleted)
    }
}
