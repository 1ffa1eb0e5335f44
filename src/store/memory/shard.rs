//! A shard of the memory store: its records, their expiry index, and how a claim, a sweep or
//! an eviction finds and changes them under the shard's lock.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::store::LeaseToken;

use super::*;

/// The store's shards.
pub(super) struct Shards([Mutex<Shard>; SHARDS]);

impl Default for Shards {
    fn default() -> Self {
        Self(std::array::from_fn(|_| Mutex::default()))
    }
}

impl std::ops::Deref for Shards {
    type Target = [Mutex<Shard>; SHARDS];

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// One shard: its records, and their index by expiry.
#[derive(Default)]
pub(super) struct Shard {
    pub(super) records: Records,
    pub(super) index: Index,
}

/// Records by the hash of their (scope, key). Each call hashes its (scope, key) once; the
/// shard and the map use that hash as it is (see [`Prehashed`]). Records whose hashes collide
/// share a [`Slot`]. The slots live in a [`Slab`]; the map holds their places, so that growing
/// it moves 8 bytes per record.
#[derive(Default)]
pub(super) struct Records {
    pub(super) places: HashMap<u64, usize, BuildHasherDefault<Prehashed>>,
    pub(super) slots: Slab<Slot>,
}

impl Records {
    pub(super) fn get(&self, hash: u64) -> Option<&Slot> {
        self.slots.get(*self.places.get(&hash)?)
    }

    pub(super) fn get_mut(&mut self, hash: u64) -> Option<&mut Slot> {
        self.slots.get_mut(*self.places.get(&hash)?)
    }

    /// Adds `record` to the slot of `hash`.
    pub(super) fn add(&mut self, hash: u64, record: Record) {
        match self.get_mut(hash) {
            // Another (scope, key) with the same hash.
            Some(slot) => slot.push(record),
            None => {
                let place = self.slots.insert(Slot::One(record));
                self.places.insert(hash, place);
            }
        }
    }

    /// Removes the slot of `hash`.
    pub(super) fn remove(&mut self, hash: u64) -> Option<Slot> {
        self.slots.remove(self.places.remove(&hash)?)
    }
}

/// The records of a shard, one queue per state, each in the order its records come due: the
/// front of each is the next.
///
/// - `completed`: by expiry.
/// - `running`: in-progress records whose lease holds, by the lease's end (only a request that
///   stopped renewing lets its lease run out; the TTL may run far longer).
/// - `stale`: in-progress records whose lease ran out, moved there by a purge, by expiry.
///
/// A purge removes what expired (the [`Store`] contract): from `running` it removes the
/// records whose lease and TTL ran out and moves those whose TTL has not to `stale`. A full
/// store removes every in-progress record whose lease ran out, from the fronts of `running`
/// and `stale` ([`Sweep::Reclaim`]).
pub(super) struct Index {
    pub(super) running: Queue,
    pub(super) stale: Queue,
    pub(super) completed: Queue,
}

/// The lease end of an in-progress record set aside in the `stale` queue of its [`Index`]:
/// on the store's clock, a time that has always passed. (A record claimed at the store's
/// first instant with a lease of zero gets it too, and belongs there: its lease ran out.)
/// Kept in the lease's field, not in a flag of its own, which would make every record 8
/// bytes larger.
pub(super) const LEASE_RAN_OUT: u64 = 0;

/// What a sweep of a shard's [`Index`] removes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Sweep {
    /// Expired answers only: a claim's sweep.
    Answers,
    /// Expired records: a purge.
    Expired,
    /// Expired answers and every in-progress record whose lease ran out: a full store.
    Reclaim,
}

/// How many in-progress records (and the tombstones of completed ones) a shard's running
/// queue keeps in arrival order before its oldest moves to the queue's tree.
pub(super) const RUNNING_IN_ORDER: usize = 64;

impl Default for Index {
    fn default() -> Self {
        Self {
            running: Queue::bounded(RUNNING_IN_ORDER),
            stale: Queue::bounded(RUNNING_IN_ORDER),
            completed: Queue::default(),
        }
    }
}

/// A map hasher for keys that already are a hash: it returns the `u64` it was given.
#[derive(Default)]
pub(super) struct Prehashed(u64);

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
pub(super) enum Slot {
    One(Record),
    Many(Vec<Record>),
}

pub(super) struct Record {
    pub(super) scope: Box<str>,
    pub(super) key: IdempotencyKey,
    pub(super) entry: Entry,
}

/// Times are on the store's clock ([`Fronts::now`]).
pub(super) struct Entry {
    pub(super) fingerprint: Fingerprint,
    pub(super) expires_at: u64,
    /// The raw token of the claim that made the record: unique, so it names the record in
    /// the [`Index`].
    pub(super) id: i64,
    /// Its place in its state's queue of the [`Index`].
    pub(super) place: u64,
    pub(super) state: State,
}

pub(super) enum State {
    /// [`LEASE_RAN_OUT`] once a purge found its lease run out and set it aside (see
    /// [`Index`]); a renewal gives it a lease again.
    InProgress {
        lease_until: u64,
    },
    Completed(Answer),
}

impl Entry {
    /// Where the record is in its queue of the [`Index`]: an in-progress record whose lease
    /// holds at the lease's end, any other at its expiry.
    pub(super) fn indexed_at(&self) -> u64 {
        match self.state {
            State::InProgress { lease_until } if lease_until != LEASE_RAN_OUT => lease_until,
            State::InProgress { .. } | State::Completed(_) => self.expires_at,
        }
    }

    pub(super) fn holds(&self, token: LeaseToken) -> bool {
        matches!(self.state, State::InProgress { .. }) && self.id == token.into_raw()
    }

    /// The bytes counted for its answer (none while in progress).
    pub(super) fn answer_bytes(&self) -> usize {
        match &self.state {
            State::Completed(answer) => answer_bytes(answer.len()),
            State::InProgress { .. } => 0,
        }
    }
}

impl Record {
    pub(super) fn is(&self, scope: &str, key: &IdempotencyKey) -> bool {
        self.key == *key && *self.scope == *scope
    }

    /// The bytes counted for the record.
    pub(super) fn bytes(&self) -> usize {
        record_bytes(&self.scope, &self.key) + self.entry.answer_bytes()
    }
}

impl Index {
    pub(super) fn queue(&mut self, entry: &Entry) -> &mut Queue {
        match entry.state {
            State::InProgress {
                lease_until: LEASE_RAN_OUT,
            } => &mut self.stale,
            State::InProgress { .. } => &mut self.running,
            State::Completed(_) => &mut self.completed,
        }
    }

    /// Adds `entry` (of `hash`) to its state's queue ([`Entry::indexed_at`]), and notes its
    /// place there.
    pub(super) fn insert(&mut self, hash: u64, entry: &mut Entry) {
        let (at, id) = (entry.indexed_at(), entry.id);
        entry.place = self.queue(entry).push(Item { at, id, hash });
    }

    /// Removes `entry` from its state's queue.
    pub(super) fn remove(&mut self, entry: &Entry) {
        self.queue(entry)
            .remove(entry.indexed_at(), entry.id, entry.place);
    }
}

impl Slot {
    pub(super) fn records(&self) -> &[Record] {
        match self {
            Slot::One(r) => std::slice::from_ref(r),
            Slot::Many(rs) => rs,
        }
    }

    pub(super) fn records_mut(&mut self) -> &mut [Record] {
        match self {
            Slot::One(r) => std::slice::from_mut(r),
            Slot::Many(rs) => rs,
        }
    }

    pub(super) fn find_mut(&mut self, scope: &str, key: &IdempotencyKey) -> Option<&mut Record> {
        self.records_mut().iter_mut().find(|r| r.is(scope, key))
    }

    pub(super) fn push(&mut self, record: Record) {
        let records = match std::mem::replace(self, Slot::Many(Vec::new())) {
            Slot::One(first) => vec![first, record],
            Slot::Many(mut records) => {
                records.push(record);
                records
            }
        };
        *self = Slot::Many(records);
    }
}

impl Shard {
    /// Removes the record `id` of `hash` from the map (not from the index).
    pub(super) fn take(&mut self, hash: u64, id: i64) -> Option<Record> {
        match self.records.get_mut(hash)? {
            Slot::One(r) if r.entry.id == id => match self.records.remove(hash)? {
                Slot::One(r) => Some(r),
                Slot::Many(_) => None,
            },
            Slot::One(_) => None,
            Slot::Many(rs) => {
                let i = rs.iter().position(|r| r.entry.id == id)?;
                let record = rs.swap_remove(i);
                if rs.is_empty() {
                    self.records.remove(hash);
                }
                Some(record)
            }
        }
    }

    /// Sweeps the fronts of the index as `sweep` says (see [`Index`]), at most `max` steps
    /// (a record removed, or moved to `stale`) in this hold of the lock. Looks at `max + 3`
    /// index entries at most: never a scan.
    pub(super) fn sweep(&mut self, now: u64, max: usize, sweep: Sweep) -> Swept {
        let mut swept = Swept::default();
        for queue in [Which::Completed, Which::Running, Which::Stale] {
            if queue != Which::Completed && sweep == Sweep::Answers {
                break;
            }
            while swept.steps < max {
                let q = match queue {
                    Which::Completed => &mut self.index.completed,
                    Which::Running => &mut self.index.running,
                    Which::Stale => &mut self.index.stale,
                };
                let Some(first) = q.first() else {
                    break;
                };
                swept.looked += 1;
                // Every stale record's lease ran out: a full store takes them all.
                let due = first.at <= now || (queue == Which::Stale && sweep == Sweep::Reclaim);
                if !due {
                    break;
                }
                q.pop_first();
                swept.steps += 1;
                let Item { id, hash, .. } = first;
                // A purge removes only what expired: a record whose lease ran out before its
                // TTL waits in `stale` for its expiry.
                if queue == Which::Running && sweep == Sweep::Expired {
                    let entry = self.records.get_mut(hash).and_then(|slot| {
                        let record = slot.records_mut().iter_mut().find(|r| r.entry.id == id);
                        record.map(|r| &mut r.entry)
                    });
                    if let Some(entry) = entry
                        && entry.expires_at > now
                    {
                        if let State::InProgress { lease_until } = &mut entry.state {
                            *lease_until = LEASE_RAN_OUT;
                        }
                        self.index.insert(hash, entry);
                        continue;
                    }
                }
                // Every index entry names a record of the map; were one not to, it is gone
                // from the index now all the same.
                if let Some(record) = self.take(hash, id) {
                    swept.removed += 1;
                    swept.bytes += record.bytes();
                }
            }
        }
        swept
    }
}

/// One of the queues of an [`Index`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Which {
    Completed,
    Running,
    Stale,
}

/// What [`Shard::sweep`] did.
#[derive(Default)]
pub(super) struct Swept {
    /// Records removed, and their bytes.
    pub(super) removed: usize,
    pub(super) bytes: usize,
    /// Records removed or moved.
    pub(super) steps: usize,
    /// Index entries looked at.
    pub(super) looked: usize,
}

/// Tokens are unique per process, across all memory stores.
pub(super) static NEXT_TOKEN: AtomicI64 = AtomicI64::new(1);

pub(super) fn next_token() -> LeaseToken {
    LeaseToken::from_raw(NEXT_TOKEN.fetch_add(1, Ordering::Relaxed))
}
