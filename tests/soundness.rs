//! Regression tests for the paths where the contract used to break: safe
//! code around the typed batch, errors and documented retries, hostile
//! input, migration's bookkeeping and split page-table locks. Every test
//! checks the oracle: a test passes only when the simulated machine saw no
//! violation and no stale entry where the contract forbids one.

// The drivers return their retry values by value.
#![allow(clippy::result_large_err)]

mod common;

use std::cell::Cell;
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;

use common::{asid, config, owned, pages, va};
use tlb_batch::arch::mock::{
    CountingTable, Fault, FrameError, FrameState, IoMode, MockError, MockKernel, MockMachine, MockRmap,
    MockSpace, Violation,
};
use tlb_batch::{
    change_protection, flush_tlb_mm, flush_tlb_page, flush_tlb_range, migrate_pages, page_referenced,
    shootdown, shrink_page_list, switch_mm, try_to_unmap, Asid, CpuSet, Error, FlushRequest, Frame,
    FrameKind, FreeFrames, Mapping, MappingFlags, MigrateBacking, MigrateFailure, MigrateOutcome, MmTlbState,
    MmuGather, OwnedFrame, PageRange, PageTable, Pte, PteFlags, ReclaimBacking, Released, Rmap, StillMapped,
    SwapResult, TableFreePolicy, TeardownBacking, TlbFlushUnmapBatch, TtuFlags, UnmapBatch, Unmapped,
    Verdict, WritebackFrame, PAGE_SIZE,
};

/// The last page of the 64-bit address space (canonical: upper half).
const TOP: u64 = 0xffff_ffff_ffff_f000;

/// `spaces` address spaces of `m`, in a reverse map.
fn rmap_of(m: &MockMachine, spaces: usize) -> MockRmap<'_> {
    let spaces = (0..spaces)
        .map(|i| m.space(&m.new_mm(asid(i as u16 + 1)).unwrap()))
        .collect();
    MockRmap::new(m, spaces)
}

/// CPU `cpu` runs space `s` of `rmap` and writes (or reads) `va`; the
/// accessed bit is cleared afterwards so that the page does not look young.
fn touch(m: &MockMachine, rmap: &MockRmap<'_>, cpu: usize, s: usize, va: u64, write: bool) {
    let c = m.cpu(cpu).unwrap();
    let mm = rmap.spaces()[s].mm();
    if c.current_mm().map_or(true, |cur| !Arc::ptr_eq(&cur, mm)) {
        c.switch_to(mm).unwrap();
    }
    if write {
        c.write(va, 7).unwrap();
    } else {
        c.read(va).unwrap();
    }
    m.test_and_clear_accessed(mm, va).unwrap();
}

/// `n` fresh frames mapped at test pages `0..n` of space 0, each touched
/// by CPU 1 (written when `writable`, read otherwise).
fn mapped(m: &MockMachine, rmap: &MockRmap<'_>, n: usize, writable: bool) -> Vec<Frame> {
    (0..n)
        .map(|i| {
            let f = m.alloc_frame().unwrap();
            rmap.map(f, 0, va(i), writable, MappingFlags::empty()).unwrap();
            touch(m, rmap, 1, 0, va(i), writable);
            f
        })
        .collect()
}

// ----- 1. The typed layer under safe code -----

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

// ----- 2. Errors and documented retries -----

/// mprotect whose shootdown fails after the PTEs changed: the retry sees
/// nothing left to change, yet must still flush what the failed call owed.
#[test]
fn change_protection_retried_after_a_failed_shootdown_still_flushes() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let rmap = rmap_of(&m, 1);
    let space = &rmap.spaces()[0];
    let f = m.alloc_frame().unwrap();
    rmap.map(f, 0, va(0), true, MappingFlags::empty()).unwrap();
    touch(&m, &rmap, 1, 0, va(0), true);
    let cpu0 = m.cpu(0).unwrap();
    let read_only = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
    let first = cpu0
        .in_shootdown(|| change_protection(&cpu0, space, pages(0, 1), read_only))
        .unwrap();
    assert!(matches!(first, Err(Error::ShootdownReentered { .. })));
    assert!(
        !m.pte(space.mm(), va(0)).unwrap().is_writable(),
        "the PTE did change"
    );
    // The documented retry.
    assert_eq!(change_protection(&cpu0, space, pages(0, 1), read_only), Ok(0));
    assert_eq!(m.check_coherent(space.mm(), pages(0, 1)), 0);
    assert_eq!(
        m.cpu(1).unwrap().write(va(0), 5),
        Err(Fault::WriteProtected { va: va(0) })
    );
    assert_eq!(m.violations(), []);
}

/// Any later change of the address space pays the owed flush too, not
/// only a retry of the same call.
#[test]
fn a_failed_change_is_flushed_by_the_next_change_of_the_address_space() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let rmap = rmap_of(&m, 1);
    let space = &rmap.spaces()[0];
    for i in 0..2 {
        let f = m.alloc_frame().unwrap();
        rmap.map(f, 0, va(i), true, MappingFlags::empty()).unwrap();
        touch(&m, &rmap, 1, 0, va(i), true);
    }
    let cpu0 = m.cpu(0).unwrap();
    let read_only = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
    let first = cpu0
        .in_shootdown(|| change_protection(&cpu0, space, pages(0, 1), read_only))
        .unwrap();
    assert!(first.is_err());
    assert!(space.mm().batched_flush_pending(), "the debt is recorded");
    // A different range: its walk does the owed flush first.
    change_protection(&cpu0, space, pages(1, 2), read_only).unwrap();
    assert_eq!(m.check_coherent(space.mm(), pages(0, 2)), 0);
    assert_eq!(m.violations(), []);
}

/// Counts what the kernel's migration services were asked to do.
struct Counting<'k, 'r, 'm> {
    kernel: MockKernel<'r, 'm>,
    copies: &'k Cell<usize>,
}

impl FreeFrames for Counting<'_, '_, '_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        self.kernel.free_batch(frames)
    }
}

impl MigrateBacking for Counting<'_, '_, '_> {
    fn alloc_target(&mut self, old: Frame) -> Option<OwnedFrame> {
        self.kernel.alloc_target(old)
    }
    fn copy_frame(&mut self, from: WritebackFrame<'_>, to: &OwnedFrame) {
        self.copies.set(self.copies.get() + 1);
        self.kernel.copy_frame(from, to)
    }
    fn move_mappings(&mut self, old: Frame, new: Frame) {
        self.kernel.move_mappings(old, new)
    }
}

/// Migration whose final flush fails: read-only pages need no flush before
/// the copy, so the first flush is the one before the old frames go. One
/// frame could not get a target and had its mappings restored. The retry
/// must release exactly the moved frames, copy nothing twice, report each
/// frame once, and never free the restored one (still mapped).
#[test]
fn migration_retried_after_its_final_flush_failed_finishes_exactly_once() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let rmap = rmap_of(&m, 1);
    let frames = mapped(&m, &rmap, 3, false);
    let copies = Cell::new(0);
    let mut backing = Counting {
        kernel: MockKernel::new(&rmap),
        copies: &copies,
    };
    backing.kernel.alloc_budget = Some(2);
    let cpu0 = m.cpu(0).unwrap();
    let mut outcomes = Vec::new();
    let mut batch = UnmapBatch::<8>::new();
    let first = cpu0
        .in_shootdown(|| {
            migrate_pages(
                &cpu0,
                &rmap,
                &mut backing,
                &mut batch,
                frames.iter().map(|&f| owned(f)),
                &mut |o| outcomes.push(o),
            )
        })
        .unwrap();
    let retry = first.expect_err("the final flush cannot run nested");
    assert!(matches!(retry.error(), Some(Error::ShootdownReentered { .. })));
    assert_eq!(retry.frames(), 3);
    let shown = format!("{retry:?}");
    assert!(
        shown.contains("MigrateRetry") && shown.contains("ShootdownReentered"),
        "{shown}"
    );
    assert!(batch.is_empty(), "the retry value owns the work");
    // Two were copied before the flush point; the third had no target.
    assert_eq!(copies.get(), 2);
    backing.kernel.alloc_budget = None;
    let summary = retry
        .retry(&cpu0, &rmap, &mut backing, &mut |o| outcomes.push(o))
        .unwrap();
    assert_eq!((summary.migrated, summary.failed), (2, 1));
    assert_eq!(copies.get(), 2, "nothing copied twice");
    assert_eq!(outcomes.len(), 3, "each frame reported once: {outcomes:?}");
    let restored = frames[2];
    assert!(outcomes.iter().any(|o| matches!(
        o,
        MigrateOutcome::Failed { frame, reason: MigrateFailure::NoMemory } if frame.frame() == restored
    )));
    assert_eq!(m.frame_state(restored).unwrap(), FrameState::InUse);
    assert!(m.pte(rmap.spaces()[0].mm(), va(2)).unwrap().maps(restored));
    for &old in &frames[..2] {
        assert_eq!(m.frame_state(old).unwrap(), FrameState::Free);
    }
    // Every page still reads through the table.
    let cpu1 = m.cpu(1).unwrap();
    for i in 0..3 {
        cpu1.read(va(i)).unwrap();
    }
    assert_eq!(m.violations(), []);
}

/// Reclaim whose final flush fails after dirty frames were queued for
/// write-out: the frames were read-only (so no flush was needed before the
/// write) but dirty from an earlier write. The retry must hand the frames
/// under write-out back, never offer them to the allocator.
#[test]
fn reclaim_retried_after_its_final_flush_failed_never_frees_a_frame_under_io() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let rmap = rmap_of(&m, 1);
    let frames = mapped(&m, &rmap, 4, false);
    for f in frames.iter().step_by(2) {
        m.set_frame_dirty(*f).unwrap();
    }
    let mut kernel = MockKernel::new(&rmap);
    kernel.io = IoMode::Queued;
    let cpu0 = m.cpu(0).unwrap();
    let mut back = HashMap::new();
    let mut batch = UnmapBatch::<8>::new();
    let first = cpu0
        .in_shootdown(|| {
            shrink_page_list(
                &cpu0,
                &rmap,
                &mut kernel,
                &mut batch,
                frames.iter().map(|&f| owned(f)),
                &mut |f, v| {
                    back.insert(f.into_frame(), v);
                },
            )
        })
        .unwrap();
    let retry = first.expect_err("the final flush cannot run nested");
    assert!(matches!(retry.error(), Some(Error::ShootdownReentered { .. })));
    assert_eq!(kernel.page_outs, 2, "written before the failed flush");
    assert_eq!(retry.frames(), 4);
    let shown = format!("{retry:?}");
    assert!(
        shown.contains("ReclaimRetry") && shown.contains("ShootdownReentered"),
        "{shown}"
    );
    let summary = retry
        .retry(&cpu0, &mut kernel, &mut |f, v| {
            back.insert(f.into_frame(), v);
        })
        .unwrap();
    assert_eq!(kernel.page_outs, 2, "not written twice");
    assert_eq!((summary.freed, summary.paged_out), (2, 2));
    for (i, f) in frames.iter().enumerate() {
        if i % 2 == 0 {
            assert_eq!(back.get(f), Some(&Verdict::Writeback));
            assert_eq!(m.frame_state(*f).unwrap(), FrameState::UnderIo);
        } else {
            assert_eq!(m.frame_state(*f).unwrap(), FrameState::Free);
        }
    }
    assert_eq!(m.violations(), []);
}

/// A gather whose flush failed still holds the first space's frames: it
/// must refuse another address space (whose flush would miss the first
/// space's CPUs) until it is finished.
#[test]
fn a_gather_with_pending_work_refuses_another_address_space() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let rmap = rmap_of(&m, 2);
    let frames: Vec<_> = (0..2).map(|_| m.alloc_frame().unwrap()).collect();
    for (s, &f) in frames.iter().enumerate() {
        rmap.map(f, s, va(0), true, MappingFlags::empty()).unwrap();
        touch(&m, &rmap, s + 1, s, va(0), true);
    }
    let mut kernel = MockKernel::new(&rmap);
    let cpu0 = m.cpu(0).unwrap();
    let mut gather = MmuGather::<8>::new();
    let mut back = Vec::new();
    let mut handback = |f: OwnedFrame, k: FrameKind| back.push((f.into_frame(), k));
    let first = cpu0
        .in_shootdown(|| {
            gather.unmap_range(
                &cpu0,
                &rmap.spaces()[0],
                &mut kernel,
                pages(0, 1),
                false,
                &mut TableFreePolicy::AfterFlush,
                &mut handback,
            )
        })
        .unwrap();
    assert!(matches!(first, Err(Error::ShootdownReentered { .. })));
    assert!(!gather.is_empty());
    assert!(
        rmap.spaces()[0].mm().batched_flush_pending(),
        "the cleared entries owe a flush, recorded in the address space"
    );
    assert_eq!(
        gather.unmap_range(
            &cpu0,
            &rmap.spaces()[1],
            &mut kernel,
            pages(0, 1),
            false,
            &mut TableFreePolicy::AfterFlush,
            &mut handback,
        ),
        Err(Error::OtherAddressSpace)
    );
    assert_eq!(
        gather.finish(
            &cpu0,
            &rmap.spaces()[1],
            &mut kernel,
            &mut TableFreePolicy::AfterFlush,
            &mut handback
        ),
        Err(Error::OtherAddressSpace)
    );
    let other = MockMachine::new(config(3, 64)).unwrap();
    assert_eq!(
        gather.finish(
            &other.cpu(0).unwrap(),
            &rmap.spaces()[0],
            &mut kernel,
            &mut TableFreePolicy::AfterFlush,
            &mut handback
        ),
        Err(Error::OtherMachine)
    );
    assert_eq!(m.frame_state(frames[0]).unwrap(), FrameState::InUse);
    gather
        .finish(
            &cpu0,
            &rmap.spaces()[0],
            &mut kernel,
            &mut TableFreePolicy::AfterFlush,
            &mut handback,
        )
        .unwrap();
    assert_eq!(m.frame_state(frames[0]).unwrap(), FrameState::Free);
    // Now free for the second space.
    gather
        .unmap_range(
            &cpu0,
            &rmap.spaces()[1],
            &mut kernel,
            pages(0, 1),
            false,
            &mut TableFreePolicy::AfterFlush,
            &mut handback,
        )
        .unwrap();
    assert_eq!(m.frame_state(frames[1]).unwrap(), FrameState::Free);
    assert!(back.is_empty());
    assert_eq!(m.violations(), []);
}

/// A kernel whose batched free puts a frame *into* the vector it is given
/// (a buggy or surprising implementation): the extra frame comes back as
/// refused, counts stay right, nothing panics.
struct Adds<'r, 'm> {
    kernel: MockKernel<'r, 'm>,
    extra: Option<Frame>,
}

impl FreeFrames for Adds<'_, '_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        self.kernel.free_batch(frames);
        if let Some(f) = self.extra.take() {
            let _ = frames.push(owned(f));
        }
    }
}

impl ReclaimBacking for Adds<'_, '_> {
    fn is_dirty(&self, frame: Frame) -> bool {
        self.kernel.is_dirty(frame)
    }
    fn page_out(&mut self, frame: WritebackFrame<'_>) -> tlb_batch::PageOut {
        self.kernel.page_out(frame)
    }
}

impl TeardownBacking for Adds<'_, '_> {
    fn set_dirty(&mut self, frame: Frame) {
        TeardownBacking::set_dirty(&mut self.kernel, frame)
    }
    fn free_tables<const N: usize>(&mut self, tables: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        self.kernel.free_tables(tables)
    }
}

#[test]
fn a_free_that_adds_frames_is_handled_by_reclaim_and_teardown() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let rmap = rmap_of(&m, 1);
    let frames = mapped(&m, &rmap, 2, false);
    let stray = m.alloc_frame().unwrap();
    // It refuses what it is given, and adds a frame on top.
    let mut kernel = MockKernel::new(&rmap);
    kernel.refuse_frees = true;
    let mut backing = Adds {
        kernel,
        extra: Some(stray),
    };
    let cpu0 = m.cpu(0).unwrap();
    let mut back = Vec::new();
    let summary = shrink_page_list(
        &cpu0,
        &rmap,
        &mut backing,
        &mut UnmapBatch::<4>::new(),
        [owned(frames[0])],
        &mut |f, v| back.push((f.into_frame(), v)),
    )
    .unwrap();
    assert_eq!(
        summary.freed, 0,
        "one offered, two left: the count does not underflow"
    );
    let verdicts: Vec<_> = back.iter().map(|(_, v)| *v).collect();
    let mut returned: Vec<_> = back.iter().map(|(f, _)| *f).collect();
    returned.sort();
    assert_eq!(verdicts, [Verdict::FreeRefused; 2]);
    assert_eq!(returned, [frames[0], stray]);

    backing.extra = Some(stray);
    let mut gather = MmuGather::<4>::new();
    let mut kinds = Vec::new();
    let s = gather
        .unmap_range(
            &cpu0,
            &rmap.spaces()[0],
            &mut backing,
            pages(1, 2),
            false,
            &mut TableFreePolicy::AfterFlush,
            &mut |f, k| kinds.push((f.into_frame(), k)),
        )
        .unwrap();
    assert_eq!(s.data_freed, 0);
    kinds.sort();
    let mut expected = [(frames[1], FrameKind::Data), (stray, FrameKind::Data)];
    expected.sort();
    assert_eq!(kinds, expected);
    assert_eq!(m.violations(), []);
}

// ----- 3. Hostile input -----

/// The last page of the address space is a page like any other: unmapped,
/// deferred, flushed, changed and torn down without losing its flush.
#[test]
fn the_last_page_of_the_address_space_keeps_its_flush() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let kernel_space = m.space(m.kernel_mm());
    let rmap = MockRmap::new(&m, vec![kernel_space]);
    let f = m.alloc_frame().unwrap();
    rmap.map(f, 0, TOP, true, MappingFlags::empty()).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.write(TOP, 1).unwrap();
    m.test_and_clear_accessed(m.kernel_mm(), TOP).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(&cpu0, &rmap, f, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::SuccessCached)
    );
    assert_eq!(batch.pending_pages(), 1);
    // A retry finds nothing mapped and must not pretend the flush is done.
    assert_eq!(
        try_to_unmap(&cpu0, &rmap, f, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::Success)
    );
    batch.flush(&cpu0).unwrap();
    assert_eq!(m.cached_translations(f), []);
    rmap.remove_frame(f);
    m.free_frame(f).unwrap();

    // mprotect, the immediate flushes and teardown reach it too.
    let g = m.alloc_frame().unwrap();
    m.map(m.kernel_mm(), TOP, g, true).unwrap();
    cpu1.write(TOP, 2).unwrap();
    let top = PageRange::page(TOP).unwrap();
    let space = m.space(m.kernel_mm());
    assert_eq!(
        change_protection(&cpu0, &space, top, |p| Pte(p.0 & !PteFlags::WRITABLE.bits())),
        Ok(1)
    );
    assert_eq!(m.check_coherent(m.kernel_mm(), top), 0);
    flush_tlb_page(&cpu0, m.kernel_mm(), TOP).unwrap();
    flush_tlb_range(&cpu0, m.kernel_mm(), top).unwrap();
    cpu1.read(TOP).unwrap();
    let mut kernel = MockKernel::new(&rmap);
    let mut gather = MmuGather::<4>::new();
    let top_table = PageRange::new(TOP - 511 * PAGE_SIZE, 512).unwrap();
    let s = gather
        .unmap_range(
            &cpu0,
            &space,
            &mut kernel,
            top_table,
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |_, _| panic!("nothing refused"),
        )
        .unwrap();
    assert_eq!((s.pages_unmapped, s.data_freed, s.tables_freed), (1, 1, 1));
    assert_eq!(m.cached_translations(g), []);
    assert_eq!(m.violations(), []);
}

/// A reverse map that reports whatever mappings it is given.
struct Listed<'a, 'm> {
    mappings: Vec<(&'a MockSpace<'m>, u64)>,
}

// SAFETY: test-only; the listed places are all the frame's mappings.
unsafe impl<'m> Rmap for Listed<'_, 'm> {
    type Space = MockSpace<'m>;
    fn walk(
        &self,
        _frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        for &(space, va) in &self.mappings {
            visit(Mapping {
                space,
                va,
                flags: MappingFlags::empty(),
            })?;
        }
        ControlFlow::Continue(())
    }
    fn set_dirty(&self, _frame: Frame) {}
}

/// Non-canonical addresses are refused at every entry point, before any
/// entry changes: from the caller, from a flush request, and from the
/// kernel's reverse map (a good mapping listed first is left alone).
#[test]
fn non_canonical_addresses_are_refused_before_anything_changes() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let space = m.space(&mm);
    let f = m.map_new(&mm, va(0), true).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.write(va(0), 1).unwrap();
    m.test_and_clear_accessed(&mm, va(0)).unwrap();
    let hole = 0x8000_0000_0000u64;
    let bad = Some(Error::NonCanonical { addr: hole });

    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(batch.add_pending(&cpu0, &mm, hole, Pte::EMPTY).err(), bad);
    assert_eq!(batch.add_accessed_clear(&cpu0, &mm, hole).err(), bad);
    assert!(batch.is_empty() && !mm.batched_flush_pending());
    assert_eq!(flush_tlb_page(&cpu0, &mm, hole).err(), bad);
    assert_eq!(
        flush_tlb_range(&cpu0, &mm, PageRange::new(hole - PAGE_SIZE, 2).unwrap()).err(),
        bad
    );
    let mut req = FlushRequest::new();
    req.add_page(asid(1), hole, 33).unwrap();
    assert_eq!(shootdown(&cpu0, &CpuSet::first(2).unwrap(), &req).err(), bad);
    assert_eq!(
        change_protection(&cpu0, &space, PageRange::new(hole, 1).unwrap(), |p| p).err(),
        bad
    );
    let empty = MockRmap::new(&m, Vec::new());
    let mut kernel = MockKernel::new(&empty);
    let mut gather = MmuGather::<4>::new();
    assert_eq!(
        gather.unmap_range(
            &cpu0,
            &space,
            &mut kernel,
            PageRange::new(0xffff_7fff_ffff_f000, 1).unwrap(),
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |_, _| {}
        ),
        Err(Error::NonCanonical {
            addr: 0xffff_7fff_ffff_f000
        })
    );
    assert!(matches!(m.map(&mm, hole, f, true), Err(MockError::Input(_))));

    // From the reverse map: the good mapping comes first and stays mapped.
    let listed = Listed {
        mappings: vec![(&space, va(0)), (&space, hole)],
    };
    for flags in [TtuFlags::BATCH_FLUSH, TtuFlags::IGNORE_ACCESS] {
        assert_eq!(try_to_unmap(&cpu0, &listed, f, flags, &mut batch).err(), bad);
    }
    assert_eq!(page_referenced(&cpu0, &listed, f, &mut batch).err(), bad);
    let mut typed = UnmapBatch::<2>::new();
    match typed.try_to_unmap(&cpu0, &listed, owned(f), TtuFlags::IGNORE_ACCESS) {
        Err((frame, e)) => assert_eq!((frame.frame(), e), (f, Error::NonCanonical { addr: hole })),
        other => panic!("{other:?}"),
    }
    assert!(m.pte(&mm, va(0)).unwrap().maps(f), "nothing changed");
    assert!(batch.is_empty() && typed.is_empty());
    assert_eq!(cpu1.write(va(0), 2), Ok(()));
    assert_eq!(m.violations(), []);
}

/// A range past the full-flush ceiling becomes a whole-ASID flush that no
/// longer lists its pages; one crossing the hole, lying in it, or reaching
/// below the upper half is refused all the same, with nothing flushed, by
/// `flush_tlb_range` and by a hand-built request sent with `shootdown`
/// (even after the request was widened to whole ASIDs or to everything).
/// Good long ranges in both halves still go through.
#[test]
fn long_ranges_a_machine_cannot_address_are_refused_past_the_ceiling() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    for c in [&cpu0, &cpu1] {
        c.switch_to(&mm).unwrap();
    }
    let all = CpuSet::first(2).unwrap();
    let hole = 0x8000_0000_0000u64;
    let below_upper = 0xffff_7fff_ffff_0000u64;
    let long = 40;
    assert!(long > <tlb_batch::arch::mock::MockCpu as tlb_batch::Arch>::FULL_FLUSH_CEILING as u64);
    let cases = [
        (PageRange::new(hole - PAGE_SIZE, long).unwrap(), hole, hole),
        (PageRange::new(hole, 100).unwrap(), hole, hole),
        (PageRange::new(0x1000, (1 << 52) - 1).unwrap(), hole, hole),
        (
            PageRange::new(below_upper, long).unwrap(),
            below_upper,
            below_upper,
        ),
    ];
    let before = (m.ipis_sent(), m.stats().shootdowns);
    for (range, at_entry, in_request) in cases {
        assert_eq!(
            flush_tlb_range(&cpu0, &mm, range).err(),
            Some(Error::NonCanonical { addr: at_entry }),
            "{range:?}"
        );
        for widen in 0..3 {
            let mut req = FlushRequest::new();
            req.add_range(asid(1), range, 33);
            match widen {
                1 => req.add_asid(asid(2)),
                2 => req.add_everything(),
                _ => {}
            }
            assert!(req.is_full());
            assert_eq!(
                shootdown(&cpu0, &all, &req).err(),
                Some(Error::NonCanonical { addr: in_request }),
                "{range:?}, widened {widen}"
            );
        }
    }
    assert_eq!((m.ipis_sent(), m.stats().shootdowns), before, "nothing was sent");

    // The same lengths in the right places: the top of each half.
    let lower_top = PageRange::new(hole - long * PAGE_SIZE, long).unwrap();
    let upper_top = PageRange::new(0u64.wrapping_sub(long * PAGE_SIZE), long).unwrap();
    assert!(flush_tlb_range(&cpu0, &mm, lower_top).unwrap().ipis_sent == 1);
    assert!(flush_tlb_range(&cpu0, m.kernel_mm(), upper_top).is_ok());
    let mut req = FlushRequest::new();
    req.add_range(asid(1), lower_top, 33);
    req.add_range(Asid::KERNEL, upper_top, 33);
    assert!(req.is_full());
    assert_eq!(shootdown(&cpu0, &all, &req).unwrap().remote_cpus, 1);
    assert_eq!(m.violations(), []);

    // With 64 address bits there is no hole: a long range across the
    // middle of the address space is every machine's to flush.
    let wide = MockMachine::new(tlb_batch::arch::mock::MockConfig {
        va_bits: 64,
        ..config(2, 64)
    })
    .unwrap();
    let mm = wide.new_mm(asid(1)).unwrap();
    let cpu0 = wide.cpu(0).unwrap();
    let middle = PageRange::new((1 << 63) - 20 * PAGE_SIZE, long).unwrap();
    assert!(flush_tlb_range(&cpu0, &mm, middle).is_ok());
    let mut req = FlushRequest::new();
    req.add_range(asid(1), middle, 33);
    assert!(req.is_full() && shootdown(&cpu0, &all, &req).is_ok());
}

/// ASIDs wider than the hardware's are refused wherever one enters: the
/// hardware would tag them as another address space's (x86: ASIDs 1 and
/// 4097 share PCID 1).
#[test]
fn asids_wider_than_the_hardware_are_refused() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    assert_eq!(Asid::new(0), Err(Error::ReservedAsid));
    assert_eq!(Asid::new(u16::MAX), Err(Error::ReservedAsid));
    let wide = Asid::new(4097).unwrap();
    let too_wide = Err(Error::AsidOutOfRange { asid: 4097, bits: 12 });
    assert_eq!(
        m.new_mm(wide).err(),
        Some(MockError::Input(Error::AsidOutOfRange { asid: 4097, bits: 12 }))
    );
    assert!(m.new_mm(Asid::new(4095).unwrap()).is_ok());
    // A kernel that builds its own state with a wide ASID.
    let mm = MmTlbState::new(wide, 0x1000);
    let cpu0 = m.cpu(0).unwrap();
    // SAFETY: refused before anything is loaded (and the mock only records
    // roots).
    assert_eq!(unsafe { switch_mm(&cpu0, None, &mm) }, too_wide);
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(batch.add_pending(&cpu0, &mm, va(0), Pte::EMPTY), too_wide);
    assert_eq!(flush_tlb_mm(&cpu0, &mm).map(|_| ()), too_wide);
    assert_eq!(flush_tlb_page(&cpu0, &mm, va(0)).map(|_| ()), too_wide);
    assert!(batch.is_empty() && !mm.batched_flush_pending());
    // A machine with 16-bit ASIDs takes it.
    let wider = MockMachine::new(tlb_batch::arch::mock::MockConfig {
        asid_bits: 16,
        ..config(2, 64)
    })
    .unwrap();
    assert!(wider.new_mm(wide).is_ok());
}

/// A machine with `PAGES` pages mapped evenly over the user half of an
/// address space (each in a table of its own), and their addresses.
fn scattered() -> (MockMachine, Arc<MmTlbState>, Vec<u64>) {
    let m = MockMachine::new(tlb_batch::arch::mock::MockConfig {
        frames: SCATTERED + 100,
        table_frames: SCATTERED + 100,
        ..config(1, 16)
    })
    .unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let step = ((1u64 << 47) / SCATTERED as u64) & !(PAGE_SIZE - 1);
    let addrs: Vec<u64> = (0..SCATTERED as u64).map(|i| i * step).collect();
    for &a in &addrs {
        m.map_new(&mm, a, true).unwrap();
    }
    (m, mm, addrs)
}

const SCATTERED: usize = 1000;

/// 1,000 pages scattered over the user half: one mprotect, or one
/// teardown, over all 2^47 bytes costs at most twice the page-table calls
/// of the same 1,000 pages given as exact one-page ranges.
#[test]
fn a_sparse_range_costs_what_is_mapped_not_its_size() {
    // A walk that pays for the range's size (2^35 pages) would run for
    // hours: the budget and the time limit turn it into a failure.
    const BUDGET: u64 = 1_000_000;
    common::within(120, || {
        let user_half = PageRange::new(0, 1 << 35).unwrap();
        let ro = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
        let mut costs = Vec::new();
        for exact in [false, true] {
            let (m, mm, addrs) = scattered();
            let space = CountingTable::with_budget(m.space(&mm), BUDGET);
            let cpu0 = m.cpu(0).unwrap();
            let rmap = MockRmap::new(&m, Vec::new());
            let mut kernel = MockKernel::new(&rmap);
            let mut gather = MmuGather::<64>::new();
            let mut teardown = |range| {
                gather
                    .unmap_range(
                        &cpu0,
                        &space,
                        &mut kernel,
                        range,
                        true,
                        &mut TableFreePolicy::AfterFlush,
                        &mut |_, _| panic!("nothing refused"),
                    )
                    .unwrap()
            };
            let (protect_calls, teardown_calls);
            if exact {
                for &a in &addrs {
                    let page = PageRange::page(a).unwrap();
                    assert_eq!(change_protection(&cpu0, &space, page, ro), Ok(1));
                }
                protect_calls = space.take_calls();
                for &a in &addrs {
                    assert_eq!(teardown(PageRange::page(a).unwrap()).pages_unmapped, 1);
                }
            } else {
                assert_eq!(change_protection(&cpu0, &space, user_half, ro), Ok(SCATTERED));
                protect_calls = space.take_calls();
                assert_eq!(teardown(user_half).pages_unmapped, SCATTERED);
            }
            teardown_calls = space.take_calls();
            assert!(!space.exceeded(), "the walk paid for the range's size");
            costs.push((protect_calls, teardown_calls));
            assert_eq!(m.violations(), []);
        }
        let [(sparse_p, sparse_t), (exact_p, exact_t)] = costs[..] else {
            unreachable!()
        };
        println!(
            "PageTable calls for {SCATTERED} pages: mprotect sparse {sparse_p} / exact {exact_p}, \
             teardown sparse {sparse_t} / exact {exact_t}"
        );
        assert!(sparse_p <= 2 * exact_p, "mprotect: {sparse_p} vs {exact_p}");
        assert!(sparse_t <= 2 * exact_t, "teardown: {sparse_t} vs {exact_t}");
    });
}

// ----- 4. Migration keeps what it does not own -----

#[test]
fn migration_keeps_no_execute_cache_and_software_bits_both_ways() {
    for budget in [None, Some(0)] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let rmap = rmap_of(&m, 1);
        let mm = rmap.spaces()[0].mm();
        let f = m.alloc_frame().unwrap();
        rmap.map(f, 0, va(0), true, MappingFlags::empty()).unwrap();
        let extra = PteFlags::NO_EXECUTE.bits() | (1 << 4) | (1 << 52);
        let original = Pte(m.pte(mm, va(0)).unwrap().0 | extra);
        m.set_pte(mm, va(0), original).unwrap();
        touch(&m, &rmap, 1, 0, va(0), true);
        let mut kernel = MockKernel::new(&rmap);
        kernel.alloc_budget = budget;
        let mut moved = None;
        migrate_pages(
            &m.cpu(0).unwrap(),
            &rmap,
            &mut kernel,
            &mut UnmapBatch::<2>::new(),
            [owned(f)],
            &mut |o| {
                if let MigrateOutcome::Migrated { new, .. } = o {
                    moved = Some(new.into_frame());
                }
            },
        )
        .unwrap();
        let now = m.pte(mm, va(0)).unwrap();
        let expected_frame = moved.unwrap_or(f);
        assert_eq!(moved.is_some(), budget.is_none());
        assert!(now.maps(expected_frame), "{now:?}");
        assert_eq!(
            now.0 & !(PteFlags::ACCESSED | PteFlags::DIRTY).bits(),
            original.with_frame(expected_frame).0 & !(PteFlags::ACCESSED | PteFlags::DIRTY).bits(),
            "every bit the migration does not own survives"
        );
        assert_eq!(m.violations(), []);
    }
}

/// Reports the frame poisoned from its `poisoned_from`-th question on.
struct PoisonedLater<'a, 'm> {
    inner: &'a MockRmap<'m>,
    asked: Cell<usize>,
    poisoned_from: usize,
}

// SAFETY: delegates every mapping to the mock rmap.
unsafe impl<'m> Rmap for PoisonedLater<'_, 'm> {
    type Space = MockSpace<'m>;
    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        self.inner.walk(frame, visit)
    }
    fn set_dirty(&self, frame: Frame) {
        self.inner.set_dirty(frame)
    }
    fn is_hwpoisoned(&self, _frame: Frame) -> bool {
        self.asked.set(self.asked.get() + 1);
        self.asked.get() >= self.poisoned_from
    }
}

/// A poisoned frame is never copied from and never freed, whether the
/// poison is known up front or found after the unmap.
#[test]
fn a_poisoned_frame_is_reported_never_copied_never_freed() {
    for poisoned_from in [1, 3] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let rmap = rmap_of(&m, 1);
        let f = m.alloc_frame().unwrap();
        rmap.map(f, 0, va(0), true, MappingFlags::empty()).unwrap();
        touch(&m, &rmap, 1, 0, va(0), true);
        let poisoned = PoisonedLater {
            inner: &rmap,
            asked: Cell::new(0),
            poisoned_from,
        };
        let copies = Cell::new(0);
        let mut backing = Counting {
            kernel: MockKernel::new(&rmap),
            copies: &copies,
        };
        let mut outcomes = Vec::new();
        migrate_pages(
            &m.cpu(0).unwrap(),
            &poisoned,
            &mut backing,
            &mut UnmapBatch::<2>::new(),
            [owned(f)],
            &mut |o| outcomes.push(o),
        )
        .unwrap();
        assert_eq!(copies.get(), 0, "nothing copied from a poisoned frame");
        assert!(
            matches!(&outcomes[..], [MigrateOutcome::Failed { frame, reason: MigrateFailure::HwPoisoned }] if frame.frame() == f),
            "{outcomes:?}"
        );
        assert_eq!(m.frame_state(f).unwrap(), FrameState::InUse, "never freed");
        assert_eq!(backing.kernel.frames_freed, 0);
        let pte = m.pte(rmap.spaces()[0].mm(), va(0)).unwrap();
        if poisoned_from == 1 {
            assert!(pte.maps(f), "untouched when known up front");
        } else {
            assert!(pte.is_hwpoison(), "found late: its mappings refuse access");
            assert_eq!(m.cpu(1).unwrap().read(va(0)), Err(Fault::HwPoison { va: va(0) }));
        }
        assert_eq!(m.violations(), []);
    }
}

// ----- 5. Split page-table locks -----

/// A page table with split locks: just before the crate takes the lock of
/// the table holding `target`, a reclaimer on another CPU (which held that
/// lock a moment ago) cleared `target` and deferred its flush. After the
/// crate's work on that table, still under its lock, the stale entry must
/// be gone.
struct SplitLocks<'a, 'm> {
    inner: &'a MockSpace<'m>,
    rmap: &'a MockRmap<'m>,
    machine: &'m MockMachine,
    target: (Frame, u64),
    reclaimer: Cell<Option<TlbFlushUnmapBatch>>,
    stale_after_table: Cell<usize>,
}

// SAFETY: forwards to the mock's page table; `with_table_locked` runs the
// body exactly once.
unsafe impl PageTable for SplitLocks<'_, '_> {
    fn tlb_state(&self) -> &MmTlbState {
        self.inner.tlb_state()
    }
    fn lookup(&self, va: u64) -> Pte {
        self.inner.lookup(va)
    }
    fn exchange(&self, va: u64, new: Pte) -> Pte {
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
    fn with_table_locked(&self, va: u64, body: &mut dyn FnMut()) {
        let (frame, target) = self.target;
        let same_table = va >> 21 == target >> 21;
        if same_table {
            if let Some(mut batch) = self.reclaimer.take() {
                let reclaimer = self.machine.cpu(2).unwrap();
                let r = try_to_unmap(&reclaimer, self.rmap, frame, TtuFlags::BATCH_FLUSH, &mut batch);
                assert_eq!(r, Ok(SwapResult::SuccessCached));
                self.reclaimer.set(Some(batch));
            }
        }
        body();
        if same_table {
            self.stale_after_table.set(
                self.machine
                    .check_coherent(self.inner.tlb_state(), PageRange::page(target).unwrap()),
            );
        }
    }
}

// SAFETY: forwards to the mock's page table.
unsafe impl tlb_batch::TableTeardown for SplitLocks<'_, '_> {
    fn detach_table(&self, range: PageRange) -> Option<tlb_batch::DetachedTable> {
        self.inner.detach_table(range)
    }
}

#[test]
fn with_split_locks_rule_5_is_checked_under_each_tables_lock() {
    for teardown in [false, true] {
        let m = MockMachine::new(config(3, 64)).unwrap();
        let rmap = rmap_of(&m, 1);
        // Page 0 in the first table; pages 512 and 513 in the second.
        let frames: Vec<_> = [0, 512, 513]
            .iter()
            .map(|&p| {
                let f = m.alloc_frame().unwrap();
                rmap.map(f, 0, va(p), true, MappingFlags::empty()).unwrap();
                touch(&m, &rmap, 1, 0, va(p), true);
                f
            })
            .collect();
        let space = SplitLocks {
            inner: &rmap.spaces()[0],
            rmap: &rmap,
            machine: &m,
            target: (frames[1], va(512)),
            reclaimer: Cell::new(Some(TlbFlushUnmapBatch::new())),
            stale_after_table: Cell::new(usize::MAX),
        };
        let cpu0 = m.cpu(0).unwrap();
        let range = pages(0, 514);
        if teardown {
            let mut kernel = MockKernel::new(&rmap);
            let mut gather = MmuGather::<8>::new();
            gather
                .unmap_range(
                    &cpu0,
                    &space,
                    &mut kernel,
                    range,
                    false,
                    &mut TableFreePolicy::AfterFlush,
                    &mut |_, _| {},
                )
                .unwrap();
        } else {
            change_protection(&cpu0, &space, range, |p| Pte(p.0 & !PteFlags::WRITABLE.bits())).unwrap();
        }
        assert_eq!(
            space.stale_after_table.get(),
            0,
            "the deferred flush was done under the table's lock"
        );
        assert_eq!(m.check_coherent(rmap.spaces()[0].mm(), range), 0);
        assert!(m.cpu(1).unwrap().write(va(512), 3).is_err());
        let mut reclaimer_batch = space.reclaimer.take().unwrap();
        reclaimer_batch.flush(&m.cpu(2).unwrap()).unwrap();
        assert_eq!(m.violations(), []);
    }
}

// ----- 6. The machine refuses what is not its own -----

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
