//! Reverse-map unmapping: [`try_to_unmap`] and [`page_referenced`], the
//! [`PageTable`] and [`Rmap`] traits a kernel implements for them, and
//! [`BoundedRmap`], an allocation-free reverse map for small kernels and
//! the mock machine.

use core::ops::ControlFlow;

use crate::arch::Arch;
use crate::batch::TlbFlushUnmapBatch;
use crate::cpuset::CpuSet;
use crate::mm::MmTlbState;
use crate::pte::{check_aligned, Frame, Pte};
use crate::range::PageRange;
use crate::request::FlushRequest;
use crate::shootdown::shootdown;
use crate::validate::{check_asid, check_va};
use crate::Error;

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

    /// The entry for `va` ([`Pte::EMPTY`] where no table exists).
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
    /// fills set the accessed bit ([`Arch::FILL_SETS_ACCESSED`]), a mapping
    /// found unmapped with the bit still clear can only be cached by CPUs
    /// that have not flushed since that epoch, so a
    /// [`FramePool`](crate::FramePool) generation of such frames waits for
    /// this epoch instead of a new one: the CPUs' usual flushes since the
    /// aging (timer ticks, switches, idle) release it, with no IPI.
    ///
    /// `None` (the default) when the map keeps no aging epochs or knows
    /// none for the frame: the pool then waits for flushes after the unmap.
    /// See the trait's `# Safety` for what `Some` promises.
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

struct RmapEntry<'a, S: ?Sized> {
    frame: Frame,
    space: &'a S,
    va: u64,
    flags: MappingFlags,
}

/// A reverse map of at most `N` mappings in fixed storage: no allocation,
/// O(N) walks. For small kernels, tests and the mock machine.
pub struct BoundedRmap<'a, S: ?Sized, P: ?Sized, const N: usize> {
    entries: heapless::Vec<RmapEntry<'a, S>, N>,
    pages: &'a P,
}

impl<'a, S: PageTable + ?Sized, P: PageState + ?Sized, const N: usize> BoundedRmap<'a, S, P, N> {
    /// An empty map forwarding page state to `pages`.
    ///
    /// # Safety
    ///
    /// The map promises callers of [`Rmap::walk`] that it knows every
    /// mapping. The caller keeps that promise: it [`add`](Self::add)s each
    /// mapping of a frame before any CPU can use it, and removes it only
    /// when the mapping no longer exists.
    ///
    /// If `pages` keeps aging epochs ([`PageState::aged_epoch`] returns
    /// `Some`), the caller also keeps [`Rmap`]'s promise about them: `add`
    /// forgets the frame's epoch, so it only remains to call
    /// `pages.set_aged_epoch(frame, None)` before writing an entry for a
    /// frame with its accessed bit clear, or clearing that bit, other than
    /// when adding the mapping (a refault that rewrites a recorded mapping)
    /// and other than through this crate.
    pub unsafe fn new(pages: &'a P) -> Self {
        BoundedRmap {
            entries: heapless::Vec::new(),
            pages,
        }
    }

    /// Records that `space` maps `frame` at `va`. Errors:
    /// [`Error::Unaligned`], [`Error::RmapFull`] (nothing is recorded).
    pub fn add(&mut self, frame: Frame, space: &'a S, va: u64, flags: MappingFlags) -> Result<(), Error> {
        check_aligned(va)?;
        // The new entry's accessed bit is clear while a CPU may still cache
        // an older mapping of the frame: no aging epoch vouches for it.
        self.pages.set_aged_epoch(frame, None);
        self.entries
            .push(RmapEntry {
                frame,
                space,
                va,
                flags,
            })
            .map_err(|_| Error::RmapFull { capacity: N })
    }

    /// Forgets the mapping of `frame` at `va` in `space`; returns whether it
    /// was recorded.
    pub fn remove(&mut self, frame: Frame, space: &S, va: u64) -> bool {
        let found = self
            .entries
            .iter()
            .position(|e| e.frame == frame && e.va == va && core::ptr::addr_eq(e.space, space));
        if let Some(i) = found {
            self.entries.swap_remove(i);
        }
        found.is_some()
    }

    /// Forgets every mapping of `frame` (when it is freed); returns how many.
    pub fn remove_frame(&mut self, frame: Frame) -> usize {
        let before = self.entries.len();
        self.entries.retain(|e| e.frame != frame);
        before - self.entries.len()
    }

    /// Changes the flags of a recorded mapping (mlock, munlock); returns
    /// whether it was recorded.
    pub fn set_flags(&mut self, frame: Frame, space: &S, va: u64, flags: MappingFlags) -> bool {
        match self
            .entries
            .iter_mut()
            .find(|e| e.frame == frame && e.va == va && core::ptr::addr_eq(e.space, space))
        {
            Some(e) => {
                e.flags = flags;
                true
            }
            None => false,
        }
    }

    /// Recorded mappings.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

// SAFETY: `walk` visits every recorded mapping of the frame, and the
// caller of `new` promised that every mapping is recorded, and that the
// page state's aging epochs, if it keeps any, are forgotten on every write
// that `add` does not cover.
unsafe impl<S: PageTable + ?Sized, P: PageState + ?Sized, const N: usize> Rmap for BoundedRmap<'_, S, P, N> {
    type Space = S;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, S>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        for e in self.entries.iter().filter(|e| e.frame == frame) {
            visit(Mapping {
                space: e.space,
                va: e.va,
                flags: e.flags,
            })?;
        }
        ControlFlow::Continue(())
    }

    fn set_dirty(&self, frame: Frame) {
        self.pages.set_dirty(frame);
    }

    fn is_hwpoisoned(&self, frame: Frame) -> bool {
        self.pages.is_hwpoisoned(frame)
    }

    fn aged_epoch(&self, frame: Frame) -> Option<u64> {
        self.pages.aged_epoch(frame)
    }

    fn set_aged_epoch(&self, frame: Frame, epoch: Option<u64>) {
        self.pages.set_aged_epoch(frame, epoch);
    }
}

/// What [`try_to_unmap`] achieved (Linux's `SWAP_*` codes, with the batched
/// flush series' two `*Cached` additions).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[must_use]
pub enum SwapResult {
    /// Every mapping is gone. No TLB entry that allows a write survives
    /// unflushed; but with [`TtuFlags::BATCH_FLUSH`] read-only or clean
    /// entries may still be cached until the batch is flushed, so the frame
    /// must not be freed or reused before
    /// [`TlbFlushUnmapBatch::flush`] (contract rule 2). It may be written
    /// out at once.
    Success,
    /// Every mapping is gone, but a flush was deferred for a PTE that was
    /// writable or dirty: a CPU may still write through a cached entry until
    /// the batch is flushed. Flush before writing the frame out
    /// ([`TlbFlushUnmapBatch::flush_dirty`]) and before freeing it
    /// ([`TlbFlushUnmapBatch::flush`]).
    SuccessCached,
    /// A mapping is left (it appeared during the walk, or could not be
    /// removed); try again later.
    Again,
    /// Like [`Again`](Self::Again), and some mapping that was removed left a
    /// possibly writable TLB entry behind, pending in the batch.
    AgainCached,
    /// The frame was recently referenced through a mapping; it stays.
    Fail,
    /// A mapping locks the frame in memory.
    Mlock,
}

impl SwapResult {
    /// Whether no mapping is left.
    pub fn is_unmapped(self) -> bool {
        matches!(self, SwapResult::Success | SwapResult::SuccessCached)
    }

    /// Whether a writable TLB entry may survive until the batch is flushed.
    pub fn is_cached(self) -> bool {
        matches!(self, SwapResult::SuccessCached | SwapResult::AgainCached)
    }
}

/// Checks every mapping `rmap` reports for `frame` (aligned, canonical,
/// an ASID the hardware can tag) without touching any entry, so that a
/// walk that then changes entries does not stop half-way on bad input.
fn check_mappings<A: Arch, R: Rmap + ?Sized>(arch: &A, rmap: &R, frame: Frame) -> Result<(), Error> {
    let mut failure = None;
    let _ = rmap.walk(frame, &mut |m| match check_mapping(arch, &m) {
        Ok(()) => ControlFlow::Continue(()),
        Err(e) => {
            failure = Some(e);
            ControlFlow::Break(())
        }
    });
    failure.map_or(Ok(()), Err)
}

fn check_mapping<A: Arch, S: PageTable + ?Sized>(arch: &A, m: &Mapping<'_, S>) -> Result<(), Error> {
    check_va(arch, m.va)?;
    check_asid(arch, m.space.tlb_state().asid())
}

/// Walks the mappings of `frame` that a present PTE still maps to it (the
/// rmap may also list places that no longer do), stopping at the first
/// error (a mapping that fails [`check_mapping`], or one `visit` returns)
/// or when `visit` asks to.
fn walk_mapped<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    frame: Frame,
    mut visit: impl FnMut(&Mapping<'_, R::Space>) -> Result<ControlFlow<()>, Error>,
) -> Result<(), Error> {
    let mut failure = None;
    let _ = rmap.walk(frame, &mut |m| {
        let step = check_mapping(arch, &m).and_then(|()| {
            if m.space.lookup(m.va).maps(frame) {
                visit(&m)
            } else {
                Ok(ControlFlow::Continue(()))
            }
        });
        step.unwrap_or_else(|e| {
            failure = Some(e);
            ControlFlow::Break(())
        })
    });
    failure.map_or(Ok(()), Err)
}

/// Clears the accessed bit of one mapping; when the architecture needs a
/// flush for that, records one in `batch` (it rides along with the next
/// flush point instead of costing an IPI now).
fn clear_young<A: Arch, S: PageTable + ?Sized>(
    arch: &A,
    space: &S,
    va: u64,
    batch: &mut TlbFlushUnmapBatch,
) -> Result<bool, Error> {
    let page = if A::ACCESSED_CLEAR_NEEDS_FLUSH {
        Some(batch.check_add(arch, space.tlb_state(), va)?)
    } else {
        None
    };
    let young = space.test_and_clear_accessed(va);
    if let (true, Some(page)) = (young, page) {
        let mm = space.tlb_state();
        batch.record(arch, mm, page, &mm.flush_targets(arch), None);
    }
    Ok(young)
}

/// Stores `frame`'s aging epoch after its accessed bits were cleared (see
/// [`Rmap::aged_epoch`]): a new epoch, published after the clears. A CPU
/// that flushes after reading that epoch (or a later one) flushes after
/// every clear, so it drops whatever it cached before them; whatever it
/// caches afterwards sets the accessed bit again, which an unmap then
/// sees. (Publishing here rather than waiting for the next pool
/// generation's epoch lets the CPUs' flushes in between count.)
///
/// When nothing was cleared (`cleared` false) a known epoch stays: it is
/// older, and still true, since no bit was cleared after it. An unknown one
/// is set all the same: every entry cached before now is dropped by a CPU
/// that flushes past the new epoch, and every later one sets the bit.
fn note_aged<A: Arch, R: Rmap + ?Sized>(arch: &A, rmap: &R, frame: Frame, cleared: bool) {
    if !A::FILL_SETS_ACCESSED || (!cleared && rmap.aged_epoch(frame).is_some()) {
        return;
    }
    // A read-modify-write that releases the clears (atomic operations of
    // any strength, by the kernel's `PageTable`) to every CPU that reads
    // this epoch or a later one before it flushes: its refills afterwards
    // come after the clears, and set the bit again where an unmap sees it.
    let epoch = arch.shootdown_state().publish_epoch();
    rmap.set_aged_epoch(frame, Some(epoch));
}

/// What removing one mapping left behind.
#[derive(Clone, Copy, Default)]
struct Cleared {
    /// Its flush is owed by `batch` (deferred, or an immediate flush that
    /// failed).
    owed: bool,
    /// A possibly writable TLB entry survives until that flush.
    writable: bool,
}

/// Removes one mapping. Every check that could fail runs before the PTE
/// is exchanged; after it, the flush is either done or recorded in `batch`
/// whatever happens. An error says whether its flush is owed by `batch`
/// (`true` once the PTE is gone: the immediate flush failed).
fn unmap_one<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    m: &Mapping<'_, R::Space>,
    frame: Frame,
    flags: TtuFlags,
    poisoned: bool,
    batch: &mut TlbFlushUnmapBatch,
) -> Result<Cleared, (bool, Error)> {
    let mm = m.space.tlb_state();
    let page = batch.check_add(arch, mm, m.va).map_err(|e| (false, e))?;
    let current = m.space.lookup(m.va);
    let replacement = if poisoned {
        Pte::hwpoison(frame)
    } else if flags.contains(TtuFlags::MIGRATION) {
        current.to_migration()
    } else {
        Pte::EMPTY
    };
    // One atomic exchange: a dirty bit set by hardware up to this instant is
    // in `old`; after it, no walk can find the frame.
    let old = m.space.exchange(m.va, replacement);
    if old.is_dirty() {
        rmap.set_dirty(frame);
    }
    // Found with the accessed bit clear: no CPU cached the mapping since
    // the frame's last aging, so flushing past its aging epoch is enough
    // (asked only when the flush is deferred: the path that flushes at
    // once pays nothing for it).
    let aged = || {
        if A::FILL_SETS_ACCESSED && !old.is_accessed() {
            rmap.aged_epoch(frame)
        } else {
            None
        }
    };
    // Read once, after the exchange (as `flush_targets` requires), for the
    // decision and for the flush alike: what `should_defer` would answer,
    // without reading the CPU set a second time.
    let targets = mm.flush_targets(arch);
    let defer = flags.contains(TtuFlags::BATCH_FLUSH)
        && A::CLEAN_WRITE_REWALK
        && !targets.difference(&CpuSet::single(arch.current_cpu())).is_empty();
    if defer {
        batch.record_pending(arch, mm, page, old, &targets, aged());
        return Ok(Cleared {
            owed: true,
            writable: old.is_writable() || old.is_dirty(),
        });
    }
    let mut request = FlushRequest::new();
    request.add_range(mm.asid(), page, A::FULL_FLUSH_CEILING);
    if let Err(e) = shootdown(arch, &targets, &request) {
        // The PTE is gone but not flushed: the batch takes the debt, so
        // that the caller's flush still covers it.
        batch.record_pending(arch, mm, page, old, &targets, aged());
        Err((true, e))
    } else {
        Ok(Cleared::default())
    }
}

/// Removes every mapping of `frame` found through `rmap` (Linux's
/// `try_to_unmap`), in walk order:
///
/// - a mapping flagged [`MappingFlags::LOCKED`] stops the walk with
///   [`SwapResult::Mlock`], unless [`TtuFlags::IGNORE_MLOCK`];
/// - with [`TtuFlags::MUNLOCK`] nothing is unmapped: the result is `Mlock`
///   if a locked mapping exists, [`SwapResult::Again`] otherwise;
/// - a mapping whose accessed bit is set stops the walk with
///   [`SwapResult::Fail`] (the bit is cleared, so a later try may succeed),
///   unless [`TtuFlags::IGNORE_ACCESS`];
/// - otherwise the PTE is atomically exchanged for an empty entry (a
///   migration entry with [`TtuFlags::MIGRATION`], a hwpoison entry for a
///   poisoned frame unless [`TtuFlags::IGNORE_HWPOISON`]); a dirty bit moves
///   to the frame ([`Rmap::set_dirty`]); the TLB flush is deferred into
///   `batch` when [`TlbFlushUnmapBatch::should_defer`] allows, done at once
///   otherwise.
///
/// When the walk went through, the result is `Success` if no present PTE
/// maps the frame any more and `Again` if one does; each becomes its
/// `*Cached` form when a deferred PTE was writable or dirty.
///
/// Why "again, cached" becomes "success, cached": while walking, each
/// mapping removed with a deferred writable flush answers `AgainCached`,
/// which means "carry on walking, and remember that a writable TLB entry
/// may be cached". Once the walk ends with no mapping left, the frame *is*
/// unmapped, which is what `Success` tells the caller; but the remembered
/// TLB entries still exist. Answering plain `Success` would invite the
/// caller to write or free the frame while a CPU can still write to it, so
/// the result keeps the warning: `SuccessCached`, unmapped but not yet safe
/// until the batch is flushed.
///
/// Whatever the result (`Success` included, and `Again`, `Fail`, `Mlock`
/// or an error after the walk removed some mappings), every PTE this call
/// cleared is either flushed or recorded in `batch`; the caller flushes the
/// batch before freeing, reusing or writing out the frame. Plain `Success`
/// under [`TtuFlags::BATCH_FLUSH`] only says that no *writable* entry
/// survives: read-only or clean entries may still be cached until the
/// flush, and freeing the frame before it leaks its contents (rule 2).
/// All of this is about the mappings *this* call removed: one an earlier
/// call removed into another batch still owes that batch's flush. The
/// caller must hold the frame alone (as Linux's page lock and LRU
/// isolation make it), and flush every batch that may owe the frame a
/// flush before writing or freeing it.
///
/// The low-level form: nothing stops the caller from freeing the frame
/// before the flush. [`UnmapBatch`](crate::UnmapBatch) is the form that
/// makes that mistake a compile error.
///
/// Errors, before any entry changed: [`Error::Unaligned`],
/// [`Error::NonCanonical`] or [`Error::AsidOutOfRange`] for a mapping the
/// rmap reported (all are checked before the first is removed),
/// [`Error::OtherMachine`] for a batch holding another machine's work.
/// During the walk: [`Error::ShootdownReentered`] from an immediate flush
/// (or a check failing on a mapping that appeared meanwhile); the walk stops
/// there, and what it cleared is in `batch`.
pub fn try_to_unmap<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    frame: Frame,
    flags: TtuFlags,
    batch: &mut TlbFlushUnmapBatch,
) -> Result<SwapResult, Error> {
    unmap_frame(arch, rmap, frame, flags, batch).result
}

/// What [`unmap_frame`] did: the result [`try_to_unmap`] reports, and
/// whether any mapping it removed left its flush owed by the batch (the
/// typed layer then keeps the frame until that flush, whatever the
/// result).
pub(crate) struct UnmapReport {
    pub(crate) result: Result<SwapResult, Error>,
    pub(crate) owed: bool,
}

pub(crate) fn unmap_frame<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    frame: Frame,
    flags: TtuFlags,
    batch: &mut TlbFlushUnmapBatch,
) -> UnmapReport {
    let fail = |e| UnmapReport {
        result: Err(e),
        owed: false,
    };
    if let Err(e) = batch
        .check_machine(arch)
        .and_then(|()| check_mappings(arch, rmap, frame))
    {
        return fail(e);
    }
    let poisoned = rmap.is_hwpoisoned(frame) && !flags.contains(TtuFlags::IGNORE_HWPOISON);
    let mut verdict = None;
    let mut owed = false;
    let mut cached = false;
    let walked = walk_mapped(arch, rmap, frame, |m| {
        if m.flags.contains(MappingFlags::LOCKED) && !flags.contains(TtuFlags::IGNORE_MLOCK) {
            verdict = Some(SwapResult::Mlock);
            return Ok(ControlFlow::Break(()));
        }
        if flags.contains(TtuFlags::MUNLOCK) {
            return Ok(ControlFlow::Continue(()));
        }
        if !flags.contains(TtuFlags::IGNORE_ACCESS) && clear_young(arch, m.space, m.va, batch)? {
            verdict = Some(SwapResult::Fail);
            return Ok(ControlFlow::Break(()));
        }
        // After an error the result is the error: only the debt matters.
        let cleared = unmap_one(arch, rmap, m, frame, flags, poisoned, batch).map_err(|(debt, e)| {
            owed |= debt;
            e
        })?;
        owed |= cleared.owed;
        cached |= cleared.writable;
        Ok(ControlFlow::Continue(()))
    });
    if verdict == Some(SwapResult::Fail) {
        // A young mapping's accessed bit was cleared.
        note_aged(arch, rmap, frame, true);
    }
    let result = walked.map(|()| match verdict {
        Some(v) => v,
        None if flags.contains(TtuFlags::MUNLOCK) => SwapResult::Again,
        None => match (rmap.mapcount(frame) == 0, cached) {
            (true, false) => SwapResult::Success,
            (true, true) => SwapResult::SuccessCached,
            (false, false) => SwapResult::Again,
            (false, true) => SwapResult::AgainCached,
        },
    });
    UnmapReport { result, owed }
}

/// What [`page_referenced`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Referenced {
    /// Mappings whose accessed bit was set (and is now clear).
    pub referenced: usize,
    /// Mappings visited that map the frame.
    pub mapped: usize,
    /// A mapping is mlocked (the walk stopped there).
    pub mlocked: bool,
}

/// Counts and clears the accessed bits of every mapping of `frame`, the
/// reclaimer's measure of how recently the page was used.
///
/// When the architecture says clearing needs a flush
/// ([`Arch::ACCESSED_CLEAR_NEEDS_FLUSH`]) each cleared mapping is recorded
/// in `batch` and flushed with it; otherwise (x86, seed 003) nothing is
/// flushed and no IPI is sent. Skipping the flush costs accuracy only: a CPU
/// keeps using its cached entry without setting the bit again, so the page
/// may look older than it is and be reclaimed a little early; its data is
/// never at risk, since unmapping it later goes through the full protocol.
///
/// On hardware whose fills set the accessed bit
/// ([`Arch::FILL_SETS_ACCESSED`]) it then stores the frame's aging epoch
/// ([`Rmap::set_aged_epoch`]): a newly published one when it cleared a bit
/// or none was known, the known one otherwise (no bit was cleared since).
/// As for [`try_to_unmap`], the caller holds the frame alone (Linux's
/// page lock and LRU isolation): an aging racing with an unmap of the same
/// frame could pair a bit cleared by one with an epoch stored by the other.
///
/// Errors, before any accessed bit is cleared: [`Error::Unaligned`],
/// [`Error::NonCanonical`] or [`Error::AsidOutOfRange`] for a mapping the
/// rmap reported, [`Error::OtherMachine`] for a batch of another machine.
pub fn page_referenced<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    frame: Frame,
    batch: &mut TlbFlushUnmapBatch,
) -> Result<Referenced, Error> {
    batch.check_machine(arch)?;
    check_mappings(arch, rmap, frame)?;
    let mut found = Referenced::default();
    let walked = walk_mapped(arch, rmap, frame, |m| {
        found.mapped += 1;
        if m.flags.contains(MappingFlags::LOCKED) {
            found.mlocked = true;
            return Ok(ControlFlow::Break(()));
        }
        found.referenced += usize::from(clear_young(arch, m.space, m.va, batch)?);
        Ok(ControlFlow::Continue(()))
    });
    // Whatever the walk cleared before it stopped, and the bits it found
    // clear, date from before this point.
    note_aged(arch, rmap, frame, found.referenced > 0);
    walked?;
    Ok(found)
}
