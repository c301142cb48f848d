//! Reverse-map unmapping against the mock machine: every SwapResult,
//! shared frames, mlock, young pages, migration and hwpoison entries, the
//! dirty bit, batched versus unbatched runs, page_referenced, the typed
//! layer, and contract rule 5.

mod common;

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{asid, config, va};
use tlb_batch::arch::mock::{Fault, MockMachine, MockSpace, Model, NoRewalk, Violation, X86Like};
use tlb_batch::{
    change_protection, page_referenced, try_to_unmap, BoundedRmap, Error, Frame, Mapping, MappingFlags,
    MmTlbState, PageRange, PageTable, Pte, PteFlags, Released, Rmap, SwapResult, TlbFlushUnmapBatch,
    TtuFlags, UnmapBatch, Unmapped,
};

type Map<'a, M> = BoundedRmap<'a, MockSpace<'a, M>, MockMachine<M>, 128>;

fn rmap<'a, M: Model>(m: &'a MockMachine<M>) -> Map<'a, M> {
    // SAFETY: every test maps frames only through `map`, which registers
    // the mapping before any CPU can use it.
    unsafe { BoundedRmap::new(m) }
}

/// Maps `frame` at test page `page` of `space` and records it in `rm`.
fn map<'a, M: Model>(
    m: &MockMachine<M>,
    rm: &mut Map<'a, M>,
    space: &'a MockSpace<'a, M>,
    frame: Frame,
    page: usize,
    writable: bool,
    flags: MappingFlags,
) {
    m.map(space.mm(), va(page), frame, writable).unwrap();
    rm.add(frame, space, va(page), flags).unwrap();
}

/// Switches `cpu` to `mm` and writes (or reads) test page `page`, then
/// clears the accessed bit so that the page does not look young.
fn touch<M: Model>(m: &MockMachine<M>, cpu: usize, mm: &Arc<MmTlbState>, page: usize, write: bool) {
    let c = m.cpu(cpu).unwrap();
    if c.current_mm().map_or(true, |cur| !Arc::ptr_eq(&cur, mm)) {
        c.switch_to(mm).unwrap();
    }
    if write {
        c.write(va(page), 100 + cpu as u64).unwrap();
    } else {
        c.read(va(page)).unwrap();
    }
    m.test_and_clear_accessed(mm, va(page)).unwrap();
}

#[test]
fn unmapping_from_the_only_cpu_flushes_at_once_and_succeeds() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &space, f, 0, true, MappingFlags::empty());
    touch(&m, 0, space.mm(), 0, true);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let r = try_to_unmap(&cpu0, &rm, f, TtuFlags::BATCH_FLUSH, &mut batch).unwrap();
    // Nothing remote to save: flushed locally at once, no IPI, no batch.
    assert_eq!(r, SwapResult::Success);
    assert!(batch.is_empty());
    assert_eq!(m.ipis_sent(), 0);
    assert!(m.frame_dirty(f).unwrap(), "the dirty bit moved to the frame");
    assert_eq!(m.cached_translations(f), []);
}

#[test]
fn a_deferred_dirty_mapping_gives_success_cached_and_a_clean_one_success() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let (dirty, clean) = (m.alloc_frame().unwrap(), m.alloc_frame().unwrap());
    map(&m, &mut rm, &space, dirty, 0, true, MappingFlags::empty());
    map(&m, &mut rm, &space, clean, 1, false, MappingFlags::empty());
    touch(&m, 1, space.mm(), 0, true);
    touch(&m, 1, space.mm(), 1, false);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(&cpu0, &rm, dirty, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::SuccessCached)
    );
    assert_eq!(
        try_to_unmap(&cpu0, &rm, clean, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::Success)
    );
    // Both were deferred: CPU 1 still caches them until the flush.
    assert_eq!(batch.pending_pages(), 2);
    assert_eq!(m.cached_translations(dirty).len(), 1);
    assert_eq!(m.ipis_sent(), 0);
    batch.flush(&cpu0).unwrap();
    assert_eq!(m.ipis_sent(), 1);
    assert!(m.frame_dirty(dirty).unwrap() && !m.frame_dirty(clean).unwrap());
    m.free_frame(dirty).unwrap();
    m.free_frame(clean).unwrap();
    assert_eq!(m.violations(), []);
}

/// An rmap whose walk races with a fault that maps the frame again right
/// after the walk passed it.
struct Refaulting<'a, M: Model> {
    inner: &'a Map<'a, M>,
    space: &'a MockSpace<'a, M>,
    page: usize,
}

// SAFETY: delegates to the bounded rmap, which knows every mapping; the
// re-installed PTE is one of those mappings.
unsafe impl<'a, M: Model> Rmap for Refaulting<'a, M> {
    type Space = MockSpace<'a, M>;
    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let flow = self.inner.walk(frame, visit);
        // The fault comes after the unmap: only a cleared entry is refilled.
        if self.space.lookup(va(self.page)) == Pte::EMPTY {
            self.space.set(
                va(self.page),
                Pte::new(frame, PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::USER),
            );
        }
        flow
    }
    fn set_dirty(&self, frame: Frame) {
        self.inner.set_dirty(frame)
    }
}

#[test]
fn a_mapping_that_reappears_gives_again_and_again_cached() {
    for (write, expected) in [(false, SwapResult::Again), (true, SwapResult::AgainCached)] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let space = m.space(&m.new_mm(asid(1)).unwrap());
        let mut rm = rmap(&m);
        let f = m.alloc_frame().unwrap();
        // Read-only and clean, or writable and dirty: only the latter can
        // leave a writable TLB entry behind.
        map(&m, &mut rm, &space, f, 0, write, MappingFlags::empty());
        touch(&m, 1, space.mm(), 0, write);
        let racing = Refaulting {
            inner: &rm,
            space: &space,
            page: 0,
        };
        let cpu0 = m.cpu(0).unwrap();
        let mut batch = TlbFlushUnmapBatch::new();
        assert_eq!(
            try_to_unmap(&cpu0, &racing, f, TtuFlags::BATCH_FLUSH, &mut batch),
            Ok(expected)
        );
        assert_eq!(rm.mapcount(f), 1);
        // The removal it did make is owed by the batch.
        assert_eq!(batch.pending_pages(), 1);
        batch.flush(&cpu0).unwrap();
    }
}

#[test]
fn a_young_mapping_fails_once_and_loses_its_accessed_bit() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &space, f, 0, true, MappingFlags::empty());
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(space.mm()).unwrap();
    cpu1.write(va(0), 1).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::Fail)
    );
    let pte = m.pte(space.mm(), va(0)).unwrap();
    assert!(pte.maps(f) && !pte.is_accessed());
    // x86 needs no flush for the cleared bit: nothing pending, no IPI.
    assert!(batch.is_empty());
    // The next try finds it old; IGNORE_ACCESS would have skipped the check.
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::SuccessCached)
    );
    batch.flush(&cpu0).unwrap();
}

#[test]
fn mlocked_mappings_stop_the_walk_unless_ignored() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (a, b) = (
        m.space(&m.new_mm(asid(1)).unwrap()),
        m.space(&m.new_mm(asid(2)).unwrap()),
    );
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &a, f, 0, true, MappingFlags::SHARED);
    map(
        &m,
        &mut rm,
        &b,
        f,
        0,
        true,
        MappingFlags::SHARED | MappingFlags::LOCKED,
    );
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
    // MUNLOCK only asks: locked somewhere, so Mlock, and nothing unmapped.
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, flags | TtuFlags::MUNLOCK, &mut batch),
        Ok(SwapResult::Mlock)
    );
    assert_eq!(rm.mapcount(f), 2);
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, flags, &mut batch),
        Ok(SwapResult::Mlock)
    );
    // The walk reached the locked mapping after removing the unlocked one.
    assert_eq!(rm.mapcount(f), 1);
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, flags | TtuFlags::IGNORE_MLOCK, &mut batch),
        Ok(SwapResult::Success)
    );
    assert_eq!(rm.mapcount(f), 0);
    // With no lock left, MUNLOCK answers Again.
    rm.set_flags(f, &b, va(0), MappingFlags::SHARED);
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, flags | TtuFlags::MUNLOCK, &mut batch),
        Ok(SwapResult::Again)
    );
    batch.flush(&cpu0).unwrap();
}

#[test]
fn a_frame_shared_by_several_address_spaces_costs_one_ipi_per_cpu() {
    // Three address spaces, each running on two CPUs; CPU 6 reclaims ten
    // frames that all three share.
    const FRAMES: usize = 10;
    let m = MockMachine::new(config(7, 64)).unwrap();
    let spaces: Vec<_> = (0..3).map(|i| m.space(&m.new_mm(asid(i + 1)).unwrap())).collect();
    let mut rm = rmap(&m);
    let frames: Vec<_> = (0..FRAMES).map(|_| m.alloc_frame().unwrap()).collect();
    for (s, space) in spaces.iter().enumerate() {
        for (i, &f) in frames.iter().enumerate() {
            map(&m, &mut rm, space, f, i, true, MappingFlags::SHARED);
        }
        for cpu in [2 * s, 2 * s + 1] {
            for i in 0..FRAMES {
                touch(&m, cpu, space.mm(), i, true);
            }
        }
    }
    let reclaimer = m.cpu(6).unwrap();
    let before = m.stats();
    let mut batch = TlbFlushUnmapBatch::new();
    for &f in &frames {
        assert_eq!(
            try_to_unmap(&reclaimer, &rm, f, TtuFlags::BATCH_FLUSH, &mut batch),
            Ok(SwapResult::SuccessCached)
        );
    }
    assert_eq!(batch.targets().len(), 6);
    let report = batch.flush(&reclaimer).unwrap();
    assert_eq!(report.ipis_sent, 6);
    assert_eq!(m.stats().since(&before).ipis_sent, 6);
    // Unbatched, the same work costs a shootdown per mapping: 2 IPIs each.
    assert_eq!(m.stale_entries(), []);
    for f in frames {
        assert!(m.frame_dirty(f).unwrap());
        m.free_frame(f).unwrap();
    }
    assert_eq!(m.violations(), []);
}

#[test]
fn migration_installs_entries_that_name_the_frame_and_fault() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let (w, r) = (m.alloc_frame().unwrap(), m.alloc_frame().unwrap());
    map(&m, &mut rm, &space, w, 0, true, MappingFlags::empty());
    map(&m, &mut rm, &space, r, 1, false, MappingFlags::empty());
    touch(&m, 1, space.mm(), 0, true);
    touch(&m, 1, space.mm(), 1, false);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let flags = TtuFlags::MIGRATION | TtuFlags::BATCH_FLUSH;
    assert_eq!(
        try_to_unmap(&cpu0, &rm, w, flags, &mut batch),
        Ok(SwapResult::SuccessCached)
    );
    assert_eq!(
        try_to_unmap(&cpu0, &rm, r, flags, &mut batch),
        Ok(SwapResult::Success)
    );
    batch.flush(&cpu0).unwrap();
    let (pw, pr) = (
        m.pte(space.mm(), va(0)).unwrap(),
        m.pte(space.mm(), va(1)).unwrap(),
    );
    assert!(pw.is_migration() && pw.frame() == w && pw.flags().contains(PteFlags::WAS_WRITABLE));
    assert!(pr.is_migration() && pr.frame() == r && !pr.flags().contains(PteFlags::WAS_WRITABLE));
    let cpu1 = m.cpu(1).unwrap();
    assert_eq!(cpu1.write(va(0), 5), Err(Fault::Migration { va: va(0) }));
    assert_eq!(cpu1.read(va(1)), Err(Fault::Migration { va: va(1) }));
    assert_eq!(
        m.frame_data(w),
        Ok(101),
        "nothing wrote the frame after the unmap"
    );
}

#[test]
fn poisoned_frames_get_hwpoison_entries_unless_ignored() {
    for (ignore, poisoned_entry) in [(false, true), (true, false)] {
        let m = MockMachine::new(config(1, 64)).unwrap();
        let space = m.space(&m.new_mm(asid(1)).unwrap());
        let mut rm = rmap(&m);
        let f = m.alloc_frame().unwrap();
        map(&m, &mut rm, &space, f, 0, true, MappingFlags::empty());
        m.poison_frame(f).unwrap();
        let mut flags = TtuFlags::IGNORE_ACCESS;
        if ignore {
            flags |= TtuFlags::IGNORE_HWPOISON;
        }
        let mut batch = TlbFlushUnmapBatch::new();
        let cpu0 = m.cpu(0).unwrap();
        assert_eq!(
            try_to_unmap(&cpu0, &rm, f, flags, &mut batch),
            Ok(SwapResult::Success)
        );
        assert_eq!(m.pte(space.mm(), va(0)).unwrap().is_hwpoison(), poisoned_entry);
        cpu0.switch_to(space.mm()).unwrap();
        let expected = if poisoned_entry {
            Fault::HwPoison { va: va(0) }
        } else {
            Fault::NotMapped { va: va(0) }
        };
        assert_eq!(cpu0.read(va(0)), Err(expected));
    }
}

/// The observable end state of a run: every PTE and every frame's dirty
/// flag and data.
fn end_state<M: Model>(m: &MockMachine<M>, spaces: &[MockSpace<'_, M>], frames: &[Frame]) -> Vec<String> {
    let mut out = Vec::new();
    for s in spaces {
        for i in 0..frames.len() {
            out.push(format!("{:?}", m.pte(s.mm(), va(i)).unwrap()));
        }
    }
    for &f in frames {
        out.push(format!(
            "{f:?} dirty={} data={}",
            m.frame_dirty(f).unwrap(),
            m.frame_data(f).unwrap()
        ));
    }
    out
}

/// One reclaim sequence: two address spaces on CPUs 0-3 share 40 frames,
/// half of them written; CPU 4 unmaps them all (with or without batching),
/// flushes, writes the dirty ones out and frees them.
fn reclaim_sequence(batched: bool) -> (Vec<String>, u64) {
    const FRAMES: usize = 40;
    let m = MockMachine::new(config(5, 128)).unwrap();
    let spaces: Vec<_> = (0..2).map(|i| m.space(&m.new_mm(asid(i + 1)).unwrap())).collect();
    let mut rm = rmap(&m);
    let frames: Vec<_> = (0..FRAMES).map(|_| m.alloc_frame().unwrap()).collect();
    for (s, space) in spaces.iter().enumerate() {
        for (i, &f) in frames.iter().enumerate() {
            map(&m, &mut rm, space, f, i, true, MappingFlags::SHARED);
            for cpu in [2 * s, 2 * s + 1] {
                touch(&m, cpu, space.mm(), i, i % 2 == 0);
            }
        }
    }
    let reclaimer = m.cpu(4).unwrap();
    let flags = if batched {
        TtuFlags::BATCH_FLUSH
    } else {
        TtuFlags::empty()
    };
    let mut batch = TlbFlushUnmapBatch::new();
    for &f in &frames {
        let r = try_to_unmap(&reclaimer, &rm, f, flags, &mut batch).unwrap();
        assert!(r.is_unmapped());
        assert_eq!(r.is_cached(), batched);
    }
    batch.flush_dirty(&reclaimer).unwrap();
    for &f in frames.iter().filter(|&&f| m.frame_dirty(f).unwrap()) {
        m.start_io(f).unwrap();
        m.end_io(f).unwrap();
    }
    let state = end_state(&m, &spaces, &frames);
    batch.flush(&reclaimer).unwrap();
    for &f in &frames {
        m.free_frame(f).unwrap();
    }
    assert_eq!(m.violations(), []);
    (state, m.stats().ipis_sent)
}

#[test]
fn batched_and_unbatched_runs_end_in_the_same_state_with_fewer_ipis() {
    let (batched_state, batched_ipis) = reclaim_sequence(true);
    let (plain_state, plain_ipis) = reclaim_sequence(false);
    assert_eq!(batched_state, plain_state);
    // Unbatched: 40 frames x 2 address spaces x 2 CPUs. Batched: one flush
    // point (the dirty flush) reaching 4 CPUs.
    assert_eq!(plain_ipis, 160);
    assert_eq!(batched_ipis, 4);
}

/// Something a test runs at a chosen instant inside an unmap.
type Action<'m> = Box<dyn FnOnce() + Send + 'm>;

/// A [`MockSpace`] that runs a one-shot action just before or just after
/// the next [`exchange`](PageTable::exchange) reaches the machine's PTE (the
/// unmap has already looked at the entry and chosen to clear it; its flush
/// comes after), and keeps every value an exchange returned. The exchange
/// itself is the machine's: the wrapper only says *when*, so a test can put
/// a hardware write at an exact point of `try_to_unmap` instead of hoping
/// the OS schedules it there.
struct AtClear<'m, M: Model> {
    space: MockSpace<'m, M>,
    before: Mutex<Option<Action<'m>>>,
    after: Mutex<Option<Action<'m>>>,
    returned: Mutex<Vec<Pte>>,
}

impl<'m, M: Model> AtClear<'m, M> {
    fn new(m: &'m MockMachine<M>, mm: &Arc<MmTlbState>) -> Self {
        AtClear {
            space: m.space(mm),
            before: Mutex::new(None),
            after: Mutex::new(None),
            returned: Mutex::new(Vec::new()),
        }
    }

    fn before_next_clear(&self, f: impl FnOnce() + Send + 'm) {
        *self.before.lock().unwrap() = Some(Box::new(f));
    }

    fn after_next_clear(&self, f: impl FnOnce() + Send + 'm) {
        *self.after.lock().unwrap() = Some(Box::new(f));
    }

    /// What the exchanges since the last call returned.
    fn take_returned(&self) -> Vec<Pte> {
        std::mem::take(&mut *self.returned.lock().unwrap())
    }
}

// SAFETY: every operation is the wrapped `MockSpace`'s; `exchange` only
// runs test code before and after the (atomic) exchange.
unsafe impl<M: Model> PageTable for AtClear<'_, M> {
    fn tlb_state(&self) -> &MmTlbState {
        self.space.tlb_state()
    }

    fn lookup(&self, va: u64) -> Pte {
        self.space.lookup(va)
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        let before = self.before.lock().unwrap().take();
        if let Some(f) = before {
            f();
        }
        let old = self.space.exchange(va, new);
        self.returned.lock().unwrap().push(old);
        let after = self.after.lock().unwrap().take();
        if let Some(f) = after {
            f();
        }
        old
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        self.space.test_and_clear_accessed(va)
    }

    fn set(&self, va: u64, pte: Pte) {
        self.space.set(va, pte);
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        self.space.next_populated(range)
    }
}

type AtClearMap<'a, 'm, M> = BoundedRmap<'a, AtClear<'m, M>, MockMachine<M>, 8>;

/// The PTE every round starts from: present, writable, clean and old.
fn clean_writable(f: Frame) -> Pte {
    Pte::new(f, PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::USER)
}

/// The property, checked after every unmap: if a write landed in the frame
/// since it was last cleaned, the unmap's one exchange returned the dirty
/// bit and the frame is marked dirty. Returns whether a write landed.
fn check_dirty_kept<M: Model>(
    m: &MockMachine<M>,
    f: Frame,
    before: u64,
    returned: &[Pte],
    what: &str,
) -> bool {
    assert_eq!(returned.len(), 1, "{what}: one exchange per unmap");
    let landed = m.frame_data(f).unwrap() != before;
    if landed {
        assert!(
            returned[0].is_dirty(),
            "{what}: a write landed but the exchange returned a clean PTE {:?}",
            returned[0]
        );
        assert!(
            m.frame_dirty(f).unwrap(),
            "{what}: a write landed and the exchange returned {:?}, but the frame is not marked dirty",
            returned[0]
        );
    }
    landed
}

/// How CPU 1's write reaches the PTE's dirty bit.
#[derive(Clone, Copy, Debug, PartialEq)]
enum WritePath {
    /// TLB miss: the walk sets the dirty bit in its locked update.
    Miss,
    /// CPU 1 first reads the page, so it caches a clean entry: x86 walks
    /// again to set the bit, `NoRewalk` sets it in place.
    CachedClean,
}

/// When CPU 1 writes, relative to CPU 0's unmap.
#[derive(Clone, Copy, Debug, PartialEq)]
enum WriteAt {
    /// After the previous round's flush and the remap, before the unmap
    /// starts.
    BeforeUnmap,
    /// Inside the unmap, after it looked at the PTE (still clean) and right
    /// before the exchange.
    JustBeforeClear,
    /// Inside the unmap, right after the exchange and before the flush: the
    /// write must fault and the frame stay clean (the control case, which
    /// shows the dirty check can tell the two apart).
    JustAfterClear,
}

/// One round per case: map the frame clean, have CPU 1 write at the case's
/// instant, unmap from CPU 0 (immediate flush), check the property and the
/// case's expected outcome, clean the frame. Returns how many writes
/// landed. One thread, synchronous IPIs: the schedule is the code's.
fn dirty_bit_rounds<M: Model>(rounds: usize, cases: &[(WritePath, WriteAt)]) -> usize {
    let m = MockMachine::<M>::with_model(config(2, 64)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let space = AtClear::new(&m, &mm);
    // SAFETY: the frame's only mapping is recorded before any CPU uses it.
    let mut rm: AtClearMap<'_, '_, M> = unsafe { BoundedRmap::new(&m) };
    let f = m.alloc_frame().unwrap();
    space.set(va(0), clean_writable(f));
    rm.add(f, &space, va(0), MappingFlags::empty()).unwrap();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.switch_to(&mm).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let mut landed = 0;
    let mut token = 0u64;
    for round in 0..rounds {
        for &(path, at) in cases {
            token += 1;
            let before = m.frame_data(f).unwrap();
            assert!(!m.frame_dirty(f).unwrap());
            assert_eq!(m.cached_translations(f), [], "the last flush left nothing cached");
            if path == WritePath::CachedClean {
                cpu1.read(va(0)).unwrap();
                assert!(m.cached_translations(f).iter().all(|(_, e)| !e.dirty));
            }
            assert!(!m.pte(&mm, va(0)).unwrap().is_dirty());
            let wrote: Arc<Mutex<Option<Result<(), Fault>>>> = Arc::default();
            let write = {
                let (m, mm, wrote) = (&m, &mm, Arc::clone(&wrote));
                move || {
                    let clean = !m.pte(mm, va(0)).unwrap().is_dirty();
                    let r = cpu1.write(va(0), token);
                    *wrote.lock().unwrap() = Some(r);
                    // The bit comes from this very write.
                    assert!(r.is_err() || clean && m.pte(mm, va(0)).unwrap().is_dirty());
                }
            };
            match at {
                WriteAt::BeforeUnmap => write(),
                WriteAt::JustBeforeClear => space.before_next_clear(write),
                WriteAt::JustAfterClear => space.after_next_clear(write),
            }
            let r = try_to_unmap(&cpu0, &rm, f, TtuFlags::IGNORE_ACCESS, &mut batch).unwrap();
            assert_eq!(r, SwapResult::Success);
            assert!(batch.is_empty(), "flushed at once");
            let wrote = wrote.lock().unwrap().take().expect("CPU 1 wrote");
            let returned = space.take_returned();
            let case = format!("round {round}, {path:?} {at:?}");
            let hit = check_dirty_kept(&m, f, before, &returned, &case);
            if at == WriteAt::JustAfterClear {
                assert_eq!(wrote, Err(Fault::NotMapped { va: va(0) }), "{case}");
                assert!(
                    !hit && !returned[0].is_dirty() && !m.frame_dirty(f).unwrap(),
                    "{case}"
                );
            } else {
                assert_eq!(wrote, Ok(()), "{case}");
                assert!(
                    hit && m.frame_data(f).unwrap() == token,
                    "{case}: the write landed"
                );
                landed += 1;
            }
            assert_eq!(m.cached_translations(f), [], "{case}: flushed");
            // Clean the page (as a completed write-out does) and map it
            // again, writable and clean.
            m.start_io(f).unwrap();
            m.end_io(f).unwrap();
            space.set(va(0), clean_writable(f));
        }
    }
    assert_eq!(m.violations(), []);
    landed
}

#[test]
fn a_dirty_bit_set_by_hardware_during_the_clear_is_never_lost() {
    // Whenever a write landed in the frame, the unmap's exchange returned
    // the dirty bit and the frame is marked dirty; each round puts CPU 1's
    // write at a fixed point (between the last flush and the clear, the
    // last instant before the exchange, just after it), so every round
    // checks the case that matters, whatever the host's load.
    const ROUNDS: usize = 200;
    use WriteAt::*;
    use WritePath::*;
    let x86 = [
        (Miss, BeforeUnmap),
        (Miss, JustBeforeClear),
        (CachedClean, BeforeUnmap),
        (CachedClean, JustBeforeClear),
        (Miss, JustAfterClear),
    ];
    assert_eq!(dirty_bit_rounds::<X86Like>(ROUNDS, &x86), 4 * ROUNDS);
    // Without the re-walk, a write through a cached clean entry sets the
    // bit in place (while the PTE still maps the frame).
    let no_rewalk = [
        (CachedClean, BeforeUnmap),
        (CachedClean, JustBeforeClear),
        (Miss, JustAfterClear),
    ];
    assert_eq!(dirty_bit_rounds::<NoRewalk>(ROUNDS, &no_rewalk), 2 * ROUNDS);
}

#[test]
fn a_dirty_bit_set_by_hardware_racing_the_clear_is_never_lost() {
    // The same property with the write truly concurrent with the exchange:
    // only a real race can put a write between an exchange's read and its
    // store (a non-atomic exchange loses the bit then). Bounded by rounds,
    // not time. In each round CPU 0 unmaps `PAGES` pages one after the
    // other and CPU 1 writes each once, hand-shaken page by page: CPU 0
    // releases CPU 1's write from inside the unmap, just before the
    // exchange, then one side spins a little before going on. The test
    // steers that delay towards where the two meet (a write that beat the
    // clear makes the next exchange come sooner, one that faulted after it
    // later), so that on an idle host many pages line the write up with
    // the exchange, whatever the host's speed. Whether a write lands
    // before the clear or faults after it is up to the scheduler: the
    // property is checked for every page either way, and nothing is
    // required of how many writes beat the clear (the test above covers
    // that deterministically).
    //
    // Synchronous delivery: CPU 0's flush reaches CPU 1's TLB at once
    // (after the access CPU 1 may be in the middle of), so CPU 0 never
    // waits for a busy host to schedule CPU 1 just to take an interrupt.
    // A side that waits for the other spins briefly, then sleeps until
    // woken; CPU 0 waits only once a round, for CPU 1 to finish its
    // writes, and then checks and remaps every page.
    const ROUNDS: usize = 250;
    const PAGES: usize = 8;
    // Spin-loop iterations, either side.
    const MAX_OFFSET: isize = 1 << 10;
    const MAX_STEP: isize = 1 << 8;
    // How long a waiting side spins before it sleeps: long enough that on
    // an idle host CPU 1 is still spinning when CPU 0 releases its next
    // write (it then reacts in a few instructions, so the steering can
    // line the two up closely); a busy host costs at most this much per
    // wait.
    const PATIENCE: Duration = Duration::from_micros(500);
    common::within(300, || {
        // CPU 0 has released this many writes (counted across rounds).
        let go = AtomicUsize::new(0);
        // How long CPU 1 spins once released.
        let writer_delay = AtomicUsize::new(0);
        // CPU 1 has made this many writes; whether each of this round's
        // landed.
        let written = AtomicUsize::new(0);
        let landed: [AtomicBool; PAGES] = Default::default();
        // A side failed: the other stops waiting for it.
        let stop = AtomicBool::new(false);
        // Waits until `done`, or until the other side failed (false).
        let wait = |done: &dyn Fn() -> bool| {
            let start = Instant::now();
            while !done() {
                if stop.load(Ordering::SeqCst) {
                    return false;
                }
                if start.elapsed() < PATIENCE {
                    core::hint::spin_loop();
                } else {
                    std::thread::park();
                }
            }
            true
        };
        let failure = Mutex::new(None);
        // Runs one side; a panic stops the other side instead of leaving it
        // waiting, and is raised once both are done.
        let side = |other: &std::thread::Thread, body: &mut dyn FnMut()| {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
                stop.store(true, Ordering::SeqCst);
                other.unpark();
                failure.lock().unwrap().get_or_insert(p);
            }
        };
        let (mut early, mut late) = (0, 0);
        let m = MockMachine::new(config(2, 64)).unwrap();
        let mm = m.new_mm(asid(1)).unwrap();
        let space = AtClear::new(&m, &mm);
        // SAFETY: each frame's only mapping is recorded before any CPU uses
        // it.
        let mut rm: AtClearMap<'_, '_, X86Like> = unsafe { BoundedRmap::new(&m) };
        let frames: Vec<Frame> = (0..PAGES).map(|_| m.alloc_frame().unwrap()).collect();
        for (page, &f) in frames.iter().enumerate() {
            space.set(va(page), clean_writable(f));
            rm.add(f, &space, va(page), MappingFlags::empty()).unwrap();
        }
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        cpu1.switch_to(&mm).unwrap();
        let unmapper = std::thread::current();
        std::thread::scope(|s| {
            let writer = s.spawn(|| {
                side(&unmapper, &mut || {
                    for n in 1..=ROUNDS * PAGES {
                        if !wait(&|| go.load(Ordering::SeqCst) >= n) {
                            return;
                        }
                        for _ in 0..writer_delay.load(Ordering::SeqCst) {
                            core::hint::spin_loop();
                        }
                        let page = va((n - 1) % PAGES);
                        let r = cpu1.write(page, n as u64);
                        assert!(r == Ok(()) || r == Err(Fault::NotMapped { va: page }), "{r:?}");
                        landed[(n - 1) % PAGES].store(r.is_ok(), Ordering::SeqCst);
                        written.store(n, Ordering::SeqCst);
                        unmapper.unpark();
                    }
                });
            });
            let writer = writer.thread();
            side(writer, &mut || {
                let mut batch = TlbFlushUnmapBatch::new();
                // Positive: CPU 0 spins before the exchange; negative: CPU 1
                // spins before the write. Its step grows by one while the
                // outcome repeats and halves when it flips, so that it soon
                // dithers about where the two meet. It learns each outcome
                // as soon as CPU 1 reports it, without waiting for it.
                let (mut offset, mut step, mut last_early): (isize, isize, bool) = (0, 1, false);
                let mut learned = 0;
                let mut learn = |upto: usize| {
                    for n in learned + 1..=upto {
                        let early = landed[(n - 1) % PAGES].load(Ordering::SeqCst);
                        step = if early == last_early { step + 1 } else { step / 2 }.clamp(1, MAX_STEP);
                        last_early = early;
                        offset =
                            if early { offset - step } else { offset + step }.clamp(-MAX_OFFSET, MAX_OFFSET);
                    }
                    learned = learned.max(upto);
                    offset
                };
                for round in 0..ROUNDS {
                    let before: Vec<u64> = frames.iter().map(|&f| m.frame_data(f).unwrap()).collect();
                    let mut returned = Vec::new();
                    for (page, &f) in frames.iter().enumerate() {
                        let n = round * PAGES + page + 1;
                        let offset = learn(written.load(Ordering::SeqCst));
                        let delay = offset.max(0).unsigned_abs();
                        writer_delay.store(offset.min(0).unsigned_abs(), Ordering::SeqCst);
                        let (go, release) = (&go, writer.clone());
                        space.before_next_clear(move || {
                            go.store(n, Ordering::SeqCst);
                            release.unpark();
                            for _ in 0..delay {
                                core::hint::spin_loop();
                            }
                        });
                        let r = try_to_unmap(&cpu0, &rm, f, TtuFlags::IGNORE_ACCESS, &mut batch);
                        // Released already, unless the unmap never reached
                        // the exchange (then the checks below say so).
                        go.store(n, Ordering::SeqCst);
                        writer.unpark();
                        assert_eq!(r, Ok(SwapResult::Success));
                        returned.push(space.take_returned());
                    }
                    // This round's writes are done, before or after the clears.
                    if !wait(&|| written.load(Ordering::SeqCst) >= (round + 1) * PAGES) {
                        return;
                    }
                    learn((round + 1) * PAGES);
                    for (page, &f) in frames.iter().enumerate() {
                        let what = format!("round {round}, page {page}");
                        let hit = check_dirty_kept(&m, f, before[page], &returned[page], &what);
                        assert_eq!(hit, landed[page].load(Ordering::SeqCst), "{what}: CPU 1's write");
                        *if hit { &mut early } else { &mut late } += 1;
                        m.start_io(f).unwrap();
                        m.end_io(f).unwrap();
                        space.set(va(page), clean_writable(f));
                    }
                }
            });
        });
        if let Some(p) = failure.into_inner().unwrap() {
            std::panic::resume_unwind(p);
        }
        eprintln!("racing the clear: {early} writes landed before it, {late} faulted after it");
        assert_eq!(early + late, ROUNDS * PAGES);
        assert_eq!(m.violations(), []);
    });
}

#[test]
fn page_referenced_counts_and_clears_without_ipis_on_x86() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (a, b) = (
        m.space(&m.new_mm(asid(1)).unwrap()),
        m.space(&m.new_mm(asid(2)).unwrap()),
    );
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &a, f, 0, true, MappingFlags::SHARED);
    map(&m, &mut rm, &b, f, 3, true, MappingFlags::SHARED);
    for (cpu, space, page) in [(1, &a, 0), (2, &b, 3)] {
        let c = m.cpu(cpu).unwrap();
        c.switch_to(space.mm()).unwrap();
        c.read(va(page)).unwrap();
    }
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let r = page_referenced(&cpu0, &rm, f, &mut batch).unwrap();
    assert_eq!((r.referenced, r.mapped, r.mlocked), (2, 2, false));
    assert!(batch.is_empty(), "x86 clears accessed bits without a flush");
    assert_eq!(m.ipis_sent(), 0);
    // Cleared: a second look finds the page old.
    assert_eq!(page_referenced(&cpu0, &rm, f, &mut batch).unwrap().referenced, 0);
    // An mlocked mapping is reported and stops the walk.
    rm.set_flags(f, &b, va(3), MappingFlags::LOCKED);
    assert!(page_referenced(&cpu0, &rm, f, &mut batch).unwrap().mlocked);
}

#[test]
fn page_referenced_batches_its_flushes_where_clearing_needs_one() {
    let m = MockMachine::<NoRewalk>::with_model(config(3, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let frames: Vec<_> = (0..5).map(|_| m.alloc_frame().unwrap()).collect();
    for (i, &f) in frames.iter().enumerate() {
        map(&m, &mut rm, &space, f, i, true, MappingFlags::empty());
        for cpu in [1, 2] {
            let c = m.cpu(cpu).unwrap();
            if c.current_mm().is_none() {
                c.switch_to(space.mm()).unwrap();
            }
            c.read(va(i)).unwrap();
        }
    }
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    for &f in &frames {
        assert_eq!(page_referenced(&cpu0, &rm, f, &mut batch).unwrap().referenced, 1);
    }
    // Five frames, one flush point: one IPI per CPU caching them.
    assert_eq!(m.ipis_sent(), 0);
    assert_eq!(batch.pending_pages(), 5);
    assert!(!batch.has_writable() && !space.mm().batched_flush_pending());
    assert_eq!(batch.flush(&cpu0).unwrap().ipis_sent, 2);
    assert_eq!(m.all_entries(), []);
}

#[test]
fn skipping_the_accessed_flush_misjudges_age_but_loses_no_data() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &space, f, 0, true, MappingFlags::empty());
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(space.mm()).unwrap();
    cpu1.write(va(0), 1).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(page_referenced(&cpu0, &rm, f, &mut batch).unwrap().referenced, 1);
    // CPU 1 keeps using the page through its cached entry: the accessed bit
    // is not set again, so the page looks unused although it is hot.
    cpu1.write(va(0), 2).unwrap();
    assert_eq!(page_referenced(&cpu0, &rm, f, &mut batch).unwrap().referenced, 0);
    // The reclaimer acts on that wrong age; the data survives all the same.
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::SuccessCached)
    );
    cpu1.write(va(0), 3).unwrap(); // still allowed: before the flush point
    batch.flush_dirty(&cpu0).unwrap();
    assert!(cpu1.write(va(0), 4).is_err(), "no write after the dirty flush");
    assert!(m.frame_dirty(f).unwrap());
    m.start_io(f).unwrap();
    assert_eq!(
        m.frame_data(f),
        Ok(3),
        "the last write before the flush is what goes to disk"
    );
    m.end_io(f).unwrap();
    m.free_frame(f).unwrap();
    assert_eq!(m.violations(), []);
}

/// mprotect done without contract rule 5: walks the range, changes present
/// PTEs, flushes what it changed, but ignores a pending batched flush.
fn mprotect_ignoring_pending_batches<M: Model>(m: &MockMachine<M>, space: &MockSpace<'_, M>, pages: usize) {
    let cpu0 = m.cpu(0).unwrap();
    for i in 0..pages {
        let pte = space.lookup(va(i));
        if pte.is_present() {
            let old = space.clear(va(i));
            space.set(va(i), Pte(old.0 & !PteFlags::WRITABLE.bits()));
            tlb_batch::flush_tlb_page(&cpu0, space.tlb_state(), va(i)).unwrap();
        }
    }
}

#[test]
fn mprotect_flushes_a_pending_batch_first() {
    for with_rule_5 in [false, true] {
        let m = MockMachine::new(config(3, 64)).unwrap();
        let space = m.space(&m.new_mm(asid(1)).unwrap());
        let mut rm = rmap(&m);
        let frames: Vec<_> = (0..2).map(|_| m.alloc_frame().unwrap()).collect();
        for (i, &f) in frames.iter().enumerate() {
            map(&m, &mut rm, &space, f, i, true, MappingFlags::empty());
            touch(&m, 1, space.mm(), i, true);
        }
        // The reclaimer on CPU 2 unmaps page 0 and defers the flush.
        let reclaimer = m.cpu(2).unwrap();
        let mut batch = TlbFlushUnmapBatch::new();
        assert_eq!(
            try_to_unmap(&reclaimer, &rm, frames[0], TtuFlags::BATCH_FLUSH, &mut batch),
            Ok(SwapResult::SuccessCached)
        );
        // The owner write-protects both pages.
        if with_rule_5 {
            let n = change_protection(&m.cpu(0).unwrap(), &space, common::pages(0, 2), |p| {
                Pte(p.0 & !PteFlags::WRITABLE.bits())
            })
            .unwrap();
            assert_eq!(n, 1, "only page 1 was still mapped");
        } else {
            mprotect_ignoring_pending_batches(&m, &space, 2);
        }
        let stale = m.check_coherent(space.mm(), common::pages(0, 2));
        let write = m.cpu(1).unwrap().write(va(0), 9);
        if with_rule_5 {
            assert_eq!(stale, 0);
            assert_eq!(m.violations(), []);
            assert_eq!(write, Err(Fault::NotMapped { va: va(0) }));
        } else {
            // CPU 1 can still write the page after mprotect returned.
            assert_eq!(stale, 1);
            assert_eq!(
                m.violations(),
                [Violation::StaleAfterChange {
                    cpu: m.cpu(1).unwrap().id(),
                    va: va(0),
                    writable: true
                }]
            );
            assert_eq!(write, Ok(()));
        }
        assert!(
            m.cpu(1).unwrap().write(va(1), 9).is_err(),
            "page 1 is read-only now"
        );
        batch.flush(&reclaimer).unwrap();
    }
}

#[test]
fn the_typed_batch_returns_frames_only_through_the_flush() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let frames: Vec<_> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    for (i, &f) in frames.iter().enumerate() {
        let flags = if i == 3 {
            MappingFlags::LOCKED
        } else {
            MappingFlags::empty()
        };
        map(&m, &mut rm, &space, f, i, true, flags);
        touch(&m, 1, space.mm(), i, true);
    }
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = UnmapBatch::<2>::new();
    let mut outcomes = Vec::new();
    for &f in &frames[..3] {
        outcomes.push(
            batch
                .try_to_unmap(&cpu0, &rm, common::owned(f), TtuFlags::empty())
                .unwrap(),
        );
    }
    assert_eq!(outcomes[0], Unmapped::Held(SwapResult::SuccessCached));
    assert_eq!(outcomes[1], Unmapped::Held(SwapResult::SuccessCached));
    // Full: nothing was done to frame 2.
    assert!(matches!(&outcomes[2], Unmapped::Full(f) if f.frame() == frames[2]));
    assert!(m.pte(space.mm(), va(2)).unwrap().maps(frames[2]));
    {
        let io = batch.flush_dirty(&cpu0).unwrap();
        assert_eq!(io.report().map(|r| r.ipis_sent), Some(1));
        assert_eq!(io.frames().count(), 2);
        for w in io.frames() {
            m.start_io(w.frame()).unwrap();
            m.end_io(w.frame()).unwrap();
        }
    }
    let flushed = batch.flush(&cpu0).unwrap();
    assert_eq!(
        flushed.report().ipis_sent,
        0,
        "flush_dirty already flushed everything"
    );
    assert_eq!(flushed.len(), 2);
    assert!(!flushed.is_empty());
    for released in flushed {
        let Released::Unmapped(owned) = released else {
            panic!("{released:?} is still mapped")
        };
        m.free_frame(owned.into_frame()).unwrap();
    }
    // An mlocked frame loses no mapping, owes nothing, and comes straight back.
    let locked = batch
        .try_to_unmap(&cpu0, &rm, common::owned(frames[3]), TtuFlags::empty())
        .unwrap();
    assert!(matches!(
        locked,
        Unmapped::Returned { ref frame, result: SwapResult::Mlock } if frame.frame() == frames[3]
    ));
    assert!(batch.is_empty());
    let nothing = batch.flush(&cpu0).unwrap();
    assert!(nothing.is_empty());
    assert_eq!(nothing.report(), tlb_batch::ShootdownReport::default());
    assert_eq!(m.violations(), []);
}

#[test]
fn bad_input_is_an_error() {
    let m = MockMachine::<X86Like>::new(config(1, 8)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut small: BoundedRmap<'_, MockSpace<'_>, MockMachine, 1> =
        // SAFETY: this map is only used to test `add`'s errors.
        unsafe { BoundedRmap::new(&m) };
    assert_eq!(
        small.add(Frame(1), &space, 0x1001, MappingFlags::empty()),
        Err(Error::Unaligned { addr: 0x1001 })
    );
    small
        .add(Frame(1), &space, 0x1000, MappingFlags::empty())
        .unwrap();
    assert_eq!(
        small.add(Frame(2), &space, 0x2000, MappingFlags::empty()),
        Err(Error::RmapFull { capacity: 1 })
    );
    let cpu0 = m.cpu(0).unwrap();
    assert_eq!(
        change_protection(&cpu0, &space, PageRange::new(0x7fff_ffff_e000, 4).unwrap(), |p| p),
        Err(Error::NonCanonical {
            addr: 0x8000_0000_0000
        })
    );
    // A frame nobody maps: nothing to do, and it says so.
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(&cpu0, &small, Frame(9), TtuFlags::empty(), &mut batch),
        Ok(SwapResult::Success)
    );
    assert_eq!(
        page_referenced(&cpu0, &small, Frame(9), &mut batch)
            .unwrap()
            .mapped,
        0
    );
    assert!(small.remove(Frame(1), &space, 0x1000));
    assert!(small.is_empty());
}

/// `BoundedRmap`'s bookkeeping: a mapping is named by frame, address and
/// address space together, and each call says what it found.
#[test]
fn the_bounded_rmap_names_a_mapping_by_frame_address_and_space() {
    let m = MockMachine::<X86Like>::new(config(1, 8)).unwrap();
    let (a, b) = (
        m.space(&m.new_mm(asid(1)).unwrap()),
        m.space(&m.new_mm(asid(2)).unwrap()),
    );
    let none = MappingFlags::empty();
    // SAFETY: only the bookkeeping is tested; no CPU uses these mappings.
    let mut rm: BoundedRmap<'_, MockSpace<'_>, MockMachine, 8> = unsafe { BoundedRmap::new(&m) };
    assert!(rm.is_empty());
    assert_eq!(rm.len(), 0);
    for (f, space, page) in [(1, &a, 0), (1, &b, 0), (1, &a, 1), (2, &a, 2)] {
        rm.add(Frame(f), space, va(page), none).unwrap();
    }
    assert_eq!(rm.len(), 4);
    assert!(!rm.is_empty());
    // One of the three differs in each: no match.
    let near_misses = [(2, &a, 0), (1, &a, 2), (2, &b, 2)];
    for (f, space, page) in near_misses {
        assert!(!rm.set_flags(Frame(f), space, va(page), MappingFlags::LOCKED));
        assert!(!rm.remove(Frame(f), space, va(page)));
    }
    assert_eq!(rm.len(), 4);
    assert!(rm.set_flags(Frame(1), &a, va(1), MappingFlags::LOCKED));
    assert!(rm.remove(Frame(1), &b, va(0)));
    assert!(!rm.remove(Frame(1), &b, va(0)), "already gone");
    assert_eq!(rm.len(), 3);
    let mut seen = Vec::new();
    let _ = rm.walk(Frame(1), &mut |mp| {
        seen.push((mp.va, mp.flags, std::ptr::eq(mp.space, &a)));
        ControlFlow::Continue(())
    });
    seen.sort_by_key(|s| s.0);
    assert_eq!(seen, [(va(0), none, true), (va(1), MappingFlags::LOCKED, true)]);
    assert_eq!(rm.remove_frame(Frame(1)), 2);
    assert_eq!(rm.remove_frame(Frame(1)), 0);
    assert_eq!(rm.len(), 1);
    assert_eq!(rm.remove_frame(Frame(2)), 1);
    assert!(rm.is_empty());
}

/// Page state that only records dirt: it relies on the trait's default for
/// hwpoison.
struct DirtOnly(Mutex<Vec<Frame>>);

impl tlb_batch::PageState for DirtOnly {
    fn set_dirty(&self, frame: Frame) {
        self.0.lock().unwrap().push(frame);
    }
}

/// A kernel without hwpoison support need not say so: by default no frame
/// is poisoned, and the dirty bit still reaches its page state.
#[test]
fn page_state_without_hwpoison_support_poisons_nothing() {
    let m = MockMachine::<X86Like>::new(config(1, 8)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let pages = DirtOnly(Mutex::new(Vec::new()));
    // SAFETY: the frame's only mapping is recorded before any CPU uses it.
    let mut rm: BoundedRmap<'_, MockSpace<'_>, DirtOnly, 4> = unsafe { BoundedRmap::new(&pages) };
    let f = m.alloc_frame().unwrap();
    m.map(space.mm(), va(0), f, true).unwrap();
    rm.add(f, &space, va(0), MappingFlags::empty()).unwrap();
    assert!(!rm.is_hwpoisoned(f));
    let cpu0 = m.cpu(0).unwrap();
    cpu0.switch_to(space.mm()).unwrap();
    cpu0.write(va(0), 7).unwrap();
    m.test_and_clear_accessed(space.mm(), va(0)).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, TtuFlags::empty(), &mut batch).unwrap(),
        SwapResult::Success
    );
    assert_eq!(*pages.0.lock().unwrap(), [f]);
}

/// What a wrapped table's `next_populated` answers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Answer {
    /// An address below the range asked about.
    Below,
    /// An address past the range asked about.
    Past,
    /// A misaligned address inside the range.
    Misaligned,
}

/// A mock table that answers `next_populated` outside the question (which
/// the crate must not trust).
struct Stray<'a> {
    space: MockSpace<'a>,
    answer: Answer,
}

/// A mock table that leaves `next_populated` to the trait's default.
struct Plain<'a> {
    space: MockSpace<'a>,
}

/// Implements `PageTable` for a wrapper of a `MockSpace` in field `space`,
/// forwarding everything but what follows the type.
macro_rules! forward_page_table {
    ($ty:ident $(, $extra:item)?) => {
        // SAFETY: every operation is the wrapped `MockSpace`'s, but
        // `next_populated` where given, which never skips an entry (its
        // answers are outside the range, which skips nothing, or inside
        // its first page).
        unsafe impl PageTable for $ty<'_> {
            fn tlb_state(&self) -> &MmTlbState {
                self.space.tlb_state()
            }
            fn lookup(&self, va: u64) -> Pte {
                self.space.lookup(va)
            }
            fn exchange(&self, va: u64, new: Pte) -> Pte {
                self.space.exchange(va, new)
            }
            fn test_and_clear_accessed(&self, va: u64) -> bool {
                self.space.test_and_clear_accessed(va)
            }
            fn set(&self, va: u64, pte: Pte) {
                self.space.set(va, pte);
            }
            $($extra)?
        }
    };
}

forward_page_table!(Plain);
forward_page_table!(
    Stray,
    fn next_populated(&self, range: PageRange) -> Option<u64> {
        let page = tlb_batch::PAGE_SIZE;
        range.last().map(|last| match self.answer {
            Answer::Below => range.start() - 5 * page,
            Answer::Past => last + 2 * page,
            Answer::Misaligned => range.start() + 123,
        })
    }
);

/// Protects test pages 2..6 of 8 through `wrap`'s table read-only and
/// checks that exactly those changed.
fn protect_through<'m, T: PageTable>(m: &'m MockMachine, wrap: impl FnOnce(MockSpace<'m>) -> T) {
    let mm = m.new_mm(asid(1)).unwrap();
    for page in 0..8 {
        let f = m.alloc_frame().unwrap();
        m.map(&mm, va(page), f, true).unwrap();
    }
    let table = wrap(m.space(&mm));
    let cpu0 = m.cpu(0).unwrap();
    let changed = change_protection(&cpu0, &table, common::pages(2, 6), |p| {
        Pte::new(p.frame(), p.flags() - PteFlags::WRITABLE)
    })
    .unwrap();
    assert_eq!(changed, 4);
    for page in 0..8 {
        let writable = m.pte(&mm, va(page)).unwrap().is_writable();
        assert_eq!(writable, !(2..6).contains(&page), "page {page}");
    }
}

/// A table's `next_populated` is a hint: the default skips nothing, an
/// answer outside the range is ignored (the walk goes on from the range's
/// start), and exactly the range's pages change, whatever the table says.
#[test]
fn range_operations_take_next_populated_as_a_hint() {
    protect_through(&MockMachine::new(config(1, 16)).unwrap(), |space| Plain { space });
    for answer in [Answer::Below, Answer::Past, Answer::Misaligned] {
        let m = MockMachine::new(config(1, 16)).unwrap();
        protect_through(&m, |space| Stray { space, answer });
    }
}

/// A typed unmap whose immediate flush failed (an architecture that never
/// defers, and the shootdown could not start): the frame stays in the batch,
/// counted as mapped with the error, and comes back only after the batch's
/// flush has paid the debt the failed flush left in it.
#[test]
fn a_typed_unmap_whose_immediate_flush_failed_holds_the_frame() {
    let m = MockMachine::<NoRewalk>::with_model(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &space, f, 0, true, MappingFlags::empty());
    touch(&m, 1, space.mm(), 0, true);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = UnmapBatch::<4>::new();
    let r = cpu0
        .in_shootdown(|| batch.try_to_unmap(&cpu0, &rm, common::owned(f), TtuFlags::empty()))
        .unwrap();
    let Ok(Unmapped::HeldMapped(tlb_batch::StillMapped::Failed(e))) = r else {
        panic!("{r:?}")
    };
    assert!(matches!(e, Error::ShootdownReentered { .. }));
    assert!(m.pte(space.mm(), va(0)).unwrap() == Pte::EMPTY, "the PTE went");
    assert_eq!(batch.tlb_batch().pending_pages(), 1, "the debt is in the batch");
    assert_eq!(m.cached_translations(f).len(), 1, "CPU 1 still caches it");
    let flushed = batch.flush(&cpu0).unwrap();
    assert_eq!(flushed.report().ipis_sent, 1);
    assert_eq!(m.cached_translations(f), []);
    for released in flushed {
        let Released::StillMapped(frame, _) = released else {
            panic!("{released:?}")
        };
        m.free_frame(frame.into_frame()).unwrap();
    }
    assert_eq!(m.violations(), []);
}
