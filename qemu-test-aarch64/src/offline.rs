//! CPUs going offline under fire: the last CPU takes itself offline with
//! `Aarch64::take_offline`, stays away for a moment, and comes back with
//! `Aarch64::bring_online`, over and over, while every other CPU runs
//! `ipi_sync` (the one crate call that asks other CPUs for an answer with
//! this `Arch`, whose flushes are broadcast `TLBI`s) and CPU 0 flushes a
//! page with `flush_tlb_page` between its syncs.
//!
//! This kernel masks interrupts throughout: a CPU takes the IPI hook's
//! request when it polls for it ([`tlb::poll`]). While the leaver is away
//! it polls nothing, as a parked CPU takes no interrupt: a sync that read
//! the online set just before it left can only be served by its own wait
//! on the way out, so a sync that returns at all shows it was. A flush
//! whose only online target is its caller is a local one, so the page
//! CPU 0 flushes stays cached on the leaver while it is away, until
//! `bring_online` drops everything: the leaver reads it first and must not
//! read it after.

use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use tlb_batch::{flush_tlb_page, ipi_sync, switch_mm, CpuSet, MmTlbState};
use tlb_batch_qemu_scenarios::{Frame, Platform};

use crate::{cpu_index, mmu, now_us, tlb, Virt, MAX_CPUS, ONLINE};

/// The scenario's phase: 0 idle, 1 running (the other CPUs join it from
/// their poll), 2 told to stop.
static JOB: AtomicU32 = AtomicU32::new(0);
/// Set by CPU 0 once every CPU is ready and the page is unmapped.
static GO: AtomicBool = AtomicBool::new(false);
/// CPUs ready, and CPUs done.
static READY: AtomicU32 = AtomicU32::new(0);
static DONE: AtomicU32 = AtomicU32::new(0);
/// Syncs each CPU completed.
static SYNCED: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// The leaver's counts: cycles, requests served on its way out, errors,
/// and whether it read the page before and after.
static CYCLES: AtomicU64 = AtomicU64::new(0);
static SERVED: AtomicU64 = AtomicU64::new(0);
static ERRORS: AtomicU64 = AtomicU64::new(0);
static READ_BEFORE: AtomicBool = AtomicBool::new(false);
static READ_AFTER: AtomicBool = AtomicBool::new(false);

/// The test page the scenario maps, caches on the leaver and unmaps.
const PAGE: usize = 0;
/// What the page's frame holds.
const VALUE: u64 = 0x0ff1_14e0_0000_0001;
/// Syncs each shooting CPU runs.
const ROUNDS: u64 = 64;
/// Microseconds the leaver spends with its "interrupts" masked before it
/// leaves, away, and back polling.
const PREPARE_US: u64 = 20;
const AWAY_US: u64 = 50;
const BACK_US: u64 = 100;
/// How long CPU 0 waits for the others at each step.
const WAIT_LIMIT_US: u64 = 20_000_000;

fn spin_us(us: u64) {
    let start = now_us();
    while now_us() - start < us {
        core::hint::spin_loop();
    }
}

/// Polls (taking IPI-hook requests) for `us` microseconds.
fn poll_us(us: u64) {
    let start = now_us();
    while now_us() - start < us {
        tlb::poll();
        core::hint::spin_loop();
    }
}

/// A CPU's part in the scenario, from its poll loop: the last CPU leaves
/// and comes back, the others sync.
pub fn serve() {
    if JOB.load(Ordering::Acquire) != 1 {
        return;
    }
    let me = cpu_index();
    let n = ONLINE.load(Ordering::Acquire);
    if me == 0 || me >= n.min(MAX_CPUS) {
        return;
    }
    if me == n - 1 {
        leave();
    } else {
        READY.fetch_add(1, Ordering::SeqCst);
        while !GO.load(Ordering::Acquire) {
            tlb::poll();
        }
        SYNCED[me].store(sync_rounds(), Ordering::SeqCst);
    }
    DONE.fetch_add(1, Ordering::SeqCst);
    while JOB.load(Ordering::Acquire) == 1 {
        tlb::poll();
    }
}

/// [`ROUNDS`] syncs; returns how many completed.
fn sync_rounds() -> u64 {
    (0..ROUNDS)
        .map(|_| u64::from(ipi_sync(tlb::arch()).is_ok()))
        .sum()
}

fn leave() {
    let a = tlb::arch();
    READ_BEFORE.store(Virt.read_page(PAGE) == Some(VALUE), Ordering::SeqCst);
    READY.fetch_add(1, Ordering::SeqCst);
    while !GO.load(Ordering::Acquire) {
        tlb::poll();
    }
    // The kernel's own space, over the kernel's table (never freed): what
    // an offline CPU keeps loaded, as Linux's offline path loads init_mm.
    let kernel = MmTlbState::kernel(tlb::mm().root());
    let (mut cycles, mut served, mut errors) = (0u64, 0u64, 0u64);
    loop {
        // The offline path, with nothing polled: some work (a kernel
        // moves its tasks away here; requests pile up meanwhile), the
        // kernel's space loaded (the crate refuses to take a CPU that runs
        // a user space offline), then out of the online set.
        spin_us(PREPARE_US);
        // SAFETY: the root is the kernel's own table, which maps
        // everything this CPU runs from.
        if unsafe { switch_mm(a, Some(tlb::mm()), &kernel) }.is_err() {
            errors += 1;
        }
        match a.take_offline() {
            Ok(s) => served += s as u64,
            Err(_) => errors += 1,
        }
        // Away: parked, polling nothing.
        spin_us(AWAY_US);
        // Back: everything flushed, the address space loaded again (the
        // crate forgot it), and requests taken again.
        match a.bring_online() {
            Ok(id) if id.index() == cpu_index() => {}
            _ => errors += 1,
        }
        // SAFETY: the root is the kernel's own table, which maps everything
        // this CPU runs from; `bring_online` left no address space loaded.
        if unsafe { switch_mm(a, None, tlb::mm()) }.is_err() {
            errors += 1;
        }
        poll_us(BACK_US);
        cycles += 1;
        if JOB.load(Ordering::Acquire) != 1 {
            break;
        }
    }
    READ_AFTER.store(Virt.read_page(PAGE).is_some(), Ordering::SeqCst);
    CYCLES.store(cycles, Ordering::SeqCst);
    SERVED.store(served, Ordering::SeqCst);
    ERRORS.store(errors, Ordering::SeqCst);
}

/// Waits (polling) until `done` holds; false after [`WAIT_LIMIT_US`].
fn wait(done: impl Fn() -> bool) -> bool {
    let start = now_us();
    while !done() {
        if now_us() - start > WAIT_LIMIT_US {
            return false;
        }
        tlb::poll();
        core::hint::spin_loop();
    }
    true
}

/// Runs the scenario on CPU 0, prints its line and returns whether it
/// passed.
pub fn run() -> bool {
    let n = ONLINE.load(Ordering::Acquire).min(MAX_CPUS);
    let p = Virt;
    for c in &SYNCED {
        c.store(0, Ordering::SeqCst);
    }
    for c in [&READY, &DONE] {
        c.store(0, Ordering::SeqCst);
    }
    GO.store(false, Ordering::SeqCst);
    p.fill_frame(PAGE, Frame::A, VALUE);
    p.set_pte(PAGE, Some(Frame::A));
    p.publish();
    // No CPU keeps what an earlier scenario left cached for the page.
    let mapped = flush_tlb_page(tlb::arch(), tlb::mm(), mmu::test_va(PAGE)).is_ok();
    JOB.store(1, Ordering::Release);
    let ready = wait(|| READY.load(Ordering::SeqCst) as usize == n - 1);
    // Unmapped with no flush yet: CPU 0's flushes below are the page's
    // only ones, broadcast while the leaver is online and local while it
    // is away.
    p.set_pte(PAGE, None);
    p.publish();
    let before = tlb::TLB.stats();
    GO.store(true, Ordering::Release);
    let mut mine = 0;
    let mut flushes_ok = true;
    for _ in 0..ROUNDS {
        mine += u64::from(ipi_sync(tlb::arch()).is_ok());
        flushes_ok &= flush_tlb_page(tlb::arch(), tlb::mm(), mmu::test_va(PAGE)).is_ok();
    }
    let shooters_done = wait(|| DONE.load(Ordering::SeqCst) as usize >= n.saturating_sub(2));
    JOB.store(2, Ordering::Release);
    let leaver_done = wait(|| DONE.load(Ordering::SeqCst) as usize == n - 1);
    JOB.store(0, Ordering::Release);
    let d = tlb::TLB.stats().since(&before);
    let shooters = n - 1;
    let synced = mine + (1..n - 1).map(|c| SYNCED[c].load(Ordering::SeqCst)).sum::<u64>();
    let total = ROUNDS * shooters as u64;
    let cycles = CYCLES.load(Ordering::SeqCst);
    let served = SERVED.load(Ordering::SeqCst);
    let errors = ERRORS.load(Ordering::SeqCst);
    let all_back = CpuSet::first(n).is_ok_and(|all| tlb::CPUS.online() == all);
    let (read_before, stale) = (
        READ_BEFORE.load(Ordering::SeqCst),
        READ_AFTER.load(Ordering::SeqCst),
    );
    let timeouts = u32::from(!ready) + u32::from(!shooters_done) + u32::from(!leaver_done);
    let ok = timeouts == 0
        && synced == total
        && mapped
        && flushes_ok
        && cycles > 0
        && errors == 0
        && all_back
        && read_before
        && !stale;
    crate::say!(
        "scenario cpu offline: {} ({n} CPUs: CPU {} went offline and came back {cycles} times, serving \
         {served} requests on its way out, {errors} errors; {shooters} CPUs x {ROUNDS} IPI syncs, \
         {synced}/{total} completed, {} requests served, {} IPIs sent; {} page flushes, {} of them broadcast; \
         all back online: {all_back}; the leaver read the page before: {read_before}; stale: {} reads after, \
         {timeouts} timeouts)\n",
        if ok { "PASS" } else { "FAIL" },
        n - 1,
        d.flushes_received,
        d.ipis_sent,
        ROUNDS,
        d.broadcasts,
        u32::from(stale),
    );
    ok
}
