//! The simulated machine itself: TLB fills and hardware A/D bits, stale
//! entries, the clean-write re-walk (and its absence), the oracle, frame
//! errors, tagged TLBs and the cost model.

mod common;

use common::{asid, config, populate, va};
use tlb_batch::arch::mock::{
    CostModel, Fault, FrameError, FrameState, MockConfig, MockError, MockMachine, NoRewalk, Violation,
};
use tlb_batch::{flush_tlb_mm, flush_tlb_page, Arch, Frame, Pte, PteFlags};

#[test]
fn accesses_fill_the_tlb_and_set_accessed_and_dirty_bits() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let f = m.map_new(&mm, va(0), true).unwrap();
    let cpu = m.cpu(0).unwrap();
    cpu.switch_to(&mm).unwrap();
    assert!(!m.pte(&mm, va(0)).unwrap().is_accessed());
    assert_eq!(cpu.read(va(0)), Ok(0));
    let pte = m.pte(&mm, va(0)).unwrap();
    assert!(pte.is_accessed() && !pte.is_dirty());
    assert_eq!(m.cached_translations(f).len(), 1);
    assert!(!m.cached_translations(f)[0].1.dirty);
    cpu.write(va(0), 42).unwrap();
    assert!(m.pte(&mm, va(0)).unwrap().is_dirty());
    assert_eq!(m.frame_data(f), Ok(42));
    assert!(m.cached_translations(f)[0].1.dirty);
    // An unmapped address faults; a read-only page refuses writes.
    assert_eq!(cpu.read(va(9)), Err(Fault::NotMapped { va: va(9) }));
    let ro = m.map_new(&mm, va(1), false).unwrap();
    assert_eq!(cpu.write(va(1), 1), Err(Fault::WriteProtected { va: va(1) }));
    assert_eq!(m.frame_data(ro), Ok(0));
}

#[test]
fn stale_entries_outlive_the_pte_until_flushed() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (mm, frames) = populate(&m, 1, 1, &[0, 1], true);
    let cpu1 = m.cpu(1).unwrap();
    let old = m.clear_pte(&mm, va(0)).unwrap();
    assert!(old.is_dirty() && old.frame() == frames[0]);
    // CPU 1 still reads through its cached entry.
    assert_eq!(cpu1.read(va(0)), Ok(1));
    assert_eq!(m.stale_entries().len(), 2);
    flush_tlb_page(&m.cpu(0).unwrap(), &mm, va(0)).unwrap();
    assert_eq!(m.stale_entries(), []);
    assert_eq!(cpu1.read(va(0)), Err(Fault::NotMapped { va: va(0) }));
}

#[test]
fn a_write_through_a_clean_entry_rewalks_and_faults_once_the_pte_is_gone() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (mm, frames) = populate(&m, 1, 1, &[1], false);
    // Make the page writable but still clean in CPU 1's TLB.
    m.map(&mm, va(0), frames[0], true).unwrap();
    flush_tlb_page(&m.cpu(0).unwrap(), &mm, va(0)).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.read(va(0)).unwrap();
    let e = m.cached_translations(frames[0])[0].1;
    assert!(e.writable && !e.dirty);
    m.clear_pte(&mm, va(0)).unwrap();
    // x86: the write walks the table again, finds nothing, faults; the
    // frame is untouched and the stale entry is gone.
    assert_eq!(cpu1.write(va(0), 5), Err(Fault::NotMapped { va: va(0) }));
    assert_eq!(m.frame_data(frames[0]), Ok(0));
    assert_eq!(m.cached_translations(frames[0]), []);
}

#[test]
fn without_the_rewalk_a_clean_entry_writes_silently_after_the_unmap() {
    let m = MockMachine::<NoRewalk>::with_model(config(2, 64)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let f = m.map_new(&mm, va(0), true).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.read(va(0)).unwrap();
    let old = m.clear_pte(&mm, va(0)).unwrap();
    assert!(!old.is_dirty());
    // The write lands although the PTE is gone, and no dirty bit records
    // it: exactly why the crate must not defer flushes on such hardware.
    assert_eq!(cpu1.write(va(0), 5), Ok(()));
    assert_eq!(m.frame_data(f), Ok(5));
    assert!(!m.pte(&mm, va(0)).unwrap().is_dirty());
}

#[test]
fn a_dirty_entry_writes_without_a_walk() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (mm, frames) = populate(&m, 1, 1, &[1], true);
    m.clear_pte(&mm, va(0)).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    let refills = m.costs().tlb_refill;
    assert_eq!(cpu1.write(va(0), 9), Ok(()));
    assert_eq!(m.costs().tlb_refill, refills, "no walk for a dirty hit");
    assert_eq!(m.frame_data(frames[0]), Ok(9));
}

#[test]
fn the_oracle_reports_reads_of_free_frames_and_io_hazards() {
    let m = MockMachine::new(config(2, 64)).unwrap();
    let (mm, frames) = populate(&m, 1, 2, &[1], true);
    let cpu1 = m.cpu(1).unwrap();
    let id = cpu1.id();
    // Page 0: written out while CPU 1 can still write it.
    m.clear_pte(&mm, va(0)).unwrap();
    m.start_io(frames[0]).unwrap();
    cpu1.write(va(0), 3).unwrap();
    m.end_io(frames[0]).unwrap();
    // Page 1: freed while cached, then read.
    m.clear_pte(&mm, va(1)).unwrap();
    m.free_frame(frames[1]).unwrap();
    cpu1.read(va(1)).unwrap();
    assert_eq!(
        m.violations(),
        [
            Violation::IoWhileWritable {
                frame: frames[0],
                cpu: id
            },
            Violation::WriteDuringIo {
                cpu: id,
                frame: frames[0],
                va: va(0)
            },
            Violation::FreedWhileCached {
                frame: frames[1],
                cpu: id,
                writable: true
            },
            Violation::ReadOfFreeFrame {
                cpu: id,
                frame: frames[1],
                va: va(1)
            },
        ]
    );
}

#[test]
fn frame_misuse_is_refused_with_an_error() {
    let m = MockMachine::new(MockConfig {
        frames: 2,
        ..config(1, 8)
    })
    .unwrap();
    let a = m.alloc_frame().unwrap();
    let _b = m.alloc_frame().unwrap();
    assert_eq!(m.alloc_frame(), Err(MockError::Frame(FrameError::OutOfFrames)));
    m.free_frame(a).unwrap();
    assert_eq!(m.violations(), []);
    assert_eq!(
        m.free_frame(a),
        Err(MockError::Frame(FrameError::WrongState {
            frame: a,
            state: FrameState::Free
        }))
    );
    assert_eq!(
        m.free_frame(Frame(1 << 40)),
        Err(MockError::Frame(FrameError::NoSuchFrame(Frame(1 << 40))))
    );
    assert_eq!(
        m.end_io(a),
        Err(MockError::Frame(FrameError::WrongState {
            frame: a,
            state: FrameState::Free
        }))
    );
    let mm = m.new_mm(asid(1)).unwrap();
    assert!(matches!(m.map_new(&mm, 0x1234, true), Err(MockError::Input(_))));
    let stranger = tlb_batch::MmTlbState::new(asid(7), 12345);
    assert_eq!(m.clear_pte(&stranger, 0), Err(MockError::UnknownAddressSpace));
    assert_eq!(m.free_frames(), 1);
}

#[test]
fn tlbs_are_bounded_and_only_tagged_ones_survive_a_switch() {
    for tagged in [false, true] {
        let m = MockMachine::new(MockConfig {
            tagged_tlb: tagged,
            ..config(1, 4)
        })
        .unwrap();
        let (mm, frames) = populate(&m, 1, 10, &[0], true);
        assert_eq!(m.all_entries().len(), 4, "capacity bounds the TLB");
        // The least recently used pages were evicted.
        assert!(m.cached_translations(frames[9]).len() == 1 && m.cached_translations(frames[0]).is_empty());
        m.cpu(0).unwrap().switch_to(&m.new_mm(asid(2)).unwrap()).unwrap();
        assert_eq!(m.all_entries().len(), if tagged { 4 } else { 0 });
        assert!(mm.cpus().is_empty(), "a switch leaves the old space's set");
    }
}

#[test]
fn global_entries_are_marked_and_kept() {
    let m = MockMachine::new(config(1, 8)).unwrap();
    let kernel = m.kernel_mm().clone();
    m.map_new(&kernel, 0xffff_ffff_8000_0000, true).unwrap();
    let pte = m.pte(&kernel, 0xffff_ffff_8000_0000).unwrap();
    assert!(pte.flags().contains(PteFlags::GLOBAL) && !pte.flags().contains(PteFlags::USER));
    let cpu = m.cpu(0).unwrap();
    cpu.read(0xffff_ffff_8000_0000).unwrap();
    cpu.switch_to(&m.new_mm(asid(1)).unwrap()).unwrap();
    assert_eq!(m.all_entries().len(), 1);
    assert!(m.all_entries()[0].1.global);
}

#[test]
fn the_cost_model_gives_exact_running_totals() {
    let cost = CostModel::default();
    let m = MockMachine::new(config(3, 64)).unwrap();
    let (mm, _) = populate(&m, 1, 2, &[0, 1, 2], true);
    // 3 CPUs x 2 pages, one walk each.
    assert_eq!(m.costs().tlb_refill, 6 * cost.tlb_refill);
    let base = m.costs();
    m.clear_pte(&mm, va(0)).unwrap();
    flush_tlb_page(&m.cpu(0).unwrap(), &mm, va(0)).unwrap();
    let c = m.costs();
    assert_eq!(c.ipi_send - base.ipi_send, 2 * cost.ipi_send);
    assert_eq!(c.ipi_receive - base.ipi_receive, 2 * cost.ipi_receive);
    assert_eq!(c.invlpg - base.invlpg, 3 * cost.invlpg);
    assert_eq!(
        c.total() - base.total(),
        2 * cost.ipi_send + 2 * cost.ipi_receive + 3 * cost.invlpg
    );
    // The receiver pays for the interrupt, the sender for sending it.
    let cpu1 = m.cpu(1).unwrap().id();
    assert!(m.cpu_cycles(cpu1).unwrap() >= cost.ipi_receive + cost.invlpg);
    // A CPU the machine does not have is an error, not a panic.
    let foreign = tlb_batch::CpuId::new(100).unwrap();
    assert!(m.cpu_cycles(foreign).is_err() && m.interrupts_taken(foreign).is_err());
}

/// Flushing a page of the kernel's address space does what INVLPG does on
/// a tagged TLB: the current ASID's entry and a global one, not another
/// ASID's entry for the same address.
#[test]
fn a_kernel_page_flush_reaches_only_the_current_asid_and_global_entries() {
    let m = MockMachine::new(MockConfig {
        tagged_tlb: true,
        ..config(1, 16)
    })
    .unwrap();
    let (a, b) = (m.new_mm(asid(1)).unwrap(), m.new_mm(asid(2)).unwrap());
    let fa = m.map_new(&a, va(0), true).unwrap();
    let fb = m.map_new(&b, va(0), true).unwrap();
    let cpu = m.cpu(0).unwrap();
    cpu.switch_to(&a).unwrap();
    cpu.read(va(0)).unwrap();
    cpu.switch_to(&b).unwrap();
    cpu.read(va(0)).unwrap();
    cpu.flush_local_page(tlb_batch::Asid::KERNEL, va(0));
    assert_eq!(m.cached_translations(fb), [], "the loaded ASID's entry goes");
    assert_eq!(m.cached_translations(fa).len(), 1, "another ASID's entry stays");
    // By ASID (INVPCID by address): that ASID's entry only.
    cpu.flush_local_page(asid(1), va(0));
    assert_eq!(m.cached_translations(fa), []);
}

/// An ASID reused for a new address space while the old one's entries are
/// still cached would let the new process reach the old one's memory. The
/// mock hands an ASID out again only once the old space is dropped, and
/// the crate prevents the rest whether or not it was flushed first: the
/// new space's first generation is newer than anything the CPU recorded
/// for ASID 5, so loading it flushes the ASID (one catch-up). A kernel
/// that loaded the root itself, without `switch_mm`, is caught.
#[test]
fn an_asid_reused_for_a_new_space_is_flushed_at_its_first_load() {
    for (flush_first, raw_load) in [(false, false), (true, false), (false, true)] {
        let m = MockMachine::new(MockConfig {
            tagged_tlb: true,
            ..config(2, 16)
        })
        .unwrap();
        let old = m.new_mm(asid(5)).unwrap();
        let secret = m.map_new(&old, va(0), true).unwrap();
        let cpu1 = m.cpu(1).unwrap();
        cpu1.switch_to(&old).unwrap();
        cpu1.read(va(0)).unwrap();
        cpu1.switch_to(&m.new_mm(asid(6)).unwrap()).unwrap();
        if flush_first {
            flush_tlb_mm(&m.cpu(0).unwrap(), &old).unwrap();
        }
        // The old process is gone: its ASID is free again.
        assert_eq!(m.new_mm(asid(5)).err(), Some(MockError::AsidInUse { asid: 5 }));
        drop(old);
        let new = m.new_mm(asid(5)).unwrap();
        m.map_new(&new, va(0), true).unwrap();
        let before = m.stats().catch_ups;
        if raw_load {
            // SAFETY: the mock's roots are its own tables; the mock's
            // `switch_address_space` only records the load.
            unsafe { tlb_batch::Arch::switch_address_space(&cpu1, new.asid(), new.root()) };
        } else {
            cpu1.switch_to(&new).unwrap();
        }
        cpu1.read(va(0)).unwrap();
        let foreign = m.violations().contains(&Violation::ForeignTranslation {
            cpu: cpu1.id(),
            va: va(0),
            frame: secret,
        });
        assert_eq!(
            foreign, raw_load,
            "flushed first: {flush_first}, raw load: {raw_load}"
        );
        assert_eq!(m.stats().catch_ups - before, u64::from(!raw_load));
    }
}

/// The walk cache keeps pointers to leaf tables; a table frame freed while
/// a CPU may still walk through such a pointer is a violation, and a walk
/// through a pointer to a freed table is one too.
#[test]
fn a_table_freed_under_a_cached_walk_pointer_is_caught() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let f = m.map_new(&mm, va(0), true).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.read(va(0)).unwrap();
    // Unmapped and flushed: the TLB entry and the pointer are gone...
    m.clear_pte(&mm, va(0)).unwrap();
    flush_tlb_page(&m.cpu(0).unwrap(), &mm, va(0)).unwrap();
    assert_eq!(m.stale_entries(), []);
    // ...but a later walk (one that faults) caches the pointer again.
    assert_eq!(cpu1.read(va(0)), Err(Fault::NotMapped { va: va(0) }));
    let table = m.detach_table(&mm, common::pages(0, 512)).unwrap();
    m.free_frame(f).unwrap();
    m.free_frame(table.frame).unwrap();
    assert_eq!(
        m.violations(),
        [Violation::TableFreedWhileCached {
            frame: table.frame,
            cpu: cpu1.id()
        }]
    );
    assert_eq!(cpu1.read(va(1)), Err(Fault::NotMapped { va: va(1) }));
    assert!(m.violations().contains(&Violation::WalkThroughFreedTable {
        cpu: cpu1.id(),
        table: table.frame,
        va: va(1)
    }));
}

/// A CPU that goes offline keeps what it cached (the kernel's space is
/// what it has loaded then, so a global kernel entry); coming back through
/// the kernel's online path drops it. Coming back without it, its old
/// entry reaches a frame that was freed meanwhile.
#[test]
fn a_cpu_that_comes_back_online_must_flush_first() {
    let kva = 0xffff_8000_0040_0000;
    for proper in [true, false] {
        let m = MockMachine::new(config(3, 16)).unwrap();
        let kernel = m.kernel_mm().clone();
        let f = m.alloc_frame().unwrap();
        let flags = PteFlags::PRESENT | PteFlags::WRITABLE | PteFlags::GLOBAL;
        m.set_pte(&kernel, kva, Pte::new(f, flags)).unwrap();
        let cpu1 = m.cpu(1).unwrap();
        cpu1.switch_to(&kernel).unwrap();
        cpu1.read(kva).unwrap();
        cpu1.go_offline();
        assert_eq!(cpu1.read(kva), Err(Fault::CpuOffline));
        // Unmapped and flushed while CPU 1 is away: it gets no IPI.
        m.clear_pte(&kernel, kva).unwrap();
        let report = flush_tlb_page(&m.cpu(0).unwrap(), &kernel, kva).unwrap();
        assert_eq!(report.ipis_sent, 1, "only CPU 2 is online to ask");
        m.free_frame(f).unwrap();
        assert_eq!(m.violations(), [], "an offline CPU's entries are dormant");
        if proper {
            cpu1.come_online();
            cpu1.switch_to(&kernel).unwrap();
        } else {
            m.set_online(1, true).unwrap();
        }
        let _ = cpu1.read(kva);
        assert_eq!(m.violations().is_empty(), proper, "{:?}", m.violations());
    }
}

/// A page table the kernel wrote itself: an entry naming a frame the
/// machine does not have is refused by the walk and reported.
#[test]
fn a_kernel_table_entry_naming_no_frame_is_caught() {
    use std::sync::atomic::AtomicU64;
    struct One(AtomicU64);
    impl tlb_batch::arch::mock::MmuTable for One {
        fn entry(&self, va: u64) -> Option<&AtomicU64> {
            (va == common::BASE).then_some(&self.0)
        }
    }
    let m = MockMachine::new(config(1, 16)).unwrap();
    let mm = m.new_mm(asid(1)).unwrap();
    let bogus = tlb_batch::Pte::new(Frame(1 << 30), PteFlags::PRESENT | PteFlags::USER);
    m.attach_table(&mm, std::sync::Arc::new(One(AtomicU64::new(bogus.0))))
        .unwrap();
    let cpu = m.cpu(0).unwrap();
    cpu.switch_to(&mm).unwrap();
    assert_eq!(cpu.read(va(0)), Err(Fault::NotMapped { va: va(0) }));
    assert_eq!(
        m.violations(),
        [Violation::MapsNoSuchFrame {
            cpu: cpu.id(),
            va: va(0),
            frame: Frame(1 << 30)
        }]
    );
    // The machine does not create entries in a kernel's table.
    assert_eq!(
        m.set_pte(&mm, va(1), tlb_batch::Pte::EMPTY),
        Err(MockError::NoTable { va: va(1) })
    );
    let other = m.new_mm(asid(2)).unwrap();
    m.map_new(&other, va(0), true).unwrap();
    assert_eq!(
        m.attach_table(&other, std::sync::Arc::new(One(AtomicU64::new(0)))),
        Err(MockError::TableInUse)
    );
}

/// A reset machine is the machine as it was built: no counts, no CPU
/// with an address space loaded, every frame free.
#[test]
fn a_reset_machine_starts_from_scratch() {
    let m = MockMachine::new(config(2, 16)).unwrap();
    let (mm, frames) = populate(&m, 1, 2, &[0, 1], true);
    flush_tlb_mm(&m.cpu(0).unwrap(), &mm).unwrap();
    assert!(m.stats().ipis_sent > 0);
    m.reset();
    assert_eq!(m.stats(), Default::default());
    assert_eq!(m.ipis_sent(), 0);
    let cpu0 = m.cpu(0).unwrap();
    assert_eq!(cpu0.shootdown_state().loaded_asid(m.cpu(1).unwrap().id()), None);
    assert_eq!(m.all_entries(), []);
    assert_eq!(m.frame_state(frames[0]).unwrap(), FrameState::Free);
    assert_eq!(m.pte(&mm, va(0)), Err(MockError::UnknownAddressSpace));
    // And it runs like new.
    let (_, again) = populate(&m, 1, 1, &[1], true);
    assert_eq!(again[0], frames[0], "frames are handed out in the same order");
}

/// The mock's kernel frees a huge frame whole when it is handed the huge
/// frame's first 4 KiB frame, as the teardown contract asks of a kernel
/// (`TableTeardown`: "the kernel frees the whole huge frame when handed
/// that one"); a frame that heads no huge frame (its head freed on its own
/// and taken again) is freed alone.
#[test]
fn the_mock_kernel_frees_a_huge_frame_whole_from_its_first_frame() {
    use tlb_batch::arch::mock::{MockKernel, MockRmap};
    use tlb_batch::{FreeFrames, OwnedFrame, PageSize};
    let m = MockMachine::new(MockConfig {
        frames: 2048,
        ..config(2, 64)
    })
    .unwrap();
    let rmap = MockRmap::new(&m, vec![]);
    let before = m.free_frames();
    let huge = m.alloc_huge_frame(PageSize::SIZE_2M).unwrap();
    assert_eq!(m.huge_frame_pages(huge), Some(512));
    assert_eq!(
        m.huge_frame_pages(Frame(huge.0 + 1)),
        None,
        "only the first frame names it"
    );
    assert_eq!(m.free_frames(), before - 512);
    let mut frames = heapless::Vec::<OwnedFrame, 4>::new();
    // SAFETY: the test owns the huge frame and hands its one claim over.
    frames.push(unsafe { OwnedFrame::new(huge) }).unwrap();
    let mut kernel = MockKernel::new(&rmap);
    kernel.free_batch(&mut frames);
    assert!(frames.is_empty());
    assert_eq!(
        (kernel.frames_freed, m.free_frames()),
        (1, before),
        "all 512 frames are free again"
    );
    assert_eq!(m.huge_frame_pages(huge), None);

    // A huge frame whose first frame was freed on its own no longer heads
    // a run: a frame taken there afterwards is freed alone.
    let huge = m.alloc_huge_frame(PageSize::SIZE_2M).unwrap();
    m.free_frame(huge).unwrap();
    assert_eq!(m.huge_frame_pages(huge), None);
    let again = m.alloc_frame().unwrap();
    assert_eq!(again, huge, "the lowest free frame is taken first");
    frames.push(unsafe { OwnedFrame::new(again) }).unwrap();
    kernel.free_batch(&mut frames);
    assert_eq!(m.free_frames(), before - 511, "only that frame came back");
    assert_eq!(m.violations(), []);
}
