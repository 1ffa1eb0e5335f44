//! What [`ClaimStrategy::Adaptive`](super::ClaimStrategy::Adaptive) goes by: how often the
//! store's recent claims found their key's record.

use std::sync::atomic::{AtomicU32, Ordering};

/// A moving average of the share of claims that found their key's record (a replay, a key in
/// flight, a reused key), each claim weighing 1/16 and the claims before it fading by 15/16:
/// the last few dozen claims decide.
///
/// It only chooses which statement a claim sends first, the read or the insert; either order
/// decides the same way (one atomic insert between racing first requests, fenced takeovers).
/// Concurrent updates may lose one another's step, which only makes the average a little
/// slower to follow.
#[derive(Debug, Default)]
pub(super) struct Workload {
    /// The share, in units of 1/65,536.
    found: AtomicU32,
}

/// The whole share: every recent claim found its key.
const ALL: u32 = 1 << 16;

impl Workload {
    /// Whether a claim should read first: more than half of the recent claims found their
    /// key, so that the read alone answers the next one most likely. Otherwise it inserts
    /// first, which alone claims a new key.
    pub(super) fn reads_first(&self) -> bool {
        self.found.load(Ordering::Relaxed) > ALL / 2
    }

    /// Counts a claim that found its key's record (`found`) or not.
    pub(super) fn record(&self, found: bool) {
        let share = self.found.load(Ordering::Relaxed);
        let next = if found {
            share + (ALL - share) / 16
        } else {
            share - share / 16
        };
        self.found.store(next, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_of_found_keys_turns_the_claims_to_reading_first_and_new_keys_turn_them_back() {
        let workload = Workload::default();
        assert!(!workload.reads_first(), "a new store inserts first");
        let mut turned = None;
        for n in 1..=64 {
            workload.record(true);
            if workload.reads_first() {
                turned = Some(n);
                break;
            }
        }
        assert_eq!(turned, Some(11), "after eleven replays in a row");
        for _ in 0..64 {
            workload.record(true);
        }
        assert!(workload.found.load(Ordering::Relaxed) <= ALL);
        let mut back = None;
        for n in 1..=64 {
            workload.record(false);
            if !workload.reads_first() {
                back = Some(n);
                break;
            }
        }
        assert!(back.is_some_and(|n| n <= 12), "{back:?}");
    }

    #[test]
    fn an_even_mix_stays_near_the_middle() {
        let workload = Workload::default();
        for i in 0..1000 {
            workload.record(i % 2 == 0);
        }
        let share = workload.found.load(Ordering::Relaxed);
        assert!((ALL * 2 / 5..ALL * 3 / 5).contains(&share), "{share}");
    }
}
