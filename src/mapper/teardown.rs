//! [`OffsetTeardown`]: an [`OffsetSpace`] that range teardown
//! ([`MmuGather::unmap_range`](crate::MmuGather::unmap_range)) may free
//! through, made by [`OffsetSpace::for_teardown`], and its
//! [`TableTeardown`], which detaches the page-table frames a teardown
//! emptied.

#![cfg_attr(not(feature = "x86_64-mapper"), allow(rustdoc::broken_intra_doc_links))]

use core::sync::atomic::Ordering;

use super::{index, span, OffsetSpace, ADDR_MASK, ENTRIES, HUGE, VA_BITS};
use crate::gather::{DetachedTable, TableTeardown};
use crate::mm::MmTlbState;
use crate::pte::{Frame, Pte, PteFlags, PAGE_SHIFT, PAGE_SIZE};
use crate::range::{is_canonical, PageRange};
use crate::rmap::PageTable;
use crate::Error;

/// An [`OffsetSpace`] whose kernel lets [`MmuGather`](crate::MmuGather)
/// free what it tears down: the data frames of the 4 KiB entries it
/// clears, and the page-table frames below the level-4 table that it
/// detaches ([`TableTeardown`]). Made by [`OffsetSpace::for_teardown`].
///
/// A table is detached once the teardown emptied it and its whole span
/// lies in the range: leaf tables first, then level-2 and level-3 tables
/// left empty by that. The level-4 table stays (it is the address space's
/// root). A range that a 2 MiB or 1 GiB page maps any of is refused with
/// [`Error::HugePage`] before anything changes
/// ([`PageTable::check_range`], which runs
/// [`OffsetSpace::check_no_huge`]): clearing 4 KiB entries would leave it
/// mapped. Split or unmap huge pages with the `x86_64` crate first.
///
/// [`OffsetTeardown::munmap`] is the short form of a teardown for a plain
/// munmap.
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
    /// present 4 KiB entry holds one claim on its frame (the frame itself,
    /// or one reference of its count; see [`OwnedFrame`](crate::OwnedFrame)),
    /// which passes to the gather when the entry is cleared; and each
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

    /// Detaches the first empty table at `level` (2: a leaf table, 3: a
    /// table of leaf tables, 4: one of those) below `table` (at
    /// `table_level`, covering `base`) whose whole span lies in
    /// `first..=last`.
    fn detach_below(
        &self,
        table: u64,
        table_level: u32,
        base: u64,
        first: u64,
        last: u64,
        level: u32,
    ) -> Option<DetachedTable> {
        let entry_span = span(table_level);
        let lo = if first > base {
            index(first, table_level)
        } else {
            0
        };
        for i in lo..ENTRIES {
            // Level-4 entries 256 and up are the upper half.
            let start = sign_extend(base.checked_add(i * entry_span)?);
            if start > last {
                return None;
            }
            let entry = self.space.word(table, i)?;
            let raw = entry.load(Ordering::SeqCst);
            if raw & PteFlags::PRESENT.bits() == 0 || raw & HUGE != 0 {
                continue;
            }
            let child = self.space.next_table(raw)?;
            // The entry's last page (`last` is the range's last page too).
            let end = start.checked_add(entry_span - PAGE_SIZE);
            let inside = start >= first && end.is_some_and(|e| e <= last);
            if table_level == level {
                if inside && self.table_is_empty(child) {
                    // Unlink with one compare-exchange: an entry the kernel
                    // changed meanwhile is left alone.
                    if entry
                        .compare_exchange(raw, 0, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                    {
                        let pages = entry_span >> PAGE_SHIFT;
                        let range = PageRange::new(start, pages).ok()?;
                        return Some(DetachedTable {
                            frame: Frame((raw & ADDR_MASK) >> PAGE_SHIFT),
                            range,
                        });
                    }
                }
            } else if let Some(found) = self.detach_below(child, table_level - 1, start, first, last, level) {
                return Some(found);
            }
        }
        None
    }

    /// Whether every word of the table at `table` is 0.
    fn table_is_empty(&self, table: u64) -> bool {
        (0..ENTRIES).all(|i| {
            self.space
                .word(table, i)
                .is_some_and(|w| w.load(Ordering::SeqCst) == 0)
        })
    }
}

/// `va` with bits 48 to 63 copies of bit 47.
fn sign_extend(va: u64) -> u64 {
    (((va << 16) as i64) >> 16) as u64
}

// SAFETY: every operation is the wrapped `OffsetSpace`'s (see its
// `PageTable` impl).
unsafe impl PageTable for OffsetTeardown<'_> {
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

    /// Refuses a range that a huge page maps any of, with
    /// [`Error::HugePage`]: the teardown clears 4 KiB entries only, and
    /// would skip it.
    fn check_range(&self, range: PageRange) -> Result<(), Error> {
        self.space.check_no_huge(range).map_err(Error::from)
    }
}

// SAFETY: `detach_table` unlinks a table with one atomic compare-exchange
// of its parent's entry, only when every word of it is 0 (it translates
// nothing) and its whole span lies in `range`; once unlinked no new walk
// reaches it, and the frame is handed over: the caller of `for_teardown`
// promised that page-table frames belong to this address space alone and
// that a cleared present entry's claim passes to the gather.
unsafe impl TableTeardown for OffsetTeardown<'_> {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        let last = range.last()?;
        let first = range.start();
        if !is_canonical(first, VA_BITS) || !is_canonical(last, VA_BITS) {
            return None;
        }
        let root = self.space.level_4;
        // The deepest tables first: a parent empties only once its
        // children are gone.
        (2..=4).find_map(|level| self.detach_below(root, 4, 0, first, last, level))
    }
}
