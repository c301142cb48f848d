//! [`BoundedRmap`]: a reverse map in fixed storage, with no allocation,
//! for small kernels, tests and the mock machine.

use core::ops::ControlFlow;

use super::{Mapping, MappingFlags, PageState, PageTable, Rmap};
use crate::pte::{check_aligned, Frame};
use crate::validate::check_user_half;
use crate::verify::check_table_root;
use crate::Error;

struct RmapEntry<'a, S: ?Sized> {
    frame: Frame,
    space: &'a S,
    va: u64,
    flags: MappingFlags,
}

/// A reverse map of at most `N` mappings in fixed storage: no allocation,
/// O(N) walks. For small kernels, tests and the mock machine.
pub struct BoundedRmap<'a, S: ?Sized, P: ?Sized, const N: usize> {
    entries: heapless::Vec<RmapEntry<'a, S>, N>,
    pages: &'a P,
}

impl<'a, S: PageTable + ?Sized, P: PageState + ?Sized, const N: usize> BoundedRmap<'a, S, P, N> {
    /// An empty map forwarding page state to `pages`.
    ///
    /// # Safety
    ///
    /// The map promises callers of [`Rmap::walk`] that it knows every
    /// mapping. The caller keeps that promise: it [`add`](Self::add)s each
    /// mapping of a frame before any CPU can use it, and removes it only
    /// when the mapping no longer exists.
    ///
    /// If `pages` keeps aging epochs ([`PageState::aged_epoch`] returns
    /// `Some`), the caller also keeps [`Rmap`]'s promise about them: `add`
    /// forgets the frame's epoch, so it only remains to call
    /// `pages.set_aged_epoch(frame, None)` before writing an entry for a
    /// frame with its accessed bit clear, or clearing that bit, other than
    /// when adding the mapping (a refault that rewrites a recorded mapping)
    /// and other than through this crate.
    pub unsafe fn new(pages: &'a P) -> Self {
        BoundedRmap {
            entries: heapless::Vec::new(),
            pages,
        }
    }

    /// Records that `space` maps `frame` at `va`. Errors (nothing is
    /// recorded): [`Error::Unaligned`], [`Error::KernelHalf`] (an
    /// upper-half address of a user space: kernel mappings belong to the
    /// kernel's space), [`Error::RootMismatch`] (a user space whose table
    /// reports another root than its state holds), [`Error::RmapFull`].
    pub fn add(&mut self, frame: Frame, space: &'a S, va: u64, flags: MappingFlags) -> Result<(), Error> {
        check_aligned(va)?;
        check_user_half(space.tlb_state(), va)?;
        check_table_root(space)?;
        // The new entry's accessed bit is clear while a CPU may still cache
        // an older mapping of the frame: no aging epoch vouches for it.
        self.pages.set_aged_epoch(frame, None);
        self.entries
            .push(RmapEntry {
                frame,
                space,
                va,
                flags,
            })
            .map_err(|_| Error::RmapFull { capacity: N })
    }

    /// Forgets the mapping of `frame` at `va` in `space`; returns whether it
    /// was recorded.
    pub fn remove(&mut self, frame: Frame, space: &S, va: u64) -> bool {
        let found = self
            .entries
            .iter()
            .position(|e| e.frame == frame && e.va == va && core::ptr::addr_eq(e.space, space));
        if let Some(i) = found {
            self.entries.swap_remove(i);
        }
        found.is_some()
    }

    /// Forgets every mapping of `frame` (when it is freed); returns how many.
    pub fn remove_frame(&mut self, frame: Frame) -> usize {
        let before = self.entries.len();
        self.entries.retain(|e| e.frame != frame);
        before - self.entries.len()
    }

    /// Changes the flags of a recorded mapping (mlock, munlock); returns
    /// whether it was recorded.
    pub fn set_flags(&mut self, frame: Frame, space: &S, va: u64, flags: MappingFlags) -> bool {
        match self
            .entries
            .iter_mut()
            .find(|e| e.frame == frame && e.va == va && core::ptr::addr_eq(e.space, space))
        {
            Some(e) => {
                e.flags = flags;
                true
            }
            None => false,
        }
    }

    /// Recorded mappings.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

// SAFETY: `walk` visits every recorded mapping of the frame, and the
// caller of `new` promised that every mapping is recorded, and that the
// page state's aging epochs, if it keeps any, are forgotten on every write
// that `add` does not cover.
unsafe impl<S: PageTable + ?Sized, P: PageState + ?Sized, const N: usize> Rmap for BoundedRmap<'_, S, P, N> {
    type Space = S;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, S>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        for e in self.entries.iter().filter(|e| e.frame == frame) {
            visit(Mapping {
                space: e.space,
                va: e.va,
                flags: e.flags,
            })?;
        }
        ControlFlow::Continue(())
    }

    fn set_dirty(&self, frame: Frame) {
        self.pages.set_dirty(frame);
    }

    fn is_hwpoisoned(&self, frame: Frame) -> bool {
        self.pages.is_hwpoisoned(frame)
    }

    fn aged_epoch(&self, frame: Frame) -> Option<u64> {
        self.pages.aged_epoch(frame)
    }

    fn set_aged_epoch(&self, frame: Frame, epoch: Option<u64>) {
        self.pages.set_aged_epoch(frame, epoch);
    }
}
