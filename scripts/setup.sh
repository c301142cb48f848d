#!/usr/bin/env bash
# Installs what scripts/test.sh needs, when it is missing, on Debian 12
# (bookworm) with rustup; on a machine that has everything it only checks,
# in about a second. Safe to run again.
#
#   packages:  qemu-system-x86 10 (from bookworm-backports: TCG emulates
#              x2APIC from 10 on), qemu-system-arm for qemu-system-aarch64
#              (from bookworm-backports too, the same QEMU), bochs with its
#              BIOS, VGA BIOS and terminal display plugin, grub-pc-bin,
#              xorriso and mtools (the ISO for Bochs), binutils (objcopy),
#              llvm (llvm-objdump, for the aarch64 flush sequences)
#   rustup:    the x86_64-unknown-none and aarch64-unknown-none targets, a
#              nightly toolchain with miri and rust-src (Miri, cargo-fuzz)
#   cargo:     cargo-fuzz
#
# Uses sudo for apt-get when not run as root.
set -euo pipefail

sudo=()
if [ "$(id -u)" -ne 0 ]; then
    sudo=(sudo)
fi

installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

# The installed QEMU's major version, or nothing when there is none. It
# must not fail: under `set -o pipefail` a missing emulator (exit 127 in
# the pipeline) would end the script before it installs anything.
qemu_major() {
    command -v qemu-system-x86_64 >/dev/null 2>&1 || return 0
    { qemu-system-x86_64 --version 2>/dev/null || true; } |
        sed -n 's/^QEMU emulator version \([0-9]*\)\..*/\1/p'
}

# Debian packages.
missing=()
for pkg in bochs bochsbios vgabios bochs-term grub-pc-bin xorriso mtools binutils llvm; do
    installed "$pkg" || missing+=("$pkg")
done
need_qemu=false
major=$(qemu_major)
if [ -z "$major" ] || [ "$major" -lt 10 ]; then
    need_qemu=true
fi
# The aarch64 test kernel only needs the emulator to exist.
need_qemu_arm=false
if ! command -v qemu-system-aarch64 >/dev/null 2>&1; then
    need_qemu_arm=true
fi
wanted=("${missing[@]}")
if $need_qemu; then
    wanted+=("qemu-system-x86 (10 or later)")
fi
if $need_qemu_arm; then
    wanted+=("qemu-system-arm")
fi
if [ "${#wanted[@]}" -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: no apt-get; install by hand: ${wanted[*]}" >&2
        exit 1
    fi
    codename=$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release 2>/dev/null || true)
    qemu_from=()
    if { $need_qemu || $need_qemu_arm; } && [ "$codename" = bookworm ]; then
        if ! grep -rqs '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
            # The mirror the machine's own sources use for bookworm.
            mirror=$("$(dirname "$0")/debian-mirror.sh" bookworm)
            echo "setup: adding bookworm-backports from $mirror"
            echo "deb $mirror bookworm-backports main" |
                "${sudo[@]}" tee /etc/apt/sources.list.d/bookworm-backports.list >/dev/null
        fi
        qemu_from=(-t bookworm-backports)
    fi
    echo "setup: installing ${wanted[*]}"
    "${sudo[@]}" apt-get update -qq
    if [ "${#missing[@]}" -gt 0 ]; then
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    # In one install, so that both emulators come from one QEMU version
    # (they share qemu-system-common): an installed qemu-system-arm goes
    # along when qemu-system-x86 is upgraded.
    qemu_pkgs=()
    if $need_qemu; then
        qemu_pkgs+=(qemu-system-x86)
    fi
    if $need_qemu_arm || { $need_qemu && installed qemu-system-arm; }; then
        qemu_pkgs+=(qemu-system-arm)
    fi
    if [ "${#qemu_pkgs[@]}" -gt 0 ]; then
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${qemu_from[@]}" "${qemu_pkgs[@]}" >/dev/null
    fi
fi

# Rust: the bare-metal targets, nightly with Miri, cargo-fuzz.
targets=$(rustup target list --installed)
for target in x86_64-unknown-none aarch64-unknown-none; do
    grep -q "^$target\$" <<<"$targets" || rustup target add "$target"
done
if ! rustup toolchain list | grep '^nightly' >/dev/null; then
    rustup toolchain install nightly --profile minimal
fi
nightly_components=$(rustup component list --toolchain nightly --installed)
if ! grep -q '^miri' <<<"$nightly_components" || ! grep -q '^rust-src' <<<"$nightly_components"; then
    rustup component add --toolchain nightly miri rust-src
fi
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
