//! The reclaim driver (Linux's `shrink_page_list`): age a list of candidate
//! frames, unmap the cold ones with their flushes batched, write out the
//! dirty ones after one flush, free the rest after one more, in one call.

use crate::arch::Arch;
use crate::pte::Frame;
use crate::rmap::{Rmap, SwapResult, TtuFlags};
use crate::shootdown::ShootdownReport;
use crate::unmap::{FreeFrames, OwnedFrame, UnmapBatch, Unmapped, WritebackFrame};
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
    /// Frames freed.
    pub freed: usize,
    /// Frames handed back, by any [`Verdict`].
    pub handed_back: usize,
    /// Dirty frames written out (synchronously or queued).
    pub paged_out: usize,
    /// Shootdowns done: at most two (the dirty flush before the first
    /// page-out, and the flush before freeing).
    pub shootdowns: usize,
    /// IPIs those shootdowns sent.
    pub ipis_sent: usize,
}

const KEEP_NONE: u8 = 0;
const KEEP_WRITEBACK: u8 = 1;
const KEEP_WRITE_FAILED: u8 = 2;

fn count_shootdown(summary: &mut ReclaimSummary, report: ShootdownReport) {
    if report != ShootdownReport::default() {
        summary.shootdowns += 1;
        summary.ipis_sent += report.ipis_sent;
    }
}

/// Reclaims what it can of `candidates` (Linux's `shrink_page_list`).
///
/// 1. Ages each frame with [`page_referenced`](crate::page_referenced): an
///    mlocked one goes back as [`Verdict::Mlocked`], a referenced one as
///    [`Verdict::Referenced`].
/// 2. Unmaps each cold one into `batch` with [`TtuFlags::BATCH_FLUSH`]; one
///    that stays mapped goes back as [`Verdict::Busy`] or `Mlocked`.
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
/// [`Verdict::NotScanned`].
///
/// Errors: a flush that fails ([`Error::ShootdownReentered`]) returns the
/// error with the unmapped frames still in `batch`, which still owes its
/// flush; call again (with no candidates) to finish.
pub fn shrink_page_list<A, R, B, const N: usize>(
    arch: &A,
    rmap: &R,
    backing: &mut B,
    batch: &mut UnmapBatch<N>,
    candidates: impl IntoIterator<Item = OwnedFrame>,
    handback: &mut dyn FnMut(OwnedFrame, Verdict),
) -> Result<ReclaimSummary, Error>
where
    A: Arch,
    R: Rmap + ?Sized,
    B: ReclaimBacking + ?Sized,
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
                Ok(Unmapped::Held(_)) => {}
                Ok(Unmapped::Returned {
                    frame,
                    result: SwapResult::Mlock,
                }) => give_back(frame, Verdict::Mlocked, &mut summary),
                Ok(Unmapped::Returned { frame, result }) => {
                    give_back(frame, Verdict::Busy(result), &mut summary)
                }
                Ok(Unmapped::Full(frame)) => give_back(frame, Verdict::NotScanned, &mut summary),
                Err((frame, e)) => give_back(frame, Verdict::Failed(e), &mut summary),
            },
            Err(e) => give_back(frame, Verdict::Failed(e), &mut summary),
        }
    }

    // Which held frames stay allocated after the final flush, by position
    // in the batch (it keeps insertion order): a byte each, not a frame.
    let mut marks = [KEEP_NONE; N];
    if batch.held_frames().any(|f| backing.is_dirty(f)) {
        let io = batch.flush_dirty(arch)?;
        count_shootdown(&mut summary, io.report().unwrap_or_default());
        for (i, page) in io.frames().enumerate() {
            if backing.is_dirty(page.frame()) {
                summary.paged_out += 1;
                marks[i] = match backing.page_out(page) {
                    PageOut::Written => KEEP_NONE,
                    PageOut::Queued => KEEP_WRITEBACK,
                    PageOut::Failed => KEEP_WRITE_FAILED,
                };
            }
        }
    }

    let mut flushed = batch.flush(arch)?;
    count_shootdown(&mut summary, flushed.report());
    let frames = flushed.frames_mut();
    // From the back, so that swap_remove only moves frames already seen.
    for i in (0..frames.len()).rev() {
        let verdict = match marks.get(i) {
            Some(&KEEP_WRITEBACK) => Verdict::Writeback,
            Some(&KEEP_WRITE_FAILED) => Verdict::WriteFailed,
            _ => continue,
        };
        give_back(frames.swap_remove(i), verdict, &mut summary);
    }
    let offered = frames.len();
    backing.free_batch(frames);
    summary.freed = offered - frames.len();
    while let Some(frame) = frames.pop() {
        give_back(frame, Verdict::FreeRefused, &mut summary);
    }
    Ok(summary)
}
