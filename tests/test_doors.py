"""Every front end resolves a request through `Engine::resolve`: the same prompt with no
sampling arguments gives the same tokens from Rust (`Engine::generate` with default
options), Python (`LLM.generate`), the CLI (`rocket generate`) and the server
(`/v1/completions`). All four use the completion defaults: the model's generation_config
(greedy for the default model) and max_tokens 16."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rocket

PROMPT = "The capital of France is"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def python_door(smollm2_path: str) -> rocket.RequestOutput:
    return rocket.LLM(smollm2_path, device="cpu").generate(PROMPT)[0]


def test_python_door_uses_the_completion_defaults(python_door: rocket.RequestOutput) -> None:
    # The default model's generation_config does not sample; 16 tokens unless EOS comes first.
    assert len(python_door.token_ids) == 16 or python_door.finish_reason == "stop"
    assert python_door.text


def test_cli_door(smollm2_path: str, python_door: rocket.RequestOutput) -> None:
    cmd = [sys.executable, "-m", "rocket", "generate", "--model", smollm2_path, "--device", "cpu", "--stats", PROMPT]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    # stdout is the continuation and a newline.
    assert r.stdout == python_door.text + "\n"
    assert f"output {len(python_door.token_ids)} tokens" in r.stderr


def test_server_door(smollm2_path: str, python_door: rocket.RequestOutput) -> None:
    from test_serve import Server

    server = Server(smollm2_path)
    try:
        status, body = server.post("/v1/completions", {"prompt": PROMPT})
        assert status == 200, body
        assert body["choices"][0]["text"] == python_door.text
        assert body["usage"]["completion_tokens"] == len(python_door.token_ids)
    finally:
        server.stop()


def test_rust_door(smollm2_path: str, python_door: rocket.RequestOutput) -> None:
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if cargo is None:
        pytest.skip("cargo is not installed")
    cmd = [cargo, "run", "-q", "-p", "rocket-core", "--example", "complete", "--", smollm2_path, PROMPT]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == python_door.token_ids
    assert out["text"] == python_door.text


def test_server_default_max_tokens_caps_requests_that_set_none(smollm2_path: str) -> None:
    from test_serve import Server

    server = Server(smollm2_path, "--default-max-tokens", "5")
    try:
        chat = [{"role": "user", "content": "Tell me a long story."}]
        for path, body in [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": chat})]:
            status, r = server.post(path, {**body, "ignore_eos": True})
            assert status == 200, r
            assert r["usage"]["completion_tokens"] == 5, path
            # A request that sets max_tokens is not capped.
            status, r = server.post(path, {**body, "ignore_eos": True, "max_tokens": 7})
            assert status == 200 and r["usage"]["completion_tokens"] == 7, r
    finally:
        server.stop()
