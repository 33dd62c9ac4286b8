"""Prefix reuse through the Python API and the `rocket chat` loop: a prompt that
starts with the whole blocks of an earlier prompt reuses their KV, and outputs
are exactly those of an engine with the cache off."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import rocket
from conftest import FIXTURES

BLOCK = 8


def llm(cache_bytes: int | None) -> rocket.LLM:
    return rocket.LLM(FIXTURES / "tiny-llama", device="cpu", progress="off", prefix_cache_bytes=cache_bytes, prefix_block=BLOCK)


def test_a_chat_turn_reuses_the_last_and_outputs_are_unchanged() -> None:
    cached, plain = llm(1 << 30), llm(0)
    params = rocket.SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2)
    messages = [{"role": "system", "content": "You answer in one short line."}]
    last_len = 0
    for turn, question in enumerate(["What is the capital of France?", "And of Italy?"]):
        messages.append({"role": "user", "content": question})
        got = cached.chat(messages, params)
        want = plain.chat(messages, params)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.logprobs == want.logprobs
        reused = got.metrics["cached_prompt_tokens"]
        assert reused == (0 if turn == 0 else last_len // BLOCK * BLOCK), turn
        assert want.metrics["cached_prompt_tokens"] == 0
        last_len = got.metrics["prompt_tokens"]
        messages.append({"role": "assistant", "content": got.text})
    stats = cached.prefix_cache_stats()
    assert stats["hits"] == 1 and stats["tokens_reused"] > 0 and stats["entries"] == 1
    assert 0 < stats["bytes"] <= stats["max_bytes"] == 1 << 30 and stats["block"] == BLOCK
    off = plain.prefix_cache_stats()
    assert (off["hits"], off["bytes"], off["max_bytes"]) == (0, 0, 0)


def test_the_default_budget_and_bad_values() -> None:
    default = rocket.LLM(FIXTURES / "tiny-llama", device="cpu", progress="off")
    assert default.prefix_cache_stats()["max_bytes"] == 1 << 30
    assert default.prefix_cache_stats()["block"] == 128
    with pytest.raises(rocket.InvalidArgumentError, match="prefix_block"):
        rocket.LLM(FIXTURES / "tiny-llama", device="cpu", prefix_block=0)
    with pytest.raises(rocket.InvalidArgumentError, match="prefix_cache_bytes"):
        rocket.LLM(FIXTURES / "tiny-llama", device="cpu", prefix_cache_bytes=-1)
    with pytest.raises(rocket.InvalidArgumentError, match="prefix_cache_bytes"):
        rocket.LLM(FIXTURES / "tiny-llama", device="cpu", prefix_cache_bytes="1G")  # type: ignore[arg-type]


def test_the_cli_chat_loop_reuses_the_previous_turn(tmp_path) -> None:  # type: ignore[no-untyped-def]
    exe = shutil.which("rocket", path=os.path.dirname(sys.executable)) or shutil.which("rocket")
    assert exe
    env = {**os.environ, "ROCKET_LOG": "info"}
    args = [exe, "chat", "-m", str(FIXTURES / "tiny-llama"), "--device", "cpu", "-n", "6", "--temperature", "0"]
    r = subprocess.run([*args, "--prefix-block", str(BLOCK)], input="hello there\nand again\n", capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    turns = [line for line in r.stderr.splitlines() if "chat turn" in line]
    assert len(turns) == 2, r.stderr
    assert "cached_prompt_tokens=0" in turns[0]
    reused = int(turns[1].split("cached_prompt_tokens=")[1].split()[0])
    assert reused > 0 and reused % BLOCK == 0, turns[1]
    off = subprocess.run([*args, "--prefix-block", str(BLOCK), "--prefix-cache-bytes", "0"], input="hello there\nand again\n", capture_output=True, text=True, timeout=300, env=env)
    assert off.returncode == 0 and off.stdout == r.stdout, off.stderr
    assert all("cached_prompt_tokens=0" in line for line in off.stderr.splitlines() if "chat turn" in line)


def test_the_real_model_gives_the_same_chat_turns_with_reuse(smollm2_path: str) -> None:
    # SmolLM2-135M-Instruct: the second turn's prompt starts with the first's, and its
    # answer (greedy and seeded sampling, with logprobs) is the one the cache-off engine gives.
    cached = rocket.LLM(smollm2_path, device="cpu", progress="off", prefix_block=32)
    plain = rocket.LLM(smollm2_path, device="cpu", progress="off", prefix_block=32, prefix_cache_bytes=0)
    system = "You are a helpful assistant. You answer questions about geography briefly, in one sentence, and you never make things up."
    for params in [
        rocket.SamplingParams(max_tokens=12, temperature=0.0, logprobs=3),
        rocket.SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, logprobs=3),
    ]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of France?"}]
        first = cached.chat(messages, params)
        assert first.logprobs == plain.chat(messages, params).logprobs
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And what is the capital of Spain?"}]
        got, want = cached.chat(messages, params), plain.chat(messages, params)
        # At least the first turn's whole blocks (more where an earlier conversation
        # of this loop shares more of the prompt).
        reused = got.metrics["cached_prompt_tokens"]
        assert reused >= first.metrics["prompt_tokens"] // 32 * 32 > 0 and reused % 32 == 0
        assert (got.token_ids, got.text, got.logprobs) == (want.token_ids, want.text, want.logprobs)
