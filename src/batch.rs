//! [`TlbFlushUnmapBatch`]: deferred TLB flushes for pages unmapped during
//! reclaim or migration, sent as one shootdown per flush point.

use crate::arch::Arch;
use crate::asid::Asid;
use crate::cpuset::{CpuId, CpuSet};
use crate::generation::{still_running, GenStep};
use crate::lifecycle::online_caller;
use crate::mm::MmTlbState;
use crate::page_size::PageSize;
use crate::pte::{Pte, PteFlags};
use crate::request::{FlushRequest, FlushScope, Pages};
use crate::shootdown::{complete_broadcast, issue_broadcast_page, shootdown, ShootdownReport};
use crate::stats::Counter;
use crate::ttu::TtuFlags;
use crate::validate::{check_asid, check_entry_size, check_space_va};
use crate::verify::space_caller;
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
///
/// A batch belongs to the machine whose [`Arch`] filled it (the one whose
/// [`Arch::shootdown_state`] it saw first): adding to it or flushing it
/// with another machine's `Arch` is refused with [`Error::OtherMachine`],
/// since that machine's CPUs are not the ones caching the pages.
#[must_use = "a batch holds deferred TLB flushes: flush it before freeing or writing out the unmapped frames"]
#[derive(Clone, Debug, Default)]
pub struct TlbFlushUnmapBatch {
    targets: CpuSet,
    request: FlushRequest,
    writable: bool,
    /// A flush epoch that every CPU holding an entry this batch owes a
    /// flush for has not yet flushed past: each deferred mapping was found
    /// with its accessed bit clear, on hardware whose fills set it, and its
    /// frame's aging epoch was known ([`Rmap::aged_epoch`](crate::Rmap::aged_epoch)).
    /// `u64::MAX` when that is not known of every entry (only an epoch
    /// opened after the clears will do); 0 while empty.
    aged: u64,
    /// The CPUs that issued broadcast invalidations for recorded pages as
    /// they were added ([`Arch::BATCH_BROADCAST_ON_ADD`]).
    issued_on: CpuSet,
    /// Whether some recorded page's invalidation was not issued on add (an
    /// `Arch` without `BATCH_BROADCAST_ON_ADD` recorded it).
    unissued: bool,
    /// The address of the filling machine's `TlbShootdown` (0: none yet).
    /// Only compared, never dereferenced.
    machine: usize,
}

/// The identity of `arch`'s machine: the address of its shootdown state,
/// which [`Arch`]'s contract makes the same on every CPU of one machine.
pub(crate) fn machine_id<A: Arch + ?Sized>(arch: &A) -> usize {
    arch.shootdown_state() as *const _ as usize
}

impl TlbFlushUnmapBatch {
    /// An empty batch.
    pub const fn new() -> Self {
        TlbFlushUnmapBatch {
            targets: CpuSet::new(),
            request: FlushRequest::new(),
            writable: false,
            aged: 0,
            issued_on: CpuSet::new(),
            unissued: false,
            machine: 0,
        }
    }

    /// [`Error::OtherMachine`] when the batch holds work of a machine other
    /// than `arch`'s.
    pub(crate) fn check_machine<A: Arch + ?Sized>(&self, arch: &A) -> Result<(), Error> {
        if self.machine == 0 || self.machine == machine_id(arch) || self.is_empty() {
            Ok(())
        } else {
            Err(Error::OtherMachine)
        }
    }

    /// Every check [`add_pending`](Self::add_pending) makes, without
    /// changing anything: the reverse-map walk runs them before it clears
    /// a PTE, so that recording the flush afterwards cannot fail.
    pub(crate) fn check_add<A: Arch>(&self, arch: &A, mm: &MmTlbState, va: u64) -> Result<Pages, Error> {
        check_space_va(arch, mm, va)?;
        check_asid(arch, mm.asid())?;
        self.check_machine(arch)?;
        space_caller(arch, mm)?;
        Pages::one(va, arch.base_page())
    }

    /// [`check_add`](Self::check_add) for the entry of `size` whose first
    /// address is `va` (a huge page's, for a huge entry), as the page table
    /// reported it: the pages its flush covers, at its stride, known to be
    /// one leaf entry of that size. Errors: those of `check_add`,
    /// [`Error::BelowBasePage`] when `size` is smaller than the
    /// architecture's base page, and [`Error::StrideUnaligned`] when `va`
    /// is not aligned to `size`.
    pub(crate) fn check_add_sized<A: Arch>(
        &self,
        arch: &A,
        mm: &MmTlbState,
        va: u64,
        size: PageSize,
    ) -> Result<Pages, Error> {
        self.check_add(arch, mm, va)?;
        check_entry_size(arch, va, size)?;
        Ok(Pages::one(va, size)?.leaf())
    }

    /// Records the flush of `page` under `asid` (its space's, or
    /// [`Asid::KERNEL`] for a global entry) for `targets` (the space's
    /// flush targets, read after the PTE changed, with the generation step
    /// that read made: [`MmTlbState::flush_targets_step`]), checked by
    /// [`check_add`](Self::check_add) with the same `arch`. `aged`: an
    /// epoch past which no CPU holds an entry for the page (see the
    /// field), if one is known.
    pub(crate) fn record<A: Arch>(
        &mut self,
        arch: &A,
        asid: Asid,
        pages: Pages,
        (targets, step): (&CpuSet, Option<GenStep>),
        aged: Option<u64>,
    ) {
        self.machine = machine_id(arch);
        if A::BROADCAST_INVALIDATE && A::BATCH_BROADCAST_ON_ADD {
            // After the PTE change (the callers record only then): the
            // invalidation cannot let a walk refill the old entry.
            for va in pages.addresses() {
                issue_broadcast_page(arch, asid, va, pages.hint());
            }
            match arch.current_cpu() {
                Ok(me) => {
                    self.issued_on.insert(me);
                }
                // Not reached: `check_add` refused such a CPU. Were it,
                // the flush would issue the invalidations again.
                Err(_) => self.unissued = true,
            }
        } else {
            self.unissued = true;
        }
        self.request
            .add_pages_step(asid, pages, A::FULL_FLUSH_CEILING, step);
        self.targets = self.targets.union(targets);
        self.aged = self.aged.max(aged.unwrap_or(u64::MAX));
    }

    /// Records a deferred unmap (see [`add_pending`](Self::add_pending))
    /// after [`check_add`](Self::check_add) passed; `old` is the entry the
    /// clear returned, the rest as for [`record`](Self::record).
    pub(crate) fn record_pending<A: Arch>(
        &mut self,
        arch: &A,
        mm: &MmTlbState,
        pages: Pages,
        old: Pte,
        targets: (&CpuSet, Option<GenStep>),
        aged: Option<u64>,
    ) {
        if !mm.is_kernel() && old.flags().contains(PteFlags::GLOBAL) {
            // A global entry is no ASID's: a CPU that ran the space at any
            // time may still hold it, whatever it runs now. Flushed as a
            // kernel page is, on every online CPU. (Only `add_pending`
            // gets here: the reverse-map walks refuse such an entry before
            // they clear it.)
            self.record(arch, Asid::KERNEL, pages, (&arch.online_cpus(), None), None);
        } else {
            self.record(arch, mm.asid(), pages, targets, aged);
        }
        self.writable |= old.is_writable() || old.is_dirty();
        mm.note_deferred();
        arch.shootdown_state().count(Counter::PagesDeferred, 1);
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
    /// An `old` entry marked [`PteFlags::GLOBAL`] in a user space is no
    /// ASID's: any CPU that ran the space may still hold it, whatever it
    /// runs now, so its page is flushed as a kernel page is, on every
    /// online CPU (an IPI to each). Map user pages without the bit (the
    /// crate's reverse-map walks refuse one before clearing it).
    ///
    /// Call it after the PTE is cleared and only when
    /// [`should_defer`](Self::should_defer) allowed it; check `va` with
    /// [`check_space_va`](crate::check_space_va) *before* clearing the PTE,
    /// so that an error here cannot leave a cleared PTE without its flush.
    /// Errors (the batch is unchanged): [`Error::Unaligned`],
    /// [`Error::NonCanonical`], [`Error::KernelHalf`] (an upper-half
    /// address of a user space), [`Error::AsidOutOfRange`],
    /// [`Error::OtherMachine`]; and two set-up errors, which no flush the
    /// crate could make would cover ([`check_cpu_state`](crate::check_cpu_state)
    /// finds them before any PTE is touched): [`Error::CpuNotOnline`] and
    /// [`Error::UntrackedRoot`] (this CPU loaded `mm`'s root without
    /// [`switch_mm`](crate::switch_mm)).
    pub fn add_pending<A: Arch>(
        &mut self,
        arch: &A,
        mm: &MmTlbState,
        va: u64,
        old: Pte,
    ) -> Result<(), Error> {
        let pages = self.check_add(arch, mm, va)?;
        let (targets, step) = mm.flush_targets_step(arch);
        self.record_pending(arch, mm, pages, old, (&targets, step), None);
        Ok(())
    }

    /// Records the flush owed after clearing the accessed bit of `va` in
    /// `mm` on hardware that needs one ([`Arch::ACCESSED_CLEAR_NEEDS_FLUSH`]).
    /// The PTE still maps its frame, so this neither marks the batch
    /// writable nor marks `mm` as having a batched unmap pending. Errors:
    /// as for [`add_pending`](Self::add_pending).
    pub fn add_accessed_clear<A: Arch>(&mut self, arch: &A, mm: &MmTlbState, va: u64) -> Result<(), Error> {
        let pages = self.check_add(arch, mm, va)?;
        let (targets, step) = mm.flush_targets_step(arch);
        self.record(arch, mm.asid(), pages, (&targets, step), None);
        Ok(())
    }

    /// An epoch past which no CPU holds any entry this batch owes a flush
    /// for, when one is known (see [`Rmap::aged_epoch`](crate::Rmap::aged_epoch));
    /// for [`FramePool`](crate::FramePool).
    pub(crate) fn aged_epoch(&self) -> Option<u64> {
        (self.aged != u64::MAX).then_some(self.aged)
    }

    /// The pending request (for [`FramePool`](crate::FramePool)).
    pub(crate) fn request(&self) -> &FlushRequest {
        &self.request
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

    /// Whether every pending invalidation was issued on add by the calling
    /// CPU, so that waiting for them completes the flush.
    pub(crate) fn issued_here<A: Arch>(&self, me: CpuId) -> bool {
        A::BROADCAST_INVALIDATE
            && A::BATCH_BROADCAST_ON_ADD
            && !self.unissued
            && self.issued_on == CpuSet::single(me)
    }

    /// Flushes everything pending: one shootdown, at most one IPI per
    /// target CPU, nothing at all when the batch is empty. On hardware that
    /// invalidates on add ([`Arch::BATCH_BROADCAST_ON_ADD`]) the flush
    /// only waits for those invalidations when this CPU issued them all,
    /// and issues them again first when it did not. After `Ok` the
    /// deferred frames may be freed, reused or written out and the batch is
    /// empty; after `Err` the batch is unchanged and still owes its flush
    /// ([`Error::OtherMachine`] when `arch` is not the machine that filled
    /// it, or an error of [`shootdown`]).
    pub fn flush<A: Arch>(&mut self, arch: &A) -> Result<ShootdownReport, Error> {
        if self.is_empty() {
            return Ok(ShootdownReport::default());
        }
        self.check_machine(arch)?;
        let me = online_caller(arch)?;
        let mut credited = CpuSet::new();
        let report = if self.issued_here::<A>(me) {
            complete_broadcast(arch, me, &self.request)
        } else {
            // A CPU recorded when a page was added that has switched away
            // since, or gone lazy, flushes by generation before it uses the
            // space again (the add advanced it): no IPI for it. Kernel
            // pages are global: every target stays.
            let state = arch.shootdown_state();
            let targets = if self.request.names_kernel() {
                self.targets
            } else {
                let running = still_running(
                    state,
                    &self.targets,
                    self.request.asids(),
                    self.request.has_too_many_asids(),
                );
                // Every entry was found unaccessed since its frame's aging,
                // on hardware whose fills set the bit: a CPU that dropped
                // its whole TLB, or every entry of each ASID the batch
                // names, after reading the aging epoch holds none of them
                // (as for a pooled aged generation). No IPI for it. (A slot
                // read while its CPU evicts it, switching away, may show
                // the next ASID's value; that CPU uses none of these
                // entries before its next load, which flushes them.)
                let asids = self.request.asids();
                let flushed_since = |cpu, aged| {
                    if self.request.has_too_many_asids() || asids.is_empty() {
                        state.passed_epoch(cpu) >= aged
                    } else {
                        asids.iter().all(|&a| state.flushed_generation(cpu, a) >= aged)
                    }
                };
                // On a tagged TLB a CPU left out stays behind the space's
                // generation and flushes the whole ASID at its next load
                // (refilling what it uses), where the flush it was spared
                // would have kept it caught up (a whole-ASID flush, or pages
                // whose step it follows): there, an IPI is the cheaper,
                // unless the batch can credit it with the flush instead.
                let spared_catch_up = |cpu| {
                    arch.tagged_tlb()
                        && match self.request.scope() {
                            FlushScope::Ranges(_) => self
                                .request
                                .steps()
                                .any(|(a, step)| state.caught_up_generation(cpu, a) >= step.from),
                            _ => true,
                        }
                };
                // The credit: a CPU that holds none of the batch's entries
                // and had carried out every flush of each named space up to
                // the start of the batch's step is caught up to its end
                // without flushing anything, when every named ASID has a
                // step (no other flush of its space came between the
                // batch's). Its slots are read so that they cannot mix
                // two ASIDs' values: the credit outlives the read.
                let stepped = self.request.steps().count() == asids.len()
                    && !asids.is_empty()
                    && !self.request.has_too_many_asids();
                let creditable = |cpu, aged| {
                    arch.tagged_tlb()
                        && stepped
                        && self.request.steps().all(|(a, step)| {
                            matches!(state.stable_generations(cpu, a),
                                Some((flushed, caught)) if flushed >= aged && caught >= step.from)
                        })
                };
                // An epoch from the future (a reverse map's bad answer) is
                // above every CPU's flushes, which record epochs read: it
                // spares no CPU.
                match self.aged_epoch() {
                    Some(aged) => {
                        let mut left = CpuSet::new();
                        for cpu in &self.targets {
                            if creditable(cpu, aged) {
                                credited.insert(cpu);
                            } else if running.contains(cpu)
                                && (!flushed_since(cpu, aged) || spared_catch_up(cpu))
                            {
                                left.insert(cpu);
                            }
                        }
                        left
                    }
                    None => running,
                }
            };
            let report = shootdown(arch, &targets, &self.request)?;
            for cpu in &credited {
                for (asid, step) in self.request.steps() {
                    arch.shootdown_state().grant_generation(cpu, asid, step.to);
                }
            }
            report
        };
        arch.shootdown_state().count(Counter::BatchesFlushed, 1);
        *self = TlbFlushUnmapBatch::new();
        Ok(report)
    }

    /// Flushes only if a deferred PTE was writable or dirty (the flush that
    /// must precede writing any deferred page out to disk); a clean-only
    /// batch stays pending. Returns the report when it flushed. Errors: as
    /// for [`flush`](Self::flush).
    pub fn flush_dirty<A: Arch>(&mut self, arch: &A) -> Result<Option<ShootdownReport>, Error> {
        self.check_machine(arch)?;
        if self.writable {
            self.flush(arch).map(Some)
        } else {
            Ok(None)
        }
    }
}
