#!/usr/bin/env python3
"""Each sampling mode's decode step over greedy's, per fuel, from `rocket bench --json`
reports named PREFIX-MODE-FUEL.json (benches/gpu_run.sh's race step): what issue 21's
targets are stated in. A mode or fuel without a report is skipped; greedy's is needed.

  python3 benches/race_ratios.py --logs /tmp/rocket-logs --prefix race \\
      --fuels "smollm2-135m qwen3-0.6b" --modes "greedy topk topp"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def decode_ms(path: Path) -> float | None:
    """The first result row's decode ms/step, or None where the report is missing."""
    if not path.is_file():
        return None
    results = json.loads(path.read_text()).get("results") or []
    return results[0]["decode_ms_per_step"] if results else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logs", type=Path, required=True, help="folder of the bench reports")
    ap.add_argument("--prefix", default="race", help="report names' prefix (race, race16)")
    ap.add_argument("--fuels", required=True, help="space-separated fuel names")
    ap.add_argument("--modes", required=True, help="space-separated modes; greedy is the baseline")
    a = ap.parse_args()
    for fuel in a.fuels.split():
        greedy = decode_ms(a.logs / f"{a.prefix}-greedy-{fuel}.json")
        if greedy is None:
            continue
        for mode in a.modes.split():
            ms = decode_ms(a.logs / f"{a.prefix}-{mode}-{fuel}.json")
            if mode != "greedy" and ms is not None:
                print(f"RATIO {a.prefix:<6} {fuel:<14} {mode:<7} {ms:.3f} / {greedy:.3f} ms = {ms / greedy:.3f}x greedy")


if __name__ == "__main__":
    main()
