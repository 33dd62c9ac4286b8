"""The long-prompt interference bench (benches/interference.py): its gap phases and
check on made-up timelines (the check must be able to fail), and a short run of the
whole tool against `rocket serve` on the CPU with the default model (SmolLM2-135M)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_module import BENCHES, load_bench

FIXTURES = Path(__file__).resolve().parent / "parity" / "fixtures"


def _module() -> Any:
    return load_bench("interference")


def _report(bench: Any, before: list[float], during: list[float], errors: list[str] | None = None,
            passes: tuple[list[float], list[float]] | None = None) -> dict[str, Any]:
    def phases(b: list[float], d: list[float]) -> dict[str, Any]:
        return {"before": bench.summary(b), "during": bench.summary(d), "after": bench.summary([])}
    return {"phases": phases(before, during), "pass_phases": phases(*(passes or (before, during))),
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
    assert any("p99 of the gaps between chunks" in f for f in fails), fails
    # The server's passes are judged alike: steady chunks do not hide a stalled pass.
    fails = bench.evaluate(_report(bench, steady, [0.0025] * 20, passes=(steady, [0.001] * 19 + [0.2])), 3.0)
    assert len(fails) == 1 and "p99 of the gaps between passes" in fails[0], fails
    assert any("too few gaps" in f for f in bench.evaluate(_report(bench, steady, [0.001] * 3), 3.0))
    assert not any("too few gaps" in f for f in bench.evaluate(_report(bench, steady, [0.001] * 3), 3.0, min_gaps=3))
    assert any("errors" in f for f in bench.evaluate(_report(bench, steady, steady, ["request 2: HTTP 400"]), 3.0))
    silent = _report(bench, steady, steady)
    silent["long_prompt_ttft_ms"] = None
    assert any("never produced a token" in f for f in bench.evaluate(silent, 3.0))


def test_pass_gaps_come_from_the_servers_pass_lines_in_every_stream() -> None:
    bench = _module()
    log = [
        "2026-12-06T19:00:00.000000Z DEBUG rocket_core::batch: pass done prompt_rows=32 decode_rows=0\n",  # the streams' prompts
        "2026-12-06T19:00:00.010000Z DEBUG rocket_core::batch: pass done prompt_rows=0 decode_rows=2\n",
        "2026-12-06T19:00:00.012000Z  WARN rocket_core::engine: something else\n",
        "2026-12-06T19:00:00.012000Z DEBUG rocket_core::batch: pass done prompt_rows=0 decode_rows=2\n",
        "2026-12-06T19:00:00.014500Z DEBUG rocket_core::batch: pass done prompt_rows=0 decode_rows=2\n",
        "2026-12-06T19:00:00.019500Z DEBUG rocket_core::batch: pass done prompt_rows=64 decode_rows=2\n",  # the long prompt
        "2026-12-06T19:00:00.024500Z DEBUG rocket_core::batch: pass done prompt_rows=64 decode_rows=2\n",
        "2026-12-06T19:00:00.031500Z DEBUG rocket_core::batch: pass done prompt_rows=7 decode_rows=2\n",  # its last piece
        "2026-12-06T19:00:00.033500Z DEBUG rocket_core::batch: pass done prompt_rows=0 decode_rows=3\n",  # it decodes too
        "2026-12-06T19:00:00.035500Z DEBUG rocket_core::batch: pass done prompt_rows=0 decode_rows=2\n",
        "2026-12-06T19:00:00.037000Z DEBUG rocket_core::batch: pass done prompt_rows=0 decode_rows=2\n",
    ]
    passes = bench.server_passes(log)
    assert [(p, d) for _, p, d in passes] == [(32, 0), (0, 2), (0, 2), (0, 2), (64, 2), (64, 2), (7, 2), (0, 3), (0, 2), (0, 2)]
    gaps = {k: [round(g * 1e3, 3) for g in v] for k, v in bench.pass_phases(passes, streams=2).items()}
    assert gaps == {"before": [2.0, 2.5], "during": [5.0, 5.0, 7.0], "after": [4.0, 1.5]}, gaps
    assert bench.pass_phases(passes[:4], streams=2) == {"before": [], "during": [], "after": []}  # no long prompt yet


def test_cuda_prompt_passes_are_read_from_the_backends_pass_lines() -> None:
    bench = _module()
    log = [f"2026-12-06T19:00:00.{i:06d}Z DEBUG rocket_core::backend::cuda: pass rows={r} decode={d} issue_us={iu} total_us={tu}\n"
           for i, (r, d, iu, tu) in enumerate([(8, "true", 20.5, 1700.0), (72, "false", 2100.0, 4600.0),
                                               (72, "false", 2300.0, 4800.5), (72, "false", 1900.0, 9000.0)])]
    c = bench.cuda_mixed_passes(log)
    assert c == {"count": 3, "issue_median_us": 2100.0, "total_median_us": 4800.5, "total_p99_us": 9000.0}, c
    assert bench.cuda_mixed_passes(log[:1])["count"] == 0


def test_a_short_cpu_run_measures_gaps_while_a_prompt_prefills(tmp_path: Path) -> None:
    out = tmp_path / "gaps.json"
    # A smoke run of the whole tool on the default model (SmolLM2-135M): beside decoding
    # streams its prompt prefills in pieces of ~600 rows (the batcher's multiply-add budget),
    # so a 2,400-token prompt takes about four passes; a tiny fixture's whole prompt fits one.
    # A shared CPU's gaps move with its neighbours, so the p99 limit is left wide and only
    # the measurement is checked.
    cmd = [sys.executable, str(BENCHES / "interference.py"), "--rocket", f"{sys.executable} -m rocket",
           "--device", "cpu", "--streams", "2", "--max-tokens", "150", "--prompt-len", "2400", "--vocab", "400",
           "--p99-over-median-max", "1e6", "--min-gaps", "3", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "interference: PASS" in r.stdout, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["errors"] == [] and report["long_prompt_ttft_ms"] > 0
    # Each of the prompt's passes is a gap in every running stream; the streams decode
    # one token per pass before it arrives.
    assert report["phases"]["during"]["count"] >= 2 * 2, report
    assert report["phases"]["before"]["count"] >= 2 * 31, report
    assert report["pass_phases"]["during"]["count"] >= 3, report
    assert report["pass_phases"]["before"]["count"] >= 20, report
