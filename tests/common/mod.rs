//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod bounded_rmap;
pub mod gather;
pub mod pool;
#[cfg(all(feature = "page-table-multiarch", feature = "mock", target_arch = "x86_64"))]
pub mod ptm_tables;
pub mod soundness;
#[cfg(all(feature = "x86_64-mapper", feature = "mock"))]
pub mod x86_tables;

use std::sync::Arc;

use tlb_batch::arch::mock::{MockConfig, MockCpu, MockMachine, Model};
use tlb_batch::{Asid, Frame, MmTlbState, TlbFlushUnmapBatch, TtuFlags, PAGE_SIZE};

/// Where test mappings start.
pub const BASE: u64 = 0x40_0000;

/// The address of test page `i`.
pub fn va(i: usize) -> u64 {
    BASE + i as u64 * PAGE_SIZE
}

/// A user ASID.
pub fn asid(v: u16) -> Asid {
    Asid::new(v).unwrap()
}

/// A synchronous x86-like machine whose TLBs hold `tlb` entries.
pub fn config(cpus: usize, tlb: usize) -> MockConfig {
    MockConfig {
        tlb_entries: tlb,
        ..MockConfig::x86_like(cpus)
    }
}

/// Maps `pages` fresh frames (writable or not) into a new address space,
/// switches each CPU of `cpus` to it and has it touch every page: a write
/// of the CPU's index when writable, a read otherwise.
pub fn populate<M: Model>(
    m: &MockMachine<M>,
    asid_value: u16,
    pages: usize,
    cpus: &[usize],
    writable: bool,
) -> (Arc<MmTlbState>, Vec<Frame>) {
    let mm = m.new_mm(asid(asid_value)).unwrap();
    let frames = (0..pages)
        .map(|i| m.map_new(&mm, va(i), writable).unwrap())
        .collect();
    for &c in cpus {
        let cpu = m.cpu(c).unwrap();
        cpu.switch_to(&mm).unwrap();
        for i in 0..pages {
            if writable {
                cpu.write(va(i), c as u64).unwrap();
            } else {
                cpu.read(va(i)).unwrap();
            }
        }
    }
    (mm, frames)
}

/// Runs `f` on its own thread and fails the test if it has not finished
/// within `secs` seconds: a deadlock becomes a failure, not a hung CI run.
pub fn within<F: FnOnce() + Send + 'static>(secs: u64, f: F) {
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(()) => worker.join().unwrap(),
        // The worker panicked: rethrow its panic.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(worker.join().unwrap_err())
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("did not finish within {secs} s: deadlock or lost request")
        }
    }
}

/// The end of every flush-then-free scenario: no stale TLB entry is left,
/// every frame goes back to the allocator, and the oracle saw nothing.
pub fn free_and_check<M: Model>(m: &MockMachine<M>, frames: Vec<Frame>) {
    assert_eq!(m.stale_entries(), []);
    for f in frames {
        m.free_frame(f).unwrap();
    }
    assert_eq!(m.violations(), []);
}

/// Clears the PTEs of test pages `pages` of `mm` and defers their flushes
/// into `batch`, checking each time that deferral is allowed.
pub fn unmap_deferred<M: Model>(
    m: &MockMachine<M>,
    cpu: &MockCpu<'_, M>,
    mm: &MmTlbState,
    pages: impl IntoIterator<Item = usize>,
    batch: &mut TlbFlushUnmapBatch,
) {
    for i in pages {
        let old = m.clear_pte(mm, va(i)).unwrap();
        assert!(TlbFlushUnmapBatch::should_defer(cpu, mm, TtuFlags::BATCH_FLUSH));
        batch.add_pending(cpu, mm, va(i), old).unwrap();
    }
}

/// The test's handle to `frame`.
pub fn owned(frame: Frame) -> tlb_batch::OwnedFrame {
    // SAFETY: the tests make one handle per frame they allocated, and free
    // frames only through that handle (or not at all).
    unsafe { tlb_batch::OwnedFrame::new(frame) }
}

/// Test pages `first..end` as a range.
pub fn pages(first: usize, end: usize) -> tlb_batch::PageRange {
    tlb_batch::PageRange::from_bounds(va(first), va(end)).unwrap()
}
