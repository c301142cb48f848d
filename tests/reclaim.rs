//! The reclaim driver against the mock machine: one dirty flush before the
//! first page-out, one flush before the batched free, every frame accounted
//! for, and the oracle watching.

mod common;

use std::collections::HashMap;

use common::{asid, config, va};
use tlb_batch::arch::mock::{FrameState, IoMode, MockKernel, MockMachine, MockRmap, Model, NoRewalk};
use tlb_batch::{shrink_page_list, Frame, MappingFlags, UnmapBatch, Verdict};

/// Three processes on CPUs 1-3 with `per_cpu` pages each; even pages are
/// written (dirty), odd ones read. Accessed bits are cleared afterwards so
/// that no page looks hot unless a test touches it again.
fn setup<M: Model>(m: &MockMachine<M>, per_cpu: usize) -> (MockRmap<'_, M>, Vec<Frame>) {
    let spaces = (0..3).map(|i| m.space(&m.new_mm(asid(i + 1)).unwrap())).collect();
    let rmap = MockRmap::new(m, spaces);
    let mut frames = Vec::new();
    for s in 0..3 {
        let cpu = m.cpu(s + 1).unwrap();
        cpu.switch_to(rmap.spaces()[s].mm()).unwrap();
        for i in 0..per_cpu {
            let f = m.alloc_frame().unwrap();
            rmap.map(f, s, va(i), true, MappingFlags::empty()).unwrap();
            if i % 2 == 0 {
                cpu.write(va(i), 1000 + f.0).unwrap();
            } else {
                cpu.read(va(i)).unwrap();
            }
            m.test_and_clear_accessed(rmap.spaces()[s].mm(), va(i)).unwrap();
            frames.push(f);
        }
    }
    (rmap, frames)
}

fn run<M: Model, const N: usize>(
    m: &MockMachine<M>,
    kernel: &mut MockKernel<'_, '_, M>,
    rmap: &MockRmap<'_, M>,
    frames: &[Frame],
) -> (tlb_batch::ReclaimSummary, HashMap<Frame, Verdict>) {
    let mut back = HashMap::new();
    let mut batch = UnmapBatch::<N>::new();
    let summary = shrink_page_list(
        &m.cpu(0).unwrap(),
        rmap,
        kernel,
        &mut batch,
        frames.iter().map(|&f| common::owned(f)),
        &mut |f, v| {
            assert!(
                back.insert(f.into_frame(), v).is_none(),
                "a frame handed back twice"
            );
        },
    )
    .unwrap();
    assert!(batch.is_empty());
    assert_eq!(
        summary.freed + back.len(),
        frames.len(),
        "every frame is freed or handed back"
    );
    assert_eq!(summary.handed_back, back.len());
    (summary, back)
}

#[test]
fn one_dirty_flush_then_page_out_then_one_batched_free() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = setup(&m, 8);
    let mut kernel = MockKernel::new(&rmap);
    let (summary, back) = run::<_, 64>(&m, &mut kernel, &rmap, &frames);
    assert_eq!(summary.scanned, 24);
    assert_eq!(summary.freed, 24);
    assert_eq!(summary.paged_out, 12, "every dirty frame written once");
    // The dirty flush covered everything (a dirty entry makes it flush the
    // whole batch), so the flush before freeing had nothing left to do: one
    // shootdown, one IPI per CPU that ran a process.
    assert_eq!((summary.shootdowns, summary.ipis_sent), (1, 3));
    assert_eq!(m.stats().ipis_sent, 3);
    assert_eq!(kernel.free_calls, 1, "one batched free");
    assert!(back.is_empty());
    for f in frames {
        assert_eq!(m.frame_state(f).unwrap(), FrameState::Free);
    }
    assert_eq!(m.violations(), [], "no I/O or free while a TLB entry survived");
}

#[test]
fn clean_pages_need_no_dirty_flush_and_one_flush_before_free() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let spaces = vec![m.space(&m.new_mm(asid(1)).unwrap())];
    let rmap = MockRmap::new(&m, spaces);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(rmap.spaces()[0].mm()).unwrap();
    let mut frames = Vec::new();
    for i in 0..10 {
        let f = m.alloc_frame().unwrap();
        rmap.map(f, 0, va(i), false, MappingFlags::empty()).unwrap();
        cpu1.read(va(i)).unwrap();
        m.test_and_clear_accessed(rmap.spaces()[0].mm(), va(i)).unwrap();
        frames.push(f);
    }
    let mut kernel = MockKernel::new(&rmap);
    let (summary, back) = run::<_, 16>(&m, &mut kernel, &rmap, &frames);
    assert_eq!((summary.freed, summary.paged_out), (10, 0));
    assert_eq!((summary.shootdowns, summary.ipis_sent), (1, 1));
    assert!(back.is_empty());
    assert_eq!(m.violations(), []);
}

#[test]
fn hot_mlocked_and_busy_frames_are_handed_back_with_their_verdicts() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = setup(&m, 4);
    // Frame 0 is used again: after a switch emptied CPU 1's TLB, the read
    // walks the table and sets the accessed bit (a TLB hit would not).
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&m.new_mm(asid(9)).unwrap()).unwrap();
    cpu1.switch_to(rmap.spaces()[0].mm()).unwrap();
    cpu1.read(va(0)).unwrap();
    // Frame 1 is mlocked; frame 2 is mlocked and used again as well (the
    // lock decides).
    rmap.set_flags(frames[1], MappingFlags::LOCKED);
    rmap.set_flags(frames[2], MappingFlags::LOCKED);
    cpu1.read(va(2)).unwrap();
    let mut kernel = MockKernel::new(&rmap);
    let (summary, back) = run::<_, 64>(&m, &mut kernel, &rmap, &frames);
    assert_eq!(back.get(&frames[0]), Some(&Verdict::Referenced));
    assert_eq!(back.get(&frames[1]), Some(&Verdict::Mlocked));
    assert_eq!(back.get(&frames[2]), Some(&Verdict::Mlocked));
    assert_eq!(back.len(), 3);
    assert_eq!(summary.freed, frames.len() - 3);
    // The kept frames are still mapped and usable.
    assert!(m.pte(rmap.spaces()[0].mm(), va(1)).unwrap().maps(frames[1]));
    assert_eq!(m.violations(), []);
}

/// A frame locked in one address space is kept whole: the driver asks
/// before unmapping, so its unlocked mapping elsewhere stays too (an unmap
/// would stop at the lock only after removing the mappings walked first).
#[test]
fn a_frame_locked_in_one_space_keeps_its_mappings_in_every_space() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, _) = setup(&m, 1);
    let f = m.alloc_frame().unwrap();
    rmap.map(f, 0, va(5), true, MappingFlags::empty()).unwrap();
    rmap.map(f, 1, va(5), true, MappingFlags::LOCKED).unwrap();
    for s in 0..2 {
        m.test_and_clear_accessed(rmap.spaces()[s].mm(), va(5)).unwrap();
    }
    let mut kernel = MockKernel::new(&rmap);
    let (summary, back) = run::<_, 8>(&m, &mut kernel, &rmap, &[f]);
    assert_eq!(back.get(&f), Some(&Verdict::Mlocked));
    assert_eq!((summary.freed, summary.shootdowns), (0, 0));
    for s in 0..2 {
        assert!(m.pte(rmap.spaces()[s].mm(), va(5)).unwrap().maps(f), "space {s}");
    }
    assert_eq!(m.violations(), []);
}

#[test]
fn queued_and_failed_writes_keep_their_frames() {
    for (io, verdict) in [
        (IoMode::Queued, Verdict::Writeback),
        (IoMode::Failing, Verdict::WriteFailed),
    ] {
        let m = MockMachine::new(config(4, 64)).unwrap();
        let (rmap, frames) = setup(&m, 4);
        let mut kernel = MockKernel::new(&rmap);
        kernel.io = io;
        let (summary, back) = run::<_, 64>(&m, &mut kernel, &rmap, &frames);
        // The 6 dirty frames stay; the 6 clean ones are freed. A queued
        // write counts as written out, a failed one does not.
        assert_eq!(summary.freed, 6);
        assert_eq!(summary.paged_out, if io == IoMode::Queued { 6 } else { 0 });
        assert_eq!(back.len(), 6);
        assert!(back.values().all(|v| *v == verdict));
        for f in back.keys() {
            let expected = if io == IoMode::Queued {
                FrameState::UnderIo
            } else {
                FrameState::InUse
            };
            assert_eq!(m.frame_state(*f).unwrap(), expected);
        }
        assert_eq!(m.violations(), []);
    }
}

#[test]
fn frames_the_allocator_refuses_come_back() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = setup(&m, 4);
    let mut kernel = MockKernel::new(&rmap);
    kernel.refuse_frees = true;
    let (summary, back) = run::<_, 64>(&m, &mut kernel, &rmap, &frames);
    assert_eq!(summary.freed, 0);
    assert_eq!(back.len(), 12);
    assert!(back.values().all(|v| *v == Verdict::FreeRefused));
    assert_eq!(kernel.free_calls, 1);
    assert_eq!(m.violations(), []);
}

#[test]
fn candidates_beyond_the_batch_are_not_scanned_but_returned() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = setup(&m, 4);
    let mut kernel = MockKernel::new(&rmap);
    let (summary, back) = run::<_, 5>(&m, &mut kernel, &rmap, &frames);
    assert_eq!((summary.scanned, summary.freed), (5, 5));
    assert_eq!(back.len(), 7);
    assert!(back.values().all(|v| *v == Verdict::NotScanned));
}

#[test]
fn without_the_rewalk_guarantee_every_unmap_flushes_at_once() {
    let m = MockMachine::<NoRewalk>::with_model(config(4, 64)).unwrap();
    let (rmap, frames) = setup(&m, 4);
    let mut kernel = MockKernel::new(&rmap);
    let (summary, back) = run::<_, 64>(&m, &mut kernel, &rmap, &frames);
    assert_eq!(summary.freed, 12);
    assert!(back.is_empty());
    // No deferral: one IPI per page, nothing left for the driver's flushes.
    assert_eq!(m.stats().ipis_sent, 12);
    assert_eq!(m.stats().pages_deferred, 0);
    assert_eq!(m.violations(), []);
}

#[test]
fn each_flush_point_costs_exactly_one_ipi_per_remote_cpu_involved() {
    // Four processes on CPUs 0-3, 32 pages each; CPU 0 reclaims lists that
    // mix pages of a growing number of processes. The floor for a list is
    // the number of other CPUs running a process whose page it unmaps.
    let m = MockMachine::new(config(4, 256)).unwrap();
    let spaces = (0..4).map(|i| m.space(&m.new_mm(asid(i + 1)).unwrap())).collect();
    let rmap = MockRmap::new(&m, spaces);
    let mut pages: Vec<Vec<Frame>> = vec![Vec::new(); 4];
    for (s, list) in pages.iter_mut().enumerate() {
        let cpu = m.cpu(s).unwrap();
        cpu.switch_to(rmap.spaces()[s].mm()).unwrap();
        for i in 0..32 {
            let f = m.alloc_frame().unwrap();
            rmap.map(f, s, va(i), false, MappingFlags::empty()).unwrap();
            cpu.read(va(i)).unwrap();
            m.test_and_clear_accessed(rmap.spaces()[s].mm(), va(i)).unwrap();
            list.push(f);
        }
    }
    let mut kernel = MockKernel::new(&rmap);
    // Lists drawing on processes {0}, {0,1}, {0,1,2}, {0,1,2,3}: floors 0..=3.
    for (round, floor) in (1..=4).zip(0..) {
        let mut list = Vec::new();
        for p in pages.iter_mut().take(round) {
            list.extend(p.drain(..8));
        }
        let (summary, back) = run::<_, 32>(&m, &mut kernel, &rmap, &list);
        assert!(back.is_empty());
        assert_eq!(summary.ipis_sent, floor, "round {round}");
    }
    assert_eq!(m.violations(), []);
}
