"""`rocket serve`: the OpenAI-compatible server, driven by the official openai
client against a server started here on loopback (SmolLM2, CPU backend).

Every loop is bounded in count and in time; all traffic goes to 127.0.0.1."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

import rocket

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
START_TIMEOUT = 120.0
# Direct, proxy-free HTTP to loopback for what the openai client hides (status, raw body).
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Server:
    """`python -m rocket serve` on a free loopback port, stderr collected."""

    def __init__(self, model: str, *extra: str, env: dict[str, str | None] | None = None) -> None:
        cmd = [sys.executable, "-m", "rocket", "serve", "--model", model, "--device", "cpu",
               "--host", "127.0.0.1", "--port", "0", *extra]
        # `env` adds to (a None value removes from) this process's environment; a
        # ROCKET_API_KEY of the caller's does not apply unless `env` sets it.
        changes = {"ROCKET_API_KEY": None, **(env or {})}
        full_env = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=full_env)
        self.log: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        try:
            self.base = self._wait_for_address()
            # The port answers before the model is loaded: /health says so.
            self.first_health = self.get("/health")
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def _wait_for_address(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m:
                return m.group(1)
        raise AssertionError(f"server did not start listening:\n{''.join(self.log)}")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{''.join(self.log)}"
            status, _ = self.get("/health")
            if status == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"server not ready after {START_TIMEOUT} s:\n{''.join(self.log)}")

    def request(self, method: str, path: str, body: bytes | dict[str, Any] | None = None,
                timeout: float = 60.0) -> tuple[int, Any]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with _HTTP.open(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path)

    def post(self, path: str, body: bytes | dict[str, Any]) -> tuple[int, Any]:
        return self.request("POST", path, body)

    def client(self, timeout: float = 120.0, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=timeout,
                             http_client=openai.DefaultHttpx2Client(trust_env=False))

    def in_flight(self) -> int:
        status, body = self.get("/health")
        assert status == 200, body
        return int(body["requests_in_flight"])

    def wait_idle(self, timeout: float = 10.0) -> float:
        """Seconds until no request is in flight (fails after `timeout`)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.in_flight() == 0:
                return time.monotonic() - start
            time.sleep(0.02)
        raise AssertionError(f"requests still in flight after {timeout} s")

    def wait(self, timeout: float = 60.0) -> int:
        """The exit code, once the process has exited and its stderr is read."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(smollm2_path: str) -> Iterator[Server]:
    s = Server(smollm2_path, "--max-batch", "32", "--max-queue", "64")
    yield s
    code = s.stop()
    assert code == 0, "".join(s.log)


@pytest.fixture(scope="module")
def model_name(server: Server) -> str:
    return server.client().models.list().data[0].id


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def greedy(**kw: Any) -> rocket.SamplingParams:
    return rocket.SamplingParams(temperature=0.0, **kw)


# --- basics -------------------------------------------------------------------------------


def test_health_and_models(server: Server, model_name: str) -> None:
    status, body = server.first_health
    assert status == 503 and body["status"] == "loading", "the port must answer 503 while the model loads"
    status, body = server.get("/health")
    assert status == 200 and body["status"] == "ok" and body["requests_in_flight"] == 0
    assert model_name == MODEL
    assert server.client().models.retrieve(model_name).id == model_name
    status, body = server.get("/v1/models/no-such-model")
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_completion_matches_the_engine(client: openai.OpenAI, model_name: str, smollm2: rocket.LLM) -> None:
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    ref = smollm2.generate(PROMPT, greedy(max_tokens=8))[0]
    choice = r.choices[0]
    assert choice.text == ref.text and "Paris" in choice.text
    assert choice.finish_reason == ref.finish_reason
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == model_name
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Token ids as the prompt give the same answer.
    r2 = client.completions.create(model=model_name, prompt=ref.prompt_token_ids, max_tokens=8, temperature=0)
    assert r2.choices[0].text == ref.text
    r3 = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert r3.choices[0].text == PROMPT + ref.text


def test_chat_matches_the_engine(server: Server, client: openai.OpenAI, model_name: str, smollm2: rocket.LLM) -> None:
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_completion_tokens=12, temperature=0)
    ref = smollm2.chat(CHAT, greedy(max_tokens=12))
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text and "Paris" in ref.text
    assert r.object == "chat.completion" and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage is not None and r.usage.completion_tokens == len(ref.token_ids)
    # The model name may be left out (curl users); a system message is honoured.
    messages = [{"role": "system", "content": "Answer in French."}, *CHAT]
    status, body = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == smollm2.chat(messages, greedy(max_tokens=6)).text


def test_streaming_completion_and_usage(client: openai.OpenAI, model_name: str) -> None:
    full = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 3 and "".join(texts) == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert len({c.id for c in chunks}) == 1


def test_streaming_chat(client: openai.OpenAI, model_name: str) -> None:
    full = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_raw_sse_ends_with_done(server: Server, model_name: str) -> None:
    req = urllib.request.Request(server.base + "/v1/completions", method="POST", data=json.dumps(
        {"model": model_name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}).encode())
    with _HTTP.open(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


# --- sampling fields ---------------------------------------------------------------------


def test_completion_logprobs(client: openai.OpenAI, model_name: str, smollm2: rocket.LLM) -> None:
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    ref = smollm2.generate(PROMPT, greedy(max_tokens=6, logprobs=3))[0]
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(ref.token_ids) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for got, want, top in zip(lp.token_logprobs, ref.logprobs, lp.top_logprobs):
        assert got == pytest.approx(want["logprob"], abs=1e-5) and got <= 0
        assert len(top) == 3
        assert max(top.values()) == pytest.approx(got, abs=1e-6), "greedy picks the most likely token"
    # Streamed, each chunk carries the chosen tokens' logprobs.
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                                            logprobs=0, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in (c.choices[0].logprobs.token_logprobs or [])]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert bytes(t.bytes or []).decode("utf-8", "replace") == t.token
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)
    plain = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_stop_seed_and_extra_fields(client: openai.OpenAI, model_name: str, smollm2: rocket.LLM) -> None:
    ref = smollm2.generate(PROMPT, greedy(max_tokens=16, ignore_eos=True))[0]
    assert "." in ref.text
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0, stop=[".", "zzz"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ref.text[: ref.text.index(".")]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0, stop=".")
    assert r.choices[0].text == ref.text[: ref.text.index(".")]
    # Same seed, same sample; and the engine agrees.
    kw: dict[str, Any] = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0,
                          "top_p": 0.95, "seed": 1234}
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    want = smollm2.generate("Once upon a time", rocket.SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95,
                                                                      seed=1234))[0].text
    assert a == b == want
    # rocket's extra fields through extra_body: top_k=1 is greedy whatever the temperature;
    # ignore_eos + min_tokens give exactly max_tokens tokens; penalties are accepted.
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=1.5, seed=3,
                                  extra_body={"top_k": 1, "ignore_eos": True, "min_tokens": 16,
                                              "repetition_penalty": 1.0, "min_p": 0.0})
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == 16  # type: ignore[union-attr]
    target = ref.token_ids[3]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"stop_token_ids": [target], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == ref.token_ids.index(target) + 1  # type: ignore[union-attr]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                  presence_penalty=1.5, frequency_penalty=1.0)
    penalised = smollm2.generate(PROMPT, greedy(max_tokens=12, presence_penalty=1.5, frequency_penalty=1.0))[0]
    assert r.choices[0].text == penalised.text


# --- bad input -------------------------------------------------------------------------------

BAD_COMPLETIONS: list[tuple[Any, int, str | None, str]] = [
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    (b"", 400, None, "invalid_json"),
    ({"prompt": PROMPT, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({"prompt": PROMPT, "max_tokens": "8"}, 400, "max_tokens", "invalid_type"),
    ({"prompt": PROMPT, "stream": "yes"}, 400, "stream", "invalid_type"),
    ({"prompt": PROMPT, "stop": [1]}, 400, "stop", "invalid_type"),
    ({"prompt": PROMPT, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ({"prompt": PROMPT, "temperature": -1}, 400, "temperature", "invalid_value"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"prompt": PROMPT, "presence_penalty": 9}, 400, "presence_penalty", "invalid_value"),
    ({"prompt": PROMPT, "logprobs": 50}, 400, "logprobs", "invalid_value"),
    ({"prompt": PROMPT, "stop_token_ids": [10**8]}, 400, "stop_token_ids", "invalid_value"),
    ({"prompt": [10**8]}, 400, "prompt", "invalid_value"),
    ({"prompt": ""}, 400, "prompt", "invalid_value"),
    ({"max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": PROMPT, "n": 2}, 400, "n", "unsupported_value"),
    ({"prompt": PROMPT, "max_tokens": 100000}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": PROMPT, "model": "gpt-4o"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("body", "status", "param", "code"), BAD_COMPLETIONS)
def test_bad_completion_requests(server: Server, body: Any, status: int, param: str | None, code: str) -> None:
    got, err = server.post("/v1/completions", body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert (err["error"]["param"], err["error"]["code"]) == (param, code)


BAD_CHATS: list[tuple[dict[str, Any], int, str, str]] = [
    ({}, 400, "messages", "missing_required_parameter"),
    ({"messages": []}, 400, "messages", "invalid_value"),
    ({"messages": "hi"}, 400, "messages", "invalid_type"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages", "invalid_type"),
    ({"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    ({"messages": CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens", "invalid_value"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages", "context_length_exceeded"),
    ({"messages": CHAT, "n": 3}, 400, "n", "unsupported_value"),
    ({"messages": CHAT, "model": "nope"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("body", "status", "param", "code"), BAD_CHATS)
def test_bad_chat_requests(server: Server, body: dict[str, Any], status: int, param: str, code: str) -> None:
    got, err = server.post("/v1/chat/completions", body)
    assert got == status, err
    assert (err["error"]["param"], err["error"]["code"]) == (param, code), err


def test_client_sees_typed_errors(client: openai.OpenAI, model_name: str, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=PROMPT, top_p=2.0)
    assert e.value.param == "top_p" and e.value.code == "invalid_value"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="not-" + model_name, messages=CHAT)
    assert server.post("/v1/nowhere", {})[0] == 404
    assert server.get("/v1/completions")[0] == 405
    assert server.in_flight() == 0, "refused requests take no slot"


# --- concurrency -----------------------------------------------------------------------------

LOAD_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "My favourite book is",
    "The quick brown fox",
    "In 1969, humans first",
]
LOAD_LENGTHS = [8, 14, 20, 24]


def test_concurrent_streams_match_solo_runs(server: Server, model_name: str, smollm2: rocket.LLM) -> None:
    jobs = [(p, LOAD_LENGTHS[(i + j) % len(LOAD_LENGTHS)]) for i, p in enumerate(LOAD_PROMPTS) for j in range(4)]
    assert len(jobs) >= 32
    solo = {job: smollm2.generate(job[0], greedy(max_tokens=job[1]))[0].text for job in set(jobs)}
    client = server.client(timeout=300)

    def run(job: tuple[str, int]) -> dict[str, Any]:
        prompt, max_tokens = job
        start = time.monotonic()
        first = None
        parts, tokens, finish = [], 0, None
        stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.text and first is None:
                    first = time.monotonic()
                parts.append(c.text)
                finish = c.finish_reason or finish
        end = time.monotonic()
        return {"job": job, "text": "".join(parts), "tokens": tokens, "finish": finish,
                "start": start, "first": first or end, "end": end}

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(run, jobs, timeout=600))
    wall = time.monotonic() - t0

    mismatched = [(r["job"], r["text"], solo[r["job"]]) for r in results if r["text"] != solo[r["job"]]]
    assert not mismatched, f"{len(mismatched)} streams differ from their solo run, e.g. {mismatched[0]}"
    assert all(r["finish"] in ("stop", "length") and r["tokens"] > 0 for r in results)
    # Continuous batching: many requests were being decoded before the first one finished.
    first_end = min(r["end"] for r in results)
    overlapping = sum(r["first"] < first_end for r in results)
    assert overlapping >= 2, "requests were served one at a time"
    latencies = sorted(r["end"] - r["start"] for r in results)
    ttfts = sorted(r["first"] - r["start"] for r in results)
    total = sum(r["tokens"] for r in results)

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    print(f"\nrocket serve load: {len(jobs)} concurrent streams, {total} tokens in {wall:.2f} s = "
          f"{total / wall:.1f} tok/s; latency p50 {pct(latencies, 0.5):.2f} s p99 {pct(latencies, 0.99):.2f} s; "
          f"ttft p50 {statistics.median(ttfts):.2f} s p99 {pct(ttfts, 0.99):.2f} s; "
          f"{overlapping} streams active before the first finished")
    server.wait_idle()


# --- cancellation, overload, shutdown --------------------------------------------------------


@pytest.fixture(scope="module")
def small(smollm2_path: str) -> Iterator[Server]:
    """A server with one decode slot and room for two requests."""
    s = Server(smollm2_path, "--max-batch", "1", "--max-queue", "2")
    yield s
    assert s.stop() == 0, "".join(s.log)


LONG = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_closed_stream_cancels_and_frees_its_slot(small: Server) -> None:
    client = small.client()
    stream = client.completions.create(model=MODEL, stream=True, **LONG)
    got = [c.choices[0].text for c, _ in zip(stream, range(3))]
    assert len(got) == 3 and small.in_flight() == 1
    stream.close()
    # 4000 tokens would take minutes; the slot is back at once.
    freed = small.wait_idle(timeout=10)
    print(f"\nslot freed {freed * 1e3:.0f} ms after the client closed its stream")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text


def test_disconnect_of_a_plain_request_cancels_it(small: Server) -> None:
    def closed() -> float:
        with _HTTP.open(small.base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        line = 'rocket_requests_total{endpoint="/v1/completions",status="499"} '
        return sum(float(m[len(line):]) for m in metrics.splitlines() if m.startswith(line))

    before = closed()
    impatient = small.client(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, **LONG)
    small.wait_idle(timeout=10)
    # Counted (and logged) as the client closing it, not left out.
    assert closed() == before + 1


def test_over_the_queue_limit_is_429(small: Server) -> None:
    client = small.client()
    # Headers arrive once a request is queued: two streams fill both places (one runs, one waits).
    running = client.completions.create(model=MODEL, stream=True, **LONG)
    waiting = client.completions.create(model=MODEL, stream=True, **LONG)
    try:
        assert small.in_flight() == 2
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 429 and e.value.code == "queue_full"
        status, body = small.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        # A waiting request whose client leaves is dropped from the queue.
        waiting.close()
        deadline = time.monotonic() + 10
        while small.in_flight() != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert small.in_flight() == 1
        assert next(iter(running)).choices[0].text is not None
    finally:
        running.close()
        waiting.close()
    small.wait_idle(timeout=10)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_in_flight_requests_then_exits(smollm2_path: str, sig: int) -> None:
    s = Server(smollm2_path)
    try:
        client = s.client()
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)
        s.proc.send_signal(sig)
        rest = list(chunks)
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        assert rest[-1].choices[0].finish_reason == "length" and len(text) > 10
        assert s.wait(timeout=30) == 0, "".join(s.log)
        assert any("shutting down" in line for line in s.log) and "stopped" in s.log[-1]
    finally:
        s.kill()


def test_a_closed_log_pipe_stops_neither_readiness_nor_shutdown(smollm2_path: str) -> None:
    # `rocket serve ... 2>&1 | head -1`: the reader of stderr goes away after the first
    # line; the server must still become ready, serve, and stop on SIGTERM.
    cmd = [sys.executable, "-m", "rocket", "serve", "--model", smollm2_path, "--device", "cpu",
           "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", proc.stderr.readline())
        assert m, "no address line"
        proc.stderr.close()
        deadline = time.monotonic() + START_TIMEOUT
        status = None
        while time.monotonic() < deadline and status != "ok":
            try:
                with _HTTP.open(m.group(1) + "/health", timeout=5) as r:
                    status = json.loads(r.read())["status"]
            except urllib.error.HTTPError:
                time.sleep(0.2)
        assert status == "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_timeout_cancels_what_is_left(smollm2_path: str) -> None:
    s = Server(smollm2_path, "--shutdown-timeout", "0.5")
    try:
        stream = s.client().completions.create(model=MODEL, stream=True, **LONG)
        chunks = iter(stream)
        next(chunks)
        started = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
        assert s.wait(timeout=30) == 0, "".join(s.log)
        assert time.monotonic() - started < 15
    finally:
        s.kill()
