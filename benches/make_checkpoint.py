"""Write an exact-shape Hugging Face checkpoint of a rocket fuel with seeded random weights.

    python benches/make_checkpoint.py --fuel llama-3.2-1b --tokenizer-dir TOKDIR --out DIR \
        [--seed 0] [--device cuda|cpu]

Real checkpoints cannot travel to the GPU machine (a 1B bf16 model is 2.5 GB), and memory-bound
decode speed does not depend on the weight values, so benchmarks run on checkpoints that have
the real models' architecture and tensor shapes but random weights:

- config.json: the architecture fields of the real model's config (as published; written out
  below), torch_dtype bfloat16, plus a "rocket_random_checkpoint" note; generation_config.json
  as the real (instruct) model's.
- model.safetensors: bf16 tensors with the HF names and shapes (tied models have no lm_head).
  Values come from one torch.Generator seeded by --seed, drawn tensor by tensor on --device in
  a fixed order, so the same fuel+seed+device gives the same bytes. Scales keep a forward pass
  well conditioned: linear weights N(0, 1/in_features) so every projection of a unit-RMS input
  is O(1); embeddings N(0, 1/hidden) so the tied LM head gives logits of std ~1; norm weights
  1 + 0.1 N(0,1).
- the tokenizer files from --tokenizer-dir (made by benches/export_tokenizers.py).

A marker file (.rocket_checkpoint.json) records fuel, seed and device; when it matches, the
weights are not generated again (the config and tokenizer files are still rewritten).
"""

import argparse
import json
import os
import shutil
import sys
import time

import torch
from safetensors.torch import save_file

_LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "mlp_bias": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}

_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

_QWEN3_GENERATION = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}

# fuel -> (config.json, generation_config.json), as the real models publish them.
FUELS = {
    "llama-3.2-1b": (
        {
            **_LLAMA_COMMON,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
            "head_dim": 64,
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 8192,
            "max_position_embeddings": 131072,
            "num_attention_heads": 32,
            "num_hidden_layers": 16,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5,
            "rope_scaling": {
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "vocab_size": 128256,
        },
        {
            "bos_token_id": 128000,
            "do_sample": True,
            "eos_token_id": [128001, 128008, 128009],
            "temperature": 0.6,
            "top_p": 0.9,
        },
    ),
    "qwen3-0.6b": (
        {**_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072},
        _QWEN3_GENERATION,
    ),
    "qwen3-1.7b": (
        {**_QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144},
        _QWEN3_GENERATION,
    ),
    # SmolLM2's config does not state head_dim: it is derived (576 / 9 = 64).
    "smollm2-135m": (
        {
            **_LLAMA_COMMON,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
            "hidden_size": 576,
            "initializer_range": 0.041666666666666664,
            "intermediate_size": 1536,
            "max_position_embeddings": 8192,
            "num_attention_heads": 9,
            "num_hidden_layers": 30,
            "num_key_value_heads": 3,
            "rms_norm_eps": 1e-5,
            "rope_scaling": None,
            "rope_theta": 100000,
            "vocab_size": 49152,
        },
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
    ),
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MARKER = ".rocket_checkpoint.json"


def tensor_specs(cfg):
    """(name, shape, kind) in HF order; kind is 'embed', 'norm' or 'linear'."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    specs = [("model.embed_tokens.weight", (vocab, h), "embed")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (heads * hd, h), "linear"),
            (p + "self_attn.k_proj.weight", (kv * hd, h), "linear"),
            (p + "self_attn.v_proj.weight", (kv * hd, h), "linear"),
            (p + "self_attn.o_proj.weight", (h, heads * hd), "linear"),
        ]
        if cfg["model_type"] == "qwen3":
            specs += [(p + "self_attn.q_norm.weight", (hd,), "norm"), (p + "self_attn.k_norm.weight", (hd,), "norm")]
        specs += [
            (p + "post_attention_layernorm.weight", (h,), "norm"),
            (p + "mlp.gate_proj.weight", (inter, h), "linear"),
            (p + "mlp.up_proj.weight", (inter, h), "linear"),
            (p + "mlp.down_proj.weight", (h, inter), "linear"),
        ]
    specs.append(("model.norm.weight", (h,), "norm"))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (vocab, h), "linear"))
    return specs


def random_tensor(shape, kind, gen, device, hidden):
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if kind == "norm":
        x.mul_(0.1).add_(1.0)
    elif kind == "embed":
        x.mul_(hidden**-0.5)
    else:
        x.mul_(shape[1] ** -0.5)
    return x.to(torch.bfloat16).cpu()


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fuel", required=True, choices=sorted(FUELS))
    ap.add_argument("--tokenizer-dir", required=True, help="folder with tokenizer.json and tokenizer_config.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    config, generation = FUELS[args.fuel]
    config = {**config, "rocket_random_checkpoint": {"fuel": args.fuel, "seed": args.seed}}
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "config.json"), config)
    write_json(os.path.join(args.out, "generation_config.json"), generation)

    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(args.tokenizer_dir, name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(args.out, name))
            copied.append(name)
    if "tokenizer.json" not in copied:
        sys.exit(f"no tokenizer.json in {args.tokenizer_dir}")

    marker = {"fuel": args.fuel, "seed": args.seed, "device": torch.device(args.device).type}
    marker_path = os.path.join(args.out, MARKER)
    weights_path = os.path.join(args.out, "model.safetensors")
    specs = tensor_specs(config)
    n_params = sum(torch.Size(s).numel() for _, s, _ in specs)
    try:
        with open(marker_path) as f:
            have = json.load(f)
    except (OSError, ValueError):
        have = None
    if have == marker and os.path.exists(weights_path) and os.path.getsize(weights_path) > 2 * n_params:
        print(f"{args.out}: {args.fuel} seed {args.seed} already there, weights not regenerated")
    else:
        if os.path.exists(marker_path):
            os.remove(marker_path)
        t0 = time.perf_counter()
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        tensors = {
            name: random_tensor(shape, kind, gen, args.device, config["hidden_size"]) for name, shape, kind in specs
        }
        t1 = time.perf_counter()
        save_file(tensors, weights_path, metadata={"format": "pt"})
        del tensors
        t2 = time.perf_counter()
        write_json(marker_path, marker)
        print(f"{args.out}: generated {len(specs)} tensors on {args.device} in {t1 - t0:.1f} s, saved in {t2 - t1:.1f} s")

    total = 0
    for name in sorted(os.listdir(args.out)):
        size = os.path.getsize(os.path.join(args.out, name))
        total += size
        print(f"  {name:32s} {size:>15,d} bytes")
    print(f"  {'total':32s} {total:>15,d} bytes ({n_params:,d} parameters, fuel {args.fuel}, seed {args.seed})")


if __name__ == "__main__":
    main()
