//! Counters and trace events (seed 000, patch 1: every sender of a flush
//! IPI can be identified).
//!
//! Counters are relaxed atomics in the machine's [`TlbShootdown`](crate::TlbShootdown);
//! trace events go to [`Arch::trace`](crate::Arch::trace), whose default is
//! empty, so a kernel without a tracer pays nothing for them.

use crate::cpuset::CpuId;
use crate::sync::{maybe_const_fn, AtomicU64, Ordering};

/// Why a flush happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlushReason {
    /// A context switch dropped (part of) this CPU's TLB.
    TaskSwitch,
    /// This CPU flushed on another CPU's request (IPI or coalesced request
    /// taken while waiting).
    RemoteShootdown,
    /// This CPU flushed pages for its own shootdown.
    LocalShootdown,
    /// This CPU flushed whole address spaces for its own shootdown.
    LocalMmShootdown,
    /// This CPU is about to send flush IPIs to other CPUs.
    RemoteSendIpi,
    /// This CPU dropped its whole TLB on its own, for frames pooled in a
    /// [`FramePool`](crate::FramePool) ([`quiescent_flush`](crate::quiescent_flush),
    /// or the releasing CPU itself).
    Quiescent,
    /// This CPU flushed an ASID whose generation moved while it did not
    /// run it (or ran it lazily), before using it again.
    CatchUp,
}

/// How much a traced flush covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlushExtent {
    /// This many single pages.
    Pages(usize),
    /// Whole address spaces (or everything).
    All,
}

/// One traced flush.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceEvent {
    /// The CPU that performed (or, for [`FlushReason::RemoteSendIpi`],
    /// requested) the flush.
    pub cpu: CpuId,
    /// Why.
    pub reason: FlushReason,
    /// How much.
    pub extent: FlushExtent,
}

/// Live counters, shared by all CPUs of one machine.
#[derive(Debug, Default)]
pub struct TlbStats {
    shootdowns: AtomicU64,
    ipis_sent: AtomicU64,
    flushes_received: AtomicU64,
    local_page_flushes: AtomicU64,
    local_full_flushes: AtomicU64,
    pages_deferred: AtomicU64,
    batches_flushed: AtomicU64,
    task_switches: AtomicU64,
    broadcasts: AtomicU64,
    quiescent_flushes: AtomicU64,
    frames_pooled: AtomicU64,
    frames_released_by_passes: AtomicU64,
    catch_ups: AtomicU64,
    generations_granted: AtomicU64,
}

/// A copy of the counters at one moment (each read separately).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TlbStatsSnapshot {
    /// Shootdowns started (one per flush point that had anything to flush).
    pub shootdowns: u64,
    /// Flush IPIs sent, one per target CPU interrupted.
    pub ipis_sent: u64,
    /// Requests from other CPUs carried out, syncs included (a coalesced
    /// IPI can carry several; a waiting initiator also takes requests
    /// without an IPI).
    pub flushes_received: u64,
    /// Single-page local invalidations (invlpg and equivalents).
    pub local_page_flushes: u64,
    /// Local flushes of a whole ASID or of everything.
    pub local_full_flushes: u64,
    /// Pages whose flush was deferred into a batch.
    pub pages_deferred: u64,
    /// Batches flushed.
    pub batches_flushed: u64,
    /// Address-space switches through [`switch_mm`](crate::switch_mm).
    pub task_switches: u64,
    /// Shootdowns carried out by broadcast invalidation instead of IPIs
    /// (counted in `shootdowns` too; see
    /// [`Arch::prefer_broadcast`](crate::Arch::prefer_broadcast)).
    pub broadcasts: u64,
    /// Local flushes done by [`quiescent_flush`](crate::quiescent_flush)
    /// because a pooled generation counted the CPU among its targets.
    pub quiescent_flushes: u64,
    /// Frames moved into a [`FramePool`](crate::FramePool) with their flush
    /// deferred.
    pub frames_pooled: u64,
    /// Pooled frames released without a shootdown, because every CPU that
    /// could cache them had flushed past their epoch.
    pub frames_released_by_passes: u64,
    /// Local flushes of one ASID made because its generation moved while
    /// the CPU did not run it, or ran it lazily (at [`switch_mm`](crate::switch_mm)
    /// or [`leave_lazy_tlb`](crate::leave_lazy_tlb)): flushes that would
    /// otherwise have been IPIs.
    pub catch_ups: u64,
    /// CPUs a [`TlbFlushUnmapBatch`](crate::TlbFlushUnmapBatch) flush left
    /// out on a tagged TLB because they held none of its entries, credited
    /// with the flush's generation so that their next load of the address
    /// space needs no catch-up for it.
    pub generations_granted: u64,
}

/// The counter a crate-internal event increments.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Counter {
    Shootdowns,
    IpisSent,
    FlushesReceived,
    LocalPageFlushes,
    LocalFullFlushes,
    PagesDeferred,
    BatchesFlushed,
    TaskSwitches,
    Broadcasts,
    QuiescentFlushes,
    FramesPooled,
    FramesReleasedByPasses,
    CatchUps,
    GenerationsGranted,
}

impl TlbStats {
    maybe_const_fn! {
        /// All counters at zero, usable in a `static`.
        pub fn new() -> Self {
            TlbStats {
                shootdowns: AtomicU64::new(0),
                ipis_sent: AtomicU64::new(0),
                flushes_received: AtomicU64::new(0),
                local_page_flushes: AtomicU64::new(0),
                local_full_flushes: AtomicU64::new(0),
                pages_deferred: AtomicU64::new(0),
                batches_flushed: AtomicU64::new(0),
                task_switches: AtomicU64::new(0),
                broadcasts: AtomicU64::new(0),
                quiescent_flushes: AtomicU64::new(0),
                frames_pooled: AtomicU64::new(0),
                frames_released_by_passes: AtomicU64::new(0),
                catch_ups: AtomicU64::new(0),
                generations_granted: AtomicU64::new(0),
            }
        }
    }

    fn counter(&self, which: Counter) -> &AtomicU64 {
        match which {
            Counter::Shootdowns => &self.shootdowns,
            Counter::IpisSent => &self.ipis_sent,
            Counter::FlushesReceived => &self.flushes_received,
            Counter::LocalPageFlushes => &self.local_page_flushes,
            Counter::LocalFullFlushes => &self.local_full_flushes,
            Counter::PagesDeferred => &self.pages_deferred,
            Counter::BatchesFlushed => &self.batches_flushed,
            Counter::TaskSwitches => &self.task_switches,
            Counter::Broadcasts => &self.broadcasts,
            Counter::QuiescentFlushes => &self.quiescent_flushes,
            Counter::FramesPooled => &self.frames_pooled,
            Counter::FramesReleasedByPasses => &self.frames_released_by_passes,
            Counter::CatchUps => &self.catch_ups,
            Counter::GenerationsGranted => &self.generations_granted,
        }
    }

    /// Sets every counter back to zero (the mock machine's reset).
    #[cfg(feature = "mock")]
    pub(crate) fn reset(&self) {
        for c in [
            Counter::Shootdowns,
            Counter::IpisSent,
            Counter::FlushesReceived,
            Counter::LocalPageFlushes,
            Counter::LocalFullFlushes,
            Counter::PagesDeferred,
            Counter::BatchesFlushed,
            Counter::TaskSwitches,
            Counter::Broadcasts,
            Counter::QuiescentFlushes,
            Counter::FramesPooled,
            Counter::FramesReleasedByPasses,
            Counter::CatchUps,
            Counter::GenerationsGranted,
        ] {
            self.counter(c).store(0, Ordering::Relaxed);
        }
    }

    pub(crate) fn add(&self, which: Counter, n: u64) {
        self.counter(which).fetch_add(n, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> TlbStatsSnapshot {
        let get = |c| self.counter(c).load(Ordering::Relaxed);
        TlbStatsSnapshot {
            shootdowns: get(Counter::Shootdowns),
            ipis_sent: get(Counter::IpisSent),
            flushes_received: get(Counter::FlushesReceived),
            local_page_flushes: get(Counter::LocalPageFlushes),
            local_full_flushes: get(Counter::LocalFullFlushes),
            pages_deferred: get(Counter::PagesDeferred),
            batches_flushed: get(Counter::BatchesFlushed),
            task_switches: get(Counter::TaskSwitches),
            broadcasts: get(Counter::Broadcasts),
            quiescent_flushes: get(Counter::QuiescentFlushes),
            frames_pooled: get(Counter::FramesPooled),
            frames_released_by_passes: get(Counter::FramesReleasedByPasses),
            catch_ups: get(Counter::CatchUps),
            generations_granted: get(Counter::GenerationsGranted),
        }
    }
}

impl TlbStatsSnapshot {
    /// The counts accumulated between `earlier` and `self`.
    #[must_use]
    pub fn since(&self, earlier: &TlbStatsSnapshot) -> TlbStatsSnapshot {
        TlbStatsSnapshot {
            shootdowns: self.shootdowns.wrapping_sub(earlier.shootdowns),
            ipis_sent: self.ipis_sent.wrapping_sub(earlier.ipis_sent),
            flushes_received: self.flushes_received.wrapping_sub(earlier.flushes_received),
            local_page_flushes: self.local_page_flushes.wrapping_sub(earlier.local_page_flushes),
            local_full_flushes: self.local_full_flushes.wrapping_sub(earlier.local_full_flushes),
            pages_deferred: self.pages_deferred.wrapping_sub(earlier.pages_deferred),
            batches_flushed: self.batches_flushed.wrapping_sub(earlier.batches_flushed),
            task_switches: self.task_switches.wrapping_sub(earlier.task_switches),
            broadcasts: self.broadcasts.wrapping_sub(earlier.broadcasts),
            quiescent_flushes: self.quiescent_flushes.wrapping_sub(earlier.quiescent_flushes),
            frames_pooled: self.frames_pooled.wrapping_sub(earlier.frames_pooled),
            frames_released_by_passes: self
                .frames_released_by_passes
                .wrapping_sub(earlier.frames_released_by_passes),
            catch_ups: self.catch_ups.wrapping_sub(earlier.catch_ups),
            generations_granted: self.generations_granted.wrapping_sub(earlier.generations_granted),
        }
    }
}
