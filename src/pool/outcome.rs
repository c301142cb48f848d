//! What a [`FramePool`] reports: why it refused a batch
//! ([`PoolRefusal`]), and how its frames went back ([`PoolReleases`]).

#[allow(unused_imports)] // the docs' links
use super::{quiescent_flush, FramePool};
use crate::Error;

/// Why [`FramePool::defer`] left a batch as it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolRefusal {
    /// A frame the batch holds is still mapped somewhere (it is in use,
    /// not reclaimed): flush the batch as usual.
    StillMapped,
    /// A deferred mapping was writable or dirty: a stale entry could still
    /// write to the frame, so it must be flushed before page-out or reuse.
    Writable,
    /// The batch covers kernel pages, whose global entries a CPU's own
    /// flush of every address space keeps.
    Kernel,
    /// The pool has room for fewer frames than the batch holds (this many).
    NoRoom {
        /// Frames the pool can still take.
        room: usize,
    },
    /// The batch or the pool holds work of another machine
    /// ([`Error::OtherMachine`]).
    OtherMachine,
    /// The calling CPU may not run crate code: it is not online
    /// ([`Error::CpuNotOnline`]), or [`Arch::current_cpu`](crate::Arch::current_cpu) cannot tell it
    /// (its error).
    Caller(Error),
}

/// How a [`FramePool`]'s frames went back, in frames, since the pool was
/// made ([`FramePool::releases`]): what a kernel tunes its flush points by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PoolReleases {
    /// Released with no IPI, their generation passed before it was even
    /// pooled: every CPU it had to reach had flushed everything after the
    /// frames' aging epoch ([`Rmap::aged_epoch`](crate::Rmap::aged_epoch)).
    pub aged: u64,
    /// Released with no IPI once every CPU it had to reach had dropped its
    /// whole TLB since: [`quiescent_flush`] (a tick, idle entry), an
    /// address-space switch on an untagged TLB, a full flush it took.
    pub passes: u64,
    /// Released with no IPI while some CPU it had to reach had not flushed
    /// everything, but could not use its entries: it was lazy, or ran
    /// another address space (it flushes by generation before it loads the
    /// frames' again), or had flushed the one it runs.
    pub generations: u64,
    /// Released by a shootdown the pool sent ([`FramePool::flush`],
    /// [`FramePool::flush_oldest`]).
    pub forced: u64,
}
