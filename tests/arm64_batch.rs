//! Batched unmaps on hardware that invalidates as pages are added
//! ([`Arch::BATCH_BROADCAST_ON_ADD`], the mock's `Arm64Like`): each page's
//! broadcast invalidation is issued by `add_pending`, and the flush only
//! waits for them, once, when the flushing CPU issued them all. The mock
//! applies a broadcast invalidation at its issuing CPU's next
//! `broadcast_sync` and not before, so a flush that forgot to wait (arm64's
//! `DSB ISH` skipped), or waited on a CPU that issued nothing, leaves stale
//! entries that the oracle sees.

mod common;

use common::{config, free_and_check, populate, unmap_deferred, va};
use tlb_batch::arch::mock::{
    Arm64Like, BroadcastTlbi, MockConfig, MockCpu, MockMachine, MockRmap, Violation,
};
use tlb_batch::{
    Arch, Asid, CpuId, CpuSet, FlushRequest, Flushed, Frame, FramePool, MappingFlags, TlbFlushUnmapBatch,
    TlbShootdown, TraceEvent, TtuFlags, UnmapBatch, Unmapped, DEFAULT_FULL_FLUSH_CEILING,
};

fn arm64(cpus: usize) -> MockMachine<Arm64Like> {
    MockMachine::<Arm64Like>::with_model(config(cpus, 128)).unwrap()
}

/// Cycles charged for broadcast invalidations and barriers so far.
fn broadcast_cycles(m: &MockMachine<Arm64Like>) -> u64 {
    m.costs().broadcast
}

#[test]
fn each_page_is_invalidated_as_it_is_added_and_the_flush_waits_once() {
    // Below and past the full-flush ceiling: the shape is the same, one
    // invalidation per page and one barrier.
    for pages in [1, 10, DEFAULT_FULL_FLUSH_CEILING + 17] {
        let m = arm64(4);
        let cost = MockConfig::x86_like(4).cost;
        let (mm, frames) = populate(&m, 1, pages, &[0, 1, 2, 3], true);
        let cpu0 = m.cpu(0).unwrap();
        let before = m.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        unmap_deferred(&m, &cpu0, &mm, 0..pages, &mut batch);
        // Issued, not waited for: every CPU still caches the pages.
        assert_eq!(broadcast_cycles(&m), pages as u64 * cost.broadcast_invalidate);
        assert_eq!(m.stale_entries().len(), 4 * pages, "{pages} pages");
        assert_eq!(m.stats().since(&before).shootdowns, 0);

        let report = batch.flush(&cpu0).unwrap();
        assert!(report.broadcast);
        assert_eq!(report.ipis_sent, 0);
        assert!(batch.is_empty());
        // One barrier, no invalidation issued again (not even a
        // whole-ASID one past the ceiling).
        assert_eq!(
            broadcast_cycles(&m),
            pages as u64 * cost.broadcast_invalidate + cost.broadcast_sync
        );
        let d = m.stats().since(&before);
        assert_eq!((d.shootdowns, d.broadcasts, d.ipis_sent), (1, 1, 0));
        assert_eq!(d.pages_deferred, pages as u64);
        assert_eq!(m.ipis_sent(), 0);
        free_and_check(&m, frames);
    }
}

/// The barrier is what makes the invalidations count: a frame freed after
/// they were issued but before the flush is still cached everywhere.
#[test]
fn freeing_before_the_flush_is_caught_although_the_invalidations_were_issued() {
    let m = arm64(2);
    let (mm, frames) = populate(&m, 1, 3, &[0, 1], true);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    unmap_deferred(&m, &cpu0, &mm, 0..3, &mut batch);
    m.free_frame(frames[0]).unwrap();
    assert!(
        m.violations()
            .iter()
            .any(|v| matches!(v, Violation::FreedWhileCached { .. })),
        "{:?}",
        m.violations()
    );
    batch.flush(&cpu0).unwrap();
    assert_eq!(m.stale_entries(), []);
}

/// A task can move between adding pages and flushing: the flushing CPU's
/// barrier does not complete the other CPU's invalidations, so the flush
/// issues them again from here.
#[test]
fn a_batch_flushed_on_a_cpu_that_did_not_fill_it_invalidates_again() {
    // Filled on CPU 1 alone, and on CPUs 1 and 0 together.
    for fillers in [&[1usize][..], &[1, 0]] {
        let m = arm64(3);
        let cost = MockConfig::x86_like(3).cost;
        let (mm, frames) = populate(&m, 1, 4, &[0, 1, 2], true);
        let mut batch = TlbFlushUnmapBatch::new();
        for (i, &c) in (0..4).zip(fillers.iter().cycle()) {
            let cpu = m.cpu(c).unwrap();
            unmap_deferred(&m, &cpu, &mm, [i], &mut batch);
        }
        let issued = broadcast_cycles(&m);
        assert_eq!(issued, 4 * cost.broadcast_invalidate);
        let cpu0 = m.cpu(0).unwrap();
        let report = batch.flush(&cpu0).unwrap();
        assert!(report.broadcast);
        assert_eq!(report.ipis_sent, 0);
        // The four pages again, and the barrier.
        assert_eq!(
            broadcast_cycles(&m) - issued,
            4 * cost.broadcast_invalidate + cost.broadcast_sync,
            "filled on {fillers:?}"
        );
        free_and_check(&m, frames);
    }
}

/// Without the on-add invalidations, a broadcast machine flushes as before:
/// everything at the flush, a ranged flush below the ceiling.
#[test]
fn broadcast_hardware_without_on_add_invalidates_at_the_flush() {
    let m = MockMachine::<BroadcastTlbi>::with_model(config(2, 64)).unwrap();
    let cost = MockConfig::x86_like(2).cost;
    let (mm, frames) = populate(&m, 1, 5, &[0, 1], true);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    unmap_deferred(&m, &cpu0, &mm, 0..5, &mut batch);
    assert_eq!(m.costs().broadcast, 0);
    batch.flush(&cpu0).unwrap();
    assert_eq!(
        m.costs().broadcast,
        5 * cost.broadcast_invalidate + cost.broadcast_sync
    );
    free_and_check(&m, frames);
}

/// An `Arch` over the same machine whose batches do not invalidate on add
/// (a kernel may wrap its `Arch`, for tracing or a quirk, and share the
/// machine's shootdown state).
struct NoOnAdd<'a>(MockCpu<'a, Arm64Like>);

// SAFETY: every method forwards to the mock CPU, whose implementation
// keeps the contract; the only difference is a capability turned off,
// which claims less.
unsafe impl Arch for NoOnAdd<'_> {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = true;
    const BROADCAST_INVALIDATE: bool = true;
    const BATCH_BROADCAST_ON_ADD: bool = false;

    fn current_cpu(&self) -> Result<CpuId, tlb_batch::Error> {
        self.0.current_cpu()
    }
    fn online_cpus(&self) -> CpuSet {
        self.0.online_cpus()
    }
    fn shootdown_state(&self) -> &TlbShootdown {
        self.0.shootdown_state()
    }
    fn tagged_tlb(&self) -> bool {
        self.0.tagged_tlb()
    }
    fn flush_local_page(&self, asid: Asid, va: u64) {
        self.0.flush_local_page(asid, va)
    }
    fn flush_local_asid(&self, asid: Asid) {
        self.0.flush_local_asid(asid)
    }
    fn flush_local_all(&self, include_global: bool) {
        self.0.flush_local_all(include_global)
    }
    fn send_flush_ipi(&self, targets: &CpuSet) {
        self.0.send_flush_ipi(targets)
    }
    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.0.switch_address_space(asid, root) }
    }
    fn broadcast_flush_page(&self, asid: Asid, va: u64) {
        self.0.broadcast_flush_page(asid, va)
    }
    fn broadcast_flush_asid(&self, asid: Asid) {
        self.0.broadcast_flush_asid(asid)
    }
    fn broadcast_flush_all(&self, include_global: bool) {
        self.0.broadcast_flush_all(include_global)
    }
    fn broadcast_sync(&self) {
        self.0.broadcast_sync()
    }
    fn prefer_broadcast(&self, remote_cpus: usize, request: &FlushRequest) -> bool {
        self.0.prefer_broadcast(remote_cpus, request)
    }
    fn relax(&self) {
        self.0.relax()
    }
    fn trace(&self, event: &TraceEvent) {
        self.0.trace(event)
    }
}

/// A batch that holds a page whose invalidation was not issued on add is
/// flushed in full, even on the CPU that issued the others.
#[test]
fn a_page_added_without_its_invalidation_makes_the_flush_issue_everything() {
    let m = arm64(2);
    let cost = MockConfig::x86_like(2).cost;
    let (mm, frames) = populate(&m, 1, 3, &[0, 1], true);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    unmap_deferred(&m, &cpu0, &mm, 0..2, &mut batch);
    let plain = NoOnAdd(m.cpu(0).unwrap());
    let old = m.clear_pte(&mm, va(2)).unwrap();
    batch.add_pending(&plain, &mm, va(2), old).unwrap();
    assert_eq!(m.costs().broadcast, 2 * cost.broadcast_invalidate);
    assert_eq!(m.stale_entries().len(), 6);
    batch.flush(&cpu0).unwrap();
    assert_eq!(
        m.costs().broadcast,
        5 * cost.broadcast_invalidate + cost.broadcast_sync
    );
    free_and_check(&m, frames);
}

/// An accessed-bit clear recorded in a batch is invalidated on add too.
#[test]
fn an_accessed_clear_is_invalidated_on_add() {
    let m = arm64(2);
    let cost = MockConfig::x86_like(2).cost;
    let (mm, _frames) = populate(&m, 1, 1, &[0, 1], true);
    let cpu0 = m.cpu(0).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    batch.add_accessed_clear(&cpu0, &mm, va(0)).unwrap();
    assert_eq!(m.costs().broadcast, cost.broadcast_invalidate);
    assert!(!batch.has_writable());
    // Not yet complete: CPU 1 still hits its entry.
    let refills = m.costs().tlb_refill;
    cpu1.read(va(0)).unwrap();
    assert_eq!(m.costs().tlb_refill, refills);
    batch.flush(&cpu0).unwrap();
    assert_eq!(
        m.costs().broadcast,
        cost.broadcast_invalidate + cost.broadcast_sync
    );
    // The entry went everywhere (the page is still mapped: CPU 1 refills).
    cpu1.read(va(0)).unwrap();
    assert_eq!(m.costs().tlb_refill, refills + cost.tlb_refill);
}

/// One address space whose `pages` clean read-only pages CPUs `readers`
/// cache; CPU `filler` unmaps them all into one `UnmapBatch`.
fn unmapped_by(
    m: &MockMachine<Arm64Like>,
    pages: usize,
    readers: &[usize],
    filler: usize,
) -> (UnmapBatch<16>, Vec<Frame>) {
    let space = m.space(&m.new_mm(common::asid(1)).unwrap());
    let rmap = MockRmap::new(m, vec![space]);
    let frames: Vec<Frame> = (0..pages)
        .map(|i| {
            let f = m.alloc_frame().unwrap();
            rmap.map(f, 0, va(i), false, MappingFlags::empty()).unwrap();
            f
        })
        .collect();
    for &c in readers {
        let cpu = m.cpu(c).unwrap();
        cpu.switch_to(rmap.spaces()[0].mm()).unwrap();
        for i in 0..pages {
            cpu.read(va(i)).unwrap();
        }
    }
    let mut batch = UnmapBatch::<16>::new();
    let cpu = m.cpu(filler).unwrap();
    for &f in &frames {
        let r = batch.try_to_unmap(&cpu, &rmap, common::owned(f), TtuFlags::IGNORE_ACCESS);
        assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    }
    (batch, frames)
}

/// Frees every frame `released` holds; returns how many.
fn free_all<const N: usize>(m: &MockMachine<Arm64Like>, mut released: Flushed<N>) -> usize {
    let n = released.frames_mut().len();
    while let Some(f) = released.frames_mut().pop() {
        m.free_frame(f.into_frame()).unwrap();
    }
    n
}

/// A pool that takes a batch this CPU invalidated on add completes it with
/// one barrier, and hands the frames back at the next `release_passed`
/// although no CPU has flushed on its own.
#[test]
fn a_pool_completes_a_batch_invalidated_here_with_one_barrier() {
    let m = arm64(3);
    let cost = MockConfig::x86_like(3).cost;
    let (mut batch, _frames) = unmapped_by(&m, 5, &[1, 2], 0);
    assert_eq!(m.stale_entries().len(), 10, "issued, not waited for");
    let mut pool = FramePool::<16>::new();
    let cpu0 = m.cpu(0).unwrap();
    assert_eq!(pool.defer(&cpu0, &mut batch), Ok(5));
    assert_eq!(m.stale_entries(), []);
    assert_eq!(
        m.costs().broadcast,
        5 * cost.broadcast_invalidate + cost.broadcast_sync
    );
    let released = pool.release_passed(&cpu0);
    assert!(!released.report().flushed_locally);
    assert_eq!(free_all(&m, released), 5);
    assert!(pool.is_empty());
    assert_eq!((m.ipis_sent(), m.violations()), (0, vec![]));
}

/// Filled on another CPU, the batch's invalidations are not this CPU's to
/// wait for: the pool keeps the frames until the CPUs that cached them
/// flush (here: its own flush).
#[test]
fn a_pool_keeps_a_batch_another_cpu_invalidated_until_a_flush() {
    let m = arm64(3);
    let (mut batch, _frames) = unmapped_by(&m, 4, &[1, 2], 1);
    let mut pool = FramePool::<16>::new();
    let cpu0 = m.cpu(0).unwrap();
    assert_eq!(pool.defer(&cpu0, &mut batch), Ok(4));
    assert!(free_all(&m, pool.release_passed(&cpu0)) == 0);
    assert_eq!(pool.len(), 4);
    let flushed = pool.flush(&cpu0).unwrap();
    assert_eq!(free_all(&m, flushed), 4);
    assert_eq!((m.stale_entries(), m.violations()), (vec![], vec![]));
}

/// `MockCpu::in_shootdown` fails what takes the CPU's request slot: on
/// `Arm64Like`, a broadcast flush takes none and succeeds inside it, as in
/// a real interrupt handler, leaving nothing stale; the table-free sync
/// interrupts the other CPUs and fails; and with `broadcast_min_remote`
/// above the CPU count flushes go by IPI and fail too, nothing flushed,
/// and the retry outside flushes.
#[test]
fn injected_failures_reach_what_takes_the_slot_and_no_broadcast() {
    for min_remote in [0, 8] {
        let m = MockMachine::<Arm64Like>::with_model(MockConfig {
            broadcast_min_remote: min_remote,
            ..config(4, 128)
        })
        .unwrap();
        let (mm, _) = populate(&m, 1, 1, &[0, 1, 2, 3], true);
        let cpu0 = m.cpu(0).unwrap();
        m.clear_pte(&mm, va(0)).unwrap();
        assert_eq!(m.stale_entries().len(), 4);
        let inside = cpu0
            .in_shootdown(|| {
                (
                    tlb_batch::flush_tlb_page(&cpu0, &mm, va(0)),
                    tlb_batch::ipi_sync(&cpu0),
                )
            })
            .unwrap();
        assert!(matches!(
            inside.1,
            Err(tlb_batch::Error::ShootdownReentered { cpu: 0 })
        ));
        if min_remote == 0 {
            assert!(inside.0.unwrap().broadcast);
            assert_eq!(m.stale_entries(), []);
        } else {
            assert!(matches!(
                inside.0,
                Err(tlb_batch::Error::ShootdownReentered { cpu: 0 })
            ));
            assert_eq!(m.stale_entries().len(), 4, "nothing flushed");
            let retry = tlb_batch::flush_tlb_page(&cpu0, &mm, va(0)).unwrap();
            assert_eq!((retry.broadcast, retry.ipis_sent), (false, 3));
            assert_eq!(m.stale_entries(), []);
        }
        assert_eq!(m.violations(), []);
    }
}
