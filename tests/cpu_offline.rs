//! CPUs leaving the online set: on real threads, a CPU goes offline and
//! comes back again and again while the others unmap, shoot down and free
//! without pause, and no shootdown is ever left waiting for it; the typed
//! refusals of `take_offline` and `take_cpu_offline`.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::{asid, config, va, within};
use tlb_batch::arch::mock::MockMachine;
use tlb_batch::{flush_tlb_page, shootdown, take_cpu_offline, Arch, CpuSet, Error, FlushRequest};

const CPUS: usize = 4;
/// The CPU that goes offline and comes back.
const LEAVER: usize = CPUS - 1;

/// CPU `LEAVER` cycles offline and online `cycles` times while CPUs 0 to 2
/// each unmap a page of their own, flush it (from every CPU running the
/// address space, CPU `LEAVER` among them until it loads the kernel's
/// space to leave; or from every online CPU, as a kernel-space flush
/// does) and free its frame, over and over, alternating interrupts off
/// and on.
///
/// Each time it is back online, the leaver reads every page (caching
/// them, so that the next flushes must reach it or find it away) and
/// stays until every initiator has completed another shootdown. A request
/// stranded in its inbox by the previous offline (published by an
/// initiator that read the online set just before the leaver left, after
/// the leaver's last look at its inbox) is never served: its initiator
/// waits forever, the leaver waits for that initiator, and the test fails
/// on its time limit instead of hanging.
fn offline_storm(cycles: u64) {
    let m = MockMachine::new(config(CPUS, 64).threaded()).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let completed: [AtomicU64; CPUS] = Default::default();
    let served_offline = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    m.run_threaded(|cpu| {
        let me = cpu.id().index();
        cpu.switch_to(&mm).unwrap();
        if me == LEAVER {
            for _ in 0..cycles {
                let before: Vec<u64> = completed.iter().map(|c| c.load(Ordering::SeqCst)).collect();
                while (0..LEAVER).any(|c| completed[c].load(Ordering::SeqCst) <= before[c]) {
                    for page in 0..LEAVER {
                        let _ = cpu.read(va(page));
                    }
                    std::thread::yield_now();
                }
                // The kernel's offline path: interrupts off, the kernel's
                // space loaded, leave, park.
                cpu.disable_interrupts();
                cpu.switch_to(m.kernel_mm()).unwrap();
                let served = cpu.take_offline().unwrap();
                served_offline.fetch_add(served as u64, Ordering::SeqCst);
                assert!(!m.online().contains(cpu.id()));
                // Nothing can arrive any more: every initiator that saw the
                // leaver online has published, and it served them all.
                assert_eq!(cpu.shootdown_state().pending_requests(cpu.id()), 0);
                std::thread::yield_now();
                cpu.come_online();
                cpu.enable_interrupts();
                cpu.switch_to(&mm).unwrap();
            }
            stop.store(true, Ordering::SeqCst);
            return;
        }
        let mut round = 0u64;
        while !stop.load(Ordering::SeqCst) {
            if round.is_multiple_of(2) {
                cpu.disable_interrupts();
            }
            let frame = m.map_new(&mm, va(me), true).unwrap();
            cpu.write(va(me), round).unwrap();
            m.clear_pte(&mm, va(me)).unwrap();
            if round % 4 < 2 {
                flush_tlb_page(&cpu, &mm, va(me)).unwrap();
            } else {
                // At every CPU, as a kernel-space flush would be: the
                // leaver is a target whenever it is online, whatever it
                // runs, so the race with its leaving is there each time.
                let mut req = FlushRequest::new();
                req.add_page(mm.asid(), va(me), 33).unwrap();
                shootdown(&cpu, &CpuSet::first(CPUS).unwrap(), &req).unwrap();
            }
            m.free_frame(frame).unwrap();
            cpu.enable_interrupts();
            completed[me].fetch_add(1, Ordering::SeqCst);
            round += 1;
        }
    });
    let done: u64 = completed.iter().map(|c| c.load(Ordering::SeqCst)).sum();
    assert!(
        done >= cycles * LEAVER as u64,
        "{done} shootdowns in {cycles} cycles"
    );
    assert_eq!(m.stats().shootdowns, done);
    // No frame was freed while a CPU could still use an entry for it: the
    // leaver kept its entries while away and dropped them on its way back.
    assert_eq!(m.violations(), []);
    for cpu in m.cpus() {
        assert_eq!(cpu.shootdown_state().pending_requests(cpu.id()), 0);
    }
    eprintln!(
        "{cycles} offline cycles, {done} shootdowns, {} requests served by the leaver while offline, \
         {} IPIs dropped at an offline CPU",
        served_offline.load(Ordering::SeqCst),
        m.ipis_lost()
    );
}

#[test]
fn a_cpu_cycling_offline_and_online_never_strands_a_shootdown() {
    // Miri interprets every step of four spinning threads: a few cycles.
    let cycles = if cfg!(miri) { 4 } else { 5_000 };
    within(60, move || offline_storm(cycles));
}

#[test]
fn going_offline_is_refused_when_it_would_strand_something() {
    let m = MockMachine::new(config(3, 16)).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    // Inside a shootdown of its own (an interrupt handler that interrupted
    // one): leaving would park with that shootdown unfinished.
    assert_eq!(
        cpu1.in_shootdown(|| cpu1.take_offline()),
        Ok(Err(Error::ShootdownReentered { cpu: 1 }))
    );
    assert!(m.online().contains(cpu1.id()));
    // Running a user space, lazily or not: its tables may be freed while
    // no flush reaches the CPU, and its MMU may still walk them.
    let mm = m.new_mm(asid(1)).unwrap();
    cpu1.switch_to(&mm).unwrap();
    assert_eq!(cpu1.take_offline(), Err(Error::UserSpaceLoaded { cpu: 1 }));
    cpu1.enter_lazy().unwrap();
    assert_eq!(cpu1.take_offline(), Err(Error::UserSpaceLoaded { cpu: 1 }));
    assert!(m.online().contains(cpu1.id()));
    assert_eq!(cpu1.shootdown_state().loaded_asid(cpu1.id()), Some(mm.asid()));
    cpu1.switch_to(m.kernel_mm()).unwrap();
    assert_eq!(cpu1.take_offline(), Ok(0));
    // Already offline: nothing to leave.
    assert_eq!(cpu1.take_offline(), Err(Error::CpuNotOnline { cpu: 1 }));
    // go_offline swallows that: the CPU stays offline.
    cpu1.go_offline();
    assert_eq!(
        m.online(),
        CpuSet::first(3).unwrap().difference(&CpuSet::single(cpu1.id()))
    );
    cpu1.come_online();
    // A `leave` that takes the CPU out of some other set: shootdowns would
    // still target it, so it must not park.
    let cpu2 = m.cpu(2).unwrap();
    assert_eq!(
        take_cpu_offline(&cpu2, |_| true),
        Err(Error::CpuStillOnline { cpu: 2 })
    );
    // One that says the CPU was not there.
    assert_eq!(
        take_cpu_offline(&cpu2, |_| false),
        Err(Error::CpuNotOnline { cpu: 2 })
    );
    assert_eq!(m.online(), CpuSet::first(3).unwrap());
}

#[test]
fn a_request_waiting_when_the_cpu_leaves_is_served_before_it_goes() {
    within(60, request_waiting_when_leaving);
}

fn request_waiting_when_leaving() {
    // CPU 1 has interrupts off, so CPU 0's request waits in its inbox
    // (the IPI latched) while CPU 0 waits for the acknowledgement.
    let m = MockMachine::new(config(2, 16).threaded()).unwrap();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.disable_interrupts();
    let mut req = FlushRequest::new();
    req.add_page(asid(1), va(0), 33).unwrap();
    std::thread::scope(|s| {
        let initiator = s.spawn(|| tlb_batch::shootdown(&cpu0, &CpuSet::single(cpu1.id()), &req).unwrap());
        while cpu1.shootdown_state().pending_requests(cpu1.id()) == 0 {
            std::thread::yield_now();
        }
        // CPU 1 leaves with the request waiting: it serves it on its way
        // out, and the initiator returns.
        assert_eq!(cpu1.take_offline(), Ok(1));
        let report = initiator.join().unwrap();
        assert_eq!(report.remote_cpus, 1);
    });
    assert_eq!(cpu1.shootdown_state().pending_requests(cpu1.id()), 0);
    // The IPI found CPU 1 with interrupts off, then offline: it stayed
    // latched, and is taken (finding nothing) once CPU 1 is back.
    cpu1.come_online();
    cpu1.enable_interrupts();
    assert_eq!(m.stats().flushes_received, 1);
}
