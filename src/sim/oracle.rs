//! The frame-state oracle: which frames are free, in use or under I/O, and
//! the record of every violation of the safety contract it witnessed.

use std::collections::BTreeMap;
use std::vec::Vec;

use crate::cpuset::CpuId;
use crate::pte::Frame;

use super::MockError;

/// The life-cycle state of a physical frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameState {
    /// On the free list: nothing may read, write or cache it.
    Free,
    /// Allocated.
    InUse,
    /// Being written out: nothing may write it.
    UnderIo,
}

/// A breach of the safety contract, as the oracle saw it happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Violation {
    /// A CPU wrote into a free frame (through a stale entry): the write is
    /// lost, or corrupts the frame's next owner (rule 1).
    WriteToFreeFrame {
        /// The writing CPU.
        cpu: CpuId,
        /// The frame written.
        frame: Frame,
        /// The virtual address used.
        va: u64,
    },
    /// A CPU wrote into a frame under I/O: the disk copy misses the write
    /// (rule 1).
    WriteDuringIo {
        /// The writing CPU.
        cpu: CpuId,
        /// The frame written.
        frame: Frame,
        /// The virtual address used.
        va: u64,
    },
    /// A CPU read a free frame: an information leak (rule 2).
    ReadOfFreeFrame {
        /// The reading CPU.
        cpu: CpuId,
        /// The frame read.
        frame: Frame,
        /// The virtual address used.
        va: u64,
    },
    /// A frame was freed while a CPU still cached a translation to it
    /// (rule 2; rule 1 as well when `writable`).
    FreedWhileCached {
        /// The frame freed.
        frame: Frame,
        /// A CPU caching it.
        cpu: CpuId,
        /// Whether that cached entry allowed writes.
        writable: bool,
    },
    /// A frame was freed while it was still being written out: the device
    /// reads a frame its next owner may already be writing (rule 1).
    FreedDuringIo {
        /// The frame.
        frame: Frame,
    },
    /// A frame was handed to I/O while a CPU still cached a writable
    /// translation to it (rule 1).
    IoWhileWritable {
        /// The frame.
        frame: Frame,
        /// A CPU caching a writable entry.
        cpu: CpuId,
    },
    /// A page-table frame was freed while a CPU was walking it locklessly
    /// (rule 6): the walker reads a frame that may already hold something
    /// else.
    TableFreedUnderWalker {
        /// The page-table frame.
        frame: Frame,
        /// The CPU walking it.
        cpu: CpuId,
    },
    /// A page-table frame was freed (or handed out again) while a CPU's
    /// walk cache still pointed to it: that CPU's next walk reads whatever
    /// the frame holds now (rule 6).
    TableFreedWhileCached {
        /// The page-table frame.
        frame: Frame,
        /// A CPU whose walk cache points to it.
        cpu: CpuId,
    },
    /// A CPU walked through a cached pointer to a page-table frame that
    /// was freed or reused (rule 6).
    WalkThroughFreedTable {
        /// The walking CPU.
        cpu: CpuId,
        /// The page-table frame.
        table: Frame,
        /// The address being translated.
        va: u64,
    },
    /// A page-table entry named a frame the machine does not have: the
    /// walk that met it faulted instead of reaching arbitrary memory.
    MapsNoSuchFrame {
        /// The walking CPU.
        cpu: CpuId,
        /// The address being translated.
        va: u64,
        /// The frame the entry named.
        frame: Frame,
    },
    /// A CPU used a TLB entry filled for another address space that had
    /// the same ASID: the ASID was reused without flushing it first, and
    /// one process reaches another's memory.
    ForeignTranslation {
        /// The CPU.
        cpu: CpuId,
        /// The address used.
        va: u64,
        /// The frame the foreign entry named.
        frame: Frame,
    },
    /// A CPU's TLB held two translations of one address that differ (other
    /// frames, or other permissions): a page cached both through a huge
    /// entry and through a 4 KiB one, after the page table was split or
    /// promoted without the flush between that removes the older
    /// translation. Intel's SDM (vol. 3, 4.10.2.3) leaves which one a
    /// processor then uses undefined.
    ConflictingTranslations {
        /// The CPU.
        cpu: CpuId,
        /// The first address both translations cover.
        va: u64,
        /// The frame the translation already cached gives it.
        cached: Frame,
        /// The frame the new one gives it.
        filled: Frame,
    },
    /// A lazy CPU ([`MockCpu::enter_lazy`](super::MockCpu::enter_lazy))
    /// resumed user code ([`MockCpu::leave_lazy`](super::MockCpu::leave_lazy))
    /// while its TLB still held an entry of the space it was lazy on for a
    /// frame freed meanwhile: it did not catch up on the flushes that
    /// skipped it, and its next access there reaches the freed frame (rule
    /// 2; rule 1 as well when `writable`). The free itself was not a
    /// [`FreedWhileCached`](Violation::FreedWhileCached): a lazy CPU uses no
    /// user entry until it resumes.
    LazyResumedWithStale {
        /// The lazy CPU.
        cpu: CpuId,
        /// The frame freed while it was cached.
        frame: Frame,
        /// The page's address in the lazy space.
        va: u64,
        /// Whether the stale entry allows writes.
        writable: bool,
    },
    /// A CPU loaded an ASID (tagged TLB) while its TLB still held an entry
    /// of that ASID for a frame freed while the CPU did not run it: it
    /// skipped the catch-up flush its generation check owed, and translates
    /// to a freed or reused frame from now on (rule 2; rule 1 as well when
    /// `writable`). The free itself was not a
    /// [`FreedWhileCached`](Violation::FreedWhileCached): an entry of an
    /// ASID the CPU has not loaded cannot be used.
    LoadedWithStale {
        /// The CPU that loaded the ASID.
        cpu: CpuId,
        /// The frame freed while it was cached.
        frame: Frame,
        /// The page's address.
        va: u64,
        /// Whether the stale entry allows writes.
        writable: bool,
    },
    /// As [`LoadedWithStale`](Violation::LoadedWithStale), for a
    /// walk-cache entry: a CPU loaded an ASID while its paging-structure
    /// cache still pointed, under that ASID, to a page table freed while
    /// it did not run it (rule 6).
    LoadedWithStaleWalk {
        /// The CPU that loaded the ASID.
        cpu: CpuId,
        /// The freed page-table frame.
        table: Frame,
    },
    /// A CPU rejoined the online set while its TLB still held an entry,
    /// cached before it went offline, for a frame freed (or, with
    /// `writable`, written out) while it was away: its online path skipped
    /// the flush of [`prepare_cpu_online`](crate::prepare_cpu_online), and
    /// it now translates to a freed frame, or to one with a new owner (rule
    /// 2; rule 1 as well when `writable`). The free itself was not a
    /// [`FreedWhileCached`](Violation::FreedWhileCached): an offline CPU
    /// uses no entry.
    OnlineWithStale {
        /// The CPU that came back.
        cpu: CpuId,
        /// The frame freed (or written out) while it was cached.
        frame: Frame,
        /// The page's address.
        va: u64,
        /// Whether the stale entry allows writes.
        writable: bool,
    },
    /// As [`OnlineWithStale`](Violation::OnlineWithStale), for a
    /// walk-cache entry: a CPU rejoined while its paging-structure cache
    /// still pointed to a page table freed while it was away (rule 6).
    OnlineWithStaleWalk {
        /// The CPU that came back.
        cpu: CpuId,
        /// The freed page-table frame.
        table: Frame,
    },
    /// The crate wrote a page-table entry through a
    /// [`MockSpace`](super::MockSpace) that the machine refuses (`error`
    /// says why: a present entry naming a free frame, a non-global entry
    /// in the kernel's space, an upper-half address of a user space).
    /// `PageTable::set` and `exchange` cannot fail, so the write is
    /// dropped and recorded here rather than lost silently: an address the
    /// crate meant to map is left unmapped.
    RefusedPteWrite {
        /// The address written.
        va: u64,
        /// What the machine refused.
        error: MockError,
    },
    /// After an operation changed a range of mappings and returned, a CPU
    /// still cached an entry there that disagrees with the page table
    /// (rule 5).
    StaleAfterChange {
        /// The CPU caching it.
        cpu: CpuId,
        /// The page's address.
        va: u64,
        /// Whether the stale entry allows writes.
        writable: bool,
    },
}

/// Why a frame operation on the mock machine was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameError {
    /// No free frame is left.
    OutOfFrames,
    /// The frame number is beyond the machine's memory.
    NoSuchFrame(Frame),
    /// The frame is not in the state the operation needs.
    WrongState {
        /// The frame.
        frame: Frame,
        /// The state it is in.
        state: FrameState,
    },
}

#[derive(Clone, Copy, Debug)]
struct FrameInfo {
    state: FrameState,
    data: u64,
    dirty: bool,
    poisoned: bool,
}

/// The machine's physical memory: one data word and a state per frame.
#[derive(Debug)]
pub(crate) struct Memory {
    frames: Vec<FrameInfo>,
    free_list: Vec<u64>,
    /// Frames from `data_frames` on form a separate pool for page tables,
    /// so that table allocations never change what data allocations see.
    data_frames: u64,
    table_free_list: Vec<u64>,
    /// The huge frames `alloc_aligned` handed out, by first frame: how many
    /// frames each spans, while its first frame is allocated.
    runs: BTreeMap<u64, u64>,
}

impl Memory {
    pub(crate) fn new(count: usize, tables: usize) -> Self {
        let total = count + tables;
        Memory {
            frames: std::vec![
                FrameInfo {
                    state: FrameState::Free,
                    data: 0,
                    dirty: false,
                    poisoned: false,
                };
                total
            ],
            // Hand out low frames first.
            free_list: (0..count as u64).rev().collect(),
            data_frames: count as u64,
            table_free_list: (count as u64..total as u64).rev().collect(),
            runs: BTreeMap::new(),
        }
    }

    /// Every frame free again, handed out in the same order as at first.
    pub(crate) fn reset(&mut self) {
        for info in &mut self.frames {
            *info = FrameInfo {
                state: FrameState::Free,
                data: 0,
                dirty: false,
                poisoned: false,
            };
        }
        let (count, total) = (self.data_frames, self.frames.len() as u64);
        self.free_list.clear();
        self.free_list.extend((0..count).rev());
        self.table_free_list.clear();
        self.table_free_list.extend((count..total).rev());
    }

    pub(crate) fn states(&self) -> Vec<(FrameState, bool)> {
        self.frames.iter().map(|f| (f.state, f.dirty)).collect()
    }

    fn info(&mut self, frame: Frame) -> Result<&mut FrameInfo, FrameError> {
        usize::try_from(frame.0)
            .ok()
            .and_then(|i| self.frames.get_mut(i))
            .ok_or(FrameError::NoSuchFrame(frame))
    }

    pub(crate) fn state(&mut self, frame: Frame) -> Result<FrameState, FrameError> {
        Ok(self.info(frame)?.state)
    }

    fn require(&mut self, frame: Frame, want: FrameState) -> Result<&mut FrameInfo, FrameError> {
        let info = self.info(frame)?;
        if info.state == want {
            Ok(info)
        } else {
            Err(FrameError::WrongState {
                frame,
                state: info.state,
            })
        }
    }

    pub(crate) fn alloc(&mut self) -> Result<Frame, FrameError> {
        let pfn = self.free_list.pop().ok_or(FrameError::OutOfFrames)?;
        self.take(pfn)
    }

    /// Takes `pages` free data frames in a row whose first frame number is
    /// a multiple of `pages` (a power of two), the lowest such run.
    pub(crate) fn alloc_aligned(&mut self, pages: u64) -> Result<Frame, FrameError> {
        let free = |pfn: u64| {
            self.frames
                .get(pfn as usize)
                .is_some_and(|f| f.state == FrameState::Free)
        };
        let first = (0..self.data_frames / pages.max(1))
            .map(|i| i * pages)
            .find(|&start| (start..start + pages).all(free))
            .ok_or(FrameError::OutOfFrames)?;
        self.free_list
            .retain(|&pfn| !(first..first + pages).contains(&pfn));
        for pfn in first..first + pages {
            self.take(pfn)?;
        }
        if pages > 1 {
            self.runs.insert(first, pages);
        }
        Ok(Frame(first))
    }

    pub(crate) fn alloc_table(&mut self) -> Result<Frame, FrameError> {
        let pfn = self.table_free_list.pop().ok_or(FrameError::OutOfFrames)?;
        self.take(pfn)
    }

    fn take(&mut self, pfn: u64) -> Result<Frame, FrameError> {
        let frame = Frame(pfn);
        let info = self.info(frame)?;
        *info = FrameInfo {
            state: FrameState::InUse,
            data: 0,
            dirty: false,
            poisoned: false,
        };
        Ok(frame)
    }

    /// How many frames the huge frame whose first frame is `frame` spans,
    /// if `alloc_aligned` handed it out and its first frame was not freed
    /// since.
    pub(crate) fn run_of(&self, frame: Frame) -> Option<u64> {
        self.runs.get(&frame.0).copied()
    }

    pub(crate) fn free(&mut self, frame: Frame) -> Result<(), FrameError> {
        self.require(frame, FrameState::InUse)?.state = FrameState::Free;
        self.runs.remove(&frame.0);
        if frame.0 < self.data_frames {
            self.free_list.push(frame.0);
        } else {
            self.table_free_list.push(frame.0);
        }
        Ok(())
    }

    pub(crate) fn start_io(&mut self, frame: Frame) -> Result<(), FrameError> {
        let info = self.require(frame, FrameState::InUse)?;
        info.state = FrameState::UnderIo;
        info.dirty = false;
        Ok(())
    }

    pub(crate) fn end_io(&mut self, frame: Frame) -> Result<(), FrameError> {
        self.require(frame, FrameState::UnderIo)?.state = FrameState::InUse;
        Ok(())
    }

    /// Stores a CPU's write; returns the state the frame was in.
    pub(crate) fn write(&mut self, frame: Frame, value: u64) -> Result<FrameState, FrameError> {
        let info = self.info(frame)?;
        info.data = value;
        Ok(info.state)
    }

    /// A CPU's read: the data and the state the frame was in.
    pub(crate) fn read(&mut self, frame: Frame) -> Result<(u64, FrameState), FrameError> {
        let info = self.info(frame)?;
        Ok((info.data, info.state))
    }

    pub(crate) fn set_dirty(&mut self, frame: Frame) -> Result<(), FrameError> {
        self.info(frame)?.dirty = true;
        Ok(())
    }

    pub(crate) fn is_dirty(&mut self, frame: Frame) -> Result<bool, FrameError> {
        Ok(self.info(frame)?.dirty)
    }

    pub(crate) fn poison(&mut self, frame: Frame) -> Result<(), FrameError> {
        self.info(frame)?.poisoned = true;
        Ok(())
    }

    pub(crate) fn is_poisoned(&mut self, frame: Frame) -> Result<bool, FrameError> {
        Ok(self.info(frame)?.poisoned)
    }

    pub(crate) fn free_count(&self) -> usize {
        self.free_list.len()
    }
}
