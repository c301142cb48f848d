//! [`quiescent_flush`]: a CPU's own flush at a point where it is cheap,
//! which pays what the pools' generations owe it without an IPI.

use crate::arch::Arch;
use crate::cpuset::CpuId;
use crate::stats::{Counter, FlushExtent, FlushReason, TraceEvent};

/// Drops every non-global entry of this CPU and records the epoch read
/// before it: every pooled generation up to that epoch is then flushed
/// here.
pub(super) fn local_pass<A: Arch>(arch: &A, me: CpuId) {
    crate::shootdown::flush_local_all_as_pass(arch, me, false);
    arch.trace(&TraceEvent {
        cpu: me,
        reason: FlushReason::Quiescent,
        extent: FlushExtent::All,
    });
}

/// The hook a kernel calls where a CPU can flush its own TLB cheaply: its
/// timer tick, idle entry, or exit from idle. If a [`FramePool`](crate::FramePool) counted
/// this CPU among those that may cache a generation it has not flushed
/// past yet, it drops every non-global entry ([`Arch::flush_local_all`])
/// and records that, so the pool can hand those frames back without an
/// IPI. Otherwise, and on a CPU in lazy TLB mode (which every pooled
/// generation counts as clear), it does nothing (a few loads). Returns
/// whether it flushed (false too on a CPU that [`Arch::current_cpu`]
/// cannot tell: no pool counts it).
///
/// Safe anywhere the CPU may flush its own TLB, interrupt handlers
/// included; the caller must not migrate during the call. A tick that
/// reaches a CPU already out of the online set (between
/// [`take_cpu_offline`](crate::take_cpu_offline) and its halt) is harmless
/// too: whatever this does, [`prepare_cpu_online`](crate::prepare_cpu_online)
/// flushes everything again before the CPU runs anything.
pub fn quiescent_flush<A: Arch>(arch: &A) -> bool {
    let state = arch.shootdown_state();
    let Ok(me) = arch.current_cpu() else {
        return false;
    };
    // A lazy CPU is clear of every generation already (it catches up by
    // generation before it runs user code): its tick need not flush.
    if !state.flush_owed(me) || state.is_lazy(me) {
        return false;
    }
    local_pass(arch, me);
    state.count(Counter::QuiescentFlushes, 1);
    true
}
