//! The README's sketch: the whole embedding in one screen, the crate's
//! calls written out (the guide's modules split the same calls up).

// guide: sketch
use tlb_batch::arch::x86_64::{CpuTable, Features, LocalApic, X86_64};
use tlb_batch::mapper::{DeallocatorFrees, OffsetSpace};
use tlb_batch::{Error, MmTlbState, PageGather, PageRange, TeardownSummary, TlbShootdown};
use x86_64::structures::paging::{FrameDeallocator, OffsetPageTable, Size4KiB};

static CPUS: CpuTable = CpuTable::new();
static TLB: TlbShootdown = TlbShootdown::new();

/// Boot CPU, interrupts off, its IDT sending vector 0xf0 to a handler that
/// calls `arch.flush_ipi_entry()`. Load every page-table root with
/// `tlb_batch::switch_mm(&arch, prev, next)` from then on.
pub fn start(apic: LocalApic) -> Result<X86_64, Error> {
    CPUS.register(0, apic.id())?; // every CPU, with its APIC ID

    // SAFETY: ring 0; every CPU is registered and routes 0xf0 before it
    // comes online, and enables what this one did.
    let arch = unsafe { X86_64::new(apic, 0xf0, &CPUS, &TLB, Features::detect()) }?;
    arch.bring_online()?; // on every CPU, as it starts
    Ok(arch)
}

/// munmap: entries cleared, one flush, then frames and emptied tables freed.
pub fn munmap(
    arch: &X86_64,
    mapper: &mut OffsetPageTable,
    mm: &MmTlbState,
    gather: &mut PageGather,
    frames: &mut impl FrameDeallocator<Size4KiB>,
    range: PageRange,
) -> Result<TeardownSummary, Error> {
    // SAFETY: each page is mapped once, by this space alone, its frame and
    // the tables below the root ours to free, into `frames`.
    let space = unsafe { OffsetSpace::new(mapper, mm).for_teardown() };
    let mut frees = unsafe { DeallocatorFrees::new(frames) };
    space.munmap(arch, gather, range, &mut frees)
}
// guide: end
