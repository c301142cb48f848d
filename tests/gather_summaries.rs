//! What a teardown reports (`TeardownSummary`): a failed call's counts
//! reported once, by the call that completes its work, and never in
//! another address space's summary; syncs and IPIs counted; summaries
//! added field by field.

mod common;

use common::gather::{finish_data, setup, tear_down, unmap_data};
use common::{asid, config, va};
use tlb_batch::arch::mock::{FrameState, MockKernel, MockMachine};
use tlb_batch::{Error, Frame, MmuGather, OwnedFrame, TableFreePolicy, TlbFlushUnmapBatch};

/// A teardown whose flush failed: `finish` reports what the failed call
/// did, the retry over the same range only what it did (nothing), and a
/// later teardown of another address space only its own pages.
#[test]
fn a_failed_teardowns_counts_are_reported_once_and_for_its_own_space() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (rmap, frames) = setup(&m, 0, 16, &[1]);
    let space = &rmap.spaces()[0];
    let other = m.space(&m.new_mm(asid(2)).unwrap());
    let lone = m.alloc_frame().unwrap();
    m.map(other.mm(), va(0), lone, true).unwrap();
    let mut kernel = MockKernel::new(&rmap);
    let cpu0 = m.cpu(0).unwrap();
    let mut gather = MmuGather::<64>::new();
    let range = common::pages(0, 16);
    let first = cpu0
        .in_shootdown(|| unmap_data(&mut gather, &cpu0, space, &mut kernel, range))
        .unwrap();
    assert!(matches!(first, Err(Error::ShootdownReentered { .. })));
    let collected = finish_data(&mut gather, &cpu0, space, &mut kernel).unwrap();
    let retried = unmap_data(&mut gather, &cpu0, space, &mut kernel, range).unwrap();
    let next = unmap_data(&mut gather, &cpu0, &other, &mut kernel, common::pages(0, 1)).unwrap();
    // A flush of a space no CPU runs reaches none.
    let single = |pages| tlb_batch::TeardownSummary {
        pages_unmapped: pages,
        data_freed: pages,
        flushes: 1,
        flushes_reaching_no_cpu: 1,
        data_free_calls: 1,
        ..Default::default()
    };
    // The failed call's flush reached CPU 1 only at `finish`.
    assert_eq!(
        collected,
        tlb_batch::TeardownSummary {
            ipis_sent: 1,
            flushes_reaching_no_cpu: 0,
            ..single(16)
        }
    );
    assert_eq!(retried, tlb_batch::TeardownSummary::default());
    assert_eq!(next, single(1));
    for f in frames.iter().chain([&lone]) {
        assert_eq!(m.frame_state(*f).unwrap(), FrameState::Free);
    }
    assert_eq!(m.violations(), []);
}

/// The kernel's batched free of a teardown that is part-way: at its first
/// call, CPU 1 starts running the address space and defers a flush of it,
/// so the teardown's next table lock needs a remote flush (contract rule 5)
/// — which fails here, with the gather's own work already completed.
struct StartsBatch<'r, 'm> {
    kernel: MockKernel<'r, 'm>,
    hook: Option<Box<dyn FnOnce() + 'r>>,
}

impl tlb_batch::FreeFrames for StartsBatch<'_, '_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        self.kernel.free_batch(frames);
        if let Some(hook) = self.hook.take() {
            hook();
        }
    }
}

impl tlb_batch::TeardownBacking for StartsBatch<'_, '_> {
    fn set_dirty(&mut self, frame: Frame) {
        tlb_batch::TeardownBacking::set_dirty(&mut self.kernel, frame)
    }
    fn free_tables<const N: usize>(&mut self, tables: &mut tlb_batch::heapless::Vec<OwnedFrame, N>) {
        self.kernel.free_tables(tables)
    }
}

/// A teardown that failed after all of its gathered work was completed
/// leaves an empty gather holding counts nobody collected: they belong to
/// that address space, so `finish` for it reports them, and a gather that
/// turns to another address space reports none of them.
#[test]
fn uncollected_counts_never_reach_another_address_spaces_summary() {
    for collect in [true, false] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let (rmap, _) = setup(&m, 0, 8, &[]);
        let mm = rmap.spaces()[0].mm().clone();
        let other = m.space(&m.new_mm(asid(2)).unwrap());
        let lone = m.alloc_frame().unwrap();
        m.map(other.mm(), va(0), lone, true).unwrap();
        let cpu0 = m.cpu(0).unwrap();
        let cpu1 = m.cpu(1).unwrap();
        let mut batch = TlbFlushUnmapBatch::new();
        let mut kernel = StartsBatch {
            kernel: MockKernel::new(&rmap),
            hook: Some(Box::new(|| {
                cpu1.switch_to(&mm).unwrap();
                cpu1.read(va(7)).unwrap();
                batch
                    .add_pending(&cpu1, &mm, va(7), tlb_batch::Pte::EMPTY)
                    .unwrap();
            })),
        };
        let mut gather = MmuGather::<4>::new();
        let space = &rmap.spaces()[0];
        let first = cpu0
            .in_shootdown(|| unmap_data(&mut gather, &cpu0, space, &mut kernel, common::pages(0, 8)))
            .unwrap();
        assert!(matches!(first, Err(Error::ShootdownReentered { .. })));
        assert!(gather.is_empty(), "the first four pages were completed");
        let half = tlb_batch::TeardownSummary {
            pages_unmapped: 4,
            data_freed: 4,
            flushes: 1,
            // No CPU runs the space.
            flushes_reaching_no_cpu: 1,
            data_free_calls: 1,
            ..Default::default()
        };
        let mut plain = MockKernel::new(&rmap);
        if collect {
            assert_eq!(finish_data(&mut gather, &cpu0, space, &mut plain), Ok(half));
        }
        let s = unmap_data(&mut gather, &cpu0, &other, &mut plain, common::pages(0, 1)).unwrap();
        assert_eq!(s.pages_unmapped, 1, "collect {collect}: {s:?}");
        drop(kernel);
        let _ = batch.flush(&cpu1).unwrap();
        assert_eq!(m.violations(), []);
    }
}

/// The counts a teardown reports for its IPI sync.
#[test]
fn a_teardown_counts_its_sync_and_the_ipis_it_sent() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (rmap, _) = setup(&m, 0, 2, &[1]);
    let mut kernel = MockKernel::new(&rmap);
    let (s, back) = tear_down::<_, 8>(
        &m,
        &rmap,
        &mut kernel,
        va(0),
        va(512),
        true,
        &mut TableFreePolicy::IpiSync,
    )
    .unwrap();
    assert!(back.is_empty());
    assert_eq!((s.flushes, s.syncs, s.tables_freed), (1, 1, 1));
    // One IPI for the flush (CPU 1 ran the space), two for the sync.
    assert_eq!(s.ipis_sent, 3);
    assert_eq!(m.ipis_sent(), 3);
}

#[test]
fn summaries_add_field_by_field_and_saturate() {
    let a = tlb_batch::TeardownSummary {
        pages_unmapped: 1,
        data_freed: 2,
        tables_freed: 3,
        tables_held: 2,
        flushes: 4,
        flushes_reaching_no_cpu: 3,
        data_free_calls: 5,
        table_free_calls: 6,
        syncs: 7,
        ipis_sent: usize::MAX,
    };
    let mut total = tlb_batch::TeardownSummary::default();
    total += a;
    assert_eq!(total, a);
    total += a;
    assert_eq!(
        total,
        tlb_batch::TeardownSummary {
            pages_unmapped: 2,
            data_freed: 4,
            tables_freed: 6,
            tables_held: 4,
            flushes: 8,
            flushes_reaching_no_cpu: 6,
            data_free_calls: 10,
            table_free_calls: 12,
            syncs: 14,
            ipis_sent: usize::MAX,
        }
    );
}
