//! Workload benchmark modelled on vm-scalability's lru-file-mmap-read: N
//! CPUs each read their share of memory-mapped file pages totalling several
//! times the simulated memory, and direct reclaim frees pages under
//! pressure. The same workload runs three ways:
//!
//! - no batching: every unmap flushes at once (one shootdown per page);
//! - the seed series' policy: a page-sized list of pages, flushed with one
//!   IPI per target when full or before freeing, each target invalidating
//!   every listed page;
//! - this crate: `shrink_page_list`, one flush per flush point, single
//!   pages up to the ceiling and a full flush above it.
//!
//! Counts (IPIs, interrupts) are exact; cycles come from the mock's cost
//! model (IPIs, invalidations, and the TLB refills they cause). Every run
//! is checked by the oracle. Then the same workload on real threads (wall
//! clock, `runs.rs`).
//!
//! This first model interleaves the CPUs' pages one by one on the LRU, so
//! every flush point reaches every CPU whose pages it frees: it shows the
//! floor the crate meets, not what a real kernel sends. The *calibrated*
//! model (`calibrated.rs`) adds what decides that in Linux (per-CPU LRU add
//! batches, scan priorities, readahead and I/O sleeps, kswapd and direct
//! reclaim, a scheduler, idle CPUs, a working set, a clock that advances
//! with the cycles charged), reproduces Linux 6.1's measured shootdowns per
//! page with Linux's policy, and runs a matrix of hardware and kernel
//! choices (tagged TLBs, idle modes, timer ticks, 8 to 48 CPUs) with the
//! policies the goals are judged against, and the others beside them
//! (`policies.rs`, tables in `report.rs`); its matrix runs also migrate
//! pages and unmap ranges, the crate's `migrate_pages` and `MmuGather`
//! against Linux 6.1's policies for them (`calibrated/ops.rs`, table in
//! `report_ops.rs`). The first model's migration figures follow.
//!
//! `cargo run --release --example reclaim` prints tables and ends with one
//! line, each goal's worst cell of the matrix and the violations of every
//! run; add `--json` for the same figures as JSON.

mod calibrated;
mod matrix;
mod policies;
mod report;
mod report_ops;
mod runs;

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use tlb_batch::arch::mock::{
    Fault, MockConfig, MockCpu, MockKernel, MockMachine, MockRmap, MockSpace, Model,
};
use tlb_batch::{
    flush_tlb_page, page_referenced, shrink_page_list, try_to_unmap, Arch, Asid, CpuSet, Frame, MappingFlags,
    OwnedFrame, PageTable, Rmap, TlbFlushUnmapBatch, TtuFlags, UnmapBatch, PAGE_SIZE,
};

/// Simulated memory, in frames.
const MEMORY: usize = 2048;
/// File pages read in all: four times memory.
const FILE_PAGES: usize = 4 * MEMORY;
/// Linux's reclaim batch (SWAP_CLUSTER_MAX).
const DEFAULT_LIST: usize = 32;
/// The seed's list: what fits in a page beside its CPU mask and count.
const SEED_LIST: usize = (PAGE_SIZE as usize - std::mem::size_of::<CpuSet>() - 8) / 8;
const BASE: u64 = 0x1000_0000;
const CPU_COUNTS: [usize; 5] = [1, 4, 8, 16, 48];
const LIST_SIZES: [usize; 3] = [32, 128, 512];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Policy {
    PerPage,
    Seed,
    Crate,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::PerPage => "no batching",
            Policy::Seed => "seed PFN list",
            Policy::Crate => "tlb-batch",
        }
    }
}

#[derive(Clone, Copy, Default, Debug)]
struct Figures {
    reclaimed: u64,
    ipis: u64,
    interrupts: u64,
    cycles: u64,
    /// Reclaim calls that unmapped something: the moments a flush was due.
    flush_points: u64,
    /// Flush operations done, local ones included (the seed also flushes
    /// when its list is full).
    flushes: u64,
    /// One IPI per remote CPU caching a reclaimed page, per flush point.
    floor: u64,
    violations: usize,
}

/// The workload's handle to a frame it allocated.
fn handle(frame: Frame) -> OwnedFrame {
    // SAFETY: the workload allocates each frame once and frees it only
    // through the crate's drivers, which take this single handle.
    unsafe { OwnedFrame::new(frame) }
}

fn va(page: usize) -> u64 {
    BASE + page as u64 * PAGE_SIZE
}

/// The seed's batch: a list of pages and the CPUs to interrupt.
#[derive(Default)]
struct SeedBatch {
    pages: Vec<(Asid, u64)>,
    targets: CpuSet,
    flushes: u64,
}

impl SeedBatch {
    /// One IPI per remote target; every target (and this CPU, if it is
    /// one) invalidates each listed page. The list reaches the targets
    /// through the machine's IPI hook.
    fn flush(&mut self, cpu: &MockCpu<'_>, shared: &Mutex<Vec<(Asid, u64)>>) {
        if self.pages.is_empty() {
            return;
        }
        self.flushes += 1;
        *shared.lock().expect("benchmark lock") = std::mem::take(&mut self.pages);
        let targets = self.targets.intersection(&cpu.online_cpus());
        if targets.contains(cpu.id()) {
            for &(asid, va) in shared.lock().expect("benchmark lock").iter() {
                cpu.flush_local_page(asid, va);
            }
        }
        cpu.send_flush_ipi(&targets.difference(&CpuSet::single(cpu.id())));
        shared.lock().expect("benchmark lock").clear();
        self.targets = CpuSet::new();
    }
}

/// Unmaps every mapping of `frame` the seed's way; returns whether it is
/// unmapped.
fn seed_unmap(
    cpu: &MockCpu<'_>,
    rmap: &MockRmap<'_>,
    frame: Frame,
    seed: &mut SeedBatch,
    shared: &Mutex<Vec<(Asid, u64)>>,
) -> bool {
    let _ = rmap.walk(frame, &mut |m| {
        if m.space.lookup(m.va).maps(frame) {
            let mm = m.space.tlb_state();
            let defer = TlbFlushUnmapBatch::should_defer(cpu, mm, TtuFlags::BATCH_FLUSH);
            let old = m.space.clear(m.va);
            if old.is_dirty() {
                rmap.set_dirty(frame);
            }
            if defer {
                seed.pages.push((mm.asid(), m.va));
                seed.targets = seed.targets.union(&mm.flush_targets(cpu));
                if seed.pages.len() == SEED_LIST {
                    seed.flush(cpu, shared);
                }
            } else {
                flush_tlb_page(cpu, mm, m.va).expect("not nested");
            }
        }
        std::ops::ControlFlow::Continue(())
    });
    rmap.mapcount(frame) == 0
}

/// The remote CPUs that may cache any mapping of the cold (not accessed)
/// frames among `candidates`: what the floor charges for this flush point.
fn floor_targets(cpu: &MockCpu<'_>, rmap: &MockRmap<'_>, candidates: &[Frame]) -> CpuSet {
    let mut targets = CpuSet::new();
    for &f in candidates {
        let _ = rmap.walk(f, &mut |m| {
            let pte = m.space.lookup(m.va);
            if pte.maps(f) && !pte.is_accessed() {
                targets = targets.union(&m.space.tlb_state().flush_targets(cpu));
            }
            std::ops::ControlFlow::Continue(())
        });
    }
    targets.difference(&CpuSet::single(cpu.id()))
}

struct Sim<'m> {
    m: &'m MockMachine,
    rmap: MockRmap<'m>,
    lru: VecDeque<Frame>,
    policy: Policy,
    list: usize,
    seed: SeedBatch,
    seed_list: Arc<Mutex<Vec<(Asid, u64)>>>,
    fig: Figures,
}

impl<'m> Sim<'m> {
    fn reclaim(&mut self, cpu: &MockCpu<'m>) {
        let n = self.list.min(self.lru.len());
        let candidates: Vec<Frame> = self.lru.drain(..n).collect();
        let floor = floor_targets(cpu, &self.rmap, &candidates);
        let freed_before = self.fig.reclaimed;
        match self.policy {
            Policy::Crate => match self.list {
                32 => self.reclaim_crate::<32>(cpu, candidates),
                128 => self.reclaim_crate::<128>(cpu, candidates),
                _ => self.reclaim_crate::<512>(cpu, candidates),
            },
            Policy::PerPage | Policy::Seed => self.reclaim_by_hand(cpu, candidates),
        }
        if self.fig.reclaimed > freed_before {
            self.fig.flush_points += 1;
            self.fig.floor += floor.len() as u64;
        }
    }

    fn reclaim_crate<const L: usize>(&mut self, cpu: &MockCpu<'m>, candidates: Vec<Frame>) {
        let mut kernel = MockKernel::new(&self.rmap);
        let mut batch = UnmapBatch::<L>::new();
        let lru = &mut self.lru;
        let summary = shrink_page_list(
            cpu,
            &self.rmap,
            &mut kernel,
            &mut batch,
            candidates.into_iter().map(handle),
            &mut |f, _| lru.push_back(f.into_frame()),
        )
        .expect("not nested");
        self.fig.reclaimed += summary.freed as u64;
    }

    /// The driver's steps written out, with either flush policy.
    fn reclaim_by_hand(&mut self, cpu: &MockCpu<'m>, candidates: Vec<Frame>) {
        let mut aging = TlbFlushUnmapBatch::new();
        let mut unmapped = Vec::new();
        for f in candidates {
            let hot = page_referenced(cpu, &self.rmap, f, &mut aging)
                .expect("aligned")
                .referenced
                > 0;
            let gone = !hot
                && match self.policy {
                    Policy::PerPage => try_to_unmap(cpu, &self.rmap, f, TtuFlags::empty(), &mut aging)
                        .expect("not nested")
                        .is_unmapped(),
                    _ => seed_unmap(cpu, &self.rmap, f, &mut self.seed, &self.seed_list),
                };
            if gone {
                unmapped.push(f);
            } else {
                self.lru.push_back(f);
            }
        }
        // The flush point: before the frames are freed.
        self.seed.flush(cpu, &self.seed_list);
        aging.flush(cpu).expect("not nested");
        for f in unmapped {
            self.rmap.remove_frame(f);
            self.m.free_frame(f).expect("unmapped and flushed");
            self.fig.reclaimed += 1;
        }
    }

    fn read(&mut self, cpu: &MockCpu<'m>, space: usize, page: usize) {
        loop {
            match cpu.read(va(page)) {
                Ok(_) => return,
                Err(Fault::NotMapped { .. }) => {}
                Err(f) => panic!("unexpected fault {f:?}"),
            }
            while self.m.free_frames() == 0 {
                self.reclaim(cpu);
            }
            let frame = self.m.alloc_frame().expect("a free frame");
            self.rmap
                .map(frame, space, va(page), false, MappingFlags::empty())
                .expect("a known space");
            self.lru.push_back(frame);
        }
    }
}

fn machine(cpus: usize) -> MockMachine {
    MockMachine::new(MockConfig {
        frames: MEMORY,
        tlb_entries: 64,
        ..MockConfig::x86_like(cpus)
    })
    .expect("a valid machine")
}

/// `n` address spaces on `m`, with ASIDs 1 to `n`: one per process.
pub fn address_spaces<H: Model>(m: &MockMachine<H>, n: usize) -> Vec<MockSpace<'_, H>> {
    (0..n)
        .map(|i| {
            m.space(
                &m.new_mm(Asid::new(i as u16 + 1).expect("a user ASID"))
                    .expect("a new address space"),
            )
        })
        .collect()
}

fn run(cpus: usize, policy: Policy, list: usize) -> Figures {
    let m = machine(cpus);
    let spaces = address_spaces(&m, cpus);
    for (i, s) in spaces.iter().enumerate() {
        m.cpu(i).expect("a CPU").switch_to(s.mm()).expect("switch");
    }
    let seed_list = Arc::new(Mutex::new(Vec::new()));
    if policy == Policy::Seed {
        let shared = Arc::clone(&seed_list);
        m.set_ipi_hook(Some(Arc::new(move |target: &MockCpu<'_>| {
            for &(asid, va) in shared.lock().expect("benchmark lock").iter() {
                target.flush_local_page(asid, va);
            }
        })));
    }
    let mut sim = Sim {
        m: &m,
        rmap: MockRmap::new(&m, spaces),
        lru: VecDeque::new(),
        policy,
        list,
        seed: SeedBatch::default(),
        seed_list,
        fig: Figures::default(),
    };
    let per_cpu = FILE_PAGES / cpus;
    for page in 0..per_cpu {
        for c in 0..cpus {
            let cpu = m.cpu(c).expect("a CPU");
            sim.read(&cpu, c, page);
        }
    }
    let mut fig = sim.fig;
    // Every flush done: the crate's shootdowns (local ones included) and
    // the seed list's own.
    fig.flushes = m.stats().shootdowns + sim.seed.flushes;
    fig.ipis = m.ipis_sent();
    fig.interrupts = m.cpus().map(|c| m.interrupts_taken(c.id()).expect("a CPU")).sum();
    fig.cycles = m.costs().total();
    fig.violations = m.violations().len();
    fig
}

fn per(n: u64, d: u64) -> f64 {
    n as f64 / d.max(1) as f64
}

fn main() -> ExitCode {
    let json = std::env::args().any(|a| a == "--json");
    let mut text = String::new();
    let mut records = Vec::new();
    let mut violations = 0;

    let _ = writeln!(
        text,
        "lru-file-mmap-read model: {FILE_PAGES} file pages read through mappings by N CPUs, \
         {MEMORY} frames of memory, direct reclaim of {DEFAULT_LIST} pages at a time\n"
    );
    let _ = writeln!(
        text,
        "{:>4}  {:<14} {:>9} {:>7} {:>9} {:>9} {:>11} {:>9} {:>10} {:>5}",
        "CPUs",
        "policy",
        "reclaimed",
        "flushes",
        "IPIs/pg",
        "irqs/pg",
        "cycles/pg",
        "IPIs vs",
        "cycles vs",
        "viol"
    );
    for cpus in CPU_COUNTS {
        let base = run(cpus, Policy::PerPage, DEFAULT_LIST);
        for policy in [Policy::PerPage, Policy::Seed, Policy::Crate] {
            let f = if policy == Policy::PerPage {
                base
            } else {
                run(cpus, policy, DEFAULT_LIST)
            };
            violations += f.violations;
            let _ = writeln!(
                text,
                "{:>4}  {:<14} {:>9} {:>7} {:>9.4} {:>9.4} {:>11.1} {:>9.3} {:>10.3} {:>5}",
                cpus,
                policy.name(),
                f.reclaimed,
                f.flushes,
                per(f.ipis, f.reclaimed),
                per(f.interrupts, f.reclaimed),
                per(f.cycles, f.reclaimed),
                per(f.ipis, base.ipis.max(1)),
                per(f.cycles, base.cycles),
                f.violations
            );
            records.push((cpus, policy, DEFAULT_LIST, f));
            if policy == Policy::Crate {
                let verdict = if f.floor == 0 && f.ipis == 0 {
                    "tlb-batch sends none: no remote CPU caches a reclaimed page".to_string()
                } else {
                    format!(
                        "tlb-batch at {:.3}x the floor ({} IPIs for {} due)",
                        per(f.ipis, f.floor),
                        f.ipis,
                        f.floor
                    )
                };
                let _ = writeln!(
                    text,
                    "{:>4}  {:<14} {:>9} {:>7} {:>9.4}   {verdict}\n",
                    "",
                    "floor",
                    "",
                    f.flush_points,
                    per(f.floor, f.reclaimed),
                );
            }
        }
    }

    let _ = writeln!(
        text,
        "Reclaim list size (tlb-batch): more pages per flush point, fewer IPIs per page\n"
    );
    let _ = writeln!(
        text,
        "{:>4}  {:>5} {:>12} {:>9} {:>9} {:>11}",
        "CPUs", "list", "flush points", "IPIs/pg", "floor/pg", "cycles/pg"
    );
    for cpus in CPU_COUNTS {
        for list in LIST_SIZES {
            let f = run(cpus, Policy::Crate, list);
            violations += f.violations;
            let _ = writeln!(
                text,
                "{:>4}  {:>5} {:>12} {:>9.4} {:>9.4} {:>11.1}",
                cpus,
                list,
                f.flush_points,
                per(f.ipis, f.reclaimed),
                per(f.floor, f.reclaimed),
                per(f.cycles, f.reclaimed)
            );
            records.push((cpus, Policy::Crate, list, f));
        }
    }

    let _ = writeln!(
        text,
        "\nThreaded machine (CPUs are threads, IPIs real cross-thread interrupts), same workload, \
         median of {} alternating runs:\n",
        runs::THREADED_REPEATS
    );
    let _ = writeln!(
        text,
        "{:>4}  {:>12} {:>12} {:>10} {:>10} {:>12}",
        "CPUs", "unbatched s", "batched s", "ratio", "IPIs/pg", "batched IPIs/pg"
    );
    let mut threaded = Vec::new();
    for cpus in [4, 8] {
        // Alternating repetitions, median of each: one noisy run decides
        // nothing.
        let mut plain_runs = Vec::new();
        let mut batch_runs = Vec::new();
        for _ in 0..runs::THREADED_REPEATS {
            plain_runs.push(runs::run_threaded(cpus, Policy::PerPage));
            batch_runs.push(runs::run_threaded(cpus, Policy::Crate));
        }
        let (t_plain, plain) = runs::median(plain_runs);
        let (t_batch, batch) = runs::median(batch_runs);
        violations += plain.violations + batch.violations;
        let _ = writeln!(
            text,
            "{:>4}  {:>12.3} {:>12.3} {:>10.3} {:>10.4} {:>12.4}",
            cpus,
            t_plain,
            t_batch,
            t_batch / t_plain,
            per(plain.ipis, plain.reclaimed),
            per(batch.ipis, batch.reclaimed)
        );
        threaded.push((cpus, t_plain, t_batch, plain, batch));
    }

    let cal = report::run_all();
    violations += cal.violations;
    text.push_str(&cal.text);

    let _ = writeln!(
        text,
        "\nMigration of 512 written pages of 8 processes (8 CPUs), by policy (the seed RFC and \
         Asterinas do not batch migration flushes: not applicable):\n"
    );
    let _ = writeln!(
        text,
        "{:<24} {:>9} {:>9} {:>11} {:>5}",
        "policy", "migrated", "IPIs/pg", "cycles/pg", "viol"
    );
    let mut migration = Vec::new();
    for (name, list) in [
        ("no batching", 1),
        ("Linux 6.1", 1),
        ("tlb-batch, lists of 32", 32),
        ("tlb-batch, one of 512", 512),
    ] {
        let f = runs::run_migration(list);
        violations += f.violations;
        let _ = writeln!(
            text,
            "{:<24} {:>9} {:>9.4} {:>11.1} {:>5}",
            name,
            f.reclaimed,
            per(f.ipis, f.reclaimed),
            per(f.cycles, f.reclaimed),
            f.violations
        );
        migration.push((name, f));
    }
    let _ = writeln!(text, "\nOracle violations in all runs: {violations}");
    if cal.misses > 0 {
        let _ = writeln!(text, "Calibration cells outside ±35%: {}", cal.misses);
    }
    // The last line: every goal's worst cell of the matrix, and the
    // violations of every run above.
    let summary = report::Worst {
        violations,
        ..cal.worst.clone()
    };
    let _ = writeln!(
        text,
        "\nEvery goal met in every cell of the matrix: {}",
        if summary.met() {
            "yes"
        } else {
            "no (the line below names each goal's worst cell)"
        }
    );
    let _ = writeln!(text, "\n{}", summary.line());

    if json {
        println!(
            "{}",
            to_json(&records, &threaded, &migration, &cal.json, violations)
        );
    } else {
        print!("{text}");
    }
    if violations == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn figures_json(f: &Figures) -> String {
    format!(
        "\"reclaimed\":{},\"ipis\":{},\"interrupts\":{},\"cycles\":{},\"flush_points\":{},\"flushes\":{},\"floor_ipis\":{},\"violations\":{}",
        f.reclaimed, f.ipis, f.interrupts, f.cycles, f.flush_points, f.flushes, f.floor, f.violations
    )
}

fn to_json(
    records: &[(usize, Policy, usize, Figures)],
    threaded: &[(usize, f64, f64, Figures, Figures)],
    migration: &[(&str, Figures)],
    calibrated: &str,
    violations: usize,
) -> String {
    let runs: Vec<String> = records
        .iter()
        .map(|(cpus, p, list, f)| {
            format!(
                "{{\"cpus\":{cpus},\"policy\":\"{}\",\"list\":{list},{}}}",
                p.name(),
                figures_json(f)
            )
        })
        .collect();
    let thr: Vec<String> = threaded
        .iter()
        .map(|(cpus, tp, tb, p, b)| {
            format!(
                "{{\"cpus\":{cpus},\"unbatched_seconds\":{tp:.6},\"batched_seconds\":{tb:.6},\"ratio\":{:.6},\"unbatched\":{{{}}},\"batched\":{{{}}}}}",
                tb / tp,
                figures_json(p),
                figures_json(b)
            )
        })
        .collect();
    let mig: Vec<String> = migration
        .iter()
        .map(|(name, f)| format!("{{\"policy\":\"{name}\",{}}}", figures_json(f)))
        .collect();
    format!(
        "{{\"memory_frames\":{MEMORY},\"file_pages\":{FILE_PAGES},\"seed_list\":{SEED_LIST},\"runs\":[{}],\"threaded\":[{}],\"migration\":[{}],{calibrated},\"violations\":{violations}}}",
        runs.join(","),
        thr.join(","),
        mig.join(",")
    )
}
