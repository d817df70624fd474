//! Where new segments land. Addresses only matter to break ties between equal-size free
//! blocks (best fit orders by stream, size, then address), so what must be right is the order
//! of the segments of one pool alive together, not the addresses themselves. A caller that
//! knows the address the real allocator got (replay of a recorded trace) passes it as a hint.
//!
//! Without a hint, placement follows the order the CUDA driver gives on the H100 and H200
//! with torch 2.11, read from the `segment_alloc` addresses of every snapshot in `bench/`
//! (`bench/addresses.md`):
//! - a large-pool segment (`cudaMalloc` of more than 2 MiB) goes below every range in use: of
//!   the pairs (new segment, large segment alive on its stream) 87% have the new one lower
//!   (median 94% per snapshot); the rest come from the first segments of a process, which
//!   ascend inside the driver's first reservation, and from sizes the driver puts in a
//!   region of their own;
//! - a small-pool segment (2 MiB) goes above every range in use: 80% of its pairs ascend, the
//!   driver filling its 2 MiB pieces upward;
//! - an expandable segment's reservation (`cuMemAddressReserve`) goes above every range too
//!   (the small pool's reservation lies below the large pool's, made after it); one per stream
//!   and pool holds every block, so its place decides no tie.
//!
//! Replayed without their addresses, 72 of the 76 snapshots then reach the peak reserved they
//! reach with them (65 with every segment placed above the last; pythia-1.4b's eager forward,
//! for one, then reserves 11% less than measured).

/// Placement starts at 2^61: `cudaMalloc` segments go down from there, reservations up, and
/// end by 2^62, far beyond any device's memory; reserved bytes stay below 2^62, within the
/// allocator's `i64` statistics.
const DEFAULT_START: u64 = 1 << 61;
const DEFAULT_END: u64 = 1 << 62;
/// `cudaMalloc` results are at least 2 MiB aligned for allocator-sized requests, and a
/// small-pool segment is one such piece.
const ALIGNMENT: u64 = 2 << 20;

#[derive(Default)]
pub(crate) struct AddressSpace {
    /// Occupied ranges (start, end exclusive), by start. A sorted vector rather than an
    /// ordered map: default placement only ever goes below or above every range (an insert at
    /// either end), and a simulation reserves thousands of segments but releases few.
    occupied: Vec<(u64, u64)>,
    hint: Option<u64>,
}

impl AddressSpace {
    pub(crate) fn new() -> Self {
        AddressSpace::default()
    }

    /// The next reservation goes to `address` if that range is free.
    pub(crate) fn set_hint(&mut self, address: u64) {
        self.hint = Some(address);
    }

    pub(crate) fn clear_hint(&mut self) {
        self.hint = None;
    }

    /// Reserves `size` bytes for a `cudaMalloc` segment and returns the start: a small-pool
    /// segment above every range in use, a larger one below; `None` when no addresses are left.
    pub(crate) fn reserve(&mut self, size: u64) -> Option<u64> {
        if let Some(start) = self.take_hint(size) {
            return Some(start);
        }
        if size <= ALIGNMENT {
            return self.above(size);
        }
        let lowest = self
            .occupied
            .first()
            .map_or(DEFAULT_START, |&(s, _)| s.min(DEFAULT_START));
        let start = lowest.checked_sub(size)? / ALIGNMENT * ALIGNMENT;
        if start == 0 {
            return None;
        }
        self.occupy(start, start + size);
        Some(start)
    }

    /// Reserves `size` bytes of virtual addresses (`cuMemAddressReserve`, an expandable
    /// segment) above every range in use and returns the start; `None` when no addresses are
    /// left.
    pub(crate) fn reserve_virtual(&mut self, size: u64) -> Option<u64> {
        self.take_hint(size).or_else(|| self.above(size))
    }

    fn take_hint(&mut self, size: u64) -> Option<u64> {
        let hint = self.hint.take().filter(|&hint| self.is_free(hint, size))?;
        self.occupy(hint, hint + size);
        Some(hint)
    }

    fn above(&mut self, size: u64) -> Option<u64> {
        let highest = self
            .occupied
            .last()
            .map_or(DEFAULT_START, |&(_, e)| e.max(DEFAULT_START));
        let start = highest.div_ceil(ALIGNMENT) * ALIGNMENT;
        let end = start.checked_add(size).filter(|&end| end <= DEFAULT_END)?;
        self.occupy(start, end);
        Some(start)
    }

    /// Marks a range the caller already knows is in use (restored segments).
    pub(crate) fn claim(&mut self, start: u64, size: u64) -> bool {
        if !self.is_free(start, size) {
            return false;
        }
        self.occupy(start, start + size);
        true
    }

    /// How many bytes from `start` on are free, at most `max` (0 when `start` is in use).
    pub(crate) fn free_extent(&self, start: u64, max: u64) -> u64 {
        // The range that starts last at or before `start` must end by it.
        let upto = self.occupied.partition_point(|&(s, _)| s <= start);
        if upto > 0 && self.occupied[upto - 1].1 > start {
            return 0;
        }
        let from = self.occupied.partition_point(|&(s, _)| s < start);
        let next = self.occupied.get(from).map_or(u64::MAX, |&(s, _)| s);
        max.min(next - start)
    }

    pub(crate) fn release(&mut self, start: u64) {
        if let Ok(i) = self.occupied.binary_search_by_key(&start, |&(s, _)| s) {
            self.occupied.remove(i);
        }
    }

    /// Marks the free range `start..end` occupied, in order (at either end, mostly).
    fn occupy(&mut self, start: u64, end: u64) {
        let at = self.occupied.partition_point(|&(s, _)| s < start);
        self.occupied.insert(at, (start, end));
    }

    fn is_free(&self, start: u64, size: u64) -> bool {
        let Some(end) = start.checked_add(size) else {
            return false;
        };
        // The range that starts last before `end` must end by `start`.
        let before = self.occupied.partition_point(|&(s, _)| s < end);
        before == 0 || self.occupied[before - 1].1 <= start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn each_large_segment_goes_below_every_range_in_use() {
        let mut space = AddressSpace::new();
        let first = space.reserve(20 * MIB).unwrap();
        let second = space.reserve(32 * MIB).unwrap();
        assert!(second + 32 * MIB <= first);
        space.release(second);
        // Below the first again, whether or not the freed range is reused.
        let third = space.reserve(24 * MIB).unwrap();
        assert!(third + 24 * MIB <= first);
        assert_eq!(third % ALIGNMENT, 0);
    }

    #[test]
    fn large_segments_go_below_restored_ones() {
        let mut space = AddressSpace::new();
        let recorded = 0x7fd0_9e00_0000;
        assert!(space.claim(recorded, 198 * MIB));
        let new = space.reserve(20 * MIB).unwrap();
        assert!(new + 20 * MIB <= recorded);
    }

    #[test]
    fn small_segments_and_reservations_go_above_every_range() {
        let mut space = AddressSpace::new();
        let large = space.reserve(20 * MIB).unwrap();
        let small = space.reserve(2 * MIB).unwrap();
        let next_small = space.reserve(2 * MIB).unwrap();
        let reservation = space.reserve_virtual(1 << 40).unwrap();
        assert!(large + 20 * MIB <= small);
        assert!(small + 2 * MIB <= next_small);
        assert!(next_small + 2 * MIB <= reservation);
    }

    #[test]
    fn a_free_hint_wins_and_a_taken_one_falls_back() {
        let mut space = AddressSpace::new();
        space.set_hint(0x7f00_0000_0000);
        assert_eq!(space.reserve(20 * MIB), Some(0x7f00_0000_0000));
        space.set_hint(0x7f00_0000_0000);
        let fallback = space.reserve(20 * MIB).unwrap();
        assert!(fallback + 20 * MIB <= 0x7f00_0000_0000);
    }

    #[test]
    fn addresses_run_out_instead_of_overflowing() {
        let mut space = AddressSpace::new();
        assert_eq!(space.reserve(DEFAULT_START + ALIGNMENT), None);
        assert_eq!(space.reserve_virtual(DEFAULT_END - DEFAULT_START + 1), None);
        assert!(space.reserve(DEFAULT_START - ALIGNMENT).is_some());
        assert_eq!(space.reserve(4 * MIB), None);
    }
}
