//! Page-table entries and physical frames.
//!
//! The layout follows x86_64 (flags in the low bits and bit 63, the frame
//! number in bits 12..52), which arm64 and RISC-V kernels can map onto with
//! a conversion at their page-table boundary.

use core::fmt;

/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;
/// The crate's unit of addresses, ranges and frames: 4 KiB on every
/// architecture. [`PageRange`](crate::PageRange)s count it, and a
/// [`Frame`] is a physical address divided by it.
///
/// It is not necessarily the architecture's base page, the smallest
/// page its tables map ([`Arch::base_page`](crate::Arch::base_page)):
/// arm64 kernels with the 16 or 64 KiB granule map pages of 4 or 16 units,
/// which the crate takes whole, as it takes a huge page (see
/// `docs/granules.md`). Every entry point refuses an address or range of
/// such a kernel that is not aligned to its base page.
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;

/// A physical frame number (physical address >> [`PAGE_SHIFT`]).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frame(pub u64);

impl Frame {
    /// The frame's physical address.
    pub const fn addr(self) -> u64 {
        self.0 << PAGE_SHIFT
    }
}

impl fmt::Debug for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pfn({:#x})", self.0)
    }
}

bitflags::bitflags! {
    /// The flag bits of a [`Pte`].
    ///
    /// Bits 9 to 11 are the crate's own in entries that are not present
    /// (migration and hwpoison entries). Every other bit of an entry (no
    /// execute, the cache-control bits 3, 4 and 7, the protection key, and
    /// the software-available bits 52 to 58 where a kernel keeps its own
    /// per-mapping state) is carried through a migration unchanged.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct PteFlags: u64 {
        /// The entry maps a frame.
        const PRESENT = 1 << 0;
        /// Writes are allowed.
        const WRITABLE = 1 << 1;
        /// User mode may access the page.
        const USER = 1 << 2;
        /// Set by hardware when a translation is loaded into a TLB.
        const ACCESSED = 1 << 5;
        /// Set by hardware on the first write through the entry.
        const DIRTY = 1 << 6;
        /// The translation is global: it survives address-space switches,
        /// and only a flush of the page or of everything with globals
        /// removes it. For kernel mappings only: the crate flushes a user
        /// space by its ASID, which leaves global entries alone, so a user
        /// entry with this bit is refused by every operation that would
        /// change it ([`Error::GlobalUserEntry`](crate::Error::GlobalUserEntry));
        /// [`TlbFlushUnmapBatch::add_pending`](crate::TlbFlushUnmapBatch::add_pending),
        /// handed one already cleared, flushes its page on every online CPU.
        const GLOBAL = 1 << 8;
        /// Software bit (not present entries only): a migration entry; the
        /// frame field names the frame being migrated.
        const MIGRATION = 1 << 9;
        /// Software bit (not present entries only): the frame is
        /// hardware-poisoned; any access must be refused.
        const HWPOISON = 1 << 10;
        /// Software bit (migration entries only): the mapping was writable
        /// and gets write access back when the migration completes.
        const WAS_WRITABLE = 1 << 11;
        /// Instruction fetches fault.
        const NO_EXECUTE = 1 << 63;
    }
}

const FRAME_MASK: u64 = 0x000f_ffff_ffff_f000;

/// A page-table entry value.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Pte(pub u64);

impl Pte {
    /// The empty (not present) entry.
    pub const EMPTY: Pte = Pte(0);

    /// An entry mapping `frame` with `flags`. Frame bits beyond the 40 the
    /// format holds are dropped.
    pub fn new(frame: Frame, flags: PteFlags) -> Pte {
        Pte((frame.addr() & FRAME_MASK) | flags.bits())
    }

    /// A non-present migration entry for `frame`: accesses wait (fault)
    /// until the migration replaces it; `writable` records whether the
    /// mapping allowed writes.
    pub fn migration(frame: Frame, writable: bool) -> Pte {
        let mut flags = PteFlags::MIGRATION;
        if writable {
            flags |= PteFlags::WAS_WRITABLE;
        }
        Pte::new(frame, flags)
    }

    /// The migration entry that replaces this present entry: not present,
    /// marked [`PteFlags::MIGRATION`], [`PteFlags::WAS_WRITABLE`] when it
    /// allowed writes, and every other bit kept (frame, no-execute,
    /// cache-control, protection key, software bits) except the accessed
    /// and dirty bits, whose news the unmap moved to the page. An entry
    /// that is not present becomes a bare migration entry for its frame.
    pub fn to_migration(self) -> Pte {
        if !self.is_present() {
            return Pte::migration(self.frame(), false);
        }
        let cleared = PteFlags::PRESENT
            | PteFlags::ACCESSED
            | PteFlags::DIRTY
            | PteFlags::HWPOISON
            | PteFlags::WAS_WRITABLE;
        let mut bits = (self.0 & !cleared.bits()) | PteFlags::MIGRATION.bits();
        if self.is_writable() {
            bits |= PteFlags::WAS_WRITABLE.bits();
        }
        Pte(bits)
    }

    /// The present entry that ends a migration: `frame` mapped with every
    /// bit the migration entry kept (see [`to_migration`](Self::to_migration)),
    /// writable again if it was; accessed and dirty clear. `None` when this
    /// is not a migration entry.
    pub fn from_migration(self, frame: Frame) -> Option<Pte> {
        if !self.is_migration() {
            return None;
        }
        let mut bits = self.0 & !(PteFlags::MIGRATION | PteFlags::WAS_WRITABLE | PteFlags::WRITABLE).bits();
        bits |= PteFlags::PRESENT.bits();
        if self.flags().contains(PteFlags::WAS_WRITABLE) {
            bits |= PteFlags::WRITABLE.bits();
        }
        Some(Pte(bits).with_frame(frame))
    }

    /// The same entry naming `frame` instead (frame bits beyond the 40 the
    /// format holds are dropped).
    pub fn with_frame(self, frame: Frame) -> Pte {
        Pte((self.0 & !FRAME_MASK) | (frame.addr() & FRAME_MASK))
    }

    /// A non-present entry marking `frame` as hardware-poisoned.
    pub fn hwpoison(frame: Frame) -> Pte {
        Pte::new(frame, PteFlags::HWPOISON)
    }

    /// Whether this is a migration entry (not present, names a frame).
    pub fn is_migration(self) -> bool {
        !self.is_present() && self.flags().contains(PteFlags::MIGRATION)
    }

    /// Whether this is a hwpoison entry (not present, names a frame).
    pub fn is_hwpoison(self) -> bool {
        !self.is_present() && self.flags().contains(PteFlags::HWPOISON)
    }

    /// Whether the entry maps `frame` (present and naming it).
    pub fn maps(self, frame: Frame) -> bool {
        self.is_present() && self.frame() == frame
    }

    /// The flag bits (unknown bits are dropped).
    pub fn flags(self) -> PteFlags {
        PteFlags::from_bits_truncate(self.0)
    }

    /// The mapped frame, whether or not the entry is present.
    pub fn frame(self) -> Frame {
        Frame((self.0 & FRAME_MASK) >> PAGE_SHIFT)
    }

    /// Whether the entry is present.
    pub fn is_present(self) -> bool {
        self.flags().contains(PteFlags::PRESENT)
    }

    /// Whether the entry is present and writable.
    pub fn is_writable(self) -> bool {
        self.flags().contains(PteFlags::PRESENT | PteFlags::WRITABLE)
    }

    /// Whether hardware has recorded a write through the entry.
    pub fn is_dirty(self) -> bool {
        self.flags().contains(PteFlags::DIRTY)
    }

    /// Whether hardware has recorded an access through the entry.
    pub fn is_accessed(self) -> bool {
        self.flags().contains(PteFlags::ACCESSED)
    }
}

impl fmt::Debug for Pte {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_present() {
            write!(f, "Pte({:?}, {:?})", self.frame(), self.flags())
        } else if self.0 == 0 {
            write!(f, "Pte(empty)")
        } else if self.is_migration() {
            write!(f, "Pte(migration, {:?})", self.frame())
        } else if self.is_hwpoison() {
            write!(f, "Pte(hwpoison, {:?})", self.frame())
        } else {
            write!(f, "Pte(not present, {:#x})", self.0)
        }
    }
}

/// Whether `va` is page-aligned; [`Error::Unaligned`](crate::Error::Unaligned)
/// otherwise.
pub fn check_aligned(va: u64) -> Result<(), crate::Error> {
    if va.is_multiple_of(PAGE_SIZE) {
        Ok(())
    } else {
        Err(crate::Error::Unaligned { addr: va })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_and_flags_round_trip() {
        let pte = Pte::new(
            Frame(0x1234),
            PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::DIRTY,
        );
        assert_eq!(pte.frame(), Frame(0x1234));
        assert!(pte.is_present() && pte.is_writable() && pte.is_dirty() && !pte.is_accessed());
        assert!(!Pte::EMPTY.is_present());
        let m = Pte::migration(Frame(7), true);
        assert!(m.is_migration() && !m.is_present() && !m.maps(Frame(7)) && m.frame() == Frame(7));
        assert!(m.flags().contains(PteFlags::WAS_WRITABLE) && !m.is_hwpoison());
        assert!(Pte::hwpoison(Frame(7)).is_hwpoison());
        let nx = Pte::new(
            Frame(5),
            PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::NO_EXECUTE | PteFlags::DIRTY,
        );
        let sw = Pte(nx.0 | (1 << 52) | (1 << 4));
        let entry = sw.to_migration();
        assert!(entry.is_migration() && entry.frame() == Frame(5) && !entry.is_dirty());
        let back = entry.from_migration(Frame(6)).unwrap();
        assert_eq!(
            back,
            Pte((sw.0 & !PteFlags::DIRTY.bits()) ^ (5 << 12) ^ (6 << 12))
        );
        assert!(back.flags().contains(PteFlags::NO_EXECUTE) && back.is_writable());
        assert_eq!(pte.from_migration(Frame(1)), None);
        assert!(pte.maps(Frame(0x1234)) && !pte.maps(Frame(1)));
        assert!(check_aligned(0x2000).is_ok());
        assert_eq!(
            check_aligned(0x2001),
            Err(crate::Error::Unaligned { addr: 0x2001 })
        );
    }
}
