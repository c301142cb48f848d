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
//! `ipi_sync` (the teardown's wait for lockless walkers) does not look at
//! the CPU sets: it interrupts every other online CPU, lazy or not, since
//! a walker may run in any address space; the scenario counts that too.
//!
//! Last, the question whether a switch can have a negative control: AP 1
//! caches P in A, switches to B, P is remapped with no TLBI at all, and it
//! switches back (A's generation did not move: no catch-up) and reads P.
//! If it reads the old frame, TCG keeps ASID-tagged entries across a
//! TTBR0_EL1 change; the kernel prints what it found.

use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tlb_batch::arch::aarch64 as a64;
use tlb_batch::{
    enter_lazy_tlb, flush_tlb_page, ipi_sync, leave_lazy_tlb, switch_mm, Arch, Asid, MmTlbState,
};

use crate::{mmu, tlb, MAX_CPUS};

const NAME: &str = "generations";
/// The test page the scenario remaps (the last one).
const PAGE: usize = mmu::TEST_PAGES - 1;
const AP: usize = 1;
const ASID_A: u16 = 0x11;
const ASID_B: u16 = 0x12;

#[repr(C, align(4096))]
struct Page([AtomicU64; 512]);

static FRAMES: [Page; 3] = [const { Page([const { AtomicU64::new(0) }; 512]) }; 3];

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
                // SAFETY: every space here has the kernel's own tables as
                // its root, which map everything this CPU runs; `loaded`
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
            MmTlbState::new(asid_a, mmu::root()),
            MmTlbState::new(asid_b, mmu::root()),
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
    let running_read = read() == value(1);

    // 2. AP 1 switched to B.
    switch_ap(2);
    set_p(2);
    let (away_broadcasts, away_shootdowns) = flush_a();
    let before = catch_ups();
    switch_ap(1);
    let back_catch_ups = catch_ups() - before;
    let back_read = read() == value(2);

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

    let ok = warm
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
         {leave_catch_ups}; stale: {stale} reads of an old frame)\n",
        if ok { "PASS" } else { "FAIL" }
    );

    // 4. Does a TTBR0_EL1 change keep ASID-tagged entries? P (frame 0) is
    // cached in A, unless the control left frame 2's entry.
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
