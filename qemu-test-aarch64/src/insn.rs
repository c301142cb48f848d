//! The TLB maintenance this kernel does by hand, in one place: the
//! crate's aarch64 `Arch` will replace these few instructions, and only
//! this module should have to change when it does.
//!
//! The sequence that makes a page-table change visible to every CPU in the
//! inner shareable domain is, on the CPU that changed the entry:
//!
//! 1. `DSB ISHST`: the entry's store is visible to every table walker
//!    before the invalidation is issued;
//! 2. `TLBI VAE1IS, Xt`: every CPU drops its EL1&0 entries for the page in
//!    the given ASID (Xt = ASID in bits 63:48, VA bits 55:12 in bits
//!    43:0); global entries for the page go too;
//! 3. `DSB ISH`: waits until every CPU has completed the invalidation (and
//!    finished the accesses that used the old entry);
//! 4. `ISB`: this CPU's later instructions are fetched and translated
//!    afresh.

use core::arch::asm;

/// The operand of `TLBI VAE1IS` (and the other by-VA forms) for one page of
/// one address space.
pub fn tlbi_va_operand(asid: u16, va: u64) -> u64 {
    u64::from(asid) << 48 | (va >> 12) & ((1 << 44) - 1)
}

/// Invalidates the page at `va` of address space `asid` on every CPU, after
/// publishing the page-table stores that precede it.
pub fn invalidate_page_all_cpus(asid: u16, va: u64) {
    // SAFETY: barriers and a TLB invalidation only change what the TLBs
    // hold, never memory; the asm is a compiler barrier too (no `nomem`),
    // so the page-table store before it is emitted before it.
    unsafe {
        asm!(
            "dsb ishst",
            "tlbi vae1is, {op}",
            "dsb ish",
            "isb",
            op = in(reg) tlbi_va_operand(asid, va),
            options(nostack, preserves_flags),
        );
    }
}

/// The same sequence with the non-broadcast `TLBI VAE1`: only the calling
/// CPU forgets the page. Only the negative control uses it (a shootdown
/// that forgot the inner shareable form).
pub fn invalidate_page_this_cpu(asid: u16, va: u64) {
    // SAFETY: as in `invalidate_page_all_cpus`, for this CPU's TLB only.
    unsafe {
        asm!(
            "dsb ishst",
            "tlbi vae1, {op}",
            "dsb ish",
            "isb",
            op = in(reg) tlbi_va_operand(asid, va),
            options(nostack, preserves_flags),
        );
    }
}

/// The same sequence without the `TLBI`: the page-table store is published
/// but no TLB forgets the old entry. Only the negative control uses it.
pub fn publish_without_invalidate() {
    // SAFETY: barriers only.
    unsafe { asm!("dsb ishst", "dsb ish", "isb", options(nostack, preserves_flags)) };
}
