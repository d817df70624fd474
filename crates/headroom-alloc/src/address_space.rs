//! Where new segments land. A real device hands out addresses the simulator cannot predict;
//! addresses only matter to break ties between equal-size free blocks. By default segments
//! are placed one after another far above any real CUDA address; a caller that knows the
//! address the real allocator got (replay of a recorded trace) passes it as a hint so that
//! ties break the same way. The driver's order (`bench/addresses.md`): a large segment mostly
//! lands below every segment alive, 2 MiB ones above; placing segments that way makes 72 of 76
//! snapshots replay without their addresses to the recorded peak (65 as placed here), but
//! moves one measured row past its 8% bound, so it is not the placement yet.

/// Default placement starts at 2^48, above the 47-bit user addresses CUDA returns on Linux,
/// so default ranges never collide with hinted (recorded) ones.
const DEFAULT_BASE: u64 = 1 << 48;
/// Default placement ends at 2^62: a device runs out of addresses there (`cudaMalloc` fails),
/// so reserved bytes stay below 2^62 and fit the allocator's `i64` statistics.
const DEFAULT_END: u64 = 1 << 62;
/// `cudaMalloc` results are at least 2 MiB aligned for allocator-sized requests.
const ALIGNMENT: u64 = 2 << 20;

#[derive(Default)]
pub(crate) struct AddressSpace {
    /// Occupied ranges (start, end exclusive), by start. A sorted vector rather than an
    /// ordered map: default placement only ever goes above every range (a push), and a
    /// simulation reserves thousands of segments but releases few.
    occupied: Vec<(u64, u64)>,
    next_default: u64,
    hint: Option<u64>,
}

impl AddressSpace {
    pub(crate) fn new() -> Self {
        AddressSpace {
            occupied: Vec::new(),
            next_default: DEFAULT_BASE,
            hint: None,
        }
    }

    /// The next reservation goes to `address` if that range is free.
    pub(crate) fn set_hint(&mut self, address: u64) {
        self.hint = Some(address);
    }

    pub(crate) fn clear_hint(&mut self) {
        self.hint = None;
    }

    /// Reserves `size` bytes (`cudaMalloc` or `cuMemAddressReserve`) and returns the start;
    /// `None` when no addresses are left.
    pub(crate) fn reserve(&mut self, size: u64) -> Option<u64> {
        if let Some(hint) = self.hint.take()
            && self.is_free(hint, size)
        {
            self.occupy(hint, hint + size);
            return Some(hint);
        }
        let start = self.next_default;
        let end = start.checked_add(size).filter(|&end| end <= DEFAULT_END)?;
        self.next_default = end.div_ceil(ALIGNMENT) * ALIGNMENT;
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

    /// Marks the free range `start..end` occupied, in order (at the end, mostly).
    fn occupy(&mut self, start: u64, end: u64) {
        let at = match self.occupied.last() {
            Some(&(last, _)) if last > start => self.occupied.partition_point(|&(s, _)| s < start),
            _ => self.occupied.len(),
        };
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
