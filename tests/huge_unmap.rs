//! A huge mapping through the reverse-map operations as one unit, over real
//! four-level tables (the `x86_64` crate's, in host memory) that the mock's
//! MMU walks, caching one TLB entry for the whole 2 MiB page: `try_to_unmap`
//! of the huge frame at the page's first address clears the one entry,
//! moves its dirty bit to the frame, and flushes it with one invalidation
//! at the 2 MiB stride; the oracle judges each of its 512 frames at the
//! free. `page_referenced` clears its one accessed bit.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use common::x86_tables::{machine_with, map, user_rw, HostMmu, OneMapping, Pages, Tables, GIB};
use std::ops::ControlFlow;
use tlb_batch::arch::mock::{Arm64Like, Fault, MockConfig, MockMachine, Violation};
use tlb_batch::mapper::OffsetSpace;

use tlb_batch::{
    page_referenced, try_to_unmap, Error, Frame, Mapping, PageSize, PageTable, Pte, Rmap, SwapResult,
    TlbFlushUnmapBatch, TtuFlags, PAGE_SIZE,
};
use x86_64::structures::paging::{PageTableFlags as F, Size1GiB, Size2MiB};

const TWO: u64 = 0x4000_0000;
const PIECES: u64 = 512;

/// Tables with one 2 MiB page at `TWO` mapping a huge frame of the
/// machine's (512 frames in a row), and a machine of 3 CPUs whose address
/// space they translate.
fn huge_space() -> (Tables, MockMachine, std::sync::Arc<tlb_batch::MmTlbState>, Frame) {
    let mut t = Tables::new();
    let (m, mm) = machine_with(3, &t);
    let huge = m.alloc_huge_frame(PageSize::SIZE_2M).unwrap();
    {
        let (mut mapper, mut pool) = t.mapper();
        map::<Size2MiB>(&mut mapper, &mut pool, TWO, huge.addr(), user_rw());
    }
    (t, m, mm, huge)
}

/// The reverse map of the huge frame, mapped whole at `TWO`.
fn whole<'s, 'a>(space: &'s OffsetSpace<'a>, huge: Frame) -> OneMapping<'s, 'a> {
    OneMapping {
        space,
        frame: huge,
        va: TWO,
        pages: Pages::default(),
    }
}

fn piece(huge: Frame, i: u64) -> Frame {
    Frame(huge.0 + i)
}

fn free_all(m: &MockMachine, huge: Frame) {
    free_all_of(m, huge)
}

#[test]
fn the_mmu_caches_one_entry_for_the_whole_huge_page() {
    let (_t, m, mm, huge) = huge_space();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.write(TWO + 3 * PAGE_SIZE, 7).unwrap();
    assert_eq!(m.frame_data(piece(huge, 3)).unwrap(), 7, "the piece's own frame");
    let cached = m.cached_translations(piece(huge, 400));
    assert_eq!(cached.len(), 1, "one entry reaches every piece");
    assert_eq!((cached[0].1.size, cached[0].1.frame), (PageSize::SIZE_2M, huge));
    // A read of another piece hits the same entry: still one.
    cpu1.read(TWO + 400 * PAGE_SIZE).unwrap();
    assert_eq!(m.all_entries().len(), 1);
    // Freeing any piece while it is cached is caught (the control for
    // the tests below).
    m.free_frame(piece(huge, 200)).unwrap();
    assert!(matches!(
        m.violations()[..],
        [Violation::FreedWhileCached { frame, .. }] if frame == piece(huge, 200)
    ));
}

/// Batched: the entry goes at once, the flush waits in the batch as one
/// invalidation (not 512 pages, which would pass the full-flush ceiling),
/// and after it every piece is freed with no CPU caching any.
#[test]
fn a_huge_page_is_unmapped_whole_and_flushed_with_one_invalidation() {
    let (mut t, m, mm, huge) = huge_space();
    let (mut mapper, _) = t.mapper();
    let space = OffsetSpace::new(&mut mapper, &mm);
    let (cpu0, cpu1, cpu2) = (m.cpu(0).unwrap(), m.cpu(1).unwrap(), m.cpu(2).unwrap());
    cpu1.switch_to(&mm).unwrap();
    cpu2.switch_to(&mm).unwrap();
    cpu1.write(TWO + 3 * PAGE_SIZE, 7).unwrap();
    cpu2.read(TWO + 300 * PAGE_SIZE).unwrap();
    let rmap = whole(&space, huge);
    let mut batch = TlbFlushUnmapBatch::new();
    let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
    let r = try_to_unmap(&cpu0, &rmap, huge, flags, &mut batch);
    assert_eq!(
        r,
        Ok(SwapResult::SuccessCached),
        "written through: a writable entry survives"
    );
    assert_eq!(
        space.lookup(TWO + 7 * PAGE_SIZE),
        Pte::EMPTY,
        "the one entry is gone"
    );
    assert!(
        rmap.pages.0.lock().unwrap().contains(&huge),
        "its dirty bit moved to the frame"
    );
    assert_eq!(batch.pending_pages(), 1, "one invalidation");
    assert!(!batch.is_full_flush());
    assert_eq!(
        m.cached_translations(piece(huge, 511)).len(),
        2,
        "cached until the flush"
    );

    let report = batch.flush(&cpu0).unwrap();
    assert_eq!(report.remote_cpus, 2);
    assert!(
        m.all_entries().is_empty(),
        "one invalidation dropped both huge entries"
    );
    free_all(&m, huge);
    assert_eq!(
        cpu1.read(TWO + 5 * PAGE_SIZE),
        Err(Fault::NotMapped {
            va: TWO + 5 * PAGE_SIZE
        })
    );
    assert_eq!(m.violations(), []);
}

/// Not batched: the flush is done before the call returns.
#[test]
fn an_immediate_unmap_of_a_huge_page_flushes_it_before_it_returns() {
    let (mut t, m, mm, huge) = huge_space();
    let (mut mapper, _) = t.mapper();
    let space = OffsetSpace::new(&mut mapper, &mm);
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.switch_to(&mm).unwrap();
    cpu1.read(TWO + 42 * PAGE_SIZE).unwrap();
    let rmap = whole(&space, huge);
    let mut batch = TlbFlushUnmapBatch::new();
    let r = try_to_unmap(&cpu0, &rmap, huge, TtuFlags::IGNORE_ACCESS, &mut batch);
    assert_eq!(r, Ok(SwapResult::Success));
    assert!(batch.is_empty() && m.all_entries().is_empty());
    assert!(
        rmap.pages.0.lock().unwrap().is_empty(),
        "never written: not dirty"
    );
    free_all(&m, huge);
    assert_eq!(m.violations(), []);
}

/// Aging: the one accessed bit all the pieces share is cleared once, and a
/// young huge page is not unmapped.
#[test]
fn a_huge_page_is_aged_by_its_one_accessed_bit() {
    let (mut t, m, mm, huge) = huge_space();
    let (mut mapper, _) = t.mapper();
    let space = OffsetSpace::new(&mut mapper, &mm);
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.switch_to(&mm).unwrap();
    cpu1.read(TWO + 9 * PAGE_SIZE).unwrap();
    let rmap = whole(&space, huge);
    let mut batch = TlbFlushUnmapBatch::new();
    let r = try_to_unmap(&cpu0, &rmap, huge, TtuFlags::BATCH_FLUSH, &mut batch);
    assert_eq!(r, Ok(SwapResult::Fail), "young: it stays");
    assert!(space.lookup(TWO + 9 * PAGE_SIZE).is_present());
    assert!(
        !space.lookup(TWO + 100 * PAGE_SIZE).is_accessed(),
        "the shared bit went"
    );
    let found = page_referenced(&cpu0, &rmap, huge, &mut batch).unwrap();
    assert_eq!((found.mapped, found.referenced), (1, 0));
    // A fresh access by a CPU without the entry sets the bit again.
    let cpu2 = m.cpu(2).unwrap();
    cpu2.switch_to(&mm).unwrap();
    cpu2.read(TWO + 500 * PAGE_SIZE).unwrap();
    let found = page_referenced(&cpu0, &rmap, huge, &mut batch).unwrap();
    assert_eq!((found.mapped, found.referenced), (1, 1));
    assert!(batch.is_empty(), "x86 needs no flush for an accessed bit");
    assert_eq!(m.violations(), []);
}

/// `OneMapping` whose frame is hardware-poisoned.
struct Poisoned<'r, 's, 'a>(&'r OneMapping<'s, 'a>);

// SAFETY: forwards the walk of a map that reports its one mapping.
unsafe impl<'a> Rmap for Poisoned<'_, '_, 'a> {
    type Space = OffsetSpace<'a>;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        self.0.walk(frame, visit)
    }

    fn set_dirty(&self, frame: Frame) {
        self.0.set_dirty(frame)
    }

    fn is_hwpoisoned(&self, _frame: Frame) -> bool {
        true
    }
}

/// Migration and hwpoison write entries a huge entry has no form for: a
/// huge mapping is refused whole, nothing changed.
#[test]
fn migration_of_a_huge_mapping_is_refused_whole() {
    let (mut t, m, mm, huge) = huge_space();
    let (mut mapper, _) = t.mapper();
    let space = OffsetSpace::new(&mut mapper, &mm);
    let cpu0 = m.cpu(0).unwrap();
    let rmap = whole(&space, huge);
    let mut batch = TlbFlushUnmapBatch::new();
    let refused = Err(Error::HugePage {
        va: TWO,
        size: PageSize::SIZE_2M.bytes(),
    });
    let flags = TtuFlags::MIGRATION | TtuFlags::IGNORE_ACCESS | TtuFlags::BATCH_FLUSH;
    assert_eq!(try_to_unmap(&cpu0, &rmap, huge, flags, &mut batch), refused);
    let poisoned = Poisoned(&rmap);
    assert_eq!(
        try_to_unmap(&cpu0, &poisoned, huge, TtuFlags::IGNORE_ACCESS, &mut batch),
        refused
    );
    assert!(space.lookup(TWO).maps(huge) && batch.is_empty() && !mm.batched_flush_pending());
}

/// A 1 GiB page (host memory: not one the machine can back, so no CPU
/// touches it): one entry cleared, one invalidation at the 1 GiB stride.
#[test]
fn a_gib_page_is_one_entry_and_one_invalidation() {
    let mut t = Tables::new();
    let (m, mm) = machine_with(2, &t);
    let one = 0x80_0000_0000;
    {
        let (mut mapper, mut pool) = t.mapper();
        map::<Size1GiB>(&mut mapper, &mut pool, one, 0x40_0000_0000, user_rw() | F::DIRTY);
    }
    let (mut mapper, _) = t.mapper();
    let space = OffsetSpace::new(&mut mapper, &mm);
    let cpu0 = m.cpu(0).unwrap();
    let m1 = m.cpu(1).unwrap();
    m1.switch_to(&mm).unwrap();
    let head = Frame(0x40_0000_0000 >> 12);
    let rmap = OneMapping {
        space: &space,
        frame: head,
        va: one,
        pages: Pages::default(),
    };
    let mut batch = TlbFlushUnmapBatch::new();
    let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
    assert_eq!(
        try_to_unmap(&cpu0, &rmap, head, flags, &mut batch),
        Ok(SwapResult::SuccessCached)
    );
    assert_eq!(space.lookup(one + GIB - PAGE_SIZE), Pte::EMPTY);
    assert_eq!((batch.pending_pages(), batch.is_full_flush()), (1, false));
    assert!(rmap.pages.0.lock().unwrap().contains(&head));
    batch.flush(&cpu0).unwrap();
    assert_eq!(m.violations(), []);
}

/// On arm64 the batch issues each page's broadcast `TLBI` as it is added
/// and its flush only waits for them: the huge page's one invalidation is
/// issued at the unmap, at the huge page's address, and drops every CPU's
/// entry for it.
#[test]
fn on_arm64_a_huge_page_is_invalidated_once_as_it_is_added() {
    let mut t = Tables::new();
    let m = MockMachine::<Arm64Like>::with_model(MockConfig::x86_like(3)).unwrap();
    let root = t.root_addr();
    let mm = m.new_mm_at(common::asid(1), root).unwrap();
    m.attach_table(&mm, std::sync::Arc::new(HostMmu { root }))
        .unwrap();
    let huge = m.alloc_huge_frame(PageSize::SIZE_2M).unwrap();
    {
        let (mut mapper, mut pool) = t.mapper();
        map::<Size2MiB>(&mut mapper, &mut pool, TWO, huge.addr(), user_rw());
    }
    let (mut mapper, _) = t.mapper();
    let space = OffsetSpace::new(&mut mapper, &mm);
    let (cpu0, cpu1, cpu2) = (m.cpu(0).unwrap(), m.cpu(1).unwrap(), m.cpu(2).unwrap());
    cpu1.switch_to(&mm).unwrap();
    cpu2.switch_to(&mm).unwrap();
    cpu1.read(TWO + 77 * PAGE_SIZE).unwrap();
    cpu2.read(TWO + 400 * PAGE_SIZE).unwrap();
    let rmap = whole(&space, huge);
    let mut batch = TlbFlushUnmapBatch::new();
    let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
    let r = try_to_unmap(&cpu0, &rmap, huge, flags, &mut batch);
    assert_eq!(r, Ok(SwapResult::SuccessCached));
    assert_eq!(batch.pending_pages(), 1);
    batch.flush(&cpu0).unwrap();
    assert!(
        m.all_entries().is_empty(),
        "the one broadcast dropped both CPUs' entries"
    );
    free_all_of(&m, huge);
    assert_eq!(m.violations(), []);
}

fn free_all_of<M: tlb_batch::arch::mock::Model>(m: &MockMachine<M>, huge: Frame) {
    for i in 0..PIECES {
        m.free_frame(piece(huge, i)).unwrap();
    }
}
