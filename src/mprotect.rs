//! Changing the mappings of a range (mprotect-like), with contract rule 5
//! built in: a batched flush still pending for the address space is done
//! first, table by table under each table's lock.

use crate::arch::Arch;
use crate::pte::{Pte, PteFlags};
use crate::range::PageRange;
use crate::request::FlushRequest;
use crate::rmap::PageTable;
use crate::shootdown::shootdown;
use crate::validate::{check_asid, check_space_range};
use crate::verify::{check_table_root, space_caller};
use crate::walk::{check_range_not_global, walk_range, Step};
use crate::Error;

/// Applies `update` to every present PTE of `space` in `range` and flushes
/// the changed pages on every CPU that may cache them (one shootdown; page
/// by page up to the ceiling, the whole address space above it). Returns
/// how many PTEs this call changed.
///
/// The range is walked table by table, each under its lock
/// ([`PageTable::with_table_locked`]), stepping over what is not mapped
/// ([`PageTable::next_populated`]: with a page table that skips absent
/// tables, the cost follows what is mapped, not the range's size). Inside
/// each table's lock, before any entry changes, a flush that a reclaimer
/// deferred for this address space and that no flush covered yet is done
/// ([`flush_tlb_batched_pending`](crate::flush_tlb_batched_pending)).
/// Without that, a PTE the reclaimer already cleared looks "not present"
/// here, so it is skipped, and a CPU could go on writing through its stale
/// writable entry after this call returned (the race fixed upstream after
/// the batched-flush series). Checking under each table's lock, not once up
/// front, is what keeps a kernel with split page-table locks safe: a
/// reclaimer may clear and defer an entry of a later table while earlier
/// tables are being changed.
///
/// Each PTE is changed by an atomic clear, then `update` on the value the
/// clear returned, then a store: a dirty bit hardware sets meanwhile is in
/// the value `update` sees, so it cannot be lost. Between the clear and the
/// store the entry is not present, so another CPU that misses its TLB on
/// that page then takes a not-present fault: the kernel's fault handler
/// must treat it as spurious (take the page-table lock, find the entry
/// present again, and return), as it must for any entry a concurrent
/// change holds cleared.
///
/// In a user space the crate never writes a global entry: a
/// [`PteFlags::GLOBAL`] bit in what `update` returns is dropped, since a
/// global entry would outlive every flush of the space's ASID (and be used
/// by other address spaces). Making a user page global is not an
/// operation this function offers. In the kernel's space, where its
/// flushes rely on global kernel mappings
/// ([`Arch::kernel_flush_needs_global`]), every present entry it writes
/// is global, whatever `update` returns: a non-global kernel entry could
/// be cached under an ASID that a later flush of the page does not name.
///
/// Errors, with nothing changed: [`Error::NonCanonical`], an address of a
/// user space in the kernel's half ([`Error::KernelHalf`]),
/// [`Error::AsidOutOfRange`], what [`PageTable::check_range`] refuses
/// (a huge page in the range, [`Error::HugePage`]), a global entry in a
/// user space ([`Error::GlobalUserEntry`]) or a non-global one in the
/// kernel's where its flushes rely on global kernel mappings
/// ([`Error::NonGlobalKernelEntry`]), a table whose root is not its
/// state's ([`Error::RootMismatch`]); [`Error::CpuNotOnline`] and
/// [`Error::UntrackedRoot`] when the flush would miss the calling CPU (it
/// is not online, or loaded the space's root without
/// [`switch_mm`](crate::switch_mm)). A failed flush ([`Error::ShootdownReentered`])
/// may come after PTEs changed: the flush they need is then recorded in the
/// address space (as a pending batched flush), so that retrying the call,
/// or any later change of this address space's mappings, flushes it first.
/// Until a call returns `Ok` the change is not in effect on every CPU.
///
/// The accessed and dirty bits of an entry that keeps its frame are kept,
/// whatever `update` returns (as Linux's `pte_modify` keeps them): the
/// accessed bit is the hardware's record that a CPU may have cached the
/// mapping, and clearing it is [`page_referenced`](crate::page_referenced)'s
/// job (a [`FramePool`](crate::FramePool) relies on a clear bit meaning
/// that no CPU cached the page since the aging that cleared it); the dirty
/// bit is the only record that the page was written, which reclaim needs
/// to write it out before freeing it (contract rule 4), so a closure such
/// as `|p| Pte::new(p.frame(), PteFlags::PRESENT | PteFlags::USER)` makes
/// a page read-only without losing it. An `update` that gives the address
/// another frame, or none, owns what `old` says: it sees `old`'s dirty
/// bit, and must record it on the page (for a reverse map,
/// [`Rmap::set_dirty`](crate::Rmap::set_dirty)) before the old frame is
/// written out or freed.
pub fn change_protection<A: Arch, S: PageTable + ?Sized>(
    arch: &A,
    space: &S,
    range: PageRange,
    mut update: impl FnMut(Pte) -> Pte,
) -> Result<usize, Error> {
    let mm = space.tlb_state();
    check_space_range(arch, mm, range)?;
    check_asid(arch, mm.asid())?;
    space_caller(arch, mm)?;
    check_table_root(space)?;
    space.check_range(range)?;
    check_range_not_global(arch, space, range)?;
    let needs_global = arch.kernel_flush_needs_global();
    let mut flush = FlushRequest::new();
    let mut changed = 0;
    let walked = walk_range(arch, space, range, &mut |va, pte| {
        if pte.is_present() {
            let old = space.clear(va);
            let new = keep_hardware_bits(old, update(old));
            let new = if !mm.is_kernel() {
                Pte(new.0 & !PteFlags::GLOBAL.bits())
            } else if needs_global && new.is_present() {
                Pte(new.0 | PteFlags::GLOBAL.bits())
            } else {
                new
            };
            space.set(va, new);
            if new != old {
                match PageRange::page(va) {
                    Ok(page) => flush.add_range(mm.asid(), page, A::FULL_FLUSH_CEILING),
                    // Cannot happen (the walk yields aligned addresses of
                    // the checked range); the whole address space then.
                    Err(_) => flush.add_asid(mm.asid()),
                }
                changed += 1;
            }
        }
        Ok(Step::Next)
    });
    let flushed = walked.and_then(|_| {
        let (targets, step) = mm.flush_targets_step(arch);
        // Every page of the request changed before this advance.
        if let Some(step) = step {
            flush.set_step(mm.asid(), step);
        }
        shootdown(arch, &targets, &flush)
    });
    if let Err(e) = flushed {
        if changed > 0 {
            mm.note_flush_owed(arch.shootdown_state());
        }
        return Err(e);
    }
    Ok(changed)
}

/// `new` with the accessed and dirty bits of `old` when both map the same
/// frame (see [`change_protection`]).
fn keep_hardware_bits(old: Pte, new: Pte) -> Pte {
    if new.is_present() && new.frame() == old.frame() {
        let kept = old.flags() & (PteFlags::ACCESSED | PteFlags::DIRTY);
        Pte(new.0 | kept.bits())
    } else {
        new
    }
}
