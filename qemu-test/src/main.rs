//! A bare-metal SMP test kernel for tlb-batch's x86_64 code.
//!
//! QEMU boots it through Multiboot; it brings up every CPU the ACPI MADT
//! lists, maps test pages with 4 KiB PTEs, and runs shootdown scenarios
//! with the crate's real `X86_64` implementation: real `invlpg`/CR3
//! flushes, real APIC IPIs, real interrupts. QEMU's TCG keeps stale
//! translations until they are invalidated, so a missing shootdown shows up
//! as a read that should fault but does not. Each scenario prints its
//! result on the serial port; the exit code (isa-debug-exit) says whether
//! all passed.
//!
//! Kernel command line words: `x2apic` (use x2APIC mode; fail if the CPU
//! lacks it), `pcid` (use PCIDs when the CPU has PCID and INVPCID),
//! `negative` (the negative control: remote CPUs acknowledge flush requests
//! without flushing, so the scenarios must fail; the teardown scenario
//! also frees page tables right after the flush instead of after an IPI
//! sync; the shared scenarios' flush under test then reaches CPU 0 only),
//! `negative-noinval` (with `negative`: the shared scenarios' flush under
//! test invalidates nothing, on CPU 0 either), `negative-teardown` (only
//! the teardown's control), `negative-window` (only the CR3 window's
//! control: [`window`] leaves the switching CPU out of its flush; `negative`
//! does so too), `timing` (also time N
//! single-page shootdowns against one batched shootdown of N pages),
//! `storm-only` (run the storm and offline scenarios alone, for the
//! many-CPU runs),
//! `unregistered` (the last AP is started without being registered in the
//! CPU table: it must stop the run when it tries to come online, never run
//! as another CPU).
//!
//! The flow scenarios (reclaim, migration, teardown, mprotect: modules
//! [`reclaim`], [`teardown`], [`mprotect`]) run the crate's drivers over
//! address spaces with page tables this kernel owns ([`paging`]), while the
//! APs store into the pages ([`flow`]); the storm ([`storm`]) has every CPU
//! shoot at every other at once; [`offline`] has the last AP go offline
//! (`take_offline`) and come back (`bring_online`) again and again while
//! the other CPUs shoot at every CPU; [`mapper`] builds an address space with
//! the `x86_64` crate's `OffsetPageTable` and runs `change_protection` and a
//! teardown through the crate's `x86_64-mapper` adapter; [`shared`] runs
//! the scenario set the aarch64 kernel runs too (`qemu-scenarios/`), with
//! this kernel's test mapping as its `Platform`; [`window`] flushes a page
//! while an AP is between its CR3 write and the end of `switch_mm`. With
//! PCIDs on, [`pcid`] adds scenarios with two PCID-tagged address spaces.

#![no_std]
#![no_main]

mod acpi;
mod basic;
mod boot;
mod flow;
mod generations;
mod huge;
mod huge_range;
mod hw;
mod mapper;
mod mprotect;
mod offline;
mod paging;
mod pcid;
mod pool_flow;
mod reclaim;
mod shared;
mod storm;
mod teardown;
mod window;

use core::fmt::Write;
use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use tlb_batch::arch::x86_64::{self as x86, CpuTable, Features, LocalApic, Supported, X86_64};
use tlb_batch::heapless;
use tlb_batch::{
    flush_tlb_page, handle_flush_ipi, shootdown, switch_mm, Arch, Asid, CpuId, CpuSet, FlushRequest,
    MmTlbState, Pte, TlbFlushUnmapBatch, TlbShootdown,
};

use boot::Frame;
use hw::Serial;
use tlb_batch_qemu_scenarios::Flush;

const FLUSH_VECTOR: u8 = 0xf0;
const SPURIOUS_VECTOR: u8 = 0xff;
const MAX_CPUS: usize = 64;
/// Test pages live at 4 GiB (PDPT entry 4), mapped with 4 KiB PTEs.
const TEST_BASE: u64 = 0x1_0000_0000;
const TEST_PAGES: usize = 512;
/// Physical frames behind the test pages (identity-mapped as well).
const TEST_PHYS: u64 = 0x0200_0000;
const PTE_FLAGS: u64 = 0x3;
const TRAMPOLINE: u64 = 0x8000;

static TLB: TlbShootdown = TlbShootdown::new();
static CPUS: CpuTable = CpuTable::new();
static USE_X2APIC: AtomicBool = AtomicBool::new(false);
static USE_PCID: AtomicBool = AtomicBool::new(false);
static NEGATIVE: AtomicBool = AtomicBool::new(false);
static SKIP_LAST_REGISTRATION: AtomicBool = AtomicBool::new(false);
static FEATURES: AtomicU32 = AtomicU32::new(0);
static ONLINE: AtomicUsize = AtomicUsize::new(1);

static FIXUP: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static IPIS_TAKEN: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static COMMAND: [AtomicU32; MAX_CPUS] = [const { AtomicU32::new(0) }; MAX_CPUS];
static ARG: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static RESULT: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];

const IDLE: u32 = 0;
const PROBE: u32 = 1;
const SHOOT_BACK: u32 = 2;
const BUSY: u32 = 3;

#[repr(C, align(4096))]
struct Table([AtomicU64; 512]);

static TEST_PD: Table = Table([const { AtomicU64::new(0) }; 512]);
static TEST_PT: Table = Table([const { AtomicU64::new(0) }; 512]);

#[repr(C, align(16))]
struct Stacks([[u8; 16384]; MAX_CPUS]);
static mut AP_STACKS: Stacks = Stacks([[0; 16384]; MAX_CPUS]);

static mut MM_STORAGE: core::mem::MaybeUninit<MmTlbState> = core::mem::MaybeUninit::uninit();
static MM_READY: AtomicBool = AtomicBool::new(false);

fn mm() -> &'static MmTlbState {
    if !MM_READY.load(Ordering::Acquire) {
        fatal("address space used before it was set up");
    }
    // SAFETY: written once by the boot CPU before MM_READY was published
    // (release/acquire), never written again.
    unsafe { (*core::ptr::addr_of!(MM_STORAGE)).assume_init_ref() }
}

/// What this kernel enables on every CPU, from what the boot CPU's CPUID
/// reported: global pages whenever supported, x2APIC mode and PCIDs when
/// the command line asks (`cpu_init` sets CR4 before any CPU uses the
/// `Arch`). Built by hand, since `Features::detect` would read one CPU's
/// CR4 on every call; `X86_64::new` checks it against the running CPU's.
fn features() -> Features {
    let bits = FEATURES.load(Ordering::Relaxed);
    Features {
        pcid: bits & 1 != 0 && USE_PCID.load(Ordering::Relaxed),
        invpcid: bits & 2 != 0,
        x2apic: bits & 4 != 0 && USE_X2APIC.load(Ordering::Relaxed),
        pge: bits & 8 != 0,
        // The test kernel runs 4-level paging.
        la57: false,
        // The boot page tables map the kernel without the global bit.
        kernel_global: false,
        hypervisor: bits & 16 != 0,
        // As detected: the scenarios' reverse map keeps no aging epochs,
        // so nothing here rests on it either way.
        fill_sets_accessed: bits & 32 != 0,
    }
}

fn apic() -> LocalApic {
    if USE_X2APIC.load(Ordering::Relaxed) {
        // SAFETY: chosen only when CPUID reports x2APIC; every CPU enables
        // x2APIC mode before it uses the value.
        unsafe { LocalApic::x2apic() }
    } else {
        // SAFETY: 0xFEE00000 is identity-mapped by the boot page tables
        // and used only as the APIC's registers.
        unsafe { LocalApic::xapic(0xfee0_0000) }
    }
}

/// The crate's x86_64 `Arch` for this machine.
fn arch() -> X86_64 {
    // SAFETY: every CPU registers in CPUS and goes online only after its
    // IDT routes FLUSH_VECTOR to `interrupt_dispatch`, which calls
    // `flush_ipi_entry`; `cpu_init` set CR4.PGE (and CR4.PCIDE when PCIDs
    // are claimed) on every CPU before its first use of the value; all of
    // it runs in ring 0.
    match unsafe { X86_64::new(apic(), FLUSH_VECTOR, &CPUS, &TLB, features()) } {
        Ok(arch) => arch,
        Err(e) => {
            say(format_args!("X86_64::new refused this CPU's features: {e}\n"));
            hw::exit(hw::EXIT_FAIL)
        }
    }
}

fn me() -> usize {
    arch()
        .current_cpu()
        .expect("every CPU of the test kernel is registered")
        .index()
}

fn say(args: core::fmt::Arguments<'_>) {
    let _ = Serial.write_fmt(args);
}

macro_rules! say {
    ($($t:tt)*) => { say(format_args!($($t)*)) };
}

fn fatal(why: &str) -> ! {
    say!("FATAL: {why}\n");
    hw::exit(hw::EXIT_FAIL)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    say!("PANIC: {info}\n");
    hw::exit(hw::EXIT_FAIL)
}

fn test_va(i: usize) -> u64 {
    TEST_BASE + (i as u64) * 4096
}

/// Reads the word at `va`; `None` if the read page-faulted.
fn probe(va: u64) -> Option<u64> {
    let slot = &FIXUP[me()];
    let value: u64;
    let faulted: u64;
    // SAFETY: the page-fault handler resumes at label 2 when `slot` holds
    // its address, so a faulting read cannot crash; the registers written
    // before the inputs are consumed are `out`, never shared with inputs.
    unsafe {
        core::arch::asm!(
            "lea {tmp}, [rip + 2f]",
            "mov qword ptr [{slot}], {tmp}",
            "mov {val}, qword ptr [{addr}]",
            "mov qword ptr [{slot}], 0",
            "xor {flag:e}, {flag:e}",
            "jmp 3f",
            "2:",
            "mov {flag:e}, 1",
            "3:",
            tmp = out(reg) _,
            slot = in(reg) slot.as_ptr(),
            val = out(reg) value,
            addr = in(reg) va,
            flag = out(reg) faulted,
            options(nostack),
        );
    }
    (faulted == 0).then_some(value)
}

/// The negative control's handler: acknowledges every request and flushes
/// nothing. Deliberately breaks the `Arch` contract.
struct SkipFlush(X86_64);

// SAFETY: NOT sound on purpose: the negative control proves the scenarios
// notice a missing remote flush. Everything but the local flushes
// delegates to the real implementation.
unsafe impl Arch for SkipFlush {
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

#[no_mangle]
extern "C" fn interrupt_dispatch(frame: &mut Frame) {
    match frame.vector {
        14 => {
            let fix = FIXUP[me()].swap(0, Ordering::SeqCst);
            if fix == 0 {
                say!(
                    "unexpected page fault at {:#x}, rip {:#x}\n",
                    hw::cr2(),
                    frame.rip
                );
                hw::exit(hw::EXIT_FAIL);
            }
            frame.rip = fix;
        }
        0xf0 => {
            IPIS_TAKEN[me()].fetch_add(1, Ordering::SeqCst);
            let skip = match shared::REMOTE.load(Ordering::SeqCst) {
                shared::SKIP => true,
                shared::FLUSH => false,
                _ => NEGATIVE.load(Ordering::Relaxed),
            };
            if skip {
                handle_flush_ipi(&SkipFlush(arch()));
                arch().apic().eoi();
            } else {
                arch().flush_ipi_entry();
            }
        }
        0xff => {}
        v => {
            say!(
                "unexpected exception {v} error {:#x} at rip {:#x}\n",
                frame.error,
                frame.rip
            );
            hw::exit(hw::EXIT_FAIL);
        }
    }
}

/// Per-CPU setup shared by the boot CPU and the APs.
fn cpu_init(cpu: usize) {
    hw::load_idt();
    // SAFETY: ring 0; PGE and (when chosen) PCIDE are supported (checked at
    // boot); CR3's PCID is 0 when PCIDE is turned on.
    unsafe {
        let mut cr4 = x86::read_cr4();
        if features().pge {
            cr4 |= x86::CR4_PGE;
        }
        if USE_PCID.load(Ordering::Relaxed) {
            cr4 |= x86::CR4_PCIDE;
        }
        x86::write_cr4(cr4);
        apic().enable(SPURIOUS_VECTOR);
    }
    match arch().bring_online() {
        Ok(id) if id.index() == cpu => {}
        Ok(_) => fatal("a CPU came up under another index than it was registered with"),
        Err(e) => {
            say!("CPU {cpu} refused to come online: {e}\n");
            hw::exit(hw::EXIT_FAIL)
        }
    }
    // SAFETY: the address space's root is the boot page table, which maps
    // this kernel; this CPU had no address space loaded before.
    if unsafe { switch_mm(&arch(), None, mm()) }.is_err() {
        fatal("the test address space's ASID does not fit the PCID width");
    }
}

#[no_mangle]
extern "C" fn ap_main(cpu: u32) -> ! {
    let cpu = cpu as usize;
    cpu_init(cpu);
    ONLINE.fetch_add(1, Ordering::SeqCst);
    hw::sti();
    loop {
        match COMMAND[cpu].load(Ordering::SeqCst) {
            PROBE => {
                let n = ARG[cpu].load(Ordering::SeqCst) as usize;
                let readable = (0..n).filter(|&i| probe(test_va(i)) == Some(pattern(i))).count();
                RESULT[cpu].store(readable as u64, Ordering::SeqCst);
                COMMAND[cpu].store(IDLE, Ordering::SeqCst);
            }
            SHOOT_BACK => {
                let rounds = ARG[cpu].load(Ordering::SeqCst);
                let boot = CpuSet::single(CpuId::BOOT);
                hw::cli();
                let mut ok = 0;
                for r in 0..rounds {
                    if shootdown(&arch(), &boot, &one_page((r % 8) as usize)).is_ok() {
                        ok += 1;
                    }
                }
                hw::sti();
                RESULT[cpu].store(ok, Ordering::SeqCst);
                COMMAND[cpu].store(IDLE, Ordering::SeqCst);
            }
            offline::LEAVE => {
                offline::leave(cpu);
                COMMAND[cpu].store(IDLE, Ordering::SeqCst);
            }
            offline::SHOOT => {
                let ok = offline::shoot(ARG[cpu].load(Ordering::SeqCst));
                RESULT[cpu].store(ok, Ordering::SeqCst);
                COMMAND[cpu].store(IDLE, Ordering::SeqCst);
            }
            pcid::AP_STEP => pcid::ap_step(cpu),
            generations::AP_STEP => generations::ap_step(cpu),
            shared::OBSERVE => shared::observe(cpu),
            window::AP_ROUND => window::ap_round(cpu),
            c @ (huge::TOUCH | huge::LOOK) => huge::ap_command(cpu, c),
            BUSY => {
                // Busy with interrupts on, until told otherwise.
                RESULT[cpu].fetch_add(1, Ordering::Relaxed);
            }
            c if c >= flow::WRITER => flow::ap_command(cpu, c),
            _ => core::hint::spin_loop(),
        }
    }
}

fn pattern(i: usize) -> u64 {
    0x5151_0000_0000 + i as u64
}

fn one_page(i: usize) -> FlushRequest {
    let mut req = FlushRequest::new();
    // A page-aligned test address: cannot fail.
    let _ = req.add_page(mm().asid(), test_va(i), 33);
    req
}

/// Maps every test page to its frame, with its pattern written.
fn map_all() {
    for i in 0..TEST_PAGES {
        let phys = TEST_PHYS + (i as u64) * 4096;
        // SAFETY: the test frames are identity-mapped RAM set aside for this.
        unsafe { core::ptr::write_volatile(phys as *mut u64, pattern(i)) };
        TEST_PT.0[i].store(phys | PTE_FLAGS, Ordering::SeqCst);
    }
}

fn aps() -> core::ops::Range<usize> {
    1..ONLINE.load(Ordering::SeqCst)
}

/// Runs `cmd` with `arg` on every AP (or one) and waits for them.
fn command(cpus: impl Iterator<Item = usize> + Clone, cmd: u32, arg: u64) {
    for c in cpus.clone() {
        ARG[c].store(arg, Ordering::SeqCst);
        RESULT[c].store(0, Ordering::SeqCst);
        COMMAND[c].store(cmd, Ordering::SeqCst);
    }
    for c in cpus {
        while COMMAND[c].load(Ordering::SeqCst) != IDLE {
            core::hint::spin_loop();
        }
    }
}

fn ipis_taken_by_aps() -> u64 {
    aps().map(|c| IPIS_TAKEN[c].load(Ordering::SeqCst)).sum()
}

fn report(name: &str, ok: bool, detail: core::fmt::Arguments<'_>) -> bool {
    say!(
        "scenario {name}: {} ({detail})\n",
        if ok { "PASS" } else { "FAIL" }
    );
    ok
}

fn cmdline(info: u32) -> &'static [u8] {
    // SAFETY: Multiboot information at `info` (identity-mapped low memory);
    // flag bit 2 says the command-line field holds a C string's address.
    unsafe {
        let flags = core::ptr::read_volatile(info as u64 as *const u32);
        if flags & 4 == 0 {
            return b"";
        }
        let p = core::ptr::read_volatile((info as u64 + 16) as *const u32) as u64 as *const u8;
        let mut len = 0;
        while *p.add(len) != 0 && len < 256 {
            len += 1;
        }
        core::slice::from_raw_parts(p, len)
    }
}

fn has_word(line: &[u8], word: &[u8]) -> bool {
    line.split(|&b| b == b' ').any(|w| w == word)
}

fn start_aps(boot_apic: u32) {
    let Some(list) = acpi::cpus() else {
        fatal("no ACPI MADT");
    };
    // Every processor the MADT lists; the all-but-self shorthand is used
    // only once all of them are online (and never if there are more than
    // this kernel starts).
    CPUS.set_present(list.listed);
    // SAFETY: the trampoline blob is copied to 0x8000 (free low memory,
    // identity-mapped) and its data words patched before each STARTUP.
    unsafe {
        let start = core::ptr::addr_of!(boot::ap_tramp_start) as usize;
        let end = core::ptr::addr_of!(boot::ap_tramp_end) as usize;
        core::ptr::copy_nonoverlapping(start as *const u8, TRAMPOLINE as *mut u8, end - start);
        let patch = |sym: *const u64, value: u64| {
            let at = TRAMPOLINE + (sym as u64 - start as u64);
            core::ptr::write_volatile(at as *mut u64, value);
        };
        patch(
            core::ptr::addr_of!(boot::tramp_cr3),
            core::ptr::addr_of!(boot::pml4) as u64,
        );
        let mut next = 1;
        for &apic_id in &list.ids[..list.count] {
            if apic_id == boot_apic || next >= MAX_CPUS {
                continue;
            }
            let last = next + 1 == list.count.min(MAX_CPUS);
            let skip = last && SKIP_LAST_REGISTRATION.load(Ordering::Relaxed);
            if !skip && CPUS.register(next, apic_id).is_err() {
                fatal("CPU table full");
            }
            let stack = core::ptr::addr_of_mut!(AP_STACKS.0[next]) as u64 + 16384;
            patch(core::ptr::addr_of!(boot::tramp_stack), stack);
            patch(core::ptr::addr_of!(boot::tramp_cpu), next as u64);
            let online = ONLINE.load(Ordering::SeqCst);
            let a = apic();
            a.send_init(apic_id);
            hw::spin(100_000);
            a.send_startup(apic_id, (TRAMPOLINE >> 12) as u8);
            hw::spin(10_000);
            if ONLINE.load(Ordering::SeqCst) == online {
                a.send_startup(apic_id, (TRAMPOLINE >> 12) as u8);
            }
            let mut waited = 0u64;
            while ONLINE.load(Ordering::SeqCst) == online {
                waited += 1;
                if waited > 500_000_000 {
                    fatal("an AP did not come up");
                }
                core::hint::spin_loop();
            }
            next += 1;
        }
    }
}

#[no_mangle]
extern "C" fn kernel_main(info: u32) -> ! {
    let line = cmdline(info);
    // What the CPU supports: `cpu_init` enables from it. (Features::detect
    // would report what is on, and nothing is yet.)
    let f = Supported::detect();
    FEATURES.store(
        u32::from(f.pcid)
            | u32::from(f.invpcid) << 1
            | u32::from(f.x2apic) << 2
            | u32::from(f.pge) << 3
            | u32::from(f.hypervisor) << 4
            | u32::from(x86::vendor_promises_fill_sets_accessed(&x86::vendor_id())) << 5,
        Ordering::Relaxed,
    );
    NEGATIVE.store(has_word(line, b"negative"), Ordering::Relaxed);
    SKIP_LAST_REGISTRATION.store(has_word(line, b"unregistered"), Ordering::Relaxed);
    let storm_only = has_word(line, b"storm-only");
    if has_word(line, b"x2apic") {
        if !f.x2apic {
            fatal("x2APIC requested but the CPU does not report it");
        }
        USE_X2APIC.store(true, Ordering::Relaxed);
    }
    if has_word(line, b"pcid") {
        if !(f.pcid && f.invpcid) {
            fatal("PCID requested but the CPU lacks PCID or INVPCID");
        }
        USE_PCID.store(true, Ordering::Relaxed);
    }
    say!(
        "tlb-batch QEMU test kernel: apic={} pcid={} negative={}\n",
        if USE_X2APIC.load(Ordering::Relaxed) {
            "x2apic"
        } else {
            "xapic"
        },
        USE_PCID.load(Ordering::Relaxed),
        NEGATIVE.load(Ordering::Relaxed)
    );

    // Test pages: PDPT[4] -> TEST_PD -> TEST_PT (4 KiB PTEs).
    // SAFETY: the boot PDPT is identity-mapped; entry 4 (4-5 GiB) is unused.
    unsafe {
        let pdpt = core::ptr::addr_of!(boot::pdpt) as *mut u64;
        core::ptr::write_volatile(pdpt.add(4), TEST_PD.0.as_ptr() as u64 | PTE_FLAGS);
    }
    TEST_PD.0[0].store(TEST_PT.0.as_ptr() as u64 | PTE_FLAGS, Ordering::SeqCst);
    // The test frames, the spaces' roots and the frame pool lie above the
    // kernel image, in RAM nothing else uses.
    if core::ptr::addr_of!(boot::__bss_end) as u64 > TEST_PHYS {
        fatal("the kernel image overlaps the test frames");
    }
    map_all();
    paging::init_pool();
    // SAFETY: the boot PML4 is in the kernel's identity-mapped .bss; its
    // entry 0 was written before paging was enabled and never changes.
    let kernel_entry = unsafe { core::ptr::read_volatile(core::ptr::addr_of!(boot::pml4) as *const u64) };
    reclaim::FLOW.init(kernel_entry);
    teardown::TEARDOWN.init(kernel_entry);

    // SAFETY: written once, before MM_READY is published and before any AP
    // starts; the root is the boot PML4.
    unsafe {
        let root = core::ptr::addr_of!(boot::pml4) as u64;
        let asid = Asid::new(1).unwrap_or(Asid::KERNEL);
        (*core::ptr::addr_of_mut!(MM_STORAGE)).write(MmTlbState::new(asid, root));
    }
    MM_READY.store(true, Ordering::Release);

    hw::mask_legacy_pic();
    hw::calibrate_tsc();
    hw::build_idt();
    // SAFETY: enabling the APIC early lets the boot CPU read its ID below;
    // `cpu_init` enables it again, harmlessly.
    unsafe { apic().enable(SPURIOUS_VECTOR) };
    let boot_apic = apic().id();
    if CPUS.register(0, boot_apic).is_err() {
        fatal("cannot register the boot CPU");
    }
    cpu_init(0);
    hw::sti();
    start_aps(boot_apic);
    let n = ONLINE.load(Ordering::SeqCst);
    say!(
        "{n} CPUs online, {} present: flush IPIs to all others {}\n",
        CPUS.present(),
        if CPUS.online().len() == CPUS.present() && n > 2 {
            "use the all-but-self shorthand"
        } else {
            "name each destination"
        }
    );
    if n < 2 {
        fatal("the scenarios need at least 2 CPUs (-smp)");
    }

    let negative = NEGATIVE.load(Ordering::Relaxed);
    let mut results: heapless::Vec<bool, 32> = heapless::Vec::new();
    if !storm_only {
        let _ = results.extend_from_slice(&[
            basic::scenario_one_page(),
            basic::scenario_batch(32),
            basic::scenario_batch(512),
            basic::scenario_mutual(),
            basic::scenario_busy(),
            reclaim::scenario_reclaim(),
            reclaim::scenario_migrate(),
            // The negative control frees the tables right after the flush,
            // which does not reach the walker.
            teardown::scenario_teardown(negative || has_word(line, b"negative-teardown")),
            mprotect::scenario_mprotect(),
            mapper::scenario_mapper(kernel_entry),
            window::scenario_window(negative || has_word(line, b"negative-window")),
        ]);
        // The scenario set the aarch64 kernel runs too; under `negative`
        // its flush under test reaches CPU 0 only (the other CPUs skip
        // it, as this kernel's negative control has them do), and with
        // `negative-noinval` as well it invalidates nothing at all.
        let flush = if !negative {
            Flush::AllCpus
        } else if has_word(line, b"negative-noinval") {
            Flush::Skipped
        } else {
            Flush::ThisCpuOnly
        };
        match shared::run(flush) {
            Some(outcomes) => {
                for o in &outcomes {
                    say!("{o}\n");
                    let _ = results.push(o.passed());
                }
            }
            None => say!("shared scenarios not run: more CPUs than they coordinate\n"),
        }
        let _ = results.push(pool_flow::scenario_pooled_reclaim());
        let _ = results.push(generations::run(line));
        let _ = results.extend_from_slice(&huge::run(
            kernel_entry,
            negative || has_word(line, b"negative-huge"),
        ));
    }
    let _ = results.push(storm::scenario_storm());
    // The negative controls' flushes are skipped in interrupt handlers
    // only, which this scenario's leaver never takes on its way out: it
    // would pass or fail by chance there.
    if !negative {
        let _ = results.push(offline::scenario_offline());
    }
    say!(
        "frame pool: {} frames in use, {} free frames found written since boot\n",
        paging::in_use(),
        paging::stale_in_free()
    );
    if has_word(line, b"timing") {
        basic::timing(32);
        basic::timing(512);
    }
    let (pcid_passed, pcid_failed) = pcid::run(line);
    let passed = results.iter().filter(|&&r| r).count() + pcid_passed;
    let failed = results.len() + pcid_passed + pcid_failed - passed;
    say!("{passed} passed, {failed} failed\n");
    hw::exit(if failed == 0 { hw::EXIT_PASS } else { hw::EXIT_FAIL })
}
