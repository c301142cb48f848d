//! Property tests over the mock's operation model: any sequence of maps,
//! accesses, switches, unmaps (low-level and typed, batched or not, blind to
//! accessed bits or not), aging, flushes (with injected failures and their
//! retries), write-outs, frees, reclaims (into a frame pool or not),
//! timer ticks and pool flushes, migrations, mprotects, teardowns, CPUs
//! going offline and back, and hostile input, from any CPU, on untagged and
//! tagged TLBs of x86 and arm64 hardware, keeps the safety contract (the oracle sees nothing after
//! every step); and batching changes no page state. Sequences made for the
//! pool (module `pool`) line up what random bytes rarely do: a page cached,
//! pooled, and a tick.

use proptest::prelude::*;
use tlb_batch::arch::mock::ops::{
    self, check, ops_from_bytes, run, run_with, BadInput, Hardware, Io, Op, RunConfig,
};
use tlb_batch::arch::mock::FrameState;

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
        tick: false,
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
            tick: false,
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
            pooled: false,
            aged: false,
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

fn ro(space: u8, page: u8) -> Op {
    Map {
        space,
        page,
        writable: false,
    }
}

fn read(cpu: u8, space: u8, page: u8) -> Op {
    Access {
        cpu,
        space,
        page,
        write: false,
        tick: false,
    }
}

fn pooled_reclaim(cpu: u8, space: u8, pages: u8, fail: bool) -> Op {
    Reclaim {
        cpu,
        space,
        pages,
        io: Io::Synchronous,
        refuse_free: false,
        fail,
        pooled: true,
        aged: false,
    }
}

/// CPU 1 runs space 0 and CPU 2 space 1, each reading read-only pages that
/// CPU 0 reclaims into the pool (each reclaim twice: the first finds the
/// pages referenced and ages them). A tick on CPU 1 hands its frames back
/// with no IPI; a later reclaim finds the pool too full, and its pool
/// flush fails first, then retries; pool flushes of the oldest frames and
/// of everything (each failing first), and the end of the run, empty it.
fn pool_sequence() -> Vec<Op> {
    let mut ops = Vec::new();
    let cache = |ops: &mut Vec<Op>, cpu: u8, space: u8, pages: &[u8]| {
        for &p in pages {
            ops.extend([ro(space, p), read(cpu, space, p)]);
        }
    };
    cache(&mut ops, 1, 0, &[0, 1, 2]);
    cache(&mut ops, 2, 1, &[0, 1]);
    for (space, pages) in [(0, 0b0111), (1, 0b0011)] {
        ops.extend([pooled_reclaim(0, space, pages, false); 2]);
    }
    ops.push(Tick { cpu: 1 });
    cache(&mut ops, 1, 0, &[0, 1, 2]);
    ops.extend([pooled_reclaim(0, 0, 0b0111, false); 2]);
    cache(&mut ops, 2, 1, &[2, 3]);
    ops.extend([pooled_reclaim(0, 1, 0b1100, true); 2]);
    ops.extend([
        PoolFlush {
            cpu: 0,
            fail: true,
            oldest: 2,
        },
        PoolFlush {
            cpu: 2,
            fail: true,
            oldest: 0,
        },
    ]);
    cache(&mut ops, 1, 0, &[3]);
    ops.extend([pooled_reclaim(0, 0, 0b1000, false); 2]);
    ops
}

/// A typed batch whose unmap ignored the accessed bit goes into the pool
/// (a `Flush` of typed batch 1 with `batch / BATCHES` odd), then CPU 0's
/// tick asks the pool for passed frames. CPU 1 read the page after its
/// frame's aging epoch: mapped fresh (epoch 0), or aged by
/// `page_referenced` and passed by a switch away and back before the read.
/// The unmap found the bit set, so the generation must wait for a flush
/// after it; the frame freed at the tick would still be in CPU 1's TLB.
fn pooled_after_a_read_since_the_aging(aged: bool) -> Vec<Op> {
    let mut ops = vec![ro(0, 0), read(1, 0, 0)];
    if aged {
        ops.extend([
            Referenced {
                cpu: 0,
                space: 0,
                page: 0,
                batch: 0,
            },
            Switch { cpu: 1, space: 1 },
            Switch { cpu: 1, space: 0 },
            read(1, 0, 0),
        ]);
    }
    ops.extend([
        TypedUnmap {
            cpu: 0,
            space: 0,
            page: 0,
            batch: 1,
            ignore_access: true,
        },
        Flush {
            cpu: 0,
            batch: 1 + ops::BATCHES as u8,
            typed: true,
            fail: false,
        },
        Tick { cpu: 0 },
    ]);
    ops
}

#[test]
fn a_pooled_page_read_since_its_aging_waits_for_a_new_flush() {
    for aged in [false, true] {
        let ops = pooled_after_a_read_since_the_aging(aged);
        check(&ops).unwrap();
        assert!(run(&ops, true).unwrap().pooled >= 1, "aged: {aged}");
    }
}

#[test]
fn the_model_exercises_the_pool_and_it_saves_ipis() {
    let ops = pool_sequence();
    check(&ops).unwrap();
    let (pooled, plain) = (run(&ops, true).unwrap(), run(&ops, false).unwrap());
    assert!(pooled.pooled >= 9, "pooled {}", pooled.pooled);
    assert!(
        pooled.released_by_passes >= 3,
        "released by passes {}",
        pooled.released_by_passes
    );
    assert_eq!(plain.pooled, 0, "the plain run has no pool");
    assert!(
        pooled.ipis < plain.ipis,
        "{} IPIs pooled, {} plain",
        pooled.ipis,
        plain.ipis
    );
    assert_eq!(pooled.state, plain.state, "the pool changes no end state");
}

/// Pages 0 and 1 of space 0, cached by CPUs 1 and 2, unmapped with
/// deferred flushes into low-level batch 0 by `adders` in turn, the batch
/// flushed from `flusher`, then both frames freed. On arm64 each unmap
/// issues its page's invalidation from the CPU that adds it, and the mock
/// applies it only at that CPU's next barrier: a flush from a CPU that did
/// not issue them all (a task that migrated between its unmaps and its
/// flush, or a batch two CPUs filled) must issue them again, or the frees
/// meet the stale entries.
fn batch_moved_between_cpus(adders: [u8; 2], flusher: u8) -> Vec<Op> {
    let mut ops = Vec::new();
    for p in 0..2 {
        ops.extend([map(0, p), read(1, 0, p), read(2, 0, p)]);
    }
    for (p, &cpu) in adders.iter().enumerate() {
        ops.push(unmap(cpu, 0, p as u8, 0));
    }
    ops.extend([
        Flush {
            cpu: flusher,
            batch: 0,
            typed: false,
            fail: false,
        },
        Free { index: 0 },
        Free { index: 0 },
    ]);
    ops
}

#[test]
fn a_batch_filled_on_other_cpus_is_flushed_everywhere_on_arm64() {
    // Added on one CPU and flushed on another; added on two, flushed on
    // either of them; and, for comparison, added and flushed on one.
    for (adders, flusher) in [([1, 1], 0), ([1, 2], 1), ([1, 2], 2), ([2, 1], 0), ([1, 1], 1)] {
        let ops = batch_moved_between_cpus(adders, flusher);
        check(&ops).unwrap();
        for tagged in [false, true] {
            let arm64 = run_with(
                &ops,
                RunConfig {
                    batching: true,
                    tagged,
                    hardware: Hardware::Arm64,
                },
            )
            .unwrap();
            // Both pages deferred (issued on add), no IPI, both frames freed.
            assert_eq!((arm64.deferred, arm64.ipis), (2, 0), "{adders:?} {flusher}");
            let free = arm64
                .state
                .frames
                .iter()
                .filter(|(s, _)| *s == FrameState::Free)
                .count();
            assert_eq!(free, arm64.state.frames.len(), "{adders:?} {flusher}");
        }
    }
}

/// Every committed fuzz seed (fuzz/seeds/ops), replayed on stable with
/// each `cargo test` as the fuzz target reads it: its first byte picks the
/// TLB kind and the hardware (`check` runs them all), the rest are the
/// operations.
#[test]
fn the_committed_fuzz_seeds_keep_the_contract() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/ops");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        if let Some((_, ops)) = bytes.split_first() {
            check(&ops_from_bytes(ops)).unwrap();
        }
        seen += 1;
    }
    assert!(seen >= 4, "only {seen} seeds in {}", dir.display());
}

/// Sequences made for the pool: few spaces and pages, read-only maps and
/// reads (so that frames are clean and cached), pooled reclaims, ticks and
/// pool flushes likely, among switches, CPUs going offline and back, and
/// the other drivers; random bytes alone rarely line these up.
mod pool {
    use super::checked;
    use proptest::prelude::*;
    use tlb_batch::arch::mock::ops::{Io, Op};

    fn io() -> impl Strategy<Value = Io> {
        prop_oneof![
            6 => Just(Io::Synchronous),
            1 => Just(Io::Queued),
            1 => Just(Io::Failing),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        let (cpu, space, page) = (0..3u8, 0..2u8, 0..4u8);
        prop_oneof![
            4 => (space.clone(), page.clone(), prop::bool::weighted(0.2))
                .prop_map(|(space, page, writable)| Op::Map { space, page, writable }),
            6 => (cpu.clone(), space.clone(), page.clone(), prop::bool::weighted(0.1))
                .prop_map(|(cpu, space, page, write)| Op::Access { cpu, space, page, write, tick: false }),
            2 => (cpu.clone(), space.clone(), page.clone())
                .prop_map(|(cpu, space, page)| Op::Access { cpu, space, page, write: false, tick: true }),
            1 => (space.clone(), page.clone()).prop_map(|(space, page)| Op::Share { space, page }),
            1 => (cpu.clone(), space.clone()).prop_map(|(cpu, space)| Op::Switch { cpu, space }),
            6 => (cpu.clone(), space.clone(), 1..16u8, io(), prop::bool::weighted(0.1), any::<bool>(),
                  prop::bool::weighted(0.85), any::<bool>())
                .prop_map(|(cpu, space, pages, io, refuse_free, fail, pooled, aged)| Op::Reclaim {
                    cpu, space, pages, io, refuse_free, fail, pooled, aged,
                }),
            4 => cpu.clone().prop_map(|cpu| Op::Tick { cpu }),
            2 => (cpu.clone(), any::<bool>(), any::<u8>())
                .prop_map(|(cpu, fail, oldest)| Op::PoolFlush { cpu, fail, oldest }),
            1 => cpu.clone().prop_map(|cpu| Op::Offline { cpu }),
            1 => cpu.clone().prop_map(|cpu| Op::Online { cpu }),
            1 => (cpu.clone(), space.clone(), any::<bool>())
                .prop_map(|(cpu, space, fail)| Op::Teardown { cpu, space, fail }),
            1 => (cpu.clone(), space.clone(), page.clone(), any::<bool>())
                .prop_map(|(cpu, space, page, fail)| Op::Migrate { cpu, space, page, no_memory: false, fail }),
            1 => (cpu.clone(), space, page, 1..4u8, any::<bool>())
                .prop_map(|(cpu, space, first, count, fail)| Op::Protect { cpu, space, first, count, fail }),
            1 => (cpu, any::<u8>()).prop_map(|(cpu, batch)| Op::Flush { cpu, batch, typed: false, fail: true }),
            1 => any::<u8>().prop_map(|index| Op::EndIo { index }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 256,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Pooled frames come back only once no CPU can cache them, every
        /// frame is accounted for, and the plain run ends the same.
        #[test]
        fn pool_sequences_keep_the_contract(ops in prop::collection::vec(op(), 1..80)) {
            checked(&ops)?;
        }
    }
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
            1 => Just(Step::Lazy),
            1 => Just(Step::Away),
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
        /// interrupts on or off, lazy or away and catching up, on tagged
        /// TLBs or not; the oracle sees nothing.
        #[test]
        fn concurrent_initiators_keep_the_contract(
            tagged in any::<bool>(),
            plans in prop::collection::vec(prop::collection::vec(step(), 0..40), 3)
        ) {
            if let Err(f) = run_concurrent(tagged, &plans) {
                return Err(TestCaseError::fail(format!("{f:?}")));
            }
        }
    }
}
