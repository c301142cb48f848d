//! `change_protection` keeps the hardware's record in an entry that keeps
//! its frame: the accessed bit (tested with the pool in `tests/aging.rs`)
//! and the dirty bit, which reclaim needs to write the page out before it
//! frees it (contract rule 4). Found by a new user's trial: a closure that
//! builds the new entry from the frame and the new protection dropped it,
//! and the page was later freed as clean.

mod common;

use common::{asid, config, va};
use tlb_batch::arch::mock::{
    FrameError, FrameState, MockError, MockKernel, MockMachine, MockRmap, Violation,
};
use tlb_batch::{
    change_protection, shrink_page_list, MappingFlags, PageRange, Pte, PteFlags, UnmapBatch, Verdict,
};

#[test]
fn making_a_written_page_read_only_keeps_its_dirty_bit_and_reclaim_writes_it_out() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let rmap = MockRmap::new(&m, vec![m.space(&m.new_mm(asid(1)).unwrap())]);
    let space = &rmap.spaces()[0];
    let mm = space.mm();
    let f = m.alloc_frame().unwrap();
    rmap.map(f, 0, va(0), true, MappingFlags::empty()).unwrap();
    let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
    cpu1.switch_to(mm).unwrap();
    cpu1.write(va(0), 42).unwrap();
    assert!(m.pte(mm, va(0)).unwrap().is_dirty());
    // The closure a kernel writes for mprotect(PROT_READ): frame and
    // protection, nothing else.
    let read_only = |p: Pte| Pte::new(p.frame(), PteFlags::PRESENT | PteFlags::USER);
    let page = PageRange::page(va(0)).unwrap();
    assert_eq!(change_protection(&cpu0, space, page, read_only), Ok(1));
    let pte = m.pte(mm, va(0)).unwrap();
    assert!(pte.is_dirty() && pte.is_accessed(), "{pte:?}");
    assert!(!pte.flags().contains(PteFlags::WRITABLE));
    assert!(
        !m.frame_dirty(f).unwrap(),
        "the dirty bit is still in the PTE only"
    );
    // Reclaim: the first pass finds the page young, the second unmaps it,
    // and must write it out before freeing it.
    let mut kernel = MockKernel::new(&rmap);
    let mut verdicts = Vec::new();
    for _ in 0..2 {
        let summary = shrink_page_list(
            &cpu0,
            &rmap,
            &mut kernel,
            &mut UnmapBatch::<4>::new(),
            [common::owned(f)],
            &mut |_, v| verdicts.push(v),
        )
        .unwrap();
        if summary.freed == 1 {
            break;
        }
    }
    assert_eq!(verdicts, [Verdict::Referenced]);
    assert_eq!(
        (kernel.page_outs, kernel.frames_freed),
        (1, 1),
        "written out, then freed"
    );
    assert_eq!(m.violations(), []);
}

/// A write the mock refuses is recorded, not dropped in silence: the
/// crate's `PageTable::set` cannot fail, and the mock's used to ignore its
/// own refusal, leaving the page unmapped with nothing reported. Here an
/// `update` maps a free frame (the kernel's mistake, which the mock
/// exists to catch); the entry is cleared and the oracle names the write.
#[test]
fn an_entry_the_mock_refuses_is_a_violation_never_a_silent_unmap() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let space = m.space(&mm);
    let f = m.map_new(&mm, va(0), true).unwrap();
    let free = m.alloc_frame().unwrap();
    m.free_frame(free).unwrap();
    let page = PageRange::page(va(0)).unwrap();
    let to_free = |_: Pte| Pte::new(free, PteFlags::PRESENT | PteFlags::USER);
    assert_eq!(
        change_protection(&m.cpu(0).unwrap(), &space, page, to_free),
        Ok(1)
    );
    assert!(!m.pte(&mm, va(0)).unwrap().is_present());
    let refused = MockError::Frame(FrameError::WrongState {
        frame: free,
        state: FrameState::Free,
    });
    assert_eq!(
        m.violations(),
        [Violation::RefusedPteWrite {
            va: va(0),
            error: refused
        }]
    );
    assert_eq!(m.frame_state(f).unwrap(), FrameState::InUse);
}
