//! Drives the mock machine with a sequence of operations decoded from the
//! input (see `tlb_batch::arch::mock::ops`: any CPU initiating, two user
//! address spaces and the kernel's, low-level and typed batches, the
//! reclaim, migration, mprotect and teardown drivers, a frame pool filled by
//! pooled reclaims and emptied by timer ticks and pool flushes, injected
//! flush failures and their retries, CPUs going offline and back, hostile
//! input).
//! The first byte picks untagged or tagged TLBs; the sequence runs batched,
//! with the oracle checking the safety contract after every step, and the
//! sequence made blind to accessed bits must end in the same page states
//! batched and unbatched (`check_with`).

#![no_main]

use libfuzzer_sys::fuzz_target;
use tlb_batch::arch::mock::ops::{check_with, ops_from_bytes};

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let ops = ops_from_bytes(rest);
    if let Err(f) = check_with(&ops, kind & 1 == 1) {
        panic!("{f:?}");
    }
});
