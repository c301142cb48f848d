//! A level 2 block descriptor taken as one unit by the crate's real
//! `Aarch64`: 2 MiB with the 4 KiB granule, 512 MiB with the 64 KiB one
//! ([`mmu::block_size`]); its pieces are pages of the granule.
//!
//! The block maps, at [`mmu::block_va`], one of two blocks aligned to
//! their size at the top of RAM, A (the one unmapped, reused and
//! protected) or B (only for the measurement). Its table,
//! [`BlockSpace`], answers the block's size from `entry_size` while a
//! block descriptor is there, and takes `exchange`, `set` and
//! `test_and_clear_accessed` on the whole descriptor at the block's first
//! address, converting as `space.rs` does for page descriptors (a block
//! descriptor is a page descriptor without bit 1).
//!
//! First a measurement: every secondary CPU reads the first half of the
//! pieces it will use ([`PIECES`] pieces in all), CPU 0 points the
//! descriptor at block B with no TLBI, and each secondary reads every
//! piece again. The line says through how many pieces the old block was
//! still read, the used ones and the unused ones apart.
//!
//! Then the scenario: while the secondaries read the pieces over and
//! over, CPU 0 unmaps the block through `try_to_unmap` of its first
//! frame into a `TlbFlushUnmapBatch` (the block's one `TLBI VAE1IS` goes
//! out as it is added), flushes the batch, and reuses block A at once with
//! another pattern. From the flush on, every read must fault: a read of
//! either pattern went through a stale translation. Under `negative` the
//! crate's flush skips its invalidations, under `negative-local` they
//! reach CPU 0 only; the scenario must then fail on those reads.
//!
//! Last, the mprotect: block A mapped writable again, the secondaries
//! store into the pieces over and over while CPU 0 makes the whole block
//! read-only through `change_protection` over its whole span; one entry
//! changes, it stays a block over A, and every store begun after the call
//! returned must fault (none lands in the block). It fails under the
//! controls on the stores that landed.

use core::ops::ControlFlow;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tlb_batch::arch::aarch64 as a64;
use tlb_batch::{
    change_protection, flush_tlb_batched_pending, flush_tlb_page, try_to_unmap, Arch, Frame, Mapping,
    MappingFlags, MmTlbState, PageRange, PageSize, PageTable, Pte, PteFlags, Rmap, SwapResult,
    TlbFlushUnmapBatch, TtuFlags,
};

use crate::crew::{piece_offset, FILLED_PIECES};
use crate::mmu::{self, DESC_TABLE_OR_PAGE, DESC_VALID};
use crate::{space, tlb, MAX_CPUS};

/// Pieces the secondaries read; the measurement warms the first half.
const PIECES: u64 = 32;
/// Reading passes each secondary makes over the pieces after the flush.
const PASSES_AFTER: u64 = 64;

const TAG_A: u64 = 0xa000_0000_0000;
const TAG_B: u64 = 0xb000_0000_0000;
const TAG_REUSED: u64 = 0xc000_0000_0000;

/// Physical addresses of blocks A and B (set once by `run`).
static BLOCK_A: AtomicU64 = AtomicU64::new(0);
static BLOCK_B: AtomicU64 = AtomicU64::new(0);

/// While set, the secondaries serve [`CMD`] from their wait loops.
static JOB: AtomicBool = AtomicBool::new(false);
static CMD: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static RES: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Set by CPU 0 once the batch's flush returned.
static FLUSHED: AtomicBool = AtomicBool::new(false);
static STOP: AtomicBool = AtomicBool::new(false);
/// Per CPU: one pass made before the unmap; passes begun after the flush.
static WARM: [AtomicBool; MAX_CPUS] = [const { AtomicBool::new(false) }; MAX_CPUS];
static PASSES: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Reads begun after the flush: of block A's first pattern, of the reused
/// block's, of anything else, and faults.
static STALE_OLD: AtomicU64 = AtomicU64::new(0);
static STALE_NEW: AtomicU64 = AtomicU64::new(0);
static OTHER: AtomicU64 = AtomicU64::new(0);
static FAULTS: AtomicU64 = AtomicU64::new(0);

// Steps.
const READ_WARM: u64 = 1;
const READ_ALL: u64 = 2;
const HAMMER: u64 = 3;
const STORE: u64 = 4;

/// Word 1 of each piece, stored by the mprotect's secondaries: before the
/// call returned, and after it (which must never land).
const STORED_BEFORE: u64 = 0xd000_0000_0000;
const STORED_AFTER: u64 = 0xe000_0000_0000;
/// Stores begun after `change_protection` returned: landed, faulted.
static LANDED: AtomicU64 = AtomicU64::new(0);
static STORE_FAULTS: AtomicU64 = AtomicU64::new(0);

fn word(block: u64, piece: u64) -> &'static AtomicU64 {
    // SAFETY: `block` is one of the blocks `run` chose at the top of RAM,
    // identity-mapped Normal memory that nothing else uses; the words are
    // only accessed atomically.
    unsafe { &*((block + piece_offset(piece)) as *const AtomicU64) }
}

fn fill(block: u64, tag: u64) {
    for piece in 0..FILLED_PIECES {
        word(block, piece).store(tag | piece, Ordering::Release);
    }
    a64::dsb_ish();
}

/// A writable block descriptor over the level 2 block at `pa`, with its
/// access flag (the test address space's attributes; also `block_split.rs`
/// and `block_teardown.rs`).
pub fn block_descriptor(pa: u64) -> u64 {
    let pte = Pte::new(
        Frame(pa >> 12),
        tlb_batch::PteFlags::PRESENT | tlb_batch::PteFlags::WRITABLE,
    );
    let pte = Pte(pte.0 | tlb_batch::PteFlags::ACCESSED.bits() | tlb_batch::PteFlags::DIRTY.bits());
    to_descriptor(pte)
}

/// The block descriptor for `pte` (a page descriptor without bit 1).
pub fn to_descriptor(pte: Pte) -> u64 {
    if !pte.is_present() {
        return pte.0 & !DESC_VALID;
    }
    space::to_descriptor(pte) & !DESC_TABLE_OR_PAGE
}

/// The crate's view of the level 2 descriptor `desc`.
pub fn to_pte(desc: u64) -> Pte {
    if desc & (DESC_VALID | DESC_TABLE_OR_PAGE) != DESC_VALID {
        return Pte(desc & !DESC_VALID);
    }
    space::to_pte(desc | DESC_TABLE_OR_PAGE)
}

/// The block's table: one level 2 entry.
pub struct BlockSpace;

static SPACE: BlockSpace = BlockSpace;

fn in_block(va: u64) -> bool {
    (mmu::block_va()..mmu::block_va() + mmu::block_bytes()).contains(&va)
}

// SAFETY: `exchange` and `test_and_clear_accessed` are single atomic
// operations on the descriptor (the hardware may set its access flag;
// it has no DBM); `lookup` reads it as it is, in its 4 KiB view; the
// state is the test address space's, which every CPU has loaded and
// whose root holds this level 2 table; `entry_size` answers the block's
// size (2 or 512 MiB) wherever a block descriptor maps the address, and the whole-entry
// operations act at the block's first address only.
unsafe impl PageTable for BlockSpace {
    fn tlb_state(&self) -> &MmTlbState {
        tlb::mm()
    }

    fn lookup(&self, va: u64) -> Pte {
        if !in_block(va) {
            return Pte::EMPTY;
        }
        let pte = to_pte(mmu::block_entry().load(Ordering::Acquire));
        if !pte.is_present() {
            return pte;
        }
        Pte(pte.0 + (va - mmu::block_va()))
    }

    fn entry_size(&self, va: u64) -> PageSize {
        if in_block(va) && to_pte(mmu::block_entry().load(Ordering::Acquire)).is_present() {
            mmu::block_size()
        } else {
            mmu::page_size()
        }
    }

    fn exchange(&self, va: u64, new: Pte) -> Pte {
        if va != mmu::block_va() {
            return Pte::EMPTY;
        }
        to_pte(mmu::block_entry().swap(to_descriptor(new), Ordering::AcqRel))
    }

    fn test_and_clear_accessed(&self, va: u64) -> bool {
        va == mmu::block_va() && mmu::block_entry().fetch_and(!mmu::AF, Ordering::AcqRel) & mmu::AF != 0
    }

    fn set(&self, va: u64, pte: Pte) {
        if va == mmu::block_va() {
            mmu::block_entry().store(to_descriptor(pte), Ordering::Release);
        }
    }
}

/// The reverse map of block A: its first frame is mapped, whole, at the
/// block's first address.
pub struct BlockRmap;

// SAFETY: block A is mapped in the test address space only at block_va()
// (the identity map of RAM covers it too, as a linear map does; nothing
// here unmaps that).
unsafe impl Rmap for BlockRmap {
    type Space = BlockSpace;

    fn walk(
        &self,
        frame: Frame,
        visit: &mut dyn FnMut(Mapping<'_, BlockSpace>) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        if frame.addr() == BLOCK_A.load(Ordering::Relaxed) {
            visit(Mapping {
                space: &SPACE,
                va: mmu::block_va(),
                flags: MappingFlags::empty(),
            })
        } else {
            ControlFlow::Continue(())
        }
    }

    fn set_dirty(&self, _frame: Frame) {
        DIRTIED.fetch_add(1, Ordering::Relaxed);
    }
}

static DIRTIED: AtomicU64 = AtomicU64::new(0);

/// Reads piece `piece` through the block: its word, or `None` on a fault.
fn read(piece: u64) -> Option<u64> {
    crate::boot::probe(mmu::block_va() + piece_offset(piece))
}

/// The secondary side, called from every wait loop (`Platform::poll`).
pub fn serve() {
    let me = crate::cpu_index();
    if me == 0 || me >= MAX_CPUS || !JOB.load(Ordering::Acquire) {
        return;
    }
    while JOB.load(Ordering::Acquire) {
        let result = match CMD[me].load(Ordering::Acquire) {
            0 => {
                core::hint::spin_loop();
                continue;
            }
            READ_WARM => (0..PIECES / 2).filter(|&p| read(p) == Some(TAG_A | p)).count() as u64,
            READ_ALL => {
                // Bit p: piece p read block A (low half), block B (high).
                let mut seen = 0;
                for p in 0..PIECES {
                    match read(p) {
                        Some(v) if v == TAG_A | p => seen |= 1 << p,
                        Some(v) if v == TAG_B | p => seen |= 1 << (p + 32),
                        _ => {}
                    }
                }
                seen
            }
            HAMMER => {
                hammer(me);
                0
            }
            STORE => {
                store_loop(me);
                0
            }
            _ => u64::MAX,
        };
        RES[me].store(result, Ordering::Relaxed);
        CMD[me].store(0, Ordering::Release);
    }
}

/// Reads the pieces over and over until [`STOP`], classifying every read
/// begun after the flush.
fn hammer(me: usize) {
    while !STOP.load(Ordering::Acquire) {
        let after = FLUSHED.load(Ordering::Acquire);
        for p in 0..PIECES {
            let after = after || FLUSHED.load(Ordering::Acquire);
            let v = read(p);
            if !after {
                continue;
            }
            match v {
                None => &FAULTS,
                Some(v) if v == TAG_A | p => &STALE_OLD,
                Some(v) if v == TAG_REUSED | p => &STALE_NEW,
                Some(_) => &OTHER,
            }
            .fetch_add(1, Ordering::Relaxed);
        }
        if after {
            PASSES[me].fetch_add(1, Ordering::Release);
        } else {
            WARM[me].store(true, Ordering::Release);
        }
    }
}

/// Stores into the pieces over and over until [`STOP`], counting the
/// stores begun after the mprotect ([`FLUSHED`] set) that landed.
fn store_loop(me: usize) {
    while !STOP.load(Ordering::Acquire) {
        let after = FLUSHED.load(Ordering::Acquire);
        for p in 0..PIECES {
            let after = after || FLUSHED.load(Ordering::Acquire);
            let value = if after { STORED_AFTER } else { STORED_BEFORE } | p;
            let landed = crate::boot::probe_store_word(mmu::block_va() + piece_offset(p) + 8, value);
            if after {
                if landed { &LANDED } else { &STORE_FAULTS }.fetch_add(1, Ordering::Relaxed);
            }
        }
        if after {
            PASSES[me].fetch_add(1, Ordering::Release);
        } else {
            WARM[me].store(true, Ordering::Release);
        }
    }
}

fn wait(what: &str, done: impl Fn() -> bool) {
    let start = crate::now_us();
    while !done() {
        if crate::now_us() - start > 20_000_000 {
            crate::say!(
                "{} block unmap: timed out waiting for {what}\n",
                mmu::block_name()
            );
            crate::fatal("the block scenario's secondaries did not answer");
        }
        core::hint::spin_loop();
    }
}

fn ask(cpu: usize, cmd: u64) -> u64 {
    CMD[cpu].store(cmd, Ordering::Release);
    wait("a secondary's answer", || CMD[cpu].load(Ordering::Acquire) == 0);
    RES[cpu].load(Ordering::Relaxed)
}

fn map(pa: u64) {
    mmu::block_entry().store(block_descriptor(pa), Ordering::Release);
    a64::dsb_ishst();
    a64::isb();
}

/// Drops every CPU's translation of the block through the crate's real
/// flush (between the steps, whatever the flush under test).
fn real_flush() {
    if flush_tlb_page(tlb::arch(), tlb::mm(), mmu::block_va()).is_err() {
        crate::fatal("flush_tlb_page refused the block");
    }
}

/// The measurement: how many used and unused pieces a secondary still
/// reads from block A after the descriptor moved to block B with no TLBI.
fn measure(cpus: usize) {
    let (a, b) = (BLOCK_A.load(Ordering::Relaxed), BLOCK_B.load(Ordering::Relaxed));
    map(a);
    real_flush();
    let mut warm = 0;
    for cpu in 1..cpus {
        warm += ask(cpu, READ_WARM);
    }
    map(b);
    a64::dsb_ish();
    let (mut used_old, mut unused_old, mut unused_new, mut used_new) = (0, 0, 0, 0);
    for cpu in 1..cpus {
        let seen = ask(cpu, READ_ALL);
        let half = (1u64 << (PIECES / 2)) - 1;
        used_old += (seen & half).count_ones();
        unused_old += (seen >> (PIECES / 2) & half).count_ones();
        used_new += (seen >> 32 & half).count_ones();
        unused_new += (seen >> (32 + PIECES / 2) & half).count_ones();
    }
    let per = (cpus as u64 - 1) * PIECES / 2;
    crate::say!(
        "block: a {} block's translation kept across a descriptor change with no TLBI ({} other CPUs read \
         {warm} of {per} pieces of block A, the descriptor moved to block B): used pieces read the old block: \
         {used_old} of {per} (the new: {used_new}); unused pieces read the old block: {unused_old} of {per} (the new: \
         {unused_new})\n",
        mmu::block_name(),
        cpus - 1
    );
    mmu::block_entry().store(0, Ordering::Release);
    a64::dsb_ishst();
    real_flush();
}

/// The scenario with `arch` as the crate's `Arch`; true when it passed.
fn scenario<A: Arch>(arch: &A, cpus: usize, under_test: &str) -> bool {
    let a = BLOCK_A.load(Ordering::Relaxed);
    fill(a, TAG_A);
    map(a);
    let (before_dirty, before_ttu) = (DIRTIED.load(Ordering::Relaxed), tlb::TLB.stats());
    for cmd in &CMD[1..cpus] {
        cmd.store(HAMMER, Ordering::Release);
    }
    wait("the secondaries' first pass", || {
        (1..cpus).all(|c| WARM[c].load(Ordering::Acquire))
    });
    let mut batch = TlbFlushUnmapBatch::new();
    let flags = TtuFlags::BATCH_FLUSH | TtuFlags::IGNORE_ACCESS;
    let r = try_to_unmap(arch, &BlockRmap, Frame(a >> 12), flags, &mut batch);
    let on_add = tlb::TLB.stats().since(&before_ttu);
    let pending = batch.pending_pages();
    if batch.flush(arch).is_err() {
        crate::fatal("the block batch's flush failed");
    }
    FLUSHED.store(true, Ordering::Release);
    let d = tlb::TLB.stats().since(&before_ttu);
    // The block is free: reused at once.
    fill(a, TAG_REUSED);
    wait("the secondaries' passes after the flush", || {
        (1..cpus).all(|c| PASSES[c].load(Ordering::Acquire) >= PASSES_AFTER)
    });
    STOP.store(true, Ordering::Release);
    for cmd in &CMD[1..cpus] {
        wait("the secondaries to stop", || cmd.load(Ordering::Acquire) == 0);
    }
    let entry = mmu::block_entry().load(Ordering::Acquire);
    let dirtied = DIRTIED.load(Ordering::Relaxed) - before_dirty;
    let (old, new, other, faults) = (
        STALE_OLD.load(Ordering::Relaxed),
        STALE_NEW.load(Ordering::Relaxed),
        OTHER.load(Ordering::Relaxed),
        FAULTS.load(Ordering::Relaxed),
    );
    let passed = r == Ok(SwapResult::SuccessCached)
        && pending == 1
        && entry == 0
        && dirtied == 1
        && on_add.local_page_flushes == 1
        && d.local_page_flushes == 1
        && d.local_full_flushes == 0
        && d.shootdowns == 1
        && d.broadcasts == 1
        && d.ipis_sent == 0
        && old + new + other == 0
        && faults > 0;
    crate::say!(
        "scenario {} block unmap: {} (flush {under_test}; {} CPUs reading {PIECES} pieces; try_to_unmap: {:?}, pages \
         pending in the batch: {pending}, descriptor cleared: {}, dirty frames reported: {dirtied}; page TLBIs issued on add: {}, \
         in all: {}, full flushes: {}, shootdowns: {}, broadcasts: {}, IPIs: {}; after the flush and the reuse: \
         {faults} reads faulted; stale: {old} reads of the old block, {new} of the reused block, {other} other)\n",
        mmu::block_name(),
        if passed { "PASS" } else { "FAIL" },
        cpus,
        r,
        entry == 0,
        on_add.local_page_flushes,
        d.local_page_flushes,
        d.local_full_flushes,
        d.shootdowns,
        d.broadcasts,
        d.ipis_sent,
    );
    passed
}

/// Makes the secondaries run `cmd` until CPU 0's `change` is done and
/// they made their passes after it.
fn with_secondaries(cpus: usize, cmd: u64, change: impl FnOnce()) {
    FLUSHED.store(false, Ordering::Release);
    STOP.store(false, Ordering::Release);
    for c in 1..cpus {
        WARM[c].store(false, Ordering::Release);
        PASSES[c].store(0, Ordering::Release);
        CMD[c].store(cmd, Ordering::Release);
    }
    wait("the secondaries' first pass", || {
        (1..cpus).all(|c| WARM[c].load(Ordering::Acquire))
    });
    change();
    FLUSHED.store(true, Ordering::Release);
    wait("the secondaries' passes after the change", || {
        (1..cpus).all(|c| PASSES[c].load(Ordering::Acquire) >= PASSES_AFTER)
    });
    STOP.store(true, Ordering::Release);
    for cmd in &CMD[1..cpus] {
        wait("the secondaries to stop", || cmd.load(Ordering::Acquire) == 0);
    }
}

/// The mprotect of the whole block with `arch`; true when it passed.
fn mprotect<A: Arch>(arch: &A, cpus: usize, under_test: &str) -> bool {
    let a = BLOCK_A.load(Ordering::Relaxed);
    fill(a, TAG_A);
    map(a);
    real_flush();
    // The unmap's batch left the space marked as having had a batched
    // flush pending; the next mprotect would flush the whole ASID for it
    // first (as Linux's flush_tlb_batched_pending does). Settled here, so
    // that the counts below are the block's alone.
    if flush_tlb_batched_pending(tlb::arch(), tlb::mm()).is_err() {
        crate::fatal("flush_tlb_batched_pending failed");
    }
    let before = tlb::TLB.stats();
    let mut changed = None;
    with_secondaries(cpus, STORE, || {
        let Ok(range) = PageRange::new(mmu::block_va(), mmu::block_bytes() / 4096) else {
            crate::fatal("the block is not a page range");
        };
        let read_only = |pte: Pte| Pte(pte.0 & !PteFlags::WRITABLE.bits());
        changed = Some(change_protection(arch, &SPACE, range, read_only));
    });
    let d = tlb::TLB.stats().since(&before);
    let desc = mmu::block_entry().load(Ordering::Acquire);
    let still_block = desc & (DESC_VALID | DESC_TABLE_OR_PAGE) == DESC_VALID
        && desc & mmu::OUTPUT_ADDRESS == a
        && desc & mmu::AP_READ_ONLY != 0
        && desc & mmu::AF != 0;
    let late_words = (0..PIECES)
        .filter(|&p| {
            // SAFETY: as in `word`, one word further in the piece.
            let w = unsafe { &*((a + piece_offset(p) + 8) as *const AtomicU64) };
            w.load(Ordering::Acquire) & !0xffff == STORED_AFTER
        })
        .count();
    let (landed, faults) = (
        LANDED.load(Ordering::Relaxed),
        STORE_FAULTS.load(Ordering::Relaxed),
    );
    let passed = changed == Some(Ok(1))
        && still_block
        && d.local_page_flushes == 1
        && d.local_full_flushes == 0
        && d.shootdowns == 1
        && d.broadcasts == 1
        && d.ipis_sent == 0
        && landed == 0
        && late_words == 0
        && faults > 0;
    crate::say!(
        "scenario {} block mprotect: {} (flush {under_test}; {cpus} CPUs storing into {PIECES} pieces; entries changed: \
         {:?}, still a read-only block over A with its access flag: {still_block}; page TLBIs: {}, full \
         flushes: {}, shootdowns: {}, broadcasts: {}, IPIs: {}; stores begun after the call: {faults} faulted, \
         {landed} landed ({late_words} pieces hold a late store))\n",
        mmu::block_name(),
        if passed { "PASS" } else { "FAIL" },
        changed.unwrap_or(Ok(0)),
        d.local_page_flushes,
        d.local_full_flushes,
        d.shootdowns,
        d.broadcasts,
        d.ipis_sent,
    );
    mmu::block_entry().store(0, Ordering::Release);
    a64::dsb_ishst();
    real_flush();
    passed
}

/// Runs the measurement and the scenario; true when the scenario passed.
pub fn run(bootargs: &[u8], ram: (u64, u64)) -> bool {
    let cpus = crate::ONLINE.load(Ordering::Acquire);
    let block = mmu::block_bytes();
    let top = crate::crew::blocks_top(ram);
    BLOCK_A.store(top - 2 * block, Ordering::Relaxed);
    BLOCK_B.store(top - block, Ordering::Relaxed);
    fill(top - 2 * block, TAG_A);
    fill(top - block, TAG_B);
    JOB.store(true, Ordering::Release);
    measure(cpus);
    let a = *tlb::arch();
    let passed = if crate::has_word(bootargs, b"negative") {
        let skip = tlb::SkipTlbi(a);
        let unmap = scenario(&skip, cpus, "SKIPPED (negative control)");
        mprotect(&skip, cpus, "SKIPPED (negative control)") && unmap
    } else if crate::has_word(bootargs, b"negative-local") {
        let local = tlb::LocalTlbi(a);
        let unmap = scenario(&local, cpus, "on CPU 0 only (negative control)");
        mprotect(&local, cpus, "on CPU 0 only (negative control)") && unmap
    } else {
        let unmap = scenario(&a, cpus, "through the crate");
        mprotect(&a, cpus, "through the crate") && unmap
    };
    JOB.store(false, Ordering::Release);
    // Whatever the flush under test, nothing of the block stays cached.
    real_flush();
    passed
}
