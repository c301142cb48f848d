//! Regression tests for the paths where the contract used to break, part
//! one: safe code around the typed batch, and a machine that refuses what is
//! not its own (another machine's `Arch`, address spaces and frames). The
//! error paths and retries are in `soundness_retries.rs`, hostile input and
//! split page-table locks in `soundness_hostile.rs`. Every test checks the
//! oracle: a test passes only when the simulated machine saw no violation and
//! no stale entry where the contract forbids one.

// The drivers return their retry values by value.
#![allow(clippy::result_large_err)]

mod common;

use std::cell::Cell;
use std::ops::ControlFlow;
use std::sync::Arc;

use common::soundness::{mapped, rmap_of, touch};
use common::{asid, config, owned, va};
use tlb_batch::arch::mock::{FrameError, FrameState, MockError, MockMachine, MockRmap, MockSpace, Violation};
use tlb_batch::{
    try_to_unmap, Error, Frame, Mapping, MappingFlags, MmTlbState, Pte, Released, Rmap, StillMapped,
    SwapResult, TlbFlushUnmapBatch, TtuFlags, UnmapBatch, Unmapped,
};

// ----- The typed layer under safe code -----

/// Frame F is mapped in space 0 (CPU 1 writes it) and space 1 (CPU 2 uses
/// it again, so it is young). The typed unmap clears the first mapping with
/// its flush deferred, then stops at the young one. Whatever the batch hands
/// back, the caller follows the obvious path: keep a frame that is still
/// mapped, unmap it again later with a batch of its own, flush that batch,
/// free it. The oracle must stay empty: F must not reach the caller while
/// CPU 1 can still write to it through the first mapping.
#[test]
fn a_frame_that_lost_one_mapping_comes_back_only_after_that_flush() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let rmap = rmap_of(&m, 2);
    let f = m.alloc_frame().unwrap();
    rmap.map(f, 0, va(0), true, MappingFlags::SHARED).unwrap();
    rmap.map(f, 1, va(0), true, MappingFlags::SHARED).unwrap();
    touch(&m, &rmap, 1, 0, va(0), true);
    let cpu2 = m.cpu(2).unwrap();
    cpu2.switch_to(rmap.spaces()[1].mm()).unwrap();
    cpu2.read(va(0)).unwrap(); // young through space 1
    let cpu0 = m.cpu(0).unwrap();

    let mut a = UnmapBatch::<4>::new();
    let kept = match a.try_to_unmap(&cpu0, &rmap, owned(f), TtuFlags::empty()) {
        Ok(Unmapped::HeldMapped(why)) => {
            assert_eq!(why, StillMapped::Busy(SwapResult::Fail));
            // Nothing to free or keep yet: the batch has it until the flush.
            assert_eq!(a.held_frames().collect::<Vec<_>>(), [f]);
            assert!(!a.is_empty());
            // A frame still mapped is not lent for I/O, but the flush owed
            // for the mapping that went is done.
            let io = a.flush_dirty(&cpu0).unwrap();
            assert_eq!(io.frames().count(), 0);
            assert_eq!(io.report().map(|r| r.ipis_sent), Some(1));
            assert!(!a.is_empty(), "nothing owed, but the frame is held");
            let flushed = a.flush(&cpu0).unwrap();
            assert_eq!((flushed.len(), flushed.is_empty()), (1, false));
            assert_eq!(flushed.still_mapped().len(), 1);
            assert_eq!(flushed.report().ipis_sent, 0, "flush_dirty did it");
            let mut released = flushed.into_iter();
            match released.next() {
                Some(Released::StillMapped(frame, StillMapped::Busy(SwapResult::Fail))) => frame,
                other => panic!("{other:?}"),
            }
        }
        Ok(Unmapped::Returned { frame, .. }) => frame,
        Err((frame, _)) => frame,
        other => panic!("{other:?}"),
    };
    // The mapping the batch removed is flushed by now.
    assert!(m.cached_translations(f).iter().all(|(cpu, _)| *cpu == cpu2.id()));
    // The caller's later, separate reclaim of the kept frame.
    let mut b = UnmapBatch::<4>::new();
    let unmapped = b.try_to_unmap(&cpu0, &rmap, kept, TtuFlags::IGNORE_ACCESS);
    assert!(matches!(unmapped, Ok(Unmapped::Held(_))), "{unmapped:?}");
    for released in b.flush(&cpu0).unwrap() {
        let Released::Unmapped(frame) = released else {
            panic!("{released:?}")
        };
        m.free_frame(frame.into_frame()).unwrap();
    }
    // F's first mapping left no writable entry behind to write into it.
    let _ = m.cpu(1).unwrap().write(va(0), 99);
    assert_eq!(m.violations(), []);
    assert!(a.is_empty() && b.is_empty());
}

/// A reverse map that reports one more mapping, non-canonical, from its
/// second walk on: the address the crate checks first looks fine, the one it
/// meets while unmapping does not (a mapping that appeared meanwhile).
struct GrowsBad<'a, 'm> {
    inner: &'a MockRmap<'m>,
    walks: Cell<usize>,
}

// SAFETY: every real mapping comes from the mock rmap; the extra one names
// an address no PTE can have, which the crate must refuse.
unsafe impl<'m> Rmap for GrowsBad<'_, 'm> {
    type Space = MockSpace<'m>;
    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        self.walks.set(self.walks.get() + 1);
        self.inner.walk(frame, visit)?;
        if self.walks.get() >= 2 {
            visit(Mapping {
                space: &self.inner.spaces()[1],
                va: 0x8000_0000_0000,
                flags: MappingFlags::SHARED,
            })?;
        }
        ControlFlow::Continue(())
    }
    fn set_dirty(&self, frame: Frame) {
        self.inner.set_dirty(frame)
    }
}

/// The error arm: the walk clears one mapping (flush deferred), then stops
/// on an error. The frame must not come back with the error while that
/// flush is owed.
#[test]
fn a_frame_whose_walk_failed_half_way_stays_until_the_flush() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let rmap = rmap_of(&m, 2);
    let f = m.alloc_frame().unwrap();
    rmap.map(f, 0, va(0), true, MappingFlags::SHARED).unwrap();
    touch(&m, &rmap, 1, 0, va(0), true);
    let bad = GrowsBad {
        inner: &rmap,
        walks: Cell::new(0),
    };
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = UnmapBatch::<4>::new();
    let frame = match batch.try_to_unmap(&cpu0, &bad, owned(f), TtuFlags::IGNORE_ACCESS) {
        Ok(Unmapped::HeldMapped(why)) => {
            assert_eq!(
                why,
                StillMapped::Failed(Error::NonCanonical {
                    addr: 0x8000_0000_0000
                })
            );
            match batch.flush(&cpu0).unwrap().into_iter().next() {
                Some(Released::StillMapped(frame, _)) => frame,
                other => panic!("{other:?}"),
            }
        }
        Err((frame, _)) => frame,
        other => panic!("{other:?}"),
    };
    // The caller gives up on the frame and frees it (no mapping is left).
    rmap.remove_frame(f);
    m.free_frame(frame.into_frame()).unwrap();
    let _ = m.cpu(1).unwrap().write(va(0), 1);
    assert_eq!(m.violations(), []);
}

/// An unmap whose immediate flush fails (the mapping was not deferred, and
/// the shootdown could not start) hands the flush it owes to the batch: the
/// caller's flush of the batch pays it before the frame is freed.
#[test]
fn a_failed_immediate_flush_leaves_its_debt_in_the_batch() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let rmap = rmap_of(&m, 1);
    let frames = mapped(&m, &rmap, 1, true);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let r = cpu0
        .in_shootdown(|| try_to_unmap(&cpu0, &rmap, frames[0], TtuFlags::IGNORE_ACCESS, &mut batch))
        .unwrap();
    assert!(matches!(r, Err(Error::ShootdownReentered { .. })));
    assert!(!m.pte(rmap.spaces()[0].mm(), va(0)).unwrap().is_present());
    assert_eq!(batch.pending_pages(), 1, "the debt is in the batch");
    batch.flush(&cpu0).unwrap();
    rmap.remove_frame(frames[0]);
    m.free_frame(frames[0]).unwrap();
    assert_eq!(m.violations(), []);
}

/// A batch filled on one machine cannot be flushed with another machine's
/// `Arch`: the frames it covers are cached on the first machine's CPUs.
#[test]
fn another_machines_arch_is_refused_by_every_batch() {
    let a = MockMachine::new(config(2, 64)).unwrap();
    let b = MockMachine::new(config(2, 64)).unwrap();
    let rmap = rmap_of(&a, 1);
    let frames = mapped(&a, &rmap, 2, true);
    let (a0, b0) = (a.cpu(0).unwrap(), b.cpu(0).unwrap());

    // The low-level batch.
    let mut low = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(&a0, &rmap, frames[0], TtuFlags::BATCH_FLUSH, &mut low),
        Ok(SwapResult::SuccessCached)
    );
    assert_eq!(low.flush(&b0), Err(Error::OtherMachine));
    assert_eq!(low.flush_dirty(&b0), Err(Error::OtherMachine));
    assert_eq!(low.pending_pages(), 1, "still owed");
    let other_mm = b.new_mm(asid(1)).unwrap();
    assert_eq!(
        low.add_pending(&b0, &other_mm, va(5), Pte::EMPTY),
        Err(Error::OtherMachine)
    );
    assert_eq!(a.cached_translations(frames[0]).len(), 1);
    low.flush(&a0).unwrap();
    assert_eq!(a.cached_translations(frames[0]), []);

    // The typed batch.
    let mut typed = UnmapBatch::<4>::new();
    let r = typed.try_to_unmap(&a0, &rmap, owned(frames[1]), TtuFlags::IGNORE_ACCESS);
    assert!(matches!(r, Ok(Unmapped::Held(_))));
    assert!(matches!(typed.flush(&b0), Err(Error::OtherMachine)));
    assert!(matches!(typed.flush_dirty(&b0), Err(Error::OtherMachine)));
    assert_eq!(typed.len(), 1);
    for released in typed.flush(&a0).unwrap() {
        let Released::Unmapped(frame) = released else {
            panic!()
        };
        a.free_frame(frame.into_frame()).unwrap();
    }
    a.free_frame(frames[0]).unwrap();
    assert_eq!(a.violations(), []);
    assert_eq!(b.violations(), []);
}

// ----- The machine refuses what is not its own -----

#[test]
fn the_mock_refuses_other_machines_address_spaces_and_absent_frames() {
    let a = MockMachine::new(config(2, 64)).unwrap();
    let b = MockMachine::new(config(2, 64)).unwrap();
    let mm_a = a.new_mm(asid(1)).unwrap();
    let _mm_b = b.new_mm(asid(1)).unwrap();
    let f = b.alloc_frame().unwrap();
    assert_eq!(b.map(&mm_a, va(0), f, true), Err(MockError::UnknownAddressSpace));
    assert_eq!(b.pte(&mm_a, va(0)), Err(MockError::UnknownAddressSpace));
    assert_eq!(b.pte(a.kernel_mm(), va(0)), Err(MockError::UnknownAddressSpace));
    assert_eq!(
        b.cpu(0).unwrap().switch_to(&mm_a),
        Err(MockError::UnknownAddressSpace)
    );
    let forged = Arc::new(MmTlbState::new(asid(2), mm_a.root()));
    assert_eq!(a.pte(&forged, va(0)), Err(MockError::UnknownAddressSpace));
    let mm_b = b.new_mm(asid(2)).unwrap();
    assert_eq!(
        b.map(&mm_b, va(0), Frame(1 << 30), true),
        Err(MockError::Frame(FrameError::NoSuchFrame(Frame(1 << 30))))
    );
    let free = b.alloc_frame().unwrap();
    b.free_frame(free).unwrap();
    assert_eq!(
        b.map(&mm_b, va(0), free, true),
        Err(MockError::Frame(FrameError::WrongState {
            frame: free,
            state: FrameState::Free
        }))
    );
}

/// The oracle counts freeing a frame under write-out as a violation, not
/// an error it happens to return.
#[test]
fn freeing_a_frame_under_io_is_a_violation() {
    let m = MockMachine::new(config(1, 8)).unwrap();
    let f = m.alloc_frame().unwrap();
    m.start_io(f).unwrap();
    assert!(m.free_frame(f).is_err());
    assert_eq!(m.violations(), [Violation::FreedDuringIo { frame: f }]);
}
