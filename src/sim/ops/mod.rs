//! An operation model for fuzzing and property tests: a sequence of
//! [`Op`]s run on a small mock machine by a driver that behaves as a kernel
//! using the crate would, with the oracle consulted after every step.
//!
//! What it covers: three CPUs, any of which initiates; two user address
//! spaces and the kernel's (whose last page is the last page of the address
//! space); maps (a CPU running the space reads the new page, as after the
//! fault that made it), shared mappings, accesses (each maybe followed by
//! the CPU's timer tick) and switches; the low-level API
//! ([`try_to_unmap`](crate::try_to_unmap) into one of two
//! [`TlbFlushUnmapBatch`](crate::TlbFlushUnmapBatch)es, with and without
//! [`TtuFlags::IGNORE_ACCESS`](crate::TtuFlags::IGNORE_ACCESS), aging,
//! flush, dirty flush, write-out, free) and the typed one (two
//! [`UnmapBatch`](crate::UnmapBatch)es); the reclaim, migration, mprotect
//! and teardown drivers (a reclaim's pages maybe aged first); a
//! [`FramePool`](crate::FramePool) of [`POOL_FRAMES`] frames that pooled
//! reclaims ([`shrink_page_list_pooled`](crate::shrink_page_list_pooled))
//! fill, and that CPUs' ticks ([`quiescent_flush`](crate::quiescent_flush),
//! then [`release_passed`](crate::FramePool::release_passed)), switches,
//! coming online and pool flushes (whole or oldest first) empty; failures
//! injected into flushes
//! ([`MockCpu::in_shootdown`](super::MockCpu::in_shootdown)) followed by
//! the documented retry; CPUs going offline and coming back; hostile input
//! (non-canonical addresses, ranges across the hole or past the top, ASIDs
//! wider than the hardware's), which must be refused with nothing changed;
//! and untagged or tagged TLBs, on x86 or arm64 hardware ([`Hardware`]).
//!
//! On arm64 ([`Arm64Like`](super::Arm64Like)) a batched unmap issues each
//! page's broadcast invalidation as the page is added, from the CPU that
//! adds it, and the mock applies it at that CPU's next barrier, not
//! before. The driver's batches belong to no CPU: any CPU adds to a
//! low-level or typed batch (each `Unmap`, `TypedUnmap` and `Referenced`
//! names its own) and any CPU flushes it (`Flush`, `FlushDirty`, the
//! first CPU online for a `WriteOut`, a `Free` and the end of the run).
//! That is a kernel whose task fills its batch (Linux's per-task
//! `tlb_ubc`), migrates, and flushes on another CPU, or whose batch is
//! filled by several tasks in turn: the flush then must not only wait for
//! the invalidations issued where it runs.
//!
//! The driver keeps frames the way a kernel with reference counts does: a
//! frame is freed when no mapping and no holder (a batch, a reclaim or
//! migration in progress, an I/O, the pool) is left, and only ever through
//! the crate's flush points. Every frame a reclaim is given must end freed,
//! handed back or pooled, exactly once, and every pooled frame must come
//! out of the pool exactly once; the pool is flushed at the end of a run.
//!
//! [`run`] returns the end state (which frame each page maps and how, and
//! every frame's life-cycle state), so that a batched and an unbatched run
//! of the same sequence can be compared: batching changes when TLB entries
//! go, never what ends up mapped, freed or written. Accessed bits and data
//! are left out of that comparison on purpose: a stale entry may serve an
//! access before the flush point in the batched run, which the contract
//! allows.
//! [`check`] compares the hardware the same way, on the sequence made blind
//! to accessed bits (see there why only that one).
//!
//! A third user address space maps 2 MiB regions with huge or small
//! entries and moves them between the two (splits, promotions), mixed with
//! unmaps, protections, migrations, teardowns and CPU accesses there
//! ([`huge`], [`Op::Huge`]).
//!
//! Runs reuse one machine per thread, hardware and TLB kind
//! ([`MockMachine::reset`](super::MockMachine::reset)), so a fuzzer pays for the operations, not for
//! building machines.
//!
//! With the `arbitrary` feature, [`Op`] implements `arbitrary::Arbitrary`,
//! so a fuzzer or a property test can make sequences from raw bytes.

mod backing;
pub mod concurrent;
mod driver;
pub mod huge;
mod run;

#[cfg(feature = "arbitrary")]
use std::vec::Vec;

use crate::pte::PAGE_SIZE;

pub use huge::HugeOp;
pub use run::{check, check_on, check_with, run, run_with, EndState, Failure, Hardware, Outcome, RunConfig};

/// CPUs of the modelled machine.
pub const CPUS: usize = 3;
/// User address spaces (the kernel's comes on top, as space `SPACES`).
pub const SPACES: usize = 2;
/// Pages per address space (few, so that random sequences meet often).
pub const PAGES: usize = 4;
/// Physical (data) frames: the small pages take the lowest ones, and three
/// 2 MiB frames of the huge space ([`huge`]) fit above them (aligned, so
/// from frame 512 on).
pub const FRAMES: usize = 4 * 512;
/// Batches of each kind the driver keeps at once.
pub const BATCHES: usize = 2;
/// Frames the driver's [`FramePool`](crate::FramePool) holds: fewer than
/// two reclaims' worth, so that it fills often and reclaims flush its
/// oldest generations to make room.
pub const POOL_FRAMES: usize = 6;

const BASE: u64 = 0x40_0000;
/// The kernel's pages end at the last page of the address space.
const KERNEL_TOP: u64 = !(PAGE_SIZE - 1);

/// The address of `page` in address space `space` (`SPACES` is the
/// kernel's).
pub fn va(space: usize, page: usize) -> u64 {
    if space >= SPACES {
        KERNEL_TOP - (PAGES - 1 - page % PAGES) as u64 * PAGE_SIZE
    } else {
        BASE + (page % PAGES) as u64 * PAGE_SIZE
    }
}

/// How the kernel model writes a dirty page out in a reclaim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum Io {
    /// The write completes at once.
    Synchronous,
    /// The write stays under way until an [`Op::EndIo`].
    Queued,
    /// The write cannot start.
    Failing,
}

/// Bad input an entry point must refuse with a typed error, changing
/// nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum BadInput {
    /// `add_pending` of a non-canonical address.
    AddPending,
    /// `flush_tlb_page` of a non-canonical address.
    FlushPage,
    /// `change_protection` of a range across the hole.
    Protect,
    /// `MmuGather::unmap_range` of a non-canonical range.
    Teardown,
    /// `try_to_unmap` through a reverse map that reports a non-canonical
    /// mapping after a good one.
    RmapAddress,
    /// `switch_mm` to an address space whose ASID is wider than the
    /// hardware's.
    WideAsid,
    /// A range that runs past the top of the address space.
    PastTheTop,
}

/// One step. Indices are taken modulo the model's sizes, so every value is
/// a valid step; a step whose precondition does not hold (mapping an
/// occupied page, an initiator that is offline) does nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum Op {
    /// Map a new frame at `page` of `space`; the first online CPU that runs
    /// the space (if one does) then reads it, as it would on return from
    /// the fault that asked for the page (so that pages are cached, and
    /// reclaims and the pool meet live TLB entries).
    Map {
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Whether writes are allowed.
        writable: bool,
    },
    /// Map the frame at `page` of `space` in the next user address space
    /// too.
    Share {
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
    },
    /// CPU `cpu` switches to `space` if it is a user space it does not run,
    /// then reads or writes `page`; then, when `tick`, its timer tick
    /// arrives ([`Op::Tick`]).
    Access {
        /// CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Write rather than read.
        write: bool,
        /// The CPU's timer tick follows the access.
        tick: bool,
    },
    /// CPU `cpu` switches to user space `space`; if it runs that space
    /// already, it goes lazy on it instead (idle, or a kernel thread:
    /// [`enter_lazy_tlb`](crate::enter_lazy_tlb)), and its next
    /// [`Op::Access`] resumes it through `switch_mm`.
    Switch {
        /// CPU.
        cpu: u8,
        /// Address space.
        space: u8,
    },
    /// Low-level `try_to_unmap` of the frame at `page` of `space`, from
    /// `cpu`, into low-level batch `batch`.
    Unmap {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Which batch.
        batch: u8,
        /// With [`TtuFlags::BATCH_FLUSH`](crate::TtuFlags::BATCH_FLUSH) (in
        /// a batching run).
        batched: bool,
        /// With [`TtuFlags::IGNORE_ACCESS`](crate::TtuFlags::IGNORE_ACCESS).
        ignore_access: bool,
    },
    /// Typed `UnmapBatch::try_to_unmap` into typed batch `batch`.
    TypedUnmap {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Which typed batch.
        batch: u8,
        /// With [`TtuFlags::IGNORE_ACCESS`](crate::TtuFlags::IGNORE_ACCESS).
        ignore_access: bool,
    },
    /// `page_referenced` of the frame at `page` of `space` into low-level
    /// batch `batch`.
    Referenced {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Which batch.
        batch: u8,
    },
    /// Flush low-level batch `batch` (`typed`: the typed one, whose frames
    /// are then put), with a failure injected first when `fail`, then the
    /// documented retry. In a batching run, a typed batch for which
    /// `batch / BATCHES` is odd and `fail` is not set goes into the
    /// driver's pool instead ([`FramePool::defer`](crate::FramePool::defer))
    /// when the pool takes it: its unmaps may have ignored accessed bits,
    /// unlike the reclaim driver's, which ages each page just before.
    Flush {
        /// Initiating CPU.
        cpu: u8,
        /// Which batch.
        batch: u8,
        /// The typed batch rather than the low-level one.
        typed: bool,
        /// Inject a failed flush first.
        fail: bool,
    },
    /// `flush_dirty` on a low-level or typed batch (the typed one's lent
    /// frames are written out).
    FlushDirty {
        /// Initiating CPU.
        cpu: u8,
        /// Which batch.
        batch: u8,
        /// The typed batch rather than the low-level one.
        typed: bool,
        /// Inject a failed flush first.
        fail: bool,
    },
    /// Write out an unmapped dirty frame of the low-level API (after its
    /// batches' dirty flush).
    WriteOut {
        /// Which unmapped frame.
        index: u8,
    },
    /// Free an unmapped frame of the low-level API (after its batches'
    /// flush).
    Free {
        /// Which unmapped frame.
        index: u8,
    },
    /// Reclaim the frames mapped in `space` at the pages of `pages` (a bit
    /// mask) with [`shrink_page_list`](crate::shrink_page_list), or with
    /// [`shrink_page_list_pooled`](crate::shrink_page_list_pooled) into the
    /// driver's pool when `pooled` (in a batching run: the plain run
    /// reclaims with `shrink_page_list`, which flushes at once).
    Reclaim {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Which pages (bit mask).
        pages: u8,
        /// How page-out behaves.
        io: Io,
        /// Whether the allocator refuses the batched free.
        refuse_free: bool,
        /// Inject a failed flush first, then retry.
        fail: bool,
        /// Clean unmapped frames go into the driver's pool, unflushed.
        pooled: bool,
        /// The pages were aged first ([`UnmapBatch::page_referenced`](crate::UnmapBatch::page_referenced),
        /// as Linux's scan of the active list does before pages reach the
        /// inactive one), so that pages CPUs still cache are reclaimed
        /// (and pooled) rather than found referenced.
        aged: bool,
    },
    /// A queued write-out completes.
    EndIo {
        /// Which frame under I/O.
        index: u8,
    },
    /// Migrate the frame at `page` of `space` with
    /// [`migrate_pages`](crate::migrate_pages).
    Migrate {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Whether no target frame can be allocated.
        no_memory: bool,
        /// Inject a failed flush first, then retry.
        fail: bool,
    },
    /// Write-protect pages `first..first + count` of `space` (mprotect).
    Protect {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// First page.
        first: u8,
        /// How many pages.
        count: u8,
        /// Inject a failed flush first, then retry.
        fail: bool,
    },
    /// Tear down the leaf table that holds `space`'s pages (a munmap of its
    /// whole span): every page unmapped, the table detached and freed after
    /// its flush, with [`TableFreePolicy::IpiSync`](crate::TableFreePolicy)
    /// when `cpu / CPUS` is odd and `AfterFlush` otherwise.
    Teardown {
        /// Initiating CPU (`cpu % CPUS`; the quotient picks the policy).
        cpu: u8,
        /// Address space.
        space: u8,
        /// Inject a failed flush first, then finish and retry.
        fail: bool,
    },
    /// CPU `cpu` goes offline (unless it is the last one online).
    Offline {
        /// CPU.
        cpu: u8,
    },
    /// CPU `cpu` comes back online through the kernel's online path.
    Online {
        /// CPU.
        cpu: u8,
    },
    /// Bad input given to an entry point from `cpu`.
    Hostile {
        /// Initiating CPU.
        cpu: u8,
        /// What.
        kind: BadInput,
    },
    /// CPU `cpu`'s timer tick: [`quiescent_flush`](crate::quiescent_flush),
    /// then [`FramePool::release_passed`](crate::FramePool::release_passed)
    /// of the driver's pool, whose frames are freed (a batching run only:
    /// the plain run has no pool).
    Tick {
        /// CPU.
        cpu: u8,
    },
    /// The driver's pool shot down from `cpu`:
    /// [`FramePool::flush`](crate::FramePool::flush) when `oldest` is 0
    /// modulo `POOL_FRAMES + 2`, otherwise
    /// [`flush_oldest`](crate::FramePool::flush_oldest) of that remainder
    /// less one frames; a failure injected first when `fail` (the pool
    /// must be unchanged), then the documented retry. A batching run only.
    PoolFlush {
        /// Initiating CPU.
        cpu: u8,
        /// Inject a failed flush first.
        fail: bool,
        /// The whole pool (0) or its oldest frames (see above).
        oldest: u8,
    },
    /// A step on the huge address space: 2 MiB mappings, splits,
    /// promotions, and the crate's other operations over them ([`huge`]).
    Huge(HugeOp),
}

impl Op {
    /// The same step made blind to accessed bits, or `None` for a step that
    /// is about them: unmaps ignore them, aging and reclaim (whose verdicts
    /// follow them) go, and a typed flush that would pool its batch
    /// flushes it (what a pool releases when follows them too). Accessed bits legitimately differ between a batched
    /// and an unbatched run (a stale entry serves an access without a walk,
    /// a rule-5 flush empties a TLB the other run keeps), so the two runs
    /// are compared on sequences made blind with this.
    pub fn ignoring_access(self) -> Option<Op> {
        match self {
            Op::Unmap {
                cpu,
                space,
                page,
                batch,
                batched,
                ..
            } => Some(Op::Unmap {
                cpu,
                space,
                page,
                batch,
                batched,
                ignore_access: true,
            }),
            Op::TypedUnmap {
                cpu,
                space,
                page,
                batch,
                ..
            } => Some(Op::TypedUnmap {
                cpu,
                space,
                page,
                batch,
                ignore_access: true,
            }),
            // Pooling frees frames the plain run keeps (and its releases
            // follow accessed bits): the blind run flushes instead.
            Op::Flush {
                cpu,
                batch,
                typed: true,
                fail,
            } => Some(Op::Flush {
                cpu,
                batch: (usize::from(batch) % BATCHES) as u8,
                typed: true,
                fail,
            }),
            Op::Referenced { .. } | Op::Reclaim { .. } => None,
            op => Some(op),
        }
    }
}

/// Decodes `bytes` into operations, one after another until the bytes run
/// out (so that every byte counts: `Vec::arbitrary` would read a "go on?"
/// flag before each element and stop after a couple of them).
#[cfg(feature = "arbitrary")]
#[cfg_attr(docsrs, doc(cfg(feature = "arbitrary")))]
pub fn ops_from_bytes(bytes: &[u8]) -> Vec<Op> {
    use arbitrary::Arbitrary;
    let mut u = arbitrary::Unstructured::new(bytes);
    let mut ops = Vec::new();
    while !u.is_empty() {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    ops
}
