//! [`OffsetTeardown::munmap`], the short form of
//! [`MmuGather::unmap_range`] for a plain munmap over a table the `x86_64`
//! crate built, and [`OffsetTeardown::munmap_bounded`], the same with
//! tables freed up to the floor and ceiling the kernel knows.

use x86_64::structures::paging::{FrameDeallocator, Size4KiB};

use super::{DeallocatorFrees, OffsetTeardown};
use crate::arch::Arch;
use crate::gather::{MmuGather, TableBounds, TableFreePolicy, TeardownSummary};
use crate::pte::Frame;
use crate::range::PageRange;
use crate::unmap::OwnedFrame;
use crate::Error;

impl OffsetTeardown<'_> {
    /// Unmaps `range` (munmap): clears its 4 KiB entries, flushes once,
    /// then frees through `frees` the data frames and the page-table frames
    /// the range emptied, all after the flush.
    ///
    /// This is [`MmuGather::unmap_range`] with the choices a kernel
    /// without lockless page-table walkers makes:
    ///
    /// - emptied page-table frames are detached and freed (`free_tables`
    ///   on): leaf tables whose whole 2 MiB lies in the range, then level-2
    ///   and level-3 tables left empty, never the level-4 root;
    /// - they are freed right after the flush
    ///   ([`TableFreePolicy::AfterFlush`]). The flush of a teardown that
    ///   frees tables reaches the CPUs that run the space and the lazy ones
    ///   too (their MMUs may still walk the tables), so this is sound
    ///   unless the kernel walks page tables in software without the
    ///   page-table lock (a GUP-fast walker); such a kernel calls
    ///   `unmap_range` with [`TableFreePolicy::IpiSync`] or its grace
    ///   period instead;
    /// - a dirty entry is counted ([`DeallocatorFrees::dirty_pages`]), not
    ///   written back: its frame is freed (anonymous memory). File-backed
    ///   mappings need their own [`TeardownBacking`](crate::TeardownBacking).
    ///
    /// `gather` holds the work between the clears and the frees; with
    /// [`PageGather`](crate::PageGather) a range of up to
    /// [`PAGE_BATCH`](crate::PAGE_BATCH) pages costs one flush, and a larger
    /// one a flush per batch. Keep it for the next munmap (it is empty after
    /// a call that succeeded).
    ///
    /// Before it, the space's root must be loaded with
    /// [`switch_mm`](crate::switch_mm) on every CPU that runs it, so that
    /// the crate knows which CPUs may cache its entries: those are the
    /// CPUs the flush reaches.
    ///
    /// Returns the counts of what this call did.
    ///
    /// Errors, with nothing changed: those of `unmap_range`'s checks
    /// ([`Error::NonCanonical`], [`Error::KernelHalf`] for a process's
    /// range in the upper half, which every process's tables share: unmap
    /// kernel pages through [`MmTlbState::kernel`](crate::MmTlbState::kernel),
    /// [`Error::AsidOutOfRange`],
    /// [`Error::OtherAddressSpace`], [`Error::OtherMachine`] for a `gather`
    /// holding another space's or machine's pending work), and
    /// [`Error::HugePage`] when a 2 MiB or 1 GiB page maps any of `range`,
    /// even wholly ([`OffsetSpace::check_no_huge`](super::OffsetSpace::check_no_huge)):
    /// `frees` hands frames to a `FrameDeallocator<Size4KiB>`, which cannot
    /// take a huge frame back as one. Split it first, or unmap it with
    /// [`MmuGather::unmap_range`] and a [`TeardownBacking`](crate::TeardownBacking)
    /// that frees the whole huge frame when handed its first 4 KiB frame
    /// (the teardown takes a wholly covered huge page as one entry). An error of a flush
    /// ([`Error::ShootdownReentered`], ...) stops the teardown part-way:
    /// `gather` keeps the frames and the flush it owes (and the address
    /// space records the flush), none is freed or lost; call `munmap` again
    /// with the same `gather` and `range` to complete it.
    ///
    /// A frame that `frees` refuses (one beyond 52 bits of physical
    /// address: no x86_64 entry names one, so a teardown of this table never
    /// meets it) makes the call end with [`Error::FrameOutOfRange`] naming
    /// the first, after everything else was done: such a number names no
    /// memory, so nothing is left to free.
    ///
    /// # Example
    ///
    /// A page mapped with the `x86_64` crate, then its 2 MiB unmapped: its
    /// frame and its leaf table go to the kernel's deallocator (feature
    /// `mock` for the simulated machine).
    ///
    /// ```
    /// # #[cfg(feature = "mock")] {
    /// use tlb_batch::arch::mock::{MockConfig, MockMachine};
    /// use tlb_batch::mapper::{DeallocatorFrees, OffsetSpace};
    /// use tlb_batch::{Asid, PageGather, PageRange};
    /// use x86_64::structures::paging::{
    ///     FrameAllocator, FrameDeallocator, Mapper, OffsetPageTable, Page, PageTable as X86Table,
    ///     PageTableFlags, PhysFrame, Size4KiB,
    /// };
    /// use x86_64::{PhysAddr, VirtAddr};
    ///
    /// // Table frames are 4 KiB-aligned host pages (physical offset 0);
    /// // freed frames are recorded.
    /// #[derive(Default)]
    /// struct Frames {
    ///     tables: Vec<Box<X86Table>>,
    ///     freed: Vec<PhysFrame>,
    /// }
    /// // SAFETY: each frame is a fresh host page, handed out once.
    /// unsafe impl FrameAllocator<Size4KiB> for Frames {
    ///     fn allocate_frame(&mut self) -> Option<PhysFrame> {
    ///         self.tables.push(Box::new(X86Table::new()));
    ///         let addr = &**self.tables.last()? as *const X86Table as u64;
    ///         PhysFrame::from_start_address(PhysAddr::new(addr)).ok()
    ///     }
    /// }
    /// impl FrameDeallocator<Size4KiB> for Frames {
    ///     unsafe fn deallocate_frame(&mut self, frame: PhysFrame) {
    ///         self.freed.push(frame); // the host pages stay allocated
    ///     }
    /// }
    ///
    /// let machine = MockMachine::new(MockConfig::x86_like(2)).unwrap();
    /// let mut frames = Frames::default();
    /// let mut root = Box::new(X86Table::new());
    /// // The state's root is the level-4 table's physical address (here,
    /// // with offset 0, its host address), as CR3 holds it.
    /// let root_paddr = &*root as *const X86Table as u64;
    /// let mm = machine.new_mm_at(Asid::new(1).unwrap(), root_paddr).unwrap();
    /// // SAFETY: every table frame is a live host page at its own address.
    /// let mut mapper = unsafe { OffsetPageTable::new(&mut root, VirtAddr::new(0)) };
    /// let page = Page::<Size4KiB>::containing_address(VirtAddr::new(0x40_0000));
    /// let data = PhysFrame::containing_address(PhysAddr::new(0x1234_5000));
    /// let flags = PageTableFlags::PRESENT | PageTableFlags::WRITABLE;
    /// // SAFETY: the frame is mapped nowhere else; no CPU runs the space.
    /// unsafe { mapper.map_to(page, data, flags, &mut frames) }.unwrap().ignore();
    ///
    /// // The munmap.
    /// let mut gather = PageGather::new();
    /// // SAFETY: the page is mapped once and its frame is the kernel's to
    /// // free; the tables below the root belong to this space alone.
    /// let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
    /// // SAFETY: frames are not reference-counted; all came from `frames`.
    /// let mut frees = unsafe { DeallocatorFrees::new(&mut frames) };
    /// let range = PageRange::new(0x40_0000, 512).unwrap(); // 2 MiB
    /// let summary = space.munmap(&machine.cpu(0).unwrap(), &mut gather, range, &mut frees).unwrap();
    ///
    /// assert_eq!((summary.pages_unmapped, summary.flushes), (1, 1));
    /// // The level-4 root stays, and so do the level-3 and level-2 tables
    /// // (their spans reach beyond the range); the leaf table goes.
    /// assert_eq!(summary.tables_freed, 1);
    /// assert_eq!(frames.freed.len(), 2);
    /// assert!(frames.freed.contains(&data));
    /// # }
    /// ```
    pub fn munmap<A, D, const N: usize>(
        &self,
        arch: &A,
        gather: &mut MmuGather<N>,
        range: PageRange,
        frees: &mut DeallocatorFrees<'_, D>,
    ) -> Result<TeardownSummary, Error>
    where
        A: Arch,
        D: FrameDeallocator<Size4KiB>,
    {
        self.unmap(arch, gather, range, None, frees)
    }

    /// [`munmap`](Self::munmap) of a mapping between two others, with the
    /// page tables freed up to `bounds` (Linux's floor and ceiling: from
    /// the end of the mapping below to the start of the one above;
    /// [`MmuGather::unmap_range_bounded`]): a leaf, level-2 or level-3
    /// table that the range touches goes once it is empty and its span
    /// lies within the bounds. So munmaps that each take part of a table's
    /// span free it at the last one, which `munmap` leaves linked.
    ///
    /// The caller promises that nothing of the space is mapped within
    /// `bounds` outside `range`, and that nothing is mapped there until
    /// the call returns (it holds the lock that keeps the range unmapped
    /// over the bounds too). A table that still holds an entry is never
    /// freed, whatever the bounds.
    ///
    /// Errors: those of `munmap`, and those `unmap_range_bounded` adds for
    /// bounds that are not canonical, reach the kernel's half, or do not
    /// enclose `range` ([`Error::OutsideTableBounds`]), all with nothing
    /// changed.
    pub fn munmap_bounded<A, D, const N: usize>(
        &self,
        arch: &A,
        gather: &mut MmuGather<N>,
        range: PageRange,
        bounds: TableBounds,
        frees: &mut DeallocatorFrees<'_, D>,
    ) -> Result<TeardownSummary, Error>
    where
        A: Arch,
        D: FrameDeallocator<Size4KiB>,
    {
        self.unmap(arch, gather, range, Some(bounds), frees)
    }

    /// `munmap` (`bounds` `None`) or `munmap_bounded`.
    fn unmap<A, D, const N: usize>(
        &self,
        arch: &A,
        gather: &mut MmuGather<N>,
        range: PageRange,
        bounds: Option<TableBounds>,
        frees: &mut DeallocatorFrees<'_, D>,
    ) -> Result<TeardownSummary, Error>
    where
        A: Arch,
        D: FrameDeallocator<Size4KiB>,
    {
        // A huge page would reach `frees` as its first 4 KiB frame, and a
        // `FrameDeallocator<Size4KiB>` would take back that one frame of
        // the huge frame's 512 (or 262144): refused, before anything
        // changes. `unmap_range` with a backing that frees huge frames
        // takes one whole.
        self.space().check_no_huge(range).map_err(Error::from)?;
        let mut refused: Option<Frame> = None;
        // Only a frame number beyond 52 bits comes back here (see
        // `munmap`): it names no memory, and the error names it.
        let mut handback = |frame: OwnedFrame, _kind| {
            refused.get_or_insert(frame.into_frame());
        };
        let policy = &mut TableFreePolicy::AfterFlush;
        let summary = match bounds {
            Some(bounds) => {
                gather.unmap_range_bounded(arch, self, frees, range, bounds, policy, &mut handback)
            }
            None => gather.unmap_range(arch, self, frees, range, true, policy, &mut handback),
        }?;
        match refused {
            Some(frame) => Err(Error::FrameOutOfRange { frame }),
            None => Ok(summary),
        }
    }
}
