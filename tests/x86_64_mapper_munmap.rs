//! The `x86_64-mapper` feature against real four-level tables (built with
//! the `x86_64` crate in host memory, see `x86_64_mapper_space.rs`), the
//! short munmap path: `OffsetTeardown::munmap` frees data and table frames
//! into a `FrameDeallocator` only after a flush that reaches the CPUs
//! running the space, refuses a range a huge page maps with nothing
//! changed (the long form `unmap_range` too), keeps what a failed flush
//! owes for the next call; `munmap_bounded` frees the tables two half
//! munmaps emptied; `DeallocatorFrees` gets exactly the frames;
//! `MapperError` converts into `Error`.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};

use common::x86_tables::{machine_with, map, user_rw, Tables, GIB, MIB2};
use tlb_batch::arch::mock::MockMachine;
use tlb_batch::heapless;
use tlb_batch::mapper::{DeallocatorFrees, MapperError, OffsetSpace};
use tlb_batch::{
    Error, Frame, FreeFrames, MmuGather, OwnedFrame, PageGather, PageRange, PageTable, Pte, TableBounds,
    TableFreePolicy, TeardownBacking, PAGE_SIZE,
};
use x86_64::structures::paging::{
    FrameDeallocator, PageTableFlags as F, PhysFrame, Size1GiB, Size2MiB, Size4KiB,
};

/// The kernel's `FrameDeallocator`: data frames go back to the simulated
/// machine (whose oracle judges the free), table frames (host pages,
/// leaked for the test) are recorded. At every call it also records
/// whether some CPU still caches a translation to any of `watched`.
struct Dealloc<'m> {
    machine: &'m MockMachine,
    data: BTreeSet<Frame>,
    watched: Vec<Frame>,
    freed: Vec<Frame>,
    cached_at_free: usize,
}

impl<'m> Dealloc<'m> {
    fn new(machine: &'m MockMachine, data: &[Frame]) -> Self {
        Dealloc {
            machine,
            data: data.iter().copied().collect(),
            watched: data.to_vec(),
            freed: Vec::new(),
            cached_at_free: 0,
        }
    }
}

impl FrameDeallocator<Size4KiB> for Dealloc<'_> {
    unsafe fn deallocate_frame(&mut self, frame: PhysFrame) {
        let frame = Frame::from(frame);
        let cached: usize = self
            .watched
            .iter()
            .map(|&f| self.machine.cached_translations(f).len())
            .sum();
        self.cached_at_free += cached;
        if self.data.contains(&frame) {
            self.machine.free_frame(frame).unwrap();
        }
        self.freed.push(frame);
    }
}

/// Every entry word of the root and of the tables in `pool`.
fn table_words(t: &Tables) -> Vec<u64> {
    std::iter::once(t.root_addr())
        .chain(t.pool.iter().copied())
        .flat_map(|table| {
            (0..512u64).map(move |i| {
                // SAFETY: `table` is a leaked host page table (offset 0)
                // and i < 512; entries are only accessed atomically.
                let word = unsafe { &*((table + i * 8) as *const AtomicU64) };
                word.load(Ordering::SeqCst)
            })
        })
        .collect()
}

#[test]
fn munmap_frees_data_and_tables_after_one_flush_that_reaches_the_cpus_running_the_space() {
    let mut t = Tables::new();
    let (m, mm) = machine_with(3, &t);
    // One page in the first GiB that stays, then three pages in two leaf
    // tables (one level-2 table) of the second GiB.
    let keep = GIB - PAGE_SIZE;
    let vas = [GIB, GIB + 3 * PAGE_SIZE, GIB + 5 * MIB2];
    let frames: Vec<Frame> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    let (mut mapper, mut pool) = t.mapper();
    for (va, f) in [&keep].into_iter().chain(&vas).zip(&frames) {
        map::<Size4KiB>(&mut mapper, &mut pool, *va, f.addr(), user_rw());
    }
    // Allocation order: level 3, level 2 and leaf of the first GiB, level
    // 2 of the second, its two leaves.
    let tables: Vec<Frame> = pool.0.iter().map(|&a| Frame(a >> 12)).collect();
    assert_eq!(tables.len(), 6);
    // CPUs 1 and 2 run the space and cache its pages; CPU 0 unmaps.
    let (cpu1, cpu2) = (m.cpu(1).unwrap(), m.cpu(2).unwrap());
    cpu1.switch_to(&mm).unwrap();
    cpu2.switch_to(&mm).unwrap();
    cpu1.write(vas[1], 9).unwrap();
    cpu2.read(vas[0]).unwrap();
    cpu2.read(vas[2]).unwrap();
    assert!(frames[1..].iter().all(|&f| !m.cached_translations(f).is_empty()));

    let (mut mapper, _) = t.mapper();
    // SAFETY: each page is mapped once and its frame is the test's to
    // free; the tables belong to this space alone.
    let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
    let mut dealloc = Dealloc::new(&m, &frames[1..]);
    let mut gather = PageGather::new();
    // SAFETY: frames are not reference-counted and all are the test's.
    let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
    let range = PageRange::new(GIB, GIB / PAGE_SIZE).unwrap();
    let summary = space
        .munmap(&m.cpu(0).unwrap(), &mut gather, range, &mut frees)
        .unwrap();

    assert_eq!(summary.pages_unmapped, 3);
    assert_eq!(summary.flushes, 1, "one flush for the whole range");
    assert_eq!(summary.ipis_sent, 2, "CPUs 1 and 2, which run the space");
    assert_eq!((summary.data_freed, summary.tables_freed), (3, 3));
    assert_eq!((summary.data_free_calls, summary.table_free_calls), (1, 1));
    assert_eq!(summary.syncs, 0, "tables freed right after the flush");
    assert_eq!((frees.freed(), frees.dirty_pages()), (6, 1));
    assert!(gather.is_empty());
    let freed: BTreeSet<Frame> = dealloc.freed.iter().copied().collect();
    assert_eq!(freed.len(), 6, "each frame once");
    let want: BTreeSet<Frame> = frames[1..].iter().chain(&tables[3..]).copied().collect();
    assert_eq!(
        freed, want,
        "the range's data frames, both leaves, their level-2 table"
    );
    assert_eq!(
        dealloc.cached_at_free, 0,
        "no CPU cached any of the range's pages at any free"
    );
    for va in vas {
        assert_eq!(space.lookup(va), Pte::EMPTY);
    }
    assert!(space.lookup(keep).maps(frames[0]), "outside the range: kept");
    assert!(cpu1.write(vas[1], 1).is_err() && cpu2.read(vas[2]).is_err());
    assert_eq!(m.violations(), []);
}

#[test]
fn a_huge_page_in_the_range_is_refused_with_every_entry_and_frame_as_it_was() {
    let mut t = Tables::new();
    let (m, mm) = machine_with(2, &t);
    // 4 KiB pages on both sides of a 2 MiB page, and a 1 GiB page above.
    let two = 0x4000_0000 + 4 * MIB2;
    let one = 0x80_0000_0000;
    let small = [two - PAGE_SIZE, two + MIB2];
    let frames: Vec<Frame> = (0..2).map(|_| m.alloc_frame().unwrap()).collect();
    let (mut mapper, mut pool) = t.mapper();
    for (&va, f) in small.iter().zip(&frames) {
        map::<Size4KiB>(&mut mapper, &mut pool, va, f.addr(), user_rw());
    }
    map::<Size2MiB>(&mut mapper, &mut pool, two, 0x1_0000_0000, user_rw());
    map::<Size1GiB>(
        &mut mapper,
        &mut pool,
        one,
        0x40_0000_0000,
        user_rw() | F::NO_EXECUTE,
    );
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    for va in small {
        cpu1.write(va, 7).unwrap();
    }
    let words = table_words(&t);
    let states = m.frame_states();
    let cached: Vec<usize> = frames.iter().map(|&f| m.cached_translations(f).len()).collect();

    let (mut mapper, _) = t.mapper();
    // SAFETY: as in the test above.
    let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
    let mut dealloc = Dealloc::new(&m, &frames);
    let mut gather = PageGather::new();
    // SAFETY: as in the test above.
    let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
    let cpu0 = m.cpu(0).unwrap();
    let pages = |first: u64, last: u64| PageRange::new(first, (last - first) / PAGE_SIZE + 1).unwrap();
    let cases = [
        // The 4 KiB pages around it, and the 2 MiB page between them.
        (pages(small[0], small[1]), two, MIB2),
        // Starting inside the 2 MiB page.
        (pages(two + 7 * PAGE_SIZE, small[1]), two, MIB2),
        // One page of the 1 GiB page.
        (PageRange::page(one + 3 * MIB2).unwrap(), one, GIB),
    ];
    for (i, (range, va, size)) in cases.into_iter().enumerate() {
        let refused = Err(Error::HugePage { va, size });
        assert_eq!(space.munmap(&cpu0, &mut gather, range, &mut frees), refused);
        if i == 0 {
            // The long form takes a huge page the range covers wholly
            // (tests/huge_range.rs); `munmap` refuses it, since its frees
            // go to a 4 KiB deallocator.
            continue;
        }
        // The long form refuses a part of one the same way.
        let mut long = MmuGather::<8>::new();
        let r = long.unmap_range(
            &cpu0,
            &space,
            &mut frees,
            range,
            false,
            &mut TableFreePolicy::AfterFlush,
            &mut |f: OwnedFrame, _| panic!("{f:?} handed back"),
        );
        assert_eq!(r, refused, "{range:?}");
        assert!(gather.is_empty() && long.is_empty());
    }
    assert_eq!((frees.freed(), frees.dirty_pages()), (0, 0));
    assert_eq!(table_words(&t), words, "every entry as it was");
    assert_eq!(m.frame_states(), states, "every frame as it was");
    let after: Vec<usize> = frames.iter().map(|&f| m.cached_translations(f).len()).collect();
    assert_eq!(after, cached, "nothing flushed either");
    assert!(dealloc.freed.is_empty());
    for va in small {
        cpu1.write(va, 8).unwrap();
    }
    assert_eq!(m.violations(), []);
}

#[test]
fn a_failed_flush_leaves_the_frames_in_the_gather_and_the_next_call_frees_them() {
    let mut t = Tables::new();
    let (m, mm) = machine_with(2, &t);
    let va = 0x20_0000;
    let frame = m.alloc_frame().unwrap();
    let (mut mapper, mut pool) = t.mapper();
    map::<Size4KiB>(&mut mapper, &mut pool, va, frame.addr(), user_rw());
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.read(va).unwrap();

    // SAFETY: as in the first test.
    let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
    let mut dealloc = Dealloc::new(&m, &[frame]);
    let mut gather = MmuGather::<4>::new();
    // SAFETY: as in the first test.
    let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
    let cpu0 = m.cpu(0).unwrap();
    let range = PageRange::new(va, 512).unwrap();
    // Called from inside a shootdown of CPU 0's: the flush is refused.
    let r = cpu0
        .in_shootdown(|| space.munmap(&cpu0, &mut gather, range, &mut frees))
        .unwrap();
    assert_eq!(r, Err(Error::ShootdownReentered { cpu: 0 }));
    assert_eq!(space.lookup(va), Pte::EMPTY, "cleared before the flush failed");
    assert!(!gather.is_empty(), "the frame and the flush are kept");
    assert_eq!(frees.freed(), 0);

    let summary = space.munmap(&cpu0, &mut gather, range, &mut frees).unwrap();
    assert_eq!(
        (summary.pages_unmapped, summary.flushes),
        (1, 1),
        "the failed call's counts"
    );
    assert_eq!((summary.data_freed, summary.tables_freed), (1, 1));
    assert!(gather.is_empty());
    assert_eq!(frees.freed(), 2);
    assert!(dealloc.freed.contains(&frame));
    assert!(cpu1.read(va).is_err());
    assert_eq!(m.violations(), []);
}

/// Records what it is given, nothing else.
#[derive(Default)]
struct Record(Vec<PhysFrame>);

impl FrameDeallocator<Size4KiB> for Record {
    unsafe fn deallocate_frame(&mut self, frame: PhysFrame) {
        self.0.push(frame);
    }
}

fn owned(frames: &[u64]) -> heapless::Vec<OwnedFrame, 8> {
    // SAFETY: the numbers are the test's; nothing frees them elsewhere.
    frames
        .iter()
        .map(|&f| unsafe { OwnedFrame::new(Frame(f)) })
        .collect()
}

#[test]
fn deallocator_frees_gets_exactly_the_frames_and_hands_back_what_has_no_phys_frame() {
    let mut record = Record::default();
    // SAFETY: the frames are numbers only; `Record` never touches them.
    let mut frees = unsafe { DeallocatorFrees::new(&mut record) };
    let beyond = 1 << 40;
    let mut data = owned(&[0x10, beyond, 0x11, u64::MAX, 0x12]);
    frees.free_batch(&mut data);
    let left: Vec<Frame> = data.iter().map(OwnedFrame::frame).collect();
    assert_eq!(left, [Frame(beyond), Frame(u64::MAX)], "refused, in order");
    let mut tables = owned(&[0x20, 0x21]);
    frees.free_tables(&mut tables);
    assert!(tables.is_empty());
    frees.set_dirty(Frame(0x10));
    assert_eq!((frees.freed(), frees.dirty_pages()), (5, 1));
    assert!(format!("{frees:?}").contains("freed: 5"));
    let got: Vec<Frame> = record.0.iter().map(|&f| Frame::from(f)).collect();
    assert_eq!(got, [0x10, 0x11, 0x12, 0x20, 0x21].map(Frame));
}

#[test]
fn mapper_errors_convert_into_the_crates_error() {
    let huge = MapperError::HugePage {
        va: 0x4000_0000,
        size: MIB2,
    };
    assert_eq!(
        Error::from(huge),
        Error::HugePage {
            va: 0x4000_0000,
            size: MIB2
        }
    );
    assert_eq!(Error::from(huge).to_string(), huge.to_string());
    let out = MapperError::FrameOutOfRange {
        frame: Frame(1 << 40),
    };
    assert_eq!(
        Error::from(out),
        Error::FrameOutOfRange {
            frame: Frame(1 << 40)
        }
    );
    assert_eq!(Error::from(out).to_string(), out.to_string());

    // `?` converts in a function that returns the crate's error.
    let mut t = Tables::new();
    let (mut mapper, mut pool) = t.mapper();
    map::<Size2MiB>(&mut mapper, &mut pool, 0x4000_0000, 0x1_0000_0000, user_rw());
    let tlb = tlb_batch::MmTlbState::new(common::asid(1), 0);
    let space = OffsetSpace::new(&mut mapper, &tlb);
    let check = |range| -> Result<(), Error> {
        space.check_no_huge(range)?;
        Ok(())
    };
    assert_eq!(
        check(PageRange::page(0x4000_0000 + PAGE_SIZE).unwrap()),
        Err(Error::from(huge))
    );
    assert_eq!(check(PageRange::page(0x3fff_f000).unwrap()), Ok(()));
}

/// `munmap_bounded`: two munmaps of the halves of the leaf table at 1 GiB,
/// between a mapping that ends at 1 GiB and one at 2 GiB. The second frees
/// the leaf table and its emptied level-2 table into the deallocator;
/// plain `munmap` frees neither. Bounds that do not enclose the range are
/// refused with nothing changed.
#[test]
fn munmap_bounded_frees_the_tables_two_half_munmaps_emptied() {
    for bounded in [true, false] {
        let mut t = Tables::new();
        let (m, mm) = machine_with(2, &t);
        let vas = [GIB - PAGE_SIZE, GIB, GIB + MIB2 - PAGE_SIZE, 2 * GIB];
        let frames: Vec<Frame> = vas.iter().map(|_| m.alloc_frame().unwrap()).collect();
        let (mut mapper, mut pool) = t.mapper();
        for (va, f) in vas.iter().zip(&frames) {
            map::<Size4KiB>(&mut mapper, &mut pool, *va, f.addr(), user_rw());
        }
        // Level 3, level 2 and leaf of the first GiB, level 2 and leaf of
        // the second, of the third.
        let tables: Vec<Frame> = pool.0.iter().map(|&a| Frame(a >> 12)).collect();
        assert_eq!(tables.len(), 7);
        let (mut mapper, _) = t.mapper();
        // SAFETY: each page is mapped once and its frame is the test's to
        // free; the tables belong to this space alone.
        let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
        let mut dealloc = Dealloc::new(&m, &frames[1..3]);
        let mut gather = PageGather::new();
        // SAFETY: frames are not reference-counted and all are the test's.
        let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
        let cpu0 = m.cpu(0).unwrap();
        let bounds = TableBounds::new(GIB, 2 * GIB).unwrap();
        let halves = [GIB, GIB + MIB2 / 2, GIB + MIB2];
        for (pair, mapped) in halves.windows(2).zip([vas[1], vas[2]]) {
            let range = PageRange::from_bounds(pair[0], pair[1]).unwrap();
            if bounded {
                let outside = TableBounds::new(pair[0] + PAGE_SIZE, 2 * GIB).unwrap();
                let refused = space.munmap_bounded(&cpu0, &mut gather, range, outside, &mut frees);
                assert_eq!(refused, Err(Error::OutsideTableBounds { addr: range.start() }));
                assert!(space.lookup(mapped).is_present(), "refused: nothing changed");
                space
                    .munmap_bounded(&cpu0, &mut gather, range, bounds, &mut frees)
                    .unwrap();
            } else {
                space.munmap(&cpu0, &mut gather, range, &mut frees).unwrap();
            }
        }
        let freed: BTreeSet<Frame> = dealloc.freed.iter().copied().collect();
        let mut want: BTreeSet<Frame> = frames[1..3].iter().copied().collect();
        if bounded {
            want.extend(&tables[3..5]);
        }
        assert_eq!(freed, want, "bounded: {bounded}");
        assert!(space.lookup(vas[0]).maps(frames[0]) && space.lookup(vas[3]).maps(frames[3]));
        assert_eq!(m.violations(), []);
    }
}
