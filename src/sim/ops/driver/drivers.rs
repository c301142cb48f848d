//! The operation model's steps that run the crate's drivers (migration,
//! mprotect, teardown; reclaim is with the pool, in `pool.rs`), each with
//! an injected failure and the documented retry when the operation asks
//! for one.

use std::format;
use std::string::String;
use std::vec::Vec;

use super::super::backing::OpsKernel;
use super::super::{va, CPUS, PAGES, SPACES};
use super::{at, crate_error, Driver};
use crate::gather::{MmuGather, TableFreePolicy};
use crate::migrate::{migrate_pages, MigrateOutcome};
use crate::mprotect::change_protection;
use crate::pte::{Pte, PteFlags};
use crate::range::{PageRange, TABLE_PAGES, TABLE_SPAN};
use crate::sim::Model;
use crate::unmap::UnmapBatch;

impl<'m, M: Model> Driver<'m, M> {
    /// `Op::Migrate`: one frame through the migration driver, with its
    /// documented retry.
    pub(super) fn migrate(
        &mut self,
        cpu: u8,
        space: u8,
        page: u8,
        no_memory: bool,
        fail: bool,
    ) -> Result<(), String> {
        let (s, p) = at(space, page);
        let (Some(c), Some(f)) = (self.cpu(cpu), self.free_to_take(s, p)) else {
            return Ok(());
        };
        let handle = self.hold(f);
        let mut outcomes = Vec::new();
        {
            let rmap = &self.rmap;
            let mut kernel = OpsKernel::for_migration(self.m, &self.rmap, &mut self.holders, no_memory);
            let mut report = |o: MigrateOutcome| outcomes.push(o);
            let mut batch = UnmapBatch::<1>::new();
            let first = if fail {
                c.in_shootdown(|| migrate_pages(&c, rmap, &mut kernel, &mut batch, [handle], &mut report))
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
        Ok(())
    }

    /// `Op::Protect`: a range made read-only, retried after an injected
    /// failure; no stale entry may survive.
    pub(super) fn protect(
        &mut self,
        cpu: u8,
        space: u8,
        first: u8,
        count: u8,
        fail: bool,
    ) -> Result<(), String> {
        let m = self.m;
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
        Ok(())
    }

    /// `Op::Teardown`: a whole address space unmapped with its tables
    /// freed, finished after an injected failure.
    pub(super) fn teardown(&mut self, cpu: u8, space: u8, fail: bool) -> Result<(), String> {
        let m = self.m;
        let s = usize::from(space) % (SPACES + 1);
        let Some(c) = self.cpu(cpu) else {
            return Ok(());
        };
        // The whole leaf table that holds the space's pages (the kernel's
        // ends at the last page of the address space), so that the table
        // itself is detached and freed after its flush.
        let range = PageRange::new(va(s, 0) & !(TABLE_SPAN - 1), TABLE_PAGES).map_err(crate_error)?;
        let space_ref = &self.rmap.spaces()[s];
        let mut kernel = OpsKernel::for_teardown(self.m, &self.rmap, &mut self.holders);
        let mut gather = MmuGather::<8>::new();
        // The CPU number's upper part picks the policy (its remainder picks
        // the CPU), so that both run without changing the input format.
        let mut policy = if usize::from(cpu) / CPUS % 2 == 1 {
            TableFreePolicy::IpiSync
        } else {
            TableFreePolicy::AfterFlush
        };
        // Frames still mapped elsewhere or held stay: the handle was the
        // mapping's own claim.
        let unmap_all = |gather: &mut MmuGather<8>, kernel: &mut OpsKernel<'_, '_, 'm, M>, policy: &mut _| {
            gather.unmap_range(&c, space_ref, kernel, range, true, policy, &mut |_, _| {})
        };
        if fail {
            let first = c
                .in_shootdown(|| unmap_all(&mut gather, &mut kernel, &mut policy))
                .map_err(crate_error)?;
            if first.is_err() {
                // The documented way back: finish what is pending.
                gather
                    .finish(&c, space_ref, &mut kernel, &mut policy, &mut |_, _| {})
                    .map_err(crate_error)?;
            }
        }
        unmap_all(&mut gather, &mut kernel, &mut policy).map_err(crate_error)?;
        m.check_coherent(self.mm(s), range);
        Ok(())
    }
}
