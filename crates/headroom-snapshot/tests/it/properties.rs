//! Property tests of the reader: arbitrary bytes, mutated real snapshots, streams of the
//! opcodes a hostile pickle is made of, and snapshots whose objects the memo shares all end in
//! `Ok` or `Err`, quickly, and nothing read holds more segments, blocks and trace entries than
//! its file has bytes. `cargo test -p headroom-snapshot -- --ignored
//! campaign` runs the same properties over many more cases (bench/fuzz/README.md).

use std::time::{Duration, Instant};

use headroom_snapshot::{
    DecodeError, Limit, ReplayOptions, SummaryOptions, from_bytes, replay, summarize,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const SMALL: &[u8] = include_bytes!("../data/small.pickle");

/// A generous bound for one small input in a debug build on a loaded machine: the reader is
/// linear, so anything near it means a blow-up.
const SLOW: Duration = Duration::from_secs(5);

/// Reads `bytes`; whatever reads is summarized and replayed. Returns the values the snapshot
/// holds (segments, blocks, trace entries).
fn exercise(bytes: &[u8]) -> Result<(), TestCaseError> {
    let start = Instant::now();
    if let Ok(snapshot) = from_bytes(bytes) {
        let blocks: usize = snapshot.segments.iter().map(|s| s.blocks.len()).sum();
        let events: usize = snapshot.device_traces.iter().map(Vec::len).sum();
        let held = snapshot.segments.len() + blocks + events;
        prop_assert!(
            held <= bytes.len(),
            "{} bytes read as {held} segments, blocks and trace entries",
            bytes.len()
        );
        let _ = summarize(
            &snapshot,
            SummaryOptions {
                timeline_points: 8,
                top_sites: 3,
            },
        );
        let _ = replay(&snapshot, &ReplayOptions::default());
    }
    prop_assert!(
        start.elapsed() < SLOW,
        "{:?} for {} bytes",
        start.elapsed(),
        bytes.len()
    );
    Ok(())
}

/// Pieces of snapshot pickles: containers, stack and memo opcodes, the keys and values the
/// converter looks for, and ints of every width.
fn token() -> impl Strategy<Value = Vec<u8>> {
    let key = prop::sample::select(vec![
        "segments",
        "device_traces",
        "blocks",
        "address",
        "total_size",
        "size",
        "state",
        "active_allocated",
        "inactive",
        "action",
        "alloc",
        "free_completed",
        "segment_alloc",
        "addr",
        "stream",
        "frames",
        "filename",
        "name",
        "line",
        "history",
        "real_size",
        "allocator_settings",
        "expandable_segments",
    ])
    .prop_map(|k| {
        let mut t = vec![0x8c, k.len() as u8];
        t.extend_from_slice(k.as_bytes());
        t
    });
    let single = prop::sample::select(b"}](2010euslatd\x94N\x88\x89\x85\x86\x87)".to_vec())
        .prop_map(|b| vec![b]);
    prop_oneof![
        4 => single,
        3 => key,
        1 => any::<u8>().prop_map(|i| vec![b'h', i]),
        1 => any::<u8>().prop_map(|i| vec![b'q', i]),
        1 => (0u32..64).prop_map(|i| [&[b'j'][..], &i.to_le_bytes()].concat()),
        1 => any::<u32>().prop_map(|i| [&[b'r'][..], &i.to_le_bytes()].concat()),
        1 => any::<u8>().prop_map(|i| vec![b'K', i]),
        1 => any::<i32>().prop_map(|i| [&[b'J'][..], &i.to_le_bytes()].concat()),
        1 => any::<u64>().prop_map(|i| [&[0x8a, 8][..], &i.to_le_bytes()].concat()),
    ]
}

fn opcode_stream() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(token(), 0..400).prop_map(|tokens| {
        let mut p = b"\x80\x04".to_vec();
        p.extend(tokens.concat());
        p.push(b'.');
        p
    })
}

/// A snapshot's shape, each object written afresh or as a memo reference to an earlier one:
/// segments (or their block lists) and device traces by index, blocks and trace entries as a
/// `DUP` of the one before.
#[derive(Clone, Debug)]
struct Shape {
    segments: Vec<SegmentShape>,
    traces: Vec<TraceShape>,
}

/// An earlier segment again, or: an earlier segment's block list again, or blocks, each a
/// `DUP` of the one before or (size in 512-byte units, active).
type SegmentShape = (Option<usize>, Option<usize>, Vec<(bool, u8, bool)>);

/// An earlier trace again, or entries, each a `DUP` or (action, address, size).
type TraceShape = (Option<usize>, Vec<(bool, u8, u16, u16)>);

impl Shape {
    fn shares(&self) -> bool {
        self.segments
            .iter()
            .any(|(s, b, blocks)| s.is_some() || b.is_some() || blocks.iter().any(|x| x.0))
            || self
                .traces
                .iter()
                .any(|(t, events)| t.is_some() || events.iter().any(|e| e.0))
    }
}

fn shape() -> impl Strategy<Value = Shape> {
    let reference = prop::option::weighted(0.15, 0usize..16);
    let block = (prop::bool::weighted(0.15), any::<u8>(), any::<bool>());
    let segment = (
        reference.clone(),
        reference.clone(),
        prop::collection::vec(block, 0..24),
    );
    let event = (
        prop::bool::weighted(0.15),
        0u8..4,
        any::<u16>(),
        any::<u16>(),
    );
    let trace = (reference, prop::collection::vec(event, 0..40));
    (
        prop::collection::vec(segment, 0..12),
        prop::collection::vec(trace, 0..4),
    )
        .prop_map(|(segments, traces)| Shape { segments, traces })
}

/// A pickle writer that memoizes every container, as `pickle.dump` does.
struct Writer {
    out: Vec<u8>,
    memo: u32,
}

impl Writer {
    fn op(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    fn memoize(&mut self) -> u32 {
        self.out.push(0x94);
        self.memo += 1;
        self.memo - 1
    }

    fn get(&mut self, slot: u32) {
        self.out.push(b'j');
        self.out.extend_from_slice(&slot.to_le_bytes());
    }

    fn str(&mut self, s: &str) {
        self.out.push(0x8c);
        self.out.push(s.len() as u8);
        self.out.extend_from_slice(s.as_bytes());
    }

    fn int(&mut self, i: u32) {
        self.out.push(b'J');
        self.out.extend_from_slice(&i.to_le_bytes());
    }
}

fn write(shape: &Shape) -> Vec<u8> {
    let mut w = Writer {
        out: b"\x80\x04".to_vec(),
        memo: 0,
    };
    w.op(b"}");
    w.memoize();
    w.op(b"(");
    w.str("segments");
    w.op(b"]");
    w.memoize();
    w.op(b"(");
    let (mut segment_slots, mut block_list_slots) = (Vec::new(), Vec::new());
    for (i, (again, blocks_again, blocks)) in shape.segments.iter().enumerate() {
        if let Some(&slot) = again.and_then(|r| segment_slots.get(r % i.max(1))) {
            w.get(slot);
            continue;
        }
        w.op(b"}");
        segment_slots.push(w.memoize());
        w.op(b"(");
        w.str("address");
        w.int(i as u32 * (1 << 21));
        w.str("total_size");
        w.int(1 << 21);
        w.str("blocks");
        match blocks_again.and_then(|r| block_list_slots.get(r % i.max(1)).copied()) {
            Some(slot) => w.get(slot),
            None => {
                w.op(b"]");
                block_list_slots.push(w.memoize());
                w.op(b"(");
                for (j, &(dup, size, active)) in blocks.iter().enumerate() {
                    if dup && j > 0 {
                        w.op(b"2");
                        continue;
                    }
                    w.op(b"}");
                    w.memoize();
                    w.op(b"(");
                    w.str("size");
                    w.int(u32::from(size) * 512);
                    w.str("state");
                    w.str(if active {
                        "active_allocated"
                    } else {
                        "inactive"
                    });
                    w.op(b"u");
                }
                w.op(b"e");
            }
        }
        w.op(b"u");
    }
    w.op(b"e");
    w.str("device_traces");
    w.op(b"]");
    w.memoize();
    w.op(b"(");
    let mut trace_slots = Vec::new();
    for (i, (again, events)) in shape.traces.iter().enumerate() {
        if let Some(&slot) = again.and_then(|r| trace_slots.get(r % i.max(1))) {
            w.get(slot);
            continue;
        }
        w.op(b"]");
        trace_slots.push(w.memoize());
        w.op(b"(");
        for (j, &(dup, action, addr, size)) in events.iter().enumerate() {
            if dup && j > 0 {
                w.op(b"2");
                continue;
            }
            w.op(b"}");
            w.memoize();
            w.op(b"(");
            w.str("action");
            w.str(["alloc", "free_requested", "free_completed", "segment_alloc"][action as usize]);
            w.str("addr");
            w.int(u32::from(addr) * 512);
            w.str("size");
            w.int(u32::from(size) * 512);
            w.op(b"u");
        }
        w.op(b"e");
    }
    w.op(b"eu.");
    w.out
}

fn check_shapes(cases: u32) {
    let mut runner = TestRunner::new(Config::with_cases(cases));
    runner
        .run(&shape(), |shape| {
            let bytes = write(&shape);
            match from_bytes(&bytes) {
                Ok(snapshot) if !shape.shares() => {
                    let blocks: Vec<usize> =
                        snapshot.segments.iter().map(|s| s.blocks.len()).collect();
                    let want: Vec<usize> = shape.segments.iter().map(|s| s.2.len()).collect();
                    prop_assert_eq!(blocks, want);
                    let events: Vec<usize> = snapshot.device_traces.iter().map(Vec::len).collect();
                    let want: Vec<usize> = shape.traces.iter().map(|t| t.1.len()).collect();
                    prop_assert_eq!(events, want);
                    exercise(&bytes)
                }
                Ok(_) => exercise(&bytes),
                Err(DecodeError::Limit(Limit::Shared { .. })) if shape.shares() => Ok(()),
                Err(e) => Err(TestCaseError::fail(format!("{shape:?}: {e}"))),
            }
        })
        .unwrap();
}

/// A change to a real snapshot: overwrite, delete, insert, or copy a run of it elsewhere
/// (repeating opcodes and memo references).
#[derive(Clone, Debug)]
enum Edit {
    Set(usize, u8),
    Delete(usize, usize),
    Insert(usize, Vec<u8>),
    Copy { from: usize, len: usize, to: usize },
}

fn edit() -> impl Strategy<Value = Edit> {
    let at = 0..SMALL.len();
    prop_oneof![
        (at.clone(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        (at.clone(), 1usize..64).prop_map(|(i, n)| Edit::Delete(i, n)),
        (at.clone(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Edit::Insert(i, b)),
        (at.clone(), 1usize..256, at).prop_map(|(from, len, to)| Edit::Copy { from, len, to }),
    ]
}

fn apply(edits: &[Edit]) -> Vec<u8> {
    let mut bytes = SMALL.to_vec();
    for e in edits {
        let n = bytes.len();
        match e {
            Edit::Set(i, b) => bytes[i % n] = *b,
            Edit::Delete(i, len) => {
                let i = i % n;
                bytes.drain(i..(i + len).min(n));
            }
            Edit::Insert(i, b) => {
                bytes.splice(i % n..i % n, b.iter().copied());
            }
            Edit::Copy { from, len, to } => {
                let from = from % n;
                let run = bytes[from..(from + len).min(n)].to_vec();
                bytes.splice(to % n..to % n, run);
            }
        }
        if bytes.is_empty() {
            break;
        }
    }
    bytes
}

fn check_arbitrary_bytes(cases: u32) {
    let mut runner = TestRunner::new(Config::with_cases(cases));
    runner
        .run(&prop::collection::vec(any::<u8>(), 0..2048), |b| {
            exercise(&b)?;
            // The same bytes as a pickle body, past the protocol header.
            exercise(&[&b"\x80\x04"[..], &b].concat())
        })
        .unwrap();
}

fn check_opcode_streams(cases: u32) {
    let mut runner = TestRunner::new(Config::with_cases(cases));
    runner.run(&opcode_stream(), |p| exercise(&p)).unwrap();
}

fn check_mutated_snapshots(cases: u32) {
    let mut runner = TestRunner::new(Config::with_cases(cases));
    runner
        .run(&prop::collection::vec(edit(), 1..6), |edits| {
            exercise(&apply(&edits))
        })
        .unwrap();
}

#[test]
fn arbitrary_bytes_end_in_ok_or_err() {
    check_arbitrary_bytes(256);
}

#[test]
fn opcode_streams_end_in_ok_or_err_and_never_grow() {
    check_opcode_streams(256);
}

#[test]
fn shared_objects_are_refused_or_stay_small() {
    check_shapes(256);
}

#[test]
fn mutated_snapshots_end_in_ok_or_err() {
    check_mutated_snapshots(24);
}

/// The long campaign: `cargo test --release -p headroom-snapshot -- --ignored campaign`.
#[test]
#[ignore = "a long campaign; run on demand"]
fn campaign() {
    check_arbitrary_bytes(200_000);
    check_opcode_streams(200_000);
    check_shapes(100_000);
    check_mutated_snapshots(5_000);
}
