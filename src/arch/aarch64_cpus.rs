//! [`CpuTable`]: which CPU index each aarch64 processor (known by its
//! MPIDR_EL1 affinity) has, and which of them are online.
//!
//! It holds no instruction, so host tests check it; the `aarch64` module
//! re-exports it and is the only code that puts CPUs online.

// On other targets only this module's tests use it.
#![cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]

use super::aarch64_encoding::mpidr_affinity;
use super::cpu_registry::{DirectSlots, HwIdTable};
use crate::cpuset::{CpuId, CpuSet, MAX_CPUS};
use crate::Error;

/// Affinities whose Aff3 and Aff2 are 0 and whose Aff1 and Aff0 are below
/// 16 (up to 16 clusters of 16 CPUs, the usual numbering) are found with
/// one load; others by a scan of the registered CPUs. A processor whose
/// four affinity fields are all 0xFF cannot be registered (no real
/// topology numbers its CPUs that far in every field).
struct Affinities;

impl DirectSlots for Affinities {
    fn slot(affinity: u32) -> Option<usize> {
        direct_slot(affinity)
    }
}

/// The direct slot of `affinity`, if it has one.
const fn direct_slot(affinity: u32) -> Option<usize> {
    let aff0 = affinity & 0xff;
    let aff1 = (affinity >> 8) & 0xff;
    if affinity >> 16 == 0 && aff0 < 16 && aff1 < 16 {
        Some(((aff1 << 4) | aff0) as usize)
    } else {
        None
    }
}

/// CPU indices by MPIDR_EL1 affinity, and which CPUs are online: a
/// `static` the kernel fills during bring-up.
///
/// The CPU that starts a processor [registers](Self::register) its index
/// and affinity first; the processor then joins the online set only
/// through `Aarch64::bring_online` (in the `aarch64` module), run on
/// itself, which flushes its TLB first: nothing else can mark a CPU
/// online.
pub struct CpuTable {
    table: HwIdTable<Affinities>,
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
        }
    }

    /// Records that CPU `cpu` is the processor whose MPIDR_EL1 is `mpidr`
    /// (only its affinity fields count: the value firmware lists in the
    /// ACPI MADT or the devicetree will do). The CPU is not online yet.
    /// Registering the same pair again is harmless. Register from one CPU
    /// at a time (bring-up is serial on the boot CPU).
    ///
    /// Errors, with nothing recorded: [`Error::CpuOutOfRange`];
    /// [`Error::InvalidHardwareId`] (with the packed affinity,
    /// [`mpidr_affinity`]) for the all-0xFF affinity or one another index
    /// already has (two indices for one processor would let one be skipped
    /// as "self" while the other is flushed);
    /// [`Error::CpuAlreadyRegistered`] when `cpu` has another affinity.
    pub fn register(&self, cpu: usize, mpidr: u64) -> Result<CpuId, Error> {
        self.table.register(cpu, mpidr_affinity(mpidr))
    }

    /// Registers the machine's CPUs in one call: CPU `i` is the processor
    /// whose MPIDR_EL1 is `mpidrs[i]` (the boot CPU first, then the others
    /// in the order the ACPI MADT or the devicetree lists them). The whole
    /// list is checked first: on an error nothing is recorded.
    ///
    /// Errors: [`register`](Self::register)'s, for the first refused CPU,
    /// and [`Error::InvalidHardwareId`] for an affinity listed twice.
    pub fn register_all(&self, mpidrs: &[u64]) -> Result<(), Error> {
        if mpidrs.len() > MAX_CPUS {
            return Err(Error::CpuOutOfRange {
                cpu: mpidrs.len() - 1,
                limit: MAX_CPUS,
            });
        }
        let mut affinities = [0; MAX_CPUS];
        for (affinity, &mpidr) in affinities.iter_mut().zip(mpidrs) {
            *affinity = mpidr_affinity(mpidr);
        }
        self.table.register_all(&affinities[..mpidrs.len()])
    }

    /// The online CPUs.
    pub fn online(&self) -> CpuSet {
        self.table.online()
    }

    /// The packed affinity ([`mpidr_affinity`]) of `cpu`, if registered: what
    /// a kernel's IPI hook needs to address it (GICv3 `ICC_SGI1R_EL1` takes
    /// Aff3, Aff2, Aff1 and a bit for Aff0).
    pub fn affinity(&self, cpu: CpuId) -> Option<u32> {
        self.table.id(cpu)
    }

    /// The CPU whose MPIDR_EL1 is `mpidr`, if registered.
    pub fn cpu_of(&self, mpidr: u64) -> Option<CpuId> {
        self.table.cpu_of(mpidr_affinity(mpidr))
    }

    /// Puts `cpu` in the online set; only `Aarch64::bring_online` calls it,
    /// after the flush that the online set's contract requires.
    pub(crate) fn join(&self, cpu: CpuId) {
        self.table.join(cpu);
    }

    /// Takes `cpu` out of the online set; returns whether it was in it.
    /// Only `Aarch64::take_offline` calls it, on the CPU itself, through
    /// [`take_cpu_offline`](crate::take_cpu_offline).
    pub(crate) fn leave(&self, cpu: CpuId) -> bool {
        self.table.leave(cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::super::cpu_registry::DIRECT_SLOTS;
    use super::*;
    use crate::cpuset::MAX_CPUS;

    fn cpu(i: usize) -> CpuId {
        CpuId::new(i).unwrap()
    }

    /// Two MPIDR values of one processor (bit 31 set or not) are one
    /// affinity listed twice: the list is refused with nothing recorded.
    #[test]
    fn registering_a_list_compares_affinities() {
        let t = CpuTable::new();
        assert_eq!(
            t.register_all(&[0x8000_0000, 0x8000_0001, 0x0]),
            Err(Error::InvalidHardwareId { hw_id: 0 })
        );
        assert_eq!(t.cpu_of(0x8000_0001), None);
        assert_eq!(t.register_all(&[0x8000_0000, 0x8000_0100]), Ok(()));
        assert_eq!(t.cpu_of(0x100), Some(cpu(1)));
        assert_eq!(t.affinity(cpu(0)), Some(0));
    }

    #[test]
    fn registration_refuses_what_would_confuse_two_cpus() {
        let t = CpuTable::new();
        // MPIDR values as the CPUs read them: RES1 bit 31 set.
        assert_eq!(t.register(0, 0x8000_0000), Ok(cpu(0)));
        assert_eq!(t.register(0, 0x8000_0000), Ok(cpu(0)));
        // The firmware's value without bit 31 is the same processor.
        assert_eq!(t.register(0, 0), Ok(cpu(0)));
        assert_eq!(t.register(1, 0), Err(Error::InvalidHardwareId { hw_id: 0 }));
        assert_eq!(t.register(0, 0x100), Err(Error::CpuAlreadyRegistered { cpu: 0 }));
        assert_eq!(
            t.register(2, 0xff_00ff_ffff),
            Err(Error::InvalidHardwareId { hw_id: u32::MAX })
        );
        assert_eq!(
            t.register(MAX_CPUS, 0x200),
            Err(Error::CpuOutOfRange {
                cpu: MAX_CPUS,
                limit: MAX_CPUS
            })
        );
        // Nothing of the refused calls was recorded.
        assert_eq!(t.affinity(cpu(0)), Some(0));
        assert_eq!(t.affinity(cpu(1)), None);
        assert_eq!(t.affinity(cpu(2)), None);
        assert_eq!(t.cpu_of(0x100), None);
        assert_eq!(t.cpu_of(0xff_00ff_ffff), None);
        // A second cluster (Aff1 = 1).
        assert_eq!(t.register(1, 0x8000_0100), Ok(cpu(1)));
        assert_eq!(t.cpu_of(0x100), Some(cpu(1)));
        assert_eq!(t.cpu_of(0x8100_0100), Some(cpu(1)));
        assert_eq!(t.cpu_of(0x101), None);
        // Affinities without a direct slot (Aff2, Aff3, Aff0 >= 16) are
        // found by a scan, with the same refusals.
        assert_eq!(t.register(3, 0x01_0000_0000), Ok(cpu(3)));
        assert_eq!(t.register(4, 0x0001_0000), Ok(cpu(4)));
        assert_eq!(t.register(5, 0x0000_0010), Ok(cpu(5)));
        assert_eq!(t.cpu_of(0x01_0000_0000), Some(cpu(3)));
        assert_eq!(t.cpu_of(0x0001_0000), Some(cpu(4)));
        assert_eq!(t.cpu_of(0x0000_0010), Some(cpu(5)));
        assert_eq!(t.cpu_of(0x0000_0011), None);
        assert_eq!(
            t.register(6, 0x0001_0000),
            Err(Error::InvalidHardwareId { hw_id: 0x0001_0000 })
        );
        assert_eq!(t.affinity(cpu(3)), Some(0x0100_0000));
        // Registration alone puts no CPU online; joining does.
        assert!(t.online().is_empty());
        t.join(cpu(1));
        assert_eq!(t.online(), CpuSet::single(cpu(1)));
        // Leaving takes it out again, once.
        assert!(t.leave(cpu(1)));
        assert!(!t.leave(cpu(1)));
        assert!(t.online().is_empty());
        assert_eq!(t.cpu_of(0x100), Some(cpu(1)));
    }

    #[test]
    fn direct_slots_cover_sixteen_clusters_of_sixteen() {
        assert_eq!(direct_slot(0), Some(0));
        assert_eq!(direct_slot(0x0f0f), Some(255));
        assert_eq!(direct_slot(0x0305), Some(0x35));
        assert_eq!(direct_slot(0x0010), None);
        assert_eq!(direct_slot(0x1000), None);
        assert_eq!(direct_slot(0x0001_0000), None);
        assert_eq!(direct_slot(0x0100_0000), None);
        // Every direct slot belongs to one affinity only.
        let mut seen = [false; DIRECT_SLOTS];
        for aff1 in 0..16u32 {
            for aff0 in 0..16u32 {
                let slot = direct_slot((aff1 << 8) | aff0).unwrap();
                assert!(!seen[slot]);
                seen[slot] = true;
            }
        }
    }
}
