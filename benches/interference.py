#!/usr/bin/env python3
"""Long prompts against running streams in `rocket serve` (issue 22: "long prompts do not
freeze other streams"): `--streams` greedy streams decode while one prompt of
`--prompt-len` tokens arrives; every stream's gaps between tokens are recorded and split
by when they ended: before the long prompt arrived, while it prefilled (arrival to its
first token), and after.

A gap is between two chunks of a stream (a token whose text ends inside a UTF-8 character,
or has none, joins the next chunk, as the server sends it: such a gap spans two tokens).
The server's own timeline counts tokens instead: it runs with `rocket_core::batch=debug`,
which logs one "pass done" line per forward pass once its tokens are with the streams; the
time between two passes in which every stream decodes is the gap between each stream's
tokens, whatever text they carry ("pass gaps").

Report: the long prompt's time to first token, and per phase the gaps' count, median,
p99 and largest, of the chunks and of the passes. Check (a FAIL line and a non-zero exit):
for each, the p99 gap while the long prompt prefills is at most `--p99-over-median-max` (3
by default, the issue's target) times the median gap of the streams before it arrived.

Beside decoding streams a prompt prefills in pieces its attention budget allows (whole
64-row tiles, at least one); the prefix block does not change the passes. The
prefix cache is off (`--prefix-cache-bytes 0`) so that repetitions prefill alike. Prompts are random token ids (never zeros), and every
request sets ignore_eos so that random weights cannot end a stream early.

Only the standard library is used (http.client), so any python3 runs it.

  python benches/interference.py --rocket target/release/rocket --model CK/llama-3.2-1b \\
      --device cuda --streams 8 --prompt-len 16384 --prefix-block 512 --json gaps.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any

from soak import percentile, start_server, stop_server, verdict


def stream_gaps(port: int, ids: list[int], max_tokens: int, timeout: float, times: list[float], arrival: list[float],
                every_chunk: bool = False) -> str | None:
    """One streamed completion of `ids`, appending the time of each chunk with text
    (`every_chunk`: of each chunk, the closing one included) to `times` as it comes
    (other threads watch it grow); returns an error, or None."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        arrival.append(time.monotonic())
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return f"HTTP {r.status}: {r.read()[:300]!r}"
        while True:
            line = r.readline()
            if not line:
                return "the stream ended before [DONE]"
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            chunk = json.loads(data)
            if "error" in chunk:
                return str(chunk["error"].get("message"))
            if chunk.get("choices") and (every_chunk or chunk["choices"][0].get("text")):
                times.append(time.monotonic())
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        c.close()


def summary(gaps: list[float]) -> dict[str, Any]:
    def ms(x: float | None) -> float | None:
        return None if x is None else 1e3 * x
    return {
        "count": len(gaps),
        "median_ms": ms(percentile(gaps, 50)),
        "p99_ms": ms(percentile(gaps, 99)),
        "max_ms": ms(max(gaps, default=None)),
    }


def phases(stream_times: list[list[float]], arrived: float, first_token: float) -> dict[str, list[float]]:
    """Each gap between consecutive tokens of a stream, by when it ended."""
    out: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for times in stream_times:
        for a, b in zip(times, times[1:]):
            key = "before" if b <= arrived else ("during" if b <= first_token else "after")
            out[key].append(b - a)
    return out


PASS_DONE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z? +DEBUG rocket_core::batch: pass done "
                       r"prompt_rows=(\d+) decode_rows=(\d+)")


def server_passes(log: list[str]) -> list[tuple[float, int, int]]:
    """(seconds, prompt rows, decode rows) of each "pass done" line of the server's log."""
    out = []
    for line in log:
        m = PASS_DONE.match(line)
        if m:
            stamp = datetime.fromisoformat(m.group(1)).replace(tzinfo=timezone.utc).timestamp()
            out.append((stamp, int(m.group(2)), int(m.group(3))))
    return out


CUDA_PASS = re.compile(r"DEBUG rocket_core::backend::cuda: pass rows=(\d+) decode=(true|false) issue_us=([\d.]+) total_us=([\d.]+)")


def cuda_mixed_passes(log: list[str]) -> dict[str, Any]:
    """The CUDA backend's passes with prompt rows (decode=false): how many, and the median
    and p99 of their host issue time and whole time, in µs (issue near the whole: the
    host's launches bound the pass)."""
    issue, total = [], []
    for line in log:
        m = CUDA_PASS.search(line)
        if m and m.group(2) == "false":
            issue.append(float(m.group(3)))
            total.append(float(m.group(4)))
    return {"count": len(total), "issue_median_us": percentile(issue, 50), "total_median_us": percentile(total, 50),
            "total_p99_us": percentile(total, 99)}


def pass_phases(passes: list[tuple[float, int, int]], streams: int) -> dict[str, list[float]]:
    """Gaps between consecutive passes that gave every stream a token, by the later pass:
    "during" from the first such pass with prompt rows (the long prompt's first piece) to
    the last with prompt rows (its last piece), "before" and "after" around them."""
    full = [(t, p) for t, p, d in passes if d == streams]
    pieces = [i for i, (_, p) in enumerate(full) if p > 0]
    out: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    if not pieces:
        return out
    first, last = pieces[0], pieces[-1]
    for i in range(1, len(full)):
        key = "before" if i < first else ("during" if i <= last else "after")
        out[key].append(full[i][0] - full[i - 1][0])
    return out


def phase_fails(what: str, phases_ms: dict[str, dict[str, Any]], ratio_max: float, min_gaps: int = 5) -> list[str]:
    before, during = phases_ms["before"], phases_ms["during"]
    if before["count"] < min_gaps or during["count"] < min_gaps:
        return [f"FAIL too few {what} to judge (before {before['count']}, during {during['count']}): "
                "longer streams (--max-tokens) or a longer prompt"]
    if during["p99_ms"] > ratio_max * before["median_ms"]:
        return [f"FAIL p99 of the {what} while the long prompt prefills {during['p99_ms']:.2f} ms > {ratio_max} x their "
                f"median before it ({before['median_ms']:.2f} ms)"]
    return []


def evaluate(report: dict[str, Any], ratio_max: float, min_gaps: int = 5) -> list[str]:
    fails = []
    if report["errors"]:
        fails.append(f"FAIL requests ended in errors: {report['errors']}")
    if report.get("long_prompt_ttft_ms") is None:
        fails.append("FAIL the long prompt never produced a token")
    fails += phase_fails("gaps between chunks", report["phases"], ratio_max, min_gaps)
    fails += phase_fails("gaps between passes", report["pass_phases"], ratio_max, min_gaps)
    return fails


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rocket", help="the rocket command [default: `rocket` on PATH, else python -m rocket]")
    p.add_argument("--model", help="model path [default: the server's default model]")
    p.add_argument("--device", default="cpu")
    p.add_argument("--streams", type=int, default=8, help="streams decoding when the long prompt arrives [default: 8]")
    p.add_argument("--stream-prompt-len", type=int, default=32, help="prompt tokens of each stream [default: 32]")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="tokens each stream generates: enough to outlast the long prefill [default: 2048]")
    p.add_argument("--prompt-len", type=int, default=4096, help="tokens of the long prompt [default: 4096]")
    p.add_argument("--warmup-tokens", type=int, default=32, help="stream tokens before the long prompt is sent [default: 32]")
    p.add_argument("--prefix-block", type=int, help="the server's --prefix-block")
    p.add_argument("--vocab", type=int, default=1000, help="draw token ids below this (every fuel has more) [default: 1000]")
    p.add_argument("--p99-over-median-max", type=float, default=3.0, help="largest p99 gap during the prefill over the median before [default: 3]")
    p.add_argument("--min-gaps", type=int, default=5,
                   help="fewest gaps before the prompt and while it prefills to judge the p99 by [default: 5]")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    a = p.parse_args()
    if a.streams < 1 or a.prompt_len < 1 or a.max_tokens <= a.warmup_tokens or a.min_gaps < 1:
        p.error("need --streams >= 1, --prompt-len >= 1, --min-gaps >= 1 and --max-tokens > --warmup-tokens")

    # The readers share one GIL: at its default 5 ms switch interval one thread can hold
    # another's chunk back that long, and the chunk gaps would count the client's wait.
    sys.setswitchinterval(1e-4)
    a.max_batch, a.max_queue = a.streams + 1, a.streams + 1
    a.server_args = ["--prefix-cache-bytes", "0"] + (["--prefix-block", str(a.prefix_block)] if a.prefix_block else [])
    # Its "pass done" lines, and on CUDA each pass's host issue and whole time.
    a.server_env = {"ROCKET_LOG": "warn,rocket_core::batch=debug,rocket_core::backend::cuda=debug"}
    proc, port, log = start_server(a)
    try:
        rng = random.Random(a.seed)
        draw = lambda n: [rng.randrange(1, a.vocab) for _ in range(n)]  # noqa: E731
        errors_of: list[str | None] = [None] * (a.streams + 1)
        times: list[list[float]] = [[] for _ in range(a.streams + 1)]
        arrivals: list[list[float]] = [[] for _ in range(a.streams + 1)]
        threads = []
        for i in range(a.streams):
            ids = draw(a.stream_prompt_len)

            def run(i: int = i, ids: list[int] = ids) -> None:
                errors_of[i] = stream_gaps(port, ids, a.max_tokens, a.request_timeout, times[i], arrivals[i])

            threads.append(threading.Thread(target=run, daemon=True))
        for t in threads:
            t.start()
        # Let every stream settle into decoding, then send the long prompt.
        deadline = time.monotonic() + a.request_timeout
        while any(len(ts) < a.warmup_tokens for ts in times[:a.streams]) and all(t.is_alive() for t in threads):
            if time.monotonic() > deadline:
                break
            time.sleep(0.002)
        long_ids = draw(a.prompt_len)

        def run_long() -> None:
            # One token: its first chunk (whatever its text) comes when the prefill ends.
            errors_of[a.streams] = stream_gaps(port, long_ids, 1, a.request_timeout, times[a.streams], arrivals[a.streams], True)

        long_thread = threading.Thread(target=run_long, daemon=True)
        long_thread.start()
        long_thread.join(a.request_timeout)
        for t in threads:
            t.join(a.request_timeout)
    finally:
        stop_server(proc)

    errors = [f"request {i}: {e}" for i, e in enumerate(errors_of) if e]
    arrived = arrivals[a.streams][0] if arrivals[a.streams] else float("inf")
    first = times[a.streams][0] if times[a.streams] else float("inf")
    gaps = phases(times[:a.streams], arrived, first)
    report = {
        "streams": a.streams, "prompt_len": a.prompt_len, "prefix_block": a.prefix_block, "device": a.device,
        "model": a.model, "long_prompt_ttft_ms": None if first == float("inf") else 1e3 * (first - arrived),
        "phases": {k: summary(v) for k, v in gaps.items()},
        "pass_phases": {k: summary(v) for k, v in pass_phases(server_passes(log), a.streams).items()},
        "cuda_prompt_passes": cuda_mixed_passes(log), "errors": errors,
    }
    print(f"interference: {a.streams} streams, a {a.prompt_len}-token prompt"
          + (f", prefix block {a.prefix_block}" if a.prefix_block else "")
          + (f": its TTFT {report['long_prompt_ttft_ms']:.1f} ms" if report["long_prompt_ttft_ms"] is not None else ""))
    for what, key in (("chunk gaps", "phases"), ("pass gaps ", "pass_phases")):
        for k, s in report[key].items():
            if s["count"]:
                print(f"  {what} {k:6}: {s['count']:5}, median {s['median_ms']:8.2f} ms, p99 {s['p99_ms']:8.2f} ms, max {s['max_ms']:8.2f} ms")
            else:
                print(f"  {what} {k:6}: none")
    c = report["cuda_prompt_passes"]
    if c["count"]:
        print(f"  CUDA passes with prompt rows: {c['count']}, host issue median {c['issue_median_us']:.0f} µs, "
              f"whole median {c['total_median_us']:.0f} µs, p99 {c['total_p99_us']:.0f} µs")
    fails = evaluate(report, a.p99_over_median_max, a.min_gaps)
    return verdict("interference", report, fails, a.json)


if __name__ == "__main__":
    sys.exit(main())
