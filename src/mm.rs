//! Per-address-space TLB state, the context-switch hook, and immediate
//! (unbatched) flushes of one address space.

use crate::arch::{Arch, Asid};
use crate::cpuset::{AtomicCpuSet, CpuId, CpuSet};
use crate::generation::GenStep;
use crate::lifecycle::online_caller;
use crate::percpu::TlbShootdown;
use crate::range::PageRange;
use crate::request::FlushRequest;
use crate::shootdown::{flush_local_all_as_pass, shootdown, ShootdownReport};
use crate::stats::{Counter, FlushExtent, FlushReason, TraceEvent};
use crate::sync::{fence, maybe_const_fn, AtomicBool, AtomicU64, Ordering};
use crate::validate::{check_asid, check_space_range, check_space_va};
use crate::verify::{bind_machine, space_caller};
use crate::Error;

mod lazy;

use lazy::leave_lazy;
pub use lazy::{enter_lazy_tlb, leave_lazy_tlb};

/// The TLB-related state of one address space (the fields Linux keeps in
/// `mm_struct`). A kernel embeds one in its own address-space type.
///
/// - `asid` and `root` identify the address space to the hardware.
/// - `cpus` holds the CPUs that run it now, lazily or not. [`switch_mm`]
///   adds the switching CPU before loading it and takes it out of the
///   previous space's set afterwards, on tagged TLBs too: a CPU that
///   switched away keeps its tagged entries but catches up by generation
///   before it loads the space again (see [`generation`](crate::generation)).
/// - `tlb_gen` is the space's flush generation: every flush of it advances
///   it, after its PTEs were cleared and before its targets are read
///   ([`flush_targets`](Self::flush_targets) does both).
/// - The "batched flush pending" marker is a pair of generations: a
///   deferral advances `pending`; a flush of the whole address space
///   advances `flushed` to the `pending` it saw *before* flushing. A
///   deferral that races with the flusher leaves `pending` ahead, so the
///   next check flushes again; a single boolean cleared by the flusher
///   would lose it.
///
/// The kernel's own mappings are an address space too: build it with
/// [`MmTlbState::kernel`]; every online CPU is then a target, lazy ones
/// included, and flushes include global entries.
#[derive(Debug)]
pub struct MmTlbState {
    asid: Asid,
    root: u64,
    cpus: AtomicCpuSet,
    /// 0 until first used; then the epoch of the newest flush (see
    /// [`generation`](crate::generation)).
    tlb_gen: AtomicU64,
    batch_pending: AtomicU64,
    batch_flushed: AtomicU64,
    /// The `batch_pending` count the newest owed flush (a change whose
    /// shootdown failed) took it to: owed until `batch_flushed` reaches it.
    owed: AtomicU64,
    /// Whether a deferral was ever noted from outside the crate
    /// ([`note_batched_pending`](Self::note_batched_pending)), with no
    /// generation advance known to follow its PTE clears: then
    /// [`flush_tlb_batched_pending`] reaches every CPU running the space.
    untracked: AtomicBool,
    /// 0 until the space is first used; then the id of the machine it
    /// was used on (the address of its [`TlbShootdown`]).
    pub(crate) machine: AtomicU64,
}

impl MmTlbState {
    maybe_const_fn! {
        /// The state of a user address space with this ASID and page-table
        /// root (opaque here; passed to [`Arch::switch_address_space`]).
        ///
        /// One state per address space, shared by every CPU that runs it,
        /// each loading it only through [`switch_mm`] with this state: the
        /// state's CPU set is what flushes reach. A second state for the
        /// same root (or the root loaded another way) has CPUs the first
        /// state's flushes skip. A root loaded another way is refused on the
        /// calling CPU ([`Error::UntrackedRoot`]) and found on any CPU by
        /// [`check_cpu_state`](crate::check_cpu_state); a second state is
        /// not: a CPU that runs it is, to the crate, running another
        /// address space, and `check_cpu_state` with that state answers
        /// `Ok`. Only the kernel can keep one state per root (a page table
        /// that reports its root, [`PageTable::root`](crate::PageTable::root),
        /// at least ties each table to the state that holds it:
        /// [`Error::RootMismatch`]). Give each live address space its own ASID,
        /// and use the state on one machine only ([`Error::OtherMachine`]).
        pub fn new(asid: Asid, root: u64) -> Self {
            MmTlbState {
                asid,
                root,
                cpus: AtomicCpuSet::new(),
                tlb_gen: AtomicU64::new(0),
                batch_pending: AtomicU64::new(0),
                batch_flushed: AtomicU64::new(0),
                owed: AtomicU64::new(0),
                untracked: AtomicBool::new(false),
                machine: AtomicU64::new(0),
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

    /// The CPUs that run this address space now, lazy ones included (empty
    /// for the kernel's: see [`flush_targets`](Self::flush_targets)).
    pub fn cpus(&self) -> CpuSet {
        self.cpus.load(Ordering::SeqCst)
    }

    /// The space's flush generation: the flush epoch of its newest flush
    /// (0 before its first use; see [`generation`](crate::generation)).
    pub fn tlb_gen(&self) -> u64 {
        self.tlb_gen.load(Ordering::SeqCst)
    }

    /// Gives a space its first generation, a fresh epoch, newer than
    /// anything a CPU recorded for an ASID a dead space may have left
    /// entries under.
    fn init_gen(&self, state: &TlbShootdown) {
        if self.tlb_gen.load(Ordering::SeqCst) == 0 {
            let fresh = state.publish_epoch();
            let _ = self
                .tlb_gen
                .compare_exchange(0, fresh, Ordering::SeqCst, Ordering::SeqCst);
        }
    }

    /// The CPUs a flush of this address space must reach: every online CPU
    /// for the kernel's; for a user space, the online CPUs that run it now
    /// and are not lazy on it. A lazy CPU and a CPU that switched away
    /// flush the space's ASID themselves before they use it again, since
    /// this call advances the space's generation.
    ///
    /// It is the first step of a flush, not a query (that is
    /// [`running_cpus`](Self::running_cpus)): it advances the space's
    /// generation, so every CPU that does not run the space now flushes
    /// its ASID before loading it again. Call it *after* clearing the PTEs
    /// to be flushed, once per flush: the
    /// generation it publishes then covers them, and the full fence here
    /// pairs with the one in [`switch_mm`] (and in [`leave_lazy_tlb`]), so a
    /// CPU that switches in concurrently is either seen here or sees the
    /// new generation and flushes. A flush that frees page tables must use
    /// [`table_flush_targets`](Self::table_flush_targets) instead, unless
    /// the tables wait for the lazy CPUs in a [`TableHold`](crate::TableHold).
    pub fn flush_targets<A: Arch>(&self, arch: &A) -> CpuSet {
        self.targets(arch, true, false).0
    }

    /// [`flush_targets`](Self::flush_targets), and the step by which it
    /// advanced the generation (`None` for the kernel's space): a request
    /// of single pages that carries it lets each target that was caught up
    /// to its start count itself caught up to its end.
    pub(crate) fn flush_targets_step<A: Arch>(&self, arch: &A) -> (CpuSet, Option<GenStep>) {
        self.targets(arch, true, false)
    }

    /// Like [`flush_targets`](Self::flush_targets), but lazy CPUs are
    /// reached too: for a flush after which page-table frames are freed. A
    /// lazy CPU keeps the space's root loaded, so its MMU may still walk
    /// the tables (speculatively, and through its paging-structure caches)
    /// whatever code it runs (Linux's `freed_tables` rule). A teardown given
    /// a [`TableHold`](crate::TableHold) flushes
    /// [`flush_targets`](Self::flush_targets) instead and keeps the tables
    /// until those CPUs have passed.
    pub fn table_flush_targets<A: Arch>(&self, arch: &A) -> CpuSet {
        self.targets(arch, true, true).0
    }

    /// [`table_flush_targets`](Self::table_flush_targets) and its step
    /// (see [`flush_targets_step`](Self::flush_targets_step)).
    pub(crate) fn table_flush_targets_step<A: Arch>(&self, arch: &A) -> (CpuSet, Option<GenStep>) {
        self.targets(arch, true, true)
    }

    /// Publishes a new epoch and stores it as the generation, and returns
    /// the step from the value it replaced. Each flush stores a value of
    /// its own: one whose epoch was overtaken by a concurrent flush's
    /// before it was stored publishes another, so no stored value lies
    /// between a step's two ends (a CPU carrying out one flush's pages
    /// misses no other). Lock-free: a retry means another flush stored.
    fn advance(&self, state: &TlbShootdown) -> GenStep {
        loop {
            // After the caller's PTE clears: a CPU that reads this
            // generation and then flushes holds no entry for them.
            let to = state.publish_epoch();
            let from = self.tlb_gen.fetch_max(to, Ordering::SeqCst);
            if from < to {
                return GenStep { from, to };
            }
        }
    }

    /// [`flush_targets_step`](Self::flush_targets_step), and the lazy
    /// CPUs it left out, from the same reads: for a flush after which page
    /// tables are held, not freed, until those CPUs have passed
    /// ([`TableHold`](crate::TableHold)). Empty for the kernel's space,
    /// whose flushes reach every online CPU.
    pub(crate) fn flush_targets_lazy_step<A: Arch>(&self, arch: &A) -> (CpuSet, CpuSet, Option<GenStep>) {
        let (set, lazy, step) = self.split_targets(arch, true);
        (set.difference(&lazy), lazy, step)
    }

    fn targets<A: Arch>(&self, arch: &A, advance: bool, with_lazy: bool) -> (CpuSet, Option<GenStep>) {
        let (set, lazy, step) = self.split_targets(arch, advance);
        if with_lazy {
            (set, step)
        } else {
            (set.difference(&lazy), step)
        }
    }

    /// The online CPUs that run the space (every online one for the
    /// kernel's), those of them that are lazy, and the step of the advance.
    fn split_targets<A: Arch>(&self, arch: &A, advance: bool) -> (CpuSet, CpuSet, Option<GenStep>) {
        let state = arch.shootdown_state();
        let step = (advance && !self.is_kernel()).then(|| self.advance(state));
        // Store-buffering pair with `switch_mm`'s fence (loom: model (e)
        // fails without either; (f) needs it to acquire a deferral).
        fence(Ordering::SeqCst);
        let online = arch.online_cpus();
        if self.is_kernel() {
            return (online, CpuSet::new(), step);
        }
        let set = self.cpus.load(Ordering::SeqCst).intersection(&online);
        let lazy = set.intersection(&state.lazy_cpus());
        (set, lazy, step)
    }

    /// The CPUs a flush of this address space would reach now (as
    /// [`flush_targets`](Self::flush_targets) computes them), without
    /// advancing its generation: for looking, not for flushing.
    pub fn running_cpus<A: Arch>(&self, arch: &A) -> CpuSet {
        self.targets(arch, false, false).0
    }

    /// Whether a CPU other than the caller's runs this address space now,
    /// not lazily (a flush would interrupt it). Advances nothing.
    ///
    /// On a CPU that [`Arch::current_cpu`] cannot tell, every CPU of the
    /// set counts as another.
    pub fn cached_elsewhere<A: Arch>(&self, arch: &A) -> bool {
        let running = self.targets(arch, false, false).0;
        match arch.current_cpu() {
            Ok(me) => !running.difference(&CpuSet::single(me)).is_empty(),
            Err(_) => !running.is_empty(),
        }
    }

    /// Records that a flush of this address space was deferred into a batch
    /// of the kernel's own (the crate's batches record theirs themselves,
    /// in [`TlbFlushUnmapBatch::add_pending`](crate::TlbFlushUnmapBatch::add_pending)).
    /// Call it after the PTE clears. The next [`flush_tlb_batched_pending`]
    /// then flushes the whole address space on every CPU that runs it; from
    /// then on, this space's pending flushes reach every such CPU, since nothing
    /// tells which generation covers the kernel's clears.
    pub fn note_batched_pending(&self) {
        self.untracked.store(true, Ordering::SeqCst);
        self.note_deferred();
    }

    /// Records a deferral whose PTE clears this space's generation was
    /// advanced after (by [`flush_targets`](Self::flush_targets) or
    /// [`advance`](Self::advance)), before this call.
    pub(crate) fn note_deferred(&self) -> u64 {
        // Releases the PTE clear to a flusher that reads `pending` (loom:
        // model (f) fails when this is Relaxed).
        self.batch_pending.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Records that a flush of this address space is owed and not yet done
    /// (a change whose shootdown failed): the next
    /// [`flush_tlb_batched_pending`] flushes the whole address space, so a
    /// retry of the failed call, or any later change of a mapping, does
    /// what the failure left undone. The generation advances first, after
    /// the changes: only a CPU that flushes the whole ASID afterwards
    /// counts as caught up past them.
    pub(crate) fn note_flush_owed(&self, state: &TlbShootdown) {
        if !self.is_kernel() {
            self.advance(state);
        }
        let counted = self.note_deferred();
        self.owed.fetch_max(counted, Ordering::SeqCst);
    }

    /// Whether a change of this space whose shootdown failed is still
    /// unflushed: a CPU may then hold an entry that allows more than its
    /// PTE now says (a write through a page made read-only), so a change
    /// that trusts the PTE flushes the space first
    /// ([`flush_tlb_batched_pending`]).
    pub(crate) fn flush_owed(&self) -> bool {
        self.batch_flushed.load(Ordering::SeqCst) < self.owed.load(Ordering::SeqCst)
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
/// `next`'s set and records the loaded ASID *before* loading it; on a
/// tagged TLB it then compares generations and, if `next` was flushed since
/// this CPU last flushed its ASID, flushes that ASID locally first (the
/// catch-up; see [`generation`](crate::generation)). It loads `next`
/// through [`Arch::switch_address_space`] and takes the CPU out of
/// `prev`'s set afterwards: from then on flushes of `prev` skip it, on
/// tagged TLBs too, and it catches up when it loads `prev` again.
///
/// Called with `next` the space already loaded (`prev` and `next` the same
/// value), it loads nothing: a CPU in lazy TLB mode leaves it, as
/// [`leave_lazy_tlb`] does (catching up first), and any other call does
/// nothing. A switch also ends lazy mode on the previous space.
///
/// Errors, with nothing loaded and nothing changed:
/// [`Error::AsidOutOfRange`] when `next`'s ASID is wider than the
/// hardware's ([`Arch::asid_bits`]), since the hardware would tag its
/// entries as another address space's; [`Error::CpuNotOnline`] when `next`
/// is a user space and this CPU is not online (flushes would not reach
/// it: bring it online first, loading the kernel's space meanwhile);
/// [`Error::OtherMachine`] when `next` was used on another machine; the
/// error of [`Arch::current_cpu`] when the CPU cannot be told.
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
    bind_machine(arch, next)?;
    // A user space loaded on a CPU that flushes do not reach would keep
    // its entries through every flush; the kernel's may be loaded on a CPU
    // coming up, which flushes everything as it joins.
    let me = if next.is_kernel() {
        arch.current_cpu()?
    } else {
        online_caller(arch)?
    };
    let state = arch.shootdown_state();
    if prev.is_some_and(|p| core::ptr::eq(p, next)) {
        if state.is_lazy(me) && !next.is_kernel() {
            leave_lazy(arch, me, next);
        }
        return Ok(());
    }
    if !next.is_kernel() {
        next.init_gen(state);
        next.cpus.insert(me, Ordering::SeqCst);
    }
    // Until the load below, this CPU still runs `prev`: a pool that reads
    // the new loaded ASID (next line) then finds `prev` here.
    let leaving = prev.filter(|p| !p.is_kernel()).map(|p| p.asid);
    state.set_leaving_asid(me, leaving);
    // Before the fence, so that a flusher or a pool that reads this CPU's
    // loaded ASID after advancing `next`'s generation either sees `next`,
    // or this CPU's generation check below sees the advance.
    state.set_loaded_asid(me, next.asid);
    state.set_lazy(me, false);
    // Pairs with the fence in `flush_targets`: either a concurrent unmapper
    // sees this CPU in the set, or this CPU's walks see the cleared PTEs
    // and its generation check the advance (loom: model (e) fails without
    // it).
    fence(Ordering::SeqCst);
    // Read before the switch (and before any catch-up): without tagged
    // TLBs the switch drops every non-global entry, so this CPU has then
    // flushed past every pooled generation published up to here (their
    // PTEs were cleared before their epoch was).
    let epoch = state.epoch();
    let tagged = arch.tagged_tlb();
    if tagged && !next.is_kernel() {
        catch_up(arch, me, next);
    }
    // SAFETY: the caller guarantees `next.root()` is a valid root.
    unsafe { arch.switch_address_space(next.asid, next.root) };
    state.count(Counter::TaskSwitches, 1);
    if !tagged {
        state.pass(me, epoch);
        arch.trace(&TraceEvent {
            cpu: me,
            reason: FlushReason::TaskSwitch,
            extent: FlushExtent::All,
        });
    }
    if let Some(prev) = prev.filter(|p| !p.is_kernel()) {
        prev.cpus.remove(me, Ordering::SeqCst);
    }
    // `prev`'s root is no longer loaded: its entries are gone (untagged,
    // and the pass above records it) or unusable until a catch-up.
    state.set_leaving_asid(me, None);
    Ok(())
}

/// Flushes `mm`'s ASID on this CPU if its generation moved past what this
/// CPU flushed it up to, and records the epoch read just before the flush
/// as the new one. Call it after the fence that orders this CPU's record
/// of `mm` (set, loaded ASID, lazy mark) before its generation read.
/// Returns whether it flushed.
fn catch_up<A: Arch>(arch: &A, me: CpuId, mm: &MmTlbState) -> bool {
    let state = arch.shootdown_state();
    if state.caught_up_generation(me, mm.asid) >= mm.tlb_gen.load(Ordering::SeqCst) {
        return false;
    }
    // Read before the flush, and after the generation: every flush of `mm`
    // up to this epoch cleared its PTEs before opening its generation, so
    // the flush below drops every entry they left, and what the TLB fills
    // afterwards comes from the cleared PTEs.
    let epoch = state.epoch();
    arch.flush_local_asid(mm.asid);
    state.asid_slots(me).record(mm.asid, epoch);
    if !arch.tagged_tlb() {
        // An untagged TLB holds the loaded space's entries only: flushing
        // them is a pass.
        state.pass(me, epoch);
    }
    state.count(Counter::LocalFullFlushes, 1);
    state.count(Counter::CatchUps, 1);
    arch.trace(&TraceEvent {
        cpu: me,
        reason: FlushReason::CatchUp,
        extent: FlushExtent::All,
    });
    true
}

/// The hook for a CPU coming online: call it on that CPU, with interrupts
/// off, *before* it joins [`Arch::online_cpus`].
///
/// While a CPU is offline it takes no flush IPIs, so it may still hold any
/// entry it cached before, global kernel entries included, for pages that
/// have since been unmapped and freed. This drops all of them
/// ([`Arch::flush_local_all`] with global entries) and forgets which
/// address space the CPU had loaded, its lazy mode and its ASIDs'
/// generations; only then may it be counted among the CPUs that shootdowns
/// reach and skip. The CPU loads an address space with [`switch_mm`]
/// afterwards, as usual.
///
/// Errors, with nothing flushed or forgotten: the error of
/// [`Arch::current_cpu`] when the CPU cannot be told (it must not join);
/// [`Error::AlreadyOnline`] when it is in [`Arch::online_cpus`] already
/// (forgetting what it runs would let flushes skip it while it uses it).
pub fn prepare_cpu_online<A: Arch>(arch: &A) -> Result<(), Error> {
    let state = arch.shootdown_state();
    let me = arch.current_cpu()?;
    if arch.online_cpus().contains(me) {
        return Err(Error::AlreadyOnline { cpu: me.index() });
    }
    flush_local_all_as_pass(arch, me, true);
    state.clear_loaded_asid(me);
    state.set_lazy(me, false);
    state.asid_slots(me).clear();
    Ok(())
}

/// Contract rule 5: an operation about to change mappings of `mm`
/// (mprotect, munmap, madvise, remap) calls this first, under the lock that
/// serialises such changes. If a batch deferred flushes of `mm` that no
/// flush covered yet, the whole address space is flushed on every CPU that
/// runs it and may still cache a deferred page (one that carried out every
/// deferral's flush since, by its generation, is left out, as are lazy
/// CPUs, which catch up before they use the space); otherwise nothing
/// happens. Returns whether the deferrals are now covered (`true`, even
/// when no CPU needed the flush).
///
/// Without this, a CPU could keep writing through a stale writable entry
/// for a page the operation is about to protect or reuse.
///
/// That includes the page-fault path when it maps a *different* frame at an
/// address a reclaimer unmapped (a fresh frame rather than the same page
/// found again, as Linux's swap cache would): until the batch is flushed,
/// another CPU's stale entry still sends its writes to the old frame, and
/// the new mapping would never see them. The fuzzer found this sequence.
///
/// Errors, with the deferrals still pending: [`Error::UntrackedRoot`] (as
/// for [`flush_tlb_page`]) and those of [`shootdown`].
pub fn flush_tlb_batched_pending<A: Arch>(arch: &A, mm: &MmTlbState) -> Result<bool, Error> {
    space_caller(arch, mm)?;
    // `pending` acquires the deferrals it counts (with `flush_targets`'s
    // fence: loom model (f)); `flushed` acquires the flush that covered
    // them, which a caller that skips relies on (model (g)).
    let pending = mm.batch_pending.load(Ordering::SeqCst);
    if mm.batch_flushed.load(Ordering::SeqCst) >= pending {
        return Ok(false);
    }
    // Every deferral counted in `pending` advanced the generation after
    // its clears and before it was counted, so a CPU caught up to this
    // value has carried out every deferred page's flush (a whole-ASID
    // flush read after them, or the deferring batch's own request, whose
    // step it followed): no IPI for it. Linux 6.1 interrupts it anyway.
    // Read after `pending`. A slot of another CPU read while that CPU
    // evicts it (`switch_mm` to another space) may show the new ASID's
    // value; that CPU runs no user code of this space before its next
    // load, which then finds the slot gone and flushes.
    let state = arch.shootdown_state();
    // The kernel's space has no generation: every online CPU, always.
    let tracked = !mm.is_kernel() && !mm.untracked.load(Ordering::SeqCst);
    let covered = tracked.then(|| mm.tlb_gen.load(Ordering::SeqCst));
    // A kernel's own deferral may have advanced nothing since its clears:
    // advance here, so that a CPU this misses while it switches in catches
    // up (the fence pair of `flush_targets` and `switch_mm`).
    let (mut targets, _) = mm.targets(arch, covered.is_none(), false);
    if let Some(generation) = covered {
        for cpu in &targets.clone() {
            if state.caught_up_generation(cpu, mm.asid) >= generation {
                targets.remove(cpu);
            }
        }
    }
    shootdown(arch, &targets, &FlushRequest::for_asid(mm.asid))?;
    // Covers every deferral up to `pending`; a later one keeps the marker
    // set, so it is flushed by the next call. Releases this flush to the
    // callers that skip (loom: model (g) fails when this is Relaxed).
    mm.batch_flushed.fetch_max(pending, Ordering::SeqCst);
    Ok(true)
}

/// Flushes one page of `mm` on every CPU that may cache it, now. Errors:
/// [`Error::Unaligned`], [`Error::NonCanonical`], [`Error::KernelHalf`]
/// (an upper-half address of a user space), [`Error::AsidOutOfRange`],
/// [`Error::UntrackedRoot`] (this CPU loaded `mm`'s root without
/// [`switch_mm`]: the flush would skip it) and those of [`shootdown`]
/// (nothing flushed).
pub fn flush_tlb_page<A: Arch>(arch: &A, mm: &MmTlbState, va: u64) -> Result<ShootdownReport, Error> {
    check_space_va(arch, mm, va)?;
    space_caller(arch, mm)?;
    flush_pages(arch, mm, PageRange::new(va, arch.base_page().base_pages())?)
}

/// One shootdown of `pages` of `mm`, carrying the generation step of its
/// advance (so the targets stay caught up), to the CPUs that run `mm`.
fn flush_pages<A: Arch>(arch: &A, mm: &MmTlbState, pages: PageRange) -> Result<ShootdownReport, Error> {
    let (targets, step) = mm.flush_targets_step(arch);
    let mut req = FlushRequest::new();
    // One invalidation per base page (a 64 KiB arm64 page is one entry:
    // sixteen invalidations 4 KiB apart would each remove it again), the
    // ceiling counted in base pages.
    req.add_base_range_step(mm.asid, pages, arch.base_page(), A::FULL_FLUSH_CEILING, step);
    shootdown(arch, &targets, &req)
}

/// Flushes the pages of `range` in `mm` on every CPU that may cache them,
/// now: page by page up to [`Arch::FULL_FLUSH_CEILING`], the whole address
/// space above it. Errors: [`Error::NonCanonical`] for a range with a page
/// the machine cannot address or that crosses the hole between the halves
/// (however long it is), [`Error::KernelHalf`] (a range of a user space
/// that reaches the upper half), [`Error::AsidOutOfRange`], [`Error::UntrackedRoot`]
/// (as for [`flush_tlb_page`]) and those of [`shootdown`] (nothing flushed).
pub fn flush_tlb_range<A: Arch>(
    arch: &A,
    mm: &MmTlbState,
    range: PageRange,
) -> Result<ShootdownReport, Error> {
    check_space_range(arch, mm, range)?;
    space_caller(arch, mm)?;
    flush_pages(arch, mm, range)
}

/// Flushes every entry of `mm` on every CPU that may cache it, now.
/// Errors: [`Error::UntrackedRoot`] (as for [`flush_tlb_page`]) and those
/// of [`shootdown`] (nothing flushed).
pub fn flush_tlb_mm<A: Arch>(arch: &A, mm: &MmTlbState) -> Result<ShootdownReport, Error> {
    space_caller(arch, mm)?;
    shootdown(arch, &mm.flush_targets(arch), &FlushRequest::for_asid(mm.asid))
}
