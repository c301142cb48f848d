#!/usr/bin/env bash
# The guides' code compiles: builds guide-kernel/ (the glue a tutorial-style
# x86_64 kernel writes, docs/embedding-x86_64.md) for x86_64-unknown-none
# and guide-kernel-aarch64/ (an ARMv8-A kernel's bring-up,
# docs/embedding-aarch64.md) for aarch64-unknown-none, then checks that
# every ```rust block of those guides and of README.md is, verbatim, one
# region of its crate's src/*.rs (the lines between `// guide: NAME` and
# `// guide: end`), and that every region is shown somewhere. A snippet
# edited in the docs alone, or code changed without its snippet, fails
# here. Takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "guide-check: $*" >&2; exit 1; }

(cd guide-kernel && cargo build --release --target x86_64-unknown-none)
(cd guide-kernel-aarch64 && cargo build --release --target aarch64-unknown-none)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# regions CRATE DIR: one file per region of CRATE/src/*.rs in DIR, marker
# lines left out.
regions() {
    local crate=$1 dir=$2 src
    mkdir -p "$dir"
    for src in "$crate"/src/*.rs; do
        awk -v dir="$dir" -v src="$src" '
            /^[ \t]*\/\/ guide: end[ \t]*$/ {
                if (name == "") { printf "%s:%d: guide: end outside a region\n", src, FNR > "/dev/stderr"; exit 1 }
                close(out); name = ""; next
            }
            /^[ \t]*\/\/ guide: / {
                if (name != "") { printf "%s:%d: region %s not ended\n", src, FNR, name > "/dev/stderr"; exit 1 }
                name = $0; sub(/^[ \t]*\/\/ guide: /, "", name); sub(/[ \t]*$/, "", name)
                out = dir "/" name
                if ((getline line < out) > 0) { printf "%s:%d: region %s defined twice\n", src, FNR, name > "/dev/stderr"; exit 1 }
                printf "" > out; next
            }
            name != "" { print > out }
            END { if (name != "") { printf "%s: region %s not ended\n", src, name > "/dev/stderr"; exit 1 } }
        ' "$src" || die "bad region markers in $src"
    done
    [ -n "$(ls "$dir")" ] || die "no regions in $crate/src"
}

# blocks DOC DIR: one file per ```rust block of DOC in DIR.
blocks() {
    local doc=$1 dir=$2
    mkdir -p "$dir"
    awk -v dir="$dir" '
        /^```rust[ \t]*$/ { n++; out = sprintf("%s/%03d", dir, n); printf "" > out; inside = 1; next }
        inside && /^```[ \t]*$/ { close(out); inside = 0; next }
        inside { print > out }
    ' "$doc"
}

# check CRATE DOC...: every ```rust block of each DOC is a region of CRATE,
# and every region of CRATE is one of those blocks.
check() {
    local crate=$1 doc block region found name n=0
    shift
    local dir="$work/$crate"
    regions "$crate" "$dir/regions"
    local shown=()
    for doc in "$@"; do
        n=$((n + 1))
        blocks "$doc" "$dir/doc$n"
        for block in "$dir/doc$n"/*; do
            [ -e "$block" ] || die "$doc has no \`\`\`rust block"
            found=
            for region in "$dir/regions"/*; do
                if cmp -s "$block" "$region"; then
                    found=$(basename "$region")
                    break
                fi
            done
            if [ -z "$found" ]; then
                echo "guide-check: this \`\`\`rust block of $doc is no region of $crate/src/*.rs:" >&2
                sed 's/^/    /' "$block" >&2
                exit 1
            fi
            echo "guide-check: $doc block $(basename "$block") = region $found"
            shown+=("$found")
        done
    done
    for region in "$dir/regions"/*; do
        name=$(basename "$region")
        printf '%s\n' "${shown[@]}" | grep -xF "$name" >/dev/null || die "region $name of $crate/src is shown nowhere"
    done
    echo "guide-check: $crate ok ($(ls "$dir/regions" | wc -l) regions, every block compiled)"
}

check guide-kernel docs/embedding-x86_64.md README.md
check guide-kernel-aarch64 docs/embedding-aarch64.md
