//! A bare-metal SMP test kernel for QEMU's aarch64 `virt` machine.
//!
//! QEMU loads the ELF with `-kernel` and enters `_start` at EL1 (the
//! machine has no EL2 or EL3 unless asked for). The boot CPU zeroes .bss,
//! reads the DTB QEMU wrote at RAM's base, builds one set of page tables
//! ([`mmu`]), turns its MMU and caches on, and starts every other CPU the
//! DTB lists through PSCI CPU_ON ([`psci`]); each of them turns its MMU on
//! with the same tables before it runs any Rust code. Then CPU 0 drives the
//! scenarios ([`scenario`], the set in `qemu-scenarios/` that the x86_64
//! kernel runs too) while the others observe, prints one line per
//! scenario on the PL011 ([`uart`]) and ends the run through semihosting
//! ([`semihost`]): exit status 0 when every scenario passed,
//! [`EXIT_FAIL`] when one failed, [`EXIT_FATAL`] when the kernel could not
//! run them.
//!
//! Kernel command line (`-append`, which QEMU puts in the DTB's
//! `/chosen/bootargs`): `negative` runs the negative control, in which the
//! flush under test goes through the crate with its invalidations skipped
//! (the page-table stores are still published); `negative-local` another,
//! in which its broadcast invalidations are replaced by the local forms
//! (only CPU 0 forgets the pages). Every scenario must then fail, on stale
//! reads.
//! The teardown scenario ([`teardown`]) runs after them, its flush weakened
//! the same way; `negative-teardown` frees its page tables right after the
//! flush instead of after an IPI sync (its walker must then read a freed
//! table), and `negative-nodsb` drops the `DSB ISH` that completes its
//! broadcast flush (which TCG cannot show: see below).
//! Last, on CPUs with hardware dirty state (TCR_EL1.HD), the clean-write
//! scenario ([`dirty`]): stores through stale entries of clean and dirty
//! pages between a batched unmap and its flushes; `negative-dirty` maps
//! its clean pages writable while reporting them clean, and it must fail
//! on stores that landed after the unmap. Under `negative` and
//! `negative-local` its batch is flushed the weakened way too.
//! After it, in every run, the offline scenario ([`offline`]): the last
//! CPU goes offline (`take_offline`) and comes back (`bring_online`) again
//! and again while the others run `ipi_sync`.
//!
//! The TLB maintenance is the crate's ([`tlb`]): every CPU is registered
//! in its `CpuTable` by MPIDR, comes online through `bring_online`, and
//! loads the test address space with `switch_mm`; the scenarios unmap and
//! remap through `flush_tlb_page`, and unmap lists of pages through
//! `try_to_unmap` into a `TlbFlushUnmapBatch` over this kernel's own tables
//! ([`space`]); the reclaim flow ages pages with `page_referenced` (where
//! the CPU sets access flags itself, TCR_EL1.HA) and reclaims the old ones
//! with `try_to_unmap`, `flush_dirty` and `flush`. The crate's aarch64 `Arch` shoots down with broadcast
//! `TLBI`s, so no scenario may send a flush IPI.
//!
//! What QEMU's TCG shows: its software TLB is per vCPU and keeps a
//! translation until a TLBI that reaches that vCPU drops it (or the vCPU
//! rewrites its translation registers), so with the flush skipped or
//! issued without the inner shareable broadcast, an observer reads the old
//! frame in every round. What it cannot show: it keeps no ASIDs in its
//! TLB entries (a `TLBI VAE1IS` with a wrong ASID was measured to pass),
//! and a TLBI has completed on every vCPU before the next instruction (a
//! missing `DSB ISH` passes too). Those need real hardware.

#![no_std]
#![no_main]

mod block;
mod block_split;
mod block_teardown;
mod boot;
mod crew;
mod dirty;
mod fdt;
mod generations;
mod mmu;
mod offline;
mod psci;
mod semihost;
mod space;
mod teardown;
mod tlb;
mod uart;

use core::fmt::Write;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tlb_batch_qemu_scenarios as scenario;

use scenario::{BatchNote, Flush, Frame, Ipis, MprotectNote, Platform, ReclaimNote};
use tlb_batch::arch::aarch64::{self as a64, Aarch64, Config};
use tlb_batch::{
    change_protection, flush_tlb_page, flush_tlb_range, page_referenced, try_to_unmap, Arch, PageRange, Pte,
    PteFlags, SwapResult, TlbFlushUnmapBatch, TtuFlags,
};

/// CPUs this kernel starts at most.
pub const MAX_CPUS: usize = 8;
/// Exit status when a scenario failed.
pub const EXIT_FAIL: u32 = 3;
/// Exit status when the kernel stopped before its verdict (a boot error,
/// an unexpected exception, a panic).
pub const EXIT_FATAL: u32 = 4;
const _: () = assert!(scenario::LIST_PAGES <= <Aarch64 as Arch>::FULL_FLUSH_CEILING);
const _: () = assert!(mmu::TEST_PAGES > <Aarch64 as Arch>::FULL_FLUSH_CEILING);
const _: () = assert!(MAX_CPUS <= scenario::MAX_CPUS);

/// Where QEMU's virt machine writes the DTB for an ELF kernel loaded above
/// it: the start of RAM.
const VIRT_RAM_BASE: u64 = 0x4000_0000;

/// CPUs that have turned their MMU on and are observing (CPU 0 included).
static ONLINE: AtomicUsize = AtomicUsize::new(1);
static mut AP_BOOT: [boot::ApBoot; MAX_CPUS] = [const {
    boot::ApBoot {
        stack_top: 0,
        cpu: 0,
        mmu: mmu::MmuConfig {
            mair: 0,
            tcr: 0,
            ttbr0: 0,
            sctlr: 0,
        },
    }
}; MAX_CPUS];

/// A page-aligned frame a test page maps.
#[repr(C, align(4096))]
struct Page([AtomicU64; 512]);

/// Each test page's frames A and B.
static FRAMES_A: [Page; mmu::TEST_PAGES] =
    [const { Page([const { AtomicU64::new(0) }; 512]) }; mmu::TEST_PAGES];
static FRAMES_B: [Page; mmu::TEST_PAGES] =
    [const { Page([const { AtomicU64::new(0) }; 512]) }; mmu::TEST_PAGES];
const _: () = assert!(mmu::TEST_PAGES <= scenario::MAX_PAGES);

pub fn say(args: core::fmt::Arguments<'_>) {
    let _ = uart::Uart.write_fmt(args);
}

#[macro_export]
macro_rules! say {
    ($($t:tt)*) => { $crate::say(format_args!($($t)*)) };
}

pub fn fatal(why: &str) -> ! {
    say!("FATAL: {why}\n");
    semihost::exit(EXIT_FATAL)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    say!("PANIC on CPU {}: {info}\n", cpu_index());
    semihost::exit(EXIT_FATAL)
}

/// Waits for interrupts forever (none are enabled).
pub fn halt() -> ! {
    loop {
        // SAFETY: waits for an interrupt; no other effect.
        unsafe { core::arch::asm!("wfi", options(nomem, nostack)) };
    }
}

/// This CPU's index (0 for the boot CPU), which each CPU keeps in
/// TPIDR_EL1 from its first Rust code on.
pub fn cpu_index() -> usize {
    let v: u64;
    // SAFETY: reading TPIDR_EL1 has no side effect.
    unsafe { core::arch::asm!("mrs {}, tpidr_el1", out(reg) v, options(nomem, nostack)) };
    v as usize
}

fn set_cpu_index(i: usize) {
    // SAFETY: TPIDR_EL1 is software's scratch register; nothing else here
    // uses it.
    unsafe { core::arch::asm!("msr tpidr_el1, {}", in(reg) i as u64, options(nomem, nostack)) };
}

fn current_el() -> u64 {
    let v: u64;
    // SAFETY: reading CurrentEL has no side effect.
    unsafe { core::arch::asm!("mrs {}, CurrentEL", out(reg) v, options(nomem, nostack)) };
    (v >> 2) & 3
}

fn mpidr() -> u64 {
    let v: u64;
    // SAFETY: reading MPIDR_EL1 has no side effect.
    unsafe { core::arch::asm!("mrs {}, mpidr_el1", out(reg) v, options(nomem, nostack)) };
    // Affinity levels 0-2 and 3; not the U and MT flags or RES1 bit 31.
    v & 0xff_00ff_ffff
}

/// Microseconds of the generic timer's virtual count.
fn now_us() -> u64 {
    let (count, freq): (u64, u64);
    // SAFETY: reading the counter registers has no side effect (EL1 may
    // always read them).
    unsafe {
        core::arch::asm!(
            "isb",
            "mrs {c}, cntvct_el0",
            "mrs {f}, cntfrq_el0",
            c = out(reg) count,
            f = out(reg) freq,
            options(nomem, nostack),
        );
    }
    (u128::from(count) * 1_000_000 / u128::from(freq.max(1))) as u64
}

/// The scenarios' view of this machine.
struct Virt;

impl Virt {
    /// Flushes `page` through the crate with the `Arch` that `flush` names.
    fn flush_with(&self, flush: Flush, page: usize) {
        let a = *tlb::arch();
        let va = mmu::test_va(page);
        let done = match flush {
            Flush::AllCpus => flush_tlb_page(&a, tlb::mm(), va),
            Flush::ThisCpuOnly => flush_tlb_page(&tlb::LocalTlbi(a), tlb::mm(), va),
            Flush::Skipped => flush_tlb_page(&tlb::SkipTlbi(a), tlb::mm(), va),
        };
        if done.is_err() {
            fatal("flush_tlb_page refused a test page");
        }
    }

    /// Unmaps the frames A of pages `0..pages` with `try_to_unmap` into one
    /// batch and flushes it once, with `a` as the `Arch`.
    fn unmap_with<A: Arch>(&self, a: &A, pages: usize) -> BatchNote {
        let before = tlb::TLB.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        let mut note = BatchNote::default();
        // Every test descriptor is written with its access flag set, so
        // without IGNORE_ACCESS the walk would only clear the flag and
        // answer Fail: aging is what the reclaim flow tests, not these.
        let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
        for frame in FRAMES_A.iter().take(pages) {
            let frame = tlb_batch::Frame(frame.0.as_ptr() as u64 >> 12);
            // The pages are writable, hence reported dirty: each unmap
            // leaves a possibly writable TLB entry for the batch's flush.
            match try_to_unmap(a, &space::TestRmap, frame, flags, &mut batch) {
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
        let d = tlb::TLB.stats().since(&before);
        note.shootdowns = d.shootdowns;
        note.page_invalidations = d.local_page_flushes;
        note.full_invalidations = d.local_full_flushes;
        note
    }

    /// The first aging pass of the reclaim flow, with `a` as the `Arch`.
    fn age_with<A: Arch>(&self, a: &A, pages: usize) -> (u64, u64) {
        let before = tlb::TLB.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        let mut young = 0;
        for (i, frame) in FRAMES_A.iter().enumerate().take(pages) {
            let frame = tlb_batch::Frame(frame.0.as_ptr() as u64 >> 12);
            match page_referenced(a, &space::TestRmap, frame, &mut batch) {
                Ok(r) if r.referenced > 0 => young |= 1 << i,
                Ok(_) => {}
                Err(_) => fatal("page_referenced refused a test frame"),
            }
        }
        // Clearing an access flag leaves TLB entries that would keep it
        // clear while the page is used: the crate recorded a flush for each.
        if batch.flush(a).is_err() {
            fatal("the aging batch's flush failed");
        }
        (young, tlb::TLB.stats().since(&before).shootdowns)
    }

    /// The reclaim pass of the reclaim flow, with `a` as the `Arch`.
    fn reclaim_with<A: Arch>(&self, a: &A, pages: usize) -> ReclaimNote {
        let before = tlb::TLB.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        let mut note = ReclaimNote::default();
        for (i, frame) in FRAMES_A.iter().enumerate().take(pages) {
            let frame = tlb_batch::Frame(frame.0.as_ptr() as u64 >> 12);
            match page_referenced(a, &space::TestRmap, frame, &mut batch) {
                Ok(r) if r.referenced > 0 => {
                    note.young |= 1 << i;
                    continue;
                }
                Ok(_) => {}
                Err(_) => fatal("page_referenced refused a test frame"),
            }
            // Old: unmap it, the flush deferred to the batch. The access
            // flag is clear, so no IGNORE_ACCESS is needed.
            match try_to_unmap(a, &space::TestRmap, frame, TtuFlags::BATCH_FLUSH, &mut batch) {
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
        let flushed = tlb::TLB.stats().since(&before).shootdowns > 0;
        for (i, frame) in FRAMES_A.iter().enumerate().take(pages) {
            if note.unmapped & 1 << i != 0 {
                // The write-out: a copy of the frame's first word.
                WRITTEN_OUT[i].store(frame.0[0].load(Ordering::Acquire), Ordering::Relaxed);
                if !flushed {
                    note.written_early += 1;
                }
            }
        }
        if batch.flush(a).is_err() {
            fatal("the reclaim batch's flush failed");
        }
        note.shootdowns = tlb::TLB.stats().since(&before).shootdowns;
        note
    }
}

impl Virt {
    /// The mprotect scenario's change, with `a` as the `Arch`.
    fn mprotect_with<A: Arch>(&self, a: &A, unmapped: usize, pages: usize) -> MprotectNote {
        let mut batch = TlbFlushUnmapBatch::new();
        let mut note = MprotectNote::default();
        for frame in FRAMES_A.iter().take(unmapped) {
            let frame = tlb_batch::Frame(frame.0.as_ptr() as u64 >> 12);
            let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
            match try_to_unmap(a, &space::TestRmap, frame, flags, &mut batch) {
                Ok(SwapResult::SuccessCached) => note.unmapped += 1,
                Ok(_) => {}
                Err(_) => fatal("try_to_unmap refused a test frame"),
            }
        }
        // The reclaimer's batch is left pending across the mprotect.
        note.pending_before = tlb::mm().batched_flush_pending();
        let Ok(range) = PageRange::new(mmu::TEST_VA, pages as u64) else {
            fatal("the mprotect range is not a page range");
        };
        let read_only = |pte: Pte| Pte(pte.0 & !PteFlags::WRITABLE.bits());
        match change_protection(a, &space::TestSpace, range, read_only) {
            Ok(n) => note.changed = n as u32,
            Err(_) => fatal("change_protection failed"),
        }
        note.pending_after = tlb::mm().batched_flush_pending();
        if batch.flush(a).is_err() {
            fatal("the reclaimer's batch flush failed");
        }
        note
    }
}

/// The reclaim flow's "swap": the first word of each page written out.
static WRITTEN_OUT: [AtomicU64; mmu::TEST_PAGES] = [const { AtomicU64::new(0) }; mmu::TEST_PAGES];

impl Platform for Virt {
    fn cpu_count(&self) -> usize {
        ONLINE.load(Ordering::Acquire)
    }
    fn this_cpu(&self) -> usize {
        cpu_index()
    }
    fn fill_frame(&self, page: usize, frame: Frame, value: u64) {
        frame_of(page, frame).0[0].store(value, Ordering::Release);
    }
    fn set_pte(&self, page: usize, frame: Option<Frame>) {
        let entry = frame.map_or(0, |f| frame_of(page, f).0.as_ptr() as u64 | mmu::TEST_PAGE_FLAGS);
        mmu::test_pte(page).store(entry, Ordering::Release);
    }
    fn publish(&self) {
        // The entries' stores reach every CPU's table walks, and this CPU's
        // next instructions see them.
        a64::dsb_ishst();
        a64::isb();
    }
    fn flush_pages(&self, pages: usize) {
        let range = PageRange::new(mmu::TEST_VA, pages as u64);
        if !range.is_ok_and(|r| flush_tlb_range(tlb::arch(), tlb::mm(), r).is_ok()) {
            fatal("flush_tlb_range refused the test pages");
        }
    }
    fn flush_page(&self, page: usize, flush: Flush) {
        self.flush_with(flush, page);
    }
    fn unmap_batched(&self, pages: usize, flush: Flush) -> BatchNote {
        let a = *tlb::arch();
        match flush {
            Flush::AllCpus => self.unmap_with(&a, pages),
            Flush::ThisCpuOnly => self.unmap_with(&tlb::LocalTlbi(a), pages),
            Flush::Skipped => self.unmap_with(&tlb::SkipTlbi(a), pages),
        }
    }
    fn hw_access_flag(&self) -> bool {
        mmu::MmuFeatures::read().hw_access_flag
    }
    fn no_access_flag_why(&self) -> &'static str {
        "no hardware access flag (ID_AA64MMFR1_EL1.HAFDBS = 0)"
    }
    fn age_pages(&self, pages: usize, flush: Flush) -> (u64, u64) {
        let a = *tlb::arch();
        match flush {
            Flush::AllCpus => self.age_with(&a, pages),
            Flush::ThisCpuOnly => self.age_with(&tlb::LocalTlbi(a), pages),
            Flush::Skipped => self.age_with(&tlb::SkipTlbi(a), pages),
        }
    }
    fn reclaim_pages(&self, pages: usize, flush: Flush) -> ReclaimNote {
        let a = *tlb::arch();
        match flush {
            Flush::AllCpus => self.reclaim_with(&a, pages),
            Flush::ThisCpuOnly => self.reclaim_with(&tlb::LocalTlbi(a), pages),
            Flush::Skipped => self.reclaim_with(&tlb::SkipTlbi(a), pages),
        }
    }
    fn mprotect_pending(&self, unmapped: usize, pages: usize, flush: Flush) -> MprotectNote {
        let a = *tlb::arch();
        match flush {
            Flush::AllCpus => self.mprotect_with(&a, unmapped, pages),
            Flush::ThisCpuOnly => self.mprotect_with(&tlb::LocalTlbi(a), unmapped, pages),
            Flush::Skipped => self.mprotect_with(&tlb::SkipTlbi(a), unmapped, pages),
        }
    }
    fn write_page(&self, page: usize, value: u64) -> bool {
        boot::probe_store_word(mmu::test_va(page) + 8, value)
    }
    fn invalidates_on_add(&self) -> bool {
        <Aarch64 as Arch>::BATCH_BROADCAST_ON_ADD
    }
    fn full_flush_ceiling(&self) -> usize {
        <Aarch64 as Arch>::FULL_FLUSH_CEILING
    }
    fn read_page(&self, page: usize) -> Option<u64> {
        boot::probe(mmu::test_va(page))
    }
    fn broadcast_shootdowns(&self) -> bool {
        // The crate's aarch64 `Arch` shoots down with `TLBI ... IS`.
        <Aarch64 as Arch>::BROADCAST_INVALIDATE
    }
    fn ipis(&self) -> Ipis {
        let (sent, hook_calls) = tlb::ipis();
        Ipis {
            sent,
            seen: hook_calls,
            shootdowns: tlb::TLB.stats().shootdowns,
        }
    }
    fn poll(&self) {
        tlb::poll();
        teardown::serve();
        dirty::serve();
        generations::serve();
        offline::serve();
        block::serve();
        block_split::serve();
        block_teardown::serve();
    }
    fn now_us(&self) -> u64 {
        now_us()
    }
}

fn frame_of(page: usize, frame: Frame) -> &'static Page {
    match frame {
        Frame::A => &FRAMES_A[page],
        Frame::B => &FRAMES_B[page],
    }
}

/// The test page whose frame A is `frame`, if any.
pub fn page_of_frame_a(frame: tlb_batch::Frame) -> Option<usize> {
    FRAMES_A.iter().position(|p| p.0.as_ptr() as u64 == frame.addr())
}

fn has_word(line: &[u8], word: &[u8]) -> bool {
    line.split(|&b| b == b' ').any(|w| w == word)
}

#[no_mangle]
extern "C" fn kernel_main(x0: u64) -> ! {
    set_cpu_index(0);
    if current_el() != 1 {
        fatal("entered outside EL1: run the virt machine without virtualization=on or secure=on");
    }
    // An ELF kernel gets the DTB's address in x0 only under the Linux boot
    // protocol; otherwise it is at RAM's base (checked by its magic).
    let dtb = if x0 != 0 { x0 } else { VIRT_RAM_BASE };
    // SAFETY: `dtb` is in the virt machine's RAM, readable with the MMU
    // off; QEMU wrote the DTB there and nothing writes that memory.
    let info = match unsafe { fdt::read(dtb) } {
        Ok(info) => info,
        Err(e) => fatal(e),
    };
    let Some(conduit) = psci::Conduit::from_method(info.psci_method) else {
        fatal("the DTB names no PSCI conduit (/psci method)");
    };
    let features = mmu::MmuFeatures::read();
    if !features.has_4k {
        fatal("the CPU has no 4 KiB translation granule");
    }
    if let Err(e) = mmu::build(info.ram.0, info.ram.1) {
        fatal(e);
    }
    let mmu_config = mmu::config(&features);
    // SAFETY: the tables identity-map this kernel's image, stacks and the
    // UART with the attributes it ran with; interrupts are masked.
    unsafe { boot::mmu_enable(&mmu_config) };
    if !mmu::enabled() {
        fatal("the MMU did not turn on");
    }

    let flush = if has_word(info.bootargs, b"negative") {
        Flush::Skipped
    } else if has_word(info.bootargs, b"negative-local") {
        Flush::ThisCpuOnly
    } else {
        Flush::AllCpus
    };
    // SAFETY: this CPU runs at EL1 (checked above).
    let config = match unsafe { Config::detect() } {
        Ok(c) => c,
        Err(_) => fatal("the crate refuses this CPU's MMU setup (Config::detect)"),
    };
    if let Err(e) = tlb::init(config, features.test_asid()) {
        fatal(e);
    }
    if tlb::CPUS.register(0, mpidr()).is_err() {
        fatal("the boot CPU cannot be registered in the CpuTable");
    }
    tlb::cpu_up(0);
    let (major, minor) = psci::version(conduit);
    say!(
        "tlb-batch aarch64 QEMU test kernel: EL{}, DTB at {:#x} (x0 {:#x}), RAM {:#x}+{:#x}, PSCI {}.{} via {}, \
         {}-bit ASIDs (test ASID {:#x}), {}-bit VAs, PARange {:#x}, hardware access flag {}, hardware dirty state {}, \
         flush under test: {:?}\n",
        current_el(),
        dtb,
        x0,
        info.ram.0,
        info.ram.1,
        major,
        minor,
        if conduit == psci::Conduit::Hvc { "HVC" } else { "SMC" },
        config.asid_bits(),
        features.test_asid(),
        config.va_bits(),
        features.pa_range,
        if features.hw_access_flag { "on (TCR_EL1.HA)" } else { "absent" },
        if features.hw_dirty_state() { "on (TCR_EL1.HD)" } else { "absent" },
        flush
    );

    start_secondaries(&info, conduit, mmu_config);
    let n = ONLINE.load(Ordering::Acquire);
    say!(
        "{n} CPUs online, MMU and caches on in each, {} online in the crate's CpuTable\n",
        tlb::CPUS.online().len()
    );
    if info.cpus_dropped > 0 {
        say!("({} more CPUs in the DTB left off)\n", info.cpus_dropped);
    }
    if n < 2 {
        fatal("the scenarios need at least 2 CPUs (-smp)");
    }

    let p = Virt;
    let outcomes = scenario::run_set(&p, mmu::TEST_PAGES, flush);
    for o in &outcomes {
        say!("{o}\n");
    }
    let teardown_passed = teardown::run(info.bootargs);
    let dirty_passed = dirty::run(info.bootargs);
    let generations_passed = generations::run(info.bootargs);
    let block_passed = block::run(info.bootargs, info.ram);
    let split_passed = block_split::run(info.bootargs, info.ram);
    let block_teardown_passed = block_teardown::run(info.bootargs, info.ram);
    // Whatever the flush under test, the CPU going offline runs with the
    // real one.
    let offline_passed = offline::run();
    let s = tlb::TLB.stats();
    say!(
        "crate counters: {} shootdowns, {} broadcasts, {} IPIs sent, {} pages deferred, {} batches flushed; \
         {} dirty frames reported, {} permission faults recovered\n",
        s.shootdowns,
        s.broadcasts,
        s.ipis_sent,
        s.pages_deferred,
        s.batches_flushed,
        space::DIRTIED.load(Ordering::Relaxed),
        boot::PERMISSION_FAULTS.load(Ordering::Relaxed)
    );
    let passed = outcomes.iter().filter(|o| o.passed()).count()
        + usize::from(teardown_passed)
        + usize::from(dirty_passed)
        + usize::from(generations_passed)
        + usize::from(block_passed)
        + usize::from(split_passed)
        + usize::from(block_teardown_passed)
        + usize::from(offline_passed);
    let total = outcomes.len() + 7;
    say!("{passed} passed, {} failed\n", total - passed);
    semihost::exit(if passed == total { 0 } else { EXIT_FAIL })
}

/// Starts every CPU the DTB lists besides this one, one at a time, each
/// with its own stack, and waits until it has turned its MMU on.
fn start_secondaries(info: &fdt::BootInfo<'_>, conduit: psci::Conduit, config: mmu::MmuConfig) {
    let me = mpidr();
    // The secondaries walk the tables with their caches off at first.
    mmu::clean_tables();
    let mut next = 1;
    for &target in &info.cpus[..info.cpu_count] {
        if target == me {
            continue;
        }
        if tlb::CPUS.register(next, target).is_err() {
            say!("MPIDR {target:#x} cannot be CPU {next} in the CpuTable\n");
            fatal("a secondary CPU could not be registered");
        }
        // SAFETY: this CPU alone writes AP_BOOT, and only for CPUs not yet
        // started; the started CPU reads its entry only after CPU_ON.
        let block = unsafe {
            let b = &mut (*core::ptr::addr_of_mut!(AP_BOOT))[next];
            let stacks = core::ptr::addr_of!(boot::STACKS) as u64;
            b.stack_top = stacks + ((next + 1) * boot::STACK_SIZE) as u64;
            b.cpu = next as u64;
            b.mmu = config;
            b as *const boot::ApBoot as u64
        };
        mmu::clean_to_poc(block, core::mem::size_of::<boot::ApBoot>() as u64);
        let online = ONLINE.load(Ordering::Acquire);
        let entry = boot::secondary_entry as *const () as u64;
        let status = psci::cpu_on(conduit, target, entry, block);
        if status != 0 {
            say!("PSCI CPU_ON for MPIDR {target:#x} returned {status}\n");
            fatal("a secondary CPU could not be started");
        }
        let start = now_us();
        while ONLINE.load(Ordering::Acquire) == online {
            if now_us() - start > 10_000_000 {
                fatal("a secondary CPU did not come up within 10 s");
            }
            core::hint::spin_loop();
        }
        next += 1;
    }
}

#[no_mangle]
extern "C" fn ap_main(cpu: u64) -> ! {
    set_cpu_index(cpu as usize);
    if !mmu::enabled() {
        fatal("a secondary CPU's MMU is off");
    }
    tlb::cpu_up(cpu as usize);
    ONLINE.fetch_add(1, Ordering::AcqRel);
    scenario::observe(&Virt)
}
