//! Model checks of the cross-CPU shootdown protocol with loom
//! (`scripts/loom.sh`: `RUSTFLAGS="--cfg loom" cargo test --release --test loom`).
//!
//! Under `--cfg loom` the crate's own atomics are loom's (`src/sync.rs`), so
//! these models explore the interleavings and weak-memory outcomes of the
//! real `shootdown`, `ipi_sync` and `handle_flush_ipi` and of the inboxes,
//! `ipi_pending` flags and acknowledgement counters behind them, not of a
//! copy.
//!
//! Each simulated CPU is a loom thread with an [`Arch`] of its own
//! ([`Cpu`]). Sending the flush IPI sets the target's "interrupt pending"
//! latch; the target takes the interrupt (calls [`handle_flush_ipi`], with
//! interrupts disabled as hardware enters a handler) at its instruction
//! boundaries, which here are [`Arch::relax`] (called in the crate's wait
//! loop), the moment it enables interrupts, and its idle loop, and only
//! while its interrupts are enabled. The local flushes count, per CPU and
//! page, what was invalidated, so a model can check that a request was
//! carried out, once, by every target *before* the initiator's
//! `shootdown` returned.
//!
//! The models:
//!
//! - (a) two CPUs shoot at each other at the same time with interrupts
//!   disabled: both return (each waiting initiator serves the other's
//!   request from its own inbox);
//! - (b) two initiators shoot at the same third CPU: both requests are
//!   carried out whether they arrive with one interrupt or two, and some
//!   execution does carry both with one;
//! - (c) CPU 0 (interrupts off) and CPU 1 (interrupts on) shoot at each
//!   other, so CPU 0 must serve CPU 1's request while it waits; CPU 0 then
//!   runs `ipi_sync`, which must return, and not while CPU 1 is inside an
//!   interrupts-off lockless page-table walk that began before it;
//! - (d) one CPU shoots at another twice in a row, reusing its request
//!   slot at once.
//!
//! Every model ends by checking that nothing was lost: every shootdown and
//! sync returned, each target carried out each request exactly once, no
//! inbox still holds a request, no latched IPI was left untaken, and the
//! crate's counters agree with what the CPUs did.
//!
//! Bounds: each model has a preemption bound (`LOOM_MAX_PREEMPTIONS`
//! overrides them all): loom explores every interleaving with at most that
//! many preemptive switches between CPUs, plus any number where a CPU
//! spins or halts. A waiting CPU that spins [`FRUITLESS_SPINS`] times in a
//! row without serving anything ends the exploration of that execution's
//! remaining alternatives (see there). An idle CPU halts (parks) until an
//! IPI or the end of the model wakes it.
#![cfg(loom)]

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering as StdOrdering};
use std::sync::Arc as StdArc;

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use tlb_batch::{
    handle_flush_ipi, ipi_sync, shootdown, Arch, Asid, CpuId, CpuSet, FlushRequest, ShootdownReport,
    TlbShootdown, PAGE_SIZE,
};

/// The most CPUs a model runs (loom allows 5 threads, the main one included).
const MAX_MODEL_CPUS: usize = 3;

/// How many `relax` calls in a row a waiting CPU may make without serving
/// anything before loom stops exploring alternatives for the rest of that
/// execution, which then runs to its end on loom's default schedule with
/// every assertion still checked.
///
/// loom's scheduler is not fair: while two CPUs spin and a third has work,
/// it explores endless schedules in which only the spinning two run, which
/// CPUs that all run at once never do. A fruitless spin re-reads the
/// acknowledgement counter and the CPU's own empty inbox and clears an
/// `ipi_pending` flag that is already clear, so schedules with more of
/// them in a row show nothing that schedules with fewer do not; this bound
/// trims the repetitions, like the preemption bound trims switches. A real
/// livelock still shows: on the default schedule it spins until loom's
/// branch limit stops it with an error.
const FRUITLESS_SPINS: usize = 3;

/// Where the models' pages start: page `p` is at `BASE + p * PAGE_SIZE`
/// in ASID 1. Each request flushes one page, its own, so what a CPU
/// flushed says which requests it carried out.
const BASE: u64 = 0x40_0000;

/// Pages the models use.
const PAGES: usize = 4;

fn asid() -> Asid {
    Asid::new(1).unwrap()
}

fn cpu_id(i: usize) -> CpuId {
    CpuId::new(i).unwrap()
}

fn cpu_set(ids: &[usize]) -> CpuSet {
    ids.iter().map(|&i| cpu_id(i)).collect()
}

/// The request that flushes page `page`.
fn request_of(page: usize) -> FlushRequest {
    let mut req = FlushRequest::new();
    req.add_page(asid(), BASE + page as u64 * PAGE_SIZE, 33).unwrap();
    req
}

/// The state all simulated CPUs share.
struct Machine {
    cpus: usize,
    tlb: TlbShootdown,
    /// Per CPU: the interrupt controller's latch for the flush vector.
    irq_pending: Vec<AtomicBool>,
    /// Per CPU and page: how many times the CPU invalidated the page.
    flushes: Vec<Vec<AtomicUsize>>,
    /// Flush IPIs the crate asked for, in all.
    ipis_sent: AtomicUsize,
    /// CPUs done with their part of the model.
    done: AtomicUsize,
    /// Each CPU's loom thread, once it runs, so that an IPI or the last CPU
    /// finishing can wake it from its idle `hlt`. A plain mutex: loom never
    /// switches threads while it is held.
    threads: std::sync::Mutex<Vec<Option<thread::Thread>>>,
}

impl Machine {
    fn new(cpus: usize) -> Arc<Machine> {
        assert!(cpus <= MAX_MODEL_CPUS);
        Arc::new(Machine {
            cpus,
            tlb: TlbShootdown::new(),
            irq_pending: (0..cpus).map(|_| AtomicBool::new(false)).collect(),
            flushes: (0..cpus)
                .map(|_| (0..PAGES).map(|_| AtomicUsize::new(0)).collect())
                .collect(),
            ipis_sent: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            threads: std::sync::Mutex::new(vec![None; cpus]),
        })
    }

    /// Wakes CPU `cpu` from `hlt` (or makes its next `hlt` return at once).
    /// A CPU whose thread has not started yet needs no wake-up: it looks at
    /// its interrupt latch and at `done` before it ever halts.
    fn wake(&self, cpu: usize) {
        if let Some(t) = &self.threads.lock().unwrap()[cpu] {
            t.unpark();
        }
    }

    /// How many times CPU `cpu` has invalidated page `page`.
    fn flushed(&self, cpu: usize, page: usize) -> usize {
        self.flushes[cpu][page].load(Ordering::Relaxed)
    }
}

/// Per-CPU events counted across every execution of one model, to show
/// that the interesting interleavings were in fact explored.
#[derive(Default)]
struct Seen {
    executions: StdAtomicUsize,
    /// A request served by a CPU whose interrupts were off, outside an
    /// interrupt: from the wait loop of its own shootdown or sync.
    served_while_waiting: StdAtomicUsize,
    /// One interrupt that carried out two requests.
    coalesced: StdAtomicUsize,
}

/// One simulated CPU: its `Arch`. Interrupt state is the CPU's own, so it
/// lives in plain cells, outside the model's shared memory.
struct Cpu {
    index: usize,
    m: Arc<Machine>,
    seen: StdArc<Seen>,
    irqs_enabled: Cell<bool>,
    in_irq: Cell<bool>,
    irqs_taken: Cell<usize>,
    /// Whether the CPU served a request since its last `relax`.
    progressed: Cell<bool>,
    /// `relax` calls in a row without progress.
    fruitless: Cell<usize>,
}

impl Cpu {
    /// CPU `index` of `m`; call it on the CPU's own loom thread.
    fn new(index: usize, m: &Arc<Machine>, seen: &StdArc<Seen>) -> Cpu {
        m.threads.lock().unwrap()[index] = Some(thread::current());
        Cpu {
            index,
            m: m.clone(),
            seen: seen.clone(),
            irqs_enabled: Cell::new(true),
            in_irq: Cell::new(false),
            irqs_taken: Cell::new(0),
            progressed: Cell::new(false),
            fruitless: Cell::new(0),
        }
    }

    /// An instruction boundary: takes a pending flush interrupt if
    /// interrupts are enabled (the handler runs with them disabled, as
    /// hardware enters it).
    fn boundary(&self) {
        if !self.irqs_enabled.get() || self.in_irq.get() {
            return;
        }
        if self.m.irq_pending[self.index].swap(false, Ordering::Acquire) {
            self.in_irq.set(true);
            let served = handle_flush_ipi(self);
            self.in_irq.set(false);
            self.irqs_taken.set(self.irqs_taken.get() + 1);
            self.progressed.set(true);
            if served >= 2 {
                self.seen.coalesced.fetch_add(1, StdOrdering::Relaxed);
            }
        }
    }

    fn disable_interrupts(&self) {
        self.irqs_enabled.set(false);
    }

    /// Enables interrupts; a latched one fires at once.
    fn enable_interrupts(&self) {
        self.irqs_enabled.set(true);
        self.boundary();
    }

    /// Shoots down page `page` on `targets`; checks that the shootdown
    /// returned and that every remote target had carried the request out
    /// by then.
    fn shoot(&self, page: usize, targets: &[usize]) -> ShootdownReport {
        let report = shootdown(self, &cpu_set(targets), &request_of(page)).unwrap();
        for &t in targets.iter().filter(|&&t| t != self.index) {
            assert_eq!(
                self.m.flushed(t, page),
                1,
                "cpu{} returned from its shootdown before cpu{t} flushed page {page}",
                self.index,
            );
        }
        report
    }

    /// Marks this CPU done, then idles with interrupts enabled until every
    /// CPU is done, taking interrupts; returns how many it took in all.
    ///
    /// The idle loop halts (parks) rather than spins: loom cannot tell a
    /// spinning idle CPU from one making progress, and three spinning CPUs
    /// give it unbounded schedules.
    fn finish(self) -> usize {
        self.enable_interrupts();
        self.m.done.fetch_add(1, Ordering::SeqCst);
        for cpu in (0..self.m.cpus).filter(|&c| c != self.index) {
            self.m.wake(cpu);
        }
        loop {
            self.boundary();
            if self.m.done.load(Ordering::SeqCst) == self.m.cpus {
                break;
            }
            // `sti; hlt`: sleeps until an IPI or the last CPU finishing.
            thread::park();
        }
        // Every IPI was sent before its initiator finished, so a latched
        // one is visible now and is taken here.
        self.boundary();
        self.irqs_taken.get()
    }
}

// SAFETY: a model machine: each `Cpu` is used only on its own loom thread,
// the local flushes are recorded before they return, and every IPI reaches
// its target's latch, which the target polls while it runs or idles.
unsafe impl Arch for Cpu {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;

    fn current_cpu(&self) -> CpuId {
        cpu_id(self.index)
    }

    fn online_cpus(&self) -> CpuSet {
        CpuSet::first(self.m.cpus).unwrap()
    }

    fn shootdown_state(&self) -> &TlbShootdown {
        &self.m.tlb
    }

    fn flush_local_page(&self, asid: Asid, va: u64) {
        assert_eq!(asid, self::asid());
        let page = ((va - BASE) / PAGE_SIZE) as usize;
        // The models never have a CPU target itself, so every flush is
        // another CPU's request.
        if !self.irqs_enabled.get() && !self.in_irq.get() {
            self.seen.served_while_waiting.fetch_add(1, StdOrdering::Relaxed);
        }
        self.m.flushes[self.index][page].fetch_add(1, Ordering::Relaxed);
        self.progressed.set(true);
    }

    fn flush_local_asid(&self, asid: Asid) {
        panic!(
            "cpu{}: a whole-ASID flush of {asid:?}; the models send single pages",
            self.index
        );
    }

    fn flush_local_all(&self, _include_global: bool) {
        panic!("cpu{}: a full flush; the models send single pages", self.index);
    }

    fn send_flush_ipi(&self, targets: &CpuSet) {
        for t in targets {
            assert_ne!(t.index(), self.index, "the crate interrupted its own CPU");
            self.m.ipis_sent.fetch_add(1, Ordering::Relaxed);
            // Release: the interrupt arrives after what the sender did
            // before sending it (x86 orders the ICR write after earlier
            // stores; the kernel's Arch must guarantee as much). The
            // crate's own orderings are still checked: a waiting initiator
            // takes requests without any interrupt. A swap, not a store:
            // loom 0.7 can let a plain store land between the read and the
            // write of a concurrent swap (tokio-rs/loom#254), which loses
            // the interrupt in the model though never on hardware.
            self.m.irq_pending[t.index()].swap(true, Ordering::Release);
            self.m.wake(t.index());
        }
    }

    unsafe fn switch_address_space(&self, _asid: Asid, _root: u64) {
        unreachable!("the models never switch address spaces");
    }

    fn relax(&self) {
        self.boundary();
        if self.progressed.replace(false) {
            self.fruitless.set(0);
        } else {
            self.fruitless.set(self.fruitless.get() + 1);
            if self.fruitless.get() == FRUITLESS_SPINS {
                // Weak fairness: see FRUITLESS_SPINS.
                loom::skip_branch();
            }
        }
        thread::yield_now();
    }
}

/// Starts CPU `index` of `m` on a loom thread of its own, running `body`.
fn spawn_cpu(
    m: &Arc<Machine>,
    seen: &StdArc<Seen>,
    index: usize,
    body: impl FnOnce(Cpu) -> usize + 'static,
) -> thread::JoinHandle<usize> {
    let (m, seen) = (m.clone(), seen.clone());
    thread::spawn(move || body(Cpu::new(index, &m, &seen)))
}

/// Runs `model` under loom with `bound` preemptions (unless
/// `LOOM_MAX_PREEMPTIONS` says otherwise) and returns what its executions
/// saw, for the model to check that its interesting cases were reached.
fn check(name: &str, bound: usize, model: impl Fn(&StdArc<Seen>) + Sync + Send + 'static) -> StdArc<Seen> {
    let seen = StdArc::new(Seen::default());
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(bound);
    }
    let bound = builder.preemption_bound;
    let s = seen.clone();
    let start = std::time::Instant::now();
    builder.check(move || {
        s.executions.fetch_add(1, StdOrdering::Relaxed);
        model(&s);
    });
    eprintln!(
        "loom model {name}: {} executions, preemption bound {bound:?}, {:.1?}; \
         requests served while waiting: {}, interrupts carrying two requests: {}",
        seen.executions.load(StdOrdering::Relaxed),
        start.elapsed(),
        seen.served_while_waiting.load(StdOrdering::Relaxed),
        seen.coalesced.load(StdOrdering::Relaxed),
    );
    seen
}

/// The end-of-model checks: nothing lost, nothing done twice.
///
/// `shootdowns[p]` lists the (remote) targets of the shootdown of page
/// `p`, empty for a page nobody shot down; `syncs` counts the requests
/// `ipi_sync` made (one per remote CPU); `irqs_taken[i]` is what CPU `i`
/// took.
fn nothing_lost(m: &Machine, shootdowns: &[&[usize]], syncs: u64, irqs_taken: &[usize]) {
    let mut expected_received = syncs;
    for cpu in 0..m.cpus {
        for (page, targets) in shootdowns.iter().enumerate() {
            let want = usize::from(targets.contains(&cpu));
            let got = m.flushed(cpu, page);
            assert_eq!(
                got, want,
                "cpu{cpu} carried out the request for page {page} {got} times"
            );
        }
        assert_eq!(
            m.tlb.pending_requests(cpu_id(cpu)),
            0,
            "cpu{cpu}'s inbox still holds a request"
        );
    }
    for targets in shootdowns {
        expected_received += targets.len() as u64;
    }
    let stats = m.tlb.stats();
    assert_eq!(
        stats.shootdowns,
        shootdowns.iter().filter(|t| !t.is_empty()).count() as u64
    );
    assert_eq!(stats.flushes_received, expected_received);
    let sent = m.ipis_sent.load(Ordering::Relaxed);
    assert_eq!(stats.ipis_sent, sent as u64);
    // Coalescing may spare IPIs, never requests.
    assert!(sent as u64 <= expected_received);
    // No interrupt was lost: every latched one was taken. Two IPIs may
    // share one interrupt: a waiting initiator that serves its inbox clears
    // the crate's `ipi_pending` while the hardware latch still holds the
    // IPI that announced the request, so the next request sends another.
    for cpu in 0..m.cpus {
        assert!(
            !m.irq_pending[cpu].load(Ordering::Relaxed),
            "cpu{cpu} never took a latched IPI"
        );
    }
    let taken = irqs_taken.iter().sum::<usize>();
    assert!(
        taken <= sent && (taken > 0 || sent == 0),
        "{sent} IPIs sent, {taken} interrupts taken"
    );
}

/// (a) CPU 0 and CPU 1 shoot at each other at the same time, both with
/// interrupts disabled. Neither can take the other's IPI; each must serve
/// the other's request from its own wait loop.
#[test]
fn a_mutual_shootdown_with_interrupts_disabled_completes() {
    let seen = check("(a) mutual, interrupts off", 5, |seen| {
        let m = Machine::new(2);
        let handles: Vec<_> = (0..2)
            .map(|i| {
                spawn_cpu(&m, seen, i, move |cpu| {
                    cpu.disable_interrupts();
                    let report = cpu.shoot(i, &[1 - i]);
                    assert_eq!(report.remote_cpus, 1);
                    assert!(report.ipis_sent <= 1);
                    assert_eq!(cpu.irqs_taken.get(), 0);
                    cpu.finish()
                })
            })
            .collect();
        let irqs: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        nothing_lost(&m, &[&[1], &[0]], 0, &irqs);
    });
    // Each executed shootdown needed the other CPU's wait loop in some
    // executions (in others the partner served it after enabling).
    assert!(seen.served_while_waiting.load(StdOrdering::Relaxed) > 0);
}

/// (b) CPU 0 and CPU 1 shoot at CPU 2 concurrently; CPU 2 has interrupts
/// enabled. One interrupt may carry both requests (the second initiator
/// finds an IPI already on its way and sends none); both must be carried
/// out before their initiators return.
#[test]
fn b_two_initiators_one_target_coalesced() {
    let seen = check("(b) two initiators, one target", 3, |seen| {
        let m = Machine::new(3);
        let mut handles: Vec<_> = (0..2)
            .map(|i| {
                spawn_cpu(&m, seen, i, move |cpu| {
                    let report = cpu.shoot(i, &[2]);
                    assert_eq!(report.remote_cpus, 1);
                    assert!(report.ipis_sent <= 1);
                    cpu.finish()
                })
            })
            .collect();
        handles.push(spawn_cpu(&m, seen, 2, Cpu::finish));
        let irqs: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(irqs[0] + irqs[1], 0, "only cpu2 was interrupted");
        assert!(irqs[2] >= 1);
        nothing_lost(&m, &[&[2], &[2], &[]], 0, &irqs);
    });
    assert!(
        seen.coalesced.load(StdOrdering::Relaxed) > 0,
        "no execution carried both requests with one interrupt"
    );
}

/// (c) CPU 0, interrupts off, shoots at CPU 1 while CPU 1, interrupts on,
/// shoots at CPU 0: CPU 0 can serve CPU 1's request only from its wait
/// loop. CPU 0 then detaches a page table, runs `ipi_sync` and frees the
/// table; CPU 1 meanwhile walks page tables locklessly with interrupts
/// off. A walk that began before the detach must not see the free.
#[test]
fn c_waiting_initiator_serves_its_inbox_and_ipi_sync_completes() {
    let seen = check("(c) serve while waiting, ipi_sync", 4, |seen| {
        let m = Machine::new(2);
        let detached = Arc::new(AtomicBool::new(false));
        let freed = Arc::new(AtomicBool::new(false));

        let (d, f) = (detached.clone(), freed.clone());
        let h0 = spawn_cpu(&m, seen, 0, move |cpu0| {
            cpu0.disable_interrupts();
            cpu0.shoot(0, &[1]);
            d.store(true, Ordering::SeqCst);
            let report = ipi_sync(&cpu0).unwrap();
            assert_eq!(report.remote_cpus, 1);
            assert!(!report.flushed_locally);
            f.store(true, Ordering::SeqCst);
            assert_eq!(cpu0.irqs_taken.get(), 0);
            cpu0.finish()
        });

        let h1 = spawn_cpu(&m, seen, 1, move |cpu1| {
            cpu1.shoot(1, &[0]);
            // A lockless page-table walk: interrupts off throughout.
            cpu1.disable_interrupts();
            if !detached.load(Ordering::SeqCst) {
                assert!(
                    !freed.load(Ordering::SeqCst),
                    "ipi_sync returned while a walk that began before it ran"
                );
            }
            cpu1.enable_interrupts();
            cpu1.finish()
        });

        let irqs = [h0.join().unwrap(), h1.join().unwrap()];
        nothing_lost(&m, &[&[1], &[0]], 1, &irqs);
    });
    assert!(
        seen.served_while_waiting.load(StdOrdering::Relaxed) > 0,
        "cpu0 never served cpu1's request from its wait loop"
    );
}

/// (d) CPU 0 shoots at CPU 1 twice in a row, reusing its request slot as
/// soon as the first shootdown returns, while CPU 1 takes the interrupts.
/// The second request must not be lost, merged into the first or carried
/// out before it is published, and a late acknowledgement of the first
/// must not count for the second.
#[test]
fn d_back_to_back_shootdowns_reuse_the_slot() {
    check("(d) back to back", 6, |seen| {
        let m = Machine::new(2);
        let h0 = spawn_cpu(&m, seen, 0, |cpu| {
            cpu.shoot(0, &[1]);
            cpu.shoot(1, &[1]);
            cpu.finish()
        });
        let h1 = spawn_cpu(&m, seen, 1, Cpu::finish);
        let irqs = [h0.join().unwrap(), h1.join().unwrap()];
        nothing_lost(&m, &[&[1], &[1]], 0, &irqs);
    });
}
