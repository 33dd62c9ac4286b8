"""The soak test (benches/soak.py): a one-minute run against `rocket serve` on
the CPU with the default model, and its checks fed fake reports (each check
must be able to fail)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench_module import BENCHES, load_bench

SOAK = BENCHES / "soak.py"


def _soak_module() -> Any:
    return load_bench("soak")


def _report(rss: list[tuple[float, int]], first_p99: float = 0.05, last_p99: float = 0.05) -> dict[str, Any]:
    lat = {"n": 50, "p50": 0.02}
    return {
        "duration_s": 300.0,
        "served": 100,
        "unexpected": {},
        "in_flight_at_end": 0,
        "rss_kb": rss,
        "latency": {
            "first": {"ttft": {**lat, "p99": first_p99}, "itl": {**lat, "p99": first_p99}},
            "last": {"ttft": {**lat, "p99": last_p99}, "itl": {**lat, "p99": last_p99}},
        },
    }


def test_checks_pass_a_steady_report_and_fail_each_fault() -> None:
    soak = _soak_module()
    flat = [(float(t), 300_000 + (t % 7) * 100) for t in range(0, 301, 2)]
    assert soak.evaluate(_report(flat), 0.05, 0.20) == []
    # RSS creeping up 10% after warm-up.
    growing = [(t, int(kb * (1 + 0.1 * t / 300))) for t, kb in flat]
    fails = soak.evaluate(_report(growing), 0.05, 0.20)
    assert len(fails) == 1 and "RSS grew" in fails[0], fails
    # Last-window p99 30% above the first.
    fails = soak.evaluate(_report(flat, 0.05, 0.065), 0.05, 0.20)
    assert len(fails) == 2 and all("drifted" in f for f in fails), fails
    # A lost request and a leaked slot.
    r = _report(flat)
    r["unexpected"] = {"unexpected: stream ended without [DONE]": 1}
    r["in_flight_at_end"] = 2
    fails = soak.evaluate(r, 0.05, 0.20)
    assert any("lost requests: 1" in f for f in fails) and any("leaked" in f for f in fails), fails
    # Too few latency samples to compare is a failure, not a pass.
    r = copy.deepcopy(_report(flat))
    r["latency"]["last"]["itl"]["n"] = 2
    assert any("too few samples" in f for f in soak.evaluate(r, 0.05, 0.20, 5))


@pytest.mark.slow
def test_one_minute_cpu_soak(tmp_path: Path, smollm2_path: str) -> None:
    # The server runs the default model (smollm2_path: it fails the setup when missing).
    out = tmp_path / "soak.json"
    # A smoke run of the whole tool: a shared CI machine's latency moves with its
    # neighbours and a minute gives few samples, so the drift, RSS and sample-count
    # limits here are looser than the defaults the long runs use.
    cmd = [sys.executable, str(SOAK), "--rocket", f"{sys.executable} -m rocket", "--device", "cpu",
           "--duration", "60", "--clients", "2", "--max-tokens", "8", "--burst-every", "20", "--min-samples", "2",
           "--p99-drift-max", "3.0", "--rss-growth-max", "0.15", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "soak: PASS" in r.stdout, r.stdout + r.stderr
    report = __import__("json").loads(out.read_text())
    assert report["served"] > 0 and report["in_flight_at_end"] == 0
    assert report["expected_errors"]["rejected_4xx"] > 0, report["expected_errors"]
    assert report["expected_errors"]["overloaded_429"] > 0, report["expected_errors"]
