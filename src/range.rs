//! Page ranges and canonical addresses.
//!
//! A range is its first page and a page count, never an exclusive end: the
//! last page of the address space (`0xffff_ffff_ffff_f000` on x86-64) has no
//! end address that fits in a `u64`, and a range that had to name one could
//! not express it. Whether a machine can translate a range is checked by
//! [`check_range`](crate::check_range), against the architecture.

use core::fmt;

use crate::pte::{check_aligned, PAGE_SHIFT, PAGE_SIZE};
use crate::Error;

/// Pages one leaf page table maps (512 eight-byte entries in a 4 KiB
/// table): the unit [`PageTable::with_table_locked`](crate::PageTable::with_table_locked)
/// locks and [`MmuGather`](crate::MmuGather) detaches.
pub const TABLE_PAGES: u64 = 512;

/// Bytes one leaf page table maps (2 MiB).
pub const TABLE_SPAN: u64 = TABLE_PAGES * PAGE_SIZE;

/// A run of whole pages: the first page's address and how many pages.
///
/// Built only through checked constructors, so every value is page-aligned
/// and ends at or below the top of the 64-bit address space: its last page
/// is always `start + (pages - 1) * PAGE_SIZE` without overflow. Whether the
/// addresses exist on a given machine (canonical form) is checked by the
/// entry points that receive the range ([`check_range`](crate::check_range)).
///
/// ```
/// use tlb_batch::{Error, PageRange, PAGE_SIZE};
///
/// let top = PageRange::new(0xffff_ffff_ffff_f000, 1).unwrap();
/// assert_eq!(top.last(), Some(0xffff_ffff_ffff_f000));
/// assert!(PageRange::new(0xffff_ffff_ffff_f000, 2).is_err()); // wraps
/// let r = PageRange::from_bounds(0x1000, 0x4000).unwrap();
/// assert_eq!((r.start(), r.pages()), (0x1000, 3));
/// assert_eq!(PageRange::from_bounds(0x4000, 0x1000), Err(Error::InvalidRange { start: 0x4000, end: 0x1000 }));
/// assert_eq!(r.iter().nth(2), Some(0x3000));
/// # let _ = PAGE_SIZE;
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageRange {
    start: u64,
    pages: u64,
}

impl PageRange {
    /// The empty range.
    pub const EMPTY: PageRange = PageRange { start: 0, pages: 0 };

    /// `pages` pages from `start`. Errors: [`Error::Unaligned`] for an
    /// unaligned `start`, [`Error::RangeOverflow`] when the range would run
    /// past the top of the address space.
    pub const fn new(start: u64, pages: u64) -> Result<Self, Error> {
        if !start.is_multiple_of(PAGE_SIZE) {
            return Err(Error::Unaligned { addr: start });
        }
        // Pages from `start` to the top of the address space, inclusive:
        // `u64::MAX - start` is `k * PAGE_SIZE + (PAGE_SIZE - 1)`.
        let room = ((u64::MAX - start) >> PAGE_SHIFT) + 1;
        if pages > room {
            return Err(Error::RangeOverflow { start, pages });
        }
        Ok(PageRange { start, pages })
    }

    /// The single page at `va`. Errors: [`Error::Unaligned`].
    pub const fn page(va: u64) -> Result<Self, Error> {
        PageRange::new(va, 1)
    }

    /// The pages of `start..end` (an exclusive end, which cannot name the
    /// last page of the address space: use [`new`](Self::new) for that).
    /// Errors: [`Error::Unaligned`] for an unaligned bound,
    /// [`Error::InvalidRange`] when `start > end`.
    pub fn from_bounds(start: u64, end: u64) -> Result<Self, Error> {
        check_aligned(start)?;
        check_aligned(end)?;
        if start > end {
            return Err(Error::InvalidRange { start, end });
        }
        PageRange::new(start, (end - start) >> PAGE_SHIFT)
    }

    /// The first page's address.
    pub const fn start(self) -> u64 {
        self.start
    }

    /// How many pages.
    pub const fn pages(self) -> u64 {
        self.pages
    }

    /// Whether the range holds no page.
    pub const fn is_empty(self) -> bool {
        self.pages == 0
    }

    /// The last page's address, or `None` for an empty range.
    pub const fn last(self) -> Option<u64> {
        if self.pages == 0 {
            None
        } else {
            // Cannot overflow: checked at construction.
            Some(self.start + (self.pages - 1) * PAGE_SIZE)
        }
    }

    /// Whether the page holding `va` is in the range.
    pub fn contains(self, va: u64) -> bool {
        let page = va & !(PAGE_SIZE - 1);
        self.last()
            .is_some_and(|last| (self.start..=last).contains(&page))
    }

    /// The part of the range from the page at `va` on (empty when `va`
    /// lies past its end, the whole range when before its start).
    pub fn from_page(self, va: u64) -> PageRange {
        let page = va & !(PAGE_SIZE - 1);
        match self.last() {
            Some(last) if page <= last => {
                let first = page.max(self.start);
                PageRange {
                    start: first,
                    pages: ((last - first) >> PAGE_SHIFT) + 1,
                }
            }
            _ => PageRange {
                start: self.start,
                pages: 0,
            },
        }
    }

    /// The part of the range after the page at `va` (empty when `va` lies
    /// at or past its last page).
    pub fn after(self, va: u64) -> PageRange {
        let page = va & !(PAGE_SIZE - 1);
        match self.last() {
            // `page < last`, so `page + PAGE_SIZE` does not overflow.
            Some(last) if page < last => self.from_page(page + PAGE_SIZE),
            _ => PageRange {
                start: self.start,
                pages: 0,
            },
        }
    }

    /// The part of the range that the leaf page table holding the entry
    /// for `va` maps (see [`TABLE_SPAN`]).
    pub fn within_table_of(self, va: u64) -> PageRange {
        let table_first = va & !(TABLE_SPAN - 1);
        let table_last = table_first + (TABLE_SPAN - PAGE_SIZE);
        let rest = self.from_page(table_first);
        match rest.last() {
            Some(last) => {
                let end = last.min(table_last);
                if end < rest.start {
                    PageRange::EMPTY
                } else {
                    PageRange {
                        start: rest.start,
                        pages: ((end - rest.start) >> PAGE_SHIFT) + 1,
                    }
                }
            }
            None => PageRange::EMPTY,
        }
    }

    /// Every page's address, in order.
    pub fn iter(self) -> impl Iterator<Item = u64> {
        (0..self.pages).map(move |i| self.start + i * PAGE_SIZE)
    }
}

impl fmt::Debug for PageRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.last() {
            Some(last) => write!(
                f,
                "PageRange({:#x}..={:#x}, {} pages)",
                self.start, last, self.pages
            ),
            None => write!(f, "PageRange(empty)"),
        }
    }
}

/// Whether `va` is canonical for an MMU that translates `bits`-bit
/// addresses: bits 63 down to `bits - 1` are all equal (sign extension).
/// `bits` of 64 or more accept every address.
pub const fn is_canonical(va: u64, bits: u32) -> bool {
    if bits >= 64 {
        return true;
    }
    if bits == 0 {
        return va == 0;
    }
    let shift = 64 - bits;
    ((((va << shift) as i64) >> shift) as u64) == va
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_reach_the_top_page_and_never_wrap() {
        let top = 0xffff_ffff_ffff_f000;
        assert_eq!(PageRange::new(top, 1).unwrap().last(), Some(top));
        assert_eq!(
            PageRange::new(top, 2),
            Err(Error::RangeOverflow { start: top, pages: 2 })
        );
        assert_eq!(
            PageRange::new(0, u64::MAX),
            Err(Error::RangeOverflow {
                start: 0,
                pages: u64::MAX
            })
        );
        let all = PageRange::new(0, 1 << 52).unwrap();
        assert_eq!(all.last(), Some(top));
        assert!(all.contains(top + 5));
        assert_eq!(PageRange::new(0x1001, 1), Err(Error::Unaligned { addr: 0x1001 }));
        assert_eq!(PageRange::new(0x1000, 0).unwrap().last(), None);
    }

    #[test]
    fn sub_ranges_stay_inside() {
        let r = PageRange::new(0x1000, 10).unwrap();
        assert_eq!(r.from_page(0x5000), PageRange::new(0x5000, 6).unwrap());
        assert_eq!(r.from_page(0).pages(), 10);
        assert!(r.from_page(0xb000).is_empty());
        assert_eq!(r.after(0x5000), PageRange::new(0x6000, 5).unwrap());
        assert!(r.after(0xa000).is_empty());
        assert!(PageRange::page(0xffff_ffff_ffff_f000)
            .unwrap()
            .after(0xffff_ffff_ffff_f000)
            .is_empty());
        let big = PageRange::new(0x1f_f000, 4).unwrap();
        assert_eq!(
            big.within_table_of(0x1f_f000),
            PageRange::new(0x1f_f000, 1).unwrap()
        );
        assert_eq!(
            big.within_table_of(0x20_0000),
            PageRange::new(0x20_0000, 3).unwrap()
        );
        assert!(big.within_table_of(0x40_0000).is_empty());
        let top = PageRange::new(0xffff_ffff_ffe0_0000, 512).unwrap();
        assert_eq!(top.within_table_of(0xffff_ffff_ffff_f000), top);
    }

    #[test]
    fn ranges_list_their_pages_and_show_their_bounds() {
        let r = PageRange::from_bounds(0x3000, 0x6000).unwrap();
        assert_eq!(r.iter().collect::<std::vec::Vec<_>>(), [0x3000, 0x4000, 0x5000]);
        assert_eq!(
            PageRange::from_bounds(0x3000, 0x3000),
            Ok(PageRange::new(0x3000, 0).unwrap())
        );
        assert!(PageRange::from_bounds(0x3000, 0x3000).unwrap().is_empty());
        assert_eq!(std::format!("{:?}", r), "PageRange(0x3000..=0x5000, 3 pages)");
        assert_eq!(std::format!("{:?}", PageRange::EMPTY), "PageRange(empty)");
    }

    #[test]
    fn canonical_form_is_sign_extension() {
        assert!(is_canonical(0x7fff_ffff_f000, 48));
        assert!(!is_canonical(0x8000_0000_0000, 48));
        assert!(is_canonical(0xffff_8000_0000_0000, 48));
        assert!(!is_canonical(0xff00_0000_0000_0000, 48));
        assert!(is_canonical(0xff00_0000_0000_0000, 57));
        assert!(is_canonical(u64::MAX, 64));
        // Zero bits: only address 0 exists.
        assert!(is_canonical(0, 0) && !is_canonical(0x1000, 0));
    }
}
