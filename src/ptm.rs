//! [`PageTable`] for the x86_64 page tables of the `page_table_multiarch`
//! crate (feature `page-table-multiarch`, x86_64 targets only).
//!
//! ArceOS and StarryOS build their address spaces with
//! `page_table_multiarch`: an [`X64PageTable<H>`] whose table frames come
//! from, and are reached through, the kernel's [`PagingHandler`] `H`. That
//! crate flushes the TLB of the CPU it runs on only (its cursor's `flush`),
//! so unmapping a page another CPU runs needs this crate's shootdown.
//! [`PtmSpace`] is such a table as this crate sees it: the kernel keeps
//! mapping pages with the table's cursor, and hands a `PtmSpace` to
//! [`try_to_unmap`](crate::try_to_unmap),
//! [`change_protection`](crate::change_protection), or, through
//! [`PtmTeardown`], to [`MmuGather::unmap_range`](crate::MmuGather::unmap_range).
//!
//! - **Reaching entries.** The root is the table's own
//!   [`root_paddr`](page_table_multiarch::PageTable64::root_paddr), and
//!   every table frame is found at [`PagingHandler::phys_to_virt`] of its
//!   physical address, as the table itself finds them. No fixed
//!   physical-memory offset is assumed.
//! - **Atomicity.** `page_table_multiarch` reads and writes entries as
//!   plain values behind `&`/`&mut` (`GenericPTE`), which is right for a
//!   table only one CPU changes under a lock, but an MMU sets accessed and
//!   dirty bits in those same words at any moment. This module therefore
//!   reads every entry word with an atomic load and changes it with one
//!   atomic operation (swap for [`exchange`](PageTable::exchange) and
//!   [`clear`](PageTable::clear), fetch-and for
//!   [`test_and_clear_accessed`](PageTable::test_and_clear_accessed),
//!   store for [`set`](PageTable::set)), viewing the word as an
//!   [`AtomicU64`] at its translated address. An x86 locked read-modify-write
//!   is atomic with respect to the page walker's own locked updates of the
//!   A/D bits, so no bit the hardware sets is lost (contract rule 4). The
//!   words are x86's hardware format (`X64PTE` is that word), decoded here
//!   bit by bit; the table's own decoders take a `&X64PTE`, which may not
//!   alias a word other CPUs write.
//! - **Huge pages.** The crate changes 4 KiB entries. A 2 MiB or 1 GiB
//!   mapping (the table's `map` with `PageSize::Size2M`/`Size1G`, or
//!   `map_region` with `allow_huge`) is reported present by
//!   [`lookup`](PageTable::lookup) (the 4 KiB piece at the address, so no
//!   frame of it is believed unmapped and freed) but never changed:
//!   [`exchange`](PageTable::exchange) answers [`Pte::EMPTY`] (nothing
//!   was removed, so [`try_to_unmap`](crate::try_to_unmap) answers
//!   [`SwapResult::Again`](crate::SwapResult::Again)), and
//!   [`set`](PageTable::set) leaves it alone. [`PtmSpace::check_no_huge`]
//!   refuses a range holding one with [`Error::HugePage`], and is the
//!   table's [`check_range`](PageTable::check_range): the range operations
//!   ([`change_protection`](crate::change_protection), a teardown through
//!   [`PtmTeardown`]) run it and refuse such a range before anything
//!   changes.
//! - **No panics.** An address the four-level table cannot translate (not
//!   48-bit canonical) has no entry ([`Pte::EMPTY`]); an entry whose table
//!   address the handler translates to something unusable (not
//!   page-aligned, beyond the address space) is treated as absent.
//!
//! `aarch64` is not covered: `page_table_multiarch`'s `A64PageTable` shares
//! the generic `PageTable64` code, but its descriptor format (valid and
//! table bits, access flag at bit 10, write permission and dirty state in
//! AP\[2\] and DBM) is not the crate's x86-layout [`Pte`], so it needs a
//! conversion at every exchange, not this module.
//!
//! See `docs/page-table-multiarch.md` for wiring a kernel, with a compiled
//! example.

use core::fmt;
use core::marker::PhantomData;
use core::sync::atomic::{AtomicU64, Ordering};

use page_table_multiarch::x86_64::X64PageTable;
use page_table_multiarch::PagingHandler;

use crate::mm::MmTlbState;
use crate::pte::{Pte, PteFlags, PAGE_SHIFT, PAGE_SIZE};
use crate::range::{is_canonical, PageRange};
use crate::rmap::PageTable;
use crate::Error;

// `PtmTeardown` and its `TableTeardown`: emptied tables detached.
mod teardown;

pub use teardown::PtmTeardown;

/// Bits 12 to 51 of an entry: the physical address it names.
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// Entries in one table.
const ENTRIES: u64 = 512;
/// Bit 7 of a level-3 or level-2 entry: it maps a 1 GiB or 2 MiB page.
const PAGE_SIZE_BIT: u64 = 1 << 7;
/// Bit 12 of a huge entry: its PAT bit (bit 7 in a 4 KiB entry).
const HUGE_PAT_BIT: u64 = 1 << 12;
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

/// The next multiple of `step` above `va`, across the non-canonical hole;
/// `None` past the top of the address space.
fn next_boundary(va: u64, step: u64) -> Option<u64> {
    let next = (va & !(step - 1)).checked_add(step)?;
    Some(if (LOWER_END..UPPER_HALF).contains(&next) {
        UPPER_HALF
    } else {
        next
    })
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

/// An address space whose page table is a `page_table_multiarch`
/// [`X64PageTable<H>`], with its [`MmTlbState`].
///
/// The [module documentation](self) says how entries are reached and
/// changed, and what happens to huge pages. It takes no lock of its own
/// ([`with_table_locked`](PageTable::with_table_locked) is the default):
/// a kernel that locks tables one by one wraps it.
pub struct PtmSpace<'a, H: PagingHandler> {
    /// The physical address of the level-4 table.
    root: u64,
    tlb: &'a MmTlbState,
    /// The table is borrowed for `'a` (by [`new`](Self::new), or by the
    /// promise of [`from_root`](Self::from_root)).
    _table: PhantomData<&'a mut X64PageTable<H>>,
}

impl<H: PagingHandler> fmt::Debug for PtmSpace<'_, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PtmSpace")
            .field("root", &format_args!("{:#x}", self.root))
            .field("asid", &self.tlb.asid())
            .finish()
    }
}

impl<'a, H: PagingHandler> PtmSpace<'a, H> {
    /// The address space `tlb`, translated by `table`. The table stays
    /// borrowed while the result lives, so no cursor changes it behind the
    /// crate's back; map more pages once the result is dropped.
    ///
    /// Safe for the reason the table's own safe methods are: they already
    /// read and write its frames wherever `H::phys_to_virt` says they are.
    /// A handler that translates wrongly breaks the table's cursor exactly
    /// as it breaks this.
    pub fn new(table: &'a mut X64PageTable<H>, tlb: &'a MmTlbState) -> Self {
        PtmSpace {
            root: table.root_paddr().as_usize() as u64,
            tlb,
            _table: PhantomData,
        }
    }

    /// The address space `tlb`, whose level-4 table is at physical address
    /// `root_paddr`: for a kernel that keeps its `X64PageTable` where it
    /// cannot lend `&mut` to it (behind its own lock, inside an address
    /// space type), and passes
    /// [`root_paddr`](page_table_multiarch::PageTable64::root_paddr).
    ///
    /// # Safety
    ///
    /// For `'a`: `root_paddr` is the root of a live x86_64 four-level
    /// table built by `X64PageTable<H>` (or to the same format); every
    /// table frame it and the tables below it name is mapped readable and
    /// writable at `H::phys_to_virt` of its physical address; no table
    /// frame is freed; and other code changes its entries only atomically
    /// or under the page-table lock the crate's callers hold (see
    /// [`PageTable`]): while the crate runs, no cursor of the table and no
    /// `query` or `walk` of it (plain reads and writes of the same words)
    /// runs on another CPU.
    pub unsafe fn from_root(root_paddr: usize, tlb: &'a MmTlbState) -> Self {
        PtmSpace {
            root: root_paddr as u64,
            tlb,
            _table: PhantomData,
        }
    }

    /// The physical address of the level-4 table (what CR3 is loaded with).
    pub fn root_paddr(&self) -> u64 {
        self.root
    }

    /// Refuses `range` with [`Error::HugePage`] (the first huge page met)
    /// when a 2 MiB or 1 GiB page maps any of it, since the crate's range
    /// operations would leave it unchanged; otherwise `Ok`. It reads upper
    /// levels only: absent entries are stepped over whole and leaf tables
    /// are not read.
    pub fn check_no_huge(&self, range: PageRange) -> Result<(), Error> {
        let Some(last) = range.last() else {
            return Ok(());
        };
        let mut va = range.start();
        loop {
            let level = match self.slot(va) {
                Slot::Huge { level, .. } => {
                    let size = span(level);
                    return Err(Error::HugePage {
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

    /// The virtual address at which the handler maps the table frame at
    /// physical address `paddr`, if it can hold a table there.
    fn table_at(paddr: u64) -> Option<u64> {
        let paddr = usize::try_from(paddr).ok()?;
        let va = H::phys_to_virt(paddr.into()).as_usize() as u64;
        (va % PAGE_SIZE == 0 && va.checked_add(PAGE_SIZE).is_some()).then_some(va)
    }

    /// Entry `index` of the table mapped at virtual address `table`.
    fn word(&self, table: u64, index: u64) -> Option<&AtomicU64> {
        if table % PAGE_SIZE != 0 || index >= ENTRIES {
            return None;
        }
        let addr = usize::try_from(table.checked_add(index * 8)?).ok()?;
        // SAFETY: `table` is `table_at` of the root or of a table frame an
        // entry below it names: by the promise of `new` (the table's own
        // use of `H::phys_to_virt`, and `&mut` to it held for 'a) or of
        // `from_root`, a live, readable and writable table page for 'a.
        // `index` < 512 and page alignment (checked above) keep the word
        // inside it, 8-byte aligned. `AtomicU64` has the size and alignment
        // of the `u64` an `X64PTE` is, and the word is only ever accessed
        // atomically while this value lives (the table's cursor, which
        // writes it plainly, is locked out by the borrow or by the caller
        // of `from_root`); x86 atomics on it are atomic with respect to the
        // MMU's locked A/D updates and other CPUs.
        Some(unsafe { &*(addr as *const AtomicU64) })
    }

    /// Walks from the root to the entry for `va`.
    fn slot(&self, va: u64) -> Slot<'_> {
        if !is_canonical(va, VA_BITS) {
            return Slot::Absent { level: 4 };
        }
        let Some(mut table) = Self::table_at(self.root) else {
            return Slot::Absent { level: 4 };
        };
        for level in (1..=4).rev() {
            let Some(entry) = self.word(table, index(va, level)) else {
                return Slot::Absent { level };
            };
            if level == 1 {
                return Slot::Page { entry, table };
            }
            let raw = entry.load(Ordering::SeqCst);
            if raw & PteFlags::PRESENT.bits() == 0 {
                return Slot::Absent { level };
            }
            if raw & PAGE_SIZE_BIT != 0 {
                // Reserved at level 4: the walk faults, nothing is mapped.
                return match level {
                    4 => Slot::Absent { level },
                    _ => Slot::Huge { entry, level },
                };
            }
            match Self::table_at(raw & ADDR_MASK) {
                Some(next) => table = next,
                None => return Slot::Absent { level },
            }
        }
        Slot::Absent { level: 1 }
    }

    /// The 4 KiB piece at `va` of the huge entry `raw` at `level`: its
    /// frame, and the huge entry's flags with the page-size bit dropped and
    /// the PAT bit moved to bit 7, where a 4 KiB entry keeps it.
    fn piece_of(raw: u64, level: u32, va: u64) -> Pte {
        let size = span(level);
        let frame = (raw & ADDR_MASK & !(size - 1)) | (va & (size - 1) & !(PAGE_SIZE - 1));
        let mut flags = raw & !ADDR_MASK & !PAGE_SIZE_BIT;
        if raw & HUGE_PAT_BIT != 0 {
            flags |= PAGE_SIZE_BIT;
        }
        Pte(frame | flags)
    }
}

// SAFETY: `exchange` (and so `clear`) is one atomic swap and
// `test_and_clear_accessed` one atomic fetch-and on the hardware entry
// word (see `word`), so a bit the MMU sets is in the old value or in the
// new entry; `lookup` is one atomic load of that word (a huge page's piece
// reported present, never as unmapped); `tlb_state` is the state given
// with the table; `next_populated` skips only addresses without a table or
// whose entry word is 0, which `lookup` reports as `Pte::EMPTY`; `check_range`
// refuses every range a huge entry maps any of;
// `with_table_locked` is the default, which runs `body` once.
unsafe impl<H: PagingHandler> PageTable for PtmSpace<'_, H> {
    fn tlb_state(&self) -> &MmTlbState {
        self.tlb
    }

    fn lookup(&self, va: u64) -> Pte {
        match self.slot(va) {
            Slot::Absent { .. } => Pte::EMPTY,
            Slot::Page { entry, .. } => Pte(entry.load(Ordering::SeqCst)),
            Slot::Huge { entry, level } => Self::piece_of(entry.load(Ordering::SeqCst), level, va),
        }
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        match self.slot(va) {
            Slot::Page { entry, .. } => Pte(entry.swap(new.0, Ordering::SeqCst)),
            // No 4 KiB entry: nothing removed, a huge page left whole.
            Slot::Absent { .. } | Slot::Huge { .. } => Pte::EMPTY,
        }
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        let accessed = PteFlags::ACCESSED.bits();
        match self.slot(va) {
            // One accessed bit serves every piece of a huge page.
            Slot::Page { entry, .. } | Slot::Huge { entry, .. } => {
                entry.fetch_and(!accessed, Ordering::SeqCst) & accessed != 0
            }
            Slot::Absent { .. } => false,
        }
    }

    fn set(&self, va: u64, pte: Pte) {
        if let Slot::Page { entry, .. } = self.slot(va) {
            entry.store(pte.0, Ordering::SeqCst);
        }
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
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

    /// Refuses a range any of which a huge page maps, with
    /// [`Error::HugePage`] ([`check_no_huge`](PtmSpace::check_no_huge)):
    /// the range operations change 4 KiB entries and would skip it.
    fn check_range(&self, range: PageRange) -> Result<(), Error> {
        self.check_no_huge(range)
    }
}
