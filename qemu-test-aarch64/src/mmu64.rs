//! The tables of the 64 KiB granule run (boot argument `granule64`):
//! TCR_EL1.TG0 = 0b01 and TG1 = 0b11, both 64 KiB, T0SZ = 16 as in the
//! 4 KiB run.
//!
//! The geometry (Arm ARM, DDI 0487, "Memory translation granule size",
//! D4.2.3 and its Table D4-8 in issue A.k; the 64KB-granule lookup
//! levels of the translation process, D8.2 in later issues): a table is
//! one 64 KiB granule of 8192 descriptors, each lookup resolves 13 address
//! bits, so a 48-bit input address is resolved by levels 1 to 3: level 1
//! by VA\[47:42\] (a table of 64 entries at T0SZ = 16, 4 TiB each), level 2
//! by VA\[41:29\] (512 MiB each: a block there is 512 MiB), level 3 by
//! VA\[28:16\] (a page is 64 KiB). Level 1 blocks exist only with 52-bit
//! output addresses; none are written here.
//!
//! What they map, as the 4 KiB tables do (`mmu.rs`): 0 - 1 GiB identity
//! as two 512 MiB Device-nGnRnE level 2 blocks; the RAM identity, its
//! first 512 MiB (where the kernel is) with 64 KiB Normal pages through
//! one level 3 table, the rest with 512 MiB Normal level 2 blocks (the
//! block scenarios take six 512 MiB blocks at the top of RAM, so the
//! `granule64` runs are given 4 GiB); and
//! [`TEST_PAGES`](crate::mmu::TEST_PAGES) 64 KiB test pages, the last
//! entries of a level 3 table of their own from [`TEST_VA`] on (level 1
//! entry 0, level 2 entry 1024). Every test frame is 64 KiB-aligned and
//! 64 KiB long (`virt.rs`). The level 2 entry after the test pages' one
//! (1025, [`BLOCK_VA`]) is where the block scenarios write their 512 MiB
//! block.

use core::sync::atomic::{AtomicU64, Ordering};

use crate::mmu::{
    Table, AF, ATTR_DEVICE, ATTR_NORMAL, DESC_TABLE_OR_PAGE, DESC_VALID, PXN, SH_INNER, TEST_PAGES, UXN,
};

/// The granule, and so the page.
pub const GRANULE: u64 = 64 << 10;
/// Descriptors in a 64 KiB table.
const ENTRIES: usize = 8192;
/// What a level 2 entry maps: a block's size.
const L2_SPAN: u64 = 512 << 20;

/// The first test page: the last [`TEST_PAGES`] entries of a leaf table
/// at 0x80_0000_0000 (level 1 index 0, level 2 index 1024).
pub const TEST_VA: u64 = 0x0000_0080_0000_0000 + (ENTRIES - TEST_PAGES) as u64 * GRANULE;
const _: () = assert!(TEST_VA >> 42 == 0 && (TEST_VA >> 29) & 8191 == 1024);

/// The clean-write scenario's pages (`dirty.rs`): the first
/// [`DIRTY_PAGES`](crate::mmu::DIRTY_PAGES) entries of the test pages'
/// leaf table, as at 4 KiB.
pub const DIRTY_VA: u64 = TEST_VA & !(L2_SPAN - 1);
const _: () = assert!(crate::mmu::DIRTY_PAGES + TEST_PAGES <= ENTRIES);

/// Where the block scenarios (`block.rs`, `block_split.rs`) map their
/// 512 MiB block: the level 2 entry after the one whose leaf table holds
/// the test pages.
pub const BLOCK_VA: u64 = (TEST_VA & !(L2_SPAN - 1)) + L2_SPAN;
const _: () = assert!(BLOCK_VA >> 42 == 0 && (BLOCK_VA >> 29) & 8191 == 1025);

/// A 64 KiB table (levels 2 and 3), aligned to its size.
#[repr(C, align(65536))]
pub struct Table64(pub [AtomicU64; ENTRIES]);

impl Table64 {
    pub const fn new() -> Self {
        Table64([const { AtomicU64::new(0) }; ENTRIES])
    }
    pub fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
}

/// The root: level 1 has 64 entries at T0SZ = 16 (512 bytes), so a
/// 4 KiB-aligned table holds it.
static L1: Table = Table::new();
static L2: Table64 = Table64::new();
static L3_RAM: Table64 = Table64::new();
/// The test pages' leaf table: the scenarios write their entries.
static L3_TEST: Table64 = Table64::new();

/// The level 1-3 table indices of `va`.
fn indices(va: u64) -> [usize; 3] {
    [
        ((va >> 42) & 63) as usize,
        ((va >> 29) & 8191) as usize,
        ((va >> 16) & 8191) as usize,
    ]
}

/// Builds the tables, as `mmu::build` does (boot CPU, MMU off, plain
/// stores only).
pub fn build(ram_base: u64, ram_size: u64) -> Result<(), &'static str> {
    // RAM below the test pages' level 2 entry (1024): 512 GiB.
    let below_tests = TEST_VA & !(L2_SPAN - 1);
    if !ram_base.is_multiple_of(L2_SPAN) || ram_size == 0 || ram_base + ram_size > below_tests {
        return Err(
            "RAM does not start at a 512 MiB boundary or does not end below 512 GiB (64 KiB granule)",
        );
    }
    let table = DESC_VALID | DESC_TABLE_OR_PAGE;
    L1.0[0].store(L2.addr() | table, Ordering::Relaxed);
    // Level 2 blocks (bit 1 clear): 1 GiB of devices.
    for i in 0..2 {
        L2.0[i].store(
            (i as u64 * L2_SPAN) | DESC_VALID | ATTR_DEVICE | AF | PXN | UXN,
            Ordering::Relaxed,
        );
    }
    L2.0[indices(ram_base)[1]].store(L3_RAM.addr() | table, Ordering::Relaxed);
    // The first 512 MiB in 64 KiB pages (the kernel's), the rest in
    // level 2 blocks.
    for i in 0..ram_size.min(L2_SPAN).div_ceil(GRANULE) {
        let pa = ram_base + i * GRANULE;
        L3_RAM.0[i as usize].store(
            pa | DESC_VALID | DESC_TABLE_OR_PAGE | ATTR_NORMAL | SH_INNER | AF | UXN,
            Ordering::Relaxed,
        );
    }
    for i in 1..ram_size.div_ceil(L2_SPAN) {
        let pa = ram_base + i * L2_SPAN;
        L2.0[indices(pa)[1]].store(
            pa | DESC_VALID | ATTR_NORMAL | SH_INNER | AF | UXN,
            Ordering::Relaxed,
        );
    }
    L2.0[indices(TEST_VA)[1]].store(L3_TEST.addr() | table, Ordering::Relaxed);
    Ok(())
}

/// The level 2 entry that maps [`BLOCK_VA`].
pub fn block_entry() -> &'static AtomicU64 {
    &L2.0[indices(BLOCK_VA)[1]]
}

/// The leaf entry of the test page at `va`.
pub fn leaf_entry(va: u64) -> &'static AtomicU64 {
    &L3_TEST.0[indices(va)[2]]
}

/// The root of the tables.
pub fn root() -> u64 {
    L1.addr()
}

/// The root table itself (the generations scenario copies it).
pub fn root_table() -> &'static Table {
    &L1
}

/// TCR_EL1's granule fields: TG0 = 0b01 (64 KiB for TTBR0), TG1 = 0b11
/// (64 KiB for TTBR1, whose walks stay disabled).
pub const TCR_GRANULE: u64 = (0b01 << 14) | (0b11 << 30);

/// Cleans the tables to the point of coherency (for CPUs that walk them
/// before their caches are on).
pub fn clean_tables() {
    crate::mmu::clean_to_poc(L1.addr(), 4096);
    for t in [&L2, &L3_RAM, &L3_TEST] {
        crate::mmu::clean_to_poc(t.addr(), GRANULE);
    }
}
