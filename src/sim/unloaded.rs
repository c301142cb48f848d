//! Entries of ASIDs a CPU does not run: contract rule 2 in its exact form
//! for tagged TLBs. Such an entry cannot be used until the CPU loads its
//! ASID again, so a frame freed while only such entries cache it is no
//! violation at the free. The oracle remembers the entries instead, and
//! judges them at the load: one still in the TLB when its ASID is loaded
//! again is a [`Violation::LoadedWithStale`] (the CPU skipped its catch-up,
//! and now translates to a freed, or reused, frame). The rules are
//! documented for users in [`arch::mock`](crate::arch::mock#tagged-tlbs-and-generations).

use std::vec::Vec;

use super::{lock, MockCpu, MockMachine, Model, TlbEntry, Violation, WalkEntry};
use crate::arch::Asid;
use crate::cpuset::CpuId;
use crate::pte::{Frame, PAGE_SHIFT};

impl<M: Model> MockMachine<M> {
    /// The free-time check's exception for tagged TLBs: remembers `entry`
    /// (cached by `cpu` for `frame`, just freed) when it is a non-global
    /// entry of an ASID `cpu` has not loaded, and returns whether it did;
    /// the caller judges the entry otherwise.
    pub(crate) fn defer_to_load(&self, cpu: CpuId, entry: &TlbEntry, frame: Frame) -> bool {
        if !self.config.tagged_tlb || entry.global || entry.page_of(frame).is_none() {
            return false;
        }
        let state = self.state(cpu);
        let loaded = lock(&state.loaded).map(|(a, _)| a);
        if loaded == Some(entry.asid) {
            return false;
        }
        let mut remembered = lock(&state.unloaded);
        if !remembered.contains(entry) {
            remembered.push(*entry);
        }
        true
    }
}

impl<M: Model> MockMachine<M> {
    /// As [`defer_to_load`](Self::defer_to_load), for a walk-cache entry
    /// pointing at a page-table frame being freed: a paging-structure
    /// cache entry is tagged like a TLB entry, and used only under its
    /// ASID.
    pub(crate) fn defer_walk_to_load(&self, cpu: CpuId, walk: &WalkEntry) -> bool {
        if !self.config.tagged_tlb || walk.asid.is_kernel() {
            return false;
        }
        let state = self.state(cpu);
        let loaded = lock(&state.loaded).map(|(a, _)| a);
        if loaded == Some(walk.asid) {
            return false;
        }
        let mut remembered = lock(&state.unloaded_walks);
        if !remembered.contains(walk) {
            remembered.push(*walk);
        }
        true
    }
}

impl<M: Model> MockCpu<'_, M> {
    /// The load-time judgement: called by the mock's
    /// `switch_address_space` once `asid` is loaded. Records a
    /// [`Violation::LoadedWithStale`] for every remembered entry of `asid`
    /// still in the TLB (a [`Violation::LoadedWithStaleWalk`] for a walk
    /// entry), forgets every remembered entry of `asid` (and any
    /// that left the TLB), and returns how many it recorded.
    pub(crate) fn judge_load(&self, asid: Asid) -> usize {
        let remembered: Vec<TlbEntry> = core::mem::take(&mut *lock(&self.state().unloaded));
        let (now, later): (Vec<TlbEntry>, Vec<TlbEntry>) =
            remembered.into_iter().partition(|e| e.asid == asid);
        let (still, kept): (Vec<TlbEntry>, Vec<TlbEntry>) = {
            let tlb = lock(&self.state().tlb);
            let in_tlb = |e: &TlbEntry| tlb.entries().any(|t| t.same_translation(e));
            let still = now.into_iter().filter(|e| in_tlb(e)).collect();
            let kept = later.into_iter().filter(|e| in_tlb(e)).collect();
            (still, kept)
        };
        lock(&self.state().unloaded).extend(kept);
        let walks: Vec<WalkEntry> = core::mem::take(&mut *lock(&self.state().unloaded_walks));
        let (walks_now, walks_later): (Vec<WalkEntry>, Vec<WalkEntry>) =
            walks.into_iter().partition(|w| w.asid == asid);
        let (walks_still, walks_kept): (Vec<WalkEntry>, Vec<WalkEntry>) = {
            let tlb = lock(&self.state().tlb);
            let cached = |w: &WalkEntry| tlb.walks().any(|t| t == w);
            let still = walks_now.into_iter().filter(|w| cached(w)).collect();
            let kept = walks_later.into_iter().filter(|w| cached(w)).collect();
            (still, kept)
        };
        lock(&self.state().unloaded_walks).extend(walks_kept);
        for w in &walks_still {
            self.machine.record(Violation::LoadedWithStaleWalk {
                cpu: self.id,
                table: w.table,
            });
        }
        for e in &still {
            self.machine.record(Violation::LoadedWithStale {
                cpu: self.id,
                frame: e.frame,
                va: e.vpn << PAGE_SHIFT,
                writable: e.writable,
            });
        }
        still.len() + walks_still.len()
    }
}
