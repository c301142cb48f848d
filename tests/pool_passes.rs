//! FramePool against the mock machine, what counts as a pass: pooled
//! frames come back with no IPI once every CPU that could cache them has
//! flushed on its own (quiescent_flush, an untagged switch, a full flush,
//! coming online) and never before, generations in any order; `flush`
//! interrupts only the CPUs still owed, also for a generation of no frames;
//! and the oracle watches every free. Refusals, room and reclaim are in
//! `pool_room.rs`.

mod common;

use common::pool::{all_in, free, pool_them, procs, set, uncached};
use common::{asid, config, owned, va};
use tlb_batch::arch::mock::{
    Arm64Like, FrameState, MockConfig, MockKernel, MockMachine, MockRmap, Violation,
};
use tlb_batch::{
    quiescent_flush, Arch, Error, Frame, FramePool, MappingFlags, ShootdownReport, TtuFlags, UnmapBatch,
    Unmapped,
};

/// The common start: CPUs 1-3 each run a process whose `per` pages they
/// cache; CPU 0 unmaps them all into one batch and pools it, sending no IPI.
fn pooled(per: usize, body: impl FnOnce(&MockMachine, &MockRmap<'_>, &[Vec<Frame>], FramePool<16>)) {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2, 3], per);
    let mut pool = FramePool::new();
    pool_them(&m, &rmap, &frames.concat(), &mut pool);
    assert_eq!((pool.len(), pool.generations()), (3 * per, 1));
    assert_eq!(pool.targets(), set(&m, &[1, 2, 3]));
    assert_eq!(m.ipis_sent(), 0, "deferring into a pool sends nothing");
    body(&m, &rmap, &frames, pool);
}

/// Test 1, the happy path: the pool hands nothing back while any target
/// (after one, after two of three) may still cache the frames, then all of
/// them once the third ran quiescent_flush: no IPI ever, a clean free, and
/// counters that say so.
#[test]
fn pooled_frames_come_back_without_ipis_once_every_target_flushed() {
    pooled(2, |m, rmap, frames, mut pool| {
        let (all, cpu0) = (frames.concat(), m.cpu(0).unwrap());
        assert!(pool.release_passed(&cpu0).is_empty());
        assert!(!quiescent_flush(&cpu0), "CPU 0 is no target: nothing to do");
        for c in [1, 2] {
            let cpu = m.cpu(c).unwrap();
            assert!(quiescent_flush(&cpu));
            assert!(!quiescent_flush(&cpu), "one flush pays the debt");
            assert!(pool.release_passed(&cpu0).is_empty(), "CPU 3 may still cache");
            assert_eq!(pool.len(), 6);
        }
        assert!(!m.cached_translations(frames[2][0]).is_empty());
        assert!(quiescent_flush(&m.cpu(3).unwrap()));
        let released = pool.release_passed(&cpu0);
        assert_eq!(released.report(), ShootdownReport::default(), "no flush");
        assert!(uncached(m, &all));
        assert_eq!(free(&mut MockKernel::new(rmap), released), all, "all, in order");
        assert!(pool.is_empty() && all_in(m, &all, FrameState::Free));
        assert_eq!(m.violations(), []);
        let s = m.stats();
        assert_eq!((m.ipis_sent(), s.ipis_sent, s.shootdowns), (0, 0, 0));
        let counts = (s.frames_pooled, s.frames_released_by_passes, s.quiescent_flushes);
        assert_eq!(counts, (6, 6, 3));
    });
}

/// Test 2: the oracle is what makes test 1 mean something. Freeing the
/// frames right after `defer`, as a pool that released too early would let
/// a kernel do, is caught as FreedWhileCached on every caching CPU, and a
/// stale read then as ReadOfFreeFrame. (The same scenario without the
/// passes, forced through `flush`, is the first case of test 6: 3 IPIs, clean.)
#[test]
fn freeing_pooled_frames_before_the_passes_is_what_the_oracle_catches() {
    pooled(2, |m, _rmap, frames, pool| {
        for &f in &frames.concat() {
            m.free_frame(f).unwrap();
        }
        let seen = m.violations();
        for (s, list) in frames.iter().enumerate() {
            let cpu = m.cpu(s + 1).unwrap().id();
            for &frame in list {
                let v = Violation::FreedWhileCached {
                    frame,
                    cpu,
                    writable: false,
                };
                assert!(seen.contains(&v), "{v:?} not in {seen:?}");
            }
        }
        let _ = m.cpu(1).unwrap().read(va(0));
        let read = Violation::ReadOfFreeFrame {
            cpu: m.cpu(1).unwrap().id(),
            frame: frames[0][0],
            va: va(0),
        };
        assert!(m.violations().contains(&read));
        drop(pool); // leaks its handles to the frames freed behind its back
    });
}

/// Test 3: a CPU that switches away no longer runs the pooled frames'
/// space. With untagged TLBs the switch dropped its entries and counts as
/// its pass (no quiescent_flush needed afterwards); with tagged TLBs the
/// entries survive, but the CPU cannot use them before it flushes that
/// ASID by generation, so the pool releases the frames all the same, and
/// the CPU catches up when it returns.
#[test]
fn an_untagged_switch_is_a_pass_and_a_tagged_one_leaves_a_catch_up() {
    for tagged in [false, true] {
        let m = MockMachine::new(MockConfig {
            tagged_tlb: tagged,
            ..config(2, 64)
        })
        .unwrap();
        let (rmap, frames) = procs(&m, &[1], 3);
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        let mut pool = FramePool::<8>::new();
        pool_them(&m, &rmap, &frames[0], &mut pool);
        assert!(pool.release_passed(&cpu0).is_empty());
        let mm = cpu1.current_mm().unwrap();
        cpu1.switch_to(&m.new_mm(asid(9)).unwrap()).unwrap();
        // No flush of CPU 1's own is needed either way.
        let back = free(&mut MockKernel::new(&rmap), pool.release_passed(&cpu0));
        assert_eq!(back, frames[0], "tagged: {tagged}");
        assert_eq!(!uncached(&m, &frames[0]), tagged, "only a tagged TLB keeps them");
        assert_eq!(m.violations(), [], "tagged: {tagged}");
        // Back on the space, a tagged TLB catches up first.
        let before = m.stats().catch_ups;
        cpu1.switch_to(&mm).unwrap();
        assert_eq!(m.stats().catch_ups - before, u64::from(tagged));
        assert!(uncached(&m, &frames[0]));
        assert_eq!((m.stats().quiescent_flushes, m.ipis_sent()), (0, 0));
        assert_eq!(m.violations(), [], "tagged: {tagged}");
    }
}

/// Test 4: a flush counts only for generations deferred before it. CPU 1's
/// quiescent_flush releases generation 1; it then caches two more pages,
/// which are pooled as generation 2: its earlier flush does not cover them,
/// so they wait for its next one.
#[test]
fn a_flush_before_the_deferral_does_not_count_for_it() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1], 4);
    let (f, mm) = (&frames[0], rmap.spaces()[0].mm());
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    let mut kernel = MockKernel::new(&rmap);
    let mut pool = FramePool::<8>::new();
    pool_them(&m, &rmap, &f[..2], &mut pool);
    assert!(quiescent_flush(&cpu1));
    // The flush emptied CPU 1's TLB: it reads pages 2 and 3 again.
    for i in 2..4 {
        cpu1.read(va(i)).unwrap();
        m.test_and_clear_accessed(mm, va(i)).unwrap();
    }
    pool_them(&m, &rmap, &f[2..], &mut pool);
    assert_eq!((pool.len(), pool.generations()), (4, 2));
    assert_eq!(free(&mut kernel, pool.release_passed(&cpu0)), f[..2]);
    assert!(
        pool.release_passed(&cpu0).is_empty(),
        "its flush came before generation 2"
    );
    assert_eq!((pool.len(), pool.generations()), (2, 1));
    assert_eq!(m.cached_translations(f[2]).len(), 1);
    assert!(quiescent_flush(&cpu1));
    assert_eq!(free(&mut kernel, pool.release_passed(&cpu0)), f[2..]);
    assert_eq!(m.ipis_sent(), 0);
    assert_eq!(m.violations(), []);
}

/// Test 5: a target that goes offline is not waited for (it runs nothing,
/// stale entries and all, until it comes back), and coming online flushes
/// it: frames freed meanwhile are never reached through it. Tagged TLBs,
/// so that its user entries outlive the switch to the kernel's space that
/// going offline starts with.
#[test]
fn an_offline_target_is_not_waited_for_and_comes_back_flushed() {
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(3, 64)
    })
    .unwrap();
    let (rmap, frames) = procs(&m, &[1, 2], 2);
    let all = frames.concat();
    let (cpu0, cpu1, cpu2) = (m.cpu(0).unwrap(), m.cpu(1).unwrap(), m.cpu(2).unwrap());
    let mut pool = FramePool::<8>::new();
    pool_them(&m, &rmap, &all, &mut pool);
    assert!(quiescent_flush(&cpu1));
    assert!(
        pool.release_passed(&cpu0).is_empty(),
        "CPU 2 is online and may cache"
    );
    cpu2.go_offline();
    let released = pool.release_passed(&cpu0);
    assert_eq!(m.cached_translations(frames[1][0]).len(), 1, "CPU 2 kept it");
    assert_eq!(free(&mut MockKernel::new(&rmap), released), all);
    assert_eq!(m.violations(), []);
    cpu2.come_online();
    assert!(uncached(&m, &all));
    cpu2.switch_to(rmap.spaces()[1].mm()).unwrap();
    assert!(
        cpu2.read(va(0)).is_err(),
        "the PTE is gone: a fault, no stale hit"
    );
    assert_eq!(m.ipis_sent(), 0);
    assert_eq!(m.violations(), []);
}

/// Tests 6 and 7: `flush` interrupts only the targets that have not passed
/// (3 targets: 3, 2 or 0 IPIs as 0, 1 or 3 of them ran quiescent_flush) and
/// hands every frame back either way. Before that, while IPIs are owed, a
/// flush nested in a shootdown fails with the pool unchanged, nothing
/// freed or flushed.
#[test]
fn flush_interrupts_only_the_cpus_that_have_not_passed() {
    for passed in [&[][..], &[1], &[1, 2, 3]] {
        pooled(2, |m, rmap, frames, mut pool| {
            let (all, cpu0) = (frames.concat(), m.cpu(0).unwrap());
            for &c in passed {
                assert!(quiescent_flush(&m.cpu(c).unwrap()));
            }
            let owed = 3 - passed.len();
            if owed > 0 {
                let r = cpu0.in_shootdown(|| pool.flush(&cpu0).map(|f| f.len())).unwrap();
                assert!(matches!(r, Err(Error::ShootdownReentered { .. })), "{r:?}");
                assert_eq!((pool.len(), pool.generations()), (6, 1));
                assert_eq!(pool.targets(), set(m, &[1, 2, 3]));
                assert!(all_in(m, &all, FrameState::InUse));
                assert!(!uncached(m, &frames[2]), "nothing was flushed");
            }
            let released = pool.flush(&cpu0).unwrap();
            let report = released.report();
            assert_eq!((report.ipis_sent, report.remote_cpus), (owed, owed), "{passed:?}");
            assert!(!report.flushed_locally, "CPU 0 was no target");
            assert_eq!(m.ipis_sent(), owed as u64);
            assert!(uncached(m, &all));
            assert_eq!(free(&mut MockKernel::new(rmap), released), all);
            assert!(pool.is_empty());
            assert_eq!(m.violations(), []);
        });
    }
}

/// CPU 1's process of 2 pages, pooled; the pool keeps them, since CPU 1
/// still runs the space.
fn pooled_while_cpu1_runs(m: &MockMachine) -> (MockRmap<'_>, Vec<Vec<Frame>>, FramePool<8>) {
    let (rmap, frames) = procs(m, &[1], 2);
    let mut pool = FramePool::<8>::new();
    pool_them(m, &rmap, &frames[0], &mut pool);
    assert!(
        pool.release_passed(&m.cpu(0).unwrap()).is_empty(),
        "CPU 1 runs the space"
    );
    (rmap, frames, pool)
}

/// CPU 1's process of 3 pages, read by CPU 0 too (which runs it as well),
/// their accessed bits cleared, then pooled: the pool's generation counts
/// both CPUs as targets.
fn pooled_after_both_cpus_read(m: &MockMachine) -> (MockRmap<'_>, Vec<Vec<Frame>>, FramePool<8>) {
    let (rmap, frames) = procs(m, &[1], 3);
    let (cpu0, mm) = (m.cpu(0).unwrap(), rmap.spaces()[0].mm());
    cpu0.switch_to(mm).unwrap();
    for i in 0..3 {
        cpu0.read(va(i)).unwrap();
        m.test_and_clear_accessed(mm, va(i)).unwrap();
    }
    let mut pool = FramePool::<8>::new();
    pool_them(m, &rmap, &frames[0], &mut pool);
    assert_eq!(pool.targets(), set(m, &[0, 1]));
    (rmap, frames, pool)
}

/// Test 6: when the CPU that releases or flushes the pool could cache the
/// frames itself, it flushes itself, locally, with no IPI for it:
/// `release_passed` once CPU 1 passed, `flush` with one IPI (to CPU 1)
/// otherwise.
#[test]
fn the_releasing_cpu_flushes_itself_when_it_was_a_target() {
    for by_flush in [false, true] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let (rmap, frames, mut pool) = pooled_after_both_cpus_read(&m);
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        assert!(m
            .cached_translations(frames[0][0])
            .iter()
            .any(|e| e.0 == cpu0.id()));
        let released = if by_flush {
            pool.flush(&cpu0).unwrap()
        } else {
            assert!(quiescent_flush(&cpu1));
            pool.release_passed(&cpu0)
        };
        let report = released.report();
        assert!(report.flushed_locally, "by_flush: {by_flush}");
        assert_eq!(report.ipis_sent, usize::from(by_flush));
        assert!(uncached(&m, &frames[0]), "by_flush: {by_flush}");
        free(&mut MockKernel::new(&rmap), released);
        assert_eq!(m.ipis_sent(), u64::from(by_flush));
        assert_eq!(m.violations(), [], "by_flush: {by_flush}");
    }
}

/// Generations come back in any order: CPU 3's process was pooled first,
/// CPU 1's second; once CPU 1 alone has flushed, the younger generation
/// comes back and the older one waits for CPU 3.
#[test]
fn a_younger_generation_passed_comes_back_before_an_older_one() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 3], 2);
    let cpu0 = m.cpu(0).unwrap();
    let mut pool = FramePool::<8>::new();
    pool_them(&m, &rmap, &frames[1], &mut pool);
    pool_them(&m, &rmap, &frames[0], &mut pool);
    assert!(quiescent_flush(&m.cpu(1).unwrap()));
    let mut kernel = MockKernel::new(&rmap);
    assert_eq!(free(&mut kernel, pool.release_passed(&cpu0)), frames[0]);
    assert_eq!((pool.len(), pool.generations()), (2, 1));
    assert!(pool.release_passed(&cpu0).is_empty());
    assert!(quiescent_flush(&m.cpu(3).unwrap()));
    assert_eq!(free(&mut kernel, pool.release_passed(&cpu0)), frames[1]);
    assert_eq!((m.ipis_sent(), m.violations()), (0, vec![]));
}

/// `flush_oldest` interrupts only the CPUs the oldest generations still
/// wait for, takes along younger ones those CPUs cover, and leaves the
/// rest to the CPUs' own flushes; asking for more than the oldest holds
/// takes the next.
#[test]
fn flush_oldest_releases_the_oldest_and_what_its_cpus_cover() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2, 3], 2);
    let cpu0 = m.cpu(0).unwrap();
    let mut pool = FramePool::<8>::new();
    // Oldest: CPU 1's pages; then CPU 2's; then CPU 1's again.
    pool_them(&m, &rmap, &frames[0][..1], &mut pool);
    pool_them(&m, &rmap, &frames[1], &mut pool);
    pool_them(&m, &rmap, &frames[0][1..], &mut pool);
    let mut kernel = MockKernel::new(&rmap);
    let released = pool.flush_oldest(&cpu0, 1).unwrap();
    assert_eq!(released.report().ipis_sent, 1, "CPU 1 only");
    let mut got = free(&mut kernel, released);
    got.sort();
    let mut want = frames[0].clone();
    want.sort();
    assert_eq!(got, want, "the oldest, and the youngest that CPU 1 covers");
    assert_eq!((pool.len(), pool.generations()), (2, 1));
    assert!(!uncached(&m, &frames[1]), "CPU 2 was left alone");
    assert_eq!(free(&mut kernel, pool.flush_oldest(&cpu0, 1).unwrap()), frames[1]);
    assert_eq!((m.ipis_sent(), m.violations()), (2, vec![]));
}

/// A CPU that a shootdown asks for a full flush (of everything, or of
/// the one address space its untagged TLB holds) has flushed past every
/// pooled generation; one asked for single pages has not.
#[test]
fn a_full_flush_by_ipi_is_a_pass_and_a_page_flush_is_not() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2], 2);
    let cpu0 = m.cpu(0).unwrap();
    let mut pool = FramePool::<8>::new();
    pool_them(&m, &rmap, &frames.concat(), &mut pool);
    let (mm1, mm2) = (rmap.spaces()[0].mm(), rmap.spaces()[1].mm());
    // A page of CPU 2's space flushed on CPU 2: no pass.
    tlb_batch::flush_tlb_page(&cpu0, mm2, va(7)).unwrap();
    assert!(cpu0.shootdown_state().flush_owed(m.cpu(2).unwrap().id()));
    // CPU 1's whole space flushed on CPU 1 (untagged: all it holds).
    tlb_batch::flush_tlb_mm(&cpu0, mm1).unwrap();
    assert!(!cpu0.shootdown_state().flush_owed(m.cpu(1).unwrap().id()));
    assert!(pool.release_passed(&cpu0).is_empty(), "CPU 2 still owes");
    // CPU 2 asked to flush an address space it does not have loaded (CPU
    // 1's): it still holds its own space's entries, so no pass.
    let other = tlb_batch::FlushRequest::for_asid(mm1.asid());
    tlb_batch::shootdown(&cpu0, &set(&m, &[2]), &other).unwrap();
    assert!(cpu0.shootdown_state().flush_owed(m.cpu(2).unwrap().id()));
    assert!(pool.release_passed(&cpu0).is_empty(), "CPU 2 still owes");
    // A flush of everything is a pass.
    let mut everything = tlb_batch::FlushRequest::new();
    everything.add_everything();
    tlb_batch::shootdown(&cpu0, &set(&m, &[2]), &everything).unwrap();
    assert!(!cpu0.shootdown_state().flush_owed(m.cpu(2).unwrap().id()));
    let all = frames.concat();
    assert_eq!(free(&mut MockKernel::new(&rmap), pool.release_passed(&cpu0)), all);
    assert_eq!(m.violations(), []);
}

/// With tagged TLBs, a CPU that runs the pooled frames' space and is asked
/// to flush another space's ASID still holds the pooled entries: that
/// flush is no pass, and the pool waits.
#[test]
fn with_tagged_tlbs_flushing_another_asid_is_no_pass() {
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(2, 64)
    })
    .unwrap();
    let (rmap, frames) = procs(&m, &[1], 2);
    let cpu0 = m.cpu(0).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    let other = m.new_mm(asid(9)).unwrap();
    let mut pool = FramePool::<8>::new();
    pool_them(&m, &rmap, &frames[0], &mut pool);
    let req = tlb_batch::FlushRequest::for_asid(other.asid());
    tlb_batch::shootdown(&cpu0, &set(&m, &[1]), &req).unwrap();
    assert!(!uncached(&m, &frames[0]), "CPU 1 keeps its own space's entries");
    assert!(pool.release_passed(&cpu0).is_empty());
    assert!(quiescent_flush(&cpu1));
    assert_eq!(
        free(&mut MockKernel::new(&rmap), pool.release_passed(&cpu0)),
        frames[0]
    );
    assert_eq!(m.violations(), []);
}

/// Coming back online flushes everything (prepare_cpu_online): a pass, so
/// the generations that counted the CPU before it left come back with no
/// further flush of its own.
#[test]
fn coming_online_is_a_pass() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1], 2);
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    let mut pool = FramePool::<8>::new();
    pool_them(&m, &rmap, &frames[0], &mut pool);
    cpu1.go_offline();
    cpu1.come_online();
    assert!(!cpu0.shootdown_state().flush_owed(cpu1.id()));
    assert!(!quiescent_flush(&cpu1));
    assert_eq!(
        free(&mut MockKernel::new(&rmap), pool.release_passed(&cpu0)),
        frames[0]
    );
    assert_eq!((m.ipis_sent(), m.violations()), (0, vec![]));
}

/// On hardware where clearing an accessed bit owes a flush (arm64), a
/// batch that only aged pages carries that flush and no frame, and the
/// pool takes it as a generation of no frames. `flush` must shoot that
/// generation down too, even when the frames it already covered fill the
/// pool (found by the operation model on `Arm64Like`: `flush` stopped at
/// `N` frames and left the frameless generation owed).
#[test]
fn flush_empties_the_pool_of_a_generation_with_no_frames() {
    let m = MockMachine::<Arm64Like>::with_model(config(3, 64)).unwrap();
    let (c0, c1, c2) = (m.cpu(0).unwrap(), m.cpu(1).unwrap(), m.cpu(2).unwrap());
    let (mm1, mm2) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
    let rmap = MockRmap::new(&m, vec![m.space(&mm1), m.space(&mm2)]);
    c1.switch_to(&mm1).unwrap();
    c2.switch_to(&mm2).unwrap();
    let map = |s: usize, i: usize, cpu: &tlb_batch::arch::mock::MockCpu<'_, Arm64Like>| {
        let f = m.alloc_frame().unwrap();
        rmap.map(f, s, va(i), false, MappingFlags::empty()).unwrap();
        cpu.read(va(i)).unwrap();
        f
    };
    let frames = [map(0, 0, &c1), map(0, 1, &c1)];
    let aged = map(1, 0, &c2);

    let mut pool = FramePool::<2>::new();
    // The pool's frames first, reaching CPU 1 only: the older generation,
    // which a flush of `N` frames takes first.
    let mut batch = UnmapBatch::<4>::new();
    for f in frames {
        let r = batch.try_to_unmap(&c0, &rmap, owned(f), TtuFlags::IGNORE_ACCESS);
        assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    }
    assert_eq!(pool.defer(&c0, &mut batch), Ok(2));
    // Then the aging of a page CPU 2 caches: its flush, owed to CPU 2.
    let mut aging = UnmapBatch::<4>::new();
    let handle = owned(aged);
    aging.page_referenced(&c0, &rmap, &handle).unwrap();
    assert!(!aging.tlb_batch().is_empty(), "the aging owes a flush");
    assert_eq!(aging.held_frames().count(), 0, "and holds no frame");
    assert_eq!(pool.defer(&c0, &mut aging), Ok(0));
    assert_eq!((pool.len(), pool.room(), pool.generations()), (2, 0, 2));

    let released = pool.flush(&c0).unwrap();
    assert_eq!(released.len(), 2);
    assert!(pool.is_empty(), "still owed: {pool:?}");
    assert_eq!(pool.generations(), 0);
    // The aging's flush reached CPU 2.
    assert_eq!(m.cached_translations(aged), vec![]);
    assert!(m.violations().is_empty(), "{:?}", m.violations());
}

/// A CPU that goes lazy on the pooled frames' space is clear of their
/// generation without flushing: the pool hands them back at once, its
/// timer tick (`quiescent_flush`) does nothing while it is lazy, and it
/// flushes the space's ASID when it resumes, since the unmap advanced the
/// space's generation. Untagged and tagged TLBs alike; no IPI.
#[test]
fn a_lazy_cpu_is_clear_of_a_pooled_generation_and_its_tick_does_nothing() {
    for tagged in [false, true] {
        let m = MockMachine::new(MockConfig {
            tagged_tlb: tagged,
            ..config(2, 64)
        })
        .unwrap();
        let (rmap, frames, mut pool) = pooled_while_cpu1_runs(&m);
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        cpu1.enter_lazy().unwrap();
        assert!(!quiescent_flush(&cpu1), "a lazy CPU's tick flushes nothing");
        let back = free(&mut MockKernel::new(&rmap), pool.release_passed(&cpu0));
        assert_eq!(back, frames[0], "tagged: {tagged}");
        assert!(!uncached(&m, &frames[0]), "CPU 1 still caches them, unusably");
        assert_eq!(m.violations(), []);
        let mm = cpu1.current_mm().unwrap();
        let before = m.stats().catch_ups;
        cpu1.switch_to(&mm).unwrap();
        assert_eq!(m.stats().catch_ups - before, 1, "tagged: {tagged}");
        assert!(uncached(&m, &frames[0]));
        assert_eq!(m.violations(), []);
        assert_eq!(m.ipis_sent(), 0);
    }
}

/// A generation every target has flushed past needs no local flush from
/// the releasing CPU, even when it was a target itself: CPU 0 and CPU 1
/// both cached the frames and both ran `quiescent_flush`, so
/// `release_passed` on CPU 0 hands them back flushing nothing (pins the
/// `&&` in `release_passed`'s "the caller must still flush itself": a
/// target that is clear owes no local flush).
#[test]
fn a_releasing_target_that_already_passed_does_not_flush_again() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, frames, mut pool) = pooled_after_both_cpus_read(&m);
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    assert!(quiescent_flush(&cpu0));
    assert!(quiescent_flush(&cpu1));
    let before = m.stats();
    let released = pool.release_passed(&cpu0);
    assert_eq!(released.report(), ShootdownReport::default(), "no flush at all");
    assert_eq!(free(&mut MockKernel::new(&rmap), released), frames[0]);
    assert_eq!(m.violations(), []);
    let after = m.stats();
    assert_eq!(after.local_full_flushes, before.local_full_flushes);
    assert_eq!(after.local_page_flushes, before.local_page_flushes);
    assert_eq!(m.ipis_sent(), 0);
}

/// On a tagged TLB, a CPU that runs an address space other than the
/// generation's is clear of it even though it never flushed that other
/// space since the unmap: CPU 1 loaded ASID 9 before it ran the pooled
/// frames' space, and returns to it with nothing to catch up, so its
/// generation of ASID 9 is older than the pool's epoch. Only the
/// generation's own spaces count (pins `Generation::names`: answering
/// true for every ASID would keep the frames waiting for a flush of a
/// space that never held them).
#[test]
fn a_tagged_cpu_back_on_an_unrelated_space_is_clear_without_flushing_it() {
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(2, 64)
    })
    .unwrap();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    let other = m.new_mm(asid(9)).unwrap();
    cpu1.switch_to(&other).unwrap();
    let (rmap, frames, mut pool) = pooled_while_cpu1_runs(&m);
    let before = m.stats().catch_ups;
    cpu1.switch_to(&other).unwrap();
    assert_eq!(m.stats().catch_ups, before, "ASID 9 had nothing to catch up");
    assert!(!uncached(&m, &frames[0]), "CPU 1 keeps the entries, unusably");
    let back = free(&mut MockKernel::new(&rmap), pool.release_passed(&cpu0));
    assert_eq!(back, frames[0]);
    assert_eq!(m.violations(), []);
    assert_eq!((m.stats().quiescent_flushes, m.ipis_sent()), (0, 0));
}

/// On a tagged TLB, a CPU that runs the generation's space again, after
/// catching up on it by generation (it left and came back), is clear of
/// the generation without a whole-TLB flush: it flushed that space's ASID
/// past the epoch. The pool hands the frames back with no IPI and no
/// `quiescent_flush` (pins the `(Some(a), None)` arm of
/// `Generation::clear_on`: without it the frames would wait for a pass).
#[test]
fn a_tagged_cpu_that_caught_up_on_the_space_it_runs_is_clear() {
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(2, 64)
    })
    .unwrap();
    let (rmap, frames, mut pool) = pooled_while_cpu1_runs(&m);
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    let mm = cpu1.current_mm().unwrap();
    cpu1.switch_to(&m.new_mm(asid(9)).unwrap()).unwrap();
    let before = m.stats().catch_ups;
    cpu1.switch_to(&mm).unwrap();
    assert_eq!(m.stats().catch_ups - before, 1, "the return flushed ASID 1");
    assert!(uncached(&m, &frames[0]));
    assert!(cpu0.shootdown_state().flush_owed(cpu1.id()), "no pass");
    let back = free(&mut MockKernel::new(&rmap), pool.release_passed(&cpu0));
    assert_eq!(back, frames[0]);
    assert_eq!(m.violations(), []);
    assert_eq!((m.stats().quiescent_flushes, m.ipis_sent()), (0, 0));
}
