use core::sync::atomic::{AtomicU64, Ordering};
use std::boxed::Box;
use std::vec::Vec;

use super::{TableFrames, Walk, ENTRIES};
use crate::pte::{Frame, Pte, PteFlags, PAGE_SHIFT};
use crate::range::PageRange;

/// One 4 KiB table in host memory.
#[repr(C, align(4096))]
struct Table([AtomicU64; ENTRIES as usize]);

/// Host tables at "physical" address = host address, with one physical
/// address (`BAD`) the frames answer unusably and a root that may be
/// replaced by any address.
struct Host {
    /// Raw, from `Box::into_raw` and freed by `Drop`: no move of a `Box`
    /// invalidates the addresses handed out meanwhile (Miri checks this).
    tables: Vec<*mut Table>,
    root: Option<u64>,
    bad_answer: u64,
}

/// The physical address whose table `Host` answers with `bad_answer`.
const BAD: u64 = 0x1000;
const PRESENT: u64 = PteFlags::PRESENT.bits();

impl Host {
    fn new(bad_answer: u64) -> Self {
        let mut host = Host {
            tables: Vec::new(),
            root: None,
            bad_answer,
        };
        host.root = Some(host.table());
        host
    }

    /// A new empty table's address.
    fn table(&mut self) -> u64 {
        let table = Box::into_raw(Box::new(Table(core::array::from_fn(|_| AtomicU64::new(0)))));
        self.tables.push(table);
        table as u64
    }

    /// Sets entry `i` of the table at `table`.
    fn put(&self, table: u64, i: usize, raw: u64) {
        let t = *self.tables.iter().find(|t| **t as u64 == table).unwrap();
        // SAFETY: a live table of `tables` (freed only by `drop`).
        unsafe { (*t).0[i].store(raw, Ordering::SeqCst) };
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        for &t in &self.tables {
            // SAFETY: each came from `Box::into_raw` and is freed once; no
            // `Walk` over `self` outlives it (they borrow it).
            drop(unsafe { Box::from_raw(t) });
        }
    }
}

// SAFETY: every address it answers other than `bad_answer` (and a root the
// test replaced, which the tests set only to addresses `Walk` refuses) is a
// table of `tables`, live, 4 KiB-aligned and only accessed atomically while
// `Host` is borrowed.
unsafe impl TableFrames for Host {
    fn root_table(&self) -> Option<u64> {
        self.root
    }

    fn table_of(&self, paddr: u64) -> Option<u64> {
        Some(if paddr == BAD { self.bad_answer } else { paddr })
    }
}

#[test]
fn an_unusable_root_has_no_entries() {
    for root in [0x1008, 0xffff_ffff_ffff_f000] {
        let mut host = Host::new(0);
        host.root = Some(root);
        let walk = Walk::new(&host);
        assert_eq!(walk.lookup(0x40_0000), Pte::EMPTY);
        assert_eq!(walk.exchange(0x40_0000, Pte(0x1234_0000 | PRESENT)), Pte::EMPTY);
        assert!(!walk.test_and_clear_accessed(0x40_0000));
        let all = PageRange::new(0, 1 << 20).unwrap();
        assert_eq!(walk.next_populated(all), None);
        assert!(walk.check_no_huge(all).is_ok());
        assert!(walk.check_no_partial_huge(all).is_ok());
        assert!(walk.detach_table(all).is_none());
    }
}

#[test]
fn a_table_address_whose_page_passes_the_top_is_absent() {
    // Aligned, but the page would end past 2^64 - 1.
    let host = Host::new(0xffff_ffff_ffff_f000);
    let root = host.root.unwrap();
    host.put(root, 0, BAD | PRESENT);
    let walk = Walk::new(&host);
    assert_eq!(walk.lookup(0), Pte::EMPTY);
    assert_eq!(walk.next_populated(PageRange::new(0, 4).unwrap()), None);
}

#[test]
fn teardown_steps_over_an_unusable_table_and_unlinks_the_next() {
    let mut host = Host::new(0x1001);
    let root = host.root.unwrap();
    let l3 = host.table();
    let l2 = host.table();
    host.put(root, 0, l3 | PRESENT);
    // Entry 0 of the level-3 table names a table that cannot be reached,
    // entry 1 an empty level-2 table.
    host.put(l3, 0, BAD | PRESENT);
    host.put(l3, 1, l2 | PRESENT);
    let walk = Walk::new(&host);
    let gib = 1 << 30;
    let two_gib = PageRange::new(0, (2 * gib) >> PAGE_SHIFT).unwrap();
    let detached = walk.detach_table(two_gib).unwrap();
    assert_eq!(detached.frame, Frame(l2 >> PAGE_SHIFT));
    assert_eq!(detached.range, PageRange::new(gib, gib >> PAGE_SHIFT).unwrap());
    assert_eq!(walk.lookup(gib), Pte::EMPTY);
    // The unusable entry stays, and keeps the level-3 table attached.
    assert!(walk.detach_table(two_gib).is_none());
}

/// A 2 MiB entry takes a new 4 KiB view through `exchange` and `set` only
/// for a frame aligned to 2 MiB: an odd multiple of 2 MiB is aligned, a
/// frame 4 KiB past one is not (and leaves the entry as it was).
#[test]
fn a_huge_entry_takes_only_a_frame_aligned_to_its_size() {
    let mut host = Host::new(0);
    let root = host.root.unwrap();
    let l3 = host.table();
    let l2 = host.table();
    host.put(root, 0, l3 | PRESENT);
    host.put(l3, 0, l2 | PRESENT);
    let mib2 = 2 << 20;
    // The 2 MiB page at 2 MiB, over the frame at 4 MiB.
    host.put(l2, 1, (2 * mib2) | PRESENT | super::HUGE);
    let walk = Walk::new(&host);
    assert_eq!(walk.lookup(mib2), Pte((2 * mib2) | PRESENT));
    // 6 MiB: bit 21 set, aligned.
    assert_eq!(
        walk.exchange(mib2, Pte((3 * mib2) | PRESENT)),
        Pte((2 * mib2) | PRESENT)
    );
    assert_eq!(walk.lookup(mib2 + 0x5000), Pte((3 * mib2 + 0x5000) | PRESENT));
    // 4 MiB + 4 KiB: refused, nothing written.
    assert_eq!(
        walk.exchange(mib2, Pte((2 * mib2 + 0x1000) | PRESENT)),
        Pte::EMPTY
    );
    walk.set(mib2, Pte((2 * mib2 + 0x1000) | PRESENT));
    assert_eq!(walk.lookup(mib2), Pte((3 * mib2) | PRESENT));
    walk.set(mib2, Pte(mib2 | PRESENT));
    assert_eq!(walk.lookup(mib2), Pte(mib2 | PRESENT));
}
