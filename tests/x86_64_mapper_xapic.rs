//! `mapper::xapic::map_xapic` over real four-level tables built in host
//! memory with the `x86_64` crate (physical offset 0): the entry it writes
//! (frame from IA32_APIC_BASE, flags the xAPIC needs), the tables it adds,
//! and what it refuses without changing anything.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use common::x86_tables::{map, upper_entry, HostMmu, Tables};
use tlb_batch::arch::mock::MmuTable;
use tlb_batch::mapper::xapic::{map_xapic, XapicMapError, XapicPage};
use x86_64::structures::paging::mapper::{MapToError, Translate, TranslateResult};
use x86_64::structures::paging::{Page, PageTableFlags as F, Size4KiB};
use x86_64::VirtAddr;

/// IA32_APIC_BASE after reset on the bootstrap processor: enabled (bit
/// 11), BSP (bit 8), registers at 0xFEE0_0000.
const RESET_APIC_BASE: u64 = 0xfee0_0900;
/// A kernel-half address for the register page.
const VA: u64 = 0xffff_8000_fee0_0000;

fn page(va: u64) -> Page<Size4KiB> {
    Page::from_start_address(VirtAddr::new(va)).unwrap()
}

fn entry(tables: &Tables, va: u64) -> Option<u64> {
    HostMmu {
        root: tables.root_addr(),
    }
    .entry(va)
    .map(|w| w.load(std::sync::atomic::Ordering::SeqCst))
}

#[test]
fn the_page_maps_the_apic_frame_uncached_writable_and_supervisor_only() {
    let mut tables = Tables::new();
    let options = XapicPage {
        no_execute: true,
        global: true,
    };
    {
        let (mut mapper, mut pool) = tables.mapper();
        // SAFETY: host memory only; the APIC frame is never dereferenced.
        let flush = unsafe { map_xapic(&mut mapper, &mut pool, page(VA), RESET_APIC_BASE, options) }.unwrap();
        // Not loaded on any CPU (and `invlpg` cannot run on the host).
        flush.ignore();
        match mapper.translate(VirtAddr::new(VA + 0x300)) {
            TranslateResult::Mapped { frame, offset, flags } => {
                assert_eq!(frame.start_address().as_u64(), 0xfee0_0000);
                assert_eq!(offset, 0x300);
                assert_eq!(
                    flags,
                    F::PRESENT | F::WRITABLE | F::NO_CACHE | F::WRITE_THROUGH | F::NO_EXECUTE | F::GLOBAL
                );
            }
            other => panic!("not mapped: {other:?}"),
        }
    }
    // The raw 4 KiB entry: PCD (bit 4) and PWT (bit 3) with PAT (bit 7)
    // clear select PAT entry 3, UC from reset; no U/S bit.
    let raw = entry(&tables, VA).unwrap();
    assert_eq!(raw & 0x000f_ffff_ffff_f000, 0xfee0_0000);
    assert_eq!(raw & 0x9f, 0x1b, "P, R/W, PWT, PCD; not U/S, not PAT: {raw:#x}");
    assert_ne!(raw & (1 << 63), 0);
    // The tables it added on the way are supervisor-only as well.
    for level in [4, 3, 2] {
        let upper = upper_entry(tables.root_addr(), VA, level).load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(upper & 0b111, 0b011, "level {level}: {upper:#x}");
    }
    // The neighbours stay unmapped.
    assert!(entry(&tables, VA + 4096).is_none_or(|w| w == 0));
}

#[test]
fn without_nx_or_global_the_entry_has_neither_bit() {
    let mut tables = Tables::new();
    {
        let (mut mapper, mut pool) = tables.mapper();
        // SAFETY: as above.
        unsafe {
            map_xapic(
                &mut mapper,
                &mut pool,
                page(VA),
                RESET_APIC_BASE,
                XapicPage::default(),
            )
        }
        .unwrap()
        .ignore();
    }
    let raw = entry(&tables, VA).unwrap();
    assert_eq!(raw & (1 << 63 | 1 << 8), 0, "{raw:#x}");
}

#[test]
fn a_disabled_or_x2apic_mode_apic_is_refused_before_any_table_changes() {
    let mut tables = Tables::new();
    {
        let (mut mapper, mut pool) = tables.mapper();
        for (base, x2apic) in [(0xfee0_0100, false), (0xfee0_0d00, true)] {
            // SAFETY: as above.
            let refused = unsafe { map_xapic(&mut mapper, &mut pool, page(VA), base, XapicPage::default()) };
            match refused {
                Err(XapicMapError::X2ApicMode) if x2apic => {}
                Err(XapicMapError::ApicDisabled) if !x2apic => {}
                other => panic!("{base:#x}: {other:?}"),
            }
        }
    }
    assert!(tables.pool.is_empty(), "no table was allocated");
    assert!(entry(&tables, VA).is_none());
}

#[test]
fn an_address_already_mapped_is_left_alone() {
    let mut tables = Tables::new();
    let (mut mapper, mut pool) = tables.mapper();
    map::<Size4KiB>(&mut mapper, &mut pool, VA, 0x5000, F::PRESENT | F::WRITABLE);
    // SAFETY: as above.
    let refused = unsafe {
        map_xapic(
            &mut mapper,
            &mut pool,
            page(VA),
            RESET_APIC_BASE,
            XapicPage::default(),
        )
    };
    match refused {
        // (The `x86_64` crate reports the frame it was asked to map.)
        Err(e @ XapicMapError::Map(MapToError::PageAlreadyMapped(_))) => {
            assert!(e.to_string().contains("already mapped"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    match mapper.translate(VirtAddr::new(VA)) {
        TranslateResult::Mapped { frame, flags, .. } => {
            assert_eq!(frame.start_address().as_u64(), 0x5000);
            assert_eq!(flags, F::PRESENT | F::WRITABLE);
        }
        other => panic!("{other:?}"),
    }
}
