//! [`PtmTeardown`]: a [`PtmSpace`] that
//! [`MmuGather::unmap_range`](crate::MmuGather::unmap_range) may free
//! through ([`PtmSpace::for_teardown`]), and its [`TableTeardown`], which
//! unlinks the page-table frames a teardown left empty.

use core::fmt;
use core::sync::atomic::Ordering;

use page_table_multiarch::PagingHandler;

use super::{index, span, PtmSpace, ADDR_MASK, ENTRIES, PAGE_SIZE_BIT, VA_BITS};
use crate::gather::{DetachedTable, TableTeardown};
use crate::mm::MmTlbState;
use crate::pte::{Frame, Pte, PteFlags, PAGE_SHIFT, PAGE_SIZE};
use crate::range::{is_canonical, PageRange};
use crate::rmap::PageTable;
use crate::Error;

/// A [`PtmSpace`] whose kernel lets [`MmuGather`](crate::MmuGather) take
/// what a teardown removes: the data frames of the present 4 KiB entries
/// it clears, and the page-table frames below the root that it unlinks
/// ([`TableTeardown::detach_table`]).
///
/// A table is unlinked once every entry of it is empty and its whole span
/// lies inside the torn-down range, leaf tables first, then the level-2
/// and level-3 tables that emptied with them; the root stays. Unlinked
/// frames are no longer reachable from the `X64PageTable`, so dropping the
/// table later does not free them again: the kernel frees them in
/// [`TeardownBacking::free_tables`](crate::TeardownBacking::free_tables),
/// typically with `H::dealloc_frame`, after the flush.
///
/// A range any of which a 2 MiB or 1 GiB page maps is refused with
/// [`Error::HugePage`] before anything changes
/// ([`PageTable::check_range`] runs [`PtmSpace::check_no_huge`]).
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
    /// In every range torn down through the result: each present 4 KiB
    /// entry holds one claim on its frame (the frame, or one reference of
    /// its count; see [`OwnedFrame`](crate::OwnedFrame)) that passes to the
    /// gather when the entry is cleared; and each table frame below the
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

    /// Unlinks the first empty table named by an entry at `level` (2: a
    /// leaf table; 3 and 4: tables of tables) below the table mapped at
    /// `table` (at `table_level`, translating from `base`) whose span lies
    /// inside `first..=last`.
    fn unlink_below(
        &self,
        table: u64,
        table_level: u32,
        base: u64,
        first: u64,
        last: u64,
        level: u32,
    ) -> Option<DetachedTable> {
        let entry_span = span(table_level);
        let from = if first > base {
            index(first, table_level)
        } else {
            0
        };
        for i in from..ENTRIES {
            // Root entries 256 and up translate the upper half.
            let start = sign_extend(base.checked_add(i * entry_span)?);
            if start > last {
                return None;
            }
            let entry = self.space.word(table, i)?;
            let raw = entry.load(Ordering::SeqCst);
            if raw & PteFlags::PRESENT.bits() == 0 || raw & PAGE_SIZE_BIT != 0 {
                continue;
            }
            let Some(child) = PtmSpace::<H>::table_at(raw & ADDR_MASK) else {
                continue;
            };
            let end = start.checked_add(entry_span - PAGE_SIZE);
            let inside = start >= first && end.is_some_and(|e| e <= last);
            if table_level != level {
                if let Some(found) = self.unlink_below(child, table_level - 1, start, first, last, level) {
                    return Some(found);
                }
                continue;
            }
            // One compare-exchange unlinks it; an entry changed meanwhile
            // (the kernel mapped something again) stays.
            if inside
                && self.is_empty(child)
                && entry
                    .compare_exchange(raw, 0, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            {
                let range = PageRange::new(start, entry_span >> PAGE_SHIFT).ok()?;
                return Some(DetachedTable {
                    frame: Frame((raw & ADDR_MASK) >> PAGE_SHIFT),
                    range,
                });
            }
        }
        None
    }

    /// Whether every entry of the table mapped at `table` is 0.
    fn is_empty(&self, table: u64) -> bool {
        (0..ENTRIES).all(|i| {
            self.space
                .word(table, i)
                .is_some_and(|w| w.load(Ordering::SeqCst) == 0)
        })
    }
}

/// `va` with bits 48 to 63 set to bit 47.
fn sign_extend(va: u64) -> u64 {
    (((va << 16) as i64) >> 16) as u64
}

// SAFETY: every operation is the wrapped `PtmSpace`'s (see its impl).
unsafe impl<H: PagingHandler> PageTable for PtmTeardown<'_, H> {
    fn tlb_state(&self) -> &MmTlbState {
        self.space.tlb_state()
    }

    fn lookup(&self, va: u64) -> Pte {
        self.space.lookup(va)
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        self.space.exchange(va, new)
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        self.space.test_and_clear_accessed(va)
    }

    fn set(&self, va: u64, pte: Pte) {
        self.space.set(va, pte);
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        self.space.next_populated(range)
    }

    fn check_range(&self, range: PageRange) -> Result<(), Error> {
        self.space.check_range(range)
    }
}

// SAFETY: `detach_table` unlinks a table by one compare-exchange of its
// parent's entry word, only when all 512 words of the table are 0 (it
// translates nothing) and its whole span lies in `range`; from then on no
// new walk reaches it, and its frame goes to the caller alone, as the
// caller of `for_teardown` promised that table frames belong to this
// address space only and that a cleared present entry's claim passes to
// the gather.
unsafe impl<H: PagingHandler> TableTeardown for PtmTeardown<'_, H> {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        let last = range.last()?;
        let first = range.start();
        if !is_canonical(first, VA_BITS) || !is_canonical(last, VA_BITS) {
            return None;
        }
        let root = PtmSpace::<H>::table_at(self.space.root)?;
        // Deepest first: a parent empties only once its children are gone.
        (2..=4).find_map(|level| self.unlink_below(root, 4, 0, first, last, level))
    }
}
