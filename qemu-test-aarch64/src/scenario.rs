//! The shootdown scenarios, written against [`Platform`] only: nothing here
//! knows how the machine booted, which architecture it is, or how a TLB is
//! invalidated. The x86_64 kernel (`qemu-test/`) is meant to run the same
//! set later through its own `Platform`.
//!
//! One test page P of a non-global (ASID-tagged) address space can map
//! frame A or frame B. A round:
//!
//! 1. the driver (CPU 0) writes a fresh pattern into A and B, maps P to A,
//!    flushes P on every CPU, and starts the round;
//! 2. every other CPU (an observer) reads P until it has seen A's pattern
//!    [`WARM_READS`] times in a row, says so, and keeps reading P in a tight
//!    loop, so that its TLB holds P -> A;
//! 3. the driver changes P (below) and makes the change visible with the
//!    flush under test, then raises the round's signal;
//! 4. each observer, once it sees the signal, reads P once more and reports
//!    what it read.
//!
//! The changes: *unmap* clears P's entry, and the observers must then
//! fault; *remap* clears it, flushes, and maps P to B (break-before-make,
//! as the architecture asks before a live entry's output address
//! changes), and the observers must then read B's pattern. Reading A's
//! pattern after the signal is a stale translation: a flush that did not
//! reach that CPU. The negative controls weaken the flush under test (skip
//! it, or flush the driver's CPU only; the page-table stores are still
//! published) and must see exactly that.

use core::fmt;
use core::sync::atomic::{AtomicU64, Ordering};

/// CPUs the scenarios can coordinate (CPU 0 drives, the others observe).
pub const MAX_CPUS: usize = 16;
/// Consecutive reads of A's pattern an observer makes before it reports
/// itself warm: its TLB then holds P -> A.
pub const WARM_READS: u32 = 64;
/// How long the driver waits for the observers at each step.
const WAIT_LIMIT_US: u64 = 10_000_000;

/// A frame P can map.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Frame {
    A,
    B,
}

/// How the driver makes its change of P's entry visible.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Flush {
    /// Publish the entry and invalidate P on every CPU: once this returns,
    /// no CPU translates P with what the entry held before.
    AllCpus,
    /// Publish the entry and invalidate P on the calling CPU only: a
    /// negative control (a shootdown that reaches no other CPU).
    ThisCpuOnly,
    /// Publish the entry only. Enough when the old entry was invalid (no
    /// TLB caches an invalid entry); anything else is the negative control.
    PublishOnly,
}

/// What the scenarios need from the machine.
pub trait Platform: Sync {
    /// CPUs online; CPU 0 is the driver, `1..cpu_count()` the observers.
    fn cpu_count(&self) -> usize;
    /// The index of the CPU running the caller.
    fn this_cpu(&self) -> usize;
    /// Writes `value` into the first word of `frame` (not through P).
    fn fill_frame(&self, frame: Frame, value: u64);
    /// Writes P's page-table entry: mapped to `frame`, or not present.
    /// Does no TLB maintenance.
    fn set_test_pte(&self, frame: Option<Frame>);
    /// Makes the last [`Platform::set_test_pte`] visible, as `flush` says.
    fn sync_test_page(&self, flush: Flush);
    /// Reads P's first word; `None` if the read faulted.
    fn read_test_page(&self) -> Option<u64>;
    /// Microseconds since some fixed point, for the driver's time limits.
    fn now_us(&self) -> u64;
}

/// What the driver does to P after the observers are warm.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Change {
    Unmap,
    Remap,
}

/// The result of one scenario.
pub struct Outcome {
    pub name: &'static str,
    pub change: Change,
    pub flush: Flush,
    pub rounds: u32,
    pub observers: u32,
    /// Reads after the signal that saw the new state (a fault for unmap,
    /// B's pattern for remap).
    pub fresh: u32,
    /// Reads after the signal that returned A's pattern of the round.
    pub stale: u32,
    /// Reads that returned anything else (a fault after a remap, another
    /// round's pattern).
    pub wrong: u32,
    /// Waits on an observer that ran out of time.
    pub timeouts: u32,
    pub elapsed_us: u64,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.observers > 0
            && self.fresh == self.rounds * self.observers
            && self.stale == 0
            && self.wrong == 0
            && self.timeouts == 0
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "scenario {}: {} ({} rounds x {} observing CPUs, flush {}: {} {}, stale: {} reads of the old frame, \
             {} other, {} timeouts, {} ms)",
            self.name,
            if self.passed() { "PASS" } else { "FAIL" },
            self.rounds,
            self.observers,
            match self.flush {
                Flush::AllCpus => "on every CPU",
                Flush::ThisCpuOnly => "on CPU 0 only (negative control)",
                Flush::PublishOnly => "SKIPPED (negative control)",
            },
            self.fresh,
            match self.change {
                Change::Unmap => "faulted as they must",
                Change::Remap => "read the new frame",
            },
            self.stale,
            self.wrong,
            self.timeouts,
            self.elapsed_us / 1000,
        )
    }
}

/// The round observers are asked to warm up for (0: none yet).
static WARM: AtomicU64 = AtomicU64::new(0);
/// The round whose change is done and visible.
static SIGNAL: AtomicU64 = AtomicU64::new(0);
/// The round the driver gave up on: observers stop waiting for it.
static ABANDONED: AtomicU64 = AtomicU64::new(0);
static READY: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static DONE: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static SEEN: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static LAST_ROUND: AtomicU64 = AtomicU64::new(0);

/// What an observer read, packed in one word: a fault is a value no
/// pattern takes.
const FAULTED: u64 = u64::MAX;

fn pattern(frame: Frame, round: u64) -> u64 {
    match frame {
        Frame::A => 0xa0a0_0000_0000_0000 | round,
        Frame::B => 0xb0b0_0000_0000_0000 | round,
    }
}

/// Runs the observer side forever: every CPU but the driver calls this
/// once it is up.
pub fn observe(p: &impl Platform) -> ! {
    let me = p.this_cpu();
    let mut last = 0;
    loop {
        let round = WARM.load(Ordering::Acquire);
        if round == last || me >= MAX_CPUS {
            core::hint::spin_loop();
            continue;
        }
        last = round;
        observe_round(p, me, round);
    }
}

fn observe_round(p: &impl Platform, me: usize, round: u64) {
    let abandoned = || ABANDONED.load(Ordering::Relaxed) == round;
    let want = pattern(Frame::A, round);
    let mut streak = 0;
    while streak < WARM_READS {
        if abandoned() {
            return;
        }
        streak = if p.read_test_page() == Some(want) {
            streak + 1
        } else {
            0
        };
    }
    READY[me].store(round, Ordering::Release);
    // Keep P's translation in use until the signal.
    while SIGNAL.load(Ordering::Acquire) != round {
        if abandoned() {
            return;
        }
        let _ = p.read_test_page();
    }
    let seen = p.read_test_page().unwrap_or(FAULTED);
    SEEN[me].store(seen, Ordering::Relaxed);
    DONE[me].store(round, Ordering::Release);
}

/// Waits until every observer's `slot` holds `round`; false on timeout.
fn wait_all(p: &impl Platform, slots: &[AtomicU64; MAX_CPUS], round: u64) -> bool {
    let start = p.now_us();
    for slot in slots.iter().take(p.cpu_count()).skip(1) {
        while slot.load(Ordering::Acquire) != round {
            if p.now_us() - start > WAIT_LIMIT_US {
                return false;
            }
            core::hint::spin_loop();
        }
    }
    true
}

/// Runs `rounds` rounds of `change` with `flush` as the flush under test.
/// Call on CPU 0 while the others run [`observe`].
pub fn run(p: &impl Platform, name: &'static str, change: Change, flush: Flush, rounds: u32) -> Outcome {
    let observers = p.cpu_count().clamp(1, MAX_CPUS) as u32 - 1;
    let mut out = Outcome {
        name,
        change,
        flush,
        rounds,
        observers,
        fresh: 0,
        stale: 0,
        wrong: 0,
        timeouts: 0,
        elapsed_us: 0,
    };
    let start = p.now_us();
    for _ in 0..rounds {
        let round = LAST_ROUND.fetch_add(1, Ordering::Relaxed) + 1;
        p.fill_frame(Frame::A, pattern(Frame::A, round));
        p.fill_frame(Frame::B, pattern(Frame::B, round));
        p.set_test_pte(Some(Frame::A));
        // Whatever P mapped before (B, or nothing) is gone everywhere.
        p.sync_test_page(Flush::AllCpus);
        WARM.store(round, Ordering::Release);
        if !wait_all(p, &READY, round) {
            out.timeouts += 1;
            ABANDONED.store(round, Ordering::Relaxed);
            continue;
        }
        p.set_test_pte(None);
        p.sync_test_page(flush);
        if change == Change::Remap {
            p.set_test_pte(Some(Frame::B));
            p.sync_test_page(Flush::PublishOnly);
        }
        SIGNAL.store(round, Ordering::Release);
        if !wait_all(p, &DONE, round) {
            out.timeouts += 1;
            ABANDONED.store(round, Ordering::Relaxed);
            continue;
        }
        let expected = match change {
            Change::Unmap => FAULTED,
            Change::Remap => pattern(Frame::B, round),
        };
        for seen in SEEN.iter().take(observers as usize + 1).skip(1) {
            match seen.load(Ordering::Relaxed) {
                v if v == expected => out.fresh += 1,
                v if v == pattern(Frame::A, round) => out.stale += 1,
                _ => out.wrong += 1,
            }
        }
    }
    out.elapsed_us = p.now_us() - start;
    out
}
