//! Changing the mappings of a range (mprotect-like), with contract rule 5
//! built in: a batched flush still pending for the address space is done
//! first, table by table under each table's lock.

use crate::arch::Arch;
use crate::page_size::PageSize;
use crate::pte::{Pte, PteFlags};
use crate::range::PageRange;
use crate::request::{FlushRequest, Pages};
use crate::rmap::PageTable;
use crate::shootdown::shootdown;
use crate::validate::{check_asid, check_space_range};
use crate::verify::{check_table_root, space_caller};
use crate::walk::{check_huge_whole, check_range_not_global, walk_range, Step};
use crate::Error;

/// Applies `update` to every present PTE of `space` in `range` and flushes
/// the changed pages on every CPU that may cache them (one shootdown; page
/// by page up to the ceiling, the whole address space above it). Returns
/// how many entries this call changed (a huge entry counts once).
///
/// A 2 MiB or 1 GiB page ([`PageTable::entry_size`]) that `range` covers
/// wholly is one entry: `update` runs once, on its 4 KiB view at the huge
/// page's first address (the first frame, the entry's flags), the result
/// is written over the whole entry with the rules below (accessed and
/// dirty bits kept, the global bit as the space needs), and its flush is
/// one invalidation at the huge page's stride, counted once against the
/// full-flush ceiling. The entry stays present throughout: it is changed
/// in place by atomic exchanges (a cleared huge entry is no entry to store
/// into), each adding back any accessed or dirty bit the hardware set
/// since the one before. So for such an entry `update` must keep the frame
/// (change flags only); anything else (no entry, another frame, a
/// migration entry) is not written, and the call stops there with
/// [`Error::HugePage`], entries changed before it owing their flush as
/// after a failed flush (below): unmap a huge page with
/// [`MmuGather::unmap_range`](crate::MmuGather::unmap_range), move it
/// after a split. A range that covers part of a huge page is refused with
/// [`Error::HugePage`] before anything changes; split it first
/// ([`split_huge_mapping`](crate::split_huge_mapping)).
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
/// Each 4 KiB PTE is changed by an atomic clear, then `update` on the
/// value the clear returned, then a store: a dirty bit hardware sets meanwhile is in
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
/// [`Error::AsidOutOfRange`], what [`PageTable::check_range`] refuses,
/// a huge page the range covers part of ([`Error::HugePage`]: asked of
/// [`PageTable::entry_size`] at the range's first and last pages, and of
/// the table's `check_range`), a global entry in a
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
    check_huge_whole(space, range, arch.base_page())?;
    check_range_not_global(arch, space, range)?;
    let needs_global = arch.kernel_flush_needs_global();
    let mut flush = FlushRequest::new();
    let mut changed = 0;
    let global = |new: Pte| {
        if !mm.is_kernel() {
            Pte(new.0 & !PteFlags::GLOBAL.bits())
        } else if needs_global && new.is_present() {
            Pte(new.0 | PteFlags::GLOBAL.bits())
        } else {
            new
        }
    };
    let walked = walk_range(arch, space, range, &mut |va, pte, size| {
        if pte.is_present() {
            let (old, new) = if size.is_huge() {
                change_huge(space, va, pte, size, |old| {
                    global(keep_hardware_bits(old, update(old)))
                })?
            } else {
                let old = space.clear(va);
                let new = global(keep_hardware_bits(old, update(old)));
                space.set(va, new);
                (old, new)
            };
            if new != old {
                match Pages::one(va, size).map(Pages::leaf) {
                    Ok(pages) => flush.add_pages_step(mm.asid(), pages, A::FULL_FLUSH_CEILING, None),
                    // Cannot happen (the walk yields each entry at its
                    // first address, in the checked range); the whole
                    // address space then.
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

/// Changes the huge entry of `size` at `va`, `seen` in its 4 KiB view,
/// to `change(seen)`, and answers the old and the new entry.
///
/// A cleared huge entry is no entry at all to the table (a store after a
/// clear would find nothing to store into), so it is changed in place by
/// exchanges: `change` runs once, on `seen`; the result must keep `seen`'s
/// frame (a change of flags), else nothing is written and the answer is
/// [`Error::HugePage`]. Under the table lock only the MMU changes the
/// entry, and only its accessed and dirty bits: an exchange that answers
/// bits the value written lacks is followed by another that adds them,
/// until none is missing (at most twice more), so no bit the hardware set
/// is lost (contract rule 4).
fn change_huge<S: PageTable + ?Sized>(
    space: &S,
    va: u64,
    seen: Pte,
    size: PageSize,
    change: impl FnOnce(Pte) -> Pte,
) -> Result<(Pte, Pte), Error> {
    let mut new = change(seen);
    if !new.is_present() || new.frame() != seen.frame() {
        return Err(Error::HugePage {
            va,
            size: size.bytes(),
        });
    }
    let mut old = space.exchange(va, new);
    let first = old;
    loop {
        let missing = keep_hardware_bits(old, new).0 & !new.0;
        if missing == 0 {
            return Ok((first, new));
        }
        new = Pte(new.0 | missing);
        old = space.exchange(va, new);
    }
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
