//! The `x86_64-mapper` feature against real four-level tables (built with
//! the `x86_64` crate in host memory, see `x86_64_mapper_space.rs`), what
//! `OffsetSpace` leaves alone or refuses: 2 MiB and 1 GiB pages (reported
//! present, refused, never changed, their PAT bit kept out of their
//! frames), addresses no four-level table translates, a table address that
//! is not page-aligned; and what `MapperError` and the spaces print.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};

use common::asid;
use common::x86_tables::{machine_with, map, upper_entry, user_rw, Pages, Tables, GIB, MIB2};
use tlb_batch::mapper::{MapperError, OffsetSpace};
use tlb_batch::{
    change_protection, try_to_unmap, BoundedRmap, Frame, MappingFlags, MmTlbState, PageRange, PageTable, Pte,
    PteFlags, TlbFlushUnmapBatch, TtuFlags, PAGE_SIZE,
};
use x86_64::structures::paging::{PageTable as X86Table, PageTableFlags as F, Size1GiB, Size2MiB, Size4KiB};
use x86_64::{PhysAddr, VirtAddr};

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
    assert_eq!(space.exchange(two + PAGE_SIZE, Pte::EMPTY), Pte::EMPTY);
    space.set(two + PAGE_SIZE, Pte::EMPTY);
    assert_eq!(space.lookup(two), before);
    assert!(space.test_and_clear_accessed(two + PAGE_SIZE));
    assert!(!space.lookup(two).is_accessed() && !space.test_and_clear_accessed(two));
    // At its first address the whole entry is written and exchanged, in
    // its 4 KiB view: write-protected (still a 2 MiB page), then cleared.
    // A migration entry has no huge form, and changes nothing.
    let level_2 = upper_entry(t_root, two, 2);
    let saved = level_2.load(Ordering::SeqCst);
    let unaccessed = Pte(before.0 & !PteFlags::ACCESSED.bits());
    assert_eq!(space.exchange(two, unaccessed.to_migration()), Pte::EMPTY);
    let read_only = Pte(unaccessed.0 & !PteFlags::WRITABLE.bits());
    space.set(two, read_only);
    assert!(!space.lookup(two + 9 * PAGE_SIZE).is_writable());
    assert_eq!(space.entry_size(two), tlb_batch::PageSize::SIZE_2M);
    assert_eq!(
        level_2.load(Ordering::SeqCst),
        saved & !(PteFlags::WRITABLE | PteFlags::ACCESSED).bits()
    );
    assert_eq!(space.exchange(two, Pte::EMPTY), read_only);
    assert_eq!(space.lookup(two + 7 * PAGE_SIZE), Pte::EMPTY, "every piece went");
    assert_eq!(level_2.load(Ordering::SeqCst), 0);
    level_2.store(saved, Ordering::SeqCst);

    // The crate's drivers: a frame inside the huge page is never believed
    // unmapped (its unmap is refused, tests/huge_rmap.rs has the rest), and
    // a protection change leaves the page as it is.
    let pages = Pages::default();
    // SAFETY: the one mapping is added before the crate walks.
    let mut rmap: BoundedRmap<'_, OffsetSpace<'_>, Pages, 4> = unsafe { BoundedRmap::new(&pages) };
    let inside = Frame(0x10_0001);
    rmap.add(inside, &space, two + PAGE_SIZE, MappingFlags::empty())
        .unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let r = try_to_unmap(&cpu0, &rmap, inside, TtuFlags::BATCH_FLUSH, &mut batch);
    assert_eq!(r, Err(tlb_batch::Error::HugePage { va: two, size: MIB2 }));
    assert!(space.lookup(two + PAGE_SIZE).maps(inside));
    assert!(
        batch.is_empty() && !mm.batched_flush_pending(),
        "no flush recorded"
    );
    batch.flush(&cpu0).unwrap();
    // A range a huge page maps part of is refused, with nothing changed,
    // rather than changed around the huge page.
    let read_only = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
    assert_eq!(
        change_protection(&cpu0, &space, around(two - PAGE_SIZE, 3), read_only),
        Err(tlb_batch::Error::HugePage { va: two, size: MIB2 })
    );
    assert!(space.lookup(two - PAGE_SIZE).is_writable(), "nothing changed");
    assert!(space.lookup(two).is_writable(), "the huge page is left as it is");
    let changed = change_protection(&cpu0, &space, around(two - PAGE_SIZE, 1), read_only).unwrap();
    assert_eq!(changed, 1, "the 4 KiB page alone");
    assert!(!space.lookup(two - PAGE_SIZE).is_writable());
    assert_eq!(m.violations(), []);
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
