//! A level 2 block descriptor split into a level 3 table of pages through
//! the crate's `split_huge_mapping`, while the other CPUs read and store
//! into the block's pieces: a 2 MiB block into 512 pages of 4 KiB, or
//! (`granule64`) a 512 MiB block into 8192 pages of 64 KiB, the table then
//! a 64 KiB one ([`LEAF_64`]).
//!
//! The rule: the Arm ARM (DDI 0487), chapter D8, "Translation table entry
//! changes", and in it "Using break-before-make when updating translation
//! table entries": changing the size of the block that maps an address,
//! or its output address or permissions, must go through an invalid entry
//! and a broadcast `TLBI` completed by a `DSB` before the new entries are
//! written; otherwise a CPU may hold entries of both sizes at once (a TLB
//! conflict abort, or either translation used). The crate gives the three
//! steps as typed values (`docs/huge-pages.md`): the break here swaps the
//! level 2 descriptor for 0, the flush is one `TLBI VAE1IS` at the
//! block's stride (the crate's shootdown, `DSB ISHST` before and `DSB ISH;
//! ISB` after), and the make writes a page descriptor into every entry of
//! the leaf table and links it with a table descriptor.
//!
//! The new table is not the old block cut up: pieces [`moved`] map other
//! frames (of block M, as a kernel remaps a piece after the split), and
//! pieces [`read_only`] lose write permission. After the make, the old
//! frames of the moved pieces are freed and reused at once (another
//! pattern). Every read through a moved piece must then return the new
//! frame, every store to a read-only piece must fault: the old block's
//! pattern or the reused pattern through a moved piece, or a store that
//! landed on a read-only piece, went through a stale translation of the
//! block.
//!
//! First a measurement, printed: the block mapped, each other CPU reads
//! every piece, CPU 0 links the split table with no `TLBI`, and each reads
//! the moved pieces and stores into the read-only ones. It says through
//! how many the old block was still used, which is what the negative
//! controls (`negative`, the `TLBI` skipped; `negative-local`, on CPU 0
//! only) need to fail.

use core::sync::atomic::{AtomicU64, Ordering};

use tlb_batch::arch::aarch64 as a64;
use tlb_batch::{flush_tlb_batched_pending, flush_tlb_range, split_huge_mapping, Arch, PageRange};

use crate::block::block_descriptor;
use crate::crew::{piece_offset, Crew, FILLED_PIECES};
use crate::mmu::{self, Table, AP_READ_ONLY, DESC_TABLE_OR_PAGE, DESC_VALID, OUTPUT_ADDRESS};
use crate::mmu64::Table64;
use crate::tlb;

const NAME: &str = "block split";
/// Pieces the other CPUs read and store into (one TCG TLB slot each).
const PIECES: u64 = 32;
/// Passes each other CPU begins after the make.
const PASSES_AFTER: u64 = 64;

/// Pieces the split maps to block M's frames.
fn moved(p: u64) -> bool {
    p % 4 == 1
}
/// Pieces the split maps read-only.
fn read_only(p: u64) -> bool {
    p % 4 == 2
}
const MOVED: u64 = PIECES / 4;
const READ_ONLY: u64 = PIECES / 4;

const TAG_S: u64 = 0x5a00_0000_0000;
const TAG_M: u64 = 0x6b00_0000_0000;
const TAG_REUSED: u64 = 0x7c00_0000_0000;

/// The split block S and block M, the moved pieces' new frames (set by
/// `run`).
static BLOCK_S: AtomicU64 = AtomicU64::new(0);
static BLOCK_M: AtomicU64 = AtomicU64::new(0);

/// The level 3 table the make links (4 KiB granule).
static LEAF: Table = Table::new();
/// The level 3 table the make links with the 64 KiB granule, placed after
/// every other static (`linker.ld`) so that none of them moved when it
/// was added.
#[link_section = ".bss_block64.split"]
static LEAF_64: Table64 = Table64::new();

/// The leaf table of this boot's granule: its entries and its address.
fn leaf() -> (&'static [AtomicU64], u64) {
    if mmu::granule64() {
        (&LEAF_64.0, LEAF_64.addr())
    } else {
        (&LEAF.0, LEAF.addr())
    }
}

static CREW: Crew = Crew::new(NAME);

// Commands.
const READ_ALL: u64 = 1;
const LOOK: u64 = 2;
const HAMMER: u64 = 3;

/// What the other CPUs are told (read before each access).
const MAPPED: u64 = 0;
/// Between the break and the end of the make: anything goes but a wrong
/// value, which no CPU can read then.
const BREAKING: u64 = 1;
/// The make returned and the moved pieces' old frames were reused.
const SPLIT: u64 = 2;
static PHASE: AtomicU64 = AtomicU64::new(MAPPED);

/// Accesses begun in [`SPLIT`]: reads of the new frames through moved
/// pieces, of the block through kept pieces; stores to read-only pieces
/// that faulted, to the others that landed.
static NEW_READS: AtomicU64 = AtomicU64::new(0);
static KEPT_READS: AtomicU64 = AtomicU64::new(0);
static RO_FAULTS: AtomicU64 = AtomicU64::new(0);
static LANDED: AtomicU64 = AtomicU64::new(0);
/// Stale: reads through a moved piece of its old frame (the block's
/// pattern, the reused one), stores that landed on a read-only piece.
static STALE_OLD: AtomicU64 = AtomicU64::new(0);
static STALE_REUSED: AtomicU64 = AtomicU64::new(0);
static STALE_STORES: AtomicU64 = AtomicU64::new(0);
/// Anything else: a read of another value or a fault, a store to a
/// writable piece that faulted.
static OTHER: AtomicU64 = AtomicU64::new(0);

fn word(block: u64, piece: u64, w: u64) -> &'static AtomicU64 {
    // SAFETY: `block` is one of the level 2 blocks `run` chose at the top
    // of RAM, identity-mapped Normal memory that only this module uses
    // while it runs; the words are only accessed atomically.
    unsafe { &*((block + piece_offset(piece) + w * 8) as *const AtomicU64) }
}

fn fill(block: u64, tag: u64) {
    for p in 0..FILLED_PIECES {
        word(block, p, 0).store(tag | p, Ordering::Relaxed);
        word(block, p, 1).store(0, Ordering::Relaxed);
    }
    a64::dsb_ish();
}

fn piece_va(p: u64) -> u64 {
    mmu::block_va() + piece_offset(p)
}

/// Writes the split's page descriptors into the leaf table, from the old
/// block descriptor `old`: its attributes, each piece over its own frame
/// of block S, the moved ones over block M's, the read-only ones with
/// AP\[2\] set.
fn write_leaf(old: u64) {
    let (s, m) = (BLOCK_S.load(Ordering::Relaxed), BLOCK_M.load(Ordering::Relaxed));
    let attrs = (old & !OUTPUT_ADDRESS) | DESC_TABLE_OR_PAGE;
    let (entries, _) = leaf();
    for (p, entry) in (0..mmu::block_pages()).zip(entries) {
        let frame = if moved(p) { m } else { s } + p * mmu::page_bytes();
        let mut desc = frame | attrs;
        if read_only(p) {
            desc |= AP_READ_ONLY;
        }
        entry.store(desc, Ordering::Relaxed);
    }
}

/// Links the leaf table in place of the block, and publishes it to the
/// walks.
fn link_leaf() {
    // The page descriptors reach the walkers before the link does.
    a64::dsb_ishst();
    mmu::block_entry().store(leaf().1 | DESC_VALID | DESC_TABLE_OR_PAGE, Ordering::Release);
    a64::dsb_ishst();
    a64::isb();
}

fn map_block(pa: u64) {
    mmu::block_entry().store(block_descriptor(pa), Ordering::Release);
    a64::dsb_ishst();
    a64::isb();
}

/// Unmaps whatever is at the block's address and drops every CPU's
/// translation of its span with the crate's real flush (a whole-ASID one:
/// a page `TLBI` drops one page's entry of a split block).
fn clear_and_flush() {
    mmu::block_entry().store(0, Ordering::Release);
    a64::dsb_ishst();
    let Ok(range) = PageRange::new(mmu::block_va(), mmu::block_bytes() / 4096) else {
        crate::fatal("the split block is not a page range");
    };
    if flush_tlb_range(tlb::arch(), tlb::mm(), range).is_err() {
        crate::fatal("flush_tlb_range refused the split block");
    }
}

fn count(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// The secondary side, called from every wait loop (`Platform::poll`).
pub fn serve() {
    CREW.serve(|me, cmd| match cmd {
        READ_ALL => (0..PIECES)
            .filter(|&p| crate::boot::probe(piece_va(p)) == Some(TAG_S | p))
            .count() as u64,
        LOOK => {
            // Moved pieces that read the old block (low half), that read
            // the new frame (high half); read-only pieces that took a store.
            let (mut old, mut new, mut stored) = (0, 0, 0);
            for p in 0..PIECES {
                if moved(p) {
                    match crate::boot::probe(piece_va(p)) {
                        Some(v) if v == TAG_S | p => old += 1,
                        Some(v) if v == TAG_M | p => new += 1,
                        _ => {}
                    }
                }
                if read_only(p) && crate::boot::probe_store_word(piece_va(p) + 8, me as u64) {
                    stored += 1;
                }
            }
            old | new << 16 | stored << 32
        }
        HAMMER => {
            hammer(me);
            0
        }
        _ => u64::MAX,
    });
}

/// Reads and stores into the pieces over and over, classifying every
/// access begun after the split.
fn hammer(me: usize) {
    while !CREW.stopping() {
        let after = PHASE.load(Ordering::Acquire) == SPLIT;
        for p in 0..PIECES {
            let now = after || PHASE.load(Ordering::Acquire) == SPLIT;
            let v = crate::boot::probe(piece_va(p));
            let landed = crate::boot::probe_store_word(piece_va(p) + 8, (me as u64) << 32 | p);
            if !now {
                continue;
            }
            match v {
                Some(v) if moved(p) && v == TAG_M | p => count(&NEW_READS),
                Some(v) if !moved(p) && v == TAG_S | p => count(&KEPT_READS),
                Some(v) if moved(p) && v == TAG_S | p => count(&STALE_OLD),
                Some(v) if moved(p) && v == TAG_REUSED | p => count(&STALE_REUSED),
                _ => count(&OTHER),
            }
            match (read_only(p), landed) {
                (true, false) => count(&RO_FAULTS),
                (true, true) => count(&STALE_STORES),
                (false, true) => count(&LANDED),
                (false, false) => count(&OTHER),
            }
        }
        CREW.end_pass(me, after);
    }
}

/// The measurement: with the block's pieces in every other CPU's TLB, the
/// split table linked with no `TLBI`: through how many moved pieces the
/// old block is read, how many read-only pieces take a store.
fn measure(cpus: usize) {
    let s = BLOCK_S.load(Ordering::Relaxed);
    clear_and_flush();
    map_block(s);
    let mut warm = 0;
    for cpu in 1..cpus {
        warm += CREW.ask(cpu, READ_ALL);
    }
    write_leaf(block_descriptor(s));
    link_leaf();
    a64::dsb_ish();
    let (mut old, mut new, mut stored) = (0, 0, 0);
    for cpu in 1..cpus {
        let seen = CREW.ask(cpu, LOOK);
        old += seen & 0xffff;
        new += seen >> 16 & 0xffff;
        stored += seen >> 32;
    }
    let others = cpus as u64 - 1;
    crate::say!(
        "block split: a {} block's translation kept across its split with no TLBI ({others} other CPUs read \
         {warm} of {} pieces of block S, then the descriptor was replaced by a level 3 table that maps {MOVED} of \
         them to other frames and {READ_ONLY} read-only): moved pieces read the old block: {old} of {} (the new \
         frames: {new}); read-only pieces took a store: {stored} of {}\n",
        mmu::block_name(),
        others * PIECES,
        others * MOVED,
        others * READ_ONLY,
    );
    clear_and_flush();
}

/// The split with `arch` as the crate's `Arch`; true when it passed.
fn scenario<A: Arch>(arch: &A, cpus: usize, under_test: &str) -> bool {
    let (s, m) = (BLOCK_S.load(Ordering::Relaxed), BLOCK_M.load(Ordering::Relaxed));
    fill(s, TAG_S);
    fill(m, TAG_M);
    for c in [
        &NEW_READS,
        &KEPT_READS,
        &RO_FAULTS,
        &LANDED,
        &STALE_OLD,
        &STALE_REUSED,
        &STALE_STORES,
        &OTHER,
    ] {
        c.store(0, Ordering::Relaxed);
    }
    map_block(s);
    // Anything an earlier scenario left pending for the space would be
    // flushed first by the split (contract rule 5): settled here, so that
    // the counts below are the split's alone.
    if flush_tlb_batched_pending(tlb::arch(), tlb::mm()).is_err() {
        crate::fatal("flush_tlb_batched_pending failed");
    }
    PHASE.store(MAPPED, Ordering::Release);
    let before = tlb::TLB.stats();
    let mut old = 0;
    let mut split = false;
    CREW.with_secondaries(cpus, HAMMER, PASSES_AFTER, || {
        PHASE.store(BREAKING, Ordering::Release);
        let broken = split_huge_mapping(arch, tlb::mm(), mmu::block_va(), mmu::block_size(), || {
            mmu::block_entry().swap(0, Ordering::AcqRel)
        });
        let Ok(broken) = broken else {
            crate::fatal("split_huge_mapping refused the block");
        };
        let Ok(flushed) = broken.flush(arch) else {
            crate::fatal("the split's flush failed");
        };
        old = flushed.make(|old| {
            write_leaf(old);
            link_leaf();
            old
        });
        split = true;
        // The moved pieces' old frames are free: reused at once.
        for p in (0..PIECES).filter(|&p| moved(p)) {
            word(s, p, 0).store(TAG_REUSED | p, Ordering::Relaxed);
        }
        a64::dsb_ish();
        PHASE.store(SPLIT, Ordering::Release);
    });
    let d = tlb::TLB.stats().since(&before);
    let was_block = old & (DESC_VALID | DESC_TABLE_OR_PAGE) == DESC_VALID && old & OUTPUT_ADDRESS == s;
    let linked = mmu::block_entry().load(Ordering::Acquire) == leaf().1 | DESC_VALID | DESC_TABLE_OR_PAGE;
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let (new, kept, ro_faults, landed) = (get(&NEW_READS), get(&KEPT_READS), get(&RO_FAULTS), get(&LANDED));
    let (stale_old, stale_reused, stale_stores, other) = (
        get(&STALE_OLD),
        get(&STALE_REUSED),
        get(&STALE_STORES),
        get(&OTHER),
    );
    let passed = split
        && was_block
        && linked
        && d.local_page_flushes == 1
        && d.local_full_flushes == 0
        && d.shootdowns == 1
        && d.broadcasts == 1
        && d.ipis_sent == 0
        && new > 0
        && kept > 0
        && ro_faults > 0
        && landed > 0
        && stale_old + stale_reused + stale_stores + other == 0;
    crate::say!(
        "scenario {} block split: {} (flush {under_test}; {cpus} CPUs reading and storing into {PIECES} pieces; \
         break: the old descriptor a block over S: {was_block}; flush: page TLBIs {}, full flushes {}, shootdowns \
         {}, broadcasts {}, IPIs {}; make: a level 3 table of {} pages, {MOVED} of the used pieces moved to other \
         frames, {READ_ONLY} read-only, linked: {linked}; after the make and the reuse of the old frames: {new} \
         reads of the new frames through moved pieces, {kept} of the block through kept pieces, {ro_faults} stores \
         to read-only pieces faulted, {landed} to the others landed; stale: {stale_old} reads of the old block and \
         {stale_reused} of the reused frames through moved pieces, {stale_stores} stores landed on read-only \
         pieces, {other} other)\n",
        mmu::block_name(),
        if passed { "PASS" } else { "FAIL" },
        d.local_page_flushes,
        d.local_full_flushes,
        d.shootdowns,
        d.broadcasts,
        d.ipis_sent,
        mmu::block_pages(),
    );
    clear_and_flush();
    passed
}

/// Runs the measurement and the split, the split's flush weakened as the
/// command line asks; true when the split passed.
pub fn run(bootargs: &[u8], ram: (u64, u64)) -> bool {
    let cpus = crate::ONLINE.load(Ordering::Acquire);
    let block = mmu::block_bytes();
    let top = crate::crew::blocks_top(ram);
    // Below blocks A and B of `block.rs`.
    BLOCK_S.store(top - 3 * block, Ordering::Relaxed);
    BLOCK_M.store(top - 4 * block, Ordering::Relaxed);
    fill(top - 3 * block, TAG_S);
    fill(top - 4 * block, TAG_M);
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
    passed
}
