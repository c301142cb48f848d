//! The matrix's cells (TLBs, idle CPUs, timer, CPUs, tasks) and the
//! figures a run of one produces.

use super::*;

/// What an idle CPU (or kswapd's) does with the user space it ran last.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Idle {
    /// It keeps it loaded, lazily (`MockCpu::enter_lazy`: the crate's
    /// `enter_lazy_tlb` and the mock's mark), as Linux does: flushes of the
    /// space skip it, and it catches up when it resumes the space.
    Lazy,
    /// It switches to the kernel's address space: out of the user space's
    /// CPU set, and (untagged TLB) its TLB flushed.
    Kernel,
}

impl Idle {
    pub fn name(self) -> &'static str {
        match self {
            Idle::Lazy => "lazy",
            Idle::Kernel => "kernel mm",
        }
    }
}

/// One cell of the matrix: the hardware and the kernel's choices a run
/// is made on.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Cell {
    pub cpus: usize,
    pub tasks: Tasks,
    /// PCID / ASID-tagged TLBs (entries survive a switch, tagged).
    pub tagged: bool,
    pub idle: Idle,
    /// The CPUs' timer period in ticks of the model; `None`: no tick (a
    /// tickless kernel whose busy CPUs run one task each).
    pub timer: Option<u64>,
    /// Hot pages each task keeps touching ([`HOT_PAGES`], or 0).
    pub hot: usize,
    /// Whether the run also migrates pages and unmaps ranges
    /// (`calibrated/ops.rs`): the matrix's cells do, the calibration's
    /// do not.
    pub ops: bool,
}

impl Cell {
    /// The cell closest to what the model ran before the matrix (and to
    /// the measured guest: TCG has no PCID, Linux idles lazily).
    pub fn measured(cpus: usize, tasks: Tasks) -> Self {
        Cell {
            cpus,
            tasks,
            tagged: false,
            idle: Idle::Lazy,
            timer: Some(TIMER_TICKS),
            hot: HOT_PAGES,
            ops: false,
        }
    }

    /// Whether this is the measured cell for its CPUs and tasks, with or
    /// without the operations.
    pub fn is_measured(&self) -> bool {
        Cell { ops: false, ..*self } == Cell::measured(self.cpus, self.tasks)
    }

    pub fn timer_name(&self) -> String {
        match self.timer {
            Some(t) if t == TIMER_TICKS => format!("tick {t}"),
            Some(t) => format!("tick {t}"),
            None => "no tick".to_string(),
        }
    }

    /// "16 threads, tagged, lazy, no tick".
    pub fn name(&self) -> String {
        format!(
            "{} {}, {}, {}, {}",
            self.cpus,
            self.tasks.name(),
            if self.tagged { "tagged" } else { "untagged" },
            self.idle.name(),
            self.timer_name()
        )
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Tasks {
    Processes,
    Threads,
}

impl Tasks {
    pub fn name(self) -> &'static str {
        match self {
            Tasks::Processes => "processes",
            Tasks::Threads => "threads",
        }
    }
}

/// Linux measured (shootdowns per reclaimed page, low and high of the
/// runs), from issue #13: Debian 6.1 in a TCG guest, 256 MB, 768 MB of
/// files, one run per cell, about 30% noise.
// 0.318 is a measurement, not 1/pi.
#[allow(clippy::approx_constant)]
pub fn measured(cpus: usize, tasks: Tasks) -> Option<(f64, f64)> {
    Some(match (cpus, tasks) {
        (2, Tasks::Processes) => (0.019, 0.019),
        (2, Tasks::Threads) => (0.031, 0.031),
        (4, Tasks::Processes) => (0.031, 0.044),
        (4, Tasks::Threads) => (0.106, 0.118),
        (8, Tasks::Processes) => (0.057, 0.060),
        (8, Tasks::Threads) => (0.288, 0.318),
        _ => return None,
    })
}

#[derive(Clone, Copy, Default, Debug)]
pub struct Figures {
    pub reclaimed: u64,
    /// Reclaim calls that freed something.
    pub calls: u64,
    /// Of them, the ones made by a task on its own CPU (the rest by kswapd).
    pub direct_calls: u64,
    /// Reclaim calls that sent at least one IPI.
    pub calls_with_ipis: u64,
    pub ipis: u64,
    pub interrupts: u64,
    pub cycles: u64,
    /// CPUs that flushed an ASID locally as they loaded it, because a
    /// flush had skipped them (lazy, or switched away: the crate's
    /// generation catch-up).
    pub catch_ups: u64,
    /// Tasks that woke on another CPU than they last ran on.
    pub moves: u64,
    /// Elapsed time: ticks of the model until the last task finished.
    pub ticks: u64,
    /// Ticks the CPUs lost to charged cycles ([`CYCLES_PER_TICK`]).
    pub stalls: u64,
    /// Reclaim calls made, freeing or not.
    pub all_calls: u64,
    /// Sum over reclaim calls of the other CPUs running a worker then.
    pub busy_others: u64,
    pub violations: usize,
    /// Shootdowns done (by the crate's functions), and how many of them by
    /// broadcast invalidation.
    pub shootdowns: u64,
    pub broadcasts: u64,
    /// The pooled policy: frames pooled, frames released by the CPUs' own
    /// flushes (no IPI), and those flushes.
    pub pooled: u64,
    pub released_by_passes: u64,
    pub quiescent_flushes: u64,
    /// Where the pool's frames went out, by the call that handed them back:
    /// `release_passed` at a CPU's timer tick (after its
    /// `quiescent_flush`), when an allocation found no free frame, and in
    /// a reclaim call (the rest of `released_by_passes`); the forced ones
    /// (`flush_oldest` when the pool is full or memory ran out, and the
    /// final `flush`: `pooled - released_by_passes`), of which the final
    /// flush.
    pub released_at_ticks: u64,
    pub released_at_alloc: u64,
    pub released_at_end: u64,
    /// Why they went back, as the pool tells (`FramePool::releases`):
    /// aged (passed before they were pooled), passes (every CPU dropped
    /// its whole TLB since), generations (some CPU lazy or on another
    /// space), forced (a shootdown the pool sent).
    pub releases: PoolReleases,
    /// Frames pooled: the most at once, and the sum over ticks (the mean
    /// is that over `ticks`).
    pub pool_peak: u64,
    pub pool_sum: u64,
    /// Refills of hot pages after full flushes beyond the first between
    /// two of a worker's page reads (charged by the model, not the mock:
    /// see `Model::touch_hot`); included in `cycles`.
    pub extra_refill_cycles: u64,
    /// The operations beside reclaim (`ops.rs`): page migration and range
    /// teardown. Their IPIs, interrupts and cycles are counted here and
    /// not in the reclaim figures above.
    pub migrate: ops::OpFigures,
    pub munmap: ops::OpFigures,
}

impl Figures {
    pub fn per_page(&self, n: u64) -> f64 {
        n as f64 / self.reclaimed.max(1) as f64
    }

    /// Pages freed per reclaim call.
    pub fn pages_per_call(&self) -> f64 {
        self.reclaimed as f64 / self.all_calls.max(1) as f64
    }

    /// CPUs interrupted per call that interrupted any.
    pub fn reach(&self) -> f64 {
        self.ipis as f64 / self.calls_with_ipis.max(1) as f64
    }

    /// Mean frames pooled over the run.
    pub fn pool_mean(&self) -> f64 {
        self.pool_sum as f64 / self.ticks.max(1) as f64
    }

    /// Adds `f`'s counts to these (the peak is the larger one).
    pub fn add(&mut self, f: &Figures) {
        self.reclaimed += f.reclaimed;
        self.calls += f.calls;
        self.direct_calls += f.direct_calls;
        self.calls_with_ipis += f.calls_with_ipis;
        self.ipis += f.ipis;
        self.interrupts += f.interrupts;
        self.cycles += f.cycles;
        self.catch_ups += f.catch_ups;
        self.moves += f.moves;
        self.ticks += f.ticks;
        self.stalls += f.stalls;
        self.all_calls += f.all_calls;
        self.busy_others += f.busy_others;
        self.violations += f.violations;
        self.broadcasts += f.broadcasts;
        self.shootdowns += f.shootdowns;
        self.pooled += f.pooled;
        self.released_by_passes += f.released_by_passes;
        self.quiescent_flushes += f.quiescent_flushes;
        self.released_at_ticks += f.released_at_ticks;
        self.released_at_alloc += f.released_at_alloc;
        self.released_at_end += f.released_at_end;
        self.pool_peak = self.pool_peak.max(f.pool_peak);
        self.pool_sum += f.pool_sum;
        self.extra_refill_cycles += f.extra_refill_cycles;
        self.releases.aged += f.releases.aged;
        self.releases.passes += f.releases.passes;
        self.releases.generations += f.releases.generations;
        self.releases.forced += f.releases.forced;
        self.migrate.add(&f.migrate);
        self.munmap.add(&f.munmap);
    }
}
