//! The four-level x86_64 table walk behind both table adapters:
//! [`mapper`](crate::mapper) (tables at a fixed physical-memory offset) and
//! `ptm` (tables wherever `page_table_multiarch`'s `PagingHandler` maps
//! them).
//!
//! The adapters differ only in how the physical address an entry names
//! becomes the virtual address of a table: that is [`TableFrames`]. All
//! else lives here once: finding the entry for an address ([`Walk`]), the
//! [`PageTable`](crate::PageTable) operations on it, the checks of huge
//! pages in a range, and the unlinking of emptied tables for a teardown.
//!
//! The rules both adapters document:
//!
//! - an entry word is only ever read with an atomic load and changed with
//!   one atomic operation (swap, fetch-and, store, compare-exchange), so an
//!   accessed or dirty bit the MMU sets meanwhile is never lost;
//! - an address that is not 48-bit canonical has no entry;
//! - a table address that is not page-aligned, whose page would run past
//!   the top of the address space, or that does not fit a pointer, is
//!   treated as an absent table;
//! - a 2 MiB or 1 GiB entry is reported (as its 4 KiB piece at each
//!   address) and swapped or stored over whole at its first address only;
//!   its one accessed bit is cleared from any address in it;
//! - bit 7 of a level-4 entry is reserved, so such an entry maps nothing.

use core::sync::atomic::{AtomicU64, Ordering};

use crate::gather::{DetachedTable, TableBounds};
use crate::page_size::PageSize;
use crate::pte::{Frame, Pte, PteFlags, PAGE_SHIFT, PAGE_SIZE};
use crate::range::{is_canonical, PageRange};

// Tables in host memory behind a `TableFrames` that can also answer
// unusable addresses.
#[cfg(test)]
mod tests;

/// Bits 12 to 51 of an entry: the physical address it names.
pub(crate) const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// Entries in one table.
pub(crate) const ENTRIES: u64 = 512;
/// Bit 7 of a level-3 or level-2 entry: it maps a 1 GiB or 2 MiB page.
const HUGE: u64 = 1 << 7;
/// Bit 12 of a huge entry: its PAT bit (bit 7 in a 4 KiB entry).
const HUGE_PAT: u64 = 1 << 12;
/// The virtual-address width of four-level paging.
const VA_BITS: u32 = 48;
/// Where the upper half starts.
const UPPER_HALF: u64 = 0xffff_8000_0000_0000;
/// The first non-canonical address above the lower half.
const LOWER_END: u64 = 0x0000_8000_0000_0000;

/// Bytes mapped by one entry of a table at `level` (1 is the leaf table).
const fn span(level: u32) -> u64 {
    PAGE_SIZE << (9 * (level - 1))
}

/// The index of the entry for `va` in its table at `level`.
const fn index(va: u64, level: u32) -> u64 {
    (va >> (PAGE_SHIFT + 9 * (level - 1))) & (ENTRIES - 1)
}

/// The next multiple of `step` above `va`, jumping the non-canonical hole
/// to the upper half; `None` past the top of the address space.
fn next_boundary(va: u64, step: u64) -> Option<u64> {
    let next = (va & !(step - 1)).checked_add(step)?;
    Some(if (LOWER_END..UPPER_HALF).contains(&next) {
        UPPER_HALF
    } else {
        next
    })
}

/// `va` with bits 48 to 63 copies of bit 47.
fn sign_extend(va: u64) -> u64 {
    (((va << 16) as i64) >> 16) as u64
}

/// How one address space's table frames are reached: the virtual address
/// of the level-4 table, and of the table frame at a physical address.
/// Either may answer anything; [`Walk`] checks the answer before it reads
/// a word there.
///
/// # Safety
///
/// While `&self` is borrowed: an address [`root_table`](Self::root_table)
/// answers, and an address [`table_of`](Self::table_of) answers for the
/// physical address a present, non-huge upper-level entry of these tables
/// names, is a live, readable and writable 4 KiB page-table page (when it
/// passes [`Walk`]'s checks); no such page is freed; and every other
/// writer of its words (the MMU, other CPUs, the kernel) changes them only
/// atomically, or under the page-table lock the crate's callers hold.
pub(crate) unsafe trait TableFrames {
    /// The virtual address of the level-4 table.
    fn root_table(&self) -> Option<u64>;
    /// The virtual address at which the table frame at physical address
    /// `paddr` is mapped.
    fn table_of(&self, paddr: u64) -> Option<u64>;
}

/// A huge page that [`Walk::check_no_huge`] or
/// [`Walk::check_no_partial_huge`] met: the first address it maps and its
/// size in bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HugeAt {
    pub(crate) va: u64,
    pub(crate) size: u64,
}

/// Which tables a detach may take: those translating some of
/// `first..=last` whose span lies inside `floor..=top` (all last pages).
#[derive(Clone, Copy)]
struct Within {
    first: u64,
    last: u64,
    floor: u64,
    top: u64,
}

/// What the walk to one address found.
enum Slot<'t> {
    /// The entry at `level` is empty or unusable: nothing in the
    /// `span(level)` bytes around the address is mapped.
    Absent { level: u32 },
    /// The 4 KiB entry, in the leaf table at virtual address `table`.
    Page { entry: &'t AtomicU64, table: u64 },
    /// A huge page's entry at `level` (3: 1 GiB, 2: 2 MiB).
    Huge { entry: &'t AtomicU64, level: u32 },
}

/// The walk over the tables `F` reaches, for as long as they are borrowed.
pub(crate) struct Walk<'t, F: ?Sized> {
    frames: &'t F,
}

impl<'t, F: TableFrames + ?Sized> Walk<'t, F> {
    /// The walk over `frames`' tables.
    pub(crate) fn new(frames: &'t F) -> Self {
        Walk { frames }
    }

    /// `va` if a table can lie there: page-aligned, its page ending below
    /// the top of the address space, and addressable by a pointer.
    fn usable(va: Option<u64>) -> Option<u64> {
        let va = va?;
        let end = va.checked_add(PAGE_SIZE)?;
        (va % PAGE_SIZE == 0 && usize::try_from(end - 1).is_ok()).then_some(va)
    }

    /// The level-4 table's virtual address, if usable.
    fn root(&self) -> Option<u64> {
        Self::usable(self.frames.root_table())
    }

    /// The virtual address of the table the upper-level entry `raw` names,
    /// if usable.
    fn child(&self, raw: u64) -> Option<u64> {
        Self::usable(self.frames.table_of(raw & ADDR_MASK))
    }

    /// Entry `index` of the table at virtual address `table`.
    fn word(&self, table: u64, index: u64) -> Option<&'t AtomicU64> {
        if !table.is_multiple_of(PAGE_SIZE) || index >= ENTRIES {
            return None;
        }
        let addr = usize::try_from(table.checked_add(index * 8)?).ok()?;
        // SAFETY: `table` is `root` or `child` of an entry of these tables,
        // so by the contract of `TableFrames` a live, readable and writable
        // table page while `frames` is borrowed ('t). `index` < 512 and the
        // page alignment checked above keep the word inside it, 8-byte
        // aligned. `AtomicU64` has the size and alignment of the `u64`
        // entry, and the word is only ever accessed atomically here; other
        // writers change it only atomically or under the caller's lock (the
        // contract again), and x86 atomics on it are atomic with respect to
        // the MMU's locked updates of the accessed and dirty bits.
        Some(unsafe { &*(addr as *const AtomicU64) })
    }

    /// Walks from the root to the entry for `va`.
    fn slot(&self, va: u64) -> Slot<'t> {
        if !is_canonical(va, VA_BITS) {
            return Slot::Absent { level: 4 };
        }
        let Some(mut table) = self.root() else {
            return Slot::Absent { level: 4 };
        };
        for level in (2..=4).rev() {
            let Some(entry) = self.word(table, index(va, level)) else {
                return Slot::Absent { level };
            };
            let raw = entry.load(Ordering::SeqCst);
            if raw & PteFlags::PRESENT.bits() == 0 {
                return Slot::Absent { level };
            }
            if raw & HUGE != 0 {
                // Reserved at level 4: the walk faults, nothing is mapped.
                return match level {
                    4 => Slot::Absent { level },
                    _ => Slot::Huge { entry, level },
                };
            }
            match self.child(raw) {
                Some(next) => table = next,
                None => return Slot::Absent { level },
            }
        }
        match self.word(table, index(va, 1)) {
            Some(entry) => Slot::Page { entry, table },
            None => Slot::Absent { level: 1 },
        }
    }

    /// The 4 KiB piece at `va` of the huge entry `raw` at `level`: its
    /// frame, and the huge entry's flags with the page-size bit dropped and
    /// the PAT bit moved to bit 7, where a 4 KiB entry keeps it.
    fn huge_piece(raw: u64, level: u32, va: u64) -> Pte {
        let size = span(level);
        let frame = (raw & ADDR_MASK & !(size - 1)) | (va & (size - 1) & !(PAGE_SIZE - 1));
        let mut flags = raw & !ADDR_MASK & !HUGE;
        if raw & HUGE_PAT != 0 {
            flags |= HUGE;
        }
        Pte(frame | flags)
    }

    /// The entry for `va` as one atomic load (a huge page's 4 KiB piece),
    /// [`Pte::EMPTY`] where there is none.
    pub(crate) fn lookup(&self, va: u64) -> Pte {
        match self.slot(va) {
            Slot::Absent { .. } => Pte::EMPTY,
            Slot::Page { entry, .. } => Pte(entry.load(Ordering::SeqCst)),
            Slot::Huge { entry, level } => Self::huge_piece(entry.load(Ordering::SeqCst), level, va),
        }
    }

    /// The size of the entry that maps `va`: the huge page's where a
    /// level-3 or level-2 entry with the page-size bit maps it, 4 KiB
    /// otherwise (a leaf entry, or nothing mapped).
    pub(crate) fn entry_size(&self, va: u64) -> PageSize {
        match self.slot(va) {
            // `slot` answers `Huge` at levels 3 and 2 only.
            Slot::Huge { level: 3, .. } => PageSize::SIZE_1G,
            Slot::Huge { .. } => PageSize::SIZE_2M,
            Slot::Absent { .. } | Slot::Page { .. } => PageSize::SIZE_4K,
        }
    }

    /// Swaps `new` into the 4 KiB entry for `va` and answers the old one.
    /// At the first address of a huge page it swaps the whole huge entry,
    /// `new` and the answer in their 4 KiB view ([`Self::huge_word`] says
    /// which values a huge entry takes). Anywhere else (nothing mapped, or
    /// inside a huge page) it changes nothing and answers [`Pte::EMPTY`].
    pub(crate) fn exchange(&self, va: u64, new: Pte) -> Pte {
        match self.slot(va) {
            Slot::Page { entry, .. } => Pte(entry.swap(new.0, Ordering::SeqCst)),
            Slot::Huge { entry, level } => match Self::huge_word(new, level, va) {
                Some(word) => Self::huge_piece(entry.swap(word, Ordering::SeqCst), level, va),
                None => Pte::EMPTY,
            },
            Slot::Absent { .. } => Pte::EMPTY,
        }
    }

    /// The huge entry at `level` that `pte`, the 4 KiB view of its first
    /// page at `va`, stands for: `va` must be that first page's address,
    /// and `pte` either [`Pte::EMPTY`] (the entry cleared) or present with
    /// a frame aligned to the page's size, its PAT bit (bit 7 in the view)
    /// moved to bit 12 and the page-size bit set. `None` for anything else
    /// (a migration or hwpoison entry has no huge form here: a non-present
    /// upper-level entry would read as no table at all).
    fn huge_word(pte: Pte, level: u32, va: u64) -> Option<u64> {
        let size = span(level);
        if va & (size - 1) != 0 {
            return None;
        }
        if pte == Pte::EMPTY {
            return Some(0);
        }
        let addr = pte.0 & ADDR_MASK;
        if !pte.is_present() || addr & (size - 1) != 0 {
            return None;
        }
        // Bit 7 of the view is the PAT bit; in the huge entry it is the
        // page-size bit, and the PAT bit is bit 12.
        let flags = pte.0 & !ADDR_MASK & !HUGE;
        let pat = if pte.0 & HUGE != 0 { HUGE_PAT } else { 0 };
        Some(addr | flags | pat | HUGE)
    }

    /// Clears the accessed bit of the entry for `va` with one fetch-and and
    /// says whether it was set. A huge page has one bit for all its pieces.
    pub(crate) fn test_and_clear_accessed(&self, va: u64) -> bool {
        let accessed = PteFlags::ACCESSED.bits();
        match self.slot(va) {
            Slot::Page { entry, .. } | Slot::Huge { entry, .. } => {
                entry.fetch_and(!accessed, Ordering::SeqCst) & accessed != 0
            }
            Slot::Absent { .. } => false,
        }
    }

    /// Stores `pte` into the 4 KiB entry for `va`, if there is one, or
    /// into the huge entry whose first page is at `va`, as
    /// [`exchange`](Self::exchange) does.
    pub(crate) fn set(&self, va: u64, pte: Pte) {
        match self.slot(va) {
            Slot::Page { entry, .. } => entry.store(pte.0, Ordering::SeqCst),
            Slot::Huge { entry, level } => {
                if let Some(word) = Self::huge_word(pte, level, va) {
                    entry.store(word, Ordering::SeqCst);
                }
            }
            Slot::Absent { .. } => {}
        }
    }

    /// The first page of `range` whose entry word is not 0, or that a huge
    /// page maps; absent upper-level entries are stepped over whole.
    pub(crate) fn next_populated(&self, range: PageRange) -> Option<u64> {
        let last = range.last()?;
        let mut va = range.start();
        loop {
            let step = match self.slot(va) {
                Slot::Huge { .. } => return Some(va),
                Slot::Absent { level } => span(level),
                Slot::Page { table, .. } => {
                    // The rest of this leaf table, one word at a time.
                    let base = va & !(span(2) - 1);
                    for i in index(va, 1)..ENTRIES {
                        let page = base + i * PAGE_SIZE;
                        if page > last {
                            return None;
                        }
                        if self.word(table, i).is_some_and(|w| w.load(Ordering::SeqCst) != 0) {
                            return Some(page);
                        }
                    }
                    span(2)
                }
            };
            match next_boundary(va, step) {
                Some(next) if next <= last => va = next,
                _ => return None,
            }
        }
    }

    /// The first huge page that maps any of `range`, as an error. Reads the
    /// upper levels only: absent entries are stepped over whole and leaf
    /// tables are not read.
    pub(crate) fn check_no_huge(&self, range: PageRange) -> Result<(), HugeAt> {
        let Some(last) = range.last() else {
            return Ok(());
        };
        let mut va = range.start();
        loop {
            let level = match self.slot(va) {
                Slot::Huge { level, .. } => {
                    let size = span(level);
                    return Err(HugeAt {
                        va: va & !(size - 1),
                        size,
                    });
                }
                Slot::Absent { level } => level,
                // A leaf table: its whole 2 MiB has no huge page.
                Slot::Page { .. } => 2,
            };
            match next_boundary(va, span(level)) {
                Some(next) if next <= last => va = next,
                _ => return Ok(()),
            }
        }
    }

    /// The first huge page that maps part of `range` but not all of it, as
    /// an error: one that starts before the range, or ends after it. Such
    /// a page holds the range's first or its last page, so those two walks
    /// are all it reads; huge pages wholly inside the range pass.
    pub(crate) fn check_no_partial_huge(&self, range: PageRange) -> Result<(), HugeAt> {
        let Some(last) = range.last() else {
            return Ok(());
        };
        for va in [range.start(), last] {
            if let Slot::Huge { level, .. } = self.slot(va) {
                let size = span(level);
                let first = va & !(size - 1);
                let end = first.checked_add(size - PAGE_SIZE);
                if first < range.start() || end.is_none_or(|end| end > last) {
                    return Err(HugeAt { va: first, size });
                }
            }
        }
        Ok(())
    }

    /// Unlinks one table below the root whose words are all 0 and whose
    /// whole span lies in `range`, the deepest first (a parent empties only
    /// once its children are gone), and answers its frame and span.
    pub(crate) fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        self.detach_table_bounded(range, TableBounds::from_range(range))
    }

    /// Unlinks one table below the root whose words are all 0, that
    /// translates some of `range` and whose whole span lies within
    /// `bounds`, the deepest first, and answers its frame and span.
    /// [`detach_table`](Self::detach_table) is this with the bounds at the
    /// range itself.
    pub(crate) fn detach_table_bounded(
        &self,
        range: PageRange,
        bounds: TableBounds,
    ) -> Option<DetachedTable> {
        let within = Within {
            first: range.start(),
            last: range.last()?,
            floor: bounds.floor(),
            top: bounds.span().last()?,
        };
        let canonical = |va| is_canonical(va, VA_BITS);
        if ![within.first, within.last, within.floor, within.top]
            .into_iter()
            .all(canonical)
        {
            return None;
        }
        let root = self.root()?;
        (2..=4).find_map(|level| self.detach_below(root, 4, 0, within, level))
    }

    /// Unlinks the first empty table named by an entry at `level` (2: a
    /// leaf table; 3 and 4: tables of tables) below the table at `table`
    /// (at `table_level`, translating from `base`) that translates some of
    /// `first..=last` and whose span lies inside `floor..=top`.
    fn detach_below(
        &self,
        table: u64,
        table_level: u32,
        base: u64,
        within: Within,
        level: u32,
    ) -> Option<DetachedTable> {
        let Within {
            first,
            last,
            floor,
            top,
        } = within;
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
            let entry = self.word(table, i)?;
            let raw = entry.load(Ordering::SeqCst);
            if raw & PteFlags::PRESENT.bits() == 0 || raw & HUGE != 0 {
                continue;
            }
            // An unusable table address is an absent table, as in `slot`.
            let Some(child) = self.child(raw) else {
                continue;
            };
            if table_level != level {
                if let Some(found) = self.detach_below(child, table_level - 1, start, within, level) {
                    return Some(found);
                }
                continue;
            }
            // The entry's last page. The entries from `from` on translate
            // some of the range: they end at or after `first`, start at or
            // before `last`.
            let end = start.checked_add(entry_span - PAGE_SIZE);
            let inside = start >= floor && end.is_some_and(|e| e <= top);
            // Every word 0, then one compare-exchange unlinks it; an entry
            // changed meanwhile (the kernel mapped something again) stays.
            // The emptiness check is what keeps wrong bounds harmless: a
            // table that still maps a page is never detached.
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

    /// Whether every word of the table at `table` is 0.
    fn is_empty(&self, table: u64) -> bool {
        (0..ENTRIES).all(|i| self.word(table, i).is_some_and(|w| w.load(Ordering::SeqCst) == 0))
    }
}

/// The [`PageTable`](crate::PageTable) methods that are the walk's own
/// (`lookup`, `exchange`, `test_and_clear_accessed`, `set`,
/// `next_populated`), for an impl whose type answers its [`Walk`] from the
/// method `$walk`. The impl's `// SAFETY:` comment still says why they
/// keep the trait's contract.
macro_rules! walk_table_ops {
    ($walk:ident) => {
        fn lookup(&self, va: u64) -> $crate::Pte {
            self.$walk().lookup(va)
        }

        fn exchange(&self, va: u64, new: $crate::Pte) -> $crate::Pte {
            self.$walk().exchange(va, new)
        }

        fn test_and_clear_accessed(&self, va: u64) -> bool {
            self.$walk().test_and_clear_accessed(va)
        }

        fn set(&self, va: u64, pte: $crate::Pte) {
            self.$walk().set(va, pte);
        }

        fn next_populated(&self, range: $crate::PageRange) -> Option<u64> {
            self.$walk().next_populated(range)
        }

        fn entry_size(&self, va: u64) -> $crate::PageSize {
            self.$walk().entry_size(va)
        }
    };
}
pub(crate) use walk_table_ops;
