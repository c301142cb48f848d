#!/usr/bin/env bash
# Runs the bare-metal SMP test kernel (qemu-test/) under Bochs 2.7, whose
# corei7_haswell_4770 model has PCID and INVPCID (QEMU's TCG has neither),
# so the crate's PCID code runs: CR3 loads with PCIDs and the NOFLUSH bit,
# INVPCID flushes, and the PCID scenarios (qemu-test/src/pcid.rs).
#
# The kernel is booted by GRUB from an ISO (Multiboot, the command line in
# grub.cfg). Bochs has no exit device: the kernel prints "N passed, M
# failed" on COM1 (a file here) and then writes "Shutdown" to port 0x8900,
# which makes Bochs stop. A run counts only if Bochs stopped that way
# before the timeout, and its verdict is that last serial line.
#
# Matrix: PCIDs on (xAPIC with 4 and 2 CPUs, x2APIC with 4), PCIDs off (the
# baseline), and two negative controls that must fail, each for its own
# reason: `negative` (remote CPUs skip their flushes) and `negative-catchup`
# (a lazy CPU leaves lazy mode without flushing what it skipped). Prints
# each run's boot-to-exit time.
#
# Bochs 2.7 does not keep TLB entries per PCID (it flushes the non-global
# ones on every CR3 write, NOFLUSH or not); the scenarios that need a tagged
# TLB measure that and print SKIP with the reason, listed at the end. For
# the same reason the catch-up at a switch back to a PCID has no negative
# control here (the generations scenario measures it and says so); the
# lazy catch-up has one, since a lazy CPU writes no CR3.
#
# Needs: the x86_64-unknown-none target, objcopy, bochs and bochsbios,
# vgabios, bochs-term (the display; none is shown), grub-pc-bin, xorriso,
# mtools (scripts/setup.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."

# What it needs (QEMU 10, the bare-metal target, binutils, ...), installed
# when missing, so that the script runs alone from a fresh clone too.
scripts/setup.sh
(cd qemu-test && cargo build --release --quiet)
kernel=qemu-test/target/tlb-batch-qemu-test.bin
objcopy -O binary qemu-test/target/x86_64-unknown-none/release/tlb-batch-qemu-test "$kernel"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo c >"$work/debugger.rc" # Debian's Bochs has its debugger built in: continue at once.

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

# run NAME EXPECT(pass|fail) CPUS CMDLINE [REQUIRED_LINE...]
# Every REQUIRED_LINE must appear in the serial log (a fixed string).
run() {
    local name=$1 expect=$2 cpus=$3 cmdline=$4
    shift 4
    local dir="$work/run" start end code verdict="" why=""
    rm -rf "$dir"
    mkdir -p "$dir/iso/boot/grub"
    cp "$kernel" "$dir/iso/boot/kernel.bin"
    cat >"$dir/iso/boot/grub/grub.cfg" <<EOF
set timeout=0
set default=0
menuentry "tlb-batch test kernel" {
    multiboot /boot/kernel.bin $cmdline
    boot
}
EOF
    grub-mkrescue -o "$dir/kernel.iso" "$dir/iso" >"$dir/grub-mkrescue.log" 2>&1 || {
        cat "$dir/grub-mkrescue.log"
        fail "bochs $name: FAIL (grub-mkrescue failed)"
        return
    }
    cat >"$dir/bochsrc" <<EOF
megs: 128
cpu: model=corei7_haswell_4770, count=$cpus, reset_on_triple_fault=0
romimage: file=/usr/share/bochs/BIOS-bochs-latest
vgaromimage: file=/usr/share/vgabios/vgabios.bin
ata0-master: type=cdrom, path=$dir/kernel.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=$dir/serial.log
display_library: term
sound: driver=dummy
speaker: enabled=0
log: $dir/bochs.log
panic: action=fatal
error: action=report
info: action=report
EOF
    # No sound: with no sound card, Debian's Bochs falls back to a mixer
    # thread that sometimes aborts ("buffer overflow detected").
    start=$(date +%s.%N)
    set +e
    TERM=dumb timeout 300 bochs -q -f "$dir/bochsrc" -rc "$work/debugger.rc" >"$dir/bochs.out" 2>&1 </dev/null
    code=$?
    set -e
    end=$(date +%s.%N)
    touch "$dir/serial.log"
    sed 's/^/    | /' "$dir/serial.log"
    if [ "$expect" = pass ]; then
        grep '^scenario .*: SKIP' "$dir/serial.log" | sed "s/: SKIP (.*/: SKIP/; s/^/  $name: /" >>"$work/skips" || true
    fi

    local last
    last=$(tail -n 1 "$dir/serial.log")
    if [ "$code" -eq 124 ]; then
        why="timed out"
    elif ! grep -q 'Shutdown port: shutdown requested' "$dir/bochs.out"; then
        why="Bochs stopped for another reason than the kernel's shutdown (exit $code)"
        tail -n 8 "$dir/bochs.out" | sed 's/^/    bochs: /'
    elif [[ $last =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]]; then
        if [ "${BASH_REMATCH[2]}" -eq 0 ] && [ "${BASH_REMATCH[1]}" -gt 0 ]; then
            verdict=pass
        elif [ "${BASH_REMATCH[2]}" -gt 0 ]; then
            verdict=fail
        fi
    else
        why="no final \"N passed, M failed\" line"
    fi
    if [ -z "$why" ] && [ "$verdict" != "$expect" ]; then
        why="the kernel's verdict was '$verdict', expected '$expect'"
    fi
    local line
    for line in "$@"; do
        if [ -z "$why" ] && ! grep -qF -- "$line" "$dir/serial.log"; then
            why="missing: $line"
        fi
    done
    if [ -z "$why" ]; then
        passed=$((passed + 1))
        printf 'bochs %-38s ok   (%s as expected, %.2f s boot to exit)\n' "$name" "$verdict" \
            "$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')"
    else
        fail "$(printf 'bochs %-38s FAIL (%s)' "$name" "$why")"
    fi
}

: >"$work/skips"
# What the generations scenario measured about Bochs' PCIDs.
NO_KEEP="generations: PCID entries kept across a CR3 write: no (AP 1 cached P in PCID 8: true, switched to PCID 9, P remapped with no flush, back on PCID 8 with 0 catch-ups it read the new frame): a skipped catch-up at a switch cannot be observed here, so it has no negative control"
pooled() {
    local aps=$(($1 - 1))
    echo "scenario pooled reclaim flow: PASS (16 pages pooled with 0 IPIs, then read through the APs' TLBs $((16 * aps)) of $((16 * aps)) times, frames intact: true; 0 released before the APs flushed; after a quiescent flush on $aps APs, 16 released by passes with 0 IPIs sent and 0 taken; 16 more pooled, AP 1 switched away, a forced flush sent $((aps - 1)) IPIs ($((aps - 1)) taken) and released 16; stale: 0 reads after the flushes)"
}
# The CR3 window scenario (qemu-test/src/window.rs), every round as expected.
window_ok="scenario cr3 window: PASS (8 rounds: AP 1 read P in T 8, in S inside switch_mm after its CR3 write 8, in S's CPU set there 8; remote CPUs the flushes asked 8, requests the AP served while it waited 8, IPIs it took after 8; reads after the switch: 8 faults, stale: 0 reads of the reused frame, 0 other)"
run "pcid, xapic, 4 cpus" pass 4 "pcid" \
    "pcid=true" "4 CPUs online" "$(pooled 4)" \
    "scenario pcid single-context flush of the loaded PCID: PASS" \
    "scenario pcid a CPU that switched away is skipped and catches up: PASS" \
    "scenario generations: PASS (AP 1 on A: a flush of A sent 1 IPI (1 taken); AP 1 switched to B: 0 IPIs (0 taken), catch-ups when back on A: 1; AP 1 lazy on A: 0 IPIs (0 taken), catch-ups at leave_lazy_tlb: 1; stale: 0 reads of an old frame)" \
    "$NO_KEEP" \
    "scenario pcid global kernel page flushed in every PCID: PASS" "$window_ok"
run "pcid, xapic, 2 cpus" pass 2 "pcid" \
    "pcid=true" "2 CPUs online" "$(pooled 2)" \
    "scenario pcid single-context flush of the loaded PCID: PASS" \
    "scenario pcid a CPU that switched away is skipped and catches up: PASS" \
    "scenario generations: PASS (AP 1 on A: a flush of A sent 1 IPI (1 taken); AP 1 switched to B: 0 IPIs (0 taken), catch-ups when back on A: 1; AP 1 lazy on A: 0 IPIs (0 taken), catch-ups at leave_lazy_tlb: 1; stale: 0 reads of an old frame)" \
    "$NO_KEEP" \
    "scenario pcid global kernel page flushed in every PCID: PASS"
run "pcid, x2apic, 4 cpus" pass 4 "pcid x2apic" \
    "apic=x2apic pcid=true" "4 CPUs online" "$(pooled 4)" \
    "scenario pcid global kernel page flushed in every PCID: PASS"
run "no pcid (baseline), xapic, 4 cpus" pass 4 "" \
    "pcid=false" "4 CPUs online" "$(pooled 4)" \
    "scenario generations: PASS (AP 1 on A: a flush of A sent 1 IPI (1 taken); AP 1 switched to B: 0 IPIs (0 taken), catch-ups when back on A: 0 (no PCIDs: the CR3 write of the switch flushed A); AP 1 lazy on A: 0 IPIs (0 taken), catch-ups at leave_lazy_tlb: 1; stale: 0 reads of an old frame)" "$window_ok"
# The negative controls must fail, and for the right reason: the stale
# reads after a shootdown whose remote flushes were skipped, and (with
# PCIDs) an address space and a kernel page that were not flushed.
run "negative control (must fail)" fail 4 "pcid negative" \
    "scenario one-page shootdown: FAIL" \
    "scenario pcid single-context flush of the loaded PCID: FAIL" \
    "scenario pcid global kernel page flushed in every PCID: FAIL"
# Its CR3 window control left the AP out of the flush: reads of the reused frame.
grep -qE "^scenario cr3 window: FAIL .* asked 0, .* waited 0, IPIs it took after 0; .*stale: [1-9]" "$work/run/serial.log" ||
    fail "bochs cr3 window control: did not fail on stale reads alone"
# A lazy CPU that leaves lazy mode without its catch-up flush reads the
# old frame through the entry it kept (no CR3 write drops it).
run "negative catch-up (must fail)" fail 2 "pcid negative-catchup" \
    "scenario generations: FAIL (AP 1 on A: a flush of A sent 1 IPI (1 taken); AP 1 switched to B: 0 IPIs (0 taken), catch-ups when back on A: 1; AP 1 lazy on A: 0 IPIs (0 taken), catch-ups at leave_lazy_tlb: 1; stale: 1 reads of an old frame)" \
    "27 passed, 1 failed"

if [ -s "$work/skips" ]; then
    echo "skipped here (they need a TLB that keeps entries per PCID, which Bochs 2.7 does not model):"
    cat "$work/skips"
fi
if [ "$failed" -ne 0 ]; then
    echo "what failed:"
    printf '  %s\n' "${failures[@]}"
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
