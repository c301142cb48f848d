//! [`PageTable`] for page tables built with the `x86_64` crate's
//! [`OffsetPageTable`] (feature `x86_64-mapper`).
//!
//! Most Rust hobby kernels map their pages with the `x86_64` crate: a
//! four-level table reached through a physical-memory offset (all of
//! physical memory mapped at one virtual offset). [`OffsetSpace`] puts the
//! crate's operations on top of such a table: the kernel keeps mapping
//! pages with [`Mapper::map_to`](x86_64::structures::paging::Mapper::map_to)
//! and hands an `OffsetSpace` to [`try_to_unmap`](crate::try_to_unmap),
//! [`change_protection`](crate::change_protection) or
//! [`MmuGather::unmap_range`](crate::MmuGather::unmap_range) (through
//! [`OffsetTeardown`]). A munmap is [`OffsetTeardown::munmap`], freeing
//! into the kernel's `FrameDeallocator` through [`DeallocatorFrees`].
//!
//! - Every change to a 4 KiB entry is one atomic operation on the entry's
//!   64-bit word (swap, fetch-and, store), so an accessed or dirty bit the
//!   hardware sets at the same moment is never lost (contract rule 4). The
//!   `x86_64` crate's `PageTableEntry` is a plain `u64` behind `&mut`; this
//!   module reaches the same word through the physical-memory offset and
//!   works on it as an `AtomicU64`.
//! - [`next_populated`](PageTable::next_populated) follows the tables:
//!   an absent level-4, level-3 or level-2 entry is stepped over whole (512
//!   GiB, 1 GiB, 2 MiB at a time), and empty entries of a leaf table are
//!   skipped there, so a sparse range costs what is mapped.
//! - A 2 MiB or 1 GiB page is one entry. [`lookup`](PageTable::lookup)
//!   reports it at every address as the 4 KiB piece there (so no frame of
//!   it is ever believed unmapped and freed), and
//!   [`entry_size`](PageTable::entry_size) its size;
//!   [`exchange`](PageTable::exchange), [`clear`](PageTable::clear) and
//!   [`set`](PageTable::set) change it whole at its first address, in its
//!   4 KiB view, and nowhere else (elsewhere an exchange answers
//!   [`Pte::EMPTY`]: nothing was removed, so nothing is freed). The
//!   reverse-map walks ([`try_to_unmap`](crate::try_to_unmap),
//!   [`page_referenced`](crate::page_referenced)) take a mapping of it at
//!   its first address whole, and the range operations
//!   ([`change_protection`](crate::change_protection), a teardown through
//!   [`OffsetTeardown`]) take one the range covers wholly as one entry;
//!   a range that covers part of one is refused with
//!   [`Error::HugePage`](crate::Error::HugePage) before anything changes
//!   ([`OffsetSpace::check_no_partial_huge`], the table's
//!   [`check_range`](PageTable::check_range)): split it first.
//!   [`OffsetSpace::check_no_huge`] refuses a range holding any huge page
//!   with [`MapperError::HugePage`] (it converts into the crate's
//!   [`Error`](crate::Error)); [`OffsetTeardown::munmap`] runs it, since
//!   its frees go to a 4 KiB frame deallocator.
//! - Nothing here panics: an address a four-level table cannot translate
//!   (not canonical with 48 bits) has no entry ([`Pte::EMPTY`]), and an
//!   entry whose table address is unusable is treated as absent.
//!
//! Frames and flags convert both ways: [`Frame`] from a
//! [`PhysFrame`] of any size (its first 4 KiB frame) and back with
//! `PhysFrame::try_from` ([`MapperError::FrameOutOfRange`] above 52 bits
//! of physical address), [`PteFlags`](crate::PteFlags) from
//! [`PageTableFlags`] (bits the crate does not name are dropped) and back
//! (every flag has its bit).
//!
//! # Example
//!
//! A four-level table in ordinary host memory (so the physical-memory
//! offset is 0), a page mapped with the `x86_64` crate, then write-protected
//! through the crate on a simulated two-CPU machine (feature `mock`). No
//! CPU runs the space here, so the change needs no IPI; for the machine's
//! CPUs to translate through such a table (and its oracle to judge the
//! flushes), a test gives the machine its own walk of the same tables
//! with `MockMachine::attach_table` and switches CPUs to the space.
//!
//! ```
//! # #[cfg(feature = "mock")] {
//! use tlb_batch::arch::mock::{MockConfig, MockMachine};
//! use tlb_batch::mapper::OffsetSpace;
//! use tlb_batch::{change_protection, Asid, Frame, PageRange, PageTable, PteFlags};
//! use x86_64::structures::paging::{
//!     FrameAllocator, Mapper, OffsetPageTable, Page, PageTable as X86Table, PageTableFlags,
//!     PhysFrame, Size4KiB,
//! };
//! use x86_64::{PhysAddr, VirtAddr};
//!
//! // Page-table frames come from a pool of 4 KiB-aligned host pages: with
//! // an offset of 0, a frame's "physical" address is its host address.
//! struct Pool(Vec<Box<X86Table>>);
//! unsafe impl FrameAllocator<Size4KiB> for Pool {
//!     fn allocate_frame(&mut self) -> Option<PhysFrame> {
//!         self.0.push(Box::new(X86Table::new()));
//!         let addr = &**self.0.last()? as *const X86Table as u64;
//!         PhysFrame::from_start_address(PhysAddr::new(addr)).ok()
//!     }
//! }
//!
//! let machine = MockMachine::new(MockConfig::x86_like(2)).unwrap();
//! let mut pool = Pool(Vec::new());
//! let mut root = Box::new(X86Table::new());
//! // The state holds the root CR3 would be loaded with: the level-4
//! // table's physical address (here its host address).
//! let root_paddr = &*root as *const X86Table as u64;
//! let mm = machine.new_mm_at(Asid::new(1).unwrap(), root_paddr).unwrap();
//! // SAFETY: every table frame the mapper meets is a live host page of
//! // `pool` or `root`, at its own address (offset 0).
//! let mut mapper = unsafe { OffsetPageTable::new(&mut root, VirtAddr::new(0)) };
//!
//! let va = 0x40_0000;
//! let data = Frame(0x1234);
//! let flags = PageTableFlags::PRESENT | PageTableFlags::WRITABLE | PageTableFlags::USER_ACCESSIBLE;
//! let page = Page::<Size4KiB>::containing_address(VirtAddr::new(va));
//! let frame = PhysFrame::try_from(data).unwrap();
//! // SAFETY: the frame is not mapped anywhere else; the address space is
//! // not loaded on any CPU, so there is nothing to flush.
//! unsafe { mapper.map_to(page, frame, flags, &mut pool) }.unwrap().ignore();
//!
//! let space = OffsetSpace::new(&mut mapper, &mm);
//! assert!(space.lookup(va).maps(data));
//! let cpu0 = machine.cpu(0).unwrap();
//! let range = PageRange::page(va).unwrap();
//! space.check_no_huge(range).unwrap();
//! let changed = change_protection(&cpu0, &space, range, |p| {
//!     tlb_batch::Pte(p.0 & !PteFlags::WRITABLE.bits())
//! })
//! .unwrap();
//! assert_eq!(changed, 1);
//! assert!(space.lookup(va).maps(data) && !space.lookup(va).is_writable());
//! # }
//! ```
//!
//! [`Pte::EMPTY`]: crate::Pte::EMPTY

// The docs name the `x86_64` crate's items, which only `x86_64-mapper`
// brings in: with `offset-tables` alone they print as plain names.
#![cfg_attr(not(feature = "x86_64-mapper"), allow(rustdoc::broken_intra_doc_links))]

use core::fmt;
use core::marker::PhantomData;

// For the docs' links to the `x86_64` crate's items.
#[cfg(feature = "x86_64-mapper")]
#[allow(unused_imports)]
use x86_64::structures::paging::{OffsetPageTable, PageTableFlags, PhysFrame};

use crate::mm::MmTlbState;
use crate::pte::Frame;
use crate::range::PageRange;
use crate::rmap::PageTable;
use crate::x86_walk::{walk_table_ops, TableFrames, Walk, ENTRIES};

// The teardown view of an `OffsetSpace` (`for_teardown`) and its
// `TableTeardown`, which detaches emptied page-table frames.
mod teardown;
// What needs the `x86_64` crate itself (feature `x86_64-mapper`): the
// constructors from its types and the conversions into them.
#[cfg(feature = "x86_64-mapper")]
mod x86_64_types;
// `DeallocatorFrees`: the crate's frees into a `FrameDeallocator`.
#[cfg(feature = "x86_64-mapper")]
mod dealloc;
// `OffsetTeardown::munmap`.
#[cfg(feature = "x86_64-mapper")]
mod munmap;
#[cfg(feature = "x86_64-mapper")]
pub mod xapic;

#[cfg(feature = "x86_64-mapper")]
pub use dealloc::DeallocatorFrees;
pub use teardown::OffsetTeardown;

/// What this module refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MapperError {
    /// A 2 MiB or 1 GiB page maps `va`: the crate changes 4 KiB entries
    /// only, so split or unmap it first.
    HugePage {
        /// The first page of the range the huge page maps.
        va: u64,
        /// Its size in bytes.
        size: u64,
    },
    /// A frame whose physical address does not fit in 52 bits.
    FrameOutOfRange {
        /// The frame that was given.
        frame: Frame,
    },
}

impl fmt::Display for MapperError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            MapperError::HugePage { va, size } => {
                write!(f, "a huge page of {size:#x} bytes maps {va:#x}")
            }
            MapperError::FrameOutOfRange { frame } => {
                write!(f, "{frame:?} lies beyond 52 bits of physical address")
            }
        }
    }
}

impl core::error::Error for MapperError {}

impl From<MapperError> for crate::Error {
    /// The same refusal: [`Error::HugePage`](crate::Error::HugePage) or
    /// [`Error::FrameOutOfRange`](crate::Error::FrameOutOfRange), with the
    /// same fields.
    fn from(err: MapperError) -> crate::Error {
        match err {
            MapperError::HugePage { va, size } => crate::Error::HugePage { va, size },
            MapperError::FrameOutOfRange { frame } => crate::Error::FrameOutOfRange { frame },
        }
    }
}

/// An address space whose page table the `x86_64` crate built: a
/// four-level table with every page-table frame reachable at a fixed
/// physical-memory offset ([`OffsetPageTable`]), and the address space's
/// [`MmTlbState`].
///
/// See the [module documentation](self) for what it does with huge pages
/// and addresses it cannot translate. It takes no lock of its own
/// ([`with_table_locked`](PageTable::with_table_locked) is the default):
/// a kernel with split page-table locks wraps it.
pub struct OffsetSpace<'a> {
    /// The level-4 table's virtual address.
    level_4: u64,
    /// The virtual address of physical address 0.
    offset: u64,
    tlb: &'a MmTlbState,
    /// The tables are borrowed (through the mapper, or by the promise of
    /// [`from_raw_parts`](Self::from_raw_parts)) for `'a`.
    _tables: PhantomData<&'a mut [u64; ENTRIES as usize]>,
}

impl fmt::Debug for OffsetSpace<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OffsetSpace")
            .field("level_4", &format_args!("{:#x}", self.level_4))
            .field("offset", &format_args!("{:#x}", self.offset))
            .field("asid", &self.tlb.asid())
            .finish()
    }
}

impl<'a> OffsetSpace<'a> {
    /// The address space `tlb` whose level-4 table is at virtual address
    /// `level_4_table`, with physical memory mapped at `phys_offset`: the
    /// form that needs no type of the `x86_64` crate, for a kernel that
    /// uses another version of it (0.14, say: pass
    /// `mapper.level_4_table() as *const _ as u64` and
    /// `mapper.phys_offset().as_u64()`) or builds its tables itself. With
    /// the feature `x86_64-mapper`, `new` and `from_raw_parts` take the
    /// `x86_64` crate's types instead.
    ///
    /// # Safety
    ///
    /// For `'a`: the level-4 table is a live, 4 KiB-aligned table at
    /// `level_4_table`, every page-table frame an entry below it names is
    /// mapped (readable and writable) at `phys_offset` plus its physical
    /// address, and no table frame is freed. Other code changes entries
    /// only atomically, or under the page-table lock the crate's callers
    /// hold (see [`PageTable`]). These are the promises the `x86_64`
    /// crate's `OffsetPageTable::new` asks for, for as long as this value
    /// lives.
    pub unsafe fn from_addresses(level_4_table: u64, phys_offset: u64, tlb: &'a MmTlbState) -> Self {
        OffsetSpace {
            level_4: level_4_table,
            offset: phys_offset,
            tlb,
            _tables: PhantomData,
        }
    }

    /// Refuses `range` with [`MapperError::HugePage`] (the first one) when
    /// a 2 MiB or 1 GiB page maps any of it, wholly or in part: for a
    /// caller whose next step handles 4 KiB frames only
    /// ([`OffsetTeardown::munmap`] runs it, since its frees go to a
    /// `FrameDeallocator<Size4KiB>`). The range operations themselves take
    /// a wholly covered huge page as one entry
    /// ([`check_no_partial_huge`](Self::check_no_partial_huge)). Cost
    /// follows the upper levels of the table: absent entries are stepped
    /// over whole, and leaf tables are not read.
    pub fn check_no_huge(&self, range: PageRange) -> Result<(), MapperError> {
        self.walk()
            .check_no_huge(range)
            .map_err(|huge| MapperError::HugePage {
                va: huge.va,
                size: huge.size,
            })
    }

    /// Refuses `range` with [`MapperError::HugePage`] when a 2 MiB or
    /// 1 GiB page maps part of it but not all of it (it starts before the
    /// range or ends after it): the crate's range operations take a huge
    /// page whole, so they take only one the range covers wholly. Huge
    /// pages inside the range pass. It reads two walks, to the range's
    /// first and last pages (such a page holds one of them). This is the
    /// table's [`check_range`](PageTable::check_range); unlike
    /// [`check_no_huge`](Self::check_no_huge), which refuses every huge
    /// page (what [`OffsetTeardown::munmap`] needs: its frees go to a
    /// 4 KiB frame deallocator).
    pub fn check_no_partial_huge(&self, range: PageRange) -> Result<(), MapperError> {
        self.walk()
            .check_no_partial_huge(range)
            .map_err(|huge| MapperError::HugePage {
                va: huge.va,
                size: huge.size,
            })
    }

    /// The shared four-level walk over these tables.
    fn walk(&self) -> Walk<'_, Self> {
        Walk::new(self)
    }
}

// SAFETY: the level-4 table's address and `offset` plus a table frame's
// physical address are, by the promise of `new` (`OffsetPageTable::new`'s,
// with the mapper borrowed for 'a) or of `from_addresses`/`from_raw_parts`,
// live, writable page-table pages while this value lives, none is freed,
// and the kernel changes them through its mapper only where the crate is
// not running (the mapper is borrowed, or the caller's lock is held).
unsafe impl TableFrames for OffsetSpace<'_> {
    fn root_table(&self) -> Option<u64> {
        Some(self.level_4)
    }

    fn table_of(&self, paddr: u64) -> Option<u64> {
        self.offset.checked_add(paddr)
    }
}

// SAFETY: `exchange` is one atomic swap and `test_and_clear_accessed` one
// atomic fetch-and on the entry word the MMU updates (the shared `Walk`
// over this space's `TableFrames`), so a bit the hardware sets is in the
// old value or in the new entry; `lookup` loads the word as it is (a huge
// page's piece as present, so it is never taken for unmapped);
// `tlb_state` is the state given for this table;
// `next_populated` skips only what has no table or whose words are 0, which
// `lookup` reports as `Pte::EMPTY`; `with_table_locked` is the default,
// which calls `body` once.
unsafe impl PageTable for OffsetSpace<'_> {
    fn tlb_state(&self) -> &MmTlbState {
        self.tlb
    }

    walk_table_ops!(walk);

    /// Refuses a range that a huge page maps part of but not all of
    /// ([`check_no_partial_huge`](OffsetSpace::check_no_partial_huge), as
    /// [`Error::HugePage`](crate::Error::HugePage)): the crate's range
    /// operations take a huge page whole, one entry, so they cannot take a
    /// piece of one.
    fn check_range(&self, range: PageRange) -> Result<(), crate::Error> {
        self.check_no_partial_huge(range).map_err(crate::Error::from)
    }
    /// The level-4 table's physical address, its virtual address less the
    /// offset: the table is reached through the offset mapping, as a
    /// kernel's `active_level_4_table` (CR3's frame plus the offset) does.
    fn root(&self) -> Option<u64> {
        self.level_4.checked_sub(self.offset)
    }
}
