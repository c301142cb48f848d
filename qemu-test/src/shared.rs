//! The scenario set both test kernels run (`qemu-scenarios/`), on this
//! machine: its [`Platform`] over the first [`PAGES`] entries of the test
//! mapping at [`TEST_BASE`](crate::TEST_BASE) (TEST_PT, in the main
//! address space), each of which maps its frame A or its frame B (statics
//! here, so identity-mapped as well), with the crate's real `X86_64`: every
//! shootdown sends flush IPIs, which the observers take in their interrupt
//! handler.
//!
//! The APs observe through the command [`OBSERVE`] (their read of a page
//! is the fault-recovering [`probe`], their write [`flow::write_probe`]),
//! CPU 0 drives. The reverse map and page table the crate's
//! `try_to_unmap`, `page_referenced` and `change_protection` walk are
//! [`TestRmap`] and [`TestSpace`]: TEST_PT's entries are x86 PTEs, which is
//! the crate's `Pte` encoding, so they are handed over as they are.
//!
//! The flush under test, and only that one (a round's setup flush is
//! always real, even in a `negative` run, so that a stale entry left by
//! one round cannot reach the next one's warm-up):
//! - [`Flush::ThisCpuOnly`]: the real `X86_64` on CPU 0, while the
//!   observers' handler acknowledges each request without flushing (the
//!   machinery of the kernel's `negative` control, switched on around that
//!   flush alone through [`REMOTE`]);
//! - [`Flush::Skipped`]: the same, and CPU 0's own invalidations skipped
//!   too ([`NoInvalidate`]); the page-table stores are published either
//!   way (x86 stores are seen by every walk in order).
//!
//! x86 sets accessed bits in hardware, so the reclaim flow runs; the crate
//! records no flush when it clears one (`ACCESSED_CLEAR_NEEDS_FLUSH` is
//! false on x86: a missed re-set only makes a page look older), so the
//! aging pass here flushes the aged pages itself with the flush under test.
//! Without that, the observers' cached entries would let them read the
//! hot pages without setting the bits again, and the flow could not say
//! which pages must be kept.

use core::ops::ControlFlow;
use core::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use tlb_batch::arch::x86_64::X86_64;
use tlb_batch::{
    change_protection, flush_tlb_page, flush_tlb_range, page_referenced, try_to_unmap, Arch, Asid, CpuId,
    CpuSet, Mapping, MappingFlags, MmTlbState, PageRange, PageTable, Pte, PteFlags, Rmap, SwapResult,
    TlbFlushUnmapBatch, TlbShootdown, TtuFlags,
};
use tlb_batch_qemu_scenarios as scenario;

use scenario::{BatchNote, Flush, Frame, Ipis, MprotectNote, Outcome, Platform, ReclaimNote};

use crate::{
    aps, arch, fatal, flow, hw, ipis_taken_by_aps, me, mm, probe, test_va, COMMAND, IDLE, ONLINE, TEST_BASE,
    TEST_PT, TLB,
};

/// The AP command that runs the scenarios' observer side until replaced.
pub const OBSERVE: u32 = 0x60;
/// Test pages the scenarios use (TEST_PT's first entries).
pub const PAGES: usize = scenario::MAX_PAGES;
const _: () = assert!(scenario::LIST_PAGES <= <X86_64 as Arch>::FULL_FLUSH_CEILING);
const _: () = assert!(PAGES > <X86_64 as Arch>::FULL_FLUSH_CEILING);
const _: () = assert!(PAGES <= crate::TEST_PAGES);

/// What the observers' flush-interrupt handler does with a request while
/// the scenarios run: [`FOLLOW`] the kernel's `negative` word (the rest of
/// the run), [`FLUSH`] (the scenarios' own flushes), [`SKIP`] (acknowledge
/// without flushing: the flush under test of a negative control).
pub static REMOTE: AtomicU8 = AtomicU8::new(FOLLOW);
pub const FOLLOW: u8 = 0;
pub const FLUSH: u8 = 1;
pub const SKIP: u8 = 2;

/// Present, writable (the accessed and dirty bits are the hardware's).
const PTE_RW: u64 = PteFlags::PRESENT.bits() | PteFlags::WRITABLE.bits();

/// A page-aligned frame a test page maps.
#[repr(C, align(4096))]
struct Page([AtomicU64; 512]);

static FRAMES_A: [Page; PAGES] = [const { Page([const { AtomicU64::new(0) }; 512]) }; PAGES];
static FRAMES_B: [Page; PAGES] = [const { Page([const { AtomicU64::new(0) }; 512]) }; PAGES];

/// The reclaim flow's "swap": the first word of each page written out.
static WRITTEN_OUT: [AtomicU64; PAGES] = [const { AtomicU64::new(0) }; PAGES];

fn frame_of(page: usize, frame: Frame) -> &'static Page {
    match frame {
        Frame::A => &FRAMES_A[page],
        Frame::B => &FRAMES_B[page],
    }
}

/// The crate's frame number of page `i`'s frame A.
fn frame_a(i: usize) -> tlb_batch::Frame {
    tlb_batch::Frame(FRAMES_A[i].0.as_ptr() as u64 >> 12)
}

/// The test page whose frame A is `frame`, if any.
fn page_of_frame_a(frame: tlb_batch::Frame) -> Option<usize> {
    FRAMES_A.iter().position(|p| p.0.as_ptr() as u64 == frame.addr())
}

/// The test pages `0..pages` as a range.
fn range(pages: usize) -> PageRange {
    match PageRange::new(TEST_BASE, pages as u64) {
        Ok(r) => r,
        Err(_) => fatal("the scenarios' test pages are not a page range"),
    }
}

/// The negative control [`Flush::Skipped`] on CPU 0: the crate's
/// shootdowns with the calling CPU's invalidations skipped; everything
/// else, the IPIs included, is the real `X86_64`'s (the observers skip
/// theirs through [`REMOTE`]).
pub struct NoInvalidate(pub X86_64);

// SAFETY: NOT sound, on purpose: the negative control shows that the
// scenarios notice a shootdown that invalidates nothing. Only the flush
// under test of such a run goes through it; every constant and every
// method but the three local invalidations is the real implementation's.
unsafe impl Arch for NoInvalidate {
    const CLEAN_WRITE_REWALK: bool = <X86_64 as Arch>::CLEAN_WRITE_REWALK;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = <X86_64 as Arch>::ACCESSED_CLEAR_NEEDS_FLUSH;
    const FULL_FLUSH_CEILING: usize = <X86_64 as Arch>::FULL_FLUSH_CEILING;
    const BROADCAST_INVALIDATE: bool = <X86_64 as Arch>::BROADCAST_INVALIDATE;

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
    fn fill_sets_accessed(&self) -> bool {
        self.0.fill_sets_accessed()
    }
    fn va_bits(&self) -> u32 {
        self.0.va_bits()
    }
    fn asid_bits(&self) -> u32 {
        self.0.asid_bits()
    }
    fn flush_local_page(&self, _asid: Asid, _va: u64) {}
    fn flush_local_asid(&self, _asid: Asid) {}
    fn flush_local_all(&self, _include_global: bool) {}
    fn send_flush_ipi(&self, targets: &CpuSet) {
        self.0.send_flush_ipi(targets)
    }
    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        // SAFETY: forwarded from our caller unchanged.
        unsafe { self.0.switch_address_space(asid, root) }
    }
}

/// While it lives, the observers acknowledge flush requests without
/// flushing; afterwards they flush them again.
struct RemoteSkipped;

impl RemoteSkipped {
    fn begin() -> RemoteSkipped {
        REMOTE.store(SKIP, Ordering::SeqCst);
        RemoteSkipped
    }
}

impl Drop for RemoteSkipped {
    fn drop(&mut self) {
        // Every shootdown made meanwhile has been acknowledged (the crate
        // waits for that), so no handler still reads SKIP for it.
        REMOTE.store(FLUSH, Ordering::SeqCst);
    }
}

/// Runs `$body` with `$a` bound to the `Arch` the flush under test
/// `$flush` names, the observers' handler set up to match.
macro_rules! under_test {
    ($flush:expr, $a:ident => $body:expr) => {{
        let real = arch();
        match $flush {
            Flush::AllCpus => {
                let $a = &real;
                $body
            }
            Flush::ThisCpuOnly => {
                let _skipped = RemoteSkipped::begin();
                let $a = &real;
                $body
            }
            Flush::Skipped => {
                let _skipped = RemoteSkipped::begin();
                let $a = &NoInvalidate(real);
                $body
            }
        }
    }};
}

/// The test pages' page table: TEST_PT's first [`PAGES`] entries.
pub struct TestSpace;

fn entry(va: u64) -> Option<&'static AtomicU64> {
    let page = (va.checked_sub(TEST_BASE)? / 4096) as usize;
    (page < PAGES && va & 0xfff == 0).then(|| &TEST_PT.0[page])
}

// SAFETY: TEST_PT is the leaf table the main address space (`mm()`, loaded
// on every CPU while the scenarios run) translates the test pages with;
// `exchange` and `test_and_clear_accessed` are single atomic operations,
// so an accessed or dirty bit the hardware sets is never lost between a
// read and a write; the entries are x86 PTEs, the crate's encoding. The
// defaults of `next_populated` and `with_table_locked` stay: one CPU
// changes the entries at a time (the driver).
unsafe impl PageTable for TestSpace {
    fn tlb_state(&self) -> &MmTlbState {
        mm()
    }

    fn lookup(&self, va: u64) -> Pte {
        entry(va).map_or(Pte::EMPTY, |e| Pte(e.load(Ordering::SeqCst)))
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        entry(va).map_or(Pte::EMPTY, |e| Pte(e.swap(new.0, Ordering::SeqCst)))
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        entry(va).is_some_and(|e| {
            e.fetch_and(!PteFlags::ACCESSED.bits(), Ordering::SeqCst) & PteFlags::ACCESSED.bits() != 0
        })
    }

    fn set(&self, va: u64, pte: Pte) {
        if let Some(e) = entry(va) {
            e.store(pte.0, Ordering::SeqCst);
        }
    }
}

/// The reverse map of the frames A: page `i`'s is mapped at most at test
/// page `i`.
pub struct TestRmap;

static SPACE: TestSpace = TestSpace;

/// Frames the reverse map was told are dirty.
static DIRTIED: AtomicU64 = AtomicU64::new(0);

// SAFETY: in the main address space a frame A is mapped only at its own
// test page (`set_pte` writes no other entry with it, and `map_all` maps
// TEST_PHYS frames, never these), so that one place is every mapping of it
// the crate must find. The kernel's identity map covers the frame too, as
// a linear map does: nothing here unmaps that or frees the frame.
unsafe impl Rmap for TestRmap {
    type Space = TestSpace;

    fn walk(
        &self,
        frame: tlb_batch::Frame,
        visit: &mut dyn FnMut(Mapping<'_, TestSpace>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        match page_of_frame_a(frame) {
            Some(page) => visit(Mapping {
                space: &SPACE,
                va: test_va(page),
                flags: MappingFlags::empty(),
            }),
            None => ControlFlow::Continue(()),
        }
    }

    fn set_dirty(&self, _frame: tlb_batch::Frame) {
        DIRTIED.fetch_add(1, Ordering::Relaxed);
    }
}

/// The scenarios' view of this machine.
pub struct Pc;

impl Pc {
    /// Unmaps the frames A of pages `0..pages` into one batch and flushes
    /// it once, with `a` as the `Arch`.
    fn unmap_with<A: Arch>(&self, a: &A, pages: usize) -> BatchNote {
        let before = TLB.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        let mut note = BatchNote::default();
        // The hardware set each entry's accessed bit when the observers
        // read the page: without IGNORE_ACCESS the unmap would only clear
        // it and answer Fail (aging is the reclaim flow's test).
        let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
        for i in 0..pages {
            // Writable entries: each unmap leaves a possibly writable TLB
            // entry for the batch's flush.
            match try_to_unmap(a, &TestRmap, frame_a(i), flags, &mut batch) {
                Ok(SwapResult::SuccessCached) => note.unmapped += 1,
                Ok(_) => {}
                Err(_) => fatal("try_to_unmap refused a test frame"),
            }
        }
        note.pending = batch.pending_pages() as u32;
        note.full_flush = batch.is_full_flush();
        if batch.flush(a).is_err() {
            fatal("the batch's flush failed");
        }
        let d = TLB.stats().since(&before);
        note.shootdowns = d.shootdowns;
        note.page_invalidations = d.local_page_flushes;
        note.full_invalidations = d.local_full_flushes;
        note
    }

    /// The reclaim flow's aging pass, with `a` as the `Arch`.
    fn age_with<A: Arch>(&self, a: &A, pages: usize) -> (u64, u64) {
        let before = TLB.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        let mut young = 0;
        for i in 0..pages {
            match page_referenced(a, &TestRmap, frame_a(i), &mut batch) {
                Ok(r) if r.referenced > 0 => young |= 1 << i,
                Ok(_) => {}
                Err(_) => fatal("page_referenced refused a test frame"),
            }
        }
        // The crate recorded no flush (x86): this kernel flushes the aged
        // pages itself, so that a touch after this sets the bit again.
        if flush_tlb_range(a, mm(), range(pages)).is_err() {
            fatal("flush_tlb_range refused the aged pages");
        }
        // Anything the crate did record would be a second shootdown here,
        // which the scenario counts as a mismatch.
        if batch.flush(a).is_err() {
            fatal("the aging batch's flush failed");
        }
        (young, TLB.stats().since(&before).shootdowns)
    }

    /// The reclaim flow's reclaim pass, with `a` as the `Arch`.
    fn reclaim_with<A: Arch>(&self, a: &A, pages: usize) -> ReclaimNote {
        let before = TLB.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        let mut note = ReclaimNote::default();
        for i in 0..pages {
            match page_referenced(a, &TestRmap, frame_a(i), &mut batch) {
                Ok(r) if r.referenced > 0 => {
                    note.young |= 1 << i;
                    continue;
                }
                Ok(_) => {}
                Err(_) => fatal("page_referenced refused a test frame"),
            }
            // Old: unmap it, its flush deferred to the batch (the accessed
            // bit is clear: no IGNORE_ACCESS needed).
            match try_to_unmap(a, &TestRmap, frame_a(i), TtuFlags::BATCH_FLUSH, &mut batch) {
                Ok(SwapResult::SuccessCached) => note.unmapped |= 1 << i,
                Ok(_) => {}
                Err(_) => fatal("try_to_unmap refused a test frame"),
            }
        }
        // Writable entries were unmapped: no CPU may write the frames
        // through a cached entry once their write-out starts.
        if batch.flush_dirty(a).is_err() {
            fatal("the reclaim batch's dirty flush failed");
        }
        let flushed = TLB.stats().since(&before).shootdowns > 0;
        for (i, frame) in FRAMES_A.iter().enumerate().take(pages) {
            if note.unmapped & 1 << i != 0 {
                WRITTEN_OUT[i].store(frame.0[0].load(Ordering::SeqCst), Ordering::Relaxed);
                if !flushed {
                    note.written_early += 1;
                }
            }
        }
        if batch.flush(a).is_err() {
            fatal("the reclaim batch's flush failed");
        }
        note.shootdowns = TLB.stats().since(&before).shootdowns;
        note
    }

    /// The mprotect scenario's change, with `a` as the `Arch`.
    fn mprotect_with<A: Arch>(&self, a: &A, unmapped: usize, pages: usize) -> MprotectNote {
        let mut batch = TlbFlushUnmapBatch::new();
        let mut note = MprotectNote::default();
        let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
        for i in 0..unmapped {
            match try_to_unmap(a, &TestRmap, frame_a(i), flags, &mut batch) {
                Ok(SwapResult::SuccessCached) => note.unmapped += 1,
                Ok(_) => {}
                Err(_) => fatal("try_to_unmap refused a test frame"),
            }
        }
        // The reclaimer's batch is left pending across the mprotect.
        note.pending_before = mm().batched_flush_pending();
        let read_only = |pte: Pte| Pte(pte.0 & !PteFlags::WRITABLE.bits());
        match change_protection(a, &SPACE, range(pages), read_only) {
            Ok(n) => note.changed = n as u32,
            Err(_) => fatal("change_protection failed"),
        }
        note.pending_after = mm().batched_flush_pending();
        if batch.flush(a).is_err() {
            fatal("the reclaimer's batch flush failed");
        }
        note
    }
}

impl Platform for Pc {
    fn cpu_count(&self) -> usize {
        ONLINE.load(Ordering::SeqCst)
    }
    fn this_cpu(&self) -> usize {
        me()
    }
    fn fill_frame(&self, page: usize, frame: Frame, value: u64) {
        frame_of(page, frame).0[0].store(value, Ordering::SeqCst);
    }
    fn set_pte(&self, page: usize, frame: Option<Frame>) {
        let pte = frame.map_or(0, |f| frame_of(page, f).0.as_ptr() as u64 | PTE_RW);
        TEST_PT.0[page].store(pte, Ordering::SeqCst);
    }
    fn publish(&self) {
        // x86 page walks see stores in program order; the SeqCst stores
        // and this fence keep the compiler from moving them past the
        // round's signal.
        core::sync::atomic::fence(Ordering::SeqCst);
    }
    fn flush_pages(&self, pages: usize) {
        if flush_tlb_range(&arch(), mm(), range(pages)).is_err() {
            fatal("flush_tlb_range refused the test pages");
        }
    }
    fn flush_page(&self, page: usize, flush: Flush) {
        let done = under_test!(flush, a => flush_tlb_page(a, mm(), test_va(page)));
        if done.is_err() {
            fatal("flush_tlb_page refused a test page");
        }
    }
    fn unmap_batched(&self, pages: usize, flush: Flush) -> BatchNote {
        under_test!(flush, a => self.unmap_with(a, pages))
    }
    fn full_flush_ceiling(&self) -> usize {
        <X86_64 as Arch>::FULL_FLUSH_CEILING
    }
    fn hw_access_flag(&self) -> bool {
        true
    }
    fn age_pages(&self, pages: usize, flush: Flush) -> (u64, u64) {
        under_test!(flush, a => self.age_with(a, pages))
    }
    fn reclaim_pages(&self, pages: usize, flush: Flush) -> ReclaimNote {
        under_test!(flush, a => self.reclaim_with(a, pages))
    }
    fn mprotect_pending(&self, unmapped: usize, pages: usize, flush: Flush) -> MprotectNote {
        under_test!(flush, a => self.mprotect_with(a, unmapped, pages))
    }
    fn write_page(&self, page: usize, value: u64) -> bool {
        flow::write_probe(test_va(page) + 8, value)
    }
    fn read_page(&self, page: usize) -> Option<u64> {
        probe(test_va(page))
    }
    fn label(&self) -> &'static str {
        // This kernel has scenarios of its own with similar names.
        "shared "
    }
    fn broadcast_shootdowns(&self) -> bool {
        // The crate's X86_64 sends flush IPIs (no INVLPGB).
        <X86_64 as Arch>::BROADCAST_INVALIDATE
    }
    fn ipis(&self) -> Ipis {
        let s = TLB.stats();
        Ipis {
            sent: s.ipis_sent,
            seen: ipis_taken_by_aps(),
            shootdowns: s.shootdowns,
        }
    }
    fn now_us(&self) -> u64 {
        hw::now_us()
    }
}

/// An AP's [`OBSERVE`] command: observes rounds until the command is
/// replaced, then reports idle.
pub fn observe(cpu: usize) {
    scenario::observe_while(&Pc, || COMMAND[cpu].load(Ordering::SeqCst) == OBSERVE);
    COMMAND[cpu].store(IDLE, Ordering::SeqCst);
}

/// Runs the set on every online CPU (CPU 0 drives), `flush` the flush
/// under test, and leaves the test mapping as `map_all` makes it, with no
/// CPU caching any of it. `None` when there are more CPUs than the set
/// coordinates.
pub fn run(flush: Flush) -> Option<[Outcome; scenario::SET]> {
    if ONLINE.load(Ordering::SeqCst) > scenario::MAX_CPUS {
        return None;
    }
    // Every CPU in the main address space (a flow may have left them in
    // its own), with nothing a negative control left cached.
    flow::load(None, aps());
    flow::scrub();
    REMOTE.store(FLUSH, Ordering::SeqCst);
    flow::start(aps(), OBSERVE, 0);
    let p = Pc;
    let outcomes = scenario::run_set(&p, PAGES, flush);
    flow::stop(aps());
    REMOTE.store(FOLLOW, Ordering::SeqCst);
    crate::map_all();
    flow::scrub();
    Some(outcomes)
}
