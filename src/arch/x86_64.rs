//! The x86_64 implementation of [`Arch`]: `invlpg`, `INVPCID` and CR3/CR4
//! flushes, PCID-tagged address spaces, and flush IPIs through the local
//! APIC in xAPIC (MMIO) or x2APIC (MSR) mode.
//!
//! A kernel sets up one [`CpuTable`] and one [`TlbShootdown`] in statics
//! and builds an [`X86_64`] value per CPU (or one shared value: it holds
//! nothing per CPU). Bring-up, in order:
//!
//! 1. the boot CPU [registers](CpuTable::register) every CPU's index and
//!    APIC ID before starting it (a duplicate or reserved ID is refused),
//!    and records how many processors the firmware lists
//!    ([`CpuTable::set_present`]);
//! 2. each CPU, itself, with interrupts off and its IDT routing the flush
//!    vector to a handler that calls [`X86_64::flush_ipi_entry`], calls
//!    [`X86_64::bring_online`]: it flushes its whole TLB and joins the set
//!    of CPUs that shootdowns reach. An unregistered CPU is refused there
//!    ([`Error::UnregisteredCpu`]), and so is every crate call made on
//!    one later (the same error, nothing changed) rather than act as
//!    another CPU; a registered CPU that is not online yet is refused by
//!    every call that flushes or loads a user space
//!    ([`Error::CpuNotOnline`]);
//! 3. a CPU that goes offline calls [`X86_64::take_offline`] on itself,
//!    with interrupts off and an address space loaded whose tables stay
//!    (the kernel's): it leaves the online set once no shootdown can still
//!    wait for it, and then parks, running nothing that uses its TLB,
//!    until it comes back through [`X86_64::bring_online`].
//!
//! Flush IPIs name each destination, except when the targets are every
//! other CPU and every present CPU is online: then one all-but-self IPI
//! reaches exactly them.
//!
//! # What it claims
//!
//! - [`CLEAN_WRITE_REWALK`](Arch::CLEAN_WRITE_REWALK), on every x86 CPU:
//!   a write through a cached entry whose dirty flag is clear walks the
//!   page table again to set it, and faults if the PTE is gone, so unmap
//!   flushes may be deferred.
//! - Not [`ACCESSED_CLEAR_NEEDS_FLUSH`](Arch::ACCESSED_CLEAR_NEEDS_FLUSH):
//!   an accessed bit cleared without a flush only makes a page look older
//!   than it is (seed 003, contract rule 8), so aging sends no IPI.
//! - [`fill_sets_accessed`](Arch::fill_sets_accessed) as the kernel's
//!   [`Features::fill_sets_accessed`] says: [`Features::detect`] sets it on
//!   Intel (SDM vol. 3A, 4.10.2.3 "Details of TLB Use") and AMD (APM vol.
//!   2, 5.4.2 "Notes on Accessed and Dirty Bits", and 5.5.3 on speculative
//!   fills) CPUs, whose manuals say that a fill sets the accessed bit of
//!   the entries it caches; any other vendor string leaves it clear. A
//!   kernel running under a hypervisor ([`Features::hypervisor`]) that may
//!   use shadow paging clears it (see the field); with it clear, frame
//!   pools still release every frame, after flushes made since the unmap.
//! - Nothing else: no broadcast invalidation (`INVLPGB` is not used), the
//!   default full-flush ceiling (33 pages).
//!
//! The instruction wrappers are small `unsafe fn`s, one instruction each;
//! they are public so that a kernel can use the same, documented ones.
//!
//! This file holds the [`X86_64`] `Arch` itself: which instruction each
//! flush uses, bring-up and the flush-IPI entry point. The wrappers, the
//! local APIC, the CPU table and feature detection live in modules of
//! their own (`x86_64_instructions.rs`, `x86_64_apic.rs`, `x86_64_cpus.rs`,
//! `x86_64_features.rs`), and everything public in them is re-exported
//! here.

use core::sync::atomic::{fence, Ordering};

pub use super::x86_64_apic::{ApicMode, LocalApic, IA32_APIC_BASE};
use super::x86_64_cpus::shorthand_reaches_exactly;
pub use super::x86_64_cpus::CpuTable;
pub use super::x86_64_features::{
    cpu_supports, Features, Supported, APIC_BASE_ENABLE, APIC_BASE_X2APIC, CR3_NOFLUSH, CR4_LA57, CR4_PCIDE,
    CR4_PGE,
};
pub use super::x86_64_instructions::{
    cpuid, invlpg, invpcid, pause, rdmsr, read_cr3, read_cr4, vendor_id, vendor_promises_fill_sets_accessed,
    write_cr3, write_cr4, wrmsr, InvpcidKind,
};
use crate::arch::{Arch, Asid};
use crate::cpuset::{CpuId, CpuSet};
use crate::percpu::TlbShootdown;
use crate::Error;

/// How [`X86_64::flush_local_page`](Arch::flush_local_page) drops one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PageFlush {
    /// `invlpg`: the loaded PCID's entry and any global entry.
    Invlpg,
    /// `INVPCID` individual-address in a PCID that is not loaded.
    InvpcidAddress(u16),
    /// A kernel page that may be cached non-global under any PCID:
    /// `invlpg` for a global entry, then `INVPCID` all-contexts (non-global)
    /// for the copies other PCIDs may hold.
    EveryPcid,
}

/// Chooses the invalidation for a page of `asid` on a CPU whose loaded
/// PCID is `current_pcid`.
fn page_flush(asid: Asid, pcid_on: bool, kernel_global: bool, current_pcid: u16) -> PageFlush {
    if !pcid_on {
        // One untagged context: `invlpg` reaches every entry for the page.
        return PageFlush::Invlpg;
    }
    if asid.is_kernel() {
        // `invlpg` reaches only the loaded PCID's non-global entry; a
        // non-global kernel entry cached while another PCID was loaded
        // survives it and is used again after a no-flush CR3 switch.
        return if kernel_global {
            PageFlush::Invlpg
        } else {
            PageFlush::EveryPcid
        };
    }
    match X86_64::pcid_of(asid) {
        Some(pcid) if pcid == current_pcid => PageFlush::Invlpg,
        Some(pcid) => PageFlush::InvpcidAddress(pcid),
        // Wider than a PCID (refused by every entry point; only a direct
        // call gets here): drop the page wherever it may be.
        None => PageFlush::EveryPcid,
    }
}

/// The x86_64 [`Arch`]: the running CPU is found by its APIC ID in a
/// [`CpuTable`]; flushes use `invlpg`, `INVPCID` or CR3/CR4; flush IPIs go
/// through the local APIC on `vector`.
///
/// It acts on what the kernel has enabled ([`Features`]), never on what
/// the CPU merely supports ([`Supported`]). PCIDs are used only when
/// CR4.PCIDE is on and the CPU has INVPCID (flushing a page of an address
/// space that is not loaded needs it); otherwise every CR3 it loads
/// carries PCID 0. An ASID's PCID is its value: [`Arch::asid_bits`] is
/// [`PCID_BITS`], so every entry point refuses a wider ASID
/// ([`Error::AsidOutOfRange`]) and two ASIDs the crate accepts never share
/// a PCID; PCID 0 is the kernel's. A kernel keeps at most 4095 live user
/// address spaces, each with its own ASID. With PCIDs a CPU keeps a
/// space's entries after it switched away; [`switch_mm`](crate::switch_mm)
/// flushes the PCID (`INVPCID` single-context) before loading it again if
/// the space's generation moved, and at the first load of a new
/// [`MmTlbState`](crate::MmTlbState), so an ASID given to a new address
/// space never reaches a retired one's entries (see
/// [`generation`](crate::generation)).
/// Addresses are checked to be canonical (48 bits, or 57 with
/// [`Features::la57`]) before any reaches `invlpg` or `INVPCID`.
///
/// # A CPU it cannot tell
///
/// On a CPU whose APIC ID is not registered in the [`CpuTable`] (which
/// breaks [`new`](Self::new)'s contract), [`current_cpu`](Arch::current_cpu)
/// answers [`Error::UnregisteredCpu`], and every crate function run with
/// this `Arch` passes that error on with nothing changed: any CPU index
/// would name another CPU, whose flushes this one would acknowledge
/// without doing them. [`bring_online`](Self::bring_online) reports the
/// same mistake when the CPU comes up.
pub struct X86_64 {
    apic: LocalApic,
    vector: u8,
    cpus: &'static CpuTable,
    state: &'static TlbShootdown,
    pcid: bool,
    invpcid: bool,
    /// CPUID reports PGE: the full flush may toggle CR4.PGE.
    pge_supported: bool,
    la57: bool,
    kernel_global: bool,
    fill_sets_accessed: bool,
    /// The kernel's own answer to "which CPU is this?"
    /// ([`with_cpu_index`](Self::with_cpu_index)), instead of the APIC ID.
    cpu_index: Option<fn() -> usize>,
}

/// The width of a PCID: ASIDs 1 to 4095 are user address spaces, PCID 0 is
/// the kernel's.
pub const PCID_BITS: u32 = 12;

/// Where CR3 holds the root's physical address: bits 51:12 (at most; a CPU
/// with fewer physical-address bits has zeros above them). Below them sit
/// the PCID, or the PWT and PCD flags, and the no-flush bit 63 of a load
/// is not stored (Intel SDM vol. 3A 4.5, Tables 4-12 and 4-13; 4.10.4.1).
const CR3_ADDRESS: u64 = 0x000f_ffff_ffff_f000;

impl X86_64 {
    /// The `Arch` for this machine, acting on `features`: what the kernel
    /// has enabled, as [`Features::detect`] reports it.
    ///
    /// It reads CR4 and CPUID on the running CPU (a few CPUIDs, each may
    /// exit to a hypervisor: keep the value rather than build it often).
    ///
    /// Errors: [`Error::FeatureUnavailable`] for a claim CR4 or CPUID
    /// contradicts ([`Features::check`]: PCIDs with CR4.PCIDE clear, and
    /// the like), rather than load CR3 values the hardware does not allow
    /// or execute instructions it lacks. Nothing is built.
    ///
    /// # Safety
    ///
    /// Ring 0 (it reads CR4), as every use of the value is. Every CPU
    /// that runs crate code or may hold TLB entries is registered in
    /// `cpus`, and calls [`bring_online`](Self::bring_online) only once
    /// its IDT routes `vector` to a handler that calls
    /// [`flush_ipi_entry`](Self::flush_ipi_entry); `apic` is valid on every
    /// CPU. `features` is true of every CPU that uses the value, not only
    /// of the running one, which is all `new` can check: with PCIDs,
    /// CR4.PCIDE is set on each of them and CR3 carries the loaded ASID's
    /// PCID; [`Features::kernel_global`] only when every kernel mapping is
    /// global; [`Features::fill_sets_accessed`] only when every CPU's TLB
    /// fills keep the promise it describes, which a guest of a hypervisor
    /// may have to withdraw (see there).
    pub unsafe fn new(
        apic: LocalApic,
        vector: u8,
        cpus: &'static CpuTable,
        state: &'static TlbShootdown,
        features: Features,
    ) -> Result<Self, Error> {
        // SAFETY: ring 0 (this function's contract); no side effect.
        let cr4 = unsafe { read_cr4() };
        Self::from_registers(apic, vector, cpus, state, features, &Supported::detect(), cr4)
    }

    /// [`new`](Self::new) given CPUID's (`cpu`) and CR4's answers.
    fn from_registers(
        apic: LocalApic,
        vector: u8,
        cpus: &'static CpuTable,
        state: &'static TlbShootdown,
        features: Features,
        cpu: &Supported,
        cr4: u64,
    ) -> Result<Self, Error> {
        features.check(cpu, cr4)?;
        Ok(X86_64 {
            apic,
            vector,
            cpus,
            state,
            pcid: features.pcid && features.invpcid,
            invpcid: features.invpcid,
            pge_supported: cpu.pge,
            la57: features.la57,
            kernel_global: features.kernel_global && features.pge,
            fill_sets_accessed: features.fill_sets_accessed,
            cpu_index: None,
        })
    }

    /// Has [`current_cpu`](Arch::current_cpu), which every crate call
    /// asks, take the running CPU's index from `index` instead of reading
    /// the local APIC ID and looking it up in the [`CpuTable`]: for a
    /// kernel that keeps its CPU index in a per-CPU register already (its
    /// GS-based per-CPU area, or `IA32_TSC_AUX` read with `rdpid` or
    /// `rdtscp`). An xAPIC ID is a read of the APIC's MMIO page and an
    /// x2APIC ID a `rdmsr`, and under many hypervisors each exits to the
    /// hypervisor. [`bring_online`](Self::bring_online) and
    /// [`take_offline`](Self::take_offline) still read the APIC ID, once.
    ///
    /// An index at or above [`MAX_CPUS`](crate::MAX_CPUS) is refused with
    /// [`Error::CpuOutOfRange`], and one the table has no APIC ID for with
    /// [`Error::UnregisteredCpu`] (its `hw_id` is then the index).
    ///
    /// # Safety
    ///
    /// On every CPU that runs crate code with this value, `index` returns
    /// the index under which that CPU is [registered](CpuTable::register),
    /// never another CPU's (a wrong index acknowledges another CPU's
    /// flushes without doing them); it may be called with interrupts off
    /// and from the flush-IPI handler, and does not call into the crate.
    pub unsafe fn with_cpu_index(self, index: fn() -> usize) -> Self {
        X86_64 {
            cpu_index: Some(index),
            ..self
        }
    }

    /// Brings the running CPU into the online set, the set that shootdowns
    /// reach: call it once on each CPU as it comes up (and again when it
    /// comes back after going offline), with interrupts disabled, after it
    /// was [registered](CpuTable::register) and its IDT routes the flush
    /// vector. This is the only way a CPU joins the online set.
    ///
    /// A CPU outside the online set gets no flush IPIs, so it may hold
    /// stale entries of any kind (global kernel ones included, and with
    /// PCIDs, entries of any address space). It flushes everything
    /// ([`prepare_cpu_online`](crate::prepare_cpu_online)) before joining,
    /// as [`Arch`]'s contract requires, and once more right after: the
    /// processor may cache translations speculatively at any time, so an
    /// entry cached between the first flush and the join, for a page whose
    /// shootdown read the online set just before the join, would otherwise
    /// escape both that shootdown and this flush. After the second flush
    /// every shootdown either reaches this CPU or cleared its entries
    /// before the flush.
    ///
    /// Errors: [`Error::UnregisteredCpu`] when this CPU's APIC ID is not in
    /// the table; [`Error::CpuIndexMismatch`] when the kernel's index
    /// ([`with_cpu_index`](Self::with_cpu_index)) names another CPU than
    /// the one this APIC ID is registered as; [`Error::AlreadyOnline`] when
    /// the CPU is online already. Nothing changes, and the CPU must not run
    /// crate code (an online one goes on as it was).
    pub fn bring_online(&self) -> Result<CpuId, Error> {
        let apic_id = self.apic.id();
        let cpu = self
            .cpus
            .cpu_of(apic_id)
            .ok_or(Error::UnregisteredCpu { hw_id: apic_id })?;
        // The kernel's index, when it gives one, must name this very CPU:
        // checked here, once, against the APIC ID.
        if let Some(index) = self.cpu_index {
            let given = index();
            if given != cpu.index() {
                return Err(Error::CpuIndexMismatch {
                    given,
                    registered: cpu.index(),
                });
            }
        }
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
    /// handler), with interrupts disabled, after the CPU loaded the
    /// kernel's address space, whose page tables stay while it is away
    /// ([`switch_mm`](crate::switch_mm) to the kernel's
    /// [`MmTlbState`](crate::MmTlbState)). It leaves the set, then
    /// serves and acknowledges every flush request that reaches it until no
    /// initiator that saw it online can still send one
    /// ([`take_cpu_offline`](crate::take_cpu_offline)), and returns how
    /// many it served on its way out. When it returns `Ok`, no shootdown
    /// and no [`FramePool`](crate::FramePool) generation waits for this
    /// CPU, and every later all-but-self IPI names its destinations
    /// instead (not every present CPU is online).
    ///
    /// After `Ok` the CPU gets no flush requests, so its TLB may keep
    /// entries for pages that are unmapped and freed while it is away. The
    /// kernel runs nothing on it that could use them: no user code, no
    /// crate function, no access to memory that may be unmapped, no
    /// interrupt handler (it parks, e.g. `cli; hlt` in a loop, until the
    /// kernel wakes it). It comes back only through
    /// [`bring_online`](Self::bring_online), which flushes everything,
    /// global entries included, before it rejoins; a flush IPI still
    /// latched at its local APIC then finds nothing to do.
    ///
    /// Errors, with nothing changed (the CPU stays as it was):
    /// [`Error::UnregisteredCpu`] when this CPU's APIC ID is not in the
    /// table; [`Error::CpuNotOnline`] when it is not online (it never came
    /// up, or already left); [`Error::ShootdownReentered`] when the call
    /// comes from an interrupt that interrupted a shootdown of this CPU's
    /// own, which would stay unfinished; [`Error::UserSpaceLoaded`] when
    /// its last `switch_mm` loaded a user space (switch to the kernel's
    /// first).
    pub fn take_offline(&self) -> Result<usize, Error> {
        let apic_id = self.apic.id();
        let cpu = self
            .cpus
            .cpu_of(apic_id)
            .ok_or(Error::UnregisteredCpu { hw_id: apic_id })?;
        crate::take_cpu_offline(self, |me| me == cpu && self.cpus.leave(cpu))
    }

    /// The flush-IPI entry point: call it from the interrupt handler of the
    /// vector given to [`new`](Self::new), on the interrupted CPU, with
    /// interrupts still disabled. It carries out every request waiting for
    /// this CPU ([`handle_flush_ipi`](crate::handle_flush_ipi)) and then
    /// signals end of interrupt. Returns the number of requests served
    /// (zero is normal: a waiting initiator may have served them).
    pub fn flush_ipi_entry(&self) -> usize {
        let served = crate::shootdown::handle_flush_ipi(self);
        self.apic.eoi();
        served
    }

    /// The local APIC.
    pub fn apic(&self) -> &LocalApic {
        &self.apic
    }

    /// Whether PCIDs are in use.
    pub fn uses_pcid(&self) -> bool {
        self.pcid
    }

    /// The PCID of an ASID: its value, so no two ASIDs share one; the
    /// kernel's ASID has PCID 0. `None` for an ASID wider than
    /// [`PCID_BITS`], which every entry point of the crate refuses
    /// ([`Error::AsidOutOfRange`]): the `Arch` methods, reachable directly,
    /// then act on every PCID rather than on another address space's.
    pub fn pcid_of(asid: Asid) -> Option<u16> {
        if asid.is_kernel() {
            Some(0)
        } else {
            let value = asid.value();
            (u32::from(value) < (1 << PCID_BITS)).then_some(value)
        }
    }

    fn current_pcid(&self) -> u16 {
        // SAFETY: ring 0 (constructor contract).
        (unsafe { read_cr3() } & 0xfff) as u16
    }
}

// SAFETY: the constructor's contract registers every CPU that may cache
// translations and routes the vector to the crate's handler; the flushes
// below complete before returning (invlpg/INVPCID/CR3/CR4 writes are
// serializing for the TLB); PCID use is enabled only with INVPCID, so an
// inactive PCID's page can be flushed; the constants hold on every x86 CPU
// (a write through a clean entry re-walks to set the dirty bit and faults
// if the PTE is gone; a cleared accessed bit needs no flush to be set
// again later); `fill_sets_accessed` answers the constructor's
// `Features::fill_sets_accessed`, which its contract makes true of the
// CPUs (`Features::detect` sets it only for the vendors that document the
// promise: Intel SDM vol. 3A 4.10.2.3, AMD APM vol. 2 5.4.2).
unsafe impl Arch for X86_64 {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;

    fn current_cpu(&self) -> Result<CpuId, Error> {
        if let Some(index) = self.cpu_index {
            let i = index();
            let cpu = CpuId::new(i)?;
            return match self.cpus.apic_id(cpu) {
                Some(_) => Ok(cpu),
                None => Err(Error::UnregisteredCpu { hw_id: i as u32 }),
            };
        }
        let apic_id = self.apic.id();
        self.cpus
            .cpu_of(apic_id)
            .ok_or(Error::UnregisteredCpu { hw_id: apic_id })
    }

    fn online_cpus(&self) -> CpuSet {
        self.cpus.online()
    }

    fn root_loaded(&self, root: u64) -> Option<bool> {
        // SAFETY: ring 0 (constructor contract).
        let cr3 = unsafe { read_cr3() };
        Some(cr3 & CR3_ADDRESS == root & CR3_ADDRESS)
    }

    fn shootdown_state(&self) -> &TlbShootdown {
        self.state
    }

    fn tagged_tlb(&self) -> bool {
        self.pcid
    }

    fn kernel_flush_needs_global(&self) -> bool {
        // Without PCIDs every non-global entry is the loaded space's, which
        // INVLPG removes; with them and without the promise, the flush
        // reaches every PCID (`page_flush`).
        self.pcid && self.kernel_global
    }

    fn fill_sets_accessed(&self) -> bool {
        self.fill_sets_accessed
    }

    fn va_bits(&self) -> u32 {
        if self.la57 {
            57
        } else {
            48
        }
    }

    fn asid_bits(&self) -> u32 {
        // The PCID width whether or not PCIDs are on, so that a kernel's
        // ASIDs stay valid when it turns them on.
        PCID_BITS
    }

    fn flush_local_page(&self, asid: Asid, va: u64) {
        let current = if self.pcid { self.current_pcid() } else { 0 };
        match page_flush(asid, self.pcid, self.kernel_global, current) {
            // SAFETY: ring 0 (constructor contract).
            PageFlush::Invlpg => unsafe { invlpg(va) },
            // SAFETY: ring 0, INVPCID present (PCIDs are used only then),
            // pcid < 4096, and `va` is the canonical address given to us.
            PageFlush::InvpcidAddress(pcid) => unsafe { invpcid(InvpcidKind::Address, pcid, va) },
            // SAFETY: as above; the all-contexts kind ignores its operands.
            PageFlush::EveryPcid => unsafe {
                invlpg(va);
                invpcid(InvpcidKind::AllExcludingGlobal, 0, 0);
            },
        }
    }

    fn flush_local_asid(&self, asid: Asid) {
        if self.pcid {
            match Self::pcid_of(asid) {
                // SAFETY: ring 0 and INVPCID present (PCIDs are used only
                // then); the PCID fits 12 bits.
                Some(pcid) => unsafe { invpcid(InvpcidKind::SingleContext, pcid, 0) },
                // An ASID wider than a PCID (see `pcid_of`): every PCID.
                // SAFETY: as above; this kind ignores its operands.
                None => unsafe { invpcid(InvpcidKind::AllExcludingGlobal, 0, 0) },
            }
        } else {
            // Without PCIDs only the loaded address space has entries;
            // reloading CR3 drops every non-global one.
            // SAFETY: ring 0; the same root is written back.
            unsafe { write_cr3(read_cr3()) };
        }
    }

    fn flush_local_all(&self, include_global: bool) {
        if self.invpcid {
            let kind = if include_global {
                InvpcidKind::AllIncludingGlobal
            } else {
                InvpcidKind::AllExcludingGlobal
            };
            // SAFETY: ring 0 and INVPCID present.
            unsafe { invpcid(kind, 0, 0) };
        } else if include_global && self.pge_supported {
            // Changing CR4.PGE flushes everything, global entries and all
            // PCIDs included (SDM vol. 3A, 4.10.4.1), whether PGE was on
            // (even if `Features::pge` left it out) or off.
            // SAFETY: ring 0; CR4 is restored to its value.
            unsafe {
                let cr4 = read_cr4();
                write_cr4(cr4 ^ CR4_PGE);
                write_cr4(cr4);
            }
        } else {
            // SAFETY: ring 0; the same root is written back (without PCIDs
            // this flushes all non-global entries; without PGE there are no
            // global ones).
            unsafe { write_cr3(read_cr3()) };
        }
    }

    fn send_flush_ipi(&self, targets: &CpuSet) {
        // An initiator the table cannot tell was refused before it got
        // here; were it not, naming each target is always right.
        let shorthand = self
            .current_cpu()
            .is_ok_and(|me| shorthand_reaches_exactly(targets, &self.cpus.online(), me, self.cpus.present()));
        if shorthand {
            self.apic.send_ipi_all_but_self(self.vector);
            return;
        }
        for cpu in targets {
            if let Some(apic_id) = self.cpus.apic_id(cpu) {
                self.apic.send_ipi(apic_id, self.vector);
            }
        }
    }

    unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
        let value = match Self::pcid_of(asid) {
            _ if !self.pcid => root,
            // What this PCID's entries missed while it was not loaded,
            // `switch_mm` has flushed by generation already (INVPCID), so
            // the load keeps them.
            Some(pcid) if pcid != 0 => root | u64::from(pcid) | CR3_NOFLUSH,
            // The kernel's address space, and an ASID wider than a PCID
            // (which `switch_mm` refuses; only a direct call gets here):
            // PCID 0, with its non-global entries dropped at the load, so
            // it never reuses what another address space left under it.
            _ => root,
        };
        // SAFETY: the caller guarantees `root` maps the running code.
        unsafe { write_cr3(value) };
    }

    fn relax(&self) {
        pause();
    }
}

#[cfg(test)]
#[path = "x86_64_tests.rs"]
mod tests;
