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

/// The six level 2 blocks the block scenarios use lie below the returned
/// address, the top of RAM rounded down to a block (A and B of
/// `block.rs`, S and M of `block_split.rs`, T and U of
/// `block_teardown.rs`, downwards in that order). Stops the kernel when
/// the lowest of them would reach into the kernel's image (2 MiB blocks
/// in 128 MiB, or 512 MiB blocks in 4 GiB, leave room to spare).
pub fn blocks_top(ram: (u64, u64)) -> u64 {
    extern "C" {
        /// The end of the kernel's image and its statics (`linker.ld`).
        static __image_end: u8;
    }
    let block = crate::mmu::block_bytes();
    let top = (ram.0 + ram.1) & !(block - 1);
    let image_end = core::ptr::addr_of!(__image_end) as u64;
    if top < ram.0 + 6 * block || top - 6 * block < image_end {
        crate::say!(
            "the block scenarios' six blocks of {} below {top:#x} reach into the kernel's image (it ends at \
             {image_end:#x}): give the machine more RAM\n",
            crate::mmu::block_name()
        );
        crate::fatal("no room for the block scenarios' blocks at the top of RAM");
    }
    top
}

/// Where the words a block scenario uses in piece `p` of its block (page
/// `p`) lie, from the block's start: at the start of the page with the
/// 4 KiB granule; with the 64 KiB granule 4 KiB x (p / 4 mod 16) into
/// it. Why: QEMU's TCG keeps a translation per 4 KiB of address whatever
/// the granule, in a direct-mapped TLB indexed by the address bits from
/// 12 up, which it may shrink to 64 entries (our reading of cputlb.c's
/// dynamic sizing, its minimum 2^6); 32 words at a 64 KiB stride share
/// 4 of those slots and evict each other. Measured with them so: the
/// measurements saw next to no stale piece and the split's controls
/// passed (docs/testing.md). Spread this way they take 32 slots of 64,
/// as 32 pieces of 4 KiB do, and every control fails.
pub fn piece_offset(p: u64) -> u64 {
    let page = crate::mmu::page_bytes();
    let quarters = page / 4096;
    p * page + (p / (64 / quarters)) % quarters * 4096
}

/// The pieces a block scenario writes when it fills or reuses a block:
/// the first 512, the whole block with the 4 KiB granule, the first
/// 32 MiB of the 512 MiB block with the 64 KiB one. No CPU reads past
/// the first 32 pieces; writing all 8192 pieces of a 512 MiB block took
/// about a second a fill under TCG on a loaded 2-core machine (measured:
/// the three block scenarios 12 s of a 17 s run on 4 Cortex-A72 CPUs).
pub const FILLED_PIECES: u64 = 512;
