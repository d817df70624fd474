//! Replaying a snapshot's trace through the allocator simulator.
//!
//! Every recorded `alloc` becomes a `malloc` of the recorded (unrounded) size on the recorded
//! stream, every `free_completed` a `free` of the block that `alloc` got. The simulator's
//! segment events (`segment_alloc/free/map/unmap`, action and size) are then compared with the
//! recorded ones.
//!
//! - **Fidelity** is the length of the longest common subsequence of the two event lists
//!   divided by the number of recorded events: the share of recorded segment events the
//!   simulator reproduces, in order. A missing or extra event costs one match and the replay
//!   re-synchronises after it, unlike a position-by-position comparison where one early
//!   difference would condemn everything after it. The first position where the two lists
//!   differ is reported separately.
//! - **Traces that begin mid-run.** The ring buffer keeps only the newest entries, and recording
//!   may start after the model was loaded. The state at the first entry is rebuilt before the
//!   replay: segments freed in the trace without being allocated in it, and segments of the
//!   snapshot never allocated in it, existed at the start; blocks freed without an alloc, and
//!   allocated blocks of the snapshot no alloc accounts for, were live. Sizes of blocks still
//!   live at the snapshot are exact; for the others the request is rounded with `round_size`
//!   and, in the large pool, a gap of at most 1 MiB to the next live block is added to the
//!   block, because such a gap cannot be a block of its own (every large-pool block is over
//!   1 MiB) and so was the unsplit remainder.
//! - **Expandable segments** are rebuilt page by page (`mapped_pages`): the snapshot lists
//!   each contiguous mapped range, and undoing the trace's `segment_map`/`segment_unmap`
//!   from the last to the first leaves the pages mapped at the first entry (pages mapped
//!   before recording began, such as the small-pool page of a harness's `torch.zeros(1)`, are
//!   the ones no `segment_map` accounts for). Each (stream, pool) gets one reservation from
//!   its lowest known address, mapped ranges tiled by their live blocks and free space,
//!   everything else unmapped, as `find_expandable_block` and `map_block` would have left it.
//!   Blocks there are exactly their rounded size: with expandable segments every remainder of
//!   512 bytes or more is split off.
//! - **`empty_cache`.** A recorded run of `segment_free`/`segment_unmap` is a cache flush:
//!   `torch.cuda.empty_cache()`, or the flush before an OOM retry. Either releases the same
//!   segments, so the simulator flushes its cache where such a run starts; a flush inside an
//!   OOM retry is followed by the retried `cudaMalloc`, which the next `alloc` reproduces.
//! - **Addresses.** Each recorded `segment_alloc`/`segment_map` address is passed to the
//!   simulator as a hint for the segment it is about to create, so that best-fit ties between
//!   equal-size blocks break by the same addresses as on the device.
//! - **`--alloc-conf` what-ifs** replay the same calls, flushes included, under another config.

use std::collections::HashMap;

use headroom_alloc::{
    AllocatorConfig, BlockId, CachingAllocator, Pool, RestoredBlock, RestoredRange, SMALL_SIZE,
    SegmentAction,
};

use crate::address_map::{AddressMap, AddressSet};
use crate::lcs::lcs_len;
use crate::mapped_pages::initial_expandable;
use crate::model::{Action, AllocatorSettings, BlockState, Snapshot, TraceEvent};

/// What to replay.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// The allocator config to replay under; `None`: the one the snapshot recorded.
    pub config: Option<AllocatorConfig>,
    /// The device whose trace to replay; `None`: the one with the most trace entries.
    pub device: Option<usize>,
    /// Place new segments as the simulator does for a run it predicts, instead of at the
    /// recorded `cudaMalloc` addresses (the state before the first entry keeps its addresses).
    pub ignore_addresses: bool,
}

/// A segment event reduced to what is compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentStep {
    pub action: Action,
    pub size: u64,
}

/// Where the simulated events first differ from the recorded ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Divergence {
    /// Position in the list of segment events.
    pub segment_event_index: usize,
    /// Index of the recorded event in the device trace, if the recorded list had one there.
    pub trace_index: Option<usize>,
    pub expected: Option<SegmentStep>,
    pub got: Option<SegmentStep>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ReplayReport {
    pub device: usize,
    pub config: AllocatorConfig,
    pub trace_events: usize,
    pub recorded_segment_events: usize,
    pub simulated_segment_events: usize,
    /// Recorded segment events reproduced in order (the longest common subsequence).
    pub matched_segment_events: usize,
    /// `matched / recorded` (1 when both lists are empty).
    pub fidelity: f64,
    /// `false` when the lists differ so much that `matched` is a lower bound.
    pub fidelity_exact: bool,
    pub first_divergence: Option<Divergence>,
    /// Reserved bytes at the start of the trace.
    pub initial_reserved_bytes: u64,
    pub recorded_peak_reserved_bytes: u64,
    pub simulated_peak_reserved_bytes: u64,
    pub recorded_final_reserved_bytes: u64,
    pub simulated_final_reserved_bytes: u64,
    pub simulated_peak_allocated_bytes: u64,
    /// Segments (mapped ranges, for expandable segments) and live blocks rebuilt before the
    /// first entry.
    pub restored_segments: usize,
    pub restored_blocks: usize,
    /// Segments that existed before the trace but could not be rebuilt (overlapping, or mapped
    /// ranges of an expandable segment whose events contradict each other): the replay runs
    /// without them.
    pub unrestored_segments: usize,
    /// Cache flushes inferred from runs of segment frees.
    pub cache_flushes: usize,
    /// Frees of addresses the replay has no block for.
    pub unmatched_frees: usize,
    /// Allocations the simulator refused (never, without a capacity).
    pub failed_allocs: usize,
    /// Recorded and simulated reserved bytes over the trace, at most [`REPLAY_POINTS`] points.
    pub timeline: Vec<ReplayPoint>,
}

/// Points of [`ReplayReport::timeline`] at most.
pub const REPLAY_POINTS: usize = 400;

/// A run of trace entries: the most each series reached over it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayPoint {
    /// The run's last trace entry.
    pub event_index: usize,
    pub recorded_reserved_bytes: u64,
    pub simulated_reserved_bytes: u64,
    pub simulated_allocated_bytes: u64,
}

/// The allocator config a snapshot recorded: its settings string, with the fields
/// `allocator_settings` reports taking precedence (they are the values in force).
pub fn config_from_settings(settings: &AllocatorSettings) -> AllocatorConfig {
    let mut config = AllocatorConfig::parse(&settings.conf).unwrap_or_default();
    config.expandable_segments = settings.expandable_segments;
    config.max_split_size = u64::try_from(settings.max_split_size).unwrap_or(u64::MAX);
    for &(mib, divisions) in &settings.roundup_power2_divisions {
        if mib.is_power_of_two() {
            let index =
                (mib.trailing_zeros() as usize).min(config.roundup_power2_divisions.len() - 1);
            config.roundup_power2_divisions[index] = divisions;
        }
    }
    config
}

/// Replays the trace of one device.
pub fn replay(snapshot: &Snapshot, options: &ReplayOptions) -> ReplayReport {
    let device = options.device.unwrap_or_else(|| busiest_device(snapshot));
    let empty = Vec::new();
    let trace = snapshot.device_traces.get(device).unwrap_or(&empty);
    let config = options.config.clone().unwrap_or_else(|| {
        snapshot
            .allocator_settings
            .as_ref()
            .map(config_from_settings)
            .unwrap_or_default()
    });
    let streams = StreamIds::new(snapshot, device, trace);

    let mut sim = CachingAllocator::new(config.clone(), None);
    let mut blocks: AddressMap<BlockId> = AddressMap::default();
    blocks.reserve(trace.len() / 8);
    let initial = restore_initial_state(&mut sim, snapshot, device, trace, &streams, &mut blocks);
    sim.reset_peak_stats();
    sim.record_segment_events(true);

    let mut recorded: Vec<(SegmentStep, usize)> = Vec::new();
    let mut pending: AddressMap<BlockId> = AddressMap::default();
    let (mut flushes, mut unmatched, mut failed) = (0, 0, 0);
    let mut reserved = initial.reserved;
    let mut peak_reserved = reserved;
    let mut in_flush = false;
    let bucket = trace.len().div_ceil(REPLAY_POINTS).max(1);
    let mut timeline: Vec<ReplayPoint> = Vec::with_capacity(REPLAY_POINTS);
    for (i, event) in trace.iter().enumerate() {
        let is_free_run = matches!(event.action, Action::SegmentFree | Action::SegmentUnmap);
        match event.action {
            Action::Alloc => match sim.malloc(event.size, streams.id(event.stream)) {
                Ok(block) => {
                    blocks.insert(event.addr, block);
                }
                Err(_) => failed += 1,
            },
            Action::FreeRequested => {
                // Normally free_completed follows at once; a gap means record_stream, and the
                // block waits, active, until its free_completed (or a flush).
                let completes_now = trace.get(i + 1).is_some_and(|next| {
                    next.action == Action::FreeCompleted && next.addr == event.addr
                });
                if !completes_now && let Some(block) = blocks.remove(&event.addr) {
                    sim.free_requested(block);
                    pending.insert(event.addr, block);
                }
            }
            Action::FreeCompleted => {
                if let Some(block) = pending.remove(&event.addr) {
                    sim.complete_free(block);
                } else if let Some(block) = blocks.remove(&event.addr) {
                    sim.free(block);
                } else {
                    unmatched += 1;
                }
            }
            Action::SegmentAlloc | Action::SegmentMap if !options.ignore_addresses => {
                sim.set_address_hint(event.addr)
            }
            Action::SegmentFree | Action::SegmentUnmap if !in_flush => {
                sim.empty_cache();
                pending.clear();
                flushes += 1;
            }
            _ => {}
        }
        in_flush = is_free_run;
        if event.action.is_segment_event() {
            recorded.push((
                SegmentStep {
                    action: event.action,
                    size: event.size,
                },
                i,
            ));
            reserved = apply_segment_event(reserved, event);
            peak_reserved = peak_reserved.max(reserved);
        }
        let stats = sim.stats();
        let point = ReplayPoint {
            event_index: i,
            recorded_reserved_bytes: reserved,
            simulated_reserved_bytes: stats.reserved_bytes.all.current as u64,
            simulated_allocated_bytes: stats.allocated_bytes.all.current as u64,
        };
        match timeline.last_mut() {
            Some(last) if i % bucket != 0 => {
                last.event_index = i;
                last.recorded_reserved_bytes = last
                    .recorded_reserved_bytes
                    .max(point.recorded_reserved_bytes);
                last.simulated_reserved_bytes = last
                    .simulated_reserved_bytes
                    .max(point.simulated_reserved_bytes);
                last.simulated_allocated_bytes = last
                    .simulated_allocated_bytes
                    .max(point.simulated_allocated_bytes);
            }
            _ => timeline.push(point),
        }
    }

    let simulated: Vec<SegmentStep> = sim
        .segment_events()
        .iter()
        .map(|e| SegmentStep {
            action: action_of(e.action),
            size: e.size,
        })
        .collect();
    let recorded_steps: Vec<SegmentStep> = recorded.iter().map(|(s, _)| *s).collect();
    let (matched, exact) = lcs_len(&step_keys(&recorded_steps), &step_keys(&simulated));
    let fidelity = if recorded_steps.is_empty() {
        if simulated.is_empty() { 1.0 } else { 0.0 }
    } else {
        matched as f64 / recorded_steps.len() as f64
    };
    let first_divergence = (0..recorded_steps.len().max(simulated.len()))
        .find(|&i| recorded_steps.get(i) != simulated.get(i))
        .map(|i| Divergence {
            segment_event_index: i,
            trace_index: recorded.get(i).map(|(_, t)| *t),
            expected: recorded_steps.get(i).copied(),
            got: simulated.get(i).copied(),
        });
    let stats = sim.stats();
    ReplayReport {
        device,
        config,
        trace_events: trace.len(),
        recorded_segment_events: recorded_steps.len(),
        simulated_segment_events: simulated.len(),
        matched_segment_events: matched,
        fidelity,
        fidelity_exact: exact,
        first_divergence,
        initial_reserved_bytes: initial.reserved,
        recorded_peak_reserved_bytes: peak_reserved,
        simulated_peak_reserved_bytes: stats.reserved_bytes.all.peak as u64,
        recorded_final_reserved_bytes: reserved,
        simulated_final_reserved_bytes: stats.reserved_bytes.all.current as u64,
        simulated_peak_allocated_bytes: stats.allocated_bytes.all.peak as u64,
        restored_segments: initial.segments,
        restored_blocks: initial.blocks,
        unrestored_segments: initial.unrestored,
        cache_flushes: flushes,
        unmatched_frees: unmatched,
        failed_allocs: failed,
        timeline,
    }
}

/// Segment steps as single integers (size and action packed), so that the LCS compares words.
fn step_keys(steps: &[SegmentStep]) -> Vec<u128> {
    steps
        .iter()
        .map(|s| (u128::from(s.size) << 4) | s.action as u128)
        .collect()
}

fn busiest_device(snapshot: &Snapshot) -> usize {
    snapshot
        .device_traces
        .iter()
        .enumerate()
        .max_by_key(|(d, t)| (t.len(), std::cmp::Reverse(*d)))
        .map_or(0, |(d, _)| d)
}

fn action_of(action: SegmentAction) -> Action {
    match action {
        SegmentAction::Alloc => Action::SegmentAlloc,
        SegmentAction::Free => Action::SegmentFree,
        SegmentAction::Map => Action::SegmentMap,
        SegmentAction::Unmap => Action::SegmentUnmap,
    }
}

fn apply_segment_event(reserved: u64, event: &TraceEvent) -> u64 {
    match event.action {
        Action::SegmentAlloc | Action::SegmentMap => reserved.saturating_add(event.size),
        _ => reserved.saturating_sub(event.size),
    }
}

/// Recorded `cudaStream_t` values mapped to the simulator's dense ids, in the same order, so
/// that the (stream, size, address) order of free blocks is the device's.
struct StreamIds(HashMap<u64, u32>);

impl StreamIds {
    fn new(snapshot: &Snapshot, device: usize, trace: &[TraceEvent]) -> Self {
        let mut values: Vec<u64> = trace.iter().map(|e| e.stream).collect();
        values.extend(
            snapshot
                .segments
                .iter()
                .filter(|s| s.device as usize == device)
                .map(|s| s.stream),
        );
        values.sort_unstable();
        values.dedup();
        StreamIds(
            values
                .into_iter()
                .enumerate()
                .map(|(i, v)| (v, i as u32))
                .collect(),
        )
    }

    fn id(&self, stream: u64) -> u32 {
        self.0.get(&stream).copied().unwrap_or(0)
    }
}

struct InitialState {
    reserved: u64,
    segments: usize,
    blocks: usize,
    unrestored: usize,
}

/// A segment that existed when the trace began.
struct InitialSegment {
    address: u64,
    size: u64,
    stream: u64,
    is_large: bool,
    is_expandable: bool,
}

/// A block live when the trace began: `size` is known when the block is still live at the
/// snapshot.
struct InitialBlock {
    address: u64,
    requested: u64,
    size: Option<u64>,
}

fn restore_initial_state(
    sim: &mut CachingAllocator,
    snapshot: &Snapshot,
    device: usize,
    trace: &[TraceEvent],
    streams: &StreamIds,
    blocks: &mut AddressMap<BlockId>,
) -> InitialState {
    let mut segments: Vec<InitialSegment> = Vec::new();
    let mut live: Vec<InitialBlock> = Vec::new();
    let mut opened_segments = AddressSet::default();
    let mut opened_blocks = AddressSet::default();
    for e in trace {
        match e.action {
            Action::SegmentAlloc => {
                opened_segments.insert(e.addr);
            }
            Action::SegmentFree if !opened_segments.remove(&e.addr) => {
                segments.push(InitialSegment {
                    address: e.addr,
                    size: e.size,
                    stream: e.stream,
                    is_large: e.size != headroom_alloc::SMALL_BUFFER,
                    is_expandable: false,
                })
            }
            Action::Alloc => {
                opened_blocks.insert(e.addr);
            }
            Action::FreeCompleted if !opened_blocks.remove(&e.addr) => {
                live.push(InitialBlock {
                    address: e.addr,
                    requested: e.size,
                    size: None,
                });
            }
            _ => {}
        }
    }
    for s in snapshot
        .segments
        .iter()
        .filter(|s| s.device as usize == device)
    {
        // Expandable segments are rebuilt page by page below.
        if !s.is_expandable && !opened_segments.contains(&s.address) {
            segments.push(InitialSegment {
                address: s.address,
                size: s.total_size,
                stream: s.stream,
                is_large: s.is_large,
                is_expandable: false,
            });
        }
        for b in &s.blocks {
            if b.state == BlockState::ActiveAllocated && !opened_blocks.contains(&b.address) {
                live.push(InitialBlock {
                    address: b.address,
                    requested: b.requested_size,
                    size: Some(b.size),
                });
            }
        }
    }
    segments.sort_by_key(|s| s.address);
    live.sort_by_key(|b| b.address);
    // The live blocks inside [address, address + size).
    let live_in = |address: u64, size: u64| {
        let first = live.partition_point(|b| b.address < address);
        let end = live.partition_point(|b| b.address < address.saturating_add(size));
        &live[first..end]
    };

    let mut state = InitialState {
        reserved: 0,
        segments: 0,
        blocks: 0,
        unrestored: 0,
    };
    for segment in &segments {
        let layout = segment_layout(
            sim.config(),
            segment,
            live_in(segment.address, segment.size),
        );
        let pool = if segment.is_large {
            Pool::Large
        } else {
            Pool::Small
        };
        match sim.restore_segment(
            segment.address,
            streams.id(segment.stream),
            pool,
            &layout.blocks,
        ) {
            Ok(ids) => {
                for (address, id) in layout.live_addresses.iter().zip(ids) {
                    blocks.insert(*address, id);
                }
                state.reserved = state.reserved.saturating_add(segment.size);
                state.segments += 1;
                state.blocks += layout.live_addresses.len();
            }
            Err(_) => state.unrestored += 1,
        }
    }

    let large_page = sim.expandable_page_size(Pool::Large);
    let expandable = initial_expandable(snapshot, device, trace, large_page);
    state.unrestored += expandable.inconsistent_ranges;
    for es in &expandable.segments {
        let mut ranges = Vec::new();
        let mut live_addresses = Vec::new();
        for &(address, size) in &es.mapped {
            let range = InitialSegment {
                address,
                size,
                stream: es.stream,
                is_large: es.is_large,
                is_expandable: true,
            };
            let layout = segment_layout(sim.config(), &range, live_in(address, size));
            live_addresses.extend(layout.live_addresses);
            ranges.push(RestoredRange {
                address,
                blocks: layout.blocks,
            });
        }
        let pool = if es.is_large {
            Pool::Large
        } else {
            Pool::Small
        };
        match sim.restore_expandable_segment(
            es.base,
            es.limit,
            streams.id(es.stream),
            pool,
            &ranges,
        ) {
            Ok(ids) => {
                for (address, id) in live_addresses.iter().zip(ids) {
                    blocks.insert(*address, id);
                }
                let mapped = es.mapped.iter().map(|r| r.1).sum::<u64>();
                state.reserved = state.reserved.saturating_add(mapped);
                state.segments += es.mapped.len();
                state.blocks += live_addresses.len();
            }
            Err(_) => state.unrestored += es.mapped.len(),
        }
    }
    state
}

struct Layout {
    blocks: Vec<RestoredBlock>,
    live_addresses: Vec<u64>,
}

/// Tiles a segment with its live blocks and the free gaps between them.
fn segment_layout(
    config: &AllocatorConfig,
    segment: &InitialSegment,
    live: &[InitialBlock],
) -> Layout {
    let end = segment.address.saturating_add(segment.size);
    let mut layout = Layout {
        blocks: Vec::new(),
        live_addresses: Vec::new(),
    };
    let mut cursor = segment.address;
    for (i, block) in live.iter().enumerate() {
        if block.address < cursor {
            continue; // overlaps the previous block: corrupt, skip it
        }
        let next_start = live.get(i + 1).map_or(end, |b| b.address.min(end));
        let size = block.size.unwrap_or_else(|| {
            let rounded = headroom_alloc::round_size(config, block.requested);
            let gap = next_start.saturating_sub(block.address.saturating_add(rounded));
            if segment.is_large && !segment.is_expandable && gap <= SMALL_SIZE {
                rounded + gap
            } else {
                rounded
            }
        });
        if block.address.saturating_add(size) > end {
            continue;
        }
        if block.address > cursor {
            layout.blocks.push(RestoredBlock {
                size: block.address - cursor,
                requested: None,
            });
        }
        layout.blocks.push(RestoredBlock {
            size,
            requested: Some(block.requested),
        });
        layout.live_addresses.push(block.address);
        cursor = block.address.saturating_add(size);
    }
    if cursor < end {
        layout.blocks.push(RestoredBlock {
            size: end - cursor,
            requested: None,
        });
    }
    layout
}
