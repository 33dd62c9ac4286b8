"""Write tiny Llama-3 and Qwen3 GGUF checkpoints with other people's tools, and the
reference logits of Hugging Face transformers loading those same files.

Nothing here uses rocket. The checkpoints are built in three steps:

1. Hugging Face classes (`LlamaForCausalLM` with llama3 rope scaling, `Qwen3ForCausalLM`)
   with seeded random weights: hidden 256, intermediate 256, 2 layers, a 276-token
   byte-level BPE vocabulary, so every matrix row is a whole number of 256-element
   K-quant blocks. The llama3 scaling (theta 1e4, head_dim 64, original context 256,
   low/high frequency factors 1/4, factor 8) puts 4 of the 32 rotary frequencies in the
   smoothing band between the high- and low-frequency wavelengths (64 and 256); the
   script checks that from the wavelengths before writing anything.
2. The `gguf` package's `GGUFWriter` (gguf==0.19.0) writes the files the way llama.cpp's
   convert_hf_to_gguf.py lays them out: its metadata key names, Q/K rows permuted for
   llama (`LlamaModel.permute`) and stored as-is for qwen3, norms in F32, and llama3
   scaling as the `rope_freqs` tensor of per-frequency divisors computed by the
   converter's formula. (The converter reads `original_max_position_embeddings` from the
   top level of config.json with a default of 8192, which is the right value for every
   real Llama-3.x; here the value in rope_scaling, 256, is used so the file matches the
   HF model it came from.)
3. Tensor types. Each file mixes types over its matrices, as llama.cpp's Q4_K_M mixes
   Q4_K and Q6_K, so four small files cover every type rocket reads: F32, F16 and BF16
   are written from the float weights; Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 with
   `gguf.quants.quantize` (the package's port of ggml's reference quantizers). gguf-py
   can only dequantize Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS, so those are written as
   raw blocks of the right type (`raw_dtype`): seeded random quant and sub-scale bytes,
   with each block's f16 super-scale(s) set from the absolute maximum of the float
   weights in that block, so the dequantized weights have the float weights' magnitude
   (they are not an approximation of them; the reference below reads the same blocks).

The reference: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)`,
which dequantizes every tensor with gguf-py and undoes the llama Q/K permutation, run
teacher-forced over an 80-token prompt. transformers does not read llama's `rope_freqs`
tensor (its GGUF loader maps no llama3 scaling), so for the llama files the model's
rotary embedding is rebuilt from the HF config's llama3 `rope_scaling` (transformers'
own llama3 implementation) after loading; the weights are still the ones transformers
read from the GGUF. For the float tensors the script also checks that what transformers
read from the GGUF is the HF model's weight (bit for bit for F32, within f16/bf16
rounding otherwise).

Outputs in tests/gguf/fixtures/: NAME.gguf, NAME.logits.bin (little-endian f32, tokens ×
vocab) and NAME.json (prompt ids, shapes, types per tensor, how transformers' GGUF tokenizer
encodes a sample text, versions).
Run: python tests/gguf/make_fixtures.py   (needs torch, transformers, gguf==0.19.0)
"""
import json
import math
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType as T
from llama_cpp_layout import KQ_SCALES, hf_to_gguf_name, permute, random_kquant
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

OUT = Path(__file__).resolve().parent / "fixtures"
HIDDEN, INTER, LAYERS = 256, 256, 2
PROMPT_LEN = 80
TEXT = " the world, hello wörld!\n  on an inner"

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}


# ---- tokenizer: GPT-2 byte-level BPE, as llama.cpp stores it ----------------------

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def vocab(specials):
    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("e", "r"), ("Ġ", "w"), ("o", "n"),
              ("Ġ", "s"), ("r", "e"), ("Ġ", "o"), ("a", "n"), ("o", "r"), ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld")]
    tokens = byte_tokens + [a + b for a, b in merges] + specials
    assert len(set(tokens)) == len(tokens)
    types = [1] * (len(tokens) - len(specials)) + [3] * len(specials)
    return tokens, types, [f"{a} {b}" for a, b in merges]


LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
LLAMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}\n\n{{ m.content }}<|eot_id|>{% endfor %}"
                  "{% if add_generation_prompt %}<|start_header_id|>assistant\n\n{% endif %}")
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---- Hugging Face models -------------------------------------------------------

def init_weights(model, seed):
    """Seeded weights with magnitudes that make every part matter: q/k large enough
    for attention scores of order one (so RoPE changes the logits), small embeddings
    (so rms_norm_eps matters), norms around one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            elif "q_proj" in name or "k_proj" in name:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def llama_model(vocab_size, tied, seed):
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                      rope_theta=10000.0, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=tied,
                      bos_token_id=vocab_size - 4, eos_token_id=[vocab_size - 3, vocab_size - 2])
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval()
    init_weights(m, seed)
    return m


def qwen3_model(vocab_size, tied, seed):
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=512,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tied,
                      bos_token_id=None, eos_token_id=vocab_size - 2)
    torch.manual_seed(seed)
    m = Qwen3ForCausalLM(cfg).eval()
    init_weights(m, seed)
    return m


def llama3_band(head_dim, theta, rope):
    """(high, band, low) counts of rotary frequencies by wavelength, as llama3 splits them."""
    old = rope["original_max_position_embeddings"]
    hi_w, lo_w = old / rope["high_freq_factor"], old / rope["low_freq_factor"]
    counts = [0, 0, 0]
    for i in range(head_dim // 2):
        w = 2 * math.pi * theta ** (2 * i / head_dim)
        counts[0 if w < hi_w else 2 if w > lo_w else 1] += 1
    return counts


def rope_freqs(head_dim, theta, rope):
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.generate_extra_tensors`, in the same
    torch float32 arithmetic (with the rope_scaling's original context length)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    lo_w, hi_w = old / low, old / high
    out = []
    for freq in freqs:
        w = 2 * math.pi / freq
        if w < hi_w:
            out.append(1)
        elif w > lo_w:
            out.append(factor)
        else:
            smooth = (old / w - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


# ---- GGUF writing -----------------------------------------------------------------

def encode(w, qtype, rng):
    """(array, raw_dtype) for GGUFWriter.add_tensor."""
    if qtype == T.F32:
        return w.astype(np.float32), None
    if qtype == T.F16:
        return w.astype(np.float16), None
    if qtype in KQ_SCALES:
        return random_kquant(w, qtype, rng), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_gguf(path, model, arch, types, fixed, tokens, token_types, merges, extra_meta, rng):
    """Write `model` as llama.cpp's converter lays out `arch`: matrices named in `fixed`
    (GGUF names) get that type, the others cycle through `types` in sorted HF name order.
    Returns {gguf name: type name}."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    theta = cfg.rope_parameters["rope_theta"]
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = cfg.head_dim
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.GUESSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    for key, value in extra_meta:
        getattr(w, key)(value)

    written = {}
    matrices = 0
    for name, p in sorted(model.state_dict().items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = p.detach().float().numpy()
        gname = hf_to_gguf_name(name)
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = permute(t, cfg.num_attention_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            t = permute(t, cfg.num_key_value_heads)
        if t.ndim == 1:
            qtype = T.F32
        elif gname in fixed:
            qtype = fixed[gname]
        else:
            qtype = types[matrices % len(types)]
            matrices += 1
        data, raw = encode(t, qtype, rng)
        w.add_tensor(gname, data, raw_dtype=raw)
        written[gname] = qtype.name
    if arch == "llama":
        rope = dict(cfg.rope_parameters)
        factors = rope_freqs(head_dim, theta, rope)
        w.add_tensor("rope_freqs.weight", factors)
        written["rope_freqs.weight"] = "F32"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


# ---- reference ------------------------------------------------------------------

def reference_logits(path, ids, hf_model, arch):
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    if arch == "llama":
        # transformers' GGUF loader maps no llama3 scaling (it skips rope_freqs): give the
        # loaded model the HF config's llama3 rotary embedding.
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        assert model.config.rope_parameters.get("rope_type", "default") == "default"
        model.config.rope_parameters = dict(hf_model.config.rope_parameters)
        model.model.rotary_emb = LlamaRotaryEmbedding(config=model.config)
        assert model.model.rotary_emb.rope_type == "llama3"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
    return model, logits


def check_float_tensors(loaded, hf_model, types):
    """Tensors stored as F32/F16/BF16 must come back as the HF weights (rounded to the type)."""
    sd_hf, sd = hf_model.state_dict(), loaded.state_dict()
    checked = 0
    for name, p in sd_hf.items():
        gname = hf_to_gguf_name(name)
        t = types.get(gname)
        if t not in ("F32", "F16", "BF16") or name not in sd:
            continue
        want = p.float()
        if t == "F16":
            want = want.half().float()
        if t == "BF16":
            want = want.bfloat16().float()
        assert torch.equal(sd[name], want), f"{name} ({t}) differs after the GGUF round trip"
        checked += 1
    return checked


# The float types go to the small k/v matrices to keep the files small.
FLOATS = {"blk.0.attn_k.weight": T.F32, "blk.0.attn_v.weight": T.F16, "blk.1.attn_k.weight": T.BF16}
FILES = [
    # name, arch, tied, seed, types cycled over the other matrices, fixed types
    ("llama3-legacy", "llama", False, 1, [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], FLOATS),
    ("llama3-kquant-tied", "llama", True, 2, [T.Q4_K, T.Q6_K, T.Q2_K, T.Q3_K, T.Q5_K, T.IQ4_XS], {}),
    ("qwen3-legacy-tied", "qwen3", True, 3, [T.Q5_1, T.Q8_0, T.Q4_1, T.Q4_0, T.Q5_0], FLOATS),
    ("qwen3-kquant", "qwen3", False, 4, [T.Q6_K, T.IQ4_XS, T.Q4_K, T.Q5_K, T.Q2_K, T.Q3_K], {"blk.1.attn_v.weight": T.BF16}),
]


def main():
    OUT.mkdir(exist_ok=True)
    for name, arch, tied, seed, types, fixed in FILES:
        rng = np.random.default_rng(seed)
        specials = LLAMA_SPECIALS if arch == "llama" else QWEN_SPECIALS
        tokens, token_types, merges = vocab(specials)
        n = len(tokens)
        hf = (llama_model if arch == "llama" else qwen3_model)(n, tied, seed)
        cfg = hf.config
        if arch == "llama":
            counts = llama3_band(cfg.head_dim, cfg.rope_parameters["rope_theta"], cfg.rope_parameters)
            assert counts[1] >= 3 and counts[0] >= 3 and counts[2] >= 3, f"llama3 regions (high, band, low) = {counts}"
            meta = [("add_bos_token_id", n - 4), ("add_eos_token_id", n - 3), ("add_eot_token_id", n - 2),
                    ("add_add_bos_token", True), ("add_chat_template", LLAMA_TEMPLATE)]
        else:
            counts = None
            meta = [("add_eos_token_id", n - 2), ("add_bos_token_id", n - 4), ("add_add_bos_token", False),
                    ("add_chat_template", QWEN_TEMPLATE), ("add_sampling_temp", 0.6), ("add_sampling_top_k", 20),
                    ("add_sampling_top_p", 0.95)]
        path = OUT / f"{name}.gguf"
        written = write_gguf(path, hf, arch, types, fixed, tokens, token_types, merges, meta, rng)
        ids = [n - 4 if arch == "llama" else n - 3] + rng.integers(0, n - len(specials), PROMPT_LEN - 1).tolist()
        loaded, logits = reference_logits(path, ids, hf, arch)
        floats = check_float_tensors(loaded, hf, written)
        with torch.no_grad():
            hf_logits = hf(torch.tensor([ids])).logits[0].numpy()
        tok = AutoTokenizer.from_pretrained(str(OUT), gguf_file=path.name)
        logits.astype("<f4").tofile(OUT / f"{name}.logits.bin")
        info = {
            "gguf": path.name, "architecture": arch, "tied": tied, "vocab_size": n, "prompt_ids": ids,
            "logits_shape": list(logits.shape), "logits_dtype": "float32 little-endian, row-major (token, vocab)",
            "reference": "transformers AutoModelForCausalLM.from_pretrained(gguf_file=..., dtype=float32)"
                         + (" with the HF config's llama3 rotary embedding (transformers reads no llama3 scaling from GGUF)" if arch == "llama" else ""),
            "llama3_frequency_regions_high_band_low": counts,
            "tensor_types": written,
            "float_tensors_equal_to_hf": floats,
            "max_abs_logit_diff_vs_hf_float_model": float(np.abs(hf_logits - logits).max()),
            "logit_abs_max": float(np.abs(logits).max()),
            "tokenized_by_transformers": {"text": TEXT, "ids": tok(TEXT)["input_ids"]},
            "versions": {p: version(p) for p in ["gguf", "transformers", "torch", "numpy"]},
        }
        (OUT / f"{name}.json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"{name}: {path.stat().st_size} bytes, types {sorted(set(written.values()))}, "
              f"{floats} float tensors equal to HF, |logit| max {info['logit_abs_max']:.3f}, "
              f"vs HF float model {info['max_abs_logit_diff_vs_hf_float_model']:.3g}")


if __name__ == "__main__":
    main()
