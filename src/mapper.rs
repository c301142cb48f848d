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
//! - The crate works on 4 KiB entries, and an entry of a 2 MiB or 1 GiB
//!   page cannot be changed one 4 KiB piece at a time. Such a mapping is
//!   reported as present ([`lookup`](PageTable::lookup) shows the 4 KiB
//!   piece at the address, so no frame of it is ever believed unmapped and
//!   freed) but never changed: [`exchange`](PageTable::exchange),
//!   [`clear`](PageTable::clear) and [`set`](PageTable::set) leave it
//!   alone (an exchange answers [`Pte::EMPTY`]: no 4 KiB entry was removed,
//!   so nothing is freed and [`try_to_unmap`](crate::try_to_unmap) answers
//!   [`SwapResult::Again`](crate::SwapResult::Again)).
//!   [`OffsetSpace::check_no_huge`] refuses a range holding one with
//!   [`MapperError::HugePage`] (it converts into the crate's
//!   [`Error`](crate::Error)), and the range operations,
//!   [`change_protection`](crate::change_protection) and a teardown
//!   through [`OffsetTeardown`], run it themselves
//!   ([`PageTable::check_range`]) and refuse such a range
//!   ([`Error::HugePage`](crate::Error::HugePage)) before they change
//!   anything: split or unmap huge pages with the `x86_64` crate first.
//! - Nothing here panics: an address a four-level table cannot translate
//!   (not canonical with 48 bits) has no entry ([`Pte::EMPTY`]), and an
//!   entry whose table address is unusable is treated as absent.
//!
//! Frames and flags convert both ways: [`Frame`] from a
//! [`PhysFrame`] of any size (its first 4 KiB frame) and back with
//! `PhysFrame::try_from` ([`MapperError::FrameOutOfRange`] above 52 bits
//! of physical address), [`PteFlags`] from [`PageTableFlags`] (bits the
//! crate does not name are dropped) and back (every flag has its bit).
//!
//! # Example
//!
//! A four-level table in ordinary host memory (so the physical-memory
//! offset is 0), a page mapped with the `x86_64` crate, then write-protected
//! through the crate on a simulated two-CPU machine (feature `mock`).
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
//! let mm = machine.new_mm(Asid::new(1).unwrap()).unwrap();
//! let mut pool = Pool(Vec::new());
//! let mut root = Box::new(X86Table::new());
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

// The docs name the `x86_64` crate's items, which only `x86_64-mapper`
// brings in: with `offset-tables` alone they print as plain names.
#![cfg_attr(not(feature = "x86_64-mapper"), allow(rustdoc::broken_intra_doc_links))]

use core::fmt;
use core::marker::PhantomData;
use core::sync::atomic::{AtomicU64, Ordering};

// For the docs' links to the `x86_64` crate's items.
#[cfg(feature = "x86_64-mapper")]
#[allow(unused_imports)]
use x86_64::structures::paging::{OffsetPageTable, PageTableFlags, PhysFrame};

use crate::mm::MmTlbState;
use crate::pte::{Frame, Pte, PteFlags, PAGE_SHIFT, PAGE_SIZE};
use crate::range::{is_canonical, PageRange};
use crate::rmap::PageTable;

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

/// The physical-address bits of an entry (bits 12 to 51).
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// Entries per table.
const ENTRIES: u64 = 512;
/// The page-size bit of a level-3 or level-2 entry (a 1 GiB or 2 MiB page).
const HUGE: u64 = 1 << 7;
/// The PAT bit of a huge entry (bit 7 in a 4 KiB entry).
const HUGE_PAT: u64 = 1 << 12;
/// Virtual-address bits a four-level table translates.
const VA_BITS: u32 = 48;
/// The first address of the upper half.
const UPPER_HALF: u64 = 0xffff_8000_0000_0000;
/// The first address past the lower half.
const LOWER_END: u64 = 0x0000_8000_0000_0000;

/// Bytes one entry at `level` maps (level 1: a 4 KiB page).
const fn span(level: u32) -> u64 {
    PAGE_SIZE << (9 * (level - 1))
}

/// The index of `va`'s entry in its table at `level`.
const fn index(va: u64, level: u32) -> u64 {
    (va >> (PAGE_SHIFT + 9 * (level - 1))) & (ENTRIES - 1)
}

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

/// Where the entry for an address is.
enum Slot<'t> {
    /// No table holds it: the entry at `level` is empty (or unusable), so
    /// the whole `span(level)` around the address has no entry.
    Absent { level: u32 },
    /// A 4 KiB entry, in the leaf table at virtual address `table`.
    Page { entry: &'t AtomicU64, table: u64 },
    /// A huge page's entry at `level` (3: 1 GiB, 2: 2 MiB).
    Huge { entry: &'t AtomicU64, level: u32 },
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
    /// a 2 MiB or 1 GiB page maps any of it: the crate's range operations
    /// leave such pages unchanged. Cost follows the upper levels of the
    /// table: absent entries are stepped over whole, and leaf tables are
    /// not read.
    pub fn check_no_huge(&self, range: PageRange) -> Result<(), MapperError> {
        let Some(last) = range.last() else {
            return Ok(());
        };
        let mut va = range.start();
        loop {
            let level = match self.slot(va) {
                Slot::Huge { level, .. } => {
                    return Err(MapperError::HugePage {
                        va: va & !(span(level) - 1),
                        size: span(level),
                    })
                }
                Slot::Absent { level } => level,
                Slot::Page { .. } => 2,
            };
            match next_boundary(va, span(level)) {
                Some(next) if next <= last => va = next,
                _ => return Ok(()),
            }
        }
    }

    /// The entry word at `index` of the table whose virtual address is
    /// `table`, or `None` if that address cannot hold a table.
    fn word(&self, table: u64, index: u64) -> Option<&AtomicU64> {
        if table % PAGE_SIZE != 0 || index >= ENTRIES {
            return None;
        }
        let addr = table.checked_add(index * 8)?;
        let ptr = usize::try_from(addr).ok()? as *const AtomicU64;
        // SAFETY: `table` is the level-4 table's address or the offset
        // mapping of a table frame an entry below it names; by the promise
        // of `new` (`OffsetPageTable::new`'s, and the mapper borrowed for
        // 'a) or of `from_raw_parts`, that is a live, writable page-table
        // page for 'a, and `index` < 512 keeps the word inside it, 8-byte
        // aligned (the table is page-aligned, checked above). Hardware and
        // other CPUs change these words too, which is why they are only
        // ever accessed atomically here: `AtomicU64` has the layout of the
        // `u64` the x86_64 crate's `PageTableEntry` wraps, and an x86
        // atomic RMW on it is atomic with respect to the MMU's own locked
        // updates of accessed and dirty bits. The kernel changes the table
        // through its mapper only where the crate is not running (the
        // mapper is borrowed by `new`; `from_raw_parts` puts it under the
        // caller's lock).
        Some(unsafe { &*ptr })
    }

    /// The virtual address of the table an upper-level entry names.
    fn next_table(&self, raw: u64) -> Option<u64> {
        self.offset.checked_add(raw & ADDR_MASK)
    }

    /// Walks to the entry for `va`.
    fn slot(&self, va: u64) -> Slot<'_> {
        if !is_canonical(va, VA_BITS) {
            return Slot::Absent { level: 4 };
        }
        let mut table = self.level_4;
        let mut level = 4;
        loop {
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
            if raw & HUGE != 0 {
                // Bit 7 is reserved in a level-4 entry: the hardware
                // faults there, so nothing is mapped.
                return if level == 4 {
                    Slot::Absent { level }
                } else {
                    Slot::Huge { entry, level }
                };
            }
            match self.next_table(raw) {
                Some(next) => table = next,
                None => return Slot::Absent { level },
            }
            level -= 1;
        }
    }

    /// The 4 KiB view of the huge entry `raw` at `level` for `va`: the
    /// piece's frame, the huge entry's flags with the page-size bit
    /// dropped and the PAT bit moved to where a 4 KiB entry has it.
    fn huge_piece(raw: u64, level: u32, va: u64) -> Pte {
        let size = span(level);
        let base = raw & ADDR_MASK & !(size - 1);
        let mut flags = raw & !ADDR_MASK & !HUGE;
        if raw & HUGE_PAT != 0 {
            flags |= HUGE;
        }
        Pte(flags | base | (va & (size - 1) & !(PAGE_SIZE - 1)))
    }
}

/// The first multiple of `span` above `va`, if below the top.
fn next_boundary(va: u64, span: u64) -> Option<u64> {
    let next = (va & !(span - 1)).checked_add(span)?;
    // Past the lower half lies the hole: go on at the upper half.
    Some(if (LOWER_END..UPPER_HALF).contains(&next) {
        UPPER_HALF
    } else {
        next
    })
}

// SAFETY: `exchange` is one atomic swap and `test_and_clear_accessed` one
// atomic fetch-and on the entry word the MMU updates (see `word`), so a
// bit the hardware sets is in the old value or in the new entry; `lookup`
// loads the word as it is (a huge page's piece as present, so it is never
// taken for unmapped); `tlb_state` is the state given for this table;
// `next_populated` skips only what has no table or whose words are 0, which
// `lookup` reports as `Pte::EMPTY`; `with_table_locked` is the default,
// which calls `body` once.
unsafe impl PageTable for OffsetSpace<'_> {
    fn tlb_state(&self) -> &MmTlbState {
        self.tlb
    }

    fn lookup(&self, va: u64) -> Pte {
        match self.slot(va) {
            Slot::Absent { .. } => Pte::EMPTY,
            Slot::Page { entry, .. } => Pte(entry.load(Ordering::SeqCst)),
            Slot::Huge { entry, level } => {
                let raw = entry.load(Ordering::SeqCst);
                Self::huge_piece(raw, level, va)
            }
        }
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        match self.slot(va) {
            Slot::Page { entry, .. } => Pte(entry.swap(new.0, Ordering::SeqCst)),
            // No 4 KiB entry to replace: a huge page stays as it is.
            Slot::Absent { .. } | Slot::Huge { .. } => Pte::EMPTY,
        }
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        let bit = PteFlags::ACCESSED.bits();
        match self.slot(va) {
            // A huge page has one accessed bit for all its pieces.
            Slot::Page { entry, .. } | Slot::Huge { entry, .. } => {
                entry.fetch_and(!bit, Ordering::SeqCst) & bit != 0
            }
            Slot::Absent { .. } => false,
        }
    }

    fn set(&self, va: u64, pte: Pte) {
        if let Slot::Page { entry, .. } = self.slot(va) {
            entry.store(pte.0, Ordering::SeqCst);
        }
    }

    /// Refuses a range that a huge page maps any of
    /// ([`check_no_huge`](OffsetSpace::check_no_huge), as
    /// [`Error::HugePage`](crate::Error::HugePage)): the crate's range
    /// operations change 4 KiB entries only, and would skip it.
    fn check_range(&self, range: PageRange) -> Result<(), crate::Error> {
        self.check_no_huge(range).map_err(crate::Error::from)
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        let last = range.last()?;
        let mut va = range.start();
        loop {
            let skip = match self.slot(va) {
                Slot::Huge { .. } => return Some(va),
                Slot::Absent { level } => span(level),
                Slot::Page { table, .. } => {
                    // The rest of this leaf table, word by word.
                    let table_base = va & !(span(2) - 1);
                    for i in index(va, 1)..ENTRIES {
                        let page = table_base + i * PAGE_SIZE;
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
            match next_boundary(va, skip) {
                Some(next) if next <= last => va = next,
                _ => return None,
            }
        }
    }
}
