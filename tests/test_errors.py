"""Bad input gives a named RocketError subclass; bad arguments are ValueErrors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import rocket
from conftest import FIXTURES


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(rocket.ModelLoadError, match=str(missing)):
        rocket.LLM(missing)


def test_unknown_model_type_lists_supported(tiny_llama_copy: Path) -> None:
    cfg = tiny_llama_copy / "config.json"
    data = json.loads(cfg.read_text())
    data["model_type"] = "falcon"
    cfg.write_text(json.dumps(data))
    with pytest.raises(rocket.ModelLoadError, match=r"falcon.*llama, qwen3"):
        rocket.LLM(tiny_llama_copy)


def test_truncated_safetensors(tiny_llama_copy: Path) -> None:
    st = tiny_llama_copy / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-10])
    with pytest.raises(rocket.ModelLoadError, match="corrupt or truncated"):
        rocket.LLM(tiny_llama_copy)


def test_corrupt_gguf(tmp_path: Path, smollm2_path: str) -> None:
    bad = tmp_path / "bad.gguf"
    with open(smollm2_path, "rb") as f:
        bad.write_bytes(f.read(5000))
    with pytest.raises(rocket.ModelLoadError, match="corrupt or truncated"):
        rocket.LLM(bad)


def test_missing_tokenizer_is_named(tiny_llama_copy: Path) -> None:
    (tiny_llama_copy / "tokenizer.json").unlink()
    with pytest.raises(rocket.ModelLoadError, match="tokenizer.json"):
        rocket.LLM(tiny_llama_copy)


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.0}, "top_k"),
    ],
)
def test_sampling_params_validation(kwargs: dict[str, float], parameter: str) -> None:
    with pytest.raises(ValueError) as info:
        rocket.SamplingParams(**kwargs)  # type: ignore[arg-type]
    err = info.value
    assert isinstance(err, rocket.InvalidArgumentError) and isinstance(err, rocket.RocketError)
    assert err.parameter == parameter and parameter in str(err)


def test_empty_prompt(tiny_llama: rocket.LLM) -> None:
    with pytest.raises(rocket.InvalidArgumentError, match="empty"):
        tiny_llama.generate("", rocket.SamplingParams(max_tokens=2))


def test_context_overflow_names_both_numbers() -> None:
    llm = rocket.LLM(FIXTURES / "tiny-llama", max_seq_len=16)
    with pytest.raises(rocket.ContextLengthError) as info:
        llm.generate("hello world", rocket.SamplingParams(max_tokens=15))
    err = info.value
    assert isinstance(err, ValueError)
    assert err.limit == 16 and err.max_tokens == 15 and err.prompt_tokens is not None
    assert "15" in str(err) and "16" in str(err)


def test_bad_device_and_missing_cuda() -> None:
    with pytest.raises(rocket.InvalidArgumentError, match="device"):
        rocket.LLM(FIXTURES / "tiny-llama", device="tpu")  # type: ignore[arg-type]
    with pytest.raises(rocket.DeviceError, match="CUDA"):
        rocket.LLM(FIXTURES / "tiny-llama", device="cuda")


def test_bad_devices_are_named() -> None:
    for bad in ("gpu0", "0,0", ""):
        with pytest.raises(rocket.InvalidArgumentError, match="devices"):
            rocket.LLM(FIXTURES / "tiny-llama", devices=bad)
    with pytest.raises(rocket.InvalidArgumentError, match='devices.*not "cpu"'):
        rocket.LLM(FIXTURES / "tiny-llama", device="cpu", devices=[0, 1])
    # Not ordinals, or none: named as the keyword's error, before anything loads.
    for bad_list in (["0"], -1, [], [-1], [0.0]):
        with pytest.raises(rocket.InvalidArgumentError, match="devices") as info:
            rocket.LLM(FIXTURES / "tiny-llama", devices=bad_list)  # type: ignore[arg-type]
        assert info.value.parameter == "devices"


@pytest.mark.parametrize(
    ("keyword", "value", "listed"),
    [
        ("decode", "bogus", '"auto", "graph" or "megakernel"'),
        ("matmul", "blas", '"auto", "gemv", "tensor" or "cublas"'),
        ("sampler", "gpu", '"device" or "host"'),
        ("progress", "sometimes", '"auto", "off" or "always"'),
        ("decode", 3, "expected a str"),
        ("pdl", "yes", "True or False"),
        ("cuda_graphs", 1, "True or False"),
        ("prompt_graphs", "on", "True or False"),
        ("wgmma_attention", "yes", "True or False"),
        ("watchdog_ms", 0, "from 1 to 3600000"),
        ("watchdog_ms", True, "expected an int"),
        ("trace_step", -1, "step number"),
        ("max_seq_len", 0, "at least 1"),
    ],
)
def test_bad_engine_options_are_named(keyword: str, value: object, listed: str) -> None:
    # Checked before the model is looked up: model=None needs no default model here.
    with pytest.raises(rocket.InvalidArgumentError, match=keyword) as info:
        rocket.LLM(None, **{keyword: value})  # type: ignore[arg-type]
    assert info.value.parameter == keyword
    assert listed in str(info.value)


def test_engine_options_take_the_environment_below_keywords(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROCKET_DECODE", "bogus")
    with pytest.raises(rocket.InvalidArgumentError, match="ROCKET_DECODE") as info:
        rocket.LLM(None)
    assert info.value.parameter == "ROCKET_DECODE" and info.value.value == "bogus"
    env = [("ROCKET_DECODE", "megakernel"), ("ROCKET_PDL", "0"), ("ROCKET_WATCHDOG_MS", "5000"), ("HOME", "/x")]
    shown = repr(rocket._rocket.EngineOptions(env=env))
    assert "decode: Megakernel" in shown and "pdl: false" in shown and "watchdog: 5s" in shown
    shown = repr(rocket._rocket.EngineOptions(decode="graph", pdl=True, env=env))
    assert "decode: Graph" in shown and "pdl: true" in shown and "watchdog: 5s" in shown
    # A keyword wins even over a bad variable of its option (the variable is not read).
    shown = repr(rocket._rocket.EngineOptions(decode="graph", env=[("ROCKET_DECODE", "bogus")]))
    assert "decode: Graph" in shown
    with pytest.raises(rocket.InvalidArgumentError, match="ROCKET_DECODE"):
        rocket._rocket.EngineOptions(pdl=True, env=[("ROCKET_DECODE", "bogus")])


def test_bad_argument_types(tiny_llama: rocket.LLM) -> None:
    with pytest.raises(ValueError):
        tiny_llama.generate([1, 2])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        tiny_llama.generate("x", {"max_tokens": 3})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"temperature": "hot"}, "temperature"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": 3}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"stop_token_ids": [2**32]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ],
)
def test_bad_sampling_arguments_name_the_parameter(kwargs: dict[str, object], parameter: str) -> None:
    with pytest.raises(rocket.InvalidArgumentError) as info:
        rocket.SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.parameter == parameter and parameter in str(info.value)


@pytest.mark.parametrize(("parameter", "value"), [("top_p", 1e-300), ("temperature", 1e300), ("min_p", -1e-60)])
def test_numbers_past_f32_are_named_as_given(parameter: str, value: float) -> None:
    # Not as the 0 or inf they would round to.
    with pytest.raises(rocket.InvalidArgumentError) as info:
        rocket.SamplingParams(**{parameter: value})  # type: ignore[arg-type]
    assert info.value.parameter == parameter and repr(value) in str(info.value), str(info.value)


def test_the_value_is_the_given_repr_whichever_layer_refused_it(tiny_llama: rocket.LLM) -> None:
    with pytest.raises(rocket.InvalidArgumentError) as info:  # the binding's check
        rocket.SamplingParams(temperature="0.5")  # type: ignore[arg-type]
    assert info.value.value == "'0.5'"
    with pytest.raises(rocket.InvalidArgumentError) as info:  # rocket/__init__.py's check
        tiny_llama.generate(["a", 1])  # type: ignore[list-item]
    assert info.value.parameter == "prompts" and info.value.value == "['a', 1]"


def test_params_of_the_wrong_type_are_named(tiny_llama: rocket.LLM) -> None:
    with pytest.raises(rocket.InvalidArgumentError, match="got dict"):
        tiny_llama.generate("x", {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(rocket.InvalidArgumentError, match="got int"):
        tiny_llama.generate("x", [3])  # type: ignore[list-item]


def test_token_ids_are_checked(tiny_llama: rocket.LLM) -> None:
    vocab = tiny_llama.info["vocab_size"]
    with pytest.raises(rocket.InvalidArgumentError) as info:
        tiny_llama.tokenizer.decode([10**8])
    assert info.value.parameter == "ids"
    with pytest.raises(rocket.InvalidArgumentError) as info:
        tiny_llama.tokenizer.decode([-1])
    assert info.value.parameter == "ids"
    with pytest.raises(rocket.InvalidArgumentError) as info:
        tiny_llama.generate_from_ids([1, -2])
    assert info.value.parameter == "prompt_token_ids"
    with pytest.raises(rocket.InvalidArgumentError) as info:
        tiny_llama.generate_from_ids([1, vocab])
    assert info.value.parameter == "prompt_token_ids"
    with pytest.raises(rocket.InvalidArgumentError) as info:
        tiny_llama.teacher_forced_logits([vocab + 5])
    assert info.value.parameter == "token_ids"
    # stop_token_ids beyond the model's vocabulary are refused when the request is resolved.
    params = rocket.SamplingParams(max_tokens=2, stop_token_ids=[vocab])
    with pytest.raises(rocket.InvalidArgumentError) as info:
        tiny_llama.generate("hello", params)
    assert info.value.parameter == "stop_token_ids" and str(vocab) in str(info.value)
    tiny_llama.generate("hello", rocket.SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1]))
