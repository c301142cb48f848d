//! The kernel the operation model plays on the huge address space: each
//! [`HugeOp`] carried out as a kernel using the crate would, frames kept
//! by their one mapping (or, unmapped, by the batch that owes their
//! flush), and what the crate promises checked after each step.

use core::sync::atomic::Ordering;
use std::format;
use std::string::String;
use std::sync::Arc;
use std::vec::Vec;

use super::backing::free_frame_or_huge;
use super::table::{huge_word, table_link, upper, HugeRmap, HugeSpace, HugeTable, Upper};
use super::{piece_va, region_va, HugeOp, HUGE, MOVED_PIECE, PIECES, REGIONS, RO_PIECE};
use crate::arch::Asid;
use crate::batch::TlbFlushUnmapBatch;
use crate::mm::flush_tlb_batched_pending;
use crate::page_size::PageSize;
use crate::pte::{Frame, Pte, PteFlags};
use crate::range::{PageRange, TABLE_PAGES};
use crate::rmap::{try_to_unmap, PageTable, TtuFlags};
use crate::sim::ops::{CPUS, SPACES};
use crate::sim::{lock, MockCpu, MockMachine, Model};
use crate::split::{BrokenMapping, FlushedBreak};
use crate::Error;

pub(super) fn crate_error(e: Error) -> String {
    format!("crate error: {e}")
}

fn flags(writable: bool) -> PteFlags {
    let mut f = PteFlags::PRESENT | PteFlags::USER;
    if writable {
        f |= PteFlags::WRITABLE;
    }
    f
}

pub(in crate::sim::ops) struct HugeDriver<'m, M: Model> {
    pub(super) m: &'m MockMachine<M>,
    pub(super) space: HugeSpace,
    batch: TlbFlushUnmapBatch,
    /// Frames unmapped into `batch` (first frames of 2 MiB frames among
    /// them), freed after its flush.
    unmapped: Vec<Frame>,
    /// The 2 MiB frames held whole (mapped by a 2 MiB entry, or unmapped
    /// as one and not yet freed), by first frame.
    pub(super) whole: Vec<Frame>,
    batching: bool,
}

impl<'m, M: Model> HugeDriver<'m, M> {
    pub(in crate::sim::ops) fn new(m: &'m MockMachine<M>, batching: bool) -> Result<Self, String> {
        let asid = Asid::new(SPACES as u16 + 1).map_err(crate_error)?;
        let mm = m.new_mm(asid).map_err(|e| format!("{e:?}"))?;
        let table = Arc::new(HugeTable::new());
        m.attach_table(&mm, table.clone()).map_err(|e| format!("{e:?}"))?;
        Ok(HugeDriver {
            m,
            space: HugeSpace { table, mm },
            batch: TlbFlushUnmapBatch::new(),
            unmapped: Vec::new(),
            whole: Vec::new(),
            batching,
        })
    }

    pub(super) fn mm(&self) -> &Arc<crate::mm::MmTlbState> {
        &self.space.mm
    }

    pub(super) fn rmap(&self) -> HugeRmap<'_, 'm, M> {
        HugeRmap {
            space: &self.space,
            m: self.m,
        }
    }

    pub(super) fn cpu(&self, cpu: u8) -> Option<MockCpu<'m, M>> {
        let c = self.m.cpu(usize::from(cpu) % CPUS).ok()?;
        self.m.online().contains(c.id()).then_some(c)
    }

    fn any_cpu(&self) -> Result<MockCpu<'m, M>, String> {
        self.m
            .cpus()
            .find(|c| self.m.online().contains(c.id()))
            .ok_or_else(|| String::from("no CPU online"))
    }

    fn runs(&self, c: &MockCpu<'m, M>) -> bool {
        c.current_mm().is_some_and(|cur| Arc::ptr_eq(&cur, self.mm()))
    }

    pub(super) fn upper_word(&self, region: usize) -> &core::sync::atomic::AtomicU64 {
        &self.space.table.regions[region % REGIONS].upper
    }

    /// What a fault's return does after a new mapping: a CPU running the
    /// space (not lazily) reads the address.
    fn fault_in(&self, va: u64) -> Result<(), String> {
        let running = self
            .m
            .cpus()
            .find(|c| self.m.online().contains(c.id()) && !c.is_lazy() && self.runs(c));
        if let Some(c) = running {
            c.read(va)
                .map_err(|e| format!("a fresh mapping faulted: {e:?}"))?;
        }
        Ok(())
    }

    /// Contract rule 5 before a new entry: a batched flush of the space
    /// still pending is done first.
    fn before_map(&self) -> Result<(), String> {
        let c = self.any_cpu()?;
        flush_tlb_batched_pending(&c, self.mm()).map_err(crate_error)?;
        Ok(())
    }

    pub(in crate::sim::ops) fn step(&mut self, op: HugeOp) -> Result<(), String> {
        match op {
            HugeOp::MapHuge { region, writable } => self.map_huge(usize::from(region), writable),
            HugeOp::MapSmall {
                region,
                piece,
                writable,
            } => self.map_small(usize::from(region), usize::from(piece), writable),
            HugeOp::Access {
                cpu,
                region,
                piece,
                write,
            } => {
                let Some(c) = self.cpu(cpu) else {
                    return Ok(());
                };
                if c.is_lazy() || !self.runs(&c) {
                    c.switch_to(self.mm()).map_err(|e| format!("{e:?}"))?;
                }
                let va = piece_va(usize::from(region), usize::from(piece));
                // Faults are normal (unmapped, protected pages).
                let _ = if write {
                    c.write(va, va ^ 0x5a5a)
                } else {
                    c.read(va).map(|_| ())
                };
                Ok(())
            }
            HugeOp::Lazy { cpu } => {
                if let Some(c) = self.cpu(cpu) {
                    if self.runs(&c) && !c.is_lazy() {
                        c.enter_lazy().map_err(|e| format!("{e:?}"))?;
                    }
                }
                Ok(())
            }
            HugeOp::Split {
                cpu,
                region,
                change,
                fail,
            } => self.split(cpu, usize::from(region), change % 3, fail),
            HugeOp::Promote { cpu, region, fail } => self.promote(cpu, usize::from(region), fail),
            HugeOp::Unmap {
                cpu,
                region,
                piece,
                batched,
            } => self.unmap(cpu, piece_va(usize::from(region), usize::from(piece)), batched),
            HugeOp::Flush { cpu, fail } => match self.cpu(cpu) {
                Some(c) => self.flush(&c, fail),
                None => Ok(()),
            },
            HugeOp::Protect {
                cpu,
                region,
                first,
                count,
                writable,
                fail,
            } => self.protect(cpu, usize::from(region), (first, count), writable, fail),
            HugeOp::Migrate { cpu, region, piece } => {
                self.migrate(cpu, piece_va(usize::from(region), usize::from(piece)))
            }
            HugeOp::Zap { cpu, region } => self.zap(cpu, usize::from(region)),
            HugeOp::Teardown { cpu, fail } => self.teardown(cpu, fail),
        }
    }

    fn map_huge(&mut self, region: usize, writable: bool) -> Result<(), String> {
        if self.upper_word(region).load(Ordering::SeqCst) != 0 {
            return Ok(());
        }
        self.before_map()?;
        let Ok(frame) = self.m.alloc_huge_frame(HUGE) else {
            return Ok(());
        };
        self.whole.push(frame);
        let word = huge_word(Pte::new(frame, flags(writable)));
        self.upper_word(region).store(word, Ordering::SeqCst);
        self.fault_in(region_va(region))
    }

    fn map_small(&mut self, region: usize, piece: usize, writable: bool) -> Result<(), String> {
        let va = piece_va(region, piece);
        let word = self.upper_word(region).load(Ordering::SeqCst);
        if matches!(upper(word), Upper::Huge(_)) || self.space.lookup(va) != Pte::EMPTY {
            return Ok(());
        }
        self.before_map()?;
        if word == 0 {
            let Ok(table) = lock(&self.m.memory).alloc_table() else {
                return Ok(());
            };
            self.upper_word(region).store(table_link(table), Ordering::SeqCst);
        }
        let Ok(frame) = self.m.alloc_frame() else {
            return Ok(());
        };
        self.space.set(va, Pte::new(frame, flags(writable)));
        self.fault_in(va)
    }

    /// Step 2 of a size change, with a failure injected first when `fail`
    /// (the break must come back with its flush owed) and the retry.
    fn flush_break<'a, T>(
        c: &MockCpu<'m, M>,
        broken: BrokenMapping<'a, T>,
        fail: bool,
    ) -> Result<FlushedBreak<T>, String> {
        let broken = if fail {
            match c.in_shootdown(|| broken.flush(c)).map_err(crate_error)? {
                Ok(flushed) => return Ok(flushed),
                Err(failed) => failed.broken,
            }
        } else {
            broken
        };
        broken.flush(c).map_err(|f| crate_error(f.error))
    }

    /// `HugeOp::Split`: break (the 2 MiB entry cleared), flush, make (a leaf
    /// table over the same frames, with `change`'s piece read-only or
    /// moved); the moved piece's old frame freed after the make.
    fn split(&mut self, cpu: u8, region: usize, change: u8, fail: bool) -> Result<(), String> {
        let m = self.m;
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        let Upper::Huge(old) = upper(self.upper_word(region).load(Ordering::SeqCst)) else {
            return Ok(());
        };
        // What the make needs, taken before the break.
        let Ok(table) = lock(&m.memory).alloc_table() else {
            return Ok(());
        };
        let moved = if change == 2 { m.alloc_frame().ok() } else { None };
        let r = &self.space.table.regions[region % REGIONS];
        let broken = split_or_promote(true, &c, self.mm(), region_va(region), || {
            r.upper.swap(0, Ordering::SeqCst)
        })?;
        let flushed = Self::flush_break(&c, broken, fail)?;
        let block = Frame(old.frame().0);
        flushed.make(|word| {
            // The hardware may have set A/D bits up to the break: the
            // cleared word has them.
            let bits = Pte(word).0 & !HUGE_FRAME_BITS & !super::table::HUGE_BIT;
            for (i, e) in r.leaf.iter().enumerate() {
                let i = i as u64;
                let mut pte = Pte(Frame(block.0 + i).addr() | bits);
                if change == 1 && i == RO_PIECE {
                    pte = Pte(pte.0 & !PteFlags::WRITABLE.bits());
                }
                if let (Some(to), MOVED_PIECE) = (moved, i) {
                    let _ = m.copy_frame(Frame(block.0 + i), to);
                    pte = pte.with_frame(to);
                }
                e.store(pte.0, Ordering::SeqCst);
            }
            r.upper.store(table_link(table), Ordering::SeqCst);
        });
        // Its frames are 4 KiB frames now, each mapped by its own entry.
        self.whole.retain(|&f| f != block);
        if moved.is_some() {
            let _ = m.free_frame(Frame(block.0 + MOVED_PIECE));
        }
        m.check_coherent(self.mm(), region_range(region)?);
        Ok(())
    }

    /// `HugeOp::Promote`: break (the table unlinked), flush, make (the
    /// pieces copied into a new 2 MiB frame, or kept in place, one 2 MiB
    /// entry written), then the table and the old frames freed.
    fn promote(&mut self, cpu: u8, region: usize, fail: bool) -> Result<(), String> {
        let m = self.m;
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        let Upper::Table(table) = upper(self.upper_word(region).load(Ordering::SeqCst)) else {
            return Ok(());
        };
        let r = &self.space.table.regions[region % REGIONS];
        let entries: Vec<(u64, Pte)> = r
            .leaf
            .iter()
            .enumerate()
            .map(|(i, e)| (i as u64, Pte(e.load(Ordering::SeqCst))))
            .filter(|(_, p)| *p != Pte::EMPTY)
            .collect();
        if entries.is_empty() || entries.iter().any(|(_, p)| !p.is_present()) {
            return Ok(());
        }
        let first = entries[0].1;
        let in_place = entries.len() as u64 == TABLE_PAGES
            && first.frame().0.is_multiple_of(TABLE_PAGES)
            && entries
                .iter()
                .all(|(i, p)| p.frame().0 == first.frame().0 + i && p.is_writable() == first.is_writable());
        let target = if in_place {
            first.frame()
        } else {
            match m.alloc_huge_frame(HUGE) {
                Ok(f) => f,
                Err(_) => return Ok(()),
            }
        };
        let broken = split_or_promote(false, &c, self.mm(), region_va(region), || {
            r.upper.swap(0, Ordering::SeqCst)
        })?;
        let flushed = Self::flush_break(&c, broken, fail)?;
        flushed.make(|_| {
            // The entries as the break left them (A/D bits up to it).
            let now: Vec<(u64, Pte)> = entries
                .iter()
                .map(|&(i, _)| (i, Pte(r.leaf[i as usize].swap(0, Ordering::SeqCst))))
                .collect();
            let writable = now.iter().all(|(_, p)| p.is_writable());
            let mut pte = Pte::new(target, flags(writable));
            for (i, p) in &now {
                if !in_place {
                    let _ = m.copy_frame(p.frame(), Frame(target.0 + i));
                }
                pte = Pte(pte.0 | (p.0 & (PteFlags::DIRTY | PteFlags::ACCESSED).bits()));
            }
            r.upper.store(huge_word(pte), Ordering::SeqCst);
            // After the flush: no CPU reaches the table or the old frames.
            let _ = m.free_frame(table);
            if !in_place {
                for (_, p) in &now {
                    let _ = m.free_frame(p.frame());
                }
            }
        });
        self.whole.push(target);
        m.check_coherent(self.mm(), region_range(region)?);
        Ok(())
    }

    /// `HugeOp::Zap`: the region's entries cleared by the kernel, flushed
    /// as one range of 4 KiB pages, their frames freed after the flush.
    fn zap(&mut self, cpu: u8, region: usize) -> Result<(), String> {
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        // Contract rule 5: a pending batched flush first.
        flush_tlb_batched_pending(&c, self.mm()).map_err(crate_error)?;
        let r = &self.space.table.regions[region % REGIONS];
        let mut freed = Vec::new();
        match upper(r.upper.load(Ordering::SeqCst)) {
            Upper::Empty => return Ok(()),
            Upper::Huge(_) => {
                let old = Pte(r.upper.swap(0, Ordering::SeqCst) & !super::table::HUGE_BIT);
                if old.is_dirty() {
                    let _ = self.m.set_frame_dirty(old.frame());
                }
                freed.push(old.frame());
            }
            Upper::Table(_) => {
                for e in &r.leaf {
                    let old = Pte(e.swap(0, Ordering::SeqCst));
                    if old.is_present() {
                        if old.is_dirty() {
                            let _ = self.m.set_frame_dirty(old.frame());
                        }
                        freed.push(old.frame());
                    }
                }
            }
        }
        let range = region_range(region)?;
        crate::flush_tlb_range(&c, self.mm(), range).map_err(crate_error)?;
        for f in freed {
            free_frame_or_huge(self.m, &mut self.whole, f);
        }
        self.m.check_coherent(self.mm(), range);
        Ok(())
    }

    /// `HugeOp::Unmap`: `try_to_unmap` of the frame at `va` into the
    /// space's batch; a piece of a huge page other than its first must be
    /// refused, with nothing changed.
    fn unmap(&mut self, cpu: u8, va: u64, batched: bool) -> Result<(), String> {
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        let pte = self.space.lookup(va);
        if !pte.is_present() {
            return Ok(());
        }
        let huge = self.space.entry_size(va) == HUGE;
        let mut flags = TtuFlags::IGNORE_ACCESS;
        if batched && self.batching {
            flags |= TtuFlags::BATCH_FLUSH;
        }
        let region = (va - region_va(0)) / HUGE.bytes();
        let before = self.upper_word(region as usize).load(Ordering::SeqCst);
        let rmap = HugeRmap {
            space: &self.space,
            m: self.m,
        };
        let result = try_to_unmap(&c, &rmap, pte.frame(), flags, &mut self.batch);
        if huge && !va.is_multiple_of(HUGE.bytes()) {
            let after = self.upper_word(region as usize).load(Ordering::SeqCst);
            return match result {
                Err(Error::HugePage { .. }) if after & !ACCESSED_DIRTY == before & !ACCESSED_DIRTY => Ok(()),
                other => Err(format!(
                    "a piece of a huge page: {other:?}, entry {before:#x} -> {after:#x}"
                )),
            };
        }
        if result.map_err(crate_error)?.is_unmapped() {
            self.unmapped.push(pte.frame());
        }
        Ok(())
    }

    /// `HugeOp::Flush`: the batch flushed (a failure injected first), then
    /// the frames it unmapped freed.
    fn flush(&mut self, c: &MockCpu<'m, M>, fail: bool) -> Result<(), String> {
        if fail {
            let first = c.in_shootdown(|| self.batch.flush(c)).map_err(crate_error)?;
            if first.is_err() && self.batch.is_empty() {
                return Err("a failed flush emptied the batch".into());
            }
        }
        self.batch.flush(c).map_err(crate_error)?;
        for f in core::mem::take(&mut self.unmapped) {
            free_frame_or_huge(self.m, &mut self.whole, f);
        }
        Ok(())
    }

    /// The end of a run: the batch flushed and its frames freed.
    pub(in crate::sim::ops) fn finish(&mut self) -> Result<(), String> {
        let c = self.any_cpu()?;
        self.flush(&c, false)
    }

    /// For the end state: each named piece's frame, writability and entry
    /// size.
    pub(in crate::sim::ops) fn end_state(&self) -> Vec<Option<(Frame, bool, PageSize)>> {
        let mut out = Vec::new();
        for region in 0..REGIONS {
            for piece in 0..PIECES.len() {
                let va = piece_va(region, piece);
                let pte = self.space.lookup(va);
                out.push(
                    pte.is_present()
                        .then(|| (pte.frame(), pte.is_writable(), self.space.entry_size(va))),
                );
            }
        }
        out
    }
}

/// The address bits of a 2 MiB entry (its frame), and the hardware's bits.
const HUGE_FRAME_BITS: u64 = 0x000f_ffff_ffe0_0000;
pub(super) const ACCESSED_DIRTY: u64 = PteFlags::ACCESSED.bits() | PteFlags::DIRTY.bits();

pub(super) fn region_range(region: usize) -> Result<PageRange, String> {
    PageRange::new(region_va(region), TABLE_PAGES).map_err(crate_error)
}

/// Step 1 of a split (`split`) or a promotion, at the huge page `va`.
fn split_or_promote<'a, A: crate::arch::Arch, T>(
    split: bool,
    c: &A,
    mm: &'a crate::mm::MmTlbState,
    va: u64,
    clear: impl FnOnce() -> T,
) -> Result<BrokenMapping<'a, T>, String> {
    let broken = if split {
        crate::split::split_huge_mapping(c, mm, va, HUGE, clear)
    } else {
        crate::split::promote_to_huge(c, mm, va, HUGE, clear)
    };
    broken.map_err(crate_error)
}
