//! Which pages of each expandable segment were mapped when a trace began.
//!
//! A snapshot lists an expandable segment once per contiguous mapped range
//! (`DeviceCachingAllocator::snapshot` skips a block whose `prev` is mapped), and the trace
//! records every `map_block` (`segment_map`) and `unmap_block` (`segment_unmap`) with the
//! pages' address and size. So the mapped pages at the first entry are the final ranges with
//! the trace undone backwards: a mapped range was unmapped before its `segment_map`, an
//! unmapped one mapped before its `segment_unmap`. Pages mapped before recording started and
//! never touched by the trace (the harness's `torch.zeros(1)` maps the small pool's first
//! page) show up as final pages that no `segment_map` accounts for.
//!
//! What the file does not say is filled in as follows.
//! - **Which reservation.** `find_expandable_block` keeps one reservation per (stream, pool)
//!   and only reserves another when no unmapped range of the stream has room, which with
//!   1 1/8 of the device per reservation does not happen in practice; so every mapped range
//!   and event of a (stream, pool) is taken to belong to one reservation. Final ranges carry
//!   their pool (`segment_type`). An event's pool follows from its size where it can: a
//!   small-pool `map_block` always maps exactly one 2 MiB page (requests are at most 1 MiB),
//!   and large-pool maps and unmaps are whole large pages (20 MiB unless
//!   `large_segment_size_mb` says otherwise). Where both fit (a small-pool unmap of a multiple
//!   of 20 MiB), the event belongs to the reservation with the highest known address at or
//!   below its own, since reservations do not overlap.
//! - **The base.** Allocation maps the lowest free address of the reservation first, so its
//!   lowest known address is taken as its start (`ptr_`).
//! - **The end.** The reservation is 1 1/8 of the device, whose size the snapshot does not
//!   record; it cannot reach the next address known to belong to something else, which is
//!   passed on as a limit.
//!
//! A reservation whose events contradict each other (pages mapped twice, addresses not whole
//! pages from the base) is not rebuilt.

use std::collections::{BTreeMap, BTreeSet};

use crate::SMALL_SEGMENT_SIZE;
use crate::model::{Action, Snapshot, TraceEvent};

/// An expandable segment as it was when the trace began.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct InitialExpandable {
    /// The recorded `cudaStream_t`.
    pub stream: u64,
    pub is_large: bool,
    /// Start of the reservation.
    pub base: u64,
    /// The reservation ends at or before this address.
    pub limit: Option<u64>,
    /// Mapped ranges at the first entry, `(address, bytes)`, in address order, neither
    /// overlapping nor touching.
    pub mapped: Vec<(u64, u64)>,
}

/// What [`initial_expandable`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ExpandableStart {
    /// Reservations with at least one page mapped at the first entry.
    pub segments: Vec<InitialExpandable>,
    /// Mapped ranges of the snapshot in reservations that could not be rebuilt.
    pub inconsistent_ranges: usize,
}

/// (stream, is_large).
type Group = (u64, bool);

/// A map or unmap of the trace.
#[derive(Clone, Copy)]
struct PageEvent {
    map: bool,
    addr: u64,
    size: u64,
    stream: u64,
}

/// The mapped pages of every expandable segment of `device` at the first entry of `trace`.
/// `large_page` is the large pool's page size (`large_segment_size`).
pub(crate) fn initial_expandable(
    snapshot: &Snapshot,
    device: usize,
    trace: &[TraceEvent],
    large_page: u64,
) -> ExpandableStart {
    let small_page = SMALL_SEGMENT_SIZE;
    let page_of = |is_large: bool| if is_large { large_page } else { small_page };

    // Final mapped ranges, per reservation.
    let mut finals: BTreeMap<Group, Vec<(u64, u64)>> = BTreeMap::new();
    // Addresses known to belong to something else than a given reservation: cudaMalloc
    // segments, and (below) the other reservations.
    let mut plain: Vec<u64> = Vec::new();
    for s in snapshot
        .segments
        .iter()
        .filter(|s| s.device as usize == device)
    {
        if s.is_expandable {
            finals
                .entry((s.stream, s.is_large))
                .or_default()
                .push((s.address, s.total_size));
        } else {
            plain.push(s.address);
        }
    }
    let events: Vec<PageEvent> = trace
        .iter()
        .filter_map(|e| match e.action {
            Action::SegmentMap | Action::SegmentUnmap => Some(PageEvent {
                map: e.action == Action::SegmentMap,
                addr: e.addr,
                size: e.size,
                stream: e.stream,
            }),
            Action::SegmentAlloc | Action::SegmentFree => {
                plain.push(e.addr);
                None
            }
            _ => None,
        })
        .collect();

    // Which reservation each event belongs to: by size where only one pool fits, else by
    // address among what is known so far.
    let mut known: BTreeMap<Group, BTreeSet<u64>> = finals
        .iter()
        .map(|(g, ranges)| (*g, ranges.iter().map(|r| r.0).collect()))
        .collect();
    let mut group_of: Vec<Option<Group>> = vec![None; events.len()];
    let mut ambiguous = Vec::new();
    let mut inconsistent_groups: BTreeSet<Group> = BTreeSet::new();
    for (i, e) in events.iter().enumerate() {
        let small = e.size.is_multiple_of(small_page) && (!e.map || e.size == small_page);
        let large = e.size.is_multiple_of(large_page);
        match (small, large) {
            (true, false) | (false, true) => {
                let g = (e.stream, large);
                group_of[i] = Some(g);
                known.entry(g).or_default().insert(e.addr);
            }
            (true, true) => ambiguous.push(i),
            // Neither pool's pages: the stream's reservations cannot be trusted.
            (false, false) => {
                inconsistent_groups.insert((e.stream, false));
                inconsistent_groups.insert((e.stream, true));
            }
        }
    }
    for i in ambiguous {
        let e = events[i];
        let below = |g: Group| known.get(&g).and_then(|a| a.range(..=e.addr).next_back());
        let above = |g: Group| known.get(&g).and_then(|a| a.range(e.addr..).next());
        let (small, large) = ((e.stream, false), (e.stream, true));
        let is_large = match (below(small), below(large)) {
            (Some(s), Some(l)) => l > s,
            (Some(_), None) => false,
            (None, Some(_)) => true,
            (None, None) => match (above(small), above(large)) {
                (Some(s), Some(l)) => l < s,
                (Some(_), None) => false,
                _ => true,
            },
        };
        let g = (e.stream, is_large);
        group_of[i] = Some(g);
        known.entry(g).or_default().insert(e.addr);
    }

    let mut start = ExpandableStart::default();
    for (&group, addresses) in &known {
        let final_ranges = finals.get(&group).map_or(&[][..], |v| v.as_slice());
        let Some(&base) = addresses.first() else {
            continue;
        };
        let page = page_of(group.1);
        let mapped = if inconsistent_groups.contains(&group) {
            None
        } else {
            let group_events = events
                .iter()
                .zip(&group_of)
                .filter(|(_, g)| **g == Some(group))
                .map(|(e, _)| *e);
            pages_at_start(base, page, final_ranges, group_events)
        };
        let Some(mapped) = mapped else {
            start.inconsistent_ranges += final_ranges.len();
            continue;
        };
        if mapped.is_empty() {
            continue;
        }
        let limit = known
            .iter()
            .filter(|(g, _)| **g != group)
            .flat_map(|(_, a)| a.range(base + 1..).next())
            .chain(plain.iter().filter(|a| **a > base))
            .min()
            .copied();
        start.segments.push(InitialExpandable {
            stream: group.0,
            is_large: group.1,
            base,
            limit,
            mapped,
        });
    }
    start
}

/// The mapped ranges of one reservation at the first entry: its final ranges with `events`
/// undone from the last to the first. `None` when an address or size is not whole pages from
/// `base`, or the events do not fit the final state (a page mapped twice, or unmapped while
/// not mapped).
fn pages_at_start(
    base: u64,
    page: u64,
    final_ranges: &[(u64, u64)],
    events: impl DoubleEndedIterator<Item = PageEvent>,
) -> Option<Vec<(u64, u64)>> {
    let pages_of = |addr: u64, size: u64| {
        let whole = addr >= base && (addr - base).is_multiple_of(page) && size.is_multiple_of(page);
        whole.then(|| {
            let first = (addr - base) / page;
            first..first + size / page
        })
    };
    let mut mapped: BTreeSet<u64> = BTreeSet::new();
    for &(addr, size) in final_ranges {
        for p in pages_of(addr, size)? {
            if !mapped.insert(p) {
                return None;
            }
        }
    }
    for e in events.rev() {
        for p in pages_of(e.addr, e.size)? {
            // Before a map the page was unmapped; before an unmap it was mapped.
            let consistent = if e.map {
                mapped.remove(&p)
            } else {
                mapped.insert(p)
            };
            if !consistent {
                return None;
            }
        }
    }
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for p in mapped {
        let addr = base + p * page;
        match ranges.last_mut() {
            Some((start, size)) if *start + *size == addr => *size += page,
            _ => ranges.push((addr, page)),
        }
    }
    Some(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn ev(map: bool, addr: u64, size: u64) -> PageEvent {
        PageEvent {
            map,
            addr,
            size,
            stream: 0,
        }
    }

    #[test]
    fn pages_no_map_accounts_for_were_mapped_before() {
        // Final: pages 0-11 of a small reservation; the trace mapped pages 1-11.
        let base = 0x3_0200_0000;
        let events: Vec<PageEvent> = (1..12)
            .map(|p| ev(true, base + p * 2 * MIB, 2 * MIB))
            .collect();
        let start = pages_at_start(base, 2 * MIB, &[(base, 24 * MIB)], events.into_iter());
        assert_eq!(start, Some(vec![(base, 2 * MIB)]));
    }

    #[test]
    fn unmaps_undone_map_pages_again() {
        // Pages 0-3 mapped before; the trace unmapped 1-2 and mapped 1 again: final 0, 1, 3.
        let base = 1 << 30;
        let page = 20 * MIB;
        let events = [
            ev(false, base + page, 2 * page),
            ev(true, base + page, page),
        ];
        let start = pages_at_start(
            base,
            page,
            &[(base, 2 * page), (base + 3 * page, page)],
            events.into_iter(),
        );
        assert_eq!(start, Some(vec![(base, 4 * page)]));
    }

    #[test]
    fn contradictions_are_not_rebuilt() {
        let base = 1 << 30;
        let page = 20 * MIB;
        // A map of pages that are not mapped at the end and never unmapped.
        assert_eq!(
            pages_at_start(base, page, &[], [ev(true, base, page)].into_iter()),
            None
        );
        // Not whole pages from the base.
        assert_eq!(
            pages_at_start(base, page, &[(base + MIB, page)], std::iter::empty()),
            None
        );
    }
}
