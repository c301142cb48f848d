//! [`TeardownSummary`]: the counts of what a teardown did.

#[cfg(doc)]
use super::{TableHold, TeardownBacking};
#[cfg(doc)]
use crate::unmap::FreeFrames;
#[cfg(doc)]
use crate::Error;

/// Counts of what a teardown did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TeardownSummary {
    /// Present PTEs cleared: a 2 MiB or 1 GiB entry counts as one.
    pub pages_unmapped: usize,
    /// Data frames freed: those offered to [`FreeFrames::free_batch`] less
    /// those it left in, or added to, the vector (handed back). A huge
    /// frame is offered, and counted, once: as its first 4 KiB frame.
    pub data_freed: usize,
    /// Page-table frames freed, counted the same way for
    /// [`TeardownBacking::free_tables`].
    pub tables_freed: usize,
    /// Page-table frames moved into the backing's [`TableHold`] instead of
    /// freed, to wait for the CPUs that were lazy on the space at the
    /// flush ([`TeardownBacking::table_hold`]).
    pub tables_held: usize,
    /// Flushes (shootdowns) done: one per batch, one in all for a range
    /// that fits.
    pub flushes: usize,
    /// Of [`flushes`](Self::flushes), those that reached no CPU at all:
    /// no CPU ran the address space, the calling one included (a teardown
    /// of a space no CPU has loaded). From a CPU that runs the space this
    /// would mean the crate does not know it does, which the teardown
    /// refuses where the `Arch` can tell ([`Error::UntrackedRoot`]).
    pub flushes_reaching_no_cpu: usize,
    /// Batched data-frame free calls.
    pub data_free_calls: usize,
    /// Batched page-table free calls.
    pub table_free_calls: usize,
    /// IPI syncs done for lockless walkers.
    pub syncs: usize,
    /// IPIs sent by flushes and syncs.
    pub ipis_sent: usize,
}

/// Adds another teardown's counts (saturating), for totals over many.
impl core::ops::AddAssign for TeardownSummary {
    fn add_assign(&mut self, other: TeardownSummary) {
        self.pages_unmapped = self.pages_unmapped.saturating_add(other.pages_unmapped);
        self.data_freed = self.data_freed.saturating_add(other.data_freed);
        self.tables_freed = self.tables_freed.saturating_add(other.tables_freed);
        self.tables_held = self.tables_held.saturating_add(other.tables_held);
        self.flushes = self.flushes.saturating_add(other.flushes);
        self.flushes_reaching_no_cpu = self
            .flushes_reaching_no_cpu
            .saturating_add(other.flushes_reaching_no_cpu);
        self.data_free_calls = self.data_free_calls.saturating_add(other.data_free_calls);
        self.table_free_calls = self.table_free_calls.saturating_add(other.table_free_calls);
        self.syncs = self.syncs.saturating_add(other.syncs);
        self.ipis_sent = self.ipis_sent.saturating_add(other.ipis_sent);
    }
}
