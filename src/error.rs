//! The crate's error type.

use core::fmt;

/// Everything that can go wrong at a public entry point of this crate.
///
/// Bad input never panics: it comes back as one of these values, and the
/// operation that reported it changed nothing (a batch that could not be
/// flushed is still pending, so no flush is ever lost).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Error {
    /// A CPU index at or above [`MAX_CPUS`](crate::MAX_CPUS), or a CPU the
    /// machine does not have.
    CpuOutOfRange {
        /// The index that was given.
        cpu: usize,
        /// The first index that is out of range.
        limit: usize,
    },
    /// A virtual address that should be page-aligned is not.
    Unaligned {
        /// The address that was given.
        addr: u64,
    },
    /// A range given by its bounds whose start lies above its end.
    InvalidRange {
        /// First address of the range.
        start: u64,
        /// One past the last address of the range.
        end: u64,
    },
    /// A range that would run past the top of the 64-bit address space.
    RangeOverflow {
        /// First address of the range.
        start: u64,
        /// How many pages were asked for.
        pages: u64,
    },
    /// An address the architecture cannot translate: not in canonical form
    /// for its [`va_bits`](crate::Arch::va_bits), or a range that crosses
    /// the hole between the two halves of the address space.
    NonCanonical {
        /// The first offending address.
        addr: u64,
    },
    /// The [`TableBounds`](crate::TableBounds) given with a teardown do not
    /// enclose its range: their floor lies above the range's start, or
    /// their ceiling below its end. Nothing changed.
    OutsideTableBounds {
        /// The range's first page outside the bounds.
        addr: u64,
    },
    /// A user ASID wider than the architecture's
    /// [`asid_bits`](crate::Arch::asid_bits): the hardware would confuse it
    /// with another address space's.
    AsidOutOfRange {
        /// The ASID value.
        asid: u16,
        /// How many bits the hardware's ASIDs have.
        bits: u32,
    },
    /// A batch or gather holding pending work of one machine was used with
    /// the [`Arch`](crate::Arch) of another (a different
    /// [`TlbShootdown`](crate::TlbShootdown)): flushing there would leave
    /// the first machine's CPUs untouched. Nothing changed.
    OtherMachine,
    /// A [`MmuGather`](crate::MmuGather) holding pending work of one
    /// address space was asked to work on another: finish the first
    /// teardown ([`MmuGather::finish`](crate::MmuGather::finish)) before
    /// starting the next. Nothing changed.
    OtherAddressSpace,
    /// A reserved ASID value (0, or the kernel's) was given where a user
    /// ASID belongs.
    ReservedAsid,
    /// A fixed-capacity reverse map has no room for another mapping.
    RmapFull {
        /// How many mappings it holds.
        capacity: usize,
    },
    /// A shootdown was started on a CPU whose own request slot is already in
    /// use: the caller re-entered the shootdown code from an interrupt on the
    /// same CPU. Nothing was flushed and nothing was lost; retry from a
    /// context that is not nested inside another shootdown.
    ShootdownReentered {
        /// The CPU that tried to start a second shootdown.
        cpu: usize,
    },
    /// A hardware CPU identifier (x86: APIC ID) that a CPU table cannot
    /// record: the value the table reserves for "none" (x86: `0xFFFF_FFFF`,
    /// which is also the x2APIC broadcast destination), or one already
    /// registered for another CPU index. Nothing was recorded.
    InvalidHardwareId {
        /// The identifier that was given.
        hw_id: u32,
    },
    /// A CPU index that is already registered with another hardware
    /// identifier. Nothing was recorded.
    CpuAlreadyRegistered {
        /// The CPU index.
        cpu: usize,
    },
    /// The running CPU's hardware identifier (x86: APIC ID) is not in the
    /// CPU table: the CPU was never registered, so the crate cannot tell
    /// which CPU it is. Nothing changed; register it first.
    UnregisteredCpu {
        /// The running CPU's hardware identifier.
        hw_id: u32,
    },
    /// The address space given is not the one the running CPU has loaded
    /// ([`enter_lazy_tlb`](crate::enter_lazy_tlb),
    /// [`leave_lazy_tlb`](crate::leave_lazy_tlb)), or is the kernel's: a
    /// lazy mark on a space the CPU does not run would let flushes skip
    /// the one it does. Nothing changed; switch to it with
    /// [`switch_mm`](crate::switch_mm) first.
    NotLoaded {
        /// The running CPU.
        cpu: usize,
    },
    /// The CPU is not in the online set (it never came online, or already
    /// left): a crate call that flushes, defers a flush or loads a user
    /// address space on it (shootdowns reach online CPUs only, its own
    /// flush included), or a CPU asked to go offline that is not online.
    /// Nothing changed; bring it online first
    /// ([`prepare_cpu_online`](crate::prepare_cpu_online) and the `Arch`'s
    /// online path).
    CpuNotOnline {
        /// The CPU index.
        cpu: usize,
    },
    /// [`prepare_cpu_online`](crate::prepare_cpu_online) on a CPU that is
    /// online already: it would forget the address space the CPU runs and
    /// the ASIDs it caches entries of, and flushes would then skip the CPU
    /// while it still uses them. Nothing changed; call it only on a CPU's
    /// way back, before it joins [`Arch::online_cpus`](crate::Arch::online_cpus).
    AlreadyOnline {
        /// The CPU index.
        cpu: usize,
    },
    /// A CPU's removal from the online set did not take it out of the set
    /// [`Arch::online_cpus`](crate::Arch::online_cpus) reads: shootdowns
    /// still target it, so it must keep serving them, not park. Nothing
    /// was served.
    CpuStillOnline {
        /// The CPU index.
        cpu: usize,
    },
    /// A CPU asked to go offline
    /// ([`take_cpu_offline`](crate::take_cpu_offline)) still has a user
    /// address space loaded through [`switch_mm`](crate::switch_mm),
    /// lazily or not: while it is away no flush reaches it, yet its MMU
    /// may walk that space's page tables, which may be freed meanwhile.
    /// Nothing changed (the CPU is still online); switch to the kernel's
    /// space ([`MmTlbState::kernel`](crate::MmTlbState::kernel)) first.
    UserSpaceLoaded {
        /// The CPU.
        cpu: usize,
    },
    /// The running CPU has the address space's page-table root loaded, but
    /// not through [`switch_mm`](crate::switch_mm): the crate does not
    /// count it among the CPUs that run the space, so a flush of the space
    /// would skip it (and every other CPU that loaded the root the same
    /// way) while it may cache the space's entries. Nothing changed; load
    /// roots with `switch_mm` (a kernel with a single address space uses
    /// [`MmTlbState::kernel`](crate::MmTlbState::kernel), whose flushes
    /// reach every online CPU). Reported where [`Arch::root_loaded`] can
    /// tell (see [`check_cpu_state`](crate::check_cpu_state)).
    ///
    /// [`Arch::root_loaded`]: crate::Arch::root_loaded
    UntrackedRoot {
        /// The running CPU.
        cpu: usize,
    },
    /// A 2 MiB or 1 GiB page (an arm64 block) that an operation would
    /// have to take in part, or in a form a huge entry has not: a range of
    /// [`change_protection`](crate::change_protection) or
    /// [`MmuGather::unmap_range`](crate::MmuGather::unmap_range) that
    /// covers part of it (a range that covers it wholly takes it as one
    /// entry), a mapping of one of its 4 KiB pieces that a reverse-map
    /// walk ([`try_to_unmap`](crate::try_to_unmap),
    /// [`page_referenced`](crate::page_referenced)) met at an address that
    /// is not the huge page's first (the frame asked about is the piece
    /// the entry maps there: only the huge frame's first frame, at the huge
    /// page's first address, is taken, whole; a place where the entry maps
    /// another piece is no mapping of that frame and is stepped over, so a
    /// reverse map must report the huge page's first address, as
    /// [`Rmap::walk`](crate::Rmap::walk) requires of every mapping), or
    /// any mapping of it for
    /// [`migrate_pages`](crate::migrate_pages) or hwpoison (sizes as
    /// [`PageTable::entry_size`](crate::PageTable::entry_size) reports
    /// them); also a range with a huge page for a caller that handles
    /// 4 KiB frames only (`OffsetTeardown::munmap`). Split the huge page
    /// first, or take it whole. Nothing changed, with one exception that
    /// `change_protection` documents: an `update` that does not keep a
    /// huge entry's frame stops the call there (that entry left as it
    /// was, entries before it changed).
    HugePage {
        /// The first address the huge page maps.
        va: u64,
        /// Its size in bytes.
        size: u64,
    },
    /// A range to flush as pages of `stride` bytes
    /// ([`FlushRequest::add_huge_range`](crate::FlushRequest::add_huge_range))
    /// that does not start, or end, on a `stride` boundary: flushed at that
    /// stride, the 4 KiB entries between two invalidations would stay
    /// cached. Nothing was added. Also a huge page given to
    /// [`split_huge_mapping`](crate::split_huge_mapping) or
    /// [`promote_to_huge`](crate::promote_to_huge) whose first address is
    /// not aligned to its size (nothing changed).
    StrideUnaligned {
        /// The range's first address.
        start: u64,
        /// Its length in 4 KiB pages.
        pages: u64,
        /// The stride in bytes.
        stride: u64,
    },
    /// A page-table entry whose size
    /// ([`PageTable::entry_size`](crate::PageTable::entry_size)) is
    /// smaller than the architecture's base page
    /// ([`Arch::base_page`](crate::Arch::base_page)): a table of a 16 or
    /// 64 KiB kernel that answers 4 KiB (the default of `entry_size`)
    /// would have the crate change a quarter or a sixteenth of a page's
    /// entry and flush at a stride the hardware does not have. Nothing
    /// changed; make `entry_size` answer the base page for a page entry.
    BelowBasePage {
        /// The address whose entry was asked.
        va: u64,
        /// The size the table reported, in bytes.
        size: u64,
        /// The base page, in bytes.
        base: u64,
    },
    /// A size given to [`split_huge_mapping`](crate::split_huge_mapping)
    /// or [`promote_to_huge`](crate::promote_to_huge) that is not larger
    /// than a base page: there is no huge entry to split or to build.
    /// Nothing changed.
    NotHuge {
        /// The size in bytes.
        size: u64,
    },
    /// A frame whose physical address does not fit the 52 bits a
    /// page-table entry holds.
    FrameOutOfRange {
        /// The frame that was given.
        frame: crate::Frame,
    },
    /// A present entry of a user address space has the global bit
    /// ([`PteFlags::GLOBAL`](crate::PteFlags::GLOBAL)): the flushes the
    /// crate sends for a user space name its ASID, which leaves global
    /// entries in every TLB, and a CPU keeps using a global entry after it
    /// switches to another space (which then reaches this one's page). Map
    /// user pages without it (on x86 only kernel pages are global).
    /// Refused before anything changed, by every operation that would
    /// unmap, change or age such an entry.
    GlobalUserEntry {
        /// The address the entry maps.
        va: u64,
    },
    /// An address in the upper half of the address space (bit 63 set) was
    /// given for a user address space. The upper half is the kernel's, and
    /// every address space shares it: on AArch64 the tables of TTBR1_EL1
    /// translate it whatever TTBR0_EL1 holds (Arm ARM, the register
    /// description of TTBR1_EL1: the higher VA range), and x86-64 kernels
    /// point the upper 256 entries of every process's level-4 table at the
    /// same kernel tables (a convention, not the hardware's). A flush of a user
    /// space reaches only the CPUs that run that space and names its ASID,
    /// so a kernel page unmapped or changed through it would stay cached on
    /// the CPUs running the other spaces. Change kernel mappings through
    /// the kernel's space ([`MmTlbState::kernel`](crate::MmTlbState::kernel)),
    /// whose flushes reach every online CPU. Refused before anything
    /// changed, by every operation that takes an address of a user space.
    KernelHalf {
        /// The first such address.
        va: u64,
    },
    /// A present entry changed through the kernel's address space is not
    /// global, on an `Arch` whose kernel-page flush relies on every kernel
    /// mapping being global ([`Arch::kernel_flush_needs_global`](crate::Arch::kernel_flush_needs_global)):
    /// the flush would leave a copy cached under another ASID on a CPU
    /// that switched away, to be used when that ASID is loaded again. A
    /// process's page belongs to the process's state; a kernel page must be
    /// mapped global. Refused before anything changed, by every operation
    /// that would unmap, change or age such an entry.
    NonGlobalKernelEntry {
        /// The address the entry maps.
        va: u64,
    },
    /// The page table's own root ([`PageTable::root`](crate::PageTable::root))
    /// is not the root its [`MmTlbState`](crate::MmTlbState) was built with:
    /// flushes reach the CPUs that loaded the state's root through
    /// [`switch_mm`](crate::switch_mm), so a CPU that loaded these tables
    /// would be skipped, and the check for a root loaded behind the crate's
    /// back ([`Error::UntrackedRoot`]) would look at the wrong root. Build
    /// the state with the table's root. Refused, with nothing changed, by
    /// every operation that changes or ages entries of a user space.
    RootMismatch {
        /// The root the page table reports.
        table: u64,
        /// The root the address space's state holds.
        state: u64,
    },
    /// A hardware feature the caller claims (for example in the x86_64
    /// `Features`) that the CPU does not support, or that it supports but
    /// the kernel has not enabled: acting on the claim would execute an
    /// instruction that faults or load a register value the hardware does
    /// not allow. Nothing was built; pass what is enabled.
    FeatureUnavailable {
        /// The feature, with the control bit that enables it.
        feature: &'static str,
        /// Whether the CPU supports it (then it is only not enabled).
        supported: bool,
    },
    /// The kernel's CPU index for the running CPU
    /// (`arch::x86_64::X86_64::with_cpu_index`)
    /// names another CPU than the one its hardware identifier is registered
    /// as: every crate call would act as that other CPU. Found when the CPU
    /// comes online; nothing changed, and the CPU must not run crate code.
    CpuIndexMismatch {
        /// The index the kernel's hook gave.
        given: usize,
        /// The index the CPU is registered under.
        registered: usize,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::CpuOutOfRange { cpu, limit } => {
                write!(f, "CPU index {cpu} is out of range (limit {limit})")
            }
            Error::Unaligned { addr } => write!(f, "address {addr:#x} is not page-aligned"),
            Error::InvalidRange { start, end } => {
                write!(f, "invalid range {start:#x}..{end:#x}")
            }
            Error::RangeOverflow { start, pages } => {
                write!(
                    f,
                    "{pages} pages from {start:#x} run past the top of the address space"
                )
            }
            Error::NonCanonical { addr } => write!(f, "address {addr:#x} is not canonical"),
            Error::OutsideTableBounds { addr } => {
                write!(
                    f,
                    "page {addr:#x} of the range lies outside the table bounds (floor, ceiling) given with it"
                )
            }
            Error::AsidOutOfRange { asid, bits } => {
                write!(f, "ASID {asid} does not fit the hardware's {bits} bits")
            }
            Error::OtherMachine => write!(f, "pending work belongs to another machine"),
            Error::OtherAddressSpace => {
                write!(f, "the gather holds pending work of another address space")
            }
            Error::ReservedAsid => write!(f, "the kernel ASID is reserved"),
            Error::RmapFull { capacity } => write!(f, "the reverse map is full ({capacity} mappings)"),
            Error::ShootdownReentered { cpu } => {
                write!(f, "CPU {cpu} re-entered a TLB shootdown while one was in flight")
            }
            Error::InvalidHardwareId { hw_id } => {
                write!(f, "hardware CPU id {hw_id:#x} is reserved or already registered")
            }
            Error::CpuAlreadyRegistered { cpu } => {
                write!(f, "CPU {cpu} is already registered with another hardware id")
            }
            Error::UnregisteredCpu { hw_id } => {
                write!(f, "the running CPU (hardware id {hw_id:#x}) was never registered")
            }
            Error::NotLoaded { cpu } => {
                write!(f, "CPU {cpu} does not have that user address space loaded")
            }
            Error::CpuNotOnline { cpu } => write!(f, "CPU {cpu} is not online"),
            Error::UserSpaceLoaded { cpu } => {
                write!(f, "CPU {cpu} still has a user address space loaded")
            }
            Error::UntrackedRoot { cpu } => {
                write!(
                    f,
                    "CPU {cpu} has the address space's root loaded without switch_mm"
                )
            }
            Error::AlreadyOnline { cpu } => {
                write!(
                    f,
                    "CPU {cpu} is online already: it cannot be prepared to come online"
                )
            }
            Error::CpuStillOnline { cpu } => {
                write!(
                    f,
                    "CPU {cpu} left a set that is not the online set shootdowns read"
                )
            }
            Error::GlobalUserEntry { va } => {
                write!(f, "the user entry for {va:#x} is global")
            }
            Error::NonGlobalKernelEntry { va } => {
                write!(f, "the kernel entry for {va:#x} is not global")
            }
            Error::KernelHalf { va } => {
                write!(
                    f,
                    "{va:#x} lies in the kernel's half, which a user address space must not change"
                )
            }
            Error::RootMismatch { table, state } => {
                write!(
                    f,
                    "the page table's root {table:#x} is not its MmTlbState's root {state:#x}"
                )
            }
            Error::HugePage { va, size } => {
                write!(f, "a huge page of {size:#x} bytes maps {va:#x}")
            }
            Error::StrideUnaligned { start, pages, stride } => {
                write!(
                    f,
                    "{pages} pages at {start:#x} are not whole pages of {stride:#x} bytes"
                )
            }
            Error::BelowBasePage { va, size, base } => {
                write!(
                    f,
                    "the entry for {va:#x} maps {size:#x} bytes, less than the base page of {base:#x}"
                )
            }
            Error::NotHuge { size } => {
                write!(f, "{size:#x} bytes is no huge page size")
            }
            Error::FrameOutOfRange { frame } => {
                write!(f, "{frame:?} lies beyond 52 bits of physical address")
            }
            Error::CpuIndexMismatch { given, registered } => {
                write!(
                    f,
                    "the kernel's CPU index {given} names another CPU than the running one ({registered})"
                )
            }
            Error::FeatureUnavailable { feature, supported } => {
                if supported {
                    write!(f, "{feature} is claimed but the kernel has not enabled it")
                } else {
                    write!(f, "{feature} is claimed but the CPU does not support it")
                }
            }
        }
    }
}

impl core::error::Error for Error {}
