//! The matrix of hardware and kernel choices the goals are judged on:
//! its cells (TLBs, idle CPUs, timer periods, CPUs, processes and
//! threads), the seeds each pools, and the runs of every peer on them.

use crate::calibrated::{
    run_cell, Cell, Figures, Idle, Tasks, HOT_PAGES, REALISTIC_TIMER, SEEDS, TIMER_TICKS,
};
use crate::policies::Peer;

/// The matrix's CPU counts (the goals' too).
pub const GOAL_CPUS: [usize; 3] = [8, 16, 48];
/// The matrix's timer periods.
pub const TIMERS: [Option<u64>; 3] = [Some(TIMER_TICKS), Some(REALISTIC_TIMER), None];

/// The seeds the matrix draws from: the calibration's four, then eight
/// more.
const MATRIX_SEEDS: [u64; 12] = [
    SEEDS[0],
    SEEDS[1],
    SEEDS[2],
    SEEDS[3],
    0x2545_f491_4f6c_dd1d,
    0x6a09_e667_f3bc_c908,
    0xbb67_ae85_84ca_a73b,
    0x3c6e_f372_fe94_f82b,
    0xa54f_f53a_5f1d_36f1,
    0x510e_527f_ade6_82d1,
    0x9b05_688c_2b3e_6c1f,
    0x1f83_d9ab_fb41_bd6b,
];

/// The seeds a matrix cell pools.
///
/// Elapsed time is the tick the slowest task finished, so it moves from
/// seed to seed more than the per-page counts do, and with processes the
/// policies' elapsed times lie within about 1% of each other (a flush
/// there reaches one CPU or none, 0.05 IPIs per page): too few seeds would
/// let the draw decide the verdict. One seed's elapsed ratio of the
/// drivers against Linux 6.1 spreads by 0.7% at 8 processes, 1.3% at 16
/// and 1.4% at 48 (standard deviation over 16, 16 and 12 seeds, with the
/// model's draws in one stream per purpose; 3.0% at 48 with a single
/// stream, `calibrated/draws.rs`). Cells of processes pool four seeds at
/// 8 CPUs and twelve at 16 and 48 (a standard error of 0.4% or less);
/// cells of threads, whose runs are the long ones (no batching interrupts
/// 47 CPUs per page at 48) and whose elapsed ratios lie 5-30% below the
/// goal, pool two.
pub fn matrix_seeds(cell: &Cell) -> &'static [u64] {
    match (cell.tasks, cell.cpus) {
        (Tasks::Threads, _) => &MATRIX_SEEDS[..2],
        (Tasks::Processes, cpus) if cpus > 8 => &MATRIX_SEEDS,
        (Tasks::Processes, _) => &MATRIX_SEEDS[..4],
    }
}

/// Every cell of the matrix, in the order the tables print them.
pub fn matrix_cells() -> Vec<Cell> {
    let mut cells = Vec::new();
    for cpus in GOAL_CPUS {
        for tasks in [Tasks::Processes, Tasks::Threads] {
            for tagged in [false, true] {
                for idle in [Idle::Lazy, Idle::Kernel] {
                    for timer in TIMERS {
                        cells.push(Cell {
                            cpus,
                            tasks,
                            tagged,
                            idle,
                            timer,
                            hot: HOT_PAGES,
                            ops: true,
                        });
                    }
                }
            }
        }
    }
    cells
}

/// One cell's runs: every peer the goals are judged against.
#[derive(Clone, Copy)]
pub struct CellRuns {
    pub cell: Cell,
    pub none: Figures,
    pub linux: Figures,
    pub drivers: Figures,
    pub pool: Figures,
}

/// Runs every peer on `cells`, each with `seeds(cell)`. Only the pool does
/// anything at a timer tick, so the other peers run once per cell with the
/// timer left out and their figures serve every timer period. On a tagged
/// TLB the two idle modes make the same flushes for every peer but the
/// pool (a switch to the kernel's space flushes nothing there, and
/// resuming either way catches up by generation), so a tagged cell with
/// idle CPUs on the kernel's space takes those peers' runs from the same
/// cell with lazy ones, if `cells` has it first, and runs the pool; the
/// test `tagged_tlbs_make_the_idle_modes_equal` runs both and pins that
/// they are equal. Not with the operations (`Cell::ops`): a teardown that
/// frees a page table interrupts lazy CPUs, not those on the kernel's
/// space, and Linux's reclaim marks a space for the teardown's first flush
/// when a lazy CPU is in its CPU set; those cells run every peer.
pub fn run_matrix(cells: &[Cell], seeds: &dyn Fn(&Cell) -> &'static [u64]) -> Vec<CellRuns> {
    let mut out: Vec<CellRuns> = Vec::new();
    for &cell in cells {
        let seeds = seeds(&cell);
        let key = Cell { timer: None, ..cell };
        let lazy_twin = cell.tagged && cell.idle == Idle::Kernel && !cell.ops;
        let shared = out.iter().find(|r| {
            let other = Cell {
                timer: None,
                ..r.cell
            };
            other == key
                || (lazy_twin
                    && other
                        == Cell {
                            idle: Idle::Lazy,
                            ..key
                        })
        });
        let (none, linux, drivers, pool) = match shared {
            Some(r) => (r.none, r.linux, r.drivers, None),
            // Every peer's runs are independent: they run side by side.
            None => std::thread::scope(|s| {
                let pool = s.spawn(|| run_cell(cell, Peer::TlbBatchPool, seeds));
                let none = s.spawn(|| run_cell(cell, Peer::NoBatching, seeds));
                let linux = s.spawn(|| run_cell(cell, Peer::Linux61, seeds));
                let drivers = run_cell(cell, Peer::TlbBatch, seeds);
                let join = |h: std::thread::ScopedJoinHandle<'_, Figures>| {
                    h.join().expect("a model run does not panic")
                };
                (join(none), join(linux), drivers, Some(join(pool)))
            }),
        };
        let pool = pool.unwrap_or_else(|| run_cell(cell, Peer::TlbBatchPool, seeds));
        out.push(CellRuns {
            cell,
            none,
            linux,
            drivers,
            pool,
        });
    }
    out
}
