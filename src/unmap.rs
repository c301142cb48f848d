//! The misuse-resistant layer over [`try_to_unmap`]: a frame any of whose
//! mappings was cleared under a pending batch comes back to the caller only
//! through that batch's flush.
//!
//! A kernel that frees frames through a function taking [`OwnedFrame`] and
//! starts I/O through one taking [`WritebackFrame`] cannot free or write
//! out a frame before its TLB entries are gone: the frame moved into the
//! [`UnmapBatch`], and the batch hands it back only from
//! [`flush`](UnmapBatch::flush) (or lends it for I/O from
//! [`flush_dirty`](UnmapBatch::flush_dirty)). That holds when the unmap did
//! not finish too: a frame still mapped somewhere, or whose walk stopped on
//! an error, stays in the batch if any mapping it lost owes a flush
//! ([`Unmapped::HeldMapped`]), and `flush` hands it back marked as still
//! mapped.
//!
//! Freeing a frame the batch holds does not compile:
//!
//! ```compile_fail,E0382
//! use tlb_batch::{Arch, OwnedFrame, Rmap, TtuFlags, UnmapBatch};
//!
//! fn free_page(_page: OwnedFrame) {}
//!
//! fn reclaim_one<A: Arch, R: Rmap>(arch: &A, rmap: &R, page: OwnedFrame) {
//!     let mut batch = UnmapBatch::<16>::new();
//!     let _ = batch.try_to_unmap(arch, rmap, page, TtuFlags::empty());
//!     free_page(page); // error: `page` moved into the batch until it is flushed
//!     let _ = batch.flush(arch);
//! }
//! ```
//!
//! Nor does adding pages while frames are out for I/O, since their
//! writable TLB entries would not have been flushed:
//!
//! ```compile_fail,E0499
//! use tlb_batch::{Arch, OwnedFrame, Rmap, TtuFlags, UnmapBatch, WritebackFrame};
//!
//! fn start_io(_page: WritebackFrame<'_>) {}
//!
//! fn reclaim_two<A: Arch, R: Rmap>(arch: &A, rmap: &R, a: OwnedFrame, b: OwnedFrame) {
//!     let mut batch = UnmapBatch::<16>::new();
//!     let _ = batch.try_to_unmap(arch, rmap, a, TtuFlags::empty());
//!     if let Ok(io) = batch.flush_dirty(arch) {
//!         let _ = batch.try_to_unmap(arch, rmap, b, TtuFlags::empty()); // error: `batch` is lent to `io`
//!         io.frames().for_each(start_io);
//!     }
//!     let _ = batch.flush(arch);
//! }
//! ```
//!
//! Nor does freeing what a flush hands back without looking at whether it
//! is still mapped:
//!
//! ```compile_fail,E0308
//! use tlb_batch::{Arch, OwnedFrame, UnmapBatch};
//!
//! fn free_page(_page: OwnedFrame) {}
//!
//! fn free_all<A: Arch>(arch: &A, batch: &mut UnmapBatch<16>) {
//!     if let Ok(flushed) = batch.flush(arch) {
//!         for page in flushed {
//!             free_page(page); // error: a `Released`, which may be still mapped
//!         }
//!     }
//! }
//! ```
//!
//! Nor does making a second handle to a frame in safe code, which could
//! then be freed while the batch holds the first:
//!
//! ```compile_fail,E0133
//! use tlb_batch::{Frame, OwnedFrame};
//!
//! fn duplicate(page: &OwnedFrame) -> OwnedFrame {
//!     OwnedFrame::new(page.frame()) // error: `new` is unsafe: it is the kernel's promise
//! }
//! ```
//!
//! The same flows written correctly:
//!
//! ```
//! use tlb_batch::{Arch, OwnedFrame, Released, Rmap, TtuFlags, UnmapBatch, Unmapped, WritebackFrame};
//!
//! fn free_page(_page: OwnedFrame) {}
//! fn start_io(_page: WritebackFrame<'_>) {}
//!
//! /// Reclaims what it can into `batch`; returns the frames it kept. On
//! /// error the batch still holds its frames and owes its flush.
//! fn reclaim<A: Arch, R: Rmap>(
//!     arch: &A,
//!     rmap: &R,
//!     batch: &mut UnmapBatch<16>,
//!     pages: Vec<OwnedFrame>,
//! ) -> Result<Vec<OwnedFrame>, tlb_batch::Error> {
//!     let mut kept = Vec::new();
//!     for page in pages {
//!         match batch.try_to_unmap(arch, rmap, page, TtuFlags::empty()) {
//!             // The batch holds it until the flush, unmapped or not.
//!             Ok(Unmapped::Held(_) | Unmapped::HeldMapped(_)) => {}
//!             // Still mapped and owing nothing: back at once.
//!             Ok(Unmapped::Returned { frame, .. } | Unmapped::Full(frame)) => kept.push(frame),
//!             Err((frame, _)) => kept.push(frame),
//!         }
//!     }
//!     if let Ok(io) = batch.flush_dirty(arch) {
//!         io.frames().for_each(start_io);
//!     }
//!     for page in batch.flush(arch)? {
//!         match page {
//!             Released::Unmapped(frame) => free_page(frame),
//!             Released::StillMapped(frame, _why) => kept.push(frame),
//!         }
//!     }
//!     Ok(kept)
//! }
//! ```

use crate::arch::Arch;
use crate::batch::TlbFlushUnmapBatch;
use crate::error::Error;
use crate::pte::Frame;
use crate::rmap::{page_referenced, unmap_frame, Referenced, Rmap, SwapResult, TtuFlags};
use crate::shootdown::ShootdownReport;

/// A claim on a frame, as a handle that is neither `Copy` nor `Clone`:
/// whoever holds it may free what it stands for. The high-level API moves
/// it into an [`UnmapBatch`] and gives it back only when that is safe.
///
/// # What a handle stands for
///
/// - In a kernel without reference counts, the frame itself: exactly one
///   handle per allocated frame, and freeing it returns the frame to the
///   allocator.
/// - In a kernel with reference counts (a page mapped by several address
///   spaces, or also held by the page cache), one counted reference: each
///   handle is one reference, [`FreeFrames::free_batch`] drops it, and the
///   frame goes back to the allocator only when its last reference goes.
///   [`MmuGather`](crate::MmuGather) makes handles this way: every present
///   entry it clears held one reference to its frame (the
///   [`TableTeardown`](crate::TableTeardown) contract), which it passes to
///   the kernel's free after the flush. A frame still mapped elsewhere keeps
///   its other references, so another space's teardown or a reclaimer's
///   batch holding it stays sound.
///
/// Either way the guarantee rests on the frame reaching the allocator only
/// through handles, which is why making one is `unsafe`.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct OwnedFrame(Frame);

impl OwnedFrame {
    /// Wraps a claim on `frame` (see [what a handle stands
    /// for](OwnedFrame#what-a-handle-stands-for)).
    ///
    /// # Safety
    ///
    /// The caller gives the handle a claim nothing else holds: the frame
    /// itself when frames are not reference-counted (no other handle to it
    /// exists, and nothing frees it except through this handle), or one
    /// reference of its count that no other handle or owner will drop. While
    /// the handle lives, the frame is not returned to the allocator by any
    /// other path. Breaking this lets safe code free a frame that a batch
    /// holds while another CPU can still write to it.
    pub const unsafe fn new(frame: Frame) -> Self {
        OwnedFrame(frame)
    }

    /// The frame number (for lookups; not a licence to free it).
    pub fn frame(&self) -> Frame {
        self.0
    }

    /// Gives up the handle, returning the raw frame.
    pub fn into_frame(self) -> Frame {
        self.0
    }
}

/// A kernel's batched free: one call for many frames.
pub trait FreeFrames {
    /// Frees the frames it accepts in one batched call, removing them from
    /// `frames` (and from the kernel's reverse map). Whatever it leaves in
    /// `frames` was refused and goes back to the caller; so does anything
    /// it adds (the crate never drops a handle it is given back).
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>);
}

/// Why a frame that an [`UnmapBatch`] held comes back from
/// [`flush`](UnmapBatch::flush) still mapped: the unmap removed some of its
/// mappings (their flush is now done) but not all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StillMapped {
    /// A mapping is left: the walk's result ([`SwapResult::Again`],
    /// `AgainCached`, `Fail` or `Mlock`).
    Busy(SwapResult),
    /// The walk stopped on this error.
    Failed(Error),
}

/// What [`UnmapBatch::try_to_unmap`] did with the frame.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a returned frame must be kept or retried"]
pub enum Unmapped {
    /// Every mapping is gone; the batch holds the frame until the flush,
    /// which hands it back as [`Released::Unmapped`]. The result is
    /// [`SwapResult::Success`] or [`SwapResult::SuccessCached`].
    Held(SwapResult),
    /// Some mapping was removed with its flush deferred, but the frame is
    /// still mapped elsewhere or the walk stopped on an error: another CPU
    /// may hold an entry of the removed mapping until the flush, so the
    /// batch holds the frame and the flush hands it back as
    /// [`Released::StillMapped`] with this reason.
    HeldMapped(StillMapped),
    /// The frame is still mapped somewhere ([`SwapResult::Again`],
    /// `Fail` or `Mlock`) and no mapping the call removed owes a flush:
    /// here it is back, with nothing pending for it.
    Returned {
        /// The frame.
        frame: OwnedFrame,
        /// Why it is still mapped.
        result: SwapResult,
    },
    /// The batch holds `N` frames already; nothing was done. Flush first.
    Full(OwnedFrame),
}

/// One frame an [`UnmapBatch`] holds, and whether its unmap finished.
#[derive(Debug)]
pub(crate) struct Held {
    pub(crate) frame: OwnedFrame,
    pub(crate) mapped: Option<StillMapped>,
}

/// Up to `N` frames and the deferred TLB flushes of their removed
/// mappings.
///
/// Frames go in through [`try_to_unmap`](Self::try_to_unmap) and come out
/// only through [`flush`](Self::flush) or, for I/O, lent by
/// [`flush_dirty`](Self::flush_dirty). Storage is fixed: no allocation.
/// Dropping a batch that holds frames leaks them (they are never freed, so
/// never unsafely): flush it instead.
///
/// The batch belongs to the machine whose [`Arch`] first added to it; using
/// another machine's `Arch` with it is refused ([`Error::OtherMachine`]).
#[must_use = "the batch holds frames and owes TLB flushes: flush it"]
pub struct UnmapBatch<const N: usize> {
    tlb: TlbFlushUnmapBatch,
    frames: heapless::Vec<Held, N>,
}

impl<const N: usize> Default for UnmapBatch<N> {
    fn default() -> Self {
        UnmapBatch::new()
    }
}

impl<const N: usize> UnmapBatch<N> {
    /// An empty batch.
    ///
    /// A capacity of 0 does not compile (`UnmapBatch::<0>::new()` fails
    /// when it is instantiated): such a batch could hold no frame, so no
    /// unmap could ever defer its flush.
    ///
    /// ```compile_fail,E0080
    /// let empty = tlb_batch::UnmapBatch::<0>::new();
    /// # let _ = empty;
    /// ```
    pub const fn new() -> Self {
        const { assert!(N > 0, "UnmapBatch needs room for at least one frame: N > 0") };
        UnmapBatch {
            tlb: TlbFlushUnmapBatch::new(),
            frames: heapless::Vec::new(),
        }
    }

    /// Unmaps every mapping of `frame` through `rmap`, deferring TLB flushes
    /// where allowed ([`TtuFlags::BATCH_FLUSH`] is added to `flags`); see
    /// [`try_to_unmap`](crate::try_to_unmap) for what each mapping gets.
    ///
    /// A frame any of whose mappings was removed with its flush owed stays
    /// in the batch ([`Unmapped::Held`], [`Unmapped::HeldMapped`]), whatever
    /// else happened. `Err` hands the frame back with the error only when
    /// nothing is owed for it: the error came before any mapping changed
    /// (bad input from the rmap, [`Error::OtherMachine`]).
    pub fn try_to_unmap<A: Arch, R: Rmap + ?Sized>(
        &mut self,
        arch: &A,
        rmap: &R,
        frame: OwnedFrame,
        flags: TtuFlags,
    ) -> Result<Unmapped, (OwnedFrame, Error)> {
        if self.frames.is_full() {
            return Ok(Unmapped::Full(frame));
        }
        let report = unmap_frame(arch, rmap, frame.0, flags | TtuFlags::BATCH_FLUSH, &mut self.tlb);
        let (mapped, outcome) = match report.result {
            Ok(result) if result.is_unmapped() => (None, Unmapped::Held(result)),
            Ok(result) if !report.owed => return Ok(Unmapped::Returned { frame, result }),
            Err(e) if !report.owed => return Err((frame, e)),
            Ok(result) => (
                Some(StillMapped::Busy(result)),
                Unmapped::HeldMapped(StillMapped::Busy(result)),
            ),
            Err(e) => (
                Some(StillMapped::Failed(e)),
                Unmapped::HeldMapped(StillMapped::Failed(e)),
            ),
        };
        // SAFETY: `frames` was not full at the top of this function, and
        // nothing since touched it (`unmap_frame` only sees `self.tlb`).
        unsafe { self.frames.push_unchecked(Held { frame, mapped }) };
        Ok(outcome)
    }

    /// Ages `frame` with [`page_referenced`](crate::page_referenced): counts
    /// and clears its accessed bits; a flush that clearing needs on this
    /// architecture joins the batch's next flush.
    pub fn page_referenced<A: Arch, R: Rmap + ?Sized>(
        &mut self,
        arch: &A,
        rmap: &R,
        frame: &OwnedFrame,
    ) -> Result<Referenced, Error> {
        page_referenced(arch, rmap, frame.0, &mut self.tlb)
    }

    /// Tries again to unmap every held frame that is still mapped for a
    /// reason [`StillMapped::Busy`] (with `flags` and
    /// [`TtuFlags::BATCH_FLUSH`]). The migration driver's passes use it.
    pub(crate) fn retry_mapped<A: Arch, R: Rmap + ?Sized>(&mut self, arch: &A, rmap: &R, flags: TtuFlags) {
        for held in self.frames.iter_mut() {
            if !matches!(held.mapped, Some(StillMapped::Busy(_))) {
                continue;
            }
            let frame = held.frame.0;
            held.mapped =
                match unmap_frame(arch, rmap, frame, flags | TtuFlags::BATCH_FLUSH, &mut self.tlb).result {
                    Ok(r) if r.is_unmapped() => None,
                    Ok(r) => Some(StillMapped::Busy(r)),
                    Err(e) => Some(StillMapped::Failed(e)),
                };
        }
    }

    /// The numbers of the frames held, in the order they were added (for
    /// lookups only: the frames themselves stay in the batch).
    pub fn held_frames(&self) -> impl Iterator<Item = Frame> + '_ {
        self.frames.iter().map(|h| h.frame.frame())
    }

    /// Frames held, still mapped ones included.
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether no frame is held and no flush is owed.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty() && self.tlb.is_empty()
    }

    /// The underlying TLB batch (targets, pending pages).
    pub fn tlb_batch(&self) -> &TlbFlushUnmapBatch {
        &self.tlb
    }

    /// Makes every held *unmapped* frame safe to write out: flushes if any
    /// deferred PTE was writable or dirty (one shootdown), and lends those
    /// frames for I/O. Frames still mapped somewhere are not lent (another
    /// mapping could be writing them). They all stay in the batch;
    /// [`flush`](Self::flush) before freeing. On error nothing is lent and
    /// the batch still owes its flush.
    pub fn flush_dirty<A: Arch>(&mut self, arch: &A) -> Result<Writeback<'_>, Error> {
        let report = self.tlb.flush_dirty(arch)?;
        Ok(Writeback {
            frames: &self.frames,
            report,
        })
    }

    /// Flushes everything pending (one shootdown at most) and hands every
    /// held frame back: unmapped ones now safe to free or reuse, still
    /// mapped ones with their reason. The batch is then empty and can be
    /// used again. On error the batch keeps its frames and its pending
    /// flush: nothing is lost, retry from a context that is not nested in
    /// another shootdown (or with the machine that filled the batch, for
    /// [`Error::OtherMachine`]).
    pub fn flush<A: Arch>(&mut self, arch: &A) -> Result<Flushed<N>, Error> {
        let report = self.flush_tlb(arch)?;
        let mut flushed = Flushed {
            unmapped: heapless::Vec::new(),
            mapped: heapless::Vec::new(),
            report,
        };
        for held in self.take_held() {
            // SAFETY: `take_held` returns at most N frames, each pushed onto
            // exactly one of the two lists, so neither exceeds N.
            unsafe {
                match held.mapped {
                    None => flushed.unmapped.push_unchecked(held.frame),
                    Some(why) => flushed.mapped.push_unchecked((held.frame, why)),
                }
            }
        }
        Ok(flushed)
    }

    /// The flush half of [`flush`](Self::flush), for the drivers, which
    /// then sort the frames out themselves.
    pub(crate) fn flush_tlb<A: Arch>(&mut self, arch: &A) -> Result<ShootdownReport, Error> {
        self.tlb.flush(arch)
    }

    /// The held frames, leaving none. Only after [`flush_tlb`](Self::flush_tlb)
    /// returned `Ok` (or for a batch that owes nothing).
    pub(crate) fn take_held(&mut self) -> heapless::Vec<Held, N> {
        core::mem::take(&mut self.frames)
    }

    /// The held frames, to read.
    pub(crate) fn held(&self) -> &[Held] {
        &self.frames
    }

    /// Forgets the pending flush, which the caller took over
    /// ([`FramePool::defer`](crate::FramePool::defer)).
    pub(crate) fn forget_tlb(&mut self) {
        self.tlb = TlbFlushUnmapBatch::new();
    }
}

/// Held frames lent for I/O by [`UnmapBatch::flush_dirty`]: no CPU holds a
/// writable TLB entry for any of them.
#[derive(Debug)]
pub struct Writeback<'a> {
    frames: &'a [Held],
    report: Option<ShootdownReport>,
}

impl<'a> Writeback<'a> {
    /// Each held frame that is unmapped, as a handle I/O functions can
    /// demand (still mapped ones are left out).
    pub fn frames(&self) -> impl Iterator<Item = WritebackFrame<'a>> + 'a {
        self.frames
            .iter()
            .filter(|h| h.mapped.is_none())
            .map(|h| WritebackFrame(&h.frame))
    }

    /// Like [`frames`](Self::frames), each with its position among all the
    /// held frames (for the drivers' per-frame bookkeeping).
    pub(crate) fn indexed(&self) -> impl Iterator<Item = (usize, WritebackFrame<'a>)> + 'a {
        self.frames
            .iter()
            .enumerate()
            .filter(|(_, h)| h.mapped.is_none())
            .map(|(i, h)| (i, WritebackFrame(&h.frame)))
    }

    /// The shootdown `flush_dirty` did, if it had to.
    pub fn report(&self) -> Option<ShootdownReport> {
        self.report
    }
}

/// A frame that may be written out: unmapped, and no CPU holds a writable
/// TLB entry for it. Only [`Writeback::frames`] makes one.
#[derive(Debug, Clone, Copy)]
pub struct WritebackFrame<'a>(&'a OwnedFrame);

impl WritebackFrame<'_> {
    /// The frame number.
    pub fn frame(&self) -> Frame {
        self.0 .0
    }
}

/// One frame handed back by [`UnmapBatch::flush`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a released frame must be freed or kept, not dropped"]
pub enum Released {
    /// Unmapped, and no CPU holds any TLB entry for it: free to free.
    Unmapped(OwnedFrame),
    /// Still mapped somewhere: the entries of the mappings the batch
    /// removed are flushed, but the frame is in use. Keep it (or unmap it
    /// again).
    StillMapped(OwnedFrame, StillMapped),
}

/// Frames handed back by [`UnmapBatch::flush`], sorted: unmapped ones (no
/// CPU holds any TLB entry for them) and still mapped ones.
#[derive(Debug)]
#[must_use = "flushed frames must be freed or kept, not dropped"]
pub struct Flushed<const N: usize> {
    unmapped: heapless::Vec<OwnedFrame, N>,
    mapped: heapless::Vec<(OwnedFrame, StillMapped), N>,
    report: ShootdownReport,
}

impl<const N: usize> Flushed<N> {
    /// Unmapped frames only, made safe by `report`.
    pub(crate) fn unmapped(unmapped: heapless::Vec<OwnedFrame, N>, report: ShootdownReport) -> Self {
        Flushed {
            unmapped,
            mapped: heapless::Vec::new(),
            report,
        }
    }

    /// The shootdown that made them safe.
    pub fn report(&self) -> ShootdownReport {
        self.report
    }

    /// How many frames, of both kinds.
    pub fn len(&self) -> usize {
        self.unmapped.len() + self.mapped.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The unmapped frames, to hand to a batched free (which takes the
    /// ones it frees) or to sort out.
    pub fn frames_mut(&mut self) -> &mut heapless::Vec<OwnedFrame, N> {
        &mut self.unmapped
    }

    /// The frames still mapped somewhere, with why.
    pub fn still_mapped(&self) -> &[(OwnedFrame, StillMapped)] {
        &self.mapped
    }

    /// Both lists: unmapped frames, and still mapped ones with why.
    #[allow(clippy::type_complexity)]
    pub fn into_parts(
        self,
    ) -> (
        heapless::Vec<OwnedFrame, N>,
        heapless::Vec<(OwnedFrame, StillMapped), N>,
    ) {
        (self.unmapped, self.mapped)
    }
}

impl<const N: usize> IntoIterator for Flushed<N> {
    type Item = Released;
    type IntoIter = core::iter::Chain<
        core::iter::Map<<heapless::Vec<OwnedFrame, N> as IntoIterator>::IntoIter, fn(OwnedFrame) -> Released>,
        core::iter::Map<
            <heapless::Vec<(OwnedFrame, StillMapped), N> as IntoIterator>::IntoIter,
            fn((OwnedFrame, StillMapped)) -> Released,
        >,
    >;
    fn into_iter(self) -> Self::IntoIter {
        let unmapped: fn(OwnedFrame) -> Released = Released::Unmapped;
        let mapped: fn((OwnedFrame, StillMapped)) -> Released = |(f, why)| Released::StillMapped(f, why);
        self.unmapped
            .into_iter()
            .map(unmapped)
            .chain(self.mapped.into_iter().map(mapped))
    }
}
