//! Unit tests of the calibrated model.

use super::*;
use tlb_batch::arch::mock::Violation;
use tlb_batch::CpuId;

#[test]
fn scan_sizes_follow_the_priorities() {
    let mut scan = Scan::new();
    // 2000 >> 7 = 15 pages, then 2000 >> 6 = 31, then 62 in two calls.
    let sizes: Vec<usize> = (0..4).map(|_| scan.next(2000)).collect();
    assert_eq!(sizes, [15, 31, 32, 30]);
}

/// On x86 with broadcast invalidation, the crate broadcasts what reaches
/// other CPUs (every flush, or the wide ones), sends no IPI when it
/// broadcasts everything, and keeps the oracle quiet either way.
#[test]
fn broadcast_hardware_broadcasts_what_reaches_other_cpus() {
    let always = run_seed::<X86Invlpgb>(
        4,
        Tasks::Threads,
        Peer::BroadcastAlways,
        SEEDS[0],
        true,
        TIMER_TICKS,
    );
    assert!(always.broadcasts > 0);
    assert_eq!(always.ipis, 0);
    assert_eq!(always.violations, 0);
    let wide = run_seed::<X86Invlpgb>(
        4,
        Tasks::Processes,
        Peer::BroadcastWide,
        SEEDS[0],
        true,
        TIMER_TICKS,
    );
    let ipis_only = run_seed::<X86Like>(4, Tasks::Processes, Peer::TlbBatch, SEEDS[0], true, TIMER_TICKS);
    assert!(wide.broadcasts > 0 && wide.broadcasts < wide.shootdowns);
    assert!(wide.ipis > 0 && wide.ipis < ipis_only.ipis);
    assert_eq!(wide.violations, 0);
}

#[test]
fn every_policy_keeps_the_oracle_quiet() {
    for peer in Peer::ALL {
        for tasks in [Tasks::Processes, Tasks::Threads] {
            let f = run_seed::<X86Like>(4, tasks, peer, SEEDS[0], true, TIMER_TICKS);
            assert_eq!(f.violations, 0, "{} with {}", peer.name(), tasks.name());
            assert!(f.reclaimed > FILE_PAGES as u64);
        }
    }
}

/// What the oracle recorded when a lazy CPU came back: at the resume, and
/// after its first read there.
struct Resume {
    at_resume: Vec<Violation>,
    after_read: Vec<Violation>,
}

/// CPU 1 caches a page of the threads' space and goes lazy; CPU 0
/// reclaims the page with Linux's policy, which skips CPU 1; CPU 1 then
/// resumes the space and reads the page again.
fn lazy_cpu_rereads(catch_up: bool) -> (Frame, Resume) {
    let m = machine::<X86Like>(2, Peer::Linux61);
    let mut model = Model::new(&m, Tasks::Threads, Peer::Linux61, SEEDS[0], catch_up);
    model.place(0, 0);
    model.place(1, 1);
    let frame = m.alloc_frame().expect("memory");
    model
        .rmap
        .map(frame, 0, va(0), false, MappingFlags::empty())
        .expect("a known space");
    model.lru.push_back(frame);
    let cpu1 = m.cpu(1).expect("a CPU");
    cpu1.read(va(0)).expect("mapped");
    model.go_lazy(1, Run::Idle);
    assert!(cpu1.is_lazy());
    assert_eq!(cpu1.read(va(0)), Err(Fault::LazyUserAccess { va: va(0) }));
    // The first scan finds the page young and keeps it, the second
    // frees it.
    assert_eq!(model.reclaim_call(0, true, 1), 0);
    assert_eq!(model.reclaim_call(0, true, 1), 1);
    assert_eq!(m.ipis_sent(), 0, "the lazy CPU was skipped");
    assert_eq!(m.cached_translations(frame).len(), 1, "CPU 1 still caches it");
    assert_eq!(
        m.violations(),
        [],
        "a lazy CPU's entry is no violation at the free"
    );
    model.place(1, 1);
    assert!(!cpu1.is_lazy());
    let at_resume = m.violations();
    let _ = cpu1.read(va(0));
    let after_read = m.violations()[at_resume.len()..].to_vec();
    (
        frame,
        Resume {
            at_resume,
            after_read,
        },
    )
}

#[test]
fn a_lazy_cpu_catches_up_before_it_uses_the_space() {
    let (_, caught_up) = lazy_cpu_rereads(true);
    assert_eq!(caught_up.at_resume, []);
    assert_eq!(caught_up.after_read, []);
    // Without the generation check, the oracle catches the CPU as it
    // resumes, before it touches anything, and again at the stale read.
    let (frame, missed) = lazy_cpu_rereads(false);
    let cpu = CpuId::new(1).expect("a CPU");
    assert_eq!(
        missed.at_resume,
        [Violation::LazyResumedWithStale {
            cpu,
            frame,
            va: va(0),
            writable: false,
        }]
    );
    assert_eq!(
        missed.after_read,
        [Violation::ReadOfFreeFrame {
            cpu,
            frame,
            va: va(0)
        }]
    );
}

#[test]
fn the_calibration_holds() {
    for cpus in CAL_CPUS {
        for tasks in [Tasks::Processes, Tasks::Threads] {
            let (lo, hi) = measured(cpus, tasks).expect("a measured cell");
            let f = run(cpus, tasks, Peer::Linux61);
            let ratio = f.per_page(f.ipis) / ((lo + hi) / 2.0);
            assert!((ratio - 1.0).abs() <= 0.35, "{cpus} {}: {ratio:.2}", tasks.name());
        }
    }
}

/// The pooled policy on 8 CPUs: far fewer IPIs than Linux 6.1's policy,
/// most frames released by the CPUs' own flushes, the oracle quiet. The
/// pages it reclaims were aged a whole LRU cycle before, so most
/// generations wait only for flushes the CPUs made since (switches to
/// idle), and even with timer ticks so rare that none comes during the run
/// the CPUs' switches release them.
#[test]
fn the_pool_releases_frames_at_the_cpus_own_flushes() {
    for tasks in [Tasks::Processes, Tasks::Threads] {
        let linux = run_seed::<X86Like>(8, tasks, Peer::Linux61, SEEDS[0], true, TIMER_TICKS);
        let pool = run_seed::<X86Like>(8, tasks, Peer::TlbBatchPool, SEEDS[0], true, TIMER_TICKS);
        assert_eq!(pool.violations, 0);
        assert!(
            pool.ipis * 5 < linux.ipis,
            "{}: {} vs {}",
            tasks.name(),
            pool.ipis,
            linux.ipis
        );
        assert!(pool.released_by_passes * 2 > pool.pooled);
        let rare = run_seed::<X86Like>(8, tasks, Peer::TlbBatchPool, SEEDS[0], true, 1 << 40);
        assert_eq!(rare.violations, 0);
        assert_eq!(rare.quiescent_flushes, 0, "{}", tasks.name());
        assert!(rare.released_by_passes * 2 > rare.pooled, "{}", tasks.name());
        assert!(rare.ipis * 5 < linux.ipis, "{}", tasks.name());
    }
}
