#!/usr/bin/env python3
"""Summarises one decode step from an Nsight Compute CSV (gpu__time_duration per kernel).

Usage: ncu_step.py FILE.csv [PASS]
PASS counts passes from the end (-1, the default, is the last; -2 the one before):
a pass is every kernel from one `embed_gather` to the next. Prints each kernel of
the pass's first layer and the pass's totals per kernel name, so a batched step's
time can be split by op (kernels run one at a time under ncu, so the sum leaves out
the launch gaps a CUDA graph hides).
"""
import collections
import csv
import sys


UNIT_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}


def duration_rows(lines):
    """The gpu__time_duration.sum rows of an ncu --csv (one metric a row), as dicts."""
    lines = [l for l in lines if l.startswith('"')]  # ncu prints its own log lines first
    return [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]


def row_us(r):
    return float(r["Metric Value"].replace(",", "")) * UNIT_US.get(r["Metric Unit"], 1e-3)


def totals_by_kernel(rows):
    """{kernel name without its arguments: [launches, µs]} over `rows`."""
    totals = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        t = totals[r["Kernel Name"].split("(")[0]]
        t[0] += 1
        t[1] += row_us(r)
    return totals


def main(path, which=-1):
    with open(path, newline="") as f:
        rows = duration_rows(f)
    if not rows:
        sys.exit(f"{path}: no gpu__time_duration rows")
    starts = [i for i, r in enumerate(rows) if r["Kernel Name"].startswith("embed_gather")]
    bounds = starts + [len(rows)]
    if not starts or -which > len(starts):
        sys.exit(f"{path}: no pass {which} ({len(starts)} passes)")
    step = rows[bounds[which - 1]:bounds[which]] if which < -1 else rows[starts[-1]:]
    print(f"first layer of pass {which} ({len(step)} kernels in the pass):")
    for r in step[:12]:
        print(f"  {r['Kernel Name'][:40]:40s} grid {r['Grid Size']:>14s}  {row_us(r):8.1f} us")
    totals = totals_by_kernel(step)
    total = sum(t[1] for t in totals.values())
    print(f"pass total {total:.1f} us (kernel time only)")
    for name, (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name[:40]:40s} x{n:4d}  {t:9.1f} us  {100 * t / total:5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else -1)
