#!/usr/bin/env bash
# Prints the Debian mirror that this machine's apt sources use for a suite
# (default: bookworm), so that scripts which add a source (bookworm-backports)
# or build a Debian root (debootstrap) use the mirror the machine already
# trusts instead of a host name written into the script.
#
#   scripts/debian-mirror.sh            the mirror for bookworm
#   scripts/debian-mirror.sh SUITE      the mirror for SUITE
#
# Reads both formats: one-line entries in /etc/apt/sources.list and
# sources.list.d/*.list (`deb [options] URI SUITE COMPONENT...`), and deb822
# stanzas in sources.list.d/*.sources (`URIs:` and `Suites:` fields,
# skipping `Enabled: no`). Only `deb` entries count (not `deb-src`). Exits 1,
# with a message, when no entry names the suite.
set -euo pipefail
suite=${1:-bookworm}
etc=${APT_ETC:-/etc/apt}

one_line() {
    # Fields: deb, then an optional [ ... ] block of options (which may hold
    # spaces), then the URI and the suite.
    awk -v suite="$suite" '
        $1 != "deb" { next }
        {
            i = 2
            if ($i ~ /^\[/) {
                while (i <= NF && $i !~ /\]$/) i++
                i++
            }
            if ($(i + 1) == suite) { print $i; exit }
        }' "$@"
}

deb822() {
    # One stanza a record (blank lines between them); comment lines dropped.
    awk -v suite="$suite" '
        BEGIN { RS = ""; FS = "\n" }
        {
            uris = ""; suites = ""; types = ""; enabled = "yes"
            for (n = 1; n <= NF; n++) {
                line = $n
                if (line ~ /^[ \t]*#/) continue
                split(line, kv, ":")
                key = tolower(kv[1])
                value = substr(line, length(kv[1]) + 2)
                gsub(/^[ \t]+|[ \t]+$/, "", value)
                if (key == "uris") uris = value
                else if (key == "suites") suites = value
                else if (key == "types") types = value
                else if (key == "enabled") enabled = tolower(value)
            }
            if (enabled == "no" || (" " types " ") !~ / deb /) next
            ns = split(suites, s, /[ \t]+/)
            for (k = 1; k <= ns; k++) {
                if (s[k] == suite) {
                    split(uris, u, /[ \t]+/)
                    print u[1]
                    exit
                }
            }
        }' "$@"
}

files=()
for f in "$etc/sources.list" "$etc"/sources.list.d/*.list; do
    [ -f "$f" ] && files+=("$f")
done
found=""
if [ "${#files[@]}" -gt 0 ]; then
    found=$(one_line "${files[@]}" | head -n 1)
fi
if [ -z "$found" ]; then
    for f in "$etc"/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        found=$(deb822 "$f" | head -n 1)
        [ -n "$found" ] && break
    done
fi
if [ -z "$found" ]; then
    echo "debian-mirror: no 'deb' entry for $suite in $etc/sources.list or $etc/sources.list.d/" >&2
    exit 1
fi
printf '%s\n' "${found%/}"
