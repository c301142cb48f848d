//! The kernel services the operation model's drivers call: a batched free
//! that drops references (a frame goes back to the allocator when no
//! mapping and no holder is left), page-out, migration targets and table
//! frees, on the mock machine.

use std::collections::HashMap;
use std::vec::Vec;

use super::Io;
use crate::gather::TeardownBacking;
use crate::migrate::MigrateBacking;
use crate::pte::Frame;
use crate::reclaim::{PageOut, ReclaimBacking};
use crate::rmap::Rmap;
use crate::sim::{MockMachine, MockRmap, Model};
use crate::unmap::{FreeFrames, OwnedFrame, WritebackFrame};

/// Who holds a frame besides its mappings: batches, a reclaim or a
/// migration in progress, an I/O. A frame is freed when its count and its
/// map count are both zero.
pub(super) type Holders = HashMap<Frame, u32>;

/// Drops one hold on `frame`; frees it when nothing maps or holds it any
/// more. Returns whether it was freed.
pub(super) fn put<M: Model>(
    m: &MockMachine<M>,
    rmap: &MockRmap<'_, M>,
    holders: &mut Holders,
    frame: Frame,
) -> bool {
    if let Some(n) = holders.get_mut(&frame) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            holders.remove(&frame);
        }
    }
    release_if_unused(m, rmap, holders, frame)
}

/// Frees `frame` if no mapping and no holder is left.
pub(super) fn release_if_unused<M: Model>(
    m: &MockMachine<M>,
    rmap: &MockRmap<'_, M>,
    holders: &Holders,
    frame: Frame,
) -> bool {
    if holders.contains_key(&frame) || rmap.mapcount(frame) != 0 {
        return false;
    }
    if m.free_frame(frame).is_ok() {
        rmap.remove_frame(frame);
        true
    } else {
        false
    }
}

/// The services, for one driver call.
pub(super) struct OpsKernel<'d, 'r, 'm, M: Model> {
    pub(super) m: &'m MockMachine<M>,
    pub(super) rmap: &'r MockRmap<'m, M>,
    pub(super) holders: &'d mut Holders,
    /// Whether the handles given to the free are holds (reclaim, migration)
    /// rather than the mappings' own claims (teardown).
    pub(super) handles_are_holds: bool,
    pub(super) io: Io,
    pub(super) refuse_free: bool,
    pub(super) no_memory: bool,
    /// Every frame the batched free took, in order: what the driver's
    /// bookkeeping checks a reclaim or a pool release against.
    pub(super) freed: Vec<Frame>,
}

impl<'d, 'r, 'm, M: Model> OpsKernel<'d, 'r, 'm, M> {
    /// The kernel a reclaim runs with: the handles are holds, write-out as
    /// `io` says, frees refused when `refuse_free`.
    pub(super) fn for_reclaim(
        m: &'m MockMachine<M>,
        rmap: &'r MockRmap<'m, M>,
        holders: &'d mut Holders,
        io: Io,
        refuse_free: bool,
    ) -> Self {
        Self::new(m, rmap, holders, true, io, refuse_free, false)
    }

    /// The kernel a migration runs with: the handles are holds, target
    /// frames refused when `no_memory`.
    pub(super) fn for_migration(
        m: &'m MockMachine<M>,
        rmap: &'r MockRmap<'m, M>,
        holders: &'d mut Holders,
        no_memory: bool,
    ) -> Self {
        Self::new(m, rmap, holders, true, Io::Synchronous, false, no_memory)
    }

    /// The kernel a teardown frees through: the handles it frees are the
    /// mappings' own claims, written synchronously, every free accepted.
    pub(super) fn for_teardown(
        m: &'m MockMachine<M>,
        rmap: &'r MockRmap<'m, M>,
        holders: &'d mut Holders,
    ) -> Self {
        Self::new(m, rmap, holders, false, Io::Synchronous, false, false)
    }

    pub(super) fn new(
        m: &'m MockMachine<M>,
        rmap: &'r MockRmap<'m, M>,
        holders: &'d mut Holders,
        handles_are_holds: bool,
        io: Io,
        refuse_free: bool,
        no_memory: bool,
    ) -> Self {
        OpsKernel {
            m,
            rmap,
            holders,
            handles_are_holds,
            io,
            refuse_free,
            no_memory,
            freed: Vec::new(),
        }
    }
}

impl<M: Model> FreeFrames for OpsKernel<'_, '_, '_, M> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        if self.refuse_free {
            return;
        }
        // Every handle's claim is dropped; the frame itself goes when it
        // was the last one.
        let mut taken: Vec<OwnedFrame> = Vec::new();
        while let Some(f) = frames.pop() {
            taken.push(f);
        }
        for f in taken {
            let frame = f.into_frame();
            self.freed.push(frame);
            if self.handles_are_holds {
                put(self.m, self.rmap, self.holders, frame);
            } else {
                release_if_unused(self.m, self.rmap, self.holders, frame);
            }
        }
    }
}

impl<M: Model> ReclaimBacking for OpsKernel<'_, '_, '_, M> {
    fn is_dirty(&self, frame: Frame) -> bool {
        self.m.frame_dirty(frame).unwrap_or(false)
    }

    fn page_out(&mut self, frame: WritebackFrame<'_>) -> PageOut {
        if self.io == Io::Failing || self.m.start_io(frame.frame()).is_err() {
            return PageOut::Failed;
        }
        match self.io {
            Io::Synchronous if self.m.end_io(frame.frame()).is_ok() => PageOut::Written,
            _ => PageOut::Queued,
        }
    }
}

impl<M: Model> MigrateBacking for OpsKernel<'_, '_, '_, M> {
    fn alloc_target(&mut self, _old: Frame) -> Option<OwnedFrame> {
        if self.no_memory {
            return None;
        }
        let frame = self.m.alloc_frame().ok()?;
        // SAFETY: fresh from the allocator: the handle is its only claim
        // (dropped once the frame is mapped: the mapping keeps it).
        Some(unsafe { OwnedFrame::new(frame) })
    }

    fn copy_frame(&mut self, from: WritebackFrame<'_>, to: &OwnedFrame) {
        let _ = self.m.copy_frame(from.frame(), to.frame());
    }

    fn move_mappings(&mut self, old: Frame, new: Frame) {
        self.rmap.move_frame(old, new);
    }
}

impl<M: Model> TeardownBacking for OpsKernel<'_, '_, '_, M> {
    fn set_dirty(&mut self, frame: Frame) {
        let _ = self.m.set_frame_dirty(frame);
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        let mut kept: heapless::Vec<OwnedFrame, N> = heapless::Vec::new();
        while let Some(t) = tables.pop() {
            if self.m.free_frame(t.frame()).is_err() {
                // At most what `tables` held.
                let _ = kept.push(t);
            }
        }
        *tables = kept;
    }
}
