//! The reclaim driver (Linux's `shrink_page_list`): age a list of candidate
//! frames, unmap the cold ones with their flushes batched, write out the
//! dirty ones after one flush, free the rest after one more, in one call.

use crate::arch::Arch;
use crate::pool::FramePool;
use crate::pte::Frame;
use crate::rmap::{Rmap, SwapResult, TtuFlags};
use crate::shootdown::ShootdownReport;
use crate::unmap::{
    Flushed, FreeFrames, Held, OwnedFrame, StillMapped, UnmapBatch, Unmapped, WritebackFrame,
};
use crate::Error;

/// What writing one dirty frame out achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PageOut {
    /// Written and clean again: the frame may be freed.
    Written,
    /// The write is under way: the frame stays allocated until the kernel
    /// sees it complete.
    Queued,
    /// The write could not be started: the frame stays dirty and in use.
    Failed,
}

/// What the kernel supplies to [`shrink_page_list`]: page state, page-out
/// and (through [`FreeFrames`]) batched freeing.
pub trait ReclaimBacking: FreeFrames {
    /// Whether the frame's page is dirty (must be written before freeing).
    fn is_dirty(&self, frame: Frame) -> bool;

    /// Writes a dirty frame out (or starts to). The handle proves that no
    /// CPU holds a writable TLB entry for it.
    fn page_out(&mut self, frame: WritebackFrame<'_>) -> PageOut;
}

/// Why [`shrink_page_list`] handed a frame back instead of freeing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Recently referenced: keep it (activate).
    Referenced,
    /// Mlocked: move it to the unevictable list.
    Mlocked,
    /// Could not be unmapped (still mapped somewhere, or young after all):
    /// activate it or try again later.
    Busy(SwapResult),
    /// Unmapped and being written out: free it when the write completes.
    Writeback,
    /// Unmapped, but the write could not be started: it stays dirty.
    WriteFailed,
    /// Unmapped and flushed, but the allocator refused it.
    FreeRefused,
    /// Not looked at: more candidates than the batch holds.
    NotScanned,
    /// Unmapping it failed with this error (what was cleared is flushed
    /// with the batch).
    Failed(Error),
}

/// Counts of what one [`shrink_page_list`] call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ReclaimSummary {
    /// Candidates looked at.
    pub scanned: usize,
    /// Frames freed: those offered to [`FreeFrames::free_batch`] less those
    /// it left in, or added to, the vector (they come back as
    /// [`Verdict::FreeRefused`]). A free that adds frames of its own lowers
    /// the count, since which of the offered frames it took cannot be told.
    pub freed: usize,
    /// Frames handed back, by any [`Verdict`].
    pub handed_back: usize,
    /// Dirty frames written out (synchronously or queued); a write-out
    /// that failed ([`Verdict::WriteFailed`]) is not counted.
    pub paged_out: usize,
    /// Shootdowns done: at most two (the dirty flush before the first
    /// page-out, and the flush before freeing; with a pool, the pool's
    /// flush instead of the latter). Not counted here: the flush an
    /// address space still owed for a change whose shootdown failed, which
    /// [`try_to_unmap`](crate::try_to_unmap) pays before it clears an entry
    /// of that space (the machine's
    /// [`TlbStatsSnapshot`](crate::TlbStatsSnapshot) counts it).
    pub shootdowns: usize,
    /// IPIs those shootdowns sent.
    pub ipis_sent: usize,
    /// Frames left in a [`FramePool`] with their flush still owed
    /// ([`shrink_page_list_pooled`] only): neither freed nor handed back.
    pub pooled: usize,
}

/// How far one held frame got through page-out; by position in the batch
/// (which keeps insertion order until the flush).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Not looked at for page-out yet.
    Pending,
    /// Clean, or written synchronously: free it after the flush.
    Free,
    /// Write queued: hand it back as [`Verdict::Writeback`].
    Queued,
    /// Write failed: hand it back as [`Verdict::WriteFailed`].
    WriteFailed,
}

fn count_shootdown(summary: &mut ReclaimSummary, report: ShootdownReport) {
    if report != ShootdownReport::default() {
        summary.shootdowns += 1;
        summary.ipis_sent += report.ipis_sent;
    }
}

fn verdict_of(why: StillMapped) -> Verdict {
    match why {
        StillMapped::Busy(SwapResult::Mlock) => Verdict::Mlocked,
        StillMapped::Busy(result) => Verdict::Busy(result),
        StillMapped::Failed(e) => Verdict::Failed(e),
    }
}

/// Reclaims what it can of `candidates` (Linux's `shrink_page_list`).
///
/// 1. Ages each frame with [`page_referenced`](crate::page_referenced): an
///    mlocked one goes back as [`Verdict::Mlocked`], a referenced one as
///    [`Verdict::Referenced`].
/// 2. Unmaps each cold one into `batch` with [`TtuFlags::BATCH_FLUSH`]; one
///    that stays mapped goes back as [`Verdict::Busy`] or `Mlocked` (after
///    the flush, if a mapping it lost owes one).
/// 3. If any unmapped frame is dirty: ONE
///    [`flush_dirty`](UnmapBatch::flush_dirty) before the first page-out,
///    then every dirty frame is written ([`ReclaimBacking::page_out`]). No
///    I/O ever starts before that flush, and there is no flush per page.
/// 4. ONE [`flush`](UnmapBatch::flush) before freeing, then every frame
///    that is clean (or was written synchronously) is freed in ONE
///    [`FreeFrames::free_batch`] call; frames under writeback, frames
///    whose write failed and frames the allocator refused go back.
///
/// Every frame ends freed or handed to `handback` with its verdict: none is
/// dropped. Frames `batch` already held are processed with this call's.
/// Candidates beyond the batch's capacity go back as
/// [`Verdict::NotScanned`]. On a CPU that flushes would miss (not online,
/// or running a candidate's address space without
/// [`switch_mm`](crate::switch_mm)) each candidate goes back as
/// [`Verdict::Failed`] with that error, its accessed bits untouched.
///
/// Errors: a flush that fails ([`Error::ShootdownReentered`],
/// [`Error::OtherMachine`]) stops the call with every unmapped frame and
/// its stage (written, queued, failed, not yet written) moved out of
/// `batch` into the returned [`ReclaimRetry`], which owes the flush; its
/// [`retry`](ReclaimRetry::retry) finishes exactly what is left.
// The retry value owns the batch (about 1 KiB plus the frames): with no
// allocator to box it in, it is moved once, on the error path only.
#[allow(clippy::result_large_err)]
pub fn shrink_page_list<A, R, B, const N: usize>(
    arch: &A,
    rmap: &R,
    backing: &mut B,
    batch: &mut UnmapBatch<N>,
    candidates: impl IntoIterator<Item = OwnedFrame>,
    handback: &mut dyn FnMut(OwnedFrame, Verdict),
) -> Result<ReclaimSummary, ReclaimRetry<N>>
where
    A: Arch,
    R: Rmap + ?Sized,
    B: ReclaimBacking + ?Sized,
{
    let mut work = scan(arch, rmap, batch, candidates, handback);
    work.run(arch, backing, handback)
}

/// [`shrink_page_list`] with the flush before freeing deferred into
/// `pool` ([`FramePool`]): when every frame the call unmapped is clean,
/// unmapped everywhere and needs no page-out, the frames go into the pool
/// instead of being flushed and freed, and the call sends no IPI. They come
/// back, and are freed through `backing`, when every CPU that could cache
/// them has flushed on its own ([`quiescent_flush`](crate::quiescent_flush),
/// an address-space switch), which this call checks first, or when the
/// pool lacks room for this call's frames, in which case one shootdown
/// releases its oldest generations ([`FramePool::flush_oldest`]).
/// Anything else (a dirty page, a frame still mapped, a writable mapping,
/// more frames than the pool holds) takes `shrink_page_list`'s path, and
/// leaves the pool alone.
///
/// [`ReclaimSummary::freed`] counts the frames freed by this call, pooled
/// ones released now included; [`ReclaimSummary::pooled`] the frames it
/// left in the pool. Freeing is the pool's flush point, so the kernel
/// flushes the pool itself ([`FramePool::flush`]) when it needs the memory
/// back sooner, and keeps the duties listed in [`pool`](crate::pool).
///
/// Errors: as for `shrink_page_list`; a failed flush of the pool leaves
/// the pool as it was and this call's frames in the returned
/// [`ReclaimRetry`], whose retry flushes and frees them directly.
#[allow(clippy::result_large_err)] // as for `shrink_page_list`
pub fn shrink_page_list_pooled<A, R, B, const N: usize, const P: usize>(
    arch: &A,
    rmap: &R,
    backing: &mut B,
    batch: &mut UnmapBatch<N>,
    pool: &mut FramePool<P>,
    candidates: impl IntoIterator<Item = OwnedFrame>,
    handback: &mut dyn FnMut(OwnedFrame, Verdict),
) -> Result<ReclaimSummary, ReclaimRetry<N>>
where
    A: Arch,
    R: Rmap + ?Sized,
    B: ReclaimBacking + ?Sized,
{
    let mut work = scan(arch, rmap, batch, candidates, handback);
    let released = pool.release_passed(arch);
    free_released(backing, released, &mut work.summary, handback);
    let poolable = !work.batch.tlb_batch().is_empty()
        && pool.check_defer(arch, &work.batch).is_ok()
        && work
            .batch
            .held()
            .iter()
            .all(|h| !backing.is_dirty(h.frame.frame()));
    if !poolable {
        return work.run(arch, backing, handback);
    }
    if pool.room() < work.batch.len() {
        match pool.flush_oldest(arch, work.batch.len() - pool.room()) {
            Ok(released) => {
                count_shootdown(&mut work.summary, released.report());
                free_released(backing, released, &mut work.summary, handback);
            }
            Err(e) => {
                work.error = Some(e);
                return Err(work);
            }
        }
    }
    match pool.defer(arch, &mut work.batch) {
        Ok(n) => {
            work.summary.pooled += n;
            Ok(core::mem::take(&mut work.summary))
        }
        // Checked above; should the flush have left too little room
        // anyway, the frames are flushed as usual.
        Err(_) => work.run(arch, backing, handback),
    }
}

/// Frees what a pool released through `backing`, handing refused frames
/// back as [`Verdict::FreeRefused`].
fn free_released<B: ReclaimBacking + ?Sized, const P: usize>(
    backing: &mut B,
    mut released: Flushed<P>,
    summary: &mut ReclaimSummary,
    handback: &mut dyn FnMut(OwnedFrame, Verdict),
) {
    let frames = released.frames_mut();
    if frames.is_empty() {
        return;
    }
    let offered = frames.len();
    backing.free_batch(frames);
    summary.freed += offered.saturating_sub(frames.len());
    while let Some(frame) = frames.pop() {
        summary.handed_back += 1;
        handback(frame, Verdict::FreeRefused);
    }
}

/// Steps 1 and 2 of [`shrink_page_list`]: ages and unmaps the candidates
/// into `batch`, handing back what it keeps; the work left (flushes,
/// page-out, freeing) is returned, owning the batch's frames.
fn scan<A, R, const N: usize>(
    arch: &A,
    rmap: &R,
    batch: &mut UnmapBatch<N>,
    candidates: impl IntoIterator<Item = OwnedFrame>,
    handback: &mut dyn FnMut(OwnedFrame, Verdict),
) -> ReclaimRetry<N>
where
    A: Arch,
    R: Rmap + ?Sized,
{
    let mut summary = ReclaimSummary::default();
    let mut give_back = |frame, verdict, summary: &mut ReclaimSummary| {
        summary.handed_back += 1;
        handback(frame, verdict);
    };
    for frame in candidates {
        if batch.len() == N {
            give_back(frame, Verdict::NotScanned, &mut summary);
            continue;
        }
        summary.scanned += 1;
        match batch.page_referenced(arch, rmap, &frame) {
            Ok(r) if r.mlocked => give_back(frame, Verdict::Mlocked, &mut summary),
            Ok(r) if r.referenced > 0 => give_back(frame, Verdict::Referenced, &mut summary),
            Ok(_) => match batch.try_to_unmap(arch, rmap, frame, TtuFlags::BATCH_FLUSH) {
                // Held until the flush, mapped or not.
                Ok(Unmapped::Held(_) | Unmapped::HeldMapped(_)) => {}
                Ok(Unmapped::Returned { frame, result }) => {
                    give_back(frame, verdict_of(StillMapped::Busy(result)), &mut summary)
                }
                Ok(Unmapped::Full(frame)) => give_back(frame, Verdict::NotScanned, &mut summary),
                Err((frame, e)) => give_back(frame, Verdict::Failed(e), &mut summary),
            },
            Err(e) => give_back(frame, Verdict::Failed(e), &mut summary),
        }
    }
    ReclaimRetry {
        batch: core::mem::take(batch),
        stages: [Stage::Pending; N],
        summary,
        error: None,
    }
}

/// A [`shrink_page_list`] call that stopped on a failed flush: it owns the
/// frames that were unmapped, the flush they are owed, and how far each got
/// (so a frame already written is not written again, and one whose write
/// is under way is never offered to the allocator).
///
/// [`retry`](Self::retry) finishes the work, from a context where the
/// flush can succeed. Dropping it instead leaks its frames (they are never
/// freed, so never unsafely) and leaves their address spaces marked as
/// owing a flush.
#[must_use = "it owns unmapped frames and owes their flush: retry it"]
pub struct ReclaimRetry<const N: usize> {
    batch: UnmapBatch<N>,
    stages: [Stage; N],
    summary: ReclaimSummary,
    error: Option<Error>,
}

impl<const N: usize> core::fmt::Debug for ReclaimRetry<N> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ReclaimRetry")
            .field("error", &self.error)
            .field("frames", &self.batch.len())
            .field("summary", &self.summary)
            .finish()
    }
}

impl<const N: usize> ReclaimRetry<N> {
    /// The error that stopped the work (last time it ran).
    pub fn error(&self) -> Option<Error> {
        self.error
    }

    /// Frames it holds.
    pub fn frames(&self) -> usize {
        self.batch.len()
    }

    /// Runs the rest of the work: the dirty flush and page-out of frames
    /// not written yet, the flush, the batched free and the hand-backs. The
    /// summary covers the whole reclaim, the first call's scan included.
    /// Errors: the work is handed back again, with the new error.
    ///
    /// `backing` is asked again which frames are dirty: give it one that
    /// answers as the first call's did (the dirty state belongs with the
    /// frame, in the kernel's page structure, not in a backing built for
    /// one call). A backing that forgot would have a dirty frame freed
    /// without its page-out.
    #[allow(clippy::result_large_err)] // as for the driver itself
    pub fn retry<A, B>(
        mut self,
        arch: &A,
        backing: &mut B,
        handback: &mut dyn FnMut(OwnedFrame, Verdict),
    ) -> Result<ReclaimSummary, ReclaimRetry<N>>
    where
        A: Arch,
        B: ReclaimBacking + ?Sized,
    {
        self.run(arch, backing, handback)
    }

    /// [`finish`](Self::finish), with a failure handed back as the work.
    #[allow(clippy::result_large_err)] // as for the driver itself
    fn run<A, B>(
        &mut self,
        arch: &A,
        backing: &mut B,
        handback: &mut dyn FnMut(OwnedFrame, Verdict),
    ) -> Result<ReclaimSummary, ReclaimRetry<N>>
    where
        A: Arch,
        B: ReclaimBacking + ?Sized,
    {
        match self.finish(arch, backing, handback) {
            Ok(summary) => Ok(summary),
            Err(e) => Err(ReclaimRetry {
                batch: core::mem::take(&mut self.batch),
                stages: core::mem::replace(&mut self.stages, [Stage::Pending; N]),
                summary: core::mem::take(&mut self.summary),
                error: Some(e),
            }),
        }
    }

    /// Steps 3 and 4 of [`shrink_page_list`], resumable: every stage it
    /// reaches is recorded before the next step that can fail.
    fn finish<A, B>(
        &mut self,
        arch: &A,
        backing: &mut B,
        handback: &mut dyn FnMut(OwnedFrame, Verdict),
    ) -> Result<ReclaimSummary, Error>
    where
        A: Arch,
        B: ReclaimBacking + ?Sized,
    {
        let wants_io = |held: &Held, stage: Stage| {
            held.mapped.is_none() && stage == Stage::Pending && backing.is_dirty(held.frame.frame())
        };
        let needs_page_out = self
            .batch
            .held()
            .iter()
            .zip(self.stages.iter())
            .any(|(h, &s)| wants_io(h, s));
        if needs_page_out {
            let io = self.batch.flush_dirty(arch)?;
            count_shootdown(&mut self.summary, io.report().unwrap_or_default());
            for (i, page) in io.indexed() {
                let Some(stage) = self.stages.get_mut(i) else {
                    continue;
                };
                if *stage != Stage::Pending {
                    continue;
                }
                *stage = if backing.is_dirty(page.frame()) {
                    let stage = match backing.page_out(page) {
                        PageOut::Written => Stage::Free,
                        PageOut::Queued => Stage::Queued,
                        PageOut::Failed => Stage::WriteFailed,
                    };
                    // A write that failed wrote nothing out.
                    self.summary.paged_out += usize::from(stage != Stage::WriteFailed);
                    stage
                } else {
                    Stage::Free
                };
            }
        }

        let report = self.batch.flush_tlb(arch)?;
        count_shootdown(&mut self.summary, report);
        let stages = core::mem::replace(&mut self.stages, [Stage::Pending; N]);
        let mut to_free: heapless::Vec<OwnedFrame, N> = heapless::Vec::new();
        for (held, stage) in self.batch.take_held().into_iter().zip(stages) {
            let verdict = match (held.mapped, stage) {
                (Some(why), _) => Some(verdict_of(why)),
                (None, Stage::Queued) => Some(Verdict::Writeback),
                (None, Stage::WriteFailed) => Some(Verdict::WriteFailed),
                (None, Stage::Pending | Stage::Free) => None,
            };
            match verdict {
                Some(v) => {
                    self.summary.handed_back += 1;
                    handback(held.frame, v);
                }
                // SAFETY: at most N frames were held, so `to_free` (of
                // capacity N) has room for each of them.
                None => unsafe { to_free.push_unchecked(held.frame) },
            }
        }
        if !to_free.is_empty() {
            let offered = to_free.len();
            backing.free_batch(&mut to_free);
            // An implementation may hand back more than it was given.
            self.summary.freed += offered.saturating_sub(to_free.len());
            while let Some(frame) = to_free.pop() {
                self.summary.handed_back += 1;
                handback(frame, Verdict::FreeRefused);
            }
        }
        self.error = None;
        Ok(core::mem::take(&mut self.summary))
    }
}
