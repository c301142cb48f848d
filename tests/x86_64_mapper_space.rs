//! The `x86_64-mapper` feature against real four-level tables, the
//! primitives and range operations of `OffsetSpace`: tables built in host
//! memory with the `x86_64` crate's `OffsetPageTable` (physical offset 0,
//! so a table frame's address is its host address), pages mapped with
//! `Mapper::map_to`, and the simulated MMU walking the same entry words, so
//! CPU writes set dirty bits in them and the oracle judges every flush and
//! free. Huge pages and addresses no table translates are in
//! `x86_64_mapper_huge.rs`, teardown in `x86_64_mapper_teardown.rs`.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::asid;
use common::x86_tables::{machine_with, map, user_rw, HostMmu, Pages, Tables, GIB};
use tlb_batch::arch::mock::{CountingTable, MmuTable};
use tlb_batch::mapper::{MapperError, OffsetSpace};
use tlb_batch::{
    change_protection, try_to_unmap, BoundedRmap, Frame, MappingFlags, MmTlbState, PageRange, PageTable, Pte,
    PteFlags, SwapResult, TlbFlushUnmapBatch, TtuFlags, PAGE_SIZE,
};
use x86_64::structures::paging::mapper::{Translate, TranslateResult};
use x86_64::structures::paging::{PageTableFlags as F, PhysFrame, Size2MiB, Size4KiB};
use x86_64::{PhysAddr, VirtAddr};

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
