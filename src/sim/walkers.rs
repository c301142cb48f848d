//! Lockless page-table walkers (the fast-GUP pattern) and the grace
//! period that waits for them.

use core::sync::atomic::Ordering;
use std::sync::Arc;
use std::vec::Vec;

use super::{lock, Delivery, Fault, MockCpu, MockMachine, Model, X86Like};
use crate::cpuset::CpuId;
use crate::mm::MmTlbState;
use crate::pte::{Frame, Pte};

impl<M: Model> MockMachine<M> {
    /// Lockless walks in progress, as (CPU, table frame).
    pub fn lockless_walkers(&self) -> Vec<(CpuId, Frame)> {
        lock(&self.walkers).values().copied().collect()
    }

    /// A grace period for lockless walkers: returns once every lockless walk
    /// that was in progress when it was called has ended, taking `cpu`'s
    /// interrupts meanwhile. A kernel's RCU-style wait, for
    /// [`TableFreePolicy::GracePeriod`](crate::TableFreePolicy::GracePeriod).
    pub fn wait_for_walkers(&self, cpu: &MockCpu<'_, M>) {
        let started: Vec<u64> = lock(&self.walkers).keys().copied().collect();
        while lock(&self.walkers).keys().any(|k| started.contains(k)) {
            cpu.poll_interrupts();
            std::thread::yield_now();
        }
    }
}

impl<'m, M: Model> MockCpu<'m, M> {
    /// Starts a lockless walk of the page table that maps `va` in this CPU's
    /// address space, the way Linux's fast GUP walks: interrupts off, no
    /// lock, so that only an IPI sync or a grace period can tell when it is
    /// over. The walk lasts until the returned guard is dropped. Errors:
    /// [`Fault::NotMapped`] when no table maps `va`;
    /// [`Fault::SynchronousDelivery`] on a machine whose IPIs are delivered
    /// synchronously, which does not model interrupts held off (use
    /// [`MockConfig::threaded`](super::MockConfig::threaded)).
    pub fn begin_lockless_walk(&self, va: u64) -> Result<LocklessWalk<'m, M>, Fault> {
        if self.machine.config.delivery == Delivery::Synchronous {
            return Err(Fault::SynchronousDelivery);
        }
        let mm = self.current_mm().ok_or(Fault::NotMapped { va })?;
        let table = self.machine.leaf_table(&mm, va).ok_or(Fault::NotMapped { va })?;
        self.disable_interrupts();
        let id = self.machine.next_walk.fetch_add(1, Ordering::Relaxed);
        lock(&self.machine.walkers).insert(id, (self.id, table));
        Ok(LocklessWalk {
            cpu: *self,
            mm,
            table,
            id,
        })
    }
}

/// A lockless page-table walk in progress (see
/// [`MockCpu::begin_lockless_walk`]); dropping it ends the walk and
/// re-enables interrupts.
pub struct LocklessWalk<'m, M: Model = X86Like> {
    pub(crate) cpu: MockCpu<'m, M>,
    pub(crate) mm: Arc<MmTlbState>,
    pub(crate) table: Frame,
    pub(crate) id: u64,
}

impl<M: Model> LocklessWalk<'_, M> {
    /// The page-table frame being walked.
    pub fn table(&self) -> Frame {
        self.table
    }

    /// Reads the entry for `va` through the walked table, as the walker
    /// would (empty once the table was detached).
    pub fn read(&self, va: u64) -> Pte {
        self.cpu.machine.pte(&self.mm, va).unwrap_or(Pte::EMPTY)
    }
}

impl<M: Model> Drop for LocklessWalk<'_, M> {
    fn drop(&mut self) {
        lock(&self.cpu.machine.walkers).remove(&self.id);
        self.cpu.enable_interrupts();
    }
}
