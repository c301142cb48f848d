//! Aging epochs (`Rmap::aged_epoch`, `Arch::FILL_SETS_ACCESSED`): a pooled
//! frame whose mappings were found with the accessed bit clear waits only
//! for the CPUs' flushes since its last aging, not for new ones; and every
//! way the bit can be clear while a CPU still caches the page (a refill
//! after the aging, a second aging, a remap, an mprotect whose flush
//! failed) makes the pool wait for a new flush. The oracle checks every
//! free; each test frees whatever the pool hands back.

mod common;

use std::sync::Arc;

use common::{asid, config, owned, va};
use tlb_batch::arch::mock::{MockConfig, MockCpu, MockKernel, MockMachine, MockRmap};
use tlb_batch::{
    change_protection, page_referenced, quiescent_flush, Frame, FramePool, FreeFrames, MappingFlags,
    MmTlbState, PageRange, Pte, PteFlags, Rmap, TlbFlushUnmapBatch, TtuFlags, UnmapBatch, Unmapped,
};

/// A machine of three CPUs: CPU 0 reclaims, CPU 1 runs the address space
/// (and caches its page), CPU 2 runs another one.
struct World {
    m: MockMachine,
}

impl World {
    fn new() -> Self {
        World {
            m: MockMachine::new(config(3, 64)).unwrap(),
        }
    }

    /// The same machine with tagged TLBs: a switch keeps the entries.
    fn tagged() -> Self {
        World {
            m: MockMachine::new(MockConfig {
                tagged_tlb: true,
                ..config(3, 64)
            })
            .unwrap(),
        }
    }
}

/// The address space with one page mapped (by `map`, or by `map_fresh`
/// when `fresh`), CPU 1 running it, CPU 2 running another space.
fn setup(w: &World, fresh: bool) -> (MockRmap<'_>, Frame, Arc<MmTlbState>) {
    let m = &w.m;
    let mm = m.new_mm(asid(1)).unwrap();
    let other = m.new_mm(asid(2)).unwrap();
    let rmap = MockRmap::new(m, vec![m.space(&mm), m.space(&other)]);
    let f = m.alloc_frame().unwrap();
    if fresh {
        rmap.map_fresh(f, 0, va(0), false, MappingFlags::empty()).unwrap();
    } else {
        rmap.map(f, 0, va(0), false, MappingFlags::empty()).unwrap();
    }
    m.cpu(0).unwrap().switch_to(&other).unwrap();
    m.cpu(1).unwrap().switch_to(&mm).unwrap();
    m.cpu(2).unwrap().switch_to(&other).unwrap();
    (rmap, f, other)
}

fn cpu(w: &World, c: usize) -> MockCpu<'_> {
    w.m.cpu(c).unwrap()
}

/// `page_referenced` from CPU 0; returns how many mappings were young.
fn age(w: &World, rmap: &MockRmap<'_>, f: Frame) -> usize {
    let mut scratch = TlbFlushUnmapBatch::new();
    let found = page_referenced(&cpu(w, 0), rmap, f, &mut scratch).unwrap();
    // x86-like hardware needs no flush after clearing accessed bits.
    assert!(scratch.is_empty());
    found.referenced
}

/// CPU 1 flushes by switching away and back (untagged TLB): it stays in
/// the address space's CPU set, with its TLB empty.
fn pass_by_switching(w: &World, rmap: &MockRmap<'_>, other: &Arc<MmTlbState>) {
    let c = cpu(w, 1);
    c.switch_to(other).unwrap();
    c.switch_to(rmap.spaces()[0].mm()).unwrap();
}

/// CPU 0 unmaps `f` (its flush deferred) and pools it; returns how many
/// frames the pool hands back at once, freed through the mock kernel.
fn unmap_pool_release(w: &World, rmap: &MockRmap<'_>, f: Frame, pool: &mut FramePool<8>) -> usize {
    let c0 = cpu(w, 0);
    let mut batch = UnmapBatch::<4>::new();
    let r = batch.try_to_unmap(&c0, rmap, owned(f), TtuFlags::IGNORE_ACCESS);
    assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    assert_eq!(pool.defer(&c0, &mut batch), Ok(1));
    release(w, rmap, pool)
}

/// What the pool hands back now, freed (the oracle checks the free).
fn release(w: &World, rmap: &MockRmap<'_>, pool: &mut FramePool<8>) -> usize {
    let mut back = pool.release_passed(&cpu(w, 0));
    let n = back.len();
    MockKernel::new(rmap).free_batch(back.frames_mut());
    assert!(back.is_empty());
    n
}

/// CPU 0 unmaps and pools `f`, which must stay pooled (CPU 1 may cache
/// it) until CPU 1's `quiescent_flush`, and come back then; the oracle
/// stays quiet.
fn pooled_until_cpu1_flushes(w: &World, rmap: &MockRmap<'_>, f: Frame, pool: &mut FramePool<8>) {
    assert_eq!(unmap_pool_release(w, rmap, f, pool), 0);
    assert!(quiescent_flush(&cpu(w, 1)), "CPU 1 owes the generation a flush");
    assert_eq!(release(w, rmap, pool), 1);
    no_violations(w);
}

fn no_violations(w: &World) {
    assert!(w.m.violations().is_empty(), "{:?}", w.m.violations());
}

#[test]
fn a_page_left_alone_since_its_aging_comes_back_without_any_new_flush() {
    let w = World::new();
    let (rmap, f, other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    assert_eq!(age(&w, &rmap, f), 1);
    assert!(rmap.aged_epoch(f).is_some());
    // CPU 1's TLB is emptied after the aging (any flush it makes anyway).
    pass_by_switching(&w, &rmap, &other);
    let mut pool = FramePool::<8>::new();
    assert_eq!(unmap_pool_release(&w, &rmap, f, &mut pool), 1);
    assert!(pool.is_empty());
    assert_eq!(w.m.ipis_sent(), 0);
    assert_eq!(w.m.stats().quiescent_flushes, 0);
    no_violations(&w);
}

#[test]
fn an_entry_cached_before_the_aging_keeps_the_frame_until_its_cpu_flushes() {
    let w = World::new();
    let (rmap, f, _other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    assert_eq!(age(&w, &rmap, f), 1);
    // CPU 1 still caches the page from before the aging.
    pooled_until_cpu1_flushes(&w, &rmap, f, &mut FramePool::new());
    assert_eq!(w.m.ipis_sent(), 0);
}

#[test]
fn a_refill_after_the_aging_needs_a_flush_after_the_unmap() {
    let w = World::new();
    let (rmap, f, other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    assert_eq!(age(&w, &rmap, f), 1);
    pass_by_switching(&w, &rmap, &other);
    // The refill sets the accessed bit again: the unmap sees it.
    cpu(&w, 1).read(va(0)).unwrap();
    pooled_until_cpu1_flushes(&w, &rmap, f, &mut FramePool::new());
}

#[test]
fn a_second_aging_that_clears_a_bit_moves_the_epoch() {
    let w = World::new();
    let (rmap, f, other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    assert_eq!(age(&w, &rmap, f), 1);
    let first = rmap.aged_epoch(f).unwrap();
    pass_by_switching(&w, &rmap, &other);
    cpu(&w, 1).read(va(0)).unwrap();
    // The second aging clears the refill's bit while CPU 1 keeps its entry.
    assert_eq!(age(&w, &rmap, f), 1);
    assert!(rmap.aged_epoch(f).unwrap() > first);
    pooled_until_cpu1_flushes(&w, &rmap, f, &mut FramePool::new());
}

#[test]
fn an_aging_that_clears_nothing_keeps_the_older_epoch() {
    let w = World::new();
    let (rmap, f, other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    assert_eq!(age(&w, &rmap, f), 1);
    let first = rmap.aged_epoch(f).unwrap();
    pass_by_switching(&w, &rmap, &other);
    // Nothing cached since: the second aging finds the bit clear.
    assert_eq!(age(&w, &rmap, f), 0);
    assert_eq!(rmap.aged_epoch(f), Some(first));
    let mut pool = FramePool::<8>::new();
    assert_eq!(unmap_pool_release(&w, &rmap, f, &mut pool), 1);
    no_violations(&w);
}

#[test]
fn an_aging_of_a_page_with_no_known_epoch_opens_one() {
    let w = World::new();
    let (rmap, f, other) = setup(&w, false);
    // Mapped by `map`: no epoch known, and the bit is clear.
    assert_eq!(rmap.aged_epoch(f), None);
    assert_eq!(age(&w, &rmap, f), 0);
    assert!(rmap.aged_epoch(f).is_some());
    pass_by_switching(&w, &rmap, &other);
    let mut pool = FramePool::<8>::new();
    assert_eq!(unmap_pool_release(&w, &rmap, f, &mut pool), 1);
    no_violations(&w);
}

#[test]
fn remapping_a_frame_forgets_its_aging() {
    let w = World::new();
    let (rmap, f, other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    assert_eq!(age(&w, &rmap, f), 1);
    pass_by_switching(&w, &rmap, &other);
    cpu(&w, 1).read(va(0)).unwrap();
    // A reclaimer unmaps the page with its flush deferred (CPU 1 keeps its
    // entry), and a fault maps the same frame again before that flush, as
    // a swap-cache hit does: the new entry's accessed bit is clear.
    let mut first = TlbFlushUnmapBatch::new();
    let r = tlb_batch::try_to_unmap(
        &cpu(&w, 0),
        &rmap,
        f,
        TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS,
        &mut first,
    );
    assert!(r.unwrap().is_unmapped());
    assert!(!first.is_empty());
    rmap.map(f, 0, va(0), false, MappingFlags::empty()).unwrap();
    assert_eq!(rmap.aged_epoch(f), None);
    pooled_until_cpu1_flushes(&w, &rmap, f, &mut FramePool::new());
    first.flush(&cpu(&w, 0)).unwrap();
}

#[test]
fn a_fresh_frame_never_read_needs_no_flush_and_a_read_one_does() {
    let w = World::new();
    let (rmap, f, _other) = setup(&w, true);
    assert_eq!(rmap.aged_epoch(f), Some(0));
    let mut pool = FramePool::<8>::new();
    assert_eq!(unmap_pool_release(&w, &rmap, f, &mut pool), 1);
    assert_eq!(w.m.stats().quiescent_flushes, 0);

    let g = w.m.alloc_frame().unwrap();
    rmap.map_fresh(g, 0, va(1), false, MappingFlags::empty()).unwrap();
    cpu(&w, 1).read(va(1)).unwrap();
    pooled_until_cpu1_flushes(&w, &rmap, g, &mut pool);
}

#[test]
fn map_fresh_of_a_frame_already_mapped_forgets_instead() {
    let w = World::new();
    let (rmap, f, _other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    rmap.map_fresh(f, 1, va(3), false, MappingFlags::SHARED).unwrap();
    assert_eq!(rmap.aged_epoch(f), None);
}

#[test]
fn change_protection_keeps_the_accessed_bit_even_when_its_flush_fails() {
    let w = World::new();
    let (rmap, f, other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    assert_eq!(age(&w, &rmap, f), 1);
    pass_by_switching(&w, &rmap, &other);
    cpu(&w, 1).read(va(0)).unwrap();
    // An update that would clear the accessed bit (and change nothing
    // else), whose flush fails: CPU 1 keeps its entry.
    let space = &rmap.spaces()[0];
    let clear_young = |p: Pte| Pte(p.0 & !PteFlags::ACCESSED.bits());
    let failed = cpu(&w, 0)
        .in_shootdown(|| change_protection(&cpu(&w, 0), space, PageRange::page(va(0)).unwrap(), clear_young))
        .unwrap();
    assert!(matches!(failed, Ok(0) | Err(_)), "{failed:?}");
    assert!(w.m.pte(space.mm(), va(0)).unwrap().is_accessed());
    pooled_until_cpu1_flushes(&w, &rmap, f, &mut FramePool::new());
}

/// A kernel's page descriptors that keep aging epochs, for a
/// `BoundedRmap`.
#[derive(Default)]
struct Pages(std::sync::Mutex<std::collections::HashMap<Frame, u64>>);

impl tlb_batch::PageState for Pages {
    fn set_dirty(&self, _frame: Frame) {}

    fn aged_epoch(&self, frame: Frame) -> Option<u64> {
        self.0.lock().unwrap().get(&frame).copied()
    }

    fn set_aged_epoch(&self, frame: Frame, epoch: Option<u64>) {
        let mut map = self.0.lock().unwrap();
        match epoch {
            Some(e) => map.insert(frame, e),
            None => map.remove(&frame),
        };
    }
}

#[test]
fn a_bounded_rmap_keeps_aging_epochs_in_the_page_state_and_add_forgets_them() {
    let w = World::new();
    let m = &w.m;
    let mm = m.new_mm(asid(1)).unwrap();
    let other = m.new_mm(asid(2)).unwrap();
    let space = m.space(&mm);
    let pages = Pages::default();
    // SAFETY: every mapping is added before a CPU can use it, and only the
    // crate clears accessed bits or writes entries after `add`.
    let mut rmap = unsafe { tlb_batch::BoundedRmap::<_, _, 4>::new(&pages) };
    let f = m.alloc_frame().unwrap();
    rmap.add(f, &space, va(0), MappingFlags::empty()).unwrap();
    m.map(&mm, va(0), f, false).unwrap();
    let (c0, c1) = (cpu(&w, 0), cpu(&w, 1));
    c0.switch_to(&other).unwrap();
    c1.switch_to(&mm).unwrap();
    c1.read(va(0)).unwrap();
    let mut scratch = TlbFlushUnmapBatch::new();
    assert_eq!(
        page_referenced(&c0, &rmap, f, &mut scratch).unwrap().referenced,
        1
    );
    let aged = pages.aged_epoch_of(f);
    assert!(aged.is_some());
    // A second mapping forgets the epoch (its entry starts clear).
    rmap.add(f, &space, va(1), MappingFlags::empty()).unwrap();
    assert_eq!(pages.aged_epoch_of(f), None);
    rmap.remove(f, &space, va(1));
    assert_eq!(
        page_referenced(&c0, &rmap, f, &mut scratch).unwrap().referenced,
        0
    );
    c1.switch_to(&other).unwrap();
    c1.switch_to(&mm).unwrap();
    // Passed since the aging: the pool hands the frame back at once.
    let mut batch = UnmapBatch::<4>::new();
    let r = batch.try_to_unmap(&c0, &rmap, owned(f), TtuFlags::IGNORE_ACCESS);
    assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    let mut pool = FramePool::<8>::new();
    assert_eq!(pool.defer(&c0, &mut batch), Ok(1));
    let mut back = pool.release_passed(&c0);
    assert_eq!(back.len(), 1);
    while let Some(f) = back.frames_mut().pop() {
        m.free_frame(f.into_frame()).unwrap();
    }
    no_violations(&w);
}

impl Pages {
    fn aged_epoch_of(&self, frame: Frame) -> Option<u64> {
        tlb_batch::PageState::aged_epoch(self, frame)
    }
}

#[test]
fn change_protection_keeps_the_accessed_bit_as_it_was_and_only_for_the_same_frame() {
    let w = World::new();
    let (rmap, f, _other) = setup(&w, false);
    let space = &rmap.spaces()[0];
    let c0 = cpu(&w, 0);
    let range = PageRange::page(va(0)).unwrap();
    let read_only = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
    // Never accessed: the bit stays clear.
    change_protection(&c0, space, range, read_only).unwrap();
    assert!(!w.m.pte(space.mm(), va(0)).unwrap().is_accessed());
    // Accessed, and `update` keeps the bit: it stays set.
    cpu(&w, 1).read(va(0)).unwrap();
    change_protection(&c0, space, range, read_only).unwrap();
    assert!(w.m.pte(space.mm(), va(0)).unwrap().is_accessed());
    // Accessed, then the entry moves to another frame: the new mapping
    // starts clear (nothing cached it yet).
    cpu(&w, 1).read(va(0)).unwrap();
    assert!(w.m.pte(space.mm(), va(0)).unwrap().is_accessed());
    let g = w.m.alloc_frame().unwrap();
    let moved = |p: Pte| Pte(p.0 & !PteFlags::ACCESSED.bits()).with_frame(g);
    change_protection(&c0, space, range, moved).unwrap();
    let now = w.m.pte(space.mm(), va(0)).unwrap();
    assert_eq!(now.frame(), g);
    assert!(!now.is_accessed());
    // An update that takes the entry away keeps nothing either.
    cpu(&w, 1).read(va(0)).unwrap();
    let gone = |p: Pte| Pte(p.0 & !(PteFlags::PRESENT | PteFlags::ACCESSED).bits());
    change_protection(&c0, space, range, gone).unwrap();
    assert!(!w.m.pte(space.mm(), va(0)).unwrap().is_accessed());
    no_violations(&w);
    let _ = f;
}

/// A reverse map that keeps no aging epochs (the trait's defaults).
struct Plain<'r, 'm>(&'r MockRmap<'m>);

// SAFETY: forwards the walk of a map that knows every mapping.
unsafe impl<'m> Rmap for Plain<'_, 'm> {
    type Space = tlb_batch::arch::mock::MockSpace<'m>;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(tlb_batch::Mapping<'_, Self::Space>) -> std::ops::ControlFlow<()>,
    ) -> std::ops::ControlFlow<()> {
        self.0.walk(frame, visit)
    }

    fn set_dirty(&self, frame: Frame) {
        self.0.set_dirty(frame);
    }
}

#[test]
fn maps_that_keep_no_aging_epochs_get_a_new_epoch_for_every_generation() {
    let w = World::new();
    let (rmap, f, other) = setup(&w, false);
    let m = &w.m;
    let mm = rmap.spaces()[0].mm().clone();
    cpu(&w, 1).read(va(0)).unwrap();
    // The kernel ages the page itself, which a map without epochs allows,
    // and CPU 1 flushes afterwards... but it cached the page before.
    cpu(&w, 1).switch_to(&other).unwrap();
    cpu(&w, 1).switch_to(&mm).unwrap();
    cpu(&w, 1).read(va(0)).unwrap();
    assert!(m.test_and_clear_accessed(&mm, va(0)).unwrap());
    let plain = Plain(&rmap);
    assert_eq!(plain.aged_epoch(f), None);
    let c0 = cpu(&w, 0);
    let mut batch = UnmapBatch::<4>::new();
    let r = batch.try_to_unmap(&c0, &plain, owned(f), TtuFlags::IGNORE_ACCESS);
    assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    let mut pool = FramePool::<8>::new();
    assert_eq!(pool.defer(&c0, &mut batch), Ok(1));
    assert!(pool.release_passed(&c0).is_empty(), "CPU 1 still caches the page");
    assert!(quiescent_flush(&cpu(&w, 1)));
    assert_eq!(release(&w, &rmap, &mut pool), 1);
    no_violations(&w);
}

#[test]
fn a_bounded_rmap_over_page_state_that_keeps_no_epochs_gets_new_epochs() {
    let w = World::new();
    let m = &w.m;
    let mm = m.new_mm(asid(1)).unwrap();
    let other = m.new_mm(asid(2)).unwrap();
    let space = m.space(&mm);
    // SAFETY: every mapping is added before a CPU can use it; the machine's
    // page state keeps no aging epochs.
    let mut rmap = unsafe { tlb_batch::BoundedRmap::<_, _, 4>::new(m) };
    let f = m.alloc_frame().unwrap();
    rmap.add(f, &space, va(0), MappingFlags::empty()).unwrap();
    m.map(&mm, va(0), f, false).unwrap();
    let (c0, c1) = (cpu(&w, 0), cpu(&w, 1));
    c0.switch_to(&other).unwrap();
    c1.switch_to(&mm).unwrap();
    // The kernel ages the page itself: CPU 1 cached it before.
    c1.read(va(0)).unwrap();
    assert!(m.test_and_clear_accessed(&mm, va(0)).unwrap());
    assert_eq!(rmap.aged_epoch(f), None);
    let mut batch = UnmapBatch::<4>::new();
    let r = batch.try_to_unmap(&c0, &rmap, owned(f), TtuFlags::IGNORE_ACCESS);
    assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    let mut pool = FramePool::<8>::new();
    assert_eq!(pool.defer(&c0, &mut batch), Ok(1));
    assert!(pool.release_passed(&c0).is_empty(), "CPU 1 still caches the page");
    assert!(quiescent_flush(&c1));
    let mut back = pool.release_passed(&c0);
    assert_eq!(back.len(), 1);
    while let Some(f) = back.frames_mut().pop() {
        m.free_frame(f.into_frame()).unwrap();
    }
    no_violations(&w);
}

#[test]
fn an_unmap_that_finds_the_page_young_moves_the_epoch_too() {
    let w = World::new();
    let (rmap, f, other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    assert_eq!(age(&w, &rmap, f), 1);
    let first = rmap.aged_epoch(f).unwrap();
    pass_by_switching(&w, &rmap, &other);
    cpu(&w, 1).read(va(0)).unwrap();
    // try_to_unmap honouring accessed bits finds the refill's bit, clears
    // it and gives up; CPU 1 keeps its entry.
    let mut scratch = TlbFlushUnmapBatch::new();
    let r = tlb_batch::try_to_unmap(&cpu(&w, 0), &rmap, f, TtuFlags::BATCH_FLUSH, &mut scratch).unwrap();
    assert_eq!(r, tlb_batch::SwapResult::Fail);
    assert!(scratch.is_empty());
    assert!(rmap.aged_epoch(f).unwrap() > first);
    pooled_until_cpu1_flushes(&w, &rmap, f, &mut FramePool::new());
}

/// An aging epoch that was never published (a map that kept it across a
/// machine reset, or broke `Rmap`'s contract) is not trusted: the pool
/// publishes a new epoch, so the CPUs' next flushes release the frame
/// instead of none ever doing so.
#[test]
fn an_aging_epoch_from_the_future_is_not_trusted() {
    let w = World::new();
    let (rmap, f, _other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    assert_eq!(age(&w, &rmap, f), 1);
    // Far beyond any epoch this machine has published.
    rmap.set_aged_epoch(f, Some(1 << 40));
    let mut pool = FramePool::<8>::new();
    pooled_until_cpu1_flushes(&w, &rmap, f, &mut pool);
    assert!(pool.is_empty());
    // Nor by the plain batch, even for a CPU that flushed everything since.
    let w = World::new();
    let (rmap, f, other) = setup(&w, false);
    cpu(&w, 1).read(va(0)).unwrap();
    assert_eq!(age(&w, &rmap, f), 1);
    pass_by_switching(&w, &rmap, &other);
    rmap.set_aged_epoch(f, Some(1 << 40));
    assert_eq!(unmap_flush_free(&w, &rmap, f), 1);
    no_violations(&w);
}

/// CPU 0 unmaps `f` (its flush deferred) and flushes the batch itself, no
/// pool; frees what comes back (the oracle checks the free) and returns
/// the IPIs the flush sent.
fn unmap_flush_free(w: &World, rmap: &MockRmap<'_>, f: Frame) -> usize {
    let c0 = cpu(w, 0);
    let mut batch = UnmapBatch::<4>::new();
    let r = batch.try_to_unmap(&c0, rmap, owned(f), TtuFlags::IGNORE_ACCESS);
    assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    let mut flushed = batch.flush(&c0).unwrap();
    let ipis = flushed.report().ipis_sent;
    MockKernel::new(rmap).free_batch(flushed.frames_mut());
    ipis
}

/// The plain batch's flush trusts the aging as the pool does: CPU 1
/// emptied its TLB after the aging and the unmap found the page
/// unaccessed, so the flush leaves CPU 1 out. Had it cached the page
/// again since (the bit set) or not flushed since the aging, it is
/// interrupted; the oracle checks each free.
#[test]
fn a_plain_batch_leaves_out_a_cpu_that_flushed_everything_since_the_aging() {
    for (flushed_since, refilled) in [(true, false), (false, false), (true, true)] {
        let w = World::new();
        let (rmap, f, other) = setup(&w, false);
        cpu(&w, 1).read(va(0)).unwrap();
        assert_eq!(age(&w, &rmap, f), 1);
        if flushed_since {
            pass_by_switching(&w, &rmap, &other);
        }
        if refilled {
            cpu(&w, 1).read(va(0)).unwrap();
        }
        let expected = usize::from(!flushed_since || refilled);
        assert_eq!(
            unmap_flush_free(&w, &rmap, f),
            expected,
            "flushed since the aging: {flushed_since}, refilled: {refilled}"
        );
        no_violations(&w);
    }
}

/// On a tagged TLB a switch flushes nothing, but a CPU that comes back to
/// a space flushed while it was away flushes that space's ASID first (its
/// catch-up): after the aging, that is as good as a pass for the space's
/// pages. The plain batch's flush then leaves it out: where the IPI would
/// not have kept it caught up anyway (a flush of another page came between
/// the batch's two unmaps, so its request carries no generation step), as
/// it is; where it would have, with a credit of the batch's step
/// (`tests/credit.rs`), so that its next load needs no catch-up. Coming
/// back with nothing flushed meanwhile, the CPU keeps its entries from
/// before the aging and is interrupted either way.
#[test]
fn a_plain_batch_leaves_out_a_cpu_that_flushed_the_asid_since_the_aging() {
    for (flushed_while_away, step_broken) in [(true, true), (true, false), (false, true)] {
        let w = World::tagged();
        let (rmap, f, other) = setup(&w, false);
        let mm = rmap.spaces()[0].mm().clone();
        let f2 = w.m.alloc_frame().unwrap();
        rmap.map(f2, 0, va(2), false, MappingFlags::empty()).unwrap();
        w.m.map_new(&mm, va(5), false).unwrap();
        for (frame, page) in [(f, 0), (f2, 2)] {
            cpu(&w, 1).read(va(page)).unwrap();
            assert_eq!(age(&w, &rmap, frame), 1);
        }
        cpu(&w, 1).switch_to(&other).unwrap();
        if flushed_while_away {
            tlb_batch::flush_tlb_mm(&cpu(&w, 0), &mm).unwrap();
        }
        let before = w.m.stats().catch_ups;
        cpu(&w, 1).switch_to(&mm).unwrap();
        assert_eq!(w.m.stats().catch_ups - before, u64::from(flushed_while_away));
        let c0 = cpu(&w, 0);
        let mut batch = UnmapBatch::<4>::new();
        for (i, frame) in [f, f2].into_iter().enumerate() {
            if i == 1 && step_broken {
                tlb_batch::flush_tlb_page(&c0, &mm, va(5)).unwrap();
            }
            let r = batch.try_to_unmap(&c0, &rmap, owned(frame), TtuFlags::IGNORE_ACCESS);
            assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
        }
        let mut flushed = batch.flush(&c0).unwrap();
        let case = format!("flushed while away: {flushed_while_away}, step broken: {step_broken}");
        let expected = usize::from(!flushed_while_away);
        assert_eq!(flushed.report().ipis_sent, expected, "{case}");
        MockKernel::new(&rmap).free_batch(flushed.frames_mut());
        no_violations(&w);
    }
}
