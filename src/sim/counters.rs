//! Costs, counters and the trace log of a simulated machine.

use core::sync::atomic::Ordering;
use std::vec::Vec;

use super::{lock, CostKind, CostTotals, CpuState, IpiHook, MockMachine, Model};
use crate::cpuset::CpuId;
use crate::stats::{TlbStatsSnapshot, TraceEvent};
use crate::Error;

impl<M: Model> MockMachine<M> {
    /// Cycle totals by kind.
    pub fn costs(&self) -> CostTotals {
        self.costs.totals()
    }

    pub(crate) fn checked_state(&self, cpu: CpuId) -> Result<&CpuState, Error> {
        self.cpus.get(cpu.index()).ok_or(Error::CpuOutOfRange {
            cpu: cpu.index(),
            limit: self.cpus.len(),
        })
    }

    /// Cycles charged to one CPU, or [`Error::CpuOutOfRange`] for a CPU
    /// this machine does not have.
    pub fn cpu_cycles(&self, cpu: CpuId) -> Result<u64, Error> {
        Ok(self.checked_state(cpu)?.cycles.load(Ordering::Relaxed))
    }

    /// Flush interrupts `cpu` has taken (spurious ones included), or
    /// [`Error::CpuOutOfRange`] for a CPU this machine does not have.
    pub fn interrupts_taken(&self, cpu: CpuId) -> Result<u64, Error> {
        Ok(self.checked_state(cpu)?.interrupts.load(Ordering::Relaxed))
    }

    /// IPIs the machine delivered or queued, counted by the machine itself
    /// (independently of the crate's own counters).
    pub fn ipis_sent(&self) -> u64 {
        self.ipis_sent.load(Ordering::Relaxed)
    }

    /// The crate's counters for this machine.
    pub fn stats(&self) -> TlbStatsSnapshot {
        self.shootdown.stats()
    }

    /// Installs (or removes) code that every CPU runs when it takes the
    /// flush interrupt, before the crate's handler: a way to model other
    /// users of the same vector, such as a baseline flush protocol in a
    /// benchmark.
    pub fn set_ipi_hook(&self, hook: Option<IpiHook<M>>) {
        *lock(&self.ipi_hook) = hook;
    }

    /// Starts or stops recording [`TraceEvent`]s.
    pub fn set_tracing(&self, on: bool) {
        self.tracing.store(on, Ordering::Relaxed);
    }

    /// The trace events recorded so far, emptying the log.
    pub fn take_trace(&self) -> Vec<TraceEvent> {
        core::mem::take(&mut *lock(&self.trace_log))
    }

    pub(crate) fn charge(&self, cpu: CpuId, kind: CostKind, cycles: u64) {
        self.state(cpu).cycles.fetch_add(cycles, Ordering::Relaxed);
        self.costs.charge(kind, cycles);
    }
}
