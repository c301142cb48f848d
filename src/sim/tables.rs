//! The simulated page tables: one word per entry, leaf tables that take a
//! page-table frame each, roots unique across machines.

use core::sync::atomic::{AtomicU64, Ordering};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::vec::Vec;

use super::{
    lock, DetachedTable, FrameError, FrameState, MmuTable, MockCpu, MockError, MockMachine, MockSpace, Model,
    PoisonError,
};
use crate::arch::Asid;
use crate::cpuset::CpuId;
use crate::gather::TableBounds;
use crate::mm::MmTlbState;
use crate::page_size::PageSize;
use crate::pte::{Frame, Pte, PteFlags, PAGE_SHIFT};
use crate::range::PageRange;
use crate::validate::{check_asid, check_space_va, check_va};

/// Page-table roots are unique across every machine of the process, so
/// that an address space of one machine is never taken for another's.
pub(crate) static NEXT_ROOT: AtomicU64 = AtomicU64::new(1);

pub(crate) fn new_root() -> u64 {
    NEXT_ROOT.fetch_add(1, Ordering::Relaxed)
}
/// A leaf table with the 4 KiB granule maps 2^9 pages; the walk caches
/// keep their pointers to leaf tables per such 2 MiB region whatever the
/// machine's base page (a pointer to a 16 or 64 KiB machine's larger leaf
/// table is then cached per 2 MiB of it, and a flush of one address drops
/// only that region's: narrower than hardware, which the crate never
/// relies on, since it flushes a freed table's whole span).
pub(crate) const REGION_SHIFT: u32 = 9;

/// One address space's entries, by virtual page number (ordered, so that
/// [`PageTable::next_populated`](crate::PageTable::next_populated) can step over what is not mapped).
pub(crate) type Table = BTreeMap<u64, AtomicU64>;

impl<M: Model> MockMachine<M> {
    /// A new, empty user address space with this ASID. Each live address
    /// space has its own ASID (the TLB tells entries apart by it, and the
    /// crate's generations are per ASID); an ASID is free again once no
    /// one holds the address space it was given to, as a kernel reuses an
    /// ASID after the process is gone (the crate then flushes it at its
    /// first load: a new space's generation is newer than any a CPU
    /// recorded for the ASID).
    ///
    /// Errors: [`MockError::Input`] with
    /// [`Error::AsidOutOfRange`](crate::Error::AsidOutOfRange) for an ASID
    /// wider than [`MockConfig::asid_bits`](super::MockConfig::asid_bits);
    /// [`MockError::AsidInUse`] for the ASID of an address space still
    /// held.
    pub fn new_mm(&self, asid: Asid) -> Result<Arc<MmTlbState>, MockError> {
        self.add_mm(asid, new_root())
    }

    /// [`new_mm`](Self::new_mm) with the page-table root the space's state
    /// holds given by the caller: for a test that runs the crate over page
    /// tables of its own (the `x86_64` crate's through
    /// `mapper::OffsetSpace`, say), whose [`PageTable::root`](crate::PageTable::root)
    /// the state's root must equal. The machine keeps the space's entries
    /// in a table of its own under that root, which its CPUs walk, until
    /// [`attach_table`](Self::attach_table) gives it the caller's tables.
    ///
    /// Errors: those of `new_mm`, and [`MockError::RootInUse`] for the root
    /// of an address space still held (or of the kernel's).
    pub fn new_mm_at(&self, asid: Asid, root: u64) -> Result<Arc<MmTlbState>, MockError> {
        let in_use = root == self.kernel_mm.root()
            || lock(&self.asid_owners)
                .values()
                .any(|w| w.upgrade().is_some_and(|mm| mm.root() == root));
        if in_use {
            return Err(MockError::RootInUse { root });
        }
        self.add_mm(asid, root)
    }

    fn add_mm(&self, asid: Asid, root: u64) -> Result<Arc<MmTlbState>, MockError> {
        check_asid(&self.probe(), asid)?;
        let mut owners = lock(&self.asid_owners);
        if owners.get(&asid.value()).is_some_and(|w| w.strong_count() > 0) {
            return Err(MockError::AsidInUse { asid: asid.value() });
        }
        let mm = Arc::new(MmTlbState::new(asid, root));
        owners.insert(asid.value(), Arc::downgrade(&mm));
        drop(owners);
        lock(&self.roots).insert(root, asid);
        self.tables
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(root, Table::new());
        Ok(mm)
    }

    /// CPU 0's view, for checks that depend only on the machine's
    /// configuration (address and ASID widths).
    pub(crate) fn probe(&self) -> MockCpu<'_, M> {
        MockCpu {
            machine: self,
            id: CpuId::BOOT,
        }
    }

    /// [`Error::Unaligned`] or [`Error::NonCanonical`] for an address this
    /// machine cannot translate.
    pub(crate) fn check_va(&self, va: u64) -> Result<(), MockError> {
        Ok(check_va(&self.probe(), va)?)
    }

    /// [`check_va`](Self::check_va) for a write to `mm`'s table, and
    /// [`Error::KernelHalf`] for an upper-half address of a user space: the
    /// crate keeps user spaces to the lower half (on real machines the
    /// upper half is shared by every space), so the machine does not let a
    /// test build a user mapping there that no crate call could change.
    fn check_write(&self, mm: &MmTlbState, va: u64) -> Result<(), MockError> {
        Ok(check_space_va(&self.probe(), mm, va)?)
    }

    /// The kernel's address space: its mappings are global and visible from
    /// every address space.
    pub fn kernel_mm(&self) -> &Arc<MmTlbState> {
        &self.kernel_mm
    }

    /// The word of the entry for `vpn` under `root`: in the machine's own
    /// tables, the one entry of the base page that holds it (kept at the
    /// page's first 4 KiB unit).
    pub(crate) fn with_pte<R>(&self, root: u64, vpn: u64, f: impl FnOnce(&AtomicU64) -> R) -> Option<R> {
        if let Some(own) = self.own_table(root) {
            return own.entry(vpn << PAGE_SHIFT).map(f);
        }
        let vpn = vpn & !(self.config.base_page.base_pages() - 1);
        let tables = self.tables.read().unwrap_or_else(PoisonError::into_inner);
        tables.get(&root).and_then(|t| t.get(&vpn)).map(f)
    }

    /// How many bits of a virtual page number (in 4 KiB units) one of the
    /// machine's own leaf tables spans: granule / 8 entries of the base
    /// page (9 for 4 KiB, 2 MiB; 13 for 16 KiB, 32 MiB; 17 for 64 KiB,
    /// 512 MiB).
    pub(crate) fn leaf_shift(&self) -> u32 {
        let g = self.config.base_page.shift();
        (g - 3) + (g - PAGE_SHIFT)
    }

    /// [`with_pte`](Self::with_pte) for the MMU: the word of the entry
    /// that maps `vpn`, whatever its size, and that size (a kernel-written
    /// table's huge entry, [`MmuTable::leaf`]; the machine's own tables
    /// hold 4 KiB entries only).
    pub(crate) fn with_leaf<R>(
        &self,
        root: u64,
        vpn: u64,
        f: impl FnOnce(&AtomicU64, PageSize) -> R,
    ) -> Option<R> {
        if let Some(own) = self.own_table(root) {
            return own.leaf(vpn << PAGE_SHIFT).map(|(e, size)| f(e, size));
        }
        self.with_pte(root, vpn, |e| f(e, self.config.base_page))
    }

    /// The kernel-written page table attached to `root`, if any.
    pub(crate) fn own_table(&self, root: u64) -> Option<Arc<dyn MmuTable>> {
        if !self.any_own_table.load(Ordering::Relaxed) {
            // The common case, without a lock.
            return None;
        }
        lock(&self.own_tables).get(&root).cloned()
    }

    /// Lets the simulated MMU walk a page table the kernel wrote itself for
    /// `mm` (an address space of this machine with nothing mapped yet):
    /// from now on every access of `mm` translates through `table`'s entry
    /// words, and the machine's own page-table functions ([`pte`](Self::pte),
    /// [`set_pte`](Self::set_pte), ...) read and write them too. See
    /// [`MmuTable`] for a worked example. Make `mm` with
    /// [`new_mm_at`](Self::new_mm_at) and the table's root when the crate
    /// is given the table as a [`PageTable`](crate::PageTable) that reports
    /// its root ([`Error::RootMismatch`](crate::Error::RootMismatch)
    /// otherwise). Errors:
    /// [`MockError::UnknownAddressSpace`] for an address space this machine
    /// did not create (or the kernel's), [`MockError::TableInUse`] when the
    /// machine's own table for `mm` already maps something.
    pub fn attach_table(&self, mm: &MmTlbState, table: Arc<dyn MmuTable>) -> Result<(), MockError> {
        self.known(mm)?;
        if mm.is_kernel() {
            return Err(MockError::UnknownAddressSpace);
        }
        let mut tables = self.tables.write().unwrap_or_else(PoisonError::into_inner);
        if tables.get(&mm.root()).is_some_and(|t| !t.is_empty()) {
            return Err(MockError::TableInUse);
        }
        tables.remove(&mm.root());
        lock(&self.own_tables).insert(mm.root(), table);
        self.any_own_table.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Maps `frame` at `va` in `mm` (replacing any previous entry).
    /// Kernel mappings are global. Errors: an address the machine cannot
    /// translate, or an upper-half address of a user space
    /// ([`MockError::Input`] with [`Error::KernelHalf`](crate::Error::KernelHalf): the kernel's half
    /// belongs to the kernel's space), an address space it did not create
    /// ([`MockError::UnknownAddressSpace`]), a frame it does not have or
    /// that is free ([`MockError::Frame`]).
    pub fn map(&self, mm: &MmTlbState, va: u64, frame: Frame, writable: bool) -> Result<(), MockError> {
        self.check_write(mm, va)?;
        let mut flags = PteFlags::PRESENT;
        if writable {
            flags |= PteFlags::WRITABLE;
        }
        flags |= if mm.is_kernel() {
            PteFlags::GLOBAL
        } else {
            PteFlags::USER
        };
        self.set_pte(mm, va, Pte::new(frame, flags))
    }

    /// Allocates a frame and maps it at `va` in `mm`.
    pub fn map_new(&self, mm: &MmTlbState, va: u64, writable: bool) -> Result<Frame, MockError> {
        self.check_write(mm, va)?;
        self.known(mm)?;
        // One base page: a run of aligned 4 KiB frames on a 16 or 64 KiB
        // machine.
        let frame = if self.config.base_page.is_huge() {
            self.alloc_huge_frame(self.config.base_page)?
        } else {
            self.alloc_frame()?
        };
        self.map(mm, va, frame, writable)?;
        Ok(frame)
    }

    /// Stores `pte` at `va` in `mm`.
    /// The first PTE of a 512-page region takes a page-table frame.
    ///
    /// A present entry of the kernel's address space must have
    /// [`PteFlags::GLOBAL`] (as [`map`](Self::map) sets it): the machine's
    /// `Arch` flushes a kernel page as INVLPG does, from the loaded ASID
    /// and the global entries, which is right only if every kernel mapping
    /// is global (the x86 `Arch`'s `Features::kernel_global`). A
    /// non-global kernel entry cached under several ASIDs would survive a
    /// page or range flush in the ASIDs not loaded, so it is refused
    /// ([`MockError::NonGlobalKernelEntry`]). Errors:
    /// as for [`map`](Self::map) (an entry that names a frame, present or a
    /// migration or hwpoison entry, must name one the machine has, in use).
    pub fn set_pte(&self, mm: &MmTlbState, va: u64, pte: Pte) -> Result<(), MockError> {
        self.check_write(mm, va)?;
        self.known(mm)?;
        check_kernel_global(mm, va, pte)?;
        if pte.is_present() || pte.is_migration() || pte.is_hwpoison() {
            match lock(&self.memory).state(pte.frame())? {
                FrameState::Free => {
                    return Err(MockError::Frame(FrameError::WrongState {
                        frame: pte.frame(),
                        state: FrameState::Free,
                    }))
                }
                FrameState::InUse | FrameState::UnderIo => {}
            }
        }
        let base = self.config.base_page.base_pages();
        if (pte.is_present() || pte.is_migration() || pte.is_hwpoison()) && pte.frame().0 & (base - 1) != 0 {
            // A base page larger than 4 KiB maps an aligned run of frames.
            return Err(MockError::Input(crate::Error::Unaligned {
                addr: pte.frame().addr(),
            }));
        }
        let vpn = va >> PAGE_SHIFT;
        if let Some(own) = self.own_table(mm.root()) {
            // The kernel's own table: only its existing entries can be set.
            let entry = own.entry(va).ok_or(MockError::NoTable { va })?;
            self.after_write(Pte(entry.swap(pte.0, Ordering::SeqCst)), pte);
            return Ok(());
        }
        let mut tables = self.tables.write().unwrap_or_else(PoisonError::into_inner);
        let table = tables.get_mut(&mm.root()).ok_or(MockError::UnknownAddressSpace)?;
        let region = (mm.root(), vpn >> self.leaf_shift());
        if let std::collections::btree_map::Entry::Vacant(slot) = lock(&self.leaf_tables).entry(region) {
            slot.insert(lock(&self.memory).alloc_table()?);
        }
        let old = table
            .entry(vpn)
            .or_insert_with(|| AtomicU64::new(0))
            .swap(pte.0, Ordering::SeqCst);
        drop(tables);
        self.after_write(Pte(old), pte);
        Ok(())
    }

    /// What a PTE write from `old` to `new` does to the aging epochs
    /// ([`Rmap::aged_epoch`](crate::Rmap::aged_epoch), kept here for every
    /// [`MockRmap`](super::MockRmap) of the machine). An epoch vouches
    /// that a CPU that cached the frame since then set the accessed bit of
    /// the mapping it used, so it stops holding when:
    ///
    /// - a write takes an accessed bit away (cleared, or the entry gone or
    ///   pointed elsewhere while the bit was set): the old frame's epoch
    ///   goes (the crate's own unmap of such an entry does not use the
    ///   epoch, so it loses nothing);
    /// - a frame is mapped anew (a CPU may still cache an older mapping of
    ///   it there): the new frame's epoch goes.
    ///
    /// An unmap of an entry whose bit is clear keeps the epoch: the crate
    /// judges that unmap by it. Every writer of the machine's tables comes
    /// here, so a test that ages or remaps through them directly cannot
    /// leave a stale epoch.
    fn after_write(&self, old: Pte, new: Pte) {
        let same_frame = new.is_present() && old.is_present() && new.frame() == old.frame();
        if old.is_present() && old.is_accessed() && !(same_frame && new.is_accessed()) {
            self.forget_aged(old.frame());
        }
        if new.is_present() && !same_frame {
            self.forget_aged(new.frame());
        }
    }

    /// Forgets `frame`'s aging epoch.
    pub(crate) fn forget_aged(&self, frame: Frame) {
        lock(&self.aged).remove(&frame);
    }

    /// The PTE at `va` in `mm` (empty when nothing was ever mapped there).
    pub fn pte(&self, mm: &MmTlbState, va: u64) -> Result<Pte, MockError> {
        self.check_va(va)?;
        self.known(mm)?;
        Ok(self
            .with_pte(mm.root(), va >> PAGE_SHIFT, |p| Pte(p.load(Ordering::SeqCst)))
            .unwrap_or(Pte::EMPTY))
    }

    /// Atomically clears the PTE at `va` in `mm` and returns what it held,
    /// with whatever accessed and dirty bits hardware set up to that
    /// instant. Flushes nothing.
    pub fn clear_pte(&self, mm: &MmTlbState, va: u64) -> Result<Pte, MockError> {
        self.exchange_pte(mm, va, Pte::EMPTY)
    }

    /// Atomically replaces the PTE at `va` in `mm` with `new` and returns
    /// the old value. Flushes nothing. A present kernel entry without the
    /// global bit is refused, as by [`set_pte`](Self::set_pte).
    pub fn exchange_pte(&self, mm: &MmTlbState, va: u64, new: Pte) -> Result<Pte, MockError> {
        self.check_write(mm, va)?;
        self.known(mm)?;
        check_kernel_global(mm, va, new)?;
        match self.with_pte(mm.root(), va >> PAGE_SHIFT, |p| {
            Pte(p.swap(new.0, Ordering::SeqCst))
        }) {
            Some(old) => {
                self.after_write(old, new);
                Ok(old)
            }
            None => {
                if new != Pte::EMPTY {
                    self.set_pte(mm, va, new)?;
                }
                Ok(Pte::EMPTY)
            }
        }
    }

    /// Atomically clears the accessed bit of the PTE at `va` in `mm`;
    /// returns whether it was set. A bit cleared forgets the frame's aging
    /// epoch (the crate's own aging stores a new one after its clears).
    pub fn test_and_clear_accessed(&self, mm: &MmTlbState, va: u64) -> Result<bool, MockError> {
        self.check_write(mm, va)?;
        self.known(mm)?;
        let mask = PteFlags::ACCESSED.bits();
        let old = self
            .with_pte(mm.root(), va >> PAGE_SHIFT, |p| {
                Pte(p.fetch_and(!mask, Ordering::SeqCst))
            })
            .unwrap_or(Pte::EMPTY);
        self.after_write(old, Pte(old.0 & !mask));
        Ok(old.0 & mask != 0)
    }

    /// `mm` as a [`PageTable`](crate::PageTable) for the reverse-map functions.
    pub fn space(&self, mm: &Arc<MmTlbState>) -> MockSpace<'_, M> {
        MockSpace {
            machine: self,
            mm: Arc::clone(mm),
        }
    }

    /// Whether `mm` is an address space this machine created, with the
    /// ASID it was created with: [`MockError::UnknownAddressSpace`]
    /// otherwise (another machine's, or one built by hand).
    pub(crate) fn known(&self, mm: &MmTlbState) -> Result<(), MockError> {
        match lock(&self.roots).get(&mm.root()) {
            Some(&asid) if asid == mm.asid() => Ok(()),
            _ => Err(MockError::UnknownAddressSpace),
        }
    }

    /// The first page of `range` whose entry in `mm` is not empty, if any:
    /// what [`PageTable::next_populated`](crate::PageTable::next_populated) answers for a [`MockSpace`].
    pub fn next_populated(&self, mm: &MmTlbState, range: PageRange) -> Option<u64> {
        let last = range.last()?;
        let tables = self.tables.read().unwrap_or_else(PoisonError::into_inner);
        let table = tables.get(&mm.root())?;
        table
            .range(range.start() >> PAGE_SHIFT..=last >> PAGE_SHIFT)
            .find(|(_, pte)| pte.load(Ordering::SeqCst) != 0)
            .map(|(vpn, _)| vpn << PAGE_SHIFT)
    }
}

impl<M: Model> MockMachine<M> {
    /// The frame of the leaf page table that maps `va` in `mm`, if any.
    pub fn leaf_table(&self, mm: &MmTlbState, va: u64) -> Option<Frame> {
        self.leaf_table_of(mm.root(), (va >> PAGE_SHIFT) >> self.leaf_shift())
    }

    /// The leaf table linked for `region` under `root`.
    pub(crate) fn leaf_table_of(&self, root: u64, region: u64) -> Option<Frame> {
        self.table_at(root, region << self.leaf_shift(), 1)
    }

    /// The table at `level` (1, the leaf, to
    /// [`WALK_LEVELS`](super::WALK_LEVELS)) linked on the way to `vpn`
    /// under `root`: kernel-written tables report every level they know
    /// ([`MmuTable::table_frame_at`]); the machine's own tables, a flat map
    /// of leaf tables, have none above the leaf.
    pub(crate) fn table_at(&self, root: u64, vpn: u64, level: u32) -> Option<Frame> {
        if let Some(own) = self.own_table(root) {
            return own.table_frame_at(vpn << PAGE_SHIFT, level);
        }
        if level != 1 {
            return None;
        }
        lock(&self.leaf_tables)
            .get(&(root, vpn >> self.leaf_shift()))
            .copied()
    }

    /// Whether a walk through a cached pointer to `table`, which `root` no
    /// longer links there, reads a freed (or reused) frame: for the
    /// machine's own tables, one not detached (a detached table is freed
    /// only after the flush that drops the pointers); for kernel-written
    /// ones, a frame the kernel freed
    /// ([`free_table_frame`](Self::free_table_frame)) or a machine frame
    /// that is free.
    pub(crate) fn unlinked_table_freed(&self, root: u64, table: Frame) -> bool {
        if self.own_table(root).is_none() {
            return !self.is_detached_table(table);
        }
        lock(&self.freed_tables).contains(&table)
            || matches!(lock(&self.memory).state(table), Ok(FrameState::Free))
    }

    /// A walk found `table` linked under `root`: a kernel-written table
    /// frame freed before is in use again.
    pub(crate) fn table_linked(&self, root: u64, table: Frame) {
        if self.own_table(root).is_some() {
            lock(&self.freed_tables).remove(&table);
        }
    }

    /// Whether `table` was detached from its page table and not freed yet
    /// (a walk through a stale pointer to it reads cleared entries).
    pub(crate) fn is_detached_table(&self, table: Frame) -> bool {
        lock(&self.detached).contains(&table)
    }

    /// Detaches one leaf table of `mm` whose whole region lies inside
    /// `range` and all of whose entries are empty, dropping them; returns
    /// its frame and region. The frame stays allocated: the caller frees it
    /// when safe.
    pub fn detach_table(&self, mm: &MmTlbState, range: PageRange) -> Option<DetachedTable> {
        self.detach_table_bounded(mm, range, TableBounds::from_range(range))
    }

    /// Detaches one leaf table of `mm` whose region meets `range` and lies
    /// wholly within `bounds`, and all of whose entries are empty (one that
    /// still holds any, present or not, stays, whatever the bounds say);
    /// returns its frame and region. The frame stays allocated: the caller
    /// frees it when safe. [`detach_table`](Self::detach_table) is this
    /// with the bounds at the range.
    pub fn detach_table_bounded(
        &self,
        mm: &MmTlbState,
        range: PageRange,
        bounds: TableBounds,
    ) -> Option<DetachedTable> {
        let last = range.last()?;
        let top = bounds.span().last()?;
        // The regions wholly within the bounds (from the first that starts
        // at or after the floor, to the last that ends at or before the
        // bounds' last page) that meet the range (from the region of its
        // start to that of its last page); `hi` is one past the last.
        // Looked up by key, so that a teardown of T tables costs
        // O(T log T), not a scan of every table per call.
        let leaf = self.leaf_shift();
        let shift = leaf + PAGE_SHIFT;
        let lo = bounds.floor().div_ceil(1 << shift).max(range.start() >> shift);
        let hi = (((top >> PAGE_SHIFT) + 1) >> leaf).min((last >> shift) + 1);
        if lo >= hi {
            return None;
        }
        let region_pages = |region: u64| (region << leaf)..=(region << leaf) + ((1 << leaf) - 1);
        // The entries' lock first, as `set_pte` takes them: no entry can
        // be written between the check that the table is empty and its
        // unlinking.
        let mut tables = self.tables.write().unwrap_or_else(PoisonError::into_inner);
        let table = tables.get_mut(&mm.root())?;
        let mut leaves = lock(&self.leaf_tables);
        let (key, frame) = leaves
            .range((mm.root(), lo)..(mm.root(), hi))
            .map(|(&key, &frame)| (key, frame))
            .find(|&(key, _)| {
                table
                    .range(region_pages(key.1))
                    .all(|(_, pte)| pte.load(Ordering::SeqCst) == 0)
            })?;
        // Detached before it is unlinked, under the leaf tables' lock: a
        // walk through a CPU's cached pointer that finds the table no
        // longer linked must find it detached (it was judged freed in that
        // window, a false violation a new user's threaded trial hit).
        lock(&self.detached).insert(frame);
        leaves.remove(&key);
        drop(leaves);
        let cleared: Vec<u64> = table.range(region_pages(key.1)).map(|(&vpn, _)| vpn).collect();
        for vpn in cleared {
            table.remove(&vpn);
        }
        Some(DetachedTable {
            frame,
            range: PageRange::new((key.1 << leaf) << PAGE_SHIFT, 1 << leaf).ok()?,
        })
    }
}

/// Refuses a present kernel entry without the global bit
/// ([`MockError::NonGlobalKernelEntry`]): see [`MockMachine::set_pte`].
fn check_kernel_global(mm: &MmTlbState, va: u64, pte: Pte) -> Result<(), MockError> {
    if mm.is_kernel() && pte.is_present() && !pte.flags().contains(PteFlags::GLOBAL) {
        return Err(MockError::NonGlobalKernelEntry { va });
    }
    Ok(())
}
