//! The test address space as the crate's reverse-map code sees it: a
//! [`PageTable`] over this kernel's own leaf table of test pages, with
//! conversions between aarch64 page descriptors and the crate's `Pte`, and
//! an [`Rmap`] that finds the one mapping of each test frame.
//!
//! Descriptor to `Pte`: a valid page descriptor is present; its access
//! flag is the accessed bit; AP\[2\] clear (writes allowed) is reported as
//! writable *and dirty*, as the crate's aarch64 `Arch` requires (a clean
//! writable page would be mapped read-only until its first write faults,
//! or with DBM until the hardware sets it dirty: only the clean-write
//! scenario maps such pages, in its own space, `dirty.rs`). An invalid descriptor is handed back as
//! it is: the hardware ignores every bit of it but bit 0, which the crate's
//! not-present entries keep clear.

use core::ops::ControlFlow;
use core::sync::atomic::{AtomicU64, Ordering};

use tlb_batch::{Frame, Mapping, MappingFlags, MmTlbState, PageSize, PageTable, Pte, PteFlags, Rmap};

use crate::mmu::{
    self, AF, AP_READ_ONLY, DBM, DESC_TABLE_OR_PAGE, DESC_VALID, OUTPUT_ADDRESS, TEST_PAGE_FLAGS,
};

/// Frames the reverse map reported dirty (a writable entry went away).
pub static DIRTIED: AtomicU64 = AtomicU64::new(0);

/// The aarch64 page descriptor for `pte`, without DBM: writes go through
/// only where the crate would see the page dirty.
pub fn to_descriptor(pte: Pte) -> u64 {
    descriptor(pte, false)
}

/// The aarch64 page descriptor for `pte`. AP\[2\] stays set (read-only)
/// unless the page is writable and dirty; with `dbm`, a writable page also
/// gets DBM, so that under TCR_EL1.HD the hardware may make it dirty.
pub fn descriptor(pte: Pte, dbm: bool) -> u64 {
    if !pte.is_present() {
        return pte.0 & !DESC_VALID;
    }
    let mut desc = (pte.frame().addr() & OUTPUT_ADDRESS) | TEST_PAGE_FLAGS;
    if !pte.is_accessed() {
        desc &= !AF;
    }
    if dbm && pte.is_writable() {
        desc |= DBM;
    }
    if !(pte.is_writable() && pte.is_dirty()) {
        desc |= AP_READ_ONLY;
    }
    desc
}

/// The crate's view of the descriptor `desc`: dirty exactly when the
/// hardware lets writes through it (AP\[2\] = 0; with DBM that is a page
/// the hardware has set dirty), writable then or when DBM is set (a clean
/// page the hardware may make dirty).
pub fn to_pte(desc: u64) -> Pte {
    let page = DESC_VALID | DESC_TABLE_OR_PAGE;
    if desc & page != page {
        return Pte(desc & !DESC_VALID);
    }
    let mut flags = PteFlags::PRESENT | PteFlags::NO_EXECUTE;
    if desc & AF != 0 {
        flags |= PteFlags::ACCESSED;
    }
    let writes_through = desc & AP_READ_ONLY == 0;
    if writes_through || desc & DBM != 0 {
        flags |= PteFlags::WRITABLE;
    }
    if writes_through {
        flags |= PteFlags::DIRTY;
    }
    Pte::new(Frame((desc & OUTPUT_ADDRESS) >> 12), flags)
}

/// The test pages' page table.
pub struct TestSpace;

/// Which test page `va` is, if any.
fn page_of(va: u64) -> Option<usize> {
    let offset = va.checked_sub(mmu::test_va(0))?;
    let page = (offset / mmu::page_bytes()) as usize;
    (page < mmu::TEST_PAGES && offset.is_multiple_of(mmu::page_bytes())).then_some(page)
}

/// The leaf entry for `va`, when it is a test page.
fn entry(va: u64) -> Option<&'static AtomicU64> {
    page_of(va).map(mmu::test_pte)
}

// SAFETY: `exchange` and `test_and_clear_accessed` are single atomic
// operations on the descriptor, so an access flag the hardware sets
// (TCR_EL1.HA, on where the CPU has it; HD, where on, changes only
// descriptors with DBM, which this space never writes) is never lost between
// a read and a write; `lookup` reads the descriptor
// as it is; the state is the address space these tables translate for
// (loaded on every CPU with `switch_mm`). `next_populated` and
// `with_table_locked` keep their defaults (the scenarios run on one CPU
// at a time, which is the lock).
unsafe impl PageTable for TestSpace {
    fn tlb_state(&self) -> &MmTlbState {
        crate::tlb::mm()
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

    /// A test page is one level 3 page descriptor: 4 KiB, or 64 KiB with
    /// the 64 KiB granule (the crate then takes it whole, at its first
    /// address, with one `TLBI`).
    fn entry_size(&self, _va: u64) -> PageSize {
        mmu::page_size()
    }
}

/// The reverse map of the test frames: frame A of page `i` is mapped at
/// most at test page `i` (frames B are not unmapped through it).
pub struct TestRmap;

static SPACE: TestSpace = TestSpace;

// SAFETY: in the test address space a test frame A is mapped only at its
// own test page (main.rs's `set_pte` writes no other entry with it), so
// that one place is every user mapping of it. The kernel's identity map
// of RAM covers the frame too, as a linear map does: no reverse map lists
// that, and nothing here unmaps it or frees the frame.
unsafe impl Rmap for TestRmap {
    type Space = TestSpace;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, TestSpace>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        match crate::page_of_frame_a(frame) {
            Some(page) => visit(Mapping {
                space: &SPACE,
                va: mmu::test_va(page),
                flags: MappingFlags::empty(),
            }),
            None => ControlFlow::Continue(()),
        }
    }

    fn set_dirty(&self, _frame: Frame) {
        DIRTIED.fetch_add(1, Ordering::Relaxed);
    }
}
