//! The operation model's huge address space, on fixed sequences: each
//! sequence lines up one of the four ways of getting huge pages wrong that
//! kernels have shipped, so that the suite (not only the fuzzer) turns red
//! when the crate's split, promotion, ranged flush or teardown regresses
//! into one of them; and random sequences of huge steps mixed with the
//! model's others keep the contract.
//!
//! The four:
//!
//! 1. a ranged flush at a 2 MiB stride over 4 KiB entries, which leaves
//!    all but the first of each 2 MiB cached (FreeBSD-EN-26:10's
//!    `INVLPGB`);
//! 2. a promotion that invalidates only the huge page's first address,
//!    leaving the older 4 KiB entries of the range (FreeBSD's old
//!    promotion bug);
//! 3. a split with no flush before the small entries are written: one
//!    address cached both as a 2 MiB and as a 4 KiB translation that
//!    differ (why Linux flushes after splitting);
//! 4. a flush of a range that freed page tables sent as if it had freed
//!    none, skipping lazy CPUs whose walk caches point to the freed table
//!    (CVE-2025-22045).

#![cfg(feature = "arbitrary")]

use proptest::prelude::*;
use tlb_batch::arch::mock::ops::{check, ops_from_bytes, HugeOp, Op};
use tlb_batch::PageSize;

use HugeOp::*;

fn h(op: HugeOp) -> Op {
    Op::Huge(op)
}

/// The index of `piece` in `PIECES`.
fn p(piece: u64) -> u8 {
    tlb_batch::arch::mock::ops::huge::PIECES
        .iter()
        .position(|&x| x == piece)
        .unwrap() as u8
}

fn access(cpu: u8, region: u8, piece: u64, write: bool) -> Op {
    h(Access {
        cpu,
        region,
        piece: p(piece),
        write,
    })
}

fn must_pass(name: &str, ops: &[Op]) {
    if let Err(f) = check(ops) {
        panic!("{name}: {f:?}");
    }
}

/// CPUs 1 and 2 cache 4 KiB entries of region 0 (pieces 1, 3, 100 and
/// 511 mapped small, CPU 1 writing them); CPU 2 then goes lazy, its walk
/// cache still pointing to the region's leaf table.
fn small_region_cached() -> Vec<Op> {
    let mut ops = vec![access(1, 0, 0, false), access(2, 0, 0, false)];
    for piece in [1, 3, 100, 511] {
        ops.push(h(MapSmall {
            region: 0,
            piece: p(piece),
            writable: true,
        }));
        ops.push(access(1, 0, piece, true));
        ops.push(access(2, 0, piece, false));
    }
    ops.push(h(Lazy { cpu: 2 }));
    ops
}

/// Region 0 mapped by one 2 MiB entry that CPUs 1 and 2 cache (each wrote
/// a piece), CPU 2 lazy.
fn huge_region_cached() -> Vec<Op> {
    vec![
        access(1, 0, 0, false),
        access(2, 0, 0, false),
        h(MapHuge {
            region: 0,
            writable: true,
        }),
        access(1, 0, 3, true),
        access(2, 0, 100, true),
        h(Lazy { cpu: 2 }),
    ]
}

/// A promotion of a region that CPUs cache as 4 KiB entries (copied into a
/// new 2 MiB frame, the old frames and the leaf table freed), then CPU 1
/// reads every piece it wrote, and CPU 2 resumes and reads one.
fn promotion() -> Vec<Op> {
    let mut ops = small_region_cached();
    ops.push(h(Promote {
        cpu: 0,
        region: 0,
        fail: false,
    }));
    for piece in [0, 1, 3, 100, 511] {
        ops.push(access(1, 0, piece, false));
    }
    ops.push(access(2, 0, 3, false));
    ops
}

/// Bug classes 2 (the promotion's flush reduced to the first page: CPU 1
/// keeps its 4 KiB entries for pieces 1, 3, 100 and 511, whose old frames
/// are freed under them) and 4 (the promotion's flush skipping the lazy
/// CPU 2, whose walk cache points to the freed leaf table).
#[test]
fn a_promotion_of_cached_small_pages_is_clean() {
    let (batched, _) = check(&promotion()).unwrap_or_else(|f| panic!("{f:?}"));
    let region0 = &batched.state.huge[..6];
    assert!(
        region0
            .iter()
            .all(|e| matches!(e, Some((_, true, s)) if *s == PageSize::SIZE_2M)),
        "one 2 MiB entry: {region0:?}"
    );
}

/// A split of a 2 MiB page that CPUs cache, moving one piece and, in the
/// other region, making one read-only; then the CPUs use the pieces.
fn split() -> Vec<Op> {
    let mut ops = huge_region_cached();
    ops.extend([
        h(MapHuge {
            region: 1,
            writable: true,
        }),
        access(1, 1, 3, true),
        h(Split {
            cpu: 0,
            region: 0,
            change: 2,
            fail: false,
        }),
        h(Split {
            cpu: 0,
            region: 1,
            change: 1,
            fail: true,
        }),
        access(1, 0, 100, true),
        access(1, 1, 3, true),
        access(2, 0, 1, false),
    ]);
    ops
}

/// Bug class 3: without the split's flush CPU 1 keeps the 2 MiB entry
/// beside the new 4 KiB ones (`StaleAfterChange` at once, then the moved
/// piece's old frame freed under it).
#[test]
fn a_split_of_a_cached_huge_page_is_clean() {
    let (batched, _) = check(&split()).unwrap_or_else(|f| panic!("{f:?}"));
    let huge = &batched.state.huge;
    assert!(
        huge.iter()
            .all(|e| matches!(e, Some((_, _, s)) if *s == PageSize::SIZE_4K)),
        "4 KiB entries everywhere: {huge:?}"
    );
    let (block, moved) = (huge[0].unwrap().0, huge[3].unwrap().0);
    assert_ne!(moved.0, block.0 + 100, "piece 100 moved");
    assert!(!huge[8].unwrap().1, "piece 3 of region 1 read-only");
}

/// A plain split (the 512 entries over the same frames), CPU 1 caching
/// three of the new 4 KiB entries, then the whole region made read-only
/// and torn down.
fn protect_after_split() -> Vec<Op> {
    let mut ops = huge_region_cached();
    ops.extend([
        h(Split {
            cpu: 0,
            region: 0,
            change: 0,
            fail: false,
        }),
        access(1, 0, 1, true),
        access(1, 0, 100, true),
        access(1, 0, 511, true),
        h(Protect {
            cpu: 0,
            region: 0,
            first: 0,
            count: 0,
            writable: false,
            fail: false,
        }),
        access(1, 0, 100, true),
        h(Teardown { cpu: 0, fail: false }),
        access(1, 0, 1, false),
    ]);
    ops
}

/// The range operations over the 4 KiB entries a split left: each entry
/// changed and flushed, none left stale.
#[test]
fn a_range_over_small_entries_of_a_split_page_is_flushed_whole() {
    let (batched, _) = check(&protect_after_split()).unwrap_or_else(|f| panic!("{f:?}"));
    assert!(batched.state.huge[..6].iter().all(Option::is_none), "torn down");
}

/// A plain split, CPU 1 caching three of the new 4 KiB entries (writing
/// them), then the kernel's own munmap of the region: its 512 entries
/// cleared, one `flush_tlb_range` over its 512 pages, the frames freed;
/// then CPU 1 reads a piece again.
fn zap_after_split() -> Vec<Op> {
    let mut ops = huge_region_cached();
    ops.extend([
        h(Split {
            cpu: 0,
            region: 0,
            change: 0,
            fail: false,
        }),
        access(1, 0, 1, true),
        access(1, 0, 100, true),
        access(1, 0, 511, true),
        h(Zap { cpu: 0, region: 0 }),
        access(1, 0, 100, false),
    ]);
    ops
}

/// Bug class 1: the range sent at a 2 MiB stride (one invalidation, of
/// the region's first address) leaves CPU 1's entries for pieces 1, 100
/// and 511, whose frames are freed under them (`FreedWhileCached`).
#[test]
fn a_range_flush_over_small_entries_reaches_every_page() {
    must_pass("zap after split", &zap_after_split());
}

/// A teardown of a region mapped small while lazy CPU 2's walk cache
/// points to its leaf table.
fn teardown_with_lazy_walker() -> Vec<Op> {
    let mut ops = small_region_cached();
    ops.extend([
        h(Teardown { cpu: 3, fail: false }),
        access(2, 0, 1, false),
        access(1, 0, 3, false),
    ]);
    ops
}

/// Bug class 4: a teardown whose flush forgets that it freed a table skips
/// the lazy CPU (`TableFreedWhileCached`).
#[test]
fn a_teardown_that_frees_a_table_reaches_the_lazy_cpu() {
    must_pass("teardown", &teardown_with_lazy_walker());
}

/// What the crate must take whole or refuse: a 2 MiB page unmapped whole
/// (batched, freed at the flush), a piece of one refused by the unmap, by
/// a partial protect and by a migration; a small page migrated.
#[test]
fn huge_pages_are_taken_whole_or_refused() {
    let mut ops = huge_region_cached();
    ops.extend([
        h(Unmap {
            cpu: 0,
            region: 0,
            piece: p(3),
            batched: true,
        }),
        h(Protect {
            cpu: 0,
            region: 0,
            first: p(3),
            count: 2,
            writable: false,
            fail: false,
        }),
        h(Migrate {
            cpu: 0,
            region: 0,
            piece: p(0),
        }),
        h(Unmap {
            cpu: 0,
            region: 0,
            piece: 0,
            batched: true,
        }),
        access(1, 0, 3, true),
        h(MapSmall {
            region: 1,
            piece: p(1),
            writable: true,
        }),
        access(1, 1, 1, true),
        h(Migrate {
            cpu: 0,
            region: 1,
            piece: p(1),
        }),
        h(Flush { cpu: 1, fail: true }),
        access(1, 0, 3, false),
        access(1, 1, 1, false),
    ]);
    let (batched, plain) = check(&ops).unwrap_or_else(|f| panic!("{f:?}"));
    let state = &batched.state.huge;
    assert!(
        state[..6].iter().all(Option::is_none),
        "region 0 unmapped: {state:?}"
    );
    assert!(
        matches!(state[7], Some((_, true, s)) if s == PageSize::SIZE_4K),
        "piece 1 of region 1 still mapped, migrated: {state:?}"
    );
    assert!(
        batched.deferred > plain.deferred,
        "the batched run deferred the huge unmap"
    );
}

fn huge_op() -> impl Strategy<Value = Op> {
    let small = 0u8..4;
    prop_oneof![
        4 => (small.clone(), any::<bool>()).prop_map(|(region, writable)| h(MapHuge { region, writable })),
        4 => (small.clone(), 0u8..6, any::<bool>()).prop_map(|(region, piece, writable)| h(MapSmall { region, piece, writable })),
        10 => (small.clone(), small.clone(), 0u8..6, any::<bool>()).prop_map(|(cpu, region, piece, write)| h(Access { cpu, region, piece, write })),
        2 => small.clone().prop_map(|cpu| h(Lazy { cpu })),
        3 => (small.clone(), small.clone(), 0u8..3, any::<bool>()).prop_map(|(cpu, region, change, fail)| h(Split { cpu, region, change, fail })),
        3 => (small.clone(), small.clone(), any::<bool>()).prop_map(|(cpu, region, fail)| h(Promote { cpu, region, fail })),
        2 => (small.clone(), small.clone(), 0u8..6, any::<bool>()).prop_map(|(cpu, region, piece, batched)| h(Unmap { cpu, region, piece, batched })),
        2 => (small.clone(), any::<bool>()).prop_map(|(cpu, fail)| h(Flush { cpu, fail })),
        2 => (small.clone(), small.clone(), 0u8..6, 0u8..4, any::<bool>(), any::<bool>())
            .prop_map(|(cpu, region, first, count, writable, fail)| h(Protect { cpu, region, first, count, writable, fail })),
        1 => (small.clone(), small.clone(), 0u8..6).prop_map(|(cpu, region, piece)| h(Migrate { cpu, region, piece })),
        1 => (0u8..6, any::<bool>()).prop_map(|(cpu, fail)| h(Teardown { cpu, fail })),
        1 => (small.clone(), small.clone()).prop_map(|(cpu, region)| h(Zap { cpu, region })),
        1 => (small.clone(), 0u8..2).prop_map(|(cpu, space)| Op::Switch { cpu, space }),
        1 => small.clone().prop_map(|cpu| Op::Offline { cpu }),
        1 => small.prop_map(|cpu| Op::Online { cpu }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Huge steps, with switches and CPUs going offline and back, on
    /// every hardware and TLB kind.
    #[test]
    fn any_sequence_of_huge_steps_keeps_the_contract(ops in prop::collection::vec(huge_op(), 0..60)) {
        check(&ops).map_err(|f| TestCaseError::fail(format!("{f:?}")))?;
    }

    /// Random bytes decode to huge steps among the others too.
    #[test]
    fn any_bytes_with_huge_steps_keep_the_contract(bytes in prop::collection::vec(any::<u8>(), 0..800)) {
        let ops = ops_from_bytes(&bytes);
        check(&ops).map_err(|f| TestCaseError::fail(format!("{f:?}")))?;
    }
}

/// The bytes the fuzz target decodes into `ops` (after its first byte, the
/// hardware): what `arbitrary`'s derive reads, a little-endian `u32` that
/// picks the variant (index `i` of `n` is the smallest tag with
/// `tag * n >> 32 == i`) and then each field, one byte each.
fn encode(ops: &[Op]) -> Vec<u8> {
    fn tag(out: &mut Vec<u8>, index: u64, count: u64) {
        let t = (index << 32).div_ceil(count);
        out.extend_from_slice(&(t as u32).to_le_bytes());
    }
    const OP_VARIANTS: u64 = 22;
    const HUGE_VARIANTS: u64 = 12;
    let mut out = Vec::new();
    for op in ops {
        let Op::Huge(op) = op else {
            panic!("only huge steps are encoded: {op:?}");
        };
        tag(&mut out, OP_VARIANTS - 1, OP_VARIANTS);
        let b = |v: bool| u8::from(v);
        let (index, fields): (u64, Vec<u8>) = match *op {
            MapHuge { region, writable } => (0, vec![region, b(writable)]),
            MapSmall {
                region,
                piece,
                writable,
            } => (1, vec![region, piece, b(writable)]),
            Access {
                cpu,
                region,
                piece,
                write,
            } => (2, vec![cpu, region, piece, b(write)]),
            Lazy { cpu } => (3, vec![cpu]),
            Split {
                cpu,
                region,
                change,
                fail,
            } => (4, vec![cpu, region, change, b(fail)]),
            Promote { cpu, region, fail } => (5, vec![cpu, region, b(fail)]),
            Unmap {
                cpu,
                region,
                piece,
                batched,
            } => (6, vec![cpu, region, piece, b(batched)]),
            Flush { cpu, fail } => (7, vec![cpu, b(fail)]),
            Protect {
                cpu,
                region,
                first,
                count,
                writable,
                fail,
            } => (8, vec![cpu, region, first, count, b(writable), b(fail)]),
            Migrate { cpu, region, piece } => (9, vec![cpu, region, piece]),
            Zap { cpu, region } => (10, vec![cpu, region]),
            Teardown { cpu, fail } => (11, vec![cpu, b(fail)]),
        };
        tag(&mut out, index, HUGE_VARIANTS);
        out.extend(fields);
    }
    out
}

/// The scenarios above, as the fuzz target's seeds (x86, untagged).
fn seeds() -> Vec<(&'static str, Vec<Op>)> {
    vec![
        ("huge-promotion", promotion()),
        ("huge-split", split()),
        ("huge-protect-after-split", protect_after_split()),
        ("huge-zap-after-split", zap_after_split()),
        ("huge-teardown-lazy-walker", teardown_with_lazy_walker()),
    ]
}

/// The committed seeds under `fuzz/seeds/ops` are the scenarios, byte for
/// byte, and decode back to them (so a change of `Op` or `HugeOp` that
/// would silently turn them into other sequences fails here).
#[test]
fn the_fuzz_seeds_are_the_scenarios() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/ops");
    for (name, ops) in seeds() {
        let mut bytes = vec![0u8];
        bytes.extend(encode(&ops));
        assert_eq!(ops_from_bytes(&bytes[1..]), ops, "{name} round trip");
        let path = dir.join(name);
        if std::env::var_os("TLB_BATCH_WRITE_SEEDS").is_some() {
            std::fs::write(&path, &bytes).unwrap();
        }
        assert_eq!(
            std::fs::read(&path).ok(),
            Some(bytes),
            "{name}: TLB_BATCH_WRITE_SEEDS=1 cargo test --test ops_huge writes it"
        );
    }
}
