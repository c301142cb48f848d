//! The misuse-resistant layer over [`try_to_unmap`]: frames unmapped under
//! a pending batch come back to the caller only through the flush.
//!
//! A kernel that frees frames through a function taking [`OwnedFrame`] and
//! starts I/O through one taking [`WritebackFrame`] cannot free or write
//! out a frame before its TLB entries are gone: the frame moved into the
//! [`UnmapBatch`], and the batch hands it back only from
//! [`flush`](UnmapBatch::flush) (or lends it for I/O from
//! [`flush_dirty`](UnmapBatch::flush_dirty)).
//!
//! Freeing a frame the batch holds does not compile:
//!
//! ```compile_fail
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
//! ```compile_fail
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
//! The same flows written correctly:
//!
//! ```
//! use tlb_batch::{Arch, OwnedFrame, Rmap, TtuFlags, UnmapBatch, Unmapped, WritebackFrame};
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
//!             Ok(Unmapped::Held(_)) => {}
//!             Ok(Unmapped::Returned { frame, .. } | Unmapped::Full(frame)) => kept.push(frame),
//!             Err((frame, _)) => kept.push(frame),
//!         }
//!     }
//!     if let Ok(io) = batch.flush_dirty(arch) {
//!         io.frames().for_each(start_io);
//!     }
//!     batch.flush(arch)?.into_iter().for_each(free_page);
//!     Ok(kept)
//! }
//! ```

use crate::arch::Arch;
use crate::batch::TlbFlushUnmapBatch;
use crate::pte::Frame;
use crate::rmap::{page_referenced, try_to_unmap, Referenced, Rmap, SwapResult, TtuFlags};
use crate::shootdown::ShootdownReport;
use crate::Error;

/// A frame the kernel owns, as a handle that is not `Copy`: whoever holds
/// it may free it. The high-level API moves it into an [`UnmapBatch`] and
/// gives it back only when that is safe.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct OwnedFrame(Frame);

impl OwnedFrame {
    /// Wraps a frame the caller owns. Create one handle per frame; the
    /// protection this layer gives rests on the frame being freed only
    /// through its handle.
    pub fn new(frame: Frame) -> Self {
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
    /// `frames` (and from the kernel's reverse map); whatever it leaves in
    /// `frames` was refused and goes back to the caller.
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>);
}

/// What [`UnmapBatch::try_to_unmap`] did with the frame.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a returned frame must be kept or retried"]
pub enum Unmapped {
    /// Every mapping is gone; the batch holds the frame until the flush.
    /// The result is [`SwapResult::Success`] or [`SwapResult::SuccessCached`].
    Held(SwapResult),
    /// The frame is still mapped somewhere ([`SwapResult::Again`],
    /// `AgainCached`, `Fail` or `Mlock`): here it is back. Mappings the call
    /// did remove are pending in the batch.
    Returned {
        /// The frame.
        frame: OwnedFrame,
        /// Why it is still mapped.
        result: SwapResult,
    },
    /// The batch holds `N` frames already; nothing was done. Flush first.
    Full(OwnedFrame),
}

/// Up to `N` unmapped frames and their deferred TLB flushes.
///
/// Frames go in through [`try_to_unmap`](Self::try_to_unmap) and come out
/// only through [`flush`](Self::flush) (owned, free to free) or, for I/O,
/// lent by [`flush_dirty`](Self::flush_dirty). Storage is fixed: no
/// allocation. Dropping a batch that holds frames leaks them (they are
/// never freed, so never unsafely): flush it instead.
#[must_use = "the batch holds frames and owes TLB flushes: flush it"]
pub struct UnmapBatch<const N: usize> {
    tlb: TlbFlushUnmapBatch,
    frames: heapless::Vec<OwnedFrame, N>,
}

impl<const N: usize> Default for UnmapBatch<N> {
    fn default() -> Self {
        UnmapBatch::new()
    }
}

impl<const N: usize> UnmapBatch<N> {
    /// An empty batch.
    pub const fn new() -> Self {
        UnmapBatch {
            tlb: TlbFlushUnmapBatch::new(),
            frames: heapless::Vec::new(),
        }
    }

    /// Unmaps every mapping of `frame` through `rmap`, deferring TLB flushes
    /// where allowed ([`TtuFlags::BATCH_FLUSH`] is added to `flags`); see
    /// [`try_to_unmap`](crate::try_to_unmap) for what each mapping gets.
    /// On error the frame comes back with it; what the call cleared is
    /// pending in the batch.
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
        match try_to_unmap(arch, rmap, frame.0, flags | TtuFlags::BATCH_FLUSH, &mut self.tlb) {
            Ok(result) if result.is_unmapped() => match self.frames.push(frame) {
                Ok(()) => Ok(Unmapped::Held(result)),
                // Capacity was checked above; should it ever fail, the frame
                // still goes back to the caller rather than being dropped.
                Err(frame) => Ok(Unmapped::Full(frame)),
            },
            Ok(result) => Ok(Unmapped::Returned { frame, result }),
            Err(e) => Err((frame, e)),
        }
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

    /// The numbers of the frames held, in the order they were added (for
    /// lookups only: the frames themselves stay in the batch).
    pub fn held_frames(&self) -> impl Iterator<Item = Frame> + '_ {
        self.frames.iter().map(OwnedFrame::frame)
    }

    /// Frames held.
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

    /// Makes every held frame safe to write out: flushes if any deferred PTE
    /// was writable or dirty (one shootdown), and lends the held frames for
    /// I/O. They stay in the batch; [`flush`](Self::flush) before freeing.
    /// On error nothing is lent and the batch still owes its flush.
    pub fn flush_dirty<A: Arch>(&mut self, arch: &A) -> Result<Writeback<'_>, Error> {
        let report = self.tlb.flush_dirty(arch)?;
        Ok(Writeback {
            frames: &self.frames,
            report,
        })
    }

    /// Flushes everything pending (one shootdown at most) and hands every
    /// held frame back, now safe to free or reuse; the batch is then empty
    /// and can be used again. On error the batch keeps its frames and its
    /// pending flush: nothing is lost, retry from a context that is not
    /// nested in another shootdown.
    pub fn flush<A: Arch>(&mut self, arch: &A) -> Result<Flushed<N>, Error> {
        let report = self.tlb.flush(arch)?;
        Ok(Flushed {
            frames: core::mem::take(&mut self.frames),
            report,
        })
    }
}

/// Held frames lent for I/O by [`UnmapBatch::flush_dirty`]: no CPU holds a
/// writable TLB entry for any of them.
#[derive(Debug)]
pub struct Writeback<'a> {
    frames: &'a [OwnedFrame],
    report: Option<ShootdownReport>,
}

impl<'a> Writeback<'a> {
    /// Each held frame, as a handle I/O functions can demand.
    pub fn frames(&self) -> impl Iterator<Item = WritebackFrame<'a>> + 'a {
        self.frames.iter().map(WritebackFrame)
    }

    /// The shootdown `flush_dirty` did, if it had to.
    pub fn report(&self) -> Option<ShootdownReport> {
        self.report
    }
}

/// A frame that may be written out: no CPU holds a writable TLB entry for
/// it. Only [`Writeback::frames`] makes one.
#[derive(Debug, Clone, Copy)]
pub struct WritebackFrame<'a>(&'a OwnedFrame);

impl WritebackFrame<'_> {
    /// The frame number.
    pub fn frame(&self) -> Frame {
        self.0 .0
    }
}

/// Frames handed back by [`UnmapBatch::flush`]: no CPU holds any TLB
/// entry for them.
#[derive(Debug)]
#[must_use = "flushed frames must be freed or kept, not dropped"]
pub struct Flushed<const N: usize> {
    frames: heapless::Vec<OwnedFrame, N>,
    report: ShootdownReport,
}

impl<const N: usize> Flushed<N> {
    /// The shootdown that made them safe.
    pub fn report(&self) -> ShootdownReport {
        self.report
    }

    /// How many frames.
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// The frames themselves, to hand to a batched free (which takes the
    /// ones it frees) or to sort out.
    pub fn frames_mut(&mut self) -> &mut heapless::Vec<OwnedFrame, N> {
        &mut self.frames
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }
}

impl<const N: usize> IntoIterator for Flushed<N> {
    type Item = OwnedFrame;
    type IntoIter = <heapless::Vec<OwnedFrame, N> as IntoIterator>::IntoIter;
    fn into_iter(self) -> Self::IntoIter {
        self.frames.into_iter()
    }
}
