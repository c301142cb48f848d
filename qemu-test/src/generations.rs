//! Flush generations on the real `X86_64`: which CPUs a flush of an address
//! space interrupts once they switched away or went lazy, and how they
//! catch up (the crate's `generation` module).
//!
//! Two address spaces, A and B (their own PML4s, ASIDs 8 and 9, which no
//! other scenario uses), map the same user page P to frames of their own.
//! AP 1 loads A and reads P; the boot CPU, which never loads A, remaps P
//! to another frame and flushes A each time, and AP 1 reads P again:
//!
//! 1. AP 1 runs A: the flush interrupts it (1 IPI).
//! 2. AP 1 switched to B: the flush interrupts nobody (0 IPIs). With PCIDs
//!    the entries of A stay in its TLB, so when it switches back the crate
//!    flushes A's PCID first (1 catch-up); without PCIDs the CR3 write of
//!    the switch itself drops them (0 catch-ups: nothing to count).
//! 3. AP 1 lazy on A (`enter_lazy_tlb`): the flush skips it (0 IPIs); it
//!    keeps CR3 and its TLB entries, so `leave_lazy_tlb` must flush A
//!    (1 catch-up) before it reads P. This holds with and without PCIDs,
//!    on every emulator, since no CR3 write happens: the negative control
//!    `negative-catchup` has `leave_lazy_tlb` run with a wrapper whose
//!    `flush_local_asid` does nothing, and AP 1 must then read the old
//!    frame.
//!
//! Then the question whether a switch can be given a negative control as
//! well: with PCIDs on, AP 1 caches P in A, switches to B, P is remapped
//! with no flush at all, and AP 1 switches back to A (its generation did
//! not move, so the crate flushes nothing) and reads P. Only if it still
//! reads the old frame does the hardware keep a PCID's entries across a
//! CR3 write, and only then could a skipped catch-up be caught at a
//! switch. Bochs 2.7 drops them on every CR3 write; QEMU's TCG has no PCID.
//! The kernel prints what it measured; the mock's tagged model (host
//! tests) carries the switch catch-up where no emulator can.
//!
//! The AP side of these steps, and of the pooled reclaim flow
//! ([`crate::pool_flow`]), runs through one AP command, [`AP_STEP`].

use core::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tlb_batch::arch::x86_64::X86_64;
use tlb_batch::{
    enter_lazy_tlb, flush_tlb_page, leave_lazy_tlb, quiescent_flush, switch_mm, Arch, Asid, CpuId, CpuSet,
    MmTlbState, PageTable, Pte, TlbShootdown,
};

use crate::paging::{self, Space, PRESENT_WRITABLE};
use crate::{arch, hw, mm, probe, report, COMMAND, IDLE, IPIS_TAKEN, MAX_CPUS, RESULT, TLB};

/// The AP command of this module's and [`crate::pool_flow`]'s steps: the
/// step in the low 8 bits of `ARG`, its parameter above.
pub const AP_STEP: u32 = 0x70;

pub static GEN_A: Space = Space::new(8, 2);
pub static GEN_B: Space = Space::new(9, 3);
/// The page P: PML4 entry 1 of A and B.
const P: u64 = 0x80_0000_0000;
const AP: usize = 1;

/// Set by `negative-catchup`: AP 1 leaves lazy mode without its catch-up
/// flush.
static SKIP_CATCH_UP: AtomicBool = AtomicBool::new(false);
/// The address space each AP loaded through these steps (the address of
/// its `MmTlbState`; 0: the main one).
static LOADED: [AtomicUsize; MAX_CPUS] = [const { AtomicUsize::new(0) }; MAX_CPUS];

// AP steps.
const SWITCH: u64 = 1;
const READ: u64 = 2;
const LAZY: u64 = 3;
const LEAVE_LAZY: u64 = 4;
const QUIESCE: u64 = 5;
const READ_POOLED: u64 = 6;

fn space_at(addr: usize) -> &'static MmTlbState {
    if addr == 0 {
        mm()
    } else {
        // SAFETY: non-zero values are addresses of `MmTlbState`s in
        // statics (`Space`s), passed by `switch_on` below.
        unsafe { &*(addr as *const MmTlbState) }
    }
}

fn addr_of(space: Option<&'static Space>) -> u64 {
    space.map_or(0, |s| s.tlb_state() as *const MmTlbState as u64)
}

/// Runs step `step` with parameter `param` on the APs `cpus`, and waits.
pub fn step(cpus: impl Iterator<Item = usize> + Clone, step: u64, param: u64) {
    crate::command(cpus, AP_STEP, step | param << 8);
}

/// Loads `space` (None: the main one) on the APs `cpus` with `switch_mm`.
pub fn switch_on(cpus: impl Iterator<Item = usize> + Clone, space: Option<&'static Space>) {
    step(cpus, SWITCH, addr_of(space));
}

/// What AP `cpu` computed in its last step.
pub fn result(cpu: usize) -> u64 {
    RESULT[cpu].load(Ordering::SeqCst)
}

/// The AP side (called from the AP loop for [`AP_STEP`]).
pub fn ap_step(cpu: usize) {
    let arg = crate::ARG[cpu].load(Ordering::SeqCst);
    let param = arg >> 8;
    let result = match arg & 0xff {
        SWITCH => {
            let prev = space_at(LOADED[cpu].load(Ordering::SeqCst));
            let next = space_at(param as usize);
            hw::cli();
            // SAFETY: every space's PML4 shares the kernel's entry 0, so
            // the running code stays mapped; `prev` is what this CPU
            // loaded last (every scenario returns the APs to the main
            // space, which they loaded at boot).
            let r = unsafe { switch_mm(&arch(), Some(prev), next) };
            hw::sti();
            if r.is_err() {
                crate::fatal("switch_mm refused a generations test space");
            }
            LOADED[cpu].store(param as usize, Ordering::SeqCst);
            0
        }
        READ => probe(param).unwrap_or(u64::MAX),
        LAZY => u64::from(enter_lazy_tlb(&arch(), space_at(LOADED[cpu].load(Ordering::SeqCst))).is_ok()),
        LEAVE_LAZY => {
            let mm = space_at(LOADED[cpu].load(Ordering::SeqCst));
            hw::cli();
            let flushed = if SKIP_CATCH_UP.load(Ordering::Relaxed) {
                leave_lazy_tlb(&NoCatchUp(arch()), mm)
            } else {
                leave_lazy_tlb(&arch(), mm)
            };
            hw::sti();
            u64::from(flushed == Ok(true))
        }
        QUIESCE => {
            hw::cli();
            let flushed = quiescent_flush(&arch());
            hw::sti();
            u64::from(flushed)
        }
        READ_POOLED => {
            let pages = param as usize;
            (0..pages)
                .filter(|&i| probe(crate::pool_flow::page_va(i)) == Some(crate::pool_flow::pattern(i)))
                .count() as u64
        }
        _ => 0,
    };
    RESULT[cpu].store(result, Ordering::SeqCst);
    COMMAND[cpu].store(IDLE, Ordering::SeqCst);
}

/// The `negative-catchup` control's `Arch`: the real one, except that a
/// flush of one ASID (what a catch-up is) does nothing.
struct NoCatchUp(X86_64);

// SAFETY: NOT sound on purpose: the negative control shows that a lazy CPU
// that leaves lazy mode without its catch-up reads a stale entry. Every
// other method is the real implementation's.
unsafe impl Arch for NoCatchUp {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;
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
    fn asid_bits(&self) -> u32 {
        self.0.asid_bits()
    }
    fn fill_sets_accessed(&self) -> bool {
        self.0.fill_sets_accessed()
    }
    fn flush_local_page(&self, asid: Asid, va: u64) {
        self.0.flush_local_page(asid, va)
    }
    fn flush_local_asid(&self, _asid: Asid) {}
    fn flush_local_all(&self, include_global: bool) {
        self.0.flush_local_all(include_global)
    }
    fn send_flush_ipi(&self, targets: &CpuSet) {
        self.0.send_flush_ipi(targets)
    }
    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        // SAFETY: forwarded from our caller unchanged.
        unsafe { self.0.switch_address_space(asid, root) }
    }
}

/// A frame with `value` in its first word.
fn frame_with(value: u64) -> u64 {
    let Some(pa) = paging::alloc() else {
        crate::fatal("the frame pool is exhausted");
    };
    paging::word(pa).store(value, Ordering::SeqCst);
    pa
}

fn set_p(pa: u64) {
    GEN_A.set(P, Pte(pa | PRESENT_WRITABLE));
}

/// A flush of A's page P from the boot CPU: (IPIs sent, IPIs AP 1 took).
fn flush_a() -> (u64, u64) {
    let (before, taken) = (TLB.stats(), IPIS_TAKEN[AP].load(Ordering::SeqCst));
    if flush_tlb_page(&arch(), GEN_A.tlb_state(), P).is_err() {
        crate::fatal("flush_tlb_page refused the generations page");
    }
    (
        TLB.stats().since(&before).ipis_sent,
        IPIS_TAKEN[AP].load(Ordering::SeqCst) - taken,
    )
}

fn catch_ups() -> u64 {
    TLB.stats().catch_ups
}

fn read_on_ap() -> u64 {
    step(AP..AP + 1, READ, P);
    result(AP)
}

/// Runs the generations scenario and the switch experiment; `line` is the
/// kernel command line. Returns the scenario's result.
pub fn run(line: &[u8]) -> bool {
    SKIP_CATCH_UP.store(crate::has_word(line, b"negative-catchup"), Ordering::Relaxed);
    let kernel_entry =
        // SAFETY: the boot PML4 is in the identity-mapped .bss; its entry 0
        // never changes after boot.
        unsafe { core::ptr::read_volatile(core::ptr::addr_of!(crate::boot::pml4) as *const u64) };
    GEN_A.init(kernel_entry);
    GEN_B.init(kernel_entry);
    let tagged = arch().tagged_tlb();
    let values = [0x6e6e_0000_0001u64, 0x6e6e_0000_0002, 0x6e6e_0000_0003];
    let frames = values.map(frame_with);
    let in_b = frame_with(0x6e6e_0000_00bb);
    GEN_A.map(P, frames[0]);
    GEN_B.map(P, in_b);

    // 1. AP 1 runs A.
    switch_on(AP..AP + 1, Some(&GEN_A));
    let warm = read_on_ap() == values[0];
    set_p(frames[1]);
    let (running_sent, running_taken) = flush_a();
    let running_read = read_on_ap() == values[1];

    // 2. AP 1 switched to B.
    switch_on(AP..AP + 1, Some(&GEN_B));
    let read_b = read_on_ap() == 0x6e6e_0000_00bb;
    set_p(frames[2]);
    let (away_sent, away_taken) = flush_a();
    let before = catch_ups();
    switch_on(AP..AP + 1, Some(&GEN_A));
    let back_catch_ups = catch_ups() - before;
    let back_read = read_on_ap() == values[2];

    // 3. AP 1 lazy on A, with P's entry (frame 2) in its TLB.
    step(AP..AP + 1, LAZY, 0);
    let lazy = result(AP) == 1;
    set_p(frames[0]);
    let (lazy_sent, lazy_taken) = flush_a();
    let before = catch_ups();
    step(AP..AP + 1, LEAVE_LAZY, 0);
    let left = result(AP) == 1;
    let leave_catch_ups = catch_ups() - before;
    let leave_value = read_on_ap();
    let leave_read = leave_value == values[0];
    let stale = u64::from(leave_value == values[2]) + u64::from(!back_read) + u64::from(!running_read);

    let expected_back = u64::from(tagged);
    let ok = warm
        && read_b
        && lazy
        && left
        && running_sent == 1
        && running_taken == 1
        && away_sent == 0
        && away_taken == 0
        && back_catch_ups == expected_back
        && lazy_sent == 0
        && lazy_taken == 0
        && leave_catch_ups == 1
        && leave_read
        && stale == 0;
    let passed = report(
        "generations",
        ok,
        format_args!(
            "AP {AP} on A: a flush of A sent {running_sent} IPI ({running_taken} taken); AP {AP} switched to B: \
             {away_sent} IPIs ({away_taken} taken), catch-ups when back on A: {back_catch_ups}{}; AP {AP} lazy on A: \
             {lazy_sent} IPIs ({lazy_taken} taken), catch-ups at leave_lazy_tlb: {leave_catch_ups}; stale: {stale} \
             reads of an old frame",
            if tagged {
                ""
            } else {
                " (no PCIDs: the CR3 write of the switch flushed A)"
            }
        ),
    );

    // 4. Does a switch keep a PCID's entries? P (frame 0) is cached in A.
    if tagged {
        let warm = read_on_ap() == values[0];
        switch_on(AP..AP + 1, Some(&GEN_B));
        set_p(frames[1]);
        // No flush: A's generation does not move, so the switch back
        // flushes nothing either (counted, to be sure).
        let before = catch_ups();
        switch_on(AP..AP + 1, Some(&GEN_A));
        let switch_catch_ups = catch_ups() - before;
        let value = read_on_ap();
        let kept = value == values[0] && switch_catch_ups == 0;
        // Now the real flush, which reaches AP 1 (it runs A).
        let _ = flush_a();
        crate::say(format_args!(
            "generations: PCID entries kept across a CR3 write: {} (AP {AP} cached P in PCID 8: {warm}, switched to \
             PCID 9, P remapped with no flush, back on PCID 8 with {switch_catch_ups} catch-ups it read the {} \
             frame){}\n",
            if kept { "yes" } else { "no" },
            if kept {
                "old"
            } else if value == values[1] {
                "new"
            } else {
                "wrong"
            },
            if kept {
                ""
            } else {
                ": a skipped catch-up at a switch cannot be observed here, so it has no negative control"
            }
        ));
    } else {
        crate::say(format_args!(
            "generations: PCID entries kept across a CR3 write: not applicable (PCIDs off: every CR3 write \
             drops the non-global entries)\n"
        ));
    }

    switch_on(AP..AP + 1, None);
    // A maps frames[1] (tagged) or frames[0]: the teardown frees that one.
    let mapped = GEN_A.lookup(P).frame().addr();
    for &f in frames.iter().filter(|&&f| f != mapped) {
        paging::free(f);
    }
    crate::teardown::release(&GEN_A, P, 1 << 30);
    crate::teardown::release(&GEN_B, P, 1 << 30);
    crate::flow::scrub();
    passed
}
