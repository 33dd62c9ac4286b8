"""The Python API on the tiny random checkpoints and the real SmolLM2 weights."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import rocket
from rocket import _rocket

GREEDY = rocket.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_generate_returns_request_outputs(tiny_llama: rocket.LLM) -> None:
    outs = tiny_llama.generate("hello world", GREEDY)
    assert isinstance(outs, list) and len(outs) == 1
    out = outs[0]
    assert out.prompt == "hello world"
    assert out.prompt_token_ids == tiny_llama.tokenizer.encode("hello world", add_special_tokens=True)
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    assert out.text == tiny_llama.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    m = out.metrics
    assert m["prompt_tokens"] == len(out.prompt_token_ids) and m["output_tokens"] == 8
    assert 0 < m["time_to_first_token"] <= m["total_seconds"]


def test_batch_keeps_order_and_equals_solo_runs(tiny_qwen3: rocket.LLM) -> None:
    prompts = ["the cat", "fn main() {", "zebra crossing", "the cat"]
    batch = tiny_qwen3.generate(prompts, GREEDY)
    assert [o.prompt for o in batch] == prompts
    for p, o in zip(prompts, batch):
        assert tiny_qwen3.generate(p, GREEDY)[0].token_ids == o.token_ids
    assert batch[0].token_ids == batch[3].token_ids


def test_greedy_is_reproducible_and_seeded_sampling_too(tiny_llama: rocket.LLM) -> None:
    runs = [tiny_llama.generate("abc", GREEDY)[0].token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    seeded = rocket.SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    a = tiny_llama.generate("abc", seeded)[0].token_ids
    assert a == tiny_llama.generate("abc", seeded)[0].token_ids
    other = rocket.SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    assert a != tiny_llama.generate("abc", other)[0].token_ids


def test_eos_stops_with_finish_reason_stop(smollm2: rocket.LLM) -> None:
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Say hi."}])
    out = smollm2.generate(prompt, rocket.SamplingParams(max_tokens=200, temperature=0.0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in smollm2.info["eos_token_ids"]
    assert "<|im_end|>" not in out.text
    # As in vLLM: the model's own end of sequence names no stop reason; a stop
    # token the request asked for is named, even when it is the end id.
    assert out.stop_reason is None
    asked = smollm2.generate(prompt, rocket.SamplingParams(max_tokens=200, temperature=0.0, stop_token_ids=[out.token_ids[-1]]))[0]
    assert asked.token_ids == out.token_ids and asked.stop_reason == out.token_ids[-1]


def test_smollm2_continuation_is_sensible(smollm2: rocket.LLM) -> None:
    out = smollm2.generate("The capital of France is", rocket.SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert "Paris" in out.text


def test_module_level_generate_uses_default_model() -> None:
    text = rocket.generate("The capital of France is", max_tokens=6, temperature=0.0)
    assert isinstance(text, str) and "Paris" in text


def test_tokenizer_round_trip(smollm2: rocket.LLM) -> None:
    tok = smollm2.tokenizer
    for text in ["Hello, world!", "naïve café 東京 👩‍👩‍👧", "def f(x):\n\treturn x  ** 2\n"]:
        ids = tok.encode(text)
        assert ids and all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text
    assert tok.vocab_size == 49152


def test_chat_template(tiny_llama: rocket.LLM) -> None:
    text = tiny_llama.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError):
        tiny_llama.apply_chat_template([{"content": "no role"}])
    # Content as the OpenAI API gives it: text parts joined; an assistant turn may have None.
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    assert tiny_llama.apply_chat_template([{"role": "user", "content": parts}]) == text
    with_none = tiny_llama.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
                                               add_generation_prompt=False)
    assert with_none.startswith(text)
    # Anything else is refused, never rendered as its repr.
    for content, why in [(None, "got NoneType"), (5, "got int"), ([{"type": "image_url", "image_url": {}}], "not type 'image_url'"),
                         ([{"type": "text", "text": 3}], "part"), (["hi"], "part")]:
        with pytest.raises(rocket.InvalidArgumentError, match=why) as info:
            tiny_llama.apply_chat_template([{"role": "user", "content": content}])
        assert info.value.parameter == "messages"
    with pytest.raises(rocket.InvalidArgumentError, match="must be a str"):
        tiny_llama.chat([{"role": 1, "content": "hi"}])
    # Nothing to answer: refused before any work.
    with pytest.raises(rocket.InvalidArgumentError, match="at least one message"):
        tiny_llama.chat([])


def test_teacher_forced_logits_match_incremental_decode(tiny_qwen3: rocket.LLM) -> None:
    ids = tiny_qwen3.tokenizer.encode("the quick brown fox jumps")
    logits = tiny_qwen3.teacher_forced_logits(ids)
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32
    assert logits.shape == (len(ids), tiny_qwen3.info["vocab_size"])
    assert np.isfinite(logits).all()
    # Greedy generation from a prefix picks the argmax of the last teacher-forced row.
    out = tiny_qwen3.generate_from_ids(ids, rocket.SamplingParams(max_tokens=1, temperature=0.0))
    assert out.token_ids[0] == int(np.argmax(logits[-1]))


def test_gil_is_released_during_generation(smollm2: rocket.LLM) -> None:
    ticks = 0
    done = threading.Event()

    def work() -> None:
        smollm2.generate("Once upon a time", rocket.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        done.set()

    t = threading.Thread(target=work)
    t.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    t.join()
    assert ticks > 50, f"main thread ran only {ticks} times while generating"


def test_info_and_version(tiny_llama: rocket.LLM) -> None:
    info = tiny_llama.info
    assert info["family"] == "llama" and info["backend"] == "cpu" and info["max_seq_len"] == 256
    assert isinstance(rocket.__version__, str)


@pytest.mark.cuda
def test_gpu_keywords_reach_the_cuda_backend() -> None:
    from conftest import FIXTURES

    # tiny-qwen3's shapes have no megakernel: asking for one fails the load.
    with pytest.raises(rocket.DeviceError, match="megakernel"):
        rocket.LLM(FIXTURES / "tiny-qwen3", device="cuda", decode="megakernel", progress="off")
    llm = rocket.LLM(FIXTURES / "tiny-qwen3", device="cuda", decode="graph", matmul="gemv", sampler="host", progress="off")
    assert llm.info["backend"] == "cuda"
    # The graph path with one matmul kernel: batched greedy equals solo.
    batch = llm.generate(["hello", "hello there"], GREEDY)
    assert [o.token_ids for o in batch] == [llm.generate(p, GREEDY)[0].token_ids for p in ["hello", "hello there"]]


def test_sampling_params_repr_is_python() -> None:
    p = rocket.SamplingParams(max_tokens=16, temperature=0.7, stop="x", stop_token_ids=[3], ignore_eos=True)
    assert repr(p) == (
        "SamplingParams(max_tokens=16, min_tokens=None, temperature=0.7, top_k=None, top_p=None, min_p=None, "
        "repetition_penalty=None, presence_penalty=None, frequency_penalty=None, seed=None, stop=['x'], "
        "stop_token_ids=[3], ignore_eos=True, logprobs=None, skip_special_tokens=None)"
    )
    assert eval(repr(p), {"SamplingParams": rocket.SamplingParams}) == p
    q = rocket.SamplingParams(top_p=1, seed=5, skip_special_tokens=False)
    assert eval(repr(q), {"SamplingParams": rocket.SamplingParams}) == q
    assert "top_p=1.0" in repr(q) and "skip_special_tokens=False" in repr(q)
    assert rocket.SamplingParams().max_tokens is None and rocket.SamplingParams().temperature is None
    # vLLM's top_k=-1 means off, as 0 does.
    assert rocket.SamplingParams(top_k=-1) == rocket.SamplingParams(top_k=0) and rocket.SamplingParams(top_k=-1).top_k == 0


def test_outputs_repr_is_python(tiny_llama: rocket.LLM) -> None:
    p = rocket.SamplingParams(max_tokens=2, temperature=0, logprobs=1)
    out = tiny_llama.generate("hi", p)[0]
    assert repr(out) == f"RequestOutput(text={out.text!r}, token_ids=<2 ids>, finish_reason={out.finish_reason!r})"
    deltas = list(tiny_llama.stream("hi", p))
    assert deltas and all(repr(d) == f"StreamDelta(text={d.text!r}, token_id={d.token_id}, logprob={d.logprob!r})" for d in deltas)
    assert all(isinstance(d.logprob, float) for d in deltas)


def test_sampling_params_pickle_and_copy_keep_every_field() -> None:
    import copy
    import pickle
    import random

    rng = random.Random()
    # Every field set away from its default, floats that f32 cannot hold exactly.
    p = rocket.SamplingParams(
        max_tokens=rng.randint(1, 500), min_tokens=rng.randint(0, 5), temperature=rng.uniform(0.1, 2.0),
        top_k=rng.randint(1, 100), top_p=rng.uniform(0.1, 1.0), min_p=rng.uniform(0.0, 0.5),
        repetition_penalty=rng.uniform(1.0, 1.5), presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1),
        seed=rng.randrange(2**64), stop=["a", "\n\n"], stop_token_ids=[rng.randrange(1000)], ignore_eos=True,
        logprobs=rng.randint(0, 20), skip_special_tokens=False,
    )
    for q in (pickle.loads(pickle.dumps(p)), copy.copy(p), copy.deepcopy(p)):
        assert type(q) is rocket.SamplingParams and q == p and repr(q) == repr(p)
    assert pickle.loads(pickle.dumps(rocket.SamplingParams())) == rocket.SamplingParams()
    assert pickle.loads(pickle.dumps(p)) != rocket.SamplingParams(**{**_fields(p), "ignore_eos": False})


def _fields(p: "rocket.SamplingParams") -> dict:
    names = ("max_tokens min_tokens temperature top_k top_p min_p repetition_penalty presence_penalty "
             "frequency_penalty seed stop stop_token_ids ignore_eos logprobs skip_special_tokens").split()
    return {n: getattr(p, n) for n in names}


def test_max_tokens_default_depends_on_the_request(smollm2_path: str) -> None:
    llm = rocket.LLM(smollm2_path, device="cpu", max_seq_len=64)
    params = rocket.SamplingParams(ignore_eos=True)
    # A completion: 16 tokens (OpenAI's and vLLM's default).
    assert len(llm.generate("The capital of France is", params)[0].token_ids) == 16
    # A chat turn: until the context is full.
    out = llm.chat([{"role": "user", "content": "Hi"}], params)
    assert len(out.prompt_token_ids) + len(out.token_ids) == 64 and out.finish_reason == "length"


def test_numpy_integers_are_token_ids_and_counts(tiny_qwen3: rocket.LLM) -> None:
    ids = tiny_qwen3.tokenizer.encode("the quick brown fox")
    as_array = np.array(ids, dtype=np.int64)
    assert np.array_equal(tiny_qwen3.teacher_forced_logits(as_array), tiny_qwen3.teacher_forced_logits(ids))
    params = rocket.SamplingParams(max_tokens=np.int64(3), temperature=0.0)
    assert tiny_qwen3.generate_from_ids(as_array, params).token_ids == tiny_qwen3.generate_from_ids(ids, params).token_ids
    assert tiny_qwen3.tokenizer.decode(as_array) == tiny_qwen3.tokenizer.decode(ids)
    # Real numbers of any kind are real numbers (numpy's floats, Fraction); bools and strings are not.
    from fractions import Fraction
    for t in (np.float32(0.5), np.float64(0.5), Fraction(1, 2), np.int64(0)):
        assert rocket.SamplingParams(temperature=t).temperature == float(t)
    for bad_t in (True, "0.5", np.bool_(True), 1j):
        with pytest.raises(rocket.InvalidArgumentError):
            rocket.SamplingParams(temperature=bad_t)
    # Floats and bools stay refused as token ids.
    for bad in ([1.0, 2.0], [True, 2], np.array([1.5])):
        with pytest.raises(rocket.InvalidArgumentError):
            tiny_qwen3.teacher_forced_logits(bad)
    # Engine keywords that count take numpy's integers too, never bools or floats.
    options = _rocket.EngineOptions(max_seq_len=np.int64(8), watchdog_ms=np.int32(500), prefix_cache_bytes=np.uint64(1 << 20))
    assert options is not None
    for keyword, bad in (("max_seq_len", True), ("max_seq_len", np.float64(8.0)), ("watchdog_ms", np.bool_(True)), ("prefix_block", 2.0)):
        with pytest.raises(rocket.InvalidArgumentError) as e:
            _rocket.EngineOptions(**{keyword: bad})
        assert e.value.parameter == keyword
    # Switches take numpy's bool (what comparisons of arrays give), never its integers.
    assert rocket.SamplingParams(ignore_eos=np.bool_(True)).ignore_eos is True
    assert rocket.SamplingParams(skip_special_tokens=np.float64(1.0) > 2).skip_special_tokens is False
    assert "pdl: false" in repr(_rocket.EngineOptions(pdl=np.False_))
    for make in (lambda: rocket.SamplingParams(ignore_eos=np.int64(1)), lambda: _rocket.EngineOptions(pdl=np.int8(0))):
        with pytest.raises(rocket.InvalidArgumentError):
            make()


def test_bad_arguments_name_their_parameter(tiny_llama: rocket.LLM) -> None:
    sp = rocket.SamplingParams(max_tokens=2)
    cases = [
        (lambda: tiny_llama.generate(None), "prompts"),  # type: ignore[arg-type]
        (lambda: tiny_llama.generate(5), "prompts"),  # type: ignore[arg-type]
        (lambda: tiny_llama.generate(["a", "b"], [sp]), "params"),
        (lambda: tiny_llama.generate("a", "not params"), "params"),  # type: ignore[arg-type]
        (lambda: tiny_llama.stream(5), "prompt"),  # type: ignore[arg-type]
        (lambda: tiny_llama.chat([]), "messages"),
        (lambda: tiny_llama.chat([{"role": "user"}]), "messages"),
        # A str or one message where the list goes (a str was read character by character).
        (lambda: tiny_llama.chat("hi"), "messages"),  # type: ignore[arg-type]
        (lambda: tiny_llama.chat({"role": "user", "content": "hi"}), "messages"),  # type: ignore[arg-type]
        (lambda: tiny_llama.apply_chat_template("hi"), "messages"),  # type: ignore[arg-type]
        # None or a generator where the list goes (they have no length).
        (lambda: tiny_llama.chat(None), "messages"),  # type: ignore[arg-type]
        (lambda: tiny_llama.chat(m for m in [{"role": "user", "content": "hi"}]), "messages"),  # type: ignore[arg-type]
        # The one-shot function takes one prompt (a list would lose all but the first).
        (lambda: rocket.generate(["a", "b"], max_tokens=2), "prompt"),  # type: ignore[arg-type]
        (lambda: tiny_llama.generate_from_ids([]), "prompt_token_ids"),
        (lambda: tiny_llama.teacher_forced_logits([]), "token_ids"),
    ]
    for call, parameter in cases:
        with pytest.raises(rocket.InvalidArgumentError) as e:
            call()
        assert e.value.parameter == parameter, (parameter, str(e.value))
