//! Regression tests for the paths where the contract used to break, part
//! three: hostile input to every entry point (the last page of the address
//! space, non-canonical addresses, ranges a machine cannot address, ASIDs
//! wider than the hardware's, sparse ranges), and a kernel page table with
//! split locks. Every test checks the oracle: a test passes only when the
//! simulated machine saw no violation and no stale entry where the contract
//! forbids one.

// The drivers return their retry values by value.
#![allow(clippy::result_large_err)]

mod common;

use std::cell::Cell;
use std::ops::ControlFlow;
use std::sync::Arc;

use common::{asid, config, owned, pages, va};
use tlb_batch::arch::mock::{CountingTable, MockError, MockKernel, MockMachine, MockRmap, MockSpace};
use tlb_batch::{
    change_protection, flush_tlb_mm, flush_tlb_page, flush_tlb_range, page_referenced, shootdown, switch_mm,
    try_to_unmap, Asid, CpuSet, Error, FlushRequest, Frame, Mapping, MappingFlags, MmTlbState, MmuGather,
    PageRange, PageTable, Pte, PteFlags, Rmap, SwapResult, TableFreePolicy, TlbFlushUnmapBatch, TtuFlags,
    UnmapBatch, PAGE_SIZE,
};

/// The last page of the 64-bit address space (canonical: upper half).
const TOP: u64 = 0xffff_ffff_ffff_f000;
use common::soundness::{rmap_of, touch};

// ----- Hostile input -----

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
    // middle of the address space is canonical. Its upper part is the
    // kernel's half all the same, which a user space's flush would not
    // reach on the CPUs running other spaces: refused for a user space,
    // flushed for the kernel's.
    let wide = MockMachine::new(tlb_batch::arch::mock::MockConfig {
        va_bits: 64,
        ..config(2, 64)
    })
    .unwrap();
    let mm = wide.new_mm(asid(1)).unwrap();
    let cpu0 = wide.cpu(0).unwrap();
    let middle = PageRange::new((1 << 63) - 20 * PAGE_SIZE, long).unwrap();
    assert_eq!(
        flush_tlb_range(&cpu0, &mm, middle).err(),
        Some(Error::KernelHalf { va: 1 << 63 })
    );
    assert_eq!(wide.ipis_sent(), 0);
    assert!(flush_tlb_range(&cpu0, wide.kernel_mm(), middle).is_ok());
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

// ----- Split page-table locks -----

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
