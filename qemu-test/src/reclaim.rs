//! The reclaim and migration flows over the test kernel's own page tables
//! ([`crate::paging`]), with writer APs storing into the pages the whole
//! time (see [`crate::flow`]).

use core::sync::atomic::Ordering;

use tlb_batch::heapless;
use tlb_batch::{
    migrate_pages, shrink_page_list, Frame, FreeFrames, MigrateBacking, MigrateOutcome, OwnedFrame, PageOut,
    PageTable, ReclaimBacking, UnmapBatch, Verdict, WritebackFrame,
};

use crate::flow::{self, LAST, MAX_PAGES};
use crate::paging::{self, Space, SpaceRmap};
use crate::teardown::release;
use crate::{aps, arch, report, IPIS_TAKEN, MAX_CPUS, TLB};

/// The address space of the reclaim, migration and mprotect flows: ASID 2,
/// loaded on every CPU while a flow runs.
pub static FLOW: Space = Space::new(2, 0);

const PAGES: usize = 48;
const RECLAIM_BASE: u64 = 0x80_0000_0000;
const MIGRATE_BASE: u64 = 0x80_4000_0000;
const AGING_ROUNDS: usize = 12;

/// The page number of a frame among `frames`.
fn page_of(frames: &[u64], pa: u64) -> Option<usize> {
    frames.iter().position(|&f| f == pa)
}

/// A checksum of a whole frame (position-dependent).
fn checksum(pa: u64) -> u64 {
    (0..512u64).fold(0u64, |acc, w| {
        acc.rotate_left(7) ^ paging::word(pa + w * 8).load(Ordering::SeqCst)
    })
}

/// How many dirty bits the MMU set in the PTEs of `frames`' pages.
fn dirty_ptes(space: &Space, n: usize) -> usize {
    (0..n)
        .filter(|&p| space.lookup(flow::page_va(p)).is_dirty())
        .count()
}

/// Reclaim's backing: page-out copies each written page's words to a
/// "swap" record with the page's checksum; the free checks that nothing
/// wrote the frame after its write-out, then poisons it.
struct Swap<'a> {
    frames: &'a [u64],
    /// Per page: the checksum at write-out (None: not written out).
    sums: [Option<u64>; PAGES],
    /// Per page, per CPU: the CPU's word as written out.
    words: [[u64; MAX_CPUS]; PAGES],
    /// Frames whose contents changed between write-out and free.
    changed_after_writeout: usize,
    pool: paging::Pool,
    freed: heapless::Vec<u64, PAGES>,
}

impl FreeFrames for Swap<'_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        for f in frames.iter() {
            let pa = f.frame().addr();
            let written = page_of(self.frames, pa).and_then(|p| self.sums[p]);
            if written.is_some_and(|s| s != checksum(pa)) {
                self.changed_after_writeout += 1;
            }
            let _ = self.freed.push(pa);
        }
        self.pool.free_batch(frames);
    }
}

impl ReclaimBacking for Swap<'_> {
    fn is_dirty(&self, frame: Frame) -> bool {
        paging::is_dirty(frame.addr())
    }

    fn page_out(&mut self, frame: WritebackFrame<'_>) -> PageOut {
        let pa = frame.frame().addr();
        let Some(p) = page_of(self.frames, pa) else {
            return PageOut::Failed;
        };
        for c in 0..MAX_CPUS {
            self.words[p][c] = paging::word(pa + 8 * c as u64).load(Ordering::SeqCst);
        }
        self.sums[p] = Some(checksum(pa));
        paging::set_clean(pa);
        PageOut::Written
    }
}

/// Maps the flow's pages at `base`, loads the space on every AP and lets
/// the writers make three passes over them: returns the frames and how
/// many PTEs the MMU marked dirty.
fn map_and_write(base: u64) -> ([u64; PAGES], usize) {
    let mut frames = [0u64; PAGES];
    flow::reset(base, PAGES, 512);
    FLOW.map_new(base, PAGES, &mut frames);
    flow::load(Some(&FLOW), aps());
    flow::start(aps(), flow::WRITER, 0);
    flow::wait_passes(aps(), 3);
    (frames, dirty_ptes(&FLOW, PAGES))
}

/// Reclaim: age (clear-young, no flush on x86), unmap with the flush
/// batched, `flush_dirty` before the write-out, `flush` before the free,
/// all through `shrink_page_list`, while every AP writes the pages.
pub fn scenario_reclaim() -> bool {
    let a = arch();
    let rmap = SpaceRmap { space: &FLOW };
    let (frames, dirty) = map_and_write(RECLAIM_BASE);

    let (stats, irqs) = (TLB.stats(), ipis_taken());
    let mut swap = Swap {
        frames: &frames,
        sums: [None; PAGES],
        words: [[0; MAX_CPUS]; PAGES],
        changed_after_writeout: 0,
        pool: paging::Pool::default(),
        freed: heapless::Vec::new(),
    };
    let mut batch: UnmapBatch<PAGES> = UnmapBatch::new();
    let mut left: heapless::Vec<OwnedFrame, PAGES> = frames
        .iter()
        .map(|&pa| {
            // SAFETY: each frame was just allocated from the pool and
            // mapped once; these handles are the only claims on them.
            unsafe { OwnedFrame::new(Frame(pa >> 12)) }
        })
        .collect();
    let (mut rounds, mut first_round_ipis, mut referenced, mut shootdowns) = (0, 0, 0, 0);
    let mut errors = 0;
    while !left.is_empty() && rounds < AGING_ROUNDS {
        rounds += 1;
        let before = TLB.stats();
        let mut next: heapless::Vec<OwnedFrame, PAGES> = heapless::Vec::new();
        let result = shrink_page_list(&a, &rmap, &mut swap, &mut batch, left, &mut |f, v| {
            referenced += usize::from(v == Verdict::Referenced);
            let _ = next.push(f);
        });
        match result {
            Ok(s) => shootdowns += s.shootdowns,
            Err(_) => errors += 1,
        }
        if rounds == 1 {
            first_round_ipis = TLB.stats().since(&before).ipis_sent;
        }
        left = next;
        // Let the writers run between aging passes, as time passes
        // between a reclaimer's scans.
        flow::wait_passes(aps(), 1);
    }
    let d = TLB.stats().since(&stats);
    let taken = ipis_taken() - irqs;
    // The writers go on a while: a stale entry would now write a freed
    // frame.
    flow::wait_passes(aps(), 3);
    flow::stop(aps());
    let faults = flow::sum(&flow::FAULTS, aps());

    let mut lost = 0;
    for (p, words) in swap.words.iter().enumerate() {
        if swap.sums[p].is_none() {
            continue;
        }
        lost += aps()
            .filter(|&c| LAST[c][p].load(Ordering::SeqCst) != words[c])
            .count();
    }
    let after_free = flow::broken(&swap.freed);
    let reclaimed = swap.freed.len();
    let bad_reads = flow::sum(&flow::BAD_READS, aps());
    let stale = lost + swap.changed_after_writeout + after_free + bad_reads as usize;
    flow::load(None, aps());
    flow::scrub();
    // Frames never reclaimed are still mapped: their PTEs hold their
    // claims, which the cleanup teardown frees.
    for f in left {
        let _ = f.into_frame();
    }
    release(&FLOW, RECLAIM_BASE, 1 << 30);
    let ok = dirty == PAGES
        && reclaimed == PAGES
        && errors == 0
        && first_round_ipis == 0
        && faults > 0
        && stale == 0;
    report(
        "reclaim flow",
        ok,
        format_args!(
            "{reclaimed}/{PAGES} pages reclaimed in {rounds} aging rounds ({referenced} found young, first aging sent \
             {first_round_ipis} IPIs), {dirty} PTEs dirtied by the MMU, {shootdowns} flushes, {} IPIs sent and \
             {taken} taken, {faults} AP writes faulted; stale: {lost} lost writes, {} frames written after \
             write-out, {after_free} freed frames written, {bad_reads} reads returned another value",
            d.ipis_sent, swap.changed_after_writeout
        ),
    )
}

/// Migration's backing: targets from the pool; the copy's words are kept
/// per page; freeing an old frame first checks that it still equals its
/// copy (no write landed in it after the copy).
struct Mover<'a> {
    frames: &'a [u64],
    new: [u64; PAGES],
    copied: [[u64; MAX_CPUS]; PAGES],
    written_after_copy: usize,
    pool: paging::Pool,
    freed: heapless::Vec<u64, PAGES>,
}

impl FreeFrames for Mover<'_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        for f in frames.iter() {
            let pa = f.frame().addr();
            if let Some(p) = page_of(self.frames, pa) {
                let changed = (0..MAX_CPUS)
                    .any(|c| paging::word(pa + 8 * c as u64).load(Ordering::SeqCst) != self.copied[p][c]);
                self.written_after_copy += usize::from(changed);
            }
            let _ = self.freed.push(pa);
        }
        self.pool.free_batch(frames);
    }
}

impl MigrateBacking for Mover<'_> {
    fn alloc_target(&mut self, _old: Frame) -> Option<OwnedFrame> {
        // SAFETY: a frame fresh from the pool: this handle is its only
        // claim.
        paging::alloc().map(|pa| unsafe { OwnedFrame::new(Frame(pa >> 12)) })
    }

    fn copy_frame(&mut self, from: WritebackFrame<'_>, to: &OwnedFrame) {
        let (src, dst) = (from.frame().addr(), to.frame().addr());
        for w in 0..512u64 {
            let v = paging::word(src + w * 8).load(Ordering::SeqCst);
            paging::word(dst + w * 8).store(v, Ordering::SeqCst);
        }
        if let Some(p) = page_of(self.frames, src) {
            for c in 0..MAX_CPUS {
                self.copied[p][c] = paging::word(dst + 8 * c as u64).load(Ordering::SeqCst);
            }
            self.new[p] = dst;
        }
        if paging::is_dirty(src) {
            paging::set_dirty(dst);
        }
    }

    fn move_mappings(&mut self, old: Frame, new: Frame) {
        if let Some(p) = page_of(self.frames, old.addr()) {
            paging::set_mapped_at(new.addr(), flow::page_va(p));
        }
        paging::set_mapped_at(old.addr(), 0);
    }
}

/// Migration of every written page while the APs keep writing: the copy
/// holds every store that completed before the unmap, and nothing lands in
/// the old frame after it.
pub fn scenario_migrate() -> bool {
    let a = arch();
    let rmap = SpaceRmap { space: &FLOW };
    let (frames, dirty) = map_and_write(MIGRATE_BASE);

    let (stats, irqs) = (TLB.stats(), ipis_taken());
    let mut mover = Mover {
        frames: &frames,
        new: [0; PAGES],
        copied: [[0; MAX_CPUS]; PAGES],
        written_after_copy: 0,
        pool: paging::Pool::default(),
        freed: heapless::Vec::new(),
    };
    let mut batch: UnmapBatch<PAGES> = UnmapBatch::new();
    let pages = frames.iter().map(|&pa| {
        // SAFETY: each frame was just allocated from the pool and
        // mapped once; these handles are the only claims on them.
        unsafe { OwnedFrame::new(Frame(pa >> 12)) }
    });
    let mut failed = 0;
    let result = migrate_pages(&a, &rmap, &mut mover, &mut batch, pages, &mut |o| {
        if !matches!(o, MigrateOutcome::Migrated { .. }) {
            failed += 1;
        }
    });
    let summary = result.unwrap_or_default();
    let d = TLB.stats().since(&stats);
    let taken = ipis_taken() - irqs;
    flow::wait_passes(aps(), 3);
    flow::stop(aps());
    let faults = flow::sum(&flow::FAULTS, aps());

    // Every store that completed is in the new frame: it went to the old
    // frame before the copy (and the copy took it) or to the new one.
    let mut lost = 0;
    let mut moved_ptes = 0;
    for (p, &new) in mover.new.iter().enumerate() {
        if new == 0 {
            continue;
        }
        let pte = FLOW.lookup(flow::page_va(p));
        moved_ptes += usize::from(pte.is_present() && pte.is_writable() && pte.frame().addr() == new);
        for c in aps() {
            let last = LAST[c][p].load(Ordering::SeqCst);
            let now = paging::word(new + 8 * c as u64).load(Ordering::SeqCst);
            if now != last || mover.copied[p][c] > last {
                lost += 1;
            }
        }
    }
    let after_free = flow::broken(&mover.freed);
    let bad_reads = flow::sum(&flow::BAD_READS, aps());
    let stale = lost + mover.written_after_copy + after_free + bad_reads as usize;
    flow::load(None, aps());
    flow::scrub();
    release(&FLOW, MIGRATE_BASE, 1 << 30);
    let ok = dirty == PAGES
        && summary.migrated == PAGES
        && failed == 0
        && moved_ptes == PAGES
        && mover.freed.len() == PAGES
        && stale == 0;
    report(
        "migration flow",
        ok,
        format_args!(
            "{}/{PAGES} pages migrated in {} passes, {dirty} PTEs dirtied by the MMU, {moved_ptes} PTEs moved, {} \
             flushes, {} IPIs sent and {taken} taken, {faults} AP writes faulted; stale: {lost} lost writes, {} old \
             frames written after the copy, {after_free} freed frames written, {bad_reads} reads returned another \
             value",
            summary.migrated, summary.passes, summary.shootdowns, d.ipis_sent, mover.written_after_copy
        ),
    )
}

/// Flush IPIs the APs took so far.
pub fn ipis_taken() -> u64 {
    aps().map(|c| IPIS_TAKEN[c].load(Ordering::SeqCst)).sum()
}

const _: () = assert!(PAGES <= MAX_PAGES);
