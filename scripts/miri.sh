#!/usr/bin/env bash
# Runs the tests that exercise the shootdown protocol, the batch and the
# mock machine under Miri, which reports undefined behaviour and data races
# (including between the real threads of the threaded mock machine): the
# unit tests, tests/batch.rs, tests/shootdown.rs, tests/mock_machine.rs,
# tests/pool_passes.rs and tests/pool_room.rs (the frame pool's unchecked
# pushes), then
# tests/soundness_typed.rs, tests/soundness_retries.rs and
# tests/soundness_hostile.rs (the typed batch's unchecked pushes, error
# paths and retries, hostile input; the sparse-range test, which maps 2,000
# pages, is left to the normal run).
# The other integration tests drive the same code through the reverse-map,
# reclaim, migration and teardown layers and take far longer to interpret.
# Tests that loop many times run fewer rounds under Miri (`cfg!(miri)`),
# and MAX_CPUS is 128 under Miri (src/cpuset.rs). Six tests that only
# count at scale are skipped: they run the code of the smaller tests
# beside them (and of tests/shootdown.rs) over more pages or CPUs, and took
# 21 of Miri's 53 minutes when they ran (2026-12-04, beside loom):
# tests/batch.rs's thousand pages, unbatched flushes, ceiling and broadcast
# counts, tests/pool_room.rs's reclaim over several calls and
# tests/pool_passes.rs's flush of the CPUs that have not passed. The plain
# `cargo test` runs them.
#
# No MIRIFLAGS: the default checks (Stacked Borrows, data races, leaks,
# isolation from the host) all apply.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup toolchain list | grep '^nightly' >/dev/null; then
    rustup toolchain install nightly --profile minimal
fi
installed=$(rustup component list --toolchain nightly --installed)
if ! grep -q '^miri' <<<"$installed" || ! grep -q '^rust-src' <<<"$installed"; then
    rustup component add --toolchain nightly miri rust-src
fi

scale=(
    --skip a_thousand_pages_on_eight_cpus_cost_one_ipi_per_other_cpu
    --skip unbatched_flushes_cost_an_ipi_per_page_per_cpu
    --skip up_to_the_ceiling_pages_are_flushed_one_by_one
    --skip broadcast_hardware_flushes_a_batch_without_any_ipi
    --skip pooled_reclaim_over_several_calls_frees_everything_with_fewer_ipis
    --skip flush_interrupts_only_the_cpus_that_have_not_passed
)
cargo +nightly miri test --lib --test batch --test shootdown --test mock_machine --test pool_passes --test pool_room "$@" -- "${scale[@]}"
cargo +nightly miri test --test soundness_typed --test soundness_retries --test soundness_hostile -- --skip sparse
