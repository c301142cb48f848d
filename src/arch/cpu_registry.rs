//! [`HwIdTable`]: the part of a hardware `Arch`'s CPU table that does not
//! depend on the architecture: which CPU index each processor, known by a
//! 32-bit hardware id (an x86 APIC ID, a packed arm64 MPIDR affinity), has,
//! found with one load for the usual ids, and which CPUs are online.
//!
//! It holds no instruction, so host tests check it; `x86_64::CpuTable` and
//! `aarch64::CpuTable` wrap it with their own id and its direct slots.

// On targets with neither hardware `Arch`, only this module's tests use it.
#![cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]

use core::marker::PhantomData;
use core::sync::atomic::{AtomicU16, AtomicU32, AtomicUsize, Ordering};

use crate::cpuset::{AtomicCpuSet, CpuId, CpuSet, MAX_CPUS};
use crate::Error;

/// The id of an unused slot; no processor can be registered with it.
pub(crate) const NO_HW_ID: u32 = u32::MAX;

/// How many ids are found with one load.
pub(crate) const DIRECT_SLOTS: usize = 256;

/// Which hardware ids have a direct slot, and which: each slot belongs to
/// one id at most.
pub(crate) trait DirectSlots {
    /// The direct slot of `id` (below [`DIRECT_SLOTS`]), if it has one.
    fn slot(id: u32) -> Option<usize>;
}

/// CPU index by hardware id, and the online set.
pub(crate) struct HwIdTable<S> {
    ids: [AtomicU32; MAX_CPUS],
    /// For ids with a direct slot: the CPU index plus one, 0 for none, so
    /// that finding the running CPU, which every crate call does, is one
    /// load instead of a scan of the table.
    direct: [AtomicU16; DIRECT_SLOTS],
    count: AtomicUsize,
    online: AtomicCpuSet,
    slots: PhantomData<S>,
}

impl<S: DirectSlots> HwIdTable<S> {
    /// An empty table, usable in a `static`.
    pub(crate) const fn new() -> Self {
        HwIdTable {
            ids: [const { AtomicU32::new(NO_HW_ID) }; MAX_CPUS],
            direct: [const { AtomicU16::new(0) }; DIRECT_SLOTS],
            count: AtomicUsize::new(0),
            online: AtomicCpuSet::new(),
            slots: PhantomData,
        }
    }

    /// Records that CPU `cpu` has hardware id `id` (not yet online).
    /// Registering the same pair again is harmless. Errors, with nothing
    /// recorded: [`Error::CpuOutOfRange`]; [`Error::InvalidHardwareId`] for
    /// [`NO_HW_ID`] or an id another index already has (two indices for one
    /// processor would let one be skipped as "self" while the other is
    /// flushed); [`Error::CpuAlreadyRegistered`] when `cpu` has another id.
    pub(crate) fn register(&self, cpu: usize, id: u32) -> Result<CpuId, Error> {
        let cpu_id = CpuId::new(cpu)?;
        if id == NO_HW_ID {
            return Err(Error::InvalidHardwareId { hw_id: id });
        }
        match self.cpu_of(id) {
            Some(other) if other != cpu_id => return Err(Error::InvalidHardwareId { hw_id: id }),
            _ => {}
        }
        match self.ids[cpu].compare_exchange(NO_HW_ID, id, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {}
            Err(existing) if existing == id => {}
            Err(_) => return Err(Error::CpuAlreadyRegistered { cpu }),
        }
        if let Some(slot) = S::slot(id).and_then(|s| self.direct.get(s)) {
            // `cpu` < MAX_CPUS <= u16::MAX (checked by `CpuId::new`, and
            // asserted in cpuset.rs), so `cpu + 1` fits.
            slot.store(cpu as u16 + 1, Ordering::Release);
        }
        self.count.fetch_max(cpu + 1, Ordering::AcqRel);
        Ok(cpu_id)
    }

    /// Registers CPU `i` with hardware id `ids[i]`, for every `i`: the
    /// whole list checked first, so on an error nothing is recorded. The
    /// errors are [`register`](Self::register)'s, for the first CPU whose
    /// pair is refused, and [`Error::InvalidHardwareId`] for an id listed
    /// twice. Sorting a copy finds those in `O(n log n)` without
    /// allocating.
    pub(crate) fn register_all(&self, ids: &[u32]) -> Result<(), Error> {
        if ids.len() > MAX_CPUS {
            return Err(Error::CpuOutOfRange {
                cpu: ids.len() - 1,
                limit: MAX_CPUS,
            });
        }
        for (cpu, &id) in ids.iter().enumerate() {
            if id == NO_HW_ID {
                return Err(Error::InvalidHardwareId { hw_id: id });
            }
            match self.cpu_of(id) {
                Some(other) if other.index() != cpu => return Err(Error::InvalidHardwareId { hw_id: id }),
                _ => {}
            }
            match self.ids[cpu].load(Ordering::Acquire) {
                NO_HW_ID => {}
                existing if existing == id => {}
                _ => return Err(Error::CpuAlreadyRegistered { cpu }),
            }
        }
        let mut sorted = [NO_HW_ID; MAX_CPUS];
        let sorted = &mut sorted[..ids.len()];
        sorted.copy_from_slice(ids);
        sorted.sort_unstable();
        if let Some(pair) = sorted.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(Error::InvalidHardwareId { hw_id: pair[0] });
        }
        for (cpu, &id) in ids.iter().enumerate() {
            self.register(cpu, id)?;
        }
        Ok(())
    }

    /// The online CPUs.
    pub(crate) fn online(&self) -> CpuSet {
        self.online.load(Ordering::SeqCst)
    }

    /// The hardware id of `cpu`, if registered.
    pub(crate) fn id(&self, cpu: CpuId) -> Option<u32> {
        match self.ids[cpu.index()].load(Ordering::Acquire) {
            NO_HW_ID => None,
            id => Some(id),
        }
    }

    /// The CPU whose hardware id is `id`, if registered.
    pub(crate) fn cpu_of(&self, id: u32) -> Option<CpuId> {
        if id == NO_HW_ID {
            return None;
        }
        if let Some(slot) = S::slot(id).and_then(|s| self.direct.get(s)) {
            let index = usize::from(slot.load(Ordering::Acquire)).checked_sub(1)?;
            return CpuId::new(index).ok();
        }
        let count = self.count.load(Ordering::Acquire).min(MAX_CPUS);
        (0..count)
            .find(|&i| self.ids[i].load(Ordering::Acquire) == id)
            .and_then(|i| CpuId::new(i).ok())
    }

    /// Puts `cpu` in the online set; only an `Arch`'s bring-up calls it,
    /// after the flush that the online set's contract requires.
    pub(crate) fn join(&self, cpu: CpuId) {
        self.online.insert(cpu, Ordering::SeqCst);
    }

    /// Takes `cpu` out of the online set and returns whether it was in it;
    /// only an `Arch`'s offline path calls it, through
    /// [`take_cpu_offline`](crate::take_cpu_offline), which then serves the
    /// CPU's inbox until no initiator can still be waiting for it.
    pub(crate) fn leave(&self, cpu: CpuId) -> bool {
        // SeqCst like `join`; what orders the removal before the marks'
        // reads is the fence in `take_cpu_offline`.
        self.online.remove(cpu, Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids below 4 have a direct slot, in reverse order.
    struct Low;

    impl DirectSlots for Low {
        fn slot(id: u32) -> Option<usize> {
            (id < 4).then(|| 3 - id as usize)
        }
    }

    fn cpu(i: usize) -> CpuId {
        CpuId::new(i).unwrap()
    }

    /// A list is checked whole before anything is recorded: a duplicate,
    /// the broadcast id, a clash with an earlier registration or too many
    /// CPUs leave the table as it was.
    #[test]
    fn registering_a_list_records_all_of_it_or_none() {
        let t = HwIdTable::<Low>::new();
        assert_eq!(
            t.register_all(&[2, 7, 2]),
            Err(Error::InvalidHardwareId { hw_id: 2 })
        );
        assert_eq!(
            t.register_all(&[5, NO_HW_ID]),
            Err(Error::InvalidHardwareId { hw_id: NO_HW_ID })
        );
        assert_eq!(
            t.register_all(&[0; MAX_CPUS + 1]),
            Err(Error::CpuOutOfRange {
                cpu: MAX_CPUS,
                limit: MAX_CPUS
            })
        );
        assert_eq!((t.cpu_of(2), t.cpu_of(5), t.cpu_of(7)), (None, None, None));
        assert_eq!(t.register_all(&[2, 9, 1]), Ok(()));
        assert_eq!(
            (t.cpu_of(2), t.cpu_of(9), t.cpu_of(1)),
            (Some(cpu(0)), Some(cpu(1)), Some(cpu(2)))
        );
        assert_eq!(t.register_all(&[2, 9, 1]), Ok(()), "the same list again");
        assert_eq!(
            t.register_all(&[2, 9, 1, 4, 8]),
            Ok(()),
            "a longer list with the same start"
        );
        assert_eq!(
            t.register_all(&[2, 3]),
            Err(Error::CpuAlreadyRegistered { cpu: 1 })
        );
        assert_eq!(
            t.register_all(&[9, 2]),
            Err(Error::InvalidHardwareId { hw_id: 9 })
        );
        assert_eq!(
            (t.cpu_of(3), t.id(cpu(3)), t.id(cpu(4))),
            (None, Some(4), Some(8))
        );
        // A CPU registered alone, not first: a list that would give it
        // another id is refused before its earlier CPUs are recorded.
        let t = HwIdTable::<Low>::new();
        assert_eq!(t.register(1, 9), Ok(cpu(1)));
        assert_eq!(
            t.register_all(&[5, 3]),
            Err(Error::CpuAlreadyRegistered { cpu: 1 })
        );
        assert_eq!((t.cpu_of(5), t.id(cpu(0))), (None, None));
        // As many CPUs as the crate has: all of them.
        let t = HwIdTable::<Low>::new();
        let mut ids = [0u32; MAX_CPUS];
        for (i, id) in ids.iter_mut().enumerate() {
            *id = i as u32 * 3;
        }
        assert_eq!(t.register_all(&ids), Ok(()));
        assert_eq!(t.cpu_of(3 * (MAX_CPUS as u32 - 1)), Some(cpu(MAX_CPUS - 1)));
    }

    #[test]
    fn direct_and_scanned_ids_are_found_and_refused_alike() {
        let t = HwIdTable::<Low>::new();
        assert_eq!(t.register(0, 2), Ok(cpu(0)));
        assert_eq!(t.register(0, 2), Ok(cpu(0)));
        assert_eq!(t.register(1, 9), Ok(cpu(1)));
        assert_eq!(t.register(2, 2), Err(Error::InvalidHardwareId { hw_id: 2 }));
        assert_eq!(t.register(2, 9), Err(Error::InvalidHardwareId { hw_id: 9 }));
        assert_eq!(t.register(1, 3), Err(Error::CpuAlreadyRegistered { cpu: 1 }));
        assert_eq!(
            t.register(2, NO_HW_ID),
            Err(Error::InvalidHardwareId { hw_id: NO_HW_ID })
        );
        assert_eq!(
            t.register(MAX_CPUS, 1),
            Err(Error::CpuOutOfRange {
                cpu: MAX_CPUS,
                limit: MAX_CPUS
            })
        );
        assert_eq!(t.cpu_of(2), Some(cpu(0)));
        assert_eq!(t.cpu_of(9), Some(cpu(1)));
        assert_eq!(t.cpu_of(3), None);
        assert_eq!(t.cpu_of(8), None);
        assert_eq!(t.cpu_of(NO_HW_ID), None);
        assert_eq!(t.id(cpu(0)), Some(2));
        assert_eq!(t.id(cpu(1)), Some(9));
        assert_eq!(t.id(cpu(2)), None);
        // A scanned id registered at a high index is found too.
        assert_eq!(t.register(40, 77), Ok(cpu(40)));
        assert_eq!(t.cpu_of(77), Some(cpu(40)));
        assert!(t.online().is_empty());
        t.join(cpu(40));
        assert_eq!(t.online(), CpuSet::single(cpu(40)));
    }

    #[test]
    fn leaving_takes_one_cpu_out_of_the_online_set_and_says_whether_it_was_in() {
        let t = HwIdTable::<Low>::new();
        for (i, id) in [(0, 0), (1, 1), (70, 500)] {
            t.register(i, id).unwrap();
            t.join(cpu(i));
        }
        let all: CpuSet = [cpu(0), cpu(1), cpu(70)].into_iter().collect();
        assert_eq!(t.online(), all);
        assert!(t.leave(cpu(1)));
        assert_eq!(t.online(), all.difference(&CpuSet::single(cpu(1))));
        // Leaving twice, or a CPU that never joined: nothing to take out.
        assert!(!t.leave(cpu(1)));
        assert!(!t.leave(cpu(2)));
        // A CPU past the first word of the set.
        assert!(t.leave(cpu(70)));
        assert_eq!(t.online(), CpuSet::single(cpu(0)));
        // Registration is untouched: the CPU is still found, and can join
        // again.
        assert_eq!(t.cpu_of(1), Some(cpu(1)));
        assert_eq!(t.cpu_of(500), Some(cpu(70)));
        t.join(cpu(1));
        assert_eq!(t.online(), [cpu(0), cpu(1)].into_iter().collect());
    }
}
