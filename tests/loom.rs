//! Model checks of the cross-CPU shootdown protocol with loom
//! (`scripts/loom.sh`: `RUSTFLAGS="--cfg loom" cargo test --release --test loom`).
//!
//! Under `--cfg loom` the crate's own atomics are loom's (`src/sync.rs`), so
//! these models explore the interleavings and weak-memory outcomes of the
//! real `shootdown`, `ipi_sync` and `handle_flush_ipi` and of the inboxes,
//! `ipi_pending` flags and acknowledgement counters behind them (and of the
//! real `FramePool`'s flush epochs and passes), not of a copy.
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
//!   slot at once;
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
//! - (h) a reclaimer unmaps a page with its flush deferred
//!   (`UnmapBatch::try_to_unmap`), pools the frame (`FramePool::defer`) and
//!   asks for it back (`FramePool::release_passed`) while the CPU caching
//!   the page runs `quiescent_flush`, and its TLB may refill the entry
//!   right after the flush: the frame comes back only once that CPU holds
//!   no entry for it, and some execution does give it back (the pass's
//!   epoch is read before the flush, the generation's published after the
//!   PTE clear);
//! - (h') the same, with the CPU passing by `switch_mm` to another address
//!   space (untagged TLB) instead;
//! - (h'') the same, with the CPU switching *into* the address space
//!   (`switch_mm`, untagged TLB), whose TLB may refill the page as it
//!   loads it: the frame comes back only once no entry can map it;
//! - (i) a reclaimer ages page 0 (`page_referenced`: the accessed bit is
//!   cleared, the frame's aging epoch published after), then unmaps and
//!   pools it, while the CPU caching it runs `quiescent_flush` and its TLB
//!   refills the entry, setting the accessed bit as x86 hardware does: the
//!   frame comes back only once that CPU holds no entry for it, whether the
//!   pool waited for the aging epoch (the bit was found clear) or a new one.
//!
//! Models (a) to (d) end by checking that nothing was lost: every
//! shootdown and sync returned, each target carried out each request
//! exactly once, no inbox still holds a request, no latched IPI was left
//! untaken, and the crate's counters agree with what the CPUs did.
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
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering as StdOrdering};
use std::sync::Arc as StdArc;

use loom::sync::atomic::AtomicU64;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use tlb_batch::{
    flush_tlb_batched_pending, handle_flush_ipi, ipi_sync, page_referenced, quiescent_flush, shootdown,
    switch_mm, Arch, Asid, CpuId, CpuSet, FlushRequest, Frame, FramePool, Mapping, MappingFlags, MmTlbState,
    OwnedFrame, PageTable, Pte, PteFlags, Rmap, ShootdownReport, SwapResult, TlbFlushUnmapBatch,
    TlbShootdown, TtuFlags, UnmapBatch, Unmapped, PAGE_SIZE,
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

/// The models' one page-table entry (models (e) to (h'')): the PTE of page
/// 0, `MAPPED` or `EMPTY`.
const MAPPED: u64 = 1;
const EMPTY: u64 = 0;
/// Model (i): the accessed bit of page 0's PTE (with `MAPPED`).
const YOUNG: u64 = 2;

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
    /// Boxed: loom runs a model's main thread on a 32 KiB stack, and a
    /// `TlbShootdown` of loom atomics (12 KiB, 64 CPUs) built in place and
    /// moved into the `Arc` overflows it.
    tlb: Box<TlbShootdown>,
    /// Per CPU: the interrupt controller's latch for the flush vector.
    irq_pending: Vec<AtomicBool>,
    /// Per CPU and page: how many times the CPU invalidated the page.
    flushes: Vec<Vec<AtomicUsize>>,
    /// Flush IPIs the crate asked for, in all.
    ipis_sent: AtomicUsize,
    /// The PTE of page 0 (models (e) to (h'')); starts `MAPPED`.
    pte: AtomicU64,
    /// Per CPU: whether its TLB holds an entry for page 0 (models (e) to
    /// (h'')). Set by [`Cpu::walk`], cleared by a whole-ASID or full flush
    /// or an address-space switch (the page flushes of models (a) to (d)
    /// leave it alone, so that those models have no more states than
    /// before; those of (h'') clear it: see [`Cpu::refill_after_flush`]).
    cached: Vec<AtomicBool>,
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
            tlb: Box::new(TlbShootdown::new()),
            irq_pending: (0..cpus).map(|_| AtomicBool::new(false)).collect(),
            flushes: (0..cpus)
                .map(|_| (0..PAGES).map(|_| AtomicUsize::new(0)).collect())
                .collect(),
            ipis_sent: AtomicUsize::new(0),
            pte: AtomicU64::new(MAPPED),
            cached: (0..cpus).map(|_| AtomicBool::new(false)).collect(),
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
    /// Models (e) to (h''): executions that ended one way or the other
    /// (see each model).
    outcomes: [StdAtomicUsize; 2],
    /// Models (h') and (h''): executions whose reclaimer found CPU 1 out of
    /// the address space and flushed page 0 at once instead of deferring.
    flushed_at_once: StdAtomicUsize,
}

impl Seen {
    fn outcome(&self, which: bool) {
        self.outcomes[usize::from(which)].fetch_add(1, StdOrdering::Relaxed);
    }

    /// Asserts that some execution ended each way.
    fn both_outcomes(&self, what: [&str; 2]) {
        for (i, what) in what.iter().enumerate() {
            assert!(
                self.outcomes[i].load(StdOrdering::Relaxed) > 0,
                "no execution where {what}"
            );
        }
    }
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
    /// Whether the CPU touches page 0 after each interrupt it takes
    /// (models (f), (g)): a TLB miss walks the page table again.
    walks_after_irq: Cell<bool>,
    /// Models (h) to (h''): whether the CPU's TLB may refill page 0's
    /// entry by itself right after a full flush, or right after loading
    /// ASID 1 (hardware walks page tables speculatively whenever it likes,
    /// so an entry can be back before the flushing code's next
    /// instruction, if the PTE still maps the page); a flush of page 0
    /// alone then drops the entry too.
    refill_after_flush: Cell<bool>,
    /// Model (i): a walk sets the PTE's accessed bit (an atomic
    /// read-modify-write, as x86 hardware's locked update) before it
    /// caches the entry (`Arch::FILL_SETS_ACCESSED`).
    walk_sets_accessed: Cell<bool>,
}

impl Cpu {
    /// CPU `index` of `m`; call it on the CPU's own loom thread.
    fn new(index: usize, m: &Arc<Machine>, seen: &StdArc<Seen>) -> Cpu {
        m.threads.lock().unwrap()[index] = Some(thread::current());
        Cpu::detached(index, m, seen)
    }

    /// CPU `index` of `m` as seen from another thread, to set up its state
    /// before the model's CPUs start (it is never woken).
    fn detached(index: usize, m: &Arc<Machine>, seen: &StdArc<Seen>) -> Cpu {
        Cpu {
            index,
            m: m.clone(),
            seen: seen.clone(),
            irqs_enabled: Cell::new(true),
            in_irq: Cell::new(false),
            irqs_taken: Cell::new(0),
            progressed: Cell::new(false),
            fruitless: Cell::new(0),
            walks_after_irq: Cell::new(false),
            refill_after_flush: Cell::new(false),
            walk_sets_accessed: Cell::new(false),
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
            if self.walks_after_irq.get() {
                self.walk();
            }
        }
    }

    /// An access to page 0: on a TLB miss the hardware walks the page table
    /// (a plain load: page walks take part in no ordering of their own) and
    /// caches what it finds mapped. Returns whether the TLB now holds it.
    fn walk(&self) -> bool {
        let cached = &self.m.cached[self.index];
        if !cached.load(Ordering::Relaxed) {
            if self.walk_sets_accessed.get() {
                // Model (i): the accessed bit is set first, atomically on
                // the entry as it is then (Relaxed: the hardware's update
                // is ordered by nothing but the entry's own coherence).
                let mut v = self.m.pte.load(Ordering::Relaxed);
                while v & MAPPED != 0 {
                    match self
                        .m
                        .pte
                        .compare_exchange(v, v | YOUNG, Ordering::Relaxed, Ordering::Relaxed)
                    {
                        Ok(_) => {
                            cached.store(true, Ordering::Relaxed);
                            break;
                        }
                        Err(now) => v = now,
                    }
                }
            } else if self.m.pte.load(Ordering::Relaxed) == MAPPED {
                cached.store(true, Ordering::Relaxed);
            }
        }
        cached.load(Ordering::Relaxed)
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
    // Only model (i)'s walks set the bit, and only model (i)'s reverse map
    // keeps aging epochs; the other models never find one.
    const FILL_SETS_ACCESSED: bool = true;

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
        if page == 0 && self.refill_after_flush.get() {
            self.m.cached[self.index].store(false, Ordering::Relaxed);
        }
        self.progressed.set(true);
    }

    fn flush_local_asid(&self, asid: Asid) {
        // Only `flush_tlb_batched_pending` (models (f), (g)) flushes a
        // whole ASID; page 0 is the only page the TLB model caches.
        assert_eq!(asid, self::asid());
        self.m.cached[self.index].store(false, Ordering::Relaxed);
        self.progressed.set(true);
    }

    fn flush_local_all(&self, _include_global: bool) {
        // Only a pool's pass (`quiescent_flush`, model (h)) flushes
        // everything; page 0 is the only page the TLB model caches, and no
        // model has a global entry.
        self.m.cached[self.index].store(false, Ordering::Relaxed);
        self.progressed.set(true);
        if self.refill_after_flush.get() {
            self.walk();
        }
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

    unsafe fn switch_address_space(&self, asid: Asid, _root: u64) {
        // Untagged TLB: loading a root drops every non-global entry.
        self.m.cached[self.index].store(false, Ordering::Relaxed);
        // Page 0 is ASID 1's: loading that one may refill it at once.
        if asid == self::asid() && self.refill_after_flush.get() {
            self.walk();
        }
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

/// Sets up CPU `index` of models (f) to (h'): it runs `mm` and has page 0
/// cached, before the model's CPUs start.
fn cached_on(m: &Arc<Machine>, seen: &StdArc<Seen>, index: usize, mm: &MmTlbState) {
    let cpu = Cpu::detached(index, m, seen);
    // SAFETY: a model: the root is never dereferenced.
    unsafe { switch_mm(&cpu, None, mm).unwrap() };
    assert!(cpu.walk());
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

/// Model (h)'s frames: page 0's, which the model's reclaimer unmaps, and
/// page 1's, an older generation pooled before the model's CPUs start.
const FRAME0: Frame = Frame(0x100);
const FRAME1: Frame = Frame(0x101);

/// How many times model (h)'s reclaimer asks its pool for passed frames.
const RELEASE_TRIES: usize = 2;

/// Model (h)'s address space as the crate's reverse-map walk sees it:
/// page 0's PTE is [`Machine::pte`] (`MAPPED` stands for a present,
/// read-only, clean entry for [`FRAME0`]), page 1's is its own (for
/// [`FRAME1`]; no CPU's TLB model caches it).
struct PoolSpace {
    m: Arc<Machine>,
    mm: Arc<MmTlbState>,
    page1: AtomicU64,
}

impl PoolSpace {
    /// The PTE for `va`, and the frame its `MAPPED` stands for.
    fn entry(&self, va: u64) -> (&AtomicU64, Frame) {
        match va {
            BASE => (&self.m.pte, FRAME0),
            _ if va == BASE + PAGE_SIZE => (&self.page1, FRAME1),
            _ => panic!("model (h) has no PTE for {va:#x}"),
        }
    }

    fn pte_of(value: u64, frame: Frame) -> Pte {
        if value & MAPPED == 0 {
            return Pte::EMPTY;
        }
        let mut flags = PteFlags::PRESENT | PteFlags::USER;
        if value & YOUNG != 0 {
            flags |= PteFlags::ACCESSED;
        }
        Pte::new(frame, flags)
    }
}

// SAFETY: a model: `exchange` is one atomic swap (the entry has no
// accessed or dirty bit for hardware to set), `lookup` loads the entry as
// it is, and `tlb_state` is the address space the CPUs run.
unsafe impl PageTable for PoolSpace {
    fn tlb_state(&self) -> &MmTlbState {
        &self.mm
    }

    fn lookup(&self, va: u64) -> Pte {
        let (pte, frame) = self.entry(va);
        PoolSpace::pte_of(pte.load(Ordering::Relaxed), frame)
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        assert_eq!(new, Pte::EMPTY, "model (h) only clears PTEs");
        let (pte, frame) = self.entry(va);
        // Relaxed, the weakest: only the crate's own orderings may order
        // the clear before the pool's epoch (the full fence in
        // `flush_targets`, which the unmap runs after the clear, and
        // `publish_epoch`'s `fetch_add`).
        PoolSpace::pte_of(pte.swap(EMPTY, Ordering::Relaxed), frame)
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        // Relaxed, the weakest: the crate's publish of the aging epoch
        // must order the clear by itself (model (i)).
        let (pte, _) = self.entry(va);
        pte.fetch_and(!YOUNG, Ordering::Relaxed) & YOUNG != 0
    }

    fn set(&self, va: u64, pte: Pte) {
        panic!("model (h) never sets a PTE ({va:#x}: {pte:?})");
    }
}

/// Model (h)'s reverse map: each frame has its one mapping in
/// [`PoolSpace`]. It keeps page 0's aging epoch (model (i); `u64::MAX`:
/// none).
struct PoolRmap(PoolSpace, AtomicU64);

// SAFETY: `walk` reports the one place each frame is mapped.
unsafe impl Rmap for PoolRmap {
    type Space = PoolSpace;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, PoolSpace>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let va = if frame == FRAME0 { BASE } else { BASE + PAGE_SIZE };
        visit(Mapping {
            space: &self.0,
            va,
            flags: MappingFlags::empty(),
        })
    }

    fn set_dirty(&self, frame: Frame) {
        panic!("model (h)'s PTEs are clean ({frame:?})");
    }

    fn aged_epoch(&self, frame: Frame) -> Option<u64> {
        let e = self.1.load(Ordering::Relaxed);
        (frame == FRAME0 && e != u64::MAX).then_some(e)
    }

    fn set_aged_epoch(&self, frame: Frame, epoch: Option<u64>) {
        if frame == FRAME0 {
            self.1.store(epoch.unwrap_or(u64::MAX), Ordering::Relaxed);
        }
    }
}

/// Unmaps `frame` through the crate's reverse-map walk with its flush
/// deferred (`UnmapBatch::try_to_unmap`), and pools it (`FramePool::defer`).
fn pool_frame(cpu: &Cpu, rmap: &PoolRmap, pool: &mut FramePool<2>, frame: Frame) {
    let mut batch = UnmapBatch::<1>::new();
    // SAFETY: a model: the frame is never freed.
    let page = unsafe { OwnedFrame::new(frame) };
    let unmapped = batch.try_to_unmap(cpu, rmap, page, TtuFlags::IGNORE_ACCESS);
    assert_eq!(unmapped, Ok(Unmapped::Held(SwapResult::Success)));
    assert_eq!(pool.defer(cpu, &mut batch), Ok(1));
    assert!(batch.is_empty());
}

/// Asks `pool` for passed frames up to [`RELEASE_TRIES`] times; returns
/// whether page 0's frame came back, which it must only once CPU 1 no
/// longer caches it (models (h) to (i)).
fn release_page0(cpu: &Cpu, pool: &mut FramePool<2>) -> bool {
    for _ in 0..RELEASE_TRIES {
        let mut back = pool.release_passed(cpu);
        if back.frames_mut().iter().any(|f| f.frame() == FRAME0) {
            assert!(
                !cpu.m.cached[1].load(Ordering::Relaxed),
                "the pool handed page 0's frame back while cpu1 still caches it"
            );
            return true;
        }
        thread::yield_now();
    }
    false
}

/// How CPU 1 flushes its TLB in models (h) to (h'').
#[derive(Clone, Copy, PartialEq)]
enum Pass {
    /// `quiescent_flush`, as at a timer tick (model (h)).
    Quiescent,
    /// `switch_mm` from the address space to another one, without tagged
    /// TLBs (model (h')).
    SwitchAway,
    /// `switch_mm` from another address space into this one, without
    /// tagged TLBs (model (h'')).
    SwitchIn,
}

/// (h) CPU 1 runs the address space with page 0 cached, and owes a flush
/// to an older pooled generation (page 1's, epoch 1). CPU 0, a reclaimer,
/// unmaps page 0 with its flush deferred (`UnmapBatch::try_to_unmap`) and
/// pools the frame (`FramePool::defer`: epoch 2), then asks the pool for
/// passed frames (`release_passed`) up to [`RELEASE_TRIES`] times; CPU 1
/// meanwhile runs `quiescent_flush`, and its TLB may refill page 0 right
/// after the flush. If CPU 0 gets page 0's frame back, CPU 1 no longer
/// caches it: CPU 1 read epoch 2 before it flushed, so the PTE was cleared
/// by then and the refill found nothing (the clear comes before the
/// epoch's `fetch_add`, the passer's load of the epoch acquires it; the
/// pool's load of `passed` acquires the flush). Reading the epoch after the
/// flush, or giving page 0's generation no epoch of its own, lets the frame
/// come back while the refilled entry maps it; without the refill neither
/// shows.
#[test]
fn h_pooled_frame_released_only_after_its_cpu_flushed_past_it() {
    pool_model("(h) FramePool vs quiescent_flush", Pass::Quiescent);
}

/// (h') Model (h), but CPU 1 passes by switching to another address space
/// (`switch_mm`, untagged TLB) instead of `quiescent_flush`. CPU 0's unmap
/// may then find CPU 1 gone from the address space and flush at once (to
/// no CPU): that frame comes back at the first try. Recording the pass
/// before the switch lets the frame come back while CPU 1 still caches it.
#[test]
fn h2_pooled_frame_released_only_after_its_cpu_switched_away() {
    pool_model("(h') FramePool vs switch_mm away", Pass::SwitchAway);
}

/// (h'') CPU 1 runs another address space, and switches into page 0's
/// (`switch_mm`, untagged TLB) while CPU 0 unmaps and pools page 0 as in
/// (h); loading the address space may refill page 0 at once. Either CPU
/// 0's unmap missed CPU 1 and CPU 1's refill finds the PTE cleared (model
/// (e)'s fence pair), or CPU 1 is a target and the frame comes back only
/// once CPU 1 passed epoch 2, which it read before it switched, after the
/// clear. Reading the epoch after the switch lets the frame come back while
/// the refilled entry maps it.
#[test]
fn h3_pooled_frame_released_only_after_its_cpu_switched_in() {
    pool_model("(h'') FramePool vs switch_mm in", Pass::SwitchIn);
}

/// Models (h) to (h''): see there.
fn pool_model(name: &str, pass: Pass) {
    let seen = check(name, 4, move |seen| {
        let m = Machine::new(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        let other = Arc::new(MmTlbState::new(Asid::new(2).unwrap(), 0x2000));
        if pass == Pass::SwitchIn {
            // SAFETY: a model: the root is never dereferenced.
            unsafe { switch_mm(&Cpu::detached(1, &m, seen), None, &other).unwrap() };
        } else {
            cached_on(&m, seen, 1, &mm);
        }
        let rmap = PoolRmap(
            PoolSpace {
                m: m.clone(),
                mm: mm.clone(),
                page1: AtomicU64::new(MAPPED),
            },
            AtomicU64::new(u64::MAX),
        );
        let mut pool = FramePool::<2>::new();
        pool_frame(&Cpu::detached(0, &m, seen), &rmap, &mut pool, FRAME1);
        let deferred_before = m.tlb.stats().pages_deferred;

        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            pool_frame(&cpu, &rmap, &mut pool, FRAME0);
            let released = release_page0(&cpu, &mut pool);
            cpu.finish();
            usize::from(released)
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            cpu.refill_after_flush.set(true);
            match pass {
                Pass::Quiescent => {
                    assert!(quiescent_flush(&cpu), "cpu1 owes page 1's generation a flush");
                }
                // SAFETY (both): a model: the roots are never dereferenced.
                Pass::SwitchAway => unsafe { switch_mm(&cpu, Some(&mm), &other).unwrap() },
                Pass::SwitchIn => unsafe { switch_mm(&cpu, Some(&other), &mm).unwrap() },
            }
            // Takes interrupts until both are done: in (h'') CPU 0's unmap
            // may miss CPU 1 when it decides whether to defer, then find it
            // when it flushes at once, and shoot page 0 at it.
            cpu.finish()
        });
        let released = h0.join().unwrap() == 1;
        h1.join().unwrap();
        // Nor does CPU 1 cache the frame again later.
        assert!(!released || !m.cached[1].load(Ordering::Relaxed));
        seen.outcome(released);
        if m.tlb.stats().pages_deferred == deferred_before {
            seen.flushed_at_once.fetch_add(1, StdOrdering::Relaxed);
        }
    });
    seen.both_outcomes([
        "cpu0 never got page 0's frame back",
        "cpu0 got page 0's frame back",
    ]);
    let at_once = seen.flushed_at_once.load(StdOrdering::Relaxed);
    if pass == Pass::Quiescent {
        assert_eq!(at_once, 0, "cpu1 never leaves the address space in (h)");
    } else {
        assert!(
            at_once > 0,
            "no execution where cpu0's unmap missed cpu1 and flushed at once"
        );
    }
}

/// (i) Page 0 is young and cached on CPU 1, which owes an older pooled
/// generation (page 1's) a flush. CPU 0 ages page 0 (`page_referenced`:
/// clears the accessed bit, publishes the aging epoch), unmaps it with its
/// flush deferred and pools it, then asks for passed frames; CPU 1 runs
/// `quiescent_flush`, and its TLB refills page 0 right after the flush,
/// setting the accessed bit first. If the unmap found the bit clear, the
/// generation waits for the aging epoch only; CPU 1 then flushed after the
/// clear (it read that epoch, published after the clear), and any refill
/// since would have set the bit. Publishing no new epoch at the aging (the
/// current one instead), or trusting the aging epoch although the bit was
/// found set, lets the frame come back while CPU 1 caches it.
#[test]
fn i_aged_frame_released_only_after_its_cpu_flushed_past_the_aging() {
    let seen = check("(i) aging epochs vs quiescent_flush", 4, move |seen| {
        let m = Machine::new(2);
        let mm = Arc::new(MmTlbState::new(asid(), 0x1000));
        cached_on(&m, seen, 1, &mm);
        m.pte.store(MAPPED | YOUNG, Ordering::Relaxed);
        let rmap = PoolRmap(
            PoolSpace {
                m: m.clone(),
                mm: mm.clone(),
                page1: AtomicU64::new(MAPPED),
            },
            AtomicU64::new(u64::MAX),
        );
        let mut pool = FramePool::<2>::new();
        pool_frame(&Cpu::detached(0, &m, seen), &rmap, &mut pool, FRAME1);

        let h0 = spawn_cpu(&m, seen, 0, move |cpu| {
            let mut scratch = TlbFlushUnmapBatch::new();
            page_referenced(&cpu, &rmap, FRAME0, &mut scratch).unwrap();
            assert!(scratch.is_empty());
            pool_frame(&cpu, &rmap, &mut pool, FRAME0);
            let released = release_page0(&cpu, &mut pool);
            cpu.finish();
            usize::from(released)
        });
        let h1 = spawn_cpu(&m, seen, 1, move |cpu| {
            cpu.refill_after_flush.set(true);
            cpu.walk_sets_accessed.set(true);
            assert!(quiescent_flush(&cpu), "cpu1 owes page 1's generation a flush");
            cpu.finish()
        });
        let released = h0.join().unwrap() == 1;
        h1.join().unwrap();
        assert!(!released || !m.cached[1].load(Ordering::Relaxed));
        seen.outcome(released);
    });
    seen.both_outcomes([
        "cpu0 never got page 0's frame back",
        "cpu0 got page 0's frame back",
    ]);
}
