//! Helpers the reverse-map tests (`tests/rmap_*.rs`) share: a
//! [`BoundedRmap`] over the mock's address spaces, and pages mapped and
//! touched through it.

use std::sync::Arc;

use tlb_batch::arch::mock::{MockMachine, MockSpace, Model};
use tlb_batch::{BoundedRmap, Frame, MappingFlags, MmTlbState};

use super::va;

pub type Map<'a, M> = BoundedRmap<'a, MockSpace<'a, M>, MockMachine<M>, 128>;

pub fn rmap<'a, M: Model>(m: &'a MockMachine<M>) -> Map<'a, M> {
    // SAFETY: every test maps frames only through `map`, which registers
    // the mapping before any CPU can use it.
    unsafe { BoundedRmap::new(m) }
}

/// Maps `frame` at test page `page` of `space` and records it in `rm`.
pub fn map<'a, M: Model>(
    m: &MockMachine<M>,
    rm: &mut Map<'a, M>,
    space: &'a MockSpace<'a, M>,
    frame: Frame,
    page: usize,
    writable: bool,
    flags: MappingFlags,
) {
    m.map(space.mm(), va(page), frame, writable).unwrap();
    rm.add(frame, space, va(page), flags).unwrap();
}

/// Switches `cpu` to `mm` and writes (or reads) test page `page`, then
/// clears the accessed bit so that the page does not look young.
pub fn touch<M: Model>(m: &MockMachine<M>, cpu: usize, mm: &Arc<MmTlbState>, page: usize, write: bool) {
    let c = m.cpu(cpu).unwrap();
    if c.current_mm().is_none_or(|cur| !Arc::ptr_eq(&cur, mm)) {
        c.switch_to(mm).unwrap();
    }
    if write {
        c.write(va(page), 100 + cpu as u64).unwrap();
    } else {
        c.read(va(page)).unwrap();
    }
    m.test_and_clear_accessed(mm, va(page)).unwrap();
}
