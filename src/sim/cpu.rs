//! One simulated CPU: switching address spaces, taking interrupts, and
//! memory accesses through its TLB as hardware makes them.

use core::sync::atomic::Ordering;
use std::sync::Arc;

use super::{
    lock, region_of, BroadcastOp, CostKind, CpuState, Delivery, Fault, FrameState, MockError, MockMachine,
    Model, Tlb, TlbEntry, Violation, WalkEntry, X86Like, WALK_LEVELS,
};
use crate::arch::Asid;
use crate::cpuset::CpuId;
use crate::mm::{switch_mm, MmTlbState};
use crate::page_size::PageSize;
use crate::pte::{Frame, Pte, PteFlags, PAGE_SHIFT};
use crate::shootdown::handle_flush_ipi;
use crate::Error;

/// One CPU of a [`MockMachine`]: the handle that implements [`Arch`](crate::Arch) and
/// performs simulated memory accesses. `Copy`; hand one to each thread.
pub struct MockCpu<'m, M: Model = X86Like> {
    pub(crate) machine: &'m MockMachine<M>,
    pub(crate) id: CpuId,
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

    pub(crate) fn state(&self) -> &'m CpuState {
        self.machine.state(self.id)
    }

    /// Switches this CPU to `next` through the crate's [`switch_mm`] hook.
    /// Errors (nothing changes): [`MockError::UnknownAddressSpace`] for an
    /// address space this machine did not create, and whatever
    /// [`switch_mm`] refuses.
    ///
    /// A [switch hook](MockMachine::set_switch_hook) runs in the middle of
    /// it; meanwhile [`current_mm`](Self::current_mm) still reports the
    /// address space this CPU is leaving.
    pub fn switch_to(&self, next: &Arc<MmTlbState>) -> Result<(), MockError> {
        self.machine.known(next)?;
        // Not locked across the switch: the switch hook may look at this
        // CPU's address space, or switch another CPU.
        let prev = lock(&self.state().mm).clone();
        let same = prev.as_ref().is_some_and(|p| Arc::ptr_eq(p, next));
        // SAFETY: every root the mock hands out names one of its own page
        // tables, and the mock's `switch_address_space` only records it.
        unsafe { switch_mm(self, prev.as_deref(), next) }?;
        *lock(&self.state().mm) = Some(Arc::clone(next));
        if self.is_lazy() {
            if same {
                // `switch_mm` caught up: the CPU resumes user code here.
                self.leave_lazy();
            } else {
                self.lazy_switched_away();
            }
        }
        Ok(())
    }

    /// Takes this CPU offline the way a kernel's CPU-offline path does,
    /// through the crate's [`take_cpu_offline`]: it leaves the online set,
    /// then serves and acknowledges every request that reaches its inbox
    /// until no initiator that saw it online can still publish one, and
    /// returns how many it served. It keeps whatever its TLB holds, takes
    /// no further IPIs (those sent to it are dropped), and runs nothing
    /// until [`come_online`](Self::come_online); call it from the thread
    /// that runs the CPU. Its interrupt mask is left as it is: with
    /// interrupts on, a pending IPI may be taken while it waits, which
    /// serves the same inbox.
    ///
    /// As on hardware, the CPU first loads the kernel's space
    /// ([`switch_to`](Self::switch_to) the machine's
    /// [`kernel_mm`](MockMachine::kernel_mm)); [`go_offline`](Self::go_offline)
    /// does both.
    ///
    /// Errors, with nothing changed: [`Error::CpuNotOnline`] when the CPU
    /// is already offline; [`Error::ShootdownReentered`] inside
    /// [`in_shootdown`](Self::in_shootdown) (as from an interrupt handler
    /// that interrupted a shootdown of this CPU);
    /// [`Error::UserSpaceLoaded`] when it still runs a user space.
    ///
    /// [`take_cpu_offline`]: crate::take_cpu_offline
    pub fn take_offline(&self) -> Result<usize, Error> {
        crate::lifecycle::take_cpu_offline(self, |me| self.machine.online.remove(me, Ordering::SeqCst))
    }

    /// A kernel's whole offline path, for a test that knows the CPU is
    /// online and outside a shootdown: a switch to the kernel's space (when
    /// it runs a user space, lazily or not), then
    /// [`take_offline`](Self::take_offline). It returns nothing: a test
    /// that needs to see a refusal calls `take_offline` itself. Refused,
    /// the CPU stays as it was: offline if it was offline already; online,
    /// running the kernel's space, inside
    /// [`in_shootdown`](Self::in_shootdown); online on its user space if
    /// the switch to the kernel's space was refused.
    pub fn go_offline(&self) {
        let runs_user = self.current_mm().is_some_and(|mm| !mm.is_kernel());
        if runs_user && self.switch_to(self.machine.kernel_mm()).is_err() {
            return;
        }
        // Either error leaves the CPU as it was, which is all a caller of
        // this form asks for.
        let _ = self.take_offline();
    }

    /// Brings this CPU back online the way a kernel must: it runs
    /// [`prepare_cpu_online`](crate::prepare_cpu_online) (everything it
    /// cached while away goes), then joins the online set; it runs no
    /// address space until it switches to one, and is not lazy (its TLB
    /// holds nothing the oracle could still hold against it). On a CPU
    /// that is online already it does nothing (the crate refuses to
    /// prepare one: [`Error::AlreadyOnline`]).
    pub fn come_online(&self) {
        if self.machine.online.contains(self.id, Ordering::SeqCst) {
            return;
        }
        // The mock always tells its CPU: this cannot fail.
        let _ = crate::mm::prepare_cpu_online(self);
        *lock(&self.state().loaded) = None;
        *lock(&self.state().mm) = None;
        *lock(&self.state().lazy) = None;
        lock(&self.state().unloaded).clear();
        lock(&self.state().unloaded_walks).clear();
        // Judged as any rejoin: what `prepare_cpu_online` left behind of
        // the entries remembered while the CPU was away is a violation.
        self.machine.join_online(self.id);
    }

    /// What this CPU's walk caches hold now: a pointer to a page table
    /// per entry, at every level ([`WalkEntry::level`]), in no particular order.
    pub fn walk_cache(&self) -> std::vec::Vec<WalkEntry> {
        lock(&self.state().tlb).walks().copied().collect()
    }

    /// The address space this CPU runs, if any.
    pub fn current_mm(&self) -> Option<Arc<MmTlbState>> {
        lock(&self.state().mm).clone()
    }

    /// Fault injection: runs `f` as an interrupt handler that arrived while
    /// this CPU was in the middle of a shootdown of its own. Every shootdown
    /// `f` starts on this CPU that interrupts other CPUs (and every
    /// [`ipi_sync`](crate::ipi_sync)) then fails with
    /// [`Error::ShootdownReentered`], through the crate's real protocol (the
    /// CPU's request slot is taken), so a test can drive an operation into
    /// its error path and check what the error leaves behind and what a
    /// retry does. Errors: [`Error::ShootdownReentered`] when this CPU is
    /// already inside such a call.
    ///
    /// A shootdown that needs no slot still succeeds inside `f`, as it
    /// would in a real interrupt handler: one whose targets are only this
    /// CPU, and one that goes by broadcast invalidation (on
    /// [`BroadcastTlbi`](crate::arch::mock::BroadcastTlbi) and
    /// [`Arm64Like`](crate::arch::mock::Arm64Like) models, including an
    /// `Arm64Like` batch's flush on the CPU that filled it). To reach a
    /// flush's error path there, have another CPU run the address space
    /// and raise [`MockConfig::broadcast_min_remote`](crate::arch::mock::MockConfig)
    /// above the number of CPUs, so that flushes go by IPI; a batch filled
    /// on this CPU under `Arm64Like` completes by its barrier whatever it
    /// is set to.
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

    pub(crate) fn take_interrupt(&self) {
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

    /// Reads the data word of the page at `va` in the current address space
    /// (or the kernel's), filling the TLB as hardware would. Errors: the
    /// [`Fault`] the access takes; [`Fault::CpuOffline`] on an offline CPU,
    /// [`Fault::LazyUserAccess`] for a user page on a lazy CPU
    /// ([`enter_lazy`](Self::enter_lazy)), neither of which changes
    /// anything.
    pub fn read(&self, va: u64) -> Result<u64, Fault> {
        self.access(va, None)
    }

    /// Writes `value` into the page at `va`, setting the dirty bit as
    /// hardware would; a write through a stale entry lands in whatever frame
    /// the entry names, and the oracle judges it. Errors as for
    /// [`read`](Self::read).
    pub fn write(&self, va: u64, value: u64) -> Result<(), Fault> {
        self.access(va, Some(value)).map(|_| ())
    }

    pub(crate) fn access(&self, va: u64, write: Option<u64>) -> Result<u64, Fault> {
        if !self.machine.is_online(self.id) {
            return Err(Fault::CpuOffline);
        }
        self.poll_interrupts();
        let m = self.machine;
        let vpn = va >> PAGE_SHIFT;
        let loaded = *lock(&self.state().loaded);
        // A lazy CPU runs kernel code only (checked before the TLB is
        // locked: the lazy mark is never taken while the TLB is held).
        self.lazy_access_check(va, loaded)?;
        let asid = loaded.map_or(Asid::KERNEL, |(a, _)| a);
        // The TLB stays locked for the whole access: an instruction is not
        // interrupted half-way, so no flush can slip between translation
        // and the memory operation.
        let mut tlb = lock(&self.state().tlb);
        let hit = tlb.lookup(asid, vpn);
        if let (Some(e), Some((_, root))) = (hit, loaded) {
            if !e.global && e.space != root {
                // The hardware tells address spaces apart by ASID alone: an
                // entry filled for another address space with this ASID
                // (reused without a flush) serves this one.
                m.record(Violation::ForeignTranslation {
                    cpu: self.id,
                    va,
                    frame: e.frame_at(vpn),
                });
            }
        }
        let frame = match (hit, write.is_some()) {
            (Some(e), false) => e.frame_at(vpn),
            (Some(e), true) if !e.writable => {
                tlb.remove(asid, vpn);
                return Err(Fault::WriteProtected { va });
            }
            (Some(e), true) if e.dirty => e.frame_at(vpn),
            (Some(e), true) if !M::CLEAN_WRITE_REWALK => {
                // No re-walk: the write goes through the cached entry; the
                // dirty bit reaches the PTE only if it still maps the frame.
                tlb.mark_dirty(asid, vpn);
                self.set_dirty_in_place(loaded, e);
                e.frame_at(vpn)
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

    pub(crate) fn set_dirty_in_place(&self, loaded: Option<(Asid, u64)>, e: TlbEntry) {
        let root = if e.global {
            self.machine.kernel_root
        } else {
            loaded.map_or(self.machine.kernel_root, |(_, r)| r)
        };
        self.machine.with_leaf(root, e.vpn, |p, size| {
            let _ = p.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                let pte = Pte(v);
                let base = Frame(pte.frame().0 & !(size.base_pages() - 1));
                (pte.is_present() && size == e.size && base == e.frame).then_some(v | PteFlags::DIRTY.bits())
            });
        });
    }

    /// The hardware's walk of the page table that maps `vpn` under `root`,
    /// through the walk caches: it starts from the deepest cached pointer
    /// on the way to `vpn` (the leaf table's, else the level-2 table's,
    /// else the level-3 table's) even when that table is no longer linked,
    /// and caches a pointer to every table it passes below that. Returns
    /// the entry word's new value (`Ok`) or the value that made the walk
    /// stop (`Err`), with the size of the page the entry maps (a huge
    /// entry ends the walk above the leaf level); `None` when no table
    /// maps `vpn` under `root`.
    fn walk_table(
        &self,
        tlb: &mut Tlb,
        asid: Asid,
        root: u64,
        vpn: u64,
        write: bool,
    ) -> Option<(Result<u64, u64>, PageSize)> {
        let m = self.machine;
        let cached =
            (1..=WALK_LEVELS).find_map(|level| tlb.walk_lookup(asid, root, level, region_of(vpn, level)));
        let below = match cached {
            Some(w) if Some(w.table) != m.table_at(root, vpn, w.level) => {
                // A stale pointer: the walk reads a table that was unlinked.
                // It must still hold what the teardown left (nothing: only
                // empty tables are unlinked) until the flush that drops the
                // pointer; a table already freed or reused is a violation.
                if m.unlinked_table_freed(root, w.table) {
                    m.record(Violation::WalkThroughFreedTable {
                        cpu: self.id,
                        table: w.table,
                        va: vpn << PAGE_SHIFT,
                    });
                }
                return Some((Err(0), PageSize::SIZE_4K));
            }
            Some(w) => w.level,
            None => WALK_LEVELS + 1,
        };
        // The rest of the walk reads the linked tables, top down, and
        // caches each one it reaches (a level the tables do not report,
        // such as those above the machine's own leaf tables, is skipped).
        for level in (1..below).rev() {
            let Some(table) = m.table_at(root, vpn, level) else {
                continue;
            };
            m.table_linked(root, table);
            tlb.walk_insert(WalkEntry {
                asid,
                space: root,
                level,
                region: region_of(vpn, level),
                table,
            });
        }
        m.with_leaf(root, vpn, |p, size| {
            // The hardware's locked update of the A/D bits: it acts on the
            // PTE as it is at this instant, so it can never resurrect a
            // cleared entry nor be lost to a concurrent clear. A huge
            // entry keeps them at the same bits.
            let word = p.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                let pte = Pte(v);
                if !pte.is_present() || (write && !pte.is_writable()) {
                    return None;
                }
                let mut bits = v;
                if write || !M::FILL_SKIPS_ACCESSED {
                    bits |= PteFlags::ACCESSED.bits();
                }
                if write {
                    bits |= PteFlags::DIRTY.bits();
                }
                Some(bits)
            });
            (word, size)
        })
    }

    pub(crate) fn walk_and_fill(
        &self,
        tlb: &mut Tlb,
        loaded: Option<(Asid, u64)>,
        va: u64,
        write: bool,
    ) -> Result<Frame, Fault> {
        let m = self.machine;
        m.charge(self.id, CostKind::TlbRefill, m.config.cost.tlb_refill);
        let vpn = va >> PAGE_SHIFT;
        let asid = loaded.map_or(Asid::KERNEL, |(a, _)| a);
        let user = loaded.and_then(|(_, root)| self.walk_table(tlb, asid, root, vpn, write));
        let ((result, size), space) = match (user, loaded) {
            (Some((Ok(v), size)), Some((_, root))) => ((Ok(v), size), root),
            // A non-empty user entry decides; an empty one falls through to
            // the kernel's half of the address space.
            (Some((Err(v), size)), Some((_, root))) if v != 0 => ((Err(v), size), root),
            _ => (
                self.walk_table(tlb, asid, m.kernel_root, vpn, write)
                    .unwrap_or((Err(0), PageSize::SIZE_4K)),
                m.kernel_root,
            ),
        };
        // The entry's first page and frame: a huge entry's address is
        // aligned to its size (its low bits hold its PAT bit, not frame).
        let base_vpn = vpn & !(size.base_pages() - 1);
        let frame_of = |v: u64| Frame(Pte(v).frame().0 & !(size.base_pages() - 1));
        let old = match result.map_err(Pte) {
            Ok(v)
                if lock(&m.memory)
                    .state(Frame(frame_of(v).0 + (vpn - base_vpn)))
                    .is_err() =>
            {
                // Only a page table the kernel wrote itself can get here:
                // the machine's own refuses such entries.
                m.record(Violation::MapsNoSuchFrame {
                    cpu: self.id,
                    va,
                    frame: Frame(frame_of(v).0 + (vpn - base_vpn)),
                });
                return Err(Fault::NotMapped { va });
            }
            Ok(v) => Pte(v),
            Err(p) if p.is_present() => return Err(Fault::WriteProtected { va }),
            Err(p) if p.is_migration() => return Err(Fault::Migration { va }),
            Err(p) if p.is_hwpoison() => return Err(Fault::HwPoison { va }),
            Err(_) => return Err(Fault::NotMapped { va }),
        };
        let global = old.flags().contains(PteFlags::GLOBAL);
        let entry = TlbEntry {
            asid: if global { Asid::KERNEL } else { asid },
            space,
            vpn: base_vpn,
            frame: frame_of(old.0),
            size,
            writable: old.is_writable(),
            dirty: write || old.is_dirty(),
            global,
        };
        if let Some(other) = tlb.insert(entry) {
            // The first page both translate.
            let common = entry.vpn.max(other.vpn);
            m.record(Violation::ConflictingTranslations {
                cpu: self.id,
                va: common << PAGE_SHIFT,
                cached: other.frame_at(common),
                filled: entry.frame_at(common),
            });
        }
        Ok(entry.frame_at(vpn))
    }

    /// Takes the configured time of a local flush
    /// ([`MockConfig::flush_delay_us`](super::MockConfig::flush_delay_us)).
    pub(crate) fn flush_delay(&self) {
        let us = self.machine.config.flush_delay_us;
        if us != 0 {
            std::thread::sleep(std::time::Duration::from_micros(u64::from(us)));
        }
    }

    pub(crate) fn broadcast(&self, op: BroadcastOp) {
        let m = self.machine;
        m.charge(self.id, CostKind::Broadcast, m.config.cost.broadcast_invalidate);
        lock(&m.broadcast_queue).push((self.id, op));
    }
}
