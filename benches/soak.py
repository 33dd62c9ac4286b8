#!/usr/bin/env python3
"""Soak test for `rocket serve`: start the server, send mixed traffic for a set
time, then report and check what a long-running deployment needs.

Traffic (from a few client threads, plus periodic bursts):
  completions and chat, streaming and not, greedy and sampled; streams the
  client drops after a token or two; malformed bodies (expect a 4xx with an
  OpenAI-style error body); bursts of streams past `--max-queue` (expect 429).

Report: requests served, outcomes by kind (expected vs unexpected), p50/p99
time to first token and inter-token latency in the first and the last window
(one minute, or a fifth of the run when that is shorter), and the server's RSS
over time (VmRSS from /proc/PID/status).

Checks (each a FAIL line and a non-zero exit when it fails):
  - no lost request: every request ended with a full response or an expected error;
  - /health's requests_in_flight returns to 0 once the traffic stops;
  - RSS growth after warm-up (max of the last window over max of the first) <= --rss-growth-max;
  - last-window p99 TTFT and inter-token latency <= (1 + --p99-drift-max) x the first window's.
Latency samples taken while a burst is in flight are left out of the window
statistics (a burst queues requests on purpose); their count is reported.

Only the standard library is used (http.client), so any python3 runs it.

  python benches/soak.py --rocket target/debug/rocket --duration 900 --json soak.json
  python benches/soak.py --recheck soak.json --rss-growth-max 0.05   # re-run the checks on a saved report
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "List three colours:",
    "def fibonacci(n):",
    "The quick brown fox",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a planet."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to five."}],
]
# Bodies the server must refuse with a 4xx and an OpenAI-style {"error": ...} body.
MALFORMED: list[tuple[str, bytes]] = [
    ("/v1/completions", b'{"prompt": "truncated'),
    ("/v1/completions", b"not json at all"),
    ("/v1/completions", b'{"prompt": 5}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -3}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}'),
    ("/v1/completions", b'{"prompt": "x", "top_p": 7}'),
    ("/v1/chat/completions", b'{"messages": "hi"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}'),
    ("/v1/chat/completions", b"[]"),
    ("/v1/chat/completions", b'{"messages": [], "n": 0}'),
]
EXPECTED_4XX = {400, 404, 405, 413, 415, 422}
LATENCY_KINDS = ("ttft", "itl")


@dataclass
class Outcome:
    kind: str  # request kind, e.g. "completion_stream_sampled"
    status: str  # "ok", "disconnected", "rejected_4xx", "overloaded_429", or "unexpected: ..."
    start: float  # seconds since the traffic began
    end: float
    expected: bool
    tokens: int = 0


@dataclass
class Stats:
    outcomes: list[Outcome] = field(default_factory=list)
    # (time since start, seconds, during a burst?)
    ttft: list[tuple[float, float, bool]] = field(default_factory=list)
    itl: list[tuple[float, float, bool]] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (time, kB)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)


class Traffic:
    def __init__(self, host: str, port: int, args: argparse.Namespace, stats: Stats) -> None:
        self.host, self.port, self.args, self.stats = host, port, args, stats
        self.t0 = time.monotonic()
        self.bursts_in_flight = 0
        self.burst_lock = threading.Lock()
        self.stop = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def in_burst(self) -> bool:
        return self.bursts_in_flight > 0

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.args.request_timeout)

    # One request of each kind. Each returns an Outcome and records latencies.
    def body(self, rng: random.Random, chat: bool, stream: bool, sampled: bool, max_tokens: int) -> dict[str, Any]:
        b: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream}
        if chat:
            b["messages"] = rng.choice(CHATS)
        else:
            b["prompt"] = rng.choice(PROMPTS)
        if sampled:
            b.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
        else:
            b["temperature"] = 0.0
        return b

    def send(self, kind: str, path: str, body: bytes, stream: bool, disconnect_after: int | None = None,
             burst: bool = False) -> Outcome:
        start = self.now()
        burst = burst or self.in_burst()
        c = self.conn()
        tokens = 0
        try:
            c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status == 429:
                payload = r.read()
                ok = b'"error"' in payload
                return Outcome(kind, "overloaded_429" if ok else "unexpected: 429 without error body", start, self.now(), ok)
            if r.status != 200:
                payload = r.read()
                if r.status in EXPECTED_4XX and kind == "malformed":
                    ok = _is_error_body(payload)
                    return Outcome(kind, "rejected_4xx" if ok else f"unexpected: {r.status} body {payload[:80]!r}", start, self.now(), ok)
                return Outcome(kind, f"unexpected: HTTP {r.status} {payload[:120]!r}", start, self.now(), False)
            if kind == "malformed":
                r.read()
                return Outcome(kind, "unexpected: malformed body accepted (200)", start, self.now(), False)
            if not stream:
                payload = json.loads(r.read())
                choice = payload["choices"][0]
                text = choice["message"]["content"] if "message" in choice else choice["text"]
                if not isinstance(text, str) or choice.get("finish_reason") not in ("stop", "length"):
                    return Outcome(kind, f"unexpected: bad body {str(payload)[:120]}", start, self.now(), False)
                return Outcome(kind, "ok", start, self.now(), True, payload.get("usage", {}).get("completion_tokens", 0))
            last = None
            done = False
            finish = None
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Outcome(kind, f"unexpected: error in stream {str(chunk)[:120]}", start, self.now(), False)
                choices = chunk.get("choices") or []
                if not choices:
                    continue  # a usage-only chunk
                ch = choices[0]
                text = ch["delta"].get("content") if "delta" in ch else ch.get("text")
                finish = ch.get("finish_reason") or finish
                if text:
                    t = self.now()
                    in_burst = burst or self.in_burst()
                    with self.stats.lock:
                        if last is None:
                            self.stats.ttft.append((t, t - start, in_burst))
                        else:
                            self.stats.itl.append((t, t - last, in_burst))
                    last = t
                    tokens += 1
                    if disconnect_after is not None and tokens >= disconnect_after:
                        c.close()  # drop the connection mid-stream
                        return Outcome(kind, "disconnected", start, self.now(), True, tokens)
            if disconnect_after is not None and done:
                # The answer ended before the client hung up: a normal completion.
                return Outcome(kind, "ok", start, self.now(), True, tokens)
            if not done or finish not in ("stop", "length"):
                return Outcome(kind, f"unexpected: stream ended without [DONE] (finish {finish})", start, self.now(), False, tokens)
            return Outcome(kind, "ok", start, self.now(), True, tokens)
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, IndexError) as e:
            return Outcome(kind, f"unexpected: {type(e).__name__}: {e}"[:160], start, self.now(), False, tokens)
        finally:
            c.close()

    def one(self, rng: random.Random, first_of: int | None = None) -> Outcome:
        a = self.args
        roll = rng.random()
        # Every run, however short, sends each special kind at least once.
        if first_of == 0:
            roll = 0.0
        elif first_of == 1:
            roll = a.malformed_frac
        if roll < a.malformed_frac:
            path, body = rng.choice(MALFORMED)
            return self.send("malformed", path, body, stream=False)
        if roll < a.malformed_frac + a.disconnect_frac:
            chat = rng.random() < 0.5
            b = self.body(rng, chat, True, rng.random() < 0.5, a.max_tokens * 4)
            return self.send("disconnect", _path(chat), json.dumps(b).encode(), stream=True,
                             disconnect_after=rng.randint(1, 2))
        chat, stream, sampled = rng.random() < 0.5, rng.random() < 0.6, rng.random() < 0.5
        kind = f"{'chat' if chat else 'completion'}_{'stream' if stream else 'plain'}_{'sampled' if sampled else 'greedy'}"
        b = self.body(rng, chat, stream, sampled, a.max_tokens)
        return self.send(kind, _path(chat), json.dumps(b).encode(), stream=stream)

    def worker(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        first: int | None = i
        while not self.stop.is_set():
            self.stats.add(self.one(rng, first))
            first = None

    def burst_loop(self) -> None:
        a = self.args
        rng = random.Random(a.seed * 1000 + 999)
        while not self.stop.wait(a.burst_every):
            with self.burst_lock:
                self.bursts_in_flight += 1
            threads = []
            results: list[Outcome] = []
            rlock = threading.Lock()

            def fire(j: int) -> None:
                b = self.body(rng, j % 2 == 1, True, j % 3 == 0, a.burst_max_tokens)
                o = self.send("burst", _path(j % 2 == 1), json.dumps(b).encode(), stream=True, burst=True)
                with rlock:
                    results.append(o)

            for j in range(a.burst_size):
                t = threading.Thread(target=fire, args=(j,), daemon=True)
                t.start()
                threads.append(t)
            for t in threads:
                t.join()
            for o in results:
                self.stats.add(o)
            # Let the queue drain before samples count again.
            time.sleep(1.0)
            with self.burst_lock:
                self.bursts_in_flight -= 1


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _is_error_body(payload: bytes) -> bool:
    try:
        e = json.loads(payload)["error"]
        return isinstance(e, dict) and isinstance(e.get("message"), str)
    except (ValueError, KeyError, TypeError):
        return False


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def get_json(host: str, port: int, path: str, timeout: float = 5.0) -> tuple[int, Any]:
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        body = r.read()
        try:
            return r.status, json.loads(body)
        except ValueError:
            return r.status, None
    finally:
        c.close()


def start_server(a: argparse.Namespace) -> tuple[subprocess.Popen[str], int, list[str]]:
    if a.rocket:
        cmd = shlex.split(a.rocket)
    elif shutil.which("rocket"):
        cmd = ["rocket"]
    else:
        cmd = [sys.executable, "-m", "rocket"]
    cmd += ["serve", "--device", a.device, "--host", "127.0.0.1", "--port", "0",
            "--max-batch", str(a.max_batch), "--max-queue", str(a.max_queue), "--progress", "off"]
    if a.model:
        cmd += ["--model", a.model]
    cmd += getattr(a, "server_args", [])  # other benches' extra server flags
    print("soak: starting", " ".join(cmd), flush=True)
    env = {**os.environ, **getattr(a, "server_env", {})}  # other benches' server variables (its log filter)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    log: list[str] = []
    port_box: list[int] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m and not port_box:
                port_box.append(int(m.group(1)))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + a.start_timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if port_box:
            try:
                status, _ = get_json("127.0.0.1", port_box[0], "/health")
                if status == 200:
                    return proc, port_box[0], log
            except OSError:
                pass
        time.sleep(getattr(a, "ready_poll", 0.2))  # other benches time the load by it
    proc.kill()
    raise SystemExit(f"FAIL: server did not become ready in {a.start_timeout} s:\n{''.join(log)}")


def stop_server(proc: subprocess.Popen[str]) -> None:
    """SIGTERM (a graceful drain), then SIGKILL if it has not exited within 40 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def verdict(name: str, report: dict[str, Any], fails: list[str], json_path: str | None) -> int:
    """Writes the JSON report, prints each failure and NAME: PASS or FAIL; the exit status."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    for line in fails:
        print(line)
    print(f"{name}: PASS" if not fails else f"{name}: FAIL", flush=True)
    return 1 if fails else 0


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


def windows(duration: float) -> tuple[tuple[float, float], tuple[float, float]]:
    w = min(60.0, duration / 5)
    return (0.0, w), (duration - w, duration)


def evaluate(report: dict[str, Any], rss_growth_max: float, p99_drift_max: float, min_samples: int = 5) -> list[str]:
    """The checks, on a report dict (so saved reports can be re-checked). Returns FAIL lines."""
    fails = []
    lost = report["unexpected"]
    if lost:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(lost.items()))
        fails.append(f"FAIL lost requests: {sum(lost.values())} without a full response or an expected error ({kinds})")
    if report["in_flight_at_end"] != 0:
        fails.append(f"FAIL /health requests_in_flight is {report['in_flight_at_end']} after the traffic stopped (leaked slots)")
    # RSS: the first window is the warm-up; compare peaks of the first and last windows.
    (f0, f1), (l0, l1) = windows(report["duration_s"])
    rss = report["rss_kb"]
    first = [kb for t, kb in rss if f0 <= t <= f1]
    last = [kb for t, kb in rss if l0 <= t <= l1]
    if not first or not last:
        fails.append("FAIL RSS: no samples in the first or last window")
    else:
        growth = max(last) / max(first) - 1
        report["rss_growth"] = growth
        if growth > rss_growth_max:
            fails.append(f"FAIL RSS grew {growth:.1%} after warm-up ({max(first)} kB -> {max(last)} kB; limit {rss_growth_max:.0%})")
    for kind in LATENCY_KINDS:
        first_w, last_w = report["latency"]["first"][kind], report["latency"]["last"][kind]
        a, b = first_w["p99"], last_w["p99"]
        if a is None or b is None or min(first_w["n"], last_w["n"]) < min_samples:
            fails.append(f"FAIL {kind}: too few samples to compare ({first_w['n']} in the first window, {last_w['n']} in the last; need {min_samples})")
        elif b > a * (1 + p99_drift_max):
            fails.append(f"FAIL {kind} p99 drifted {b / a - 1:+.0%} (first window {a * 1e3:.1f} ms, last {b * 1e3:.1f} ms; limit +{p99_drift_max:.0%})")
    if report["served"] == 0:
        fails.append("FAIL no request was served")
    return fails


def build_report(stats: Stats, a: argparse.Namespace, duration: float, in_flight_end: int | None) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    unexpected: dict[str, int] = {}
    for o in stats.outcomes:
        by_kind.setdefault(o.kind, {}).setdefault(o.status, 0)
        by_kind[o.kind][o.status] += 1
        if not o.expected:
            key = re.sub(r"\d+", "N", o.status)[:80]
            unexpected[key] = unexpected.get(key, 0) + 1
    (f0, f1), (l0, l1) = windows(duration)
    lat: dict[str, Any] = {}
    excluded = 0
    for name, (w0, w1) in (("first", (f0, f1)), ("last", (l0, l1))):
        lat[name] = {"window_s": [round(w0, 1), round(w1, 1)]}
        for kind in LATENCY_KINDS:
            samples = getattr(stats, kind)
            xs = [x for t, x, burst in samples if w0 <= t <= w1 and not burst]
            lat[name][kind] = {"n": len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99)}
    excluded = sum(1 for kind in LATENCY_KINDS for _, _, burst in getattr(stats, kind) if burst)
    served = sum(1 for o in stats.outcomes if o.status == "ok")
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "duration_s": duration,
        "requests": len(stats.outcomes),
        "served": served,
        "tokens_streamed_or_returned": sum(o.tokens for o in stats.outcomes),
        "outcomes_by_kind": by_kind,
        "expected_errors": {s: sum(1 for o in stats.outcomes if o.expected and o.status == s) for s in ("rejected_4xx", "overloaded_429", "disconnected")},
        "unexpected": unexpected,
        "latency": lat,
        "latency_samples_in_bursts_excluded": excluded,
        "in_flight_at_end": in_flight_end,
        "rss_kb": stats.rss,
        "settings": {k: v for k, v in vars(a).items() if k != "recheck"},
    }


def print_report(r: dict[str, Any]) -> None:
    ms = lambda x: "-" if x is None else f"{x * 1e3:.1f}"  # noqa: E731
    print(f"soak: {r['duration_s']:.0f} s, {r['requests']} requests, {r['served']} served, "
          f"{r['tokens_streamed_or_returned']} tokens")
    print("expected errors: " + ", ".join(f"{k} {v}" for k, v in r["expected_errors"].items()))
    print("unexpected: " + (", ".join(f"{k} x{v}" for k, v in r["unexpected"].items()) or "none"))
    print("outcomes by kind:")
    for kind, d in sorted(r["outcomes_by_kind"].items()):
        print(f"  {kind:32s} " + ", ".join(f"{s} {n}" for s, n in sorted(d.items())))
    print("latency (ms)          n    p50     p99")
    for w in ("first", "last"):
        for kind in LATENCY_KINDS:
            s = r["latency"][w][kind]
            print(f"  {w:5s} {kind:4s} {str(r['latency'][w]['window_s']):14s} {s['n']:6d} {ms(s['p50']):>7s} {ms(s['p99']):>7s}")
    print(f"  ({r['latency_samples_in_bursts_excluded']} samples taken during bursts left out)")
    rss = r["rss_kb"]
    if rss:
        step = max(1, len(rss) // 10)
        pts = rss[::step] + ([rss[-1]] if (len(rss) - 1) % step else [])
        print("RSS (MB) over time: " + " ".join(f"{t:.0f}s:{kb / 1024:.0f}" for t, kb in pts))
    if "rss_growth" in r:
        print(f"RSS growth after warm-up: {r['rss_growth']:+.2%}")
    print(f"/health requests_in_flight at the end: {r['in_flight_at_end']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rocket", help="the rocket command, e.g. target/debug/rocket or 'python -m rocket' [default: `rocket` on PATH, else python -m rocket]")
    p.add_argument("--model", help="model path [default: the server's default model]")
    p.add_argument("--device", default="cpu")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic [default: 60]")
    p.add_argument("--clients", type=int, default=3, help="client threads sending one request at a time [default: 3]")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of ordinary requests [default: 16]")
    p.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts [default: 60]")
    p.add_argument("--burst-max-tokens", type=int, default=4, help="max_tokens of burst requests [default: 4]")
    p.add_argument("--burst-size", type=int, default=0, help="requests per burst [default: 2 x max-queue]")
    p.add_argument("--malformed-frac", type=float, default=0.08)
    p.add_argument("--disconnect-frac", type=float, default=0.08)
    p.add_argument("--rss-growth-max", type=float, default=0.05, help="largest RSS growth after warm-up [default: 0.05]")
    p.add_argument("--p99-drift-max", type=float, default=0.20, help="largest rise of last-window p99 over the first [default: 0.20]")
    p.add_argument("--min-samples", type=int, default=5, help="fewest latency samples per window for the p99 comparison [default: 5]")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--recheck", help="only re-run the checks on a saved report (JSON)")
    a = p.parse_args()

    if a.recheck:
        with open(a.recheck) as f:
            report = json.load(f)
        fails = evaluate(report, a.rss_growth_max, a.p99_drift_max, a.min_samples)
        print_report(report)
        for line in fails:
            print(line)
        print("soak: PASS" if not fails else "soak: FAIL")
        return 1 if fails else 0

    if a.burst_size <= 0:
        a.burst_size = 2 * a.max_queue
    proc, port, log = start_server(a)
    stats = Stats()
    traffic = Traffic("127.0.0.1", port, a, stats)
    threads = [threading.Thread(target=traffic.worker, args=(i,), daemon=True) for i in range(a.clients)]
    threads.append(threading.Thread(target=traffic.burst_loop, daemon=True))
    for t in threads:
        t.start()
    try:
        while traffic.now() < a.duration:
            kb = rss_kb(proc.pid)
            if kb is not None:
                stats.rss.append((round(traffic.now(), 2), kb))
            if proc.poll() is not None:
                break
            time.sleep(1.0)
        duration = min(traffic.now(), a.duration)
        traffic.stop.set()
        for t in threads:
            t.join(timeout=a.request_timeout + 10)
        # Every slot must be free once nobody is asking.
        in_flight: int | None = None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                status, body = get_json("127.0.0.1", port, "/health")
                in_flight = (body or {}).get("requests_in_flight")
                if status == 200 and in_flight == 0:
                    break
            except OSError:
                in_flight = None
            time.sleep(0.25)
        alive = proc.poll() is None
    finally:
        stop_server(proc)
    report = build_report(stats, a, duration, in_flight)
    report["server_exit_code"] = proc.returncode
    fails = evaluate(report, a.rss_growth_max, a.p99_drift_max, a.min_samples)
    print_report(report)
    if not alive:
        fails.append(f"FAIL the server died during the run:\n{''.join(log[-20:])}")
    elif proc.returncode != 0:
        fails.append(f"FAIL the server exited with {proc.returncode} after SIGTERM")
    return verdict("soak", report, fails, a.json)


if __name__ == "__main__":
    sys.exit(main())
