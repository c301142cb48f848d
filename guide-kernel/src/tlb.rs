//! Setting the crate up: the statics, the `Arch`, the CPUs, the xAPIC
//! page, the flush-IPI entry, bring-up and the address-space switch.

// guide: uses-tlb
use tlb_batch::arch::x86_64::{wrmsr, CpuTable, Features, LocalApic, X86_64};
use tlb_batch::mapper::xapic::{map_local_xapic, XapicMapError, XapicPage};
use tlb_batch::{CpuId, Error, MmTlbState, TlbShootdown};
use x86_64::structures::idt::InterruptDescriptorTable;
use x86_64::structures::paging::{FrameAllocator, OffsetPageTable, Page, Size4KiB};
use x86_64::VirtAddr;
// guide: end

// guide: statics
/// The flush IPI's vector: any vector the kernel does not use otherwise.
pub const TLB_VECTOR: u8 = 0xf0;

/// Every CPU's index and APIC ID, and which CPUs are online.
pub static CPUS: CpuTable = CpuTable::new();
/// The shootdown protocol's per-CPU state.
pub static TLB: TlbShootdown = TlbShootdown::new();
/// The `Arch`, built once on the boot CPU and shared by every CPU.
static ARCH: spin::Once<X86_64> = spin::Once::new();

/// The `Arch` every crate call takes.
pub fn arch() -> &'static X86_64 {
    ARCH.get().expect("tlb::init has not run")
}
// guide: end

// guide: xapic
/// The virtual address the kernel picks for the xAPIC's register page.
const XAPIC_PAGE: u64 = 0xffff_ff00_0000_0000;

/// Maps the xAPIC's registers (not needed in x2APIC mode).
pub fn map_local_apic(
    mapper: &mut OffsetPageTable,
    frames: &mut impl FrameAllocator<Size4KiB>,
) -> Result<LocalApic, XapicMapError> {
    let page = Page::containing_address(VirtAddr::new(XAPIC_PAGE));
    // SAFETY: ring 0; `frames` hands out unused frames; nothing else uses
    // the APIC's page or `page` as memory; the mapping stays for good.
    unsafe { map_local_xapic(mapper, frames, page, XapicPage::default()) }
}
// guide: end

// guide: enable-apic
/// The local APIC's spurious-interrupt vector. Its handler only returns:
/// a spurious interrupt is never in service, so it takes no EOI (Intel
/// SDM vol. 3A, 10.9). 0xff also suits the P6 family, whose APICs wire
/// the vector's low four bits to 1.
pub const SPURIOUS_VECTOR: u8 = 0xff;

/// On each CPU as it starts, before `init` (the boot CPU) or `cpu_online`
/// (the others): turns its local APIC on. Only the spurious-interrupt
/// register is written; the local vector table stays as the firmware left
/// it, so interrupts the 8259 PIC delivers through LINT0 (PC firmware's
/// virtual-wire mode, QEMU's too) keep coming.
pub fn enable_local_apic(apic: &LocalApic) {
    // SAFETY: ring 0; the kernel's IDT routes SPURIOUS_VECTOR to a handler
    // that returns without an EOI, and TLB_VECTOR once `cpu_online` runs.
    unsafe { apic.enable(SPURIOUS_VECTOR) }
}
// guide: end

// guide: init
/// On the boot CPU, after its CR4 (PGE, PCIDE) is set up and the local
/// APIC enabled, before any other CPU starts: registers every CPU (by the
/// APIC IDs the ACPI MADT lists; `&[apic.id()]` on one CPU) and builds
/// the `Arch`.
pub fn init(apic: LocalApic, apic_ids: &[u32]) -> Result<(), Error> {
    // CPU i has APIC ID apic_ids[i].
    CPUS.register_all(apic_ids)?;
    // SAFETY: ring 0.
    let features = unsafe { Features::detect() };
    // SAFETY: ring 0; every CPU is registered above before it runs crate
    // code, and calls `bring_online` only once its IDT routes TLB_VECTOR to
    // `tlb_flush_entry`; `apic` is valid on every CPU; every CPU enables in
    // CR4 what this one did.
    let arch = unsafe { X86_64::new(apic, TLB_VECTOR, &CPUS, &TLB, features) }?;
    ARCH.call_once(|| arch);
    Ok(())
}
// guide: end

// guide: idt
// The flush IPI's interrupt entry, on stable Rust: registers saved, then
// `arch().flush_ipi_entry()` (serves the requests, then the EOI), `iretq`.
tlb_batch::x86_64_flush_ipi_entry!(tlb_flush_entry for arch());

/// Where the kernel builds its IDT, next to its exception handlers.
pub fn route_flush_ipi(idt: &mut InterruptDescriptorTable) {
    let entry = VirtAddr::from_ptr(tlb_flush_entry as *const ());
    // SAFETY: `tlb_flush_entry` is an interrupt entry: it keeps every
    // register the handler may change and ends with `iretq`.
    unsafe { idt[TLB_VECTOR].set_handler_addr(entry) };
}
// guide: end

// guide: cpu-index
/// IA32_TSC_AUX, where this kernel keeps each CPU's index.
const IA32_TSC_AUX: u32 = 0xc000_0103;

/// On each CPU as it starts, before `cpu_online`: records its index
/// (the one `init` registered with its APIC ID).
pub fn set_cpu_index(index: usize) {
    // SAFETY: ring 0; the MSR exists where `rdpid` does.
    unsafe { wrmsr(IA32_TSC_AUX, index as u64) };
}

/// The running CPU's index, with `rdpid` (CPUID.(07H,0):ECX bit 22).
fn cpu_index() -> usize {
    let index: u64;
    // SAFETY: reads IA32_TSC_AUX into a register, nothing else.
    unsafe { core::arch::asm!("rdpid {}", out(reg) index, options(nomem, nostack, preserves_flags)) };
    index as usize
}

/// `init`'s `Arch`, answering "which CPU?" from `cpu_index` instead of an
/// APIC ID read per crate call: `ARCH.call_once(|| with_fast_index(arch))`.
pub fn with_fast_index(arch: X86_64) -> X86_64 {
    // SAFETY: `set_cpu_index` ran on every CPU with its registered index.
    unsafe { arch.with_cpu_index(cpu_index) }
}
// guide: end

// guide: online
/// On each CPU as it starts (the boot CPU too), interrupts off, its IDT
/// loaded: flushes its TLB and joins the CPUs that shootdowns reach.
pub fn cpu_online() -> Result<CpuId, Error> {
    arch().bring_online()
}
// guide: end

// guide: switch
/// The context switch's page-table load: the only way a root that
/// `MmTlbState` describes may be loaded.
///
/// # Safety
///
/// `next`'s root maps the kernel, and `prev` is what this CPU runs now.
pub unsafe fn switch_to(prev: Option<&MmTlbState>, next: &MmTlbState) -> Result<(), Error> {
    x86_64::instructions::interrupts::without_interrupts(|| {
        // SAFETY: the caller's promise, interrupts off.
        unsafe { tlb_batch::switch_mm(arch(), prev, next) }
    })
}
// guide: end
