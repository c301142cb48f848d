//! This kernel's use of the crate: the CPU table, the shootdown state, the
//! crate's aarch64 `Arch` built once the MMU setup is known, the test
//! address space's `MmTlbState`, the flush-IPI hook (which no flush may
//! call: only the teardown scenario's table-free sync, `ipi_sync`, uses
//! it), and the three deliberately broken `Arch` wrappers of the negative
//! controls.
//!
//! Every wrapper forwards [`Arch::base_page`] and the level-hinted
//! `flush_local_page_sized`/`broadcast_flush_page_sized` to the crate's
//! `Aarch64` (or breaks them the same way as the plain forms): the trait's
//! defaults would answer a 4 KiB base page on the 64 KiB granule run and
//! drop the FEAT_TTL hints, so a control would not test the flush a
//! passing run makes.

use core::mem::MaybeUninit;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tlb_batch::arch::aarch64::{Aarch64, Config, CpuTable};
use tlb_batch::{Arch, Asid, CpuId, CpuSet, MmTlbState, PageSize, TlbShootdown};

use crate::MAX_CPUS;

pub static CPUS: CpuTable = CpuTable::new();
pub static TLB: TlbShootdown = TlbShootdown::new();

static mut ARCH: MaybeUninit<Aarch64> = MaybeUninit::uninit();
static mut MM: MaybeUninit<MmTlbState> = MaybeUninit::uninit();
static READY: AtomicBool = AtomicBool::new(false);

/// Calls of [`send_sgi`] since boot.
pub static HOOK_CALLS: AtomicU64 = AtomicU64::new(0);
/// Per CPU: a flush request the hook asked it to serve.
static IPI_PENDING: [AtomicBool; MAX_CPUS] = [const { AtomicBool::new(false) }; MAX_CPUS];

/// The crate's flush-IPI hook. The broadcast path sends no IPI, so no
/// flush may call it; the shootdown scenarios fail if anything did. The
/// one caller is `ipi_sync`, which the teardown scenario's table-free
/// policy uses to wait for lockless page-table walkers (it flushes
/// nothing; see `teardown.rs`). It does not
/// raise an interrupt (this kernel sets up no GIC): it marks each target,
/// and every CPU serves its mark from each of its wait loops ([`poll`]),
/// which is where every CPU of this kernel spends its time between its own
/// crate calls. So a call is counted and served rather than left to hang.
fn send_sgi(targets: &CpuSet) {
    HOOK_CALLS.fetch_add(1, Ordering::SeqCst);
    for cpu in targets.iter() {
        if let Some(flag) = IPI_PENDING.get(cpu.index()) {
            flag.store(true, Ordering::SeqCst);
        }
    }
}

/// Serves a flush request [`send_sgi`] marked for this CPU, as its
/// interrupt handler would.
pub fn poll() {
    if !READY.load(Ordering::Acquire) {
        return;
    }
    let me = crate::cpu_index();
    if IPI_PENDING[me].swap(false, Ordering::SeqCst) {
        arch().flush_ipi_entry();
    }
}

/// Builds the `Arch` and the test address space (ASID `asid`, root the
/// kernel's tables), once, on the boot CPU, with its MMU on and before any
/// other CPU starts.
pub fn init(config: Config, asid: u16) -> Result<(), &'static str> {
    let asid = Asid::new(asid).map_err(|_| "the test ASID is not a user ASID")?;
    // SAFETY: this runs at EL1 with stage 1 translation on, and every CPU
    // loads the same TCR_EL1 (mmu::config), which `config` was read from;
    // QEMU's CPUs have no repeat-TLBI errata. Every CPU is registered in
    // CPUS before it starts (start_secondaries) and all of them are in the
    // machine's one Inner Shareable domain. The IPI hook marks its targets
    // and each CPU serves its mark from every loop it waits in (`poll`),
    // with interrupts masked as they always are here. The only user
    // address space is the test one, loaded only through switch_mm with a
    // non-zero ASID. Its descriptors that let writes through (AP[2] = 0)
    // are reported dirty by space::TestSpace and dirty_space::DirtySpace; clean
    // writable pages (dirty.rs) are mapped read-only with DBM, and no fault
    // handler makes an entry writable (the negative control
    // `negative-dirty` breaks this on purpose, for dirty.rs's pages only).
    // The statics are written here once, before READY is published and
    // before any other CPU runs.
    unsafe {
        (*core::ptr::addr_of_mut!(ARCH)).write(Aarch64::new(&CPUS, &TLB, send_sgi, config));
        (*core::ptr::addr_of_mut!(MM)).write(MmTlbState::new(asid, crate::mmu::root()));
    }
    READY.store(true, Ordering::Release);
    Ok(())
}

/// The crate's `Arch` for this machine.
pub fn arch() -> &'static Aarch64 {
    if !READY.load(Ordering::Acquire) {
        crate::fatal("the crate's Arch used before it was built");
    }
    // SAFETY: written once by `init` before READY was published
    // (release/acquire), never written again.
    unsafe { (*core::ptr::addr_of!(ARCH)).assume_init_ref() }
}

/// The test address space.
pub fn mm() -> &'static MmTlbState {
    if !READY.load(Ordering::Acquire) {
        crate::fatal("the test address space used before it was built");
    }
    // SAFETY: as in `arch`.
    unsafe { (*core::ptr::addr_of!(MM)).assume_init_ref() }
}

/// Brings the running CPU online in the crate (its TLB flushed) and loads
/// the test address space on it. `cpu` is the index it was registered
/// with.
pub fn cpu_up(cpu: usize) {
    match arch().bring_online() {
        Ok(id) if id.index() == cpu => {}
        Ok(_) => crate::fatal("a CPU came online under another index than it was registered with"),
        Err(_) => crate::fatal("a CPU refused to come online (not registered in the CpuTable)"),
    }
    // SAFETY: the root is the kernel's own table, which maps everything
    // this CPU runs from; this CPU had no user address space loaded.
    if unsafe { tlb_batch::switch_mm(arch(), None, mm()) }.is_err() {
        crate::fatal("switch_mm refused the test address space");
    }
}

/// Flush IPIs sent so far, as the crate counted them, and calls of the
/// hook.
pub fn ipis() -> (u64, u64) {
    (TLB.stats().ipis_sent, HOOK_CALLS.load(Ordering::SeqCst))
}

/// The negative control `negative`: the crate's shootdowns with every
/// invalidation skipped (the barriers stay, so the page-table stores are
/// published).
pub struct SkipTlbi(pub Aarch64);

/// The negative control `negative-local`: the crate's broadcast
/// invalidations replaced by the same invalidations on the calling CPU
/// only (`TLBI VAE1`, `TLBI ASIDE1`, `TLBI VMALLE1`).
pub struct LocalTlbi(pub Aarch64);

/// The negative control `negative-nodsb`: the crate's broadcast
/// invalidations issued as they are, but `broadcast_sync` without its
/// `DSB ISH`: nothing waits for the `TLBI ... IS` to complete on the other
/// CPUs before the flush returns (and the frames are freed). Only the
/// `ISB` stays. On hardware a CPU may then still use a dropped entry after
/// the shootdown returned; QEMU's TCG completes a broadcast TLBI on every
/// vCPU before the issuing one runs its next instruction, so the
/// emulator is expected to pass it (the script says so).
pub struct NoDsb(pub Aarch64);

/// The crate's aarch64 `Arch` with one capability turned off:
/// [`BATCH_BROADCAST_ON_ADD`](Arch::BATCH_BROADCAST_ON_ADD), so a batch
/// issues its pages' `TLBI VAE1IS` at its flush instead of as each page is
/// added (the trait's default; every instruction is the real
/// implementation's). The clean-write scenario (`dirty.rs`) unmaps through
/// it: on hardware a `TLBI` issued on add may not have reached another CPU
/// before that CPU's next store, which is the window the scenario probes,
/// but QEMU's TCG carries a `TLBI ... IS` out on every vCPU at once, so
/// with the invalidations issued on add no stale entry would be left to
/// store through. Issued at the flush, they leave the observers' entries
/// cached until then, as a slow invalidation would on hardware.
pub struct FlushTimeTlbi(pub Aarch64);

macro_rules! forward_arch {
    () => {
        forward_arch!(on_add: <Aarch64 as Arch>::BATCH_BROADCAST_ON_ADD);
    };
    (on_add: $on_add:expr) => {
        const CLEAN_WRITE_REWALK: bool = <Aarch64 as Arch>::CLEAN_WRITE_REWALK;
        const ACCESSED_CLEAR_NEEDS_FLUSH: bool = <Aarch64 as Arch>::ACCESSED_CLEAR_NEEDS_FLUSH;
        const FULL_FLUSH_CEILING: usize = <Aarch64 as Arch>::FULL_FLUSH_CEILING;
        const BROADCAST_INVALIDATE: bool = <Aarch64 as Arch>::BROADCAST_INVALIDATE;
        const BATCH_BROADCAST_ON_ADD: bool = $on_add;

        fn current_cpu(&self) -> Result<CpuId, tlb_batch::Error> {
            self.0.current_cpu()
        }
        fn online_cpus(&self) -> CpuSet {
            self.0.online_cpus()
        }
        fn shootdown_state(&self) -> &TlbShootdown {
            self.0.shootdown_state()
        }
        fn tagged_tlb(&self) -> bool {
            self.0.tagged_tlb()
        }
        fn fill_sets_accessed(&self) -> bool {
            self.0.fill_sets_accessed()
        }
        fn va_bits(&self) -> u32 {
            self.0.va_bits()
        }
        fn asid_bits(&self) -> u32 {
            self.0.asid_bits()
        }
        // The granule TCR_EL1 selects: without it a wrapper would answer
        // the trait's 4 KiB default on a 64 KiB kernel (ranges flushed
        // sixteen times too often, its tables refused as below the base
        // page).
        fn base_page(&self) -> PageSize {
            self.0.base_page()
        }
        fn send_flush_ipi(&self, targets: &CpuSet) {
            self.0.send_flush_ipi(targets)
        }
        unsafe fn switch_address_space(&self, asid: Asid, root: u64) {
            // SAFETY: forwarded from our caller unchanged.
            unsafe { self.0.switch_address_space(asid, root) }
        }
    };
}

/// The real implementation's local flushes.
macro_rules! forward_local {
    () => {
        fn flush_local_page(&self, asid: Asid, va: u64) {
            self.0.flush_local_page(asid, va)
        }
        fn flush_local_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
            self.0.flush_local_page_sized(asid, va, leaf)
        }
        fn flush_local_asid(&self, asid: Asid) {
            self.0.flush_local_asid(asid)
        }
        fn flush_local_all(&self, include_global: bool) {
            self.0.flush_local_all(include_global)
        }
    };
}

/// The real implementation's broadcast invalidations.
macro_rules! forward_broadcast {
    () => {
        fn broadcast_flush_page(&self, asid: Asid, va: u64) {
            self.0.broadcast_flush_page(asid, va)
        }
        fn broadcast_flush_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
            self.0.broadcast_flush_page_sized(asid, va, leaf)
        }
        fn broadcast_flush_asid(&self, asid: Asid) {
            self.0.broadcast_flush_asid(asid)
        }
        fn broadcast_flush_all(&self, include_global: bool) {
            self.0.broadcast_flush_all(include_global)
        }
    };
}

/// The real implementation's completion barrier.
macro_rules! forward_sync {
    () => {
        fn broadcast_sync(&self) {
            self.0.broadcast_sync()
        }
    };
}

// SAFETY: NOT sound, on purpose: the negative control shows that the
// scenarios notice a shootdown that invalidates nothing. Only the flush
// under test of a negative-control run goes through it; everything but
// the invalidations is the real implementation's.
unsafe impl Arch for SkipTlbi {
    forward_arch!();
    forward_sync!();
    fn flush_local_page(&self, _asid: Asid, _va: u64) {}
    fn flush_local_page_sized(&self, _asid: Asid, _va: u64, _leaf: Option<PageSize>) {}
    fn flush_local_asid(&self, _asid: Asid) {}
    fn flush_local_all(&self, _include_global: bool) {}
    fn broadcast_flush_page(&self, _asid: Asid, _va: u64) {}
    fn broadcast_flush_page_sized(&self, _asid: Asid, _va: u64, _leaf: Option<PageSize>) {}
    fn broadcast_flush_asid(&self, _asid: Asid) {}
    fn broadcast_flush_all(&self, _include_global: bool) {}
}

// SAFETY: NOT sound, on purpose: the negative control shows that the
// scenarios notice a shootdown whose invalidations reach the calling CPU
// only. Only the flush under test of a negative-control run goes through
// it; everything else is the real implementation's.
unsafe impl Arch for LocalTlbi {
    forward_arch!();
    forward_sync!();
    forward_local!();
    fn broadcast_flush_page(&self, asid: Asid, va: u64) {
        self.0.flush_local_page(asid, va)
    }
    fn broadcast_flush_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
        self.0.flush_local_page_sized(asid, va, leaf)
    }
    fn broadcast_flush_asid(&self, asid: Asid) {
        self.0.flush_local_asid(asid)
    }
    fn broadcast_flush_all(&self, include_global: bool) {
        self.0.flush_local_all(include_global)
    }
}

// SAFETY: every method is the real implementation's, whose contract
// `init` upholds; the one constant changed, BATCH_BROADCAST_ON_ADD, may be
// false on any hardware (it is the trait's default): the crate then
// issues a batch's invalidations at its flush, before it waits for them.
unsafe impl Arch for FlushTimeTlbi {
    forward_arch!(on_add: false);
    forward_sync!();
    forward_local!();
    forward_broadcast!();
}

// SAFETY: NOT sound, on purpose: the negative control shows what a
// broadcast flush that is not waited for does. Only the flush under test
// of the teardown scenario goes through it; every invalidation is the
// real implementation's, only the completion barrier is missing.
unsafe impl Arch for NoDsb {
    forward_arch!();
    forward_local!();
    forward_broadcast!();
    fn broadcast_sync(&self) {
        // The real one is `DSB ISH` then `ISB`: the DSB is skipped.
        tlb_batch::arch::aarch64::isb();
    }
}

/// The crate's aarch64 `Arch`, every call forwarded, counting the page
/// invalidations the crate asks for: the 64 KiB granule scenario
/// (`granule64.rs`) checks that a 64 KiB page costs one `TLBI`, not
/// sixteen, and which leaf size the crate passes as the level hint.
pub struct CountTlbi(pub Aarch64);

/// Page invalidations asked of [`CountTlbi`] (local or broadcast).
static PAGE_TLBIS: AtomicU64 = AtomicU64::new(0);
/// Those of them that came with a leaf size (a level hint to give).
static SIZED: AtomicU64 = AtomicU64::new(0);
/// The last leaf size given, in bytes (0: none yet).
static LEAF: AtomicU64 = AtomicU64::new(0);

impl CountTlbi {
    /// Clears the counters.
    pub fn reset() {
        for c in [&PAGE_TLBIS, &SIZED, &LEAF] {
            c.store(0, Ordering::SeqCst);
        }
    }

    /// Page invalidations, those with a leaf size, and the last leaf size
    /// in bytes, since [`reset`](Self::reset).
    pub fn counts() -> (u64, u64, u64) {
        (
            PAGE_TLBIS.load(Ordering::SeqCst),
            SIZED.load(Ordering::SeqCst),
            LEAF.load(Ordering::SeqCst),
        )
    }

    fn count(leaf: Option<PageSize>) {
        PAGE_TLBIS.fetch_add(1, Ordering::SeqCst);
        if let Some(size) = leaf {
            SIZED.fetch_add(1, Ordering::SeqCst);
            LEAF.store(size.bytes(), Ordering::SeqCst);
        }
    }
}

// SAFETY: every method is the real implementation's, whose contract
// `init` upholds, called with the same arguments; only counters change.
unsafe impl Arch for CountTlbi {
    forward_arch!();
    forward_sync!();
    fn flush_local_page(&self, asid: Asid, va: u64) {
        Self::count(None);
        self.0.flush_local_page(asid, va)
    }
    fn flush_local_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
        Self::count(leaf);
        self.0.flush_local_page_sized(asid, va, leaf)
    }
    fn flush_local_asid(&self, asid: Asid) {
        self.0.flush_local_asid(asid)
    }
    fn flush_local_all(&self, include_global: bool) {
        self.0.flush_local_all(include_global)
    }
    fn broadcast_flush_page(&self, asid: Asid, va: u64) {
        Self::count(None);
        self.0.broadcast_flush_page(asid, va)
    }
    fn broadcast_flush_page_sized(&self, asid: Asid, va: u64, leaf: Option<PageSize>) {
        Self::count(leaf);
        self.0.broadcast_flush_page_sized(asid, va, leaf)
    }
    fn broadcast_flush_asid(&self, asid: Asid) {
        self.0.broadcast_flush_asid(asid)
    }
    fn broadcast_flush_all(&self, include_global: bool) {
        self.0.broadcast_flush_all(include_global)
    }
}
