//! Property tests over the mock's operation model: any sequence of maps,
//! accesses, switches, unmaps (batched or not), aging, flushes, write-outs,
//! frees, migrations, mprotects and teardowns keeps the safety contract
//! (the oracle sees nothing after every step), and a batched run ends in the
//! same page states as an unbatched run of the same sequence.

use proptest::prelude::*;
use tlb_batch::arch::mock::ops::{ops_from_bytes, run, Op};

/// Runs `ops` batched and unbatched; both must keep the contract and end
/// in the same state. Returns the pages deferred and the IPIs of each run.
/// (Batching is not promised to save IPIs on every sequence: a deferral
/// followed by an mprotect pays for rule 5's flush and then the batch's.)
fn check(ops: &[Op]) -> Result<(u64, u64, u64), TestCaseError> {
    let batched = run(ops, true).map_err(|f| TestCaseError::fail(format!("batched run: {f:?}")))?;
    let plain = run(ops, false).map_err(|f| TestCaseError::fail(format!("unbatched run: {f:?}")))?;
    prop_assert_eq!(&batched.state, &plain.state, "batching changed the end state");
    Ok((batched.deferred, batched.ipis, plain.ipis))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        // Failures are reported with their minimal input; nothing is
        // written next to the sources.
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn any_sequence_keeps_the_contract_and_batching_changes_no_page_state(
        bytes in prop::collection::vec(any::<u8>(), 0..1200)
    ) {
        let ops = ops_from_bytes(&bytes);
        prop_assert!(bytes.len() < 16 || !ops.is_empty());
        check(&ops)?;
    }
}

use Op::*;

/// Two processes share pages on three CPUs; the reclaimer unmaps with
/// batching, writes out and frees: the sequence defers flushes and saves
/// IPIs, and stays clean.
fn busy_sequence() -> Vec<Op> {
    let mut ops = Vec::new();
    for p in 0..4 {
        ops.push(Map {
            space: 0,
            page: p,
            writable: true,
        });
        ops.push(Share { space: 0, page: p });
        ops.push(Access {
            cpu: 1,
            space: 0,
            page: p,
            write: true,
        });
        ops.push(Access {
            cpu: 2,
            space: 1,
            page: p,
            write: false,
        });
    }
    for p in 0..4 {
        ops.push(Unmap {
            space: 0,
            page: p,
            batched: true,
        });
    }
    ops.extend([
        WriteOut { index: 0 },
        WriteOut { index: 1 },
        Free { index: 0 },
        Free { index: 0 },
    ]);
    ops
}

#[test]
fn the_model_exercises_deferral_and_saves_ipis() {
    let (deferred, batched, plain) = check(&busy_sequence()).unwrap();
    assert!(deferred >= 6, "deferred {deferred}");
    assert!(batched < plain, "{batched} IPIs batched, {plain} unbatched");
}

#[test]
fn the_model_covers_migration_mprotect_and_teardown() {
    let mut ops = busy_sequence();
    ops.extend([
        Map {
            space: 1,
            page: 0,
            writable: true,
        },
        Access {
            cpu: 2,
            space: 1,
            page: 0,
            write: true,
        },
        Migrate { space: 1, page: 0 },
        Access {
            cpu: 2,
            space: 1,
            page: 0,
            write: true,
        },
        Map {
            space: 0,
            page: 3,
            writable: true,
        },
        Access {
            cpu: 1,
            space: 0,
            page: 3,
            write: true,
        },
        Unmap {
            space: 0,
            page: 3,
            batched: true,
        },
        Map {
            space: 0,
            page: 2,
            writable: true,
        },
        Protect { space: 0 },
        Teardown { space: 1 },
        Free { index: 0 },
    ]);
    let batched = run(&ops, true).unwrap();
    let plain = run(&ops, false).unwrap();
    assert_eq!(batched.state, plain.state);
    // The write-protect took effect and the teardown emptied space 1.
    assert!(batched.state.mappings[..6]
        .iter()
        .flatten()
        .all(|&(_, writable)| !writable));
    assert!(batched.state.mappings[6..].iter().all(Option::is_none));
}

/// Every committed fuzz seed (fuzz/seeds/ops), including the sequence the
/// fuzzer found (a new frame mapped where a reclaimer left a stale writable
/// entry: rule 5 at fault time), replayed on stable with each `cargo test`.
#[test]
fn the_committed_fuzz_seeds_keep_the_contract() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/ops");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        check(&tlb_batch::arch::mock::ops::ops_from_bytes(&bytes)).unwrap();
        seen += 1;
    }
    assert!(seen >= 4, "only {seen} seeds in {}", dir.display());
}
