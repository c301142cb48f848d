//! [`TableHold`]: page-table frames a teardown emptied and unlinked, kept
//! allocated, not reused, until every CPU that was lazy on the address
//! space at the teardown's flush has passed, so that the flush need not
//! interrupt lazy CPUs.
//!
//! # Why lazy CPUs matter when tables are freed
//!
//! A lazy CPU ([`enter_lazy_tlb`](crate::enter_lazy_tlb)) keeps the address
//! space's root loaded. It runs no user code, so a stale TLB entry for a
//! data page is harmless until it catches up; but its MMU may still walk
//! the page tables (speculatively, and through its paging-structure caches,
//! which may point to a table the teardown unlinked). A freed table frame
//! reused for anything else would then be read as a table, and on x86 the
//! walk could even set accessed bits in it. Linux therefore sends a
//! teardown that frees tables to the lazy CPUs too (its `freed_tables`
//! rule), and so does [`MmuGather`](crate::MmuGather) without a hold
//! ([`MmTlbState::table_flush_targets`](crate::MmTlbState::table_flush_targets)).
//!
//! # What a hold does instead
//!
//! A teardown given a hold ([`TeardownBacking::table_hold`](crate::TeardownBacking::table_hold),
//! most simply through [`TableHold::around`]) flushes the CPUs that run
//! the space and are not lazy ([`MmTlbState::flush_targets`](crate::MmTlbState::flush_targets),
//! which advances the space's generation to some `G`), reads the lazy ones
//! from the same reads, and, if any of them has not passed already, moves
//! the emptied table frames into the hold instead of freeing them, with
//! that set of CPUs and `G`. The frames stay allocated: a walk through a
//! stale pointer reads a table whose entries are all empty (the
//! [`TableTeardown`](crate::TableTeardown) contract: a table is detached
//! only once empty), finds nothing present, caches nothing and sets no
//! bit. A CPU of the set has *passed* once
//!
//! - it flushed the space's ASID whole, or everything, after reading an
//!   epoch of at least `G`: its catch-up when it leaves lazy mode or
//!   switches back ([`leave_lazy_tlb`](crate::leave_lazy_tlb),
//!   [`switch_mm`](crate::switch_mm)), a whole-ASID flush it was sent
//!   ([`TableHold::flush`]), an untagged switch. (A timer tick alone
//!   passes no lazy CPU, and lazy CPUs are all a hold waits for:
//!   [`quiescent_flush`](crate::quiescent_flush) does nothing on one,
//!   since every pooled generation counts it clear already.) Such a flush
//!   drops the paging-structure caches of that ASID as well as its TLB
//!   entries: Intel SDM vol. 3A, 4.10.4.1 (`INVPCID` type 1,
//!   single-context, invalidates the PCID's paging-structure-cache
//!   entries with its mappings; so does `MOV to CR3` with bit 63 clear,
//!   for the PCID it loads, and for every PCID without `CR4.PCIDE`); Arm
//!   ARM (DDI 0487), the AArch64 TLB maintenance instructions: `TLBI
//!   ASIDE1` invalidates every cached stage-1 entry of the ASID, the
//!   intermediate (walk-cache) entries of every level included. `G` was
//!   published after the tables were unlinked, so what the CPU walks
//!   after that flush comes from tables that no longer link them; or
//! - it has another root loaded ([`switch_mm`](crate::switch_mm) to
//!   another space, the kernel's included): its MMU no longer walks this
//!   root. On a tagged TLB its walk-cache entries of the old ASID stay,
//!   but the hardware uses only the entries of the ASID it runs (SDM vol.
//!   3A, 4.10.2.4 and 4.10.3.1; Arm ARM on ASID-tagged entries), and it
//!   flushes that ASID by generation before it loads it again (its record
//!   is below `G`, the space's generation at least `G`); or
//! - it is offline: it runs nothing, and
//!   [`prepare_cpu_online`](crate::prepare_cpu_online) flushes everything,
//!   walk caches included, before it runs anything again.
//!
//! Each of these is for good: a CPU that passed never again reaches the
//! frames through a cached pointer, so a group's set only shrinks.
//! [`TableHold::release_passed`] hands back, with no IPI, the groups whose
//! CPUs all passed; [`TableHold::flush`] sends the CPUs that have not a
//! whole-ASID flush and hands back everything (for memory pressure, or the
//! end of the kernel's use of the hold).
//!
//! A teardown with a hold that lacks room does what it does without one:
//! the flush reaches the lazy CPUs and the tables are freed after it.
//!
//! # Ordering
//!
//! - *The split.* The lazy set is read in the same step as the targets,
//!   after the generation's advance and a full fence
//!   ([`MmTlbState::flush_targets`](crate::MmTlbState::flush_targets)). A
//!   CPU that leaves lazy mode concurrently clears its mark, fences, then
//!   reads the generation ([`leave_lazy_tlb`](crate::leave_lazy_tlb)):
//!   either the flusher reads the mark cleared (the CPU is a target, and
//!   the flush's request, the tables' whole spans, reaches it), or the
//!   CPU's read sees `G` and its catch-up flushes the ASID after the
//!   unlink. The same store-buffering pair covers a CPU switching in
//!   ([`switch_mm`](crate::switch_mm)'s fence): it is a target, or it
//!   catches up before it loads the root (loom models (e), (k), and (p) for
//!   the hold). A CPU that enters lazy mode concurrently is either a target
//!   or in the lazy set: both are covered.
//! - *The verdict.* A CPU of the set is judged from another CPU, which
//!   reads, in this order, the online set, its ASID slot (under the slots'
//!   sequence count, [`TlbShootdown::stable_generations`]: a slot being
//!   handed to another ASID is not believed), its loaded ASID and then the
//!   ASID a switch of it is leaving. The CPU records a catch-up only after
//!   its flush; it records the ASID it leaves before the one it loads, and
//!   clears the former only after the new root is loaded: so a reader that
//!   sees a record of at least `G`, or the new ASID and no ASID being left,
//!   sees a CPU that no longer walks through the old pointers. A stale read
//!   only delays the verdict. A CPU that leaves lazy mode and catches up
//!   between two reads is passed by its record; one that switches away and
//!   back between them caught up on its way back, so the record says so.
//!
//! Software walkers (lockless, as fast GUP) are another matter, handled
//! before the tables go into the hold by the teardown's
//! [`TableFreePolicy`](crate::TableFreePolicy): they walk from the root,
//! not through the MMU's caches, and are over once the sync or grace
//! period is. A kernel frees the frames a hold hands back without another.

use crate::arch::{Arch, Asid};
use crate::batch::machine_id;
use crate::cpuset::{CpuId, CpuSet};
use crate::mm::MmTlbState;
use crate::percpu::TlbShootdown;
use crate::request::FlushRequest;
use crate::shootdown::{shootdown, ShootdownReport};
use crate::unmap::{Flushed, FreeFrames, OwnedFrame};
use crate::Error;

use super::{MmuGather, TeardownBacking};

/// How many groups (teardowns whose lazy CPUs differ) a [`TableHold`]
/// tells apart. A teardown of the address space of the newest group joins
/// it when all are in use (it then waits for both sets of CPUs, and the
/// later generation); one of another space finds no room, and its flush
/// reaches the lazy CPUs as without a hold.
pub const TABLE_HOLD_GROUPS: usize = 16;

#[cfg(all(test, loom))]
pub(crate) use sealed::Holder;
pub(crate) use sealed::LazyWait;

impl LazyWait {
    /// One wait covering both: every CPU of either, and the later
    /// generation (a CPU that flushed past it flushed past both).
    pub(crate) fn merge(self, other: LazyWait) -> LazyWait {
        LazyWait {
            asid: self.asid,
            generation: self.generation.max(other.generation),
            cpus: self.cpus.union(&other.cpus),
        }
    }

    /// The CPUs of the wait that have not passed (see the
    /// [module](self) documentation).
    pub(crate) fn pending(&self, state: &TlbShootdown, online: &CpuSet) -> CpuSet {
        let mut left = CpuSet::new();
        for cpu in &self.cpus {
            if !passed(state, online, cpu, self.asid, self.generation) {
                left.insert(cpu);
            }
        }
        left
    }
}

/// The flush of a teardown whose tables a hold may keep: `request` (its
/// pages cleared and its tables unlinked before this call) goes to the
/// CPUs that run `mm` and are not lazy on it
/// ([`MmTlbState::flush_targets`](crate::MmTlbState::flush_targets)),
/// and what the tables then wait for comes back with the report: the lazy
/// CPUs of the same reads, and the generation this flush advanced the
/// space to (`None` when no CPU was lazy: free them as usual). The
/// request is left as it was, with its generation step.
pub(crate) fn flush_sparing_lazy<A: Arch>(
    arch: &A,
    mm: &MmTlbState,
    request: &mut FlushRequest,
) -> Result<(ShootdownReport, Option<LazyWait>), Error> {
    let (targets, lazy, step) = mm.flush_targets_lazy_step(arch);
    if let Some(step) = step {
        request.set_step(mm.asid(), step);
    }
    let report = shootdown(arch, &targets, request)?;
    let wait = step.filter(|_| !lazy.is_empty()).map(|step| LazyWait {
        asid: mm.asid(),
        generation: step.to,
        cpus: lazy,
    });
    Ok((report, wait))
}

/// Whether `cpu`, lazy on the space of `asid` when a flush that advanced
/// its generation to `generation` left it out, can no longer walk through
/// a pointer it cached to a table that flush unlinked. See "The verdict"
/// in the module documentation for the order of the reads.
fn passed(state: &TlbShootdown, online: &CpuSet, cpu: CpuId, asid: Asid, generation: u64) -> bool {
    if !online.contains(cpu) {
        return true;
    }
    // A whole-ASID flush (or a pass) after reading an epoch at least
    // `generation`, which was published after the unlink. Not the `caught`
    // value: page flushes and credits carry that one, and they may have
    // left walk-cache entries elsewhere in the space.
    if state
        .stable_generations(cpu, asid)
        .is_some_and(|(flushed, _)| flushed >= generation)
    {
        return true;
    }
    // The loaded ASID first, then the one a switch is leaving: a reader
    // that sees the new loaded ASID then sees the old one until the switch
    // has loaded the new root (`TlbShootdown::set_leaving_asid`).
    let loaded = state.loaded_asid(cpu);
    let leaving = state.leaving_asid(cpu);
    loaded != Some(asid) && leaving != Some(asid)
}

/// One group of held tables: the wait they share and how many they are.
#[derive(Clone, Copy, Debug)]
struct Group {
    wait: LazyWait,
    frames: usize,
}

mod sealed {
    use crate::arch::Asid;
    use crate::unmap::OwnedFrame;

    /// What the tables of one flush that left lazy CPUs out wait for: the
    /// space's ASID, the generation that flush advanced it to, and the
    /// CPUs that were lazy on it. Public only to be named by
    /// [`Holder`], which nothing outside the crate can name.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct LazyWait {
        pub(crate) asid: Asid,
        pub(crate) generation: u64,
        pub(crate) cpus: crate::cpuset::CpuSet,
    }

    /// The crate's side of [`HoldTables`](super::HoldTables).
    pub trait Holder {
        /// How many table frames of `asid`'s space, on the machine
        /// `machine`, it can take now.
        fn room_for(&self, machine: usize, asid: Asid) -> usize;

        /// Takes every frame `next` gives (at most `room_for` of them),
        /// waiting for `wait`; returns how many.
        fn take(
            &mut self,
            machine: usize,
            wait: &LazyWait,
            next: &mut dyn FnMut() -> Option<OwnedFrame>,
        ) -> usize;
    }
}

/// Where a teardown may put the page-table frames that lazy CPUs could
/// still walk through their paging-structure caches, instead of
/// interrupting them: a [`TableHold`], the one implementation (the trait
/// is sealed). A [`TeardownBacking`] hands one to the teardown from
/// [`table_hold`](TeardownBacking::table_hold).
pub trait HoldTables: sealed::Holder {}

impl<const N: usize> HoldTables for TableHold<N> {}

/// Up to `N` emptied page-table frames, kept allocated until every CPU
/// that was lazy on their address space when the teardown flushed has
/// passed, so that the teardown need not interrupt lazy CPUs.
///
/// A lazy CPU keeps the space's root loaded, and its MMU may walk the
/// tables through its paging-structure caches, so a freed table must not
/// be reused while it can (Linux's `freed_tables` rule interrupts it
/// instead). A held table is empty (the [`TableTeardown`](crate::TableTeardown)
/// contract), so such a walk finds nothing present. A CPU has passed once
///
/// - it flushed the space's ASID whole, or everything, after the
///   teardown's flush advanced the space's generation (its catch-up when
///   it resumes or switches back, a pass, a whole-ASID flush it was
///   sent): that flush drops the ASID's paging-structure caches too (Intel
///   SDM vol. 3A, 4.10.4.1, `INVPCID` single-context and `MOV to CR3`;
///   Arm ARM, `TLBI ASIDE1`, walk-cache entries of every level);
/// - it loaded another root: its MMU no longer walks this one (on a tagged
///   TLB its old ASID's cached walks are unusable, and flushed by the
///   generation check before it loads that ASID again); or
/// - it went offline ([`prepare_cpu_online`](crate::prepare_cpu_online)
///   flushes everything before it runs again).
///
/// Frames come in from a teardown given the hold
/// ([`around`](Self::around), or a backing's
/// [`table_hold`](TeardownBacking::table_hold)) and go out only through
/// [`release_passed`](Self::release_passed) (no IPI) and
/// [`flush`](Self::flush) (an IPI to the CPUs that have not passed), as
/// [`Flushed`] frames: no CPU's MMU can reach them any more, and the kernel
/// frees them as it frees page tables (after its lockless-walker policy,
/// which the teardown already waited for). Dropping a hold that holds
/// frames leaks them (never frees them unsafely): flush it instead.
///
/// A hold belongs to the machine whose teardown first filled it;
/// another machine's is refused ([`Error::OtherMachine`], or no room).
///
/// ```
/// # #[cfg(feature = "mock")] {
/// use tlb_batch::arch::mock::{MockConfig, MockKernel, MockMachine, MockRmap};
/// use tlb_batch::{
///     Asid, FreeFrames, MappingFlags, PageGather, PageRange, TableFreePolicy, TableHold, TeardownBacking,
/// };
///
/// let machine = MockMachine::new(MockConfig::x86_like(2)).unwrap();
/// let mm = machine.new_mm(Asid::new(1).unwrap()).unwrap();
/// let rmap = MockRmap::new(&machine, vec![machine.space(&mm)]);
/// let (cpu0, cpu1) = (machine.cpu(0).unwrap(), machine.cpu(1).unwrap());
/// let frame = machine.alloc_frame().unwrap();
/// rmap.map(frame, 0, 0x40_0000, true, MappingFlags::empty()).unwrap();
/// cpu0.switch_to(&mm).unwrap();
/// cpu1.switch_to(&mm).unwrap();
/// cpu1.read(0x40_0000).unwrap(); // its walk cache points to the leaf table
/// cpu1.enter_lazy().unwrap(); // and it goes idle, the space still loaded
///
/// // Tear down the leaf table's whole range, the table with it: CPU 1 is
/// // not interrupted, and the emptied table waits in the hold.
/// let mut hold = TableHold::<8>::new();
/// let mut kernel = MockKernel::new(&rmap);
/// let range = PageRange::new(0x40_0000, 512).unwrap();
/// let summary = PageGather::new()
///     .unmap_range(
///         &cpu0,
///         &rmap.spaces()[0],
///         &mut hold.around(&mut kernel),
///         range,
///         true,
///         &mut TableFreePolicy::AfterFlush,
///         &mut |_, _| unreachable!(),
///     )
///     .unwrap();
/// assert_eq!((summary.tables_held, summary.ipis_sent), (1, 0));
/// assert!(hold.release_passed(&cpu0).is_empty()); // CPU 1 may still walk it
///
/// // CPU 1 resumes the space: its catch-up drops its walk cache.
/// cpu1.switch_to(&mm).unwrap();
/// let mut back = hold.release_passed(&cpu0);
/// assert_eq!(back.len(), 1);
/// kernel.free_tables(back.frames_mut());
/// assert_eq!(machine.ipis_sent(), 0);
/// assert!(machine.violations().is_empty());
/// # }
/// ```
#[must_use = "a hold keeps page-table frames allocated: release or flush it"]
pub struct TableHold<const N: usize> {
    /// The frames, group after group, oldest first.
    frames: heapless::Vec<OwnedFrame, N>,
    groups: heapless::Vec<Group, TABLE_HOLD_GROUPS>,
    /// The address of the owning machine's `TlbShootdown` (0: none yet).
    machine: usize,
}

impl<const N: usize> Default for TableHold<N> {
    fn default() -> Self {
        TableHold::new()
    }
}

impl<const N: usize> core::fmt::Debug for TableHold<N> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("TableHold")
            .field("frames", &self.frames.len())
            .field("groups", &self.groups.len())
            .field("waiting", &self.waiting())
            .finish()
    }
}

impl<const N: usize> TableHold<N> {
    /// An empty hold.
    ///
    /// A capacity of 0 does not compile (`TableHold::<0>::new()` fails
    /// when it is instantiated): such a hold would take nothing.
    ///
    /// ```compile_fail,E0080
    /// let hold = tlb_batch::TableHold::<0>::new();
    /// # let _ = hold;
    /// ```
    pub const fn new() -> Self {
        const { assert!(N > 0, "TableHold needs room for at least one frame: N > 0") };
        TableHold {
            frames: heapless::Vec::new(),
            groups: heapless::Vec::new(),
            machine: 0,
        }
    }

    /// Frames held.
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether no frame is held.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// How many more frames the hold can take.
    pub fn room(&self) -> usize {
        N - self.frames.len()
    }

    /// Groups held (at most [`TABLE_HOLD_GROUPS`]).
    pub fn groups(&self) -> usize {
        self.groups.len()
    }

    /// Every CPU some group still waits for, as of the last
    /// [`release_passed`](Self::release_passed) (some may have passed
    /// since).
    pub fn waiting(&self) -> CpuSet {
        self.groups
            .iter()
            .fold(CpuSet::new(), |acc, g| acc.union(&g.wait.cpus))
    }

    /// `backing` with this hold: pass it to a teardown
    /// ([`MmuGather::unmap_range`](crate::MmuGather::unmap_range) and the
    /// rest) to hold the tables lazy CPUs may still walk instead of
    /// interrupting them.
    pub fn around<'a, B: TeardownBacking + ?Sized>(
        &'a mut self,
        backing: &'a mut B,
    ) -> HoldingBacking<'a, B, N> {
        HoldingBacking { backing, hold: self }
    }

    /// Hands back, without any IPI, every group whose CPUs have all passed,
    /// in any order, and forgets the CPUs of the others that have. Returns
    /// an empty [`Flushed`] when every group still waits (or the hold is
    /// empty, or belongs to another machine). Its cost is proportional to
    /// the groups held and their CPUs.
    pub fn release_passed<A: Arch>(&mut self, arch: &A) -> Flushed<N> {
        let mut released = heapless::Vec::new();
        if self.is_empty() || self.machine != machine_id(arch) {
            return Flushed::unmapped(released, Default::default());
        }
        let state = arch.shootdown_state();
        let online = arch.online_cpus();
        let mut frames = core::mem::take(&mut self.frames).into_iter();
        for mut g in core::mem::take(&mut self.groups) {
            g.wait.cpus = g.wait.pending(state, &online);
            let release = g.wait.cpus.is_empty();
            for frame in frames.by_ref().take(g.frames) {
                // SAFETY: the hold holds at most N frames, so either list
                // (each of capacity N) has room for all of them.
                unsafe {
                    if release {
                        released.push_unchecked(frame);
                    } else {
                        self.frames.push_unchecked(frame);
                    }
                }
            }
            if !release {
                // SAFETY: at most as many groups as were taken out.
                unsafe { self.groups.push_unchecked(g) };
            }
        }
        if self.groups.is_empty() {
            self.machine = 0;
        }
        Flushed::unmapped(released, Default::default())
    }

    /// Sends a whole-ASID flush of the held tables' spaces to every CPU a
    /// group still waits for (none when all have passed) and hands every
    /// frame back: for when the kernel cannot wait (memory is low, or it
    /// stops using the hold).
    ///
    /// Errors, with the hold unchanged: [`Error::OtherMachine`], and those
    /// of [`shootdown`] (retry from a context not nested in another
    /// shootdown).
    pub fn flush<A: Arch>(&mut self, arch: &A) -> Result<Flushed<N>, Error> {
        if self.is_empty() {
            return Ok(Flushed::unmapped(heapless::Vec::new(), Default::default()));
        }
        if self.machine != machine_id(arch) {
            return Err(Error::OtherMachine);
        }
        let state = arch.shootdown_state();
        let online = arch.online_cpus();
        let mut targets = CpuSet::new();
        let mut request = FlushRequest::new();
        for g in &self.groups {
            let left = g.wait.pending(state, &online);
            if !left.is_empty() {
                targets = targets.union(&left);
                // Many spaces degrade to a flush of everything.
                request.add_asid(g.wait.asid);
            }
        }
        // A CPU that passes meanwhile gets a flush it no longer needs; one
        // that has not passed gets it, and its whole-ASID flush drops its
        // walk caches of the space: then none reaches the frames.
        let report = shootdown(arch, &targets, &request)?;
        self.groups.clear();
        self.machine = 0;
        Ok(Flushed::unmapped(core::mem::take(&mut self.frames), report))
    }
}

impl<const N: usize> sealed::Holder for TableHold<N> {
    fn room_for(&self, machine: usize, asid: Asid) -> usize {
        if !self.is_empty() && self.machine != machine {
            return 0;
        }
        let joins_newest = self.groups.last().is_some_and(|g| g.wait.asid == asid);
        if self.groups.is_full() && !joins_newest {
            return 0;
        }
        self.room()
    }

    fn take(
        &mut self,
        machine: usize,
        wait: &LazyWait,
        next: &mut dyn FnMut() -> Option<OwnedFrame>,
    ) -> usize {
        let mut n = 0;
        while self.frames.len() < N {
            let Some(frame) = next() else { break };
            // SAFETY: fewer than N frames, checked just above.
            unsafe { self.frames.push_unchecked(frame) };
            n += 1;
        }
        let group = Group {
            wait: *wait,
            frames: n,
        };
        if let Err(group) = self.groups.push(group) {
            // Every slot in use: `room_for` gave room only to the newest
            // group's space, which this group joins.
            if let Some(newest) = self.groups.last_mut() {
                newest.wait = newest.wait.merge(group.wait);
                newest.frames += group.frames;
            }
        }
        self.machine = machine;
        n
    }
}

/// A [`TeardownBacking`] and a [`TableHold`] together
/// ([`TableHold::around`]): frees what the backing frees, and gives the
/// teardown the hold for the page tables that lazy CPUs may still walk.
pub struct HoldingBacking<'a, B: ?Sized, const N: usize> {
    backing: &'a mut B,
    hold: &'a mut TableHold<N>,
}

impl<B: TeardownBacking + ?Sized, const N: usize> FreeFrames for HoldingBacking<'_, B, N> {
    fn free_batch<const M: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, M>) {
        self.backing.free_batch(frames);
    }
}

impl<B: TeardownBacking + ?Sized, const N: usize> TeardownBacking for HoldingBacking<'_, B, N> {
    fn set_dirty(&mut self, frame: crate::pte::Frame) {
        self.backing.set_dirty(frame);
    }

    fn free_tables<const M: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, M>) {
        self.backing.free_tables(tables);
    }

    fn table_hold(&mut self) -> Option<&mut dyn HoldTables> {
        Some(self.hold)
    }
}

impl<const N: usize> MmuGather<N> {
    /// The step after the flush (and the lockless walkers' policy) for
    /// tables whose flush left lazy CPUs out: when none of those CPUs is
    /// left unpassed, nothing (the tables are freed as usual); otherwise
    /// the tables go into the backing's hold, all of them (returns `true`),
    /// or, if it has no room for them now, those CPUs get a whole-ASID
    /// flush first, which drops their walk caches of the space, and the
    /// tables are freed as usual. Errors: those of that flush, with the
    /// tables and what they wait for kept.
    pub(super) fn settle_lazy<A, B>(&mut self, arch: &A, backing: &mut B) -> Result<bool, Error>
    where
        A: Arch,
        B: TeardownBacking + ?Sized,
    {
        let Some(wait) = self.lazy_wait else {
            return Ok(false);
        };
        let state = arch.shootdown_state();
        let pending = wait.pending(state, &arch.online_cpus());
        if pending.is_empty() {
            self.lazy_wait = None;
            return Ok(false);
        }
        let machine = machine_id(arch);
        if let Some(hold) = backing.table_hold() {
            if hold.room_for(machine, wait.asid) >= self.tables.len() {
                let wait = LazyWait {
                    cpus: pending,
                    ..wait
                };
                let tables = &mut self.tables;
                let held = hold.take(machine, &wait, &mut || tables.pop());
                self.summary.tables_held += held;
                self.lazy_wait = None;
                return Ok(true);
            }
        }
        let report = shootdown(arch, &pending, &FlushRequest::for_asid(wait.asid))?;
        self.summary.ipis_sent += report.ipis_sent;
        self.lazy_wait = None;
        Ok(false)
    }
}
