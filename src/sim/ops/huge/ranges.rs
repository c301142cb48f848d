//! The huge space's steps that run the crate's range and migration
//! drivers: `change_protection` (a huge page taken whole, or refused when
//! covered in part), `migrate_pages` (a huge page refused) and an
//! `MmuGather` teardown that frees the leaf tables.

use core::sync::atomic::Ordering;
use std::format;
use std::string::String;
use std::vec::Vec;

use super::backing::HugeKernel;
use super::driver::{crate_error, region_range, HugeDriver, ACCESSED_DIRTY};
use super::table::{upper, Upper};
use super::{region_va, HUGE, PIECES, REGIONS};
use crate::gather::{MmuGather, TableFreePolicy};
use crate::migrate::{migrate_pages, MigrateOutcome};
use crate::mprotect::change_protection;
use crate::pte::{Pte, PteFlags, PAGE_SIZE};
use crate::range::{PageRange, TABLE_PAGES};
use crate::rmap::PageTable;
use crate::sim::ops::CPUS;
use crate::sim::Model;
use crate::unmap::{OwnedFrame, UnmapBatch};
use crate::Error;

impl<M: Model> HugeDriver<'_, M> {
    /// The upper entry of `region` without the bits hardware may set.
    fn settled(&self, region: usize) -> u64 {
        self.upper_word(region).load(Ordering::SeqCst) & !ACCESSED_DIRTY
    }

    /// `HugeOp::Protect`: read-only (or writable again) over the region or
    /// part of it; a range over part of a huge page refused with the entry
    /// as it was; no stale entry left after it returns.
    pub(super) fn protect(
        &mut self,
        cpu: u8,
        region: usize,
        (first, count): (u8, u8),
        writable: bool,
        fail: bool,
    ) -> Result<(), String> {
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        let region = region % REGIONS;
        let range = match count % 4 {
            0 => region_range(region)?,
            n => {
                let piece = PIECES[usize::from(first) % PIECES.len()];
                let pages = u64::from(n).min(TABLE_PAGES - piece);
                PageRange::new(region_va(region) + piece * PAGE_SIZE, pages).map_err(crate_error)?
            }
        };
        let partial_huge = matches!(
            upper(self.upper_word(region).load(Ordering::SeqCst)),
            Upper::Huge(_)
        ) && range.pages() != TABLE_PAGES;
        let before = self.settled(region);
        let bit = PteFlags::WRITABLE.bits();
        let update = |p: Pte| if writable { Pte(p.0 | bit) } else { Pte(p.0 & !bit) };
        if fail {
            // Its result does not matter: the call below must finish it.
            let _ = c
                .in_shootdown(|| change_protection(&c, &self.space, range, update))
                .map_err(crate_error)?;
        }
        let result = change_protection(&c, &self.space, range, update);
        if partial_huge {
            return match result {
                Err(Error::HugePage { .. }) if self.settled(region) == before => Ok(()),
                other => Err(format!("part of a huge page protected: {other:?}")),
            };
        }
        result.map_err(crate_error)?;
        self.m.check_coherent(self.mm(), range);
        Ok(())
    }

    /// `HugeOp::Migrate`: a 4 KiB frame moves; a huge page's frame (any
    /// piece) is refused, still mapped as it was.
    pub(super) fn migrate(&mut self, cpu: u8, va: u64) -> Result<(), String> {
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        let pte = self.space.lookup(va);
        if !pte.is_present() {
            return Ok(());
        }
        let huge = self.space.entry_size(va) == HUGE;
        let region = ((va - region_va(0)) / HUGE.bytes()) as usize;
        let before = self.settled(region);
        // SAFETY: the huge space maps each frame once and the driver frees
        // a mapped frame only through its mapping's removal: this handle is
        // the one claim on it, given back below or freed by the migration.
        let handle = unsafe { OwnedFrame::new(pte.frame()) };
        let mut outcomes = Vec::new();
        {
            let rmap = self.rmap();
            let mut kernel = HugeKernel {
                m: self.m,
                whole: &mut Vec::new(),
            };
            let mut report = |o: MigrateOutcome| outcomes.push(o);
            let mut batch = UnmapBatch::<1>::new();
            if let Err(retry) = migrate_pages(&c, &rmap, &mut kernel, &mut batch, [handle], &mut report) {
                retry
                    .retry(&c, &rmap, &mut kernel, &mut report)
                    .map_err(|r| format!("migration retry failed: {:?}", r.error()))?;
            }
        }
        match (outcomes.as_slice(), huge) {
            ([MigrateOutcome::Failed { .. }], true) if self.settled(region) == before => {}
            ([MigrateOutcome::Migrated { .. } | MigrateOutcome::Failed { .. }], false) => {}
            (o, _) => return Err(format!("migration of {va:#x} (huge: {huge}): {o:?}")),
        }
        for o in outcomes {
            match o {
                // The new frame's claim is its mapping's now.
                MigrateOutcome::Migrated { new, .. } => {
                    let _ = new.into_frame();
                }
                MigrateOutcome::Failed { frame, .. } | MigrateOutcome::OldFrameRefused(frame) => {
                    let _ = frame.into_frame();
                }
            }
        }
        Ok(())
    }

    /// `HugeOp::Teardown`: the whole space unmapped, its leaf tables freed
    /// after the flush, finished after an injected failure.
    pub(super) fn teardown(&mut self, cpu: u8, fail: bool) -> Result<(), String> {
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        let range = PageRange::new(region_va(0), REGIONS as u64 * TABLE_PAGES).map_err(crate_error)?;
        let mut policy = if usize::from(cpu) / CPUS % 2 == 1 {
            TableFreePolicy::IpiSync
        } else {
            TableFreePolicy::AfterFlush
        };
        let space = &self.space;
        let mut kernel = HugeKernel {
            m: self.m,
            whole: &mut self.whole,
        };
        let mut gather = MmuGather::<8>::new();
        if fail {
            let first = c
                .in_shootdown(|| {
                    gather.unmap_range(&c, space, &mut kernel, range, true, &mut policy, &mut |_, _| {})
                })
                .map_err(crate_error)?;
            if first.is_err() {
                // The documented way back: finish what is pending.
                gather
                    .finish(&c, space, &mut kernel, &mut policy, &mut |_, _| {})
                    .map_err(crate_error)?;
            }
        }
        gather
            .unmap_range(&c, space, &mut kernel, range, true, &mut policy, &mut |_, _| {})
            .map_err(crate_error)?;
        self.m.check_coherent(self.mm(), range);
        Ok(())
    }
}
