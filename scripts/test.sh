#!/usr/bin/env bash
# Every test, after installing what they need (scripts/setup.sh):
#   1. the x86_64 code on an emulated SMP machine: QEMU (scripts/qemu-test.sh)
#      and Bochs, whose CPU model has PCIDs (scripts/bochs-test.sh); the
#      aarch64 code on QEMU's virt machine (scripts/qemu-test-aarch64.sh),
#      and the barriers and TLBIs its flushes compile to
#      (scripts/aarch64-flush-sequences.sh);
#   2. loom models of the shootdown protocol (scripts/loom.sh);
#   3. with a nightly toolchain: Miri over the protocol, batch and mock
#      machine tests (scripts/miri.sh) and a short run of each fuzz target
#      (scripts/fuzz.sh, FUZZ_SECONDS each, 20 by default here);
#   4. the shared scenario set's host tests (qemu-scenarios/), then every
#      host test of the crate, property tests included (cargo test), last.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/qemu-test.sh
scripts/qemu-test-aarch64.sh
scripts/aarch64-flush-sequences.sh
scripts/bochs-test.sh
scripts/loom.sh
if cargo +nightly --version >/dev/null 2>&1; then
    scripts/miri.sh
    FUZZ_SECONDS=${FUZZ_SECONDS:-20} scripts/fuzz.sh
else
    echo "no nightly toolchain: Miri and fuzzing skipped (rustup toolchain install nightly)"
fi
(cd qemu-scenarios && cargo test)
cargo test
