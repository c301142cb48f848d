//! Range teardown (Linux's `mmu_gather`): clear a range's PTEs, flush once,
//! then free the data frames and the emptied page-table frames, each in one
//! batched call per batch (seed 004).

use crate::arch::Arch;
use crate::mm::flush_tlb_batched_pending;
use crate::pte::{check_range, Frame, Pte, PAGE_SIZE};
use crate::request::FlushRequest;
use crate::rmap::PageTable;
use crate::shootdown::{ipi_sync, shootdown};
use crate::unmap::{FreeFrames, OwnedFrame};
use crate::Error;

/// Frames per batch when a gather's batches are sized like Linux's: the
/// pointers that fit in one page beside a small header.
pub const PAGE_BATCH: usize = PAGE_SIZE as usize / 8 - 2;

/// A page-table frame taken out of a page table, and the addresses it used
/// to translate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DetachedTable {
    /// The page-table frame.
    pub frame: Frame,
    /// First address it translated.
    pub start: u64,
    /// One past the last address it translated.
    pub end: u64,
}

/// A page table that can give up the tables of a torn-down range.
///
/// # Safety
///
/// [`detach_table`](TableTeardown::detach_table) returns only a table that
/// translates nothing outside `start..end`, after unlinking it so that no
/// new walk can reach it; walks already under way may still be reading it,
/// which is what [`TableFreePolicy`] is for.
pub unsafe trait TableTeardown: PageTable {
    /// Unlinks one page-table frame whose addresses all lie in
    /// `start..end`, or returns `None` when none is left.
    fn detach_table(&self, start: u64, end: u64) -> Option<DetachedTable>;
}

/// What the kernel supplies to [`MmuGather::unmap_range`].
pub trait TeardownBacking: FreeFrames {
    /// Marks a data frame's page dirty (its PTE was dirty).
    fn set_dirty(&mut self, frame: Frame);

    /// Frees the page-table frames it accepts in ONE batched call, removing
    /// them from `tables`; what it leaves there was refused.
    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>);
}

/// When page-table frames may be freed after the flush (rule 6).
pub enum TableFreePolicy<'a> {
    /// At once: no CPU walks page tables without the kernel's locks.
    AfterFlush,
    /// After an IPI to every other CPU was taken ([`ipi_sync`]): lockless
    /// walkers run with interrupts off, so none that started before the
    /// sync is still walking.
    IpiSync,
    /// After the kernel's grace period (RCU-style), run by this callback.
    GracePeriod(&'a mut dyn FnMut()),
}

/// Which kind of frame a teardown hands back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FrameKind {
    /// A frame that held data.
    Data,
    /// A page-table frame.
    Table,
}

/// Counts of what a teardown did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TeardownSummary {
    /// Present PTEs cleared.
    pub pages_unmapped: usize,
    /// Data frames freed.
    pub data_freed: usize,
    /// Page-table frames freed.
    pub tables_freed: usize,
    /// Flushes (shootdowns) done: one per batch, one in all for a range
    /// that fits.
    pub flushes: usize,
    /// Batched data-frame free calls.
    pub data_free_calls: usize,
    /// Batched page-table free calls.
    pub table_free_calls: usize,
    /// IPI syncs done for lockless walkers.
    pub syncs: usize,
    /// IPIs sent by flushes and syncs.
    pub ipis_sent: usize,
}

/// A range teardown's pending work: the pages to flush, and up to `N` data
/// frames and `N` page-table frames waiting for that flush. Fixed storage,
/// no allocation; [`PageGather`] sizes it like Linux.
#[must_use = "a gather may hold frames and owe a flush: finish it"]
pub struct MmuGather<const N: usize> {
    request: FlushRequest,
    pages: heapless::Vec<OwnedFrame, N>,
    tables: heapless::Vec<OwnedFrame, N>,
    summary: TeardownSummary,
}

/// A gather with page-sized batches.
pub type PageGather = MmuGather<PAGE_BATCH>;

impl<const N: usize> Default for MmuGather<N> {
    fn default() -> Self {
        MmuGather::new()
    }
}

impl<const N: usize> MmuGather<N> {
    /// An empty gather.
    pub const fn new() -> Self {
        MmuGather {
            request: FlushRequest::new(),
            pages: heapless::Vec::new(),
            tables: heapless::Vec::new(),
            summary: TeardownSummary {
                pages_unmapped: 0,
                data_freed: 0,
                tables_freed: 0,
                flushes: 0,
                data_free_calls: 0,
                table_free_calls: 0,
                syncs: 0,
                ipis_sent: 0,
            },
        }
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.request.is_empty() && self.pages.is_empty() && self.tables.is_empty()
    }

    /// Tears down `start..end` of `space` (munmap, exit):
    ///
    /// 1. a batched flush still pending for the address space is done first
    ///    (contract rule 5);
    /// 2. each present PTE is cleared atomically, its dirty bit moved to the
    ///    frame ([`TeardownBacking::set_dirty`]), its page added to the flush
    ///    and its frame to the data batch; migration and hwpoison entries
    ///    are cleared too;
    /// 3. with `free_tables`, every page-table frame that translated only
    ///    this range is detached into the table batch;
    /// 4. one flush of the range (page by page up to the ceiling, the
    ///    whole address space above it), then the data frames in ONE
    ///    [`FreeFrames::free_batch`] call, then, after `policy` allows, the
    ///    page-table frames in ONE [`TeardownBacking::free_tables`] call.
    ///
    /// When a batch fills up, step 4 runs mid-way and the teardown goes on.
    /// Frames the kernel refuses go to `handback`; none is dropped.
    ///
    /// Errors: [`Error::Unaligned`], [`Error::InvalidRange`] (nothing
    /// changed); [`Error::ShootdownReentered`] from a flush: the gather keeps
    /// its pending frames and flush, and [`finish`](Self::finish) completes
    /// them later.
    #[allow(clippy::too_many_arguments)]
    pub fn unmap_range<A, S, B>(
        &mut self,
        arch: &A,
        space: &S,
        backing: &mut B,
        start: u64,
        end: u64,
        free_tables: bool,
        policy: &mut TableFreePolicy<'_>,
        handback: &mut dyn FnMut(OwnedFrame, FrameKind),
    ) -> Result<TeardownSummary, Error>
    where
        A: Arch,
        S: TableTeardown + ?Sized,
        B: TeardownBacking + ?Sized,
    {
        check_range(start, end)?;
        let mm = space.tlb_state();
        flush_tlb_batched_pending(arch, mm)?;
        let mut va = start;
        while va < end {
            let pte = space.lookup(va);
            if pte.is_present() {
                if self.pages.is_full() {
                    self.finish(arch, space, backing, policy, handback)?;
                }
                let old = space.clear(va);
                if old.is_present() {
                    if old.is_dirty() {
                        backing.set_dirty(old.frame());
                    }
                    self.request.add_page(mm.asid(), va, A::FULL_FLUSH_CEILING)?;
                    // Not full: checked above.
                    if let Err(frame) = self.pages.push(OwnedFrame::new(old.frame())) {
                        handback(frame, FrameKind::Data);
                    }
                    self.summary.pages_unmapped += 1;
                }
            } else if pte != Pte::EMPTY {
                // A migration or hwpoison entry: nothing cached, nothing to
                // free, but the mapping goes.
                space.clear(va);
            }
            va += PAGE_SIZE;
        }
        if free_tables {
            while let Some(table) = space.detach_table(start, end) {
                if self.tables.is_full() {
                    self.finish(arch, space, backing, policy, handback)?;
                }
                // Paging-structure caches may hold the table: its whole
                // range is flushed before it is freed.
                self.request
                    .add_range(mm.asid(), table.start, table.end, A::FULL_FLUSH_CEILING)?;
                if let Err(frame) = self.tables.push(OwnedFrame::new(table.frame)) {
                    handback(frame, FrameKind::Table);
                }
            }
        }
        self.finish(arch, space, backing, policy, handback)?;
        Ok(core::mem::take(&mut self.summary))
    }

    /// Flushes what is pending for `space`, then frees the data batch and,
    /// once `policy` allows, the table batch (one call each). Called by
    /// [`unmap_range`](Self::unmap_range); call it yourself to complete a
    /// teardown that returned an error.
    pub fn finish<A, S, B>(
        &mut self,
        arch: &A,
        space: &S,
        backing: &mut B,
        policy: &mut TableFreePolicy<'_>,
        handback: &mut dyn FnMut(OwnedFrame, FrameKind),
    ) -> Result<(), Error>
    where
        A: Arch,
        S: PageTable + ?Sized,
        B: TeardownBacking + ?Sized,
    {
        if !self.request.is_empty() {
            let mm = space.tlb_state();
            let report = shootdown(arch, &mm.flush_targets(arch), &self.request)?;
            self.request.clear();
            self.summary.flushes += 1;
            self.summary.ipis_sent += report.ipis_sent;
        }
        if !self.pages.is_empty() {
            let offered = self.pages.len();
            backing.free_batch(&mut self.pages);
            self.summary.data_free_calls += 1;
            self.summary.data_freed += offered - self.pages.len();
            while let Some(frame) = self.pages.pop() {
                handback(frame, FrameKind::Data);
            }
        }
        if !self.tables.is_empty() {
            match policy {
                TableFreePolicy::AfterFlush => {}
                TableFreePolicy::IpiSync => {
                    let report = ipi_sync(arch)?;
                    self.summary.syncs += 1;
                    self.summary.ipis_sent += report.ipis_sent;
                }
                TableFreePolicy::GracePeriod(wait) => wait(),
            }
            let offered = self.tables.len();
            backing.free_tables(&mut self.tables);
            self.summary.table_free_calls += 1;
            self.summary.tables_freed += offered - self.tables.len();
            while let Some(frame) = self.tables.pop() {
                handback(frame, FrameKind::Table);
            }
        }
        Ok(())
    }
}
