//! The simulation: a simulated SMP machine that models real TLB behaviour,
//! a small simulated kernel on it, the frame-state oracle and the operation
//! model for fuzzing (feature `mock`). Users reach all of it through
//! [`arch::mock`](crate::arch::mock), where the simulated CPUs' [`Arch`](crate::Arch)
//! lives.
//!
//! Every host test, benchmark and fuzz target of this crate runs on it, and
//! kernels can use it in their own tests. It is a model, not a counter:
//!
//! - Each simulated CPU has a bounded TLB that fills on access by walking
//!   the simulated page tables, sets accessed and dirty bits atomically the
//!   way hardware does, and keeps stale entries until they are flushed.
//! - A write through a cached *clean* entry re-walks the page table (and
//!   faults if the PTE is gone), as on x86; [`NoRewalk`] models hardware
//!   without that guarantee, so tests can prove the crate never defers
//!   there. [`BroadcastTlbi`] models broadcast invalidation (arm64 `TLBI IS`,
//!   AMD `INVLPGB`): no IPIs, remote entries disappear at the issuing
//!   CPU's barrier and not before; [`Arm64Like`] adds arm64's batched
//!   unmap, which invalidates as pages are added and waits once.
//! - Fills set the accessed bit before they cache, as Intel and AMD
//!   document, and the x86 models say so to the crate;
//!   [`X86NoAccessedPromise`] does not (a kernel that does not claim it),
//!   and [`Model::FILL_SKIPS_ACCESSED`] makes fills that leave the bit
//!   clear, so tests can show both what a pool does without the promise
//!   and that the oracle catches a false claim.
//! - A frame-state oracle knows which frames are free, in use or under I/O
//!   and records every [`Violation`] of the safety contract: a write
//!   through a stale entry into a free or in-I/O frame, a read of a free
//!   frame, a frame freed while cached, a frame sent to I/O while cached
//!   writable.
//! - IPIs are delivered either synchronously (the target's handler runs at
//!   once, on the sender's thread) or, with [`Delivery::Threaded`] and
//!   [`MockMachine::run_threaded`], to CPUs that are real threads and take
//!   interrupts at their instruction boundaries when interrupts are enabled.
//! - A [`CostModel`] charges cycles for IPIs, invalidations and refills, kept
//!   as running totals.
//! - A switch hook ([`MockMachine::set_switch_hook`]) runs test code in
//!   the middle of an address-space switch, after the CPU loaded the new
//!   root and before [`switch_mm`](crate::switch_mm) finished recording
//!   it: the way to test a kernel's code against the CR3 window of
//!   CVE-2025-37964 (the switching CPU fills its TLB from the new tables
//!   while other CPUs unmap, flush and free).
//! - A CPU can be lazy ([`MockCpu::enter_lazy`]): it keeps a user address
//!   space loaded but runs no user code, a kernel's flush policy may skip
//!   it, and the oracle judges its stale entries when it resumes
//!   ([`MockCpu::leave_lazy`]) instead of when their frames are freed.
//!
//! Each [`MockCpu`] is one CPU's view of the machine and implements
//! [`Arch`]; many machines can run side by side in parallel tests.

mod cost;
mod counters;
mod counting;
mod cpu;
mod dormant;
mod error;
mod frames;
mod kernel;
mod lazy;
mod machine;
mod model;
pub mod ops;
mod oracle;
mod own_table;
mod space;
mod switch_hook;
mod tables;
mod threads;
mod tlb;
mod unloaded;
mod walkers;

use std::sync::{Mutex, MutexGuard, PoisonError};

pub use crate::gather::DetachedTable;
pub use cost::{CostKind, CostModel, CostTotals};
pub use counting::CountingTable;
pub use cpu::MockCpu;
pub use error::{Fault, MockError};
pub use kernel::{IoMode, MockKernel, MockRmap};
pub use machine::{IpiHook, MockMachine};
pub use model::{
    Arm64Like, BroadcastTlbi, Delivery, MockConfig, Model, NoRewalk, X86Invlpgb, X86Like,
    X86NoAccessedPromise,
};
pub use oracle::{FrameError, FrameState, Violation};
pub use own_table::MmuTable;
pub use space::MockSpace;
pub use switch_hook::SwitchHook;
pub use tlb::{TlbEntry, WalkEntry, WALK_LEVELS};
pub use walkers::LocklessWalk;

pub(crate) use lazy::Lazy;
pub(crate) use machine::{BroadcastOp, CpuState};
pub(crate) use tables::{new_root, Table, REGION_SHIFT};
pub(crate) use tlb::{region_of, Tlb, WalkFlush};

/// Locks a mutex, carrying on past poisoning (a panicking test thread must
/// not hide the state other assertions want to read).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
