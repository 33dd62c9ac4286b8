"""`rocket serve` on a network: API keys, `/metrics` (read with Prometheus' own
text-format parser), `x-request-id`, and the one log line per request.

Servers run here on loopback (SmolLM2, CPU backend), started by test_serve's
`Server`; every loop is bounded in count and time."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_serve import CHAT, MODEL, PROMPT, Server

KEYS = ("sk-rocket-test-one", "sk-rocket-test-two")
IGNORE_EOS = {"ignore_eos": True}
SECRET = "zebra-7731-marker"
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def call(server: Server, method: str, path: str, body: bytes | dict[str, Any] | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One raw request: status, lower-cased headers, body bytes."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(server.base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with _HTTP.open(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def scrape(server: Server) -> Samples:
    """Every sample of /metrics (fetched without a key), parsed by prometheus_client."""
    status, headers, body = call(server, "GET", "/metrics")
    assert status == 200, body
    assert headers["content-type"].startswith("text/plain; version=0.0.4"), headers
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def request_deltas(before: Samples, after: Samples) -> dict[tuple[str, str], float]:
    """rocket_requests_total changes by (endpoint, status)."""
    out = {}
    for key in set(before) | set(after):
        name, labels = key
        if name == "rocket_requests_total":
            d = after.get(key, 0.0) - before.get(key, 0.0)
            if d:
                lab = dict(labels)
                out[(lab["endpoint"], lab["status"])] = d
    return out


@pytest.fixture(scope="module")
def keyed(smollm2_path: str) -> Iterator[Server]:
    s = Server(smollm2_path, "--api-key", KEYS[0], "--api-key", KEYS[1], env={"ROCKET_LOG": "info"})
    yield s
    assert s.stop() == 0, "".join(s.log)


# --- authentication ---------------------------------------------------------------------


def test_requests_without_a_valid_key_get_401_and_no_work_is_done(keyed: Server) -> None:
    assert any("2 API key(s) required" in line for line in keyed.log), "".join(keyed.log)
    before = scrape(keyed)
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    refused = [
        ("POST", "/v1/completions", completion, {}, "no API key given"),
        ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}, bearer(KEYS[0][:-1]), "incorrect"),
        ("POST", "/v1/completions", completion, bearer(KEYS[0] + "x"), "incorrect"),
        ("POST", "/v1/completions", completion, bearer(KEYS[1].upper()), "incorrect"),
        # A malformed body is refused for its key, not parsed: the check comes first.
        ("POST", "/v1/completions", b"{not json", {}, "no API key given"),
        ("GET", "/v1/models", None, {"Authorization": f"Basic {KEYS[0]}"}, "must be 'Bearer"),
        ("GET", "/v1/no-such-route", None, {}, "no API key given"),
    ]
    for method, path, body, headers, message in refused:
        status, h, raw = call(keyed, method, path, body, headers)
        err = json.loads(raw)["error"]
        assert status == 401, (path, headers, raw)
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_api_key", None), err
        assert message in err["message"], err
        assert h["www-authenticate"] == "Bearer" and h["x-request-id"], h
    after = scrape(keyed)
    # Nothing reached the engine: no tokens, no first token, no request in any other state.
    for name in ("rocket_prompt_tokens_total", "rocket_generation_tokens_total", "rocket_time_to_first_token_seconds_count"):
        assert value(after, name) == value(before, name), name
    assert request_deltas(before, after) == {
        ("/v1/completions", "401"): 4, ("/v1/chat/completions", "401"): 1, ("/v1/models", "401"): 1,
        ("unmatched", "401"): 1, ("/metrics", "200"): 1,
    }
    # /health stays open.
    status, _, raw = call(keyed, "GET", "/health")
    assert status == 200 and json.loads(raw)["requests_in_flight"] == 0


def test_the_openai_client_with_api_key(keyed: Server) -> None:
    for key in KEYS:
        r = keyed.client(api_key=key).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        assert r.usage is not None and r.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError) as e:
        keyed.client(api_key="sk-wrong").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


def test_keys_from_a_file_win_over_the_variable(smollm2_path: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\n\nsk-file-one\n   sk-file-two   \n")
    s = Server(smollm2_path, "--api-key-file", str(keys), "--log-prompts",
               env={"ROCKET_API_KEY": "sk-env", "ROCKET_LOG": "info"})
    try:
        for key in ("sk-file-one", "sk-file-two"):
            status, _, raw = call(s, "GET", "/v1/models", headers=bearer(key))
            assert status == 200, raw
        for key in ("sk-env", "# team keys", "sk-file-one sk-file-two"):
            assert call(s, "GET", "/v1/models", headers=bearer(key))[0] == 401, key
        # --log-prompts: this time the prompt is in the request's log line.
        r = s.client(api_key="sk-file-two").completions.with_raw_response.create(
            model=MODEL, prompt=f"Remember {SECRET}.", max_tokens=2, temperature=0)
        rid = r.headers["x-request-id"]
        line = wait_for_log_line(s, rid)
        assert f'prompt="Remember {SECRET}."' in line, line
    finally:
        assert s.stop() == 0, "".join(s.log)


def test_key_from_the_environment(smollm2_path: str) -> None:
    s = Server(smollm2_path, env={"ROCKET_API_KEY": "sk-from-env"})
    try:
        r = s.client(api_key="sk-from-env").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert r.choices[0].message.content is not None
        assert call(s, "GET", "/v1/models")[0] == 401
        assert call(s, "GET", "/v1/models", headers=bearer("sk-from-envx"))[0] == 401
        assert call(s, "GET", "/health")[0] == 200
    finally:
        assert s.stop() == 0, "".join(s.log)


@pytest.mark.parametrize(("args", "message"), [
    (["--api-key", ""], "--api-key: an API key must not be empty"),
    (["--api-key", "two words"], "--api-key: an API key may hold only visible ASCII"),
    (["--api-key-file", "EMPTY"], "the file holds no key"),
    (["--api-key-file", "MISSING"], "cannot read it"),
])
def test_bad_keys_are_refused_at_start(tmp_path: Path, args: list[str], message: str) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n")
    args = [str(empty) if a == "EMPTY" else str(tmp_path / "missing.txt") if a == "MISSING" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "rocket", "serve", "--device", "cpu", "--port", "0", *args],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and message in r.stderr, r.stderr


# --- /metrics ---------------------------------------------------------------------------


def test_metrics_count_the_requests_and_tokens_sent(keyed: Server) -> None:
    client = keyed.client(api_key=KEYS[1])
    before = scrape(keyed)
    usages = []
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    usages.append(r.usage)
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                       extra_body=IGNORE_EOS)
    usages.append(c.usage)
    for stream in (
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0.7, seed=3,
                                  stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS),
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True,  # type: ignore[arg-type]
                                       stream_options={"include_usage": True}, extra_body=IGNORE_EOS),
    ):
        chunks = list(stream)
        usages.append(chunks[-1].usage)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key=KEYS[0] + KEYS[1]).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert client.models.list().data
    assert call(keyed, "GET", "/health")[0] == 200
    after = scrape(keyed)

    assert all(u is not None for u in usages)
    prompt_tokens = sum(u.prompt_tokens for u in usages if u)
    completion_tokens = [u.completion_tokens for u in usages if u]
    assert request_deltas(before, after) == {
        ("/v1/completions", "200"): 2, ("/v1/chat/completions", "200"): 2, ("/v1/completions", "400"): 1,
        ("/v1/completions", "401"): 1, ("/v1/models/{*id}", "404"): 1, ("/v1/models", "200"): 1,
        ("/health", "200"): 1, ("/metrics", "200"): 1,
    }

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("rocket_prompt_tokens_total") == prompt_tokens > 0
    assert delta("rocket_generation_tokens_total") == sum(completion_tokens) == 5 + 4 + 6 + 3
    # One first token per generating request; an inter-token gap for every later token.
    assert delta("rocket_time_to_first_token_seconds_count") == 4
    assert delta("rocket_inter_token_latency_seconds_count") == sum(n - 1 for n in completion_tokens)
    assert delta("rocket_time_to_first_token_seconds_sum") > 0
    for h in ("rocket_time_to_first_token_seconds", "rocket_inter_token_latency_seconds"):
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in after.items() if k[0] == h + "_bucket")
        counts = [v for _, v in buckets]
        assert len(buckets) > 10 and counts == sorted(counts), h
        assert buckets[-1] == (float("inf"), value(after, h + "_count")), h
    # Idle again; the CPU backend decodes with forward passes and never launches a megakernel.
    assert (value(after, "rocket_queue_depth"), value(after, "rocket_running_requests")) == (0, 0)
    assert value(after, "rocket_kv_cache_usage_bytes") == 0
    assert value(after, "rocket_megakernel_launches_total") == value(after, "rocket_megakernel_watchdog_events_total") == 0
    paths = {(dict(k[1])["batch"], dict(k[1])["sampling"]): (dict(k[1])["path"], v)
             for k, v in after.items() if k[0] == "rocket_decode_path_info"}
    assert paths == {(b, s): ("forward passes", 1.0) for b in ("1", ">1") for s in ("greedy", "sampled")}


def test_metrics_gauges_see_a_running_request(keyed: Server) -> None:
    client = keyed.client(api_key=KEYS[0])
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4000, temperature=0,
                                       stream=True, extra_body=IGNORE_EOS)
    try:
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        during = scrape(keyed)
    finally:
        stream.close()
    assert value(during, "rocket_running_requests") == 1 and value(during, "rocket_queue_depth") == 0
    # SmolLM2's f32 KV cache for the whole context it asked for: prompt + 4000 tokens.
    assert value(during, "rocket_kv_cache_usage_bytes") >= 4000 * 30 * 2 * 3 * 64 * 4
    keyed.wait_idle(timeout=10)
    deadline = time.monotonic() + 10
    while value(scrape(keyed), "rocket_running_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    idle = scrape(keyed)
    assert (value(idle, "rocket_running_requests"), value(idle, "rocket_kv_cache_usage_bytes")) == (0, 0)


# --- request ids and logs ---------------------------------------------------------------


def test_every_response_carries_a_request_id(keyed: Server) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    status, h, raw = call(keyed, "POST", "/v1/completions", body, {**bearer(KEYS[0]), "x-request-id": "client id-42"})
    assert status == 200 and h["x-request-id"] == "client id-42"
    assert json.loads(raw)["id"] == "cmpl-client id-42"
    ids = set()
    for _ in range(2):
        status, h, raw = call(keyed, "POST", "/v1/completions", body, bearer(KEYS[0]))
        assert status == 200 and re.fullmatch(r"[0-9a-f]{24}", h["x-request-id"]), h
        assert json.loads(raw)["id"] == "cmpl-" + h["x-request-id"]
        ids.add(h["x-request-id"])
    assert len(ids) == 2
    # Too long, or not printable ASCII: a fresh id instead.
    for bad in ("x" * 129, "tab\there"):
        status, h, _ = call(keyed, "POST", "/v1/completions", body, {**bearer(KEYS[0]), "x-request-id": bad})
        assert status == 200 and re.fullmatch(r"[0-9a-f]{24}", h["x-request-id"]), (bad, h)
    assert call(keyed, "GET", "/v1/models", None, {**bearer(KEYS[0]), "x-request-id": "x" * 128})[1]["x-request-id"] == "x" * 128
    # Errors, open routes and streams too.
    for method, path, b, headers in [
        ("POST", "/v1/completions", body, {}),
        ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, bearer(KEYS[0])),
        ("GET", "/nowhere", None, {}),
        ("GET", "/health", None, {}),
        ("GET", "/metrics", None, {}),
    ]:
        status, h, _ = call(keyed, method, path, b, {**headers, "x-request-id": f"id-{path}"})
        assert h.get("x-request-id") == f"id-{path}", (method, path, status, h)
    client = keyed.client(api_key=KEYS[1])
    raw_stream = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=3, stream=True, extra_headers={"x-request-id": "stream-7"})  # type: ignore[arg-type]
    assert raw_stream.headers["x-request-id"] == "stream-7"
    assert {c.id for c in raw_stream.parse()} == {"chatcmpl-stream-7"}
    # The openai client reads the header as the response's request id.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_headers={"x-request-id": "sdk-1"})
    assert r._request_id == "sdk-1" and r.id == "cmpl-sdk-1"


def wait_for_log_line(server: Server, rid: str, timeout: float = 10.0) -> str:
    """The one log line of request `rid` (a stream's is written when it ends)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in list(server.log) if f'id="{rid}"' in line]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert len(lines) == 1, (rid, lines)
    return lines[0]


def fields(line: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))


def test_one_log_line_per_request_without_prompts_or_colours(keyed: Server) -> None:
    client = keyed.client(api_key=KEYS[0])
    r = client.completions.create(model=MODEL, prompt=f"The password is {SECRET}", max_tokens=4, temperature=0,
                                  extra_body=IGNORE_EOS, extra_headers={"x-request-id": "log-plain"})
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SECRET}], max_tokens=3,
                                            stream=True, extra_body=IGNORE_EOS, extra_headers={"x-request-id": "log-stream"})
    assert len(list(stream)) >= 2
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=SECRET, max_tokens=4, temperature=-1, extra_headers={"x-request-id": "log-400"})
    status = call(keyed, "POST", "/v1/completions", {"prompt": SECRET}, {"x-request-id": "log-401"})[0]
    assert status == 401

    plain = fields(wait_for_log_line(keyed, "log-plain"))
    assert r.usage is not None
    want = {"endpoint": '"/v1/completions"', "status": "200", "prompt_tokens": str(r.usage.prompt_tokens),
            "output_tokens": "4", "finish_reason": '"length"'}
    assert {k: plain.get(k) for k in want} == want, plain
    assert 0 < float(plain["ttft_ms"]) <= float(plain["duration_ms"])
    streamed = fields(wait_for_log_line(keyed, "log-stream"))
    assert (streamed["endpoint"], streamed["status"], streamed["output_tokens"], streamed["finish_reason"]) == (
        '"/v1/chat/completions"', "200", "3", '"length"'), streamed
    bad = fields(wait_for_log_line(keyed, "log-400"))
    assert bad["status"] == "400" and "ttft_ms" not in bad and "output_tokens" not in bad, bad
    assert fields(wait_for_log_line(keyed, "log-401"))["status"] == "401"
    line = wait_for_log_line(keyed, "log-plain")
    assert " INFO " in line and "rocket::serve" in line, line
    log = "".join(keyed.log)
    assert SECRET not in log, "prompt text was logged without --log-prompts"
    assert "\x1b[" not in log, "colour codes in a log that is not a terminal"
