//! The 64 KiB granule run (boot argument `granule64`): what it checks
//! beyond the shared scenarios, which run unchanged over 64 KiB test
//! pages (`mmu64.rs`), and which of this kernel's own scenarios it skips.
//!
//! The scenario here, [`run`], checks what a larger base page changes in
//! the crate's flushes, through [`CountTlbi`](tlb::CountTlbi) (the crate's
//! `Aarch64` with a counter on each page invalidation): every wrapper
//! `Arch` answers the 64 KiB base page; `flush_tlb_range` over 4 test
//! pages asks for 4 page `TLBI`s (one per 64 KiB page, not 64) and gives
//! no level hint (the kernel named the range); a batched `try_to_unmap`
//! of one page asks for 1, with the leaf size the page table reported
//! (64 KiB), which `Aarch64` turns into TTL 0b1111 where FEAT_TTL is
//! present and into no hint where it is not.
//!
//! On a CPU with FEAT_TTL it then measures what the emulator does with
//! the hint: CPU 0 caches test page 0, its descriptor is moved to another
//! frame with no `TLBI`, and one `TLBI VAE1IS` is issued (none; a wrong
//! level hint; another page's address with the right hint; the right
//! one), after which CPU 0 reads the page again. A wrong hint lets the
//! hardware keep the entry (Arm ARM, the TTL field of `TLBI VAE1IS`); if
//! the emulator drops it anyway, a wrong hint cannot be caught here and
//! the line says so.

use tlb_batch::arch::aarch64::{self as a64, tlbi_va_operand_for, ttl_hint};
use tlb_batch::{
    flush_tlb_range, try_to_unmap, Arch, PageRange, PageSize, SwapResult, TlbFlushUnmapBatch, TtuFlags,
};
use tlb_batch_qemu_scenarios::{Flush, Frame, Platform};

use crate::tlb::{self, CountTlbi, FlushTimeTlbi, LocalTlbi, NoDsb, SkipTlbi};
use crate::virt::frame_of;
use crate::{mmu, say, space, Virt};

const NAME: &str = "64 KiB granule TLBIs";
/// Test pages the range flush covers.
const RANGE_PAGES: usize = 4;

/// The base page every `Arch` of this kernel answers, if they agree.
fn base_page_of_all() -> Option<PageSize> {
    let a = *tlb::arch();
    let all = [
        a.base_page(),
        SkipTlbi(a).base_page(),
        LocalTlbi(a).base_page(),
        FlushTimeTlbi(a).base_page(),
        NoDsb(a).base_page(),
        CountTlbi(a).base_page(),
    ];
    all.iter().all(|&b| b == all[0]).then_some(all[0])
}

/// Maps test pages `0..pages` to their frames A (value `v + page`), made
/// visible on every CPU with the real flush.
fn map_fresh(p: &Virt, pages: usize, v: u64) {
    for i in 0..pages {
        p.fill_frame(i, Frame::A, v + i as u64);
        p.set_pte(i, Some(Frame::A));
    }
    p.publish();
    p.flush_pages(pages);
}

/// Runs the scenario on CPU 0, prints its lines and returns whether it
/// passed.
pub fn run() -> bool {
    let p = Virt;
    let a = CountTlbi(*tlb::arch());
    let config = tlb::arch().config();
    let base = base_page_of_all();

    map_fresh(&p, RANGE_PAGES, 0x6464_0000);
    CountTlbi::reset();
    let range = PageRange::new(mmu::test_va(0), RANGE_PAGES as u64 * mmu::page_units());
    let range_ok = range.is_ok_and(|r| flush_tlb_range(&a, tlb::mm(), r).is_ok());
    let (range_tlbis, range_sized, _) = CountTlbi::counts();

    CountTlbi::reset();
    let mut batch = TlbFlushUnmapBatch::new();
    let frame = tlb_batch::Frame(frame_of(0, Frame::A).0.as_ptr() as u64 >> 12);
    let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
    let unmapped = try_to_unmap(&a, &space::TestRmap, frame, flags, &mut batch);
    let pending = batch.pending_pages();
    let flushed = batch.flush(&a).is_ok();
    let (unmap_tlbis, unmap_sized, leaf) = CountTlbi::counts();
    let faults = p.read_page(0).is_none();
    let leaf_size = (leaf != 0)
        .then(|| PageSize::from_shift(leaf.trailing_zeros()))
        .flatten();
    let ttl = match leaf_size {
        Some(size) if config.level_hints() => ttl_hint(config.granule(), size),
        _ => 0,
    };
    let ok = base == Some(PageSize::SIZE_64K)
        && range_ok
        && range_tlbis == RANGE_PAGES as u64
        && range_sized == 0
        && matches!(unmapped, Ok(SwapResult::SuccessCached))
        && pending == 1
        && flushed
        && unmap_tlbis == 1
        && unmap_sized == 1
        && leaf == PageSize::SIZE_64K.bytes()
        && ttl == if config.level_hints() { 0b1111 } else { 0 }
        && faults;
    say!(
        "scenario {NAME}: {} (base page of the crate's Aarch64 and of every test wrapper: {} KiB; flush_tlb_range of \
         {RANGE_PAGES} pages: page TLBIs {range_tlbis}, with a leaf size {range_sized}; batched try_to_unmap of 1 \
         page: {unmapped:?}, pending {pending}, page TLBIs {unmap_tlbis}, with a leaf size {unmap_sized} ({} KiB), \
         TTL in the operand 0b{ttl:04b} (level hints {}); the page faults after the flush: {faults})\n",
        if ok { "PASS" } else { "FAIL" },
        // 0: the wrappers disagree.
        base.map_or(0, |b| b.bytes() >> 10),
        leaf >> 10,
        if config.level_hints() { "on" } else { "off" },
    );
    measure_ttl(&p, config.level_hints());
    ok
}

/// CPU 0 caches test page 0 (frame A), the descriptor is moved to frame B
/// with no `TLBI`, then `tlbi` runs (followed by `DSB ISH; ISB`): what
/// CPU 0 reads then. `None` when the page faulted.
fn after(p: &Virt, round: u64, tlbi: impl Fn()) -> (bool, Option<u64>) {
    let (old, new) = (0x7a00_0000 + round, 0x7b00_0000 + round);
    p.fill_frame(0, Frame::A, old);
    p.fill_frame(0, Frame::B, new);
    p.set_pte(0, Some(Frame::A));
    p.publish();
    p.flush_page(0, Flush::AllCpus);
    let cached = p.read_page(0) == Some(old);
    // No break-before-make, on purpose: only this CPU reads the page, and
    // what its TLB keeps is the measurement (as block.rs measures blocks).
    p.set_pte(0, Some(Frame::B));
    p.publish();
    let kept = p.read_page(0) == Some(old);
    tlbi();
    a64::dsb_ish();
    a64::isb();
    let read = p.read_page(0);
    // The real flush, before the next round or scenario.
    p.flush_page(0, Flush::AllCpus);
    (cached && kept && p.read_page(0) == Some(new), read)
}

/// Says which frame a read returned.
fn frame_read(round: u64, read: Option<u64>) -> &'static str {
    match read {
        Some(v) if v == 0x7a00_0000 + round => "A, the entry kept",
        Some(v) if v == 0x7b00_0000 + round => "B, the entry dropped",
        Some(_) => "another value",
        None => "a fault",
    }
}

/// The TTL measurement (see the module documentation), on CPUs with
/// FEAT_TTL; a line saying why not elsewhere.
fn measure_ttl(p: &Virt, hints: bool) {
    if !hints {
        say!(
            "granule64: what the emulator does with a level hint: not measured (no FEAT_TTL: TTL is RES0)\n"
        );
        return;
    }
    let asid = mmu::MmuFeatures::read().test_asid();
    let k64 = PageSize::SIZE_64K;
    let tlbi = |page: usize, ttl: u64| {
        let op = tlbi_va_operand_for(asid, mmu::test_va(page), k64, ttl);
        // SAFETY: EL1, a CPU with FEAT_TTL (the caller checked); the
        // wrong hints are the measurement, and the real flush follows
        // in `after` before anything else uses the page.
        unsafe { a64::tlbi_vae1is_operand(op) };
    };
    let right = ttl_hint(k64, k64);
    let wrong = ttl_hint(k64, PageSize::SIZE_512M);
    let (ok0, none) = after(p, 1, || {});
    let (ok1, wrong_hint) = after(p, 2, || tlbi(0, wrong));
    let (ok2, other_page) = after(p, 3, || tlbi(1, right));
    let (ok3, right_hint) = after(p, 4, || tlbi(0, right));
    say!(
        "granule64: what the emulator does with a level hint (CPU 0 cached test page 0, its descriptor moved from \
         frame A to B with no TLBI, then one TLBI VAE1IS; each round set up and cleaned: {}): no TLBI: {}; the page \
         with a wrong hint (TTL 0b{wrong:04b}, level 2): {}; test page 1 with the right hint (TTL 0b{right:04b}): \
         {}; the page with the right hint: {}\n",
        ok0 && ok1 && ok2 && ok3,
        frame_read(1, none),
        frame_read(2, wrong_hint),
        frame_read(3, other_page),
        frame_read(4, right_hint),
    );
}
