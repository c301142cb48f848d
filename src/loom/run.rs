//! Running a loom model on the model machine (`machine.rs`): each
//! simulated CPU on a loom thread of its own, the model under its
//! preemption bound, and the checks every execution of the shootdown
//! models ends with.

use std::boxed::Box;
use std::eprintln;
use std::sync::atomic::Ordering as StdOrdering;
use std::sync::Arc as StdArc;

use loom::sync::atomic::Ordering;
use loom::sync::Arc;
use loom::thread;

use super::machine::{cpu_id, Cpu, Machine, Seen};
use crate::{switch_mm, MmTlbState};

/// The stack of each model CPU's loom thread.
const CPU_STACK: usize = 1 << 20;

/// Starts CPU `index` of `m` on a loom thread of its own, running `body`.
pub fn spawn_cpu(
    m: &Arc<Machine>,
    seen: &StdArc<Seen>,
    index: usize,
    body: impl FnOnce(Cpu) -> usize + 'static,
) -> thread::JoinHandle<usize> {
    let (m, seen) = (m.clone(), seen.clone());
    let body = OneThread(Box::new(move || body(Cpu::new(index, &m, &seen))));
    // loom's coroutines get small stacks by default; a pool's generations
    // (each with its ASIDs) and its release's working arrays need more.
    thread::Builder::new()
        .stack_size(CPU_STACK)
        .spawn(move || {
            let body = body;
            (body.0)()
        })
        .expect("a loom thread")
}

/// A model CPU's body, which loom's thread builder wants `Send` although
/// the model's closures hold state that is not (`Cell`s of the CPU).
struct OneThread(Box<dyn FnOnce() -> usize>);

// SAFETY: loom runs every thread of a model as a coroutine on the one OS
// thread that runs the test, so the body never crosses an OS thread.
unsafe impl Send for OneThread {}

/// Runs `model` under loom with `bound` preemptions (unless
/// `LOOM_MAX_PREEMPTIONS` says otherwise) and returns what its executions
/// saw, for the model to check that its interesting cases were reached.
pub fn check(
    name: &str,
    bound: usize,
    model: impl Fn(&StdArc<Seen>) + Sync + Send + 'static,
) -> StdArc<Seen> {
    let seen = StdArc::new(Seen::default());
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(bound);
    }
    let bound = builder.preemption_bound;
    let s = seen.clone();
    let model = StdArc::new(model);
    let start = std::time::Instant::now();
    builder.check(move || {
        s.executions.fetch_add(1, StdOrdering::Relaxed);
        // On a thread with a large stack: loom's main coroutine has 32 KiB,
        // which a machine's `TlbShootdown` of loom atomics, built on the
        // stack before it is boxed, no longer fits in.
        let (s, model) = (s.clone(), model.clone());
        thread::Builder::new()
            .stack_size(CPU_STACK)
            .spawn(move || model(&s))
            .expect("a loom thread")
            .join()
            .expect("the model's thread");
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
pub fn nothing_lost(m: &Machine, shootdowns: &[&[usize]], syncs: u64, irqs_taken: &[usize]) {
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

/// Sets up CPU `index` of models (f) to (h'): it runs `mm` and has page 0
/// cached, before the model's CPUs start.
pub fn cached_on(m: &Arc<Machine>, seen: &StdArc<Seen>, index: usize, mm: &MmTlbState) {
    let cpu = Cpu::detached(index, m, seen);
    // SAFETY: a model: the root is never dereferenced.
    unsafe { switch_mm(&cpu, None, mm).unwrap() };
    assert!(cpu.walk());
}
