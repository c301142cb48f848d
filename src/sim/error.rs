//! Why a simulated access or a machine-level operation did not go through.

use super::FrameError;
use crate::Error;

/// Why a simulated memory access did not complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// No present PTE maps the address (page fault).
    NotMapped {
        /// The faulting address.
        va: u64,
    },
    /// A write to a page mapped read-only.
    WriteProtected {
        /// The faulting address.
        va: u64,
    },
    /// The PTE is a migration entry: the access waits for the migration.
    Migration {
        /// The faulting address.
        va: u64,
    },
    /// The PTE marks a hardware-poisoned frame.
    HwPoison {
        /// The faulting address.
        va: u64,
    },
    /// The CPU is offline: it runs no code.
    CpuOffline,
    /// The CPU is lazy ([`MockCpu::enter_lazy`](super::MockCpu::enter_lazy)):
    /// it runs no user code, and `va` would have been translated through
    /// the user address space it keeps loaded. Nothing was cached, read or
    /// written.
    LazyUserAccess {
        /// The refused address.
        va: u64,
    },
    /// [`MockCpu::begin_lockless_walk`](super::MockCpu::begin_lockless_walk)
    /// on a machine with synchronous delivery (the default): a lockless
    /// walk holds interrupts off, which only threaded delivery models
    /// ([`MockConfig::threaded`](super::MockConfig::threaded)). With IPIs
    /// run at once, an IPI sync would return while the walk still runs,
    /// and a table freed after it would be reported as freed under it.
    SynchronousDelivery,
}

/// Why a machine-level operation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MockError {
    /// A frame operation was refused.
    Frame(FrameError),
    /// Bad input (unaligned address, CPU out of range, ...).
    Input(Error),
    /// The address space was not created by this machine.
    UnknownAddressSpace,
    /// A page table the kernel wrote itself has no entry for this address
    /// (the machine does not create tables in it).
    NoTable {
        /// The address.
        va: u64,
    },
    /// [`MockMachine::attach_table`](super::MockMachine::attach_table):
    /// the machine's own table for the address space already maps
    /// something.
    TableInUse,
    /// [`MockCpu::enter_lazy`](super::MockCpu::enter_lazy): the CPU has no
    /// user address space loaded to be lazy on.
    NoUserSpace,
    /// A present entry for the kernel's address space without
    /// [`PteFlags::GLOBAL`](crate::PteFlags::GLOBAL): the machine's `Arch`
    /// flushes kernel pages as INVLPG does, which reaches a kernel entry
    /// cached under an ASID that is not loaded only if it is global.
    NonGlobalKernelEntry {
        /// The address.
        va: u64,
    },
    /// [`MockMachine::new_mm`](super::MockMachine::new_mm): an address
    /// space with this ASID is still held. Two live spaces with one ASID
    /// would share TLB entries and the crate's per-ASID generations, so
    /// one could use the other's translations.
    AsidInUse {
        /// The ASID.
        asid: u16,
    },
    /// [`MockMachine::new_mm_at`](super::MockMachine::new_mm_at): an
    /// address space still held (or the kernel's) has this root. Two live
    /// states for one root would split the CPUs that run it between them.
    RootInUse {
        /// The root.
        root: u64,
    },
}

impl From<FrameError> for MockError {
    fn from(e: FrameError) -> Self {
        MockError::Frame(e)
    }
}

impl From<Error> for MockError {
    fn from(e: Error) -> Self {
        MockError::Input(e)
    }
}
