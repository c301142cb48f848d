//! A page table handed to the crate with an `MmTlbState` that holds
//! another root than the table's own (`Error::RootMismatch`): flushes go
//! to the CPUs that loaded the state's root, so the CPUs running the table
//! would keep their entries while its frames are freed. Every entry point
//! that changes or ages entries refuses it with nothing changed, over real
//! `x86_64`-crate tables (`OffsetSpace`, `OffsetTeardown`) and over
//! `page_table_multiarch`'s (`PtmSpace`); the kernel's own space is not
//! checked, since its flushes reach every CPU. The mock's `new_mm_at`, the
//! way tests give a state the table's root, refuses a root in use.

#![cfg(all(feature = "x86_64-mapper", feature = "page-table-multiarch", feature = "mock"))]

mod common;

use std::sync::Arc;

use common::asid;
use common::x86_tables::{machine_with, map, user_rw, Dealloc, HostMmu, OneMapping, Pages, Tables, GIB};
use tlb_batch::arch::mock::{MockConfig, MockError, MockMachine};
use tlb_batch::mapper::{DeallocatorFrees, OffsetSpace};
use tlb_batch::{
    change_protection, BoundedRmap, Error, Frame, MappingFlags, MmTlbState, PageGather, PageRange, PageTable,
    PAGE_SIZE,
};
use x86_64::structures::paging::Size4KiB;

/// One page of real tables, mapped and cached by CPU 1 through the right
/// state; `wrong` is a second live state (another root) that a confused
/// kernel hands the crate instead.
struct Setup {
    tables: Tables,
    machine: MockMachine,
    right: Arc<MmTlbState>,
    wrong: Arc<MmTlbState>,
    frame: Frame,
}

const VA: u64 = GIB;

fn setup() -> Setup {
    let mut tables = Tables::new();
    let (machine, right) = machine_with(3, &tables);
    let wrong = machine.new_mm(asid(2)).unwrap();
    let frame = machine.alloc_frame().unwrap();
    let (mut mapper, mut pool) = tables.mapper();
    map::<Size4KiB>(&mut mapper, &mut pool, VA, frame.addr(), user_rw());
    let cpu1 = machine.cpu(1).unwrap();
    cpu1.switch_to(&right).unwrap();
    cpu1.write(VA, 5).unwrap();
    // CPU 2 runs the wrong state: a flush of it would reach CPU 2 only.
    machine.cpu(2).unwrap().switch_to(&wrong).unwrap();
    assert!(!machine.cached_translations(frame).is_empty());
    Setup {
        tables,
        machine,
        right,
        wrong,
        frame,
    }
}

impl Setup {
    fn refused(&self) -> Error {
        Error::RootMismatch {
            table: self.tables.root_addr(),
            state: self.wrong.root(),
        }
    }
}

/// Nothing changed: the entry still maps the frame, CPU 1 still caches
/// it, no IPI went out, and the oracle saw nothing wrong.
fn assert_untouched(tables: &mut Tables, machine: &MockMachine, right: &MmTlbState, frame: Frame) {
    let (mut mapper, _) = tables.mapper();
    let space = OffsetSpace::new(&mut mapper, right);
    let pte = space.lookup(VA);
    assert!(pte.maps(frame) && pte.is_writable() && pte.is_dirty());
    assert!(!machine.cached_translations(frame).is_empty());
    assert_eq!(machine.ipis_sent(), 0);
    assert_eq!(machine.violations(), []);
}

#[test]
fn munmap_with_another_spaces_state_is_refused_and_the_right_one_frees_after_the_flush() {
    let s = setup();
    let refused = s.refused();
    let Setup {
        mut tables,
        machine,
        right,
        wrong,
        frame,
    } = s;
    let range = PageRange::new(VA, 512).unwrap();
    let cpu0 = machine.cpu(0).unwrap();
    let mut gather = PageGather::new();
    let mut dealloc = Dealloc(&machine, Vec::new());
    {
        let (mut mapper, _) = tables.mapper();
        // SAFETY: the page is mapped once and its frame is the test's; the
        // tables belong to this space alone.
        let space = unsafe { OffsetSpace::new(&mut mapper, &wrong).for_teardown() };
        // SAFETY: frames are not reference-counted.
        let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
        let got = space.munmap(&cpu0, &mut gather, range, &mut frees);
        assert_eq!(got.unwrap_err(), refused);
    }
    assert!(gather.is_empty() && dealloc.1.is_empty());
    assert_untouched(&mut tables, &machine, &right, frame);

    // The same call with the table's own state: CPU 1 is interrupted, and
    // the frame is freed once no CPU caches it.
    let (mut mapper, _) = tables.mapper();
    // SAFETY: as above.
    let space = unsafe { OffsetSpace::new(&mut mapper, &right).for_teardown() };
    // SAFETY: as above.
    let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
    let summary = space.munmap(&cpu0, &mut gather, range, &mut frees).unwrap();
    assert_eq!((summary.pages_unmapped, summary.ipis_sent), (1, 1));
    assert_eq!(dealloc.1, [frame]);
    assert_eq!(machine.violations(), []);
}

#[test]
fn change_protection_with_another_spaces_state_is_refused() {
    let s = setup();
    let refused = s.refused();
    let Setup {
        mut tables,
        machine,
        right,
        wrong,
        frame,
    } = s;
    let cpu0 = machine.cpu(0).unwrap();
    {
        let (mut mapper, _) = tables.mapper();
        let space = OffsetSpace::new(&mut mapper, &wrong);
        let got = change_protection(&cpu0, &space, PageRange::page(VA).unwrap(), |p| {
            tlb_batch::Pte(p.0 & !tlb_batch::PteFlags::WRITABLE.bits())
        });
        assert_eq!(got, Err(refused));
    }
    assert_untouched(&mut tables, &machine, &right, frame);
}

#[test]
fn reclaim_and_aging_with_another_spaces_state_are_refused_before_any_entry_changes() {
    let s = setup();
    let refused = s.refused();
    let Setup {
        mut tables,
        machine,
        right,
        wrong,
        frame,
    } = s;
    let cpu0 = machine.cpu(0).unwrap();
    {
        let (mut mapper, _) = tables.mapper();
        let space = OffsetSpace::new(&mut mapper, &wrong);
        // Written as a kernel's own: `BoundedRmap::add` refuses the
        // mismatch already.
        let rmap = OneMapping {
            space: &space,
            frame,
            va: VA,
            pages: Pages::default(),
        };
        rmap.assert_walks_refused(&cpu0, refused);

        // BoundedRmap refuses the mapping when it is recorded.
        let pages = Pages::default();
        // SAFETY: nothing is walked.
        let mut bounded: BoundedRmap<'_, OffsetSpace<'_>, Pages, 4> = unsafe { BoundedRmap::new(&pages) };
        let got = bounded.add(frame, &space, VA, MappingFlags::empty());
        assert_eq!(got, Err(refused));
    }
    assert_untouched(&mut tables, &machine, &right, frame);
}

#[test]
fn the_kernels_space_is_not_checked_since_its_flushes_reach_every_cpu() {
    let Setup {
        mut tables,
        machine,
        frame,
        ..
    } = setup();
    let root = tables.root_addr();
    let cpu0 = machine.cpu(0).unwrap();
    let kernel = MmTlbState::kernel(0);
    let (mut mapper, _) = tables.mapper();
    let space = OffsetSpace::new(&mut mapper, &kernel);
    assert_eq!(space.root(), Some(root));
    let changed = change_protection(&cpu0, &space, PageRange::page(VA).unwrap(), |p| {
        tlb_batch::Pte(p.0 & !tlb_batch::PteFlags::WRITABLE.bits())
    })
    .unwrap();
    assert_eq!(changed, 1);
    assert!(
        machine.cached_translations(frame).is_empty(),
        "the kernel space's flush reached CPU 1"
    );
    assert_eq!(machine.violations(), []);
}

#[test]
fn ptm_space_reports_its_root_and_a_state_with_another_is_refused() {
    use common::ptm_tables::{machine_with as ptm_machine, map as ptm_map, table, user_rw as ptm_rw};
    use page_table_multiarch::PageSize;
    use tlb_batch::ptm::PtmSpace;

    let mut t = table();
    let (m, mm) = ptm_machine(2, &t);
    let frame = m.alloc_frame().unwrap();
    ptm_map(&mut t, VA, frame, PageSize::Size4K, ptm_rw());
    let root = t.root_paddr().as_usize() as u64;
    let wrong = MmTlbState::new(asid(3), root + PAGE_SIZE);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.read(VA).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let range = PageRange::page(VA).unwrap();
    let ro = |p: tlb_batch::Pte| tlb_batch::Pte(p.0 & !tlb_batch::PteFlags::WRITABLE.bits());

    let space = PtmSpace::new(&mut t, &wrong);
    assert_eq!(space.root(), Some(root));
    let got = change_protection(&cpu0, &space, range, ro);
    assert_eq!(
        got,
        Err(Error::RootMismatch {
            table: root,
            state: root + PAGE_SIZE
        })
    );
    assert!(space.lookup(VA).is_writable() && !m.cached_translations(frame).is_empty());

    let space = PtmSpace::new(&mut t, &mm);
    assert_eq!(change_protection(&cpu0, &space, range, ro), Ok(1));
    assert!(m.cached_translations(frame).is_empty());
    assert_eq!(m.violations(), []);
}

#[test]
fn new_mm_at_refuses_a_root_in_use_and_takes_it_back_once_the_space_is_gone() {
    let m = MockMachine::new(MockConfig::x86_like(2)).unwrap();
    let t = Tables::new();
    let root = t.root_addr();
    let first = m.new_mm_at(asid(1), root).unwrap();
    assert_eq!(first.root(), root);
    assert_eq!(
        m.new_mm_at(asid(2), root).unwrap_err(),
        MockError::RootInUse { root }
    );
    let kernel_root = m.kernel_mm().root();
    assert_eq!(
        m.new_mm_at(asid(2), kernel_root).unwrap_err(),
        MockError::RootInUse { root: kernel_root }
    );
    // The ASID rule of `new_mm` holds too.
    assert_eq!(
        m.new_mm_at(asid(1), root + PAGE_SIZE).unwrap_err(),
        MockError::AsidInUse { asid: 1 }
    );
    // The attached tables are walked under that root.
    m.attach_table(&first, Arc::new(HostMmu { root })).unwrap();
    drop(first);
    let again = m.new_mm_at(asid(2), root).unwrap();
    assert_eq!((again.root(), again.asid()), (root, asid(2)));
}
