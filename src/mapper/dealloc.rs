//! [`DeallocatorFrees`]: the crate's batched frees ([`FreeFrames`],
//! [`TeardownBacking`]) carried out by a kernel's
//! [`FrameDeallocator`] of the `x86_64` crate.

use core::fmt;

use x86_64::structures::paging::{FrameDeallocator, PhysFrame, Size4KiB};

use crate::gather::TeardownBacking;
use crate::pte::Frame;
use crate::unmap::{FreeFrames, OwnedFrame};

/// Frees the frames the crate hands over (data frames after their flush,
/// page-table frames after theirs) one by one into a
/// [`FrameDeallocator<Size4KiB>`], the trait a kernel built on the
/// `x86_64` crate already implements for its frame allocator.
///
/// It is the [`TeardownBacking`] of
/// [`MmuGather::unmap_range`](crate::MmuGather::unmap_range) and
/// [`OffsetTeardown::munmap`](super::OffsetTeardown::munmap) for a kernel
/// whose frames are not reference-counted and whose pages need no
/// write-back: a page whose entry was dirty is only counted
/// ([`dirty_pages`](Self::dirty_pages)), since its frame is freed anyway.
/// A kernel with file-backed or shared pages writes its own backing.
///
/// A frame whose physical address does not fit 52 bits has no
/// [`PhysFrame`]: it is refused (left in the batch, so the crate hands it
/// back). No entry of an x86_64 page table can name one.
///
/// Frames are 4 KiB frames only: the crate hands over a torn-down 2 MiB or
/// 1 GiB mapping as its huge frame's first 4 KiB frame, and this would
/// give back that one frame of the huge frame, never the rest.
/// [`OffsetTeardown::munmap`](super::OffsetTeardown::munmap) therefore
/// refuses a range with a huge page ([`Error::HugePage`](crate::Error::HugePage));
/// a kernel that tears huge pages down writes a backing that frees the
/// whole huge frame (its `FrameDeallocator<Size2MiB>`, say) when handed
/// the first frame, which only the kernel, knowing its frames, can tell.
pub struct DeallocatorFrees<'a, D: FrameDeallocator<Size4KiB>> {
    dealloc: &'a mut D,
    freed: usize,
    dirty: usize,
}

impl<D: FrameDeallocator<Size4KiB>> fmt::Debug for DeallocatorFrees<'_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeallocatorFrees")
            .field("freed", &self.freed)
            .field("dirty", &self.dirty)
            .finish_non_exhaustive()
    }
}

impl<'a, D: FrameDeallocator<Size4KiB>> DeallocatorFrees<'a, D> {
    /// Frees through `dealloc`.
    ///
    /// # Safety
    ///
    /// For every frame the crate hands to the result (through
    /// [`FreeFrames::free_batch`] or [`TeardownBacking::free_tables`]):
    ///
    /// - its handle ([`OwnedFrame`]) stands for the frame itself, not for
    ///   one reference of a count: no other mapping, page cache or kernel
    ///   object still uses it, so that once the crate hands it over it is
    ///   unused, as [`FrameDeallocator::deallocate_frame`] requires. With
    ///   [`OffsetTeardown`](super::OffsetTeardown) that means each page in
    ///   the range torn down is mapped once, by that range alone, and its
    ///   page-table frames belong to that address space alone (the promise
    ///   of [`OffsetSpace::for_teardown`](super::OffsetSpace::for_teardown)
    ///   in its stricter, not reference-counted form);
    /// - `dealloc` may take it back: it came from the allocator `dealloc`
    ///   returns frames to (data frames and page-table frames alike).
    ///
    /// Not a safety matter, but a leak: a range torn down through the
    /// result with [`MmuGather::unmap_range`](crate::MmuGather::unmap_range)
    /// that maps a huge page gives back only its first 4 KiB frame (see
    /// the type's docs; [`OffsetTeardown::munmap`](super::OffsetTeardown::munmap)
    /// refuses such a range).
    pub unsafe fn new(dealloc: &'a mut D) -> Self {
        DeallocatorFrees {
            dealloc,
            freed: 0,
            dirty: 0,
        }
    }

    /// Frames given to the deallocator so far (data and page-table
    /// frames).
    pub fn freed(&self) -> usize {
        self.freed
    }

    /// Pages whose entry was dirty when the crate cleared it, so far.
    pub fn dirty_pages(&self) -> usize {
        self.dirty
    }

    /// Gives every frame of `frames` that has a [`PhysFrame`] to the
    /// deallocator; the others stay in `frames`, in their order.
    fn free_all<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        let mut kept = 0;
        for i in 0..frames.len() {
            let frame: Frame = frames[i].frame();
            match PhysFrame::<Size4KiB>::try_from(frame) {
                Ok(phys) => {
                    // SAFETY: the crate hands a frame to a `FreeFrames` only
                    // once nothing can reach it through a TLB or a page
                    // table any more (after its flush, and for page-table
                    // frames after the table-free policy), and the caller
                    // of `new` promised that its handle is the frame itself
                    // and that `dealloc` may take it: so it is unused, and
                    // this is its one deallocation (its handle is dropped
                    // below, not handed back).
                    unsafe { self.dealloc.deallocate_frame(phys) };
                    self.freed = self.freed.saturating_add(1);
                }
                Err(_) => {
                    frames.swap(kept, i);
                    kept += 1;
                }
            }
        }
        frames.truncate(kept);
    }
}

impl<D: FrameDeallocator<Size4KiB>> FreeFrames for DeallocatorFrees<'_, D> {
    /// Deallocates every frame with a [`PhysFrame`] (all that a page-table
    /// entry can name); leaves the others, which the crate hands back.
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        self.free_all(frames);
    }
}

impl<D: FrameDeallocator<Size4KiB>> TeardownBacking for DeallocatorFrees<'_, D> {
    /// Counts the page ([`dirty_pages`](DeallocatorFrees::dirty_pages)):
    /// its frame is freed, so there is nothing to write back.
    fn set_dirty(&mut self, _frame: Frame) {
        self.dirty = self.dirty.saturating_add(1);
    }

    /// Deallocates page-table frames as [`free_batch`](FreeFrames::free_batch)
    /// does data frames.
    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        self.free_all(tables);
    }
}
