//! Changing the mappings of a range (mprotect-like), with contract rule 5
//! built in: a batched flush still pending for the address space is done
//! first.

use crate::arch::Arch;
use crate::mm::flush_tlb_batched_pending;
use crate::pte::{check_range, Pte, PAGE_SIZE};
use crate::request::FlushRequest;
use crate::rmap::PageTable;
use crate::shootdown::shootdown;
use crate::Error;

/// Applies `update` to every present PTE of `space` in `start..end` and
/// flushes the changed pages on every CPU that may cache them (one
/// shootdown; page by page up to the ceiling, the whole address space above
/// it). Returns how many PTEs changed.
///
/// First, if a reclaimer deferred flushes for this address space that no
/// flush covered yet, they are flushed ([`flush_tlb_batched_pending`]).
/// Without that, a PTE the reclaimer already cleared looks "not present"
/// here, so it is skipped, and a CPU could go on writing through its stale
/// writable entry after this call returned (the race fixed upstream after
/// the batched-flush series).
///
/// Each PTE is changed by an atomic clear, then `update` on the value the
/// clear returned, then a store: a dirty bit hardware sets meanwhile is in
/// the value `update` sees, so it cannot be lost. Hold the kernel's
/// page-table lock for the range, as for any PTE change.
///
/// Errors: [`Error::Unaligned`], [`Error::InvalidRange`] (nothing changed);
/// [`Error::ShootdownReentered`] (PTEs may have changed but not been
/// flushed: retry the call, which flushes again).
pub fn change_protection<A: Arch, S: PageTable + ?Sized>(
    arch: &A,
    space: &S,
    start: u64,
    end: u64,
    mut update: impl FnMut(Pte) -> Pte,
) -> Result<usize, Error> {
    check_range(start, end)?;
    let mm = space.tlb_state();
    flush_tlb_batched_pending(arch, mm)?;
    let mut flush = FlushRequest::new();
    let mut changed = 0;
    let mut va = start;
    while va < end {
        if space.lookup(va).is_present() {
            let old = space.clear(va);
            let new = update(old);
            space.set(va, new);
            if new != old {
                flush.add_page(mm.asid(), va, A::FULL_FLUSH_CEILING)?;
                changed += 1;
            }
        }
        va += PAGE_SIZE;
    }
    shootdown(arch, &mm.flush_targets(arch), &flush)?;
    Ok(changed)
}
