//! Clean writes after an unmap, under hardware dirty-state management:
//! the evidence for the crate's aarch64 `CLEAN_WRITE_REWALK`.
//!
//! The crate defers the flush of an unmapped page to a batch because a
//! CPU cannot write through a cached entry of a *clean* page without the
//! descriptor in memory being consulted again: with TCR_EL1.HD = 1 a clean
//! writable page is mapped read-only (AP\[2\] = 1) with DBM set, and the
//! first write makes the hardware clear AP\[2\] in memory by an atomic
//! update against the descriptor it translated with; when that descriptor
//! is gone the update fails, the walk is repeated and faults. A *dirty*
//! page's entry allows writes outright, which is why the batch must be
//! flushed (`flush_dirty`) before such a page is written out.
//!
//! # The pages
//!
//! [`mmu::DIRTY_PAGES`] pages at the start of the test pages' leaf table
//! (4 KiB pages, or 64 KiB ones with the 64 KiB granule: the scenario runs
//! the same at both), non-global (tagged with the test ASID), access flag
//! set, mapped clean: read-only with DBM. `DirtySpace` (`dirty_space.rs`)
//! converts their descriptors for the crate: dirty exactly when the hardware lets writes through (AP\[2\] = 0),
//! writable when it does or when DBM is set (so a clean page that may
//! become dirty is reported writable, which is conservative).
//!
//! # A round
//!
//! 1. CPU 0 fills the frames and maps the pages clean. The observers (CPUs
//!    1 and up) read every page, write the even ones (the hardware marks
//!    them dirty: CPU 0 checks AP\[2\] in memory) and only read the odd
//!    ones, whose read-only entries stay cached.
//! 2. CPU 0 unmaps every frame with `try_to_unmap(.., BATCH_FLUSH, ..)`
//!    into one batch, through the crate's `Arch` with its invalidations
//!    issued at the batch's flush ([`tlb::FlushTimeTlbi`]: under TCG a
//!    `TLBI` issued on add would have dropped every entry before the
//!    observers could store, and the scenario would show nothing). With
//!    the batch unflushed (its pending count checked), each observer reads
//!    every page (a read that returns the round's data proves its entry is
//!    still cached) and stores once to each. Every store to a clean page
//!    must fault; a store to a dirty page may land, through its writable
//!    entry.
//! 3. CPU 0 calls `flush_dirty`, which must flush (dirty pages are in the
//!    batch), then "writes out" the frames: the clean ones must hold what
//!    they held (no store landed), the dirty ones the observers' first
//!    write or the store each observer says landed. The observers read and
//!    store once more: every access must fault, and the frames must still
//!    hold what was written out.
//! 4. CPU 0 calls `flush` (nothing is left), then frees the frames by
//!    poisoning them. The crate's dirty report of each page must match
//!    what the observers did, and no IPI may be sent.
//!
//! # What TCG shows
//!
//! QEMU emulates the dirty update: a write through a clean page's
//! descriptor clears AP\[2\] in memory by a compare-and-swap (the even
//! pages' first writes go through only so, and step 1 checks AP\[2\]).
//! Its software TLB keeps a clean page's entry read-only, and a store
//! through a read-only entry always walks the tables again, so the clean
//! stores after the unmap find the cleared descriptor by that walk. That
//! the hardware cannot store through its cached clean entry is what the
//! scenario shows; the way hardware gets there (the compare-and-swap
//! against the cached descriptor failing, then a walk that faults with a
//! translation fault, which the line requires) only hardware exercises.
//!
//! The negative control `negative-dirty` maps the odd pages writable
//! (AP\[2\] = 0: no clean state) and marks them with a software bit that
//! makes the conversion report them clean anyway: the stale entries then
//! allow the stores after the unmap, which land in the frames, and the
//! scenario must fail on "stores landed after unmap". Under `negative`
//! and `negative-local` the batch's flush goes through the weakened
//! `Arch`: the clean pages still fault (the re-walk needs no flush), but
//! the dirty pages' stores after `flush_dirty` land, and the scenario
//! fails on those.

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tlb_batch::arch::aarch64 as a64;
use tlb_batch::{flush_tlb_range, try_to_unmap, Arch, PageRange, TlbFlushUnmapBatch, TtuFlags};

use crate::dirty_space::{frame_of, DirtyRmap, CLAIMED_CLEAN, FRAMES, REPORTED_DIRTY};
use crate::mmu::{self, AP_READ_ONLY, DBM, DIRTY_PAGES, TEST_PAGE_FLAGS};
use crate::{boot, tlb, MAX_CPUS};

const NAME: &str = "clean writes after unmap";
/// Rounds of the scenario.
const ROUNDS: u64 = 20;
/// What a freed frame holds in every word.
const POISON: u64 = 0xdead_d177_dead_d177;
/// How long CPU 0 waits for the observers at each step.
const WAIT_LIMIT_US: u64 = 10_000_000;
/// The even pages: written by the observers, so dirty.
const EVEN: u64 = {
    let mut m = 0u64;
    let mut p = 0;
    while p < DIRTY_PAGES {
        m |= 1 << p;
        p += 2;
    }
    m
};
const ALL: u64 = (1 << DIRTY_PAGES) - 1;
/// The odd pages: only read, so clean.
const ODD: u64 = ALL & !EVEN;
const _: () = assert!(DIRTY_PAGES <= 64 && DIRTY_PAGES >= 2);

/// Steps of a round, as `round * 4 + step` in [`STEP`].
const WARM: u64 = 1;
const AFTER_UNMAP: u64 = 2;
const AFTER_FLUSH_DIRTY: u64 = 3;

/// Whether the observers serve the scenario.
static JOB: AtomicBool = AtomicBool::new(false);
/// The step the observers are asked to take: `round * 4 + step`.
static STEP: AtomicU64 = AtomicU64::new(0);
/// The step each observer took last.
static DONE: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per observer, over the scenario: reads or first writes of step 1 that
/// went wrong (a fault, or other data than the round's).
static WARM_BAD: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per observer, in the current round (a bit per page): reads after the
/// unmap that returned the round's data (the entry was still cached).
static CACHED: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per observer, in the current round: stores after the unmap that did
/// not fault.
static LANDED: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per observer, in the current round: reads after `flush_dirty` that did
/// not fault.
static LATE_READ: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per observer, in the current round: stores after `flush_dirty` that did
/// not fault.
static LATE_LANDED: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Per observer, over the scenario: reads after the unmap that returned
/// anything but the round's data or a fault.
static OTHER: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];

/// The word an observer stores or finds: `kind` 0 before any store, 1 its
/// write in step 1, 2 its store after the unmap, 3 after `flush_dirty`.
fn value(kind: u64, round: u64, page: usize, cpu: usize) -> u64 {
    0xd1e7_0000_0000_0000 | kind << 44 | (cpu as u64) << 36 | (page as u64) << 24 | round
}

/// Word 0 of page `page` in `round`.
fn pattern(round: u64, page: usize) -> u64 {
    value(0xf, round, page, 0)
}

/// Step 1 on an observer: reads every page, writes the even ones.
fn warm(me: usize, round: u64) {
    let mut bad = 0;
    for p in 0..DIRTY_PAGES {
        let va = mmu::dirty_va(p);
        if boot::probe(va) != Some(pattern(round, p)) {
            bad += 1;
        }
        if EVEN & 1 << p != 0 && !boot::probe_store_word(va + 8 * me as u64, value(1, round, p, me)) {
            bad += 1;
        }
    }
    // The odd pages once more, after the writes: their read-only entries
    // are the last ones filled.
    for p in (1..DIRTY_PAGES).step_by(2) {
        if boot::probe(mmu::dirty_va(p)) != Some(pattern(round, p)) {
            bad += 1;
        }
    }
    WARM_BAD[me].fetch_add(bad, Ordering::Relaxed);
}

/// Steps 2 and 3 on an observer: one read and one store to every page;
/// returns the pages whose read hit and whose store did not fault.
fn attempt(me: usize, round: u64, kind: u64) -> (u64, u64) {
    let (mut read, mut stored) = (0u64, 0u64);
    for p in 0..DIRTY_PAGES {
        let va = mmu::dirty_va(p);
        match boot::probe(va) {
            None => {}
            Some(v) if v == pattern(round, p) => read |= 1 << p,
            Some(_) => {
                read |= 1 << p;
                OTHER[me].fetch_add(1, Ordering::Relaxed);
            }
        }
        if boot::probe_store_word(va + 8 * me as u64, value(kind, round, p, me)) {
            stored |= 1 << p;
        }
    }
    (read, stored)
}

/// The observers' side, called from every wait loop of every CPU
/// (`Platform::poll` in main.rs): on CPUs 1 and up, while CPU 0 runs the
/// scenario, takes each step it asks for, once.
pub fn serve() {
    let me = crate::cpu_index();
    if me == 0 || me >= MAX_CPUS || !JOB.load(Ordering::Acquire) {
        return;
    }
    while JOB.load(Ordering::Acquire) {
        tlb::poll();
        let step = STEP.load(Ordering::Acquire);
        if step == 0 || DONE[me].load(Ordering::Relaxed) == step {
            core::hint::spin_loop();
            continue;
        }
        let round = step / 4;
        match step % 4 {
            WARM => warm(me, round),
            AFTER_UNMAP => {
                let (read, stored) = attempt(me, round, 2);
                CACHED[me].store(read, Ordering::Relaxed);
                LANDED[me].store(stored, Ordering::Relaxed);
            }
            AFTER_FLUSH_DIRTY => {
                let (read, stored) = attempt(me, round, 3);
                LATE_READ[me].store(read, Ordering::Relaxed);
                LATE_LANDED[me].store(stored, Ordering::Relaxed);
            }
            _ => {}
        }
        DONE[me].store(step, Ordering::Release);
    }
}

/// Asks the observers `1..cpus` for `step` and waits until each took it;
/// false after [`WAIT_LIMIT_US`].
fn ask(step: u64, cpus: usize) -> bool {
    STEP.store(step, Ordering::Release);
    let start = crate::now_us();
    while (1..cpus).any(|c| DONE[c].load(Ordering::Acquire) != step) {
        if crate::now_us() - start > WAIT_LIMIT_US {
            return false;
        }
        tlb::poll();
        core::hint::spin_loop();
    }
    true
}

/// Fills the frames for `round` and maps every page clean (the odd ones
/// writable under the negative control), then drops whatever an earlier
/// round left in any TLB.
fn map_round(round: u64, claim_clean: bool) {
    for (p, f) in FRAMES.iter().enumerate() {
        f.0[0].store(pattern(round, p), Ordering::Relaxed);
        for c in 1..MAX_CPUS {
            f.0[c].store(value(0, round, p, c), Ordering::Relaxed);
        }
    }
    for (p, f) in FRAMES.iter().enumerate() {
        let pa = f.0.as_ptr() as u64;
        let mut desc = pa | TEST_PAGE_FLAGS | DBM | AP_READ_ONLY;
        if claim_clean && ODD & 1 << p != 0 {
            desc = (desc & !AP_READ_ONLY) | CLAIMED_CLEAN;
        }
        mmu::dirty_pte(p).store(desc, Ordering::Release);
    }
    a64::dsb_ishst();
    a64::isb();
    // PageRange counts 4 KiB units: a 64 KiB page is 16 of them.
    let range = PageRange::new(mmu::dirty_va(0), DIRTY_PAGES as u64 * mmu::page_units());
    if !range.is_ok_and(|r| flush_tlb_range(tlb::arch(), tlb::mm(), r).is_ok()) {
        crate::fatal("clean writes: flush_tlb_range refused the pages");
    }
}

/// Runs the scenario with the flush the kernel command line asks for,
/// prints its line and returns whether it passed (true when skipped).
pub fn run(bootargs: &[u8]) -> bool {
    let features = mmu::MmuFeatures::read();
    if !features.hw_dirty_state() {
        crate::say!(
            "scenario {NAME}: skipped: no hardware dirty state (ID_AA64MMFR1_EL1.HAFDBS = {})\n",
            features.hafdbs
        );
        return true;
    }
    let a = *tlb::arch();
    let claim_clean = crate::has_word(bootargs, b"negative-dirty");
    if crate::has_word(bootargs, b"negative") {
        scenario(&tlb::SkipTlbi(a), "SKIPPED (negative control)", claim_clean)
    } else if crate::has_word(bootargs, b"negative-local") {
        scenario(
            &tlb::LocalTlbi(a),
            "on CPU 0 only (negative control)",
            claim_clean,
        )
    } else {
        scenario(
            &tlb::FlushTimeTlbi(a),
            "TLBI VAE1IS at the batch's flush",
            claim_clean,
        )
    }
}

/// What a run counted.
#[derive(Default)]
struct Tally {
    unmapped: u64,
    warm_bad: u64,
    /// Descriptors whose AP\[2\] the hardware did not leave as the
    /// observers' accesses require (cleared on the written pages, set on
    /// the read ones).
    hw_state_wrong: u64,
    /// Pages whose dirty report from the crate differs from what was done
    /// to them.
    report_wrong: u64,
    /// Rounds in which the batch was not pending, or had been flushed,
    /// when the observers stored after the unmap.
    not_pending: u64,
    /// Permission faults of the stores after the unmap: a store refused
    /// by the cached read-only entry itself, not by a walk that found the
    /// descriptor gone (a translation fault), which is what HD must give.
    /// Only hardware can show one: QEMU's TCG walks the tables again on
    /// every store through a read-only entry of its software TLB, HD or
    /// not.
    permission_faults: u64,
    clean_attempts: u64,
    clean_landed: u64,
    clean_cached: u64,
    dirty_attempts: u64,
    dirty_landed: u64,
    /// Words of the frames that differed at the write-out from what the
    /// observers' stores leave there by their own account (a store that
    /// landed unreported, or reported and lost).
    wrong_at_writeout: u64,
    /// Words of clean frames that changed between the unmap and the
    /// write-out.
    clean_in_frames: u64,
    dirty_flushes: u64,
    late_read: u64,
    late_landed: u64,
    /// Words that changed after the write-out.
    late_in_frames: u64,
    errors: u64,
    timeouts: u64,
}

fn scenario<A: Arch>(arch: &A, flush: &str, claim_clean: bool) -> bool {
    let cpus = crate::ONLINE.load(Ordering::Acquire).min(MAX_CPUS);
    let mut t = Tally::default();
    let (ipis_before, hooks_before) = tlb::ipis();
    let start = crate::now_us();
    STEP.store(0, Ordering::SeqCst);
    JOB.store(true, Ordering::SeqCst);
    for round in 1..=ROUNDS {
        map_round(round, claim_clean);
        if !ask(round * 4 + WARM, cpus) {
            t.timeouts += 1;
        }
        for p in 0..DIRTY_PAGES {
            let desc = mmu::dirty_pte(p).load(Ordering::Acquire);
            let written = EVEN & 1 << p != 0 || claim_clean;
            if (desc & AP_READ_ONLY == 0) != written || desc & DBM == 0 {
                t.hw_state_wrong += 1;
            }
        }
        // The unmap, every flush deferred to one batch. The descriptors
        // are written with their access flag set, so without
        // IGNORE_ACCESS the walk would only clear it and answer Fail.
        REPORTED_DIRTY.store(0, Ordering::Relaxed);
        let before = tlb::TLB.stats();
        let mut batch = TlbFlushUnmapBatch::new();
        for p in 0..DIRTY_PAGES {
            let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
            match try_to_unmap(arch, &DirtyRmap, frame_of(p), flags, &mut batch) {
                Ok(r) if r.is_unmapped() => t.unmapped += 1,
                Ok(_) => {}
                Err(_) => t.errors += 1,
            }
        }
        t.report_wrong += u64::from((REPORTED_DIRTY.load(Ordering::Relaxed) ^ EVEN).count_ones());
        // The stores through the stale entries, before any flush. Only
        // the observers run meanwhile, so the permission faults counted
        // are theirs.
        let permission_faults = boot::PERMISSION_FAULTS.load(Ordering::SeqCst);
        if !ask(round * 4 + AFTER_UNMAP, cpus) {
            t.timeouts += 1;
        }
        t.permission_faults += boot::PERMISSION_FAULTS.load(Ordering::SeqCst) - permission_faults;
        if batch.pending_pages() != DIRTY_PAGES || tlb::TLB.stats().since(&before).batches_flushed != 0 {
            t.not_pending += 1;
        }
        match batch.flush_dirty(arch) {
            Ok(Some(_)) => t.dirty_flushes += 1,
            Ok(None) => {}
            Err(_) => t.errors += 1,
        }
        // The write-out: what each observer's word holds now.
        let mut written_out = [[0u64; MAX_CPUS]; DIRTY_PAGES];
        for (p, out) in written_out.iter_mut().enumerate() {
            for (c, word) in out.iter_mut().enumerate().take(cpus).skip(1) {
                *word = FRAMES[p].0[c].load(Ordering::Acquire);
                let landed = LANDED[c].load(Ordering::Relaxed) & 1 << p != 0;
                let expect = match (EVEN & 1 << p != 0, landed) {
                    (_, true) => value(2, round, p, c),
                    (true, false) => value(1, round, p, c),
                    (false, false) => value(0, round, p, c),
                };
                if *word != expect {
                    t.wrong_at_writeout += 1;
                }
                // A clean frame must hold what it held before the unmap.
                if ODD & 1 << p != 0 && *word != value(0, round, p, c) {
                    t.clean_in_frames += 1;
                }
            }
        }
        for c in 1..cpus {
            let (cached, landed) = (
                CACHED[c].load(Ordering::Relaxed),
                LANDED[c].load(Ordering::Relaxed),
            );
            t.clean_attempts += u64::from(ODD.count_ones());
            t.dirty_attempts += u64::from(EVEN.count_ones());
            t.clean_landed += u64::from((landed & ODD).count_ones());
            t.dirty_landed += u64::from((landed & EVEN).count_ones());
            t.clean_cached += u64::from((cached & ODD).count_ones());
        }
        // After flush_dirty no access may get through.
        if !ask(round * 4 + AFTER_FLUSH_DIRTY, cpus) {
            t.timeouts += 1;
        }
        for c in 1..cpus {
            t.late_read += u64::from(LATE_READ[c].load(Ordering::Relaxed).count_ones());
            t.late_landed += u64::from(LATE_LANDED[c].load(Ordering::Relaxed).count_ones());
        }
        for (p, out) in written_out.iter().enumerate() {
            for (c, &word) in out.iter().enumerate().take(cpus).skip(1) {
                if FRAMES[p].0[c].load(Ordering::Acquire) != word {
                    t.late_in_frames += 1;
                }
            }
        }
        if batch.flush(arch).is_err() {
            t.errors += 1;
        }
        // Freed: poisoned (the part a page maps: 4 or 64 KiB).
        for f in &FRAMES {
            for w in f.0.iter().take((mmu::page_bytes() / 8) as usize) {
                w.store(POISON, Ordering::Relaxed);
            }
        }
    }
    JOB.store(false, Ordering::SeqCst);
    STEP.store(0, Ordering::SeqCst);
    let elapsed_ms = (crate::now_us() - start) / 1000;
    let (ipis_after, hooks_after) = tlb::ipis();
    let (ipis, hooks) = (ipis_after - ipis_before, hooks_after - hooks_before);
    let warm_bad: u64 = WARM_BAD.iter().map(|w| w.swap(0, Ordering::Relaxed)).sum();
    let other: u64 = OTHER.iter().map(|w| w.swap(0, Ordering::Relaxed)).sum();
    t.warm_bad = warm_bad;
    let observers = cpus - 1;
    let passed = observers > 0
        && t.errors == 0
        && t.timeouts == 0
        && t.unmapped == ROUNDS * DIRTY_PAGES as u64
        && t.warm_bad == 0
        && other == 0
        && t.hw_state_wrong == 0
        && t.report_wrong == 0
        && t.not_pending == 0
        && t.clean_landed == 0
        && t.permission_faults == 0
        && t.clean_in_frames == 0
        && t.wrong_at_writeout == 0
        && t.clean_cached > 0
        && t.dirty_flushes == ROUNDS
        && t.late_read == 0
        && t.late_landed == 0
        && t.late_in_frames == 0
        && ipis == 0
        && hooks == 0;
    crate::say!(
        "scenario {NAME}: {} ({ROUNDS} rounds x {DIRTY_PAGES} pages, TCR_EL1.HD on, mapped clean (read-only, DBM){}; \
         observing CPUs: {observers}; they wrote the even pages and read the odd ({} faults or wrong reads; AP[2] in memory not \
         as they left it: {}); try_to_unmap(BATCH_FLUSH) of all, flush {flush}: {} unmapped, dirty reports wrong: \
         {}; then, the batch pending ({} rounds not), each observer read each page (the stale entry still cached \
         in {} of {} reads of clean pages) and stored to it: {} of {} stores to clean pages faulted ({} of them \
         permission faults, not translation faults), stores landed after unmap: {} ({} words of clean frames changed at write-out); {} of {} stores to dirty pages landed \
         before flush_dirty; flush_dirty flushed in {} rounds; {} words at write-out not as the stores reported; \
         after flush_dirty: stores landed after flush_dirty: {}, {} reads, {} words changed after write-out; \
         {other} other reads, {} errors, {ipis} IPIs ({hooks} hook calls), {} timeouts, {elapsed_ms} ms)\n",
        if passed { "PASS" } else { "FAIL" },
        if claim_clean {
            ", the odd pages writable but reported clean (negative control)"
        } else {
            ""
        },
        t.warm_bad,
        t.hw_state_wrong,
        t.unmapped,
        t.report_wrong,
        t.not_pending,
        t.clean_cached,
        t.clean_attempts,
        t.clean_attempts - t.clean_landed,
        t.clean_attempts,
        t.permission_faults,
        t.clean_landed,
        t.clean_in_frames,
        t.dirty_landed,
        t.dirty_attempts,
        t.dirty_flushes,
        t.wrong_at_writeout,
        t.late_landed,
        t.late_read,
        t.late_in_frames,
        t.errors,
        t.timeouts,
    );
    passed
}
