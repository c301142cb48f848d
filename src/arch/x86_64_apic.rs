//! The local APIC as the x86_64 [`Arch`](super::Arch) uses it: its
//! registers in xAPIC (MMIO) or x2APIC (MSR) mode, end of interrupt, and
//! the interrupt command register that sends flush IPIs (and INIT and
//! STARTUP for bring-up).
//!
//! The `x86_64` module re-exports every public item.

use core::arch::asm;
use core::ptr::NonNull;

use volatile::VolatilePtr;

use super::x86_64_instructions::{pause, rdmsr, without_interrupts, wrmsr};

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
    /// An xAPIC whose register page is mapped at virtual address `base`.
    ///
    /// The mapping it needs, on every CPU that uses the value:
    ///
    /// - one 4 KiB page at `base` (4 KiB-aligned) whose frame is the
    ///   physical address in IA32_APIC_BASE bits 12 and up
    ///   (0xFEE0_0000 after reset; SDM vol. 3A, 10.4.4, or 11.4.4 in the
    ///   editions that number the APIC chapter 11), read while the APIC is
    ///   enabled in xAPIC mode (bit 11 set, bit 10 clear);
    /// - present and writable (EOI and the ICR are written), supervisor
    ///   only;
    /// - strong uncacheable, as 10.4.1 / 11.4.1 requires for the APIC's
    ///   registers: PCD and PWT set with PAT clear, which is UC while PAT
    ///   entry 3 keeps its reset value (vol. 3A, "Selecting a Memory Type
    ///   from the PAT"), or any PAT entry the kernel programmed as UC;
    /// - no-execute where IA32_EFER.NXE is on, and global if the kernel
    ///   promises global kernel mappings (neither is needed for the
    ///   registers to work).
    ///
    /// With the `x86_64-mapper` feature, `tlb_batch::mapper::xapic::map_xapic`
    /// writes exactly that entry through the `x86_64` crate's `Mapper`.
    ///
    /// # Safety
    ///
    /// `base` must map the local APIC's 4 KiB register page as above for
    /// as long as the value is used, and nothing else may treat that page
    /// as memory; the value is used in ring 0 only.
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
