#!/usr/bin/env bash
# Builds the bare-metal SMP test kernel (qemu-test/) and runs its scenario
# matrix under QEMU (TCG), each run with a timeout:
#   xAPIC and x2APIC, with 4 CPUs (the all-but-self shorthand) and 2 CPUs
#   (a physical destination per CPU), then the negative control, which must
#   fail, and one timed run. Prints each run's boot-to-exit wall time.
# Needs: the x86_64-unknown-none target, objcopy, qemu-system-x86_64 (10.x
# for x2APIC under TCG).
set -euo pipefail
cd "$(dirname "$0")/.."

rustup target list --installed 2>/dev/null | grep -q '^x86_64-unknown-none$' ||
    rustup target add x86_64-unknown-none
(cd qemu-test && cargo build --release --quiet)
out=qemu-test/target/tlb-batch-qemu-test.bin
objcopy -O binary qemu-test/target/x86_64-unknown-none/release/tlb-batch-qemu-test "$out"

passed=0
failed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# run NAME EXPECTED_EXIT CPUS CPU_MODEL CMDLINE
run() {
    local name=$1 expected=$2 smp=$3 model=$4 cmdline=$5 start end code
    start=$(date +%s.%N)
    set +e
    timeout 120 qemu-system-x86_64 -kernel "$out" -append "$cmdline" -smp "$smp" -cpu "$model" \
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
        failed=$((failed + 1))
        printf 'qemu %-34s FAIL (exit %d, expected %d)\n' "$name" "$code" "$expected"
    fi
}

PASS=33 # (0x10 << 1) | 1
FAIL=35 # (0x11 << 1) | 1
run "xapic, 4 cpus" $PASS 4 qemu64 ""
run "xapic, 2 cpus" $PASS 2 qemu64 ""
run "x2apic, 4 cpus" $PASS 4 qemu64,+x2apic "x2apic"
run "x2apic, 2 cpus" $PASS 2 qemu64,+x2apic "x2apic"
# The negative control: remote CPUs skip their flush. It must fail, and for
# the right reason (stale reads after a shootdown).
run "negative control (must fail)" $FAIL 4 qemu64 "negative"
if ! grep -q 'scenario one-page shootdown: FAIL' "$log"; then
    failed=$((failed + 1))
    echo "qemu negative control failed for another reason than a stale read"
fi
run "timed, xapic, 4 cpus" $PASS 4 qemu64 "timing"
# A CPU started without being registered must stop the run when it comes
# up (Error::UnregisteredCpu), not act as another CPU.
run "unregistered CPU (must stop)" $FAIL 4 qemu64 "unregistered"
if ! grep -q 'refused to come online: the running CPU (hardware id 0x3) was never registered' "$log"; then
    failed=$((failed + 1))
    echo "qemu unregistered CPU: not stopped by bring_online's error"
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
