//! Paths shared by the integration tests.

use std::path::PathBuf;

/// The shared fixture: a real `_dump_snapshot` of a 3-iteration actor/ref run with manual
/// offload (torch 2.11, H200), kept in bench/shared.
pub fn shared_fixture() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../bench/shared/fixtures/snapshot-actor-ref-manual-offload.pickle.gz");
    assert!(path.exists(), "shared fixture missing: {}", path.display());
    path
}
