//! The shootdown scenarios, written against [`Platform`] only: nothing here
//! knows how the machine booted, which architecture it is, or how a TLB is
//! invalidated. Both bare-metal test kernels run this set, each through
//! its own `Platform`: the aarch64 one (`qemu-test-aarch64/`) and the
//! x86_64 one (`qemu-test/`).
//!
//! A scenario uses the first `pages` test pages P0, P1, ... of one
//! non-global (ASID-tagged) address space; each can map its frame A or its
//! frame B. A round:
//!
//! 1. the driver (CPU 0) writes a fresh pattern into every A and B, maps
//!    each page to its A, flushes the pages on every CPU, and starts the
//!    round;
//! 2. every other CPU (an observer) reads the pages until it has seen every
//!    A pattern [`WARM_READS`] sweeps in a row, says so, and keeps reading
//!    them in a tight loop, so that its TLB holds each P -> A;
//! 3. the driver changes the pages (below) and makes the change visible
//!    with the flush under test, then raises the round's signal;
//! 4. each observer, once it sees the signal, reads every page once more
//!    and reports what it read.
//!
//! The changes: *unmap* clears one page's entry and flushes it, and the
//! observers must then fault; *remap* clears it, flushes, and maps it to B
//! (break-before-make, as the architecture asks before a live entry's
//! output address changes), and the observers must then read B's pattern;
//! *batched unmap* has the platform unmap every page's frame into one
//! batch and flush that once, and the observers must fault on every page.
//! Reading A's pattern after the signal is a stale translation: a flush
//! that did not reach that CPU. The negative controls weaken the flush
//! under test (skip its invalidations, or make them reach the driver's CPU
//! only; the page-table stores are still published) and must see exactly
//! that.
//!
//! *Reclaim flow* (CPUs with a hardware access flag only): once the
//! observers are warm the driver asks them to stop reading, ages every
//! page (the crate's `page_referenced` clears each access flag and records
//! a flush, which the driver makes with the flush under test; where the
//! crate records none, as on x86, on which a missed re-set only makes a
//! page look older, the platform flushes the aged pages itself with the
//! flush under test, so that the next step is deterministic), then lets
//! the observers read the even ("hot") pages once, which sets their access
//! flags again through the hardware. A second `page_referenced` pass must
//! find exactly the hot pages young; they are kept, and the odd ("cold")
//! ones are unmapped with `try_to_unmap` into the same batch, written out
//! after `flush_dirty` and freed after `flush`: the driver then poisons
//! each freed frame, as its next owner would overwrite it. After the
//! signal the observers must read A's pattern on the pages the pass kept
//! and fault on the ones it reclaimed (the cold ones, when the flushes
//! work; a missing flush can hide a hot page's read from its access flag,
//! and then the pass, counted as off, reclaims it too); reading A's
//! pattern or the poison on a reclaimed page is a stale read.
//!
//! *mprotect with a pending batch*: while the observers read every page
//! and also write the second half, the driver unmaps the frames of the
//! first half with `try_to_unmap` into a batch that it does not flush yet
//! (a reclaimer's deferred flush), then makes the whole range read-only
//! with `change_protection`, which must flush that batch first (contract
//! rule 5). After the signal the observers must fault reading each page
//! of the first half and fault writing each page of the second (a
//! permission fault, which the exception handler turns into a skipped
//! write); a read of A's pattern or a write that went through is a stale
//! translation.
//!
//! Every scenario also checks the flush interrupts against what the
//! platform says its shootdowns are ([`Platform::broadcast_shootdowns`]):
//! where a shootdown is a broadcast invalidation (aarch64's `TLBI ... IS`)
//! none may be sent or asked for; where it is made with IPIs (x86_64) each
//! shootdown must have sent exactly one to every observer, and every one
//! sent must have been taken.

#![cfg_attr(not(test), no_std)]

use core::sync::atomic::{AtomicU64, Ordering};

mod outcome;
pub use outcome::{BatchNote, Change, Ipis, MprotectNote, Outcome, ReclaimNote};

/// CPUs the scenarios can coordinate (CPU 0 drives, the others observe).
pub const MAX_CPUS: usize = 16;
/// Test pages a scenario can use.
pub const MAX_PAGES: usize = 64;
/// Consecutive sweeps over the pages that read every A pattern, which an
/// observer makes before it reports itself warm: its TLB then holds every
/// P -> A.
pub const WARM_READS: u32 = 64;
/// How long the driver waits for the observers at each step.
const WAIT_LIMIT_US: u64 = 10_000_000;

/// A frame a test page can map.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Frame {
    A,
    B,
}

/// How the driver makes its change of the entries visible.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Flush {
    /// Publish the entries and invalidate them on every CPU: once this
    /// returns, no CPU translates a page with what its entry held before.
    AllCpus,
    /// The same shootdown, with its invalidations made on the calling CPU
    /// only: a negative control (a shootdown that reaches no other CPU).
    ThisCpuOnly,
    /// The same shootdown, with its invalidations skipped: a negative
    /// control (the page-table stores are still published).
    Skipped,
}

/// What the scenarios need from the machine.
pub trait Platform: Sync {
    /// CPUs online; CPU 0 is the driver, `1..cpu_count()` the observers.
    fn cpu_count(&self) -> usize;
    /// The index of the CPU running the caller.
    fn this_cpu(&self) -> usize;
    /// Writes `value` into the first word of `page`'s `frame` (not through
    /// the page).
    fn fill_frame(&self, page: usize, frame: Frame, value: u64);
    /// Writes `page`'s page-table entry: mapped to its `frame`, or not
    /// present. Does no TLB maintenance.
    fn set_pte(&self, page: usize, frame: Option<Frame>);
    /// Publishes the entries written so far to every CPU's table walks,
    /// without invalidating anything: enough when every changed entry was
    /// invalid before (no TLB caches an invalid entry).
    fn publish(&self);
    /// Invalidates pages `0..pages` on every CPU (the round's setup).
    fn flush_pages(&self, pages: usize);
    /// Makes `page`'s last [`Platform::set_pte`] visible, as `flush` says.
    fn flush_page(&self, page: usize, flush: Flush);
    /// Unmaps the frames A of pages `0..pages`, each found through the
    /// platform's reverse map, into one batch, and flushes that once, as
    /// `flush` says.
    fn unmap_batched(&self, pages: usize, flush: Flush) -> BatchNote;
    /// The page count above which a batch becomes a whole-address-space
    /// flush.
    fn full_flush_ceiling(&self) -> usize;
    /// Whether a batch invalidates each page as it is added, on hardware
    /// that broadcasts (the crate's `BATCH_BROADCAST_ON_ADD`): a batched
    /// unmap then makes exactly one page invalidation per page and no
    /// whole-address-space one, past the ceiling too.
    fn invalidates_on_add(&self) -> bool {
        false
    }
    /// Whether the hardware sets access flags (on aarch64: TCR_EL1.HA is
    /// on; x86_64 always sets its accessed bits).
    fn hw_access_flag(&self) -> bool {
        false
    }
    /// Why [`Platform::hw_access_flag`] is false, for the reclaim flow's
    /// "skipped" line.
    fn no_access_flag_why(&self) -> &'static str {
        "no hardware access flag"
    }
    /// Printed before every scenario name in this platform's lines (for
    /// a kernel that runs other scenarios of similar names too).
    fn label(&self) -> &'static str {
        ""
    }
    /// Ages pages `0..pages` (clears each access flag through the crate,
    /// into one batch) and flushes what that recorded, as `flush` says;
    /// where the crate records no flush for a cleared flag (x86), the
    /// platform flushes the aged pages itself, in one shootdown. Returns
    /// the pages found young and the shootdowns made.
    fn age_pages(&self, _pages: usize, _flush: Flush) -> (u64, u64) {
        (0, 0)
    }
    /// Ages pages `0..pages` again, keeps the young ones and reclaims the
    /// others into one batch: `flush_dirty` before their write-out, `flush`
    /// before returning (the frames are then free), as `flush` says.
    fn reclaim_pages(&self, _pages: usize, _flush: Flush) -> ReclaimNote {
        ReclaimNote::default()
    }
    /// Unmaps the frames A of pages `0..unmapped` into a batch it does not
    /// flush, makes pages `0..pages` read-only with the crate's
    /// `change_protection`, then flushes the batch, as `flush` says.
    fn mprotect_pending(&self, _unmapped: usize, _pages: usize, _flush: Flush) -> MprotectNote {
        MprotectNote::default()
    }
    /// Writes `value` to `page`'s second word; false if the write faulted.
    fn write_page(&self, _page: usize, _value: u64) -> bool {
        false
    }
    /// Reads `page`'s first word; `None` if the read faulted.
    fn read_page(&self, page: usize) -> Option<u64>;
    /// Whether a shootdown reaches the other CPUs by a broadcast
    /// invalidation, so that no flush interrupt may be sent (true), or by
    /// flush IPIs, one to each other CPU that may cache the pages (false).
    fn broadcast_shootdowns(&self) -> bool;
    /// Flush interrupts and shootdowns so far (counters since boot).
    fn ipis(&self) -> Ipis;
    /// Called in every wait loop: serves what the platform must serve
    /// while a CPU spins.
    fn poll(&self) {}
    /// Microseconds since some fixed point, for the driver's time limits.
    fn now_us(&self) -> u64;
}

/// The round observers are asked to warm up for (0: none yet).
static WARM: AtomicU64 = AtomicU64::new(0);
/// How many pages the current round uses.
static PAGES: AtomicU64 = AtomicU64::new(1);
/// The round whose change is done and visible.
static SIGNAL: AtomicU64 = AtomicU64::new(0);
/// The round the driver gave up on: observers stop waiting for it.
static ABANDONED: AtomicU64 = AtomicU64::new(0);
static READY: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static DONE: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// What each observer read after the signal, page by page.
static SEEN: [[AtomicU64; MAX_PAGES]; MAX_CPUS] =
    [const { [const { AtomicU64::new(0) }; MAX_PAGES] }; MAX_CPUS];
static LAST_ROUND: AtomicU64 = AtomicU64::new(0);
/// Reclaim flow: the round whose observers must stop reading the pages.
static QUIET: AtomicU64 = AtomicU64::new(0);
static QUIET_ACK: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Reclaim flow: the round whose pages are aged; observers touch the hot
/// ones once.
static AGED: AtomicU64 = AtomicU64::new(0);
static TOUCHED: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Whether the current scenario is the mprotect one: its observers also
/// write the second half of the pages.
static MPROTECT: AtomicU64 = AtomicU64::new(0);
/// What an observer records for a write that went through.
const WROTE: u64 = 0x5757_5757_5757_5757;

/// What an observer read, packed in one word: a fault is a value no
/// pattern takes.
const FAULTED: u64 = u64::MAX;

fn pattern(frame: Frame, page: usize, round: u64) -> u64 {
    let tag = match frame {
        Frame::A => 0xa0a0_0000_0000_0000,
        Frame::B => 0xb0b0_0000_0000_0000,
    };
    tag | (page as u64) << 32 | round
}

/// What the driver writes into a frame it reclaimed, once it is free.
fn poison(page: usize, round: u64) -> u64 {
    0xdead_0000_0000_0000 | (page as u64) << 32 | round
}

/// Whether page `i` is one the reclaim flow's observers touch after aging.
fn hot(i: usize) -> bool {
    i & 1 == 0
}

/// The reclaim flow's hot pages among `0..pages`, as a bit mask.
fn hot_mask(pages: usize) -> u64 {
    (0..pages).filter(|&i| hot(i)).fold(0, |m, i| m | 1 << i)
}

fn all_mask(pages: usize) -> u64 {
    if pages >= 64 {
        u64::MAX
    } else {
        (1 << pages) - 1
    }
}

/// Runs the observer side forever: every CPU but the driver calls this
/// once it is up.
pub fn observe(p: &impl Platform) -> ! {
    loop {
        observe_while(p, || true);
    }
}

/// The last round each CPU observed (or began to).
static OBSERVED: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];

/// Runs the observer side until `go_on` answers false, which it asks
/// between rounds only: for a CPU that has other work between the driver's
/// scenarios. A CPU that comes back joins the rounds started since, never
/// one it already observed.
pub fn observe_while(p: &impl Platform, go_on: impl Fn() -> bool) {
    let me = p.this_cpu();
    let Some(observed) = OBSERVED.get(me) else {
        // More CPUs than the scenarios coordinate: this one sits out.
        while go_on() {
            p.poll();
            core::hint::spin_loop();
        }
        return;
    };
    while go_on() {
        p.poll();
        let round = WARM.load(Ordering::Acquire);
        if round == observed.load(Ordering::Relaxed) {
            core::hint::spin_loop();
            continue;
        }
        observed.store(round, Ordering::Relaxed);
        observe_round(p, me, round);
    }
}

fn observe_round(p: &impl Platform, me: usize, round: u64) {
    let abandoned = || ABANDONED.load(Ordering::Relaxed) == round;
    let pages = (PAGES.load(Ordering::Relaxed) as usize).min(MAX_PAGES);
    let mut streak = 0;
    while streak < WARM_READS {
        p.poll();
        if abandoned() {
            return;
        }
        let warm = (0..pages).all(|i| p.read_page(i) == Some(pattern(Frame::A, i, round)));
        streak = if warm { streak + 1 } else { 0 };
    }
    READY[me].store(round, Ordering::Release);
    // Keep every page's translation in use until the signal (or until
    // the reclaim flow asks for quiet).
    while SIGNAL.load(Ordering::Acquire) != round && QUIET.load(Ordering::Acquire) != round {
        p.poll();
        if abandoned() {
            return;
        }
        for i in 0..pages {
            let _ = p.read_page(i);
        }
        if MPROTECT.load(Ordering::Relaxed) != 0 {
            for i in pages / 2..pages {
                let _ = p.write_page(i, round);
            }
        }
    }
    if QUIET.load(Ordering::Acquire) == round {
        // Reading nothing keeps the translations cached (no TLBI, no
        // walk, so no access flag set) while the driver ages the pages.
        QUIET_ACK[me].store(round, Ordering::Release);
        let wait = |flag: &AtomicU64| {
            while flag.load(Ordering::Acquire) != round {
                p.poll();
                if abandoned() {
                    return false;
                }
                core::hint::spin_loop();
            }
            true
        };
        if !wait(&AGED) {
            return;
        }
        for i in (0..pages).filter(|&i| hot(i)) {
            let _ = p.read_page(i);
        }
        TOUCHED[me].store(round, Ordering::Release);
        if !wait(&SIGNAL) {
            return;
        }
    }
    let mprotect = MPROTECT.load(Ordering::Relaxed) != 0;
    for (i, seen) in SEEN[me].iter().enumerate().take(pages) {
        let v = if mprotect && i >= pages / 2 {
            if p.write_page(i, !round) {
                WROTE
            } else {
                FAULTED
            }
        } else {
            p.read_page(i).unwrap_or(FAULTED)
        };
        seen.store(v, Ordering::Relaxed);
    }
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
            p.poll();
            core::hint::spin_loop();
        }
    }
    true
}

/// Rounds of the single-page scenarios of [`run_set`].
pub const PAGE_ROUNDS: u32 = 50;
/// Rounds of the other scenarios of [`run_set`].
pub const BATCH_ROUNDS: u32 = 20;
/// Pages of the list, mprotect and reclaim scenarios of [`run_set`]: below
/// any full-flush ceiling a platform may have (the kernels assert it).
pub const LIST_PAGES: usize = 16;
/// How many scenarios [`run_set`] runs.
pub const SET: usize = 6;

/// The scenario set both kernels run, in order: unmap and remap of one
/// page, a batched list of [`LIST_PAGES`] pages, a batch of
/// `past_ceiling` pages (more than the platform's full-flush ceiling),
/// mprotect with a pending batch, and the reclaim flow, each with `flush`
/// as the flush under test. Call on CPU 0 while the others run
/// [`observe`].
pub fn run_set(p: &impl Platform, past_ceiling: usize, flush: Flush) -> [Outcome; SET] {
    [
        run(p, "unmap shootdown", Change::Unmap, 1, flush, PAGE_ROUNDS),
        run(p, "remap shootdown", Change::Remap, 1, flush, PAGE_ROUNDS),
        run(p, "a list", Change::BatchedUnmap, LIST_PAGES, flush, BATCH_ROUNDS),
        run(
            p,
            "past the ceiling",
            Change::BatchedUnmap,
            past_ceiling,
            flush,
            BATCH_ROUNDS,
        ),
        run(
            p,
            "mprotect with a pending batch",
            Change::Mprotect,
            LIST_PAGES,
            flush,
            BATCH_ROUNDS,
        ),
        run(
            p,
            "reclaim flow",
            Change::Reclaim,
            LIST_PAGES,
            flush,
            BATCH_ROUNDS,
        ),
    ]
}

/// Runs `rounds` rounds of `change` over `pages` pages (page 0 alone for
/// [`Change::Unmap`] and [`Change::Remap`]) with `flush` as the flush under
/// test. Call on CPU 0 while the others run [`observe`].
pub fn run(
    p: &impl Platform,
    name: &'static str,
    change: Change,
    pages: usize,
    flush: Flush,
    rounds: u32,
) -> Outcome {
    let pages = match change {
        Change::Unmap | Change::Remap => 1,
        Change::BatchedUnmap | Change::Reclaim => pages.clamp(1, MAX_PAGES),
        Change::Mprotect => pages.clamp(2, MAX_PAGES),
    };
    let observers = p.cpu_count().clamp(1, MAX_CPUS) as u32 - 1;
    let mut out = Outcome {
        label: p.label(),
        rounds,
        pages: pages as u32,
        observers,
        broadcast: p.broadcast_shootdowns(),
        ..Outcome::new(name, change, flush)
    };
    if change == Change::Reclaim && !p.hw_access_flag() {
        out.skipped = Some(p.no_access_flag_why());
        return out;
    }
    let before = p.ipis();
    let start = p.now_us();
    PAGES.store(pages as u64, Ordering::Relaxed);
    MPROTECT.store(u64::from(change == Change::Mprotect), Ordering::Relaxed);
    for _ in 0..rounds {
        let round = LAST_ROUND.fetch_add(1, Ordering::Relaxed) + 1;
        for i in 0..pages {
            p.fill_frame(i, Frame::A, pattern(Frame::A, i, round));
            p.fill_frame(i, Frame::B, pattern(Frame::B, i, round));
            p.set_pte(i, Some(Frame::A));
        }
        // Whatever the pages mapped before (B, or nothing) is gone
        // everywhere.
        p.flush_pages(pages);
        // The pages the reclaim flow unmaps this round (none elsewhere).
        let mut reclaimed = 0;
        WARM.store(round, Ordering::Release);
        if !wait_all(p, &READY, round) {
            out.timeouts += 1;
            ABANDONED.store(round, Ordering::Relaxed);
            continue;
        }
        match change {
            Change::Unmap | Change::Remap => {
                p.set_pte(0, None);
                p.flush_page(0, flush);
                if change == Change::Remap {
                    p.set_pte(0, Some(Frame::B));
                    p.publish();
                }
            }
            Change::BatchedUnmap => {
                let note = p.unmap_batched(pages, flush);
                out.full_flush = note.full_flush;
                let on_add = p.invalidates_on_add();
                out.invalidations = (note.page_invalidations, note.full_invalidations, on_add);
                let want_full = pages > p.full_flush_ceiling();
                if note.unmapped != pages as u32
                    || note.pending != pages as u32
                    || note.shootdowns != 1
                    || note.full_flush != want_full
                    || (on_add && (note.page_invalidations != pages as u64 || note.full_invalidations != 0))
                {
                    out.batch_mismatches += 1;
                }
            }
            Change::Mprotect => {
                let half = pages / 2;
                let note = p.mprotect_pending(half, pages, flush);
                if note.unmapped != half as u32
                    || !note.pending_before
                    || note.pending_after
                    || note.changed != (pages - half) as u32
                {
                    out.batch_mismatches += 1;
                }
            }
            Change::Reclaim => {
                QUIET.store(round, Ordering::Release);
                if !wait_all(p, &QUIET_ACK, round) {
                    out.timeouts += 1;
                    ABANDONED.store(round, Ordering::Relaxed);
                    continue;
                }
                let (young, aging_shootdowns) = p.age_pages(pages, flush);
                AGED.store(round, Ordering::Release);
                if !wait_all(p, &TOUCHED, round) {
                    out.timeouts += 1;
                    ABANDONED.store(round, Ordering::Relaxed);
                    continue;
                }
                let note = p.reclaim_pages(pages, flush);
                let cold = all_mask(pages) & !hot_mask(pages);
                if young != all_mask(pages)
                    || aging_shootdowns != 1
                    || note.young != hot_mask(pages)
                    || note.unmapped != cold
                    || note.written_early != 0
                    || note.shootdowns != 1
                {
                    out.batch_mismatches += 1;
                }
                // What an observer must see follows what the pass did: a
                // hot page that it reclaimed (because a stale translation
                // hid the observer's read from the access flag, as under a
                // negative control) must fault, and reading its poison is
                // a stale read, not another wrong value.
                reclaimed = note.unmapped;
                // The frames are free: their next owner overwrites them.
                for i in (0..pages).filter(|&i| reclaimed & 1 << i != 0) {
                    p.fill_frame(i, Frame::A, poison(i, round));
                }
            }
        }
        SIGNAL.store(round, Ordering::Release);
        if !wait_all(p, &DONE, round) {
            out.timeouts += 1;
            ABANDONED.store(round, Ordering::Relaxed);
            continue;
        }
        for seen in SEEN.iter().take(observers as usize + 1).skip(1) {
            for (i, word) in seen.iter().enumerate().take(pages) {
                let expected = match change {
                    Change::Unmap | Change::BatchedUnmap => FAULTED,
                    Change::Remap => pattern(Frame::B, i, round),
                    Change::Reclaim if reclaimed & 1 << i == 0 => pattern(Frame::A, i, round),
                    Change::Reclaim | Change::Mprotect => FAULTED,
                };
                match word.load(Ordering::Relaxed) {
                    v if v == expected => out.fresh += 1,
                    v if v == pattern(Frame::A, i, round) || v == poison(i, round) || v == WROTE => {
                        out.stale += 1
                    }
                    _ => out.wrong += 1,
                }
            }
        }
    }
    out.elapsed_us = p.now_us() - start;
    let after = p.ipis();
    out.ipis_sent = after.sent - before.sent;
    out.ipis_seen = after.seen - before.seen;
    out.shootdowns = after.shootdowns - before.shootdowns;
    out
}

#[cfg(test)]
mod tests;
