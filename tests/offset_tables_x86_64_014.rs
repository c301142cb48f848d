//! A kernel on the `x86_64` crate's 0.14 (whose types the crate's
//! `x86_64-mapper` feature, built on 0.15, cannot take) hands its tables
//! to `mapper::OffsetSpace` by address (`from_addresses`, feature
//! `offset-tables`): the crate reads and changes the very entries 0.14's
//! mapper wrote, and refuses a huge page.
use tlb_batch::arch::mock::MockMachine;
use tlb_batch::mapper::{MapperError, OffsetSpace};
use tlb_batch::{Frame, PageRange, PageTable, Pte};
use x86_64_014::structures::paging::{
    FrameAllocator, Mapper, OffsetPageTable, Page, PageTable as Table014, PageTableFlags as F, PhysFrame,
    Size2MiB, Size4KiB, Translate,
};
use x86_64_014::{PhysAddr, VirtAddr};

mod common;

/// Page-table frames for 0.14's `map_to`: leaked, zeroed host pages, so
/// the physical-memory offset is 0.
struct Leaked;

// SAFETY: each frame is a fresh, zeroed, 4 KiB-aligned host page that is
// never handed out twice.
unsafe impl FrameAllocator<Size4KiB> for Leaked {
    fn allocate_frame(&mut self) -> Option<PhysFrame> {
        let page: &'static mut Table014 = Box::leak(Box::new(Table014::new()));
        PhysFrame::from_start_address(PhysAddr::new(page as *mut Table014 as u64)).ok()
    }
}

#[test]
fn tables_built_with_x86_64_0_14_are_read_and_changed_in_place() {
    let root: &'static mut Table014 = Box::leak(Box::new(Table014::new()));
    let root_addr = &*root as *const Table014 as u64;
    // SAFETY: every table frame is a leaked host page at its own address.
    let mut mapper = unsafe { OffsetPageTable::new(root, VirtAddr::new(0)) };
    let flags = F::PRESENT | F::WRITABLE;
    let data = [0x1234_5000u64, 0x1234_6000, 0x1234_7000];
    for (i, &frame) in data.iter().enumerate() {
        let page = Page::<Size4KiB>::containing_address(VirtAddr::new(common::va(i)));
        let frame = PhysFrame::containing_address(PhysAddr::new(frame));
        // SAFETY: the frames are never dereferenced (they are numbers to
        // the crate); no CPU has this space loaded.
        unsafe { mapper.map_to(page, frame, flags, &mut Leaked) }
            .unwrap()
            .ignore();
    }
    let huge_va = 0x4000_0000u64;
    let huge = Page::<Size2MiB>::containing_address(VirtAddr::new(huge_va));
    let huge_frame = PhysFrame::<Size2MiB>::containing_address(PhysAddr::new(0x8000_0000));
    // SAFETY: as above.
    unsafe { mapper.map_to(huge, huge_frame, flags, &mut Leaked) }
        .unwrap()
        .ignore();

    let m = MockMachine::new(common::config(2, 16)).unwrap();
    let mm = m.new_mm(common::asid(1)).unwrap();
    // SAFETY: the tables are live for the test (leaked) and reachable at
    // offset 0; only this thread changes them, through `space`.
    let space = unsafe { OffsetSpace::from_addresses(root_addr, 0, &mm) };
    for (i, &frame) in data.iter().enumerate() {
        let pte = space.lookup(common::va(i));
        assert!(
            pte.maps(Frame(frame >> 12)) && pte.is_writable(),
            "page {i}: {pte:?}"
        );
    }
    // A clear through the crate is what 0.14's own walk sees.
    let old = space.exchange(common::va(1), Pte::EMPTY);
    assert!(old.maps(Frame(data[1] >> 12)));
    assert!(mapper.translate_addr(VirtAddr::new(common::va(1))).is_none());
    assert!(mapper.translate_addr(VirtAddr::new(common::va(2))).is_some());
    // The huge page is refused by name, never walked as 4 KiB entries.
    assert_eq!(
        space.check_no_huge(PageRange::new(huge_va, 512).unwrap()),
        Err(MapperError::HugePage {
            va: huge_va,
            size: 2 << 20
        })
    );
    assert_eq!(
        space.check_no_huge(PageRange::new(common::va(0), 3).unwrap()),
        Ok(())
    );
}
