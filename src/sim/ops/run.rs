//! Running a sequence of [`Op`]s: one run on a reset machine
//! ([`run_with`]), and the comparison of a batching run with a plain one
//! ([`check_with`], [`check`]).

use std::cell::RefCell;
use std::format;
use std::string::String;
use std::vec::Vec;

use super::driver;
use super::{Op, CPUS, FRAMES};
use crate::pte::Frame;
use crate::sim::{FrameState, MockConfig, MockMachine, Violation};

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
        pooled: stats.frames_pooled,
        released_by_passes: stats.frames_released_by_passes,
    })
}
