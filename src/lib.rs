//! Batched TLB shootdown for Rust kernels.
//!
//! Unmapping a page that other CPUs may have cached needs a remote flush,
//! classically one inter-processor interrupt (IPI) per target CPU per page.
//! A reclaimer unmapping more than 100,000 pages a second then sends
//! hundreds of thousands of interrupts a second. This crate clears the
//! PTEs, records the pages in a [`TlbFlushUnmapBatch`], and sends one IPI
//! per target CPU per *flush point* (before a frame is freed, reused or
//! handed to I/O). On a 48-CPU machine the Linux series this follows cut
//! interrupts from about 900K/s to 60K/s and the workload's time by 25%.
//!
//! # What a kernel provides
//!
//! One implementation of [`Arch`] (current CPU, local flushes, sending the
//! flush IPI, loading an address space) and a `static` [`TlbShootdown`]. Its
//! flush-IPI vector calls [`handle_flush_ipi`]; its context switch calls
//! [`switch_mm`]; each address space embeds an [`MmTlbState`] and
//! implements [`PageTable`]; its reverse map implements [`Rmap`] (or it uses
//! [`BoundedRmap`]).
//!
//! # What it gets
//!
//! - [`UnmapBatch`]: unmap frames through the reverse map with flushes
//!   deferred, then [`flush_dirty`](UnmapBatch::flush_dirty) before writing
//!   them out and [`flush`](UnmapBatch::flush) before freeing them; a frame
//!   any of whose mappings was cleared under the batch comes back only
//!   through those calls (still mapped ones marked as such), so the order is
//!   enforced at compile time. Making an [`OwnedFrame`] is the kernel's
//!   `unsafe` promise that the handle is the only claim that can free it.
//! - [`try_to_unmap`], [`page_referenced`] and [`TlbFlushUnmapBatch`]: the
//!   same machinery, low-level, with the contract documented.
//! - [`change_protection`]: mprotect-like changes that first flush what a
//!   reclaimer left pending (contract rule 5).
//! - [`shootdown`] and the `flush_tlb_*` functions for immediate flushes.
//! - [`shrink_page_list`], [`migrate_pages`] and [`MmuGather`]: the reclaim,
//!   migration and teardown drivers, one flush per flush point.
//! - [`FramePool`], [`quiescent_flush`] and [`shrink_page_list_pooled`]:
//!   fewer flush points still. Clean unmapped frames stay allocated in a
//!   pool until every CPU that could cache them has flushed on its own (a
//!   timer tick, idle, an untagged switch), then come back with no IPI;
//!   one shootdown only when the kernel cannot wait ([`pool`]).
//!
//! # CPUs coming and going
//!
//! Shootdowns reach the CPUs of [`Arch::online_cpus`], and nothing else
//! waits for a CPU outside that set. A CPU joins it only after dropping
//! every TLB entry it may hold ([`prepare_cpu_online`], which the hardware
//! `Arch`s' `bring_online` runs), and leaves it only through
//! [`take_cpu_offline`] (their `take_offline`): it serves and acknowledges
//! every request that reaches it until no initiator that read the set with
//! it still in can publish to it, so no shootdown and no [`FramePool`]
//! generation waits for a CPU that is gone. In between it runs nothing that
//! uses its TLB (no flush reaches it there) and keeps no page table loaded
//! that may be freed while it is away.
//!
//! # Cargo features
//!
//! None is on by default.
//!
//! - `mock`: the simulated SMP machine (`arch::mock`, needs `std`) that
//!   every host test runs on; kernels enable it in their own tests.
//! - `arbitrary`: `Arbitrary` for the mock's operation model (fuzzing).
//! - `x86_64-mapper`: `mapper::OffsetSpace`, the [`PageTable`] of a page
//!   table built with the `x86_64` crate's `OffsetPageTable` (and
//!   `mapper::OffsetTeardown` for [`MmuGather`], with `munmap` in one
//!   call and `mapper::DeallocatorFrees` freeing into the crate's
//!   `FrameDeallocator`), so a kernel that maps its pages with that crate
//!   implements nothing for its page table.
//! - `offset-tables`: the same `OffsetSpace` and `OffsetTeardown` without
//!   the `x86_64` crate, built from the tables' addresses
//!   (`OffsetSpace::from_addresses`): for a kernel on another version of
//!   that crate (0.14) or with tables of its own making.
//! - `page-table-multiarch`: `ptm::PtmSpace`, the [`PageTable`] of an
//!   x86_64 table built with the `page_table_multiarch` crate
//!   (`X64PageTable`, as ArceOS and StarryOS use), and `ptm::PtmTeardown`
//!   for [`MmuGather`]; on x86_64 targets only. Its guide is
//!   `docs/page-table-multiarch.md`.
//! - `std`: links the standard library (the mock needs it).
//!
//! # Bad input and failures
//!
//! Every entry point checks what it is given before it changes anything:
//! addresses must be aligned and canonical ([`Arch::va_bits`], checked on
//! what the kernel's reverse map reports too), ranges ([`PageRange`]: a
//! first page and a count, so the last page of the address space is
//! expressible) must not cross the hole between the halves, ASIDs must fit
//! the hardware's width ([`Arch::asid_bits`]); anything else is a typed
//! [`Error`] with nothing changed. Range operations step over what is not
//! mapped ([`PageTable::next_populated`]), so their cost follows what is
//! mapped.
//!
//! A failed flush loses nothing owed. A driver never returns with a frame
//! in an unknown state: every frame is freed, handed back, or held by a
//! value the caller owns that records exactly what is left
//! ([`ReclaimRetry`], [`MigrateRetry`], an unfinished [`MmuGather`], an
//! [`UnmapBatch`] that keeps its frames), and retrying that value finishes
//! the work; [`change_protection`] records the flush it owes in the address
//! space, so the retry, or any later change of it, does it first.
//!
//! # The safety contract
//!
//! Everything in the crate, and every test against the simulated machine,
//! holds to these rules:
//!
//! 1. No frame is freed, reused or handed to I/O while any CPU may still
//!    *use* a writable TLB entry for it (lost writes, corruption).
//! 2. No frame is freed or reused while any CPU may *use* a TLB entry for
//!    it (information leak). An entry is usable while it is global, or
//!    tagged with the ASID the CPU has loaded (and runs user code in: a
//!    lazy CPU, [`enter_lazy_tlb`], uses none until it resumes), or tagged
//!    with an ASID the CPU may load again without flushing it first. An
//!    entry tagged with an ASID the CPU does not run, which the crate
//!    flushes before the CPU loads that ASID again (the generation check of
//!    [`switch_mm`]; see [`generation`]), is not usable: its frame may be
//!    freed or reused. The mock's oracle checks exactly this form: such
//!    entries are judged when the ASID is loaded.
//! 3. Deferral happens only when the architecture guarantees that a write
//!    through a clean cached entry re-walks the page table
//!    ([`Arch::CLEAN_WRITE_REWALK`]).
//! 4. A dirty bit is never lost: clearing a PTE is atomic with respect to
//!    the hardware setting accessed/dirty bits, and a dirty PTE marks its
//!    page dirty.
//! 5. An operation that changes a mapping of an address space with a
//!    pending batched flush flushes that batch first
//!    ([`flush_tlb_batched_pending`]).
//! 6. Page-table frames are freed only after the flush, and after lockless
//!    walkers are excluded where the kernel asks for that.
//! 7. A shootdown always completes: no deadlock, no lost request.
//! 8. Clearing accessed bits without a flush may cost aging accuracy, never
//!    data.
//!
//! # Example
//!
//! On the simulated machine (feature `mock`): four CPUs run an address
//! space; CPU 0 unmaps 100 pages with their flushes deferred, then flushes
//! once before freeing the frames.
//!
//! ```
//! # #[cfg(feature = "mock")] {
//! use tlb_batch::arch::mock::{MockConfig, MockMachine};
//! use tlb_batch::{Asid, TlbFlushUnmapBatch, TtuFlags, PAGE_SIZE};
//!
//! let machine = MockMachine::new(MockConfig::x86_like(4)).unwrap();
//! let mm = machine.new_mm(Asid::new(1).unwrap()).unwrap();
//! let mut frames = Vec::new();
//! for i in 0..100 {
//!     let va = 0x40_0000 + i * PAGE_SIZE;
//!     frames.push(machine.map_new(&mm, va, true).unwrap());
//! }
//! for cpu in 0..4 {
//!     let c = machine.cpu(cpu).unwrap();
//!     c.switch_to(&mm).unwrap();
//!     for i in 0..100 {
//!         c.write(0x40_0000 + i * PAGE_SIZE, cpu as u64).unwrap();
//!     }
//! }
//!
//! let cpu0 = machine.cpu(0).unwrap();
//! let mut batch = TlbFlushUnmapBatch::new();
//! for i in 0..100 {
//!     let va = 0x40_0000 + i * PAGE_SIZE;
//!     let old = machine.clear_pte(&mm, va).unwrap();
//!     assert!(TlbFlushUnmapBatch::should_defer(&cpu0, &mm, TtuFlags::BATCH_FLUSH));
//!     batch.add_pending(&cpu0, &mm, va, old).unwrap();
//! }
//! let report = batch.flush(&cpu0).unwrap();
//! assert_eq!(report.ipis_sent, 3); // one per other CPU, for 100 pages
//! for f in frames {
//!     machine.free_frame(f).unwrap();
//! }
//! assert!(machine.violations().is_empty());
//! # }
//! ```
#![no_std]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

#[cfg(any(feature = "std", test))]
extern crate std;

pub mod arch;
mod asid;
mod batch;
mod cpuset;
mod error;
mod gather;
pub mod generation;
mod lifecycle;
// The loom models: unit tests of the crate's own atomics under `--cfg loom`
// (scripts/loom.sh).
#[cfg(all(test, loom))]
mod loom;
#[cfg(feature = "offset-tables")]
#[cfg_attr(docsrs, doc(cfg(feature = "offset-tables")))]
pub mod mapper;
mod migrate;
mod mm;
mod mprotect;
mod page_size;
mod percpu;
pub mod pool;
mod pte;
#[cfg(all(feature = "page-table-multiarch", target_arch = "x86_64"))]
#[cfg_attr(
    docsrs,
    doc(cfg(all(feature = "page-table-multiarch", target_arch = "x86_64")))
)]
pub mod ptm;
mod range;
// The four-level x86_64 walk `mapper` and `ptm` share.
#[cfg(any(
    feature = "offset-tables",
    all(feature = "page-table-multiarch", target_arch = "x86_64")
))]
mod x86_walk;
/// The example of `docs/page-table-multiarch.md`, compiled and run by
/// `cargo test --doc` (only then: the file is not in the package).
#[cfg(all(
    doctest,
    feature = "page-table-multiarch",
    feature = "mock",
    target_arch = "x86_64"
))]
#[doc = include_str!("../docs/page-table-multiarch.md")]
pub struct PageTableMultiarchGuide;
mod reclaim;
mod request;
pub mod rmap;
mod shootdown;
#[cfg(feature = "mock")]
mod sim;
mod split;
mod stats;
mod sync;
mod ttu;
mod unmap;
mod validate;
mod verify;
mod walk;

/// The fixed-capacity collections in this crate's signatures
/// ([`FreeFrames::free_batch`], [`Flushed::frames_mut`], ...), re-exported
/// so that an implementation names exactly the version the crate uses.
pub use heapless;

pub use arch::{Arch, Asid, DEFAULT_FULL_FLUSH_CEILING};
pub use batch::TlbFlushUnmapBatch;
pub use cpuset::{AtomicCpuSet, CpuId, CpuSet, CpuSetIter, MAX_CPUS};
pub use error::Error;
pub use gather::{
    DetachedTable, FrameKind, HoldTables, HoldingBacking, MmuGather, PageGather, TableBounds,
    TableFreePolicy, TableHold, TableTeardown, TeardownBacking, TeardownSummary, PAGE_BATCH,
    TABLE_HOLD_GROUPS,
};
pub use lifecycle::take_cpu_offline;
pub use migrate::{
    migrate_pages, MigrateBacking, MigrateFailure, MigrateOutcome, MigrateRetry, MigrateSummary,
    MIGRATE_PASSES,
};
pub use mm::{
    enter_lazy_tlb, flush_tlb_batched_pending, flush_tlb_mm, flush_tlb_page, flush_tlb_range, leave_lazy_tlb,
    prepare_cpu_online, switch_mm, MmTlbState,
};
pub use mprotect::change_protection;
pub use page_size::PageSize;
pub use percpu::TlbShootdown;
pub use pool::{quiescent_flush, FramePool, PoolRefusal, PoolReleases, POOL_GENERATIONS};
pub use pte::{check_aligned, Frame, Pte, PteFlags, PAGE_SHIFT, PAGE_SIZE};
pub use range::{is_canonical, PageRange, TABLE_PAGES, TABLE_SPAN};
pub use reclaim::{
    shrink_page_list, shrink_page_list_pooled, PageOut, ReclaimBacking, ReclaimRetry, ReclaimSummary, Verdict,
};
pub use request::{FlushRange, FlushRequest, FlushScope, MAX_FLUSH_ASIDS, MAX_FLUSH_ENTRIES};
pub use rmap::{
    page_referenced, try_to_unmap, BoundedRmap, Mapping, MappingFlags, PageState, PageTable, Referenced,
    Rmap, SwapResult, TtuFlags,
};
pub use shootdown::{handle_flush_ipi, ipi_sync, shootdown, ShootdownReport};
pub use split::{promote_to_huge, split_huge_mapping, BrokenMapping, FlushFailed, FlushedBreak, HugeChange};
pub use stats::{FlushExtent, FlushReason, TlbStats, TlbStatsSnapshot, TraceEvent};
pub use unmap::{
    Flushed, FreeFrames, OwnedFrame, Released, StillMapped, UnmapBatch, Unmapped, Writeback, WritebackFrame,
};
pub use validate::{
    check_asid, check_range, check_request, check_space_range, check_space_va, check_table_bounds, check_va,
};
pub use verify::check_cpu_state;
