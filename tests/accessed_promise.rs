//! The accessed-bit promise (`Arch::fill_sets_accessed`) against the
//! frame pool: without it a pooled reclaim still frees every frame, with
//! no violation and no IPI, only through flushes made after the unmap
//! instead of through aging epochs; and a kernel that claims it on
//! hardware whose fills leave the bit clear is caught by the oracle, while
//! the same hardware unclaimed is safe.

mod common;

use std::sync::Arc;

use common::{asid, config, owned, va};
use tlb_batch::arch::mock::{
    FrameState, MockKernel, MockMachine, MockRmap, Model, Violation, X86Like, X86NoAccessedPromise,
};
use tlb_batch::{
    page_referenced, quiescent_flush, shrink_page_list_pooled, Arch, Flushed, Frame, FramePool, FreeFrames,
    MappingFlags, MmTlbState, Rmap, TlbFlushUnmapBatch, TtuFlags, UnmapBatch, Unmapped, Verdict,
};

/// Hardware whose read fills cache a translation and leave its accessed
/// bit clear, under a kernel that claims the opposite: the wrong claim.
#[derive(Debug)]
struct FalseClaim;

impl Model for FalseClaim {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;
    const BROADCAST_INVALIDATE: bool = false;
    const FILL_SETS_ACCESSED: bool = true;
    const FILL_SKIPS_ACCESSED: bool = true;
}

/// The same hardware under a kernel that does not claim the promise.
#[derive(Debug)]
struct SkipsUnclaimed;

impl Model for SkipsUnclaimed {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;
    const BROADCAST_INVALIDATE: bool = false;
    const FILL_SKIPS_ACCESSED: bool = true;
}

/// Pages per process.
const PER: usize = 4;

/// A machine of three CPUs: CPU 0 reclaims, CPUs 1 and 2 each run a
/// process of `PER` clean read-only pages that they read (and cache).
/// Returns the reverse map, every frame, and an address space no page is
/// mapped in (to switch to).
fn procs<M: Model>(m: &MockMachine<M>) -> (MockRmap<'_, M>, Vec<Frame>, Arc<MmTlbState>) {
    let spaces = (0..2).map(|i| m.space(&m.new_mm(asid(i + 1)).unwrap())).collect();
    let rmap = MockRmap::new(m, spaces);
    let mut frames = Vec::new();
    for s in 0..2 {
        let cpu = m.cpu(s + 1).unwrap();
        cpu.switch_to(rmap.spaces()[s].mm()).unwrap();
        for i in 0..PER {
            let f = m.alloc_frame().unwrap();
            rmap.map(f, s, va(i), false, MappingFlags::empty()).unwrap();
            cpu.read(va(i)).unwrap();
            frames.push(f);
        }
    }
    (rmap, frames, m.new_mm(asid(9)).unwrap())
}

/// CPUs 1 and 2 each switch away and back (untagged TLBs: their entries
/// go, and the switch counts as their flush), as they would at any
/// context switch; they touch none of the pages afterwards.
fn switch_away_and_back<M: Model>(m: &MockMachine<M>, rmap: &MockRmap<'_, M>, other: &Arc<MmTlbState>) {
    for s in 0..2 {
        let cpu = m.cpu(s + 1).unwrap();
        cpu.switch_to(other).unwrap();
        cpu.switch_to(rmap.spaces()[s].mm()).unwrap();
    }
}

/// Frees what a pool handed back; returns how many frames that was.
fn free<M: Model, const N: usize>(kernel: &mut MockKernel<'_, '_, M>, mut released: Flushed<N>) -> usize {
    assert!(released.still_mapped().is_empty());
    let n = released.frames_mut().len();
    kernel.free_batch(released.frames_mut());
    assert!(released.frames_mut().is_empty(), "the allocator took every frame");
    n
}

/// Two scans of reclaim's LRU cycle through `shrink_page_list_pooled`:
/// the first finds every page referenced and clears the bits, the CPUs
/// switch (a flush each, after that aging) and leave the pages alone, the
/// second unmaps them all into the pool. Returns how many frames the pool
/// hands back right after the second scan, and how many only after each
/// CPU's next `quiescent_flush`; checks that every frame ends freed, with
/// no IPI and no violation.
fn lru_cycle<M: Model>() -> (usize, usize) {
    let m = MockMachine::<M>::with_model(config(3, 64)).unwrap();
    let (rmap, frames, other) = procs(&m);
    let cpu0 = m.cpu(0).unwrap();
    let mut kernel = MockKernel::new(&rmap);
    let mut batch = UnmapBatch::<{ 2 * PER }>::new();
    let mut pool = FramePool::<{ 4 * PER }>::new();
    let mut young = Vec::new();
    let s = shrink_page_list_pooled(
        &cpu0,
        &rmap,
        &mut kernel,
        &mut batch,
        &mut pool,
        frames.iter().map(|&f| owned(f)),
        &mut |f, v| {
            assert_eq!(v, Verdict::Referenced, "{f:?}");
            young.push(f);
        },
    )
    .unwrap();
    assert_eq!((s.handed_back, s.pooled, young.len()), (2 * PER, 0, 2 * PER));
    switch_away_and_back(&m, &rmap, &other);
    let s = shrink_page_list_pooled(
        &cpu0,
        &rmap,
        &mut kernel,
        &mut batch,
        &mut pool,
        young,
        &mut |f, v| panic!("{f:?} handed back: {v:?}"),
    )
    .unwrap();
    assert_eq!((s.pooled, s.ipis_sent), (2 * PER, 0));
    let at_once = free(&mut kernel, pool.release_passed(&cpu0));
    for c in 1..3 {
        quiescent_flush(&m.cpu(c).unwrap());
    }
    let after_ticks = free(&mut kernel, pool.release_passed(&cpu0));
    assert!(pool.is_empty());
    assert!(frames
        .iter()
        .all(|&f| m.frame_state(f).unwrap() == FrameState::Free));
    assert_eq!(m.violations(), []);
    assert_eq!(m.ipis_sent(), 0);
    assert_eq!(m.stats().frames_released_by_passes, 2 * PER as u64);
    (at_once, after_ticks)
}

#[test]
fn the_mock_models_answer_as_they_are_declared() {
    let x86 = MockMachine::new(config(1, 8)).unwrap();
    assert!(x86.cpu(0).unwrap().fill_sets_accessed());
    let unclaimed = MockMachine::<X86NoAccessedPromise>::with_model(config(1, 8)).unwrap();
    assert!(!unclaimed.cpu(0).unwrap().fill_sets_accessed());
}

/// With the promise, the frames' aging epoch (the first scan's) was
/// passed by the switches, so the pool hands them back at once; without
/// it, they wait for the CPUs' next flushes, which then release all of
/// them. Neither sends an IPI or frees a frame some CPU caches.
#[test]
fn pooled_reclaim_without_the_promise_frees_everything_through_later_flushes() {
    assert_eq!(lru_cycle::<X86Like>(), (2 * PER, 0));
    assert_eq!(lru_cycle::<X86NoAccessedPromise>(), (0, 2 * PER));
}

/// The wrong claim. CPU 1 caches its page; CPU 0 ages it (the aging epoch
/// is stored when the model claims the promise); CPU 1 flushes by a
/// switch, so it has passed that epoch, and reads the page again. On
/// hardware whose fill then leaves the bit clear, CPU 0's unmap finds it
/// clear, and a pool that trusts the claim hands the frame back while CPU
/// 1 still caches it. Returns how many frames the pool handed back at
/// once and the violations recorded by the time the frame is freed.
fn refill_after_the_aging<M: Model>() -> (usize, Vec<Violation>) {
    let m = MockMachine::<M>::with_model(config(3, 64)).unwrap();
    let (rmap, frames, other) = procs(&m);
    let (cpu0, cpu1, f) = (m.cpu(0).unwrap(), m.cpu(1).unwrap(), frames[0]);
    let mut kernel = MockKernel::new(&rmap);
    let mut scratch = TlbFlushUnmapBatch::new();
    page_referenced(&cpu0, &rmap, f, &mut scratch).unwrap();
    assert_eq!(rmap.aged_epoch(f).is_some(), M::FILL_SETS_ACCESSED);
    cpu1.switch_to(&other).unwrap();
    cpu1.switch_to(rmap.spaces()[0].mm()).unwrap();
    cpu1.read(va(0)).unwrap();
    assert_eq!(m.cached_translations(f).len(), 1, "CPU 1 caches the page again");
    let mut batch = UnmapBatch::<4>::new();
    let r = batch.try_to_unmap(&cpu0, &rmap, owned(f), TtuFlags::IGNORE_ACCESS);
    assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    let mut pool = FramePool::<8>::new();
    assert_eq!(pool.defer(&cpu0, &mut batch), Ok(1));
    let at_once = free(&mut kernel, pool.release_passed(&cpu0));
    if at_once == 0 {
        quiescent_flush(&cpu1);
        assert_eq!(free(&mut kernel, pool.release_passed(&cpu0)), 1);
    }
    assert_eq!(m.frame_state(f).unwrap(), FrameState::Free);
    (at_once, m.violations())
}

#[test]
fn a_false_claim_of_the_promise_is_what_the_oracle_catches() {
    let (at_once, seen) = refill_after_the_aging::<FalseClaim>();
    assert_eq!(at_once, 1, "the pool trusted the aging epoch");
    // CPU 1's read-only entry, the only one there is.
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(
        matches!(seen[0], Violation::FreedWhileCached { writable: false, .. }),
        "{seen:?}"
    );
}

#[test]
fn the_same_hardware_unclaimed_and_honest_hardware_claimed_are_both_safe() {
    assert_eq!(refill_after_the_aging::<SkipsUnclaimed>(), (0, vec![]));
    assert_eq!(refill_after_the_aging::<X86NoAccessedPromise>(), (0, vec![]));
    // Fills that set the bit: the unmap finds the refill's bit and waits.
    assert_eq!(refill_after_the_aging::<X86Like>(), (0, vec![]));
}
