//! Reverse-map unmapping: [`try_to_unmap`] and [`page_referenced`], the
//! [`PageTable`] and [`Rmap`] traits a kernel implements for them, and
//! [`BoundedRmap`], an allocation-free reverse map for small kernels and
//! the mock machine.
//!
//! This file holds what a kernel implements: the traits, with their
//! defaults, and the mapping a walk reports. The algorithms live in
//! submodules, re-exported here: `unmap` ([`try_to_unmap`]), `aging`
//! ([`page_referenced`]), `visit` (the checked walk both share), and
//! `bounded` ([`BoundedRmap`]).

use core::ops::ControlFlow;

use crate::mm::MmTlbState;
use crate::page_size::PageSize;
use crate::pte::{Frame, Pte};
use crate::range::PageRange;

mod aging;
mod bounded;
mod unmap;
mod visit;

pub use aging::{page_referenced, Referenced};
pub use bounded::BoundedRmap;
pub(crate) use unmap::unmap_frame;
pub use unmap::{try_to_unmap, SwapResult};

pub use crate::ttu::TtuFlags;

bitflags::bitflags! {
    /// Properties of one mapping of a frame (the parts of Linux's
    /// `vm_flags` the walk reads).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct MappingFlags: u32 {
        /// The mapping is mlocked: the frame must stay resident.
        const LOCKED = 1 << 0;
        /// The mapping is shared with other address spaces.
        const SHARED = 1 << 1;
    }
}

/// The page table of one address space, as this crate needs it.
///
/// # Safety
///
/// The crate frees frames (through its callers) on the strength of these
/// answers, so an implementation guarantees:
///
/// - [`exchange`](PageTable::exchange) and
///   [`test_and_clear_accessed`](PageTable::test_and_clear_accessed) are
///   single atomic operations on the entry, so that an accessed or dirty
///   bit set by hardware at the same moment is either in the returned value
///   or applies to the new entry, never lost (contract rule 4);
/// - [`lookup`](PageTable::lookup) returns the entry as it is;
/// - [`tlb_state`](PageTable::tlb_state) is the state of the address space
///   this table translates for, the one whose CPUs may cache its entries.
///
/// - [`next_populated`](PageTable::next_populated) never skips an entry
///   that is not empty (a present PTE, or a migration or hwpoison entry);
/// - [`entry_size`](PageTable::entry_size) answers the huge page's size
///   wherever a huge entry maps the address (the default's 4 KiB is right
///   only for a table without huge entries), so that no walk changes one
///   piece of an entry all of whose pieces share its bits;
/// - [`with_table_locked`](PageTable::with_table_locked) calls its `body`
///   exactly once, and a kernel with split page-table locks holds there the
///   same lock its reverse-map walk ([`Rmap::walk`]) holds for entries of
///   that table.
///
/// Addresses passed in are page-aligned and canonical (the crate checks
/// before calling). Callers that need the kernel's page-table lock hold it
/// around the calls (see [`Rmap::walk`] and
/// [`with_table_locked`](PageTable::with_table_locked)).
pub unsafe trait PageTable {
    /// The address space's TLB state.
    fn tlb_state(&self) -> &MmTlbState;

    /// The entry for `va` ([`Pte::EMPTY`] where no table exists); where a
    /// huge entry maps `va`, its 4 KiB view there: the frame of the piece
    /// at `va`, the huge entry's flags (see [`entry_size`](Self::entry_size)).
    fn lookup(&self, va: u64) -> Pte;

    /// Atomically replaces the entry for `va` with `new` and returns the
    /// old value, with every accessed/dirty bit hardware set up to then.
    fn exchange(&self, va: u64, new: Pte) -> Pte;

    /// Atomically clears the accessed bit of the entry for `va`; returns
    /// whether it was set.
    fn test_and_clear_accessed(&self, va: u64) -> bool;

    /// Stores `pte` for `va`. Only called for an entry the caller cleared
    /// or found present, so the table exists.
    fn set(&self, va: u64, pte: Pte);

    /// Atomically clears the entry for `va`, returning the old value.
    fn clear(&self, va: u64) -> Pte {
        self.exchange(va, Pte::EMPTY)
    }

    /// The first address in `range` whose entry may be non-empty, or `None`
    /// when every entry of `range` is empty. Range operations
    /// ([`change_protection`](crate::change_protection),
    /// [`MmuGather::unmap_range`](crate::MmuGather::unmap_range)) call it to
    /// step over what is not mapped, so that their cost follows what is
    /// mapped rather than the size of the range: a kernel skips absent
    /// tables (and empty entries, if it can) here. The default skips
    /// nothing: it answers `range.start()`, and a range costs one
    /// [`lookup`](Self::lookup) per page.
    fn next_populated(&self, range: PageRange) -> Option<u64> {
        range.last().map(|_| range.start())
    }

    /// The size of the entry that maps `va`: the architecture's base page
    /// ([`Arch::base_page`](crate::Arch::base_page): 4 KiB, or an arm64
    /// kernel's 16 or 64 KiB granule) for a page entry, the huge page's
    /// size where a 2 MiB or 1 GiB entry (an arm64 block) maps it. Where
    /// nothing is mapped any answer will do. An answer smaller than the
    /// base page for a non-empty entry is refused
    /// ([`Error::BelowBasePage`](crate::Error::BelowBasePage)): a 16 or
    /// 64 KiB kernel's table must override the 4 KiB default.
    ///
    /// The range operations ([`change_protection`](crate::change_protection),
    /// [`MmuGather::unmap_range`](crate::MmuGather::unmap_range)) ask it for
    /// each non-empty entry they meet and take a huge one whole, once, at
    /// its first address (see [`check_range`](Self::check_range)).
    ///
    /// The reverse-map operations ask it for every mapping before any entry
    /// changes. A mapping at a huge page's first address, of the huge
    /// frame's first 4 KiB frame, is the whole huge page:
    /// [`try_to_unmap`] clears the one entry (its dirty bit goes to that
    /// frame, [`Rmap::set_dirty`]) and flushes it with one invalidation at
    /// the huge stride, and [`page_referenced`] clears its one accessed bit
    /// (its aging epoch is that frame's); the caller then frees or writes
    /// out the huge frame as one. A mapping of any other piece, and any
    /// huge mapping for migration ([`migrate_pages`](crate::migrate_pages))
    /// or hwpoison, is refused with [`Error::HugePage`](crate::Error::HugePage)
    /// before anything changes: split the huge page first. The default
    /// answers 4 KiB everywhere: right for a table without huge pages, and
    /// what every table written before this method answered.
    ///
    /// A table that answers a huge size also takes, at the huge page's
    /// first address (and only there), [`exchange`](Self::exchange),
    /// [`clear`](Self::clear), [`set`](Self::set) and
    /// [`test_and_clear_accessed`](Self::test_and_clear_accessed) on the
    /// whole huge entry, the values in their 4 KiB view (the first page's
    /// frame, the entry's flags): the crate writes [`Pte::EMPTY`] there, or
    /// a present entry whose frame is aligned to the size.
    fn entry_size(&self, va: u64) -> PageSize {
        let _ = va;
        PageSize::SIZE_4K
    }

    /// Refuses `range` before a range operation
    /// ([`change_protection`](crate::change_protection),
    /// [`MmuGather::unmap_range`](crate::MmuGather::unmap_range)) changes
    /// anything in it, when the table holds something there that the
    /// operation cannot take as it takes entries. The operation returns the
    /// error with nothing changed, rather than skip anything silently. The
    /// default refuses nothing.
    ///
    /// Huge pages need nothing here from a table that reports them through
    /// [`entry_size`](Self::entry_size): the operations take a huge page
    /// the range covers wholly as one entry (visited once at its first
    /// address, changed or cleared there whole, flushed at its stride),
    /// and refuse a range that covers part of one with
    /// [`Error::HugePage`](crate::Error::HugePage) themselves, asking
    /// `entry_size` at the range's first and last pages (a huge page the
    /// range covers part of holds one of them). The x86 adapters check
    /// the same here (`check_no_partial_huge`). A table that maps huge
    /// pages but answers 4 KiB from `entry_size` must refuse every range
    /// they map any of here, since the operations would take their pieces
    /// for 4 KiB entries.
    fn check_range(&self, range: PageRange) -> Result<(), crate::Error> {
        let _ = range;
        Ok(())
    }

    /// The root of these tables in the form [`MmTlbState::root`] holds it
    /// (what [`switch_mm`](crate::switch_mm) loads; on x86_64, the level-4
    /// table's physical address), or `None` when the table cannot tell (the
    /// default).
    ///
    /// With an answer, every crate function that changes or ages entries
    /// of a user space refuses the table when it differs from
    /// `tlb_state().root()` ([`Error::RootMismatch`](crate::Error::RootMismatch)),
    /// with nothing changed: flushes reach the CPUs that loaded the state's
    /// root, so a CPU that loaded these tables would be skipped. The
    /// adapters `mapper::OffsetSpace` and `ptm::PtmSpace` answer; a kernel's
    /// own table should too. The kernel's address space is not checked
    /// (its flushes reach every online CPU).
    fn root(&self) -> Option<u64> {
        None
    }

    /// Runs `body` once, holding the lock of the leaf page table that holds
    /// the entry for `va` (it maps [`TABLE_SPAN`](crate::TABLE_SPAN) bytes).
    ///
    /// Range operations change entries table by table inside this call, and
    /// check for a pending batched flush first thing inside it (contract
    /// rule 5). A kernel with split page-table locks implements it so that
    /// a reclaimer clearing an entry of that table under the same lock
    /// either finished before (and its pending flush is seen and done) or
    /// waits until the table is done. The default runs `body` without a
    /// lock, right for kernels that hold one lock for the whole address
    /// space around the crate's calls.
    fn with_table_locked(&self, va: u64, body: &mut dyn FnMut()) {
        let _ = va;
        body();
    }
}

/// One mapping of a frame, as a reverse-map walk reports it.
#[derive(Debug)]
pub struct Mapping<'a, S: ?Sized> {
    /// The address space (and its page table).
    pub space: &'a S,
    /// The page-aligned virtual address the frame is expected at.
    pub va: u64,
    /// Properties of the mapping.
    pub flags: MappingFlags,
}

/// The kernel's reverse map and per-frame state: for a frame, every place
/// that may map it.
///
/// # Safety
///
/// [`try_to_unmap`] reports [`SwapResult::Success`] when the walk found no
/// mapping left, and the caller then frees the frame. So
/// [`walk`](Rmap::walk) must visit every (address space, address) whose
/// PTE may map the frame. Visiting places that do not map it is harmless:
/// the crate checks each PTE. Addresses it reports are checked too: an
/// unaligned or non-canonical one, or an address space whose ASID the
/// hardware cannot tag, makes the calling function return an error before
/// it changes any entry of the frame.
///
/// A reverse map that keeps aging epochs ([`aged_epoch`](Rmap::aged_epoch)
/// returns `Some` for some frame) also guarantees, for each such frame:
///
/// - `aged_epoch` returns the value [`set_aged_epoch`](Rmap::set_aged_epoch)
///   last stored for it, or `None`;
/// - it returns `None` from the moment anything other than this crate
///   writes a present entry for the frame with its accessed bit clear, or
///   clears that bit (the kernel mapping the frame, again or anew; aging
///   of its own), until the crate stores a new value. A kernel keeps this
///   by calling `set_aged_epoch(frame, None)` before such a write;
/// - the one other value it may hold is `Some(0)`, for a frame mapped while
///   no CPU could cache it (just taken from the allocator: the contract
///   frees a frame only once no CPU caches it), until anything but the
///   crate writes or clears one of its entries again.
///
/// A [`FramePool`](crate::FramePool) frees frames on the strength of these
/// values (see [`aged_epoch`](Rmap::aged_epoch)). The defaults keep none.
pub unsafe trait Rmap {
    /// The address-space type mappings refer to.
    type Space: PageTable + ?Sized;

    /// Calls `visit` for each mapping of `frame` until it returns
    /// `Break`; returns `Break` if it stopped early. A kernel with
    /// page-table locks holds the lock of each mapping's table while
    /// `visit` runs for it.
    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()>;

    /// Marks the frame's page dirty (a dirty PTE's dirty bit moves here when
    /// the PTE goes away).
    fn set_dirty(&self, frame: Frame);

    /// Whether the frame is hardware-poisoned. The default says no.
    fn is_hwpoisoned(&self, frame: Frame) -> bool {
        let _ = frame;
        false
    }

    /// The aging epoch of `frame`: the flush epoch the crate stored with
    /// [`set_aged_epoch`](Rmap::set_aged_epoch) after it last cleared the
    /// accessed bits of the frame's mappings ([`page_referenced`], or
    /// [`try_to_unmap`] finding a mapping young). On hardware whose TLB
    /// fills set the accessed bit ([`Arch::fill_sets_accessed`]), a mapping
    /// found unmapped with the bit still clear can only be cached by CPUs
    /// that have not flushed since that epoch, so a
    /// [`FramePool`](crate::FramePool) generation of such frames waits for
    /// this epoch instead of a new one: the CPUs' usual flushes since the
    /// aging (timer ticks, switches, idle) release it, with no IPI.
    ///
    /// `None` (the default) when the map keeps no aging epochs or knows
    /// none for the frame: the pool then waits for flushes after the unmap.
    /// See the trait's `# Safety` for what `Some` promises.
    ///
    /// [`Arch::fill_sets_accessed`]: crate::arch::Arch::fill_sets_accessed
    fn aged_epoch(&self, frame: Frame) -> Option<u64> {
        let _ = frame;
        None
    }

    /// Stores the aging epoch of `frame` (`None`: forget it). The crate
    /// calls it after clearing accessed bits of the frame's mappings; a
    /// kernel calls it with `None` before it writes a present entry for the
    /// frame with the accessed bit clear itself. The default stores
    /// nothing.
    fn set_aged_epoch(&self, frame: Frame, epoch: Option<u64>) {
        let _ = (frame, epoch);
    }

    /// How many present PTEs map `frame` (migration and hwpoison entries
    /// do not count).
    fn mapcount(&self, frame: Frame) -> usize {
        let mut count = 0;
        let _ = self.walk(frame, &mut |m| {
            if m.space.lookup(m.va).maps(frame) {
                count += 1;
            }
            ControlFlow::Continue(())
        });
        count
    }
}

/// Per-frame state a [`BoundedRmap`] forwards to (the mock machine
/// implements it; a kernel points it at its page descriptors).
pub trait PageState {
    /// Marks the frame's page dirty.
    fn set_dirty(&self, frame: Frame);

    /// Whether the frame is hardware-poisoned.
    fn is_hwpoisoned(&self, frame: Frame) -> bool {
        let _ = frame;
        false
    }

    /// The frame's aging epoch, for [`Rmap::aged_epoch`]: what
    /// [`set_aged_epoch`](Self::set_aged_epoch) last stored, or `None`. The
    /// default keeps none. Keeping them is a promise made through
    /// [`BoundedRmap::new`]'s `# Safety`.
    fn aged_epoch(&self, frame: Frame) -> Option<u64> {
        let _ = frame;
        None
    }

    /// Stores the frame's aging epoch (`None`: forget it), for
    /// [`Rmap::set_aged_epoch`]. The default stores nothing.
    fn set_aged_epoch(&self, frame: Frame, epoch: Option<u64>) {
        let _ = (frame, epoch);
    }
}
