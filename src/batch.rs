//! [`TlbFlushUnmapBatch`]: deferred TLB flushes for pages unmapped during
//! reclaim or migration, sent as one shootdown per flush point.

use crate::arch::Arch;
use crate::cpuset::CpuSet;
use crate::mm::MmTlbState;
use crate::pte::{check_aligned, Pte};
use crate::request::{FlushRequest, FlushScope};
use crate::rmap::TtuFlags;
use crate::shootdown::{shootdown, ShootdownReport};
use crate::stats::Counter;
use crate::Error;

/// Pending TLB flushes of pages whose PTEs were cleared but not yet flushed
/// (Linux's `struct tlbflush_unmap_batch`).
///
/// It accumulates the union of the CPUs to interrupt and up to
/// [`Arch::FULL_FLUSH_CEILING`] pages; past that it degrades to one full
/// flush of the address spaces involved per target, so its size is fixed
/// however many pages it covers. It also remembers whether any deferred PTE
/// was writable or dirty: such a page must not go to I/O before
/// [`flush_dirty`](Self::flush_dirty), because another CPU could still be
/// writing to it.
///
/// The pages it covers must not be freed, reused or written out until
/// [`flush`](Self::flush) returned `Ok` (contract rules 1 and 2). A batch
/// dropped while not empty has lost nothing in the page tables, but its
/// frames are still cached: drop it only after flushing.
#[must_use = "a batch holds deferred TLB flushes: flush it before freeing or writing out the unmapped frames"]
#[derive(Clone, Debug, Default)]
pub struct TlbFlushUnmapBatch {
    targets: CpuSet,
    request: FlushRequest,
    writable: bool,
}

impl TlbFlushUnmapBatch {
    /// An empty batch.
    pub const fn new() -> Self {
        TlbFlushUnmapBatch {
            targets: CpuSet::new(),
            request: FlushRequest::new(),
            writable: false,
        }
    }

    /// Whether the flush of a page of `mm` may be deferred: only when the
    /// caller asked for it ([`TtuFlags::BATCH_FLUSH`]), only when the
    /// hardware re-walks the page table on a write through a clean entry
    /// ([`Arch::CLEAN_WRITE_REWALK`]), and only when a CPU other than the
    /// current one may hold entries of `mm` (a local flush is cheap; a
    /// remote one is what batching saves).
    pub fn should_defer<A: Arch>(arch: &A, mm: &MmTlbState, flags: TtuFlags) -> bool {
        flags.contains(TtuFlags::BATCH_FLUSH) && A::CLEAN_WRITE_REWALK && mm.cached_elsewhere(arch)
    }

    /// Records that the PTE for `va` in `mm` was cleared and its flush is
    /// deferred to this batch; `old` is the value the atomic clear returned.
    /// Marks `mm` as having a batched flush pending (see
    /// [`flush_tlb_batched_pending`](crate::flush_tlb_batched_pending)).
    ///
    /// Call it after the PTE is cleared and only when
    /// [`should_defer`](Self::should_defer) allowed it. Errors:
    /// [`Error::Unaligned`] (the batch is unchanged).
    pub fn add_pending<A: Arch>(
        &mut self,
        arch: &A,
        mm: &MmTlbState,
        va: u64,
        old: Pte,
    ) -> Result<(), Error> {
        check_aligned(va)?;
        self.request.add_page(mm.asid(), va, A::FULL_FLUSH_CEILING)?;
        self.targets = self.targets.union(&mm.flush_targets(arch));
        self.writable |= old.is_writable() || old.is_dirty();
        mm.note_batched_pending();
        arch.shootdown_state().count(Counter::PagesDeferred, 1);
        Ok(())
    }

    /// Records the flush owed after clearing the accessed bit of `va` in
    /// `mm` on hardware that needs one ([`Arch::ACCESSED_CLEAR_NEEDS_FLUSH`]).
    /// The PTE still maps its frame, so this neither marks the batch
    /// writable nor marks `mm` as having a batched unmap pending. Errors:
    /// [`Error::Unaligned`].
    pub fn add_accessed_clear<A: Arch>(&mut self, arch: &A, mm: &MmTlbState, va: u64) -> Result<(), Error> {
        self.request.add_page(mm.asid(), va, A::FULL_FLUSH_CEILING)?;
        self.targets = self.targets.union(&mm.flush_targets(arch));
        Ok(())
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.request.is_empty()
    }

    /// Whether a deferred PTE was writable or dirty, so that
    /// [`flush_dirty`](Self::flush_dirty) would flush.
    pub fn has_writable(&self) -> bool {
        self.writable
    }

    /// The CPUs the next flush will reach.
    pub fn targets(&self) -> CpuSet {
        self.targets
    }

    /// Pages deferred since the last flush.
    pub fn pending_pages(&self) -> usize {
        self.request.pages()
    }

    /// Whether the batch has passed the ceiling and will flush whole address
    /// spaces rather than single pages.
    pub fn is_full_flush(&self) -> bool {
        !matches!(self.request.scope(), FlushScope::Ranges(_)) && !self.is_empty()
    }

    /// Flushes everything pending: one shootdown, at most one IPI per
    /// target CPU, nothing at all when the batch is empty. After `Ok` the
    /// deferred frames may be freed, reused or written out and the batch is
    /// empty; after `Err` the batch is unchanged and still owes its flush.
    pub fn flush<A: Arch>(&mut self, arch: &A) -> Result<ShootdownReport, Error> {
        if self.is_empty() {
            return Ok(ShootdownReport::default());
        }
        let report = shootdown(arch, &self.targets, &self.request)?;
        arch.shootdown_state().count(Counter::BatchesFlushed, 1);
        *self = TlbFlushUnmapBatch::new();
        Ok(report)
    }

    /// Flushes only if a deferred PTE was writable or dirty (the flush that
    /// must precede writing any deferred page out to disk); a clean-only
    /// batch stays pending. Returns the report when it flushed.
    pub fn flush_dirty<A: Arch>(&mut self, arch: &A) -> Result<Option<ShootdownReport>, Error> {
        if self.writable {
            self.flush(arch).map(Some)
        } else {
            Ok(None)
        }
    }
}
