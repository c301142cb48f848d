//! What a scenario reports: the platform's counters, what its batched
//! unmap, mprotect and reclaim did, and the outcome of a run, printed as
//! the one line the test scripts check.

use core::fmt;

use crate::Flush;

/// What the platform's batched unmap did, for the scenario to check.
#[derive(Clone, Copy, Default, Debug)]
pub struct BatchNote {
    /// Frames the unmap reported unmapped with a writable TLB entry left
    /// for the flush (the test pages are writable).
    pub unmapped: u32,
    /// Pages the batch held when it was flushed.
    pub pending: u32,
    /// Whether the batch had become a whole-address-space flush.
    pub full_flush: bool,
    /// Shootdowns the unmap and the flush made together.
    pub shootdowns: u64,
    /// Single-page invalidations the crate counted for the unmap and the
    /// flush (on every CPU that made one).
    pub page_invalidations: u64,
    /// Whole-address-space (or whole-TLB) invalidations it counted.
    pub full_invalidations: u64,
}

/// The platform's counters of flush interrupts and shootdowns.
#[derive(Clone, Copy, Default, Debug)]
pub struct Ipis {
    /// Flush IPIs sent, as counted by the shootdown code.
    pub sent: u64,
    /// Flush IPIs as the platform saw them: calls of the hook that would
    /// send them (where shootdowns broadcast, which must see none), or
    /// interrupts taken by the observers (where shootdowns send IPIs).
    pub seen: u64,
    /// Shootdowns made, as counted by the shootdown code.
    pub shootdowns: u64,
}

/// What the driver does to the pages after the observers are warm.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Change {
    /// Page 0 unmapped and flushed.
    Unmap,
    /// Page 0 unmapped, flushed, and mapped to B.
    Remap,
    /// Every page unmapped into one batch, flushed once.
    BatchedUnmap,
    /// Every page aged, the even ones touched again, the odd ones
    /// reclaimed (unmapped, written out, freed and poisoned).
    Reclaim,
    /// The first half unmapped into a batch left pending, then every page
    /// made read-only.
    Mprotect,
}

/// What the platform's mprotect did, for the scenario to check.
#[derive(Clone, Copy, Default, Debug)]
pub struct MprotectNote {
    /// Frames the deferred unmap took away with a writable entry left.
    pub unmapped: u32,
    /// Whether the address space had a batched flush pending before the
    /// call, and after it.
    pub pending_before: bool,
    pub pending_after: bool,
    /// Entries `change_protection` changed.
    pub changed: u32,
}
/// What the platform's reclaim pass did, for the scenario to check.
#[derive(Clone, Copy, Default, Debug)]
pub struct ReclaimNote {
    /// Pages (bit i: page i) whose mapping `page_referenced` found young.
    pub young: u64,
    /// Pages unmapped with a writable TLB entry left for the batch.
    pub unmapped: u64,
    /// Pages written out before any shootdown of the pass had been made
    /// (before the dirty flush): must be none.
    pub written_early: u32,
    /// Shootdowns the pass made.
    pub shootdowns: u64,
}

/// The result of one scenario.
pub struct Outcome {
    /// Printed before the name ([`Platform::label`]).
    pub label: &'static str,
    pub name: &'static str,
    pub change: Change,
    pub flush: Flush,
    pub rounds: u32,
    pub pages: u32,
    pub observers: u32,
    /// Page reads after the signal that saw the new state (a fault for an
    /// unmap, B's pattern for remap).
    pub fresh: u32,
    /// Page reads after the signal that returned A's pattern of the round.
    pub stale: u32,
    /// Page reads that returned anything else (a fault after a remap,
    /// another round's pattern).
    pub wrong: u32,
    /// Waits on an observer that ran out of time.
    pub timeouts: u32,
    /// Rounds whose batch did not do what the scenario expects (a frame
    /// left mapped, pages missing, not one shootdown, the wrong kind of
    /// flush).
    pub batch_mismatches: u32,
    /// Whether the batches became whole-address-space flushes (batched
    /// unmaps only; the last round's).
    pub full_flush: bool,
    /// The last round's page and whole-address-space invalidation counts
    /// (batched unmaps only), and whether the pages were invalidated as
    /// they were added.
    pub invalidations: (u64, u64, bool),
    /// Whether the platform's shootdowns are broadcast invalidations (no
    /// IPI may be sent) or IPIs (one per shootdown and observer).
    pub broadcast: bool,
    /// Flush interrupts the shootdown code counted during the scenario.
    pub ipis_sent: u64,
    /// Flush interrupts the platform saw during the scenario (see
    /// [`Ipis::seen`]).
    pub ipis_seen: u64,
    /// Shootdowns made during the scenario.
    pub shootdowns: u64,
    pub elapsed_us: u64,
    /// The scenario did not run (the reclaim flow without a hardware
    /// access flag), and why.
    pub skipped: Option<&'static str>,
}

impl Outcome {
    /// The record of `name` before it runs: every count zero, no label,
    /// no IPIs expected; the scenario fills in its size.
    pub fn new(name: &'static str, change: Change, flush: Flush) -> Outcome {
        Outcome {
            label: "",
            name,
            change,
            flush,
            rounds: 0,
            pages: 0,
            observers: 0,
            fresh: 0,
            stale: 0,
            wrong: 0,
            timeouts: 0,
            batch_mismatches: 0,
            full_flush: false,
            invalidations: (0, 0, false),
            broadcast: false,
            ipis_sent: 0,
            ipis_seen: 0,
            shootdowns: 0,
            elapsed_us: 0,
            skipped: None,
        }
    }

    pub fn passed(&self) -> bool {
        if self.skipped.is_some() {
            return true;
        }
        self.observers > 0
            && self.fresh == self.rounds * self.observers * self.pages
            && self.stale == 0
            && self.wrong == 0
            && self.timeouts == 0
            && self.batch_mismatches == 0
            && self.ipis_as_expected()
    }

    /// Whether the flush interrupts match the platform's kind of
    /// shootdown: none at all for broadcast invalidations; otherwise at
    /// least one shootdown per round (the round's setup), each of which
    /// sent one IPI to every observer, and every IPI taken.
    pub fn ipis_as_expected(&self) -> bool {
        if self.broadcast {
            self.ipis_sent == 0 && self.ipis_seen == 0
        } else {
            self.shootdowns >= u64::from(self.rounds)
                && self.ipis_sent == self.shootdowns * u64::from(self.observers)
                && self.ipis_seen == self.ipis_sent
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(why) = self.skipped {
            return write!(f, "scenario {}{}: skipped: {}", self.label, self.name, why);
        }
        write!(
            f,
            "scenario {}{}: {} ({} rounds x {} observing CPUs x {} pages, flush {}: {} {}, stale: {} reads of \
             the old frame, {} other, {} timeouts, ",
            self.label,
            self.name,
            if self.passed() { "PASS" } else { "FAIL" },
            self.rounds,
            self.observers,
            self.pages,
            match self.flush {
                Flush::AllCpus => "on every CPU",
                Flush::ThisCpuOnly => "on CPU 0 only (negative control)",
                Flush::Skipped => "SKIPPED (negative control)",
            },
            self.fresh,
            match self.change {
                Change::Unmap | Change::BatchedUnmap => "faulted as they must",
                Change::Remap => "read the new frame",
                Change::Reclaim => "faulted on a reclaimed page or read a kept one",
                Change::Mprotect => "faulted (unmapped reads, read-only writes)",
            },
            self.stale,
            self.wrong,
            self.timeouts,
        )?;
        if self.change == Change::BatchedUnmap {
            write!(
                f,
                "1 batch flush per round of {}, {} page and {} whole-ASID invalidations{}, {} rounds off that, ",
                if self.full_flush {
                    "a whole-ASID request"
                } else {
                    "a page list"
                },
                self.invalidations.0,
                self.invalidations.1,
                if self.invalidations.2 {
                    " issued as the pages were added, one barrier"
                } else {
                    ""
                },
                self.batch_mismatches
            )?;
        }
        if self.change == Change::Reclaim {
            write!(
                f,
                "hot pages kept and cold ones reclaimed, written out after the dirty flush, with 1 shootdown per \
                 aging and per reclaim pass: {} rounds off that, ",
                self.batch_mismatches
            )?;
        }
        if self.change == Change::Mprotect {
            write!(
                f,
                "batch pending before change_protection and flushed by it, every page left made read-only: {} \
                 rounds off that, ",
                self.batch_mismatches
            )?;
        }
        if self.broadcast {
            write!(f, "IPIs sent: {}", self.ipis_sent)?;
            if self.ipis_seen > 0 {
                write!(f, ", IPI hook called {} times", self.ipis_seen)?;
            }
        } else {
            write!(
                f,
                "{} shootdowns, IPIs sent: {} (1 per shootdown and observer: {}), taken: {}",
                self.shootdowns,
                self.ipis_sent,
                self.shootdowns * u64::from(self.observers),
                self.ipis_seen
            )?;
        }
        write!(f, ", {} ms)", self.elapsed_us / 1000)
    }
}
