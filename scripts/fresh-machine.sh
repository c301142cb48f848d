#!/usr/bin/env bash
# Runs the README's two set-up commands (the demonstration, then every
# test) the way a new user would: on a fresh Debian 12 machine that has
# nothing of this project installed. The machine is a minimal Debian root
# made with debootstrap, entered with chroot:
#
#   1. a base root: `debootstrap --variant=minbase bookworm`, then
#      build-essential, git, ca-certificates and curl (cached between runs,
#      see FRESH_CACHE; nothing the project installs is ever in it);
#   2. a copy of it for this run, with the host's CA bundle (TLS to the
#      toolchain server) and the host's resolver configuration;
#   3. rustup with the stable toolchain, installed by the host's `rustup`
#      binary run as `rustup-init` inside the root;
#   4. a clean clone of the commit under test (HEAD by default; committed
#      work only) in /root/tlb-batch;
#   5. the README's two commands, each in a login shell there (so that
#      rustup's PATH line in ~/.profile is what puts cargo on the PATH), each
#      timed; QEMU, Bochs and the rest install through the test command
#      itself, as on any fresh machine.
#
# /proc, /sys, /dev (with /dev/pts) and /dev/shm are mounted in the root
# while it is used, and unmounted on every way out (success, failure,
# interrupt); the root is then deleted unless FRESH_KEEP=1. Exits non-zero
# when either command fails (both run either way) or the root cannot be
# made.
#
#   sudo scripts/fresh-machine.sh            HEAD
#   sudo scripts/fresh-machine.sh COMMIT     another commit of this clone
#   sudo scripts/fresh-machine.sh --run CMD [--run CMD ...] [COMMIT]
#                                            other commands instead of the
#                                            README's (e.g. scripts/setup-check.sh)
#
# Environment:
#   FRESH_CACHE   where the base root's tarball is kept
#                 (default /var/cache/tlb-batch-fresh); FRESH_CACHE= (empty)
#                 builds the base anew and keeps nothing
#   FRESH_BASE_MAX_AGE_DAYS   rebuild a cached base older than this (7)
#   FRESH_WORK    where the run's root is made (default /var/tmp)
#   FRESH_KEEP=1  keep the run's root (its path is printed) for a look inside
#
# Needs root, debootstrap (installed when missing), git, tar, and about
# 20 GB of free disk under FRESH_WORK for the run (toolchains and builds).
set -euo pipefail
cd "$(dirname "$0")/.."
top=$(pwd)
say() { printf 'fresh-machine: %s\n' "$*"; }
die() { say "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot and mount)"
commands=()
rev=
while [ "$#" -gt 0 ]; do
    case "$1" in
        --run) [ "$#" -ge 2 ] || die "--run needs a command"; commands+=("$2"); shift 2 ;;
        -*) die "unknown option $1" ;;
        *) [ -z "$rev" ] || die "one commit at most"; rev=$1; shift ;;
    esac
done
commit=$(git rev-parse --verify "${rev:-HEAD}^{commit}") || die "no such commit: ${rev:-HEAD}"
if [ -z "$rev" ] && [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    say "note: the work tree has uncommitted changes; they are not part of the run"
fi

# The README's two commands: the first two ```sh blocks (Quick start) of
# the commit under test's README, one line each.
if [ "${#commands[@]}" -eq 0 ]; then
    mapfile -t commands < <(git show "$commit:README.md" | awk '
        /^```sh[ \t]*$/ { inside = 1; lines = 0; next }
        inside && /^```/ { inside = 0; if (lines != 1) { print "BAD"; exit }; if (++blocks == 2) exit; next }
        inside { lines++; print }')
    if [ "${#commands[@]}" -ne 2 ] || [ "${commands[0]}" = BAD ] || [ "${commands[1]}" = BAD ]; then
        die "README.md must open with two \`\`\`sh blocks of one command each (the demonstration, the tests)"
    fi
fi

command -v debootstrap >/dev/null 2>&1 || scripts/apt-install.sh debootstrap
mirror=$(scripts/debian-mirror.sh bookworm)
base_packages=(build-essential git ca-certificates curl)

# Mounts made so far (in order) and the roots to delete, for the cleanup.
mounts=()
remove=()

# Ends every process whose root is inside $1 (a command left running in the
# chroot keeps its mounts busy).
kill_inside() {
    local p root
    for p in /proc/[0-9]*; do
        root=$(readlink "$p/root" 2>/dev/null) || continue
        case "$root" in
            "$1" | "$1"/*) kill -KILL "${p#/proc/}" 2>/dev/null || true ;;
        esac
    done
}

cleanup() {
    local status=$? i m dir
    trap - EXIT INT TERM
    for dir in "${remove[@]}"; do
        kill_inside "$dir"
    done
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        m=${mounts[$i]}
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || say "could not unmount $m"
    done
    for dir in "${remove[@]}"; do
        # Never delete through a mount that is still there (a bound /dev
        # holds the host's device nodes).
        if awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { found = 1 } END { exit !found }' /proc/mounts; then
            say "left $dir in place: something is still mounted under it"
        elif [ "${FRESH_KEEP:-0}" = 1 ] && [ "$dir" = "${run_dir:-}" ]; then
            say "kept the root: $dir/root"
        else
            rm -rf --one-file-system "$dir"
        fi
    done
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mount_into() {
    local root=$1
    mount -t proc proc "$root/proc"
    mounts+=("$root/proc")
    mount -t sysfs sysfs "$root/sys"
    mounts+=("$root/sys")
    mount --bind /dev "$root/dev"
    mounts+=("$root/dev")
    # Terminals, which apt and dpkg open for their logs.
    mount --bind /dev/pts "$root/dev/pts"
    mounts+=("$root/dev/pts")
    mkdir -p "$root/dev/shm"
    mount -t tmpfs -o mode=1777,nosuid,nodev shm "$root/dev/shm"
    mounts+=("$root/dev/shm")
}

unmount_all() {
    local i
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        umount "${mounts[$i]}"
    done
    mounts=()
}

# The host's resolver, so that apt, rustup and cargo reach the registries.
host_files_into() {
    local root=$1
    cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
    [ -f /etc/hosts ] && cp /etc/hosts "$root/etc/hosts"
}

# A clean environment, as a login would have it. Proxy settings, if the
# host has them, are part of the machine, not of the project: kept.
clean_env=(env -i HOME=/root USER=root LOGNAME=root SHELL=/bin/bash TERM=dumb LANG=C.UTF-8
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
for var in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
    [ -n "${!var:-}" ] && clean_env+=("$var=${!var}")
done

in_root() {
    local root=$1
    shift
    chroot "$root" "${clean_env[@]}" "$@"
}

# The same, waited for in the background: bash runs a trap only once the
# foreground command has ended, so a TERM sent to this script during a
# 20-minute test run would otherwise wait for it; `wait` returns at once,
# and the cleanup ends what runs in the root.
in_root_waited() {
    local child
    in_root "$@" &
    child=$!
    wait "$child"
}

# 1. The base root, from the cache when a young enough one is there.
recipe="bookworm minbase $mirror ${base_packages[*]}"
key=$(printf '%s' "$recipe" | sha256sum | cut -c1-16)
cache=${FRESH_CACHE-/var/cache/tlb-batch-fresh}
work=${FRESH_WORK:-/var/tmp}
base_tar=
if [ -n "$cache" ]; then
    mkdir -p "$cache"
    base_tar="$cache/bookworm-base-$key.tar"
    if [ -f "$base_tar" ] && [ -n "$(find "$base_tar" -mtime +"${FRESH_BASE_MAX_AGE_DAYS:-7}")" ]; then
        say "the cached base is older than ${FRESH_BASE_MAX_AGE_DAYS:-7} days: made anew"
        rm -f "$base_tar"
    fi
fi

run_dir=$(mktemp -d "$work/tlb-batch-fresh.XXXXXX")
remove+=("$run_dir")
root="$run_dir/root"
mkdir "$root"

start=$SECONDS
if [ -n "$base_tar" ] && [ -f "$base_tar" ]; then
    say "base root from the cache ($base_tar)"
    tar -C "$root" --numeric-owner -xpf "$base_tar"
else
    say "debootstrap --variant=minbase bookworm from $mirror"
    debootstrap --variant=minbase bookworm "$root" "$mirror" >"$run_dir/debootstrap.log" 2>&1 ||
        { tail -n 20 "$run_dir/debootstrap.log" >&2; die "debootstrap failed"; }
    host_files_into "$root"
    mount_into "$root"
    in_root "$root" apt-get update -qq
    in_root "$root" env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${base_packages[@]}" >"$run_dir/apt.log" 2>&1 ||
        { tail -n 20 "$run_dir/apt.log" >&2; die "installing ${base_packages[*]} failed"; }
    in_root "$root" apt-get clean
    unmount_all
    # As a fresh machine has it: no package lists yet (`apt-get update`
    # comes first), nothing of the host's.
    rm -rf "$root"/var/lib/apt/lists/* "$root/etc/resolv.conf"
    if [ -n "$base_tar" ]; then
        # Written aside and renamed: a run beside this one never reads half
        # a tarball.
        tar -C "$root" --numeric-owner -cf "$base_tar.part.$$" . && mv "$base_tar.part.$$" "$base_tar"
        say "cached the base root as $base_tar"
    fi
fi
say "base root ready in $((SECONDS - start)) s"

# 2. What the machine itself would have: a resolver, the CA bundle.
host_files_into "$root"
[ -f /etc/ssl/certs/ca-certificates.crt ] &&
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
mount_into "$root"

# 3. rustup and the stable toolchain (the host's stable version, so that
# the run tests what the host builds with).
start=$SECONDS
host_rustup=$(command -v rustup) || die "the host has no rustup binary to install from"
stable=$(rustc +stable --version 2>/dev/null | awk '{ print $2 }')
install -m 755 "$host_rustup" "$root/usr/local/bin/rustup-init"
in_root "$root" rustup-init -y --profile default --default-toolchain "${stable:-stable}" >"$run_dir/rustup.log" 2>&1 ||
    { tail -n 20 "$run_dir/rustup.log" >&2; die "rustup-init failed"; }
rm -f "$root/usr/local/bin/rustup-init"
say "rustup with Rust ${stable:-stable} installed in $((SECONDS - start)) s"

# 4. A clean clone of the commit under test.
git clone -q --no-local --no-checkout "$top" "$root/root/tlb-batch"
git -C "$root/root/tlb-batch" checkout -q --detach "$commit"
say "commit under test: $(git log -1 --format='%h %s' "$commit")"

# 5. The README's commands (or those given), as a user types them after
# logging in.
results=()
failed=0
passed=0
for cmd in "${commands[@]}"; do
    say "running: $cmd"
    start=$SECONDS
    status=0
    in_root_waited "$root" bash -l -c "cd /root/tlb-batch && $cmd" || status=$?
    results+=("$(printf '%-45s exit %3d  %5d s' "$cmd" "$status" "$((SECONDS - start))")")
    if [ "$status" -eq 0 ]; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
    fi
done

say "on a fresh Debian 12 root:"
for line in "${results[@]}"; do
    printf '  %s\n' "$line"
done
# The commands, counted as a test runner would close.
echo "fresh-machine: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
