//! The checks every entry point runs before it touches a page-table entry
//! or sends a request: addresses aligned and canonical for the
//! architecture ([`Arch::va_bits`]), ranges that do not cross the hole
//! between the two halves of the address space, ASIDs that fit the
//! hardware's width ([`Arch::asid_bits`]).

use crate::arch::Arch;
use crate::asid::Asid;
use crate::gather::TableBounds;
use crate::mm::MmTlbState;
use crate::page_size::PageSize;
use crate::pte::{check_aligned, PAGE_SIZE};
use crate::range::{is_canonical, PageRange};
use crate::request::{FlushRequest, FlushScope};
use crate::Error;

/// Checks that `va` is aligned to the architecture's base page
/// ([`Error::Unaligned`], see [`Arch::base_page`]) and canonical on it
/// ([`Error::NonCanonical`], see [`Arch::va_bits`]).
pub fn check_va<A: Arch + ?Sized>(arch: &A, va: u64) -> Result<(), Error> {
    check_aligned(va)?;
    if arch.base_page().align_down(va) != va {
        return Err(Error::Unaligned { addr: va });
    }
    if is_canonical(va, arch.va_bits()) {
        Ok(())
    } else {
        Err(Error::NonCanonical { addr: va })
    }
}

/// Checks that `range` is whole base pages of the architecture
/// ([`Error::Unaligned`] for its start, [`Error::StrideUnaligned`] for its
/// length, see [`Arch::base_page`]), that every page of it is canonical on
/// the architecture and that the range does not cross the hole between the
/// lower and the upper half of the address space ([`Error::NonCanonical`]
/// naming the first address that is not).
pub fn check_range<A: Arch + ?Sized>(arch: &A, range: PageRange) -> Result<(), Error> {
    let Some(last) = range.last() else {
        return Ok(());
    };
    check_va(arch, range.start())?;
    let base = arch.base_page();
    if !range.pages().is_multiple_of(base.base_pages()) {
        return Err(Error::StrideUnaligned {
            start: range.start(),
            pages: range.pages(),
            stride: base.bytes(),
        });
    }
    let bits = arch.va_bits();
    if bits >= 64 {
        // Every address exists: there is no hole to cross.
        return Ok(());
    }
    // The start is canonical. From the upper half the range can only run
    // on in the upper half (it ends at the top at most); from the lower
    // half, the first address past it is the first non-canonical one.
    if !is_canonical(last, bits) || (range.start() >> 63) != (last >> 63) {
        let hole = if bits == 0 { 1 } else { 1u64 << (bits - 1) };
        return Err(Error::NonCanonical { addr: hole });
    }
    Ok(())
}

/// Refuses an upper-half address (bit 63 set) for a user space
/// ([`Error::KernelHalf`]); any address of the kernel's space passes.
pub(crate) fn check_user_half(mm: &MmTlbState, va: u64) -> Result<(), Error> {
    if !mm.is_kernel() && va >> 63 != 0 {
        return Err(Error::KernelHalf { va });
    }
    Ok(())
}

/// Checks an address of `mm` before a PTE of it changes: [`check_va`]
/// ([`Error::Unaligned`], [`Error::NonCanonical`]), and for a user space
/// that the address is in the lower half ([`Error::KernelHalf`]: the upper
/// half is the kernel's, shared by every address space, so a flush of the
/// user space would miss the CPUs running the others).
pub fn check_space_va<A: Arch + ?Sized>(arch: &A, mm: &MmTlbState, va: u64) -> Result<(), Error> {
    check_va(arch, va)?;
    check_user_half(mm, va)
}

/// Checks a range of `mm` before PTEs of it change: [`check_range`]
/// ([`Error::NonCanonical`]), and for a user space that no page of it is in
/// the upper half ([`Error::KernelHalf`] naming the first that is; with
/// 64-bit addresses there is no hole, and a range may run from one half
/// into the other).
pub fn check_space_range<A: Arch + ?Sized>(arch: &A, mm: &MmTlbState, range: PageRange) -> Result<(), Error> {
    check_range(arch, range)?;
    match range.last() {
        Some(last) if last >> 63 != 0 => check_user_half(mm, range.start().max(1 << 63)),
        _ => Ok(()),
    }
}

/// Checks the [`TableBounds`] a teardown of `range` in `mm` is given:
/// canonical, not across the hole and, for a user space, not in the
/// kernel's half, as for [`check_space_range`] ([`Error::NonCanonical`],
/// [`Error::KernelHalf`]); and enclosing `range`
/// ([`Error::OutsideTableBounds`] naming the range's first page below the
/// floor or at or above the ceiling).
pub fn check_table_bounds<A: Arch + ?Sized>(
    arch: &A,
    mm: &MmTlbState,
    range: PageRange,
    bounds: TableBounds,
) -> Result<(), Error> {
    check_space_range(arch, mm, bounds.span())?;
    if range.start() < bounds.floor() {
        return Err(Error::OutsideTableBounds { addr: range.start() });
    }
    match (range.last(), bounds.span().last()) {
        // The first page at or above the ceiling: the one after the
        // bounds' last page (the range's own last page is above it, so
        // that page exists), or the range's start for empty bounds.
        (Some(last), Some(bound)) if last > bound => Err(Error::OutsideTableBounds {
            addr: bound + PAGE_SIZE,
        }),
        (Some(_), None) => Err(Error::OutsideTableBounds { addr: range.start() }),
        _ => Ok(()),
    }
}

/// Checks the size a page table reports for the entry at `va`
/// ([`PageTable::entry_size`](crate::PageTable::entry_size)) against the
/// architecture's base page: [`Error::BelowBasePage`] when it is smaller.
pub(crate) fn check_entry_size<A: Arch + ?Sized>(arch: &A, va: u64, size: PageSize) -> Result<(), Error> {
    let base = arch.base_page();
    if size < base {
        return Err(Error::BelowBasePage {
            va,
            size: size.bytes(),
            base: base.bytes(),
        });
    }
    Ok(())
}

/// Checks that a user ASID fits the architecture's ASID width
/// ([`Arch::asid_bits`]); [`Asid::KERNEL`] always fits. Errors:
/// [`Error::AsidOutOfRange`].
pub fn check_asid<A: Arch + ?Sized>(arch: &A, asid: Asid) -> Result<(), Error> {
    if asid.is_kernel() {
        return Ok(());
    }
    let bits = arch.asid_bits().min(16);
    if u32::from(asid.value()) < (1u32 << bits) {
        Ok(())
    } else {
        Err(Error::AsidOutOfRange {
            asid: asid.value(),
            bits,
        })
    }
}

/// Checks that `arch` can carry `request` out: every page canonical
/// ([`Error::NonCanonical`]) and every ASID within its width
/// ([`Error::AsidOutOfRange`]). [`shootdown`](crate::shootdown) calls it
/// before anything is published, so that no remote CPU's interrupt handler
/// ever meets an address its invalidation instruction faults on.
///
/// A request that degraded to a full flush no longer lists its pages, but
/// it is refused all the same when a page ever added to it was not
/// canonical or a range crossed the hole: the error then names where the
/// hole begins, or for the upper half the lowest address added.
pub fn check_request<A: Arch + ?Sized>(arch: &A, request: &FlushRequest) -> Result<(), Error> {
    if let FlushScope::Ranges(ranges) = request.scope() {
        for r in ranges {
            // A range that does not fit the address space at its stride
            // is refused as one that runs past its top.
            let covered = r.covered().ok_or(Error::NonCanonical { addr: r.start })?;
            check_range(arch, covered)?;
        }
    }
    let bits = arch.va_bits();
    if bits < 64 {
        let extent = request.extent();
        // A range that starts in the lower half stays below the hole when
        // its last page does; one in the upper half runs on to the top.
        if extent
            .lower_last
            .is_some_and(|last| last >> 63 != 0 || !is_canonical(last, bits))
        {
            let hole = if bits == 0 { 1 } else { 1u64 << (bits - 1) };
            return Err(Error::NonCanonical { addr: hole });
        }
        if let Some(start) = extent.upper_start.filter(|&s| !is_canonical(s, bits)) {
            return Err(Error::NonCanonical { addr: start });
        }
    }
    for &asid in request.asids() {
        check_asid(arch, asid)?;
    }
    Ok(())
}
