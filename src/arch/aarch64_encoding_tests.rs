//! The arithmetic of the aarch64 `Arch`, checked on the host: ASID widths,
//! regions and granules from the system registers, `TLBI` operands, TTBR0
//! values and MPIDR affinities (`aarch64_encoding.rs`).

use super::*;

/// A TCR_EL1 value: 4 KiB granules both sides, the given sizes, AS.
fn tcr(t0sz: u64, t1sz: u64, as16: bool) -> u64 {
    t0sz | (t1sz << TCR_T1SZ_SHIFT) | (0b10 << TCR_TG1_SHIFT) | if as16 { TCR_AS } else { 0 }
}

const MMFR0_16: u64 = MMFR0_ASID_16 << MMFR0_ASID_BITS_SHIFT;

#[test]
fn asid_width_comes_from_the_cpu_and_tcr_as() {
    // 16-bit capable and AS set: 16 bits.
    let c = Config::from_registers(MMFR0_16, tcr(16, 16, true)).unwrap();
    assert_eq!(c.asid_bits(), 16);
    // Capable but AS clear: the hardware tags with 8 bits.
    let c = Config::from_registers(MMFR0_16, tcr(16, 16, false)).unwrap();
    assert_eq!(c.asid_bits(), 8);
    // 8-bit CPU: AS is RES0, 8 bits whatever it holds.
    let c = Config::from_registers(0, tcr(16, 16, true)).unwrap();
    assert_eq!(c.asid_bits(), 8);
    // A reserved ASIDBits value.
    assert_eq!(
        Config::from_registers(0b0001 << MMFR0_ASID_BITS_SHIFT, tcr(16, 16, true)),
        Err(Unsupported::AsidBits { bits: 1 })
    );
    // Other ID register fields do not matter (PARange 48 bits, mixed
    // endianness, 16 KiB granule present).
    let c = Config::from_registers(
        MMFR0_16 | 0b0101 | (0b0001 << 8) | (0b0001 << 20),
        tcr(16, 16, true),
    )
    .unwrap();
    assert_eq!(c.asid_bits(), 16);
}

#[test]
fn regions_give_the_canonical_width() {
    let c = Config::from_registers(MMFR0_16, tcr(16, 16, true)).unwrap();
    assert_eq!((c.region_bits(), c.va_bits()), (48, 49));
    // 39-bit regions (T0SZ = T1SZ = 25).
    let c = Config::from_registers(MMFR0_16, tcr(25, 25, true)).unwrap();
    assert_eq!((c.region_bits(), c.va_bits()), (39, 40));
    // Different sizes: the wider one, so every user address passes.
    let c = Config::from_registers(MMFR0_16, tcr(16, 25, true)).unwrap();
    assert_eq!(c.va_bits(), 49);
    let c = Config::from_registers(MMFR0_16, tcr(25, 16, true)).unwrap();
    assert_eq!(c.va_bits(), 49);
    // Out of range on either side, and the extremes of the field.
    for (t0, t1, bits) in [(12, 16, 52), (16, 12, 52), (40, 16, 24), (16, 63, 1), (0, 16, 64)] {
        assert_eq!(
            Config::from_registers(MMFR0_16, tcr(t0, t1, true)),
            Err(Unsupported::RegionBits { bits })
        );
    }
    assert!(Config::from_registers(MMFR0_16, tcr(39, 39, false)).is_ok());
}

#[test]
fn the_granule_both_halves_select_is_the_base_page() {
    let good = tcr(16, 16, true);
    let with = |tg0: u64, tg1: u64| {
        (good & !(0b11 << TCR_TG0_SHIFT) & !(0b11 << TCR_TG1_SHIFT))
            | (tg0 << TCR_TG0_SHIFT)
            | (tg1 << TCR_TG1_SHIFT)
    };
    let granule = |mmfr0: u64, tcr: u64| Config::from_registers(mmfr0, tcr).map(|c| c.granule());
    let tgran16 = 0b0001 << 20;
    assert_eq!(granule(MMFR0_16, good), Ok(PageSize::SIZE_4K));
    // 64 KiB: TG0 0b01, TG1 0b11; implemented unless TGran64 = 0b1111.
    assert_eq!(granule(MMFR0_16, with(0b01, 0b11)), Ok(PageSize::SIZE_64K));
    assert_eq!(
        granule(MMFR0_16 | (0b1111 << 24), with(0b01, 0b11)),
        Err(Unsupported::Granule)
    );
    // 16 KiB: TG0 0b10, TG1 0b01; only where TGran16 says so.
    assert_eq!(granule(MMFR0_16, with(0b10, 0b01)), Err(Unsupported::Granule));
    assert_eq!(
        granule(MMFR0_16 | tgran16, with(0b10, 0b01)),
        Ok(PageSize::SIZE_16K)
    );
    // Mixed granules (each valid alone) and reserved values.
    for (tg0, tg1) in [
        (0b00, 0b11),
        (0b01, 0b10),
        (0b10, 0b10),
        (0b11, 0b10),
        (0b00, 0b00),
    ] {
        assert_eq!(
            granule(MMFR0_16 | tgran16, with(tg0, tg1)),
            Err(Unsupported::Granule),
            "TG0 {tg0:#b} TG1 {tg1:#b}"
        );
    }
    // TTBR1 walks off (EPD1): TG1 is not read, reserved or not, and
    // TG0 alone must be implemented; T1SZ is not read either.
    let epd1 = |tcr: u64| tcr | TCR_EPD1;
    for tg1 in [0b00, 0b01, 0b10, 0b11] {
        assert_eq!(
            granule(MMFR0_16, epd1(with(0b01, tg1))),
            Ok(PageSize::SIZE_64K),
            "TG1 {tg1:#b}"
        );
    }
    assert_eq!(
        granule(MMFR0_16, epd1(with(0b11, 0b11))),
        Err(Unsupported::Granule)
    );
    assert_eq!(
        granule(MMFR0_16, epd1(with(0b10, 0b01))),
        Err(Unsupported::Granule)
    );
    let bare = epd1(with(0b01, 0b00)) & !(0x3f << TCR_T1SZ_SHIFT) & !(0x3f << TCR_T0SZ_SHIFT);
    let c = Config::from_registers(MMFR0_16, bare | 25).unwrap();
    assert_eq!(c.region_bits(), 39, "T0SZ's region; T1SZ = 0 not read");
    // The CPU lacks the 4 KiB granule; 4 KiB with 52-bit support is 4 KiB.
    assert_eq!(
        granule(MMFR0_16 | (0b1111 << 28), good),
        Err(Unsupported::Granule)
    );
    assert_eq!(granule(MMFR0_16 | (0b0001 << 28), good), Ok(PageSize::SIZE_4K));
    assert_eq!(
        Config::from_registers(MMFR0_16, good | TCR_A1),
        Err(Unsupported::AsidInTtbr1)
    );
}

#[test]
fn a_given_granule_and_the_level_hints_are_checked() {
    let c = Config::new(16, 48).unwrap();
    assert_eq!(c.granule(), PageSize::SIZE_4K);
    assert!(!c.level_hints());
    assert_eq!(
        c.with_granule(PageSize::SIZE_64K).map(|c| c.granule()),
        Ok(PageSize::SIZE_64K)
    );
    assert_eq!(c.with_granule(PageSize::SIZE_2M), Err(Unsupported::Granule));
    assert!(c.with_level_hints(0b0001 << 48).level_hints());
    assert!(!c.with_level_hints(!(0xf << 48)).level_hints());
}

#[test]
fn a_given_setup_is_checked_too() {
    assert_eq!(Config::new(16, 48).map(|c| c.va_bits()), Ok(49));
    assert_eq!(Config::new(8, 39).map(|c| c.asid_bits()), Ok(8));
    assert_eq!(Config::new(12, 48), Err(Unsupported::AsidBits { bits: 12 }));
    assert_eq!(Config::new(32, 48), Err(Unsupported::AsidBits { bits: 32 }));
    assert_eq!(Config::new(16, 52), Err(Unsupported::RegionBits { bits: 52 }));
    assert_eq!(Config::new(16, 24), Err(Unsupported::RegionBits { bits: 24 }));
    let c = Config::new(16, 48).unwrap();
    assert!(!c.repeats_tlbi());
    assert!(c.with_repeated_tlbi().repeats_tlbi());
    assert_eq!(c.with_repeated_tlbi().asid_bits(), 16);
}

#[test]
fn tlbi_operands_carry_the_asid_and_va_55_to_12() {
    assert_eq!(tlbi_va_operand(0, 0), 0);
    assert_eq!(tlbi_va_operand(5, 0x1000), (5 << 48) | 1);
    assert_eq!(
        tlbi_va_operand(0xffff, 0x0000_7fff_ffff_f000),
        (0xffff << 48) | 0x7_ffff_ffff
    );
    // The page offset is dropped.
    assert_eq!(tlbi_va_operand(1, 0x1fff), tlbi_va_operand(1, 0x1000));
    // An upper-region address keeps bit 55 (bits 55:12 fill all 44
    // bits) and loses bits 63:56; the ASID is not disturbed.
    assert_eq!(
        tlbi_va_operand(7, 0xffff_0000_0000_0000),
        (7 << 48) | (0xff0 << 32)
    );
    assert_eq!(
        tlbi_va_operand(7, 0xffff_ffff_ffff_f000),
        (7 << 48) | ((1 << 44) - 1)
    );
    // A tag in the top byte does not change the operand.
    assert_eq!(
        tlbi_va_operand(3, 0x5a00_0000_0040_0000),
        tlbi_va_operand(3, 0x40_0000)
    );
    assert_eq!(tlbi_asid_operand(0x1234), 0x1234 << 48);
    assert_eq!(tlbi_asid_operand(0), 0);
}

#[test]
fn ttbr0_takes_the_asid_in_its_top_bits() {
    assert_eq!(ttbr0_value(0x4008_0000, 9), (9 << 48) | 0x4008_0000);
    // CnP (bit 0) is kept; stray high bits are replaced by the ASID.
    assert_eq!(ttbr0_value(0x4008_0001, 0), 0x4008_0001);
    assert_eq!(ttbr0_value(0xabcd_0000_4008_0000, 2), (2 << 48) | 0x4008_0000);
}

#[test]
fn affinities_drop_the_bits_that_are_not_affinity() {
    // RES1 bit 31, U bit 30 and MT bit 24 do not name a CPU.
    assert_eq!(mpidr_affinity(0x8000_0000), 0);
    assert_eq!(mpidr_affinity(0xc100_0203), 0x0000_0203);
    assert_eq!(mpidr_affinity(0x0000_0012_0003_0405), 0x1203_0405);
    // Bits above Aff3 are ignored.
    assert_eq!(mpidr_affinity(0xffff_ff00_0000_0001), 1);
}

#[test]
fn flushes_name_one_asid_only_when_it_is_exactly_the_hardwares() {
    let a = |v| Asid::new(v).unwrap();
    assert_eq!(tlbi_scope(a(1), 8), TlbiScope::Asid(1));
    assert_eq!(tlbi_scope(a(255), 8), TlbiScope::Asid(255));
    // Too wide for 8 bits: its low byte is another ASID.
    assert_eq!(tlbi_scope(a(256), 8), TlbiScope::AllAsids);
    assert_eq!(tlbi_scope(a(256 + 5), 8), TlbiScope::AllAsids);
    assert_eq!(tlbi_scope(a(0xfffe), 16), TlbiScope::Asid(0xfffe));
    // The kernel's pages: every ASID, whatever their nG bit.
    assert_eq!(tlbi_scope(Asid::KERNEL, 16), TlbiScope::AllAsids);
    assert_eq!(tlbi_scope(Asid::KERNEL, 8), TlbiScope::AllAsids);
    // A nonsensical width never narrows anything.
    assert_eq!(tlbi_scope(a(5), 40), TlbiScope::AllAsids);
}

#[test]
fn the_kernel_and_too_wide_asids_load_asid_zero_and_flush_it() {
    let a = |v| Asid::new(v).unwrap();
    assert_eq!(ttbr0_asid(a(7), 8), 7);
    assert!(!needs_flush_on_load(ttbr0_asid(a(7), 8)));
    assert_eq!(ttbr0_asid(Asid::KERNEL, 16), 0);
    assert_eq!(ttbr0_asid(a(300), 8), 0);
    assert!(needs_flush_on_load(ttbr0_asid(Asid::KERNEL, 16)));
    assert!(needs_flush_on_load(ttbr0_asid(a(300), 8)));
}

#[test]
fn refusals_say_what_was_refused() {
    use std::string::ToString;
    assert!(Unsupported::Granule.to_string().contains("granules"));
    assert!(Unsupported::AsidBits { bits: 12 }.to_string().contains("12"));
    assert!(Unsupported::RegionBits { bits: 52 }.to_string().contains("52"));
    assert!(Unsupported::AsidInTtbr1.to_string().contains("TTBR1"));
}
