"""Write a synthetic GGUF with Llama-3.2-1B's shapes and a Q4_K_M-like type mix, for
timing rocket's GGUF load (the file is ~0.8 GB: do not commit it).

Shapes: hidden 2048, 16 layers, 32/8 heads of 64, intermediate 8192, vocab 128256, tied
output, llama3 rope_freqs. Types as llama.cpp's Q4_K_M picks them for this model:
token_embd Q6_K; attn_v and ffn_down Q6_K in the layers where llama.cpp "uses more
bits" (the first and last eighth, and every third layer between), Q4_K elsewhere; the
other matrices Q4_K; norms and rope_freqs F32. Blocks are random bytes with small
finite f16 scales (the weights are meaningless; only the load work is real), written by
the `gguf` package's GGUFWriter. The tokenizer is 256 byte tokens plus placeholders.

Run: python tests/gguf/make_1b_q4_k_m.py OUT.gguf, then e.g. `rocket inspect OUT.gguf`.
"""
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from llama_cpp_layout import use_more_bits

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 2048, 16, 32, 8, 64, 8192, 128256
# Byte offsets of each block's f16 scales.
SCALES = {T.Q4_K: [0, 2], T.Q6_K: [208]}


def blocks(rng, qtype, rows, cols):
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // elems, nbytes), dtype=np.uint8)
    for off in SCALES[qtype]:
        raw[:, off:off + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return raw.reshape(rows, cols // elems * nbytes)


def main(path):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("synthetic-llama-3.2-1b-q4_k_m")
    w.add_context_length(131072)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    byte_tokens = [chr(c) for c in range(0x100, 0x200)]
    merged = byte_tokens[0] + byte_tokens[1]
    tokens = byte_tokens + [merged] + [f"<tok{i}>" for i in range(VOCAB - 256 - 3)] + ["<|begin_of_text|>", "<|eot_id|>"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3])
    w.add_token_merges([f"{byte_tokens[0]} {byte_tokens[1]}"])
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)

    w.add_tensor("token_embd.weight", blocks(rng, T.Q6_K, VOCAB, HIDDEN), raw_dtype=T.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("rope_freqs.weight", np.ones(HEAD_DIM // 2, np.float32))
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        hi = T.Q6_K if use_more_bits(i, LAYERS) else T.Q4_K
        for name, qtype, rows, cols in [("attn_q", T.Q4_K, q, HIDDEN), ("attn_k", T.Q4_K, kv, HIDDEN), ("attn_v", hi, kv, HIDDEN),
                                        ("attn_output", T.Q4_K, HIDDEN, q), ("ffn_gate", T.Q4_K, INTER, HIDDEN),
                                        ("ffn_up", T.Q4_K, INTER, HIDDEN), ("ffn_down", hi, HIDDEN, INTER)]:
            w.add_tensor(f"blk.{i}.{name}.weight", blocks(rng, qtype, rows, cols), raw_dtype=qtype)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1])
