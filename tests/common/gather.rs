//! Helpers the `MmuGather` tests (`tests/gather*.rs`) share: an address
//! space with test pages mapped and touched, and teardowns of it.

use tlb_batch::arch::mock::{MockKernel, MockMachine, MockRmap, Model};
use tlb_batch::{Error, Frame, FrameKind, MappingFlags, MmuGather, OwnedFrame, TableFreePolicy};

use super::{asid, va};

/// One address space run by `cpus`, with `pages` test pages mapped at
/// `first..first + pages` (even ones written).
pub fn setup<'m, M: Model>(
    m: &'m MockMachine<M>,
    first: usize,
    pages: usize,
    cpus: &[usize],
) -> (MockRmap<'m, M>, Vec<Frame>) {
    let rmap = MockRmap::new(m, vec![m.space(&m.new_mm(asid(1)).unwrap())]);
    let frames: Vec<Frame> = (first..first + pages)
        .map(|i| {
            let f = m.alloc_frame().unwrap();
            rmap.map(f, 0, va(i), true, MappingFlags::empty()).unwrap();
            f
        })
        .collect();
    for &c in cpus {
        let cpu = m.cpu(c).unwrap();
        cpu.switch_to(rmap.spaces()[0].mm()).unwrap();
        for i in first..first + pages {
            if i % 2 == 0 {
                cpu.write(va(i), i as u64).unwrap();
            } else {
                cpu.read(va(i)).unwrap();
            }
        }
    }
    (rmap, frames)
}

pub fn tear_down<M: Model, const N: usize>(
    m: &MockMachine<M>,
    rmap: &MockRmap<'_, M>,
    kernel: &mut MockKernel<'_, '_, M>,
    start: u64,
    end: u64,
    free_tables: bool,
    policy: &mut TableFreePolicy<'_>,
) -> Result<(tlb_batch::TeardownSummary, Vec<(Frame, FrameKind)>), Error> {
    let mut gather = MmuGather::<N>::new();
    let mut back = Vec::new();
    let summary = gather.unmap_range(
        &m.cpu(0).unwrap(),
        &rmap.spaces()[0],
        kernel,
        tlb_batch::PageRange::from_bounds(start, end)?,
        free_tables,
        policy,
        &mut |f: OwnedFrame, kind| back.push((f.into_frame(), kind)),
    )?;
    assert!(gather.is_empty());
    Ok((summary, back))
}

/// `gather.unmap_range` of `range`, data frames only (no table freed),
/// with every free accepted.
pub fn unmap_data<A, S, B, const N: usize>(
    gather: &mut MmuGather<N>,
    arch: &A,
    space: &S,
    backing: &mut B,
    range: tlb_batch::PageRange,
) -> Result<tlb_batch::TeardownSummary, Error>
where
    A: tlb_batch::Arch,
    S: tlb_batch::TableTeardown + ?Sized,
    B: tlb_batch::TeardownBacking + ?Sized,
{
    gather.unmap_range(
        arch,
        space,
        backing,
        range,
        false,
        &mut TableFreePolicy::AfterFlush,
        &mut |_, _| panic!("nothing refused"),
    )
}

/// `gather.finish` after [`unmap_data`].
pub fn finish_data<A, S, B, const N: usize>(
    gather: &mut MmuGather<N>,
    arch: &A,
    space: &S,
    backing: &mut B,
) -> Result<tlb_batch::TeardownSummary, Error>
where
    A: tlb_batch::Arch,
    S: tlb_batch::PageTable + ?Sized,
    B: tlb_batch::TeardownBacking + ?Sized,
{
    gather.finish(
        arch,
        space,
        backing,
        &mut TableFreePolicy::AfterFlush,
        &mut |_, _| panic!("nothing refused"),
    )
}
