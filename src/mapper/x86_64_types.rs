//! The parts of the adapter that need the `x86_64` crate's own types
//! (feature `x86_64-mapper`): [`OffsetSpace`]'s constructors from an
//! `OffsetPageTable` or its addresses, and the conversions between the
//! crate's frames and flags and the `x86_64` crate's.

use x86_64::structures::paging::{OffsetPageTable, PageSize, PageTableFlags, PhysFrame};
use x86_64::{PhysAddr, VirtAddr};

use super::{MapperError, OffsetSpace};
use crate::mm::MmTlbState;
use crate::pte::{Frame, PteFlags, PAGE_SHIFT};

/// Frames whose address fits the 52 physical-address bits of an entry.
const MAX_FRAMES: u64 = 1 << (52 - PAGE_SHIFT);

impl<'a> OffsetSpace<'a> {
    /// The address space `tlb` whose table is `mapper`'s. The mapper stays
    /// borrowed while the result lives, so the kernel cannot change the
    /// table through it behind the crate's back; map more pages with the
    /// mapper once the result is dropped, or use
    /// [`from_raw_parts`](Self::from_raw_parts) under the kernel's own
    /// page-table lock.
    ///
    /// Safe for the reason the mapper's own safe methods are: building the
    /// mapper ([`OffsetPageTable::new`]) was the promise that its tables
    /// are reachable at its offset, and `&mut` to it already lets safe
    /// code write any entry of its level-4 table.
    pub fn new(mapper: &'a mut OffsetPageTable<'_>, tlb: &'a MmTlbState) -> Self {
        let offset = mapper.phys_offset().as_u64();
        let level_4 = mapper.level_4_table_mut() as *mut x86_64::structures::paging::PageTable as u64;
        // SAFETY: building the mapper was the promise that its tables are
        // reachable at its offset; the mapper stays borrowed for `'a`.
        unsafe { OffsetSpace::from_addresses(level_4, offset, tlb) }
    }

    /// The address space `tlb` whose level-4 table is at `level_4_table`,
    /// with physical memory mapped at `phys_offset`.
    ///
    /// # Safety
    ///
    /// For `'a`: the level-4 table is a live, 4 KiB-aligned table at
    /// `level_4_table`, every page-table frame an entry below it names is
    /// mapped (readable and writable) at `phys_offset` plus its physical
    /// address, and no table frame is freed. Other code changes entries
    /// only atomically, or under the page-table lock the crate's callers
    /// hold (see [`PageTable`](crate::PageTable)). These are the promises of
    /// [`OffsetPageTable::new`], for as long as this value lives.
    pub unsafe fn from_raw_parts(
        level_4_table: VirtAddr,
        phys_offset: VirtAddr,
        tlb: &'a MmTlbState,
    ) -> Self {
        // SAFETY: the caller's promise is `from_addresses`' own.
        unsafe { OffsetSpace::from_addresses(level_4_table.as_u64(), phys_offset.as_u64(), tlb) }
    }
}

impl<S: PageSize> From<PhysFrame<S>> for Frame {
    /// The frame's first 4 KiB frame.
    fn from(frame: PhysFrame<S>) -> Frame {
        Frame(frame.start_address().as_u64() >> PAGE_SHIFT)
    }
}

impl TryFrom<Frame> for PhysFrame {
    type Error = MapperError;

    /// The 4 KiB frame; [`MapperError::FrameOutOfRange`] beyond 52 bits of
    /// physical address.
    fn try_from(frame: Frame) -> Result<PhysFrame, MapperError> {
        let out = MapperError::FrameOutOfRange { frame };
        if frame.0 >= MAX_FRAMES {
            return Err(out);
        }
        let addr = PhysAddr::try_new(frame.addr()).map_err(|_| out)?;
        PhysFrame::from_start_address(addr).map_err(|_| out)
    }
}

impl From<PageTableFlags> for PteFlags {
    /// The same bits; those [`PteFlags`] does not name (write-through,
    /// cache-disable, huge page, bits 52 to 62) are dropped.
    fn from(flags: PageTableFlags) -> PteFlags {
        PteFlags::from_bits_truncate(flags.bits())
    }
}

impl From<PteFlags> for PageTableFlags {
    /// The same bits (the crate's software bits 9 to 11 are `BIT_9` to
    /// `BIT_11`).
    fn from(flags: PteFlags) -> PageTableFlags {
        PageTableFlags::from_bits_truncate(flags.bits())
    }
}
