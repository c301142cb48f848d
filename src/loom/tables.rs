//! Model checks with loom of the real `TableHold`: page tables a teardown
//! keeps for the CPUs that were lazy at its flush, instead of interrupting
//! them (`scripts/loom.sh loom::tables`).
//!
//! - (p) on a tagged TLB, CPU 1 is lazy on the address space with a
//!   cached pointer to a page table (the machine's page-0 entry stands for
//!   it: [`Machine::pte`] is the parent's link to the table, `cached` the
//!   walk-cache pointer). CPU 0 unlinks the table and flushes with the
//!   teardown's split (`flush_sparing_lazy`: running, non-lazy CPUs only),
//!   holds the table if CPU 1 was lazy then, and asks the hold for it back
//!   (`TableHold::release_passed`), while CPU 1 resumes the space
//!   (`leave_lazy_tlb`; (p')) or switches to another space and back
//!   (`switch_mm` both ways; (p'')). CPU 1's MMU may walk through the
//!   pointer at every step it takes in the crate while ASID 1's root is
//!   loaded (`Cpu::watch_freed`). The table comes back (is freed) only
//!   once CPU 1 can no longer walk through its pointer: never while it is
//!   lazy with the pointer cached, nor between the end of its lazy mark
//!   and its catch-up, nor between its record of the next ASID and the
//!   load of the next root, nor after it runs the space again with it.
//!   Releasing regardless of the lazy set, judging a CPU passed once its
//!   lazy mark is gone, or by its loaded ASID without the one it is
//!   leaving, fails.
//!
//! The model machine is in `machine.rs`, running a model in `run.rs`.

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

use super::machine::{asid, Cpu, Machine, EMPTY, MAPPED};
use super::run::{cached_on, check, spawn_cpu};
use crate::batch::machine_id;
use crate::gather::{flush_sparing_lazy, Holder};
use crate::{
    enter_lazy_tlb, leave_lazy_tlb, switch_mm, Asid, FlushRequest, Frame, MmTlbState, OwnedFrame, TableHold,
};

/// The page-table frame CPU 0 unlinks.
const TABLE: Frame = Frame(0x200);

/// How many times CPU 0 asks its hold for passed tables.
const RELEASE_TRIES: usize = 2;

/// How CPU 1 stops walking through its pointer in model (p).
#[derive(Clone, Copy)]
enum Resume {
    /// `leave_lazy_tlb`: its catch-up flushes the ASID.
    Leave,
    /// `switch_mm` to another space (the pointer stays, tagged) and back.
    SwitchAwayAndBack,
}

fn model(name: &str, resume: Resume) {
    let seen = check(name, 3, move |seen| {
        let m = Machine::tagged(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        let other = Arc::new(MmTlbState::new(Asid::new(2).unwrap(), 0x2000));
        cached_on(&m, seen, 1, &mm);
        enter_lazy_tlb(&Cpu::detached(1, &m, seen), &mm).unwrap();
        let freed = Arc::new(AtomicBool::new(false));
        let flag = freed.clone();
        let mm0 = mm.clone();
        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            // The unlink (Relaxed: only the crate's own orderings may order
            // it before the generation the flush publishes).
            assert_eq!(cpu.m.pte.swap(EMPTY, Ordering::Relaxed), MAPPED);
            // The table's whole span: above the ceiling, the whole ASID.
            let mut request = FlushRequest::for_asid(asid());
            let (_, wait) = flush_sparing_lazy(&cpu, &mm0, &mut request).unwrap();
            let mut back = false;
            match wait {
                // CPU 1 was a target: the flush reached it, free at once.
                None => back = true,
                Some(wait) => {
                    let mut hold = TableHold::<1>::new();
                    // SAFETY: a model: the frame is never dereferenced.
                    let mut table = Some(unsafe { OwnedFrame::new(TABLE) });
                    assert_eq!(hold.take(machine_id(&cpu), &wait, &mut || table.take()), 1);
                    for _ in 0..RELEASE_TRIES {
                        if !hold.release_passed(&cpu).is_empty() {
                            back = true;
                            break;
                        }
                        thread::yield_now();
                    }
                }
            }
            if back {
                flag.store(true, Ordering::SeqCst);
            }
            cpu.finish();
            usize::from(back)
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            // Its MMU may walk through the pointer at every step it takes
            // in the crate while ASID 1's root is loaded.
            cpu.hw_asid.set(Some(asid()));
            *cpu.watch_freed.borrow_mut() = Some(freed.clone());
            // Lazy, its pointer cached: its MMU may walk through it now.
            let early = freed.load(Ordering::SeqCst) && cpu.m.caches(1);
            match resume {
                Resume::Leave => {
                    leave_lazy_tlb(&cpu, &mm).unwrap();
                }
                Resume::SwitchAwayAndBack => {
                    // SAFETY: a model: the roots are never dereferenced.
                    unsafe { switch_mm(&cpu, Some(&mm), &other).unwrap() };
                    // SAFETY: as above.
                    unsafe { switch_mm(&cpu, Some(&other), &mm).unwrap() };
                }
            }
            // Running the space again: its walks start from the root.
            cpu.walk();
            let late = freed.load(Ordering::SeqCst) && cpu.m.caches(1);
            let walked = cpu.walked_freed.get();
            cpu.finish();
            usize::from(early || late || walked)
        });
        let back = h0.join().unwrap() == 1;
        let stale = h1.join().unwrap() == 1;
        assert!(
            !stale,
            "cpu0 freed the table while cpu1 could still walk through its cached pointer"
        );
        assert!(
            !back || !m.caches(1),
            "the table came back and cpu1 still points to it"
        );
        seen.outcome(back);
    });
    seen.both_outcomes(["cpu0 kept the table", "cpu0 got the table back"]);
}

/// (p') CPU 1 resumes the space it is lazy on (`leave_lazy_tlb`).
#[test]
fn p_lazy_cpu_resumes_while_a_teardown_holds_its_table() {
    model("(p') TableHold vs leave_lazy_tlb", Resume::Leave);
}

/// (p'') CPU 1 switches to another space and back (`switch_mm`).
#[test]
fn p_lazy_cpu_switches_away_and_back_while_a_teardown_holds_its_table() {
    model(
        "(p'') TableHold vs switch_mm away and back",
        Resume::SwitchAwayAndBack,
    );
}
