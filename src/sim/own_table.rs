//! Page tables a kernel wrote itself, walked by the simulated MMU, so that
//! the kernel's own page-table code is tested against the oracle.

use core::sync::atomic::AtomicU64;

use crate::page_size::PageSize;
use crate::pte::Frame;

/// What the simulated MMU needs from a page table a kernel wrote itself:
/// the 64-bit word of each entry, which the MMU reads and updates
/// atomically as hardware does (accessed and dirty bits), and, optionally,
/// which frames hold the tables on the way to an address (for the walk
/// caches: [`table_frame`](MmuTable::table_frame) for the leaf table,
/// [`table_frame_at`](MmuTable::table_frame_at) for every level).
///
/// Attach one to an address space with
/// [`MockMachine::attach_table`](crate::arch::mock::MockMachine::attach_table):
/// every access to that address space then translates through the
/// kernel's entries. The kernel's [`PageTable`](crate::PageTable)
/// implementation works on the same words, so the oracle judges the
/// kernel's own code: a non-atomic clear that loses a dirty bit, a
/// forgotten flush, a frame freed early.
///
/// # A worked example
///
/// A kernel's page table for 2 MiB of user space: one leaf table of 512
/// entry words in a frame of its own. The same value is the MMU's view and
/// the crate's [`PageTable`](crate::PageTable).
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
///
/// use tlb_batch::arch::mock::{MmuTable, MockConfig, MockMachine};
/// use tlb_batch::{change_protection, Asid, Frame, MmTlbState, PageRange, PageTable, Pte, PteFlags};
///
/// const BASE: u64 = 0x4000_0000;
///
/// struct LeafTable {
///     mm: Arc<MmTlbState>,
///     frame: Frame, // the page-table frame itself
///     entries: [AtomicU64; 512],
/// }
///
/// impl LeafTable {
///     fn slot(&self, va: u64) -> Option<&AtomicU64> {
///         let index = va.checked_sub(BASE)? >> 12;
///         self.entries.get(usize::try_from(index).ok()?)
///     }
/// }
///
/// impl MmuTable for LeafTable {
///     fn entry(&self, va: u64) -> Option<&AtomicU64> {
///         self.slot(va)
///     }
///     fn table_frame(&self, va: u64) -> Option<Frame> {
///         self.slot(va).map(|_| self.frame)
///     }
/// }
///
/// // SAFETY: every change is one atomic operation on the entry word the
/// // MMU updates too; `tlb_state` is the address space this table serves.
/// unsafe impl PageTable for LeafTable {
///     fn tlb_state(&self) -> &MmTlbState {
///         &self.mm
///     }
///     fn lookup(&self, va: u64) -> Pte {
///         self.slot(va).map_or(Pte::EMPTY, |e| Pte(e.load(Ordering::SeqCst)))
///     }
///     fn exchange(&self, va: u64, new: Pte) -> Pte {
///         self.slot(va).map_or(Pte::EMPTY, |e| Pte(e.swap(new.0, Ordering::SeqCst)))
///     }
///     fn test_and_clear_accessed(&self, va: u64) -> bool {
///         let bit = PteFlags::ACCESSED.bits();
///         self.slot(va).is_some_and(|e| e.fetch_and(!bit, Ordering::SeqCst) & bit != 0)
///     }
///     fn set(&self, va: u64, pte: Pte) {
///         if let Some(e) = self.slot(va) {
///             e.store(pte.0, Ordering::SeqCst);
///         }
///     }
/// }
///
/// let machine = MockMachine::new(MockConfig::x86_like(2)).unwrap();
/// let mm = machine.new_mm(Asid::new(1).unwrap()).unwrap();
/// let table = Arc::new(LeafTable {
///     mm: Arc::clone(&mm),
///     frame: machine.alloc_frame().unwrap(),
///     entries: [const { AtomicU64::new(0) }; 512],
/// });
/// machine.attach_table(&mm, table.clone()).unwrap();
///
/// // The kernel maps a frame through its own code; CPU 1 writes it.
/// let data = machine.alloc_frame().unwrap();
/// let flags = PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::USER;
/// table.set(BASE, Pte::new(data, flags));
/// let cpu1 = machine.cpu(1).unwrap();
/// cpu1.switch_to(&mm).unwrap();
/// cpu1.write(BASE, 7).unwrap();
/// assert!(table.lookup(BASE).is_dirty(), "the MMU set the dirty bit in the kernel's word");
///
/// // The crate write-protects the page through the kernel's table: after
/// // the call, no CPU can write it any more.
/// let cpu0 = machine.cpu(0).unwrap();
/// let page = PageRange::page(BASE).unwrap();
/// change_protection(&cpu0, &*table, page, |p| Pte(p.0 & !PteFlags::WRITABLE.bits())).unwrap();
/// assert!(cpu1.write(BASE, 8).is_err());
/// assert_eq!(machine.check_coherent(&mm, page), 0);
/// assert_eq!(machine.violations(), []);
/// ```
pub trait MmuTable: Send + Sync {
    /// The entry word for `va`, or `None` when no table maps it (the walk
    /// faults).
    fn entry(&self, va: u64) -> Option<&AtomicU64>;

    /// The entry word that maps `va` and the size of the page it maps: a
    /// 4 KiB entry, or a huge one (an x86 level-2 or level-3 entry with the
    /// page-size bit, in its own format: the page's physical address
    /// aligned to its size, its PAT bit at bit 12). The MMU then caches one
    /// translation for the whole huge page, as hardware does, and the
    /// oracle judges every 4 KiB frame of it. The default is
    /// [`entry`](Self::entry), a 4 KiB entry: a table without huge pages
    /// (or one whose huge entries the MMU should treat as unmapped) needs
    /// nothing more. Where a huge entry maps `va` no leaf table does:
    /// [`table_frame`](Self::table_frame) answers `None` there, and so does
    /// `table_frame_at(va, level)` for the levels below the huge entry's.
    fn leaf(&self, va: u64) -> Option<(&AtomicU64, PageSize)> {
        self.entry(va).map(|e| (e, PageSize::SIZE_4K))
    }

    /// The frame holding the leaf table that maps `va`, if any. With it the
    /// MMU caches a pointer to the table (the walk cache), and the oracle
    /// flags the table frame freed while a CPU may still walk through it.
    /// The default says nothing, and no walk through this table is cached.
    fn table_frame(&self, va: u64) -> Option<Frame> {
        let _ = va;
        None
    }

    /// The frame holding the table at `level` on the way to `va`, if the
    /// walk reaches one there: level 1 is the leaf table (it maps 2 MiB, and
    /// the default answers [`table_frame`](Self::table_frame) for it), 2
    /// the table above it (1 GiB: x86's page directory), 3 the one above
    /// that (512 GiB: x86's page-directory-pointer table). Other levels
    /// are never asked (the root is not cached). A walk caches a pointer to
    /// each table it passed that this reports (the paging-structure caches
    /// at every level), so that a table freed while a CPU may still walk
    /// through such a pointer is caught: free a page-table frame that is
    /// not one of the machine's with
    /// [`MockMachine::free_table_frame`](crate::arch::mock::MockMachine::free_table_frame)
    /// so the oracle sees it. The default reports the leaf level only, so
    /// implementations written before this method keep their behaviour.
    fn table_frame_at(&self, va: u64, level: u32) -> Option<Frame> {
        if level == 1 {
            self.table_frame(va)
        } else {
            None
        }
    }
}
