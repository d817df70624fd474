//! Files built to exhaust memory or time are refused quickly, each by the bound it hits, with
//! a message that names the bound and the fix.

use std::io::Write;

use headroom_snapshot::limits::{MAX_PICKLE_BYTES, MAX_STACK};
use headroom_snapshot::{DecodeError, Limit, SnapshotError, from_bytes, load};

fn limit_of(bytes: &[u8]) -> Limit {
    match from_bytes(bytes) {
        Err(DecodeError::Limit(limit)) => limit,
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("read as a snapshot"),
    }
}

/// `X`: a short unicode string.
fn str_op(out: &mut Vec<u8>, s: &str) {
    out.push(0x8c);
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

/// A 2 KB pickle whose `LONG_BINPUT`s each name a memo slot 2^20 past the last: without a
/// bound each 5-byte opcode allocates 16 MiB of empty slots, 6 GB in all.
#[test]
fn a_memo_bomb_is_refused() {
    let mut p = b"\x80\x04N".to_vec();
    for k in 1..=400u32 {
        p.push(b'r');
        p.extend_from_slice(&(k << 20).to_le_bytes());
    }
    p.push(b'.');
    assert!(p.len() < 2100);
    let limit = limit_of(&p);
    assert_eq!(
        limit,
        Limit::Memo {
            index: 1 << 20,
            offset: 3
        }
    );
    assert!(limit.to_string().contains("memo slot 1048576 at byte 3"));
}

/// A top-level dict whose `segments` list holds `segments` references to one segment whose
/// `blocks` list holds `blocks` references to one block: 30 KB that would convert to
/// `segments × blocks` blocks (10^8 here, gigabytes).
fn shared_blocks(segments: usize, blocks: usize) -> Vec<u8> {
    let mut p = b"\x80\x04}(".to_vec();
    str_op(&mut p, "segments");
    p.extend_from_slice(b"](}(");
    str_op(&mut p, "address");
    p.extend_from_slice(b"J\x00\x00\x00\x10");
    str_op(&mut p, "total_size");
    p.extend_from_slice(b"J\x00\x00\x20\x00");
    str_op(&mut p, "blocks");
    p.extend_from_slice(b"](}(");
    str_op(&mut p, "size");
    p.extend_from_slice(b"J\x00\x00\x20\x00");
    str_op(&mut p, "state");
    str_op(&mut p, "inactive");
    p.push(b'u');
    p.extend(std::iter::repeat_n(b'2', blocks - 1));
    p.extend_from_slice(b"eu");
    p.extend(std::iter::repeat_n(b'2', segments - 1));
    p.extend_from_slice(b"eu.");
    p
}

#[test]
fn shared_blocks_are_not_multiplied() {
    // The same shape without sharing reads: the bound does not refuse real structure.
    let one = from_bytes(&shared_blocks(1, 1)).expect("one segment, one block");
    assert_eq!(one.segments.len(), 1);
    assert_eq!(one.segments[0].blocks.len(), 1);

    let bomb = shared_blocks(10_000, 10_000);
    assert!(bomb.len() < 30_000);
    let limit = limit_of(&bomb);
    assert!(matches!(limit, Limit::Shared { .. }), "{limit:?}");
    assert!(
        limit
            .to_string()
            .contains("_dump_snapshot writes each of them once"),
        "{limit}"
    );
}

/// `device_traces` as `devices` references to one list of `entries` references to one trace
/// entry.
fn shared_trace(devices: usize, entries: usize) -> Vec<u8> {
    let mut p = b"\x80\x04}(".to_vec();
    str_op(&mut p, "segments");
    p.push(b']');
    str_op(&mut p, "device_traces");
    p.extend_from_slice(b"](](}(");
    str_op(&mut p, "action");
    str_op(&mut p, "alloc");
    str_op(&mut p, "addr");
    p.extend_from_slice(b"J\x00\x00\x00\x10");
    str_op(&mut p, "size");
    p.extend_from_slice(b"K\x08");
    p.push(b'u');
    p.extend(std::iter::repeat_n(b'2', entries - 1));
    p.push(b'e');
    p.extend(std::iter::repeat_n(b'2', devices - 1));
    p.extend_from_slice(b"eu.");
    p
}

#[test]
fn a_shared_trace_is_not_multiplied() {
    let one = from_bytes(&shared_trace(1, 3)).expect("one device, three entries");
    assert_eq!(one.device_traces[0].len(), 3);
    let limit = limit_of(&shared_trace(10_000, 10_000));
    assert!(matches!(limit, Limit::Shared { .. }), "{limit:?}");
}

/// Concatenated gzip members of 1 MiB of zeros each: about 1000:1, so its 1 MB would be 1 GB
/// of pickle without a bound. It is refused within the first few MiB of output.
#[test]
fn a_gzip_bomb_is_refused() {
    let mut member = Vec::new();
    {
        let mut enc = flate2::write::GzEncoder::new(&mut member, flate2::Compression::best());
        enc.write_all(&vec![0u8; 1 << 20]).unwrap();
        enc.finish().unwrap();
    }
    let bomb: Vec<u8> = member.repeat(1024);
    assert!(bomb.len() < 1_200_000, "{}", bomb.len());
    let limit = limit_of(&bomb);
    let Limit::Decompressed {
        compressed,
        limit: bytes,
    } = limit
    else {
        panic!("{limit:?}");
    };
    // The decoder reads its input 32 KiB at a time.
    assert!(compressed <= 64 << 10, "read {compressed} bytes");
    assert!(bytes <= 8 << 20, "decompressed {bytes} bytes");
    let message = limit.to_string();
    assert!(message.contains("grows more than 128-fold"), "{message}");
    assert!(
        message.contains("gunzip it and pass the .pickle"),
        "{message}"
    );
}

/// One value pushed per byte (`DUP`) past the stack bound.
#[test]
fn a_stack_of_duplicates_is_refused() {
    let mut p = b"\x80\x04N".to_vec();
    p.extend(std::iter::repeat_n(b'2', MAX_STACK));
    p.push(b'.');
    assert_eq!(
        limit_of(&p),
        Limit::Stack {
            offset: 3 + MAX_STACK - 1
        }
    );
}

#[test]
fn a_file_past_the_size_bound_is_refused_unread() {
    let path = std::env::temp_dir().join(format!("headroom-huge-{}.pickle", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    // Sparse: no bytes are written.
    file.set_len(MAX_PICKLE_BYTES + 1).unwrap();
    let result = load(&path);
    std::fs::remove_file(&path).unwrap();
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            SnapshotError::Decode {
                source: DecodeError::Limit(Limit::FileSize),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("larger than 4.00 GiB"), "{err}");
}
