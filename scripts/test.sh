#!/usr/bin/env bash
# Every test: the x86_64 code on an emulated SMP machine (QEMU scenario
# matrix, scripts/qemu-test.sh), then every host test (cargo test).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/qemu-test.sh
cargo test
