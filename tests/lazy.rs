//! Lazy CPUs on the mock machine: the mark, the refusal of user accesses,
//! the oracle's judgement of a lazy CPU's stale entries when it resumes
//! rather than when their frames are freed, and the crate's lazy TLB mode
//! (`enter_lazy_tlb`, `leave_lazy_tlb`): flushes skip a lazy CPU except
//! those that free page tables, and it catches up when it resumes.

mod common;

use common::{asid, config, populate, va};
use tlb_batch::arch::mock::{Fault, MockConfig, MockError, MockKernel, MockMachine, MockRmap, Violation};
use tlb_batch::{
    enter_lazy_tlb, flush_tlb_page, leave_lazy_tlb, Arch, CpuSet, Error, Frame, MappingFlags, MmuGather,
    PageRange, TableFreePolicy,
};

const KVA: u64 = 0xffff_ffff_8000_0000;

/// CPU 1 caches page 0 of a space (written, so writable and dirty) and goes
/// lazy on it; CPU 0 unmaps the page, flushes only itself (a policy that
/// skips lazy CPUs) and frees the frame.
fn freed_behind_a_lazy_cpu(m: &MockMachine) -> Frame {
    let (mm, frames) = populate(m, 1, 1, &[0, 1], true);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.enter_lazy().unwrap();
    assert!(cpu1.is_lazy());
    assert_eq!(m.lazy_cpus(), CpuSet::single(cpu1.id()));
    m.clear_pte(&mm, va(0)).unwrap();
    m.cpu(0).unwrap().flush_local_all(false);
    m.free_frame(frames[0]).unwrap();
    frames[0]
}

/// The free is no violation while the CPU is lazy; resuming with the
/// entry still cached is, once, at the resume, naming the entry.
#[test]
fn resuming_without_catching_up_is_a_violation_at_the_resume() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let frame = freed_behind_a_lazy_cpu(&m);
    assert_eq!(m.violations(), [], "a lazy CPU's entry is judged later");
    let cpu1 = m.cpu(1).unwrap();
    assert_eq!(cpu1.leave_lazy(), 1);
    assert!(!cpu1.is_lazy());
    assert_eq!(
        m.violations(),
        [Violation::LazyResumedWithStale {
            cpu: cpu1.id(),
            frame,
            va: va(0),
            writable: true,
        }]
    );
    // Leaving again finds nothing: the mark and what it remembered are gone.
    assert_eq!(cpu1.leave_lazy(), 0);
    assert_eq!(m.violation_count(), 1);
}

/// A CPU that flushes before it leaves lazy mode has caught up: nothing is
/// recorded, and its next access faults instead of reaching the frame.
#[test]
fn resuming_after_a_local_flush_is_fine() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    freed_behind_a_lazy_cpu(&m);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.flush_local_all(false);
    assert_eq!(cpu1.leave_lazy(), 0);
    assert_eq!(cpu1.read(va(0)), Err(Fault::NotMapped { va: va(0) }));
    assert_eq!(m.violations(), []);
}

/// Other ways the entry goes before the resume: a switch of the untagged
/// TLB to another space, or the crate's own catch-up when the CPU resumes
/// the space through `switch_mm` (the crate's flushes skip a lazy CPU).
#[test]
fn a_switch_or_an_interrupt_catches_a_lazy_cpu_up_too() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    freed_behind_a_lazy_cpu(&m);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&m.new_mm(asid(2)).unwrap()).unwrap();
    assert_eq!(cpu1.leave_lazy(), 0);
    assert_eq!(m.violations(), []);

    let m = MockMachine::new(config(2, 16)).unwrap();
    let (mm, frames) = populate(&m, 1, 1, &[0, 1], true);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.enter_lazy().unwrap();
    m.clear_pte(&mm, va(0)).unwrap();
    let report = flush_tlb_page(&m.cpu(0).unwrap(), &mm, va(0)).unwrap();
    assert_eq!(report.ipis_sent, 0, "the crate skips the lazy CPU");
    m.free_frame(frames[0]).unwrap();
    // Resuming the space through `switch_mm` catches up by generation.
    let before = m.stats().catch_ups;
    cpu1.switch_to(&mm).unwrap();
    assert_eq!(m.stats().catch_ups - before, 1);
    assert!(!cpu1.is_lazy());
    assert_eq!(m.violations(), []);
}

/// A lazy CPU runs no user code: reads and writes of user pages are
/// refused and change nothing (no fill, no accessed or dirty bit, no
/// data), whether the page is cached or not; kernel pages are reached as
/// usual; leaving lazy mode restores user accesses.
#[test]
fn a_lazy_cpu_is_refused_user_accesses() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let (mm, frames) = populate(&m, 1, 2, &[1], false);
    let kernel = m.kernel_mm().clone();
    let kframe = m.map_new(&kernel, KVA, true).unwrap();
    // Page 1 is mapped but not cached, its accessed bit clear.
    let cpu1 = m.cpu(1).unwrap();
    cpu1.flush_local_all(false);
    cpu1.read(va(0)).unwrap();
    m.test_and_clear_accessed(&mm, va(1)).unwrap();
    cpu1.enter_lazy().unwrap();
    let before = m.all_entries();
    assert_eq!(cpu1.read(va(0)), Err(Fault::LazyUserAccess { va: va(0) }));
    assert_eq!(cpu1.write(va(0), 7), Err(Fault::LazyUserAccess { va: va(0) }));
    assert_eq!(cpu1.read(va(1)), Err(Fault::LazyUserAccess { va: va(1) }));
    assert_eq!(m.all_entries(), before);
    assert!(!m.pte(&mm, va(1)).unwrap().is_accessed());
    assert_eq!(m.frame_data(frames[0]), Ok(0));
    // Nothing mapped at all: an ordinary fault.
    assert_eq!(cpu1.read(va(5)), Err(Fault::NotMapped { va: va(5) }));
    // Kernel code runs on a lazy CPU, through its cached global entry too.
    cpu1.write(KVA, 3).unwrap();
    assert_eq!(m.frame_data(kframe), Ok(3));
    assert_eq!(cpu1.read(KVA), Ok(3));
    assert_eq!(cpu1.leave_lazy(), 0);
    assert_eq!(cpu1.read(va(1)), Ok(0));
    assert_eq!(m.violations(), []);
    // A cached entry of the lazy space whose PTE is gone (its flush not
    // made yet) is refused as well: not read through.
    cpu1.enter_lazy().unwrap();
    m.clear_pte(&mm, va(1)).unwrap();
    assert_eq!(cpu1.read(va(1)), Err(Fault::LazyUserAccess { va: va(1) }));
    assert_eq!(m.violations(), []);
}

/// What the mark does not defer: an entry of the kernel's mappings is
/// judged at the free as for any CPU. On a tagged TLB an entry of another
/// space than the one the CPU is lazy on is of an ASID it has not loaded:
/// judged when it loads that ASID, where a missing catch-up is caught.
#[test]
fn only_the_lazy_spaces_entries_wait_for_the_resume() {
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(2, 16)
    })
    .unwrap();
    let kernel = m.kernel_mm().clone();
    let kframe = m.map_new(&kernel, KVA, false).unwrap();
    let (other, others) = populate(&m, 2, 1, &[1], false);
    let (_, _) = populate(&m, 1, 1, &[1], false);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.read(KVA).unwrap();
    cpu1.enter_lazy().unwrap();
    m.clear_pte(&kernel, KVA).unwrap();
    m.free_frame(kframe).unwrap();
    m.clear_pte(&other, va(0)).unwrap();
    m.free_frame(others[0]).unwrap();
    let cpu = cpu1.id();
    // The other space's entry is of an ASID CPU 1 has not loaded: judged
    // when it loads it, and its PTE was cleared without any flush, so its
    // generation never moved and nothing flushes it.
    assert_eq!(
        m.violations(),
        [Violation::FreedWhileCached {
            frame: kframe,
            cpu,
            writable: false
        }]
    );
    assert_eq!(cpu1.leave_lazy(), 0);
    cpu1.switch_to(&other).unwrap();
    assert_eq!(
        m.violations()[1..],
        [Violation::LoadedWithStale {
            cpu,
            frame: others[0],
            va: va(0),
            writable: false
        }]
    );
}

/// The mark needs a user space to be lazy on, survives a second
/// `enter_lazy` (with what it remembered), and goes when the CPU comes
/// back online or the machine is reset.
#[test]
fn the_mark_and_its_edges() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    assert_eq!(cpu1.enter_lazy(), Err(MockError::NoUserSpace));
    cpu1.switch_to(&m.kernel_mm().clone()).unwrap();
    assert_eq!(cpu1.enter_lazy(), Err(MockError::NoUserSpace));
    assert!(!cpu1.is_lazy() && m.lazy_cpus().is_empty());
    assert_eq!(cpu1.leave_lazy(), 0);

    freed_behind_a_lazy_cpu(&m);
    cpu1.enter_lazy().unwrap();
    assert_eq!(cpu1.leave_lazy(), 1, "a second enter forgets nothing");

    let m = MockMachine::new(config(2, 16)).unwrap();
    freed_behind_a_lazy_cpu(&m);
    let cpu1 = m.cpu(1).unwrap();
    cpu1.go_offline();
    cpu1.come_online();
    assert!(!cpu1.is_lazy());
    assert_eq!(cpu1.leave_lazy(), 0);
    // CPU 0 still runs the first space, whose ASID is then not free.
    m.cpu(0).unwrap().switch_to(m.kernel_mm()).unwrap();
    freed_behind_a_lazy_cpu(&m);
    m.reset();
    assert!(m.lazy_cpus().is_empty());
    assert_eq!(m.violations(), []);
}

/// Page tables freed under a lazy CPU: its MMU may still walk the root it
/// keeps loaded (and its walk cache points into the table), so the
/// teardown's flush reaches it, one IPI; a teardown that frees data pages
/// only skips it, and the CPU catches up when it resumes. Either way the
/// oracle sees nothing wrong.
#[test]
fn a_teardown_that_frees_page_tables_reaches_lazy_cpus() {
    for free_tables in [false, true] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let rmap = MockRmap::new(&m, vec![m.space(&m.new_mm(asid(1)).unwrap())]);
        let mm = rmap.spaces()[0].mm().clone();
        for i in 0..4 {
            let f = m.alloc_frame().unwrap();
            rmap.map(f, 0, va(i), false, MappingFlags::empty()).unwrap();
        }
        for c in 0..2 {
            let cpu = m.cpu(c).unwrap();
            cpu.switch_to(&mm).unwrap();
            cpu.read(va(0)).unwrap();
        }
        let cpu1 = m.cpu(1).unwrap();
        cpu1.enter_lazy().unwrap();
        let mut kernel = MockKernel::new(&rmap);
        let mut gather = MmuGather::<64>::new();
        let before = m.ipis_sent();
        let summary = gather
            .unmap_range(
                &m.cpu(0).unwrap(),
                &rmap.spaces()[0],
                &mut kernel,
                PageRange::from_bounds(va(0), va(512)).unwrap(),
                free_tables,
                &mut TableFreePolicy::AfterFlush,
                &mut |_, _| panic!("every free is accepted"),
            )
            .unwrap();
        assert_eq!(summary.tables_freed > 0, free_tables);
        assert_eq!(
            m.ipis_sent() - before,
            u64::from(free_tables),
            "freeing tables: {free_tables}"
        );
        assert_eq!(m.violations(), []);
        cpu1.switch_to(&mm).unwrap();
        assert!(!cpu1.is_lazy());
        assert_eq!(m.violations(), []);
    }
}

/// Lazy mode names the space the CPU has loaded: any other space, the
/// kernel's, or a CPU with nothing loaded is refused with nothing changed,
/// so that no flush can skip a CPU that runs another space.
#[test]
fn lazy_mode_refuses_a_space_the_cpu_does_not_run() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let other = m.new_mm(asid(2)).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    let refused = Err(Error::NotLoaded { cpu: 1 });
    let refused_leave: Result<bool, Error> = Err(Error::NotLoaded { cpu: 1 });
    assert_eq!(enter_lazy_tlb(&cpu1, &mm), refused, "nothing loaded");
    cpu1.switch_to(&mm).unwrap();
    assert_eq!(enter_lazy_tlb(&cpu1, &other), refused);
    assert_eq!(enter_lazy_tlb(&cpu1, m.kernel_mm()), refused);
    assert_eq!(leave_lazy_tlb(&cpu1, &other), refused_leave);
    assert!(!cpu1.shootdown_state().is_lazy(cpu1.id()));
    assert_eq!(leave_lazy_tlb(&cpu1, &mm), Ok(false), "not lazy: nothing to do");
    enter_lazy_tlb(&cpu1, &mm).unwrap();
    assert_eq!(m.lazy_cpus(), CpuSet::new(), "the mock's mark is its own");
    assert!(cpu1.shootdown_state().is_lazy(cpu1.id()));
    assert_eq!(mm.running_cpus(&m.cpu(0).unwrap()), CpuSet::new());
    assert_eq!(leave_lazy_tlb(&cpu1, &mm), Ok(false), "nothing flushed meanwhile");
    assert_eq!(mm.running_cpus(&m.cpu(0).unwrap()), CpuSet::single(cpu1.id()));
    enter_lazy_tlb(&cpu1, &mm).unwrap();
    flush_tlb_page(&m.cpu(0).unwrap(), &mm, va(0)).unwrap();
    assert_eq!(
        leave_lazy_tlb(&cpu1, &mm),
        Ok(true),
        "the flush it skipped is caught up"
    );
}

/// A CPU taken out of the online set while it runs a user space (by the
/// raw switch: `take_cpu_offline` refuses that) and brought back still
/// counts in the set of that space (nothing takes it out), but no longer
/// has it loaded (`prepare_cpu_online` forgot it): lazy mode on that space
/// is refused until it switches to it again. Refusing on either sign alone
/// would let flushes skip a CPU that runs nothing it thinks it does.
#[test]
fn lazy_mode_needs_the_space_loaded_not_only_the_cpu_in_its_set() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    m.set_online(1, false).unwrap();
    cpu1.come_online();
    assert!(mm.cpus().contains(cpu1.id()), "still in the set");
    assert_eq!(cpu1.shootdown_state().loaded_asid(cpu1.id()), None);
    assert_eq!(enter_lazy_tlb(&cpu1, &mm), Err(Error::NotLoaded { cpu: 1 }));
    cpu1.switch_to(&mm).unwrap();
    assert_eq!(enter_lazy_tlb(&cpu1, &mm), Ok(()));
}
