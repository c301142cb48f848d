//! The cross-CPU protocol: concurrent initiators on real threads, mutual
//! shootdowns with interrupts disabled, coalesced IPIs, re-entry, the
//! pending/flushed generation pair, and kernel (global) mappings.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};

use common::{asid, config, populate, va, within};
use tlb_batch::arch::mock::{MockCpu, MockMachine};
use tlb_batch::{
    flush_tlb_batched_pending, flush_tlb_page, handle_flush_ipi, shootdown, Arch, Asid, CpuId, CpuSet, Error,
    FlushRequest, TlbFlushUnmapBatch, TlbShootdown, TraceEvent, PAGE_SIZE,
};

fn cpu_set(ids: &[usize]) -> CpuSet {
    ids.iter().map(|&i| CpuId::new(i).unwrap()).collect()
}

fn one_page(asid_value: u16, i: usize) -> FlushRequest {
    let mut req = FlushRequest::new();
    req.add_page(asid(asid_value), va(i), 33).unwrap();
    req
}

#[test]
fn concurrent_initiators_on_threads_all_complete_and_are_acknowledged() {
    within(60, concurrent_initiators);
}

fn concurrent_initiators() {
    const CPUS: usize = 4;
    // Miri interprets every step of four spinning threads, about seven
    // seconds a round: a few rounds still cross every path of the protocol.
    const ROUNDS: usize = if cfg!(miri) { 8 } else { 300 };
    let m = MockMachine::new(config(CPUS, 64).threaded()).unwrap();
    let all = CpuSet::first(CPUS).unwrap();
    m.run_threaded(|cpu| {
        for round in 0..ROUNDS {
            // Alternate interrupts on and off: completion must not depend
            // on the initiator taking interrupts.
            if round % 2 == 0 {
                cpu.disable_interrupts();
            }
            let report = shootdown(&cpu, &all, &one_page(1, round)).unwrap();
            assert_eq!(report.remote_cpus, CPUS - 1);
            cpu.enable_interrupts();
        }
    });
    let s = m.stats();
    assert_eq!(s.shootdowns, (CPUS * ROUNDS) as u64);
    // Every request was carried out by every other CPU, exactly once.
    assert_eq!(s.flushes_received, (CPUS * ROUNDS * (CPUS - 1)) as u64);
    assert_eq!(s.local_page_flushes, (CPUS * ROUNDS * CPUS) as u64);
    // Coalescing can only save interrupts, and the machine's own count of
    // delivered IPIs agrees with the crate's.
    assert!(s.ipis_sent <= s.flushes_received);
    assert_eq!(m.ipis_sent(), s.ipis_sent);
    for cpu in m.cpus() {
        assert_eq!(m.shootdown_pending(cpu.id()), 0);
    }
}

trait PendingProbe {
    fn shootdown_pending(&self, cpu: CpuId) -> usize;
}

impl PendingProbe for MockMachine {
    fn shootdown_pending(&self, cpu: CpuId) -> usize {
        self.cpu(0).unwrap().shootdown_state().pending_requests(cpu)
    }
}

#[test]
fn two_cpus_shooting_at_each_other_with_interrupts_off_never_deadlock() {
    // Fewer rounds under Miri (about 1.5 s each), as in
    // `concurrent_initiators`.
    const ROUNDS: usize = if cfg!(miri) { 20 } else { 2000 };
    within(60, || {
        let m = MockMachine::new(config(2, 64).threaded()).unwrap();
        let finished = AtomicUsize::new(0);
        m.run_threaded(|cpu| {
            let other = cpu_set(&[1 - cpu.id().index()]);
            cpu.disable_interrupts();
            for round in 0..ROUNDS {
                shootdown(&cpu, &other, &one_page(1, round)).unwrap();
            }
            // Wait for the partner with interrupts still off, serving the
            // inbox as any CPU spinning with interrupts off must.
            finished.fetch_add(1, Ordering::SeqCst);
            while finished.load(Ordering::SeqCst) < 2 {
                handle_flush_ipi(&cpu);
                std::thread::yield_now();
            }
            // Every request was served, and not one by an interrupt: the
            // initiators' wait loops served each other.
            assert_eq!(m.interrupts_taken(cpu.id()).unwrap(), 0);
            assert_eq!(m.stats().flushes_received, 2 * ROUNDS as u64);
            // The latched IPI now fires and finds nothing left to do.
            cpu.enable_interrupts();
        });
        assert_eq!(m.stats().flushes_received, 2 * ROUNDS as u64);
        // Each side sent at most one IPI per request (coalescing may save
        // some), and the machine saw the same number.
        assert!(m.stats().ipis_sent <= 2 * ROUNDS as u64);
        assert_eq!(m.ipis_sent(), m.stats().ipis_sent);
    });
}

#[test]
fn one_interrupt_serves_coalesced_requests_and_loses_none() {
    within(60, coalesced);
}

/// Disables interrupts on `cpu` and waits until `n` requests wait in its
/// inbox (their IPIs latched, none taken).
fn wait_with_interrupts_off_for_requests(cpu: &MockCpu<'_>, n: usize) {
    cpu.disable_interrupts();
    let state = cpu.shootdown_state();
    while state.pending_requests(cpu.id()) < n {
        std::thread::yield_now();
    }
}

fn coalesced() {
    let m = MockMachine::new(config(3, 64).threaded()).unwrap();
    let (_, frames) = populate(&m, 1, 2, &[2], true);
    let target = cpu_set(&[2]);
    m.run_threaded(|cpu| match cpu.id().index() {
        2 => {
            wait_with_interrupts_off_for_requests(&cpu, 2);
            // Both requests wait; one interrupt must carry out both.
            assert!(!cpu.poll_interrupts());
            cpu.enable_interrupts();
        }
        i => {
            shootdown(&cpu, &target, &one_page(1, i)).unwrap();
        }
    });
    let cpu2 = m.cpu(2).unwrap().id();
    assert_eq!(m.interrupts_taken(cpu2).unwrap(), 1);
    assert_eq!(m.ipis_sent(), 1, "the second request rode on the first IPI");
    assert_eq!(m.stats().flushes_received, 2);
    // Both pages are gone from CPU 2's TLB.
    assert!(m.cached_translations(frames[0]).is_empty());
    assert!(m.cached_translations(frames[1]).is_empty());
}

/// The handler says how many requests it carried out: both waiting ones
/// in one call, none in the next.
#[test]
fn the_handler_reports_how_many_requests_it_served() {
    within(60, || {
        let m = MockMachine::new(config(3, 64).threaded()).unwrap();
        let _ = populate(&m, 1, 2, &[2], true);
        let target = cpu_set(&[2]);
        let served = AtomicUsize::new(usize::MAX);
        m.run_threaded(|cpu| match cpu.id().index() {
            2 => {
                wait_with_interrupts_off_for_requests(&cpu, 2);
                // Asserted after the run: a panic here would leave the
                // machine's threads waiting.
                let first = handle_flush_ipi(&cpu);
                let second = handle_flush_ipi(&cpu);
                served.store(first * 10 + second, Ordering::SeqCst);
                cpu.enable_interrupts();
            }
            i => {
                shootdown(&cpu, &target, &one_page(1, i)).unwrap();
            }
        });
        assert_eq!(served.load(Ordering::SeqCst), 20, "2 served, then 0");
        assert_eq!(m.stats().flushes_received, 2);
    });
}

#[test]
fn the_initiator_flushes_itself_without_an_ipi() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let (mm, frames) = populate(&m, 1, 1, &[0], true);
    let cpu0 = m.cpu(0).unwrap();
    let report = flush_tlb_page(&cpu0, &mm, va(0)).unwrap();
    assert_eq!(report.ipis_sent, 0);
    assert!(report.flushed_locally);
    assert_eq!(m.ipis_sent(), 0);
    assert!(m.cached_translations(frames[0]).is_empty());
}

#[test]
fn offline_or_idle_cpus_are_not_interrupted() {
    let m = MockMachine::new(config(8, 64)).unwrap();
    let (mm, _) = populate(&m, 1, 1, &[0, 3], true);
    let cpu0 = m.cpu(0).unwrap();
    let report = flush_tlb_page(&cpu0, &mm, va(0)).unwrap();
    assert_eq!((report.remote_cpus, report.ipis_sent), (1, 1));
    // A target set naming CPUs the machine does not have is clipped to the
    // online ones instead of waiting forever.
    let report = shootdown(&cpu0, &cpu_set(&[3, 100]), &one_page(1, 0)).unwrap();
    assert_eq!(report.remote_cpus, 1);
}

/// An `Arch` that runs a hook just before sending IPIs: lets a test act in
/// the middle of a shootdown, as an interrupt or another CPU would.
struct Hooked<'a> {
    inner: MockCpu<'a>,
    hook: &'a dyn Fn(&MockCpu<'a>),
}

// SAFETY: every method delegates to the mock CPU, whose guarantees hold; the
// hook runs before delegating and does not change what is delivered.
unsafe impl Arch for Hooked<'_> {
    const CLEAN_WRITE_REWALK: bool = <MockCpu as Arch>::CLEAN_WRITE_REWALK;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = <MockCpu as Arch>::ACCESSED_CLEAR_NEEDS_FLUSH;
    fn current_cpu(&self) -> Result<CpuId, tlb_batch::Error> {
        self.inner.current_cpu()
    }
    fn online_cpus(&self) -> CpuSet {
        self.inner.online_cpus()
    }
    fn shootdown_state(&self) -> &TlbShootdown {
        self.inner.shootdown_state()
    }
    fn flush_local_page(&self, asid: Asid, va: u64) {
        self.inner.flush_local_page(asid, va)
    }
    fn flush_local_asid(&self, asid: Asid) {
        self.inner.flush_local_asid(asid)
    }
    fn flush_local_all(&self, include_global: bool) {
        self.inner.flush_local_all(include_global)
    }
    fn send_flush_ipi(&self, targets: &CpuSet) {
        (self.hook)(&self.inner);
        self.inner.send_flush_ipi(targets)
    }
    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        // SAFETY: forwarded unchanged from our caller.
        unsafe { self.inner.switch_address_space(asid, root) }
    }
    fn trace(&self, event: &TraceEvent) {
        self.inner.trace(event)
    }
}

#[test]
fn a_deferral_racing_with_the_pending_flush_is_not_lost() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (mm, _) = populate(&m, 1, 2, &[0, 1, 2], true);
    let cpu2 = m.cpu(2).unwrap();
    // CPU 2 (a reclaimer) defers page 0.
    let mut reclaim = TlbFlushUnmapBatch::new();
    let old = m.clear_pte(&mm, va(0)).unwrap();
    reclaim.add_pending(&cpu2, &mm, va(0), old).unwrap();
    assert!(mm.batched_flush_pending());

    // CPU 0 (an mprotect) flushes the pending batch; while its shootdown is
    // in flight, the reclaimer defers page 1 too.
    let late = std::cell::RefCell::new(TlbFlushUnmapBatch::new());
    let hook = |_: &MockCpu| {
        if late.borrow().is_empty() {
            let old = m.clear_pte(&mm, va(1)).unwrap();
            late.borrow_mut().add_pending(&cpu2, &mm, va(1), old).unwrap();
        }
    };
    let cpu0 = Hooked {
        inner: m.cpu(0).unwrap(),
        hook: &hook,
    };
    assert_eq!(flush_tlb_batched_pending(&cpu0, &mm), Ok(true));
    // The late deferral must still show: a boolean cleared by the flusher
    // would have said "nothing pending" here.
    assert!(mm.batched_flush_pending());
    assert_eq!(flush_tlb_batched_pending(&cpu0, &mm), Ok(true));
    assert!(!mm.batched_flush_pending());
    assert_eq!(flush_tlb_batched_pending(&cpu0, &mm), Ok(false));
    reclaim.flush(&cpu2).unwrap();
    late.into_inner().flush(&cpu2).unwrap();
}

#[test]
fn a_shootdown_reentered_on_the_same_cpu_is_an_error_not_a_hang() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let seen = std::cell::Cell::new(None);
    let hook = |inner: &MockCpu| {
        seen.set(Some(shootdown(inner, &cpu_set(&[0, 1]), &one_page(1, 1))));
    };
    let cpu0 = Hooked {
        inner: m.cpu(0).unwrap(),
        hook: &hook,
    };
    shootdown(&cpu0, &cpu_set(&[0, 1]), &one_page(1, 0)).unwrap();
    assert_eq!(seen.get(), Some(Err(Error::ShootdownReentered { cpu: 0 })));
    // The outer shootdown finished and released the slot: a new one works.
    assert!(shootdown(&m.cpu(0).unwrap(), &cpu_set(&[0, 1]), &one_page(1, 0)).is_ok());
}

#[test]
fn kernel_mappings_reach_every_cpu_and_flush_global_entries() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let kernel = m.kernel_mm().clone();
    let kva = 0xffff_8000_0000_0000u64;
    let f = m.map_new(&kernel, kva, true).unwrap();
    // Each CPU runs its own user address space and touches the kernel page.
    for c in m.cpus() {
        c.switch_to(&m.new_mm(asid(10 + c.id().index() as u16)).unwrap())
            .unwrap();
        c.write(kva, 1).unwrap();
    }
    assert_eq!(m.cached_translations(f).len(), 4);
    assert!(m.cached_translations(f).iter().all(|(_, e)| e.global));
    // Global entries survive switches...
    let c1 = m.cpu(1).unwrap();
    c1.switch_to(&m.new_mm(asid(20)).unwrap()).unwrap();
    assert_eq!(m.cached_translations(f).len(), 4);
    // ...and a kernel flush reaches every online CPU, whatever it runs.
    m.clear_pte(&kernel, kva).unwrap();
    let report = flush_tlb_page(&m.cpu(0).unwrap(), &kernel, kva).unwrap();
    assert_eq!(report.remote_cpus, 3);
    assert_eq!(m.cached_translations(f), []);
    m.free_frame(f).unwrap();
    assert_eq!(m.violations(), []);

    // A full flush of the kernel address space removes global entries too.
    let g = m.map_new(&kernel, kva + PAGE_SIZE, true).unwrap();
    for c in m.cpus() {
        c.read(kva + PAGE_SIZE).unwrap();
    }
    tlb_batch::flush_tlb_mm(&m.cpu(0).unwrap(), &kernel).unwrap();
    assert_eq!(m.cached_translations(g), []);
}

#[test]
fn switching_keeps_the_cpu_set_exact() {
    let m = MockMachine::new(config(4, 64)).unwrap();
    let a = m.new_mm(asid(1)).unwrap();
    let b = m.new_mm(asid(2)).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&a).unwrap();
    assert_eq!(a.cpus(), cpu_set(&[1]));
    cpu1.switch_to(&b).unwrap();
    assert_eq!(a.cpus(), CpuSet::new());
    assert_eq!(b.cpus(), cpu_set(&[1]));
    // Switching to the address space already loaded changes nothing.
    cpu1.switch_to(&b).unwrap();
    assert_eq!(m.stats().task_switches, 2);
    // A flush of `a` now interrupts nobody.
    let report = tlb_batch::flush_tlb_mm(&m.cpu(0).unwrap(), &a).unwrap();
    assert_eq!(report, Default::default());
    assert_eq!(m.ipis_sent(), 0);
}

/// A shootdown returns only after every target has carried its request
/// out: checked the moment `flush_tlb_page` returns, on real threads, with
/// each remote flush slowed down so that a target acknowledging before it
/// flushes would be caught still caching the entry.
#[test]
fn no_target_still_caches_the_entry_when_the_shootdown_returns() {
    const ROUNDS: usize = if cfg!(miri) { 2 } else { 20 };
    within(60, || {
        let m = MockMachine::new(tlb_batch::arch::mock::MockConfig {
            flush_delay_us: 2000,
            ..config(3, 64).threaded()
        })
        .unwrap();
        let mm = m.new_mm(asid(1)).unwrap();
        let done = AtomicUsize::new(0);
        let ready = AtomicUsize::new(0);
        let round_no = AtomicUsize::new(0);
        m.run_threaded(|cpu| {
            if cpu.id().index() != 0 {
                cpu.switch_to(&mm).unwrap();
                // Each round: read the page (caching it), then keep taking
                // interrupts until the initiator moves on.
                // Round numbers start at 1: 0 means none has started.
                let mut seen = 0;
                while done.load(Ordering::SeqCst) == 0 {
                    let round = round_no.load(Ordering::SeqCst);
                    if round != seen {
                        let _ = cpu.read(va((round - 1) % 4));
                        seen = round;
                        ready.fetch_add(1, Ordering::SeqCst);
                    }
                    cpu.poll_interrupts();
                    std::thread::yield_now();
                }
                return;
            }
            cpu.switch_to(&mm).unwrap();
            for round in 0..ROUNDS {
                let page = va(round % 4);
                let f = m.map_new(&mm, page, true).unwrap();
                ready.store(0, Ordering::SeqCst);
                round_no.store(round + 1, Ordering::SeqCst);
                while ready.load(Ordering::SeqCst) < 2 {
                    cpu.poll_interrupts();
                    std::thread::yield_now();
                }
                assert_eq!(m.cached_translations(f).len(), 2, "both targets cached the page");
                m.clear_pte(&mm, page).unwrap();
                flush_tlb_page(&cpu, &mm, page).unwrap();
                // The moment the shootdown returned:
                assert_eq!(
                    m.cached_translations(f),
                    [],
                    "a target still caches the entry after the shootdown returned"
                );
                m.free_frame(f).unwrap();
            }
            done.store(1, Ordering::SeqCst);
        });
        assert_eq!(m.violations(), []);
    });
}

/// The CPU-side bookkeeping of what each CPU has loaded: set by
/// `switch_mm`, forgotten by `prepare_cpu_online`; and with it, a CPU of an
/// untagged TLB skips the pages of an address space it does not run.
#[test]
fn each_cpu_flushes_only_the_address_space_it_runs() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (a, _) = populate(&m, 1, 1, &[1], true);
    let (b, _) = populate(&m, 2, 1, &[2], true);
    let cpu0 = m.cpu(0).unwrap();
    let state = cpu0.shootdown_state();
    let (c1, c2) = (m.cpu(1).unwrap().id(), m.cpu(2).unwrap().id());
    assert_eq!(state.loaded_asid(c1), Some(a.asid()));
    assert_eq!(state.loaded_asid(c2), Some(b.asid()));
    // One request naming a page of each address space, to both CPUs.
    let mut req = FlushRequest::new();
    req.add_page(a.asid(), va(0), 33).unwrap();
    req.add_page(b.asid(), va(0), 33).unwrap();
    let before = m.stats();
    shootdown(&m.cpu(0).unwrap(), &cpu_set(&[1, 2]), &req).unwrap();
    // Each CPU invalidated only its own address space's page.
    assert_eq!(m.stats().since(&before).local_page_flushes, 2);
    m.cpu(2).unwrap().go_offline();
    m.cpu(2).unwrap().come_online();
    assert_eq!(state.loaded_asid(c2), None);
}

/// A flush of everything reaches global (kernel) entries exactly when the
/// request asks for them.
#[test]
fn everything_means_global_entries_only_when_asked() {
    for global in [false, true] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let kernel = m.kernel_mm().clone();
        let kva = 0xffff_ffff_8000_0000;
        let f = m.map_new(&kernel, kva, true).unwrap();
        m.cpu(1).unwrap().read(kva).unwrap();
        let mut req = FlushRequest::new();
        if global {
            req.add_everything();
        } else {
            // More address spaces than a request names: everything, but
            // not the global entries.
            for v in 1..=tlb_batch::MAX_FLUSH_ASIDS as u16 + 1 {
                req.add_asid(asid(v));
            }
        }
        shootdown(&m.cpu(0).unwrap(), &cpu_set(&[1]), &req).unwrap();
        assert_eq!(m.cached_translations(f).is_empty(), global);
    }
}

/// An empty request interrupts nobody; one interrupt serves every request
/// waiting in a CPU's inbox and says how many; the traced extent of a
/// request is its page count; each CPU counts its own full flushes.
#[test]
fn the_protocol_counts_what_it_does() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (mm, _) = populate(&m, 1, 2, &[0, 1, 2], true);
    let cpu0 = m.cpu(0).unwrap();
    let report = shootdown(&cpu0, &cpu_set(&[1, 2]), &FlushRequest::new()).unwrap();
    assert_eq!(report, tlb_batch::ShootdownReport::default());
    assert_eq!(m.ipis_sent(), 0);
    m.set_tracing(true);
    let mut req = FlushRequest::new();
    req.add_page(asid(1), va(0), 33).unwrap();
    req.add_page(asid(1), va(1), 33).unwrap();
    shootdown(&cpu0, &cpu_set(&[1]), &req).unwrap();
    let send = m
        .take_trace()
        .into_iter()
        .find(|e| e.reason == tlb_batch::FlushReason::RemoteSendIpi)
        .unwrap();
    assert_eq!(send.extent, tlb_batch::FlushExtent::Pages(2));
    let before = m.stats();
    tlb_batch::flush_tlb_mm(&cpu0, &mm).unwrap();
    assert_eq!(m.stats().since(&before).local_full_flushes, 3, "one per CPU");
    // A kernel-wide flush by address space is a full flush on each target
    // and on the initiator, each counted.
    let mut kernel = FlushRequest::new();
    kernel.add_asid(Asid::KERNEL);
    let before = m.stats();
    shootdown(&cpu0, &cpu_set(&[0, 1, 2]), &kernel).unwrap();
    assert_eq!(m.stats().since(&before).local_full_flushes, 3, "one per CPU");
}

/// Broadcast invalidation reaches every page of a range, not only its
/// first.
#[test]
fn broadcast_flushes_every_page_of_a_range() {
    use tlb_batch::arch::mock::BroadcastTlbi;
    let m = MockMachine::<BroadcastTlbi>::with_model(config(3, 64)).unwrap();
    let (mm, frames) = populate(&m, 1, 3, &[1, 2], true);
    tlb_batch::flush_tlb_range(&m.cpu(0).unwrap(), &mm, common::pages(0, 3)).unwrap();
    for f in frames {
        assert_eq!(m.cached_translations(f), [], "every page of the range went");
    }
    assert_eq!(m.ipis_sent(), 0);
}

/// On broadcast hardware the machine chooses per flush: a flush that
/// reaches no other CPU is local; with a threshold of two remote CPUs, one
/// that must reach one other CPU sends it an IPI, one that must reach three
/// broadcasts; all leave nothing cached, and the report says which was
/// used.
#[test]
fn broadcast_hardware_chooses_ipis_below_its_threshold() {
    use tlb_batch::arch::mock::{BroadcastTlbi, MockConfig};
    let m = MockMachine::<BroadcastTlbi>::with_model(MockConfig {
        broadcast_min_remote: 2,
        ..config(4, 64)
    })
    .unwrap();
    let cpu0 = m.cpu(0).unwrap();
    // Reaching no other CPU: a local flush, never a broadcast.
    let (mine, mine_frames) = populate(&m, 3, 1, &[0], true);
    m.clear_pte(&mine, va(0)).unwrap();
    let r = flush_tlb_page(&cpu0, &mine, va(0)).unwrap();
    assert!(!r.broadcast && r.flushed_locally && r.ipis_sent == 0);
    assert_eq!(m.cached_translations(mine_frames[0]), []);
    let (narrow, narrow_frames) = populate(&m, 1, 1, &[1], true);
    m.clear_pte(&narrow, va(0)).unwrap();
    let r = flush_tlb_page(&cpu0, &narrow, va(0)).unwrap();
    assert!(!r.broadcast, "one remote CPU: below the threshold");
    assert_eq!((r.remote_cpus, r.ipis_sent), (1, 1));
    assert_eq!(m.cached_translations(narrow_frames[0]), []);

    let (wide, wide_frames) = populate(&m, 2, 1, &[1, 2, 3], true);
    m.clear_pte(&wide, va(0)).unwrap();
    assert_eq!(m.stats().broadcasts, 0);
    let before = m.ipis_sent();
    let r = flush_tlb_page(&cpu0, &wide, va(0)).unwrap();
    assert!(r.broadcast, "three remote CPUs: at or above the threshold");
    assert_eq!(m.ipis_sent(), before, "a broadcast sends no IPI");
    assert_eq!(m.stats().broadcasts, 1, "counted as a broadcast");

    // Exactly at the threshold: two remote CPUs broadcast.
    let (two, two_frames) = populate(&m, 4, 1, &[2, 3], true);
    m.clear_pte(&two, va(0)).unwrap();
    let r = flush_tlb_page(&cpu0, &two, va(0)).unwrap();
    assert!(r.broadcast, "two remote CPUs: at the threshold");
    assert_eq!(m.stats().broadcasts, 2);
    assert_eq!(m.cached_translations(two_frames[0]), []);
    assert_eq!(m.cached_translations(wide_frames[0]), []);
    assert_eq!(m.violations(), []);
}

/// Even on hardware that always broadcasts, a flush that reaches no other
/// CPU stays local: a broadcast would make every CPU wait at its barrier
/// for nothing.
#[test]
fn a_flush_for_this_cpu_alone_is_never_broadcast() {
    use tlb_batch::arch::mock::BroadcastTlbi;
    let m = MockMachine::<BroadcastTlbi>::with_model(config(3, 64)).unwrap();
    let (mm, frames) = populate(&m, 1, 1, &[0], true);
    m.clear_pte(&mm, va(0)).unwrap();
    let r = flush_tlb_page(&m.cpu(0).unwrap(), &mm, va(0)).unwrap();
    assert!(!r.broadcast && r.flushed_locally);
    assert_eq!(m.stats().broadcasts, 0);
    assert_eq!(m.cached_translations(frames[0]), []);
}
