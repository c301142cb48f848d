//! The kernel the operation model plays: it carries out each [`Op`] the way
//! a kernel using the crate would, keeps frames by reference counts, and
//! checks what the crate promises after each step.

// The drivers hand back their retry values by value.
#![allow(clippy::result_large_err)]

use std::format;
use std::string::String;
use std::sync::Arc;
use std::vec::Vec;

use super::backing::{put, Holders, OpsKernel};
use super::{va, EndState, BATCHES};
use super::{BadInput, Io, Op, CPUS, FRAMES, PAGES, SPACES};
use crate::arch::Asid;
use crate::batch::TlbFlushUnmapBatch;
use crate::gather::{MmuGather, TableFreePolicy};
use crate::migrate::{migrate_pages, MigrateOutcome};
use crate::mm::{flush_tlb_batched_pending, flush_tlb_page, switch_mm, MmTlbState};
use crate::mprotect::change_protection;
use crate::pte::{Frame, Pte, PteFlags, PAGE_SIZE};
use crate::range::PageRange;
use crate::reclaim::{shrink_page_list, Verdict};
use crate::rmap::{page_referenced, try_to_unmap, MappingFlags, PageTable, Rmap, TtuFlags};
use crate::sim::{FrameState, MockCpu, MockMachine, MockRmap, MockSpace, TlbEntry};
use crate::unmap::{OwnedFrame, Released, UnmapBatch, Unmapped};
use crate::Error;

/// What bad input must not change: every entry of every space, every TLB
/// entry, every low-level batch's pending pages.
type Snapshot = (
    [[Pte; PAGES]; SPACES + 1],
    Vec<(crate::cpuset::CpuId, TlbEntry)>,
    [usize; BATCHES],
);

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

pub(super) struct Driver<'m> {
    m: &'m MockMachine,
    rmap: MockRmap<'m>,
    holders: Holders,
    low: [TlbFlushUnmapBatch; BATCHES],
    pending: Vec<Pending>,
    typed: [UnmapBatch<TYPED>; BATCHES],
    under_io: Vec<Frame>,
    batching: bool,
}

fn crate_error(e: Error) -> String {
    format!("crate error: {e}")
}

impl<'m> Driver<'m> {
    pub(super) fn new(m: &'m MockMachine, batching: bool) -> Result<Self, String> {
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
            batching,
        })
    }

    fn space(&self, s: usize) -> &MockSpace<'m> {
        &self.rmap.spaces()[s]
    }

    fn mm(&self, s: usize) -> &Arc<MmTlbState> {
        self.space(s).mm()
    }

    /// The CPU named by `cpu`, if it is online (an offline one runs
    /// nothing).
    fn cpu(&self, cpu: u8) -> Option<MockCpu<'m>> {
        let c = self.m.cpu(usize::from(cpu) % CPUS).ok()?;
        self.m.online().contains(c.id()).then_some(c)
    }

    /// Some online CPU, to run what a fault handler would.
    fn any_cpu(&self) -> Result<MockCpu<'m>, String> {
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

    fn flush_low(&mut self, c: &MockCpu<'m>, b: usize, fail: bool) -> Result<(), String> {
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

    fn flush_typed(&mut self, c: &MockCpu<'m>, b: usize, fail: bool) -> Result<(), String> {
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
        let at = |space: u8, page: u8| (usize::from(space) % (SPACES + 1), usize::from(page) % PAGES);
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
                        .map(f, s, va(s, p), writable, MappingFlags::empty())
                        .map_err(|e| format!("{e:?}"))?;
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
            } => {
                let (s, p) = at(space, page);
                let Some(c) = self.cpu(cpu) else {
                    return Ok(());
                };
                if s < SPACES && c.current_mm().map_or(true, |cur| !Arc::ptr_eq(&cur, self.mm(s))) {
                    c.switch_to(self.mm(s)).map_err(|e| format!("{e:?}"))?;
                }
                // Faults are normal (unmapped, protected pages).
                let _ = if write {
                    c.write(va(s, p), step as u64)
                } else {
                    c.read(va(s, p)).map(|_| ())
                };
            }
            Op::Switch { cpu, space } => {
                let s = usize::from(space) % SPACES;
                if let Some(c) = self.cpu(cpu) {
                    c.switch_to(self.mm(s)).map_err(|e| format!("{e:?}"))?;
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
                if let Some(c) = self.cpu(cpu) {
                    if typed {
                        self.flush_typed(&c, b, fail)?;
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
            } => {
                let s = usize::from(space) % (SPACES + 1);
                let Some(c) = self.cpu(cpu) else {
                    return Ok(());
                };
                let mut picked = Vec::new();
                for p in (0..PAGES).filter(|p| pages & (1 << p) != 0) {
                    if let Some(f) = self.free_to_take(s, p).filter(|f| !picked.contains(f)) {
                        picked.push(f);
                    }
                }
                let handles: Vec<OwnedFrame> = picked.iter().map(|&f| self.hold(f)).collect();
                let mut back: Vec<(Frame, Verdict)> = Vec::new();
                {
                    let rmap = &self.rmap;
                    let mut kernel = OpsKernel::new(
                        self.m,
                        &self.rmap,
                        &mut self.holders,
                        true,
                        io,
                        refuse_free,
                        false,
                    );
                    let mut handback = |f: OwnedFrame, v: Verdict| back.push((f.into_frame(), v));
                    let mut batch = UnmapBatch::<PAGES>::new();
                    let first = if fail {
                        c.in_shootdown(|| {
                            shrink_page_list(&c, rmap, &mut kernel, &mut batch, handles, &mut handback)
                        })
                        .map_err(crate_error)?
                    } else {
                        shrink_page_list(&c, rmap, &mut kernel, &mut batch, handles, &mut handback)
                    };
                    if let Err(retry) = first {
                        // The documented retry.
                        retry
                            .retry(&c, &mut kernel, &mut handback)
                            .map_err(|r| format!("reclaim retry failed: {:?}", r.error()))?;
                    }
                }
                for (f, verdict) in back {
                    if verdict == Verdict::Writeback {
                        self.under_io.push(f);
                    } else {
                        self.put(f);
                    }
                }
            }
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
            } => {
                let (s, p) = at(space, page);
                let (Some(c), Some(f)) = (self.cpu(cpu), self.free_to_take(s, p)) else {
                    return Ok(());
                };
                let handle = self.hold(f);
                let mut outcomes = Vec::new();
                {
                    let rmap = &self.rmap;
                    let mut kernel = OpsKernel::new(
                        self.m,
                        &self.rmap,
                        &mut self.holders,
                        true,
                        Io::Synchronous,
                        false,
                        no_memory,
                    );
                    let mut report = |o: MigrateOutcome| outcomes.push(o);
                    let mut batch = UnmapBatch::<1>::new();
                    let first = if fail {
                        c.in_shootdown(|| {
                            migrate_pages(&c, rmap, &mut kernel, &mut batch, [handle], &mut report)
                        })
                        .map_err(crate_error)?
                    } else {
                        migrate_pages(&c, rmap, &mut kernel, &mut batch, [handle], &mut report)
                    };
                    if let Err(retry) = first {
                        retry
                            .retry(&c, rmap, &mut kernel, &mut report)
                            .map_err(|r| format!("migration retry failed: {:?}", r.error()))?;
                    }
                }
                if outcomes.len() != 1 {
                    return Err(format!("one frame, {} outcomes: {outcomes:?}", outcomes.len()));
                }
                for o in outcomes {
                    match o {
                        // The new frame's own claim goes: its mapping keeps it.
                        MigrateOutcome::Migrated { new, .. } => {
                            let _ = new.into_frame();
                        }
                        MigrateOutcome::Failed { frame, .. } | MigrateOutcome::OldFrameRefused(frame) => {
                            self.put(frame.into_frame())
                        }
                    }
                }
            }
            Op::Protect {
                cpu,
                space,
                first,
                count,
                fail,
            } => {
                let (s, p) = at(space, first);
                let n = (usize::from(count) % (PAGES + 1)).min(PAGES - p);
                let Some(c) = self.cpu(cpu) else {
                    return Ok(());
                };
                let range = PageRange::new(va(s, p), n as u64).map_err(crate_error)?;
                let ro = |pte: Pte| Pte(pte.0 & !PteFlags::WRITABLE.bits());
                if fail {
                    // Its result does not matter: the retry must finish it.
                    let _ = c
                        .in_shootdown(|| change_protection(&c, self.space(s), range, ro))
                        .map_err(crate_error)?;
                }
                change_protection(&c, self.space(s), range, ro).map_err(crate_error)?;
                // No CPU may keep a stale entry in the range once it returned.
                m.check_coherent(self.mm(s), range);
            }
            Op::Teardown { cpu, space, fail } => {
                let s = usize::from(space) % (SPACES + 1);
                let Some(c) = self.cpu(cpu) else {
                    return Ok(());
                };
                let range = PageRange::new(va(s, 0), PAGES as u64).map_err(crate_error)?;
                let space_ref = &self.rmap.spaces()[s];
                let mut kernel = OpsKernel::new(
                    self.m,
                    &self.rmap,
                    &mut self.holders,
                    false,
                    Io::Synchronous,
                    false,
                    false,
                );
                let mut gather = MmuGather::<8>::new();
                let mut policy = TableFreePolicy::AfterFlush;
                // Frames still mapped elsewhere or held stay: the handle
                // was the mapping's own claim.
                let mut handback = |_: OwnedFrame, _| {};
                if fail {
                    let first = c
                        .in_shootdown(|| {
                            gather.unmap_range(
                                &c,
                                space_ref,
                                &mut kernel,
                                range,
                                true,
                                &mut policy,
                                &mut handback,
                            )
                        })
                        .map_err(crate_error)?;
                    if first.is_err() {
                        // The documented way back: finish what is pending.
                        gather
                            .finish(&c, space_ref, &mut kernel, &mut policy, &mut handback)
                            .map_err(crate_error)?;
                    }
                }
                gather
                    .unmap_range(
                        &c,
                        space_ref,
                        &mut kernel,
                        range,
                        true,
                        &mut policy,
                        &mut handback,
                    )
                    .map_err(crate_error)?;
                m.check_coherent(self.mm(s), range);
            }
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
        }
        Ok(())
    }

    fn snapshot(&self) -> Snapshot {
        let mut ptes = [[Pte::EMPTY; PAGES]; SPACES + 1];
        for (s, row) in ptes.iter_mut().enumerate() {
            for (p, pte) in row.iter_mut().enumerate() {
                *pte = self.space(s).lookup(va(s, p));
            }
        }
        let pending = [self.low[0].pending_pages(), self.low[1].pending_pages()];
        (ptes, self.m.all_entries(), pending)
    }

    fn hostile(&mut self, c: &MockCpu<'m>, kind: BadInput) -> Result<(), String> {
        let hole = 1u64 << 47;
        let before = self.snapshot();
        let result = match kind {
            BadInput::AddPending => {
                let mm = Arc::clone(self.mm(0));
                self.low[0].add_pending(c, &mm, hole, Pte::EMPTY)
            }
            BadInput::FlushPage => flush_tlb_page(c, self.mm(0), hole).map(|_| ()),
            BadInput::Protect => PageRange::new(hole - PAGE_SIZE, 2)
                .and_then(|r| change_protection(c, self.space(0), r, |p| p))
                .map(|_| ()),
            BadInput::Teardown => {
                let mut kernel = OpsKernel::new(
                    self.m,
                    &self.rmap,
                    &mut self.holders,
                    false,
                    Io::Synchronous,
                    false,
                    false,
                );
                let mut gather = MmuGather::<8>::new();
                match PageRange::new(hole, 1) {
                    Ok(r) => gather
                        .unmap_range(
                            c,
                            &self.rmap.spaces()[0],
                            &mut kernel,
                            r,
                            true,
                            &mut TableFreePolicy::AfterFlush,
                            &mut |_, _| {},
                        )
                        .map(|_| ()),
                    Err(e) => Err(e),
                }
            }
            BadInput::RmapAddress => {
                // A frame mapped somewhere, reported with a bad address
                // after its good one.
                let found = (0..=SPACES)
                    .flat_map(|s| (0..PAGES).map(move |p| (s, p)))
                    .find_map(|(s, p)| self.frame_at(s, p).map(|f| (s, p, f)));
                match found {
                    Some((s, p, f)) => {
                        let bad = BadRmap {
                            inner: &self.rmap,
                            good: (s, va(s, p)),
                            bad: hole,
                        };
                        try_to_unmap(c, &bad, f, TtuFlags::IGNORE_ACCESS, &mut self.low[0]).map(|_| ())
                    }
                    None => Err(Error::NonCanonical { addr: hole }),
                }
            }
            BadInput::WideAsid => {
                let asid = Asid::new(1 << 12).map_err(crate_error)?;
                let mm = MmTlbState::new(asid, 0);
                // SAFETY: refused before anything is loaded.
                unsafe { switch_mm(c, None, &mm) }
            }
            BadInput::PastTheTop => PageRange::new(va(SPACES, PAGES - 1), 2).map(|_| ()),
        };
        match result {
            Ok(()) => return Err(format!("{kind:?} was accepted")),
            Err(Error::NonCanonical { .. } | Error::AsidOutOfRange { .. } | Error::RangeOverflow { .. }) => {}
            Err(e) => return Err(format!("{kind:?} refused with the wrong error: {e}")),
        }
        if self.snapshot() != before {
            return Err(format!("{kind:?} was refused but changed something"));
        }
        Ok(())
    }

    /// The end of a run: every batch flushed, every held frame put (an I/O
    /// under way completes first).
    pub(super) fn finish(&mut self) -> Result<(), String> {
        for cpu in 0..CPUS as u8 {
            self.step(0, Op::Online { cpu })?;
        }
        let c = self.any_cpu()?;
        for b in 0..BATCHES {
            self.flush_low(&c, b, false)?;
            self.flush_typed(&c, b, false)?;
        }
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
        Ok(EndState { mappings, frames })
    }
}

/// A reverse map that reports one good mapping of a frame and then one at
/// a non-canonical address.
struct BadRmap<'a, 'm> {
    inner: &'a MockRmap<'m>,
    good: (usize, u64),
    bad: u64,
}

// SAFETY: the good mapping is a real one of the mock rmap; the bad one is
// an address no PTE can have, which the crate must refuse before it
// changes anything.
unsafe impl<'m> Rmap for BadRmap<'_, 'm> {
    type Space = MockSpace<'m>;

    fn walk(
        &self,
        _frame: Frame,
        visit: &mut dyn FnMut(crate::rmap::Mapping<'_, Self::Space>) -> core::ops::ControlFlow<()>,
    ) -> core::ops::ControlFlow<()> {
        let space = &self.inner.spaces()[self.good.0];
        for va in [self.good.1, self.bad] {
            visit(crate::rmap::Mapping {
                space,
                va,
                flags: MappingFlags::empty(),
            })?;
        }
        core::ops::ControlFlow::Continue(())
    }

    fn set_dirty(&self, frame: Frame) {
        self.inner.set_dirty(frame);
    }
}
