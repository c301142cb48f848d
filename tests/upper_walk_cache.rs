//! Upper-level walk caches (paging-structure caches above the leaf) on
//! real four-level tables built with the `x86_64` crate and attached to
//! the mock: a CPU that walked through a page directory (level 2, 1 GiB)
//! or a page-directory-pointer table (level 3, 512 GiB) keeps a pointer to
//! it until a flush drops it. `MmuGather` over `OffsetTeardown` frees such
//! tables after a flush that reaches that CPU, and its later speculative
//! walks stay clean; the oracle catches a table freed under a cached
//! pointer. Also the per-architecture rule of a flush by address: x86's
//! INVLPG drops every walk-cache entry of the loaded ASID, arm64's TLBI by
//! VA only the entries on the way to that address.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use std::sync::Arc;

use common::asid;
use common::x86_tables::{map, user_rw, HostMmu, Tables, GIB, MIB2};
use tlb_batch::arch::mock::{
    Arm64Like, MmuTable, MockConfig, MockCpu, MockMachine, Model, Violation, X86Like,
};
use tlb_batch::arch::Arch;
use tlb_batch::mapper::OffsetSpace;
use tlb_batch::{
    Frame, FrameKind, FreeFrames, MmTlbState, MmuGather, OwnedFrame, PageRange, TableFreePolicy,
    TeardownBacking, TeardownSummary, PAGE_SIZE,
};
use x86_64::structures::paging::Size4KiB;

/// What one level-3 table maps.
const GIB512: u64 = 512 * GIB;

/// The kernel's side of a teardown: data frames go back to the machine,
/// page-table frames (host pages) are reported freed to the oracle
/// ([`MockMachine::free_table_frame`]), which judges every CPU whose walk
/// caches still point to them.
struct Backing<'m, M: Model> {
    machine: &'m MockMachine<M>,
    tables: Vec<Frame>,
}

impl<M: Model> FreeFrames for Backing<'_, M> {
    fn free_batch<const N: usize>(&mut self, frames: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        while let Some(f) = frames.pop() {
            self.machine.free_frame(f.into_frame()).unwrap();
        }
    }
}

impl<M: Model> TeardownBacking for Backing<'_, M> {
    fn set_dirty(&mut self, _frame: Frame) {}

    fn free_tables<const N: usize>(&mut self, tables: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        while let Some(f) = tables.pop() {
            let frame = f.into_frame();
            self.machine.free_table_frame(frame);
            self.tables.push(frame);
        }
    }
}

/// A machine of model `M` with two CPUs and an address space that `tables`
/// translate (walks cache pointers at every level: `HostMmu`).
fn machine_of<M: Model>(tables: &Tables) -> (MockMachine<M>, Arc<MmTlbState>) {
    let m = MockMachine::<M>::with_model(MockConfig::x86_like(2)).unwrap();
    let root = tables.root_addr();
    let mm = m.new_mm_at(asid(1), root).unwrap();
    m.attach_table(&mm, Arc::new(HostMmu { root })).unwrap();
    (m, mm)
}

/// Tears `range` down on CPU 0 through `MmuGather`, freeing the tables it
/// empties; returns the summary and the table frames freed.
fn teardown<M: Model>(
    t: &mut Tables,
    m: &MockMachine<M>,
    mm: &MmTlbState,
    range: PageRange,
) -> (TeardownSummary, Vec<Frame>) {
    let (mut mapper, _) = t.mapper();
    // SAFETY: each mapped data frame's claim is the test's, handed over
    // here, and no table is shared with another address space.
    let space = unsafe { OffsetSpace::new(&mut mapper, mm).for_teardown() };
    let mut backing = Backing {
        machine: m,
        tables: Vec::new(),
    };
    let mut gather = MmuGather::<16>::new();
    let cpu0 = m.cpu(0).unwrap();
    let mut handed_back = Vec::new();
    let summary = gather
        .unmap_range(
            &cpu0,
            &space,
            &mut backing,
            range,
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |f: OwnedFrame, k: FrameKind| handed_back.push((f.into_frame(), k)),
        )
        .unwrap();
    assert_eq!(handed_back, []);
    (summary, backing.tables)
}

/// The span of the level-`level` table that maps `va`, as pages.
fn span(va: u64, level: u32) -> PageRange {
    let bytes = PAGE_SIZE << (9 * level);
    PageRange::new(va & !(bytes - 1), bytes / PAGE_SIZE).unwrap()
}

/// Whether `cpu`'s walk caches point to `table` at `level`.
fn caches<M: Model>(cpu: &MockCpu<'_, M>, level: u32, table: Frame) -> bool {
    cpu.walk_cache()
        .iter()
        .any(|w| w.level == level && w.table == table)
}

/// Maps one page at `va`, has CPU 1 read it, then tears down the tables
/// below the level-`level` one that maps it (with the page), so that only
/// that table is left, empty; CPU 1 then walks towards `va` again (a
/// speculative walk that faults) and so caches a pointer to it. Returns
/// the table's frame.
fn walked_empty_table<M: Model>(
    t: &mut Tables,
    m: &MockMachine<M>,
    mm: &Arc<MmTlbState>,
    va: u64,
    level: u32,
) -> Frame {
    let data = m.alloc_frame().unwrap();
    let (mut mapper, mut pool) = t.mapper();
    map::<Size4KiB>(&mut mapper, &mut pool, va, data.addr(), user_rw());
    let mmu = HostMmu { root: t.root_addr() };
    let table = mmu.table_frame_at(va, level).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(mm).unwrap();
    cpu1.read(va).unwrap();
    for l in 1..=3 {
        assert!(caches(&cpu1, l, mmu.table_frame_at(va, l).unwrap()), "level {l}");
    }
    // Everything below `table` goes, through the crate, cleanly.
    let (summary, freed) = teardown(t, m, mm, span(va, level - 1));
    assert_eq!(
        (summary.pages_unmapped, summary.tables_freed),
        (1, level as usize - 1)
    );
    assert!(!freed.contains(&table));
    assert_eq!(mmu.table_frame_at(va, level), Some(table), "still linked");
    assert_eq!(m.violations(), []);
    // A speculative walk through it (it faults below) caches it again.
    assert!(cpu1.read(va).is_err());
    assert!(caches(&cpu1, level, table));
    assert!(!caches(&cpu1, 1, table));
    table
}

/// The scenario of the two tests below: CPU 1 caches a pointer to an
/// empty level-`level` table; a teardown of the table's span frees that
/// table alone, with nothing else to flush; CPU 1's walks afterwards,
/// anywhere in the span, are clean.
fn freeing_a_walked_table_is_clean<M: Model>(va: u64, level: u32) {
    let mut t = Tables::new();
    let (m, mm) = machine_of::<M>(&t);
    let table = walked_empty_table(&mut t, &m, &mm, va, level);
    let (summary, freed) = teardown(&mut t, &m, &mm, span(va, level));
    assert_eq!(m.violations(), [], "freeing the level-{level} table");
    assert_eq!(summary.pages_unmapped, 0);
    assert_eq!(freed, [table], "the level-{level} table alone");
    assert_eq!(summary.flushes, 1);
    let cpu1 = m.cpu(1).unwrap();
    // Speculative accesses all over the span: every one faults, none
    // through the freed table.
    let first = span(va, level).start();
    for probe in [
        va,
        first,
        first + MIB2,
        first + (PAGE_SIZE << (9 * level)) - PAGE_SIZE,
    ] {
        assert!(cpu1.read(probe).is_err(), "{probe:#x}");
        assert!(cpu1.write(probe, 1).is_err(), "{probe:#x}");
    }
    assert_eq!(m.violations(), [], "walks after the teardown");
    assert!(!caches(&cpu1, level, table), "the flush dropped the pointer");
}

#[test]
fn a_freed_page_directory_is_flushed_from_a_cpu_that_walked_through_it() {
    freeing_a_walked_table_is_clean::<X86Like>(GIB + 5 * MIB2 + 3 * PAGE_SIZE, 2);
}

#[test]
fn a_freed_pdpt_is_flushed_from_a_cpu_that_walked_through_it() {
    freeing_a_walked_table_is_clean::<X86Like>(GIB512 + GIB + 3 * PAGE_SIZE, 3);
}

#[test]
fn on_arm64_too_a_freed_upper_table_is_flushed_by_the_broadcast() {
    freeing_a_walked_table_is_clean::<Arm64Like>(GIB + 5 * MIB2 + 3 * PAGE_SIZE, 2);
    freeing_a_walked_table_is_clean::<Arm64Like>(GIB512 + GIB + 3 * PAGE_SIZE, 3);
}

/// One teardown that frees every level at once (leaf, level-2 and level-3
/// tables) under a CPU that walked through all of them to a page it wrote.
#[test]
fn a_teardown_freeing_every_level_under_a_walking_cpu_is_clean() {
    let mut t = Tables::new();
    let (m, mm) = machine_of::<X86Like>(&t);
    let vas = [GIB512 + 3 * PAGE_SIZE, GIB512 + GIB + 7 * MIB2];
    let (mut mapper, mut pool) = t.mapper();
    for va in vas {
        let data = m.alloc_frame().unwrap();
        map::<Size4KiB>(&mut mapper, &mut pool, va, data.addr(), user_rw());
    }
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    for va in vas {
        cpu1.write(va, 7).unwrap();
    }
    assert_eq!(cpu1.walk_cache().iter().filter(|w| w.level == 3).count(), 1);
    assert_eq!(cpu1.walk_cache().iter().filter(|w| w.level == 2).count(), 2);
    let (summary, freed) = teardown(&mut t, &m, &mm, span(vas[0], 3));
    assert_eq!(summary.pages_unmapped, 2);
    assert_eq!(freed.len(), 5, "two leaves, two page directories, the PDPT");
    assert!(cpu1.walk_cache().is_empty());
    for va in vas {
        assert!(cpu1.read(va).is_err());
    }
    assert_eq!(m.violations(), []);
}

/// The oracle's side: a page directory freed without a flush while CPU 1
/// caches a pointer to it is `TableFreedWhileCached`, and CPU 1's next walk
/// through the pointer is `WalkThroughFreedTable`; on a CPU whose pointer
/// a flush dropped, neither.
#[test]
fn a_page_directory_freed_under_a_cached_pointer_is_caught() {
    let mut t = Tables::new();
    let (m, mm) = machine_of::<X86Like>(&t);
    let va = GIB + 3 * PAGE_SIZE;
    let pd = walked_empty_table(&mut t, &m, &mm, va, 2);
    // Unlink it by hand, as a kernel would, and free it with no flush.
    let pdpte = common::x86_tables::upper_entry(t.root_addr(), va, 3);
    pdpte.store(0, std::sync::atomic::Ordering::SeqCst);
    m.free_table_frame(pd);
    let cpu1 = m.cpu(1).unwrap();
    assert_eq!(
        m.violations(),
        [Violation::TableFreedWhileCached {
            frame: pd,
            cpu: cpu1.id()
        }]
    );
    assert!(cpu1.read(GIB + 9 * MIB2).is_err());
    assert_eq!(
        m.violations()[1..],
        [Violation::WalkThroughFreedTable {
            cpu: cpu1.id(),
            table: pd,
            va: GIB + 9 * MIB2
        }]
    );
}

/// x86: INVLPG of any page of the loaded ASID drops every walk-cache entry
/// of that ASID (Intel SDM vol. 3A, 4.10.4.1), so CPU 1's pointer to a page
/// directory goes with a flush of a page in another GiB.
#[test]
fn invlpg_drops_every_walk_cache_entry_of_the_loaded_asid() {
    let mut t = Tables::new();
    let (m, mm) = machine_of::<X86Like>(&t);
    let pd = walked_empty_table(&mut t, &m, &mm, GIB + 3 * PAGE_SIZE, 2);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.flush_local_page(mm.asid(), 5 * GIB);
    assert!(!caches(&cpu1, 2, pd));
    assert!(cpu1.walk_cache().is_empty());
}

/// arm64: a TLBI by VA drops only the walk-cache entries on the way to
/// that VA, at every level: a flush of a page in another GiB leaves the
/// pointer to the page directory (and the level-3 table's), one inside its
/// GiB drops both, and one inside the level-3 table's span but another GiB
/// drops the level-3 pointer only.
#[test]
fn a_tlbi_by_va_drops_only_the_walk_cache_entries_on_its_way() {
    let mut t = Tables::new();
    let (m, mm) = machine_of::<Arm64Like>(&t);
    let va = GIB + 3 * PAGE_SIZE;
    let pd = walked_empty_table(&mut t, &m, &mm, va, 2);
    let pdpt = HostMmu { root: t.root_addr() }.table_frame_at(va, 3).unwrap();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    // Outside the level-3 table's 512 GiB: nothing goes.
    cpu0.broadcast_flush_page(mm.asid(), GIB512 + GIB);
    cpu0.broadcast_sync();
    assert!(caches(&cpu1, 2, pd) && caches(&cpu1, 3, pdpt));
    // Another GiB under the same level-3 table: its pointer goes.
    cpu0.broadcast_flush_page(mm.asid(), 2 * GIB);
    cpu0.broadcast_sync();
    assert!(caches(&cpu1, 2, pd) && !caches(&cpu1, 3, pdpt));
    // Inside the page directory's GiB: its pointer goes too.
    cpu0.broadcast_flush_page(mm.asid(), GIB + 77 * MIB2);
    cpu0.broadcast_sync();
    assert!(!caches(&cpu1, 2, pd));
    // The local form on CPU 1 follows the same rule.
    assert!(cpu1.read(va).is_err());
    assert!(caches(&cpu1, 2, pd));
    cpu1.flush_local_page(mm.asid(), 3 * GIB);
    assert!(caches(&cpu1, 2, pd));
    cpu1.flush_local_page(mm.asid(), va);
    assert!(cpu1.walk_cache().is_empty());
    assert_eq!(m.violations(), []);
}

/// Tagged TLBs: CPU 1 walked through a page directory, then switched to
/// another address space, leaving the first one's CPU set but keeping its
/// tagged pointer. The teardown's flush skips CPU 1, the table is freed
/// (no violation: CPU 1 cannot use the pointer without loading the ASID),
/// and when CPU 1 switches back the crate's catch-up drops the pointer
/// before its first walk (no `LoadedWithStaleWalk`).
#[test]
fn a_cpu_that_switched_away_catches_up_before_it_walks_again() {
    let mut t = Tables::new();
    let m = MockMachine::<X86Like>::new(MockConfig {
        tagged_tlb: true,
        ..MockConfig::x86_like(2)
    })
    .unwrap();
    let root = t.root_addr();
    let mm = m.new_mm_at(asid(1), root).unwrap();
    m.attach_table(&mm, Arc::new(HostMmu { root })).unwrap();
    let va = GIB + 3 * PAGE_SIZE;
    let pd = walked_empty_table(&mut t, &m, &mm, va, 2);
    let other = m.new_mm(asid(2)).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&other).unwrap();
    assert!(caches(&cpu1, 2, pd), "tagged: the pointer stays");
    let (summary, freed) = teardown(&mut t, &m, &mm, span(va, 2));
    assert_eq!(freed, [pd]);
    assert_eq!(summary.flushes, 1);
    assert!(caches(&cpu1, 2, pd), "the flush skipped CPU 1");
    assert_eq!(m.violations(), []);
    cpu1.switch_to(&mm).unwrap();
    assert_eq!(m.violations(), [], "at the load");
    assert!(!caches(&cpu1, 2, pd), "the catch-up dropped it");
    assert!(cpu1.read(va).is_err());
    assert_eq!(m.violations(), []);
}

/// A CPU away while a table it walked through is freed is not judged at
/// the free (an offline CPU walks nothing) but as it rejoins: through
/// `come_online` (which runs `prepare_cpu_online`) its walk caches are
/// empty; through the raw switch the pointer it kept is
/// `OnlineWithStaleWalk`.
#[test]
fn a_cpu_rejoining_with_a_pointer_to_a_table_freed_while_away_is_caught() {
    let va = GIB + 5 * MIB2 + 3 * PAGE_SIZE;
    for proper in [true, false] {
        let mut t = Tables::new();
        let (m, mm) = machine_of::<X86Like>(&t);
        let table = walked_empty_table(&mut t, &m, &mm, va, 2);
        m.set_online(1, false).unwrap();
        let (_, freed) = teardown(&mut t, &m, &mm, span(va, 2));
        assert_eq!(freed, [table]);
        assert_eq!(m.violations(), [], "an offline CPU walks nothing");
        let cpu1 = m.cpu(1).unwrap();
        assert!(caches(&cpu1, 2, table), "the flush did not reach it");
        if proper {
            cpu1.come_online();
            assert_eq!(m.violations(), []);
            assert!(cpu1.walk_cache().is_empty());
        } else {
            m.set_online(1, true).unwrap();
            assert_eq!(
                m.violations(),
                [Violation::OnlineWithStaleWalk {
                    cpu: cpu1.id(),
                    table
                }]
            );
        }
    }
}

/// What the rejoin judges is what the CPU still holds: on `Arm64Like`, a
/// broadcast `TLBI` by VA reaches every CPU's TLB, an offline one's too
/// (one parked, not powered off), and takes the walk-cache pointers on its
/// way. CPU 1, away, keeps
/// pointers to two page directories, both freed (with no flush: the
/// oracle's record is what is tested); a broadcast for an address under
/// the first drops that pointer only, so the rejoin holds the second
/// alone against it.
#[test]
fn a_rejoin_is_judged_on_the_pointers_still_cached() {
    let mut t = Tables::new();
    // Three CPUs: CPU 2 runs the space (walking nothing), so that the
    // flush has a remote target and goes out as a broadcast.
    let m = MockMachine::<Arm64Like>::with_model(MockConfig::x86_like(3)).unwrap();
    let root = t.root_addr();
    let mm = m.new_mm_at(asid(1), root).unwrap();
    m.attach_table(&mm, Arc::new(HostMmu { root })).unwrap();
    m.cpu(2).unwrap().switch_to(&mm).unwrap();
    let vas = [GIB + 3 * PAGE_SIZE, GIB512 + GIB + 3 * PAGE_SIZE];
    let (mut mapper, mut pool) = t.mapper();
    for va in vas {
        let data = m.alloc_frame().unwrap();
        map::<Size4KiB>(&mut mapper, &mut pool, va, data.addr(), user_rw());
    }
    let mmu = HostMmu { root: t.root_addr() };
    let tables = vas.map(|va| mmu.table_frame_at(va, 2).unwrap());
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    for va in vas {
        cpu1.read(va).unwrap();
    }
    m.set_online(1, false).unwrap();
    for table in tables {
        m.free_table_frame(table);
    }
    assert_eq!(m.violations(), [], "CPU 1 is away");
    tlb_batch::flush_tlb_page(&m.cpu(0).unwrap(), &mm, vas[0]).unwrap();
    assert!(!caches(&cpu1, 2, tables[0]), "the broadcast reached it");
    assert!(caches(&cpu1, 2, tables[1]));
    m.set_online(1, true).unwrap();
    assert_eq!(
        m.violations(),
        [Violation::OnlineWithStaleWalk {
            cpu: cpu1.id(),
            table: tables[1]
        }]
    );
}
