//! The teardown of a region that holds a level 2 block descriptor (2 MiB,
//! or 512 MiB with the 64 KiB granule), through the crate's `MmuGather`,
//! while the other CPUs read the block.
//!
//! The region is what one level 2 table maps below entry [`ROOT_INDEX`]
//! of the kernel's root table. With the 4 KiB granule, the gigabyte below
//! level 0 entry 3: a level 1 table ([`L1`], which stays) whose first
//! entry links a level 2 table ([`L2`]) holding one block descriptor, over
//! block T at the top of RAM. With the 64 KiB granule the root is the
//! level 1 table (`mmu64.rs`), and its entry 3 links the level 2 table
//! ([`L2_64`], 8192 entries, 4 TiB) itself; nothing stays above it, so the
//! teardown clears the root entry (as `teardown_space.rs` does).
//! `MmuGather::unmap_range` over the level 2 table's whole span, with
//! `free_tables` and `TableFreePolicy::IpiSync`, must clear the block as
//! one entry (one page unmapped, its dirty bit moved to the block's first
//! frame), detach the level 2 table (the range covers it), flush once,
//! hand the block's first frame to `FreeFrames::free_batch` once, after
//! the flush, and the table to `TeardownBacking::free_tables` after the
//! flush and the sync.
//!
//! The flush: the freed table's span (1 GiB or 4 TiB) is flushed as well as the
//! block, so that no CPU's walk caches keep a pointer to the table; that
//! is far past the full-flush ceiling, so the one flush is a whole-ASID
//! `TLBI ASIDE1IS` (a broadcast: no IPI). The sync (`ipi_sync`) is the
//! one user of the IPI hook: one IPI to each other CPU, which takes it
//! between two passes of its reads ([`crate::crew`]).
//!
//! The kernel's side ([`Backing`]) frees the block by reusing it at once
//! (another pattern in every piece) and poisons the table (an invalid
//! descriptor in every entry). From the reuse on, every read of the other
//! CPUs must fault: the block's pattern or the reused one went through a
//! stale translation. Under `negative` (the flush's `TLBI` skipped) and
//! `negative-local` (on CPU 0 only) they read through what their TLBs
//! kept, as `block.rs` measured for a block, and the scenario must fail.
//!
//! First a measurement, printed: does TCG keep a walk-cache entry, a
//! pointer to a level 2 table, across a change of the level 1 entry with
//! no `TLBI`? Each other CPU reads half the pieces, CPU 0 points the level
//! 1 entry at another level 2 table ([`L2_ALT`], a block over block U)
//! and each reads every piece again: a piece it had not read that still
//! reads block T went through the old table. TCG caches only whole
//! translations, never a table pointer (measured: through none), so a
//! teardown that frees a table without flushing the walk caches cannot be
//! caught here; the line says so, and the mock machine is where that
//! shape fails (`TableFreedWhileCached`).

use core::sync::atomic::{AtomicU64, Ordering};

use tlb_batch::arch::aarch64 as a64;
use tlb_batch::{
    flush_tlb_batched_pending, flush_tlb_range, heapless, Arch, DetachedTable, Frame, FreeFrames, MmTlbState,
    MmuGather, OwnedFrame, PageRange, PageSize, PageTable, Pte, TableFreePolicy, TableTeardown,
    TeardownBacking, TeardownSummary, TlbStatsSnapshot,
};

use crate::block::{block_descriptor, to_descriptor, to_pte};
use crate::crew::{piece_offset, Crew, FILLED_PIECES};
use crate::mmu::{self, Table, DESC_TABLE_OR_PAGE, DESC_VALID, OUTPUT_ADDRESS};
use crate::mmu64::Table64;
use crate::tlb;

const NAME: &str = "block teardown";
/// The root-table entry the region hangs below (at 4 KiB 0 is the
/// identity map, 1 the test pages, 2 `teardown.rs`'s tables; at 64 KiB
/// 0 holds the identity map and the test pages, 2 `teardown.rs`'s).
const ROOT_INDEX: usize = 3;
const TABLE_DESC: u64 = DESC_VALID | DESC_TABLE_OR_PAGE;
/// What a freed table holds in every word (bit 0 clear: invalid).
const POISON: u64 = 0xdead_b10c_dead_b10c;
/// Pieces the other CPUs read; the measurement warms the first half.
const PIECES: u64 = 32;
const PASSES_AFTER: u64 = 64;

const TAG_T: u64 = 0x8d00_0000_0000;
const TAG_U: u64 = 0x9e00_0000_0000;
const TAG_REUSED: u64 = 0xaf00_0000_0000;

static L1: Table = Table::new();
static L2: Table = Table::new();
static L2_ALT: Table = Table::new();
/// The level 2 tables with the 64 KiB granule, after every other static
/// (`linker.ld`), so that none of those moved when they were added.
#[link_section = ".bss_block64.teardown"]
static L2_64: Table64 = Table64::new();
#[link_section = ".bss_block64.teardown_alt"]
static L2_ALT_64: Table64 = Table64::new();

/// The region's first address: what root entry [`ROOT_INDEX`] maps.
fn base() -> u64 {
    let root_shift = if mmu::granule64() { 42 } else { 39 };
    (ROOT_INDEX as u64) << root_shift
}

/// What the level 2 table maps, the range torn down: 1 GiB or 4 TiB.
fn span() -> u64 {
    mmu::block_bytes() * mmu::block_pages()
}

/// The level 2 table (`alt`: the measurement's other one) of this boot's
/// granule: its entries and its address.
fn l2(alt: bool) -> (&'static [AtomicU64], u64) {
    match (mmu::granule64(), alt) {
        (false, false) => (&L2.0, L2.addr()),
        (false, true) => (&L2_ALT.0, L2_ALT.addr()),
        (true, false) => (&L2_64.0, L2_64.addr()),
        (true, true) => (&L2_ALT_64.0, L2_ALT_64.addr()),
    }
}

/// The entry that links the level 2 table: [`L1`]'s first at 4 KiB, the
/// root's entry [`ROOT_INDEX`] at 64 KiB.
fn link_entry() -> &'static AtomicU64 {
    if mmu::granule64() {
        mmu::root_entry(ROOT_INDEX)
    } else {
        &L1.0[0]
    }
}

/// Block T (torn down) and block U (the measurement's other block).
static BLOCK_T: AtomicU64 = AtomicU64::new(0);
static BLOCK_U: AtomicU64 = AtomicU64::new(0);

static CREW: Crew = Crew::new(NAME);

const READ_WARM: u64 = 1;
const READ_ALL: u64 = 2;
const HAMMER: u64 = 3;

const MAPPED: u64 = 0;
/// The block was handed back and reused: every read must fault.
const GONE: u64 = 1;
static PHASE: AtomicU64 = AtomicU64::new(MAPPED);

/// Reads begun in [`GONE`]: faulted; of block T's pattern, of the reused
/// one, of anything else.
static FAULTS: AtomicU64 = AtomicU64::new(0);
static STALE_OLD: AtomicU64 = AtomicU64::new(0);
static STALE_REUSED: AtomicU64 = AtomicU64::new(0);
static OTHER: AtomicU64 = AtomicU64::new(0);

fn fill(block: u64, tag: u64) {
    for p in 0..FILLED_PIECES {
        // SAFETY: `block` is one of the level 2 blocks `run` chose at the
        // top of RAM, identity-mapped Normal memory that only this module
        // uses while it runs; the words are only accessed atomically.
        let w = unsafe { &*((block + piece_offset(p)) as *const AtomicU64) };
        w.store(tag | p, Ordering::Relaxed);
    }
    a64::dsb_ish();
}

fn piece_va(p: u64) -> u64 {
    base() + piece_offset(p)
}

/// The level 2 entry that maps `va`, when a level 2 table of this module
/// is linked there.
fn l2_entry(va: u64) -> Option<&'static AtomicU64> {
    if !(base()..base() + span()).contains(&va) {
        return None;
    }
    let link = link_entry().load(Ordering::Acquire);
    if link & TABLE_DESC != TABLE_DESC {
        return None;
    }
    let (table, _) = [l2(false), l2(true)]
        .into_iter()
        .find(|t| t.1 == link & OUTPUT_ADDRESS)?;
    let index = (va - base()) / mmu::block_bytes();
    table.get(index as usize)
}

fn is_block(desc: u64) -> bool {
    desc & TABLE_DESC == DESC_VALID
}

/// Links the level 1 table below the root (4 KiB granule) and the level
/// 2 table at `l2` below it, and drops every CPU's translations of the
/// region with the crate's real flush.
fn link(l2: u64) {
    link_entry().store(l2 | TABLE_DESC, Ordering::Release);
    if !mmu::granule64() {
        mmu::root_entry(ROOT_INDEX).store(L1.addr() | TABLE_DESC, Ordering::Release);
    }
    a64::dsb_ishst();
    a64::isb();
    real_flush();
}

/// The crate's real flush of the region's first block: past the
/// ceiling, so a whole-ASID one.
fn real_flush() {
    let Ok(range) = PageRange::new(base(), mmu::block_bytes() / 4096) else {
        crate::fatal("the teardown block is not a page range");
    };
    if flush_tlb_range(tlb::arch(), tlb::mm(), range).is_err() {
        crate::fatal("flush_tlb_range refused the teardown block");
    }
}

/// The region's tables as the crate sees them.
pub struct RegionSpace;

// SAFETY: `exchange` and `test_and_clear_accessed` are single atomic
// operations on the level 2 descriptor (the hardware may set its access
// flag; it has no DBM); `lookup` reads it as it is, in its 4 KiB view;
// `entry_size` answers the block's size wherever a block descriptor maps the address,
// and the whole-entry operations act at a block's first address only;
// `next_populated` skips only empty level 2 entries and addresses outside
// the region, where nothing is mapped; the state is the test address
// space's, which every CPU loaded with `switch_mm`, and whose root
// (`root`) these tables hang below; only CPU 0 changes them, one call at a
// time.
unsafe impl PageTable for RegionSpace {
    fn tlb_state(&self) -> &MmTlbState {
        tlb::mm()
    }

    fn root(&self) -> Option<u64> {
        Some(mmu::root())
    }

    fn lookup(&self, va: u64) -> Pte {
        let Some(e) = l2_entry(va) else {
            return Pte::EMPTY;
        };
        let pte = to_pte(e.load(Ordering::Acquire));
        if !pte.is_present() {
            return pte;
        }
        Pte(pte.0 + (va & (mmu::block_bytes() - 1)))
    }

    fn entry_size(&self, va: u64) -> PageSize {
        if l2_entry(va).is_some_and(|e| is_block(e.load(Ordering::Acquire))) {
            mmu::block_size()
        } else {
            mmu::page_size()
        }
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        match l2_entry(va) {
            Some(e) if va.is_multiple_of(mmu::block_bytes()) => {
                to_pte(e.swap(to_descriptor(new), Ordering::AcqRel))
            }
            _ => Pte::EMPTY,
        }
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        va.is_multiple_of(mmu::block_bytes())
            && l2_entry(va).is_some_and(|e| e.fetch_and(!mmu::AF, Ordering::AcqRel) & mmu::AF != 0)
    }

    fn set(&self, va: u64, pte: Pte) {
        if let Some(e) = l2_entry(va).filter(|_| va.is_multiple_of(mmu::block_bytes())) {
            e.store(to_descriptor(pte), Ordering::Release);
        }
    }

    fn next_populated(&self, range: PageRange) -> Option<u64> {
        let block = mmu::block_bytes();
        let last = range.last()?.min(base() + span() - 1);
        let mut va = range.start().max(base()) & !(block - 1);
        while va <= last {
            if l2_entry(va).is_some_and(|e| e.load(Ordering::Acquire) != 0) {
                return Some(va.max(range.start()));
            }
            va += block;
        }
        None
    }
}

// SAFETY: `detach_table` unlinks (one atomic swap of the level 1 entry
// that links it) the level 2 table only when `range` covers its whole
// span, so it translates nothing outside `range`; the frame is the static
// [`L2`] or [`L2_64`], which nothing else frees (`Backing` poisons it); the range returned is
// its whole span. `clear` of the block entry hands over the one claim on
// block T, which `Backing` frees (reuses) once.
unsafe impl TableTeardown for RegionSpace {
    fn detach_table(&self, range: PageRange) -> Option<DetachedTable> {
        let covered = range.start() <= base() && range.last()? >= base() + span() - 4096;
        if !covered {
            return None;
        }
        let link = link_entry().load(Ordering::Acquire);
        if link & TABLE_DESC != TABLE_DESC {
            return None;
        }
        let link = link_entry().swap(0, Ordering::AcqRel);
        Some(DetachedTable {
            frame: Frame((link & OUTPUT_ADDRESS) >> 12),
            range: PageRange::from_bounds(base(), base() + span()).ok()?,
        })
    }
}

/// The kernel's side of the teardown: frees block T (by reusing it) and
/// the level 2 table (by poisoning it), and records what came before each.
struct Backing {
    began: TlbStatsSnapshot,
    began_hooks: u64,
    /// The block's first frame handed over, and after a flush; other
    /// frames handed over.
    block: u64,
    block_after_flush: u64,
    others: u64,
    dirty: u64,
    /// IPIs sent and hook calls up to the data free (the flush's).
    flush_ipis: u64,
    flush_hooks: u64,
    /// Tables freed; after the flush and a hook call since the data free
    /// (the sync).
    tables: u64,
    tables_after_sync: u64,
}

impl FreeFrames for Backing {
    fn free_batch<const N: usize>(&mut self, frames: &mut heapless::Vec<OwnedFrame, N>) {
        let (ipis, hooks) = tlb::ipis();
        self.flush_ipis = ipis - self.began.ipis_sent;
        self.flush_hooks = hooks - self.began_hooks;
        while let Some(f) = frames.pop() {
            let t = BLOCK_T.load(Ordering::Relaxed);
            if f.into_frame() != Frame(t >> 12) {
                self.others += 1;
                continue;
            }
            self.block += 1;
            if tlb::TLB.stats().since(&self.began).shootdowns > 0 {
                self.block_after_flush += 1;
            }
            // Freed, and reused at once.
            PHASE.store(GONE, Ordering::Release);
            fill(t, TAG_REUSED);
        }
    }
}

impl TeardownBacking for Backing {
    fn set_dirty(&mut self, frame: Frame) {
        if frame == Frame(BLOCK_T.load(Ordering::Relaxed) >> 12) {
            self.dirty += 1;
        }
    }

    fn free_tables<const N: usize>(&mut self, tables: &mut heapless::Vec<OwnedFrame, N>) {
        let hooks = tlb::ipis().1 - self.began_hooks;
        let flushed = tlb::TLB.stats().since(&self.began).shootdowns > 0;
        while let Some(f) = tables.pop() {
            self.tables += 1;
            if flushed && hooks > self.flush_hooks {
                self.tables_after_sync += 1;
            }
            let (table, addr) = l2(false);
            if f.into_frame().addr() == addr {
                for w in table {
                    w.store(POISON, Ordering::Relaxed);
                }
            }
        }
    }
}

/// The secondary side, called from every wait loop (`Platform::poll`).
pub fn serve() {
    CREW.serve(|me, cmd| match cmd {
        READ_WARM => (0..PIECES / 2)
            .filter(|&p| crate::boot::probe(piece_va(p)) == Some(TAG_T | p))
            .count() as u64,
        READ_ALL => {
            // Bit p: piece p read block T (low half), block U (high).
            let mut seen = 0;
            for p in 0..PIECES {
                match crate::boot::probe(piece_va(p)) {
                    Some(v) if v == TAG_T | p => seen |= 1 << p,
                    Some(v) if v == TAG_U | p => seen |= 1 << (p + 32),
                    _ => {}
                }
            }
            seen
        }
        HAMMER => {
            while !CREW.stopping() {
                let after = PHASE.load(Ordering::Acquire) == GONE;
                for p in 0..PIECES {
                    let now = after || PHASE.load(Ordering::Acquire) == GONE;
                    let v = crate::boot::probe(piece_va(p));
                    if now {
                        match v {
                            None => &FAULTS,
                            Some(v) if v == TAG_T | p => &STALE_OLD,
                            Some(v) if v == TAG_REUSED | p => &STALE_REUSED,
                            Some(_) => &OTHER,
                        }
                        .fetch_add(1, Ordering::Relaxed);
                    }
                }
                CREW.end_pass(me, after);
            }
            0
        }
        _ => u64::MAX,
    });
}

/// The measurement: does a CPU keep walking through a level 2 table after
/// the level 1 entry moved to another one, with no `TLBI`?
fn measure(cpus: usize) {
    let (t, u) = (BLOCK_T.load(Ordering::Relaxed), BLOCK_U.load(Ordering::Relaxed));
    let ((table, addr), (alt, alt_addr)) = (l2(false), l2(true));
    table[0].store(block_descriptor(t), Ordering::Release);
    alt[0].store(block_descriptor(u), Ordering::Release);
    link(addr);
    let mut warm = 0;
    for cpu in 1..cpus {
        warm += CREW.ask(cpu, READ_WARM);
    }
    link_entry().store(alt_addr | TABLE_DESC, Ordering::Release);
    a64::dsb_ish();
    let half = (1u64 << (PIECES / 2)) - 1;
    let (mut used_old, mut used_new, mut unused_old, mut unused_new) = (0, 0, 0, 0);
    for cpu in 1..cpus {
        let seen = CREW.ask(cpu, READ_ALL);
        used_old += (seen & half).count_ones();
        unused_old += (seen >> (PIECES / 2) & half).count_ones();
        used_new += (seen >> 32 & half).count_ones();
        unused_new += (seen >> (32 + PIECES / 2) & half).count_ones();
    }
    let per = (cpus as u64 - 1) * PIECES / 2;
    crate::say!(
        "block teardown: a level 2 table kept in a walk cache across a change of the level 1 entry that links it, \
         with no TLBI ({} other CPUs read {warm} of {per} pieces of block T through it, the entry moved to a table \
         with a block over U): used pieces read the old block: {used_old} of {per} (U: {used_new}); unused pieces \
         read through the old table: {unused_old} of {per} (the new: {unused_new}){}\n",
        cpus - 1,
        if unused_old == 0 {
            ": TCG keeps no walk cache, so a table freed with no flush of the walk caches cannot be caught here"
        } else {
            ""
        }
    );
    alt[0].store(0, Ordering::Release);
    link(addr);
}

/// The teardown with `arch` as the crate's `Arch`; true when it passed.
fn scenario<A: Arch>(arch: &A, cpus: usize, under_test: &str) -> bool {
    let t = BLOCK_T.load(Ordering::Relaxed);
    fill(t, TAG_T);
    let (table, addr) = l2(false);
    for w in table {
        w.store(0, Ordering::Relaxed);
    }
    table[0].store(block_descriptor(t), Ordering::Release);
    link(addr);
    if flush_tlb_batched_pending(tlb::arch(), tlb::mm()).is_err() {
        crate::fatal("flush_tlb_batched_pending failed");
    }
    for c in [&FAULTS, &STALE_OLD, &STALE_REUSED, &OTHER] {
        c.store(0, Ordering::Relaxed);
    }
    PHASE.store(MAPPED, Ordering::Release);
    let Ok(range) = PageRange::from_bounds(base(), base() + span()) else {
        crate::fatal("the teardown region is not a page range");
    };
    let mut b = Backing {
        began: tlb::TLB.stats(),
        began_hooks: tlb::ipis().1,
        block: 0,
        block_after_flush: 0,
        others: 0,
        dirty: 0,
        flush_ipis: 0,
        flush_hooks: 0,
        tables: 0,
        tables_after_sync: 0,
    };
    let mut summary = None;
    let mut handed_back = 0;
    CREW.with_secondaries(cpus, HAMMER, PASSES_AFTER, || {
        b.began = tlb::TLB.stats();
        b.began_hooks = tlb::ipis().1;
        let mut gather: MmuGather<4> = MmuGather::new();
        let mut policy = TableFreePolicy::IpiSync;
        summary = gather
            .unmap_range(
                arch,
                &RegionSpace,
                &mut b,
                range,
                true,
                &mut policy,
                &mut |_, _| handed_back += 1,
            )
            .ok();
        PHASE.store(GONE, Ordering::Release);
    });
    let d = tlb::TLB.stats().since(&b.began);
    let hooks = tlb::ipis().1 - b.began_hooks;
    let unlinked = link_entry().load(Ordering::Acquire) == 0;
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let (faults, old, reused, other) = (get(&FAULTS), get(&STALE_OLD), get(&STALE_REUSED), get(&OTHER));
    let s = summary.unwrap_or(TeardownSummary::default());
    let others = cpus as u64 - 1;
    let passed = summary.is_some()
        && (s.pages_unmapped, s.data_freed, s.data_free_calls, s.tables_freed) == (1, 1, 1, 1)
        && (s.flushes, s.syncs) == (1, 1)
        && (b.block, b.block_after_flush, b.others, b.dirty) == (1, 1, 0, 1)
        && (b.tables, b.tables_after_sync) == (1, 1)
        && handed_back == 0
        && unlinked
        && d.local_page_flushes == 0
        && d.local_full_flushes == 1
        && d.shootdowns == 1
        && d.broadcasts == 1
        && (b.flush_ipis, b.flush_hooks) == (0, 0)
        && d.ipis_sent == others
        && hooks == 1
        && faults > 0
        && old + reused + other == 0;
    crate::say!(
        "scenario {} block teardown: {} (flush {under_test}; {cpus} CPUs reading {PIECES} pieces; unmap_range of \
         the level 2 table's {} with IpiSync: {} page unmapped, dirty moved to the block: {}; the block's first frame \
         handed to free_batch {} times (after the flush: {}), reused at once, other frames {}, handed back \
         {handed_back}; tables freed {} (after the flush and the sync: {}, the level 1 entry cleared: {unlinked}); \
         page TLBIs {}, full flushes {}, shootdowns {}, broadcasts {}, IPIs: {} by the flush, {} by the sync ({} \
         hook call); after the reuse: {faults} reads faulted; stale: {old} reads of the old block, {reused} of the \
         reused block, {other} other)\n",
        mmu::block_name(),
        if passed { "PASS" } else { "FAIL" },
        if mmu::granule64() { "4 TiB" } else { "1 GiB" },
        s.pages_unmapped,
        b.dirty,
        b.block,
        b.block_after_flush,
        b.others,
        b.tables,
        b.tables_after_sync,
        d.local_page_flushes,
        d.local_full_flushes,
        d.shootdowns,
        d.broadcasts,
        b.flush_ipis,
        d.ipis_sent - b.flush_ipis,
        hooks - b.flush_hooks,
    );
    passed
}

/// Runs the measurement and the teardown, its flush weakened as the
/// command line asks; true when the teardown passed.
pub fn run(bootargs: &[u8], ram: (u64, u64)) -> bool {
    let cpus = crate::ONLINE.load(Ordering::Acquire);
    let block = mmu::block_bytes();
    let top = crate::crew::blocks_top(ram);
    // Below the blocks of `block.rs` and `block_split.rs`.
    BLOCK_T.store(top - 5 * block, Ordering::Relaxed);
    BLOCK_U.store(top - 6 * block, Ordering::Relaxed);
    fill(top - 5 * block, TAG_T);
    fill(top - 6 * block, TAG_U);
    CREW.summon();
    measure(cpus);
    let a = *tlb::arch();
    let passed = if crate::has_word(bootargs, b"negative") {
        scenario(&tlb::SkipTlbi(a), cpus, "SKIPPED (negative control)")
    } else if crate::has_word(bootargs, b"negative-local") {
        scenario(&tlb::LocalTlbi(a), cpus, "on CPU 0 only (negative control)")
    } else {
        scenario(&a, cpus, "through the crate")
    };
    CREW.dismiss();
    // Nothing of the region stays linked or cached, whatever the flush
    // under test.
    link_entry().store(0, Ordering::Release);
    mmu::root_entry(ROOT_INDEX).store(0, Ordering::Release);
    a64::dsb_ishst();
    real_flush();
    passed
}
