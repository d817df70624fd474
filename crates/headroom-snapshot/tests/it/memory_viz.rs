//! `summarize` against PyTorch's own `torch/cuda/_memory_viz.py` (`segsum`, the `stats`
//! command), torch 2.11.
//!
//! How the numbers were obtained:
//! - The real module was copied from the GPU machine's install
//!   (`torch 2.11.0+cu130`, `site-packages/torch/cuda/_memory_viz.py`, sha256
//!   `2d4ff8d092362d62dffd3f26fa558483230cd9004656a96541b6dac78d7793be`). Its `segsum` needs no
//!   compiled torch, so `bench/allocator/memory_viz_exact.py` loads it by path and runs
//!   `segsum` with only the two formatting helpers swapped (`_format_size` -> the integer,
//!   `_report_free` -> external and internal bytes), which prints the totals exactly.
//! - For the eight `bench/snapshots`, the same swap was also run on the GPU machine with the
//!   real `import torch.cuda._memory_viz`; both give the values below.
//! - For the shared fixture, `python -m torch.cuda._memory_viz stats` on the GPU machine
//!   printed `segments: 313`, `total_reserved: 30.2GiB`, `total_allocated: 17.3GiB`,
//!   `total_free: 12.9GiB (0.0% internal)`; the exact values come from the local run, and the
//!   rounded lines are checked too, formatted as `_memory_viz` formats them.
//!
//! (The 2.11 CLI's `_read` does not gunzip: `stats FILE.pickle.gz` fails with an unpickling
//! error, so the device output for the fixture must have come from a decompressed copy.)
//!
//! `segsum`'s terms in headroom's summary: `total_reserved` = `reserved_bytes`,
//! `total_allocated` (Σ `requested_size` of active_allocated blocks) = `requested_bytes`,
//! internal free (Σ size - requested of those blocks) = `fragmentation.internal_free_bytes`,
//! external free (every other block) = `fragmentation.external_free_bytes`.

use std::path::{Path, PathBuf};

use crate::common;

use headroom_snapshot::{Summary, SummaryOptions, load, summarize};

/// `segsum`'s totals.
struct Segsum {
    segments: usize,
    total_reserved: u64,
    total_allocated: u64,
    free_external: u64,
    free_internal: u64,
}

fn summary(path: &Path) -> Summary {
    assert!(path.exists(), "missing: {}", path.display());
    summarize(&load(path).unwrap(), SummaryOptions::default())
}

fn check(name: &str, s: &Summary, want: &Segsum) {
    assert_eq!(s.segments.total, want.segments, "{name}: segments");
    assert_eq!(
        s.reserved_bytes, want.total_reserved,
        "{name}: total_reserved"
    );
    assert_eq!(
        s.requested_bytes, want.total_allocated,
        "{name}: total_allocated"
    );
    assert_eq!(
        s.fragmentation.external_free_bytes, want.free_external,
        "{name}: external free"
    );
    assert_eq!(
        s.fragmentation.internal_free_bytes, want.free_internal,
        "{name}: internal free"
    );
    // segsum's own check: allocated + free = reserved.
    assert_eq!(
        want.total_allocated + want.free_external + want.free_internal,
        want.total_reserved,
        "{name}"
    );
}

/// `_memory_viz._format_size`: `f"{num:3.1f}{unit}B"`, dividing by 1024 while |num| >= 1024.
fn format_size(bytes: u64) -> String {
    let mut num = bytes as f64;
    for unit in ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "Zi"] {
        if num.abs() < 1024.0 {
            return format!("{num:3.1}{unit}B");
        }
        num /= 1024.0;
    }
    format!("{num:.1}YiB")
}

/// The four total lines of `segsum`'s output (`_report_free` for the last).
fn stats_lines(s: &Summary) -> [String; 4] {
    let internal = s.fragmentation.internal_free_bytes;
    let free = s.fragmentation.external_free_bytes + internal;
    let suffix = if free == 0 {
        String::new()
    } else {
        format!(" ({:.1}% internal)", internal as f64 / free as f64 * 100.0)
    };
    [
        format!("segments: {}", s.segments.total),
        format!("total_reserved: {}", format_size(s.reserved_bytes)),
        format!("total_allocated: {}", format_size(s.requested_bytes)),
        format!("total_free: {}{suffix}", format_size(free)),
    ]
}

#[test]
fn shared_fixture_matches_memory_viz_stats() {
    let s = summary(&common::shared_fixture());
    check(
        "fixture",
        &s,
        &Segsum {
            segments: 313,
            total_reserved: 32_470_204_416,
            total_allocated: 18_593_810_948,
            free_external: 13_870_625_280,
            free_internal: 5_768_188,
        },
    );
    // What the device printed.
    assert_eq!(
        stats_lines(&s),
        [
            "segments: 313",
            "total_reserved: 30.2GiB",
            "total_allocated: 17.3GiB",
            "total_free: 12.9GiB (0.0% internal)",
        ]
    );
}

#[test]
fn recorded_snapshots_match_memory_viz_stats() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/snapshots");
    // (file, segsum totals, the stats lines as _memory_viz prints them)
    let cases: [(&str, Segsum, [&str; 4]); 8] = [
        (
            "gpt2-amp",
            Segsum {
                segments: 21,
                total_reserved: 1_472_200_704,
                total_allocated: 710_894_596,
                free_external: 758_382_080,
                free_internal: 2_924_028,
            },
            [
                "segments: 21",
                "total_reserved: 1.4GiB",
                "total_allocated: 678.0MiB",
                "total_free: 726.0MiB (0.4% internal)",
            ],
        ),
        (
            "mistral-bf16-masked",
            Segsum {
                segments: 79,
                total_reserved: 7_182_745_600,
                total_allocated: 4_257_346_052,
                free_external: 2_925_398_528,
                free_internal: 1_020,
            },
            [
                "segments: 79",
                "total_reserved: 6.7GiB",
                "total_allocated: 4.0GiB",
                "total_free: 2.7GiB (0.0% internal)",
            ],
        ),
        (
            "q05-amp-expandable",
            Segsum {
                segments: 2,
                total_reserved: 3_716_153_344,
                total_allocated: 2_059_685_636,
                free_external: 1_656_466_432,
                free_internal: 1_276,
            },
            [
                "segments: 2",
                "total_reserved: 3.5GiB",
                "total_allocated: 1.9GiB",
                "total_free: 1.5GiB (0.0% internal)",
            ],
        ),
        (
            "q05-bf16-adamw",
            Segsum {
                segments: 23,
                total_reserved: 2_778_726_400,
                total_allocated: 1_063_923_716,
                free_external: 1_713_023_488,
                free_internal: 1_779_196,
            },
            [
                "segments: 23",
                "total_reserved: 2.6GiB",
                "total_allocated: 1014.6MiB",
                "total_free: 1.6GiB (0.1% internal)",
            ],
        ),
        (
            "q05-bf16-lora",
            Segsum {
                segments: 29,
                total_reserved: 1_900_019_712,
                total_allocated: 408_880_644,
                free_external: 1_490_119_168,
                free_internal: 1_019_900,
            },
            [
                "segments: 29",
                "total_reserved: 1.8GiB",
                "total_allocated: 389.9MiB",
                "total_free: 1.4GiB (0.1% internal)",
            ],
        ),
        (
            "q05-fp32-math",
            Segsum {
                segments: 22,
                total_reserved: 4_588_568_576,
                total_allocated: 2_059_685_636,
                free_external: 2_526_718_976,
                free_internal: 2_163_964,
            },
            [
                "segments: 22",
                "total_reserved: 4.3GiB",
                "total_allocated: 1.9GiB",
                "total_free: 2.4GiB (0.1% internal)",
            ],
        ),
        (
            "q05-nf4-lora-kbit-gc",
            Segsum {
                segments: 22,
                total_reserved: 2_092_957_696,
                total_allocated: 637_968_684,
                free_external: 1_454_243_840,
                free_internal: 745_172,
            },
            [
                "segments: 22",
                "total_reserved: 1.9GiB",
                "total_allocated: 608.4MiB",
                "total_free: 1.4GiB (0.1% internal)",
            ],
        ),
        (
            "qwen3-4b-bf16",
            Segsum {
                segments: 33,
                total_reserved: 6_813_646_848,
                total_allocated: 3_612_035_588,
                free_external: 3_198_068_224,
                free_internal: 3_543_036,
            },
            [
                "segments: 33",
                "total_reserved: 6.3GiB",
                "total_allocated: 3.4GiB",
                "total_free: 3.0GiB (0.1% internal)",
            ],
        ),
    ];
    for (name, want, lines) in &cases {
        let s = summary(&dir.join(format!("{name}.pickle.gz")));
        check(name, &s, want);
        assert_eq!(stats_lines(&s), *lines, "{name}");
    }
}
