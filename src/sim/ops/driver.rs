//! The kernel the operation model plays: it carries out each [`Op`] the way
//! a kernel using the crate would, keeps frames by reference counts, and
//! checks what the crate promises after each step.

// The drivers hand back their retry values by value.
#![allow(clippy::result_large_err)]

use std::format;
use std::string::String;
use std::sync::Arc;
use std::vec::Vec;

mod drivers;
mod hostile;
mod pool;

use super::backing::{put, Holders};
use super::huge::HugeDriver;
use super::{va, EndState, BATCHES};
use super::{Op, CPUS, FRAMES, PAGES, POOL_FRAMES, SPACES};
use crate::arch::Asid;
use crate::batch::TlbFlushUnmapBatch;
use crate::mm::{flush_tlb_batched_pending, MmTlbState};
use crate::pool::FramePool;
use crate::pte::{Frame, Pte};
use crate::rmap::{page_referenced, try_to_unmap, MappingFlags, PageTable, TtuFlags};
use crate::sim::{FrameState, MockCpu, MockMachine, MockRmap, MockSpace, Model};
use crate::unmap::{OwnedFrame, Released, UnmapBatch, Unmapped};
use crate::Error;

/// Frames a typed batch holds.
const TYPED: usize = 4;

/// A frame the low-level API touched: the batches that may owe a flush for
/// one of its removed mappings, and whether it is wholly unmapped (then it
/// waits for a write-out or a free). The driver holds it until then.
struct Pending {
    frame: Frame,
    batches: u8,
    unmapped: bool,
}

pub(super) struct Driver<'m, M: Model> {
    m: &'m MockMachine<M>,
    rmap: MockRmap<'m, M>,
    holders: Holders,
    low: [TlbFlushUnmapBatch; BATCHES],
    pending: Vec<Pending>,
    typed: [UnmapBatch<TYPED>; BATCHES],
    under_io: Vec<Frame>,
    /// The pool pooled reclaims fill, kept across steps (a batching run
    /// only), and the frames it holds, each with one hold in `holders`.
    pool: FramePool<POOL_FRAMES>,
    pooled: Vec<Frame>,
    /// The huge address space and its steps.
    huge: HugeDriver<'m, M>,
    batching: bool,
}

/// The (space, page) an operation's raw numbers name.
fn at(space: u8, page: u8) -> (usize, usize) {
    (usize::from(space) % (SPACES + 1), usize::from(page) % PAGES)
}

fn crate_error(e: Error) -> String {
    format!("crate error: {e}")
}

impl<'m, M: Model> Driver<'m, M> {
    pub(super) fn new(m: &'m MockMachine<M>, batching: bool) -> Result<Self, String> {
        let mut spaces = Vec::new();
        for i in 0..SPACES {
            let asid = Asid::new(i as u16 + 1).map_err(crate_error)?;
            let mm = m.new_mm(asid).map_err(|e| format!("{e:?}"))?;
            spaces.push(m.space(&mm));
        }
        spaces.push(m.space(m.kernel_mm()));
        Ok(Driver {
            m,
            rmap: MockRmap::new(m, spaces),
            holders: Holders::new(),
            low: [TlbFlushUnmapBatch::new(), TlbFlushUnmapBatch::new()],
            pending: Vec::new(),
            typed: [UnmapBatch::new(), UnmapBatch::new()],
            under_io: Vec::new(),
            pool: FramePool::new(),
            pooled: Vec::new(),
            huge: HugeDriver::new(m, batching)?,
            batching,
        })
    }

    fn space(&self, s: usize) -> &MockSpace<'m, M> {
        &self.rmap.spaces()[s]
    }

    fn mm(&self, s: usize) -> &Arc<MmTlbState> {
        self.space(s).mm()
    }

    /// The CPU named by `cpu`, if it is online (an offline one runs
    /// nothing).
    fn cpu(&self, cpu: u8) -> Option<MockCpu<'m, M>> {
        let c = self.m.cpu(usize::from(cpu) % CPUS).ok()?;
        self.m.online().contains(c.id()).then_some(c)
    }

    /// Some online CPU, to run what a fault handler would.
    fn any_cpu(&self) -> Result<MockCpu<'m, M>, String> {
        self.m
            .cpus()
            .find(|c| self.m.online().contains(c.id()))
            .ok_or_else(|| String::from("no CPU online"))
    }

    fn frame_at(&self, s: usize, p: usize) -> Option<Frame> {
        let pte = self.space(s).lookup(va(s, p));
        pte.is_present().then(|| pte.frame())
    }

    /// A frame mapped at (`space`, `page`) that nothing holds: what a
    /// reclaimer or a migration may pick.
    fn free_to_take(&self, s: usize, p: usize) -> Option<Frame> {
        self.frame_at(s, p).filter(|f| !self.holders.contains_key(f))
    }

    /// A frame mapped at (`space`, `page`) that the low-level unmaps may
    /// pick: one nothing holds, or one only they hold (its pending entry's
    /// claim). A frame a typed batch or a driver's retry value holds is
    /// another path's, as a page under another reclaimer's lock is in a
    /// kernel: it may still owe that holder's deferred flush, which the
    /// low-level write-out and free below know nothing of.
    fn low_level_frame_at(&self, s: usize, p: usize) -> Option<Frame> {
        let f = self.frame_at(s, p)?;
        let ours = u32::from(self.pending.iter().any(|q| q.frame == f));
        (self.holders.get(&f).copied().unwrap_or(0) <= ours).then_some(f)
    }

    fn hold(&mut self, frame: Frame) -> OwnedFrame {
        *self.holders.entry(frame).or_insert(0) += 1;
        // SAFETY: the driver counts every claim it hands out (`holders`),
        // and a frame is freed only when none is left (`put`).
        unsafe { OwnedFrame::new(frame) }
    }

    fn put(&mut self, frame: Frame) {
        put(self.m, &self.rmap, &mut self.holders, frame);
    }

    /// Every frame that no CPU may reach any more through a stale entry
    /// after low-level batch `b` was flushed: its debt is paid.
    fn flushed_low(&mut self, b: usize) {
        let bit = 1u8 << b;
        let mut released = Vec::new();
        for p in &mut self.pending {
            p.batches &= !bit;
        }
        self.pending.retain(|p| {
            let done = p.batches == 0 && !p.unmapped;
            if done {
                released.push(p.frame);
            }
            !done
        });
        for f in released {
            self.put(f);
        }
    }

    fn flush_low(&mut self, c: &MockCpu<'m, M>, b: usize, fail: bool) -> Result<(), String> {
        if fail {
            let first = c.in_shootdown(|| self.low[b].flush(c)).map_err(crate_error)?;
            if first.is_err() && self.low[b].is_empty() {
                return Err("a failed flush emptied the batch".into());
            }
        }
        // The documented retry (or the plain flush).
        self.low[b].flush(c).map_err(crate_error)?;
        self.flushed_low(b);
        Ok(())
    }

    fn flush_typed(&mut self, c: &MockCpu<'m, M>, b: usize, fail: bool, pool_it: bool) -> Result<(), String> {
        if pool_it && !fail && self.batching {
            // Into the driver's pool instead, if it takes the batch: frames
            // unmapped by typed unmaps, which may skip the aging (ignoring
            // accessed bits), so a generation that takes an aging epoch
            // must have found every bit clear.
            let frames: Vec<Frame> = self.typed[b].held().iter().map(|h| h.frame.frame()).collect();
            if let Ok(n) = self.pool.defer(c, &mut self.typed[b]) {
                if n != frames.len() || !self.typed[b].is_empty() {
                    return Err(format!("defer took {n} of {} frames", frames.len()));
                }
                self.pooled.extend(frames);
                return self.check_pool();
            }
        }
        if fail {
            let held = self.typed[b].len();
            match c.in_shootdown(|| self.typed[b].flush(c)).map_err(crate_error)? {
                // Nothing was owed, so nothing could fail.
                Ok(flushed) => return self.put_flushed(flushed),
                Err(_) if self.typed[b].len() != held => return Err("a failed flush lost frames".into()),
                Err(_) => {}
            }
        }
        // The documented retry (or the plain flush).
        let flushed = self.typed[b].flush(c).map_err(crate_error)?;
        self.put_flushed(flushed)
    }

    fn put_flushed(&mut self, flushed: crate::unmap::Flushed<TYPED>) -> Result<(), String> {
        for released in flushed {
            match released {
                Released::Unmapped(f) | Released::StillMapped(f, _) => self.put(f.into_frame()),
            }
        }
        Ok(())
    }

    pub(super) fn step(&mut self, step: usize, op: Op) -> Result<(), String> {
        let m = self.m;
        match op {
            Op::Map {
                space,
                page,
                writable,
            } => {
                let (s, p) = at(space, page);
                if self.space(s).lookup(va(s, p)) != Pte::EMPTY {
                    return Ok(());
                }
                // Rule 5 at fault time: a CPU may still write through a
                // stale entry for this address into the frame a reclaimer
                // unmapped; a new frame goes in only after that batch is
                // flushed.
                let c = self.any_cpu()?;
                flush_tlb_batched_pending(&c, self.mm(s)).map_err(crate_error)?;
                if let Ok(f) = m.alloc_frame() {
                    self.rmap
                        .map_fresh(f, s, va(s, p), writable, MappingFlags::empty())
                        .map_err(|e| format!("{e:?}"))?;
                    // The fault came from a CPU running the space (if one
                    // does, not lazily), which reads the page as it returns.
                    let running = m.cpus().find(|c| {
                        m.online().contains(c.id())
                            && !c.is_lazy()
                            && c.current_mm().is_some_and(|cur| Arc::ptr_eq(&cur, self.mm(s)))
                    });
                    if let Some(c) = running {
                        c.read(va(s, p))
                            .map_err(|e| format!("a fresh mapping faulted: {e:?}"))?;
                    }
                }
            }
            Op::Share { space, page } => {
                let (s, p) = at(space, page);
                if s >= SPACES {
                    return Ok(());
                }
                let o = (s + 1) % SPACES;
                let pte = self.space(s).lookup(va(s, p));
                if pte.is_present() && self.space(o).lookup(va(o, p)) == Pte::EMPTY {
                    let c = self.any_cpu()?;
                    flush_tlb_batched_pending(&c, self.mm(o)).map_err(crate_error)?;
                    self.rmap
                        .map(pte.frame(), o, va(o, p), pte.is_writable(), MappingFlags::SHARED)
                        .map_err(|e| format!("{e:?}"))?;
                }
            }
            Op::Access {
                cpu,
                space,
                page,
                write,
                tick,
            } => {
                let (s, p) = at(space, page);
                let Some(c) = self.cpu(cpu) else {
                    return Ok(());
                };
                // A lazy CPU resumes user code through `switch_mm` (to the
                // space it is lazy on: the crate's catch-up, then the
                // oracle's judgement), as does a CPU that runs another space.
                if s < SPACES
                    && (c.is_lazy() || c.current_mm().is_none_or(|cur| !Arc::ptr_eq(&cur, self.mm(s))))
                {
                    c.switch_to(self.mm(s)).map_err(|e| format!("{e:?}"))?;
                }
                // Faults are normal (unmapped, protected pages).
                let _ = if write {
                    c.write(va(s, p), step as u64)
                } else {
                    c.read(va(s, p)).map(|_| ())
                };
                if tick {
                    self.tick(cpu)?;
                }
            }
            Op::Switch { cpu, space } => {
                let s = usize::from(space) % SPACES;
                if let Some(c) = self.cpu(cpu) {
                    if c.current_mm().is_some_and(|cur| Arc::ptr_eq(&cur, self.mm(s))) {
                        // A switch to the space it runs: the CPU goes idle
                        // (or runs a kernel thread) lazily on it.
                        let _ = c.enter_lazy();
                    } else {
                        c.switch_to(self.mm(s)).map_err(|e| format!("{e:?}"))?;
                    }
                }
            }
            Op::Unmap {
                cpu,
                space,
                page,
                batch,
                batched,
                ignore_access,
            } => {
                let (s, p) = at(space, page);
                let b = usize::from(batch) % BATCHES;
                let (Some(c), Some(f)) = (self.cpu(cpu), self.low_level_frame_at(s, p)) else {
                    return Ok(());
                };
                let mut flags = TtuFlags::empty();
                if ignore_access {
                    flags |= TtuFlags::IGNORE_ACCESS;
                }
                if batched && self.batching {
                    flags |= TtuFlags::BATCH_FLUSH;
                }
                // Held until the batch is flushed (and, unmapped, freed).
                match self.pending.iter_mut().find(|q| q.frame == f) {
                    Some(q) => q.batches |= 1 << b,
                    None => {
                        let _claim = self.hold(f);
                        self.pending.push(Pending {
                            frame: f,
                            batches: 1 << b,
                            unmapped: false,
                        });
                    }
                }
                let r = try_to_unmap(&c, &self.rmap, f, flags, &mut self.low[b]).map_err(crate_error)?;
                if r.is_unmapped() {
                    if let Some(q) = self.pending.iter_mut().find(|q| q.frame == f) {
                        q.unmapped = true;
                    }
                }
            }
            Op::TypedUnmap {
                cpu,
                space,
                page,
                batch,
                ignore_access,
            } => {
                let (s, p) = at(space, page);
                let b = usize::from(batch) % BATCHES;
                let (Some(c), Some(f)) = (self.cpu(cpu), self.free_to_take(s, p)) else {
                    return Ok(());
                };
                let flags = if ignore_access {
                    TtuFlags::IGNORE_ACCESS
                } else {
                    TtuFlags::empty()
                };
                let handle = self.hold(f);
                match self.typed[b].try_to_unmap(&c, &self.rmap, handle, flags) {
                    Ok(Unmapped::Held(_) | Unmapped::HeldMapped(_)) => {}
                    Ok(Unmapped::Returned { frame, .. } | Unmapped::Full(frame)) => {
                        self.put(frame.into_frame())
                    }
                    Err((frame, e)) => return Err(format!("typed unmap of {:?}: {e}", frame.frame())),
                }
            }
            Op::Referenced {
                cpu,
                space,
                page,
                batch,
            } => {
                let (s, p) = at(space, page);
                let b = usize::from(batch) % BATCHES;
                if let (Some(c), Some(f)) = (self.cpu(cpu), self.frame_at(s, p)) {
                    page_referenced(&c, &self.rmap, f, &mut self.low[b]).map_err(crate_error)?;
                }
            }
            Op::Flush {
                cpu,
                batch,
                typed,
                fail,
            } => {
                let b = usize::from(batch) % BATCHES;
                let pool_it = (usize::from(batch) / BATCHES) % 2 == 1;
                if let Some(c) = self.cpu(cpu) {
                    if typed {
                        self.flush_typed(&c, b, fail, pool_it)?;
                    } else {
                        self.flush_low(&c, b, fail)?;
                    }
                }
            }
            Op::FlushDirty {
                cpu,
                batch,
                typed,
                fail,
            } => {
                let b = usize::from(batch) % BATCHES;
                let Some(c) = self.cpu(cpu) else {
                    return Ok(());
                };
                if fail {
                    let failed = if typed {
                        c.in_shootdown(|| self.typed[b].flush_dirty(&c).map(|_| ()))
                    } else {
                        c.in_shootdown(|| self.low[b].flush_dirty(&c).map(|_| ()))
                    };
                    failed.map_err(crate_error)?.ok();
                }
                if typed {
                    let io = self.typed[b].flush_dirty(&c).map_err(crate_error)?;
                    for page in io.frames() {
                        let f = page.frame();
                        if m.frame_dirty(f) == Ok(true) && m.frame_state(f) == Ok(FrameState::InUse) {
                            m.start_io(f).map_err(|e| format!("{e:?}"))?;
                            m.end_io(f).map_err(|e| format!("{e:?}"))?;
                        }
                    }
                } else if self.low[b].flush_dirty(&c).map_err(crate_error)?.is_some() {
                    self.flushed_low(b);
                }
            }
            Op::WriteOut { index } => {
                let unmapped: Vec<usize> = (0..self.pending.len())
                    .filter(|&i| self.pending[i].unmapped)
                    .collect();
                if unmapped.is_empty() {
                    return Ok(());
                }
                let i = unmapped[usize::from(index) % unmapped.len()];
                let (f, batches) = (self.pending[i].frame, self.pending[i].batches);
                if m.frame_dirty(f) == Ok(true) && m.frame_state(f) == Ok(FrameState::InUse) {
                    // The protocol: no I/O before the dirty flush of every
                    // batch that may owe one for the frame.
                    let c = self.any_cpu()?;
                    for b in 0..BATCHES {
                        if batches & (1 << b) != 0
                            && self.low[b].flush_dirty(&c).map_err(crate_error)?.is_some()
                        {
                            self.flushed_low(b);
                        }
                    }
                    m.start_io(f).map_err(|e| format!("{e:?}"))?;
                    m.end_io(f).map_err(|e| format!("{e:?}"))?;
                }
            }
            Op::Free { index } => {
                let unmapped: Vec<usize> = (0..self.pending.len())
                    .filter(|&i| self.pending[i].unmapped)
                    .collect();
                if unmapped.is_empty() {
                    return Ok(());
                }
                let i = unmapped[usize::from(index) % unmapped.len()];
                let (f, batches) = (self.pending[i].frame, self.pending[i].batches);
                // The protocol: no free before the flush of every batch that
                // may owe one for the frame.
                let c = self.any_cpu()?;
                for b in 0..BATCHES {
                    if batches & (1 << b) != 0 {
                        self.flush_low(&c, b, false)?;
                    }
                }
                self.pending.retain(|q| q.frame != f);
                self.put(f);
            }
            Op::Reclaim {
                cpu,
                space,
                pages,
                io,
                refuse_free,
                fail,
                pooled,
                aged,
            } => self.reclaim(cpu, space, pages, (io, refuse_free), fail, pooled, aged)?,
            Op::EndIo { index } => {
                if !self.under_io.is_empty() {
                    let f = self.under_io.remove(usize::from(index) % self.under_io.len());
                    m.end_io(f).map_err(|e| format!("{e:?}"))?;
                    self.put(f);
                }
            }
            Op::Migrate {
                cpu,
                space,
                page,
                no_memory,
                fail,
            } => self.migrate(cpu, space, page, no_memory, fail)?,
            Op::Protect {
                cpu,
                space,
                first,
                count,
                fail,
            } => self.protect(cpu, space, first, count, fail)?,
            Op::Teardown { cpu, space, fail } => self.teardown(cpu, space, fail)?,
            Op::Offline { cpu } => {
                if let Some(c) = self.cpu(cpu) {
                    if m.online().len() > 1 {
                        c.go_offline();
                    }
                }
            }
            Op::Online { cpu } => {
                let c = m.cpu(usize::from(cpu) % CPUS).map_err(crate_error)?;
                if !m.online().contains(c.id()) {
                    c.come_online();
                }
            }
            Op::Hostile { cpu, kind } => {
                if let Some(c) = self.cpu(cpu) {
                    self.hostile(&c, kind)?;
                }
            }
            Op::Tick { cpu } => self.tick(cpu)?,
            Op::PoolFlush { cpu, fail, oldest } => self.pool_flush(cpu, fail, oldest)?,
            Op::Huge(op) => self.huge.step(op)?,
        }
        Ok(())
    }

    /// The end of a run: every batch and the pool flushed, every held frame
    /// put (an I/O under way completes first).
    pub(super) fn finish(&mut self) -> Result<(), String> {
        for cpu in 0..CPUS as u8 {
            self.step(0, Op::Online { cpu })?;
        }
        let c = self.any_cpu()?;
        for b in 0..BATCHES {
            self.flush_low(&c, b, false)?;
            self.flush_typed(&c, b, false, false)?;
        }
        self.drain_pool(&c)?;
        self.huge.finish()?;
        for f in core::mem::take(&mut self.under_io) {
            self.m.end_io(f).map_err(|e| format!("{e:?}"))?;
            self.put(f);
        }
        for q in core::mem::take(&mut self.pending) {
            self.put(q.frame);
        }
        if let Some((f, _)) = self.holders.iter().next() {
            return Err(format!("{f:?} is still held at the end"));
        }
        Ok(())
    }

    pub(super) fn end_state(&self) -> Result<EndState, String> {
        let mut mappings = Vec::new();
        for s in 0..=SPACES {
            for p in 0..PAGES {
                let pte = self.space(s).lookup(va(s, p));
                mappings.push(pte.is_present().then(|| (pte.frame(), pte.is_writable())));
            }
        }
        let mut frames = self.m.frame_states();
        frames.truncate(FRAMES);
        Ok(EndState {
            mappings,
            frames,
            huge: self.huge.end_state(),
        })
    }
}
