//! Lazy TLB mode: a CPU that stops running user code keeps the space
//! loaded, is skipped by its flushes, and catches up by generation when it
//! resumes.

use super::{catch_up, MmTlbState};
use crate::arch::Arch;
use crate::cpuset::CpuId;
use crate::lifecycle::online_caller;
use crate::sync::{fence, Ordering};
use crate::Error;

/// Ends lazy mode on `mm`, the loaded space: flushes of it reach this CPU
/// again from the moment the mark is gone, and what they skipped is caught
/// up before returning.
pub(super) fn leave_lazy<A: Arch>(arch: &A, me: CpuId, mm: &MmTlbState) -> bool {
    let state = arch.shootdown_state();
    state.set_lazy(me, false);
    // Pairs with `flush_targets`' fence: a flusher that still saw the mark
    // advanced the generation before reading it, so the check sees it.
    fence(Ordering::SeqCst);
    catch_up(arch, me, mm)
}

/// Lazy TLB mode: call it on a CPU that stops running user code but keeps
/// `mm`, the user space it has loaded, loaded (it goes idle, or runs a
/// kernel thread that borrows the space, as Linux's `enter_lazy_tlb`).
/// From then on flushes of `mm` skip this CPU ([`MmTlbState::flush_targets`])
/// except those that free page tables (and a teardown with a
/// [`TableHold`](crate::TableHold) skips it then too, keeping the tables
/// until it has passed), and the CPU catches up by
/// generation when it resumes ([`leave_lazy_tlb`], or [`switch_mm`](super::switch_mm) to any
/// space).
///
/// The caller guarantees that the CPU runs no code that uses `mm`'s user
/// mappings until then: its entries for pages unmapped meanwhile survive,
/// and their frames may be freed and reused (contract rule 2 holds because
/// the CPU cannot use them, and flushes them before it can).
///
/// Errors: [`Error::NotLoaded`] when `mm` is not the user space this CPU
/// has loaded (according to [`switch_mm`](super::switch_mm)): nothing changes;
/// [`Error::CpuNotOnline`] and the error of [`Arch::current_cpu`], as for
/// [`switch_mm`](super::switch_mm).
pub fn enter_lazy_tlb<A: Arch>(arch: &A, mm: &MmTlbState) -> Result<(), Error> {
    let me = check_loaded(arch, mm)?;
    arch.shootdown_state().set_lazy(me, true);
    Ok(())
}

/// Leaves lazy TLB mode on `mm`, the space this CPU has loaded, before it
/// runs user code again: if `mm` was flushed while this CPU was lazy, its
/// ASID is flushed here, locally. Returns whether it flushed (false also
/// for a CPU that was not lazy). Switching to another space with
/// [`switch_mm`](super::switch_mm) leaves lazy mode as well.
///
/// Errors: [`Error::NotLoaded`] when `mm` is not the user space this CPU
/// has loaded: nothing changes;
/// [`Error::CpuNotOnline`] and the error of [`Arch::current_cpu`], as for
/// [`switch_mm`](super::switch_mm).
pub fn leave_lazy_tlb<A: Arch>(arch: &A, mm: &MmTlbState) -> Result<bool, Error> {
    let me = check_loaded(arch, mm)?;
    if !arch.shootdown_state().is_lazy(me) {
        return Ok(false);
    }
    Ok(leave_lazy(arch, me, mm))
}

fn check_loaded<A: Arch>(arch: &A, mm: &MmTlbState) -> Result<CpuId, Error> {
    let me = online_caller(arch)?;
    let loaded = arch.shootdown_state().loaded_asid(me);
    if mm.is_kernel() || loaded != Some(mm.asid) || !mm.cpus.load(Ordering::SeqCst).contains(me) {
        return Err(Error::NotLoaded { cpu: me.index() });
    }
    Ok(me)
}
