//! Flush generations on the mock machine (`tlb_batch::generation`): what a
//! CPU records for the ASIDs it ran, and when it must flush one before
//! loading it again. The counts are the crate's `catch_ups`: a catch-up
//! too many is a wasted local flush (and refills), one too few is a stale
//! entry, which the oracle catches at the load.

mod common;

use common::{asid, config, va};
use tlb_batch::arch::mock::{Fault, MockConfig, MockMachine};
use tlb_batch::generation::ASID_SLOTS;
use tlb_batch::{flush_tlb_mm, flush_tlb_page, TlbFlushUnmapBatch};

fn tagged(cpus: usize) -> MockMachine {
    MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(cpus, 64)
    })
    .unwrap()
}

/// A space's first load on a CPU flushes its ASID (the CPU cannot know
/// what a dead space left under it); coming back to it with nothing
/// flushed meanwhile does not.
#[test]
fn a_first_load_catches_up_and_a_return_with_nothing_flushed_does_not() {
    let m = tagged(2);
    let (a, b) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&a).unwrap();
    cpu1.switch_to(&b).unwrap();
    assert_eq!(m.stats().catch_ups, 2, "two first loads");
    cpu1.switch_to(&a).unwrap();
    cpu1.switch_to(&b).unwrap();
    assert_eq!(m.stats().catch_ups, 2, "nothing was flushed meanwhile");
    assert_eq!(m.violations(), []);
}

/// A flush of a whole address space that reaches a CPU running it counts
/// as that CPU's catch-up on it: after switching away and back, with
/// nothing flushed in between, it flushes nothing. So does a page flush
/// that follows the last flush the CPU carried out (its request carries the
/// step of the space's generation, as Linux's `new_tlb_gen` one past the
/// CPU's): the return after it flushes nothing either.
#[test]
fn a_flush_received_counts_as_caught_up_whole_space_or_pages() {
    let m = tagged(2);
    let (a, b) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
    m.map_new(&a, va(0), false).unwrap();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.switch_to(&a).unwrap();
    cpu1.read(va(0)).unwrap();
    let first = m.stats().catch_ups;
    assert_eq!(flush_tlb_mm(&cpu0, &a).unwrap().ipis_sent, 1);
    cpu1.switch_to(&b).unwrap();
    let before = m.stats().catch_ups;
    cpu1.switch_to(&a).unwrap();
    assert_eq!(m.stats().catch_ups - before, 0, "the IPI's flush of A counted");
    for _ in 0..3 {
        assert_eq!(flush_tlb_page(&cpu0, &a, va(0)).unwrap().ipis_sent, 1);
    }
    cpu1.switch_to(&b).unwrap();
    let before = m.stats().catch_ups;
    cpu1.switch_to(&a).unwrap();
    assert_eq!(
        m.stats().catch_ups - before,
        0,
        "each page flush followed the one before"
    );
    assert!(first >= 1);
    assert_eq!(m.violations(), []);
}

/// A page flush counts only when the CPU carried out every flush of the
/// space before it. Here a batched unmap advances A's generation first and
/// is flushed only after CPU 1 switched away (so it skips CPU 1, which owes
/// a catch-up for it); a page flush that CPU 1 receives in between must not
/// carry it past that debt. Its return to A flushes A, and the oracle sees
/// no stale entry for the freed frame at the load.
#[test]
fn a_page_flush_after_one_the_cpu_missed_does_not_count() {
    let m = tagged(2);
    let (a, b) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
    let freed = m.map_new(&a, va(0), false).unwrap();
    m.map_new(&a, va(1), false).unwrap();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.switch_to(&a).unwrap();
    cpu1.read(va(0)).unwrap();
    cpu1.read(va(1)).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let old = m.clear_pte(&a, va(0)).unwrap();
    batch.add_pending(&cpu0, &a, va(0), old).unwrap();
    assert_eq!(flush_tlb_page(&cpu0, &a, va(1)).unwrap().ipis_sent, 1);
    cpu1.switch_to(&b).unwrap();
    assert_eq!(batch.flush(&cpu0).unwrap().ipis_sent, 0, "CPU 1 switched away");
    m.free_frame(freed).unwrap();
    let before = m.stats().catch_ups;
    cpu1.switch_to(&a).unwrap();
    assert_eq!(m.violations(), [], "no stale entry at the load");
    assert_eq!(m.stats().catch_ups - before, 1, "it owes the batch's page");
    assert_eq!(cpu1.read(va(0)).map(|_| ()), Err(Fault::NotMapped { va: va(0) }));
}

/// A CPU remembers `ASID_SLOTS` ASIDs. Running one more evicts the oldest
/// recorded one, whose next load flushes it again although its space was
/// never flushed; the others it still remembers load without a flush.
#[test]
fn an_asid_evicted_from_the_slots_is_flushed_at_its_next_load() {
    let m = tagged(2);
    let spaces: Vec<_> = (1..=ASID_SLOTS as u16 + 1)
        .map(|i| m.new_mm(asid(i)).unwrap())
        .collect();
    let cpu1 = m.cpu(1).unwrap();
    for s in &spaces {
        cpu1.switch_to(s).unwrap();
    }
    assert_eq!(m.stats().catch_ups, spaces.len() as u64, "every first load");
    // The last one took the slot of the first; the second is remembered.
    let before = m.stats().catch_ups;
    cpu1.switch_to(&spaces[1]).unwrap();
    assert_eq!(m.stats().catch_ups - before, 0, "remembered");
    cpu1.switch_to(&spaces[0]).unwrap();
    assert_eq!(m.stats().catch_ups - before, 1, "evicted: flushed again");
    assert_eq!(m.violations(), []);
}

/// A full local flush (a timer tick's `quiescent_flush` owing the pool, or
/// any flush of everything) catches up every ASID at once: the generation
/// is the machine's epoch, so the CPU's pass covers them all, remembered
/// or not.
#[test]
fn a_pass_catches_up_every_asid_at_once() {
    let m = tagged(2);
    let (a, b) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.switch_to(&a).unwrap();
    cpu1.switch_to(&b).unwrap();
    flush_tlb_mm(&cpu0, &a).unwrap();
    let mut everything = tlb_batch::FlushRequest::new();
    everything.add_everything();
    tlb_batch::shootdown(&cpu0, &tlb_batch::CpuSet::single(cpu1.id()), &everything).unwrap();
    let before = m.stats().catch_ups;
    cpu1.switch_to(&a).unwrap();
    assert_eq!(m.stats().catch_ups - before, 0, "the pass covered A");
    assert_eq!(m.violations(), []);
}

/// `flush_tlb_batched_pending` (contract rule 5) leaves out a CPU already
/// caught up past every deferral it covers: here the deferring batch's own
/// flush reached CPU 1, whose generation followed its step. Before that
/// flush, CPU 1 may still cache the page and is interrupted (its stale
/// entry gone afterwards); a deferral the kernel noted itself
/// (`note_batched_pending`, no generation known) interrupts it always.
#[test]
fn a_pending_batch_flush_skips_the_cpus_that_carried_out_the_deferrals() {
    for (batch_flushed_first, kernel_noted) in [(true, false), (false, false), (true, true)] {
        let m = tagged(2);
        let a = m.new_mm(asid(1)).unwrap();
        m.map_new(&a, va(0), true).unwrap();
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        cpu1.switch_to(&a).unwrap();
        cpu1.write(va(0), 1).unwrap();
        let mut batch = TlbFlushUnmapBatch::new();
        let old = m.clear_pte(&a, va(0)).unwrap();
        batch.add_pending(&cpu0, &a, va(0), old).unwrap();
        if kernel_noted {
            a.note_batched_pending();
        }
        if batch_flushed_first {
            assert_eq!(batch.flush(&cpu0).unwrap().ipis_sent, 1);
        }
        let before = m.ipis_sent();
        assert_eq!(tlb_batch::flush_tlb_batched_pending(&cpu0, &a), Ok(true));
        let expected = u64::from(!batch_flushed_first || kernel_noted);
        let case = format!("batch flushed first: {batch_flushed_first}, noted by the kernel: {kernel_noted}");
        assert_eq!(m.ipis_sent() - before, expected, "{case}");
        assert!(!a.batched_flush_pending(), "{case}");
        assert_eq!(
            cpu1.write(va(0), 2),
            Err(Fault::NotMapped { va: va(0) }),
            "{case}"
        );
        let _ = batch.flush(&cpu0).unwrap();
        assert_eq!(m.violations(), [], "{case}");
    }
}
