//! The migration driver against the mock machine.

mod common;

use std::ops::ControlFlow;

use common::{asid, config, va};
use tlb_batch::arch::mock::{Fault, MockKernel, MockMachine, MockRmap, MockSpace};
use tlb_batch::{
    migrate_pages, Frame, Mapping, MappingFlags, MigrateFailure, MigrateOutcome, PageTable, Pte, PteFlags,
    Rmap, UnmapBatch, MIGRATE_PASSES,
};

/// Two processes (CPUs 1 and 2) share `n` frames; the first half writable
/// and written, the rest read-only.
fn setup(m: &MockMachine, n: usize) -> (MockRmap<'_>, Vec<Frame>) {
    let spaces = (0..2).map(|i| m.space(&m.new_mm(asid(i + 1)).unwrap())).collect();
    let rmap = MockRmap::new(m, spaces);
    let frames: Vec<_> = (0..n).map(|_| m.alloc_frame().unwrap()).collect();
    for s in 0..2 {
        let cpu = m.cpu(s + 1).unwrap();
        cpu.switch_to(rmap.spaces()[s].mm()).unwrap();
        for (i, &f) in frames.iter().enumerate() {
            let writable = i < n / 2;
            rmap.map(f, s, va(i), writable, MappingFlags::SHARED).unwrap();
            if writable {
                cpu.write(va(i), 500 + i as u64).unwrap();
            } else {
                cpu.read(va(i)).unwrap();
            }
        }
    }
    (rmap, frames)
}

fn outcomes<R: Rmap, const N: usize>(
    m: &MockMachine,
    rmap: &R,
    kernel: &mut MockKernel<'_, '_>,
    frames: &[Frame],
) -> (tlb_batch::MigrateSummary, Vec<MigrateOutcome>) {
    let mut out = Vec::new();
    let mut batch = UnmapBatch::<N>::new();
    let summary = migrate_pages(
        &m.cpu(0).unwrap(),
        rmap,
        kernel,
        &mut batch,
        frames.iter().map(|&f| common::owned(f)),
        &mut |o| out.push(o),
    )
    .unwrap();
    assert!(batch.is_empty());
    (summary, out)
}

#[test]
fn a_list_of_shared_frames_moves_with_one_flush() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = setup(&m, 8);
    let mut kernel = MockKernel::new(&rmap);
    let (summary, out) = outcomes::<_, 16>(&m, &rmap, &mut kernel, &frames);
    assert_eq!((summary.migrated, summary.failed, summary.passes), (8, 0, 1));
    // Writable entries existed, so the flush came before the first copy and
    // covered everything: one shootdown reaching both CPUs.
    assert_eq!((summary.shootdowns, summary.ipis_sent), (1, 2));
    assert_eq!(kernel.free_calls, 1, "old frames released in one batch");
    for (i, o) in out.iter().enumerate() {
        let MigrateOutcome::Migrated { old, new } = o else {
            panic!("{o:?}")
        };
        assert_eq!(*old, frames[i]);
        assert!(m.frame_state(*old).unwrap() == tlb_batch::arch::mock::FrameState::Free);
        let written = if i < 4 { 500 + i as u64 } else { 0 };
        assert_eq!(m.frame_data(new.frame()), Ok(written), "contents copied");
        for s in 0..2 {
            let pte = m.pte(rmap.spaces()[s].mm(), va(i)).unwrap();
            assert!(pte.maps(new.frame()));
            assert_eq!(pte.is_writable(), i < 4, "writability survives the move");
        }
    }
    // The processes see their data in the new frames.
    let cpu1 = m.cpu(1).unwrap();
    assert_eq!(cpu1.read(va(0)), Ok(500));
    cpu1.write(va(1), 7).unwrap();
    assert_eq!(m.violations(), []);
}

/// An old frame the allocator refuses comes back as `OldFrameRefused`,
/// after the frame's `Migrated` report: one of `Migrated` or `Failed` per
/// frame, and the refusal as the only second report.
#[test]
fn a_refused_old_frame_follows_its_migrated_report() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = setup(&m, 4);
    let mut kernel = MockKernel::new(&rmap);
    kernel.refuse_frees = true;
    let (summary, out) = outcomes::<_, 8>(&m, &rmap, &mut kernel, &frames);
    assert_eq!((summary.migrated, summary.failed), (4, 0));
    assert_eq!(out.len(), 8);
    let (moved, refused) = out.split_at(4);
    for (i, o) in moved.iter().enumerate() {
        assert!(
            matches!(o, MigrateOutcome::Migrated { old, .. } if *old == frames[i]),
            "{o:?}"
        );
    }
    let mut back: Vec<Frame> = refused
        .iter()
        .map(|o| match o {
            MigrateOutcome::OldFrameRefused(f) => f.frame(),
            other => panic!("{other:?}"),
        })
        .collect();
    back.sort();
    let mut expected = frames.clone();
    expected.sort();
    assert_eq!(back, expected, "each old frame handed back once");
    for &f in &frames {
        assert_eq!(
            m.frame_state(f).unwrap(),
            tlb_batch::arch::mock::FrameState::InUse
        );
    }
    assert_eq!(m.violations(), []);
}

#[test]
fn read_only_frames_are_copied_before_the_single_flush() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = setup(&m, 8);
    // Only the read-only half: nothing can write them, so no flush is
    // needed before copying; the one flush comes before release.
    let mut kernel = MockKernel::new(&rmap);
    let (summary, _) = outcomes::<_, 16>(&m, &rmap, &mut kernel, &frames[4..]);
    assert_eq!(
        (summary.migrated, summary.shootdowns, summary.ipis_sent),
        (4, 1, 2)
    );
    assert_eq!(m.violations(), []);
}

#[test]
fn when_allocation_fails_the_original_mappings_come_back() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = setup(&m, 4);
    let mut kernel = MockKernel::new(&rmap);
    kernel.alloc_budget = Some(1);
    let (summary, out) = outcomes::<_, 16>(&m, &rmap, &mut kernel, &frames);
    assert_eq!((summary.migrated, summary.failed), (1, 3));
    let mut failed: Vec<Frame> = out
        .iter()
        .filter_map(|o| match o {
            MigrateOutcome::Failed {
                frame,
                reason: MigrateFailure::NoMemory,
            } => Some(frame.frame()),
            _ => None,
        })
        .collect();
    failed.sort();
    assert_eq!(failed, &frames[1..]);
    for (i, &f) in frames.iter().enumerate().skip(1) {
        for s in 0..2 {
            let pte = m.pte(rmap.spaces()[s].mm(), va(i)).unwrap();
            assert!(pte.maps(f), "mapping restored");
            assert_eq!(pte.is_writable(), i < 2);
        }
        assert_eq!(
            m.frame_state(f).unwrap(),
            tlb_batch::arch::mock::FrameState::InUse
        );
    }
    assert_eq!(m.cpu(1).unwrap().read(va(2)), Ok(0));
    assert_eq!(m.violations(), []);
}

/// A reverse map under which a fault maps the frame again after every walk,
/// `times` times.
struct Busy<'a, 'm> {
    inner: &'a MockRmap<'m>,
    times: std::cell::Cell<usize>,
}

// SAFETY: delegates to the mock rmap; the re-installed PTE is one of its
// recorded mappings.
unsafe impl<'m> Rmap for Busy<'_, 'm> {
    type Space = MockSpace<'m>;
    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let flow = self.inner.walk(frame, visit);
        let space = &self.inner.spaces()[0];
        if self.times.get() > 0 && space.lookup(va(0)).is_migration() {
            self.times.set(self.times.get() - 1);
            space.set(
                va(0),
                Pte::new(frame, PteFlags::PRESENT | PteFlags::USER | PteFlags::WRITABLE),
            );
        }
        flow
    }
    fn set_dirty(&self, frame: Frame) {
        self.inner.set_dirty(frame)
    }
}

#[test]
fn busy_frames_are_retried_then_reported_with_mappings_restored() {
    for (refaults, migrated) in [(3, true), (usize::MAX, false)] {
        let m = MockMachine::new(config(3, 64)).unwrap();
        let (rmap, frames) = setup(&m, 1);
        let busy = Busy {
            inner: &rmap,
            times: std::cell::Cell::new(refaults),
        };
        let mut kernel = MockKernel::new(&rmap);
        let (summary, out) = outcomes::<_, 4>(&m, &busy, &mut kernel, &frames);
        if migrated {
            assert_eq!((summary.migrated, summary.passes), (1, 4));
        } else {
            assert_eq!((summary.failed, summary.passes), (1, MIGRATE_PASSES));
            assert!(matches!(
                out[0],
                MigrateOutcome::Failed {
                    reason: MigrateFailure::Busy(_),
                    ..
                }
            ));
            for s in 0..2 {
                assert!(m.pte(rmap.spaces()[s].mm(), va(0)).unwrap().maps(frames[0]));
            }
        }
        // Every pass defers its flushes to the batch: one shootdown at the
        // end, one IPI to each of CPUs 1 and 2.
        let stats = m.stats();
        assert_eq!((stats.shootdowns, stats.ipis_sent), (1, 2));
        assert_ne!(m.cpu(1).unwrap().read(va(0)), Err(Fault::Migration { va: va(0) }));
        assert_eq!(m.violations(), []);
    }
}

#[test]
fn batched_migration_costs_fewer_ipis_than_page_by_page() {
    let mut ipis = Vec::new();
    for per_page in [true, false] {
        let m = MockMachine::new(config(3, 64)).unwrap();
        let (rmap, frames) = setup(&m, 16);
        let mut kernel = MockKernel::new(&rmap);
        if per_page {
            for f in &frames {
                outcomes::<_, 1>(&m, &rmap, &mut kernel, std::slice::from_ref(f));
            }
        } else {
            outcomes::<_, 16>(&m, &rmap, &mut kernel, &frames);
        }
        assert_eq!(m.violations(), []);
        ipis.push(m.stats().ipis_sent);
    }
    // Page by page: a shootdown per frame reaching both CPUs.
    assert_eq!(ipis, [32, 2]);
}

/// Mlocked mappings do not stop a migration (it keeps the page resident).
#[test]
fn an_mlocked_frame_is_migrated() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = setup(&m, 2);
    rmap.set_flags(frames[0], MappingFlags::LOCKED);
    let mut kernel = MockKernel::new(&rmap);
    let (summary, out) = outcomes::<_, 4>(&m, &rmap, &mut kernel, &frames);
    assert_eq!((summary.migrated, summary.failed), (2, 0), "{out:?}");
    assert_eq!(m.violations(), []);
}

/// When no other CPU runs the address spaces, every unmap flushes at once
/// and owes nothing: a frame that is mapped again after each walk comes
/// back from the unmap at once and is retried pass after pass, then
/// reported busy with its mappings restored.
#[test]
fn busy_frames_that_owe_nothing_are_retried_pass_by_pass() {
    for (refaults, migrated) in [(3, true), (usize::MAX, false)] {
        let m = MockMachine::new(config(3, 64)).unwrap();
        let (rmap, frames) = setup(&m, 1);
        // CPUs 1 and 2 leave: nothing is cached elsewhere.
        let idle = m.new_mm(asid(9)).unwrap();
        for c in [1, 2] {
            m.cpu(c).unwrap().switch_to(&idle).unwrap();
        }
        let busy = Busy {
            inner: &rmap,
            times: std::cell::Cell::new(refaults),
        };
        let mut kernel = MockKernel::new(&rmap);
        let (summary, out) = outcomes::<_, 4>(&m, &busy, &mut kernel, &frames);
        if migrated {
            assert_eq!((summary.migrated, summary.passes), (1, 4), "{out:?}");
        } else {
            assert_eq!((summary.failed, summary.passes), (1, MIGRATE_PASSES), "{out:?}");
            assert!(matches!(
                out[..],
                [MigrateOutcome::Failed {
                    reason: MigrateFailure::Busy(_),
                    ..
                }]
            ));
            for s in 0..2 {
                assert!(m.pte(rmap.spaces()[s].mm(), va(0)).unwrap().maps(frames[0]));
            }
        }
        assert_eq!(m.stats().pages_deferred, 0, "every flush was immediate");
        assert_eq!(m.violations(), []);
    }
}

/// A reverse map that answers, for each frame, every mapping of every frame
/// in a list: the contract lets a walk report places that may map the
/// frame and no longer do (or never did).
struct Overreport<'a, 'm> {
    inner: &'a MockRmap<'m>,
    frames: Vec<Frame>,
}

// SAFETY: every mapping of a frame is reported (the mock rmap's), and the
// extra ones are mappings of other frames, which the crate must check.
unsafe impl<'m> Rmap for Overreport<'_, 'm> {
    type Space = MockSpace<'m>;
    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        self.inner.walk(frame, visit)?;
        for &other in self.frames.iter().filter(|&&f| f != frame) {
            self.inner.walk(other, visit)?;
        }
        ControlFlow::Continue(())
    }
    fn set_dirty(&self, frame: Frame) {
        self.inner.set_dirty(frame)
    }
    fn is_hwpoisoned(&self, frame: Frame) -> bool {
        self.inner.is_hwpoisoned(frame)
    }
}

/// The mock kernel as a migration backing, which poisons `victim` when the
/// first target frame is allocated (after every frame was unmapped, before
/// any entry is restored).
struct PoisonOnFirstAlloc<'k, 'r, 'm> {
    kernel: MockKernel<'r, 'm>,
    machine: &'k MockMachine,
    victim: Option<Frame>,
}

impl tlb_batch::FreeFrames for PoisonOnFirstAlloc<'_, '_, '_> {
    fn free_batch<const N: usize>(
        &mut self,
        frames: &mut tlb_batch::heapless::Vec<tlb_batch::OwnedFrame, N>,
    ) {
        self.kernel.free_batch(frames)
    }
}

impl tlb_batch::MigrateBacking for PoisonOnFirstAlloc<'_, '_, '_> {
    fn alloc_target(&mut self, old: Frame) -> Option<tlb_batch::OwnedFrame> {
        if let Some(victim) = self.victim.take() {
            self.machine.poison_frame(victim).unwrap();
        }
        self.kernel.alloc_target(old)
    }
    fn copy_frame(&mut self, from: tlb_batch::WritebackFrame<'_>, to: &tlb_batch::OwnedFrame) {
        self.kernel.copy_frame(from, to)
    }
    fn move_mappings(&mut self, old: Frame, new: Frame) {
        self.kernel.move_mappings(old, new)
    }
}

/// Restoring and poisoning migration entries touch only the entries of the
/// frame at hand, even when the reverse map also reports other frames'
/// mappings that are migration entries too: frame 1 is found poisoned
/// after the unmap, frames 0 and 2 move, and every address ends up with
/// its own frame's entry.
#[test]
fn migration_entries_are_restored_or_poisoned_only_for_their_own_frame() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = setup(&m, 3);
    let over = Overreport {
        inner: &rmap,
        frames: frames.clone(),
    };
    let mut backing = PoisonOnFirstAlloc {
        kernel: MockKernel::new(&rmap),
        machine: &m,
        victim: Some(frames[1]),
    };
    let mut out = Vec::new();
    let mut batch = UnmapBatch::<4>::new();
    let summary = migrate_pages(
        &m.cpu(0).unwrap(),
        &over,
        &mut backing,
        &mut batch,
        frames.iter().map(|&f| common::owned(f)),
        &mut |o| out.push(o),
    )
    .unwrap();
    assert_eq!((summary.migrated, summary.failed), (2, 1), "{out:?}");
    let mut new = Vec::new();
    for o in &out {
        match o {
            MigrateOutcome::Migrated { old, new: to } => new.push((*old, to.frame())),
            MigrateOutcome::Failed {
                frame,
                reason: MigrateFailure::HwPoisoned,
            } => assert_eq!(frame.frame(), frames[1]),
            other => panic!("{other:?}"),
        }
    }
    new.sort();
    assert_eq!(
        new.iter().map(|n| n.0).collect::<Vec<_>>(),
        [frames[0], frames[2]]
    );
    for s in 0..2 {
        let mm = rmap.spaces()[s].mm();
        assert!(m.pte(mm, va(0)).unwrap().maps(new[0].1), "space {s}, page 0");
        let poisoned = m.pte(mm, va(1)).unwrap();
        assert!(
            poisoned.is_hwpoison() && poisoned.frame() == frames[1],
            "space {s}: {poisoned:?}"
        );
        assert!(m.pte(mm, va(2)).unwrap().maps(new[1].1), "space {s}, page 2");
    }
    assert_eq!(m.violations(), []);
}
