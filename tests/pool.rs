//! FramePool against the mock machine: pooled frames come back with no IPI
//! once every CPU that could cache them has flushed on its own
//! (quiescent_flush, an untagged switch, coming online) and never before;
//! `flush` interrupts only the CPUs still owed; refusals and failed flushes
//! change nothing; and the oracle watches every free.

mod common;

use common::{asid, config, owned, va};
use tlb_batch::arch::mock::{
    Arm64Like, FrameState, MockConfig, MockKernel, MockMachine, MockRmap, Violation,
};
use tlb_batch::{
    flush_tlb_batched_pending, quiescent_flush, shrink_page_list, shrink_page_list_pooled, Arch, CpuSet,
    Error, Flushed, Frame, FramePool, FreeFrames, MappingFlags, OwnedFrame, PoolRefusal, ReclaimSummary,
    ShootdownReport, TtuFlags, UnmapBatch, Unmapped, Verdict,
};

/// One address space per CPU of `cpus`, each with `per` clean read-only
/// pages that its CPU read (so caches) and that were aged afterwards.
/// Returns the reverse map and each space's frames.
fn procs<'m>(m: &'m MockMachine, cpus: &[usize], per: usize) -> (MockRmap<'m>, Vec<Vec<Frame>>) {
    let spaces = (0..cpus.len())
        .map(|i| m.space(&m.new_mm(asid(i as u16 + 1)).unwrap()))
        .collect();
    let rmap = MockRmap::new(m, spaces);
    let mut frames = Vec::new();
    for (s, &c) in cpus.iter().enumerate() {
        let (cpu, mm) = (m.cpu(c).unwrap(), rmap.spaces()[s].mm());
        cpu.switch_to(mm).unwrap();
        let list: Vec<Frame> = (0..per)
            .map(|i| {
                let f = m.alloc_frame().unwrap();
                rmap.map(f, s, va(i), false, MappingFlags::empty()).unwrap();
                cpu.read(va(i)).unwrap();
                m.test_and_clear_accessed(mm, va(i)).unwrap();
                f
            })
            .collect();
        frames.push(list);
    }
    (rmap, frames)
}

/// Unmaps `frames` from CPU 0 into `batch`: every mapping goes, with its
/// flush deferred.
fn unmap<const N: usize>(m: &MockMachine, rmap: &MockRmap<'_>, frames: &[Frame], batch: &mut UnmapBatch<N>) {
    for &f in frames {
        let r = batch.try_to_unmap(&m.cpu(0).unwrap(), rmap, owned(f), TtuFlags::empty());
        assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    }
}

/// Unmaps `frames` from CPU 0 and pools them in `pool` as one generation.
fn pool_them<const P: usize>(
    m: &MockMachine,
    rmap: &MockRmap<'_>,
    frames: &[Frame],
    pool: &mut FramePool<P>,
) {
    let mut batch = UnmapBatch::<16>::new();
    unmap(m, rmap, frames, &mut batch);
    assert_eq!(pool.defer(&m.cpu(0).unwrap(), &mut batch), Ok(frames.len()));
    assert!(batch.is_empty());
}

/// The CPUs of `m` numbered `cpus`.
fn set(m: &MockMachine, cpus: &[usize]) -> CpuSet {
    let mut s = CpuSet::new();
    for &c in cpus {
        s.insert(m.cpu(c).unwrap().id());
    }
    s
}

/// Frees what a pool handed back through the kernel's batched free, which
/// must take every frame; returns them in the order they came.
fn free<const N: usize>(kernel: &mut MockKernel<'_, '_>, mut released: Flushed<N>) -> Vec<Frame> {
    assert!(released.still_mapped().is_empty());
    let frames: Vec<Frame> = released.frames_mut().iter().map(|f| f.frame()).collect();
    kernel.free_batch(released.frames_mut());
    assert!(released.frames_mut().is_empty(), "the allocator took every frame");
    frames
}

/// No CPU, online or not, caches any of `frames`.
fn uncached(m: &MockMachine, frames: &[Frame]) -> bool {
    frames.iter().all(|&f| m.cached_translations(f).is_empty())
}

/// Whether every one of `frames` is in `state`.
fn all_in(m: &MockMachine, frames: &[Frame], state: FrameState) -> bool {
    frames.iter().all(|&f| m.frame_state(f).unwrap() == state)
}

/// A reclaim callback for calls that must hand nothing back.
fn no_handback(f: OwnedFrame, v: Verdict) {
    panic!("{f:?} handed back: {v:?}")
}

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

/// Test 3: with untagged TLBs a switch drops the target's entries and
/// counts as its pass (no quiescent_flush needed afterwards); with tagged
/// TLBs the entries survive the switch, so the pool keeps waiting until
/// the CPU runs quiescent_flush.
#[test]
fn an_untagged_switch_is_a_pass_and_a_tagged_one_is_not() {
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
        cpu1.switch_to(&m.new_mm(asid(9)).unwrap()).unwrap();
        if tagged {
            assert_eq!(m.cached_translations(frames[0][0]).len(), 1, "tagged: kept");
            assert!(
                pool.release_passed(&cpu0).is_empty(),
                "a tagged switch is no pass"
            );
            assert!(quiescent_flush(&cpu1));
        } else {
            assert!(uncached(&m, &frames[0]));
            assert!(!quiescent_flush(&cpu1), "the switch paid the debt");
        }
        let back = free(&mut MockKernel::new(&rmap), pool.release_passed(&cpu0));
        assert_eq!(back, frames[0], "tagged: {tagged}");
        assert_eq!(
            (m.stats().quiescent_flushes, m.ipis_sent()),
            (u64::from(tagged), 0)
        );
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
/// it: frames freed meanwhile are never reached through it.
#[test]
fn an_offline_target_is_not_waited_for_and_comes_back_flushed() {
    let m = MockMachine::new(config(3, 64)).unwrap();
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

/// Test 6: when the CPU that releases or flushes the pool could cache the
/// frames itself, it flushes itself, locally, with no IPI for it:
/// `release_passed` once CPU 1 passed, `flush` with one IPI (to CPU 1)
/// otherwise.
#[test]
fn the_releasing_cpu_flushes_itself_when_it_was_a_target() {
    for by_flush in [false, true] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let (rmap, frames) = procs(&m, &[1], 3);
        let (cpu0, cpu1, mm) = (m.cpu(0).unwrap(), m.cpu(1).unwrap(), rmap.spaces()[0].mm());
        cpu0.switch_to(mm).unwrap();
        for i in 0..3 {
            cpu0.read(va(i)).unwrap();
            m.test_and_clear_accessed(mm, va(i)).unwrap();
        }
        let mut pool = FramePool::<8>::new();
        pool_them(&m, &rmap, &frames[0], &mut pool);
        assert_eq!(pool.targets(), set(&m, &[0, 1]));
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

/// Test 7: shrink_page_list_pooled whose pool lacks room must flush it; if
/// that fails, the pool is unchanged and the call's frames come back in the
/// ReclaimRetry, whose retry flushes and frees them with no violation.
#[test]
fn a_failed_pool_flush_in_reclaim_hands_the_call_back_as_a_retry() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2], 3);
    let cpu0 = m.cpu(0).unwrap();
    let mut kernel = MockKernel::new(&rmap);
    let mut batch = UnmapBatch::<4>::new();
    let mut pool = FramePool::<4>::new();
    let mut call = |list: &[Frame]| {
        let cands = list.iter().map(|&f| owned(f));
        shrink_page_list_pooled(
            &cpu0,
            &rmap,
            &mut kernel,
            &mut batch,
            &mut pool,
            cands,
            &mut no_handback,
        )
        .map_err(Box::new)
    };
    let s = call(&frames[0]).unwrap();
    assert_eq!((s.pooled, s.freed, s.ipis_sent), (3, 0, 0));
    let r = cpu0.in_shootdown(|| call(&frames[1])).unwrap();
    let retry = r.expect_err("no room: the pool flush must fail");
    assert!(matches!(retry.error(), Some(Error::ShootdownReentered { .. })));
    assert_eq!(retry.frames(), 3);
    assert_eq!((pool.len(), pool.generations()), (3, 1));
    assert_eq!(pool.targets(), set(&m, &[1]));
    assert_eq!(kernel.frames_freed, 0);
    assert!(!uncached(&m, &frames[0]) && !uncached(&m, &frames[1]));
    let s = retry.retry(&cpu0, &mut kernel, &mut no_handback).unwrap();
    assert_eq!((s.freed, s.pooled, s.ipis_sent), (3, 0, 1));
    assert_eq!(kernel.frames_freed, 3);
    assert!(uncached(&m, &frames[1]));
    assert_eq!(pool.len(), 3, "the retry leaves the pool alone");
    assert_eq!(free(&mut kernel, pool.flush(&cpu0).unwrap()), frames[0]);
    assert_eq!(m.violations(), []);
}

/// For test 8: checks that `defer` through `m`'s CPU 0 refuses `batch` for
/// `why` and changes neither it nor `pool`; then that the batch still
/// flushes and its unmapped frames free with no violation. Returns the
/// frames that came back still mapped.
fn refused<const N: usize, const P: usize>(
    m: &MockMachine,
    rmap: &MockRmap<'_>,
    batch: &mut UnmapBatch<N>,
    pool: &mut FramePool<P>,
    why: PoolRefusal,
) -> Vec<Frame> {
    let held: Vec<Frame> = batch.held_frames().collect();
    let tlb = |b: &UnmapBatch<N>| (b.tlb_batch().pending_pages(), b.tlb_batch().targets());
    let (before, kept) = (tlb(batch), (pool.len(), pool.generations(), pool.targets()));
    let pooled_before = m.stats().frames_pooled;
    assert_eq!(pool.defer(&m.cpu(0).unwrap(), batch), Err(why));
    assert_eq!(batch.held_frames().collect::<Vec<_>>(), held);
    assert_eq!(tlb(batch), before);
    assert_eq!((pool.len(), pool.generations(), pool.targets()), kept);
    assert_eq!(m.stats().frames_pooled, pooled_before);
    let flushed = batch.flush(&m.cpu(0).unwrap()).unwrap();
    assert!(flushed.report().ipis_sent > 0, "the batch still owed its flush");
    let (mut unmapped, mapped) = flushed.into_parts();
    MockKernel::new(rmap).free_batch(&mut unmapped);
    assert!(unmapped.is_empty());
    assert_eq!(m.violations(), [], "{why:?}");
    mapped.into_iter().map(|(f, _)| f.into_frame()).collect()
}

/// Test 8: a batch with a frame still mapped elsewhere, or a writable
/// (clean or dirty) deferred mapping, or kernel pages, is refused with the
/// matching PoolRefusal and stays exactly as it was.
#[test]
fn mapped_writable_and_kernel_batches_are_refused_unchanged() {
    // StillMapped: F lost its mapping in space 0 (CPU 1 caches it) but is
    // young in space 1 (CPU 2 just used it), so the unmap stops there.
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2], 1);
    let f = m.alloc_frame().unwrap();
    for s in 0..2 {
        rmap.map(f, s, va(5), false, MappingFlags::SHARED).unwrap();
        m.cpu(s + 1).unwrap().read(va(5)).unwrap();
    }
    m.test_and_clear_accessed(rmap.spaces()[0].mm(), va(5)).unwrap();
    let mut batch = UnmapBatch::<4>::new();
    unmap(&m, &rmap, &frames[0], &mut batch);
    let r = batch.try_to_unmap(&m.cpu(0).unwrap(), &rmap, owned(f), TtuFlags::empty());
    assert!(matches!(r, Ok(Unmapped::HeldMapped(_))), "{r:?}");
    let mut pool = FramePool::<8>::new();
    assert_eq!(
        refused(&m, &rmap, &mut batch, &mut pool, PoolRefusal::StillMapped),
        [f]
    );
    assert!(m.pte(rmap.spaces()[1].mm(), va(5)).unwrap().maps(f));

    // Writable: a writable mapping CPU 1 only read (clean), or wrote (dirty).
    for write in [false, true] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let (rmap, _) = procs(&m, &[1], 0);
        let f = m.alloc_frame().unwrap();
        rmap.map(f, 0, va(0), true, MappingFlags::empty()).unwrap();
        if write {
            m.cpu(1).unwrap().write(va(0), 7).unwrap();
        } else {
            m.cpu(1).unwrap().read(va(0)).unwrap();
        }
        m.test_and_clear_accessed(rmap.spaces()[0].mm(), va(0)).unwrap();
        let mut batch = UnmapBatch::<4>::new();
        unmap(&m, &rmap, &[f], &mut batch);
        refused(
            &m,
            &rmap,
            &mut batch,
            &mut FramePool::<8>::new(),
            PoolRefusal::Writable,
        );
    }

    // Kernel: a read-only kernel page (a global entry) CPU 1 cached.
    let m = MockMachine::new(config(2, 64)).unwrap();
    let rmap = MockRmap::new(&m, vec![m.space(m.kernel_mm())]);
    const KVA: u64 = 0xffff_8000_0040_0000;
    let f = m.alloc_frame().unwrap();
    rmap.map(f, 0, KVA, false, MappingFlags::empty()).unwrap();
    m.cpu(1).unwrap().read(KVA).unwrap();
    m.test_and_clear_accessed(m.kernel_mm(), KVA).unwrap();
    let mut batch = UnmapBatch::<4>::new();
    unmap(&m, &rmap, &[f], &mut batch);
    assert_eq!(batch.tlb_batch().targets(), set(&m, &[0, 1]));
    refused(
        &m,
        &rmap,
        &mut batch,
        &mut FramePool::<8>::new(),
        PoolRefusal::Kernel,
    );
}

/// Test 8: a batch larger than the room left is refused as NoRoom with that
/// room, the pool keeping what it had; a batch or a pool of another machine
/// is refused as OtherMachine, and `release_passed` and `flush` through
/// another machine's CPU do nothing.
#[test]
fn no_room_and_other_machine_are_refused_unchanged() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2], 3);
    let cpu0 = m.cpu(0).unwrap();
    let mut pool = FramePool::<3>::new();
    pool_them(&m, &rmap, &frames[0][..1], &mut pool);
    let mut batch = UnmapBatch::<4>::new();
    unmap(&m, &rmap, &frames[1], &mut batch);
    refused(&m, &rmap, &mut batch, &mut pool, PoolRefusal::NoRoom { room: 2 });

    // The pool holds m's frame: a second machine's batch, through its CPU.
    let m2 = MockMachine::new(config(3, 64)).unwrap();
    let (rmap2, frames2) = procs(&m2, &[1], 2);
    let mut batch2 = UnmapBatch::<4>::new();
    unmap(&m2, &rmap2, &frames2[0], &mut batch2);
    refused(&m2, &rmap2, &mut batch2, &mut pool, PoolRefusal::OtherMachine);
    let cpu0_2 = m2.cpu(0).unwrap();
    assert!(pool.release_passed(&cpu0_2).is_empty());
    assert_eq!(pool.flush(&cpu0_2).map(|f| f.len()), Err(Error::OtherMachine));
    assert_eq!(pool.len(), 1);
    // m's batch offered through m2's CPU, to an empty pool.
    let mut empty = FramePool::<8>::new();
    unmap(&m, &rmap, &frames[0][1..], &mut batch);
    assert_eq!(empty.defer(&cpu0_2, &mut batch), Err(PoolRefusal::OtherMachine));
    assert!(empty.is_empty());
    assert_eq!((batch.len(), batch.tlb_batch().pending_pages()), (2, 2));
    refused(
        &m,
        &rmap,
        &mut batch,
        &mut FramePool::<1>::new(),
        PoolRefusal::NoRoom { room: 1 },
    );
    assert_eq!(
        free(&mut MockKernel::new(&rmap), pool.flush(&cpu0).unwrap()),
        frames[0][..1]
    );
    assert_eq!((m.violations(), m2.violations()), (vec![], vec![]));
}

/// The script of test 9 on a fresh machine: 24 clean read-only pages of
/// three processes (CPUs 1-3) reclaimed by CPU 0 in six calls of four (each
/// call drawing on all three), CPUs ticking (quiescent_flush) after some
/// calls, then one call with a dirty page, then the pool is released and
/// flushed. Checks that every frame is freed exactly once (none handed back)
/// and the oracle saw nothing; returns the IPIs sent and each call's summary.
fn reclaim_script(pool_it: bool) -> (u64, Vec<ReclaimSummary>) {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2, 3], 8);
    let dirty = m.alloc_frame().unwrap();
    rmap.map(dirty, 0, va(20), true, MappingFlags::empty()).unwrap();
    m.cpu(1).unwrap().write(va(20), 5).unwrap();
    m.test_and_clear_accessed(rmap.spaces()[0].mm(), va(20)).unwrap();
    let order: Vec<Frame> = (0..8).flat_map(|i| frames.iter().map(move |l| l[i])).collect();
    let mut calls: Vec<Vec<Frame>> = order.chunks(4).map(<[Frame]>::to_vec).collect();
    calls.push(vec![dirty]);
    let ticks: [&[usize]; 7] = [&[], &[], &[1, 2, 3], &[1], &[], &[], &[1, 2, 3]];
    let cpu0 = m.cpu(0).unwrap();
    let mut kernel = MockKernel::new(&rmap);
    let (mut batch, mut pool) = (UnmapBatch::<4>::new(), FramePool::<8>::new());
    let mut summaries = Vec::new();
    for (list, tick) in calls.iter().zip(ticks) {
        let (k, b, h) = (&mut kernel, &mut batch, &mut no_handback);
        let cands = list.iter().map(|&f| owned(f));
        let s = if pool_it {
            shrink_page_list_pooled(&cpu0, &rmap, k, b, &mut pool, cands, h)
        } else {
            shrink_page_list(&cpu0, &rmap, k, b, cands, h)
        };
        summaries.push(s.unwrap());
        for &c in tick {
            quiescent_flush(&m.cpu(c).unwrap());
        }
    }
    let mut drained = free(&mut kernel, pool.release_passed(&cpu0)).len();
    drained += free(&mut kernel, pool.flush(&cpu0).unwrap()).len();
    let freed: usize = summaries.iter().map(|s| s.freed).sum::<usize>() + drained;
    assert_eq!((freed, kernel.frames_freed), (25, 25), "pooled: {pool_it}");
    assert!(all_in(&m, &order, FrameState::Free) && all_in(&m, &[dirty], FrameState::Free));
    assert_eq!((kernel.page_outs, summaries[6].paged_out), (1, 1));
    assert_eq!(m.violations(), [], "pooled: {pool_it}");
    let s = m.stats();
    let expected = if pool_it { (24, 12, 7) } else { (0, 0, 0) };
    assert_eq!(
        (s.frames_pooled, s.frames_released_by_passes, s.quiescent_flushes),
        expected
    );
    (m.ipis_sent(), summaries)
}

/// Test 9: shrink_page_list_pooled end to end. The pool fills, is flushed
/// when it lacks room, releases generations the CPUs' ticks passed, and
/// leaves a dirty page to the usual path; every frame is freed exactly once,
/// with zero violations and fewer IPIs than shrink_page_list on the same
/// script.
#[test]
fn pooled_reclaim_over_several_calls_frees_everything_with_fewer_ipis() {
    let (plain_ipis, plain) = reclaim_script(false);
    let (pooled_ipis, pooled) = reclaim_script(true);
    assert_eq!(plain_ipis, 6 * 3 + 1);
    assert!(plain.iter().all(|s| s.pooled == 0));
    let col = |f: fn(&ReclaimSummary) -> usize| pooled.iter().map(f).collect::<Vec<_>>();
    // Calls 3 and 6 find the pool full. Call 3 flushes both generations
    // (the second's CPUs are interrupted for the first anyway: 3 IPIs);
    // call 6 only the oldest one, enough for its four frames (2 IPIs: CPU 1
    // passed it at the tick after call 4), and leaves the younger one to
    // the CPUs' ticks. Call 4 gets the generation every CPU passed back for
    // free; the dirty call 7 pools nothing and pays its own dirty flush.
    assert_eq!(col(|s| s.pooled), [4, 4, 4, 4, 4, 4, 0]);
    assert_eq!(col(|s| s.freed), [0, 0, 8, 4, 0, 4, 1]);
    assert_eq!(col(|s| s.ipis_sent), [0, 0, 3, 0, 0, 2, 1]);
    // The rest went back through the final ticks: no IPI.
    assert_eq!(pooled_ipis, 6);
    assert!(pooled_ipis < plain_ipis);
}

/// Test 10 (contract rule 5): pooling leaves the address space marked, so a
/// change of its mappings first flushes it (Ok(true)), after which no CPU
/// caches the pooled pages; the pool still owns the frames until released.
#[test]
fn pooled_pages_still_owe_the_rule_5_flush() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1], 3);
    let (cpu0, mm) = (m.cpu(0).unwrap(), rmap.spaces()[0].mm());
    let mut pool = FramePool::<8>::new();
    pool_them(&m, &rmap, &frames[0], &mut pool);
    assert!(mm.batched_flush_pending());
    assert_eq!(flush_tlb_batched_pending(&cpu0, mm), Ok(true));
    assert_eq!(m.ipis_sent(), 1);
    assert!(uncached(&m, &frames[0]));
    assert_eq!(flush_tlb_batched_pending(&cpu0, mm), Ok(false));
    assert_eq!(pool.len(), 3);
    assert!(all_in(&m, &frames[0], FrameState::InUse));
    assert_eq!(
        free(&mut MockKernel::new(&rmap), pool.flush(&cpu0).unwrap()),
        frames[0]
    );
    assert_eq!(m.violations(), []);
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

/// With every generation slot taken, a further batch joins the newest
/// generation, which then waits for both batches' CPUs and the later epoch.
#[test]
fn a_batch_beyond_the_last_generation_joins_the_newest() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let n = tlb_batch::POOL_GENERATIONS;
    let (rmap, frames) = procs(&m, &[1, 2], n);
    let cpu0 = m.cpu(0).unwrap();
    let mut pool = FramePool::<64>::new();
    for &f in &frames[0] {
        pool_them(&m, &rmap, &[f], &mut pool);
    }
    assert_eq!(pool.generations(), n);
    pool_them(&m, &rmap, &frames[1][..1], &mut pool);
    assert_eq!((pool.generations(), pool.len()), (n, n + 1));
    // CPU 1 passing releases all but the newest, which CPU 2 also owes.
    assert!(quiescent_flush(&m.cpu(1).unwrap()));
    let mut kernel = MockKernel::new(&rmap);
    assert_eq!(free(&mut kernel, pool.release_passed(&cpu0)), frames[0][..n - 1]);
    assert_eq!(pool.len(), 2);
    assert!(quiescent_flush(&m.cpu(2).unwrap()));
    let rest = free(&mut kernel, pool.release_passed(&cpu0));
    assert_eq!(rest, [frames[0][n - 1], frames[1][0]]);
    assert_eq!((m.ipis_sent(), m.violations()), (0, vec![]));
}

/// A reclaim call the pool would refuse whatever its room (here: more
/// frames than the whole pool holds) does not flush the pool first: it
/// takes the usual path, one shootdown, and the pool keeps its frames.
#[test]
fn a_call_the_pool_cannot_take_does_not_empty_it() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2], 3);
    let cpu0 = m.cpu(0).unwrap();
    let mut pool = FramePool::<2>::new();
    pool_them(&m, &rmap, &frames[0][..2], &mut pool);
    let mut kernel = MockKernel::new(&rmap);
    let mut batch = UnmapBatch::<4>::new();
    let s = shrink_page_list_pooled(
        &cpu0,
        &rmap,
        &mut kernel,
        &mut batch,
        &mut pool,
        frames[1].iter().map(|&f| owned(f)),
        &mut no_handback,
    )
    .unwrap();
    assert_eq!((s.pooled, s.freed, s.shootdowns, s.ipis_sent), (0, 3, 1, 1));
    assert_eq!(pool.len(), 2, "the pool was not flushed for nothing");
    assert_eq!(free(&mut kernel, pool.flush(&cpu0).unwrap()), frames[0][..2]);
    assert_eq!(m.violations(), []);
}

/// Runs `shrink_page_list_pooled` from CPU 0 over `list` with a batch of
/// four, collecting what it hands back.
fn reclaim_into<const P: usize>(
    m: &MockMachine,
    rmap: &MockRmap<'_>,
    kernel: &mut MockKernel<'_, '_>,
    pool: &mut FramePool<P>,
    list: &[Frame],
) -> (ReclaimSummary, Vec<(OwnedFrame, Verdict)>) {
    let mut batch = UnmapBatch::<4>::new();
    let mut back = Vec::new();
    let s = shrink_page_list_pooled(
        &m.cpu(0).unwrap(),
        rmap,
        kernel,
        &mut batch,
        pool,
        list.iter().map(|&f| owned(f)),
        &mut |f, v| back.push((f, v)),
    )
    .unwrap();
    (s, back)
}

/// A reclaim call whose frames take exactly the room the pool has left
/// goes into the pool without flushing any of it: no IPI, and no batch
/// flushed (a pool flush for zero frames would send nothing either, but
/// still counts as one).
#[test]
fn a_call_that_exactly_fills_the_pool_flushes_none_of_it() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2], 2);
    let mut pool = FramePool::<4>::new();
    pool_them(&m, &rmap, &frames[0], &mut pool);
    let mut kernel = MockKernel::new(&rmap);
    let (s, back) = reclaim_into(&m, &rmap, &mut kernel, &mut pool, &frames[1]);
    assert!(back.is_empty());
    assert_eq!((s.pooled, s.freed, s.shootdowns, s.ipis_sent), (2, 0, 0, 0));
    assert_eq!((pool.len(), pool.room(), pool.generations()), (4, 0, 2));
    assert_eq!((m.ipis_sent(), m.stats().batches_flushed), (0, 0));
    let cpu0 = m.cpu(0).unwrap();
    assert_eq!(free(&mut kernel, pool.flush(&cpu0).unwrap()), frames.concat());
    assert_eq!(m.violations(), []);
}

/// A reclaim call one slot short flushes only as many of the oldest
/// generations as that slot takes: the oldest (CPU 1's two frames, one
/// IPI) is enough, and CPU 2's younger generation keeps waiting for CPU 2's
/// own flush, with no IPI to it.
#[test]
fn a_call_short_of_room_flushes_only_the_generations_it_needs() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2, 3], 2);
    let mut pool = FramePool::<4>::new();
    pool_them(&m, &rmap, &frames[0], &mut pool);
    pool_them(&m, &rmap, &frames[1][..1], &mut pool);
    assert_eq!(pool.room(), 1);
    let mut kernel = MockKernel::new(&rmap);
    let (s, back) = reclaim_into(&m, &rmap, &mut kernel, &mut pool, &frames[2]);
    assert!(back.is_empty());
    assert_eq!((s.pooled, s.freed, s.shootdowns, s.ipis_sent), (2, 2, 1, 1));
    assert_eq!((m.ipis_sent(), kernel.frames_freed), (1, 2));
    assert!(all_in(&m, &frames[0], FrameState::Free));
    assert!(!uncached(&m, &frames[1][..1]), "CPU 2 was not interrupted");
    assert_eq!((pool.len(), pool.generations()), (3, 2));
    assert_eq!(pool.targets(), set(&m, &[2, 3]));
    let cpu0 = m.cpu(0).unwrap();
    let rest = free(&mut kernel, pool.flush(&cpu0).unwrap());
    assert_eq!(rest, [&frames[1][..1], &frames[2][..]].concat());
    assert_eq!(m.violations(), []);
}

/// Pooled frames released during a reclaim call that the allocator then
/// refuses go back to the caller as `FreeRefused`, each counted once as
/// handed back and none as freed; the call's own frames are pooled as
/// usual, and the refused ones can be freed later.
#[test]
fn released_frames_the_allocator_refuses_are_handed_back_and_counted() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2], 3);
    let mut pool = FramePool::<8>::new();
    pool_them(&m, &rmap, &frames[0], &mut pool);
    assert!(quiescent_flush(&m.cpu(1).unwrap()));
    let mut kernel = MockKernel::new(&rmap);
    kernel.refuse_frees = true;
    let (s, back) = reclaim_into(&m, &rmap, &mut kernel, &mut pool, &frames[1]);
    assert_eq!((s.scanned, s.freed, s.handed_back, s.pooled), (3, 0, 3, 3));
    assert_eq!((kernel.free_calls, kernel.frames_freed), (1, 0));
    assert!(back.iter().all(|(_, v)| *v == Verdict::FreeRefused));
    let mut returned: Vec<Frame> = back.iter().map(|(f, _)| f.frame()).collect();
    returned.sort();
    let mut expected = frames[0].clone();
    expected.sort();
    assert_eq!(returned, expected);
    assert!(all_in(&m, &frames[0], FrameState::InUse));
    kernel.refuse_frees = false;
    let mut again: tlb_batch::heapless::Vec<OwnedFrame, 4> = back.into_iter().map(|(f, _)| f).collect();
    kernel.free_batch(&mut again);
    assert!(again.is_empty() && all_in(&m, &frames[0], FrameState::Free));
    let cpu0 = m.cpu(0).unwrap();
    assert_eq!(free(&mut kernel, pool.flush(&cpu0).unwrap()), frames[1]);
    assert_eq!(m.violations(), []);
}

/// With tagged TLBs, a CPU asked to flush the address space it has loaded
/// still holds entries of the one it ran before: that flush is no pass.
#[test]
fn with_tagged_tlbs_flushing_the_loaded_space_is_no_pass() {
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(2, 64)
    })
    .unwrap();
    let (rmap, frames) = procs(&m, &[1], 2);
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    let other = m.new_mm(asid(9)).unwrap();
    cpu1.switch_to(&other).unwrap();
    let mut pool = FramePool::<8>::new();
    pool_them(&m, &rmap, &frames[0], &mut pool);
    tlb_batch::flush_tlb_mm(&cpu0, &other).unwrap();
    assert!(!uncached(&m, &frames[0]), "CPU 1 keeps the first space's entries");
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

/// What a pool says of itself, and what its flushes count: `Debug` names
/// its frames, generations and targets; a flush of a pool holding frames
/// counts one flushed batch, a flush of an empty one none.
#[test]
fn a_pool_reports_what_it_holds_and_counts_its_flushes() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2], 1);
    let cpu0 = m.cpu(0).unwrap();
    let mut pool = FramePool::<8>::new();
    assert_eq!(pool.flush(&cpu0).map(|f| f.len()), Ok(0));
    assert_eq!(m.stats().batches_flushed, 0, "an empty pool flushes no batch");
    pool_them(&m, &rmap, &frames.concat(), &mut pool);
    let shown = format!("{pool:?}");
    assert!(shown.starts_with("FramePool"), "{shown}");
    assert!(
        shown.contains("frames: 2") && shown.contains("generations: 1"),
        "{shown}"
    );
    let before = m.stats().batches_flushed;
    let back = free(&mut MockKernel::new(&rmap), pool.flush(&cpu0).unwrap());
    assert_eq!(back, frames.concat());
    assert_eq!(m.stats().batches_flushed, before + 1);
    assert_eq!(m.violations(), []);
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
