//! Running the model: one seed, a cell pooled over seeds, the machine
//! each run gets, and the model's initial state.

use super::*;

/// The calibrated workload on `cpus` CPUs with `peer`'s policy in the
/// measured cell ([`Cell::measured`]), pooled over [`SEEDS`].
pub fn run(cpus: usize, tasks: Tasks, peer: Peer) -> Figures {
    run_cell(Cell::measured(cpus, tasks), peer, &SEEDS)
}

/// The workload in `cell` with `peer`'s policy, pooled over `seeds`.
///
/// The seeds' runs are independent (each its own machine and model), so
/// they run on threads of their own; the counts are summed, so the figures
/// are the same whatever order they finish in.
pub fn run_cell(cell: Cell, peer: Peer, seeds: &[u64]) -> Figures {
    let one = |seed: u64| match peer {
        Peer::BroadcastAlways | Peer::BroadcastWide => run_seed::<X86Invlpgb>(cell, peer, seed),
        _ => run_seed::<X86Like>(cell, peer, seed),
    };
    let mut total = Figures::default();
    std::thread::scope(|s| {
        let runs: Vec<_> = seeds.iter().map(|&seed| s.spawn(move || one(seed))).collect();
        for run in runs {
            total.add(&run.join().expect("a model run does not panic"));
        }
    });
    total
}

/// One run with one seed.
pub fn run_seed<H: Hardware>(cell: Cell, peer: Peer, seed: u64) -> Figures {
    let m = machine::<H>(cell, peer);
    let mut model = Model::new(&m, cell, peer, seed);
    for t in 0..cell.cpus {
        model.place(t, t);
    }
    while !model.done() {
        model.tick();
    }
    model.flush_tables(0);
    if !model.pool.is_empty() {
        let released = model.pool.flush(&m.cpu(0).expect("a CPU")).expect("not nested");
        model.fig.released_at_end += released.len() as u64;
        model.free_released(released);
    }
    let mut fig = model.fig;
    fig.releases = model.pool.releases();
    fig.ticks = model.now;
    // The operations' own IPIs, interrupts and cycles are theirs, not
    // reclaim's.
    let (mig, un) = (fig.migrate, fig.munmap);
    fig.ipis = m.ipis_sent() - mig.ipis - un.ipis;
    fig.interrupts = m
        .cpus()
        .map(|c| m.interrupts_taken(c.id()).expect("a CPU"))
        .sum::<u64>()
        - mig.interrupts
        - un.interrupts;
    fig.cycles = m.costs().total() + fig.extra_refill_cycles - mig.cycles - un.cycles;
    fig.violations = m.violations().len();
    let stats = m.stats();
    fig.broadcasts = stats.broadcasts;
    fig.shootdowns = stats.shootdowns;
    fig.pooled = stats.frames_pooled;
    fig.released_by_passes = stats.frames_released_by_passes;
    fig.quiescent_flushes = stats.quiescent_flushes;
    fig.catch_ups = stats.catch_ups;
    fig
}

/// The machine: x86-like, or with broadcast invalidation for the
/// broadcast policies (whose threshold `peer` sets).
pub(super) fn machine<H: Hardware>(cell: Cell, peer: Peer) -> MockMachine<H> {
    MockMachine::with_model(MockConfig {
        // The hot pages' frames come on top of the workload's memory.
        frames: MEMORY + cell.hot,
        tlb_entries: TLB_ENTRIES,
        tagged_tlb: cell.tagged,
        broadcast_min_remote: if peer == Peer::BroadcastWide {
            BROADCAST_MIN_REMOTE
        } else {
            0
        },
        ..MockConfig::x86_like(cell.cpus)
    })
    .expect("a valid machine")
}

impl<'m, H: Hardware> Model<'m, H> {
    /// The model on machine `m`, one task per CPU, nothing mapped yet.
    pub(super) fn new(m: &'m MockMachine<H>, cell: Cell, peer: Peer, seed: u64) -> Self {
        let cpus = m.nr_cpus();
        let nspaces = match cell.tasks {
            Tasks::Processes => cpus,
            Tasks::Threads => 1,
        };
        let spaces = crate::address_spaces(m, nspaces);
        let rmap = MockRmap::new(m, spaces);
        // The hot pages: the same frames, read-only, in every space, known
        // to the reverse map (so that migration can move them).
        for h in 0..cell.hot {
            let f = m.alloc_frame().expect("memory for the hot pages");
            for s in 0..nspaces {
                rmap.map(
                    f,
                    s,
                    HOT_BASE + h as u64 * PAGE_SIZE,
                    false,
                    MappingFlags::empty(),
                )
                .expect("a hot page");
            }
        }
        let pages = task_pages(cpus);
        let stride = pages.div_ceil(REGION_ALIGN) * REGION_ALIGN;
        let shared = Shared::default();
        install_hook(m, &shared);
        m.set_tracing(true);
        let mut model = Model {
            m,
            rmap,
            peer,
            shared,
            tasks: (0..cpus)
                .map(|i| Task {
                    space: if nspaces == 1 { 0 } else { i },
                    first: i * stride,
                    pages,
                    pos: 0,
                    asleep_until: None,
                    last_cpu: None,
                })
                .collect(),
            cpus: (0..cpus)
                .map(|_| Cpu {
                    run: Run::Idle,
                    add_batch: Vec::new(),
                    debt: 0,
                    seen: 0,
                    hot_next: 0,
                    full_flushes: 0,
                })
                .collect(),
            runq: VecDeque::new(),
            lru: VecDeque::new(),
            kswapd: None,
            draws: Draws::new(seed, cpus),
            now: 0,
            cell,
            pool: Pool::new(),
            ops: ops::Ops::new(cell.ops, cpus),
            fig: Figures::default(),
        };
        model.place_neighbours();
        model
    }
}
