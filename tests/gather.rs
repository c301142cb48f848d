//! Range teardown: one flush per range, data and page-table frames freed in
//! one batched call per batch, table-free policies against a lockless
//! walker, bad input, and refused frees.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::gather::{setup, tear_down};
use common::{asid, config, va, within};
use tlb_batch::arch::mock::{BroadcastTlbi, Fault, FrameState, MockKernel, MockMachine, MockRmap, Violation};
use tlb_batch::{
    Error, Frame, FrameKind, MappingFlags, MmuGather, PageGather, TableFreePolicy, TlbFlushUnmapBatch,
    TtuFlags,
};

#[test]
fn a_range_is_flushed_once_and_its_frames_freed_in_one_call() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, frames) = setup(&m, 0, 20, &[1, 2, 3]);
    let mut kernel = MockKernel::new(&rmap);
    let before = m.stats();
    let (s, back) = tear_down::<_, 64>(
        &m,
        &rmap,
        &mut kernel,
        va(0),
        va(20),
        false,
        &mut TableFreePolicy::AfterFlush,
    )
    .unwrap();
    assert!(back.is_empty());
    assert_eq!(
        (s.pages_unmapped, s.data_freed, s.flushes, s.data_free_calls),
        (20, 20, 1, 1)
    );
    assert_eq!(s.ipis_sent, 3);
    let d = m.stats().since(&before);
    // 20 pages are under the ceiling: three CPUs invalidate them one by one.
    assert_eq!((d.local_page_flushes, d.local_full_flushes), (60, 0));
    for (i, &f) in frames.iter().enumerate() {
        assert_eq!(m.frame_state(f).unwrap(), FrameState::Free);
        assert_eq!(
            m.frame_dirty(f).unwrap(),
            i % 2 == 0,
            "dirty bit moved to the frame"
        );
    }
    assert_eq!(m.stale_entries(), []);
    assert_eq!(m.violations(), []);
}

#[test]
fn above_the_ceiling_the_range_becomes_one_full_flush() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (rmap, _) = setup(&m, 0, 40, &[1, 2, 3]);
    let mut kernel = MockKernel::new(&rmap);
    let before = m.stats();
    let (s, _) = tear_down::<_, 64>(
        &m,
        &rmap,
        &mut kernel,
        va(0),
        va(40),
        false,
        &mut TableFreePolicy::AfterFlush,
    )
    .unwrap();
    assert_eq!((s.flushes, s.ipis_sent), (1, 3));
    let d = m.stats().since(&before);
    assert_eq!((d.local_page_flushes, d.local_full_flushes), (0, 3));
    assert_eq!(m.stale_entries(), []);
    assert_eq!(m.violations(), []);
}

#[test]
fn a_full_batch_is_flushed_and_freed_mid_way() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, _) = setup(&m, 0, 20, &[1]);
    let mut kernel = MockKernel::new(&rmap);
    let (s, back) = tear_down::<_, 8>(
        &m,
        &rmap,
        &mut kernel,
        va(0),
        va(20),
        false,
        &mut TableFreePolicy::AfterFlush,
    )
    .unwrap();
    assert!(back.is_empty());
    assert_eq!((s.data_freed, s.flushes, s.data_free_calls), (20, 3, 3));
    assert_eq!(kernel.free_calls, 3);
    assert_eq!(m.violations(), []);
}

#[test]
fn emptied_page_tables_are_freed_in_one_batched_call() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let rmap = MockRmap::new(&m, vec![m.space(&m.new_mm(asid(1)).unwrap())]);
    // One page in each of four 512-page regions (leaf tables).
    let pages = [0, 512, 1024, 1536];
    for &p in &pages {
        rmap.map(m.alloc_frame().unwrap(), 0, va(p), true, MappingFlags::empty())
            .unwrap();
    }
    let mm = rmap.spaces()[0].mm().clone();
    let tables: Vec<Frame> = pages.iter().map(|&p| m.leaf_table(&mm, va(p)).unwrap()).collect();
    let mut kernel = MockKernel::new(&rmap);
    // The range covers the first three regions whole.
    let (s, back) = tear_down::<_, 64>(
        &m,
        &rmap,
        &mut kernel,
        va(0),
        va(1536),
        true,
        &mut TableFreePolicy::AfterFlush,
    )
    .unwrap();
    assert!(back.is_empty());
    assert_eq!(
        (s.tables_freed, s.table_free_calls),
        (3, 1),
        "three tables, one call"
    );
    assert_eq!(kernel.table_free_calls, 1);
    for &t in &tables[..3] {
        assert_eq!(m.frame_state(t).unwrap(), FrameState::Free);
    }
    // The fourth region is outside the range: its table and page stay.
    assert_eq!(m.leaf_table(&mm, va(1536)), Some(tables[3]));
    assert!(m.pte(&mm, va(1536)).unwrap().is_present());
    assert_eq!(m.violations(), []);
}

/// CPU 1 walks the table locklessly (interrupts off) while CPU 0 tears the
/// range down on broadcast-invalidation hardware, where the flush itself
/// interrupts nobody. Returns the violations the oracle saw.
fn teardown_under_a_lockless_walker(policy: &str) -> Vec<Violation> {
    let m = MockMachine::<BroadcastTlbi>::with_model(config(2, 64).threaded()).unwrap();
    let (rmap, _) = setup(&m, 0, 1, &[]);
    let walking = AtomicBool::new(false);
    let freed = AtomicBool::new(false);
    m.run_threaded(|cpu| {
        if cpu.id().index() == 1 {
            cpu.switch_to(rmap.spaces()[0].mm()).unwrap();
            let walk = cpu.begin_lockless_walk(va(0)).unwrap();
            walking.store(true, Ordering::SeqCst);
            // Walk until the teardown says it freed the table, or for a
            // while: a correct policy waits for this walk to end.
            let deadline = Instant::now() + Duration::from_millis(150);
            while !freed.load(Ordering::SeqCst) && Instant::now() < deadline {
                let _ = walk.read(va(0));
                std::thread::yield_now();
            }
            drop(walk);
            return;
        }
        while !walking.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        let mut kernel = MockKernel::new(&rmap);
        let mut grace = || m.wait_for_walkers(&cpu);
        let mut policy = match policy {
            "after flush" => TableFreePolicy::AfterFlush,
            "IPI sync" => TableFreePolicy::IpiSync,
            _ => TableFreePolicy::GracePeriod(&mut grace),
        };
        let mut gather = PageGather::new();
        let s = gather
            .unmap_range(
                &cpu,
                &rmap.spaces()[0],
                &mut kernel,
                common::pages(0, 512),
                true,
                &mut policy,
                &mut |_, _| panic!("nothing is refused"),
            )
            .unwrap();
        assert_eq!(s.tables_freed, 1);
        freed.store(true, Ordering::SeqCst);
    });
    m.violations()
}

#[test]
fn freeing_tables_right_after_the_flush_is_caught_under_a_lockless_walker() {
    within(60, || {
        let v = teardown_under_a_lockless_walker("after flush");
        assert!(
            matches!(v.as_slice(), [Violation::TableFreedUnderWalker { cpu, .. }] if cpu.index() == 1),
            "{v:?}"
        );
    });
}

#[test]
fn ipi_sync_and_grace_period_wait_out_the_lockless_walker() {
    within(60, || {
        assert_eq!(teardown_under_a_lockless_walker("IPI sync"), []);
        assert_eq!(teardown_under_a_lockless_walker("grace period"), []);
    });
}

#[test]
fn bad_ranges_are_errors_and_change_nothing() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, frames) = setup(&m, 0, 4, &[1]);
    let mut kernel = MockKernel::new(&rmap);
    let mut p = TableFreePolicy::AfterFlush;
    assert_eq!(
        tear_down::<_, 8>(&m, &rmap, &mut kernel, va(0) + 1, va(4), true, &mut p).err(),
        Some(Error::Unaligned { addr: va(0) + 1 })
    );
    assert_eq!(
        tear_down::<_, 8>(&m, &rmap, &mut kernel, va(4), va(0), true, &mut p).err(),
        Some(Error::InvalidRange {
            start: va(4),
            end: va(0)
        })
    );
    let mm = rmap.spaces()[0].mm();
    assert!(frames
        .iter()
        .enumerate()
        .all(|(i, &f)| m.pte(mm, va(i)).unwrap().maps(f)));
    assert_eq!(kernel.free_calls + kernel.table_free_calls, 0);
}

#[test]
fn frames_and_tables_the_allocator_refuses_come_back() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, frames) = setup(&m, 0, 4, &[1]);
    let table = m.leaf_table(rmap.spaces()[0].mm(), va(0)).unwrap();
    let mut kernel = MockKernel::new(&rmap);
    kernel.refuse_frees = true;
    kernel.refuse_table_frees = true;
    let (s, mut back) = tear_down::<_, 8>(
        &m,
        &rmap,
        &mut kernel,
        va(0),
        va(512),
        true,
        &mut TableFreePolicy::AfterFlush,
    )
    .unwrap();
    assert_eq!((s.data_freed, s.tables_freed), (0, 0));
    back.sort();
    let mut expected: Vec<_> = frames.iter().map(|&f| (f, FrameKind::Data)).collect();
    expected.push((table, FrameKind::Table));
    expected.sort();
    assert_eq!(back, expected, "every refused frame handed back");
    assert!(back
        .iter()
        .all(|(f, _)| m.frame_state(*f).unwrap() == FrameState::InUse));
    // Unmapped and flushed all the same.
    assert_eq!(m.stale_entries(), []);
    assert_eq!(m.violations(), []);
}

#[test]
fn munmap_flushes_a_pending_batched_flush_first() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = setup(&m, 0, 2, &[1]);
    let mm = rmap.spaces()[0].mm().clone();
    // A reclaimer on CPU 2 unmapped page 0 and deferred the flush.
    let mut batch = TlbFlushUnmapBatch::new();
    let r = tlb_batch::try_to_unmap(
        &m.cpu(2).unwrap(),
        &rmap,
        frames[0],
        TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS,
        &mut batch,
    )
    .unwrap();
    assert!(r.is_cached() && mm.batched_flush_pending());
    // munmap of the whole range finds page 0 already gone, yet must not
    // return while CPU 1 can still write it.
    let mut kernel = MockKernel::new(&rmap);
    tear_down::<_, 8>(
        &m,
        &rmap,
        &mut kernel,
        va(0),
        va(2),
        false,
        &mut TableFreePolicy::AfterFlush,
    )
    .unwrap();
    assert!(!mm.batched_flush_pending());
    assert_eq!(m.check_coherent(&mm, common::pages(0, 2)), 0);
    assert!(m.cpu(1).unwrap().write(va(0), 1).is_err());
    batch.flush(&m.cpu(2).unwrap()).unwrap();
    assert_eq!(m.violations(), []);
}

/// A leaf table whose pages were all unmapped earlier still sits in the
/// walk cache of a CPU that touched the range since (a walk that faults
/// caches the pointer too). Tearing the range down frees the table: its
/// whole range must be flushed first, although no page in it is present.
#[test]
fn a_table_with_nothing_mapped_is_flushed_before_it_is_freed() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = setup(&m, 0, 2, &[1, 2]);
    let mm = rmap.spaces()[0].mm().clone();
    let cpu0 = m.cpu(0).unwrap();
    // Everything unmapped and flushed, the frames freed.
    for (i, &f) in frames.iter().enumerate() {
        m.clear_pte(&mm, va(i)).unwrap();
        tlb_batch::flush_tlb_page(&cpu0, &mm, va(i)).unwrap();
        rmap.remove_frame(f);
        m.free_frame(f).unwrap();
    }
    // CPU 1 touches the range again: a fault, but its walk cache now
    // points at the leaf table.
    assert!(m.cpu(1).unwrap().read(va(0)).is_err());
    let mut kernel = MockKernel::new(&rmap);
    let (s, back) = tear_down::<_, 64>(
        &m,
        &rmap,
        &mut kernel,
        va(0),
        va(512),
        true,
        &mut TableFreePolicy::AfterFlush,
    )
    .unwrap();
    assert!(back.is_empty());
    assert_eq!((s.pages_unmapped, s.tables_freed), (0, 1));
    assert_eq!(
        m.violations(),
        [],
        "the table's range was flushed before it was freed"
    );
}

/// A page of Linux's size holds 510 frame pointers beside its header.
#[test]
fn a_page_batch_holds_what_fits_in_one_page() {
    assert_eq!(tlb_batch::PAGE_BATCH, 510);
}

/// The IPI sync before freeing tables fails (it is started from an
/// interrupt nested in a shootdown) after the range's flush went through
/// (no CPU ran the address space, so it needed no IPI): the data frames are
/// freed, the tables stay in the gather, which is not empty, and the
/// address space owes no flush. `finish` frees the tables after its own
/// sync.
#[test]
fn a_failed_ipi_sync_keeps_the_tables_and_owes_no_flush() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, frames) = setup(&m, 0, 2, &[]);
    let mm = rmap.spaces()[0].mm().clone();
    let mut kernel = MockKernel::new(&rmap);
    let cpu0 = m.cpu(0).unwrap();
    let mut gather = MmuGather::<8>::new();
    let first = cpu0
        .in_shootdown(|| {
            gather.unmap_range(
                &cpu0,
                &rmap.spaces()[0],
                &mut kernel,
                common::pages(0, 512),
                true,
                &mut TableFreePolicy::IpiSync,
                &mut |_, _| panic!("nothing refused"),
            )
        })
        .unwrap();
    assert!(matches!(first, Err(Error::ShootdownReentered { .. })));
    for &f in &frames {
        assert_eq!(m.frame_state(f).unwrap(), FrameState::Free);
    }
    assert!(!gather.is_empty(), "the table waits for its sync");
    assert!(!mm.batched_flush_pending(), "nothing cleared is left unflushed");
    assert_eq!(kernel.table_free_calls, 0);
    let s = gather
        .finish(
            &cpu0,
            &rmap.spaces()[0],
            &mut kernel,
            &mut TableFreePolicy::IpiSync,
            &mut |_, _| panic!("nothing refused"),
        )
        .unwrap();
    assert!(gather.is_empty());
    assert_eq!(kernel.table_free_calls, 1);
    assert_eq!(m.ipis_sent(), 2, "the sync interrupted both other CPUs");
    // `finish` reports the failed call's work and its own, once.
    let whole = tlb_batch::TeardownSummary {
        pages_unmapped: 2,
        data_freed: 2,
        tables_freed: 1,
        tables_held: 0,
        // No CPU runs the space: the flush reached none (the sync did).
        flushes: 1,
        flushes_reaching_no_cpu: 1,
        data_free_calls: 1,
        table_free_calls: 1,
        syncs: 1,
        ipis_sent: 2,
    };
    assert_eq!(s, whole);
    let again = gather.finish(
        &cpu0,
        &rmap.spaces()[0],
        &mut kernel,
        &mut TableFreePolicy::IpiSync,
        &mut |_, _| panic!("nothing refused"),
    );
    assert_eq!(again, Ok(tlb_batch::TeardownSummary::default()));
    assert_eq!(m.violations(), []);
}

/// A lockless walk on a machine with synchronous delivery (the default)
/// is refused: interrupts held off are not modelled there, so an IPI sync
/// would return while the walk still runs (a new user's trial: `Ok`, then
/// `TableFreedUnderWalker`). Nothing starts.
#[test]
fn a_lockless_walk_needs_threaded_delivery() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let _mapped = setup(&m, 0, 1, &[1]);
    let cpu1 = m.cpu(1).unwrap();
    let refused = cpu1.begin_lockless_walk(va(0));
    assert!(matches!(refused, Err(Fault::SynchronousDelivery)));
    assert!(cpu1.interrupts_enabled());
    assert!(m.lockless_walkers().is_empty());
}
