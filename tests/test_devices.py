"""The several-GPU server bench (benches/devices.py): its checks on made-up runs (each
must be able to fail), and a short run of the whole tool against `rocket serve` on the
CPU with a tiny fixture (one engine: the one-GPU half of the bench)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_module import BENCHES, load_bench

FIXTURES = Path(__file__).resolve().parent / "parity" / "fixtures"


def _module() -> Any:
    return load_bench("devices")


def _run(gpus: int, tokens_per_s: float, ready_s: float, running: list[int] | None = None, errors: list[str] | None = None) -> dict[str, Any]:
    names = [f"cuda:{i}" for i in range(gpus)]
    return {"devices": "all" if gpus > 1 else "0", "gpus": gpus, "tokens_per_s": tokens_per_s, "load_to_ready_s": ready_s,
            "most_running": dict(zip(names, running or [32] * gpus)), "errors": errors or []}


def _report(one: dict[str, Any], all_: dict[str, Any] | None = None) -> dict[str, Any]:
    r: dict[str, Any] = {"runs": [one] + ([all_] if all_ else [])}
    if all_:
        r["speedup"] = all_["tokens_per_s"] / one["tokens_per_s"]
        r["load_ratio"] = all_["load_to_ready_s"] / one["load_to_ready_s"]
    return r


def test_the_checks_pass_at_the_targets_and_fail_past_them() -> None:
    bench = _module()
    assert bench.evaluate(_report(_run(1, 1000, 10.0), _run(2, 1950, 12.5)), 1.9, 1.3) == []
    # Too little speedup for two GPUs, and for four (0.95 x 4 = 3.8).
    assert any("1.80x" in f for f in bench.evaluate(_report(_run(1, 1000, 10.0), _run(2, 1800, 12.0)), 1.9, 1.3))
    assert bench.evaluate(_report(_run(1, 1000, 10.0), _run(4, 3700, 12.0)), 1.9, 1.3) != []
    assert bench.evaluate(_report(_run(1, 1000, 10.0), _run(4, 3850, 12.0)), 1.9, 1.3) == []
    # Loading too slowly, a GPU that never ran a stream, a failed stream.
    assert any("load to ready" in f for f in bench.evaluate(_report(_run(1, 1000, 10.0), _run(2, 2000, 13.5)), 1.9, 1.3))
    assert any("cuda:1 never ran" in f for f in bench.evaluate(_report(_run(1, 1000, 10.0), _run(2, 2000, 11.0, [32, 0])), 1.9, 1.3))
    assert bench.evaluate(_report(_run(1, 1000, 10.0, errors=["stream 3: HTTP 500"])), 1.9, 1.3) == ["FAIL: stream 3: HTTP 500"]
    # One GPU alone: nothing to compare, nothing fails.
    assert bench.evaluate(_report(_run(1, 1000, 10.0)), 1.9, 1.3) == []


def test_prompts_are_random_nonzero_and_the_same_in_every_server() -> None:
    bench = _module()
    a, b = bench.prompt(0, 3, 16, 1000), bench.prompt(0, 3, 16, 1000)
    assert a == b and len(a) == 16 and all(1 <= t < 1000 for t in a)
    assert a != bench.prompt(0, 4, 16, 1000) and a != bench.prompt(1, 3, 16, 1000)


def test_a_short_cpu_run_serves_every_stream_as_it_runs_alone(tmp_path: Path) -> None:
    out = tmp_path / "devices.json"
    cmd = [sys.executable, str(BENCHES / "devices.py"), "--rocket", f"{sys.executable} -m rocket",
           "--model", str(FIXTURES / "tiny-qwen3"), "--device", "cpu", "--streams-per-gpu", "4", "--max-batch-per-gpu", "4",
           "--max-tokens", "12", "--prompt-len", "9", "--vocab", "400", "--check-solo", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "devices: PASS" in r.stdout, r.stdout + r.stderr
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["errors"] == [] and run["streams"] == 4 and run["solo_checked"] == 4, run
    assert run["tokens"] == 4 * 12 and run["tokens_per_s"] > 0 and run["load_to_ready_s"] > 0, run
    assert "DEVICES --devices cpu" in r.stdout, r.stdout


def test_the_gpus_counted_are_those_the_servers_see(monkeypatch: Any) -> None:
    bench = _module()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert bench.gpu_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert bench.gpu_count() == 0
