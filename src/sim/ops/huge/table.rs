//! The huge address space's page table: per 2 MiB region one upper entry
//! (empty, a 2 MiB leaf, or the link to a leaf table of 512 entries) and
//! the storage of that leaf table. The simulated MMU walks it (it is
//! attached as a kernel-written table, [`MmuTable`]), the crate changes it
//! ([`PageTable`], [`TableTeardown`]), and [`HugeRmap`] finds a frame's
//! mapping in it.

use core::ops::ControlFlow;
use core::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::vec::Vec;

use super::{region_va, HUGE, REGIONS};
use crate::gather::{DetachedTable, TableTeardown};
use crate::mm::MmTlbState;
use crate::page_size::PageSize;
use crate::pte::{Frame, Pte, PteFlags, PAGE_SHIFT, PAGE_SIZE};
use crate::range::{PageRange, TABLE_PAGES};
use crate::rmap::{Mapping, MappingFlags, PageTable, Rmap};
use crate::sim::{MmuTable, MockMachine, Model};

/// The bit that marks an upper entry as a 2 MiB leaf (x86's page-size bit;
/// no [`PteFlags`] bit uses it). Without it a present upper entry links a
/// leaf table, whose frame it names.
pub(super) const HUGE_BIT: u64 = 1 << 7;

/// What an upper entry word says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Upper {
    /// Nothing mapped in the region.
    Empty,
    /// A 2 MiB entry: the entry in its 4 KiB view (the huge bit taken off).
    Huge(Pte),
    /// A leaf table, in this frame.
    Table(Frame),
}

pub(super) fn upper(word: u64) -> Upper {
    if word & PteFlags::PRESENT.bits() == 0 {
        Upper::Empty
    } else if word & HUGE_BIT != 0 {
        Upper::Huge(Pte(word & !HUGE_BIT))
    } else {
        Upper::Table(Pte(word).frame())
    }
}

/// The word of an upper entry that links the leaf table in `frame`.
pub(super) fn table_link(frame: Frame) -> u64 {
    Pte::new(frame, PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::USER).0
}

/// The word of a 2 MiB entry whose 4 KiB view is `pte` (empty stays empty).
pub(super) fn huge_word(pte: Pte) -> u64 {
    if pte == Pte::EMPTY {
        0
    } else {
        pte.0 | HUGE_BIT
    }
}

/// One region: its upper entry and its leaf table's entries (meaningful
/// while the upper entry links the table, and, after a promotion's break,
/// until its make has read them).
pub(super) struct Region {
    pub(super) upper: AtomicU64,
    pub(super) leaf: Vec<AtomicU64>,
}

/// The huge space's table.
pub(super) struct HugeTable {
    pub(super) regions: Vec<Region>,
}

impl HugeTable {
    pub(super) fn new() -> Self {
        HugeTable {
            regions: (0..REGIONS)
                .map(|_| Region {
                    upper: AtomicU64::new(0),
                    leaf: (0..TABLE_PAGES).map(|_| AtomicU64::new(0)).collect(),
                })
                .collect(),
        }
    }

    /// The region of `va` and the index of its 4 KiB page there.
    fn locate(&self, va: u64) -> Option<(&Region, usize)> {
        let offset = va.checked_sub(region_va(0))?;
        let region = self.regions.get(usize::try_from(offset / HUGE.bytes()).ok()?)?;
        Some((region, ((offset % HUGE.bytes()) >> PAGE_SHIFT) as usize))
    }

    pub(super) fn upper_of(&self, va: u64) -> Upper {
        self.locate(va)
            .map_or(Upper::Empty, |(r, _)| upper(r.upper.load(Ordering::SeqCst)))
    }
}

impl MmuTable for HugeTable {
    fn entry(&self, va: u64) -> Option<&AtomicU64> {
        let (r, i) = self.locate(va)?;
        match upper(r.upper.load(Ordering::SeqCst)) {
            Upper::Table(_) => r.leaf.get(i),
            _ => None,
        }
    }

    fn leaf(&self, va: u64) -> Option<(&AtomicU64, PageSize)> {
        let (r, i) = self.locate(va)?;
        match upper(r.upper.load(Ordering::SeqCst)) {
            Upper::Empty => None,
            Upper::Huge(_) => Some((&r.upper, HUGE)),
            Upper::Table(_) => r.leaf.get(i).map(|e| (e, PageSize::SIZE_4K)),
        }
    }

    fn table_frame(&self, va: u64) -> Option<Frame> {
        match self.upper_of(va) {
            Upper::Table(frame) => Some(frame),
            _ => None,
        }
    }
}

/// The huge space as the crate's [`PageTable`]: a 2 MiB entry is taken
/// whole at its first address, in its 4 KiB view.
pub(super) struct HugeSpace {
    pub(super) table: Arc<HugeTable>,
    pub(super) mm: Arc<MmTlbState>,
}

impl HugeSpace {
    /// Runs `f` on the word that holds `va`'s entry and tells whether it
    /// is a 2 MiB one; for a piece of a 2 MiB page other than its first,
    /// `None` (the crate changes a huge entry only at its first address).
    fn with_word<R>(&self, va: u64, f: impl FnOnce(&AtomicU64, bool) -> R) -> Option<R> {
        let (r, i) = self.table.locate(va)?;
        match upper(r.upper.load(Ordering::SeqCst)) {
            Upper::Empty => None,
            Upper::Huge(_) => (i == 0).then(|| f(&r.upper, true)),
            Upper::Table(_) => r.leaf.get(i).map(|e| f(e, false)),
        }
    }
}

/// A word as the crate sees it: a 2 MiB entry without its huge bit.
fn view(word: u64, huge: bool) -> Pte {
    if huge {
        Pte(word & !HUGE_BIT)
    } else {
        Pte(word)
    }
}

// SAFETY: every change is one atomic operation (swap, fetch_and, store) on
// the word the simulated MMU reads and updates (its A/D bits) with its own
// atomic read-modify-write: the upper entry for a 2 MiB page, the leaf
// entry otherwise; `tlb_state` is the space the table is attached to;
// `entry_size` answers 2 MiB wherever a 2 MiB entry maps the address, and
// `next_populated` skips only regions and entries that are empty.
unsafe impl PageTable for HugeSpace {
    fn tlb_state(&self) -> &MmTlbState {
        &self.mm
    }

    fn lookup(&self, va: u64) -> Pte {
        let Some((r, i)) = self.table.locate(va) else {
            return Pte::EMPTY;
        };
        match upper(r.upper.load(Ordering::SeqCst)) {
            Upper::Empty => Pte::EMPTY,
            // Another piece of a huge page: its 4 KiB view.
            Upper::Huge(pte) => Pte(pte.0 + i as u64 * PAGE_SIZE),
            Upper::Table(_) => r
                .leaf
                .get(i)
                .map_or(Pte::EMPTY, |e| Pte(e.load(Ordering::SeqCst))),
        }
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        self.with_word(va, |w, huge| {
            let stored = if huge { huge_word(new) } else { new.0 };
            view(w.swap(stored, Ordering::SeqCst), huge)
        })
        .unwrap_or(Pte::EMPTY)
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        let bit = PteFlags::ACCESSED.bits();
        self.with_word(va, |w, _| w.fetch_and(!bit, Ordering::SeqCst) & bit != 0)
            .unwrap_or(false)
    }

    fn set(&self, va: u64, pte: Pte) {
        self.with_word(va, |w, huge| {
            w.store(if huge { huge_word(pte) } else { pte.0 }, Ordering::SeqCst)
        });
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        let last = range.last()?;
        let mut va = range.start();
        while va <= last {
            let Some((r, i)) = self.table.locate(va) else {
                // Below the space: on to its first region; above: done.
                if va < region_va(0) {
                    va = region_va(0);
                    continue;
                }
                return None;
            };
            match upper(r.upper.load(Ordering::SeqCst)) {
                Upper::Huge(_) => return Some(va),
                Upper::Table(_) => {
                    if let Some(j) = (i..r.leaf.len()).find(|&j| r.leaf[j].load(Ordering::SeqCst) != 0) {
                        let found = va + (j - i) as u64 * PAGE_SIZE;
                        return (found <= last).then_some(found);
                    }
                }
                Upper::Empty => {}
            }
            va = (va & !(HUGE.bytes() - 1)) + HUGE.bytes();
        }
        None
    }

    fn entry_size(&self, va: u64) -> PageSize {
        match self.table.upper_of(va) {
            Upper::Huge(_) => HUGE,
            _ => PageSize::SIZE_4K,
        }
    }

    fn root(&self) -> Option<u64> {
        Some(self.mm.root())
    }
}

// SAFETY: `detach_table` hands out only a leaf table whose region lies
// wholly in `range` and all of whose entries are empty, unlinking it with
// one compare-exchange of its upper entry (nothing else writes the leaf
// while the driver's step runs), and reports the region's whole span.
unsafe impl TableTeardown for HugeSpace {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        let last = range.last()?;
        for (n, r) in self.table.regions.iter().enumerate() {
            let start = region_va(n);
            let word = r.upper.load(Ordering::SeqCst);
            let Upper::Table(frame) = upper(word) else {
                continue;
            };
            let inside = start >= range.start() && start + (HUGE.bytes() - 1) <= last;
            if !inside || r.leaf.iter().any(|e| e.load(Ordering::SeqCst) != 0) {
                continue;
            }
            if r.upper
                .compare_exchange(word, 0, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                return Some(DetachedTable {
                    frame,
                    range: PageRange::new(start, TABLE_PAGES).ok()?,
                });
            }
        }
        None
    }
}

/// The huge space's reverse map: a frame's one mapping, read from the
/// table (the space's frames are mapped once each). A 2 MiB frame's first
/// frame is mapped at the region's first address; any other frame of it,
/// at its piece (which the crate refuses).
pub(super) struct HugeRmap<'s, 'm, M: Model> {
    pub(super) space: &'s HugeSpace,
    pub(super) m: &'m MockMachine<M>,
}

impl<M: Model> HugeRmap<'_, '_, M> {
    /// The address `frame` is mapped at (present, or a migration entry
    /// naming it), if any.
    pub(super) fn find(&self, frame: Frame) -> Option<u64> {
        for (n, r) in self.space.table.regions.iter().enumerate() {
            match upper(r.upper.load(Ordering::SeqCst)) {
                Upper::Empty => {}
                Upper::Huge(pte) => {
                    let offset = frame.0.wrapping_sub(pte.frame().0);
                    if offset < HUGE.base_pages() {
                        return Some(region_va(n) + offset * PAGE_SIZE);
                    }
                }
                Upper::Table(_) => {
                    let i = r.leaf.iter().position(|e| {
                        let pte = Pte(e.load(Ordering::SeqCst));
                        pte != Pte::EMPTY && pte.frame() == frame
                    });
                    if let Some(i) = i {
                        return Some(region_va(n) + i as u64 * PAGE_SIZE);
                    }
                }
            }
        }
        None
    }
}

// SAFETY: `walk` reports the one mapping the table holds for the frame (the
// space maps each frame once and is its only space), read while the
// driver's step, which holds every lock the model has, runs.
unsafe impl<M: Model> Rmap for HugeRmap<'_, '_, M> {
    type Space = HugeSpace;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, HugeSpace>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        match self.find(frame) {
            Some(va) => visit(Mapping {
                space: self.space,
                va,
                flags: MappingFlags::empty(),
            }),
            None => ControlFlow::Continue(()),
        }
    }

    fn set_dirty(&self, frame: Frame) {
        let _ = self.m.set_frame_dirty(frame);
    }
}
