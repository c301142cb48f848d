#!/usr/bin/env bash
# Fuzzes every cargo-fuzz target (fuzz/fuzz_targets/) with the nightly
# toolchain, each for FUZZ_SECONDS seconds (default 30), starting from the
# committed seeds (fuzz/seeds/<target>) plus whatever corpus earlier runs
# left in fuzz/corpus/<target> (not committed).
#
# Installs what it needs when missing (scripts/setup.sh).
# A long run:   FUZZ_SECONDS=3600 scripts/fuzz.sh
# One target:   cargo +nightly fuzz run ops fuzz/corpus/ops fuzz/seeds/ops
# A crash is saved under fuzz/artifacts/<target>/; replay it with
#               cargo +nightly fuzz run -s none ops fuzz/artifacts/ops/<file>
#
# The targets are built without AddressSanitizer (-s none): they are safe
# Rust over the crate's few unsafe blocks, which Miri checks
# (scripts/miri.sh), and what they look for is a breach of the safety
# contract, which the mock machine's oracle reports. ASan's shadow memory
# only slowed the simulator down (4,500 against 13,800 executions a second
# of the ops target, measured side by side).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-30}
# Nightly and cargo-fuzz, installed when missing (with the rest of what
# the tests need), so that the script runs alone from a fresh clone too.
scripts/setup.sh
for target in ops flush_request; do
    mkdir -p "fuzz/corpus/$target"
    echo "== fuzz $target for ${seconds}s"
    cargo +nightly fuzz run -s none "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
        -max_total_time="$seconds" -print_final_stats=1 2>&1 | grep -E '^(#|Done|stat::number_of_executed_units|==)|ERROR|panicked' | tail -n 5
done
