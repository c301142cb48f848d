//! The hardware interface: the [`Arch`] trait a kernel implements once.
//!
//! Everything else in the crate is generic over `Arch`. Three
//! implementations ship with it: `mock` (feature `mock`), a simulated SMP
//! machine with modelled TLBs that every host test runs on; `x86_64`,
//! proven on an emulated SMP machine under QEMU (`qemu-test/` in the
//! repository); and `aarch64`, for ARMv8-A at EL1 with broadcast `TLBI`s,
//! run on QEMU's `virt` machine with 4 CPUs (`qemu-test-aarch64/`: single
//! pages, page lists and full flushes, no IPIs). Each hardware one is
//! compiled for its own target only.

#[cfg(feature = "mock")]
#[cfg_attr(docsrs, doc(cfg(feature = "mock")))]
pub mod mock;
// Not in the loom harness (`cfg(all(test, loom))`): its `static`-friendly
// `const` constructors use `core` atomics, and the loom models (src/loom/)
// bring their own Arch. The plain library has it under `--cfg loom` too.
#[cfg(all(target_arch = "x86_64", not(all(test, loom))))]
#[cfg_attr(docsrs, doc(cfg(target_arch = "x86_64")))]
pub mod x86_64;
// Its instruction wrappers, local APIC, CPU table and feature detection,
// which `x86_64` re-exports.
#[cfg(all(target_arch = "x86_64", not(all(test, loom))))]
mod x86_64_apic;
#[cfg(all(target_arch = "x86_64", not(all(test, loom))))]
mod x86_64_cpus;
// The stable-Rust interrupt entry for the flush IPI (a macro).
#[cfg(all(target_arch = "x86_64", not(all(test, loom))))]
mod x86_64_entry;
#[cfg(all(target_arch = "x86_64", not(all(test, loom))))]
mod x86_64_features;
#[cfg(all(target_arch = "x86_64", not(all(test, loom))))]
mod x86_64_instructions;
// As for x86_64. The arithmetic of the aarch64 `Arch` (register fields,
// TLBI operands, the CPU table) lives in modules of its own that compile on
// the host as well, where their unit tests run; `aarch64` re-exports it.
#[cfg(all(target_arch = "aarch64", not(all(test, loom))))]
#[cfg_attr(docsrs, doc(cfg(target_arch = "aarch64")))]
pub mod aarch64;
#[cfg(all(not(all(test, loom)), any(test, target_arch = "aarch64")))]
mod aarch64_cpus;
// Its instruction wrappers, which `aarch64` re-exports, and the barrier
// and TLBI sequence of each of its flushes.
#[cfg(all(target_arch = "aarch64", not(all(test, loom))))]
mod aarch64_instructions;
#[cfg(all(target_arch = "aarch64", not(all(test, loom))))]
mod aarch64_sequences;
// The CPU table both hardware `Arch`es wrap.
#[cfg(all(not(all(test, loom)), any(test, target_arch = "aarch64")))]
mod aarch64_encoding;
// Its granule: pages, blocks, and the TLBI operand's level hint.
#[cfg(all(not(all(test, loom)), any(test, target_arch = "aarch64")))]
mod aarch64_granule;
#[cfg(all(
    not(all(test, loom)),
    any(test, target_arch = "x86_64", target_arch = "aarch64")
))]
mod cpu_registry;

pub use crate::asid::Asid;
use crate::cpuset::{CpuId, CpuSet};
use crate::page_size::PageSize;
use crate::percpu::TlbShootdown;
use crate::request::FlushRequest;
use crate::stats::TraceEvent;

/// The default [`Arch::FULL_FLUSH_CEILING`]: above this many pages one full
/// flush is cheaper than that many single-page invalidations (the figure
/// Linux uses on x86).
pub const DEFAULT_FULL_FLUSH_CEILING: usize = 33;

/// What a kernel implements once for its hardware: who am I, flush my own
/// TLB, interrupt other CPUs, switch address spaces. Capability constants
/// say what the hardware guarantees; the crate's policies read them.
///
/// Methods take `&self`, so one value can describe one CPU's view of a
/// machine (as the mock does, to run many simulated machines side by side
/// in parallel tests) or be a zero-sized handle to the real hardware.
///
/// # Safety
///
/// The crate trusts every answer and every effect promised here to keep
/// freed memory out of reach of other CPUs. An implementation guarantees:
///
/// - [`current_cpu`](Arch::current_cpu) names the CPU actually running the
///   caller, and the caller cannot migrate while a crate function runs
///   (kernels call the crate with preemption disabled).
/// - [`online_cpus`](Arch::online_cpus) contains every CPU that may hold a
///   TLB entry and that will answer an IPI; a CPU joins it only after
///   [`prepare_cpu_online`](crate::prepare_cpu_online) ran on it, leaves
///   it only through [`take_cpu_offline`](crate::take_cpu_offline) (whose
///   `leave` removes it from the atomics `online_cpus` reads), and an
///   offline CPU runs no code that uses its TLB.
/// - Each `flush_local_*` method has removed the named entries from this
///   CPU's TLB by the time it returns, including entries of an ASID that is
///   not loaded when [`tagged_tlb`](Arch::tagged_tlb) is true.
/// - When [`tagged_tlb`](Arch::tagged_tlb) is false,
///   [`switch_address_space`](Arch::switch_address_space) drops every
///   non-global entry the CPU holds (as loading CR3 without PCIDs does):
///   the crate counts such a switch as a full local flush
///   ([`FramePool`](crate::FramePool) releases frames on it).
/// - [`send_flush_ipi`](Arch::send_flush_ipi) delivers an interrupt to each
///   target, whose handler calls [`handle_flush_ipi`](crate::handle_flush_ipi)
///   with that CPU's `Arch` value.
/// - [`shootdown_state`](Arch::shootdown_state) returns the same
///   [`TlbShootdown`] on every CPU of one machine.
/// - [`va_bits`](Arch::va_bits) and [`asid_bits`](Arch::asid_bits) are
///   no wider than what the hardware translates and tags: the crate hands
///   every address and ASID that passes those checks to the `flush_*`
///   methods and to remote CPUs' interrupt handlers.
/// - The capability constants are true of the hardware; in particular
///   [`CLEAN_WRITE_REWALK`](Arch::CLEAN_WRITE_REWALK) must not be claimed
///   without the hardware guarantee, since batching relies on it, and
///   [`fill_sets_accessed`](Arch::fill_sets_accessed) answers true only
///   where every CPU's TLB fills keep the promise it describes, since
///   frame pools free frames on its strength.
/// - When [`BROADCAST_INVALIDATE`](Arch::BROADCAST_INVALIDATE) is true, the
///   `broadcast_*` methods invalidate on every CPU and
///   [`broadcast_sync`](Arch::broadcast_sync) waits until every one this
///   CPU issued before it completed, in the same crate call or an earlier
///   one ([`BATCH_BROADCAST_ON_ADD`](Arch::BATCH_BROADCAST_ON_ADD) issues
///   them as pages are added and waits at the flush, possibly after other
///   code ran on the CPU in between).
pub unsafe trait Arch {
    /// A write through a cached *clean* (not dirty) writable TLB entry makes
    /// the hardware walk the page table again to set the dirty bit, and
    /// faults if the PTE is gone. x86 guarantees this. Deferring the flush of
    /// an unmapped page is legal only when it holds: otherwise a write
    /// through the stale entry could dirty a page the kernel believes clean.
    const CLEAN_WRITE_REWALK: bool;

    /// Clearing a PTE's accessed bit must be followed by a TLB flush for the
    /// bit to be set again reliably. On x86 it is not needed: a missed
    /// re-set only makes a page look older than it is (seed 003).
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool;

    /// The default answer of [`fill_sets_accessed`](Arch::fill_sets_accessed),
    /// for an `Arch` whose answer is known when it is compiled (the mock's
    /// models, a kernel's own `Arch` for one kind of CPU). The crate reads
    /// only the method; an `Arch` whose answer depends on the CPU it runs on
    /// (the crate's `X86_64`: the vendor, and what the kernel declares)
    /// leaves this false and overrides the method. Claim
    /// it only under the conditions given there. The default is false.
    const FILL_SETS_ACCESSED: bool = false;

    /// Above this many pages a ranged flush becomes one full flush. Values
    /// above [`MAX_FLUSH_ENTRIES`](crate::MAX_FLUSH_ENTRIES) are treated as
    /// that limit.
    const FULL_FLUSH_CEILING: usize = DEFAULT_FULL_FLUSH_CEILING;

    /// The hardware invalidates remote TLBs without interrupts (arm64
    /// `TLBI ... IS`, AMD `INVLPGB`): the crate then issues `broadcast_*`
    /// calls and one [`broadcast_sync`](Arch::broadcast_sync) instead of
    /// IPIs.
    const BROADCAST_INVALIDATE: bool = false;

    /// On hardware with [`BROADCAST_INVALIDATE`](Arch::BROADCAST_INVALIDATE),
    /// a [`TlbFlushUnmapBatch`](crate::TlbFlushUnmapBatch) issues each
    /// page's broadcast invalidation ([`broadcast_flush_page`](Arch::broadcast_flush_page))
    /// as the page is added, without waiting for it, and its flush only
    /// waits ([`broadcast_sync`](Arch::broadcast_sync)) when every page was
    /// added on the flushing CPU; otherwise the flush issues the
    /// invalidations again from the flushing CPU before it waits, since
    /// `broadcast_sync` completes only the calling CPU's. This is Linux's
    /// batched unmap on arm64 (since 6.6): the invalidations run while the
    /// unmap goes on, and the batch's one barrier finds most of them done.
    /// It costs one broadcast per page however many pages the batch holds
    /// (no [`FULL_FLUSH_CEILING`](Arch::FULL_FLUSH_CEILING) applies to what
    /// is issued on add), and it bypasses
    /// [`prefer_broadcast`](Arch::prefer_broadcast) for batched pages.
    /// Ignored without `BROADCAST_INVALIDATE`. The default is false.
    const BATCH_BROADCAST_ON_ADD: bool = false;

    /// The CPU running the caller.
    ///
    /// Errors: [`Error::UnregisteredCpu`](crate::Error::UnregisteredCpu)
    /// (or another typed error) when the implementation cannot tell which
    /// CPU this is, for example a CPU whose hardware identifier was never
    /// registered. Every crate function that needs the calling CPU passes
    /// the error on with nothing changed, and those that start flushes
    /// also refuse a CPU that is not in [`online_cpus`](Arch::online_cpus)
    /// ([`Error::CpuNotOnline`](crate::Error::CpuNotOnline)): shootdowns
    /// reach online CPUs only, so such a CPU would miss them. Never guess:
    /// an answer that names another CPU acknowledges that CPU's flushes
    /// without doing them.
    fn current_cpu(&self) -> Result<CpuId, crate::Error>;

    /// The CPUs that are up and answer IPIs.
    fn online_cpus(&self) -> CpuSet;

    /// Whether `root` (in the form
    /// [`switch_address_space`](Arch::switch_address_space) takes it) is the
    /// page-table root the running CPU has loaded now, or `None` when the
    /// implementation cannot tell cheaply (the default).
    ///
    /// With an answer, the crate refuses a flush of a user address space
    /// whose root the calling CPU loaded without [`switch_mm`](crate::switch_mm)
    /// ([`Error::UntrackedRoot`](crate::Error::UntrackedRoot)): it would
    /// skip that CPU. [`check_cpu_state`](crate::check_cpu_state) asks it
    /// too. The x86_64 and aarch64 `Arch`s read CR3 and TTBR0_EL1, the
    /// mock its CPU's loaded root.
    fn root_loaded(&self, root: u64) -> Option<bool> {
        let _ = root;
        None
    }

    /// The machine's shootdown bookkeeping, normally a `static`.
    fn shootdown_state(&self) -> &TlbShootdown;

    /// Whether [`flush_local_page`](Arch::flush_local_page) of a kernel
    /// page relies on every kernel mapping being global: it removes the
    /// global entry and the loaded ASID's, and a non-global entry cached
    /// under another ASID survives it (x86 with PCIDs and
    /// `Features::kernel_global`: one `INVLPG`). Then the crate refuses to
    /// change a present non-global entry through the kernel's address space
    /// ([`Error::NonGlobalKernelEntry`](crate::Error::NonGlobalKernelEntry)):
    /// such an entry is a process's page handed to the wrong state, or a
    /// kernel page mapped against the promise. The default is false (the
    /// kernel-page flush reaches every ASID, or there is only one).
    fn kernel_flush_needs_global(&self) -> bool {
        false
    }

    /// Whether TLB entries of an address space survive switching away from
    /// it (x86 with PCID, arm64 ASIDs). Either way switching away takes the
    /// CPU out of the address space's CPU set, so it gets no further IPIs
    /// for it; when true, [`switch_mm`](crate::switch_mm) flushes the ASID
    /// ([`flush_local_asid`](Arch::flush_local_asid), before loading it) when
    /// the CPU comes back behind the space's generation. The default is
    /// false.
    fn tagged_tlb(&self) -> bool {
        false
    }

    /// Whether the hardware never caches a translation whose PTE has its
    /// accessed bit clear: a TLB fill sets the bit in the PTE in memory, by
    /// an atomic update of that PTE, before the entry it caches can be used.
    /// Then a PTE found with the bit clear has not been cached by any CPU
    /// since the bit was last cleared, and a [`FramePool`](crate::FramePool)
    /// may count a CPU's flush made after that clear as enough (see
    /// [`Rmap::aged_epoch`](crate::Rmap::aged_epoch)).
    ///
    /// Where the vendors say so: Intel, SDM vol. 3A, section 4.10.2.3
    /// "Details of TLB Use" (no translation enters a TLB while an accessed
    /// flag of the paging-structure entries it came from is 0: the
    /// processor sets those flags first); AMD, APM vol. 2 (publication
    /// 24593), section 5.4.2 "Notes on Accessed and Dirty Bits" (caching an
    /// entry and setting its accessed bit go together, on a mispredicted
    /// path too) and section 5.5.3, "Speculative Caching of Address
    /// Translations" (a translation loaded speculatively gets its bit set).
    /// Nothing is claimed here for other vendors, nor for a TLB that caches
    /// entries without setting the bit: software-managed accessed flags,
    /// arm64 with hardware access-flag updates (no promise was found that
    /// the update comes before the entry is used), or a guest whose
    /// hypervisor fills its shadow page tables without setting the guest's
    /// bit first. There a pool that trusted the bit could free a frame some
    /// CPU still maps.
    ///
    /// The answer must be the same on every CPU of the machine, and true
    /// only if every CPU that may cache the address spaces' translations
    /// keeps the promise. False costs no correctness: pooled frames then
    /// wait for flushes made after their unmap, and come back through those
    /// (passes or the pool's own flush). The default returns
    /// [`FILL_SETS_ACCESSED`](Arch::FILL_SETS_ACCESSED).
    fn fill_sets_accessed(&self) -> bool {
        Self::FILL_SETS_ACCESSED
    }

    /// How many low bits of a virtual address the MMU translates: an
    /// address is canonical when its bits 63 down to `va_bits() - 1` are
    /// all equal (x86-64: 48, or 57 with 5-level paging; RISC-V Sv39: 39;
    /// arm64 with 48-bit lower and upper halves: 49). Every entry point
    /// refuses other addresses with [`Error::NonCanonical`](crate::Error::NonCanonical) before it
    /// touches a page-table entry or sends a request. The default is 48.
    fn va_bits(&self) -> u32 {
        48
    }

    /// How many bits the hardware's ASIDs have (x86 PCID: 12; arm64: 8 or
    /// 16). User ASIDs run from 1 to `2^asid_bits() - 1`, and never reach
    /// `u16::MAX`, which is [`Asid::KERNEL`](crate::Asid::KERNEL) (with
    /// 16-bit ASIDs the highest user ASID is `0xfffe`); a wider one would
    /// share TLB entries with another address space, so every entry point
    /// refuses it with [`Error::AsidOutOfRange`](crate::Error::AsidOutOfRange). The default is 16.
    fn asid_bits(&self) -> u32 {
        16
    }

    /// Invalidates this CPU's entry for the page at `va` in `asid`.
    ///
    /// The page may be larger than 4 KiB (a [`FlushRange`] of a huge
    /// stride names each huge page once, by its first address): the
    /// invalidation must remove the entry that translates `va` whatever
    /// size the TLB cached it at, and every smaller entry the CPU may have
    /// cached for that page. x86 `INVLPG` and `INVPCID` by address do (SDM
    /// vol. 2, INVLPG: "flushes all TLB entries for that page", all of them
    /// where a large page was cached as several entries, vol. 3, 4.10.2.3);
    /// arm64 `TLBI VAE1` by address removes the entries that translate the
    /// address, a block's included (Arm ARM DDI 0487, "TLB maintenance
    /// instructions": an invalidation by address applies to an entry of
    /// any size that translates it).
    ///
    /// [`FlushRange`]: crate::FlushRange
    ///
    /// For [`Asid::KERNEL`] it removes every entry this CPU may hold for
    /// the kernel page, whatever ASID was loaded when it was filled: the
    /// global entry, and a non-global one cached under any user ASID (a
    /// kernel that maps some kernel pages non-global, as with page-table
    /// isolation, or where the hardware tags kernel entries). Where every
    /// kernel mapping is global, one local invalidation of the global
    /// entry is enough (x86 `INVLPG`, SDM vol. 3A, 4.10.4.1: it invalidates
    /// global entries for the page whatever the current PCID); otherwise
    /// the implementation reaches the other ASIDs too (x86: `INVPCID`
    /// all-contexts, as the crate's `X86_64` does when
    /// `Features::kernel_global` is off). A non-global kernel entry left
    /// under an ASID that is not loaded would survive the flush of a
    /// freed kernel page, and be used when that ASID is loaded again.
    fn flush_local_page(&self, asid: Asid, va: u64);

    /// [`flush_local_page`](Arch::flush_local_page), told what the crate
    /// knows of the entry it removes: `leaf` is the size of the one leaf
    /// entry that mapped the page (as [`PageTable::entry_size`](crate::PageTable::entry_size)
    /// reported it when the crate changed it), given only when the crate
    /// learned that size from the table and no page table on the way to
    /// the page is freed under this flush; `None` says nothing (the entry
    /// may be of any size, and walk-cache entries for the address must go
    /// too). The crate's own flushes call this method, once per page of a
    /// [`FlushRange`](crate::FlushRange), on the CPU that serves the
    /// request.
    ///
    /// An implementation may use `leaf` as a hint to the hardware (arm64's
    /// FEAT_TTL level hint: the crate's `Aarch64` does when the CPU has
    /// it), or ignore it. The default ignores it and calls
    /// [`flush_local_page`](Arch::flush_local_page), so `Arch`es written
    /// before this method need no change.
    fn flush_local_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
        let _ = leaf;
        self.flush_local_page(asid, va);
    }

    /// The smallest page the architecture's page tables map, as the
    /// kernel configured them: 4 KiB on x86_64; 4, 16 or 64 KiB on arm64
    /// (TCR_EL1's granule). The default is 4 KiB.
    ///
    /// The crate still counts addresses, ranges and [`Frame`](crate::Frame)s
    /// in 4 KiB units ([`PAGE_SIZE`](crate::PAGE_SIZE)); a larger base page
    /// is taken whole, as a huge page is: its one entry at its first
    /// address, one invalidation for it. So every entry point refuses, before
    /// anything changes, an address that is not aligned to it
    /// ([`Error::Unaligned`](crate::Error::Unaligned)), a range that is not
    /// whole base pages ([`Error::StrideUnaligned`](crate::Error::StrideUnaligned)),
    /// and an entry whose [`PageTable::entry_size`](crate::PageTable::entry_size)
    /// is smaller ([`Error::BelowBasePage`](crate::Error::BelowBasePage));
    /// ranges are flushed at this stride, and the full-flush ceiling
    /// counts base pages. The answer must be a power of two from 4 KiB to
    /// 512 GiB (what [`PageSize`] holds), the same on every CPU, and never
    /// change.
    fn base_page(&self) -> PageSize {
        PageSize::SIZE_4K
    }

    /// Invalidates this CPU's non-global entries of `asid`, and its
    /// paging-structure (walk) cache entries for `asid` at every level.
    ///
    /// The crate relies on the second half: a CPU that catches up by
    /// generation with this flush may have cached pointers to page tables
    /// freed meanwhile ([`TableHold`](crate::TableHold) releases such
    /// tables once every lazy CPU did). Both hardware forms used here do
    /// it: on x86, INVPCID single-context and a MOV to CR3 (Intel SDM
    /// vol. 3A, 4.10.4.1, "Operations that Invalidate TLBs and
    /// Paging-Structure Caches"); on arm64, TLBI ASIDE1, which invalidates
    /// cached copies of translation table entries of every level for the
    /// ASID (Arm ARM, "TLB maintenance instructions").
    fn flush_local_asid(&self, asid: Asid);

    /// Invalidates every entry of every ASID on this CPU, paging-structure
    /// cache entries included; global entries too when `include_global`
    /// is true.
    fn flush_local_all(&self, include_global: bool);

    /// Sends the TLB-flush interrupt to every CPU in `targets` (never the
    /// current CPU: the crate flushes that one itself).
    fn send_flush_ipi(&self, targets: &CpuSet);

    /// Loads the address space whose ASID is `asid` and whose page-table
    /// root (opaque to the crate, for example a physical address for CR3) is
    /// `root`.
    ///
    /// [`switch_mm`](crate::switch_mm) calls it, and a kernel loads roots
    /// only through `switch_mm`: a root loaded by calling this directly is
    /// outside the crate's bookkeeping, so flushes of that address space
    /// skip the CPU (the calling CPU's own case is refused,
    /// [`Error::UntrackedRoot`](crate::Error::UntrackedRoot), and
    /// [`check_cpu_state`](crate::check_cpu_state) finds it on any CPU).
    ///
    /// # Safety
    ///
    /// `root` must be a valid page-table root that maps the code and data
    /// the CPU is running from.
    unsafe fn switch_address_space(&self, asid: Asid, root: u64);

    /// Broadcast invalidation of one page on every CPU; only called when
    /// [`BROADCAST_INVALIDATE`](Arch::BROADCAST_INVALIDATE) is true. As
    /// with [`flush_local_page`](Arch::flush_local_page), the page may be a
    /// huge one, named by its first address, and its entries of every size
    /// must go.
    fn broadcast_flush_page(&self, asid: Asid, va: u64) {
        let _ = (asid, va);
    }

    /// [`broadcast_flush_page`](Arch::broadcast_flush_page) with what the
    /// crate knows of the entry, as for
    /// [`flush_local_page_sized`](Arch::flush_local_page_sized). The
    /// default ignores `leaf` and calls `broadcast_flush_page`.
    fn broadcast_flush_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
        let _ = leaf;
        self.broadcast_flush_page(asid, va);
    }

    /// Broadcast invalidation of one ASID on every CPU; only called when
    /// [`BROADCAST_INVALIDATE`](Arch::BROADCAST_INVALIDATE) is true.
    fn broadcast_flush_asid(&self, asid: Asid) {
        let _ = asid;
    }

    /// Broadcast invalidation of everything (global entries included when
    /// asked) on every CPU; only called when
    /// [`BROADCAST_INVALIDATE`](Arch::BROADCAST_INVALIDATE) is true.
    fn broadcast_flush_all(&self, include_global: bool) {
        let _ = include_global;
    }

    /// Waits until every broadcast invalidation this CPU issued has taken
    /// effect on every CPU (only this CPU's: one issued by another CPU may
    /// still be in flight).
    fn broadcast_sync(&self) {}

    /// Whether to carry out `request` by broadcast invalidation rather than
    /// IPIs, when it must reach `remote_cpus` (at least one) CPUs besides
    /// this one; only asked when
    /// [`BROADCAST_INVALIDATE`](Arch::BROADCAST_INVALIDATE) is true (a
    /// flush that reaches no other CPU is always done locally). Either
    /// answer is correct: IPIs work on any hardware, a broadcast reaches
    /// every CPU. It is a cost choice: a broadcast's
    /// barrier waits for every CPU of the machine and its invalidations
    /// disturb them all, while IPIs interrupt only the targets, so a kernel
    /// may broadcast only when an address space is active on at least some
    /// number of CPUs (as Linux does on x86 for address spaces it gives a
    /// global ASID). [`ShootdownReport::broadcast`](crate::ShootdownReport::broadcast)
    /// says which was chosen. The default always broadcasts.
    fn prefer_broadcast(&self, remote_cpus: usize, request: &FlushRequest) -> bool {
        let _ = (remote_cpus, request);
        true
    }

    /// Called in every busy-wait loop of the crate (x86: `pause`). A
    /// simulated CPU also takes its pending interrupts here.
    fn relax(&self) {
        core::hint::spin_loop();
    }

    /// Called for every flush the crate performs or requests. The default
    /// does nothing and compiles to nothing; a kernel overrides it to feed
    /// its tracer.
    fn trace(&self, event: &TraceEvent) {
        let _ = event;
    }
}
