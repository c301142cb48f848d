//! Drives the mock machine with a sequence of operations decoded from the
//! input (map, access from CPU k, switch, unmap with and without batching,
//! page_referenced, flush, flush_dirty, write-out, free, migrate, mprotect,
//! teardown). The oracle checks the safety contract after every step, and
//! the batched and unbatched runs of the sequence must end in the same page
//! states.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tlb_batch::arch::mock::ops::{ops_from_bytes, run};

fuzz_target!(|data: &[u8]| {
    let ops = ops_from_bytes(data);
    let batched = match run(&ops, true) {
        Ok(o) => o,
        Err(f) => panic!("batched run broke the contract: {f:?}"),
    };
    let plain = match run(&ops, false) {
        Ok(o) => o,
        Err(f) => panic!("unbatched run broke the contract: {f:?}"),
    };
    assert_eq!(batched.state, plain.state, "batching changed the end state");
});
