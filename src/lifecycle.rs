//! A CPU leaving the online set: [`take_cpu_offline`], the counterpart of
//! [`prepare_cpu_online`](crate::prepare_cpu_online).
//!
//! Shootdowns reach the CPUs of [`Arch::online_cpus`], read once per
//! shootdown. A CPU that leaves the set can still be a target of an
//! initiator that read the set a moment before: that initiator puts its
//! request in the leaving CPU's inbox afterwards and waits for the
//! acknowledgement. Serving the inbox once after leaving is not enough,
//! since the request may arrive after that serve. So every initiator keeps
//! a per-CPU mark up from before its read of the online set until it has
//! published to every target it read there (the `Choosing` guard in
//! `shootdown.rs`), and the leaving CPU serves its inbox until it has seen
//! every other CPU's mark down once. After that no initiator that saw it
//! online can still publish to it, and every request that did reach it has
//! been served and acknowledged.

use crate::arch::Arch;
use crate::cpuset::CpuId;
use crate::shootdown::service_inbox;
use crate::sync::{fence, Ordering};
use crate::Error;

/// The calling CPU, for a crate function about to change what CPUs may
/// cache or to send flushes: [`Arch::current_cpu`], refused with
/// [`Error::CpuNotOnline`] when the CPU is not in [`Arch::online_cpus`].
/// Shootdowns reach the online CPUs only, the caller's own flush included,
/// so a CPU outside the set that unmapped a page would keep its own stale
/// entry, and one that loaded an address space would be missed by every
/// flush of it.
pub(crate) fn online_caller<A: Arch>(arch: &A) -> Result<CpuId, Error> {
    let me = arch.current_cpu()?;
    if !arch.online_cpus().contains(me) {
        return Err(Error::CpuNotOnline { cpu: me.index() });
    }
    Ok(me)
}

/// Takes the running CPU out of the online set and waits until no
/// shootdown can still be waiting for it, serving and acknowledging every
/// request that reaches it meanwhile; returns how many requests it served.
///
/// `leave` removes `cpu` (the running CPU) from the set
/// [`Arch::online_cpus`] reads, and returns whether it was in it: an
/// `Arch`'s own offline path passes its removal here (the hardware
/// `Arch`s' `take_offline` methods and the mock machine's
/// `MockCpu::take_offline` do). Call it on the CPU that goes offline,
/// with interrupts off, from its offline path, not from an interrupt
/// handler.
///
/// When it returns `Ok`, no initiator waits for this CPU, none will (every
/// initiator that could still see it online has published its request and
/// had it served), and no [`FramePool`](crate::FramePool) generation counts
/// it. Until it comes back through the `Arch`'s online path (which runs
/// [`prepare_cpu_online`] before it rejoins) the CPU gets no flush
/// requests, so its TLB may keep entries for pages that are unmapped and
/// freed meanwhile. The kernel therefore guarantees that from here on it
/// runs nothing that uses those entries: no user code, no access to memory
/// that may be unmapped while it is away, no crate function but
/// [`prepare_cpu_online`], and no interrupt handler that does any of this
/// (in practice it parks: `cli; hlt` in a loop, or the firmware's CPU_OFF).
/// Before calling this it loads the kernel's address space
/// ([`switch_mm`](crate::switch_mm) to the kernel's [`MmTlbState`], as
/// Linux's offline path switches to `init_mm`), whose page tables are not
/// freed while it is away: no shootdown or [`ipi_sync`](crate::ipi_sync)
/// reaches it to say that a table it could walk is gone. A CPU the crate
/// records as running a user space is refused. A flush IPI sent to it in the last
/// moments may still be latched at its interrupt controller when it comes
/// back; the handler then finds nothing to do.
///
/// Errors, with nothing changed (the CPU stays online): the error of
/// [`Arch::current_cpu`] when the CPU cannot be told;
/// [`Error::ShootdownReentered`] when this CPU is inside a shootdown or
/// [`ipi_sync`](crate::ipi_sync) of its own (the call comes from an
/// interrupt handler that interrupted one): the CPU would park with that
/// shootdown unfinished; [`Error::UserSpaceLoaded`] when the CPU's last
/// [`switch_mm`](crate::switch_mm) loaded a user space (lazy or not):
/// switch to the kernel's first; [`Error::CpuNotOnline`] when `leave` says the CPU
/// was not online. [`Error::CpuStillOnline`] when `leave` returned `true`
/// but `online_cpus` still contains the CPU (it removed it from another
/// set): nothing was served, the CPU is still a target, and it must not
/// park.
///
/// [`MmTlbState`]: crate::MmTlbState
/// [`prepare_cpu_online`]: crate::prepare_cpu_online
pub fn take_cpu_offline<A: Arch>(arch: &A, leave: impl FnOnce(CpuId) -> bool) -> Result<usize, Error> {
    let state = arch.shootdown_state();
    let me = arch.current_cpu()?;
    let own = &state.cpus[me.index()];
    // Only this CPU (and handlers nested on it, which cannot be running
    // while this code runs) sets its own slot and mark, so what it reads
    // here stays true until it changes them itself.
    if own.slot.busy.load(Ordering::Relaxed) || own.choosing.load(Ordering::Relaxed) != 0 {
        return Err(Error::ShootdownReentered { cpu: me.index() });
    }
    // A user space loaded here (lazily or not) would stay loaded while no
    // flush reaches this CPU: its page tables may be freed meanwhile, and
    // the MMU may walk them speculatively. Only this CPU's `switch_mm` and
    // `prepare_cpu_online` change its record, so it holds from here on.
    if state.loaded_asid(me).is_some_and(|a| !a.is_kernel()) {
        return Err(Error::UserSpaceLoaded { cpu: me.index() });
    }
    if !leave(me) {
        return Err(Error::CpuNotOnline { cpu: me.index() });
    }
    // Store-buffering pair with the fence in `Choosing::enter`, which each
    // initiator runs after raising its mark and before reading the online
    // set. In the fences' single total order, either that fence comes
    // after this one, so the initiator's online read sees this CPU gone
    // and it never publishes here, or it comes before, so the reads of
    // the marks below see that initiator's mark up (or a later value)
    // (loom: model (offline) hangs without either fence).
    fence(Ordering::SeqCst);
    if arch.online_cpus().contains(me) {
        return Err(Error::CpuStillOnline { cpu: me.index() });
    }
    let mut served = 0;
    for (index, cpu) in state.cpus.iter().enumerate() {
        if index == me.index() {
            continue;
        }
        // Acquire: reading zero after a mark that was up synchronizes with
        // the release that lowered it, so the initiator's inbox insertions
        // are visible to the serve below and to the last one (beyond loom,
        // like that release: see `Choosing`'s drop). A mark is up only
        // from an initiator's online read to its last inbox insertion, a
        // short stretch with no waiting in it, and down while the
        // initiator waits for its acknowledgements, so reading it down
        // once comes soon even on a CPU that shoots back to back.
        // Meanwhile this CPU serves what arrives: those acknowledgements
        // may be what the initiator waits for.
        while cpu.choosing.load(Ordering::Acquire) != 0 {
            served += service_inbox(arch, state, me);
            arch.relax();
        }
    }
    // Every initiator that read the online set with this CPU in it has
    // published by now, and each publication is visible here: this serve
    // takes whatever the inbox still holds, and nothing arrives after it.
    // Its clearing of `ipi_pending` comes after every such initiator's
    // setting of it too, so the CPU leaves with the flag down: an IPI
    // latched for it that is lost while it is away (an INIT, a CPU_OFF)
    // costs nothing, since the first request after it comes back sends a
    // new one.
    served += service_inbox(arch, state, me);
    Ok(served)
}
