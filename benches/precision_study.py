"""How far bf16 prefill arithmetic moves each fuel's logits from the fp32 reference.

    python benches/precision_study.py [--fuels llama-3.2-1b,...] [--tokens 256] [--seed 0] [--modes kv,kv+act16,...]

Runs on the CPU with torch and transformers. Each fuel is built in memory with the
exact shapes and the seeded random weights of `benches/make_checkpoint.py` (bf16
values held in fp32), and one prompt of random token ids is run teacher-forced under
arithmetic that emulates what a GPU prefill path rounds:

- `kv`: the KV cache stored in bf16 (what every rocket GPU path does today: with
  activations split into bf16 hi + lo parts and hi/lo attention operands, the rest is
  within ~2^-16 of fp32);
- `kv+act`: also every matrix product's input activation rounded to bf16 (cuBLASLt or a
  wgmma GEMM on bf16 activations alone, fp32 accumulation); `kv+act[qkv]`, `[o]`,
  `[gate_up]`, `[down]`, `[lm_head]`: only that product's input;
- `kv+attn`: also the attention's query and probabilities rounded to bf16 before their
  products (FlashAttention-style bf16 operands; the scores' softmax stays fp32);
- `kv+act+attn`: both;
- `kv+act16`, `kv+attn16`, `kv+act16+attn16`: the same roundings to fp16 instead of bf16
  (an fp16 tensor-core product: 11 significant bits instead of 8, at the same rate). The
  matrix products' weights are rounded to fp16 too (bf16 weights convert exactly but for
  magnitudes below fp16's normal range), as are the attention's keys and values;
- `kv+act16+attn`: fp16 products with bf16 attention operands (bf16 queries and weights
  against the bf16 cache: no conversion of the keys and values).

Per mode it prints the logits' relative L2 distance from the fp32 run (over every
position, and the worst position) and the share of positions whose top-1 token agrees.
The CUDA tests' bar is 1e-2 relative L2 at every fuel. Random weights: no outlier
features, so real checkpoints may round worse; the numbers rank the modes, they do not
prove a real model's bar.
"""

import argparse
import importlib.util
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

HERE = os.path.dirname(os.path.abspath(__file__))


def load_make_checkpoint():
    spec = importlib.util.spec_from_file_location("make_checkpoint", os.path.join(HERE, "make_checkpoint.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rounded(x, dtype):
    return x.to(dtype).to(x.dtype)


class Rounding:
    """Which operands the emulated GPU rounds (read by the hooks below): `act` is the set
    of products whose input activations are rounded to `act_dtype`; `attn` rounds the
    attention's operands to `attn_dtype`."""

    kv = False
    act = frozenset()
    act_dtype = torch.bfloat16
    attn = False
    attn_dtype = torch.bfloat16


PRODUCTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down", "lm_head": "lm_head"}


def emulated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal GQA attention with the rounding of `Rounding`; fp32 scores and softmax."""
    if Rounding.kv:
        key, value = rounded(key, torch.bfloat16), rounded(value, torch.bfloat16)
    if Rounding.attn:
        query = rounded(query, Rounding.attn_dtype)
        key, value = rounded(key, Rounding.attn_dtype), rounded(value, Rounding.attn_dtype)
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if Rounding.attn:
        # FlashAttention rounds e^(s - m) before P·V and divides by the fp32 sum
        # after: the same relative rounding as rounding the normalised row.
        probs = rounded(probs, Rounding.attn_dtype)
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), probs


def emulated_linear(module, x):
    """A Linear's forward with the operands `Rounding` asks for (bf16 weights are bf16 already)."""
    weight = module.weight
    if module.rocket_product in Rounding.act:
        x = rounded(x, Rounding.act_dtype)
        if Rounding.act_dtype != torch.bfloat16:
            weight = rounded(weight, Rounding.act_dtype)
    return torch.nn.functional.linear(x, weight, module.bias)


def build(fuel, seed, mc):
    cfg_dict, _ = mc.FUELS[fuel]
    cfg = AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype")})
    cfg._attn_implementation = "rocket_emulated"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = cfg_dict["hidden_size"]
    params = dict(model.named_parameters())
    for name, shape, kind in mc.tensor_specs(cfg_dict):
        t = mc.random_tensor(shape, kind, gen, "cpu", hidden).to(torch.float32)
        with torch.no_grad():
            params[name].copy_(t)
    model.tie_weights()
    model.eval()
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.rocket_product = PRODUCTS[name.rsplit(".", 1)[-1]]
            m.forward = emulated_linear.__get__(m)
    return model, cfg_dict["vocab_size"]


ALL = frozenset(PRODUCTS.values())
BF16, FP16 = torch.bfloat16, torch.float16
# (name, bf16 KV, products with rounded inputs, their format, rounded attention operands, their format)
MODES = [
    ("fp32", False, frozenset(), BF16, False, BF16),
    ("kv", True, frozenset(), BF16, False, BF16),
    ("kv+act", True, ALL, BF16, False, BF16),
    ("kv+attn", True, frozenset(), BF16, True, BF16),
    ("kv+act+attn", True, ALL, BF16, True, BF16),
    ("kv+act16", True, ALL, FP16, False, BF16),
    ("kv+attn16", True, frozenset(), BF16, True, FP16),
    ("kv+act16+attn16", True, ALL, FP16, True, FP16),
    ("kv+act16+attn", True, ALL, FP16, True, BF16),
] + [(f"kv+act[{p}]", True, frozenset([p]), BF16, False, BF16) for p in ("qkv", "o", "gate_up", "down", "lm_head")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fuels", default="smollm2-135m,qwen3-0.6b,llama-3.2-1b,qwen3-1.7b")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(m[0] for m in MODES[1:]), help="modes to run besides fp32, comma-separated")
    args = ap.parse_args()
    mc = load_make_checkpoint()
    fuels = args.fuels.split(",")
    unknown = [f for f in fuels if f not in mc.FUELS]
    if unknown:
        ap.error(f"unknown fuel(s) {', '.join(unknown)}; choose from {', '.join(sorted(mc.FUELS))}")
    names, asked = [m[0] for m in MODES[1:]], args.modes.split(",")
    bad = [m for m in asked if m not in names]
    if bad:
        ap.error(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(names)}")
    modes = [MODES[0]] + [m for m in MODES[1:] if m[0] in asked]
    if args.tokens < 1:
        ap.error(f"--tokens must be at least 1, got {args.tokens}")
    ALL_ATTENTION_FUNCTIONS.register("rocket_emulated", emulated_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("rocket_emulated", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    rows = []
    for fuel in fuels:
        t0 = time.time()
        model, vocab = build(fuel, args.seed, mc)
        ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed + 7))
        ref = None
        for mode, kv, act, act_dtype, attn, attn_dtype in modes:
            Rounding.kv, Rounding.act, Rounding.act_dtype = kv, act, act_dtype
            Rounding.attn, Rounding.attn_dtype = attn, attn_dtype
            with torch.no_grad():
                logits = model(ids, use_cache=False).logits[0]
            if ref is None:
                ref = logits  # fp32, the first mode
                continue
            # Per position in float64, a slice at a time (a long prompt's logits are GBs).
            diff2, ref2, agree = [], [], 0
            for lo in range(0, ref.shape[0], 256):
                r, g = ref[lo : lo + 256].double(), logits[lo : lo + 256].double()
                diff2.append(((g - r) ** 2).sum(-1))
                ref2.append((r**2).sum(-1))
                agree += (g.argmax(-1) == r.argmax(-1)).sum().item()
            diff2, ref2 = torch.cat(diff2), torch.cat(ref2)
            whole = (diff2.sum() / ref2.sum()).sqrt().item()
            worst = (diff2 / ref2).sqrt().max().item()
            top1 = agree / ref.shape[0]
            rows.append((fuel, mode, whole, worst, top1))
            print(f"{fuel:14s} {mode:15s} rel L2 {whole:.2e}  worst position {worst:.2e}  top-1 {100 * top1:6.2f}%", flush=True)
            del logits
        print(f"{fuel}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        del model, ref
    print()
    print(f"| fuel | mode | logits rel L2 ({args.tokens} positions) | worst position | top-1 agreement |")
    print("|---|---|---:|---:|---:|")
    for fuel, mode, whole, worst, top1 in rows:
        print(f"| {fuel} | {mode} | {whole:.2e} | {worst:.2e} | {100 * top1:.2f}% |")


if __name__ == "__main__":
    main()
