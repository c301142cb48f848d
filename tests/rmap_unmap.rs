//! Reverse-map unmapping against the mock machine: every SwapResult,
//! shared frames, mlock, young pages, migration and hwpoison entries,
//! batched versus unbatched runs, page_referenced, and contract rule 5. The
//! dirty bit's races with the clear are in `rmap_dirty.rs`, the typed layer
//! and the edges of the traits a kernel implements in `rmap_traits.rs`.

mod common;

use std::ops::ControlFlow;

use common::bounded_rmap::{map, rmap, touch, Map};
use common::{asid, config, va};
use tlb_batch::arch::mock::{Fault, MockMachine, MockSpace, Model, NoRewalk, Violation};
use tlb_batch::{
    change_protection, page_referenced, try_to_unmap, Frame, Mapping, MappingFlags, PageTable, Pte, PteFlags,
    Rmap, SwapResult, TlbFlushUnmapBatch, TtuFlags,
};

#[test]
fn unmapping_from_the_only_cpu_flushes_at_once_and_succeeds() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &space, f, 0, true, MappingFlags::empty());
    touch(&m, 0, space.mm(), 0, true);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let r = try_to_unmap(&cpu0, &rm, f, TtuFlags::BATCH_FLUSH, &mut batch).unwrap();
    // Nothing remote to save: flushed locally at once, no IPI, no batch.
    assert_eq!(r, SwapResult::Success);
    assert!(batch.is_empty());
    assert_eq!(m.ipis_sent(), 0);
    assert!(m.frame_dirty(f).unwrap(), "the dirty bit moved to the frame");
    assert_eq!(m.cached_translations(f), []);
}

#[test]
fn a_deferred_dirty_mapping_gives_success_cached_and_a_clean_one_success() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let (dirty, clean) = (m.alloc_frame().unwrap(), m.alloc_frame().unwrap());
    map(&m, &mut rm, &space, dirty, 0, true, MappingFlags::empty());
    map(&m, &mut rm, &space, clean, 1, false, MappingFlags::empty());
    touch(&m, 1, space.mm(), 0, true);
    touch(&m, 1, space.mm(), 1, false);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(&cpu0, &rm, dirty, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::SuccessCached)
    );
    assert_eq!(
        try_to_unmap(&cpu0, &rm, clean, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::Success)
    );
    // Both were deferred: CPU 1 still caches them until the flush.
    assert_eq!(batch.pending_pages(), 2);
    assert_eq!(m.cached_translations(dirty).len(), 1);
    assert_eq!(m.ipis_sent(), 0);
    batch.flush(&cpu0).unwrap();
    assert_eq!(m.ipis_sent(), 1);
    assert!(m.frame_dirty(dirty).unwrap() && !m.frame_dirty(clean).unwrap());
    m.free_frame(dirty).unwrap();
    m.free_frame(clean).unwrap();
    assert_eq!(m.violations(), []);
}

/// An rmap whose walk races with a fault that maps the frame again right
/// after the walk passed it.
struct Refaulting<'a, M: Model> {
    inner: &'a Map<'a, M>,
    space: &'a MockSpace<'a, M>,
    page: usize,
}

// SAFETY: delegates to the bounded rmap, which knows every mapping; the
// re-installed PTE is one of those mappings.
unsafe impl<'a, M: Model> Rmap for Refaulting<'a, M> {
    type Space = MockSpace<'a, M>;
    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        let flow = self.inner.walk(frame, visit);
        // The fault comes after the unmap: only a cleared entry is refilled.
        if self.space.lookup(va(self.page)) == Pte::EMPTY {
            self.space.set(
                va(self.page),
                Pte::new(frame, PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::USER),
            );
        }
        flow
    }
    fn set_dirty(&self, frame: Frame) {
        self.inner.set_dirty(frame)
    }
}

#[test]
fn a_mapping_that_reappears_gives_again_and_again_cached() {
    for (write, expected) in [(false, SwapResult::Again), (true, SwapResult::AgainCached)] {
        let m = MockMachine::new(config(2, 64)).unwrap();
        let space = m.space(&m.new_mm(asid(1)).unwrap());
        let mut rm = rmap(&m);
        let f = m.alloc_frame().unwrap();
        // Read-only and clean, or writable and dirty: only the latter can
        // leave a writable TLB entry behind.
        map(&m, &mut rm, &space, f, 0, write, MappingFlags::empty());
        touch(&m, 1, space.mm(), 0, write);
        let racing = Refaulting {
            inner: &rm,
            space: &space,
            page: 0,
        };
        let cpu0 = m.cpu(0).unwrap();
        let mut batch = TlbFlushUnmapBatch::new();
        assert_eq!(
            try_to_unmap(&cpu0, &racing, f, TtuFlags::BATCH_FLUSH, &mut batch),
            Ok(expected)
        );
        assert_eq!(rm.mapcount(f), 1);
        // The removal it did make is owed by the batch.
        assert_eq!(batch.pending_pages(), 1);
        batch.flush(&cpu0).unwrap();
    }
}

#[test]
fn a_young_mapping_fails_once_and_loses_its_accessed_bit() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &space, f, 0, true, MappingFlags::empty());
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(space.mm()).unwrap();
    cpu1.write(va(0), 1).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::Fail)
    );
    let pte = m.pte(space.mm(), va(0)).unwrap();
    assert!(pte.maps(f) && !pte.is_accessed());
    // x86 needs no flush for the cleared bit: nothing pending, no IPI.
    assert!(batch.is_empty());
    // The next try finds it old; IGNORE_ACCESS would have skipped the check.
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::SuccessCached)
    );
    batch.flush(&cpu0).unwrap();
}

#[test]
fn mlocked_mappings_stop_the_walk_unless_ignored() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (a, b) = (
        m.space(&m.new_mm(asid(1)).unwrap()),
        m.space(&m.new_mm(asid(2)).unwrap()),
    );
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &a, f, 0, true, MappingFlags::SHARED);
    map(
        &m,
        &mut rm,
        &b,
        f,
        0,
        true,
        MappingFlags::SHARED | MappingFlags::LOCKED,
    );
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
    // MUNLOCK only asks: locked somewhere, so Mlock, and nothing unmapped.
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, flags | TtuFlags::MUNLOCK, &mut batch),
        Ok(SwapResult::Mlock)
    );
    assert_eq!(rm.mapcount(f), 2);
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, flags, &mut batch),
        Ok(SwapResult::Mlock)
    );
    // The walk reached the locked mapping after removing the unlocked one.
    assert_eq!(rm.mapcount(f), 1);
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, flags | TtuFlags::IGNORE_MLOCK, &mut batch),
        Ok(SwapResult::Success)
    );
    assert_eq!(rm.mapcount(f), 0);
    // With no lock left, MUNLOCK answers Again.
    rm.set_flags(f, &b, va(0), MappingFlags::SHARED);
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, flags | TtuFlags::MUNLOCK, &mut batch),
        Ok(SwapResult::Again)
    );
    batch.flush(&cpu0).unwrap();
}

#[test]
fn a_frame_shared_by_several_address_spaces_costs_one_ipi_per_cpu() {
    // Three address spaces, each running on two CPUs; CPU 6 reclaims ten
    // frames that all three share.
    const FRAMES: usize = 10;
    let m = MockMachine::new(config(7, 64)).unwrap();
    let spaces: Vec<_> = (0..3).map(|i| m.space(&m.new_mm(asid(i + 1)).unwrap())).collect();
    let mut rm = rmap(&m);
    let frames: Vec<_> = (0..FRAMES).map(|_| m.alloc_frame().unwrap()).collect();
    for (s, space) in spaces.iter().enumerate() {
        for (i, &f) in frames.iter().enumerate() {
            map(&m, &mut rm, space, f, i, true, MappingFlags::SHARED);
        }
        for cpu in [2 * s, 2 * s + 1] {
            for i in 0..FRAMES {
                touch(&m, cpu, space.mm(), i, true);
            }
        }
    }
    let reclaimer = m.cpu(6).unwrap();
    let before = m.stats();
    let mut batch = TlbFlushUnmapBatch::new();
    for &f in &frames {
        assert_eq!(
            try_to_unmap(&reclaimer, &rm, f, TtuFlags::BATCH_FLUSH, &mut batch),
            Ok(SwapResult::SuccessCached)
        );
    }
    assert_eq!(batch.targets().len(), 6);
    let report = batch.flush(&reclaimer).unwrap();
    assert_eq!(report.ipis_sent, 6);
    assert_eq!(m.stats().since(&before).ipis_sent, 6);
    // Unbatched, the same work costs a shootdown per mapping: 2 IPIs each.
    assert_eq!(m.stale_entries(), []);
    for f in frames {
        assert!(m.frame_dirty(f).unwrap());
        m.free_frame(f).unwrap();
    }
    assert_eq!(m.violations(), []);
}

#[test]
fn migration_installs_entries_that_name_the_frame_and_fault() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let (w, r) = (m.alloc_frame().unwrap(), m.alloc_frame().unwrap());
    map(&m, &mut rm, &space, w, 0, true, MappingFlags::empty());
    map(&m, &mut rm, &space, r, 1, false, MappingFlags::empty());
    touch(&m, 1, space.mm(), 0, true);
    touch(&m, 1, space.mm(), 1, false);
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let flags = TtuFlags::MIGRATION | TtuFlags::BATCH_FLUSH;
    assert_eq!(
        try_to_unmap(&cpu0, &rm, w, flags, &mut batch),
        Ok(SwapResult::SuccessCached)
    );
    assert_eq!(
        try_to_unmap(&cpu0, &rm, r, flags, &mut batch),
        Ok(SwapResult::Success)
    );
    batch.flush(&cpu0).unwrap();
    let (pw, pr) = (
        m.pte(space.mm(), va(0)).unwrap(),
        m.pte(space.mm(), va(1)).unwrap(),
    );
    assert!(pw.is_migration() && pw.frame() == w && pw.flags().contains(PteFlags::WAS_WRITABLE));
    assert!(pr.is_migration() && pr.frame() == r && !pr.flags().contains(PteFlags::WAS_WRITABLE));
    let cpu1 = m.cpu(1).unwrap();
    assert_eq!(cpu1.write(va(0), 5), Err(Fault::Migration { va: va(0) }));
    assert_eq!(cpu1.read(va(1)), Err(Fault::Migration { va: va(1) }));
    assert_eq!(
        m.frame_data(w),
        Ok(101),
        "nothing wrote the frame after the unmap"
    );
}

#[test]
fn poisoned_frames_get_hwpoison_entries_unless_ignored() {
    for (ignore, poisoned_entry) in [(false, true), (true, false)] {
        let m = MockMachine::new(config(1, 64)).unwrap();
        let space = m.space(&m.new_mm(asid(1)).unwrap());
        let mut rm = rmap(&m);
        let f = m.alloc_frame().unwrap();
        map(&m, &mut rm, &space, f, 0, true, MappingFlags::empty());
        m.poison_frame(f).unwrap();
        let mut flags = TtuFlags::IGNORE_ACCESS;
        if ignore {
            flags |= TtuFlags::IGNORE_HWPOISON;
        }
        let mut batch = TlbFlushUnmapBatch::new();
        let cpu0 = m.cpu(0).unwrap();
        assert_eq!(
            try_to_unmap(&cpu0, &rm, f, flags, &mut batch),
            Ok(SwapResult::Success)
        );
        assert_eq!(m.pte(space.mm(), va(0)).unwrap().is_hwpoison(), poisoned_entry);
        cpu0.switch_to(space.mm()).unwrap();
        let expected = if poisoned_entry {
            Fault::HwPoison { va: va(0) }
        } else {
            Fault::NotMapped { va: va(0) }
        };
        assert_eq!(cpu0.read(va(0)), Err(expected));
    }
}

/// The observable end state of a run: every PTE and every frame's dirty
/// flag and data.
fn end_state<M: Model>(m: &MockMachine<M>, spaces: &[MockSpace<'_, M>], frames: &[Frame]) -> Vec<String> {
    let mut out = Vec::new();
    for s in spaces {
        for i in 0..frames.len() {
            out.push(format!("{:?}", m.pte(s.mm(), va(i)).unwrap()));
        }
    }
    for &f in frames {
        out.push(format!(
            "{f:?} dirty={} data={}",
            m.frame_dirty(f).unwrap(),
            m.frame_data(f).unwrap()
        ));
    }
    out
}

/// One reclaim sequence: two address spaces on CPUs 0-3 share 40 frames,
/// half of them written; CPU 4 unmaps them all (with or without batching),
/// flushes, writes the dirty ones out and frees them.
fn reclaim_sequence(batched: bool) -> (Vec<String>, u64) {
    const FRAMES: usize = 40;
    let m = MockMachine::new(config(5, 128)).unwrap();
    let spaces: Vec<_> = (0..2).map(|i| m.space(&m.new_mm(asid(i + 1)).unwrap())).collect();
    let mut rm = rmap(&m);
    let frames: Vec<_> = (0..FRAMES).map(|_| m.alloc_frame().unwrap()).collect();
    for (s, space) in spaces.iter().enumerate() {
        for (i, &f) in frames.iter().enumerate() {
            map(&m, &mut rm, space, f, i, true, MappingFlags::SHARED);
            for cpu in [2 * s, 2 * s + 1] {
                touch(&m, cpu, space.mm(), i, i % 2 == 0);
            }
        }
    }
    let reclaimer = m.cpu(4).unwrap();
    let flags = if batched {
        TtuFlags::BATCH_FLUSH
    } else {
        TtuFlags::empty()
    };
    let mut batch = TlbFlushUnmapBatch::new();
    for &f in &frames {
        let r = try_to_unmap(&reclaimer, &rm, f, flags, &mut batch).unwrap();
        assert!(r.is_unmapped());
        assert_eq!(r.is_cached(), batched);
    }
    batch.flush_dirty(&reclaimer).unwrap();
    for &f in frames.iter().filter(|&&f| m.frame_dirty(f).unwrap()) {
        m.start_io(f).unwrap();
        m.end_io(f).unwrap();
    }
    let state = end_state(&m, &spaces, &frames);
    batch.flush(&reclaimer).unwrap();
    for &f in &frames {
        m.free_frame(f).unwrap();
    }
    assert_eq!(m.violations(), []);
    (state, m.stats().ipis_sent)
}

#[test]
fn batched_and_unbatched_runs_end_in_the_same_state_with_fewer_ipis() {
    let (batched_state, batched_ipis) = reclaim_sequence(true);
    let (plain_state, plain_ipis) = reclaim_sequence(false);
    assert_eq!(batched_state, plain_state);
    // Unbatched: 40 frames x 2 address spaces x 2 CPUs. Batched: one flush
    // point (the dirty flush) reaching 4 CPUs.
    assert_eq!(plain_ipis, 160);
    assert_eq!(batched_ipis, 4);
}

#[test]
fn page_referenced_counts_and_clears_without_ipis_on_x86() {
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (a, b) = (
        m.space(&m.new_mm(asid(1)).unwrap()),
        m.space(&m.new_mm(asid(2)).unwrap()),
    );
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &a, f, 0, true, MappingFlags::SHARED);
    map(&m, &mut rm, &b, f, 3, true, MappingFlags::SHARED);
    for (cpu, space, page) in [(1, &a, 0), (2, &b, 3)] {
        let c = m.cpu(cpu).unwrap();
        c.switch_to(space.mm()).unwrap();
        c.read(va(page)).unwrap();
    }
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    let r = page_referenced(&cpu0, &rm, f, &mut batch).unwrap();
    assert_eq!((r.referenced, r.mapped, r.mlocked), (2, 2, false));
    assert!(batch.is_empty(), "x86 clears accessed bits without a flush");
    assert_eq!(m.ipis_sent(), 0);
    // Cleared: a second look finds the page old.
    assert_eq!(page_referenced(&cpu0, &rm, f, &mut batch).unwrap().referenced, 0);
    // An mlocked mapping is reported and stops the walk.
    rm.set_flags(f, &b, va(3), MappingFlags::LOCKED);
    assert!(page_referenced(&cpu0, &rm, f, &mut batch).unwrap().mlocked);
}

#[test]
fn page_referenced_batches_its_flushes_where_clearing_needs_one() {
    let m = MockMachine::<NoRewalk>::with_model(config(3, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let frames: Vec<_> = (0..5).map(|_| m.alloc_frame().unwrap()).collect();
    for (i, &f) in frames.iter().enumerate() {
        map(&m, &mut rm, &space, f, i, true, MappingFlags::empty());
        for cpu in [1, 2] {
            let c = m.cpu(cpu).unwrap();
            if c.current_mm().is_none() {
                c.switch_to(space.mm()).unwrap();
            }
            c.read(va(i)).unwrap();
        }
    }
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    for &f in &frames {
        assert_eq!(page_referenced(&cpu0, &rm, f, &mut batch).unwrap().referenced, 1);
    }
    // Five frames, one flush point: one IPI per CPU caching them.
    assert_eq!(m.ipis_sent(), 0);
    assert_eq!(batch.pending_pages(), 5);
    assert!(!batch.has_writable() && !space.mm().batched_flush_pending());
    assert_eq!(batch.flush(&cpu0).unwrap().ipis_sent, 2);
    assert_eq!(m.all_entries(), []);
}

#[test]
fn skipping_the_accessed_flush_misjudges_age_but_loses_no_data() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let space = m.space(&m.new_mm(asid(1)).unwrap());
    let mut rm = rmap(&m);
    let f = m.alloc_frame().unwrap();
    map(&m, &mut rm, &space, f, 0, true, MappingFlags::empty());
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(space.mm()).unwrap();
    cpu1.write(va(0), 1).unwrap();
    let cpu0 = m.cpu(0).unwrap();
    let mut batch = TlbFlushUnmapBatch::new();
    assert_eq!(page_referenced(&cpu0, &rm, f, &mut batch).unwrap().referenced, 1);
    // CPU 1 keeps using the page through its cached entry: the accessed bit
    // is not set again, so the page looks unused although it is hot.
    cpu1.write(va(0), 2).unwrap();
    assert_eq!(page_referenced(&cpu0, &rm, f, &mut batch).unwrap().referenced, 0);
    // The reclaimer acts on that wrong age; the data survives all the same.
    assert_eq!(
        try_to_unmap(&cpu0, &rm, f, TtuFlags::BATCH_FLUSH, &mut batch),
        Ok(SwapResult::SuccessCached)
    );
    cpu1.write(va(0), 3).unwrap(); // still allowed: before the flush point
    batch.flush_dirty(&cpu0).unwrap();
    assert!(cpu1.write(va(0), 4).is_err(), "no write after the dirty flush");
    assert!(m.frame_dirty(f).unwrap());
    m.start_io(f).unwrap();
    assert_eq!(
        m.frame_data(f),
        Ok(3),
        "the last write before the flush is what goes to disk"
    );
    m.end_io(f).unwrap();
    m.free_frame(f).unwrap();
    assert_eq!(m.violations(), []);
}

/// mprotect done without contract rule 5: walks the range, changes present
/// PTEs, flushes what it changed, but ignores a pending batched flush.
fn mprotect_ignoring_pending_batches<M: Model>(m: &MockMachine<M>, space: &MockSpace<'_, M>, pages: usize) {
    let cpu0 = m.cpu(0).unwrap();
    for i in 0..pages {
        let pte = space.lookup(va(i));
        if pte.is_present() {
            let old = space.clear(va(i));
            space.set(va(i), Pte(old.0 & !PteFlags::WRITABLE.bits()));
            tlb_batch::flush_tlb_page(&cpu0, space.tlb_state(), va(i)).unwrap();
        }
    }
}

#[test]
fn mprotect_flushes_a_pending_batch_first() {
    for with_rule_5 in [false, true] {
        let m = MockMachine::new(config(3, 64)).unwrap();
        let space = m.space(&m.new_mm(asid(1)).unwrap());
        let mut rm = rmap(&m);
        let frames: Vec<_> = (0..2).map(|_| m.alloc_frame().unwrap()).collect();
        for (i, &f) in frames.iter().enumerate() {
            map(&m, &mut rm, &space, f, i, true, MappingFlags::empty());
            touch(&m, 1, space.mm(), i, true);
        }
        // The reclaimer on CPU 2 unmaps page 0 and defers the flush.
        let reclaimer = m.cpu(2).unwrap();
        let mut batch = TlbFlushUnmapBatch::new();
        assert_eq!(
            try_to_unmap(&reclaimer, &rm, frames[0], TtuFlags::BATCH_FLUSH, &mut batch),
            Ok(SwapResult::SuccessCached)
        );
        // The owner write-protects both pages.
        if with_rule_5 {
            let n = change_protection(&m.cpu(0).unwrap(), &space, common::pages(0, 2), |p| {
                Pte(p.0 & !PteFlags::WRITABLE.bits())
            })
            .unwrap();
            assert_eq!(n, 1, "only page 1 was still mapped");
        } else {
            mprotect_ignoring_pending_batches(&m, &space, 2);
        }
        let stale = m.check_coherent(space.mm(), common::pages(0, 2));
        let write = m.cpu(1).unwrap().write(va(0), 9);
        if with_rule_5 {
            assert_eq!(stale, 0);
            assert_eq!(m.violations(), []);
            assert_eq!(write, Err(Fault::NotMapped { va: va(0) }));
        } else {
            // CPU 1 can still write the page after mprotect returned.
            assert_eq!(stale, 1);
            assert_eq!(
                m.violations(),
                [Violation::StaleAfterChange {
                    cpu: m.cpu(1).unwrap().id(),
                    va: va(0),
                    writable: true
                }]
            );
            assert_eq!(write, Ok(()));
        }
        assert!(
            m.cpu(1).unwrap().write(va(1), 9).is_err(),
            "page 1 is read-only now"
        );
        batch.flush(&reclaimer).unwrap();
    }
}
