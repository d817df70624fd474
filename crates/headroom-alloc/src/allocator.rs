//! `DeviceCachingAllocator`: the native allocator of one device, method by method.
//!
//! Each private method mirrors the C++ method of the same name in
//! `c10/cuda/CUDACachingAllocator.cpp` (PyTorch 2.11). What a simulation has no use for is
//! left out: CUDA graphs and `MemPool` private pools, IPC, peer access, profiler hooks,
//! free-memory callbacks, and garbage collection (which needs
//! `set_per_process_memory_fraction`). Cross-stream frees (`record_stream`) are modelled by
//! `free_requested` + `complete_free`.

use crate::address_space::AddressSpace;
use crate::block::{Block, BlockArena, BlockId, NONE, Pool};
use crate::config::AllocatorConfig;
use crate::events::{SegmentAction, SegmentEvent};
use crate::expandable::ExpandableSegment;
use crate::oom::{DeviceOutOfMemory, ONE_EXABYTE, OutOfMemory};
use crate::pool::{AddressKey, BlockPool, FreeBlock, Slot};
use crate::restore::RestoreError;
use crate::size::{MIN_BLOCK_SIZE, SMALL_BUFFER, SMALL_SIZE, get_allocation_size, round_size};
use crate::stats::Stats;

/// The device size assumed for the virtual reservation of expandable segments when no
/// capacity is given (PyTorch reserves 1.125 x `totalGlobalMem`).
const UNBOUNDED_DEVICE_TOTAL: u64 = 1 << 40;

/// The simulated caching allocator of one device.
pub struct CachingAllocator {
    pub(crate) config: AllocatorConfig,
    /// Bytes the allocator may obtain from the device; `None` for no limit.
    capacity: Option<u64>,
    pub(crate) blocks: BlockArena,
    small_blocks: BlockPool,
    large_blocks: BlockPool,
    /// Live expandable segments by index (`expandable_segments_`); released ones are `None`.
    expandable_segments: Vec<Option<ExpandableSegment>>,
    /// Blocks freed by the caller but still in use by other streams (`cuda_events`).
    pending_frees: Vec<u32>,
    /// Bytes obtained from the device (`total_allocated_memory`).
    total_allocated_memory: u64,
    stats: Stats,
    address_space: AddressSpace,
    event_log: Option<Vec<SegmentEvent>>,
    /// Where each `malloc` found its block, while recording (see [`Decision`]).
    decisions: Option<Vec<Decision>>,
    /// The device limit changed the layout: a request it refused was served after freeing
    /// cached blocks, or freeing them changed something (see
    /// [`CachingAllocator::limit_has_acted`]).
    limit_acted: bool,
}

/// How one `malloc` was served: the block best fit chose (before splitting), a new segment,
/// or anything else (expandable segments, a cache flush, an error). Recorded to show that a
/// later run of the same requests makes the same choices; see
/// [`CachingAllocator::repeats_from`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    kind: DecisionKind,
    pool: Pool,
    stream: u32,
    /// The rounded request.
    size: u64,
    /// The block found, or the new segment.
    ptr: u64,
    block_size: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DecisionKind {
    Found,
    NewSegment,
    Other,
}

/// The layout of every block at one moment, as far as it steers later decisions: address,
/// size, pool, stream, whether allocated (and for what request), pending or unmapped, and
/// whether it has neighbours in its segment. Block handles and the statistics' counters are
/// left out: no decision reads them.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// In address order.
    blocks: Vec<BlockState>,
    config_ok: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BlockState {
    ptr: u64,
    size: u64,
    /// The request of an allocated block, `FREE` for a free one (whose request is stale and
    /// unused).
    requested: u64,
    stream: u32,
    /// Small pool, pending free, mapped, expandable, has a previous, has a next block.
    flags: u8,
}

const FREE: u64 = u64::MAX;

impl BlockState {
    /// A whole `cudaMalloc` segment that is free: mapped and nothing else.
    fn is_free_segment(&self) -> bool {
        self.requested == FREE && self.flags & !1 == 1 << 2
    }
}

/// Blocks laid out from a segment's start: (size, `Some(requested)` if allocated).
pub(crate) type BlockLayout = Vec<(u64, Option<u64>)>;

/// `AllocParams`: one request on its way through `malloc`.
struct AllocParams {
    /// Rounded size.
    size: u64,
    stream: u32,
    pool: Pool,
    /// Size of a new segment for this request.
    alloc_size: u64,
    /// The block found or created.
    block: u32,
    /// Where the block found still sits in its pool's set: `get_free_block` leaves it there
    /// for `alloc_found_block` to remove it, or to put the remainder of a split in its place
    /// (one update of the set instead of two).
    slot: Option<Slot>,
}

/// Where restored blocks are being laid out: the segment (expandable index or `NONE`), its
/// stream and pool, the next address and the last block placed.
struct Tiling {
    segment: u32,
    stream: u32,
    pool: Pool,
    ptr: u64,
    prev: u32,
}

/// `get_pool` for the default pools: rounded sizes up to 1 MiB are small.
fn get_pool(size: u64) -> Pool {
    if size <= SMALL_SIZE {
        Pool::Small
    } else {
        Pool::Large
    }
}

impl CachingAllocator {
    /// A device with nothing allocated. `capacity` is the number of bytes the allocator may
    /// obtain from the device (its total memory minus what the CUDA context, NCCL and other
    /// processes hold); `None` never runs out.
    pub fn new(config: AllocatorConfig, capacity: Option<u64>) -> Self {
        let stats = Stats::new(config.max_split_size);
        let mut allocator = CachingAllocator {
            config,
            capacity,
            blocks: BlockArena::default(),
            small_blocks: BlockPool::default(),
            large_blocks: BlockPool::default(),
            expandable_segments: Vec::new(),
            pending_frees: Vec::new(),
            total_allocated_memory: 0,
            stats,
            address_space: AddressSpace::new(),
            event_log: None,
            decisions: None,
            limit_acted: false,
        };
        allocator.note_expandable_limit();
        allocator
    }

    /// Change the device capacity from now on (`None`: no limit). The estimator lifts the
    /// limit after the first out-of-memory error to measure how much the run would need.
    pub fn set_capacity(&mut self, capacity: Option<u64>) {
        self.capacity = capacity;
        self.note_expandable_limit();
    }

    /// Expandable segments reserve address space in proportion to the capacity: with a limit,
    /// every segment is laid out differently from the first.
    fn note_expandable_limit(&mut self) {
        self.limit_acted |= self.capacity.is_some() && self.config.expandable_segments;
    }

    /// Whether the device limit has made the layout differ from what the same calls would
    /// have left without a limit. Until the device first refuses a segment, a limited
    /// allocator is an unlimited one. A refused request then frees the cache and retries: if
    /// that freed nothing (no pending frees, no whole free segment) and the request failed,
    /// only counters (`num_ooms`, retries, syncs) differ, and once the limit is lifted the
    /// request gets the segment an unlimited allocator would have made. Anything else (a
    /// retry that succeeded, a block released, a configuration other than the plain one,
    /// whose releases this does not follow) counts as acting.
    pub fn limit_has_acted(&self) -> bool {
        self.limit_acted
    }

    /// Starts (or stops) recording how each `malloc` is served; starting clears the record.
    pub fn record_decisions(&mut self, on: bool) {
        self.decisions = on.then(Vec::new);
    }

    /// Starts recording into `buffer` (cleared first), reusing its memory. Room is made for
    /// as many decisions as there were allocations so far (a step allocates about as often
    /// as everything before it): growing the log by copying costs more than writing it.
    pub fn record_decisions_into(&mut self, mut buffer: Vec<Decision>) {
        buffer.clear();
        buffer.reserve(self.stats.allocation.all.allocated as usize);
        self.decisions = Some(buffer);
    }

    /// The decisions recorded since recording started (empty when it is off).
    pub fn take_decisions(&mut self) -> Vec<Decision> {
        self.decisions
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// The block layout now, for [`CachingAllocator::repeats_from`].
    pub fn checkpoint(&self) -> Checkpoint {
        let mut blocks = Vec::with_capacity(self.blocks.len());
        self.each_block_in_order(|b| {
            blocks.push(b);
            true
        });
        Checkpoint {
            blocks,
            config_ok: self.plain_config(),
        }
    }

    /// No `max_split_size`, no expandable segments, no pending frees: the configuration
    /// [`CachingAllocator::repeats_from`] covers. A device limit does not matter: a repeated
    /// run never asks the device for memory (every new segment is one of the spare ones), and
    /// a run that hit the limit recorded a decision of another kind.
    fn plain_config(&self) -> bool {
        !self.config.expandable_segments
            && self.config.max_split_size == u64::MAX
            && self.pending_frees.is_empty()
            && self.expandable_segments.iter().all(Option::is_none)
    }

    /// Every block in address order (segment by segment, each from its first block along
    /// `next`), until `f` returns false. Returns whether `f` saw them all.
    fn each_block_in_order(&self, mut f: impl FnMut(BlockState) -> bool) -> bool {
        let mut heads: Vec<(u64, u32)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.prev == NONE)
            .map(|(id, b)| (b.ptr, id))
            .collect();
        // Segments do not overlap: their first addresses alone order them.
        heads.sort_unstable_by_key(|&(ptr, _)| ptr);
        for (_, head) in heads {
            let mut id = head;
            while id != NONE {
                let b = &self.blocks[id];
                let state = BlockState {
                    ptr: b.ptr,
                    size: b.size,
                    requested: if b.allocated { b.requested_size } else { FREE },
                    stream: b.stream,
                    flags: u8::from(b.pool.is_small())
                        | (u8::from(b.pending_free) << 1)
                        | (u8::from(b.mapped) << 2)
                        | (u8::from(b.is_expandable()) << 3)
                        | (u8::from(b.prev != NONE) << 4)
                        | (u8::from(b.next != NONE) << 5),
                };
                if !f(state) {
                    return false;
                }
                id = b.next;
            }
        }
        true
    }

    /// Whether the requests that, from the layout `earlier`, were served as `decisions`
    /// would be served the same way from the layout now, block for block, leaving the same
    /// layout behind.
    ///
    /// That holds when the layout now is `earlier` plus some whole free segments `E` (made
    /// while `decisions` were taken) that never change a decision: best fit takes the
    /// smallest block of the pool and stream by (size, address), so a request `earlier`
    /// served from block `f` is served from `f` again unless a member of `E` is large
    /// enough and orders before `f`; a request that got a new segment `X` instead takes the
    /// best member of `E`, which must be `X` itself (same address and size: the state is then
    /// the same as after `X` was made). Frees only merge blocks within their segment, so
    /// they never touch `E`. Only the plain configuration is covered (no `max_split_size`,
    /// no expandable segments, no pending frees); for anything else, or any decision of
    /// another kind (a cache flush and retry, an expandable mapping, a failure), the answer
    /// is no. A device limit does not matter: the repeated requests never reach the device.
    pub fn repeats_from(&self, earlier: &Checkpoint, decisions: &[Decision]) -> bool {
        if !self.plain_config() || !earlier.config_ok || self.blocks.len() < earlier.blocks.len() {
            return false;
        }
        // `earlier` must be contained in the layout now; what it has besides is E.
        let mut spare: Vec<BlockState> = Vec::new();
        let mut old = earlier.blocks.iter().peekable();
        let contained = self.each_block_in_order(|b| match old.peek() {
            Some(&&o) if o.ptr == b.ptr => {
                old.next();
                o == b
            }
            _ => {
                spare.push(b);
                b.is_free_segment()
            }
        });
        if !contained || old.next().is_some() {
            return false;
        }
        // E by pool and stream, each in best-fit order (size, address): the member best fit
        // would take for a request is the first one large enough.
        spare.sort_unstable_by_key(|e| (e.flags & 1, e.stream, e.size, e.ptr));
        let best = |spare: &[BlockState], d: &Decision| -> Option<usize> {
            let small = u8::from(d.pool.is_small());
            let i = spare
                .partition_point(|e| (e.flags & 1, e.stream, e.size) < (small, d.stream, d.size));
            spare
                .get(i)
                .filter(|e| e.flags & 1 == small && e.stream == d.stream)
                .map(|_| i)
        };
        for d in decisions {
            match d.kind {
                DecisionKind::Other => return false,
                DecisionKind::Found => {
                    if let Some(i) = best(&spare, d)
                        && (spare[i].size, spare[i].ptr) < (d.block_size, d.ptr)
                    {
                        return false;
                    }
                }
                DecisionKind::NewSegment => match best(&spare, d) {
                    Some(i) if spare[i].size == d.block_size && spare[i].ptr == d.ptr => {
                        spare.remove(i);
                    }
                    _ => return false,
                },
            }
        }
        true
    }

    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// `resetPeakStats`.
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    /// The size of the block behind `block`: the rounded request, or more when the remainder
    /// was too small to split off.
    pub fn block_size(&self, block: BlockId) -> u64 {
        self.blocks[block.0].size
    }

    /// The address of the block behind `block`.
    pub fn block_address(&self, block: BlockId) -> u64 {
        self.blocks[block.0].ptr
    }

    /// Starts (or stops and clears) the log of segment events.
    pub fn record_segment_events(&mut self, on: bool) {
        self.event_log = on.then(Vec::new);
    }

    /// Segment events since logging started, oldest first (empty when logging is off).
    pub fn segment_events(&self) -> &[SegmentEvent] {
        self.event_log.as_deref().unwrap_or(&[])
    }

    /// The next segment reservation made during the next `malloc` goes to `address` if the
    /// range is free (replay passes the recorded `cudaMalloc` address so that ties between
    /// equal-size blocks break as they did on the device). Cleared when that `malloc` returns.
    pub fn set_address_hint(&mut self, address: u64) {
        self.address_space.set_hint(address);
    }

    /// `DeviceCachingAllocator::malloc`: a block of at least `size` bytes usable on `stream`.
    pub fn malloc(&mut self, size: u64, stream: u32) -> Result<BlockId, OutOfMemory> {
        let result = self.malloc_inner(size, stream);
        self.address_space.clear_hint();
        result
    }

    fn malloc_inner(&mut self, orig_size: u64, stream: u32) -> Result<BlockId, OutOfMemory> {
        if orig_size >= ONE_EXABYTE {
            return Err(OutOfMemory::MoreThanOneExabyte {
                requested: orig_size,
            });
        }
        let size = round_size(&self.config, orig_size);
        let pool = get_pool(size);
        let alloc_size = get_allocation_size(&self.config, size);
        let mut params = AllocParams {
            size,
            stream,
            pool,
            alloc_size,
            block: NONE,
            slot: None,
        };

        let mut kind = DecisionKind::Found;
        let block_found = self.get_free_block(&mut params)
            || {
                kind = if self.config.expandable_segments {
                    DecisionKind::Other
                } else {
                    DecisionKind::NewSegment
                };
                self.alloc_block(&mut params, false)
            }
            || {
                kind = DecisionKind::Other;
                self.retry_after_release(&mut params)
            };
        if let Some(log) = &mut self.decisions {
            let (ptr, block_size) = if block_found {
                let b = &self.blocks[params.block];
                (b.ptr, b.size)
            } else {
                (0, 0)
            };
            log.push(Decision {
                kind: if block_found {
                    kind
                } else {
                    DecisionKind::Other
                },
                pool,
                stream,
                size,
                ptr,
                block_size,
            });
        }
        if !block_found {
            self.stats.num_ooms += 1;
            return Err(OutOfMemory::Device(
                self.out_of_memory(orig_size, alloc_size),
            ));
        }
        let split_remainder = self.should_split(params.block, size);
        Ok(BlockId(self.alloc_found_block(
            &params,
            orig_size,
            split_remainder,
        )))
    }

    /// The last resort of `malloc`, once the device refused a segment: free cached blocks and
    /// try again. Notes whether that made the layout differ from an unlimited allocator's.
    fn retry_after_release(&mut self, params: &mut AllocParams) -> bool {
        let untouched = (self.stats.num_device_free, self.pending_frees.is_empty());
        let found = (self.release_available_cached_blocks(params)
            && self.alloc_block(params, false))
            || (self.release_cached_blocks() && self.alloc_block(params, true));
        let changed = (self.stats.num_device_free, true) != untouched;
        self.limit_acted |= found || changed || !self.plain_config();
        found
    }

    fn out_of_memory(&self, requested: u64, alloc_size: u64) -> DeviceOutOfMemory {
        let reserved = self.stats.reserved_bytes.all.current as u64;
        let device_total = self.capacity.unwrap_or(u64::MAX);
        DeviceOutOfMemory {
            requested,
            alloc_size,
            device: 0,
            device_total,
            device_free: device_total.saturating_sub(self.total_allocated_memory),
            allocated_bytes: self.stats.allocated_bytes.all.current as u64,
            reserved_bytes: reserved,
        }
    }

    /// `free` for a block used on its own stream only: it goes back to its pool at once.
    pub fn free(&mut self, block: BlockId) {
        self.release_allocation(block.0);
        self.free_block(block.0);
    }

    /// `free` for a block that `record_stream` marked as used by other streams: the caller is
    /// done with it, but it stays active (and unusable) until `complete_free` or a cache flush.
    pub fn free_requested(&mut self, block: BlockId) {
        self.release_allocation(block.0);
        self.blocks[block.0].pending_free = true;
        self.pending_frees.push(block.0);
    }

    /// The other streams are done with a block passed to `free_requested` (`process_events`
    /// seeing its events complete). Does nothing if a cache flush already completed it.
    pub fn complete_free(&mut self, block: BlockId) {
        if let Some(i) = self.pending_frees.iter().position(|&b| b == block.0) {
            self.pending_frees.swap_remove(i);
            self.blocks[block.0].pending_free = false;
            self.free_block(block.0);
        }
    }

    /// The part of `free` before the block goes back to the pool.
    fn release_allocation(&mut self, id: u32) {
        let block = &mut self.blocks[id];
        debug_assert!(block.allocated, "freeing a block that is not allocated");
        block.allocated = false;
        let (small, size) = (block.pool.is_small(), block.size);
        self.stats.allocation.decrease(small, 1);
        self.stats.allocated_bytes.decrease(small, size);
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.decrease(1);
        }
    }

    /// `emptyCache` (`release_cached_blocks`): completes pending frees, returns every whole free
    /// segment to the device and unmaps the free pages of expandable segments.
    pub fn empty_cache(&mut self) {
        self.release_cached_blocks();
    }

    // ----- the C++ private methods -------------------------------------------------------

    fn pool_ref(&self, pool: Pool) -> &BlockPool {
        if pool.is_small() {
            &self.small_blocks
        } else {
            &self.large_blocks
        }
    }

    fn pool_mut(&mut self, pool: Pool) -> &mut BlockPool {
        if pool.is_small() {
            &mut self.small_blocks
        } else {
            &mut self.large_blocks
        }
    }

    fn free_block_key(&self, id: u32) -> FreeBlock {
        let b = &self.blocks[id];
        FreeBlock {
            stream: b.stream,
            size: b.size,
            ptr: b.ptr,
            id,
        }
    }

    fn address_key(&self, id: u32) -> AddressKey {
        let b = &self.blocks[id];
        AddressKey {
            stream: b.stream,
            ptr: b.ptr,
            id,
        }
    }

    /// `BlockPool::insert_into_blocks`.
    fn insert_into_blocks(&mut self, id: u32) {
        let (key, pool) = (self.free_block_key(id), self.blocks[id].pool);
        let inserted = self.pool_mut(pool).blocks.insert(key);
        debug_assert!(inserted);
    }

    fn erase_from_blocks(&mut self, id: u32) {
        let b = &self.blocks[id];
        let (stream, size, ptr, pool) = (b.stream, b.size, b.ptr, b.pool);
        let erased = self.pool_mut(pool).blocks.remove(stream, size, ptr);
        debug_assert!(erased);
    }

    fn insert_unmapped(&mut self, id: u32) {
        let (key, pool) = (self.address_key(id), self.blocks[id].pool);
        self.pool_mut(pool).unmapped.insert(key);
    }

    fn erase_unmapped(&mut self, id: u32) {
        let (key, pool) = (self.address_key(id), self.blocks[id].pool);
        let erased = self.pool_mut(pool).unmapped.remove(&key);
        debug_assert!(erased);
    }

    fn expandable(&self, index: u32) -> &ExpandableSegment {
        self.expandable_segments[index as usize]
            .as_ref()
            .expect("released expandable segment")
    }

    fn log(&mut self, action: SegmentAction, address: u64, size: u64, stream: u32) {
        if let Some(log) = &mut self.event_log {
            log.push(SegmentEvent {
                action,
                address,
                size,
                stream,
            });
        }
    }

    /// Whether the device has `bytes` more to give (`cudaMalloc` / `cuMemCreate` succeeding).
    fn fits(&self, bytes: u64) -> bool {
        self.capacity
            .is_none_or(|cap| self.total_allocated_memory.saturating_add(bytes) <= cap)
    }

    /// `Block::splice`: links `id` between `before` and `after`.
    fn splice(&mut self, id: u32, before: u32, after: u32) {
        if before != NONE {
            self.blocks[before].next = id;
        }
        self.blocks[id].prev = before;
        if after != NONE {
            self.blocks[after].prev = id;
        }
        self.blocks[id].next = after;
    }

    /// `get_free_block`: best fit among this stream's free blocks of the pool, by size then
    /// address, subject to the `max_split_size` rules.
    fn get_free_block(&mut self, p: &mut AllocParams) -> bool {
        let max_split_size = self.config.max_split_size;
        let max_non_split_rounding_size = self.config.max_non_split_rounding_size;
        let size = p.size;
        // The size rules below, on the block found.
        let fits = move |found: &FreeBlock| {
            // Do not return an oversized block for a request that is not oversize.
            if size < max_split_size && found.size >= max_split_size {
                return false;
            }
            // An oversize block may serve an oversize request only within the rounding limit.
            !(size >= max_split_size
                && found.size >= size.saturating_add(max_non_split_rounding_size))
        };
        // The common case, in one search: the first candidate is a plain block. It stays in
        // the set (at `p.slot`) until `alloc_found_block`.
        let Some((found, slot)) = self
            .pool_ref(p.pool)
            .blocks
            .first_at_least(p.stream, p.size)
        else {
            return false;
        };
        if !self.blocks[found.id].is_expandable() {
            if !fits(&found) {
                return false;
            }
            p.block = found.id;
            p.slot = Some(slot);
            return true;
        }
        let pool = self.pool_ref(p.pool);
        let mut candidates = pool.blocks.at_least(p.stream, p.size);
        let Some(mut found) = candidates.next() else {
            return false;
        };
        if found.stream != p.stream {
            return false;
        }
        if self.blocks[found.id].is_expandable() {
            if self.config.expandable_segments {
                // Rank blocks at the end of a mapped range by the size they can grow to.
                while self.blocks[found.id].is_expandable() {
                    match candidates.next() {
                        Some(next)
                            if next.stream == p.stream
                                && self.expandable_size(next.id)
                                    < self.expandable_size(found.id) =>
                        {
                            found = next;
                        }
                        _ => break,
                    }
                }
            } else {
                // Expandable segments were turned off: only plain blocks may be used.
                loop {
                    match candidates.next() {
                        None => return false,
                        Some(next) => {
                            found = next;
                            if !(self.blocks[found.id].is_expandable() && found.stream == p.stream)
                            {
                                break;
                            }
                        }
                    }
                }
                if found.stream != p.stream {
                    return false;
                }
            }
        }
        if !fits(&found) {
            return false;
        }
        let removed = self
            .pool_mut(p.pool)
            .blocks
            .remove(found.stream, found.size, found.ptr);
        debug_assert!(removed);
        p.block = found.id;
        true
    }

    /// The `expandable_size` lambda of `get_free_block`: a block's size plus the unmapped
    /// range right after it.
    fn expandable_size(&self, id: u32) -> u64 {
        let b = &self.blocks[id];
        let grow = if b.next != NONE && !self.blocks[b.next].mapped {
            self.blocks[b.next].size
        } else {
            0
        };
        b.size + grow
    }

    /// `should_split`.
    fn should_split(&self, id: u32, size: u64) -> bool {
        let block = &self.blocks[id];
        let remaining = block.size - size;
        if block.pool.is_small() || self.config.expandable_segments {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.config.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// `alloc_block`: a new segment (`cudaMalloc`), or new pages of an expandable segment.
    fn alloc_block(&mut self, p: &mut AllocParams, is_retry: bool) -> bool {
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        if self.config.expandable_segments {
            return match self.try_allocate_expandable_block(p.stream, p.pool, p.size) {
                Some(id) => {
                    p.block = id;
                    true
                }
                None => false,
            };
        }
        let size = p.alloc_size;
        if !self.fits(size) {
            return false;
        }
        let Some(ptr) = self.address_space.reserve(size) else {
            return false;
        };
        self.total_allocated_memory += size;
        p.block = self.blocks.insert(Block {
            ptr,
            size,
            requested_size: 0,
            stream: p.stream,
            pool: p.pool,
            allocated: false,
            pending_free: false,
            mapped: true,
            prev: NONE,
            next: NONE,
            expandable: NONE,
        });
        let small = p.pool.is_small();
        self.stats.segment.increase(small, 1);
        self.stats.reserved_bytes.increase(small, size);
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        self.log(SegmentAction::Alloc, ptr, size, p.stream);
        true
    }

    /// `alloc_found_block`: hands out `params.block`, first splitting the request off its
    /// low-address end when `split_remainder`.
    fn alloc_found_block(&mut self, p: &AllocParams, orig_size: u64, split_remainder: bool) -> u32 {
        let small = p.pool.is_small();
        let mut id = p.block;
        let already_split = self.blocks[id].is_split();
        let expandable = self.blocks[id].is_expandable();
        if split_remainder {
            let remaining = id;
            let (ptr, prev, segment) = {
                let r = &self.blocks[remaining];
                (r.ptr, r.prev, r.expandable)
            };
            id = self.blocks.insert(Block {
                ptr,
                size: p.size,
                requested_size: 0,
                stream: p.stream,
                pool: p.pool,
                allocated: false,
                pending_free: false,
                mapped: true,
                prev: NONE,
                next: NONE,
                expandable: segment,
            });
            self.splice(id, prev, remaining);
            let r = &mut self.blocks[remaining];
            r.ptr += p.size;
            r.size -= p.size;
            let remaining_size = r.size;
            match p.slot {
                Some(slot) => {
                    let key = self.free_block_key(remaining);
                    self.pool_mut(p.pool).blocks.replace_slot(slot, key);
                }
                None => self.insert_into_blocks(remaining),
            }
            if already_split && !expandable {
                // An already-split inactive block shrinks by the size handed out.
                self.stats.inactive_split_bytes.decrease(small, p.size);
            } else if !expandable {
                // A whole segment becomes split: its remainder is a new inactive split block.
                self.stats
                    .inactive_split_bytes
                    .increase(small, remaining_size);
                self.stats.inactive_split.increase(small, 1);
            }
        } else if let Some(slot) = p.slot {
            self.pool_mut(p.pool).blocks.remove_slot(slot);
        }
        if !split_remainder && already_split && !expandable {
            // An inactive split block becomes active whole.
            let size = self.blocks[id].size;
            self.stats.inactive_split_bytes.decrease(small, size);
            self.stats.inactive_split.decrease(small, 1);
        }

        let block = &mut self.blocks[id];
        block.allocated = true;
        block.requested_size = orig_size;
        let size = block.size;
        self.stats.allocation.increase(small, 1);
        self.stats.allocated_bytes.increase(small, size);
        self.stats.active.increase(small, 1);
        self.stats.active_bytes.increase(small, size);
        self.stats.requested_bytes.increase(small, orig_size);
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.increase(1);
        }
        id
    }

    /// `free_block`: back into the pool, merged with free neighbours.
    fn free_block(&mut self, id: u32) {
        let (original_size, requested_size, small, prev, next) = {
            let b = &self.blocks[id];
            (b.size, b.requested_size, b.pool.is_small(), b.prev, b.next)
        };
        let mut net_inactive_blocks: i64 = 0;
        let mut net_inactive_bytes: i64 = 0;
        // The free neighbours leave the pool's set and the merged block enters it: done as
        // one replacement of a neighbour's entry (the other, if any, is removed).
        debug_assert!(self.blocks[id].mapped);
        let (merge_prev, merge_next) = (self.mergeable(id, prev), self.mergeable(id, next));
        let slot = match (merge_prev, merge_next) {
            (false, false) => None,
            (true, false) => Some(self.slot_of(prev)),
            (false, true) => Some(self.slot_of(next)),
            (true, true) => {
                self.erase_from_blocks(prev);
                Some(self.slot_of(next))
            }
        };
        for (candidate, merges) in [(prev, merge_prev), (next, merge_next)] {
            if merges {
                let subsumed = self.merge_blocks(id, candidate);
                net_inactive_blocks -= 1;
                net_inactive_bytes -= subsumed as i64;
            }
        }
        match slot {
            Some(slot) => {
                let (key, pool) = (self.free_block_key(id), self.blocks[id].pool);
                self.pool_mut(pool).blocks.replace_slot(slot, key);
            }
            None => self.insert_into_blocks(id),
        }
        let block = &self.blocks[id];
        if block.is_split() {
            net_inactive_blocks += 1;
            net_inactive_bytes += block.size as i64;
        }
        // Expandable segments are left out of inactive_split, as in PyTorch.
        if !block.is_expandable() {
            apply_delta(&mut self.stats.inactive_split, small, net_inactive_blocks);
            apply_delta(
                &mut self.stats.inactive_split_bytes,
                small,
                net_inactive_bytes,
            );
        }
        self.stats.active.decrease(small, 1);
        self.stats.active_bytes.decrease(small, original_size);
        self.stats.requested_bytes.decrease(small, requested_size);
    }

    /// The condition of `try_merge_blocks`: `src` is a free neighbour in the same mapping
    /// state as `dst`.
    fn mergeable(&self, dst: u32, src: u32) -> bool {
        if src == NONE {
            return false;
        }
        let s = &self.blocks[src];
        !(s.allocated || s.pending_free || s.mapped != self.blocks[dst].mapped)
    }

    /// Where the free mapped block `id` is in its pool's set.
    fn slot_of(&self, id: u32) -> Slot {
        let b = &self.blocks[id];
        self.pool_ref(b.pool)
            .blocks
            .find(b.stream, b.size, b.ptr)
            .expect("a free mapped block is in its pool's set")
    }

    /// The linking half of `try_merge_blocks` for a `mergeable` mapped `src` already dealt
    /// with in the pool's set: `dst` absorbs it. Returns the bytes absorbed.
    fn merge_blocks(&mut self, dst: u32, src: u32) -> u64 {
        let s = &self.blocks[src];
        let (src_ptr, src_size, src_prev, src_next) = (s.ptr, s.size, s.prev, s.next);
        if self.blocks[dst].prev == src {
            // [src dst]
            self.blocks[dst].ptr = src_ptr;
            self.blocks[dst].prev = src_prev;
            if src_prev != NONE {
                self.blocks[src_prev].next = dst;
            }
        } else {
            // [dst src]
            self.blocks[dst].next = src_next;
            if src_next != NONE {
                self.blocks[src_next].prev = dst;
            }
        }
        self.blocks[dst].size += src_size;
        self.blocks.remove(src);
        src_size
    }

    /// `try_merge_blocks`: absorbs `src` into `dst` when `src` is a free neighbour in the same
    /// mapping state; returns the bytes absorbed. `dst` must not be in a pool set.
    fn try_merge_blocks(&mut self, dst: u32, src: u32) -> u64 {
        if src == NONE {
            return 0;
        }
        let s = &self.blocks[src];
        if s.allocated || s.pending_free || s.mapped != self.blocks[dst].mapped {
            return 0;
        }
        if s.mapped {
            self.erase_from_blocks(src);
        } else {
            self.erase_unmapped(src);
        }
        self.merge_blocks(dst, src)
    }

    /// `release_available_cached_blocks`: with `max_split_size` set, frees one cached oversize
    /// segment big enough for the request, or else the largest ones until enough was freed.
    fn release_available_cached_blocks(&mut self, p: &AllocParams) -> bool {
        let max_split_size = self.config.max_split_size;
        if max_split_size == u64::MAX {
            return false;
        }
        let key_size = p.size.max(max_split_size);
        let pool = self.pool_ref(p.pool);
        if let Some(found) = pool.blocks.at_least(p.stream, key_size).next()
            && found.stream == p.stream
            && !self.blocks[found.id].is_expandable()
        {
            let id = found.id;
            self.release_block(id);
            return true;
        }
        // No single block is large enough: free oversize blocks, largest first.
        let mut released = 0u64;
        let mut victims = Vec::new();
        for key in pool.blocks.below(p.stream, key_size) {
            if released >= key_size || key.size < max_split_size || key.stream != p.stream {
                break;
            }
            if !self.blocks[key.id].is_expandable() {
                released += key.size;
                victims.push(key.id);
            }
        }
        for id in victims {
            self.release_block(id);
        }
        released >= key_size
    }

    /// `release_cached_blocks` for the default pools.
    fn release_cached_blocks(&mut self) -> bool {
        self.synchronize_and_free_events();
        self.release_blocks(Pool::Large);
        self.release_blocks(Pool::Small);
        true
    }

    /// `synchronize_and_free_events`: every pending cross-stream free completes.
    fn synchronize_and_free_events(&mut self) {
        self.stats.num_sync_all_streams += 1;
        for id in std::mem::take(&mut self.pending_frees) {
            self.blocks[id].pending_free = false;
            self.free_block(id);
        }
    }

    /// `release_blocks`: frees every free block that is a whole segment, in pool order, then
    /// unmaps the free pages of expandable segments.
    fn release_blocks(&mut self, pool: Pool) {
        let mut whole_segments = Vec::new();
        let mut to_unmap = Vec::new();
        for key in self.pool_ref(pool).blocks.iter() {
            let block = &self.blocks[key.id];
            if block.is_expandable() {
                to_unmap.push(key.id);
            } else if !block.is_split() {
                whole_segments.push(key.id);
            }
        }
        for id in whole_segments {
            self.release_block(id);
        }
        for id in to_unmap {
            self.unmap_block(id);
            let block = &self.blocks[id];
            if !block.is_split() && !block.mapped {
                self.release_expandable_segment(id);
            }
        }
    }

    /// `release_block`: `cudaFree` of a whole free segment.
    fn release_block(&mut self, id: u32) {
        let (ptr, size, stream, small) = {
            let b = &self.blocks[id];
            debug_assert!(!b.is_expandable() && !b.is_split() && !b.allocated);
            (b.ptr, b.size, b.stream, b.pool.is_small())
        };
        self.stats.num_device_free += 1;
        self.log(SegmentAction::Free, ptr, size, stream);
        self.address_space.release(ptr);
        self.total_allocated_memory -= size;
        self.stats.segment.decrease(small, 1);
        self.stats.reserved_bytes.decrease(small, size);
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
        self.erase_from_blocks(id);
        self.blocks.remove(id);
    }

    /// `unmap_block`: unmaps the whole pages inside a free block of an expandable segment; the
    /// partial pages at either end stay mapped as free blocks of their own.
    fn unmap_block(&mut self, id: u32) {
        let (ptr, size, stream, pool, segment) = {
            let b = &self.blocks[id];
            (b.ptr, b.size, b.stream, b.pool, b.expandable)
        };
        let unmapped = self.expandable(segment).pages_to_unmap(ptr, size);
        if unmapped.size == 0 {
            return;
        }
        self.erase_from_blocks(id);
        let before_size = unmapped.ptr - ptr;
        if before_size > 0 {
            let before =
                self.blocks
                    .insert(free_block_in(segment, ptr, before_size, stream, pool, true));
            let prev = self.blocks[id].prev;
            self.splice(before, prev, id);
            self.insert_into_blocks(before);
        }
        let after_size = size - (before_size + unmapped.size);
        if after_size > 0 {
            let after_ptr = unmapped.ptr + unmapped.size;
            let after = self.blocks.insert(free_block_in(
                segment, after_ptr, after_size, stream, pool, true,
            ));
            let next = self.blocks[id].next;
            self.splice(after, id, next);
            self.insert_into_blocks(after);
        }
        let block = &mut self.blocks[id];
        block.ptr = unmapped.ptr;
        block.size = unmapped.size;
        block.mapped = false;
        let prev = block.prev;
        self.try_merge_blocks(id, prev);
        let next = self.blocks[id].next;
        self.try_merge_blocks(id, next);
        self.insert_unmapped(id);

        self.total_allocated_memory -= unmapped.size;
        self.stats
            .reserved_bytes
            .decrease(pool.is_small(), unmapped.size);
        self.stats.num_device_free += 1;
        self.log(SegmentAction::Unmap, unmapped.ptr, unmapped.size, stream);
    }

    /// `release_expandable_segment`: the whole reservation is unmapped and free.
    fn release_expandable_segment(&mut self, id: u32) {
        let segment = self.blocks[id].expandable;
        self.erase_unmapped(id);
        self.blocks.remove(id);
        if let Some(released) = self.expandable_segments[segment as usize].take() {
            self.address_space.release(released.base);
        }
    }

    /// `find_expandable_block`: the lowest address of this stream's expandable segment where
    /// free and unmapped space add up to `size`, or a new segment's whole reservation (`None`
    /// when no addresses are left for one).
    fn find_expandable_block(&mut self, stream: u32, pool: Pool, size: u64) -> Option<u32> {
        let allocatable =
            |id: u32| id != NONE && !self.blocks[id].allocated && !self.blocks[id].pending_free;
        let start = AddressKey {
            stream,
            ptr: 0,
            id: 0,
        };
        for key in self.pool_ref(pool).unmapped.range(start..) {
            if key.stream != stream {
                break;
            }
            let mut candidate = key.id;
            // A free mapped block right before the unmapped range can be part of the answer.
            let prev = self.blocks[candidate].prev;
            if allocatable(prev) {
                candidate = prev;
            }
            let mut bytes = 0;
            let mut b = candidate;
            while bytes < size && allocatable(b) {
                bytes += self.blocks[b].size;
                b = self.blocks[b].next;
            }
            if bytes >= size {
                return Some(candidate);
            }
        }
        let (page_size, mut pages) = self.expandable_geometry(pool);
        if self.capacity.is_none() {
            // A device without a limit has room for any request: its reservation is sized to
            // hold it, as a device large enough would reserve 1 1/8 of itself.
            pages = pages.max(size.div_ceil(page_size));
        }
        let base = self
            .address_space
            .reserve_virtual(pages.checked_mul(page_size)?)?;
        let index = self.expandable_segments.len() as u32;
        self.expandable_segments.push(Some(ExpandableSegment {
            base,
            page_size,
            pages,
        }));
        let reservation = self.expandable(index).size();
        let id = self
            .blocks
            .insert(free_block_in(index, base, reservation, stream, pool, false));
        self.insert_unmapped(id);
        Some(id)
    }

    /// The `ExpandableSegment` constructor's geometry for a pool: the page size
    /// (`segment_size_`: `kSmallBuffer` for the small pool, `large_segment_size` for the large
    /// one) and the pages reserved (`max_handles_`).
    pub(crate) fn expandable_geometry(&self, pool: Pool) -> (u64, u64) {
        let page_size = if pool.is_small() {
            SMALL_BUFFER
        } else {
            self.config.large_segment_size
        };
        let device_total = self.capacity.unwrap_or(UNBOUNDED_DEVICE_TOTAL);
        // "enough address space for 1 1/8 the total memory on the GPU"
        let pages = device_total
            .saturating_add(device_total / 8)
            .div_ceil(page_size);
        (page_size, pages)
    }

    /// `map_block`: maps the pages covering the first `size` bytes of the unmapped block `id`.
    fn map_block(&mut self, id: u32, size: u64) -> bool {
        let (ptr, block_size, stream, pool, segment) = {
            let b = &self.blocks[id];
            (b.ptr, b.size, b.stream, b.pool, b.expandable)
        };
        let mapped = self.expandable(segment).pages_to_map(ptr, size);
        if mapped.size == 0 || !self.fits(mapped.size) {
            return false;
        }
        self.erase_unmapped(id);
        self.blocks[id].mapped = true;
        if mapped.size < block_size {
            let rest = free_block_in(
                segment,
                ptr + mapped.size,
                block_size - mapped.size,
                stream,
                pool,
                false,
            );
            let remaining = self.blocks.insert(rest);
            let next = self.blocks[id].next;
            self.splice(remaining, id, next);
            self.insert_unmapped(remaining);
            self.blocks[id].size = mapped.size;
        }
        let prev = self.blocks[id].prev;
        self.try_merge_blocks(id, prev);
        let next = self.blocks[id].next;
        self.try_merge_blocks(id, next);
        self.insert_into_blocks(id);

        self.total_allocated_memory += mapped.size;
        self.stats
            .reserved_bytes
            .increase(pool.is_small(), mapped.size);
        self.stats.num_device_alloc += 1;
        self.log(SegmentAction::Map, mapped.ptr, mapped.size, stream);
        true
    }

    /// `try_allocate_expandable_block`: maps pages at the lowest possible address until a
    /// free block of `size` bytes exists, and takes it out of the pool.
    fn try_allocate_expandable_block(&mut self, stream: u32, pool: Pool, size: u64) -> Option<u32> {
        let mut candidate = self.find_expandable_block(stream, pool, size)?;
        if !self.blocks[candidate].mapped {
            let first = self.blocks[candidate].size.min(size);
            if !self.map_block(candidate, first) {
                return None;
            }
        }
        while self.blocks[candidate].size < size {
            // free -> unmapped -> ...: map part of the unmapped block, which absorbs the free one.
            let remaining = size - self.blocks[candidate].size;
            let next = self.blocks[candidate].next;
            if next == NONE {
                return None;
            }
            let to_map = remaining.min(self.blocks[next].size);
            if !self.map_block(next, to_map) {
                return None;
            }
            candidate = next;
        }
        self.erase_from_blocks(candidate);
        Some(candidate)
    }

    // ----- restoring a recorded state ----------------------------------------------------

    /// Recreates a `cudaMalloc` segment as a snapshot shows it: `blocks` tile it from
    /// `address` upward, each allocated (`Some(requested)`) or free. Stats move as if the
    /// blocks had been allocated; no segment event is logged. Adjacent free blocks are merged.
    pub(crate) fn restore_segment_blocks(
        &mut self,
        address: u64,
        stream: u32,
        pool: Pool,
        blocks: &[(u64, Option<u64>)],
    ) -> Option<Vec<BlockId>> {
        let total = blocks
            .iter()
            .try_fold(0u64, |sum, (size, _)| sum.checked_add(*size))?;
        if total == 0
            || blocks.iter().any(|(size, _)| *size == 0)
            || !self.address_space.claim(address, total)
        {
            return None;
        }
        let small = pool.is_small();
        self.total_allocated_memory += total;
        self.stats.segment.increase(small, 1);
        self.stats.reserved_bytes.increase(small, total);
        if total >= self.config.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        let mut allocated = Vec::new();
        let mut free_ids = Vec::new();
        let mut tiling = Tiling {
            segment: NONE,
            stream,
            pool,
            ptr: address,
            prev: NONE,
        };
        self.restore_tiles(&mut tiling, blocks, &mut allocated, &mut free_ids);
        for id in free_ids {
            self.insert_into_blocks(id);
            if self.blocks[id].is_split() {
                self.stats.inactive_split.increase(small, 1);
                self.stats
                    .inactive_split_bytes
                    .increase(small, self.blocks[id].size);
            }
        }
        Some(allocated)
    }

    /// Lays `blocks` out from `tiling.ptr`, linked after `tiling.prev`: allocated ones are
    /// counted, a free one merges into a free mapped predecessor (no two free neighbours),
    /// the others are listed in `free_ids` for their pool.
    fn restore_tiles(
        &mut self,
        tiling: &mut Tiling,
        blocks: &[(u64, Option<u64>)],
        allocated: &mut Vec<BlockId>,
        free_ids: &mut Vec<u32>,
    ) {
        let small = tiling.pool.is_small();
        for &(size, requested) in blocks {
            let prev = tiling.prev;
            let prev_free_mapped =
                prev != NONE && self.blocks[prev].mapped && !self.blocks[prev].allocated;
            if requested.is_none() && prev_free_mapped {
                self.blocks[prev].size += size;
                tiling.ptr += size;
                continue;
            }
            let block = free_block_in(
                tiling.segment,
                tiling.ptr,
                size,
                tiling.stream,
                tiling.pool,
                true,
            );
            let id = self.blocks.insert(block);
            self.splice(id, prev, NONE);
            if let Some(requested) = requested {
                self.restore_allocated(id, requested, small);
                allocated.push(BlockId(id));
            } else {
                free_ids.push(id);
            }
            tiling.prev = id;
            tiling.ptr += size;
        }
    }

    /// Marks a restored block allocated, counted as `alloc_found_block` counts it.
    fn restore_allocated(&mut self, id: u32, requested: u64, small: bool) {
        let b = &mut self.blocks[id];
        b.allocated = true;
        b.requested_size = requested;
        let size = b.size;
        self.stats.allocation.increase(small, 1);
        self.stats.allocated_bytes.increase(small, size);
        self.stats.active.increase(small, 1);
        self.stats.active_bytes.increase(small, size);
        self.stats.requested_bytes.increase(small, requested);
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.increase(1);
        }
    }

    /// Recreates an `ExpandableSegment` as a recorded state implies it: the reservation
    /// starts at `base`; each of `ranges` (address, blocks) is mapped, a whole number of pages
    /// from `base` in ascending order, and tiled by its blocks, allocated (`Some(requested)`)
    /// or free; the rest of the reservation is unmapped. The block list is then what
    /// `find_expandable_block`, `map_block` and `try_merge_blocks` leave: one chain over the
    /// reservation, free mapped blocks in `blocks`, unmapped ranges in `unmapped`, no two
    /// free neighbours in the same mapping state. Stats move as `map_block` and
    /// `alloc_found_block` move them (reserved bytes, not the `segment` count); nothing is
    /// logged.
    ///
    /// The reservation is the constructor's (1 1/8 of the device) cut short at `limit` and at
    /// the next range already in use: a recorded device's size may be unknown here, but the
    /// addresses it used for other segments are not.
    pub(crate) fn restore_expandable_blocks(
        &mut self,
        base: u64,
        limit: Option<u64>,
        stream: u32,
        pool: Pool,
        ranges: &[(u64, BlockLayout)],
    ) -> Result<Vec<BlockId>, RestoreError> {
        let (page_size, pages) = self.expandable_geometry(pool);
        let mut mapped_end = base;
        let mut mapped_total = 0u64;
        for (address, blocks) in ranges {
            let size = blocks
                .iter()
                .try_fold(0u64, |sum, (size, _)| sum.checked_add(*size))
                .ok_or(RestoreError::Empty)?;
            if size == 0 || blocks.iter().any(|(size, _)| *size == 0) {
                return Err(RestoreError::Empty);
            }
            let end = address.checked_add(size).ok_or(RestoreError::Empty)?;
            if *address < mapped_end
                || !(address - base).is_multiple_of(page_size)
                || !size.is_multiple_of(page_size)
            {
                return Err(RestoreError::NotWholePages {
                    address: *address,
                    size,
                    page_size,
                });
            }
            mapped_end = end;
            mapped_total += size;
        }
        let wanted = pages
            .saturating_mul(page_size)
            .min(limit.map_or(u64::MAX, |l| l.saturating_sub(base)));
        let reserved = self.address_space.free_extent(base, wanted) / page_size * page_size;
        if reserved == 0 || base + reserved < mapped_end {
            return Err(RestoreError::Overlaps {
                address: base,
                size: mapped_end.max(base + page_size) - base,
            });
        }
        let claimed = self.address_space.claim(base, reserved);
        debug_assert!(claimed);
        let index = self.expandable_segments.len() as u32;
        self.expandable_segments.push(Some(ExpandableSegment {
            base,
            page_size,
            pages: reserved / page_size,
        }));

        let small = pool.is_small();
        let mut allocated = Vec::new();
        let mut free_ids = Vec::new();
        let mut unmapped_ids = Vec::new();
        let mut ptr = base;
        let mut prev = NONE;
        let unmapped_to = |this: &mut Self, ptr: u64, end: u64, prev: u32, ids: &mut Vec<u32>| {
            let id = this
                .blocks
                .insert(free_block_in(index, ptr, end - ptr, stream, pool, false));
            this.splice(id, prev, NONE);
            ids.push(id);
            id
        };
        for (address, blocks) in ranges {
            if *address > ptr {
                prev = unmapped_to(self, ptr, *address, prev, &mut unmapped_ids);
                ptr = *address;
            }
            let mut tiling = Tiling {
                segment: index,
                stream,
                pool,
                ptr,
                prev,
            };
            self.restore_tiles(&mut tiling, blocks, &mut allocated, &mut free_ids);
            (ptr, prev) = (tiling.ptr, tiling.prev);
        }
        if ptr < base + reserved {
            unmapped_to(self, ptr, base + reserved, prev, &mut unmapped_ids);
        }
        for id in free_ids {
            self.insert_into_blocks(id);
        }
        for id in unmapped_ids {
            self.insert_unmapped(id);
        }
        self.total_allocated_memory += mapped_total;
        self.stats.reserved_bytes.increase(small, mapped_total);
        Ok(allocated)
    }
}

/// A free block of an expandable segment (or of a plain segment when `segment` is `NONE`).
fn free_block_in(
    segment: u32,
    ptr: u64,
    size: u64,
    stream: u32,
    pool: Pool,
    mapped: bool,
) -> Block {
    Block {
        ptr,
        size,
        requested_size: 0,
        stream,
        pool,
        allocated: false,
        pending_free: false,
        mapped,
        prev: NONE,
        next: NONE,
        expandable: segment,
    }
}

fn apply_delta(stat: &mut crate::stats::StatArray, small: bool, delta: i64) {
    if delta > 0 {
        stat.increase(small, delta as u64);
    } else if delta < 0 {
        stat.decrease(small, delta.unsigned_abs());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unlimited_expandable_allocator_serves_a_request_above_its_default_reservation() {
        let config = AllocatorConfig {
            expandable_segments: true,
            ..AllocatorConfig::default()
        };
        let mut alloc = CachingAllocator::new(config, None);
        let small = alloc.malloc(1 << 30, 0).expect("1 GiB");
        let huge = 3 * UNBOUNDED_DEVICE_TOTAL;
        let block = alloc
            .malloc(huge, 0)
            .expect("no limit: no out-of-memory error");
        assert!(alloc.block_size(block) >= huge);
        alloc.free(block);
        alloc.free(small);
        assert_eq!(alloc.stats().allocated_bytes.all.current, 0);
    }

    #[test]
    fn running_out_of_addresses_is_an_out_of_memory_error_not_a_corrupt_pool() {
        let mut alloc = CachingAllocator::new(AllocatorConfig::default(), None);
        let mut blocks = Vec::new();
        let mut error = None;
        for _ in 0..64 {
            match alloc.malloc(1 << 59, 0) {
                Ok(block) => blocks.push(block),
                Err(e) => {
                    error = Some(e);
                    break;
                }
            }
        }
        assert!(matches!(error, Some(OutOfMemory::Device(_))), "{error:?}");
        for block in blocks {
            alloc.free(block);
        }
        assert_eq!(alloc.stats().allocated_bytes.all.current, 0);
        let again = alloc
            .malloc(1 << 59, 0)
            .expect("a cached segment serves it");
        alloc.free(again);
    }

    #[test]
    fn a_limited_expandable_allocator_still_refuses_what_exceeds_the_device() {
        let config = AllocatorConfig {
            expandable_segments: true,
            ..AllocatorConfig::default()
        };
        let mut alloc = CachingAllocator::new(config, Some(80 << 30));
        assert!(matches!(
            alloc.malloc(81 << 30, 0),
            Err(OutOfMemory::Device(_))
        ));
    }
}
