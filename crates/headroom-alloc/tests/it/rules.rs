//! One test per allocator rule, with expected values worked out from the C++ by hand
//! (bench/shared/reference/allocator-spec.md §1.13, and the functions named in each test).

use headroom_alloc::{
    AllocatorConfig, BlockView, CachingAllocator, OutOfMemory, Pool, SegmentAction, SegmentEvent,
    SegmentView,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn allocator(conf: &str, capacity: Option<u64>) -> CachingAllocator {
    let mut a = CachingAllocator::new(AllocatorConfig::parse(conf).unwrap(), capacity);
    a.record_segment_events(true);
    a
}

/// (pool, segment size, [(block size, allocated)]) per segment.
type Layout = Vec<(Pool, u64, Vec<(u64, bool)>)>;

fn layout(a: &CachingAllocator) -> Layout {
    a.segments()
        .map(|s: SegmentView| {
            (
                s.pool,
                s.total_size,
                s.blocks
                    .iter()
                    .map(|b: &BlockView| (b.size, b.allocated))
                    .collect(),
            )
        })
        .collect()
}

fn actions(a: &CachingAllocator) -> Vec<(SegmentAction, u64)> {
    a.segment_events()
        .iter()
        .map(|e: &SegmentEvent| (e.action, e.size))
        .collect()
}

#[test]
fn one_byte_gets_512_bytes_of_a_new_2_mib_small_segment() {
    let mut a = allocator("", None);
    let b = a.malloc(1, 0).unwrap();
    assert_eq!(a.block_size(b), 512);
    assert_eq!(
        layout(&a),
        vec![(
            Pool::Small,
            2 * MIB,
            vec![(512, true), (2 * MIB - 512, false)]
        )]
    );
    let s = a.stats();
    assert_eq!(s.reserved_bytes.all.current, 2 * MIB as i64);
    assert_eq!(s.reserved_bytes.small_pool.current, 2 * MIB as i64);
    assert_eq!(s.allocated_bytes.all.current, 512);
    assert_eq!(s.requested_bytes.all.current, 1);
    assert_eq!(s.inactive_split.all.current, 1);
    assert_eq!(s.inactive_split_bytes.all.current, (2 * MIB - 512) as i64);
    assert_eq!(actions(&a), vec![(SegmentAction::Alloc, 2 * MIB)]);
}

#[test]
fn a_remainder_of_at_most_1_mib_is_not_split_off_a_large_block() {
    let mut a = allocator("", None);
    let first = a.malloc(1_572_864, 0).unwrap(); // 1.5 MiB -> 20 MiB segment, split
    assert_eq!(
        layout(&a),
        vec![(
            Pool::Large,
            20 * MIB,
            vec![(1_572_864, true), (20 * MIB - 1_572_864, false)]
        )]
    );
    let second = a.malloc(18 * MIB, 0).unwrap(); // 18.5 MiB free block, remainder 0.5 MiB
    assert_eq!(a.block_size(first), 1_572_864);
    assert_eq!(a.block_size(second), 18 * MIB + 512 * KIB);
    assert_eq!(a.stats().allocated_bytes.all.current, 20 * MIB as i64);
    assert_eq!(
        a.stats().requested_bytes.all.current,
        (1_572_864 + 18 * MIB) as i64
    );
    assert_eq!(a.stats().inactive_split.all.current, 0);
    assert_eq!(actions(&a), vec![(SegmentAction::Alloc, 20 * MIB)]);
}

#[test]
fn requests_of_10_mib_or_more_get_a_segment_rounded_to_2_mib() {
    let mut a = allocator("", None);
    let b = a.malloc(12 * MIB + 1, 0).unwrap();
    assert_eq!(a.block_size(b), 12 * MIB + 512);
    // remainder 2 MiB - 512 > 1 MiB: split
    assert_eq!(
        layout(&a),
        vec![(
            Pool::Large,
            14 * MIB,
            vec![(12 * MIB + 512, true), (2 * MIB - 512, false)]
        )]
    );
}

#[test]
fn requests_between_1_and_10_mib_share_a_large_segment() {
    let mut a = allocator("", None);
    let x = a.malloc(4 * MIB, 0).unwrap();
    let y = a.malloc(4 * MIB, 0).unwrap();
    let z = a.malloc(4 * MIB, 0).unwrap();
    // 20 - 8 = 12 MiB left for z: split, 8 MiB left; all three in one segment
    assert_eq!(
        layout(&a),
        vec![(
            Pool::Large,
            20 * MIB,
            vec![
                (4 * MIB, true),
                (4 * MIB, true),
                (4 * MIB, true),
                (8 * MIB, false)
            ]
        )]
    );
    assert_eq!(a.block_address(y), a.block_address(x) + 4 * MIB);
    assert_eq!(a.block_address(z), a.block_address(y) + 4 * MIB);
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole_and_limits_their_reuse() {
    let mut a = allocator("max_split_size_mb:64", None);
    let big = a.malloc(100 * MIB, 0).unwrap();
    assert_eq!(
        layout(&a),
        vec![(Pool::Large, 100 * MIB, vec![(100 * MIB, true)])]
    );
    assert_eq!(a.stats().oversize_allocations.current, 1);
    assert_eq!(a.stats().oversize_segments.current, 1);
    a.free(big);
    // 90 MiB: 100 < 90 + 20, reused whole
    let b90 = a.malloc(90 * MIB, 0).unwrap();
    assert_eq!(a.block_size(b90), 100 * MIB);
    a.free(b90);
    // 70 MiB: 100 >= 70 + 20, refused; new 70 MiB segment
    let b70 = a.malloc(70 * MIB, 0).unwrap();
    assert_eq!(a.block_size(b70), 70 * MIB);
    // 30 MiB is not oversize: the cached 100 MiB block is never used for it
    let b30 = a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(a.block_size(b30), 30 * MIB);
    assert_eq!(
        actions(&a),
        vec![
            (SegmentAction::Alloc, 100 * MIB),
            (SegmentAction::Alloc, 70 * MIB),
            (SegmentAction::Alloc, 30 * MIB)
        ]
    );
}

#[test]
fn max_non_split_rounding_widens_oversize_reuse() {
    let mut a = allocator("max_split_size_mb:64,max_non_split_rounding_mb:40", None);
    let big = a.malloc(100 * MIB, 0).unwrap();
    a.free(big);
    // 100 < 70 + 40: reused
    let b70 = a.malloc(70 * MIB, 0).unwrap();
    assert_eq!(a.block_size(b70), 100 * MIB);
}

#[test]
fn freeing_coalesces_with_free_neighbours() {
    let mut a = allocator("", None);
    let x = a.malloc(512, 0).unwrap();
    let y = a.malloc(512, 0).unwrap();
    let z = a.malloc(512, 0).unwrap();
    a.free(y);
    assert_eq!(
        layout(&a),
        vec![(
            Pool::Small,
            2 * MIB,
            vec![
                (512, true),
                (512, false),
                (512, true),
                (2 * MIB - 1536, false)
            ]
        )]
    );
    assert_eq!(a.stats().inactive_split.all.current, 2);
    a.free(x); // merges with y
    assert_eq!(
        layout(&a)[0].2,
        vec![(1024, false), (512, true), (2 * MIB - 1536, false)]
    );
    a.free(z); // merges with both sides: the segment is whole again
    assert_eq!(layout(&a)[0].2, vec![(2 * MIB, false)]);
    assert_eq!(a.stats().inactive_split.all.current, 0);
    assert_eq!(a.stats().inactive_split_bytes.all.current, 0);
    assert_eq!(a.stats().active_bytes.all.current, 0);
}

#[test]
fn best_fit_takes_the_smallest_block_then_the_lowest_address() {
    let mut a = allocator("", None);
    // Three 30 MiB segments (>= 10 MiB requests get their own segment).
    let s1 = a.malloc(30 * MIB, 0).unwrap();
    let s2 = a.malloc(30 * MIB, 0).unwrap();
    let s3 = a.malloc(12 * MIB, 0).unwrap();
    let (addr1, addr2, addr3) = (
        a.block_address(s1),
        a.block_address(s2),
        a.block_address(s3),
    );
    a.free(s2);
    a.free(s1);
    a.free(s3);
    // 11 MiB: the 12 MiB block is the best fit (remainder 1 MiB: not split)
    let b = a.malloc(11 * MIB, 0).unwrap();
    assert_eq!(a.block_address(b), addr3);
    assert_eq!(a.block_size(b), 12 * MIB);
    // 20 MiB: two equal 30 MiB blocks, the lower address wins: the newer segment, which
    // cudaMalloc placed below the older one.
    assert!(addr2 < addr1);
    let c = a.malloc(20 * MIB, 0).unwrap();
    assert_eq!(a.block_address(c), addr2);
}

#[test]
fn blocks_are_reused_only_on_their_own_stream() {
    let mut a = allocator("", None);
    let x = a.malloc(5 * MIB, 1).unwrap();
    let x_address = a.block_address(x);
    a.free(x);
    let y = a.malloc(5 * MIB, 0).unwrap();
    assert_ne!(a.block_address(y), x_address);
    assert_eq!(a.stats().reserved_bytes.all.current, 40 * MIB as i64);
    let z = a.malloc(5 * MIB, 1).unwrap();
    assert_eq!(a.block_address(z), x_address);
}

#[test]
fn empty_cache_returns_whole_free_segments_and_keeps_split_ones() {
    let mut a = allocator("", None);
    let small = a.malloc(1, 0).unwrap();
    let large = a.malloc(1_572_864, 0).unwrap();
    let kept = a.malloc(1_572_864, 0).unwrap();
    let whole = a.malloc(64 * MIB, 0).unwrap();
    a.free(large);
    a.free(whole);
    a.empty_cache();
    // The 64 MiB segment is free and whole: released. The 20 MiB one still holds `kept`,
    // the 2 MiB one holds `small`.
    assert_eq!(
        actions(&a),
        vec![
            (SegmentAction::Alloc, 2 * MIB),
            (SegmentAction::Alloc, 20 * MIB),
            (SegmentAction::Alloc, 64 * MIB),
            (SegmentAction::Free, 64 * MIB),
        ]
    );
    assert_eq!(a.stats().reserved_bytes.all.current, 22 * MIB as i64);
    assert_eq!(a.stats().segment.all.current, 2);
    a.free(small);
    a.free(kept);
    a.empty_cache();
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
    assert_eq!(a.stats().num_device_free, 3);
    assert_eq!(a.segments().count(), 0);
}

#[test]
fn empty_cache_releases_large_pool_first_in_size_then_address_order() {
    let mut a = allocator("", None);
    let x = a.malloc(40 * MIB, 0).unwrap();
    let y = a.malloc(12 * MIB, 0).unwrap();
    let z = a.malloc(1, 0).unwrap();
    let w = a.malloc(40 * MIB, 0).unwrap();
    let (wx, ww) = (a.block_address(x), a.block_address(w));
    for b in [z, x, w, y] {
        a.free(b);
    }
    a.empty_cache();
    let freed: Vec<(u64, u64)> = a
        .segment_events()
        .iter()
        .filter(|e| e.action == SegmentAction::Free)
        .map(|e| (e.size, e.address))
        .collect();
    let (lo, hi) = (wx.min(ww), wx.max(ww));
    assert_eq!(
        freed,
        vec![
            (12 * MIB, freed[0].1),
            (40 * MIB, lo),
            (40 * MIB, hi),
            (2 * MIB, freed[3].1)
        ]
    );
}

#[test]
fn a_failed_cuda_malloc_flushes_the_cache_and_retries() {
    let mut a = allocator("", Some(100 * MIB));
    let x = a.malloc(60 * MIB, 0).unwrap();
    a.free(x);
    let y = a.malloc(80 * MIB, 0).unwrap();
    assert_eq!(a.block_size(y), 80 * MIB);
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert_eq!(a.stats().num_ooms, 0);
    assert_eq!(
        actions(&a),
        vec![
            (SegmentAction::Alloc, 60 * MIB),
            (SegmentAction::Free, 60 * MIB),
            (SegmentAction::Alloc, 80 * MIB)
        ]
    );
}

/// The limit acts once a refused request frees something or gets served: until then a
/// limited allocator is an unlimited one, even after an error.
#[test]
fn the_limit_acts_when_a_refusal_changes_the_layout() {
    // Refused with nothing cached: an error, and the layout is an unlimited allocator's.
    let mut a = allocator("", Some(100 * MIB));
    let _x = a.malloc(60 * MIB, 0).unwrap();
    assert!(a.malloc(60 * MIB, 0).is_err());
    assert!(!a.limit_has_acted());
    // Refused with a whole free segment cached: it is released.
    let mut b = allocator("", Some(100 * MIB));
    let small = b.malloc(KIB, 0).unwrap();
    b.free(small);
    let _x = b.malloc(60 * MIB, 0).unwrap();
    assert!(b.malloc(60 * MIB, 0).is_err());
    assert!(b.limit_has_acted());
    // Served after the flush.
    let mut c = allocator("", Some(100 * MIB));
    let x = c.malloc(60 * MIB, 0).unwrap();
    c.free(x);
    c.malloc(80 * MIB, 0).unwrap();
    assert!(c.limit_has_acted());
    // Expandable segments are laid out by the capacity from the start.
    assert!(allocator("expandable_segments:True", Some(100 * MIB)).limit_has_acted());
    assert!(!allocator("expandable_segments:True", None).limit_has_acted());
}

#[test]
fn release_available_cached_blocks_frees_one_oversize_block_without_a_retry() {
    let mut a = allocator("max_split_size_mb:64", Some(170 * MIB));
    let big = a.malloc(100 * MIB, 0).unwrap();
    a.free(big);
    // 80 MiB: the 100 MiB block is >= 80 + 20, refused; cudaMalloc fails (180 > 170);
    // the smallest cached block >= 80 MiB is freed and the first attempt repeated.
    let b = a.malloc(80 * MIB, 0).unwrap();
    assert_eq!(a.block_size(b), 80 * MIB);
    assert_eq!(a.stats().num_alloc_retries, 0);
    assert_eq!(
        actions(&a),
        vec![
            (SegmentAction::Alloc, 100 * MIB),
            (SegmentAction::Free, 100 * MIB),
            (SegmentAction::Alloc, 80 * MIB)
        ]
    );
}

#[test]
fn release_available_cached_blocks_frees_largest_first_then_falls_back_to_the_flush() {
    let mut a = allocator("max_split_size_mb:64", Some(200 * MIB));
    let big = a.malloc(100 * MIB, 0).unwrap();
    a.free(big);
    // 150 MiB: no cached block >= 150 MiB; the 100 MiB one is freed but is not enough, so
    // release_available_cached_blocks fails and the full flush + retry follows.
    let b = a.malloc(150 * MIB, 0).unwrap();
    assert_eq!(a.block_size(b), 150 * MIB);
    assert_eq!(a.stats().num_alloc_retries, 1);
}

#[test]
fn running_out_reports_pytorch_2_11_message() {
    let mut a = allocator("", Some(100 * MIB));
    let _held = a.malloc(60 * MIB, 0).unwrap();
    let err = a.malloc(50 * MIB + 1, 0).unwrap_err();
    let OutOfMemory::Device(oom) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(oom.alloc_size, 52 * MIB);
    assert_eq!(a.stats().num_ooms, 1);
    assert_eq!(a.stats().num_alloc_retries, 1);
    // The C++ concatenation, from TORCH_CHECK_WITH(OutOfMemoryError, ...) in malloc():
    let expected = concat!(
        "CUDA out of memory. Tried to allocate ",
        "52.00 MiB",
        ". GPU ",
        "0",
        " has a total capacity of ",
        "100.00 MiB",
        " of which ",
        "40.00 MiB",
        " is free. ",
        "Of the allocated memory ",
        "60.00 MiB",
        " is allocated by PyTorch, ",
        "and ",
        "0 bytes",
        " is reserved by PyTorch but unallocated.",
        " If reserved but unallocated memory is large try setting",
        " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid",
        " fragmentation.  See documentation for Memory Management ",
        " (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    );
    assert_eq!(err.to_string(), expected);
}

#[test]
fn fragmentation_shows_in_the_oom_message() {
    let mut a = allocator("", Some(60 * MIB));
    let x = a.malloc(4 * MIB, 0).unwrap(); // 20 MiB segment
    let _y = a.malloc(4 * MIB, 0).unwrap();
    let _z = a.malloc(30 * MIB, 0).unwrap();
    a.free(x);
    // 20 MiB needs a new segment: 20 + 30 + 20 > 60; the split segment cannot be freed.
    let err = a.malloc(20 * MIB, 0).unwrap_err();
    let OutOfMemory::Device(oom) = err else {
        panic!()
    };
    assert_eq!(oom.reserved_bytes, 50 * MIB);
    assert_eq!(oom.allocated_bytes, 34 * MIB);
    assert_eq!(oom.device_free, 10 * MIB);
    assert!(
        oom.to_string()
            .contains("and 16.00 MiB is reserved by PyTorch but unallocated.")
    );
}

#[test]
fn one_exabyte_is_refused_before_the_device_allocator() {
    let mut a = allocator("", None);
    let err = a.malloc(1 << 60, 0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "CUDA out of memory. Tried to allocate more than 1EB memory."
    );
    assert_eq!(a.stats().num_ooms, 0);
}

#[test]
fn roundup_power2_divisions_round_the_block() {
    let mut a = allocator("roundup_power2_divisions:4", None);
    let b = a.malloc(5_000_000, 0).unwrap();
    assert_eq!(a.block_size(b), 5_242_880);
}

#[test]
fn expandable_segments_map_whole_pages_for_the_rounded_request() {
    let mut a = allocator("expandable_segments:True", None);
    let b = a.malloc(101 * MIB, 0).unwrap();
    assert_eq!(a.block_size(b), 101 * MIB);
    assert_eq!(actions(&a), vec![(SegmentAction::Map, 120 * MIB)]);
    assert_eq!(a.stats().reserved_bytes.all.current, 120 * MIB as i64);
    // Expandable segments do not count as cudaMalloc segments.
    assert_eq!(a.stats().segment.all.current, 0);
    let segs: Vec<SegmentView> = a.segments().collect();
    assert_eq!(segs.len(), 1);
    assert!(segs[0].is_expandable);
    assert_eq!(
        segs[0]
            .blocks
            .iter()
            .map(|b| (b.size, b.allocated))
            .collect::<Vec<_>>(),
        vec![(101 * MIB, true), (19 * MIB, false)]
    );
    a.free(b);
    a.empty_cache();
    assert_eq!(actions(&a)[1..], [(SegmentAction::Unmap, 120 * MIB)]);
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
    assert_eq!(a.segments().count(), 0);
}

#[test]
fn expandable_segments_grow_at_the_end_of_the_mapped_range() {
    let mut a = allocator("expandable_segments:True", None);
    let x = a.malloc(15 * MIB, 0).unwrap(); // one 20 MiB page, 5 MiB left
    let y = a.malloc(15 * MIB, 0).unwrap(); // 5 MiB free + one more page
    assert_eq!(a.block_address(y), a.block_address(x) + 15 * MIB);
    assert_eq!(
        actions(&a),
        vec![
            (SegmentAction::Map, 20 * MIB),
            (SegmentAction::Map, 20 * MIB)
        ]
    );
    let segs: Vec<SegmentView> = a.segments().collect();
    assert_eq!(segs.len(), 1);
    assert_eq!(segs[0].total_size, 40 * MIB);
    // small requests use the small pool's 2 MiB pages
    let _s = a.malloc(1, 0).unwrap();
    assert_eq!(actions(&a)[2], (SegmentAction::Map, 2 * MIB));
    assert_eq!(a.stats().reserved_bytes.small_pool.current, 2 * MIB as i64);
}

#[test]
fn expandable_release_unmaps_only_whole_free_pages() {
    let mut a = allocator("expandable_segments:True", None);
    let x = a.malloc(30 * MIB, 0).unwrap(); // pages 0-1 (40 MiB), 10 MiB free at the end
    let y = a.malloc(10 * MIB, 0).unwrap(); // fills the rest of page 1
    let z = a.malloc(20 * MIB, 0).unwrap(); // page 2
    a.free(x);
    a.free(z);
    a.empty_cache();
    // x spans page 0 and half of page 1: only page 0 is unmapped; z's page 2 is unmapped.
    assert_eq!(
        actions(&a)[..2],
        [
            (SegmentAction::Map, 40 * MIB),
            (SegmentAction::Map, 20 * MIB)
        ]
    );
    // Release goes in (size, address) order: z's 20 MiB block first, then x's.
    assert_eq!(
        actions(&a)[2..],
        [
            (SegmentAction::Unmap, 20 * MIB),
            (SegmentAction::Unmap, 20 * MIB)
        ]
    );
    assert_eq!(a.stats().reserved_bytes.all.current, 20 * MIB as i64);
    let segs: Vec<SegmentView> = a.segments().collect();
    assert_eq!(segs.len(), 1);
    assert_eq!(
        segs[0]
            .blocks
            .iter()
            .map(|b| (b.size, b.allocated))
            .collect::<Vec<_>>(),
        vec![(10 * MIB, false), (10 * MIB, true)]
    );
    a.free(y);
}

#[test]
fn expandable_segments_hit_the_capacity_page_by_page() {
    let mut a = allocator("expandable_segments:True", Some(50 * MIB));
    let _x = a.malloc(30 * MIB, 0).unwrap(); // 40 MiB mapped
    let err = a.malloc(15 * MIB, 0).unwrap_err(); // 10 MiB free + one more 20 MiB page > 50
    let OutOfMemory::Device(oom) = err else {
        panic!()
    };
    // The message names get_allocation_size (15 MiB rounded to 2 MiB), not the page.
    assert_eq!(oom.alloc_size, 16 * MIB);
    assert_eq!(oom.reserved_bytes, 40 * MIB);
}

#[test]
fn pending_frees_stay_active_until_completed_or_flushed() {
    let mut a = allocator("", None);
    let x = a.malloc(512, 0).unwrap();
    let y = a.malloc(512, 0).unwrap();
    a.free_requested(x);
    assert_eq!(a.stats().allocated_bytes.all.current, 512);
    assert_eq!(a.stats().active_bytes.all.current, 1024);
    // x cannot be reused: a new 512 B block comes after y
    let z = a.malloc(512, 0).unwrap();
    assert_eq!(a.block_address(z), a.block_address(y) + 512);
    a.free(y);
    // y cannot merge with the pending x
    assert_eq!(a.segments().next().unwrap().blocks.len(), 4);
    a.complete_free(x);
    assert_eq!(a.stats().active_bytes.all.current, 512);
    assert_eq!(
        a.segments()
            .next()
            .unwrap()
            .blocks
            .iter()
            .map(|b| (b.size, b.allocated))
            .collect::<Vec<_>>(),
        vec![(1024, false), (512, true), (2 * MIB - 1536, false)]
    );
    let w = a.malloc(512, 0).unwrap();
    a.free_requested(w);
    a.empty_cache();
    assert_eq!(a.stats().active.all.current, 1);
}

#[test]
fn peak_stats_reset_to_current() {
    let mut a = allocator("", None);
    let x = a.malloc(30 * MIB, 0).unwrap();
    a.free(x);
    assert_eq!(a.stats().allocated_bytes.all.peak, 30 * MIB as i64);
    a.reset_peak_stats();
    assert_eq!(a.stats().allocated_bytes.all.peak, 0);
    assert_eq!(a.stats().reserved_bytes.all.peak, 30 * MIB as i64);
}

#[test]
fn address_hints_place_segments() {
    let mut a = allocator("", None);
    a.set_address_hint(0x7f00_0000_0000);
    let x = a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(a.block_address(x), 0x7f00_0000_0000);
    // A hint overlapping a live segment is ignored.
    a.set_address_hint(0x7f00_0000_0000 + MIB);
    let y = a.malloc(30 * MIB, 0).unwrap();
    assert_ne!(a.block_address(y), 0x7f00_0000_0000 + MIB);
    // A hint not used by its malloc does not leak into the next one.
    a.set_address_hint(0x7e00_0000_0000);
    let _small = a.malloc(1, 0).unwrap();
    let z = a.malloc(30 * MIB, 0).unwrap();
    assert_ne!(a.block_address(z), 0x7e00_0000_0000);
}
