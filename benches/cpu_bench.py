"""CPU reference backend bench: model load time and decode speed.

    python benches/cpu_bench.py [--model PATH] [--gen-len 128] [--reps 3] [--json FILE]

Defaults to the embedded SmolLM2-135M-Instruct. Decode runs with ignore_eos so
every repetition generates exactly --gen-len tokens. Prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import rocket


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", default="The history of the printing press begins")
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = args.model or rocket.default_model_path()

    # Load time: the first load warms the page cache; report the later ones.
    load_times = []
    for _ in range(args.reps + 1):
        t0 = time.perf_counter()
        llm = rocket.LLM(model, device="cpu")
        load_times.append(time.perf_counter() - t0)
    load_times = load_times[1:]

    params = rocket.SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    llm.generate(args.prompt, rocket.SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    decode, ttft = [], []
    for _ in range(args.reps):
        out = llm.generate(args.prompt, params)[0]
        assert len(out.token_ids) == args.gen_len, len(out.token_ids)
        decode.append(out.metrics["decode_tokens_per_second"])
        ttft.append(out.metrics["time_to_first_token"])

    info = llm.info
    gbps = [tps * info["bytes_per_decode_step"] / 1e9 for tps in decode]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "command": " ".join([sys.executable, *sys.argv]),
        "model": model,
        "prompt_tokens": out.metrics["prompt_tokens"],
        "gen_len": args.gen_len,
        "load_seconds": load_times,
        "ttft_seconds": ttft,
        "decode_tokens_per_second": decode,
        "effective_weight_GBps": gbps,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)

    def ms(xs: list[float]) -> str:
        return f"{statistics.mean(xs):.3f} ± {statistics.pstdev(xs):.3f}"

    print(f"\nrocket CPU bench — {os.path.basename(model)}, commit {result['commit']}, {result['date']}, {os.cpu_count()} CPUs")
    print("| metric | mean ± std |")
    print("|---|---|")
    print(f"| load to ready (s) | {ms(load_times)} |")
    print(f"| TTFT, {result['prompt_tokens']}-token prompt (s) | {ms(ttft)} |")
    print(f"| decode tokens/s ({args.gen_len} tokens) | {ms(decode)} |")
    print(f"| effective weight read (GB/s) | {ms(gbps)} |")


if __name__ == "__main__":
    main()
