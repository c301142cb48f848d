//! The aarch64 implementation of [`Arch`], for an ARMv8-A kernel running at
//! EL1 with the 4, 16 or 64 KiB translation granule: `TLBI` by address, by ASID and for everything,
//! broadcast to every CPU by the hardware (the `IS` forms) instead of by
//! interrupts, ASIDs in TTBR0_EL1, and a CPU table keyed by MPIDR_EL1.
//!
//! # Bring-up
//!
//! A kernel keeps one [`CpuTable`] and one [`TlbShootdown`] in statics and
//! builds an [`Aarch64`] value (one can serve every CPU: it holds nothing
//! per CPU). In order:
//!
//! 1. the boot CPU reads its MMU setup ([`Config::detect`], or
//!    [`Config::new`] with values it chose; either is checked), and
//!    [registers](CpuTable::register) every CPU's index and MPIDR (from
//!    the ACPI MADT or the devicetree) before starting it;
//! 2. each CPU, itself, with interrupts masked, its MMU on with the same
//!    TCR_EL1 as the boot CPU's, and its interrupt controller routing the
//!    IPI the kernel's hook sends to a handler that calls
//!    [`Aarch64::flush_ipi_entry`], calls [`Aarch64::bring_online`]: it
//!    flushes the CPU's whole TLB, joins the set of CPUs that shootdowns
//!    reach, and flushes again. An unregistered CPU is refused there
//!    ([`Error::UnregisteredCpu`]), and so is every crate call made on
//!    one later (the same error, nothing changed) rather than act as
//!    another CPU; a registered CPU that is not online yet is refused by
//!    every call that flushes or loads a user space
//!    ([`Error::CpuNotOnline`]);
//! 3. a CPU that goes offline calls [`Aarch64::take_offline`] on itself,
//!    with interrupts masked and an address space loaded whose tables stay
//!    (the kernel's): it leaves the online set once no IPI sync can still
//!    wait for it, and then parks (or calls PSCI CPU_OFF), running nothing
//!    that uses its TLB, until it comes back through
//!    [`Aarch64::bring_online`].
//!
//! What the kernel sets up, on every CPU, before the first crate call:
//!
//! - TCR_EL1: TG0 and TG1 select the same granule, 4, 16 or 64 KiB, one
//!   the CPU implements (it is the crate's [`base_page`](Arch::base_page):
//!   addresses and ranges are refused unless aligned to it, and every
//!   range is flushed one `TLBI` per page of it); T0SZ and T1SZ from 16 to
//!   39 (48- to 25-bit regions); a kernel that runs from TTBR0 alone with
//!   TTBR1 walks off (EPD1 = 1) may leave TG1 and T1SZ at any value; A1 =
//!   0, so the ASID comes from TTBR0 and
//!   one register write changes root and ASID together; AS = 1 for 16-bit
//!   ASIDs when ID_AA64MMFR0_EL1.ASIDBits says the CPU has them (8-bit
//!   ASIDs otherwise). [`Config::from_registers`] refuses any other
//!   setup. HA and HD (hardware access flag and dirty state, FEAT_HAFDBS)
//!   may be on or off: see the capabilities below for what the crate
//!   requires either way.
//! - SCTLR_EL1.M = 1 (stage 1 translation on), with the translation tables
//!   in Normal Inner Shareable write-back memory (TCR_EL1's IRGNn, ORGNn
//!   and SHn say so for the walks), as any SMP kernel has them.
//! - Kernel mappings in the TTBR1 tables; user address spaces in TTBR0
//!   tables, loaded only through
//!   [`switch_mm`](crate::switch_mm) (which calls
//!   [`switch_address_space`](Arch::switch_address_space)): TTBR1 is never
//!   touched here. Kernel pages (the upper half, which TTBR1 translates)
//!   are unmapped and flushed through the kernel's
//!   [`MmTlbState::kernel`](crate::MmTlbState::kernel); a user space's
//!   operations refuse them ([`Error::KernelHalf`]).
//! - The kernel runs at EL1. Under a hypervisor, the hypervisor keeps the
//!   `TLBI` semantics for the virtual CPUs (as KVM does when it moves a
//!   virtual CPU). A kernel at EL2 with FEAT_VHE is not served: there the
//!   EL1 `TLBI`s this module issues would act on another translation
//!   regime.
//!
//! # What each flush executes
//!
//! | flush | this CPU only | every CPU (broadcast) |
//! | --- | --- | --- |
//! | one page of a user ASID | `DSB NSHST`; `TLBI VAE1`; `DSB NSH`; `ISB` | `DSB ISHST`; `TLBI VAE1IS` per page; then once `DSB ISH`; `ISB` |
//! | one kernel page | `DSB NSHST`; `TLBI VAAE1`; `DSB NSH`; `ISB` | `DSB ISHST`; `TLBI VAAE1IS` per page; then once `DSB ISH`; `ISB` |
//! | a user ASID | `DSB NSHST`; `TLBI ASIDE1`; `DSB NSH`; `ISB` | `DSB ISHST`; `TLBI ASIDE1IS`; `DSB ISH`; `ISB` |
//! | everything (and the kernel's ASID) | `DSB NSHST`; `TLBI VMALLE1`; `DSB NSH`; `ISB` | `DSB ISHST`; `TLBI VMALLE1IS`; `DSB ISH`; `ISB` |
//! | a [`TlbFlushUnmapBatch`](crate::TlbFlushUnmapBatch) | - | on each add: `DSB ISHST`; `TLBI VAE1IS`; at the flush: `DSB ISH`; `ISB` |
//!
//! Batched unmaps follow Linux's arm64 shape
//! ([`BATCH_BROADCAST_ON_ADD`](Arch::BATCH_BROADCAST_ON_ADD) is true):
//! each page's `TLBI` is issued, without waiting, by the call that adds
//! the page to the batch, right after its entry was cleared, and the
//! batch's flush executes only the `DSB ISH` that waits for them all (and
//! the `ISB`), however many pages it holds; past the full-flush ceiling
//! too, since the invalidations are already on their way. A `DSB`
//! completes only the invalidations of the CPU that executes it, so when
//! a batch is flushed on a CPU other than the one (or ones) that filled
//! it (its task moved), the flush issues the batch's invalidations again
//! from the flushing CPU, as an ordinary broadcast shootdown, before it
//! waits.
//!
//! The barriers, in the order they run:
//!
//! - `DSB ISHST` (or `NSHST` for a local flush) before a `TLBI`: this
//!   CPU's earlier stores, the cleared page-table entries among them, are
//!   complete, so that no walk after the invalidation can read the old
//!   entry and cache it again. A `TLBI` is not a memory access, so the
//!   release/acquire orderings of Rust atomics do not order it; only a
//!   `DSB` does. Entries cleared by *another* CPU reached this one through
//!   an atomic it released them with and this CPU acquired (the crate's
//!   pending-flush generations, a shootdown request); a `TLBI` is never
//!   executed speculatively, so it runs after that acquire returned, and
//!   the crate relies on those stores then being visible to every
//!   observer, walks included, as AArch64's other-multi-copy-atomic
//!   memory model provides.
//! - `DSB ISH` after the broadcast `TLBI`s: returns once every CPU of the
//!   Inner Shareable domain has dropped the entries and finished the
//!   memory accesses that used them, which is the moment a frame may be
//!   freed or handed to I/O. One `DSB` completes every `TLBI` issued
//!   before it, so a flush of many pages waits once.
//! - `DSB NSH` after a local `TLBI`: the same, for this CPU alone.
//! - `ISB` last: instructions already fetched, or translated, under the
//!   old entries are fetched again, so that this CPU's own next
//!   instructions (kernel text included) use the new translations.
//!
//! Page flushes use `VAE1`, which also drops cached intermediate entries
//! (walk caches) for the address, not the leaf-only `VALE1`: the crate
//! flushes the range of a page-table frame it frees through the same
//! page flushes ([`MmuGather`](crate::MmuGather)), and a walk cache that
//! still pointed into the freed frame would read whatever is written there
//! next. `VALE1IS` would save the hardware some work for the leaf entries
//! that reclaim clears, but a page flush does not say which kind it is
//! ([`tlbi_vale1is`] is here for kernels that know).
//!
//! With FEAT_TTL ([`Config::with_level_hints`], which [`Config::detect`]
//! reads from ID_AA64MMFR2_EL1), a page invalidation carries the level
//! hint (operand bits \[47:44\]) when the crate knows the leaf entry it
//! removes: a page or block of the granule whose size the page table
//! reported ([`flush_local_page_sized`](Arch::flush_local_page_sized)),
//! in a flush that frees no page table. Anything else (a range the kernel
//! named, a freed table's span, a size that is no page or block of the
//! granule) goes without one, since the Arm ARM lets a `TLBI` with a
//! wrong hint invalidate nothing (see `aarch64_granule.rs`).
//!
//! Kernel pages ([`Asid::KERNEL`]) are invalidated in every ASID (`VAAE1`,
//! `VMALLE1`): that reaches global entries, and non-global kernel entries
//! too, which a kernel that unmaps itself from user space (as Linux's KPTI
//! does) has, tagged with whatever ASID was loaded. There is no EL1
//! invalidation of every ASID that spares global entries, so a flush of
//! everything always drops them too.
//!
//! # Capabilities, and why
//!
//! - [`BROADCAST_INVALIDATE`](Arch::BROADCAST_INVALIDATE) is true, and the
//!   trait's [`prefer_broadcast`](Arch::prefer_broadcast) (always) is kept:
//!   every shootdown is a broadcast, and no flush IPI is ever sent for
//!   one. [`BATCH_BROADCAST_ON_ADD`](Arch::BATCH_BROADCAST_ON_ADD) is
//!   true (above). [`send_flush_ipi`](Arch::send_flush_ipi) is still reached by
//!   [`ipi_sync`](crate::ipi_sync), which
//!   [`TableFreePolicy::IpiSync`](crate::TableFreePolicy) uses to wait out
//!   lockless page-table walkers (an invalidation interrupts nobody, so it
//!   cannot), so it calls the IPI hook the kernel gives to
//!   [`Aarch64::new`].
//! - [`tagged_tlb`](Arch::tagged_tlb) is true: entries carry the ASID
//!   loaded in TTBR0 and survive switches. A kernel gives each live
//!   address space its own ASID (1 to `2^asid_bits - 1`, at most `0xfffe`
//!   since `u16::MAX` is [`Asid::KERNEL`](crate::Asid::KERNEL); 0 is the
//!   kernel's own TTBR0 tables). A CPU keeps a space's entries after it
//!   switched away and leaves the space's CPU set; [`switch_mm`](crate::switch_mm)
//!   flushes the ASID locally before loading it again if the space's
//!   generation moved, and at the first load of a new
//!   [`MmTlbState`](crate::MmTlbState), so a retired space's ASID may go
//!   to a new one without a flush of its own (see
//!   [`generation`](crate::generation)).
//! - [`CLEAN_WRITE_REWALK`](Arch::CLEAN_WRITE_REWALK) is true. On aarch64
//!   a write never goes through a TLB entry made from a clean descriptor
//!   without the page table in memory being consulted again: a clean page
//!   is mapped read-only (AP\[2\] = 1), so the write either raises a
//!   Permission fault (hardware dirty state off, or DBM clear), which the
//!   kernel's fault handler resolves from the entry in memory, now gone;
//!   or, with TCR_EL1.HD = 1 and DBM set, the hardware marks the entry
//!   dirty by an atomic compare-and-swap of the descriptor in memory
//!   against the value it translated with, and when that value has
//!   changed it translates again from the tables, finds the cleared
//!   entry and faults. (Arm ARM, "Hardware management of the dirty
//!   state", and its pseudocode: `AArch64.S1Translate` repeats the walk
//!   until `AArch64.MemSwapTableDesc`, which writes only when memory still
//!   holds the old descriptor, succeeds.) What the crate requires for
//!   this, with or without FEAT_HAFDBS: a descriptor the hardware lets
//!   writes through (AP\[2\] = 0) is one the kernel's
//!   [`PageTable`](crate::PageTable) reports dirty, and clean writable
//!   pages are mapped read-only (with DBM when HD is on), as Linux maps
//!   them; the kernel's fault handler re-reads the entry under the
//!   page-table lock before it marks anything dirty.
//! - [`ACCESSED_CLEAR_NEEDS_FLUSH`](Arch::ACCESSED_CLEAR_NEEDS_FLUSH) is
//!   true. A TLB entry made while the access flag was set is used without
//!   looking at the descriptor again, so after the flag is cleared a page
//!   in use through a cached entry keeps looking unused until the entry
//!   leaves the TLB; with ASIDs, entries survive context switches and can
//!   stay for a long time, and reclaim would evict hot pages. Linux's
//!   arm64 `ptep_clear_flush_young` invalidates for this reason (without
//!   waiting for completion). Here the invalidation is recorded in the
//!   caller's batch and rides with its next flush; it only ever costs
//!   aging accuracy if missed (contract rule 8).
//! - [`fill_sets_accessed`](Arch::fill_sets_accessed) stays false. Without
//!   hardware access-flag management (TCR_EL1.HA = 0) the guarantee holds:
//!   a descriptor with AF = 0 raises an Access flag fault, and the Arm ARM
//!   lets a TLB cache only descriptors that raise no Translation, Address
//!   size or Access flag fault (Arm's AArch64 memory-management guide says
//!   it plainly: a TLB never holds an entry whose Access flag is 0). With
//!   HA = 1 such a descriptor raises no fault, so the same rule permits
//!   caching it, and no statement was found that the hardware has written
//!   AF = 1 to memory before such an entry exists or is used (the
//!   pseudocode sets it during an access's translation, but TLBs may be
//!   filled by speculative walks at any time). [`Config`] does not say
//!   which of the two a kernel runs, so the answer is false for both; the
//!   cost is that [`FramePool`](crate::FramePool) generations wait for
//!   flushes after the unmap instead of using aging epochs.
//!
//! The crate therefore needs nothing of FEAT_HAFDBS and refuses nothing
//! without it: with HA and HD off the kernel handles Access flag and
//! Permission faults (it must, for the same reasons, on any ARMv8.0 CPU).
//!
//! # CPUs with repeat-TLBI errata
//!
//! On CPUs whose errata need every `TLBI` issued twice (Linux's
//! ARM64_WORKAROUND_REPEAT_TLBI), the kernel builds its [`Config`] with
//! [`Config::with_repeated_tlbi`]: each `TLBI` is followed by `DSB ISH`
//! and the same `TLBI` again.
//!
//! The instruction wrappers are small functions, one instruction each;
//! they are public so that a kernel can use the same, documented ones.
//!
//! This file holds the [`Aarch64`] `Arch` itself: bring-up, the flush-IPI
//! entry point, and which sequence each flush runs. The sequences
//! themselves live in `aarch64_sequences.rs`, the wrappers in
//! `aarch64_instructions.rs`, the arithmetic in `aarch64_encoding.rs` and
//! the CPU table in `aarch64_cpus.rs`; everything public in them is
//! re-exported here.

use core::sync::atomic::{fence, Ordering};

pub use super::aarch64_cpus::CpuTable;
pub use super::aarch64_encoding::{
    mpidr_affinity, tlbi_asid_operand, tlbi_va_operand, ttbr0_base, ttbr0_value, Config, Unsupported,
    MAX_REGION_BITS, MIN_REGION_BITS,
};
use super::aarch64_encoding::{needs_flush_on_load, ttbr0_asid};
pub use super::aarch64_granule::{tlbi_va_operand_for, ttl_hint};
pub use super::aarch64_instructions::{
    dsb_ish, dsb_ishst, dsb_nsh, dsb_nshst, isb, read_id_aa64mmfr0_el1, read_id_aa64mmfr2_el1,
    read_mpidr_el1, read_tcr_el1, read_ttbr0_el1, tlbi_aside1, tlbi_aside1is, tlbi_vaae1, tlbi_vaae1_operand,
    tlbi_vaae1is, tlbi_vaae1is_operand, tlbi_vae1, tlbi_vae1_operand, tlbi_vae1is, tlbi_vae1is_operand,
    tlbi_vale1is, tlbi_vmalle1, tlbi_vmalle1is, write_ttbr0_el1,
};
use super::aarch64_sequences::Tlbi;
use crate::arch::{Arch, Asid};
use crate::cpuset::{CpuId, CpuSet};
use crate::page_size::PageSize;
use crate::percpu::TlbShootdown;
use crate::Error;

/// The hook through which [`Aarch64`] sends the flush IPI: it interrupts
/// every CPU of the set (never the caller) on the interrupt whose handler
/// calls [`Aarch64::flush_ipi_entry`]. On GICv3 that is an SGI written to
/// ICC_SGI1R_EL1, addressed with [`CpuTable::affinity`].
pub type SendIpi = fn(targets: &CpuSet);

/// The aarch64 [`Arch`]: the running CPU is found by its MPIDR_EL1 in a
/// [`CpuTable`]; flushes are `TLBI` instructions, broadcast by the hardware
/// to every CPU, so no shootdown needs an interrupt (the module
/// documentation lists each sequence and why its barriers are there).
///
/// ASIDs are the hardware's (8 or 16 bits, from the [`Config`]): every
/// entry point refuses a wider one ([`Error::AsidOutOfRange`]), the kernel
/// address space runs with ASID 0 in TTBR0, and a retired address space's
/// ASID may go to a new one once no CPU runs the old one, lazily included
/// ([`switch_mm`](crate::switch_mm) flushes it at the new space's first
/// load on each CPU). Addresses are checked against the wider region of
/// TCR_EL1 ([`Config::va_bits`]) before any reaches a `TLBI`; a tagged
/// pointer (TBI) must be stripped of its tag first.
///
/// # A CPU it cannot tell
///
/// On a CPU whose MPIDR is not registered in the [`CpuTable`] (which
/// breaks [`new`](Self::new)'s contract), [`current_cpu`](Arch::current_cpu)
/// answers [`Error::UnregisteredCpu`] (with the packed affinity), and every
/// crate function run with this `Arch` passes that error on with nothing
/// changed: any CPU index would name another CPU.
/// [`bring_online`](Self::bring_online) reports the same mistake when the
/// CPU comes up.
#[derive(Clone, Copy)]
pub struct Aarch64 {
    cpus: &'static CpuTable,
    state: &'static TlbShootdown,
    send_ipi: SendIpi,
    pub(super) config: Config,
}

impl Aarch64 {
    /// The `Arch` for this machine.
    ///
    /// # Safety
    ///
    /// - The value is used at EL1 (not EL2), with stage 1 translation on
    ///   and the setup `config` describes on every CPU (and, on CPUs with
    ///   repeat-TLBI errata, `config` asks for repeated `TLBI`s).
    /// - Every CPU that runs crate code or may hold TLB entries is
    ///   registered in `cpus`, and all of them are in one Inner Shareable
    ///   domain (as the CPUs of an SMP system are), so that a broadcast
    ///   `TLBI` reaches each of them.
    /// - `send_ipi` interrupts each CPU it is given, and that CPU's
    ///   handler calls [`flush_ipi_entry`](Self::flush_ipi_entry); a CPU
    ///   calls [`bring_online`](Self::bring_online) only once that handler
    ///   is in place.
    /// - User address spaces are translated by TTBR0 tables, loaded only
    ///   through this value; no user address space is loaded with ASID 0.
    /// - A descriptor that lets writes through (AP\[2\] = 0) is one the
    ///   kernel's [`PageTable`](crate::PageTable) reports dirty: clean
    ///   writable pages are mapped read-only (with DBM set when TCR_EL1.HD
    ///   is on), and the kernel's Permission-fault handler re-reads the
    ///   entry under its lock before it makes one writable. This is what
    ///   [`CLEAN_WRITE_REWALK`](Arch::CLEAN_WRITE_REWALK) rests on (see
    ///   the module documentation).
    pub const unsafe fn new(
        cpus: &'static CpuTable,
        state: &'static TlbShootdown,
        send_ipi: SendIpi,
        config: Config,
    ) -> Self {
        Aarch64 {
            cpus,
            state,
            send_ipi,
            config,
        }
    }

    /// Brings the running CPU into the online set, the set that shootdowns
    /// reach: call it once on each CPU as it comes up (and again when it
    /// comes back after going offline), with interrupts masked, after it
    /// was [registered](CpuTable::register) and its interrupt controller
    /// routes the flush IPI. This is the only way a CPU joins the online
    /// set.
    ///
    /// A CPU outside the online set was never told of any flush, so it may
    /// hold stale entries of any address space. It flushes everything
    /// ([`prepare_cpu_online`](crate::prepare_cpu_online)) before joining,
    /// as [`Arch`]'s contract requires, and once more right after: the
    /// hardware may fill its TLB speculatively at any time, and an entry
    /// filled between the first flush and the join, for a page whose
    /// shootdown read the online set just before the join, would otherwise
    /// escape both. (A broadcast invalidation reaches a CPU whether it is
    /// online or not, but a shootdown whose only online target was its own
    /// CPU is a local flush, which does not.)
    ///
    /// Errors: [`Error::UnregisteredCpu`] (with the packed affinity) when
    /// this CPU's MPIDR is not in the table, [`Error::AlreadyOnline`] when
    /// it is online already; nothing changes, and the CPU must not run
    /// crate code (an online one goes on as it was).
    pub fn bring_online(&self) -> Result<CpuId, Error> {
        // SAFETY: EL1 (constructor contract).
        let mpidr = unsafe { read_mpidr_el1() };
        let cpu = self.cpus.cpu_of(mpidr).ok_or(Error::UnregisteredCpu {
            hw_id: mpidr_affinity(mpidr),
        })?;
        crate::prepare_cpu_online(self)?;
        self.cpus.join(cpu);
        // The join is visible (SeqCst) before the second flush starts.
        fence(Ordering::SeqCst);
        self.flush_local_all(true);
        self.state.count(crate::stats::Counter::LocalFullFlushes, 1);
        Ok(cpu)
    }

    /// Takes the running CPU out of the online set, the way back from
    /// [`bring_online`](Self::bring_online): call it on the CPU that goes
    /// offline, from the kernel's offline path (not from an interrupt
    /// handler), with interrupts masked, after the CPU loaded an address
    /// space whose page tables stay while it is away, normally the
    /// kernel's ([`switch_mm`](crate::switch_mm) to the kernel's
    /// [`MmTlbState`](crate::MmTlbState)). It leaves the set, then serves
    /// every request that reaches it (with this `Arch`, those of
    /// [`ipi_sync`](crate::ipi_sync)) until no initiator that saw it online
    /// can still send one ([`take_cpu_offline`](crate::take_cpu_offline)),
    /// and returns how many it served on its way out. When it returns
    /// `Ok`, no [`ipi_sync`](crate::ipi_sync) and no
    /// [`FramePool`](crate::FramePool) generation waits for this CPU, and a
    /// flush whose only online target is the caller is done locally even
    /// when this CPU still caches the pages.
    ///
    /// So after `Ok` the CPU's TLB may keep entries for pages that are
    /// unmapped and freed while it is away (broadcast `TLBI`s still reach
    /// it while it is powered, local flushes do not). The kernel runs
    /// nothing on it that could use them: no user code, no crate function,
    /// no access to memory that may be unmapped, no interrupt handler (it
    /// parks with interrupts masked, or calls PSCI CPU_OFF). It comes back
    /// only through [`bring_online`](Self::bring_online), which flushes
    /// everything before it rejoins; an IPI still pending at its interrupt
    /// controller then finds nothing to do.
    ///
    /// Errors, with nothing changed (the CPU stays as it was):
    /// [`Error::UnregisteredCpu`] (with the packed affinity) when this
    /// CPU's MPIDR is not in the table; [`Error::CpuNotOnline`] when it is
    /// not online (it never came up, or already left);
    /// [`Error::ShootdownReentered`] when the call comes from an interrupt
    /// that interrupted a shootdown or IPI sync of this CPU's own, which
    /// would stay unfinished; [`Error::UserSpaceLoaded`] when its last
    /// `switch_mm` loaded a user space (switch to the kernel's first).
    pub fn take_offline(&self) -> Result<usize, Error> {
        // SAFETY: EL1 (constructor contract).
        let mpidr = unsafe { read_mpidr_el1() };
        let cpu = self.cpus.cpu_of(mpidr).ok_or(Error::UnregisteredCpu {
            hw_id: mpidr_affinity(mpidr),
        })?;
        crate::take_cpu_offline(self, |me| me == cpu && self.cpus.leave(cpu))
    }

    /// The flush-IPI entry point: call it from the handler of the
    /// interrupt the [`SendIpi`] hook sends, on the interrupted CPU, with
    /// interrupts still masked; the kernel acknowledges and ends the
    /// interrupt at its controller as it does for any other. It serves
    /// every request waiting for this CPU
    /// ([`handle_flush_ipi`](crate::handle_flush_ipi)) and returns how many
    /// (zero is normal: a waiting initiator may have served them). With
    /// this `Arch` the only requests are those of
    /// [`ipi_sync`](crate::ipi_sync).
    pub fn flush_ipi_entry(&self) -> usize {
        crate::shootdown::handle_flush_ipi(self)
    }

    /// The CPU table.
    pub fn cpus(&self) -> &'static CpuTable {
        self.cpus
    }

    /// The MMU setup given to [`new`](Self::new).
    pub fn config(&self) -> Config {
        self.config
    }
}

// SAFETY: the constructor's contract registers every CPU that may cache
// translations, puts them all in one Inner Shareable domain and routes the
// IPI hook to the crate's handler; each local flush ends with DSB NSH, so
// its TLBI is complete when it returns; broadcast TLBIs reach every CPU
// and complete at broadcast_sync's DSB ISH; ASIDs wider than the
// hardware's never reach a by-ASID TLBI (the all-ASID forms are used);
// TTBR0 loads root and ASID in one write (TCR_EL1.A1 = 0, checked by
// Config); the constants hold on aarch64 as the module documentation
// explains (CLEAN_WRITE_REWALK with the descriptor rule of the
// constructor's contract).
unsafe impl Arch for Aarch64 {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = true;
    const FILL_SETS_ACCESSED: bool = false;
    const BROADCAST_INVALIDATE: bool = true;
    const BATCH_BROADCAST_ON_ADD: bool = true;

    fn current_cpu(&self) -> Result<CpuId, Error> {
        // SAFETY: EL1 (constructor contract).
        let mpidr = unsafe { read_mpidr_el1() };
        self.cpus.cpu_of(mpidr).ok_or(Error::UnregisteredCpu {
            hw_id: mpidr_affinity(mpidr),
        })
    }

    fn root_loaded(&self, root: u64) -> Option<bool> {
        // SAFETY: EL1 (constructor contract).
        let ttbr = unsafe { read_ttbr0_el1() };
        Some(ttbr0_base(ttbr) == ttbr0_base(root))
    }

    fn online_cpus(&self) -> CpuSet {
        self.cpus.online()
    }

    fn shootdown_state(&self) -> &TlbShootdown {
        self.state
    }

    fn tagged_tlb(&self) -> bool {
        true
    }

    fn va_bits(&self) -> u32 {
        self.config.va_bits()
    }

    fn asid_bits(&self) -> u32 {
        self.config.asid_bits()
    }

    fn flush_local_page(&self, asid: Asid, va: u64) {
        self.local(self.page_op(asid, va, None, false));
    }

    fn flush_local_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
        self.local(self.page_op(asid, va, leaf, false));
    }

    fn base_page(&self) -> PageSize {
        self.config.granule()
    }

    fn flush_local_asid(&self, asid: Asid) {
        self.local(self.asid_op(asid, false));
    }

    fn flush_local_all(&self, _include_global: bool) {
        // No EL1 invalidation of every ASID spares global entries: this one
        // drops them too, which is more than asked and always allowed.
        self.local(Tlbi::Vmalle1);
    }

    fn send_flush_ipi(&self, targets: &CpuSet) {
        (self.send_ipi)(targets);
    }

    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        let hw = ttbr0_asid(asid, self.config.asid_bits());
        // The tables this CPU just wrote are visible to the walks that the
        // new root may start as soon as it is loaded.
        dsb_ishst();
        // SAFETY: the caller guarantees `root` is a valid table; the ASID
        // is its address space's own (or 0, dropped below).
        unsafe { write_ttbr0_el1(ttbr0_value(root, hw)) };
        // The new root and ASID govern every later instruction's
        // translations.
        isb();
        if needs_flush_on_load(hw) {
            // ASID 0 is shared by the kernel's tables and by ASIDs too
            // wide for the hardware (only a direct call gets one): what a
            // previous root left under it must not be used with this one.
            self.local(Tlbi::Aside1(0));
        }
    }

    fn broadcast_flush_page(&self, asid: Asid, va: u64) {
        self.broadcast(self.page_op(asid, va, None, true));
    }

    fn broadcast_flush_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
        self.broadcast(self.page_op(asid, va, leaf, true));
    }

    fn broadcast_flush_asid(&self, asid: Asid) {
        self.broadcast(self.asid_op(asid, true));
    }

    fn broadcast_flush_all(&self, _include_global: bool) {
        // As for `flush_local_all`: global entries go too.
        self.broadcast(Tlbi::Vmalle1is);
    }

    fn broadcast_sync(&self) {
        // Every TLBI ... IS issued before it has taken effect on every CPU
        // of the Inner Shareable domain, including the memory accesses
        // that used the dropped entries...
        dsb_ish();
        // ...and this CPU's next instructions use the new translations.
        isb();
    }
}
