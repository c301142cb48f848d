//! The deterministic cost model: fixed cycle charges per event, kept as
//! running totals per CPU and per kind of event.

use core::sync::atomic::{AtomicU64, Ordering};

/// Cycles charged per event. The defaults are round figures of the order
/// measured on x86 servers; they make ratios meaningful, not absolute times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CostModel {
    /// Sender's cost of one IPI (per target CPU).
    pub ipi_send: u64,
    /// Receiver's cost of taking one interrupt (entry, handler, exit).
    pub ipi_receive: u64,
    /// One single-page invalidation (invlpg).
    pub invlpg: u64,
    /// One full flush of an ASID or of everything (refills are charged
    /// separately, as they happen).
    pub full_flush: u64,
    /// One page-table walk that fills a TLB entry.
    pub tlb_refill: u64,
    /// One broadcast invalidation instruction.
    pub broadcast_invalidate: u64,
    /// The barrier that completes broadcast invalidations.
    pub broadcast_sync: u64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            ipi_send: 1_000,
            ipi_receive: 2_500,
            invlpg: 150,
            full_flush: 400,
            tlb_refill: 60,
            broadcast_invalidate: 120,
            broadcast_sync: 900,
        }
    }
}

/// What kind of work a charge pays for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostKind {
    /// Sending IPIs.
    IpiSend,
    /// Receiving IPIs.
    IpiReceive,
    /// Single-page invalidations.
    Invlpg,
    /// Full flushes.
    FullFlush,
    /// TLB refills.
    TlbRefill,
    /// Broadcast invalidations and their barrier.
    Broadcast,
}

/// Running totals of simulated cycles by kind (read with
/// [`MockMachine::costs`](super::MockMachine::costs)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CostTotals {
    /// Cycles spent sending IPIs.
    pub ipi_send: u64,
    /// Cycles spent taking IPIs.
    pub ipi_receive: u64,
    /// Cycles spent on single-page invalidations.
    pub invlpg: u64,
    /// Cycles spent on full flushes.
    pub full_flush: u64,
    /// Cycles spent refilling TLBs.
    pub tlb_refill: u64,
    /// Cycles spent on broadcast invalidation.
    pub broadcast: u64,
}

impl CostTotals {
    /// All cycles together.
    pub fn total(&self) -> u64 {
        self.ipi_send + self.ipi_receive + self.invlpg + self.full_flush + self.tlb_refill + self.broadcast
    }
}

#[derive(Debug, Default)]
pub(crate) struct CostMeter {
    by_kind: [AtomicU64; 6],
}

impl CostMeter {
    pub(super) fn charge(&self, kind: CostKind, cycles: u64) {
        self.by_kind[kind as usize].fetch_add(cycles, Ordering::Relaxed);
    }

    pub(super) fn reset(&self) {
        for k in &self.by_kind {
            k.store(0, Ordering::Relaxed);
        }
    }

    pub(super) fn totals(&self) -> CostTotals {
        let get = |k: CostKind| self.by_kind[k as usize].load(Ordering::Relaxed);
        CostTotals {
            ipi_send: get(CostKind::IpiSend),
            ipi_receive: get(CostKind::IpiReceive),
            invlpg: get(CostKind::Invlpg),
            full_flush: get(CostKind::FullFlush),
            tlb_refill: get(CostKind::TlbRefill),
            broadcast: get(CostKind::Broadcast),
        }
    }
}
