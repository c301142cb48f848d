//! The matrix's second table: page migration (`migrate_pages`) and range
//! teardown (`MmuGather`) in every cell, against Linux 6.1's policy for
//! the same operation (`calibrated/ops.rs`), with their JSON.

use std::fmt::Write as _;

use crate::calibrated::ops::{
    OpFigures, BUFFER_EVERY, BUFFER_LIFE, BUFFER_SIZES, COMPACT_MAX, COMPACT_PERIOD,
};
use crate::calibrated::Figures;
use crate::report::{CellRuns, GOAL_DRIVERS_IPIS, TIMERS};

/// Where a run's figures keep an operation's.
type OfRun = fn(&Figures) -> OpFigures;

/// The operations, by name, and where a run's figures keep them.
const OPS: [(&str, OfRun); 2] = [("migrate_pages", |f| f.migrate), ("MmuGather", |f| f.munmap)];

/// IPIs per page of `d` against `l`: 0 when `d` sent none, infinite when
/// only `d` sent some (with processes a teardown rarely reaches another
/// CPU: a few IPIs in a run, which the two runs' different timing decides;
/// the table shows the counts beside the ratio).
fn ipis_x(d: &OpFigures, l: &OpFigures) -> f64 {
    let (dp, lp) = (d.per_page(d.ipis), l.per_page(l.ipis));
    if dp == 0.0 {
        0.0
    } else if lp == 0.0 {
        f64::INFINITY
    } else {
        dp / lp
    }
}

/// Each operation's name and the drivers' IPIs per page in `r` against
/// Linux 6.1's.
pub fn op_ratios(r: &CellRuns) -> Vec<(&'static str, f64)> {
    OPS.iter()
        .map(|&(name, of)| (name, ipis_x(&of(&r.drivers), &of(&r.linux))))
        .collect()
}

pub fn ops_text(runs: &[CellRuns]) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "\nmigrate_pages and MmuGather in the same runs (calibrated/ops.rs): every {COMPACT_PERIOD} ticks a running \
         task compacts, migrating up to {COMPACT_MAX} mapped pages of a random block of frames; every \
         {BUFFER_EVERY} page reads a task maps a buffer of {BUFFER_SIZES:?} pages in turn, writes it for \
         {BUFFER_LIFE} reads and unmaps it (every other one alone on its page table, which goes with it). \
         Linux 6.1: page-by-page migration, each PTE flushed as it is cleared (ptep_clear_flush); munmap's one \
         flush at tlb_finish_mmu (lazy CPUs too when a table was freed). drivers: tlb-batch's migrate_pages and \
         MmuGather, whose freed tables wait in a TableHold for the CPUs that were lazy at the flush (released \
         once each caught up, loaded another root or went offline; the hold is flushed when page-table frames \
         run out and at the end of the run, counted here) instead of interrupting them. IPIs per page (migrated, or unmapped) and the drivers' ratio; goal <= {GOAL_DRIVERS_IPIS}x. \
         Only the pool acts at timer ticks, so one row per cell serves its three timers.\n"
    );
    let _ = writeln!(
        text,
        "{:<42} | {:>6} {:>6} {:>6} {:>8} {:>8} {:>7} | {:>6} {:>6} {:>6} {:>8} {:>8} {:>7} | {:>5} {:>5} | {:>4}  met",
        "cell",
        "pages",
        "Linux",
        "drv.",
        "Linux",
        "drivers",
        "x",
        "pages",
        "Linux",
        "drv.",
        "Linux",
        "drivers",
        "x",
        "Linux",
        "drv.",
        "viol"
    );
    let _ = writeln!(
        text,
        "{:<42} | {:>6} {:>6} {:>6} {:>8} {:>8} {:>7} | {:>6} {:>6} {:>6} {:>8} {:>8} {:>7} | {:>5} {:>5} |",
        "",
        "migr.",
        "IPIs",
        "IPIs",
        "IPIs/pg",
        "IPIs/pg",
        "IPIs",
        "unmap.",
        "IPIs",
        "IPIs",
        "IPIs/pg",
        "IPIs/pg",
        "IPIs",
        "pend.",
        "pend."
    );
    for r in runs.iter().filter(|r| r.cell.timer == TIMERS[0]) {
        let (l, d) = (&r.linux, &r.drivers);
        let viol = l.violations + d.violations;
        let mut row = format!("{:<42}", r.cell.name());
        let mut met = viol == 0;
        for &(_, of) in &OPS {
            let (lo, dr) = (of(l), of(d));
            let x = ipis_x(&dr, &lo);
            met &= x <= GOAL_DRIVERS_IPIS;
            let _ = write!(
                row,
                " | {:>6} {:>6} {:>6} {:>8.4} {:>8.4} {:>7.3}",
                dr.pages,
                lo.ipis,
                dr.ipis,
                lo.per_page(lo.ipis),
                dr.per_page(dr.ipis),
                x
            );
        }
        let _ = writeln!(
            text,
            "{row} | {:>5} {:>5} | {viol:>4}  {}",
            l.munmap.pending,
            d.munmap.pending,
            if met { "yes" } else { "NO" }
        );
    }
    let (mut lp, mut lc, mut dp, mut dc) = (0, 0, 0, 0);
    for r in runs.iter().filter(|r| r.cell.timer == TIMERS[0]) {
        lp += r.linux.munmap.pending;
        lc += r.linux.munmap.calls;
        dp += r.drivers.munmap.pending;
        dc += r.drivers.munmap.calls;
    }
    let _ = writeln!(
        text,
        "pages: the drivers' run's (Linux's migrates and unmaps about as many); IPIs: each run's; x: the drivers' IPIs \
         per page against Linux's (inf: Linux's run sent none); pend.: teardowns that found a deferred flush \
         outstanding (below); viol: both runs, whole run. MmuGather's teardowns \
         that found a deferred flush of the space outstanding, and so flushed the whole space first (Linux's \
         flush_tlb_batched_pending rule; the crate's migrate_pages defers and leaves that mark, Linux 6.1's \
         migration does not): {} of {} with Linux 6.1, {} of {} with the drivers (every cell, every seed).",
        lp, lc, dp, dc
    );
    text
}

fn op_json(f: &OpFigures) -> String {
    format!(
        "{{\"calls\":{},\"pages\":{},\"ipis\":{},\"interrupts\":{},\"cycles\":{},\"pending_at_teardown\":{}}}",
        f.calls, f.pages, f.ipis, f.interrupts, f.cycles, f.pending
    )
}

/// The cell's operations as JSON members: `"migrate_pages":{...}` and
/// `"mmu_gather":{...}`, each with every peer's figures and the drivers'
/// ratio.
pub fn ops_json(r: &CellRuns) -> String {
    let ratios = op_ratios(r);
    OPS.iter()
        .zip(ratios)
        .map(|(&(name, of), (_, x))| {
            format!(
                "\"{}\":{{\"no_batching\":{},\"linux61\":{},\"drivers\":{},\"pool\":{},\"drivers_ipis_x\":{}}}",
                if name == "MmuGather" { "mmu_gather" } else { name },
                op_json(&of(&r.none)),
                op_json(&of(&r.linux)),
                op_json(&of(&r.drivers)),
                op_json(&of(&r.pool)),
                // JSON has no infinity: null when only the drivers sent IPIs.
                if x.is_finite() {
                    format!("{x:.6}")
                } else {
                    "null".to_string()
                }
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}
