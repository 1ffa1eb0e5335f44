use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::{ClaimOutcome, ClaimRequest, LeaseToken, Store};
use crate::error::StoreError;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, MAX_KEY_LEN};
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
    /// Randomly keyed SipHash, as `HashMap`'s default: clients choose the keys, so they must
    /// not be able to choose colliding hashes.
    hasher: std::hash::RandomState,
    /// Tests only: every (scope, key) gets the same hash, so that records share slots.
    #[cfg(test)]
    same_hash: bool,
}

/// Records by the hash of their (scope, key). Each call hashes its (scope, key) once; the
/// shard and the map use that hash as it is (see [`Prehashed`]). Records whose hashes collide
/// share a [`Slot`].
type Shard = HashMap<u64, Slot, BuildHasherDefault<Prehashed>>;

/// A map hasher for keys that already are a hash: it returns the `u64` it was given.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }

    // Only `u64` keys are hashed with it; any other input is folded in all the same.
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
}

/// The records of one hash: almost always one.
enum Slot {
    One(Record),
    Many(Vec<Record>),
}

struct Record {
    scope: Box<str>,
    key: IdempotencyKey,
    entry: Entry,
}

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

impl Record {
    fn is(&self, scope: &str, key: &IdempotencyKey) -> bool {
        self.key == *key && *self.scope == *scope
    }
}

impl Slot {
    fn records(&self) -> &[Record] {
        match self {
            Slot::One(r) => std::slice::from_ref(r),
            Slot::Many(rs) => rs,
        }
    }

    fn records_mut(&mut self) -> &mut [Record] {
        match self {
            Slot::One(r) => std::slice::from_mut(r),
            Slot::Many(rs) => rs,
        }
    }

    fn find_mut(&mut self, scope: &str, key: &IdempotencyKey) -> Option<&mut Record> {
        self.records_mut().iter_mut().find(|r| r.is(scope, key))
    }

    fn push(&mut self, record: Record) {
        let records = match std::mem::replace(self, Slot::Many(Vec::new())) {
            Slot::One(first) => vec![first, record],
            Slot::Many(mut records) => {
                records.push(record);
                records
            }
        };
        *self = Slot::Many(records);
    }

    /// Keeps the records for which `keep` holds; `false` when none is left.
    fn retain(&mut self, mut keep: impl FnMut(&Record) -> bool) -> bool {
        match self {
            Slot::One(r) => keep(r),
            Slot::Many(rs) => {
                rs.retain(|r| keep(r));
                !rs.is_empty()
            }
        }
    }
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
            .map(|s| {
                lock(s)
                    .values()
                    .map(|slot| slot.records().len())
                    .sum::<usize>()
            })
            .sum()
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The hash of a (scope, key) and its shard, locked.
    fn shard(&self, scope: &str, key: &IdempotencyKey) -> (u64, MutexGuard<'_, Shard>) {
        #[cfg(test)]
        let hash = if self.inner.same_hash {
            0x1234_5678_9abc_def0
        } else {
            hash_of(&self.inner.hasher, scope, key)
        };
        #[cfg(not(test))]
        let hash = hash_of(&self.inner.hasher, scope, key);
        // The map indexes its buckets with the low bits and tags them with the top seven;
        // the shard takes four bits in between. Masked to 0..16, the cast cannot truncate.
        #[allow(clippy::cast_possible_truncation)]
        let i = ((hash >> 32) % SHARDS as u64) as usize;
        (hash, lock(&self.inner.shards[i]))
    }

    /// Calls `f` with the record of (scope, key) while `token` holds it, expired or not: a
    /// token holds its in-progress record until another claim replaces it, or it is
    /// released or purged (as in the Postgres store, whose statements match the token alone).
    fn with_held<T>(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        f: impl FnOnce(Option<&mut Entry>, Instant) -> T,
    ) -> T {
        let (hash, mut shard) = self.shard(scope, key);
        let now = Instant::now();
        let entry = shard
            .get_mut(&hash)
            .and_then(|slot| slot.find_mut(scope, key))
            .map(|r| &mut r.entry)
            .filter(|e| matches!(e.state, State::InProgress { token: t, .. } if t == token));
        f(entry, now)
    }
}

/// The longest span a record or a lease is given: 100 years, as the Postgres store clamps
/// its intervals, so both stores agree on huge durations.
const MAX_SPAN: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `now + d`, saturating: `d` is capped at [`MAX_SPAN`], so `Duration::MAX` means "never".
fn after(now: Instant, d: Duration) -> Instant {
    let d = d.min(MAX_SPAN);
    // `Instant` counts from an arbitrary origin (the boot, on most platforms): 100 years past
    // now fits in its 64-bit seconds or nanoseconds. Should a platform's not, a day is the
    // fallback rather than a panic.
    now.checked_add(d)
        .or_else(|| now.checked_add(d.min(Duration::from_secs(24 * 3600))))
        .unwrap_or(now)
}

/// The hash of a (scope, key): the scope's length, the scope and the key, in one write when
/// they fit in a small buffer (SipHash pays per write).
fn hash_of(hasher: &std::hash::RandomState, scope: &str, key: &IdempotencyKey) -> u64 {
    let (scope, key) = (scope.as_bytes(), key.as_str().as_bytes());
    let mut h = hasher.build_hasher();
    let mut buf = [0u8; 8 + 120 + MAX_KEY_LEN];
    let len = 8 + scope.len() + key.len();
    if let Some(out) = buf.get_mut(..len) {
        out[..8].copy_from_slice(&(scope.len() as u64).to_le_bytes());
        out[8..8 + scope.len()].copy_from_slice(scope);
        out[8 + scope.len()..].copy_from_slice(key);
        h.write(out);
    } else {
        h.write_u64(scope.len() as u64);
        h.write(scope);
        h.write(key);
    }
    h.finish()
}

/// A poisoned shard only means another thread panicked while holding the lock; every
/// mutation below leaves the map consistent at each step, so the data is still valid.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Store for MemoryStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let (hash, mut shard) = self.shard(req.scope, req.key);
        let now = Instant::now();
        let fresh = |takeover: bool| {
            let token = next_token();
            let entry = Entry {
                fingerprint: req.fingerprint,
                // An in-progress record lives at least as long as its lease.
                expires_at: after(now, req.ttl.max(req.lease)),
                state: State::InProgress {
                    token,
                    lease_until: after(now, req.lease),
                },
            };
            (entry, ClaimOutcome::Acquired { token, takeover })
        };
        let new_record = |entry| Record {
            scope: req.scope.into(),
            key: req.key.clone(),
            entry,
        };
        let slot = match shard.entry(hash) {
            MapEntry::Occupied(slot) => slot.into_mut(),
            MapEntry::Vacant(vacant) => {
                let (entry, outcome) = fresh(false);
                vacant.insert(Slot::One(new_record(entry)));
                return Ok(outcome);
            }
        };
        let Some(record) = slot.find_mut(req.scope, req.key) else {
            // Another (scope, key) with the same hash.
            let (entry, outcome) = fresh(false);
            slot.push(new_record(entry));
            return Ok(outcome);
        };
        let e = &mut record.entry;
        if e.expires_at <= now {
            // Expired: count it as absent and reuse its slot.
            let (entry, outcome) = fresh(false);
            *e = entry;
            return Ok(outcome);
        }
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

    async fn complete(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.with_held(scope, key, token, |entry, now| match entry {
            Some(e) => {
                e.state = State::Completed(response.clone());
                e.expires_at = after(now, ttl);
                true
            }
            None => false,
        }))
    }

    async fn release(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> Result<bool, StoreError> {
        let (hash, mut shard) = self.shard(scope, key);
        let MapEntry::Occupied(mut slot) = shard.entry(hash) else {
            return Ok(false);
        };
        let held = |r: &Record| {
            r.is(scope, key)
                && matches!(r.entry.state, State::InProgress { token: t, .. } if t == token)
        };
        if !slot.get().records().iter().any(held) {
            return Ok(false);
        }
        if !slot.get_mut().retain(|r| !held(r)) {
            slot.remove();
        }
        Ok(true)
    }

    async fn renew(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        Ok(self.with_held(scope, key, token, |entry, now| match entry {
            Some(Entry {
                state: State::InProgress { lease_until, .. },
                expires_at,
                ..
            }) => {
                *lease_until = after(now, lease);
                // The record lives at least as long as the lease it now holds.
                *expires_at = (*expires_at).max(*lease_until);
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
                map.retain(|_, slot| {
                    slot.retain(|r| {
                        if budget > 0 && r.entry.expires_at <= now {
                            budget -= 1;
                            false
                        } else {
                            true
                        }
                    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    fn colliding() -> MemoryStore {
        MemoryStore {
            inner: Arc::new(Inner {
                same_hash: true,
                ..Inner::default()
            }),
        }
    }

    fn claim<'a>(scope: &'a str, key: &'a IdempotencyKey) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            fingerprint: Fingerprint::from_bytes([7; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        }
    }

    fn token(outcome: ClaimOutcome) -> LeaseToken {
        match outcome {
            ClaimOutcome::Acquired { token, .. } => token,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn records_with_the_same_hash_stay_apart() {
        let store = colliding();
        let (a, b) = (
            IdempotencyKey::parse("a").unwrap(),
            IdempotencyKey::parse("b").unwrap(),
        );
        let ta = token(store.claim(claim("", &a)).await.unwrap());
        let tb = token(store.claim(claim("", &b)).await.unwrap());
        let tc = token(store.claim(claim("tenant", &a)).await.unwrap());
        assert_eq!(store.len(), 3);

        let answer = StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::new());
        let ttl = Duration::from_secs(60);
        assert!(store.complete("", &a, ta, &answer, ttl).await.unwrap());
        assert!(!store.complete("", &b, ta, &answer, ttl).await.unwrap());
        assert_eq!(
            store.claim(claim("", &a)).await.unwrap(),
            ClaimOutcome::Completed(answer.clone())
        );
        assert!(matches!(
            store.claim(claim("", &b)).await.unwrap(),
            ClaimOutcome::InFlight { .. }
        ));

        assert!(store.release("", &b, tb).await.unwrap());
        assert!(!store.release("", &b, tb).await.unwrap());
        assert!(store.release("tenant", &a, tc).await.unwrap());
        assert_eq!(store.len(), 1);
        assert!(matches!(
            store.claim(claim("", &b)).await.unwrap(),
            ClaimOutcome::Acquired {
                takeover: false,
                ..
            }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn huge_durations_saturate_instead_of_panicking() {
        let store = MemoryStore::new();
        let key = IdempotencyKey::parse("k").unwrap();
        let forever = ClaimRequest {
            lease: Duration::MAX,
            ttl: Duration::MAX,
            ..claim("", &key)
        };
        let t = token(store.claim(forever).await.unwrap());
        tokio::time::advance(Duration::from_secs(10 * 365 * 24 * 3600)).await;
        assert!(matches!(
            store.claim(forever).await.unwrap(),
            ClaimOutcome::InFlight { .. }
        ));
        assert!(store.renew("", &key, t, Duration::MAX).await.unwrap());
        let answer = StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::new());
        assert!(
            store
                .complete("", &key, t, &answer, Duration::MAX)
                .await
                .unwrap()
        );
        tokio::time::advance(Duration::from_secs(10 * 365 * 24 * 3600)).await;
        assert_eq!(
            store.claim(forever).await.unwrap(),
            ClaimOutcome::Completed(answer)
        );
        assert_eq!(store.purge_expired(10).await.unwrap(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn purge_empties_shared_slots() {
        let store = colliding();
        for k in ["a", "b", "c"] {
            let key = IdempotencyKey::parse(k).unwrap();
            store.claim(claim("", &key)).await.unwrap();
        }
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(store.purge_expired(2).await.unwrap(), 3);
        assert!(store.is_empty());
    }
}
