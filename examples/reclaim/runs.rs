//! The first model's other runs: the same workload on a threaded machine
//! (wall clock), and page migration in lists of different sizes.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

use tlb_batch::arch::mock::{MockConfig, MockCpu, MockKernel, MockMachine, MockRmap};
use tlb_batch::{
    migrate_pages, page_referenced, shrink_page_list, try_to_unmap, Frame, MappingFlags, TlbFlushUnmapBatch,
    TtuFlags, UnmapBatch,
};

use crate::{address_spaces, handle, machine, va, Figures, Policy, DEFAULT_LIST, FILE_PAGES, MEMORY};

/// The workload on real threads (CPUs as threads, IPIs as cross-thread
/// interrupts); returns the wall time in seconds and the figures.
pub fn run_threaded(cpus: usize, policy: Policy) -> (f64, Figures) {
    let memory = MEMORY;
    let m = MockMachine::new(
        MockConfig {
            frames: memory,
            tlb_entries: 64,
            ..MockConfig::x86_like(cpus)
        }
        .threaded(),
    )
    .expect("a valid machine");
    let spaces = address_spaces(&m, cpus);
    let rmap = MockRmap::new(&m, spaces);
    let lru: Mutex<VecDeque<Frame>> = Mutex::new(VecDeque::new());
    let reclaimed = std::sync::atomic::AtomicU64::new(0);
    let per_cpu = FILE_PAGES / cpus;
    // A lock taken the way a kernel spins with interrupts on: pending IPIs
    // are served while waiting, so a shootdown never waits on a spinner.
    let lock_serving = |cpu: &MockCpu<'_>| loop {
        if let Ok(guard) = lru.try_lock() {
            return guard;
        }
        cpu.poll_interrupts();
        std::thread::yield_now();
    };
    let start = Instant::now();
    m.run_threaded(|cpu| {
        let me = cpu.id().index();
        cpu.switch_to(rmap.spaces()[me].mm()).expect("switch");
        let mut kernel = MockKernel::new(&rmap);
        for page in 0..per_cpu {
            while cpu.read(va(page)).is_err() {
                if let Ok(frame) = m.alloc_frame() {
                    rmap.map(frame, me, va(page), false, MappingFlags::empty())
                        .expect("a known space");
                    lock_serving(&cpu).push_back(frame);
                    continue;
                }
                let candidates: Vec<Frame> = {
                    let mut l = lock_serving(&cpu);
                    let n = DEFAULT_LIST.min(l.len());
                    l.drain(..n).collect()
                };
                let mut kept = Vec::new();
                match policy {
                    Policy::Crate => {
                        let mut batch = UnmapBatch::<DEFAULT_LIST>::new();
                        let s = shrink_page_list(
                            &cpu,
                            &rmap,
                            &mut kernel,
                            &mut batch,
                            candidates.into_iter().map(handle),
                            &mut |f, _| kept.push(f.into_frame()),
                        )
                        .expect("not nested");
                        reclaimed.fetch_add(s.freed as u64, std::sync::atomic::Ordering::Relaxed);
                    }
                    _ => {
                        let mut aging = TlbFlushUnmapBatch::new();
                        for f in candidates {
                            let hot = page_referenced(&cpu, &rmap, f, &mut aging)
                                .expect("aligned")
                                .referenced
                                > 0;
                            if !hot
                                && try_to_unmap(&cpu, &rmap, f, TtuFlags::empty(), &mut aging)
                                    .expect("not nested")
                                    .is_unmapped()
                            {
                                rmap.remove_frame(f);
                                m.free_frame(f).expect("unmapped and flushed");
                                reclaimed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            } else {
                                kept.push(f);
                            }
                        }
                    }
                }
                lock_serving(&cpu).extend(kept);
            }
        }
    });
    let wall = start.elapsed().as_secs_f64();
    let fig = Figures {
        reclaimed: reclaimed.load(std::sync::atomic::Ordering::Relaxed),
        ipis: m.ipis_sent(),
        interrupts: m.cpus().map(|c| m.interrupts_taken(c.id()).expect("a CPU")).sum(),
        cycles: m.costs().total(),
        violations: m.violations().len(),
        ..Figures::default()
    };
    (wall, fig)
}

/// Migrates `frames` with the crate's driver in lists of `L` pages.
fn migrate_in<const L: usize>(
    cpu: &MockCpu<'_>,
    rmap: &MockRmap<'_>,
    kernel: &mut MockKernel<'_, '_>,
    frames: &[Frame],
    count: &mut dyn FnMut(tlb_batch::MigrateOutcome),
) {
    for chunk in frames.chunks(L) {
        let mut batch = UnmapBatch::<L>::new();
        let pages = chunk.iter().map(|&f| handle(f));
        migrate_pages(cpu, rmap, kernel, &mut batch, pages, count).expect("not nested");
    }
}

/// Migrates every page of 8 processes (64 each, written: 512 pages) in
/// lists of `list` pages (1, 32 or 512).
pub fn run_migration(list: usize) -> Figures {
    let cpus = 8;
    let m = machine(cpus);
    let spaces = address_spaces(&m, cpus);
    let rmap = MockRmap::new(&m, spaces);
    let mut frames = Vec::new();
    for c in 0..cpus {
        let cpu = m.cpu(c).expect("a CPU");
        cpu.switch_to(rmap.spaces()[c].mm()).expect("switch");
        for p in 0..64 {
            let f = m.alloc_frame().expect("memory");
            rmap.map(f, c, va(p), true, MappingFlags::empty())
                .expect("a known space");
            cpu.write(va(p), f.0).expect("mapped");
            frames.push(f);
        }
    }
    let (ipis, cycles) = (m.ipis_sent(), m.costs().total());
    let mut kernel = MockKernel::new(&rmap);
    let mut migrated = 0;
    let cpu0 = m.cpu(0).expect("a CPU");
    let mut count = |o: tlb_batch::MigrateOutcome| {
        if matches!(o, tlb_batch::MigrateOutcome::Migrated { .. }) {
            migrated += 1;
        }
    };
    match list {
        1 => migrate_in::<1>(&cpu0, &rmap, &mut kernel, &frames, &mut count),
        32 => migrate_in::<32>(&cpu0, &rmap, &mut kernel, &frames, &mut count),
        _ => migrate_in::<512>(&cpu0, &rmap, &mut kernel, &frames, &mut count),
    }
    Figures {
        reclaimed: migrated,
        ipis: m.ipis_sent() - ipis,
        cycles: m.costs().total() - cycles,
        violations: m.violations().len(),
        ..Figures::default()
    }
}

pub const THREADED_REPEATS: usize = 3;

pub fn median(mut runs: Vec<(f64, Figures)>) -> (f64, Figures) {
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    runs[runs.len() / 2]
}
