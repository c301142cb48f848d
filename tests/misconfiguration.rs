//! Set-ups under which a flush would miss a CPU that may hold entries are
//! refused with a typed error, with nothing changed, never a silent `Ok`:
//! a crate call on a CPU that is not online, a root loaded without
//! `switch_mm`, a second `MmTlbState` for a root the CPU runs, and a CPU
//! that `Arch::current_cpu` cannot tell. Each test also shows the frame
//! was not freed under the stale entry, and that the right set-up works.
mod common;

use common::{asid, config, va};
use tlb_batch::arch::mock::{
    FrameState, MockConfig, MockCpu, MockError, MockKernel, MockMachine, MockRmap, X86Like,
};
use tlb_batch::{
    check_cpu_state, flush_tlb_mm, flush_tlb_page, handle_flush_ipi, page_referenced, quiescent_flush,
    shootdown, shrink_page_list, switch_mm, try_to_unmap, Arch, Asid, CpuId, CpuSet, Error, FlushRequest,
    Frame, FramePool, MappingFlags, MmTlbState, MmuGather, PageRange, Pte, PteFlags, Rmap, TableFreePolicy,
    TlbFlushUnmapBatch, TlbShootdown, TraceEvent, TtuFlags, UnmapBatch, Verdict,
};

/// One address space with one mapped page (page 0), in an rmap.
fn one_page(m: &MockMachine<X86Like>) -> (MockRmap<'_, X86Like>, Frame) {
    let rmap = MockRmap::new(m, vec![m.space(&m.new_mm(asid(1)).unwrap())]);
    let f = m.alloc_frame().unwrap();
    rmap.map(f, 0, va(0), true, MappingFlags::empty()).unwrap();
    (rmap, f)
}

/// Every way the crate could flush (or defer a flush of) page 0 of
/// `rmap`'s space, called on `cpu`: each must fail with `expected` and
/// leave the PTE, the frame and the batch as they were.
fn every_flush_is_refused<A: Arch>(
    m: &MockMachine<X86Like>,
    rmap: &MockRmap<'_, X86Like>,
    f: Frame,
    cpu: &A,
    expected: Error,
) {
    let space = &rmap.spaces()[0];
    let mm = space.mm();
    // Young, so that an aging that went ahead would show.
    let young = m.pte(mm, va(0)).unwrap();
    m.set_pte(mm, va(0), Pte::new(f, young.flags() | PteFlags::ACCESSED))
        .unwrap();
    let pte = m.pte(mm, va(0)).unwrap();
    let aged = rmap.aged_epoch(f);
    assert_eq!(
        flush_tlb_page(cpu, mm, va(0)).unwrap_err(),
        expected,
        "flush_tlb_page"
    );
    assert_eq!(flush_tlb_mm(cpu, mm).unwrap_err(), expected, "flush_tlb_mm");
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(
            cpu,
            rmap,
            f,
            TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS,
            &mut batch
        )
        .unwrap_err(),
        expected,
        "try_to_unmap"
    );
    assert!(batch.is_empty());
    let mut frames = UnmapBatch::<4>::new();
    assert!(frames
        .try_to_unmap(cpu, rmap, common::owned(f), TtuFlags::IGNORE_ACCESS)
        .is_err());
    let mut kernel = MockKernel::new(rmap);
    let mut gather = MmuGather::<8>::new();
    let torn = gather.unmap_range(
        cpu,
        space,
        &mut kernel,
        PageRange::page(va(0)).unwrap(),
        true,
        &mut TableFreePolicy::AfterFlush,
        &mut |_, _| panic!("nothing handed back"),
    );
    assert_eq!(torn.unwrap_err(), expected, "MmuGather::unmap_range");
    assert!(gather.is_empty());
    assert_eq!(
        tlb_batch::change_protection(cpu, space, PageRange::page(va(0)).unwrap(), |p| p).unwrap_err(),
        expected,
        "change_protection"
    );
    // Aging stores an epoch the pool trusts for every CPU: refused before
    // it clears anything, directly or inside reclaim.
    let mut unused = TlbFlushUnmapBatch::new();
    assert_eq!(
        page_referenced(cpu, rmap, f, &mut unused).unwrap_err(),
        expected,
        "page_referenced"
    );
    let mut kernel = MockKernel::new(rmap);
    let mut back = Vec::new();
    let reclaimed = shrink_page_list(
        cpu,
        rmap,
        &mut kernel,
        &mut UnmapBatch::<4>::new(),
        [common::owned(f)],
        &mut |frame, verdict| back.push((frame.into_frame(), verdict)),
    )
    .unwrap();
    assert_eq!(back, [(f, Verdict::Failed(expected))], "shrink_page_list");
    assert_eq!((reclaimed.freed, reclaimed.shootdowns), (0, 0));
    // Nothing changed: the page is mapped as before (still young), its
    // frame in use, its aging epoch as it was.
    assert_eq!(m.pte(mm, va(0)).unwrap(), pte);
    assert_eq!(rmap.aged_epoch(f), aged);
    assert_eq!(m.frame_state(f).unwrap(), FrameState::InUse);
}

#[test]
fn a_cpu_that_is_not_online_cannot_flush_defer_or_load_a_user_space() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let (rmap, f) = one_page(&m);
    let mm = rmap.spaces()[0].mm();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(mm).unwrap();
    cpu1.read(va(0)).unwrap();
    cpu1.go_offline();
    assert!(!m.online().contains(cpu1.id()));
    let expected = Error::CpuNotOnline { cpu: 1 };
    every_flush_is_refused(&m, &rmap, f, &cpu1, expected);
    // A shootdown from it would skip its own TLB (the online set clips it).
    let req = FlushRequest::for_asid(mm.asid());
    assert_eq!(shootdown(&cpu1, &CpuSet::single(cpu1.id()), &req), Err(expected));
    assert_eq!(tlb_batch::ipi_sync(&cpu1).unwrap_err(), expected);
    // Loading a user space there would hide it from every flush of it.
    let other = m.new_mm(asid(2)).unwrap();
    // SAFETY: the mock's roots are its own tables; the call is refused.
    assert_eq!(unsafe { switch_mm(&cpu1, Some(mm), &other) }, Err(expected));
    assert!(other.cpus().is_empty());
    // Online again, the same calls work, and the page goes.
    cpu1.come_online();
    cpu1.switch_to(mm).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let _ = try_to_unmap(
        &cpu1,
        &rmap,
        f,
        TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS,
        &mut batch,
    )
    .unwrap();
    batch.flush(&cpu1).unwrap();
    common::free_and_check(&m, vec![f]);
}

#[test]
fn a_root_loaded_without_switch_mm_is_refused_and_found_by_the_debug_check() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let (rmap, f) = one_page(&m);
    let mm = rmap.spaces()[0].mm();
    let cpu0 = m.cpu(0).unwrap();
    // The kernel loads the root itself: the crate does not know CPU 0 runs it.
    // SAFETY: the root is the mock's own table for `mm`.
    unsafe { cpu0.switch_address_space(mm.asid(), mm.root()) };
    cpu0.read(va(0)).unwrap();
    assert!(mm.cpus().is_empty());
    every_flush_is_refused(&m, &rmap, f, &cpu0, Error::UntrackedRoot { cpu: 0 });
    assert_eq!(check_cpu_state(&cpu0, mm), Err(Error::UntrackedRoot { cpu: 0 }));
    // Another CPU may still tear the space down: it does not run it, and
    // the refusal is about the caller. The debug check finds CPU 0 there
    // only when CPU 0 runs it; the flush it would miss is shown by the
    // oracle below, through the right path instead.
    cpu0.switch_to(mm).unwrap();
    assert_eq!(check_cpu_state(&cpu0, mm), Ok(()));
    let mut batch = TlbFlushUnmapBatch::new();
    let _ = try_to_unmap(
        &cpu0,
        &rmap,
        f,
        TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS,
        &mut batch,
    )
    .unwrap();
    batch.flush(&cpu0).unwrap();
    common::free_and_check(&m, vec![f]);
}

#[test]
fn a_second_state_for_a_loaded_root_is_refused() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let (rmap, f) = one_page(&m);
    let mm = rmap.spaces()[0].mm();
    let cpu0 = m.cpu(0).unwrap();
    cpu0.switch_to(mm).unwrap();
    cpu0.read(va(0)).unwrap();
    // A kernel that builds a fresh state for the root it runs (same ASID,
    // same root): the fresh one's CPU set is empty, so its flushes would
    // skip CPU 0.
    let twin = MmTlbState::new(mm.asid(), mm.root());
    assert_eq!(
        flush_tlb_page(&cpu0, &twin, va(0)),
        Err(Error::UntrackedRoot { cpu: 0 })
    );
    assert_eq!(
        check_cpu_state(&cpu0, &twin),
        Err(Error::UntrackedRoot { cpu: 0 })
    );
    // And the debug check tells a CPU that runs another root.
    let other = m.new_mm(asid(2)).unwrap();
    assert_eq!(check_cpu_state(&cpu0, &other), Err(Error::NotLoaded { cpu: 0 }));
    assert_eq!(check_cpu_state(&cpu0, mm), Ok(()));
    assert_eq!(m.frame_state(f).unwrap(), FrameState::InUse);
}

#[test]
fn a_flush_from_a_cpu_that_runs_nothing_says_it_reached_no_cpu() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let (rmap, _) = one_page(&m);
    let mm = rmap.spaces()[0].mm();
    let cpu0 = m.cpu(0).unwrap();
    let report = flush_tlb_page(&cpu0, mm, va(0)).unwrap();
    assert!(report.reached_no_cpu());
    cpu0.switch_to(mm).unwrap();
    let report = flush_tlb_page(&cpu0, mm, va(0)).unwrap();
    assert!(!report.reached_no_cpu() && report.flushed_locally);
}

/// An `Arch` whose `current_cpu` cannot tell the CPU (as the x86_64 and
/// aarch64 ones answer for a CPU missing from their `CpuTable`); the rest
/// is the mock CPU's.
struct Untold<'a>(MockCpu<'a, X86Like>);

// SAFETY: every method but `current_cpu` delegates to the mock CPU, whose
// guarantees hold; `current_cpu` names no CPU at all.
unsafe impl Arch for Untold<'_> {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;
    const FILL_SETS_ACCESSED: bool = true;
    fn current_cpu(&self) -> Result<CpuId, Error> {
        Err(Error::UnregisteredCpu { hw_id: 0x42 })
    }
    fn online_cpus(&self) -> CpuSet {
        self.0.online_cpus()
    }
    fn root_loaded(&self, root: u64) -> Option<bool> {
        self.0.root_loaded(root)
    }
    fn shootdown_state(&self) -> &TlbShootdown {
        self.0.shootdown_state()
    }
    fn flush_local_page(&self, asid: Asid, va: u64) {
        self.0.flush_local_page(asid, va)
    }
    fn flush_local_asid(&self, asid: Asid) {
        self.0.flush_local_asid(asid)
    }
    fn flush_local_all(&self, include_global: bool) {
        self.0.flush_local_all(include_global)
    }
    fn send_flush_ipi(&self, targets: &CpuSet) {
        self.0.send_flush_ipi(targets)
    }
    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        // SAFETY: forwarded unchanged from our caller.
        unsafe { self.0.switch_address_space(asid, root) }
    }
    fn trace(&self, event: &TraceEvent) {
        self.0.trace(event)
    }
}

#[test]
fn a_cpu_the_arch_cannot_tell_gets_its_error_everywhere_and_nothing_changes() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let (rmap, f) = one_page(&m);
    let mm = rmap.spaces()[0].mm();
    let untold = Untold(m.cpu(0).unwrap());
    let expected = Error::UnregisteredCpu { hw_id: 0x42 };
    every_flush_is_refused(&m, &rmap, f, &untold, expected);
    let req = FlushRequest::for_asid(mm.asid());
    assert_eq!(shootdown(&untold, &m.online(), &req), Err(expected));
    // SAFETY: the mock's own root; the call is refused.
    assert_eq!(unsafe { switch_mm(&untold, None, mm) }, Err(expected));
    assert!(mm.cpus().is_empty());
    assert_eq!(tlb_batch::prepare_cpu_online(&untold), Err(expected));
    assert_eq!(tlb_batch::take_cpu_offline(&untold, |_| true), Err(expected));
    assert_eq!(check_cpu_state(&untold, mm), Err(expected));
    // The calls that answer no `Result` do nothing.
    assert_eq!(handle_flush_ipi(&untold), 0);
    assert!(!quiescent_flush(&untold));
    let mut pool = FramePool::<4>::new();
    assert!(pool.release_passed(&untold).is_empty());
    // Every CPU that runs the space counts as another one.
    assert!(!mm.cached_elsewhere(&untold));
    m.cpu(1).unwrap().switch_to(mm).unwrap();
    assert!(mm.cached_elsewhere(&untold));
    assert_eq!(m.online(), CpuSet::first(2).unwrap());
    assert_eq!(m.violations(), []);
}

#[test]
fn a_space_used_on_one_machine_is_refused_on_another() {
    let m1 = MockMachine::new(config(2, 16)).unwrap();
    let m2 = MockMachine::new(config(2, 16)).unwrap();
    let (rmap, f) = one_page(&m1);
    let mm = rmap.spaces()[0].mm();
    for c in m1.cpus() {
        c.switch_to(mm).unwrap();
        c.write(va(0), 1).unwrap();
    }
    // The other machine's CPUs are not the ones the space's CPU set
    // names: every flush through them would reach nobody.
    let other = m2.cpu(0).unwrap();
    every_flush_is_refused(&m1, &rmap, f, &other, Error::OtherMachine);
    // SAFETY: the mock's own root; the call is refused.
    assert_eq!(unsafe { switch_mm(&other, None, mm) }, Err(Error::OtherMachine));
    assert_eq!(mm.cpus(), m1.online(), "nothing changed");
    // Its own machine still flushes it.
    let cpu0 = m1.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let _ = try_to_unmap(
        &cpu0,
        &rmap,
        f,
        TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS,
        &mut batch,
    )
    .unwrap();
    batch.flush(&cpu0).unwrap();
    common::free_and_check(&m1, vec![f]);
    assert_eq!(m2.violations(), []);
}

/// The mock's `Arch` flushes a kernel page as INVLPG does (the loaded
/// ASID's entry and the global one), which is right only when every
/// kernel entry is global: a non-global kernel entry is refused by the
/// machine's PTE writers, with nothing stored. A global one cached by a
/// CPU under two ASIDs is gone after one page flush, and its frame can
/// be freed (found by a new user's trial: a non-global entry survived in
/// the ASID not loaded).
#[test]
fn a_kernel_entry_must_be_global_and_then_one_page_flush_reaches_every_asid() {
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(2, 64)
    })
    .unwrap();
    let (c0, c1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    let (a, b) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
    let kernel = m.kernel_mm().clone();
    let kva = 0xffff_8000_0040_0000;
    let f = m.alloc_frame().unwrap();
    let plain = Pte::new(f, PteFlags::PRESENT | PteFlags::WRITABLE);
    let refused = Err(MockError::NonGlobalKernelEntry { va: kva });
    assert_eq!(m.set_pte(&kernel, kva, plain), refused);
    assert_eq!(m.exchange_pte(&kernel, kva, plain), refused.map(|()| Pte::EMPTY));
    assert_eq!(m.pte(&kernel, kva), Ok(Pte::EMPTY));
    // A user entry needs no global bit.
    m.set_pte(&a, va(0), Pte::new(f, PteFlags::PRESENT | PteFlags::USER))
        .unwrap();
    m.clear_pte(&a, va(0)).unwrap();

    m.set_pte(&kernel, kva, Pte::new(f, plain.flags() | PteFlags::GLOBAL))
        .unwrap();
    for space in [&a, &b] {
        c1.switch_to(space).unwrap();
        c1.read(kva).unwrap();
    }
    m.clear_pte(&kernel, kva).unwrap();
    flush_tlb_page(&c0, &kernel, kva).unwrap();
    assert_eq!(m.cached_translations(f), vec![]);
    m.free_frame(f).unwrap();
    c1.switch_to(&a).unwrap();
    assert!(c1.read(kva).is_err());
    assert_eq!(m.violations(), vec![]);
}

/// A test that ages a page by hand through the mock's own writers rather
/// than `page_referenced`, while a CPU keeps the entry it filled before:
/// the epoch the crate stored at its last aging no longer vouches that
/// such an entry would have set the bit again. The machine forgets the
/// epoch at that write, so the pool waits for the CPU's flush instead of
/// handing the frame back under its entry (found by a new user's trial).
#[test]
fn aging_by_hand_through_the_mock_forgets_the_crates_epoch() {
    type Clear = fn(&MockMachine<X86Like>, &MmTlbState);
    let by_hand: [(&str, Clear); 3] = [
        ("test_and_clear_accessed", |m, mm| {
            assert!(m.test_and_clear_accessed(mm, va(0)).unwrap());
        }),
        ("exchange_pte", |m, mm| {
            let pte = m.pte(mm, va(0)).unwrap();
            let old = m
                .exchange_pte(mm, va(0), Pte::new(pte.frame(), pte.flags() - PteFlags::ACCESSED))
                .unwrap();
            assert!(old.is_accessed());
        }),
        ("set_pte", |m, mm| {
            let pte = m.pte(mm, va(0)).unwrap();
            m.set_pte(mm, va(0), Pte::new(pte.frame(), pte.flags() - PteFlags::ACCESSED))
                .unwrap();
        }),
    ];
    for (how, clear) in by_hand {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let (mm, other) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
        let rmap = MockRmap::new(&m, vec![m.space(&mm), m.space(&other)]);
        let f = m.alloc_frame().unwrap();
        rmap.map(f, 0, va(0), false, MappingFlags::empty()).unwrap();
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        cpu0.switch_to(&other).unwrap();
        cpu1.switch_to(&mm).unwrap();
        // The crate's aging opens an epoch; CPU 1 flushes after it (a
        // switch away and back, untagged).
        page_referenced(&cpu0, &rmap, f, &mut TlbFlushUnmapBatch::new()).unwrap();
        assert!(rmap.aged_epoch(f).is_some());
        cpu1.switch_to(&other).unwrap();
        cpu1.switch_to(&mm).unwrap();
        // CPU 1 caches the page (its fill sets the bit), then the bit is
        // cleared by hand while the entry stays.
        cpu1.read(va(0)).unwrap();
        clear(&m, &mm);
        assert_eq!(rmap.aged_epoch(f), None, "{how}");
        let mut batch = UnmapBatch::<4>::new();
        let unmapped = batch.try_to_unmap(&cpu0, &rmap, common::owned(f), TtuFlags::IGNORE_ACCESS);
        assert!(matches!(unmapped, Ok(tlb_batch::Unmapped::Held(_))), "{how}");
        let mut pool = FramePool::<4>::new();
        assert_eq!(pool.defer(&cpu0, &mut batch), Ok(1), "{how}");
        assert!(pool.release_passed(&cpu0).is_empty(), "{how}: CPU 1 caches it");
        assert!(quiescent_flush(&cpu1));
        let mut back = pool.release_passed(&cpu0);
        assert_eq!(back.len(), 1, "{how}");
        tlb_batch::FreeFrames::free_batch(&mut MockKernel::new(&rmap), back.frames_mut());
        assert_eq!(m.violations(), [], "{how}");
    }
}

/// Which writes make the machine forget an epoch: a write that takes an
/// accessed bit away (the old frame's), and a frame mapped anew (the new
/// frame's, over an empty entry or over another frame's); an unmap or a
/// rewrite of an entry whose bit is clear keeps it.
#[test]
fn the_mock_forgets_exactly_the_epochs_a_write_invalidates() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let rmap = MockRmap::new(&m, vec![m.space(&mm)]);
    let cpu0 = m.cpu(0).unwrap();
    let frames: Vec<Frame> = (0..4).map(|_| m.alloc_frame().unwrap()).collect();
    for (i, &f) in frames.iter().enumerate() {
        rmap.map(f, 0, va(i), false, MappingFlags::empty()).unwrap();
        page_referenced(&cpu0, &rmap, f, &mut TlbFlushUnmapBatch::new()).unwrap();
        assert!(rmap.aged_epoch(f).is_some());
    }
    let entry = |f: Frame| Pte::new(f, PteFlags::PRESENT | PteFlags::USER);
    // Bits clear: a rewrite and an unmap keep the epochs.
    m.exchange_pte(&mm, va(0), entry(frames[0])).unwrap();
    m.clear_pte(&mm, va(1)).unwrap();
    assert!(rmap.aged_epoch(frames[0]).is_some() && rmap.aged_epoch(frames[1]).is_some());
    // An accessed entry unmapped by hand: its frame's epoch goes.
    m.set_pte(
        &mm,
        va(0),
        Pte::new(frames[0], entry(frames[0]).flags() | PteFlags::ACCESSED),
    )
    .unwrap();
    assert!(rmap.aged_epoch(frames[0]).is_some(), "a bit set is no reason");
    m.clear_pte(&mm, va(0)).unwrap();
    assert_eq!(rmap.aged_epoch(frames[0]), None);
    // Mapped anew over an empty entry, and over another frame's.
    m.set_pte(&mm, va(1), entry(frames[1])).unwrap();
    assert_eq!(rmap.aged_epoch(frames[1]), None);
    m.set_pte(&mm, va(2), entry(frames[3])).unwrap();
    assert_eq!(rmap.aged_epoch(frames[3]), None);
    assert!(rmap.aged_epoch(frames[2]).is_some(), "its bit was clear");
}

/// Found by a new user's trial: `prepare_cpu_online` on a CPU that is
/// online and runs an address space answered `Ok` and forgot what the CPU
/// ran, so a batch's flush then skipped it (`FreedWhileCached`, then
/// `WriteToFreeFrame`). It is refused with nothing forgotten, and the
/// flush reaches the CPU.
#[test]
fn preparing_an_online_cpu_to_come_online_is_refused() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let (rmap, f) = one_page(&m);
    let mm = rmap.spaces()[0].mm();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.switch_to(mm).unwrap();
    cpu1.write(va(0), 1).unwrap();
    assert_eq!(
        tlb_batch::prepare_cpu_online(&cpu1),
        Err(Error::AlreadyOnline { cpu: 1 })
    );
    assert_eq!(check_cpu_state(&cpu1, mm), Ok(()), "nothing was forgotten");
    let old = m.clear_pte(mm, va(0)).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    batch.add_pending(&cpu0, mm, va(0), old).unwrap();
    assert_eq!(batch.flush(&cpu0).unwrap().remote_cpus, 1);
    rmap.remove_frame(f);
    m.free_frame(f).unwrap();
    assert!(cpu1.write(va(0), 2).is_err());
    assert_eq!(m.violations(), []);
    // The way back still works: offline, then prepared and joined.
    cpu1.go_offline();
    cpu1.come_online();
    assert!(m.online().contains(cpu1.id()));
    assert_eq!(m.violations(), []);
}
