//! Stage 1 translation for EL1: one set of page tables that every CPU
//! loads into TTBR0_EL1.
//!
//! 4 KiB granule, 48-bit virtual addresses (T0SZ = 16, so a walk starts at
//! level 0), TTBR1 walks disabled. The tables map:
//!
//! - 0 - 1 GiB identity, one Device-nGnRnE block (flash, GIC, the PL011 at
//!   0x0900_0000 and the other virt devices), never executable;
//! - the RAM the DTB reports, identity, 2 MiB Normal write-back blocks,
//!   inner shareable, writable and executable at EL1 (a test kernel): the
//!   kernel, its stacks, the DTB and the test frames;
//! - [`TEST_PAGES`] 4 KiB pages from [`TEST_VA`] on, through their own
//!   level 1-3 tables: the pages the scenarios map, unmap and remap.
//!
//! Kernel mappings are global; the test pages are not (nG = 1), so their
//! TLB entries carry the ASID in TTBR0_EL1. Every CPU turns its MMU on
//! with ASID 0 in TTBR0_EL1 and then loads the test address space (the same
//! root, with the test ASID) through the crate's `switch_mm`. The ASID is 16 bits wide when
//! ID_AA64MMFR0_EL1.ASIDBits says the CPU has them (TCR_EL1.AS = 1), 8
//! otherwise. Hardware access-flag updates (TCR_EL1.HA = 1) are on when
//! ID_AA64MMFR1_EL1.HAFDBS says the CPU has them (QEMU's `max`, not the
//! Cortex-A72): a walk that finds AF clear sets it instead of faulting.
//! Hardware dirty-state updates (TCR_EL1.HD = 1) are on where HAFDBS says
//! the CPU has them too (2 or more): they act only on descriptors with DBM
//! (bit 51) set, which only the clean-write scenario (`dirty.rs`) writes,
//! in the first [`DIRTY_PAGES`] entries of the test pages' leaf table.
//! Every descriptor is written with AF set; only the reclaim flow's aging
//! clears it.
//!
//! With the boot argument `granule64` ([`use_granule64`]) the tables are
//! those of `mmu64.rs` instead (64 KiB granule, levels 1 to 3), and
//! [`test_va`], [`test_pte`], [`root`], [`config`] and [`clean_tables`]
//! answer for them, as do [`dirty_pte`], [`dirty_va`], [`root_copy`],
//! [`root_entry`] and the block scenarios' [`block_entry`] (a 512 MiB
//! block then, [`block_size`]).

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tlb_batch::PageSize;

use crate::mmu64;

/// Where the test pages live: level 0 index 1, away from the identity map,
/// the last [`TEST_PAGES`] entries of one leaf table.
pub const TEST_VA: u64 = 0x0000_0080_0000_0000 + (512 - TEST_PAGES as u64) * 4096;
/// How many test pages there are: more than the crate's full-flush ceiling
/// (33 pages), so that one batch can pass it (asserted in main.rs).
pub const TEST_PAGES: usize = 48;
const _: () = assert!(TEST_VA >> 39 == 1, "the test pages need their own level 0 entry");

/// The ASID of the test address space when 16-bit ASIDs exist (it does
/// not fit 8 bits, so a CPU or setup that drops the top byte is noticed on
/// hardware); [`ASID_8`] otherwise.
const ASID_16: u16 = 0x3ca5;
const ASID_8: u16 = 0xa5;

pub const DESC_VALID: u64 = 1 << 0;
/// Table descriptor at levels 0-2, page descriptor at level 3.
pub const DESC_TABLE_OR_PAGE: u64 = 1 << 1;
pub const ATTR_DEVICE: u64 = 0 << 2;
pub const ATTR_NORMAL: u64 = 1 << 2;
/// AP\[2\]: read-only at every level.
pub const AP_READ_ONLY: u64 = 1 << 7;
pub const SH_INNER: u64 = 3 << 8;
/// The access flag.
pub const AF: u64 = 1 << 10;
pub const NG: u64 = 1 << 11;
/// DBM, the dirty bit modifier: with TCR_EL1.HD = 1 a write through a
/// read-only (AP\[2\] = 1) descriptor with DBM set makes the hardware
/// clear AP\[2\] in memory instead of faulting.
pub const DBM: u64 = 1 << 51;
pub const PXN: u64 = 1 << 53;
pub const UXN: u64 = 1 << 54;
/// The output address field of a 4 KiB page descriptor (48-bit PAs).
pub const OUTPUT_ADDRESS: u64 = 0x0000_ffff_ffff_f000;

/// Leaf descriptor bits of a data page of the test address space
/// (writable: AP\[2\] clear).
pub const TEST_PAGE_FLAGS: u64 =
    DESC_VALID | DESC_TABLE_OR_PAGE | ATTR_NORMAL | SH_INNER | AF | NG | PXN | UXN;

/// Where the block scenario (`block.rs`) maps its 2 MiB block: the level
/// 2 entry after the one whose leaf table holds the test pages.
pub const BLOCK_VA: u64 = (TEST_VA & !0x1f_ffff) + MIB2;
const _: () = assert!(BLOCK_VA >> 39 == 1 && (BLOCK_VA >> 21) & 511 == 1);

/// Pages of the clean-write scenario, at the start of the test pages'
/// leaf table (the other test pages are its last [`TEST_PAGES`] entries).
pub const DIRTY_PAGES: usize = 16;
const _: () = assert!(DIRTY_PAGES + TEST_PAGES <= 512);

/// Set by the boot argument `granule64`, before the tables are built:
/// the tables are `mmu64.rs`'s, with the 64 KiB granule.
static GRANULE_64K: AtomicBool = AtomicBool::new(false);

/// Makes this boot use the 64 KiB granule: call it before [`build`].
pub fn use_granule64() {
    GRANULE_64K.store(true, Ordering::Relaxed);
}

/// Whether this boot uses the 64 KiB granule.
pub fn granule64() -> bool {
    GRANULE_64K.load(Ordering::Relaxed)
}

/// The page the tables map: 4 or 64 KiB.
pub fn page_size() -> PageSize {
    if granule64() {
        PageSize::SIZE_64K
    } else {
        PageSize::SIZE_4K
    }
}

/// Bytes in a test page.
pub fn page_bytes() -> u64 {
    page_size().bytes()
}

/// A test page in the crate's 4 KiB units (`PageRange` lengths).
pub fn page_units() -> u64 {
    page_bytes() / 4096
}

/// MAIR_EL1: attribute 0 Device-nGnRnE, attribute 1 Normal memory,
/// inner and outer write-back non-transient, read and write allocate.
const MAIR: u64 = 0xff << 8;

const GIB: u64 = 1 << 30;
const MIB2: u64 = 2 << 20;

#[repr(C, align(4096))]
pub struct Table(pub [AtomicU64; 512]);

impl Table {
    pub const fn new() -> Self {
        Table([const { AtomicU64::new(0) }; 512])
    }
    pub fn addr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
}

static L0: Table = Table::new();
static L1_IDENT: Table = Table::new();
static L2_RAM: Table = Table::new();
static L1_TEST: Table = Table::new();
static L2_TEST: Table = Table::new();
/// The test pages' leaf table: the scenarios write their entries.
static L3_TEST: Table = Table::new();

/// What every CPU loads to turn its MMU on (read by `mmu_enable` in
/// `boot.rs`, in this order).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MmuConfig {
    pub mair: u64,
    pub tcr: u64,
    pub ttbr0: u64,
    pub sctlr: u64,
}

/// Facts read from ID_AA64MMFR0_EL1.
#[derive(Clone, Copy)]
pub struct MmuFeatures {
    pub asid_16: bool,
    /// PARange, capped at 48 bits (0b101): more needs 52-bit descriptors.
    pub pa_range: u64,
    pub has_4k: bool,
    /// TGran64 (bits 27:24) is not 0b1111: the 64 KiB granule exists.
    pub has_64k: bool,
    /// ID_AA64MMFR2_EL1.TTL (bits 51:48) is not 0: FEAT_TTL, the level
    /// hints of by-address `TLBI`s.
    pub feat_ttl: bool,
    /// ID_AA64MMFR1_EL1.HAFDBS is not 0: the hardware can set access
    /// flags (TCR_EL1.HA).
    pub hw_access_flag: bool,
    /// ID_AA64MMFR1_EL1.HAFDBS, which says what the hardware can manage:
    /// 1 access flags, 2 (or more) dirty state too (TCR_EL1.HD).
    pub hafdbs: u64,
}

impl MmuFeatures {
    pub fn read() -> Self {
        let r: u64;
        // SAFETY: reading an ID register at EL1 has no side effect.
        unsafe { core::arch::asm!("mrs {}, id_aa64mmfr0_el1", out(reg) r, options(nomem, nostack)) };
        let r1: u64;
        // SAFETY: as above.
        unsafe { core::arch::asm!("mrs {}, id_aa64mmfr1_el1", out(reg) r1, options(nomem, nostack)) };
        MmuFeatures {
            hw_access_flag: r1 & 0xf != 0,
            hafdbs: r1 & 0xf,
            asid_16: (r >> 4) & 0xf == 0b0010,
            pa_range: (r & 0xf).min(0b101),
            // TGran4 (bits 31:28): 0b1111 means no 4 KiB granule.
            has_4k: (r >> 28) & 0xf != 0xf,
            has_64k: (r >> 24) & 0xf != 0xf,
            // SAFETY: EL1, as above.
            feat_ttl: (unsafe { tlb_batch::arch::aarch64::read_id_aa64mmfr2_el1() } >> 48) & 0xf != 0,
        }
    }

    /// Whether the hardware can set pages dirty (FEAT_HAFDBS with dirty
    /// state: HAFDBS 2 or more), so that TCR_EL1.HD is on.
    pub fn hw_dirty_state(&self) -> bool {
        self.hafdbs >= 2
    }

    /// The test address space's ASID.
    pub fn test_asid(&self) -> u16 {
        if self.asid_16 {
            ASID_16
        } else {
            ASID_8
        }
    }
}

/// Builds the tables. Runs once, on the boot CPU, with its MMU off: only
/// plain aligned stores (no atomic read-modify-write on memory that is
/// still Device memory to this CPU).
pub fn build(ram_base: u64, ram_size: u64) -> Result<(), &'static str> {
    if granule64() {
        return mmu64::build(ram_base, ram_size);
    }
    if !ram_base.is_multiple_of(GIB) || ram_size == 0 || ram_size > GIB {
        return Err("RAM is not one block of at most 1 GiB at a 1 GiB boundary");
    }
    let table = DESC_VALID | DESC_TABLE_OR_PAGE;
    L0.0[0].store(L1_IDENT.addr() | table, Ordering::Relaxed);
    // Level 1 block (bit 1 clear): 1 GiB of devices.
    L1_IDENT.0[0].store(DESC_VALID | ATTR_DEVICE | AF | PXN | UXN, Ordering::Relaxed);
    L1_IDENT.0[(ram_base / GIB) as usize].store(L2_RAM.addr() | table, Ordering::Relaxed);
    for i in 0..ram_size.div_ceil(MIB2) {
        let pa = ram_base + i * MIB2;
        L2_RAM.0[i as usize].store(
            pa | DESC_VALID | ATTR_NORMAL | SH_INNER | AF | UXN,
            Ordering::Relaxed,
        );
    }
    let [i0, i1, i2, _] = indices(TEST_VA);
    L0.0[i0].store(L1_TEST.addr() | table, Ordering::Relaxed);
    L1_TEST.0[i1].store(L2_TEST.addr() | table, Ordering::Relaxed);
    L2_TEST.0[i2].store(L3_TEST.addr() | table, Ordering::Relaxed);
    Ok(())
}

/// The leaf entry of test page `page` (below [`TEST_PAGES`]).
pub fn test_pte(page: usize) -> &'static AtomicU64 {
    if granule64() {
        return mmu64::leaf_entry(test_va(page));
    }
    &L3_TEST.0[indices(test_va(page))[3]]
}

/// The level 2 entry that maps [`block_va`] (empty until a block
/// scenario writes a block descriptor or its split table there).
pub fn block_entry() -> &'static AtomicU64 {
    if granule64() {
        return mmu64::block_entry();
    }
    &L2_TEST.0[indices(BLOCK_VA)[2]]
}

/// Where the block scenarios map their level 2 block: [`BLOCK_VA`], or
/// [`mmu64::BLOCK_VA`] with the 64 KiB granule.
pub fn block_va() -> u64 {
    if granule64() {
        mmu64::BLOCK_VA
    } else {
        BLOCK_VA
    }
}

/// What a level 2 block maps: 2 MiB, or 512 MiB with the 64 KiB granule
/// (the block scenarios' block; the pieces they read are pages,
/// [`page_bytes`]).
pub fn block_size() -> PageSize {
    if granule64() {
        PageSize::SIZE_512M
    } else {
        PageSize::SIZE_2M
    }
}

/// Bytes in a level 2 block.
pub fn block_bytes() -> u64 {
    block_size().bytes()
}

/// The block's size as the scenario names and lines say it.
pub fn block_name() -> &'static str {
    if granule64() {
        "512 MiB"
    } else {
        "2 MiB"
    }
}

/// Pages in a level 2 block: the entries of a level 3 table (512 or
/// 8192).
pub fn block_pages() -> u64 {
    block_bytes() / page_bytes()
}

/// The leaf entry of the clean-write scenario's page `page` (below
/// [`DIRTY_PAGES`]).
pub fn dirty_pte(page: usize) -> &'static AtomicU64 {
    if granule64() {
        return mmu64::leaf_entry(dirty_va(page));
    }
    &L3_TEST.0[indices(dirty_va(page))[3]]
}

/// The address of the clean-write scenario's page `page`: the start of
/// the test pages' leaf table (2 MiB of 4 KiB pages, or 512 MiB of
/// 64 KiB pages), one page each.
pub fn dirty_va(page: usize) -> u64 {
    if granule64() {
        return mmu64::DIRTY_VA + page as u64 * mmu64::GRANULE;
    }
    (TEST_VA & !0x1f_ffff) + page as u64 * 4096
}

/// The address of test page `page`.
pub fn test_va(page: usize) -> u64 {
    if granule64() {
        return mmu64::TEST_VA + page as u64 * mmu64::GRANULE;
    }
    TEST_VA + page as u64 * 4096
}

/// The root of the tables (the test address space's, and the kernel's).
pub fn root() -> u64 {
    if granule64() {
        return mmu64::root();
    }
    L0.addr()
}

/// Roots of their own for the generations scenario's two address spaces.
static L0_COPIES: [Table; 2] = [const { Table::new() }; 2];

/// A root of its own (`slot` 0 or 1) that maps what [`root`] maps now,
/// through the same lower tables: a CPU that has [`root`] loaded does not
/// have this one loaded, so the crate can tell it apart (a root loaded
/// without `switch_mm` to its own space is refused).
///
/// With the 64 KiB granule the root is `mmu64.rs`'s level 1 table (64
/// entries, 512 bytes, so a 4 KiB table holds its copy too).
pub fn root_copy(slot: usize) -> u64 {
    let Some(copy) = L0_COPIES.get(slot) else {
        crate::fatal("no such root copy");
    };
    let root = if granule64() { mmu64::root_table() } else { &L0 };
    for (to, from) in copy.0.iter().zip(root.0.iter()) {
        to.store(from.load(Ordering::Acquire), Ordering::Release);
    }
    // The entries reach the other CPUs' table walks before any of them
    // can load this root.
    tlb_batch::arch::aarch64::dsb_ish();
    copy.addr()
}

/// Entry `index` of the root table, for the scenarios whose page tables
/// hang below a root entry of their own: below 512 at 4 KiB (level 0),
/// below 64 at 64 KiB (level 1, `mmu64.rs`; the entries past the 64th
/// are not part of the table).
pub fn root_entry(index: usize) -> &'static AtomicU64 {
    if granule64() {
        if index >= 64 {
            crate::fatal("a root entry past the 64 of the 64 KiB granule's level 1 table");
        }
        return &mmu64::root_table().0[index];
    }
    &L0.0[index]
}

/// The level 0-3 table indices of `va`.
fn indices(va: u64) -> [usize; 4] {
    [39, 30, 21, 12].map(|shift| ((va >> shift) & 511) as usize)
}

/// The register values that turn translation on with these tables.
pub fn config(f: &MmuFeatures) -> MmuConfig {
    let t0sz = 16;
    let irgn0_wb = 1 << 8;
    let orgn0_wb = 1 << 10;
    let sh0_inner = 3 << 12;
    let t1sz = 16 << 16;
    let epd1 = 1 << 23;
    // TG0 = 0b00 and TG1 = 0b10 (4 KiB), or both 64 KiB.
    let granule = if granule64() { mmu64::TCR_GRANULE } else { 2 << 30 };
    let ips = f.pa_range << 32;
    let as16 = u64::from(f.asid_16) << 36;
    let ha = u64::from(f.hw_access_flag) << 39;
    let hd = u64::from(f.hw_dirty_state()) << 40;
    let tcr = t0sz | irgn0_wb | orgn0_wb | sh0_inner | granule | t1sz | epd1 | ips | as16 | ha | hd;
    // ASID 0 until the crate loads the test address space.
    let ttbr0 = root();
    // SCTLR_EL1 as reset left it, plus M (MMU), C (data cache) and I
    // (instruction cache); minus A (alignment checks), WXN and the
    // big-endian bits.
    let sctlr: u64;
    // SAFETY: reading a system register at EL1 has no side effect.
    unsafe { core::arch::asm!("mrs {}, sctlr_el1", out(reg) sctlr, options(nomem, nostack)) };
    let (m, a, c, i, wxn, e0e, ee) = (1, 1 << 1, 1 << 2, 1 << 12, 1 << 19, 1 << 24, 1 << 25);
    MmuConfig {
        mair: MAIR,
        tcr,
        ttbr0,
        sctlr: (sctlr | m | c | i) & !(a | wxn | e0e | ee),
    }
}

/// Cleans `len` bytes at `addr` to the point of coherency, so that a CPU
/// whose MMU (and so whose caches) are still off reads what this one wrote.
pub fn clean_to_poc(addr: u64, len: u64) {
    let ctr: u64;
    // SAFETY: reading CTR_EL0 has no side effect.
    unsafe { core::arch::asm!("mrs {}, ctr_el0", out(reg) ctr, options(nomem, nostack)) };
    // DminLine (bits 19:16): log2 of the smallest data cache line, in words.
    let line = 4u64 << ((ctr >> 16) & 0xf);
    let mut a = addr & !(line - 1);
    while a < addr + len {
        // SAFETY: a cache clean by address changes no memory contents;
        // `a` is identity-mapped RAM.
        unsafe { core::arch::asm!("dc cvac, {}", in(reg) a, options(nostack)) };
        a += line;
    }
    // SAFETY: a barrier only.
    unsafe { core::arch::asm!("dsb sy", options(nostack)) };
}

/// Cleans every table to the point of coherency (for CPUs that walk them
/// before their caches are on).
pub fn clean_tables() {
    if granule64() {
        return mmu64::clean_tables();
    }
    for t in [&L0, &L1_IDENT, &L2_RAM, &L1_TEST, &L2_TEST, &L3_TEST] {
        clean_to_poc(t.addr(), 4096);
    }
}

/// Whether this CPU runs with its MMU on.
pub fn enabled() -> bool {
    let sctlr: u64;
    // SAFETY: reading a system register at EL1 has no side effect.
    unsafe { core::arch::asm!("mrs {}, sctlr_el1", out(reg) sctlr, options(nomem, nostack)) };
    sctlr & 1 != 0
}
