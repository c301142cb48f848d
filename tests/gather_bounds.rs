//! Page tables that adjacent teardowns empty, on the mock machine:
//! `MmuGather::unmap_range_bounded` frees a leaf table that two munmaps
//! each covered half of, `unmap_range` keeps it (as before bounds), bounds
//! that would cover a still-mapped page never free its table, bad bounds
//! are refused with nothing changed, and the flush drops the pointers
//! other CPUs' walk caches hold to a freed table.

mod common;

use std::sync::Arc;

use common::{asid, config, va};
use tlb_batch::arch::mock::{Fault, MockKernel, MockMachine, MockRmap, Violation};
use tlb_batch::{
    Error, Frame, FrameKind, MmTlbState, MmuGather, OwnedFrame, PageRange, TableBounds, TableFreePolicy,
    TeardownSummary, PAGE_SIZE,
};

/// An address space with a page at test page 0 (the mapping below), one
/// at test page 2048 (the mapping above), and `pages` in between, each
/// written by CPU 1, which keeps running the space: its walk cache holds a
/// pointer to every leaf table.
fn space_with<'m>(m: &'m MockMachine, pages: &[usize]) -> (MockRmap<'m>, Arc<MmTlbState>, Vec<Frame>) {
    let mm = m.new_mm(asid(1)).unwrap();
    let rmap = MockRmap::new(m, vec![m.space(&mm)]);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    let frames = [0, 2048]
        .iter()
        .chain(pages)
        .map(|&i| {
            let f = m.map_new(&mm, va(i), true).unwrap();
            cpu1.write(va(i), i as u64).unwrap();
            f
        })
        .collect();
    (rmap, mm, frames)
}

/// The bounds a kernel knows for a munmap between test pages 0 and 2048:
/// from the end of the page below to the start of the page above.
fn gap() -> TableBounds {
    TableBounds::new(va(1), va(2048)).unwrap()
}

/// One teardown of test pages `first..end`, tables freed within `bounds`
/// (or, with `None`, only those wholly inside the range), every free
/// accepted.
fn unmap(
    m: &MockMachine,
    rmap: &MockRmap<'_>,
    first: usize,
    end: usize,
    bounds: Option<TableBounds>,
) -> Result<TeardownSummary, Error> {
    let mut kernel = MockKernel::new(rmap);
    let mut gather = MmuGather::<64>::new();
    let range = common::pages(first, end);
    let mut back = Vec::new();
    let mut handback = |f: OwnedFrame, k: FrameKind| back.push((f.into_frame(), k));
    let cpu0 = m.cpu(0).unwrap();
    let space = &rmap.spaces()[0];
    let policy = &mut TableFreePolicy::AfterFlush;
    let summary = match bounds {
        Some(bounds) => {
            gather.unmap_range_bounded(&cpu0, space, &mut kernel, range, bounds, policy, &mut handback)
        }
        None => gather.unmap_range(&cpu0, space, &mut kernel, range, true, policy, &mut handback),
    };
    assert!(gather.is_empty());
    assert_eq!(back, [], "nothing handed back");
    summary
}

/// Two munmaps that each cover half of a leaf table: with the bounds the
/// kernel knows, the second frees the table (the first cannot, the other
/// half is still mapped); the flush leaves no usable pointer to it in CPU
/// 1's walk cache, and the pages around stay mapped.
#[test]
fn two_half_teardowns_with_bounds_free_the_leaf_table() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, mm, frames) = space_with(&m, &[512, 700, 800, 1023]);
    let table = m.leaf_table(&mm, va(512)).unwrap();

    let first = unmap(&m, &rmap, 512, 768, Some(gap())).unwrap();
    assert_eq!(
        (first.pages_unmapped, first.tables_freed),
        (2, 0),
        "the other half is mapped"
    );
    assert_eq!(m.leaf_table(&mm, va(512)), Some(table));
    let cpu1 = m.cpu(1).unwrap();
    // CPU 1 walks through the table again (a pointer in its walk cache).
    assert_eq!(cpu1.read(va(800)), Ok(800));

    let second = unmap(&m, &rmap, 768, 1024, Some(gap())).unwrap();
    assert_eq!((second.pages_unmapped, second.tables_freed), (2, 1));
    assert_eq!(second.flushes, 1, "one flush for the pages and the table");
    assert_eq!(m.leaf_table(&mm, va(512)), None, "the emptied table is gone");
    assert_eq!(cpu1.read(va(600)), Err(Fault::NotMapped { va: va(600) }));
    assert_eq!(cpu1.read(va(0)), Ok(0));
    assert_eq!(cpu1.read(va(2048)), Ok(2048));
    assert_eq!(m.check_coherent(&mm, common::pages(0, 2049)), 0);
    assert_eq!(m.violations(), []);
    assert!(m.pte(&mm, va(0)).unwrap().maps(frames[0]));
}

/// The same two munmaps without bounds free nothing: the table is covered
/// whole by neither range, and stays linked and empty (today's behaviour).
#[test]
fn without_bounds_the_half_covered_table_stays() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, mm, _) = space_with(&m, &[512, 1023]);
    let table = m.leaf_table(&mm, va(512)).unwrap();
    for (first, end) in [(512, 768), (768, 1024)] {
        let s = unmap(&m, &rmap, first, end, None).unwrap();
        assert_eq!((s.pages_unmapped, s.tables_freed), (1, 0));
    }
    assert_eq!(m.leaf_table(&mm, va(512)), Some(table), "empty, still linked");
    // A bounded teardown of the gap's empty part finds and frees it.
    let s = unmap(&m, &rmap, 600, 601, Some(gap())).unwrap();
    assert_eq!((s.pages_unmapped, s.tables_freed), (0, 1));
    assert_eq!(m.leaf_table(&mm, va(512)), None);
    assert_eq!(m.violations(), []);
}

/// Bounds that wrongly claim a still-mapped page is free: the table that
/// maps it is never freed, and the page stays mapped and readable (from a
/// CPU whose walk cache points to the table, and one that walks afresh).
#[test]
fn a_bound_over_a_still_mapped_page_never_frees_its_table() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, mm, frames) = space_with(&m, &[512, 900]);
    let table = m.leaf_table(&mm, va(512)).unwrap();
    // The kernel says nothing is mapped from page 0 up to 2048: wrong for
    // page 900 (and page 0, whose table the range does not touch).
    let wide = TableBounds::new(va(0), va(2048)).unwrap();
    let s = unmap(&m, &rmap, 512, 768, Some(wide)).unwrap();
    assert_eq!((s.pages_unmapped, s.tables_freed), (1, 0));
    assert_eq!(m.leaf_table(&mm, va(512)), Some(table));
    assert!(m.pte(&mm, va(900)).unwrap().maps(frames[3]));
    assert_eq!(m.cpu(1).unwrap().read(va(900)), Ok(900));
    let cpu2 = m.cpu(2).unwrap();
    cpu2.switch_to(&mm).unwrap();
    assert_eq!(cpu2.read(va(900)), Ok(900));
    assert_eq!(m.violations(), []);
}

/// Every bad bound is refused before anything changes: the pages stay
/// mapped, CPU 1's cached entries stay usable, no flush is sent.
#[test]
fn bad_bounds_are_refused_with_nothing_changed() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, mm, _) = space_with(&m, &[512, 1023]);
    let hole = 0x0000_8000_0000_0000;
    let top_half = 0xffff_8000_0000_0000;
    let cases = [
        // A floor above the range's start, a ceiling below its end.
        (
            TableBounds::new(va(513), va(2048)),
            Error::OutsideTableBounds { addr: va(512) },
        ),
        (
            TableBounds::new(va(1), va(700)),
            Error::OutsideTableBounds { addr: va(700) },
        ),
        (
            TableBounds::new(va(512), va(512)),
            Error::OutsideTableBounds { addr: va(512) },
        ),
        // Not canonical, across the hole, in the kernel's half.
        (
            TableBounds::new(va(1), hole + PAGE_SIZE),
            Error::NonCanonical { addr: hole },
        ),
        (TableBounds::to_top(va(1)), Error::NonCanonical { addr: hole }),
        (TableBounds::to_top(hole), Error::NonCanonical { addr: hole }),
        (TableBounds::to_top(top_half), Error::KernelHalf { va: top_half }),
    ];
    let before = m.stats();
    for (bounds, want) in cases {
        let bounds = bounds.unwrap();
        assert_eq!(unmap(&m, &rmap, 512, 768, Some(bounds)), Err(want), "{bounds:?}");
    }
    // Bounds that cannot be built.
    assert_eq!(
        TableBounds::new(va(1) + 1, va(2048)),
        Err(Error::Unaligned { addr: va(1) + 1 })
    );
    assert_eq!(
        TableBounds::new(va(1), va(2048) - 8),
        Err(Error::Unaligned { addr: va(2048) - 8 })
    );
    assert_eq!(
        TableBounds::new(va(9), va(1)),
        Err(Error::InvalidRange {
            start: va(9),
            end: va(1)
        })
    );
    assert_eq!(TableBounds::to_top(3), Err(Error::Unaligned { addr: 3 }));
    assert_eq!(m.stats(), before, "no flush, no IPI");
    assert!(m.leaf_table(&mm, va(512)).is_some());
    assert_eq!(m.cpu(1).unwrap().read(va(512)), Ok(512));
    assert_eq!(m.violations(), []);
    let shown = Error::OutsideTableBounds { addr: va(512) }.to_string();
    assert!(shown.contains("0x600000") && shown.contains("bounds"), "{shown}");
}

/// Bounds that enclose the range exactly, or reach the top of the user
/// half, are fine; the accessors give back what was built.
#[test]
fn bounds_at_the_range_or_the_end_of_the_user_half_are_accepted() {
    let bounds = TableBounds::new(va(1), va(2048)).unwrap();
    assert_eq!((bounds.floor(), bounds.ceiling()), (va(1), Some(va(2048))));
    assert_eq!(bounds.span(), PageRange::from_bounds(va(1), va(2048)).unwrap());
    let all = TableBounds::to_top(0).unwrap();
    assert_eq!((all.floor(), all.ceiling()), (0, None));
    assert!(all.covers(PageRange::new(u64::MAX - 511 * PAGE_SIZE - 4095, 512).unwrap()));
    assert!(!bounds.covers(PageRange::EMPTY));

    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, mm, _) = space_with(&m, &[512]);
    let exact = TableBounds::from_range(common::pages(512, 513));
    let s = unmap(&m, &rmap, 512, 513, Some(exact)).unwrap();
    assert_eq!(
        (s.pages_unmapped, s.tables_freed),
        (1, 0),
        "the table reaches past the bounds"
    );
    let user_half = TableBounds::new(va(1), 0x0000_8000_0000_0000).unwrap();
    // The table of page 2048 and the one of page 0 are not in the gap;
    // the mapping above is unmapped too, so its table goes.
    let s = unmap(&m, &rmap, 600, 2049, Some(user_half)).unwrap();
    assert_eq!((s.pages_unmapped, s.tables_freed), (1, 2));
    assert!(m.leaf_table(&mm, va(0)).is_some());
    assert_eq!(m.violations(), []);
}

/// A table emptied earlier, that a CPU then walked into (a faulting walk
/// caches the pointer as well), is freed by a bounded teardown that clears
/// no page at all: the flush of its span alone drops the pointer, on the
/// CPU that runs the space and on one that switched away since.
#[test]
fn the_flush_drops_walk_pointers_to_a_freed_table_when_no_page_was_cleared() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, mm, _) = space_with(&m, &[512, 1023]);
    let cpu2 = m.cpu(2).unwrap();
    cpu2.switch_to(&mm).unwrap();
    for (first, end) in [(512, 768), (768, 1024)] {
        unmap(&m, &rmap, first, end, None).unwrap();
    }
    let table = m.leaf_table(&mm, va(512)).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    assert_eq!(cpu1.read(va(600)), Err(Fault::NotMapped { va: va(600) }));
    assert_eq!(cpu2.read(va(601)), Err(Fault::NotMapped { va: va(601) }));
    let other = m.new_mm(asid(2)).unwrap();
    cpu2.switch_to(&other).unwrap();

    let s = unmap(&m, &rmap, 512, 1024, Some(gap())).unwrap();
    assert_eq!((s.pages_unmapped, s.tables_freed, s.flushes), (0, 1, 1));
    assert_eq!(m.leaf_table(&mm, va(512)), None);
    assert_eq!(cpu1.read(va(700)), Err(Fault::NotMapped { va: va(700) }));
    cpu2.switch_to(&mm).unwrap();
    assert_eq!(cpu2.read(va(701)), Err(Fault::NotMapped { va: va(701) }));
    assert!(
        !m.violations()
            .iter()
            .any(|v| matches!(v, Violation::WalkThroughFreedTable { table: t, .. } if *t == table)),
        "{:?}",
        m.violations()
    );
    assert_eq!(m.violations(), []);
}

/// `CountingTable` forwards the bounded hook (not the default, which would
/// keep to the range) and records its searches.
#[test]
fn the_counting_wrapper_forwards_bounded_searches() {
    use tlb_batch::arch::mock::CountingTable;
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, mm, _) = space_with(&m, &[512, 1023]);
    unmap(&m, &rmap, 768, 1024, None).unwrap();
    let space = CountingTable::new(m.space(&mm));
    let mut kernel = MockKernel::new(&rmap);
    let range = common::pages(512, 768);
    let s = MmuGather::<64>::new()
        .unmap_range_bounded(
            &m.cpu(0).unwrap(),
            &space,
            &mut kernel,
            range,
            gap(),
            &mut TableFreePolicy::AfterFlush,
            &mut |_, _| panic!("nothing refused"),
        )
        .unwrap();
    assert_eq!((s.pages_unmapped, s.tables_freed), (1, 1));
    assert_eq!(m.leaf_table(&mm, va(512)), None);
    // The search that found the table, then the whole range, which finds
    // none.
    assert_eq!(space.detach_searches(), [range, range]);
    assert_eq!(m.violations(), []);
}

/// `TableBounds::covers` takes a table only when both its ends lie within
/// the bounds: one that starts below the floor, or ends past the ceiling,
/// is not covered, nor an empty one.
#[test]
fn bounds_cover_a_table_only_with_both_its_ends_inside() {
    let bounds = TableBounds::new(2 << 20, 8 << 20).unwrap();
    assert!(bounds.covers(PageRange::new(2 << 20, 512).unwrap()));
    assert!(bounds.covers(PageRange::new(6 << 20, 512).unwrap()));
    assert!(
        !bounds.covers(PageRange::new(0, 512).unwrap()),
        "starts below the floor"
    );
    assert!(
        !bounds.covers(PageRange::new(8 << 20, 512).unwrap()),
        "past the ceiling"
    );
    assert!(
        !bounds.covers(PageRange::new(6 << 20, 1024).unwrap()),
        "ends past the ceiling"
    );
    assert!(
        !bounds.covers(PageRange::new(4 << 20, 0).unwrap()),
        "an empty table"
    );
}

/// A `TableTeardown` written before bounds existed: it implements
/// `detach_table` only, over the mock's table.
struct BeforeBounds<'a, 'm>(&'a tlb_batch::arch::mock::MockSpace<'m>);

// SAFETY: forwards every call to the mock's page table.
unsafe impl tlb_batch::PageTable for BeforeBounds<'_, '_> {
    fn tlb_state(&self) -> &MmTlbState {
        self.0.tlb_state()
    }
    fn lookup(&self, va: u64) -> tlb_batch::Pte {
        self.0.lookup(va)
    }
    fn exchange(&self, va: u64, new: tlb_batch::Pte) -> tlb_batch::Pte {
        self.0.exchange(va, new)
    }
    fn test_and_clear_accessed(&self, va: u64) -> bool {
        self.0.test_and_clear_accessed(va)
    }
    fn set(&self, va: u64, pte: tlb_batch::Pte) {
        self.0.set(va, pte)
    }
}

// SAFETY: forwards to the mock's page table.
unsafe impl tlb_batch::TableTeardown for BeforeBounds<'_, '_> {
    fn detach_table(&self, range: PageRange) -> Option<tlb_batch::DetachedTable> {
        self.0.detach_table(range)
    }
}

/// With an implementation that predates bounds, `unmap_range_bounded`
/// still frees what `unmap_range` would: the leaf table wholly inside the
/// range (the default `detach_table_bounded` keeps to `detach_table`).
#[test]
fn a_teardown_without_bounded_searches_frees_the_tables_inside_the_range() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, mm, _) = space_with(&m, &[512, 1023]);
    let space = BeforeBounds(&rmap.spaces()[0]);
    let mut kernel = MockKernel::new(&rmap);
    let s = MmuGather::<64>::new()
        .unmap_range_bounded(
            &m.cpu(0).unwrap(),
            &space,
            &mut kernel,
            common::pages(512, 1024),
            gap(),
            &mut TableFreePolicy::AfterFlush,
            &mut |_, _| panic!("nothing refused"),
        )
        .unwrap();
    assert_eq!((s.pages_unmapped, s.tables_freed), (2, 1));
    assert_eq!(m.leaf_table(&mm, va(512)), None);
    assert_eq!(m.violations(), []);
}
