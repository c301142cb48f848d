//! Unmapping: [`try_to_unmap`] removes every mapping of a frame, deferring
//! or doing each TLB flush, and reports what it achieved as a
//! [`SwapResult`].

use core::ops::ControlFlow;

use super::aging::{clear_young, note_aged};
use super::visit::{check_mappings, walk_mapped, Huge};
use super::{Mapping, MappingFlags, PageTable, Rmap, TtuFlags};
use crate::arch::Arch;
use crate::batch::TlbFlushUnmapBatch;
use crate::cpuset::CpuSet;
use crate::mm::flush_tlb_batched_pending;
use crate::pte::{Frame, Pte};
use crate::request::FlushRequest;
use crate::shootdown::shootdown;
use crate::Error;

/// What [`try_to_unmap`] achieved (Linux's `SWAP_*` codes, with the batched
/// flush series' two `*Cached` additions).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[must_use]
pub enum SwapResult {
    /// Every mapping is gone. No TLB entry that allows a write survives
    /// unflushed; but with [`TtuFlags::BATCH_FLUSH`] read-only or clean
    /// entries may still be cached until the batch is flushed, so the frame
    /// must not be freed or reused before
    /// [`TlbFlushUnmapBatch::flush`] (contract rule 2). It may be written
    /// out at once.
    Success,
    /// Every mapping is gone, but a flush was deferred for a PTE that was
    /// writable or dirty: a CPU may still write through a cached entry until
    /// the batch is flushed. Flush before writing the frame out
    /// ([`TlbFlushUnmapBatch::flush_dirty`]) and before freeing it
    /// ([`TlbFlushUnmapBatch::flush`]).
    SuccessCached,
    /// A mapping is left (it appeared during the walk, or could not be
    /// removed); try again later.
    Again,
    /// Like [`Again`](Self::Again), and some mapping that was removed left a
    /// possibly writable TLB entry behind, pending in the batch.
    AgainCached,
    /// The frame was recently referenced through a mapping; it stays.
    Fail,
    /// A mapping locks the frame in memory.
    Mlock,
}

impl SwapResult {
    /// Whether no mapping is left.
    pub fn is_unmapped(self) -> bool {
        matches!(self, SwapResult::Success | SwapResult::SuccessCached)
    }

    /// Whether a writable TLB entry may survive until the batch is flushed.
    pub fn is_cached(self) -> bool {
        matches!(self, SwapResult::SuccessCached | SwapResult::AgainCached)
    }
}

/// What removing one mapping left behind.
#[derive(Clone, Copy, Default)]
struct Cleared {
    /// Its flush is owed by `batch` (deferred, or an immediate flush that
    /// failed).
    owed: bool,
    /// A possibly writable TLB entry survives until that flush.
    writable: bool,
}

/// Removes one mapping. Every check that could fail runs before the PTE
/// is exchanged; after it, the flush is either done or recorded in `batch`
/// whatever happens. An error says whether its flush is owed by `batch`
/// (`true` once the PTE is gone: the immediate flush failed).
fn unmap_one<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    m: &Mapping<'_, R::Space>,
    frame: Frame,
    flags: TtuFlags,
    poisoned: bool,
    batch: &mut TlbFlushUnmapBatch,
) -> Result<Cleared, (bool, Error)> {
    let mm = m.space.tlb_state();
    // A huge entry goes whole, at its first address (the pre-check refused
    // any other), with one flush at its stride.
    let pages = batch
        .check_add_sized(arch, mm, m.va, m.space.entry_size(m.va))
        .map_err(|e| (false, e))?;
    let me = arch.current_cpu().map_err(|e| (false, e))?;
    // A change of this space whose flush failed (a `change_protection`
    // that returned its error) may have left a CPU an entry that allows
    // more than the PTE says: writable where the PTE is now read-only.
    // What this unmap records (whether a writable entry survives, so that
    // `flush_dirty` must flush before a write-out) is judged by the PTE,
    // so that flush comes first, as every later change of the space owes
    // it; an error stops here, nothing changed for this mapping.
    if mm.flush_owed() {
        flush_tlb_batched_pending(arch, mm).map_err(|e| (false, e))?;
    }
    let current = m.space.lookup(m.va);
    let replacement = if poisoned {
        Pte::hwpoison(frame)
    } else if flags.contains(TtuFlags::MIGRATION) {
        current.to_migration()
    } else {
        Pte::EMPTY
    };
    // One atomic exchange: a dirty bit set by hardware up to this instant is
    // in `old`; after it, no walk can find the frame.
    let old = m.space.exchange(m.va, replacement);
    if old.is_dirty() {
        rmap.set_dirty(frame);
    }
    // Found with the accessed bit clear: no CPU cached the mapping since
    // the frame's last aging, so flushing past its aging epoch is enough
    // (asked only when the flush is deferred: the path that flushes at
    // once pays nothing for it).
    let aged = || {
        if arch.fill_sets_accessed() && !old.is_accessed() {
            rmap.aged_epoch(frame)
        } else {
            None
        }
    };
    // Read once, after the exchange (as `flush_targets` requires), for the
    // decision and for the flush alike: what `should_defer` would answer,
    // without reading the CPU set a second time.
    let (targets, step) = mm.flush_targets_step(arch);
    let defer = flags.contains(TtuFlags::BATCH_FLUSH)
        && A::CLEAN_WRITE_REWALK
        && !targets.difference(&CpuSet::single(me)).is_empty();
    if defer {
        batch.record_pending(arch, mm, pages, old, (&targets, step), aged());
        return Ok(Cleared {
            owed: true,
            writable: old.is_writable() || old.is_dirty(),
        });
    }
    let mut request = FlushRequest::new();
    request.add_pages_step(mm.asid(), pages, A::FULL_FLUSH_CEILING, step);
    if let Err(e) = shootdown(arch, &targets, &request) {
        // The PTE is gone but not flushed: the batch takes the debt, so
        // that the caller's flush still covers it.
        batch.record_pending(arch, mm, pages, old, (&targets, step), aged());
        Err((true, e))
    } else {
        Ok(Cleared::default())
    }
}

/// Removes every mapping of `frame` found through `rmap` (Linux's
/// `try_to_unmap`), in walk order:
///
/// - a mapping flagged [`MappingFlags::LOCKED`] stops the walk with
///   [`SwapResult::Mlock`], unless [`TtuFlags::IGNORE_MLOCK`];
/// - with [`TtuFlags::MUNLOCK`] nothing is unmapped: the result is `Mlock`
///   if a locked mapping exists, [`SwapResult::Again`] otherwise;
/// - a mapping whose accessed bit is set stops the walk with
///   [`SwapResult::Fail`] (the bit is cleared, so a later try may succeed),
///   unless [`TtuFlags::IGNORE_ACCESS`];
/// - otherwise the PTE is atomically exchanged for an empty entry (a
///   migration entry with [`TtuFlags::MIGRATION`], a hwpoison entry for a
///   poisoned frame unless [`TtuFlags::IGNORE_HWPOISON`]); a dirty bit moves
///   to the frame ([`Rmap::set_dirty`]); the TLB flush is deferred into
///   `batch` when [`TlbFlushUnmapBatch::should_defer`] allows, done at once
///   otherwise.
///
/// When the walk went through, the result is `Success` if no present PTE
/// maps the frame any more and `Again` if one does; each becomes its
/// `*Cached` form when a deferred PTE was writable or dirty.
///
/// Why "again, cached" becomes "success, cached": while walking, each
/// mapping removed with a deferred writable flush answers `AgainCached`,
/// which means "carry on walking, and remember that a writable TLB entry
/// may be cached". Once the walk ends with no mapping left, the frame *is*
/// unmapped, which is what `Success` tells the caller; but the remembered
/// TLB entries still exist. Answering plain `Success` would invite the
/// caller to write or free the frame while a CPU can still write to it, so
/// the result keeps the warning: `SuccessCached`, unmapped but not yet safe
/// until the batch is flushed.
///
/// Whatever the result (`Success` included, and `Again`, `Fail`, `Mlock`
/// or an error after the walk removed some mappings), every PTE this call
/// cleared is either flushed or recorded in `batch`; the caller flushes the
/// batch before freeing, reusing or writing out the frame. Plain `Success`
/// under [`TtuFlags::BATCH_FLUSH`] only says that no *writable* entry
/// survives: read-only or clean entries may still be cached until the
/// flush, and freeing the frame before it leaks its contents (rule 2).
/// All of this is about the mappings *this* call removed: one an earlier
/// call removed into another batch still owes that batch's flush. The
/// caller must hold the frame alone (as Linux's page lock and LRU
/// isolation make it), and flush every batch that may owe the frame a
/// flush before writing or freeing it.
///
/// The low-level form: nothing stops the caller from freeing the frame
/// before the flush. [`UnmapBatch`](crate::UnmapBatch) is the form that
/// makes that mistake a compile error.
///
/// Errors, before any entry changed (every mapping is checked before the
/// first is touched): [`Error::Unaligned`], [`Error::NonCanonical`],
/// [`Error::KernelHalf`] (a user space's mapping in the upper half, which
/// every space shares) or [`Error::AsidOutOfRange`] for a mapping the rmap
/// reported,
/// [`Error::GlobalUserEntry`] for a user mapping whose entry is global (no
/// flush of its space would remove it), [`Error::NonGlobalKernelEntry`]
/// for a kernel mapping whose entry is not global where the kernel's
/// flushes rely on it,
/// [`Error::RootMismatch`] for a mapping's table whose root is not its
/// state's (its flushes would go to other CPUs),
/// [`Error::OtherMachine`] for a batch or a space of another machine,
/// [`Error::CpuNotOnline`] and [`Error::UntrackedRoot`] when a flush would
/// miss the calling CPU (it is not online, or loaded a mapping's address
/// space without [`switch_mm`](crate::switch_mm)), the error of
/// [`Arch::current_cpu`] when it cannot tell the CPU. During the walk:
/// [`Error::ShootdownReentered`] from an immediate flush, or from the
/// flush a mapping's space still owes for a change whose shootdown failed
/// (a [`change_protection`](crate::change_protection) that returned its
/// error: it is paid before that mapping is cleared, since a CPU may hold
/// an entry that allows more than the PTE says), or a check failing on a
/// mapping that appeared meanwhile; the walk stops there, and what it
/// cleared is in `batch`.
pub fn try_to_unmap<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    frame: Frame,
    flags: TtuFlags,
    batch: &mut TlbFlushUnmapBatch,
) -> Result<SwapResult, Error> {
    unmap_frame(arch, rmap, frame, flags, batch).result
}

/// What [`unmap_frame`] did: the result [`try_to_unmap`] reports, and
/// whether any mapping it removed left its flush owed by the batch (the
/// typed layer then keeps the frame until that flush, whatever the
/// result).
pub(crate) struct UnmapReport {
    pub(crate) result: Result<SwapResult, Error>,
    pub(crate) owed: bool,
}

pub(crate) fn unmap_frame<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    frame: Frame,
    flags: TtuFlags,
    batch: &mut TlbFlushUnmapBatch,
) -> UnmapReport {
    let fail = |e| UnmapReport {
        result: Err(e),
        owed: false,
    };
    let poisoned = rmap.is_hwpoisoned(frame) && !flags.contains(TtuFlags::IGNORE_HWPOISON);
    // A huge entry has no migration or hwpoison form: it is unmapped whole
    // or not at all.
    let huge = if poisoned || flags.contains(TtuFlags::MIGRATION) {
        Huge::Refused
    } else {
        Huge::WholeOnly
    };
    if let Err(e) = batch
        .check_machine(arch)
        .and_then(|()| check_mappings(arch, rmap, frame, huge))
    {
        return fail(e);
    }
    let mut verdict = None;
    let mut owed = false;
    let mut cached = false;
    let walked = walk_mapped(arch, rmap, frame, |m| {
        if m.flags.contains(MappingFlags::LOCKED) && !flags.contains(TtuFlags::IGNORE_MLOCK) {
            verdict = Some(SwapResult::Mlock);
            return Ok(ControlFlow::Break(()));
        }
        if flags.contains(TtuFlags::MUNLOCK) {
            return Ok(ControlFlow::Continue(()));
        }
        if !flags.contains(TtuFlags::IGNORE_ACCESS) && clear_young(arch, m.space, m.va, batch)? {
            verdict = Some(SwapResult::Fail);
            return Ok(ControlFlow::Break(()));
        }
        // After an error the result is the error: only the debt matters.
        let cleared = unmap_one(arch, rmap, m, frame, flags, poisoned, batch).map_err(|(debt, e)| {
            owed |= debt;
            e
        })?;
        owed |= cleared.owed;
        cached |= cleared.writable;
        Ok(ControlFlow::Continue(()))
    });
    if verdict == Some(SwapResult::Fail) {
        // A young mapping's accessed bit was cleared.
        note_aged(arch, rmap, frame, true);
    }
    let result = walked.map(|()| match verdict {
        Some(v) => v,
        None if flags.contains(TtuFlags::MUNLOCK) => SwapResult::Again,
        None => match (rmap.mapcount(frame) == 0, cached) {
            (true, false) => SwapResult::Success,
            (true, true) => SwapResult::SuccessCached,
            (false, false) => SwapResult::Again,
            (false, true) => SwapResult::AgainCached,
        },
    });
    UnmapReport { result, owed }
}
