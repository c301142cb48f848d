//! The `page-table-multiarch` feature's teardown, against `X64PageTable`s
//! built in host memory (see `ptm_space.rs`): `MmuGather::unmap_range`
//! through `PtmTeardown` frees the data frames after the one flush, then
//! the table frames it unlinked (back to the `PagingHandler`, as a kernel
//! would), and a range a huge page maps is refused with nothing changed.

#![cfg(all(feature = "page-table-multiarch", feature = "mock", target_arch = "x86_64"))]

mod common;

use std::collections::BTreeSet;

use common::asid;
use common::ptm_tables::{
    allocated, deallocated, machine_with, map, table, user_rw, HostPaging, PtmMmu, Table, GIB, MIB2,
};
use memory_addr::PhysAddr;
use page_table_multiarch::{PageSize, PagingHandler};
use tlb_batch::arch::mock::{MmuTable, MockMachine};
use tlb_batch::ptm::{PtmSpace, PtmTeardown};
use tlb_batch::{
    DetachedTable, Error, Frame, FrameKind, FreeFrames, MmTlbState, MmuGather, OwnedFrame, PageRange,
    PageTable, Pte, TableFreePolicy, TableTeardown, TeardownBacking, PAGE_SIZE,
};

/// The kernel's side of a teardown: data frames back to the simulated
/// machine (whose oracle checks that no CPU still caches them), table
/// frames back to the `PagingHandler`, each only once no CPU holds a stale
/// translation (checked at the call).
struct Backing<'m> {
    machine: &'m MockMachine,
    dirty: Vec<Frame>,
    freed: Vec<Frame>,
    tables: Vec<Frame>,
}

impl<'m> Backing<'m> {
    fn new(machine: &'m MockMachine) -> Self {
        Backing {
            machine,
            dirty: Vec::new(),
            freed: Vec::new(),
            tables: Vec::new(),
        }
    }
}

impl FreeFrames for Backing<'_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        assert_eq!(self.machine.stale_entries(), [], "data freed before the flush");
        while let Some(f) = frames.pop() {
            self.machine.free_frame(f.frame()).unwrap();
            self.freed.push(f.into_frame());
        }
    }
}

impl TeardownBacking for Backing<'_> {
    fn set_dirty(&mut self, frame: Frame) {
        self.dirty.push(frame);
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        assert_eq!(self.machine.stale_entries(), [], "tables freed before the flush");
        while let Some(f) = tables.pop() {
            let frame = f.into_frame();
            HostPaging::dealloc_frame(PhysAddr::from(frame.addr() as usize));
            self.tables.push(frame);
        }
    }
}

fn frames_of(addrs: &[u64]) -> BTreeSet<Frame> {
    addrs.iter().map(|&a| Frame(a >> 12)).collect()
}

#[test]
fn mmu_gather_frees_data_after_the_flush_then_the_tables_it_unlinked() {
    let mut t = table();
    let (m, mm) = machine_with(3, &t);
    // One page in the first GiB that stays, then two leaf tables in the
    // second GiB, under one level-2 table.
    let keep = GIB - PAGE_SIZE;
    let vas = [GIB, GIB + 3 * PAGE_SIZE, GIB + 5 * MIB2];
    let frames: Vec<Frame> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    for (&va, &f) in [&keep].into_iter().chain(&vas).zip(&frames) {
        map(&mut t, va, f, PageSize::Size4K, user_rw());
    }
    // Root, level 3, level 2 and leaf of the first GiB, level 2 of the
    // second and its two leaves.
    let tables = allocated();
    assert_eq!(tables.len(), 7);
    let root = t.root_paddr().as_usize() as u64;
    assert_eq!(tables[0], root);
    let mmu = PtmMmu { root };
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.write(vas[1], 9).unwrap();
    cpu1.read(vas[2]).unwrap();

    // SAFETY: each mapped frame's claim is the test's, handed over here;
    // no table is shared with another address space.
    let space = unsafe { PtmSpace::new(&mut t, &mm).for_teardown() };
    let mut backing = Backing::new(&m);
    let mut gather = MmuGather::<16>::new();
    let mut handed_back = Vec::new();
    let cpu0 = m.cpu(0).unwrap();
    let summary = gather
        .unmap_range(
            &cpu0,
            &space,
            &mut backing,
            PageRange::new(GIB, GIB / PAGE_SIZE).unwrap(),
            true,
            &mut TableFreePolicy::IpiSync,
            &mut |f: OwnedFrame, k: FrameKind| handed_back.push((f.into_frame(), k)),
        )
        .unwrap();
    assert_eq!(handed_back, []);
    assert_eq!((summary.pages_unmapped, summary.flushes), (3, 1));
    assert_eq!(backing.dirty, [frames[2]], "the written page's dirty bit moved");
    assert_eq!(
        backing.freed.iter().copied().collect::<BTreeSet<_>>(),
        frames[1..].iter().copied().collect()
    );
    let unlinked: BTreeSet<Frame> = backing.tables.iter().copied().collect();
    assert_eq!(
        unlinked,
        frames_of(&tables[4..]),
        "both leaves and their level-2 table"
    );
    assert_eq!(summary.tables_freed, 3);
    assert_eq!(
        frames_of(&deallocated()),
        unlinked,
        "back to the handler, once each"
    );
    // The flush interrupts CPU 1, which runs the space, alone; the IPI
    // sync for lockless walkers then reaches every other CPU.
    let taken: Vec<u64> = (0..3)
        .map(|c| m.interrupts_taken(m.cpu(c).unwrap().id()).unwrap())
        .collect();
    assert_eq!(taken, [0, 2, 1]);
    assert_eq!((summary.syncs, summary.ipis_sent), (1, 3));
    for va in vas {
        assert_eq!(space.lookup(va), Pte::EMPTY);
        assert!(mmu.entry(va).is_none(), "no walk reaches the unlinked tables");
    }
    assert!(space.lookup(keep).maps(frames[0]), "outside the range: kept");
    assert!(cpu1.write(vas[1], 1).is_err());
    assert_eq!(
        space.detach_table(PageRange::new(GIB, GIB / PAGE_SIZE).unwrap()),
        None
    );
    assert_eq!(
        space.detach_table(PageRange::new(0, 511).unwrap()),
        None,
        "inside one table"
    );
    assert_eq!(m.violations(), []);
    // The table itself still reaches what is left, and frees the rest
    // (not the unlinked tables again) when dropped.
    let before = deallocated().len();
    drop(t);
    let now = deallocated();
    assert_eq!(frames_of(&now[before..]), frames_of(&tables[..4]));
}

/// Tears down a range that covers part of a huge page: refused with
/// `Error::HugePage` for that page before anything changes.
fn refused_with_nothing_changed(
    t: &mut Table,
    m: &MockMachine,
    mm: &MmTlbState,
    range: PageRange,
    want: Error,
) {
    // SAFETY: nothing is freed (the teardown is refused before it starts).
    let space: PtmTeardown<'_, HostPaging> = unsafe { PtmSpace::new(t, mm).for_teardown() };
    let before: Vec<Pte> = [range.start(), range.start() + 2 * MIB2]
        .map(|va| space.lookup(va))
        .to_vec();
    let mut backing = Backing::new(m);
    let mut gather = MmuGather::<16>::new();
    let cpu0 = m.cpu(0).unwrap();
    let mut handback = |_: OwnedFrame, _: FrameKind| panic!("nothing to hand back");
    let result = gather.unmap_range(
        &cpu0,
        &space,
        &mut backing,
        range,
        true,
        &mut TableFreePolicy::AfterFlush,
        &mut handback,
    );
    assert_eq!(result, Err(want));
    let after: Vec<Pte> = [range.start(), range.start() + 2 * MIB2]
        .map(|va| space.lookup(va))
        .to_vec();
    assert_eq!(before, after, "nothing changed");
    assert!(gather.is_empty());
    assert!(backing.freed.is_empty() && backing.tables.is_empty() && backing.dirty.is_empty());
    assert_eq!(m.ipis_sent(), 0);
}

#[test]
fn a_range_a_huge_page_maps_is_refused_before_anything_changes() {
    let mut t = table();
    let (m, mm) = machine_with(2, &t);
    let data = m.alloc_frame().unwrap();
    // A 4 KiB page, a 2 MiB page after it, and a 1 GiB page further up.
    map(&mut t, GIB, data, PageSize::Size4K, user_rw());
    map(
        &mut t,
        GIB + 2 * MIB2,
        Frame(0x4000_0000 >> 12),
        PageSize::Size2M,
        user_rw(),
    );
    map(
        &mut t,
        4 * GIB,
        Frame(0x8000_0000 >> 12),
        PageSize::Size1G,
        user_rw(),
    );
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.write(GIB, 3).unwrap();

    // Up to the middle of the 2 MiB page (one covering it wholly takes it
    // as one entry: tests/huge_range.rs).
    let two = PageRange::new(GIB, 5 * MIB2 / 2 / PAGE_SIZE).unwrap();
    let huge_2m = Error::HugePage {
        va: GIB + 2 * MIB2,
        size: MIB2,
    };
    refused_with_nothing_changed(&mut t, &m, &mm, two, huge_2m);
    let one = PageRange::new(4 * GIB - 2 * MIB2, 4 * MIB2 / PAGE_SIZE).unwrap();
    let huge_1g = Error::HugePage {
        va: 4 * GIB,
        size: GIB,
    };
    refused_with_nothing_changed(&mut t, &m, &mm, one, huge_1g);
    assert_eq!(cpu1.read(GIB), Ok(3), "the 4 KiB page is still mapped");
    assert_eq!(m.violations(), []);

    // Below the huge page, the same teardown goes through.
    // SAFETY: the one data frame's claim is the test's, handed over here.
    let space = unsafe { PtmSpace::new(&mut t, &mm).for_teardown() };
    let mut backing = Backing::new(&m);
    let mut gather = MmuGather::<16>::new();
    let summary = gather
        .unmap_range(
            &m.cpu(0).unwrap(),
            &space,
            &mut backing,
            PageRange::new(GIB, 2 * MIB2 / PAGE_SIZE).unwrap(),
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |_, _| panic!("nothing to hand back"),
        )
        .unwrap();
    assert_eq!((summary.pages_unmapped, summary.tables_freed), (1, 1));
    assert_eq!(backing.freed, [data]);
    assert_eq!(backing.dirty, [data]);
    assert!(space.lookup(GIB + 2 * MIB2).is_present(), "the huge page stays");
    assert_eq!(m.violations(), []);
}

#[test]
fn detach_table_refuses_non_canonical_ranges_and_the_space_prints_what_it_holds() {
    let mut t = table();
    let root = t.root_paddr().as_usize() as u64;
    let tlb = MmTlbState::new(asid(3), 0);
    let space = PtmSpace::new(&mut t, &tlb);
    assert_eq!(
        format!("{space:?}"),
        format!("PtmSpace {{ root: {root:#x}, asid: asid(3) }}")
    );
    // SAFETY: nothing is freed: no teardown runs.
    let teardown = unsafe { space.for_teardown() };
    assert!(format!("{teardown:?}").starts_with("PtmTeardown { space: PtmSpace {"));
    let hole = PageRange::new(0x0000_8000_0000_0000, 1).unwrap();
    assert_eq!(teardown.detach_table(hole), None::<DetachedTable>);
    assert_eq!(teardown.check_range(hole), Ok(()));
}

/// With the bounds the kernel knows (the mappings around end at 1 GiB and
/// start at 2 GiB), the second of two munmaps that each cover half of the
/// leaf table at 1 GiB unlinks it and the level-2 table that emptied with
/// it, and hands both back to the `PagingHandler` after the flush; the
/// mappings around stay.
#[test]
fn two_half_munmaps_with_bounds_unlink_the_leaf_table_and_its_parent() {
    let mut t = table();
    let (m, mm) = machine_with(2, &t);
    let vas = [GIB - PAGE_SIZE, GIB, GIB + MIB2 - PAGE_SIZE, 2 * GIB];
    let frames: Vec<Frame> = vas.iter().map(|_| m.alloc_frame().unwrap()).collect();
    for (&va, &f) in vas.iter().zip(&frames) {
        map(&mut t, va, f, PageSize::Size4K, user_rw());
    }
    // Root, level 3, level 2 and leaf of the first GiB, level 2 and leaf
    // of the second, level 2 and leaf of the third.
    let tables = allocated();
    assert_eq!(tables.len(), 8);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.write(GIB, 5).unwrap();
    // SAFETY: each mapped frame's claim is the test's, handed over here;
    // no table is shared with another address space.
    let space = unsafe { PtmSpace::new(&mut t, &mm).for_teardown() };
    let bounds = tlb_batch::TableBounds::new(GIB, 2 * GIB).unwrap();
    let mut backing = Backing::new(&m);
    let cpu0 = m.cpu(0).unwrap();
    for (first, end, pages, freed) in [(GIB, GIB + MIB2 / 2, 1, 0), (GIB + MIB2 / 2, GIB + MIB2, 1, 2)] {
        let summary = MmuGather::<16>::new()
            .unmap_range_bounded(
                &cpu0,
                &space,
                &mut backing,
                PageRange::from_bounds(first, end).unwrap(),
                bounds,
                &mut TableFreePolicy::AfterFlush,
                &mut |_, _| panic!("nothing refused"),
            )
            .unwrap();
        assert_eq!((summary.pages_unmapped, summary.tables_freed), (pages, freed));
    }
    assert_eq!(frames_of(&deallocated()), frames_of(&tables[4..6]));
    assert_eq!(cpu1.read(GIB - PAGE_SIZE), Ok(0));
    assert_eq!(cpu1.read(2 * GIB), Ok(0));
    assert!(cpu1.read(GIB).is_err());
    assert!(space.lookup(2 * GIB).maps(frames[3]));
    assert_eq!(m.violations(), []);
}
