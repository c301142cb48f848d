//! The translation granule of the aarch64 [`Arch`](super::Arch): which
//! one TCR_EL1 selects and the CPU implements, what its pages and blocks
//! are, and the by-address `TLBI` operand for it, with the FEAT_TTL level
//! hint.
//!
//! Like `aarch64_encoding`, it executes no instruction, so it compiles on
//! every target and its unit tests run on the host. References are to the
//! Arm Architecture Reference Manual for A-profile (DDI 0487): the
//! register descriptions of chapter D19 (TCR_EL1, ID_AA64MMFR0_EL1,
//! ID_AA64MMFR2_EL1) and the `TLBI` descriptions of section C5.5 (for
//! example "TLBI VAE1IS, TLBI VAE1ISNXS", C5.5.60 in issue J.a: the
//! fields VA\[55:12\] and TTL).
//!
//! The facts it rests on:
//!
//! - **Granules.** TCR_EL1.TG0 (bits \[15:14\]) selects TTBR0's granule:
//!   0b00 4 KiB, 0b01 64 KiB, 0b10 16 KiB (0b11 reserved). TG1 (bits
//!   \[31:30\]) encodes TTBR1's differently: 0b01 16 KiB, 0b10 4 KiB, 0b11
//!   64 KiB (0b00 reserved). A reserved value, or a granule the CPU does
//!   not implement, makes the hardware use an IMPLEMENTATION DEFINED one,
//!   so both are refused. ID_AA64MMFR0_EL1 says which are implemented:
//!   TGran4 (bits \[31:28\]) 0b0000 or 0b0001 yes, 0b1111 no; TGran64
//!   (bits \[27:24\]) 0b0000 yes, 0b1111 no; TGran16 (bits \[23:20\]) 0b0000
//!   no, 0b0001 or 0b0010 yes.
//! - **Pages and blocks** (D8, "Translation granule" and the tables of
//!   its lookup levels): a leaf table holds granule / 8 descriptors, so a
//!   level-3 page is the granule, and a level-2 block one leaf table's
//!   span: 2 MiB (4 KiB granule), 32 MiB (16 KiB), 512 MiB (64 KiB). A
//!   level-1 block exists with the 4 KiB granule (1 GiB) and, with 52-bit
//!   output addresses only, with the 16 and 64 KiB ones (64 GiB, 4 TiB),
//!   which this crate does not serve (`MAX_REGION_BITS` is 48).
//! - **The by-address operand** (`VAE1`, `VAAE1`, `VALE1`, their `IS`
//!   forms): bits \[43:0\] hold VA\[55:12\] whatever the granule. With the
//!   16 KiB granule bits \[1:0\] of that field, with the 64 KiB granule
//!   bits \[3:0\], are RES0 and ignored when the instruction executes (VA
//!   bits \[13:12\], \[15:12\] select nothing in a page); this module
//!   writes them as zero. The crate uses no range `TLBI` (FEAT_TLBIRANGE,
//!   whose BaseADDR counts granules).
//! - **The level hint** (FEAT_TTL, present when ID_AA64MMFR2_EL1.TTL, bits
//!   \[51:48\], is not 0b0000): operand bits \[47:44\] "indicate the level of
//!   the translation table walk that holds the leaf entry for the address
//!   being invalidated". TTL\[3:2\] is the granule (0b01 4 KiB, 0b10 16 KiB,
//!   0b11 64 KiB; 0b00: no information, the hardware must assume any
//!   level) and TTL\[1:0\] the level (0b00 is reserved for the 16 and 64 KiB
//!   granules). And: "If an incorrect value of the TTL field is specified
//!   for the entry being invalidated by the instruction, then no entries
//!   are required by the architecture to be invalidated from the TLB." So
//!   a hint is given only for a leaf entry whose size the crate learned
//!   from the page table, equal to a page or block of the granule, and
//!   never when a page table on the way is freed (the hint names the
//!   leaf's level, and the walk-cache entries that point into the freed
//!   table must go).

// On other targets only this module's tests use it.
#![cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]

use crate::page_size::PageSize;

/// TCR_EL1.TG0, bits \[15:14\].
pub(super) const TCR_TG0_SHIFT: u32 = 14;
/// TCR_EL1.TG1, bits \[31:30\].
pub(super) const TCR_TG1_SHIFT: u32 = 30;
/// ID_AA64MMFR0_EL1.TGran16, TGran64, TGran4.
const MMFR0_TGRAN16_SHIFT: u32 = 20;
const MMFR0_TGRAN64_SHIFT: u32 = 24;
const MMFR0_TGRAN4_SHIFT: u32 = 28;
/// ID_AA64MMFR2_EL1.TTL, bits \[51:48\].
const MMFR2_TTL_SHIFT: u32 = 48;
/// Where the TTL field sits in a by-address `TLBI` operand.
const TTL_SHIFT: u32 = 44;
/// Bits \[43:0\] of a by-address `TLBI` operand: VA\[55:12\].
const TLBI_VA_MASK: u64 = (1 << 44) - 1;

const fn field(value: u64, shift: u32) -> u64 {
    (value >> shift) & 0xf
}

/// The granule TG0 selects, if the value is not reserved.
pub(super) const fn tg0_granule(tg0: u64) -> Option<PageSize> {
    match tg0 {
        0b00 => Some(PageSize::SIZE_4K),
        0b01 => Some(PageSize::SIZE_64K),
        0b10 => Some(PageSize::SIZE_16K),
        _ => None,
    }
}

/// The granule TG1 selects, if the value is not reserved.
pub(super) const fn tg1_granule(tg1: u64) -> Option<PageSize> {
    match tg1 {
        0b01 => Some(PageSize::SIZE_16K),
        0b10 => Some(PageSize::SIZE_4K),
        0b11 => Some(PageSize::SIZE_64K),
        _ => None,
    }
}

/// Whether the CPU whose ID_AA64MMFR0_EL1 is `mmfr0` implements
/// `granule` (4, 16 or 64 KiB; any other is not a granule).
pub(super) const fn implements(mmfr0: u64, granule: PageSize) -> bool {
    match granule.shift() {
        12 => field(mmfr0, MMFR0_TGRAN4_SHIFT) != 0b1111,
        14 => {
            let f = field(mmfr0, MMFR0_TGRAN16_SHIFT);
            f == 0b0001 || f == 0b0010
        }
        16 => field(mmfr0, MMFR0_TGRAN64_SHIFT) != 0b1111,
        _ => false,
    }
}

/// Whether `size` is one of the three granules.
pub(super) const fn is_granule(size: PageSize) -> bool {
    matches!(size.shift(), 12 | 14 | 16)
}

/// Whether ID_AA64MMFR2_EL1 (`mmfr2`) says the CPU has FEAT_TTL.
pub(super) const fn has_feat_ttl(mmfr2: u64) -> bool {
    field(mmfr2, MMFR2_TTL_SHIFT) != 0
}

/// The TTL value (operand bits \[47:44\]) that says a leaf entry of `leaf`
/// bytes with `granule`: the granule in bits \[3:2\], the lookup level in
/// bits \[1:0\]; 0 (no hint) for a size that is no page or block this crate
/// serves with that granule.
pub const fn ttl_hint(granule: PageSize, leaf: PageSize) -> u64 {
    let g = match granule.shift() {
        12 => 0b01,
        14 => 0b10,
        16 => 0b11,
        _ => return 0,
    };
    // A leaf table maps granule / 8 entries: each level up is
    // `granule_shift - 3` more address bits.
    let bits = granule.shift() - 3;
    let level = if leaf.shift() == granule.shift() {
        3
    } else if leaf.shift() == granule.shift() + bits {
        2
    } else if g == 0b01 && leaf.shift() == granule.shift() + 2 * bits {
        // 1 GiB, the 4 KiB granule's level-1 block (the others need
        // 52-bit addresses).
        1
    } else {
        return 0;
    };
    (g << 2) | level
}

/// The operand of a by-address `TLBI` (`VAE1`, `VALE1`, `VAAE1`,
/// `VAALE1`, their `IS` forms) for the page at `va` with `granule`: the
/// ASID in bits \[63:48\] (RES0 for the all-ASID forms: pass 0), `ttl` in
/// bits \[47:44\] ([`ttl_hint`], or 0 for none), and VA\[55:12\] in bits
/// \[43:0\] with the bits below the granule (RES0 for the 16 and 64 KiB
/// granules) cleared. Bits 63 to 56 of `va` (a tag, or the upper region's
/// ones) are not part of it.
pub const fn tlbi_va_operand_for(asid: u16, va: u64, granule: PageSize, ttl: u64) -> u64 {
    let low = (1u64 << (granule.shift() - 12)) - 1;
    ((asid as u64) << 48) | ((ttl & 0xf) << TTL_SHIFT) | ((va >> 12) & TLBI_VA_MASK & !low)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tg0_and_tg1_encode_granules_differently() {
        assert_eq!(tg0_granule(0b00), Some(PageSize::SIZE_4K));
        assert_eq!(tg0_granule(0b01), Some(PageSize::SIZE_64K));
        assert_eq!(tg0_granule(0b10), Some(PageSize::SIZE_16K));
        assert_eq!(tg0_granule(0b11), None);
        assert_eq!(tg1_granule(0b00), None);
        assert_eq!(tg1_granule(0b01), Some(PageSize::SIZE_16K));
        assert_eq!(tg1_granule(0b10), Some(PageSize::SIZE_4K));
        assert_eq!(tg1_granule(0b11), Some(PageSize::SIZE_64K));
    }

    #[test]
    fn the_id_register_says_which_granules_exist() {
        // All zero: 4 and 64 KiB yes, 16 KiB no.
        assert!(implements(0, PageSize::SIZE_4K) && implements(0, PageSize::SIZE_64K));
        assert!(!implements(0, PageSize::SIZE_16K));
        assert!(implements(0b0001 << 20, PageSize::SIZE_16K));
        assert!(implements(0b0010 << 20, PageSize::SIZE_16K));
        assert!(!implements(0b1111 << 24, PageSize::SIZE_64K));
        assert!(!implements(0b1111 << 28, PageSize::SIZE_4K));
        assert!(implements(0b0001 << 28, PageSize::SIZE_4K));
        assert!(!implements(!0, PageSize::SIZE_2M));
        assert!(!has_feat_ttl(0) && has_feat_ttl(0b0001 << 48));
        assert!(!has_feat_ttl(0xffff_0000_ffff_ffff & !(0xf << 48)));
    }

    #[test]
    fn only_the_three_granules_are_granules() {
        for size in [PageSize::SIZE_4K, PageSize::SIZE_16K, PageSize::SIZE_64K] {
            assert!(is_granule(size), "{size}");
        }
        // Blocks, and the powers of two between the granules, are not.
        for shift in [13, 15, 21, 25, 29, 30] {
            let size = PageSize::from_shift(shift).unwrap();
            assert!(!is_granule(size), "{size}");
        }
    }

    #[test]
    fn level_hints_name_the_granule_and_the_leaf_level() {
        let (k4, k16, k64) = (PageSize::SIZE_4K, PageSize::SIZE_16K, PageSize::SIZE_64K);
        assert_eq!(ttl_hint(k4, k4), 0b0111);
        assert_eq!(ttl_hint(k4, PageSize::SIZE_2M), 0b0110);
        assert_eq!(ttl_hint(k4, PageSize::SIZE_1G), 0b0101);
        assert_eq!(ttl_hint(k16, k16), 0b1011);
        assert_eq!(ttl_hint(k16, PageSize::SIZE_32M), 0b1010);
        assert_eq!(ttl_hint(k64, k64), 0b1111);
        assert_eq!(ttl_hint(k64, PageSize::SIZE_512M), 0b1110);
        // No such entry: no hint, never a wrong one.
        assert_eq!(ttl_hint(k64, k4), 0);
        assert_eq!(ttl_hint(k64, PageSize::SIZE_2M), 0);
        assert_eq!(ttl_hint(k16, PageSize::SIZE_2M), 0);
        assert_eq!(ttl_hint(k16, PageSize::SIZE_1G), 0, "64 GiB is the level-1 block");
        assert_eq!(ttl_hint(k4, k64), 0);
        assert_eq!(ttl_hint(PageSize::SIZE_2M, PageSize::SIZE_2M), 0);
    }

    #[test]
    fn operands_clear_the_bits_a_granule_ignores_and_carry_the_hint() {
        let (k4, k16, k64) = (PageSize::SIZE_4K, PageSize::SIZE_16K, PageSize::SIZE_64K);
        // 4 KiB: VA[55:12] in full.
        assert_eq!(tlbi_va_operand_for(5, 0x1000, k4, 0), (5 << 48) | 1);
        // 16 KiB: bits [1:0] of the field are RES0.
        assert_eq!(tlbi_va_operand_for(5, 0x7000, k16, 0), (5 << 48) | 4);
        // 64 KiB: bits [3:0].
        assert_eq!(tlbi_va_operand_for(5, 0x1_f000, k64, 0), (5 << 48) | 0x10);
        // An aligned page is unchanged by the masking.
        assert_eq!(tlbi_va_operand_for(0, 0x4_0000, k64, 0), 0x40);
        // The hint in bits [47:44], the ASID untouched.
        assert_eq!(
            tlbi_va_operand_for(0xffff, 0x4_0000, k64, ttl_hint(k64, k64)),
            (0xffff << 48) | (0b1111 << 44) | 0x40
        );
        // The upper region keeps VA[55], loses the tag byte.
        assert_eq!(
            tlbi_va_operand_for(0, 0x5aff_ffff_ffff_0000, k64, 0),
            TLBI_VA_MASK & !0xf
        );
        // A stray hint never reaches the ASID field.
        assert_eq!(tlbi_va_operand_for(0, 0, k4, 0x1f), 0xf << 44);
    }
}
