//! What batching costs when it defers nothing: issue #13 asks that the
//! path where no flush is deferred (only the running CPU caches the
//! address space, or the hardware does not re-walk on a clean write) cost
//! at most 1.05x the instructions of a direct flush.
//!
//! Every mode unmaps the same pages of one address space on one CPU,
//! through the same reverse map and page table, with an `Arch` whose
//! flushes only count (so that the crate's own instructions are what is
//! measured):
//!
//! - `unmap-now`: the crate's `try_to_unmap` without `BATCH_FLUSH`: every
//!   page flushed at once, the direct flush the goal compares against;
//! - `unmap`: the same with `TtuFlags::BATCH_FLUSH` into a
//!   `TlbFlushUnmapBatch`, then the batch's `flush` (a flush point per
//!   page, the worst case); it defers nothing, since no other CPU caches
//!   the space;
//! - `unmap-norewalk`: the same on hardware without the clean-write
//!   re-walk, where the crate never defers;
//! - `direct`: what a kernel without the crate's checks writes: walk the
//!   reverse map, clear each PTE, move its dirty bit, `flush_tlb_page`
//!   (what `try_to_unmap`'s validation and `SwapResult` cost on top).
//!
//! `scripts/bench-nodefer.sh` runs each under callgrind, counting only
//! inside the measured loop, and prints instructions per page and the
//! ratios. `cargo run --release --example nodefer -- --mode M --pages N`
//! runs one of them.

use std::hint::black_box;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};

use tlb_batch::rmap::Mapping;
use tlb_batch::{
    flush_tlb_page, switch_mm, try_to_unmap, Arch, Asid, CpuId, CpuSet, Frame, MmTlbState, PageTable, Pte,
    PteFlags, Rmap, TlbFlushUnmapBatch, TlbShootdown, TtuFlags, PAGE_SIZE,
};

const BASE: u64 = 0x4000_0000;

static TLB: TlbShootdown = TlbShootdown::new();
static LOCAL_FLUSHES: AtomicU64 = AtomicU64::new(0);

/// One CPU whose flushes only count; `REWALK` is its
/// `CLEAN_WRITE_REWALK`.
struct Hw<const REWALK: bool>;

// SAFETY: one CPU, always CPU 0, with nothing else running; its TLB is
// imaginary, so counting a flush is carrying it out; it never sends an IPI
// (it has no other CPU); an imaginary TLB caches nothing, so its fills set
// every accessed bit they need to.
unsafe impl<const REWALK: bool> Arch for Hw<REWALK> {
    const CLEAN_WRITE_REWALK: bool = REWALK;
    const ACCESSED_CLEAR_NEEDS_FLUSH: bool = false;
    // As x86: the unmap path then looks at aging epochs where it defers.
    const FILL_SETS_ACCESSED: bool = true;

    fn current_cpu(&self) -> Result<CpuId, tlb_batch::Error> {
        CpuId::new(0)
    }
    fn online_cpus(&self) -> CpuSet {
        CpuId::new(0).map_or(CpuSet::new(), CpuSet::single)
    }
    fn shootdown_state(&self) -> &TlbShootdown {
        &TLB
    }
    fn flush_local_page(&self, _asid: Asid, va: u64) {
        black_box(va);
        LOCAL_FLUSHES.fetch_add(1, Ordering::Relaxed);
    }
    fn flush_local_asid(&self, _asid: Asid) {
        LOCAL_FLUSHES.fetch_add(1, Ordering::Relaxed);
    }
    fn flush_local_all(&self, _include_global: bool) {
        LOCAL_FLUSHES.fetch_add(1, Ordering::Relaxed);
    }
    fn send_flush_ipi(&self, _targets: &CpuSet) {
        unreachable!("one CPU sends no IPI");
    }
    unsafe fn switch_address_space(&self, _asid: Asid, _root: u64) {}
}

/// A flat page table: one atomic entry per page from `BASE`.
struct Space {
    mm: MmTlbState,
    ptes: Vec<AtomicU64>,
}

impl Space {
    fn index(&self, va: u64) -> usize {
        ((va - BASE) / PAGE_SIZE) as usize
    }
}

// SAFETY: every entry is one atomic word, exchanged and cleared with
// single atomic operations; lookup reads it as it is; `mm` is this
// table's address space.
unsafe impl PageTable for Space {
    fn tlb_state(&self) -> &MmTlbState {
        &self.mm
    }
    fn lookup(&self, va: u64) -> Pte {
        Pte(self.ptes[self.index(va)].load(Ordering::SeqCst))
    }
    fn exchange(&self, va: u64, new: Pte) -> Pte {
        Pte(self.ptes[self.index(va)].swap(new.0, Ordering::SeqCst))
    }
    fn test_and_clear_accessed(&self, va: u64) -> bool {
        let bit = PteFlags::ACCESSED.bits();
        self.ptes[self.index(va)].fetch_and(!bit, Ordering::SeqCst) & bit != 0
    }
    fn set(&self, va: u64, pte: Pte) {
        self.ptes[self.index(va)].store(pte.0, Ordering::SeqCst);
    }
}

/// Frame `f` is mapped once, at `BASE + f * PAGE_SIZE`.
struct OneMapping<'s>(&'s Space);

// SAFETY: every frame has exactly the one mapping `walk` reports.
unsafe impl Rmap for OneMapping<'_> {
    type Space = Space;
    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        visit(Mapping {
            space: self.0,
            va: BASE + frame.0 * PAGE_SIZE,
            flags: Default::default(),
        })
    }
    fn set_dirty(&self, frame: Frame) {
        black_box(frame);
    }
}

fn map_all(space: &Space) {
    let flags = PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::ACCESSED | PteFlags::DIRTY;
    for (i, pte) in space.ptes.iter().enumerate() {
        pte.store(Pte::new(Frame(i as u64), flags).0, Ordering::SeqCst);
    }
}

/// The direct way, for every page: the kernel's own reverse-map walk, an
/// atomic clear, the dirty bit moved, one immediate flush.
#[inline(never)]
fn measured_direct<A: Arch>(hw: &A, rmap: &OneMapping<'_>, pages: u64) {
    for f in 0..pages {
        let frame = Frame(f);
        let _ = rmap.walk(frame, &mut |m| {
            let old = m.space.clear(m.va);
            if old.is_dirty() {
                rmap.set_dirty(frame);
            }
            flush_tlb_page(hw, m.space.tlb_state(), m.va).expect("a valid page");
            ControlFlow::Continue(())
        });
    }
}

/// The crate's way, for every page: `try_to_unmap` with `BATCH_FLUSH`,
/// then the flush point.
#[inline(never)]
fn measured_unmap<A: Arch>(hw: &A, rmap: &OneMapping<'_>, pages: u64, flags: TtuFlags) {
    let mut batch = TlbFlushUnmapBatch::new();
    for f in 0..pages {
        let r = try_to_unmap(hw, rmap, Frame(f), flags | TtuFlags::IGNORE_ACCESS, &mut batch);
        assert!(r.expect("a valid page").is_unmapped());
        batch.flush(hw).expect("not nested");
    }
}

fn main() {
    let mut mode = "unmap".to_string();
    let mut pages = 100_000u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--mode" => mode = args.next().expect("--mode M"),
            "--pages" => pages = args.next().and_then(|v| v.parse().ok()).expect("--pages N"),
            other => panic!("unknown argument {other}"),
        }
    }
    let space = Space {
        mm: MmTlbState::new(Asid::new(1).expect("ASID 1"), 0),
        ptes: (0..pages).map(|_| AtomicU64::new(0)).collect(),
    };
    map_all(&space);
    let rmap = OneMapping(&space);
    // SAFETY: the imaginary root is never dereferenced.
    unsafe { switch_mm(&Hw::<true>, None, &space.mm) }.expect("ASID 1 fits");
    match mode.as_str() {
        "direct" => measured_direct(&Hw::<true>, &rmap, pages),
        "unmap-now" => measured_unmap(&Hw::<true>, &rmap, pages, TtuFlags::empty()),
        "unmap" => measured_unmap(&Hw::<true>, &rmap, pages, TtuFlags::BATCH_FLUSH),
        "unmap-norewalk" => measured_unmap(&Hw::<false>, &rmap, pages, TtuFlags::BATCH_FLUSH),
        other => panic!("unknown mode {other}"),
    }
    let stats = TLB.stats();
    assert_eq!(stats.pages_deferred, 0, "nothing may be deferred on one CPU");
    assert_eq!(
        LOCAL_FLUSHES.load(Ordering::Relaxed),
        pages,
        "one local flush per page"
    );
    assert!(space.ptes.iter().all(|p| p.load(Ordering::SeqCst) == 0));
    println!(
        "{mode}: {pages} pages unmapped, {} local flushes, 0 deferred",
        pages
    );
}
