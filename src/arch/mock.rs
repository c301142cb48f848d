//! The simulated CPUs' [`Arch`] (feature `mock`): what a kernel's tests
//! plug in where the real hardware's `Arch` would go.
//!
//! This is the one path to the simulation: the machine ([`MockMachine`]),
//! its CPUs ([`MockCpu`], which implement [`Arch`] here), the oracle
//! ([`Violation`], [`FrameState`]), the simulated kernel ([`MockKernel`],
//! [`MockRmap`], [`MockSpace`]) and the operation model ([`ops`]) live in
//! the crate's simulation module and are re-exported from here.
//!
//! - Each simulated CPU has a bounded TLB that fills on access by walking
//!   the simulated page tables, sets accessed and dirty bits atomically the
//!   way hardware does, and keeps stale entries until they are flushed.
//! - A write through a cached *clean* entry re-walks the page table (and
//!   faults if the PTE is gone), as on x86; [`NoRewalk`] models hardware
//!   without that guarantee, so tests can prove the crate never defers
//!   there. [`BroadcastTlbi`] models broadcast invalidation (arm64 `TLBI IS`,
//!   AMD `INVLPGB`): no IPIs, remote entries disappear at the issuing
//!   CPU's barrier and not before; [`Arm64Like`] adds arm64's batched
//!   unmap, which invalidates as pages are added and waits once.
//! - Fills set the accessed bit before they cache, as Intel and AMD
//!   document, and the x86 models say so to the crate;
//!   [`X86NoAccessedPromise`] does not (a kernel that does not claim it),
//!   and [`Model::FILL_SKIPS_ACCESSED`] makes fills that leave the bit
//!   clear, so tests can show both what a pool does without the promise
//!   and that the oracle catches a false claim.
//! - A frame-state oracle knows which frames are free, in use or under I/O
//!   and records every [`Violation`] of the safety contract.
//! - IPIs are delivered either synchronously or, with
//!   [`Delivery::Threaded`] and [`MockMachine::run_threaded`], to CPUs that
//!   are real threads.
//! - A [`CostModel`] charges cycles for IPIs, invalidations and refills.
//! - A switch hook ([`MockMachine::set_switch_hook`]) runs test code in
//!   the middle of an address-space switch, after the CPU loaded the new
//!   root and before [`switch_mm`](crate::switch_mm) finished recording
//!   it: the way to test a kernel's code against the CR3 window of
//!   CVE-2025-37964 (the switching CPU fills its TLB from the new tables
//!   while other CPUs unmap, flush and free).
//! - CPUs can be *lazy* (below): the crate's flushes skip them, and the
//!   oracle checks that they catch up before they run user code.
//! - On a tagged TLB, a CPU that switched away keeps its entries of the
//!   old space; the oracle judges them when it loads that ASID again
//!   (below).
//!
//! # Lazy CPUs
//!
//! A CPU that stops running user code (it goes idle, or runs a kernel
//! thread) may keep the last user address space loaded instead of
//! switching away: it is *lazy* on it, as Linux's idle CPUs and kernel
//! threads borrow the previous task's address space. The crate leaves such
//! CPUs out of that space's flushes ([`enter_lazy_tlb`](crate::enter_lazy_tlb),
//! [`MmTlbState::flush_targets`](crate::MmTlbState::flush_targets)), and a
//! lazy CPU that resumes the space flushes its ASID first if the space's
//! generation moved meanwhile (its catch-up, in
//! [`leave_lazy_tlb`](crate::leave_lazy_tlb) or
//! [`switch_mm`](crate::switch_mm)). The mock models the state, and the
//! oracle judges the catch-up:
//!
//! - [`MockCpu::enter_lazy`] marks a CPU lazy on the user address space it
//!   has loaded, for the crate (as `enter_lazy_tlb` does) and for the
//!   oracle; [`MockCpu::is_lazy`] and [`MockMachine::lazy_cpus`] tell who
//!   is. A lazy CPU stays online and keeps its TLB and its place in the
//!   space's CPU set. [`MockCpu::switch_to`] the same space resumes it
//!   through `switch_mm` (catch-up included); a switch to another space
//!   ends the mark too.
//! - A lazy CPU runs kernel code, and takes interrupts, but no user code:
//!   an access that would translate through the user address space (a
//!   non-global TLB entry, or a user page-table entry that is not empty)
//!   is refused with [`Fault::LazyUserAccess`] and changes nothing. Kernel
//!   pages are reached as usual.
//! - A frame freed (or sent to I/O) while a lazy CPU caches an entry for it
//!   that came from the space it is lazy on is not a
//!   [`Violation::FreedWhileCached`]: the CPU cannot use that entry while
//!   it is lazy. The oracle remembers the entry instead.
//! - [`MockCpu::leave_lazy`] is the moment the CPU resumes user code
//!   (`switch_to` calls it after the crate's catch-up; called alone, it
//!   models a kernel that resumes without one). Each remembered entry still
//!   in its TLB then is a [`Violation::LazyResumedWithStale`]. One that is
//!   gone (flushed by the CPU itself, by an interrupt, by a switch of an
//!   untagged TLB, or evicted) is fine. On a tagged TLB a lazy CPU that
//!   switches to another space takes the remembered entries along: they
//!   are judged when it loads the lazy space's ASID again.
//! - Everything else about a lazy CPU is judged at once, as for any CPU:
//!   global entries and entries filled from the kernel's page table
//!   (kernel mappings are flushed everywhere), cached pointers to freed
//!   page tables ([`Violation::TableFreedWhileCached`]: its MMU may still
//!   walk the loaded root, so a flush that frees page tables reaches lazy
//!   CPUs, [`MmTlbState::table_flush_targets`](crate::MmTlbState::table_flush_targets)),
//!   and stale entries after a change ([`MockMachine::check_coherent`]),
//!   unless the CPU is behind the space's generation and so owes a
//!   catch-up.
//! - [`MockCpu::come_online`] and [`MockMachine::reset`] clear the mark.
//!
//! # Tagged TLBs and generations
//!
//! With [`MockConfig::tagged_tlb`], entries survive a switch, tagged with
//! their ASID, and [`switch_mm`](crate::switch_mm) takes the CPU out of the
//! old space's set: flushes of that space skip it from then on, and it
//! flushes the ASID before it loads it again if the space's generation
//! moved (see [`generation`](crate::generation)). The oracle checks
//! contract rule 2 in that exact form:
//!
//! - a frame freed, or sent to I/O, while a CPU caches an entry for it of
//!   an ASID that CPU has not loaded (non-global) is no violation at the
//!   free: the entry cannot be used. Nor is a page table freed under such
//!   a CPU's walk-cache entry of another ASID. The oracle remembers both;
//! - when the CPU loads that ASID again (the mock's
//!   `switch_address_space`, after the crate's catch-up), each remembered
//!   entry still in its TLB is a [`Violation::LoadedWithStale`] (a
//!   [`Violation::LoadedWithStaleWalk`] for a walk-cache entry): the CPU
//!   skipped the flush it owed, and translates to a freed or reused frame.
//!   A kernel that loads a root without `switch_mm` is caught this way.

use core::sync::atomic::Ordering;
use std::vec::Vec;

pub use crate::sim::*;

use crate::arch::{Arch, Asid};
use crate::cpuset::{CpuId, CpuSet};
use crate::page_size::PageSize;
use crate::percpu::TlbShootdown;
use crate::pte::PAGE_SHIFT;
use crate::request::FlushRequest;
use crate::sim::{lock, BroadcastOp, WalkFlush};
use crate::stats::TraceEvent;
use crate::Error;

// SAFETY: each MockCpu reports its own id; the online CPUs are the ones in
// the machine's online set, all of which answer IPIs (synchronously or from
// their threads), and a CPU joins it through `come_online`, which runs
// `prepare_cpu_online` first, and leaves it through `take_offline`, which
// runs `take_cpu_offline` (the raw `set_online` is the documented way to
// model a kernel that does neither); local flushes edit this CPU's modelled TLB before returning;
// `send_flush_ipi` runs or queues `handle_flush_ipi` for each target; every
// CPU of one machine returns the machine's single `TlbShootdown`; the
// constants come from the model, which the simulated hardware obeys; the
// broadcast operations reach every CPU's TLB at `broadcast_sync`.
unsafe impl<M: Model> Arch for MockCpu<'_, M> {
    const CLEAN_WRITE_REWALK: bool = M::CLEAN_WRITE_REWALK;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = M::ACCESSED_CLEAR_NEEDS_FLUSH;
    const FILL_SETS_ACCESSED: bool = M::FILL_SETS_ACCESSED;
    const BROADCAST_INVALIDATE: bool = M::BROADCAST_INVALIDATE;
    const BATCH_BROADCAST_ON_ADD: bool = M::BATCH_BROADCAST_ON_ADD;

    fn current_cpu(&self) -> Result<CpuId, Error> {
        Ok(self.id)
    }

    fn online_cpus(&self) -> CpuSet {
        self.machine.online()
    }

    fn root_loaded(&self, root: u64) -> Option<bool> {
        Some(lock(&self.state().loaded).is_some_and(|(_, r)| r == root))
    }

    fn shootdown_state(&self) -> &TlbShootdown {
        &self.machine.shootdown
    }

    fn tagged_tlb(&self) -> bool {
        self.machine.config.tagged_tlb
    }

    fn kernel_flush_needs_global(&self) -> bool {
        // A kernel page flush removes the loaded ASID's entry and the
        // global one, as INVLPG does (the machine's own kernel mappings are
        // always global).
        self.machine.config.tagged_tlb
    }

    fn va_bits(&self) -> u32 {
        self.machine.config.va_bits
    }

    fn asid_bits(&self) -> u32 {
        self.machine.config.asid_bits
    }

    fn flush_local_page(&self, asid: Asid, va: u64) {
        self.flush_page_hinted(asid, va, None);
    }

    fn flush_local_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
        self.flush_page_hinted(asid, va, leaf.filter(|_| self.machine.config.level_hints));
    }

    fn base_page(&self) -> PageSize {
        self.machine.config.base_page
    }

    fn flush_local_asid(&self, asid: Asid) {
        let m = self.machine;
        m.charge(self.id, CostKind::FullFlush, m.config.cost.full_flush);
        self.flush_delay();
        lock(&self.state().tlb).invalidate_asid(asid);
    }

    fn flush_local_all(&self, include_global: bool) {
        let m = self.machine;
        m.charge(self.id, CostKind::FullFlush, m.config.cost.full_flush);
        self.flush_delay();
        lock(&self.state().tlb).invalidate_all(include_global);
    }

    fn send_flush_ipi(&self, targets: &CpuSet) {
        self.send_ipis(targets);
    }

    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        self.switch_root(asid, root);
    }

    fn broadcast_flush_page(&self, asid: Asid, va: u64) {
        self.broadcast(BroadcastOp::Page(asid, va >> PAGE_SHIFT, None));
    }

    fn broadcast_flush_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
        let leaf = leaf.filter(|_| self.machine.config.level_hints);
        self.broadcast(BroadcastOp::Page(asid, va >> PAGE_SHIFT, leaf));
    }

    fn broadcast_flush_asid(&self, asid: Asid) {
        self.broadcast(BroadcastOp::Asid(asid));
    }

    fn broadcast_flush_all(&self, include_global: bool) {
        self.broadcast(BroadcastOp::All(include_global));
    }

    fn prefer_broadcast(&self, remote_cpus: usize, _request: &FlushRequest) -> bool {
        remote_cpus >= self.machine.config.broadcast_min_remote
    }

    fn broadcast_sync(&self) {
        self.sync_broadcasts();
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

impl<M: Model> MockCpu<'_, M> {
    /// A local page invalidation, honouring `leaf` as a level hint (see
    /// [`MockConfig::level_hints`]; the caller filtered it).
    fn flush_page_hinted(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
        let m = self.machine;
        m.charge(self.id, CostKind::Invlpg, m.config.cost.invlpg);
        self.flush_delay();
        let vpn = va >> PAGE_SHIFT;
        let current = lock(&self.state().loaded).map(|(a, _)| a);
        let mut tlb = lock(&self.state().tlb);
        // INVLPG takes every walk-cache entry of the loaded ASID on x86; a
        // local TLBI VAE1 those on the way to the page.
        let invlpg = if M::PAGE_FLUSH_DROPS_ASID_WALKS {
            WalkFlush::WholeAsid
        } else {
            WalkFlush::Covering
        };
        if asid.is_kernel() {
            // INVLPG: the current ASID's entry and a global one, nothing of
            // the other ASIDs a tagged TLB keeps.
            tlb.invalidate_va_hinted(current.unwrap_or(Asid::KERNEL), vpn, true, invlpg, leaf);
        } else if current == Some(asid) || !m.config.tagged_tlb {
            tlb.invalidate_va_hinted(asid, vpn, true, invlpg, leaf);
        } else {
            // INVPCID by address in an ASID that is not loaded: global
            // entries stay, and only the walk-cache entries on the way to
            // the page go (see `Tlb::invalidate_va`).
            tlb.invalidate_va_hinted(asid, vpn, false, WalkFlush::Covering, leaf);
        }
    }

    fn send_ipis(&self, targets: &CpuSet) {
        let m = self.machine;
        for t in targets.iter() {
            if t.index() >= m.cpus.len() || !m.is_online(t) {
                // A CPU the machine does not have, or one that is offline:
                // nobody is there to take it.
                m.ipis_lost.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            m.ipis_sent.fetch_add(1, Ordering::Relaxed);
            m.charge(self.id, CostKind::IpiSend, m.config.cost.ipi_send);
            let target = MockCpu { machine: m, id: t };
            match m.config.delivery {
                Delivery::Synchronous => target.take_interrupt(),
                Delivery::Threaded => target.state().irq_pending.store(true, Ordering::SeqCst),
            }
        }
    }

    fn switch_root(&self, asid: Asid, root: u64) {
        {
            // Not inside a free's judgement, which asks what is loaded.
            let _transition = self.machine.transition();
            *lock(&self.state().loaded) = Some((asid, root));
            if !self.machine.config.tagged_tlb {
                // An untagged TLB loses every non-global entry on a switch.
                self.flush_local_all(false);
            } else if !asid.is_kernel() {
                // Entries of this ASID cached for frames freed while it was
                // not loaded are usable again from here: the catch-up must
                // have dropped them.
                self.judge_load(asid);
            }
        }
        // The CR3 window: the new root is loaded and may be walked, and
        // `switch_mm` has not finished its bookkeeping. No lock is held
        // here, so the hook may use this CPU and any other.
        self.machine.run_switch_hook(self);
    }

    fn sync_broadcasts(&self) {
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
                    // By ASID and address, global entries included (TLBI
                    // VAE1IS); the kernel's pages in every ASID (VAAE1IS).
                    BroadcastOp::Page(asid, vpn, leaf) if asid.is_kernel() => {
                        tlb.invalidate_va_all_asids_hinted(vpn, leaf)
                    }
                    BroadcastOp::Page(asid, vpn, leaf) => {
                        tlb.invalidate_va_hinted(asid, vpn, true, WalkFlush::Covering, leaf)
                    }
                    BroadcastOp::Asid(asid) => tlb.invalidate_asid(asid),
                    BroadcastOp::All(g) => tlb.invalidate_all(g),
                }
            }
        }
    }
}
