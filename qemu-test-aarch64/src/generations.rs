//! Flush generations on the real `Aarch64`: what the CPU sets decide on
//! hardware whose invalidations reach every CPU anyway.
//!
//! A broadcast `TLBI ... IS` needs no IPI, so generations save none here.
//! What they change is whether a flush is broadcast at all: a flush whose
//! targets are only the calling CPU is a local `TLBI`, and one with no
//! target is nothing. Two address spaces A and B (ASIDs 0x11 and 0x12,
//! over the kernel's own tables, which map the test page P non-global)
//! let AP 1 run A, switch to B, go lazy, while CPU 0, which never loads A,
//! remaps P and flushes A:
//!
//! 1. AP 1 runs A: the flush is one broadcast.
//! 2. AP 1 switched to B: it left A's CPU set, the flush targets nobody
//!    (no broadcast, no shootdown), and switching back catches up (one
//!    local `TLBI ASIDE1`).
//! 3. AP 1 lazy on A (`enter_lazy_tlb`): skipped the same way; it keeps
//!    TTBR0_EL1 and its TLB entries, so `leave_lazy_tlb` must catch up.
//!    The negative control `negative-catchup` leaves lazy mode through
//!    `tlb::SkipTlbi` (its local `TLBI ASIDE1` does nothing): AP 1 must
//!    then read the old frame, which TCG shows since no translation
//!    register is written.
//!
//! The frame pool: A's page P (read-only) unmapped into an `UnmapBatch`
//! and deferred into a `FramePool` while AP 1 runs A comes back at once
//! with no IPI (its `TLBI VAE1IS` went out as the page was added, and the
//! deferral completed it with one `DSB ISH`); once AP 1 switched away,
//! nobody else runs A, the unmap defers nothing and issues no TLBI at all
//! (AP 1 catches up when it comes back). Its line comes first, and its
//! result is part of the scenario's.
//!
//! `ipi_sync` (the teardown's wait for lockless walkers) does not look at
//! the CPU sets: it interrupts every other online CPU, lazy or not, since
//! a walker may run in any address space; the scenario counts that too.
//!
//! With the 64 KiB granule (`granule64`) it runs as it is: P is then a
//! 64 KiB test page, its frames 64 KiB, and A's and B's roots copies of
//! the 64-entry level 1 table (`mmu::root_copy`); its lines are the same.
//!
//! Last, the question whether a switch can have a negative control: AP 1
//! caches P in A, switches to B, P is remapped with no TLBI at all, and it
//! switches back (A's generation did not move: no catch-up) and reads P.
//! If it reads the old frame, TCG keeps ASID-tagged entries across a
//! TTBR0_EL1 change; the kernel prints what it found.

use core::mem::MaybeUninit;
use core::ops::ControlFlow;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tlb_batch::arch::aarch64 as a64;
use tlb_batch::{
    enter_lazy_tlb, flush_tlb_page, ipi_sync, leave_lazy_tlb, switch_mm, Arch, Asid, Frame, FramePool,
    Mapping, MappingFlags, MmTlbState, OwnedFrame, PageSize, PageTable, Pte, Rmap, TtuFlags, UnmapBatch,
    Unmapped,
};

use crate::{mmu, space, tlb, MAX_CPUS};

const NAME: &str = "generations";
/// The test page the scenario remaps (the last one).
const PAGE: usize = mmu::TEST_PAGES - 1;
const AP: usize = 1;
const ASID_A: u16 = 0x11;
const ASID_B: u16 = 0x12;

/// A frame P maps: 64 KiB-aligned and 64 KiB long, so that it serves the
/// 64 KiB granule whole (at 4 KiB P maps its first 4 KiB; only word 0 is
/// read).
#[repr(C, align(65536))]
struct Page([AtomicU64; 8192]);

#[link_section = ".bss_tail.frames"]
static FRAMES: [Page; 3] = [const { Page([const { AtomicU64::new(0) }; 8192]) }; 3];

static mut SPACES: MaybeUninit<[MmTlbState; 2]> = MaybeUninit::uninit();
static READY: AtomicBool = AtomicBool::new(false);
/// While set, AP 1 serves [`CMD`] from its wait loops.
static JOB: AtomicBool = AtomicBool::new(false);
static SKIP_CATCH_UP: AtomicBool = AtomicBool::new(false);
/// Per CPU: the step asked of it (0: none), and what it answered.
static CMD: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static RES: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per CPU: the space it loaded through these steps (0: the test space,
/// 1: A, 2: B).
static LOADED: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];

// Steps (the space index in the bits above 8 for SWITCH).
const SWITCH: u64 = 1;
const READ: u64 = 2;
const LAZY: u64 = 3;
const LEAVE_LAZY: u64 = 4;

fn space(i: u64) -> &'static MmTlbState {
    if i == 0 {
        return tlb::mm();
    }
    if !READY.load(Ordering::Acquire) {
        crate::fatal("the generations spaces used before they were built");
    }
    // SAFETY: written once by `run` before READY was published, never
    // written again.
    unsafe { &(*core::ptr::addr_of!(SPACES)).assume_init_ref()[i as usize - 1] }
}

fn frame_pa(i: usize) -> u64 {
    FRAMES[i].0.as_ptr() as u64
}

fn value(i: usize) -> u64 {
    0x6e6e_0000_0000 + i as u64
}

/// The AP side, called from every wait loop (`Platform::poll`).
pub fn serve() {
    let me = crate::cpu_index();
    if me == 0 || me >= MAX_CPUS || !JOB.load(Ordering::Acquire) {
        return;
    }
    while JOB.load(Ordering::Acquire) {
        tlb::poll();
        let cmd = CMD[me].load(Ordering::Acquire);
        if cmd == 0 {
            core::hint::spin_loop();
            continue;
        }
        let param = cmd >> 8;
        let a = *tlb::arch();
        let loaded = space(LOADED[me].load(Ordering::Relaxed));
        let result = match cmd & 0xff {
            SWITCH => {
                // SAFETY: every space here has the kernel's own tables, or
                // a copy of their root, as its root, which map everything
                // this CPU runs; `loaded`
                // is what it has loaded (interrupts are always masked).
                if unsafe { switch_mm(&a, Some(loaded), space(param)) }.is_err() {
                    crate::fatal("switch_mm refused a generations space");
                }
                LOADED[me].store(param, Ordering::Relaxed);
                0
            }
            READ => crate::boot::probe(mmu::test_va(PAGE)).unwrap_or(u64::MAX),
            LAZY => u64::from(enter_lazy_tlb(&a, loaded).is_ok()),
            LEAVE_LAZY => {
                let flushed = if SKIP_CATCH_UP.load(Ordering::Relaxed) {
                    leave_lazy_tlb(&tlb::SkipTlbi(a), loaded)
                } else {
                    leave_lazy_tlb(&a, loaded)
                };
                u64::from(flushed == Ok(true))
            }
            _ => 0,
        };
        RES[me].store(result, Ordering::Relaxed);
        CMD[me].store(0, Ordering::Release);
    }
}

/// Has AP 1 run `step` and returns its answer.
fn ask(step: u64) -> u64 {
    CMD[AP].store(step, Ordering::Release);
    while CMD[AP].load(Ordering::Acquire) != 0 {
        tlb::poll();
        core::hint::spin_loop();
    }
    RES[AP].load(Ordering::Relaxed)
}

fn switch_ap(to: u64) {
    ask(SWITCH | to << 8);
}

fn read() -> u64 {
    ask(READ)
}

/// Points P at frame `i`, published to every CPU's walks, with no TLBI.
fn set_p(i: usize) {
    mmu::test_pte(PAGE).store(frame_pa(i) | mmu::TEST_PAGE_FLAGS, Ordering::Release);
    a64::dsb_ishst();
    a64::isb();
}

/// Points P at frame `i` read-only (a frame pool takes only mappings
/// whose stale entries cannot write), with no TLBI.
fn set_p_read_only(i: usize) {
    mmu::test_pte(PAGE).store(
        frame_pa(i) | mmu::TEST_PAGE_FLAGS | mmu::AP_READ_ONLY,
        Ordering::Release,
    );
    a64::dsb_ishst();
    a64::isb();
}

/// Address space A as the crate's reverse-map code sees it: page P only.
struct SpaceA;

static SPACE_A: SpaceA = SpaceA;

fn entry(va: u64) -> Option<&'static AtomicU64> {
    (va == mmu::test_va(PAGE)).then(|| mmu::test_pte(PAGE))
}

// SAFETY: `exchange` and `test_and_clear_accessed` are single atomic
// operations on the descriptor (an access flag the hardware sets is never
// lost); the state is A's, whose ASID CPUs load with these tables; the
// defaults of the other methods hold (one CPU changes the entry).
unsafe impl PageTable for SpaceA {
    fn tlb_state(&self) -> &MmTlbState {
        space(1)
    }
    fn lookup(&self, va: u64) -> Pte {
        entry(va).map_or(Pte::EMPTY, |e| space::to_pte(e.load(Ordering::Acquire)))
    }
    fn exchange(&self, va: u64, new: Pte) -> Pte {
        entry(va).map_or(Pte::EMPTY, |e| {
            space::to_pte(e.swap(space::to_descriptor(new), Ordering::AcqRel))
        })
    }
    fn test_and_clear_accessed(&self, va: u64) -> bool {
        entry(va).is_some_and(|e| e.fetch_and(!mmu::AF, Ordering::AcqRel) & mmu::AF != 0)
    }
    fn set(&self, va: u64, pte: Pte) {
        if let Some(e) = entry(va) {
            e.store(space::to_descriptor(pte), Ordering::Release);
        }
    }
    /// P is a level 3 page descriptor: 4 KiB, or 64 KiB with the 64 KiB
    /// granule.
    fn entry_size(&self, _va: u64) -> PageSize {
        mmu::page_size()
    }
}

struct RmapA;

// SAFETY: this module's frames are mapped only at P, whose entry only this
// scenario writes while it runs: P is every user mapping of them.
unsafe impl Rmap for RmapA {
    type Space = SpaceA;
    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, SpaceA>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let pte = SPACE_A.lookup(mmu::test_va(PAGE));
        if pte.is_present() && pte.frame() == frame {
            visit(Mapping {
                space: &SPACE_A,
                va: mmu::test_va(PAGE),
                flags: MappingFlags::empty(),
            })
        } else {
            ControlFlow::Continue(())
        }
    }
    fn set_dirty(&self, _frame: Frame) {}
}

/// Unmaps frame `i` (at P) into a batch and defers it into `pool`:
/// (whether its flush was deferred, frames pooled).
fn unmap_into_pool(i: usize, pool: &mut FramePool<4>) -> (bool, usize) {
    let mut batch: UnmapBatch<1> = UnmapBatch::new();
    // SAFETY: the frame is a static of this module, mapped only at P; this
    // handle is the one claim on it until the pool hands it back.
    let frame = unsafe { OwnedFrame::new(Frame(frame_pa(i) >> 12)) };
    if !matches!(
        batch.try_to_unmap(tlb::arch(), &RmapA, frame, TtuFlags::IGNORE_ACCESS),
        Ok(Unmapped::Held(_))
    ) {
        crate::fatal("the generations page was not unmapped into the batch");
    }
    let deferred = batch.tlb_batch().pending_pages() > 0;
    match pool.defer(tlb::arch(), &mut batch) {
        Ok(n) => (deferred, n),
        Err(_) => crate::fatal("the frame pool refused the generations batch"),
    }
}

/// Takes back what `pool` releases without a shootdown: how many frames.
fn release(pool: &mut FramePool<4>) -> usize {
    let (frames, mapped) = pool.release_passed(tlb::arch()).into_parts();
    let n = frames.len() + mapped.len();
    // Statics of this module: nothing to free.
    for f in frames {
        let _ = f.into_frame();
    }
    for (f, _) in mapped {
        let _ = f.into_frame();
    }
    n
}

/// The pool part: A's page P unmapped into a frame pool while AP 1 runs
/// A, then after it switched away. Returns whether it passed.
fn pooled() -> bool {
    let mut pool: FramePool<4> = FramePool::new();
    // AP 1 runs A and caches P (frame 0, read-only).
    set_p_read_only(0);
    let _ = flush_a();
    let warm = read() == value(0);
    let before = tlb::TLB.stats();
    let (deferred, pooled) = unmap_into_pool(0, &mut pool);
    let released = release(&mut pool);
    let d = tlb::TLB.stats().since(&before);
    let faulted = read() == u64::MAX;

    // AP 1 switched to B: nobody else runs A.
    set_p_read_only(1);
    let _ = flush_a();
    let warm_away = read() == value(1);
    switch_ap(2);
    let before = tlb::TLB.stats();
    let (deferred_away, pooled_away) = unmap_into_pool(1, &mut pool);
    let released_away = release(&mut pool);
    let d_away = tlb::TLB.stats().since(&before);
    let catch_up = catch_ups();
    switch_ap(1);
    let catch_ups_back = catch_ups() - catch_up;
    let faulted_away = read() == u64::MAX;
    let ok = warm
        && deferred
        && pooled == 1
        && released == 1
        && d.ipis_sent == 0
        && faulted
        && warm_away
        && !deferred_away
        && pooled_away == 1
        && released_away == 1
        && d_away.ipis_sent == 0
        && d_away.broadcasts == 0
        && faulted_away
        && pool.is_empty();
    crate::say!(
        "generations, frame pool: AP {AP} on A: P unmapped with its flush deferred: {deferred}, {pooled} frame pooled \
         and {released} released at once with {} IPIs (page TLBIs issued on add: {}, broadcasts completing them: {}), \
         then AP {AP} faulted: {faulted}; AP {AP} switched to B: deferred: {deferred_away}, {pooled_away} pooled and \
         {released_away} released at once with {} IPIs (page TLBIs: {}, broadcasts: {}), catch-ups when back on A: \
         {catch_ups_back}, then AP {AP} faulted: {faulted_away}{}\n",
        d.ipis_sent,
        d.local_page_flushes,
        d.broadcasts,
        d_away.ipis_sent,
        d_away.local_page_flushes,
        d_away.broadcasts,
        if ok { "" } else { " (wrong)" },
    );
    ok
}

/// A flush of A's page P from CPU 0: (broadcasts, shootdowns) it made.
fn flush_a() -> (u64, u64) {
    let before = tlb::TLB.stats();
    if flush_tlb_page(tlb::arch(), space(1), mmu::test_va(PAGE)).is_err() {
        crate::fatal("flush_tlb_page refused the generations page");
    }
    let d = tlb::TLB.stats().since(&before);
    (d.broadcasts, d.shootdowns)
}

fn catch_ups() -> u64 {
    tlb::TLB.stats().catch_ups
}

/// Runs the scenario and the switch experiment; returns the scenario's
/// result.
pub fn run(bootargs: &[u8]) -> bool {
    if crate::ONLINE.load(Ordering::Acquire) < 2 {
        crate::say!("scenario {NAME}: skipped: one CPU\n");
        return true;
    }
    SKIP_CATCH_UP.store(crate::has_word(bootargs, b"negative-catchup"), Ordering::Relaxed);
    let (Ok(asid_a), Ok(asid_b)) = (Asid::new(ASID_A), Asid::new(ASID_B)) else {
        crate::fatal("the generations ASIDs are not user ASIDs");
    };
    // SAFETY: written once, before READY is published and before any AP
    // is asked to use the spaces.
    unsafe {
        (*core::ptr::addr_of_mut!(SPACES)).write([
            MmTlbState::new(asid_a, mmu::root_copy(0)),
            MmTlbState::new(asid_b, mmu::root_copy(1)),
        ]);
    }
    READY.store(true, Ordering::Release);
    for (i, f) in FRAMES.iter().enumerate() {
        f.0[0].store(value(i), Ordering::Release);
    }
    let saved = mmu::test_pte(PAGE).load(Ordering::Acquire);
    set_p(0);
    // Nothing cached P's old mapping in A or B; in the test space, drop it
    // everywhere (P's entry is shared by the three spaces).
    if flush_tlb_page(tlb::arch(), tlb::mm(), mmu::test_va(PAGE)).is_err() {
        crate::fatal("flush_tlb_page refused a test page");
    }
    JOB.store(true, Ordering::Release);

    // 1. AP 1 runs A.
    switch_ap(1);
    let warm = read() == value(0);
    set_p(1);
    let (running_broadcasts, _) = flush_a();
    let running_value = read();
    let running_read = running_value == value(1);

    // 2. AP 1 switched to B.
    switch_ap(2);
    set_p(2);
    let (away_broadcasts, away_shootdowns) = flush_a();
    let before = catch_ups();
    switch_ap(1);
    let back_catch_ups = catch_ups() - before;
    let back_value = read();
    let back_read = back_value == value(2);

    // 3. AP 1 lazy on A, with P's entry (frame 2) cached.
    let lazy = ask(LAZY) == 1;
    set_p(0);
    let (lazy_broadcasts, lazy_shootdowns) = flush_a();
    let hooks = tlb::ipis().1;
    let sync = ipi_sync(tlb::arch());
    let sync_cpus = sync.map_or(0, |r| r.remote_cpus);
    let sync_hooks = tlb::ipis().1 - hooks;
    let before = catch_ups();
    let left = ask(LEAVE_LAZY) == 1;
    let leave_catch_ups = catch_ups() - before;
    let leave_value = read();
    let stale = u64::from(leave_value == value(2)) + u64::from(!back_read) + u64::from(!running_read);
    let others = crate::ONLINE.load(Ordering::Acquire) - 1;

    // 4. The frame pool, with A's page P read-only.
    let pooled_ok = pooled();

    let ok = warm
        && pooled_ok
        && lazy
        && left
        && running_broadcasts == 1
        && away_broadcasts == 0
        && away_shootdowns == 0
        && back_catch_ups == 1
        && lazy_broadcasts == 0
        && lazy_shootdowns == 0
        && leave_catch_ups == 1
        && leave_value == value(0)
        && sync_cpus == others
        && sync_hooks == 1
        && stale == 0;
    crate::say!(
        "scenario {NAME}: {} (AP {AP} on A: a flush of A made {running_broadcasts} broadcast; AP {AP} switched to \
         B: {away_broadcasts} broadcasts, {away_shootdowns} shootdowns, catch-ups when back on A: {back_catch_ups}; \
         AP {AP} lazy on A: {lazy_broadcasts} broadcasts, {lazy_shootdowns} shootdowns, ipi_sync still reached \
         {sync_cpus} of {others} other CPUs with {sync_hooks} hook call, catch-ups at leave_lazy_tlb: \
         {leave_catch_ups}; stale: {stale} reads of an old frame){}\n",
        if ok { "PASS" } else { "FAIL" },
        if ok { "" } else { " (reads below)" }
    );
    if !ok {
        crate::say!(
            "generations: reads (frame 0 holds {:#x}, 1 {:#x}, 2 {:#x}; a fault {:#x}): while running A {running_value:#x}, \
             back on A {back_value:#x}, after leave_lazy_tlb {leave_value:#x}\n",
            value(0),
            value(1),
            value(2),
            u64::MAX
        );
    }

    // 5. Does a TTBR0_EL1 change keep ASID-tagged entries? AP 1 runs A
    // and caught up at its last switch; P is unmapped, so no entry of it
    // is cached, and mapping it needs no TLBI. (A flush here would move
    // A's generation, and the switch back below would catch up: a TLBI
    // ...IS leaves no record on the CPUs it reaches.)
    set_p(0);
    let warm = read();
    switch_ap(2);
    set_p(1);
    // No TLBI: A's generation does not move, so the switch back does not
    // catch up either (counted, to be sure).
    let before = catch_ups();
    switch_ap(1);
    let switch_catch_ups = catch_ups() - before;
    let after = read();
    let kept = after == warm && switch_catch_ups == 0;
    crate::say!(
        "generations: ASID-tagged entries kept across a TTBR0_EL1 change: {} (AP {AP} cached P in ASID {ASID_A:#x}, \
         switched to ASID {ASID_B:#x}, P remapped with no TLBI, back on ASID {ASID_A:#x} with {switch_catch_ups} catch-ups it \
         read the {} frame){}\n",
        if kept { "yes" } else { "no" },
        if kept {
            "old"
        } else if after == value(1) {
            "new"
        } else {
            "wrong"
        },
        if kept {
            ""
        } else {
            ": a skipped catch-up at a switch cannot be observed under this TCG, so it has no negative control"
        }
    );

    switch_ap(0);
    JOB.store(false, Ordering::Release);
    mmu::test_pte(PAGE).store(saved, Ordering::Release);
    let a = *tlb::arch();
    // The entries A and B left behind, and P's in the test space.
    a.broadcast_flush_asid(space(1).asid());
    a.broadcast_flush_asid(space(2).asid());
    a.broadcast_sync();
    if flush_tlb_page(&a, tlb::mm(), mmu::test_va(PAGE)).is_err() {
        crate::fatal("flush_tlb_page refused a test page");
    }
    ok
}
