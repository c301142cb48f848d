//! mprotect (`change_protection`, read-only) of a range while a reclaim
//! batch for the same address space is still pending: after the call
//! returns, no AP store may land, neither in a page it write-protected nor
//! in one the reclaimer unmapped with its flush deferred (contract rule 5).

use core::sync::atomic::Ordering;

use tlb_batch::{
    change_protection, Frame, FreeFrames, OwnedFrame, PageRange, PageTable, Pte, PteFlags, TtuFlags,
    UnmapBatch, Unmapped,
};

use crate::flow::{self, LATE, PHASE};
use crate::paging::{self, SpaceRmap};
use crate::reclaim::{ipis_taken, FLOW};
use crate::teardown::release;
use crate::{aps, arch, report, TLB};

const BASE: u64 = 0x80_8000_0000;
const PAGES: usize = 32;
const UNMAPPED: usize = PAGES / 2;

/// Reclaim unmaps half the pages (flush deferred), then the whole range is
/// made read-only while every AP keeps storing into it.
pub fn scenario_mprotect() -> bool {
    let a = arch();
    let rmap = SpaceRmap { space: &FLOW };
    let mut frames = [0u64; PAGES];
    flow::reset(BASE, PAGES, 512);
    FLOW.map_new(BASE, PAGES, &mut frames);
    flow::load(Some(&FLOW), aps());
    flow::start(aps(), flow::WRITER, 0);
    flow::wait_passes(aps(), 3);
    let dirty = (0..PAGES)
        .filter(|&p| FLOW.lookup(flow::page_va(p)).is_dirty())
        .count();

    let mut batch: UnmapBatch<UNMAPPED> = UnmapBatch::new();
    let mut held = 0;
    for &pa in &frames[..UNMAPPED] {
        // SAFETY: a pool frame mapped once: this handle is its only claim
        // (its PTE is cleared by the unmap; nothing else frees it).
        let frame = unsafe { OwnedFrame::new(Frame(pa >> 12)) };
        if let Ok(Unmapped::Held(_)) = batch.try_to_unmap(&a, &rmap, frame, TtuFlags::IGNORE_ACCESS) {
            held += 1;
        }
    }
    let pending = FLOW.tlb_state().batched_flush_pending();

    let (stats, irqs) = (TLB.stats(), ipis_taken());
    let Ok(range) = PageRange::from_bounds(BASE, BASE + PAGES as u64 * 4096) else {
        crate::fatal("bad mprotect range");
    };
    let changed = change_protection(&a, &FLOW, range, |pte| Pte(pte.0 & !PteFlags::WRITABLE.bits()));
    // From here on, any store that completes is a failure.
    PHASE.store(1, Ordering::SeqCst);
    let still_pending = FLOW.tlb_state().batched_flush_pending();
    let d = TLB.stats().since(&stats);
    let taken = ipis_taken() - irqs;
    flow::wait_passes(aps(), 3);
    flow::stop(aps());
    let late = flow::sum(&LATE, aps());
    let faults = flow::sum(&flow::FAULTS, aps());
    let read_only = (UNMAPPED..PAGES)
        .filter(|&p| {
            let pte = FLOW.lookup(flow::page_va(p));
            pte.is_present() && !pte.is_writable()
        })
        .count();

    // The reclaimer's batch: flushed, then its frames freed.
    let mut pool = paging::Pool::default();
    let freed = match batch.flush(&a) {
        Ok(mut flushed) => {
            pool.free_batch(flushed.frames_mut());
            pool.freed
        }
        Err(_) => 0,
    };
    let after_free = flow::broken(&pool.log);
    let bad_reads = flow::sum(&flow::BAD_READS, aps());
    flow::load(None, aps());
    flow::scrub();
    release(&FLOW, BASE, 1 << 30);
    let ok = dirty == PAGES
        && held == UNMAPPED
        && pending
        && !still_pending
        && changed == Ok(PAGES - UNMAPPED)
        && read_only == PAGES - UNMAPPED
        && freed == UNMAPPED
        && late == 0
        && after_free == 0
        && bad_reads == 0;
    report(
        "mprotect with a reclaim batch pending",
        ok,
        format_args!(
            "{PAGES} pages, {dirty} PTEs dirtied by the MMU, {held} unmapped by reclaim (flush pending: {pending}), {} made read-only, {} flushes, \
             {} IPIs sent and {taken} taken, {faults} AP writes faulted; stale: {late} AP writes landed after \
             change_protection returned, {after_free} freed frames written, {bad_reads} reads returned another value",
            changed.unwrap_or(0),
            d.shootdowns,
            d.ipis_sent
        ),
    )
}
