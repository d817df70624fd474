//! Starting from a recorded state: restored segments must behave as the ones PyTorch built.
//! Expected values are worked out by hand from `find_expandable_block`, `map_block`,
//! `try_allocate_expandable_block` and `release_blocks` (PyTorch 2.11).

use headroom_alloc::{
    AllocatorConfig, CachingAllocator, Pool, RestoreError, RestoredBlock, RestoredRange,
    SegmentAction, SegmentEvent, SegmentView,
};

const MIB: u64 = 1 << 20;
const SMALL_BASE: u64 = 0x3_0200_0000;
const LARGE_BASE: u64 = 0x2a_5400_0000;

fn expandable() -> CachingAllocator {
    let mut a = CachingAllocator::new(
        AllocatorConfig::parse("expandable_segments:True").unwrap(),
        None,
    );
    a.record_segment_events(true);
    a
}

fn free(size: u64) -> RestoredBlock {
    RestoredBlock {
        size,
        requested: None,
    }
}

fn used(size: u64) -> RestoredBlock {
    RestoredBlock {
        size,
        requested: Some(size),
    }
}

fn events(a: &CachingAllocator) -> Vec<(SegmentAction, u64, u64)> {
    a.segment_events()
        .iter()
        .map(|e: &SegmentEvent| (e.action, e.address, e.size))
        .collect()
}

fn layout(a: &CachingAllocator) -> Vec<(u64, Vec<(u64, bool)>)> {
    a.segments()
        .map(|s: SegmentView| {
            (
                s.address,
                s.blocks.iter().map(|b| (b.size, b.allocated)).collect(),
            )
        })
        .collect()
}

#[test]
fn a_page_mapped_before_the_trace_serves_small_requests_without_a_map() {
    // The harness's torch.zeros(1) mapped the small pool's first page and freed its block.
    let mut a = expandable();
    let restored = a
        .restore_expandable_segment(
            SMALL_BASE,
            None,
            0,
            Pool::Small,
            &[RestoredRange {
                address: SMALL_BASE,
                blocks: vec![free(2 * MIB)],
            }],
        )
        .unwrap();
    assert!(restored.is_empty());
    assert_eq!(a.stats().reserved_bytes.small_pool.current, 2 * MIB as i64);
    assert_eq!(
        a.stats().segment.all.current,
        0,
        "pages are not cudaMalloc segments"
    );

    let x = a.malloc(4, 0).unwrap();
    assert_eq!(a.block_address(x), SMALL_BASE);
    let y = a.malloc(MIB, 0).unwrap();
    assert_eq!(a.block_address(y), SMALL_BASE + 512);
    assert!(events(&a).is_empty());
    // 1 MiB - 512 bytes are left on page 0: the next MiB maps page 1 behind them
    // (free -> unmapped, `try_allocate_expandable_block`).
    let z = a.malloc(MIB, 0).unwrap();
    assert_eq!(a.block_address(z), SMALL_BASE + 512 + MIB);
    assert_eq!(
        events(&a),
        vec![(SegmentAction::Map, SMALL_BASE + 2 * MIB, 2 * MIB)]
    );
    assert_eq!(a.stats().reserved_bytes.all.current, 4 * MIB as i64);
}

#[test]
fn mapped_ranges_with_holes_grow_and_shrink_like_built_ones() {
    let mut a = expandable();
    let page = a.expandable_page_size(Pool::Large);
    assert_eq!(page, 20 * MIB);
    // Page 0: 5 MiB live, 15 MiB free; pages 1-2 unmapped; page 3 free.
    let live = a
        .restore_expandable_segment(
            LARGE_BASE,
            None,
            0,
            Pool::Large,
            &[
                RestoredRange {
                    address: LARGE_BASE,
                    blocks: vec![used(5 * MIB), free(15 * MIB)],
                },
                RestoredRange {
                    address: LARGE_BASE + 3 * page,
                    blocks: vec![free(page)],
                },
            ],
        )
        .unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(a.block_address(live[0]), LARGE_BASE);
    assert_eq!(a.stats().reserved_bytes.all.current, 40 * MIB as i64);
    assert_eq!(a.stats().allocated_bytes.all.current, 5 * MIB as i64);
    // One snapshot segment per contiguous mapped range.
    assert_eq!(
        layout(&a),
        vec![
            (LARGE_BASE, vec![(5 * MIB, true), (15 * MIB, false)]),
            (LARGE_BASE + 3 * page, vec![(page, false)]),
        ]
    );

    // No free block holds 30 MiB. The lowest unmapped range (pages 1-2) with the free 15 MiB
    // before it has room, so one page is mapped there rather than growing past page 3.
    let b = a.malloc(30 * MIB, 0).unwrap();
    assert_eq!(a.block_address(b), LARGE_BASE + 5 * MIB);
    assert_eq!(
        events(&a),
        vec![(SegmentAction::Map, LARGE_BASE + page, page)]
    );
    assert_eq!(
        layout(&a)[0],
        (
            LARGE_BASE,
            vec![(5 * MIB, true), (30 * MIB, true), (5 * MIB, false)]
        )
    );

    // Freed and flushed: release_blocks goes by (size, address): page 3 first, then the
    // 40 MiB range; the reservation is then wholly unmapped and released.
    a.free(b);
    a.free(live[0]);
    a.empty_cache();
    assert_eq!(
        events(&a)[1..],
        [
            (SegmentAction::Unmap, LARGE_BASE + 3 * page, page),
            (SegmentAction::Unmap, LARGE_BASE, 2 * page),
        ]
    );
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
    assert_eq!(a.segments().count(), 0);
}

#[test]
fn the_reservation_stops_at_its_limit() {
    let mut a = expandable();
    let ranges = [RestoredRange {
        address: LARGE_BASE,
        blocks: vec![free(20 * MIB)],
    }];
    a.restore_expandable_segment(
        LARGE_BASE,
        Some(LARGE_BASE + 100 * MIB),
        0,
        Pool::Large,
        &ranges,
    )
    .unwrap();
    // Another stream's reservation can start right at the limit.
    a.set_address_hint(LARGE_BASE + 100 * MIB);
    let b = a.malloc(30 * MIB, 1).unwrap();
    assert_eq!(a.block_address(b), LARGE_BASE + 100 * MIB);
}

#[test]
fn inconsistent_layouts_are_refused() {
    let mut a = expandable();
    let at = |address: u64, blocks: Vec<RestoredBlock>| [RestoredRange { address, blocks }];
    // Not whole pages: 20 MiB starting 1 MiB into the reservation.
    assert_eq!(
        a.restore_expandable_segment(
            LARGE_BASE,
            None,
            0,
            Pool::Large,
            &at(LARGE_BASE + MIB, vec![free(20 * MIB)])
        ),
        Err(RestoreError::NotWholePages {
            address: LARGE_BASE + MIB,
            size: 20 * MIB,
            page_size: 20 * MIB
        })
    );
    assert_eq!(
        a.restore_expandable_segment(
            LARGE_BASE,
            None,
            0,
            Pool::Large,
            &at(LARGE_BASE, vec![free(10 * MIB)])
        ),
        Err(RestoreError::NotWholePages {
            address: LARGE_BASE,
            size: 10 * MIB,
            page_size: 20 * MIB
        })
    );
    assert_eq!(
        a.restore_expandable_segment(
            LARGE_BASE,
            None,
            0,
            Pool::Large,
            &at(LARGE_BASE, vec![free(0), free(20 * MIB)])
        ),
        Err(RestoreError::Empty)
    );
    // Nothing was changed by the refusals; a second reservation on the same range is refused.
    assert_eq!(a.stats().reserved_bytes.all.current, 0);
    a.restore_expandable_segment(
        LARGE_BASE,
        None,
        0,
        Pool::Large,
        &at(LARGE_BASE, vec![free(20 * MIB)]),
    )
    .unwrap();
    assert!(matches!(
        a.restore_expandable_segment(
            LARGE_BASE,
            None,
            1,
            Pool::Large,
            &at(LARGE_BASE, vec![free(20 * MIB)])
        ),
        Err(RestoreError::Overlaps { .. })
    ));
    assert_eq!(a.stats().reserved_bytes.all.current, 20 * MIB as i64);
}
