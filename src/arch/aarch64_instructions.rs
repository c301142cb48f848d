//! The instructions the aarch64 [`Arch`](super::Arch) executes, each in a
//! small wrapper: the `TLBI` forms it issues (and `VALE1IS`, for kernels
//! that know a flush is leaf-only), the `DSB` and `ISB` barriers, and the
//! system registers it reads and writes, with [`Config::detect`], which
//! reads them.
//!
//! The `aarch64` module re-exports every public item, so that a kernel can
//! use the same, documented wrappers.

use core::arch::asm;

use super::aarch64_encoding::{tlbi_asid_operand, tlbi_va_operand, Config, Unsupported};

/// `TLBI VAE1IS`: on every CPU of the Inner Shareable domain, invalidates
/// the entries for the page at `va` tagged with `asid`, global entries for
/// it, and cached intermediate entries (walk caches) for it. Completes at
/// the next `DSB ISH` ([`dsb_ish`]).
///
/// # Safety
///
/// EL1 or higher (an EL0 `TLBI` is undefined and traps). Invalidating never
/// breaks memory safety by itself: the function is `unsafe` because
/// executing it at EL0 faults.
#[inline]
pub unsafe fn tlbi_vae1is(asid: u16, va: u64) {
    // SAFETY: the caller runs at EL1 or higher; a TLBI only drops cached
    // translations.
    unsafe { asm!("tlbi vae1is, {}", in(reg) tlbi_va_operand(asid, va), options(nostack, preserves_flags)) };
}

/// `TLBI VALE1IS`: as [`tlbi_vae1is`], but only last-level (leaf)
/// entries; walk caches for the address may survive. For unmapping a page
/// whose page-table frames all stay in place.
///
/// # Safety
///
/// EL1 or higher (see [`tlbi_vae1is`]).
#[inline]
pub unsafe fn tlbi_vale1is(asid: u16, va: u64) {
    // SAFETY: the caller runs at EL1 or higher; a TLBI only drops cached
    // translations.
    unsafe { asm!("tlbi vale1is, {}", in(reg) tlbi_va_operand(asid, va), options(nostack, preserves_flags)) };
}

/// `TLBI VAAE1IS`: on every CPU of the Inner Shareable domain, invalidates
/// the entries for the page at `va` whatever their ASID, global or not,
/// and walk caches for it.
///
/// # Safety
///
/// EL1 or higher (see [`tlbi_vae1is`]).
#[inline]
pub unsafe fn tlbi_vaae1is(va: u64) {
    // SAFETY: the caller runs at EL1 or higher; a TLBI only drops cached
    // translations. The operand's ASID field is RES0 for this form.
    unsafe { asm!("tlbi vaae1is, {}", in(reg) tlbi_va_operand(0, va), options(nostack, preserves_flags)) };
}

/// `TLBI ASIDE1IS`: on every CPU of the Inner Shareable domain,
/// invalidates every non-global entry tagged with `asid`, walk caches
/// included.
///
/// # Safety
///
/// EL1 or higher (see [`tlbi_vae1is`]).
#[inline]
pub unsafe fn tlbi_aside1is(asid: u16) {
    // SAFETY: the caller runs at EL1 or higher; a TLBI only drops cached
    // translations.
    unsafe { asm!("tlbi aside1is, {}", in(reg) tlbi_asid_operand(asid), options(nostack, preserves_flags)) };
}

/// `TLBI VMALLE1IS`: on every CPU of the Inner Shareable domain,
/// invalidates every EL1&0 stage 1 entry of the current VMID, global ones
/// included.
///
/// # Safety
///
/// EL1 or higher (see [`tlbi_vae1is`]).
#[inline]
pub unsafe fn tlbi_vmalle1is() {
    // SAFETY: the caller runs at EL1 or higher; a TLBI only drops cached
    // translations.
    unsafe { asm!("tlbi vmalle1is", options(nostack, preserves_flags)) };
}

/// `TLBI VAE1`: [`tlbi_vae1is`] on this CPU only. Completes at the next
/// `DSB NSH` ([`dsb_nsh`]).
///
/// # Safety
///
/// EL1 or higher (see [`tlbi_vae1is`]).
#[inline]
pub unsafe fn tlbi_vae1(asid: u16, va: u64) {
    // SAFETY: the caller runs at EL1 or higher; a TLBI only drops cached
    // translations.
    unsafe { asm!("tlbi vae1, {}", in(reg) tlbi_va_operand(asid, va), options(nostack, preserves_flags)) };
}

/// `TLBI VAAE1`: [`tlbi_vaae1is`] on this CPU only.
///
/// # Safety
///
/// EL1 or higher (see [`tlbi_vae1is`]).
#[inline]
pub unsafe fn tlbi_vaae1(va: u64) {
    // SAFETY: the caller runs at EL1 or higher; a TLBI only drops cached
    // translations. The operand's ASID field is RES0 for this form.
    unsafe { asm!("tlbi vaae1, {}", in(reg) tlbi_va_operand(0, va), options(nostack, preserves_flags)) };
}

/// `TLBI ASIDE1`: [`tlbi_aside1is`] on this CPU only.
///
/// # Safety
///
/// EL1 or higher (see [`tlbi_vae1is`]).
#[inline]
pub unsafe fn tlbi_aside1(asid: u16) {
    // SAFETY: the caller runs at EL1 or higher; a TLBI only drops cached
    // translations.
    unsafe { asm!("tlbi aside1, {}", in(reg) tlbi_asid_operand(asid), options(nostack, preserves_flags)) };
}

/// `TLBI VMALLE1`: [`tlbi_vmalle1is`] on this CPU only.
///
/// # Safety
///
/// EL1 or higher (see [`tlbi_vae1is`]).
#[inline]
pub unsafe fn tlbi_vmalle1() {
    // SAFETY: the caller runs at EL1 or higher; a TLBI only drops cached
    // translations.
    unsafe { asm!("tlbi vmalle1", options(nostack, preserves_flags)) };
}

/// `TLBI VAE1IS` with an operand built by the caller
/// ([`tlbi_va_operand_for`](super::aarch64::tlbi_va_operand_for): the ASID,
/// a FEAT_TTL level hint, VA\[55:12\]).
///
/// # Safety
///
/// EL1 or higher (see [`tlbi_vae1is`]); a non-zero TTL only on a CPU with
/// FEAT_TTL and only the right one for the entry (a wrong one may leave it
/// cached: see `aarch64_granule`).
#[inline]
pub unsafe fn tlbi_vae1is_operand(operand: u64) {
    // SAFETY: the caller runs at EL1 or higher and vouches for the hint; a
    // TLBI only drops cached translations.
    unsafe { asm!("tlbi vae1is, {}", in(reg) operand, options(nostack, preserves_flags)) };
}

/// `TLBI VAAE1IS` with an operand built by the caller (ASID field 0).
///
/// # Safety
///
/// As for [`tlbi_vae1is_operand`].
#[inline]
pub unsafe fn tlbi_vaae1is_operand(operand: u64) {
    // SAFETY: as for `tlbi_vae1is_operand`.
    unsafe { asm!("tlbi vaae1is, {}", in(reg) operand, options(nostack, preserves_flags)) };
}

/// `TLBI VAE1` (this CPU only) with an operand built by the caller.
///
/// # Safety
///
/// As for [`tlbi_vae1is_operand`].
#[inline]
pub unsafe fn tlbi_vae1_operand(operand: u64) {
    // SAFETY: as for `tlbi_vae1is_operand`.
    unsafe { asm!("tlbi vae1, {}", in(reg) operand, options(nostack, preserves_flags)) };
}

/// `TLBI VAAE1` (this CPU only) with an operand built by the caller (ASID
/// field 0).
///
/// # Safety
///
/// As for [`tlbi_vae1is_operand`].
#[inline]
pub unsafe fn tlbi_vaae1_operand(operand: u64) {
    // SAFETY: as for `tlbi_vae1is_operand`.
    unsafe { asm!("tlbi vaae1, {}", in(reg) operand, options(nostack, preserves_flags)) };
}

/// `DSB ISH`: waits until every earlier memory access of this CPU is
/// complete for the Inner Shareable domain, and every earlier broadcast
/// `TLBI` has taken effect on every CPU of it.
#[inline]
pub fn dsb_ish() {
    // SAFETY: a barrier only orders and waits; it is available at every
    // exception level. No `nomem`: the compiler keeps memory accesses on
    // their side of it.
    unsafe { asm!("dsb ish", options(nostack, preserves_flags)) };
}

/// `DSB ISHST`: waits until every earlier store of this CPU is complete
/// for the Inner Shareable domain (visible to every CPU's table walks).
#[inline]
pub fn dsb_ishst() {
    // SAFETY: as for `dsb_ish`.
    unsafe { asm!("dsb ishst", options(nostack, preserves_flags)) };
}

/// `DSB NSH`: waits until every earlier memory access and local `TLBI` of
/// this CPU is complete for this CPU.
#[inline]
pub fn dsb_nsh() {
    // SAFETY: as for `dsb_ish`.
    unsafe { asm!("dsb nsh", options(nostack, preserves_flags)) };
}

/// `DSB NSHST`: waits until every earlier store of this CPU is complete
/// for this CPU (visible to its own table walks).
#[inline]
pub fn dsb_nshst() {
    // SAFETY: as for `dsb_ish`.
    unsafe { asm!("dsb nshst", options(nostack, preserves_flags)) };
}

/// `ISB`: later instructions are fetched again, with every completed
/// change of system registers and of translations in effect.
#[inline]
pub fn isb() {
    // SAFETY: as for `dsb_ish`.
    unsafe { asm!("isb", options(nostack, preserves_flags)) };
}

/// Reads ID_AA64MMFR0_EL1 (ASID width, granules, physical address size).
///
/// # Safety
///
/// EL1 or higher (an EL0 read traps).
#[inline]
pub unsafe fn read_id_aa64mmfr0_el1() -> u64 {
    let value: u64;
    // SAFETY: the caller runs at EL1 or higher; reading an ID register has
    // no side effect.
    unsafe { asm!("mrs {}, id_aa64mmfr0_el1", out(reg) value, options(nomem, nostack, preserves_flags)) };
    value
}

/// Reads ID_AA64MMFR2_EL1 (among its fields TTL, FEAT_TTL's level hints).
/// On a CPU older than ARMv8.2 the register is an unallocated ID register,
/// which reads as zero (Arm ARM, D19, "the ID register encoding space").
///
/// # Safety
///
/// EL1 or higher (an EL0 read traps).
#[inline]
pub unsafe fn read_id_aa64mmfr2_el1() -> u64 {
    let value: u64;
    // SAFETY: the caller runs at EL1 or higher; reading an ID register has
    // no side effect. Named by its encoding (S3_0_C0_C7_2), which every
    // assembler takes.
    unsafe { asm!("mrs {}, s3_0_c0_c7_2", out(reg) value, options(nomem, nostack, preserves_flags)) };
    value
}

/// Reads TCR_EL1 (the EL1&0 translation setup).
///
/// # Safety
///
/// EL1 or higher.
#[inline]
pub unsafe fn read_tcr_el1() -> u64 {
    let value: u64;
    // SAFETY: the caller runs at EL1 or higher; the read has no side
    // effect.
    unsafe { asm!("mrs {}, tcr_el1", out(reg) value, options(nomem, nostack, preserves_flags)) };
    value
}

/// Reads MPIDR_EL1: the running CPU's affinity ([`mpidr_affinity`]).
///
/// # Safety
///
/// EL1 or higher.
///
/// [`mpidr_affinity`]: super::aarch64::mpidr_affinity
#[inline]
pub unsafe fn read_mpidr_el1() -> u64 {
    let value: u64;
    // SAFETY: the caller runs at EL1 or higher; the read has no side
    // effect.
    unsafe { asm!("mrs {}, mpidr_el1", out(reg) value, options(nomem, nostack, preserves_flags)) };
    value
}

/// Writes TTBR0_EL1: the lower region's table root and, with TCR_EL1.A1 =
/// 0, the current ASID ([`ttbr0_value`]). Takes effect for translations
/// after the next context synchronization ([`isb`]).
///
/// # Safety
///
/// EL1; `value`'s root is a valid translation table whose mappings the
/// kernel vouches for (every later access to a lower-region address goes
/// through it), and its ASID's TLB entries belong to that table.
///
/// [`ttbr0_value`]: super::aarch64::ttbr0_value
#[inline]
pub unsafe fn write_ttbr0_el1(value: u64) {
    // SAFETY: the caller guarantees a valid root and a matching ASID. No
    // `nomem`: memory accesses stay on their side of the switch.
    unsafe { asm!("msr ttbr0_el1, {}", in(reg) value, options(nostack, preserves_flags)) };
}

/// Reads TTBR0_EL1: the lower region's table and the loaded ASID.
///
/// # Safety
///
/// EL1 or higher (EL0 access traps).
#[inline]
pub unsafe fn read_ttbr0_el1() -> u64 {
    let value: u64;
    // SAFETY: the caller guarantees EL1; the read has no side effect.
    unsafe { asm!("mrs {}, ttbr0_el1", out(reg) value, options(nomem, nostack, preserves_flags)) };
    value
}

impl Config {
    /// Reads this CPU's ID_AA64MMFR0_EL1, ID_AA64MMFR2_EL1 and TCR_EL1
    /// and checks them ([`from_registers`](Self::from_registers), then
    /// [`with_level_hints`](Self::with_level_hints)). Call it once the MMU
    /// is set up; every CPU must have the same setup, and FEAT_TTL if this
    /// one has it (on a system whose CPUs differ, build the `Config` from
    /// the values common to all).
    ///
    /// # Safety
    ///
    /// EL1 (see [`read_tcr_el1`]).
    pub unsafe fn detect() -> Result<Config, Unsupported> {
        // SAFETY: the caller runs at EL1.
        let (mmfr0, mmfr2, tcr) =
            unsafe { (read_id_aa64mmfr0_el1(), read_id_aa64mmfr2_el1(), read_tcr_el1()) };
        Ok(Config::from_registers(mmfr0, tcr)?.with_level_hints(mmfr2))
    }
}
