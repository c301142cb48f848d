//! Changing the size of a mapping: splitting a huge page into base pages,
//! and promoting (collapsing) the base pages of a range into one huge page,
//! without any CPU ever holding two translations for one address that
//! differ.
//!
//! The sequence and its architecture rules are documented on
//! [`BrokenMapping`], which every caller meets.

use core::fmt;

use crate::arch::Arch;
use crate::mm::{flush_tlb_batched_pending, MmTlbState};
use crate::page_size::PageSize;
use crate::pte::check_aligned;
use crate::range::PageRange;
use crate::request::FlushRequest;
use crate::shootdown::{shootdown, ShootdownReport};
use crate::validate::{check_asid, check_space_range};
use crate::verify::space_caller;
use crate::Error;

/// Which change of page size a [`BrokenMapping`] is part of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HugeChange {
    /// One huge entry becomes a table of smaller ones (Linux's
    /// `__split_huge_pmd`, FreeBSD's demotion): the old entry is one huge
    /// page, flushed with one invalidation.
    Split,
    /// The smaller entries of a range become one huge entry (Linux's
    /// `khugepaged` collapse, FreeBSD's promotion): the old entries are
    /// base pages (or anything smaller than the huge page), flushed one
    /// 4 KiB page at a time up to the ceiling, as a whole ASID above it;
    /// the leaf table they were in is freed after the flush.
    Promote,
}

/// Step 1 done: the old entry is no longer in the page table, but CPUs may
/// still hold it (and, for a promotion, point to the unlinked leaf table).
/// [`flush`](Self::flush) is owed before any new entry is written.
///
/// `T` is what the kernel's break closure returned: the old entry's value,
/// the detached leaf table, whatever the make step needs.
///
/// The sequence is the same for both, and for both architectures:
///
/// 1. **Break.** The kernel replaces the old entry with a non-present one
///    (the huge entry for a split; for a promotion, the upper-level entry
///    that points to the leaf table, which unlinks that table).
/// 2. **Flush** the old entries from every CPU that may hold them,
///    including lazy CPUs, at the old entries' size.
/// 3. **Make.** Only then does the kernel write the new entries.
///
/// [`split_huge_mapping`] and [`promote_to_huge`] check their input and do
/// step 1 (through a closure: the entry writes are the kernel's), and hand
/// back a [`BrokenMapping`]; its [`flush`](BrokenMapping::flush) does step
/// 2 and hands back a [`FlushedBreak`], whose [`make`](FlushedBreak::make)
/// runs the kernel's closure for step 3. Each value is `#[must_use]`: the
/// types let no new entry be written before the flush.
///
/// Why this order, on each architecture:
///
/// - **x86** (Intel SDM vol. 3A, 4.10.2.3, "Details of TLB Use"): once the
///   page size used for an address changes, the TLB may hold a translation
///   of each size for it, and an access may use either; if the two differ
///   in frame or permissions the result is undefined. The manual's remedy
///   is exactly the three steps above: clear the present bit, invalidate
///   the translations of the affected addresses (4.10.4.2, "Recommended
///   Invalidation"), then write the entry of the new size. One `INVLPG` of
///   any address inside a large page removes every entry cached for it,
///   split into smaller ones or not (vol. 2, `INVLPG`); small entries need
///   one each.
/// - **arm64** (Arm ARM, DDI 0487, "Using break-before-make when updating
///   translation table entries"): changing the block size of a mapping
///   requires break-before-make, since two entries of different sizes for
///   one address may raise a TLB conflict abort ("TLB conflict aborts"):
///   write an invalid entry, `DSB`, `TLBI` by address for the old entries
///   (one per block; one per page for page entries), `DSB`, and only then
///   the new entries. The crate's aarch64 shootdown issues `DSB ISHST`
///   before its `TLBI ... IS` instructions and completes them with
///   `DSB ISH; ISB`, so [`BrokenMapping::flush`] returning is the second
///   barrier. The kernel still makes its new entries visible to the table
///   walker as it does for any new mapping (a `DSB ISHST` after the
///   write).
///
/// The flush reaches lazy CPUs too ([`MmTlbState::table_flush_targets`]):
/// a lazy CPU keeps the space's root loaded, and its MMU may fill entries
/// speculatively from the new tables while it still holds the old entry,
/// which is the conflict the break exists to prevent; and a promotion
/// frees the leaf table, which a lazy CPU's walk caches may still point to
/// (CVE-2025-22045 was a collapse flushed as if it freed no table, which
/// skipped lazy CPUs). CPUs that switched away on a tagged TLB are not
/// interrupted: they fill nothing for an address space they have not
/// loaded, and flush its ASID by generation before they load it again.
///
/// What a walk cache holds goes with the flush: a promotion flushes every
/// 4 KiB page of the range (above [`Arch::FULL_FLUSH_CEILING`] pages, the
/// whole ASID), which on x86 drops the ASID's paging-structure-cache
/// entries (vol. 3A, 4.10.4.1, "Operations that Invalidate TLBs and
/// Paging-Structure Caches") and on arm64 (`TLBI` by address without the
/// last-level hint: "TLB maintenance instructions") the entries of every
/// level on the way to each address, the unlinked leaf table's included.
#[must_use = "CPUs may still cache the old entry: flush before writing the new ones"]
#[derive(Debug)]
pub struct BrokenMapping<'a, T> {
    mm: &'a MmTlbState,
    start: u64,
    size: PageSize,
    /// The architecture's base page: a promotion's old entries.
    base: PageSize,
    change: HugeChange,
    old: T,
}

/// Step 2 done: no CPU holds the old entries any more (nor, for a
/// promotion, a pointer to the old leaf table). [`make`](Self::make)
/// writes the new ones.
#[must_use = "the old mapping is broken: write the new entries with `make`"]
#[derive(Debug)]
pub struct FlushedBreak<T> {
    start: u64,
    size: PageSize,
    change: HugeChange,
    report: ShootdownReport,
    old: T,
}

/// A [`BrokenMapping::flush`] that failed (a shootdown from an interrupt
/// nested in another, a CPU no longer online...): the old entry stays
/// broken and the flush owed; call [`flush`](BrokenMapping::flush) on
/// `broken` again (from a CPU where it can run) to finish.
#[must_use = "the flush is still owed: retry `broken.flush`"]
#[derive(Debug)]
pub struct FlushFailed<'a, T> {
    /// Why the flush failed; nothing was flushed by this attempt.
    pub error: Error,
    /// The break, with its flush still owed.
    pub broken: BrokenMapping<'a, T>,
}

impl<T> fmt::Display for FlushFailed<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the flush after breaking the {} mapping at {:#x} failed: {}",
            self.broken.size, self.broken.start, self.error
        )
    }
}

/// Step 1 of a split: checks, then runs `clear`, which must replace the
/// huge entry mapping `va..va + size` of `mm` with a non-present one (and
/// return whatever the make step needs, typically the old entry's value,
/// to build the table of small entries from). Returns the
/// [`BrokenMapping`], whose [`flush`](BrokenMapping::flush) invalidates the
/// huge page once, on every CPU that may cache it, lazy ones included.
///
/// ```text
/// let broken = split_huge_mapping(arch, mm, va, PageSize::SIZE_2M, || pmd.clear())?;
/// let flushed = broken.flush(arch).map_err(|f| f.error)?; // or retry f.broken
/// flushed.make(|old| pmd.populate(table_of_small_entries(old)));
/// ```
///
/// The caller guarantees: it holds the lock that serialises changes of this
/// entry (the page-table lock), from before this call until `make`
/// returns; `clear` writes a non-present entry atomically with respect to
/// the hardware setting accessed and dirty bits (an atomic exchange, whose
/// old value keeps them), and writes no other entry; and no new entry for
/// the range is written before `make`.
/// For the kernel's space ([`MmTlbState::kernel`]) on an `Arch` whose
/// kernel flushes rely on global pages
/// ([`Arch::kernel_flush_needs_global`]), the old entry was global: a
/// non-global one cached under another ASID would survive the flush (the
/// crate cannot see the entry the closure clears, so it cannot refuse it
/// with [`Error::NonGlobalKernelEntry`] as its other walks do).
///
/// Errors, before `clear` runs and with no entry changed:
/// [`Error::NotHuge`] (`size` is not larger than the architecture's base page); [`Error::Unaligned`] and
/// [`Error::StrideUnaligned`] (`va` not aligned to a page, to `size`);
/// [`Error::RangeOverflow`], [`Error::NonCanonical`] and
/// [`Error::KernelHalf`] (as for [`flush_tlb_range`](crate::flush_tlb_range));
/// [`Error::AsidOutOfRange`], [`Error::OtherMachine`],
/// [`Error::CpuNotOnline`], [`Error::UntrackedRoot`]; and those of
/// [`flush_tlb_batched_pending`], which runs first (contract rule 5: a
/// batched flush of `mm` still pending is done before the mapping
/// changes).
pub fn split_huge_mapping<'a, A: Arch, T>(
    arch: &A,
    mm: &'a MmTlbState,
    va: u64,
    size: PageSize,
    clear: impl FnOnce() -> T,
) -> Result<BrokenMapping<'a, T>, Error> {
    break_mapping(arch, mm, va, size, HugeChange::Split, clear)
}

/// Step 1 of a promotion (collapse): checks, then runs `clear`, which must
/// replace the entry that points to the table mapping `va..va + size` of
/// `mm` (for a 2 MiB page, the page-directory entry of its leaf table)
/// with a non-present one, unlinking that table, and return what the make
/// step needs (typically the detached table, whose entries name the old
/// frames). Returns the [`BrokenMapping`], whose
/// [`flush`](BrokenMapping::flush) invalidates every 4 KiB page of the
/// range (the whole ASID above [`Arch::FULL_FLUSH_CEILING`] pages) on every
/// CPU that may cache one, lazy ones included, and with them the walk
/// caches' pointers to the unlinked table.
///
/// ```text
/// let broken = promote_to_huge(arch, mm, va, PageSize::SIZE_2M, || pmd.detach_table())?;
/// let flushed = broken.flush(arch).map_err(|f| f.error)?;
/// flushed.make(|table| {
///    copy_pages_into(huge_frame, &table); // no write can reach the old frames now
///    pmd.set_huge(huge_frame);
///    free_table_after_grace_period(table); // and the old frames
/// });
/// ```
///
/// The caller guarantees what [`split_huge_mapping`] asks, and: the
/// contents of the old frames are copied only in `make` (a CPU may write
/// through a stale entry until the flush); the old leaf table and the old
/// frames are freed only after the flush (in `make` or later: contract
/// rules 2 and 6), and the table only after lockless walkers are excluded
/// where the kernel has them ([`ipi_sync`](crate::ipi_sync) or its grace
/// period). Errors: as for [`split_huge_mapping`], before `clear` runs.
pub fn promote_to_huge<'a, A: Arch, T>(
    arch: &A,
    mm: &'a MmTlbState,
    va: u64,
    size: PageSize,
    clear: impl FnOnce() -> T,
) -> Result<BrokenMapping<'a, T>, Error> {
    break_mapping(arch, mm, va, size, HugeChange::Promote, clear)
}

/// The huge page `va..va + size` of `mm`, checked as every entry point
/// checks a range it is about to change.
fn check_huge<A: Arch>(arch: &A, mm: &MmTlbState, va: u64, size: PageSize) -> Result<PageRange, Error> {
    if size <= arch.base_page() {
        return Err(Error::NotHuge { size: size.bytes() });
    }
    check_aligned(va)?;
    if size.align_down(va) != va {
        return Err(Error::StrideUnaligned {
            start: va,
            pages: size.base_pages(),
            stride: size.bytes(),
        });
    }
    let range = PageRange::new(va, size.base_pages())?;
    check_space_range(arch, mm, range)?;
    check_asid(arch, mm.asid())?;
    space_caller(arch, mm)?;
    Ok(range)
}

fn break_mapping<'a, A: Arch, T>(
    arch: &A,
    mm: &'a MmTlbState,
    va: u64,
    size: PageSize,
    change: HugeChange,
    clear: impl FnOnce() -> T,
) -> Result<BrokenMapping<'a, T>, Error> {
    check_huge(arch, mm, va, size)?;
    // Contract rule 5: a CPU may still write through an entry a batch
    // deferred; the change below must not be made under it.
    flush_tlb_batched_pending(arch, mm)?;
    let old = clear();
    Ok(BrokenMapping {
        mm,
        start: va,
        size,
        base: arch.base_page(),
        change,
        old,
    })
}

impl<'a, T> BrokenMapping<'a, T> {
    /// The huge page's first address.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// The huge page's size.
    pub fn size(&self) -> PageSize {
        self.size
    }

    /// Split or promotion.
    pub fn change(&self) -> HugeChange {
        self.change
    }

    /// What the break closure returned.
    pub fn old(&self) -> &T {
        &self.old
    }

    /// The size of the entries the flush removes, one invalidation each:
    /// the huge page for a split, the architecture's base pages for a
    /// promotion (an invalidation of each base page removes an entry of
    /// any size that covers it, so a range mapped by a mix of sizes is
    /// covered too).
    pub fn flush_stride(&self) -> PageSize {
        match self.change {
            HugeChange::Split => self.size,
            HugeChange::Promote => self.base,
        }
    }

    /// Step 2: flushes the old entries from every CPU that may hold them
    /// (see [`BrokenMapping`] for who and why), waiting until each has. On success no CPU holds a
    /// translation of the range, nor a walk-cache pointer to a table the
    /// break unlinked, and [`FlushedBreak::make`] may write the new
    /// entries.
    ///
    /// Errors: a [`FlushFailed`] holding this break, its flush still owed
    /// (those of [`shootdown`]; [`Error::CpuNotOnline`],
    /// [`Error::UntrackedRoot`] and [`Error::OtherMachine`] for the calling
    /// CPU, which may differ from the one that broke the entry).
    pub fn flush<A: Arch>(self, arch: &A) -> Result<FlushedBreak<T>, FlushFailed<'a, T>> {
        match self.shoot(arch) {
            Ok(report) => Ok(FlushedBreak {
                start: self.start,
                size: self.size,
                change: self.change,
                report,
                old: self.old,
            }),
            Err(error) => Err(FlushFailed { error, broken: self }),
        }
    }

    fn shoot<A: Arch>(&self, arch: &A) -> Result<ShootdownReport, Error> {
        space_caller(arch, self.mm)?;
        let range = PageRange::new(self.start, self.size.base_pages())?;
        // After the break: the generation this advances covers it, so a
        // CPU that switched away flushes the ASID before loading it again.
        // Lazy CPUs are reached (see the type's documentation).
        let (targets, step) = self.mm.table_flush_targets_step(arch);
        let mut req = FlushRequest::new();
        req.add_huge_range_step(
            self.mm.asid(),
            range,
            self.flush_stride(),
            A::FULL_FLUSH_CEILING,
            step,
        )?;
        shootdown(arch, &targets, &req)
    }
}

impl<T> FlushedBreak<T> {
    /// The huge page's first address.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// The huge page's size.
    pub fn size(&self) -> PageSize {
        self.size
    }

    /// Split or promotion.
    pub fn change(&self) -> HugeChange {
        self.change
    }

    /// What the flush did: the CPUs it interrupted, whether it ran locally
    /// or by broadcast.
    pub fn report(&self) -> ShootdownReport {
        self.report
    }

    /// Step 3: runs `install` with what the break closure returned, to
    /// write the new entries (for a split, link a table of small entries;
    /// for a promotion, copy the old frames' contents and write the huge
    /// entry, then free the old table and frames as [`promote_to_huge`]
    /// says), and returns what it returns.
    pub fn make<R>(self, install: impl FnOnce(T) -> R) -> R {
        install(self.old)
    }
}

#[cfg(all(test, feature = "mock", not(loom)))]
mod tests {
    use std::string::ToString;

    use super::*;
    use crate::arch::mock::{MockConfig, MockMachine};
    use crate::Asid;

    /// The flush stride of each change, and a failed flush's message
    /// naming the break it holds.
    #[test]
    fn strides_and_the_failed_flush_message() {
        let m = MockMachine::new(MockConfig::x86_like(2)).unwrap();
        let mm = m.new_mm(Asid::new(1).unwrap()).unwrap();
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        cpu0.switch_to(&mm).unwrap();
        cpu1.switch_to(&mm).unwrap();
        let va = 0x4000_0000;
        let split = split_huge_mapping(&cpu0, &mm, va, PageSize::SIZE_1G, || 7).unwrap();
        assert_eq!(
            (split.start(), split.size(), *split.old()),
            (va, PageSize::SIZE_1G, 7)
        );
        assert_eq!(split.flush_stride(), PageSize::SIZE_1G);
        let failed = cpu0.in_shootdown(|| split.flush(&cpu0)).unwrap().unwrap_err();
        assert_eq!(
            failed.to_string(),
            "the flush after breaking the 1 GiB mapping at 0x40000000 failed: \
             CPU 0 re-entered a TLB shootdown while one was in flight"
        );
        let flushed = failed.broken.flush(&cpu0).unwrap();
        assert_eq!(flushed.change(), HugeChange::Split);
        // The flushed break names the huge page it was made for.
        assert_eq!((flushed.start(), flushed.size()), (va, PageSize::SIZE_1G));
        assert_eq!(flushed.make(|old| old + 1), 8);
        let promote = promote_to_huge(&cpu0, &mm, va, PageSize::SIZE_2M, || ()).unwrap();
        assert_eq!(promote.flush_stride(), PageSize::SIZE_4K);
        let flushed = promote.flush(&cpu0).unwrap();
        assert_eq!(flushed.report().remote_cpus, 1);
        assert_eq!(
            (flushed.start(), flushed.size(), flushed.change()),
            (va, PageSize::SIZE_2M, HugeChange::Promote)
        );
        flushed.make(|()| ());
    }
}
