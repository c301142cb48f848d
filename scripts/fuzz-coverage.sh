#!/usr/bin/env bash
# Which lines of src/ the committed fuzz seeds reach: replays
# fuzz/seeds/<target> through an instrumented build of each cargo-fuzz
# target (`cargo fuzz coverage`), then prints llvm-cov's per-file summary of
# src/ (both targets merged) and writes the annotated lines to
# fuzz/coverage/src.txt, so that the uncovered ones can be read.
#
#   scripts/fuzz-coverage.sh            summary of both targets
#   COVERAGE_SHOW=1 scripts/fuzz-coverage.sh   also print the annotated lines
#
# Needs the nightly toolchain with llvm-tools-preview (installed here when
# missing) and cargo-fuzz (scripts/setup.sh). Not part of scripts/test.sh: it measures reach,
# it checks nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

# Nightly and cargo-fuzz, installed when missing (scripts/setup.sh).
scripts/setup.sh
rustup component add --toolchain nightly llvm-tools-preview >/dev/null 2>&1 || true
sysroot=$(rustc +nightly --print sysroot)
host=$(rustc +nightly -vV | sed -n 's/^host: //p')
tools="$sysroot/lib/rustlib/$host/bin"
[ -x "$tools/llvm-cov" ] || { echo "llvm-cov not found under $tools" >&2; exit 1; }

targets=(ops flush_request)
profiles=()
binaries=()
for target in "${targets[@]}"; do
    echo "== replaying fuzz/seeds/$target ($(ls "fuzz/seeds/$target" | wc -l) inputs)"
    cargo +nightly fuzz coverage -s none "$target" "fuzz/seeds/$target" >/dev/null 2>&1
    profiles+=("fuzz/coverage/$target/coverage.profdata")
    # cargo fuzz coverage builds into the crate's target directory.
    binaries+=("target/$host/coverage/$host/release/$target")
done

merged=fuzz/coverage/merged.profdata
"$tools/llvm-profdata" merge -sparse "${profiles[@]}" -o "$merged"
# Only the crate's own sources: not the fuzz targets, std or other crates.
filter=(-ignore-filename-regex='(/\.cargo/|/rustc/|/fuzz/|/\.rustup/)')
# The first binary, then every other one as an -object.
objects=("${binaries[0]}")
for b in "${binaries[@]:1}"; do
    objects+=(-object "$b")
done
"$tools/llvm-cov" report "${objects[@]}" \
    -instr-profile="$merged" "${filter[@]}" |
    sed -e "s|$(pwd)/||"
"$tools/llvm-cov" show "${objects[@]}" \
    -instr-profile="$merged" "${filter[@]}" -show-line-counts \
    >fuzz/coverage/src.txt
echo "annotated lines: fuzz/coverage/src.txt"
if [ "${COVERAGE_SHOW:-0}" = 1 ]; then
    cat fuzz/coverage/src.txt
fi
