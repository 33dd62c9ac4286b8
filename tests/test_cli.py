"""The `rocket` console script installed by pip behaves like the Rust CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import FIXTURES


def run(*args: str) -> subprocess.CompletedProcess[str]:
    # The script pip installed beside this interpreter (a venv's bin/ need not be on PATH).
    exe = shutil.which("rocket", path=os.path.dirname(sys.executable)) or shutil.which("rocket")
    assert exe, "`pip install .` must put a rocket command on PATH"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def test_generate_with_default_model() -> None:
    r = run("generate", "--max-tokens", "8", "--temperature", "0", "The capital of France is")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is") and "Paris" in r.stdout


def test_generate_chat_and_stats() -> None:
    r = run("generate", "--chat", "--stats", "-n", "16", "What is 2+2?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "tokens/s" in r.stderr


def test_inspect() -> None:
    r = run("inspect", str(FIXTURES / "tiny-llama"))
    assert r.returncode == 0, r.stderr
    assert "llama3 scaling" in r.stdout and "bytes read per decode step" in r.stdout


@pytest.mark.parametrize("args", [("generate", "--model", "/no/such/dir", "hi"), ("inspect", "/no/such/file.gguf")])
def test_errors_are_one_line(args: tuple[str, ...]) -> None:
    r = run(*args)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "/no/such" in r.stderr


def test_usage_error() -> None:
    r = run("frobnicate")
    assert r.returncode == 2
