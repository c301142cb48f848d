//! Aging: [`page_referenced`] counts and clears the accessed bits of a
//! frame's mappings, and the two steps it shares with the unmap walk,
//! clearing one accessed bit and storing the frame's aging epoch after.

use core::ops::ControlFlow;

use super::visit::{check_mappings, walk_mapped, Huge};
use super::{MappingFlags, PageTable, Rmap};
use crate::arch::Arch;
use crate::batch::TlbFlushUnmapBatch;
use crate::pte::Frame;
use crate::Error;

/// Clears the accessed bit of one mapping; when the architecture needs a
/// flush for that, records one in `batch` (it rides along with the next
/// flush point instead of costing an IPI now).
pub(super) fn clear_young<A: Arch, S: PageTable + ?Sized>(
    arch: &A,
    space: &S,
    va: u64,
    batch: &mut TlbFlushUnmapBatch,
) -> Result<bool, Error> {
    // A huge entry has one accessed bit, cleared at its first address
    // (the only one the walk visits it at), and one flush at its stride.
    let page = if A::ACCESSED_CLEAR_NEEDS_FLUSH {
        Some(batch.check_add_sized(arch, space.tlb_state(), va, space.entry_size(va))?)
    } else {
        None
    };
    let young = space.test_and_clear_accessed(va);
    if let (true, Some(page)) = (young, page) {
        let mm = space.tlb_state();
        let (targets, step) = mm.flush_targets_step(arch);
        batch.record(arch, mm.asid(), page, (&targets, step), None);
    }
    Ok(young)
}

/// Stores `frame`'s aging epoch after its accessed bits were cleared (see
/// [`Rmap::aged_epoch`]): a new epoch, published after the clears. A CPU
/// that flushes after reading that epoch (or a later one) flushes after
/// every clear, so it drops whatever it cached before them; whatever it
/// caches afterwards sets the accessed bit again, which an unmap then
/// sees. (Publishing here rather than waiting for the next pool
/// generation's epoch lets the CPUs' flushes in between count.)
///
/// When nothing was cleared (`cleared` false) a known epoch stays: it is
/// older, and still true, since no bit was cleared after it. An unknown one
/// is set all the same: every entry cached before now is dropped by a CPU
/// that flushes past the new epoch, and every later one sets the bit.
pub(super) fn note_aged<A: Arch, R: Rmap + ?Sized>(arch: &A, rmap: &R, frame: Frame, cleared: bool) {
    if !arch.fill_sets_accessed() || (!cleared && rmap.aged_epoch(frame).is_some()) {
        return;
    }
    // A read-modify-write that releases the clears (atomic operations of
    // any strength, by the kernel's `PageTable`) to every CPU that reads
    // this epoch or a later one before it flushes: its refills afterwards
    // come after the clears, and set the bit again where an unmap sees it.
    let epoch = arch.shootdown_state().publish_epoch();
    rmap.set_aged_epoch(frame, Some(epoch));
}

/// What [`page_referenced`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Referenced {
    /// Mappings whose accessed bit was set (and is now clear).
    pub referenced: usize,
    /// Mappings visited that map the frame.
    pub mapped: usize,
    /// A mapping is mlocked (the walk stopped there).
    pub mlocked: bool,
}

/// Counts and clears the accessed bits of every mapping of `frame`, the
/// reclaimer's measure of how recently the page was used.
///
/// When the architecture says clearing needs a flush
/// ([`Arch::ACCESSED_CLEAR_NEEDS_FLUSH`]) each cleared mapping is recorded
/// in `batch` and flushed with it; otherwise (x86, seed 003) nothing is
/// flushed and no IPI is sent. Skipping the flush costs accuracy only: a CPU
/// keeps using its cached entry without setting the bit again, so the page
/// may look older than it is and be reclaimed a little early; its data is
/// never at risk, since unmapping it later goes through the full protocol.
///
/// On hardware whose fills set the accessed bit
/// ([`Arch::fill_sets_accessed`]) it then stores the frame's aging epoch
/// ([`Rmap::set_aged_epoch`]): a newly published one when it cleared a bit
/// or none was known, the known one otherwise (no bit was cleared since).
/// As for [`try_to_unmap`](super::try_to_unmap), the caller holds the
/// frame alone (Linux's page lock and LRU isolation): an aging racing with
/// an unmap of the same frame could pair a bit cleared by one with an epoch
/// stored by the other.
///
/// Errors, before any accessed bit is cleared or any epoch stored:
/// [`Error::Unaligned`], [`Error::NonCanonical`], [`Error::KernelHalf`]
/// or [`Error::AsidOutOfRange`] for a mapping the rmap reported,
/// [`Error::GlobalUserEntry`] for a user mapping whose entry is global,
/// [`Error::NonGlobalKernelEntry`] for a kernel mapping whose entry is not
/// where the kernel's flushes rely on it,
/// [`Error::RootMismatch`] for a mapping's table whose root is not its
/// state's, [`Error::OtherMachine`] for a batch or a space of another machine;
/// [`Error::CpuNotOnline`] and [`Error::UntrackedRoot`] for a caller that
/// flushes would miss (outside [`Arch::online_cpus`], or running a
/// mapping's space without [`switch_mm`](crate::switch_mm)): the epoch
/// stored afterwards would vouch for clears its own TLB does not answer
/// for; the error of [`Arch::current_cpu`] when it cannot tell the CPU.
pub fn page_referenced<A: Arch, R: Rmap + ?Sized>(
    arch: &A,
    rmap: &R,
    frame: Frame,
    batch: &mut TlbFlushUnmapBatch,
) -> Result<Referenced, Error> {
    batch.check_machine(arch)?;
    check_mappings(arch, rmap, frame, Huge::WholeOnly)?;
    let mut found = Referenced::default();
    let walked = walk_mapped(arch, rmap, frame, |m| {
        found.mapped += 1;
        if m.flags.contains(MappingFlags::LOCKED) {
            found.mlocked = true;
            return Ok(ControlFlow::Break(()));
        }
        found.referenced += usize::from(clear_young(arch, m.space, m.va, batch)?);
        Ok(ControlFlow::Continue(()))
    });
    // Whatever the walk cleared before it stopped, and the bits it found
    // clear, date from before this point.
    note_aged(arch, rmap, frame, found.referenced > 0);
    walked?;
    Ok(found)
}
