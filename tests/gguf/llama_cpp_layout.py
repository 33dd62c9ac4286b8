"""How llama.cpp lays out a llama/qwen3 model in GGUF, for the scripts that write GGUF
files with the `gguf` package (tests/gguf/make_fixtures.py, tests/gguf/make_1b_q4_k_m.py,
benches/gguf_gpu_check.py): tensor names as convert_hf_to_gguf.py maps them, and the
layers where llama.cpp's Q4_K_M "uses more bits". Standard library only.
"""

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
