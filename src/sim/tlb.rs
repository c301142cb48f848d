//! One simulated CPU's translation caches: a bounded TLB (least recently
//! used eviction, tagged by ASID, global entries kept apart, each entry as
//! large as the page-table entry it was filled from: one huge entry covers
//! a whole 2 MiB or 1 GiB page) and bounded paging-structure caches (the
//! pointers to page tables that walks cached, one cache per level, tagged
//! by ASID).
//!
//! Invalidation is modelled as narrowly as real hardware guarantees it, so
//! that a crate relying on more is caught:
//!
//! - [`invalidate_va`](Tlb::invalidate_va) is x86's `INVLPG` (the current
//!   ASID's entry and a global one) or `INVPCID` by address (one ASID's
//!   non-global entry), or arm64's `TLBI VAE1`: it drops every entry that
//!   translates the address, of any size (a huge entry whatever address
//!   inside it is named; a 4 KiB entry only at its own address, so a flush
//!   at a 2 MiB stride over 4 KiB entries leaves all but the first of each
//!   stride); which walk-cache entries go with it is the caller's
//!   [`WalkFlush`].
//! - [`invalidate_asid`](Tlb::invalidate_asid) drops one ASID's non-global
//!   entries and walk-cache entries at every level.
//! - [`invalidate_all`](Tlb::invalidate_all) drops every non-global entry
//!   (and global ones when asked) and every walk-cache entry.
//!
//! Each entry also remembers which address space (page-table root) it was
//! filled from. The hardware cannot see that, and uses an entry by its
//! ASID alone; the oracle uses it to catch an ASID reused for a new address
//! space while another's entries are still cached.

use std::vec::Vec;

use crate::arch::Asid;
use crate::page_size::PageSize;
use crate::pte::{Frame, PAGE_SHIFT};

/// One cached translation: of one 4 KiB page, or of a whole huge page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TlbEntry {
    /// The ASID it was filled under ([`Asid::KERNEL`] when global).
    pub asid: Asid,
    /// The page-table root of the address space it was filled from.
    pub space: u64,
    /// Virtual page number (address >> 12) of its first 4 KiB page.
    pub vpn: u64,
    /// The frame its first 4 KiB page translates to; the others follow.
    pub frame: Frame,
    /// The size of the page-table entry it was filled from.
    pub size: PageSize,
    /// Whether writes through it are allowed.
    pub writable: bool,
    /// Whether the entry already recorded a write (hardware will not walk
    /// the page table again to set the dirty bit).
    pub dirty: bool,
    /// Whether it survives address-space switches.
    pub global: bool,
}

impl TlbEntry {
    /// How many 4 KiB pages it translates.
    pub fn pages(&self) -> u64 {
        self.size.base_pages()
    }

    /// Whether it translates the page `vpn`.
    pub fn covers(&self, vpn: u64) -> bool {
        vpn.wrapping_sub(self.vpn) < self.pages()
    }

    /// The frame it translates the page `vpn` to (`vpn` covered).
    pub fn frame_at(&self, vpn: u64) -> Frame {
        Frame(self.frame.0 + vpn.wrapping_sub(self.vpn))
    }

    /// The page through which it reaches `frame`, if it does.
    pub fn page_of(&self, frame: Frame) -> Option<u64> {
        let offset = frame.0.wrapping_sub(self.frame.0);
        (offset < self.pages()).then(|| self.vpn + offset)
    }

    /// The address of the page through which it reaches `frame`, or its
    /// first page's when it does not.
    pub fn va_of(&self, frame: Frame) -> u64 {
        self.page_of(frame).unwrap_or(self.vpn) << PAGE_SHIFT
    }

    /// Whether it and `other` are the same translation (of the same pages,
    /// to the same frames, from the same address space, under the same
    /// tag), their accessed and dirty state and write permission aside.
    pub(crate) fn same_translation(&self, other: &TlbEntry) -> bool {
        self.asid == other.asid
            && self.space == other.space
            && self.vpn == other.vpn
            && self.frame == other.frame
            && self.size == other.size
            && self.global == other.global
    }

    /// Whether it and `other` translate some page in common.
    fn overlaps(&self, other: &TlbEntry) -> bool {
        self.covers(other.vpn) || other.covers(self.vpn)
    }

    /// Whether it and `other` translate their common pages differently:
    /// another frame or other permissions (the case Intel's SDM vol. 3,
    /// 4.10.2.3 leaves undefined when a page is cached both as a small and
    /// as a large translation).
    fn conflicts_with(&self, other: &TlbEntry) -> bool {
        let vpn = self.vpn.max(other.vpn);
        self.overlaps(other)
            && (self.frame_at(vpn) != other.frame_at(vpn)
                || self.writable != other.writable
                || self.space != other.space)
    }
}

/// One cached pointer to a page table (a paging-structure-cache entry):
/// walks under `asid` for addresses of `region` go straight to `table`, the
/// table at `level` on their way.
///
/// Levels count from the leaf: a level-1 table (x86's page table, reached
/// through a PDE-cache entry) maps 2 MiB, a level-2 table (a page
/// directory, through a PDPTE-cache entry) 1 GiB, a level-3 table (a
/// page-directory-pointer table, through a PML4E-cache entry) 512 GiB.
/// arm64's walk caches hold the same pointers for its levels 3, 2 and 1
/// (4 KiB granule).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WalkEntry {
    /// The ASID it was filled under.
    pub asid: Asid,
    /// The page-table root it was filled from.
    pub space: u64,
    /// The level of the table it points to: 1 (leaf) to
    /// [`WALK_LEVELS`].
    pub level: u32,
    /// The region of addresses the table maps: the virtual page number
    /// shifted right by 9 bits per level (`vpn >> (9 * level)`).
    pub region: u64,
    /// The page-table frame.
    pub table: Frame,
}

/// The levels of tables a walk caches pointers to (the root is not cached:
/// the CPU holds it in CR3 or TTBR0).
pub const WALK_LEVELS: u32 = 3;

/// The region of level-`level` table that maps virtual page `vpn`.
pub(crate) fn region_of(vpn: u64, level: u32) -> u64 {
    vpn >> (super::REGION_SHIFT * level)
}

impl WalkEntry {
    /// Whether a walk for virtual page `vpn` would use this entry (the
    /// table's region holds `vpn`).
    pub fn covers(&self, vpn: u64) -> bool {
        self.region == region_of(vpn, self.level)
    }
}

/// Which walk-cache entries a flush of one address takes with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WalkFlush {
    /// Every entry of the ASID, whatever address it serves (x86's
    /// `INVLPG`).
    WholeAsid,
    /// Only the entries a walk for that address would use, at every level
    /// (arm64's non-last-level `TLBI VAE1`/`VAE1IS`, AMD's `INVLPGB`
    /// without its final-translation-only bit).
    Covering,
}

/// Walk-cache entries per CPU, by level (real ones hold a few dozen
/// pointers to leaf tables and a handful above).
const WALK_CAPACITY: [usize; WALK_LEVELS as usize] = [16, 8, 4];

#[derive(Debug)]
pub(crate) struct Tlb {
    entries: Vec<(TlbEntry, u64)>,
    walks: Vec<(WalkEntry, u64)>,
    capacity: usize,
    clock: u64,
}

fn evict_lru<T>(list: &mut Vec<(T, u64)>, capacity: usize) {
    if list.len() >= capacity {
        if let Some(lru) = list
            .iter()
            .enumerate()
            .min_by_key(|(_, (_, t))| *t)
            .map(|(i, _)| i)
        {
            list.swap_remove(lru);
        }
    }
}

impl Tlb {
    pub(crate) fn new(capacity: usize) -> Self {
        Tlb {
            entries: Vec::with_capacity(capacity),
            walks: Vec::with_capacity(WALK_CAPACITY.iter().sum()),
            capacity: capacity.max(1),
            clock: 0,
        }
    }

    fn position(&self, asid: Asid, vpn: u64) -> Option<usize> {
        self.entries
            .iter()
            .position(|(e, _)| e.covers(vpn) && (e.global || e.asid == asid))
    }

    /// The entry the hardware uses for `vpn` under `asid` (its own or a
    /// global one), marked as most recently used.
    pub(crate) fn lookup(&mut self, asid: Asid, vpn: u64) -> Option<TlbEntry> {
        let i = self.position(asid, vpn)?;
        self.clock += 1;
        self.entries[i].1 = self.clock;
        Some(self.entries[i].0)
    }

    /// The entry [`lookup`](Self::lookup) would return, without marking
    /// it used.
    pub(crate) fn peek(&self, asid: Asid, vpn: u64) -> Option<TlbEntry> {
        self.position(asid, vpn).map(|i| self.entries[i].0)
    }

    pub(crate) fn mark_dirty(&mut self, asid: Asid, vpn: u64) {
        if let Some(i) = self.position(asid, vpn) {
            self.entries[i].0.dirty = true;
        }
    }

    pub(crate) fn remove(&mut self, asid: Asid, vpn: u64) {
        if let Some(i) = self.position(asid, vpn) {
            self.entries.swap_remove(i);
        }
    }

    /// Caches `entry`, replacing one of the same page and size and evicting
    /// the least recently used entry when full. Entries of another size
    /// that overlap it stay, as in hardware; the first one (same ASID, or
    /// global) that translates a common page differently is returned: the
    /// TLB now holds two differing translations for one address.
    pub(crate) fn insert(&mut self, entry: TlbEntry) -> Option<TlbEntry> {
        let same_tag = |e: &TlbEntry| e.global == entry.global && (e.global || e.asid == entry.asid);
        self.entries
            .retain(|(e, _)| !(same_tag(e) && e.vpn == entry.vpn && e.size == entry.size));
        let conflict = self
            .entries
            .iter()
            .map(|(e, _)| *e)
            .find(|e| same_tag(e) && e.conflicts_with(&entry));
        evict_lru(&mut self.entries, self.capacity);
        self.clock += 1;
        self.entries.push((entry, self.clock));
        conflict
    }

    /// The cached pointer to the level-`level` table for `region` of the
    /// address space `space` under `asid` (the simulated machine keeps the
    /// user and the kernel half in two roots, so the root tells the halves
    /// apart).
    pub(crate) fn walk_lookup(
        &mut self,
        asid: Asid,
        space: u64,
        level: u32,
        region: u64,
    ) -> Option<WalkEntry> {
        let i = self.walks.iter().position(|(w, _)| {
            w.asid == asid && w.space == space && w.level == level && w.region == region
        })?;
        self.clock += 1;
        self.walks[i].1 = self.clock;
        Some(self.walks[i].0)
    }

    /// Caches a pointer to a table, evicting the least recently used one
    /// of its level when that level's cache is full.
    pub(crate) fn walk_insert(&mut self, entry: WalkEntry) {
        self.walks.retain(|(w, _)| {
            !(w.asid == entry.asid
                && w.space == entry.space
                && w.level == entry.level
                && w.region == entry.region)
        });
        let capacity = usize::try_from(entry.level)
            .ok()
            .and_then(|l| WALK_CAPACITY.get(l.wrapping_sub(1)))
            .copied()
            .unwrap_or(1);
        let same_level = self.walks.iter().filter(|(w, _)| w.level == entry.level).count();
        if same_level >= capacity {
            if let Some(lru) = self
                .walks
                .iter()
                .enumerate()
                .filter(|(_, (w, _))| w.level == entry.level)
                .min_by_key(|(_, (_, t))| *t)
                .map(|(i, _)| i)
            {
                self.walks.swap_remove(lru);
            }
        }
        self.clock += 1;
        self.walks.push((entry, self.clock));
    }

    /// Drops every entry that translates `vpn` filled under `asid` (of any
    /// size: a huge one whatever page of it `vpn` is), a global one too
    /// when `include_global`, and the walk-cache entries of `asid` that
    /// `walks` names.
    ///
    /// What the hardware guarantees, and so what the callers pass:
    ///
    /// - x86 `INVLPG` ([`WalkFlush::WholeAsid`]): Intel SDM vol. 3A,
    ///   4.10.4.1 ("Operations that Invalidate TLBs and Paging-Structure
    ///   Caches"): besides the TLB entries for the page (of the current
    ///   PCID, and global ones), it invalidates every paging-structure-cache
    ///   entry of the current PCID, for any linear address.
    /// - x86 `INVPCID` individual-address (an ASID not loaded)
    ///   ([`WalkFlush::Covering`]): the same section says it invalidates
    ///   the mappings for that address and PCID; that it drops the PCID's
    ///   other paging-structure-cache entries too was not confirmed from
    ///   the manual's text, so the mock keeps the narrower rule.
    /// - arm64 `TLBI VAE1`/`VAE1IS` ([`WalkFlush::Covering`]): Arm ARM
    ///   (DDI 0487), "TLB maintenance instructions": a TLBI by
    ///   VA without the last-level hint invalidates cached entries from
    ///   any level of the walk that translates that VA (for that ASID, and
    ///   global ones); the last-level forms (`VALE1`, `VALE1IS`) drop no
    ///   walk-cache entry. The crate's `aarch64` `Arch` issues only the
    ///   non-last-level forms, so the mock models no last-level flush.
    /// - AMD `INVLPGB` without the final-translation-only bit (AMD APM
    ///   vol. 3, `INVLPGB`) ([`WalkFlush::Covering`]): the upper-level
    ///   entries for that address go with the TLB entry.
    pub(crate) fn invalidate_va(&mut self, asid: Asid, vpn: u64, include_global: bool, walks: WalkFlush) {
        self.entries.retain(|(e, _)| {
            !(e.covers(vpn) && ((e.global && include_global) || (!e.global && e.asid == asid)))
        });
        self.walks
            .retain(|(w, _)| !(w.asid == asid && (walks == WalkFlush::WholeAsid || w.covers(vpn))));
    }

    /// [`invalidate_va`](Self::invalidate_va) with a level hint `leaf` as
    /// arm64's FEAT_TTL may take it: only entries of exactly that size go,
    /// and no walk-cache entry (a hint names a leaf; the Arm ARM requires
    /// nothing to be invalidated when it is wrong). `None` is
    /// `invalidate_va`.
    pub(crate) fn invalidate_va_hinted(
        &mut self,
        asid: Asid,
        vpn: u64,
        include_global: bool,
        walks: WalkFlush,
        leaf: Option<PageSize>,
    ) {
        let Some(size) = leaf else {
            return self.invalidate_va(asid, vpn, include_global, walks);
        };
        self.entries.retain(|(e, _)| {
            !(e.size == size
                && e.covers(vpn)
                && ((e.global && include_global) || (!e.global && e.asid == asid)))
        });
    }

    /// [`invalidate_va_all_asids`](Self::invalidate_va_all_asids) with a
    /// level hint, as for [`invalidate_va_hinted`](Self::invalidate_va_hinted).
    pub(crate) fn invalidate_va_all_asids_hinted(&mut self, vpn: u64, leaf: Option<PageSize>) {
        match leaf {
            None => self.invalidate_va_all_asids(vpn),
            Some(size) => self.entries.retain(|(e, _)| !(e.size == size && e.covers(vpn))),
        }
    }

    /// Drops every entry for `vpn`, of every ASID and global (arm64's
    /// `TLBI VAAE1IS`), and every walk-cache entry, of any ASID, that a
    /// walk for `vpn` would use.
    pub(crate) fn invalidate_va_all_asids(&mut self, vpn: u64) {
        self.entries.retain(|(e, _)| !e.covers(vpn));
        self.walks.retain(|(w, _)| !w.covers(vpn));
    }

    /// Drops the non-global entries and the walk-cache entries of `asid`.
    pub(crate) fn invalidate_asid(&mut self, asid: Asid) {
        self.entries.retain(|(e, _)| e.global || e.asid != asid);
        self.walks.retain(|(w, _)| w.asid != asid);
    }

    /// Drops every non-global entry (and global ones too when asked) and
    /// the whole walk cache.
    pub(crate) fn invalidate_all(&mut self, include_global: bool) {
        self.entries.retain(|(e, _)| e.global && !include_global);
        self.walks.clear();
    }

    /// Forgets everything.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.walks.clear();
        self.clock = 0;
    }

    /// Every cached translation.
    pub(crate) fn entries(&self) -> impl Iterator<Item = &TlbEntry> {
        self.entries.iter().map(|(e, _)| e)
    }

    /// Every cached pointer to a page table, at every level.
    pub(crate) fn walks(&self) -> impl Iterator<Item = &WalkEntry> {
        self.walks.iter().map(|(w, _)| w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(asid: u16, vpn: u64, global: bool) -> TlbEntry {
        TlbEntry {
            asid: if global {
                Asid::KERNEL
            } else {
                Asid::new(asid).unwrap()
            },
            space: 1,
            vpn,
            frame: Frame(vpn + 100),
            size: PageSize::SIZE_4K,
            writable: true,
            dirty: false,
            global,
        }
    }

    fn a(v: u16) -> Asid {
        Asid::new(v).unwrap()
    }

    #[test]
    fn lru_eviction_and_tagged_lookup() {
        let mut t = Tlb::new(2);
        t.insert(entry(1, 10, false));
        t.insert(entry(1, 11, false));
        assert!(t.lookup(a(1), 10).is_some());
        t.insert(entry(1, 12, false)); // evicts 11, the least recently used
        assert!(t.lookup(a(1), 11).is_none());
        assert!(t.lookup(a(2), 10).is_none());
        assert!(t.lookup(a(1), 12).is_some());
    }

    #[test]
    fn invalidation_is_as_narrow_as_the_hardware_promises() {
        let mut t = Tlb::new(8);
        t.insert(entry(1, 10, false));
        t.insert(entry(2, 10, false));
        t.insert(entry(0, 10, true));
        // INVLPG in ASID 1: its own entry and the global one, not ASID 2's.
        t.invalidate_va(a(1), 10, true, WalkFlush::Covering);
        assert_eq!(t.entries().map(|e| e.asid).collect::<Vec<_>>(), [a(2)]);
        t.insert(entry(0, 20, true));
        // INVPCID by address in ASID 2: global entries stay.
        t.invalidate_va(a(2), 10, false, WalkFlush::Covering);
        assert_eq!(t.entries().count(), 1);
        t.invalidate_all(false);
        assert_eq!(t.entries().count(), 1, "global entries survive");
        t.invalidate_asid(a(1));
        assert_eq!(t.entries().count(), 1);
        t.invalidate_all(true);
        assert_eq!(t.entries().count(), 0);
    }

    fn walk(asid: u16, level: u32, region: u64) -> WalkEntry {
        WalkEntry {
            asid: a(asid),
            space: 1,
            level,
            region,
            table: Frame(region + 1000 * u64::from(level)),
        }
    }

    #[test]
    fn walk_cache_entries_go_with_their_asid_and_region() {
        let mut t = Tlb::new(8);
        t.walk_insert(walk(1, 1, 0));
        t.walk_insert(walk(1, 1, 1));
        t.walk_insert(walk(2, 1, 0));
        // A page of region 0 in ASID 1, by address: only that pointer goes.
        t.invalidate_va(a(1), 5, true, WalkFlush::Covering);
        assert!(t.walk_lookup(a(1), 1, 1, 0).is_none());
        assert!(t.walk_lookup(a(1), 1, 1, 1).is_some() && t.walk_lookup(a(2), 1, 1, 0).is_some());
        t.invalidate_asid(a(2));
        assert!(t.walk_lookup(a(2), 1, 1, 0).is_none());
        t.invalidate_all(false);
        assert_eq!(t.walks().count(), 0);
    }

    #[test]
    fn a_flush_by_address_takes_the_upper_levels_on_its_way_and_invlpg_takes_all() {
        let mut t = Tlb::new(8);
        // Pointers for the page at vpn 0 at every level, and for another
        // GiB (vpn 1 << 18) under the same level-3 table.
        let far = 1u64 << 18;
        for level in 1..=WALK_LEVELS {
            t.walk_insert(walk(1, level, region_of(0, level)));
            t.walk_insert(walk(1, level, region_of(far, level)));
        }
        assert_eq!(t.walks().count(), 5, "the level-3 pointer is shared");
        // arm64 TLBI VAE1 for vpn 0: its leaf, level-2 and level-3 pointers.
        t.invalidate_va(a(1), 0, true, WalkFlush::Covering);
        let left: Vec<(u32, u64)> = t.walks().map(|w| (w.level, w.region)).collect();
        assert_eq!(left.len(), 2);
        assert!(left.contains(&(1, far >> 9)) && left.contains(&(2, 1)));
        // Another ASID's INVLPG leaves them; this one's takes them all.
        t.invalidate_va(a(2), far, true, WalkFlush::WholeAsid);
        assert_eq!(t.walks().count(), 2);
        t.invalidate_va(a(1), 12345, true, WalkFlush::WholeAsid);
        assert_eq!(t.walks().count(), 0);
        // VAAE1IS: every ASID's pointers on the way to the page.
        t.walk_insert(walk(1, 2, 0));
        t.walk_insert(walk(2, 3, 0));
        t.walk_insert(walk(2, 2, 1));
        t.invalidate_va_all_asids(5);
        assert_eq!(
            t.walks().map(|w| (w.level, w.region)).collect::<Vec<_>>(),
            [(2, 1)]
        );
    }

    #[test]
    fn each_level_evicts_its_own_least_recently_used() {
        let mut t = Tlb::new(8);
        t.walk_insert(walk(1, 3, 0));
        for region in 0..40 {
            t.walk_insert(walk(1, 1, region));
        }
        assert_eq!(t.walks().filter(|w| w.level == 1).count(), 16);
        assert!(
            t.walk_lookup(a(1), 1, 3, 0).is_some(),
            "leaf pointers do not evict it"
        );
    }
}
