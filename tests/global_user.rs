//! A user page mapped global is refused by every operation that would
//! unmap, change, age or migrate it, with nothing changed: the crate
//! flushes a user space by its ASID, which leaves global entries in the
//! TLBs, and a CPU keeps using a global entry after it switches to another
//! space. Found by a new user's trial: the batch's whole-ASID flush, a
//! tagged switch and the pool all freed frames a CPU still reached that
//! way, with every call answering `Ok`.

mod common;

use common::{asid, config, owned, va};
use tlb_batch::arch::mock::{FrameState, MockConfig, MockKernel, MockMachine, MockRmap};
use tlb_batch::{
    change_protection, migrate_pages, page_referenced, shrink_page_list, try_to_unmap, Error, MappingFlags,
    MigrateFailure, MigrateOutcome, MmuGather, PageRange, Pte, PteFlags, TableFreePolicy, TlbFlushUnmapBatch,
    TtuFlags, UnmapBatch, Verdict,
};

#[test]
fn a_global_user_entry_is_refused_everywhere_with_nothing_changed() {
    for tagged_tlb in [false, true] {
        let m = MockMachine::new(MockConfig {
            tagged_tlb,
            ..config(2, 64)
        })
        .unwrap();
        let (mm, other) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
        let rmap = MockRmap::new(&m, vec![m.space(&mm)]);
        let space = &rmap.spaces()[0];
        let f = m.alloc_frame().unwrap();
        rmap.map(f, 0, va(0), true, MappingFlags::empty()).unwrap();
        let flags = PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::USER | PteFlags::GLOBAL;
        m.set_pte(&mm, va(0), Pte::new(f, flags)).unwrap();
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        cpu1.switch_to(&mm).unwrap();
        cpu1.write(va(0), 7).unwrap();
        cpu1.switch_to(&other).unwrap();
        cpu0.switch_to(&mm).unwrap();
        let pte = m.pte(&mm, va(0)).unwrap();
        let refused = Error::GlobalUserEntry { va: va(0) };

        let mut batch = TlbFlushUnmapBatch::new();
        let ttu = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
        assert_eq!(try_to_unmap(&cpu0, &rmap, f, ttu, &mut batch), Err(refused));
        assert!(batch.is_empty());
        assert_eq!(page_referenced(&cpu0, &rmap, f, &mut batch), Err(refused));
        let mut frames = UnmapBatch::<4>::new();
        let typed = frames.try_to_unmap(&cpu0, &rmap, owned(f), TtuFlags::IGNORE_ACCESS);
        assert!(matches!(typed, Err((_, e)) if e == refused), "{typed:?}");
        let mut kernel = MockKernel::new(&rmap);
        let mut back = Vec::new();
        shrink_page_list(
            &cpu0,
            &rmap,
            &mut kernel,
            &mut frames,
            [owned(f)],
            &mut |frame, v| back.push((frame.into_frame(), v)),
        )
        .unwrap();
        assert_eq!(back, [(f, Verdict::Failed(refused))]);
        let mut moved = Vec::new();
        migrate_pages(&cpu0, &rmap, &mut kernel, &mut frames, [owned(f)], &mut |o| {
            moved.push(o)
        })
        .unwrap();
        assert!(
            matches!(&moved[..], [MigrateOutcome::Failed { reason: MigrateFailure::Failed(e), .. }] if *e == refused),
            "{moved:?}"
        );
        let page = PageRange::page(va(0)).unwrap();
        assert_eq!(change_protection(&cpu0, space, page, |p| p), Err(refused));
        let mut gather = MmuGather::<8>::new();
        let torn = gather.unmap_range(
            &cpu0,
            space,
            &mut kernel,
            common::pages(0, 512),
            true,
            &mut TableFreePolicy::AfterFlush,
            &mut |_, _| panic!("nothing handed back"),
        );
        assert_eq!(torn.unwrap_err(), refused);
        assert!(gather.is_empty());

        // Nothing changed, and nothing reached a freed frame.
        assert_eq!(m.pte(&mm, va(0)).unwrap(), pte, "tagged: {tagged_tlb}");
        assert_eq!(m.frame_state(f).unwrap(), FrameState::InUse);
        assert_eq!(m.violations(), []);
    }
}

#[test]
fn change_protection_never_makes_a_user_entry_global() {
    // Found by a new user's trial: an `update` that set GLOBAL got `Ok`,
    // and a CPU that switched to another process still read the page.
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(2, 64)
    })
    .unwrap();
    let (mm, other) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
    let f = m.map_new(&mm, va(0), true).unwrap();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu0.switch_to(&mm).unwrap();
    let space = m.space(&mm);
    let range = PageRange::page(va(0)).unwrap();
    let global = |p: Pte| Pte(p.0 | PteFlags::GLOBAL.bits());
    assert_eq!(change_protection(&cpu0, &space, range, global), Ok(0));
    let ro_global = |p: Pte| Pte((p.0 | PteFlags::GLOBAL.bits()) & !PteFlags::WRITABLE.bits());
    assert_eq!(change_protection(&cpu0, &space, range, ro_global), Ok(1));
    let pte = m.pte(&mm, va(0)).unwrap();
    assert!(pte.maps(f) && !pte.is_writable() && !pte.flags().contains(PteFlags::GLOBAL));
    cpu1.switch_to(&mm).unwrap();
    cpu1.read(va(0)).unwrap();
    cpu1.switch_to(&other).unwrap();
    assert!(
        cpu1.read(va(0)).is_err(),
        "another process does not reach the page"
    );
    assert_eq!(m.violations(), []);
}

/// Found by a new user's trial: `add_pending` is handed an entry its
/// caller has already cleared, so it cannot refuse a global one without
/// leaving it unflushed. It flushes it as a kernel page instead, on every
/// online CPU: here CPU 1, which wrote the page in the space and switched
/// to another (a flush of the space's ASID, or one of its running CPUs
/// only, left its global entry alive, and the frame was freed under it),
/// and CPU 2, which never ran the space at all.
#[test]
fn a_global_user_entry_handed_to_add_pending_is_flushed_on_every_online_cpu() {
    for tagged_tlb in [false, true] {
        let m = MockMachine::new(MockConfig {
            tagged_tlb,
            ..config(3, 64)
        })
        .unwrap();
        let (mm, other) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
        let f = m.alloc_frame().unwrap();
        let flags = PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::USER | PteFlags::GLOBAL;
        m.set_pte(&mm, va(0), Pte::new(f, flags)).unwrap();
        let (cpu0, cpu1, cpu2) = (m.cpu(0).unwrap(), m.cpu(1).unwrap(), m.cpu(2).unwrap());
        cpu1.switch_to(&mm).unwrap();
        cpu1.write(va(0), 7).unwrap();
        cpu1.switch_to(&other).unwrap();
        cpu2.switch_to(&other).unwrap();
        cpu0.switch_to(&mm).unwrap();
        assert_eq!(cpu1.read(va(0)), Ok(7), "the global entry outlives the switch");

        let old = m.clear_pte(&mm, va(0)).unwrap();
        let mut batch = TlbFlushUnmapBatch::new();
        batch.add_pending(&cpu0, &mm, va(0), old).unwrap();
        assert!(batch.has_writable());
        let report = batch.flush(&cpu0).unwrap();
        m.free_frame(f).unwrap();
        assert_eq!(m.violations(), [], "tagged {tagged_tlb}");
        assert!(cpu1.read(va(0)).is_err() && cpu2.read(va(0)).is_err());
        let reached = (report.remote_cpus, report.ipis_sent);
        assert_eq!(reached, (2, 2), "tagged {tagged_tlb}");
    }
}
