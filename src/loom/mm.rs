//! Model checks with loom of what an address space's fences guarantee
//! (`scripts/loom.sh`: `RUSTFLAGS="--cfg loom" cargo test --release --lib loom::mm`):
//! `switch_mm` against the flush targets of an unmap, and deferred flushes
//! against `flush_tlb_batched_pending`.
//!
//! The models:
//!
//! - (e) a CPU switches to an address space (`switch_mm`) while another
//!   clears one of its PTEs and computes the flush targets
//!   (`flush_targets`): either the switcher is a target or its page-table
//!   walk sees the cleared PTE (the fence pair of `switch_mm` and
//!   `flush_targets`);
//! - (f) a reclaimer clears a PTE and defers its flush
//!   (`note_batched_pending`) while another CPU runs
//!   `flush_tlb_batched_pending`: if that call saw the deferral, the CPU
//!   caching the page has flushed it and cannot re-cache it from the
//!   cleared PTE; if it did not, the deferral is still pending;
//! - (g) two CPUs run `flush_tlb_batched_pending` for one deferral: one
//!   flushes; the other, if it finds the deferral already covered and
//!   skips, finds the stale entry gone too;
//! - (j) on a tagged TLB, a CPU that switched away (and left the space's
//!   set, its entry kept) switches back while another CPU clears a PTE and
//!   computes the flush targets: either it is a target, or its generation
//!   check sees the flush and drops the entry before it loads the ASID;
//! - (k) a lazy CPU leaves lazy mode (`leave_lazy_tlb`) while another CPU
//!   clears a PTE and computes the flush targets, which skip lazy CPUs:
//!   either it is a target or it catches up before it runs user code;
//! - (m) a batch that recorded a CPU as a target is flushed while that CPU
//!   switches away: the flush may skip it once it no longer runs the
//!   space, never while it still caches the page there;
//! - (n) on a tagged TLB, a CPU's own page flush of the space carries it
//!   forward by generation while another CPU's batched unmap, whose
//!   generation was published first, advances the space concurrently: the
//!   page flush must not carry the CPU past the batched one, which skips
//!   it once it switched away.
//! - (o) on a tagged TLB, a batch whose entry was aged (so that a CPU
//!   holding none of it may be credited with the flush instead of
//!   interrupted) is flushed while a CPU that owes a catch-up for an
//!   earlier flush switches back into the space: the credit must never
//!   carry that CPU past the earlier flush, whose stale entry it still
//!   holds.
//!
//! The model machine (simulated CPUs, their `Arch`, the bounds) is in
//! `machine.rs`, running a model in `run.rs`; the shootdown models (a) to
//! (d) are in `shootdown.rs`, the frame pool's (h) to (i) in `pool.rs`.

use loom::sync::atomic::Ordering;
use loom::sync::Arc;

use super::machine::{asid, cpu_id, Cpu, Machine, BASE, EMPTY, MAPPED};
use super::run::{cached_on, check, spawn_cpu};
use crate::{
    enter_lazy_tlb, flush_tlb_batched_pending, flush_tlb_page, leave_lazy_tlb, switch_mm, Asid, Frame,
    MmTlbState, Pte, PteFlags, TlbFlushUnmapBatch,
};

/// (e) CPU 1 switches to an address space (`switch_mm`) and then touches
/// page 0, while CPU 0 clears page 0's PTE and computes the flush targets
/// (`flush_targets`), as every unmap does. Either CPU 1 is a target, or
/// its walk found the PTE cleared and cached nothing: the full fences in
/// `switch_mm` (after adding the CPU to the set) and `flush_targets`
/// (before reading it) pair up, as a store-buffering pattern needs.
#[test]
fn e_switch_mm_races_with_an_unmapper() {
    let seen = check("(e) switch_mm vs flush_targets", 4, |seen| {
        let m = Machine::new(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        let mm0 = mm.clone();
        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            // The unmap: an atomic exchange of the PTE, then the targets.
            assert_eq!(cpu.m.pte.swap(EMPTY, Ordering::Relaxed), MAPPED);
            usize::from(mm0.flush_targets(&cpu).contains(cpu_id(1)))
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            // SAFETY: a model: the root is never dereferenced.
            unsafe { switch_mm(&cpu, None, &mm).unwrap() };
            usize::from(cpu.walk())
        });
        let targeted = h0.join().unwrap() == 1;
        let cached = h1.join().unwrap() == 1;
        assert!(
            targeted || !cached,
            "cpu1 cached page 0 from the PTE cpu0 cleared, and cpu0's flush targets miss cpu1"
        );
        seen.outcome(targeted);
    });
    seen.both_outcomes(["cpu1 was no target", "cpu1 was a target"]);
}

/// (f) CPU 1, a reclaimer, clears page 0's PTE and defers its flush
/// (`note_batched_pending`) while CPU 0 runs `flush_tlb_batched_pending`;
/// CPU 2 runs the address space with page 0 cached, and touches the page
/// again after every interrupt. If CPU 0's call saw the deferral, it
/// flushed CPU 2, and CPU 2 cannot cache page 0 again: its walk after the
/// flush sees the cleared PTE (the deferral's fetch_add releases the clear,
/// the flusher's load of `pending` acquires it, and the shootdown carries
/// it on). If it did not, the deferral is still pending.
#[test]
fn f_batched_pending_flush_covers_the_deferred_clear() {
    let seen = check("(f) deferral vs flush_tlb_batched_pending", 3, |seen| {
        let m = Machine::new(3);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        cached_on(&m, seen, 2, &mm);

        let mm0 = mm.clone();
        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            let flushed = flush_tlb_batched_pending(&cpu, &mm0).unwrap();
            cpu.finish();
            usize::from(flushed)
        });
        let mm1 = mm.clone();
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            assert_eq!(cpu.m.pte.swap(EMPTY, Ordering::Relaxed), MAPPED);
            mm1.note_batched_pending();
            cpu.finish()
        });
        let h2 = spawn_cpu(&m, seen, 2, |cpu| {
            cpu.walks_after_irq.set(true);
            cpu.finish()
        });
        let flushed = h0.join().unwrap() == 1;
        h1.join().unwrap();
        h2.join().unwrap();
        if flushed {
            assert!(
                !m.cached[2].load(Ordering::Relaxed),
                "cpu0's flush_tlb_batched_pending saw the deferral, yet cpu2 still caches page 0"
            );
            assert!(!mm.batched_flush_pending());
        } else {
            assert!(mm.batched_flush_pending(), "a deferral no flush covered was lost");
        }
        seen.outcome(flushed);
    });
    seen.both_outcomes(["cpu0 missed the deferral", "cpu0 flushed the deferral"]);
}

/// (g) Page 0's PTE was cleared and its flush deferred; CPU 1 has it
/// cached. CPU 0 and CPU 1 both run `flush_tlb_batched_pending`. CPU 1
/// with targets {1} flushes locally, CPU 0 shoots at CPU 1, unless it finds
/// the deferral already covered by CPU 1's flush and skips: then it must
/// find CPU 1's entry gone (the flusher's `fetch_max` releases its flush,
/// the skipper's load of `flushed` acquires it).
#[test]
fn g_skipped_batched_pending_flush_comes_after_the_flush() {
    let seen = check("(g) flush_tlb_batched_pending twice", 4, |seen| {
        let m = Machine::new(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        cached_on(&m, seen, 1, &mm);
        m.pte.store(EMPTY, Ordering::Relaxed);
        mm.note_batched_pending();

        let mm0 = mm.clone();
        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            let flushed = flush_tlb_batched_pending(&cpu, &mm0).unwrap();
            assert!(
                !cpu.m.cached[1].load(Ordering::Relaxed),
                "cpu0's flush_tlb_batched_pending returned Ok({flushed}) while cpu1 still caches page 0"
            );
            cpu.finish();
            usize::from(flushed)
        });
        let mm1 = mm.clone();
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            flush_tlb_batched_pending(&cpu, &mm1).unwrap();
            // Its own local flush: it never skips, since cpu0's shootdown
            // completes only once cpu1 takes interrupts, in `finish`.
            assert!(!cpu.m.cached[1].load(Ordering::Relaxed));
            cpu.finish()
        });
        let cpu0_flushed = h0.join().unwrap() == 1;
        h1.join().unwrap();
        assert!(!m.cached[1].load(Ordering::Relaxed));
        assert!(!mm.batched_flush_pending());
        seen.outcome(cpu0_flushed);
    });
    seen.both_outcomes(["cpu0 skipped", "cpu0 flushed"]);
}

/// (j) Tagged TLB. CPU 1 ran the address space with page 0 cached, then
/// switched to another one: it left the space's set, and its entry stays,
/// tagged. It switches back (`switch_mm`) and looks at its TLB, while CPU 0
/// clears page 0's PTE and computes the flush targets (which advances the
/// space's generation). Either CPU 1 is a target (it put itself back in the
/// set before CPU 0 read it), or its generation check, after the fence,
/// saw the advance and flushed the ASID before loading it: it never runs
/// the space with the stale entry and no flush on its way. Recording the
/// loaded ASID after the generation read, or skipping the check, fails.
#[test]
fn j_tagged_switch_back_races_with_an_unmapper() {
    let seen = check("(j) tagged switch back vs flush_targets", 4, |seen| {
        let m = Machine::tagged(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        let other = Arc::new(MmTlbState::new(Asid::new(2).unwrap(), 0x2000));
        cached_on(&m, seen, 1, &mm);
        let away = Cpu::detached(1, &m, seen);
        // SAFETY: a model: the roots are never dereferenced.
        unsafe { switch_mm(&away, Some(&mm), &other).unwrap() };
        assert!(m.caches(1), "a tagged TLB keeps the entry");
        let mm0 = mm.clone();
        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            assert_eq!(cpu.m.pte.swap(EMPTY, Ordering::Relaxed), MAPPED);
            usize::from(mm0.flush_targets(&cpu).contains(cpu_id(1)))
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            // SAFETY: as above.
            unsafe { switch_mm(&cpu, Some(&other), &mm).unwrap() };
            usize::from(cpu.m.caches(1))
        });
        let targeted = h0.join().unwrap() == 1;
        let stale = h1.join().unwrap() == 1;
        assert!(
            targeted || !stale,
            "cpu1 loaded the space with page 0's stale entry, and cpu0's flush targets miss it"
        );
        seen.outcome(targeted);
    });
    seen.both_outcomes(["cpu1 caught up by itself", "cpu1 was a target"]);
}

/// (k) CPU 1 runs the address space with page 0 cached and is lazy on it
/// (`enter_lazy_tlb`). It leaves lazy mode (`leave_lazy_tlb`) and looks at
/// its TLB, while CPU 0 clears page 0's PTE and computes the flush
/// targets, which leave lazy CPUs out. Either CPU 1 is a target (its mark
/// was gone when CPU 0 read the lazy set), or its catch-up saw the advanced
/// generation and flushed. Skipping the fence after clearing the mark, or
/// the catch-up, fails.
#[test]
fn k_lazy_cpu_resumes_while_an_unmapper_skips_it() {
    let seen = check("(k) leave_lazy_tlb vs flush_targets", 4, |seen| {
        let m = Machine::new(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        cached_on(&m, seen, 1, &mm);
        enter_lazy_tlb(&Cpu::detached(1, &m, seen), &mm).unwrap();
        let mm0 = mm.clone();
        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            assert_eq!(cpu.m.pte.swap(EMPTY, Ordering::Relaxed), MAPPED);
            usize::from(mm0.flush_targets(&cpu).contains(cpu_id(1)))
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            leave_lazy_tlb(&cpu, &mm).unwrap();
            usize::from(cpu.m.caches(1))
        });
        let targeted = h0.join().unwrap() == 1;
        let stale = h1.join().unwrap() == 1;
        assert!(
            targeted || !stale,
            "cpu1 resumed the space with page 0's stale entry, and cpu0's flush skipped it"
        );
        seen.outcome(targeted);
    });
    seen.both_outcomes(["cpu1 caught up by itself", "cpu1 was a target"]);
}

/// (m) Untagged TLB. CPU 1 runs the address space with page 0 cached. CPU 0
/// clears page 0's PTE and records it in a batch (`add_pending`: CPU 1 is
/// a target unless its switch already left the set), then flushes the
/// batch and checks CPU 1's TLB, as a free would; CPU 1 meanwhile switches
/// to another address space. The flush may leave CPU 1 out once it runs
/// the other space (its switch dropped the entry), never while it still
/// caches the page: a flush that skips every recorded target fails. (The
/// window of a switch that recorded its next ASID but has not loaded the
/// next root is not reached here; model (h') reaches it, through the same
/// `generation::running` the pool shares with the batch.)
#[test]
fn m_batch_flush_races_with_a_target_switching_away() {
    let seen = check("(m) batch flush vs a target switching away", 4, |seen| {
        let m = Machine::new(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        let other = Arc::new(MmTlbState::new(Asid::new(2).unwrap(), 0x2000));
        cached_on(&m, seen, 1, &mm);
        let mm0 = mm.clone();
        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            assert_eq!(cpu.m.pte.swap(EMPTY, Ordering::Relaxed), MAPPED);
            let old = Pte::new(Frame(0x100), PteFlags::PRESENT | PteFlags::USER);
            let mut batch = TlbFlushUnmapBatch::new();
            // CPU 1 is a target unless its switch took it out of the set
            // before the add read it.
            batch.add_pending(&cpu, &mm0, BASE, old).unwrap();
            let report = batch.flush(&cpu).unwrap();
            assert!(
                !cpu.m.caches(1),
                "the batch's flush skipped cpu1 while it still cached page 0"
            );
            cpu.finish();
            report.remote_cpus
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            // SAFETY: a model: the roots are never dereferenced.
            unsafe { switch_mm(&cpu, Some(&mm), &other).unwrap() };
            cpu.finish()
        });
        let interrupted = h0.join().unwrap() == 1;
        h1.join().unwrap();
        seen.outcome(interrupted);
    });
    seen.both_outcomes(["cpu1 was left out", "cpu1 was interrupted"]);
}

/// (n) Tagged TLB. CPU 1 runs the address space with page 0 cached; it
/// flushes page 1 of the space itself (`flush_tlb_page`, a request of one
/// page that carries the generation step of its advance, which CPU 1
/// follows), switches to another space and back, and the model then looks
/// at its TLB once every CPU is done. CPU 0 meanwhile clears page 0's PTE,
/// records it in a batch (which advances the generation too) and flushes
/// the batch, which skips CPU 1 if it has switched away by then. Both
/// advances publish an epoch and then store it: when CPU 0's epoch, the
/// older, is stored after CPU 1's, a step that ended at CPU 1's value would
/// carry CPU 1 past a flush it never did, and its return would load the
/// ASID with page 0's stale entry. Each advance must store a value of its
/// own (`MmTlbState::flush_targets`): one that was overtaken publishes
/// another. Taking the first epoch whatever the store found fails.
#[test]
fn n_a_page_flush_step_races_with_a_batched_unmap() {
    let seen = check("(n) page flush step vs batched unmap", 4, |seen| {
        let m = Machine::tagged(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        let other = Arc::new(MmTlbState::new(Asid::new(2).unwrap(), 0x2000));
        cached_on(&m, seen, 1, &mm);
        let mm0 = mm.clone();
        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            assert_eq!(cpu.m.pte.swap(EMPTY, Ordering::Relaxed), MAPPED);
            let old = Pte::new(Frame(0x100), PteFlags::PRESENT | PteFlags::USER);
            let mut batch = TlbFlushUnmapBatch::new();
            batch.add_pending(&cpu, &mm0, BASE, old).unwrap();
            let report = batch.flush(&cpu).unwrap();
            cpu.finish();
            report.remote_cpus
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            // Page flushes of page 0 (the batch's, if it interrupts CPU 1)
            // drop the entry, and loading the space may walk it again.
            cpu.refill_after_flush.set(true);
            flush_tlb_page(&cpu, &mm, BASE + crate::PAGE_SIZE).unwrap();
            // SAFETY: a model: the roots are never dereferenced.
            unsafe {
                switch_mm(&cpu, Some(&mm), &other).unwrap();
                switch_mm(&cpu, Some(&other), &mm).unwrap();
            }
            cpu.finish()
        });
        let interrupted = h0.join().unwrap() == 1;
        h1.join().unwrap();
        assert!(
            !m.caches(1),
            "cpu1 runs the space again with page 0's stale entry: the batch's flush skipped it \
             and its generation check did not see that flush"
        );
        seen.outcome(interrupted);
    });
    seen.both_outcomes(["cpu1 caught up by itself", "cpu1 was interrupted"]);
}

/// (o) Tagged TLB. Page 1 was aged (its accessed bit cleared at an epoch
/// every later flush follows) and is never cached. CPU 1 ran the space,
/// cached page 0, and switched to another space, keeping the entry
/// tagged. CPU 0 then unmapped page 0 and flushed it (CPU 1 was no target:
/// it owes a catch-up, which drops the entry before it loads the ASID
/// again). Now CPU 1 switches back while CPU 0 clears page 1 and flushes a
/// batch of it that carries the aging epoch. CPU 1 holds no entry of page
/// 1 and flushed its ASID after the aging, so the batch may credit it with
/// its generation step instead of interrupting it, but only if CPU 1 had
/// carried out every flush up to the step's start (`caught >= step.from`
/// in `TlbFlushUnmapBatch::flush`). A CPU that has put itself back in the
/// space's set but not yet caught up is behind the earlier flush: credited
/// then, its catch-up would find itself current and load the ASID with page
/// 0's stale entry. Dropping that condition fails.
#[test]
fn o_a_credit_never_skips_a_catch_up_owed_for_an_earlier_flush() {
    let seen = check("(o) aged batch credit vs a switch back", 4, |seen| {
        let m = Machine::tagged(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        let other = Arc::new(MmTlbState::new(Asid::new(2).unwrap(), 0x2000));
        let aged = m.tlb.publish_epoch();
        cached_on(&m, seen, 1, &mm);
        let away = Cpu::detached(1, &m, seen);
        // SAFETY: a model: the roots are never dereferenced.
        unsafe { switch_mm(&away, Some(&mm), &other).unwrap() };
        let cpu0 = Cpu::detached(0, &m, seen);
        assert_eq!(m.pte.swap(EMPTY, Ordering::Relaxed), MAPPED);
        let report = flush_tlb_page(&cpu0, &mm, BASE).unwrap();
        assert_eq!(report.remote_cpus, 0, "cpu1 switched away before the unmap");
        assert!(m.caches(1), "a tagged TLB keeps the entry until the catch-up");
        let mm0 = mm.clone();
        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            let page1 = BASE + crate::PAGE_SIZE;
            let old = Pte::new(Frame(0x101), PteFlags::PRESENT | PteFlags::USER);
            let mut batch = TlbFlushUnmapBatch::new();
            let pages = batch.check_add(&cpu, &mm0, page1).unwrap();
            let (targets, step) = mm0.flush_targets_step(&cpu);
            batch.record_pending(&cpu, &mm0, pages, old, (&targets, step), Some(aged));
            batch.flush(&cpu).unwrap();
            let credited = cpu.m.tlb.stats().generations_granted > 0;
            cpu.finish();
            usize::from(credited)
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            // SAFETY: as above.
            unsafe { switch_mm(&cpu, Some(&other), &mm).unwrap() };
            cpu.finish()
        });
        let credited = h0.join().unwrap() == 1;
        h1.join().unwrap();
        assert!(
            !m.caches(1),
            "cpu1 runs the space again with page 0's stale entry: the batch credited it \
             past a flush it had not caught up with"
        );
        seen.outcome(credited);
    });
    seen.both_outcomes(["cpu1 was not credited", "cpu1 was credited"]);
}
