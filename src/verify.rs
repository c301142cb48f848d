//! Refusing a caller the crate's bookkeeping does not describe.
//!
//! A flush reaches the CPUs the crate knows to run an address space: the
//! online CPUs that loaded it through [`switch_mm`](crate::switch_mm). A
//! kernel that loads a root another way, or runs crate code on a CPU that
//! never came online, would get a flush that skips CPUs holding entries,
//! and frames freed under them. The checks here turn those set-ups into
//! typed errors: every crate function that starts a flush of an address
//! space runs [`space_caller`] first, with nothing changed yet, and a
//! kernel's debug build can run [`check_cpu_state`] wherever it likes (at
//! its timer tick, after its own context switch) to find a CPU that is
//! wrong although it calls nothing.

use crate::arch::Arch;
use crate::cpuset::CpuId;
use crate::lifecycle::online_caller;
use crate::mm::MmTlbState;
use crate::rmap::PageTable;
use crate::Error;

/// The calling CPU, for a crate function about to flush `mm` (or to defer
/// a flush of it): refused when `mm` belongs to another machine
/// ([`Error::OtherMachine`]: its CPU set names that machine's CPUs), when
/// the CPU is not online
/// ([`Error::CpuNotOnline`]), cannot be told (the error of
/// [`Arch::current_cpu`]), or has `mm`'s root loaded without the crate
/// counting it among the CPUs that run `mm` ([`Error::UntrackedRoot`],
/// where [`Arch::root_loaded`] can tell): the flush would skip its own
/// TLB.
pub(crate) fn space_caller<A: Arch>(arch: &A, mm: &MmTlbState) -> Result<CpuId, Error> {
    bind_machine(arch, mm)?;
    let me = online_caller(arch)?;
    check_space_on(arch, mm, me)?;
    Ok(me)
}

/// [`space_caller`]'s checks of `mm` for `me`, the calling CPU already
/// found online: for a walk over many spaces that asks the `Arch` for the
/// CPU once.
pub(crate) fn check_space_on<A: Arch>(arch: &A, mm: &MmTlbState, me: CpuId) -> Result<(), Error> {
    bind_machine(arch, mm)?;
    if !mm.is_kernel() && arch.root_loaded(mm.root()) == Some(true) && !tracked_on(arch, mm, me) {
        return Err(Error::UntrackedRoot { cpu: me.index() });
    }
    Ok(())
}

/// Refuses a user space's table whose own root is not its state's
/// ([`Error::RootMismatch`]): the state's CPU set counts the CPUs that
/// loaded the state's root, so flushes would skip those running these
/// tables.
pub(crate) fn check_table_root<S: PageTable + ?Sized>(space: &S) -> Result<(), Error> {
    let mm = space.tlb_state();
    match space.root() {
        Some(table) if !mm.is_kernel() && table != mm.root() => Err(Error::RootMismatch {
            table,
            state: mm.root(),
        }),
        _ => Ok(()),
    }
}

/// Whether the crate records `mm` as loaded on `cpu` and counts `cpu` in
/// its CPU set, as [`switch_mm`](crate::switch_mm) leaves them.
fn tracked_on<A: Arch>(arch: &A, mm: &MmTlbState, cpu: CpuId) -> bool {
    arch.shootdown_state().loaded_asid(cpu) == Some(mm.asid()) && mm.cpus().contains(cpu)
}

/// A check for a kernel's debug builds: whether the running CPU is set up
/// so that every flush of `current`, the address space the kernel believes
/// it runs, reaches it. Changes nothing, and costs a few loads and (on the
/// x86_64 and aarch64 `Arch`s) one read of CR3 or TTBR0_EL1; call it where
/// a mistake would show, for example at each timer tick and after the
/// kernel's own context switch.
///
/// `Ok` means: the CPU is online and known to [`Arch::current_cpu`]; the
/// `Arch` reports `current`'s root loaded, or cannot tell
/// ([`Arch::root_loaded`] answers `None`); and for a user space, the
/// crate records `current` as this CPU's loaded space and counts the CPU
/// among those that run it (what [`switch_mm`](crate::switch_mm) does).
///
/// Errors: [`Error::CpuNotOnline`], or the error of [`Arch::current_cpu`];
/// [`Error::NotLoaded`] when the `Arch` says another root is loaded than
/// `current`'s; [`Error::UntrackedRoot`] when a user space's root is
/// loaded (or cannot be told) but not through `switch_mm`.
pub fn check_cpu_state<A: Arch>(arch: &A, current: &MmTlbState) -> Result<(), Error> {
    let me = online_caller(arch)?;
    if arch.root_loaded(current.root()) == Some(false) {
        return Err(Error::NotLoaded { cpu: me.index() });
    }
    if !current.is_kernel() && !tracked_on(arch, current, me) {
        return Err(Error::UntrackedRoot { cpu: me.index() });
    }
    Ok(())
}

/// Binds `mm` to the machine of `arch` at its first use, and refuses it
/// ([`Error::OtherMachine`]) on another machine afterwards: its CPU set
/// and generation describe the first machine's CPUs, so a flush through
/// another machine's `Arch` would reach none of them. (Not in the loom
/// harness, whose models run one machine.)
pub(crate) fn bind_machine<A: Arch>(arch: &A, mm: &MmTlbState) -> Result<(), Error> {
    #[cfg(not(all(test, loom)))]
    {
        use crate::sync::Ordering;
        let id = arch.shootdown_state() as *const crate::TlbShootdown as u64;
        // A plain load first: every flush of the space asks, and a bound
        // space must not cost a locked instruction on a shared line each
        // time (the value only ever goes from 0 to one id).
        if mm.machine.load(Ordering::Relaxed) == id {
            return Ok(());
        }
        match mm
            .machine
            .compare_exchange(0, id, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => {}
            Err(bound) if bound == id => {}
            Err(_) => return Err(Error::OtherMachine),
        }
    }
    #[cfg(all(test, loom))]
    let _ = (arch, &mm.machine);
    Ok(())
}
