//! The shared fixture: a real `_dump_snapshot` of a 3-iteration actor/ref run (torch 2.11,
//! H200). Expected values come from `bench/allocator/memory_viz_reference.py`, an independent
//! Python re-implementation of `_memory_viz.segsum` and `MemoryViz.js process_alloc_data`
//! run on the same file; `allocated_bytes` is also the measured `end_allocated` of the run's
//! last phase (`snapshot-actor-ref-manual-offload.json`).

use headroom_snapshot::{SummaryOptions, load, summarize};

use crate::common::shared_fixture as fixture;

#[test]
fn reads_the_fixture() {
    let snap = load(&fixture()).unwrap();
    assert_eq!(snap.segments.len(), 313);
    assert_eq!(snap.device_traces.len(), 1);
    assert_eq!(snap.device_traces[0].len(), 74673);
    assert_eq!(snap.annotation_count, 12);
    let settings = snap.allocator_settings.as_ref().unwrap();
    assert_eq!(settings.conf, "");
    assert_eq!(settings.max_split_size, -1);
    assert!(!settings.expandable_segments);
    assert_eq!(settings.roundup_power2_divisions.len(), 16);
    // First entry: alloc of 4 bytes from site-packages/torch/utils/_device.py:116.
    let first = snap.device_traces[0][0];
    assert_eq!(first.addr, 0x7f47b7e00000);
    assert_eq!(first.size, 4);
    let top = snap.frames.stack(first.frames).next().unwrap();
    assert_eq!(
        (top.filename, top.line, top.name),
        (
            "site-packages/torch/utils/_device.py",
            116,
            "__torch_function__"
        )
    );
}

#[test]
fn summary_matches_memory_viz() {
    let snap = load(&fixture()).unwrap();
    let s = summarize(&snap, SummaryOptions::default());
    // segsum
    assert_eq!(s.segments.total, 313);
    assert_eq!(s.reserved_bytes, 32_470_204_416);
    assert_eq!(s.requested_bytes, 18_593_810_948);
    assert_eq!(s.fragmentation.internal_free_bytes, 5_768_188);
    assert_eq!(s.fragmentation.external_free_bytes, 13_870_625_280);
    // block sums
    assert_eq!(s.allocated_bytes, 18_599_579_136);
    assert_eq!(s.active_bytes, 18_599_579_136);
    assert_eq!(s.fragmentation.free_bytes, 13_870_625_280);
    assert_eq!(s.fragmentation.largest_free_block_bytes, 2_489_319_424);
    assert_eq!(s.segments.large + s.segments.small, 313);
    // Active Memory Timeline
    let t = s.trace.unwrap();
    assert_eq!(t.events, 74673);
    assert_eq!(t.peak_active_bytes, 30_943_525_384);
    assert_eq!(t.initially_active_bytes, 0);
    assert_eq!(t.counts.alloc, 24895);
    assert_eq!(t.counts.free_completed, 23873);
    assert_eq!(t.counts.segment_alloc, 1172);
    assert_eq!(t.counts.segment_free, 860);
    // Reserved at the end of the trace is the snapshot's reserved.
    let last = t.timeline.last().unwrap();
    assert_eq!(last.event_index, 74672);
}
