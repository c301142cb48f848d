//! The arithmetic of the aarch64 [`Arch`](super::Arch): system-register
//! fields, `TLBI` operands, the TTBR0 value, MPIDR affinities, and which
//! invalidation a flush of an ASID uses.
//!
//! None of it executes an instruction, so it compiles on every target and
//! the host's unit tests check it; the `aarch64` module re-exports what a
//! kernel needs. Field positions are those of the Arm Architecture
//! Reference Manual for A-profile (DDI 0487), chapter D19 (AArch64 system
//! registers) and section C5.5 (`TLBI` operands).

// On other targets only this module's tests use it.
#![cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]

use core::fmt;

use super::aarch64_granule::{
    has_feat_ttl, implements, is_granule, tg0_granule, tg1_granule, TCR_TG0_SHIFT, TCR_TG1_SHIFT,
};
use crate::arch::Asid;
use crate::page_size::PageSize;

/// ID_AA64MMFR0_EL1.ASIDBits, bits \[7:4\]: how wide the CPU's ASIDs can be.
const MMFR0_ASID_BITS_SHIFT: u32 = 4;
/// ASIDBits value: 8-bit ASIDs only.
const MMFR0_ASID_8: u64 = 0b0000;
/// ASIDBits value: 16-bit ASIDs are implemented (used when TCR_EL1.AS is 1).
const MMFR0_ASID_16: u64 = 0b0010;

/// TCR_EL1.T0SZ, bits \[5:0\]: the TTBR0 (lower) region is `2^(64 - T0SZ)`
/// bytes.
const TCR_T0SZ_SHIFT: u32 = 0;
/// TCR_EL1.T1SZ, bits \[21:16\]: the TTBR1 (upper) region's size.
const TCR_T1SZ_SHIFT: u32 = 16;
/// TCR_EL1.A1, bit 22: 1 takes the ASID from TTBR1 instead of TTBR0.
const TCR_A1: u64 = 1 << 22;
/// TCR_EL1.EPD1, bit 23: 1 disables walks from TTBR1, so that the upper
/// region translates nothing and TG1 and T1SZ go unused.
const TCR_EPD1: u64 = 1 << 23;
/// TCR_EL1.AS, bit 36: 1 makes the hardware use all 16 ASID bits.
const TCR_AS: u64 = 1 << 36;

/// The narrowest region (in address bits) a TxSZ may select without
/// FEAT_TTST, with any granule: TxSZ = 39.
pub const MIN_REGION_BITS: u32 = 25;
/// The widest region this crate supports: TxSZ = 16, 48-bit halves. Wider
/// (52-bit) regions need FEAT_LPA2 and a `TLBI` operand that this crate
/// does not build.
pub const MAX_REGION_BITS: u32 = 48;

/// Bits \[43:0\] of a by-address `TLBI` operand: VA\[55:12\] (4 KiB granule).
const TLBI_VA_MASK: u64 = (1 << 44) - 1;
/// Where the ASID sits, in a `TLBI` operand and in TTBR0_EL1 alike.
const ASID_SHIFT: u32 = 48;
/// Bits \[63:48\] of TTBR0_EL1: the ASID field.
const TTBR_ASID_FIELD: u64 = 0xffff << ASID_SHIFT;

/// The MPIDR_EL1 affinity fields: Aff2:Aff1:Aff0 in bits \[23:0\], Aff3 in
/// bits \[39:32\]. The bits between (MT, U, the RES1 bit 31) say nothing
/// about which CPU it is.
const MPIDR_AFF_LOW: u64 = 0x00ff_ffff;
const MPIDR_AFF3_SHIFT: u32 = 32;

/// A translation setup the aarch64 `Arch` cannot serve (what
/// [`Config`]'s constructors refuse).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsupported {
    /// TTBR0 and TTBR1 walks use different granules (the crate has one
    /// base page), a TG0 or TG1 value is reserved, or the CPU does not
    /// implement the granule (ID_AA64MMFR0_EL1.TGran4, TGran16, TGran64):
    /// the hardware would then use an IMPLEMENTATION DEFINED one. Also a
    /// size given to [`Config::with_granule`] that is not 4, 16 or 64 KiB.
    Granule,
    /// TCR_EL1.A1 is 1: the ASID comes from TTBR1, while this `Arch`
    /// switches address spaces by writing TTBR0 (root and ASID in one
    /// register write).
    AsidInTtbr1,
    /// An ASID width other than 8 or 16 bits, or a reserved
    /// ID_AA64MMFR0_EL1.ASIDBits value (given here as the field's value).
    AsidBits {
        /// The width asked for, or the ID register field.
        bits: u32,
    },
    /// A virtual-address region outside [`MIN_REGION_BITS`] to
    /// [`MAX_REGION_BITS`] bits (TxSZ 16 to 39).
    RegionBits {
        /// The region's width in bits (64 - TxSZ).
        bits: u32,
    },
}

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unsupported::Granule => write!(
                f,
                "translation granules differ between TTBR0 and TTBR1, or are not 4, 16 or 64 KiB as implemented"
            ),
            Unsupported::AsidInTtbr1 => write!(f, "TCR_EL1.A1 takes the ASID from TTBR1"),
            Unsupported::AsidBits { bits } => write!(f, "ASID width {bits} is neither 8 nor 16 bits"),
            Unsupported::RegionBits { bits } => write!(
                f,
                "a {bits}-bit address region is outside {MIN_REGION_BITS} to {MAX_REGION_BITS} bits"
            ),
        }
    }
}

/// What the aarch64 `Arch` needs to know about the MMU setup: ASID width,
/// address-region width, translation granule (the base page), whether
/// `TLBI`s may carry the FEAT_TTL level hint, and whether every `TLBI`
/// must be issued twice (a CPU erratum). Built from the system registers
/// or from values the kernel gives, and checked either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    asid_bits: u32,
    region_bits: u32,
    granule: PageSize,
    level_hints: bool,
    repeat_tlbi: bool,
}

/// Whether a region of `bits` address bits is one this crate serves.
const fn region_fits(bits: u32) -> bool {
    MIN_REGION_BITS <= bits && bits <= MAX_REGION_BITS
}

const fn field(value: u64, shift: u32, width: u32) -> u64 {
    (value >> shift) & ((1 << width) - 1)
}

impl Config {
    /// A setup the kernel describes itself: `asid_bits` (8, or 16 when it
    /// sets TCR_EL1.AS on a CPU whose ID_AA64MMFR0_EL1 allows it) and
    /// `region_bits`, the width of the wider of the two address regions
    /// (64 - TxSZ, 25 to 48); the 4 KiB granule ([`with_granule`](Self::with_granule)
    /// for another) and no level hints ([`with_level_hints`](Self::with_level_hints)).
    ///
    /// Errors: [`Unsupported::AsidBits`], [`Unsupported::RegionBits`].
    pub const fn new(asid_bits: u32, region_bits: u32) -> Result<Config, Unsupported> {
        if asid_bits != 8 && asid_bits != 16 {
            return Err(Unsupported::AsidBits { bits: asid_bits });
        }
        if !region_fits(region_bits) {
            return Err(Unsupported::RegionBits { bits: region_bits });
        }
        Ok(Config {
            asid_bits,
            region_bits,
            granule: PageSize::SIZE_4K,
            level_hints: false,
            repeat_tlbi: false,
        })
    }

    /// The setup that the values of ID_AA64MMFR0_EL1 (`mmfr0`) and TCR_EL1
    /// (`tcr`) describe: 16-bit ASIDs when the CPU has them and TCR_EL1.AS
    /// turns them on, 8-bit ones otherwise; the wider of the two regions;
    /// the granule TG0 and TG1 select (4, 16 or 64 KiB, the same for
    /// both); no level hints ([`with_level_hints`](Self::with_level_hints)
    /// adds them from ID_AA64MMFR2_EL1; [`detect`](Self::detect) reads all
    /// three registers). A kernel that runs from TTBR0 alone, with walks
    /// from TTBR1 disabled (TCR_EL1.EPD1 set, as the Raspberry Pi tutorial
    /// kernels do), has no upper region: TG1 and T1SZ are then not read
    /// (they may hold anything, reserved values included), and the region
    /// is TTBR0's.
    ///
    /// Errors: [`Unsupported::Granule`] when TG0 and TG1 (with TTBR1 walks
    /// on) select different granules, either value is reserved, or the
    /// CPU does not implement the granule; [`Unsupported::AsidInTtbr1`]
    /// when TCR_EL1.A1 is set; [`Unsupported::AsidBits`] for a reserved
    /// ASIDBits value; [`Unsupported::RegionBits`] when T0SZ, or T1SZ with
    /// TTBR1 walks on, is outside 16 to 39.
    pub const fn from_registers(mmfr0: u64, tcr: u64) -> Result<Config, Unsupported> {
        let ttbr1_walks = tcr & TCR_EPD1 == 0;
        let granule = match (
            tg0_granule(field(tcr, TCR_TG0_SHIFT, 2)),
            tg1_granule(field(tcr, TCR_TG1_SHIFT, 2)),
        ) {
            (Some(lower), Some(upper)) if lower.shift() == upper.shift() && implements(mmfr0, lower) => lower,
            (Some(lower), _) if !ttbr1_walks && implements(mmfr0, lower) => lower,
            _ => return Err(Unsupported::Granule),
        };
        if tcr & TCR_A1 != 0 {
            return Err(Unsupported::AsidInTtbr1);
        }
        let asid_bits = match field(mmfr0, MMFR0_ASID_BITS_SHIFT, 4) {
            // TCR_EL1.AS chooses between 8 and 16 bits.
            MMFR0_ASID_16 if tcr & TCR_AS != 0 => 16,
            MMFR0_ASID_16 => 8,
            // AS is RES0 on such a CPU: the hardware tags with 8 bits
            // whatever the kernel wrote there.
            MMFR0_ASID_8 => 8,
            other => return Err(Unsupported::AsidBits { bits: other as u32 }),
        };
        // Both TxSZ fields are 6 bits wide, so neither subtraction wraps.
        let lower = 64 - field(tcr, TCR_T0SZ_SHIFT, 6) as u32;
        let upper = if ttbr1_walks {
            64 - field(tcr, TCR_T1SZ_SHIFT, 6) as u32
        } else {
            lower
        };
        if !region_fits(lower) {
            return Err(Unsupported::RegionBits { bits: lower });
        }
        if !region_fits(upper) {
            return Err(Unsupported::RegionBits { bits: upper });
        }
        let region_bits = if lower > upper { lower } else { upper };
        Ok(Config {
            asid_bits,
            region_bits,
            granule,
            level_hints: false,
            repeat_tlbi: false,
        })
    }

    /// The same setup, with every `TLBI` issued twice with a `DSB ISH` in
    /// between: the workaround for CPUs whose errata let one invalidation
    /// miss entries (Linux's ARM64_WORKAROUND_REPEAT_TLBI, for example
    /// Cortex-A76 erratum 1286807 and Qualcomm Falkor erratum 1009). The
    /// kernel knows its CPUs' revisions; this crate does not look them up.
    #[must_use]
    pub const fn with_repeated_tlbi(self) -> Config {
        Config {
            repeat_tlbi: true,
            ..self
        }
    }

    /// The same setup with the `granule` (4, 16 or 64 KiB) that TCR_EL1's
    /// TG0 and TG1 both select, as the kernel set them on a CPU that
    /// implements it. Errors: [`Unsupported::Granule`] for any other size.
    pub const fn with_granule(self, granule: PageSize) -> Result<Config, Unsupported> {
        if !is_granule(granule) {
            return Err(Unsupported::Granule);
        }
        Ok(Config { granule, ..self })
    }

    /// The same setup, with the FEAT_TTL level hint in page invalidations
    /// when ID_AA64MMFR2_EL1 (`mmfr2`) says every CPU has it (its TTL
    /// field, bits \[51:48\], is not 0; pass the value common to all CPUs,
    /// or 0). A hint is given only where the crate knows the leaf entry's
    /// size (see `aarch64_granule`); without FEAT_TTL the field is RES0
    /// and the operand keeps it zero.
    #[must_use]
    pub const fn with_level_hints(self, mmfr2: u64) -> Config {
        Config {
            level_hints: has_feat_ttl(mmfr2),
            ..self
        }
    }

    /// The translation granule, which is the base page
    /// ([`Arch::base_page`](crate::Arch::base_page)).
    pub const fn granule(&self) -> PageSize {
        self.granule
    }

    /// Whether page invalidations carry the FEAT_TTL level hint.
    pub const fn level_hints(&self) -> bool {
        self.level_hints
    }

    /// How many bits the hardware's ASIDs have: 8 or 16.
    pub const fn asid_bits(&self) -> u32 {
        self.asid_bits
    }

    /// The width of the wider address region, 64 - TxSZ.
    pub const fn region_bits(&self) -> u32 {
        self.region_bits
    }

    /// The crate's canonical width ([`Arch::va_bits`](crate::Arch::va_bits)):
    /// one more than the region's, since on aarch64 the lower region runs
    /// up from 0 and the upper one down from the top, and an address is in
    /// one of them exactly when its bits from `region_bits` up are all
    /// equal (49 for the usual 48-bit regions).
    pub const fn va_bits(&self) -> u32 {
        self.region_bits + 1
    }

    /// Whether every `TLBI` is issued twice ([`with_repeated_tlbi`](Self::with_repeated_tlbi)).
    pub const fn repeats_tlbi(&self) -> bool {
        self.repeat_tlbi
    }
}

/// The operand of a by-address `TLBI` (`VAE1`, `VALE1`, `VAAE1`, their
/// `IS` forms) with no level hint: the ASID in bits \[63:48\], TTL 0 in
/// bits \[47:44\] (any level), and VA\[55:12\] in bits \[43:0\], right for
/// every granule when `va` is aligned to it (the bits below a 16 or 64 KiB
/// granule are RES0: [`tlbi_va_operand_for`](super::aarch64_granule::tlbi_va_operand_for)
/// clears them, and adds a hint).
/// Bits 63 to 56 of `va` (a pointer tag, or the upper region's ones) are
/// not part of it; bit 55 tells the regions apart. The all-ASID forms
/// ignore the ASID field (it is RES0 there: pass 0).
pub const fn tlbi_va_operand(asid: u16, va: u64) -> u64 {
    ((asid as u64) << ASID_SHIFT) | ((va >> 12) & TLBI_VA_MASK)
}

/// The operand of `TLBI ASIDE1` / `ASIDE1IS`: the ASID in bits \[63:48\],
/// the rest RES0.
pub const fn tlbi_asid_operand(asid: u16) -> u64 {
    (asid as u64) << ASID_SHIFT
}

/// The TTBR0_EL1 value that loads the table at `root` with `asid`: the
/// ASID replaces bits \[63:48\] of `root` (the table's physical address, and
/// CnP in bit 0 if the kernel uses it), so both change in one register
/// write.
pub const fn ttbr0_value(root: u64, asid: u16) -> u64 {
    (root & !TTBR_ASID_FIELD) | ((asid as u64) << ASID_SHIFT)
}

/// The table address of a TTBR0_EL1 value or of a root given to
/// [`ttbr0_value`]: BADDR, bits \[47:1\], without the ASID above it and
/// CnP in bit 0 (Arm ARM, TTBR0_EL1; with 52-bit addresses bits \[5:2\]
/// carry address bits \[51:48\], which this keeps too). Two values load
/// the same table when their bases are equal.
pub const fn ttbr0_base(value: u64) -> u64 {
    value & !TTBR_ASID_FIELD & !1
}

/// A CPU's affinity, Aff3:Aff2:Aff1:Aff0 packed into 32 bits, from an
/// MPIDR_EL1 value (or the MPIDR field of an ACPI MADT GICC entry, or a
/// devicetree `cpu` node's `reg`): what [`CpuTable`](super::aarch64_cpus::CpuTable)
/// knows CPUs by.
pub const fn mpidr_affinity(mpidr: u64) -> u32 {
    let aff3 = (mpidr >> MPIDR_AFF3_SHIFT) & 0xff;
    ((aff3 << 24) | (mpidr & MPIDR_AFF_LOW)) as u32
}

/// Which entries an invalidation for an ASID reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TlbiScope {
    /// The entries tagged with this hardware ASID (and, for a by-address
    /// invalidation, global entries for the address).
    Asid(u16),
    /// Every ASID's entries: the all-ASID form (`VAAE1`, `VMALLE1`).
    AllAsids,
}

/// The scope that flushing `asid` needs on hardware with `asid_bits`-bit
/// ASIDs.
///
/// [`Asid::KERNEL`] is every ASID: kernel pages are normally global (nG
/// clear), which a by-ASID invalidation reaches too, but a kernel that
/// maps some of them non-global (as Linux does under KPTI) would have
/// them tagged with whatever ASID was loaded, so the all-ASID form is the
/// one that is right either way. An ASID wider than the hardware's (which
/// every entry point of the crate refuses; only a direct call gets here)
/// is every ASID too: the hardware would only see its low bits, another
/// address space's ASID.
pub(crate) const fn tlbi_scope(asid: Asid, asid_bits: u32) -> TlbiScope {
    let value = asid.value();
    if asid.is_kernel() || asid_bits > 16 || (value as u32) >> asid_bits != 0 {
        TlbiScope::AllAsids
    } else {
        TlbiScope::Asid(value)
    }
}

/// The hardware ASID that TTBR0 gets for `asid`: its value for a user ASID
/// that fits, 0 for [`Asid::KERNEL`] (the crate never gives 0 to a user
/// address space) and for an ASID wider than the hardware's. Address
/// spaces loaded with 0 share it, so their switch drops ASID 0's entries
/// ([`needs_flush_on_load`]).
pub(crate) const fn ttbr0_asid(asid: Asid, asid_bits: u32) -> u16 {
    match tlbi_scope(asid, asid_bits) {
        TlbiScope::Asid(value) => value,
        TlbiScope::AllAsids => 0,
    }
}

/// Whether loading an address space tagged `hw_asid` must drop that ASID's
/// entries: only for ASID 0, which several roots may use in turn.
pub(crate) const fn needs_flush_on_load(hw_asid: u16) -> bool {
    hw_asid == 0
}

#[cfg(test)]
#[path = "aarch64_encoding_tests.rs"]
mod tests;
