//! An operation model for fuzzing and property tests: a sequence of
//! [`Op`]s run on a small mock machine by a driver that behaves as a kernel
//! using the crate would, with the oracle consulted after every step.
//!
//! What it covers: three CPUs, any of which initiates; two user address
//! spaces and the kernel's (whose last page is the last page of the address
//! space); maps, shared mappings, accesses and switches; the low-level API
//! ([`try_to_unmap`](crate::try_to_unmap) into one of two
//! [`TlbFlushUnmapBatch`](crate::TlbFlushUnmapBatch)es, with and without
//! [`TtuFlags::IGNORE_ACCESS`](crate::TtuFlags::IGNORE_ACCESS), aging,
//! flush, dirty flush, write-out, free) and the typed one (two
//! [`UnmapBatch`](crate::UnmapBatch)es); the reclaim, migration, mprotect
//! and teardown drivers; failures injected into flushes
//! ([`MockCpu::in_shootdown`](super::MockCpu::in_shootdown)) followed by
//! the documented retry; CPUs going offline and coming back; hostile input
//! (non-canonical addresses, ranges across the hole or past the top, ASIDs
//! wider than the hardware's), which must be refused with nothing changed;
//! and untagged or tagged TLBs.
//!
//! The driver keeps frames the way a kernel with reference counts does: a
//! frame is freed when no mapping and no holder (a batch, a reclaim or
//! migration in progress, an I/O) is left, and only ever through the
//! crate's flush points.
//!
//! [`run`] returns the end state (which frame each page maps and how, and
//! every frame's life-cycle state), so that a batched and an unbatched run
//! of the same sequence can be compared: batching changes when TLB entries
//! go, never what ends up mapped, freed or written. Accessed bits and data
//! are left out of that comparison on purpose: a stale entry may serve an
//! access before the flush point in the batched run, which the contract
//! allows.
//!
//! Runs reuse one machine per thread and configuration
//! ([`MockMachine::reset`]), so a fuzzer pays for the operations, not for
//! building machines.
//!
//! With the `arbitrary` feature, [`Op`] implements `arbitrary::Arbitrary`,
//! so a fuzzer or a property test can make sequences from raw bytes.

mod backing;
pub mod concurrent;
mod driver;

use std::cell::RefCell;
use std::format;
use std::string::String;
use std::vec::Vec;

use super::{FrameState, MockConfig, MockMachine, Violation};
use crate::pte::{Frame, PAGE_SIZE};

/// CPUs of the modelled machine.
pub const CPUS: usize = 3;
/// User address spaces (the kernel's comes on top, as space `SPACES`).
pub const SPACES: usize = 2;
/// Pages per address space (few, so that random sequences meet often).
pub const PAGES: usize = 4;
/// Physical frames.
pub const FRAMES: usize = 48;
/// Batches of each kind the driver keeps at once.
pub const BATCHES: usize = 2;

const BASE: u64 = 0x40_0000;
/// The kernel's pages end at the last page of the address space.
const KERNEL_TOP: u64 = !(PAGE_SIZE - 1);

/// The address of `page` in address space `space` (`SPACES` is the
/// kernel's).
pub fn va(space: usize, page: usize) -> u64 {
    if space >= SPACES {
        KERNEL_TOP - (PAGES - 1 - page % PAGES) as u64 * PAGE_SIZE
    } else {
        BASE + (page % PAGES) as u64 * PAGE_SIZE
    }
}

/// How the kernel model writes a dirty page out in a reclaim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum Io {
    /// The write completes at once.
    Synchronous,
    /// The write stays under way until an [`Op::EndIo`].
    Queued,
    /// The write cannot start.
    Failing,
}

/// Bad input an entry point must refuse with a typed error, changing
/// nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum BadInput {
    /// `add_pending` of a non-canonical address.
    AddPending,
    /// `flush_tlb_page` of a non-canonical address.
    FlushPage,
    /// `change_protection` of a range across the hole.
    Protect,
    /// `MmuGather::unmap_range` of a non-canonical range.
    Teardown,
    /// `try_to_unmap` through a reverse map that reports a non-canonical
    /// mapping after a good one.
    RmapAddress,
    /// `switch_mm` to an address space whose ASID is wider than the
    /// hardware's.
    WideAsid,
    /// A range that runs past the top of the address space.
    PastTheTop,
}

/// One step. Indices are taken modulo the model's sizes, so every value is
/// a valid step; a step whose precondition does not hold (mapping an
/// occupied page, an initiator that is offline) does nothing.
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
    /// Map the frame at `page` of `space` in the next user address space
    /// too.
    Share {
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
    },
    /// CPU `cpu` switches to `space` if it is a user space it does not run,
    /// then reads or writes `page`.
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
    /// CPU `cpu` switches to user space `space`.
    Switch {
        /// CPU.
        cpu: u8,
        /// Address space.
        space: u8,
    },
    /// Low-level `try_to_unmap` of the frame at `page` of `space`, from
    /// `cpu`, into low-level batch `batch`.
    Unmap {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Which batch.
        batch: u8,
        /// With [`TtuFlags::BATCH_FLUSH`](crate::TtuFlags::BATCH_FLUSH) (in
        /// a batching run).
        batched: bool,
        /// With [`TtuFlags::IGNORE_ACCESS`](crate::TtuFlags::IGNORE_ACCESS).
        ignore_access: bool,
    },
    /// Typed `UnmapBatch::try_to_unmap` into typed batch `batch`.
    TypedUnmap {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Which typed batch.
        batch: u8,
        /// With [`TtuFlags::IGNORE_ACCESS`](crate::TtuFlags::IGNORE_ACCESS).
        ignore_access: bool,
    },
    /// `page_referenced` of the frame at `page` of `space` into low-level
    /// batch `batch`.
    Referenced {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Which batch.
        batch: u8,
    },
    /// Flush low-level batch `batch` (`typed`: the typed one, whose frames
    /// are then put), with a failure injected first when `fail`, then the
    /// documented retry.
    Flush {
        /// Initiating CPU.
        cpu: u8,
        /// Which batch.
        batch: u8,
        /// The typed batch rather than the low-level one.
        typed: bool,
        /// Inject a failed flush first.
        fail: bool,
    },
    /// `flush_dirty` on a low-level or typed batch (the typed one's lent
    /// frames are written out).
    FlushDirty {
        /// Initiating CPU.
        cpu: u8,
        /// Which batch.
        batch: u8,
        /// The typed batch rather than the low-level one.
        typed: bool,
        /// Inject a failed flush first.
        fail: bool,
    },
    /// Write out an unmapped dirty frame of the low-level API (after its
    /// batches' dirty flush).
    WriteOut {
        /// Which unmapped frame.
        index: u8,
    },
    /// Free an unmapped frame of the low-level API (after its batches'
    /// flush).
    Free {
        /// Which unmapped frame.
        index: u8,
    },
    /// Reclaim the frames mapped in `space` at the pages of `pages` (a bit
    /// mask) with [`shrink_page_list`](crate::shrink_page_list).
    Reclaim {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Which pages (bit mask).
        pages: u8,
        /// How page-out behaves.
        io: Io,
        /// Whether the allocator refuses the batched free.
        refuse_free: bool,
        /// Inject a failed flush first, then retry.
        fail: bool,
    },
    /// A queued write-out completes.
    EndIo {
        /// Which frame under I/O.
        index: u8,
    },
    /// Migrate the frame at `page` of `space` with
    /// [`migrate_pages`](crate::migrate_pages).
    Migrate {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// Page.
        page: u8,
        /// Whether no target frame can be allocated.
        no_memory: bool,
        /// Inject a failed flush first, then retry.
        fail: bool,
    },
    /// Write-protect pages `first..first + count` of `space` (mprotect).
    Protect {
        /// Initiating CPU.
        cpu: u8,
        /// Address space.
        space: u8,
        /// First page.
        first: u8,
        /// How many pages.
        count: u8,
        /// Inject a failed flush first, then retry.
        fail: bool,
    },
    /// Tear down the leaf table that holds `space`'s pages (a munmap of its
    /// whole span): every page unmapped, the table detached and freed after
    /// its flush, with [`TableFreePolicy::IpiSync`](crate::TableFreePolicy)
    /// when `cpu / CPUS` is odd and `AfterFlush` otherwise.
    Teardown {
        /// Initiating CPU (`cpu % CPUS`; the quotient picks the policy).
        cpu: u8,
        /// Address space.
        space: u8,
        /// Inject a failed flush first, then finish and retry.
        fail: bool,
    },
    /// CPU `cpu` goes offline (unless it is the last one online).
    Offline {
        /// CPU.
        cpu: u8,
    },
    /// CPU `cpu` comes back online through the kernel's online path.
    Online {
        /// CPU.
        cpu: u8,
    },
    /// Bad input given to an entry point from `cpu`.
    Hostile {
        /// Initiating CPU.
        cpu: u8,
        /// What.
        kind: BadInput,
    },
}

impl Op {
    /// The same step made blind to accessed bits, or `None` for a step that
    /// is about them: unmaps ignore them, aging and reclaim (whose verdicts
    /// follow them) go. Accessed bits legitimately differ between a batched
    /// and an unbatched run (a stale entry serves an access without a walk,
    /// a rule-5 flush empties a TLB the other run keeps), so the two runs
    /// are compared on sequences made blind with this.
    pub fn ignoring_access(self) -> Option<Op> {
        match self {
            Op::Unmap {
                cpu,
                space,
                page,
                batch,
                batched,
                ..
            } => Some(Op::Unmap {
                cpu,
                space,
                page,
                batch,
                batched,
                ignore_access: true,
            }),
            Op::TypedUnmap {
                cpu,
                space,
                page,
                batch,
                ..
            } => Some(Op::TypedUnmap {
                cpu,
                space,
                page,
                batch,
                ignore_access: true,
            }),
            Op::Referenced { .. } | Op::Reclaim { .. } => None,
            op => Some(op),
        }
    }
}

/// Checks `ops` on an untagged or a tagged machine: the sequence runs
/// batched and must keep the contract (its `Unmap` steps that do not ask
/// for batching flush at once, so both paths run); then the sequence made
/// blind to accessed bits ([`Op::ignoring_access`]) runs batched and
/// unbatched, and both must keep the contract and end in the same page
/// states. Returns the batched and unbatched outcomes of the blind
/// sequence.
pub fn check_with(ops: &[Op], tagged: bool) -> Result<(Outcome, Outcome), Failure> {
    let blind: Vec<Op> = ops.iter().filter_map(|op| op.ignoring_access()).collect();
    if blind != ops {
        run_with(
            ops,
            RunConfig {
                batching: true,
                tagged,
            },
        )?;
    }
    let batched = run_with(
        &blind,
        RunConfig {
            batching: true,
            tagged,
        },
    )?;
    let plain = run_with(
        &blind,
        RunConfig {
            batching: false,
            tagged,
        },
    )?;
    if batched.state != plain.state {
        return Err(Failure {
            step: blind.len(),
            op: None,
            violations: Vec::new(),
            reason: format!(
                "batching changed the end state (tagged: {tagged}):\n batched {:?}\n plain   {:?}",
                batched.state, plain.state
            ),
        });
    }
    Ok((batched, plain))
}

/// [`check_with`] on an untagged and on a tagged machine, and the full
/// sequence unbatched too; returns the untagged outcomes.
pub fn check(ops: &[Op]) -> Result<(Outcome, Outcome), Failure> {
    for tagged in [false, true] {
        run_with(
            ops,
            RunConfig {
                batching: false,
                tagged,
            },
        )?;
    }
    let tagged = check_with(ops, true);
    check_with(ops, false).and_then(|untagged| tagged.map(|_| untagged))
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

/// How a run is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RunConfig {
    /// Whether `Unmap` steps that ask for batching get it.
    pub batching: bool,
    /// Whether TLB entries survive address-space switches (PCID).
    pub tagged: bool,
}

/// What a run ends with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndState {
    /// For each (space, page), the kernel's included: the mapped frame and
    /// whether it is writable.
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
    pub op: Option<Op>,
    /// The oracle's findings (empty when the crate returned an error).
    pub violations: Vec<Violation>,
    /// What went wrong.
    pub reason: String,
}

std::thread_local! {
    /// One machine per TLB kind (untagged, tagged) and thread, reset
    /// between runs: a fuzzer's thread runs millions of inputs on them.
    static MACHINES: [RefCell<Option<MockMachine>>; 2] = const { [RefCell::new(None), RefCell::new(None)] };
}

/// Runs `f` on the thread's machine for `tagged`, reset (made on first
/// use).
fn with_machine<R>(tagged: bool, f: impl FnOnce(&MockMachine) -> R) -> Result<R, String> {
    MACHINES.with(|machines| {
        let mut slot = machines[usize::from(tagged)].borrow_mut();
        match slot.as_ref() {
            Some(m) => m.reset(),
            None => {
                let m = MockMachine::new(MockConfig {
                    frames: FRAMES,
                    table_frames: 16,
                    tlb_entries: 16,
                    tagged_tlb: tagged,
                    ..MockConfig::x86_like(CPUS)
                })
                .map_err(|e| format!("{e}"))?;
                *slot = Some(m);
            }
        }
        match slot.as_ref() {
            Some(m) => Ok(f(m)),
            None => Err("no machine".into()),
        }
    })
}

/// Runs `ops` on an untagged machine, with `Unmap` steps batched as they
/// ask (`batching`) or never. See [`run_with`].
pub fn run(ops: &[Op], batching: bool) -> Result<Outcome, Failure> {
    run_with(
        ops,
        RunConfig {
            batching,
            tagged: false,
        },
    )
}

/// Runs `ops` on a fresh (reset) machine of [`CPUS`] CPUs, [`SPACES`] user
/// address spaces and the kernel's, [`PAGES`] pages each and [`FRAMES`]
/// frames. After every step the oracle's record must be empty, and after
/// every change of a range no CPU may keep an entry that disagrees with the
/// page table; at the end every batch is flushed, every held frame put, and
/// the end state read.
pub fn run_with(ops: &[Op], config: RunConfig) -> Result<Outcome, Failure> {
    let fail = |step: usize, op: Option<Op>, violations: Vec<Violation>, reason: String| Failure {
        step,
        op,
        violations,
        reason,
    };
    with_machine(config.tagged, |m| run_on(m, ops, config.batching))
        .map_err(|r| fail(0, None, Vec::new(), r))?
}

fn run_on(m: &MockMachine, ops: &[Op], batching: bool) -> Result<Outcome, Failure> {
    let fail = |step: usize, op: Option<Op>, violations: Vec<Violation>, reason: String| Failure {
        step,
        op,
        violations,
        reason,
    };
    let mut driver = driver::Driver::new(m, batching).map_err(|r| fail(0, None, Vec::new(), r))?;
    for (step, &op) in ops.iter().enumerate() {
        driver
            .step(step, op)
            .map_err(|reason| fail(step, Some(op), m.violations(), reason))?;
        if m.violation_count() != 0 {
            return Err(fail(
                step,
                Some(op),
                m.violations(),
                "the oracle saw a violation".into(),
            ));
        }
    }
    let last = ops.len();
    driver
        .finish()
        .map_err(|reason| fail(last, None, m.violations(), reason))?;
    if m.violation_count() != 0 {
        return Err(fail(last, None, m.violations(), "violation at the end".into()));
    }
    let state = driver
        .end_state()
        .map_err(|reason| fail(last, None, m.violations(), reason))?;
    let stats = m.stats();
    Ok(Outcome {
        state,
        ipis: stats.ipis_sent,
        deferred: stats.pages_deferred,
    })
}
