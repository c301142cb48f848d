//! Ends the run through Arm semihosting, which QEMU serves when started
//! with `-semihosting`.
//!
//! On AArch64 a semihosting call is `HLT #0xF000` with the operation in w0
//! and its argument in x1. SYS_EXIT (0x18) takes, on AArch64, the address
//! of a two-word block: the reason, and a subcode. With the reason
//! ADP_Stopped_ApplicationExit (0x20026) QEMU exits with the subcode as its
//! own exit status; any other reason exits with status 1. Without
//! `-semihosting` the HLT is an undefined instruction: the exception
//! handler reports that instead of looping on it (see [`exit`]).

use core::sync::atomic::{AtomicBool, Ordering};

const SYS_EXIT: u32 = 0x18;
const ADP_STOPPED_APPLICATION_EXIT: u64 = 0x20026;

static EXITING: AtomicBool = AtomicBool::new(false);

/// Whether [`exit`] was called: an exception taken after that is the HLT
/// itself, refused because semihosting is off.
pub fn exiting() -> bool {
    EXITING.load(Ordering::Relaxed)
}

/// Stops QEMU with exit status `code`.
pub fn exit(code: u32) -> ! {
    EXITING.store(true, Ordering::Relaxed);
    let block = [ADP_STOPPED_APPLICATION_EXIT, u64::from(code)];
    // SAFETY: the semihosting SYS_EXIT call: w0 the operation, x1 the
    // address of its parameter block, which lives on this stack until the
    // call (which does not return under QEMU).
    unsafe {
        core::arch::asm!(
            "hlt #0xf000",
            in("w0") SYS_EXIT,
            in("x1") block.as_ptr(),
            options(nostack, readonly),
        );
    }
    crate::halt()
}
