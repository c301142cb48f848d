#!/usr/bin/env bash
# Every test, after installing what they need (scripts/setup.sh):
#   1. the x86_64 code on an emulated SMP machine: QEMU (scripts/qemu-test.sh)
#      and Bochs, whose CPU model has PCIDs (scripts/bochs-test.sh); the
#      aarch64 code on QEMU's virt machine (scripts/qemu-test-aarch64.sh),
#      and the barriers and TLBIs its flushes compile to
#      (scripts/aarch64-flush-sequences.sh); the guides' kernel glue built
#      for x86_64-unknown-none and aarch64-unknown-none, their snippets
#      checked against it (scripts/guide-check.sh, seconds);
#   2. loom models of the shootdown protocol (scripts/loom.sh: unit tests of
#      the library in src/loom/, built under `--cfg loom`);
#   3. with a nightly toolchain: Miri over the protocol, batch and mock
#      machine tests (scripts/miri.sh) and a short run of each fuzz target
#      (scripts/fuzz.sh, FUZZ_SECONDS each, 20 by default here);
#   4. the shared scenario set's host tests (qemu-scenarios/), then every
#      host test of the crate, property tests included (cargo test), last.
# Loom and Miri are deterministic, CPU-bound and independent of each
# other: they run side by side (Miri's output is printed when it ends, and
# its failure fails the run), which saves minutes on a 2-core machine. The
# emulators run alone, since their scenarios wait with time limits.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { printf '\n== test.sh: %s (at %d s)\n' "$*" "$SECONDS"; }
phase setup
scripts/setup.sh
phase "QEMU, x86_64"
scripts/qemu-test.sh
phase "QEMU, aarch64"
scripts/qemu-test-aarch64.sh
scripts/aarch64-flush-sequences.sh
phase "the guides' code (guide-kernel/, guide-kernel-aarch64/, docs/embedding-*.md)"
scripts/guide-check.sh
phase Bochs
scripts/bochs-test.sh
nightly=false
if cargo +nightly --version >/dev/null 2>&1; then
    nightly=true
fi
miri_log=$(mktemp)
miri=
# A failure elsewhere ends the run: Miri must not run on without it.
trap 'rm -f "$miri_log"; if [ -n "$miri" ]; then kill "$miri" 2>/dev/null || true; fi' EXIT
if $nightly; then
    phase "Miri (in the background) and loom"
    scripts/miri.sh >"$miri_log" 2>&1 &
    miri=$!
else
    phase loom
fi
scripts/loom.sh
if $nightly; then
    miri_status=0
    wait "$miri" || miri_status=$?
    phase "Miri's output"
    cat "$miri_log"
    if [ "$miri_status" -ne 0 ]; then
        echo "Miri failed (exit $miri_status)"
        exit 1
    fi
    phase fuzzing
    FUZZ_SECONDS=${FUZZ_SECONDS:-20} scripts/fuzz.sh
else
    echo "no nightly toolchain: Miri and fuzzing skipped (rustup toolchain install nightly)"
fi
phase "host tests"
(cd qemu-scenarios && cargo test)
cargo test
phase done
