//! A 2 MiB page under the real `X86_64` code: unmapped whole through
//! `try_to_unmap` with a batched flush, then split into 512 small entries
//! through `split_huge_mapping`, while the APs read and write it.
//!
//! The page is mapped with the `x86_64` crate's `Mapper::map_to` (a
//! `Size2MiB` page over a fresh `OffsetPageTable`, as [`crate::mapper`]
//! builds its tables) to a 2 MiB block of RAM above the frame pool, and
//! every CPU loads the space with `switch_mm`. Each AP reads word 0 of
//! some of the block's pieces (4 KiB pages), and writes a word of its own
//! in each, round after round, through fault-surviving probes.
//!
//! 1. **What the emulator keeps** (a measurement, printed as its own line): with
//!    the APs' TLBs filled, the page-directory entry is pointed at another
//!    block with no invalidation, and each AP reads again the pieces it
//!    used and pieces it never used, and then the used ones again after
//!    an `invlpg` of a page outside the huge page. An old value through a
//!    used piece is the stale huge translation the controls below depend
//!    on.
//! 2. **Unmap**: `try_to_unmap` of the block's first frame with
//!    `TtuFlags::BATCH_FLUSH`, through an [`Rmap`] that knows the one
//!    mapping; the batch must hold one invalidation, its flush must cost
//!    one invalidation on each CPU (`TlbStats::local_page_flushes`), and
//!    only then is the block reused (refilled with another pattern). An
//!    access that does not fault once the flush returned is stale.
//! 3. **Split**: the page is mapped again, and `split_huge_mapping` breaks
//!    its entry, flushes it (one invalidation on each CPU), and `make`
//!    links a leaf table of 512 entries over the same frames, pieces
//!    48 to 63 ([`read_only`], all of which every AP uses) without the
//!    writable bit. Afterwards a write to one of those must fault, the
//!    others' writes land, and every read must return the block's data.
//!
//! Which pieces: TCG's TLB is direct-mapped by page number, as few as 64
//! slots, with an 8-entry victim buffer. Pieces 64 apart share a slot, and
//! a piece whose slot the AP's own code or data uses loses its entry at
//! once. So the pieces in use are the first 64 (each AP `c` its own
//! `8c..8c + 8`, pieces 40 to 47 for the measurement's never-used reads,
//! 48 to 63 read-only after the split): each has a slot of its own, and
//! several read-only pieces, not one, leave the control some stale entry
//! to write through whichever slots the kernel's pages take (up to 4 APs;
//! with more, their pieces overlap the others', which only blurs the
//! measurement).
//!
//! Then [`crate::huge_range`] maps the page whole again for the range
//! operations over it: mprotect (`change_protection`) and teardown
//! (`MmuGather::unmap_range`).
//!
//! The negative control (`negative-huge`, and `negative`) runs the same
//! two flows with the flush under test skipped: the crate's shootdown
//! through [`NoInvalidate`] on the boot CPU and the APs acknowledging
//! without flushing ([`shared::REMOTE`]). The reads of the reused block
//! and the writes to the read-only pieces that the APs' stale 2 MiB
//! translations let through must then fail both scenarios.

use core::ops::ControlFlow;
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use tlb_batch::mapper::OffsetSpace;
use tlb_batch::{
    flush_tlb_batched_pending, split_huge_mapping, try_to_unmap, Arch, Asid, Frame, Mapping, MappingFlags,
    MmTlbState, PageSize, Rmap, SwapResult, TlbFlushUnmapBatch, TtuFlags,
};
use x86_64::structures::paging::{
    Mapper, OffsetPageTable, Page, PageTable as X86Table, PageTableFlags, PhysFrame, Size2MiB,
};
use x86_64::{PhysAddr, VirtAddr};

use crate::flow::{self, write_probe, PASSES};
use crate::mapper::{MmSlot, PoolFrames};
use crate::paging;
use crate::reclaim::ipis_taken;
use crate::shared::{self, NoInvalidate};
use crate::{aps, arch, fatal, probe, report, say, COMMAND, IDLE, MAX_CPUS, ONLINE, TLB};

/// AP loop: read and write the pieces, until told to stop.
pub const TOUCH: u32 = 0x80;
/// AP one-shot: read used and unused pieces once (the measurement).
pub const LOOK: u32 = 0x81;

/// No other scenario uses this ASID.
const ASID: u16 = 13;
/// PML4 entry 4: the mapper creates a PDPT and a page directory.
pub(crate) const VA: u64 = 0x200_0000_0000;
/// The block the page maps, and the one the measurement points it at:
/// 2 MiB-aligned RAM above the frame pool (which ends at 112 MiB),
/// identity-mapped by the boot tables, used by nothing else.
pub(crate) const BLOCK: u64 = 0x0740_0000;
const OTHER: u64 = 0x0760_0000;
pub(crate) const PIECES: u64 = 512;
/// Pieces each AP uses of its own: `8 * cpu + j`.
const USED: u64 = 8;
/// The pieces the split maps read-only, which every AP uses.
const FIRST_READ_ONLY: u64 = 48;
const READ_ONLY_PIECES: u64 = 16;
fn read_only(k: u64) -> bool {
    (FIRST_READ_ONLY..FIRST_READ_ONLY + READ_ONLY_PIECES).contains(&k)
}
/// Pieces no AP uses: the measurement reads them once.
const UNUSED: u64 = 40;

pub(crate) const TAG_BLOCK: u64 = 0xb10c_0000_0000;
const TAG_OTHER: u64 = 0x07e4_0000_0000;
pub(crate) const TAG_REUSED: u64 = 0x4e05_0000_0000;

/// What the APs are told the state is (read before each access).
pub(crate) const MAPPED: u32 = 0;
/// The unmap's flush returned: every access must fault.
pub(crate) const GONE: u32 = 1;
/// Between the split's break and its make: anything but a wrong value.
const BREAKING: u32 = 2;
/// The split's make returned: reads succeed, writes fault on
/// the [`read_only`] pieces only.
const SPLIT: u32 = 3;
/// [`crate::huge_range`]'s mprotect returned: reads succeed, every write
/// faults.
pub(crate) const PROTECTED: u32 = 4;
pub(crate) static PHASE: AtomicU32 = AtomicU32::new(MAPPED);

/// Per AP: accesses that went through when they had to fault, or
/// returned what they must not (the scenarios' "stale").
pub(crate) static STALE: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per AP: reads of the reused block's pattern.
pub(crate) static REUSED_READS: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per AP: faults where an access was to go through (after the split).
pub(crate) static OTHER_WRONG: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per AP: accesses that faulted in [`GONE`], and writes to
/// [`read_only`] pieces that faulted in [`SPLIT`].
pub(crate) static FAULTS: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per AP: writes to the other pieces that landed in [`SPLIT`].
pub(crate) static LANDED: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per AP, the measurement: old block read through a used piece, new
/// block read through a used piece, old through an unused, new through an
/// unused; then old through a used piece after an `invlpg` of a page
/// outside the huge page.
static LOOKED: [[AtomicU64; 5]; MAX_CPUS] = [const { [const { AtomicU64::new(0) }; 5] }; MAX_CPUS];

static MM: MmSlot = MmSlot::new();

fn piece_va(k: u64) -> u64 {
    VA + k * 4096
}

fn used_piece(cpu: usize, j: u64) -> u64 {
    (8 * cpu as u64 + j) % PIECES
}

/// Word `w` of piece `k` of the block at `block`, through the identity map.
pub(crate) fn block_word(block: u64, k: u64, w: u64) -> &'static AtomicU64 {
    // SAFETY: BLOCK and OTHER are 2 MiB of identity-mapped RAM each that
    // nothing but this module uses; every access to them is atomic.
    unsafe { &*((block + k * 4096 + w * 8) as *const AtomicU64) }
}

pub(crate) fn fill(block: u64, tag: u64) {
    for k in 0..PIECES {
        for w in 0..512 {
            block_word(block, k, w).store(if w == 0 { tag | k } else { 0 }, Ordering::SeqCst);
        }
    }
}

/// One AP's loop: each used piece and each [`read_only`] one, read then
/// written.
fn touch(cpu: usize) {
    let mut seq = 0u64;
    while COMMAND[cpu].load(Ordering::SeqCst) == TOUCH {
        for k in (0..USED)
            .map(|j| used_piece(cpu, j))
            .chain(FIRST_READ_ONLY..FIRST_READ_ONLY + READ_ONLY_PIECES)
        {
            let va = piece_va(k);
            let phase = PHASE.load(Ordering::SeqCst);
            match probe(va) {
                None if phase == GONE => {
                    FAULTS[cpu].fetch_add(1, Ordering::Relaxed);
                }
                None if phase == SPLIT || phase == PROTECTED => {
                    OTHER_WRONG[cpu].fetch_add(1, Ordering::SeqCst);
                }
                None => {}
                Some(v) => {
                    if v == TAG_REUSED | k {
                        REUSED_READS[cpu].fetch_add(1, Ordering::SeqCst);
                    }
                    if phase == GONE || v != TAG_BLOCK | k {
                        STALE[cpu].fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            seq += 1;
            let phase = PHASE.load(Ordering::SeqCst);
            let landed = write_probe(va + 8 * (1 + cpu as u64), seq);
            match (phase, landed, read_only(k)) {
                (GONE | PROTECTED, true, _) | (SPLIT, true, true) => {
                    STALE[cpu].fetch_add(1, Ordering::SeqCst);
                }
                (GONE | PROTECTED, false, _) | (SPLIT, false, true) => {
                    FAULTS[cpu].fetch_add(1, Ordering::Relaxed);
                }
                (SPLIT, true, false) => {
                    LANDED[cpu].fetch_add(1, Ordering::Relaxed);
                }
                (SPLIT, false, false) => {
                    OTHER_WRONG[cpu].fetch_add(1, Ordering::SeqCst);
                }
                _ => {}
            }
        }
        PASSES[cpu].fetch_add(1, Ordering::SeqCst);
    }
}

/// One AP's look at the block after the entry changed with no flush;
/// with a non-zero [`crate::ARG`], after an `invlpg` of that address.
fn look(cpu: usize) {
    let count = |slot: usize| LOOKED[cpu][slot].fetch_add(1, Ordering::SeqCst);
    let invalidated = crate::ARG[cpu].load(Ordering::SeqCst);
    if invalidated != 0 {
        let Ok(asid) = Asid::new(ASID) else {
            fatal("the huge-page scenario's ASID is out of range");
        };
        arch().flush_local_page(asid, invalidated);
        for j in 0..USED {
            let k = used_piece(cpu, j);
            if probe(piece_va(k)) == Some(TAG_BLOCK | k) {
                count(4);
            }
        }
        return;
    }
    for j in 0..USED {
        let (used, unused) = (used_piece(cpu, j), UNUSED + j);
        for (k, base) in [(used, 0), (unused, 2)] {
            match probe(piece_va(k)) {
                Some(v) if v == TAG_BLOCK | k => count(base),
                Some(v) if v == TAG_OTHER | k => count(base + 1),
                _ => 0,
            };
        }
    }
}

/// Runs a command of this module on an AP (from its command loop).
pub fn ap_command(cpu: usize, cmd: u32) {
    match cmd {
        TOUCH => touch(cpu),
        LOOK => look(cpu),
        _ => {}
    }
    COMMAND[cpu].store(IDLE, Ordering::SeqCst);
}

/// The one reverse-map entry of the block: its first frame at [`VA`].
struct BlockRmap<'s, 'a> {
    space: &'s OffsetSpace<'a>,
    dirty: AtomicBool,
}

// SAFETY: the block is mapped at most once, at VA, in this space, and
// only while the scenario holds the mapper; `walk` reports exactly that.
unsafe impl<'a> Rmap for BlockRmap<'_, 'a> {
    type Space = OffsetSpace<'a>;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        if frame.addr() != BLOCK {
            return ControlFlow::Continue(());
        }
        visit(Mapping {
            space: self.space,
            va: VA,
            flags: MappingFlags::empty(),
        })
    }

    fn set_dirty(&self, frame: Frame) {
        if frame.addr() == BLOCK {
            self.dirty.store(true, Ordering::SeqCst);
        }
    }
}

fn zero_counters() {
    for c in 0..MAX_CPUS {
        for a in [
            &STALE[c],
            &REUSED_READS[c],
            &OTHER_WRONG[c],
            &FAULTS[c],
            &LANDED[c],
        ] {
            a.store(0, Ordering::SeqCst);
        }
    }
}

pub(crate) fn total(counter: &[AtomicU64; MAX_CPUS]) -> u64 {
    flow::sum(counter, aps())
}

/// The page-directory entry of [`VA`] (the mapper made the tables).
pub(crate) fn pde(root: u64) -> &'static AtomicU64 {
    let mut table = root;
    for level in [4, 3] {
        let e = paging::word(table + paging::index(VA, level) * 8).load(Ordering::SeqCst);
        if e & 1 == 0 {
            fatal("the huge page's tables are missing");
        }
        table = paging::entry_addr(e);
    }
    paging::word(table + paging::index(VA, 2) * 8)
}

pub(crate) fn map_block(mapper: &mut OffsetPageTable<'_>) -> bool {
    let page = Page::<Size2MiB>::containing_address(VirtAddr::new(VA));
    let Ok(frame) = PhysFrame::<Size2MiB>::from_start_address(PhysAddr::new(BLOCK)) else {
        return false;
    };
    let flags = PageTableFlags::PRESENT | PageTableFlags::WRITABLE;
    // SAFETY: the block is RAM nothing else maps in this space, mapped at
    // an address where this space has nothing; no CPU caches VA (never
    // mapped, or unmapped and flushed, or every TLB scrubbed).
    match unsafe { mapper.map_to(page, frame, flags, &mut PoolFrames) } {
        Ok(flush) => {
            flush.ignore();
            true
        }
        Err(_) => false,
    }
}

/// Starts the APs' loop over a freshly mapped block and lets it fill
/// their TLBs (and set the entry's dirty bit).
pub(crate) fn start_touching() {
    zero_counters();
    PHASE.store(MAPPED, Ordering::SeqCst);
    flow::start(aps(), TOUCH, 0);
    flow::wait_passes(aps(), 4);
}

/// The scenarios; `control` skips the flush under test in each.
pub fn run(kernel_entry: u64, control: bool) -> [bool; 4] {
    let Some(root) = paging::alloc() else {
        fatal("the frame pool is exhausted");
    };
    paging::word(root).store(kernel_entry, Ordering::SeqCst);
    let Ok(asid) = Asid::new(ASID) else {
        fatal("the huge-page scenario's ASID is out of range");
    };
    let mm = MM.put(MmTlbState::new(asid, root));
    let results = {
        // SAFETY: as in `mapper::scenario_mapper`: a pool frame used as
        // this table only, identity-mapped (offset 0), freed below, once
        // this block (and the mapper with it) has ended.
        let mut mapper = unsafe { OffsetPageTable::new(&mut *(root as *mut X86Table), VirtAddr::new(0)) };
        fill(BLOCK, TAG_BLOCK);
        fill(OTHER, TAG_OTHER);
        if !map_block(&mut mapper) {
            fatal("map_to refused the 2 MiB page");
        }
        flow::load_mm(Some(mm), aps());
        measure_kept(root);
        let unmapped = unmap(&mut mapper, mm, control);
        let split = split(&mut mapper, mm, root, control);
        let [protected, torn_down] = crate::huge_range::run(&mut mapper, mm, root, control);
        [unmapped, split, protected, torn_down]
    };
    shared::REMOTE.store(shared::FOLLOW, Ordering::SeqCst);
    // Unlink and free the tables, with no CPU in the space any more.
    flow::load_mm(None, aps());
    flow::scrub();
    // The teardown freed the page directory and the PDPT; what a failed
    // one left linked goes here.
    if paging::word(root + paging::index(VA, 4) * 8).load(Ordering::SeqCst) & 1 != 0 {
        unlink_leaf(root);
        let pdpt = paging::entry_addr(paging::word(root + paging::index(VA, 4) * 8).load(Ordering::SeqCst));
        let pd = paging::entry_addr(paging::word(pdpt + paging::index(VA, 3) * 8).load(Ordering::SeqCst));
        paging::free(pd);
        paging::free(pdpt);
    }
    paging::free(root);
    results
}

/// Clears the page-directory entry of [`VA`] and frees the leaf table it
/// pointed to (the split's), if any; every TLB scrubbed in between.
pub(crate) fn unlink_leaf(root: u64) {
    let leaf = pde(root).swap(0, Ordering::SeqCst);
    flow::scrub();
    if leaf & 1 != 0 && leaf & 0x80 == 0 {
        paging::free(paging::entry_addr(leaf));
    }
}

/// Step 1: does the emulated TLB keep a translation of a 2 MiB page across a change
/// of its entry that nothing invalidated? Prints what it saw.
fn measure_kept(root: u64) {
    start_touching();
    flow::stop(aps());
    let entry = pde(root);
    let old = entry.load(Ordering::SeqCst);
    entry.store((old & !0x000f_ffff_ffe0_0000) | OTHER, Ordering::SeqCst);
    for slot in LOOKED.iter().flatten() {
        slot.store(0, Ordering::SeqCst);
    }
    crate::command(aps(), LOOK, 0);
    // What one 4 KiB invalidation of a page outside the huge page (the
    // next 2 MiB, unmapped) drops: the shape of a flush at the wrong page.
    crate::command(aps(), LOOK, VA + PIECES * 4096);
    entry.store(old, Ordering::SeqCst);
    flow::scrub();
    let sum = |slot: usize| aps().map(|c| LOOKED[c][slot].load(Ordering::SeqCst)).sum::<u64>();
    let n = (ONLINE.load(Ordering::SeqCst) as u64 - 1) * USED;
    let kept = sum(0) > 0;
    say(format_args!(
        "huge: the emulated TLB keeps a 2 MiB translation across a change of its entry with no flush: {} (the APs read the \
         old block through {} of {n} pieces they had used, the new one through {}; through pieces they had not \
         used: old {}, new {} of {n})\n",
        if kept { "yes" } else { "no" },
        sum(0),
        sum(1),
        sum(2),
        sum(3)
    ));
    say(format_args!(
        "huge: then after one invlpg of a 4 KiB page outside the 2 MiB page (the next 2 MiB, unmapped) the APs \
         still read the old block through {} of {n} pieces they had used\n",
        sum(4)
    ));
}

/// Step 2: the unmap, the flush, the reuse.
fn unmap(mapper: &mut OffsetPageTable<'_>, mm: &'static MmTlbState, control: bool) -> bool {
    let real = arch();
    start_touching();
    let (stats, irqs) = (TLB.stats(), ipis_taken());
    let space = OffsetSpace::new(mapper, mm);
    let rmap = BlockRmap {
        space: &space,
        dirty: AtomicBool::new(false),
    };
    let mut batch = TlbFlushUnmapBatch::new();
    let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
    let result = try_to_unmap(&real, &rmap, Frame(BLOCK >> 12), flags, &mut batch);
    let pending = batch.pending_pages();
    let whole = !batch.is_full_flush();
    // The APs still read through their TLBs: allowed until the flush.
    flow::wait_passes(aps(), 1);
    let flushed = if control {
        shared::REMOTE.store(shared::SKIP, Ordering::SeqCst);
        let r = batch.flush(&NoInvalidate(arch()));
        shared::REMOTE.store(shared::FLUSH, Ordering::SeqCst);
        r
    } else {
        batch.flush(&real)
    };
    let d = TLB.stats().since(&stats);
    let taken = ipis_taken() - irqs;
    // Only now may the block be reused.
    PHASE.store(GONE, Ordering::SeqCst);
    fill(BLOCK, TAG_REUSED);
    flow::wait_passes(aps(), 4);
    flow::stop(aps());
    let (stale, reused, faults) = (total(&STALE), total(&REUSED_READS), total(&FAULTS));
    flow::scrub();
    let cpus = ONLINE.load(Ordering::SeqCst);
    let aps_n = cpus - 1;
    let remote = flushed.map_or(0, |r| r.remote_cpus);
    let dirty = rmap.dirty.load(Ordering::SeqCst);
    let ok = result == Ok(SwapResult::SuccessCached)
        && dirty
        && pending == 1
        && whole
        && d.shootdowns == 1
        && remote == aps_n
        && d.local_page_flushes == cpus as u64
        && d.local_full_flushes == 0
        && faults > 0
        && stale == 0;
    report(
        "huge page unmap",
        ok,
        format_args!(
            "2 MiB page mapped with map_to, read and written by {aps_n} APs; try_to_unmap: {}, dirty moved to the \
             frame: {dirty}; {pending} invalidation pending (full flush: {}), {} flush, {remote} remote CPUs, {} IPIs \
             sent and {taken} taken, {} invalidations on {cpus} CPUs{}; block reused after the flush, then {faults} \
             AP accesses faulted; stale: {stale} accesses went through after the flush ({reused} reads of the reused \
             block)",
            match result {
                Ok(SwapResult::SuccessCached) => "SuccessCached",
                Ok(_) => "another result",
                Err(_) => "error",
            },
            !whole,
            d.shootdowns,
            d.ipis_sent,
            d.local_page_flushes,
            if control { " (flush skipped: the control)" } else { "" }
        ),
    )
}

/// Step 3: map again, then break, flush, make 512 small entries.
fn split(mapper: &mut OffsetPageTable<'_>, mm: &'static MmTlbState, root: u64, control: bool) -> bool {
    let real = arch();
    // Mapping VA again is a change of a mapping the unmap's batch deferred
    // a flush of: contract rule 5 first (a whole-ASID flush, since the
    // space's pending marker stays until this covers it).
    let covered = flush_tlb_batched_pending(&real, mm) == Ok(true);
    fill(BLOCK, TAG_BLOCK);
    if !map_block(mapper) {
        fatal("map_to refused the 2 MiB page again");
    }
    start_touching();
    let Some(leaf) = paging::alloc() else {
        fatal("the frame pool is exhausted");
    };
    let (stats, irqs) = (TLB.stats(), ipis_taken());
    let entry = pde(root);
    PHASE.store(BREAKING, Ordering::SeqCst);
    let made = if control {
        shared::REMOTE.store(shared::SKIP, Ordering::SeqCst);
        let skip = NoInvalidate(arch());
        let r = split_huge_mapping(&skip, mm, VA, PageSize::SIZE_2M, || {
            entry.swap(0, Ordering::SeqCst)
        })
        .map(|broken| broken.flush(&skip).map_err(|f| f.error));
        shared::REMOTE.store(shared::FLUSH, Ordering::SeqCst);
        r
    } else {
        split_huge_mapping(&real, mm, VA, PageSize::SIZE_2M, || {
            entry.swap(0, Ordering::SeqCst)
        })
        .map(|broken| broken.flush(&real).map_err(|f| f.error))
    };
    let d = TLB.stats().since(&stats);
    let taken = ipis_taken() - irqs;
    let (remote, old) = match made {
        Ok(Ok(flushed)) => {
            let remote = flushed.report().remote_cpus;
            let old = flushed.make(|old| {
                // The old entry's low flags (present ... dirty; not the
                // page-size bit 7, nor its PAT bit 12, clear here), over
                // each 4 KiB frame of the block.
                let flags = old & 0x7f;
                for k in 0..PIECES {
                    let mut e = (BLOCK + k * 4096) | flags;
                    if read_only(k) {
                        e &= !PageTableFlags::WRITABLE.bits();
                    }
                    paging::word(leaf + k * 8).store(e, Ordering::SeqCst);
                }
                entry.store(leaf | paging::PRESENT_WRITABLE, Ordering::SeqCst);
                old
            });
            (remote, old)
        }
        _ => fatal("split_huge_mapping or its flush failed"),
    };
    PHASE.store(SPLIT, Ordering::SeqCst);
    flow::wait_passes(aps(), 4);
    flow::stop(aps());
    let (stale, faults, landed, wrong) = (total(&STALE), total(&FAULTS), total(&LANDED), total(&OTHER_WRONG));
    let cpus = ONLINE.load(Ordering::SeqCst);
    let aps_n = cpus - 1;
    let was_huge = old & PageTableFlags::HUGE_PAGE.bits() != 0 && old & 0x000f_ffff_ffe0_0000 == BLOCK;
    let ok = covered
        && was_huge
        && d.shootdowns == 1
        && remote == aps_n
        && d.local_page_flushes == cpus as u64
        && d.local_full_flushes == 0
        && faults > 0
        && landed > 0
        && wrong == 0
        && stale == 0;
    report(
        "huge page split",
        ok,
        format_args!(
            "2 MiB page mapped again; break, flush ({} shootdown, {remote} remote CPUs, {} IPIs sent and {taken} \
             taken, {} invalidations on {cpus} CPUs{}), make: 512 entries over the same frames, pieces {FIRST_READ_ONLY} to {} \
             read-only; then {faults} AP writes to them faulted and {landed} to the others landed; stale: {stale} \
             writes landed on a read-only piece or reads returned another value, {wrong} other",
            d.shootdowns,
            d.ipis_sent,
            d.local_page_flushes,
            if control { " (flush skipped: the control)" } else { "" },
            FIRST_READ_ONLY + READ_ONLY_PIECES - 1
        ),
    )
}
