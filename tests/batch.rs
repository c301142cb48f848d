//! TlbFlushUnmapBatch against the mock machine: when it defers, what a
//! flush costs, the ceiling, flush_dirty, the broadcast model, and the
//! oracle catching a skipped flush.

mod common;

use common::{asid, config, free_and_check, populate, unmap_deferred, va};
use tlb_batch::arch::mock::{BroadcastTlbi, MockConfig, MockMachine, NoRewalk, Violation};
use tlb_batch::{
    flush_tlb_page, Arch, Error, FlushReason, TlbFlushUnmapBatch, TtuFlags, DEFAULT_FULL_FLUSH_CEILING,
};

#[test]
fn defers_only_with_the_flag_and_a_remote_cpu() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (mm, _) = populate(&m, 1, 4, &[0], true);
    let cpu0 = m.cpu(0).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    // Only the current CPU runs it: a local flush is cheap, nothing to batch.
    assert!(!TlbFlushUnmapBatch::should_defer(
        &cpu0,
        &mm,
        TtuFlags::BATCH_FLUSH
    ));
    // Seen from another CPU, CPU 0 is remote.
    assert!(TlbFlushUnmapBatch::should_defer(
        &cpu1,
        &mm,
        TtuFlags::BATCH_FLUSH
    ));
    // Without the flag, never.
    assert!(!TlbFlushUnmapBatch::should_defer(&cpu1, &mm, TtuFlags::empty()));
    assert!(!TlbFlushUnmapBatch::should_defer(&cpu1, &mm, TtuFlags::MIGRATION));
    assert!(TlbFlushUnmapBatch::should_defer(
        &cpu1,
        &mm,
        TtuFlags::MIGRATION | TtuFlags::BATCH_FLUSH
    ));
    // Once CPU 0 switches away (untagged TLB) nobody else can cache it.
    let other = m.new_mm(asid(2)).unwrap();
    cpu0.switch_to(&other).unwrap();
    assert!(mm.cpus().is_empty());
    assert!(!TlbFlushUnmapBatch::should_defer(
        &cpu1,
        &mm,
        TtuFlags::BATCH_FLUSH
    ));
}

/// On a tagged TLB a CPU that switched away keeps its entries of the old
/// space, but leaves its CPU set: it is no target any more, and it flushes
/// the old ASID by generation before it loads the space again. The frame
/// may be freed meanwhile (contract rule 2's exact form), and the oracle
/// judges the entry at the load.
#[test]
fn tagged_tlbs_leave_a_switched_away_cpu_to_its_catch_up() {
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(2, 64)
    })
    .unwrap();
    let (mm, frames) = populate(&m, 1, 1, &[1], true);
    let cpu0 = m.cpu(0).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&m.new_mm(asid(2)).unwrap()).unwrap();
    // The entry survives the switch, but CPU 1 cannot use it.
    assert_eq!(m.cached_translations(frames[0]).len(), 1);
    assert!(mm.cpus().is_empty());
    assert!(!TlbFlushUnmapBatch::should_defer(
        &cpu0,
        &mm,
        TtuFlags::BATCH_FLUSH
    ));
    let old = m.clear_pte(&mm, va(0)).unwrap();
    let report = tlb_batch::flush_tlb_page(&cpu0, &mm, va(0)).unwrap();
    assert_eq!(report.ipis_sent, 0, "nobody runs the space");
    assert!(old.is_present());
    m.free_frame(frames[0]).unwrap();
    assert_eq!(m.violations(), [], "an entry of an ASID not loaded is unusable");
    let before = m.stats().catch_ups;
    cpu1.switch_to(&mm).unwrap();
    assert_eq!(
        m.stats().catch_ups - before,
        1,
        "CPU 1 flushed the space's ASID first"
    );
    assert!(m.cached_translations(frames[0]).is_empty());
    assert_eq!(m.violations(), []);
}

#[test]
fn never_defers_without_the_clean_write_rewalk() {
    let m = MockMachine::<NoRewalk>::with_model(config(4, 64)).unwrap();
    let (mm, _) = populate(&m, 1, 4, &[0, 1, 2, 3], true);
    let cpu0 = m.cpu(0).unwrap();
    assert!(mm.cached_elsewhere(&cpu0));
    assert!(!TlbFlushUnmapBatch::should_defer(
        &cpu0,
        &mm,
        TtuFlags::BATCH_FLUSH
    ));
}

#[test]
fn a_thousand_pages_on_eight_cpus_cost_one_ipi_per_other_cpu() {
    // Under Miri a thousand pages on eight CPUs take minutes to interpret;
    // 40 is still past the full-flush ceiling.
    const PAGES: usize = if cfg!(miri) { 40 } else { 1000 };
    let m = MockMachine::new(config(8, 64)).unwrap();
    let all: Vec<usize> = (0..8).collect();
    let (mm, frames) = populate(&m, 1, PAGES, &all, true);
    let cpu0 = m.cpu(0).unwrap();
    let before = m.stats();
    let ipis_before = m.ipis_sent();

    let mut batch = TlbFlushUnmapBatch::new();
    unmap_deferred(&m, &cpu0, &mm, 0..PAGES, &mut batch);
    assert_eq!(batch.pending_pages(), PAGES);
    assert!(batch.is_full_flush());
    assert!(batch.has_writable());
    assert_eq!(batch.targets().len(), 8);
    // Nothing was sent while deferring.
    assert_eq!(m.ipis_sent(), ipis_before);

    let report = batch.flush(&cpu0).unwrap();
    assert!(batch.is_empty());
    assert_eq!(report.remote_cpus, 7);
    assert_eq!(report.ipis_sent, 7);
    assert!(report.flushed_locally);
    let d = m.stats().since(&before);
    assert_eq!(d.ipis_sent, 7);
    assert_eq!(m.ipis_sent() - ipis_before, 7);
    assert_eq!(d.shootdowns, 1);
    assert_eq!(d.batches_flushed, 1);
    assert_eq!(d.pages_deferred, PAGES as u64);
    assert_eq!(d.flushes_received, 7);
    // Past the ceiling: one full flush per target, no single-page flushes.
    assert_eq!(d.local_full_flushes, 8);
    assert_eq!(d.local_page_flushes, 0);
    for c in 1..8 {
        assert_eq!(m.interrupts_taken(m.cpu(c).unwrap().id()).unwrap(), 1);
    }
    free_and_check(&m, frames);
}

#[test]
fn unbatched_flushes_cost_an_ipi_per_page_per_cpu() {
    // Each shootdown to seven CPUs takes seconds under Miri.
    const PAGES: usize = if cfg!(miri) { 10 } else { 100 };
    let m = MockMachine::new(config(8, 64)).unwrap();
    let all: Vec<usize> = (0..8).collect();
    let (mm, frames) = populate(&m, 1, PAGES, &all, true);
    let cpu0 = m.cpu(0).unwrap();
    let before = m.stats();
    for i in 0..PAGES {
        m.clear_pte(&mm, va(i)).unwrap();
        flush_tlb_page(&cpu0, &mm, va(i)).unwrap();
    }
    assert_eq!(m.stats().since(&before).ipis_sent, 7 * PAGES as u64);
    free_and_check(&m, frames);
}

#[test]
fn up_to_the_ceiling_pages_are_flushed_one_by_one() {
    let ceiling = DEFAULT_FULL_FLUSH_CEILING;
    for (pages, full) in [(ceiling, false), (ceiling + 1, true)] {
        let m = MockMachine::new(config(4, 256)).unwrap();
        let (mm, frames) = populate(&m, 1, pages, &[0, 1, 2, 3], true);
        let cpu0 = m.cpu(0).unwrap();
        let before = m.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        // In descending order, so that no two pages merge into one range.
        unmap_deferred(&m, &cpu0, &mm, (0..pages).rev(), &mut batch);
        assert_eq!(batch.is_full_flush(), full);
        batch.flush(&cpu0).unwrap();
        let d = m.stats().since(&before);
        if full {
            assert_eq!((d.local_page_flushes, d.local_full_flushes), (0, 4));
        } else {
            assert_eq!(
                (d.local_page_flushes, d.local_full_flushes),
                (4 * pages as u64, 0)
            );
        }
        assert_eq!(d.ipis_sent, 3);
        free_and_check(&m, frames);
    }
}

#[test]
fn flush_dirty_flushes_writable_batches_and_leaves_clean_ones_pending() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (ro, ro_frames) = populate(&m, 1, 3, &[1, 2], false);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    for i in 0..3 {
        let old = m.clear_pte(&ro, va(i)).unwrap();
        assert!(!old.is_writable() && !old.is_dirty());
        batch.add_pending(&cpu0, &ro, va(i), old).unwrap();
    }
    let before = m.stats();
    assert!(!batch.has_writable());
    assert_eq!(batch.flush_dirty(&cpu0).unwrap(), None);
    assert_eq!(m.stats().since(&before).ipis_sent, 0);
    assert!(!batch.is_empty(), "a clean-only batch stays pending");
    assert_eq!(m.cached_translations(ro_frames[0]).len(), 2);
    // A read-only stale entry does not stop I/O (nobody can write through it).
    m.start_io(ro_frames[0]).unwrap();
    m.end_io(ro_frames[0]).unwrap();
    assert_eq!(m.violations(), []);

    // Now a dirty page joins the batch: flush_dirty must flush everything.
    let rw = m.new_mm(asid(2)).unwrap();
    let f = m.map_new(&rw, va(0), true).unwrap();
    let cpu3 = m.cpu(3).unwrap();
    cpu3.switch_to(&rw).unwrap();
    cpu3.write(va(0), 7).unwrap();
    let old = m.clear_pte(&rw, va(0)).unwrap();
    assert!(old.is_dirty());
    batch.add_pending(&cpu0, &rw, va(0), old).unwrap();
    assert!(batch.has_writable());
    let report = batch
        .flush_dirty(&cpu0)
        .unwrap()
        .expect("a dirty batch is flushed");
    assert_eq!(report.ipis_sent, 3);
    assert!(batch.is_empty());
    m.start_io(f).unwrap();
    assert_eq!(m.stale_entries(), []);
    assert_eq!(m.violations(), []);
}

#[test]
fn an_empty_batch_sends_nothing() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(batch.flush(&cpu0).unwrap(), Default::default());
    assert_eq!(batch.flush_dirty(&cpu0).unwrap(), None);
    assert_eq!(m.stats(), Default::default());
    assert_eq!(m.ipis_sent(), 0);
}

#[test]
fn broadcast_hardware_flushes_a_batch_without_any_ipi() {
    let m = MockMachine::<BroadcastTlbi>::with_model(config(4, 64)).unwrap();
    let (mm, frames) = populate(&m, 1, 50, &[0, 1, 2, 3], true);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    unmap_deferred(&m, &cpu0, &mm, 0..50, &mut batch);
    assert!(!m.stale_entries().is_empty(), "stale entries before the flush");
    let report = batch.flush(&cpu0).unwrap();
    assert!(report.broadcast);
    assert_eq!(report.ipis_sent, 0);
    assert_eq!(m.ipis_sent(), 0);
    assert_eq!(m.stats().ipis_sent, 0);
    assert!(m.costs().broadcast > 0);
    assert_eq!(m.costs().ipi_send + m.costs().ipi_receive, 0);
    free_and_check(&m, frames);
}

/// The oracle is itself under test: skipping the flush must be caught.
#[test]
fn the_oracle_catches_a_write_through_a_stale_entry_when_the_flush_is_skipped() {
    for skip_flush in [true, false] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let (mm, frames) = populate(&m, 1, 1, &[0, 1], true);
        let cpu0 = m.cpu(0).unwrap();
        let cpu1 = m.cpu(1).unwrap();
        let mut batch = TlbFlushUnmapBatch::new();
        let old = m.clear_pte(&mm, va(0)).unwrap();
        batch.add_pending(&cpu0, &mm, va(0), old).unwrap();
        if !skip_flush {
            batch.flush(&cpu0).unwrap();
        }
        m.free_frame(frames[0]).unwrap();
        let write = cpu1.write(va(0), 0xdead);
        if skip_flush {
            // CPU 1's dirty writable entry survived: the write lands in a
            // free frame, and both the free and the write are reported.
            assert_eq!(write, Ok(()));
            let v = m.violations();
            assert!(v.contains(&Violation::FreedWhileCached {
                frame: frames[0],
                cpu: cpu1.id(),
                writable: true
            }));
            assert!(v.contains(&Violation::WriteToFreeFrame {
                cpu: cpu1.id(),
                frame: frames[0],
                va: va(0)
            }));
        } else {
            assert!(write.is_err());
            assert_eq!(m.violations(), []);
        }
        let _ = batch.flush(&cpu0);
    }
}

#[test]
fn every_flush_is_traced_with_its_reason() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (mm, _) = populate(&m, 1, 2, &[0, 1, 2], true);
    let cpu0 = m.cpu(0).unwrap();
    m.set_tracing(true);
    let mut batch = TlbFlushUnmapBatch::new();
    for i in 0..2 {
        let old = m.clear_pte(&mm, va(i)).unwrap();
        batch.add_pending(&cpu0, &mm, va(i), old).unwrap();
    }
    batch.flush(&cpu0).unwrap();
    let reasons: Vec<_> = m.take_trace().iter().map(|e| (e.cpu.index(), e.reason)).collect();
    assert_eq!(
        reasons,
        [
            (0, FlushReason::RemoteSendIpi),
            (1, FlushReason::RemoteShootdown),
            (2, FlushReason::RemoteShootdown),
            (0, FlushReason::LocalShootdown),
        ]
    );
    m.cpu(1).unwrap().switch_to(&m.new_mm(asid(2)).unwrap()).unwrap();
    assert_eq!(m.take_trace()[0].reason, FlushReason::TaskSwitch);
}

#[test]
fn bad_input_is_an_error_and_changes_nothing() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (mm, _) = populate(&m, 1, 1, &[0, 1], true);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let old = m.clear_pte(&mm, va(0)).unwrap();
    assert_eq!(
        batch.add_pending(&cpu0, &mm, va(0) + 8, old),
        Err(Error::Unaligned { addr: va(0) + 8 })
    );
    assert!(batch.is_empty());
    assert!(!mm.batched_flush_pending());
    assert!(matches!(m.cpu(2), Err(Error::CpuOutOfRange { cpu: 2, limit: 2 })));
    assert!(MockMachine::new(config(0, 64)).is_err());
    assert!(MockMachine::new(config(tlb_batch::MAX_CPUS + 1, 64)).is_err());
    // Widths no hardware has (a new user's trial built machines with
    // these): refused, not clamped or run.
    for (va_bits, asid_bits) in [
        (0, 12),
        (13, 12),
        (31, 12),
        (65, 12),
        (200, 12),
        (48, 17),
        (48, 64),
    ] {
        let refused = MockMachine::new(MockConfig {
            va_bits,
            asid_bits,
            ..config(2, 64)
        });
        assert!(
            matches!(refused, Err(Error::FeatureUnavailable { supported: false, .. })),
            "va_bits {va_bits}, asid_bits {asid_bits}"
        );
    }
    for (va_bits, asid_bits) in [(32, 0), (39, 8), (48, 12), (57, 16), (64, 16)] {
        let built = MockMachine::new(MockConfig {
            va_bits,
            asid_bits,
            ..config(2, 64)
        });
        assert!(built.is_ok(), "va_bits {va_bits}, asid_bits {asid_bits}");
    }
    assert_eq!(
        tlb_batch::PageRange::from_bounds(va(2), va(1)),
        Err(Error::InvalidRange {
            start: va(2),
            end: va(1)
        })
    );
    assert_eq!(cpu0.online_cpus().len(), 2);
}

/// A deferred PTE that allowed writes counts as writable even when it was
/// clean: `flush_dirty` must flush before the page goes to I/O.
#[test]
fn a_clean_writable_deferral_makes_the_batch_writable() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (mm, _) = populate(&m, 1, 2, &[0, 1], false);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let clean_writable = tlb_batch::Pte::new(
        tlb_batch::Frame(1),
        tlb_batch::PteFlags::PRESENT | tlb_batch::PteFlags::WRITABLE,
    );
    let read_only = tlb_batch::Pte::new(tlb_batch::Frame(2), tlb_batch::PteFlags::PRESENT);
    batch.add_pending(&cpu0, &mm, va(0), read_only).unwrap();
    assert!(!batch.has_writable());
    batch.add_pending(&cpu0, &mm, va(1), clean_writable).unwrap();
    assert!(
        batch.has_writable(),
        "a clean writable entry may still take a write"
    );
    assert!(batch.flush_dirty(&cpu0).unwrap().is_some());
}

/// A CPU recorded as a target when a page was added, that has switched
/// away (or gone lazy) by the time the batch is flushed, is not
/// interrupted: the add advanced the space's generation, so it flushes the
/// ASID before it uses the space again. The frame is freed in between,
/// and the oracle judges the CPU at its return. On untagged and tagged
/// TLBs, switched away or lazy.
#[test]
fn a_target_that_left_before_the_flush_gets_no_ipi() {
    for (tagged, lazy) in [(false, false), (true, false), (false, true), (true, true)] {
        let m = MockMachine::new(MockConfig {
            tagged_tlb: tagged,
            ..config(2, 64)
        })
        .unwrap();
        let (mm, frames) = populate(&m, 1, 1, &[0, 1], true);
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        let mut batch = TlbFlushUnmapBatch::new();
        let old = m.clear_pte(&mm, va(0)).unwrap();
        batch.add_pending(&cpu0, &mm, va(0), old).unwrap();
        assert!(batch.targets().contains(cpu1.id()));
        if lazy {
            cpu1.enter_lazy().unwrap();
        } else {
            cpu1.switch_to(&m.new_mm(asid(2)).unwrap()).unwrap();
        }
        let report = batch.flush(&cpu0).unwrap();
        assert_eq!(report.ipis_sent, 0, "tagged: {tagged}, lazy: {lazy}");
        m.free_frame(frames[0]).unwrap();
        assert_eq!(m.violations(), []);
        cpu1.switch_to(&mm).unwrap();
        assert!(m.cached_translations(frames[0]).is_empty());
        assert_eq!(m.violations(), [], "tagged: {tagged}, lazy: {lazy}");
    }
}
