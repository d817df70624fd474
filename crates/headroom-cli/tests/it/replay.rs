//! `headroom replay` of a snapshot: the recorded addresses, or headroom's own placement of new
//! segments (`--ignore-addresses`), and what each reports.

use headroom_snapshot::{ReplayOptions, load, replay};

use crate::common::{bad_input, json, repo};

/// The DDP run whose 20 and 70 MiB segments the driver put in gaps of its address space, where
/// headroom's placement reserves more (bench/addresses.md).
const DDP: &str = "bench/distributed/h200x2/ddp-q15.pickle.gz";

#[test]
fn ignore_addresses_replays_with_headroom_placement_and_says_so() {
    let recorded = json(&["replay", DDP, "--json"]);
    let placed = json(&["replay", DDP, "--json", "--ignore-addresses"]);
    assert_eq!(recorded["ignore_addresses"], false);
    assert_eq!(placed["ignore_addresses"], true);
    assert_eq!(
        recorded["simulated_peak_reserved_bytes"],
        recorded["recorded_peak_reserved_bytes"]
    );

    let snapshot = load(&repo().join(DDP)).unwrap();
    let library = replay(
        &snapshot,
        &ReplayOptions {
            ignore_addresses: true,
            ..ReplayOptions::default()
        },
    );
    assert_eq!(
        placed["simulated_peak_reserved_bytes"],
        library.simulated_peak_reserved_bytes
    );
    assert_eq!(
        placed["segment_events"]["simulated"],
        library.simulated_segment_events
    );
}

#[test]
fn ignore_addresses_refuses_a_trace_which_recorded_none() {
    let err = bad_input(&[
        "replay",
        "crates/headroom-cli/tests/fixtures/trace/tiny.json",
        "--ignore-addresses",
    ]);
    assert!(
        err.contains("--ignore-addresses") && err.contains("recorded no addresses"),
        "{err}"
    );
}
