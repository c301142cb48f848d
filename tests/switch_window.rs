//! The CR3 window (Linux CVE-2025-37964) on the mock machine, through its
//! switch hook: code that runs after a CPU loaded a new page-table root
//! and before `switch_mm` finished recording the switch. From the moment
//! the root is loaded the hardware may walk the new tables (speculatively,
//! too), so another CPU that unmaps, flushes and frees in that window must
//! already count the switching CPU as a target; and a `FramePool` must
//! count a CPU as running the space it loads from before the load, and
//! never count a pass for entries filled after the epoch it read.
//!
//! Loom explores the same window exhaustively in src/loom/mm.rs (model
//! (e)) and src/loom/pool.rs (models (h') and (h'')); here it is one
//! fixed interleaving, on the whole crate (reverse-map walk, batch,
//! shootdown, pool, kernel free), judged by the oracle and by counts,
//! never by timing.

mod common;

use std::sync::{Arc, Mutex};

use common::{asid, config, owned, va};
use tlb_batch::arch::mock::{
    Fault, MockConfig, MockCpu, MockKernel, MockMachine, MockRmap, Model, X86Invlpgb, X86Like,
};
use tlb_batch::{
    quiescent_flush, CpuSet, Flushed, Frame, FramePool, FreeFrames, MappingFlags, MmTlbState,
    ShootdownReport, SwapResult, TtuFlags, UnmapBatch, Unmapped,
};

/// How the tests unmap: deferred flushes, and a page recently read is
/// taken anyway (the reclaimer aged it already).
const TTU: TtuFlags = TtuFlags::BATCH_FLUSH.union(TtuFlags::IGNORE_ACCESS);

/// `value`, for the rest of the test run: the switch hook is `'static`, so
/// the machine and what borrows it (the reverse map) are leaked, one small
/// machine per test.
fn leak<T>(value: T) -> &'static T {
    Box::leak(Box::new(value))
}

/// A machine of three synchronous CPUs of model `M`, with tagged
/// (PCID-like) TLBs or untagged ones.
fn machine<M: Model>(tagged: bool) -> &'static MockMachine<M> {
    let config = MockConfig {
        tagged_tlb: tagged,
        ..config(3, 64)
    };
    leak(MockMachine::with_model(config).unwrap())
}

/// The two address spaces of every test: `s`, the one CPU 0 switches into
/// (or out of), and `t`, the other one.
struct World<M: Model> {
    m: &'static MockMachine<M>,
    rmap: &'static MockRmap<'static, M>,
    s: Arc<MmTlbState>,
    t: Arc<MmTlbState>,
    /// The page of `s` at `va(0)`, read-only and clean (so poolable).
    p: Frame,
}

impl<M: Model> World<M> {
    fn new(tagged: bool) -> Self {
        let m = machine::<M>(tagged);
        let (s, t) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
        let rmap = leak(MockRmap::new(m, vec![m.space(&s), m.space(&t)]));
        let p = m.alloc_frame().unwrap();
        rmap.map(p, 0, va(0), false, MappingFlags::empty()).unwrap();
        // A page of `t` at the same address, so that CPU 0 has something
        // of `t` cached when it runs `t`.
        let q = m.alloc_frame().unwrap();
        rmap.map(q, 1, va(0), false, MappingFlags::empty()).unwrap();
        World { m, rmap, s, t, p }
    }

    fn cpu(&self, index: usize) -> MockCpu<'static, M> {
        self.m.cpu(index).unwrap()
    }

    /// Whether CPU `index` holds a TLB entry for `frame`.
    fn caches(&self, index: usize, frame: Frame) -> bool {
        let id = self.cpu(index).id();
        self.m.cached_translations(frame).iter().any(|(c, _)| *c == id)
    }

    /// Switches CPU 0 to `next` with `hook` installed for that one switch,
    /// and checks that the hook ran exactly once.
    fn switch_cpu0_with(
        &self,
        next: &Arc<MmTlbState>,
        hook: impl Fn(&MockCpu<'_, M>) + Send + Sync + 'static,
    ) {
        let runs = Arc::new(Mutex::new(0usize));
        let counted = Arc::clone(&runs);
        let cpu0 = self.cpu(0).id();
        self.m.set_switch_hook(Some(Arc::new(move |cpu: &MockCpu<'_, M>| {
            assert_eq!(cpu.id(), cpu0, "only CPU 0 switches while the hook is installed");
            *counted.lock().unwrap() += 1;
            hook(cpu);
        })));
        let switched = self.cpu(0).switch_to(next);
        self.m.set_switch_hook(None);
        switched.unwrap();
        assert_eq!(*runs.lock().unwrap(), 1, "the hook runs once per switch");
    }
}

/// Frees what a flush or a pool handed back through the kernel's batched
/// free; returns the frames it freed.
fn free_all<M: Model, const N: usize>(rmap: &MockRmap<'_, M>, mut back: Flushed<N>) -> Vec<Frame> {
    assert!(back.still_mapped().is_empty());
    let frames: Vec<Frame> = back.frames_mut().iter().map(|f| f.frame()).collect();
    MockKernel::new(rmap).free_batch(back.frames_mut());
    assert!(back.frames_mut().is_empty(), "the allocator takes every frame");
    frames
}

/// What the sender-side hook saw and did in the window.
#[derive(Debug, Default)]
struct SenderWindow {
    /// CPU 0's read of page P from the new tables.
    read: Option<Result<u64, Fault>>,
    /// Whether CPU 0 cached P after that read.
    cached: bool,
    /// CPU 1's unmap of P.
    unmapped: Option<Unmapped>,
    /// The CPUs the batch had to reach.
    targets: CpuSet,
    /// The flush's report.
    report: ShootdownReport,
    /// Flush interrupts CPU 0 took during the flush.
    cpu0_interrupts: u64,
    /// Frames the kernel freed.
    freed: Vec<Frame>,
}

/// The CVE's shape, from the unmapper's side. CPU 0 runs T and switches
/// into S; with `cpu2`, CPU 2 runs S too, with page P cached. In the
/// window, CPU 0 reads P (the hardware may fill it as soon as the root is
/// loaded), and CPU 1 unmaps P with its flush deferred, flushes the batch
/// and frees the frame through the kernel. `switch_mm` put CPU 0 in S's set
/// before loading the root, so the unmap defers for it and the flush
/// reaches it (an IPI, or the broadcast): the oracle sees no free while
/// cached, and CPU 0's next access faults instead of reading the freed
/// frame. With the CPU added only after the load, the flush reaches CPU 2
/// alone (or, without CPU 2, the unmap flushes at once, to nobody) and the
/// frame is freed under CPU 0's entry. (Broadcast hardware invalidates on
/// every CPU, so there only the run without CPU 2 shows the miss in the
/// oracle; with CPU 2 the flush's targets do.)
fn sender_side<M: Model>(tagged: bool, cpu2: bool) {
    let w = World::<M>::new(tagged);
    let (m, rmap, p) = (w.m, w.rmap, w.p);
    w.cpu(0).switch_to(&w.t).unwrap();
    w.cpu(0).read(va(0)).unwrap();
    if cpu2 {
        w.cpu(2).switch_to(&w.s).unwrap();
        w.cpu(2).read(va(0)).unwrap();
    }
    assert!(!w.s.cpus().contains(w.cpu(0).id()), "CPU 0 never ran S before");

    let seen = Arc::new(Mutex::new(SenderWindow::default()));
    let record = Arc::clone(&seen);
    let cpu0 = w.cpu(0).id();
    w.switch_cpu0_with(&w.s, move |cpu| {
        let mut seen = record.lock().unwrap();
        seen.read = Some(cpu.read(va(0)));
        seen.cached = m.cached_translations(p).iter().any(|(c, _)| *c == cpu0);
        let cpu1 = m.cpu(1).unwrap();
        let mut batch = UnmapBatch::<4>::new();
        seen.unmapped = Some(batch.try_to_unmap(&cpu1, rmap, owned(p), TTU).unwrap());
        seen.targets = batch.tlb_batch().targets();
        let before = m.interrupts_taken(cpu0).unwrap();
        let flushed = batch.flush(&cpu1).unwrap();
        seen.report = flushed.report();
        seen.cpu0_interrupts = m.interrupts_taken(cpu0).unwrap() - before;
        seen.freed = free_all(rmap, flushed);
    });

    // After the switch CPU 0 uses what its TLB holds for P: nothing, if
    // the flush reached it.
    let after = w.cpu(0).read(va(0));
    let seen = seen.lock().unwrap();
    assert_eq!(
        m.violations(),
        [],
        "a frame was freed, or read, while a CPU in the CR3 window still cached it"
    );
    assert_eq!(
        after,
        Err(Fault::NotMapped { va: va(0) }),
        "CPU 0 lost its entry for P"
    );
    assert!(
        matches!(seen.read, Some(Ok(_))),
        "CPU 0 reads P from the new tables in the window: {:?}",
        seen.read
    );
    assert!(seen.cached, "the read in the window filled CPU 0's TLB");
    assert_eq!(seen.unmapped, Some(Unmapped::Held(SwapResult::Success)));
    assert_eq!(seen.freed, [p]);
    assert!(
        seen.targets.contains(cpu0),
        "CPU 0 is among the flush's targets: {:?}",
        seen.targets
    );
    assert_eq!(seen.targets.contains(w.cpu(2).id()), cpu2);
    if M::BROADCAST_INVALIDATE {
        assert!(seen.report.broadcast, "{:?}", seen.report);
        assert_eq!(seen.cpu0_interrupts, 0);
    } else {
        let remote = 1 + usize::from(cpu2);
        assert_eq!(seen.report.remote_cpus, remote, "{:?}", seen.report);
        assert_eq!(seen.cpu0_interrupts, 1, "the flush interrupted CPU 0 once");
    }
    assert_eq!(m.stale_entries(), []);
}

#[test]
fn unmapper_in_the_window_flushes_the_switching_cpu_untagged() {
    sender_side::<X86Like>(false, true);
}

#[test]
fn unmapper_in_the_window_flushes_the_switching_cpu_tagged() {
    sender_side::<X86Like>(true, true);
}

#[test]
fn unmapper_in_the_window_defers_for_the_switching_cpu_alone() {
    sender_side::<X86Like>(false, false);
}

#[test]
fn unmapper_in_the_window_flushes_the_switching_cpu_broadcast() {
    sender_side::<X86Invlpgb>(true, true);
}

#[test]
fn unmapper_in_the_window_flushes_the_switching_cpu_alone_broadcast() {
    sender_side::<X86Invlpgb>(true, false);
}

/// What a pool-side hook saw and did in the window.
#[derive(Debug, Default)]
struct PoolWindow {
    /// Whether CPU 0 cached P in the window.
    cached: bool,
    /// CPU 1's unmap of P (switch-in test only).
    unmapped: Option<Unmapped>,
    /// The CPUs the pooled generation waits for (switch-in test only).
    targets: CpuSet,
    /// Frames the pool handed back in the window (and the kernel freed).
    released: Vec<Frame>,
}

/// A pool that the tests' hooks share.
type Pool = &'static Mutex<FramePool<4>>;

/// CPU 1 unmaps P with its flush deferred and pools it; returns the unmap's
/// result and the CPUs the new generation waits for.
fn unmap_into_pool<M: Model>(
    m: &MockMachine<M>,
    rmap: &MockRmap<'_, M>,
    p: Frame,
    pool: &mut FramePool<4>,
) -> (Unmapped, CpuSet) {
    let cpu1 = m.cpu(1).unwrap();
    let mut batch = UnmapBatch::<4>::new();
    let unmapped = batch.try_to_unmap(&cpu1, rmap, owned(p), TTU).unwrap();
    let before = pool.targets();
    assert_eq!(pool.defer(&cpu1, &mut batch), Ok(1));
    assert!(batch.is_empty());
    (unmapped, pool.targets().difference(&before))
}

/// CPU 1 asks `pool` for passed frames and frees whatever comes back.
fn release<M: Model>(m: &MockMachine<M>, rmap: &MockRmap<'_, M>, pool: Pool) -> Vec<Frame> {
    let back = pool.lock().unwrap().release_passed(&m.cpu(1).unwrap());
    free_all(rmap, back)
}

/// Pool side, switching away: P's flush sits in a pooled generation that
/// waits for CPU 0, which ran S and cached P; CPU 0 switches to T. In the
/// window (T's root loaded, an untagged TLB already dropped S's entries)
/// CPU 1 asks the pool for passed frames and gets nothing: until
/// `switch_mm` is done, CPU 0 counts as running both the space it loads
/// and the one it leaves (it recorded S as left before recording T). Once
/// the switch returned, P comes back without any flush of CPU 0's: it runs
/// T, cannot use S's entries (a tagged TLB still holds P's under S's
/// ASID), and S's generation, advanced when P was unmapped, makes it flush
/// S's ASID before it loads S again. The oracle judges exactly that at the
/// load: CPU 0 switching back to S catches up, and no `LoadedWithStale` is
/// recorded. Counting CPU 0 as clear in the window, before its old root is
/// gone, would release P while an untagged TLB may still hold it (loom
/// model (h') shows that interleaving).
fn pool_switch_away(tagged: bool) {
    let w = World::<X86Like>::new(tagged);
    let (m, rmap, p) = (w.m, w.rmap, w.p);
    w.cpu(0).switch_to(&w.s).unwrap();
    w.cpu(0).read(va(0)).unwrap();
    let pool: Pool = leak(Mutex::new(FramePool::new()));
    let (unmapped, targets) = unmap_into_pool(m, rmap, p, &mut pool.lock().unwrap());
    assert_eq!(unmapped, Unmapped::Held(SwapResult::Success));
    assert_eq!(targets, CpuSet::single(w.cpu(0).id()));
    assert_eq!(m.ipis_sent(), 0, "pooling sends nothing");
    assert_eq!(release(m, rmap, pool), [], "CPU 0 runs S and has not flushed yet");

    let seen = Arc::new(Mutex::new(PoolWindow::default()));
    let record = Arc::clone(&seen);
    let cpu0 = w.cpu(0).id();
    w.switch_cpu0_with(&w.t, move |_cpu| {
        let mut seen = record.lock().unwrap();
        seen.cached = m.cached_translations(p).iter().any(|(c, _)| *c == cpu0);
        seen.released = release(m, rmap, pool);
    });

    let seen = seen.lock().unwrap();
    assert_eq!(m.violations(), [], "a pooled frame was freed while usable");
    assert_eq!(seen.released, [], "in the window CPU 0 still counts as running S");
    assert_eq!(
        seen.cached, tagged,
        "only a tagged TLB keeps S's entries across the switch"
    );
    assert_eq!(release(m, rmap, pool), [p], "CPU 0 runs T now");
    assert_eq!(w.caches(0, p), tagged);
    let before = m.stats().catch_ups;
    w.cpu(0).switch_to(&w.s).unwrap();
    assert_eq!(
        m.stats().catch_ups - before,
        u64::from(tagged),
        "back on S, a tagged TLB flushes S's ASID first"
    );
    assert!(!w.caches(0, p));
    assert_eq!(m.violations(), []);
    assert!(pool.lock().unwrap().is_empty());
    assert_eq!(m.ipis_sent(), 0, "the pool got P back without an IPI");
}

#[test]
fn pool_releases_a_frame_once_its_cpu_runs_another_space_untagged() {
    pool_switch_away(false);
}

#[test]
fn pool_releases_a_frame_once_its_cpu_runs_another_space_tagged() {
    pool_switch_away(true);
}

/// Pool side, switching in (loom model (h'') on the whole crate): CPU 0
/// runs T and switches into S. In the window it reads P, filling its TLB
/// from S's tables, and CPU 1 unmaps P with its flush deferred and pools
/// it: CPU 0 is in S's set already, so the generation waits for it. The
/// pool hands nothing back in the window, nor after the switch returned:
/// the epoch CPU 0 recorded as passed was read before the switch, before
/// P's generation was published, and CPU 0 does still cache P. Only CPU
/// 0's `quiescent_flush` releases it. An epoch read after the switch would
/// count the switch as a pass of P's generation and free P under CPU 0's
/// entry; a CPU put in S's set only after the load would not be waited for
/// at all.
fn pool_switch_in(tagged: bool) {
    let w = World::<X86Like>::new(tagged);
    let (m, rmap, p) = (w.m, w.rmap, w.p);
    w.cpu(0).switch_to(&w.t).unwrap();
    w.cpu(0).read(va(0)).unwrap();
    let pool: Pool = leak(Mutex::new(FramePool::new()));

    let seen = Arc::new(Mutex::new(PoolWindow::default()));
    let record = Arc::clone(&seen);
    let cpu0 = w.cpu(0).id();
    w.switch_cpu0_with(&w.s, move |cpu| {
        let mut seen = record.lock().unwrap();
        let _ = cpu.read(va(0));
        seen.cached = m.cached_translations(p).iter().any(|(c, _)| *c == cpu0);
        let (unmapped, targets) = unmap_into_pool(m, rmap, p, &mut pool.lock().unwrap());
        seen.unmapped = Some(unmapped);
        seen.targets = targets;
        seen.released = release(m, rmap, pool);
    });
    // Asked again once the switch returned.
    let released_after = release(m, rmap, pool);

    let seen = seen.lock().unwrap();
    assert_eq!(m.violations(), [], "a pooled frame was freed while cached");
    assert!(seen.cached, "the read in the window filled CPU 0's TLB");
    assert_eq!(seen.unmapped, Some(Unmapped::Held(SwapResult::Success)));
    assert_eq!(
        seen.targets,
        CpuSet::single(cpu0),
        "P's generation waits for CPU 0"
    );
    assert_eq!(seen.released, [], "the pool handed P back in the window");
    assert_eq!(
        released_after,
        [],
        "the pool handed P back after the switch, while CPU 0 caches it"
    );
    assert!(w.caches(0, p));
    assert!(quiescent_flush(&w.cpu(0)));
    assert_eq!(release(m, rmap, pool), [p]);
    assert_eq!(m.violations(), []);
    assert_eq!(m.ipis_sent(), 0, "the pool got P back without an IPI");
}

#[test]
fn pool_waits_for_a_cpu_that_filled_in_the_window_of_a_switch_in_untagged() {
    pool_switch_in(false);
}

#[test]
fn pool_waits_for_a_cpu_that_filled_in_the_window_of_a_switch_in_tagged() {
    pool_switch_in(true);
}

/// The hook itself: it runs once per switch that loads a root, with the
/// switching CPU's old address space still current; a switch made inside
/// it runs none; a switch to the address space already loaded, and a
/// removed or reset hook, run none.
#[test]
fn the_switch_hook_runs_once_per_loading_switch_and_never_recursively() {
    let w = World::<X86Like>::new(false);
    let m = w.m;
    let runs = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&runs);
    let (s, t) = (w.s.clone(), w.t.clone());
    m.set_switch_hook(Some(Arc::new(move |cpu: &MockCpu<'_, X86Like>| {
        let current = cpu.current_mm().map(|mm| mm.asid());
        record.lock().unwrap().push((cpu.id().index(), current));
        // CPU 1 switches from inside the hook: no hook for that one.
        m.cpu(1).unwrap().switch_to(&s).unwrap();
    })));
    w.cpu(0).switch_to(&w.t).unwrap();
    w.cpu(0).switch_to(&w.t).unwrap();
    w.cpu(0).switch_to(&w.s).unwrap();
    assert_eq!(*runs.lock().unwrap(), [(0, None), (0, Some(t.asid()))]);
    assert_eq!(w.cpu(1).current_mm().map(|mm| mm.asid()), Some(w.s.asid()));
    m.set_switch_hook(None);
    w.cpu(0).switch_to(&w.t).unwrap();
    assert_eq!(runs.lock().unwrap().len(), 2);
    assert_eq!(m.violations(), []);

    let record = Arc::clone(&runs);
    m.set_switch_hook(Some(Arc::new(move |cpu: &MockCpu<'_, X86Like>| {
        record.lock().unwrap().push((cpu.id().index(), None));
    })));
    m.reset();
    let fresh = m.new_mm(asid(3)).unwrap();
    w.cpu(0).switch_to(&fresh).unwrap();
    assert_eq!(runs.lock().unwrap().len(), 2, "reset removed the hook");
}

/// A CPU switching away from a space it was lazy on (an idle CPU picking
/// a task of another process) runs the new root from the CR3 write on: in
/// the window its accesses to the new space fill its TLB as the hardware
/// would (they are not the refused user accesses of a lazy CPU), while its
/// TLB keeps nothing of the old space on an untagged TLB. Once the switch
/// returns it is no longer lazy.
#[test]
fn a_lazy_cpu_switching_away_fills_from_the_new_tables_in_the_window() {
    use tlb_batch::PageTable;
    for tagged in [false, true] {
        let w = World::<X86Like>::new(tagged);
        let q = w.rmap.spaces()[1].lookup(va(0)).frame();
        w.cpu(0).switch_to(&w.s).unwrap();
        w.cpu(0).read(va(0)).unwrap();
        w.cpu(0).enter_lazy().unwrap();
        assert!(matches!(w.cpu(0).read(va(0)), Err(Fault::LazyUserAccess { .. })));
        let read = Arc::new(Mutex::new(None));
        let seen = Arc::clone(&read);
        w.switch_cpu0_with(&w.t, move |cpu| {
            *seen.lock().unwrap() = Some(cpu.read(va(0)));
        });
        assert_eq!(
            *read.lock().unwrap(),
            Some(Ok(w.m.frame_data(q).unwrap())),
            "tagged {tagged}"
        );
        assert!(w.caches(0, q), "tagged {tagged}: filled in the window");
        assert_eq!(w.caches(0, w.p), tagged, "tagged {tagged}: the old space's entry");
        assert!(!w.cpu(0).is_lazy());
        assert_eq!(w.m.violations(), [], "tagged {tagged}");
    }
}
