#!/usr/bin/env bash
# Mutation testing of the files that carry the safety contract: every
# mutant cargo-mutants makes of them (a condition inverted, a function
# returning a constant, an operator swapped) must make some test fail.
#
#   scripts/mutants.sh                 all of them (hours on 2 cores)
#   scripts/mutants.sh -f src/mm.rs    one file (arguments go to cargo mutants)
#
# The tests run with nextest by default: it runs the same test binaries
# as `cargo test` (every unit and integration test of the host suite), one
# process per test, but not the doc tests, so what it catches is a lower
# bound of what `cargo test` catches, in about half the time. For
# `cargo test` itself: MUTANTS_TEST_TOOL=cargo scripts/mutants.sh.
# The timeout is three times the unmutated run; a mutant that hangs counts
# as caught (a shootdown that never completes is a failure too). The
# summary prints, per file, the viable mutants caught and the survivors;
# survivors listed in scripts/mutants-equivalent.txt, with why each changes
# nothing observable, are marked as such.
set -euo pipefail
cd "$(dirname "$0")/.."

# python3 for the summary (a minimal Debian has none).
scripts/apt-install.sh python3
command -v cargo-mutants >/dev/null 2>&1 || cargo install --locked cargo-mutants
if [ "${MUTANTS_TEST_TOOL:-nextest}" = nextest ]; then
    command -v cargo-nextest >/dev/null 2>&1 || cargo install --locked cargo-nextest
fi

files=(batch shootdown mm request rmap rmap/unmap rmap/aging rmap/visit rmap/bounded unmap gather reclaim migrate mprotect percpu pool pool/generations pool/quiescent generation lifecycle validate range walk)
args=()
if [ "$#" -eq 0 ]; then
    for f in "${files[@]}"; do
        args+=(-f "src/$f.rs")
    done
fi

out=target/mutants
# cargo-mutants creates the output directory but not its parent: a fresh
# clone has no target/ yet.
mkdir -p "$out"
status=0
cargo mutants "${args[@]}" "$@" \
    --test-tool "${MUTANTS_TEST_TOOL:-nextest}" \
    --jobs "${MUTANTS_JOBS:-2}" \
    --timeout-multiplier 3 \
    --output "$out" || status=$?
# 0: every mutant caught; 2: some survived; 3: timeouts. Anything else is
# a failure of the run itself.
case "$status" in
    0 | 2 | 3) ;;
    *) echo "cargo mutants failed ($status)" >&2; exit "$status" ;;
esac
python3 scripts/mutants_summary.py "$out/mutants.out/outcomes.json" scripts/mutants-equivalent.txt
