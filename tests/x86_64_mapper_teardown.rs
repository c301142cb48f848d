//! The `x86_64-mapper` feature against real four-level tables (built with
//! the `x86_64` crate in host memory, see `x86_64_mapper_space.rs`),
//! teardown through `OffsetTeardown`: `MmuGather` frees data frames after
//! the flush and detaches the tables it emptied, `detach_table` leaves the
//! tables a range covers only in part at every level and refuses a range
//! with an end in the hole, every primitive forwards to the space, and
//! with bounds (`unmap_range_bounded`) two half teardowns free a leaf table
//! and its emptied parent, never a table that still maps a page.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

use common::asid;
use common::x86_tables::{machine_with, map, upper_entry, user_rw, HostMmu, Tables, GIB, MIB2};
use tlb_batch::arch::mock::{MmuTable, MockMachine};
use tlb_batch::mapper::{OffsetSpace, OffsetTeardown};
use tlb_batch::{
    DetachedTable, Frame, FrameKind, FreeFrames, MmTlbState, MmuGather, OwnedFrame, PageRange, PageTable,
    Pte, PteFlags, TableBounds, TableFreePolicy, TeardownBacking, TeardownSummary, PAGE_SIZE,
};
use x86_64::structures::paging::{PageTableFlags as F, Size4KiB};

/// The kernel's side of a teardown: data frames go back to the simulated
/// machine (whose oracle checks no CPU still caches them); page-table
/// frames are recorded (they are host pages, leaked for the test).
struct Backing<'m> {
    machine: &'m MockMachine,
    dirty: Vec<Frame>,
    freed: Vec<Frame>,
    tables: Vec<Frame>,
}

impl FreeFrames for Backing<'_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
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
        while let Some(f) = tables.pop() {
            self.tables.push(f.into_frame());
        }
    }
}

#[test]
fn mmu_gather_frees_data_frames_after_the_flush_and_detaches_emptied_tables() {
    let mut t = Tables::new();
    let (m, mm) = machine_with(2, &t);
    // One page in the first GiB that the teardown leaves alone, then two
    // leaf tables in the second GiB (one level-2 table).
    let keep = GIB - PAGE_SIZE;
    let vas = [GIB, GIB + 3 * PAGE_SIZE, GIB + 5 * MIB2];
    let frames: Vec<Frame> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    let (mut mapper, mut pool) = t.mapper();
    for (va, f) in [&keep].into_iter().chain(&vas).zip(&frames) {
        map::<Size4KiB>(&mut mapper, &mut pool, *va, f.addr(), user_rw());
    }
    // Allocation order: level 3, level 2 (first GiB), its leaf, level 2
    // (second GiB), its two leaves.
    let allocated: Vec<Frame> = pool.0.iter().map(|&a| Frame(a >> 12)).collect();
    assert_eq!(allocated.len(), 6);
    let mmu = HostMmu { root: t.root_addr() };
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.write(vas[1], 9).unwrap();
    cpu1.read(vas[2]).unwrap();

    let (mut mapper, _) = t.mapper();
    // SAFETY: each mapped frame's claim is the test's, handed over here,
    // and no table is shared with another address space.
    let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
    let mut backing = Backing {
        machine: &m,
        dirty: Vec::new(),
        freed: Vec::new(),
        tables: Vec::new(),
    };
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
    assert_eq!(summary.pages_unmapped, 3);
    assert_eq!(summary.flushes, 1);
    assert_eq!(backing.dirty, [frames[2]], "the written page's dirty bit moved");
    assert_eq!(
        backing.freed.iter().collect::<BTreeSet<_>>(),
        frames[1..].iter().collect()
    );
    let tables: BTreeSet<Frame> = backing.tables.iter().copied().collect();
    assert_eq!(
        tables,
        allocated[3..].iter().copied().collect(),
        "both leaves and their level-2 table"
    );
    assert_eq!(summary.tables_freed, 3);
    for va in vas {
        assert_eq!(space.lookup(va), Pte::EMPTY);
        assert!(mmu.entry(va).is_none(), "no walk reaches the detached tables");
    }
    assert!(space.lookup(keep).maps(frames[0]), "outside the range: kept");
    assert!(cpu1.write(vas[1], 1).is_err());
    assert_eq!(m.violations(), []);
    // Nothing left to detach; a range inside one table detaches nothing.
    assert_eq!(
        space_detach(&space, PageRange::new(GIB, GIB / PAGE_SIZE).unwrap()),
        None
    );
    assert_eq!(space_detach(&space, PageRange::new(0, 511).unwrap()), None);
}

fn space_detach(space: &OffsetTeardown<'_>, range: PageRange) -> Option<tlb_batch::DetachedTable> {
    use tlb_batch::TableTeardown;
    space.detach_table(range)
}

/// Maps a page at each of `vas` with the `x86_64` crate and clears it
/// again: the tables on the way to each stay linked, and empty.
fn empty_tables_at(t: &mut Tables, vas: &[u64]) {
    let (mut mapper, mut pool) = t.mapper();
    for &va in vas {
        map::<Size4KiB>(&mut mapper, &mut pool, va, 0x5000, user_rw());
    }
    let tlb = MmTlbState::new(asid(1), 0);
    let space = OffsetSpace::new(&mut mapper, &tlb);
    for &va in vas {
        assert!(space.clear(va).maps(Frame(5)));
    }
}

/// What detaching the table that the level-`level` entry (4 to 2) for `va`
/// names must answer: that table's frame, and the span the entry maps.
fn table_named(root: u64, va: u64, level: u32) -> DetachedTable {
    let span = PAGE_SIZE << (9 * (level - 1));
    let raw = upper_entry(root, va, level).load(Ordering::SeqCst);
    assert_eq!(raw & 1, 1, "{va:#x}: no table below level {level}");
    DetachedTable {
        frame: Frame((raw & 0x000f_ffff_ffff_f000) >> 12),
        range: PageRange::new(va & !(span - 1), span / PAGE_SIZE).unwrap(),
    }
}

/// Every table `detach_table` hands out for `range`, in order, until it
/// answers `None` (at most 64: a wrong answer must not loop for ever).
fn detach_all(space: &OffsetTeardown<'_>, range: PageRange) -> Vec<DetachedTable> {
    std::iter::from_fn(|| space_detach(space, range))
        .take(64)
        .collect()
}

/// The pages of `first..=last`.
fn pages_through(first: u64, last: u64) -> PageRange {
    PageRange::new(first, (last - first) / PAGE_SIZE + 1).unwrap()
}

/// Leaf tables the range only partly covers stay linked, at both ends, even
/// when empty: a range that starts one page into one leaf table's 2 MiB and
/// ends one page short of another's detaches exactly the empty leaf tables
/// in between, and not their level-2 table (the range covers only part of
/// its GiB); a leaf table the range covers whole but that still maps a page
/// stays too.
#[test]
fn detach_table_leaves_leaf_tables_the_range_covers_only_in_part() {
    let mut t = Tables::new();
    let root = t.root_addr();
    let slot = |i: u64| GIB + i * MIB2;
    // Empty leaf tables at the 2 MiB slots 0 to 3 of the second GiB; slot 4
    // keeps a page.
    empty_tables_at(&mut t, &[slot(0), slot(1), slot(2), slot(3)]);
    let (mut mapper, mut pool) = t.mapper();
    map::<Size4KiB>(&mut mapper, &mut pool, slot(4) + PAGE_SIZE, 0x7000, user_rw());
    let want = [table_named(root, slot(1), 2), table_named(root, slot(2), 2)];
    let partial = [slot(0), slot(3)].map(|va| table_named(root, va, 2));
    let kept = table_named(root, slot(4), 2);
    let level_2 = table_named(root, GIB, 3);

    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: nothing is freed (the test calls `detach_table` only, and the
    // tables are leaked); no table is shared.
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };
    // One page into slot 0 up to one page short of the end of slot 3; then
    // one page into slot 3 up to the end of slot 4.
    let range = pages_through(slot(0) + PAGE_SIZE, slot(4) - 2 * PAGE_SIZE);
    assert_eq!(detach_all(&space, range), want);
    let range = pages_through(slot(3) + PAGE_SIZE, slot(5) - PAGE_SIZE);
    assert_eq!(detach_all(&space, range), [], "slot 3 in part, slot 4 in use");

    for table in partial.iter().chain([&kept]) {
        let va = table.range.start();
        assert_eq!(table_named(root, va, 2), *table, "{va:#x}: still linked");
    }
    assert_eq!(table_named(root, GIB, 3), level_2);
    assert!(space.lookup(slot(4) + PAGE_SIZE).maps(Frame(7)));
    let mmu = HostMmu { root };
    assert!(mmu.entry(slot(1)).is_none() && mmu.entry(slot(2)).is_none());
    assert!(mmu.entry(slot(0)).is_some() && mmu.entry(slot(3)).is_some());
}

/// The same one level up: level-2 tables (1 GiB each) that the range covers
/// only in part stay linked once the teardown emptied them, those it covers
/// whole go after their leaf tables. The range starts in one level-2
/// table's GiB, so leaf tables at the start of the next ones, which the
/// scan reaches from an earlier table, are found too.
#[test]
fn detach_table_leaves_level_2_tables_the_range_covers_only_in_part() {
    let mut t = Tables::new();
    let root = t.root_addr();
    // A leaf table at 2 MiB slot 5 of the first GiB; at slot 0 of the
    // second, third and fourth.
    let vas = [5 * MIB2, GIB, 2 * GIB, 3 * GIB];
    empty_tables_at(&mut t, &vas);
    let leaves = vas.map(|va| table_named(root, va, 2));
    let level_2 = vas.map(|va| table_named(root, va, 3));
    let level_3 = table_named(root, 0, 4);
    let (mut mapper, _) = t.mapper();
    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: as above: nothing is freed, no table is shared.
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };

    // From slot 2 of the first GiB to the end of slot 1 of the fourth: all
    // four leaf tables, and the level-2 tables of the second and third GiB.
    let range = pages_through(2 * MIB2, 3 * GIB + 2 * MIB2 - PAGE_SIZE);
    let mut want = leaves.to_vec();
    want.extend([level_2[1], level_2[2]]);
    assert_eq!(detach_all(&space, range), want);
    for (i, &va) in vas.iter().enumerate() {
        assert!(HostMmu { root }.entry(va).is_none(), "{va:#x}");
        if i == 0 || i == 3 {
            assert_eq!(table_named(root, va, 3), level_2[i], "{va:#x}: only in part");
        }
    }
    assert_eq!(table_named(root, 0, 4), level_3);
}

/// And at the top: level-3 tables (512 GiB each, named by the level-4
/// table) that the range covers only in part stay linked; the one it
/// covers whole goes after its level-2 and leaf tables. Again the scan
/// reaches tables at index 0 from an earlier one.
#[test]
fn detach_table_leaves_level_3_tables_the_range_covers_only_in_part() {
    const TIB_HALF: u64 = 512 * GIB;
    let mut t = Tables::new();
    let root = t.root_addr();
    // Level-4 entries 1, 2 and 3: one page in the second GiB of the first,
    // at the very start of the second and third.
    let vas = [TIB_HALF + GIB, 2 * TIB_HALF, 3 * TIB_HALF];
    empty_tables_at(&mut t, &vas);
    let leaves = vas.map(|va| table_named(root, va, 2));
    let level_2 = vas.map(|va| table_named(root, va, 3));
    let level_3 = vas.map(|va| table_named(root, va, 4));
    let (mut mapper, _) = t.mapper();
    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: as above: nothing is freed, no table is shared.
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };

    // From the second GiB of entry 1 to the end of the first two GiB of
    // entry 3.
    let range = pages_through(TIB_HALF + GIB, 3 * TIB_HALF + 2 * GIB - PAGE_SIZE);
    let mut want = leaves.to_vec();
    want.extend(level_2);
    want.push(level_3[1]);
    assert_eq!(detach_all(&space, range), want);
    assert_eq!(table_named(root, vas[0], 4), level_3[0], "only in part");
    assert_eq!(table_named(root, vas[2], 4), level_3[2], "only in part");
    assert_eq!(upper_entry(root, vas[1], 4).load(Ordering::SeqCst), 0);
}

/// `OffsetTeardown` is the same address space: each primitive, called on
/// it, reads and changes the entry words its `OffsetSpace` does, and its
/// address-space state is the one it was made with.
#[test]
fn offset_teardown_forwards_every_primitive_to_its_space() {
    let mut t = Tables::new();
    let (mut mapper, mut pool) = t.mapper();
    let va = 0x40_0000;
    map::<Size4KiB>(&mut mapper, &mut pool, va, 0x5000, user_rw() | F::ACCESSED);
    map::<Size4KiB>(&mut mapper, &mut pool, va + 3 * PAGE_SIZE, 0x6000, user_rw());
    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: nothing is freed: no teardown runs.
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };
    assert!(std::ptr::eq(space.tlb_state(), &tlb));
    assert!(std::ptr::eq(space.space().tlb_state(), &tlb));

    assert_eq!(space.lookup(va), Pte(0x5000 | (user_rw() | F::ACCESSED).bits()));
    assert!(space.test_and_clear_accessed(va), "the accessed bit was set");
    assert!(!space.space().lookup(va).is_accessed(), "and is cleared");
    assert!(!space.test_and_clear_accessed(va));
    assert!(!space.test_and_clear_accessed(va + 3 * PAGE_SIZE));

    let ro = Pte::new(Frame(8), PteFlags::PRESENT | PteFlags::USER);
    space.set(va, ro);
    assert_eq!(space.space().lookup(va), ro);
    assert_eq!(space.exchange(va, Pte::EMPTY), ro);
    assert_eq!(space.space().lookup(va), Pte::EMPTY);
    let table = PageRange::new(va, 512).unwrap();
    assert_eq!(space.next_populated(table), Some(va + 3 * PAGE_SIZE));
}

/// A range with an end in the non-canonical hole is refused whole, as
/// `check_range` refuses it for the gather: nothing is detached, not even
/// empty tables that lie wholly inside its canonical part, and those same
/// tables go once the range stops at the edge of the hole.
#[test]
fn detach_table_refuses_a_range_with_an_end_in_the_hole() {
    const LOWER_LAST_GIB: u64 = 0x7fff_c000_0000;
    const HOLE: u64 = 0x0000_8000_0000_0000;
    const UPPER: u64 = 0xffff_8000_0000_0000;
    let mut t = Tables::new();
    let root = t.root_addr();
    // An empty leaf table in the last 2 MiB of the lower half and one in
    // the first 2 MiB of the upper half.
    let vas = [HOLE - MIB2, UPPER];
    empty_tables_at(&mut t, &vas);
    let want = vas.map(|va| [table_named(root, va, 2), table_named(root, va, 3)]);
    let (mut mapper, _) = t.mapper();
    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: nothing is freed: the test calls `detach_table` only, and
    // the tables are leaked; no table is shared.
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };

    // The last GiB of the lower half and the hole's first page; the hole's
    // first page and the upper half's first GiB.
    assert_eq!(detach_all(&space, pages_through(LOWER_LAST_GIB, HOLE)), []);
    assert_eq!(
        detach_all(&space, pages_through(HOLE, UPPER + GIB - PAGE_SIZE)),
        []
    );
    for (va, tables) in vas.iter().zip(&want) {
        assert_eq!([table_named(root, *va, 2), table_named(root, *va, 3)], *tables);
    }

    let lower = pages_through(LOWER_LAST_GIB, HOLE - PAGE_SIZE);
    assert_eq!(detach_all(&space, lower), want[0]);
    let upper = pages_through(UPPER, UPPER + GIB - PAGE_SIZE);
    assert_eq!(detach_all(&space, upper), want[1]);
}

/// A teardown of many tables searches on from the table it found last,
/// not from the range's start each time (which cost O(T^2) entry reads
/// for T tables: 6.4 us per table at 2,048 tables against 1.2 us at 256,
/// `examples/teardown_cost.rs`), and still frees the upper-level tables
/// whose span starts before where its last search began. One page in
/// each of 1,024 leaf tables (two level-2 tables' worth), and a range that
/// ends 2 MiB past them, where nothing is mapped.
#[test]
fn a_teardown_searches_on_from_its_last_table_and_frees_every_level() {
    use tlb_batch::arch::mock::CountingTable;
    let mut t = Tables::new();
    let (m, mm) = machine_with(2, &t);
    let base = 4 * GIB;
    let (mut mapper, mut pool) = t.mapper();
    for i in 0..1024 {
        let f = m.alloc_frame().unwrap();
        map::<Size4KiB>(&mut mapper, &mut pool, base + i * MIB2, f.addr(), user_rw());
    }
    let (mut mapper, _) = t.mapper();
    // SAFETY: each mapped frame's claim is the test's, handed over here,
    // and no table is shared with another address space.
    let space = CountingTable::new(unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() });
    let mut backing = Backing {
        machine: &m,
        dirty: Vec::new(),
        freed: Vec::new(),
        tables: Vec::new(),
    };
    let range = PageRange::from_bounds(base, base + 2 * GIB + MIB2).unwrap();
    let summary = MmuGather::<64>::new()
        .unmap_range(
            &m.cpu(0).unwrap(),
            &space,
            &mut backing,
            range,
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |_, _| panic!("nothing refused"),
        )
        .unwrap();
    assert_eq!(
        summary.tables_freed,
        1024 + 2,
        "every leaf table and both level-2 tables"
    );
    let searches = space.detach_searches();
    // One search per table found, and three that find none: past the last
    // leaf table (then the whole range again, which finds the first
    // level-2 table), past the last level-2 table, and the whole range at
    // the end.
    assert_eq!(searches.len(), 1024 + 2 + 3);
    let whole = searches.iter().filter(|s| **s == range).count();
    assert!(whole <= 3, "{whole} searches of the whole range");
    // After the first, each leaf table's search starts past the last one.
    assert!(searches[1..1024]
        .iter()
        .enumerate()
        .all(|(i, s)| s.start() == base + (i as u64 + 1) * MIB2));
    assert_eq!(m.violations(), []);
}

/// A teardown of `range` through `OffsetTeardown` with `bounds` (`None`:
/// `unmap_range`, tables wholly inside the range only): the summary, and
/// the page-table frames freed.
fn bounded(
    m: &MockMachine,
    space: &OffsetTeardown<'_>,
    range: PageRange,
    bounds: Option<TableBounds>,
) -> (TeardownSummary, Vec<Frame>) {
    let mut backing = Backing {
        machine: m,
        dirty: Vec::new(),
        freed: Vec::new(),
        tables: Vec::new(),
    };
    let mut gather = MmuGather::<16>::new();
    let cpu0 = m.cpu(0).unwrap();
    let policy = &mut TableFreePolicy::AfterFlush;
    let back = &mut |_: OwnedFrame, _: FrameKind| panic!("nothing refused");
    let summary = match bounds {
        Some(b) => gather.unmap_range_bounded(&cpu0, space, &mut backing, range, b, policy, back),
        None => gather.unmap_range(&cpu0, space, &mut backing, range, true, policy, back),
    };
    (summary.unwrap(), backing.tables)
}

/// Two munmaps that each cover half of the leaf table at 1 GiB, between a
/// mapping that ends at 1 GiB and one at 2 GiB. With those bounds the
/// second frees the leaf table and then the level-2 table that emptied
/// with it (its GiB lies within them); the level-3 table (512 GiB) stays,
/// as do the mappings around. Without bounds nothing is freed.
#[test]
fn two_half_munmaps_with_bounds_free_the_leaf_table_and_its_emptied_parent() {
    for with_bounds in [true, false] {
        let mut t = Tables::new();
        let root = t.root_addr();
        let (m, mm) = machine_with(2, &t);
        let vas = [GIB - PAGE_SIZE, GIB, GIB + MIB2 - PAGE_SIZE, 2 * GIB];
        let frames: Vec<Frame> = vas.iter().map(|_| m.alloc_frame().unwrap()).collect();
        let (mut mapper, mut pool) = t.mapper();
        for (va, f) in vas.iter().zip(&frames) {
            map::<Size4KiB>(&mut mapper, &mut pool, *va, f.addr(), user_rw());
        }
        let leaf = table_named(root, GIB, 2);
        let level_2 = table_named(root, GIB, 3);
        let level_3 = table_named(root, GIB, 4);
        let cpu1 = m.cpu(1).unwrap();
        cpu1.switch_to(&mm).unwrap();
        for (i, va) in vas.iter().enumerate() {
            cpu1.write(*va, i as u64).unwrap();
        }
        let (mut mapper, _) = t.mapper();
        // SAFETY: each mapped frame's claim is the test's, handed over
        // here, and no table is shared with another address space.
        let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
        let bounds = with_bounds.then(|| TableBounds::new(GIB, 2 * GIB).unwrap());

        let half = MIB2 / 2;
        let (first, tables) = bounded(
            &m,
            &space,
            PageRange::from_bounds(GIB, GIB + half).unwrap(),
            bounds,
        );
        assert_eq!(
            (first.pages_unmapped, tables),
            (1, vec![]),
            "the other half is mapped"
        );
        let second = PageRange::from_bounds(GIB + half, GIB + MIB2).unwrap();
        let (second, tables) = bounded(&m, &space, second, bounds);
        assert_eq!(second.pages_unmapped, 1);
        if with_bounds {
            let freed: BTreeSet<Frame> = tables.into_iter().collect();
            assert_eq!(
                freed,
                [leaf.frame, level_2.frame].into(),
                "the leaf and its parent"
            );
            assert_eq!(
                table_named(root, GIB, 4),
                level_3,
                "512 GiB reach past the bounds"
            );
            assert!(HostMmu { root }.entry(GIB).is_none());
        } else {
            assert_eq!(tables, []);
            assert_eq!(table_named(root, GIB, 2), leaf, "empty, still linked");
        }
        assert_eq!(cpu1.read(GIB - PAGE_SIZE), Ok(0));
        assert_eq!(cpu1.read(2 * GIB), Ok(3));
        assert!(cpu1.read(GIB).is_err());
        assert_eq!(
            m.check_coherent(&mm, PageRange::from_bounds(GIB, GIB + MIB2).unwrap()),
            0
        );
        assert_eq!(m.violations(), []);
    }
}

/// Bounds that wrongly say the whole first 4 GiB are free: the leaf table
/// that still maps a page, and its parents, stay; the page stays mapped
/// and readable.
#[test]
fn a_bound_over_a_still_mapped_page_never_frees_its_tables() {
    let mut t = Tables::new();
    let root = t.root_addr();
    let (m, mm) = machine_with(2, &t);
    let vas = [GIB, GIB + 300 * PAGE_SIZE];
    let frames: Vec<Frame> = vas.iter().map(|_| m.alloc_frame().unwrap()).collect();
    let (mut mapper, mut pool) = t.mapper();
    for (va, f) in vas.iter().zip(&frames) {
        map::<Size4KiB>(&mut mapper, &mut pool, *va, f.addr(), user_rw());
    }
    let linked = [2, 3, 4].map(|level| table_named(root, GIB, level));
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.write(vas[1], 7).unwrap();
    let (mut mapper, _) = t.mapper();
    // SAFETY: as above.
    let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
    let wrong = TableBounds::new(0, 4 * GIB).unwrap();
    let range = PageRange::new(GIB, 256).unwrap();
    let (summary, tables) = bounded(&m, &space, range, Some(wrong));
    assert_eq!((summary.pages_unmapped, tables), (1, vec![]));
    assert_eq!([2, 3, 4].map(|level| table_named(root, GIB, level)), linked);
    assert!(space.lookup(vas[1]).maps(frames[1]));
    assert_eq!(cpu1.read(vas[1]), Ok(7));
    assert_eq!(m.violations(), []);
}
