//! A simulated address space as the crate's [`PageTable`], and the
//! machine's page state as a [`PageState`].

use std::sync::Arc;

use super::{DetachedTable, MockError, MockMachine, Model, Violation, X86Like};
use crate::gather::TableBounds;
use crate::mm::MmTlbState;
use crate::page_size::PageSize;
use crate::pte::{Frame, Pte};
use crate::range::PageRange;
use crate::rmap::{PageState, PageTable};

impl<M: Model> PageState for MockMachine<M> {
    fn set_dirty(&self, frame: Frame) {
        // A frame the machine does not have has no page to mark.
        let _ = self.set_frame_dirty(frame);
    }

    fn is_hwpoisoned(&self, frame: Frame) -> bool {
        self.frame_poisoned(frame).unwrap_or(false)
    }
}

/// One address space of a [`MockMachine`] as a [`PageTable`] (made by
/// [`MockMachine::space`]).
pub struct MockSpace<'m, M: Model = X86Like> {
    pub(crate) machine: &'m MockMachine<M>,
    pub(crate) mm: Arc<MmTlbState>,
}

impl<M: Model> MockSpace<'_, M> {
    /// The address space's state.
    pub fn mm(&self) -> &Arc<MmTlbState> {
        &self.mm
    }
}

impl<M: Model> core::fmt::Debug for MockSpace<'_, M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "MockSpace({:?})", self.mm.asid())
    }
}

impl<M: Model> MockSpace<'_, M> {
    /// A write the machine refused, which `PageTable` has no way to
    /// report: recorded as a violation (the crate wrote an entry no
    /// hardware table would take), never dropped silently. Nothing was
    /// written, so nothing was there to return.
    fn refused(&self, va: u64, error: MockError) -> Pte {
        self.machine.record(Violation::RefusedPteWrite { va, error });
        Pte::EMPTY
    }
}

// SAFETY: every operation is one atomic instruction on the modelled PTE
// (swap, fetch_and, load, store), the same word the simulated hardware
// updates with its own atomic read-modify-write; `tlb_state` is the state of
// the address space whose table this is. The machine made the space, so the
// table exists: a failed lookup can only mean "nothing mapped here".
unsafe impl<M: Model> PageTable for MockSpace<'_, M> {
    fn tlb_state(&self) -> &MmTlbState {
        &self.mm
    }

    fn lookup(&self, va: u64) -> Pte {
        self.machine.pte(&self.mm, va).unwrap_or(Pte::EMPTY)
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        self.machine
            .exchange_pte(&self.mm, va, new)
            .unwrap_or_else(|error| self.refused(va, error))
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        self.machine
            .test_and_clear_accessed(&self.mm, va)
            .unwrap_or(false)
    }

    fn set(&self, va: u64, pte: Pte) {
        if let Err(error) = self.machine.set_pte(&self.mm, va, pte) {
            self.refused(va, error);
        }
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        self.machine.next_populated(&self.mm, range)
    }

    fn entry_size(&self, va: u64) -> PageSize {
        // The machine's own tables map base pages only. (A kernel-written
        // table attached to the space is given to the crate as the
        // kernel's own `PageTable`, which answers for itself.)
        let _ = va;
        self.machine.config.base_page
    }
}

// SAFETY: both hooks hand out only a leaf table all of whose entries are
// empty, checked and unlinked under the lock every writer of the simulated
// table takes, and report its whole region: `detach_table` one whose
// region lies in the range, `detach_table_bounded` one whose region lies
// within the bounds and meets the range.
unsafe impl<M: Model> crate::gather::TableTeardown for MockSpace<'_, M> {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        self.machine.detach_table(&self.mm, range)
    }

    fn detach_table_bounded(&self, range: PageRange, bounds: TableBounds) -> Option<DetachedTable> {
        self.machine.detach_table_bounded(&self.mm, range, bounds)
    }
}
