//! An operation model for fuzzing and property tests: a sequence of
//! [`Op`]s (map, access from CPU k, switch, unmap with or without batching,
//! age, flush, flush_dirty, write out, free, migrate, mprotect-like change,
//! range teardown) run on a small mock machine by a driver that follows the
//! crate's protocol, with the oracle consulted after every step.
//!
//! [`run`] returns the end state (which frame each page maps and how, and
//! every frame's life-cycle state), so that a batched and an unbatched run
//! of the same sequence can be compared: batching changes when TLB entries
//! go, never what ends up mapped, freed or written. Accessed bits and data
//! are left out of that comparison on purpose: a stale entry may serve an
//! access before the flush point in the batched run, which the contract
//! allows.
//!
//! With the `arbitrary` feature, [`Op`] implements `arbitrary::Arbitrary`,
//! so a fuzzer or a property test can make sequences from raw bytes.

use std::format;
use std::string::String;
use std::sync::Arc;
use std::vec::Vec;

use super::{FrameState, MockConfig, MockKernel, MockMachine, MockRmap, MockSpace, Violation};
use crate::arch::Asid;
use crate::gather::{MmuGather, TableFreePolicy, TeardownBacking};
use crate::migrate::{migrate_pages, MigrateOutcome};
use crate::mm::{flush_tlb_batched_pending, MmTlbState};
use crate::mprotect::change_protection;
use crate::pte::{Frame, Pte, PteFlags, PAGE_SIZE};
use crate::range::PageRange;
use crate::rmap::{page_referenced, try_to_unmap, MappingFlags, Rmap, TtuFlags};
use crate::unmap::{FreeFrames, OwnedFrame, UnmapBatch};
use crate::TlbFlushUnmapBatch;

/// CPUs of the modelled machine.
pub const CPUS: usize = 3;
/// Address spaces.
pub const SPACES: usize = 2;
/// Pages per address space (few, so that random sequences meet often).
pub const PAGES: usize = 4;
/// Physical frames.
pub const FRAMES: usize = 40;

const BASE: u64 = 0x40_0000;

fn va(page: usize) -> u64 {
    BASE + page as u64 * PAGE_SIZE
}

/// Every page of an address space of the model.
fn range() -> PageRange {
    PageRange::new(BASE, PAGES as u64).unwrap_or(PageRange::EMPTY)
}

/// One step. Indices are taken modulo the model's sizes, so every value is
/// a valid step; a step whose precondition does not hold (mapping an
/// occupied page, say) does nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum Op {
    /// Map a new frame at `page` of `space`.
    Map {
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Whether writes are allowed.
        writable: bool,
    },
    /// Map the frame at `page` of `space` in the other address space too.
    Share {
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
    },
    /// CPU `cpu` switches to `space` if it runs another one, then reads or
    /// writes `page`.
    Access {
        /// CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Write rather than read.
        write: bool,
    },
    /// CPU `cpu` switches to `space`.
    Switch {
        /// CPU.
        cpu: u8,
        /// Address space.
        space: u8,
    },
    /// `try_to_unmap` of the frame at `page` of `space`, with its flush
    /// batched or not.
    Unmap {
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// With [`TtuFlags::BATCH_FLUSH`] (in a batching run).
        batched: bool,
    },
    /// `page_referenced` of the frame at `page` of `space`.
    Referenced {
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
    },
    /// Flush the batch.
    Flush,
    /// `flush_dirty` on the batch.
    FlushDirty,
    /// Write out an unmapped dirty frame (after the dirty flush).
    WriteOut {
        /// Which unmapped frame.
        index: u8,
    },
    /// Free an unmapped frame (after the flush).
    Free {
        /// Which unmapped frame.
        index: u8,
    },
    /// Migrate the frame at `page` of `space`.
    Migrate {
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
    },
    /// Write-protect every page of `space` (mprotect).
    Protect {
        /// Address space.
        space: u8,
    },
    /// Tear down every page of `space` (munmap).
    Teardown {
        /// Address space.
        space: u8,
    },
}

/// Decodes `bytes` into operations, one after another until the bytes run
/// out (so that every byte counts: `Vec::arbitrary` would read a "go on?"
/// flag before each element and stop after a couple of them).
#[cfg(feature = "arbitrary")]
#[cfg_attr(docsrs, doc(cfg(feature = "arbitrary")))]
pub fn ops_from_bytes(bytes: &[u8]) -> Vec<Op> {
    use arbitrary::Arbitrary;
    let mut u = arbitrary::Unstructured::new(bytes);
    let mut ops = Vec::new();
    while !u.is_empty() {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    ops
}

/// What a run ends with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndState {
    /// For each (space, page): the mapped frame and whether it is writable.
    pub mappings: Vec<Option<(Frame, bool)>>,
    /// For each frame: its life-cycle state and dirty flag.
    pub frames: Vec<(FrameState, bool)>,
}

/// The end state and a few counts (which differ between batched and
/// unbatched runs, so they are not part of [`EndState`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The end state.
    pub state: EndState,
    /// Flush IPIs sent.
    pub ipis: u64,
    /// Pages whose flush was deferred.
    pub deferred: u64,
}

/// Why a run stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Index of the step.
    pub step: usize,
    /// The step.
    pub op: Op,
    /// The oracle's findings (empty when the crate returned an error).
    pub violations: Vec<Violation>,
    /// What went wrong.
    pub reason: String,
}

/// A teardown backing with reference counts: a frame still mapped
/// elsewhere is not freed (handed back instead).
struct Refcounted<'r, 'm> {
    rmap: &'r MockRmap<'m>,
    machine: &'m MockMachine,
}

impl FreeFrames for Refcounted<'_, '_> {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        let mut kept: heapless::Vec<OwnedFrame, N> = heapless::Vec::new();
        while let Some(f) = frames.pop() {
            if self.rmap.mapcount(f.frame()) == 0 && self.machine.free_frame(f.frame()).is_ok() {
                self.rmap.remove_frame(f.frame());
            } else {
                // At most what `frames` held.
                let _ = kept.push(f);
            }
        }
        *frames = kept;
    }
}

impl TeardownBacking for Refcounted<'_, '_> {
    fn set_dirty(&mut self, frame: Frame) {
        let _ = self.machine.set_frame_dirty(frame);
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        let mut kept: heapless::Vec<OwnedFrame, N> = heapless::Vec::new();
        while let Some(t) = tables.pop() {
            if self.machine.free_frame(t.frame()).is_err() {
                let _ = kept.push(t);
            }
        }
        *tables = kept;
    }
}

struct Driver<'m> {
    m: &'m MockMachine,
    rmap: MockRmap<'m>,
    slots: [[Option<Frame>; PAGES]; SPACES],
    unmapped: Vec<Frame>,
    batch: TlbFlushUnmapBatch,
    batching: bool,
}

impl<'m> Driver<'m> {
    fn mm(&self, space: usize) -> &Arc<MmTlbState> {
        self.rmap.spaces()[space].mm()
    }

    fn forget(&mut self, frame: Frame) {
        for row in &mut self.slots {
            for slot in row.iter_mut().filter(|s| **s == Some(frame)) {
                *slot = None;
            }
        }
    }

    fn step(&mut self, step: usize, op: Op) -> Result<(), String> {
        let m = self.m;
        let cpu0 = m.cpu(0).map_err(|e| format!("{e}"))?;
        let err = |e: crate::Error| format!("crate error: {e}");
        match op {
            Op::Map {
                space,
                page,
                writable,
            } => {
                let (s, p) = (usize::from(space) % SPACES, usize::from(page) % PAGES);
                if self.slots[s][p].is_none() {
                    // Rule 5 at fault time: a CPU may still write through a
                    // stale entry for this address into the frame a
                    // reclaimer unmapped; a new frame goes in only after
                    // that batch is flushed.
                    flush_tlb_batched_pending(&cpu0, self.mm(s)).map_err(err)?;
                    if let Ok(f) = m.alloc_frame() {
                        self.rmap
                            .map(f, s, va(p), writable, MappingFlags::empty())
                            .map_err(|e| format!("{e:?}"))?;
                        self.slots[s][p] = Some(f);
                    }
                }
            }
            Op::Share { space, page } => {
                let (s, p) = (usize::from(space) % SPACES, usize::from(page) % PAGES);
                let o = (s + 1) % SPACES;
                if let (Some(f), None) = (self.slots[s][p], self.slots[o][p]) {
                    flush_tlb_batched_pending(&cpu0, self.mm(o)).map_err(err)?;
                    let pte = m.pte(self.mm(s), va(p)).map_err(|e| format!("{e:?}"))?;
                    if pte.maps(f) {
                        self.rmap
                            .map(f, o, va(p), pte.is_writable(), MappingFlags::SHARED)
                            .map_err(|e| format!("{e:?}"))?;
                        self.slots[o][p] = Some(f);
                    }
                }
            }
            Op::Access {
                cpu,
                space,
                page,
                write,
            } => {
                let c = m.cpu(usize::from(cpu) % CPUS).map_err(|e| format!("{e}"))?;
                let mm = self.mm(usize::from(space) % SPACES);
                if c.current_mm().map_or(true, |cur| !Arc::ptr_eq(&cur, mm)) {
                    c.switch_to(mm).map_err(|e| format!("{e:?}"))?;
                }
                let p = usize::from(page) % PAGES;
                // Faults are normal (unmapped, protected pages).
                let _ = if write {
                    c.write(va(p), step as u64)
                } else {
                    c.read(va(p)).map(|_| ())
                };
            }
            Op::Switch { cpu, space } => {
                let c = m.cpu(usize::from(cpu) % CPUS).map_err(|e| format!("{e}"))?;
                c.switch_to(self.mm(usize::from(space) % SPACES))
                    .map_err(|e| format!("{e:?}"))?;
            }
            Op::Unmap { space, page, batched } => {
                let (s, p) = (usize::from(space) % SPACES, usize::from(page) % PAGES);
                if let Some(f) = self.slots[s][p] {
                    let mut flags = TtuFlags::IGNORE_ACCESS;
                    if batched && self.batching {
                        flags |= TtuFlags::BATCH_FLUSH;
                    }
                    let r = try_to_unmap(&cpu0, &self.rmap, f, flags, &mut self.batch).map_err(err)?;
                    if r.is_unmapped() {
                        self.forget(f);
                        self.unmapped.push(f);
                    }
                }
            }
            Op::Referenced { space, page } => {
                let (s, p) = (usize::from(space) % SPACES, usize::from(page) % PAGES);
                if let Some(f) = self.slots[s][p] {
                    page_referenced(&cpu0, &self.rmap, f, &mut self.batch).map_err(err)?;
                }
            }
            Op::Flush => {
                self.batch.flush(&cpu0).map_err(err)?;
            }
            Op::FlushDirty => {
                self.batch.flush_dirty(&cpu0).map_err(err)?;
            }
            Op::WriteOut { index } => {
                if !self.unmapped.is_empty() {
                    let f = self.unmapped[usize::from(index) % self.unmapped.len()];
                    if m.frame_dirty(f) == Ok(true) && m.frame_state(f) == Ok(FrameState::InUse) {
                        // The protocol: no I/O before the dirty flush.
                        self.batch.flush_dirty(&cpu0).map_err(err)?;
                        m.start_io(f).map_err(|e| format!("{e:?}"))?;
                        m.end_io(f).map_err(|e| format!("{e:?}"))?;
                    }
                }
            }
            Op::Free { index } => {
                if !self.unmapped.is_empty() {
                    let f = self.unmapped.remove(usize::from(index) % self.unmapped.len());
                    // The protocol: no free before the flush.
                    self.batch.flush(&cpu0).map_err(err)?;
                    self.rmap.remove_frame(f);
                    m.free_frame(f).map_err(|e| format!("{e:?}"))?;
                }
            }
            Op::Migrate { space, page } => {
                let (s, p) = (usize::from(space) % SPACES, usize::from(page) % PAGES);
                if let Some(f) = self.slots[s][p] {
                    let mut kernel = MockKernel::new(&self.rmap);
                    let mut batch = UnmapBatch::<1>::new();
                    let mut moved = None;
                    // SAFETY: the driver's slots name each mapped frame once,
                    // and the frame is freed only through this handle.
                    let handle = unsafe { OwnedFrame::new(f) };
                    migrate_pages(&cpu0, &self.rmap, &mut kernel, &mut batch, [handle], &mut |o| {
                        if let MigrateOutcome::Migrated { old, new } = o {
                            moved = Some((old, new.into_frame()));
                        }
                    })
                    .map_err(|retry| format!("migration stopped: {:?}", retry.error()))?;
                    if let Some((old, new)) = moved {
                        for slot in self.slots.iter_mut().flatten().filter(|s| **s == Some(old)) {
                            *slot = Some(new);
                        }
                    }
                }
            }
            Op::Protect { space } => {
                let s = usize::from(space) % SPACES;
                let table: &MockSpace<'_> = &self.rmap.spaces()[s];
                change_protection(&cpu0, table, range(), |pte| {
                    Pte(pte.0 & !PteFlags::WRITABLE.bits())
                })
                .map_err(err)?;
                // No CPU may keep a stale entry in the range once it returned.
                m.check_coherent(self.mm(s), range());
            }
            Op::Teardown { space } => {
                let s = usize::from(space) % SPACES;
                let mut backing = Refcounted {
                    rmap: &self.rmap,
                    machine: m,
                };
                let mut gather = MmuGather::<8>::new();
                let mut policy = TableFreePolicy::AfterFlush;
                gather
                    .unmap_range(
                        &cpu0,
                        &self.rmap.spaces()[s],
                        &mut backing,
                        range(),
                        true,
                        &mut policy,
                        // Frames still mapped in the other space stay there.
                        &mut |_, _| {},
                    )
                    .map_err(err)?;
                self.slots[s] = [None; PAGES];
                m.check_coherent(self.mm(s), range());
            }
        }
        Ok(())
    }

    fn end_state(&self) -> Result<EndState, String> {
        let mut mappings = Vec::new();
        for s in 0..SPACES {
            for p in 0..PAGES {
                let pte = self.m.pte(self.mm(s), va(p)).map_err(|e| format!("{e:?}"))?;
                mappings.push(pte.is_present().then(|| (pte.frame(), pte.is_writable())));
            }
        }
        let frames = (0..FRAMES as u64)
            .map(|f| {
                let frame = Frame(f);
                Ok((
                    self.m.frame_state(frame).map_err(|e| format!("{e:?}"))?,
                    self.m.frame_dirty(frame).map_err(|e| format!("{e:?}"))?,
                ))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(EndState { mappings, frames })
    }
}

/// Runs `ops` on a fresh machine ([`CPUS`] CPUs, [`SPACES`] address spaces
/// of [`PAGES`] pages, [`FRAMES`] frames), with `Unmap` steps batched as
/// they ask (`batching`) or never. After every step the oracle's record
/// must be empty; at the end the batch is flushed and the end state read.
pub fn run(ops: &[Op], batching: bool) -> Result<Outcome, Failure> {
    let fail = |step: usize, op: Op, violations: Vec<Violation>, reason: String| Failure {
        step,
        op,
        violations,
        reason,
    };
    let machine = MockMachine::new(MockConfig {
        frames: FRAMES,
        tlb_entries: 16,
        ..MockConfig::x86_like(CPUS)
    })
    .map_err(|e| fail(0, Op::Flush, Vec::new(), format!("{e}")))?;
    let mut spaces = Vec::new();
    for i in 0..SPACES {
        let mm = Asid::new(i as u16 + 1)
            .map_err(|e| format!("{e}"))
            .and_then(|asid| machine.new_mm(asid).map_err(|e| format!("{e:?}")))
            .map_err(|reason| fail(0, Op::Flush, Vec::new(), reason))?;
        spaces.push(machine.space(&mm));
    }
    let mut driver = Driver {
        m: &machine,
        rmap: MockRmap::new(&machine, spaces),
        slots: [[None; PAGES]; SPACES],
        unmapped: Vec::new(),
        batch: TlbFlushUnmapBatch::new(),
        batching,
    };
    for (step, &op) in ops.iter().enumerate() {
        driver
            .step(step, op)
            .map_err(|reason| fail(step, op, machine.violations(), reason))?;
        let violations = machine.violations();
        if !violations.is_empty() {
            return Err(fail(step, op, violations, "the oracle saw a violation".into()));
        }
    }
    let last = ops.len();
    let cpu0 = machine
        .cpu(0)
        .map_err(|e| fail(last, Op::Flush, Vec::new(), format!("{e}")))?;
    driver
        .batch
        .flush(&cpu0)
        .map_err(|e| fail(last, Op::Flush, Vec::new(), format!("{e}")))?;
    let state = driver
        .end_state()
        .map_err(|reason| fail(last, Op::Flush, machine.violations(), reason))?;
    let stats = machine.stats();
    Ok(Outcome {
        state,
        ipis: stats.ipis_sent,
        deferred: stats.pages_deferred,
    })
}
