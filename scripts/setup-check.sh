#!/usr/bin/env bash
# Checks scripts/setup.sh on a machine that lacks each thing it installs, one
# at a time: for every piece (each Debian package, QEMU absent, QEMU too old,
# the backports source, each bare-metal target, nightly, Miri, rust-src,
# cargo-fuzz) it takes that piece away, runs setup.sh, and checks that
# everything is there again; at the start (nothing of it installed) and at
# the end (nothing to do, in about a second) it runs setup.sh once more.
#
# It removes packages and toolchains, so it runs only inside a throwaway
# Debian 12 root (scripts/fresh-machine.sh --run scripts/setup-check.sh)
# or where SETUP_CHECK_THROWAWAY=1 says the machine may be damaged.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${SETUP_CHECK_THROWAWAY:-0}" != 1 ] && [ "$(stat -c %d:%i /)" = "$(stat -c %d:%i /proc/1/root/. 2>/dev/null)" ]; then
    echo "setup-check: removes packages and toolchains; run it in a throwaway root (scripts/fresh-machine.sh --run scripts/setup-check.sh) or set SETUP_CHECK_THROWAWAY=1" >&2
    exit 2
fi

debs=(bochs bochsbios vgabios bochs-term grub-pc-bin xorriso mtools binutils llvm)
passed=0
failed=0

installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

# Everything setup.sh promises, or the first thing missing.
what_is_missing() {
    local pkg major
    for pkg in "${debs[@]}" qemu-system-x86 qemu-system-arm; do
        installed "$pkg" || { echo "package $pkg"; return; }
    done
    # The tools the test scripts call, not only the package names.
    for tool in bochs grub-mkrescue xorriso mformat objcopy llvm-objdump; do
        command -v "$tool" >/dev/null 2>&1 || { echo "command $tool"; return; }
    done
    major=$({ qemu-system-x86_64 --version 2>/dev/null || true; } | sed -n 's/^QEMU emulator version \([0-9]*\)\..*/\1/p')
    [ -n "$major" ] && [ "$major" -ge 10 ] || { echo "QEMU 10 or later (have: ${major:-none})"; return; }
    command -v qemu-system-aarch64 >/dev/null 2>&1 || { echo "qemu-system-aarch64"; return; }
    for target in x86_64-unknown-none aarch64-unknown-none; do
        rustup target list --installed | grep -x "$target" >/dev/null || { echo "target $target"; return; }
    done
    rustup toolchain list | grep '^nightly' >/dev/null || { echo "nightly"; return; }
    for component in miri rust-src; do
        rustup component list --toolchain nightly --installed | grep "^$component" >/dev/null ||
            { echo "nightly's $component"; return; }
    done
    command -v cargo-fuzz >/dev/null 2>&1 || { echo "cargo-fuzz"; return; }
}

# check NAME: run setup.sh, then require that nothing is missing.
check() {
    local name=$1 start=$SECONDS status=0 missing
    scripts/setup.sh >/tmp/setup-check.log 2>&1 || status=$?
    missing=$(what_is_missing)
    if [ "$status" -eq 0 ] && [ -z "$missing" ]; then
        printf 'setup-check: %-52s ok   (%d s)\n' "$name" "$((SECONDS - start))"
        passed=$((passed + 1))
    else
        printf 'setup-check: %-52s FAIL (exit %d, missing: %s)\n' "$name" "$status" "${missing:-nothing}"
        sed 's/^/    /' /tmp/setup-check.log | tail -n 20
        failed=$((failed + 1))
    fi
}

# Takes packages away with what only they brought (llvm's llvm-objdump is
# in llvm-14, bochs' plugins in their own packages), so that the machine
# really lacks the tool.
apt_remove() {
    DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq --purge "$@" >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get autoremove -y -qq --purge >/dev/null
}

check "nothing installed yet"

for pkg in "${debs[@]}"; do
    if [ "$pkg" = binutils ]; then
        # Removing it through apt would take build-essential and the C
        # compiler with it (Rust's linker): take the package alone.
        dpkg --purge --force-depends binutils >/dev/null 2>&1
    else
        apt_remove "$pkg"
    fi
    check "without $pkg"
done

apt_remove qemu-system-x86 qemu-system-arm
check "without QEMU"

apt_remove qemu-system-arm
check "without qemu-system-arm"

# An older QEMU from bookworm itself (7.2: no x2APIC under TCG), and no
# backports source: setup.sh must add the source and upgrade both.
# Every QEMU package goes (backports' qemu-utils breaks bookworm's
# qemu-system-common).
mapfile -t qemu_pkgs < <(dpkg-query -W -f='${Status} ${Package}\n' 'qemu*' 2>/dev/null |
    awk '$1 == "install" && $3 == "installed" { print $4 }')
apt_remove "${qemu_pkgs[@]}"
rm -f /etc/apt/sources.list.d/bookworm-backports.list
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm qemu-system-x86 >/dev/null
qemu-system-x86_64 --version | head -n 1 | sed 's/^/setup-check: before: /'
check "with bookworm's QEMU and no backports source"
grep -h '^deb ' /etc/apt/sources.list.d/bookworm-backports.list | sed 's/^/setup-check: added: /'

for target in x86_64-unknown-none aarch64-unknown-none; do
    rustup target remove "$target" >/dev/null 2>&1
    check "without the $target target"
done

rustup component remove --toolchain nightly miri >/dev/null 2>&1
check "without nightly's miri"
rustup component remove --toolchain nightly rust-src >/dev/null 2>&1
check "without nightly's rust-src"
rustup toolchain uninstall nightly >/dev/null 2>&1
check "without nightly"

cargo uninstall cargo-fuzz >/dev/null 2>&1
check "without cargo-fuzz"

check "with everything installed (nothing to do)"
if grep -q 'installing' /tmp/setup-check.log; then
    echo "setup-check: a second run installed something:"
    sed 's/^/    /' /tmp/setup-check.log
    failed=$((failed + 1))
fi
echo "setup-check: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
