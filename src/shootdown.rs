//! The cross-CPU shootdown protocol.
//!
//! Every CPU owns one *request slot* (the request it is currently asking
//! others to carry out) and one *inbox* (the set of CPUs whose slots hold a
//! request for it). All of it lives in one [`TlbShootdown`] value, normally
//! a `static`, so the protocol never allocates.
//!
//! An initiator writes its request into its slot, sets its bit in every
//! target's inbox, sends an IPI to the targets whose inbox had no interrupt
//! on the way already, flushes itself locally, and waits until every target
//! acknowledged. A target's interrupt handler empties its inbox and carries
//! out every request it finds there, so one interrupt serves any number of
//! coalesced requests. While an initiator waits it empties its own inbox
//! too: two CPUs shooting at each other with interrupts disabled each serve
//! the other's request, and neither waits forever.

use crate::arch::Arch;
use crate::asid::Asid;
use crate::cpuset::{CpuId, CpuSet};
use crate::lifecycle::online_caller;
use crate::page_size::PageSize;
use crate::percpu::{Payload, TlbShootdown};
use crate::request::{FlushRequest, FlushScope};
use crate::stats::{Counter, FlushExtent, FlushReason, TraceEvent};
use crate::sync::{fence, AtomicU32, Ordering};
use crate::validate::check_request;
use crate::Error;

/// What one shootdown did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShootdownReport {
    /// Remote CPUs asked to flush by IPI, each acknowledged before return
    /// (0 for a broadcast, which asks no CPU: the hardware reaches them).
    pub remote_cpus: usize,
    /// IPIs sent: at most `remote_cpus`, fewer when an interrupt was already
    /// on its way to a target and the request rode along with it.
    pub ipis_sent: usize,
    /// Whether the calling CPU ran a local flush of its own (false for a
    /// broadcast, whose invalidation covers the calling CPU too).
    pub flushed_locally: bool,
    /// Whether the flush went through broadcast invalidation (no IPIs).
    pub broadcast: bool,
}

impl ShootdownReport {
    /// Whether the flush reached no CPU: no IPI, no local flush, no
    /// broadcast. Right when no CPU runs the address space, or when there
    /// was nothing to flush: an empty request, or a batch that owes nothing
    /// (its unmaps flushed at once, as they do when no other CPU runs the
    /// space: [`TlbFlushUnmapBatch::is_empty`](crate::TlbFlushUnmapBatch::is_empty)).
    /// From a CPU that runs the space, with a flush owed, a sign that the
    /// crate does not know it does (a root loaded without
    /// [`switch_mm`](crate::switch_mm), which the crate refuses where
    /// [`Arch::root_loaded`] can tell).
    pub fn reached_no_cpu(&self) -> bool {
        self.remote_cpus == 0 && !self.flushed_locally && !self.broadcast
    }
}

/// Invalidates what `request` names on every CPU of `targets` (offline CPUs
/// are ignored) and returns once all of them have done so. The calling CPU
/// flushes itself locally, without an IPI.
///
/// Callers run with preemption disabled; interrupts may be off. Errors,
/// each with nothing flushed and the flush still owed by the caller:
/// [`Error::ShootdownReentered`] when the shootdown needs this CPU's slot
/// (it interrupts other CPUs) and the slot is already in use (the call came
/// from an interrupt that interrupted a shootdown on the same CPU); a
/// shootdown that reaches only this CPU, or goes by broadcast invalidation,
/// takes no slot and does not fail so; [`Error::NonCanonical`] and [`Error::AsidOutOfRange`] for a
/// request the architecture cannot carry out ([`check_request`]);
/// [`Error::CpuNotOnline`] on a CPU outside [`Arch::online_cpus`] (the
/// flush would skip the caller's own TLB), and the error of
/// [`Arch::current_cpu`] when the calling CPU cannot be told.
pub fn shootdown<A: Arch>(
    arch: &A,
    targets: &CpuSet,
    request: &FlushRequest,
) -> Result<ShootdownReport, Error> {
    check_request(arch, request)?;
    let mut report = ShootdownReport::default();
    if request.is_empty() {
        return Ok(report);
    }
    let state = arch.shootdown_state();
    let me = online_caller(arch)?;
    // Held from before the online set is read until every target read in
    // it has the request in its inbox, so that a CPU leaving the online
    // set meanwhile waits for this publication ([`Choosing`]).
    let choosing = Choosing::enter(state, me);
    let targets = targets.intersection(&arch.online_cpus());
    if targets.is_empty() {
        return Ok(report);
    }
    let remote = targets.difference(&CpuSet::single(me));

    // A flush that reaches no other CPU is a local one, whatever the
    // hardware offers.
    if A::BROADCAST_INVALIDATE && !remote.is_empty() && arch.prefer_broadcast(remote.len(), request) {
        // Publishes to no inbox: the hardware reaches every CPU, online or
        // not.
        drop(choosing);
        issue_broadcast(arch, state, request);
        return Ok(complete_broadcast(arch, me, request));
    }

    if !remote.is_empty() {
        report.ipis_sent = publish(arch, state, me, &remote, Payload::Flush(request))?;
        report.remote_cpus = remote.len();
    }
    drop(choosing);
    state.count(Counter::Shootdowns, 1);

    if targets.contains(me) {
        let reason = match request.scope() {
            FlushScope::Ranges(_) => FlushReason::LocalShootdown,
            _ => FlushReason::LocalMmShootdown,
        };
        execute_local(arch, state, me, request, reason);
        report.flushed_locally = true;
    }

    if !remote.is_empty() {
        wait_for_acks(arch, state, me);
    }
    Ok(report)
}

/// Interrupts every other online CPU and waits until each has taken the
/// interrupt (or served the request from a wait loop), flushing nothing.
///
/// A CPU that walks page tables locklessly with interrupts disabled (like
/// Linux's fast GUP) cannot take the interrupt until its walk is over, so
/// when this returns no such walk that started before the call is still
/// running: page-table frames detached before the call may then be freed.
/// Broadcast-invalidation hardware needs this too, since its flushes do
/// not interrupt anyone. Errors: [`Error::ShootdownReentered`], as for
/// [`shootdown`].
pub fn ipi_sync<A: Arch>(arch: &A) -> Result<ShootdownReport, Error> {
    let state = arch.shootdown_state();
    let me = online_caller(arch)?;
    // As in `shootdown`: a CPU leaving the online set waits for this
    // publication if the read below still sees it.
    let choosing = Choosing::enter(state, me);
    let remote = arch.online_cpus().difference(&CpuSet::single(me));
    if remote.is_empty() {
        return Ok(ShootdownReport::default());
    }
    let ipis_sent = publish(arch, state, me, &remote, Payload::Sync)?;
    drop(choosing);
    wait_for_acks(arch, state, me);
    Ok(ShootdownReport {
        remote_cpus: remote.len(),
        ipis_sent,
        flushed_locally: false,
        broadcast: false,
    })
}

/// The calling CPU's mark that it is choosing targets from the online set:
/// taken before the read ([`enter`](Self::enter)), dropped once every
/// target it read there has the request in its inbox, or once it knows it
/// publishes nothing (each early return drops it too).
///
/// This is what lets a CPU leave the online set without stranding a
/// request: an initiator that read the set while the CPU was still in it
/// has its mark up until it published, and
/// [`take_cpu_offline`](crate::take_cpu_offline) on the leaving CPU
/// serves its inbox until it has seen every other CPU's mark down. The
/// mark is a count, not a flag, because an interrupt handler may start a
/// shootdown of its own while the interrupted code holds the mark; it
/// takes no request slot, so a shootdown that needs none (local-only, or
/// broadcast) still works from such a handler.
struct Choosing<'a> {
    count: &'a AtomicU32,
}

impl<'a> Choosing<'a> {
    fn enter(state: &'a TlbShootdown, me: CpuId) -> Self {
        let count = &state.cpus[me.index()].choosing;
        // Only this CPU, and handlers nested on it, change its own count,
        // in program order; the fence below puts it before the online
        // read for the CPUs that look at it.
        count.fetch_add(1, Ordering::Relaxed);
        // Store-buffering pair with the fence in `take_cpu_offline`
        // (whose CPU removed itself from the online set before it): in the
        // fences' single total order either this one comes first, and the
        // leaving CPU's read of the count sees it up, or that one does,
        // and the online read below sees the removal. A SeqCst increment
        // and online read would say the same on paper, but the caller's
        // `Arch` chooses the online read's ordering, and loom models only
        // SeqCst fences as such (loom: model (offline) hangs without
        // either fence).
        fence(Ordering::SeqCst);
        Choosing { count }
    }
}

impl Drop for Choosing<'_> {
    fn drop(&mut self) {
        // Lowered only after the last inbox insertion (loom: model
        // (offline) hangs when the mark comes down before `publish`).
        // Release: a leaving CPU that reads the count at zero (acquire)
        // then sees every insertion made under the mark, so its last
        // serve of its inbox finds them. Without it that serve's take
        // could come before an insertion in the inbox's modification
        // order; loom, whose read-modify-writes always read the newest
        // value, cannot show that (model (offline) passes with this
        // Relaxed).
        self.count.fetch_sub(1, Ordering::Release);
    }
}

/// Puts `payload` in this CPU's slot and in the inbox of every CPU of
/// `remote`, interrupting those without an interrupt already on its way.
/// Returns the number of IPIs sent.
fn publish<A: Arch>(
    arch: &A,
    state: &TlbShootdown,
    me: CpuId,
    remote: &CpuSet,
    payload: Payload<'_>,
) -> Result<usize, Error> {
    let slot = &state.cpus[me.index()].slot;
    // Only this CPU touches its own slot; the orderings keep the slot's
    // writes after the claim (and the wait before the release) against an
    // interrupt handler on this same CPU, which loom cannot model.
    if slot.busy.swap(true, Ordering::Acquire) {
        return Err(Error::ShootdownReentered { cpu: me.index() });
    }
    slot.write(payload);
    // `remote.len()` <= MAX_CPUS, far below u32::MAX.
    slot.remaining.store(remote.len() as u32, Ordering::Relaxed);
    let mut need_ipi = CpuSet::new();
    for t in remote {
        let target = &state.cpus[t.index()];
        // Both halves matter: the release publishes the slot's contents to
        // the handler's take; the acquire (with the take's release) makes
        // the `ipi_pending` handshake below sound, so that a request whose
        // swap finds the flag set is surely seen by the handler that clears
        // it (loom: models (a), (b), (c) fail when this is Relaxed; a lost
        // IPI from weakening the handshake itself is beyond loom, which
        // always reads the newest value in a read-modify-write).
        target.inbox.insert(me, Ordering::SeqCst);
        // Only one IPI per target is needed until its handler runs: the
        // handler clears `ipi_pending` before emptying the inbox, so a
        // request that finds it set is seen by that handler.
        if !target.ipi_pending.swap(true, Ordering::SeqCst) {
            need_ipi.insert(t);
        }
    }
    if !need_ipi.is_empty() {
        state.count(Counter::IpisSent, need_ipi.len() as u64);
        let extent = match payload {
            Payload::Flush(request) => extent_of(request),
            Payload::Sync => FlushExtent::Pages(0),
        };
        arch.trace(&TraceEvent {
            cpu: me,
            reason: FlushReason::RemoteSendIpi,
            extent,
        });
        arch.send_flush_ipi(&need_ipi);
    }
    Ok(need_ipi.len())
}

/// Runs `f` with this CPU's request slot taken, as if `f` were an interrupt
/// handler that arrived while this CPU was in the middle of a shootdown:
/// every shootdown `f` starts on this CPU fails with
/// [`Error::ShootdownReentered`], exactly as such a handler's would. The
/// mock machine's fault injection
/// ([`MockCpu::in_shootdown`](crate::arch::mock::MockCpu::in_shootdown)).
/// Errors: [`Error::ShootdownReentered`] when the slot is already taken.
#[cfg(feature = "mock")]
pub(crate) fn with_slot_taken<A: Arch, R>(arch: &A, f: impl FnOnce() -> R) -> Result<R, Error> {
    let me = arch.current_cpu()?;
    let slot = &arch.shootdown_state().cpus[me.index()].slot;
    if slot.busy.swap(true, Ordering::Acquire) {
        return Err(Error::ShootdownReentered { cpu: me.index() });
    }
    let result = f();
    slot.busy.store(false, Ordering::Release);
    Ok(result)
}

/// Waits until every target acknowledged this CPU's request, serving this
/// CPU's own inbox meanwhile, then frees the slot.
fn wait_for_acks<A: Arch>(arch: &A, state: &TlbShootdown, me: CpuId) {
    let slot = &state.cpus[me.index()].slot;
    // Acquires the targets' flushes with their acknowledgements (loom:
    // every model fails when this is Relaxed).
    while slot.remaining.load(Ordering::Acquire) != 0 {
        service_inbox(arch, state, me);
        arch.relax();
    }
    slot.busy.store(false, Ordering::Release);
}

/// The flush-IPI handler: the kernel calls it from its interrupt vector for
/// the flush IPI, on the interrupted CPU, then signals end of interrupt.
/// Carries out every request waiting for this CPU (several coalesced
/// requests are served by one call) and returns how many it served; zero is
/// normal when a waiting initiator already took them.
///
/// On a CPU that [`Arch::current_cpu`] cannot tell it serves nothing and
/// returns zero: no initiator can have chosen it, since initiators read
/// their targets from the online CPUs, which are all told.
pub fn handle_flush_ipi<A: Arch>(arch: &A) -> usize {
    match arch.current_cpu() {
        Ok(me) => service_inbox(arch, arch.shootdown_state(), me),
        Err(_) => 0,
    }
}

pub(crate) fn service_inbox<A: Arch>(arch: &A, state: &TlbShootdown, me: CpuId) -> usize {
    let cpu = &state.cpus[me.index()];
    // Clear first: a request published after this store sends a new IPI or
    // is found by the take below.
    cpu.ipi_pending.store(false, Ordering::SeqCst);
    // Acquires the requests' slots; its release half is the handler's side
    // of the `ipi_pending` handshake (loom: models (a), (b), (c)).
    let initiators = cpu.inbox.take(Ordering::SeqCst);
    let mut served = 0;
    for from in &initiators {
        let slot = &state.cpus[from.index()].slot;
        if let Some(request) = slot.read() {
            execute_local(arch, state, me, &request, FlushReason::RemoteShootdown);
        }
        // Counted before the acknowledgement, which releases it: an
        // initiator that saw its request done sees it counted too.
        state.count(Counter::FlushesReceived, 1);
        // Acknowledge only after the flush; the initiator may reuse the
        // slot as soon as the count reaches zero. The release carries the
        // flush to the initiator's acquire (loom: every model fails when
        // this is Relaxed; the threaded test
        // `no_target_still_caches_the_entry_when_the_shootdown_returns`
        // fails when the acknowledgement comes first).
        slot.remaining.fetch_sub(1, Ordering::Release);
        served += 1;
    }
    served
}

fn extent_of(request: &FlushRequest) -> FlushExtent {
    match request.scope() {
        FlushScope::Ranges(_) => FlushExtent::Pages(request.pages()),
        _ => FlushExtent::All,
    }
}

/// Drops every non-global entry of the calling CPU's TLB (the global ones
/// too with `include_global`) and records that as a pass: the CPU holds no
/// entry for the frames of any [`FramePool`](crate::FramePool) generation
/// published before the flush. Counts one local full flush; tracing is
/// left to the caller, which knows why it flushed.
pub(crate) fn flush_local_all_as_pass<A: Arch>(arch: &A, me: CpuId, include_global: bool) {
    let state = arch.shootdown_state();
    // The epoch must be read before the flush, not after. A generation's
    // epoch is published only once its PTEs are cleared (or, for an aged
    // generation, once their accessed bits were, and the unmap found them
    // still clear), so a CPU that read epoch e and then dropped every
    // non-global entry cannot hold an entry for the frames of any
    // generation up to e: what it cached went with the flush, and anything
    // it refilled later was walked from the cleared PTEs (or would have set
    // the accessed bit the unmap found clear). Read after the flush, the epoch may belong to a generation
    // whose PTEs were cleared after the flush, by which time the CPU may
    // have refilled an entry for one of its pages; passing that epoch
    // would release the frame while the entry survives.
    let epoch = state.epoch();
    arch.flush_local_all(include_global);
    state.pass(me, epoch);
    state.count(Counter::LocalFullFlushes, 1);
}

/// Carries out `request` on the calling CPU only.
pub(crate) fn execute_local<A: Arch>(
    arch: &A,
    state: &TlbShootdown,
    me: CpuId,
    request: &FlushRequest,
    reason: FlushReason,
) {
    let loaded = state.loaded_asid(me);
    let tagged = arch.tagged_tlb();
    // Without tagged TLBs a CPU holds entries only of the loaded address
    // space (and global ones): switching flushed the rest. With no record
    // of what is loaded, assume it could be anything.
    let may_hold = |asid: Asid| asid.is_kernel() || tagged || loaded.is_none_or(|l| l == asid);
    let extent = match request.scope() {
        FlushScope::Ranges(ranges) => {
            let mut pages = 0usize;
            let hints = request.leaf_hints();
            for r in ranges.iter().filter(|r| may_hold(r.asid)) {
                let leaf = hints.then_some(r.stride);
                for va in r.addresses() {
                    arch.flush_local_page_sized(r.asid, va, leaf);
                }
                pages += r.pages as usize;
            }
            // Every page each step's flush cleared is flushed here: a CPU
            // caught up to a step's start is caught up to its end.
            let passed = state.passed_epoch(me);
            for (asid, step) in request.steps().filter(|(a, _)| may_hold(*a)) {
                state.asid_slots(me).follow(asid, step, passed);
            }
            state.count(Counter::LocalPageFlushes, pages as u64);
            FlushExtent::Pages(pages)
        }
        FlushScope::Asids(asids) => {
            // Without tagged TLBs a CPU holds non-global entries of the
            // loaded space only: flushing that one is a full flush, and a
            // pass for pooled frames (epoch read before the flush).
            let epoch = state.epoch();
            let whole = !tagged && loaded.is_some_and(|l| asids.contains(&l));
            let mut n = 0;
            for &asid in asids {
                if asid.is_kernel() {
                    arch.flush_local_all(true);
                    n += 1;
                } else if may_hold(asid) {
                    arch.flush_local_asid(asid);
                    // Caught up on that ASID as of the epoch read before.
                    state.asid_slots(me).raise(asid, epoch);
                    n += 1;
                }
            }
            if whole {
                state.pass(me, epoch);
            }
            state.count(Counter::LocalFullFlushes, n);
            FlushExtent::All
        }
        FlushScope::Everything { include_global } => {
            // Every non-global entry goes: a pass for pooled frames.
            flush_local_all_as_pass(arch, me, include_global);
            FlushExtent::All
        }
    };
    arch.trace(&TraceEvent {
        cpu: me,
        reason,
        extent,
    });
}

/// Issues the broadcast invalidations `request` names, without waiting for
/// them ([`complete_broadcast`] does).
fn issue_broadcast<A: Arch>(arch: &A, state: &TlbShootdown, request: &FlushRequest) {
    match request.scope() {
        FlushScope::Ranges(ranges) => {
            let hints = request.leaf_hints();
            for r in ranges {
                let leaf = hints.then_some(r.stride);
                for va in r.addresses() {
                    arch.broadcast_flush_page_sized(r.asid, va, leaf);
                }
            }
            state.count(Counter::LocalPageFlushes, request.pages() as u64);
        }
        FlushScope::Asids(asids) => {
            for &asid in asids {
                if asid.is_kernel() {
                    arch.broadcast_flush_all(true);
                } else {
                    arch.broadcast_flush_asid(asid);
                }
            }
            state.count(Counter::LocalFullFlushes, asids.len() as u64);
        }
        FlushScope::Everything { include_global } => {
            arch.broadcast_flush_all(include_global);
            state.count(Counter::LocalFullFlushes, 1);
        }
    }
}

/// Issues one page's broadcast invalidation as a batch records it
/// ([`Arch::BATCH_BROADCAST_ON_ADD`]); [`complete_broadcast`] on the same
/// CPU completes it. `leaf`: the size of the leaf entry that mapped the
/// page, when known (see [`Arch::flush_local_page_sized`]).
pub(crate) fn issue_broadcast_page<A: Arch>(arch: &A, asid: Asid, va: u64, leaf: Option<PageSize>) {
    arch.broadcast_flush_page_sized(asid, va, leaf);
    arch.shootdown_state().count(Counter::LocalPageFlushes, 1);
}

/// Waits until every broadcast invalidation the calling CPU issued, those
/// of `request` among them, has taken effect on every CPU: the end of a
/// broadcast shootdown, counted as one.
pub(crate) fn complete_broadcast<A: Arch>(arch: &A, me: CpuId, request: &FlushRequest) -> ShootdownReport {
    let state = arch.shootdown_state();
    state.count(Counter::Shootdowns, 1);
    state.count(Counter::Broadcasts, 1);
    arch.broadcast_sync();
    arch.trace(&TraceEvent {
        cpu: me,
        reason: FlushReason::LocalShootdown,
        extent: extent_of(request),
    });
    ShootdownReport {
        broadcast: true,
        ..ShootdownReport::default()
    }
}
