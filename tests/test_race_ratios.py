"""benches/race_ratios.py: each sampling mode's decode step over greedy's, read from
`rocket bench --json` reports (the shape the bench writes), fed fresh random figures."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benches" / "race_ratios.py"


def _report(path: Path, ms: float) -> None:
    path.write_text(json.dumps({"results": [{"batch": 1, "decode_path": "megakernel", "decode_ms_per_step": ms}]}))


def _run(logs: Path, fuels: str, modes: str, prefix: str = "race") -> list[str]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--logs", str(logs), "--prefix", prefix, "--fuels", fuels, "--modes", modes],
        check=True, capture_output=True, text=True,
    ).stdout
    return out.splitlines()


def test_ratios_are_each_mode_over_greedy(tmp_path: Path) -> None:
    rng = random.Random()
    greedy, topk, topp = (rng.uniform(0.3, 1.5) for _ in range(3))
    _report(tmp_path / "race-greedy-qwen3-0.6b.json", greedy)
    _report(tmp_path / "race-topk-qwen3-0.6b.json", topk)
    _report(tmp_path / "race-topp-qwen3-0.6b.json", topp)
    lines = _run(tmp_path, "qwen3-0.6b", "greedy topk topp")
    assert len(lines) == 2, lines
    assert lines[0].split()[2:4] == ["qwen3-0.6b", "topk"] and lines[0].endswith(f"= {topk / greedy:.3f}x greedy"), lines
    assert lines[1].split()[3] == "topp" and lines[1].endswith(f"= {topp / greedy:.3f}x greedy"), lines


def test_a_fuel_without_greedy_or_a_missing_mode_is_skipped(tmp_path: Path) -> None:
    _report(tmp_path / "race16-topk-llama-3.2-1b.json", 1.7)  # no greedy report: nothing to divide by
    _report(tmp_path / "race16-greedy-smollm2-135m.json", 1.1)  # greedy only: no ratio
    assert _run(tmp_path, "llama-3.2-1b smollm2-135m", "greedy topk topp", prefix="race16") == []
