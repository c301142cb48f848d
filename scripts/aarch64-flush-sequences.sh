#!/usr/bin/env bash
# Prints, from the aarch64 test kernel as built (qemu-test-aarch64/), the
# barriers and TLB invalidations each flush kind of the crate's aarch64
# `Arch` executes, and fails when one is not the documented sequence
# (src/arch/aarch64.rs, "What each flush executes"):
#   local page / ASID / everything: DSB NSHST; TLBI VAE1|VAAE1 / ASIDE1 |
#     VMALLE1 / VMALLE1; DSB NSH; ISB
#   broadcast page / ASID / everything: DSB ISHST; TLBI ...IS (no wait)
# (the page flushes checked are the _sized ones the crate calls: a level
# hint, when the CPU has FEAT_TTL, changes the operand, not the sequence)
#   a batched unmap: the TLBI issued when a page is added (the batch's
#     record calls broadcast_flush_page_sized), and its flush waits with
#     DSB ISH; ISB and issues no TLBI of its own.
# (The second TLBI after a DSB ISH in each is the repeat-TLBI errata path,
# taken only when Config::with_repeated_tlbi asked for it.)
# Needs llvm-objdump (Debian's llvm; scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
# What it needs (QEMU 10, the bare-metal target, binutils, ...), installed
# when missing, so that the script runs alone from a fresh clone too.
scripts/setup.sh

kernel=qemu-test-aarch64/target/aarch64-unknown-none/release/tlb-batch-qemu-test-aarch64
(cd qemu-test-aarch64 && cargo build --release --quiet)
dis=$(mktemp)
trap 'rm -f "$dis"' EXIT
# -C: demangled v0 names (qemu-test-aarch64/.cargo/config.toml asks for
# v0), which name a generic function's type arguments, so the copy for
# the crate's own Aarch64 is told from the test wrappers' copies.
llvm-objdump -d -C --no-show-raw-insn "$kernel" >"$dis"

failed=0
# body NAME: the barrier, TLBI, ISB and call lines of the function whose
# demangled name is exactly NAME (calls shown by their last path segment).
body() {
    awk -v name="<$1>:" '
        /^[0-9a-f]+ </ { if (done) exit; p = substr($0, index($0, " ") + 1) == name; if (p) done = 1; next }
        p && /\t(tlbi|dsb|isb|bl)(\t|$)/ { sub(/^[ \t0-9a-f]+:[ \t]+/, ""); sub(/[ \t]0x[0-9a-f]+ </, " <"); gsub(/\t/, " "); print }
    ' "$dis"
}
# expect NAME PATTERN REGEX [ABSENT]: prints NAME's sequence; REGEX must
# match the sequence joined with "; ", and ABSENT must not.
expect() {
    local seq
    seq=$(body "$2" | sed -E 's/<core::panicking::[a-z_]*>$/<a bounds-check panic>/; s/<.*::([a-z_]+)(::<.*>)?>$/<\1>/' |
        paste -sd ';' - | sed 's/;/; /g')
    printf '%-32s %s\n' "$1:" "${seq:-(not found)}"
    if ! grep -qE "$3" <<<"$seq" || { [ -n "${4:-}" ] && grep -qE "$4" <<<"$seq"; }; then
        echo "    FAIL: expected /$3/${4:+ without /$4/}"
        failed=$((failed + 1))
    fi
}
arch='<tlb_batch::arch::aarch64::Aarch64 as tlb_batch::arch::Arch>::'
batch='<tlb_batch::batch::TlbFlushUnmapBatch>::'
for_arch='::<tlb_batch::arch::aarch64::Aarch64>'
# The page flushes the crate calls are the sized ones (a level hint, when
# given, is in the operand, so the sequence is the same); the one-ASID and
# the all-ASID (global page) branches come in whichever order the compiler
# lays them out, each with its own barriers.
either() { printf '^(%s; %s|%s; %s)$' "$1" "$2" "$2" "$1"; }
expect "local page" "${arch}flush_local_page_sized" "$(either \
    'dsb nshst; tlbi vae1, x8; dsb ish; tlbi vae1, x8; dsb nsh; isb' \
    'dsb nshst; tlbi vaae1, x8; dsb ish; tlbi vaae1, x8; dsb nsh; isb')"
expect "local ASID" "${arch}flush_local_asid" '^dsb nshst; tlbi aside1, x8; dsb ish; tlbi aside1, x8; dsb nsh; isb; tlbi vmalle1; dsb ish; tlbi vmalle1; dsb nsh; isb$'
expect "local everything" "${arch}flush_local_all" '^dsb nshst; tlbi vmalle1; dsb ish; tlbi vmalle1; dsb nsh; isb$'
expect "broadcast page (no wait)" "${arch}broadcast_flush_page_sized" "$(either \
    'dsb ishst; tlbi vae1is, x8; dsb ish; tlbi vae1is, x8' \
    'dsb ishst; tlbi vaae1is, x8; dsb ish; tlbi vaae1is, x8')"
expect "broadcast ASID (no wait)" "${arch}broadcast_flush_asid" '^dsb ishst; tlbi aside1is, x8; dsb ish; tlbi aside1is, x8; tlbi vmalle1is; dsb ish; tlbi vmalle1is$'
expect "broadcast everything (no wait)" "${arch}broadcast_flush_all" '^dsb ishst; tlbi vmalle1is; dsb ish; tlbi vmalle1is$'
expect "batch: page added" "${batch}record${for_arch}" '^bl <broadcast_flush_page_sized>; ' 'tlbi|dsb'
# The wait and the shootdown of the other path, in whichever order the
# compiler lays them out.
expect "batch: flush" "${batch}flush${for_arch}" '(bl <shootdown>.*; dsb ish; isb; |dsb ish; isb; .*bl <shootdown>)' 'tlbi'
if [ "$failed" -ne 0 ]; then
    echo "aarch64 flush sequences: $failed not as documented"
    exit 1
fi
echo "aarch64 flush sequences: as documented"
