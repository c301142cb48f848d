//! The walk both reverse-map algorithms ([`try_to_unmap`](super::try_to_unmap)
//! and [`page_referenced`](super::page_referenced)) share: every mapping the
//! rmap reports is checked before any entry changes, and only the mappings
//! a present PTE still maps to the frame are visited.

use core::ops::ControlFlow;

use super::{Mapping, PageTable, Rmap};
use crate::arch::Arch;
use crate::lifecycle::online_caller;
use crate::pte::{Frame, Pte};
use crate::validate::{check_asid, check_entry_size, check_space_va};
use crate::verify::{check_space_on, check_table_root};
use crate::walk::check_not_global;
use crate::Error;

/// Checks every mapping `rmap` reports for `frame` (aligned, canonical,
/// an ASID the hardware can tag) and the calling CPU against each
/// mapping's space (online, the space of this machine, its root not
/// loaded behind the crate's back: [`space_caller`]'s checks; the table's
/// own root its state's, [`Error::RootMismatch`]), that no mapping is
/// through a huge entry ([`Error::HugePage`]), and that
/// no user entry is global ([`Error::GlobalUserEntry`]), without
/// touching any entry, so that a walk that then changes entries, or ages
/// them, does not stop half-way on bad input or a misconfigured caller.
/// The CPU is checked even for a frame with no mapping.
///
/// [`space_caller`]: crate::verify::space_caller
pub(super) fn check_mappings<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    frame: Frame,
    huge: Huge,
) -> Result<(), Error> {
    let me = online_caller(arch)?;
    let mut failure = None;
    let _ = rmap.walk(frame, &mut |m| {
        let checked = check_mapping(arch, &m)
            .and_then(|()| check_table_root(m.space))
            .and_then(|()| check_space_on(arch, m.space.tlb_state(), me))
            .and_then(|()| {
                let pte = m.space.lookup(m.va);
                check_huge(arch, m.space, m.va, pte, frame, huge)?;
                check_not_global(arch, m.space, m.va, pte)
            });
        match checked {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                failure = Some(e);
                ControlFlow::Break(())
            }
        }
    });
    failure.map_or(Ok(()), Err)
}

/// What a walk does with a mapping through a huge entry
/// ([`PageTable::entry_size`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Huge {
    /// It takes the entry whole, at the huge page's first address (the
    /// frame is the huge frame's first): one accessed and one dirty bit,
    /// one clear, one flush at the huge stride. A mapping of one 4 KiB
    /// piece at any other address is refused.
    WholeOnly,
    /// It refuses every one (migration and hwpoison write entries that a
    /// huge entry has no form for).
    Refused,
}

/// Refuses a mapping of `frame` through a huge entry that `huge` does not
/// take: one 4 KiB piece of it (clearing the accessed bit all its pieces
/// share for one, or recording a flush for a piece whose entry stays
/// mapped, would each be wrong), or any when `huge` refuses them all. A
/// place the rmap lists whose entry (`pte`, huge or not) no longer maps
/// `frame` is not a mapping of it: the walk steps over it.
///
/// An entry smaller than the architecture's base page is refused too
/// ([`Error::BelowBasePage`]): its flush would be at a stride the hardware
/// does not have.
fn check_huge<A: Arch, S: PageTable + ?Sized>(
    arch: &A,
    space: &S,
    va: u64,
    pte: Pte,
    frame: Frame,
    huge: Huge,
) -> Result<(), Error> {
    if !pte.maps(frame) {
        return Ok(());
    }
    let size = space.entry_size(va);
    check_entry_size(arch, va, size)?;
    // Migration and hwpoison refuse every entry larger than 4 KiB, a 16 or
    // 64 KiB arm64 page's too: their entries have no form here for a
    // frame of more than one 4 KiB unit.
    if size.is_huge() && (huge == Huge::Refused || size.align_down(va) != va) {
        return Err(Error::HugePage {
            va: size.align_down(va),
            size: size.bytes(),
        });
    }
    Ok(())
}

fn check_mapping<A: Arch, S: PageTable + ?Sized>(arch: &A, m: &Mapping<'_, S>) -> Result<(), Error> {
    check_space_va(arch, m.space.tlb_state(), m.va)?;
    check_asid(arch, m.space.tlb_state().asid())
}

/// Walks the mappings of `frame` that a present PTE still maps to it (the
/// rmap may also list places that no longer do), stopping at the first
/// error (a mapping that fails [`check_mapping`], or one `visit` returns)
/// or when `visit` asks to.
pub(super) fn walk_mapped<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    frame: Frame,
    mut visit: impl FnMut(&Mapping<'_, R::Space>) -> Result<ControlFlow<()>, Error>,
) -> Result<(), Error> {
    let mut failure = None;
    let _ = rmap.walk(frame, &mut |m| {
        let step = check_mapping(arch, &m).and_then(|()| {
            if m.space.lookup(m.va).maps(frame) {
                visit(&m)
            } else {
                Ok(ControlFlow::Continue(()))
            }
        });
        step.unwrap_or_else(|e| {
            failure = Some(e);
            ControlFlow::Break(())
        })
    });
    failure.map_or(Ok(()), Err)
}
