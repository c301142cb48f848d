//! The switch hook: code a test runs on a simulated CPU in the middle of
//! an address-space switch, between the hardware's load of the new root
//! and the end of [`switch_mm`](crate::switch_mm).
//!
//! On x86 the interval between writing CR3 and the kernel's bookkeeping of
//! what the CPU has loaded is a real window (CVE-2025-37964): from the
//! moment CR3 is written, the MMU may walk the new tables and cache their
//! entries (speculatively, before the CPU executes a single instruction
//! that touches user memory), while the rest of the kernel still sees the
//! CPU as it was before the switch. A kernel that reads its per-CPU
//! "loaded" state, or the address space's CPU set, to decide whom to flush
//! must get the answer right for a CPU in this window.

use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::vec::Vec;

use super::{lock, MockCpu, MockMachine, Model};

/// Code a simulated CPU runs in the middle of an address-space switch (see
/// [`MockMachine::set_switch_hook`]). It gets the switching CPU.
pub type SwitchHook<M> = Arc<dyn for<'a> Fn(&MockCpu<'a, M>) + Send + Sync>;

impl<M: Model> MockMachine<M> {
    /// Installs (or, with `None`, removes) code that runs in the window of
    /// every address-space switch: the mock's
    /// [`Arch::switch_address_space`](crate::Arch::switch_address_space)
    /// calls it after the switching CPU loaded the new root (its TLB walks
    /// the new address space from then on; an untagged TLB has already
    /// dropped its non-global entries), before it returns to
    /// [`switch_mm`](crate::switch_mm). That is, after `switch_mm` added
    /// the CPU to the new address space's set, recorded the loaded ASID and
    /// read the flush epoch, and before it records the CPU's pass (untagged
    /// TLBs) and removes it from the old address space's set. During the
    /// hook [`MockCpu::current_mm`] still reports the old address space.
    ///
    /// This is the way to test a kernel's code against the CR3 window
    /// (CVE-2025-37964): the hook can make the switching CPU touch memory
    /// (a read or write fills its TLB from the new tables, as the hardware
    /// may do speculatively as soon as the root is written; so too on a
    /// CPU leaving lazy mode by this switch, whose lazy mark the switch
    /// clears only after the hook), and drive
    /// other CPUs (`cpu.machine().cpu(1)`) through an unmap, a flush, a
    /// [`FramePool`](crate::FramePool) release or a free, with the oracle
    /// watching. It runs on every switch, through
    /// [`MockCpu::switch_to`] or a kernel's own call to `switch_mm` with a
    /// [`MockCpu`]; a switch that loads nothing (to the address space
    /// already loaded, or refused) runs no hook.
    ///
    /// A switch made while the hook runs, on the thread that runs it, runs
    /// no hook (the hook cannot recurse into itself); switches on other
    /// threads (threaded delivery) run it as usual, concurrently. The hook
    /// must be `'static`: share its state through `Arc`s, or, in a test,
    /// leak the machine (`Box::leak`) so that values that borrow it (a
    /// [`MockRmap`](super::MockRmap), a kernel's own address spaces) can
    /// move into the closure. [`reset`](Self::reset) removes it.
    pub fn set_switch_hook(&self, hook: Option<SwitchHook<M>>) {
        *lock(&self.switch_hook) = hook;
    }

    /// Runs the switch hook, if one is installed, on `cpu`, unless this
    /// thread is already running it.
    pub(crate) fn run_switch_hook(&self, cpu: &MockCpu<'_, M>) {
        let Some(hook) = lock(&self.switch_hook).clone() else {
            return;
        };
        let me = std::thread::current().id();
        {
            let mut running = lock(&self.switch_hook_threads);
            if running.contains(&me) {
                return;
            }
            running.push(me);
        }
        let _running = Running {
            threads: &self.switch_hook_threads,
            me,
        };
        hook(cpu);
    }
}

/// Marks this thread as out of the hook when dropped, also when the hook
/// panics (a test's failed assertion), so a later switch runs it again.
struct Running<'a> {
    threads: &'a Mutex<Vec<ThreadId>>,
    me: ThreadId,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        lock(self.threads).retain(|t| *t != self.me);
    }
}
