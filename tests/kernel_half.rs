//! The upper half of the address space is the kernel's, and every address
//! space shares it (x86-64 kernels point the upper level-4 entries of
//! every process at the same tables; AArch64 translates it through
//! TTBR1_EL1 whatever process runs). A kernel page unmapped or changed
//! through a user space's state would be flushed only on the CPUs running
//! that space, under its ASID, and stay cached on the CPUs running the
//! others. Every entry point refuses an upper-half address of a user space
//! (`Error::KernelHalf`) with nothing changed; the kernel's space takes the
//! same page and its flush reaches every CPU.

#![cfg(all(feature = "x86_64-mapper", feature = "mock"))]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::asid;
use common::x86_tables::{map, Dealloc, HostMmu, OneMapping, Pages, Tables};
use tlb_batch::arch::mock::{MockConfig, MockError, MockKernel, MockMachine, MockRmap};
use tlb_batch::mapper::{DeallocatorFrees, OffsetSpace};
use tlb_batch::{
    change_protection, check_space_range, check_space_va, flush_tlb_page, flush_tlb_range, BoundedRmap,
    Error, Frame, MappingFlags, MmTlbState, MmuGather, PageGather, PageRange, PageTable, Pte, PteFlags,
    TableFreePolicy, TlbFlushUnmapBatch, PAGE_SIZE,
};
use x86_64::structures::paging::{PageTableFlags as F, Size4KiB};

/// A kernel page: the first page of the upper half's first 4 MiB.
const KVA: u64 = 0xffff_8000_0040_0000;

/// The level-4 index of the upper half's first entry.
const FIRST_KERNEL_SLOT: u64 = 256;

/// Two processes whose tables share the kernel half, as a kernel builds
/// them: `b`'s tables map a supervisor page at [`KVA`] (global or not),
/// and `a`'s level-4 entry 256 names the same level-3 table. CPU 1 runs
/// `a` and has written the page; CPU 0 runs `b`.
struct Shared {
    a: Tables,
    b: Tables,
    mm_b: Arc<MmTlbState>,
    frame: Frame,
}

fn shared(global: bool) -> (MockMachine, Shared) {
    let (a, mut b) = (Tables::new(), Tables::new());
    let machine = MockMachine::new(MockConfig::x86_like(2)).unwrap();
    let mm_a = machine.new_mm_at(asid(1), a.root_addr()).unwrap();
    let mm_b = machine.new_mm_at(asid(2), b.root_addr()).unwrap();
    let frame = machine.alloc_frame().unwrap();
    let mut flags = F::PRESENT | F::WRITABLE;
    if global {
        flags |= F::GLOBAL;
    }
    let (mut mapper, mut pool) = b.mapper();
    map::<Size4KiB>(&mut mapper, &mut pool, KVA, frame.addr(), flags);
    let slot = |root: u64| {
        // SAFETY: `root` is a leaked host page table (offset 0) and the
        // slot is below 512; entries are only accessed atomically here.
        unsafe { &*((root + FIRST_KERNEL_SLOT * 8) as *const AtomicU64) }
    };
    let kernel_half = slot(b.root_addr()).load(Ordering::SeqCst);
    slot(a.root_addr()).store(kernel_half, Ordering::SeqCst);
    for (mm, tables) in [(&mm_a, &a), (&mm_b, &b)] {
        let root = tables.root_addr();
        machine.attach_table(mm, Arc::new(HostMmu { root })).unwrap();
    }
    let cpu1 = machine.cpu(1).unwrap();
    cpu1.switch_to(&mm_a).unwrap();
    cpu1.write(KVA, 7).unwrap();
    machine.cpu(0).unwrap().switch_to(&mm_b).unwrap();
    assert!(!machine.cached_translations(frame).is_empty());
    (machine, Shared { a, b, mm_b, frame })
}

impl Shared {
    /// Nothing changed: both processes' tables still map the page, CPU 1
    /// still caches it, no IPI went out, the oracle saw nothing wrong.
    fn assert_untouched(&mut self, machine: &MockMachine) {
        for tables in [&mut self.a, &mut self.b] {
            let (mut mapper, _) = tables.mapper();
            let pte = OffsetSpace::new(&mut mapper, &self.mm_b).lookup(KVA);
            assert!(pte.maps(self.frame) && pte.is_writable(), "{pte:?}");
        }
        assert!(!machine.cached_translations(self.frame).is_empty());
        assert_eq!(machine.ipis_sent(), 0);
        assert_eq!(machine.violations(), []);
    }
}

/// The trial's case: munmap of a kernel page through a process's
/// `OffsetTeardown` used to return `Ok` with no IPI and free the frame
/// under CPU 1's entry (CPU 1 runs the other process). It is refused,
/// global page or not (a global one is not reported as a global *user*
/// entry: it is a kernel page in the wrong space); the kernel's space
/// unmaps it, and its flush reaches CPU 1.
#[test]
fn munmap_of_a_kernel_page_through_a_process_is_refused_and_the_kernels_space_frees_it() {
    for global in [false, true] {
        let (m, mut s) = shared(global);
        let cpu0 = m.cpu(0).unwrap();
        let range = PageRange::new(KVA, 512).unwrap();
        let mut gather = PageGather::new();
        {
            let mut dealloc = Dealloc(&m, Vec::new());
            let (mut mapper, _) = s.b.mapper();
            // SAFETY: the page is mapped once, its frame is the test's, and
            // nothing is torn down (the call is refused).
            let space = unsafe { OffsetSpace::new(&mut mapper, &s.mm_b).for_teardown() };
            // SAFETY: frames are not reference-counted.
            let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
            let got = space.munmap(&cpu0, &mut gather, range, &mut frees);
            assert_eq!(got.unwrap_err(), Error::KernelHalf { va: KVA }, "global {global}");
            assert!(dealloc.1.is_empty());
        }
        assert!(gather.is_empty());
        s.assert_untouched(&m);
        if !global {
            continue;
        }
        // The kernel's own space (its mappings global, as the x86 `Arch`'s
        // `Features::kernel_global` promises): one flush to every CPU, then
        // the frame is freed.
        let kernel = MmTlbState::kernel(0);
        let mut dealloc = Dealloc(&m, Vec::new());
        let (mut mapper, _) = s.b.mapper();
        // SAFETY: as above; the leaf table below slot 256 that it may
        // detach is the kernel's (the test's host pages are never freed).
        let space = unsafe { OffsetSpace::new(&mut mapper, &kernel).for_teardown() };
        // SAFETY: as above.
        let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
        let summary = space.munmap(&cpu0, &mut gather, range, &mut frees).unwrap();
        assert_eq!((summary.pages_unmapped, summary.ipis_sent), (1, 1));
        assert_eq!(dealloc.1, [s.frame]);
        assert!(m.cpu(1).unwrap().read(KVA).is_err());
        assert_eq!(m.violations(), []);
    }
}

#[test]
fn reclaim_aging_and_mprotect_of_a_kernel_page_through_a_process_are_refused() {
    let (m, mut s) = shared(false);
    let cpu0 = m.cpu(0).unwrap();
    let refused = Error::KernelHalf { va: KVA };
    {
        let (mut mapper, _) = s.b.mapper();
        let space = OffsetSpace::new(&mut mapper, &s.mm_b);
        // A process's reverse map that lists the kernel page (a kernel
        // that records kernel mappings per process).
        let rmap = OneMapping {
            space: &space,
            frame: s.frame,
            va: KVA,
            pages: Pages::default(),
        };
        rmap.assert_walks_refused(&cpu0, refused);
        let read_only = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
        let got = change_protection(&cpu0, &space, PageRange::page(KVA).unwrap(), read_only);
        assert_eq!(got, Err(refused));

        let pages = Pages::default();
        // SAFETY: nothing is walked.
        let mut bounded: BoundedRmap<'_, OffsetSpace<'_>, Pages, 4> = unsafe { BoundedRmap::new(&pages) };
        let got = bounded.add(s.frame, &space, KVA, MappingFlags::empty());
        assert_eq!(got, Err(refused));
    }
    assert!(!s.mm_b.batched_flush_pending());
    s.assert_untouched(&m);
}

/// The immediate flushes, the batch's own entry points, the gather over
/// the mock's spaces and the public checks: an upper-half address of a
/// user space is refused before anything is sent or recorded; the
/// kernel's space takes it. The mock itself refuses to map one.
#[test]
fn every_entry_point_refuses_an_upper_half_address_of_a_user_space() {
    let m = MockMachine::new(MockConfig::x86_like(2)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    m.cpu(1).unwrap().switch_to(&mm).unwrap();
    let refused = Error::KernelHalf { va: KVA };
    let page = PageRange::page(KVA).unwrap();
    let f = m.alloc_frame().unwrap();
    assert_eq!(m.map(&mm, KVA, f, true), Err(MockError::Input(refused)));
    assert_eq!(
        m.set_pte(&mm, KVA, Pte::new(f, PteFlags::PRESENT)),
        Err(MockError::Input(refused))
    );
    assert_eq!(
        m.exchange_pte(&mm, KVA, Pte::EMPTY),
        Err(MockError::Input(refused))
    );
    assert_eq!(m.pte(&mm, KVA), Ok(Pte::EMPTY), "reads are not refused");

    assert_eq!(flush_tlb_page(&cpu0, &mm, KVA).unwrap_err(), refused);
    assert_eq!(flush_tlb_range(&cpu0, &mm, page).unwrap_err(), refused);
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(batch.add_pending(&cpu0, &mm, KVA, Pte::EMPTY), Err(refused));
    assert_eq!(batch.add_accessed_clear(&cpu0, &mm, KVA), Err(refused));
    assert!(batch.is_empty() && !mm.batched_flush_pending());
    let space = m.space(&mm);
    let read_only = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
    assert_eq!(change_protection(&cpu0, &space, page, read_only), Err(refused));
    let rmap = MockRmap::new(&m, vec![space]);
    let mut kernel = MockKernel::new(&rmap);
    let mut gather = MmuGather::<8>::new();
    let got = gather.unmap_range(
        &cpu0,
        &rmap.spaces()[0],
        &mut kernel,
        page,
        true,
        &mut TableFreePolicy::AfterFlush,
        &mut |_, _| panic!("nothing to hand back"),
    );
    assert_eq!(got.unwrap_err(), refused);
    assert!(gather.is_empty());
    assert_eq!((m.ipis_sent(), m.stats().shootdowns), (0, 0));

    // The public checks, for kernels that clear PTEs themselves: the
    // lower half passes, a range that reaches the upper half is refused
    // from its first upper page (64-bit addresses have no hole).
    assert_eq!(check_space_va(&cpu0, &mm, KVA), Err(refused));
    assert_eq!(check_space_va(&cpu0, &mm, 0x40_0000), Ok(()));
    assert_eq!(check_space_va(&cpu0, m.kernel_mm(), KVA), Ok(()));
    assert_eq!(check_space_range(&cpu0, m.kernel_mm(), page), Ok(()));
    let wide = MockMachine::new(MockConfig {
        va_bits: 64,
        ..MockConfig::x86_like(1)
    })
    .unwrap();
    let wide_mm = wide.new_mm(asid(1)).unwrap();
    let middle = PageRange::new((1 << 63) - 2 * PAGE_SIZE, 4).unwrap();
    assert_eq!(
        check_space_range(&wide.cpu(0).unwrap(), &wide_mm, middle),
        Err(Error::KernelHalf { va: 1 << 63 })
    );

    // The kernel's space: mapped, flushed everywhere.
    m.map(m.kernel_mm(), KVA, f, true).unwrap();
    m.cpu(1).unwrap().read(KVA).unwrap();
    m.clear_pte(m.kernel_mm(), KVA).unwrap();
    assert_eq!(flush_tlb_page(&cpu0, m.kernel_mm(), KVA).unwrap().remote_cpus, 1);
    assert!(m.cached_translations(f).is_empty());
    assert_eq!(m.violations(), []);
}

/// The other side of the same mistake: a process's table handed to the
/// kernel's state. The kernel's flushes reach every CPU, but on a tagged
/// TLB whose kernel-page flush relies on global kernel mappings (x86 with
/// PCIDs and `Features::kernel_global`: one INVLPG) they remove the loaded
/// ASID's entry and the global one. CPU 1 wrote the process's page, then
/// switched to another process, keeping its entry under ASID 1: a munmap
/// through the kernel's state used to return `Ok` and free the frame, and
/// CPU 1 wrote to the freed frame when it switched back. The non-global
/// entry is refused (`Error::NonGlobalKernelEntry`) with nothing changed,
/// by munmap, change_protection and the reverse-map walks; on an untagged
/// TLB, where the switch dropped the entry, the kernel's state may change
/// it.
#[test]
fn a_process_page_changed_through_the_kernels_state_is_refused_on_a_tagged_tlb() {
    use common::x86_tables::user_rw;
    const VA: u64 = 0x40_0000;
    for tagged in [true, false] {
        let mut tables = Tables::new();
        let root = tables.root_addr();
        let m = MockMachine::new(MockConfig {
            tagged_tlb: tagged,
            ..MockConfig::x86_like(2)
        })
        .unwrap();
        let mm = m.new_mm_at(asid(1), root).unwrap();
        m.attach_table(&mm, Arc::new(HostMmu { root })).unwrap();
        let other = m.new_mm(asid(2)).unwrap();
        let frame = m.alloc_frame().unwrap();
        {
            let (mut mapper, mut pool) = tables.mapper();
            map::<Size4KiB>(&mut mapper, &mut pool, VA, frame.addr(), user_rw());
        }
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        cpu1.switch_to(&mm).unwrap();
        cpu1.write(VA, 3).unwrap();
        cpu1.switch_to(&other).unwrap();
        let kernel = MmTlbState::kernel(root);
        let refused = Error::NonGlobalKernelEntry { va: VA };
        let range = PageRange::page(VA).unwrap();
        let mut dealloc = Dealloc(&m, Vec::new());
        let (mut mapper, _) = tables.mapper();
        if tagged {
            {
                let space = OffsetSpace::new(&mut mapper, &kernel);
                let read_only = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
                assert_eq!(change_protection(&cpu0, &space, range, read_only), Err(refused));
                let rmap = OneMapping {
                    space: &space,
                    frame,
                    va: VA,
                    pages: Pages::default(),
                };
                rmap.assert_walks_refused(&cpu0, refused);
            }
            // SAFETY: the page is mapped once and its frame is the test's;
            // nothing is torn down (the call is refused).
            let space = unsafe { OffsetSpace::new(&mut mapper, &kernel).for_teardown() };
            // SAFETY: frames are not reference-counted.
            let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
            let got = space.munmap(&cpu0, &mut PageGather::new(), range, &mut frees);
            assert_eq!(got.unwrap_err(), refused);
            assert!(space.lookup(VA).maps(frame) && space.lookup(VA).is_writable());
            assert_eq!(m.ipis_sent(), 0);
            assert_eq!(frees.dirty_pages(), 0, "nothing was torn down");
            // The process's own state unmaps it; CPU 1 catches up when it
            // switches back.
            let space = unsafe { OffsetSpace::new(&mut mapper, &mm).for_teardown() };
            // SAFETY: as above, and now the frame is freed after the flush.
            let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
            space
                .munmap(&cpu0, &mut PageGather::new(), range, &mut frees)
                .unwrap();
        } else {
            // SAFETY: as above.
            let space = unsafe { OffsetSpace::new(&mut mapper, &kernel).for_teardown() };
            // SAFETY: as above.
            let mut frees = unsafe { DeallocatorFrees::new(&mut dealloc) };
            let summary = space
                .munmap(&cpu0, &mut PageGather::new(), range, &mut frees)
                .unwrap();
            assert_eq!(summary.pages_unmapped, 1);
        }
        assert_eq!(dealloc.1, [frame], "tagged {tagged}");
        cpu1.switch_to(&mm).unwrap();
        assert!(cpu1.write(VA, 4).is_err(), "tagged {tagged}");
        assert_eq!(m.violations(), [], "tagged {tagged}");
    }
}

/// `change_protection` in the kernel's space keeps its entries global
/// where its flushes rely on that (here the mock's tagged TLB): an
/// `update` written as for a process (`PRESENT` and the frame, no
/// `GLOBAL`) used to store a non-global kernel entry, which CPUs would
/// cache under their own ASIDs and which the next change refused
/// (`Error::NonGlobalKernelEntry`). (The mock keeps every kernel entry
/// global, tagged or not, so the untagged case is x86's unit test.)
#[test]
fn change_protection_keeps_the_kernels_entries_global_where_its_flushes_need_it() {
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..MockConfig::x86_like(2)
    })
    .unwrap();
    let kernel = m.kernel_mm();
    let f = m.alloc_frame().unwrap();
    m.map(kernel, KVA, f, true).unwrap();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.write(KVA, 1).unwrap();
    let space = m.space(kernel);
    let page = PageRange::page(KVA).unwrap();
    let read_only = |p: Pte| Pte::new(p.frame(), PteFlags::PRESENT);
    assert_eq!(change_protection(&cpu0, &space, page, read_only), Ok(1));
    let pte = m.pte(kernel, KVA).unwrap();
    assert!(pte.maps(f) && !pte.is_writable(), "{pte:?}");
    assert!(pte.flags().contains(PteFlags::GLOBAL));
    assert!(cpu1.write(KVA, 2).is_err());
    let writable = |p: Pte| Pte::new(p.frame(), PteFlags::PRESENT | PteFlags::WRITABLE);
    assert_eq!(change_protection(&cpu0, &space, page, writable), Ok(1));
    cpu1.write(KVA, 3).unwrap();
    // An update that keeps the entry's own global bit (clearing only
    // WRITABLE, as a kernel's is usually written) keeps it global.
    let keep = |p: Pte| Pte(p.0 & !PteFlags::WRITABLE.bits());
    assert_eq!(change_protection(&cpu0, &space, page, keep), Ok(1));
    let pte = m.pte(kernel, KVA).unwrap();
    assert!(pte.maps(f) && !pte.is_writable(), "{pte:?}");
    assert!(pte.flags().contains(PteFlags::GLOBAL), "{pte:?}");
    // An entry the update clears stays clear: only present entries are
    // made global.
    assert_eq!(change_protection(&cpu0, &space, page, |_| Pte::EMPTY), Ok(1));
    assert_eq!(m.pte(kernel, KVA).unwrap(), Pte::EMPTY);
    assert!(cpu1.read(KVA).is_err());
    assert_eq!(m.violations(), []);
}
