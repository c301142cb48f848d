//! One entry of a teardown: cleared, its dirty bit moved to its frame, its
//! page (of the entry's size) added to the flush and its frame to the data
//! batch.

use super::{FrameKind, MmuGather, TeardownBacking};
use crate::arch::Arch;
use crate::page_size::PageSize;
use crate::pte::Pte;
use crate::request::Pages;
use crate::rmap::PageTable;
use crate::unmap::OwnedFrame;
use crate::walk::Step;
use crate::Error;

impl<const N: usize> MmuGather<N> {
    /// Takes the non-empty entry `(va, pte, size)` that the teardown's walk
    /// met (at its first address, for a huge one: the walk hands a huge
    /// entry over once, whole). A present entry is cleared, its dirty bit
    /// goes to its frame ([`TeardownBacking::set_dirty`]), its page is
    /// added to the flush as one page of `size` (one invalidation at the
    /// huge stride for a huge entry), and its frame (a huge frame's first
    /// 4 KiB frame) to the data batch, freed after the flush; pauses the
    /// walk, with nothing changed, when the batch is full. A migration or
    /// hwpoison entry is cleared, nothing more.
    pub(super) fn take_entry<A, S, B>(
        &mut self,
        space: &S,
        backing: &mut B,
        (va, pte, size): (u64, Pte, PageSize),
        handback: &mut dyn FnMut(OwnedFrame, FrameKind),
    ) -> Result<Step, Error>
    where
        A: Arch,
        S: PageTable + ?Sized,
        B: TeardownBacking + ?Sized,
    {
        if !pte.is_present() {
            // Nothing cached, nothing to free, but the mapping goes.
            space.clear(va);
            return Ok(Step::Next);
        }
        if self.pages.is_full() {
            return Ok(Step::Pause);
        }
        let old = space.clear(va);
        if old.is_present() {
            let asid = space.tlb_state().asid();
            if old.is_dirty() {
                backing.set_dirty(old.frame());
            }
            // The walk met it as one entry of `size`: its leaf size.
            match Pages::one(va, size).map(Pages::leaf) {
                Ok(pages) => self
                    .request
                    .add_pages_step(asid, pages, A::FULL_FLUSH_CEILING, None),
                // Cannot happen (the walk yields each entry at its first
                // address); the whole address space then.
                Err(_) => self.request.add_asid(asid),
            }
            // SAFETY: the cleared present entry held one claim on its frame
            // (for a huge entry, on the whole huge frame, named by its
            // first 4 KiB frame), which the `TableTeardown` contract passes
            // to us; the handle is that claim and nothing else.
            let frame = unsafe { OwnedFrame::new(old.frame()) };
            if let Err(frame) = self.pages.push(frame) {
                // Not full: checked above.
                handback(frame, FrameKind::Data);
            }
            self.summary.pages_unmapped += 1;
        }
        Ok(Step::Next)
    }
}
