//! Range teardown (Linux's `mmu_gather`): clear a range's PTEs, flush once,
//! then free the data frames and the emptied page-table frames, each in one
//! batched call per batch (seed 004).

use crate::arch::Arch;
use crate::batch::machine_id;
use crate::mm::MmTlbState;
use crate::pte::{Frame, PAGE_SIZE};
use crate::range::PageRange;
use crate::request::FlushRequest;
use crate::rmap::PageTable;
use crate::shootdown::{ipi_sync, shootdown};
use crate::unmap::{FreeFrames, OwnedFrame};
use crate::validate::{check_asid, check_space_range, check_table_bounds};
use crate::verify::{check_table_root, space_caller};
use crate::walk::{check_huge_whole, check_range_not_global, walk_range};
use crate::Error;

mod entry;
mod hold;
mod summary;
mod tables;

#[cfg(all(test, loom))]
pub(crate) use hold::Holder;
pub(crate) use hold::{flush_sparing_lazy, LazyWait};
pub use hold::{HoldTables, HoldingBacking, TableHold, TABLE_HOLD_GROUPS};
pub use summary::TeardownSummary;
pub use tables::{DetachedTable, TableBounds, TableTeardown};

/// Frames per batch when a gather's batches are sized like Linux's: the
/// pointers that fit in one page beside a small header.
pub const PAGE_BATCH: usize = PAGE_SIZE as usize / 8 - 2;

/// What the kernel supplies to [`MmuGather::unmap_range`].
pub trait TeardownBacking: FreeFrames {
    /// Marks a data frame's page dirty (its PTE was dirty).
    fn set_dirty(&mut self, frame: Frame);

    /// Frees the page-table frames it accepts in ONE batched call, removing
    /// them from `tables`; what it leaves there was refused.
    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>);

    /// Where the teardown may hold the page-table frames that CPUs lazy on
    /// the address space could still walk, instead of interrupting those
    /// CPUs: a [`TableHold`] (see there). `None`, the default, keeps
    /// Linux's rule: a flush that frees tables reaches lazy CPUs too.
    /// [`TableHold::around`] wraps a backing to give one.
    fn table_hold(&mut self) -> Option<&mut dyn HoldTables> {
        None
    }
}

/// Which page-table frames a teardown detaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FreeTables {
    /// None.
    No,
    /// Those wholly inside the range ([`TableTeardown::detach_table`]).
    InRange,
    /// Those the range touches that lie within the bounds
    /// ([`TableTeardown::detach_table_bounded`]).
    Within(TableBounds),
}

/// When page-table frames may be freed after the flush (rule 6).
pub enum TableFreePolicy<'a> {
    /// At once: no CPU walks page tables without the kernel's locks.
    AfterFlush,
    /// After an IPI to every other CPU was taken ([`ipi_sync`]): lockless
    /// walkers run with interrupts off, so none that started before the
    /// sync is still walking. A CPU also acknowledges the sync from the
    /// wait loop of a shootdown it started itself, with interrupts off: a
    /// lockless walk must therefore not start or wait for a shootdown
    /// before it is over (a fast-GUP walk never does).
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

/// A range teardown's pending work: the pages to flush, and up to `N` data
/// frames and `N` page-table frames waiting for that flush. Fixed storage,
/// no allocation; [`PageGather`] sizes it like Linux.
///
/// While it holds pending work, the gather belongs to the address space
/// and the machine that work came from: using it for another address space
/// ([`Error::OtherAddressSpace`]) or with another machine's `Arch`
/// ([`Error::OtherMachine`]) is refused until [`finish`](Self::finish)
/// completed it, since its flush must reach the CPUs that cached the first
/// address space.
#[must_use = "a gather may hold frames and owe a flush: finish it"]
pub struct MmuGather<const N: usize> {
    request: FlushRequest,
    pages: heapless::Vec<OwnedFrame, N>,
    tables: heapless::Vec<OwnedFrame, N>,
    summary: TeardownSummary,
    /// (address-space identity, machine identity) of the pending work;
    /// only compared, never dereferenced.
    owner: Option<(usize, usize)>,
    /// The same identities for the counts in `summary` not yet reported.
    counts_of: Option<(usize, usize)>,
    /// What the tables wait for when the flush that covered them left lazy
    /// CPUs out (the teardown's backing had a hold): until they are held,
    /// or those CPUs are interrupted after all.
    lazy_wait: Option<LazyWait>,
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
    ///
    /// A capacity of 0 does not compile (`MmuGather::<0>::new()` fails
    /// when it is instantiated, `cargo build` rather than `cargo check`):
    /// such a gather could never take the first page, and a teardown would
    /// make no progress.
    ///
    /// ```compile_fail,E0080
    /// let gather = tlb_batch::MmuGather::<0>::new();
    /// # let _ = gather;
    /// ```
    pub const fn new() -> Self {
        const { assert!(N > 0, "MmuGather needs room for at least one page: N > 0") };
        MmuGather {
            request: FlushRequest::new(),
            pages: heapless::Vec::new(),
            tables: heapless::Vec::new(),
            summary: TeardownSummary {
                pages_unmapped: 0,
                data_freed: 0,
                tables_freed: 0,
                tables_held: 0,
                flushes: 0,
                flushes_reaching_no_cpu: 0,
                data_free_calls: 0,
                table_free_calls: 0,
                syncs: 0,
                ipis_sent: 0,
            },
            owner: None,
            counts_of: None,
            lazy_wait: None,
        }
    }

    /// Claims the gather for `mm` on `arch`'s machine: refused while it
    /// holds another one's pending work.
    fn claim<A: Arch>(&mut self, arch: &A, mm: &MmTlbState) -> Result<(), Error> {
        let me = (mm.id(), machine_id(arch));
        match self.owner {
            Some(owner) if !self.is_empty() && owner != me => Err(if owner.1 != me.1 {
                Error::OtherMachine
            } else {
                Error::OtherAddressSpace
            }),
            _ => {
                self.owner = Some(me);
                if self.counts_of != Some(me) {
                    // Counts a failed teardown of another address space
                    // left behind, with its work completed and never
                    // collected: they are not this one's to report.
                    self.summary = TeardownSummary::default();
                    self.counts_of = Some(me);
                }
                Ok(())
            }
        }
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.request.is_empty() && self.pages.is_empty() && self.tables.is_empty()
    }

    /// Tears down `range` of `space` (munmap, exit):
    ///
    /// 1. the range is walked table by table, each under its lock
    ///    ([`PageTable::with_table_locked`]), stepping over what is not
    ///    mapped ([`PageTable::next_populated`]); inside each table's lock a
    ///    batched flush still pending for the address space is done first
    ///    (contract rule 5);
    /// 2. each present PTE is cleared atomically, its dirty bit moved to the
    ///    frame ([`TeardownBacking::set_dirty`]), its page added to the flush
    ///    and its frame to the data batch; migration and hwpoison entries
    ///    are cleared too. A 2 MiB or 1 GiB entry
    ///    ([`PageTable::entry_size`]) that the range covers wholly is one
    ///    entry: cleared once at its first address, its dirty bit moved to
    ///    the huge frame's first 4 KiB frame, flushed with one invalidation
    ///    at its stride (counted once against the full-flush ceiling), and
    ///    that first frame handed to [`FreeFrames::free_batch`] once, after
    ///    the flush, for the kernel to free the whole huge frame (as Linux
    ///    frees a folio); the summary counts it as one page unmapped and
    ///    one data frame freed;
    /// 3. with `free_tables`, every page-table frame that translated only
    ///    this range is detached into the table batch (to free also the
    ///    tables the range shares with unmapped space around it, see
    ///    [`unmap_range_bounded`](Self::unmap_range_bounded));
    /// 4. one flush of the range (page by page up to the ceiling, the
    ///    whole address space above it), then the data frames in ONE
    ///    [`FreeFrames::free_batch`] call, then, after `policy` allows, the
    ///    page-table frames in ONE [`TeardownBacking::free_tables`] call.
    ///
    /// When a batch fills up, step 4 runs mid-way (outside the table lock)
    /// and the teardown goes on. Frames the kernel refuses go to
    /// `handback`; none is dropped.
    ///
    /// Returns the counts of what this call did.
    ///
    /// Errors, with nothing changed: [`Error::NonCanonical`], an address
    /// of a user space in the kernel's half ([`Error::KernelHalf`]),
    /// [`Error::AsidOutOfRange`], what [`PageTable::check_range`](crate::PageTable::check_range)
    /// refuses, a huge page the range covers part of ([`Error::HugePage`]:
    /// split it first, or widen the range), a global entry in a user space
    /// ([`Error::GlobalUserEntry`]) or a non-global one in the kernel's where
    /// its flushes rely on global kernel mappings
    /// ([`Error::NonGlobalKernelEntry`]), a table whose root is not its state's
    /// ([`Error::RootMismatch`]), [`Error::OtherAddressSpace`],
    /// [`Error::OtherMachine`]; [`Error::CpuNotOnline`] and
    /// [`Error::UntrackedRoot`] when the flush would miss the calling CPU
    /// (it is not online, or loaded the space's root without
    /// [`switch_mm`](crate::switch_mm)). [`Error::ShootdownReentered`] from a flush
    /// stops the teardown: the gather keeps its pending frames and flush
    /// (and the address space records that a flush is owed), so
    /// [`finish`](Self::finish) completes them and reports the counts of
    /// everything the failed call did; then call `unmap_range` again for
    /// the rest of the range (what was torn down is empty and costs
    /// nothing), whose summary counts only what that call did. No count is
    /// reported twice or for another address space: counts of a failed call
    /// that no `finish` collected go to the next call for the same address
    /// space, and are dropped when the gather turns to another one.
    #[allow(clippy::too_many_arguments)]
    pub fn unmap_range<A, S, B>(
        &mut self,
        arch: &A,
        space: &S,
        backing: &mut B,
        range: PageRange,
        free_tables: bool,
        policy: &mut TableFreePolicy<'_>,
        handback: &mut dyn FnMut(OwnedFrame, FrameKind),
    ) -> Result<TeardownSummary, Error>
    where
        A: Arch,
        S: TableTeardown + ?Sized,
        B: TeardownBacking + ?Sized,
    {
        let tables = if free_tables {
            FreeTables::InRange
        } else {
            FreeTables::No
        };
        self.run(arch, space, backing, range, tables, policy, handback)
    }

    /// [`unmap_range`](Self::unmap_range) with page tables freed up to the
    /// bounds the kernel knows (Linux's `floor` and `ceiling`): the
    /// munmap of one mapping between two others, with `bounds` from the
    /// end of the mapping below it to the start of the one above.
    ///
    /// Step 3 then detaches, instead of the tables wholly inside `range`,
    /// every empty page-table frame that translates some of `range` and
    /// whose whole span lies within `bounds`
    /// ([`TableTeardown::detach_table_bounded`]), leaf tables first, then
    /// the upper-level tables that emptied with them. So two teardowns that
    /// each cover half of a leaf table free it at the second one, as a
    /// teardown of the whole table would; without bounds it stays linked,
    /// empty, until the space goes.
    ///
    /// The caller guarantees that no mapping of `space` lies within
    /// `bounds` outside `range`, and that none is made there until the call
    /// returns (it holds, over the bounds, the lock that keeps the range
    /// from being mapped again). Bounds that wrongly take in a mapped page
    /// cost nothing: a table that still holds an entry stays linked (the
    /// [`TableTeardown`] contract). A mapping made within the bounds during
    /// the call breaks the guarantee as one made in `range` would: it may
    /// land in a table that is being unlinked.
    ///
    /// A freed table's whole span is flushed (the flush that covers the
    /// range's pages grows to it, often to the whole address space), which
    /// drops the pointers to it that CPUs' paging-structure caches hold.
    ///
    /// Errors, with nothing changed: those of `unmap_range`;
    /// [`Error::NonCanonical`] for bounds that are not canonical or cross
    /// the hole between the two halves, [`Error::KernelHalf`] for bounds of
    /// a user space that reach the kernel's half (the kernel's tables are
    /// shared: give a user space's bounds a ceiling at the end of its
    /// half), and [`Error::OutsideTableBounds`] for bounds that do not
    /// enclose `range` (a floor above its start, a ceiling below its end),
    /// naming its first page outside them. Unaligned bounds cannot be
    /// built ([`TableBounds::new`]).
    #[allow(clippy::too_many_arguments)]
    pub fn unmap_range_bounded<A, S, B>(
        &mut self,
        arch: &A,
        space: &S,
        backing: &mut B,
        range: PageRange,
        bounds: TableBounds,
        policy: &mut TableFreePolicy<'_>,
        handback: &mut dyn FnMut(OwnedFrame, FrameKind),
    ) -> Result<TeardownSummary, Error>
    where
        A: Arch,
        S: TableTeardown + ?Sized,
        B: TeardownBacking + ?Sized,
    {
        let tables = FreeTables::Within(bounds);
        self.run(arch, space, backing, range, tables, policy, handback)
    }

    /// The checks, then the teardown, of both entry points.
    #[allow(clippy::too_many_arguments)]
    fn run<A, S, B>(
        &mut self,
        arch: &A,
        space: &S,
        backing: &mut B,
        range: PageRange,
        tables: FreeTables,
        policy: &mut TableFreePolicy<'_>,
        handback: &mut dyn FnMut(OwnedFrame, FrameKind),
    ) -> Result<TeardownSummary, Error>
    where
        A: Arch,
        S: TableTeardown + ?Sized,
        B: TeardownBacking + ?Sized,
    {
        let mm = space.tlb_state();
        check_space_range(arch, mm, range)?;
        if let FreeTables::Within(bounds) = tables {
            check_table_bounds(arch, mm, range, bounds)?;
        }
        check_asid(arch, mm.asid())?;
        space_caller(arch, mm)?;
        check_table_root(space)?;
        space.check_range(range)?;
        check_huge_whole(space, range, arch.base_page())?;
        check_range_not_global(arch, space, range)?;
        self.claim(arch, mm)?;
        let result = self.tear_down(arch, space, backing, range, tables, policy, handback);
        if result.is_err() && !self.request.is_empty() {
            // Cleared but not flushed: whoever changes this address space
            // next flushes it first, even if the gather is never finished.
            mm.note_flush_owed(arch.shootdown_state());
        }
        result?;
        Ok(core::mem::take(&mut self.summary))
    }

    #[allow(clippy::too_many_arguments)]
    fn tear_down<A, S, B>(
        &mut self,
        arch: &A,
        space: &S,
        backing: &mut B,
        range: PageRange,
        tables: FreeTables,
        policy: &mut TableFreePolicy<'_>,
        handback: &mut dyn FnMut(OwnedFrame, FrameKind),
    ) -> Result<(), Error>
    where
        A: Arch,
        S: TableTeardown + ?Sized,
        B: TeardownBacking + ?Sized,
    {
        let mm = space.tlb_state();
        let mut rest = range;
        loop {
            let paused = walk_range(arch, space, rest, &mut |va, pte, size| {
                self.take_entry::<A, _, _>(space, backing, (va, pte, size), handback)
            })?;
            match paused {
                Some(va) => {
                    self.complete(arch, space, backing, policy, handback)?;
                    rest = rest.from_page(va);
                }
                None => break,
            }
        }
        if tables != FreeTables::No {
            // Where the next search starts: past the table detached last,
            // so that a teardown of T tables costs what it frees, not T
            // searches from the range's start (a search that finds tables
            // in address order has nothing left before that table but
            // tables that are not empty). When that narrower search finds
            // nothing, one more goes over the whole range (tables of a
            // level whose span starts before it), and the teardown ends
            // only when a whole-range search finds none: whatever order a
            // `TableTeardown` finds tables in, none is left.
            let mut from = range;
            loop {
                // Room first, then the detach: a mid-way completion that
                // fails (its flush or its sync) returns with the next table
                // still linked, where a retry finds it, never unlinked and
                // held by nothing.
                if self.tables.is_full() {
                    self.complete(arch, space, backing, policy, handback)?;
                }
                let detached = match tables {
                    FreeTables::Within(bounds) => space.detach_table_bounded(from, bounds),
                    _ => space.detach_table(from),
                };
                let table = match detached {
                    Some(table) => table,
                    None if from != range => {
                        from = range;
                        continue;
                    }
                    None => break,
                };
                from = match table.range.last() {
                    Some(last) if !range.after(last).is_empty() => range.after(last),
                    _ => range,
                };
                // Paging-structure caches may hold the table: its whole
                // span is flushed before it is freed, not only the range's
                // pages in it. With bounds the span reaches past the range.
                // A page of the range inside the span would do on every
                // model the crate knows (INVLPG drops all of its PCID's
                // paging-structure entries; arm64's non-last-level TLBI
                // VAE1IS and the mock's page flush drop the walk entries on
                // that page's path, which runs through this table), but
                // the span is right whatever the table reports about the
                // range. 512 pages lie above any usual full-flush ceiling:
                // the flush becomes one of the whole address space.
                // At the base page's stride (the ceiling counts base
                // pages), and with no level hint for anything the request
                // holds: a hint names a leaf entry's level, and the freed
                // table's walk-cache entries must go whatever it says.
                self.request.add_base_range_step(
                    mm.asid(),
                    table.range,
                    arch.base_page(),
                    A::FULL_FLUSH_CEILING,
                    None,
                );
                self.request.forbid_leaf_hints();
                // SAFETY: `detach_table` hands over the table frame itself
                // (the `TableTeardown` contract): nothing else frees it.
                let frame = unsafe { OwnedFrame::new(table.frame) };
                if let Err(frame) = self.tables.push(frame) {
                    handback(frame, FrameKind::Table);
                }
            }
        }
        self.complete(arch, space, backing, policy, handback)
    }

    /// Flushes what is pending for `space`, then frees the data batch and,
    /// once `policy` allows, the table batch (one call each). Call it to
    /// complete a teardown that returned an error
    /// ([`unmap_range`](Self::unmap_range) calls the same steps itself).
    ///
    /// Returns the counts of what the failed calls before it did and what
    /// it did itself, none of which `unmap_range` reported (all zero when
    /// nothing was pending). Errors: [`Error::OtherAddressSpace`] or
    /// [`Error::OtherMachine`] when `space` or `arch` is not the one the
    /// pending work came from (nothing changes); errors of the flush or the
    /// IPI sync (the work stays pending, its counts kept; call again).
    pub fn finish<A, S, B>(
        &mut self,
        arch: &A,
        space: &S,
        backing: &mut B,
        policy: &mut TableFreePolicy<'_>,
        handback: &mut dyn FnMut(OwnedFrame, FrameKind),
    ) -> Result<TeardownSummary, Error>
    where
        A: Arch,
        S: PageTable + ?Sized,
        B: TeardownBacking + ?Sized,
    {
        self.complete(arch, space, backing, policy, handback)?;
        Ok(core::mem::take(&mut self.summary))
    }

    /// [`finish`](Self::finish)'s steps, the counts kept in the gather for
    /// whoever reports them.
    fn complete<A, S, B>(
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
        let mm = space.tlb_state();
        self.claim(arch, mm)?;
        if !self.request.is_empty() {
            // Lazy CPUs too when page tables go (their MMUs may walk them),
            // unless the backing's hold can keep the tables until they
            // have passed (`gather/hold.rs`).
            let hold = !self.tables.is_empty()
                && !mm.is_kernel()
                && backing
                    .table_hold()
                    .is_some_and(|h| h.room_for(machine_id(arch), mm.asid()) >= self.tables.len());
            let (report, wait) = if hold {
                flush_sparing_lazy(arch, mm, &mut self.request)?
            } else {
                let (targets, step) = if self.tables.is_empty() {
                    mm.flush_targets_step(arch)
                } else {
                    mm.table_flush_targets_step(arch)
                };
                // Every page of the request was cleared, and every table
                // of it unlinked, before this advance.
                if let Some(step) = step {
                    self.request.set_step(mm.asid(), step);
                }
                (shootdown(arch, &targets, &self.request)?, None)
            };
            self.request.clear();
            self.summary.flushes += 1;
            self.summary.flushes_reaching_no_cpu += usize::from(report.reached_no_cpu());
            self.summary.ipis_sent += report.ipis_sent;
            if let Some(wait) = wait {
                // Tables an earlier flush left waiting (its completion
                // failed after it) wait for both sets.
                self.lazy_wait = Some(self.lazy_wait.map_or(wait, |w| w.merge(wait)));
            }
        }
        if !self.pages.is_empty() {
            let offered = self.pages.len();
            backing.free_batch(&mut self.pages);
            self.summary.data_free_calls += 1;
            // An implementation may hand back more than it was given.
            self.summary.data_freed += offered.saturating_sub(self.pages.len());
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
            if self.settle_lazy(arch, backing)? {
                self.owner = None;
                return Ok(());
            }
            let offered = self.tables.len();
            backing.free_tables(&mut self.tables);
            self.summary.table_free_calls += 1;
            self.summary.tables_freed += offered.saturating_sub(self.tables.len());
            while let Some(frame) = self.tables.pop() {
                handback(frame, FrameKind::Table);
            }
        }
        self.owner = None;
        Ok(())
    }
}
