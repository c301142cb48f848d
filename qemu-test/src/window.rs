//! The CR3 window: a flush that runs while a CPU is in the middle of
//! `switch_mm` must reach it (the shape of CVE-2025-37964).
//!
//! Linux once recorded a CPU's switch into an address space only after it
//! had written CR3. A flusher that looked at the space's CPU set in
//! between skipped a CPU whose MMU could already walk (and cache) the new
//! tables. The crate's `switch_mm` adds the CPU to the set, records the
//! loaded ASID and fences before it calls `Arch::switch_address_space`, so
//! a flusher in that window must find the CPU among its targets.
//!
//! Two address spaces, T and S, with PML4s of their own (entry 0 shared
//! with the kernel, entry 3 private), map page P at [`P_VA`] to different
//! frames. Each round:
//! - AP [`AP`] loads T, reads P (T's frame), then calls `switch_mm` to S
//!   through [`Window`], whose `switch_address_space` writes CR3 and then,
//!   still inside `switch_mm`, reads P (so its TLB caches P from S's
//!   tables), tells CPU 0, and waits, interrupts off, serving its flush
//!   inbox with `handle_flush_ipi` until CPU 0 is done;
//! - CPU 0 meanwhile clears P's PTE in S, flushes P with `flush_tlb_page`,
//!   writes [`MARKER`] into the old frame (as if it were reused) and says
//!   it is done;
//! - after `switch_mm` returns, the AP reads P again: it must fault; the
//!   marker would be a read through the entry the flush missed.
//!
//! The negative control (`negative` or `negative-window` on the command
//! line) shoots P down on S's flush targets minus the AP: what a CPU that
//! records its switch only after the CR3 write would get. Its stale entry
//! then serves the marker. TCG keeps a translation until it is
//! invalidated (or evicted by another), so most rounds show it; several
//! rounds are run and counted, since TCG may drop an entry on its own.

use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use tlb_batch::arch::x86_64::X86_64;
use tlb_batch::{
    flush_tlb_page, handle_flush_ipi, shootdown, switch_mm, Arch, Asid, CpuId, CpuSet, FlushRequest,
    MmTlbState, TlbShootdown,
};

use crate::{arch, fatal, hw, mm, probe, report, ARG, COMMAND, IDLE, IPIS_TAKEN, RESULT};

/// The AP command that runs one round on the AP's side.
pub const AP_ROUND: u32 = 0x74;

/// The AP that switches.
const AP: usize = 1;
const ROUNDS: u64 = 8;
/// Page P: PML4 entry 3 (1.5 TiB), private to T and S.
const P_VA: u64 = 0x180_0000_0000;
const PML4_SLOT: usize = 3;
const ASID_T: u16 = 11;
const ASID_S: u16 = 12;
const PATTERN_T: u64 = 0x7777_0000_0000_0001;
const PATTERN_S: u64 = 0x5555_0000_0000_0002;
/// What CPU 0 writes into S's old frame of P once it is unmapped.
const MARKER: u64 = 0x4d41_524b_4552_2121;
const PRESENT_RW: u64 = 0x3;
/// Spins before a handshake counts as lost.
const PATIENCE: u64 = 500_000_000;

/// Handshake between the two sides of a round.
static STAGE: AtomicU32 = AtomicU32::new(START);
const START: u32 = 0;
/// The AP has written CR3 and read P from S's tables.
const IN_WINDOW: u32 = 1;
/// CPU 0 has unmapped, flushed and reused P's frame.
const DONE: u32 = 2;

/// The AP's figures for one round.
static WARM_S: AtomicBool = AtomicBool::new(false);
static SERVED: AtomicU64 = AtomicU64::new(0);

#[repr(C, align(4096))]
struct Table([AtomicU64; 512]);

const fn empty() -> Table {
    Table([const { AtomicU64::new(0) }; 512])
}

/// An address space's private tables down to the one that maps P, and
/// P's frame in it.
struct Tables {
    pml4: Table,
    pdpt: Table,
    pd: Table,
    pt: Table,
    frame: Table,
}

static TABLES: [Tables; 2] = [const {
    Tables {
        pml4: empty(),
        pdpt: empty(),
        pd: empty(),
        pt: empty(),
        frame: empty(),
    }
}; 2];

const T: usize = 0;
const S: usize = 1;

static mut SPACES: core::mem::MaybeUninit<[MmTlbState; 2]> = core::mem::MaybeUninit::uninit();
static SPACES_READY: AtomicBool = AtomicBool::new(false);

fn space(s: usize) -> &'static MmTlbState {
    if !SPACES_READY.load(Ordering::Acquire) {
        fatal("the window scenario's address spaces used before they were set up");
    }
    // SAFETY: written once by CPU 0 before SPACES_READY was published
    // (release/acquire), never written again.
    unsafe { &(*core::ptr::addr_of!(SPACES)).assume_init_ref()[s] }
}

fn addr(t: &Table) -> u64 {
    t.0.as_ptr() as u64
}

/// (Re)maps P in space `s` to its frame, the space's pattern written.
fn map_p(s: usize) {
    let t = &TABLES[s];
    t.frame.0[0].store(if s == T { PATTERN_T } else { PATTERN_S }, Ordering::SeqCst);
    t.pt.0[0].store(addr(&t.frame) | PRESENT_RW, Ordering::SeqCst);
}

fn setup() {
    if SPACES_READY.load(Ordering::Acquire) {
        return;
    }
    // SAFETY: the boot PML4 is identity-mapped; its entry 0 (the kernel's
    // identity map) was written before paging was enabled and never changes.
    let kernel = unsafe { core::ptr::read_volatile(core::ptr::addr_of!(crate::boot::pml4) as *const u64) };
    for (s, t) in TABLES.iter().enumerate() {
        t.pml4.0[0].store(kernel, Ordering::SeqCst);
        t.pml4.0[PML4_SLOT].store(addr(&t.pdpt) | PRESENT_RW, Ordering::SeqCst);
        t.pdpt.0[0].store(addr(&t.pd) | PRESENT_RW, Ordering::SeqCst);
        t.pd.0[0].store(addr(&t.pt) | PRESENT_RW, Ordering::SeqCst);
        map_p(s);
    }
    let asid = |v| Asid::new(v).unwrap_or(Asid::KERNEL);
    // SAFETY: written once, before SPACES_READY is published and before
    // the AP is told to use the spaces.
    unsafe {
        (*core::ptr::addr_of_mut!(SPACES)).write([
            MmTlbState::new(asid(ASID_T), addr(&TABLES[T].pml4)),
            MmTlbState::new(asid(ASID_S), addr(&TABLES[S].pml4)),
        ]);
    }
    SPACES_READY.store(true, Ordering::Release);
}

/// The test's `Arch` for the AP's switch into S: the real `X86_64`, whose
/// `switch_address_space` then acts inside the window (see the module
/// docs) before it returns to `switch_mm`.
struct Window(X86_64);

// SAFETY: every method and constant is the real implementation's; the
// switch loads the root it was given, and what it does afterwards (a
// fault-recovering read, serving the flush inbox as a waiting initiator
// does) needs nothing that `switch_mm` holds.
unsafe impl Arch for Window {
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
    fn relax(&self) {
        self.0.relax()
    }
    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        // SAFETY: forwarded from our caller unchanged.
        unsafe { self.0.switch_address_space(asid, root) };
        // The window: CR3 holds S's root, `switch_mm` has not returned.
        // Fill the TLB from S's tables, then let CPU 0 unmap and flush.
        WARM_S.store(probe(P_VA) == Some(PATTERN_S), Ordering::SeqCst);
        STAGE.store(IN_WINDOW, Ordering::SeqCst);
        let mut served = 0;
        let mut waited = 0u64;
        while STAGE.load(Ordering::SeqCst) != DONE {
            // Interrupts are off: a request for this CPU is served here.
            served += handle_flush_ipi(&self.0) as u64;
            waited += 1;
            if waited > PATIENCE {
                fatal("window scenario: CPU 0 never finished its flush");
            }
            self.0.relax();
        }
        SERVED.store(served, Ordering::SeqCst);
    }
}

/// Switches the running CPU from `prev` to `next` with `a` (interrupts
/// are off).
fn switch<A: Arch>(a: &A, prev: &MmTlbState, next: &MmTlbState) {
    // SAFETY: every root here (the boot PML4, T's, S's) maps the kernel
    // through the shared PML4 entry 0; `prev` is what this CPU has loaded
    // (the AP goes main -> T -> S -> main in each round).
    if unsafe { switch_mm(a, Some(prev), next) }.is_err() {
        fatal("the window scenario's ASIDs do not fit");
    }
}

/// Results packed into `RESULT`: bit 0 T's frame read in T, bit 1 S's
/// frame read inside the window, bits 8.. the read after the switch.
const AFTER_SHIFT: u32 = 8;
const AFTER_FAULT: u64 = 0;
const AFTER_MARKER: u64 = 1;
const AFTER_OTHER: u64 = 2;

/// One round on the AP (called from its command loop).
pub fn ap_round(cpu: usize) {
    let a = arch();
    hw::cli();
    switch(&a, mm(), space(T));
    let warm_t = probe(P_VA) == Some(PATTERN_T);
    switch(&Window(arch()), space(T), space(S));
    let after = match probe(P_VA) {
        None => AFTER_FAULT,
        Some(MARKER) => AFTER_MARKER,
        Some(_) => AFTER_OTHER,
    };
    switch(&a, space(S), mm());
    // Whatever the round left cached (the control's stale entry, kept
    // under S's PCID on a tagged TLB) goes before the next round.
    a.flush_local_all(false);
    hw::sti();
    let warm_s = WARM_S.load(Ordering::SeqCst);
    RESULT[cpu].store(
        u64::from(warm_t) | u64::from(warm_s) << 1 | after << AFTER_SHIFT,
        Ordering::SeqCst,
    );
    COMMAND[cpu].store(IDLE, Ordering::SeqCst);
}

fn wait_until(what: &str, done: impl Fn() -> bool) {
    let mut waited = 0u64;
    while !done() {
        waited += 1;
        if waited > PATIENCE {
            crate::say(format_args!("window scenario: gave up waiting for {what}\n"));
            hw::exit(hw::EXIT_FAIL);
        }
        core::hint::spin_loop();
    }
}

/// Runs the rounds; `leave_out` is the negative control (the AP is left
/// out of the flush's targets).
pub fn scenario_window(leave_out: bool) -> bool {
    setup();
    let a = arch();
    let Ok(ap_id) = CpuId::new(AP) else {
        fatal("window scenario: no CPU id for the AP");
    };
    let (mut warm_t, mut warm_s, mut in_set, mut reached, mut served, mut ipis) = (0, 0, 0, 0, 0, 0);
    let (mut stale, mut faults, mut other) = (0, 0, 0);
    for _ in 0..ROUNDS {
        map_p(T);
        map_p(S);
        STAGE.store(START, Ordering::SeqCst);
        SERVED.store(0, Ordering::SeqCst);
        let taken_before = IPIS_TAKEN[AP].load(Ordering::SeqCst);
        ARG[AP].store(0, Ordering::SeqCst);
        RESULT[AP].store(0, Ordering::SeqCst);
        COMMAND[AP].store(AP_ROUND, Ordering::SeqCst);
        wait_until("the AP to enter the window", || {
            STAGE.load(Ordering::SeqCst) == IN_WINDOW
        });
        in_set += u64::from(space(S).cpus().contains(ap_id));
        TABLES[S].pt.0[0].store(0, Ordering::SeqCst);
        let r = if leave_out {
            let targets = space(S).flush_targets(&a).difference(&CpuSet::single(ap_id));
            let mut req = FlushRequest::new();
            if req
                .add_page(space(S).asid(), P_VA, <X86_64 as Arch>::FULL_FLUSH_CEILING)
                .is_err()
            {
                fatal("window scenario: P is not a page address");
            }
            shootdown(&a, &targets, &req)
        } else {
            flush_tlb_page(&a, space(S), P_VA)
        };
        reached += r.map_or(0, |r| r.remote_cpus as u64);
        // The frame is reused: anything reading it through P now is stale.
        TABLES[S].frame.0[0].store(MARKER, Ordering::SeqCst);
        STAGE.store(DONE, Ordering::SeqCst);
        wait_until("the AP to finish its round", || {
            COMMAND[AP].load(Ordering::SeqCst) == IDLE
        });
        let res = RESULT[AP].load(Ordering::SeqCst);
        warm_t += res & 1;
        warm_s += res >> 1 & 1;
        match res >> AFTER_SHIFT {
            AFTER_FAULT => faults += 1,
            AFTER_MARKER => stale += 1,
            _ => other += 1,
        }
        served += SERVED.load(Ordering::SeqCst);
        ipis += IPIS_TAKEN[AP].load(Ordering::SeqCst) - taken_before;
    }
    let n = ROUNDS;
    let ok = warm_t == n
        && warm_s == n
        && in_set == n
        && reached == n
        && served == n
        && ipis == n
        && faults == n
        && stale == 0
        && other == 0;
    report(
        "cr3 window",
        ok,
        format_args!(
            "{n} rounds{}: AP {AP} read P in T {warm_t}, in S inside switch_mm after its CR3 write \
             {warm_s}, in S's CPU set there {in_set}; remote CPUs the flushes asked {reached}, requests the AP \
             served while it waited {served}, IPIs it took after {ipis}; reads after the switch: \
             {faults} faults, stale: {stale} reads of the reused frame, {other} other",
            if leave_out { ", the AP left out of the flush (control)" } else { "" }
        ),
    )
}
