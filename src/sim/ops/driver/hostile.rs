//! Hostile input in the operation model: each kind must be refused with a
//! typed error and nothing changed (page tables, TLBs, pending batches).

use std::format;
use std::string::String;
use std::sync::Arc;
use std::vec::Vec;

use super::super::backing::OpsKernel;
use super::super::{va, BadInput, BATCHES, PAGES, SPACES};
use super::{crate_error, Driver};
use crate::arch::Asid;
use crate::gather::{MmuGather, TableFreePolicy};
use crate::mm::{flush_tlb_page, switch_mm, MmTlbState};
use crate::mprotect::change_protection;
use crate::pte::{Frame, Pte, PAGE_SIZE};
use crate::range::PageRange;
use crate::rmap::{try_to_unmap, MappingFlags, PageTable, Rmap, TtuFlags};
use crate::sim::{MockCpu, MockRmap, MockSpace, Model, TlbEntry};
use crate::Error;

/// What bad input must not change: every entry of every space, every TLB
/// entry, every low-level batch's pending pages.
type Snapshot = (
    [[Pte; PAGES]; SPACES + 1],
    Vec<(crate::cpuset::CpuId, TlbEntry)>,
    [usize; BATCHES],
);

impl<'m, M: Model> Driver<'m, M> {
    fn snapshot(&self) -> Snapshot {
        let mut ptes = [[Pte::EMPTY; PAGES]; SPACES + 1];
        for (s, row) in ptes.iter_mut().enumerate() {
            for (p, pte) in row.iter_mut().enumerate() {
                *pte = self.space(s).lookup(va(s, p));
            }
        }
        let pending = [self.low[0].pending_pages(), self.low[1].pending_pages()];
        (ptes, self.m.all_entries(), pending)
    }

    pub(super) fn hostile(&mut self, c: &MockCpu<'m, M>, kind: BadInput) -> Result<(), String> {
        let hole = 1u64 << 47;
        let before = self.snapshot();
        let result = match kind {
            BadInput::AddPending => {
                let mm = Arc::clone(self.mm(0));
                self.low[0].add_pending(c, &mm, hole, Pte::EMPTY)
            }
            BadInput::FlushPage => flush_tlb_page(c, self.mm(0), hole).map(|_| ()),
            BadInput::Protect => PageRange::new(hole - PAGE_SIZE, 2)
                .and_then(|r| change_protection(c, self.space(0), r, |p| p))
                .map(|_| ()),
            BadInput::Teardown => {
                let mut kernel = OpsKernel::for_teardown(self.m, &self.rmap, &mut self.holders);
                let mut gather = MmuGather::<8>::new();
                match PageRange::new(hole, 1) {
                    Ok(r) => gather
                        .unmap_range(
                            c,
                            &self.rmap.spaces()[0],
                            &mut kernel,
                            r,
                            true,
                            &mut TableFreePolicy::AfterFlush,
                            &mut |_, _| {},
                        )
                        .map(|_| ()),
                    Err(e) => Err(e),
                }
            }
            BadInput::RmapAddress => {
                // A frame mapped somewhere, reported with a bad address
                // after its good one.
                let found = (0..=SPACES)
                    .flat_map(|s| (0..PAGES).map(move |p| (s, p)))
                    .find_map(|(s, p)| self.frame_at(s, p).map(|f| (s, p, f)));
                match found {
                    Some((s, p, f)) => {
                        let bad = BadRmap {
                            inner: &self.rmap,
                            good: (s, va(s, p)),
                            bad: hole,
                        };
                        try_to_unmap(c, &bad, f, TtuFlags::IGNORE_ACCESS, &mut self.low[0]).map(|_| ())
                    }
                    None => Err(Error::NonCanonical { addr: hole }),
                }
            }
            BadInput::WideAsid => {
                let asid = Asid::new(1 << 12).map_err(crate_error)?;
                let mm = MmTlbState::new(asid, 0);
                // SAFETY: refused before anything is loaded.
                unsafe { switch_mm(c, None, &mm) }
            }
            BadInput::PastTheTop => PageRange::new(va(SPACES, PAGES - 1), 2).map(|_| ()),
        };
        match result {
            Ok(()) => return Err(format!("{kind:?} was accepted")),
            Err(Error::NonCanonical { .. } | Error::AsidOutOfRange { .. } | Error::RangeOverflow { .. }) => {}
            Err(e) => return Err(format!("{kind:?} refused with the wrong error: {e}")),
        }
        if self.snapshot() != before {
            return Err(format!("{kind:?} was refused but changed something"));
        }
        Ok(())
    }
}

/// A reverse map that reports one good mapping of a frame and then one at
/// a non-canonical address.
struct BadRmap<'a, 'm, M: Model> {
    inner: &'a MockRmap<'m, M>,
    good: (usize, u64),
    bad: u64,
}

// SAFETY: the good mapping is a real one of the mock rmap; the bad one is
// an address no PTE can have, which the crate must refuse before it
// changes anything.
unsafe impl<'m, M: Model> Rmap for BadRmap<'_, 'm, M> {
    type Space = MockSpace<'m, M>;

    fn walk(
        &self,
        _frame: Frame,
        visit: &mut dyn FnMut(crate::rmap::Mapping<'_, Self::Space>) -> core::ops::ControlFlow<()>,
    ) -> core::ops::ControlFlow<()> {
        let space = &self.inner.spaces()[self.good.0];
        for va in [self.good.1, self.bad] {
            visit(crate::rmap::Mapping {
                space,
                va,
                flags: MappingFlags::empty(),
            })?;
        }
        core::ops::ControlFlow::Continue(())
    }

    fn set_dirty(&self, frame: Frame) {
        self.inner.set_dirty(frame);
    }
}
