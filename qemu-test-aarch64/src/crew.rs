//! The other CPUs' side of the 2 MiB block split and teardown scenarios
//! (`block_split.rs`, `block_teardown.rs`): a mailbox per CPU that CPU 0
//! writes a command into, and the bookkeeping of a loop the secondaries
//! run while CPU 0 changes the block under them (a first pass made before
//! the change, then a number of passes begun after it).
//!
//! A secondary waits in the shared scenarios' observe loop, which calls
//! `Platform::poll`, which calls each scenario's `serve`; while a
//! [`Crew`]'s job is on, its `serve` keeps the CPU there and answers
//! commands. Every wait of a secondary here also serves flush-IPI
//! requests (`tlb::poll`), so that an `ipi_sync` of CPU 0 completes while
//! the secondaries run a loop of this module.

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::{tlb, MAX_CPUS};

/// How long CPU 0 waits for the secondaries at any step before it gives
/// the run up as broken (a stale read is counted, never waited for).
const WAIT_LIMIT_US: u64 = 20_000_000;

pub struct Crew {
    name: &'static str,
    /// While set, the secondaries serve [`Crew::cmd`] from their wait
    /// loops.
    job: AtomicBool,
    cmd: [AtomicU64; MAX_CPUS],
    res: [AtomicU64; MAX_CPUS],
    /// Ends the secondaries' loop.
    stop: AtomicBool,
    /// Per CPU: a whole pass made before the change; passes begun after it.
    warm: [AtomicBool; MAX_CPUS],
    passes: [AtomicU64; MAX_CPUS],
}

impl Crew {
    pub const fn new(name: &'static str) -> Self {
        Crew {
            name,
            job: AtomicBool::new(false),
            cmd: [const { AtomicU64::new(0) }; MAX_CPUS],
            res: [const { AtomicU64::new(0) }; MAX_CPUS],
            stop: AtomicBool::new(false),
            warm: [const { AtomicBool::new(false) }; MAX_CPUS],
            passes: [const { AtomicU64::new(0) }; MAX_CPUS],
        }
    }

    /// Keeps the secondaries in [`serve`](Self::serve) from now on, until
    /// [`dismiss`](Self::dismiss).
    pub fn summon(&self) {
        self.job.store(true, Ordering::Release);
    }

    pub fn dismiss(&self) {
        self.job.store(false, Ordering::Release);
    }

    /// The secondary side: while the job is on, runs each command it is
    /// given through `run` (this CPU, the command; its answer is stored for
    /// CPU 0).
    pub fn serve(&self, run: impl Fn(usize, u64) -> u64) {
        let me = crate::cpu_index();
        if me == 0 || me >= MAX_CPUS || !self.job.load(Ordering::Acquire) {
            return;
        }
        while self.job.load(Ordering::Acquire) {
            let cmd = self.cmd[me].load(Ordering::Acquire);
            if cmd == 0 {
                tlb::poll();
                core::hint::spin_loop();
                continue;
            }
            let result = run(me, cmd);
            self.res[me].store(result, Ordering::Relaxed);
            self.cmd[me].store(0, Ordering::Release);
        }
    }

    /// Whether a secondary's loop should end.
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// A secondary ends a pass of its loop: `after` when the pass began
    /// after CPU 0's change. Takes a pending flush-IPI request here, as an
    /// interrupt handler would between two passes.
    pub fn end_pass(&self, me: usize, after: bool) {
        if after {
            self.passes[me].fetch_add(1, Ordering::Release);
        } else {
            self.warm[me].store(true, Ordering::Release);
        }
        tlb::poll();
    }

    /// Waits until `done` holds, serving flush-IPI requests meanwhile.
    pub fn wait(&self, what: &str, done: impl Fn() -> bool) {
        let start = crate::now_us();
        while !done() {
            if crate::now_us() - start > WAIT_LIMIT_US {
                crate::say!("{}: timed out waiting for {what}\n", self.name);
                crate::fatal("a block scenario's secondaries did not answer");
            }
            tlb::poll();
            core::hint::spin_loop();
        }
    }

    /// Runs `cmd` once on secondary `cpu` and returns its answer.
    pub fn ask(&self, cpu: usize, cmd: u64) -> u64 {
        self.cmd[cpu].store(cmd, Ordering::Release);
        self.wait("a secondary's answer", || {
            self.cmd[cpu].load(Ordering::Acquire) == 0
        });
        self.res[cpu].load(Ordering::Relaxed)
    }

    /// Makes the secondaries `1..cpus` run the loop `cmd` until CPU 0's
    /// `change` has returned and each of them has begun `passes` passes
    /// after it (the loop decides which passes count as after).
    pub fn with_secondaries(&self, cpus: usize, cmd: u64, passes: u64, change: impl FnOnce()) {
        self.stop.store(false, Ordering::Release);
        for c in 1..cpus {
            self.warm[c].store(false, Ordering::Release);
            self.passes[c].store(0, Ordering::Release);
            self.cmd[c].store(cmd, Ordering::Release);
        }
        self.wait("the secondaries' first pass", || {
            (1..cpus).all(|c| self.warm[c].load(Ordering::Acquire))
        });
        change();
        self.wait("the secondaries' passes after the change", || {
            (1..cpus).all(|c| self.passes[c].load(Ordering::Acquire) >= passes)
        });
        self.stop.store(true, Ordering::Release);
        for c in 1..cpus {
            self.wait("the secondaries to stop", || {
                self.cmd[c].load(Ordering::Acquire) == 0
            });
        }
    }
}
