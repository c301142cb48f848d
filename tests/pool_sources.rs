//! FramePool: where its frames go back from, as `FramePool::releases`
//! counts them. A generation every target had flushed past before it was
//! pooled is *aged*; one whose targets all dropped their whole TLB since
//! went back by *passes*; one some target of which could not use its
//! entries (lazy, or running another address space) went back by
//! *generations*; and a shootdown the pool sent *forced* the rest.

mod common;

use common::pool::{pool_them, procs};
use common::{asid, config, owned, va};
use tlb_batch::arch::mock::{MockKernel, MockMachine, MockRmap};
use tlb_batch::pool::PoolReleases;
use tlb_batch::{quiescent_flush, FramePool, FreeFrames, MappingFlags, TtuFlags, UnmapBatch, Unmapped};

fn releases(aged: u64, passes: u64, generations: u64, forced: u64) -> PoolReleases {
    PoolReleases {
        aged,
        passes,
        generations,
        forced,
    }
}

/// CPUs 1-3 each cache a page of their own process, pooled from CPU 0 as
/// one generation; `then` makes the CPUs do something, and the frames that
/// `release_passed` hands back afterwards are counted as it says.
fn released_after(then: impl FnOnce(&MockMachine, &MockRmap<'_>)) -> (usize, PoolReleases) {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = procs(&m, &[1, 2, 3], 1);
    let mut pool = FramePool::<16>::new();
    pool_them(&m, &rmap, &frames.concat(), &mut pool);
    assert_eq!(pool.releases(), PoolReleases::default(), "nothing back yet");
    then(&m, &rmap);
    let mut released = pool.release_passed(&m.cpu(0).unwrap());
    let n = released.len();
    MockKernel::new(&rmap).free_batch(released.frames_mut());
    let mut rest = pool.flush(&m.cpu(0).unwrap()).unwrap();
    MockKernel::new(&rmap).free_batch(rest.frames_mut());
    assert_eq!(m.violations(), []);
    (n, pool.releases())
}

#[test]
fn frames_released_after_every_target_flushed_everything_count_as_passes() {
    let (n, r) = released_after(|m, _| {
        for c in 1..4 {
            assert!(quiescent_flush(&m.cpu(c).unwrap()));
        }
    });
    assert_eq!((n, r), (3, releases(0, 3, 0, 0)));
}

#[test]
fn frames_released_while_a_target_is_lazy_count_as_generations() {
    let (n, r) = released_after(|m, _| {
        assert!(quiescent_flush(&m.cpu(1).unwrap()));
        for c in 2..4 {
            m.cpu(c).unwrap().enter_lazy().unwrap();
        }
    });
    assert_eq!((n, r), (3, releases(0, 0, 3, 0)));
}

#[test]
fn frames_a_target_still_caches_are_forced_by_the_flush() {
    let (n, r) = released_after(|m, _| {
        assert!(quiescent_flush(&m.cpu(1).unwrap()));
    });
    assert_eq!((n, r), (0, releases(0, 0, 0, 3)));
}

/// A page mapped fresh from the allocator and never read has aging epoch
/// 0, which every CPU has passed: its generation is aged when it is
/// pooled, and `release_passed` hands it back at once.
#[test]
fn a_generation_passed_before_it_was_pooled_counts_as_aged() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let rmap = MockRmap::new(&m, vec![m.space(&mm)]);
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu0.switch_to(&mm).unwrap();
    cpu1.switch_to(&mm).unwrap();
    let f = m.alloc_frame().unwrap();
    rmap.map_fresh(f, 0, va(0), false, MappingFlags::empty()).unwrap();
    let mut batch = UnmapBatch::<4>::new();
    let r = batch.try_to_unmap(&cpu0, &rmap, owned(f), TtuFlags::BATCH_FLUSH);
    assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    let mut pool = FramePool::<16>::new();
    assert_eq!(pool.defer(&cpu0, &mut batch), Ok(1));
    let mut released = pool.release_passed(&cpu0);
    assert_eq!(released.len(), 1);
    MockKernel::new(&rmap).free_batch(released.frames_mut());
    assert_eq!(pool.releases(), releases(1, 0, 0, 0));
    assert_eq!((m.ipis_sent(), m.violations()), (0, vec![]));
}

/// A batch that joins the newest generation (every slot in use) leaves it
/// aged only if both were: an aged batch (a page never read, aging epoch
/// 0) joining a generation CPU 1 had not flushed past leaves it unaged,
/// so once CPU 1 passes, every frame counts as released by passes and
/// none as aged. Pins the `&=` of the join in `FramePool::defer`.
#[test]
fn an_aged_batch_joining_the_newest_generation_leaves_it_unaged() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let n = tlb_batch::POOL_GENERATIONS;
    let (rmap, frames) = procs(&m, &[1], n);
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    let mut pool = FramePool::<64>::new();
    for &f in &frames[0] {
        pool_them(&m, &rmap, &[f], &mut pool);
    }
    let f = m.alloc_frame().unwrap();
    rmap.map_fresh(f, 0, va(n), false, MappingFlags::empty()).unwrap();
    let mut batch = UnmapBatch::<4>::new();
    let r = batch.try_to_unmap(&cpu0, &rmap, owned(f), TtuFlags::BATCH_FLUSH);
    assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    assert_eq!(pool.defer(&cpu0, &mut batch), Ok(1));
    assert_eq!((pool.generations(), pool.len()), (n, n + 1));
    assert!(pool.release_passed(&cpu0).is_empty(), "CPU 1 has not passed");
    assert!(quiescent_flush(&cpu1));
    let mut released = pool.release_passed(&cpu0);
    assert_eq!(released.len(), n + 1);
    MockKernel::new(&rmap).free_batch(released.frames_mut());
    assert_eq!(m.violations(), []);
    assert_eq!(pool.releases(), releases(0, n as u64 + 1, 0, 0));
    assert_eq!(m.ipis_sent(), 0);
}
