//! OOM messages as people paste them: fragments, colours, bytes of other encodings, retyped
//! units, inside arbitrary text. Each is read as the clean message is, and no text panics.

use headroom::diagnose::decode_log;
use headroom::diagnose::oom_message::{self, Backend, Format, OomMessage};
use proptest::prelude::*;
use serde_json::Value;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

const SENTENCES: &str = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. \
    GPU 0 has a total capacity of 79.25 GiB of which 1.50 GiB is free. Including non-PyTorch \
    memory, this process has 77.74 GiB memory in use. Of the allocated memory 70.00 GiB is \
    allocated by PyTorch, and 6.00 GiB is reserved by PyTorch but unallocated.";

fn corpus() -> Vec<String> {
    let doc: Value = serde_json::from_str(include_str!("../data/oom_messages.json")).unwrap();
    doc["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["text"].as_str().unwrap().to_string())
        .collect()
}

fn read(bytes: &[u8]) -> Option<OomMessage> {
    oom_message::parse(&decode_log(bytes))
}

/// What `scripts/fuzz` found: a paste whose reserved bytes are near `u64::MAX` overflowed the
/// explanation's arithmetic. Every size from a paste saturates now.
#[test]
fn sizes_near_the_top_of_u64_are_explained_without_overflow() {
    let bytes = include_bytes!("../data/fuzz/oom-log-overflow.bin");
    let text = decode_log(bytes);
    let messages = oom_message::parse_all(&text);
    assert!(!messages.is_empty());
    for m in &messages {
        let explanation = oom_message::explain(m);
        assert!(!explanation.summary.is_empty());
    }
}

#[test]
fn a_bare_pre_2_1_fragment_is_read() {
    let m = read(b"Tried to allocate 156.00 MiB (GPU 0; ...)").expect("a fragment");
    assert_eq!(m.backend, Backend::Cuda);
    assert_eq!(m.format, Format::ReservedInTotal);
    assert_eq!(m.tried_to_allocate_bytes, Some(156 * MIB));
    assert_eq!(m.device, Some(0));

    let whole = read(
        b"Tried to allocate 20.00 MiB (GPU 1; 7.79 GiB total capacity; 6.50 GiB already \
          allocated; 3.94 MiB free; 6.61 GiB reserved in total by PyTorch)",
    )
    .expect("a fragment");
    assert_eq!(whole.device, Some(1));
    assert_eq!(whole.free_bytes, Some(4_131_389));
    assert!(whole.reserved_by_pytorch_bytes.is_some());
}

#[test]
fn a_bare_2_1_fragment_and_a_lone_request_are_read() {
    let tail = SENTENCES.split_once("CUDA out of memory. ").unwrap().1;
    let fragment = read(tail.as_bytes()).expect("a fragment");
    let whole = read(SENTENCES.as_bytes()).unwrap();
    assert_eq!(fragment, whole);

    let lone = read(b"Tried to allocate 62.02 GiB. What uses it?").expect("a request");
    assert!(lone.tried_to_allocate_bytes.is_some());
    assert_eq!(lone.total_capacity_bytes, None);
}

#[test]
fn other_runtimes_and_prose_are_not_fragments() {
    for text in [
        "RuntimeError: MPS backend out of memory (MPS allocated: 17.79 GB, other allocations: \
         1.40 GB, max allowed: 18.13 GB). Tried to allocate 256 bytes on private pool.",
        "RuntimeError: XPU out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.56 GiB total \
         capacity; 14.86 GiB already allocated; 0 bytes free; 15.02 GiB reserved in total by \
         PyTorch)",
        "Tried to allocate memory for the cache, which failed.",
    ] {
        assert_eq!(read(text.as_bytes()), None, "{text}");
    }
}

#[test]
fn a_fragment_does_not_displace_a_whole_message() {
    let text = format!("Tried to allocate 2.00 GiB (GPU 0; ...)\n{SENTENCES}");
    let all = oom_message::parse_all(&text);
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].format, Format::Sentences);
}

#[test]
fn bytes_that_are_not_utf8_do_not_hide_the_message() {
    // A Latin-1 non-breaking space (0xa0) between number and unit, and stray bytes around.
    let text = SENTENCES
        .replace("2.00 GiB", "2.00\u{0}GiB")
        .into_bytes()
        .into_iter()
        .map(|b| if b == 0 { 0xa0 } else { b })
        .collect::<Vec<u8>>();
    let pasted = [&b"\x80Log \xff\x81:\n"[..], &text, b"\n\xc3(end)"].concat();
    assert!(std::str::from_utf8(&pasted).is_err());
    assert_eq!(read(&pasted), oom_message::parse(SENTENCES));
    assert!(read(&pasted).is_some());
}

#[test]
fn utf16_logs_with_a_byte_order_mark_are_read() {
    let le: Vec<u8> = [0xff, 0xfe]
        .into_iter()
        .chain(SENTENCES.encode_utf16().flat_map(u16::to_le_bytes))
        .collect();
    let be: Vec<u8> = [0xfe, 0xff]
        .into_iter()
        .chain(SENTENCES.encode_utf16().flat_map(u16::to_be_bytes))
        .collect();
    assert_eq!(read(&le), oom_message::parse(SENTENCES));
    assert_eq!(read(&be), oom_message::parse(SENTENCES));
}

#[test]
fn ansi_colours_are_stripped() {
    let clean = oom_message::parse(SENTENCES).unwrap();
    let coloured = SENTENCES
        .replace(
            "torch.OutOfMemoryError",
            "\x1b[31;1mtorch.OutOfMemoryError\x1b[0m",
        )
        .replace("2.00 GiB", "\x1b[1m2.00 GiB\x1b[22m")
        .replace("GPU 0", "\x1b]8;;https://pytorch.org\x07GPU 0\x1b]8;;\x07")
        .replace("Of the", "\x1b[2K\x1b(BOf the");
    assert_eq!(oom_message::parse(&coloured), Some(clean.clone()));
    for intro in ["^[", "\u{241b}", "\\x1b", "\\033", "\\u001b"] {
        let shown = SENTENCES.replace("CUDA out", &format!("{intro}[1;31mCUDA{intro}[0m out"));
        assert_eq!(oom_message::parse(&shown), Some(clean.clone()), "{shown}");
    }
}

#[test]
fn retyped_units_read_as_the_printed_ones() {
    let clean = oom_message::parse(SENTENCES).unwrap();
    let retyped = SENTENCES
        .replace("2.00 GiB", "2.00GB")
        .replace("79.25 GiB", "79.25 gb")
        .replace("1.50 GiB", "1.50 GB");
    assert_eq!(oom_message::parse(&retyped), Some(clean));
    let old = read(b"CUDA out of memory. Tried to allocate 512 KB (GPU 0; 10.92 GB total capacity; 0 B already allocated; 9.28 GB free; 4.68 MB cached)")
        .unwrap();
    assert_eq!(old.tried_to_allocate_bytes, Some(512 << 10));
    assert_eq!(old.allocated_by_pytorch_bytes, Some(0));
    assert_eq!(old.reserved_unallocated_bytes, Some(4_907_336));
    assert_eq!(old.total_capacity_bytes, Some(11_725_260_718));
    assert_eq!(old.free_bytes.map(|b| b / GIB), Some(9));
}

/// How a paste may spell the whitespace between two words.
fn spaces() -> impl Strategy<Value = &'static [u8]> {
    prop::sample::select(vec![
        &b" "[..],
        b"\n",
        b"  \t",
        b"\xa0",
        b" \xff ",
        b" \x1b[0m",
        b"\x1b[1;31m ",
        b"\r\n[rank3]: ",
        b" **",
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any bytes: decoding, parsing and explaining never panic.
    #[test]
    fn any_bytes_are_read_without_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        for m in oom_message::parse_all(&decode_log(&bytes)) {
            let _ = oom_message::explain(&m);
        }
    }

    /// Text built around the message's own words, where half-messages and odd sizes are
    /// likely: never a panic.
    #[test]
    fn message_like_text_is_read_without_panic(
        words in prop::collection::vec(prop::sample::select(vec![
            "CUDA out of memory.", "Tried to allocate", "(GPU", "0;", "GPU", "has a total",
            "capacity of", "of which", "is free.", "Process", "99999999999999999999999", "has",
            "memory in use.", "18446744073709551616.00 GiB", "0.5", "GB", "bytes", "\x1b[",
            "^[[", "allowed;", "Of the allocated memory", "is allocated by PyTorch,", "with",
            "allocated in private pools (e.g., CUDA Graphs),", "and", "is reserved by PyTorch",
            "but unallocated.", "total capacity;", "already allocated;", "free;", "cached)",
            "reserved in total by PyTorch)", "more than 1EB memory", "\u{fffd}", "é",
        ]), 0..40),
    ) {
        for m in oom_message::parse_all(&words.join(" ")) {
            let _ = oom_message::explain(&m);
        }
    }

    /// A real message inside noise, its whitespace respelled as pastes do and its units
    /// retyped: read exactly as the clean message is.
    #[test]
    fn a_message_in_noise_is_still_found(
        index in 0..43usize,
        before in ".{0,80}",
        after in ".{0,80}",
        seps in prop::collection::vec(spaces(), 64),
        retype in any::<bool>(),
    ) {
        let messages = corpus();
        let clean = &messages[index % messages.len()];
        let want = oom_message::parse(clean);
        prop_assume!(want.is_some());
        let mut text = clean.clone();
        if retype {
            text = text.replace(" GiB", " GB").replace(" MiB", "MB").replace(" KiB", " KB");
        }
        let mut pasted = before.into_bytes();
        pasted.push(b'\n');
        for (i, word) in text.split(' ').enumerate() {
            if i > 0 {
                pasted.extend_from_slice(seps[i % seps.len()]);
            }
            pasted.extend_from_slice(word.as_bytes());
        }
        pasted.push(b'\n');
        pasted.extend_from_slice(after.as_bytes());
        prop_assert_eq!(read(&pasted), want);
    }
}
