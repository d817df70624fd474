//! Replay of the shared fixture through the simulator. The expected peaks are not the
//! simulator's own output: they are what the run measured with torch.cuda.max_memory_*
//! (`snapshot-actor-ref-manual-offload.json`: train1 peak_reserved 32470204416,
//! peak_allocated 30981537792), and the recorded event counts come from the trace itself.

use headroom_alloc::AllocatorConfig;
use headroom_snapshot::{Action, ReplayOptions, load, replay};

use crate::common::shared_fixture as fixture;

#[test]
fn fixture_replays_every_segment_event_and_the_measured_peaks() {
    let snap = load(&fixture()).unwrap();
    let report = replay(&snap, &ReplayOptions::default());
    assert_eq!(report.recorded_segment_events, 1172 + 860);
    assert!(
        report.fidelity >= 0.99,
        "fidelity {} ({:?})",
        report.fidelity,
        report.first_divergence
    );
    assert_eq!(report.simulated_peak_reserved_bytes, 32_470_204_416);
    assert_eq!(report.recorded_peak_reserved_bytes, 32_470_204_416);
    assert_eq!(report.simulated_peak_allocated_bytes, 30_981_537_792);
    assert_eq!(
        report.simulated_final_reserved_bytes,
        report.recorded_final_reserved_bytes
    );
    assert_eq!(report.unmatched_frees, 0);
    // Two empty_cache() per iteration (after actor.cpu() and after ref.cpu()), three iterations.
    assert_eq!(report.cache_flushes, 6);
}

#[test]
fn what_if_expandable_segments() {
    let snap = load(&fixture()).unwrap();
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let report = replay(
        &snap,
        &ReplayOptions {
            config: Some(config),
            device: None,
            ..ReplayOptions::default()
        },
    );
    // The calls are the same, so allocated bytes cannot exceed what the default allocator
    // handed out by more than rounding; reserved memory tiles into pages instead of segments.
    assert!(report.simulated_peak_reserved_bytes > 0);
    assert!(report.simulated_peak_reserved_bytes < report.recorded_peak_reserved_bytes);
    assert!(report.simulated_peak_allocated_bytes <= 30_981_537_792);
    assert_eq!(report.unmatched_frees, 0);
    assert!(
        snap.device_traces[0]
            .iter()
            .all(|e| e.action != Action::SegmentMap),
        "the fixture ran without expandable segments"
    );
}
