#!/usr/bin/env python3
"""One server over several GPUs (issue 25): `rocket serve --devices` against one GPU.

Two servers in turn, each timed from its start to `/health` answering 200 ("load to
ready"): `--devices ONE` (default `0`) with `--streams-per-gpu` concurrent greedy
streams, then `--devices all` with that many per GPU, each stream `--max-tokens`
tokens (EOS ignored) of a random prompt. Throughput is every stream's tokens over the
time from the first request to the last stream's end. `/health` is sampled while the
streams run: every GPU must run some of them. With `--check-solo`, every prompt is
first sent alone to the same server and each concurrent stream's text must equal its
solo text (run the server with batch-independent passes for that: `--server-arg
--decode=graph --server-arg --matmul=gemv`).

Checks (FAIL lines and a non-zero exit): no request fails; with several GPUs, the
throughput ratio is at least `--min-speedup` per GPU pair (1.9 for two GPUs: 0.95 x
the GPUs) and the load-to-ready ratio at most `--max-load-ratio` (1.3). On a host
with one GPU only the one-GPU server runs and the report says so. `--device cpu` runs
one CPU engine (no `--devices`): what the tests use to check this script.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

from soak import get_json, start_server, stop_server, verdict


def completion(port: int, ids: list[int], max_tokens: int, timeout: float) -> tuple[str | None, str, int]:
    """One streamed greedy completion of `ids`: (error or None, its text, its chunks)."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    text, tokens = [], 0
    try:
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return f"HTTP {r.status}: {r.read()[:300]!r}", "", 0
        while True:
            line = r.readline()
            if not line:
                return "the stream ended before [DONE]", "".join(text), tokens
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return None, "".join(text), tokens
            chunk = json.loads(data)
            if "error" in chunk:
                return str(chunk["error"].get("message")), "".join(text), tokens
            if chunk.get("choices"):
                text.append(chunk["choices"][0].get("text") or "")
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}", "".join(text), tokens
    finally:
        c.close()


def gpu_count() -> int | None:
    """GPUs the servers can see (CUDA_VISIBLE_DEVICES, else nvidia-smi), or None where it cannot tell."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")) if out.returncode == 0 else None


def prompt(seed: int, i: int, n: int, vocab: int) -> list[int]:
    """Stream i's prompt: random ids (never zeros), the same in every server."""
    rng = random.Random(seed * 1_000_003 + i)
    return [rng.randrange(1, vocab) for _ in range(n)]


def run_server(a: argparse.Namespace, devices: str | None) -> dict[str, Any]:
    """Starts a server on `devices` and runs `--streams-per-gpu` streams per GPU at once; its report."""
    a.max_batch, a.max_queue = a.max_batch_per_gpu, max(a.streams_per_gpu, a.max_batch_per_gpu) + 1
    a.server_args = ["--prefix-cache-bytes", "0"] + (["--devices", devices] if devices else []) + a.server_arg
    a.ready_poll = 0.01  # start_server's readiness poll: the load time's resolution
    t0 = time.monotonic()
    proc, port, _log = start_server(a)
    ready_s = time.monotonic() - t0
    report: dict[str, Any] = {"devices": devices or a.device, "load_to_ready_s": ready_s, "errors": []}
    try:
        _, health = get_json("127.0.0.1", port, "/health")
        names = [d["device"] for d in (health or {}).get("devices", [])] or [a.device]
        streams = a.streams_per_gpu * len(names)
        report.update(gpus=len(names), streams=streams)
        prompts = [prompt(a.seed, i, a.prompt_len, a.vocab) for i in range(streams)]
        solo: list[str] = []
        if a.check_solo:
            for i, ids in enumerate(prompts):
                err, text, _ = completion(port, ids, a.max_tokens, a.request_timeout)
                if err:
                    report["errors"].append(f"solo request {i}: {err}")
                solo.append(text)
        results: list[tuple[str | None, str, int]] = [(None, "", 0)] * streams
        ended = [0.0] * streams
        ran: dict[str, int] = {n: 0 for n in names}

        def run(i: int) -> None:
            results[i] = completion(port, prompts[i], a.max_tokens, a.request_timeout)
            ended[i] = time.monotonic()

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
        start = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            try:
                _, h = get_json("127.0.0.1", port, "/health")
            except OSError as e:
                report["errors"].append(f"/health while the streams ran: {e}")
                h = None
            for d in (h or {}).get("devices", []):
                ran[d["device"]] = max(ran.get(d["device"], 0), int(d.get("running", 0)))
            time.sleep(0.05)
        for t in threads:
            t.join()
        # From the first request to the last stream's end (each thread's own time, not the poll's).
        seconds = max(ended) - start
        tokens = sum(r[2] for r in results)
        report.update(seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
                      most_running=ran, solo_checked=len(solo))
        for i, (err, text, n) in enumerate(results):
            if err:
                report["errors"].append(f"stream {i}: {err}")
            elif n != a.max_tokens:
                report["errors"].append(f"stream {i}: {n} tokens, not {a.max_tokens}")
            elif a.check_solo and text != solo[i]:
                report["errors"].append(f"stream {i}: its text differs from its text alone")
    finally:
        stop_server(proc)
    return report


def evaluate(report: dict[str, Any], min_speedup: float, max_load_ratio: float) -> list[str]:
    fails = [f"FAIL: {e}" for run in report["runs"] for e in run["errors"]]
    for run in report["runs"]:
        idle = [d for d, n in run.get("most_running", {}).items() if n == 0 and len(run["most_running"]) > 1]
        if idle:
            fails.append(f"FAIL: --devices {run['devices']}: {', '.join(idle)} never ran a stream")
    if len(report["runs"]) == 2 and report["runs"][0]["tokens_per_s"] > 0:
        one, all_ = report["runs"]
        pairs = all_["gpus"] / 2
        if report["speedup"] < min_speedup * pairs:
            fails.append(f"FAIL: {all_['gpus']} GPUs gave {report['speedup']:.2f}x one GPU's tokens/s (want >= {min_speedup * pairs:.2f})")
        if report["load_ratio"] > max_load_ratio:
            fails.append(f"FAIL: load to ready on {all_['gpus']} GPUs took {report['load_ratio']:.2f}x one GPU's (want <= {max_load_ratio})")
    return fails


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rocket", help="the rocket command [default: `rocket` on PATH, else python -m rocket]")
    p.add_argument("--model", help="model path [default: the server's default model]")
    p.add_argument("--device", default="cuda", help="cuda (the servers take --devices), or cpu: one CPU engine [default: cuda]")
    p.add_argument("--one", default="0", help="the one-GPU server's --devices [default: 0]")
    p.add_argument("--streams-per-gpu", type=int, default=32, help="concurrent streams per GPU [default: 32]")
    p.add_argument("--max-batch-per-gpu", type=int, default=32, help="the servers' --max-batch (per GPU) [default: 32]")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of each stream [default: 128]")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of each stream [default: 16]")
    p.add_argument("--vocab", type=int, default=1000, help="draw token ids below this (every fuel has more) [default: 1000]")
    p.add_argument("--check-solo", action="store_true", help="each stream's text must equal the prompt's text when sent alone")
    p.add_argument("--server-arg", action="append", default=[], help="another flag for both servers (repeat it; --flag=value)")
    p.add_argument("--min-speedup", type=float, default=1.9, help="least tokens/s of all GPUs over one GPU's, per pair of GPUs [default: 1.9]")
    p.add_argument("--max-load-ratio", type=float, default=1.3, help="most load-to-ready time of all GPUs over one GPU's [default: 1.3]")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    a = p.parse_args()
    if a.streams_per_gpu < 1 or a.max_tokens < 1 or a.prompt_len < 1:
        p.error("need --streams-per-gpu, --max-tokens and --prompt-len >= 1")

    gpu = a.device != "cpu"
    report: dict[str, Any] = {"max_tokens": a.max_tokens, "prompt_len": a.prompt_len, "streams_per_gpu": a.streams_per_gpu,
                              "check_solo": a.check_solo, "server_args": a.server_arg, "runs": []}
    report["runs"].append(run_server(a, a.one if gpu else None))
    host_gpus = gpu_count() if gpu else None
    if gpu and (host_gpus is None or host_gpus > 1):
        report["runs"].append(run_server(a, "all"))
        if report["runs"][1]["gpus"] < 2:
            seen = report["runs"].pop()["gpus"]
            if host_gpus is not None:  # the host has several: `--devices all` should have used them
                report["runs"][0]["errors"].append(f"--devices all served on {seen} GPU(s) of the {host_gpus} this host has")
    one = report["runs"][0]
    print(f"DEVICES --devices {one['devices']}: load to ready {one['load_to_ready_s']:.2f} s; {one['streams']} streams x "
          f"{a.max_tokens} tokens in {one['seconds']:.2f} s: {one['tokens_per_s']:.0f} tokens/s"
          + (f"; {one['solo_checked']} checked against their text alone" if a.check_solo else ""))
    if len(report["runs"]) == 2:
        all_ = report["runs"][1]
        report["speedup"] = all_["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] > 0 else 0.0
        report["load_ratio"] = all_["load_to_ready_s"] / one["load_to_ready_s"]
        print(f"DEVICES --devices all ({all_['gpus']} GPUs): load to ready {all_['load_to_ready_s']:.2f} s "
              f"({report['load_ratio']:.2f}x); {all_['streams']} streams in {all_['seconds']:.2f} s: "
              f"{all_['tokens_per_s']:.0f} tokens/s ({report['speedup']:.2f}x); most running per GPU {all_['most_running']}")
    elif gpu:
        print(f"DEVICES: this host has {host_gpus} GPU: the several-GPU server was not run (no speedup or load ratio)")
    return verdict("devices", report, evaluate(report, a.min_speedup, a.max_load_ratio), a.json)

if __name__ == "__main__":
    sys.exit(main())
