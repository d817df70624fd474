//! What a snapshot says about memory, computed the way PyTorch's own viewers compute it:
//! `torch/cuda/_memory_viz.py` (`segsum`, the `stats` command) for the state at the snapshot
//! and `MemoryViz.js` (`process_alloc_data`, the Active Memory Timeline) for the trace.

use std::collections::HashMap;

use serde::Serialize;

use crate::address_map::AddressMap;

use crate::model::{Action, BlockState, NO_STACK, Snapshot, StackId};
use crate::sites::site_of;

/// How much detail [`summarize`] keeps.
#[derive(Clone, Copy, Debug)]
pub struct SummaryOptions {
    /// Points in the downsampled timeline.
    pub timeline_points: usize,
    /// Allocation sites listed at the peak.
    pub top_sites: usize,
}

impl Default for SummaryOptions {
    fn default() -> Self {
        SummaryOptions {
            timeline_points: 200,
            top_sites: 10,
        }
    }
}

/// The memory state at the snapshot, over all devices.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// `memory_reserved()`: Σ segment sizes (`_memory_viz` `total_reserved`).
    pub reserved_bytes: u64,
    /// `memory_allocated()`: Σ sizes of allocated blocks.
    pub allocated_bytes: u64,
    /// Σ sizes of active blocks (allocated or awaiting a cross-stream free).
    pub active_bytes: u64,
    /// Σ requested sizes of allocated blocks (`_memory_viz` `total_allocated`).
    pub requested_bytes: u64,
    pub segments: SegmentCounts,
    pub fragmentation: Fragmentation,
    /// The `PYTORCH_CUDA_ALLOC_CONF` the snapshot recorded, if any.
    pub allocator_conf: Option<String>,
    /// The trace of the device with the most trace entries.
    pub trace: Option<TraceSummary>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentCounts {
    pub total: usize,
    pub large: usize,
    pub small: usize,
    pub expandable: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Fragmentation {
    /// `reserved - allocated`: what PyTorch's OOM message calls "reserved but unallocated".
    pub reserved_unallocated_bytes: u64,
    /// Σ sizes of inactive blocks.
    pub free_bytes: u64,
    pub largest_free_block_bytes: u64,
    /// `1 - largest free block / free bytes`: 0 when all free memory is one block.
    pub ratio: f64,
    /// `_memory_viz` "internal" free: rounding inside allocated blocks (size - requested).
    pub internal_free_bytes: u64,
    /// `_memory_viz` "external" free: blocks not allocated (inactive or awaiting free).
    pub external_free_bytes: u64,
}

/// One allocation site live at the peak.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Site {
    /// `file.py:LINE (function)` of the first frame outside torch internals.
    pub location: String,
    /// Σ requested bytes of its live allocations.
    pub bytes: u64,
    pub count: u64,
}

/// One point of the downsampled timeline: the maximum of each series over a run of events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TimelinePoint {
    /// Index of the last trace entry in the run.
    pub event_index: usize,
    pub time_us: i64,
    /// Active memory as `MemoryViz.js` plots it (Σ requested bytes).
    pub active_bytes: u64,
    /// Reserved memory (Σ segment and mapped bytes).
    pub reserved_bytes: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ActionCounts {
    pub alloc: usize,
    pub free_requested: usize,
    pub free_completed: usize,
    pub segment_alloc: usize,
    pub segment_free: usize,
    pub segment_map: usize,
    pub segment_unmap: usize,
    pub oom: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceSummary {
    pub device: usize,
    pub events: usize,
    pub counts: ActionCounts,
    /// Requested bytes live before the trace began (freed in the trace without an alloc in
    /// it, or still allocated at the snapshot and never allocated in it).
    pub initially_active_bytes: u64,
    /// `max_size` of `MemoryViz.js`'s Active Memory Timeline: the largest Σ requested bytes
    /// after any alloc or free.
    pub peak_active_bytes: u64,
    /// The trace entry at which the peak was first reached (`None`: no alloc or free in the
    /// trace, the peak is what was live before it).
    pub peak_event_index: Option<usize>,
    pub peak_time_us: Option<i64>,
    /// Reserved bytes at the start of the trace (from the snapshot's segments, undoing the
    /// trace's segment events).
    pub initial_reserved_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// The largest allocation sites live at the peak, by bytes.
    pub top_sites: Vec<Site>,
    pub timeline: Vec<TimelinePoint>,
}

/// Analyses a loaded snapshot.
pub fn summarize(snapshot: &Snapshot, options: SummaryOptions) -> Summary {
    let mut summary = Summary {
        reserved_bytes: 0,
        allocated_bytes: 0,
        active_bytes: 0,
        requested_bytes: 0,
        segments: SegmentCounts::default(),
        fragmentation: Fragmentation {
            reserved_unallocated_bytes: 0,
            free_bytes: 0,
            largest_free_block_bytes: 0,
            ratio: 0.0,
            internal_free_bytes: 0,
            external_free_bytes: 0,
        },
        allocator_conf: snapshot.allocator_settings.as_ref().map(|s| s.conf.clone()),
        trace: None,
    };
    for segment in &snapshot.segments {
        summary.reserved_bytes = summary.reserved_bytes.saturating_add(segment.total_size);
        summary.segments.total += 1;
        if segment.is_large {
            summary.segments.large += 1;
        } else {
            summary.segments.small += 1;
        }
        summary.segments.expandable += usize::from(segment.is_expandable);
        let frag = &mut summary.fragmentation;
        for block in &segment.blocks {
            match block.state {
                BlockState::ActiveAllocated => {
                    summary.allocated_bytes = summary.allocated_bytes.saturating_add(block.size);
                    summary.active_bytes = summary.active_bytes.saturating_add(block.size);
                    summary.requested_bytes =
                        summary.requested_bytes.saturating_add(block.requested_size);
                    frag.internal_free_bytes = frag
                        .internal_free_bytes
                        .saturating_add(block.size.saturating_sub(block.requested_size));
                }
                BlockState::ActivePendingFree => {
                    summary.active_bytes = summary.active_bytes.saturating_add(block.size);
                    frag.external_free_bytes = frag.external_free_bytes.saturating_add(block.size);
                }
                BlockState::Inactive => {
                    frag.free_bytes = frag.free_bytes.saturating_add(block.size);
                    frag.external_free_bytes = frag.external_free_bytes.saturating_add(block.size);
                    frag.largest_free_block_bytes = frag.largest_free_block_bytes.max(block.size);
                }
            }
        }
    }
    let frag = &mut summary.fragmentation;
    frag.reserved_unallocated_bytes = summary
        .reserved_bytes
        .saturating_sub(summary.allocated_bytes);
    if frag.free_bytes > 0 {
        frag.ratio = 1.0 - frag.largest_free_block_bytes as f64 / frag.free_bytes as f64;
    }
    let busiest = snapshot
        .device_traces
        .iter()
        .enumerate()
        .filter(|(_, t)| !t.is_empty())
        .max_by_key(|(d, t)| (t.len(), std::cmp::Reverse(*d)));
    summary.trace = busiest.map(|(device, _)| summarize_trace(snapshot, device, options));
    summary
}

/// An allocation on the Active Memory Timeline.
#[derive(Clone, Copy)]
struct Element {
    size: u64,
    stack: StackId,
}

fn summarize_trace(snapshot: &Snapshot, device: usize, options: SummaryOptions) -> TraceSummary {
    let trace = &snapshot.device_traces[device];
    let segments = || {
        snapshot
            .segments
            .iter()
            .filter(|s| s.device as usize == device)
    };

    // process_alloc_data: allocs open elements, frees close them; a free of an address not
    // open was live before the trace, as is every allocated block of the snapshot that no
    // alloc in the trace accounts for.
    let mut open: AddressMap<Element> = AddressMap::default();
    let mut initial: Vec<Element> = Vec::new();
    let mut counts = ActionCounts::default();
    let mut segment_delta: i128 = 0;
    for event in trace {
        match event.action {
            Action::Alloc => {
                counts.alloc += 1;
                open.insert(
                    event.addr,
                    Element {
                        size: event.size,
                        stack: event.frames,
                    },
                );
            }
            Action::FreeCompleted => {
                counts.free_completed += 1;
                if open.remove(&event.addr).is_none() {
                    initial.push(Element {
                        size: event.size,
                        stack: event.frames,
                    });
                }
            }
            Action::FreeRequested => counts.free_requested += 1,
            Action::SegmentAlloc => {
                counts.segment_alloc += 1;
                segment_delta += i128::from(event.size);
            }
            Action::SegmentMap => {
                counts.segment_map += 1;
                segment_delta += i128::from(event.size);
            }
            Action::SegmentFree => {
                counts.segment_free += 1;
                segment_delta -= i128::from(event.size);
            }
            Action::SegmentUnmap => {
                counts.segment_unmap += 1;
                segment_delta -= i128::from(event.size);
            }
            Action::Oom => counts.oom += 1,
            Action::Snapshot | Action::Other => {}
        }
    }
    let mut never_freed: Vec<(u64, Element)> = Vec::new();
    for segment in segments() {
        for block in &segment.blocks {
            if block.state == BlockState::ActiveAllocated && !open.contains_key(&block.address) {
                never_freed.push((
                    block.address,
                    Element {
                        size: block.requested_size,
                        stack: block.frames,
                    },
                ));
            }
        }
    }
    let initially_active_bytes = initial
        .iter()
        .chain(never_freed.iter().map(|(_, e)| e))
        .fold(0u64, |sum, e| sum.saturating_add(e.size));
    let final_reserved = segments().fold(0u64, |sum, s| sum.saturating_add(s.total_size));
    let initial_reserved = u64::try_from(i128::from(final_reserved) - segment_delta).unwrap_or(0);

    // Second pass: the series, the peak and the timeline.
    let mut active = initially_active_bytes;
    let mut reserved = initial_reserved;
    let mut peak_active = 0u64;
    let mut peak_index = None;
    let mut peak_reserved = initial_reserved;
    let points = options.timeline_points.max(1);
    let bucket = trace.len().div_ceil(points).max(1);
    let mut timeline: Vec<TimelinePoint> = Vec::with_capacity(points);
    let mut opened: AddressMap<u64> = AddressMap::default();
    for (i, event) in trace.iter().enumerate() {
        match event.action {
            Action::Alloc => {
                active = active.saturating_add(event.size);
                opened.insert(event.addr, event.size);
            }
            Action::FreeCompleted => {
                // Closing an element opened in the trace, or one live before it: either way
                // its size is the free's size, which MemoryViz takes from the alloc.
                let size = opened.remove(&event.addr).unwrap_or(event.size);
                active = active.saturating_sub(size);
            }
            Action::SegmentAlloc | Action::SegmentMap => {
                reserved = reserved.saturating_add(event.size)
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                reserved = reserved.saturating_sub(event.size)
            }
            _ => {}
        }
        if matches!(event.action, Action::Alloc | Action::FreeCompleted)
            && (peak_index.is_none() || active > peak_active)
        {
            peak_active = active;
            peak_index = Some(i);
        }
        peak_reserved = peak_reserved.max(reserved);
        let point = TimelinePoint {
            event_index: i,
            time_us: event.time_us,
            active_bytes: active,
            reserved_bytes: reserved,
        };
        if i % bucket == 0 {
            timeline.push(point);
        } else if let Some(last) = timeline.last_mut() {
            last.event_index = i;
            last.time_us = event.time_us;
            last.active_bytes = last.active_bytes.max(active);
            last.reserved_bytes = last.reserved_bytes.max(reserved);
        }
    }
    if peak_index.is_none() {
        peak_active = initially_active_bytes;
    }

    let top_sites = peak_index.map_or_else(
        || {
            rank_sites(
                snapshot,
                initial
                    .iter()
                    .chain(never_freed.iter().map(|(_, e)| e))
                    .copied(),
                options.top_sites,
            )
        },
        |peak| {
            rank_sites(
                snapshot,
                live_at(snapshot, device, peak, &initial, &never_freed),
                options.top_sites,
            )
        },
    );

    TraceSummary {
        device,
        events: trace.len(),
        counts,
        initially_active_bytes,
        peak_active_bytes: peak_active,
        peak_event_index: peak_index,
        peak_time_us: peak_index.map(|i| trace[i].time_us),
        initial_reserved_bytes: initial_reserved,
        peak_reserved_bytes: peak_reserved,
        top_sites,
        timeline,
    }
}

/// The elements live right after trace entry `peak`: those live before the trace and not yet
/// freed, plus those allocated up to `peak` and not yet freed.
fn live_at(
    snapshot: &Snapshot,
    device: usize,
    peak: usize,
    initial: &[Element],
    never_freed: &[(u64, Element)],
) -> impl Iterator<Item = Element> {
    let trace = &snapshot.device_traces[device];
    let mut open: AddressMap<Element> = AddressMap::default();
    let mut initial_freed = 0usize;
    for event in &trace[..=peak] {
        match event.action {
            Action::Alloc => {
                open.insert(
                    event.addr,
                    Element {
                        size: event.size,
                        stack: event.frames,
                    },
                );
            }
            Action::FreeCompleted => {
                initial_freed += usize::from(open.remove(&event.addr).is_none())
            }
            _ => {}
        }
    }
    // `initial` lists pre-trace elements in the order of their frees.
    let still_initial = initial[initial_freed.min(initial.len())..].to_vec();
    open.into_values()
        .chain(still_initial)
        .chain(never_freed.iter().map(|(_, e)| *e).collect::<Vec<_>>())
}

fn rank_sites(snapshot: &Snapshot, live: impl Iterator<Item = Element>, top: usize) -> Vec<Site> {
    let mut by_stack: HashMap<StackId, (u64, u64)> = HashMap::new();
    for e in live {
        let entry = by_stack.entry(e.stack).or_default();
        entry.0 = entry.0.saturating_add(e.size);
        entry.1 += 1;
    }
    let mut by_site: HashMap<String, (u64, u64)> = HashMap::new();
    for (stack, (bytes, count)) in by_stack {
        let site = if stack == NO_STACK {
            "<no stack recorded>".to_string()
        } else {
            site_of(&snapshot.frames, stack)
        };
        let entry = by_site.entry(site).or_default();
        entry.0 = entry.0.saturating_add(bytes);
        entry.1 += count;
    }
    let mut sites: Vec<Site> = by_site
        .into_iter()
        .map(|(location, (bytes, count))| Site {
            location,
            bytes,
            count,
        })
        .collect();
    sites.sort_by(|a, b| {
        b.bytes
            .cmp(&a.bytes)
            .then_with(|| a.location.cmp(&b.location))
    });
    sites.truncate(top);
    sites
}
