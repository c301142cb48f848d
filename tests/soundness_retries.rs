//! Regression tests for the paths where the contract used to break, part
//! two: errors and documented retries (a shootdown that fails inside
//! mprotect, migration, reclaim and teardown, and what the retry must still
//! do), and migration's bookkeeping (bits it does not own, poisoned frames).
//! Every test checks the oracle: a test passes only when the simulated
//! machine saw no violation and no stale entry where the contract forbids
//! one.

// The drivers return their retry values by value.
#![allow(clippy::result_large_err)]

mod common;

use std::cell::Cell;
use std::collections::HashMap;
use std::ops::ControlFlow;

use common::soundness::{mapped, rmap_of, touch};
use common::{config, owned, pages, va};
use tlb_batch::arch::mock::{Fault, FrameState, IoMode, MockKernel, MockMachine, MockRmap, MockSpace};
use tlb_batch::{
    change_protection, migrate_pages, shrink_page_list, Error, Frame, FrameKind, FreeFrames, Mapping,
    MappingFlags, MigrateBacking, MigrateFailure, MigrateOutcome, MmuGather, OwnedFrame, Pte, PteFlags,
    ReclaimBacking, Rmap, TableFreePolicy, TeardownBacking, UnmapBatch, Verdict, WritebackFrame,
};

// ----- Errors and documented retries -----

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

/// Found by a new user's trial: mprotect (read-write to read-only) whose
/// shootdown fails leaves CPU 1 a writable entry for a page whose PTE is
/// now read-only; reclaim then found the PTE read-only and clean, skipped
/// the flush before the page-out (`flush_dirty`), and started the write
/// while CPU 1 could still write (`IoWhileWritable`). The unmap now pays
/// the failed change's owed flush before it clears the entry, with the
/// plain and the pooled reclaim alike.
#[test]
fn reclaim_after_a_failed_mprotect_flushes_the_writable_entry_before_io() {
    for pooled in [false, true] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let rmap = rmap_of(&m, 1);
        let space = &rmap.spaces()[0];
        let f = m.alloc_frame().unwrap();
        rmap.map(f, 0, va(0), true, MappingFlags::empty()).unwrap();
        // CPU 1 reads: its entry allows writes, the PTE stays clean.
        touch(&m, &rmap, 1, 0, va(0), false);
        let cpu0 = m.cpu(0).unwrap();
        let read_only = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
        let failed = cpu0
            .in_shootdown(|| change_protection(&cpu0, space, pages(0, 1), read_only))
            .unwrap();
        assert!(matches!(failed, Err(Error::ShootdownReentered { .. })));
        // The page is dirty by other means (a write(2) into the page
        // cache): reclaim must write it out.
        rmap.set_dirty(f);
        let mut kernel = MockKernel::new(&rmap);
        let mut batch = UnmapBatch::<4>::new();
        let mut verdicts = Vec::new();
        if pooled {
            let mut pool = tlb_batch::FramePool::<8>::new();
            tlb_batch::shrink_page_list_pooled(
                &cpu0,
                &rmap,
                &mut kernel,
                &mut batch,
                &mut pool,
                [owned(f)],
                &mut |_, v| verdicts.push(v),
            )
            .unwrap();
            let mut released = pool.flush(&cpu0).unwrap();
            kernel.free_batch(released.frames_mut());
        } else {
            shrink_page_list(&cpu0, &rmap, &mut kernel, &mut batch, [owned(f)], &mut |_, v| {
                verdicts.push(v)
            })
            .unwrap();
        }
        assert_eq!(kernel.page_outs, 1, "pooled {pooled}: {verdicts:?}");
        assert!(m.cpu(1).unwrap().write(va(0), 9).is_err(), "pooled {pooled}");
        // Paid once: a later unmap in the space defers its flush again,
        // with no shootdown of its own.
        let g = m.alloc_frame().unwrap();
        rmap.map(g, 0, va(1), true, MappingFlags::empty()).unwrap();
        touch(&m, &rmap, 1, 0, va(1), false);
        let before = m.stats();
        let mut later = tlb_batch::TlbFlushUnmapBatch::new();
        let ttu = tlb_batch::TtuFlags::BATCH_FLUSH;
        let got = tlb_batch::try_to_unmap(&cpu0, &rmap, g, ttu, &mut later).unwrap();
        assert!(got.is_unmapped(), "{got:?}");
        assert_eq!(m.stats().since(&before).shootdowns, 0, "pooled {pooled}");
        later.flush(&cpu0).unwrap();
        assert_eq!(m.violations(), [], "pooled {pooled}");
    }
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

// ----- Migration keeps what it does not own -----

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
