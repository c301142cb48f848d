//! Reclaim: the page cache's clean pages, unmapped in one batch, and
//! the frame pool that saves their flush.

// guide: uses-reclaim
use core::cell::RefCell;

use tlb_batch::heapless;
use tlb_batch::mapper::{DeallocatorFrees, OffsetSpace};
use tlb_batch::{
    BoundedRmap, Frame, FramePool, FreeFrames, MappingFlags, MmTlbState, OwnedFrame, PageOut, PageState,
    ReclaimBacking, ReclaimRetry, ReclaimSummary, UnmapBatch, Verdict, WritebackFrame,
};
use x86_64::structures::paging::{FrameDeallocator, OffsetPageTable, PhysFrame, Size4KiB};

use crate::tlb::arch;
// guide: end

/// Frames one reclaim call looks at.
const RECLAIM_BATCH: usize = 32;

// guide: reclaim-backing
/// The frames whose entry the crate found dirty (a clean page's entry is
/// read-only, so none should be): kept, never freed.
#[derive(Default)]
pub struct Dirty(RefCell<heapless::Vec<Frame, RECLAIM_BATCH>>);

impl PageState for Dirty {
    fn set_dirty(&self, frame: Frame) {
        let mut dirty = self.0.borrow_mut();
        if !dirty.contains(&frame) {
            // At most one frame per candidate: it fits.
            dirty.push(frame).expect("more dirty frames than candidates");
        }
    }
}

/// Frees into the kernel's allocator; a dirty page has nowhere to go.
pub struct Backing<'a, D: FrameDeallocator<Size4KiB>> {
    dirty: &'a Dirty,
    frees: DeallocatorFrees<'a, D>,
}

impl<'a, D: FrameDeallocator<Size4KiB>> Backing<'a, D> {
    /// # Safety
    ///
    /// Frames are not reference-counted, and all came from `frames`.
    pub unsafe fn new(dirty: &'a Dirty, frames: &'a mut D) -> Self {
        // SAFETY: the caller's promise is `DeallocatorFrees::new`'s.
        let frees = unsafe { DeallocatorFrees::new(frames) };
        Backing { dirty, frees }
    }
}

impl<D: FrameDeallocator<Size4KiB>> FreeFrames for Backing<'_, D> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        self.frees.free_batch(frames);
    }
}

impl<D: FrameDeallocator<Size4KiB>> ReclaimBacking for Backing<'_, D> {
    fn is_dirty(&self, frame: Frame) -> bool {
        self.dirty.0.borrow().contains(&frame)
    }
    fn page_out(&mut self, _frame: WritebackFrame<'_>) -> PageOut {
        PageOut::Failed // no swap: the frame is handed back, still dirty
    }
}
// guide: end

// guide: reclaim
/// Reclaims what it can of `candidates`, page-cache frames each mapped once,
/// read-only, at its address in `mm` (whose table `mapper` is). Frames it
/// keeps go to `keep` with why. `dirty`: a new one per call, kept until an
/// `Err`'s retry (with a `Backing` of the same `dirty`) has finished.
#[allow(clippy::result_large_err)] // the retry owns the batch: 2.5 KiB, no heap
pub fn reclaim(
    mapper: &mut OffsetPageTable,
    mm: &MmTlbState,
    dirty: &Dirty,
    frames: &mut impl FrameDeallocator<Size4KiB>,
    candidates: &[(PhysFrame, u64)],
    keep: &mut dyn FnMut(OwnedFrame, Verdict),
) -> Result<ReclaimSummary, ReclaimRetry<RECLAIM_BATCH>> {
    let space = OffsetSpace::new(mapper, mm);
    // SAFETY: every mapping of each frame offered below is added first.
    let mut rmap = unsafe { BoundedRmap::<_, _, RECLAIM_BATCH>::new(dirty) };
    let mut offered = heapless::Vec::<OwnedFrame, RECLAIM_BATCH>::new();
    for &(frame, va) in candidates {
        // SAFETY: the page cache's claim on the frame, which it gives up.
        let page = unsafe { OwnedFrame::new(Frame::from(frame)) };
        match rmap.add(page.frame(), &space, va, MappingFlags::empty()) {
            Ok(()) => offered
                .push(page)
                .unwrap_or_else(|page| keep(page, Verdict::NotScanned)),
            Err(e) => keep(page, Verdict::Failed(e)), // more than the map holds
        }
    }
    // SAFETY: frames are not reference-counted, and all came from `frames`.
    let mut backing = unsafe { Backing::new(dirty, frames) };
    let mut batch = UnmapBatch::new();
    tlb_batch::shrink_page_list(arch(), &rmap, &mut backing, &mut batch, offered, keep)
}
// guide: end

// guide: pool
/// Clean unmapped frames whose flush is owed, until every CPU flushed.
pub static POOL: spin::Mutex<FramePool<256>> = spin::Mutex::new(FramePool::new());

/// From the timer interrupt, on every CPU: this CPU's flush point, then
/// frees what every CPU has flushed past.
pub fn timer_tick(frames: &mut impl FrameDeallocator<Size4KiB>) {
    tlb_batch::quiescent_flush(arch());
    if let Some(mut pool) = POOL.try_lock() {
        let mut released = pool.release_passed(arch());
        // SAFETY: as in `reclaim`: the pool's frames came from `frames`.
        unsafe { DeallocatorFrees::new(frames) }.free_batch(released.frames_mut());
    }
}
// guide: end
