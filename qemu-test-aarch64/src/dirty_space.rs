//! The clean-write scenario's pages (`dirty.rs`) as the crate sees them:
//! their frames, the conversion of their descriptors (with DBM, and the
//! negative control's wrong one), their [`PageTable`] and their [`Rmap`].
//!
//! The pages are [`mmu::DIRTY_PAGES`] level 3 page descriptors at the start
//! of the test pages' leaf table: 4 KiB pages, or 64 KiB pages with the
//! 64 KiB granule (`granule64`), which [`DirtySpace::entry_size`] reports so
//! that the crate takes each whole, with one `TLBI`. Their frames are
//! 64 KiB-aligned and 64 KiB long, so they serve either granule (at 4 KiB
//! a page maps the first 4 KiB of its frame).

use core::ops::ControlFlow;
use core::sync::atomic::{AtomicU64, Ordering};

use tlb_batch::{Frame, Mapping, MappingFlags, MmTlbState, PageSize, PageTable, Pte, PteFlags, Rmap};

use crate::mmu::{self, AF, DIRTY_PAGES};
use crate::{space, tlb, MAX_CPUS};

/// A software bit of a page descriptor (bits 55-58 are ignored by the
/// hardware): set by the negative control on the pages it maps writable
/// yet wants reported clean.
pub const CLAIMED_CLEAN: u64 = 1 << 55;

/// A page's frame, 64 KiB-aligned and 64 KiB long.
#[repr(C, align(65536))]
pub struct DirtyFrame(pub [AtomicU64; 8192]);

/// Each page's frame. Word 0 holds the round's pattern; word `c` (1 to
/// [`MAX_CPUS`] - 1) is where observer `c` stores.
#[link_section = ".bss_tail.frames"]
pub static FRAMES: [DirtyFrame; DIRTY_PAGES] =
    [const { DirtyFrame([const { AtomicU64::new(0) }; 8192]) }; DIRTY_PAGES];
const _: () = assert!(MAX_CPUS <= 512);

/// The pages the crate reported dirty in the current round (a bit each).
pub static REPORTED_DIRTY: AtomicU64 = AtomicU64::new(0);

/// Page `page`'s frame, in the crate's 4 KiB frame numbers.
pub fn frame_of(page: usize) -> Frame {
    Frame(FRAMES[page].0.as_ptr() as u64 >> 12)
}

/// The aarch64 page descriptor for `pte`: a writable page gets DBM, and
/// AP\[2\] stays set (read-only) unless the page is writable and dirty.
pub fn to_descriptor(pte: Pte) -> u64 {
    space::descriptor(pte, true)
}

/// The crate's view of the descriptor `desc` ([`space::to_pte`]), except
/// that the negative control's [`CLAIMED_CLEAN`] bit hides the dirty
/// state: wrong, on purpose.
pub fn to_pte(desc: u64) -> Pte {
    let pte = space::to_pte(desc);
    if desc & CLAIMED_CLEAN != 0 && pte.is_present() {
        Pte::new(pte.frame(), pte.flags() - PteFlags::DIRTY)
    } else {
        pte
    }
}

/// Which of the scenario's pages `va` is, if any.
fn page_of(va: u64) -> Option<usize> {
    let page = (va.checked_sub(mmu::dirty_va(0))? / mmu::page_bytes()) as usize;
    (page < DIRTY_PAGES && va.is_multiple_of(mmu::page_bytes())).then_some(page)
}

fn entry(va: u64) -> Option<&'static AtomicU64> {
    page_of(va).map(mmu::dirty_pte)
}

/// The scenario's pages as the crate's reverse-map code sees them.
pub struct DirtySpace;

// SAFETY: the hardware writes these descriptors itself (it sets AP[2] = 0
// on a write, TCR_EL1.HD, and the access flag, TCR_EL1.HA), always by an
// atomic update; `exchange` and `test_and_clear_accessed` are single
// atomic operations, so no state the hardware set between a read and a
// write is lost, and `exchange` returns the descriptor as the hardware
// last left it, whose dirty state `to_pte` reports. `lookup` reads the
// descriptor as it is. The state is the test address space's, which every
// CPU loaded with `switch_mm` and whose root holds these tables. Only CPU
// 0 changes the descriptors (the observers' hardware only sets state in
// them), one call at a time, so the default `with_table_locked` and
// `next_populated` are right. (Under `negative-dirty` the conversion
// reports writable descriptors clean: the control's deliberate breach.)
unsafe impl PageTable for DirtySpace {
    fn tlb_state(&self) -> &MmTlbState {
        tlb::mm()
    }

    fn lookup(&self, va: u64) -> Pte {
        entry(va).map_or(Pte::EMPTY, |e| to_pte(e.load(Ordering::Acquire)))
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        entry(va).map_or(Pte::EMPTY, |e| {
            to_pte(e.swap(to_descriptor(new), Ordering::AcqRel))
        })
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        entry(va).is_some_and(|e| e.fetch_and(!AF, Ordering::AcqRel) & AF != 0)
    }

    fn set(&self, va: u64, pte: Pte) {
        if let Some(e) = entry(va) {
            e.store(to_descriptor(pte), Ordering::Release);
        }
    }

    /// A level 3 page descriptor: the granule's page, 4 or 64 KiB.
    fn entry_size(&self, _va: u64) -> PageSize {
        mmu::page_size()
    }
}

static SPACE: DirtySpace = DirtySpace;

/// The reverse map of the scenario's frames: frame `p` is mapped at most
/// at page `p`.
pub struct DirtyRmap;

// SAFETY: a frame of FRAMES is mapped in the test address space only at
// its own page (`map_round` writes no other entry with it), so that one
// place is every user mapping of it; the kernel's identity map of RAM
// covers it too, as a linear map does, and nothing here unmaps that.
unsafe impl Rmap for DirtyRmap {
    type Space = DirtySpace;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, DirtySpace>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        match (0..DIRTY_PAGES).find(|&p| frame_of(p) == frame) {
            Some(page) => visit(Mapping {
                space: &SPACE,
                va: mmu::dirty_va(page),
                flags: MappingFlags::empty(),
            }),
            None => ControlFlow::Continue(()),
        }
    }

    fn set_dirty(&self, frame: Frame) {
        if let Some(p) = (0..DIRTY_PAGES).find(|&p| frame_of(p) == frame) {
            REPORTED_DIRTY.fetch_or(1 << p, Ordering::Relaxed);
        }
    }
}
