use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

#[cfg(doc)]
use super::Store;
use super::{KeyNotifier, LeaseToken};
#[cfg(doc)]
use crate::error::StoreError;
use crate::key::{IdempotencyKey, MAX_KEY_LEN};

mod answer;
mod fronts;
mod index;
mod ops;
mod shard;
mod slab;
mod usage;

use answer::Answer;
use fronts::Fronts;
use index::{Item, Queue};
use shard::*;
use slab::Slab;
pub use usage::WhenFull;
use usage::{Usage, answer_bytes, count_evicted, count_expired, count_rejected, record_bytes};

/// Shards of a store: each holds its own lock, map and expiry index. A shard's map grows on
/// its own, with a 256th of the records to move (while its lock is held: about 4 ms at 10 M
/// records, against 262 ms with 16 shards at 7.3 M; `benches/memory_scale.rs`).
const SHARDS: usize = 256;

/// How many expired answers a claim removes from its shard, at most, before it looks up its
/// key. More than one: a claim adds at most one record, so the store drops expired answers
/// faster than it takes new ones.
const SWEEP_PER_CLAIM: usize = 4;

/// How many expired answers a claim that finds the store full removes from each shard, at
/// most, before it applies the [`WhenFull`] policy.
const SWEEP_WHEN_FULL: usize = 64;

/// How many times a claim that finds the store full frees records (expired ones, or evicted
/// ones) and tries again before it gives up.
const ROOM_ATTEMPTS: usize = 16;

/// An in-process store: the default for development, tests and single-process services.
///
/// Records live in memory, in sharded maps behind short-lived locks (never held across an
/// `.await`). Everything is lost when the process exits, and two processes do not see each
/// other's keys: run several instances against [`PostgresStore`](crate::PostgresStore).
///
/// Times come from Tokio's clock, so tests can use `tokio::time::pause`.
///
/// # Limits
///
/// The store holds at most [`with_max_entries`](Self::with_max_entries) records (default
/// 1,000,000) and about [`with_max_bytes`](Self::with_max_bytes) bytes (default 1 GiB). The
/// bytes counted for a record are its key, its scope, its answer's status, header names and
/// values and body (with their lengths), and a fixed estimate of what the store spends around
/// them (190 bytes a record, 64 an answer). A record with a 36-character key and a 60-byte
/// JSON answer counts 391 bytes, and takes about 360 of resident memory (measured by
/// `benches/memory_bytes.rs`). With the defaults, a million small answers fit (about 400 MB);
/// larger answers hit the byte limit first.
///
/// The records are spread over 256 shards, each with its own lock. A shard's map holds where
/// each record is, not the record, so when it grows it moves 16 bytes per record, and only a
/// 256th of them: filling a store with 10 million records, no call took longer than about
/// 4 ms (`benches/memory_scale.rs`).
///
/// The limits are checked when a claim would add a record for a new key. Expired answers do
/// not count: a full store drops them first. If that does not make room, the store applies its
/// [`WhenFull`] policy ([`with_when_full`](Self::with_when_full)): by default it fails closed
/// ([`StoreError::Full`], which the layer answers `503` with `Retry-After`); or it evicts the
/// completed records nearest their expiry. In-progress records are never evicted while their
/// lease runs (a live request renews it every third of it). One whose lease ran out was
/// abandoned by its request (a task aborted, a runtime shut down, a future dropped where no
/// release could be sent), whatever its TTL: a full store removes it before it refuses or
/// evicts, so abandoned claims cannot keep a store full until a purge (with the layer's
/// defaults, for the 24 h TTL). Everything
/// but a new key's claim goes on as usual when full: replays, `409`s for running keys, and the
/// answers of running requests, which are always stored (so the bytes may pass the limit by
/// the answers of the requests running when it was reached).
///
/// # Expiry
///
/// An expired record counts as absent at once. The store also removes expired answers on its
/// own, with no task to spawn: each claim first removes up to four from its shard (its shard
/// adds one record at most), in the order they expire, so memory stays bounded by what is
/// live. An in-progress record whose lease ran out stays until its owner completes or releases
/// it, a claim of its key replaces it (a takeover), a claim finds the store full (whatever its
/// TTL), or, once its TTL ran out too, [`purge_expired`](Store::purge_expired) removes it (as
/// the [`Store`] contract says, its token holds it until then; an owner that was only stalled
/// then finds its answer not stored, as after a takeover). A purge leaves a record whose TTL
/// still runs alone: its owner may be stalled rather than gone, and may still store its answer.
/// [`purge_expired`](Store::purge_expired) and
/// [`spawn_purge_task`](crate::spawn_purge_task) still work, removing every expired record;
/// like the claims, they take records from the front of an expiry index, at most
/// `batch_size` per hold of a shard's lock, and never scan a shard.
///
/// # Metrics
///
/// With the `metrics` feature: the gauges `tower_idempotency_memory_records` and
/// `tower_idempotency_memory_bytes` (summed over the process's memory stores), and the
/// counters `tower_idempotency_memory_evictions_total`,
/// `tower_idempotency_memory_rejections_total` (claims refused because the store was full)
/// and `tower_idempotency_memory_expired_total` (expired records removed). None has labels.
///
/// ```
/// use tower_idempotency::{MemoryStore, WhenFull};
///
/// let store = MemoryStore::new()
///     .with_max_entries(100_000)
///     .with_max_bytes(64 << 20)
///     .with_when_full(WhenFull::EvictCompleted);
/// # let _ = store;
/// ```
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    shards: Shards,
    /// When each shard's first completed record expires, for eviction.
    fronts: Fronts,
    /// Randomly keyed SipHash, as `HashMap`'s default: clients choose the keys, so they must
    /// not be able to choose colliding hashes.
    hasher: std::hash::RandomState,
    usage: Usage,
    /// Wakes the duplicates waiting for a key ([`Store::watch`]).
    notifier: KeyNotifier,
    /// Tests only: every (scope, key) gets the same hash, so that records share slots.
    #[cfg(test)]
    same_hash: bool,
    /// Tests only: the most index entries one hold of a shard's lock looked at.
    #[cfg(test)]
    most_looked_at: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let usage = &self.inner.usage;
        f.debug_struct("MemoryStore")
            .field("records", &usage.entries())
            .field("bytes", &usage.bytes())
            .field("max_entries", &usage.max_entries())
            .field("max_bytes", &usage.max_bytes())
            .field("when_full", &usage.when_full())
            .finish()
    }
}

impl MemoryStore {
    /// An empty store, with the default limits (1,000,000 records, 1 GiB) and policy
    /// ([`WhenFull::Reject`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the most records the store holds (default 1,000,000). Records already held are
    /// kept; only claims of new keys are checked. Applies to every clone of this store.
    ///
    /// `0` holds no record: every claim of a new key is refused ([`StoreError::Full`], which
    /// the layer answers `503`), failing closed, never letting a request run unprotected.
    pub fn with_max_entries(self, max: usize) -> Self {
        self.inner.usage.set_max_entries(max);
        self
    }

    /// Sets the most bytes the store counts (default 1 GiB; see [Limits](Self#limits) for
    /// what is counted). Records already held are kept; only claims of new keys are checked.
    /// Applies to every clone of this store. A limit below one record's bytes (`0`) refuses
    /// every new key, as [`with_max_entries(0)`](Self::with_max_entries) does.
    pub fn with_max_bytes(self, max: usize) -> Self {
        self.inner.usage.set_max_bytes(max);
        self
    }

    /// Sets what a claim of a new key does when the store is full (default
    /// [`WhenFull::Reject`]). Applies to every clone of this store.
    pub fn with_when_full(self, policy: WhenFull) -> Self {
        self.inner.usage.set_when_full(policy);
        self
    }

    /// The number of records held, expired ones included until they are removed.
    pub fn len(&self) -> usize {
        self.inner.usage.entries()
    }

    /// Whether the store holds no records.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes counted for the records held (see [Limits](Self#limits)).
    pub fn bytes(&self) -> usize {
        self.inner.usage.bytes()
    }

    /// Now, on the store's clock ([`Fronts::now`]).
    fn now(&self) -> u64 {
        self.inner.fronts.now()
    }

    /// The hash of a (scope, key), its shard's number and its shard, locked.
    fn shard(&self, scope: &str, key: &IdempotencyKey) -> (u64, usize, MutexGuard<'_, Shard>) {
        #[cfg(test)]
        let hash = if self.inner.same_hash {
            0x1234_5678_9abc_def0
        } else {
            hash_of(&self.inner.hasher, scope, key)
        };
        #[cfg(not(test))]
        let hash = hash_of(&self.inner.hasher, scope, key);
        // The map indexes its buckets with the low bits and tags them with the top seven;
        // the shard takes eight bits in between. Reduced to 0..256, the cast cannot truncate.
        #[allow(clippy::cast_possible_truncation)]
        let i = ((hash >> 32) % SHARDS as u64) as usize;
        (hash, i, lock(&self.inner.shards[i]))
    }

    /// Sweeps shard `i`'s index as `sweep` says, at most `max` steps in this hold of its
    /// lock (see [`Shard::sweep`]); counts what it removed.
    fn sweep(&self, i: usize, shard: &mut Shard, now: u64, max: usize, sweep: Sweep) -> Swept {
        // Nothing to do for completed records unless the shard's front has passed: most
        // claims leave the index untouched (its first entry is a walk down the tree).
        if sweep == Sweep::Answers && !self.inner.fronts.has_expired(i, now) {
            return Swept::default();
        }
        let swept = shard.sweep(now, max, sweep);
        if swept.removed > 0 {
            self.inner.fronts.reset(i, &shard.index);
        }
        #[cfg(test)]
        self.inner
            .most_looked_at
            .fetch_max(swept.looked, std::sync::atomic::Ordering::Relaxed);
        self.inner.usage.freed(swept.removed, swept.bytes);
        count_expired(swept.removed);
        swept
    }

    /// Frees room for a new record of `bytes` and reserves it; `false` when the store is
    /// full of records it may not drop. Called with no shard locked; locks one at a time.
    fn make_room(&self, bytes: usize) -> bool {
        let usage = &self.inner.usage;
        for _ in 0..ROOM_ATTEMPTS {
            if usage.try_reserve(bytes) {
                return true;
            }
            let now = self.now();
            let mut freed = 0;
            // Only the shards holding expired answers, found by their fronts.
            for i in self.inner.fronts.expired_by(now) {
                let shard = &mut lock(&self.inner.shards[i]);
                freed += self
                    .sweep(i, shard, now, SWEEP_WHEN_FULL, Sweep::Answers)
                    .removed;
            }
            if freed == 0 {
                freed = self.sweep_abandoned(now);
            }
            if freed == 0 && usage.when_full() == WhenFull::EvictCompleted && self.evict_one() {
                freed = 1;
            }
            if freed == 0 {
                return false;
            }
        }
        usage.try_reserve(bytes)
    }

    /// Removes in-progress records whose lease ran out, whatever their TTL (their requests
    /// stopped renewing: a task aborted, a runtime shut down, a future dropped where no
    /// release could be sent), up to [`SWEEP_WHEN_FULL`] a shard; returns how many. Only a
    /// full store that found no expired answer to drop calls it, so the claims of a store with
    /// room never pay for it: it locks every shard in turn, and takes from the front of each
    /// one's in-progress index alone.
    fn sweep_abandoned(&self, now: u64) -> usize {
        let mut freed = 0;
        for (i, shard) in self.inner.shards.iter().enumerate() {
            let mut shard = lock(shard);
            let index = &shard.index;
            if index.stale.first().is_some() || index.running.first().is_some_and(|f| f.at <= now) {
                freed += self
                    .sweep(i, &mut shard, now, SWEEP_WHEN_FULL, Sweep::Reclaim)
                    .removed;
            }
        }
        freed
    }

    /// Evicts the completed record nearest its expiry, of all shards; `false` when there is
    /// none. Finds its shard by the shards' [`Fronts`], then locks that shard alone.
    fn evict_one(&self) -> bool {
        // A shard picked a moment ago may have lost its completed records since: then look
        // again, a few times at most.
        for _ in 0..ROOM_ATTEMPTS {
            let Some(i) = self.inner.fronts.earliest() else {
                return false;
            };
            let mut shard = lock(&self.inner.shards[i]);
            // Whatever that shard's first completed record is now.
            let first = shard.index.completed.pop_first();
            self.inner.fronts.reset(i, &shard.index);
            let Some(Item { id, hash, .. }) = first else {
                continue;
            };
            let Some(record) = shard.take(hash, id) else {
                continue;
            };
            drop(shard);
            self.inner.usage.freed(1, record.bytes());
            count_evicted(1);
            return true;
        }
        false
    }

    /// Calls `f` with the record of (scope, key) while `token` holds it, expired or not, and
    /// the shard's index: a token holds its in-progress record until another claim replaces
    /// it, or it is released or purged (as in the Postgres store, whose statements match the
    /// token alone).
    fn with_held<T>(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        f: impl FnOnce(Option<Held<'_>>, u64) -> T,
    ) -> T {
        let (hash, i, mut shard) = self.shard(scope, key);
        let now = self.now();
        let Shard { records, index } = &mut *shard;
        let entry = records
            .get_mut(hash)
            .and_then(|slot| slot.find_mut(scope, key))
            .map(|r| &mut r.entry)
            .filter(|e| e.holds(token));
        f(
            entry.map(|entry| Held {
                entry,
                index,
                hash,
                shard: i,
            }),
            now,
        )
    }
}

/// An in-progress record held by a token, with its shard's index ([`MemoryStore::with_held`]).
struct Held<'a> {
    entry: &'a mut Entry,
    index: &'a mut Index,
    /// The hash of its (scope, key).
    hash: u64,
    /// The number of its shard.
    shard: usize,
}

/// The longest span a record or a lease is given: 100 years, as the Postgres store clamps
/// its intervals, so both stores agree on huge durations.
const MAX_SPAN: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `now + d` on the store's clock, saturating: `d` is capped at [`MAX_SPAN`], so
/// `Duration::MAX` means "never".
fn after(now: u64, d: Duration) -> u64 {
    // 100 years is about 3.2e18 nanoseconds: it fits in a `u64`, so the cast cannot truncate.
    #[allow(clippy::cast_possible_truncation)]
    let d = d.min(MAX_SPAN).as_nanos() as u64;
    now.saturating_add(d)
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::error::StoreError;
    use crate::fingerprint::Fingerprint;
    use crate::response::StoredResponse;
    use crate::store::{ClaimOutcome, ClaimRequest, Store};
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

    async fn store_answer(store: &MemoryStore, k: &str, ttl: Duration) {
        let key = IdempotencyKey::parse(k).unwrap();
        let t = token(store.claim(claim("", &key)).await.unwrap());
        let answer = StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::new());
        assert!(store.complete("", &key, t, &answer, ttl).await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn each_claim_removes_up_to_four_expired_answers_of_its_shard() {
        // One shard, one slot: every record is in the claims' way.
        let store = colliding();
        for i in 0..10 {
            store_answer(&store, &format!("old{i}"), Duration::from_secs(1)).await;
        }
        let running = IdempotencyKey::parse("running").unwrap();
        let expired_claim = ClaimRequest {
            lease: Duration::from_millis(100),
            ttl: Duration::from_millis(100),
            ..claim("", &running)
        };
        let t = token(store.claim(expired_claim).await.unwrap());
        tokio::time::advance(Duration::from_secs(2)).await;
        let bytes = store.bytes();
        for (i, left) in [(0, 8), (1, 5), (2, 4), (3, 5)] {
            let key = IdempotencyKey::parse(&format!("new{i}")).unwrap();
            token(store.claim(claim("", &key)).await.unwrap());
            assert_eq!(store.len(), left, "after claim {i}");
        }
        assert!(store.bytes() < bytes);
        // The expired in-progress record stays: its token still holds it.
        assert!(
            store
                .renew("", &running, t, Duration::from_secs(1))
                .await
                .unwrap()
        );
    }

    /// In-progress records abandoned by their requests (a task aborted, a runtime shut down)
    /// whose lease has run out count against the limits only until the store is
    /// full: then a claim removes them before it refuses, instead of failing closed until a
    /// purge.
    #[tokio::test(start_paused = true)]
    async fn a_full_store_removes_abandoned_in_progress_records_before_it_refuses() {
        let store = MemoryStore::new().with_max_entries(8);
        let short = |key| ClaimRequest {
            lease: Duration::from_secs(1),
            ttl: Duration::from_secs(1),
            ..claim("", key)
        };
        let keys: Vec<_> = (0..8)
            .map(|i| IdempotencyKey::parse(&format!("abandoned{i}")).unwrap())
            .collect();
        for key in &keys {
            token(store.claim(short(key)).await.unwrap());
        }
        let new = IdempotencyKey::parse("new").unwrap();
        // Their leases run: the store is full of records it may not drop.
        assert!(matches!(
            store.claim(claim("", &new)).await,
            Err(StoreError::Full)
        ));
        tokio::time::advance(Duration::from_secs(2)).await;
        token(store.claim(claim("", &new)).await.unwrap());
        assert!(store.len() <= 8, "{}", store.len());
    }

    /// With the layer's defaults a claim's lease (30 s) is far shorter than its TTL (24 h):
    /// an in-progress record whose request is gone (a task aborted, a runtime shut down, a
    /// future dropped where no release could be sent) stops being renewed, and once its lease
    /// ran out a full store reclaims it before it refuses, whatever its TTL, whether a purge
    /// has passed over it meanwhile or not. A record whose request still renews its lease is
    /// kept.
    #[tokio::test(start_paused = true)]
    async fn a_full_store_reclaims_claims_whose_lease_ran_out_before_their_ttl() {
        for purged_meanwhile in [false, true] {
            let store = MemoryStore::new().with_max_entries(8);
            let abandoned = |key| ClaimRequest {
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(24 * 3600),
                ..claim("", key)
            };
            let keys: Vec<_> = (0..8)
                .map(|i| IdempotencyKey::parse(&format!("abandoned{i}")).unwrap())
                .collect();
            let mut tokens = Vec::new();
            for key in &keys {
                tokens.push(token(store.claim(abandoned(key)).await.unwrap()));
            }
            let new = IdempotencyKey::parse("new").unwrap();
            assert!(matches!(
                store.claim(claim("", &new)).await,
                Err(StoreError::Full)
            ));
            // The first key's request is alive: it renews its lease every third of it.
            for _ in 0..3 {
                tokio::time::advance(Duration::from_secs(10)).await;
                let renewed = store.renew("", &keys[0], tokens[0], Duration::from_secs(30));
                assert!(renewed.await.unwrap());
            }
            tokio::time::advance(Duration::from_secs(1)).await;
            if purged_meanwhile {
                // Their TTL runs: a purge leaves them.
                assert_eq!(store.purge_expired(100).await.unwrap(), 0);
                assert_eq!(store.len(), 8);
            }
            token(store.claim(claim("", &new)).await.unwrap());
            assert!(store.len() <= 8, "{}", store.len());
            // The live one is kept; a reclaimed one's token no longer holds its key.
            assert!(matches!(
                store.claim(abandoned(&keys[0])).await.unwrap(),
                ClaimOutcome::InFlight { .. }
            ));
            let mut gone = 0;
            for (key, t) in keys.iter().zip(&tokens).skip(1) {
                if !store
                    .renew("", key, *t, Duration::from_secs(30))
                    .await
                    .unwrap()
                {
                    gone += 1;
                }
            }
            assert!(
                gone >= 1,
                "no abandoned claim was reclaimed ({purged_meanwhile})"
            );
        }
    }

    /// A purge removes an in-progress record once its lease and its TTL ran out, and never
    /// before its TTL (its owner may be stalled, not gone, and may still store its answer):
    /// one whose lease ran out first waits aside, out of the way of records that expire
    /// after it, and is removed at its expiry. A renewal brings it back.
    #[tokio::test(start_paused = true)]
    async fn a_purge_removes_a_claim_whose_lease_ran_out_at_its_ttl() {
        let store = MemoryStore::new();
        let with = |key, lease, ttl| ClaimRequest {
            lease: Duration::from_secs(lease),
            ttl: Duration::from_secs(ttl),
            ..claim("", key)
        };
        let [stalled, gone, brief] =
            ["stalled", "gone", "brief"].map(|k| IdempotencyKey::parse(k).unwrap());
        let ts = token(store.claim(with(&stalled, 30, 3600)).await.unwrap());
        let tg = token(store.claim(with(&gone, 30, 3600)).await.unwrap());
        // Its lease ends after theirs, its TTL long before.
        tokio::time::advance(Duration::from_secs(1)).await;
        token(store.claim(with(&brief, 30, 30)).await.unwrap());
        tokio::time::advance(Duration::from_secs(40)).await;
        assert_eq!(store.purge_expired(10).await.unwrap(), 1, "the brief one");
        assert_eq!(store.len(), 2);
        // The stalled owner wakes up and renews: its key is its own again.
        assert!(
            store
                .renew("", &stalled, ts, Duration::from_secs(30))
                .await
                .unwrap()
        );
        tokio::time::advance(Duration::from_secs(20)).await;
        assert_eq!(store.purge_expired(10).await.unwrap(), 0);
        assert!(
            store
                .renew("", &stalled, ts, Duration::from_secs(30))
                .await
                .unwrap()
        );
        let answer = StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::new());
        let ttl = Duration::from_secs(7200);
        assert!(
            store
                .complete("", &stalled, ts, &answer, ttl)
                .await
                .unwrap()
        );
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert_eq!(
            store.purge_expired(10).await.unwrap(),
            1,
            "the gone one, at its TTL"
        );
        assert!(
            !store
                .renew("", &gone, tg, Duration::from_secs(30))
                .await
                .unwrap()
        );
        assert_eq!(store.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn sweeping_and_purging_never_scan_a_shard() {
        let store = MemoryStore::new();
        let n = 200_000;
        for i in 0..n {
            store_answer(&store, &format!("k{i}"), Duration::from_secs(1)).await;
        }
        tokio::time::advance(Duration::from_secs(2)).await;
        let looked = &store.inner.most_looked_at;

        // A claim removes a few expired answers, looking at no more index entries than that.
        looked.store(0, Ordering::Relaxed);
        let key = IdempotencyKey::parse("new").unwrap();
        token(store.claim(claim("", &key)).await.unwrap());
        assert!(looked.load(Ordering::Relaxed) <= SWEEP_PER_CLAIM + 1);
        let left = store.len();
        assert!((n + 1 - SWEEP_PER_CLAIM..=n).contains(&left), "{left}");

        // A purge takes at most a batch per hold of a shard's lock: 13,000 expired records
        // a shard, 1,000 a batch, so each shard's lock is let go a dozen times at least.
        looked.store(0, Ordering::Relaxed);
        let purged = store.purge_expired(1000).await.unwrap();
        assert_eq!(purged, (left - 1) as u64);
        assert!(looked.load(Ordering::Relaxed) <= 1000 + 2);
        assert_eq!(store.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn sweeps_find_expired_records_whatever_order_their_ttls_came_in() {
        // One shard: the long TTLs come first, so the short ones arrive out of order.
        let store = colliding();
        for i in 0..100 {
            store_answer(&store, &format!("long{i}"), Duration::from_secs(10)).await;
            store_answer(&store, &format!("short{i}"), Duration::from_secs(1)).await;
        }
        // A handler that runs on while a thousand others come and go behind it.
        let slow = IdempotencyKey::parse("slow").unwrap();
        let slow_claim = ClaimRequest {
            ttl: Duration::from_secs(5),
            lease: Duration::from_secs(5),
            ..claim("", &slow)
        };
        let slow_token = token(store.claim(slow_claim).await.unwrap());
        for i in 0..1_000 {
            store_answer(&store, &format!("brief{i}"), Duration::from_secs(20)).await;
        }
        assert_eq!(store.len(), 1_201);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(store.purge_expired(1_000).await.unwrap(), 100);
        tokio::time::advance(Duration::from_secs(4)).await;
        // The slow handler's record, which a thousand completions passed.
        assert_eq!(store.purge_expired(1_000).await.unwrap(), 1);
        assert!(
            !store
                .renew("", &slow, slow_token, Duration::from_secs(1))
                .await
                .unwrap()
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(store.purge_expired(1_000).await.unwrap(), 100);
        assert_eq!(store.len(), 1_000);
    }

    #[test]
    fn a_store_made_after_a_paused_clock_started_reads_that_clock_right() {
        // The runtime's clock stops when it is built; the store, made 300 ms later outside
        // it, then sees times before its own making. Answers must live their TTL and
        // leases their length all the same, not read as expired (nor longer) because those
        // times came before the store.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let store = colliding();
        rt.block_on(async {
            let (done, running) = (
                IdempotencyKey::parse("done").unwrap(),
                IdempotencyKey::parse("running").unwrap(),
            );
            let brief = |key| ClaimRequest {
                lease: Duration::from_millis(100),
                ttl: Duration::from_millis(100),
                ..claim("", key)
            };
            let t = token(store.claim(brief(&done)).await.unwrap());
            let answer = StoredResponse::new(StatusCode::OK, HeaderMap::new(), Bytes::new());
            let ttl = Duration::from_millis(50);
            assert!(store.complete("", &done, t, &answer, ttl).await.unwrap());
            token(store.claim(brief(&running)).await.unwrap());

            tokio::time::advance(Duration::from_millis(40)).await;
            assert_eq!(store.purge_expired(10).await.unwrap(), 0);
            assert_eq!(
                store.claim(brief(&done)).await.unwrap(),
                ClaimOutcome::Completed(answer.clone())
            );
            assert_eq!(
                store.claim(brief(&running)).await.unwrap(),
                ClaimOutcome::InFlight {
                    retry_after: Duration::from_millis(60)
                }
            );
            tokio::time::advance(Duration::from_millis(20)).await;
            assert_eq!(store.purge_expired(10).await.unwrap(), 1);
        });
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
