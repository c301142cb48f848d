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
//! `granule64` (with or without a control's word) builds the tables with
//! the 64 KiB granule instead ([`mmu64`]): the shared scenarios and the
//! offline one run over 64 KiB test pages, as do the clean writes and the
//! generations scenario and the teardown (its tables 64 KiB frames below
//! the 64-entry level 1 root), the scenario of [`granule64`] counts the
//! crate's `TLBI`s per 64 KiB page and its level hints, and the block
//! scenarios run over a level 2 block of 512 MiB instead of 2 MiB (the
//! script gives those runs 4 GiB of RAM for their six blocks).
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
mod dirty_space;
mod fdt;
mod generations;
mod granule64;
mod mmu;
mod mmu64;
mod offline;
mod psci;
mod semihost;
mod space;
mod teardown;
mod teardown_space;
mod tlb;
mod uart;
mod virt;

use core::fmt::Write;
use core::sync::atomic::{AtomicUsize, Ordering};

use tlb_batch_qemu_scenarios as scenario;

use scenario::Flush;
use tlb_batch::arch::aarch64::{Aarch64, Config};
use tlb_batch::Arch;
pub use virt::{page_of_frame_a, Virt};

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
    if has_word(info.bootargs, b"granule64") {
        if !features.has_64k {
            fatal("granule64: the CPU has no 64 KiB translation granule (ID_AA64MMFR0_EL1.TGran64 = 0b1111)");
        }
        mmu::use_granule64();
    } else if !features.has_4k {
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

    if mmu::granule64() {
        say!(
            "granule64: ID_AA64MMFR0_EL1.TGran64 present; TCR_EL1 {:#x} (TG0 = 0b01, TG1 = 0b11: 64 KiB), tables \
             of levels 1 to 3 (T0SZ = 16), 64 KiB test pages; the crate's base page: {} KiB; FEAT_TTL \
             (ID_AA64MMFR2_EL1.TTL): {}, so level hints are {}\n",
            mmu_config.tcr,
            config.granule().bytes() >> 10,
            if features.feat_ttl { "present" } else { "absent" },
            if config.level_hints() { "on" } else { "off" },
        );
    }
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
    let g64 = mmu::granule64();
    let teardown_passed = teardown::run(info.bootargs);
    let dirty_passed = dirty::run(info.bootargs);
    let generations_passed = generations::run(info.bootargs);
    // The block scenarios: a level 2 block, 2 MiB or (granule64) 512 MiB.
    let block_passed = block::run(info.bootargs, info.ram);
    let split_passed = block_split::run(info.bootargs, info.ram);
    let block_teardown_passed = block_teardown::run(info.bootargs, info.ram);
    let granule_passed = !g64 || granule64::run();
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
        + usize::from(offline_passed)
        + usize::from(g64 && granule_passed);
    let total = outcomes.len() + 7 + usize::from(g64);
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
