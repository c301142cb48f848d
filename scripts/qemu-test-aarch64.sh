#!/usr/bin/env bash
# Builds the bare-metal aarch64 test kernel (qemu-test-aarch64/) and runs it
# on QEMU's virt machine (TCG), each run with a timeout:
#   the shootdown scenarios (unmap, remap, a batched list of pages, a batch
#   past the full-flush ceiling, mprotect with a reclaim batch pending; all
#   through the crate's aarch64 Arch), the reclaim flow (aging with
#   page_referenced, then try_to_unmap, flush_dirty and flush; it needs a
#   hardware access flag, so it runs on "max" and says "skipped" on the
#   Cortex-A72) and the teardown with batched table free (MmuGather tearing
#   down 4 leaf tables of written pages while CPU 1 walks the tables
#   locklessly with interrupts masked; tables freed after ipi_sync, the
#   only user of the IPI hook, since the flush itself is a broadcast TLBI
#   that sends no IPI; its counts checked exactly: 512 pages unmapped, 80
#   tables freed, 16 flushes with 0 IPIs, 16 syncs with one IPI per other
#   CPU each) and the clean writes after unmap (TCR_EL1.HD on,
#   pages mapped clean, read-only with DBM: after a batched try_to_unmap,
#   before any flush, every store to a clean page must fault, the hardware
#   finding its descriptor gone when it tries to set it dirty, while a
#   dirty page's store may land until flush_dirty and none after it; it
#   needs hardware dirty state, so it runs on "max" and says "skipped" on
#   the Cortex-A72) and the 2 MiB block unmap (a level 2 block descriptor
#   unmapped whole through a batched try_to_unmap while the other CPUs
#   read it, the block reused after the flush: one TLBI VAE1IS issued on
#   add, one broadcast, every read after the flush faulting; counts checked
#   exactly, after a measurement of what TCG keeps of a block, printed;
#   then change_protection of the whole block to read-only while the
#   other CPUs store into it, every store after it returned faulting)
#   and the 2 MiB block split (split_huge_mapping: the descriptor broken,
#   one TLBI VAE1IS at the 2 MiB stride, a level 3 table made with 8 of
#   the 32 pieces the other CPUs read and store into moved to other
#   frames, whose old frames are reused, and 8 read-only: no read of an
#   old frame through a moved piece, no store landed on a read-only one;
#   after a measurement that the old block survives a split with no TLBI)
#   and the 2 MiB block teardown (MmuGather::unmap_range with IpiSync over
#   a level 2 table's gigabyte holding one block: the block cleared whole,
#   its frame freed once after the flush and reused, the table freed after
#   the flush and the sync, one whole-ASID TLBI ASIDE1IS, one IPI per other
#   CPU from the sync; every read of the other CPUs after it faulting;
#   after a measurement, printed and required, of whether TCG keeps a walk
#   cache: it keeps none, so a table freed with no walk-cache flush cannot
#   fail here),
#   both with exact counts,
#   with 4 Cortex-A72 CPUs and with 2 "max" CPUs (which must pass);
#   then the negative controls, which must fail, every scenario on stale
#   reads (never a timeout or a crash; the block unmap on reads
#   of the reused block, its mprotect on stores that landed after it, the
#   split on old frames read through moved pieces and stores landed on
#   read-only ones, the block teardown on reads of the reused block):
#   "negative" (the TLBIs
#   skipped) and "negative-local" (TLBIs that reach CPU 0 only), on the
#   Cortex-A72 and again on "max" for the reclaim flow (where the clean
#   writes fail too, on stores to dirty pages that landed after
#   flush_dirty, while every store to a clean page still faults: the
#   re-walk needs no flush); "negative-dirty" on "max" (the clean pages
#   mapped writable, AP[2] = 0, but reported clean to the crate), which
#   must fail the clean writes alone, on stores landed after the unmap;
#   "negative-teardown"
#   (the tables freed right after the flush, TableFreePolicy::AfterFlush),
#   which must fail the teardown alone, because its walker read a freed,
#   poisoned table (not a stale read, not a timeout); "negative-catchup"
#   (a lazy CPU leaves lazy mode without its catch-up TLBI), which must
#   fail the generations scenario alone, on the old frame read. The
#   generations scenario's counts (broadcasts a flush makes once AP 1
#   switched away or went lazy, catch-ups, ipi_sync's reach) are checked
#   exactly in the passing runs.
# Last, "negative-nodsb": the teardown's broadcast flush without the
#   DSB ISH that waits for its TLBIs to complete on the other CPUs. It is
#   run and reported, but not required to fail: QEMU's TCG carries out a
#   TLBI ...IS on every vCPU before the issuing vCPU runs its next
#   instruction (tlb_flush_*_all_cpus_synced), so the barrier has nothing
#   left to wait for and the control passes; only hardware can show it. If
#   a QEMU ever fails it on stale reads, the script says so and counts that
#   as the control working; any other failure counts as a failure.
# Then the 64 KiB granule ("granule64": TCR_EL1.TG0 = 0b01, TG1 = 0b11,
#   64 KiB test pages over 64 KiB frames, the crate's Aarch64 with a
#   64 KiB base page) on 2 "max" CPUs (FEAT_TTL: level hints on) and on 4
#   Cortex-A72 CPUs (no FEAT_TTL: no hints), which must pass: the shared
#   scenarios with the 4 KiB run's exact counts (one TLBI per 64 KiB page),
#   the "64 KiB granule TLBIs" scenario (every wrapper Arch answers 64 KiB;
#   4 page TLBIs for a 4-page flush_tlb_range, 1 with the 64 KiB leaf size
#   for a batched try_to_unmap), the generations scenario with the 4 KiB
#   run's exact lines (its roots copies of the 64-entry level 1 table, its
#   frames 64 KiB), the teardown with batched table free with the 4 KiB
#   run's exact counts (its tables 64 KiB frames of 8192 entries: a level
#   2 table over 4 TiB below entry 2 of the 64-entry level 1 root, 4 leaf
#   tables of 512 MiB; 512 pages unmapped and 80 tables freed in 16
#   rounds, 16 flushes with 0 IPIs, 16 syncs with one IPI per other CPU
#   each), and the four block scenarios over a level 2 block of 512 MiB
#   with the 2 MiB block's exact counts (32 pieces of 64 KiB; the split
#   into a 64 KiB level 3 table of 8192 pages; the teardown of a level 2
#   table over 4 TiB hanging from the root's entry 3), the runs given
#   4 GiB of RAM for their six 512 MiB blocks; on "max" the clean
#   writes after unmap too (16 pages of 64 KiB at the start of the test
#   pages' leaf table); on "max" the kernel measures what
#   TCG does with a wrong TTL hint, which the script reports (TCG ignores
#   TTL, so no control rests on it). Then "granule64 negative" on the
#   Cortex-A72 and "granule64 negative-local" on "max", which must fail
#   every shared scenario and the teardown on stale reads, and the block
#   scenarios as at 4 KiB (negative-local the clean writes too, on late
#   stores to dirty pages), "granule64
#   negative-dirty" on
#   "max", which must fail the clean writes alone, on stores landed after
#   the unmap, "granule64 negative-catchup"
#   on "max", which must fail the generations scenario alone, on the lazy
#   CPU's read of the old 64 KiB frame, and "granule64 negative-teardown"
#   on the Cortex-A72, which must fail the teardown alone, its walker
#   having read a freed, poisoned 64 KiB table (no stale read, no
#   timeout).
# Every run, negative controls included, ends with the offline scenario,
#   whose flushes are the real ones and which must pass: the last CPU goes
#   offline (take_offline) and comes back (bring_online) again and again
#   while the others run ipi_sync, every sync completes, and the CPU reads
#   no stale page after.
# Prints each run's boot-to-exit wall time. Two to three minutes on a
# 2-core machine under a load average of about 10 (the seven 64 KiB runs
# add about 45 s of boot-to-exit time in all); 96 s under a load average
# of about 1.5. With the block scenarios at 64 KiB: 2 min 14 s under a
# load average of about 15 (the seven 64 KiB runs 61 s in all, the
# longest run 13.6 s of its 60 s limit), 1 min 33 s at about 5 (39 s,
# the longest 11.6 s).
# Needs: the aarch64-unknown-none target and qemu-system-aarch64 (Debian
# 12: qemu-system-arm from bookworm-backports); scripts/setup.sh installs
# what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# What it needs (QEMU 10, the bare-metal target, binutils, ...), installed
# when missing, so that the script runs alone from a fresh clone too.
scripts/setup.sh
(cd qemu-test-aarch64 && cargo build --release --quiet)
kernel=qemu-test-aarch64/target/aarch64-unknown-none/release/tlb-batch-qemu-test-aarch64

passed=0
failed=0
# Every failure is said where it happens and again at the end, where a
# log cut to its last lines (as CI's summary is) still shows it.
failures=()
fail() {
    failed=$((failed + 1))
    failures+=("$1")
    echo "$1"
}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# run NAME EXPECTED_EXIT CPUS CPU_MODEL CMDLINE [TIMEOUT_SECONDS]
# The 4 KiB runs have 128 MiB of RAM. The granule64 runs have 4 GiB: the
# block scenarios take six 512 MiB blocks, aligned to their size, below
# the top of RAM (0x4000_0000 + 4 GiB), which leaves the kernel the
# gigabyte at 0x4000_0000; QEMU allocates guest RAM as it is first
# touched, and the scenarios touch 32 MiB of each block.
run() {
    local name=$1 expected=$2 smp=$3 model=$4 cmdline=$5 limit=${6:-60} start end code line ram=128M
    case " $cmdline " in *" granule64 "*) ram=4G ;; esac
    start=$(date +%s.%N)
    set +e
    timeout "$limit" qemu-system-aarch64 -machine virt -cpu "$model" -smp "$smp" -m "$ram" \
        -nographic -semihosting -no-reboot -accel tcg -kernel "$kernel" -append "$cmdline" </dev/null >"$log" 2>&1
    code=$?
    set -e
    end=$(date +%s.%N)
    # The serial console ends lines with CR LF: dropped here, once, so that
    # the checks grep the file itself. A check written as
    # `tr -d '\r' <"$log" | grep -q ...` fails at random under pipefail:
    # grep -q exits at its first match, and tr, still writing, dies of
    # SIGPIPE (measured: about 1 check in 10 on a 5 KiB log).
    tr -d '\r' <"$log" >"$log.lf"
    mv "$log.lf" "$log"
    sed 's/^/    | /' "$log"
    if [ "$code" -eq "$expected" ] || { [ "$expected" = "$EITHER" ] && { [ "$code" -eq "$PASS" ] || [ "$code" -eq "$FAIL" ]; }; }; then
        passed=$((passed + 1))
        printf 'qemu-aarch64 %-42s ok   (exit %d, %.2f s boot to exit)\n' "$name" "$code" "$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')"
    else
        fail "$(printf 'qemu-aarch64 %-42s FAIL (exit %d, expected %s)' "$name" "$code" "$expected")"
        # The scenarios that failed, for the summary at the end.
        while IFS= read -r line; do
            failures+=("    $line")
        done < <(grep -E '^scenario .*: FAIL' "$log" | cut -c1-600)
    fi
}

# failed_for_stale SCENARIO: the last run's line for SCENARIO must say FAIL
# and count at least one stale read (a negative control that failed for any
# other reason, a timeout or a wrong value, does not count).
failed_for_stale() {
    if ! grep -qE "^scenario $1: FAIL .*stale: [1-9][0-9]* reads of the old frame, 0 other, 0 timeouts" "$log"; then
        fail "qemu-aarch64 negative control: '$1' did not fail on stale reads alone"
    fi
}

PASS=0
FAIL=3 # EXIT_FAIL in qemu-test-aarch64/src/main.rs; 4 is a fatal error
EITHER=-1 # a run whose verdict is read from its output, not its status
TEARDOWN="teardown with batched table free"
DIRTY="clean writes after unmap"
# The block scenarios' names: "$SIZE block unmap" (mprotect, split,
# teardown), SIZE the level 2 block's, "2 MiB" or (granule64) "512 MiB".

# exact_line REGEX WHAT: the last run must hold a line matching REGEX (a
# whole line; literal parentheses in it are escaped here).
exact_line() {
    local want=$1
    want=${want//(/\\(}
    want=${want//)/\\)}
    if ! grep -qE "^$want\$" "$log"; then
        fail "qemu-aarch64: $2"
    fi
}

# block_shape SIZE: sets size, the block's ("2 MiB" or "512 MiB"), pages,
# the entries of the level 3 table a split makes, and span, what the
# level 2 table the block teardown frees maps.
block_shape() {
    size=${1:-2 MiB}
    if [ "$size" = "512 MiB" ]; then pages=8192 span="4 TiB"; else pages=512 span="1 GiB"; fi
}

# split_teardown_counted CPUS [SIZE]: the last run's block split and
# block teardown lines, PASS with their exact counts, and the
# measurements the controls rest on: a split with no TLBI leaves the old
# block readable through moved pieces and writable through read-only
# ones; with no TLBI the pieces a CPU read keep the old block (the
# teardown's premise). The walk-cache line is required too (it says what
# TCG cannot show), whatever it measured.
split_teardown_counted() {
    local others=$(($1 - 1)) size pages span
    block_shape "${2:-}"
    exact_line "scenario $size block split: PASS (flush through the crate; $1 CPUs reading and storing into 32 pieces; break: the old descriptor a block over S: true; flush: page TLBIs 1, full flushes 0, shootdowns 1, broadcasts 1, IPIs 0; make: a level 3 table of $pages pages, 8 of the used pieces moved to other frames, 8 read-only, linked: true; after the make and the reuse of the old frames: [1-9][0-9]* reads of the new frames through moved pieces, [1-9][0-9]* of the block through kept pieces, [1-9][0-9]* stores to read-only pieces faulted, [1-9][0-9]* to the others landed; stale: 0 reads of the old block and 0 of the reused frames through moved pieces, 0 stores landed on read-only pieces, 0 other)" \
        "$size block split, $1 cpus: the split did not pass with its exact counts"
    exact_line "scenario $size block teardown: PASS (flush through the crate; $1 CPUs reading 32 pieces; unmap_range of the level 2 table's $span with IpiSync: 1 page unmapped, dirty moved to the block: 1; the block's first frame handed to free_batch 1 times (after the flush: 1), reused at once, other frames 0, handed back 0; tables freed 1 (after the flush and the sync: 1, the level 1 entry cleared: true); page TLBIs 0, full flushes 1, shootdowns 1, broadcasts 1, IPIs: 0 by the flush, $others by the sync (1 hook call); after the reuse: [1-9][0-9]* reads faulted; stale: 0 reads of the old block, 0 of the reused block, 0 other)" \
        "$size block teardown, $1 cpus: the teardown did not pass with its exact counts"
    if ! grep -qE "^block split: a $size block's .*moved pieces read the old block: [1-9][0-9]* of .*read-only pieces took a store: [1-9][0-9]* of " "$log"; then
        fail "qemu-aarch64 $size block split, $1 cpus: the measurement kept the old block in no moved or no read-only piece (its control could not fail)"
    fi
    if ! grep -qE "^block teardown: .*used pieces read the old block: [1-9][0-9]* of .*unused pieces read through the old table: [0-9]+ of " "$log"; then
        fail "qemu-aarch64 $size block teardown, $1 cpus: the measurement saw no stale piece (its control could not fail)"
    fi
}

# block_counted CPUS [SIZE]: the last run's block lines: the measurement
# (which must show a stale piece, the controls' premise) and the unmap's
# and the mprotect's PASS with their exact counts.
block_counted() {
    local size pages span want
    block_shape "${2:-}"
    want="scenario $size block unmap: PASS (flush through the crate; $1 CPUs reading 32 pieces; try_to_unmap: Ok(SuccessCached), pages pending in the batch: 1, descriptor cleared: true, dirty frames reported: 1; page TLBIs issued on add: 1, in all: 1, full flushes: 0, shootdowns: 1, broadcasts: 1, IPIs: 0; after the flush and the reuse: [1-9][0-9]* reads faulted; stale: 0 reads of the old block, 0 of the reused block, 0 other)"
    want=${want//(/\\(}
    want=${want//)/\\)}
    if ! grep -qE "^$want\$" "$log"; then
        fail "qemu-aarch64 $size block, $1 cpus: the block unmap did not pass with its exact counts"
    fi
    if ! grep -qE "^scenario $size block mprotect: PASS \(flush through the crate; $1 CPUs storing into 32 pieces; entries changed: Ok\(1\), still a read-only block over A with its access flag: true; page TLBIs: 1, full flushes: 0, shootdowns: 1, broadcasts: 1, IPIs: 0; stores begun after the call: [1-9][0-9]* faulted, 0 landed \(0 pieces hold a late store\)\)\$" "$log"; then
        fail "qemu-aarch64 $size block, $1 cpus: the block mprotect did not pass with its exact counts"
    fi
    if ! grep -qE "^block: a $size block's .*used pieces read the old block: [1-9][0-9]* of " "$log"; then
        fail "qemu-aarch64 $size block, $1 cpus: the measurement saw no stale piece (its control could not fail)"
    fi
}

# block_failed_stale [SIZE]: the last run's block lines must say FAIL,
# the unmap with reads of the reused block through the stale
# translation, the mprotect with stores that landed after it returned.
block_failed_stale() {
    local size pages span
    block_shape "${1:-}"
    if ! grep -qE "^scenario $size block unmap: FAIL .*page TLBIs issued on add: 1, in all: 1, full flushes: 0, shootdowns: 1, broadcasts: 1, IPIs: 0; .*stale: [0-9]+ reads of the old block, [1-9][0-9]* of the reused block, 0 other\)" "$log"; then
        fail "qemu-aarch64 negative control: the $size block unmap did not fail on reads of the reused block"
    fi
    if ! grep -qE "^scenario $size block mprotect: FAIL .*entries changed: Ok\(1\), .*page TLBIs: 1, full flushes: 0, shootdowns: 1, broadcasts: 1, IPIs: 0; stores begun after the call: [0-9]+ faulted, [1-9][0-9]* landed" "$log"; then
        fail "qemu-aarch64 negative control: the $size block mprotect did not fail on stores landed after it returned"
    fi
    # The split with its counts as in a passing run, failing on moved
    # pieces read through the old block (either pattern) and on stores
    # landed on read-only pieces.
    if ! grep -qE "^scenario $size block split: FAIL .*flush: page TLBIs 1, full flushes 0, shootdowns 1, broadcasts 1, IPIs 0; make: a level 3 table of $pages pages, .*linked: true; .*stale: ([1-9][0-9]* reads of the old block and [0-9]+|[0-9]+ reads of the old block and [1-9][0-9]*) of the reused frames through moved pieces, [1-9][0-9]* stores landed on read-only pieces, 0 other\)" "$log"; then
        fail "qemu-aarch64 negative control: the $size block split did not fail on moved pieces read through the old block"
    fi
    if ! grep -qE "^scenario $size block teardown: FAIL .*unmap_range of the level 2 table's $span with IpiSync: 1 page unmapped, .*handed to free_batch 1 times \(after the flush: 1\), .*tables freed 1 \(after the flush and the sync: 1, .*page TLBIs 0, full flushes 1, shootdowns 1, broadcasts 1, IPIs: 0 by the flush, .*stale: [0-9]+ reads of the old block, [1-9][0-9]* of the reused block, 0 other\)" "$log"; then
        fail "qemu-aarch64 negative control: the $size block teardown did not fail on reads of the reused block"
    fi
}

# offline_counted: the last run's offline scenario passed, its CPU went
# offline and came back at least once without an error, and every sync
# completed (one stranded by the CPU leaving would hang the run instead,
# which the timeout catches).
offline_counted() {
    if ! grep -qE '^scenario cpu offline: PASS \([0-9]+ CPUs: CPU [0-9]+ went offline and came back [1-9][0-9]* times, serving [0-9]+ requests on its way out, 0 errors; .* ([0-9]+)/\1 completed,' "$log"; then
        fail "qemu-aarch64 cpu offline: the scenario did not report its CPU back and every sync completed"
    fi
}

# teardown_counted CPUS GRANULE: the last run's teardown line, PASS with
# its exact counts at GRANULE (4 or 64 KiB): 16 rounds of 32 pages
# unmapped and freed and 5 tables freed (4 leaf tables and their level 2
# table), one flush per round with no IPI, one ipi_sync per round with an
# IPI to each other CPU, the walker never reading a freed table, every
# read after a teardown faulting. The walks and the walker's leaf visits
# vary from run to run.
teardown_counted() {
    local others=$(($1 - 1)) shape
    if [ "$2" = 64 ]; then shape="of 64 KiB in 4 leaf tables of 8192 entries below a level 2 table over 4 TiB"; else
        shape="of 4 KiB in 4 leaf tables of 512 entries below a level 2 table over 1 GiB"; fi
    exact_line "scenario $TEARDOWN: PASS (16 rounds x 32 pages $shape, written by CPU 0, torn down by MmuGather (512 pages unmapped), tables freed after an IPI sync (IpiSync), flush on every CPU: 512 data frames and 80 tables freed, 0 of them before the flush, 0 tables while a walk could hold them, 512 pages dirty, 0 handed back, 0 errors, 0 frames leaked; 16 flushes sent 0 IPIs (0 hook calls), 16 table-free syncs sent $((16 * others)) IPIs (16 hook calls); walker on CPU 1, lockless, interrupts masked: [0-9]+ walks, [1-9][0-9]* reached a leaf table, walker read 0 freed tables; CPU 1 after each teardown: 512 reads faulted as they must, stale: 0 reads of the old frame, 0 other, 0 timeouts, [0-9]+ ms)" \
        "teardown, $1 cpus, $2 KiB: the teardown did not pass with its exact counts"
}

# teardown_failed_walker TALLY NAME GRANULE: tables freed right after the
# flush (negative-teardown): the teardown alone failed (TALLY is the run's
# last line), at GRANULE (4 or 64 KiB), its walker having read a freed
# table, with every count of the
# unmap as in a passing run, no stale read and no timeout.
teardown_failed_walker() {
    if ! grep -qE "^scenario $TEARDOWN: FAIL \(16 rounds x 32 pages of $3 KiB .*torn down by MmuGather \(512 pages unmapped\), tables freed right after the flush \(AfterFlush, negative control\), flush on every CPU: 512 data frames and 80 tables freed, 0 of them before the flush, [1-9][0-9]* tables while a walk could hold them, .*; 16 flushes sent 0 IPIs \(0 hook calls\), 0 table-free syncs sent 0 IPIs \(0 hook calls\); .*walker read [1-9][0-9]* freed tables; .*stale: 0 reads of the old frame, 0 other, 0 timeouts" "$log" ||
        ! grep -q "^$1\$" "$log"; then
        fail "qemu-aarch64 negative control: '$2' did not fail on the walker reading a freed table alone"
    fi
}

# generations_counted CPUS: the last run's generations lines, exact. A
# broadcast TLBI needs no IPI, so what the CPU sets decide here is whether
# a flush is broadcast at all (a frame pool's too); ipi_sync interrupts
# every other CPU anyway.
generations_counted() {
    local others=$(($1 - 1)) want
    for want in \
        "scenario generations: PASS (AP 1 on A: a flush of A made 1 broadcast; AP 1 switched to B: 0 broadcasts, 0 shootdowns, catch-ups when back on A: 1; AP 1 lazy on A: 0 broadcasts, 0 shootdowns, ipi_sync still reached $others of $others other CPUs with 1 hook call, catch-ups at leave_lazy_tlb: 1; stale: 0 reads of an old frame)" \
        "generations, frame pool: AP 1 on A: P unmapped with its flush deferred: true, 1 frame pooled and 1 released at once with 0 IPIs (page TLBIs issued on add: 1, broadcasts completing them: 1), then AP 1 faulted: true; AP 1 switched to B: deferred: false, 1 pooled and 1 released at once with 0 IPIs (page TLBIs: 0, broadcasts: 0), catch-ups when back on A: 1, then AP 1 faulted: true" \
        "$NO_KEEP"; do
        # Whole lines (the carriage returns were dropped by `run`).
        if ! grep -qxF -- "$want" "$log"; then
            fail "qemu-aarch64 generations, $1 cpus: missing: $want"
        fi
    done
}
# What the generations scenario measured: QEMU's TCG drops a vCPU's whole
# TLB when TTBR0_EL1's ASID field changes (vmsa_ttbr_write), so a skipped
# catch-up at a switch cannot be caught here.
NO_KEEP="generations: ASID-tagged entries kept across a TTBR0_EL1 change: no (AP 1 cached P in ASID 0x11, switched to ASID 0x12, P remapped with no TLBI, back on ASID 0x11 with 0 catch-ups it read the new frame): a skipped catch-up at a switch cannot be observed under this TCG, so it has no negative control"
run "cortex-a72, 4 cpus" $PASS 4 cortex-a72 ""
offline_counted
teardown_counted 4 4
generations_counted 4
block_counted 4
split_teardown_counted 4
if ! grep -q "^scenario $DIRTY: skipped: no hardware dirty state" "$log"; then
    fail "qemu-aarch64 cortex-a72: the clean writes were not skipped for want of hardware dirty state"
fi
run "max, 2 cpus" $PASS 2 max ""
offline_counted
teardown_counted 2 4
generations_counted 2
block_counted 2
split_teardown_counted 2
if ! grep -q "^scenario reclaim flow: PASS" "$log"; then
    fail "qemu-aarch64 max: the reclaim flow did not run and pass"
fi
if ! grep -q "^scenario $DIRTY: PASS" "$log"; then
    fail "qemu-aarch64 max: the clean writes after unmap did not run and pass"
fi
run "negative control: no TLBI (must fail)" $FAIL 4 cortex-a72 "negative"
offline_counted
for s in "unmap shootdown" "remap shootdown" "a list" "past the ceiling" "mprotect with a pending batch" "$TEARDOWN"; do
    failed_for_stale "$s"
done
block_failed_stale
run "negative control: local TLBI (must fail)" $FAIL 4 cortex-a72 "negative-local"
offline_counted
for s in "unmap shootdown" "remap shootdown" "a list" "past the ceiling" "mprotect with a pending batch" "$TEARDOWN"; do
    failed_for_stale "$s"
done
block_failed_stale

# dirty_failed_late: the last run's clean-write line must say FAIL on
# stores to dirty pages that landed after flush_dirty, with every store to
# a clean page faulted (none landed after the unmap).
dirty_failed_late() {
    if ! grep -qE "^scenario $DIRTY: FAIL .*stores landed after unmap: 0 \(0 words .*stores landed after flush_dirty: [1-9]" "$log"; then
        fail "qemu-aarch64 negative control: the clean writes did not fail on late stores to dirty pages alone"
    fi
}

# The reclaim flow and the clean writes need the hardware access flag
# and dirty state of "max".
run "max negative control: no TLBI (must fail)" $FAIL 2 max "negative"
offline_counted
failed_for_stale "reclaim flow"
failed_for_stale "mprotect with a pending batch"
failed_for_stale "$TEARDOWN"
dirty_failed_late
block_failed_stale
run "max negative control: local TLBI (must fail)" $FAIL 2 max "negative-local"
offline_counted
failed_for_stale "reclaim flow"
failed_for_stale "mprotect with a pending batch"
failed_for_stale "$TEARDOWN"
dirty_failed_late
block_failed_stale

# Clean pages mapped writable but reported clean: the clean writes alone
# fail, on stores that landed after the unmap (in the frames too), with
# the flushes themselves intact (nothing landed after flush_dirty).
# dirty_failed_writable TALLY NAME: the clean writes alone failed (TALLY
# is the run's last line), on stores landed after the unmap.
dirty_failed_writable() {
    if ! grep -qE "^scenario $DIRTY: FAIL .*stores landed after unmap: [1-9][0-9]* \([1-9][0-9]* words of clean frames changed .*stores landed after flush_dirty: 0," "$log" ||
        ! grep -q "^$1\$" "$log"; then
        fail "qemu-aarch64 negative control: '$2' did not fail on stores landed after the unmap alone"
    fi
}
run "max negative control: clean pages writable (must fail)" $FAIL 2 max "negative-dirty"
offline_counted
dirty_failed_writable "12 passed, 1 failed" "negative-dirty"

# Tables freed right after the flush: the teardown alone fails, its walker
# having read a freed table, with no stale read and no timeout.
run "negative control: AfterFlush (must fail)" $FAIL 4 cortex-a72 "negative-teardown"
offline_counted
teardown_failed_walker "12 passed, 1 failed" "negative-teardown" 4

# No DSB ISH after the broadcast TLBIs: not detectable under TCG (see the
# header), so either verdict is accepted and reported; a failure must be
# the teardown's alone, on stale reads.
# The lazy catch-up's control: AP 1 leaves lazy mode with its local TLBI
# ASIDE1 skipped and must read the old frame through the entry it kept (a
# lazy CPU writes no TTBR0_EL1, so TCG keeps it). Only that scenario fails.
# catchup_failed TALLY: the generations scenario alone failed (TALLY is
# the run's last line), on the lazy CPU's one read of the old frame.
catchup_failed() {
    if ! grep -qE "^scenario generations: FAIL .*catch-ups at leave_lazy_tlb: 1; stale: 1 reads of an old frame\) \(reads below\)$" "$log" ||
        ! grep -q "while running A 0x6e6e00000001, back on A 0x6e6e00000002, after leave_lazy_tlb 0x6e6e00000002$" "$log" ||
        ! grep -q "^$1\$" "$log"; then
        fail "qemu-aarch64 negative control: '$2' did not fail on the lazy CPU's stale read alone"
    fi
}
run "negative control: no catch-up (must fail)" $FAIL 2 max "negative-catchup"
offline_counted
catchup_failed "12 passed, 1 failed" "negative-catchup"

# The 64 KiB granule ("granule64"): the shared scenarios over 64 KiB test
# pages with their exact counts (a batch of 48 pages is 48 page TLBIs,
# not 768), the granule scenario's TLBI counts (4 for a flush_tlb_range of
# 4 pages, 1 with the 64 KiB leaf size for a batched try_to_unmap; TTL
# 0b1111 on "max", which has FEAT_TTL, none on the Cortex-A72), the
# teardown with its 4 KiB run's counts over 64 KiB tables, the skipped
# lines of the scenarios that need a 2 MiB block, and
# what TCG did with a wrong level hint (reported: TCG ignores TTL, so no
# control rests on it).
G64="64 KiB granule TLBIs"
# granule64_counted CPUS MODEL: the last run's lines, exact.
granule64_counted() {
    local o=$(($1 - 1)) hints ttl
    if [ "$2" = max ]; then hints="present, so level hints are on" ttl="0b1111 (level hints on)"; else
        hints="absent, so level hints are off" ttl="0b0000 (level hints off)"; fi
    exact_line "granule64: ID_AA64MMFR0_EL1.TGran64 present; TCR_EL1 0x[0-9a-f]+ (TG0 = 0b01, TG1 = 0b11: 64 KiB), tables of levels 1 to 3 (T0SZ = 16), 64 KiB test pages; the crate's base page: 64 KiB; FEAT_TTL (ID_AA64MMFR2_EL1.TTL): $hints" \
        "granule64 $2: the granule line is missing or wrong"
    exact_line "scenario unmap shootdown: PASS (50 rounds x $o observing CPUs x 1 pages, flush on every CPU: $((50 * o)) faulted as they must, stale: 0 reads of the old frame, 0 other, 0 timeouts, IPIs sent: 0, [0-9]+ ms)" \
        "granule64 $2: the unmap did not pass with its counts"
    exact_line "scenario remap shootdown: PASS (50 rounds x $o observing CPUs x 1 pages, flush on every CPU: $((50 * o)) read the new frame, stale: 0 reads of the old frame, 0 other, 0 timeouts, IPIs sent: 0, [0-9]+ ms)" \
        "granule64 $2: the remap did not pass with its counts"
    exact_line "scenario a list: PASS (20 rounds x $o observing CPUs x 16 pages, flush on every CPU: $((320 * o)) faulted as they must, stale: 0 reads of the old frame, 0 other, 0 timeouts, 1 batch flush per round of a page list, 16 page and 0 whole-ASID invalidations issued as the pages were added, one barrier, 0 rounds off that, IPIs sent: 0, [0-9]+ ms)" \
        "granule64 $2: the list did not pass with one TLBI per 64 KiB page"
    exact_line "scenario past the ceiling: PASS (20 rounds x $o observing CPUs x 48 pages, flush on every CPU: $((960 * o)) faulted as they must, stale: 0 reads of the old frame, 0 other, 0 timeouts, 1 batch flush per round of a whole-ASID request, 48 page and 0 whole-ASID invalidations issued as the pages were added, one barrier, 0 rounds off that, IPIs sent: 0, [0-9]+ ms)" \
        "granule64 $2: past the ceiling did not pass with one TLBI per 64 KiB page"
    exact_line "scenario mprotect with a pending batch: PASS (20 rounds x $o observing CPUs x 16 pages, flush on every CPU: $((320 * o)) faulted (unmapped reads, read-only writes), stale: 0 reads of the old frame, 0 other, 0 timeouts, batch pending before change_protection and flushed by it, every page left made read-only: 0 rounds off that, IPIs sent: 0, [0-9]+ ms)" \
        "granule64 $2: the mprotect did not pass with its counts"
    if [ "$2" = max ]; then
        exact_line "scenario reclaim flow: PASS (20 rounds x $o observing CPUs x 16 pages, flush on every CPU: $((320 * o)) faulted on a reclaimed page or read a kept one, stale: 0 reads of the old frame, 0 other, 0 timeouts, hot pages kept and cold ones reclaimed, written out after the dirty flush, with 1 shootdown per aging and per reclaim pass: 0 rounds off that, IPIs sent: 0, [0-9]+ ms)" \
            "granule64 max: the reclaim flow did not pass with its counts"
    elif ! grep -q "^scenario reclaim flow: skipped: no hardware access flag" "$log"; then
        fail "qemu-aarch64 granule64 $2: the reclaim flow was not skipped for want of a hardware access flag"
    fi
    exact_line "scenario $G64: PASS (base page of the crate's Aarch64 and of every test wrapper: 64 KiB; flush_tlb_range of 4 pages: page TLBIs 4, with a leaf size 0; batched try_to_unmap of 1 page: Ok(SuccessCached), pending 1, page TLBIs 1, with a leaf size 1 (64 KiB), TTL in the operand $ttl; the page faults after the flush: true)" \
        "granule64 $2: the TLBI counts per 64 KiB page are not 4 and 1"
    if [ "$2" = max ]; then
        grep -q "^scenario $DIRTY: PASS" "$log" ||
            fail "qemu-aarch64 granule64 max: the clean writes after unmap did not run and pass"
    elif ! grep -q "^scenario $DIRTY: skipped: no hardware dirty state" "$log"; then
        fail "qemu-aarch64 granule64 $2: the clean writes were not skipped for want of hardware dirty state"
    fi
    teardown_counted "$1" 64
    # The block scenarios over a 512 MiB block, with the 2 MiB block's
    # exact counts (a 64 KiB split table of 8192 pages, a level 2 table
    # over 4 TiB torn down), and no block scenario skipped.
    block_counted "$1" "512 MiB"
    split_teardown_counted "$1" "512 MiB"
    if grep -q '^scenario .*block.*: skipped' "$log"; then
        fail "qemu-aarch64 granule64 $2: a block scenario was skipped"
    fi
    grep -q "^14 passed, 0 failed" "$log" || fail "qemu-aarch64 granule64 $2: not 14 passed, 0 failed"
}
run "granule64: max, 2 cpus" $PASS 2 max "granule64"
offline_counted
granule64_counted 2 max
generations_counted 2
# What TCG does with a level hint: the line must show the premise (the
# entry kept with no TLBI) and is reported; a wrong hint that drops the
# entry anyway is why no negative control rests on TTL.
if ! grep -qE "^granule64: what the emulator does with a level hint \(.*each round set up and cleaned: true\): no TLBI: A, the entry kept; .*the page with the right hint: B, the entry dropped$" "$log"; then
    fail "qemu-aarch64 granule64 max: the level hint measurement did not run or its premise failed"
elif grep -q "the page with a wrong hint (TTL 0b1110, level 2): B, the entry dropped" "$log"; then
    echo "qemu-aarch64 granule64: TCG ignores the TTL hint (a TLBI VAE1IS with a wrong level dropped the entry), and a" \
        "page TLBI of another 64 KiB page dropped it too: wrong hints and addresses cannot be caught here (not counted)"
else
    echo "qemu-aarch64 granule64: this QEMU kept the entry past a wrong TTL hint: a wrong-hint control could fail here"
fi
run "granule64: cortex-a72, 4 cpus" $PASS 4 cortex-a72 "granule64"
offline_counted
granule64_counted 4 cortex-a72
generations_counted 4
grep -q "^granule64: what the emulator does with a level hint: not measured (no FEAT_TTL" "$log" ||
    fail "qemu-aarch64 granule64 cortex-a72: the level hint line is missing"
# The controls at 64 KiB: every shared scenario must fail on stale reads,
# the teardown too, and the block scenarios as at 4 KiB (the counts in
# the tally: the unmap and the mprotect count as one); the granule
# scenario (real flushes) and the offline one still pass.
run "granule64 negative control: no TLBI (must fail)" $FAIL 4 cortex-a72 "granule64 negative"
offline_counted
for s in "unmap shootdown" "remap shootdown" "a list" "past the ceiling" "mprotect with a pending batch" "$TEARDOWN"; do
    failed_for_stale "$s"
done
block_failed_stale "512 MiB"
grep -q "^scenario $G64: PASS" "$log" && grep -q "^5 passed, 9 failed" "$log" ||
    fail "qemu-aarch64 granule64 negative: not the 5 shared scenarios, the teardown and the block scenarios alone failed"
run "granule64 max negative control: local TLBI (must fail)" $FAIL 2 max "granule64 negative-local"
offline_counted
for s in "unmap shootdown" "remap shootdown" "a list" "past the ceiling" "mprotect with a pending batch" "reclaim flow" "$TEARDOWN"; do
    failed_for_stale "$s"
done
# The clean writes fail as at 4 KiB: every store to a clean page faults,
# stores to dirty pages land after flush_dirty.
dirty_failed_late
block_failed_stale "512 MiB"
grep -q "^scenario $G64: PASS" "$log" && grep -q "^3 passed, 11 failed" "$log" ||
    fail "qemu-aarch64 granule64 max negative-local: not the 6 shared scenarios, the teardown, the clean writes and the block scenarios alone failed"
# Clean pages mapped writable but reported clean, at 64 KiB: the clean
# writes alone fail, on stores landed after the unmap.
run "granule64 max negative control: clean pages writable (must fail)" $FAIL 2 max "granule64 negative-dirty"
offline_counted
dirty_failed_writable "13 passed, 1 failed" "granule64 negative-dirty"
# The lazy catch-up's control at 64 KiB: a lazy CPU writes no TTBR0_EL1,
# so TCG keeps its 64 KiB entry too, and only the generations scenario
# fails, on that one read.
run "granule64 negative control: no catch-up (must fail)" $FAIL 2 max "granule64 negative-catchup"
offline_counted
catchup_failed "13 passed, 1 failed" "granule64 negative-catchup"
# Tables freed right after the flush, at 64 KiB: the teardown alone
# fails, its walker having read a freed 64 KiB table.
run "granule64 negative control: AfterFlush (must fail)" $FAIL 4 cortex-a72 "granule64 negative-teardown"
offline_counted
teardown_failed_walker "13 passed, 1 failed" "granule64 negative-teardown" 64

run "negative control: no DSB ISH (reported)" $EITHER 4 cortex-a72 "negative-nodsb"
offline_counted
if grep -q "^scenario $TEARDOWN: PASS" "$log" && grep -q "^13 passed, 0 failed" "$log"; then
    echo "qemu-aarch64 negative-nodsb: PASSED, as expected under TCG, which cannot show a missing DSB ISH: it completes" \
        "a TLBI ...IS on every vCPU before the issuing vCPU goes on; only hardware can (not counted either way)"
elif grep -qE "^scenario $TEARDOWN: FAIL .*stale: [1-9][0-9]* reads of the old frame, 0 other, 0 timeouts" "$log" &&
    grep -q "^12 passed, 1 failed" "$log"; then
    echo "qemu-aarch64 negative-nodsb: failed on stale reads: this QEMU shows a missing DSB ISH (the control works)"
else
    fail "qemu-aarch64 negative-nodsb: neither passed nor failed on stale reads alone"
fi

if [ "$failed" -ne 0 ]; then
    echo "what failed:"
    printf '  %s\n' "${failures[@]}"
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
