"""GGUF files against the same weights in a Hugging Face folder, through rocket.

    python3 benches/gguf_gpu_check.py --ckpt DIR[,DIR...] --rocket BIN [--logits-at BIN] \
        [--device cuda|cpu] [--work DIR] [--steps 200] [--load-file OUT.gguf]

For each HF checkpoint folder (llama or qwen3; bf16/f16/f32 safetensors, tokenizer.json;
on the GPU machine the exact-shape random checkpoints of benches/make_checkpoint.py), the
`gguf` package (gguf==0.19.0; nothing of rocket's writes these files) writes, in WORK/NAME/:

- bf16.gguf: the checkpoint's weights as llama.cpp's convert_hf_to_gguf.py lays them out:
  matrices BF16 (bit for bit the checkpoint's bf16), norms F32, llama Q/K rows permuted
  (`LlamaModel.permute`), llama3 rope scaling as the `rope_freqs` tensor only (the
  converter's formula in float32), tokenizer.ggml.* metadata as the converter writes a
  gpt2-style BPE tokenizer (tokens with [PADn] up to the config's vocab_size, token types
  NORMAL/CONTROL/USER_DEFINED/UNUSED, merges, bos/eos/padding ids, add_bos_token, pre-tokenizer
  `llama-bpe` / `qwen2`, chat template).
- q4km.gguf: a Q4_K_M-like mix (token_embd and an untied output Q6_K; attn_v and ffn_down Q6_K
  in the layers where llama.cpp's Q4_K_M uses more bits, Q4_K elsewhere; every other matrix
  Q4_K; norms F32). gguf-py cannot quantize K-quants, so the blocks are raw: seeded random
  quant and sub-scale bytes with each block's f16 scale (and min scale) set from the float
  block's absolute maximum, so the weights keep the checkpoint's magnitudes. For llama it
  also carries `llama.rope.scaling.*` llama3 metadata next to `rope_freqs` (rocket then
  computes the frequencies as transformers does and checks the tensor against them).
- q4km-hf/: an HF folder of the same weights: every tensor written to q4km.gguf (the same
  arrays GGUFWriter wrote; gguf.GGUFReader would take minutes to parse a 150K-token vocabulary
  in Python), dequantized with gguf.quants.dequantize, llama Q/K un-permuted, stored
  as bf16 rounded to nearest even (as torch rounds) for --device cuda, where rocket
  dequantizes a GGUF to bf16, or as f32 for --device cpu, where it dequantizes to f32.

Then each pair (bf16.gguf, the checkpoint) and (q4km.gguf, q4km-hf) runs through rocket and
must agree:

- door (both devices): `rocket generate` greedy, EOS ignored, --logprobs 5 (the graph path
  on a GPU: logprobs leave the megakernel), on a text prompt, so the GGUF's tokenizer takes
  part: the prompt and generated ids must be equal and every printed logprob (4 decimals)
  equal, or within DOOR_BAR (1e-4 on the CPU, 2e-3 on a GPU) where the pair's rotary
  frequencies differ (below). 4 decimals cannot show every difference: the bitwise check
  below is the sharp one.
- megakernel (cuda): crates/rocket-core/examples/logits_at.rs `greedy` jobs: a seeded prompt
  prefilled, then batch-1 greedy decoding of --steps tokens in megakernel launches of up to
  128 steps (the batcher's), every step's logits kept. The tokens must be equal, the launches
  more than one, and the logits bitwise equal, or within MK_BAR of the row's RMS where the
  frequencies differ.
- path (cuda): `rocket bench` on the GGUF at batch 1, default options: its decode path must
  be "megakernel", and the run must decode every token.

Where bitwise equality is not expected: llama's bf16.gguf carries llama3 scaling only as
`rope_freqs`, f32 divisors of the base frequencies; from the HF config rocket computes the
scaled frequencies as transformers does. For Llama-3.2's 32 frequencies the two differ by one
ulp in the 3 of the smoothing band, so its logits may differ by rounding (the bars above); every
other pair has identical weights and frequencies and must match bit for bit.

--load-file writes tests/gguf/make_1b_q4_k_m.py's Llama-3.2-1B-shaped Q4_K_M file and prints
how long `rocket bench` takes to load it (Engine::load, ready to generate) on the device(s)
as GGUF-LOAD lines (report only; the target is <= 2 s on the GPU machine's 16 cores).

Prints PASS/FAIL per check and exits 1 when any failed. Needs numpy and the gguf package
(with its pyyaml import); no torch.
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as T
except ImportError as e:  # the GPU machine has no gguf: gpu_run.sh installs the carried wheel
    sys.exit(f"gguf_gpu_check: the gguf package (gguf==0.19.0) is needed: {e}")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gguf"))
from llama_cpp_layout import gguf_to_hf_name, hf_to_gguf_name, permute, random_kquant, unpermute, use_more_bits  # noqa: E402

HERE = Path(__file__).resolve().parent
# Printed logprobs (4 decimals), where frequencies differ by an ulp: the CPU computes in f32
# (one unit of the last digit), a GPU's graph path rounds activations and the KV cache to bf16.
DOOR_BAR = {"cpu": 1e-4, "cuda": 2e-3}
MK_BAR = 1e-2  # max |logit difference| / row RMS, where frequencies differ by an ulp
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea,"
FAILED = []


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)
    return ok


# ---- safetensors and bf16, in numpy --------------------------------------------------

ST_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


def read_safetensors(folder):
    """{name: (dtype name, memory-mapped array)} of a checkpoint folder (model.safetensors or
    its shards); bf16 tensors are uint16 bits."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for name in files:
        raw = np.memmap(folder / name, dtype=np.uint8, mode="r")
        n = int(raw[:8].view("<u8")[0])
        header = json.loads(bytes(raw[8:8 + n]))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out[key] = (info["dtype"], np.asarray(raw[8 + n + a:8 + n + b]).view(ST_DTYPES[info["dtype"]]).reshape(info["shape"]))
    return out


def as_f32(tensor):
    dtype, data = tensor
    return bf16_to_f32(data) if dtype == "BF16" else data.astype(np.float32)


def as_bf16(tensor):
    dtype, data = tensor
    return data if dtype == "BF16" else f32_to_bf16(data.astype(np.float32))


def parallel(fn, items):
    """fn over items on every core (numpy releases the GIL in the heavy parts)."""
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return list(pool.map(fn, items))


def write_safetensors(path, tensors):
    """tensors: {name: float32 array or ("BF16", uint16 array)}."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        dtype, arr = t if isinstance(t, tuple) else ("F32", np.ascontiguousarray(t, dtype=np.float32))
        blob = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """Round to nearest even, as torch's .to(torch.bfloat16) (NaNs stay quiet NaNs)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = b >> 16
    r &= 1
    r += 0x7FFF
    r += b  # wraps only for NaNs, fixed below
    r >>= 16
    out = r.astype(np.uint16)
    if np.isnan(x).any():
        nan = (b & 0x7FFFFFFF) > 0x7F800000
        out[nan] = ((b[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def check_bf16_rounding():
    """f32_to_bf16 against gguf-py's bf16 quantizer, and torch's rounding where torch is
    installed, on ties, subnormals, infinities, NaNs and random values."""
    bits = np.concatenate([np.random.default_rng(7).integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32),
                           np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x00008000, 0x00018000, 0x7F7FFFFF, 0x7F7F8000,
                                     0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x80000000], np.uint32)])
    x = bits.view(np.float32)
    ours = f32_to_bf16(x)
    theirs = gguf.quants.quantize(x, T.BF16).view(np.uint16).reshape(-1)
    finite = np.isfinite(x)  # gguf-py and torch keep different NaN payloads
    ok = np.array_equal(ours[finite], theirs[finite]) and bool(np.isnan(bf16_to_f32(ours[~np.isfinite(x) & np.isnan(x)])).all())
    try:
        import torch
        ok = ok and np.array_equal(ours[finite], torch.from_numpy(x[finite]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
        against = "gguf-py and torch"
    except ImportError:
        against = "gguf-py"
    if not ok:
        raise SystemExit(f"f32_to_bf16 disagrees with {against}")
    log(f"bf16 rounding agrees with {against} on {len(x)} values")


# ---- llama.cpp's converter -------------------------------------------------------------

def rope_freqs(head_dim, theta, rope):
    """`LlamaModel.generate_extra_tensors`: llama3 per-frequency divisors, in float32 as the
    converter computes them (torch float32 there, numpy float32 here: numpy's pow can be one
    ulp off torch's, not for Llama-3.2-1B's or Llama-3.1-8B's frequencies, so this stays
    apart from make_fixtures.py's torch copy; see llama_cpp_layout.py)."""
    f32 = np.float32
    freqs = f32(1.0) / (f32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / f32(head_dim)))
    factor, low, high = f32(rope["factor"]), f32(rope.get("low_freq_factor", 1.0)), f32(rope.get("high_freq_factor", 4.0))
    old = f32(rope["original_max_position_embeddings"])
    lo_w, hi_w = old / low, old / high
    out = []
    for freq in freqs:
        w = f32(2 * math.pi) / freq
        if w < hi_w:
            out.append(f32(1))
        elif w > lo_w:
            out.append(factor)
        else:
            smooth = (old / w - low) / (high - low)
            out.append(f32(1) / ((f32(1) - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def looks_special(token):
    """convert_hf_to_gguf.py `does_token_look_special`."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>")) or (token.startswith("<unused") and token.endswith(">")))


def adds_bos(post_processor):
    """Whether tokenizer.json's post-processor puts a special token before a single sequence."""
    if not post_processor:
        return False
    if post_processor.get("type") == "Sequence":
        return any(adds_bos(p) for p in post_processor.get("processors", []))
    if post_processor.get("type") == "TemplateProcessing":
        single = post_processor.get("single") or []
        return bool(single) and "SpecialToken" in single[0]
    return False


class Tokenizer:
    """tokenizer.ggml.* as the converter writes a gpt2-style BPE tokenizer (`get_vocab_base`,
    gguf.SpecialVocab)."""

    def __init__(self, folder, cfg):
        folder = Path(folder)
        tj = json.loads((folder / "tokenizer.json").read_text())
        tc_path = folder / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
        assert tj["model"]["type"] == "BPE", "only byte-level BPE tokenizers"
        vocab = dict(tj["model"]["vocab"])
        added = {a["content"]: a for a in tj.get("added_tokens", [])}
        for a in added.values():
            vocab[a["content"]] = a["id"]
        reverse = {i: t for t, i in vocab.items()}
        self.tokens, self.types = [], []
        for i in range(cfg["vocab_size"]):
            t = reverse.get(i)
            if t is None:
                self.tokens.append(f"[PAD{i}]")
                self.types.append(gguf.TokenType.UNUSED)
            elif t in added:
                self.tokens.append(t)
                self.types.append(gguf.TokenType.CONTROL if added[t]["special"] or looks_special(t) else gguf.TokenType.USER_DEFINED)
            else:
                self.tokens.append(t)
                self.types.append(gguf.TokenType.NORMAL)
        self.merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]

        def token_id(key):
            v = tc.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            return vocab.get(v) if isinstance(v, str) else None

        def first(v):
            return v[0] if isinstance(v, list) else v

        self.bos = token_id("bos_token")
        if self.bos is None:
            self.bos = first(cfg.get("bos_token_id"))
        self.eos = token_id("eos_token")
        if self.eos is None:
            self.eos = first(cfg.get("eos_token_id"))
        self.pad = token_id("pad_token")
        # SpecialVocab: the post-processor's template, overridden by an explicit add_bos_token.
        self.add_bos = tc["add_bos_token"] if isinstance(tc.get("add_bos_token"), bool) else adds_bos(tj.get("post_processor"))
        template = folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.exists() else tc.get("chat_template")
        self.eot = vocab.get("<|eot_id|>")

    def write(self, w, arch):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        w.add_token_merges(self.merges)
        if self.bos is not None:
            w.add_bos_token_id(self.bos)
        if self.eos is not None:
            w.add_eos_token_id(self.eos)
        if self.eot is not None:
            w.add_eot_token_id(self.eot)
        if self.pad is not None:
            w.add_pad_token_id(self.pad)
        w.add_add_bos_token(self.add_bos)
        if isinstance(self.chat_template, str):
            w.add_chat_template(self.chat_template)


# ---- writing the GGUFs --------------------------------------------------------------

def q4km_type(name, layers):
    if name in ("token_embd.weight", "output.weight"):
        return T.Q6_K
    part = name.split(".")[2]
    if part in ("attn_v", "ffn_down") and use_more_bits(int(name.split(".")[1]), layers):
        return T.Q6_K
    return T.Q4_K


def write_gguf(path, cfg, tok, weights, quantized, llama3_meta, seed):
    """weights: read_safetensors' tensors. Returns {GGUF name: (type, what was written)}."""
    arch = cfg["model_type"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(Path(path).stem)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if quantized else gguf.LlamaFileType.MOSTLY_BF16)
    tok.write(w, arch)
    rope = cfg.get("rope_scaling") or {}
    llama3 = arch == "llama" and rope.get("rope_type", rope.get("type")) == "llama3"
    if llama3 and llama3_meta:
        w.add_string(f"{arch}.rope.scaling.type", "llama3")
        w.add_float32(f"{arch}.rope.scaling.factor", float(rope["factor"]))
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", int(rope["original_max_position_embeddings"]))
        w.add_float32(f"{arch}.rope.scaling.low_freq_factor", float(rope.get("low_freq_factor", 1.0)))
        w.add_float32(f"{arch}.rope.scaling.high_freq_factor", float(rope.get("high_freq_factor", 4.0)))

    def encode(item):
        index, name = item
        g = hf_to_gguf_name(name)
        if weights[name][1].ndim == 1:
            return g, T.F32, np.ascontiguousarray(as_f32(weights[name]))
        x = as_f32(weights[name]) if quantized else as_bf16(weights[name])
        if arch == "llama" and name.endswith("q_proj.weight"):
            x = permute(x, heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            x = permute(x, kv)
        if not quantized:
            return g, T.BF16, np.ascontiguousarray(x)
        qtype = q4km_type(g, cfg["num_hidden_layers"])
        return g, qtype, random_kquant(x, qtype, np.random.default_rng([seed, index]))

    written = {}
    for g, qtype, data in parallel(encode, list(enumerate(sorted(weights)))):
        w.add_tensor(g, data, raw_dtype=None if qtype == T.F32 else qtype)
        written[g] = (qtype, data)
    if llama3:
        factors = rope_freqs(head_dim, float(cfg["rope_theta"]), rope)
        w.add_tensor("rope_freqs.weight", factors)
        written["rope_freqs.weight"] = (T.F32, factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def hf_copy_of_gguf(written, ckpt, out, cfg, bf16):
    """An HF folder holding the tensors write_gguf wrote (its `written`) as gguf-py
    dequantizes them, llama Q/K un-permuted; bf16 (rounded to nearest even) or f32."""
    arch = cfg["model_type"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out.mkdir(parents=True, exist_ok=True)

    def decode(g):
        qtype, data = written[g]
        x = gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)
        name = gguf_to_hf_name(g)
        if arch == "llama" and name.endswith("q_proj.weight"):
            x = unpermute(x, heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            x = unpermute(x, kv)
        return name, ("BF16", f32_to_bf16(x)) if bf16 else np.ascontiguousarray(x)

    tensors = dict(parallel(decode, [g for g in written if g != "rope_freqs.weight"]))
    write_safetensors(out / "model.safetensors", tensors)
    for f in sorted(Path(ckpt).iterdir()):
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json" and not f.name.startswith("."):
            shutil.copy(f, out / f.name)
    return len(tensors)


# ---- running rocket ---------------------------------------------------------------------

def run(cmd, timeout=600):
    t = time.time()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    log(f"  {time.time() - t:5.1f} s  {' '.join(str(c) for c in cmd)[:160]}")
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r


LOGPROB_LINE = re.compile(r"^\s*(\d+)\s+(-?[\d.]+|-inf|NaN)\s+.*\[(.*)\]\s*$")


def door(rocket, model, device, steps):
    """`rocket generate` greedy with logprobs: (ids, [(logprob, [(id, lp), ...])])."""
    r = run([rocket, "generate", "--model", model, "--device", device, "--max-seq-len", "512", "--progress", "off", "-t", "0", "--ignore-eos",
             "--keep-special-tokens", "--logprobs", "5", "-n", steps, PROMPT])
    ids, lps = [], []
    for line in r.stderr.splitlines():
        m = LOGPROB_LINE.match(line)
        if m:
            ids.append(int(m.group(1)))
            top = [(int(a), float(b)) for a, b in (p.split(":") for p in m.group(3).split())]
            lps.append((float(m.group(2)), top))
    if len(ids) != steps:
        raise RuntimeError(f"expected {steps} logprob lines from rocket generate, got {len(ids)}:\n{r.stderr[-2000:]}")
    return ids, lps


def compare_door(name, a, b, exact, device):
    (ids_a, lp_a), (ids_b, lp_b) = a, b
    if ids_a != ids_b:
        first = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y) if len(ids_a) == len(ids_b) else -1
        return check(name, False, f"generated ids differ from step {first}: {ids_a[:first + 3]} vs {ids_b[:first + 3]}")
    worst = 0.0
    for (la, ta), (lb, tb) in zip(lp_a, lp_b):
        if [i for i, _ in ta] != [i for i, _ in tb]:
            return check(name, False, f"top-5 ids differ: {ta} vs {tb}")
        # In units of the printed last digit (-3.5985 vs -3.5986 is one unit, not 1.00000000001e-4).
        worst = max([worst, abs(round(la * 1e4) - round(lb * 1e4)) / 1e4]
                    + [abs(round(x * 1e4) - round(y * 1e4)) / 1e4 for (_, x), (_, y) in zip(ta, tb)])
    bar = 0.0 if exact else DOOR_BAR[device]
    return check(name, worst <= bar, f"{len(ids_a)} greedy ids equal, top-5 logprobs max |diff| {worst:.1e} (bar {bar:g})")


def megakernel_greedy(logits_at, model, work, prompt, steps):
    """logits_at's `greedy` job: (tokens, logits [steps][vocab], launches)."""
    ids = work / "prompt.u32"
    np.asarray(prompt, dtype="<u4").tofile(ids)
    out = work / f"greedy-{Path(model).name}.npy"
    jobs = work / "jobs.json"
    jobs.write_text(json.dumps([{"ids": str(ids), "steps": steps, "path": "greedy", "out": str(out)}]))
    r = run([logits_at, model, jobs])
    line = json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])
    logits = np.load(out)
    out.unlink()
    return line["generated"], logits, line["launches"]


def compare_megakernel(name, a, b, exact, steps):
    (ta, la, na), (tb, lb, nb) = a, b
    if ta != tb:
        first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        return check(name, False, f"greedy tokens differ from step {first}: {ta[first:first + 4]} vs {tb[first:first + 4]}")
    if len(ta) != steps or na != nb or na < 2 or la.shape != lb.shape or la.dtype != np.float32 or lb.dtype != np.float32:
        return check(name, False, f"{len(ta)} tokens (want {steps}), {na} and {nb} megakernel launches (want the same, >= 2), "
                                  f"logits {la.shape} {la.dtype} and {lb.shape} {lb.dtype}")
    if not (np.isfinite(la).all() and np.isfinite(lb).all()):
        return check(name, False, "logits not finite")
    rows_equal = int((la.view(np.uint32) == lb.view(np.uint32)).all(axis=1).sum())
    same = rows_equal == len(la)
    rel = float((np.abs(la - lb).max(axis=1) / np.sqrt((lb.astype(np.float64) ** 2).mean(axis=1))).max())
    return check(name, same if exact else rel <= MK_BAR,
                 f"{len(ta)} greedy tokens equal over {na} megakernel launches; logits "
                 f"{'bitwise equal' if same else f'{rows_equal}/{len(la)} rows bitwise equal, max |diff|/RMS {rel:.1e}'}"
                 f" ({'bitwise required' if exact else f'bar {MK_BAR:g}'})")


def bench(rocket, model, device, gen, work, tag):
    out = work / f"bench-{tag}.json"
    run([rocket, "bench", "--model", model, "--device", device, "--batch", "1", "--prompt-len", "16", "--gen-len", gen,
         "--reps", "1", "--max-seq-len", "512", "--progress", "off", "--json", out])
    return json.loads(out.read_text())


# ---- main ---------------------------------------------------------------------------------

def check_checkpoint(ckpt, args):
    ckpt = Path(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    arch = cfg["model_type"]
    if arch not in ("llama", "qwen3"):
        raise SystemExit(f"{ckpt}: model_type {arch!r} (llama or qwen3 only)")
    name = ckpt.name
    work = Path(args.work) / name
    work.mkdir(parents=True, exist_ok=True)
    t = time.time()
    weights = read_safetensors(ckpt)
    ragged = sorted(k for k, (_, x) in weights.items() if x.ndim == 2 and x.shape[1] % 256)
    if ragged:
        raise SystemExit(f"{ckpt}: K-quant rows are whole 256-element blocks; {ragged[0]} has {weights[ragged[0]][1].shape[1]} columns")
    tok = Tokenizer(ckpt, cfg)
    bf16_gguf, q_gguf, q_hf = work / "bf16.gguf", work / "q4km.gguf", work / "q4km-hf"
    write_gguf(bf16_gguf, cfg, tok, weights, quantized=False, llama3_meta=False, seed=args.seed)
    written = write_gguf(q_gguf, cfg, tok, weights, quantized=True, llama3_meta=True, seed=args.seed)
    del weights
    hf_copy_of_gguf(written, ckpt, q_hf, cfg, bf16=args.device == "cuda")
    types = [t.name for t, _ in written.values()]
    counts = {k: types.count(k) for k in sorted(set(types))}
    del written
    log(f"{name}: wrote {bf16_gguf.stat().st_size / 1e9:.2f} GB bf16, {q_gguf.stat().st_size / 1e9:.2f} GB Q4_K_M-like {counts}, "
        f"and its dequantized HF copy in {time.time() - t:.1f} s")

    rope = cfg.get("rope_scaling") or {}
    ulp_rope = arch == "llama" and rope.get("rope_type", rope.get("type")) == "llama3"
    pairs = [("bf16", bf16_gguf, ckpt, not ulp_rope), ("q4km", q_gguf, q_hf, True)]
    for tag, g, hf, exact in pairs:
        label = f"{name} {tag}.gguf vs {Path(hf).name}"
        try:
            compare_door(f"gguf door {label}", door(args.rocket, g, args.device, args.door_steps),
                         door(args.rocket, hf, args.device, args.door_steps), exact, args.device)
            if args.device != "cuda":
                continue
            vocab = cfg["vocab_size"]
            prompt = np.random.default_rng(args.seed).integers(0, vocab * 9 // 10, args.prompt_len).tolist()
            compare_megakernel(f"gguf megakernel {label}", megakernel_greedy(args.logits_at, g, work, prompt, args.steps),
                               megakernel_greedy(args.logits_at, hf, work, prompt, args.steps), exact, args.steps)
            report = bench(args.rocket, g, "cuda", args.steps, work, tag)
            path = report["results"][0]["decode_path"]
            check(f"gguf path {g.name} ({name})", path == "megakernel",
                  f"rocket bench's batch-1 greedy decode path {path!r}, {args.steps} tokens; load {report['load_seconds']:.2f} s")
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            check(f"gguf {label}", False, str(e))
    if not args.keep:
        for p in (bf16_gguf, q_gguf):
            p.unlink()
        shutil.rmtree(q_hf)


def load_time(args):
    path = Path(args.load_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    t = time.time()
    subprocess.run([sys.executable, str(HERE.parent / "tests/gguf/make_1b_q4_k_m.py"), str(path)], check=True)
    log(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.time() - t:.1f} s")
    for device in args.load_devices.split(","):
        try:
            r = bench(args.rocket, path, device, 2, path.parent, f"load-{device}")
            s = r["load_seconds"]
            print(f"GGUF-LOAD {path.name} device={device} ready {s:.2f} s (Engine::load: dequantize to "
                  f"{'bf16' if device == 'cuda' else 'f32'}, backend up; {os.cpu_count()} cores; target <= 2 s on cuda)", flush=True)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            check(f"gguf load {device}", False, str(e))
    if not args.keep:
        path.unlink()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default="", help="HF checkpoint folders, comma separated")
    ap.add_argument("--rocket", required=True, help="the rocket CLI")
    ap.add_argument("--logits-at", help="crates/rocket-core/examples/logits_at (needed with --device cuda)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--work", default="/tmp/rocket-gguf-check")
    ap.add_argument("--steps", type=int, default=200, help="megakernel greedy tokens (>128: more than one launch)")
    ap.add_argument("--door-steps", type=int, default=24, help="tokens of the rocket generate comparison")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-file", help="write the 1B Q4_K_M timing file here and report its load time")
    ap.add_argument("--load-devices", default="cuda,cpu")
    ap.add_argument("--keep", action="store_true", help="keep the written files")
    args = ap.parse_args()
    if args.device == "cuda" and not args.logits_at:
        ap.error("--device cuda needs --logits-at")
    check_bf16_rounding()
    for ckpt in filter(None, args.ckpt.split(",")):
        check_checkpoint(ckpt, args)
    if args.load_file:
        load_time(args)
    if FAILED:
        print(f"FAIL: {len(FAILED)} GGUF check(s) failed: {', '.join(FAILED)}")
        sys.exit(1)
    print("PASS: every GGUF check passed")


if __name__ == "__main__":
    main()
