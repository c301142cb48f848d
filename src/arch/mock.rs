//! A simulated SMP machine that models real TLB behaviour (feature `mock`).
//!
//! Every host test, benchmark and fuzz target of this crate runs on it, and
//! kernels can use it in their own tests. It is a model, not a counter:
//!
//! - Each simulated CPU has a bounded TLB that fills on access by walking
//!   the simulated page tables, sets accessed and dirty bits atomically the
//!   way hardware does, and keeps stale entries until they are flushed.
//! - A write through a cached *clean* entry re-walks the page table (and
//!   faults if the PTE is gone), as on x86; [`NoRewalk`] models hardware
//!   without that guarantee, so tests can prove the crate never defers
//!   there. [`BroadcastTlbi`] models broadcast invalidation (arm64 `TLBI IS`,
//!   AMD `INVLPGB`): no IPIs, remote entries disappear at the barrier.
//! - A frame-state oracle knows which frames are free, in use or under I/O
//!   and records every [`Violation`] of the safety contract: a write
//!   through a stale entry into a free or in-I/O frame, a read of a free
//!   frame, a frame freed while cached, a frame sent to I/O while cached
//!   writable.
//! - IPIs are delivered either synchronously (the target's handler runs at
//!   once, on the sender's thread) or, with [`Delivery::Threaded`] and
//!   [`MockMachine::run_threaded`], to CPUs that are real threads and take
//!   interrupts at their instruction boundaries when interrupts are enabled.
//! - A [`CostModel`] charges cycles for IPIs, invalidations and refills, kept
//!   as running totals.
//!
//! Each [`MockCpu`] is one CPU's view of the machine and implements
//! [`Arch`]; many machines can run side by side in parallel tests.

mod cost;
mod counting;
mod kernel;
pub mod ops;
mod oracle;
mod tlb;

use core::marker::PhantomData;
use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::boxed::Box;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::vec::Vec;

pub use cost::{CostKind, CostModel, CostTotals};
pub use counting::CountingTable;
pub use kernel::{IoMode, MockKernel, MockRmap};
pub use oracle::{FrameError, FrameState, Violation};
pub use tlb::TlbEntry;

use tlb::Tlb;

use crate::arch::{Arch, Asid};
use crate::cpuset::{CpuId, CpuSet, MAX_CPUS};
use crate::mm::{switch_mm, MmTlbState};
use crate::pte::{Frame, Pte, PteFlags, PAGE_SHIFT, PAGE_SIZE};
use crate::range::{check_asid, check_va, PageRange};
use crate::rmap::{PageState, PageTable};
use crate::shootdown::{handle_flush_ipi, TlbShootdown};
use crate::stats::{TlbStatsSnapshot, TraceEvent};
use crate::Error;

/// The hardware properties a simulated machine has.
pub trait Model: Send + Sync + 'static {
    /// See [`Arch::CLEAN_WRITE_REWALK`].
    const CLEAN_WRITE_REWALK: bool;
    /// See [`Arch::ACCESSED_CLEAR_NEEDS_FLUSH`].
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool;
    /// See [`Arch::BROADCAST_INVALIDATE`].
    const BROADCAST_INVALIDATE: bool;
}

/// x86-like hardware: writes through clean entries re-walk, clearing the
/// accessed bit needs no flush, remote flushes need IPIs.
#[derive(Debug)]
pub struct X86Like;

impl Model for X86Like {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;
    const BROADCAST_INVALIDATE: bool = false;
}

/// Hardware that writes through a cached clean entry without looking at
/// the page table again: deferring a flush is unsafe there.
#[derive(Debug)]
pub struct NoRewalk;

impl Model for NoRewalk {
    const CLEAN_WRITE_REWALK: bool = false;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = true;
    const BROADCAST_INVALIDATE: bool = false;
}

/// Broadcast-invalidation hardware (arm64 `TLBI ... IS` + `DSB`, AMD
/// `INVLPGB` + `TLBSYNC`): remote entries go without any IPI, completed by
/// one barrier.
#[derive(Debug)]
pub struct BroadcastTlbi;

impl Model for BroadcastTlbi {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = true;
    const BROADCAST_INVALIDATE: bool = true;
}

/// How IPIs reach their target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// The target's handler runs at once, on the sending thread (interrupt
    /// masking is not modelled). Deterministic; for counting tests.
    Synchronous,
    /// The target CPU is a thread (see [`MockMachine::run_threaded`]) and
    /// takes the interrupt at its next instruction boundary while its
    /// interrupts are enabled.
    Threaded,
}

/// The shape of a simulated machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MockConfig {
    /// Number of CPUs, 1 to [`MAX_CPUS`].
    pub cpus: usize,
    /// Physical frames of memory.
    pub frames: usize,
    /// TLB entries per CPU.
    pub tlb_entries: usize,
    /// Frames set aside for page tables (one per 512-page region mapped).
    pub table_frames: usize,
    /// Whether TLB entries survive address-space switches (PCID).
    pub tagged_tlb: bool,
    /// Virtual-address width ([`Arch::va_bits`]): 48 like x86-64.
    pub va_bits: u32,
    /// ASID width ([`Arch::asid_bits`]): 12 like x86's PCIDs.
    pub asid_bits: u32,
    /// How IPIs are delivered.
    pub delivery: Delivery,
    /// Cycle charges.
    pub cost: CostModel,
}

impl MockConfig {
    /// `cpus` CPUs, 4096 frames, 64-entry untagged TLBs, 48-bit addresses,
    /// 12-bit ASIDs, synchronous IPIs.
    pub fn x86_like(cpus: usize) -> Self {
        MockConfig {
            cpus,
            frames: 4096,
            tlb_entries: 64,
            table_frames: 256,
            tagged_tlb: false,
            va_bits: 48,
            asid_bits: 12,
            delivery: Delivery::Synchronous,
            cost: CostModel::default(),
        }
    }

    /// The same machine with threaded IPI delivery.
    #[must_use]
    pub fn threaded(mut self) -> Self {
        self.delivery = Delivery::Threaded;
        self
    }
}

/// Why a simulated memory access did not complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// No present PTE maps the address (page fault).
    NotMapped {
        /// The faulting address.
        va: u64,
    },
    /// A write to a page mapped read-only.
    WriteProtected {
        /// The faulting address.
        va: u64,
    },
    /// The PTE is a migration entry: the access waits for the migration.
    Migration {
        /// The faulting address.
        va: u64,
    },
    /// The PTE marks a hardware-poisoned frame.
    HwPoison {
        /// The faulting address.
        va: u64,
    },
}

/// Why a machine-level operation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MockError {
    /// A frame operation was refused.
    Frame(FrameError),
    /// Bad input (unaligned address, CPU out of range, ...).
    Input(Error),
    /// The address space was not created by this machine.
    UnknownAddressSpace,
}

impl From<FrameError> for MockError {
    fn from(e: FrameError) -> Self {
        MockError::Frame(e)
    }
}

impl From<Error> for MockError {
    fn from(e: Error) -> Self {
        MockError::Input(e)
    }
}

/// Page-table roots are unique across every machine of the process, so
/// that an address space of one machine is never taken for another's.
static NEXT_ROOT: AtomicU64 = AtomicU64::new(1);

fn new_root() -> u64 {
    NEXT_ROOT.fetch_add(1, Ordering::Relaxed)
}
/// A leaf table maps 2^9 pages.
const REGION_SHIFT: u32 = 9;

#[derive(Clone, Copy, Debug)]
enum BroadcastOp {
    Page(Asid, u64),
    Asid(Asid),
    All(bool),
}

struct CpuState {
    tlb: Mutex<Tlb>,
    loaded: Mutex<Option<(Asid, u64)>>,
    mm: Mutex<Option<Arc<MmTlbState>>>,
    irq_enabled: AtomicBool,
    irq_pending: AtomicBool,
    cycles: AtomicU64,
    interrupts: AtomicU64,
}

/// One address space's entries, by virtual page number (ordered, so that
/// [`PageTable::next_populated`] can step over what is not mapped).
type Table = BTreeMap<u64, AtomicU64>;

/// Locks a mutex, carrying on past poisoning (a panicking test thread must
/// not hide the state other assertions want to read).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A simulated SMP machine; `M` fixes its hardware [`Model`].
pub struct MockMachine<M: Model = X86Like> {
    config: MockConfig,
    shootdown: Box<TlbShootdown>,
    cpus: Vec<CpuState>,
    memory: Mutex<oracle::Memory>,
    tables: RwLock<HashMap<u64, Table>>,
    kernel_root: u64,
    kernel_mm: Arc<MmTlbState>,
    asid_roots: Mutex<HashMap<Asid, u64>>,
    /// The ASID each root of this machine was created with.
    roots: Mutex<HashMap<u64, Asid>>,
    /// The frame holding each leaf table, by (root, region of 512 pages).
    leaf_tables: Mutex<HashMap<(u64, u64), Frame>>,
    /// Lockless walks in progress: id -> (CPU, table frame).
    walkers: Mutex<HashMap<u64, (CpuId, Frame)>>,
    next_walk: AtomicU64,
    violations: Mutex<Vec<Violation>>,
    broadcast_queue: Mutex<Vec<(CpuId, BroadcastOp)>>,
    costs: cost::CostMeter,
    ipis_sent: AtomicU64,
    tracing: AtomicBool,
    trace_log: Mutex<Vec<TraceEvent>>,
    ipi_hook: Mutex<Option<IpiHook<M>>>,
    _model: PhantomData<M>,
}

/// Code a simulated CPU runs when it takes the flush interrupt, before the
/// crate's handler (see [`MockMachine::set_ipi_hook`]).
pub type IpiHook<M> = Arc<dyn for<'a> Fn(&MockCpu<'a, M>) + Send + Sync>;

impl MockMachine<X86Like> {
    /// An x86-like machine (see [`MockMachine::with_model`]).
    pub fn new(config: MockConfig) -> Result<Self, Error> {
        Self::with_model(config)
    }
}

impl<M: Model> MockMachine<M> {
    /// A machine of model `M`. Errors: [`Error::CpuOutOfRange`] when
    /// `config.cpus` is 0 or above [`MAX_CPUS`].
    pub fn with_model(config: MockConfig) -> Result<Self, Error> {
        if config.cpus == 0 || config.cpus > MAX_CPUS {
            return Err(Error::CpuOutOfRange {
                cpu: config.cpus,
                limit: MAX_CPUS,
            });
        }
        let cpus = (0..config.cpus)
            .map(|_| CpuState {
                tlb: Mutex::new(Tlb::new(config.tlb_entries)),
                loaded: Mutex::new(None),
                mm: Mutex::new(None),
                irq_enabled: AtomicBool::new(true),
                irq_pending: AtomicBool::new(false),
                cycles: AtomicU64::new(0),
                interrupts: AtomicU64::new(0),
            })
            .collect();
        let kernel_root = new_root();
        let mut tables = HashMap::new();
        tables.insert(kernel_root, Table::new());
        let mut roots = HashMap::new();
        roots.insert(kernel_root, Asid::KERNEL);
        Ok(MockMachine {
            config,
            shootdown: Box::new(TlbShootdown::new()),
            cpus,
            memory: Mutex::new(oracle::Memory::new(config.frames, config.table_frames)),
            tables: RwLock::new(tables),
            kernel_root,
            kernel_mm: Arc::new(MmTlbState::kernel(kernel_root)),
            asid_roots: Mutex::new(HashMap::new()),
            roots: Mutex::new(roots),
            leaf_tables: Mutex::new(HashMap::new()),
            walkers: Mutex::new(HashMap::new()),
            next_walk: AtomicU64::new(0),
            violations: Mutex::new(Vec::new()),
            broadcast_queue: Mutex::new(Vec::new()),
            costs: cost::CostMeter::default(),
            ipis_sent: AtomicU64::new(0),
            tracing: AtomicBool::new(false),
            trace_log: Mutex::new(Vec::new()),
            ipi_hook: Mutex::new(None),
            _model: PhantomData,
        })
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

    /// Only for ids this machine handed out (through a [`MockCpu`]), which
    /// are below `cpus.len()` by construction.
    fn state(&self, cpu: CpuId) -> &CpuState {
        &self.cpus[cpu.index()]
    }

    // ----- address spaces and page tables -----

    /// A new, empty user address space with this ASID. Give each live
    /// address space its own ASID: the model tells TLB entries apart by it.
    /// Errors: [`MockError::Input`] with [`Error::AsidOutOfRange`] for an
    /// ASID wider than [`MockConfig::asid_bits`].
    pub fn new_mm(&self, asid: Asid) -> Result<Arc<MmTlbState>, MockError> {
        check_asid(&self.probe(), asid)?;
        let root = new_root();
        lock(&self.asid_roots).insert(asid, root);
        lock(&self.roots).insert(root, asid);
        self.tables
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(root, Table::new());
        Ok(Arc::new(MmTlbState::new(asid, root)))
    }

    /// CPU 0's view, for checks that depend only on the machine's
    /// configuration (address and ASID widths).
    fn probe(&self) -> MockCpu<'_, M> {
        MockCpu {
            machine: self,
            id: CpuId::BOOT,
        }
    }

    /// [`Error::Unaligned`] or [`Error::NonCanonical`] for an address this
    /// machine cannot translate.
    fn check_va(&self, va: u64) -> Result<(), MockError> {
        Ok(check_va(&self.probe(), va)?)
    }

    /// The kernel's address space: its mappings are global and visible from
    /// every address space.
    pub fn kernel_mm(&self) -> &Arc<MmTlbState> {
        &self.kernel_mm
    }

    fn with_pte<R>(&self, root: u64, vpn: u64, f: impl FnOnce(&AtomicU64) -> R) -> Option<R> {
        let tables = self.tables.read().unwrap_or_else(PoisonError::into_inner);
        tables.get(&root).and_then(|t| t.get(&vpn)).map(f)
    }

    /// Maps `frame` at `va` in `mm` (replacing any previous entry).
    /// Kernel mappings are global. Errors: an address the machine cannot
    /// translate ([`MockError::Input`]), an address space it did not create
    /// ([`MockError::UnknownAddressSpace`]), a frame it does not have or
    /// that is free ([`MockError::Frame`]).
    pub fn map(&self, mm: &MmTlbState, va: u64, frame: Frame, writable: bool) -> Result<(), MockError> {
        self.check_va(va)?;
        let mut flags = PteFlags::PRESENT;
        if writable {
            flags |= PteFlags::WRITABLE;
        }
        flags |= if mm.is_kernel() {
            PteFlags::GLOBAL
        } else {
            PteFlags::USER
        };
        self.set_pte(mm, va, Pte::new(frame, flags))
    }

    /// Allocates a frame and maps it at `va` in `mm`.
    pub fn map_new(&self, mm: &MmTlbState, va: u64, writable: bool) -> Result<Frame, MockError> {
        self.check_va(va)?;
        self.known(mm)?;
        let frame = self.alloc_frame()?;
        self.map(mm, va, frame, writable)?;
        Ok(frame)
    }

    /// Stores `pte` at `va` in `mm`.
    /// The first PTE of a 512-page region takes a page-table frame. Errors:
    /// as for [`map`](Self::map) (an entry that names a frame, present or a
    /// migration or hwpoison entry, must name one the machine has, in use).
    pub fn set_pte(&self, mm: &MmTlbState, va: u64, pte: Pte) -> Result<(), MockError> {
        self.check_va(va)?;
        self.known(mm)?;
        if pte.is_present() || pte.is_migration() || pte.is_hwpoison() {
            match lock(&self.memory).state(pte.frame())? {
                FrameState::Free => {
                    return Err(MockError::Frame(FrameError::WrongState {
                        frame: pte.frame(),
                        state: FrameState::Free,
                    }))
                }
                FrameState::InUse | FrameState::UnderIo => {}
            }
        }
        let vpn = va >> PAGE_SHIFT;
        let mut tables = self.tables.write().unwrap_or_else(PoisonError::into_inner);
        let table = tables.get_mut(&mm.root()).ok_or(MockError::UnknownAddressSpace)?;
        let region = (mm.root(), vpn >> REGION_SHIFT);
        if let std::collections::hash_map::Entry::Vacant(slot) = lock(&self.leaf_tables).entry(region) {
            slot.insert(lock(&self.memory).alloc_table()?);
        }
        table
            .entry(vpn)
            .or_insert_with(|| AtomicU64::new(0))
            .store(pte.0, Ordering::SeqCst);
        Ok(())
    }

    /// The PTE at `va` in `mm` (empty when nothing was ever mapped there).
    pub fn pte(&self, mm: &MmTlbState, va: u64) -> Result<Pte, MockError> {
        self.check_va(va)?;
        self.known(mm)?;
        Ok(self
            .with_pte(mm.root(), va >> PAGE_SHIFT, |p| Pte(p.load(Ordering::SeqCst)))
            .unwrap_or(Pte::EMPTY))
    }

    /// Atomically clears the PTE at `va` in `mm` and returns what it held,
    /// with whatever accessed and dirty bits hardware set up to that
    /// instant. Flushes nothing.
    pub fn clear_pte(&self, mm: &MmTlbState, va: u64) -> Result<Pte, MockError> {
        self.exchange_pte(mm, va, Pte::EMPTY)
    }

    /// Atomically replaces the PTE at `va` in `mm` with `new` and returns
    /// the old value. Flushes nothing.
    pub fn exchange_pte(&self, mm: &MmTlbState, va: u64, new: Pte) -> Result<Pte, MockError> {
        self.check_va(va)?;
        self.known(mm)?;
        match self.with_pte(mm.root(), va >> PAGE_SHIFT, |p| {
            Pte(p.swap(new.0, Ordering::SeqCst))
        }) {
            Some(old) => Ok(old),
            None => {
                if new != Pte::EMPTY {
                    self.set_pte(mm, va, new)?;
                }
                Ok(Pte::EMPTY)
            }
        }
    }

    /// Atomically clears the accessed bit of the PTE at `va` in `mm`;
    /// returns whether it was set.
    pub fn test_and_clear_accessed(&self, mm: &MmTlbState, va: u64) -> Result<bool, MockError> {
        self.check_va(va)?;
        self.known(mm)?;
        let mask = PteFlags::ACCESSED.bits();
        Ok(self
            .with_pte(mm.root(), va >> PAGE_SHIFT, |p| {
                p.fetch_and(!mask, Ordering::SeqCst) & mask != 0
            })
            .unwrap_or(false))
    }

    /// `mm` as a [`PageTable`] for the reverse-map functions.
    pub fn space(&self, mm: &Arc<MmTlbState>) -> MockSpace<'_, M> {
        MockSpace {
            machine: self,
            mm: Arc::clone(mm),
        }
    }

    /// Whether `mm` is an address space this machine created, with the
    /// ASID it was created with: [`MockError::UnknownAddressSpace`]
    /// otherwise (another machine's, or one built by hand).
    fn known(&self, mm: &MmTlbState) -> Result<(), MockError> {
        match lock(&self.roots).get(&mm.root()) {
            Some(&asid) if asid == mm.asid() => Ok(()),
            _ => Err(MockError::UnknownAddressSpace),
        }
    }

    /// The first page of `range` whose entry in `mm` is not empty, if any:
    /// what [`PageTable::next_populated`] answers for a [`MockSpace`].
    pub fn next_populated(&self, mm: &MmTlbState, range: PageRange) -> Option<u64> {
        let last = range.last()?;
        let tables = self.tables.read().unwrap_or_else(PoisonError::into_inner);
        let table = tables.get(&mm.root())?;
        table
            .range(range.start() >> PAGE_SHIFT..=last >> PAGE_SHIFT)
            .find(|(_, pte)| pte.load(Ordering::SeqCst) != 0)
            .map(|(vpn, _)| vpn << PAGE_SHIFT)
    }

    // ----- frames and the oracle -----

    /// Takes a free frame.
    pub fn alloc_frame(&self) -> Result<Frame, MockError> {
        Ok(lock(&self.memory).alloc()?)
    }

    /// Returns a frame to the free list. The oracle records a
    /// [`Violation::FreedWhileCached`] for every CPU still caching it (only
    /// when the free itself is accepted), and a [`Violation::FreedDuringIo`]
    /// for a frame still being written out (which stays under I/O, and the
    /// free is refused).
    pub fn free_frame(&self, frame: Frame) -> Result<(), MockError> {
        // TLBs are scanned before the memory lock is taken: accesses lock a
        // TLB and then memory, never the other way round.
        let cached = self.cached_translations(frame);
        let walking: Vec<CpuId> = lock(&self.walkers)
            .values()
            .filter(|(_, t)| *t == frame)
            .map(|(c, _)| *c)
            .collect();
        let freed = lock(&self.memory).free(frame);
        if let Err(FrameError::WrongState {
            state: FrameState::UnderIo,
            ..
        }) = freed
        {
            // A real allocator would take it back while the device still
            // reads it: that is a breach of the contract, not a refusal.
            self.record(Violation::FreedDuringIo { frame });
        }
        freed?;
        for cpu in walking {
            self.record(Violation::TableFreedUnderWalker { frame, cpu });
        }
        for (cpu, entry) in cached {
            self.record(Violation::FreedWhileCached {
                frame,
                cpu,
                writable: entry.writable,
            });
        }
        Ok(())
    }

    /// Starts writing a frame out. The oracle records a
    /// [`Violation::IoWhileWritable`] for every CPU caching it writable
    /// (only when the frame could start I/O).
    pub fn start_io(&self, frame: Frame) -> Result<(), MockError> {
        let cached = self.cached_translations(frame);
        lock(&self.memory).start_io(frame)?;
        for (cpu, _) in cached.into_iter().filter(|(_, e)| e.writable) {
            self.record(Violation::IoWhileWritable { frame, cpu });
        }
        Ok(())
    }

    /// Finishes writing a frame out.
    pub fn end_io(&self, frame: Frame) -> Result<(), MockError> {
        Ok(lock(&self.memory).end_io(frame)?)
    }

    /// A frame's state.
    pub fn frame_state(&self, frame: Frame) -> Result<FrameState, MockError> {
        Ok(lock(&self.memory).state(frame)?)
    }

    /// The data word last written into a frame.
    pub fn frame_data(&self, frame: Frame) -> Result<u64, MockError> {
        Ok(lock(&self.memory).read(frame)?.0)
    }

    /// Marks a frame's page dirty (the software flag the kernel keeps).
    pub fn set_frame_dirty(&self, frame: Frame) -> Result<(), MockError> {
        Ok(lock(&self.memory).set_dirty(frame)?)
    }

    /// Whether a frame's page is marked dirty.
    pub fn frame_dirty(&self, frame: Frame) -> Result<bool, MockError> {
        Ok(lock(&self.memory).is_dirty(frame)?)
    }

    /// Marks a frame hardware-poisoned (it stays allocated).
    pub fn poison_frame(&self, frame: Frame) -> Result<(), MockError> {
        Ok(lock(&self.memory).poison(frame)?)
    }

    /// Whether a frame is marked hardware-poisoned.
    pub fn frame_poisoned(&self, frame: Frame) -> Result<bool, MockError> {
        Ok(lock(&self.memory).is_poisoned(frame)?)
    }

    /// Copies the data word and the dirty flag of `from` into `to`.
    pub fn copy_frame(&self, from: Frame, to: Frame) -> Result<(), MockError> {
        let mut mem = lock(&self.memory);
        let (data, _) = mem.read(from)?;
        let dirty = mem.is_dirty(from)?;
        mem.write(to, data)?;
        if dirty {
            mem.set_dirty(to)?;
        }
        Ok(())
    }

    /// Number of free frames.
    pub fn free_frames(&self) -> usize {
        lock(&self.memory).free_count()
    }

    fn record(&self, v: Violation) {
        lock(&self.violations).push(v);
    }

    /// Every violation the oracle recorded so far.
    pub fn violations(&self) -> Vec<Violation> {
        lock(&self.violations).clone()
    }

    /// Every (CPU, entry) pair caching a translation to `frame`.
    pub fn cached_translations(&self, frame: Frame) -> Vec<(CpuId, TlbEntry)> {
        self.all_entries()
            .into_iter()
            .filter(|(_, e)| e.frame == frame)
            .collect()
    }

    /// Every TLB entry of every CPU.
    pub fn all_entries(&self) -> Vec<(CpuId, TlbEntry)> {
        let mut out = Vec::new();
        for cpu in self.cpus() {
            out.extend(lock(&self.state(cpu.id).tlb).entries().map(|e| (cpu.id, *e)));
        }
        out
    }

    /// The TLB entries that no longer match the page table: the PTE they
    /// came from is gone, maps another frame, or no longer allows a write
    /// the entry allows. These are what shootdowns exist to remove.
    pub fn stale_entries(&self) -> Vec<(CpuId, TlbEntry)> {
        let roots = lock(&self.asid_roots).clone();
        self.all_entries()
            .into_iter()
            .filter(|(_, e)| {
                let root = if e.global {
                    Some(self.kernel_root)
                } else {
                    roots.get(&e.asid).copied()
                };
                let pte = root.and_then(|r| self.with_pte(r, e.vpn, |p| Pte(p.load(Ordering::SeqCst))));
                !pte.is_some_and(|p| {
                    p.is_present() && p.frame() == e.frame && (p.is_writable() || !e.writable)
                })
            })
            .collect()
    }

    /// The frame of the leaf page table that maps `va` in `mm`, if any.
    pub fn leaf_table(&self, mm: &MmTlbState, va: u64) -> Option<Frame> {
        lock(&self.leaf_tables)
            .get(&(mm.root(), (va >> PAGE_SHIFT) >> REGION_SHIFT))
            .copied()
    }

    /// Detaches one leaf table of `mm` whose whole region lies inside
    /// `range`, dropping its (cleared) entries; returns its frame and
    /// region. The frame stays allocated: the caller frees it when safe.
    pub fn detach_table(&self, mm: &MmTlbState, range: PageRange) -> Option<DetachedTable> {
        let last = range.last()?;
        let mut leaves = lock(&self.leaf_tables);
        let key = leaves.keys().copied().find(|&(root, region)| {
            let first = region << (REGION_SHIFT + PAGE_SHIFT);
            let table_last = first + ((1u64 << (REGION_SHIFT + PAGE_SHIFT)) - PAGE_SIZE);
            root == mm.root() && first >= range.start() && table_last <= last
        })?;
        let frame = leaves.remove(&key)?;
        drop(leaves);
        let first_vpn = key.1 << REGION_SHIFT;
        let last_vpn = first_vpn + ((1 << REGION_SHIFT) - 1);
        let mut tables = self.tables.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(table) = tables.get_mut(&mm.root()) {
            table.retain(|vpn, _| !(first_vpn..=last_vpn).contains(vpn));
        }
        Some(DetachedTable {
            frame,
            range: PageRange::new(first_vpn << PAGE_SHIFT, 1 << REGION_SHIFT).ok()?,
        })
    }

    /// Lockless walks in progress, as (CPU, table frame).
    pub fn lockless_walkers(&self) -> Vec<(CpuId, Frame)> {
        lock(&self.walkers).values().copied().collect()
    }

    /// A grace period for lockless walkers: returns once every lockless walk
    /// that was in progress when it was called has ended, taking `cpu`'s
    /// interrupts meanwhile. A kernel's RCU-style wait, for
    /// [`TableFreePolicy::GracePeriod`](crate::TableFreePolicy::GracePeriod).
    pub fn wait_for_walkers(&self, cpu: &MockCpu<'_, M>) {
        let started: Vec<u64> = lock(&self.walkers).keys().copied().collect();
        while lock(&self.walkers).keys().any(|k| started.contains(k)) {
            cpu.poll_interrupts();
            std::thread::yield_now();
        }
    }

    /// The oracle's check after an operation that changed the mappings of
    /// `mm` in `range` (mprotect, munmap, remap) returned: no CPU may
    /// still hold an entry there that disagrees with the page table. Records
    /// a [`Violation::StaleAfterChange`] for each such entry and returns how
    /// many it found.
    pub fn check_coherent(&self, mm: &MmTlbState, range: PageRange) -> usize {
        let stale: Vec<_> = self
            .stale_entries()
            .into_iter()
            .filter(|(_, e)| {
                (e.asid == mm.asid() || e.global && mm.is_kernel()) && range.contains(e.vpn << PAGE_SHIFT)
            })
            .collect();
        for (cpu, e) in &stale {
            self.record(Violation::StaleAfterChange {
                cpu: *cpu,
                va: e.vpn << PAGE_SHIFT,
                writable: e.writable,
            });
        }
        stale.len()
    }

    // ----- costs, counters, tracing -----

    /// Cycle totals by kind.
    pub fn costs(&self) -> CostTotals {
        self.costs.totals()
    }

    fn checked_state(&self, cpu: CpuId) -> Result<&CpuState, Error> {
        self.cpus.get(cpu.index()).ok_or(Error::CpuOutOfRange {
            cpu: cpu.index(),
            limit: self.cpus.len(),
        })
    }

    /// Cycles charged to one CPU, or [`Error::CpuOutOfRange`] for a CPU
    /// this machine does not have.
    pub fn cpu_cycles(&self, cpu: CpuId) -> Result<u64, Error> {
        Ok(self.checked_state(cpu)?.cycles.load(Ordering::Relaxed))
    }

    /// Flush interrupts `cpu` has taken (spurious ones included), or
    /// [`Error::CpuOutOfRange`] for a CPU this machine does not have.
    pub fn interrupts_taken(&self, cpu: CpuId) -> Result<u64, Error> {
        Ok(self.checked_state(cpu)?.interrupts.load(Ordering::Relaxed))
    }

    /// IPIs the machine delivered or queued, counted by the machine itself
    /// (independently of the crate's own counters).
    pub fn ipis_sent(&self) -> u64 {
        self.ipis_sent.load(Ordering::Relaxed)
    }

    /// The crate's counters for this machine.
    pub fn stats(&self) -> TlbStatsSnapshot {
        self.shootdown.stats()
    }

    /// Installs (or removes) code that every CPU runs when it takes the
    /// flush interrupt, before the crate's handler: a way to model other
    /// users of the same vector, such as a baseline flush protocol in a
    /// benchmark.
    pub fn set_ipi_hook(&self, hook: Option<IpiHook<M>>) {
        *lock(&self.ipi_hook) = hook;
    }

    /// Starts or stops recording [`TraceEvent`]s.
    pub fn set_tracing(&self, on: bool) {
        self.tracing.store(on, Ordering::Relaxed);
    }

    /// The trace events recorded so far, emptying the log.
    pub fn take_trace(&self) -> Vec<TraceEvent> {
        core::mem::take(&mut *lock(&self.trace_log))
    }

    fn charge(&self, cpu: CpuId, kind: CostKind, cycles: u64) {
        self.state(cpu).cycles.fetch_add(cycles, Ordering::Relaxed);
        self.costs.charge(kind, cycles);
    }

    // ----- threads -----

    /// Runs `f` once on every CPU, each CPU a real thread, and returns when
    /// all are done. A thread whose `f` returned keeps taking interrupts
    /// until every other one returned, so late IPIs are still served. Use
    /// with [`Delivery::Threaded`].
    pub fn run_threaded<F>(&self, f: F)
    where
        F: Fn(MockCpu<'_, M>) + Sync,
    {
        let done = AtomicUsize::new(0);
        let n = self.cpus.len();
        std::thread::scope(|s| {
            for cpu in self.cpus() {
                let (f, done) = (&f, &done);
                s.spawn(move || {
                    f(cpu);
                    cpu.enable_interrupts();
                    done.fetch_add(1, Ordering::SeqCst);
                    while done.load(Ordering::SeqCst) < n {
                        cpu.poll_interrupts();
                        std::thread::yield_now();
                    }
                    cpu.poll_interrupts();
                });
            }
        });
    }
}

/// One CPU of a [`MockMachine`]: the handle that implements [`Arch`] and
/// performs simulated memory accesses. `Copy`; hand one to each thread.
pub struct MockCpu<'m, M: Model = X86Like> {
    machine: &'m MockMachine<M>,
    id: CpuId,
}

impl<M: Model> Clone for MockCpu<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M: Model> Copy for MockCpu<'_, M> {}

impl<M: Model> core::fmt::Debug for MockCpu<'_, M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "MockCpu({:?})", self.id)
    }
}

impl<'m, M: Model> MockCpu<'m, M> {
    /// This CPU's id.
    pub fn id(&self) -> CpuId {
        self.id
    }

    /// The machine.
    pub fn machine(&self) -> &'m MockMachine<M> {
        self.machine
    }

    fn state(&self) -> &'m CpuState {
        self.machine.state(self.id)
    }

    /// Switches this CPU to `next` through the crate's [`switch_mm`] hook.
    /// Errors (nothing changes): [`MockError::UnknownAddressSpace`] for an
    /// address space this machine did not create, and whatever
    /// [`switch_mm`] refuses.
    pub fn switch_to(&self, next: &Arc<MmTlbState>) -> Result<(), MockError> {
        self.machine.known(next)?;
        let mut current = lock(&self.state().mm);
        // SAFETY: every root the mock hands out names one of its own page
        // tables, and the mock's `switch_address_space` only records it.
        unsafe { switch_mm(self, current.as_deref(), next) }?;
        *current = Some(Arc::clone(next));
        Ok(())
    }

    /// The address space this CPU runs, if any.
    pub fn current_mm(&self) -> Option<Arc<MmTlbState>> {
        lock(&self.state().mm).clone()
    }

    /// Fault injection: runs `f` as an interrupt handler that arrived while
    /// this CPU was in the middle of a shootdown of its own. Every shootdown
    /// `f` starts on this CPU then fails with
    /// [`Error::ShootdownReentered`], through the crate's real protocol (the
    /// CPU's request slot is taken), so a test can drive an operation into
    /// its error path and check what the error leaves behind and what a
    /// retry does. Errors: [`Error::ShootdownReentered`] when this CPU is
    /// already inside such a call.
    pub fn in_shootdown<R>(&self, f: impl FnOnce() -> R) -> Result<R, Error> {
        crate::shootdown::with_slot_taken(self, f)
    }

    /// Masks interrupts: IPIs stay pending until they are enabled again
    /// (threaded delivery only).
    pub fn disable_interrupts(&self) {
        self.state().irq_enabled.store(false, Ordering::SeqCst);
    }

    /// Unmasks interrupts and takes any pending one.
    pub fn enable_interrupts(&self) {
        self.state().irq_enabled.store(true, Ordering::SeqCst);
        self.poll_interrupts();
    }

    /// Whether interrupts are enabled.
    pub fn interrupts_enabled(&self) -> bool {
        self.state().irq_enabled.load(Ordering::SeqCst)
    }

    /// An instruction boundary: takes a pending flush IPI if interrupts are
    /// enabled (threaded delivery). Returns whether it took one.
    pub fn poll_interrupts(&self) -> bool {
        let st = self.state();
        if self.machine.config.delivery == Delivery::Threaded
            && st.irq_enabled.load(Ordering::SeqCst)
            && st.irq_pending.swap(false, Ordering::SeqCst)
        {
            self.take_interrupt();
            true
        } else {
            false
        }
    }

    fn take_interrupt(&self) {
        self.state().interrupts.fetch_add(1, Ordering::Relaxed);
        self.machine.charge(
            self.id,
            CostKind::IpiReceive,
            self.machine.config.cost.ipi_receive,
        );
        let hook = lock(&self.machine.ipi_hook).clone();
        if let Some(hook) = hook {
            hook(self);
        }
        handle_flush_ipi(self);
    }

    /// Starts a lockless walk of the page table that maps `va` in this CPU's
    /// address space, the way Linux's fast GUP walks: interrupts off, no
    /// lock, so that only an IPI sync or a grace period can tell when it is
    /// over. The walk lasts until the returned guard is dropped. Errors:
    /// [`Fault::NotMapped`] when no table maps `va`.
    pub fn begin_lockless_walk(&self, va: u64) -> Result<LocklessWalk<'m, M>, Fault> {
        let mm = self.current_mm().ok_or(Fault::NotMapped { va })?;
        let table = self.machine.leaf_table(&mm, va).ok_or(Fault::NotMapped { va })?;
        self.disable_interrupts();
        let id = self.machine.next_walk.fetch_add(1, Ordering::Relaxed);
        lock(&self.machine.walkers).insert(id, (self.id, table));
        Ok(LocklessWalk {
            cpu: *self,
            mm,
            table,
            id,
        })
    }

    /// Reads the data word of the page at `va` in the current address space
    /// (or the kernel's), filling the TLB as hardware would.
    pub fn read(&self, va: u64) -> Result<u64, Fault> {
        self.access(va, None)
    }

    /// Writes `value` into the page at `va`, setting the dirty bit as
    /// hardware would; a write through a stale entry lands in whatever frame
    /// the entry names, and the oracle judges it.
    pub fn write(&self, va: u64, value: u64) -> Result<(), Fault> {
        self.access(va, Some(value)).map(|_| ())
    }

    fn access(&self, va: u64, write: Option<u64>) -> Result<u64, Fault> {
        self.poll_interrupts();
        let m = self.machine;
        let vpn = va >> PAGE_SHIFT;
        let loaded = *lock(&self.state().loaded);
        let asid = loaded.map_or(Asid::KERNEL, |(a, _)| a);
        // The TLB stays locked for the whole access: an instruction is not
        // interrupted half-way, so no flush can slip between translation
        // and the memory operation.
        let mut tlb = lock(&self.state().tlb);
        let frame = match (tlb.lookup(asid, vpn), write.is_some()) {
            (Some(e), false) => e.frame,
            (Some(e), true) if !e.writable => {
                tlb.remove(asid, vpn);
                return Err(Fault::WriteProtected { va });
            }
            (Some(e), true) if e.dirty => e.frame,
            (Some(e), true) if !M::CLEAN_WRITE_REWALK => {
                // No re-walk: the write goes through the cached entry; the
                // dirty bit reaches the PTE only if it still maps the frame.
                tlb.mark_dirty(asid, vpn);
                self.set_dirty_in_place(loaded, e);
                e.frame
            }
            (Some(_), true) => {
                // Clean entry: hardware walks again to set the dirty bit and
                // faults if the PTE is gone.
                tlb.remove(asid, vpn);
                self.walk_and_fill(&mut tlb, loaded, va, true)?
            }
            (None, w) => self.walk_and_fill(&mut tlb, loaded, va, w)?,
        };
        let mut mem = lock(&m.memory);
        let violation = match write {
            Some(value) => match mem.write(frame, value) {
                Ok(FrameState::Free) => Some(Violation::WriteToFreeFrame {
                    cpu: self.id,
                    frame,
                    va,
                }),
                Ok(FrameState::UnderIo) => Some(Violation::WriteDuringIo {
                    cpu: self.id,
                    frame,
                    va,
                }),
                _ => None,
            },
            None => match mem.read(frame) {
                Ok((_, FrameState::Free)) => Some(Violation::ReadOfFreeFrame {
                    cpu: self.id,
                    frame,
                    va,
                }),
                _ => None,
            },
        };
        let value = mem.read(frame).map(|(d, _)| d).unwrap_or(0);
        drop(mem);
        drop(tlb);
        if let Some(v) = violation {
            m.record(v);
        }
        Ok(value)
    }

    fn set_dirty_in_place(&self, loaded: Option<(Asid, u64)>, e: TlbEntry) {
        let root = if e.global {
            self.machine.kernel_root
        } else {
            loaded.map_or(self.machine.kernel_root, |(_, r)| r)
        };
        self.machine.with_pte(root, e.vpn, |p| {
            let _ = p.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                let pte = Pte(v);
                (pte.is_present() && pte.frame() == e.frame).then_some(v | PteFlags::DIRTY.bits())
            });
        });
    }

    fn walk_and_fill(
        &self,
        tlb: &mut Tlb,
        loaded: Option<(Asid, u64)>,
        va: u64,
        write: bool,
    ) -> Result<Frame, Fault> {
        let m = self.machine;
        m.charge(self.id, CostKind::TlbRefill, m.config.cost.tlb_refill);
        let vpn = va >> PAGE_SHIFT;
        let walk = |root: u64| {
            m.with_pte(root, vpn, |p| {
                // The hardware's locked update of the A/D bits: it acts on
                // the PTE as it is at this instant, so it can never resurrect
                // a cleared entry nor be lost to a concurrent clear.
                p.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                    let pte = Pte(v);
                    if !pte.is_present() || (write && !pte.is_writable()) {
                        return None;
                    }
                    let mut bits = v | PteFlags::ACCESSED.bits();
                    if write {
                        bits |= PteFlags::DIRTY.bits();
                    }
                    Some(bits)
                })
            })
        };
        let user = loaded.and_then(|(_, root)| walk(root));
        let result = match user {
            Some(Ok(v)) => Ok(v),
            // A non-empty user entry decides; an empty one falls through to
            // the kernel's half of the address space.
            Some(Err(v)) if v != 0 => Err(v),
            _ => walk(self.machine.kernel_root).unwrap_or(Err(0)),
        };
        let old = match result.map_err(Pte) {
            Ok(v) => Pte(v),
            Err(p) if p.is_present() => return Err(Fault::WriteProtected { va }),
            Err(p) if p.is_migration() => return Err(Fault::Migration { va }),
            Err(p) if p.is_hwpoison() => return Err(Fault::HwPoison { va }),
            Err(_) => return Err(Fault::NotMapped { va }),
        };
        let global = old.flags().contains(PteFlags::GLOBAL);
        let asid = if global {
            Asid::KERNEL
        } else {
            loaded.map_or(Asid::KERNEL, |(a, _)| a)
        };
        tlb.insert(TlbEntry {
            asid,
            vpn,
            frame: old.frame(),
            writable: old.is_writable(),
            dirty: write || old.is_dirty(),
            global,
        });
        Ok(old.frame())
    }

    fn broadcast(&self, op: BroadcastOp) {
        let m = self.machine;
        m.charge(self.id, CostKind::Broadcast, m.config.cost.broadcast_invalidate);
        lock(&m.broadcast_queue).push((self.id, op));
    }
}

// SAFETY: each MockCpu reports its own id; online CPUs are exactly the
// machine's CPUs, all of which answer IPIs (synchronously or from their
// threads); local flushes edit this CPU's modelled TLB before returning;
// `send_flush_ipi` runs or queues `handle_flush_ipi` for each target; every
// CPU of one machine returns the machine's single `TlbShootdown`; the
// constants come from the model, which the simulated hardware obeys; the
// broadcast operations reach every CPU's TLB at `broadcast_sync`.
unsafe impl<M: Model> Arch for MockCpu<'_, M> {
    const CLEAN_WRITE_REWALK: bool = M::CLEAN_WRITE_REWALK;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = M::ACCESSED_CLEAR_NEEDS_FLUSH;
    const BROADCAST_INVALIDATE: bool = M::BROADCAST_INVALIDATE;

    fn current_cpu(&self) -> CpuId {
        self.id
    }

    fn online_cpus(&self) -> CpuSet {
        // The machine was built with 1..=MAX_CPUS CPUs.
        CpuSet::first(self.machine.cpus.len()).unwrap_or_default()
    }

    fn shootdown_state(&self) -> &TlbShootdown {
        &self.machine.shootdown
    }

    fn tagged_tlb(&self) -> bool {
        self.machine.config.tagged_tlb
    }

    fn va_bits(&self) -> u32 {
        self.machine.config.va_bits
    }

    fn asid_bits(&self) -> u32 {
        self.machine.config.asid_bits
    }

    fn flush_local_page(&self, asid: Asid, va: u64) {
        let m = self.machine;
        m.charge(self.id, CostKind::Invlpg, m.config.cost.invlpg);
        lock(&self.state().tlb).flush_page(asid, va >> PAGE_SHIFT);
    }

    fn flush_local_asid(&self, asid: Asid) {
        let m = self.machine;
        m.charge(self.id, CostKind::FullFlush, m.config.cost.full_flush);
        lock(&self.state().tlb).flush_asid(asid);
    }

    fn flush_local_all(&self, include_global: bool) {
        let m = self.machine;
        m.charge(self.id, CostKind::FullFlush, m.config.cost.full_flush);
        lock(&self.state().tlb).flush_all(include_global);
    }

    fn send_flush_ipi(&self, targets: &CpuSet) {
        let m = self.machine;
        for t in targets.iter().filter(|t| t.index() < m.cpus.len()) {
            m.ipis_sent.fetch_add(1, Ordering::Relaxed);
            m.charge(self.id, CostKind::IpiSend, m.config.cost.ipi_send);
            let target = MockCpu { machine: m, id: t };
            match m.config.delivery {
                Delivery::Synchronous => target.take_interrupt(),
                Delivery::Threaded => target.state().irq_pending.store(true, Ordering::SeqCst),
            }
        }
    }

    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        *lock(&self.state().loaded) = Some((asid, root));
        if !self.machine.config.tagged_tlb {
            // An untagged TLB loses every non-global entry on a switch.
            self.flush_local_all(false);
        }
    }

    fn broadcast_flush_page(&self, asid: Asid, va: u64) {
        self.broadcast(BroadcastOp::Page(asid, va >> PAGE_SHIFT));
    }

    fn broadcast_flush_asid(&self, asid: Asid) {
        self.broadcast(BroadcastOp::Asid(asid));
    }

    fn broadcast_flush_all(&self, include_global: bool) {
        self.broadcast(BroadcastOp::All(include_global));
    }

    fn broadcast_sync(&self) {
        let m = self.machine;
        m.charge(self.id, CostKind::Broadcast, m.config.cost.broadcast_sync);
        let mine: Vec<BroadcastOp> = {
            let mut q = lock(&m.broadcast_queue);
            let (mine, rest): (Vec<_>, Vec<_>) = q.drain(..).partition(|(c, _)| *c == self.id);
            *q = rest;
            mine.into_iter().map(|(_, op)| op).collect()
        };
        for cpu in m.cpus() {
            let mut tlb = lock(&cpu.state().tlb);
            for op in &mine {
                match *op {
                    BroadcastOp::Page(asid, vpn) => tlb.flush_page(asid, vpn),
                    BroadcastOp::Asid(asid) => tlb.flush_asid(asid),
                    BroadcastOp::All(g) => tlb.flush_all(g),
                }
            }
        }
    }

    fn relax(&self) {
        if !self.poll_interrupts() {
            if self.machine.config.delivery == Delivery::Threaded {
                std::thread::yield_now();
            } else {
                core::hint::spin_loop();
            }
        }
    }

    fn trace(&self, event: &TraceEvent) {
        if self.machine.tracing.load(Ordering::Relaxed) {
            lock(&self.machine.trace_log).push(*event);
        }
    }
}

impl<M: Model> PageState for MockMachine<M> {
    fn set_dirty(&self, frame: Frame) {
        // A frame the machine does not have has no page to mark.
        let _ = self.set_frame_dirty(frame);
    }

    fn is_hwpoisoned(&self, frame: Frame) -> bool {
        self.frame_poisoned(frame).unwrap_or(false)
    }
}

/// One address space of a [`MockMachine`] as a [`PageTable`] (made by
/// [`MockMachine::space`]).
pub struct MockSpace<'m, M: Model = X86Like> {
    machine: &'m MockMachine<M>,
    mm: Arc<MmTlbState>,
}

impl<M: Model> MockSpace<'_, M> {
    /// The address space's state.
    pub fn mm(&self) -> &Arc<MmTlbState> {
        &self.mm
    }
}

impl<M: Model> core::fmt::Debug for MockSpace<'_, M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "MockSpace({:?})", self.mm.asid())
    }
}

// SAFETY: every operation is one atomic instruction on the modelled PTE
// (swap, fetch_and, load, store), the same word the simulated hardware
// updates with its own atomic read-modify-write; `tlb_state` is the state of
// the address space whose table this is. The machine made the space, so the
// table exists: a failed lookup can only mean "nothing mapped here".
unsafe impl<M: Model> PageTable for MockSpace<'_, M> {
    fn tlb_state(&self) -> &MmTlbState {
        &self.mm
    }

    fn lookup(&self, va: u64) -> Pte {
        self.machine.pte(&self.mm, va).unwrap_or(Pte::EMPTY)
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        self.machine.exchange_pte(&self.mm, va, new).unwrap_or(Pte::EMPTY)
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        self.machine
            .test_and_clear_accessed(&self.mm, va)
            .unwrap_or(false)
    }

    fn set(&self, va: u64, pte: Pte) {
        let _ = self.machine.set_pte(&self.mm, va, pte);
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        self.machine.next_populated(&self.mm, range)
    }
}

pub use crate::gather::DetachedTable;

/// A lockless page-table walk in progress (see
/// [`MockCpu::begin_lockless_walk`]); dropping it ends the walk and
/// re-enables interrupts.
pub struct LocklessWalk<'m, M: Model = X86Like> {
    cpu: MockCpu<'m, M>,
    mm: Arc<MmTlbState>,
    table: Frame,
    id: u64,
}

impl<M: Model> LocklessWalk<'_, M> {
    /// The page-table frame being walked.
    pub fn table(&self) -> Frame {
        self.table
    }

    /// Reads the entry for `va` through the walked table, as the walker
    /// would (empty once the table was detached).
    pub fn read(&self, va: u64) -> Pte {
        self.cpu.machine.pte(&self.mm, va).unwrap_or(Pte::EMPTY)
    }
}

impl<M: Model> Drop for LocklessWalk<'_, M> {
    fn drop(&mut self) {
        lock(&self.cpu.machine.walkers).remove(&self.id);
        self.cpu.enable_interrupts();
    }
}

// SAFETY: `detach_table` hands out only a table whose whole region lies in
// the range, removing its entries from the simulated table first.
unsafe impl<M: Model> crate::gather::TableTeardown for MockSpace<'_, M> {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        self.machine.detach_table(&self.mm, range)
    }
}
