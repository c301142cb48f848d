//! munmap-style teardown with the crate's `MmuGather` and batched
//! page-table freeing, while another CPU walks the page tables locklessly
//! (the GUP-fast pattern).
//!
//! # The tables
//!
//! The scenario's pages hang below an entry of their own of the kernel's
//! root table, in tables grown on demand from a poisoning frame pool
//! ([`TeardownSpace`], `teardown_space.rs`). A round maps [`PAGES`] pages
//! spread over [`TABLES`] leaf (level 3) tables of one level 2 table, and
//! CPU 0 writes every page through its new mapping.
//!
//! # The teardown
//!
//! `MmuGather::unmap_range` over the level 2 table's span (1 GiB at
//! 4 KiB, 4 TiB at 64 KiB), with `free_tables`: it clears every page
//! descriptor, detaches the four leaf tables and then the level 2 table
//! ([`TableTeardown`](tlb_batch::TableTeardown)), flushes once (through
//! the crate's aarch64 `Arch`: a broadcast `TLBI ASIDE1IS`, which
//! interrupts no CPU), frees the data frames in one call and, once the
//! policy allows, the five tables in one call ([`TeardownBacking`]). At
//! 4 KiB the level 1 table stays, as upper tables do in a kernel; at
//! 64 KiB the level 2 table hangs from the root itself, whose entry the
//! teardown clears.
//!
//! # The walker
//!
//! CPU 1 walks the tables in software, as a lockless walker does: from
//! the root, one descriptor per level down to a page descriptor, with
//! interrupts masked (they always are in this kernel), holding each level
//! a while. It takes the table-free sync request (`tlb::poll`, standing
//! for its interrupt handler) only between walks: that is "it takes the
//! IPI once its interrupts are back on". A walk that reads [`POISON`], or
//! finds at its end that a table it went through was freed since it
//! reached it, counts as having read a freed table. CPU 0 starts each
//! teardown while the walker holds a level 2 or level 3 table, the tables
//! the teardown frees.
//!
//! Under `TableFreePolicy::IpiSync`, `ipi_sync` waits until every other CPU
//! took its request, so no walk that could have reached a detached table
//! is still running when the tables are freed. Under
//! `TableFreePolicy::AfterFlush` (the command-line word
//! `negative-teardown`) the tables are freed and poisoned right after the
//! flush, under the walker, which must see it.
//!
//! # The IPIs
//!
//! The TLB flush is a broadcast invalidation here: it sends no IPI and
//! does not wait for anyone, least of all for a CPU that reads tables with
//! its interrupts masked. That is why the table free needs its own sync:
//! `ipi_sync` is the only caller of the flush-IPI hook in this kernel (one
//! hook call and one IPI per other CPU for each teardown). Linux on arm64
//! has the same need: its fast GUP walks with interrupts off, so freeing
//! page tables waits for an RCU grace period (`MMU_GATHER_RCU_TABLE_FREE`),
//! and where it cannot defer (no memory for the batch, or khugepaged
//! collapsing a table) it interrupts every CPU
//! (`tlb_remove_table_sync_one`), although its TLB flushes send none.
//!
//! # The evidence
//!
//! The free callbacks check, at the moment the crate calls them, that a
//! shootdown has happened since the teardown began (data and tables: freed
//! only after the flush) and, for the tables, that the walk that was
//! running when the last table was detached has ended (freed only after
//! the walker finished). The hook's and the crate's IPI counters are read
//! around each callback, which separates the flush's IPIs (must be 0)
//! from the sync's. CPU 1 also reads every page through the MMU between
//! walks, so that its TLB holds them; after each teardown it reads them
//! once more and must fault: reading the round's data or the poison is a
//! stale translation of a freed frame (the negative controls `negative`
//! and `negative-local` make the teardown's flush skip its invalidations
//! or make them local, and must show that). `negative-nodsb` flushes
//! without the `DSB ISH` that waits for the broadcast (see
//! `tlb::NoDsb`).

use core::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use tlb_batch::arch::aarch64 as a64;
use tlb_batch::{
    flush_tlb_range, heapless, Arch, Frame, FreeFrames, MmuGather, OwnedFrame, PageRange, TableFreePolicy,
    TeardownBacking, TeardownSummary,
};

use crate::mmu::{self, OUTPUT_ADDRESS};
use crate::teardown_space::{
    alloc, free, generation, in_use, prepare_pool, word, Geometry, TeardownSpace, POISON, POOL_FRAMES,
    TABLE_DESC,
};
use crate::{boot, tlb};

/// Leaf tables mapped in a round.
const TABLES: usize = 4;
/// Pages mapped in each leaf table.
const PER_TABLE: usize = 8;
/// Pages mapped in a round.
const PAGES: usize = TABLES * PER_TABLE;
/// Map-write-teardown rounds.
const ROUNDS: u64 = 16;
/// Tables freed by each teardown: the leaf tables and their level 2 table.
const TABLES_FREED: usize = TABLES + 1;
/// How long the walker holds each level of a walk.
const HOLD_US: u64 = 400;
/// The CPU that walks the tables and reads the pages.
const WALKER_CPU: usize = 1;
/// How long CPU 0 waits for the walker at each step.
const WAIT_LIMIT_US: u64 = 10_000_000;

// Two rounds' frames and the level 1 table (4 KiB) fit.
const _: () = assert!(2 * (PAGES + TABLES_FREED) < POOL_FRAMES);
const _: () = assert!(PAGES <= 64, "the gather holds 64 frames of each kind");
// The leaf tables fit in one level 2 table, and each leaf table's pages
// (at entries `p`, below) in it, at either granule (512 or 8192 entries).
const _: () = assert!(TABLES <= 512 && PAGES <= 512);

/// 1 while CPU 0 wants the walker to run.
static JOB: AtomicU32 = AtomicU32::new(0);
/// Whether the walker is in its loop.
static RUNNING: AtomicBool = AtomicBool::new(false);
/// 0 between walks; otherwise 1 + the level of the table the walker holds
/// (it read an entry of it and has not finished with it).
static WALK_LEVEL: AtomicU32 = AtomicU32::new(0);
/// The number of the walk started last (each walk takes the next one).
static WALK_SEQ: AtomicU64 = AtomicU64::new(0);
/// The number of the walk finished last.
static WALK_DONE: AtomicU64 = AtomicU64::new(0);
/// The newest walk that was started when a table was detached: it may
/// hold that table until it is done.
static DETACH_SEEN: AtomicU64 = AtomicU64::new(0);
/// Walks that read a freed table.
static CAUGHT: AtomicU64 = AtomicU64::new(0);
/// Walks that reached a leaf table.
static LEAVES: AtomicU64 = AtomicU64::new(0);
/// The round whose pages are mapped and written (0: none).
static ROUND: AtomicU64 = AtomicU64::new(0);
/// The round whose pages the walker CPU read, every one, through the MMU.
static WARM: AtomicU64 = AtomicU64::new(0);
/// The round whose teardown returned.
static TORN: AtomicU64 = AtomicU64::new(0);
/// The round the walker CPU read again after its teardown.
static CHECKED: AtomicU64 = AtomicU64::new(0);
/// Reads after a teardown that faulted.
static FRESH: AtomicU64 = AtomicU64::new(0);
/// Reads that returned a torn-down page's data after its teardown, or the
/// poison of a freed frame at any time.
static STALE: AtomicU64 = AtomicU64::new(0);
/// Reads that returned anything else unexpected.
static OTHER: AtomicU64 = AtomicU64::new(0);

/// Page `p` of the scenario: leaf table `p / PER_TABLE`, at entry `p` of
/// it (so that no two pages share their low address bits, nor, under
/// QEMU, their software-TLB slot).
fn page_va(p: usize) -> u64 {
    let g = Geometry::get();
    g.base() + (p / PER_TABLE) as u64 * g.reach(3) + p as u64 * g.page_bytes()
}

fn pattern(round: u64, p: usize) -> u64 {
    0x7ea2_0000_0000_0000 | (p as u64) << 32 | round
}

/// Called as a table is detached: a walk started before this point may
/// still hold the table; one started after it finds the entry empty.
pub(crate) fn note_detach() {
    DETACH_SEEN.fetch_max(WALK_SEQ.load(Ordering::SeqCst), Ordering::SeqCst);
}

/// The counters read at one moment of a teardown.
#[derive(Clone, Copy, Default)]
struct Moment {
    shootdowns: u64,
    ipis: u64,
    hook_calls: u64,
}

impl Moment {
    fn now() -> Self {
        let (ipis, hook_calls) = tlb::ipis();
        Moment {
            shootdowns: tlb::TLB.stats().shootdowns,
            ipis,
            hook_calls,
        }
    }
}

/// The kernel side of the teardown: frees into the pool and checks, at
/// each free, what must have happened before it.
#[derive(Default)]
struct Backing {
    /// When the current teardown began, and when its data frames were
    /// freed.
    began: Moment,
    data_freed_at: Moment,
    data_freed: usize,
    tables_freed: usize,
    dirty: usize,
    /// Frames freed with no shootdown since the teardown began.
    before_flush: usize,
    /// Tables freed while the walk that was running at their detach could
    /// still be holding them.
    under_walk: usize,
    /// IPIs and hook calls from the start to the data free (the flush),
    /// and from there to the table free (the sync).
    flush_ipis: u64,
    flush_hooks: u64,
    sync_ipis: u64,
    sync_hooks: u64,
}

impl Backing {
    fn begin(&mut self) {
        self.began = Moment::now();
        self.data_freed_at = self.began;
    }
}

impl FreeFrames for Backing {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        let now = Moment::now();
        if now.shootdowns == self.began.shootdowns {
            self.before_flush += frames.len();
        }
        self.flush_ipis += now.ipis - self.began.ipis;
        self.flush_hooks += now.hook_calls - self.began.hook_calls;
        self.data_freed_at = now;
        while let Some(f) = frames.pop() {
            free(f.into_frame().addr());
            self.data_freed += 1;
        }
    }
}

impl TeardownBacking for Backing {
    fn set_dirty(&mut self, _frame: Frame) {
        self.dirty += 1;
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        let now = Moment::now();
        if now.shootdowns == self.began.shootdowns {
            self.before_flush += tables.len();
        }
        if WALK_DONE.load(Ordering::SeqCst) < DETACH_SEEN.load(Ordering::SeqCst) {
            self.under_walk += tables.len();
        }
        self.sync_ipis += now.ipis - self.data_freed_at.ipis;
        self.sync_hooks += now.hook_calls - self.data_freed_at.hook_calls;
        while let Some(f) = tables.pop() {
            free(f.into_frame().addr());
            self.tables_freed += 1;
        }
    }
}

fn hold(us: u64) {
    let start = crate::now_us();
    while crate::now_us() - start < us {
        core::hint::spin_loop();
    }
}

/// One lockless walk to `va`'s page descriptor, holding each level
/// [`HOLD_US`]; returns whether it read a freed table. Runs with
/// interrupts masked, as everything in this kernel does: nothing can
/// interrupt it, and the table-free sync is taken after it returns.
///
/// Every table the walk went through is checked again at its end: its
/// generation must not have changed, nor the entry it read have become
/// [`POISON`], so a table freed at any moment of the walk is caught.
fn walk_once(va: u64) -> bool {
    let mut seen = [(0u64, 0u64); 4];
    let mut depth = 0;
    let mut table = mmu::root();
    let mut freed = false;
    let g = Geometry::get();
    for level in g.root_level..4 {
        let slot = table + g.index(va, level) * 8;
        // Not a table of ours: a freed table's frame reused; the check
        // below catches that.
        let Some(entry) = word(slot) else { break };
        seen[depth] = (slot, generation(table));
        depth += 1;
        if level == 3 {
            LEAVES.fetch_add(1, Ordering::Relaxed);
        }
        let v = entry.load(Ordering::SeqCst);
        if v == POISON {
            freed = true;
            break;
        }
        WALK_LEVEL.store(level as u32 + 1, Ordering::SeqCst);
        hold(HOLD_US);
        if level == 3 || v & TABLE_DESC != TABLE_DESC {
            break;
        }
        table = v & OUTPUT_ADDRESS;
    }
    WALK_LEVEL.store(0, Ordering::SeqCst);
    freed
        || seen[..depth].iter().any(|&(slot, gen)| {
            word(slot).is_some_and(|w| w.load(Ordering::SeqCst) == POISON) || generation(slot) != gen
        })
}

/// One pass of the walker CPU over the pages through the MMU: before the
/// round's teardown returned it must read the round's data (or fault,
/// once the teardown has begun); after it, it must fault.
fn read_pass() {
    let round = ROUND.load(Ordering::Acquire);
    if round == 0 || CHECKED.load(Ordering::Acquire) == round {
        return;
    }
    let after = TORN.load(Ordering::Acquire) == round;
    let mut warm = true;
    for p in 0..PAGES {
        match boot::probe(page_va(p)) {
            None if after => {
                FRESH.fetch_add(1, Ordering::Relaxed);
            }
            None => warm = false,
            Some(POISON) => {
                STALE.fetch_add(1, Ordering::Relaxed);
            }
            Some(v) if v == pattern(round, p) => {
                if after {
                    STALE.fetch_add(1, Ordering::Relaxed);
                }
            }
            Some(_) => {
                OTHER.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    if after {
        CHECKED.store(round, Ordering::Release);
    } else if warm {
        WARM.store(round, Ordering::Release);
    }
}

/// The walker's side, called from every wait loop of every CPU
/// (`Platform::poll` in main.rs): on the walker CPU, while CPU 0 asks for
/// it, walks the tables and reads the pages, taking flush-IPI requests
/// between walks only.
pub fn serve() {
    if crate::cpu_index() != WALKER_CPU || JOB.load(Ordering::Acquire) != 1 {
        return;
    }
    RUNNING.store(true, Ordering::SeqCst);
    let mut p = 0;
    while JOB.load(Ordering::Acquire) == 1 {
        let seq = WALK_SEQ.fetch_add(1, Ordering::SeqCst) + 1;
        if walk_once(page_va(p % PAGES)) {
            CAUGHT.fetch_add(1, Ordering::SeqCst);
        }
        WALK_DONE.store(seq, Ordering::SeqCst);
        p += 1;
        // "Interrupts back on": a pending table-free sync is taken here.
        tlb::poll();
        read_pass();
    }
    RUNNING.store(false, Ordering::SeqCst);
}

/// Waits until `done` holds; false after [`WAIT_LIMIT_US`].
fn wait(done: impl Fn() -> bool) -> bool {
    let start = crate::now_us();
    while !done() {
        if crate::now_us() - start > WAIT_LIMIT_US {
            return false;
        }
        tlb::poll();
        core::hint::spin_loop();
    }
    true
}

/// Runs the scenario with the flush under test and the table-free policy
/// that the kernel command line asks for, prints its line and returns
/// whether it passed.
pub fn run(bootargs: &[u8]) -> bool {
    let a = *tlb::arch();
    let after_flush = crate::has_word(bootargs, b"negative-teardown");
    if crate::has_word(bootargs, b"negative") {
        scenario(&tlb::SkipTlbi(a), "SKIPPED (negative control)", after_flush)
    } else if crate::has_word(bootargs, b"negative-local") {
        scenario(
            &tlb::LocalTlbi(a),
            "on CPU 0 only (negative control)",
            after_flush,
        )
    } else if crate::has_word(bootargs, b"negative-nodsb") {
        scenario(
            &tlb::NoDsb(a),
            "broadcast without DSB ISH (negative control)",
            after_flush,
        )
    } else {
        scenario(&a, "on every CPU", after_flush)
    }
}

fn scenario<A: Arch>(arch: &A, flush: &str, after_flush: bool) -> bool {
    prepare_pool();
    let space = TeardownSpace;
    let g = Geometry::get();
    let Ok(range) = PageRange::from_bounds(g.base(), g.base() + g.span()) else {
        crate::fatal("teardown: bad range");
    };
    let cpus = tlb::CPUS.online().len() as u64;
    for c in [
        &CAUGHT, &LEAVES, &FRESH, &STALE, &OTHER, &ROUND, &WARM, &TORN, &CHECKED,
    ] {
        c.store(0, Ordering::SeqCst);
    }
    let start = crate::now_us();
    let mut timeouts = 0u32;
    JOB.store(1, Ordering::SeqCst);
    if !wait(|| RUNNING.load(Ordering::SeqCst)) {
        timeouts += 1;
    }
    let walks_before = WALK_DONE.load(Ordering::SeqCst);
    let mut backing = Backing::default();
    let mut total = TeardownSummary::default();
    let (mut handed_back, mut errors) = (0usize, 0usize);
    for round in 1..=ROUNDS {
        for p in 0..PAGES {
            let Some(pa) = alloc() else {
                crate::fatal("teardown: the frame pool is exhausted");
            };
            space.map(page_va(p), pa);
        }
        // The descriptors reach every CPU's table walks; what an earlier
        // round (or a negative control's flush) left in a TLB is gone.
        a64::dsb_ishst();
        a64::isb();
        if flush_tlb_range(tlb::arch(), tlb::mm(), range).is_err() {
            crate::fatal("teardown: flush_tlb_range refused the range");
        }
        for p in 0..PAGES {
            if !boot::probe_store_word(page_va(p), pattern(round, p)) {
                crate::fatal("teardown: a freshly mapped page faulted");
            }
        }
        ROUND.store(round, Ordering::Release);
        // The walker CPU's TLB holds every page, and the walker holds a
        // table this teardown frees.
        if !wait(|| WARM.load(Ordering::Acquire) == round) {
            timeouts += 1;
        }
        if !wait(|| matches!(WALK_LEVEL.load(Ordering::SeqCst), 3 | 4)) {
            timeouts += 1;
        }
        backing.begin();
        let mut policy = if after_flush {
            TableFreePolicy::AfterFlush
        } else {
            TableFreePolicy::IpiSync
        };
        let mut gather: MmuGather<64> = MmuGather::new();
        match gather.unmap_range(
            arch,
            &space,
            &mut backing,
            range,
            true,
            &mut policy,
            &mut |_, _| handed_back += 1,
        ) {
            Ok(s) => total += s,
            Err(_) => errors += 1,
        }
        TORN.store(round, Ordering::Release);
        if !wait(|| CHECKED.load(Ordering::Acquire) == round) {
            timeouts += 1;
        }
    }
    JOB.store(0, Ordering::SeqCst);
    if !wait(|| !RUNNING.load(Ordering::SeqCst)) {
        timeouts += 1;
    }
    ROUND.store(0, Ordering::SeqCst);
    let elapsed_ms = (crate::now_us() - start) / 1000;
    let walks = WALK_DONE.load(Ordering::SeqCst) - walks_before;
    let (caught, leaves) = (CAUGHT.load(Ordering::SeqCst), LEAVES.load(Ordering::SeqCst));
    let (fresh, stale, other) = (
        FRESH.load(Ordering::SeqCst),
        STALE.load(Ordering::SeqCst),
        OTHER.load(Ordering::SeqCst),
    );
    // Only the tables above the level 2 one are left allocated.
    let leaked = in_use().saturating_sub(g.kept_tables());
    let rounds = ROUNDS as usize;
    let syncs = if after_flush { 0 } else { rounds };
    let b = &backing;
    let (span, span_unit) = if g.span() >= 1 << 40 {
        (g.span() >> 40, "TiB")
    } else {
        (g.span() >> 30, "GiB")
    };
    let passed = errors == 0
        && handed_back == 0
        && leaked == 0
        && total.pages_unmapped == PAGES * rounds
        && total.data_freed == PAGES * rounds
        && b.data_freed == PAGES * rounds
        && b.dirty == PAGES * rounds
        && total.tables_freed == TABLES_FREED * rounds
        && b.tables_freed == TABLES_FREED * rounds
        && total.flushes == rounds
        && total.syncs == syncs
        && b.before_flush == 0
        && b.under_walk == 0
        && b.flush_ipis == 0
        && b.flush_hooks == 0
        && b.sync_hooks == syncs as u64
        && b.sync_ipis == syncs as u64 * (cpus - 1)
        && total.ipis_sent as u64 == b.sync_ipis
        && leaves > 0
        && caught == 0
        && fresh == (PAGES * rounds) as u64
        && stale == 0
        && other == 0
        && timeouts == 0;
    crate::say!(
        "scenario teardown with batched table free: {} ({ROUNDS} rounds x {PAGES} pages of {} KiB in {TABLES} leaf \
         tables of {} entries below a level 2 table over {span} {span_unit}, written by CPU 0, torn down by \
         MmuGather ({} pages unmapped), tables freed {}, flush {flush}: {} data frames and {} tables \
         freed, {} of them before the flush, {} tables while a walk could hold them, {} pages dirty, {handed_back} \
         handed back, {} errors, {leaked} frames leaked; {} flushes sent {} IPIs ({} hook calls), {} table-free \
         syncs sent {} IPIs ({} hook calls); walker on CPU {WALKER_CPU}, lockless, interrupts masked: {walks} \
         walks, {leaves} reached a leaf table, walker read {caught} freed tables; CPU {WALKER_CPU} after each \
         teardown: {fresh} reads faulted as they must, stale: {stale} reads of the old frame, {other} other, \
         {timeouts} timeouts, {elapsed_ms} ms)\n",
        if passed { "PASS" } else { "FAIL" },
        g.page_bytes() >> 10,
        g.entries(),
        total.pages_unmapped,
        if after_flush {
            "right after the flush (AfterFlush, negative control)"
        } else {
            "after an IPI sync (IpiSync)"
        },
        b.data_freed,
        b.tables_freed,
        b.before_flush,
        b.under_walk,
        b.dirty,
        errors,
        total.flushes,
        b.flush_ipis,
        b.flush_hooks,
        total.syncs,
        b.sync_ipis,
        b.sync_hooks,
    );
    crate::say!(
        "  (teardown: each flush is a broadcast TLBI and interrupts no CPU, so it sends 0 IPIs; the IPIs above \
         are ipi_sync's, the only user of the flush-IPI hook here: one per other CPU per teardown, which a CPU \
         walking the tables with interrupts masked takes only after its walk; Linux on arm64 does the same \
         (tlb_remove_table_sync_one) where it cannot wait for an RCU grace period before freeing page tables \
         that a lockless walker may hold)\n"
    );
    passed
}
