//! The scenarios' view of this machine: the [`Platform`] of the shared
//! scenario set (`qemu-scenarios/`) over this kernel's test pages, their
//! frames, and the crate calls each scenario step makes (the flush under
//! test through the crate's `Aarch64` or one of the negative controls'
//! wrappers in [`tlb`]).

use core::sync::atomic::{AtomicU64, Ordering};

use tlb_batch::arch::aarch64::{self as a64, Aarch64};
use tlb_batch::{
    change_protection, flush_tlb_page, flush_tlb_range, page_referenced, try_to_unmap, Arch, PageRange, Pte,
    PteFlags, SwapResult, TlbFlushUnmapBatch, TtuFlags,
};
use tlb_batch_qemu_scenarios::{BatchNote, Flush, Frame, Ipis, MprotectNote, Platform, ReclaimNote};

use crate::{
    block, block_split, block_teardown, boot, cpu_index, dirty, fatal, generations, mmu, now_us, offline,
    space, teardown, tlb, ONLINE,
};

/// A frame a test page maps: 64 KiB-aligned and 64 KiB long, so that it
/// serves the 64 KiB granule run whole (the 4 KiB run maps its first
/// 4 KiB; the scenarios use the first words only).
#[repr(C, align(65536))]
pub struct Page(pub [AtomicU64; 8192]);

/// Each test page's frames A and B.
static FRAMES_A: [Page; mmu::TEST_PAGES] =
    [const { Page([const { AtomicU64::new(0) }; 8192]) }; mmu::TEST_PAGES];
static FRAMES_B: [Page; mmu::TEST_PAGES] =
    [const { Page([const { AtomicU64::new(0) }; 8192]) }; mmu::TEST_PAGES];
const _: () = assert!(mmu::TEST_PAGES <= tlb_batch_qemu_scenarios::MAX_PAGES);

/// The scenarios' view of this machine.
pub struct Virt;

impl Virt {
    /// Flushes `page` through the crate with the `Arch` that `flush` names.
    fn flush_with(&self, flush: Flush, page: usize) {
        let a = *tlb::arch();
        let va = mmu::test_va(page);
        let done = match flush {
            Flush::AllCpus => flush_tlb_page(&a, tlb::mm(), va),
            Flush::ThisCpuOnly => flush_tlb_page(&tlb::LocalTlbi(a), tlb::mm(), va),
            Flush::Skipped => flush_tlb_page(&tlb::SkipTlbi(a), tlb::mm(), va),
        };
        if done.is_err() {
            fatal("flush_tlb_page refused a test page");
        }
    }

    /// Unmaps the frames A of pages `0..pages` with `try_to_unmap` into one
    /// batch and flushes it once, with `a` as the `Arch`.
    fn unmap_with<A: Arch>(&self, a: &A, pages: usize) -> BatchNote {
        let before = tlb::TLB.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        let mut note = BatchNote::default();
        // Every test descriptor is written with its access flag set, so
        // without IGNORE_ACCESS the walk would only clear the flag and
        // answer Fail: aging is what the reclaim flow tests, not these.
        let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
        for frame in FRAMES_A.iter().take(pages) {
            let frame = tlb_batch::Frame(frame.0.as_ptr() as u64 >> 12);
            // The pages are writable, hence reported dirty: each unmap
            // leaves a possibly writable TLB entry for the batch's flush.
            match try_to_unmap(a, &space::TestRmap, frame, flags, &mut batch) {
                Ok(SwapResult::SuccessCached) => note.unmapped += 1,
                Ok(_) => {}
                Err(_) => fatal("try_to_unmap refused a test frame"),
            }
        }
        note.pending = batch.pending_pages() as u32;
        note.full_flush = batch.is_full_flush();
        if batch.flush(a).is_err() {
            fatal("the batch's flush failed");
        }
        let d = tlb::TLB.stats().since(&before);
        note.shootdowns = d.shootdowns;
        note.page_invalidations = d.local_page_flushes;
        note.full_invalidations = d.local_full_flushes;
        note
    }

    /// The first aging pass of the reclaim flow, with `a` as the `Arch`.
    fn age_with<A: Arch>(&self, a: &A, pages: usize) -> (u64, u64) {
        let before = tlb::TLB.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        let mut young = 0;
        for (i, frame) in FRAMES_A.iter().enumerate().take(pages) {
            let frame = tlb_batch::Frame(frame.0.as_ptr() as u64 >> 12);
            match page_referenced(a, &space::TestRmap, frame, &mut batch) {
                Ok(r) if r.referenced > 0 => young |= 1 << i,
                Ok(_) => {}
                Err(_) => fatal("page_referenced refused a test frame"),
            }
        }
        // Clearing an access flag leaves TLB entries that would keep it
        // clear while the page is used: the crate recorded a flush for each.
        if batch.flush(a).is_err() {
            fatal("the aging batch's flush failed");
        }
        (young, tlb::TLB.stats().since(&before).shootdowns)
    }

    /// The reclaim pass of the reclaim flow, with `a` as the `Arch`.
    fn reclaim_with<A: Arch>(&self, a: &A, pages: usize) -> ReclaimNote {
        let before = tlb::TLB.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        let mut note = ReclaimNote::default();
        for (i, frame) in FRAMES_A.iter().enumerate().take(pages) {
            let frame = tlb_batch::Frame(frame.0.as_ptr() as u64 >> 12);
            match page_referenced(a, &space::TestRmap, frame, &mut batch) {
                Ok(r) if r.referenced > 0 => {
                    note.young |= 1 << i;
                    continue;
                }
                Ok(_) => {}
                Err(_) => fatal("page_referenced refused a test frame"),
            }
            // Old: unmap it, the flush deferred to the batch. The access
            // flag is clear, so no IGNORE_ACCESS is needed.
            match try_to_unmap(a, &space::TestRmap, frame, TtuFlags::BATCH_FLUSH, &mut batch) {
                Ok(SwapResult::SuccessCached) => note.unmapped |= 1 << i,
                Ok(_) => {}
                Err(_) => fatal("try_to_unmap refused a test frame"),
            }
        }
        // Writable entries were unmapped: no CPU may write the frames
        // through a cached entry once their write-out starts.
        if batch.flush_dirty(a).is_err() {
            fatal("the reclaim batch's dirty flush failed");
        }
        let flushed = tlb::TLB.stats().since(&before).shootdowns > 0;
        for (i, frame) in FRAMES_A.iter().enumerate().take(pages) {
            if note.unmapped & 1 << i != 0 {
                // The write-out: a copy of the frame's first word.
                WRITTEN_OUT[i].store(frame.0[0].load(Ordering::Acquire), Ordering::Relaxed);
                if !flushed {
                    note.written_early += 1;
                }
            }
        }
        if batch.flush(a).is_err() {
            fatal("the reclaim batch's flush failed");
        }
        note.shootdowns = tlb::TLB.stats().since(&before).shootdowns;
        note
    }
}

impl Virt {
    /// The mprotect scenario's change, with `a` as the `Arch`.
    fn mprotect_with<A: Arch>(&self, a: &A, unmapped: usize, pages: usize) -> MprotectNote {
        let mut batch = TlbFlushUnmapBatch::new();
        let mut note = MprotectNote::default();
        for frame in FRAMES_A.iter().take(unmapped) {
            let frame = tlb_batch::Frame(frame.0.as_ptr() as u64 >> 12);
            let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
            match try_to_unmap(a, &space::TestRmap, frame, flags, &mut batch) {
                Ok(SwapResult::SuccessCached) => note.unmapped += 1,
                Ok(_) => {}
                Err(_) => fatal("try_to_unmap refused a test frame"),
            }
        }
        // The reclaimer's batch is left pending across the mprotect.
        note.pending_before = tlb::mm().batched_flush_pending();
        let Ok(range) = PageRange::new(mmu::test_va(0), pages as u64 * mmu::page_units()) else {
            fatal("the mprotect range is not a page range");
        };
        let read_only = |pte: Pte| Pte(pte.0 & !PteFlags::WRITABLE.bits());
        match change_protection(a, &space::TestSpace, range, read_only) {
            Ok(n) => note.changed = n as u32,
            Err(_) => fatal("change_protection failed"),
        }
        note.pending_after = tlb::mm().batched_flush_pending();
        if batch.flush(a).is_err() {
            fatal("the reclaimer's batch flush failed");
        }
        note
    }
}

/// The reclaim flow's "swap": the first word of each page written out.
static WRITTEN_OUT: [AtomicU64; mmu::TEST_PAGES] = [const { AtomicU64::new(0) }; mmu::TEST_PAGES];

impl Platform for Virt {
    fn cpu_count(&self) -> usize {
        ONLINE.load(Ordering::Acquire)
    }
    fn this_cpu(&self) -> usize {
        cpu_index()
    }
    fn fill_frame(&self, page: usize, frame: Frame, value: u64) {
        frame_of(page, frame).0[0].store(value, Ordering::Release);
    }
    fn set_pte(&self, page: usize, frame: Option<Frame>) {
        let entry = frame.map_or(0, |f| frame_of(page, f).0.as_ptr() as u64 | mmu::TEST_PAGE_FLAGS);
        mmu::test_pte(page).store(entry, Ordering::Release);
    }
    fn publish(&self) {
        // The entries' stores reach every CPU's table walks, and this CPU's
        // next instructions see them.
        a64::dsb_ishst();
        a64::isb();
    }
    fn flush_pages(&self, pages: usize) {
        let range = PageRange::new(mmu::test_va(0), pages as u64 * mmu::page_units());
        if !range.is_ok_and(|r| flush_tlb_range(tlb::arch(), tlb::mm(), r).is_ok()) {
            fatal("flush_tlb_range refused the test pages");
        }
    }
    fn flush_page(&self, page: usize, flush: Flush) {
        self.flush_with(flush, page);
    }
    fn unmap_batched(&self, pages: usize, flush: Flush) -> BatchNote {
        let a = *tlb::arch();
        match flush {
            Flush::AllCpus => self.unmap_with(&a, pages),
            Flush::ThisCpuOnly => self.unmap_with(&tlb::LocalTlbi(a), pages),
            Flush::Skipped => self.unmap_with(&tlb::SkipTlbi(a), pages),
        }
    }
    fn hw_access_flag(&self) -> bool {
        mmu::MmuFeatures::read().hw_access_flag
    }
    fn no_access_flag_why(&self) -> &'static str {
        "no hardware access flag (ID_AA64MMFR1_EL1.HAFDBS = 0)"
    }
    fn age_pages(&self, pages: usize, flush: Flush) -> (u64, u64) {
        let a = *tlb::arch();
        match flush {
            Flush::AllCpus => self.age_with(&a, pages),
            Flush::ThisCpuOnly => self.age_with(&tlb::LocalTlbi(a), pages),
            Flush::Skipped => self.age_with(&tlb::SkipTlbi(a), pages),
        }
    }
    fn reclaim_pages(&self, pages: usize, flush: Flush) -> ReclaimNote {
        let a = *tlb::arch();
        match flush {
            Flush::AllCpus => self.reclaim_with(&a, pages),
            Flush::ThisCpuOnly => self.reclaim_with(&tlb::LocalTlbi(a), pages),
            Flush::Skipped => self.reclaim_with(&tlb::SkipTlbi(a), pages),
        }
    }
    fn mprotect_pending(&self, unmapped: usize, pages: usize, flush: Flush) -> MprotectNote {
        let a = *tlb::arch();
        match flush {
            Flush::AllCpus => self.mprotect_with(&a, unmapped, pages),
            Flush::ThisCpuOnly => self.mprotect_with(&tlb::LocalTlbi(a), unmapped, pages),
            Flush::Skipped => self.mprotect_with(&tlb::SkipTlbi(a), unmapped, pages),
        }
    }
    fn write_page(&self, page: usize, value: u64) -> bool {
        boot::probe_store_word(mmu::test_va(page) + 8, value)
    }
    fn invalidates_on_add(&self) -> bool {
        <Aarch64 as Arch>::BATCH_BROADCAST_ON_ADD
    }
    fn full_flush_ceiling(&self) -> usize {
        <Aarch64 as Arch>::FULL_FLUSH_CEILING
    }
    fn read_page(&self, page: usize) -> Option<u64> {
        boot::probe(mmu::test_va(page))
    }
    fn broadcast_shootdowns(&self) -> bool {
        // The crate's aarch64 `Arch` shoots down with `TLBI ... IS`.
        <Aarch64 as Arch>::BROADCAST_INVALIDATE
    }
    fn ipis(&self) -> Ipis {
        let (sent, hook_calls) = tlb::ipis();
        Ipis {
            sent,
            seen: hook_calls,
            shootdowns: tlb::TLB.stats().shootdowns,
        }
    }
    fn poll(&self) {
        tlb::poll();
        teardown::serve();
        dirty::serve();
        generations::serve();
        offline::serve();
        block::serve();
        block_split::serve();
        block_teardown::serve();
    }
    fn now_us(&self) -> u64 {
        now_us()
    }
}

pub fn frame_of(page: usize, frame: Frame) -> &'static Page {
    match frame {
        Frame::A => &FRAMES_A[page],
        Frame::B => &FRAMES_B[page],
    }
}

/// The test page whose frame A is `frame`, if any.
pub fn page_of_frame_a(frame: tlb_batch::Frame) -> Option<usize> {
    FRAMES_A.iter().position(|p| p.0.as_ptr() as u64 == frame.addr())
}
