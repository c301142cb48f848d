//! Per-address-space TLB state, the context-switch hook, and immediate
//! (unbatched) flushes of one address space.

use crate::arch::{Arch, Asid};
use crate::cpuset::{AtomicCpuSet, CpuSet};
use crate::range::PageRange;
use crate::request::FlushRequest;
use crate::shootdown::{flush_local_all_as_pass, shootdown, ShootdownReport};
use crate::stats::{Counter, FlushExtent, FlushReason, TraceEvent};
use crate::sync::{fence, maybe_const_fn, AtomicU64, Ordering};
use crate::validate::{check_asid, check_range, check_va};
use crate::Error;

/// The TLB-related state of one address space (the fields Linux keeps in
/// `mm_struct`). A kernel embeds one in its own address-space type.
///
/// - `asid` and `root` identify the address space to the hardware.
/// - `cpus` holds every CPU that may cache its translations. [`switch_mm`]
///   keeps it exact enough that no IPI goes to a CPU that cannot hold an
///   entry: without tagged TLBs, switching away removes the CPU.
/// - The "batched flush pending" marker is a pair of generations: a
///   deferral advances `pending`; a flush of the whole address space
///   advances `flushed` to the `pending` it saw *before* flushing. A
///   deferral that races with the flusher leaves `pending` ahead, so the
///   next check flushes again; a single boolean cleared by the flusher
///   would lose it.
///
/// The kernel's own mappings are an address space too: build it with
/// [`MmTlbState::kernel`]; every online CPU is then a target and flushes
/// include global entries.
#[derive(Debug)]
pub struct MmTlbState {
    asid: Asid,
    root: u64,
    cpus: AtomicCpuSet,
    batch_pending: AtomicU64,
    batch_flushed: AtomicU64,
}

impl MmTlbState {
    maybe_const_fn! {
        /// The state of a user address space with this ASID and page-table
        /// root (opaque here; passed to [`Arch::switch_address_space`]).
        pub fn new(asid: Asid, root: u64) -> Self {
            MmTlbState {
                asid,
                root,
                cpus: AtomicCpuSet::new(),
                batch_pending: AtomicU64::new(0),
                batch_flushed: AtomicU64::new(0),
            }
        }
    }

    maybe_const_fn! {
        /// The state of the kernel's (global) address space.
        pub fn kernel(root: u64) -> Self {
            MmTlbState::new(Asid::KERNEL, root)
        }
    }

    /// The ASID.
    pub fn asid(&self) -> Asid {
        self.asid
    }

    /// The page-table root given at construction.
    pub fn root(&self) -> u64 {
        self.root
    }

    /// Whether this is the kernel's address space.
    pub fn is_kernel(&self) -> bool {
        self.asid.is_kernel()
    }

    /// The CPUs recorded as possibly caching this address space (empty for
    /// the kernel's: see [`flush_targets`](Self::flush_targets)).
    pub fn cpus(&self) -> CpuSet {
        self.cpus.load(Ordering::SeqCst)
    }

    /// The CPUs a flush of this address space must reach: every online CPU
    /// for the kernel's, the recorded online CPUs otherwise.
    ///
    /// Call it *after* clearing the PTEs to be flushed: the full fence here
    /// pairs with the one in [`switch_mm`], so a CPU that switches in
    /// concurrently is either seen here or walks the already-cleared table.
    pub fn flush_targets<A: Arch>(&self, arch: &A) -> CpuSet {
        // Store-buffering pair with `switch_mm`'s fence (loom: model (e)
        // fails without either; (f) needs it to acquire a deferral).
        fence(Ordering::SeqCst);
        let online = arch.online_cpus();
        if self.is_kernel() {
            online
        } else {
            self.cpus.load(Ordering::SeqCst).intersection(&online)
        }
    }

    /// Whether a CPU other than the caller's may hold entries of this
    /// address space.
    pub fn cached_elsewhere<A: Arch>(&self, arch: &A) -> bool {
        !self
            .flush_targets(arch)
            .difference(&CpuSet::single(arch.current_cpu()))
            .is_empty()
    }

    /// Records that a flush of this address space was deferred into a batch
    /// (called by [`TlbFlushUnmapBatch::add_pending`](crate::TlbFlushUnmapBatch::add_pending)).
    pub fn note_batched_pending(&self) {
        // Releases the PTE clear to a flusher that reads `pending` (loom:
        // model (f) fails when this is Relaxed).
        self.batch_pending.fetch_add(1, Ordering::SeqCst);
    }

    /// Records that a flush of this address space is owed and not yet done
    /// (a change whose shootdown failed): the next
    /// [`flush_tlb_batched_pending`] flushes the whole address space, so a
    /// retry of the failed call, or any later change of a mapping, does
    /// what the failure left undone.
    pub(crate) fn note_flush_owed(&self) {
        self.note_batched_pending();
    }

    /// Identity of this state (its address), to tell address spaces apart
    /// without holding a reference.
    pub(crate) fn id(&self) -> usize {
        self as *const MmTlbState as usize
    }

    /// Whether a deferred flush may still be outstanding: some batch
    /// recorded a deferral that no [`flush_tlb_batched_pending`] covered.
    pub fn batched_flush_pending(&self) -> bool {
        self.batch_flushed.load(Ordering::SeqCst) < self.batch_pending.load(Ordering::SeqCst)
    }
}

/// The context-switch hook: call it on the switching CPU, with interrupts
/// off, instead of loading the page-table root yourself. It adds the CPU to
/// `next`'s set *before* loading it, records the loaded ASID, loads it
/// through [`Arch::switch_address_space`], and, when TLBs are not tagged,
/// removes the CPU from `prev`'s set afterwards (its entries are gone).
///
/// Errors: [`Error::AsidOutOfRange`] when `next`'s ASID is wider than the
/// hardware's ([`Arch::asid_bits`]): nothing is loaded and nothing changes,
/// since the hardware would tag its entries as another address space's.
///
/// # Safety
///
/// `next.root()` must be a valid page-table root that maps the running
/// code, as [`Arch::switch_address_space`] requires, and `prev` must be the
/// address space this CPU had loaded.
pub unsafe fn switch_mm<A: Arch>(
    arch: &A,
    prev: Option<&MmTlbState>,
    next: &MmTlbState,
) -> Result<(), Error> {
    check_asid(arch, next.asid)?;
    let me = arch.current_cpu();
    let state = arch.shootdown_state();
    if prev.is_some_and(|p| core::ptr::eq(p, next)) {
        return Ok(());
    }
    if !next.is_kernel() {
        next.cpus.insert(me, Ordering::SeqCst);
    }
    // Pairs with the fence in `flush_targets`: either a concurrent unmapper
    // sees this CPU in the set, or this CPU's walks see the cleared PTEs
    // (loom: model (e) fails without it).
    fence(Ordering::SeqCst);
    state.set_loaded_asid(me, next.asid);
    // Read before the switch: without tagged TLBs the switch drops every
    // non-global entry, so this CPU has then flushed past every pooled
    // generation published up to here (their PTEs were cleared before
    // their epoch was).
    let epoch = state.epoch();
    // SAFETY: the caller guarantees `next.root()` is a valid root.
    unsafe { arch.switch_address_space(next.asid, next.root) };
    state.count(Counter::TaskSwitches, 1);
    if !arch.tagged_tlb() {
        state.pass(me, epoch);
        arch.trace(&TraceEvent {
            cpu: me,
            reason: FlushReason::TaskSwitch,
            extent: FlushExtent::All,
        });
        if let Some(prev) = prev.filter(|p| !p.is_kernel()) {
            prev.cpus.remove(me, Ordering::SeqCst);
        }
    }
    Ok(())
}

/// The hook for a CPU coming online: call it on that CPU, with interrupts
/// off, *before* it joins [`Arch::online_cpus`].
///
/// While a CPU is offline it takes no flush IPIs, so it may still hold any
/// entry it cached before, global kernel entries included, for pages that
/// have since been unmapped and freed. This drops all of them
/// ([`Arch::flush_local_all`] with global entries) and forgets which
/// address space the CPU had loaded; only then may it be counted among the
/// CPUs that shootdowns reach and skip. The CPU loads an address space with
/// [`switch_mm`] afterwards, as usual.
pub fn prepare_cpu_online<A: Arch>(arch: &A) {
    flush_local_all_as_pass(arch, true);
    arch.shootdown_state().clear_loaded_asid(arch.current_cpu());
}

/// Contract rule 5: an operation about to change mappings of `mm`
/// (mprotect, munmap, madvise, remap) calls this first, under the lock that
/// serialises such changes. If a batch deferred flushes of `mm` that no
/// flush covered yet, the whole address space is flushed on every CPU that
/// may cache it; otherwise nothing happens. Returns whether it flushed.
///
/// Without this, a CPU could keep writing through a stale writable entry
/// for a page the operation is about to protect or reuse.
///
/// That includes the page-fault path when it maps a *different* frame at an
/// address a reclaimer unmapped (a fresh frame rather than the same page
/// found again, as Linux's swap cache would): until the batch is flushed,
/// another CPU's stale entry still sends its writes to the old frame, and
/// the new mapping would never see them. The fuzzer found this sequence.
pub fn flush_tlb_batched_pending<A: Arch>(arch: &A, mm: &MmTlbState) -> Result<bool, Error> {
    // `pending` acquires the deferrals it counts (with `flush_targets`'s
    // fence: loom model (f)); `flushed` acquires the flush that covered
    // them, which a caller that skips relies on (model (g)).
    let pending = mm.batch_pending.load(Ordering::SeqCst);
    if mm.batch_flushed.load(Ordering::SeqCst) >= pending {
        return Ok(false);
    }
    shootdown(arch, &mm.flush_targets(arch), &FlushRequest::for_asid(mm.asid))?;
    // Covers every deferral up to `pending`; a later one keeps the marker
    // set, so it is flushed by the next call. Releases this flush to the
    // callers that skip (loom: model (g) fails when this is Relaxed).
    mm.batch_flushed.fetch_max(pending, Ordering::SeqCst);
    Ok(true)
}

/// Flushes one page of `mm` on every CPU that may cache it, now. Errors:
/// [`Error::Unaligned`], [`Error::NonCanonical`], [`Error::AsidOutOfRange`]
/// and those of [`shootdown`] (nothing flushed).
pub fn flush_tlb_page<A: Arch>(arch: &A, mm: &MmTlbState, va: u64) -> Result<ShootdownReport, Error> {
    check_va(arch, va)?;
    let mut req = FlushRequest::new();
    req.add_page(mm.asid, va, A::FULL_FLUSH_CEILING)?;
    shootdown(arch, &mm.flush_targets(arch), &req)
}

/// Flushes the pages of `range` in `mm` on every CPU that may cache them,
/// now: page by page up to [`Arch::FULL_FLUSH_CEILING`], the whole address
/// space above it. Errors: [`Error::NonCanonical`] for a range with a page
/// the machine cannot address or that crosses the hole between the halves
/// (however long it is), [`Error::AsidOutOfRange`] and those of
/// [`shootdown`] (nothing flushed).
pub fn flush_tlb_range<A: Arch>(
    arch: &A,
    mm: &MmTlbState,
    range: PageRange,
) -> Result<ShootdownReport, Error> {
    check_range(arch, range)?;
    let mut req = FlushRequest::new();
    req.add_range(mm.asid, range, A::FULL_FLUSH_CEILING);
    shootdown(arch, &mm.flush_targets(arch), &req)
}

/// Flushes every entry of `mm` on every CPU that may cache it, now.
pub fn flush_tlb_mm<A: Arch>(arch: &A, mm: &MmTlbState) -> Result<ShootdownReport, Error> {
    shootdown(arch, &mm.flush_targets(arch), &FlushRequest::for_asid(mm.asid))
}
