//! Where a shard keeps its records: in chunks of fixed size that never move, each record at a
//! place that its map entry names.
//!
//! A hash map that holds its values inline moves every value when it grows, holding the
//! shard's lock all the while (68 ms at 1.8 million records over 16 shards, measured by
//! `benches/memory_scale.rs`), and leaves up to half of its slots empty after growing, each
//! as large as a record. Here the map holds an 8-byte place per record: growing it moves
//! those, and its empty slots cost 16 bytes each. The chunks are allocated one at a time, at
//! their full size, and never reallocated; a removed record's place is reused by the next one.
//! The first chunks are small (8 records, then 16, doubling up to 1,024), so that a store
//! holding few records, spread over 256 shards, holds little memory.

/// Records per chunk, at most: a place is its chunk's number times this, plus its offset.
const CHUNK: usize = 1024;
/// Records in the first chunk.
const FIRST_CHUNK: usize = 8;

/// The records chunk `n` holds.
fn chunk_len(n: usize) -> usize {
    FIRST_CHUNK
        .checked_shl(u32::try_from(n).unwrap_or(u32::MAX))
        .map_or(CHUNK, |len| len.min(CHUNK))
}

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
        let n = self.chunks.len();
        match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < chunk_len(n - 1) => {
                chunk.push(Some(value));
                (n - 1) * CHUNK + chunk.len() - 1
            }
            _ => {
                let mut chunk = Vec::with_capacity(chunk_len(n));
                chunk.push(Some(value));
                self.chunks.push(chunk);
                n * CHUNK
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
    fn chunks_grow_from_eight_records_to_1024() {
        let lens: Vec<usize> = (0..10).map(chunk_len).collect();
        assert_eq!(lens, [8, 16, 32, 64, 128, 256, 512, 1024, 1024, 1024]);
        assert_eq!(chunk_len(usize::MAX), CHUNK);
    }

    #[test]
    fn values_keep_their_places_and_freed_places_are_reused() {
        let mut slab = Slab::default();
        // 8 + 16 + … + 512 = 1016 in the first seven chunks, then chunks of 1024.
        let n = 1016 + 2 * CHUNK + 5;
        let places: Vec<usize> = (0..n).map(|v| slab.insert(v)).collect();
        assert_eq!(slab.chunks.len(), 10);
        for (k, chunk) in slab.chunks.iter().enumerate() {
            assert_eq!(
                chunk.capacity(),
                chunk_len(k),
                "chunk {k} was never reallocated"
            );
        }
        let mut distinct = places.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), n, "every value has its own place");
        for (v, &p) in places.iter().enumerate() {
            assert_eq!(slab.get(p), Some(&v));
        }
        assert_eq!(places[8], CHUNK, "the second chunk's first place");

        let p = places[1500];
        assert_eq!(slab.remove(p), Some(1500));
        assert_eq!(slab.remove(p), None, "removed once");
        assert_eq!(slab.get(p), None);
        assert_eq!(slab.insert(99), p, "the freed place is reused");
        assert_eq!(slab.get(p), Some(&99));
        if let Some(v) = slab.get_mut(places[0]) {
            *v = 42;
        }
        assert_eq!(slab.get(places[0]), Some(&42));
        assert_eq!(slab.get(8), None, "past the first chunk's records");
        assert_eq!(slab.get(20 * CHUNK), None, "no such chunk");
        assert_eq!(slab.remove(20 * CHUNK), None);
        assert_eq!(
            slab.chunks.len(),
            10,
            "no chunk was added for a reused place"
        );
    }
}
