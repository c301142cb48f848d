//! The x86_64 implementation of [`Arch`]: `invlpg`, `INVPCID` and CR3/CR4
//! flushes, PCID-tagged address spaces, and flush IPIs through the local
//! APIC in xAPIC (MMIO) or x2APIC (MSR) mode.
//!
//! A kernel sets up one [`CpuTable`] and one [`TlbShootdown`] in statics
//! and builds an [`X86_64`] value per CPU (or one shared value: it holds
//! nothing per CPU). Bring-up, in order:
//!
//! 1. the boot CPU [registers](CpuTable::register) every CPU's index and
//!    APIC ID before starting it (a duplicate or reserved ID is refused),
//!    and records how many processors the firmware lists
//!    ([`CpuTable::set_present`]);
//! 2. each CPU, itself, with interrupts off and its IDT routing the flush
//!    vector to a handler that calls [`X86_64::flush_ipi_entry`], calls
//!    [`X86_64::bring_online`]: it flushes its whole TLB and joins the set
//!    of CPUs that shootdowns reach. An unregistered CPU is refused there
//!    ([`Error::UnregisteredCpu`]), and a crate function run on one panics
//!    rather than act as another CPU.
//!
//! Flush IPIs name each destination, except when the targets are every
//! other CPU and every present CPU is online: then one all-but-self IPI
//! reaches exactly them.
//!
//! The instruction wrappers are small `unsafe fn`s, one instruction each;
//! they are public so that a kernel can use the same, documented ones.

use core::arch::asm;
use core::ptr::NonNull;
use core::sync::atomic::{fence, AtomicUsize, Ordering};

use volatile::VolatilePtr;

use crate::arch::cpu_registry::{DirectSlots, HwIdTable, DIRECT_SLOTS};
use crate::arch::{Arch, Asid};
use crate::cpuset::{CpuId, CpuSet};
use crate::percpu::TlbShootdown;
use crate::Error;

/// The four kinds of `INVPCID` invalidation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum InvpcidKind {
    /// One address in one PCID (global entries excepted).
    Address = 0,
    /// Every non-global entry of one PCID.
    SingleContext = 1,
    /// Every entry of every PCID, global ones included.
    AllIncludingGlobal = 2,
    /// Every non-global entry of every PCID.
    AllExcludingGlobal = 3,
}

/// Invalidates the TLB entries for the page containing `va` in the current
/// PCID, and a global entry for it (and paging-structure caches for it).
///
/// # Safety
///
/// Ring 0 only. Invalidating never breaks memory safety by itself; the
/// function is `unsafe` because executing it outside ring 0 faults.
#[inline]
pub unsafe fn invlpg(va: u64) {
    // SAFETY: the caller runs in ring 0; invlpg reads no memory and only
    // drops cached translations.
    unsafe { asm!("invlpg [{}]", in(reg) va, options(nostack, preserves_flags)) };
}

/// Executes `INVPCID` of `kind` for `pcid` (and `va` for
/// [`InvpcidKind::Address`]).
///
/// # Safety
///
/// Ring 0 only, on a CPU whose CPUID reports INVPCID (otherwise #UD);
/// `pcid` below 4096 and `va` canonical (otherwise #GP).
#[inline]
pub unsafe fn invpcid(kind: InvpcidKind, pcid: u16, va: u64) {
    let descriptor: [u64; 2] = [u64::from(pcid), va];
    // SAFETY: the caller guarantees ring 0, INVPCID support and valid
    // operands; the descriptor lives on the stack for the instruction.
    unsafe {
        asm!(
            "invpcid {}, [{}]",
            in(reg) kind as u64,
            in(reg) descriptor.as_ptr(),
            options(nostack, preserves_flags, readonly)
        )
    };
}

/// Reads CR3 (page-table root and PCID).
///
/// # Safety
///
/// Ring 0 only.
#[inline]
pub unsafe fn read_cr3() -> u64 {
    let value: u64;
    // SAFETY: reading CR3 in ring 0 has no side effect.
    unsafe { asm!("mov {}, cr3", out(reg) value, options(nomem, nostack, preserves_flags)) };
    value
}

/// Writes CR3: switches to the page table at `value`'s root with its PCID;
/// without bit 63 set, flushes that PCID's non-global entries.
///
/// # Safety
///
/// Ring 0 only; `value` names a valid top-level page table that maps the
/// running code, its stack and everything the caller touches next.
#[inline]
pub unsafe fn write_cr3(value: u64) {
    // SAFETY: the caller guarantees the new root maps what runs next.
    unsafe { asm!("mov cr3, {}", in(reg) value, options(nostack, preserves_flags)) };
}

/// Reads CR4.
///
/// # Safety
///
/// Ring 0 only.
#[inline]
pub unsafe fn read_cr4() -> u64 {
    let value: u64;
    // SAFETY: reading CR4 in ring 0 has no side effect.
    unsafe { asm!("mov {}, cr4", out(reg) value, options(nomem, nostack, preserves_flags)) };
    value
}

/// Writes CR4.
///
/// # Safety
///
/// Ring 0 only; `value` must keep the paging mode the kernel runs in (PAE,
/// and PCIDE only with CR3's PCID at zero when turning it on).
#[inline]
pub unsafe fn write_cr4(value: u64) {
    // SAFETY: the caller guarantees a consistent paging configuration.
    unsafe { asm!("mov cr4, {}", in(reg) value, options(nostack, preserves_flags)) };
}

/// Reads a model-specific register.
///
/// # Safety
///
/// Ring 0 only; `msr` must exist on this CPU (otherwise #GP).
#[inline]
pub unsafe fn rdmsr(msr: u32) -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: the caller guarantees ring 0 and an existing MSR.
    unsafe {
        asm!("rdmsr", in("ecx") msr, out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags))
    };
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Writes a model-specific register.
///
/// # Safety
///
/// Ring 0 only; `msr` must exist and accept `value`, and writing it must
/// not break what the kernel relies on.
#[inline]
pub unsafe fn wrmsr(msr: u32, value: u64) {
    // SAFETY: the caller guarantees ring 0 and a meaningful write.
    unsafe {
        asm!(
            "wrmsr",
            in("ecx") msr,
            in("eax") value as u32,
            in("edx") (value >> 32) as u32,
            options(nostack, preserves_flags)
        )
    };
}

/// The spin-wait hint.
#[inline]
pub fn pause() {
    core::hint::spin_loop();
}

/// RFLAGS.IF: maskable interrupts are enabled.
const RFLAGS_IF: u64 = 1 << 9;

/// Runs `f` with maskable interrupts disabled, then restores the interrupt
/// flag to what it was (enabled again only if it was enabled before).
///
/// # Safety
///
/// Ring 0 only (`cli` faults elsewhere); `f` must not rely on taking
/// interrupts.
#[inline]
unsafe fn without_interrupts<R>(f: impl FnOnce() -> R) -> R {
    let rflags: u64;
    // SAFETY: reading RFLAGS through the stack has no other effect; no
    // `nomem`, so the compiler keeps memory accesses on their side of it.
    unsafe { asm!("pushfq", "pop {}", out(reg) rflags, options(preserves_flags)) };
    // SAFETY: ring 0 (the caller's guarantee); `cli` only masks interrupts.
    unsafe { asm!("cli", options(nostack)) };
    let result = f();
    if rflags & RFLAGS_IF != 0 {
        // SAFETY: ring 0; interrupts were enabled on entry, so enabling
        // them again restores the caller's state.
        unsafe { asm!("sti", options(nostack)) };
    }
    result
}

/// `CPUID` leaf `leaf`, subleaf `subleaf`: (eax, ebx, ecx, edx).
#[inline]
pub fn cpuid(leaf: u32, subleaf: u32) -> (u32, u32, u32, u32) {
    // SAFETY: CPUID exists on every x86_64 CPU and only reads identification
    // registers. Rust 1.94 made `__cpuid_count` safe; the minimum supported
    // Rust needs the `unsafe` block, which newer compilers call unused.
    #[allow(unused_unsafe)]
    let r = unsafe { core::arch::x86_64::__cpuid_count(leaf, subleaf) };
    (r.eax, r.ebx, r.ecx, r.edx)
}

/// The TLB-related features this CPU reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    /// Process-context identifiers (CR4.PCIDE).
    pub pcid: bool,
    /// The `INVPCID` instruction.
    pub invpcid: bool,
    /// x2APIC mode.
    pub x2apic: bool,
    /// Global pages (CR4.PGE).
    pub pge: bool,
    /// 5-level paging is on (CR4.LA57): addresses have 57 canonical bits
    /// instead of 48. [`detect`](Self::detect) leaves it false; a kernel
    /// that enables LA57 sets it.
    pub la57: bool,
    /// The kernel promises that every kernel mapping has its global bit set
    /// and that CR4.PGE is on. With PCIDs, flushing a kernel page is then
    /// one `invlpg` (it drops a global entry whatever PCID is loaded);
    /// without the promise a kernel page may sit, non-global, in every
    /// PCID's entries, and each kernel-page flush also drops every
    /// non-global entry of every PCID (`INVPCID` all-contexts), which is
    /// correct but costs every address space its TLB. [`detect`](Self::detect)
    /// leaves it false, the safe choice.
    pub kernel_global: bool,
}

impl Features {
    /// Reads CPUID.
    pub fn detect() -> Features {
        let (_, _, ecx1, edx1) = cpuid(1, 0);
        let max = cpuid(0, 0).0;
        let ebx7 = if max >= 7 { cpuid(7, 0).1 } else { 0 };
        Features {
            pcid: ecx1 & (1 << 17) != 0,
            invpcid: ebx7 & (1 << 10) != 0,
            x2apic: ecx1 & (1 << 21) != 0,
            pge: edx1 & (1 << 13) != 0,
            la57: false,
            kernel_global: false,
        }
    }
}

/// CR4 bit: global pages.
pub const CR4_PGE: u64 = 1 << 7;
/// CR4 bit: PCIDs.
pub const CR4_PCIDE: u64 = 1 << 17;
/// CR3 bit: do not flush the new PCID's entries.
pub const CR3_NOFLUSH: u64 = 1 << 63;
/// The IA32_APIC_BASE MSR.
pub const IA32_APIC_BASE: u32 = 0x1b;

const XAPIC_ID: usize = 0x20;
const XAPIC_EOI: usize = 0xb0;
const XAPIC_SVR: usize = 0xf0;
const XAPIC_ICR_LOW: usize = 0x300;
const XAPIC_ICR_HIGH: usize = 0x310;
const X2APIC_ID: u32 = 0x802;
const X2APIC_EOI: u32 = 0x80b;
const X2APIC_SVR: u32 = 0x80f;
const X2APIC_ICR: u32 = 0x830;
const ICR_DELIVERY_PENDING: u32 = 1 << 12;
const ICR_LEVEL_ASSERT: u32 = 1 << 14;
const ICR_LEVEL_TRIGGER: u32 = 1 << 15;
const ICR_ALL_BUT_SELF: u32 = 0b11 << 18;
const DELIVERY_INIT: u32 = 0b101 << 8;
const DELIVERY_STARTUP: u32 = 0b110 << 8;

/// How the local APIC is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApicMode {
    /// Memory-mapped registers at this virtual address (mapped uncached).
    XApic {
        /// Virtual address of the register page.
        base: usize,
    },
    /// Registers as MSRs.
    X2Apic,
}

/// The local APIC of the running CPU (every CPU's APIC answers at the same
/// address or MSRs, so one value serves all CPUs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalApic {
    mode: ApicMode,
}

impl LocalApic {
    /// An xAPIC whose register page is mapped (uncached, writable) at
    /// virtual address `base`.
    ///
    /// # Safety
    ///
    /// `base` must map the local APIC's 4 KiB register page for as long as
    /// the value is used, and nothing else may treat that page as memory;
    /// the value is used in ring 0 only.
    pub const unsafe fn xapic(base: usize) -> Self {
        LocalApic {
            mode: ApicMode::XApic { base },
        }
    }

    /// The x2APIC (its registers are MSRs).
    ///
    /// # Safety
    ///
    /// The CPUs that use the value run in x2APIC mode (see
    /// [`enable`](Self::enable)), in ring 0.
    pub const unsafe fn x2apic() -> Self {
        LocalApic {
            mode: ApicMode::X2Apic,
        }
    }

    /// The mode.
    pub fn mode(&self) -> ApicMode {
        self.mode
    }

    fn reg(&self, base: usize, offset: usize) -> VolatilePtr<'static, u32> {
        // `base` is non-zero for a mapped register page (guaranteed by the
        // `xapic` constructor's contract); a zero base would be a contract
        // breach, and dangling is the well-defined stand-in.
        let ptr = NonNull::new((base + offset) as *mut u32).unwrap_or(NonNull::dangling());
        // SAFETY: `xapic`'s caller guarantees the register page is mapped
        // for the life of the value and used only as MMIO.
        unsafe { VolatilePtr::new(ptr) }
    }

    /// This CPU's APIC ID.
    pub fn id(&self) -> u32 {
        match self.mode {
            ApicMode::XApic { base } => self.reg(base, XAPIC_ID).read() >> 24,
            // SAFETY: the `x2apic` constructor's caller guarantees x2APIC
            // mode, in which this MSR exists.
            ApicMode::X2Apic => unsafe { rdmsr(X2APIC_ID) as u32 },
        }
    }

    /// Turns the APIC on in its mode (x2APIC: sets the enable bits in
    /// IA32_APIC_BASE first) with `spurious_vector` for spurious
    /// interrupts.
    ///
    /// # Safety
    ///
    /// Ring 0; for x2APIC, the CPU supports it. Interrupts the APIC then
    /// delivers need handlers.
    pub unsafe fn enable(&self, spurious_vector: u8) {
        let svr = 0x100 | u32::from(spurious_vector);
        match self.mode {
            ApicMode::XApic { base } => self.reg(base, XAPIC_SVR).write(svr),
            ApicMode::X2Apic => {
                // SAFETY: ring 0 and x2APIC support are the caller's
                // guarantees; bits 11 (enable) and 10 (x2APIC) switch modes.
                unsafe {
                    let apic_base = rdmsr(IA32_APIC_BASE);
                    wrmsr(IA32_APIC_BASE, apic_base | (1 << 11) | (1 << 10));
                    wrmsr(X2APIC_SVR, u64::from(svr));
                }
            }
        }
    }

    /// Signals end of interrupt.
    pub fn eoi(&self) {
        match self.mode {
            ApicMode::XApic { base } => self.reg(base, XAPIC_EOI).write(0),
            // SAFETY: x2APIC mode (the constructor's contract); writing 0
            // to the EOI MSR is the defined EOI.
            ApicMode::X2Apic => unsafe { wrmsr(X2APIC_EOI, 0) },
        }
    }

    /// Writes the interrupt command register: `low` (vector, delivery mode,
    /// shorthand) to physical destination `dest`.
    fn command(&self, dest: u32, low: u32) {
        match self.mode {
            ApicMode::XApic { base } => {
                // The xAPIC's ICR is two registers: the high half holds the
                // destination and writing the low half sends. An interrupt
                // taken between the two writes whose handler sends an IPI
                // of its own would leave its destination in the high half,
                // and our write of the low half would send our vector to
                // the handler's target. So the pair (and the wait for the
                // APIC to accept it) runs with interrupts masked, and the
                // caller's interrupt flag is restored afterwards.
                let send = || {
                    self.reg(base, XAPIC_ICR_HIGH).write(dest << 24);
                    self.reg(base, XAPIC_ICR_LOW).write(low);
                    while self.reg(base, XAPIC_ICR_LOW).read() & ICR_DELIVERY_PENDING != 0 {
                        pause();
                    }
                };
                // SAFETY: ring 0 (every constructor's contract); `send`
                // takes no interrupts.
                unsafe { without_interrupts(send) };
            }
            ApicMode::X2Apic => {
                // WRMSR to the x2APIC ICR is not serializing, and unlike
                // an xAPIC MMIO write it is not ordered after earlier
                // stores: the interrupt could reach the target before the
                // request we published (inbox entry, `ipi_pending` flag)
                // is visible to it. The target would find an empty inbox
                // and return, its pending flag would stay set with no IPI
                // in flight, later initiators would skip sending to it,
                // and the waiting initiator would spin forever. MFENCE
                // drains our stores; LFENCE keeps the WRMSR from
                // executing before the MFENCE completes (the sequence the
                // SDM gives for x2APIC ICR writes). A Rust fence alone may
                // compile to a locked instruction, which does not order
                // the WRMSR.
                // SAFETY: MFENCE and LFENCE exist on every x86_64 CPU and
                // only order memory accesses; no `nomem`, so the compiler
                // keeps earlier stores before them.
                unsafe { asm!("mfence", "lfence", options(nostack, preserves_flags)) };
                // SAFETY: x2APIC mode (the constructor's contract); a write
                // of the ICR MSR sends one IPI, destination in bits 63:32.
                unsafe { wrmsr(X2APIC_ICR, (u64::from(dest) << 32) | u64::from(low)) };
            }
        }
    }

    /// Sends fixed interrupt `vector` to the CPU whose APIC ID is `dest`.
    pub fn send_ipi(&self, dest: u32, vector: u8) {
        self.command(dest, u32::from(vector) | ICR_LEVEL_ASSERT);
    }

    /// Sends fixed interrupt `vector` to every CPU but this one (the
    /// all-excluding-self shorthand: one ICR write).
    pub fn send_ipi_all_but_self(&self, vector: u8) {
        self.command(0, u32::from(vector) | ICR_LEVEL_ASSERT | ICR_ALL_BUT_SELF);
    }

    /// Sends INIT to `dest` (application-processor bring-up).
    pub fn send_init(&self, dest: u32) {
        self.command(dest, DELIVERY_INIT | ICR_LEVEL_ASSERT | ICR_LEVEL_TRIGGER);
    }

    /// Sends STARTUP to `dest`: it starts in real mode at `page << 12`.
    pub fn send_startup(&self, dest: u32, page: u8) {
        self.command(dest, DELIVERY_STARTUP | ICR_LEVEL_ASSERT | u32::from(page));
    }
}

/// APIC IDs of the machine's CPUs and which of them are online: a `static`
/// the kernel fills during bring-up.
///
/// A CPU is [registered](Self::register) (index and APIC ID) by the CPU that
/// starts it, and joins the online set only through
/// [`X86_64::bring_online`], run on the CPU itself, which flushes its TLB
/// first: nothing else can mark a CPU online.
pub struct CpuTable {
    table: HwIdTable<ApicIds>,
    present: AtomicUsize,
}

/// APIC IDs below [`DIRECT_SLOTS`] (every xAPIC ID, and x2APIC IDs on most
/// machines) are looked up with one load; larger ones (x2APIC on very
/// large or sparse machines) by a scan of the registered CPUs. The x2APIC
/// broadcast destination, `0xFFFF_FFFF`, cannot be registered.
struct ApicIds;

impl DirectSlots for ApicIds {
    fn slot(apic_id: u32) -> Option<usize> {
        let id = apic_id as usize;
        (id < DIRECT_SLOTS).then_some(id)
    }
}

impl Default for CpuTable {
    fn default() -> Self {
        CpuTable::new()
    }
}

impl CpuTable {
    /// An empty table, usable in a `static`.
    pub const fn new() -> Self {
        CpuTable {
            table: HwIdTable::new(),
            present: AtomicUsize::new(0),
        }
    }

    /// Records that CPU `cpu` has APIC ID `apic_id` (not yet online).
    /// Registering the same pair again is harmless. Register CPUs from one
    /// CPU at a time (bring-up is serial on the boot CPU).
    ///
    /// Errors, with nothing recorded: [`Error::CpuOutOfRange`];
    /// [`Error::InvalidHardwareId`] for `0xFFFF_FFFF` (the broadcast
    /// destination) or an APIC ID another index already has (two indices
    /// for one CPU would let one of them be skipped as "self" while the
    /// other is flushed); [`Error::CpuAlreadyRegistered`] when `cpu` has
    /// another APIC ID.
    pub fn register(&self, cpu: usize, apic_id: u32) -> Result<CpuId, Error> {
        self.table.register(cpu, apic_id)
    }

    /// Records how many CPUs the machine has: every processor the firmware
    /// lists as usable (ACPI MADT), started or not. Only when that many
    /// CPUs are online does [`X86_64`] send a flush IPI with the APIC's
    /// all-but-self shorthand, which reaches every processor of the
    /// machine; until it is set, every IPI names its destination.
    pub fn set_present(&self, cpus: usize) {
        self.present.store(cpus, Ordering::SeqCst);
    }

    /// The count given to [`set_present`](Self::set_present) (0 if never).
    pub fn present(&self) -> usize {
        self.present.load(Ordering::SeqCst)
    }

    /// The online CPUs.
    pub fn online(&self) -> CpuSet {
        self.table.online()
    }

    /// The APIC ID of `cpu`, if registered.
    pub fn apic_id(&self, cpu: CpuId) -> Option<u32> {
        self.table.id(cpu)
    }

    /// The CPU whose APIC ID is `apic_id`, if registered.
    pub fn cpu_of(&self, apic_id: u32) -> Option<CpuId> {
        self.table.cpu_of(apic_id)
    }
}

/// Whether one all-but-self IPI reaches exactly `targets`: they are every
/// online CPU but `me`, and every CPU the machine has (`present`) is
/// online, so no offline, unregistered or not-yet-started processor takes
/// an interrupt it has no business with. A single target gets a directed
/// IPI either way.
fn shorthand_reaches_exactly(targets: &CpuSet, online: &CpuSet, me: CpuId, present: usize) -> bool {
    targets.len() > 1
        && online.len() == present
        && online.contains(me)
        && *targets == online.difference(&CpuSet::single(me))
}

/// How [`X86_64::flush_local_page`](Arch::flush_local_page) drops one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PageFlush {
    /// `invlpg`: the loaded PCID's entry and any global entry.
    Invlpg,
    /// `INVPCID` individual-address in a PCID that is not loaded.
    InvpcidAddress(u16),
    /// A kernel page that may be cached non-global under any PCID:
    /// `invlpg` for a global entry, then `INVPCID` all-contexts (non-global)
    /// for the copies other PCIDs may hold.
    EveryPcid,
}

/// Chooses the invalidation for a page of `asid` on a CPU whose loaded
/// PCID is `current_pcid`.
fn page_flush(asid: Asid, pcid_on: bool, kernel_global: bool, current_pcid: u16) -> PageFlush {
    if !pcid_on {
        // One untagged context: `invlpg` reaches every entry for the page.
        return PageFlush::Invlpg;
    }
    if asid.is_kernel() {
        // `invlpg` reaches only the loaded PCID's non-global entry; a
        // non-global kernel entry cached while another PCID was loaded
        // survives it and is used again after a no-flush CR3 switch.
        return if kernel_global {
            PageFlush::Invlpg
        } else {
            PageFlush::EveryPcid
        };
    }
    match X86_64::pcid_of(asid) {
        Some(pcid) if pcid == current_pcid => PageFlush::Invlpg,
        Some(pcid) => PageFlush::InvpcidAddress(pcid),
        // Wider than a PCID (refused by every entry point; only a direct
        // call gets here): drop the page wherever it may be.
        None => PageFlush::EveryPcid,
    }
}

/// The x86_64 [`Arch`]: the running CPU is found by its APIC ID in a
/// [`CpuTable`]; flushes use `invlpg`, `INVPCID` or CR3/CR4; flush IPIs go
/// through the local APIC on `vector`.
///
/// PCIDs are used only when the CPU has both PCID and INVPCID (flushing a
/// page of an address space that is not loaded needs INVPCID) and CR4.PCIDE
/// is set. An ASID's PCID is its value: [`Arch::asid_bits`] is
/// [`PCID_BITS`], so every entry point refuses a wider ASID
/// ([`Error::AsidOutOfRange`]) and two ASIDs the crate accepts never share
/// a PCID; PCID 0 is the kernel's. A kernel keeps at most 4095 live user
/// address spaces, each with its own ASID, and before it gives a retired
/// address space's ASID to a new one it flushes that ASID everywhere
/// ([`flush_tlb_mm`](crate::flush_tlb_mm) on the old address space, after
/// its last mapping is gone): with PCIDs a CPU keeps the old entries
/// tagged with it, which the new address space would otherwise use.
/// Addresses are checked to be canonical (48 bits, or 57 with
/// [`Features::la57`]) before any reaches `invlpg` or `INVPCID`.
///
/// # Panics
///
/// [`current_cpu`](Arch::current_cpu) (and so every crate function run with
/// this `Arch`) panics on a CPU whose APIC ID is not registered in the
/// [`CpuTable`]: that breaks [`new`](Self::new)'s contract, and any answer
/// would name another CPU, whose flushes this one would then acknowledge
/// without doing them. [`bring_online`](Self::bring_online) reports the
/// same mistake as [`Error::UnregisteredCpu`] when the CPU comes up, before
/// anything can use it.
pub struct X86_64 {
    apic: LocalApic,
    vector: u8,
    cpus: &'static CpuTable,
    state: &'static TlbShootdown,
    pcid: bool,
    invpcid: bool,
    pge: bool,
    la57: bool,
    kernel_global: bool,
}

/// The width of a PCID: ASIDs 1 to 4095 are user address spaces, PCID 0 is
/// the kernel's.
pub const PCID_BITS: u32 = 12;

impl X86_64 {
    /// The `Arch` for this machine.
    ///
    /// # Safety
    ///
    /// Every CPU that runs crate code or may hold TLB entries is registered
    /// in `cpus`, and calls [`bring_online`](Self::bring_online) only once
    /// its IDT routes `vector` to a handler that calls
    /// [`flush_ipi_entry`](Self::flush_ipi_entry); `apic` is valid on every
    /// CPU; the value is used in ring 0 only. When `features` says PCID and
    /// INVPCID, CR4.PCIDE is set on every CPU and CR3 carries the loaded
    /// ASID's PCID. `features` is true of the CPUs (in particular
    /// [`Features::kernel_global`] only when every kernel mapping is global
    /// and CR4.PGE is on).
    pub const unsafe fn new(
        apic: LocalApic,
        vector: u8,
        cpus: &'static CpuTable,
        state: &'static TlbShootdown,
        features: Features,
    ) -> Self {
        X86_64 {
            apic,
            vector,
            cpus,
            state,
            pcid: features.pcid && features.invpcid,
            invpcid: features.invpcid,
            pge: features.pge,
            la57: features.la57,
            kernel_global: features.kernel_global && features.pge,
        }
    }

    /// Brings the running CPU into the online set, the set that shootdowns
    /// reach: call it once on each CPU as it comes up (and again when it
    /// comes back after going offline), with interrupts disabled, after it
    /// was [registered](CpuTable::register) and its IDT routes the flush
    /// vector. This is the only way a CPU joins the online set.
    ///
    /// A CPU outside the online set gets no flush IPIs, so it may hold
    /// stale entries of any kind (global kernel ones included, and with
    /// PCIDs, entries of any address space). It flushes everything
    /// ([`prepare_cpu_online`](crate::prepare_cpu_online)) before joining,
    /// as [`Arch`]'s contract requires, and once more right after: the
    /// processor may cache translations speculatively at any time, so an
    /// entry cached between the first flush and the join, for a page whose
    /// shootdown read the online set just before the join, would otherwise
    /// escape both that shootdown and this flush. After the second flush
    /// every shootdown either reaches this CPU or cleared its entries
    /// before the flush.
    ///
    /// Errors: [`Error::UnregisteredCpu`] when this CPU's APIC ID is not in
    /// the table; nothing changes, and the CPU must not run crate code.
    pub fn bring_online(&self) -> Result<CpuId, Error> {
        let apic_id = self.apic.id();
        let cpu = self
            .cpus
            .cpu_of(apic_id)
            .ok_or(Error::UnregisteredCpu { hw_id: apic_id })?;
        crate::prepare_cpu_online(self);
        self.cpus.table.join(cpu);
        // The join is visible (SeqCst) before the second flush starts.
        fence(Ordering::SeqCst);
        self.flush_local_all(true);
        self.state.count(crate::stats::Counter::LocalFullFlushes, 1);
        Ok(cpu)
    }

    /// The flush-IPI entry point: call it from the interrupt handler of the
    /// vector given to [`new`](Self::new), on the interrupted CPU, with
    /// interrupts still disabled. It carries out every request waiting for
    /// this CPU ([`handle_flush_ipi`](crate::handle_flush_ipi)) and then
    /// signals end of interrupt. Returns the number of requests served
    /// (zero is normal: a waiting initiator may have served them).
    pub fn flush_ipi_entry(&self) -> usize {
        let served = crate::shootdown::handle_flush_ipi(self);
        self.apic.eoi();
        served
    }

    /// The local APIC.
    pub fn apic(&self) -> &LocalApic {
        &self.apic
    }

    /// Whether PCIDs are in use.
    pub fn uses_pcid(&self) -> bool {
        self.pcid
    }

    /// The PCID of an ASID: its value, so no two ASIDs share one; the
    /// kernel's ASID has PCID 0. `None` for an ASID wider than
    /// [`PCID_BITS`], which every entry point of the crate refuses
    /// ([`Error::AsidOutOfRange`]): the `Arch` methods, reachable directly,
    /// then act on every PCID rather than on another address space's.
    pub fn pcid_of(asid: Asid) -> Option<u16> {
        if asid.is_kernel() {
            Some(0)
        } else {
            let value = asid.value();
            (u32::from(value) < (1 << PCID_BITS)).then_some(value)
        }
    }

    fn current_pcid(&self) -> u16 {
        // SAFETY: ring 0 (constructor contract).
        (unsafe { read_cr3() } & 0xfff) as u16
    }
}

/// The answer to a CPU that was never registered: there is no right CPU
/// index to give, and a wrong one corrupts the shootdown protocol.
///
/// The panic stands behind the invariant of [`X86_64::new`]'s `# Safety`
/// (every CPU that runs crate code is registered), documented under
/// `# Panics` on [`X86_64`]; a kernel that keeps the contract never gets
/// here, and [`X86_64::bring_online`] reports the breach as
/// [`Error::UnregisteredCpu`] before the CPU can run any crate code.
#[cold]
#[inline(never)]
fn unregistered(apic_id: u32) -> ! {
    panic!(
        "tlb-batch: CPU with APIC ID {apic_id:#x} runs crate code without being registered \
         in the CpuTable (X86_64::new's contract; CpuTable::register it before it starts)"
    )
}

// SAFETY: the constructor's contract registers every CPU that may cache
// translations and routes the vector to the crate's handler; the flushes
// below complete before returning (invlpg/INVPCID/CR3/CR4 writes are
// serializing for the TLB); PCID use is enabled only with INVPCID, so an
// inactive PCID's page can be flushed; the constants hold on x86 (a write
// through a clean entry re-walks to set the dirty bit and faults if the PTE
// is gone; a cleared accessed bit needs no flush to be set again later;
// no translation is cached before the processor has set the accessed bit
// of every paging-structure entry it used, SDM vol. 3 4.10.2.3).
unsafe impl Arch for X86_64 {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;
    const FILL_SETS_ACCESSED: bool = true;

    fn current_cpu(&self) -> CpuId {
        let apic_id = self.apic.id();
        match self.cpus.cpu_of(apic_id) {
            Some(cpu) => cpu,
            None => unregistered(apic_id),
        }
    }

    fn online_cpus(&self) -> CpuSet {
        self.cpus.online()
    }

    fn shootdown_state(&self) -> &TlbShootdown {
        self.state
    }

    fn tagged_tlb(&self) -> bool {
        self.pcid
    }

    fn va_bits(&self) -> u32 {
        if self.la57 {
            57
        } else {
            48
        }
    }

    fn asid_bits(&self) -> u32 {
        // The PCID width whether or not PCIDs are on, so that a kernel's
        // ASIDs stay valid when it turns them on.
        PCID_BITS
    }

    fn flush_local_page(&self, asid: Asid, va: u64) {
        let current = if self.pcid { self.current_pcid() } else { 0 };
        match page_flush(asid, self.pcid, self.kernel_global, current) {
            // SAFETY: ring 0 (constructor contract).
            PageFlush::Invlpg => unsafe { invlpg(va) },
            // SAFETY: ring 0, INVPCID present (PCIDs are used only then),
            // pcid < 4096, and `va` is the canonical address given to us.
            PageFlush::InvpcidAddress(pcid) => unsafe { invpcid(InvpcidKind::Address, pcid, va) },
            // SAFETY: as above; the all-contexts kind ignores its operands.
            PageFlush::EveryPcid => unsafe {
                invlpg(va);
                invpcid(InvpcidKind::AllExcludingGlobal, 0, 0);
            },
        }
    }

    fn flush_local_asid(&self, asid: Asid) {
        if self.pcid {
            match Self::pcid_of(asid) {
                // SAFETY: ring 0 and INVPCID present (PCIDs are used only
                // then); the PCID fits 12 bits.
                Some(pcid) => unsafe { invpcid(InvpcidKind::SingleContext, pcid, 0) },
                // An ASID wider than a PCID (see `pcid_of`): every PCID.
                // SAFETY: as above; this kind ignores its operands.
                None => unsafe { invpcid(InvpcidKind::AllExcludingGlobal, 0, 0) },
            }
        } else {
            // Without PCIDs only the loaded address space has entries;
            // reloading CR3 drops every non-global one.
            // SAFETY: ring 0; the same root is written back.
            unsafe { write_cr3(read_cr3()) };
        }
    }

    fn flush_local_all(&self, include_global: bool) {
        if self.invpcid {
            let kind = if include_global {
                InvpcidKind::AllIncludingGlobal
            } else {
                InvpcidKind::AllExcludingGlobal
            };
            // SAFETY: ring 0 and INVPCID present.
            unsafe { invpcid(kind, 0, 0) };
        } else if include_global && self.pge {
            // Toggling CR4.PGE flushes everything, global entries included.
            // SAFETY: ring 0; CR4 is restored to its value.
            unsafe {
                let cr4 = read_cr4();
                write_cr4(cr4 ^ CR4_PGE);
                write_cr4(cr4);
            }
        } else {
            // SAFETY: ring 0; the same root is written back (without PCIDs
            // this flushes all non-global entries; without PGE there are no
            // global ones).
            unsafe { write_cr3(read_cr3()) };
        }
    }

    fn send_flush_ipi(&self, targets: &CpuSet) {
        let me = self.current_cpu();
        if shorthand_reaches_exactly(targets, &self.cpus.online(), me, self.cpus.present()) {
            self.apic.send_ipi_all_but_self(self.vector);
            return;
        }
        for cpu in targets {
            if let Some(apic_id) = self.cpus.apic_id(cpu) {
                self.apic.send_ipi(apic_id, self.vector);
            }
        }
    }

    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        let value = match Self::pcid_of(asid) {
            _ if !self.pcid => root,
            // Entries of a user PCID were kept exact by shootdowns while it
            // was not loaded (INVPCID), so no flush is needed.
            Some(pcid) if pcid != 0 => root | u64::from(pcid) | CR3_NOFLUSH,
            // The kernel's address space, and an ASID wider than a PCID
            // (which `switch_mm` refuses; only a direct call gets here):
            // PCID 0, with its non-global entries dropped at the load, so
            // it never reuses what another address space left under it.
            _ => root,
        };
        // SAFETY: the caller guarantees `root` maps the running code.
        unsafe { write_cr3(value) };
    }

    fn relax(&self) {
        pause();
    }
}

#[cfg(test)]
mod tests {
    //! The decisions of the x86_64 `Arch` that run without ring 0: CPU
    //! registration, when the all-but-self shorthand is allowed, and which
    //! instruction drops a page. The instructions themselves run in the
    //! QEMU and Bochs test kernels (`qemu-test/`).
    use super::*;
    use crate::cpuset::MAX_CPUS;

    fn cpu(i: usize) -> CpuId {
        CpuId::new(i).unwrap()
    }

    fn set(cpus: &[usize]) -> CpuSet {
        cpus.iter().map(|&i| cpu(i)).collect()
    }

    #[test]
    fn registration_refuses_what_would_confuse_two_cpus() {
        let t = CpuTable::new();
        assert_eq!(t.register(0, 7), Ok(cpu(0)));
        // Same pair again: harmless.
        assert_eq!(t.register(0, 7), Ok(cpu(0)));
        // One APIC ID for two indices: one of them would be skipped as
        // "self" while the other is the one flushed.
        assert_eq!(t.register(1, 7), Err(Error::InvalidHardwareId { hw_id: 7 }));
        // An index that already has another APIC ID.
        assert_eq!(t.register(0, 8), Err(Error::CpuAlreadyRegistered { cpu: 0 }));
        // The broadcast destination is no CPU's.
        assert_eq!(
            t.register(2, u32::MAX),
            Err(Error::InvalidHardwareId { hw_id: u32::MAX })
        );
        assert_eq!(
            t.register(MAX_CPUS, 9),
            Err(Error::CpuOutOfRange {
                cpu: MAX_CPUS,
                limit: MAX_CPUS
            })
        );
        // Nothing of the refused calls was recorded.
        assert_eq!(t.apic_id(cpu(0)), Some(7));
        assert_eq!(t.apic_id(cpu(1)), None);
        assert_eq!(t.apic_id(cpu(2)), None);
        assert_eq!(t.cpu_of(8), None);
        assert_eq!(t.cpu_of(u32::MAX), None);
        assert_eq!(t.register(1, 8), Ok(cpu(1)));
        assert_eq!(t.cpu_of(8), Some(cpu(1)));
        // IDs past the direct table (large x2APIC IDs) are found by a scan,
        // with the same refusals; IDs next to them stay unknown.
        assert_eq!(t.register(3, 0x1_0000), Ok(cpu(3)));
        assert_eq!(t.cpu_of(0x1_0000), Some(cpu(3)));
        assert_eq!(t.cpu_of(0x1_0001), None);
        assert_eq!(
            t.register(4, 0x1_0000),
            Err(Error::InvalidHardwareId { hw_id: 0x1_0000 })
        );
        assert_eq!(t.register(4, 255), Ok(cpu(4)));
        assert_eq!(t.cpu_of(255), Some(cpu(4)));
        assert_eq!(t.cpu_of(256), None);
        assert_eq!(t.apic_id(cpu(4)), Some(255));
        // Registration alone puts no CPU online.
        assert!(t.online().is_empty());
        // The present count starts unknown (no shorthand) and is what the
        // kernel says.
        assert_eq!(t.present(), 0);
        t.set_present(4);
        assert_eq!(t.present(), 4);
    }

    #[test]
    fn the_shorthand_is_used_only_when_it_reaches_exactly_the_targets() {
        let online = set(&[0, 1, 2, 3]);
        let others = set(&[1, 2, 3]);
        // Every present CPU online, targets all the others: one IPI.
        assert!(shorthand_reaches_exactly(&others, &online, cpu(0), 4));
        // Present count never given (0), or a present CPU offline or never
        // started: the shorthand would interrupt it.
        assert!(!shorthand_reaches_exactly(&others, &online, cpu(0), 0));
        assert!(!shorthand_reaches_exactly(&others, &online, cpu(0), 5));
        let three = set(&[0, 1, 2]);
        assert!(!shorthand_reaches_exactly(&set(&[1, 2]), &three, cpu(0), 4));
        // Targets short of all the others.
        assert!(!shorthand_reaches_exactly(&set(&[1, 2]), &online, cpu(0), 4));
        // A sender outside the online set (bringing itself up).
        assert!(!shorthand_reaches_exactly(
            &set(&[1, 2, 3]),
            &set(&[1, 2, 3]),
            cpu(0),
            3
        ));
        // One target: a directed IPI costs the same.
        assert!(!shorthand_reaches_exactly(&set(&[1]), &set(&[0, 1]), cpu(0), 2));
    }

    #[test]
    fn a_page_flush_reaches_every_pcid_that_may_hold_the_page() {
        let user = Asid::new(5).unwrap();
        // Without PCIDs: one context, `invlpg` whatever the ASID.
        assert_eq!(page_flush(user, false, false, 0), PageFlush::Invlpg);
        assert_eq!(page_flush(Asid::KERNEL, false, false, 0), PageFlush::Invlpg);
        // A user page of the loaded PCID, or of another one.
        assert_eq!(page_flush(user, true, false, 5), PageFlush::Invlpg);
        assert_eq!(page_flush(user, true, true, 9), PageFlush::InvpcidAddress(5));
        // A kernel page: global entries are dropped by `invlpg` in any
        // PCID; a kernel that cannot promise global mappings gets every
        // PCID flushed, whatever is loaded.
        assert_eq!(page_flush(Asid::KERNEL, true, true, 5), PageFlush::Invlpg);
        assert_eq!(page_flush(Asid::KERNEL, true, false, 5), PageFlush::EveryPcid);
        assert_eq!(page_flush(Asid::KERNEL, true, false, 0), PageFlush::EveryPcid);
        // An ASID wider than a PCID (only by a direct call): every PCID,
        // never the PCID its low bits would name.
        let wide = Asid::new(4096 + 5).unwrap();
        assert_eq!(page_flush(wide, true, true, 5), PageFlush::EveryPcid);
    }

    #[test]
    fn pcids_are_the_asids_and_the_kernel_has_zero() {
        assert_eq!(X86_64::pcid_of(Asid::KERNEL), Some(0));
        assert_eq!(X86_64::pcid_of(Asid::new(1).unwrap()), Some(1));
        assert_eq!(X86_64::pcid_of(Asid::new(4095).unwrap()), Some(4095));
        // Wider than 12 bits: no PCID, never another address space's.
        assert_eq!(X86_64::pcid_of(Asid::new(4096).unwrap()), None);
        assert_eq!(X86_64::pcid_of(Asid::new(4096 + 5).unwrap()), None);
    }
}
