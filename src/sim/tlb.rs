//! One simulated CPU's TLB: bounded, least-recently-used eviction, tagged
//! by ASID, with global entries and a cached dirty state per entry.

use std::vec::Vec;

use crate::arch::Asid;
use crate::pte::Frame;

/// One cached translation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TlbEntry {
    /// The address space it was filled for ([`Asid::KERNEL`] when global).
    pub asid: Asid,
    /// Virtual page number (address >> 12).
    pub vpn: u64,
    /// The frame it translates to.
    pub frame: Frame,
    /// Whether writes through it are allowed.
    pub writable: bool,
    /// Whether the entry already recorded a write (hardware will not walk
    /// the page table again to set the dirty bit).
    pub dirty: bool,
    /// Whether it survives address-space switches.
    pub global: bool,
}

#[derive(Debug)]
pub(crate) struct Tlb {
    entries: Vec<(TlbEntry, u64)>,
    capacity: usize,
    clock: u64,
}

impl Tlb {
    pub(crate) fn new(capacity: usize) -> Self {
        Tlb {
            entries: Vec::with_capacity(capacity),
            capacity: capacity.max(1),
            clock: 0,
        }
    }

    fn position(&self, asid: Asid, vpn: u64) -> Option<usize> {
        self.entries
            .iter()
            .position(|(e, _)| e.vpn == vpn && (e.global || e.asid == asid))
    }

    /// The entry translating `vpn` for `asid` (or a global one), marked as
    /// most recently used.
    pub(crate) fn lookup(&mut self, asid: Asid, vpn: u64) -> Option<TlbEntry> {
        let i = self.position(asid, vpn)?;
        self.clock += 1;
        self.entries[i].1 = self.clock;
        Some(self.entries[i].0)
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

    /// Caches `entry`, replacing one for the same page and evicting the
    /// least recently used entry when full.
    pub(crate) fn insert(&mut self, entry: TlbEntry) {
        self.remove(entry.asid, entry.vpn);
        if self.entries.len() >= self.capacity {
            if let Some(lru) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(i, _)| i)
            {
                self.entries.swap_remove(lru);
            }
        }
        self.clock += 1;
        self.entries.push((entry, self.clock));
    }

    /// invlpg: drops the entry for `vpn` in `asid`, and a global one for
    /// that page (x86 invlpg drops global entries too).
    pub(crate) fn flush_page(&mut self, asid: Asid, vpn: u64) {
        self.entries
            .retain(|(e, _)| !(e.vpn == vpn && (e.global || e.asid == asid || asid.is_kernel())));
    }

    /// Drops the non-global entries of `asid`.
    pub(crate) fn flush_asid(&mut self, asid: Asid) {
        self.entries.retain(|(e, _)| e.global || e.asid != asid);
    }

    /// Drops every non-global entry, and global ones too when asked.
    pub(crate) fn flush_all(&mut self, include_global: bool) {
        self.entries.retain(|(e, _)| e.global && !include_global);
    }

    /// Every cached entry.
    pub(crate) fn entries(&self) -> impl Iterator<Item = &TlbEntry> {
        self.entries.iter().map(|(e, _)| e)
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
            vpn,
            frame: Frame(vpn + 100),
            writable: true,
            dirty: false,
            global,
        }
    }

    #[test]
    fn lru_eviction_and_tagged_lookup() {
        let mut t = Tlb::new(2);
        t.insert(entry(1, 10, false));
        t.insert(entry(1, 11, false));
        assert!(t.lookup(Asid::new(1).unwrap(), 10).is_some());
        t.insert(entry(1, 12, false)); // evicts 11, the least recently used
        assert!(t.lookup(Asid::new(1).unwrap(), 11).is_none());
        assert!(t.lookup(Asid::new(2).unwrap(), 10).is_none());
        assert!(t.lookup(Asid::new(1).unwrap(), 12).is_some());
    }

    #[test]
    fn flushes_respect_global_entries() {
        let mut t = Tlb::new(8);
        t.insert(entry(1, 10, false));
        t.insert(entry(0, 20, true));
        t.flush_all(false);
        assert_eq!(t.entries().count(), 1);
        t.flush_asid(Asid::new(1).unwrap());
        assert_eq!(t.entries().count(), 1);
        t.flush_page(Asid::new(1).unwrap(), 20);
        assert_eq!(t.entries().count(), 0);
    }
}
