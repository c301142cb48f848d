//! Helpers the frame-pool tests (`tests/pool_*.rs`) share: processes
//! whose pages their CPUs cache, unmapped and pooled from CPU 0, and checks
//! of what the machine still caches.

use tlb_batch::arch::mock::{FrameState, MockKernel, MockMachine, MockRmap};
use tlb_batch::{
    CpuSet, Flushed, Frame, FramePool, FreeFrames, MappingFlags, TtuFlags, UnmapBatch, Unmapped,
};

use super::{asid, owned, va};

/// One address space per CPU of `cpus`, each with `per` clean read-only
/// pages that its CPU read (so caches) and that were aged afterwards.
/// Returns the reverse map and each space's frames.
pub fn procs<'m>(m: &'m MockMachine, cpus: &[usize], per: usize) -> (MockRmap<'m>, Vec<Vec<Frame>>) {
    let spaces = (0..cpus.len())
        .map(|i| m.space(&m.new_mm(asid(i as u16 + 1)).unwrap()))
        .collect();
    let rmap = MockRmap::new(m, spaces);
    let mut frames = Vec::new();
    for (s, &c) in cpus.iter().enumerate() {
        let (cpu, mm) = (m.cpu(c).unwrap(), rmap.spaces()[s].mm());
        cpu.switch_to(mm).unwrap();
        let list: Vec<Frame> = (0..per)
            .map(|i| {
                let f = m.alloc_frame().unwrap();
                rmap.map(f, s, va(i), false, MappingFlags::empty()).unwrap();
                cpu.read(va(i)).unwrap();
                m.test_and_clear_accessed(mm, va(i)).unwrap();
                f
            })
            .collect();
        frames.push(list);
    }
    (rmap, frames)
}

/// Unmaps `frames` from CPU 0 into `batch`: every mapping goes, with its
/// flush deferred.
pub fn unmap<const N: usize>(
    m: &MockMachine,
    rmap: &MockRmap<'_>,
    frames: &[Frame],
    batch: &mut UnmapBatch<N>,
) {
    for &f in frames {
        let r = batch.try_to_unmap(&m.cpu(0).unwrap(), rmap, owned(f), TtuFlags::empty());
        assert!(matches!(r, Ok(Unmapped::Held(_))), "{r:?}");
    }
}

/// Unmaps `frames` from CPU 0 and pools them in `pool` as one generation.
pub fn pool_them<const P: usize>(
    m: &MockMachine,
    rmap: &MockRmap<'_>,
    frames: &[Frame],
    pool: &mut FramePool<P>,
) {
    let mut batch = UnmapBatch::<16>::new();
    unmap(m, rmap, frames, &mut batch);
    assert_eq!(pool.defer(&m.cpu(0).unwrap(), &mut batch), Ok(frames.len()));
    assert!(batch.is_empty());
}

/// The CPUs of `m` numbered `cpus`.
pub fn set(m: &MockMachine, cpus: &[usize]) -> CpuSet {
    let mut s = CpuSet::new();
    for &c in cpus {
        s.insert(m.cpu(c).unwrap().id());
    }
    s
}

/// Frees what a pool handed back through the kernel's batched free, which
/// must take every frame; returns them in the order they came.
pub fn free<const N: usize>(kernel: &mut MockKernel<'_, '_>, mut released: Flushed<N>) -> Vec<Frame> {
    assert!(released.still_mapped().is_empty());
    let frames: Vec<Frame> = released.frames_mut().iter().map(|f| f.frame()).collect();
    kernel.free_batch(released.frames_mut());
    assert!(released.frames_mut().is_empty(), "the allocator took every frame");
    frames
}

/// No CPU, online or not, caches any of `frames`.
pub fn uncached(m: &MockMachine, frames: &[Frame]) -> bool {
    frames.iter().all(|&f| m.cached_translations(f).is_empty())
}

/// Whether every one of `frames` is in `state`.
pub fn all_in(m: &MockMachine, frames: &[Frame], state: FrameState) -> bool {
    frames.iter().all(|&f| m.frame_state(f).unwrap() == state)
}
