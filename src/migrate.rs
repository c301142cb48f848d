//! The migration driver: move a list of frames' contents to new frames with
//! one flush before the first copy and one before the old frames are
//! released.

use core::ops::ControlFlow;

use crate::arch::Arch;
use crate::pte::{Frame, Pte};
use crate::rmap::{PageTable, Rmap, SwapResult, TtuFlags};
use crate::shootdown::ShootdownReport;
use crate::unmap::{FreeFrames, OwnedFrame, StillMapped, UnmapBatch, Unmapped, WritebackFrame};
use crate::Error;

/// How many times a frame that is still mapped after an unmap attempt is
/// tried again before it is reported busy.
pub const MIGRATE_PASSES: usize = 10;

/// What the kernel supplies to [`migrate_pages`].
pub trait MigrateBacking: FreeFrames {
    /// A new frame to receive `old`'s contents, or `None` when memory is
    /// short (the migration of `old` is then undone).
    fn alloc_target(&mut self, old: Frame) -> Option<OwnedFrame>;

    /// Copies the contents and page state (dirty, ...) of `from` into `to`.
    /// The handle proves that no CPU can write `from` any more.
    fn copy_frame(&mut self, from: WritebackFrame<'_>, to: &OwnedFrame);

    /// Reverse-map bookkeeping: every mapping of `old` now maps `new`.
    ///
    /// Called after the migration entries naming `old` were replaced by
    /// entries mapping `new`, which the crate finds through the reverse map
    /// under `old` ([`Rmap::walk`](crate::Rmap::walk)): so the reverse map
    /// must still list `old`'s mappings under `old` until this call (not
    /// move them earlier, in [`copy_frame`](Self::copy_frame) for example),
    /// or those entries would stay migration entries.
    fn move_mappings(&mut self, old: Frame, new: Frame);
}

/// Why a frame was not migrated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MigrateFailure {
    /// Still mapped after every pass (the result of the last unmap).
    Busy(SwapResult),
    /// No target frame could be allocated.
    NoMemory,
    /// More frames than the batch holds.
    NotScanned,
    /// Unmapping failed with this error.
    Failed(Error),
    /// The frame is hardware-poisoned: nothing was copied from it, and it
    /// is handed back rather than freed (its mappings are left as they
    /// were, or, when the poison was found after the unmap, are hwpoison
    /// entries).
    HwPoisoned,
}

/// One frame's fate in [`migrate_pages`].
#[derive(Debug, PartialEq, Eq)]
pub enum MigrateOutcome {
    /// Moved: the mappings of `old` now map `new`. Reported as soon as the
    /// copy is done, which hands `new` over; `old` is released after the
    /// call's final flush (or its [`MigrateRetry`]'s), and should the
    /// allocator refuse it, an [`OldFrameRefused`](Self::OldFrameRefused)
    /// report for it follows.
    Migrated {
        /// The frame that held the contents.
        old: Frame,
        /// The frame that holds them now.
        new: OwnedFrame,
    },
    /// Not moved: the frame is back, with its original mappings restored.
    Failed {
        /// The frame.
        frame: OwnedFrame,
        /// Why.
        reason: MigrateFailure,
    },
    /// A frame already reported [`Migrated`](Self::Migrated) that the
    /// allocator refused to take back: here it is, unmapped and flushed. The
    /// only second report a frame can get.
    OldFrameRefused(OwnedFrame),
}

/// Counts of what one [`migrate_pages`] call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MigrateSummary {
    /// Frames moved.
    pub migrated: usize,
    /// Frames not moved.
    pub failed: usize,
    /// Unmap passes made (1 when nothing was busy).
    pub passes: usize,
    /// Shootdowns done (at most two: before the first copy, before release).
    pub shootdowns: usize,
    /// IPIs they sent.
    pub ipis_sent: usize,
}

/// Replaces every migration entry naming `old` with the present entry it
/// stood for, now mapping `new` (every bit the migration did not own is
/// kept: see [`Pte::from_migration`]); `new == old` undoes a migration.
fn remove_migration_ptes<R: Rmap + ?Sized>(rmap: &R, old: Frame, new: Frame) {
    // The restored entries have their accessed bit clear, while a CPU may
    // still cache the old mapping (an undo comes before the batch's
    // flush): no aging epoch vouches for them any more.
    rmap.set_aged_epoch(new, None);
    let _ = rmap.walk(old, &mut |m| {
        let pte = m.space.lookup(m.va);
        if pte.is_migration() && pte.frame() == old {
            if let Some(present) = pte.from_migration(new) {
                m.space.set(m.va, present);
            }
        }
        ControlFlow::Continue(())
    });
}

/// Turns every migration entry naming `frame` into a hwpoison entry: the
/// frame went bad while its mappings waited, so they must not come back.
fn poison_migration_ptes<R: Rmap + ?Sized>(rmap: &R, frame: Frame) {
    let _ = rmap.walk(frame, &mut |m| {
        let pte = m.space.lookup(m.va);
        if pte.is_migration() && pte.frame() == frame {
            m.space.set(m.va, Pte::hwpoison(frame));
        }
        ControlFlow::Continue(())
    });
}

fn fail(
    report: &mut dyn FnMut(MigrateOutcome),
    summary: &mut MigrateSummary,
    frame: OwnedFrame,
    reason: MigrateFailure,
) {
    summary.failed += 1;
    report(MigrateOutcome::Failed { frame, reason });
}

fn count_shootdown(summary: &mut MigrateSummary, report: ShootdownReport) {
    if report != ShootdownReport::default() {
        summary.shootdowns += 1;
        summary.ipis_sent += report.ipis_sent;
    }
}

/// Migrates `pages`:
///
/// 1. A hardware-poisoned frame is reported [`MigrateFailure::HwPoisoned`]
///    at once, untouched: nothing is ever copied from it, and it never goes
///    back to the allocator. A frame mapped through an entry larger than
///    4 KiB (a huge page, or an arm64 16 or 64 KiB page) is not migrated:
///    it is reported `MigrateFailure::Failed(Error::HugePage { .. })`,
///    its mappings untouched, and the call goes on with the others (the
///    call itself returns `Ok`).
/// 2. Unmaps each other one with [`TtuFlags::MIGRATION`] | `BATCH_FLUSH`
///    (mlock and access bits ignored, as migration must), so every mapping
///    becomes a migration entry and its flush joins `batch`. A frame still
///    mapped is tried again, up to [`MIGRATE_PASSES`] passes in all, then
///    reported [`MigrateFailure::Busy`] with its mappings restored (after
///    the flush, if a mapping it lost owes one).
/// 3. ONE [`flush_dirty`](UnmapBatch::flush_dirty) before the first copy
///    (it flushes whenever any entry was writable or dirty; otherwise
///    nobody can write the frames and copying is safe as is).
/// 4. For each frame: allocate a target, copy, point the migration entries
///    at the new frame (keeping every bit of the original entries but the
///    frame, accessed and dirty). If allocation fails, the original
///    mappings are restored and the frame reported
///    [`MigrateFailure::NoMemory`]; if the frame turned out poisoned, its
///    entries become hwpoison entries and it is reported `HwPoisoned`.
/// 5. ONE [`flush`](UnmapBatch::flush), then the old frames of the moved
///    pages are released in ONE [`FreeFrames::free_batch`] call.
///
/// Every frame gets exactly one [`MigrateOutcome::Migrated`] or
/// [`MigrateOutcome::Failed`] given to `report`; a migrated frame whose old
/// frame the allocator then refuses also comes back, after the final
/// flush, as [`MigrateOutcome::OldFrameRefused`].
/// Frames `batch` already held are migrated with this call's (a mapping an
/// earlier unmap removed without [`TtuFlags::MIGRATION`] left no entry to
/// point at the new frame: such a frame's contents move, nothing maps it).
///
/// Errors: a failed flush ([`Error::ShootdownReentered`],
/// [`Error::OtherMachine`]) stops the call with the held frames and how far
/// each got (waiting for its copy, moved, restored) moved out of `batch`
/// into the returned [`MigrateRetry`], which owes the flush; its
/// [`retry`](MigrateRetry::retry) finishes exactly what is left, and no
/// frame is copied, restored or reported twice.
// The retry value owns the batch (about 1 KiB plus the frames): with no
// allocator to box it in, it is moved once, on the error path only.
#[allow(clippy::result_large_err)]
pub fn migrate_pages<A, R, B, const N: usize>(
    arch: &A,
    rmap: &R,
    backing: &mut B,
    batch: &mut UnmapBatch<N>,
    pages: impl IntoIterator<Item = OwnedFrame>,
    report: &mut dyn FnMut(MigrateOutcome),
) -> Result<MigrateSummary, MigrateRetry<N>>
where
    A: Arch,
    R: Rmap + ?Sized,
    B: MigrateBacking + ?Sized,
{
    let mut summary = MigrateSummary::default();
    let flags =
        TtuFlags::MIGRATION | TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_MLOCK | TtuFlags::IGNORE_ACCESS;

    let mut pending: heapless::Vec<OwnedFrame, N> = heapless::Vec::new();
    for frame in pages {
        if rmap.is_hwpoisoned(frame.frame()) {
            fail(report, &mut summary, frame, MigrateFailure::HwPoisoned);
        } else if let Err(frame) = pending.push(frame) {
            fail(report, &mut summary, frame, MigrateFailure::NotScanned);
        }
    }
    let held_busy = |batch: &UnmapBatch<N>| {
        batch
            .held()
            .iter()
            .any(|h| matches!(h.mapped, Some(StillMapped::Busy(_))))
    };
    for pass in 1..=MIGRATE_PASSES {
        if pending.is_empty() && !held_busy(batch) {
            break;
        }
        summary.passes = pass;
        // Frames held still mapped (from the pass before, or from before
        // the call) are tried again.
        batch.retry_mapped(arch, rmap, flags);
        let mut busy: heapless::Vec<OwnedFrame, N> = heapless::Vec::new();
        for frame in core::mem::take(&mut pending) {
            match batch.try_to_unmap(arch, rmap, frame, flags) {
                // Held until the flush; a still mapped one is retried by
                // the next pass (`retry_mapped`).
                Ok(Unmapped::Held(_) | Unmapped::HeldMapped(_)) => {}
                Ok(Unmapped::Returned { frame, result }) if pass < MIGRATE_PASSES => {
                    // `busy` holds at most what `pending` held.
                    if let Err(frame) = busy.push(frame) {
                        remove_migration_ptes(rmap, frame.frame(), frame.frame());
                        fail(report, &mut summary, frame, MigrateFailure::Busy(result));
                    }
                }
                Ok(Unmapped::Returned { frame, result }) => {
                    remove_migration_ptes(rmap, frame.frame(), frame.frame());
                    fail(report, &mut summary, frame, MigrateFailure::Busy(result));
                }
                Ok(Unmapped::Full(frame)) => fail(report, &mut summary, frame, MigrateFailure::NotScanned),
                Err((frame, e)) => {
                    remove_migration_ptes(rmap, frame.frame(), frame.frame());
                    fail(report, &mut summary, frame, MigrateFailure::Failed(e));
                }
            }
        }
        pending = busy;
    }
    // Frames the passes could not unmap wholly get their mappings back now;
    // they leave the batch after its flush.
    for held in batch.held().iter().filter(|h| h.mapped.is_some()) {
        remove_migration_ptes(rmap, held.frame.frame(), held.frame.frame());
    }

    let mut work = MigrateRetry {
        batch: core::mem::take(batch),
        stages: [Stage::Waiting; N],
        summary,
        error: None,
    };
    match work.finish(arch, rmap, backing, report) {
        Ok(summary) => Ok(summary),
        Err(e) => {
            work.error = Some(e);
            Err(work)
        }
    }
}

/// How far one held, unmapped frame got; by position in the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Its mappings are migration entries; not copied yet.
    Waiting,
    /// Copied and reported; its mappings point at the new frame. The old
    /// frame is released after the flush.
    Moved,
    /// No target frame: mappings restored, reported after the flush.
    NoMemory,
    /// Found poisoned: mappings are hwpoison entries, reported after the
    /// flush and never freed.
    Poisoned,
}

/// A [`migrate_pages`] call that stopped on a failed flush: it owns the
/// held frames, the flush they are owed and how far each got, so that
/// [`retry`](Self::retry) finishes exactly what is left. Dropping it leaks
/// its frames (never freed, so never unsafely) and leaves any migration
/// entries in place, so accesses to those pages keep waiting: retry it.
#[must_use = "it owns frames under migration and owes their flush: retry it"]
pub struct MigrateRetry<const N: usize> {
    batch: UnmapBatch<N>,
    stages: [Stage; N],
    summary: MigrateSummary,
    error: Option<Error>,
}

impl<const N: usize> core::fmt::Debug for MigrateRetry<N> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MigrateRetry")
            .field("error", &self.error)
            .field("frames", &self.batch.len())
            .field("summary", &self.summary)
            .finish()
    }
}

impl<const N: usize> MigrateRetry<N> {
    /// The error that stopped the work (last time it ran).
    pub fn error(&self) -> Option<Error> {
        self.error
    }

    /// Frames it holds.
    pub fn frames(&self) -> usize {
        self.batch.len()
    }

    /// Runs the rest of the work (steps 3 to 5 of [`migrate_pages`] for
    /// what is left). The summary covers the whole migration. Errors: the
    /// work is handed back again, with the new error.
    #[allow(clippy::result_large_err)] // as for the driver itself
    pub fn retry<A, R, B>(
        mut self,
        arch: &A,
        rmap: &R,
        backing: &mut B,
        report: &mut dyn FnMut(MigrateOutcome),
    ) -> Result<MigrateSummary, MigrateRetry<N>>
    where
        A: Arch,
        R: Rmap + ?Sized,
        B: MigrateBacking + ?Sized,
    {
        match self.finish(arch, rmap, backing, report) {
            Ok(summary) => Ok(summary),
            Err(e) => {
                self.error = Some(e);
                Err(self)
            }
        }
    }

    fn finish<A, R, B>(
        &mut self,
        arch: &A,
        rmap: &R,
        backing: &mut B,
        report: &mut dyn FnMut(MigrateOutcome),
    ) -> Result<MigrateSummary, Error>
    where
        A: Arch,
        R: Rmap + ?Sized,
        B: MigrateBacking + ?Sized,
    {
        let waiting = self
            .batch
            .held()
            .iter()
            .zip(self.stages.iter())
            .any(|(h, &s)| h.mapped.is_none() && s == Stage::Waiting);
        if waiting {
            let io = self.batch.flush_dirty(arch)?;
            count_shootdown(&mut self.summary, io.report().unwrap_or_default());
            for (i, old) in io.indexed() {
                let Some(stage) = self.stages.get_mut(i) else {
                    continue;
                };
                if *stage != Stage::Waiting {
                    continue;
                }
                *stage = if rmap.is_hwpoisoned(old.frame()) {
                    poison_migration_ptes(rmap, old.frame());
                    Stage::Poisoned
                } else if let Some(new) = backing.alloc_target(old.frame()) {
                    backing.copy_frame(old, &new);
                    remove_migration_ptes(rmap, old.frame(), new.frame());
                    backing.move_mappings(old.frame(), new.frame());
                    self.summary.migrated += 1;
                    report(MigrateOutcome::Migrated {
                        old: old.frame(),
                        new,
                    });
                    Stage::Moved
                } else {
                    remove_migration_ptes(rmap, old.frame(), old.frame());
                    Stage::NoMemory
                };
            }
        }

        let flushed = self.batch.flush_tlb(arch)?;
        count_shootdown(&mut self.summary, flushed);
        let stages = core::mem::replace(&mut self.stages, [Stage::Waiting; N]);
        let mut release: heapless::Vec<OwnedFrame, N> = heapless::Vec::new();
        for (held, stage) in self.batch.take_held().into_iter().zip(stages) {
            let reason = match (held.mapped, stage) {
                (Some(StillMapped::Busy(r)), _) => MigrateFailure::Busy(r),
                (Some(StillMapped::Failed(e)), _) => MigrateFailure::Failed(e),
                (None, Stage::NoMemory) => MigrateFailure::NoMemory,
                (None, Stage::Poisoned) => MigrateFailure::HwPoisoned,
                (None, Stage::Moved) => {
                    // SAFETY: at most N frames were held, so `release` (of
                    // capacity N) has room for each of them.
                    unsafe { release.push_unchecked(held.frame) };
                    continue;
                }
                (None, Stage::Waiting) => {
                    // Every waiting frame was handled once `flush_dirty`
                    // succeeded; should one be left, it gets its mappings
                    // back rather than stay unreachable.
                    remove_migration_ptes(rmap, held.frame.frame(), held.frame.frame());
                    MigrateFailure::NoMemory
                }
            };
            fail(report, &mut self.summary, held.frame, reason);
        }
        if !release.is_empty() {
            backing.free_batch(&mut release);
            while let Some(frame) = release.pop() {
                report(MigrateOutcome::OldFrameRefused(frame));
            }
        }
        self.error = None;
        Ok(core::mem::take(&mut self.summary))
    }
}
