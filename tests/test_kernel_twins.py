"""The kernels' CPU twins (kernels/twin/): each runs its kernel's index arithmetic on
the CPU against a float64 reference and requires its deliberate mistakes (mutants) to
fail. A kernel source that changed without its twin fails here (the twin's hash), so a
kernel edit that CI cannot run on a GPU still meets its CPU check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TWINS = Path(__file__).resolve().parents[1] / "kernels" / "twin"


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(TWINS / script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("rope_kv_twin.py", ("--mutants",)),
        ("attention_prefill_wg_layout.py", ("--mutants",)),
        ("gemm_f16_layout.py", ("--mutants",)),
        ("attention_prefill_twin.py", ("--quick", "--mutants")),
    ],
)
def test_twin_passes_and_catches_its_mutants(script: str, args: tuple[str, ...]) -> None:
    out = _run(script, *args)
    lines = out.splitlines()
    assert lines and lines[-1] == "OK", out[-2000:]
    assert not [line for line in lines if line.startswith("WARNING")], f"{script}: its kernel changed since the twin was checked against it"
    caught = [line for line in lines if line.startswith("mutants: ")]
    assert len(caught) == 1, out[-2000:]
    n, total = caught[0].split()[1].split("/")
    assert n == total and int(total) >= 10, caught[0]
