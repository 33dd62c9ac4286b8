"""Generation features on the real SmolLM2 weights: stopping, streaming,
penalties, logprobs, per-prompt params."""

from __future__ import annotations

import math

import pytest

import rocket
from conftest import FIXTURES

PROMPT = "The capital of France is"


def greedy(**kw: object) -> rocket.SamplingParams:
    return rocket.SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(smollm2: rocket.LLM) -> rocket.RequestOutput:
    return smollm2.generate(PROMPT, greedy(max_tokens=24, ignore_eos=True))[0]


def test_stop_string_split_across_tokens_is_trimmed(smollm2: rocket.LLM, reference: rocket.RequestOutput) -> None:
    text = reference.text
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [smollm2.tokenizer.decode(reference.token_ids[: i + 1]) for i in range(len(reference.token_ids))]
    boundary = len(pieces[2])
    stop = text[boundary - 2 : boundary + 3]
    assert len(stop) == 5 and stop in text
    out = smollm2.generate(PROMPT, greedy(max_tokens=24, ignore_eos=True, stop=[stop, "never-occurs"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_stop_token_ids(smollm2: rocket.LLM, reference: rocket.RequestOutput) -> None:
    target = reference.token_ids[5]
    out = smollm2.generate(PROMPT, greedy(max_tokens=24, ignore_eos=True, stop_token_ids=[target]))[0]
    first = reference.token_ids.index(target)
    assert out.token_ids == reference.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    # The stop token's own text is not output (as a stop string's is not, and as in vLLM).
    assert out.text == smollm2.tokenizer.decode(reference.token_ids[:first])
    stream = smollm2.stream(PROMPT, greedy(max_tokens=24, ignore_eos=True, stop_token_ids=[target]))
    assert "".join(d.text for d in stream) == out.text
    # Asking for special tokens shows every token's text, the end one's too.
    shown = smollm2.generate(PROMPT, greedy(max_tokens=24, ignore_eos=True, stop_token_ids=[target], skip_special_tokens=False))[0]
    assert shown.text == smollm2.tokenizer.decode(reference.token_ids[: first + 1])


def test_a_stream_keeps_its_engine_loaded() -> None:
    import gc

    params = greedy(max_tokens=12, ignore_eos=True)

    def open_stream() -> tuple[rocket.RequestOutput, rocket.Stream]:
        llm = rocket.LLM(FIXTURES / "tiny-llama", device="cpu")
        return llm.generate(PROMPT, params)[0], llm.stream(PROMPT, params)

    # The LLM is gone once open_stream returns; the stream must still run to its end.
    want, stream = open_stream()
    gc.collect()
    assert "".join(d.text for d in stream) == want.text and stream.finish_reason == "length"


def test_min_tokens_holds_back_stop_strings(smollm2: rocket.LLM, reference: rocket.RequestOutput) -> None:
    # A stop string that the first token completes ends nothing before min_tokens tokens.
    first = smollm2.tokenizer.decode(reference.token_ids[:1])
    early = smollm2.generate(PROMPT, greedy(max_tokens=24, ignore_eos=True, stop=[first]))[0]
    assert early.text == "" and len(early.token_ids) == 1 and early.stop_reason == first
    held = smollm2.generate(PROMPT, greedy(max_tokens=8, ignore_eos=True, min_tokens=4, stop=[first]))[0]
    assert held.token_ids == reference.token_ids[:8] and held.finish_reason == "length"


def test_stream_concatenates_to_generate(smollm2: rocket.LLM) -> None:
    for prompt, params in [
        (PROMPT, greedy(max_tokens=30)),
        ("Write one word in Japanese and an emoji:", greedy(max_tokens=30, ignore_eos=True)),
        (PROMPT, greedy(max_tokens=30, stop=["Paris"], logprobs=0)),
    ]:
        want = smollm2.generate(prompt, params)[0]
        stream = smollm2.stream(prompt, params)
        deltas = list(stream)
        assert "".join(d.text for d in deltas) == want.text
        assert [d.token_id for d in deltas] == want.token_ids
        assert stream.finish_reason == want.finish_reason
        for d in deltas:
            d.text.encode("utf-8")  # never a broken sequence (would raise on surrogates)
            assert "\ufffd" not in d.text or "\ufffd" in want.text


def test_stop_strings_hold_back_only_text_that_may_start_one(smollm2: rocket.LLM) -> None:
    # Nothing the model writes can begin "\x00never": each delta is what it is without stops.
    params = greedy(max_tokens=12, ignore_eos=True)
    plain = [d.text for d in smollm2.stream(PROMPT, params)]
    stopped = [d.text for d in smollm2.stream(PROMPT, greedy(max_tokens=12, ignore_eos=True, stop=["\x00never"]))]
    assert stopped == plain


def test_closing_a_stream_cancels(smollm2: rocket.LLM) -> None:
    stream = smollm2.stream(PROMPT, greedy(max_tokens=500, ignore_eos=True))
    first = next(stream)
    assert isinstance(first.token_id, int)
    assert stream.finish_reason is None
    stream.close()
    assert list(stream) == [] and stream.finish_reason == "cancelled"
    # A stream read to its end keeps its reason when closed after.
    done = smollm2.stream(PROMPT, greedy(max_tokens=3, ignore_eos=True))
    assert len(list(done)) == 3 and done.finish_reason == "length"
    done.close()
    assert done.finish_reason == "length"
    # A with block closes it too, on leaving by break or by an exception.
    with smollm2.stream(PROMPT, greedy(max_tokens=500, ignore_eos=True)) as s:
        for _ in s:
            break
    assert list(s) == []
    with pytest.raises(RuntimeError, match="leave"):
        with smollm2.stream(PROMPT, greedy(max_tokens=500, ignore_eos=True)) as s:
            next(s)
            raise RuntimeError("leave")
    assert list(s) == [] and s.finish_reason == "cancelled"


def test_logprobs(smollm2: rocket.LLM) -> None:
    out = smollm2.generate(PROMPT, greedy(max_tokens=5, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry["token_id"] == tok and entry["logprob"] <= 0
        top = entry["top"]
        assert len(top) == 3 and top[0][0] == tok  # greedy picks the most likely
        assert math.isclose(top[0][1], entry["logprob"], abs_tol=1e-6)
        assert top[0][1] >= top[1][1] >= top[2][1]


def test_repetition_penalties_change_repetitive_output(smollm2: rocket.LLM) -> None:
    prompt = "one two one two one two one two"
    plain = smollm2.generate(prompt, greedy(max_tokens=12, ignore_eos=True))[0]
    for kw in ({"repetition_penalty": 1.8}, {"frequency_penalty": 1.5}, {"presence_penalty": 2.0}):
        penalised = smollm2.generate(prompt, greedy(max_tokens=12, ignore_eos=True, **kw))[0]
        assert penalised.token_ids != plain.token_ids, kw
        assert len(set(penalised.token_ids)) >= len(set(plain.token_ids)), kw


def test_min_tokens_delays_eos(smollm2: rocket.LLM) -> None:
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Say hi."}])
    short = smollm2.generate(prompt, greedy(max_tokens=200))[0]
    assert short.finish_reason == "stop"
    longer = smollm2.generate(prompt, greedy(max_tokens=200, min_tokens=len(short.token_ids) + 3))[0]
    assert len(longer.token_ids) > len(short.token_ids)


def test_per_prompt_params_and_seeds(smollm2: rocket.LLM) -> None:
    prompts = ["Once upon a time", PROMPT]
    params = [rocket.SamplingParams(max_tokens=8, temperature=0.9, seed=7), greedy(max_tokens=4)]
    outs = smollm2.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts and len(outs[1].token_ids) <= 4
    assert outs[0].token_ids == smollm2.generate(prompts[0], params[0])[0].token_ids
    with pytest.raises(ValueError):
        smollm2.generate(prompts, params[:1])


def test_chat(smollm2: rocket.LLM) -> None:
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}], greedy(max_tokens=20))
    assert "Paris" in out.text


def test_skip_special_tokens_false_keeps_eos_text(smollm2: rocket.LLM) -> None:
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Say hi."}])
    out = smollm2.generate(prompt, greedy(max_tokens=200, skip_special_tokens=False))[0]
    assert out.finish_reason == "stop" and out.text.endswith("<|im_end|>")


def test_unset_values_come_from_generation_config(smollm2: rocket.LLM, tiny_qwen3: rocket.LLM) -> None:
    # tiny-qwen3's generation_config.json: do_sample true, temperature 0.6, top_k 20, top_p 0.95.
    unset = rocket.SamplingParams(max_tokens=16, seed=11, ignore_eos=True)
    assert unset.temperature is None and unset.top_k is None
    explicit = rocket.SamplingParams(max_tokens=16, seed=11, ignore_eos=True, temperature=0.6, top_k=20, top_p=0.95)
    assert tiny_qwen3.generate("the cat", unset)[0].token_ids == tiny_qwen3.generate("the cat", explicit)[0].token_ids
    # The GGUF carries no generation config: as in HF, no do_sample means greedy.
    assert smollm2.generate(PROMPT, rocket.SamplingParams(max_tokens=8))[0].token_ids == (
        smollm2.generate(PROMPT, greedy(max_tokens=8))[0].token_ids
    )
