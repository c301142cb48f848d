//! Lazy CPUs: the per-CPU mark, the access check that keeps a lazy CPU
//! out of user memory, and the oracle's deferred judgement of the entries
//! it still caches for frames freed meanwhile. The rules are documented
//! for users in [`arch::mock`](crate::arch::mock#lazy-cpus).

use std::vec::Vec;

use super::{lock, Fault, MockCpu, MockError, MockMachine, Model, TlbEntry, Violation};
use crate::arch::Asid;
use crate::cpuset::{CpuId, CpuSet};
use crate::pte::{Frame, PAGE_SHIFT};

/// One CPU's lazy mode: the address space it is lazy on, and the entries
/// of that space it cached when their frames were freed.
#[derive(Debug)]
pub(crate) struct Lazy {
    asid: Asid,
    root: u64,
    stale: Vec<TlbEntry>,
}

impl Lazy {
    /// Whether `e` came from the address space this CPU is lazy on.
    fn covers(&self, e: &TlbEntry) -> bool {
        !e.global && e.asid == self.asid && e.space == self.root
    }
}

impl<M: Model> MockCpu<'_, M> {
    /// Marks this CPU lazy on the user address space it has loaded (see
    /// [the rules](crate::arch::mock#lazy-cpus)). A CPU already lazy stays
    /// so, on the same space, and keeps what the oracle remembers.
    ///
    /// Errors (nothing changes): [`MockError::NoUserSpace`] when the CPU has
    /// no user address space loaded (none, or the kernel's).
    pub fn enter_lazy(&self) -> Result<(), MockError> {
        let loaded = *lock(&self.state().loaded);
        let (asid, root) = loaded
            .filter(|(a, _)| !a.is_kernel())
            .ok_or(MockError::NoUserSpace)?;
        let mut lazy = lock(&self.state().lazy);
        if lazy.is_none() {
            *lazy = Some(Lazy {
                asid,
                root,
                stale: Vec::new(),
            });
        }
        // The crate's own mark, as `enter_lazy_tlb` sets it: flushes of the
        // space skip this CPU from here on.
        self.machine.shootdown.set_lazy(self.id, true);
        Ok(())
    }

    /// The end of lazy mode by a switch to another address space: the
    /// entries the oracle remembered are now of an ASID this CPU has not
    /// loaded, judged when it loads that ASID again (an untagged TLB has
    /// dropped them already).
    pub(crate) fn lazy_switched_away(&self) {
        let _transition = self.machine.transition();
        if let Some(lazy) = lock(&self.state().lazy).take() {
            if self.machine.config.tagged_tlb {
                lock(&self.state().unloaded).extend(lazy.stale);
            }
        }
    }

    /// Ends this CPU's lazy mode: it may run user code again, in the
    /// address space it has loaded now. Records a
    /// [`Violation::LazyResumedWithStale`] for every entry the oracle
    /// remembered (its frame was freed while this CPU was lazy) that is
    /// still in the TLB, and returns how many it recorded (0 for a CPU that
    /// was not lazy). Catch up and switch first, then leave: a switch of an
    /// untagged TLB drops the old space's entries.
    pub fn leave_lazy(&self) -> usize {
        let _transition = self.machine.transition();
        self.machine.shootdown.set_lazy(self.id, false);
        let Some(lazy) = lock(&self.state().lazy).take() else {
            return 0;
        };
        let still: Vec<TlbEntry> = {
            let tlb = lock(&self.state().tlb);
            lazy.stale
                .into_iter()
                .filter(|s| tlb.entries().any(|e| e.same_translation(s)))
                .collect()
        };
        for e in &still {
            self.machine.record(Violation::LazyResumedWithStale {
                cpu: self.id,
                frame: e.frame,
                va: e.vpn << PAGE_SHIFT,
                writable: e.writable,
            });
        }
        still.len()
    }

    /// Whether this CPU is lazy.
    pub fn is_lazy(&self) -> bool {
        lock(&self.state().lazy).is_some()
    }

    /// The access check of a lazy CPU: [`Fault::LazyUserAccess`] when an
    /// access to `va` would translate through the user address space it is
    /// lazy on (a non-global TLB entry, or a user page-table entry that is
    /// not empty). A lazy CPU that has loaded another root already (a
    /// switch away, inside its CR3 window: the switch hook) runs that one,
    /// and its accesses there are the hardware's fills from the new tables.
    pub(crate) fn lazy_access_check(&self, va: u64, loaded: Option<(Asid, u64)>) -> Result<(), Fault> {
        let lazy_root = lock(&self.state().lazy).as_ref().map(|l| l.root);
        if lazy_root.is_none() || loaded.map(|(_, root)| root) != lazy_root {
            return Ok(());
        }
        let vpn = va >> PAGE_SHIFT;
        let asid = loaded.map_or(Asid::KERNEL, |(a, _)| a);
        let user_hit = lock(&self.state().tlb).peek(asid, vpn).is_some_and(|e| !e.global);
        let user_pte = loaded.is_some_and(|(_, root)| {
            self.machine
                .with_leaf(root, vpn, |p, _| {
                    p.load(core::sync::atomic::Ordering::SeqCst) != 0
                })
                .unwrap_or(false)
        });
        if user_hit || user_pte {
            Err(Fault::LazyUserAccess { va })
        } else {
            Ok(())
        }
    }
}

impl<M: Model> MockMachine<M> {
    /// The CPUs that are lazy now ([`MockCpu::enter_lazy`]).
    pub fn lazy_cpus(&self) -> CpuSet {
        let mut set = CpuSet::new();
        for cpu in self.cpus() {
            if cpu.is_lazy() {
                set.insert(cpu.id());
            }
        }
        set
    }

    /// The free-time check's exception for lazy CPUs: remembers `entry`
    /// (cached by `cpu` for `frame`, just freed) when `cpu` is lazy on the
    /// space it came from, and returns whether it did; the caller records
    /// [`Violation::FreedWhileCached`] otherwise.
    pub(crate) fn defer_to_lazy(&self, cpu: CpuId, entry: &TlbEntry, frame: Frame) -> bool {
        let mut lazy = lock(&self.state(cpu).lazy);
        match lazy.as_mut() {
            Some(l) if l.covers(entry) && entry.page_of(frame).is_some() => {
                if !l.stale.iter().any(|s| s.same_translation(entry)) {
                    l.stale.push(*entry);
                }
                true
            }
            _ => false,
        }
    }
}
