//! The teardown scenario's address space (`teardown.rs`): page tables
//! grown on demand from a poisoning frame pool, below an entry of their
//! own of the kernel's root table, as the crate's `PageTable` and
//! `TableTeardown` see them.
//!
//! The scenario's pages hang below an entry of their own ([`ROOT_INDEX`])
//! of the kernel's root table, in tables taken from a small frame pool
//! ([`POOL_FRAMES`] frames of the granule's size, identity-mapped like all
//! of RAM), the way a hobby kernel grows its tables on demand:
//! [`TeardownSpace::map`] allocates the missing tables on the way down and
//! writes a page descriptor with the same attributes as the other test
//! pages (non-global, so tagged with the test ASID; writable).
//!
//! # The geometry
//!
//! Everything about the shape of the tables is a function of the boot's
//! granule ([`Geometry`]):
//!
//! - 4 KiB: the root is a level 0 table; below its entry 2 a level 1
//!   table (which stays), then the level 2 table the teardown frees, over
//!   1 GiB, and its leaf tables, 2 MiB each; tables of 512 entries, 4 KiB
//!   frames.
//! - 64 KiB (`granule64`, `mmu64.rs`): the root is the 64-entry level 1
//!   table; below its entry 2 hangs the level 2 table the teardown frees,
//!   over 4 TiB, with its leaf tables of 512 MiB each; tables of 8192
//!   entries, 64 KiB frames (a pool of its own, [`POOL_64K`]). No table
//!   stays: the teardown clears the root entry itself.
//!
//! A freed frame is filled with [`POISON`] (bit 0 clear: an invalid
//! descriptor at every level) and its generation counter is bumped, so a
//! reader can tell that a table it is reading was freed under it.

use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use tlb_batch::{DetachedTable, Frame, MmTlbState, PageRange, PageSize, PageTable, Pte, TableTeardown};

use crate::mmu::{self, AF, DESC_TABLE_OR_PAGE, DESC_VALID, OUTPUT_ADDRESS, TEST_PAGE_FLAGS};
use crate::space::{to_descriptor, to_pte};
use crate::tlb;

/// The root-table entry the scenario's tables hang below (the other test
/// pages and the identity map use entries 0 and 1 at 4 KiB, entry 0 at
/// 64 KiB).
const ROOT_INDEX: u64 = 2;
/// Frames of the pool: data pages and tables of about four rounds, so the
/// next-fit allocator does not hand a frame out again soon after its free.
pub(crate) const POOL_FRAMES: usize = 160;
/// What a free frame holds in every word (bit 0 clear: never a valid
/// descriptor).
pub(crate) const POISON: u64 = 0xdead_f4ee_dead_f4ee;
/// A table descriptor (levels 0-2) or a page descriptor (level 3).
pub(crate) const TABLE_DESC: u64 = DESC_VALID | DESC_TABLE_OR_PAGE;

/// The shape of the tables at one granule (Arm ARM, the translation
/// granule's lookup levels; `mmu64.rs` cites them for 64 KiB).
#[derive(Clone, Copy)]
pub(crate) struct Geometry {
    /// log2 of a page, of a table, and of a pool frame: 12 or 16.
    page_shift: u32,
    /// Address bits each table level resolves: 9 (512 entries) or 13
    /// (8192).
    bits: u32,
    /// The level of the kernel's root table: 0 or 1 (at T0SZ = 16).
    pub(crate) root_level: usize,
}

impl Geometry {
    /// This boot's.
    pub(crate) fn get() -> Self {
        if mmu::granule64() {
            Geometry {
                page_shift: 16,
                bits: 13,
                root_level: 1,
            }
        } else {
            Geometry {
                page_shift: 12,
                bits: 9,
                root_level: 0,
            }
        }
    }

    /// Bytes in a page, a table and a pool frame.
    pub(crate) fn page_bytes(self) -> u64 {
        1 << self.page_shift
    }

    /// Entries of a (non-root) table.
    pub(crate) fn entries(self) -> u64 {
        1 << self.bits
    }

    /// The lowest address bit that a table of `level` resolves.
    fn shift(self, level: usize) -> u32 {
        self.page_shift + self.bits * (3 - level as u32)
    }

    /// The index of `va` in its table of `level` (the root's level ... 3:
    /// leaf).
    pub(crate) fn index(self, va: u64, level: usize) -> u64 {
        (va >> self.shift(level)) & (self.entries() - 1)
    }

    /// What a table of `level` maps (for the root: more than the VA
    /// space).
    pub(crate) fn reach(self, level: usize) -> u64 {
        1 << (self.shift(level) + self.bits)
    }

    /// Entries of the root table: 512 at level 0, 64 at level 1 (48-bit
    /// VAs).
    fn root_entries(self) -> u64 {
        1 << (48 - self.shift(self.root_level))
    }

    /// The first page of the scenario: the start of root entry
    /// [`ROOT_INDEX`]'s span.
    pub(crate) fn base(self) -> u64 {
        ROOT_INDEX << self.shift(self.root_level)
    }

    /// What the level 2 table maps: the range torn down each round (1 GiB
    /// or 4 TiB).
    pub(crate) fn span(self) -> u64 {
        self.reach(2)
    }

    /// Tables between the root and the level 2 table, which stay
    /// allocated once made: the level 1 table at 4 KiB, none at 64 KiB.
    pub(crate) fn kept_tables(self) -> usize {
        1 - self.root_level
    }
}

#[repr(C, align(4096))]
struct PoolFrame([AtomicU64; 512]);

/// A 64 KiB frame of the pool for the 64 KiB granule.
#[repr(C, align(65536))]
struct PoolFrame64([AtomicU64; 8192]);

static POOL: [PoolFrame; POOL_FRAMES] =
    [const { PoolFrame([const { AtomicU64::new(0) }; 512]) }; POOL_FRAMES];
/// The pool's frames with the 64 KiB granule (10 MiB): in a section of
/// their own after every other static (`linker.ld`), so that the 4 KiB
/// run's statics and the 64 KiB frames of the other scenarios keep their
/// places.
#[link_section = ".bss_pool.teardown"]
static POOL_64K: [PoolFrame64; POOL_FRAMES] =
    [const { PoolFrame64([const { AtomicU64::new(0) }; 8192]) }; POOL_FRAMES];
static USED: [AtomicBool; POOL_FRAMES] = [const { AtomicBool::new(false) }; POOL_FRAMES];
/// How many times each frame was freed.
static GENERATION: [AtomicU64; POOL_FRAMES] = [const { AtomicU64::new(0) }; POOL_FRAMES];
static NEXT_FIT: AtomicUsize = AtomicUsize::new(0);
static IN_USE: AtomicUsize = AtomicUsize::new(0);
static POOL_READY: AtomicBool = AtomicBool::new(false);

/// The words of frame `i` of this granule's pool.
fn frame(i: usize) -> &'static [AtomicU64] {
    if mmu::granule64() {
        &POOL_64K[i].0
    } else {
        &POOL[i].0
    }
}

fn pool_index(pa: u64) -> Option<usize> {
    let bytes = Geometry::get().page_bytes();
    let i = (pa.checked_sub(frame(0).as_ptr() as u64)? / bytes) as usize;
    (i < POOL_FRAMES).then_some(i)
}

/// The descriptor word at physical (= virtual) address `pa`, when it lies
/// in the root table or in the pool; `None` elsewhere.
pub(crate) fn word(pa: u64) -> Option<&'static AtomicU64> {
    if !pa.is_multiple_of(8) {
        return None;
    }
    let g = Geometry::get();
    let root = mmu::root();
    if (root..root + g.root_entries() * 8).contains(&pa) {
        return Some(mmu::root_entry(((pa - root) / 8) as usize));
    }
    let i = pool_index(pa)?;
    Some(&frame(i)[((pa % g.page_bytes()) / 8) as usize])
}

fn fill(i: usize, value: u64) {
    for w in frame(i) {
        w.store(value, Ordering::Relaxed);
    }
}

/// A zeroed frame of the pool (its address), next-fit.
pub(crate) fn alloc() -> Option<u64> {
    let start = NEXT_FIT.load(Ordering::Relaxed);
    for k in 0..POOL_FRAMES {
        let i = (start + k) % POOL_FRAMES;
        if !USED[i].swap(true, Ordering::AcqRel) {
            NEXT_FIT.store(i + 1, Ordering::Relaxed);
            fill(i, 0);
            IN_USE.fetch_add(1, Ordering::SeqCst);
            // The zeroes are stored before the frame is linked anywhere.
            core::sync::atomic::fence(Ordering::Release);
            return Some(frame(i).as_ptr() as u64);
        }
    }
    None
}

/// Returns a frame to the pool: its generation bumped, then poisoned.
pub(crate) fn free(pa: u64) {
    let Some(i) = pool_index(pa) else {
        crate::fatal("teardown: freeing a frame outside the pool");
    };
    GENERATION[i].fetch_add(1, Ordering::SeqCst);
    fill(i, POISON);
    if !USED[i].swap(false, Ordering::AcqRel) {
        crate::fatal("teardown: double free of a pool frame");
    }
    IN_USE.fetch_sub(1, Ordering::SeqCst);
}

/// Fills the whole pool with [`POISON`], once, before its first use.
pub(crate) fn prepare_pool() {
    if !POOL_READY.swap(true, Ordering::SeqCst) {
        for i in 0..POOL_FRAMES {
            fill(i, POISON);
        }
    }
}

/// Frames of the pool handed out and not freed.
pub(crate) fn in_use() -> usize {
    IN_USE.load(Ordering::SeqCst)
}

/// How many times the frame holding `pa` was freed (0 outside the pool).
pub(crate) fn generation(pa: u64) -> u64 {
    pool_index(pa).map_or(0, |i| GENERATION[i].load(Ordering::SeqCst))
}

/// The scenario's address space: the test address space's `MmTlbState`,
/// below the root entry [`ROOT_INDEX`].
pub struct TeardownSpace;

impl TeardownSpace {
    /// The slot of `va`'s entry in its table of `level`, allocating the
    /// missing tables above it when `create`; `None` when one is missing
    /// (or the pool is exhausted).
    fn slot(&self, va: u64, level: usize, create: bool) -> Option<&'static AtomicU64> {
        let g = Geometry::get();
        let mut table = mmu::root();
        for l in g.root_level..level {
            let e = word(table + g.index(va, l) * 8)?;
            let mut v = e.load(Ordering::Acquire);
            if v & TABLE_DESC != TABLE_DESC {
                if !create {
                    return None;
                }
                v = alloc()? | TABLE_DESC;
                e.store(v, Ordering::Release);
            }
            table = v & OUTPUT_ADDRESS;
        }
        word(table + g.index(va, level) * 8)
    }

    /// Maps `va` to the frame at `pa`, writable, like the other test pages.
    pub(crate) fn map(&self, va: u64, pa: u64) {
        let Some(slot) = self.slot(va, 3, true) else {
            crate::fatal("teardown: the frame pool is exhausted");
        };
        slot.store(pa | TEST_PAGE_FLAGS, Ordering::Release);
    }
}

// SAFETY: `exchange` and `test_and_clear_accessed` are single atomic
// operations on the descriptor, so an access flag the hardware sets
// (TCR_EL1.HA where the CPU has it; HD acts only on descriptors with DBM,
// which these tables never hold) is never lost; `lookup`
// reads the descriptor as it is and the conversions are space.rs's, which
// report every writable page dirty as the crate's aarch64 `Arch` needs;
// the state is the test address space's, whose ASID and root (the root
// these tables hang below) every CPU loaded with `switch_mm`;
// `entry_size` answers the granule's page, the only size these tables
// map; `next_populated` skips only spans under a missing table and leaf
// entries that hold 0, where every entry is empty; only CPU 0 changes
// these tables, one call at a time, so the default `with_table_locked` is
// right.
unsafe impl PageTable for TeardownSpace {
    fn tlb_state(&self) -> &MmTlbState {
        tlb::mm()
    }

    fn lookup(&self, va: u64) -> Pte {
        self.slot(va, 3, false)
            .map_or(Pte::EMPTY, |s| to_pte(s.load(Ordering::Acquire)))
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        self.slot(va, 3, false).map_or(Pte::EMPTY, |s| {
            to_pte(s.swap(to_descriptor(new), Ordering::AcqRel))
        })
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        self.slot(va, 3, false)
            .is_some_and(|s| s.fetch_and(!AF, Ordering::AcqRel) & AF != 0)
    }

    fn set(&self, va: u64, pte: Pte) {
        if let Some(s) = self.slot(va, 3, false) {
            s.store(to_descriptor(pte), Ordering::Release);
        }
    }

    fn entry_size(&self, _va: u64) -> PageSize {
        mmu::page_size()
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        let g = Geometry::get();
        let last = range.last()?;
        let mut va = range.start();
        'outer: while va <= last {
            // Step over the span of the highest missing table.
            for level in g.root_level..3 {
                let linked = self
                    .slot(va, level, false)
                    .is_some_and(|s| s.load(Ordering::Acquire) & TABLE_DESC == TABLE_DESC);
                if !linked {
                    let span = g.reach(level + 1);
                    va = (va | (span - 1)).checked_add(1)?;
                    continue 'outer;
                }
            }
            // The leaf table is there: step over its entries that hold 0
            // (an empty `Pte`'s descriptor), up to its end. A 64 KiB leaf
            // table spans 512 MiB: without this a teardown would look up
            // every empty entry of it, sixteen times (once per 4 KiB the
            // crate steps by).
            let table_last = va | (g.reach(3) - 1);
            while va <= last.min(table_last) {
                if self
                    .slot(va, 3, false)
                    .is_some_and(|s| s.load(Ordering::Acquire) != 0)
                {
                    return Some(va);
                }
                va = (va | (g.page_bytes() - 1)).checked_add(1)?;
            }
        }
        None
    }
}

// SAFETY: `detach_table` unlinks (one atomic store of an invalid
// descriptor) a level 3 or level 2 table whose whole reach lies in
// `range`, leaf tables first, so a level 2 table goes only once no leaf
// table is linked below it (at 64 KiB the entry that links the level 2
// table is root entry `ROOT_INDEX`, the scenario's alone); the frame it
// hands over was allocated for that table alone and nothing else frees
// it. A present page descriptor held
// the only claim on its pool frame: each data frame is mapped once, at
// the page it was allocated for.
unsafe impl TableTeardown for TeardownSpace {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        let g = Geometry::get();
        let end = range.start().checked_add(range.pages() * 4096)?;
        for level in [3, 2] {
            let span = g.reach(level);
            let mut va = range.start().checked_add(span - 1)? & !(span - 1);
            while va.checked_add(span).is_some_and(|e| e <= end) {
                // The entry that links a table of `level` is in the one
                // above it.
                let Some(above) = self.slot(va, level - 1, false) else {
                    // No table of `level - 1` here: step over its reach.
                    va = (va | (g.reach(level - 1) - 1)).checked_add(1)?;
                    continue;
                };
                let v = above.load(Ordering::Acquire);
                if v & TABLE_DESC == TABLE_DESC {
                    above.store(0, Ordering::SeqCst);
                    // A walk started before this point may still hold the
                    // table; one started after it finds the entry empty.
                    crate::teardown::note_detach();
                    return Some(DetachedTable {
                        frame: Frame((v & OUTPUT_ADDRESS) >> 12),
                        range: PageRange::from_bounds(va, va + span).ok()?,
                    });
                }
                va += span;
            }
        }
        None
    }
}
