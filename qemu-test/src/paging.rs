//! Real 4-level x86-64 page tables owned by the test kernel, a frame pool
//! that poisons what it frees, and the crate's traits implemented on top:
//! [`PageTable`] and [`TableTeardown`] for [`Space`], [`Rmap`] for
//! [`SpaceRmap`], [`FreeFrames`] for [`Pool`].
//!
//! # Layout
//!
//! Each [`Space`] is a separate address space with its own PML4 (at a fixed
//! physical frame, so that its `MmTlbState` can be a `static`) and its own
//! ASID. Its PML4 entry 0 is a copy of the boot PML4's entry 0, so the
//! kernel's identity mapping of the low 4 GiB (code, data, stacks, the
//! APIC, the pool itself) is shared and a CPU can switch into the space with
//! the crate's `switch_mm` and keep running. Test pages live above 512 GiB
//! (PML4 entries 1 and up), in tables allocated from the pool on demand.
//!
//! All physical memory used here is identity-mapped, so a table's entries
//! are reached through their physical address: that is how the crate's
//! calls, and the lockless walker of the teardown scenario, read them.
//!
//! # Poison
//!
//! Every frame in the pool is filled with [`POISON`] while it is free. A
//! write that lands in a free frame (through a stale TLB entry) breaks the
//! pattern: [`alloc`] counts such frames in [`stale_in_free`] before it
//! hands the frame out, and scenarios check the frames they freed with
//! [`poison_broken`]. Freeing also bumps the frame's generation, so a
//! lockless reader can tell that a table it is reading was freed under it.

use core::ops::ControlFlow;
use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use tlb_batch::heapless;
use tlb_batch::{
    Asid, DetachedTable, Frame, FreeFrames, Mapping, MappingFlags, MmTlbState, OwnedFrame, PageRange,
    PageTable, Pte, Rmap, TableTeardown,
};

/// The pattern of a free frame (bit 0 clear: never a present entry).
pub const POISON: u64 = 0xdead_f4ee_dead_f4ee;
/// First pool frame (physical; identity-mapped RAM above the kernel, the
/// old test frames and the fixed roots).
pub const POOL_BASE: u64 = 0x0400_0000;
/// Frames in the pool (48 MiB).
pub const POOL_FRAMES: usize = 12288;
/// Fixed PML4 frames of the spaces, below the pool.
pub const ROOTS_BASE: u64 = 0x03f0_0000;

const WORDS: usize = 512;
/// Present and writable: intermediate entries and test pages.
pub const PRESENT_WRITABLE: u64 = 0x3;
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;

static USED: [AtomicU64; POOL_FRAMES / 64] = [const { AtomicU64::new(0) }; POOL_FRAMES / 64];
static GENERATION: [AtomicU64; POOL_FRAMES] = [const { AtomicU64::new(0) }; POOL_FRAMES];
/// Where each pool frame is mapped (0: nowhere), for the reverse map.
static MAPPED_AT: [AtomicU64; POOL_FRAMES] = [const { AtomicU64::new(0) }; POOL_FRAMES];
/// The page state: dirty (a dirty PTE's bit moved here on unmap).
static DIRTY: [AtomicBool; POOL_FRAMES] = [const { AtomicBool::new(false) }; POOL_FRAMES];
static NEXT_FIT: AtomicUsize = AtomicUsize::new(0);
static STALE_IN_FREE: AtomicU64 = AtomicU64::new(0);
static IN_USE: AtomicUsize = AtomicUsize::new(0);

/// The word at physical address `pa`, which must lie in the fixed roots
/// or the pool (anything else is a test bug: fatal).
pub fn word(pa: u64) -> &'static AtomicU64 {
    if !(ROOTS_BASE..POOL_BASE + POOL_FRAMES as u64 * 4096).contains(&pa) || !pa.is_multiple_of(8) {
        crate::fatal("a page-table word outside the test kernel's frames");
    }
    // SAFETY: checked just above: an 8-byte aligned word of the RAM set
    // aside for the spaces' roots and the pool, identity-mapped and used
    // by nothing else, for the whole run; every access to it is atomic.
    unsafe { &*(pa as *const AtomicU64) }
}

fn index_of(pa: u64) -> Option<usize> {
    let i = (pa.checked_sub(POOL_BASE)? / 4096) as usize;
    (i < POOL_FRAMES).then_some(i)
}

fn fill(pa: u64, value: u64) {
    for w in 0..WORDS as u64 {
        word(pa + w * 8).store(value, Ordering::Relaxed);
    }
}

/// Words of the frame at `pa` that do not hold [`POISON`].
pub fn poison_broken(pa: u64) -> usize {
    (0..WORDS as u64)
        .filter(|w| word(pa + w * 8).load(Ordering::Relaxed) != POISON)
        .count()
}

/// Poisons the whole pool; call once at boot, before any other use.
pub fn init_pool() {
    for i in 0..POOL_FRAMES as u64 {
        fill(POOL_BASE + i * 4096, POISON);
    }
}

/// Free frames found with their poison broken when they were allocated
/// (writes that landed in a free frame), since boot.
pub fn stale_in_free() -> u64 {
    STALE_IN_FREE.load(Ordering::SeqCst)
}

/// Pool frames allocated now.
pub fn in_use() -> usize {
    IN_USE.load(Ordering::SeqCst)
}

/// A zeroed frame from the pool (physical address), next-fit so that a
/// freed frame is not handed out again at once.
pub fn alloc() -> Option<u64> {
    let start = NEXT_FIT.load(Ordering::Relaxed);
    for k in 0..POOL_FRAMES {
        let i = (start + k) % POOL_FRAMES;
        let bit = 1u64 << (i % 64);
        if USED[i / 64].fetch_or(bit, Ordering::AcqRel) & bit == 0 {
            NEXT_FIT.store(i + 1, Ordering::Relaxed);
            let pa = POOL_BASE + i as u64 * 4096;
            if poison_broken(pa) != 0 {
                STALE_IN_FREE.fetch_add(1, Ordering::SeqCst);
            }
            fill(pa, 0);
            DIRTY[i].store(false, Ordering::SeqCst);
            MAPPED_AT[i].store(0, Ordering::SeqCst);
            IN_USE.fetch_add(1, Ordering::SeqCst);
            return Some(pa);
        }
    }
    None
}

/// Returns a frame to the pool: poisoned, its generation bumped, its
/// reverse-map entry and page state dropped.
pub fn free(pa: u64) {
    let Some(i) = index_of(pa) else {
        crate::fatal("freeing a frame outside the pool");
    };
    MAPPED_AT[i].store(0, Ordering::SeqCst);
    DIRTY[i].store(false, Ordering::SeqCst);
    GENERATION[i].fetch_add(1, Ordering::SeqCst);
    fill(pa, POISON);
    let bit = 1u64 << (i % 64);
    if USED[i / 64].fetch_and(!bit, Ordering::AcqRel) & bit == 0 {
        crate::fatal("double free of a pool frame");
    }
    IN_USE.fetch_sub(1, Ordering::SeqCst);
}

/// How many times the frame at `pa` was freed (0 outside the pool).
pub fn generation(pa: u64) -> u64 {
    index_of(pa).map_or(0, |i| GENERATION[i].load(Ordering::SeqCst))
}

/// Whether the page of the frame at `pa` is dirty.
pub fn is_dirty(pa: u64) -> bool {
    index_of(pa).is_some_and(|i| DIRTY[i].load(Ordering::SeqCst))
}

/// Marks the page of the frame at `pa` clean (after its write-out).
pub fn set_clean(pa: u64) {
    if let Some(i) = index_of(pa) {
        DIRTY[i].store(false, Ordering::SeqCst);
    }
}

/// Marks the page of the frame at `pa` dirty.
pub fn set_dirty(pa: u64) {
    if let Some(i) = index_of(pa) {
        DIRTY[i].store(true, Ordering::SeqCst);
    }
}

/// Records that the frame at `pa` is mapped at `va` (0: nowhere).
pub fn set_mapped_at(pa: u64, va: u64) {
    if let Some(i) = index_of(pa) {
        MAPPED_AT[i].store(va, Ordering::SeqCst);
    }
}

/// The index of `va`'s entry in the table of `level` (4: PML4 ... 1: PT).
pub fn index(va: u64, level: u32) -> u64 {
    (va >> (12 + 9 * (level - 1))) & 511
}

/// The frame an intermediate or leaf entry points at.
pub fn entry_addr(entry: u64) -> u64 {
    entry & ADDR_MASK
}

/// One address space: its TLB state and its own 4-level page table.
pub struct Space {
    mm: MmTlbState,
}

impl Space {
    /// The space with this ASID whose PML4 is fixed root number `slot`.
    pub const fn new(asid: u16, slot: u64) -> Space {
        let asid = match Asid::new(asid) {
            Ok(a) => a,
            Err(_) => panic!("ASID out of range"),
        };
        Space {
            mm: MmTlbState::new(asid, ROOTS_BASE + slot * 4096),
        }
    }

    /// The PML4's physical address.
    pub fn root(&self) -> u64 {
        self.mm.root()
    }

    /// Sets up the PML4: empty but for entry 0, `kernel_entry`, the boot
    /// PML4's entry for the kernel's identity map. Call once, before any
    /// CPU loads it.
    pub fn init(&self, kernel_entry: u64) {
        fill(self.root(), 0);
        word(self.root()).store(kernel_entry, Ordering::SeqCst);
    }

    /// The slot of `va`'s entry at `level` (1: the PTE), allocating the
    /// tables above it when `create`; `None` when a table is missing.
    fn slot(&self, va: u64, level: u32, create: bool) -> Option<&'static AtomicU64> {
        let mut table = self.root();
        for l in (level + 1..=4).rev() {
            let e = word(table + index(va, l) * 8);
            let mut v = e.load(Ordering::SeqCst);
            if v & 1 == 0 {
                if !create {
                    return None;
                }
                let new = alloc()?;
                v = new | PRESENT_WRITABLE;
                e.store(v, Ordering::SeqCst);
            }
            table = entry_addr(v);
        }
        Some(word(table + index(va, level) * 8))
    }

    /// Maps `va` to the pool frame at `pa`, present and writable, and
    /// records it in the reverse map.
    pub fn map(&self, va: u64, pa: u64) {
        let Some(slot) = self.slot(va, 1, true) else {
            crate::fatal("the frame pool is exhausted");
        };
        set_mapped_at(pa, va);
        slot.store(pa | PRESENT_WRITABLE, Ordering::SeqCst);
    }

    /// Allocates and maps `n` pages from `base`; returns their frames.
    pub fn map_new(&self, base: u64, n: usize, frames: &mut [u64]) {
        for (i, f) in frames.iter_mut().enumerate().take(n) {
            let Some(pa) = alloc() else {
                crate::fatal("the frame pool is exhausted");
            };
            *f = pa;
            self.map(base + i as u64 * 4096, pa);
        }
    }
}

// SAFETY: every entry is an `AtomicU64` changed only by single atomic
// operations (swap, fetch_and, store), so an accessed or dirty bit the
// MMU sets concurrently is either in the value returned or kept in the
// new entry; `lookup` reads the entry as it is; the `MmTlbState` is the one
// whose ASID and root CPUs load for this table; `next_populated` skips
// only ranges under a missing intermediate table, where every entry is
// empty; the test kernel changes a space from one CPU at a time, so the
// default (lock-free) `with_table_locked` is right.
unsafe impl PageTable for Space {
    fn tlb_state(&self) -> &MmTlbState {
        &self.mm
    }

    fn lookup(&self, va: u64) -> Pte {
        self.slot(va, 1, false)
            .map_or(Pte::EMPTY, |s| Pte(s.load(Ordering::SeqCst)))
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        match self.slot(va, 1, false) {
            Some(s) => Pte(s.swap(new.0, Ordering::SeqCst)),
            None => Pte::EMPTY,
        }
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        const ACCESSED: u64 = 1 << 5;
        self.slot(va, 1, false)
            .is_some_and(|s| s.fetch_and(!ACCESSED, Ordering::SeqCst) & ACCESSED != 0)
    }

    fn set(&self, va: u64, pte: Pte) {
        if let Some(s) = self.slot(va, 1, false) {
            s.store(pte.0, Ordering::SeqCst);
        }
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        let last = range.last()?;
        let mut va = range.start();
        'outer: while va <= last {
            // Skip the span of the highest missing table on the way down.
            for level in (2..=4).rev() {
                if self
                    .slot(va, level, false)
                    .is_none_or(|s| s.load(Ordering::SeqCst) & 1 == 0)
                {
                    let span = 1u64 << (12 + 9 * (level - 1));
                    va = (va | (span - 1)).checked_add(1)?;
                    continue 'outer;
                }
            }
            return Some(va);
        }
        None
    }
}

// SAFETY: `detach_table` unlinks (one atomic store) a page table or page
// directory whose whole span lies in `range`, leaf tables first so that a
// directory is detached only once no table below it is linked, and hands
// over the frame, which nothing else frees; a present leaf entry held the
// only claim on its pool frame (each pool frame is mapped at most once).
unsafe impl TableTeardown for Space {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        let end = range.start().checked_add(range.pages() * 4096)?;
        for level in [2u32, 3] {
            let span = 1u64 << (12 + 9 * (level - 1));
            let mut va = (range.start() + span - 1) & !(span - 1);
            while va.checked_add(span).is_some_and(|e| e <= end) {
                if let Some(slot) = self.slot(va, level, false) {
                    let v = slot.load(Ordering::SeqCst);
                    if v & 1 != 0 {
                        slot.store(0, Ordering::SeqCst);
                        let table_range = PageRange::from_bounds(va, va + span).ok()?;
                        return Some(DetachedTable {
                            frame: Frame(entry_addr(v) >> 12),
                            range: table_range,
                        });
                    }
                }
                va += span;
            }
        }
        None
    }
}

/// The reverse map of one space's pool frames: each frame is mapped at
/// most once, at the address [`Space::map`] recorded.
pub struct SpaceRmap<'a> {
    /// The space every recorded mapping belongs to.
    pub space: &'a Space,
}

// SAFETY: `walk` visits the one place each pool frame can be mapped: the
// address recorded when it was mapped (migration moves the record with the
// mapping, and it is dropped only when the frame is freed).
unsafe impl Rmap for SpaceRmap<'_> {
    type Space = Space;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let va = index_of(frame.addr()).map_or(0, |i| MAPPED_AT[i].load(Ordering::SeqCst));
        if va == 0 {
            return ControlFlow::Continue(());
        }
        visit(Mapping {
            space: self.space,
            va,
            flags: MappingFlags::empty(),
        })
    }

    fn set_dirty(&self, frame: Frame) {
        set_dirty(frame.addr());
    }
}

/// Frees what the crate hands over, poisoning it; counts what it freed.
#[derive(Default)]
pub struct Pool {
    /// Data frames freed.
    pub freed: usize,
    /// Table frames freed.
    pub tables_freed: usize,
    /// Batched free calls.
    pub calls: usize,
    /// The data frames freed (the first 1024), to check their poison.
    pub log: heapless::Vec<u64, 1024>,
}

impl FreeFrames for Pool {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        self.calls += 1;
        while let Some(f) = frames.pop() {
            let pa = f.into_frame().addr();
            free(pa);
            let _ = self.log.push(pa);
            self.freed += 1;
        }
    }
}

impl tlb_batch::TeardownBacking for Pool {
    fn set_dirty(&mut self, frame: Frame) {
        set_dirty(frame.addr());
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        while let Some(f) = tables.pop() {
            free(f.into_frame().addr());
            self.tables_freed += 1;
        }
    }
}
