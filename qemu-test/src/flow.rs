//! The APs' side of the flow scenarios (writers, a lockless page-table
//! walker, the storm) and the helpers the scenarios share: loading an
//! address space on every CPU, starting and stopping the APs' loops,
//! checked stores.
//!
//! A *writer* AP stores increasing sequence numbers into its own word
//! (offset `8 * cpu`) of every test page, round after round, each store
//! through [`write_probe`] so that a fault (unmapped, migration entry,
//! write-protected) is survived and counted. After a store completes it
//! records the value in [`LAST`], so the scenario knows the last write of
//! every CPU to every page that the hardware accepted; a store that
//! completes after the scenario published [`PHASE`] `= 1` (read before the
//! store) counts as late in [`LATE`]. Before each store it reads its word
//! back: a read that does not fault must return that last store, or it
//! counts in [`BAD_READS`] (a stale read of a freed, poisoned frame, or of
//! a copy that missed a write).

use core::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use tlb_batch::{shootdown, switch_mm, Arch, CpuSet, MmTlbState, PageTable};

use crate::paging::{self, Space, POISON};
use crate::{arch, hw, me, MAX_CPUS};

/// AP commands of the flow scenarios (the first ones are in main.rs).
pub const WRITER: u32 = 10;
/// Walk the page tables of [`WALK_ROOT`] locklessly, interrupts off.
pub const WALKER: u32 = 11;
/// Shoot at every other CPU, [`crate::ARG`] rounds, interrupts off.
pub const STORM: u32 = 12;
/// Load the address space whose `MmTlbState` is at [`crate::ARG`] (0: the
/// main one) with `switch_mm`.
pub const SWITCH: u32 = 13;
/// Drop every TLB entry (real flush), between scenarios.
pub const SCRUB: u32 = 14;
/// Told to end a loop; the AP answers with `IDLE`.
pub const STOP: u32 = 15;

/// Most pages a writer covers.
pub const MAX_PAGES: usize = 64;

/// Where the writers write: page `p` is at
/// `base + (p / per_table) * 2 MiB + (p % per_table) * 4 KiB`.
pub static WRITE_BASE: AtomicU64 = AtomicU64::new(0);
/// How many pages the writers cover.
pub static WRITE_PAGES: AtomicUsize = AtomicUsize::new(0);
/// Pages per leaf table in the writers' layout.
pub static PER_TABLE: AtomicUsize = AtomicUsize::new(512);
/// 0 while writes are allowed; 1 once the scenario forbade them.
pub static PHASE: AtomicU32 = AtomicU32::new(0);

/// The last value each CPU stored into each page without a fault.
pub static LAST: [[AtomicU64; MAX_PAGES]; MAX_CPUS] =
    [const { [const { AtomicU64::new(0) }; MAX_PAGES] }; MAX_CPUS];
/// Stores that completed after [`PHASE`] was 1.
pub static LATE: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Reads that returned something else than the CPU's last store.
pub static BAD_READS: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Stores that faulted.
pub static FAULTS: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
/// Full passes over the pages (writers) or walks (walker).
pub static PASSES: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];
static SEQ: [AtomicU64; MAX_CPUS] = [const { AtomicU64::new(0) }; MAX_CPUS];

/// The root the walker walks, and its pages (same layout as the writers').
pub static WALK_ROOT: AtomicU64 = AtomicU64::new(0);
/// Walks that read a table freed while the walk was under way.
pub static WALK_CAUGHT: AtomicU64 = AtomicU64::new(0);
/// Walks that reached a leaf table (and read a PTE from it).
pub static WALK_LEAVES: AtomicU64 = AtomicU64::new(0);
/// The level the walker is holding (4: PML4 ... 1: PT), 0 between walks.
/// The teardown scenario starts a teardown only once the walker holds a
/// page directory or page table it read from the linked tables, so that
/// every teardown races a walk at its most exposed moment.
pub static WALK_LEVEL: AtomicU32 = AtomicU32::new(0);
/// Pause iterations the walker holds each level (interrupts off).
pub const WALK_HOLD: u64 = 20000;

/// Storm participants ready; the boot CPU starts them all at once.
pub static STORM_READY: AtomicUsize = AtomicUsize::new(0);
/// Set by the boot CPU when every participant is ready.
pub static STORM_GO: AtomicU32 = AtomicU32::new(0);

/// The address space each CPU has loaded (its `MmTlbState`'s address; 0:
/// the main one).
static LOADED: [AtomicUsize; MAX_CPUS] = [const { AtomicUsize::new(0) }; MAX_CPUS];

/// The address of writer page `p`.
pub fn page_va(p: usize) -> u64 {
    let per = PER_TABLE.load(Ordering::Relaxed).max(1);
    WRITE_BASE.load(Ordering::Relaxed) + (p / per) as u64 * 0x20_0000 + (p % per) as u64 * 4096
}

/// Stores `value` at `va`; `false` if the store page-faulted (it then did
/// not happen).
pub fn write_probe(va: u64, value: u64) -> bool {
    let slot = &crate::FIXUP[me()];
    let faulted: u64;
    // SAFETY: the page-fault handler resumes at label 2 when `slot` holds
    // its address, so a faulting store cannot crash; `va` is a test page
    // of the loaded space, never memory the kernel itself uses.
    unsafe {
        core::arch::asm!(
            "lea {tmp}, [rip + 2f]",
            "mov qword ptr [{slot}], {tmp}",
            "mov qword ptr [{addr}], {val}",
            "mov qword ptr [{slot}], 0",
            "xor {flag:e}, {flag:e}",
            "jmp 3f",
            "2:",
            "mov {flag:e}, 1",
            "3:",
            tmp = out(reg) _,
            slot = in(reg) slot.as_ptr(),
            val = in(reg) value,
            addr = in(reg) va,
            flag = out(reg) faulted,
            options(nostack),
        );
    }
    faulted == 0
}

fn space_of(addr: usize) -> &'static MmTlbState {
    if addr == 0 {
        crate::mm()
    } else {
        // SAFETY: non-zero values come from `load_mm`, which passes the
        // address of an `MmTlbState` that lives for the whole run.
        unsafe { &*(addr as *const MmTlbState) }
    }
}

/// Loads the address space whose TLB state is at `addr` (0: the main one)
/// on the running CPU.
fn switch_to(addr: usize) {
    let cpu = me();
    let prev = space_of(LOADED[cpu].load(Ordering::SeqCst));
    let next = space_of(addr);
    hw::cli();
    // SAFETY: every space's PML4 shares the kernel's identity mapping
    // (entry 0), so the running code stays mapped; `prev` is what this CPU
    // loaded last (recorded in LOADED); interrupts are off.
    if unsafe { switch_mm(&arch(), Some(prev), next) }.is_err() {
        crate::fatal("switch_mm refused a test address space");
    }
    LOADED[cpu].store(addr, Ordering::SeqCst);
    hw::sti();
}

fn writer(cpu: usize) {
    let pages = WRITE_PAGES.load(Ordering::SeqCst).min(MAX_PAGES);
    while crate::COMMAND[cpu].load(Ordering::SeqCst) == WRITER {
        for (p, last) in LAST[cpu].iter().enumerate().take(pages) {
            let va = page_va(p) + 8 * cpu as u64;
            // A read that goes through must return this CPU's last store
            // there (its own word: nobody else writes it, and a copy or
            // write-out must have kept it); a freed frame reads as poison.
            if crate::probe(va).is_some_and(|v| v != last.load(Ordering::SeqCst)) {
                BAD_READS[cpu].fetch_add(1, Ordering::SeqCst);
            }
            let seq = SEQ[cpu].fetch_add(1, Ordering::Relaxed) + 1;
            let forbidden = PHASE.load(Ordering::SeqCst) == 1;
            if write_probe(va, seq) {
                last.store(seq, Ordering::SeqCst);
                if forbidden {
                    LATE[cpu].fetch_add(1, Ordering::SeqCst);
                }
            } else {
                FAULTS[cpu].fetch_add(1, Ordering::Relaxed);
            }
        }
        PASSES[cpu].fetch_add(1, Ordering::SeqCst);
    }
}

/// One lockless walk to `va`'s leaf entry, interrupts off (the caller's),
/// holding each level a while; returns whether it read a freed table.
///
/// A table counts as freed under the walk when an entry read from it is
/// [`POISON`], or when its free count changed since the walk reached it.
/// Every table the walk went through is checked again at the end, before
/// the caller turns interrupts back on: a table freed at any moment of the
/// walk is caught, whatever level the walk had got to.
fn walk_once(root: u64, va: u64) -> bool {
    let mut seen = [(0u64, 0u64); 4];
    let mut depth = 0;
    let mut table = root;
    let mut freed = false;
    for level in (1..=4).rev() {
        let slot = table + paging::index(va, level) * 8;
        seen[depth] = (slot, paging::generation(table));
        depth += 1;
        if level == 1 {
            WALK_LEAVES.fetch_add(1, Ordering::Relaxed);
        }
        let entry = paging::word(slot).load(Ordering::SeqCst);
        if entry == POISON {
            freed = true;
            break;
        }
        WALK_LEVEL.store(level, Ordering::SeqCst);
        hw::spin(WALK_HOLD);
        if entry & 1 == 0 {
            break;
        }
        if level == 1 {
            break;
        }
        table = paging::entry_addr(entry);
    }
    WALK_LEVEL.store(0, Ordering::SeqCst);
    freed
        || seen[..depth].iter().any(|&(slot, generation)| {
            paging::word(slot).load(Ordering::SeqCst) == POISON
                || paging::generation(slot & !0xfff) != generation
        })
}

fn walker(cpu: usize) {
    let root = WALK_ROOT.load(Ordering::SeqCst);
    let mut p = 0;
    while crate::COMMAND[cpu].load(Ordering::SeqCst) == WALKER {
        let pages = WRITE_PAGES.load(Ordering::SeqCst).max(1);
        hw::cli();
        if walk_once(root, page_va(p % pages)) {
            WALK_CAUGHT.fetch_add(1, Ordering::SeqCst);
        }
        hw::sti();
        p += 1;
        PASSES[cpu].fetch_add(1, Ordering::SeqCst);
    }
}

/// Every online CPU but the running one.
pub fn others() -> CpuSet {
    let a = arch();
    a.online_cpus()
        .difference(&CpuSet::single(a.current_cpu().expect("registered")))
}

/// The storm loop of one CPU: wait for the start, then `rounds`
/// shootdowns at every other CPU with interrupts off; returns how many
/// completed.
pub fn storm_rounds(rounds: u64) -> u64 {
    STORM_READY.fetch_add(1, Ordering::SeqCst);
    while STORM_GO.load(Ordering::SeqCst) == 0 {
        core::hint::spin_loop();
    }
    let targets = others();
    let cpu = me() as u64;
    // The negative control skips the flushes an initiator does for others'
    // requests while it waits, too (in the storm that is most of them).
    let negative = crate::NEGATIVE.load(Ordering::Relaxed);
    hw::cli();
    let mut ok = 0;
    for r in 0..rounds {
        let request = crate::one_page(((r + cpu) % 8) as usize);
        let done = if negative {
            shootdown(&crate::SkipFlush(arch()), &targets, &request)
        } else {
            shootdown(&arch(), &targets, &request)
        };
        ok += u64::from(done.is_ok());
    }
    hw::sti();
    ok
}

/// Runs a flow command on an AP (called from its command loop).
pub fn ap_command(cpu: usize, cmd: u32) {
    match cmd {
        WRITER => writer(cpu),
        WALKER => walker(cpu),
        STORM => {
            let ok = storm_rounds(crate::ARG[cpu].load(Ordering::SeqCst));
            crate::RESULT[cpu].store(ok, Ordering::SeqCst);
        }
        SWITCH => switch_to(crate::ARG[cpu].load(Ordering::SeqCst) as usize),
        SCRUB => arch().flush_local_all(true),
        _ => {}
    }
    // A loop ends when told (its command was replaced by STOP); a one-shot
    // command ends here. Either way the AP reports idle.
    crate::COMMAND[cpu].store(crate::IDLE, Ordering::SeqCst);
}

/// Starts `cmd` on each CPU of `cpus` without waiting.
pub fn start(cpus: impl Iterator<Item = usize>, cmd: u32, arg: u64) {
    for c in cpus {
        crate::ARG[c].store(arg, Ordering::SeqCst);
        crate::RESULT[c].store(0, Ordering::SeqCst);
        crate::COMMAND[c].store(cmd, Ordering::SeqCst);
    }
}

/// Ends the loops of `cpus` and waits until each is idle.
pub fn stop(cpus: impl Iterator<Item = usize> + Clone) {
    for c in cpus.clone() {
        crate::COMMAND[c].store(STOP, Ordering::SeqCst);
    }
    for c in cpus {
        while crate::COMMAND[c].load(Ordering::SeqCst) != crate::IDLE {
            core::hint::spin_loop();
        }
    }
}

/// Waits until every CPU of `cpus` made `n` more passes of its loop
/// (fatal after a very long time: a loop that stopped is a test bug).
pub fn wait_passes(cpus: impl Iterator<Item = usize> + Clone, n: u64) {
    let start: [u64; MAX_CPUS] = core::array::from_fn(|c| PASSES[c].load(Ordering::SeqCst));
    let mut spins = 0u64;
    while !cpus
        .clone()
        .all(|c| PASSES[c].load(Ordering::SeqCst) >= start[c] + n)
    {
        spins += 1;
        if spins > 4_000_000_000 {
            crate::fatal("an AP loop made no progress");
        }
        core::hint::spin_loop();
    }
}

/// Loads `space` (None: the main address space) on the boot CPU and on
/// every CPU of `cpus`.
pub fn load(space: Option<&'static Space>, cpus: impl Iterator<Item = usize> + Clone) {
    load_mm(space.map(|s| s.tlb_state()), cpus);
}

/// Loads the address space of `mm` (None: the main one) on the boot CPU
/// and on every CPU of `cpus`: for spaces whose page table is not a
/// [`Space`] (the x86_64-crate scenario's).
pub fn load_mm(mm: Option<&'static MmTlbState>, cpus: impl Iterator<Item = usize> + Clone) {
    let addr = mm.map_or(0, |m| m as *const MmTlbState as usize);
    switch_to(addr);
    crate::command(cpus, SWITCH, addr as u64);
}

/// Drops every TLB entry on every CPU with a real flush, so that what a
/// negative control left cached cannot reach the next scenario.
pub fn scrub() {
    arch().flush_local_all(true);
    crate::command(crate::aps(), SCRUB, 0);
}

/// Resets the writers' bookkeeping for a scenario over `pages` pages at
/// `base` (`per_table` pages in each 2 MiB).
pub fn reset(base: u64, pages: usize, per_table: usize) {
    WRITE_BASE.store(base, Ordering::SeqCst);
    WRITE_PAGES.store(pages, Ordering::SeqCst);
    PER_TABLE.store(per_table, Ordering::SeqCst);
    PHASE.store(0, Ordering::SeqCst);
    for c in 0..MAX_CPUS {
        LATE[c].store(0, Ordering::SeqCst);
        BAD_READS[c].store(0, Ordering::SeqCst);
        FAULTS[c].store(0, Ordering::SeqCst);
        for last in &LAST[c] {
            last.store(0, Ordering::SeqCst);
        }
    }
}

/// Sum of a per-CPU counter over `cpus`.
pub fn sum(counter: &[AtomicU64; MAX_CPUS], cpus: impl Iterator<Item = usize>) -> u64 {
    cpus.map(|c| counter[c].load(Ordering::SeqCst)).sum()
}

/// Frames (physical) whose poison is broken among `frames`.
pub fn broken(frames: &[u64]) -> usize {
    frames
        .iter()
        .filter(|&&pa| paging::poison_broken(pa) != 0)
        .count()
}
