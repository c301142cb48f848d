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
# Tests that loop many times run fewer rounds under Miri (`cfg!(miri)`).
#
# No MIRIFLAGS: the default checks (Stacked Borrows, data races, leaks,
# isolation from the host) all apply. About 7 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup toolchain list | grep -q '^nightly'; then
    rustup toolchain install nightly --profile minimal
fi
installed=$(rustup component list --toolchain nightly --installed)
if ! grep -q '^miri' <<<"$installed" || ! grep -q '^rust-src' <<<"$installed"; then
    rustup component add --toolchain nightly miri rust-src
fi

cargo +nightly miri test --lib --test batch --test shootdown --test mock_machine --test pool_passes --test pool_room "$@"
cargo +nightly miri test --test soundness_typed --test soundness_retries --test soundness_hostile -- --skip sparse
