//! A small simulated kernel on top of the mock machine: a reverse map and
//! the page-out, free and migration services the drivers call, with knobs
//! to make them fail.

use core::ops::ControlFlow;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::vec::Vec;

use super::{lock, MockError, MockMachine, MockSpace, Model, X86Like};
use crate::gather::TeardownBacking;
use crate::migrate::MigrateBacking;
use crate::pte::Frame;
use crate::reclaim::{PageOut, ReclaimBacking};
use crate::rmap::{Mapping, MappingFlags, Rmap};
use crate::unmap::{FreeFrames, OwnedFrame, WritebackFrame};

type Entry = (usize, u64, MappingFlags);

/// A reverse map over a fixed list of address spaces of one machine, keyed
/// by frame (hash map: fast enough for benchmark-sized runs).
///
/// The aging epochs the crate stores through it ([`Rmap::aged_epoch`])
/// are kept by the machine, whose PTE writers forget a frame's whenever a
/// write maps the frame anew or clears an accessed bit of it: through
/// this map ([`map`](Self::map)), [`MockMachine::map`],
/// [`MockMachine::set_pte`], [`MockMachine::exchange_pte`],
/// [`MockMachine::test_and_clear_accessed`] or the spaces' `PageTable`
/// methods, as [`Rmap`]'s contract asks of a kernel. So a test that ages
/// or remaps pages by hand cannot leave an epoch the crate would trust
/// wrongly.
pub struct MockRmap<'m, M: Model = X86Like> {
    machine: &'m MockMachine<M>,
    spaces: Vec<MockSpace<'m, M>>,
    map: Mutex<BTreeMap<Frame, Vec<Entry>>>,
}

impl<'m, M: Model> MockRmap<'m, M> {
    /// A reverse map over `spaces` (address spaces of `machine`), referred
    /// to by their index in that list.
    pub fn new(machine: &'m MockMachine<M>, spaces: Vec<MockSpace<'m, M>>) -> Self {
        MockRmap {
            machine,
            spaces,
            map: Mutex::new(BTreeMap::new()),
        }
    }

    /// The address spaces.
    pub fn spaces(&self) -> &[MockSpace<'m, M>] {
        &self.spaces
    }

    /// Maps `frame` at `va` in space `space` and records the mapping.
    /// Errors: [`MockError::UnknownAddressSpace`] for an index out of range,
    /// and whatever [`MockMachine::map`] refuses.
    pub fn map(
        &self,
        frame: Frame,
        space: usize,
        va: u64,
        writable: bool,
        flags: MappingFlags,
    ) -> Result<(), MockError> {
        let s = self.spaces.get(space).ok_or(MockError::UnknownAddressSpace)?;
        // Recorded first: a mapping is known before any CPU can use it.
        lock(&self.map).entry(frame).or_default().push((space, va, flags));
        // The new entry's accessed bit is clear, and a CPU may still cache
        // an older mapping of the frame here: its aging epoch no longer
        // vouches for it (the machine's write forgets it too, unless the
        // call fails).
        self.machine.forget_aged(frame);
        self.machine.map(s.mm(), va, frame, writable)
    }

    /// [`map`](Self::map) for a frame just allocated, which no CPU can
    /// cache (a free frame is cached nowhere): its aging epoch
    /// ([`Rmap::aged_epoch`]) becomes 0, so an unmap that finds the entry
    /// never accessed needs no CPU's flush at all. A frame with mappings
    /// recorded already is not fresh: it is mapped as by `map`, its epoch
    /// forgotten.
    pub fn map_fresh(
        &self,
        frame: Frame,
        space: usize,
        va: u64,
        writable: bool,
        flags: MappingFlags,
    ) -> Result<(), MockError> {
        let fresh = lock(&self.map).get(&frame).is_none_or(Vec::is_empty);
        self.map(frame, space, va, writable, flags)?;
        if fresh {
            lock(&self.machine.aged).insert(frame, 0);
        }
        Ok(())
    }

    /// Forgets every mapping of `frame`.
    pub fn remove_frame(&self, frame: Frame) {
        lock(&self.map).remove(&frame);
        self.machine.forget_aged(frame);
    }

    /// Moves every recorded mapping of `old` to `new`.
    pub fn move_frame(&self, old: Frame, new: Frame) {
        self.machine.forget_aged(old);
        self.machine.forget_aged(new);
        let mut map = lock(&self.map);
        if let Some(entries) = map.remove(&old) {
            map.entry(new).or_default().extend(entries);
        }
    }

    /// Changes the flags of every recorded mapping of `frame`.
    pub fn set_flags(&self, frame: Frame, flags: MappingFlags) {
        if let Some(entries) = lock(&self.map).get_mut(&frame) {
            for e in entries {
                e.2 = flags;
            }
        }
    }
}

// SAFETY: `walk` visits every mapping recorded for the frame, and the mock
// records a mapping (through `map`) before setting its PTE. `aged_epoch`
// returns what the crate last stored, forgotten by `map` (the mock's only
// writer of present entries besides the crate; the simulated hardware only
// ever sets accessed bits) and when mappings move or go. A test that sets
// PTEs behind the map's back gets wrong answers about simulated memory only,
// which the oracle then reports; no real memory is at stake.
unsafe impl<'m, M: Model> Rmap for MockRmap<'m, M> {
    type Space = MockSpace<'m, M>;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, Self::Space>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        // Copied out so that `visit` may change the map (never under lock):
        // on the stack for the usual handful of mappings.
        let mut few: heapless::Vec<Entry, 8> = heapless::Vec::new();
        let mut many: Vec<Entry> = Vec::new();
        if let Some(entries) = lock(&self.map).get(&frame) {
            if entries.len() <= few.capacity() {
                few.extend(entries.iter().copied());
            } else {
                many.extend(entries.iter().copied());
            }
        }
        for &(space, va, flags) in few.iter().chain(many.iter()) {
            if let Some(space) = self.spaces.get(space) {
                visit(Mapping { space, va, flags })?;
            }
        }
        ControlFlow::Continue(())
    }

    fn set_dirty(&self, frame: Frame) {
        let _ = self.machine.set_frame_dirty(frame);
    }

    fn aged_epoch(&self, frame: Frame) -> Option<u64> {
        lock(&self.machine.aged).get(&frame).copied()
    }

    fn set_aged_epoch(&self, frame: Frame, epoch: Option<u64>) {
        let mut aged = lock(&self.machine.aged);
        match epoch {
            Some(e) => aged.insert(frame, e),
            None => aged.remove(&frame),
        };
    }

    fn is_hwpoisoned(&self, frame: Frame) -> bool {
        self.machine.frame_poisoned(frame).unwrap_or(false)
    }
}

/// How [`MockKernel::page_out`] behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// The write completes at once; the frame is clean and may be freed.
    Synchronous,
    /// The write stays in flight (the frame stays under I/O).
    Queued,
    /// The write cannot be started.
    Failing,
}

/// The kernel services the reclaim and migration drivers call, on a mock
/// machine and a [`MockRmap`], with counters and failure knobs.
pub struct MockKernel<'r, 'm, M: Model = X86Like> {
    rmap: &'r MockRmap<'m, M>,
    /// How page-out behaves.
    pub io: IoMode,
    /// Refuse every batched free (the frames must come back).
    pub refuse_frees: bool,
    /// Refuse every batched page-table free.
    pub refuse_table_frees: bool,
    /// Batched page-table free calls made.
    pub table_free_calls: usize,
    /// Allocations of migration targets left before they fail (`None`: no
    /// limit).
    pub alloc_budget: Option<usize>,
    /// Batched free calls made.
    pub free_calls: usize,
    /// Frames freed.
    pub frames_freed: usize,
    /// Page-outs started.
    pub page_outs: usize,
}

impl<'r, 'm, M: Model> MockKernel<'r, 'm, M> {
    /// Services over `rmap`'s machine: synchronous I/O, frees accepted.
    pub fn new(rmap: &'r MockRmap<'m, M>) -> Self {
        MockKernel {
            rmap,
            io: IoMode::Synchronous,
            refuse_frees: false,
            refuse_table_frees: false,
            table_free_calls: 0,
            alloc_budget: None,
            free_calls: 0,
            frames_freed: 0,
            page_outs: 0,
        }
    }

    fn machine(&self) -> &'m MockMachine<M> {
        self.rmap.machine
    }
}

impl<M: Model> FreeFrames for MockKernel<'_, '_, M> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        self.free_calls += 1;
        if self.refuse_frees {
            return;
        }
        let mut refused: heapless::Vec<OwnedFrame, N> = heapless::Vec::new();
        while let Some(frame) = frames.pop() {
            self.rmap.remove_frame(frame.frame());
            // A huge frame's handle names its first 4 KiB frame, and the
            // kernel frees the whole huge frame with it (as Linux frees a
            // folio); on a machine whose base page is larger than 4 KiB a
            // page's frame is the first of an aligned run, freed with it
            // too.
            let base = self.machine().config().base_page.base_pages();
            let run = self
                .machine()
                .huge_frame_pages(frame.frame())
                .map_or(base, |pages| pages.max(base));
            match self.machine().free_frame(frame.frame()) {
                Ok(()) => {
                    self.frames_freed += 1;
                    for i in 1..run {
                        let _ = self.machine().free_frame(Frame(frame.frame().0 + i));
                    }
                }
                // Not freeable (under I/O, say): it goes back. `refused`
                // holds at most what `frames` held.
                Err(_) => {
                    let _ = refused.push(frame);
                }
            }
        }
        *frames = refused;
    }
}

impl<M: Model> TeardownBacking for MockKernel<'_, '_, M> {
    fn set_dirty(&mut self, frame: Frame) {
        let _ = self.machine().set_frame_dirty(frame);
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        self.table_free_calls += 1;
        if self.refuse_table_frees {
            return;
        }
        let mut refused: heapless::Vec<OwnedFrame, N> = heapless::Vec::new();
        while let Some(table) = tables.pop() {
            if self.machine().free_frame(table.frame()).is_err() {
                // `refused` holds at most what `tables` held.
                let _ = refused.push(table);
            }
        }
        *tables = refused;
    }
}

impl<M: Model> ReclaimBacking for MockKernel<'_, '_, M> {
    fn is_dirty(&self, frame: Frame) -> bool {
        self.machine().frame_dirty(frame).unwrap_or(false)
    }

    fn page_out(&mut self, frame: WritebackFrame<'_>) -> PageOut {
        if self.io == IoMode::Failing {
            return PageOut::Failed;
        }
        self.page_outs += 1;
        if self.machine().start_io(frame.frame()).is_err() {
            return PageOut::Failed;
        }
        match self.io {
            IoMode::Synchronous => match self.machine().end_io(frame.frame()) {
                Ok(()) => PageOut::Written,
                Err(_) => PageOut::Queued,
            },
            _ => PageOut::Queued,
        }
    }
}

impl<M: Model> MigrateBacking for MockKernel<'_, '_, M> {
    fn alloc_target(&mut self, _old: Frame) -> Option<OwnedFrame> {
        match self.alloc_budget {
            Some(0) => return None,
            Some(ref mut n) => *n -= 1,
            None => {}
        }
        let frame = self.machine().alloc_frame().ok()?;
        // SAFETY: the frame comes fresh from the allocator: this handle is
        // the only claim on it.
        Some(unsafe { OwnedFrame::new(frame) })
    }

    fn copy_frame(&mut self, from: WritebackFrame<'_>, to: &OwnedFrame) {
        let _ = self.machine().copy_frame(from.frame(), to.frame());
    }

    fn move_mappings(&mut self, old: Frame, new: Frame) {
        self.rmap.move_frame(old, new);
    }
}
