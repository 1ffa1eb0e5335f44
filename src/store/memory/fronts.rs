//! When each shard's first completed record expires, readable without its lock: a full store
//! finds the shards holding expired answers, and (with
//! [`WhenFull::EvictCompleted`](super::WhenFull::EvictCompleted)) the shard holding the
//! answer nearest its expiry, by reading one number per shard, instead of locking all 256
//! shards for every new key.
//!
//! A shard's number is kept while its lock is held: lowered when a completed record is added
//! (a completion), set again after completed records are removed (a sweep, an eviction, an
//! expired record replaced by a claim). Eviction reads the numbers without locks, then locks
//! the shard it picked and takes that shard's first completed record as it is by then.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{Index, SHARDS};

/// No completed record.
const NONE: u64 = u64::MAX;

/// The store's making on its clock ([`Fronts::now`]): 2⁶² ns, about 146 years. A time before
/// it still reads right, not as zero: a store made outside a Tokio runtime whose clock is
/// paused (as tests do) sees that runtime's earlier times. Its latest time, 146 years after
/// plus 100 years of TTL, stays below [`NONE`].
const ORIGIN: u64 = 1 << 62;

/// Each shard's first completed expiry, on the store's clock ([`Fronts::now`]).
pub(super) struct Fronts {
    epoch: Instant,
    at: [AtomicU64; SHARDS],
}

impl Default for Fronts {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            at: std::array::from_fn(|_| AtomicU64::new(NONE)),
        }
    }
}

impl Fronts {
    /// The store's clock, as records, the index and the fronts keep times: nanoseconds, with
    /// the store's making at [`ORIGIN`] (one clock read and one conversion per store call;
    /// the rest is integer arithmetic).
    pub(super) fn now(&self) -> u64 {
        let now = Instant::now();
        // Saturates 146 years either side; records live 100 years at most (`MAX_SPAN`).
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(ORIGIN);
        match now.checked_duration_since(self.epoch) {
            Some(since) => ORIGIN.saturating_add(nanos(since)),
            None => ORIGIN.saturating_sub(nanos(self.epoch - now)),
        }
    }

    /// Shard `i` gained a completed record expiring `at` (on the store's clock), its lock
    /// held.
    pub(super) fn added(&self, i: usize, at: u64) {
        let Some(front) = self.at.get(i) else { return };
        // Most completions expire after the shard's front: read before writing, so that they
        // leave the shared line alone.
        if at < front.load(Ordering::Relaxed) {
            front.fetch_min(at, Ordering::Relaxed);
        }
    }

    /// Shard `i` may have lost completed records: its front is read again (its lock held).
    pub(super) fn reset(&self, i: usize, index: &Index) {
        let Some(front) = self.at.get(i) else { return };
        let at = index.completed.first().map_or(NONE, |first| first.at);
        front.store(at, Ordering::Relaxed);
    }

    /// Whether shard `i` may hold a completed record expired by `now`: `false` means it holds
    /// none, as its front is never later than its first completed record's expiry.
    pub(super) fn has_expired(&self, i: usize, now: u64) -> bool {
        self.at
            .get(i)
            .is_none_or(|at| at.load(Ordering::Relaxed) <= now)
    }

    /// The shards whose first completed record has expired by `now`.
    pub(super) fn expired_by(&self, now: u64) -> impl Iterator<Item = usize> + '_ {
        self.at
            .iter()
            .enumerate()
            .filter(move |(_, at)| at.load(Ordering::Relaxed) <= now)
            .map(|(i, _)| i)
    }

    /// The shard whose first completed record expires first, if any shard has one.
    pub(super) fn earliest(&self) -> Option<usize> {
        let (i, at) = self
            .at
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .enumerate()
            .min_by_key(|&(_, at)| at)?;
        (at != NONE).then_some(i)
    }
}
