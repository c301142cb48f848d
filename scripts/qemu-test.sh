#!/usr/bin/env bash
# Builds the bare-metal SMP test kernel (qemu-test/) and runs its scenario
# matrix under QEMU (TCG), each run with a timeout:
#   xAPIC and x2APIC, with 4 CPUs (the all-but-self shorthand) and 2 CPUs
#   (a physical destination per CPU), every scenario (the shootdown ones,
#   the reclaim, migration, teardown and mprotect flows, the x86_64-crate
#   mapper, the scenario set shared with the aarch64 kernel, the pooled
#   reclaim flow and the flush generations with their exact counts, the
#   CR3 window, the storm, an AP going offline and coming back while the
#   others shoot, a 2 MiB page unmapped, split, made read-only and torn
#   down with its tables under the APs' accesses, with exact counts); then
#   the negative controls, which must fail, each scenario for its own
#   reason (a stale access caught, never a timeout or a crash); one timed
#   run; and the storm and the offline scenario alone at 16 and 64 CPUs.
#   Every run that must pass is also checked for the offline scenario's
#   counts (the AP came back at least once, every shootdown completed).
#   Prints each run's
#   boot-to-exit wall time. About 3 to 4 minutes on a 2-core machine.
# Needs: the x86_64-unknown-none target, objcopy, qemu-system-x86_64 (10.x
# for x2APIC under TCG); scripts/setup.sh installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# What it needs (QEMU 10, the bare-metal target, binutils, ...), installed
# when missing, so that the script runs alone from a fresh clone too.
scripts/setup.sh
(cd qemu-test && cargo build --release --quiet)
out=qemu-test/target/tlb-batch-qemu-test.bin
objcopy -O binary qemu-test/target/x86_64-unknown-none/release/tlb-batch-qemu-test "$out"

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
run() {
    local name=$1 expected=$2 smp=$3 model=$4 cmdline=$5 limit=${6:-120} start end code line
    start=$(date +%s.%N)
    set +e
    timeout "$limit" qemu-system-x86_64 -kernel "$out" -append "$cmdline" -smp "$smp" -cpu "$model" \
        -m 128M -display none -serial stdio -no-reboot -accel tcg \
        -device isa-debug-exit,iobase=0xf4,iosize=0x04 >"$log" 2>&1
    code=$?
    set -e
    end=$(date +%s.%N)
    sed 's/^/    | /' "$log"
    if [ "$code" -eq "$expected" ]; then
        passed=$((passed + 1))
        printf 'qemu %-34s ok   (exit %d, %.2f s boot to exit)\n' "$name" "$code" "$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')"
    else
        fail "$(printf 'qemu %-34s FAIL (exit %d, expected %d)' "$name" "$code" "$expected")"
        # The scenarios that failed, for the summary at the end.
        while IFS= read -r line; do
            failures+=("    $line")
        done < <(tr -d '\r' <"$log" | grep -E '^scenario .*: FAIL' | cut -c1-600)
    fi
}

# offline_counted: the last run's offline scenario passed, its AP went
# offline and came back at least once without an error, and every one of
# the others' shootdowns completed (a shootdown stranded by the AP leaving
# would hang the run instead, which the timeout catches).
offline_counted() {
    if ! grep -qE '^scenario cpu offline: PASS \([0-9]+ CPUs: CPU [0-9]+ went offline and came back [1-9][0-9]* times, serving [0-9]+ requests on its way out, 0 errors; .* ([0-9]+)/\1 completed,' "$log"; then
        fail "qemu cpu offline: the scenario did not report its AP back and every shootdown completed"
    fi
}

PASS=33 # (0x10 << 1) | 1
FAIL=35 # (0x11 << 1) | 1
# generations_counted CPUS: the last run's pooled reclaim flow and
# generations lines, with their exact counts for CPUS CPUs (no PCIDs under
# TCG: a switch flushes by its CR3 write, so it counts no catch-up).
generations_counted() {
    local aps=$(($1 - 1)) want
    # How many reads went through the APs' stale entries varies (a TLB
    # may drop an entry at any time, and QEMU's does): at least one.
    if ! grep -qxE "scenario pooled reclaim flow: PASS \(16 pages pooled with 0 IPIs, then read through the APs' TLBs [1-9][0-9]* of $((16 * aps)) times, frames intact: true; 0 released before the APs flushed; after a quiescent flush on $aps APs, 16 released by passes with 0 IPIs sent and 0 taken; 16 more pooled, AP 1 switched away, a forced flush sent $((aps - 1)) IPIs \($((aps - 1)) taken\) and released 16; stale: 0 reads after the flushes\)" "$log"; then
        fail "qemu generations, $1 cpus: missing the pooled reclaim flow's line with these counts"
    fi
    for want in \
        "scenario generations: PASS (AP 1 on A: a flush of A sent 1 IPI (1 taken); AP 1 switched to B: 0 IPIs (0 taken), catch-ups when back on A: 0 (no PCIDs: the CR3 write of the switch flushed A); AP 1 lazy on A: 0 IPIs (0 taken), catch-ups at leave_lazy_tlb: 1; stale: 0 reads of an old frame)" \
        "generations: PCID entries kept across a CR3 write: not applicable (PCIDs off: every CR3 write drops the non-global entries)"; do
        if ! grep -qxF -- "$want" "$log"; then
            fail "qemu generations, $1 cpus: missing: $want"
        fi
    done
}
# window_is LINE: the last run's CR3 window scenario (qemu-test/src/window.rs)
# printed exactly LINE after its name; window_control: its control failed
# with the AP left out of every flush, and on reads of the reused frame.
window_is() {
    grep -qxF "scenario cr3 window: $1" "$log" || fail "qemu cr3 window: not '$1'"
}
window_control() {
    grep -qE "^scenario cr3 window: FAIL .* asked 0, .* waited 0, IPIs it took after 0; .*stale: [1-9]" "$log" ||
        fail "qemu cr3 window control: did not fail on stale reads alone"
}
# huge_counted CPUS: the last run's 2 MiB page scenarios (qemu-test/src/huge.rs,
# huge_range.rs) passed with their exact counts for CPUS CPUs: one
# invalidation pending in the batch, one shootdown of the unmap, one of the
# split and one of the mprotect, each an IPI to every AP and one
# invalidation on every CPU; the teardown's one flush of the whole space on
# every CPU (its freed tables' span is past the ceiling) and its sync, an
# IPI each to every AP, the block's frame handed over once and both tables
# freed after the flush; how many accesses faulted varies, at least one.
huge_counted() {
    local aps=$(($1 - 1)) n=$1
    if ! grep -qxE "scenario huge page unmap: PASS \(2 MiB page mapped with map_to, read and written by $aps APs; try_to_unmap: SuccessCached, dirty moved to the frame: true; 1 invalidation pending \(full flush: false\), 1 flush, $aps remote CPUs, $aps IPIs sent and $aps taken, $n invalidations on $n CPUs; block reused after the flush, then [1-9][0-9]* AP accesses faulted; stale: 0 accesses went through after the flush \(0 reads of the reused block\)\)" "$log"; then
        fail "qemu huge page unmap, $1 cpus: missing the line with these counts"
    fi
    if ! grep -qxE "scenario huge page split: PASS \(2 MiB page mapped again; break, flush \(1 shootdown, $aps remote CPUs, $aps IPIs sent and $aps taken, $n invalidations on $n CPUs\), make: 512 entries over the same frames, pieces 48 to 63 read-only; then [1-9][0-9]* AP writes to them faulted and [1-9][0-9]* to the others landed; stale: 0 writes landed on a read-only piece or reads returned another value, 0 other\)" "$log"; then
        fail "qemu huge page split, $1 cpus: missing the line with these counts"
    fi
    if ! grep -qxE "scenario huge page mprotect: PASS \(2 MiB page written by $aps APs; change_protection of its 2 MiB to read-only: 1 entry changed, still a 2 MiB entry over the same block: true, dirty bit kept: true; 1 shootdown, $aps IPIs sent and $aps taken, $n invalidations on $n CPUs \(0 full\); then [1-9][0-9]* AP writes faulted, 512 of 512 pieces intact; stale: 0 writes landed after change_protection returned or reads returned another value, 0 other\)" "$log"; then
        fail "qemu huge page mprotect, $1 cpus: missing the line with these counts"
    fi
    if ! grep -qxE "scenario huge page teardown: PASS \(2 MiB page written by $aps APs; unmap_range of its PML4 entry's span with IpiSync: 1 page unmapped, dirty moved to the block: true, 1 flush \($((2 * aps)) IPIs sent and $((2 * aps)) taken with the sync, $n invalidations of the whole space on $n CPUs, 0 of a page\); handed to free_batch: the block's first frame 1 \(after the flush 1\), reused at once, other frames 0, handed back 0; tables freed 2 \(after the flush 2, the PML4 entry cleared: true\), syncs 1; then [1-9][0-9]* AP accesses faulted; stale: 0 accesses went through after the flush \(0 reads of the reused block\)\)" "$log"; then
        fail "qemu huge page teardown, $1 cpus: missing the line with these counts"
    fi
}
# huge_control: the last run's huge-page control failed all four scenarios
# on stale accesses, with TCG measured keeping the old 2 MiB translation (the
# control means something only then).
huge_control() {
    grep -q "^huge: the emulated TLB keeps a 2 MiB translation across a change of its entry with no flush: yes " "$log" ||
        fail "qemu huge control: TCG was not seen keeping the 2 MiB translation"
    failed_for_stale "huge page unmap"
    failed_for_stale "huge page split"
    failed_for_stale "huge page mprotect"
    failed_for_stale "huge page teardown"
}
window_ok="PASS (8 rounds: AP 1 read P in T 8, in S inside switch_mm after its CR3 write 8, in S's CPU set there 8; remote CPUs the flushes asked 8, requests the AP served while it waited 8, IPIs it took after 8; reads after the switch: 8 faults, stale: 0 reads of the reused frame, 0 other)"
run "xapic, 4 cpus" $PASS 4 qemu64 ""
generations_counted 4
huge_counted 4
window_is "$window_ok"
offline_counted
run "xapic, 2 cpus" $PASS 2 qemu64 ""
generations_counted 2
huge_counted 2
window_is "$window_ok"
offline_counted
run "x2apic, 4 cpus" $PASS 4 qemu64,+x2apic "x2apic"
generations_counted 4
huge_counted 4
window_is "$window_ok"
offline_counted
run "x2apic, 2 cpus" $PASS 2 qemu64,+x2apic "x2apic"
generations_counted 2
huge_counted 2
window_is "$window_ok"
offline_counted
# failed_for_stale SCENARIO: the last run's line for SCENARIO must say FAIL
# and its "stale:" part must count at least one stale access (a negative
# control that failed for any other reason does not count).
failed_for_stale() {
    local line
    line=$(grep -F "scenario $1: FAIL" "$log" || true)
    if [ -z "$line" ] || ! printf '%s\n' "${line#*stale: }" | grep -E '(^|[^0-9])[1-9][0-9]* ' >/dev/null; then
        fail "qemu negative control: '$1' did not fail on a stale access"
    fi
}

# shared_failed_for_stale SCENARIO: the same for a scenario of the set
# shared with the aarch64 kernel (qemu-scenarios/, prefixed "shared" here),
# whose line must also count no other wrong value and no timeout.
shared_failed_for_stale() {
    if ! grep -qE "^scenario shared $1: FAIL .*stale: [1-9][0-9]* reads of the old frame, 0 other, 0 timeouts" "$log"; then
        fail "qemu negative control: 'shared $1' did not fail on stale reads alone"
    fi
}
shared=("unmap shootdown" "remap shootdown" "a list" "past the ceiling" "mprotect with a pending batch" "reclaim flow")

# The negative control: remote CPUs skip their flush, and teardown frees
# page tables right after its flush instead of after an IPI sync. It must
# fail, and for the right reason: stale reads after a shootdown, lost or
# late writes, writes into freed frames, a walker reading a freed table.
run "negative control (must fail)" $FAIL 4 qemu64 "negative"
if ! grep -q 'scenario one-page shootdown: FAIL' "$log"; then
    fail "qemu negative control failed for another reason than a stale read"
fi
failed_for_stale "reclaim flow"
failed_for_stale "migration flow"
failed_for_stale "mprotect with a reclaim batch pending"
failed_for_stale "x86_64-crate mapper"
failed_for_stale "storm"
window_control
huge_control
if ! grep -qE 'scenario teardown flow \(AfterFlush\): FAIL .*walker read [1-9]' "$log"; then
    fail "qemu negative control: teardown did not fail on a walker reading a freed table"
fi
# The shared set's flush under test reaches CPU 0 only here.
for s in "${shared[@]}"; do
    shared_failed_for_stale "$s"
done
# negative-noinval: the shared set's flush under test invalidates nothing,
# not even on CPU 0 (the other scenarios are as under "negative").
run "negative control, x2apic, 2 cpus" $FAIL 2 qemu64,+x2apic "x2apic negative negative-noinval"
window_control
huge_control
failed_for_stale "reclaim flow"
failed_for_stale "migration flow"
failed_for_stale "mprotect with a reclaim batch pending"
failed_for_stale "x86_64-crate mapper"
for s in "${shared[@]}"; do
    shared_failed_for_stale "$s"
done
# Teardown's own control, alone: AfterFlush instead of IpiSync, every flush
# real. Only the teardown may fail, on the walker.
run "negative teardown only (must fail)" $FAIL 4 qemu64 "negative-teardown"
if ! grep -qE 'scenario teardown flow \(AfterFlush\): FAIL .*walker read [1-9]' "$log" ||
    [ "$(grep -c ': FAIL' "$log")" -ne 1 ]; then
    fail "qemu negative teardown: not exactly the teardown failing on a freed table"
fi
# The lazy catch-up's control: AP 1 leaves lazy mode with its catch-up
# flush skipped and must read the old frame through the entry it kept (a
# lazy CPU writes no CR3, so TCG keeps it). Only that scenario may fail.
run "negative catch-up (must fail)" $FAIL 2 qemu64 "negative-catchup"
failed_for_stale "generations"
if [ "$(grep -c ': FAIL' "$log")" -ne 1 ]; then
    fail "qemu negative catch-up: not exactly the generations scenario failing"
fi
# The CR3 window's control alone: only that scenario may fail.
run "negative window only (must fail)" $FAIL 2 qemu64 "negative-window"
window_control
[ "$(grep -c ': FAIL' "$log")" -eq 1 ] || fail "qemu negative window: not the window alone failing"
# The 2 MiB page's control alone: the unmap's batched flush, the split's,
# the mprotect's and the teardown's skipped (the boot CPU's invalidations
# and the APs'); the four huge-page scenarios, and only they, must fail on
# stale accesses.
run "negative huge page only (must fail)" $FAIL 2 qemu64 "negative-huge"
huge_control
[ "$(grep -c ': FAIL' "$log")" -eq 4 ] || fail "qemu negative huge page: not the four huge-page scenarios alone failing"
run "timed, xapic, 4 cpus" $PASS 4 qemu64 "timing"
offline_counted
# A CPU started without being registered must stop the run when it comes
# up (Error::UnregisteredCpu), not act as another CPU.
run "unregistered CPU (must stop)" $FAIL 4 qemu64 "unregistered"
if ! grep -q 'refused to come online: the running CPU (hardware id 0x3) was never registered' "$log"; then
    fail "qemu unregistered CPU: not stopped by bring_online's error"
fi
# The storm alone with many CPUs, and the offline scenario after it (their
# length per CPU shrinks as the count grows; boot alone takes most of the
# 64-CPU run under TCG).
run "storm, xapic, 16 cpus" $PASS 16 qemu64 "storm-only" 180
offline_counted
run "storm, x2apic, 64 cpus" $PASS 64 qemu64,+x2apic "x2apic storm-only" 300
offline_counted
# The storm's negative control: every CPU skips the flushes it is asked
# for, in its interrupt handler and while it waits.
run "negative storm, 16 cpus (must fail)" $FAIL 16 qemu64 "negative storm-only" 180
failed_for_stale "storm"

if [ "$failed" -ne 0 ]; then
    echo "what failed:"
    printf '  %s\n' "${failures[@]}"
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
