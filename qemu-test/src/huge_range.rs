//! The range operations over the 2 MiB page of [`crate::huge`], which
//! they take as one entry when the range covers it wholly, while the APs
//! read and write it (the same loop, the same 64 pieces):
//!
//! 1. **mprotect**: `change_protection` over the page's 2 MiB makes it
//!    read-only. The page-directory entry must stay a 2 MiB entry over the
//!    same block with its dirty bit (set by the APs' stores) kept, the
//!    call must cost one shootdown and one invalidation on each CPU, and
//!    once it returned every AP store must fault while every read still
//!    returns the block's data.
//! 2. **teardown**: `MmuGather::unmap_range` with table freeing
//!    (`TableFreePolicy::IpiSync`, as [`crate::teardown`]) over the whole
//!    span of the space's PML4 entry, so that the page directory and the
//!    PDPT, which held nothing but the page, go too. The kernel's side is
//!    [`Backing`]: handed the block's first 4 KiB frame, it frees the whole
//!    block by reusing it at once (another pattern in every piece), and it
//!    checks that the flush came first, for the block and for the tables.
//!    The freed tables' span is far past the full-flush ceiling, so the
//!    one flush is of the whole address space on each CPU. After it every
//!    AP access must fault, and none may read the new pattern.
//!
//! The control (`negative-huge`, and `negative`) skips both flushes as
//! [`crate::huge`]'s does: stores through the APs' stale writable
//! translations after the mprotect, and reads of the reused block and
//! stores into it after the teardown, must fail both scenarios.

use core::sync::atomic::Ordering;

use tlb_batch::mapper::OffsetSpace;
use tlb_batch::{
    change_protection, heapless, Frame, FreeFrames, MmTlbState, MmuGather, OwnedFrame, PageRange, PageSize,
    PageTable, Pte, PteFlags, TableFreePolicy, TeardownBacking, TeardownSummary, TlbStatsSnapshot,
};
use x86_64::structures::paging::{OffsetPageTable, PageTableFlags};

use crate::huge::{
    self, block_word, fill, pde, total, BLOCK, FAULTS, GONE, OTHER_WRONG, PHASE, PIECES, PROTECTED,
    REUSED_READS, STALE, TAG_BLOCK, TAG_REUSED, VA,
};
use crate::reclaim::ipis_taken;
use crate::shared::{self, NoInvalidate};
use crate::{aps, arch, fatal, flow, paging, report, ONLINE, TLB};

/// The page-directory entry's frame bits, for a 2 MiB entry.
const HUGE_FRAME: u64 = 0x000f_ffff_ffe0_0000;
const ACCESSED: u64 = 1 << 5;
const DIRTY: u64 = 1 << 6;

/// Both flows, on the space [`crate::huge::run`] built, after its split:
/// the page is mapped whole again first. Leaves the PML4 entry of [`VA`]
/// cleared when the teardown did its work.
pub fn run(mapper: &mut OffsetPageTable<'_>, mm: &'static MmTlbState, root: u64, control: bool) -> [bool; 2] {
    huge::unlink_leaf(root);
    fill(BLOCK, TAG_BLOCK);
    if !huge::map_block(mapper) {
        fatal("map_to refused the 2 MiB page for the range operations");
    }
    let protected = mprotect(mapper, mm, root, control);
    // Writable again for the teardown, every TLB scrubbed (the control's
    // stale entries with them).
    pde(root).fetch_or(PageTableFlags::WRITABLE.bits(), Ordering::SeqCst);
    flow::scrub();
    let torn_down = teardown(mapper, mm, root, control);
    [protected, torn_down]
}

fn whole_page() -> PageRange {
    match PageRange::from_bounds(VA, VA + PIECES * 4096) {
        Ok(r) => r,
        Err(_) => fatal("bad huge-page range"),
    }
}

/// Step 1: the 2 MiB page made read-only as one entry.
fn mprotect(mapper: &mut OffsetPageTable<'_>, mm: &'static MmTlbState, root: u64, control: bool) -> bool {
    huge::start_touching();
    let entry = pde(root);
    let before = entry.load(Ordering::SeqCst);
    let space = OffsetSpace::new(mapper, mm);
    let read_only = |pte: Pte| Pte(pte.0 & !PteFlags::WRITABLE.bits());
    let (stats, irqs) = (TLB.stats(), ipis_taken());
    let changed = if control {
        shared::REMOTE.store(shared::SKIP, Ordering::SeqCst);
        let r = change_protection(&NoInvalidate(arch()), &space, whole_page(), read_only);
        shared::REMOTE.store(shared::FLUSH, Ordering::SeqCst);
        r
    } else {
        change_protection(&arch(), &space, whole_page(), read_only)
    };
    // From here on, a store that lands is stale.
    PHASE.store(PROTECTED, Ordering::SeqCst);
    let d = TLB.stats().since(&stats);
    let taken = ipis_taken() - irqs;
    flow::wait_passes(aps(), 4);
    flow::stop(aps());
    let (stale, faults, wrong) = (total(&STALE), total(&FAULTS), total(&OTHER_WRONG));
    let after = entry.load(Ordering::SeqCst);
    let size_2m = space.entry_size(VA + 9 * 4096) == PageSize::SIZE_2M;
    let intact = (0..PIECES)
        .filter(|&k| block_word(BLOCK, k, 0).load(Ordering::SeqCst) == TAG_BLOCK | k)
        .count() as u64;
    let cpus = ONLINE.load(Ordering::SeqCst);
    let aps_n = cpus - 1;
    let huge_bit = PageTableFlags::HUGE_PAGE.bits();
    let writable = PageTableFlags::WRITABLE.bits();
    let entry_ok =
        after & huge_bit != 0 && after & HUGE_FRAME == BLOCK && after & writable == 0 && after & 1 != 0;
    let dirty_kept = before & DIRTY != 0 && after & DIRTY != 0 && after & ACCESSED != 0;
    let ok = changed == Ok(1)
        && before & writable != 0
        && entry_ok
        && size_2m
        && dirty_kept
        && d.shootdowns == 1
        && d.ipis_sent == aps_n as u64
        && taken == aps_n as u64
        && d.local_page_flushes == cpus as u64
        && d.local_full_flushes == 0
        && intact == PIECES
        && faults > 0
        && wrong == 0
        && stale == 0;
    report(
        "huge page mprotect",
        ok,
        format_args!(
            "2 MiB page written by {aps_n} APs; change_protection of its 2 MiB to read-only: {} entry changed, still \
             a 2 MiB entry over the same block: {}, dirty bit kept: {dirty_kept}; {} shootdown, {} IPIs sent and \
             {taken} taken, {} invalidations on {cpus} CPUs ({} full){}; then {faults} AP writes faulted, {intact} \
             of {PIECES} pieces intact; stale: {stale} writes landed after change_protection returned or reads \
             returned another value, {wrong} other",
            changed.unwrap_or(0),
            entry_ok && size_2m,
            d.shootdowns,
            d.ipis_sent,
            d.local_page_flushes,
            d.local_full_flushes,
            if control { " (flush skipped: the control)" } else { "" }
        ),
    )
}

/// The kernel's side of the teardown: frees the block (by reusing it) and
/// the tables, and records whether the one flush came before each.
struct Backing {
    /// The counts when the teardown started.
    stats: TlbStatsSnapshot,
    /// The block's first frame handed over; other frames handed over.
    block: u32,
    others: u32,
    /// The block's dirty bit moved to it.
    dirty: bool,
    /// Frees (block, tables) that came after the flush.
    block_after_flush: u32,
    tables: u32,
    tables_after_flush: u32,
}

impl Backing {
    fn flushed(&self) -> bool {
        TLB.stats().since(&self.stats).shootdowns == 1
    }
}

impl FreeFrames for Backing {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        while let Some(f) = frames.pop() {
            if f.into_frame() != Frame(BLOCK >> 12) {
                self.others += 1;
                continue;
            }
            self.block += 1;
            self.block_after_flush += u32::from(self.flushed());
            // Freed, and reused at once: from now on an AP access that
            // does not fault, or reads the new pattern, is stale.
            PHASE.store(GONE, Ordering::SeqCst);
            fill(BLOCK, TAG_REUSED);
        }
    }
}

impl TeardownBacking for Backing {
    fn set_dirty(&mut self, frame: Frame) {
        self.dirty |= frame == Frame(BLOCK >> 12);
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        while let Some(f) = tables.pop() {
            self.tables += 1;
            self.tables_after_flush += u32::from(self.flushed());
            // Pool frames (the mapper's), poisoned as they are freed.
            paging::free(f.into_frame().addr());
        }
    }
}

/// Step 2: the teardown of the whole PML4 entry's span, the 2 MiB page and
/// its tables with it.
fn teardown(mapper: &mut OffsetPageTable<'_>, mm: &'static MmTlbState, root: u64, control: bool) -> bool {
    huge::start_touching();
    let Ok(range) = PageRange::from_bounds(VA, VA + (1 << 39)) else {
        fatal("bad huge-page teardown range");
    };
    // SAFETY: the space maps nothing in the range but the 2 MiB page, whose
    // entry is the one claim on the block (freed by `Backing`); its PDPT
    // and page directory are pool frames of this space alone.
    let space = unsafe { OffsetSpace::new(mapper, mm).for_teardown() };
    let (stats, irqs) = (TLB.stats(), ipis_taken());
    let mut backing = Backing {
        stats,
        block: 0,
        others: 0,
        dirty: false,
        block_after_flush: 0,
        tables: 0,
        tables_after_flush: 0,
    };
    let mut gather: MmuGather<4> = MmuGather::new();
    let mut handed_back = 0;
    let mut policy = TableFreePolicy::IpiSync;
    let mut handback = |_: OwnedFrame, _| handed_back += 1;
    let summary = if control {
        shared::REMOTE.store(shared::SKIP, Ordering::SeqCst);
        let skip = NoInvalidate(arch());
        let r = gather.unmap_range(
            &skip,
            &space,
            &mut backing,
            range,
            true,
            &mut policy,
            &mut handback,
        );
        shared::REMOTE.store(shared::FLUSH, Ordering::SeqCst);
        r
    } else {
        gather.unmap_range(
            &arch(),
            &space,
            &mut backing,
            range,
            true,
            &mut policy,
            &mut handback,
        )
    };
    PHASE.store(GONE, Ordering::SeqCst);
    let d = TLB.stats().since(&stats);
    let taken = ipis_taken() - irqs;
    flow::wait_passes(aps(), 4);
    flow::stop(aps());
    let (stale, reused, faults) = (total(&STALE), total(&REUSED_READS), total(&FAULTS));
    let unlinked = paging::word(root + paging::index(VA, 4) * 8).load(Ordering::SeqCst) == 0;
    let cpus = ONLINE.load(Ordering::SeqCst);
    let aps_n = cpus - 1;
    let s = summary.unwrap_or(TeardownSummary::default());
    let ok = summary.is_ok()
        && (s.pages_unmapped, s.data_freed, s.data_free_calls, s.tables_freed) == (1, 1, 1, 2)
        && (s.flushes, s.syncs) == (1, 1)
        && (backing.block, backing.others, backing.block_after_flush) == (1, 0, 1)
        && (backing.tables, backing.tables_after_flush) == (2, 2)
        && backing.dirty
        && handed_back == 0
        && unlinked
        && d.shootdowns == 1
        && d.ipis_sent == 2 * aps_n as u64
        && taken == 2 * aps_n as u64
        && d.local_full_flushes == cpus as u64
        && d.local_page_flushes == 0
        && faults > 0
        && stale == 0;
    report(
        "huge page teardown",
        ok,
        format_args!(
            "2 MiB page written by {aps_n} APs; unmap_range of its PML4 entry's span with IpiSync: {} page \
             unmapped, dirty moved to the block: {}, {} flush ({} IPIs sent and {taken} taken with the sync, {} \
             invalidations of the whole space on {cpus} CPUs, {} of a page){}; handed to free_batch: the block's \
             first frame {} (after the flush {}), reused at once, other frames {}, handed back {handed_back}; \
             tables freed {} (after the flush {}, the PML4 entry cleared: {unlinked}), syncs {}; then {faults} AP accesses \
             faulted; stale: {stale} accesses went through after the flush ({reused} reads of the reused block)",
            s.pages_unmapped,
            backing.dirty,
            s.flushes,
            d.ipis_sent,
            d.local_full_flushes,
            d.local_page_flushes,
            if control { " (flush skipped: the control)" } else { "" },
            backing.block,
            backing.block_after_flush,
            backing.others,
            backing.tables,
            backing.tables_after_flush,
            s.syncs,
        ),
    )
}
