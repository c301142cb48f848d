//! The model machine the loom models (`src/loom/`, `scripts/loom.sh`)
//! share: simulated CPUs with an [`Arch`] of their own, what the models saw,
//! and the bounds they run under. Running a model and its end-of-model
//! checks are in `run.rs`.
//!
//! In the crate's unit-test harness built with `--cfg loom` the crate's own
//! atomics are loom's (`src/sync.rs`), so these models explore the
//! interleavings and weak-memory outcomes of the real `shootdown`,
//! `ipi_sync` and `handle_flush_ipi` and of the inboxes, `ipi_pending`
//! flags and acknowledgement counters behind them (and of the real
//! `FramePool`'s flush epochs and passes), not of a copy.
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
//! Bounds: each model has a preemption bound (`LOOM_MAX_PREEMPTIONS`
//! overrides them all): loom explores every interleaving with at most that
//! many preemptive switches between CPUs, plus any number where a CPU
//! spins or halts. A waiting CPU that spins [`FRUITLESS_SPINS`] times in a
//! row without serving anything ends the exploration of that execution's
//! remaining alternatives (see there). An idle CPU halts (parks) until an
//! IPI or the end of the model wakes it.

use std::boxed::Box;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicUsize as StdAtomicUsize, Ordering as StdOrdering};
use std::sync::Arc as StdArc;
use std::vec;
use std::vec::Vec;

use loom::sync::atomic::AtomicU64;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

use crate::{
    handle_flush_ipi, shootdown, Arch, Asid, AtomicCpuSet, CpuId, CpuSet, FlushRequest, ShootdownReport,
    TlbShootdown, PAGE_SIZE,
};

/// The most CPUs a model runs (loom allows 5 threads, the main one included).
pub const MAX_MODEL_CPUS: usize = 3;

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
pub const FRUITLESS_SPINS: usize = 3;

/// Where the models' pages start: page `p` is at `BASE + p * PAGE_SIZE`
/// in ASID 1. Each request flushes one page, its own, so what a CPU
/// flushed says which requests it carried out.
pub const BASE: u64 = 0x40_0000;

/// Pages the models use.
pub const PAGES: usize = 4;

/// The models' one page-table entry (models (e) to (h'')): the PTE of page
/// 0, `MAPPED` or `EMPTY`.
pub const MAPPED: u64 = 1;
pub const EMPTY: u64 = 0;
/// Model (i): the accessed bit of page 0's PTE (with `MAPPED`).
pub const YOUNG: u64 = 2;

pub fn asid() -> Asid {
    Asid::new(1).unwrap()
}

pub fn cpu_id(i: usize) -> CpuId {
    CpuId::new(i).unwrap()
}

pub fn cpu_set(ids: &[usize]) -> CpuSet {
    ids.iter().map(|&i| cpu_id(i)).collect()
}

/// The request that flushes page `page`.
pub fn request_of(page: usize) -> FlushRequest {
    let mut req = FlushRequest::new();
    req.add_page(asid(), BASE + page as u64 * PAGE_SIZE, 33).unwrap();
    req
}

/// The state all simulated CPUs share.
pub struct Machine {
    pub cpus: usize,
    /// Boxed: loom runs a model's main thread on a 32 KiB stack, and a
    /// `TlbShootdown` of loom atomics (12 KiB, 64 CPUs) built in place and
    /// moved into the `Arc` overflows it.
    pub tlb: Box<TlbShootdown>,
    /// Per CPU: the interrupt controller's latch for the flush vector.
    pub irq_pending: Vec<AtomicBool>,
    /// Per CPU and page: how many times the CPU invalidated the page.
    pub flushes: Vec<Vec<AtomicUsize>>,
    /// Flush IPIs the crate asked for, in all.
    pub ipis_sent: AtomicUsize,
    /// The PTE of page 0 (models (e) to (h'')); starts `MAPPED`.
    pub pte: AtomicU64,
    /// Per CPU: whether its TLB holds an entry for page 0 (models (e) to
    /// (h'')). Set by [`Cpu::walk`], cleared by a whole-ASID or full flush
    /// or an address-space switch (the page flushes of models (a) to (d)
    /// leave it alone, so that those models have no more states than
    /// before; those of (h'') clear it: see [`Cpu::refill_after_flush`]).
    pub cached: Vec<AtomicBool>,
    /// The online CPUs: all of them, until one leaves (model (offline)).
    pub online: AtomicCpuSet,
    /// CPUs done with their part of the model.
    pub done: AtomicUsize,
    /// Whether the TLBs keep other ASIDs' entries across a switch.
    pub tagged: bool,
    /// Each CPU's loom thread, once it runs, so that an IPI or the last CPU
    /// finishing can wake it from its idle `hlt`. A plain mutex: loom never
    /// switches threads while it is held.
    pub threads: std::sync::Mutex<Vec<Option<thread::Thread>>>,
}

impl Machine {
    pub fn new(cpus: usize) -> Arc<Machine> {
        Machine::build(cpus, false)
    }

    /// A machine whose TLBs are tagged (PCID, ASIDs): loading a root keeps
    /// the entries of the other ASIDs (models (j) to (l)).
    pub fn tagged(cpus: usize) -> Arc<Machine> {
        Machine::build(cpus, true)
    }

    fn build(cpus: usize, tagged: bool) -> Arc<Machine> {
        assert!(cpus <= MAX_MODEL_CPUS);
        Arc::new(Machine {
            cpus,
            tagged,
            tlb: Box::new(TlbShootdown::new()),
            irq_pending: (0..cpus).map(|_| AtomicBool::new(false)).collect(),
            flushes: (0..cpus)
                .map(|_| (0..PAGES).map(|_| AtomicUsize::new(0)).collect())
                .collect(),
            ipis_sent: AtomicUsize::new(0),
            pte: AtomicU64::new(MAPPED),
            cached: (0..cpus).map(|_| AtomicBool::new(false)).collect(),
            online: {
                let online = AtomicCpuSet::new();
                online.insert_all(&CpuSet::first(cpus).unwrap(), Ordering::Relaxed);
                online
            },
            done: AtomicUsize::new(0),
            threads: std::sync::Mutex::new(vec![None; cpus]),
        })
    }

    /// Whether CPU `cpu`'s TLB holds page 0's entry (of ASID 1).
    pub fn caches(&self, cpu: usize) -> bool {
        self.cached[cpu].load(Ordering::Relaxed)
    }

    /// Wakes CPU `cpu` from `hlt` (or makes its next `hlt` return at once).
    /// A CPU whose thread has not started yet needs no wake-up: it looks at
    /// its interrupt latch and at `done` before it ever halts.
    pub fn wake(&self, cpu: usize) {
        if let Some(t) = &self.threads.lock().unwrap()[cpu] {
            t.unpark();
        }
    }

    /// How many times CPU `cpu` has invalidated page `page`.
    pub fn flushed(&self, cpu: usize, page: usize) -> usize {
        self.flushes[cpu][page].load(Ordering::Relaxed)
    }
}

/// Per-CPU events counted across every execution of one model, to show
/// that the interesting interleavings were in fact explored.
#[derive(Default)]
pub struct Seen {
    pub executions: StdAtomicUsize,
    /// A request served by a CPU whose interrupts were off, outside an
    /// interrupt: from the wait loop of its own shootdown or sync.
    pub served_while_waiting: StdAtomicUsize,
    /// One interrupt that carried out two requests.
    pub coalesced: StdAtomicUsize,
    /// Models (e) to (h''): executions that ended one way or the other
    /// (see each model).
    pub outcomes: [StdAtomicUsize; 2],
    /// Models (h') and (h''): executions whose reclaimer found CPU 1 out of
    /// the address space and flushed page 0 at once instead of deferring.
    pub flushed_at_once: StdAtomicUsize,
}

impl Seen {
    pub fn outcome(&self, which: bool) {
        self.outcomes[usize::from(which)].fetch_add(1, StdOrdering::Relaxed);
    }

    /// Asserts that some execution ended each way.
    pub fn both_outcomes(&self, what: [&str; 2]) {
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
pub struct Cpu {
    pub index: usize,
    pub m: Arc<Machine>,
    pub seen: StdArc<Seen>,
    pub irqs_enabled: Cell<bool>,
    pub in_irq: Cell<bool>,
    pub irqs_taken: Cell<usize>,
    /// Whether the CPU served a request since its last `relax`.
    pub progressed: Cell<bool>,
    /// `relax` calls in a row without progress.
    pub fruitless: Cell<usize>,
    /// Whether the CPU touches page 0 after each interrupt it takes
    /// (models (f), (g)): a TLB miss walks the page table again.
    pub walks_after_irq: Cell<bool>,
    /// Models (h) to (h''): whether the CPU's TLB may refill page 0's
    /// entry by itself right after a full flush, or right after loading
    /// ASID 1 (hardware walks page tables speculatively whenever it likes,
    /// so an entry can be back before the flushing code's next
    /// instruction, if the PTE still maps the page); a flush of page 0
    /// alone then drops the entry too.
    pub refill_after_flush: Cell<bool>,
    /// Model (i): a walk sets the PTE's accessed bit (an atomic
    /// read-modify-write, as x86 hardware's locked update) before it
    /// caches the entry (`Arch::FILL_SETS_ACCESSED`).
    pub walk_sets_accessed: Cell<bool>,
    /// Model (p): the flag its table's release sets. While it is watched,
    /// the CPU's MMU may walk through its cached pointer (page 0's entry
    /// stands for a walk-cache pointer to the table) at every step it takes
    /// in the crate (each `shootdown_state` call) with ASID 1's root
    /// loaded: [`walked_freed`](Self::walked_freed) records one that
    /// found the table released.
    pub watch_freed: RefCell<Option<Arc<AtomicBool>>>,
    /// The ASID whose root the hardware has loaded (model (p)).
    pub hw_asid: Cell<Option<Asid>>,
    /// Model (p): whether the MMU walked through its pointer to a table
    /// after the table was released.
    pub walked_freed: Cell<bool>,
}

impl Cpu {
    /// CPU `index` of `m`; call it on the CPU's own loom thread.
    pub fn new(index: usize, m: &Arc<Machine>, seen: &StdArc<Seen>) -> Cpu {
        m.threads.lock().unwrap()[index] = Some(thread::current());
        Cpu::detached(index, m, seen)
    }

    /// CPU `index` of `m` as seen from another thread, to set up its state
    /// before the model's CPUs start (it is never woken).
    pub fn detached(index: usize, m: &Arc<Machine>, seen: &StdArc<Seen>) -> Cpu {
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
            watch_freed: RefCell::new(None),
            hw_asid: Cell::new(None),
            walked_freed: Cell::new(false),
        }
    }

    /// Model (p): a step at which the MMU may walk (see `watch_freed`).
    fn mmu_step(&self) {
        if let Some(freed) = self.watch_freed.borrow().as_ref() {
            if self.hw_asid.get() == Some(asid()) && self.m.caches(self.index) && freed.load(Ordering::SeqCst)
            {
                self.walked_freed.set(true);
            }
        }
    }

    /// An instruction boundary: takes a pending flush interrupt if
    /// interrupts are enabled (the handler runs with them disabled, as
    /// hardware enters it).
    pub fn boundary(&self) {
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
    pub fn walk(&self) -> bool {
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

    pub fn disable_interrupts(&self) {
        self.irqs_enabled.set(false);
    }

    /// Enables interrupts; a latched one fires at once.
    pub fn enable_interrupts(&self) {
        self.irqs_enabled.set(true);
        self.boundary();
    }

    /// Shoots down page `page` on `targets`; checks that the shootdown
    /// returned and that every remote target had carried the request out
    /// by then.
    pub fn shoot(&self, page: usize, targets: &[usize]) -> ShootdownReport {
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
    pub fn finish(self) -> usize {
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

impl Cpu {
    /// The end of a CPU that went offline (model (offline)): marks it done, then
    /// halts with interrupts still off, taking nothing, until every CPU is
    /// done; returns how many interrupts it took before it left. An IPI
    /// sent to it meanwhile stays latched: only its own wait on the way
    /// out could have served the request behind it.
    pub fn park_offline(self) -> usize {
        assert!(
            !self.irqs_enabled.get(),
            "an offline CPU parks with interrupts off"
        );
        self.m.done.fetch_add(1, Ordering::SeqCst);
        for cpu in (0..self.m.cpus).filter(|&c| c != self.index) {
            self.m.wake(cpu);
        }
        while self.m.done.load(Ordering::SeqCst) != self.m.cpus {
            // `cli; hlt`: only the last CPU finishing wakes it.
            thread::park();
        }
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

    fn current_cpu(&self) -> Result<CpuId, crate::Error> {
        Ok(cpu_id(self.index))
    }

    fn online_cpus(&self) -> CpuSet {
        // Relaxed: the crate's own fences order this read against a CPU
        // leaving the set (model (offline)); every other model keeps all CPUs
        // online throughout.
        self.m.online.load(Ordering::Relaxed)
    }

    fn shootdown_state(&self) -> &TlbShootdown {
        self.mmu_step();
        &self.m.tlb
    }

    fn tagged_tlb(&self) -> bool {
        self.m.tagged
    }

    fn flush_local_page(&self, asid: Asid, va: u64) {
        assert_eq!(asid, self::asid());
        let page = ((va - BASE) / PAGE_SIZE) as usize;
        // Only model (n) has a CPU flush its own page (with interrupts
        // enabled, so not counted here); a flush with interrupts off
        // outside the handler is another CPU's request, served while
        // waiting.
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
        // `flush_tlb_batched_pending` (models (f), (g)) and the catch-ups
        // of tagged TLBs (models (j) to (l)) flush a whole ASID; page 0,
        // of ASID 1, is the only page the TLB model caches.
        if asid == self::asid() {
            self.m.cached[self.index].store(false, Ordering::Relaxed);
        }
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
        // Untagged TLB: loading a root drops every non-global entry; a
        // tagged one keeps page 0's entry, tagged with ASID 1.
        if !self.m.tagged {
            self.m.cached[self.index].store(false, Ordering::Relaxed);
        }
        self.hw_asid.set(Some(asid));
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
