//! `BlockPool`: the free blocks of one pool, ordered for best fit.
//!
//! PyTorch keeps them in a `std::set<Block*, BlockComparatorSize>`, ordered by (stream, size,
//! address). Here each stream has its own set, kept as the distinct sizes with, per size, the
//! blocks by address (see [`SizeOrdered`]). Iterating the streams in ascending order, each set
//! in order, is PyTorch's order.

use std::collections::BTreeSet;

/// A free block as the size order sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FreeBlock {
    pub stream: u32,
    pub size: u64,
    pub ptr: u64,
    pub id: u32,
}

/// The blocks of one size as (address, block), highest address first (best fit takes the
/// last). Most sizes hold one block: it is kept in the class itself, so finding it is one
/// load fewer than through a heap buffer.
#[derive(Default, Clone)]
struct SizeClass {
    entries: smallvec::SmallVec<[(u64, u32); 1]>,
}

impl SizeClass {
    /// Where `ptr` is or would go. Most blocks go or are found at or near the low end (89%
    /// within three entries of it in the 70B full bench run, in classes of up to 470), so
    /// the search gallops from that end, 1, 2, 4, ... entries up, and bisects the last
    /// stride: `d` entries from the end cost about 2 log2(d) probes.
    #[inline]
    fn position(&self, ptr: u64) -> usize {
        let e = &self.entries;
        // Entries from `from` on are at or below `ptr`.
        let mut from = e.len();
        let mut stride = 1;
        while from > 0 {
            let probe = from.saturating_sub(stride);
            if e[probe].0 > ptr {
                return probe + 1 + e[probe + 1..from].partition_point(|&(p, _)| p > ptr);
            }
            from = probe;
            stride *= 2;
        }
        0
    }

    /// Inserts at `index`. Freed blocks mostly come back at or next to the low-address end,
    /// so no entry or one moves (about one on average in the bench runs): those two cases
    /// are plain stores instead of a `memmove` call.
    #[inline]
    fn insert(&mut self, index: usize, entry: (u64, u32)) {
        let e = &mut self.entries;
        let end = e.len();
        e.push(entry);
        match end - index {
            0 => {}
            1 => {
                e[end] = e[index];
                e[index] = entry;
            }
            _ => {
                e.copy_within(index..end, index + 1);
                e[index] = entry;
            }
        }
    }

    /// Removes the entry at `index`; as for `insert`, the last two positions without a
    /// `memmove` call.
    #[inline]
    fn remove(&mut self, index: usize) {
        let e = &mut self.entries;
        let last = e.len() - 1;
        match last - index {
            0 => {}
            1 => e[index] = e[last],
            _ => e.copy_within(index + 1.., index),
        }
        e.pop();
    }
}

/// The index of the first of `sizes` (ascending) that is at least `size`. A count rather than
/// a binary search: there are only tens of sizes, and a count has no dependent loads.
#[inline]
fn first_size_at_least(sizes: &[(u64, u32)], size: u64) -> usize {
    sizes.iter().map(|&(s, _)| usize::from(s < size)).sum()
}

/// The free blocks of one stream, in (size, address) order: the distinct sizes ascending,
/// each with its blocks. Free blocks come in few sizes (tens) with many blocks each, so a
/// best-fit query is a search among the sizes, and taking the block the smallest address.
///
/// Most blocks are alone in their size, so sizes come and go with nearly every change: the
/// sizes are one array of (size, class), shifted once per new or emptied size, and the
/// classes stay where they are in a table of their own.
#[derive(Default, Clone)]
pub(crate) struct SizeOrdered {
    /// Sizes that have blocks, ascending, with the index of their class in `classes`.
    sizes: Vec<(u64, u32)>,
    /// The blocks of each size; those not in `sizes` are empty and listed in `vacant`.
    classes: Vec<SizeClass>,
    vacant: Vec<u32>,
    len: usize,
}

/// A position in a [`SizeOrdered`]: size class and index within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cursor {
    class: usize,
    index: usize,
}

impl SizeOrdered {
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The blocks of the `at`th size.
    #[inline]
    fn class(&self, at: usize) -> &SizeClass {
        &self.classes[self.sizes[at].1 as usize]
    }

    #[inline]
    fn class_mut(&mut self, at: usize) -> &mut SizeClass {
        &mut self.classes[self.sizes[at].1 as usize]
    }

    /// The smallest block with at least `size` bytes (its lowest address).
    #[inline]
    fn first_at_least(&self, size: u64) -> Option<Cursor> {
        let class = first_size_at_least(&self.sizes, size);
        let &(_, c) = self.sizes.get(class)?;
        Some(Cursor {
            class,
            index: self.classes[c as usize].entries.len() - 1,
        })
    }

    #[inline]
    fn at(&self, c: Cursor) -> (u64, u64, u32) {
        let (ptr, id) = self.class(c.class).entries[c.index];
        (self.sizes[c.class].0, ptr, id)
    }

    /// The next block in (size, address) order.
    #[inline]
    fn next(&self, c: Cursor) -> Option<Cursor> {
        if c.index > 0 {
            Some(Cursor {
                class: c.class,
                index: c.index - 1,
            })
        } else {
            let class = c.class + 1;
            let &(_, next) = self.sizes.get(class)?;
            Some(Cursor {
                class,
                index: self.classes[next as usize].entries.len() - 1,
            })
        }
    }

    /// The previous block in (size, address) order.
    #[inline]
    fn prev(&self, c: Cursor) -> Option<Cursor> {
        if c.index + 1 < self.class(c.class).entries.len() {
            Some(Cursor {
                class: c.class,
                index: c.index + 1,
            })
        } else if c.class > 0 {
            Some(Cursor {
                class: c.class - 1,
                index: 0,
            })
        } else {
            None
        }
    }

    /// The largest block smaller than `size` (its highest address).
    fn last_below(&self, size: u64) -> Option<Cursor> {
        let class = first_size_at_least(&self.sizes, size).checked_sub(1)?;
        Some(Cursor { class, index: 0 })
    }

    /// Where (size, ptr) is.
    #[inline]
    fn find(&self, size: u64, ptr: u64) -> Option<Cursor> {
        let class = first_size_at_least(&self.sizes, size);
        if self.sizes.get(class).map(|e| e.0) != Some(size) {
            return None;
        }
        let c = self.class(class);
        let index = c.position(ptr);
        (c.entries.get(index).map(|e| e.0) == Some(ptr)).then_some(Cursor { class, index })
    }

    /// Adds (size, ptr); returns false if it was there already.
    fn insert(&mut self, size: u64, ptr: u64, id: u32) -> bool {
        let class = first_size_at_least(&self.sizes, size);
        if self.sizes.get(class).map(|e| e.0) != Some(size) {
            let slot = self.vacant.pop().unwrap_or_else(|| {
                self.classes.push(SizeClass::default());
                self.classes.len() as u32 - 1
            });
            self.sizes.insert(class, (size, slot));
        }
        let c = self.class_mut(class);
        let index = c.position(ptr);
        if c.entries.get(index).map(|e| e.0) == Some(ptr) {
            return false;
        }
        c.insert(index, (ptr, id));
        self.len += 1;
        true
    }

    /// Removes the entry at `c`.
    #[inline]
    fn remove_at(&mut self, c: Cursor) {
        let class = self.class_mut(c.class);
        class.remove(c.index);
        let emptied = class.entries.is_empty();
        self.len -= 1;
        if emptied {
            let (_, slot) = self.sizes.remove(c.class);
            self.vacant.push(slot);
        }
    }

    /// Puts (size, ptr) where the entry at `c` was: removing the one, inserting the other.
    ///
    /// A split's remainder or a merged block is usually alone in its size, as the block it
    /// replaces was: its size then empties and a new one comes. That case moves the size's
    /// entry to its new place in one shift of the sizes between, keeping its class, where
    /// removing and inserting would shift every larger size twice. The class is the one
    /// removing would leave vacant and inserting take again, so the set ends as it would.
    #[inline]
    fn replace_at(&mut self, c: Cursor, size: u64, ptr: u64, id: u32) {
        let (old_size, slot) = self.sizes[c.class];
        if size != old_size && self.classes[slot as usize].entries.len() == 1 {
            // Sizes below `size`, the emptied one among them if it is smaller.
            let to = first_size_at_least(&self.sizes, size);
            if self.sizes.get(to).map(|e| e.0) != Some(size) {
                self.classes[slot as usize].entries[0] = (ptr, id);
                if to > c.class {
                    self.sizes.copy_within(c.class + 1..to, c.class);
                    self.sizes[to - 1] = (size, slot);
                } else {
                    self.sizes.copy_within(to..c.class, to + 1);
                    self.sizes[to] = (size, slot);
                }
                return;
            }
        }
        self.remove_at(c);
        let inserted = self.insert(size, ptr, id);
        debug_assert!(inserted);
    }

    /// Removes (size, ptr); returns false if it was not there.
    fn remove(&mut self, size: u64, ptr: u64) -> bool {
        match self.find(size, ptr) {
            Some(c) => {
                self.remove_at(c);
                true
            }
            None => false,
        }
    }

    /// Every entry in (size, address) order.
    fn iter(&self) -> impl Iterator<Item = (u64, u64, u32)> + '_ {
        self.sizes.iter().flat_map(|&(size, c)| {
            self.classes[c as usize]
                .entries
                .iter()
                .rev()
                .map(move |&(ptr, id)| (size, ptr, id))
        })
    }
}

/// Forward iteration over one stream's free blocks from a position.
pub(crate) struct Candidates<'a> {
    set: Option<&'a SizeOrdered>,
    stream: u32,
    at: Option<Cursor>,
}

impl Iterator for Candidates<'_> {
    type Item = FreeBlock;

    #[inline]
    fn next(&mut self) -> Option<FreeBlock> {
        let set = self.set?;
        let c = self.at?;
        self.at = set.next(c);
        let (size, ptr, id) = set.at(c);
        Some(FreeBlock {
            stream: self.stream,
            size,
            ptr,
            id,
        })
    }
}

/// Where a block is in a [`FreeBlocks`]; valid until the set next changes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Slot {
    stream: usize,
    at: Cursor,
}

/// The free mapped blocks of a pool, by stream.
#[derive(Default, Clone)]
pub(crate) struct FreeBlocks {
    /// Sorted by stream; a stream's set may be empty.
    streams: Vec<(u32, SizeOrdered)>,
}

impl FreeBlocks {
    #[inline]
    fn stream(&self, stream: u32) -> Option<&SizeOrdered> {
        self.streams
            .iter()
            .find(|(s, _)| *s == stream)
            .map(|(_, set)| set)
    }

    #[inline]
    fn stream_mut(&mut self, stream: u32) -> Option<&mut SizeOrdered> {
        self.streams
            .iter_mut()
            .find(|(s, _)| *s == stream)
            .map(|(_, set)| set)
    }

    /// `blocks.insert(block)`; false if it was there already.
    pub(crate) fn insert(&mut self, b: FreeBlock) -> bool {
        if let Some(set) = self.stream_mut(b.stream) {
            return set.insert(b.size, b.ptr, b.id);
        }
        let at = self.streams.partition_point(|(s, _)| *s < b.stream);
        let mut set = SizeOrdered::default();
        set.insert(b.size, b.ptr, b.id);
        self.streams.insert(at, (b.stream, set));
        true
    }

    /// `blocks.erase(block)`; false if it was not there.
    pub(crate) fn remove(&mut self, stream: u32, size: u64, ptr: u64) -> bool {
        self.stream_mut(stream)
            .is_some_and(|set| set.remove(size, ptr))
    }

    /// `blocks.lower_bound(Block(stream, size))` and on, within the stream (PyTorch stops at a
    /// block of another stream; the next stream's blocks never qualify).
    #[inline]
    pub(crate) fn at_least(&self, stream: u32, size: u64) -> Candidates<'_> {
        let set = self.stream(stream);
        Candidates {
            set,
            stream,
            at: set.and_then(|s| s.first_at_least(size)),
        }
    }

    /// The first block of `stream` with at least `size` bytes, and where it is.
    #[inline]
    pub(crate) fn first_at_least(&self, stream: u32, size: u64) -> Option<(FreeBlock, Slot)> {
        let s = self.streams.iter().position(|(st, _)| *st == stream)?;
        let set = &self.streams[s].1;
        let at = set.first_at_least(size)?;
        let (size, ptr, id) = set.at(at);
        let found = FreeBlock {
            stream,
            size,
            ptr,
            id,
        };
        Some((found, Slot { stream: s, at }))
    }

    /// Where the block (stream, size, ptr) is.
    #[inline]
    pub(crate) fn find(&self, stream: u32, size: u64, ptr: u64) -> Option<Slot> {
        let s = self.streams.iter().position(|(st, _)| *st == stream)?;
        let at = self.streams[s].1.find(size, ptr)?;
        Some(Slot { stream: s, at })
    }

    /// Removes the block at `slot`.
    #[inline]
    pub(crate) fn remove_slot(&mut self, slot: Slot) {
        self.streams[slot.stream].1.remove_at(slot.at);
    }

    /// Replaces the block at `slot` by `b` (of the same stream, not in the set): what
    /// removing the one and inserting the other does.
    #[inline]
    pub(crate) fn replace_slot(&mut self, slot: Slot, b: FreeBlock) {
        let (stream, set) = &mut self.streams[slot.stream];
        debug_assert_eq!(*stream, b.stream);
        set.replace_at(slot.at, b.size, b.ptr, b.id);
    }

    /// The blocks of `stream` smaller than `size`, largest first.
    pub(crate) fn below(&self, stream: u32, size: u64) -> impl Iterator<Item = FreeBlock> + '_ {
        let set = self.stream(stream);
        let start = set.and_then(|s| s.last_below(size));
        let mut at = start;
        std::iter::from_fn(move || {
            let s = set?;
            let c = at?;
            at = s.prev(c);
            let (size, ptr, id) = s.at(c);
            Some(FreeBlock {
                stream,
                size,
                ptr,
                id,
            })
        })
    }

    /// Every block in PyTorch's set order: stream, size, address.
    pub(crate) fn iter(&self) -> impl Iterator<Item = FreeBlock> + '_ {
        self.streams.iter().flat_map(|(stream, set)| {
            set.iter().map(move |(size, ptr, id)| FreeBlock {
                stream: *stream,
                size,
                ptr,
                id,
            })
        })
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.streams.iter().map(|(_, s)| s.len()).sum()
    }
}

/// `BlockComparatorAddress`: unmapped expandable-segment ranges ordered by (stream, address).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct AddressKey {
    pub stream: u32,
    pub ptr: u64,
    pub id: u32,
}

/// `struct BlockPool`.
#[derive(Default)]
pub(crate) struct BlockPool {
    /// Free, mapped blocks.
    pub blocks: FreeBlocks,
    /// Free, unmapped ranges of expandable segments.
    pub unmapped: BTreeSet<AddressKey>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// A xorshift64 generator from `state`: the tests' operations, repeatable.
    fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    /// Replacements where nearly every block is alone in its size (sizes from a wide range),
    /// so a replaced size empties and a new one comes, above and below it: the set must list
    /// and search as PyTorch's would.
    #[test]
    fn replacing_blocks_alone_in_their_size_matches_an_ordered_set() {
        let mut rand = xorshift(0x9e37_79b9_7f4a_7c15);
        let mut ours = FreeBlocks::default();
        let mut reference: BTreeSet<(u32, u64, u64, u32)> = BTreeSet::new();
        for id in 0..200u32 {
            let b = FreeBlock {
                stream: 0,
                size: (rand() % 100_000 + 1) * 512,
                ptr: u64::from(id) * (1 << 40),
                id,
            };
            if ours.insert(b) {
                reference.insert((0, b.size, b.ptr, b.id));
            }
        }
        for id in 200..20_000u32 {
            let n = reference.len();
            let &(s, z, p, i) = reference.iter().nth((rand() as usize) % n).unwrap();
            // A split's remainder: the block shrinks, its address moves up; or a merge: it
            // grows. Half the time the new size is one another block has.
            let size = if rand().is_multiple_of(2) {
                reference.iter().nth((rand() as usize) % n).unwrap().1
            } else if rand().is_multiple_of(2) {
                (z / 512 - z / 512 * (rand() % 100) / 100).max(1) * 512
            } else {
                z + (rand() % 100_000 + 1) * 512
            };
            let b = FreeBlock {
                stream: s,
                size,
                ptr: p + (rand() % 64) * 512,
                id,
            };
            let slot = ours.find(s, z, p).expect("present");
            ours.replace_slot(slot, b);
            reference.remove(&(s, z, p, i));
            reference.insert((s, b.size, b.ptr, b.id));
            let probe = (rand() % 100_001) * 512;
            let got: Vec<_> = ours
                .at_least(0, probe)
                .map(|b| (b.stream, b.size, b.ptr, b.id))
                .collect();
            let want: Vec<_> = reference.range((0, probe, 0, 0)..).copied().collect();
            assert_eq!(got, want);
            let got: Vec<_> = ours
                .below(0, probe)
                .map(|b| (b.stream, b.size, b.ptr, b.id))
                .collect();
            let want: Vec<_> = reference.range(..(0, probe, 0, 0)).rev().copied().collect();
            assert_eq!(got, want);
            assert_eq!(ours.len(), reference.len());
        }
        let all: Vec<_> = ours
            .iter()
            .map(|b| (b.stream, b.size, b.ptr, b.id))
            .collect();
        assert_eq!(all, reference.iter().copied().collect::<Vec<_>>());
    }

    /// A reference: PyTorch's set as a `BTreeSet` of (stream, size, ptr, id).
    #[test]
    fn matches_an_ordered_set_under_random_operations() {
        let mut rand = xorshift(0x2545_f491_4f6c_dd1d);
        let mut ours = FreeBlocks::default();
        let mut reference: BTreeSet<(u32, u64, u64, u32)> = BTreeSet::new();
        let mut next_id = 0u32;
        for step in 0..30_000 {
            let op = rand() % 10;
            if op < 5 || reference.is_empty() {
                let b = FreeBlock {
                    stream: (rand() % 3) as u32,
                    size: (rand() % 64 + 1) * 512,
                    ptr: (rand() % 4096) * 512,
                    id: next_id,
                };
                next_id += 1;
                let fresh = !reference
                    .iter()
                    .any(|&(s, z, p, _)| s == b.stream && z == b.size && p == b.ptr);
                assert_eq!(ours.insert(b), fresh);
                if fresh {
                    reference.insert((b.stream, b.size, b.ptr, b.id));
                }
            } else if op < 8 {
                let n = reference.len();
                let &(s, z, p, _) = reference.iter().nth((rand() as usize) % n).unwrap();
                assert!(ours.remove(s, z, p));
                reference.retain(|&(s2, z2, p2, _)| (s2, z2, p2) != (s, z, p));
                assert!(!ours.remove(s, z, p));
            } else {
                let stream = (rand() % 3) as u32;
                let size = (rand() % 70) * 512;
                let want: Vec<_> = reference
                    .range((stream, size, 0, 0)..)
                    .take_while(|k| k.0 == stream)
                    .copied()
                    .collect();
                let got: Vec<_> = ours
                    .at_least(stream, size)
                    .map(|b| (b.stream, b.size, b.ptr, b.id))
                    .collect();
                assert_eq!(got, want);
                let want: Vec<_> = reference
                    .range(..(stream, size, 0, 0))
                    .rev()
                    .take_while(|k| k.0 == stream)
                    .copied()
                    .collect();
                let got: Vec<_> = ours
                    .below(stream, size)
                    .map(|b| (b.stream, b.size, b.ptr, b.id))
                    .collect();
                assert_eq!(got, want);
                if step % 5 == 0 {
                    // Replace a random entry by a fresh key (as a split or a merge does).
                    let n = reference.len();
                    if n > 0 {
                        let &(s, z, p, _) = reference.iter().nth((rand() as usize) % n).unwrap();
                        let b = FreeBlock {
                            stream: s,
                            size: (rand() % 64 + 1) * 512,
                            ptr: (rand() % 4096) * 512,
                            id: next_id,
                        };
                        next_id += 1;
                        let fresh = !reference
                            .iter()
                            .any(|&(s2, z2, p2, _)| (s2, z2, p2) == (s, b.size, b.ptr));
                        if fresh {
                            let slot = ours.find(s, z, p).expect("present");
                            ours.replace_slot(slot, b);
                            reference.retain(|&(s2, z2, p2, _)| (s2, z2, p2) != (s, z, p));
                            reference.insert((s, b.size, b.ptr, b.id));
                        }
                    }
                }
                if step % 7 == 0 {
                    let taken = ours.first_at_least(stream, size).map(|(b, slot)| {
                        ours.remove_slot(slot);
                        b
                    });
                    let want = reference
                        .range((stream, size, 0, 0)..)
                        .next()
                        .filter(|k| k.0 == stream)
                        .copied();
                    assert_eq!(taken.map(|b| (b.stream, b.size, b.ptr, b.id)), want);
                    if let Some(k) = want {
                        reference.remove(&k);
                    }
                }
            }
            assert_eq!(ours.len(), reference.len());
        }
        let all: Vec<_> = ours
            .iter()
            .map(|b| (b.stream, b.size, b.ptr, b.id))
            .collect();
        let want: Vec<_> = reference.iter().copied().collect();
        assert_eq!(all, want);
    }
}
