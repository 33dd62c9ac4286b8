"""How llama.cpp lays out a llama/qwen3 model in GGUF, for the scripts that write GGUF
files with the `gguf` package (tests/gguf/make_fixtures.py, tests/gguf/make_1b_q4_k_m.py,
benches/gguf_gpu_check.py): tensor names as convert_hf_to_gguf.py maps them, its Q/K row
permutation for llama, the layers where llama.cpp's Q4_K_M "uses more bits", and the
seeded random K-quant blocks the scripts write where gguf-py cannot quantize. Needs numpy
and gguf (no torch).

Not here: the llama3 `rope_freqs` divisors. make_fixtures.py computes them in torch float32
as the converter does; gguf_gpu_check.py (no torch on the GPU machine) in numpy float32,
whose pow differs from torch's by one ulp for some frequencies (e.g. frequency 9 of the
fixtures' head_dim 64, theta 1e4), so one shared version would change a committed fixture.
"""

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

# Hugging Face tensor names outside the layers -> GGUF names.
_FIXED = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
# model.layers.N.<part> -> blk.N.<name>.weight
_LAYER = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
          "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
          "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
          "post_attention_layernorm.weight": "ffn_norm", "mlp.gate_proj.weight": "ffn_gate",
          "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}


def hf_to_gguf_name(name):
    """convert_hf_to_gguf.py's name for the Hugging Face tensor `name`."""
    if name in _FIXED:
        return _FIXED[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.weight"


def gguf_to_hf_name(gname):
    """The Hugging Face name of GGUF tensor `gname` (the inverse of `hf_to_gguf_name`)."""
    fixed = {g: h for h, g in _FIXED.items()}
    if gname in fixed:
        return fixed[gname]
    _, layer, part, _ = gname.split(".")
    rest = {g: h for h, g in _LAYER.items()}[part]
    return f"model.layers.{layer}.{rest}"


def use_more_bits(i, n):
    """llama.cpp's `use_more_bits`: Q4_K_M stores attn_v and ffn_down of layer `i` (of `n`) as Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def permute(w, n_head):
    """convert_hf_to_gguf.py `LlamaModel.permute`: interleave the two rotary halves of each of
    the `n_head` heads in the rows of `w` (the KV head count for attn_k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w, n_head):
    """The inverse of `permute` (what transformers' GGUF loader does to llama's Q/K)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Byte offsets of each K-quant block's f16 scales and f16 min scales, and the largest |value|
# per unit of the scale with random quants and sub-scales (scale × max sub-scale × max |quant|).
KQ_SCALES = {
    T.Q2_K: ([80], [82], 15 * 3),
    T.Q3_K: ([108], [], 32 * 4),
    T.Q4_K: ([0], [2], 63 * 15),
    T.Q5_K: ([0], [2], 63 * 31),
    T.Q6_K: ([208], [], 128 * 32),
    T.IQ4_XS: ([0], [], 32 * 127),
}


def random_kquant(w, qtype, rng):
    """Raw blocks of `qtype` (a KQ_SCALES type) for matrix `w`: random quant and sub-scale
    bytes from `rng`, each block's scale (and min scale) from the float block's absolute
    maximum, so the dequantized weights have `w`'s magnitude (they do not approximate it)."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    rows, cols = w.shape
    assert cols % elems == 0, (w.shape, qtype.name)
    nblocks = rows * cols // elems
    amax = np.abs(w.reshape(nblocks, elems)).max(axis=1)
    raw = rng.integers(0, 256, size=(nblocks, nbytes), dtype=np.uint8)
    d_offs, m_offs, span = KQ_SCALES[qtype]
    for off in d_offs:
        raw[:, off:off + 2] = (amax / span).astype(np.float16).view(np.uint8).reshape(nblocks, 2)
    for off in m_offs:  # mins up to 63 (15 for Q2_K) × dmin: about half the range
        raw[:, off:off + 2] = (amax / (2 * (15 if qtype == T.Q2_K else 63))).astype(np.float16).view(np.uint8).reshape(nblocks, 2)
    return raw.reshape(rows, cols // elems * nbytes)
