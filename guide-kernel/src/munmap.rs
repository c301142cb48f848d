//! An address space per process, and munmap.

// guide: uses-munmap
use tlb_batch::mapper::{DeallocatorFrees, OffsetSpace};
use tlb_batch::{Asid, Error, MmTlbState, PageGather, PageRange, TableBounds, TeardownSummary};
use x86_64::structures::paging::{FrameDeallocator, OffsetPageTable, PhysFrame, Size4KiB};

use crate::tlb::arch;
// guide: end

// guide: address-space
/// What the kernel keeps per process for the crate, next to its page table.
pub struct AddressSpace {
    /// Which CPUs run it and how far its flushes got.
    pub tlb: MmTlbState,
    /// munmap's pending work, kept from one call to the next.
    pub gather: PageGather,
}

impl AddressSpace {
    /// `asid`: 1 to 4095, one per live process; `level_4`: its table's frame.
    pub fn new(asid: Asid, level_4: PhysFrame) -> Self {
        AddressSpace {
            tlb: MmTlbState::new(asid, level_4.start_address().as_u64()),
            gather: PageGather::new(),
        }
    }
}
// guide: end

// guide: munmap
/// munmap: clears the range's entries, flushes once, then frees the
/// frames and the page tables the range emptied into `frames`.
pub fn munmap(
    space: &mut AddressSpace,
    mapper: &mut OffsetPageTable,
    frames: &mut impl FrameDeallocator<Size4KiB>,
    start: u64,
    pages: u64,
) -> Result<TeardownSummary, Error> {
    let range = PageRange::new(start, pages)?;
    // SAFETY: each page of the range is mapped once, by this address space
    // alone, and its frame is ours to free; so are the tables below the root.
    let table = unsafe { OffsetSpace::new(mapper, &space.tlb).for_teardown() };
    // SAFETY: frames are not reference-counted, and all came from `frames`.
    let mut frees = unsafe { DeallocatorFrees::new(frames) };
    table.munmap(arch(), &mut space.gather, range, &mut frees)
}
// guide: end

// guide: munmap-bounded
/// munmap of one mapping between two others: `floor` is where the mapping
/// below it ends (0 when there is none), `ceiling` where the one above it
/// starts (the end of the user half when there is none). Every empty table
/// the range touches whose span lies in that gap goes too.
pub fn munmap_between(
    space: &mut AddressSpace,
    mapper: &mut OffsetPageTable,
    frames: &mut impl FrameDeallocator<Size4KiB>,
    range: PageRange,
    floor: u64,
    ceiling: u64,
) -> Result<TeardownSummary, Error> {
    let bounds = TableBounds::new(floor, ceiling)?;
    // SAFETY: as for `munmap`: the range's frames and the tables below the
    // root are this address space's alone.
    let table = unsafe { OffsetSpace::new(mapper, &space.tlb).for_teardown() };
    // SAFETY: as for `munmap`.
    let mut frees = unsafe { DeallocatorFrees::new(frames) };
    table.munmap_bounded(arch(), &mut space.gather, range, bounds, &mut frees)
}
// guide: end
