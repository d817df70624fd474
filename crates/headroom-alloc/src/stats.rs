//! `DeviceStats`: what `torch.cuda.memory_stats()` reports, kept the way
//! `CUDACachingAllocator.cpp` keeps it.

/// One counter (`c10::CachingAllocator::Stat`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    /// Total ever added (saturating: a long run of huge requests can pass `i64::MAX`).
    pub allocated: i64,
    /// Total ever removed (saturating).
    pub freed: i64,
}

impl Stat {
    pub(crate) fn increase(&mut self, amount: u64) {
        self.current += amount as i64;
        self.peak = self.peak.max(self.current);
        self.allocated = self.allocated.saturating_add(amount as i64);
    }

    pub(crate) fn decrease(&mut self, amount: u64) {
        self.current -= amount as i64;
        debug_assert!(self.current >= 0, "negative allocator stat (logic error)");
        self.freed = self.freed.saturating_add(amount as i64);
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// A counter kept for all pools together and for each default pool (`StatArray` indexed by
/// `StatType::{AGGREGATE, SMALL_POOL, LARGE_POOL}`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    pub all: Stat,
    pub small_pool: Stat,
    pub large_pool: Stat,
}

impl StatArray {
    /// `for_each_selected_stat_type(get_stat_types_for_pool(pool), increase)`.
    pub(crate) fn increase(&mut self, small: bool, amount: u64) {
        self.all.increase(amount);
        self.pool_mut(small).increase(amount);
    }

    pub(crate) fn decrease(&mut self, small: bool, amount: u64) {
        self.all.decrease(amount);
        self.pool_mut(small).decrease(amount);
    }

    fn pool_mut(&mut self, small: bool) -> &mut Stat {
        if small {
            &mut self.small_pool
        } else {
            &mut self.large_pool
        }
    }

    fn reset_peak(&mut self) {
        self.all.reset_peak();
        self.small_pool.reset_peak();
        self.large_pool.reset_peak();
    }
}

/// `DeviceStats`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Number of allocated blocks.
    pub allocation: StatArray,
    /// Number of `cudaMalloc` segments (expandable segments do not count here, as in PyTorch).
    pub segment: StatArray,
    /// Number of active blocks: allocated, or freed but waiting for other streams.
    pub active: StatArray,
    /// Number of free blocks inside segments that also hold active blocks (not counted for
    /// expandable segments).
    pub inactive_split: StatArray,
    /// `memory_allocated()`: sizes of allocated blocks (rounded, possibly unsplit).
    pub allocated_bytes: StatArray,
    /// `memory_reserved()`: bytes obtained from the device (segments and mapped pages).
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    /// Bytes the callers asked for, before rounding.
    pub requested_bytes: StatArray,
    /// `cudaMalloc` attempts after a full cache flush.
    pub num_alloc_retries: u64,
    /// Allocations that failed after the flush.
    pub num_ooms: u64,
    /// Blocks of at least `max_split_size` handed out.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size` obtained.
    pub oversize_segments: Stat,
    /// `synchronize_and_free_events` calls (every cache flush).
    pub num_sync_all_streams: u64,
    /// `cudaMalloc` calls plus page mappings.
    pub num_device_alloc: u64,
    /// `cudaFree` calls plus page unmappings.
    pub num_device_free: u64,
    /// `max_split_size` in bytes, `-1` when unlimited (as in snapshots).
    pub max_split_size: i64,
}

impl Stats {
    pub(crate) fn new(max_split_size: u64) -> Self {
        Stats {
            max_split_size: i64::try_from(max_split_size).unwrap_or(-1),
            ..Stats::default()
        }
    }

    /// `resetPeakStats`.
    pub(crate) fn reset_peak(&mut self) {
        for s in [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ] {
            s.reset_peak();
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }
}
