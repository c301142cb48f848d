//! The crate on machines whose base page is an arm64 granule's 16 or 64
//! KiB (`MockConfig::base_page`), and 4 KiB for comparison: the machine's
//! tables map pages of that size, its TLB entries are that large, and
//! with `MockConfig::level_hints` a page invalidation that carries a
//! FEAT_TTL-like hint removes only entries of exactly the hinted size. So
//! a flush at the wrong stride, or with a wrong hint, leaves entries the
//! oracle catches, and input not aligned to the base page must be refused
//! before anything changes.

mod common;

use std::ops::ControlFlow;
use std::sync::Arc;

use tlb_batch::arch::mock::{Arm64Like, MockConfig, MockKernel, MockMachine, MockRmap, Model, X86Like};
use tlb_batch::{
    change_protection, flush_tlb_page, flush_tlb_range, Arch, Error, Frame, Mapping, MappingFlags,
    MmTlbState, MmuGather, PageRange, PageSize, PageTable, Pte, PteFlags, Rmap, TableFreePolicy,
    TlbFlushUnmapBatch, TtuFlags, PAGE_SIZE,
};

const BASE: u64 = 0x4000_0000;
const GRANULES: [PageSize; 3] = [PageSize::SIZE_4K, PageSize::SIZE_16K, PageSize::SIZE_64K];

fn machine<M: Model>(cpus: usize, base: PageSize) -> MockMachine<M> {
    MockMachine::with_model(MockConfig {
        frames: 2048,
        tlb_entries: 64,
        tagged_tlb: true,
        base_page: base,
        level_hints: true,
        ..MockConfig::x86_like(cpus)
    })
    .unwrap()
}

/// Page `i` of `base` bytes.
fn page(base: PageSize, i: usize) -> u64 {
    BASE + i as u64 * base.bytes()
}

/// `pages` pages of `base` mapped writable in one space through a
/// `MockRmap`, written by every CPU of `cpus` at an address inside each
/// page other than its first (a 4 KiB unit of it), so that every CPU
/// caches each page's one entry.
fn mapped<'m, M: Model>(
    m: &'m MockMachine<M>,
    base: PageSize,
    pages: usize,
    cpus: &[usize],
) -> (MockRmap<'m, M>, Vec<Frame>) {
    let rmap = MockRmap::new(m, vec![m.space(&m.new_mm(common::asid(1)).unwrap())]);
    let frames: Vec<Frame> = (0..pages)
        .map(|i| {
            let f = m.alloc_huge_frame(base).unwrap();
            rmap.map(f, 0, page(base, i), true, MappingFlags::empty())
                .unwrap();
            f
        })
        .collect();
    let inside = base.bytes() - PAGE_SIZE;
    for &c in cpus {
        let cpu = m.cpu(c).unwrap();
        cpu.switch_to(rmap.spaces()[0].mm()).unwrap();
        for i in 0..pages {
            cpu.write(page(base, i) + inside, c as u64).unwrap();
        }
    }
    (rmap, frames)
}

/// Frees every 4 KiB frame of each page's run.
fn free_runs<M: Model>(m: &MockMachine<M>, base: PageSize, frames: &[Frame]) {
    for f in frames {
        for i in 0..base.base_pages() {
            m.free_frame(Frame(f.0 + i)).unwrap();
        }
    }
}

#[test]
fn a_batched_unmap_is_one_hinted_invalidation_per_page_under_every_granule() {
    for base in GRANULES {
        let m = machine::<Arm64Like>(3, base);
        let (rmap, frames) = mapped(&m, base, 4, &[0, 1, 2]);
        let cpu0 = m.cpu(0).unwrap();
        assert_eq!(cpu0.base_page(), base);
        let before = m.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        for &f in &frames {
            let r = tlb_batch::try_to_unmap(
                &cpu0,
                &rmap,
                f,
                TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS,
                &mut batch,
            )
            .unwrap();
            assert!(matches!(r, tlb_batch::SwapResult::SuccessCached), "{base}: {r:?}");
        }
        batch.flush(&cpu0).unwrap();
        let d = m.stats().since(&before);
        // One invalidation per page, issued as it was added, whatever its
        // size: never one per 4 KiB unit.
        assert_eq!(d.local_page_flushes, 4, "{base}");
        assert_eq!(m.stale_entries(), [], "{base}");
        free_runs(&m, base, &frames);
        assert_eq!(m.violations(), [], "{base}");
    }
}

#[test]
fn range_flushes_count_and_invalidate_base_pages() {
    for base in GRANULES {
        let m = machine::<X86Like>(2, base);
        let (rmap, frames) = mapped(&m, base, 3, &[0, 1]);
        let mm = rmap.spaces()[0].mm().clone();
        for i in 0..3 {
            m.clear_pte(&mm, page(base, i)).unwrap();
        }
        let cpu0 = m.cpu(0).unwrap();
        let before = m.stats();
        let range = PageRange::new(page(base, 0), 3 * base.base_pages()).unwrap();
        let report = flush_tlb_range(&cpu0, &mm, range).unwrap();
        assert_eq!(report.remote_cpus, 1);
        let d = m.stats().since(&before);
        // Three invalidations on each of the two CPUs, not 3 x 16 at 64
        // KiB (past the ceiling, that would have been a full flush).
        assert_eq!((d.local_page_flushes, d.local_full_flushes), (6, 0), "{base}");
        assert_eq!(m.stale_entries(), [], "{base}");
        free_runs(&m, base, &frames);
        assert_eq!(m.violations(), [], "{base}");
    }
}

#[test]
fn input_not_aligned_to_the_base_page_is_refused_before_anything_changes() {
    let base = PageSize::SIZE_64K;
    let m = machine::<Arm64Like>(2, base);
    let (rmap, frames) = mapped(&m, base, 2, &[0, 1]);
    let space = &rmap.spaces()[0];
    let mm = space.mm().clone();
    let cpu0 = m.cpu(0).unwrap();
    let before = m.stats();
    let inside = page(base, 0) + PAGE_SIZE;
    assert_eq!(
        flush_tlb_page(&cpu0, &mm, inside).unwrap_err(),
        Error::Unaligned { addr: inside }
    );
    // A range that starts on a page but is not whole pages of it.
    let short = PageRange::new(page(base, 0), 4).unwrap();
    let stride = Error::StrideUnaligned {
        start: page(base, 0),
        pages: 4,
        stride: base.bytes(),
    };
    assert_eq!(flush_tlb_range(&cpu0, &mm, short).unwrap_err(), stride);
    assert_eq!(
        change_protection(&cpu0, space, short, |p| Pte(p.0 & !PteFlags::WRITABLE.bits())).unwrap_err(),
        stride
    );
    let mut kernel = MockKernel::new(&rmap);
    let mut gather = MmuGather::<8>::new();
    let torn = gather.unmap_range(
        &cpu0,
        space,
        &mut kernel,
        PageRange::new(inside, 16).unwrap(),
        false,
        &mut TableFreePolicy::AfterFlush,
        &mut |_, _| panic!("nothing taken"),
    );
    assert_eq!(torn.unwrap_err(), Error::Unaligned { addr: inside });
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        batch.add_pending(&cpu0, &mm, inside, Pte::EMPTY).unwrap_err(),
        Error::Unaligned { addr: inside }
    );
    assert!(batch.is_empty());
    // Nothing was flushed, nothing unmapped.
    let d = m.stats().since(&before);
    assert_eq!(
        (d.shootdowns, d.local_page_flushes, d.local_full_flushes),
        (0, 0, 0)
    );
    assert!(m.pte(&mm, page(base, 0)).unwrap().is_writable());
    assert_eq!(m.all_entries().len(), 4);
    // The machine refuses an unaligned mapping, and a 4 KiB-aligned frame.
    assert!(m.map(&mm, inside, frames[0], true).is_err());
    assert!(m.map(&mm, page(base, 5), Frame(frames[0].0 + 1), true).is_err());
    let mut batch = TlbFlushUnmapBatch::new();
    for &f in &frames {
        let _ = tlb_batch::try_to_unmap(
            &cpu0,
            &rmap,
            f,
            TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS,
            &mut batch,
        )
        .unwrap();
    }
    batch.flush(&cpu0).unwrap();
    free_runs(&m, base, &frames);
    assert_eq!(m.violations(), []);
}

/// A kernel's table for a 64 KiB machine that forgot to say so: it answers
/// the default 4 KiB from `entry_size`.
struct Says4K<'a, 'm>(&'a tlb_batch::arch::mock::MockSpace<'m, Arm64Like>);

// SAFETY: every call goes to the machine's space, which keeps the
// contract; only `entry_size` is left at the default, which is what the
// test shows the crate refuses.
unsafe impl PageTable for Says4K<'_, '_> {
    fn tlb_state(&self) -> &MmTlbState {
        self.0.tlb_state()
    }
    fn lookup(&self, va: u64) -> Pte {
        self.0.lookup(va)
    }
    fn exchange(&self, va: u64, new: Pte) -> Pte {
        self.0.exchange(va, new)
    }
    fn test_and_clear_accessed(&self, va: u64) -> bool {
        self.0.test_and_clear_accessed(va)
    }
    fn set(&self, va: u64, pte: Pte) {
        self.0.set(va, pte)
    }
}

/// `MockRmap`'s mappings, through [`Says4K`].
struct Says4KRmap<'a, 'm>(Says4K<'a, 'm>, &'a MockRmap<'m, Arm64Like>);

// SAFETY: forwards the walk of a map that keeps the contract, each mapping
// in the same space (seen through `Says4K`) at the same address.
unsafe impl<'a, 'm> Rmap for Says4KRmap<'a, 'm> {
    type Space = Says4K<'a, 'm>;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        self.1.walk(frame, &mut |mapping| {
            visit(Mapping {
                space: &self.0,
                va: mapping.va,
                flags: mapping.flags,
            })
        })
    }

    fn set_dirty(&self, frame: Frame) {
        self.1.set_dirty(frame)
    }
}

#[test]
fn an_entry_smaller_than_the_base_page_is_refused() {
    let base = PageSize::SIZE_64K;
    let m = machine::<Arm64Like>(2, base);
    let (rmap, frames) = mapped(&m, base, 1, &[0, 1]);
    let cpu0 = m.cpu(0).unwrap();
    let table = Says4K(&rmap.spaces()[0]);
    let range = PageRange::new(page(base, 0), base.base_pages()).unwrap();
    let refused = Error::BelowBasePage {
        va: page(base, 0),
        size: 4096,
        base: base.bytes(),
    };
    assert_eq!(
        change_protection(&cpu0, &table, range, |p| Pte(p.0 & !PteFlags::WRITABLE.bits())).unwrap_err(),
        refused
    );
    assert!(m.pte(table.tlb_state(), page(base, 0)).unwrap().is_writable());
    assert_eq!(m.stats().shootdowns, 0);
    // The reverse map's walk too, before the entry changes.
    let says4k = Says4KRmap(Says4K(&rmap.spaces()[0]), &rmap);
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        tlb_batch::try_to_unmap(&cpu0, &says4k, frames[0], TtuFlags::BATCH_FLUSH, &mut batch),
        Err(refused)
    );
    assert!(batch.is_empty());
    assert!(m.pte(table.tlb_state(), page(base, 0)).unwrap().is_present());
    let _ = Arc::clone(rmap.spaces()[0].mm());
    let mut batch = TlbFlushUnmapBatch::new();
    let _ = tlb_batch::try_to_unmap(
        &cpu0,
        &rmap,
        frames[0],
        TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS,
        &mut batch,
    )
    .unwrap();
    batch.flush(&cpu0).unwrap();
    free_runs(&m, base, &frames);
    assert_eq!(m.violations(), []);
}

#[test]
fn mprotect_and_teardown_take_each_page_whole_under_every_granule() {
    for base in GRANULES {
        let m = machine::<Arm64Like>(3, base);
        let (rmap, frames) = mapped(&m, base, 4, &[0, 1, 2]);
        let space = &rmap.spaces()[0];
        let mm = space.mm().clone();
        let cpu0 = m.cpu(0).unwrap();
        let all = PageRange::new(page(base, 0), 4 * base.base_pages()).unwrap();
        let before = m.stats();
        let changed =
            change_protection(&cpu0, space, all, |p| Pte(p.0 & !PteFlags::WRITABLE.bits())).unwrap();
        assert_eq!(changed, 4, "{base}: one entry per page");
        assert_eq!(m.stats().since(&before).local_page_flushes, 4, "{base}");
        assert_eq!(m.check_coherent(&mm, all), 0, "{base}");
        let cpu2 = m.cpu(2).unwrap();
        assert!(
            cpu2.write(page(base, 1) + PAGE_SIZE, 9).is_err(),
            "{base}: read-only now"
        );

        // The whole leaf table's span (granule / 8 pages of the granule),
        // with its table freed after the flush and an IPI sync.
        let span = (base.bytes() / 8) * base.base_pages();
        let table = m.leaf_table(&mm, page(base, 0)).unwrap();
        assert_eq!(
            m.leaf_table(&mm, page(base, 3)),
            Some(table),
            "{base}: one leaf table"
        );
        let mut kernel = MockKernel::new(&rmap);
        let mut gather = MmuGather::<8>::new();
        let s = gather
            .unmap_range(
                &cpu0,
                space,
                &mut kernel,
                PageRange::new(BASE, span).unwrap(),
                true,
                &mut TableFreePolicy::IpiSync,
                &mut |_, _| panic!("nothing refused"),
            )
            .unwrap();
        assert_eq!((s.pages_unmapped, s.tables_freed), (4, 1), "{base}");
        assert_eq!(m.leaf_table(&mm, page(base, 0)), None);
        // The kernel freed each page's whole run of frames.
        for f in &frames {
            for i in 0..base.base_pages() {
                assert_eq!(
                    m.frame_state(Frame(f.0 + i)).unwrap(),
                    tlb_batch::arch::mock::FrameState::Free,
                    "{base}"
                );
            }
        }
        assert_eq!(m.stale_entries(), [], "{base}");
        assert_eq!(m.violations(), [], "{base}");
    }
}

#[test]
fn the_machine_takes_only_arm64_granules() {
    for shift in [13, 15, 21] {
        let config = MockConfig {
            base_page: PageSize::from_shift(shift).unwrap(),
            ..MockConfig::x86_like(1)
        };
        assert!(MockMachine::new(config).is_err(), "{shift}");
    }
}

/// A page whose leaf entry the crate read from the page table is
/// invalidated with the level hint (its size), which on a FEAT_TTL-like
/// machine removes that leaf entry and no walk-cache entry: the CPUs keep
/// their pointers to the leaf table that still maps the other pages. Both
/// through change_protection's shootdown and through a batched unmap
/// (whose broadcast goes as the page is added).
#[test]
fn known_leaf_sizes_are_hinted_and_keep_the_walk_caches() {
    // Through broadcasts (arm64) and through IPIs, whose handler rebuilds
    // the request from the slot (x86-like).
    hinted_keeps_the_walk_caches::<Arm64Like>();
    hinted_keeps_the_walk_caches::<X86Like>();
}

fn hinted_keeps_the_walk_caches<M: Model>() {
    for base in GRANULES {
        let m = machine::<M>(2, base);
        let (rmap, frames) = mapped(&m, base, 2, &[0, 1]);
        let space = &rmap.spaces()[0];
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        let walks = cpu1.walk_cache();
        assert!(!walks.is_empty(), "{base}: CPU 1 walked to its pages");
        let kept = |what: &str| {
            let now = cpu1.walk_cache();
            assert!(
                walks.iter().all(|w| now.contains(w)),
                "{base}: {what}: {walks:?} -> {now:?}"
            );
        };

        let second = PageRange::new(page(base, 1), base.base_pages()).unwrap();
        let changed =
            change_protection(&cpu0, space, second, |p| Pte(p.0 & !PteFlags::WRITABLE.bits())).unwrap();
        assert_eq!(changed, 1, "{base}");
        kept("change_protection");
        assert!(cpu1.write(page(base, 1), 9).is_err(), "{base}: read-only now");

        let mut batch = TlbFlushUnmapBatch::new();
        let r = tlb_batch::try_to_unmap(
            &cpu0,
            &rmap,
            frames[0],
            TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS,
            &mut batch,
        )
        .unwrap();
        assert!(matches!(r, tlb_batch::SwapResult::SuccessCached), "{base}: {r:?}");
        batch.flush(&cpu0).unwrap();
        kept("a batched unmap");
        assert_eq!(m.stale_entries(), [], "{base}");
        free_runs(&m, base, &frames[..1]);
        assert_eq!(m.violations(), [], "{base}");
    }
}
