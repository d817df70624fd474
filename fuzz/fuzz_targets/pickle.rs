//! Any bytes as a snapshot file: reading ends in `Ok` or `Err` within the reader's bounds, and
//! whatever reads can be summarized and replayed without panicking.
#![no_main]

use headroom_snapshot::{SummaryOptions, from_bytes, replay, summarize};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(snapshot) = from_bytes(data) {
        let _ = summarize(
            &snapshot,
            SummaryOptions {
                timeline_points: 8,
                top_sites: 3,
            },
        );
        let _ = replay(&snapshot, &Default::default());
    }
});
