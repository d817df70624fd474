//! Corrupt, truncated and foreign inputs end in `Ok` or `Err`, never a panic, and whatever
//! parses can be summarized and replayed. The input is `tests/data/small.pickle`: the first
//! 1500 trace entries and 12 segments of the shared fixture, re-pickled with protocol 4.
//! (`fuzz/` at the repository root holds a cargo-fuzz target, `pickle`, for the same property.)

use headroom_snapshot::{ReplayOptions, SummaryOptions, from_bytes, replay, summarize};

const SMALL: &[u8] = include_bytes!("../data/small.pickle");

fn exercise(bytes: &[u8]) {
    if let Ok(snapshot) = from_bytes(bytes) {
        let _ = summarize(
            &snapshot,
            SummaryOptions {
                timeline_points: 16,
                top_sites: 3,
            },
        );
        let _ = replay(&snapshot, &ReplayOptions::default());
    }
}

/// A deterministic generator, so failures reproduce.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn the_small_snapshot_reads_and_replays() {
    let snapshot = from_bytes(SMALL).unwrap();
    assert_eq!(snapshot.device_traces[0].len(), 1500);
    assert_eq!(snapshot.segments.len(), 12);
    exercise(SMALL);
}

#[test]
fn every_truncation_is_an_error() {
    let mut rng = Lcg(1);
    let mut cuts: Vec<usize> = (0..256).collect();
    cuts.extend((0..300).map(|_| rng.below(SMALL.len())));
    for cut in cuts {
        assert!(
            from_bytes(&SMALL[..cut]).is_err(),
            "truncated at {cut} parsed"
        );
    }
}

#[test]
fn byte_flips_never_panic() {
    let mut rng = Lcg(2);
    for _ in 0..600 {
        let mut bytes = SMALL.to_vec();
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(bytes.len());
            bytes[i] = rng.next() as u8;
        }
        exercise(&bytes);
    }
}

#[test]
fn insertions_deletions_and_splices_never_panic() {
    let mut rng = Lcg(3);
    for _ in 0..300 {
        let mut bytes = SMALL.to_vec();
        let i = rng.below(bytes.len());
        match rng.below(3) {
            0 => {
                let n = 1 + rng.below(16);
                bytes.drain(i..(i + n).min(bytes.len()));
            }
            1 => {
                let junk: Vec<u8> = (0..1 + rng.below(16)).map(|_| rng.next() as u8).collect();
                bytes.splice(i..i, junk);
            }
            _ => {
                // duplicate a slice of the stream elsewhere: repeated opcodes and memo refs
                let j = rng.below(bytes.len());
                let n = rng.below(64).min(bytes.len() - j);
                let slice = bytes[j..j + n].to_vec();
                bytes.splice(i..i, slice);
            }
        }
        exercise(&bytes);
    }
}

#[test]
fn foreign_inputs_are_errors() {
    for bytes in [
        &b""[..],
        b"not a pickle at all",
        b"\x1f\x8b\x08\x00garbage",
        b"\x80\x04N.",                                         // None
        b"\x80\x04]\x94.", // []  (an empty list of segments is fine)
        b"\x80\x04}\x94.", // {}
        b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01.", // 1
    ] {
        let result = from_bytes(bytes);
        if bytes == b"\x80\x04]\x94." {
            assert!(result.is_ok());
        } else {
            assert!(result.is_err(), "{bytes:?} parsed");
        }
    }
    // gzip of a non-snapshot pickle
    let mut gz = Vec::new();
    {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(&mut gz, flate2::Compression::fast());
        enc.write_all(b"\x80\x04K\x01.").unwrap();
    }
    let err = from_bytes(&gz).unwrap_err().to_string();
    assert!(err.contains("not a memory snapshot"), "{err}");
}
