//! The size of what one page-table entry maps: a base page, or a huge page
//! (an x86 2 MiB or 1 GiB page, an arm64 block).

use core::fmt;

use crate::pte::PAGE_SHIFT;

/// The size of the memory one page-table entry maps, a power of two.
///
/// [`PageTable::entry_size`](crate::PageTable::entry_size) reports it for
/// the entry that maps an address. The crate's operations take a huge
/// entry whole, at its first address (a reverse-map mapping of the huge
/// frame there, a range that covers the whole huge page), flushed with one
/// invalidation at its size; anything that would change one piece of it is
/// refused with [`Error::HugePage`](crate::Error::HugePage) before anything
/// changes, never changed piecewise or skipped in silence (see
/// `docs/huge-pages.md`).
///
/// The sizes the crate knows by name are x86_64's (4 KiB, 2 MiB, 1 GiB:
/// Intel SDM vol. 3, 4.5, "4-Level Paging and 5-Level Paging"), which are
/// also arm64's with a 4 KiB granule (a page, and level-2 and level-1
/// blocks: Arm ARM, D8.3). [`from_shift`](Self::from_shift) builds any
/// other power of two from 4 KiB to 512 GiB (arm64's 16 KiB and 64 KiB
/// granules and their blocks of 32 MiB, 512 MiB and 4 TiB are not all in
/// that range: only those up to 512 GiB are representable).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageSize {
    shift: u8,
}

impl PageSize {
    /// 4 KiB: the crate's unit ([`PAGE_SIZE`](crate::PAGE_SIZE)), and the
    /// base page of x86_64 and of arm64 with the 4 KiB granule.
    pub const SIZE_4K: PageSize = PageSize { shift: 12 };
    /// An arm64 page with the 16 KiB granule (a level-3 entry).
    pub const SIZE_16K: PageSize = PageSize { shift: 14 };
    /// An arm64 page with the 64 KiB granule (a level-3 entry).
    pub const SIZE_64K: PageSize = PageSize { shift: 16 };
    /// An arm64 level-2 block with the 16 KiB granule.
    pub const SIZE_32M: PageSize = PageSize { shift: 25 };
    /// An arm64 level-2 block with the 64 KiB granule.
    pub const SIZE_512M: PageSize = PageSize { shift: 29 };
    /// An x86_64 2 MiB page (a level-2 entry with the page-size bit), or an
    /// arm64 level-2 block with a 4 KiB granule.
    pub const SIZE_2M: PageSize = PageSize { shift: 21 };
    /// An x86_64 1 GiB page (a level-3 entry with the page-size bit), or an
    /// arm64 level-1 block with a 4 KiB granule.
    pub const SIZE_1G: PageSize = PageSize { shift: 30 };

    /// The smallest shift [`from_shift`](Self::from_shift) takes: a base
    /// page.
    pub const MIN_SHIFT: u32 = PAGE_SHIFT;
    /// The largest shift [`from_shift`](Self::from_shift) takes (512 GiB,
    /// what one x86_64 level-4 entry spans).
    pub const MAX_SHIFT: u32 = 39;

    /// The size of `1 << shift` bytes, or `None` for a shift outside
    /// [`MIN_SHIFT`](Self::MIN_SHIFT)`..=`[`MAX_SHIFT`](Self::MAX_SHIFT).
    pub const fn from_shift(shift: u32) -> Option<PageSize> {
        if shift < Self::MIN_SHIFT || shift > Self::MAX_SHIFT {
            return None;
        }
        // The range check above keeps `shift` below 40, so it fits a u8.
        Some(PageSize { shift: shift as u8 })
    }

    /// log2 of the size in bytes.
    pub const fn shift(self) -> u32 {
        self.shift as u32
    }

    /// The size in bytes.
    pub const fn bytes(self) -> u64 {
        1 << self.shift
    }

    /// How many 4 KiB units ([`PAGE_SIZE`](crate::PAGE_SIZE), the crate's
    /// unit, which is not necessarily the architecture's base page:
    /// [`Arch::base_page`](crate::Arch::base_page)) it covers.
    pub const fn base_pages(self) -> u64 {
        1 << (self.shift as u32 - PAGE_SHIFT)
    }

    /// Whether it is larger than 4 KiB (an x86 huge page, an arm64 block,
    /// or a 16 or 64 KiB arm64 page: the crate takes all of them whole).
    pub const fn is_huge(self) -> bool {
        self.shift as u32 > PAGE_SHIFT
    }

    /// The first address of the page of this size that holds `va`.
    pub const fn align_down(self, va: u64) -> u64 {
        va & !(self.bytes() - 1)
    }
}

impl Default for PageSize {
    /// A base page.
    fn default() -> Self {
        PageSize::SIZE_4K
    }
}

impl fmt::Debug for PageSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `4 KiB`, `2 MiB`, `1 GiB`, `512 GiB`.
impl fmt::Display for PageSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (unit, shift) = match self.shift() {
            s if s >= 30 => ("GiB", 30),
            s if s >= 20 => ("MiB", 20),
            _ => ("KiB", 10),
        };
        write!(f, "{} {unit}", 1u64 << (self.shift() - shift))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::PageSize;

    #[test]
    fn sizes_by_name_and_by_shift() {
        assert_eq!(PageSize::SIZE_4K.bytes(), 4096);
        assert_eq!(PageSize::SIZE_2M.base_pages(), 512);
        assert_eq!(PageSize::SIZE_1G.base_pages(), 512 * 512);
        assert_eq!(PageSize::from_shift(21), Some(PageSize::SIZE_2M));
        assert_eq!(PageSize::from_shift(11), None);
        assert_eq!(PageSize::from_shift(40), None);
        assert_eq!(PageSize::from_shift(39).map(PageSize::bytes), Some(1 << 39));
        assert!(!PageSize::SIZE_4K.is_huge() && PageSize::SIZE_2M.is_huge());
        assert_eq!(PageSize::default(), PageSize::SIZE_4K);
        assert_eq!(PageSize::SIZE_2M.align_down(0x4020_1234), 0x4020_0000);
        assert!(PageSize::SIZE_4K < PageSize::SIZE_2M);
    }

    #[test]
    fn prints_in_binary_units() {
        let shown: std::vec::Vec<_> = [12, 14, 16, 21, 25, 29, 30, 39]
            .into_iter()
            .filter_map(PageSize::from_shift)
            .map(|s| std::format!("{s}"))
            .collect();
        assert_eq!(
            shown,
            ["4 KiB", "16 KiB", "64 KiB", "2 MiB", "32 MiB", "512 MiB", "1 GiB", "512 GiB"]
        );
        // Debug (what errors and assertions show) is the same text.
        assert_eq!(std::format!("{:?}", PageSize::SIZE_2M), "2 MiB");
        assert_eq!(std::format!("{:?}", Some(PageSize::SIZE_16K)), "Some(16 KiB)");
    }
}
