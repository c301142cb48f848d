//! Drives the mock machine with a sequence of operations decoded from the
//! input (see `tlb_batch::arch::mock::ops`: any CPU initiating, two user
//! address spaces and the kernel's, low-level and typed batches, the
//! reclaim, migration, mprotect and teardown drivers, a frame pool filled by
//! pooled reclaims and emptied by timer ticks and pool flushes, injected
//! flush failures and their retries, CPUs going offline and back, hostile
//! input, and a huge address space whose 2 MiB regions are mapped huge or
//! small, split and promoted through the crate, unmapped, protected,
//! migrated and torn down while CPUs cache 2 MiB entries beside 4 KiB
//! ones).
//! The first byte picks untagged or tagged TLBs (bit 0) and x86 or arm64
//! hardware (bit 1: arm64, whose batched unmaps invalidate as pages are
//! added); the sequence runs batched, with the oracle checking the safety
//! contract after every step, and the sequence made blind to accessed bits
//! must end in the same page states batched and unbatched (`check_on`).

#![no_main]

use libfuzzer_sys::fuzz_target;
use tlb_batch::arch::mock::ops::{check_on, ops_from_bytes, Hardware};

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let ops = ops_from_bytes(rest);
    let hardware = if kind & 2 == 0 {
        Hardware::X86
    } else {
        Hardware::Arm64
    };
    if let Err(f) = check_on(&ops, kind & 1 == 1, hardware) {
        panic!("{f:?}");
    }
});
