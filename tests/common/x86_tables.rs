//! Helpers the `x86_64-mapper` tests (`tests/x86_64_mapper_*.rs`) share:
//! four-level tables in host memory built with the `x86_64` crate's
//! `OffsetPageTable` (physical offset 0), the simulated MMU's own walk of
//! them, and a machine whose address space they translate.

use std::collections::BTreeSet;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tlb_batch::arch::mock::{MmuTable, MockConfig, MockMachine};
use tlb_batch::arch::Arch;
use tlb_batch::mapper::OffsetSpace;
use tlb_batch::{
    page_referenced, try_to_unmap, Error, Frame, Mapping, MappingFlags, MmTlbState, PageState, Rmap,
    TlbFlushUnmapBatch, TtuFlags,
};
use x86_64::structures::paging::{
    FrameAllocator, FrameDeallocator, Mapper, OffsetPageTable, Page, PageSize, PageTable as X86Table,
    PageTableFlags as F, PhysFrame, Size4KiB,
};
use x86_64::{PhysAddr, VirtAddr};

use super::asid;

pub const MIB2: u64 = 2 << 20;
pub const GIB: u64 = 1 << 30;

/// Four-level tables in host memory: every table a 4 KiB-aligned host
/// page, never freed while the test runs (the simulated MMU keeps reading
/// them), so the physical-memory offset is 0.
pub struct Tables {
    pub root: &'static mut X86Table,
    pub pool: Vec<u64>,
}

impl Tables {
    pub fn new() -> Tables {
        Tables {
            root: Box::leak(Box::new(X86Table::new())),
            pool: Vec::new(),
        }
    }

    pub fn root_addr(&self) -> u64 {
        &*self.root as *const X86Table as u64
    }

    /// The `x86_64` crate's mapper over these tables, and their allocator.
    pub fn mapper(&mut self) -> (OffsetPageTable<'_>, Pool<'_>) {
        // SAFETY: every table frame an entry names is a leaked host page at
        // its own address (offset 0).
        let mapper = unsafe { OffsetPageTable::new(self.root, VirtAddr::new(0)) };
        (mapper, Pool(&mut self.pool))
    }
}

/// Allocates page-table frames for `map_to`: leaked host pages.
pub struct Pool<'a>(pub &'a mut Vec<u64>);

// SAFETY: each frame is a fresh, zeroed, 4 KiB-aligned host page that is
// never handed out twice.
unsafe impl FrameAllocator<Size4KiB> for Pool<'_> {
    fn allocate_frame(&mut self) -> Option<PhysFrame> {
        let page: &'static mut X86Table = Box::leak(Box::new(X86Table::new()));
        let addr = page as *mut X86Table as u64;
        self.0.push(addr);
        PhysFrame::from_start_address(PhysAddr::new(addr)).ok()
    }
}

pub fn map<S: PageSize + std::fmt::Debug>(
    mapper: &mut OffsetPageTable<'_>,
    pool: &mut Pool<'_>,
    va: u64,
    frame_addr: u64,
    flags: F,
) where
    for<'a> OffsetPageTable<'a>: Mapper<S>,
{
    let page = Page::<S>::from_start_address(VirtAddr::new(va)).unwrap();
    let frame = PhysFrame::<S>::from_start_address(PhysAddr::new(frame_addr)).unwrap();
    // SAFETY: the frames are simulated (never dereferenced by the host),
    // and the address space is not loaded anywhere yet.
    unsafe { mapper.map_to(page, frame, flags, pool) }
        .unwrap()
        .ignore();
}

/// The simulated MMU's view of the same tables: its own walk (independent
/// of the code under test) to the entry word that maps an address, a
/// 4 KiB entry or a 2 MiB or 1 GiB one (`leaf`), which the MMU caches as
/// one huge translation.
pub struct HostMmu {
    pub root: u64,
}

impl HostMmu {
    /// The entry word that maps `va` and its size, walking from level 4
    /// down to a leaf or a huge entry.
    fn walk(&self, va: u64) -> Option<(&AtomicU64, tlb_batch::PageSize)> {
        let mut table = self.root;
        for level in (1..=4u32).rev() {
            let i = (va >> (12 + 9 * (level - 1))) & 511;
            // SAFETY: `table` is a leaked host page table (offset 0) and
            // i < 512; entries are only accessed atomically in this test.
            let word = unsafe { &*((table + i * 8) as *const AtomicU64) };
            if level == 1 {
                return Some((word, tlb_batch::PageSize::SIZE_4K));
            }
            let raw = word.load(Ordering::SeqCst);
            if raw & 1 == 0 {
                return None;
            }
            if raw & (1 << 7) != 0 {
                return match level {
                    3 => Some((word, tlb_batch::PageSize::SIZE_1G)),
                    2 => Some((word, tlb_batch::PageSize::SIZE_2M)),
                    _ => None,
                };
            }
            table = raw & 0x000f_ffff_ffff_f000;
        }
        None
    }

    /// The host address of the table at `level` (4, the root, to 1, the
    /// leaf) on the way to `va`, if every entry above it is present and
    /// none maps a huge page.
    fn table_at(&self, va: u64, level: u32) -> Option<u64> {
        let mut table = self.root;
        for l in (level + 1..=4u32).rev() {
            let i = (va >> (12 + 9 * (l - 1))) & 511;
            // SAFETY: as in `walk`.
            let raw = unsafe { &*((table + i * 8) as *const AtomicU64) }.load(Ordering::SeqCst);
            if raw & 1 == 0 || raw & (1 << 7) != 0 {
                return None;
            }
            table = raw & 0x000f_ffff_ffff_f000;
        }
        Some(table)
    }
}

impl MmuTable for HostMmu {
    fn entry(&self, va: u64) -> Option<&AtomicU64> {
        self.walk(va)
            .and_then(|(word, size)| (!size.is_huge()).then_some(word))
    }

    fn leaf(&self, va: u64) -> Option<(&AtomicU64, tlb_batch::PageSize)> {
        self.walk(va)
    }

    fn table_frame(&self, va: u64) -> Option<Frame> {
        self.table_frame_at(va, 1)
    }

    /// Every level below the root, so that the simulated MMU caches
    /// pointers to page directories and PDPTs as well as to page tables.
    fn table_frame_at(&self, va: u64, level: u32) -> Option<Frame> {
        if !(1..=3).contains(&level) {
            return None;
        }
        self.table_at(va, level).map(|addr| Frame(addr >> 12))
    }
}

/// The entry word at `level` (4 to 2) on the way to `va`, which must have
/// tables down to that level.
pub fn upper_entry(root: u64, va: u64, level: u32) -> &'static AtomicU64 {
    let mut table = root;
    for l in (level..=4).rev() {
        let i = (va >> (12 + 9 * (l - 1))) & 511;
        // SAFETY: as in `HostMmu::walk`.
        let word: &'static AtomicU64 = unsafe { &*((table + i * 8) as *const AtomicU64) };
        if l == level {
            return word;
        }
        table = word.load(Ordering::SeqCst) & 0x000f_ffff_ffff_f000;
    }
    unreachable!()
}

pub fn user_rw() -> F {
    F::PRESENT | F::WRITABLE | F::USER_ACCESSIBLE
}

/// A machine of `cpus` CPUs and an address space translated by `tables`.
pub fn machine_with(cpus: usize, tables: &Tables) -> (MockMachine, Arc<MmTlbState>) {
    let m = MockMachine::new(MockConfig::x86_like(cpus)).unwrap();
    let root = tables.root_addr();
    let mm = m.new_mm_at(asid(1), root).unwrap();
    m.attach_table(&mm, Arc::new(HostMmu { root })).unwrap();
    (m, mm)
}

/// Per-frame state for the reverse map: which frames were marked dirty.
#[derive(Default)]
pub struct Pages(pub std::sync::Mutex<BTreeSet<Frame>>);

impl PageState for Pages {
    fn set_dirty(&self, frame: Frame) {
        self.0.lock().unwrap().insert(frame);
    }
}

/// Frees data frames into the machine (whose oracle judges each free) and
/// records them; page-table frames (host pages, above 2^40) are left alone.
pub struct Dealloc<'m>(pub &'m MockMachine, pub Vec<Frame>);

impl FrameDeallocator<Size4KiB> for Dealloc<'_> {
    unsafe fn deallocate_frame(&mut self, frame: PhysFrame) {
        let frame = Frame::from(frame);
        if frame.addr() < (1 << 40) && self.0.free_frame(frame).is_ok() {
            self.1.push(frame);
        }
    }
}

/// A reverse map of one mapping, written the way a kernel's own would be
/// (not through `BoundedRmap::add`, which refuses some set-ups already).
pub struct OneMapping<'s, 'a> {
    pub space: &'s OffsetSpace<'a>,
    pub frame: Frame,
    pub va: u64,
    pub pages: Pages,
}

impl OneMapping<'_, '_> {
    /// Asserts that reclaim (batched or not) and aging of the frame on
    /// `arch` are refused with `refused`, with nothing recorded: no
    /// deferred flush, no page marked dirty.
    pub fn assert_walks_refused<A: Arch>(&self, arch: &A, refused: Error) {
        let mut batch = TlbFlushUnmapBatch::new();
        for flags in [TtuFlags::BATCH_FLUSH, TtuFlags::IGNORE_ACCESS] {
            let got = try_to_unmap(arch, self, self.frame, flags, &mut batch);
            assert_eq!(got, Err(refused), "{flags:?}");
        }
        let got = page_referenced(arch, self, self.frame, &mut batch);
        assert_eq!(got.unwrap_err(), refused);
        assert!(batch.is_empty() && self.pages.0.lock().unwrap().is_empty());
    }
}

// SAFETY: the tests that use it map `frame` once, at `va` in `space`.
unsafe impl<'a> Rmap for OneMapping<'_, 'a> {
    type Space = OffsetSpace<'a>;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        if frame != self.frame {
            return ControlFlow::Continue(());
        }
        visit(Mapping {
            space: self.space,
            va: self.va,
            flags: MappingFlags::empty(),
        })
    }

    fn set_dirty(&self, frame: Frame) {
        self.pages.0.lock().unwrap().insert(frame);
    }
}
