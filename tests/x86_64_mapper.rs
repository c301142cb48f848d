//! The `x86_64-mapper` feature against real four-level tables: tables built
//! in host memory with the `x86_64` crate's `OffsetPageTable` (physical
//! offset 0, so a table frame's address is its host address), pages mapped
//! with `Mapper::map_to`, and the simulated MMU walking the same entry
//! words, so CPU writes set dirty bits in them and the oracle judges every
//! flush and free.
#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::asid;
use tlb_batch::arch::mock::{CountingTable, MmuTable, MockConfig, MockMachine};
use tlb_batch::mapper::{MapperError, OffsetSpace, OffsetTeardown};
use tlb_batch::{
    change_protection, try_to_unmap, BoundedRmap, DetachedTable, Frame, FrameKind, FreeFrames, MappingFlags,
    MmTlbState, MmuGather, OwnedFrame, PageRange, PageState, PageTable, Pte, PteFlags, SwapResult,
    TableFreePolicy, TeardownBacking, TlbFlushUnmapBatch, TtuFlags, PAGE_SIZE,
};
use x86_64::structures::paging::mapper::{Translate, TranslateResult};
use x86_64::structures::paging::{
    FrameAllocator, Mapper, OffsetPageTable, Page, PageSize, PageTable as X86Table, PageTableFlags as F,
    PhysFrame, Size1GiB, Size2MiB, Size4KiB,
};
use x86_64::{PhysAddr, VirtAddr};

const MIB2: u64 = 2 << 20;
const GIB: u64 = 1 << 30;

/// Four-level tables in host memory: every table a 4 KiB-aligned host
/// page, never freed while the test runs (the simulated MMU keeps reading
/// them), so the physical-memory offset is 0.
struct Tables {
    root: &'static mut X86Table,
    pool: Vec<u64>,
}

impl Tables {
    fn new() -> Tables {
        Tables {
            root: Box::leak(Box::new(X86Table::new())),
            pool: Vec::new(),
        }
    }

    fn root_addr(&self) -> u64 {
        &*self.root as *const X86Table as u64
    }

    /// The `x86_64` crate's mapper over these tables, and their allocator.
    fn mapper(&mut self) -> (OffsetPageTable<'_>, Pool<'_>) {
        // SAFETY: every table frame an entry names is a leaked host page at
        // its own address (offset 0).
        let mapper = unsafe { OffsetPageTable::new(self.root, VirtAddr::new(0)) };
        (mapper, Pool(&mut self.pool))
    }
}

/// Allocates page-table frames for `map_to`: leaked host pages.
struct Pool<'a>(&'a mut Vec<u64>);

// SAFETY: each frame is a fresh, zeroed, 4 KiB-aligned host page that is
// never handed out twice.
unsafe impl FrameAllocator<Size4KiB> for Pool<'_> {
    fn allocate_frame(&mut self) -> Option<PhysFrame> {
        let page: &'static mut X86Table = Box::leak(Box::new(X86Table::new()));
        let addr = page as *mut X86Table as u64;
        self.0.push(addr);
        PhysFrame::from_start_address(PhysAddr::new(addr)).ok()
    }
}

fn map<S: PageSize + std::fmt::Debug>(
    mapper: &mut OffsetPageTable<'_>,
    pool: &mut Pool<'_>,
    va: u64,
    frame_addr: u64,
    flags: F,
) where
    for<'a> OffsetPageTable<'a>: Mapper<S>,
{
    let page = Page::<S>::from_start_address(VirtAddr::new(va)).unwrap();
    let frame = PhysFrame::<S>::from_start_address(PhysAddr::new(frame_addr)).unwrap();
    // SAFETY: the frames are simulated (never dereferenced by the host),
    // and the address space is not loaded anywhere yet.
    unsafe { mapper.map_to(page, frame, flags, pool) }
        .unwrap()
        .ignore();
}

/// The simulated MMU's view of the same tables: its own walk (independent
/// of the code under test) to the 4 KiB entry word of an address. Huge
/// pages are not modelled: the walk faults there.
struct HostMmu {
    root: u64,
}

impl MmuTable for HostMmu {
    fn entry(&self, va: u64) -> Option<&AtomicU64> {
        let mut table = self.root;
        for level in (1..=4u32).rev() {
            let i = (va >> (12 + 9 * (level - 1))) & 511;
            // SAFETY: `table` is a leaked host page table (offset 0) and
            // i < 512; entries are only accessed atomically in this test.
            let word = unsafe { &*((table + i * 8) as *const AtomicU64) };
            if level == 1 {
                return Some(word);
            }
            let raw = word.load(Ordering::SeqCst);
            if raw & 1 == 0 || raw & (1 << 7) != 0 {
                return None;
            }
            table = raw & 0x000f_ffff_ffff_f000;
        }
        None
    }
}

/// The entry word at `level` (4 to 2) on the way to `va`, which must have
/// tables down to that level.
fn upper_entry(root: u64, va: u64, level: u32) -> &'static AtomicU64 {
    let mut table = root;
    for l in (level..=4).rev() {
        let i = (va >> (12 + 9 * (l - 1))) & 511;
        // SAFETY: as in `HostMmu::entry`.
        let word: &'static AtomicU64 = unsafe { &*((table + i * 8) as *const AtomicU64) };
        if l == level {
            return word;
        }
        table = word.load(Ordering::SeqCst) & 0x000f_ffff_ffff_f000;
    }
    unreachable!()
}

fn user_rw() -> F {
    F::PRESENT | F::WRITABLE | F::USER_ACCESSIBLE
}

/// A machine of `cpus` CPUs and an address space translated by `tables`.
fn machine_with(cpus: usize, tables: &Tables) -> (MockMachine, Arc<MmTlbState>) {
    let m = MockMachine::new(MockConfig::x86_like(cpus)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    m.attach_table(
        &mm,
        Arc::new(HostMmu {
            root: tables.root_addr(),
        }),
    )
    .unwrap();
    (m, mm)
}

#[test]
fn entries_and_conversions_match_what_the_x86_64_crate_mapped() {
    let mut t = Tables::new();
    let (mut mapper, mut pool) = t.mapper();
    let flags = user_rw() | F::NO_EXECUTE | F::WRITE_THROUGH | F::BIT_52 | F::BIT_9;
    map::<Size4KiB>(&mut mapper, &mut pool, 0x40_0000, 0x1234_5000, flags);
    map::<Size4KiB>(&mut mapper, &mut pool, 0xffff_8000_0010_0000, 0x7000, F::PRESENT);
    let tlb = MmTlbState::new(asid(1), 0);
    let space = OffsetSpace::new(&mut mapper, &tlb);

    // The crate sees the entry word exactly as the x86_64 crate wrote it.
    let pte = space.lookup(0x40_0000);
    assert_eq!(pte, Pte(0x1234_5000 | flags.bits()));
    assert_eq!(pte.frame(), Frame(0x12345));
    assert_eq!(F::from(pte.flags()), user_rw() | F::NO_EXECUTE | F::BIT_9);
    assert_eq!(space.lookup(0xffff_8000_0010_0000), Pte(0x7000 | 1));
    // Same leaf table, no entry; no table at all; beyond 48 bits.
    assert_eq!(space.lookup(0x40_1000), Pte::EMPTY);
    assert_eq!(space.lookup(0x7fff_ffff_f000), Pte::EMPTY);
    assert_eq!(space.lookup(0x0100_0000_0040_0000), Pte::EMPTY);

    // Frames and flags both ways.
    let f = PhysFrame::<Size4KiB>::from_start_address(PhysAddr::new(0x1234_5000)).unwrap();
    assert_eq!(Frame::from(f), Frame(0x12345));
    assert_eq!(PhysFrame::<Size4KiB>::try_from(Frame(0x12345)), Ok(f));
    let huge = PhysFrame::<Size2MiB>::from_start_address(PhysAddr::new(0x4060_0000)).unwrap();
    assert_eq!(Frame::from(huge), Frame(0x40600));
    let last = Frame((1 << 40) - 1);
    assert_eq!(Frame::from(PhysFrame::<Size4KiB>::try_from(last).unwrap()), last);
    for bad in [Frame(1 << 40), Frame(u64::MAX)] {
        assert_eq!(
            PhysFrame::<Size4KiB>::try_from(bad),
            Err(MapperError::FrameOutOfRange { frame: bad })
        );
    }
    let all = PteFlags::all();
    assert_eq!(PteFlags::from(F::from(all)), all);
    assert_eq!(F::from(all).bits(), all.bits());
    assert_eq!(
        PteFlags::from(F::HUGE_PAGE | F::NO_CACHE | F::BIT_62 | F::DIRTY),
        PteFlags::DIRTY
    );
}

#[test]
fn the_primitives_change_the_entry_words_the_x86_64_crate_reads() {
    let mut t = Tables::new();
    let (mut mapper, mut pool) = t.mapper();
    map::<Size4KiB>(
        &mut mapper,
        &mut pool,
        0x40_0000,
        0x5000,
        user_rw() | F::ACCESSED | F::DIRTY,
    );
    map::<Size4KiB>(&mut mapper, &mut pool, 0x40_1000, 0x6000, user_rw());
    let tlb = MmTlbState::new(asid(1), 0);
    {
        let space = OffsetSpace::new(&mut mapper, &tlb);
        assert!(space.test_and_clear_accessed(0x40_0000));
        assert!(!space.test_and_clear_accessed(0x40_0000));
        assert!(!space.test_and_clear_accessed(0x40_1000));
        let old = space.exchange(0x40_0000, Pte::migration(Frame(5), true));
        assert!(old.is_dirty() && !old.is_accessed() && old.maps(Frame(5)));
        assert!(space.lookup(0x40_0000).is_migration());
        assert_eq!(space.clear(0x40_0000), Pte::migration(Frame(5), true));
        let ro = Pte::new(Frame(6), PteFlags::PRESENT | PteFlags::USER);
        space.set(0x40_1000, ro);
        // No table: nothing to exchange, and `set` does not build one.
        assert_eq!(space.exchange(0x80_0000_0000, ro), Pte::EMPTY);
        space.set(0x80_0000_0000, ro);
        assert_eq!(space.lookup(0x80_0000_0000), Pte::EMPTY);
    }
    // The x86_64 crate reads what the crate wrote.
    let at = |va| mapper.translate(VirtAddr::new(va));
    assert!(matches!(at(0x40_0000), TranslateResult::NotMapped));
    match at(0x40_1000) {
        TranslateResult::Mapped { frame, flags, .. } => {
            assert_eq!(frame.start_address().as_u64(), 0x6000);
            assert_eq!(flags, F::PRESENT | F::USER_ACCESSIBLE);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(at(0x80_0000_0000), TranslateResult::NotMapped));
}

/// The MMU sets the dirty bit while the crate exchanges the entry: with a
/// single atomic swap every bit set is either returned or in the new entry.
/// (A load followed by a store loses the bits set between the two.)
#[test]
fn exchange_never_loses_a_dirty_bit_the_hardware_sets_meanwhile() {
    let mut t = Tables::new();
    let (mut mapper, mut pool) = t.mapper();
    let va = 0x40_0000;
    map::<Size4KiB>(&mut mapper, &mut pool, va, 0x5000, user_rw());
    let word = HostMmu { root: t.root_addr() }.entry(va).unwrap() as *const AtomicU64 as usize;
    let (mut mapper, _) = t.mapper();
    let tlb = MmTlbState::new(asid(1), 0);
    let space = OffsetSpace::new(&mut mapper, &tlb);
    let clean = Pte(0x5000 | user_rw().bits());
    let stop = AtomicBool::new(false);
    let set = AtomicUsize::new(0);
    let dirty = PteFlags::DIRTY.bits();
    let mut seen = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: the leaked host table outlives the test.
            let word = unsafe { &*(word as *const AtomicU64) };
            while !stop.load(Ordering::Relaxed) {
                // The MMU's locked update: set the bit when it is clear.
                if word.fetch_or(dirty, Ordering::SeqCst) & dirty == 0 {
                    set.fetch_add(1, Ordering::SeqCst);
                }
                std::hint::spin_loop();
            }
        });
        // Until the writer got many bits in (or time is up on a loaded
        // machine): each is a chance for a non-atomic exchange to lose one.
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until && set.load(Ordering::Relaxed) < 20_000 {
            for _ in 0..1000 {
                if space.exchange(va, clean).is_dirty() {
                    seen += 1;
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    if space.lookup(va).is_dirty() {
        seen += 1;
    }
    let set = set.load(Ordering::SeqCst);
    assert!(set > 0, "the writer ran");
    assert_eq!(seen, set, "every dirty bit set is seen once");
}

/// Per-frame state for the reverse map: which frames were marked dirty.
#[derive(Default)]
struct Pages(std::sync::Mutex<BTreeSet<Frame>>);

impl PageState for Pages {
    fn set_dirty(&self, frame: Frame) {
        self.0.lock().unwrap().insert(frame);
    }
}

#[test]
fn try_to_unmap_clears_real_entries_keeps_dirty_bits_and_batches_the_flush() {
    let mut t = Tables::new();
    let (m, mm) = machine_with(3, &t);
    let frames: Vec<Frame> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    let va = |i: usize| 0x40_0000 + i as u64 * PAGE_SIZE;
    let (mut mapper, mut pool) = t.mapper();
    for (i, f) in frames.iter().enumerate() {
        // Pages 0 and 1 writable, 2 and 3 read-only.
        let flags = if i < 2 {
            user_rw()
        } else {
            F::PRESENT | F::USER_ACCESSIBLE
        };
        map::<Size4KiB>(&mut mapper, &mut pool, va(i), f.addr(), flags);
    }
    let space = OffsetSpace::new(&mut mapper, &mm);
    for c in [1, 2] {
        let cpu = m.cpu(c).unwrap();
        cpu.switch_to(&mm).unwrap();
        cpu.write(va(0), 7).unwrap();
        cpu.read(va(1)).unwrap();
        cpu.read(va(2)).unwrap();
        cpu.read(va(3)).unwrap();
    }
    assert!(
        space.lookup(va(0)).is_dirty(),
        "the MMU set the dirty bit in the x86_64 entry"
    );
    assert!(!space.lookup(va(1)).is_dirty());
    for i in 0..4 {
        assert!(space.test_and_clear_accessed(va(i)), "page {i} was accessed");
    }
    let pages = Pages::default();
    // SAFETY: every mapping is added before the crate walks.
    let mut rmap: BoundedRmap<'_, OffsetSpace<'_>, Pages, 8> = unsafe { BoundedRmap::new(&pages) };
    for (i, &f) in frames.iter().enumerate() {
        rmap.add(f, &space, va(i), MappingFlags::empty()).unwrap();
    }

    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let results: Vec<SwapResult> = frames
        .iter()
        .map(|&f| try_to_unmap(&cpu0, &rmap, f, TtuFlags::BATCH_FLUSH, &mut batch).unwrap())
        .collect();
    assert_eq!(
        results,
        [
            SwapResult::SuccessCached,
            SwapResult::SuccessCached,
            SwapResult::Success,
            SwapResult::Success
        ]
    );
    for i in 0..4 {
        assert_eq!(space.lookup(va(i)), Pte::EMPTY);
    }
    assert_eq!(
        *pages.0.lock().unwrap(),
        BTreeSet::from([frames[0]]),
        "only the written page is dirty"
    );
    assert_eq!(m.ipis_sent(), 0, "deferred");
    assert!(
        !m.cached_translations(frames[0]).is_empty(),
        "stale until the flush"
    );
    let report = batch.flush(&cpu0).unwrap();
    assert_eq!(report.ipis_sent, 2, "one IPI per other CPU for four pages");
    for f in frames {
        assert_eq!(m.cached_translations(f), []);
        m.free_frame(f).unwrap();
    }
    assert!(m.cpu(1).unwrap().write(va(0), 8).is_err(), "the page is gone");
    assert_eq!(m.violations(), []);
}

#[test]
fn change_protection_costs_what_is_mapped_and_keeps_dirty_bits() {
    let mut t = Tables::new();
    let (m, mm) = machine_with(2, &t);
    // Three pages far apart inside 4 GiB: three leaf tables, two level-2
    // tables, plus one page in another level-4 entry beyond the range.
    let vas = [0x40_0000, 0x4000_3000, 0xc000_0000 + 511 * PAGE_SIZE];
    let outside = 0x80_0000_0000;
    let frames: Vec<Frame> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    let (mut mapper, mut pool) = t.mapper();
    for (va, f) in vas.iter().chain([&outside]).zip(&frames) {
        map::<Size4KiB>(&mut mapper, &mut pool, *va, f.addr(), user_rw());
    }
    let space = CountingTable::with_budget(OffsetSpace::new(&mut mapper, &mm), 1000);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    for va in vas {
        cpu1.write(va, 1).unwrap();
    }
    let range = PageRange::new(0, 4 * GIB / PAGE_SIZE).unwrap();
    space.inner().check_no_huge(range).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let changed = change_protection(&cpu0, &space, range, |p| Pte(p.0 & !PteFlags::WRITABLE.bits())).unwrap();
    assert_eq!(changed, 3);
    assert!(
        !space.exceeded(),
        "a 4 GiB range with 3 pages took {} calls",
        space.calls()
    );
    assert!(space.calls() < 40, "{} calls", space.calls());
    for va in vas {
        let pte = space.lookup(va);
        assert!(pte.is_present() && !pte.is_writable(), "{va:#x}: {pte:?}");
        assert!(pte.is_dirty(), "{va:#x}: the dirty bit survived the change");
        assert!(cpu1.write(va, 2).is_err(), "{va:#x}: no CPU can write any more");
    }
    assert!(
        space.lookup(outside).is_writable(),
        "outside the range: unchanged"
    );
    assert_eq!(m.check_coherent(&mm, range), 0);
    assert_eq!(m.violations(), []);
}

#[test]
fn next_populated_follows_the_tables_across_both_halves() {
    let mut t = Tables::new();
    let (mut mapper, mut pool) = t.mapper();
    let low = 0x7f00_0000_0000 + 3 * PAGE_SIZE;
    let high = 0xffff_ff80_0000_0000 + 5 * PAGE_SIZE;
    map::<Size4KiB>(&mut mapper, &mut pool, low, 0x5000, user_rw());
    map::<Size4KiB>(&mut mapper, &mut pool, high, 0x6000, user_rw());
    let tlb = MmTlbState::new(asid(1), 0);
    let space = OffsetSpace::new(&mut mapper, &tlb);
    let everything = PageRange::new(0, 1 << 52).unwrap();
    assert_eq!(space.next_populated(everything), Some(low));
    assert_eq!(space.next_populated(everything.after(low)), Some(high));
    assert_eq!(space.next_populated(everything.after(high)), None);
    // Inside one leaf table: the next non-empty word, or none in range.
    let table = PageRange::new(0x7f00_0000_0000, 512).unwrap();
    assert_eq!(space.next_populated(table), Some(low));
    assert_eq!(
        space.next_populated(PageRange::new(0x7f00_0000_0000, 3).unwrap()),
        None
    );
    // A non-present but non-empty entry (a migration entry) is not skipped.
    space.exchange(low, Pte::migration(Frame(5), false));
    assert_eq!(space.next_populated(table), Some(low));
    space.clear(low);
    assert_eq!(space.next_populated(table), None);
    // The top page and the empty range.
    assert_eq!(
        space.next_populated(PageRange::new(0xffff_ffff_ffff_f000, 1).unwrap()),
        None
    );
    assert_eq!(space.next_populated(PageRange::EMPTY), None);
}

#[test]
fn huge_pages_are_reported_present_refused_and_never_changed() {
    let mut t = Tables::new();
    let (m, mm) = machine_with(2, &t);
    let t_root = t.root_addr();
    let (mut mapper, mut pool) = t.mapper();
    let two = 0x4000_0000; // a 2 MiB page
    let one = 0x80_0000_0000; // a 1 GiB page
    let huge_flags = user_rw() | F::ACCESSED | F::DIRTY;
    map::<Size2MiB>(&mut mapper, &mut pool, two, 0x1_0000_0000, huge_flags);
    map::<Size1GiB>(
        &mut mapper,
        &mut pool,
        one,
        0x40_0000_0000,
        user_rw() | F::NO_EXECUTE,
    );
    let small = m.alloc_frame().unwrap();
    map::<Size4KiB>(&mut mapper, &mut pool, two - PAGE_SIZE, small.addr(), user_rw());
    let space = OffsetSpace::new(&mut mapper, &mm);

    // The 4 KiB piece at an address, present, with the huge entry's flags.
    let piece = space.lookup(two + 5 * PAGE_SIZE);
    let want = PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::USER | PteFlags::ACCESSED | PteFlags::DIRTY;
    assert_eq!(
        piece,
        Pte::new(Frame(0x10_0005), want),
        "no page-size bit in the piece"
    );
    let piece = space.lookup(one + GIB - PAGE_SIZE);
    assert_eq!(piece.frame(), Frame((0x40_0000_0000 + GIB - PAGE_SIZE) >> 12));
    assert!(piece.flags().contains(PteFlags::NO_EXECUTE) && piece.is_writable());

    // A huge entry's PAT bit (bit 12) is bit 7 in the 4 KiB view; the
    // frame is unchanged.
    let level_2 = upper_entry(t_root, two, 2);
    level_2.fetch_or(1 << 12, Ordering::SeqCst);
    let piece = space.lookup(two + 5 * PAGE_SIZE);
    assert_eq!(piece, Pte(Pte::new(Frame(0x10_0005), want).0 | 1 << 7));
    level_2.fetch_and(!(1 << 12), Ordering::SeqCst);

    // Refused by the check, with where and how big.
    let around = |va: u64, pages| PageRange::new(va, pages).unwrap();
    assert_eq!(
        space.check_no_huge(around(two - PAGE_SIZE, 4)),
        Err(MapperError::HugePage { va: two, size: MIB2 })
    );
    assert_eq!(
        space.check_no_huge(around(one + 7 * MIB2, 1)),
        Err(MapperError::HugePage { va: one, size: GIB })
    );
    assert_eq!(space.check_no_huge(around(two - MIB2, 512)), Ok(()));
    assert_eq!(
        space.check_no_huge(around(0, two / PAGE_SIZE)),
        Ok(()),
        "the GiB below"
    );
    assert_eq!(
        space.next_populated(around(two + 3 * PAGE_SIZE, 10)),
        Some(two + 3 * PAGE_SIZE)
    );
    assert_eq!(space.next_populated(around(0x8000_0000, 1 << 28)), Some(one));

    // Never changed one 4 KiB piece at a time; its accessed bit is shared.
    let before = space.lookup(two);
    assert_eq!(space.exchange(two, Pte::EMPTY), Pte::EMPTY);
    space.set(two, Pte::EMPTY);
    assert_eq!(space.lookup(two), before);
    assert!(space.test_and_clear_accessed(two + PAGE_SIZE));
    assert!(!space.lookup(two).is_accessed() && !space.test_and_clear_accessed(two));

    // The crate's drivers: a frame inside the huge page is never believed
    // unmapped, and a protection change leaves the page as it is.
    let pages = Pages::default();
    // SAFETY: the one mapping is added before the crate walks.
    let mut rmap: BoundedRmap<'_, OffsetSpace<'_>, Pages, 4> = unsafe { BoundedRmap::new(&pages) };
    let inside = Frame(0x10_0001);
    rmap.add(inside, &space, two + PAGE_SIZE, MappingFlags::empty())
        .unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let r = try_to_unmap(&cpu0, &rmap, inside, TtuFlags::BATCH_FLUSH, &mut batch).unwrap();
    assert_eq!(r, SwapResult::Again);
    assert!(space.lookup(two + PAGE_SIZE).maps(inside));
    batch.flush(&cpu0).unwrap();
    let changed = change_protection(&cpu0, &space, around(two - PAGE_SIZE, 3), |p| {
        Pte(p.0 & !PteFlags::WRITABLE.bits())
    })
    .unwrap();
    assert_eq!(changed, 1, "the 4 KiB page only");
    assert!(!space.lookup(two - PAGE_SIZE).is_writable());
    assert!(space.lookup(two).is_writable(), "the huge page is left as it is");
    assert_eq!(m.violations(), []);
}

/// The kernel's side of a teardown: data frames go back to the simulated
/// machine (whose oracle checks no CPU still caches them); page-table
/// frames are recorded (they are host pages, leaked for the test).
struct Backing<'m> {
    machine: &'m MockMachine,
    dirty: Vec<Frame>,
    freed: Vec<Frame>,
    tables: Vec<Frame>,
}

impl FreeFrames for Backing<'_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        while let Some(f) = frames.pop() {
            self.machine.free_frame(f.frame()).unwrap();
            self.freed.push(f.into_frame());
        }
    }
}

impl TeardownBacking for Backing<'_> {
    fn set_dirty(&mut self, frame: Frame) {
        self.dirty.push(frame);
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        while let Some(f) = tables.pop() {
            self.tables.push(f.into_frame());
        }
    }
}

#[test]
fn mmu_gather_frees_data_frames_after_the_flush_and_detaches_emptied_tables() {
    let mut t = Tables::new();
    let (m, mm) = machine_with(2, &t);
    // One page in the first GiB that the teardown leaves alone, then two
    // leaf tables in the second GiB (one level-2 table).
    let keep = GIB - PAGE_SIZE;
    let vas = [GIB, GIB + 3 * PAGE_SIZE, GIB + 5 * MIB2];
    let frames: Vec<Frame> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    let (mut mapper, mut pool) = t.mapper();
    for (va, f) in [&keep].into_iter().chain(&vas).zip(&frames) {
        map::<Size4KiB>(&mut mapper, &mut pool, *va, f.addr(), user_rw());
    }
    // Allocation order: level 3, level 2 (first GiB), its leaf, level 2
    // (second GiB), its two leaves.
    let allocated: Vec<Frame> = pool.0.iter().map(|&a| Frame(a >> 12)).collect();
    assert_eq!(allocated.len(), 6);
    let mmu = HostMmu { root: t.root_addr() };
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.write(vas[1], 9).unwrap();
    cpu1.read(vas[2]).unwrap();

    let (mut mapper, _) = t.mapper();
    // SAFETY: each mapped frame's claim is the test's, handed over here,
    // and no table is shared with another address space.
    let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
    let mut backing = Backing {
        machine: &m,
        dirty: Vec::new(),
        freed: Vec::new(),
        tables: Vec::new(),
    };
    let mut gather = MmuGather::<16>::new();
    let mut handed_back = Vec::new();
    let cpu0 = m.cpu(0).unwrap();
    let summary = gather
        .unmap_range(
            &cpu0,
            &space,
            &mut backing,
            PageRange::new(GIB, GIB / PAGE_SIZE).unwrap(),
            true,
            &mut TableFreePolicy::IpiSync,
            &mut |f: OwnedFrame, k: FrameKind| handed_back.push((f.into_frame(), k)),
        )
        .unwrap();
    assert_eq!(handed_back, []);
    assert_eq!(summary.pages_unmapped, 3);
    assert_eq!(summary.flushes, 1);
    assert_eq!(backing.dirty, [frames[2]], "the written page's dirty bit moved");
    assert_eq!(
        backing.freed.iter().collect::<BTreeSet<_>>(),
        frames[1..].iter().collect()
    );
    let tables: BTreeSet<Frame> = backing.tables.iter().copied().collect();
    assert_eq!(
        tables,
        allocated[3..].iter().copied().collect(),
        "both leaves and their level-2 table"
    );
    assert_eq!(summary.tables_freed, 3);
    for va in vas {
        assert_eq!(space.lookup(va), Pte::EMPTY);
        assert!(mmu.entry(va).is_none(), "no walk reaches the detached tables");
    }
    assert!(space.lookup(keep).maps(frames[0]), "outside the range: kept");
    assert!(cpu1.write(vas[1], 1).is_err());
    assert_eq!(m.violations(), []);
    // Nothing left to detach; a range inside one table detaches nothing.
    assert_eq!(
        space_detach(&space, PageRange::new(GIB, GIB / PAGE_SIZE).unwrap()),
        None
    );
    assert_eq!(space_detach(&space, PageRange::new(0, 511).unwrap()), None);
}

fn space_detach(space: &OffsetTeardown<'_>, range: PageRange) -> Option<tlb_batch::DetachedTable> {
    use tlb_batch::TableTeardown;
    space.detach_table(range)
}

#[test]
fn addresses_no_four_level_table_translates_are_empty_and_never_panic() {
    let mut t = Tables::new();
    let (mut mapper, mut pool) = t.mapper();
    map::<Size4KiB>(&mut mapper, &mut pool, 0xffff_ffff_ffff_f000, 0x5000, user_rw());
    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: the test promises what `OffsetTeardown` asks (nothing is
    // freed: no teardown runs).
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };
    use tlb_batch::TableTeardown;
    let top = 0xffff_ffff_ffff_f000;
    assert!(
        space.lookup(top).is_writable(),
        "the last page of the address space"
    );
    for va in [
        0x0000_8000_0000_0000,
        0x0100_0000_0000_0000,
        0xff00_0000_0000_0000,
    ] {
        assert_eq!(space.lookup(va), Pte::EMPTY, "{va:#x}");
        assert_eq!(space.exchange(va, Pte(0x5003)), Pte::EMPTY);
        space.set(va, Pte(0x5003));
        assert!(!space.test_and_clear_accessed(va));
        let r = PageRange::new(va, 1).unwrap();
        assert_eq!(space.next_populated(r), None);
        assert_eq!(space.detach_table(r), None);
        assert_eq!(space.space().check_no_huge(r), Ok(()));
    }
    // A range across the hole finds the top page; detaching the top
    // table is refused while it maps a page.
    let hole = PageRange::new(0x7fff_ffff_f000, (1 << 52) - (0x7fff_ffff_f000 >> 12)).unwrap();
    assert_eq!(space.next_populated(hole), Some(top));
    assert_eq!(space.detach_table(hole), None);
    assert_eq!(space.detach_table(PageRange::EMPTY), None);
    assert!(space.lookup(top).is_present());
}

/// Maps a page at each of `vas` with the `x86_64` crate and clears it
/// again: the tables on the way to each stay linked, and empty.
fn empty_tables_at(t: &mut Tables, vas: &[u64]) {
    let (mut mapper, mut pool) = t.mapper();
    for &va in vas {
        map::<Size4KiB>(&mut mapper, &mut pool, va, 0x5000, user_rw());
    }
    let tlb = MmTlbState::new(asid(1), 0);
    let space = OffsetSpace::new(&mut mapper, &tlb);
    for &va in vas {
        assert!(space.clear(va).maps(Frame(5)));
    }
}

/// What detaching the table that the level-`level` entry (4 to 2) for `va`
/// names must answer: that table's frame, and the span the entry maps.
fn table_named(root: u64, va: u64, level: u32) -> DetachedTable {
    let span = PAGE_SIZE << (9 * (level - 1));
    let raw = upper_entry(root, va, level).load(Ordering::SeqCst);
    assert_eq!(raw & 1, 1, "{va:#x}: no table below level {level}");
    DetachedTable {
        frame: Frame((raw & 0x000f_ffff_ffff_f000) >> 12),
        range: PageRange::new(va & !(span - 1), span / PAGE_SIZE).unwrap(),
    }
}

/// Every table `detach_table` hands out for `range`, in order, until it
/// answers `None` (at most 64: a wrong answer must not loop for ever).
fn detach_all(space: &OffsetTeardown<'_>, range: PageRange) -> Vec<DetachedTable> {
    std::iter::from_fn(|| space_detach(space, range))
        .take(64)
        .collect()
}

/// The pages of `first..=last`.
fn pages_through(first: u64, last: u64) -> PageRange {
    PageRange::new(first, (last - first) / PAGE_SIZE + 1).unwrap()
}

/// Leaf tables the range only partly covers stay linked, at both ends, even
/// when empty: a range that starts one page into one leaf table's 2 MiB and
/// ends one page short of another's detaches exactly the empty leaf tables
/// in between, and not their level-2 table (the range covers only part of
/// its GiB); a leaf table the range covers whole but that still maps a page
/// stays too.
#[test]
fn detach_table_leaves_leaf_tables_the_range_covers_only_in_part() {
    let mut t = Tables::new();
    let root = t.root_addr();
    let slot = |i: u64| GIB + i * MIB2;
    // Empty leaf tables at the 2 MiB slots 0 to 3 of the second GiB; slot 4
    // keeps a page.
    empty_tables_at(&mut t, &[slot(0), slot(1), slot(2), slot(3)]);
    let (mut mapper, mut pool) = t.mapper();
    map::<Size4KiB>(&mut mapper, &mut pool, slot(4) + PAGE_SIZE, 0x7000, user_rw());
    let want = [table_named(root, slot(1), 2), table_named(root, slot(2), 2)];
    let partial = [slot(0), slot(3)].map(|va| table_named(root, va, 2));
    let kept = table_named(root, slot(4), 2);
    let level_2 = table_named(root, GIB, 3);

    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: nothing is freed (the test calls `detach_table` only, and the
    // tables are leaked); no table is shared.
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };
    // One page into slot 0 up to one page short of the end of slot 3; then
    // one page into slot 3 up to the end of slot 4.
    let range = pages_through(slot(0) + PAGE_SIZE, slot(4) - 2 * PAGE_SIZE);
    assert_eq!(detach_all(&space, range), want);
    let range = pages_through(slot(3) + PAGE_SIZE, slot(5) - PAGE_SIZE);
    assert_eq!(detach_all(&space, range), [], "slot 3 in part, slot 4 in use");

    for table in partial.iter().chain([&kept]) {
        let va = table.range.start();
        assert_eq!(table_named(root, va, 2), *table, "{va:#x}: still linked");
    }
    assert_eq!(table_named(root, GIB, 3), level_2);
    assert!(space.lookup(slot(4) + PAGE_SIZE).maps(Frame(7)));
    let mmu = HostMmu { root };
    assert!(mmu.entry(slot(1)).is_none() && mmu.entry(slot(2)).is_none());
    assert!(mmu.entry(slot(0)).is_some() && mmu.entry(slot(3)).is_some());
}

/// The same one level up: level-2 tables (1 GiB each) that the range covers
/// only in part stay linked once the teardown emptied them, those it covers
/// whole go after their leaf tables. The range starts in one level-2
/// table's GiB, so leaf tables at the start of the next ones, which the
/// scan reaches from an earlier table, are found too.
#[test]
fn detach_table_leaves_level_2_tables_the_range_covers_only_in_part() {
    let mut t = Tables::new();
    let root = t.root_addr();
    // A leaf table at 2 MiB slot 5 of the first GiB; at slot 0 of the
    // second, third and fourth.
    let vas = [5 * MIB2, GIB, 2 * GIB, 3 * GIB];
    empty_tables_at(&mut t, &vas);
    let leaves = vas.map(|va| table_named(root, va, 2));
    let level_2 = vas.map(|va| table_named(root, va, 3));
    let level_3 = table_named(root, 0, 4);
    let (mut mapper, _) = t.mapper();
    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: as above: nothing is freed, no table is shared.
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };

    // From slot 2 of the first GiB to the end of slot 1 of the fourth: all
    // four leaf tables, and the level-2 tables of the second and third GiB.
    let range = pages_through(2 * MIB2, 3 * GIB + 2 * MIB2 - PAGE_SIZE);
    let mut want = leaves.to_vec();
    want.extend([level_2[1], level_2[2]]);
    assert_eq!(detach_all(&space, range), want);
    for (i, &va) in vas.iter().enumerate() {
        assert!(HostMmu { root }.entry(va).is_none(), "{va:#x}");
        if i == 0 || i == 3 {
            assert_eq!(table_named(root, va, 3), level_2[i], "{va:#x}: only in part");
        }
    }
    assert_eq!(table_named(root, 0, 4), level_3);
}

/// And at the top: level-3 tables (512 GiB each, named by the level-4
/// table) that the range covers only in part stay linked; the one it
/// covers whole goes after its level-2 and leaf tables. Again the scan
/// reaches tables at index 0 from an earlier one.
#[test]
fn detach_table_leaves_level_3_tables_the_range_covers_only_in_part() {
    const TIB_HALF: u64 = 512 * GIB;
    let mut t = Tables::new();
    let root = t.root_addr();
    // Level-4 entries 1, 2 and 3: one page in the second GiB of the first,
    // at the very start of the second and third.
    let vas = [TIB_HALF + GIB, 2 * TIB_HALF, 3 * TIB_HALF];
    empty_tables_at(&mut t, &vas);
    let leaves = vas.map(|va| table_named(root, va, 2));
    let level_2 = vas.map(|va| table_named(root, va, 3));
    let level_3 = vas.map(|va| table_named(root, va, 4));
    let (mut mapper, _) = t.mapper();
    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: as above: nothing is freed, no table is shared.
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };

    // From the second GiB of entry 1 to the end of the first two GiB of
    // entry 3.
    let range = pages_through(TIB_HALF + GIB, 3 * TIB_HALF + 2 * GIB - PAGE_SIZE);
    let mut want = leaves.to_vec();
    want.extend(level_2);
    want.push(level_3[1]);
    assert_eq!(detach_all(&space, range), want);
    assert_eq!(table_named(root, vas[0], 4), level_3[0], "only in part");
    assert_eq!(table_named(root, vas[2], 4), level_3[2], "only in part");
    assert_eq!(upper_entry(root, vas[1], 4).load(Ordering::SeqCst), 0);
}

/// A huge entry's PAT bit is bit 12, the lowest bit of a 4 KiB frame
/// number: the 4 KiB view of every piece moves it to bit 7 and keeps it out
/// of the frame, at an even piece (where a leaked bit 12 would show as the
/// next frame) as at an odd one, for 2 MiB and 1 GiB pages alike.
#[test]
fn a_huge_pages_pat_bit_never_shows_in_its_frames() {
    let mut t = Tables::new();
    let root = t.root_addr();
    let (mut mapper, mut pool) = t.mapper();
    let two = 0x4000_0000;
    let one = 0x80_0000_0000;
    map::<Size2MiB>(&mut mapper, &mut pool, two, 0x1_0000_0000, user_rw());
    map::<Size1GiB>(&mut mapper, &mut pool, one, 0x40_0000_0000, user_rw());
    const PAT: u64 = 1 << 12;
    upper_entry(root, two, 2).fetch_or(PAT, Ordering::SeqCst);
    upper_entry(root, one, 3).fetch_or(PAT, Ordering::SeqCst);
    let tlb = MmTlbState::new(asid(1), 0);
    let space = OffsetSpace::new(&mut mapper, &tlb);
    let flags = PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::USER;
    let piece = |frame: u64| Pte(Pte::new(Frame(frame), flags).0 | 1 << 7);
    for (base, frame, pieces) in [(two, 0x10_0000, 512), (one, 0x400_0000, 1 << 18)] {
        for i in [0, 1, 2, 4, pieces - 2, pieces - 1] {
            assert_eq!(
                space.lookup(base + i * PAGE_SIZE),
                piece(frame + i),
                "{base:#x}: piece {i}"
            );
        }
    }
}

/// `OffsetTeardown` is the same address space: each primitive, called on
/// it, reads and changes the entry words its `OffsetSpace` does, and its
/// address-space state is the one it was made with.
#[test]
fn offset_teardown_forwards_every_primitive_to_its_space() {
    let mut t = Tables::new();
    let (mut mapper, mut pool) = t.mapper();
    let va = 0x40_0000;
    map::<Size4KiB>(&mut mapper, &mut pool, va, 0x5000, user_rw() | F::ACCESSED);
    map::<Size4KiB>(&mut mapper, &mut pool, va + 3 * PAGE_SIZE, 0x6000, user_rw());
    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: nothing is freed: no teardown runs.
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };
    assert!(std::ptr::eq(space.tlb_state(), &tlb));
    assert!(std::ptr::eq(space.space().tlb_state(), &tlb));

    assert_eq!(space.lookup(va), Pte(0x5000 | (user_rw() | F::ACCESSED).bits()));
    assert!(space.test_and_clear_accessed(va), "the accessed bit was set");
    assert!(!space.space().lookup(va).is_accessed(), "and is cleared");
    assert!(!space.test_and_clear_accessed(va));
    assert!(!space.test_and_clear_accessed(va + 3 * PAGE_SIZE));

    let ro = Pte::new(Frame(8), PteFlags::PRESENT | PteFlags::USER);
    space.set(va, ro);
    assert_eq!(space.space().lookup(va), ro);
    assert_eq!(space.exchange(va, Pte::EMPTY), ro);
    assert_eq!(space.space().lookup(va), Pte::EMPTY);
    let table = PageRange::new(va, 512).unwrap();
    assert_eq!(space.next_populated(table), Some(va + 3 * PAGE_SIZE));
}

/// `next_populated` answers only addresses inside its range: stepping over
/// an absent GiB can land on a huge page just past the range's end, which
/// it does not report.
#[test]
fn next_populated_never_answers_a_huge_page_past_the_range() {
    let mut t = Tables::new();
    let (mut mapper, mut pool) = t.mapper();
    let two = 0x4000_0000;
    map::<Size2MiB>(&mut mapper, &mut pool, two, 0x1_0000_0000, user_rw());
    let tlb = MmTlbState::new(asid(1), 0);
    let space = OffsetSpace::new(&mut mapper, &tlb);
    // The last 2 MiB of the first GiB (no level-2 table), and its last page.
    assert_eq!(
        space.next_populated(PageRange::new(two - MIB2, 512).unwrap()),
        None
    );
    assert_eq!(
        space.next_populated(PageRange::page(two - PAGE_SIZE).unwrap()),
        None
    );
    // One page more reaches it.
    assert_eq!(
        space.next_populated(PageRange::new(two - MIB2, 513).unwrap()),
        Some(two)
    );
}

/// A table address that is not page-aligned is unusable, so what it would
/// translate is absent (module documentation): with a physical-memory
/// offset of 8, the level-3 table a level-4 entry names would start 8
/// bytes into a page, and nothing there is read (its first word, which
/// would map a 1 GiB page, is neither reported nor changed).
#[test]
fn a_table_address_that_is_not_page_aligned_translates_nothing() {
    let root: &'static mut X86Table = Box::leak(Box::new(X86Table::new()));
    // Two zeroed pages: the "table" at offset 8 into them is mapped,
    // readable and writable, as `from_raw_parts` asks.
    let below: &'static mut [X86Table; 2] = Box::leak(Box::new([X86Table::new(), X86Table::new()]));
    let below = below.as_mut_ptr() as u64;
    // SAFETY: `below` is a leaked 8 KiB host allocation; word 1 of it (its
    // bytes 8 to 15) is the first word of the table seen at offset 8.
    let seen = unsafe { &*((below + 8) as *const AtomicU64) };
    seen.store(0x4000_0000 | (user_rw() | F::HUGE_PAGE).bits(), Ordering::SeqCst);
    root[0].set_addr(PhysAddr::new(below), user_rw());
    let root = &*root as *const X86Table as u64;
    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: the level-4 table is a leaked, aligned host page; the one
    // frame its entries name (`below`) is mapped, readable and writable,
    // at 8 plus its address, for the whole test. Nothing else changes it.
    let space = unsafe { OffsetSpace::from_raw_parts(VirtAddr::new(root), VirtAddr::new(8), &tlb) };
    let first = PageRange::new(0, 512).unwrap();
    assert_eq!(space.lookup(0), Pte::EMPTY);
    assert_eq!(space.lookup(0x1000), Pte::EMPTY);
    assert_eq!(space.next_populated(first), None);
    assert_eq!(space.check_no_huge(first), Ok(()));
    assert!(!space.test_and_clear_accessed(0));
    assert_eq!(seen.load(Ordering::SeqCst) & PteFlags::ACCESSED.bits(), 0);
}

/// What `MapperError` and `OffsetSpace` print.
#[test]
fn mapper_errors_and_spaces_print_what_they_hold() {
    let huge = MapperError::HugePage {
        va: 0x4000_0000,
        size: MIB2,
    };
    assert_eq!(huge.to_string(), "a huge page of 0x200000 bytes maps 0x40000000");
    let far = MapperError::FrameOutOfRange {
        frame: Frame(1 << 40),
    };
    assert_eq!(
        far.to_string(),
        "pfn(0x10000000000) lies beyond 52 bits of physical address"
    );
    let err: &dyn std::error::Error = &far;
    assert!(err.source().is_none());

    let mut t = Tables::new();
    let root = t.root_addr();
    let (mut mapper, _) = t.mapper();
    let tlb = MmTlbState::new(asid(3), 0);
    let space = OffsetSpace::new(&mut mapper, &tlb);
    let want = format!("OffsetSpace {{ level_4: {root:#x}, offset: 0x0, asid: asid(3) }}");
    assert_eq!(format!("{space:?}"), want);
    // SAFETY: nothing is freed: no teardown runs.
    let teardown = unsafe { space.for_teardown() };
    assert_eq!(
        format!("{teardown:?}"),
        format!("OffsetTeardown {{ space: {want} }}")
    );
}

/// A range with an end in the non-canonical hole is refused whole, as
/// `check_range` refuses it for the gather: nothing is detached, not even
/// empty tables that lie wholly inside its canonical part, and those same
/// tables go once the range stops at the edge of the hole.
#[test]
fn detach_table_refuses_a_range_with_an_end_in_the_hole() {
    const LOWER_LAST_GIB: u64 = 0x7fff_c000_0000;
    const HOLE: u64 = 0x0000_8000_0000_0000;
    const UPPER: u64 = 0xffff_8000_0000_0000;
    let mut t = Tables::new();
    let root = t.root_addr();
    // An empty leaf table in the last 2 MiB of the lower half and one in
    // the first 2 MiB of the upper half.
    let vas = [HOLE - MIB2, UPPER];
    empty_tables_at(&mut t, &vas);
    let want = vas.map(|va| [table_named(root, va, 2), table_named(root, va, 3)]);
    let (mut mapper, _) = t.mapper();
    let tlb = MmTlbState::new(asid(1), 0);
    // SAFETY: nothing is freed: the test calls `detach_table` only, and
    // the tables are leaked; no table is shared.
    let space = unsafe { OffsetSpace::new(&mut mapper, &tlb).for_teardown() };

    // The last GiB of the lower half and the hole's first page; the hole's
    // first page and the upper half's first GiB.
    assert_eq!(detach_all(&space, pages_through(LOWER_LAST_GIB, HOLE)), []);
    assert_eq!(
        detach_all(&space, pages_through(HOLE, UPPER + GIB - PAGE_SIZE)),
        []
    );
    for (va, tables) in vas.iter().zip(&want) {
        assert_eq!([table_named(root, *va, 2), table_named(root, *va, 3)], *tables);
    }

    let lower = pages_through(LOWER_LAST_GIB, HOLE - PAGE_SIZE);
    assert_eq!(detach_all(&space, lower), want[0]);
    let upper = pages_through(UPPER, UPPER + GIB - PAGE_SIZE);
    assert_eq!(detach_all(&space, upper), want[1]);
}
