//! A huge mapping through the range operations as one unit, over real
//! four-level tables (the `x86_64` crate's, in host memory) that the mock's
//! MMU walks, caching one TLB entry for the whole 2 MiB page:
//! `change_protection` and `MmuGather::unmap_range` over a range that
//! covers the huge page wholly (with 4 KiB pages on both sides) take its
//! one entry once, keep or move its dirty bit, flush it with one
//! invalidation at its stride, and (the teardown) hand its frame over once,
//! after the flush; the oracle judges each of its 512 frames. A range that
//! covers part of it is refused with nothing changed.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use common::x86_tables::{machine_with, map, user_rw, Tables, GIB, MIB2};
use tlb_batch::arch::mock::{CountingTable, Fault, MockMachine};
use tlb_batch::heapless;
use tlb_batch::mapper::{DeallocatorFrees, MapperError, OffsetSpace};
use tlb_batch::{
    change_protection, Error, Frame, FrameKind, FreeFrames, MmuGather, OwnedFrame, PageRange, PageSize,
    PageTable, Pte, PteFlags, TableFreePolicy, TeardownBacking, PAGE_SIZE,
};
use x86_64::structures::paging::{PageTableFlags as F, Size1GiB, Size2MiB, Size4KiB};

/// The 2 MiB page's first address.
const TWO: u64 = 0x4000_0000;
/// A 4 KiB page on each side of it.
const BELOW: u64 = TWO - PAGE_SIZE;
const ABOVE: u64 = TWO + MIB2;
const PIECES: u64 = 512;

fn read_only(p: Pte) -> Pte {
    Pte(p.0 & !PteFlags::WRITABLE.bits())
}

/// Tables with a 2 MiB page at `TWO` mapping a huge frame of the
/// machine's (512 frames in a row) and a 4 KiB page on each side, and a
/// machine of 3 CPUs whose address space they translate: the range from
/// `BELOW` to `ABOVE`, and the huge frame, and the small frames.
struct Setup {
    t: Tables,
    m: MockMachine,
    mm: std::sync::Arc<tlb_batch::MmTlbState>,
    huge: Frame,
    small: [Frame; 2],
}

impl Setup {
    fn new() -> Setup {
        let mut t = Tables::new();
        let (m, mm) = machine_with(3, &t);
        let huge = m.alloc_huge_frame(PageSize::SIZE_2M).unwrap();
        let small = [m.alloc_frame().unwrap(), m.alloc_frame().unwrap()];
        {
            let (mut mapper, mut pool) = t.mapper();
            map::<Size2MiB>(&mut mapper, &mut pool, TWO, huge.addr(), user_rw());
            map::<Size4KiB>(&mut mapper, &mut pool, BELOW, small[0].addr(), user_rw());
            map::<Size4KiB>(&mut mapper, &mut pool, ABOVE, small[1].addr(), user_rw());
        }
        Setup {
            t,
            m,
            mm,
            huge,
            small,
        }
    }

    /// CPUs 1 and 2 run the space: CPU 1 writes the huge page (its entry
    /// turns dirty) and the small pages, CPU 2 reads the huge page; both
    /// cache the one 2 MiB entry.
    fn touch(&self) {
        let (cpu1, cpu2) = (self.m.cpu(1).unwrap(), self.m.cpu(2).unwrap());
        cpu1.switch_to(&self.mm).unwrap();
        cpu2.switch_to(&self.mm).unwrap();
        cpu1.write(TWO + 3 * PAGE_SIZE, 7).unwrap();
        cpu1.write(BELOW, 1).unwrap();
        cpu1.write(ABOVE, 2).unwrap();
        cpu2.read(TWO + 300 * PAGE_SIZE).unwrap();
        assert_eq!(self.m.cached_translations(piece(self.huge, 511)).len(), 2);
    }
}

/// The whole range: both small pages and the huge page between them.
fn whole() -> PageRange {
    PageRange::new(BELOW, (ABOVE - BELOW) / PAGE_SIZE + 1).unwrap()
}

fn piece(huge: Frame, i: u64) -> Frame {
    Frame(huge.0 + i)
}

#[test]
fn mprotect_of_a_range_covering_a_huge_page_write_protects_it_with_one_invalidation() {
    let mut s = Setup::new();
    s.touch();
    let (mut mapper, _) = s.t.mapper();
    let space = OffsetSpace::new(&mut mapper, &s.mm);
    let cpu0 = s.m.cpu(0).unwrap();
    let before = s.m.stats();
    let changed = change_protection(&cpu0, &space, whole(), read_only).unwrap();
    assert_eq!(changed, 3, "the huge entry counts once");
    // The oracle first: no CPU holds an entry that allows more than the
    // tables do.
    assert_eq!(s.m.check_coherent(&s.mm, whole()), 0, "{:?}", s.m.violations());
    let d = s.m.stats().since(&before);
    assert_eq!(d.shootdowns, 1);
    assert_eq!(d.local_full_flushes, 0, "512 pages would pass the ceiling");
    assert_eq!(
        d.local_page_flushes, 6,
        "three invalidations (one for the huge page) on each of the two CPUs"
    );

    // Still one 2 MiB entry, read-only, its dirty and accessed bits kept.
    assert_eq!(space.entry_size(TWO + 9 * PAGE_SIZE), PageSize::SIZE_2M);
    for i in [0, 3, 300, 511] {
        let pte = space.lookup(TWO + i * PAGE_SIZE);
        assert!(pte.maps(piece(s.huge, i)) && !pte.is_writable(), "{i}: {pte:?}");
        assert!(pte.is_dirty() && pte.is_accessed(), "{i}: the bits survived");
    }
    for va in [BELOW, ABOVE] {
        assert!(!space.lookup(va).is_writable() && space.lookup(va).is_dirty());
    }
    let (cpu1, cpu2) = (s.m.cpu(1).unwrap(), s.m.cpu(2).unwrap());
    for cpu in [&cpu1, &cpu2] {
        for va in [TWO, TWO + 3 * PAGE_SIZE, TWO + 511 * PAGE_SIZE, BELOW, ABOVE] {
            assert!(
                matches!(cpu.write(va, 9), Err(Fault::WriteProtected { .. })),
                "{va:#x}: no CPU writes any more"
            );
        }
    }
    assert_eq!(cpu2.read(TWO + 3 * PAGE_SIZE), Ok(7), "still mapped, same frame");
    assert_eq!(s.m.violations(), []);
}

/// Frees data frames into the machine, whose oracle judges each free: the
/// huge frame's first frame stands for all 512, which it frees; records
/// what it was handed and which frames were dirty. Table frames (host
/// pages) are left alone.
struct HugeBacking<'m> {
    m: &'m MockMachine,
    huge: Frame,
    handed: Vec<Frame>,
    dirty: Vec<Frame>,
    freed: usize,
}

impl FreeFrames for HugeBacking<'_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        while let Some(f) = frames.pop() {
            let f = f.into_frame();
            self.handed.push(f);
            let count = if f == self.huge { PIECES } else { 1 };
            for i in 0..count {
                self.m.free_frame(piece(f, i)).unwrap();
                self.freed += 1;
            }
        }
    }
}

impl TeardownBacking for HugeBacking<'_> {
    fn set_dirty(&mut self, frame: Frame) {
        self.dirty.push(frame);
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        tables.clear();
    }
}

#[test]
fn a_teardown_covering_a_huge_page_frees_its_512_frames_after_the_one_flush() {
    let mut s = Setup::new();
    s.touch();
    let (mut mapper, _) = s.t.mapper();
    // SAFETY: each page is mapped once and its frame (for the huge page,
    // the whole huge frame) is the test's to free; no table frame is
    // freed (`free_tables` drops them: host pages the test leaks).
    let space = unsafe { OffsetSpace::new(&mut mapper, &s.mm).for_teardown() };
    let mut backing = HugeBacking {
        m: &s.m,
        huge: s.huge,
        handed: Vec::new(),
        dirty: Vec::new(),
        freed: 0,
    };
    let mut gather = MmuGather::<16>::new();
    let cpu0 = s.m.cpu(0).unwrap();
    let before = s.m.stats();
    let summary = gather
        .unmap_range(
            &cpu0,
            &space,
            &mut backing,
            whole(),
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |f: OwnedFrame, _: FrameKind| panic!("{f:?} handed back"),
        )
        .unwrap();
    // The oracle first: every one of the 514 frees came after the flush.
    let v = s.m.violations();
    assert!(v.is_empty(), "{} violations, the first {:?}", v.len(), v.first());
    let d = s.m.stats().since(&before);
    assert_eq!(
        (summary.pages_unmapped, summary.data_freed, summary.flushes),
        (3, 3, 1),
        "the huge page is one page unmapped and one data frame"
    );
    assert_eq!((summary.data_free_calls, summary.tables_freed), (1, 0));
    assert_eq!((d.local_full_flushes, d.local_page_flushes), (0, 6));
    let mut handed = backing.handed.clone();
    handed.sort();
    let mut want = vec![s.huge, s.small[0], s.small[1]];
    want.sort();
    assert_eq!(handed, want, "the huge frame handed once, as its first frame");
    assert_eq!(backing.freed, 514);
    assert!(
        backing.dirty.contains(&s.huge),
        "its dirty bit moved to the frame"
    );
    for i in 0..PIECES {
        assert_eq!(
            s.m.frame_state(piece(s.huge, i)),
            Ok(tlb_batch::arch::mock::FrameState::Free)
        );
    }
    for va in [BELOW, TWO, TWO + 7 * PAGE_SIZE, ABOVE] {
        assert_eq!(space.lookup(va), Pte::EMPTY, "{va:#x}");
    }
    assert!(s.m.all_entries().is_empty());
    assert_eq!(
        s.m.cpu(1).unwrap().read(TWO + 5 * PAGE_SIZE),
        Err(Fault::NotMapped {
            va: TWO + 5 * PAGE_SIZE
        })
    );
    assert!(gather.is_empty());
    assert_eq!(s.m.violations(), []);
}

#[test]
fn a_range_covering_part_of_a_huge_page_is_refused_with_nothing_changed() {
    let mut s = Setup::new();
    s.touch();
    let (mut mapper, _) = s.t.mapper();
    // SAFETY: as in the teardown test; here nothing is freed.
    let space = unsafe { OffsetSpace::new(&mut mapper, &s.mm).for_teardown() };
    let cpu0 = s.m.cpu(0).unwrap();
    let look = |space: &dyn Fn(u64) -> Pte| [BELOW, TWO, TWO + 100 * PAGE_SIZE, ABOVE].map(space);
    let words = look(&|va| space.lookup(va));
    let states = s.m.frame_states();
    let entries = s.m.all_entries().len();
    let ipis = s.m.ipis_sent();
    let refused = Err(Error::HugePage { va: TWO, size: MIB2 });
    let parts = [
        // Ends inside it.
        PageRange::new(BELOW, 6).unwrap(),
        // Starts inside it.
        PageRange::new(TWO + PAGE_SIZE, 512).unwrap(),
        // One page of it.
        PageRange::page(TWO + 200 * PAGE_SIZE).unwrap(),
    ];
    for range in parts {
        // The table's own check, then the operations (whose read-only
        // pass over a user space refuses it too, before any change).
        assert_eq!(space.check_range(range), refused, "{range:?}");
        assert_eq!(
            space.space().check_no_partial_huge(range),
            Err(MapperError::HugePage { va: TWO, size: MIB2 })
        );
        assert_eq!(
            change_protection(&cpu0, &space, range, read_only),
            refused.map(|()| 0)
        );
        let mut backing = HugeBacking {
            m: &s.m,
            huge: s.huge,
            handed: Vec::new(),
            dirty: Vec::new(),
            freed: 0,
        };
        let mut gather = MmuGather::<16>::new();
        let r = gather.unmap_range(
            &cpu0,
            &space,
            &mut backing,
            range,
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |f: OwnedFrame, _: FrameKind| panic!("{f:?} handed back"),
        );
        assert_eq!(r.map(|_| ()), refused, "{range:?}");
        assert!(gather.is_empty() && backing.handed.is_empty() && backing.dirty.is_empty());
    }
    // `munmap` frees into a 4 KiB deallocator: it refuses even a range
    // that covers the huge page wholly.
    let mut dealloc = common::x86_tables::Dealloc(&s.m, Vec::new());
    // SAFETY: nothing is freed (refused before anything changes).
    let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
    let mut gather = MmuGather::<16>::new();
    assert_eq!(space.check_range(whole()), Ok(()), "taken whole");
    assert_eq!(
        space.munmap(&cpu0, &mut gather, whole(), &mut frees).map(|_| ()),
        refused
    );
    assert_eq!(look(&|va| space.lookup(va)), words, "every entry as it was");
    assert_eq!(s.m.frame_states(), states);
    assert_eq!((s.m.all_entries().len(), s.m.ipis_sent()), (entries, ipis));
    assert!(!s.mm.batched_flush_pending());
    s.m.cpu(1).unwrap().write(TWO + 8 * PAGE_SIZE, 3).unwrap();
    assert_eq!(s.m.violations(), []);
}

/// An `update` that gives a huge entry another frame (a huge entry is
/// changed in place, flags only): nothing is written and the call stops
/// with `Error::HugePage`.
#[test]
fn an_update_that_moves_a_huge_entrys_frame_is_refused_with_the_entry_as_it_was() {
    let mut s = Setup::new();
    s.touch();
    let (mut mapper, _) = s.t.mapper();
    let space = OffsetSpace::new(&mut mapper, &s.mm);
    let cpu0 = s.m.cpu(0).unwrap();
    let before = space.lookup(TWO);
    let range = PageRange::new(TWO, PIECES).unwrap();
    let moved = |p: Pte| Pte::new(Frame(p.frame().0 + 1), p.flags());
    assert_eq!(
        change_protection(&cpu0, &space, range, moved),
        Err(Error::HugePage { va: TWO, size: MIB2 })
    );
    assert_eq!(space.lookup(TWO), before);
    assert_eq!(s.m.check_coherent(&s.mm, range), 0);
    assert_eq!(s.m.violations(), []);
}

/// A 1 GiB page (host memory: not one the machine can back, so no CPU
/// touches it), wholly covered: one entry, one invalidation, for the
/// protection change and for the teardown; the walks step over it whole
/// (a budget of calls far below its 262144 pieces).
#[test]
fn a_gib_page_wholly_covered_is_one_entry_and_one_invalidation() {
    let mut t = Tables::new();
    let (m, mm) = machine_with(2, &t);
    let one = 0x80_0000_0000;
    let head = Frame(0x40_0000_0000 >> 12);
    {
        let (mut mapper, mut pool) = t.mapper();
        map::<Size1GiB>(&mut mapper, &mut pool, one, head.addr(), user_rw() | F::DIRTY);
    }
    let (mut mapper, _) = t.mapper();
    // SAFETY: the one mapping's frame is the test's; nothing is freed into
    // the machine (the recording backing keeps host numbers only).
    let space = CountingTable::with_budget(unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() }, 200);
    let cpu0 = m.cpu(0).unwrap();
    m.cpu(1).unwrap().switch_to(&mm).unwrap();
    let range = PageRange::new(one, GIB / PAGE_SIZE).unwrap();

    let before = m.stats();
    assert_eq!(change_protection(&cpu0, &space, range, read_only), Ok(1));
    let d = m.stats().since(&before);
    assert_eq!(
        (d.shootdowns, d.local_page_flushes, d.local_full_flushes),
        (1, 1, 0)
    );
    let last = space.lookup(one + GIB - PAGE_SIZE);
    assert!(last.is_present() && !last.is_writable() && last.is_dirty());
    assert_eq!(space.entry_size(one), PageSize::SIZE_1G);

    struct Record(Vec<Frame>, Vec<Frame>);
    impl FreeFrames for Record {
        fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
            while let Some(f) = frames.pop() {
                self.0.push(f.into_frame());
            }
        }
    }
    impl TeardownBacking for Record {
        fn set_dirty(&mut self, frame: Frame) {
            self.1.push(frame);
        }
        fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
            tables.clear();
        }
    }
    let mut record = Record(Vec::new(), Vec::new());
    let mut gather = MmuGather::<4>::new();
    let before = m.stats();
    let summary = gather
        .unmap_range(
            &cpu0,
            &space,
            &mut record,
            range,
            false,
            &mut TableFreePolicy::AfterFlush,
            &mut |f: OwnedFrame, _: FrameKind| panic!("{f:?} handed back"),
        )
        .unwrap();
    let d = m.stats().since(&before);
    assert_eq!(
        (summary.pages_unmapped, summary.data_freed, summary.flushes),
        (1, 1, 1)
    );
    assert_eq!((d.local_page_flushes, d.local_full_flushes), (1, 0));
    assert_eq!(
        (record.0.as_slice(), record.1.as_slice()),
        ([head].as_slice(), [head].as_slice())
    );
    assert_eq!(space.lookup(one + 12345 * PAGE_SIZE), Pte::EMPTY);
    assert!(
        !space.exceeded(),
        "{} calls: the walks stepped over it whole",
        space.calls()
    );
    assert_eq!(m.violations(), []);
}

/// The accessed and dirty bits of a huge entry survive an `update` that
/// builds the entry afresh without them, as for 4 KiB entries: the dirty
/// bit is the only record that the huge page was written.
#[test]
fn an_update_that_drops_the_hardware_bits_keeps_them_on_a_huge_entry() {
    let mut s = Setup::new();
    s.touch();
    let (mut mapper, _) = s.t.mapper();
    let space = OffsetSpace::new(&mut mapper, &s.mm);
    let cpu0 = s.m.cpu(0).unwrap();
    let range = PageRange::new(TWO, PIECES).unwrap();
    let afresh = |p: Pte| Pte::new(p.frame(), PteFlags::PRESENT | PteFlags::USER);
    assert_eq!(change_protection(&cpu0, &space, range, afresh), Ok(1));
    assert_eq!(s.m.check_coherent(&s.mm, range), 0, "{:?}", s.m.violations());
    let pte = space.lookup(TWO + 5 * PAGE_SIZE);
    assert!(
        !pte.is_writable() && pte.is_dirty() && pte.is_accessed(),
        "{pte:?}"
    );
    assert_eq!(space.entry_size(TWO), PageSize::SIZE_2M);
    assert_eq!(s.m.violations(), []);
}

/// The huge page's table, whose MMU sets the dirty bit of the huge entry
/// between the crate's read of it and its first exchange (a CPU's store
/// through a cached writable entry, racing `change_protection`).
struct DirtiedInTheGap<'a, 'b> {
    inner: &'a OffsetSpace<'b>,
    raced: std::cell::Cell<bool>,
}

// SAFETY: forwards every call to the adapter; the one extra store sets the
// dirty bit of a present huge entry in place, as the MMU would.
unsafe impl PageTable for DirtiedInTheGap<'_, '_> {
    fn tlb_state(&self) -> &tlb_batch::MmTlbState {
        self.inner.tlb_state()
    }
    fn lookup(&self, va: u64) -> Pte {
        self.inner.lookup(va)
    }
    fn exchange(&self, va: u64, new: Pte) -> Pte {
        if !self.raced.replace(true) {
            let now = self.inner.lookup(va);
            self.inner.set(va, Pte(now.0 | PteFlags::DIRTY.bits()));
        }
        self.inner.exchange(va, new)
    }
    fn test_and_clear_accessed(&self, va: u64) -> bool {
        self.inner.test_and_clear_accessed(va)
    }
    fn set(&self, va: u64, pte: Pte) {
        self.inner.set(va, pte)
    }
    fn next_populated(&self, range: PageRange) -> Option<u64> {
        self.inner.next_populated(range)
    }
    fn entry_size(&self, va: u64) -> PageSize {
        self.inner.entry_size(va)
    }
    fn check_range(&self, range: PageRange) -> Result<(), Error> {
        self.inner.check_range(range)
    }
}

/// A dirty bit the MMU sets on a huge entry after `change_protection` read
/// it and before its exchange is added back to the new entry: the one
/// record that the huge page was written is never lost.
#[test]
fn a_dirty_bit_set_during_the_update_of_a_huge_entry_is_kept() {
    let mut s = Setup::new();
    let cpu2 = s.m.cpu(2).unwrap();
    cpu2.switch_to(&s.mm).unwrap();
    cpu2.read(TWO + 300 * PAGE_SIZE).unwrap();
    let (mut mapper, _) = s.t.mapper();
    let adapter = OffsetSpace::new(&mut mapper, &s.mm);
    assert!(!adapter.lookup(TWO).is_dirty(), "read only so far");
    let space = DirtiedInTheGap {
        inner: &adapter,
        raced: std::cell::Cell::new(false),
    };
    let range = PageRange::new(TWO, PIECES).unwrap();
    assert_eq!(
        change_protection(&s.m.cpu(0).unwrap(), &space, range, read_only),
        Ok(1)
    );
    let pte = adapter.lookup(TWO);
    assert!(
        pte.is_present() && !pte.is_writable() && pte.is_dirty(),
        "{pte:?}"
    );
    assert_eq!(pte.frame(), s.huge);
    assert_eq!(adapter.entry_size(TWO), PageSize::SIZE_2M);
    assert_eq!(s.m.check_coherent(&s.mm, range), 0, "{:?}", s.m.violations());
}
