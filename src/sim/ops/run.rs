//! Running a sequence of [`Op`]s: one run on a reset machine
//! ([`run_with`]), and the comparison of a batching run with a plain one
//! ([`check_on`], [`check_with`], [`check`]), on x86 or arm64 hardware
//! ([`Hardware`]).

use std::cell::RefCell;
use std::format;
use std::string::String;
use std::thread::LocalKey;
use std::vec::Vec;

use super::driver;
use super::{Op, CPUS, FRAMES};
use crate::page_size::PageSize;
use crate::pte::Frame;
use crate::sim::{Arm64Like, FrameState, MockConfig, MockMachine, Model, Violation, X86Like};

/// Checks `ops` on an untagged or a tagged x86 machine: [`check_on`] with
/// [`Hardware::X86`].
pub fn check_with(ops: &[Op], tagged: bool) -> Result<(Outcome, Outcome), Failure> {
    check_on(ops, tagged, Hardware::X86)
}

/// Checks `ops` on an untagged or a tagged machine of `hardware`: the
/// sequence runs batched and must keep the contract (its `Unmap` steps
/// that do not ask for batching flush at once, so both paths run); then
/// the sequence made blind to accessed bits ([`Op::ignoring_access`]) runs
/// batched and unbatched, and both must keep the contract and end in the
/// same page states. Returns the batched and unbatched outcomes of the
/// blind sequence.
pub fn check_on(ops: &[Op], tagged: bool, hardware: Hardware) -> Result<(Outcome, Outcome), Failure> {
    let config = |batching| RunConfig {
        batching,
        tagged,
        hardware,
    };
    let blind: Vec<Op> = ops.iter().filter_map(|op| op.ignoring_access()).collect();
    if blind != ops {
        run_with(ops, config(true))?;
    }
    let batched = run_with(&blind, config(true))?;
    let plain = run_with(&blind, config(false))?;
    if batched.state != plain.state {
        return Err(Failure {
            step: blind.len(),
            op: None,
            violations: Vec::new(),
            reason: format!(
                "batching changed the end state ({hardware:?}, tagged: {tagged}):\n batched {:?}\n plain   {:?}",
                batched.state, plain.state
            ),
        });
    }
    Ok((batched, plain))
}

/// [`check_on`] on every [`Hardware`], untagged and tagged, and the full
/// sequence unbatched on each too; then the blind sequence's end state must
/// be the same on every hardware (see below). Returns the untagged x86
/// outcomes.
///
/// Why the hardware is compared on the blind sequence only: the full one
/// ages pages and reclaims by their accessed bits, and those legitimately
/// differ between hardware. On arm64 a fill need not set the accessed bit
/// ([`Arch::fill_sets_accessed`](crate::Arch::fill_sets_accessed) is false)
/// and clearing it owes a flush, so the pool's aging epochs and which
/// flushes empty which TLBs differ, and with them which pages a later
/// aging finds referenced. The blind sequence unmaps, migrates, protects
/// and tears down whatever the accessed bits say, so what ends up mapped,
/// freed and written there is the hardware's to change no more than
/// batching's.
pub fn check(ops: &[Op]) -> Result<(Outcome, Outcome), Failure> {
    for hardware in Hardware::ALL {
        for tagged in [false, true] {
            run_with(
                ops,
                RunConfig {
                    batching: false,
                    tagged,
                    hardware,
                },
            )?;
        }
    }
    let untagged = check_hardware(ops, false)?;
    check_hardware(ops, true)?;
    Ok(untagged)
}

/// [`check_on`] on x86 and on arm64 with the same TLB kind, whose blind end
/// states must be the same; returns the x86 outcomes.
fn check_hardware(ops: &[Op], tagged: bool) -> Result<(Outcome, Outcome), Failure> {
    let x86 = check_on(ops, tagged, Hardware::X86)?;
    let arm64 = check_on(ops, tagged, Hardware::Arm64)?;
    if x86.0.state != arm64.0.state {
        return Err(Failure {
            step: ops.len(),
            op: None,
            violations: Vec::new(),
            reason: format!(
                "the hardware changed the end state (tagged: {tagged}):\n x86   {:?}\n arm64 {:?}",
                x86.0.state, arm64.0.state
            ),
        });
    }
    Ok(x86)
}

/// The hardware a run's machine models.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Hardware {
    /// x86 ([`X86Like`]): remote flushes by IPI, fills set the accessed
    /// bit, clearing it needs no flush.
    #[default]
    X86,
    /// arm64 ([`Arm64Like`]): remote flushes by broadcast invalidation;
    /// a batched unmap issues each page's invalidation as the page is added
    /// and the batch's flush waits for them (when the flushing CPU issued
    /// them all) or issues them again; clearing an accessed bit owes a
    /// flush.
    Arm64,
}

impl Hardware {
    /// Every hardware the model runs on.
    pub const ALL: [Hardware; 2] = [Hardware::X86, Hardware::Arm64];
}

/// How a run is set up. The default: unbatched, untagged, x86.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RunConfig {
    /// Whether `Unmap` steps that ask for batching get it.
    pub batching: bool,
    /// Whether TLB entries survive address-space switches (PCID, ASIDs).
    pub tagged: bool,
    /// The machine's hardware.
    pub hardware: Hardware,
}

/// What a run ends with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndState {
    /// For each (space, page), the kernel's included: the mapped frame and
    /// whether it is writable.
    pub mappings: Vec<Option<(Frame, bool)>>,
    /// For each frame: its life-cycle state and dirty flag.
    pub frames: Vec<(FrameState, bool)>,
    /// For each region of the huge space and each of its named pieces
    /// ([`huge::PIECES`](super::huge::PIECES)): the frame it maps, whether
    /// it is writable, and the size of the entry that maps it.
    pub huge: Vec<Option<(Frame, bool, PageSize)>>,
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
    /// Frames moved into the driver's pool.
    pub pooled: u64,
    /// Pooled frames handed back because every CPU that could cache them
    /// had flushed on its own (no IPI).
    pub released_by_passes: u64,
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

/// One machine per TLB kind (untagged, tagged) of a hardware.
type Machines<M> = [RefCell<Option<MockMachine<M>>>; 2];

std::thread_local! {
    /// One machine per hardware, TLB kind and thread, reset between runs:
    /// a fuzzer's thread runs millions of inputs on them.
    static X86_MACHINES: Machines<X86Like> = const { [RefCell::new(None), RefCell::new(None)] };
    static ARM64_MACHINES: Machines<Arm64Like> = const { [RefCell::new(None), RefCell::new(None)] };
}

/// Runs `f` on the thread's machine of `machines` for `tagged`, reset
/// (made on first use).
fn with_machine<M: Model, R>(
    machines: &'static LocalKey<Machines<M>>,
    tagged: bool,
    f: impl FnOnce(&MockMachine<M>) -> R,
) -> Result<R, String> {
    machines.with(|machines| {
        let mut slot = machines[usize::from(tagged)].borrow_mut();
        match slot.as_ref() {
            Some(m) => m.reset(),
            None => {
                let m = MockMachine::<M>::with_model(MockConfig {
                    frames: FRAMES,
                    // The small spaces' leaf tables, and the huge space's
                    // (a split takes one before the old is freed).
                    table_frames: 24,
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

/// Runs `ops` on an untagged x86 machine, with `Unmap` steps batched as they
/// ask (`batching`) or never. See [`run_with`].
pub fn run(ops: &[Op], batching: bool) -> Result<Outcome, Failure> {
    run_with(
        ops,
        RunConfig {
            batching,
            ..RunConfig::default()
        },
    )
}

/// Runs `ops` on a fresh (reset) machine of [`CPUS`] CPUs,
/// [`SPACES`](super::SPACES) user address spaces and the kernel's,
/// [`PAGES`](super::PAGES) pages each and [`FRAMES`] frames. After every
/// step the oracle's record must be empty, and after every change of a
/// range no CPU may keep an entry that disagrees with the page table; at
/// the end every batch and the frame pool are flushed, every held frame
/// put, and the end state read.
pub fn run_with(ops: &[Op], config: RunConfig) -> Result<Outcome, Failure> {
    let fail = |step: usize, op: Option<Op>, violations: Vec<Violation>, reason: String| Failure {
        step,
        op,
        violations,
        reason,
    };
    let (tagged, batching) = (config.tagged, config.batching);
    match config.hardware {
        Hardware::X86 => with_machine(&X86_MACHINES, tagged, |m| run_on(m, ops, batching)),
        Hardware::Arm64 => with_machine(&ARM64_MACHINES, tagged, |m| run_on(m, ops, batching)),
    }
    .map_err(|r| fail(0, None, Vec::new(), r))?
}

fn run_on<M: Model>(m: &MockMachine<M>, ops: &[Op], batching: bool) -> Result<Outcome, Failure> {
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
        pooled: stats.frames_pooled,
        released_by_passes: stats.frames_released_by_passes,
    })
}
