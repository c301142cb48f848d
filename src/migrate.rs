//! The migration driver: move a list of frames' contents to new frames with
//! one flush before the first copy and one before the old frames are
//! released.

use core::ops::ControlFlow;

use crate::arch::Arch;
use crate::pte::{Frame, Pte, PteFlags};
use crate::rmap::{PageTable, Rmap, SwapResult, TtuFlags};
use crate::shootdown::ShootdownReport;
use crate::unmap::{FreeFrames, OwnedFrame, UnmapBatch, Unmapped, WritebackFrame};
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
}

/// One frame's fate in [`migrate_pages`].
#[derive(Debug, PartialEq, Eq)]
pub enum MigrateOutcome {
    /// Moved: the mappings of `old` now map `new`, and `old` was released.
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
    /// Moved, but the allocator refused to take the old frame back: here it
    /// is, unmapped and flushed.
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

/// Replaces every migration entry naming `old` with a present PTE for
/// `new` (writable if the original mapping was); `new == old` undoes a
/// migration.
fn remove_migration_ptes<R: Rmap + ?Sized>(rmap: &R, old: Frame, new: Frame) {
    let _ = rmap.walk(old, &mut |m| {
        let pte = m.space.lookup(m.va);
        if pte.is_migration() && pte.frame() == old {
            let mut flags = PteFlags::PRESENT;
            flags |= if m.space.tlb_state().is_kernel() {
                PteFlags::GLOBAL
            } else {
                PteFlags::USER
            };
            if pte.flags().contains(PteFlags::WAS_WRITABLE) {
                flags |= PteFlags::WRITABLE;
            }
            m.space.set(m.va, Pte::new(new, flags));
        }
        ControlFlow::Continue(())
    });
}

const KEEP_NONE: u8 = 0;
const KEEP_NO_MEMORY: u8 = 1;

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
/// 1. Unmaps each with [`TtuFlags::MIGRATION`] | `BATCH_FLUSH` (mlock and
///    access bits ignored, as migration must), so every mapping becomes a
///    migration entry and its flush joins `batch`. A frame still mapped is
///    tried again, up to [`MIGRATE_PASSES`] passes in all, then reported
///    [`MigrateFailure::Busy`] with its mappings restored.
/// 2. ONE [`flush_dirty`](UnmapBatch::flush_dirty) before the first copy
///    (it flushes whenever any entry was writable or dirty; otherwise
///    nobody can write the frames and copying is safe as is).
/// 3. For each frame: allocate a target, copy, point the migration entries
///    at the new frame. If allocation fails, the original mappings are
///    restored and the frame reported [`MigrateFailure::NoMemory`].
/// 4. ONE [`flush`](UnmapBatch::flush), then the old frames of the moved
///    pages are released in ONE [`FreeFrames::free_batch`] call.
///
/// Every frame ends in exactly one [`MigrateOutcome`] given to `report`.
///
/// Errors: a failed flush returns the error with the frames still in
/// `batch` (their mappings are migration entries until a retry finishes).
pub fn migrate_pages<A, R, B, const N: usize>(
    arch: &A,
    rmap: &R,
    backing: &mut B,
    batch: &mut UnmapBatch<N>,
    pages: impl IntoIterator<Item = OwnedFrame>,
    report: &mut dyn FnMut(MigrateOutcome),
) -> Result<MigrateSummary, Error>
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
        if let Err(frame) = pending.push(frame) {
            fail(report, &mut summary, frame, MigrateFailure::NotScanned);
        }
    }
    for pass in 1..=MIGRATE_PASSES {
        if pending.is_empty() {
            break;
        }
        summary.passes = pass;
        let mut busy: heapless::Vec<OwnedFrame, N> = heapless::Vec::new();
        for frame in core::mem::take(&mut pending) {
            match batch.try_to_unmap(arch, rmap, frame, flags) {
                Ok(Unmapped::Held(_)) => {}
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

    let mut marks = [KEEP_NONE; N];
    {
        let io = batch.flush_dirty(arch)?;
        count_shootdown(&mut summary, io.report().unwrap_or_default());
        for (i, old) in io.frames().enumerate() {
            match backing.alloc_target(old.frame()) {
                Some(new) => {
                    backing.copy_frame(old, &new);
                    remove_migration_ptes(rmap, old.frame(), new.frame());
                    backing.move_mappings(old.frame(), new.frame());
                    summary.migrated += 1;
                    report(MigrateOutcome::Migrated {
                        old: old.frame(),
                        new,
                    });
                }
                None => {
                    remove_migration_ptes(rmap, old.frame(), old.frame());
                    marks[i] = KEEP_NO_MEMORY;
                }
            }
        }
    }

    let mut flushed = batch.flush(arch)?;
    count_shootdown(&mut summary, flushed.report());
    let frames = flushed.frames_mut();
    for i in (0..frames.len()).rev() {
        if marks.get(i) == Some(&KEEP_NO_MEMORY) {
            fail(
                report,
                &mut summary,
                frames.swap_remove(i),
                MigrateFailure::NoMemory,
            );
        }
    }
    backing.free_batch(frames);
    while let Some(frame) = frames.pop() {
        report(MigrateOutcome::OldFrameRefused(frame));
    }
    Ok(summary)
}
