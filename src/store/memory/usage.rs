//! What a [`MemoryStore`](super::MemoryStore) holds and may hold: its limits, its counts of
//! records and bytes, what it does when full, and their metrics.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use crate::key::IdempotencyKey;

/// What a [`MemoryStore`](super::MemoryStore) does with the claim of a new key when it is
/// full (it holds its [most records](super::MemoryStore::with_max_entries) or [most
/// bytes](super::MemoryStore::with_max_bytes)).
///
/// Whatever the policy, a full store first drops the expired answers it still holds, then
/// applies the policy only if that did not make room. Only the claim of a **new** key is ever
/// refused: repeats of stored keys are still replayed, duplicates of running keys still get
/// `409`, mismatches `422`, and a running request still stores its answer. An in-progress
/// record is never evicted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum WhenFull {
    /// Fail closed (the default): the claim fails with [`StoreError::Full`](crate::StoreError::Full),
    /// which the layer answers `503 Service Unavailable` with `Retry-After`, without running
    /// the handler. No stored answer is ever dropped early, so no retry can run a handler
    /// twice because of the limits.
    #[default]
    Reject,
    /// Make room by evicting completed records, those nearest their expiry first (with one
    /// TTL for every key, the oldest answers first). A retry of an evicted key runs its handler
    /// again, as after its TTL. When only in-progress records are left to evict, the claim
    /// fails as with [`Reject`](WhenFull::Reject).
    EvictCompleted,
}

/// The default [`MemoryStore::with_max_entries`](super::MemoryStore::with_max_entries).
pub(crate) const DEFAULT_MAX_ENTRIES: usize = 1_000_000;
/// The default [`MemoryStore::with_max_bytes`](super::MemoryStore::with_max_bytes): 1 GiB.
pub(crate) const DEFAULT_MAX_BYTES: usize = 1 << 30;

/// What a record costs besides its key, scope and answer: its slot (120 bytes, in a chunk of
/// its shard), its place in the shard's map (which keeps spare places), its item in the
/// expiry index (24 bytes in a queue that keeps spare room) and its key's allocation. An
/// estimate on the safe side, checked against the resident memory of a million records by
/// `benches/memory_bytes.rs` (a record counted 391 bytes takes about 360).
pub(crate) const RECORD_OVERHEAD: usize = 190;
/// What a stored answer costs besides its header names and values and its body: its
/// allocations and their bookkeeping. An estimate, as [`RECORD_OVERHEAD`].
pub(crate) const ANSWER_OVERHEAD: usize = 64;

/// The bytes counted for a record without its answer.
pub(crate) fn record_bytes(scope: &str, key: &IdempotencyKey) -> usize {
    RECORD_OVERHEAD + scope.len() + key.as_str().len()
}

/// The bytes counted for a stored answer whose encoding (its status, header names and values,
/// body, and their lengths) takes `encoded` bytes.
pub(crate) fn answer_bytes(encoded: usize) -> usize {
    ANSWER_OVERHEAD + encoded
}

/// The limits and the counts of one store (shared by its clones).
pub(crate) struct Usage {
    entries: AtomicUsize,
    bytes: AtomicUsize,
    max_entries: AtomicUsize,
    max_bytes: AtomicUsize,
    when_full: AtomicU8,
}

impl Default for Usage {
    fn default() -> Self {
        Self {
            entries: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            max_entries: AtomicUsize::new(DEFAULT_MAX_ENTRIES),
            max_bytes: AtomicUsize::new(DEFAULT_MAX_BYTES),
            when_full: AtomicU8::new(0),
        }
    }
}

impl Usage {
    pub(crate) fn set_max_entries(&self, n: usize) {
        self.max_entries.store(n, Ordering::Relaxed);
    }

    pub(crate) fn set_max_bytes(&self, n: usize) {
        self.max_bytes.store(n, Ordering::Relaxed);
    }

    pub(crate) fn set_when_full(&self, policy: WhenFull) {
        let raw = match policy {
            WhenFull::Reject => 0,
            WhenFull::EvictCompleted => 1,
        };
        self.when_full.store(raw, Ordering::Relaxed);
    }

    pub(crate) fn when_full(&self) -> WhenFull {
        match self.when_full.load(Ordering::Relaxed) {
            1 => WhenFull::EvictCompleted,
            _ => WhenFull::Reject,
        }
    }

    pub(crate) fn max_entries(&self) -> usize {
        self.max_entries.load(Ordering::Relaxed)
    }

    pub(crate) fn max_bytes(&self) -> usize {
        self.max_bytes.load(Ordering::Relaxed)
    }

    pub(crate) fn entries(&self) -> usize {
        self.entries.load(Ordering::Relaxed)
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Counts a new record of `bytes` if it fits under both limits; `false` (counting nothing)
    /// when it does not.
    pub(crate) fn try_reserve(&self, bytes: usize) -> bool {
        let max_entries = self.max_entries();
        let max_bytes = self.max_bytes();
        if self
            .entries
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max_entries).then_some(n + 1)
            })
            .is_err()
        {
            return false;
        }
        if self
            .bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                b.checked_add(bytes).filter(|&total| total <= max_bytes)
            })
            .is_err()
        {
            self.entries.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        gauges(1, bytes, true);
        true
    }

    /// Takes back a reservation that was not used.
    pub(crate) fn unreserve(&self, bytes: usize) {
        self.freed(1, bytes);
    }

    /// Counts `bytes` more (an answer stored: never refused, the handler has run).
    pub(crate) fn grew(&self, bytes: usize) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        gauges(0, bytes, true);
    }

    /// Counts `records` records and `bytes` bytes fewer.
    pub(crate) fn freed(&self, records: usize, bytes: usize) {
        if records == 0 && bytes == 0 {
            return;
        }
        // Never below zero: every count taken back was added first (saturating all the same).
        let _ = self
            .entries
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(records))
            });
        let _ = self
            .bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some(b.saturating_sub(bytes))
            });
        gauges(records, bytes, false);
    }
}

impl Drop for Usage {
    fn drop(&mut self) {
        // The gauges sum every store of the process: take this one's share back.
        gauges(self.entries(), self.bytes(), false);
    }
}

/// Moves the record and byte gauges (summed over every memory store of the process).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
fn gauges(records: usize, bytes: usize, up: bool) {
    #[cfg(feature = "metrics")]
    {
        // Gauges are f64: exact up to 2^53, far beyond any count here.
        #[allow(clippy::cast_precision_loss)]
        let (records, bytes) = (records as f64, bytes as f64);
        let (r, b) = (
            metrics::gauge!("tower_idempotency_memory_records"),
            metrics::gauge!("tower_idempotency_memory_bytes"),
        );
        if up {
            r.increment(records);
            b.increment(bytes);
        } else {
            r.decrement(records);
            b.decrement(bytes);
        }
    }
}

/// Counts records evicted to make room.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn count_evicted(n: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_idempotency_memory_evictions_total").increment(n);
}

/// Counts claims refused because the store is full.
pub(crate) fn count_rejected() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_idempotency_memory_rejections_total").increment(1);
}

/// Counts expired records removed (by the store's own sweeping or by a purge).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn count_expired(n: usize) {
    #[cfg(feature = "metrics")]
    if n > 0 {
        metrics::counter!("tower_idempotency_memory_expired_total").increment(n as u64);
    }
}
