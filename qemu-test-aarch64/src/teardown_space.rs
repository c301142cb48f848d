//! The teardown scenario's address space (`teardown.rs`): page tables
//! grown on demand from a poisoning frame pool, below an entry of their
//! own of the kernel's root table, as the crate's `PageTable` and
//! `TableTeardown` see them.
//!
//! The scenario's pages hang below a level 0 entry of their own
//! ([`ROOT_INDEX`]) of the kernel's root table, in level 1-3 tables taken
//! from a small frame pool ([`POOL_FRAMES`] 4 KiB frames, identity-mapped
//! like all of RAM), the way a hobby kernel grows its tables on demand:
//! [`TeardownSpace::map`] allocates the missing tables on the way down and
//! writes a page descriptor with the same attributes as the other test
//! pages (non-global, so tagged with the test ASID; writable).
//!
//! A freed frame is filled with [`POISON`] (bit 0 clear: an invalid
//! descriptor at every level) and its generation counter is bumped, so a
//! reader can tell that a table it is reading was freed under it.

use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use tlb_batch::{DetachedTable, Frame, MmTlbState, PageRange, PageTable, Pte, TableTeardown};

use crate::mmu::{self, AF, DESC_TABLE_OR_PAGE, DESC_VALID, OUTPUT_ADDRESS, TEST_PAGE_FLAGS};
use crate::space::{to_descriptor, to_pte};
use crate::tlb;

/// The root-table entry the scenario's tables hang below (the other test
/// pages use entry 1, the identity map entry 0).
const ROOT_INDEX: usize = 2;
/// The first page of the scenario.
pub(crate) const BASE: u64 = (ROOT_INDEX as u64) << 39;
/// What the level 2 table maps: the range torn down each round.
pub(crate) const SPAN: u64 = 1 << 30;
/// Frames of the pool: data pages and tables of about four rounds, so the
/// next-fit allocator does not hand a frame out again soon after its free.
pub(crate) const POOL_FRAMES: usize = 160;
/// What a free frame holds in every word (bit 0 clear: never a valid
/// descriptor).
pub(crate) const POISON: u64 = 0xdead_f4ee_dead_f4ee;
/// A table descriptor (levels 0-2) or a page descriptor (level 3).
pub(crate) const TABLE_DESC: u64 = DESC_VALID | DESC_TABLE_OR_PAGE;

#[repr(C, align(4096))]
struct PoolFrame([AtomicU64; 512]);

static POOL: [PoolFrame; POOL_FRAMES] =
    [const { PoolFrame([const { AtomicU64::new(0) }; 512]) }; POOL_FRAMES];
static USED: [AtomicBool; POOL_FRAMES] = [const { AtomicBool::new(false) }; POOL_FRAMES];
/// How many times each frame was freed.
static GENERATION: [AtomicU64; POOL_FRAMES] = [const { AtomicU64::new(0) }; POOL_FRAMES];
static NEXT_FIT: AtomicUsize = AtomicUsize::new(0);
static IN_USE: AtomicUsize = AtomicUsize::new(0);
static POOL_READY: AtomicBool = AtomicBool::new(false);

fn pool_index(pa: u64) -> Option<usize> {
    let i = (pa.checked_sub(POOL.as_ptr() as u64)? / 4096) as usize;
    (i < POOL_FRAMES).then_some(i)
}

/// The descriptor word at physical (= virtual) address `pa`, when it lies
/// in the root table or in the pool; `None` elsewhere.
pub(crate) fn word(pa: u64) -> Option<&'static AtomicU64> {
    if !pa.is_multiple_of(8) {
        return None;
    }
    let root = mmu::root();
    if (root..root + 4096).contains(&pa) {
        return Some(mmu::root_entry(((pa - root) / 8) as usize));
    }
    let i = pool_index(pa)?;
    Some(&POOL[i].0[((pa % 4096) / 8) as usize])
}

fn fill(i: usize, value: u64) {
    for w in &POOL[i].0 {
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
            return Some(POOL[i].0.as_ptr() as u64);
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

/// The index of `va` in its table of `level` (0: the root ... 3: leaf).
pub(crate) fn index(va: u64, level: usize) -> u64 {
    (va >> (39 - 9 * level)) & 511
}

/// What a table of `level` maps.
pub(crate) fn reach(level: usize) -> u64 {
    1 << (39 + 9 - 9 * level)
}

/// The scenario's address space: the test address space's `MmTlbState`,
/// below the root entry [`ROOT_INDEX`].
pub struct TeardownSpace;

impl TeardownSpace {
    /// The slot of `va`'s entry in its table of `level`, allocating the
    /// missing tables above it when `create`; `None` when one is missing
    /// (or the pool is exhausted).
    fn slot(&self, va: u64, level: usize, create: bool) -> Option<&'static AtomicU64> {
        let mut table = mmu::root();
        for l in 0..level {
            let e = word(table + index(va, l) * 8)?;
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
        word(table + index(va, level) * 8)
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
// `next_populated` skips only spans under a missing table, where every
// entry is empty; only CPU 0 changes these tables, one call at a time,
// so the default `with_table_locked` is right.
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

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        let last = range.last()?;
        let mut va = range.start();
        'outer: while va <= last {
            // Step over the span of the highest missing table.
            for level in 0..3 {
                let linked = self
                    .slot(va, level, false)
                    .is_some_and(|s| s.load(Ordering::Acquire) & TABLE_DESC == TABLE_DESC);
                if !linked {
                    let span = reach(level + 1);
                    va = (va | (span - 1)).checked_add(1)?;
                    continue 'outer;
                }
            }
            return Some(va);
        }
        None
    }
}

// SAFETY: `detach_table` unlinks (one atomic store of an invalid
// descriptor) a level 3 or level 2 table whose whole reach lies in
// `range`, leaf tables first, so a level 2 table goes only once no leaf
// table is linked below it; the frame it hands over was allocated for that
// table alone and nothing else frees it. A present page descriptor held
// the only claim on its pool frame: each data frame is mapped once, at
// the page it was allocated for.
unsafe impl TableTeardown for TeardownSpace {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        let end = range.start().checked_add(range.pages() * 4096)?;
        for level in [3, 2] {
            let span = reach(level);
            let mut va = range.start().checked_add(span - 1)? & !(span - 1);
            while va.checked_add(span).is_some_and(|e| e <= end) {
                // The entry that links a table of `level` is in the one
                // above it.
                let Some(above) = self.slot(va, level - 1, false) else {
                    // No table of `level - 1` here: step over its reach.
                    va = (va | (reach(level - 1) - 1)).checked_add(1)?;
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
