//! The bring-up that `docs/embedding-aarch64.md` shows, for an ARMv8-A
//! kernel at EL1 with 4 KiB pages. Every ```rust block of that page is a
//! verbatim excerpt of this file, between `// guide: NAME` and
//! `// guide: end` markers; `scripts/guide-check.sh` builds the crate for
//! `aarch64-unknown-none` and checks that the excerpts match.
//!
//! It is a library: it compiles the calls, it does not boot. The kernel's
//! own pieces (its SGI sender, the MPIDRs its firmware lists, its kernel
//! page table) are parameters.

#![no_std]

use tlb_batch::arch::aarch64::{Aarch64, Config, CpuTable, Unsupported};
use tlb_batch::{switch_mm, CpuSet, Error, MmTlbState, TlbShootdown};

/// The kernel's boot error: either of the two errors bring-up can meet.
#[derive(Debug)]
pub enum BootError {
    /// An MMU setting the crate does not serve.
    Mmu(Unsupported),
    /// A crate call refused.
    Tlb(Error),
}

impl From<Unsupported> for BootError {
    fn from(e: Unsupported) -> Self {
        BootError::Mmu(e)
    }
}

impl From<Error> for BootError {
    fn from(e: Error) -> Self {
        BootError::Tlb(e)
    }
}

/// The kernel's SGI sender: raises its flush SGI at every CPU of `targets`
/// (through the GIC's ICC_SGI1R_EL1; not shown here).
fn send_sgi(_targets: &CpuSet) {}

// guide: statics
/// Every CPU's index and MPIDR, and which CPUs are online.
static CPUS: CpuTable = CpuTable::new();
/// The shootdown protocol's per-CPU state.
static TLB: TlbShootdown = TlbShootdown::new();

/// The `Arch` (it holds nothing per CPU: any CPU can build one).
pub fn arch(config: Config) -> Aarch64 {
    // SAFETY: EL1 with the MMU on and the same TCR_EL1 on every CPU; every
    // CPU registers in CPUS and comes online through bring_online once its
    // GIC routes the SGI that send_sgi raises to a handler calling
    // arch(..).flush_ipi_entry(); user tables in TTBR0, never with ASID 0;
    // clean writable pages mapped read-only (DBM set if TCR_EL1.HD is on).
    unsafe { Aarch64::new(&CPUS, &TLB, send_sgi, config) }
}
// guide: end

// guide: boot
/// On the boot CPU, before any other starts: reads and checks the MMU
/// setup (a 4, 16 or 64 KiB granule the CPU implements, the same in TG0
/// and TG1 unless TTBR1 walks are off; ASID from TTBR0, ASIDs of 8 or 16
/// bits as TCR_EL1.AS and the CPU allow, 25- to 48-bit regions; CPUs with
/// repeat-TLBI errata add `.with_repeated_tlbi()`), and registers every
/// CPU: CPU i is the one whose MPIDR_EL1 is `mpidrs[i]`, the boot CPU
/// first, in the order the ACPI MADT or the devicetree lists them.
pub fn boot(mpidrs: &[u64]) -> Result<Config, BootError> {
    // SAFETY: EL1.
    let config = unsafe { Config::detect() }?;
    // The whole list is checked first (duplicate affinities refused).
    CPUS.register_all(mpidrs)?;
    Ok(config)
}
// guide: end

// guide: online
/// On each CPU as it starts (interrupts masked): flushes its whole TLB,
/// joins the online set, flushes again; refused if never registered.
pub fn cpu_up(config: Config) -> Result<(), Error> {
    arch(config).bring_online()?;
    Ok(())
}

/// On a CPU going offline (interrupts masked): loads the kernel's address
/// space (a CPU still running a user space is refused with
/// `Error::UserSpaceLoaded`), then leaves the online set once no
/// `ipi_sync` can wait for it; it then parks (or PSCI CPU_OFF) until
/// `cpu_up`. `current` is the space it ran.
pub fn cpu_down(config: Config, current: &MmTlbState, kernel: &MmTlbState) -> Result<(), Error> {
    let a = arch(config);
    // SAFETY: `kernel`'s root is the kernel's own table, which maps the
    // code that runs from here on; `current` is the space this CPU ran.
    unsafe { switch_mm(&a, Some(current), kernel) }?;
    a.take_offline()?;
    Ok(())
}
// guide: end
