//! A shard's records in expiry order, one [`Queue`] per state: what the claims' sweeps, the
//! purge and eviction take from the front.
//!
//! A shard's expiries nearly always arrive in order: each is `now + ttl` (or the lease), with
//! `now` read under the shard's lock and one TTL for a layer. So a queue keeps its items in a
//! `VecDeque` in arrival order, and only an item that would break the order (a shorter TTL, a
//! renewed lease) goes to a `BTreeMap` beside it. Adding an item is a push at the back, and
//! removing one from the middle of the deque (its record completed or replaced) leaves a
//! tombstone there, found by the position the record keeps: no tree is walked on the hot path.
//! Tombstones at the front are dropped at once, so the front is always a live item.

use std::collections::{BTreeMap, VecDeque};

/// One record in a queue: when it expires (nanoseconds after the store was made), the id of
/// the claim that made it (unique: it names the record) and the hash of its (scope, key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Item {
    pub(super) at: u64,
    pub(super) id: i64,
    pub(super) hash: u64,
}

/// The `id` of a tombstone: claims' ids start at 1.
const DEAD: i64 = 0;

/// The place of an item that is in the tree (see [`Queue::push`]).
pub(super) const IN_TREE: u64 = u64::MAX;

/// Items in expiry order. See the module's docs.
#[derive(Default)]
pub(super) struct Queue {
    /// In `(at, id)` order, with tombstones (`id == DEAD`) anywhere but at the front.
    deque: VecDeque<Item>,
    /// The absolute place of `deque[0]`: places grow by one with each push.
    base: u64,
    /// The items that came out of order, or were moved out of the deque, by `(at, id)`.
    tree: BTreeMap<(u64, i64), u64>,
    /// When set, the deque's length (tombstones included) beyond which its live front moves
    /// to the tree, so that tombstones behind a long-lived item do not pile up.
    limit: Option<usize>,
}

impl Queue {
    /// A queue whose deque holds at most about `limit` items: for records that leave the
    /// queue in any order (in-progress ones complete), so that a long-running one at the
    /// front keeps at most `limit` tombstones behind it.
    pub(super) fn bounded(limit: usize) -> Self {
        Self {
            limit: Some(limit),
            ..Self::default()
        }
    }

    /// Adds `item`; returns its place, which [`remove`](Self::remove) takes.
    pub(super) fn push(&mut self, item: Item) -> u64 {
        let in_order = self
            .deque
            .back()
            .is_none_or(|last| (last.at, last.id) <= (item.at, item.id));
        if !in_order {
            self.tree.insert((item.at, item.id), item.hash);
            return IN_TREE;
        }
        self.deque.push_back(item);
        let place = self.base + (self.deque.len() as u64 - 1);
        if let Some(limit) = self.limit {
            while self.deque.len() > limit {
                // The front is live (tombstones never stay there): it moves to the tree,
                // where `remove` finds it when its place is behind `base`.
                if let Some(front) = self.deque.pop_front() {
                    self.base += 1;
                    self.tree.insert((front.at, front.id), front.hash);
                }
                self.drop_dead_front();
            }
        }
        place
    }

    /// Removes the item (`at`, `id`) that [`push`](Self::push) put at `place`; `false` when
    /// it is not there.
    pub(super) fn remove(&mut self, at: u64, id: i64, place: u64) -> bool {
        if place != IN_TREE
            && let Some(i) = place.checked_sub(self.base)
            && let Ok(i) = usize::try_from(i)
            && let Some(item) = self.deque.get_mut(i)
            && item.id == id
        {
            item.id = DEAD;
            self.drop_dead_front();
            return true;
        }
        // In the tree from the start, or moved there since.
        self.tree.remove(&(at, id)).is_some()
    }

    /// The item that expires first.
    pub(super) fn first(&self) -> Option<Item> {
        let front = self.deque.front().copied();
        let tree = self
            .tree
            .first_key_value()
            .map(|(&(at, id), &hash)| Item { at, id, hash });
        match (front, tree) {
            (Some(f), Some(t)) => Some(if (t.at, t.id) < (f.at, f.id) { t } else { f }),
            (f, t) => f.or(t),
        }
    }

    /// Removes and returns the item that expires first.
    pub(super) fn pop_first(&mut self) -> Option<Item> {
        let first = self.first()?;
        if self.deque.front() == Some(&first) {
            self.deque.pop_front();
            self.base += 1;
            self.drop_dead_front();
        } else {
            self.tree.remove(&(first.at, first.id));
        }
        Some(first)
    }

    /// How many items it holds (tombstones not counted), for tests.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.deque.iter().filter(|i| i.id != DEAD).count() + self.tree.len()
    }

    fn drop_dead_front(&mut self) {
        while self.deque.front().is_some_and(|i| i.id == DEAD) {
            self.deque.pop_front();
            self.base += 1;
        }
        // An empty deque takes no memory it does not need: a burst's capacity goes back.
        if self.deque.is_empty() && self.deque.capacity() > 64 {
            self.deque = VecDeque::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(at: u64, id: i64) -> Item {
        Item {
            at,
            id,
            hash: at ^ 0xff,
        }
    }

    fn drain(q: &mut Queue) -> Vec<(u64, i64)> {
        std::iter::from_fn(|| q.pop_first().map(|i| (i.at, i.id))).collect()
    }

    #[test]
    fn items_come_out_in_expiry_order_whatever_order_they_came_in() {
        let mut q = Queue::default();
        for (at, id) in [(10, 1), (20, 2), (5, 3), (20, 4), (15, 5), (30, 6), (1, 7)] {
            q.push(item(at, id));
        }
        assert_eq!(q.len(), 7);
        assert_eq!(
            drain(&mut q),
            [(1, 7), (5, 3), (10, 1), (15, 5), (20, 2), (20, 4), (30, 6)]
        );
        assert_eq!(q.first(), None);
    }

    #[test]
    fn removed_items_never_come_out_and_the_front_stays_live() {
        let mut q = Queue::default();
        let places: Vec<u64> = (1..=6_i64)
            .map(|id| q.push(item(id.unsigned_abs() * 10, id)))
            .collect();
        let late = q.push(item(5, 7));
        assert_eq!(late, IN_TREE);
        // The front, one in the middle, the one in the tree; twice is once.
        assert!(q.remove(10, 1, places[0]));
        assert!(q.remove(40, 4, places[3]));
        assert!(!q.remove(40, 4, places[3]));
        assert!(q.remove(5, 7, late));
        // A place that names another item removes nothing.
        assert!(!q.remove(20, 99, places[1]));
        assert_eq!(q.first(), Some(item(20, 2)));
        assert_eq!(drain(&mut q), [(20, 2), (30, 3), (50, 5), (60, 6)]);
    }

    /// Random pushes (mostly in order, some not), removals of live and gone items, and pops,
    /// against a `BTreeMap` of the same items: the queue must agree at every step.
    #[test]
    fn agrees_with_a_sorted_map_under_random_operations() {
        for (seed, limit) in [(1_u64, None), (2, Some(4)), (3, Some(64)), (4, Some(1))] {
            let mut q = limit.map_or_else(Queue::default, Queue::bounded);
            let mut model: BTreeMap<(u64, i64), u64> = BTreeMap::new();
            // Every item pushed, with its place, live or not.
            let mut pushed: Vec<(Item, u64)> = Vec::new();
            let (mut state, mut clock, mut next_id) = (seed, 1_000_u64, 1_i64);
            let mut random = move |n: u64| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state % n
            };
            for step in 0..20_000 {
                match random(10) {
                    // A push: expiries mostly grow, as `now + ttl` does; some come early.
                    0..=4 => {
                        clock += random(3);
                        let at = if random(8) == 0 {
                            clock.saturating_sub(random(500))
                        } else {
                            clock
                        };
                        let item = Item {
                            at,
                            id: next_id,
                            hash: random(u64::MAX),
                        };
                        next_id += 1;
                        let place = q.push(item);
                        model.insert((item.at, item.id), item.hash);
                        pushed.push((item, place));
                    }
                    // A removal of any item ever pushed: live ones go, gone ones are absent.
                    5..=7 if !pushed.is_empty() => {
                        let len = pushed.len() as u64;
                        let i = usize::try_from(random(len)).unwrap();
                        let (item, place) = pushed[i];
                        let live = model.remove(&(item.at, item.id)).is_some();
                        assert_eq!(q.remove(item.at, item.id, place), live, "step {step}");
                    }
                    _ => {
                        let expected =
                            model
                                .pop_first()
                                .map(|((at, id), hash)| Item { at, id, hash });
                        assert_eq!(q.pop_first(), expected, "step {step}");
                    }
                }
                let expected =
                    model
                        .first_key_value()
                        .map(|(&(at, id), &hash)| Item { at, id, hash });
                assert_eq!(q.first(), expected, "step {step}");
                assert_eq!(q.len(), model.len(), "step {step}");
                if let Some(limit) = limit {
                    assert!(q.deque.len() <= limit, "step {step}: {}", q.deque.len());
                }
            }
        }
    }

    #[test]
    fn a_long_lived_front_moves_to_the_tree_so_tombstones_do_not_pile_up() {
        let mut q = Queue::bounded(4);
        let long = q.push(item(1, 1));
        for id in 2..1_000_i64 {
            let place = q.push(item(id.unsigned_abs(), id));
            assert!(q.remove(id.unsigned_abs(), id, place));
        }
        assert!(q.deque.len() <= 4, "{}", q.deque.len());
        assert_eq!(q.len(), 1);
        // Moved to the tree, the long-lived item is still found by its old place.
        assert!(q.remove(1, 1, long));
        assert_eq!(q.first(), None);
    }
}
