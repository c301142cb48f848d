//! A CPU that comes back online keeps nothing it cached before: the
//! kernel's online path runs `prepare_cpu_online`, which drops it. The
//! oracle's side: while a CPU is away its entries are dormant (a frame
//! freed under them is no violation then), and a CPU that rejoins through
//! the raw switch (`MockMachine::set_online`, a kernel that forgot the
//! flush) with an entry for a frame freed or written out meanwhile is
//! `OnlineWithStale` as it rejoins, even once the frame has a new owner,
//! where a write through the entry looks like any other write.

mod common;

use common::{asid, config, va};
use tlb_batch::arch::mock::{MockConfig, MockMachine, Violation};
use tlb_batch::{flush_tlb_page, CpuId, Frame, Pte, PteFlags};

/// A tagged machine: a CPU's user entries survive its switch to the
/// kernel's space on the way offline.
fn tagged(cpus: usize) -> MockConfig {
    MockConfig {
        tagged_tlb: true,
        ..config(cpus, 16)
    }
}

fn cpu_id(i: usize) -> CpuId {
    CpuId::new(i).unwrap()
}

/// What the oracle must hold against CPU 1's rejoin: its entry for `frame`
/// at `va` when `caught`, nothing otherwise.
fn rejoin_verdict(caught: bool, frame: Frame, va: u64, writable: bool) -> Vec<Violation> {
    let entry = Violation::OnlineWithStale {
        cpu: cpu_id(1),
        frame,
        va,
        writable,
    };
    if caught {
        vec![entry]
    } else {
        vec![]
    }
}

/// A fresh page of a new space at `va(0)`, mapped `writable`, that CPU 1
/// reads (caching it) before it goes offline the proper way; CPU 0 then
/// unmaps it and flushes, which cannot reach CPU 1. Returns its frame.
fn cached_then_unmapped_while_away(m: &MockMachine, writable: bool) -> Frame {
    let mm = m.new_mm(asid(1)).unwrap();
    let f = m.map_new(&mm, va(0), writable).unwrap();
    let cpu1 = m.cpu(1).unwrap();
    cpu1.switch_to(&mm).unwrap();
    cpu1.read(va(0)).unwrap();
    cpu1.go_offline();
    m.clear_pte(&mm, va(0)).unwrap();
    flush_tlb_page(&m.cpu(0).unwrap(), &mm, va(0)).unwrap();
    f
}

/// CPU 1 writes a user page, goes offline the proper way (its tagged entry
/// stays, dormant); CPU 0 unmaps the page, flushes (no IPI: CPU 1 is away)
/// and frees the frame, which a second space then takes. Through
/// `come_online` CPU 1 comes back clean and faults on the page; through
/// the raw switch it is caught as it rejoins, before the write through its
/// old entry that lands in the new owner's page.
#[test]
fn rejoining_with_an_entry_for_a_reused_frame_is_caught() {
    for proper in [true, false] {
        let m = MockMachine::new(tagged(2)).unwrap();
        let mm = m.new_mm(asid(1)).unwrap();
        let f = m.map_new(&mm, va(0), true).unwrap();
        let (cpu0, cpu1) = (m.cpu(0).unwrap(), m.cpu(1).unwrap());
        cpu0.switch_to(&mm).unwrap();
        cpu1.switch_to(&mm).unwrap();
        cpu1.write(va(0), 1).unwrap();
        cpu1.go_offline();
        assert!(!m.online().contains(cpu_id(1)));
        m.clear_pte(&mm, va(0)).unwrap();
        let report = flush_tlb_page(&cpu0, &mm, va(0)).unwrap();
        assert_eq!(report.ipis_sent, 0, "CPU 1 is away");
        m.free_frame(f).unwrap();
        let other = m.new_mm(asid(2)).unwrap();
        assert_eq!(m.map_new(&other, va(0), true).unwrap(), f, "reused at once");
        let owners = m.frame_data(f).unwrap();
        assert_eq!(m.violations(), [], "an offline CPU's entries are dormant");
        if proper {
            cpu1.come_online();
            assert_eq!(m.violations(), []);
            cpu1.switch_to(&mm).unwrap();
            assert!(cpu1.write(va(0), 99).is_err(), "unmapped: it faults");
            assert_eq!(m.frame_data(f).unwrap(), owners, "the new owner's page is intact");
            assert_eq!(m.violations(), []);
        } else {
            m.set_online(1, true).unwrap();
            assert_eq!(m.violations(), rejoin_verdict(true, f, va(0), true));
        }
    }
}

/// The same for a global kernel entry on an untagged TLB (which no switch
/// drops), with the raw switch both ways; and a CPU that rejoins with
/// nothing freed under its entries is not judged.
#[test]
fn rejoining_with_a_kernel_entry_for_a_freed_frame_is_caught() {
    let kva = 0xffff_8000_0040_0000;
    for freed in [false, true] {
        let m = MockMachine::new(config(2, 16)).unwrap();
        let kernel = m.kernel_mm().clone();
        let f = m.alloc_frame().unwrap();
        let flags = PteFlags::PRESENT | PteFlags::GLOBAL;
        m.set_pte(&kernel, kva, Pte::new(f, flags)).unwrap();
        let cpu1 = m.cpu(1).unwrap();
        cpu1.switch_to(&kernel).unwrap();
        cpu1.read(kva).unwrap();
        m.set_online(1, false).unwrap();
        if freed {
            m.clear_pte(&kernel, kva).unwrap();
            flush_tlb_page(&m.cpu(0).unwrap(), &kernel, kva).unwrap();
            m.free_frame(f).unwrap();
            assert_eq!(m.alloc_frame().unwrap(), f);
        }
        assert_eq!(m.violations(), []);
        m.set_online(1, true).unwrap();
        assert_eq!(m.violations(), rejoin_verdict(freed, f, kva, false));
    }
}

/// A writable entry kept while its frame was written out: the rejoining
/// CPU could write after the disk copy was taken, which is the lost write
/// of rule 1 even though the frame was never freed. A read-only one is no
/// such danger.
#[test]
fn rejoining_with_a_writable_entry_for_a_frame_written_out_is_caught() {
    for writable in [false, true] {
        let m = MockMachine::new(tagged(2)).unwrap();
        let f = cached_then_unmapped_while_away(&m, writable);
        m.start_io(f).unwrap();
        m.end_io(f).unwrap();
        assert_eq!(m.violations(), []);
        m.set_online(1, true).unwrap();
        assert_eq!(m.violations(), rejoin_verdict(writable, f, va(0), true));
    }
}

/// What an absence remembered is judged once, at the rejoin that ends it:
/// a second absence with nothing freed adds nothing, and a CPU already
/// online is not judged again.
#[test]
fn each_absence_is_judged_once() {
    let m = MockMachine::new(tagged(2)).unwrap();
    let f = cached_then_unmapped_while_away(&m, false);
    m.free_frame(f).unwrap();
    m.set_online(1, true).unwrap();
    m.set_online(1, true).unwrap();
    assert_eq!(m.violations().len(), 1);
    m.set_online(1, false).unwrap();
    m.set_online(1, true).unwrap();
    assert_eq!(m.violations().len(), 1, "nothing freed during the second absence");
}
