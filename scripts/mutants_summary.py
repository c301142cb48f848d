#!/usr/bin/env python3
"""Summarises a cargo-mutants run per file.

Usage: mutants_summary.py OUTCOMES_JSON EQUIVALENT_LIST

For every mutated file: viable mutants (those that built), caught ones
(a test failed or the run timed out), survivors, and the percentage caught.
A survivor whose description appears in EQUIVALENT_LIST (one per line,
`file:line: description  # why`) is marked equivalent and listed with the
reason; the other survivors are listed as missed. Exits 1 when a missed
survivor is left.
"""
import json
import sys
from collections import defaultdict


def describe(outcome):
    scenario = outcome.get("scenario", {})
    mutant = scenario.get("Mutant") if isinstance(scenario, dict) else None
    if not mutant:
        return None, None
    f = mutant.get("file", "?")
    span = mutant.get("span", {}).get("start", {})
    line = span.get("line", "?")
    name = mutant.get("name")
    if name:
        return f, name
    return f, "{}:{}: {}".format(f, line, mutant.get("genre", "?"))


def summary(outcome):
    s = outcome.get("summary")
    return s if isinstance(s, str) else str(s)


def main():
    outcomes = json.load(open(sys.argv[1]))
    equivalent = {}
    try:
        for raw in open(sys.argv[2]):
            raw = raw.strip()
            if raw and not raw.startswith("#"):
                desc, _, why = raw.partition("  # ")
                equivalent[desc.strip()] = why.strip()
    except FileNotFoundError:
        pass
    per_file = defaultdict(lambda: {"caught": 0, "missed": [], "equivalent": [], "unviable": 0})
    for o in outcomes.get("outcomes", []):
        f, desc = describe(o)
        if f is None:
            continue
        s = summary(o)
        row = per_file[f]
        if s in ("CaughtMutant", "Timeout"):
            row["caught"] += 1
        elif s == "MissedMutant":
            key = next((k for k in equivalent if desc.endswith(k) or k in desc), None)
            if key:
                row["equivalent"].append((desc, equivalent[key]))
            else:
                row["missed"].append(desc)
        else:
            row["unviable"] += 1
    print("{:<22} {:>7} {:>7} {:>7} {:>9}".format("file", "viable", "caught", "equiv", "caught %"))
    missed_any = False
    for f in sorted(per_file):
        r = per_file[f]
        viable = r["caught"] + len(r["missed"]) + len(r["equivalent"])
        judged = viable - len(r["equivalent"])
        pct = 100.0 * r["caught"] / judged if judged else 100.0
        print("{:<22} {:>7} {:>7} {:>7} {:>8.1f}%".format(f, viable, r["caught"], len(r["equivalent"]), pct))
    for f in sorted(per_file):
        for desc, why in per_file[f]["equivalent"]:
            print("equivalent: {}  ({})".format(desc, why))
    for f in sorted(per_file):
        for desc in per_file[f]["missed"]:
            missed_any = True
            print("MISSED: {}".format(desc))
    sys.exit(1 if missed_any else 0)


if __name__ == "__main__":
    main()
