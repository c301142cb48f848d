//! FramePool against the mock machine, what it takes and how reclaim uses
//! it: refusals (a frame still mapped, writable or kernel batches, no room,
//! another machine) and failed flushes change nothing; a reclaim call flushes
//! only the generations it needs room for; a batch beyond the last
//! generation joins the newest; frames the allocator refuses are handed
//! back; and the pool reports what it holds. Passes are in `pool_passes.rs`.

mod common;

use common::pool::{all_in, free, pool_them, procs, set, uncached, unmap};
use common::{config, owned, va};
use tlb_batch::arch::mock::{FrameState, MockKernel, MockMachine, MockRmap};
use tlb_batch::{
    flush_tlb_batched_pending, quiescent_flush, shrink_page_list, shrink_page_list_pooled, Error, Frame,
    FramePool, FreeFrames, MappingFlags, OwnedFrame, PoolRefusal, ReclaimSummary, TtuFlags, UnmapBatch,
    Unmapped, Verdict,
};

/// A reclaim callback for calls that must hand nothing back.
fn no_handback(f: OwnedFrame, v: Verdict) {
    panic!("{f:?} handed back: {v:?}")
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

/// A batch that joins the newest generation keeps that generation's
/// "more address spaces than it names". CPUs 1 to 9 each run a space of
/// their own; the newest generation holds a page of each (more ASIDs than
/// a request names, so the ninth is known only as "many"), and a batch of
/// the first space then joins it. Once CPUs 1 to 8 have passed, the
/// fifteen older generations (the first space's alone) come back, but
/// the joined one must wait for CPU 9, which runs the ninth space and
/// still caches its page. Pins the `|=` of `Generation::merge_asids`:
/// losing "many" would free that page while CPU 9 caches it.
#[test]
fn a_joined_generation_keeps_the_spaces_it_could_not_name() {
    let spaces = tlb_batch::MAX_FLUSH_ASIDS + 1;
    let m = MockMachine::new(config(spaces + 1, 64)).unwrap();
    let n = tlb_batch::POOL_GENERATIONS;
    let cpus: Vec<usize> = (1..=spaces).collect();
    let (rmap, frames) = procs(&m, &cpus, n + 1);
    let cpu0 = m.cpu(0).unwrap();
    let mut pool = FramePool::<64>::new();
    for &f in &frames[0][..n - 1] {
        pool_them(&m, &rmap, &[f], &mut pool);
    }
    let newest: Vec<Frame> = frames.iter().map(|list| list[n - 1]).collect();
    pool_them(&m, &rmap, &newest, &mut pool);
    pool_them(&m, &rmap, &frames[0][n..], &mut pool);
    assert_eq!((pool.generations(), pool.len()), (n, n + spaces));
    for &c in &cpus[..spaces - 1] {
        assert!(quiescent_flush(&m.cpu(c).unwrap()));
    }
    let last = newest[spaces - 1];
    assert!(!m.cached_translations(last).is_empty(), "CPU 9 caches it");
    let mut kernel = MockKernel::new(&rmap);
    let back = free(&mut kernel, pool.release_passed(&cpu0));
    assert_eq!(m.violations(), []);
    assert_eq!(back, frames[0][..n - 1], "only the first space's generations");
    assert_eq!(pool.len(), spaces + 1);
    assert!(quiescent_flush(&m.cpu(spaces).unwrap()));
    let rest = free(&mut kernel, pool.release_passed(&cpu0));
    assert_eq!(m.violations(), []);
    assert_eq!(rest.len(), spaces + 1);
    assert_eq!(m.ipis_sent(), 0);
}
