"""The long-prompt interference bench (benches/interference.py): its gap phases and
check on made-up timelines (the check must be able to fail), and a short run of the
whole tool against `rocket serve` on the CPU with a tiny fixture."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCHES = Path(__file__).resolve().parents[1] / "benches"
FIXTURES = Path(__file__).resolve().parent / "parity" / "fixtures"


def _module() -> Any:
    sys.path.insert(0, str(BENCHES))  # it imports soak's server start
    try:
        spec = importlib.util.spec_from_file_location("interference", BENCHES / "interference.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCHES))


def _report(bench: Any, before: list[float], during: list[float], errors: list[str] | None = None) -> dict[str, Any]:
    return {"phases": {"before": bench.summary(before), "during": bench.summary(during), "after": bench.summary([])},
            "errors": errors or [], "long_prompt_ttft_ms": 12.0}


def test_gaps_fall_in_the_phase_they_end_in_and_the_check_can_fail() -> None:
    bench = _module()
    # Two streams; the long prompt arrives at t=10 and gets its first token at t=20.
    streams = [[0.0, 4.0, 9.0, 12.0, 21.0, 22.0], [1.0, 10.0, 15.0, 20.0, 30.0]]
    gaps = bench.phases(streams, arrived=10.0, first_token=20.0)
    assert sorted(gaps["before"]) == [4.0, 5.0, 9.0]  # ends at 4, 9 and 10
    assert sorted(gaps["during"]) == [3.0, 5.0, 5.0]  # ends at 12, 15 and 20
    assert sorted(gaps["after"]) == [1.0, 9.0, 10.0]
    steady = [0.001] * 50
    assert bench.evaluate(_report(bench, steady, [0.0025] * 20), 3.0) == []
    fails = bench.evaluate(_report(bench, steady, [0.001] * 19 + [0.2]), 3.0)
    assert any("p99 gap while the long prompt prefills" in f for f in fails), fails
    assert any("too few gaps" in f for f in bench.evaluate(_report(bench, steady, [0.001] * 3), 3.0))
    assert any("errors" in f for f in bench.evaluate(_report(bench, steady, steady, ["request 2: HTTP 400"]), 3.0))
    silent = _report(bench, steady, steady)
    silent["long_prompt_ttft_ms"] = None
    assert any("never produced a token" in f for f in bench.evaluate(silent, 3.0))


def test_a_short_cpu_run_measures_gaps_while_a_prompt_prefills(tmp_path: Path) -> None:
    out = tmp_path / "gaps.json"
    # A smoke run of the whole tool on a tiny model: a shared CPU's gaps move with its
    # neighbours, so the p99 limit is left wide and only the measurement is checked.
    cmd = [sys.executable, str(BENCHES / "interference.py"), "--rocket", f"{sys.executable} -m rocket",
           "--model", str(FIXTURES / "tiny-qwen3"), "--device", "cpu", "--streams", "3", "--max-tokens", "400",
           "--prompt-len", "600", "--vocab", "400", "--prefix-block", "32", "--p99-over-median-max", "1e6",
           "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "interference: PASS" in r.stdout, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["errors"] == [] and report["long_prompt_ttft_ms"] > 0
    # Passes of 32 tokens: about 19 for the prompt, each a gap in every running stream.
    assert report["phases"]["during"]["count"] >= 5, report
    assert report["phases"]["before"]["count"] >= 3 * 31, report
