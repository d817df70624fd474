//! Random malloc/free/empty_cache sequences must keep the allocator's books consistent:
//! the stats always equal what the segment list shows.

use headroom_alloc::{
    AllocatorConfig, BlockId, CachingAllocator, Pool, RestoredBlock, RestoredRange, SegmentView,
};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

#[derive(Clone, Debug)]
enum Op {
    Malloc { size: u64, stream: u32 },
    Free(usize),
    FreeRequested(usize),
    CompleteFree(usize),
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        1u64..=4096,          // small pool, sub-page
        4097u64..=MIB,        // small pool
        MIB + 1..=10 * MIB,   // shared 20 MiB segments
        10 * MIB..=300 * MIB, // own segments, oversize with max_split_size_mb:64
    ];
    prop_oneof![
        6 => (size, 0u32..2).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        4 => any::<usize>().prop_map(Op::Free),
        1 => any::<usize>().prop_map(Op::FreeRequested),
        1 => any::<usize>().prop_map(Op::CompleteFree),
        1 => Just(Op::EmptyCache),
    ]
}

/// Recomputes the stats from the segment list and checks the structure of every segment.
fn check(alloc: &CachingAllocator, capacity: Option<u64>) {
    let segments: Vec<SegmentView> = alloc.segments().collect();
    let stats = alloc.stats();
    let (mut reserved, mut allocated, mut active, mut requested) =
        ([0i64; 2], [0i64; 2], [0i64; 2], [0i64; 2]);
    let (mut n_alloc, mut n_active, mut n_segments) = ([0i64; 2], [0i64; 2], [0i64; 2]);
    let (mut inactive_split, mut inactive_split_bytes) = ([0i64; 2], [0i64; 2]);
    for s in &segments {
        let p = usize::from(s.pool == Pool::Small);
        assert_eq!(
            s.blocks.first().map(|b| b.address),
            Some(s.address),
            "segment starts at its first block"
        );
        let mut next = s.address;
        for (i, b) in s.blocks.iter().enumerate() {
            assert_eq!(b.address, next, "blocks tile the segment");
            next += b.size;
            if i > 0 {
                let prev = &s.blocks[i - 1];
                assert!(prev.active || b.active, "two adjacent free blocks in {s:?}");
            }
            if b.allocated {
                allocated[p] += b.size as i64;
                n_alloc[p] += 1;
            }
            if b.active {
                active[p] += b.size as i64;
                requested[p] += b.requested_size as i64;
                n_active[p] += 1;
            } else if !s.is_expandable && s.blocks.len() > 1 {
                inactive_split[p] += 1;
                inactive_split_bytes[p] += b.size as i64;
            }
        }
        assert_eq!(
            next - s.address,
            s.total_size,
            "block sizes add up to the segment size"
        );
        reserved[p] += s.total_size as i64;
        if !s.is_expandable {
            n_segments[p] += 1;
        }
    }
    let pairs = [
        ("reserved_bytes", &stats.reserved_bytes, reserved),
        ("allocated_bytes", &stats.allocated_bytes, allocated),
        ("active_bytes", &stats.active_bytes, active),
        ("requested_bytes", &stats.requested_bytes, requested),
        ("allocation", &stats.allocation, n_alloc),
        ("active", &stats.active, n_active),
        ("segment", &stats.segment, n_segments),
        ("inactive_split", &stats.inactive_split, inactive_split),
        (
            "inactive_split_bytes",
            &stats.inactive_split_bytes,
            inactive_split_bytes,
        ),
    ];
    for (name, stat, [large, small]) in pairs {
        assert_eq!(stat.large_pool.current, large, "{name} (large pool)");
        assert_eq!(stat.small_pool.current, small, "{name} (small pool)");
        assert_eq!(stat.all.current, large + small, "{name}");
        assert!(stat.all.peak >= stat.all.current, "{name} peak");
    }
    assert!(stats.allocated_bytes.all.current <= stats.reserved_bytes.all.current);
    if let Some(cap) = capacity {
        assert!(
            stats.reserved_bytes.all.current as u64 <= cap,
            "reserved beyond capacity"
        );
    }
}

fn run(conf: &str, capacity: Option<u64>, ops: &[Op]) {
    let alloc = CachingAllocator::new(AllocatorConfig::parse(conf).unwrap(), capacity);
    run_from(alloc, Vec::new(), capacity, ops);
}

/// Runs `ops` on `alloc`, whose allocated blocks are `live`.
fn run_from(
    mut alloc: CachingAllocator,
    mut live: Vec<BlockId>,
    capacity: Option<u64>,
    ops: &[Op],
) {
    check(&alloc, capacity);
    let mut pending: Vec<BlockId> = Vec::new();
    for op in ops {
        match *op {
            Op::Malloc { size, stream } => {
                if let Ok(b) = alloc.malloc(size, stream) {
                    assert!(alloc.block_size(b) >= size);
                    live.push(b);
                }
            }
            Op::Free(i) if !live.is_empty() => {
                let b = live.swap_remove(i % live.len());
                alloc.free(b);
            }
            Op::FreeRequested(i) if !live.is_empty() => {
                let b = live.swap_remove(i % live.len());
                alloc.free_requested(b);
                pending.push(b);
            }
            Op::CompleteFree(i) if !pending.is_empty() => {
                let b = pending.swap_remove(i % pending.len());
                alloc.complete_free(b);
            }
            Op::EmptyCache => {
                alloc.empty_cache();
                pending.clear();
            }
            _ => {}
        }
        check(&alloc, capacity);
    }
    for b in live {
        alloc.free(b);
    }
    alloc.empty_cache();
    check(&alloc, capacity);
    assert_eq!(
        alloc.stats().reserved_bytes.all.current,
        0,
        "everything freed and flushed"
    );
}

/// One page of a restored expandable segment.
#[derive(Clone, Copy, Debug)]
enum Page {
    Unmapped,
    Free,
    Allocated,
    /// An allocated block of a quarter page, then free space.
    Quarter,
}

fn page() -> impl Strategy<Value = Page> {
    prop_oneof![
        Just(Page::Unmapped),
        Just(Page::Free),
        Just(Page::Allocated),
        Just(Page::Quarter),
    ]
}

/// Restores an expandable segment of `pool` at `base` laid out as `pages`, as a replay of a
/// trace that began mid-run would; returns the allocated blocks.
fn restore_pages(
    alloc: &mut CachingAllocator,
    base: u64,
    pool: Pool,
    pages: &[Page],
) -> Vec<BlockId> {
    let page_size = alloc.expandable_page_size(pool);
    let mut ranges: Vec<RestoredRange> = Vec::new();
    for (i, p) in pages.iter().enumerate() {
        let blocks = match p {
            Page::Unmapped => continue,
            Page::Free => vec![(page_size, None)],
            Page::Allocated => vec![(page_size, Some(page_size - 100))],
            Page::Quarter => vec![
                (page_size / 4, Some(page_size / 4)),
                (page_size * 3 / 4, None),
            ],
        };
        let blocks = blocks
            .into_iter()
            .map(|(size, requested)| RestoredBlock { size, requested });
        let address = base + i as u64 * page_size;
        match ranges.last_mut() {
            Some(r) if r.address + r.blocks.iter().map(|b| b.size).sum::<u64>() == address => {
                r.blocks.extend(blocks)
            }
            _ => ranges.push(RestoredRange {
                address,
                blocks: blocks.collect(),
            }),
        }
    }
    if ranges.is_empty() {
        return Vec::new();
    }
    alloc
        .restore_expandable_segment(base, None, 0, pool, &ranges)
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn expandable_from_a_restored_state(
        small in prop::collection::vec(page(), 0..8),
        large in prop::collection::vec(page(), 0..8),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut alloc = CachingAllocator::new(
            AllocatorConfig::parse("expandable_segments:True").unwrap(),
            None,
        );
        // The large reservation first: the small one, below it, stops where it begins.
        let mut live = restore_pages(&mut alloc, 0x7f00_0000_0000, Pool::Large, &large);
        live.extend(restore_pages(&mut alloc, 0x7e00_0000_0000, Pool::Small, &small));
        run_from(alloc, live, None, &ops);
    }

    #[test]
    fn default_config(ops in prop::collection::vec(op(), 1..120)) {
        run("", None, &ops);
    }

    #[test]
    fn with_capacity(ops in prop::collection::vec(op(), 1..120)) {
        run("", Some(600 * MIB), &ops);
    }

    #[test]
    fn max_split_size(ops in prop::collection::vec(op(), 1..120)) {
        run("max_split_size_mb:64", Some(800 * MIB), &ops);
    }

    #[test]
    fn expandable(ops in prop::collection::vec(op(), 1..120)) {
        run("expandable_segments:True", None, &ops);
    }

    #[test]
    fn expandable_with_capacity(ops in prop::collection::vec(op(), 1..120)) {
        run("expandable_segments:True,roundup_power2_divisions:[256:1,512:2,>:8]", Some(700 * MIB), &ops);
    }
}
