//! Helpers the `page-table-multiarch` tests (`tests/ptm_*.rs`) share: a
//! `PagingHandler` over host memory, four-level tables built with
//! `page_table_multiarch`'s `X64PageTable` through it, the simulated MMU's
//! own walk of those tables, and a machine whose address space they
//! translate.
//!
//! The handler's "physical" address of a host page is its host address
//! minus [`OFFSET`], and `phys_to_virt` adds it back: code that used a
//! table's physical addresses as pointers, without the handler's
//! translation, would read the wrong memory, and the tests would see it.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use memory_addr::{PhysAddr, VirtAddr};
use page_table_multiarch::x86_64::X64PageTable;
use page_table_multiarch::{MappingFlags, PageSize, PagingHandler};
use tlb_batch::arch::mock::{MmuTable, MockConfig, MockMachine};
use tlb_batch::{Frame, MmTlbState, PageState};

use super::asid;

pub const MIB2: u64 = 2 << 20;
pub const GIB: u64 = 1 << 30;

/// Host address minus "physical" address: 16 TiB, below the host's heap
/// and mmap areas, so every host page has a physical address.
pub const OFFSET: usize = 0x1000_0000_0000;

thread_local! {
    /// The physical addresses of the table frames this thread's tables
    /// took from the handler, in allocation order (each test runs on its
    /// own thread).
    static ALLOCATED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// The frames handed back through `dealloc_frames`.
    static DEALLOCATED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// The kernel's paging handler, over host memory.
pub struct HostPaging;

impl PagingHandler for HostPaging {
    fn alloc_frames(num: usize, align: usize) -> Option<PhysAddr> {
        let layout = std::alloc::Layout::from_size_align(num * 4096, align.max(4096)).ok()?;
        // SAFETY: the layout's size is not zero (`num` >= 1 for tables).
        let host = unsafe { std::alloc::alloc_zeroed(layout) } as usize;
        let phys = host.checked_sub(OFFSET)?;
        ALLOCATED.with(|a| a.borrow_mut().push(phys as u64));
        Some(PhysAddr::from(phys))
    }

    /// Records the frame and keeps the memory: the simulated MMU may still
    /// read a table the test is done with, and the tests check what was
    /// handed back.
    fn dealloc_frames(paddr: PhysAddr, _num: usize) {
        DEALLOCATED.with(|d| d.borrow_mut().push(paddr.as_usize() as u64));
    }

    fn phys_to_virt(paddr: PhysAddr) -> VirtAddr {
        VirtAddr::from(paddr.as_usize() + OFFSET)
    }
}

/// The table frames allocated on this thread so far.
pub fn allocated() -> Vec<u64> {
    ALLOCATED.with(|a| a.borrow().clone())
}

/// The table frames handed back to the handler on this thread so far.
pub fn deallocated() -> Vec<u64> {
    DEALLOCATED.with(|d| d.borrow().clone())
}

pub type Table = X64PageTable<HostPaging>;

/// A new, empty table (its root taken from the handler).
pub fn table() -> Table {
    Table::try_new().unwrap()
}

pub fn user_rw() -> MappingFlags {
    MappingFlags::READ | MappingFlags::WRITE | MappingFlags::USER
}

pub fn user_ro() -> MappingFlags {
    MappingFlags::READ | MappingFlags::USER
}

/// Maps `frame` at `va` with the table's own cursor. The cursor's local
/// flush is compiled out on the host (it runs on bare metal only).
pub fn map(table: &mut Table, va: u64, frame: Frame, size: PageSize, flags: MappingFlags) {
    let mut cursor = table.cursor();
    cursor
        .map(
            VirtAddr::from(va as usize),
            PhysAddr::from(frame.addr() as usize),
            size,
            flags,
        )
        .unwrap();
}

/// The simulated MMU's walk of the same tables: its own code, independent
/// of the adapter under test, translating through the handler's offset.
/// Huge pages are not modelled (the walk faults there).
pub struct PtmMmu {
    pub root: u64,
}

impl MmuTable for PtmMmu {
    /// Every level below the root, so that the simulated MMU caches
    /// pointers to the upper tables as well as to leaf tables.
    fn table_frame_at(&self, va: u64, level: u32) -> Option<Frame> {
        if !(1..=3).contains(&level) {
            return None;
        }
        let mut table = self.root;
        for l in (level + 1..=4u32).rev() {
            let i = (va >> (12 + 9 * (l - 1))) & 511;
            let host = table as usize + OFFSET + i as usize * 8;
            // SAFETY: as in `entry`.
            let raw = unsafe { &*(host as *const AtomicU64) }.load(Ordering::SeqCst);
            if raw & 1 == 0 || raw & (1 << 7) != 0 {
                return None;
            }
            table = raw & 0x000f_ffff_ffff_f000;
        }
        Some(Frame(table >> 12))
    }

    fn entry(&self, va: u64) -> Option<&AtomicU64> {
        let mut table = self.root;
        for level in (1..=4u32).rev() {
            let i = (va >> (12 + 9 * (level - 1))) & 511;
            let host = table as usize + OFFSET + i as usize * 8;
            // SAFETY: `table` is a table frame from `HostPaging` (never
            // freed) and i < 512; the tests access entries only atomically
            // while the machine runs.
            let word = unsafe { &*(host as *const AtomicU64) };
            if level == 1 {
                return Some(word);
            }
            let raw = word.load(Ordering::SeqCst);
            if raw & 1 == 0 || raw & (1 << 7) != 0 {
                return None;
            }
            table = raw & 0x000f_ffff_ffff_f000;
        }
        None
    }
}

/// A machine of `cpus` CPUs and an address space that `table` translates.
pub fn machine_with(cpus: usize, table: &Table) -> (MockMachine, Arc<MmTlbState>) {
    let m = MockMachine::new(MockConfig::x86_like(cpus)).unwrap();
    let root = table.root_paddr().as_usize() as u64;
    let mm = m.new_mm_at(asid(1), root).unwrap();
    m.attach_table(&mm, Arc::new(PtmMmu { root })).unwrap();
    (m, mm)
}

/// Per-frame state for the reverse map: the frames marked dirty.
#[derive(Default)]
pub struct Pages(pub std::sync::Mutex<BTreeSet<Frame>>);

impl PageState for Pages {
    fn set_dirty(&self, frame: Frame) {
        self.0.lock().unwrap().insert(frame);
    }
}
