//! One pooled generation: its epoch, the CPUs it had to reach, its
//! frames, and the address spaces of its mappings, with the rule that says
//! when a CPU is clear of it.

use crate::arch::Asid;
use crate::cpuset::{CpuId, CpuSet};
use crate::generation::running;
use crate::percpu::TlbShootdown;
use crate::request::MAX_FLUSH_ASIDS;

/// One batch's worth of pooled frames: the epoch opened after their PTEs
/// were cleared, the CPUs that could cache them, how many there are, and
/// the ASIDs of their mappings (`many`: more than it tells apart).
/// `aged`: every CPU it had to reach had passed its epoch when it was
/// pooled (for [`PoolReleases`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct Generation {
    pub(super) epoch: u64,
    pub(super) targets: CpuSet,
    pub(super) frames: usize,
    pub(super) asids: [Asid; MAX_FLUSH_ASIDS],
    pub(super) nr_asids: usize,
    pub(super) many: bool,
    pub(super) aged: bool,
}

impl Generation {
    pub(super) fn names(&self, asid: Asid) -> bool {
        self.many || self.asids[..self.nr_asids].contains(&asid)
    }

    /// Adds `other`'s ASIDs to this generation's.
    pub(super) fn merge_asids(&mut self, other: &Generation) {
        self.many |= other.many;
        for &a in &other.asids[..other.nr_asids] {
            if self.names(a) {
                continue;
            }
            match self.asids.get_mut(self.nr_asids) {
                Some(slot) => {
                    *slot = a;
                    self.nr_asids += 1;
                }
                None => self.many = true,
            }
        }
    }

    /// Whether `cpu` holds no entry for this generation's frames that it
    /// could use before flushing it: it flushed everything past the
    /// generation's epoch, or it runs none of the generation's address
    /// spaces now (a lazy CPU runs none; a CPU in the middle of a switch
    /// runs both the space it leaves and the one it loads), so that it
    /// flushes any of them by generation before it loads it again
    /// (contract rule 2's exact form), or it flushed the one it runs past
    /// the epoch.
    ///
    /// Sound against a CPU switching concurrently: the batch advanced its
    /// spaces' generations when it recorded the pages, before this is
    /// asked; a CPU records the ASID it loads, and clears its lazy mark,
    /// before it reads the generation. So if this reads the old state, the
    /// CPU's generation check sees the advance and flushes.
    pub(super) fn clear_on(&self, state: &TlbShootdown, cpu: CpuId) -> bool {
        if state.passed_epoch(cpu) >= self.epoch {
            return true;
        }
        match running(state, cpu, |a| self.names(a)) {
            (None, None) => true,
            // It runs one of the spaces: clear if it flushed it past the
            // epoch since.
            (Some(a), None) => state.flushed_generation(cpu, a) >= self.epoch,
            _ => false,
        }
    }
}
