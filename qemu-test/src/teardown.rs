//! munmap-style teardown with batched page-table freeing (`MmuGather`)
//! while an AP walks the page tables locklessly with interrupts off (the
//! GUP-fast pattern).
//!
//! The walker runs on AP 1, which never loads the torn-down address space:
//! like a CPU that a flush does not interrupt (one outside the space's CPU
//! set, or one whose flush the hardware or hypervisor does without an
//! IPI), the teardown's TLB shootdown does not wait for it. Only
//! `TableFreePolicy::IpiSync` does: its IPI is taken once the walker turns
//! interrupts back on, so no walk that could still hold a pointer to a
//! detached table is running when the tables are freed. Under
//! `TableFreePolicy::AfterFlush` (the negative control) the tables are
//! freed, and poisoned, while the walker is still inside them, and it sees
//! that (the poison pattern, or the frame's free count changing under it).

use core::sync::atomic::Ordering;

use tlb_batch::{FrameKind, MmuGather, PageRange, PageTable, TableFreePolicy, TeardownSummary};

use crate::flow::{self, WALK_CAUGHT, WALK_LEAVES, WALK_LEVEL, WALK_ROOT};
use crate::paging::{self, Space};
use crate::reclaim::ipis_taken;
use crate::{arch, report, TLB};

/// The torn-down address space: ASID 3, loaded by the boot CPU only (it
/// writes the pages; the teardown's flush is then local, so nothing but the
/// table-free policy can hold the free back for the walker).
pub static TEARDOWN: Space = Space::new(3, 1);

const BASE: u64 = 0x100_0000_0000;
const SPAN: u64 = 1 << 30;
const PER_TABLE: usize = 16;
const TABLES: usize = 4;
const PAGES: usize = PER_TABLE * TABLES;
const ROUNDS: usize = 16;

/// Tears down `[base, base + span)` of `space` with one gather (tables
/// freed at once: no walker runs there) and checks nothing was handed back.
/// Cleans up after a scenario, with every CPU's TLB scrubbed first.
pub fn release(space: &Space, base: u64, span: u64) {
    let Ok(range) = PageRange::from_bounds(base, base + span) else {
        crate::fatal("bad cleanup range");
    };
    let mut gather: MmuGather<64> = MmuGather::new();
    let mut pool = paging::Pool::default();
    let mut kept = 0;
    let r = gather.unmap_range(
        &arch(),
        space,
        &mut pool,
        range,
        true,
        &mut TableFreePolicy::AfterFlush,
        &mut |_, _| kept += 1,
    );
    if r.is_err() || kept != 0 {
        crate::fatal("cleanup teardown failed");
    }
}

/// Repeated teardowns of a 1 GiB range (4 leaf tables and their page
/// directory) with `IpiSync` (or `AfterFlush`, the negative control), with
/// a lockless walker running on AP 1.
pub fn scenario_teardown(after_flush: bool) -> bool {
    let a = arch();
    let walker = 1..2;
    flow::reset(BASE, PAGES, PER_TABLE);
    WALK_ROOT.store(TEARDOWN.root(), Ordering::SeqCst);
    WALK_CAUGHT.store(0, Ordering::SeqCst);
    WALK_LEAVES.store(0, Ordering::SeqCst);
    let Ok(range) = PageRange::from_bounds(BASE, BASE + SPAN) else {
        crate::fatal("bad teardown range");
    };
    flow::load(Some(&TEARDOWN), core::iter::empty());
    flow::start(walker.clone(), flow::WALKER, 0);

    let (stats, irqs) = (TLB.stats(), ipis_taken());
    let walks_before = flow::PASSES[1].load(Ordering::SeqCst);
    let mut total = TeardownSummary::default();
    let mut pool = paging::Pool::default();
    let (mut dirty, mut handed_back, mut errors) = (0, 0, 0);
    for _ in 0..ROUNDS {
        for p in 0..PAGES {
            let Some(pa) = paging::alloc() else {
                crate::fatal("the frame pool is exhausted");
            };
            TEARDOWN.map(flow::page_va(p), pa);
        }
        // The boot CPU writes every page (the MMU sets the dirty bits), the
        // walker goes over the new tables.
        for p in 0..PAGES {
            if !flow::write_probe(flow::page_va(p), 1) {
                crate::fatal("a freshly mapped page faulted");
            }
        }
        dirty += (0..PAGES)
            .filter(|&p| TEARDOWN.lookup(flow::page_va(p)).is_dirty())
            .count();
        flow::wait_passes(walker.clone(), 1);
        // Start while the walker holds a directory or table of this round
        // (it read them from linked entries): the teardown unlinks and
        // frees them under the walk.
        let mut spins = 0u64;
        while !matches!(WALK_LEVEL.load(Ordering::SeqCst), 1 | 2) {
            spins += 1;
            if spins > 4_000_000_000 {
                crate::fatal("the walker never reached a page directory");
            }
            core::hint::spin_loop();
        }
        let mut policy = if after_flush {
            TableFreePolicy::AfterFlush
        } else {
            TableFreePolicy::IpiSync
        };
        let mut gather: MmuGather<PAGES> = MmuGather::new();
        match gather.unmap_range(
            &a,
            &TEARDOWN,
            &mut pool,
            range,
            true,
            &mut policy,
            &mut |_, kind| {
                handed_back += 1;
                if kind == FrameKind::Table {
                    handed_back += 1000;
                }
            },
        ) {
            Ok(s) => total += s,
            Err(_) => errors += 1,
        }
    }
    flow::wait_passes(walker.clone(), 2);
    flow::stop(walker.clone());
    let d = TLB.stats().since(&stats);
    let taken = ipis_taken() - irqs;
    let caught = WALK_CAUGHT.load(Ordering::SeqCst);
    let leaves = WALK_LEAVES.load(Ordering::SeqCst);
    let walks = flow::PASSES[1].load(Ordering::SeqCst) - walks_before;
    let after_free = flow::broken(&pool.log);
    flow::load(None, core::iter::empty());
    flow::scrub();
    let ok = errors == 0
        && handed_back == 0
        && dirty == PAGES * ROUNDS
        && total.pages_unmapped == PAGES * ROUNDS
        && total.tables_freed == (TABLES + 1) * ROUNDS
        && total.syncs == if after_flush { 0 } else { ROUNDS }
        && leaves > 0
        && caught == 0
        && after_free == 0;
    report(
        if after_flush {
            "teardown flow (AfterFlush)"
        } else {
            "teardown flow (IpiSync)"
        },
        ok,
        format_args!(
            "{ROUNDS} teardowns, {} pages and {} tables freed, {dirty} PTEs dirtied by the MMU, {} flushes and {} \
             syncs, {} IPIs sent and {taken} taken, walker: {walks} walks, {leaves} reached a leaf table; stale: walker \
             read {caught} freed tables, {after_free} freed frames written",
            total.data_freed, total.tables_freed, total.flushes, total.syncs, d.ipis_sent
        ),
    )
}
