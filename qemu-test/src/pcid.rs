//! Scenarios for PCID-tagged TLBs, run only when the kernel uses PCIDs
//! (`pcid` on the command line, on a CPU with PCID and INVPCID).
//!
//! Two user address spaces, A and B, get their own PML4s. Both share the
//! kernel's mappings (PML4 entry 0, the boot tables) and map their own
//! frames, with different contents, at the same user addresses (PML4 entry
//! 1, 512 GiB). A kernel region at 5 GiB (boot PDPT entry 5) holds pages
//! that every address space sees: global ones and one that is not global.
//!
//! On a tagged TLB a `switch_mm` (CR3 with the NOFLUSH bit) keeps the
//! entries of the PCID it leaves, so a page unmapped without a flush is
//! still readable after switching away and back. The first scenario checks
//! that this is observable here; the ones that need it are skipped, with
//! the reason printed, when it is not (Bochs 2.7 accepts PCIDs and INVPCID
//! but flushes every non-global entry on each CR3 write). The others run
//! everywhere: a single-context flush of the loaded PCID, the bookkeeping
//! of which CPUs run an address space (a CPU that switched away is not
//! interrupted by its shootdown and catches up when it comes back), and
//! global kernel pages flushed whichever PCID is loaded.
//!
//! Negative control: `negative` (remote CPUs acknowledge without flushing,
//! and these scenarios skip their own local flushes). A control for the
//! catch-up at a switch would need a TLB that keeps a PCID's entries
//! across a CR3 write, which Bochs 2.7 does not have (the first scenario
//! measures it, and `generations.rs` too); the lazy catch-up, which needs
//! no switch, has its control in `generations.rs`.

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tlb_batch::{flush_tlb_page, flush_tlb_range, switch_mm, Arch, Asid, CpuId, MmTlbState, PageRange};

use crate::{arch, command, hw, mm, probe, report, COMMAND, IDLE, RESULT};

/// The AP command that runs one of this module's steps (`AP_STEP`'s
/// argument, in `ARG`).
pub const AP_STEP: u32 = 0x50;

/// User pages of A and B: PML4 entry 1.
const USER_BASE: u64 = 0x80_0000_0000;
/// Kernel pages: boot PDPT entry 5 (5 GiB).
const KERNEL_BASE: u64 = 0x1_4000_0000;
const USER_PAGES: usize = 8;
/// Frames behind A's pages, then B's, then the kernel pages'.
const FRAMES: u64 = 0x0300_0000;
const PRESENT_RW: u64 = 0x3;
const GLOBAL: u64 = 0x100;
const ASID_A: u16 = 6;
const ASID_B: u16 = 7;

#[repr(C, align(4096))]
struct Table([AtomicU64; 512]);

const fn empty() -> Table {
    Table([const { AtomicU64::new(0) }; 512])
}

/// One address space's private tables: PML4, and the PDPT, PD and PT that
/// map its user pages.
struct Tables {
    pml4: Table,
    pdpt: Table,
    pd: Table,
    pt: Table,
}

static TABLES: [Tables; 2] = [const {
    Tables {
        pml4: empty(),
        pdpt: empty(),
        pd: empty(),
        pt: empty(),
    }
}; 2];
static KERNEL_PD: Table = empty();
static KERNEL_PT: Table = empty();

static mut SPACES: core::mem::MaybeUninit<[MmTlbState; 2]> = core::mem::MaybeUninit::uninit();
static SPACES_READY: AtomicBool = AtomicBool::new(false);
static NEGATIVE: AtomicBool = AtomicBool::new(false);

fn space(i: usize) -> &'static MmTlbState {
    if !SPACES_READY.load(Ordering::Acquire) {
        crate::fatal("PCID address spaces used before they were set up");
    }
    // SAFETY: written once by the boot CPU before SPACES_READY was
    // published (release/acquire), never written again.
    unsafe { &(*core::ptr::addr_of!(SPACES)).assume_init_ref()[i] }
}

fn a() -> &'static MmTlbState {
    space(0)
}

fn b() -> &'static MmTlbState {
    space(1)
}

fn user_va(i: usize) -> u64 {
    USER_BASE + (i as u64) * 4096
}

fn kernel_va(i: usize) -> u64 {
    KERNEL_BASE + (i as u64) * 4096
}

/// What address space `s` (0 = A, 1 = B) keeps in user page `i`.
fn user_pattern(s: usize, i: usize) -> u64 {
    0xa5a5_0000_0000 + ((s as u64) << 16) + i as u64
}

fn kernel_pattern(i: usize) -> u64 {
    0x6b6b_0000_0000 + i as u64
}

fn table_addr(t: &Table) -> u64 {
    t.0.as_ptr() as u64
}

/// (Re)maps user page `i` of space `s` to its frame, pattern written.
fn map_user(s: usize, i: usize) {
    let phys = FRAMES + ((s * USER_PAGES + i) as u64) * 4096;
    // SAFETY: the frames from FRAMES on are identity-mapped RAM set aside
    // for these scenarios.
    unsafe { core::ptr::write_volatile(phys as *mut u64, user_pattern(s, i)) };
    TABLES[s].pt.0[i].store(phys | PRESENT_RW, Ordering::SeqCst);
}

/// (Re)maps kernel page `i`, global or not.
fn map_kernel(i: usize, global: bool) {
    let phys = FRAMES + ((2 * USER_PAGES + i) as u64) * 4096;
    // SAFETY: as in `map_user`.
    unsafe { core::ptr::write_volatile(phys as *mut u64, kernel_pattern(i)) };
    let flags = PRESENT_RW | if global { GLOBAL } else { 0 };
    KERNEL_PT.0[i].store(phys | flags, Ordering::SeqCst);
}

/// Builds A's and B's tables and the kernel region, and their states.
fn setup() {
    // SAFETY: the boot PML4 and PDPT are identity-mapped; PDPT entry 5 is
    // unused (the boot CPU runs this before any scenario uses it).
    let boot_pml4_0 = unsafe {
        let pdpt = core::ptr::addr_of!(crate::boot::pdpt) as *mut u64;
        core::ptr::write_volatile(pdpt.add(5), table_addr(&KERNEL_PD) | PRESENT_RW);
        core::ptr::read_volatile(core::ptr::addr_of!(crate::boot::pml4) as *const u64)
    };
    KERNEL_PD.0[0].store(table_addr(&KERNEL_PT) | PRESENT_RW, Ordering::SeqCst);
    for (s, t) in TABLES.iter().enumerate() {
        // Entry 0: the kernel's tables, shared (not copied).
        t.pml4.0[0].store(boot_pml4_0, Ordering::SeqCst);
        t.pml4.0[1].store(table_addr(&t.pdpt) | PRESENT_RW, Ordering::SeqCst);
        t.pdpt.0[0].store(table_addr(&t.pd) | PRESENT_RW, Ordering::SeqCst);
        t.pd.0[0].store(table_addr(&t.pt) | PRESENT_RW, Ordering::SeqCst);
        for i in 0..USER_PAGES {
            map_user(s, i);
        }
    }
    let asid = |v| Asid::new(v).unwrap_or(Asid::KERNEL);
    // SAFETY: written once, before SPACES_READY is published and before any
    // AP is told to use the spaces.
    unsafe {
        (*core::ptr::addr_of_mut!(SPACES)).write([
            MmTlbState::new(asid(ASID_A), table_addr(&TABLES[0].pml4)),
            MmTlbState::new(asid(ASID_B), table_addr(&TABLES[1].pml4)),
        ]);
    }
    SPACES_READY.store(true, Ordering::Release);
}

/// Switches this CPU from `prev` to `next`, interrupts off around it.
fn switch(prev: &MmTlbState, next: &MmTlbState) {
    hw::cli();
    // SAFETY: every root here (the boot PML4, A's, B's) maps the kernel
    // through the shared PML4 entry 0; `prev` is what this CPU has loaded
    // (callers switch in pairs, back to the boot space).
    let r = unsafe { switch_mm(&arch(), Some(prev), next) };
    hw::sti();
    if r.is_err() {
        crate::fatal("a PCID test address space's ASID does not fit");
    }
}

fn reads(va: u64, expected: u64) -> bool {
    probe(va) == Some(expected)
}

/// Scenario 1: an entry of a PCID that is not loaded survives a NOFLUSH
/// switch. Returns the scenario's result (`None`: skipped) and whether the
/// TLB is tagged.
fn tagged_switch() -> (Option<bool>, bool) {
    map_user(0, 0);
    switch(mm(), a());
    let warm = reads(user_va(0), user_pattern(0, 0));
    TABLES[0].pt.0[0].store(0, Ordering::SeqCst);
    switch(a(), b());
    let in_b = reads(user_va(0), user_pattern(1, 0));
    switch(b(), a());
    let stale = reads(user_va(0), user_pattern(0, 0));
    // Leave no stale entry behind: A is loaded, so this is INVLPG.
    arch().flush_local_page(a().asid(), user_va(0));
    switch(a(), mm());
    let detail = format_args!(
        "warmed in PCID {ASID_A}: {warm}, PCID {ASID_B} read its own frame: {in_b}, \
         unmapped page still readable after switching to PCID {ASID_B} and back: {stale}"
    );
    let name = "pcid tagged switch keeps the other PCID's entries";
    if warm && in_b && stale {
        (Some(report(name, true, detail)), true)
    } else if warm && in_b {
        skip(
            name,
            format_args!(
                "{detail}; this CPU drops non-global entries on every CR3 write, so staleness \
                 in a PCID that is not loaded cannot be observed"
            ),
        );
        (None, false)
    } else {
        (Some(report(name, false, detail)), false)
    }
}

fn skip(name: &str, why: core::fmt::Arguments<'_>) {
    crate::say(format_args!("scenario {name}: SKIP ({why})\n"));
}

/// Scenario 2a: the crate's flush of a whole ASID while it is loaded
/// (INVPCID single-context on the current PCID; `flush_tlb_mm` sends the
/// same to remote CPUs) removes its entries.
fn flush_loaded_asid() -> bool {
    map_user(0, 4);
    switch(mm(), a());
    let warm = reads(user_va(4), user_pattern(0, 4));
    TABLES[0].pt.0[4].store(0, Ordering::SeqCst);
    let stale_before = probe(user_va(4)).is_some();
    if !NEGATIVE.load(Ordering::Relaxed) {
        arch().flush_local_asid(a().asid());
    }
    let stale = probe(user_va(4)).is_some();
    arch().flush_local_asid(a().asid());
    switch(a(), mm());
    report(
        "pcid single-context flush of the loaded PCID",
        warm && stale_before && !stale,
        format_args!(
            "warmed: {warm}, readable after the unmap before the flush: {stale_before}, \
             after INVPCID single-context: {stale}"
        ),
    )
}

/// Scenario 2b: the crate's local flushes of a PCID that is not loaded
/// (INVPCID individual address, then single context) remove its entries.
fn flush_unloaded(tagged: bool) -> Option<bool> {
    let x = arch();
    let negative = NEGATIVE.load(Ordering::Relaxed);
    map_user(0, 1);
    map_user(0, 2);
    switch(mm(), a());
    let warm = reads(user_va(1), user_pattern(0, 1)) && reads(user_va(2), user_pattern(0, 2));
    TABLES[0].pt.0[1].store(0, Ordering::SeqCst);
    TABLES[0].pt.0[2].store(0, Ordering::SeqCst);
    switch(a(), b());
    if !negative {
        // A is not loaded: INVPCID (individual address) for page 1 only.
        x.flush_local_page(a().asid(), user_va(1));
    }
    switch(b(), a());
    let page_stale = probe(user_va(1)).is_some();
    // Page 2 was not named: still readable, so the address flush was not
    // a whole-PCID flush and staleness is visible here.
    let other_kept = probe(user_va(2)).is_some();
    switch(a(), b());
    if !negative {
        // A is not loaded: INVPCID (single context).
        x.flush_local_asid(a().asid());
    }
    switch(b(), a());
    let asid_stale = probe(user_va(2)).is_some();
    x.flush_local_asid(a().asid());
    switch(a(), mm());
    let name = "pcid flush of a PCID that is not loaded";
    if !tagged {
        skip(
            name,
            format_args!(
                "INVPCID address and single-context ran without a fault; their effect is not \
                 observable on an untagged TLB"
            ),
        );
        return None;
    }
    Some(report(
        name,
        warm && !page_stale && other_kept && !asid_stale,
        format_args!(
            "warmed: {warm}, stale after INVPCID address: {page_stale}, the page it did not \
             name still cached: {other_kept}, stale after INVPCID single-context: {asid_stale}"
        ),
    ))
}

/// AP steps.
const STEP_ENTER_A_LEAVE_TO_B: u64 = 1;
const STEP_BACK_TO_A_AND_PROBE: u64 = 2;
const STEP_PROBE_KERNEL_PAGE_1: u64 = 3;

/// Runs the step in `ARG[cpu]` on an AP (called from the AP loop).
pub fn ap_step(cpu: usize) {
    let step = crate::ARG[cpu].load(Ordering::SeqCst);
    let result = match step {
        STEP_ENTER_A_LEAVE_TO_B => {
            switch(mm(), a());
            let warm = reads(user_va(3), user_pattern(0, 3));
            switch(a(), b());
            u64::from(warm)
        }
        STEP_BACK_TO_A_AND_PROBE => {
            switch(b(), a());
            let stale = probe(user_va(3)).is_some();
            arch().flush_local_asid(a().asid());
            switch(a(), mm());
            u64::from(stale)
        }
        STEP_PROBE_KERNEL_PAGE_1 => u64::from(reads(kernel_va(1), kernel_pattern(1))),
        _ => 0,
    };
    RESULT[cpu].store(result, Ordering::SeqCst);
    COMMAND[cpu].store(IDLE, Ordering::SeqCst);
}

/// Scenario 3: an AP that cached A and switched to B has left A's CPU
/// set (flush generations): a shootdown of A does not interrupt it, and
/// when it switches back it flushes A's PCID first (a catch-up), so it
/// reads no stale entry. Whether that read could fail at all depends on
/// the TLB keeping A's entries across the switch (`tagged`).
fn remote_unloaded(tagged: bool) -> bool {
    let ap = 1;
    let ap_id = CpuId::new(ap).unwrap_or(CpuId::BOOT);
    map_user(0, 3);
    command(ap..ap + 1, AP_STEP, STEP_ENTER_A_LEAVE_TO_B);
    let warm = RESULT[ap].load(Ordering::SeqCst) == 1;
    let left = !a().cpus().contains(ap_id);
    let taken_before = crate::IPIS_TAKEN[ap].load(Ordering::SeqCst);
    TABLES[0].pt.0[3].store(0, Ordering::SeqCst);
    let r = flush_tlb_page(&arch(), a(), user_va(3));
    let taken = crate::IPIS_TAKEN[ap].load(Ordering::SeqCst) - taken_before;
    let catch_ups = crate::TLB.stats().catch_ups;
    command(ap..ap + 1, AP_STEP, STEP_BACK_TO_A_AND_PROBE);
    let caught_up = crate::TLB.stats().catch_ups - catch_ups;
    let stale = RESULT[ap].load(Ordering::SeqCst) == 1;
    let skipped = r.is_ok_and(|r| r.remote_cpus == 0) && taken == 0;
    let ok = warm && left && skipped && caught_up == 1 && !stale;
    report(
        "pcid a CPU that switched away is skipped and catches up",
        ok,
        format_args!(
            "AP {ap} warmed A: {warm}, left A's CPU set when it switched to B: {left}, IPIs it took: {taken}, \
             catch-ups when it switched back: {caught_up}, stale after switching back: {stale}{}",
            if tagged {
                ""
            } else {
                " (this TLB drops PCID entries at a CR3 write: the stale check cannot fail here)"
            }
        ),
    )
}

/// Scenario 4a: global kernel entries, cached while A was loaded, are
/// removed by `flush_local_page(Asid::KERNEL, ..)` while B is loaded, and by
/// a kernel-range shootdown on an AP.
fn kernel_global() -> bool {
    let x = arch();
    let negative = NEGATIVE.load(Ordering::Relaxed);
    map_kernel(0, true);
    map_kernel(1, true);
    switch(mm(), a());
    let warm = reads(kernel_va(0), kernel_pattern(0));
    switch(a(), b());
    KERNEL_PT.0[0].store(0, Ordering::SeqCst);
    if !negative {
        x.flush_local_page(Asid::KERNEL, kernel_va(0));
    }
    let stale_b = probe(kernel_va(0)).is_some();
    switch(b(), a());
    let stale_a = probe(kernel_va(0)).is_some();
    switch(a(), mm());

    // Remote: every AP caches page 1 in its own (boot) address space.
    let aps = crate::aps();
    command(aps.clone(), AP_STEP, STEP_PROBE_KERNEL_PAGE_1);
    let warm_remote = aps.clone().all(|c| RESULT[c].load(Ordering::SeqCst) == 1);
    KERNEL_PT.0[1].store(0, Ordering::SeqCst);
    // The kernel's address space: its flushes reach every online CPU and
    // name Asid::KERNEL (the root is not used for flushing).
    let kmm = MmTlbState::kernel(mm().root());
    let flushed = PageRange::page(kernel_va(1)).is_ok_and(|range| flush_tlb_range(&x, &kmm, range).is_ok());
    command(aps.clone(), AP_STEP, STEP_PROBE_KERNEL_PAGE_1);
    let stale_remote: u64 = aps.map(|c| RESULT[c].load(Ordering::SeqCst)).sum();
    x.flush_local_all(true);
    report(
        "pcid global kernel page flushed in every PCID",
        warm && warm_remote && flushed && !stale_b && !stale_a && stale_remote == 0,
        format_args!(
            "stale in PCID {ASID_B} (loaded): {stale_b}, in PCID {ASID_A}: {stale_a}, \
             APs still reading after the kernel-range shootdown: {stale_remote}"
        ),
    )
}

/// Scenario 4b: a kernel page that is NOT global (as with page-table
/// isolation), cached while A was loaded, flushed with
/// `flush_local_page(Asid::KERNEL, ..)` while B is loaded: after switching
/// back to A it must fault. INVLPG drops non-global entries of the current
/// PCID only, so this needs the kernel flush to reach every PCID.
fn kernel_not_global(tagged: bool) -> Option<bool> {
    let x = arch();
    map_kernel(2, false);
    switch(mm(), a());
    let warm = reads(kernel_va(2), kernel_pattern(2));
    switch(a(), b());
    KERNEL_PT.0[2].store(0, Ordering::SeqCst);
    if !NEGATIVE.load(Ordering::Relaxed) {
        x.flush_local_page(Asid::KERNEL, kernel_va(2));
    }
    switch(b(), a());
    let stale = probe(kernel_va(2)).is_some();
    x.flush_local_all(true);
    switch(a(), mm());
    let name = "pcid non-global kernel page flushed in every PCID";
    if !tagged {
        skip(
            name,
            format_args!("needs a tagged TLB: the switch back would flush the entry anyway"),
        );
        return None;
    }
    Some(report(
        name,
        warm && !stale,
        format_args!(
            "warmed in PCID {ASID_A}: {warm}, flushed while PCID {ASID_B} was loaded, stale in \
             PCID {ASID_A}: {stale}{}",
            if stale {
                "; INVLPG drops a non-global entry of the current PCID only, so a kernel page \
                 flush must reach every PCID"
            } else {
                ""
            }
        ),
    ))
}

/// Runs the PCID scenarios (when PCIDs are in use); returns (passed,
/// failed). `line` is the kernel command line.
pub fn run(line: &[u8]) -> (usize, usize) {
    if !arch().uses_pcid() {
        return (0, 0);
    }
    NEGATIVE.store(crate::has_word(line, b"negative"), Ordering::Relaxed);
    setup();
    let (first, tagged) = tagged_switch();
    let results = [
        first,
        Some(flush_loaded_asid()),
        flush_unloaded(tagged),
        Some(remote_unloaded(tagged)),
        Some(kernel_global()),
        kernel_not_global(tagged),
    ];
    let passed = results.iter().filter(|r| **r == Some(true)).count();
    let failed = results.iter().filter(|r| **r == Some(false)).count();
    (passed, failed)
}
