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
//!   [`AtomicU64`](core::sync::atomic::AtomicU64) at its translated address. An x86 locked read-modify-write
//!   is atomic with respect to the page walker's own locked updates of the
//!   A/D bits, so no bit the hardware sets is lost (contract rule 4). The
//!   words are x86's hardware format (`X64PTE` is that word), decoded here
//!   bit by bit; the table's own decoders take a `&X64PTE`, which may not
//!   alias a word other CPUs write.
//! - **Huge pages.** A 2 MiB or 1 GiB mapping (the table's `map` with
//!   `PageSize::Size2M`/`Size1G`, or `map_region` with `allow_huge`) is
//!   one entry: [`lookup`](PageTable::lookup) reports it present at every
//!   address (the 4 KiB piece there, so no frame of it is believed
//!   unmapped and freed), [`entry_size`](PageTable::entry_size) its size,
//!   and [`exchange`](PageTable::exchange) and [`set`](PageTable::set)
//!   change it whole at its first address only (elsewhere an exchange
//!   answers [`Pte::EMPTY`]: nothing was removed). The reverse-map walks
//!   take a mapping of it at its first address whole; the range
//!   operations ([`change_protection`](crate::change_protection), a
//!   teardown through [`PtmTeardown`]) take one the range covers wholly
//!   as one entry, and refuse a range that covers part of one with
//!   [`Error::HugePage`] before anything changes
//!   ([`PtmSpace::check_no_partial_huge`], the table's
//!   [`check_range`](PageTable::check_range)). [`PtmSpace::check_no_huge`]
//!   refuses a range holding any huge page.
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
//!
//! [`Pte::EMPTY`]: crate::Pte::EMPTY
//! [`Pte`]: crate::Pte

use core::fmt;
use core::marker::PhantomData;

use page_table_multiarch::x86_64::X64PageTable;
use page_table_multiarch::PagingHandler;

use crate::mm::MmTlbState;
use crate::range::PageRange;
use crate::rmap::PageTable;
use crate::x86_walk::{walk_table_ops, TableFrames, Walk};
use crate::Error;

// `PtmTeardown` and its `TableTeardown`: emptied tables detached.
mod teardown;

pub use teardown::PtmTeardown;

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
    /// when a 2 MiB or 1 GiB page maps any of it, wholly or in part;
    /// otherwise `Ok`: for a caller whose next step handles 4 KiB frames
    /// only. The range operations take a wholly covered huge page as one
    /// entry ([`check_no_partial_huge`](Self::check_no_partial_huge)). It
    /// reads upper levels only: absent entries are stepped over whole and
    /// leaf tables are not read.
    pub fn check_no_huge(&self, range: PageRange) -> Result<(), Error> {
        self.walk().check_no_huge(range).map_err(|huge| Error::HugePage {
            va: huge.va,
            size: huge.size,
        })
    }

    /// Refuses `range` with [`Error::HugePage`] when a 2 MiB or 1 GiB page
    /// maps part of it but not all of it (it starts before the range or
    /// ends after it); huge pages inside the range pass. This is the
    /// table's [`check_range`](PageTable::check_range): the range
    /// operations take a huge page whole, one entry. It reads two walks,
    /// to the range's first and last pages (such a page holds one of them).
    pub fn check_no_partial_huge(&self, range: PageRange) -> Result<(), Error> {
        self.walk()
            .check_no_partial_huge(range)
            .map_err(|huge| Error::HugePage {
                va: huge.va,
                size: huge.size,
            })
    }

    /// The shared four-level walk over this table.
    fn walk(&self) -> Walk<'_, Self> {
        Walk::new(self)
    }
}

// SAFETY: `H::phys_to_virt` of the root and of every table frame an entry
// below it names is, by the promise of `new` (the table's own use of the
// handler, and `&mut` to it held for 'a) or of `from_root`, a live,
// readable and writable table page while this value lives; no table frame
// is freed meanwhile, and the table's cursor, which writes words plainly,
// is locked out by the borrow or by the caller of `from_root`.
unsafe impl<H: PagingHandler> TableFrames for PtmSpace<'_, H> {
    fn root_table(&self) -> Option<u64> {
        self.table_of(self.root)
    }

    fn table_of(&self, paddr: u64) -> Option<u64> {
        let paddr = usize::try_from(paddr).ok()?;
        Some(H::phys_to_virt(paddr.into()).as_usize() as u64)
    }
}

// SAFETY: `exchange` (and so `clear`) is one atomic swap and
// `test_and_clear_accessed` one atomic fetch-and on the hardware entry
// word (the shared `Walk` over this space's `TableFrames`), so a bit the
// MMU sets is in the old value or in the new entry; `lookup` is one atomic
// load of that word (a huge page's piece reported present, never as
// unmapped); `tlb_state` is the state given with the table;
// `next_populated` skips only addresses without a table or whose entry
// word is 0, which `lookup` reports as `Pte::EMPTY`; `check_range` refuses
// every range a huge entry maps part of; `with_table_locked` is the
// default, which runs `body` once.
unsafe impl<H: PagingHandler> PageTable for PtmSpace<'_, H> {
    fn tlb_state(&self) -> &MmTlbState {
        self.tlb
    }

    walk_table_ops!(walk);

    /// Refuses a range that a huge page maps part of but not all of, with
    /// [`Error::HugePage`] ([`check_no_partial_huge`](PtmSpace::check_no_partial_huge)):
    /// the range operations take a huge page whole, one entry.
    fn check_range(&self, range: PageRange) -> Result<(), Error> {
        self.check_no_partial_huge(range)
    }
    fn root(&self) -> Option<u64> {
        Some(self.root)
    }
}
