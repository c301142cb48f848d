//! The storm: every CPU shoots at every other one at the same time, with
//! interrupts off, so requests pile up in inboxes, interrupts coalesce,
//! request slots are reused round after round, and every initiator must
//! serve its own inbox while it waits for its acknowledgements.
//!
//! The pages the storm's requests flush (the first 8 test pages at 4 GiB)
//! are unmapped before it, without a flush, after every CPU read them: the
//! storm's requests are their only flush, so each CPU must have served
//! requests for all 8 by the end, and a read of any of them afterwards is a
//! stale read.

use core::sync::atomic::Ordering;

use crate::flow::{self, STORM_GO, STORM_READY};
use crate::{aps, report, IPIS_TAKEN, ONLINE, RESULT, TLB};

/// Pages the storm flushes.
pub const STORM_PAGES: usize = 8;

/// Shootdowns per CPU: a few hundred in all whatever the CPU count (the
/// work per shootdown grows with it), and at least one per page, so that
/// each CPU's requests cover every page.
pub fn rounds_per_cpu(cpus: usize) -> u64 {
    (512 / cpus.max(1)).max(STORM_PAGES) as u64
}

/// CPUs (the boot CPU included) that can read `n` of the storm's pages.
pub fn readers() -> u64 {
    crate::command(aps(), crate::PROBE, STORM_PAGES as u64);
    let own = (0..STORM_PAGES)
        .filter(|&i| crate::probe(crate::test_va(i)) == Some(crate::pattern(i)))
        .count();
    aps().map(|c| RESULT[c].load(Ordering::SeqCst)).sum::<u64>() + own as u64
}

/// Runs the storm on every online CPU.
pub fn scenario_storm() -> bool {
    let n = ONLINE.load(Ordering::SeqCst);
    let rounds = rounds_per_cpu(n);
    crate::map_all();
    let cached = readers();
    for i in 0..STORM_PAGES {
        crate::TEST_PT.0[i].store(0, Ordering::SeqCst);
    }
    STORM_READY.store(0, Ordering::SeqCst);
    STORM_GO.store(0, Ordering::SeqCst);
    let (stats, taken_before) = (TLB.stats(), taken());
    flow::start(aps(), flow::STORM, rounds);
    while STORM_READY.load(Ordering::SeqCst) < n - 1 {
        core::hint::spin_loop();
    }
    let t0 = crate::hw::rdtsc();
    STORM_GO.store(1, Ordering::SeqCst);
    let mine = flow::storm_rounds(rounds);
    for c in aps() {
        while crate::COMMAND[c].load(Ordering::SeqCst) != crate::IDLE {
            core::hint::spin_loop();
        }
    }
    let ticks = crate::hw::rdtsc() - t0;
    let theirs: u64 = aps().map(|c| RESULT[c].load(Ordering::SeqCst)).sum();
    let d = TLB.stats().since(&stats);
    let taken = taken() - taken_before;
    let total = rounds * n as u64;
    let requests = total * (n as u64 - 1);
    let done = mine + theirs;
    let stale = readers();
    let expected = (n * STORM_PAGES) as u64;
    report(
        "storm",
        done == total && d.shootdowns >= total && cached == expected && stale == 0,
        format_args!(
            "{n} CPUs x {rounds} shootdowns at all others, {done}/{total} completed, {requests} flush requests, {} \
             served, {} IPIs sent and {taken} taken, {ticks} TSC ticks; {cached}/{expected} page reads cached \
             before; stale: {stale} reads after",
            d.flushes_received, d.ipis_sent
        ),
    )
}

fn taken() -> u64 {
    (0..ONLINE.load(Ordering::SeqCst))
        .map(|c| IPIS_TAKEN[c].load(Ordering::SeqCst))
        .sum()
}
