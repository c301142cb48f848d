#!/usr/bin/env bash
# Instruction counts (callgrind) for freeing page-table frames one call per
# table versus one batched call, for 1, 64 and 512 tables, then the
# wall-clock ratio measured in one run. Needs valgrind (installed when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/apt-install.sh valgrind
cargo build -q --release --example table_free
bin=target/release/examples/table_free

# Counts only inside the two free_tables implementations (inclusive of the
# lock and everything they call), so setup and the loop around them do not
# dilute the figures.
collected() {
    valgrind --tool=callgrind --callgrind-out-file=/dev/null --toggle-collect='*free_tables*' "$bin" "$@" 2>&1 |
        sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}

echo "Instructions per table freed (callgrind, inside free_tables only)"
printf '%7s %14s %14s %10s\n' tables single batched ratio
for n in 1 64 512; do
    iters=$((100000 / n))
    single=$(collected --mode single --tables "$n" --iters "$iters")
    batched=$(collected --mode batched --tables "$n" --iters "$iters")
    awk -v n="$n" -v it="$iters" -v s="$single" -v t="$batched" 'BEGIN {
        ps = s / (n * it); pb = t / (n * it);
        printf "%7d %14.1f %14.1f %10.3f\n", n, ps, pb, pb / ps }'
done
echo
"$bin"
