//! `Block`: a range of a segment, free or handed out, linked to its neighbours. Blocks live in
//! an arena and refer to each other by index, so the hot path never allocates.

/// A handle to an allocated block. It stays valid until the block is freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockId(pub(crate) u32);

impl BlockId {
    /// Names no block: what a caller hands out in place of one the allocator refused (a
    /// simulation that stopped). It must never come back to the allocator.
    pub const DETACHED: BlockId = BlockId(NONE);

    /// A small number for the block, unique among live blocks (its slot in the arena): for
    /// tables a caller keeps by block.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// "No block": the null `prev`/`next`/`expandable_segment_` pointer.
pub(crate) const NONE: u32 = u32::MAX;

/// Which of the device's two default pools a block belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pool {
    /// Rounded sizes up to 1 MiB, packed into 2 MiB segments.
    Small,
    /// Everything larger.
    Large,
}

impl Pool {
    pub(crate) fn is_small(self) -> bool {
        self == Pool::Small
    }
}

/// `struct Block` from `CUDACachingAllocator.cpp`, less what only a real device needs
/// (events, contexts, device index).
#[derive(Clone, Debug)]
pub(crate) struct Block {
    pub ptr: u64,
    pub size: u64,
    /// The caller's request (stale once the block is free, as in PyTorch).
    pub requested_size: u64,
    pub stream: u32,
    pub pool: Pool,
    pub allocated: bool,
    /// Freed by the caller but still in use by another stream (`event_count > 0`): active,
    /// not allocated, and not mergeable.
    pub pending_free: bool,
    /// Backed by physical pages; only expandable-segment blocks can be unmapped.
    pub mapped: bool,
    pub prev: u32,
    pub next: u32,
    /// Index of the expandable segment this block is part of, or `NONE`.
    pub expandable: u32,
}

impl Block {
    pub(crate) fn is_split(&self) -> bool {
        self.prev != NONE || self.next != NONE
    }

    pub(crate) fn is_expandable(&self) -> bool {
        self.expandable != NONE
    }
}

/// The block store: `new Block` / `delete block` become `insert` / `remove` on a slab.
#[derive(Default)]
pub(crate) struct BlockArena {
    slots: Vec<Block>,
    live: Vec<bool>,
    vacant: Vec<u32>,
}

impl BlockArena {
    pub(crate) fn insert(&mut self, block: Block) -> u32 {
        if let Some(id) = self.vacant.pop() {
            self.slots[id as usize] = block;
            self.live[id as usize] = true;
            id
        } else {
            let id = u32::try_from(self.slots.len()).expect("more than 4 billion blocks");
            self.slots.push(block);
            self.live.push(true);
            id
        }
    }

    pub(crate) fn remove(&mut self, id: u32) {
        debug_assert!(self.live[id as usize]);
        self.live[id as usize] = false;
        self.vacant.push(id);
    }

    /// How many blocks are live.
    pub(crate) fn len(&self) -> usize {
        self.slots.len() - self.vacant.len()
    }

    /// Every live block, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Block)> {
        self.slots
            .iter()
            .zip(&self.live)
            .enumerate()
            .filter(|(_, (_, live))| **live)
            .map(|(i, (b, _))| (i as u32, b))
    }
}

impl std::ops::Index<u32> for BlockArena {
    type Output = Block;
    fn index(&self, id: u32) -> &Block {
        &self.slots[id as usize]
    }
}

impl std::ops::IndexMut<u32> for BlockArena {
    fn index_mut(&mut self, id: u32) -> &mut Block {
        &mut self.slots[id as usize]
    }
}
