//! [`OffsetTeardown`]: an [`OffsetSpace`] that range teardown
//! ([`MmuGather::unmap_range`](crate::MmuGather::unmap_range)) may free
//! through, made by [`OffsetSpace::for_teardown`], and its
//! [`TableTeardown`], which detaches the page-table frames a teardown
//! emptied.

#![cfg_attr(not(feature = "x86_64-mapper"), allow(rustdoc::broken_intra_doc_links))]

use super::OffsetSpace;
use crate::gather::{DetachedTable, TableBounds, TableTeardown};
use crate::mm::MmTlbState;
use crate::range::PageRange;
use crate::rmap::PageTable;
use crate::x86_walk::{walk_table_ops, Walk};
use crate::Error;

/// An [`OffsetSpace`] whose kernel lets [`MmuGather`](crate::MmuGather)
/// free what it tears down: the data frames of the 4 KiB entries it
/// clears, and the page-table frames below the level-4 table that it
/// detaches ([`TableTeardown`]). Made by [`OffsetSpace::for_teardown`].
///
/// A table is detached once the teardown emptied it and its whole span
/// lies in the range (with [`MmuGather::unmap_range_bounded`](crate::MmuGather::unmap_range_bounded):
/// once every word of it is 0, it translates some of the range and its
/// whole span lies within the bounds): leaf tables first, then level-2
/// and level-3 tables left empty by that. The level-4 table stays (it is
/// the address space's root).
///
/// A 2 MiB or 1 GiB page that the range covers wholly is one entry: it is
/// cleared once and its frame (the huge frame's first 4 KiB frame) handed
/// to the kernel's [`FreeFrames`](crate::FreeFrames) once, after the
/// flush, for the kernel to free the whole huge frame. A range that a huge
/// page maps part of is refused with [`Error::HugePage`] before anything
/// changes ([`PageTable::check_range`], which runs
/// [`OffsetSpace::check_no_partial_huge`]): split it first.
///
/// [`OffsetTeardown::munmap`] is the short form of a teardown for a plain
/// munmap of 4 KiB pages (it refuses every huge page: its frees go to a
/// 4 KiB frame deallocator).
#[derive(Debug)]
pub struct OffsetTeardown<'a> {
    space: OffsetSpace<'a>,
}

impl<'a> OffsetSpace<'a> {
    /// This address space, for [`MmuGather::unmap_range`](crate::MmuGather::unmap_range).
    ///
    /// # Safety
    ///
    /// In every range the kernel tears down through the result: each
    /// present entry holds one claim on its frame (the frame itself, or
    /// one reference of its count; see [`OwnedFrame`](crate::OwnedFrame);
    /// for a 2 MiB or 1 GiB entry, the whole huge frame, named by its first
    /// 4 KiB frame), which passes to the gather when the entry is cleared;
    /// and each
    /// page-table frame below the level-4 table belongs to this address
    /// space alone (not shared with another, as kernel-half tables often
    /// are), so that once unlinked, nothing else frees or walks into it.
    pub unsafe fn for_teardown(self) -> OffsetTeardown<'a> {
        OffsetTeardown { space: self }
    }
}

impl<'a> OffsetTeardown<'a> {
    /// The address space.
    pub fn space(&self) -> &OffsetSpace<'a> {
        &self.space
    }

    /// The shared walk over the space's tables.
    fn walk(&self) -> Walk<'_, OffsetSpace<'a>> {
        self.space.walk()
    }
}

// SAFETY: every operation is the wrapped `OffsetSpace`'s, or the same
// `Walk` over its tables that its own operations use (see its
// `PageTable` impl).
unsafe impl PageTable for OffsetTeardown<'_> {
    fn tlb_state(&self) -> &MmTlbState {
        self.space.tlb_state()
    }

    walk_table_ops!(walk);

    /// Refuses a range that a huge page maps part of but not all of, with
    /// [`Error::HugePage`] ([`OffsetSpace::check_no_partial_huge`]): a
    /// teardown takes a huge page whole or not at all.
    fn check_range(&self, range: PageRange) -> Result<(), Error> {
        self.space.check_range(range)
    }

    fn root(&self) -> Option<u64> {
        self.space.root()
    }
}

// SAFETY: both hooks unlink a table with one atomic compare-exchange of
// its parent's entry, only when every word of it is 0 (it translates
// nothing), and report its whole span; `detach_table` only when that span
// lies in `range`, `detach_table_bounded` only when it lies within
// `bounds` and meets `range`. Once unlinked no new walk reaches it, and
// the frame is handed over: the caller of `for_teardown` promised that
// page-table frames belong to this address space alone and that a cleared
// present entry's claim passes to the gather.
unsafe impl TableTeardown for OffsetTeardown<'_> {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        self.walk().detach_table(range)
    }

    fn detach_table_bounded(&self, range: PageRange, bounds: TableBounds) -> Option<DetachedTable> {
        self.walk().detach_table_bounded(range, bounds)
    }
}
