//! The kernel services the huge space's drivers call: frees (a 2 MiB
//! frame whole when handed its first frame, as Linux frees a folio),
//! table frees, migration targets.

use std::vec::Vec;

use super::HUGE;
use crate::gather::TeardownBacking;
use crate::migrate::MigrateBacking;
use crate::pte::Frame;
use crate::sim::{MockMachine, Model};
use crate::unmap::{FreeFrames, OwnedFrame, WritebackFrame};

/// Frees `frame`: the whole 2 MiB frame when `whole` lists it (and then no
/// more), else the one 4 KiB frame.
pub(super) fn free_frame_or_huge<M: Model>(m: &MockMachine<M>, whole: &mut Vec<Frame>, frame: Frame) {
    if let Some(i) = whole.iter().position(|&f| f == frame) {
        whole.swap_remove(i);
        for piece in 0..HUGE.base_pages() {
            let _ = m.free_frame(Frame(frame.0 + piece));
        }
    } else {
        let _ = m.free_frame(frame);
    }
}

/// The services, for one driver call.
pub(super) struct HugeKernel<'d, 'm, M: Model> {
    pub(super) m: &'m MockMachine<M>,
    /// The 2 MiB frames held whole (their first frames).
    pub(super) whole: &'d mut Vec<Frame>,
}

impl<M: Model> FreeFrames for HugeKernel<'_, '_, M> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        while let Some(f) = frames.pop() {
            free_frame_or_huge(self.m, self.whole, f.into_frame());
        }
    }
}

impl<M: Model> TeardownBacking for HugeKernel<'_, '_, M> {
    fn set_dirty(&mut self, frame: Frame) {
        let _ = self.m.set_frame_dirty(frame);
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        while let Some(t) = tables.pop() {
            let _ = self.m.free_frame(t.into_frame());
        }
    }
}

impl<M: Model> MigrateBacking for HugeKernel<'_, '_, M> {
    fn alloc_target(&mut self, _old: Frame) -> Option<OwnedFrame> {
        let frame = self.m.alloc_frame().ok()?;
        // SAFETY: fresh from the allocator: the handle is its only claim
        // (dropped once the frame is mapped: the mapping keeps it).
        Some(unsafe { OwnedFrame::new(frame) })
    }

    fn copy_frame(&mut self, from: WritebackFrame<'_>, to: &OwnedFrame) {
        let _ = self.m.copy_frame(from.frame(), to.frame());
    }

    fn move_mappings(&mut self, _old: Frame, _new: Frame) {
        // The reverse map reads the table: the new entries are found there.
    }
}
