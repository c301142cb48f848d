//! CPUs going offline under fire: the last AP takes itself offline with
//! `X86_64::take_offline`, stays away for a moment with interrupts off,
//! and comes back with `X86_64::bring_online`, over and over, while every
//! other CPU shoots at every CPU of the machine with interrupts off.
//!
//! Each shootdown reads the online set afresh, so some find the leaver
//! gone, some find it there, and some read the set just before it leaves
//! and publish to it while it is on its way out: its own wait there is the
//! only thing that can serve those (it takes no interrupt until it is back),
//! so a shootdown that returns at all shows it did. While it is away the
//! online set falls short of the present CPUs, so the all-but-self
//! shorthand gives way to named destinations, and back.
//!
//! The pages the requests flush (the storm's, at 4 GiB) are unmapped
//! without a flush before, after every CPU read them: at the end no CPU,
//! the leaver included (it flushed everything on each return), may still
//! read one.

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tlb_batch::{shootdown, switch_mm, Arch, CpuSet, MmTlbState};

use crate::storm::{readers, STORM_PAGES};
use crate::{arch, flow, hw, mm, report, ONLINE, RESULT};

/// AP command: take this CPU offline and back until told to stop.
pub const LEAVE: u32 = 0x78;
/// AP command: [`crate::ARG`] shootdowns at every CPU, interrupts off.
pub const SHOOT: u32 = 0x79;

/// APs ready; the boot CPU starts them all at once.
static READY: AtomicU32 = AtomicU32::new(0);
static GO: AtomicU32 = AtomicU32::new(0);
/// Set once every shooter is done: the leaver then ends, online.
static STOP: AtomicU32 = AtomicU32::new(0);
/// Requests the leaver served on its way out, in all.
static SERVED: AtomicU64 = AtomicU64::new(0);
/// Errors from `switch_mm`, `take_offline` or `bring_online` on the leaver.
static ERRORS: AtomicU64 = AtomicU64::new(0);

/// Pause iterations the leaver spends in each cycle with interrupts off
/// before it leaves, away, and back online.
const PREPARE: u64 = 500;
const AWAY: u64 = 500;
const BACK: u64 = 2_000;

fn wait_for_go() {
    READY.fetch_add(1, Ordering::SeqCst);
    while GO.load(Ordering::SeqCst) == 0 {
        core::hint::spin_loop();
    }
}

/// The leaver's loop (an AP command): returns with the CPU online.
pub fn leave(cpu: usize) {
    wait_for_go();
    let a = arch();
    // The kernel's own space, over the boot page table (never freed): what
    // an offline CPU keeps loaded, as Linux's offline path loads init_mm.
    let kernel = MmTlbState::kernel(mm().root());
    let (mut cycles, mut served, mut errors) = (0u64, 0u64, 0u64);
    while cycles == 0 || STOP.load(Ordering::SeqCst) == 0 {
        // The offline path: interrupts off, some work (a kernel moves its
        // tasks and interrupts away here; requests pile up in the inbox
        // meanwhile), the kernel's space loaded (the crate refuses to take
        // a CPU that runs a user space offline), then out of the online set.
        hw::cli();
        hw::spin(PREPARE);
        // SAFETY: the root is the boot page table, which maps this kernel.
        if unsafe { switch_mm(&a, Some(mm()), &kernel) }.is_err() {
            errors += 1;
        }
        match a.take_offline() {
            Ok(n) => served += n as u64,
            Err(_) => errors += 1,
        }
        // Away: nothing but this loop and the stack, interrupts still off
        // (flush IPIs sent meanwhile stay latched at the local APIC).
        hw::spin(AWAY);
        match a.bring_online() {
            Ok(id) if id.index() == cpu => {}
            _ => errors += 1,
        }
        // `bring_online` forgot the loaded ASID with everything else.
        // SAFETY: the root is the boot page table, which maps this kernel.
        if unsafe { switch_mm(&a, None, mm()) }.is_err() {
            errors += 1;
        }
        // Back: a latched IPI fires here and finds nothing left to do.
        hw::sti();
        hw::spin(BACK);
        cycles += 1;
    }
    SERVED.store(served, Ordering::SeqCst);
    ERRORS.store(errors, Ordering::SeqCst);
    RESULT[cpu].store(cycles, Ordering::SeqCst);
}

/// `rounds` shootdowns at every CPU of the machine, this one included
/// (its own entries go by a local flush), with interrupts off; returns how
/// many completed.
pub fn shoot(rounds: u64) -> u64 {
    wait_for_go();
    let me = arch().current_cpu().expect("registered");
    // Every CPU, online or not: each shootdown keeps the online ones.
    let targets = CpuSet::first(ONLINE.load(Ordering::SeqCst)).unwrap_or_default();
    hw::cli();
    let mut ok = 0;
    for r in 0..rounds {
        let request = crate::one_page(((r + me.index() as u64) % STORM_PAGES as u64) as usize);
        ok += u64::from(shootdown(&arch(), &targets, &request).is_ok());
    }
    hw::sti();
    ok
}

/// Runs the scenario: the last AP leaves and comes back while the others
/// (the boot CPU among them) shoot.
pub fn scenario_offline() -> bool {
    let n = ONLINE.load(Ordering::SeqCst);
    let leaver = n - 1;
    let shooters = n - 1;
    let rounds = crate::storm::rounds_per_cpu(n);
    crate::map_all();
    let cached = readers();
    for i in 0..STORM_PAGES {
        crate::TEST_PT.0[i].store(0, Ordering::SeqCst);
    }
    for flag in [&READY, &GO, &STOP] {
        flag.store(0, Ordering::SeqCst);
    }
    let stats = crate::TLB.stats();
    flow::start(1..leaver, SHOOT, rounds);
    flow::start(leaver..n, LEAVE, 0);
    while READY.load(Ordering::SeqCst) < (n - 1) as u32 {
        core::hint::spin_loop();
    }
    GO.store(1, Ordering::SeqCst);
    let mine = shoot(rounds);
    for c in 1..leaver {
        while crate::COMMAND[c].load(Ordering::SeqCst) != crate::IDLE {
            core::hint::spin_loop();
        }
    }
    STOP.store(1, Ordering::SeqCst);
    while crate::COMMAND[leaver].load(Ordering::SeqCst) != crate::IDLE {
        core::hint::spin_loop();
    }
    let d = crate::TLB.stats().since(&stats);
    let done = mine + (1..leaver).map(|c| RESULT[c].load(Ordering::SeqCst)).sum::<u64>();
    let total = rounds * shooters as u64;
    let cycles = RESULT[leaver].load(Ordering::SeqCst);
    let served = SERVED.load(Ordering::SeqCst);
    let errors = ERRORS.load(Ordering::SeqCst);
    let all_back = CpuSet::first(n).is_ok_and(|all| crate::CPUS.online() == all);
    let stale = readers();
    let expected = (n * STORM_PAGES) as u64;
    report(
        "cpu offline",
        done == total && cycles > 0 && errors == 0 && all_back && cached == expected && stale == 0,
        format_args!(
            "{n} CPUs: CPU {leaver} went offline and came back {cycles} times, serving {served} requests on \
             its way out, {errors} errors; {shooters} CPUs x {rounds} shootdowns at every CPU, {done}/{total} \
             completed, {} flush requests served, {} IPIs sent; all back online: {all_back}; {cached}/{expected} \
             page reads cached before; stale: {stale} reads after",
            d.flushes_received, d.ipis_sent
        ),
    )
}
