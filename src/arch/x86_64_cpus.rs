//! The x86 CPU table: which CPU index each processor (known by its APIC
//! ID) has, which of them are online, how many the machine has, and when
//! one all-but-self IPI reaches exactly the CPUs a flush targets.
//!
//! It holds no instruction; the `x86_64` module re-exports [`CpuTable`]
//! and is the only code that puts CPUs online.

use core::sync::atomic::{AtomicUsize, Ordering};

use super::cpu_registry::{DirectSlots, HwIdTable, DIRECT_SLOTS};
use crate::cpuset::{CpuId, CpuSet};
use crate::Error;

/// APIC IDs of the machine's CPUs and which of them are online: a `static`
/// the kernel fills during bring-up.
///
/// A CPU is [registered](Self::register) (index and APIC ID) by the CPU that
/// starts it, and joins the online set only through
/// [`X86_64::bring_online`], run on the CPU itself, which flushes its TLB
/// first: nothing else can mark a CPU online.
///
/// [`X86_64::bring_online`]: super::x86_64::X86_64::bring_online
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

    /// Registers the machine's CPUs in one call: CPU `i` gets APIC ID
    /// `apic_ids[i]` (the boot CPU first, then the others in the order the
    /// ACPI MADT lists them), and the count of CPUs becomes
    /// `apic_ids.len()` ([`set_present`](Self::set_present)). The whole
    /// list is checked first: on an error nothing is recorded.
    ///
    /// Errors: [`register`](Self::register)'s, for the first refused CPU,
    /// and [`Error::InvalidHardwareId`] for an APIC ID listed twice.
    pub fn register_all(&self, apic_ids: &[u32]) -> Result<(), Error> {
        self.table.register_all(apic_ids)?;
        self.set_present(apic_ids.len());
        Ok(())
    }

    /// Records how many CPUs the machine has: every processor the firmware
    /// lists as usable (ACPI MADT), started or not. Only when that many
    /// CPUs are online does [`X86_64`] send a flush IPI with the APIC's
    /// all-but-self shorthand, which reaches every processor of the
    /// machine; until it is set, every IPI names its destination.
    ///
    /// [`X86_64`]: super::x86_64::X86_64
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

    /// Puts `cpu` in the online set. Only
    /// [`X86_64::bring_online`](super::x86_64::X86_64::bring_online) calls
    /// it, on the CPU itself, after flushing its TLB.
    pub(super) fn join(&self, cpu: CpuId) {
        self.table.join(cpu);
    }

    /// Takes `cpu` out of the online set; returns whether it was in it.
    /// Only [`X86_64::take_offline`](super::x86_64::X86_64::take_offline)
    /// calls it, on the CPU itself, through
    /// [`take_cpu_offline`](crate::take_cpu_offline).
    pub(super) fn leave(&self, cpu: CpuId) -> bool {
        self.table.leave(cpu)
    }
}

/// Whether one all-but-self IPI reaches exactly `targets`: they are every
/// online CPU but `me`, and every CPU the machine has (`present`) is
/// online, so no offline, unregistered or not-yet-started processor takes
/// an interrupt it has no business with. A single target gets a directed
/// IPI either way.
///
/// A CPU that went offline ([`X86_64::take_offline`]) is out of `online`,
/// so while it is away the count falls short of `present` and every IPI
/// names its destination. A sender whose targets came from an older read
/// of the online set that still held it gets a directed IPI too (its
/// targets then hold a CPU the current set lacks); the offline CPU serves
/// that request before it parks, and finds the latched IPI empty when it
/// comes back.
///
/// [`X86_64::take_offline`]: super::x86_64::X86_64::take_offline
pub(super) fn shorthand_reaches_exactly(
    targets: &CpuSet,
    online: &CpuSet,
    me: CpuId,
    present: usize,
) -> bool {
    targets.len() > 1
        && online.len() == present
        && online.contains(me)
        && *targets == online.difference(&CpuSet::single(me))
}

#[cfg(test)]
mod tests {
    //! CPU registration and when the all-but-self shorthand is allowed,
    //! which run without ring 0.
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
    fn the_shorthand_is_not_used_while_a_cpu_is_offline() {
        let t = CpuTable::new();
        for i in 0..4 {
            t.register(i, 10 + i as u32).unwrap();
            t.join(cpu(i));
        }
        t.set_present(4);
        let others = set(&[1, 2, 3]);
        assert!(shorthand_reaches_exactly(
            &others,
            &t.online(),
            cpu(0),
            t.present()
        ));
        // CPU 3 goes offline: the others now online are 1 and 2, and an
        // all-but-self IPI would interrupt CPU 3 too.
        assert!(t.leave(cpu(3)));
        assert!(!t.leave(cpu(3)));
        let online = t.online();
        assert_eq!(online, set(&[0, 1, 2]));
        assert!(!shorthand_reaches_exactly(
            &set(&[1, 2]),
            &online,
            cpu(0),
            t.present()
        ));
        // Targets read before CPU 3 left still name it: directed IPIs.
        assert!(!shorthand_reaches_exactly(&others, &online, cpu(0), t.present()));
        // Sent by CPU 3 itself while it leaves (it is no longer online).
        assert!(!shorthand_reaches_exactly(
            &set(&[0, 1, 2]),
            &online,
            cpu(3),
            t.present()
        ));
        // Back online: every present CPU is, and the shorthand returns.
        t.join(cpu(3));
        assert!(shorthand_reaches_exactly(
            &others,
            &t.online(),
            cpu(0),
            t.present()
        ));
        assert!(shorthand_reaches_exactly(
            &set(&[0, 1, 2]),
            &t.online(),
            cpu(3),
            t.present()
        ));
    }
}
