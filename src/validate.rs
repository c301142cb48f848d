//! The checks every entry point runs before it touches a page-table entry
//! or sends a request: addresses aligned and canonical for the
//! architecture ([`Arch::va_bits`]), ranges that do not cross the hole
//! between the two halves of the address space, ASIDs that fit the
//! hardware's width ([`Arch::asid_bits`]).

use crate::arch::Arch;
use crate::asid::Asid;
use crate::pte::check_aligned;
use crate::range::{is_canonical, PageRange};
use crate::request::{FlushRequest, FlushScope};
use crate::Error;

/// Checks that `va` is page-aligned ([`Error::Unaligned`]) and canonical
/// on this architecture ([`Error::NonCanonical`], see [`Arch::va_bits`]).
pub fn check_va<A: Arch + ?Sized>(arch: &A, va: u64) -> Result<(), Error> {
    check_aligned(va)?;
    if is_canonical(va, arch.va_bits()) {
        Ok(())
    } else {
        Err(Error::NonCanonical { addr: va })
    }
}

/// Checks that every page of `range` is canonical on this architecture and
/// that the range does not cross the hole between the lower and the upper
/// half of the address space ([`Error::NonCanonical`] naming the first
/// address that is not).
pub fn check_range<A: Arch + ?Sized>(arch: &A, range: PageRange) -> Result<(), Error> {
    let Some(last) = range.last() else {
        return Ok(());
    };
    check_va(arch, range.start())?;
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
pub fn check_request<A: Arch + ?Sized>(arch: &A, request: &FlushRequest) -> Result<(), Error> {
    if let FlushScope::Ranges(ranges) = request.scope() {
        for r in ranges {
            check_range(arch, PageRange::new(r.start, u64::from(r.pages))?)?;
        }
    }
    for &asid in request.asids() {
        check_asid(arch, asid)?;
    }
    Ok(())
}
