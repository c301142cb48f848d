//! Walking a range of one address space's page table the way range
//! operations must: table by table, each under its lock
//! ([`PageTable::with_table_locked`]) with contract rule 5 checked inside
//! it, and stepping over what is not mapped
//! ([`PageTable::next_populated`]) so that the cost follows what is mapped.
//! A huge entry ([`PageTable::entry_size`]) is one entry: met at its first
//! address, then stepped over whole; a range that covers part of one is
//! refused ([`Error::HugePage`]).

use crate::arch::Arch;
use crate::mm::flush_tlb_batched_pending;
use crate::page_size::PageSize;
use crate::pte::{Pte, PteFlags, PAGE_SIZE};
use crate::range::PageRange;
use crate::rmap::PageTable;
use crate::Error;

/// What `visit` asks of [`walk_range`] after seeing one entry.
pub(crate) enum Step {
    /// Done with this entry; go on.
    Next,
    /// Stop before this entry (it was not changed): the caller has work to
    /// do outside the table lock, then walks again from here.
    Pause,
}

/// The first address of `range` whose entry may be non-empty, trusting
/// [`PageTable::next_populated`] only for an answer inside `range` (any
/// other answer falls back to `range.start()`, which skips nothing and
/// always makes progress).
///
/// The answer is aligned down to `base`, the architecture's base page (an
/// entry of a 16 or 64 KiB arm64 page is met at its first address, as a
/// huge one is); `range` starts on a base page, so it stays inside.
fn next_populated<S: PageTable + ?Sized>(space: &S, range: PageRange, base: PageSize) -> Option<u64> {
    if range.is_empty() {
        return None;
    }
    match space.next_populated(range) {
        Some(va) if range.contains(va) => Some(base.align_down(va).max(range.start())),
        Some(_) => Some(range.start()),
        None => None,
    }
}

/// Refuses an entry whose global bit the crate's flushes of its space
/// would not match: in a user address space a present global entry
/// ([`Error::GlobalUserEntry`]: flushes of the space's ASID leave global
/// entries alone, and a CPU keeps using one after it switches to another
/// space, so no flush the crate sends for the space would remove it); in
/// the kernel's, a present non-global one where the `Arch`'s kernel-page
/// flush relies on global kernel mappings
/// ([`Error::NonGlobalKernelEntry`], see [`Arch::kernel_flush_needs_global`]).
pub(crate) fn check_not_global<A: Arch, S: PageTable + ?Sized>(
    arch: &A,
    space: &S,
    va: u64,
    pte: Pte,
) -> Result<(), Error> {
    if !pte.is_present() {
        return Ok(());
    }
    let global = pte.flags().contains(PteFlags::GLOBAL);
    if space.tlb_state().is_kernel() {
        if !global && arch.kernel_flush_needs_global() {
            return Err(Error::NonGlobalKernelEntry { va });
        }
    } else if global {
        return Err(Error::GlobalUserEntry { va });
    }
    Ok(())
}

/// The huge page of `size` that holds `va`, as the error for a range
/// operation that would take only part of it.
fn partial(va: u64, size: PageSize) -> Error {
    Error::HugePage {
        va: size.align_down(va),
        size: size.bytes(),
    }
}

/// The last page of the entry of `size` that starts at `va`, when that
/// entry lies wholly in `range`.
fn whole_in(range: PageRange, va: u64, size: PageSize) -> Option<u64> {
    let end = va.checked_add(size.bytes() - PAGE_SIZE)?;
    let whole = size.align_down(va) == va && range.contains(va) && range.last()? >= end;
    whole.then_some(end)
}

/// Refuses `range` when a huge page ([`PageTable::entry_size`]) maps part
/// of it but not all of it, before anything changes: such a page holds the
/// range's first or last page (it starts before the range or ends after
/// it), so asking for those two is enough, whatever the table's
/// [`PageTable::check_range`] checks.
///
/// Sizes below `base` (the architecture's base page) are left to the walk,
/// which refuses such an entry where one is mapped
/// ([`Error::BelowBasePage`]); a table may answer 4 KiB where nothing is.
pub(crate) fn check_huge_whole<S: PageTable + ?Sized>(
    space: &S,
    range: PageRange,
    base: PageSize,
) -> Result<(), Error> {
    let Some(last) = range.last() else {
        return Ok(());
    };
    for va in [range.start(), last] {
        let size = space.entry_size(va);
        if size.is_huge() && size >= base && whole_in(range, size.align_down(va), size).is_none() {
            return Err(partial(va, size));
        }
    }
    Ok(())
}

/// The last page of the entry at `va`, a non-empty entry a walk of `range`
/// met: `va` itself for a 4 KiB entry, the huge page's last for a huge one
/// met at its first address. [`Error::HugePage`] for a huge one that does
/// not lie wholly in `range` or is met elsewhere (the table changed after
/// [`check_huge_whole`], or reports sizes inconsistently): it is never
/// taken in part, nor skipped.
///
/// [`Error::BelowBasePage`] for an entry smaller than `base`, the
/// architecture's base page.
fn entry_end<S: PageTable + ?Sized>(
    space: &S,
    range: PageRange,
    va: u64,
    base: PageSize,
) -> Result<(u64, PageSize), Error> {
    let size = space.entry_size(va);
    if size < base {
        return Err(Error::BelowBasePage {
            va,
            size: size.bytes(),
            base: base.bytes(),
        });
    }
    if !size.is_huge() {
        return Ok((va, size));
    }
    match whole_in(range, va, size) {
        Some(end) => Ok((end, size)),
        None => Err(partial(va, size)),
    }
}

/// [`check_not_global`] for every entry of `range`, before a range
/// operation changes any: a read-only pass that steps over what is not
/// mapped, and over a huge entry whole, as [`walk_range`] does (none for
/// the kernel's space where its flushes reach every entry whatever its
/// global bit).
pub(crate) fn check_range_not_global<A: Arch, S: PageTable + ?Sized>(
    arch: &A,
    space: &S,
    range: PageRange,
) -> Result<(), Error> {
    if space.tlb_state().is_kernel() && !arch.kernel_flush_needs_global() {
        return Ok(());
    }
    let base = arch.base_page();
    let mut va = next_populated(space, range, base);
    while let Some(v) = va {
        let pte = space.lookup(v);
        check_not_global(arch, space, v, pte)?;
        let end = if pte == Pte::EMPTY {
            v
        } else {
            entry_end(space, range, v, base)?.0
        };
        va = next_populated(space, range.after(end), base);
    }
    Ok(())
}

/// Calls `visit` for every non-empty entry of `range` in `space`, in
/// address order, table by table: for each leaf table that may map
/// something in the range, under that table's lock, first a pending
/// batched flush of the address space is done (rule 5, checked where a
/// reclaimer holding the same lock would have set it), then `visit` runs
/// for the table's non-empty entries, with each entry's size. A huge
/// entry is visited once, at its first address, and the walk goes on past
/// its last page; one that `range` does not hold wholly stops the walk
/// with [`Error::HugePage`] before `visit` sees it ([`check_huge_whole`]
/// refuses such a range before any walk).
///
/// After the last table, rule 5 is checked once more, for deferrals in
/// tables the walk stepped over because nothing in them was left mapped.
///
/// Returns `Ok(None)` when the whole range was walked, `Ok(Some(va))` when
/// `visit` paused before the entry at `va`. On an error (from the flush or
/// from `visit`) the walk stops; entries already visited stay changed.
pub(crate) fn walk_range<A, S>(
    arch: &A,
    space: &S,
    range: PageRange,
    visit: &mut dyn FnMut(u64, Pte, PageSize) -> Result<Step, Error>,
) -> Result<Option<u64>, Error>
where
    A: Arch,
    S: PageTable + ?Sized,
{
    let mm = space.tlb_state();
    let mut rest = range;
    let base = arch.base_page();
    while let Some(first) = next_populated(space, rest, base) {
        let table = rest.within_table_of(first).from_page(first);
        // The last page this table's walk took: past the table's end
        // after a huge entry larger than a table's span.
        let mut done = table.last();
        let mut outcome: Result<Option<u64>, Error> = Ok(None);
        space.with_table_locked(first, &mut || {
            outcome = (|| {
                flush_tlb_batched_pending(arch, mm)?;
                let mut va = Some(first);
                while let Some(v) = va {
                    let pte = space.lookup(v);
                    let mut end = v;
                    if pte != Pte::EMPTY {
                        let (last, size) = entry_end(space, range, v, base)?;
                        if let Step::Pause = visit(v, pte, size)? {
                            return Ok(Some(v));
                        }
                        end = last;
                        done = done.max(Some(last));
                    }
                    va = next_populated(space, table.after(end), base);
                }
                Ok(None)
            })();
        });
        if let Some(paused) = outcome? {
            return Ok(Some(paused));
        }
        match done {
            Some(last) => rest = rest.after(last),
            None => break,
        }
    }
    // A reclaimer may have cleared and deferred the last non-empty entry of
    // a table this walk then stepped over (or before the walk, in a range
    // with nothing left to visit): the stale entry it left must not outlive
    // the operation either.
    flush_tlb_batched_pending(arch, mm)?;
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::asid::Asid;
    use crate::mm::MmTlbState;

    /// A table that maps one 2 MiB page at 2 MiB (its pieces read as
    /// present) and says so through `entry_size` alone: its `check_range`
    /// is the default, which refuses nothing.
    struct OneHuge(MmTlbState);

    const TWO: u64 = 2 << 20;

    fn huge(va: u64) -> bool {
        (TWO..2 * TWO).contains(&va)
    }

    // SAFETY: read-only in these tests: nothing is exchanged, set or
    // cleared, so every answer is the one load of a constant entry.
    unsafe impl PageTable for OneHuge {
        fn tlb_state(&self) -> &MmTlbState {
            &self.0
        }
        fn lookup(&self, va: u64) -> Pte {
            if huge(va) {
                Pte(va & !(PAGE_SIZE - 1) | PteFlags::PRESENT.bits())
            } else {
                Pte::EMPTY
            }
        }
        fn exchange(&self, _va: u64, _new: Pte) -> Pte {
            Pte::EMPTY
        }
        fn test_and_clear_accessed(&self, _va: u64) -> bool {
            false
        }
        fn set(&self, _va: u64, _pte: Pte) {}
        fn entry_size(&self, va: u64) -> PageSize {
            if huge(va) {
                PageSize::SIZE_2M
            } else {
                PageSize::SIZE_4K
            }
        }
    }

    fn space() -> OneHuge {
        OneHuge(MmTlbState::new(Asid::new(1).unwrap_or(Asid::KERNEL), 0))
    }

    /// The crate's own check, from the two ends of the range, whatever
    /// the table's `check_range` says.
    #[test]
    fn a_range_covering_part_of_a_huge_page_is_refused_from_its_ends() {
        let s = space();
        let refused = Err(Error::HugePage { va: TWO, size: TWO });
        let range = |first: u64, pages: u64| PageRange::new(first, pages).unwrap();
        assert_eq!(
            check_huge_whole(&s, range(TWO - PAGE_SIZE, 2), PageSize::SIZE_4K),
            refused
        );
        assert_eq!(
            check_huge_whole(&s, range(TWO + PAGE_SIZE, 600), PageSize::SIZE_4K),
            refused
        );
        assert_eq!(
            check_huge_whole(&s, range(TWO + 9 * PAGE_SIZE, 1), PageSize::SIZE_4K),
            refused
        );
        assert_eq!(
            check_huge_whole(&s, range(TWO - PAGE_SIZE, 514), PageSize::SIZE_4K),
            Ok(())
        );
        assert_eq!(check_huge_whole(&s, range(TWO, 512), PageSize::SIZE_4K), Ok(()));
        assert_eq!(check_huge_whole(&s, PageRange::EMPTY, PageSize::SIZE_4K), Ok(()));
    }

    /// The read-only pass steps over a huge page whole: one entry, however
    /// many pieces.
    #[test]
    fn the_read_only_pass_meets_a_huge_page_once() {
        let s = space();
        let all = PageRange::new(0, 3 * 512).unwrap();
        let mut met = 0;
        let mut va = next_populated(&s, all, PageSize::SIZE_4K);
        while let Some(v) = va {
            let mut end = v;
            if s.lookup(v) != Pte::EMPTY {
                let (last, size) = entry_end(&s, all, v, PageSize::SIZE_4K).unwrap();
                assert_eq!((v, size, last), (TWO, PageSize::SIZE_2M, 2 * TWO - PAGE_SIZE));
                met += 1;
                end = last;
            }
            va = next_populated(&s, all.after(end), PageSize::SIZE_4K);
        }
        assert_eq!(met, 1);
    }
}
