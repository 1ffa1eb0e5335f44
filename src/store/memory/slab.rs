//! Where a shard keeps its records: in chunks of fixed size that never move, each record at a
//! place that its map entry names.
//!
//! A hash map that holds its values inline moves every value when it grows, holding the
//! shard's lock all the while (68 ms at 1.8 million records over 16 shards, measured by
//! `benches/memory_scale.rs`), and leaves up to half of its slots empty after growing, each
//! as large as a record. Here the map holds an 8-byte place per record: growing it moves
//! those, and its empty slots cost 16 bytes each. The chunks are allocated one at a time, full
//! size, and never reallocated; a removed record's place is reused by the next one.

/// Records per chunk.
const CHUNK: usize = 1024;

/// Values at stable places.
pub(super) struct Slab<T> {
    chunks: Vec<Vec<Option<T>>>,
    /// Places whose value was removed, to reuse.
    free: Vec<usize>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> Slab<T> {
    /// Stores `value`; returns its place.
    pub(super) fn insert(&mut self, value: T) -> usize {
        if let Some(place) = self.free.pop()
            && let Some(cell) = self.cell(place)
        {
            *cell = Some(value);
            return place;
        }
        let full = self.chunks.len() * CHUNK;
        match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < CHUNK => {
                chunk.push(Some(value));
                full - CHUNK + chunk.len() - 1
            }
            _ => {
                let mut chunk = Vec::with_capacity(CHUNK);
                chunk.push(Some(value));
                self.chunks.push(chunk);
                full
            }
        }
    }

    /// The value at `place`.
    pub(super) fn get(&self, place: usize) -> Option<&T> {
        self.chunks.get(place / CHUNK)?.get(place % CHUNK)?.as_ref()
    }

    /// The value at `place`.
    pub(super) fn get_mut(&mut self, place: usize) -> Option<&mut T> {
        self.cell(place)?.as_mut()
    }

    /// Takes the value at `place` out; its place is reused.
    pub(super) fn remove(&mut self, place: usize) -> Option<T> {
        let value = self.cell(place)?.take()?;
        self.free.push(place);
        Some(value)
    }

    fn cell(&mut self, place: usize) -> Option<&mut Option<T>> {
        self.chunks.get_mut(place / CHUNK)?.get_mut(place % CHUNK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_keep_their_places_and_freed_places_are_reused() {
        let mut slab = Slab::default();
        let places: Vec<usize> = (0..3 * CHUNK + 5).map(|i| slab.insert(i)).collect();
        assert_eq!(places, (0..3 * CHUNK + 5).collect::<Vec<_>>());
        assert_eq!(slab.chunks.len(), 4);
        assert!(slab.chunks.iter().all(|c| c.capacity() == CHUNK));
        for &p in &places {
            assert_eq!(slab.get(p), Some(&p));
        }

        assert_eq!(slab.remove(CHUNK + 7), Some(CHUNK + 7));
        assert_eq!(slab.remove(CHUNK + 7), None, "removed once");
        assert_eq!(slab.get(CHUNK + 7), None);
        assert_eq!(slab.insert(99), CHUNK + 7, "the freed place is reused");
        assert_eq!(slab.get(CHUNK + 7), Some(&99));
        if let Some(v) = slab.get_mut(0) {
            *v = 42;
        }
        assert_eq!(slab.get(0), Some(&42));
        assert_eq!(slab.get(10 * CHUNK), None, "no such place");
        assert_eq!(slab.remove(10 * CHUNK), None);
        assert_eq!(
            slab.chunks.len(),
            4,
            "no chunk was added for a reused place"
        );
    }
}
