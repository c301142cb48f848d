//! Physical frames as the oracle sees them: allocation, I/O, freeing, and
//! the checks that record a violation of the safety contract.

use core::sync::atomic::Ordering;
use std::vec::Vec;

use super::{lock, FrameError, FrameState, MockError, MockMachine, Model, TlbEntry, Violation, WalkEntry};
use crate::cpuset::CpuId;
use crate::mm::MmTlbState;
use crate::page_size::PageSize;
use crate::pte::{Frame, Pte, PAGE_SHIFT};
use crate::range::PageRange;

impl<M: Model> MockMachine<M> {
    /// Takes a free frame.
    pub fn alloc_frame(&self) -> Result<Frame, MockError> {
        Ok(lock(&self.memory).alloc()?)
    }

    /// Takes a huge frame: `size.base_pages()` free frames in a row, the
    /// first aligned to `size` (as a huge page-table entry needs), each of
    /// which the oracle judges as a frame of its own. Free it by freeing
    /// each of them ([`free_frame`](Self::free_frame)). Errors:
    /// [`MockError::Frame`] with [`FrameError::OutOfFrames`] when no such
    /// run is free (give the machine enough frames,
    /// [`MockConfig::frames`](super::MockConfig::frames)).
    pub fn alloc_huge_frame(&self, size: PageSize) -> Result<Frame, MockError> {
        Ok(lock(&self.memory).alloc_aligned(size.base_pages())?)
    }

    /// How many 4 KiB frames the huge frame whose first frame is `frame`
    /// spans: `Some` for a frame [`alloc_huge_frame`](Self::alloc_huge_frame)
    /// returned, until that first frame is freed; `None` for any other
    /// frame. [`MockKernel`](super::MockKernel) frees the whole run when it
    /// is handed the first frame, as a kernel frees a huge frame (a folio)
    /// whole.
    pub fn huge_frame_pages(&self, frame: Frame) -> Option<u64> {
        lock(&self.memory).run_of(frame)
    }

    /// Returns a frame to the free list. The oracle records a
    /// [`Violation::FreedWhileCached`] for every CPU still caching it (a
    /// lazy CPU's entry from the space it is lazy on is remembered instead,
    /// and judged when the CPU resumes: [`MockCpu::leave_lazy`](super::MockCpu::leave_lazy);
    /// so is, on a tagged TLB, an entry of an ASID the CPU has not loaded,
    /// judged when it loads it: [`Violation::LoadedWithStale`]) and a
    /// [`Violation::TableFreedWhileCached`] for every CPU whose walk cache
    /// still points to it (only when the free itself is accepted; on a
    /// tagged TLB, a walk entry of an ASID the CPU has not loaded is judged
    /// at the load too), and a
    /// [`Violation::FreedDuringIo`] for a frame still being written out
    /// (which stays under I/O, and the free is refused).
    pub fn free_frame(&self, frame: Frame) -> Result<(), MockError> {
        // No CPU stops being lazy or loads an ASID from the scan to the
        // last verdict.
        let _judging = self.judging();
        // TLBs are scanned before the memory lock is taken: accesses lock a
        // TLB and then memory, never the other way round.
        let cached = self.live_translations(frame);
        let walk_cached = self.walk_cached(frame);
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
        self.remember_dormant(frame, false);
        lock(&self.detached).remove(&frame);
        for cpu in walk_cached {
            self.record(Violation::TableFreedWhileCached { frame, cpu });
        }
        for cpu in walking {
            self.record(Violation::TableFreedUnderWalker { frame, cpu });
        }
        for (cpu, entry) in cached {
            if self.defer_to_lazy(cpu, &entry, frame) || self.defer_to_load(cpu, &entry, frame) {
                continue;
            }
            self.record(Violation::FreedWhileCached {
                frame,
                cpu,
                writable: entry.writable,
            });
        }
        Ok(())
    }

    /// The online CPUs whose walk caches point to the page-table frame
    /// `frame`, at any level, under an ASID they may use (on a tagged TLB,
    /// an entry of an ASID the CPU has not loaded is remembered instead,
    /// and judged at the load).
    fn walk_cached(&self, frame: Frame) -> Vec<CpuId> {
        self.cpus()
            .filter(|cpu| self.is_online(cpu.id()))
            .filter(|cpu| {
                let walks: Vec<WalkEntry> = lock(&cpu.state().tlb)
                    .walks()
                    .filter(|w| w.table == frame)
                    .copied()
                    .collect();
                walks.iter().any(|w| !self.defer_walk_to_load(cpu.id(), w))
            })
            .map(|cpu| cpu.id())
            .collect()
    }

    /// Tells the oracle that the kernel freed the page-table frame `frame`
    /// of a table it wrote itself ([`attach_table`](Self::attach_table)),
    /// a frame that is not one of the machine's (a table in the test's own
    /// memory; a machine frame goes back through
    /// [`free_frame`](Self::free_frame), which judges the same). Call it
    /// where the kernel's
    /// [`TeardownBacking::free_tables`](crate::TeardownBacking::free_tables)
    /// frees one. The oracle records a [`Violation::TableFreedWhileCached`]
    /// for every CPU whose walk cache still points to it, at any level (on
    /// a tagged TLB, one of an ASID the CPU has not loaded is judged when it
    /// loads it: [`Violation::LoadedWithStaleWalk`]), and from then on a
    /// walk through such a pointer is a
    /// [`Violation::WalkThroughFreedTable`], until a walk finds the frame
    /// linked again (reused as a table).
    pub fn free_table_frame(&self, frame: Frame) {
        let _judging = self.judging();
        let walk_cached = self.walk_cached(frame);
        lock(&self.freed_tables).insert(frame);
        self.remember_dormant(frame, false);
        for cpu in walk_cached {
            self.record(Violation::TableFreedWhileCached { frame, cpu });
        }
    }

    /// Starts writing a frame out. The oracle records a
    /// [`Violation::IoWhileWritable`] for every CPU caching it writable
    /// (only when the frame could start I/O), except an entry the CPU
    /// cannot use until it catches up (lazy, or of an ASID it has not
    /// loaded): that one is judged at the resume or at the load, as for a
    /// free.
    pub fn start_io(&self, frame: Frame) -> Result<(), MockError> {
        let _judging = self.judging();
        let cached = self.live_translations(frame);
        lock(&self.memory).start_io(frame)?;
        self.remember_dormant(frame, true);
        for (cpu, entry) in cached.into_iter().filter(|(_, e)| e.writable) {
            // An entry the CPU cannot use before a catch-up flush is judged
            // then, as at a free.
            if self.defer_to_lazy(cpu, &entry, frame) || self.defer_to_load(cpu, &entry, frame) {
                continue;
            }
            self.record(Violation::IoWhileWritable { frame, cpu });
        }
        Ok(())
    }

    /// Finishes writing a frame out.
    pub fn end_io(&self, frame: Frame) -> Result<(), MockError> {
        Ok(lock(&self.memory).end_io(frame)?)
    }

    /// Every frame's state and dirty flag, in frame order (data frames,
    /// then page-table frames), read at once.
    pub fn frame_states(&self) -> Vec<(FrameState, bool)> {
        lock(&self.memory).states()
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

    pub(crate) fn record(&self, v: Violation) {
        lock(&self.violations).push(v);
    }

    /// How many violations the oracle recorded so far (without copying
    /// them).
    pub fn violation_count(&self) -> usize {
        lock(&self.violations).len()
    }

    /// Every violation the oracle recorded so far.
    pub fn violations(&self) -> Vec<Violation> {
        lock(&self.violations).clone()
    }

    /// What the oracle holds against a frame: the translations to it cached
    /// by online CPUs. An offline CPU's entries are dormant: it runs
    /// nothing, and must drop them before it comes back
    /// ([`prepare_cpu_online`](crate::prepare_cpu_online)); if it does not,
    /// the oracle sees what they reach when they are used.
    fn live_translations(&self, frame: Frame) -> Vec<(CpuId, TlbEntry)> {
        self.cached_translations(frame)
            .into_iter()
            .filter(|(cpu, _)| self.is_online(*cpu))
            .collect()
    }

    /// Whether `cpu` cannot use `e`, an entry of `mm`, before it flushes
    /// `mm`'s ASID by generation. A CPU is lazy from the crate's mark
    /// until the machine's resume ([`MockCpu::leave_lazy`](super::MockCpu::leave_lazy)):
    /// `switch_mm` clears the mark before it catches up, and the CPU runs
    /// no user code until both are done.
    fn owes_catch_up(&self, cpu: CpuId, e: &TlbEntry, mm: &MmTlbState) -> bool {
        if e.global || mm.is_kernel() {
            return false;
        }
        let loaded = lock(&self.state(cpu).loaded).map(|(a, _)| a);
        let lazy = self.shootdown.is_lazy(cpu) || lock(&self.state(cpu).lazy).is_some();
        let unusable = lazy || (self.config.tagged_tlb && loaded != Some(e.asid));
        unusable && self.shootdown.caught_up_generation(cpu, mm.asid()) < mm.tlb_gen()
    }

    /// Whether `cpu`'s TLB holds `e` now (the same translation, with the
    /// same write permission): a verdict on an entry seen in an earlier
    /// scan asks first, since a CPU may have caught up and dropped it in
    /// between.
    fn still_cached(&self, cpu: CpuId, e: &TlbEntry) -> bool {
        lock(&self.state(cpu).tlb)
            .entries()
            .any(|t| t.same_translation(e) && t.writable == e.writable)
    }

    /// Every (CPU, entry) pair caching a translation to `frame` (a 4 KiB
    /// entry for it, or a huge entry one of whose pages it is), offline
    /// CPUs included.
    pub fn cached_translations(&self, frame: Frame) -> Vec<(CpuId, TlbEntry)> {
        // The oracle asks this at every free: each TLB is scanned in place
        // and only the matches are copied out (copying every entry of
        // every CPU first made a 48-CPU benchmark run spend three quarters
        // of its time here).
        let mut out = Vec::new();
        for cpu in self.cpus() {
            let tlb = lock(&self.state(cpu.id).tlb);
            out.extend(
                tlb.entries()
                    .filter(|e| e.page_of(frame).is_some())
                    .map(|e| (cpu.id, *e)),
            );
        }
        out
    }

    /// Every TLB entry of every CPU.
    pub fn all_entries(&self) -> Vec<(CpuId, TlbEntry)> {
        let mut out = Vec::with_capacity(self.cpus.len() * self.config.tlb_entries);
        for cpu in self.cpus() {
            out.extend(lock(&self.state(cpu.id).tlb).entries().map(|e| (cpu.id, *e)));
        }
        out
    }

    /// The TLB entries that no longer match the page table: the PTE they
    /// came from is gone, maps another frame, or no longer allows a write
    /// the entry allows. These are what shootdowns exist to remove.
    pub fn stale_entries(&self) -> Vec<(CpuId, TlbEntry)> {
        self.all_entries()
            .into_iter()
            .filter(|(_, e)| {
                // The entry it came from: the same size, present, at the
                // same frame, allowing at least what the entry allows.
                let now = self.with_leaf(e.space, e.vpn, |p, size| (Pte(p.load(Ordering::SeqCst)), size));
                !now.is_some_and(|(p, size)| {
                    let base = Frame(p.frame().0 & !(size.base_pages() - 1));
                    p.is_present() && size == e.size && base == e.frame && (p.is_writable() || !e.writable)
                })
            })
            .collect()
    }

    /// The oracle's check after an operation that changed the mappings of
    /// `mm` in `range` (mprotect, munmap, remap) returned: no CPU may
    /// still hold an entry there that disagrees with the page table, except
    /// one it cannot use until it flushes that ASID by generation (a
    /// non-global entry on a CPU that is lazy on `mm`, or, on a tagged TLB,
    /// that has another ASID loaded, and that is behind `mm`'s
    /// [`tlb_gen`](MmTlbState::tlb_gen); and one it no longer holds when
    /// judged, if it caught up meanwhile). Records
    /// a [`Violation::StaleAfterChange`] for each such entry and returns how
    /// many it found.
    pub fn check_coherent(&self, mm: &MmTlbState, range: PageRange) -> usize {
        let stale: Vec<_> = self
            .stale_entries()
            .into_iter()
            .filter(|(cpu, _)| self.is_online(*cpu))
            .filter(|(_, e)| {
                (e.asid == mm.asid() || e.global && mm.is_kernel())
                    && (range.contains(e.vpn << PAGE_SHIFT)
                        || !range.is_empty() && e.covers(range.start() >> PAGE_SHIFT))
            })
            .filter(|(cpu, e)| !self.owes_catch_up(*cpu, e, mm))
            // Asked after the exemption: a CPU that caught up (and loaded
            // the ASID, or resumed) since the scan dropped the entry then.
            .filter(|(cpu, e)| self.still_cached(*cpu, e))
            .collect();
        for (cpu, e) in &stale {
            self.record(Violation::StaleAfterChange {
                cpu: *cpu,
                va: (e.vpn << PAGE_SHIFT).max(range.start()),
                writable: e.writable,
            });
        }
        stale.len()
    }
}
