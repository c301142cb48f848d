//! The simulated machine: its CPUs' state, memory, page tables and
//! oracle records, and the handles to its CPUs.

use core::marker::PhantomData;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::boxed::Box;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::vec::Vec;

use super::{
    cost, lock, new_root, oracle, Lazy, MmuTable, MockConfig, MockCpu, Model, SwitchHook, Table, Tlb,
    TlbEntry, Violation, WalkEntry, X86Like,
};
use crate::arch::Asid;
use crate::cpuset::{AtomicCpuSet, CpuId, CpuSet, MAX_CPUS};
use crate::mm::MmTlbState;
use crate::page_size::PageSize;
use crate::percpu::TlbShootdown;
use crate::pte::Frame;
use crate::stats::TraceEvent;
use crate::Error;

#[derive(Clone, Copy, Debug)]
pub(crate) enum BroadcastOp {
    /// A page, by ASID and virtual page number, with the level hint given.
    Page(Asid, u64, Option<PageSize>),
    Asid(Asid),
    All(bool),
}

pub(crate) struct CpuState {
    pub(crate) tlb: Mutex<Tlb>,
    pub(crate) loaded: Mutex<Option<(Asid, u64)>>,
    pub(crate) mm: Mutex<Option<Arc<MmTlbState>>>,
    /// The CPU's lazy mode ([`MockCpu::enter_lazy`]), if it is lazy. Lock
    /// order: this before the TLB (`leave_lazy`), never while holding it.
    pub(crate) lazy: Mutex<Option<Lazy>>,
    /// Entries of ASIDs the CPU had not loaded when their frames were
    /// freed, judged when it loads the ASID again (`unloaded.rs`). Lock
    /// order: as `lazy`.
    pub(crate) unloaded: Mutex<Vec<TlbEntry>>,
    /// The same for walk-cache entries pointing at freed page tables.
    pub(crate) unloaded_walks: Mutex<Vec<WalkEntry>>,
    /// Entries the CPU held while offline for frames freed (or, writable,
    /// written out) meanwhile, judged when it rejoins (`dormant.rs`). Lock
    /// order: as `lazy`.
    pub(crate) dormant: Mutex<Vec<TlbEntry>>,
    /// The same for walk-cache entries pointing at freed page tables.
    pub(crate) dormant_walks: Mutex<Vec<WalkEntry>>,
    pub(crate) irq_enabled: AtomicBool,
    pub(crate) irq_pending: AtomicBool,
    pub(crate) cycles: AtomicU64,
    pub(crate) interrupts: AtomicU64,
}

/// A simulated SMP machine; `M` fixes its hardware [`Model`].
pub struct MockMachine<M: Model = X86Like> {
    pub(crate) config: MockConfig,
    pub(crate) shootdown: Box<TlbShootdown>,
    pub(crate) cpus: Vec<CpuState>,
    pub(crate) memory: Mutex<oracle::Memory>,
    pub(crate) tables: RwLock<BTreeMap<u64, Table>>,
    pub(crate) kernel_root: u64,
    pub(crate) kernel_mm: Arc<MmTlbState>,
    /// The ASID each root of this machine was created with.
    pub(crate) roots: Mutex<BTreeMap<u64, Asid>>,
    /// The address space each user ASID was last given to
    /// ([`MockMachine::new_mm`]): live while someone holds it.
    pub(crate) asid_owners: Mutex<BTreeMap<u16, Weak<MmTlbState>>>,
    /// Aging epochs the crate stored through a [`MockRmap`](super::MockRmap)
    /// ([`Rmap::aged_epoch`](crate::Rmap::aged_epoch)), by frame; the
    /// machine's PTE writers forget those a write invalidates.
    pub(crate) aged: Mutex<BTreeMap<Frame, u64>>,
    /// The frame holding each leaf table, by (root, region of 512 pages).
    pub(crate) leaf_tables: Mutex<BTreeMap<(u64, u64), Frame>>,
    /// Page tables the kernel wrote itself, by root ([`MockMachine::attach_table`]).
    pub(crate) own_tables: Mutex<BTreeMap<u64, Arc<dyn MmuTable>>>,
    /// Whether `own_tables` holds anything (so that walks of the machine's
    /// own tables need not look).
    pub(crate) any_own_table: AtomicBool,
    /// Leaf tables detached from their page table and not freed yet.
    pub(crate) detached: Mutex<BTreeSet<Frame>>,
    /// Page-table frames of kernel-written tables (not the machine's own
    /// frames) that the kernel freed ([`MockMachine::free_table_frame`]),
    /// and has not linked again since.
    pub(crate) freed_tables: Mutex<BTreeSet<Frame>>,
    /// Lockless walks in progress: id -> (CPU, table frame).
    pub(crate) walkers: Mutex<BTreeMap<u64, (CpuId, Frame)>>,
    pub(crate) next_walk: AtomicU64,
    pub(crate) violations: Mutex<Vec<Violation>>,
    /// The CPUs that are up and take interrupts.
    pub(crate) online: AtomicCpuSet,
    /// IPIs sent to CPUs that were offline (dropped, as a sleeping CPU
    /// would not answer them).
    pub(crate) ipis_lost: AtomicU64,
    pub(crate) broadcast_queue: Mutex<Vec<(CpuId, BroadcastOp)>>,
    pub(crate) costs: cost::CostMeter,
    pub(crate) ipis_sent: AtomicU64,
    pub(crate) tracing: AtomicBool,
    pub(crate) trace_log: Mutex<Vec<TraceEvent>>,
    pub(crate) ipi_hook: Mutex<Option<IpiHook<M>>>,
    pub(crate) switch_hook: Mutex<Option<SwitchHook<M>>>,
    /// The threads running the switch hook now (a switch they make runs
    /// none).
    pub(crate) switch_hook_threads: Mutex<Vec<std::thread::ThreadId>>,
    /// Keeps the oracle's free-time judgement whole: a free or a write-out
    /// holds it shared from its scan of the TLBs to its last verdict, and
    /// a CPU holds it exclusively while it stops being lazy or loads an
    /// ASID. Without it a CPU could catch up and resume between the scan
    /// (which saw its entry) and the verdict (which no longer finds it
    /// lazy), and a correct flush would be reported as a violation.
    pub(crate) judgement: RwLock<()>,
    pub(crate) _model: PhantomData<M>,
}

/// Code a simulated CPU runs when it takes the flush interrupt, before the
/// crate's handler (see [`MockMachine::set_ipi_hook`]).
pub type IpiHook<M> = Arc<dyn for<'a> Fn(&MockCpu<'a, M>) + Send + Sync>;

impl<M: Model> MockMachine<M> {
    /// Holds off the transitions the oracle's free-time verdicts depend on
    /// (see the field `judgement`), for a free or a write-out.
    pub(crate) fn judging(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.judgement.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// A CPU's leave of lazy mode or load of an ASID, kept out of every
    /// free's or write-out's judgement.
    pub(crate) fn transition(&self) -> std::sync::RwLockWriteGuard<'_, ()> {
        self.judgement.write().unwrap_or_else(PoisonError::into_inner)
    }
}

impl MockMachine<X86Like> {
    /// An x86-like machine (see [`MockMachine::with_model`]).
    pub fn new(config: MockConfig) -> Result<Self, Error> {
        Self::with_model(config)
    }
}

impl<M: Model> MockMachine<M> {
    /// A machine of model `M`. Errors: [`Error::CpuOutOfRange`] when
    /// `config.cpus` is 0 or above [`MAX_CPUS`];
    /// [`Error::FeatureUnavailable`] (`supported: false`) for an address
    /// width outside 32 to 64 bits or an ASID wider than 16 bits, which no
    /// hardware the crate runs on has (the crate's ASIDs are 16 bits), and
    /// for a [`MockConfig::base_page`] other than 4, 16 or 64 KiB.
    pub fn with_model(config: MockConfig) -> Result<Self, Error> {
        if config.cpus == 0 || config.cpus > MAX_CPUS {
            return Err(Error::CpuOutOfRange {
                cpu: config.cpus,
                limit: MAX_CPUS,
            });
        }
        if !(32..=64).contains(&config.va_bits) {
            return Err(Error::FeatureUnavailable {
                feature: "a virtual-address width of 32 to 64 bits (MockConfig::va_bits)",
                supported: false,
            });
        }
        if !matches!(config.base_page.shift(), 12 | 14 | 16) {
            return Err(Error::FeatureUnavailable {
                feature: "a base page of 4, 16 or 64 KiB (MockConfig::base_page)",
                supported: false,
            });
        }
        if config.asid_bits > 16 {
            return Err(Error::FeatureUnavailable {
                feature: "an ASID width of at most 16 bits (MockConfig::asid_bits)",
                supported: false,
            });
        }
        let cpus = (0..config.cpus)
            .map(|_| CpuState {
                tlb: Mutex::new(Tlb::new(config.tlb_entries)),
                loaded: Mutex::new(None),
                mm: Mutex::new(None),
                lazy: Mutex::new(None),
                unloaded: Mutex::new(Vec::new()),
                unloaded_walks: Mutex::new(Vec::new()),
                dormant: Mutex::new(Vec::new()),
                dormant_walks: Mutex::new(Vec::new()),
                irq_enabled: AtomicBool::new(true),
                irq_pending: AtomicBool::new(false),
                cycles: AtomicU64::new(0),
                interrupts: AtomicU64::new(0),
            })
            .collect();
        let kernel_root = new_root();
        let mut tables = BTreeMap::new();
        tables.insert(kernel_root, Table::new());
        let mut roots = BTreeMap::new();
        roots.insert(kernel_root, Asid::KERNEL);
        Ok(MockMachine {
            config,
            shootdown: Box::new(TlbShootdown::new()),
            cpus,
            memory: Mutex::new(oracle::Memory::new(config.frames, config.table_frames)),
            tables: RwLock::new(tables),
            kernel_root,
            kernel_mm: Arc::new(MmTlbState::kernel(kernel_root)),
            roots: Mutex::new(roots),
            asid_owners: Mutex::new(BTreeMap::new()),
            aged: Mutex::new(BTreeMap::new()),
            leaf_tables: Mutex::new(BTreeMap::new()),
            detached: Mutex::new(BTreeSet::new()),
            freed_tables: Mutex::new(BTreeSet::new()),
            own_tables: Mutex::new(BTreeMap::new()),
            any_own_table: AtomicBool::new(false),
            walkers: Mutex::new(BTreeMap::new()),
            next_walk: AtomicU64::new(0),
            violations: Mutex::new(Vec::new()),
            online: {
                let online = AtomicCpuSet::new();
                online.insert_all(&CpuSet::first(config.cpus)?, Ordering::SeqCst);
                online
            },
            ipis_lost: AtomicU64::new(0),
            broadcast_queue: Mutex::new(Vec::new()),
            costs: cost::CostMeter::default(),
            ipis_sent: AtomicU64::new(0),
            tracing: AtomicBool::new(false),
            trace_log: Mutex::new(Vec::new()),
            ipi_hook: Mutex::new(None),
            switch_hook: Mutex::new(None),
            switch_hook_threads: Mutex::new(Vec::new()),
            judgement: RwLock::new(()),
            _model: PhantomData,
        })
    }

    /// Puts the machine back in the state [`with_model`](Self::with_model)
    /// built it in: every frame free, every TLB empty, every CPU online
    /// with no address space, not lazy, and interrupts on, no page table but the
    /// kernel's (empty), no record in the oracle, counters and costs at
    /// zero, no hooks. Address spaces made before are forgotten (the
    /// machine refuses them from now on). Much cheaper than building a new
    /// machine: a fuzzer reuses one machine for every input. Nothing may be
    /// running on the machine's CPUs.
    pub fn reset(&self) {
        for cpu in &self.cpus {
            lock(&cpu.tlb).clear();
            *lock(&cpu.loaded) = None;
            *lock(&cpu.mm) = None;
            *lock(&cpu.lazy) = None;
            lock(&cpu.unloaded).clear();
            lock(&cpu.unloaded_walks).clear();
            lock(&cpu.dormant).clear();
            lock(&cpu.dormant_walks).clear();
            cpu.irq_enabled.store(true, Ordering::SeqCst);
            cpu.irq_pending.store(false, Ordering::SeqCst);
            cpu.cycles.store(0, Ordering::Relaxed);
            cpu.interrupts.store(0, Ordering::Relaxed);
        }
        self.shootdown.reset(self.cpus.len());
        lock(&self.memory).reset();
        {
            let mut tables = self.tables.write().unwrap_or_else(PoisonError::into_inner);
            tables.clear();
            tables.insert(self.kernel_root, Table::new());
        }
        {
            let mut roots = lock(&self.roots);
            roots.clear();
            roots.insert(self.kernel_root, Asid::KERNEL);
        }
        lock(&self.asid_owners).clear();
        lock(&self.aged).clear();
        lock(&self.leaf_tables).clear();
        lock(&self.detached).clear();
        lock(&self.freed_tables).clear();
        lock(&self.own_tables).clear();
        self.any_own_table.store(false, Ordering::SeqCst);
        lock(&self.walkers).clear();
        lock(&self.violations).clear();
        lock(&self.broadcast_queue).clear();
        lock(&self.trace_log).clear();
        *lock(&self.ipi_hook) = None;
        *lock(&self.switch_hook) = None;
        self.online.take(Ordering::SeqCst);
        if let Ok(all) = CpuSet::first(self.cpus.len()) {
            self.online.insert_all(&all, Ordering::SeqCst);
        }
        self.ipis_lost.store(0, Ordering::Relaxed);
        self.ipis_sent.store(0, Ordering::Relaxed);
        self.tracing.store(false, Ordering::Relaxed);
        self.costs.reset();
    }

    /// The configuration the machine was built with.
    pub fn config(&self) -> &MockConfig {
        &self.config
    }

    /// Number of CPUs.
    pub fn nr_cpus(&self) -> usize {
        self.cpus.len()
    }

    /// CPU `index`'s view of the machine, or [`Error::CpuOutOfRange`].
    pub fn cpu(&self, index: usize) -> Result<MockCpu<'_, M>, Error> {
        if index >= self.cpus.len() {
            return Err(Error::CpuOutOfRange {
                cpu: index,
                limit: self.cpus.len(),
            });
        }
        Ok(MockCpu {
            machine: self,
            id: CpuId::new(index)?,
        })
    }

    /// Every CPU's view, in order.
    pub fn cpus(&self) -> impl Iterator<Item = MockCpu<'_, M>> + '_ {
        (0..self.cpus.len()).filter_map(move |i| self.cpu(i).ok())
    }

    /// The CPUs that are online (all of them until one goes offline).
    pub fn online(&self) -> CpuSet {
        self.online.load(Ordering::SeqCst)
    }

    /// Whether `cpu` is online.
    pub(crate) fn is_online(&self, cpu: CpuId) -> bool {
        self.online.contains(cpu, Ordering::SeqCst)
    }

    /// The raw switch behind [`MockCpu::take_offline`] and
    /// [`MockCpu::come_online`]: puts `cpu` in or out of the online set and
    /// nothing else. A kernel's online path runs
    /// [`prepare_cpu_online`](crate::prepare_cpu_online) first; calling this
    /// instead models a kernel that forgets to: an entry the CPU still
    /// holds for a frame freed (or, writable, written out) while it was
    /// away is then a [`Violation::OnlineWithStale`]
    /// ([`Violation::OnlineWithStaleWalk`] for a walk-cache entry pointing
    /// at a freed table), recorded as it rejoins, whatever the frame holds
    /// by then. A kernel's offline path serves the
    /// CPU's inbox until no initiator can still publish to it
    /// ([`take_cpu_offline`](crate::take_cpu_offline)); taking a CPU out
    /// with this instead models one that does not: with
    /// [`Delivery::Threaded`](super::Delivery::Threaded), a shootdown that
    /// read the online set just before may then wait forever for the CPU
    /// (with synchronous delivery no shootdown is in flight between calls,
    /// so nothing is stranded). Errors: [`Error::CpuOutOfRange`].
    pub fn set_online(&self, cpu: usize, online: bool) -> Result<(), Error> {
        let id = self.cpu(cpu)?.id();
        if online {
            self.join_online(id);
        } else {
            self.online.remove(id, Ordering::SeqCst);
        }
        Ok(())
    }

    /// IPIs sent to CPUs that were offline at the time, or that the machine
    /// does not have (dropped).
    pub fn ipis_lost(&self) -> u64 {
        self.ipis_lost.load(Ordering::Relaxed)
    }

    /// Only for ids this machine handed out (through a [`MockCpu`]), which
    /// are below `cpus.len()` by construction.
    pub(crate) fn state(&self, cpu: CpuId) -> &CpuState {
        &self.cpus[cpu.index()]
    }
}
