//! The sequence each flush of the aarch64 [`Arch`](super::Arch) executes:
//! which `TLBI` a page or an ASID gets, issued once or twice (repeat-TLBI
//! errata), with the barriers around it for a flush of this CPU or a
//! broadcast. The `aarch64` module documentation lists every sequence and
//! why each barrier is there.

use super::aarch64::Aarch64;
use super::aarch64_encoding::{tlbi_scope, TlbiScope};
use super::aarch64_granule::{tlbi_va_operand_for, ttl_hint};
use super::aarch64_instructions::{
    dsb_ish, dsb_ishst, dsb_nsh, dsb_nshst, isb, tlbi_aside1, tlbi_aside1is, tlbi_vaae1_operand,
    tlbi_vaae1is_operand, tlbi_vae1_operand, tlbi_vae1is_operand, tlbi_vmalle1, tlbi_vmalle1is,
};
use crate::arch::Asid;
use crate::page_size::PageSize;

/// One `TLBI`, as [`Aarch64`] issues it (once, or twice on CPUs with
/// repeat-TLBI errata). The by-address forms carry their whole operand
/// (ASID, level hint, address).
#[derive(Clone, Copy)]
pub(super) enum Tlbi {
    Vae1(u64),
    Vaae1(u64),
    Aside1(u16),
    Vmalle1,
    Vae1is(u64),
    Vaae1is(u64),
    Aside1is(u16),
    Vmalle1is,
}

impl Aarch64 {
    /// Issues `op`, a second time after a `DSB ISH` when the CPUs need
    /// repeated invalidations.
    #[inline]
    fn tlbi(&self, op: Tlbi) {
        let issue = |op: Tlbi| {
            // SAFETY: EL1 (constructor contract); every operand comes from
            // the checked encodings of `aarch64_encoding` and
            // `aarch64_granule`, with a level hint only where `page_op`
            // allows one.
            unsafe {
                match op {
                    Tlbi::Vae1(op) => tlbi_vae1_operand(op),
                    Tlbi::Vaae1(op) => tlbi_vaae1_operand(op),
                    Tlbi::Aside1(asid) => tlbi_aside1(asid),
                    Tlbi::Vmalle1 => tlbi_vmalle1(),
                    Tlbi::Vae1is(op) => tlbi_vae1is_operand(op),
                    Tlbi::Vaae1is(op) => tlbi_vaae1is_operand(op),
                    Tlbi::Aside1is(asid) => tlbi_aside1is(asid),
                    Tlbi::Vmalle1is => tlbi_vmalle1is(),
                }
            }
        };
        issue(op);
        if self.config.repeats_tlbi() {
            // The errata workaround: the first invalidation completes
            // everywhere before the same one is issued again.
            dsb_ish();
            issue(op);
        }
    }

    /// A complete invalidation on this CPU only.
    #[inline]
    pub(super) fn local(&self, op: Tlbi) {
        // This CPU's page-table stores are visible to its own walks before
        // the invalidation, so none refills an entry from an old value.
        dsb_nshst();
        self.tlbi(op);
        // The invalidation is complete on this CPU, with every access that
        // used the dropped entries...
        dsb_nsh();
        // ...and the instructions after it are fetched and translated anew.
        isb();
    }

    /// A broadcast invalidation, complete only at [`Arch::broadcast_sync`].
    #[inline]
    pub(super) fn broadcast(&self, op: Tlbi) {
        // This CPU's page-table stores are visible to every CPU's walks
        // before any CPU drops its entry, so no walk refills it from the
        // old value.
        dsb_ishst();
        self.tlbi(op);
    }

    /// The invalidation of the page at `va` of `asid`. With `leaf` (the
    /// size of the one leaf entry that mapped it, as the crate learned it
    /// from the page table, and no table freed on its way) and FEAT_TTL,
    /// the operand carries the level hint for that size when it is a page
    /// or block of the granule; otherwise none, since a wrong hint lets
    /// the hardware keep the entry (see `aarch64_granule`).
    pub(super) fn page_op(&self, asid: Asid, va: u64, leaf: Option<PageSize>, broadcast: bool) -> Tlbi {
        let granule = self.config.granule();
        let ttl = match leaf {
            Some(size) if self.config.level_hints() => ttl_hint(granule, size),
            _ => 0,
        };
        match (tlbi_scope(asid, self.config.asid_bits()), broadcast) {
            (TlbiScope::Asid(hw), false) => Tlbi::Vae1(tlbi_va_operand_for(hw, va, granule, ttl)),
            (TlbiScope::Asid(hw), true) => Tlbi::Vae1is(tlbi_va_operand_for(hw, va, granule, ttl)),
            (TlbiScope::AllAsids, false) => Tlbi::Vaae1(tlbi_va_operand_for(0, va, granule, ttl)),
            (TlbiScope::AllAsids, true) => Tlbi::Vaae1is(tlbi_va_operand_for(0, va, granule, ttl)),
        }
    }

    pub(super) fn asid_op(&self, asid: Asid, broadcast: bool) -> Tlbi {
        match (tlbi_scope(asid, self.config.asid_bits()), broadcast) {
            (TlbiScope::Asid(hw), false) => Tlbi::Aside1(hw),
            (TlbiScope::Asid(hw), true) => Tlbi::Aside1is(hw),
            (TlbiScope::AllAsids, false) => Tlbi::Vmalle1,
            (TlbiScope::AllAsids, true) => Tlbi::Vmalle1is,
        }
    }
}
