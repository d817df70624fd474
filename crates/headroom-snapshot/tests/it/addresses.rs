//! Replay without the recorded `cudaMalloc` addresses (`bench/addresses.md`): the same calls
//! run, only best-fit ties may break differently. pythia-1.4b's eager forward (H100) is the
//! snapshot where that matters most: with its addresses the replay reserves what the run
//! measured with `torch.cuda.max_memory_reserved()` (`bench/trace/unseen`).

use std::path::PathBuf;

use headroom_snapshot::{ReplayOptions, load, replay};

#[test]
fn ignoring_addresses_replays_the_same_calls() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../bench/trace/unseen/snapshots/pythia-eager-fwd.pickle.gz");
    let snapshot = load(&path).unwrap();
    let with = replay(&snapshot, &ReplayOptions::default());
    let without = replay(
        &snapshot,
        &ReplayOptions {
            ignore_addresses: true,
            ..ReplayOptions::default()
        },
    );
    assert_eq!(with.recorded_peak_reserved_bytes, 18_773_704_704);
    assert_eq!(with.simulated_peak_reserved_bytes, 18_773_704_704);
    assert_eq!(
        without.simulated_peak_allocated_bytes,
        with.simulated_peak_allocated_bytes
    );
    assert_eq!((without.failed_allocs, without.unmatched_frees), (0, 0));
    assert!(without.fidelity >= 0.98, "fidelity {}", without.fidelity);
}
