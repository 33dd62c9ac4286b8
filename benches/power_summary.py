#!/usr/bin/env python3
"""Mean SM clock, power draw and temperature of the GPU during each bench.

Reads the samples benches/gpu_run.sh takes with POWER_LOG=1 (nvidia-smi
--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu, CSV, UTC
clock) and its bench.times file ("NAME start|end UNIX_SECONDS" lines), and prints
one row per bench, so that a change in ms/token can be told from the clock
moving under it.

Usage: power_summary.py power.csv bench.times
"""
import csv
import sys
from datetime import datetime, timezone


def samples(path):
    out = []
    with open(path) as f:
        for row in csv.reader(f):
            if len(row) < 5:
                continue
            try:
                t = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
                sm = float(row[1].split()[0])
                power = float(row[3].split()[0])
                temp = float(row[4])
            except ValueError:
                continue  # a header or a field nvidia-smi could not read
            out.append((t, sm, power, temp))
    return out


def spans(path):
    start, result = {}, []
    with open(path) as f:
        for line in f:
            name, what, t = line.split()
            if what == "start":
                start[name] = float(t)
            elif name in start:
                result.append((name, start.pop(name), float(t)))
    return result


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    data = samples(sys.argv[1])
    print("| bench | samples | SM MHz mean (min) | W mean (max) | °C max |")
    print("|:--|--:|--:|--:|--:|")
    for name, a, b in spans(sys.argv[2]):
        inside = [s for s in data if a <= s[0] <= b]
        if not inside:
            print(f"| {name} | 0 | - | - | - |")
            continue
        sm = [s[1] for s in inside]
        w = [s[2] for s in inside]
        print(
            f"| {name} | {len(inside)} | {sum(sm) / len(sm):.0f} ({min(sm):.0f}) | "
            f"{sum(w) / len(w):.0f} ({max(w):.0f}) | {max(s[3] for s in inside):.0f} |"
        )


if __name__ == "__main__":
    main()
