//! The batch's credit on tagged TLBs: a CPU that a `TlbFlushUnmapBatch`
//! flush leaves out because it holds none of the batch's entries (it
//! flushed the space's ASID after their aging, and they were found
//! unaccessed) is credited with the batch's generation step, so that its
//! next load of the space needs no catch-up, but only when it had carried
//! out every flush of the space up to the step's start. The oracle judges
//! every load and every free.
//!
//! The last condition matters only for a CPU that is a target (it ran the
//! space when a page was added) and yet missed an earlier flush: a CPU
//! between recording its switch into the space and its catch-up. One
//! thread of the mock cannot stop there (its switch hook runs after the
//! catch-up on tagged TLBs); what these tests show is that a CPU the batch
//! did not target is never credited.

mod common;

use std::sync::Arc;

use common::{asid, owned, va};
use tlb_batch::arch::mock::{MockConfig, MockCpu, MockKernel, MockMachine, MockRmap};
use tlb_batch::{
    flush_tlb_mm, page_referenced, Frame, FreeFrames, MappingFlags, MmTlbState, TlbFlushUnmapBatch, TtuFlags,
    UnmapBatch, Unmapped,
};

/// Three CPUs with tagged TLBs: CPU 0 reclaims, CPU 1 runs the space.
fn machine() -> MockMachine {
    MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..common::config(3, 64)
    })
    .unwrap()
}

fn cpu(m: &MockMachine, c: usize) -> MockCpu<'_> {
    m.cpu(c).unwrap()
}

/// `mm` with frames at pages 0 and 5, CPU 1 running it with both cached,
/// page 0 aged, and then CPU 1 caught up by its own flush of the ASID
/// after that aging (it went away, `mm` was flushed, it came back).
fn setup(m: &MockMachine) -> (MockRmap<'_>, Arc<MmTlbState>, Arc<MmTlbState>, [Frame; 2]) {
    let mm = m.new_mm(asid(1)).unwrap();
    let other = m.new_mm(asid(2)).unwrap();
    let rmap = MockRmap::new(m, vec![m.space(&mm), m.space(&other)]);
    let frames = [m.alloc_frame().unwrap(), m.alloc_frame().unwrap()];
    for (f, page) in frames.iter().zip([0, 5]) {
        rmap.map(*f, 0, va(page), false, MappingFlags::empty()).unwrap();
    }
    cpu(m, 0).switch_to(&other).unwrap();
    cpu(m, 2).switch_to(&other).unwrap();
    let c1 = cpu(m, 1);
    c1.switch_to(&mm).unwrap();
    c1.read(va(0)).unwrap();
    let mut scratch = TlbFlushUnmapBatch::new();
    let aged = page_referenced(&cpu(m, 0), &rmap, frames[0], &mut scratch).unwrap();
    assert_eq!(aged.referenced, 1);
    c1.switch_to(&other).unwrap();
    flush_tlb_mm(&cpu(m, 0), &mm).unwrap();
    let before = m.stats().catch_ups;
    c1.switch_to(&mm).unwrap();
    assert_eq!(
        m.stats().catch_ups - before,
        1,
        "CPU 1 flushed the ASID after the aging"
    );
    c1.read(va(5)).unwrap();
    (rmap, mm, other, frames)
}

/// CPU 0 unmaps `f` into a batch of its own, flushes and frees it; returns
/// the IPIs and the credits the flush gave.
fn unmap_flush_free(m: &MockMachine, rmap: &MockRmap<'_>, f: Frame) -> (usize, u64) {
    let c0 = cpu(m, 0);
    let mut batch = UnmapBatch::<4>::new();
    let r = batch.try_to_unmap(&c0, rmap, owned(f), TtuFlags::IGNORE_ACCESS);
    assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    let credits = m.stats().generations_granted;
    let mut flushed = batch.flush(&c0).unwrap();
    let ipis = flushed.report().ipis_sent;
    MockKernel::new(rmap).free_batch(flushed.frames_mut());
    (ipis, m.stats().generations_granted - credits)
}

fn no_violations(m: &MockMachine) {
    assert!(m.violations().is_empty(), "{:?}", m.violations());
}

/// Running the space: no IPI, a credit, and no catch-up when CPU 1 comes
/// back to the space after a switch away (it still holds page 5's entry,
/// which stays valid).
#[test]
fn a_credited_cpu_comes_back_to_the_space_without_a_catch_up() {
    let m = machine();
    let (rmap, mm, other, [f, _]) = setup(&m);
    assert_eq!(unmap_flush_free(&m, &rmap, f), (0, 1));
    let c1 = cpu(&m, 1);
    c1.switch_to(&other).unwrap();
    let before = m.stats().catch_ups;
    c1.switch_to(&mm).unwrap();
    assert_eq!(m.stats().catch_ups - before, 0, "the credit stands for the flush");
    c1.read(va(5)).unwrap();
    no_violations(&m);
}

/// Lazy on the space, CPU 1 is no target of the batch (flushes skip lazy
/// CPUs), and the batch credits only its targets: CPU 1 catches up when
/// it resumes. Here it also missed a flush of page 5, whose frame was then
/// freed: the catch-up drops that entry too (a resume without it would be
/// the oracle's `LazyResumedWithStale`).
#[test]
fn a_lazy_cpu_gets_no_credit_and_catches_up_when_it_resumes() {
    let m = machine();
    let (rmap, mm, _, [f, f5]) = setup(&m);
    let c1 = cpu(&m, 1);
    c1.enter_lazy().unwrap();
    assert_eq!(unmap_flush_free(&m, &rmap, f5), (0, 0), "page 5 was never aged");
    assert_eq!(unmap_flush_free(&m, &rmap, f), (0, 0));
    let before = m.stats().catch_ups;
    c1.switch_to(&mm).unwrap();
    assert_eq!(m.stats().catch_ups - before, 1);
    no_violations(&m);
}

/// A CPU that did not flush the ASID since the aging may hold the batch's
/// entry: it is interrupted, and credited with nothing.
#[test]
fn a_cpu_that_may_hold_the_entry_is_interrupted_not_credited() {
    let m = machine();
    let mm = m.new_mm(asid(1)).unwrap();
    let other = m.new_mm(asid(2)).unwrap();
    let rmap = MockRmap::new(&m, vec![m.space(&mm), m.space(&other)]);
    let f = m.alloc_frame().unwrap();
    rmap.map(f, 0, va(0), false, MappingFlags::empty()).unwrap();
    cpu(&m, 0).switch_to(&other).unwrap();
    let c1 = cpu(&m, 1);
    c1.switch_to(&mm).unwrap();
    c1.read(va(0)).unwrap();
    let mut scratch = TlbFlushUnmapBatch::new();
    page_referenced(&cpu(&m, 0), &rmap, f, &mut scratch).unwrap();
    assert_eq!(unmap_flush_free(&m, &rmap, f), (1, 0));
    no_violations(&m);
}
