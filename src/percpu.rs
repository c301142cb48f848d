//! The shootdown bookkeeping of one machine, as data: per-CPU inboxes,
//! request slots and loaded ASIDs, and the counters. The protocol that
//! moves requests through them is in [`shootdown`](crate::shootdown); this
//! module knows nothing of [`Arch`](crate::Arch), which names the state it
//! returns from [`Arch::shootdown_state`](crate::Arch::shootdown_state)(crate::Arch::shootdown_state).

use crate::asid::Asid;
use crate::cpuset::{AtomicCpuSet, CpuId, CpuSet, MAX_CPUS};
use crate::generation::{AsidSlots, GenStep};
use crate::page_size::PageSize;
use crate::request::{FlushRange, FlushRequest, FlushScope, MAX_FLUSH_ASIDS, MAX_FLUSH_ENTRIES};
use crate::stats::{Counter, TlbStats, TlbStatsSnapshot};
use crate::sync::{atomic_array, maybe_const_fn, AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};

const NO_ASID: u32 = u32::MAX;

const KIND_RANGES: u8 = 0;
const KIND_ASIDS: u8 = 1;
const KIND_ALL: u8 = 2;
const KIND_ALL_GLOBAL: u8 = 3;
const KIND_SYNC: u8 = 4;

/// What a request slot carries: a flush, or nothing but the interrupt.
#[derive(Clone, Copy)]
pub(crate) enum Payload<'a> {
    Flush(&'a FlushRequest),
    Sync,
}

/// One CPU's outgoing request. Fields are atomics so that readers on other
/// CPUs never race with a plain write; the publishing `inbox` update
/// (release) and the handler's `take` (acquire) order them.
pub(crate) struct RequestSlot {
    pub(crate) busy: AtomicBool,
    pub(crate) remaining: AtomicU32,
    kind: AtomicU8,
    len: AtomicU8,
    /// Whether the page flushes may carry level hints
    /// ([`FlushRequest::leaf_hints`]).
    hinted: AtomicBool,
    words: [AtomicU64; 2 * MAX_FLUSH_ENTRIES],
    /// The generation steps of a page request's ASIDs: how many, and for
    /// each its ASID, start and end.
    nr_steps: AtomicU8,
    step_asid: [AtomicU32; MAX_FLUSH_ASIDS],
    step_from: [AtomicU64; MAX_FLUSH_ASIDS],
    step_to: [AtomicU64; MAX_FLUSH_ASIDS],
}

static_assertions::const_assert!(MAX_FLUSH_ENTRIES <= u8::MAX as usize);
// A range's page count shares its slot word with the ASID and the stride.
static_assertions::const_assert!(MAX_FLUSH_ENTRIES < 1 << 24);
static_assertions::const_assert!(MAX_FLUSH_ASIDS <= u8::MAX as usize);

impl RequestSlot {
    maybe_const_fn! {
        fn new() -> Self {
            RequestSlot {
                busy: AtomicBool::new(false),
                remaining: AtomicU32::new(0),
                kind: AtomicU8::new(KIND_RANGES),
                len: AtomicU8::new(0),
                hinted: AtomicBool::new(false),
                words: atomic_array![AtomicU64::new(0); 2 * MAX_FLUSH_ENTRIES],
                nr_steps: AtomicU8::new(0),
                step_asid: atomic_array![AtomicU32::new(0); MAX_FLUSH_ASIDS],
                step_from: atomic_array![AtomicU64::new(0); MAX_FLUSH_ASIDS],
                step_to: atomic_array![AtomicU64::new(0); MAX_FLUSH_ASIDS],
            }
        }
    }

    pub(crate) fn write(&self, payload: Payload<'_>) {
        let req = match payload {
            Payload::Flush(req) => req,
            Payload::Sync => {
                self.kind.store(KIND_SYNC, Ordering::Relaxed);
                self.len.store(0, Ordering::Relaxed);
                return;
            }
        };
        let (kind, len) = match req.scope() {
            FlushScope::Ranges(ranges) => {
                for (i, r) in ranges.iter().enumerate() {
                    self.words[2 * i].store(r.start, Ordering::Relaxed);
                    // A range's pages are at most MAX_FLUSH_ENTRIES (below
                    // 2^24, asserted), its stride's shift below 2^8.
                    let meta = (u64::from(r.asid.value()) << 32)
                        | (u64::from(r.stride.shift()) << 24)
                        | u64::from(r.pages);
                    self.words[2 * i + 1].store(meta, Ordering::Relaxed);
                }
                let mut n = 0;
                for (i, (asid, step)) in req.steps().enumerate() {
                    self.step_asid[i].store(u32::from(asid.value()), Ordering::Relaxed);
                    self.step_from[i].store(step.from, Ordering::Relaxed);
                    self.step_to[i].store(step.to, Ordering::Relaxed);
                    n = i + 1;
                }
                // At most MAX_FLUSH_ASIDS steps, which fits in u8.
                self.nr_steps.store(n as u8, Ordering::Relaxed);
                self.hinted.store(req.leaf_hints(), Ordering::Relaxed);
                (KIND_RANGES, ranges.len())
            }
            FlushScope::Asids(asids) => {
                for (i, a) in asids.iter().enumerate() {
                    self.words[i].store(u64::from(a.value()), Ordering::Relaxed);
                }
                (KIND_ASIDS, asids.len())
            }
            FlushScope::Everything { include_global } => {
                (if include_global { KIND_ALL_GLOBAL } else { KIND_ALL }, 0)
            }
        };
        self.kind.store(kind, Ordering::Relaxed);
        // `len` is at most MAX_FLUSH_ENTRIES, which fits in u8 (asserted).
        self.len.store(len as u8, Ordering::Relaxed);
    }

    /// The request in the slot; `None` for a sync, which flushes nothing.
    pub(crate) fn read(&self) -> Option<FlushRequest> {
        let len = usize::from(self.len.load(Ordering::Relaxed)).min(MAX_FLUSH_ENTRIES);
        // Only values written from a valid `Asid` by `write` are read back.
        let asid_of = |w: u64| Asid::from_raw(w as u16);
        Some(match self.kind.load(Ordering::Relaxed) {
            KIND_SYNC => return None,
            KIND_RANGES => {
                let mut ranges = [FlushRange {
                    asid: Asid::KERNEL,
                    start: 0,
                    pages: 0,
                    stride: PageSize::SIZE_4K,
                }; MAX_FLUSH_ENTRIES];
                for (i, r) in ranges.iter_mut().enumerate().take(len) {
                    let meta = self.words[2 * i + 1].load(Ordering::Relaxed);
                    // Only shifts `write` stored from a valid `PageSize`
                    // are read back; should one not be, the receiving CPU
                    // flushes everything rather than guess a stride.
                    let Some(stride) = PageSize::from_shift(((meta >> 24) & 0xff) as u32) else {
                        return Some(FlushRequest::from_parts(FlushScope::Everything {
                            include_global: true,
                        }));
                    };
                    *r = FlushRange {
                        asid: asid_of(meta >> 32),
                        start: self.words[2 * i].load(Ordering::Relaxed),
                        pages: (meta & 0xff_ffff) as u32,
                        stride,
                    };
                }
                let mut req = FlushRequest::from_parts(FlushScope::Ranges(&ranges[..len]));
                if self.hinted.load(Ordering::Relaxed) {
                    req.allow_leaf_hints();
                }
                let steps = usize::from(self.nr_steps.load(Ordering::Relaxed)).min(MAX_FLUSH_ASIDS);
                for i in 0..steps {
                    let step = GenStep {
                        from: self.step_from[i].load(Ordering::Relaxed),
                        to: self.step_to[i].load(Ordering::Relaxed),
                    };
                    req.set_step(
                        asid_of(u64::from(self.step_asid[i].load(Ordering::Relaxed))),
                        step,
                    );
                }
                req
            }
            KIND_ASIDS => {
                let mut asids = [Asid::KERNEL; MAX_FLUSH_ENTRIES];
                for (i, a) in asids.iter_mut().enumerate().take(len) {
                    *a = asid_of(self.words[i].load(Ordering::Relaxed));
                }
                FlushRequest::from_parts(FlushScope::Asids(&asids[..len]))
            }
            kind => FlushRequest::from_parts(FlushScope::Everything {
                include_global: kind == KIND_ALL_GLOBAL,
            }),
        })
    }
}

#[repr(align(64))]
pub(crate) struct PerCpu {
    pub(crate) inbox: AtomicCpuSet,
    pub(crate) ipi_pending: AtomicBool,
    /// How many initiators on this CPU are between reading the online set
    /// and having published to every target they read there (more than
    /// one when an interrupt handler's shootdown nests in another). A CPU
    /// going offline waits until it reads zero here on every other CPU
    /// (see [`take_cpu_offline`](crate::take_cpu_offline)).
    pub(crate) choosing: AtomicU32,
    loaded_asid: AtomicU32,
    /// The user ASID a switch in progress is leaving ([`switch_mm`](crate::switch_mm)):
    /// the CPU still has its root loaded until the switch loads the next
    /// one, so it counts as running both meanwhile.
    leaving_asid: AtomicU32,
    /// The newest flush epoch this CPU is known to have flushed past: it
    /// read the machine's epoch, then dropped every non-global entry.
    passed: AtomicU64,
    /// The newest epoch a [`FramePool`](crate::FramePool) published while
    /// counting this CPU among those that may cache its frames.
    owed: AtomicU64,
    /// The ASIDs whose entries this CPU may hold, each with the generation
    /// it flushed them up to (see [`generation`](crate::generation)).
    pub(crate) asids: AsidSlots,
    pub(crate) slot: RequestSlot,
}

impl PerCpu {
    maybe_const_fn! {
        fn new() -> Self {
            PerCpu {
                inbox: AtomicCpuSet::new(),
                ipi_pending: AtomicBool::new(false),
                choosing: AtomicU32::new(0),
                loaded_asid: AtomicU32::new(NO_ASID),
                leaving_asid: AtomicU32::new(NO_ASID),
                passed: AtomicU64::new(0),
                owed: AtomicU64::new(0),
                asids: AsidSlots::new(),
                slot: RequestSlot::new(),
            }
        }
    }
}

/// All shootdown bookkeeping of one machine: per-CPU inboxes, request
/// slots and loaded ASIDs, and the counters. Build it once, in a `static`,
/// and return it from [`Arch::shootdown_state`](crate::Arch::shootdown_state).
///
/// ```
/// static TLB: tlb_batch::TlbShootdown = tlb_batch::TlbShootdown::new();
/// assert_eq!(TLB.stats().ipis_sent, 0);
/// ```
pub struct TlbShootdown {
    pub(crate) cpus: [PerCpu; MAX_CPUS],
    /// The flush epoch: advanced once per generation of pooled frames,
    /// after their PTEs were cleared (see [`FramePool`](crate::FramePool)).
    epoch: AtomicU64,
    /// The CPUs in lazy TLB mode ([`enter_lazy_tlb`](crate::enter_lazy_tlb)):
    /// they keep a user space loaded, and flushes of it skip them.
    lazy: AtomicCpuSet,
    stats: TlbStats,
}

impl Default for TlbShootdown {
    fn default() -> Self {
        TlbShootdown::new()
    }
}

impl TlbShootdown {
    maybe_const_fn! {
        /// Fresh state: no CPU has an address space loaded, nothing in flight.
        pub fn new() -> Self {
            TlbShootdown {
                cpus: atomic_array![PerCpu::new(); MAX_CPUS],
                epoch: AtomicU64::new(0),
                lazy: AtomicCpuSet::new(),
                stats: TlbStats::new(),
            }
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> TlbStatsSnapshot {
        self.stats.snapshot()
    }

    pub(crate) fn count(&self, which: Counter, n: u64) {
        self.stats.add(which, n);
    }

    /// Back to the state `new` gives, for the first `cpus` CPUs (the mock
    /// machine's reset; nothing may be in flight).
    #[cfg(feature = "mock")]
    pub(crate) fn reset(&self, cpus: usize) {
        for cpu in self.cpus.iter().take(cpus) {
            cpu.inbox.take(Ordering::SeqCst);
            cpu.ipi_pending.store(false, Ordering::SeqCst);
            cpu.choosing.store(0, Ordering::SeqCst);
            cpu.loaded_asid.store(NO_ASID, Ordering::SeqCst);
            cpu.leaving_asid.store(NO_ASID, Ordering::SeqCst);
            cpu.slot.busy.store(false, Ordering::SeqCst);
            cpu.slot.remaining.store(0, Ordering::SeqCst);
            cpu.passed.store(0, Ordering::SeqCst);
            cpu.owed.store(0, Ordering::SeqCst);
            cpu.asids.clear();
        }
        self.epoch.store(0, Ordering::SeqCst);
        self.lazy.take(Ordering::SeqCst);
        self.stats.reset();
    }

    /// The ASID `cpu` has loaded, as recorded by [`switch_mm`](crate::switch_mm).
    pub fn loaded_asid(&self, cpu: CpuId) -> Option<Asid> {
        match self.cpus[cpu.index()].loaded_asid.load(Ordering::SeqCst) {
            NO_ASID => None,
            // Stored from a valid `Asid` by `set_loaded_asid`.
            v => Some(Asid::from_raw(v as u16)),
        }
    }

    pub(crate) fn clear_loaded_asid(&self, cpu: CpuId) {
        self.cpus[cpu.index()]
            .loaded_asid
            .store(NO_ASID, Ordering::Relaxed);
    }

    /// The user ASID `cpu` is switching away from, while its switch has
    /// not loaded the next root yet.
    pub(crate) fn leaving_asid(&self, cpu: CpuId) -> Option<Asid> {
        match self.cpus[cpu.index()].leaving_asid.load(Ordering::SeqCst) {
            NO_ASID => None,
            // Stored from a valid `Asid` by `set_leaving_asid`.
            v => Some(Asid::from_raw(v as u16)),
        }
    }

    /// Sequentially consistent, and set before the loaded ASID changes: a
    /// reader that sees the new loaded ASID and then reads this sees the
    /// space being left, until the switch has loaded the next root.
    pub(crate) fn set_leaving_asid(&self, cpu: CpuId, asid: Option<Asid>) {
        let raw = asid.map_or(NO_ASID, |a| u32::from(a.value()));
        self.cpus[cpu.index()].leaving_asid.store(raw, Ordering::SeqCst);
    }

    pub(crate) fn set_loaded_asid(&self, cpu: CpuId, asid: Asid) {
        self.cpus[cpu.index()]
            .loaded_asid
            .store(u32::from(asid.value()), Ordering::SeqCst);
    }

    /// Opens a new flush epoch and returns it. Called after the PTEs of the
    /// frames it stands for were cleared: a CPU that reads this epoch (or a
    /// later one) and then flushes has dropped every entry for them.
    pub(crate) fn publish_epoch(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::SeqCst).wrapping_add(1)
    }

    /// The newest published epoch.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Records that `cpu` may cache frames of epoch `epoch`: its next
    /// [`quiescent_flush`](crate::quiescent_flush) flushes.
    pub(crate) fn owe(&self, cpu: CpuId, epoch: u64) {
        self.cpus[cpu.index()].owed.fetch_max(epoch, Ordering::SeqCst);
    }

    /// Records that `cpu` dropped every non-global entry after reading
    /// epoch `epoch`.
    pub(crate) fn pass(&self, cpu: CpuId, epoch: u64) {
        self.cpus[cpu.index()].passed.fetch_max(epoch, Ordering::SeqCst);
    }

    /// The newest epoch `cpu` has flushed past (0: none yet). Frames of a
    /// [`FramePool`](crate::FramePool) generation with this epoch or an
    /// older one hold no entry on `cpu`.
    pub fn passed_epoch(&self, cpu: CpuId) -> u64 {
        self.cpus[cpu.index()].passed.load(Ordering::SeqCst)
    }

    /// Whether `cpu` owes a flush to a pooled generation it has not
    /// flushed past yet ([`quiescent_flush`](crate::quiescent_flush) on it
    /// would flush).
    pub fn flush_owed(&self, cpu: CpuId) -> bool {
        let c = &self.cpus[cpu.index()];
        c.owed.load(Ordering::SeqCst) > c.passed.load(Ordering::SeqCst)
    }

    /// The CPUs in lazy TLB mode now ([`enter_lazy_tlb`](crate::enter_lazy_tlb)).
    pub fn lazy_cpus(&self) -> CpuSet {
        self.lazy.load(Ordering::SeqCst)
    }

    /// Whether `cpu` is in lazy TLB mode.
    pub fn is_lazy(&self, cpu: CpuId) -> bool {
        self.lazy.load(Ordering::SeqCst).contains(cpu)
    }

    pub(crate) fn set_lazy(&self, cpu: CpuId, lazy: bool) {
        // Sequentially consistent on both sides: a flusher that reads the
        // set after advancing a generation either sees a CPU that left
        // lazy mode, or that CPU's generation check sees the advance.
        if lazy {
            self.lazy.insert(cpu, Ordering::SeqCst);
        } else {
            self.lazy.remove(cpu, Ordering::SeqCst);
        }
    }

    /// The generation `cpu` is known to have flushed `asid`'s entries up
    /// to: the newer of its last flush of that ASID and its last pass.
    pub fn flushed_generation(&self, cpu: CpuId, asid: Asid) -> u64 {
        let c = &self.cpus[cpu.index()];
        c.asids.flushed(asid).max(c.passed.load(Ordering::SeqCst))
    }

    /// The generation of `asid`'s address space up to which `cpu` has
    /// carried out every flush (see [`generation`](crate::generation)): at
    /// least [`flushed_generation`](Self::flushed_generation), and more
    /// after page flushes that followed each other. A CPU loading the ASID
    /// flushes it first when this is below the space's `tlb_gen`.
    pub fn caught_up_generation(&self, cpu: CpuId, asid: Asid) -> u64 {
        let c = &self.cpus[cpu.index()];
        c.asids.caught(asid).max(c.passed.load(Ordering::SeqCst))
    }

    /// [`flushed_generation`](Self::flushed_generation) and
    /// [`caught_up_generation`](Self::caught_up_generation) of `asid` on
    /// `cpu`, read from another CPU: `None` when `cpu` reassigned one of
    /// its ASID slots meanwhile, so that the pair may mix two ASIDs'
    /// values. What it returns is a value `cpu` really reached for `asid`
    /// (or older), fit to grant it a generation on
    /// ([`grant_generation`](Self::grant_generation)).
    pub(crate) fn stable_generations(&self, cpu: CpuId, asid: Asid) -> Option<(u64, u64)> {
        let c = &self.cpus[cpu.index()];
        let (flushed, caught) = c.asids.stable(|s| (s.flushed(asid), s.caught(asid)))?;
        let passed = c.passed.load(Ordering::SeqCst);
        Some((flushed.max(passed), caught.max(passed)))
    }

    /// Records that `cpu` holds no entry of `asid` left by any flush of its
    /// address space up to generation `to` (a flush left it out because it
    /// holds none of that flush's entries and had carried out every flush
    /// before it): its next load of `asid` needs no catch-up for them.
    pub(crate) fn grant_generation(&self, cpu: CpuId, asid: Asid, to: u64) {
        self.cpus[cpu.index()].asids.grant(asid, to);
        self.count(Counter::GenerationsGranted, 1);
    }

    pub(crate) fn asid_slots(&self, cpu: CpuId) -> &AsidSlots {
        &self.cpus[cpu.index()].asids
    }

    /// How many initiators have a request waiting in `cpu`'s inbox.
    pub fn pending_requests(&self, cpu: CpuId) -> usize {
        self.cpus[cpu.index()].inbox.load(Ordering::Acquire).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::range::PageRange;

    /// A page request read back from a slot keeps its ASIDs' generation
    /// steps (a target follows them); one written after it without steps
    /// reads back without, not with the old ones.
    #[test]
    fn a_slot_carries_the_steps_of_a_page_request() {
        let slot = RequestSlot::new();
        let (a, b) = (Asid::new(1).unwrap(), Asid::new(2).unwrap());
        let page = |i: u64| PageRange::page(0x4000 + i * 0x1000).unwrap();
        let mut req = FlushRequest::new();
        req.add_range_step(a, page(0), 33, Some(GenStep { from: 3, to: 4 }));
        req.add_range_step(b, page(1), 33, Some(GenStep { from: 7, to: 9 }));
        slot.write(Payload::Flush(&req));
        let back = slot.read().unwrap();
        assert_eq!(back.scope(), req.scope());
        assert_eq!(
            back.steps().collect::<std::vec::Vec<_>>(),
            req.steps().collect::<std::vec::Vec<_>>()
        );
        assert_eq!(back.steps().count(), 2);
        let mut plain = FlushRequest::new();
        plain.add_range(a, page(0), 33);
        slot.write(Payload::Flush(&plain));
        assert_eq!(slot.read().unwrap().steps().count(), 0);
    }

    /// A slot carries each range's stride: huge pages read back as huge
    /// pages, beside 4 KiB ones of the same ASID.
    #[test]
    fn a_slot_carries_the_stride_of_each_range() {
        let slot = RequestSlot::new();
        let a = Asid::new(1).unwrap();
        let mut req = FlushRequest::new();
        let gib = PageRange::new(1 << 30, 2 << 18).unwrap();
        req.add_huge_range(a, gib, PageSize::SIZE_1G, 33).unwrap();
        req.add_range(a, PageRange::page(0x4000).unwrap(), 33);
        slot.write(Payload::Flush(&req));
        let back = slot.read().unwrap();
        assert_eq!((back.scope(), back.pages()), (req.scope(), 3));
    }
}
