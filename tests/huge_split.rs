//! Splitting a huge mapping and promoting (collapsing) small ones into a
//! huge one, over real four-level tables (the `x86_64` crate's, in host
//! memory, attached to the mock) with other CPUs holding the old entries:
//! the crate's break / flush / make sequence (`split_huge_mapping`,
//! `promote_to_huge`) stays clean, and each way of getting it wrong that
//! kernels have shipped is caught by the oracle:
//!
//! - a split whose new small entries are written with no flush (a CPU keeps
//!   the huge entry): `StaleAfterChange`, and `FreedWhileCached` for a
//!   piece moved to another frame;
//! - a promotion that flushes only the huge page's first address (FreeBSD's
//!   old promotion bug): the older 4 KiB entries stay, and the next fill of
//!   another piece caches the huge entry beside them,
//!   `ConflictingTranslations`; freeing the old frames, `FreedWhileCached`;
//! - a flush at a 2 MiB stride over 4 KiB entries (FreeBSD-EN-26:10's
//!   INVLPGB shape): `FreedWhileCached`;
//! - a collapse flushed as if it freed no page table, skipping a lazy CPU
//!   whose walk cache points to the freed leaf table (CVE-2025-22045's
//!   shape): `TableFreedWhileCached`.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::asid;
use common::x86_tables::{map, upper_entry, user_rw, HostMmu, Tables, MIB2};
use tlb_batch::arch::mock::{
    Arm64Like, Fault, MmuTable, MockConfig, MockCpu, MockMachine, Model, Violation, X86Like,
};
use tlb_batch::arch::Arch;
use tlb_batch::{
    flush_tlb_page, flush_tlb_range, promote_to_huge, shootdown, split_huge_mapping, Error, FlushRequest,
    Frame, HugeChange, MmTlbState, PageRange, PageSize, PAGE_SIZE,
};
use x86_64::structures::paging::{PageTable as X86Table, PageTableFlags as F, Size2MiB, Size4KiB};
use x86_64::PhysAddr;

/// The huge page's address (the second 2 MiB of the second GiB).
const H: u64 = 0x4000_0000 + MIB2;
/// Pieces (4 KiB pages of the huge range) the tests look at.
const RO_PIECE: u64 = 7;
const MOVED_PIECE: u64 = 9;
const PRESENT_RW_USER: u64 = 0x7;
const HUGE_BIT: u64 = 0x80;
const ADDR_2M: u64 = 0x000f_ffff_ffe0_0000;
const ADDR_4K: u64 = 0x000f_ffff_ffff_f000;

fn piece(i: u64) -> u64 {
    H + i * PAGE_SIZE
}

fn huge_range() -> PageRange {
    PageRange::new(H, PageSize::SIZE_2M.base_pages()).unwrap()
}

/// The machine's frames, handed out from the lowest: 512..1024 is a
/// 2 MiB-aligned block (physical 2 MiB), 1024..1536 are the pieces' frames
/// before a collapse, 1536.. spares.
struct Frames {
    block: Frame,
    small: Vec<Frame>,
    spare: Frame,
}

fn frames<M: Model>(m: &MockMachine<M>) -> Frames {
    let all: Vec<Frame> = (0..1537).map(|_| m.alloc_frame().unwrap()).collect();
    assert_eq!(all[512], Frame(512), "frames are handed out from the lowest");
    Frames {
        block: all[512],
        small: all[1024..1536].to_vec(),
        spare: all[1536],
    }
}

/// A machine of model `M` with three CPUs and an address space that `t`
/// translates.
fn machine_of<M: Model>(t: &Tables) -> (MockMachine<M>, Arc<MmTlbState>) {
    let m = MockMachine::<M>::with_model(MockConfig::x86_like(3)).unwrap();
    let root = t.root_addr();
    let mm = m.new_mm_at(asid(1), root).unwrap();
    m.attach_table(&mm, Arc::new(HostMmu { root })).unwrap();
    (m, mm)
}

/// The page-directory entry that maps the huge range (a huge entry, or
/// the pointer to its leaf table).
fn pde(t: &Tables) -> &'static AtomicU64 {
    upper_entry(t.root_addr(), H, 2)
}

/// A new leaf table whose entry `i` is `entry(i)`, as a host address.
fn leaf_table(entry: impl Fn(u64) -> u64) -> u64 {
    let table: &'static mut X86Table = Box::leak(Box::new(X86Table::new()));
    for (i, e) in table.iter_mut().enumerate() {
        let raw = entry(i as u64);
        e.set_addr(
            PhysAddr::new(raw & ADDR_4K),
            F::from_bits_truncate(raw & !ADDR_4K),
        );
    }
    table as *mut X86Table as u64
}

/// The split's table: the huge entry's frames and bits, piece
/// [`RO_PIECE`] read-only and piece [`MOVED_PIECE`] moved to `moved_to`
/// (an mprotect and a migration of one piece each, the reasons a kernel
/// splits).
fn split_table(old_pde: u64, moved_to: Frame) -> u64 {
    let base = old_pde & ADDR_2M;
    let flags = old_pde & 0x7f;
    leaf_table(|i| match i {
        RO_PIECE => (base + i * PAGE_SIZE) | (flags & !0x2),
        MOVED_PIECE => moved_to.addr() | flags,
        _ => (base + i * PAGE_SIZE) | flags,
    })
}

/// Tables with a 2 MiB page at `H` over the block, CPUs 1 and 2 running
/// the space and holding its huge entry (each wrote a piece), and CPU 2
/// lazy when `lazy`.
fn huge_mapped<M: Model>(lazy: bool) -> (Tables, MockMachine<M>, Arc<MmTlbState>, Frames) {
    let mut t = Tables::new();
    let (m, mm) = machine_of::<M>(&t);
    let f = frames(&m);
    {
        let (mut mapper, mut pool) = t.mapper();
        map::<Size2MiB>(&mut mapper, &mut pool, H, f.block.addr(), user_rw());
    }
    for c in 0..3 {
        m.cpu(c).unwrap().switch_to(&mm).unwrap();
    }
    for c in 1..3 {
        let cpu = m.cpu(c).unwrap();
        cpu.write(piece(c as u64), c as u64).unwrap();
        assert!(holds_huge(&m, &cpu), "CPU {c} caches the huge entry");
    }
    if lazy {
        m.cpu(2).unwrap().enter_lazy().unwrap();
    }
    (t, m, mm, f)
}

/// Whether `cpu` caches a 2 MiB entry for `H`.
fn holds_huge<M: Model>(m: &MockMachine<M>, cpu: &MockCpu<'_, M>) -> bool {
    m.all_entries()
        .iter()
        .any(|(c, e)| *c == cpu.id() && e.vpn == H >> 12 && e.size == PageSize::SIZE_2M)
}

/// What the CPUs see after a split: the read-only piece refuses a write,
/// the moved one reaches the new frame, and the old frame of the moved
/// piece is freed.
fn use_after_split<M: Model>(m: &MockMachine<M>, f: &Frames) {
    let cpu1 = m.cpu(1).unwrap();
    let _ = cpu1.write(piece(RO_PIECE), 11);
    let _ = cpu1.write(piece(MOVED_PIECE), 99);
    m.free_frame(Frame(f.block.0 + MOVED_PIECE)).unwrap();
}

fn split_with_the_sequence<M: Model>() {
    let (t, m, mm, f) = huge_mapped::<M>(true);
    let cpu0 = m.cpu(0).unwrap();
    let broken = split_huge_mapping(&cpu0, &mm, H, PageSize::SIZE_2M, || {
        pde(&t).swap(0, Ordering::SeqCst)
    })
    .unwrap();
    assert_eq!(
        (broken.change(), broken.flush_stride()),
        (HugeChange::Split, PageSize::SIZE_2M)
    );
    let flushed = broken.flush(&cpu0).unwrap();
    let lingering = [1, 2].map(|c| holds_huge(&m, &m.cpu(c).unwrap()));
    flushed.make(|old| pde(&t).store(split_table(old, f.spare) | PRESENT_RW_USER, Ordering::SeqCst));
    let stale = m.check_coherent(&mm, huge_range());
    let cpu1 = m.cpu(1).unwrap();
    let ro_write = cpu1.write(piece(RO_PIECE), 11);
    use_after_split(&m, &f);
    let read1 = cpu1.read(piece(1));
    let cpu2 = m.cpu(2).unwrap();
    cpu2.switch_to(&mm).unwrap(); // resumes from lazy
    let read2 = cpu2.read(piece(2));
    // The oracle first, then what the CPUs saw.
    assert_eq!(m.violations(), []);
    assert_eq!(stale, 0);
    assert_eq!(
        lingering,
        [false, false],
        "the flush reached CPU 1 and lazy CPU 2"
    );
    assert!(ro_write.is_err(), "read-only now");
    assert_eq!(
        m.frame_data(f.spare).unwrap(),
        99,
        "the write reached the new frame"
    );
    assert_eq!(
        (read1, read2),
        (Ok(1), Ok(2)),
        "the other pieces are as they were"
    );
}

/// The crate's split: the huge entry goes from every CPU (the lazy one
/// too) before the small entries are written; afterwards each piece is
/// what its new entry says.
#[test]
fn a_split_through_the_crate_is_clean() {
    split_with_the_sequence::<X86Like>();
}

#[test]
fn on_arm64_a_split_through_the_crate_is_clean() {
    split_with_the_sequence::<Arm64Like>();
}

/// A split that writes the new table with no flush: CPU 1 keeps the
/// writable huge entry, so the read-only piece is stale and the moved
/// piece's old frame is freed under it.
#[test]
fn a_split_without_the_flush_is_caught() {
    let (t, m, mm, f) = huge_mapped::<X86Like>(false);
    let old = pde(&t).swap(0, Ordering::SeqCst);
    pde(&t).store(split_table(old, f.spare) | PRESENT_RW_USER, Ordering::SeqCst);
    assert!(m.check_coherent(&mm, huge_range()) >= 2, "CPUs 1 and 2");
    use_after_split(&m, &f);
    let v = m.violations();
    assert!(
        v.iter()
            .any(|v| matches!(v, Violation::StaleAfterChange { writable: true, .. })),
        "{v:?}"
    );
    assert!(
        v.iter().any(
            |v| matches!(v, Violation::FreedWhileCached { frame, .. } if frame.0 == f.block.0 + MOVED_PIECE)
        ),
        "{v:?}"
    );
    assert_eq!(
        m.frame_data(f.spare).unwrap(),
        0,
        "the write went to the old frame"
    );
}

/// Tables mapping the huge range with 4 KiB pages (piece `i` to the `i`th
/// small frame), CPU 1 having written pieces 0, 3, 100 and 511 (their
/// 4 KiB entries and the walk pointers to the leaf table cached), and CPU
/// 2 having read piece 5, then lazy when `lazy`. Returns the leaf table.
fn small_mapped<M: Model>(lazy: bool) -> (Tables, MockMachine<M>, Arc<MmTlbState>, Frames, Frame) {
    let mut t = Tables::new();
    let (m, mm) = machine_of::<M>(&t);
    let f = frames(&m);
    {
        let (mut mapper, mut pool) = t.mapper();
        for (i, frame) in f.small.iter().enumerate() {
            map::<Size4KiB>(&mut mapper, &mut pool, piece(i as u64), frame.addr(), user_rw());
        }
    }
    for c in 0..3 {
        m.cpu(c).unwrap().switch_to(&mm).unwrap();
    }
    let cpu1 = m.cpu(1).unwrap();
    for i in [0, 3, 100, 511] {
        cpu1.write(piece(i), 1000 + i).unwrap();
    }
    let cpu2 = m.cpu(2).unwrap();
    cpu2.read(piece(5)).unwrap();
    let leaf = Frame((pde(&t).load(Ordering::SeqCst) & ADDR_4K) >> 12);
    assert!(cpu2.walk_cache().iter().any(|w| w.level == 1 && w.table == leaf));
    if lazy {
        cpu2.enter_lazy().unwrap();
    }
    (t, m, mm, f, leaf)
}

/// The make step of a collapse: copy each piece into the block, write the
/// huge entry, free the old leaf table and the old frames.
fn collapse<M: Model>(t: &Tables, m: &MockMachine<M>, f: &Frames, leaf: Frame) {
    for (i, small) in f.small.iter().enumerate() {
        m.copy_frame(*small, Frame(f.block.0 + i as u64)).unwrap();
    }
    pde(t).store(f.block.addr() | PRESENT_RW_USER | HUGE_BIT, Ordering::SeqCst);
    m.free_table_frame(leaf);
    for small in &f.small {
        m.free_frame(*small).unwrap();
    }
}

/// What the CPUs do after a collapse: CPU 1 reads pieces it had cached and
/// one it had not; each read must see what it wrote before.
fn use_after_collapse<M: Model>(m: &MockMachine<M>) -> Vec<Result<u64, Fault>> {
    let cpu1 = m.cpu(1).unwrap();
    [200, 3, 100, 511]
        .into_iter()
        .map(|i| cpu1.read(piece(i)))
        .collect()
}

fn promote_with_the_sequence<M: Model>() {
    let (t, m, mm, f, leaf) = small_mapped::<M>(true);
    let cpu0 = m.cpu(0).unwrap();
    let broken = promote_to_huge(&cpu0, &mm, H, PageSize::SIZE_2M, || {
        pde(&t).swap(0, Ordering::SeqCst)
    })
    .unwrap();
    let stride = broken.flush_stride();
    let flushed = broken.flush(&cpu0).unwrap();
    let old_leaf = flushed.make(|old| {
        collapse(&t, &m, &f, leaf);
        Frame((old & ADDR_4K) >> 12)
    });
    let reads = use_after_collapse(&m);
    let cpu2 = m.cpu(2).unwrap();
    cpu2.switch_to(&mm).unwrap(); // resumes from lazy
    let read2 = cpu2.read(piece(3));
    // The oracle first, then what the CPUs saw.
    assert_eq!(m.violations(), []);
    assert_eq!(stride, PageSize::SIZE_4K);
    assert_eq!(old_leaf, leaf);
    assert_eq!(reads, [Ok(0), Ok(1003), Ok(1100), Ok(1511)], "copied");
    assert!(holds_huge(&m, &m.cpu(1).unwrap()));
    assert_eq!(read2, Ok(1003));
}

/// The crate's promotion: every 4 KiB entry of the range, and every walk
/// pointer to the unlinked leaf table (the lazy CPU's included), is gone
/// before the huge entry is written and the table and frames freed.
#[test]
fn a_promotion_through_the_crate_is_clean() {
    promote_with_the_sequence::<X86Like>();
}

#[test]
fn on_arm64_a_promotion_through_the_crate_is_clean() {
    promote_with_the_sequence::<Arm64Like>();
}

/// FreeBSD's old promotion bug: only the huge page's first address is
/// invalidated. CPU 1 keeps its 4 KiB entries for pieces 3, 100 and 511;
/// its fill of piece 200 caches the huge entry beside them
/// (`ConflictingTranslations`, named at the first piece both translate,
/// piece 3: its old frame and its frame in the block), its reads of the
/// old pieces still reach the old frames, and freeing those is
/// `FreedWhileCached`.
#[test]
fn a_promotion_that_flushes_only_the_first_page_is_caught() {
    let (t, m, mm, f, leaf) = small_mapped::<X86Like>(false);
    let cpu0 = m.cpu(0).unwrap();
    pde(&t).swap(0, Ordering::SeqCst);
    flush_tlb_page(&cpu0, &mm, H).unwrap();
    for (i, small) in f.small.iter().enumerate() {
        m.copy_frame(*small, Frame(f.block.0 + i as u64)).unwrap();
    }
    pde(&t).store(f.block.addr() | PRESENT_RW_USER | HUGE_BIT, Ordering::SeqCst);
    assert_eq!(m.cpu(1).unwrap().read(piece(200)).unwrap(), 0);
    let v = m.violations();
    assert!(
        v.iter().any(
            |v| matches!(v, Violation::ConflictingTranslations { va, cached, filled, .. }
                if *va == piece(3) && *cached == f.small[3] && *filled == Frame(f.block.0 + 3))
        ),
        "{v:?}"
    );
    m.free_table_frame(leaf);
    for small in &f.small {
        m.free_frame(*small).unwrap();
    }
    let freed_cached = m
        .violations()
        .iter()
        .filter(|v| matches!(v, Violation::FreedWhileCached { cpu, .. } if cpu.index() == 1))
        .count();
    assert_eq!(freed_cached, 3, "pieces 3, 100 and 511");
}

/// CVE-2025-22045's shape: a collapse whose flush covers every page but
/// is sent as if no page table were freed (`flush_tlb_range`, which skips
/// lazy CPUs). CPU 2, lazy, still points to the leaf table when it is
/// freed: `TableFreedWhileCached`. Through the crate (`promote_to_huge`,
/// above) the lazy CPU is reached.
#[test]
fn a_collapse_flushed_as_if_no_table_were_freed_is_caught() {
    let (t, m, mm, f, leaf) = small_mapped::<X86Like>(true);
    let cpu0 = m.cpu(0).unwrap();
    pde(&t).swap(0, Ordering::SeqCst);
    flush_tlb_range(&cpu0, &mm, huge_range()).unwrap();
    collapse(&t, &m, &f, leaf);
    let v = m.violations();
    assert!(
        v.iter().any(|v| matches!(v, Violation::TableFreedWhileCached { frame, cpu } if *frame == leaf && cpu.index() == 2)),
        "{v:?}"
    );
}

/// FreeBSD-EN-26:10's shape: a ranged flush at a 2 MiB stride over a range
/// mapped with 4 KiB pages invalidates only the first page of each 2 MiB,
/// so CPU 1's entries for pieces 3, 100 and 511 survive their unmap and
/// their frames are freed under them. At the 4 KiB stride, clean.
#[test]
fn a_flush_at_a_huge_stride_over_small_entries_is_caught() {
    for stride in [PageSize::SIZE_2M, PageSize::SIZE_4K] {
        let (t, m, mm, f, _) = small_mapped::<X86Like>(false);
        let cpu0 = m.cpu(0).unwrap();
        let mmu = HostMmu { root: t.root_addr() };
        for i in 0..512 {
            mmu.entry(piece(i)).unwrap().store(0, Ordering::SeqCst);
        }
        let mut req = FlushRequest::new();
        req.add_huge_range(
            mm.asid(),
            huge_range(),
            stride,
            <MockCpu<'_, X86Like> as Arch>::FULL_FLUSH_CEILING,
        )
        .unwrap();
        shootdown(&cpu0, &mm.flush_targets(&cpu0), &req).unwrap();
        for small in &f.small {
            m.free_frame(*small).unwrap();
        }
        let freed_cached = m
            .violations()
            .iter()
            .filter(|v| matches!(v, Violation::FreedWhileCached { .. }))
            .count();
        let expected = if stride == PageSize::SIZE_2M { 4 } else { 0 };
        assert_eq!(
            freed_cached, expected,
            "stride {stride}: pieces 3, 100, 511 and CPU 2's 5"
        );
    }
}

/// Input the sequence refuses, each before the break closure runs.
#[test]
fn bad_input_is_refused_before_the_break() {
    let (t, m, mm, _) = huge_mapped::<X86Like>(false);
    let cpu0 = m.cpu(0).unwrap();
    let before = pde(&t).load(Ordering::SeqCst);
    let cases = [
        (H, PageSize::SIZE_4K, Error::NotHuge { size: PAGE_SIZE }),
        (H + 1, PageSize::SIZE_2M, Error::Unaligned { addr: H + 1 }),
        (
            H + PAGE_SIZE,
            PageSize::SIZE_2M,
            Error::StrideUnaligned {
                start: H + PAGE_SIZE,
                pages: 512,
                stride: MIB2,
            },
        ),
        (1 << 47, PageSize::SIZE_2M, Error::NonCanonical { addr: 1 << 47 }),
        (
            0xffff_8000_0000_0000,
            PageSize::SIZE_2M,
            Error::KernelHalf {
                va: 0xffff_8000_0000_0000,
            },
        ),
    ];
    for (va, size, error) in cases {
        let got = split_huge_mapping(&cpu0, &mm, va, size, || panic!("no break"));
        assert_eq!(got.map(|_| ()).unwrap_err(), error, "split {va:#x} {size}");
        let got = promote_to_huge(&cpu0, &mm, va, size, || panic!("no break"));
        assert_eq!(got.map(|_| ()).unwrap_err(), error, "promote {va:#x} {size}");
    }
    m.cpu(2).unwrap().go_offline();
    let got = split_huge_mapping(&m.cpu(2).unwrap(), &mm, H, PageSize::SIZE_2M, || {
        panic!("no break")
    });
    assert_eq!(got.map(|_| ()).unwrap_err(), Error::CpuNotOnline { cpu: 2 });
    assert_eq!(pde(&t).load(Ordering::SeqCst), before, "nothing changed");
    assert_eq!(m.violations(), []);
}

/// A flush that fails (started from an interrupt nested in a shootdown)
/// hands the break back with its flush owed; no new entry can be written
/// meanwhile, and the retry finishes it cleanly.
#[test]
fn a_failed_flush_hands_the_break_back_and_the_retry_finishes() {
    let (t, m, mm, f) = huge_mapped::<X86Like>(false);
    let cpu0 = m.cpu(0).unwrap();
    let broken = split_huge_mapping(&cpu0, &mm, H, PageSize::SIZE_2M, || {
        pde(&t).swap(0, Ordering::SeqCst)
    })
    .unwrap();
    let failed = cpu0.in_shootdown(|| broken.flush(&cpu0)).unwrap().unwrap_err();
    assert_eq!(failed.error, Error::ShootdownReentered { cpu: 0 });
    assert!(holds_huge(&m, &m.cpu(1).unwrap()), "nothing flushed");
    let flushed = failed.broken.flush(&cpu0).unwrap();
    assert_eq!(flushed.report().remote_cpus, 2);
    flushed.make(|old| pde(&t).store(split_table(old, f.spare) | PRESENT_RW_USER, Ordering::SeqCst));
    use_after_split(&m, &f);
    assert_eq!(m.check_coherent(&mm, huge_range()), 0);
    assert_eq!(m.violations(), []);
}

/// Tagged TLBs: CPU 2 cached the huge entry, then switched to another
/// space, keeping it under the first space's ASID. The split's flush does
/// not interrupt it (it cannot fill entries for a space it has not
/// loaded); the moved piece's old frame is freed meanwhile, and when CPU 2
/// loads the space again its catch-up drops the huge entry before any use
/// (no `LoadedWithStale`).
#[test]
fn a_cpu_that_switched_away_catches_up_before_it_uses_the_split_range() {
    let mut t = Tables::new();
    let m = MockMachine::<X86Like>::new(MockConfig {
        tagged_tlb: true,
        ..MockConfig::x86_like(3)
    })
    .unwrap();
    let root = t.root_addr();
    let mm = m.new_mm_at(asid(1), root).unwrap();
    m.attach_table(&mm, Arc::new(HostMmu { root })).unwrap();
    let f = frames(&m);
    {
        let (mut mapper, mut pool) = t.mapper();
        map::<Size2MiB>(&mut mapper, &mut pool, H, f.block.addr(), user_rw());
    }
    let (cpu0, cpu1, cpu2) = (m.cpu(0).unwrap(), m.cpu(1).unwrap(), m.cpu(2).unwrap());
    for cpu in [cpu0, cpu1, cpu2] {
        cpu.switch_to(&mm).unwrap();
    }
    cpu1.write(piece(1), 1).unwrap();
    cpu2.write(piece(MOVED_PIECE), 2).unwrap();
    let other = m.new_mm(asid(2)).unwrap();
    cpu2.switch_to(&other).unwrap();
    assert!(holds_huge(&m, &cpu2), "tagged: the entry stays");
    let broken = split_huge_mapping(&cpu0, &mm, H, PageSize::SIZE_2M, || {
        pde(&t).swap(0, Ordering::SeqCst)
    })
    .unwrap();
    let flushed = broken.flush(&cpu0).unwrap();
    assert_eq!(flushed.report().remote_cpus, 1, "CPU 1 only");
    flushed.make(|old| pde(&t).store(split_table(old, f.spare) | PRESENT_RW_USER, Ordering::SeqCst));
    m.free_frame(Frame(f.block.0 + MOVED_PIECE)).unwrap();
    assert_eq!(m.violations(), [], "CPU 2 cannot use its entry");
    cpu2.switch_to(&mm).unwrap();
    let read = cpu2.read(piece(MOVED_PIECE));
    assert_eq!(m.violations(), [], "the catch-up dropped it");
    assert!(!holds_huge(&m, &cpu2));
    assert_eq!(read, Ok(0), "the new frame");
}

/// On a machine whose page invalidations honour a FEAT_TTL-like level hint
/// (`MockConfig::level_hints`), a flush of an address whose leaf entry the
/// crate did not read (`flush_tlb_page`: the kernel changed the entry)
/// carries no hint: a base-page hint would leave the 2 MiB entry that
/// maps the address cached.
fn a_flush_of_an_entry_of_unknown_size_is_unhinted<M: Model>() {
    let mut t = Tables::new();
    let config = MockConfig {
        level_hints: true,
        ..MockConfig::x86_like(2)
    };
    let m = MockMachine::<M>::with_model(config).unwrap();
    let root = t.root_addr();
    let mm = m.new_mm_at(asid(1), root).unwrap();
    m.attach_table(&mm, Arc::new(HostMmu { root })).unwrap();
    let f = frames(&m);
    {
        let (mut mapper, mut pool) = t.mapper();
        map::<Size2MiB>(&mut mapper, &mut pool, H, f.block.addr(), user_rw());
    }
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu0.switch_to(&mm).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.write(piece(1), 1).unwrap();
    assert!(holds_huge(&m, &cpu1));
    pde(&t).swap(0, Ordering::SeqCst);
    flush_tlb_page(&cpu0, &mm, H).unwrap();
    assert!(!holds_huge(&m, &cpu1), "the huge entry went with the flush");
    assert_eq!(m.stale_entries(), []);
    assert_eq!(m.violations(), []);
}

#[test]
fn a_flush_of_an_entry_of_unknown_size_carries_no_level_hint() {
    a_flush_of_an_entry_of_unknown_size_is_unhinted::<X86Like>();
    a_flush_of_an_entry_of_unknown_size_is_unhinted::<Arm64Like>();
}
