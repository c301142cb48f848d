//! The `page-table-multiarch` feature against real four-level tables:
//! `X64PageTable`s built in host memory by `page_table_multiarch` through a
//! `PagingHandler` whose physical addresses are host addresses less a fixed
//! offset, pages mapped with the table's own cursor, and the simulated MMU
//! walking the same entry words (so CPU writes set dirty bits in them, and
//! the oracle judges every flush and free). Teardown is in
//! `ptm_teardown.rs`.

#![cfg(all(feature = "page-table-multiarch", feature = "mock", target_arch = "x86_64"))]

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::asid;
use common::ptm_tables::{machine_with, map, table, user_ro, user_rw, Pages, PtmMmu, MIB2};
use memory_addr::VirtAddr;
use page_table_multiarch::{MappingFlags, PageSize, PagingError};
use tlb_batch::arch::mock::MmuTable;
use tlb_batch::ptm::PtmSpace;
use tlb_batch::{
    change_protection, try_to_unmap, BoundedRmap, Error, Frame, MappingFlags as RmapFlags, MmTlbState,
    PageRange, PageTable, Pte, PteFlags, SwapResult, TlbFlushUnmapBatch, TtuFlags, PAGE_SIZE,
};

const VA: u64 = 0x40_0000;

fn va(i: usize) -> u64 {
    VA + i as u64 * PAGE_SIZE
}

fn query(t: &common::ptm_tables::Table, va: u64) -> Result<(u64, MappingFlags, PageSize), PagingError> {
    t.query(VirtAddr::from(va as usize))
        .map(|(pa, flags, size)| (pa.as_usize() as u64, flags, size))
}

#[test]
fn lookup_sees_the_words_the_cursor_wrote_and_the_table_reads_what_the_crate_wrote() {
    let mut t = table();
    map(&mut t, va(0), Frame(0x12345), PageSize::Size4K, user_rw());
    map(
        &mut t,
        va(1),
        Frame(0x6),
        PageSize::Size4K,
        user_ro() | MappingFlags::EXECUTE,
    );
    map(
        &mut t,
        0xffff_8000_0010_0000,
        Frame(0x7),
        PageSize::Size4K,
        MappingFlags::READ,
    );
    let root = t.root_paddr().as_usize() as u64;
    let tlb = MmTlbState::new(asid(1), 0);
    {
        let space = PtmSpace::new(&mut t, &tlb);
        assert_eq!(space.root_paddr(), root);
        let rw = space.lookup(va(0));
        assert!(rw.maps(Frame(0x12345)) && rw.is_writable());
        assert!(rw.flags().contains(PteFlags::USER | PteFlags::NO_EXECUTE));
        let rx = space.lookup(va(1));
        assert!(rx.maps(Frame(6)) && !rx.is_writable());
        assert!(!rx.flags().contains(PteFlags::NO_EXECUTE));
        let kernel = space.lookup(0xffff_8000_0010_0000);
        assert!(kernel.maps(Frame(7)) && !kernel.flags().contains(PteFlags::USER));
        // Same leaf table, no entry; no table at all; beyond 48 bits.
        assert_eq!(space.lookup(va(2)), Pte::EMPTY);
        assert_eq!(space.lookup(0x7fff_ffff_f000), Pte::EMPTY);
        assert_eq!(space.lookup(0x0100_0000_0040_0000), Pte::EMPTY);

        // The primitives, on the same words.
        assert!(!space.test_and_clear_accessed(va(0)));
        let old = space.exchange(va(0), Pte::migration(Frame(0x12345), true));
        assert_eq!(old, rw);
        assert!(space.lookup(va(0)).is_migration());
        assert_eq!(space.clear(va(0)), Pte::migration(Frame(0x12345), true));
        space.set(va(1), Pte::new(Frame(8), PteFlags::PRESENT | PteFlags::WRITABLE));
        // No table there: nothing exchanged, and `set` builds none.
        assert_eq!(space.exchange(0x80_0000_0000, rw), Pte::EMPTY);
        space.set(0x80_0000_0000, rw);
        assert_eq!(space.lookup(0x80_0000_0000), Pte::EMPTY);
    }
    // `page_table_multiarch` reads what the crate wrote.
    assert_eq!(query(&t, va(0)), Err(PagingError::NotMapped));
    let (pa, flags, size) = query(&t, va(1)).unwrap();
    assert_eq!((pa, size), (0x8000, PageSize::Size4K));
    assert_eq!(
        flags,
        MappingFlags::READ | MappingFlags::WRITE | MappingFlags::EXECUTE
    );
    assert_eq!(query(&t, 0x80_0000_0000), Err(PagingError::NotMapped));
}

/// The MMU sets the dirty bit while the crate exchanges the entry: with one
/// atomic swap each bit set is returned exactly once or stays in the entry.
#[test]
fn exchange_never_loses_a_dirty_bit_the_hardware_sets_meanwhile() {
    let mut t = table();
    map(&mut t, VA, Frame(5), PageSize::Size4K, user_rw());
    let root = t.root_paddr().as_usize() as u64;
    let word = PtmMmu { root }.entry(VA).unwrap() as *const AtomicU64 as usize;
    let tlb = MmTlbState::new(asid(1), 0);
    let space = PtmSpace::new(&mut t, &tlb);
    let clean = space.lookup(VA);
    let dirty = PteFlags::DIRTY.bits();
    let (stop, set) = (AtomicBool::new(false), AtomicUsize::new(0));
    let mut seen = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: the handler never frees table frames.
            let word = unsafe { &*(word as *const AtomicU64) };
            while !stop.load(Ordering::Relaxed) {
                if word.fetch_or(dirty, Ordering::SeqCst) & dirty == 0 {
                    set.fetch_add(1, Ordering::SeqCst);
                }
                std::hint::spin_loop();
            }
        });
        let until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < until && set.load(Ordering::Relaxed) < 10_000 {
            for _ in 0..1000 {
                seen += usize::from(space.exchange(VA, clean).is_dirty());
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    seen += usize::from(space.lookup(VA).is_dirty());
    let set = set.load(Ordering::SeqCst);
    assert!(set > 0, "the writer ran");
    assert_eq!(seen, set, "every dirty bit set is seen once");
}

/// Reclaim through a `BoundedRmap`: the entries go at once, the flush is
/// deferred into one batch, and that flush interrupts exactly the CPUs
/// that run the space (not the initiator, not a CPU running another one).
#[test]
fn try_to_unmap_batches_and_the_flush_reaches_exactly_the_cpus_running_the_space() {
    let mut t = table();
    let (m, mm) = machine_with(4, &t);
    let frames: Vec<Frame> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    for (i, &f) in frames.iter().enumerate() {
        // Pages 0 and 1 writable, 2 and 3 read-only.
        let flags = if i < 2 { user_rw() } else { user_ro() };
        map(&mut t, va(i), f, PageSize::Size4K, flags);
    }
    let space = PtmSpace::new(&mut t, &mm);
    for c in [1, 2] {
        let cpu = m.cpu(c).unwrap();
        cpu.switch_to(&mm).unwrap();
        cpu.write(va(0), 7).unwrap();
        for i in 1..4 {
            cpu.read(va(i)).unwrap();
        }
    }
    // CPU 3 runs another address space: no flush of this one is its.
    let other = m.new_mm(asid(2)).unwrap();
    let other_frame = m.map_new(&other, VA, true).unwrap();
    m.cpu(3).unwrap().switch_to(&other).unwrap();
    m.cpu(3).unwrap().write(VA, 1).unwrap();
    assert!(
        space.lookup(va(0)).is_dirty(),
        "the MMU set the dirty bit in the table's word"
    );
    assert!(!space.lookup(va(1)).is_dirty());
    for i in 0..4 {
        assert!(space.test_and_clear_accessed(va(i)), "page {i} was accessed");
    }

    let pages = Pages::default();
    // SAFETY: every mapping is added before the crate walks.
    let mut rmap: BoundedRmap<'_, PtmSpace<'_, _>, Pages, 8> = unsafe { BoundedRmap::new(&pages) };
    for (i, &f) in frames.iter().enumerate() {
        rmap.add(f, &space, va(i), RmapFlags::empty()).unwrap();
    }
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let results: Vec<SwapResult> = frames
        .iter()
        .map(|&f| try_to_unmap(&cpu0, &rmap, f, TtuFlags::BATCH_FLUSH, &mut batch).unwrap())
        .collect();
    use SwapResult::{Success, SuccessCached};
    assert_eq!(results, [SuccessCached, SuccessCached, Success, Success]);
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
    assert_eq!(
        (report.remote_cpus, report.ipis_sent),
        (2, 2),
        "one IPI per CPU running it"
    );
    let taken: Vec<u64> = (0..4)
        .map(|c| m.interrupts_taken(m.cpu(c).unwrap().id()).unwrap())
        .collect();
    assert_eq!(taken, [0, 1, 1, 0], "exactly CPUs 1 and 2");
    for f in frames {
        assert_eq!(m.cached_translations(f), []);
        m.free_frame(f).unwrap();
    }
    assert!(m.cpu(1).unwrap().write(va(0), 8).is_err(), "the page is gone");
    assert_eq!(m.cpu(3).unwrap().read(VA), Ok(1), "the other space is untouched");
    assert!(m.cached_translations(other_frame).len() == 1);
    assert_eq!(m.violations(), []);
}

/// A 2 MiB page: reported present (never taken for unmapped), refused by
/// `check_no_huge` with `Error::HugePage`, so `change_protection` refuses a
/// range holding part of it with nothing changed, and left whole by the
/// primitives inside it, so `try_to_unmap` of a piece is refused.
#[test]
fn a_huge_page_is_refused_and_never_changed() {
    let mut t = table();
    let (m, mm) = machine_with(2, &t);
    let huge_base = 0x4000_0000;
    map(
        &mut t,
        huge_base,
        Frame(0x20_0000 >> 12),
        PageSize::Size2M,
        user_rw(),
    );
    map(&mut t, huge_base + MIB2, Frame(0x99), PageSize::Size4K, user_rw());
    let space = PtmSpace::new(&mut t, &mm);
    let inside = huge_base + 5 * PAGE_SIZE;
    let piece = space.lookup(inside);
    assert!(piece.maps(Frame(0x205)) && piece.is_writable(), "{piece:?}");
    let range = PageRange::new(huge_base, 2 * MIB2 / PAGE_SIZE).unwrap();
    let refused = Error::HugePage {
        va: huge_base,
        size: MIB2,
    };
    assert_eq!(space.check_no_huge(range), Err(refused));
    assert_eq!(
        space.check_no_huge(PageRange::page(inside).unwrap()),
        Err(refused)
    );
    assert_eq!(
        space.check_no_huge(PageRange::page(huge_base + MIB2).unwrap()),
        Ok(())
    );
    assert_eq!(space.next_populated(range), Some(huge_base));

    // A protection change over part of it is refused before the 4 KiB
    // page beside it changes (tests/huge_range.rs takes one whole).
    let cpu0 = m.cpu(0).unwrap();
    let beside = space.lookup(huge_base + MIB2);
    let both = PageRange::new(inside, (huge_base + MIB2 - inside) / PAGE_SIZE + 1).unwrap();
    let read_only = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
    assert_eq!(change_protection(&cpu0, &space, both, read_only), Err(refused));
    assert_eq!(space.lookup(huge_base + MIB2), beside);
    assert!(space.lookup(inside).is_writable());

    let before = space.lookup(inside);
    assert_eq!(space.exchange(inside, Pte::EMPTY), Pte::EMPTY);
    space.set(inside, Pte::EMPTY);
    assert_eq!(
        space.lookup(inside),
        before,
        "the huge entry is unchanged inside it"
    );

    let pages = Pages::default();
    // SAFETY: the one mapping is added before the crate walks.
    let mut rmap: BoundedRmap<'_, PtmSpace<'_, _>, Pages, 2> = unsafe { BoundedRmap::new(&pages) };
    rmap.add(Frame(0x205), &space, inside, RmapFlags::empty())
        .unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let result = try_to_unmap(&cpu0, &rmap, Frame(0x205), TtuFlags::BATCH_FLUSH, &mut batch);
    assert_eq!(
        result,
        Err(refused),
        "a piece of a huge page is not unmapped alone"
    );
    assert_eq!(space.lookup(inside), before);
    assert!(batch.is_empty() && !mm.batched_flush_pending());
    assert_eq!(m.violations(), []);
}

#[test]
fn change_protection_write_protects_real_entries_and_keeps_dirty_bits() {
    let mut t = table();
    let (m, mm) = machine_with(2, &t);
    let vas = [va(0), 0x4000_3000, 0xc000_0000 + 511 * PAGE_SIZE];
    let outside = 0x80_0000_0000;
    let frames: Vec<Frame> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    for (&va, &f) in vas.iter().chain([&outside]).zip(&frames) {
        map(&mut t, va, f, PageSize::Size4K, user_rw());
    }
    let space = PtmSpace::new(&mut t, &mm);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    for va in vas {
        cpu1.write(va, 1).unwrap();
    }
    let range = PageRange::new(0, (4 << 30) / PAGE_SIZE).unwrap();
    space.check_no_huge(range).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let changed = change_protection(&cpu0, &space, range, |p| Pte(p.0 & !PteFlags::WRITABLE.bits())).unwrap();
    assert_eq!(changed, 3);
    for va in vas {
        let pte = space.lookup(va);
        assert!(
            pte.is_present() && !pte.is_writable() && pte.is_dirty(),
            "{va:#x}: {pte:?}"
        );
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
    let mut t = table();
    let low = 0x7f00_0000_0000 + 3 * PAGE_SIZE;
    let high = 0xffff_ff80_0000_0000 + 5 * PAGE_SIZE;
    map(&mut t, low, Frame(5), PageSize::Size4K, user_rw());
    map(&mut t, high, Frame(6), PageSize::Size4K, user_rw());
    let tlb = MmTlbState::new(asid(1), 0);
    let space = PtmSpace::new(&mut t, &tlb);
    let everything = PageRange::new(0, 1 << 52).unwrap();
    assert_eq!(space.next_populated(everything), Some(low));
    assert_eq!(space.next_populated(everything.after(low)), Some(high));
    assert_eq!(space.next_populated(everything.after(high)), None);
    let leaf = PageRange::new(0x7f00_0000_0000, 512).unwrap();
    assert_eq!(
        space.next_populated(PageRange::new(0x7f00_0000_0000, 3).unwrap()),
        None
    );
    // A migration entry is not empty: it is not skipped.
    space.exchange(low, Pte::migration(Frame(5), false));
    assert_eq!(space.next_populated(leaf), Some(low));
    space.clear(low);
    assert_eq!(space.next_populated(leaf), None);
    assert_eq!(space.next_populated(PageRange::EMPTY), None);
}

/// A kernel that keeps its table behind its own lock passes the root: the
/// same entries, the same changes.
#[test]
fn from_root_sees_and_changes_what_new_does() {
    let mut t = table();
    map(&mut t, va(0), Frame(0x42), PageSize::Size4K, user_rw());
    let root = t.root_paddr().as_usize();
    let tlb = MmTlbState::new(asid(1), root as u64);
    let by_borrow = PtmSpace::new(&mut t, &tlb).lookup(va(0));
    // SAFETY: `t` is live, its handler maps every table frame, and
    // nothing else touches it while `space` lives.
    let space = unsafe { PtmSpace::<common::ptm_tables::HostPaging>::from_root(root, &tlb) };
    assert_eq!(space.root_paddr(), root as u64);
    assert_eq!(space.lookup(va(0)), by_borrow);
    assert!(space.clear(va(0)).maps(Frame(0x42)));
    assert_eq!(query(&t, va(0)), Err(PagingError::NotMapped));
}
