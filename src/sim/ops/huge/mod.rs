//! Huge pages in the operation model: a third user address space whose
//! page table (this module's, attached to the machine as a kernel-written
//! table) maps each of its [`REGIONS`] 2 MiB regions either with one 2 MiB
//! entry or with a leaf table of 4 KiB entries, and the steps
//! ([`HugeOp`]) that move a region between the two through the crate's
//! break / flush / make sequence
//! ([`split_huge_mapping`](crate::split_huge_mapping),
//! [`promote_to_huge`](crate::promote_to_huge)), mixed with what the rest
//! of the crate does to huge and small entries there: reverse-map unmaps
//! (batched or not), `change_protection` (a range covering a huge page
//! wholly, or part of one, which must be refused), migration (refused for
//! a huge page), an `MmuGather` teardown that frees the leaf tables, and
//! CPU accesses that cache 2 MiB entries beside 4 KiB ones, lazy CPUs
//! whose walk caches still point to a leaf table included.
//!
//! The oracle judges every access and free as for the other spaces, and
//! adds what only sizes show: an access through a huge entry to a freed
//! piece, two differing translations of one address cached at once
//! ([`Violation::ConflictingTranslations`](crate::arch::mock::Violation::ConflictingTranslations)),
//! a table freed while a walk cache points to it; after every split,
//! promotion, protection and teardown no CPU may keep an entry of the
//! region that disagrees with the table (`check_coherent`), a size
//! included.
//!
//! A promotion copies into a new 2 MiB frame (Linux's collapse) unless
//! the region's 512 entries already map one aligned block in order with
//! the same permissions (after a plain split), which it promotes in place
//! (FreeBSD's promotion); either way the leaf table is freed after the
//! flush, and in the copying case the old frames too.

mod backing;
mod driver;
mod ranges;
mod table;

pub(super) use driver::HugeDriver;

use crate::page_size::PageSize;
use crate::pte::PAGE_SIZE;

/// 2 MiB regions of the huge address space.
pub const REGIONS: usize = 2;
/// The first address of the huge address space (1 GiB: its regions share
/// one page directory).
pub const HUGE_BASE: u64 = 0x4000_0000;
/// The 4 KiB pieces of a region the steps name (the first, the last, and a
/// few between: the split makes [`RO_PIECE`] read-only and moves
/// [`MOVED_PIECE`] to a frame of its own).
pub const PIECES: [u64; 6] = [0, 1, 3, 100, 256, 511];
/// The piece a split with [`HugeOp::Split`]'s `change` 1 makes read-only.
pub const RO_PIECE: u64 = 3;
/// The piece a split with `change` 2 moves to another frame.
pub const MOVED_PIECE: u64 = 100;
/// The size of the huge pages.
pub(crate) const HUGE: PageSize = PageSize::SIZE_2M;

/// The first address of region `region` (taken modulo [`REGIONS`]).
pub fn region_va(region: usize) -> u64 {
    HUGE_BASE + (region % REGIONS) as u64 * HUGE.bytes()
}

/// The address of piece `piece` (an index into [`PIECES`], taken modulo
/// its length) of region `region`.
pub fn piece_va(region: usize, piece: usize) -> u64 {
    region_va(region) + PIECES[piece % PIECES.len()] * PAGE_SIZE
}

/// One step on the huge address space. Indices are taken modulo the
/// model's sizes; a step whose precondition does not hold (a split of a
/// region not mapped huge, a promotion of one with no leaf table) does
/// nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum HugeOp {
    /// Map a new 2 MiB frame at `region` with one 2 MiB entry, if nothing
    /// maps the region; a CPU running the space then reads it.
    MapHuge {
        /// Region.
        region: u8,
        /// Whether writes are allowed.
        writable: bool,
    },
    /// Map a new 4 KiB frame at piece `piece` of `region` (linking a leaf
    /// table first if the region has none), unless a huge entry maps the
    /// region or the piece is mapped; a CPU running the space reads it.
    MapSmall {
        /// Region.
        region: u8,
        /// Piece (index into [`PIECES`]).
        piece: u8,
        /// Whether writes are allowed.
        writable: bool,
    },
    /// CPU `cpu` switches to the huge space if it does not run it (or
    /// resumes it from lazy), then reads or writes the piece.
    Access {
        /// CPU.
        cpu: u8,
        /// Region.
        region: u8,
        /// Piece (index into [`PIECES`]).
        piece: u8,
        /// Write rather than read.
        write: bool,
    },
    /// CPU `cpu`, if it runs the huge space, goes lazy on it (its walk
    /// caches keep their pointers to the space's leaf tables).
    Lazy {
        /// CPU.
        cpu: u8,
    },
    /// Split the 2 MiB entry of `region` into a leaf table of 512 entries
    /// over the same frames: `change` 1 (modulo 3) makes [`RO_PIECE`]
    /// read-only, 2 moves [`MOVED_PIECE`] to a new frame (copied, and the
    /// old one freed after the make). A failed flush injected first when
    /// `fail`, then the documented retry.
    Split {
        /// Initiating CPU.
        cpu: u8,
        /// Region.
        region: u8,
        /// What the new entries change (see above).
        change: u8,
        /// Inject a failed flush first.
        fail: bool,
    },
    /// Promote (collapse) the leaf table of `region` into one 2 MiB entry,
    /// in place or into a new 2 MiB frame (see the module's
    /// documentation); the table (and, copying, the old frames) freed
    /// after the flush.
    Promote {
        /// Initiating CPU.
        cpu: u8,
        /// Region.
        region: u8,
        /// Inject a failed flush first.
        fail: bool,
    },
    /// `try_to_unmap` of the frame at the piece into the huge space's
    /// batch (ignoring accessed bits; deferred when `batched`, in a
    /// batching run). Piece 0 of a huge page is the whole 2 MiB frame;
    /// any other piece of one must be refused with nothing changed. An
    /// unmapped frame is freed at the next [`HugeOp::Flush`].
    Unmap {
        /// Initiating CPU.
        cpu: u8,
        /// Region.
        region: u8,
        /// Piece (index into [`PIECES`]).
        piece: u8,
        /// With [`TtuFlags::BATCH_FLUSH`](crate::TtuFlags::BATCH_FLUSH).
        batched: bool,
    },
    /// Flush the huge space's batch (a failure injected first when
    /// `fail`, then the retry), then free the frames it unmapped.
    Flush {
        /// Initiating CPU.
        cpu: u8,
        /// Inject a failed flush first.
        fail: bool,
    },
    /// `change_protection` of `region`: the whole region when `count` is
    /// 0 (modulo 4), else `count` pages from the piece `first`; read-only,
    /// or writable again when `writable`. A range that covers part of a
    /// huge page must be refused with nothing changed.
    Protect {
        /// Initiating CPU.
        cpu: u8,
        /// Region.
        region: u8,
        /// First piece (index into [`PIECES`]).
        first: u8,
        /// Pages (see above).
        count: u8,
        /// Make writable rather than read-only.
        writable: bool,
        /// Inject a failed flush first, then run it again.
        fail: bool,
    },
    /// `migrate_pages` of the frame at the piece: a 4 KiB frame moves to a
    /// new one, a huge page (any piece of it) is refused and stays mapped.
    Migrate {
        /// Initiating CPU.
        cpu: u8,
        /// Region.
        region: u8,
        /// Piece (index into [`PIECES`]).
        piece: u8,
    },
    /// The kernel's own munmap of `region` (Linux's `zap_page_range`):
    /// whatever maps it cleared entry by entry (the 2 MiB entry, or each
    /// 4 KiB one, the leaf table left linked), one
    /// [`flush_tlb_range`](crate::flush_tlb_range) over the region's 4 KiB
    /// pages, then the frames freed.
    Zap {
        /// Initiating CPU.
        cpu: u8,
        /// Region.
        region: u8,
    },
    /// `MmuGather::unmap_range` over the whole huge space, its leaf tables
    /// freed after the flush ([`TableFreePolicy::IpiSync`](crate::TableFreePolicy)
    /// when `cpu / CPUS` is odd), a failure injected first when `fail`,
    /// then the documented finish and retry.
    Teardown {
        /// Initiating CPU (`cpu % CPUS`; the quotient picks the policy).
        cpu: u8,
        /// Inject a failed flush first.
        fail: bool,
    },
}
