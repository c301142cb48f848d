//! [`FramePool`]: unmapped frames kept, not yet freed, until every CPU that
//! could cache them has flushed on its own, and [`quiescent_flush`], the
//! hook through which CPUs do that at points where a flush is cheap.
//!
//! # Why
//!
//! A reclaim call frees about a dozen pages and owes one shootdown for
//! them. Freeing is what forces the shootdown to happen *now*; nothing
//! else does, since the PTEs are already cleared. A pool keeps the frames
//! allocated instead, and lets the shootdown wait until either
//!
//! - every CPU that could hold an entry for them has dropped its whole TLB
//!   anyway: at an address-space switch without tagged TLBs, or at its
//!   next timer tick or idle entry through [`quiescent_flush`] (the idea of
//!   LATR, ASPLOS 2018). The frames then go back with no IPI at all; or
//! - the kernel cannot wait: the pool is full, free memory is low, or it
//!   must reuse a pooled frame. [`FramePool::flush_oldest`] then sends one
//!   shootdown for the oldest generations (and any younger one whose CPUs
//!   it interrupts anyway), [`FramePool::flush`] one for everything, each
//!   only to the CPUs that have not flushed yet.
//!
//! # How a CPU is known to have flushed
//!
//! The machine's [`TlbShootdown`](crate::TlbShootdown) keeps a flush *epoch*. Each batch moved
//! into a pool becomes a generation: the pool opens a new epoch *after*
//! the batch's PTEs were cleared, and marks each CPU the batch had to reach
//! as owing a flush. A CPU records the epoch it read just *before* it
//! dropped every non-global entry (its "passed" epoch). If that is at least
//! a generation's epoch, the CPU read it after the PTEs were cleared, so
//! its TLB could not refill an entry for those pages after the flush: it
//! holds none.
//!
//! A CPU that has not flushed is clear of a generation all the same when
//! it runs none of the generation's address spaces now: it is lazy
//! ([`enter_lazy_tlb`](crate::enter_lazy_tlb)), or it switched to another
//! space (on a tagged TLB its entries stay, under an ASID it does not run).
//! It cannot use those entries, and it flushes the ASID by generation
//! before it loads the space again, since the batch advanced the space's
//! generation when it recorded the pages (see [`generation`](crate::generation);
//! contract rule 2's exact form). A CPU in the middle of a switch counts as
//! running both spaces until it has loaded the new root.
//!
//! A generation is released when every online CPU it had to reach is
//! clear of it; a CPU that went offline runs no code until
//! [`prepare_cpu_online`](crate::prepare_cpu_online) flushes it.
//!
//! # Aging epochs: flushes made before the unmap
//!
//! Where a TLB fill sets the PTE's accessed bit before it caches anything
//! ([`Arch::fill_sets_accessed`]: Intel and AMD x86, unless the kernel
//! declares otherwise), an entry found at the unmap with the bit clear has
//! not been cached by any CPU since the bit was last cleared.
//! [`page_referenced`](crate::page_referenced) publishes an epoch after it
//! clears the bits and stores it with the frame
//! ([`Rmap::set_aged_epoch`](crate::Rmap::set_aged_epoch)); a batch whose
//! unmaps all found the bit clear, of frames whose epoch is known, becomes
//! a generation with the latest of those epochs rather than a new one. A
//! CPU that passed it flushed after the clears, and anything it cached
//! since would have set the bit again. Reclaim ages a page a whole LRU
//! cycle before it unmaps it, so most such generations have been passed by
//! every CPU before they are even pooled. The reverse map keeps the epochs
//! only if its implementation opts in (see [`Rmap`](crate::Rmap)'s
//! `# Safety`).
//!
//! Nothing else rests on the promise. Where the `Arch` does not make it
//! (other vendors, a guest that cannot trust its hypervisor's shadow
//! paging, arm64) no aging epoch is stored or used, every generation opens
//! a new epoch after its unmaps, and its frames come back through the
//! CPUs' flushes after that ([`quiescent_flush`], switches) or through
//! [`FramePool::flush`]: the same release rule as above, only later.
//!
//! # What the kernel must do
//!
//! - Call [`quiescent_flush`] from its timer tick; with untagged TLBs,
//!   [`switch_mm`](crate::switch_mm) already records the flush a switch
//!   implies. A CPU that goes idle, or runs a kernel thread, should enter
//!   lazy TLB mode ([`enter_lazy_tlb`](crate::enter_lazy_tlb)) or switch to
//!   the kernel's address space: either way no generation waits for it,
//!   and no flush interrupts it (lazy mode saves the switch and the refills
//!   after it, as Linux does).
//! - Treat pooled frames as allocated: they are not free memory. Release
//!   passed generations often ([`FramePool::release_passed`], no IPIs) and
//!   [`flush`](FramePool::flush) the pool when free memory falls below a
//!   watermark it chooses, or when it must reuse one of the frames.
//! - Flush the pool (or the page's address spaces) before it writes new
//!   data into a *file page* one of whose old frames is pooled: a CPU could
//!   otherwise still read the old frame's contents through a stale
//!   read-only entry. In the usual case, a refault that reads the page back
//!   from disk, the old contents and the new are the same. Changing a
//!   mapping of an address space with pooled pages goes through
//!   [`flush_tlb_batched_pending`](crate::flush_tlb_batched_pending) as for
//!   any deferred flush (contract rule 5): the pool leaves the address
//!   space marked until then.
//!
//! Only frames whose deferred mappings were all clean and read-only go into
//! a pool, so no stale entry of a pooled frame allows a write: whatever a
//! CPU still caches, it can only read the old contents, which stay in the
//! frame until it is released. Frames mapped in the kernel's address
//! space never go into a pool: its entries are global, and the local
//! flushes a pool waits for (a switch, a whole-ASID flush) keep global
//! entries. (A user page mapped global is refused before it is unmapped,
//! [`Error::GlobalUserEntry`], so no pooled
//! frame has one.)

use crate::arch::{Arch, Asid};
use crate::batch::machine_id;
use crate::cpuset::CpuSet;
use crate::lifecycle::online_caller;
use crate::request::{FlushRequest, MAX_FLUSH_ASIDS};
use crate::shootdown::{complete_broadcast, shootdown, ShootdownReport};
use crate::stats::Counter;
use crate::unmap::{Flushed, OwnedFrame, UnmapBatch};
use crate::Error;

mod generations;
mod outcome;
mod quiescent;

use generations::Generation;
pub use outcome::{PoolRefusal, PoolReleases};
use quiescent::local_pass;
pub use quiescent::quiescent_flush;

/// How many generations a pool tells apart. A batch deferred into a pool
/// whose generations are all in use joins the newest one (which then waits
/// for the later of the two epochs): still exact about what is owed, only
/// released a little later.
pub const POOL_GENERATIONS: usize = 16;

/// Up to `N` unmapped frames whose TLB flush is still owed, kept allocated
/// until every CPU that could cache them has flushed on its own (see the
/// [module](crate::pool) documentation) or the kernel asks for them.
///
/// Frames come in from an [`UnmapBatch`] with [`defer`](Self::defer) (or
/// through [`shrink_page_list_pooled`](crate::shrink_page_list_pooled)) and
/// go out only through [`release_passed`](Self::release_passed), which
/// hands back the generations every CPU has flushed past, and
/// [`flush`](Self::flush), which shoots down whatever is still owed and
/// hands back everything. Either way they come back as [`Flushed`]: no CPU
/// holds any TLB entry for them then. Dropping a pool that holds frames
/// leaks them (never frees them unsafely): flush it instead.
///
/// A pool belongs to the machine whose [`Arch`] first deferred into it;
/// another machine's is refused ([`Error::OtherMachine`]).
///
/// ```
/// # #[cfg(feature = "mock")] {
/// use tlb_batch::arch::mock::{MockConfig, MockKernel, MockMachine, MockRmap};
/// use tlb_batch::{quiescent_flush, Asid, FramePool, OwnedFrame, TtuFlags, UnmapBatch, Unmapped, PAGE_SIZE};
///
/// let machine = MockMachine::new(MockConfig::x86_like(2)).unwrap();
/// let mm = machine.new_mm(Asid::new(1).unwrap()).unwrap();
/// let rmap = MockRmap::new(&machine, vec![machine.space(&mm)]);
/// let (cpu0, cpu1) = (machine.cpu(0).unwrap(), machine.cpu(1).unwrap());
/// cpu0.switch_to(&mm).unwrap();
/// cpu1.switch_to(&mm).unwrap();
/// let frame = machine.alloc_frame().unwrap();
/// rmap.map(frame, 0, 0x40_0000, false, Default::default()).unwrap();
/// cpu1.read(0x40_0000).unwrap(); // CPU 1 caches the page
///
/// // Unmap it with the flush deferred, and pool the frame instead of
/// // flushing: no IPI yet.
/// let mut batch = UnmapBatch::<8>::new();
/// // SAFETY: the only handle to a frame this example allocated.
/// let page = unsafe { OwnedFrame::new(frame) };
/// let unmapped = batch.try_to_unmap(&cpu0, &rmap, page, TtuFlags::IGNORE_ACCESS);
/// assert!(matches!(unmapped, Ok(Unmapped::Held(_))));
/// let mut pool = FramePool::<64>::new();
/// assert_eq!(pool.defer(&cpu0, &mut batch), Ok(1));
/// assert!(pool.release_passed(&cpu0).is_empty()); // CPU 1 may still cache it
///
/// // CPU 1's timer tick flushes its TLB; the frame comes back, no IPI sent.
/// assert!(quiescent_flush(&cpu1));
/// let mut released = pool.release_passed(&cpu0);
/// assert_eq!(released.len(), 1);
/// let mut kernel = MockKernel::new(&rmap);
/// tlb_batch::FreeFrames::free_batch(&mut kernel, released.frames_mut());
/// assert_eq!(machine.ipis_sent(), 0);
/// assert!(machine.violations().is_empty());
/// # }
/// ```
#[must_use = "a pool holds frames whose TLB flush is still owed: release or flush it"]
pub struct FramePool<const N: usize> {
    /// The frames, generation after generation, oldest first.
    frames: heapless::Vec<OwnedFrame, N>,
    gens: heapless::Vec<Generation, POOL_GENERATIONS>,
    /// Everything any generation pooled since the pool was last empty
    /// covers: generations released one by one leave their pages in it,
    /// so a pool that never empties flushes more than it holds (at worst
    /// every address space it has seen, as one full flush).
    request: FlushRequest,
    /// The address of the owning machine's `TlbShootdown` (0: none yet).
    machine: usize,
    releases: PoolReleases,
}

impl<const N: usize> Default for FramePool<N> {
    fn default() -> Self {
        FramePool::new()
    }
}

impl<const N: usize> core::fmt::Debug for FramePool<N> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("FramePool")
            .field("frames", &self.frames.len())
            .field("generations", &self.gens.len())
            .field("targets", &self.targets())
            .finish()
    }
}

impl<const N: usize> FramePool<N> {
    /// An empty pool.
    ///
    /// A capacity of 0 does not compile (`FramePool::<0>::new()` fails when
    /// it is instantiated): such a pool would refuse every batch.
    ///
    /// ```compile_fail,E0080
    /// let empty = tlb_batch::FramePool::<0>::new();
    /// # let _ = empty;
    /// ```
    pub const fn new() -> Self {
        const { assert!(N > 0, "FramePool needs room for at least one frame: N > 0") };
        FramePool {
            frames: heapless::Vec::new(),
            gens: heapless::Vec::new(),
            request: FlushRequest::new(),
            machine: 0,
            releases: PoolReleases {
                aged: 0,
                passes: 0,
                generations: 0,
                forced: 0,
            },
        }
    }

    /// How the frames this pool handed back so far went out: see
    /// [`PoolReleases`].
    pub fn releases(&self) -> PoolReleases {
        self.releases
    }

    /// Frames pooled.
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether no frame is pooled and no flush is owed.
    pub fn is_empty(&self) -> bool {
        self.gens.is_empty()
    }

    /// How many more frames the pool can take.
    pub fn room(&self) -> usize {
        N - self.frames.len()
    }

    /// Generations pooled (at most [`POOL_GENERATIONS`]).
    pub fn generations(&self) -> usize {
        self.gens.len()
    }

    /// Every CPU some pooled generation had to reach (some may have
    /// flushed past it since).
    pub fn targets(&self) -> CpuSet {
        self.gens
            .iter()
            .fold(CpuSet::new(), |acc, g| acc.union(&g.targets))
    }

    fn check_machine<A: Arch>(&self, arch: &A) -> Result<(), Error> {
        if self.is_empty() || self.machine == machine_id(arch) {
            Ok(())
        } else {
            Err(Error::OtherMachine)
        }
    }

    /// Every check of [`defer`](Self::defer) but the room left: whether
    /// the pool would take `batch` once it had room for it (a batch larger
    /// than the whole pool never fits).
    pub(crate) fn check_defer<A: Arch, const M: usize>(
        &self,
        arch: &A,
        batch: &UnmapBatch<M>,
    ) -> Result<(), PoolRefusal> {
        let tlb = batch.tlb_batch();
        if tlb.check_machine(arch).is_err() || self.check_machine(arch).is_err() {
            return Err(PoolRefusal::OtherMachine);
        }
        if batch.held().iter().any(|h| h.mapped.is_some()) {
            return Err(PoolRefusal::StillMapped);
        }
        if tlb.has_writable() {
            return Err(PoolRefusal::Writable);
        }
        if tlb.request().names_kernel() {
            return Err(PoolRefusal::Kernel);
        }
        if batch.len() > N {
            return Err(PoolRefusal::NoRoom { room: self.room() });
        }
        Ok(())
    }

    /// Moves every frame of `batch`, and the flush it owes, into the pool,
    /// without flushing: the frames stay allocated, and come back from
    /// [`release_passed`](Self::release_passed) or [`flush`](Self::flush).
    /// Returns how many frames moved; `batch` is then empty (its address
    /// spaces stay marked as owing a flush, for
    /// [`flush_tlb_batched_pending`](crate::flush_tlb_batched_pending)).
    ///
    /// Call it only after the batch's PTEs were cleared (as
    /// [`UnmapBatch::try_to_unmap`] does): the generation's epoch is opened
    /// here, and CPUs that flush after reading it are trusted to hold no
    /// entry for the frames. When the reverse map keeps aging epochs and
    /// the hardware's fills set the accessed bit, a batch whose mappings
    /// were all found with the bit clear takes the frames' aging epoch
    /// instead ([`Rmap::aged_epoch`](crate::Rmap::aged_epoch)): CPUs that
    /// flushed since the aging need not flush again, so such frames often
    /// come back from the next [`release_passed`](Self::release_passed).
    /// On hardware whose batches invalidate as pages are added
    /// ([`Arch::BATCH_BROADCAST_ON_ADD`]), a batch filled on this CPU is
    /// completed here with one barrier ([`Arch::broadcast_sync`], no IPI),
    /// and its frames come back from the next `release_passed` whoever has
    /// flushed.
    ///
    /// Refused, with `batch` and the pool unchanged (flush the batch as
    /// usual then), when a held frame is still mapped, a deferred mapping
    /// was writable or dirty, the batch covers kernel pages, the pool lacks
    /// room, or either belongs to another machine: [`PoolRefusal`].
    pub fn defer<A: Arch, const M: usize>(
        &mut self,
        arch: &A,
        batch: &mut UnmapBatch<M>,
    ) -> Result<usize, PoolRefusal> {
        self.check_defer(arch, batch)?;
        let me = online_caller(arch).map_err(PoolRefusal::Caller)?;
        if batch.len() > self.room() {
            return Err(PoolRefusal::NoRoom { room: self.room() });
        }
        if batch.is_empty() {
            return Ok(0);
        }
        let tlb = batch.tlb_batch();
        let state = arch.shootdown_state();
        // After the PTE clears (the batch recorded each one after it was
        // done): a CPU that reads this epoch and then flushes holds none
        // of the batch's entries. When every entry was found with its
        // accessed bit clear, an older epoch, read after the frames' last
        // aging, does as well (see `Rmap::aged_epoch`); it may not be
        // published yet.
        let epoch = if tlb.issued_here::<A>(me) {
            // This CPU issued every page's broadcast invalidation as it was
            // added (`Arch::BATCH_BROADCAST_ON_ADD`): one barrier completes
            // them on every CPU, after which none holds an entry for the
            // frames, so the generation waits for no CPU (epoch 0, which
            // every CPU has passed).
            complete_broadcast(arch, me, tlb.request());
            0
        } else {
            match tlb.aged_epoch() {
                Some(aged) if aged <= state.epoch() => aged,
                _ => state.publish_epoch(),
            }
        };
        let targets = tlb.targets();
        for cpu in &targets {
            state.owe(cpu, epoch);
        }
        let aged = targets
            .intersection(&arch.online_cpus())
            .difference(&CpuSet::single(me))
            .iter()
            .all(|c| state.passed_epoch(c) >= epoch);
        self.request.merge(tlb.request(), A::FULL_FLUSH_CEILING);
        let frames = batch.len();
        let named = tlb.request().asids();
        let mut asids = [Asid::KERNEL; MAX_FLUSH_ASIDS];
        asids[..named.len()].copy_from_slice(named);
        let generation = Generation {
            epoch,
            targets,
            frames,
            asids,
            nr_asids: named.len(),
            many: tlb.request().has_too_many_asids(),
            aged,
        };
        if let Err(generation) = self.gens.push(generation) {
            // Every slot in use: join the newest generation, which then
            // waits for both epochs' CPUs (the newer epoch covers the
            // older; an aged generation's may be the older one).
            if let Some(newest) = self.gens.last_mut() {
                newest.epoch = newest.epoch.max(generation.epoch);
                newest.targets = newest.targets.union(&generation.targets);
                newest.frames += generation.frames;
                newest.aged &= generation.aged;
                newest.merge_asids(&generation);
            }
        }
        for held in batch.take_held() {
            // SAFETY: `batch.len()` <= `self.room()` was checked above, so
            // the deque has room for every held frame.
            unsafe { self.frames.push_unchecked(held.frame) };
        }
        batch.forget_tlb();
        self.machine = machine_id(arch);
        state.count(Counter::FramesPooled, frames as u64);
        Ok(frames)
    }

    /// Hands back, without any IPI, every generation that all the CPUs it
    /// had to reach have flushed past, in any order. A CPU flushes past
    /// every generation published before it drops all its non-global
    /// entries: in [`quiescent_flush`], at an address-space switch without
    /// tagged TLBs, in [`prepare_cpu_online`](crate::prepare_cpu_online),
    /// or when a shootdown asks it for a full flush (of everything, or of
    /// the one address space an untagged TLB holds); a shootdown of single
    /// pages is no such flush. If the calling CPU is among
    /// those it has not, it flushes itself here, locally. Returns an empty
    /// [`Flushed`] when every generation still waits for another CPU (or
    /// the pool is empty, or belongs to another machine, or the calling CPU
    /// is not online or cannot be told). Its cost is
    /// proportional to what the pool holds.
    pub fn release_passed<A: Arch>(&mut self, arch: &A) -> Flushed<N> {
        let mut released = heapless::Vec::new();
        if self.check_machine(arch).is_err() {
            return Flushed::unmapped(released, ShootdownReport::default());
        }
        let state = arch.shootdown_state();
        let Ok(me) = online_caller(arch) else {
            return Flushed::unmapped(released, ShootdownReport::default());
        };
        let online = arch.online_cpus();
        let passed = |g: &Generation| {
            let others = g.targets.intersection(&online).difference(&CpuSet::single(me));
            others.iter().all(|c| g.clear_on(state, c))
        };
        // Each generation's verdict, taken once and used both for the
        // local flush and for the split below: another CPU may pass a
        // generation in between, which must then wait for the next call
        // rather than go out without the local flush it may need. Along
        // the way, the newest epoch among the passed generations that the
        // calling CPU must still flush itself for.
        let mut verdicts = [false; POOL_GENERATIONS];
        let mut local = false;
        let mut any = false;
        for (verdict, g) in verdicts.iter_mut().zip(self.gens.iter()) {
            *verdict = passed(g);
            if *verdict {
                any = true;
                local |= g.targets.contains(me) && !g.clear_on(state, me);
            }
        }
        if !any {
            return Flushed::unmapped(released, ShootdownReport::default());
        }
        let mut report = ShootdownReport::default();
        if local {
            local_pass(arch, me);
            report.flushed_locally = true;
        }
        // Frames are stored generation after generation, oldest first.
        let mut frames = core::mem::take(&mut self.frames).into_iter();
        let gens = core::mem::take(&mut self.gens);
        // `gens` held at most POOL_GENERATIONS: the zip takes every one.
        for (g, &release) in gens.into_iter().zip(verdicts.iter()) {
            if release {
                let n = g.frames as u64;
                let passed = g
                    .targets
                    .intersection(&online)
                    .difference(&CpuSet::single(me))
                    .iter()
                    .all(|c| state.passed_epoch(c) >= g.epoch);
                if g.aged {
                    self.releases.aged += n;
                } else if passed {
                    self.releases.passes += n;
                } else {
                    self.releases.generations += n;
                }
            }
            for frame in frames.by_ref().take(g.frames) {
                // SAFETY: the pool holds at most N frames, so either list
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
                // SAFETY: at most as many generations as were taken out.
                unsafe { self.gens.push_unchecked(g) };
            }
        }
        if self.gens.is_empty() {
            self.request.clear();
            self.machine = 0;
        }
        state.count(Counter::FramesReleasedByPasses, released.len() as u64);
        Flushed::unmapped(released, report)
    }

    /// Shoots down what the pool still owes and hands every frame back:
    /// one shootdown of everything pooled, to the CPUs (this one
    /// included) that have not flushed past the generations they had to
    /// reach; none at all when every one has. For when the kernel cannot
    /// wait: free memory is low, or a pooled frame must be reused.
    ///
    /// Errors, with the pool unchanged and the flush still owed:
    /// [`Error::OtherMachine`], and those of [`shootdown`] (retry from a
    /// context not nested in another shootdown).
    pub fn flush<A: Arch>(&mut self, arch: &A) -> Result<Flushed<N>, Error> {
        // Every generation, not `N` frames' worth: a generation may hold
        // no frame at all (a batch that only aged pages, on hardware where
        // clearing an accessed bit owes a flush), and its flush is owed
        // all the same.
        self.flush_oldest(arch, usize::MAX)
    }

    /// Like [`flush`](Self::flush), but only for the oldest generations
    /// that together hold at least `frames` frames (all of them if they
    /// hold fewer): one shootdown to the CPUs that have not flushed past
    /// those, then every generation no CPU can cache any more comes back,
    /// those and any other a CPU's flush has covered meanwhile. The
    /// younger generations keep waiting for the CPUs' own flushes, which
    /// they are the likeliest not to have had yet. For when the pool is
    /// full, or the kernel needs some frames now. With `frames` 0 it
    /// interrupts no CPU: only the generations no CPU can cache any more
    /// come back, as from [`release_passed`](Self::release_passed). Errors:
    /// as for `flush`, with the pool unchanged.
    pub fn flush_oldest<A: Arch>(&mut self, arch: &A, frames: usize) -> Result<Flushed<N>, Error> {
        self.check_machine(arch)?;
        let state = arch.shootdown_state();
        let online = arch.online_cpus();
        let unpassed = |g: &Generation| {
            let mut set = CpuSet::new();
            for cpu in &g.targets.intersection(&online) {
                if !g.clear_on(state, cpu) {
                    set.insert(cpu);
                }
            }
            set
        };
        // Generations are taken greedily, each time the one that adds the
        // fewest CPUs to interrupt (the oldest among equals), until they
        // hold `frames` frames; then every one whose CPUs are interrupted
        // already comes along for free. At most POOL_GENERATIONS rounds.
        let mut waiting = [CpuSet::new(); POOL_GENERATIONS];
        for (w, g) in waiting.iter_mut().zip(self.gens.iter()) {
            *w = unpassed(g);
        }
        let mut owed = CpuSet::new();
        let mut covered = 0;
        let mut chosen = [false; POOL_GENERATIONS];
        loop {
            let cheapest = self
                .gens
                .iter()
                .enumerate()
                .filter(|&(i, _)| !chosen[i])
                .map(|(i, g)| (waiting[i].difference(&owed).len(), i, g.frames))
                .min_by_key(|&(added, i, _)| (added, i));
            let Some((added, i, n)) = cheapest else { break };
            if added > 0 && covered >= frames {
                break;
            }
            chosen[i] = true;
            owed = owed.union(&waiting[i]);
            covered += n;
        }
        let report = shootdown(arch, &owed, &self.request)?;
        if !self.gens.is_empty() {
            state.count(Counter::BatchesFlushed, 1);
        }
        // The flushed generations come out first: their CPUs are done with
        // them whatever the request was. The shootdown may also have been a
        // full flush that counts as a pass for others.
        let mut released = heapless::Vec::new();
        let mut frames_left = core::mem::take(&mut self.frames).into_iter();
        let gens = core::mem::take(&mut self.gens);
        for (i, g) in gens.into_iter().enumerate() {
            if chosen[i] {
                self.releases.forced += g.frames as u64;
            }
            for frame in frames_left.by_ref().take(g.frames) {
                // SAFETY: at most N frames in all, each list of capacity N.
                unsafe {
                    if chosen[i] {
                        released.push_unchecked(frame);
                    } else {
                        self.frames.push_unchecked(frame);
                    }
                }
            }
            if !chosen[i] {
                // SAFETY: at most as many generations as were taken out.
                unsafe { self.gens.push_unchecked(g) };
            }
        }
        if self.gens.is_empty() {
            self.request.clear();
            self.machine = 0;
        } else {
            let (more, _) = self.release_passed(arch).into_parts();
            for frame in more {
                // SAFETY: as above.
                unsafe { released.push_unchecked(frame) };
            }
        }
        Ok(Flushed::unmapped(released, report))
    }
}
