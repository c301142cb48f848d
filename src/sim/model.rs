//! What kind of hardware a simulated machine is, and its shape.

use super::CostModel;
use crate::page_size::PageSize;

/// The hardware properties a simulated machine has.
pub trait Model: Send + Sync + 'static {
    /// See [`Arch::CLEAN_WRITE_REWALK`](crate::Arch::CLEAN_WRITE_REWALK).
    const CLEAN_WRITE_REWALK: bool;
    /// See [`Arch::ACCESSED_CLEAR_NEEDS_FLUSH`](crate::Arch::ACCESSED_CLEAR_NEEDS_FLUSH).
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool;
    /// See [`Arch::BROADCAST_INVALIDATE`](crate::Arch::BROADCAST_INVALIDATE).
    const BROADCAST_INVALIDATE: bool;
    /// What the machine's CPUs answer to
    /// [`Arch::fill_sets_accessed`](crate::Arch::fill_sets_accessed): whether
    /// the crate is told that fills set the accessed bit. What the
    /// simulated fills do is [`FILL_SKIPS_ACCESSED`](Model::FILL_SKIPS_ACCESSED)'s
    /// to say; a model that claims this with that knob on tells the crate
    /// something false, on purpose (a negative control).
    const FILL_SETS_ACCESSED: bool = false;
    /// Whether a simulated fill for a read caches the translation and
    /// leaves the PTE's accessed bit as it was (a write still sets the
    /// accessed and dirty bits). Off, every fill sets the bit in the
    /// page-table walk's locked update before it caches, as Intel and AMD
    /// document. On, it models a TLB that breaks that promise: hardware
    /// without it, or a hypervisor's shadow paging that caches a guest's
    /// translation without setting the guest's bit. Aging is less accurate
    /// there (a page in use may look idle, contract rule 8), and only a
    /// wrong [`FILL_SETS_ACCESSED`](Model::FILL_SETS_ACCESSED) claim risks
    /// more. The default is false.
    const FILL_SKIPS_ACCESSED: bool = false;
    /// See [`Arch::BATCH_BROADCAST_ON_ADD`](crate::Arch::BATCH_BROADCAST_ON_ADD).
    /// The simulated broadcast invalidations take effect at the issuing
    /// CPU's next `broadcast_sync`, and not before, whatever this says.
    const BATCH_BROADCAST_ON_ADD: bool = false;
    /// Whether a local flush of one page in the loaded ASID drops every
    /// walk-cache entry of that ASID, whatever address it serves (x86's
    /// `INVLPG`: Intel SDM vol. 3A, 4.10.4.1), rather than only the entries
    /// a walk for that page would use (arm64's `TLBI VAE1`). The default
    /// is the narrower rule; broadcast invalidations always follow it
    /// (arm64 `TLBI VAE1IS`, AMD `INVLPGB`).
    const PAGE_FLUSH_DROPS_ASID_WALKS: bool = false;
}

/// x86-like hardware: writes through clean entries re-walk, clearing the
/// accessed bit needs no flush, remote flushes need IPIs.
#[derive(Debug)]
pub struct X86Like;

impl Model for X86Like {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;
    const BROADCAST_INVALIDATE: bool = false;
    const FILL_SETS_ACCESSED: bool = true;
    const PAGE_FLUSH_DROPS_ASID_WALKS: bool = true;
}

/// x86 as seen by a kernel that does not claim the accessed-bit promise
/// ([`Arch::fill_sets_accessed`](crate::Arch::fill_sets_accessed) is
/// false): a CPU of a vendor that does not document it (Hygon, Zhaoxin),
/// or a guest that cannot vouch for its hypervisor's shadow paging.
/// Everything else is [`X86Like`]'s, and the simulated fills still set the
/// bit; only the crate is not told so, and its frame pools then wait for
/// flushes made after each unmap instead of taking aging epochs.
#[derive(Debug)]
pub struct X86NoAccessedPromise;

impl Model for X86NoAccessedPromise {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;
    const BROADCAST_INVALIDATE: bool = false;
    const FILL_SETS_ACCESSED: bool = false;
    const PAGE_FLUSH_DROPS_ASID_WALKS: bool = true;
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

/// arm64 as the crate's `aarch64` `Arch` describes it: [`BroadcastTlbi`]
/// whose batched unmaps issue each page's broadcast invalidation as the
/// page is added and wait for them all once, at the flush (Linux's arm64
/// shape). A fill does not promise to set the accessed bit.
#[derive(Debug)]
pub struct Arm64Like;

impl Model for Arm64Like {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = true;
    const BROADCAST_INVALIDATE: bool = true;
    const BATCH_BROADCAST_ON_ADD: bool = true;
}

/// x86 with AMD's broadcast invalidation (`INVLPGB` + `TLBSYNC`): x86's
/// guarantees ([`X86Like`]) plus remote invalidation without IPIs.
#[derive(Debug)]
pub struct X86Invlpgb;

impl Model for X86Invlpgb {
    const CLEAN_WRITE_REWALK: bool = true;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;
    const BROADCAST_INVALIDATE: bool = true;
    const FILL_SETS_ACCESSED: bool = true;
    const PAGE_FLUSH_DROPS_ASID_WALKS: bool = true;
}

/// How IPIs reach their target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// The target's handler runs at once, on the sending thread (interrupt
    /// masking is not modelled). Deterministic; for counting tests.
    Synchronous,
    /// The target CPU is a thread (see [`MockMachine::run_threaded`](super::MockMachine::run_threaded)) and
    /// takes the interrupt at its next instruction boundary while its
    /// interrupts are enabled.
    Threaded,
}

/// The shape of a simulated machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MockConfig {
    /// Number of CPUs, 1 to [`MAX_CPUS`](crate::MAX_CPUS).
    pub cpus: usize,
    /// Physical frames of memory.
    pub frames: usize,
    /// TLB entries per CPU.
    pub tlb_entries: usize,
    /// Frames set aside for page tables (one per 512-page region mapped).
    pub table_frames: usize,
    /// Whether TLB entries survive address-space switches (PCID).
    pub tagged_tlb: bool,
    /// Virtual-address width ([`Arch::va_bits`](crate::Arch::va_bits)): 48 like x86-64.
    pub va_bits: u32,
    /// ASID width ([`Arch::asid_bits`](crate::Arch::asid_bits)): 12 like x86's PCIDs.
    pub asid_bits: u32,
    /// How IPIs are delivered.
    pub delivery: Delivery,
    /// Cycle charges.
    pub cost: CostModel,
    /// How long each local flush takes in real time (threaded delivery):
    /// zero by default. A slow flush widens the window in which a protocol
    /// that acknowledged a request before carrying it out would let the
    /// initiator go on while the target still caches the entry.
    pub flush_delay_us: u32,
    /// On a model with broadcast invalidation ([`BroadcastTlbi`],
    /// [`X86Invlpgb`], [`Arm64Like`]): the
    /// fewest remote CPUs a flush must reach for the CPUs to broadcast
    /// rather than send IPIs ([`Arch::prefer_broadcast`](crate::Arch::prefer_broadcast)).
    /// 0, the default, always broadcasts.
    pub broadcast_min_remote: usize,
    /// The base page ([`Arch::base_page`](crate::Arch::base_page)): 4 KiB
    /// by default, or an arm64 granule's 16 or 64 KiB. The machine's own
    /// page tables then map pages of that size only (one entry each, met
    /// at its first address, of a frame aligned to it:
    /// [`MockMachine::alloc_huge_frame`](super::MockMachine::alloc_huge_frame)),
    /// its TLB entries are that large, and a leaf table spans what the
    /// granule's does (granule / 8 entries: 2 MiB, 32 MiB, 512 MiB).
    pub base_page: PageSize,
    /// Whether page invalidations honour a level hint
    /// ([`Arch::flush_local_page_sized`](crate::Arch::flush_local_page_sized)'s
    /// `leaf`) as arm64's FEAT_TTL may: one with a hint removes only leaf
    /// entries of exactly that size, and no walk-cache entry, so a wrong
    /// hint leaves the entry cached (the Arm ARM lets a `TLBI` with a
    /// wrong TTL invalidate nothing). Off by default: hints are ignored.
    pub level_hints: bool,
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
            flush_delay_us: 0,
            broadcast_min_remote: 0,
            base_page: PageSize::SIZE_4K,
            level_hints: false,
        }
    }

    /// The same machine with threaded IPI delivery.
    #[must_use]
    pub fn threaded(mut self) -> Self {
        self.delivery = Delivery::Threaded;
        self
    }
}
