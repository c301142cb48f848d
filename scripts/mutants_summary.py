#!/usr/bin/env python3
"""Summarises a cargo-mutants run per file.

Usage: mutants_summary.py OUTCOMES_JSON EQUIVALENT_LIST

For every mutated file: viable mutants (those that built), caught ones
(a test failed or the run timed out), survivors, and the percentage caught.
Exits 1 when a survivor is left that the equivalent list does not cover.

The equivalent list names survivors judged equivalent, one a line:

    FILE: MUTATION in FUNCTION  # why

that is, cargo-mutants' description without its line and column (for
example `src/migrate.rs: replace | with ^ in migrate_pages`), so that an
entry survives edits elsewhere in the file. A key covers as many survivors
as the lines it is written on: three `|` of one expression that each survive
are three lines, and a fourth survivor of that key counts as missed. Entries
of a file this run mutated that cover no survivor are listed: as stale when
the mutant was made and caught (remove the entry), as not generated when no
such mutant was made (a filtered run, or the code is gone: re-key it).
"""
import json
import re
import sys
from collections import defaultdict

LINE_COL = re.compile(r"^(?P<file>[^:]+):\d+:\d+: ")


def key_of(name):
    """cargo-mutants' mutant name without the line and column."""
    return LINE_COL.sub(lambda m: m.group("file") + ": ", name, count=1)


def describe(outcome):
    scenario = outcome.get("scenario", {})
    mutant = scenario.get("Mutant") if isinstance(scenario, dict) else None
    if not mutant:
        return None, None
    f = mutant.get("file", "?")
    name = mutant.get("name")
    if not name:
        span = mutant.get("span", {}).get("start", {})
        name = "{}:{}:{}: {}".format(f, span.get("line", "?"), span.get("column", "?"), mutant.get("genre", "?"))
    return f, name


def read_equivalent(path):
    """{key: [why, why, ...]}: one reason per line the key is written on."""
    equivalent = defaultdict(list)
    try:
        with open(path) as lines:
            for number, raw in enumerate(lines, 1):
                raw = raw.strip()
                if not raw or raw.startswith("#"):
                    continue
                desc, _, why = raw.partition("  # ")
                desc = desc.strip()
                if LINE_COL.match(desc):
                    sys.exit("{}:{}: key an entry without its line and column: {}".format(path, number, desc))
                equivalent[desc].append(why.strip())
    except FileNotFoundError:
        pass
    return equivalent


def main():
    with open(sys.argv[1]) as f:
        outcomes = json.load(f)
    equivalent = read_equivalent(sys.argv[2])
    left = {k: list(v) for k, v in equivalent.items()}
    generated = set()
    per_file = defaultdict(lambda: {"caught": 0, "missed": [], "equivalent": [], "unviable": 0})
    for o in outcomes.get("outcomes", []):
        f, desc = describe(o)
        if f is None:
            continue
        s = o.get("summary")
        s = s if isinstance(s, str) else str(s)
        row = per_file[f]
        generated.add(key_of(desc))
        if s in ("CaughtMutant", "Timeout"):
            row["caught"] += 1
        elif s == "MissedMutant":
            reasons = left.get(key_of(desc))
            if reasons:
                row["equivalent"].append((desc, reasons.pop(0)))
            else:
                row["missed"].append(desc)
        else:
            row["unviable"] += 1
    print("{:<30} {:>7} {:>7} {:>7} {:>9}".format("file", "viable", "caught", "equiv", "caught %"))
    for f in sorted(per_file):
        r = per_file[f]
        viable = r["caught"] + len(r["missed"]) + len(r["equivalent"])
        judged = viable - len(r["equivalent"])
        pct = 100.0 * r["caught"] / judged if judged else 100.0
        print("{:<30} {:>7} {:>7} {:>7} {:>8.1f}%".format(f, viable, r["caught"], len(r["equivalent"]), pct))
    for f in sorted(per_file):
        for desc, why in per_file[f]["equivalent"]:
            print("equivalent: {}  ({})".format(desc, why))
    for key in sorted(left):
        f = key.split(": ", 1)[0]
        if f not in per_file or not left[key]:
            continue
        if key in generated:
            print("stale ({} line(s) cover no survivor: caught now): {}".format(len(left[key]), key))
        else:
            print("not generated ({} line(s); filtered out of this run, or the code is gone): {}".format(len(left[key]), key))
    missed_any = False
    for f in sorted(per_file):
        for desc in per_file[f]["missed"]:
            missed_any = True
            print("MISSED: {}".format(desc))
    sys.exit(1 if missed_any else 0)


if __name__ == "__main__":
    main()
