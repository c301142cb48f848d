//! The reverse-map layer's edges against the mock machine: the typed batch
//! that returns frames only through the flush, bad input, how the bounded
//! reverse map names a mapping, a `PageState` without hwpoison support, and
//! range operations that take `next_populated` as a hint only.

mod common;

use std::ops::ControlFlow;
use std::sync::Mutex;

use common::bounded_rmap::{map, rmap, touch};
use common::{asid, config, va};
use tlb_batch::arch::mock::{MockMachine, MockSpace, NoRewalk, X86Like};
use tlb_batch::{
    change_protection, page_referenced, try_to_unmap, BoundedRmap, Error, Frame, MappingFlags, MmTlbState,
    PageRange, PageTable, Pte, PteFlags, Released, Rmap, SwapResult, TlbFlushUnmapBatch, TtuFlags,
    UnmapBatch, Unmapped,
};

#[test]
fn the_typed_batch_returns_frames_only_through_the_flush() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let frames: Vec<_> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    for (i, &f) in frames.iter().enumerate() {
        let flags = if i == 3 {
            MappingFlags::LOCKED
        } else {
            MappingFlags::empty()
        };
        map(&m, &mut rm, &space, f, i, true, flags);
        touch(&m, 1, space.mm(), i, true);
    }
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = UnmapBatch::<2>::new();
    let mut outcomes = Vec::new();
    for &f in &frames[..3] {
        outcomes.push(
            batch
                .try_to_unmap(&cpu0, &rm, common::owned(f), TtuFlags::empty())
                .unwrap(),
        );
    }
    assert_eq!(outcomes[0], Unmapped::Held(SwapResult::SuccessCached));
    assert_eq!(outcomes[1], Unmapped::Held(SwapResult::SuccessCached));
    // Full: nothing was done to frame 2.
    assert!(matches!(&outcomes[2], Unmapped::Full(f) if f.frame() == frames[2]));
    assert!(m.pte(space.mm(), va(2)).unwrap().maps(frames[2]));
    {
        let io = batch.flush_dirty(&cpu0).unwrap();
        assert_eq!(io.report().map(|r| r.ipis_sent), Some(1));
        assert_eq!(io.frames().count(), 2);
        for w in io.frames() {
            m.start_io(w.frame()).unwrap();
            m.end_io(w.frame()).unwrap();
        }
    }
    let flushed = batch.flush(&cpu0).unwrap();
    assert_eq!(
        flushed.report().ipis_sent,
        0,
        "flush_dirty already flushed everything"
    );
    assert_eq!(flushed.len(), 2);
    assert!(!flushed.is_empty());
    for released in flushed {
        let Released::Unmapped(owned) = released else {
            panic!("{released:?} is still mapped")
        };
        m.free_frame(owned.into_frame()).unwrap();
    }
    // An mlocked frame loses no mapping, owes nothing, and comes straight back.
    let locked = batch
        .try_to_unmap(&cpu0, &rm, common::owned(frames[3]), TtuFlags::empty())
        .unwrap();
    assert!(matches!(
        locked,
        Unmapped::Returned { ref frame, result: SwapResult::Mlock } if frame.frame() == frames[3]
    ));
    assert!(batch.is_empty());
    let nothing = batch.flush(&cpu0).unwrap();
    assert!(nothing.is_empty());
    assert_eq!(nothing.report(), tlb_batch::ShootdownReport::default());
    assert_eq!(m.violations(), []);
}

#[test]
fn bad_input_is_an_error() {
    let m = MockMachine::<X86Like>::new(config(1, 8)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut small: BoundedRmap<'_, MockSpace<'_>, MockMachine, 1> =
        // SAFETY: this map is only used to test `add`'s errors.
        unsafe { BoundedRmap::new(&m) };
    assert_eq!(
        small.add(Frame(1), &space, 0x1001, MappingFlags::empty()),
        Err(Error::Unaligned { addr: 0x1001 })
    );
    small
        .add(Frame(1), &space, 0x1000, MappingFlags::empty())
        .unwrap();
    assert_eq!(
        small.add(Frame(2), &space, 0x2000, MappingFlags::empty()),
        Err(Error::RmapFull { capacity: 1 })
    );
    let cpu0 = m.cpu(0).unwrap();
    assert_eq!(
        change_protection(&cpu0, &space, PageRange::new(0x7fff_ffff_e000, 4).unwrap(), |p| p),
        Err(Error::NonCanonical {
            addr: 0x8000_0000_0000
        })
    );
    // A frame nobody maps: nothing to do, and it says so.
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(&cpu0, &small, Frame(9), TtuFlags::empty(), &mut batch),
        Ok(SwapResult::Success)
    );
    assert_eq!(
        page_referenced(&cpu0, &small, Frame(9), &mut batch)
            .unwrap()
            .mapped,
        0
    );
    assert!(small.remove(Frame(1), &space, 0x1000));
    assert!(small.is_empty());
}

/// `BoundedRmap`'s bookkeeping: a mapping is named by frame, address and
/// address space together, and each call says what it found.
#[test]
fn the_bounded_rmap_names_a_mapping_by_frame_address_and_space() {
    let m = MockMachine::<X86Like>::new(config(1, 8)).unwrap();
    let (a, b) = (
        m.space(&m.new_mm(asid(1)).unwrap()),
        m.space(&m.new_mm(asid(2)).unwrap()),
    );
    let none = MappingFlags::empty();
    // SAFETY: only the bookkeeping is tested; no CPU uses these mappings.
    let mut rm: BoundedRmap<'_, MockSpace<'_>, MockMachine, 8> = unsafe { BoundedRmap::new(&m) };
    assert!(rm.is_empty());
    assert_eq!(rm.len(), 0);
    for (f, space, page) in [(1, &a, 0), (1, &b, 0), (1, &a, 1), (2, &a, 2)] {
        rm.add(Frame(f), space, va(page), none).unwrap();
    }
    assert_eq!(rm.len(), 4);
    assert!(!rm.is_empty());
    // One of the three differs in each: no match.
    let near_misses = [(2, &a, 0), (1, &a, 2), (2, &b, 2)];
    for (f, space, page) in near_misses {
        assert!(!rm.set_flags(Frame(f), space, va(page), MappingFlags::LOCKED));
        assert!(!rm.remove(Frame(f), space, va(page)));
    }
    assert_eq!(rm.len(), 4);
    assert!(rm.set_flags(Frame(1), &a, va(1), MappingFlags::LOCKED));
    assert!(rm.remove(Frame(1), &b, va(0)));
    assert!(!rm.remove(Frame(1), &b, va(0)), "already gone");
    assert_eq!(rm.len(), 3);
    let mut seen = Vec::new();
    let _ = rm.walk(Frame(1), &mut |mp| {
        seen.push((mp.va, mp.flags, std::ptr::eq(mp.space, &a)));
        ControlFlow::Continue(())
    });
    seen.sort_by_key(|s| s.0);
    assert_eq!(seen, [(va(0), none, true), (va(1), MappingFlags::LOCKED, true)]);
    assert_eq!(rm.remove_frame(Frame(1)), 2);
    assert_eq!(rm.remove_frame(Frame(1)), 0);
    assert_eq!(rm.len(), 1);
    assert_eq!(rm.remove_frame(Frame(2)), 1);
    assert!(rm.is_empty());
}

/// Page state that only records dirt: it relies on the trait's default for
/// hwpoison.
struct DirtOnly(Mutex<Vec<Frame>>);

impl tlb_batch::PageState for DirtOnly {
    fn set_dirty(&self, frame: Frame) {
        self.0.lock().unwrap().push(frame);
    }
}

/// A kernel without hwpoison support need not say so: by default no frame
/// is poisoned, and the dirty bit still reaches its page state.
#[test]
fn page_state_without_hwpoison_support_poisons_nothing() {
    let m = MockMachine::<X86Like>::new(config(1, 8)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let pages = DirtOnly(Mutex::new(Vec::new()));
    // SAFETY: the frame's only mapping is recorded before any CPU uses it.
    let mut rm: BoundedRmap<'_, MockSpace<'_>, DirtOnly, 4> = unsafe { BoundedRmap::new(&pages) };
    let f = m.alloc_frame().unwrap();
    m.map(space.mm(), va(0), f, true).unwrap();
    rm.add(f, &space, va(0), MappingFlags::empty()).unwrap();
    assert!(!rm.is_hwpoisoned(f));
    let cpu0 = m.cpu(0).unwrap();
    cpu0.switch_to(space.mm()).unwrap();
    cpu0.write(va(0), 7).unwrap();
    m.test_and_clear_accessed(space.mm(), va(0)).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, TtuFlags::empty(), &mut batch).unwrap(),
        SwapResult::Success
    );
    assert_eq!(*pages.0.lock().unwrap(), [f]);
}

/// What a wrapped table's `next_populated` answers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Answer {
    /// An address below the range asked about.
    Below,
    /// An address past the range asked about.
    Past,
    /// A misaligned address inside the range.
    Misaligned,
}

/// A mock table that answers `next_populated` outside the question (which
/// the crate must not trust).
struct Stray<'a> {
    space: MockSpace<'a>,
    answer: Answer,
}

/// A mock table that leaves `next_populated` to the trait's default.
struct Plain<'a> {
    space: MockSpace<'a>,
}

/// Implements `PageTable` for a wrapper of a `MockSpace` in field `space`,
/// forwarding everything but what follows the type.
macro_rules! forward_page_table {
    ($ty:ident $(, $extra:item)?) => {
        // SAFETY: every operation is the wrapped `MockSpace`'s, but
        // `next_populated` where given, which never skips an entry (its
        // answers are outside the range, which skips nothing, or inside
        // its first page).
        unsafe impl PageTable for $ty<'_> {
            fn tlb_state(&self) -> &MmTlbState {
                self.space.tlb_state()
            }
            fn lookup(&self, va: u64) -> Pte {
                self.space.lookup(va)
            }
            fn exchange(&self, va: u64, new: Pte) -> Pte {
                self.space.exchange(va, new)
            }
            fn test_and_clear_accessed(&self, va: u64) -> bool {
                self.space.test_and_clear_accessed(va)
            }
            fn set(&self, va: u64, pte: Pte) {
                self.space.set(va, pte);
            }
            $($extra)?
        }
    };
}

forward_page_table!(Plain);
forward_page_table!(
    Stray,
    fn next_populated(&self, range: PageRange) -> Option<u64> {
        let page = tlb_batch::PAGE_SIZE;
        range.last().map(|last| match self.answer {
            Answer::Below => range.start() - 5 * page,
            Answer::Past => last + 2 * page,
            Answer::Misaligned => range.start() + 123,
        })
    }
);

/// Protects test pages 2..6 of 8 through `wrap`'s table read-only and
/// checks that exactly those changed.
fn protect_through<'m, T: PageTable>(m: &'m MockMachine, wrap: impl FnOnce(MockSpace<'m>) -> T) {
    let mm = m.new_mm(asid(1)).unwrap();
    for page in 0..8 {
        let f = m.alloc_frame().unwrap();
        m.map(&mm, va(page), f, true).unwrap();
    }
    let table = wrap(m.space(&mm));
    let cpu0 = m.cpu(0).unwrap();
    let changed = change_protection(&cpu0, &table, common::pages(2, 6), |p| {
        Pte::new(p.frame(), p.flags() - PteFlags::WRITABLE)
    })
    .unwrap();
    assert_eq!(changed, 4);
    for page in 0..8 {
        let writable = m.pte(&mm, va(page)).unwrap().is_writable();
        assert_eq!(writable, !(2..6).contains(&page), "page {page}");
    }
}

/// A table's `next_populated` is a hint: the default skips nothing, an
/// answer outside the range is ignored (the walk goes on from the range's
/// start), and exactly the range's pages change, whatever the table says.
#[test]
fn range_operations_take_next_populated_as_a_hint() {
    protect_through(&MockMachine::new(config(1, 16)).unwrap(), |space| Plain { space });
    for answer in [Answer::Below, Answer::Past, Answer::Misaligned] {
        let m = MockMachine::new(config(1, 16)).unwrap();
        protect_through(&m, |space| Stray { space, answer });
    }
}

/// A typed unmap whose immediate flush failed (an architecture that never
/// defers, and the shootdown could not start): the frame stays in the batch,
/// counted as mapped with the error, and comes back only after the batch's
/// flush has paid the debt the failed flush left in it.
#[test]
fn a_typed_unmap_whose_immediate_flush_failed_holds_the_frame() {
    let m = MockMachine::<NoRewalk>::with_model(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &space, f, 0, true, MappingFlags::empty());
    touch(&m, 1, space.mm(), 0, true);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = UnmapBatch::<4>::new();
    let r = cpu0
        .in_shootdown(|| batch.try_to_unmap(&cpu0, &rm, common::owned(f), TtuFlags::empty()))
        .unwrap();
    let Ok(Unmapped::HeldMapped(tlb_batch::StillMapped::Failed(e))) = r else {
        panic!("{r:?}")
    };
    assert!(matches!(e, Error::ShootdownReentered { .. }));
    assert!(m.pte(space.mm(), va(0)).unwrap() == Pte::EMPTY, "the PTE went");
    assert_eq!(batch.tlb_batch().pending_pages(), 1, "the debt is in the batch");
    assert_eq!(m.cached_translations(f).len(), 1, "CPU 1 still caches it");
    let flushed = batch.flush(&cpu0).unwrap();
    assert_eq!(flushed.report().ipis_sent, 1);
    assert_eq!(m.cached_translations(f), []);
    for released in flushed {
        let Released::StillMapped(frame, _) = released else {
            panic!("{released:?}")
        };
        m.free_frame(frame.into_frame()).unwrap();
    }
    assert_eq!(m.violations(), []);
}
