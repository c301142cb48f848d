//! Helpers the soundness tests (`tests/soundness_*.rs`) share: address
//! spaces in a mock reverse map, and frames mapped and touched in them.

use std::sync::Arc;

use tlb_batch::arch::mock::{MockMachine, MockRmap};
use tlb_batch::{Frame, MappingFlags};

use super::{asid, va};

/// `spaces` address spaces of `m`, in a reverse map.
pub fn rmap_of(m: &MockMachine, spaces: usize) -> MockRmap<'_> {
    let spaces = (0..spaces)
        .map(|i| m.space(&m.new_mm(asid(i as u16 + 1)).unwrap()))
        .collect();
    MockRmap::new(m, spaces)
}

/// CPU `cpu` runs space `s` of `rmap` and writes (or reads) `va`; the
/// accessed bit is cleared afterwards so that the page does not look young.
pub fn touch(m: &MockMachine, rmap: &MockRmap<'_>, cpu: usize, s: usize, va: u64, write: bool) {
    let c = m.cpu(cpu).unwrap();
    let mm = rmap.spaces()[s].mm();
    if c.current_mm().is_none_or(|cur| !Arc::ptr_eq(&cur, mm)) {
        c.switch_to(mm).unwrap();
    }
    if write {
        c.write(va, 7).unwrap();
    } else {
        c.read(va).unwrap();
    }
    m.test_and_clear_accessed(mm, va).unwrap();
}

/// `n` fresh frames mapped at test pages `0..n` of space 0, each touched
/// by CPU 1 (written when `writable`, read otherwise).
pub fn mapped(m: &MockMachine, rmap: &MockRmap<'_>, n: usize, writable: bool) -> Vec<Frame> {
    (0..n)
        .map(|i| {
            let f = m.alloc_frame().unwrap();
            rmap.map(f, 0, va(i), writable, MappingFlags::empty()).unwrap();
            touch(m, rmap, 1, 0, va(i), writable);
            f
        })
        .collect()
}
