//! The operation model's reclaims and its [`FramePool`]: a reclaim with or
//! without the pool (with an injected failure and the documented retry),
//! CPUs' ticks, pool flushes, and the bookkeeping that says every frame a
//! reclaim was given ends freed, handed back or pooled, exactly once, and
//! every pooled frame comes out of the pool exactly once.

use std::format;
use std::string::String;
use std::vec::Vec;

use super::super::backing::OpsKernel;
use super::super::{Io, PAGES, POOL_FRAMES, SPACES};
use super::{crate_error, Driver};
use crate::cpuset::CpuSet;
use crate::pool::{quiescent_flush, FramePool};
use crate::pte::Frame;
use crate::reclaim::{shrink_page_list, shrink_page_list_pooled, ReclaimSummary, Verdict};
use crate::rmap::Rmap;
use crate::sim::{FrameState, MockCpu, Model};
use crate::unmap::{Flushed, FreeFrames, OwnedFrame, UnmapBatch};

/// What a failed pool flush must leave as it was: frames, generations and
/// the CPUs they wait for.
type PoolShape = (usize, usize, CpuSet);

/// How a reclaim's kernel writes dirty pages out, and whether its
/// allocator refuses the batched free.
type Backing = (Io, bool);

/// What one reclaim gave back: the summary, the frames the batched free
/// took and the frames handed back with their verdicts.
struct Reclaimed {
    summary: ReclaimSummary,
    freed: Vec<Frame>,
    back: Vec<(Frame, Verdict)>,
}

impl<'m, M: Model> Driver<'m, M> {
    /// `Op::Reclaim`: the reclaim driver over the frames picked (aged
    /// first when `aged`), with its documented retry after an injected
    /// failure; into the pool when `pooled` and the run batches (the plain
    /// run flushes at once, as `shrink_page_list` does).
    #[allow(clippy::too_many_arguments)] // the operation's own fields
    pub(super) fn reclaim(
        &mut self,
        cpu: u8,
        space: u8,
        pages: u8,
        backing: Backing,
        fail: bool,
        pooled: bool,
        aged: bool,
    ) -> Result<(), String> {
        let s = usize::from(space) % (SPACES + 1);
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        let pooled = pooled && self.batching;
        let mut picked = Vec::new();
        for p in (0..PAGES).filter(|p| pages & (1 << p) != 0) {
            if let Some(f) = self.free_to_take(s, p).filter(|f| !picked.contains(f)) {
                picked.push(f);
            }
        }
        let handles: Vec<OwnedFrame> = picked.iter().map(|&f| self.hold(f)).collect();
        let done = self.run_reclaim(&c, handles, backing, fail, pooled, aged)?;
        self.account(&picked, &done, pooled)?;
        for (f, verdict) in done.back {
            if verdict == Verdict::Writeback {
                self.under_io.push(f);
            } else {
                self.put(f);
            }
        }
        self.check_pool()
    }

    /// The reclaim call itself (inside an injected failure first when
    /// `fail`), then the documented retry if it stopped.
    fn run_reclaim(
        &mut self,
        c: &MockCpu<'m, M>,
        handles: Vec<OwnedFrame>,
        (io, refuse_free): Backing,
        fail: bool,
        pooled: bool,
        aged: bool,
    ) -> Result<Reclaimed, String> {
        let rmap = &self.rmap;
        let pool = &mut self.pool;
        let mut kernel = OpsKernel::for_reclaim(self.m, &self.rmap, &mut self.holders, io, refuse_free);
        let mut back: Vec<(Frame, Verdict)> = Vec::new();
        let mut handback = |f: OwnedFrame, v: Verdict| back.push((f.into_frame(), v));
        let mut batch = UnmapBatch::<PAGES>::new();
        if aged {
            for h in &handles {
                batch.page_referenced(c, rmap, h).map_err(crate_error)?;
            }
        }
        let call = |kernel: &mut OpsKernel<'_, '_, 'm, M>, handback: &mut dyn FnMut(OwnedFrame, Verdict)| {
            if pooled {
                shrink_page_list_pooled(c, rmap, kernel, &mut batch, pool, handles, handback)
            } else {
                shrink_page_list(c, rmap, kernel, &mut batch, handles, handback)
            }
        };
        let first = if fail {
            c.in_shootdown(|| call(&mut kernel, &mut handback))
                .map_err(crate_error)?
        } else {
            call(&mut kernel, &mut handback)
        };
        let summary = match first {
            Ok(summary) => summary,
            // The documented retry.
            Err(retry) => retry
                .retry(c, &mut kernel, &mut handback)
                .map_err(|r| format!("reclaim retry failed: {:?}", r.error()))?,
        };
        let freed = core::mem::take(&mut kernel.freed);
        Ok(Reclaimed { summary, freed, back })
    }

    /// The bookkeeping of one reclaim: every frame it freed or handed back
    /// came out once, and was one it was given or one the pool held; what
    /// is left of both is what the pool holds now (nothing of this call's
    /// without the pool); the summary counts the same.
    fn account(&mut self, picked: &[Frame], done: &Reclaimed, pooled: bool) -> Result<(), String> {
        let out: Vec<Frame> = done
            .freed
            .iter()
            .copied()
            .chain(done.back.iter().map(|&(f, _)| f))
            .collect();
        for (i, f) in out.iter().enumerate() {
            if out[..i].contains(f) {
                return Err(format!("{f:?} came out of a reclaim twice"));
            }
            if !picked.contains(f) && !self.pooled.contains(f) {
                return Err(format!("{f:?} came out of a reclaim that never had it"));
            }
        }
        let left: Vec<Frame> = self
            .pooled
            .iter()
            .chain(picked)
            .filter(|f| !out.contains(f))
            .copied()
            .collect();
        let new: Vec<Frame> = picked.iter().filter(|f| left.contains(f)).copied().collect();
        if !pooled && !new.is_empty() {
            return Err(format!("a reclaim without the pool kept {new:?}"));
        }
        let s = done.summary;
        if (s.freed, s.handed_back, s.pooled) != (done.freed.len(), done.back.len(), new.len()) {
            return Err(format!(
                "reclaim summary {s:?}, but {} freed, {} handed back, {} pooled",
                done.freed.len(),
                done.back.len(),
                new.len()
            ));
        }
        self.pooled = left;
        Ok(())
    }

    /// `Op::Tick`: the CPU's quiescent flush, then what the pool can hand
    /// back without an IPI is freed.
    pub(super) fn tick(&mut self, cpu: u8) -> Result<(), String> {
        if !self.batching {
            return Ok(());
        }
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        quiescent_flush(&c);
        if quiescent_flush(&c) {
            return Err("one quiescent flush did not pay this CPU's debt".into());
        }
        let released = self.pool.release_passed(&c);
        self.free_from_pool(released)
    }

    /// `Op::PoolFlush`: the whole pool, or its oldest `oldest - 1` frames
    /// (modulo `POOL_FRAMES + 2`), shot down, after an injected failure
    /// that must leave the pool unchanged, then the documented retry.
    pub(super) fn pool_flush(&mut self, cpu: u8, fail: bool, oldest: u8) -> Result<(), String> {
        if !self.batching {
            return Ok(());
        }
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        let want = usize::from(oldest) % (POOL_FRAMES + 2);
        let held = self.pool.len();
        let flush = |pool: &mut FramePool<POOL_FRAMES>| match want {
            0 => pool.flush(&c),
            n => pool.flush_oldest(&c, n - 1),
        };
        if fail {
            let shape = self.pool_shape();
            match c.in_shootdown(|| flush(&mut self.pool)).map_err(crate_error)? {
                // Nothing was owed, so nothing could fail.
                Ok(released) => return self.flushed_pool(released, want, held),
                Err(_) if self.pool_shape() != shape => {
                    return Err("a failed pool flush changed the pool".into())
                }
                Err(_) => {}
            }
        }
        // The documented retry (or the plain flush).
        let released = flush(&mut self.pool).map_err(crate_error)?;
        self.flushed_pool(released, want, held)
    }

    fn pool_shape(&self) -> PoolShape {
        (self.pool.len(), self.pool.generations(), self.pool.targets())
    }

    /// What a pool flush released: at least what it was asked for (all of
    /// it for `flush`), freed.
    fn flushed_pool(
        &mut self,
        released: Flushed<POOL_FRAMES>,
        want: usize,
        held: usize,
    ) -> Result<(), String> {
        let asked = match want {
            0 => held,
            n => (n - 1).min(held),
        };
        if released.len() < asked {
            return Err(format!(
                "a pool flush for {asked} frames released {} of {held}",
                released.len()
            ));
        }
        if want == 0 && !self.pool.is_empty() {
            return Err(format!("a flushed pool still holds {} frames", self.pool.len()));
        }
        self.free_from_pool(released)
    }

    /// Frees what the pool released through the batched free the reclaims
    /// use: each frame must be one the pool held, once; the allocator takes
    /// them all.
    pub(super) fn free_from_pool(&mut self, mut released: Flushed<POOL_FRAMES>) -> Result<(), String> {
        if !released.still_mapped().is_empty() {
            return Err("the pool released frames still mapped".into());
        }
        for f in released.frames_mut().iter().map(OwnedFrame::frame) {
            match self.pooled.iter().position(|&q| q == f) {
                Some(i) => {
                    self.pooled.swap_remove(i);
                }
                None => return Err(format!("{f:?} came out of the pool, which did not hold it")),
            }
        }
        let mut kernel =
            OpsKernel::for_reclaim(self.m, &self.rmap, &mut self.holders, Io::Synchronous, false);
        kernel.free_batch(released.frames_mut());
        if !released.frames_mut().is_empty() {
            return Err("the allocator kept frames the pool released".into());
        }
        self.check_pool()
    }

    /// The end of a run: the pool flushed and every frame it held freed.
    pub(super) fn drain_pool(&mut self, c: &MockCpu<'m, M>) -> Result<(), String> {
        let released = self.pool.flush(c).map_err(crate_error)?;
        self.free_from_pool(released)?;
        if !self.pool.is_empty() {
            return Err("the pool is not empty after its flush".into());
        }
        Ok(())
    }

    /// The pool holds the frames the bookkeeping says, each allocated,
    /// unmapped and held by nothing else.
    pub(super) fn check_pool(&self) -> Result<(), String> {
        if self.pool.len() != self.pooled.len() {
            return Err(format!(
                "the pool holds {} frames, the bookkeeping {:?}",
                self.pool.len(),
                self.pooled
            ));
        }
        for &f in &self.pooled {
            let alone = self.holders.get(&f) == Some(&1) && self.rmap.mapcount(f) == 0;
            if !alone || self.m.frame_state(f) != Ok(FrameState::InUse) {
                return Err(format!("pooled {f:?} is not the pool's alone"));
            }
        }
        Ok(())
    }
}
