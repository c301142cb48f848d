//! Property tests over the mock's operation model: any sequence of maps,
//! accesses, switches, unmaps (low-level and typed, batched or not, blind to
//! accessed bits or not), aging, flushes (with injected failures and their
//! retries), write-outs, frees, reclaims, migrations, mprotects, teardowns,
//! CPUs going offline and back, and hostile input, from any CPU, on untagged
//! and tagged TLBs, keeps the safety contract (the oracle sees nothing after
//! every step); and batching changes no page state.

use proptest::prelude::*;
use tlb_batch::arch::mock::ops::{self, check, ops_from_bytes, run, BadInput, Io, Op};

fn checked(ops: &[Op]) -> Result<(ops::Outcome, ops::Outcome), TestCaseError> {
    check(ops).map_err(|f| TestCaseError::fail(format!("{f:?}")))
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
        bytes in prop::collection::vec(any::<u8>(), 0..1500)
    ) {
        let ops = ops_from_bytes(&bytes);
        prop_assert!(bytes.len() < 16 || !ops.is_empty());
        checked(&ops)?;
    }
}

use Op::*;

const W: bool = true;

fn map(space: u8, page: u8) -> Op {
    Map {
        space,
        page,
        writable: W,
    }
}

fn write(cpu: u8, space: u8, page: u8) -> Op {
    Access {
        cpu,
        space,
        page,
        write: true,
    }
}

fn unmap(cpu: u8, space: u8, page: u8, batch: u8) -> Op {
    Unmap {
        cpu,
        space,
        page,
        batch,
        batched: true,
        ignore_access: true,
    }
}

/// Two processes share pages on three CPUs; CPU 0 unmaps with batching,
/// writes out and frees: the sequence defers flushes and saves IPIs, and
/// stays clean.
fn busy_sequence() -> Vec<Op> {
    let mut ops = Vec::new();
    for p in 0..4 {
        ops.extend([map(0, p), Share { space: 0, page: p }, write(1, 0, p)]);
        ops.push(Access {
            cpu: 2,
            space: 1,
            page: p,
            write: false,
        });
    }
    for p in 0..4 {
        ops.push(unmap(0, 0, p, 0));
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
    let (batched, plain) = check(&busy_sequence()).unwrap();
    assert!(batched.deferred >= 6, "deferred {}", batched.deferred);
    assert!(
        batched.ipis < plain.ipis,
        "{} IPIs batched, {} unbatched",
        batched.ipis,
        plain.ipis
    );
}

#[test]
fn the_model_covers_every_driver_typed_batches_failures_and_the_kernel_space() {
    let mut ops = busy_sequence();
    ops.extend([
        map(1, 0),
        write(2, 1, 0),
        Migrate {
            cpu: 1,
            space: 1,
            page: 0,
            no_memory: false,
            fail: true,
        },
        write(2, 1, 0),
        map(0, 3),
        write(1, 0, 3),
        unmap(2, 0, 3, 1),
        map(0, 2),
        Protect {
            cpu: 1,
            space: 0,
            first: 0,
            count: 4,
            fail: true,
        },
        // The kernel's space: its last page is the last page of the
        // address space.
        map(2, 3),
        write(1, 2, 3),
        TypedUnmap {
            cpu: 0,
            space: 2,
            page: 3,
            batch: 1,
            ignore_access: true,
        },
        Flush {
            cpu: 2,
            batch: 1,
            typed: true,
            fail: true,
        },
        map(1, 1),
        write(2, 1, 1),
        Reclaim {
            cpu: 0,
            space: 1,
            pages: 0b11,
            io: Io::Queued,
            refuse_free: false,
            fail: true,
        },
        EndIo { index: 0 },
        Teardown {
            cpu: 2,
            space: 1,
            fail: true,
        },
        Free { index: 0 },
        Hostile {
            cpu: 1,
            kind: BadInput::RmapAddress,
        },
    ]);
    let (batched, plain) = check(&ops).unwrap();
    // The write-protect took effect and the teardown emptied space 1.
    assert!(batched.state.mappings[..4]
        .iter()
        .flatten()
        .all(|&(_, writable)| !writable));
    assert!(batched.state.mappings[4..8].iter().all(Option::is_none));
    assert!(plain.ipis > 0);
}

/// The gap the fuzzer found in the protocol as first written down: a fault
/// that maps a new frame where a reclaimer left a stale writable entry must
/// flush the pending batch first (rule 5), or another CPU goes on writing
/// into the old frame.
#[test]
fn a_new_frame_mapped_where_a_reclaimer_unmapped_one_is_safe() {
    let ops = [
        map(0, 0),
        write(1, 0, 0),
        unmap(0, 0, 0, 0),
        map(0, 0),
        write(1, 0, 0),
        Free { index: 0 },
    ];
    check(&ops).unwrap();
}

#[test]
fn a_cpu_away_during_a_shootdown_comes_back_clean() {
    let ops = [
        map(0, 0),
        write(1, 0, 0),
        write(2, 0, 0),
        Offline { cpu: 2 },
        unmap(0, 0, 0, 0),
        Free { index: 0 },
        map(0, 0),
        Online { cpu: 2 },
        write(2, 0, 0),
    ];
    check(&ops).unwrap();
}

#[test]
fn hostile_input_is_refused_with_nothing_changed() {
    let mut ops = busy_sequence();
    for kind in [
        BadInput::AddPending,
        BadInput::FlushPage,
        BadInput::Protect,
        BadInput::Teardown,
        BadInput::RmapAddress,
        BadInput::WideAsid,
        BadInput::PastTheTop,
    ] {
        ops.insert(6, Hostile { cpu: 0, kind });
    }
    check(&ops).unwrap();
    // And the same on its own, with nothing mapped.
    run(
        &[Hostile {
            cpu: 2,
            kind: BadInput::Teardown,
        }],
        true,
    )
    .unwrap();
}

/// Every committed fuzz seed (fuzz/seeds/ops), replayed on stable with
/// each `cargo test`.
#[test]
fn the_committed_fuzz_seeds_keep_the_contract() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/ops");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        check(&ops_from_bytes(&bytes)).unwrap();
        seen += 1;
    }
    assert!(seen >= 4, "only {seen} seeds in {}", dir.display());
}

mod concurrent {
    use proptest::prelude::*;
    use tlb_batch::arch::mock::ops::concurrent::{run_concurrent, Step};

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (any::<u8>(), any::<bool>()).prop_map(|(page, write)| Step::Access { page, write }),
            2 => any::<bool>().prop_map(|batched| Step::Remap { batched }),
            1 => Just(Step::Protect),
            1 => Just(Step::Migrate),
            1 => Just(Step::InterruptsOff),
            1 => Just(Step::InterruptsOn),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: if cfg!(miri) { 2 } else { 48 },
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Every CPU initiates at once (threaded delivery): shootdowns
        /// cross, coalesce and meet CPUs that access the pages, with
        /// interrupts on or off; the oracle sees nothing.
        #[test]
        fn concurrent_initiators_keep_the_contract(
            plans in prop::collection::vec(prop::collection::vec(step(), 0..40), 3)
        ) {
            if let Err(f) = run_concurrent(&plans) {
                return Err(TestCaseError::fail(format!("{f:?}")));
            }
        }
    }
}
