//! [`PtmTeardown`]: a [`PtmSpace`] that
//! [`MmuGather::unmap_range`](crate::MmuGather::unmap_range) may free
//! through ([`PtmSpace::for_teardown`]), and its [`TableTeardown`], which
//! unlinks the page-table frames a teardown left empty.

use core::fmt;

use page_table_multiarch::PagingHandler;

use super::PtmSpace;
use crate::gather::{DetachedTable, TableBounds, TableTeardown};
use crate::mm::MmTlbState;
use crate::range::PageRange;
use crate::rmap::PageTable;
use crate::x86_walk::{walk_table_ops, Walk};
use crate::Error;

/// A [`PtmSpace`] whose kernel lets [`MmuGather`](crate::MmuGather) take
/// what a teardown removes: the data frames of the present 4 KiB entries
/// it clears, and the page-table frames below the root that it unlinks
/// ([`TableTeardown::detach_table`]).
///
/// A table is unlinked once every entry of it is empty and its whole span
/// lies inside the torn-down range (with
/// [`MmuGather::unmap_range_bounded`](crate::MmuGather::unmap_range_bounded):
/// within the bounds, and it translates some of the range), leaf tables
/// first, then the level-2
/// and level-3 tables that emptied with them; the root stays. Unlinked
/// frames are no longer reachable from the `X64PageTable`, so dropping the
/// table later does not free them again: the kernel frees them in
/// [`TeardownBacking::free_tables`](crate::TeardownBacking::free_tables),
/// typically with `H::dealloc_frame`, after the flush.
///
/// A 2 MiB or 1 GiB page that the range covers wholly is one entry:
/// cleared once, its frame (the huge frame's first 4 KiB frame) handed to
/// [`FreeFrames::free_batch`](crate::FreeFrames::free_batch) once, after
/// the flush, for the kernel to free the whole huge frame. A range a huge
/// page maps part of is refused with [`Error::HugePage`] before anything
/// changes ([`PageTable::check_range`] runs
/// [`PtmSpace::check_no_partial_huge`]).
pub struct PtmTeardown<'a, H: PagingHandler> {
    space: PtmSpace<'a, H>,
}

impl<H: PagingHandler> fmt::Debug for PtmTeardown<'_, H> {
    // By hand: a derive would ask `H: Debug` of the handler, which
    // `PagingHandler` does not.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PtmTeardown").field("space", &self.space).finish()
    }
}

impl<'a, H: PagingHandler> PtmSpace<'a, H> {
    /// This address space, for
    /// [`MmuGather::unmap_range`](crate::MmuGather::unmap_range).
    ///
    /// # Safety
    ///
    /// In every range torn down through the result: each present entry
    /// holds one claim on its frame (the frame, or one reference of its
    /// count; see [`OwnedFrame`](crate::OwnedFrame); for a 2 MiB or 1 GiB
    /// entry, the whole huge frame, named by its first 4 KiB frame) that
    /// passes to the gather when the entry is cleared; and each table frame below the
    /// root belongs to this address space alone. With
    /// `page_table_multiarch`'s `copy-from` feature the root's entries for
    /// the kernel half name the kernel's own tables: such a range must not
    /// be torn down through the result.
    pub unsafe fn for_teardown(self) -> PtmTeardown<'a, H> {
        PtmTeardown { space: self }
    }
}

impl<'a, H: PagingHandler> PtmTeardown<'a, H> {
    /// The address space.
    pub fn space(&self) -> &PtmSpace<'a, H> {
        &self.space
    }

    /// The shared walk over the space's tables.
    fn walk(&self) -> Walk<'_, PtmSpace<'a, H>> {
        self.space.walk()
    }
}

// SAFETY: every operation is the wrapped `PtmSpace`'s, or the same
// `Walk` over its tables that its own operations use (see its impl).
unsafe impl<H: PagingHandler> PageTable for PtmTeardown<'_, H> {
    fn tlb_state(&self) -> &MmTlbState {
        self.space.tlb_state()
    }

    walk_table_ops!(walk);

    fn check_range(&self, range: PageRange) -> Result<(), Error> {
        self.space.check_range(range)
    }

    fn root(&self) -> Option<u64> {
        self.space.root()
    }
}

// SAFETY: both hooks unlink a table by one compare-exchange of its
// parent's entry word, only when all 512 words of the table are 0 (it
// translates nothing), and report its whole span; `detach_table` only when
// that span lies in `range`, `detach_table_bounded` only when it lies
// within `bounds` and meets `range`. From then on no new walk reaches it, and its frame goes to the caller alone, as the
// caller of `for_teardown` promised that table frames belong to this
// address space only and that a cleared present entry's claim passes to
// the gather.
unsafe impl<H: PagingHandler> TableTeardown for PtmTeardown<'_, H> {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        self.walk().detach_table(range)
    }

    fn detach_table_bounded(&self, range: PageRange, bounds: TableBounds) -> Option<DetachedTable> {
        self.walk().detach_table_bounded(range, bounds)
    }
}
