#!/usr/bin/env bash
# The guide's code compiles: builds guide-kernel/ (the glue a tutorial-style
# x86_64 kernel writes, docs/embedding-x86_64.md) for x86_64-unknown-none,
# then checks that every ```rust block of that guide and of README.md is,
# verbatim, one region of guide-kernel/src/*.rs (the lines between
# `// guide: NAME` and `// guide: end`), and that the guide shows every
# region but the README's sketch. A snippet edited in the docs alone, or
# code changed without its snippet, fails here. Takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

guide=docs/embedding-x86_64.md
die() { echo "guide-check: $*" >&2; exit 1; }

(cd guide-kernel && cargo build --release --target x86_64-unknown-none)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Regions: one file per name, marker lines left out.
mkdir "$work/regions"
for src in guide-kernel/src/*.rs; do
    awk -v dir="$work/regions" -v src="$src" '
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
[ -n "$(ls "$work/regions")" ] || die "no regions in guide-kernel/src"

# Blocks: one file per ```rust block of a document.
blocks() {
    local doc=$1 dir=$2
    mkdir -p "$dir"
    awk -v dir="$dir" '
        /^```rust[ \t]*$/ { n++; out = sprintf("%s/%03d", dir, n); printf "" > out; inside = 1; next }
        inside && /^```[ \t]*$/ { close(out); inside = 0; next }
        inside { print > out }
    ' "$doc"
}
blocks "$guide" "$work/guide"
blocks README.md "$work/readme"

shown=()
check_doc() {
    local doc=$1 dir=$2 block region found
    for block in "$dir"/*; do
        [ -e "$block" ] || die "$doc has no \`\`\`rust block"
        found=
        for region in "$work/regions"/*; do
            if cmp -s "$block" "$region"; then
                found=$(basename "$region")
                break
            fi
        done
        if [ -z "$found" ]; then
            echo "guide-check: this \`\`\`rust block of $doc is no region of guide-kernel/src/*.rs:" >&2
            sed 's/^/    /' "$block" >&2
            exit 1
        fi
        echo "guide-check: $doc block $(basename "$block") = region $found"
        shown+=("$found")
    done
}
check_doc "$guide" "$work/guide"
check_doc README.md "$work/readme"

for region in "$work/regions"/*; do
    name=$(basename "$region")
    printf '%s\n' "${shown[@]}" | grep -qxF "$name" || die "region $name of guide-kernel/src is shown nowhere"
done
echo "guide-check: ok ($(ls "$work/regions" | wc -l) regions, every block compiled)"
