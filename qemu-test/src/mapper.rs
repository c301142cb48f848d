//! The crate embedded the way a hobby kernel that builds its page tables
//! with the `x86_64` crate would do it (feature `x86_64-mapper`).
//!
//! A fresh PML4 from the frame pool, sharing the kernel's identity map
//! through entry 0, becomes an `OffsetPageTable` with physical offset 0
//! (everything the pool hands out is identity-mapped). Pages are mapped
//! with `Mapper::map_to`, the tables coming from the pool through a
//! `FrameAllocator`, and the address space is loaded on every CPU with
//! `switch_mm` while the APs store into the pages. Then, through
//! `OffsetSpace`, the range is made read-only with `change_protection`
//! (no store may land once it returned, the dirty bits must survive, and
//! the `x86_64` crate must read the entries back read-only) and torn down
//! with `MmuGather` over `OffsetTeardown` (the frames and every table the
//! mapper created go back to the pool, poisoned; no AP may touch them
//! afterwards, and the `x86_64` crate must find nothing mapped there).

use core::cell::UnsafeCell;
use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicBool, Ordering};

use tlb_batch::mapper::OffsetSpace;
use tlb_batch::{
    change_protection, Asid, MmTlbState, MmuGather, PageRange, PageTable as _, Pte, PteFlags, TableFreePolicy,
};
use x86_64::structures::paging::mapper::{MappedFrame, TranslateResult};
use x86_64::structures::paging::{
    FrameAllocator, Mapper, OffsetPageTable, Page, PageTable as X86Table, PageTableFlags, PhysFrame,
    Size4KiB, Translate,
};
use x86_64::{PhysAddr, VirtAddr};

use crate::flow::{self, BAD_READS, FAULTS, LATE, PHASE};
use crate::paging;
use crate::reclaim::ipis_taken;
use crate::{aps, arch, fatal, report, TLB};

/// No other scenario uses this ASID (nor the PCID it becomes).
const ASID: u16 = 9;
/// PML4 entry 3: the mapper creates a PDPT, a page directory and a leaf
/// table for the pages.
const BASE: u64 = 0x180_0000_0000;
const PAGES: usize = 32;
/// The teardown covers all 512 GiB of that PML4 entry, so all three
/// tables lie inside it and are detached and freed.
const SPAN: u64 = 1 << 39;
const TABLES: usize = 3;

/// Page-table and data frames for the `x86_64` crate, from the kernel's
/// frame pool (zeroed, identity-mapped, 4 KiB-aligned).
pub(crate) struct PoolFrames;

// SAFETY: every frame comes from `paging::alloc`, which hands out each
// pool frame once until it is freed, so no frame is returned twice.
unsafe impl FrameAllocator<Size4KiB> for PoolFrames {
    fn allocate_frame(&mut self) -> Option<PhysFrame> {
        PhysFrame::from_start_address(PhysAddr::new(paging::alloc()?)).ok()
    }
}

/// Where a scenario's `MmTlbState` lives. Its root is a pool frame, so it
/// is built at run time; the APs reach it through `flow::load_mm`, which
/// wants a state that outlives the scenario. (The huge-page scenario,
/// [`crate::huge`], keeps its own.)
pub(crate) struct MmSlot {
    state: UnsafeCell<MaybeUninit<MmTlbState>>,
    written: AtomicBool,
}

// SAFETY: `state` is written once (`put` makes a second write fatal), by
// the boot CPU, before its address reaches any other CPU (through
// `flow::load_mm`'s SeqCst stores); afterwards it is only shared.
unsafe impl Sync for MmSlot {}

impl MmSlot {
    pub(crate) const fn new() -> MmSlot {
        MmSlot {
            state: UnsafeCell::new(MaybeUninit::uninit()),
            written: AtomicBool::new(false),
        }
    }

    pub(crate) fn put(&'static self, mm: MmTlbState) -> &'static MmTlbState {
        if self.written.swap(true, Ordering::SeqCst) {
            fatal("a scenario's address space was set up twice");
        }
        // SAFETY: the first and only write (checked just above); no
        // reference into `state` exists before it.
        unsafe { (*self.state.get()).write(mm) }
    }
}

static MM: MmSlot = MmSlot::new();

/// What the `x86_64` crate reads for `va`: the 4 KiB frame and the leaf
/// entry's flags, or `None` when nothing (or a huge page) maps it.
fn translate(mapper: &OffsetPageTable<'_>, va: u64) -> Option<(u64, PageTableFlags)> {
    match mapper.translate(VirtAddr::new(va)) {
        TranslateResult::Mapped {
            frame: MappedFrame::Size4KiB(frame),
            flags,
            ..
        } => Some((frame.start_address().as_u64(), flags)),
        _ => None,
    }
}

/// The scenario; `kernel_entry` is the boot PML4's entry 0 (the kernel's
/// identity map), shared with the new address space.
pub fn scenario_mapper(kernel_entry: u64) -> bool {
    let in_use = paging::in_use();
    let Some(root) = paging::alloc() else {
        fatal("the frame pool is exhausted");
    };
    paging::word(root).store(kernel_entry, Ordering::SeqCst);
    let Ok(asid) = Asid::new(ASID) else {
        fatal("the mapper scenario's ASID is out of range");
    };
    let mm = MM.put(MmTlbState::new(asid, root));
    let ok = {
        // SAFETY: `root` is a pool frame allocated just above (zeroed, but
        // for the kernel's entry 0), identity-mapped and page-aligned, used
        // as nothing but this table until it is freed below, once this
        // block (and the mapper with it) has ended. Offset 0 is right for
        // every table the mapper can reach: the pool frames it allocates
        // and the boot tables under entry 0 are all identity-mapped.
        let mut mapper = unsafe { OffsetPageTable::new(&mut *(root as *mut X86Table), VirtAddr::new(0)) };
        run(&mut mapper, mm, in_use + 1)
    };
    // No CPU has the space loaded any more, and every TLB was scrubbed.
    paging::free(root);
    ok
}

/// Runs it over `mapper`'s empty table; `in_use` is how many pool frames
/// are allocated with the table's root and nothing under it.
fn run(mapper: &mut OffsetPageTable<'_>, mm: &'static MmTlbState, in_use: usize) -> bool {
    let a = arch();
    flow::reset(BASE, PAGES, 512);

    // What the kernel did before it ever heard of tlb-batch.
    let flags = PageTableFlags::PRESENT | PageTableFlags::WRITABLE;
    let mut frames = [0u64; PAGES];
    let mut mapped = 0;
    for (p, slot) in frames.iter_mut().enumerate() {
        let Some(frame) = PoolFrames.allocate_frame() else {
            fatal("the frame pool is exhausted");
        };
        let page = Page::<Size4KiB>::containing_address(VirtAddr::new(flow::page_va(p)));
        // SAFETY: a fresh pool frame, mapped nowhere else, at an address
        // nothing in this address space maps yet.
        if let Ok(flush) = unsafe { mapper.map_to(page, frame, flags, &mut PoolFrames) } {
            // No CPU has loaded this address space yet, so no TLB can
            // hold the page: there is nothing to invalidate.
            flush.ignore();
            *slot = frame.start_address().as_u64();
            mapped += 1;
        }
    }

    flow::load_mm(Some(mm), aps());
    flow::start(aps(), flow::WRITER, 0);
    flow::wait_passes(aps(), 3);

    // The embedding: a few lines around the kernel's own mapper.
    let (Ok(range), Ok(whole)) = (
        PageRange::from_bounds(BASE, BASE + PAGES as u64 * 4096),
        PageRange::from_bounds(BASE, BASE + SPAN),
    ) else {
        fatal("bad mapper range");
    };
    let (stats, irqs) = (TLB.stats(), ipis_taken());
    let (dirty, no_huge, changed) = {
        let space = OffsetSpace::new(mapper, mm);
        let dirty = (0..PAGES)
            .filter(|&p| space.lookup(flow::page_va(p)).is_dirty())
            .count();
        let no_huge = space.check_no_huge(range).is_ok();
        let changed = if no_huge {
            change_protection(&a, &space, range, |pte| Pte(pte.0 & !PteFlags::WRITABLE.bits()))
        } else {
            Ok(0)
        };
        (dirty, no_huge, changed)
    };
    // From here on, any store that completes is a failure.
    PHASE.store(1, Ordering::SeqCst);
    flow::wait_passes(aps(), 3);

    // Read back through the kernel's mapper, with the writers paused so
    // that the MMU changes no entry under these plain reads.
    flow::stop(aps());
    let read_only = (0..PAGES)
        .filter(|&p| {
            translate(mapper, flow::page_va(p)).is_some_and(|(pa, f)| {
                pa == frames[p] && !f.contains(PageTableFlags::WRITABLE) && f.contains(PageTableFlags::DIRTY)
            })
        })
        .count();
    flow::start(aps(), flow::WRITER, 0);
    flow::wait_passes(aps(), 1);

    // munmap: pages, leaf table, page directory and PDPT back to the pool.
    let mut pool = paging::Pool::default();
    let mut handed_back = 0;
    let torn = {
        // SAFETY: every present entry in the range was made by `map_to`
        // above with a fresh pool frame: it holds the only claim on it. The
        // tables below PML4 entry 3 were allocated by the mapper for this
        // address space alone (the shared kernel tables hang off entry 0,
        // outside the range).
        let space = unsafe { OffsetSpace::new(mapper, mm).for_teardown() };
        let mut gather: MmuGather<PAGES> = MmuGather::new();
        // AfterFlush: no code here walks page tables without holding the
        // mapper, so the flush alone (which covers the tables' ranges, for
        // the paging-structure caches) makes the tables free to reuse.
        gather.unmap_range(
            &a,
            &space,
            &mut pool,
            whole,
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |_, _| handed_back += 1,
        )
    };
    flow::wait_passes(aps(), 3);
    flow::stop(aps());
    let d = TLB.stats().since(&stats);
    let taken = ipis_taken() - irqs;
    let late = flow::sum(&LATE, aps());
    let bad_reads = flow::sum(&BAD_READS, aps());
    let faults = flow::sum(&FAULTS, aps());
    let after_free = flow::broken(&pool.log);
    let gone = (0..PAGES)
        .filter(|&p| translate(mapper, flow::page_va(p)).is_none())
        .count();
    flow::load_mm(None, aps());
    flow::scrub();

    let (pages_freed, tables_freed) = torn.map_or((0, 0), |s| (s.data_freed, s.tables_freed));
    let ok = mapped == PAGES
        && dirty == PAGES
        && no_huge
        && changed == Ok(PAGES)
        && read_only == PAGES
        && torn.is_ok_and(|s| s.pages_unmapped == PAGES)
        && pages_freed == PAGES
        && tables_freed == TABLES
        && handed_back == 0
        && gone == PAGES
        && paging::in_use() == in_use
        && faults > 0
        && late == 0
        && after_free == 0
        && bad_reads == 0;
    report(
        "x86_64-crate mapper",
        ok,
        format_args!(
            "{mapped} pages mapped with map_to, {dirty} dirtied by the MMU, {} made read-only ({read_only} read back \
             read-only and dirty by the x86_64 crate), {} flushes, {} IPIs \
             sent and {taken} taken, {pages_freed} pages and {tables_freed} tables freed; stale: {late} writes after \
             change_protection returned, {after_free} freed frames written, {bad_reads} reads returned another value",
            changed.unwrap_or(0),
            d.shootdowns,
            d.ipis_sent
        ),
    )
}
