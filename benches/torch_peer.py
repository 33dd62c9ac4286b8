"""Plain-PyTorch peer: how fast Hugging Face transformers decodes a checkpoint, bf16, one device.

    python benches/torch_peer.py --model DIR [--batch 1,16] [--prompt-len 128] [--gen-len 256]
        [--reps 5] [--json FILE] [--device cuda|cpu] [--no-eager] [--no-compile]

On the same checkpoint (e.g. one written by benches/make_checkpoint.py), for each batch size B,
with B random prompts of --prompt-len token ids (torch.randint, fixed seed, special ids avoided,
the same for every rep):

(a) "hf-generate": `model.generate(cache_implementation="static")`, greedy, with
    min_new_tokens = max_new_tokens so every run decodes exactly N tokens. On CUDA, transformers
    then compiles the one-token forward by itself (torch.compile, mode reduce-overhead, i.e.
    CUDA graphs, fullgraph=False); that is what a user of generate gets. TTFT = time of a
    generate with N=1; decode ms/step = (time(N=gen_len) - time(N=1)) / (gen_len - 1).
    "hf-generate-eager" is the same with `disable_compile=True` (skipped with --no-eager).
(b) "gpt-fast": the HF model with a transformers StaticCache, the prompt prefilled once
    eagerly, then gen_len one-token greedy decode steps through
    torch.compile(step, mode="reduce-overhead", fullgraph=True), timed with
    torch.cuda.synchronize() around the loop. If fullgraph=True does not compile, the error is
    recorded and fullgraph=False is tried. (--no-compile skips it.)

Every figure is mean ± std over --reps after warm-up. ms/step is the time of one decode step for
the whole batch (= ms/token at batch 1). Copy bandwidth is a device-to-device copy of 2 GiB timed
with CUDA events, counted as read + write bytes (2 x size) per second, 1 GB = 1e9 bytes. The
effective bandwidth of a decode is the weight bytes read per step (every parameter once; the
embedding table only when tied, as the LM head; KV-cache reads not counted) / step time.
As a check that each path decodes what the model computes, "teacher_forced_top1" is the share
of its generated tokens that one eager forward over prompt + generated tokens also ranks first
(bf16 noise on random weights flips some near-ties; a wrong decode path gives ~0). The JSON has
every per-rep figure; a table is printed last.
"""

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig, StaticCache


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def mean_std(xs):
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"mean": m, "std": s, "reps": xs}


def copy_bandwidth(device):
    """GB/s of a device-to-device copy, counting read + write bytes."""
    nbytes = 2 * 2**30 if device.type == "cuda" else 256 * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    iters = 20 if device.type == "cuda" else 5
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        seconds, _ = timed(lambda: [dst.copy_(src) for _ in range(iters)], device)
    del src, dst
    return 2 * nbytes * iters / seconds / 1e9, nbytes


def weight_bytes(model):
    """Bytes of weights read by one decode step (tied parameters counted once)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups tied ones
    emb = model.get_input_embeddings().weight
    if model.get_output_embeddings().weight is not emb:  # untied: the embedding table is only gathered from
        total -= emb.numel() * emb.element_size()
    return total


def random_prompts(model_dir, config, batch, length, seed, device):
    special = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(config, key, None)
        special.update(v if isinstance(v, list) else [] if v is None else [v])
    try:
        with open(os.path.join(model_dir, "tokenizer.json")) as f:
            special.update(t["id"] for t in json.load(f).get("added_tokens", []) if t.get("special"))
    except OSError:
        pass
    allowed = torch.tensor([i for i in range(config.vocab_size) if i not in special])
    gen = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(len(allowed), (batch, length), generator=gen)].to(device)


def teacher_forced_agreement(model, ids, tokens):
    """Share of generated tokens that an eager, cache-free forward over prompt + tokens also picks
    as its top-1: ~0.95 for bf16 noise on random weights, ~0 if the decode path were wrong."""
    with torch.inference_mode():
        logits = model(input_ids=torch.cat([ids, tokens], 1), use_cache=False, logits_to_keep=tokens.shape[1] + 1).logits
    return (logits[:, :-1].argmax(-1) == tokens).float().mean().item()


def bench_generate(model, ids, args, device, eager):
    """(a): TTFT and decode ms/step of model.generate with a static cache."""
    n = args.gen_len

    def generate(new_tokens):
        cfg = GenerationConfig(
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            disable_compile=eager,
            eos_token_id=model.generation_config.eos_token_id,
            pad_token_id=model.generation_config.pad_token_id or 0,
        )
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)

    torch._dynamo.reset()
    for i in range(2):  # the first decode compiles (and records CUDA graphs)
        log(f"  warm-up {i + 1}/2 ...")
        generate(n)
        generate(1)
    ttft, step = [], []
    for _ in range(args.reps):
        t1, _ = timed(lambda: generate(1), device)
        tn, out = timed(lambda: generate(n), device)
        assert out.shape[1] == ids.shape[1] + n, out.shape
        ttft.append(t1 * 1e3)
        step.append((tn - t1) * 1e3 / (n - 1))
    compiled = not eager and hasattr(model, "_compiled_call")
    return {"ttft_ms": mean_std(ttft), "ms_per_step": mean_std(step), "compiled": compiled}, out[:, ids.shape[1] :]


def bench_gpt_fast(model, ids, args, device, fullgraph):
    """(b): prefill eagerly into a StaticCache, then time gen_len compiled one-token steps."""
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + args.gen_len)

    def step(tok):
        logits = model(input_ids=tok, past_key_values=cache, use_cache=True).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=fullgraph)

    def prefill():
        cache.reset()  # keeps the buffers (static addresses), zeroes them and the lengths
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    def decode(tok):
        toks = []
        for _ in range(args.gen_len):
            torch.compiler.cudagraph_mark_step_begin()
            tok = compiled(tok).clone()
            toks.append(tok)
        return torch.cat(toks, 1)

    with torch.inference_mode():
        for i in range(2):
            log(f"  warm-up {i + 1}/2{' (compiles)' if i == 0 else ''} ...")
            t0 = time.perf_counter()
            decode(prefill())
            log(f"  ... {time.perf_counter() - t0:.1f} s")
        times = []
        for _ in range(args.reps):
            tok = prefill()
            seconds, out = timed(lambda: decode(tok), device)
            times.append(seconds * 1e3 / args.gen_len)
    return {"ms_per_step": mean_std(times), "fullgraph": fullgraph}, torch.cat([tok, out], 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-eager", action="store_true", help="skip hf-generate-eager")
    ap.add_argument("--no-compile", action="store_true", help="skip gpt-fast")
    args = ap.parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch.split(",")]

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(device).eval()
    wbytes = weight_bytes(model)
    copy_gbps, copy_bytes = copy_bandwidth(device)
    log(f"{type(model).__name__}: {wbytes / 1e9:.3f} GB of weights per step; copy {copy_gbps:.0f} GB/s")

    def bandwidth(res):
        ms = res["ms_per_step"]["mean"]
        res["weights_gbps"] = wbytes / (ms / 1e3) / 1e9
        res["pct_of_copy"] = 100 * res["weights_gbps"] / copy_gbps

    results = []
    for b in batches:
        ids = random_prompts(args.model, model.config, b, args.prompt_len, args.seed, device)
        row = {"batch": b}
        variants = [("hf-generate", False)] + ([] if args.no_eager else [("hf-generate-eager", True)])
        for name, eager in variants:
            log(f"batch {b}: {name}")
            res, tokens = bench_generate(model, ids, args, device, eager)
            bandwidth(res)
            res["teacher_forced_top1"] = teacher_forced_agreement(model, ids, tokens)
            row[name] = res
        if not args.no_compile:
            errors = []
            for fullgraph in (True, False):
                log(f"batch {b}: gpt-fast (fullgraph={fullgraph})")
                try:
                    res, tokens = bench_gpt_fast(model, ids, args, device, fullgraph)
                except Exception as e:  # a compile failure is a result too
                    errors.append(f"fullgraph={fullgraph}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
                    log("  failed: " + errors[-1])
                    continue
                bandwidth(res)
                res["teacher_forced_top1"] = teacher_forced_agreement(model, ids, tokens)
                row["gpt-fast"] = res
                break
            if errors:
                row.setdefault("gpt-fast", {})["errors"] = errors
        results.append(row)

    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "model": os.path.abspath(args.model),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight_bytes_per_step": wbytes,
        "copy_gbps": copy_gbps,
        "copy_bytes": copy_bytes,
        "copy_convention": "device-to-device copy_, (read + write bytes) / time, 1 GB = 1e9 bytes",
        "effective_gbps_convention": "weight bytes read per step (KV cache excluded) / ms_per_step",
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "reps": args.reps,
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")

    print(f"\n{report['device']}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{report['architecture']}, {wbytes / 1e9:.3f} GB weights/step, prompt {args.prompt_len}, "
          f"gen {args.gen_len}, {args.reps} reps; copy bandwidth {copy_gbps:.0f} GB/s (read+write)")
    print(f"{'batch':>5}  {'method':18} {'TTFT ms':>16} {'ms/step':>16} {'tok/s':>9} {'GB/s':>7} {'%copy':>6} {'TF-top1':>7}")
    for row in results:
        for name in ("hf-generate", "hf-generate-eager", "gpt-fast"):
            res = row.get(name)
            if res is None:
                continue
            if "ms_per_step" not in res:
                print(f"{row['batch']:>5}  {name:18} FAILED: {res['errors'][0][:90]}")
                continue
            ttft = res.get("ttft_ms")
            ttft = f"{ttft['mean']:8.2f} ± {ttft['std']:5.2f}" if ttft else "-"
            ms = res["ms_per_step"]
            tag = "" if res.get("fullgraph", True) else "  (fullgraph=False)"
            print(f"{row['batch']:>5}  {name:18} {ttft:>16} {ms['mean']:8.3f} ± {ms['std']:5.3f} "
                  f"{row['batch'] * 1e3 / ms['mean']:9.1f} {res['weights_gbps']:7.{0 if res['weights_gbps'] >= 100 else 2}f} {res['pct_of_copy']:5.1f}% {res['teacher_forced_top1']:7.3f}{tag}")


if __name__ == "__main__":
    main()
