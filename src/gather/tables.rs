//! What a page table gives up to a teardown: [`DetachedTable`], the
//! [`TableTeardown`] hook that unlinks emptied tables, and the
//! [`TableBounds`] (Linux's floor and ceiling) within which a teardown may
//! free tables that reach past its range.

use crate::pte::{Frame, PAGE_SIZE};
use crate::range::PageRange;
use crate::rmap::PageTable;
use crate::Error;

#[cfg(doc)]
use super::{MmuGather, TableFreePolicy, TableHold};
#[cfg(doc)]
use crate::unmap::{FreeFrames, OwnedFrame};

/// A page-table frame taken out of a page table, and the addresses it used
/// to translate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DetachedTable {
    /// The page-table frame.
    pub frame: Frame,
    /// The pages it translated.
    pub range: PageRange,
}

/// The addresses around a torn-down range that no mapping uses, within
/// which a teardown may free page tables (Linux's `floor` and `ceiling`
/// of `free_pgtables`): from the floor (the end of the mapping below the
/// range, or the lowest user address) up to, not including, the ceiling
/// (the start of the mapping above it, or the end of the user half).
///
/// Without bounds a teardown frees only the tables whose whole span lies
/// inside its range, so two munmaps that each cover half of a leaf table
/// leave it empty and linked. With them, a table that the range touches
/// is freed once its whole span lies within the bounds and it is empty.
///
/// What the kernel promises by passing bounds (see
/// [`MmuGather::unmap_range_bounded`]): no mapping lies in them outside the
/// range, and nothing maps a page in them while the teardown runs (the
/// lock it holds for the munmap keeps them free, as Linux's mmap lock keeps
/// the gap between two VMAs). Bounds that are wrong cost no memory
/// safety: a table that still holds any entry is never freed.
///
/// ```
/// use tlb_batch::{PageRange, TableBounds, TABLE_SPAN};
///
/// // The mappings around [2 MiB + 1 MiB, 4 MiB) end at 2 MiB and start at 8 MiB.
/// let bounds = TableBounds::new(2 << 20, 8 << 20).unwrap();
/// assert_eq!((bounds.floor(), bounds.ceiling()), (2 << 20, Some(8 << 20)));
/// // The leaf table of [2 MiB, 4 MiB) lies within them, the one below does not.
/// assert!(bounds.covers(PageRange::new(2 << 20, 512).unwrap()));
/// assert!(!bounds.covers(PageRange::new(0, 512).unwrap()));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TableBounds {
    span: PageRange,
}

impl TableBounds {
    /// The addresses from `floor` up to, not including, `ceiling`.
    ///
    /// Errors: [`Error::Unaligned`] for a bound that is not page-aligned,
    /// [`Error::InvalidRange`] when `floor > ceiling`. Whether the bounds
    /// are canonical, and enclose the range, is checked by the teardown
    /// they are given to (it knows the architecture).
    pub fn new(floor: u64, ceiling: u64) -> Result<Self, Error> {
        Ok(TableBounds {
            span: PageRange::from_bounds(floor, ceiling)?,
        })
    }

    /// The addresses from `floor` to the top of the 64-bit address space
    /// (a ceiling of 2^64, which `u64` cannot hold: Linux's ceiling of 0).
    ///
    /// Errors: [`Error::Unaligned`] for an unaligned `floor`.
    pub fn to_top(floor: u64) -> Result<Self, Error> {
        // For an aligned floor, the pages from it to the top (2^52 from 0).
        let pages = (u64::MAX - floor) / PAGE_SIZE + 1;
        Ok(TableBounds {
            span: PageRange::new(floor, pages)?,
        })
    }

    /// The pages of `span` (its first page is the floor, the page after
    /// its last the ceiling).
    pub const fn from_range(span: PageRange) -> Self {
        TableBounds { span }
    }

    /// The lowest address a freed table may translate.
    pub const fn floor(self) -> u64 {
        self.span.start()
    }

    /// The first address above the bounds; `None` when they reach the top
    /// of the address space.
    pub fn ceiling(self) -> Option<u64> {
        match self.span.last() {
            Some(last) => last.checked_add(PAGE_SIZE),
            None => Some(self.span.start()),
        }
    }

    /// The bounds as pages.
    pub const fn span(self) -> PageRange {
        self.span
    }

    /// Whether every page of `table` lies within the bounds (an empty
    /// `table` never does: a table translates something).
    pub fn covers(self, table: PageRange) -> bool {
        match (self.span.last(), table.last()) {
            (Some(last), Some(table_last)) => self.span.start() <= table.start() && table_last <= last,
            _ => false,
        }
    }
}

/// A page table that can give up the tables of a torn-down range.
///
/// # Safety
///
/// - [`detach_table`](TableTeardown::detach_table) returns only a table
///   that translates nothing outside `range`, and only when every entry of
///   it is empty, after unlinking it so that no new walk can reach it
///   (walks already under way may still be reading it, which is what
///   [`TableFreePolicy`] is for), and hands the caller the table frame
///   itself: nothing else frees it. Empty, because a [`TableHold`] may keep
///   the frame where a lazy CPU's MMU can still walk it through a cached
///   pointer: it must find nothing present there (and so cache nothing,
///   and set no accessed bit).
/// - [`detach_table_bounded`](TableTeardown::detach_table_bounded) returns
///   only a table whose whole span lies within `bounds` and that
///   translates some page of `range`, and only when every entry of it is
///   empty (no page, no swap, migration or poison entry, no lower table)
///   at the moment it is unlinked: the check and the unlink must not let a
///   write in between go unnoticed (one compare-exchange of the parent's
///   entry, say, while the kernel's lock keeps the table's own entries
///   still). It is unlinked and handed over as by `detach_table`. A table
///   that reaches past `bounds`, or still holds an entry, stays linked
///   whatever the bounds say: bounds are the kernel's word that nothing is
///   mapped there, and a wrong word must cost no memory.
/// - The [`range`](DetachedTable::range) of a detached table is its whole
///   span, every address it translated: the caller flushes it before the
///   frame is freed, so that no paging-structure cache keeps a pointer to
///   it.
/// - A present entry that [`PageTable::clear`] removes held one claim on
///   its frame (the frame itself, or one reference of its count: see
///   [`OwnedFrame`]), which passes to the caller: [`MmuGather`] wraps it in
///   an [`OwnedFrame`] and hands it to [`FreeFrames::free_batch`] after the
///   flush. For a 2 MiB or 1 GiB entry ([`PageTable::entry_size`]) the
///   claim is on the whole huge frame, and its handle names the huge
///   frame's first 4 KiB frame: the kernel frees the whole huge frame
///   when handed that one (as Linux frees a folio, not its pages).
pub unsafe trait TableTeardown: PageTable {
    /// Unlinks one page-table frame whose addresses all lie in `range`, or
    /// returns `None` when none is left.
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable>;

    /// Unlinks one empty page-table frame that translates some of `range`
    /// and whose addresses all lie within `bounds` (which enclose `range`),
    /// or returns `None` when none is left: how
    /// [`MmuGather::unmap_range_bounded`] frees the tables that adjacent
    /// teardowns emptied between them.
    ///
    /// The default keeps to the tables wholly inside `range`
    /// ([`detach_table`](Self::detach_table)), which any bounds allow: an
    /// implementation written before bounds existed frees what it did.
    fn detach_table_bounded(&self, range: PageRange, bounds: TableBounds) -> Option<DetachedTable> {
        let _ = bounds;
        self.detach_table(range)
    }
}
