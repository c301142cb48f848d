//! The reverse-map operations and huge pages, over real four-level tables
//! (the `x86_64` crate's, in host memory, attached to the mock): a frame
//! that a 2 MiB or 1 GiB entry maps is refused by `try_to_unmap`,
//! `page_referenced` and `migrate_pages` with `Error::HugePage` before
//! anything changes. Before `PageTable::entry_size`, `try_to_unmap` of such
//! a frame cleared nothing yet recorded a deferred flush and marked the
//! space as having one pending, and `page_referenced` cleared the accessed
//! bit the whole huge entry shares while keeping an aging epoch for one
//! 4 KiB piece only.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use common::x86_tables::{machine_with, map, user_rw, OneMapping, Pages, Tables, GIB, MIB2};
use tlb_batch::mapper::OffsetSpace;
use tlb_batch::{
    migrate_pages, try_to_unmap, Error, Frame, FreeFrames, MigrateBacking, MigrateFailure, MigrateOutcome,
    OwnedFrame, PageSize, PageTable, SwapResult, TlbFlushUnmapBatch, TtuFlags, UnmapBatch, WritebackFrame,
    PAGE_SIZE,
};
use x86_64::structures::paging::{PageTableFlags as F, Size1GiB, Size2MiB, Size4KiB};

const TWO: u64 = 0x4000_0000; // a 2 MiB page here
const ONE: u64 = 0x80_0000_0000; // a 1 GiB page here
const SMALL: u64 = TWO - PAGE_SIZE; // a 4 KiB page just below the 2 MiB one
const TWO_PHYS: u64 = 0x1_0000_0000;
const ONE_PHYS: u64 = 0x40_0000_0000;

/// Tables with a 2 MiB page at `TWO`, a 1 GiB page at `ONE` and a 4 KiB
/// page at `SMALL`, every one accessed.
fn huge_tables() -> (Tables, Frame) {
    let mut t = Tables::new();
    let small = Frame(0x7_0000);
    {
        let (mut mapper, mut pool) = t.mapper();
        let accessed = user_rw() | F::ACCESSED;
        map::<Size2MiB>(&mut mapper, &mut pool, TWO, TWO_PHYS, accessed);
        map::<Size1GiB>(&mut mapper, &mut pool, ONE, ONE_PHYS, accessed);
        map::<Size4KiB>(&mut mapper, &mut pool, SMALL, small.addr(), accessed);
    }
    (t, small)
}

#[test]
fn entry_size_reports_each_entrys_size() {
    let (mut t, _) = huge_tables();
    let (_m, mm) = machine_with(2, &t);
    let (mut mapper, _) = t.mapper();
    let space = OffsetSpace::new(&mut mapper, &mm);
    for (va, size) in [
        (TWO, PageSize::SIZE_2M),
        (TWO + MIB2 - PAGE_SIZE, PageSize::SIZE_2M),
        (ONE + 7 * MIB2 + 3 * PAGE_SIZE, PageSize::SIZE_1G),
        (SMALL, PageSize::SIZE_4K),
        (TWO + MIB2, PageSize::SIZE_4K), // nothing mapped there
        (ONE + GIB, PageSize::SIZE_4K),  // nor there
        (1 << 47, PageSize::SIZE_4K),    // not canonical
    ] {
        assert_eq!(space.entry_size(va), size, "{va:#x}");
    }
}

/// A 4 KiB piece of a huge page other than its first, the second, one
/// inside and the last, of a 2 MiB and of a 1 GiB page: unmap (batched or
/// not, young or not) and aging are refused with the huge page's start
/// and size, and nothing is recorded or changed: no deferred flush, no
/// pending mark on the space, the accessed bit the pieces share still set,
/// the entry still mapped. (At its first address the mapping is the whole
/// huge page: tests/huge_unmap.rs.)
#[test]
fn unmap_and_aging_of_a_piece_of_a_huge_page_are_refused_with_nothing_changed() {
    let (mut t, _) = huge_tables();
    let (m, mm) = machine_with(2, &t);
    let (mut mapper, _) = t.mapper();
    let space = OffsetSpace::new(&mut mapper, &mm);
    let cpu0 = m.cpu(0).unwrap();
    let cases = [(TWO, TWO_PHYS, MIB2), (ONE, ONE_PHYS, GIB)];
    for (base, phys, size) in cases {
        for offset in [PAGE_SIZE, 5 * PAGE_SIZE, size - PAGE_SIZE] {
            let va = base + offset;
            let rmap = OneMapping {
                space: &space,
                frame: Frame((phys + offset) >> 12),
                va,
                pages: Pages::default(),
            };
            assert!(space.lookup(va).maps(rmap.frame), "the piece maps the frame");
            rmap.assert_walks_refused(&cpu0, Error::HugePage { va: base, size });
            let pte = space.lookup(va);
            assert!(pte.maps(rmap.frame) && pte.is_accessed(), "{va:#x}: unchanged");
            assert!(!mm.batched_flush_pending(), "no flush marked pending");
        }
    }
    assert_eq!(m.violations(), []);
}

/// A place the reverse map still lists, where a huge page now maps some
/// other frame, is not a mapping of the frame: it is stepped over, not
/// refused, and the frame is reported unmapped. The 4 KiB page beside the
/// huge one is unmapped as before.
#[test]
fn a_listed_place_a_huge_page_maps_another_frame_at_is_no_mapping() {
    let (mut t, small) = huge_tables();
    let (m, mm) = machine_with(2, &t);
    let (mut mapper, _) = t.mapper();
    let space = OffsetSpace::new(&mut mapper, &mm);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let stale = OneMapping {
        space: &space,
        frame: Frame(0x9_9999),
        va: TWO + PAGE_SIZE,
        pages: Pages::default(),
    };
    let r = try_to_unmap(&cpu0, &stale, stale.frame, TtuFlags::BATCH_FLUSH, &mut batch);
    assert_eq!(r, Ok(SwapResult::Success));
    assert!(batch.is_empty());

    let beside = OneMapping {
        space: &space,
        frame: small,
        va: SMALL,
        pages: Pages::default(),
    };
    let r = try_to_unmap(&cpu0, &beside, small, TtuFlags::IGNORE_ACCESS, &mut batch);
    assert_eq!(r, Ok(SwapResult::Success));
    assert!(!space.lookup(SMALL).is_present());
    assert!(space.lookup(TWO).is_present(), "the huge page is left as it is");
    assert_eq!(m.violations(), []);
}

/// Migration services that must never be reached for a refused frame.
struct NoTargets(usize);

impl FreeFrames for NoTargets {
    fn free_batch<const N: usize>(&mut self, _frames: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        // Refuses every frame: they come back to the caller.
    }
}

impl MigrateBacking for NoTargets {
    fn alloc_target(&mut self, _old: Frame) -> Option<OwnedFrame> {
        self.0 += 1;
        None
    }
    fn copy_frame(&mut self, _from: WritebackFrame<'_>, _to: &OwnedFrame) {
        self.0 += 1;
    }
    fn move_mappings(&mut self, _old: Frame, _new: Frame) {
        self.0 += 1;
    }
}

/// Migration of a piece of a huge page: reported failed with the refusal,
/// the frame handed back, no service called, the entry unchanged.
#[test]
fn migration_of_a_piece_of_a_huge_page_is_refused_and_hands_the_frame_back() {
    let (mut t, _) = huge_tables();
    let (m, mm) = machine_with(2, &t);
    let (mut mapper, _) = t.mapper();
    let space = OffsetSpace::new(&mut mapper, &mm);
    let cpu0 = m.cpu(0).unwrap();
    let frame = Frame((TWO_PHYS >> 12) + 3);
    let rmap = OneMapping {
        space: &space,
        frame,
        va: TWO + 3 * PAGE_SIZE,
        pages: Pages::default(),
    };
    let mut backing = NoTargets(0);
    let mut batch = UnmapBatch::<4>::new();
    let mut outcomes = Vec::new();
    // SAFETY: the test owns the frame's one claim (host memory the mock
    // never hands out).
    let owned = unsafe { OwnedFrame::new(frame) };
    let summary = migrate_pages(&cpu0, &rmap, &mut backing, &mut batch, [owned], &mut |o| {
        outcomes.push(o)
    })
    .map_err(|_| "the flush does not fail")
    .unwrap();
    assert_eq!(summary.migrated, 0);
    let [MigrateOutcome::Failed { frame: back, reason }] = &outcomes[..] else {
        panic!("one failure, got {outcomes:?}");
    };
    assert_eq!(back.frame(), frame);
    assert_eq!(
        *reason,
        MigrateFailure::Failed(Error::HugePage { va: TWO, size: MIB2 })
    );
    assert_eq!(backing.0, 0, "no target allocated, nothing copied or moved");
    assert!(space.lookup(TWO + 3 * PAGE_SIZE).maps(frame) && !mm.batched_flush_pending());
    assert_eq!(m.violations(), []);
    // The frame came back through the outcome; forget it (host memory).
    std::mem::forget(outcomes);
}
