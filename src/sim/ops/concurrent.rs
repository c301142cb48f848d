//! The operation model with concurrent initiators: every CPU is a real
//! thread on a machine with threaded IPI delivery, all run one address
//! space and read and write every page, and each one also changes the
//! mapping of a page of its own (unmap with a batched flush, free, map a
//! new frame; write-protect and back; migrate), so that shootdowns from
//! several CPUs cross each other, coalesce and meet CPUs that are
//! accessing memory, with interrupts on or off, or that are lazy or run
//! the kernel's space for a while (and catch up when they come back). The
//! TLBs are tagged or not. The oracle must see nothing.

use std::format;
use std::string::String;
use std::sync::Mutex;
use std::vec::Vec;

use super::{Failure, CPUS};
use crate::arch::Asid;
use crate::batch::TlbFlushUnmapBatch;
use crate::migrate::{migrate_pages, MigrateOutcome};
use crate::mm::flush_tlb_batched_pending;
use crate::mprotect::change_protection;
use crate::pte::{Pte, PteFlags, PAGE_SIZE};
use crate::range::PageRange;
use crate::rmap::{try_to_unmap, MappingFlags, PageTable, Rmap, TtuFlags};
use crate::sim::{MockConfig, MockCpu, MockKernel, MockMachine, MockRmap};
use crate::unmap::{OwnedFrame, UnmapBatch};

const BASE: u64 = 0x40_0000;

fn page_va(page: usize) -> u64 {
    BASE + (page % CPUS) as u64 * PAGE_SIZE
}

/// One CPU's step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum Step {
    /// Read or write any page (another CPU's too).
    Access {
        /// Which page.
        page: u8,
        /// Write rather than read.
        write: bool,
    },
    /// Unmap this CPU's page into its batch (deferred when `batched`),
    /// flush, free the frame, map a new one (rule 5 first).
    Remap {
        /// Defer the flush.
        batched: bool,
    },
    /// Write-protect this CPU's page, then make it writable again.
    Protect,
    /// Migrate this CPU's page to a new frame.
    Migrate,
    /// Turn interrupts off for a while (a shootdown this CPU starts must
    /// still complete, serving its inbox while it waits).
    InterruptsOff,
    /// Turn interrupts back on.
    InterruptsOn,
    /// Go lazy (the address space stays loaded; flushes skip this CPU),
    /// let the others run, then resume through `switch_mm`, which catches
    /// up by generation.
    Lazy,
    /// Switch to the kernel's address space (on a tagged TLB the entries
    /// stay under the ASID; this CPU leaves the space's CPU set), let the
    /// others run, and switch back.
    Away,
}

/// Runs `plans[c]` on CPU `c` (missing plans are empty), all CPUs at once,
/// with tagged TLBs or not. Errors: what the crate refused, or the
/// oracle's findings.
pub fn run_concurrent(tagged: bool, plans: &[Vec<Step>]) -> Result<(), Failure> {
    let fail = |reason: String, violations| Failure {
        step: 0,
        op: None,
        violations,
        reason,
    };
    let m = MockMachine::new(MockConfig {
        frames: 64,
        tlb_entries: 16,
        // Slow flushes widen the window a protocol that acknowledged before
        // flushing would leave open.
        flush_delay_us: 50,
        tagged_tlb: tagged,
        ..MockConfig::x86_like(CPUS).threaded()
    })
    .map_err(|e| fail(format!("{e}"), Vec::new()))?;
    let asid = Asid::new(1).map_err(|e| fail(format!("{e}"), Vec::new()))?;
    let mm = m.new_mm(asid).map_err(|e| fail(format!("{e:?}"), Vec::new()))?;
    let rmap = MockRmap::new(&m, std::vec![m.space(&mm)]);
    for page in 0..CPUS {
        let f = m.alloc_frame().map_err(|e| fail(format!("{e:?}"), Vec::new()))?;
        rmap.map(f, 0, page_va(page), true, MappingFlags::empty())
            .map_err(|e| fail(format!("{e:?}"), Vec::new()))?;
    }
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    m.run_threaded(|cpu| {
        let me = cpu.id().index();
        let plan: &[Step] = plans.get(me).map_or(&[], Vec::as_slice);
        if let Err(e) = cpu.switch_to(rmap.spaces()[0].mm()) {
            crate::sim::lock(&errors).push(format!("cpu {me}: switch: {e:?}"));
            return;
        }
        for (i, &step) in plan.iter().enumerate() {
            if let Err(e) = one_step(&m, &rmap, &cpu, step, i as u64) {
                crate::sim::lock(&errors).push(format!("cpu {me}, step {i} ({step:?}): {e}"));
                break;
            }
        }
        cpu.enable_interrupts();
    });
    let errors = crate::sim::lock(&errors).clone();
    if let Some(first) = errors.into_iter().next() {
        return Err(fail(first, m.violations()));
    }
    if m.violation_count() != 0 {
        return Err(fail("the oracle saw a violation".into(), m.violations()));
    }
    Ok(())
}

fn one_step(
    m: &MockMachine,
    rmap: &MockRmap<'_>,
    cpu: &MockCpu<'_>,
    step: Step,
    token: u64,
) -> Result<(), String> {
    let me = cpu.id().index();
    let space = &rmap.spaces()[0];
    let mine = page_va(me);
    let err = |e: crate::Error| format!("{e}");
    match step {
        Step::Access { page, write } => {
            // Faults are normal: another CPU may be remapping the page.
            let _ = if write {
                cpu.write(page_va(usize::from(page)), token)
            } else {
                cpu.read(page_va(usize::from(page))).map(|_| ())
            };
        }
        Step::Remap { batched } => {
            let pte = space.lookup(mine);
            if !pte.is_present() {
                return Ok(());
            }
            let f = pte.frame();
            let flags = if batched {
                TtuFlags::IGNORE_ACCESS | TtuFlags::BATCH_FLUSH
            } else {
                TtuFlags::IGNORE_ACCESS
            };
            let mut batch = TlbFlushUnmapBatch::new();
            let r = try_to_unmap(cpu, rmap, f, flags, &mut batch).map_err(err)?;
            batch.flush(cpu).map_err(err)?;
            if r.is_unmapped() {
                rmap.remove_frame(f);
                m.free_frame(f).map_err(|e| format!("{e:?}"))?;
                flush_tlb_batched_pending(cpu, space.tlb_state()).map_err(err)?;
                let new = m.alloc_frame().map_err(|e| format!("{e:?}"))?;
                rmap.map(new, 0, mine, true, MappingFlags::empty())
                    .map_err(|e| format!("{e:?}"))?;
            }
        }
        Step::Protect => {
            let page = PageRange::page(mine).map_err(err)?;
            change_protection(cpu, space, page, |p| Pte(p.0 & !PteFlags::WRITABLE.bits())).map_err(err)?;
            if space.lookup(mine).is_present() && m.check_coherent(space.tlb_state(), page) != 0 {
                return Err("a stale entry survived the write-protect".into());
            }
            change_protection(cpu, space, page, |p| Pte(p.0 | PteFlags::WRITABLE.bits())).map_err(err)?;
        }
        Step::Migrate => {
            let pte = space.lookup(mine);
            if !pte.is_present() || rmap.mapcount(pte.frame()) != 1 {
                return Ok(());
            }
            let mut kernel = MockKernel::new(rmap);
            // SAFETY: only this CPU changes its own page's mapping, and the
            // frame is freed only through this handle.
            let handle = unsafe { OwnedFrame::new(pte.frame()) };
            let mut bad: Option<String> = None;
            migrate_pages(
                cpu,
                rmap,
                &mut kernel,
                &mut UnmapBatch::<1>::new(),
                [handle],
                &mut |o| {
                    if let MigrateOutcome::Failed { reason, .. } = o {
                        bad = Some(format!("migration failed: {reason:?}"));
                    }
                },
            )
            .map_err(|r| format!("migration stopped: {:?}", r.error()))?;
            if let Some(b) = bad {
                return Err(b);
            }
        }
        Step::InterruptsOff => cpu.disable_interrupts(),
        Step::InterruptsOn => cpu.enable_interrupts(),
        Step::Lazy => {
            cpu.enter_lazy().map_err(|e| format!("{e:?}"))?;
            std::thread::yield_now();
            cpu.switch_to(space.mm()).map_err(|e| format!("{e:?}"))?;
        }
        Step::Away => {
            cpu.switch_to(m.kernel_mm()).map_err(|e| format!("{e:?}"))?;
            std::thread::yield_now();
            cpu.switch_to(space.mm()).map_err(|e| format!("{e:?}"))?;
        }
    }
    Ok(())
}
