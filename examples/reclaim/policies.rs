//! The six flush policies the calibrated model compares, each as one
//! reclaim call: age the candidates, unmap the cold ones, flush, free.
//!
//! - **no batching**: every unmap is flushed at once, through the crate's
//!   `try_to_unmap` without `BATCH_FLUSH` (one shootdown per page).
//! - **seed RFC**: a page-sized list of (ASID, address) pairs; full or at
//!   the flush point it goes to every CPU of the union of the address
//!   spaces' CPU sets with one IPI each, and every target invalidates every
//!   listed page.
//! - **Linux 6.1**: deferral into one batch per call, then one *full*
//!   flush (`arch_tlbbatch_flush`), on the crate's primitives, which carry
//!   Linux 6.1's mechanism. At each PTE clear the batch adds the space's
//!   CPU set as it is then (`mm_cpumask`: the CPUs that run the space,
//!   lazy ones included; a CPU leaves it at switch-out, with or without
//!   PCID); at the flush point it advances the generation of each space
//!   (`tlb_gen`, through `flush_targets`) and sends one shootdown of those
//!   spaces to that union less the CPUs lazy now (`tlb_is_not_lazy`). A
//!   lazy CPU, or one that switched away, catches up by generation when
//!   it loads the space again (the crate's `switch_mm`).
//! - **Asterinas**: flush operations are queued per address space, up to
//!   32 (more turn into one full flush); each address space's queue is
//!   dispatched with its own round of IPIs to the CPUs that have it
//!   active. Its initiators wait with interrupts on, which changes nothing
//!   in a synchronous machine and is not charged.
//! - **tlb-batch**: the crate's `shrink_page_list` with a 32-page batch.
//! - **tlb-batch pool**: the crate's `shrink_page_list_pooled`: a call
//!   whose frames are all clean moves them into a `FramePool` of
//!   [`POOL_FRAMES`] instead of flushing; CPUs flush themselves at their
//!   timer ticks (`quiescent_flush`) and on untagged switches, and the pool
//!   hands frames back without IPIs once every CPU that could cache them
//!   has flushed, is lazy, or runs another address space (it catches up by
//!   generation first), or with one shootdown when it is full or memory
//!   runs out (`calibrated.rs` drives it).
//!
//! The by-hand policies reach their targets through the machine's IPI
//! hook: the initiator leaves its request in [`Shared`], each target reads
//! it when it takes the interrupt.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};

use tlb_batch::arch::mock::{MockCpu, MockKernel, MockMachine, MockRmap, Model};
use tlb_batch::{
    page_referenced, shootdown, shrink_page_list, shrink_page_list_pooled, try_to_unmap, Arch, Asid, CpuSet,
    FlushRequest, Frame, FramePool, OwnedFrame, PageTable, Rmap, TlbFlushUnmapBatch, TtuFlags, UnmapBatch,
    PAGE_SIZE,
};

/// The seed's list: what fits in a page beside its CPU mask and count.
pub const SEED_LIST: usize = (PAGE_SIZE as usize - std::mem::size_of::<CpuSet>() - 8) / 8;
/// Asterinas's queue: more operations than this become one full flush.
pub const ASTERINAS_OPS: usize = 32;
/// Pages a reclaim call scans (Linux's SWAP_CLUSTER_MAX), and the crate's
/// batch size.
pub const SCAN: usize = 32;
/// The pool of [`Peer::TlbBatchPool`]: 256 frames, an eighth of the
/// model's memory (1 MiB of 4 KiB pages; the measured guest had 256 MiB).
pub const POOL_FRAMES: usize = 256;

/// The pool the crate's pooled policy keeps across reclaim calls.
pub type Pool = FramePool<POOL_FRAMES>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Peer {
    NoBatching,
    Seed,
    Linux61,
    Asterinas,
    TlbBatch,
    /// tlb-batch with a frame pool released at the CPUs' own flushes.
    TlbBatchPool,
    /// tlb-batch on x86 with AMD's broadcast invalidation (`INVLPGB`; the
    /// mock's `X86Invlpgb`), broadcasting every flush that reaches another
    /// CPU.
    BroadcastAlways,
    /// The same hardware, broadcasting only flushes that must reach at
    /// least [`BROADCAST_MIN_REMOTE`] other CPUs, IPIs below that
    /// (`Arch::prefer_broadcast`).
    BroadcastWide,
}

/// The threshold of [`Peer::BroadcastWide`]: a flush that reaches one other
/// CPU (the common case with processes) interrupts it rather than make
/// every CPU of the machine invalidate and wait at the barrier.
pub const BROADCAST_MIN_REMOTE: usize = 2;

impl Peer {
    #[allow(dead_code)] // the tests run every policy
    pub const ALL: [Peer; 6] = [
        Peer::NoBatching,
        Peer::Seed,
        Peer::Linux61,
        Peer::Asterinas,
        Peer::TlbBatch,
        Peer::TlbBatchPool,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Peer::NoBatching => "no batching",
            Peer::Seed => "seed RFC",
            Peer::Linux61 => "Linux 6.1",
            Peer::Asterinas => "Asterinas",
            Peer::TlbBatch => "tlb-batch",
            Peer::TlbBatchPool => "tlb-batch pool",
            Peer::BroadcastAlways => "bcast always",
            Peer::BroadcastWide => "bcast >=2",
        }
    }
}

/// What a flush IPI asks of its targets.
#[derive(Default)]
pub struct Request {
    pages: Vec<(Asid, u64)>,
    full: bool,
}

pub type Shared = Arc<Mutex<Request>>;

/// Makes every CPU of `m` carry out the request in `shared` when it takes
/// a flush interrupt (the crate's own handler runs after it and finds
/// nothing to do for the by-hand policies).
pub fn install_hook<H: Model>(m: &MockMachine<H>, shared: &Shared) {
    let s = Arc::clone(shared);
    m.set_ipi_hook(Some(Arc::new(move |t: &MockCpu<'_, H>| {
        let r = s.lock().expect("benchmark lock");
        if r.full {
            t.flush_local_all(false);
        } else {
            for &(asid, va) in &r.pages {
                t.flush_local_page(asid, va);
            }
        }
    })));
}

/// One flush round: this CPU flushes itself if it has one of the ASIDs
/// loaded (its TLB is untagged: nothing else of theirs can be in it), then
/// one IPI to each other target.
fn round<H: Model>(
    cpu: &MockCpu<'_, H>,
    shared: &Shared,
    pages: &[(Asid, u64)],
    full: bool,
    targets: &CpuSet,
) {
    if pages.is_empty() {
        return;
    }
    let loaded = cpu.current_mm().map(|mm| mm.asid());
    if pages.iter().any(|&(a, _)| Some(a) == loaded) {
        if full {
            cpu.flush_local_all(false);
        } else {
            for &(asid, va) in pages {
                cpu.flush_local_page(asid, va);
            }
        }
    }
    {
        let mut r = shared.lock().expect("benchmark lock");
        r.pages = pages.to_vec();
        r.full = full;
    }
    cpu.send_flush_ipi(&targets.difference(&CpuSet::single(cpu.id())));
    shared.lock().expect("benchmark lock").pages.clear();
}

/// The workload's handle to a frame it allocated.
pub fn handle(frame: Frame) -> OwnedFrame {
    // SAFETY: the model allocates each frame once and frees it only
    // through the crate's drivers or `free_frame` after its flush, each of
    // which takes this single handle or the frame once.
    unsafe { OwnedFrame::new(frame) }
}

/// What one reclaim call did.
#[derive(Default)]
pub struct Call {
    pub freed: u64,
    /// Rounds of flush IPIs the initiator sent and waited for.
    pub rounds: u64,
}

/// One reclaim call of `peer` on `cpu` over `candidates` (taken from the
/// LRU's tail); frames kept go to `keep`. Only the pooled policy uses
/// `pool`.
pub fn reclaim<H: Model>(
    peer: Peer,
    cpu: &MockCpu<'_, H>,
    rmap: &MockRmap<'_, H>,
    shared: &Shared,
    pool: &mut Pool,
    candidates: Vec<Frame>,
    keep: &mut dyn FnMut(Frame),
) -> Call {
    match peer {
        Peer::TlbBatch | Peer::TlbBatchPool | Peer::BroadcastAlways | Peer::BroadcastWide => {
            let ipis = cpu.machine().ipis_sent();
            let mut kernel = MockKernel::new(rmap);
            let mut batch = UnmapBatch::<SCAN>::new();
            let frames = candidates.into_iter().map(handle);
            let mut back = |f: OwnedFrame, _| keep(f.into_frame());
            let s = if peer == Peer::TlbBatchPool {
                shrink_page_list_pooled(cpu, rmap, &mut kernel, &mut batch, pool, frames, &mut back)
            } else {
                shrink_page_list(cpu, rmap, &mut kernel, &mut batch, frames, &mut back)
            }
            .expect("not nested");
            Call {
                freed: s.freed as u64,
                // One flush per call (a batch of SCAN pages is never full
                // before the flush point), or the pool's `flush_oldest`.
                rounds: u64::from(cpu.machine().ipis_sent() > ipis),
            }
        }
        Peer::NoBatching => {
            let mut aging = TlbFlushUnmapBatch::new();
            let mut call = Call::default();
            for f in candidates {
                let hot = page_referenced(cpu, rmap, f, &mut aging)
                    .expect("aligned")
                    .referenced
                    > 0;
                let ipis = cpu.machine().ipis_sent();
                let gone = !hot
                    && try_to_unmap(cpu, rmap, f, TtuFlags::empty(), &mut aging)
                        .expect("not nested")
                        .is_unmapped();
                // Every page's flush is a round the initiator waits for.
                call.rounds += u64::from(cpu.machine().ipis_sent() > ipis);
                if gone {
                    rmap.remove_frame(f);
                    cpu.machine().free_frame(f).expect("unmapped and flushed");
                    call.freed += 1;
                } else {
                    keep(f);
                }
            }
            aging.flush(cpu).expect("not nested");
            call
        }
        Peer::Seed | Peer::Linux61 | Peer::Asterinas => deferred(peer, cpu, rmap, shared, candidates, keep),
    }
}

/// Invalidations owed, with the CPUs to reach, by ASID (in the order the
/// pages came in within each ASID).
type Pending = BTreeMap<u16, (Vec<(Asid, u64)>, CpuSet)>;

/// The three by-hand deferring policies: clear the PTEs, remember what
/// each target must invalidate, flush, then free.
fn deferred<H: Model>(
    peer: Peer,
    cpu: &MockCpu<'_, H>,
    rmap: &MockRmap<'_, H>,
    shared: &Shared,
    candidates: Vec<Frame>,
    keep: &mut dyn FnMut(Frame),
) -> Call {
    let mut aging = TlbFlushUnmapBatch::new();
    let mut unmapped = Vec::new();
    let mut pending: Pending = BTreeMap::new();
    let ipis = cpu.machine().ipis_sent();
    let mut rounds = 0;
    let seed_flush = |pending: &mut Pending, rounds: &mut u64| {
        let mut pages = Vec::new();
        let mut targets = CpuSet::new();
        for (_, (p, t)) in std::mem::take(pending) {
            pages.extend(p);
            targets = targets.union(&t);
        }
        let before = cpu.machine().ipis_sent();
        round(cpu, shared, &pages, false, &targets);
        *rounds += u64::from(cpu.machine().ipis_sent() > before);
    };
    for f in candidates {
        let hot = page_referenced(cpu, rmap, f, &mut aging)
            .expect("aligned")
            .referenced
            > 0;
        if hot {
            keep(f);
            continue;
        }
        let _ = rmap.walk(f, &mut |m| {
            if m.space.lookup(m.va).maps(f) {
                let mm = m.space.tlb_state();
                if m.space.clear(m.va).is_dirty() {
                    rmap.set_dirty(f);
                }
                // Linux marks the space for `flush_tlb_batched_pending`
                // when it defers, which it does when another CPU is in
                // `mm_cpumask` (`should_defer_flush`); only a range
                // teardown (`calibrated/ops.rs`) looks at the mark.
                if peer == Peer::Linux61 && !mm.cpus().difference(&CpuSet::single(cpu.id())).is_empty() {
                    mm.note_batched_pending();
                }
                let e = pending.entry(mm.asid().value()).or_default();
                e.0.push((mm.asid(), m.va));
                // The CPUs that run the space now, lazy ones left out (this
                // advances the space's generation: they catch up); for
                // Linux's, `mm_cpumask` as it is now, lazy ones included
                // (`set_tlb_ubc_flush_pending`).
                e.1 = e.1.union(&if peer == Peer::Linux61 {
                    mm.cpus()
                } else {
                    mm.flush_targets(cpu)
                });
            }
            ControlFlow::Continue(())
        });
        if peer == Peer::Seed && pending.values().map(|(p, _)| p.len()).sum::<usize>() >= SEED_LIST {
            seed_flush(&mut pending, &mut rounds);
        }
        if rmap.mapcount(f) == 0 {
            unmapped.push(f);
        } else {
            keep(f);
        }
    }
    // The flush point, before any frame is freed.
    match peer {
        Peer::Seed => seed_flush(&mut pending, &mut rounds),
        Peer::Linux61 => {
            // `arch_tlbbatch_flush`: every PTE is cleared, so each space's
            // generation advances now (its lazy and switched-away CPUs
            // catch up when they load it); then one full flush of the
            // batch's spaces to the CPUs gathered at the clears that are
            // not lazy now (`native_flush_tlb_multi`).
            let mut request = FlushRequest::new();
            let mut targets = CpuSet::new();
            for (asid, (_, t)) in std::mem::take(&mut pending) {
                let space = rmap
                    .spaces()
                    .iter()
                    .find(|s| s.mm().asid().value() == asid)
                    .expect("a known space");
                let _ = space.mm().flush_targets(cpu);
                request.add_asid(space.mm().asid());
                targets = targets.union(&t);
            }
            let targets = targets.difference(&cpu.machine().lazy_cpus());
            if !request.is_empty() {
                shootdown(cpu, &targets, &request).expect("not nested");
            }
            rounds = u64::from(cpu.machine().ipis_sent() > ipis);
        }
        _ => {
            for (_, (p, t)) in std::mem::take(&mut pending) {
                let before = cpu.machine().ipis_sent();
                round(cpu, shared, &p, p.len() > ASTERINAS_OPS, &t);
                rounds += u64::from(cpu.machine().ipis_sent() > before);
            }
        }
    }
    aging.flush(cpu).expect("not nested");
    let freed = unmapped.len() as u64;
    for f in unmapped {
        rmap.remove_frame(f);
        cpu.machine().free_frame(f).expect("unmapped and flushed");
    }
    Call { freed, rounds }
}
