#!/usr/bin/env bash
# Installs the Debian packages named on the command line that are not
# installed yet (apt-get, with sudo when not run as root); with all of them
# present it only checks. For the scripts that need a tool a fresh Debian 12
# machine lacks (valgrind for the benchmarks, python3 for the mutation
# summary), so that each runs from a fresh clone.
#
#   scripts/apt-install.sh PACKAGE...
#   scripts/apt-install.sh -t bookworm-backports PACKAGE...   from a suite
set -euo pipefail
from=()
if [ "${1:-}" = -t ]; then
    from=(-t "$2")
    shift 2
fi
missing=()
for pkg in "$@"; do
    [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" = "install ok installed" ] ||
        missing+=("$pkg")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "apt-install: no apt-get here; install by hand: ${missing[*]}" >&2
    exit 1
fi
sudo=()
if [ "$(id -u)" -ne 0 ]; then
    sudo=(sudo)
fi
echo "apt-install: installing ${missing[*]}"
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${from[@]}" "${missing[@]}" >/dev/null
