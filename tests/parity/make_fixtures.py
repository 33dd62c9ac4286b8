#!/usr/bin/env python3
"""Create three tiny, seeded, random Hugging Face checkpoints for rocket's parity tests.

Everything here is built with HF code only (transformers + tokenizers + torch):

  fixtures/tiny-llama/  LlamaForCausalLM, bf16, single model.safetensors, llama3 RoPE
                        scaling written in the LEGACY config spelling (rope_theta +
                        rope_scaling), head_dim absent from config.json (derived 64/4=16),
                        untied lm_head, chat template inside tokenizer_config.json.
  fixtures/tiny-qwen3/  Qwen3ForCausalLM, f16, SHARDED safetensors + index, head_dim=32
                        given explicitly (!= hidden/heads), tied embeddings,
                        transformers-5 "rope_parameters" spelling, chat template in a
                        separate chat_template.jinja, max_position_embeddings 1024
                        for contexts of >= 512 tokens.
  fixtures/tiny-llama3-band/  LlamaForCausalLM, bf16, llama3 RoPE scaling in the
                        transformers-5 "rope_parameters" spelling with parameters chosen so
                        that frequencies fall in all three llama3 regions, three of them in
                        the smoothing band; max_position_embeddings 1024 for contexts of
                        >= 512 tokens. Tokenizer as tiny-llama's.

Both get a small byte-level BPE tokenizer trained with `tokenizers` on a fixed corpus.
Running the script twice gives byte-identical files (checked by --check).

Usage:  HF_HUB_OFFLINE=1 /work/venv-ref/bin/python tests/parity/make_fixtures.py [--check]
"""

import os

# Deterministic tokenizer training / torch math: single thread everywhere.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import hashlib
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ---------------------------------------------------------------------------------------------
# Fixed training corpus: English, code, numbers, whitespace, unicode. Never change it casually:
# every reference in data/tiny-*.json depends on the merges learned from it.
# ---------------------------------------------------------------------------------------------
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Hello world! Hello there, how are you today? I'm fine, thanks. They'll see; we've done it.",
    "Once upon a time, there was a little model that wanted to answer every question.",
    "The user asked a question and the assistant gave a short answer.",
    "system user assistant: you are a helpful assistant. Answer the question of the user.",
    "What is the capital of France? The capital of France is Paris.",
    "In the beginning the tokenizer learned the most common pairs of bytes in the text.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n    else:\n        continue\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "fn main() {\n    let mut v = Vec::new();\n    for i in 0..10 {\n        v.push(i * 2);\n    }\n    println!(\"{:?}\", v);\n}\n",
    "impl Display for Point {\n    fn fmt(&self, f: &mut Formatter) -> Result {\n        write!(f, \"({}, {})\", self.x, self.y)\n    }\n}\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1234567890 -7 1e-5",
    "https://example.com/path/to/page?query=1&lang=en  mailto:someone@example.org",
    "Tabs\tand  spaces   and\n\nnew lines\n\n\nare whitespace.",
    "Café, naïve, résumé, façade, Straße, Ångström, jalapeño, crème brûlée.",
    "日本語のテキストです。中文测试。한국어 문장입니다.",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇺🇸 🇯🇵 ❤️ ✨",
    "Ελληνικά, русский текст, العربية, עברית, हिन्दी.",
    "JSON: {\"name\": \"rocket\", \"version\": 1, \"tags\": [\"fast\", \"small\"]}",
]


def corpus_iter():
    # Repeat to give pair statistics some weight; order is fixed.
    for _ in range(3):
        for line in CORPUS:
            yield line


QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_llama_tokenizer() -> Tokenizer:
    """SmolLM2-like: specials at ids 0..2, Digits(individual) + ByteLevel(use_regex) pre-tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_iter(), trainer=trainer)
    return tok


def train_qwen_tokenizer() -> Tokenizer:
    """Qwen2-like: NFC normalizer, regex Split + ByteLevel(no regex), specials appended at the END."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=397,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_iter(), trainer=trainer)
    tok.add_special_tokens(SPECIALS)  # -> ids len(vocab) .. len(vocab)+2, like Qwen's added tokens
    return tok


LLAMA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN_CHAT_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content | trim + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def dump_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def reinit_(model: torch.nn.Module, seed: int) -> None:
    """Large-std re-init so logits are spread (top-1 is not a near-tie)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name == "model.norm.weight":  # final norm x3: logits ~3x wider, fewer near-ties
                p.copy_(3.0 * (1.0 + 0.1 * torch.randn(p.shape, generator=g)))
            elif p.ndim == 1:  # all other 1-D params of these models are RMSNorm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def fresh_f32_copy(cls, config, model):
    """An f32 model holding `model`'s (bf16/f16) weights upcast. Not `model.to(f32)`: that would also
    round-trip the non-persistent RoPE inv_freq buffer through bf16/f16 and change the logits."""
    ref = cls(config).eval()
    ref.load_state_dict({k: v.to(torch.float32) for k, v in model.state_dict().items()})
    return ref


def finish_folder(tmp: Path, out: Path, keep: list[str]) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in sorted(keep):
        shutil.copyfile(tmp / name, out / name)


def check_tokenizer_roundtrip(folder: Path, raw: Tokenizer) -> None:
    """AutoTokenizer must encode exactly like the raw tokenizer.json."""
    hf = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    samples = CORPUS + ["<|im_start|>user\nhi<|im_end|>\n", "  leading and trailing  ", "e\u0301 vs \u00e9"]
    for s in samples:
        a = hf(s, add_special_tokens=False).input_ids
        b = raw.encode(s, add_special_tokens=False).ids
        assert a == b, (folder.name, s, a, b)
        assert hf(s).input_ids == a, (folder.name, "add_special_tokens=True must not add anything", s)


def make_tiny_llama() -> None:
    out = FIXTURES / "tiny-llama"
    tok = train_llama_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, ids
    assert tok.get_vocab_size() <= 512

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=dict(rope),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    reinit_(model, seed=1234)
    model = model.to(torch.bfloat16)

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        model.save_pretrained(tmp)  # single file: model.safetensors
        cfg = json.loads((tmp / "config.json").read_text())
        # LEGACY spelling: top-level rope_theta + rope_scaling; no head_dim.
        cfg.pop("rope_parameters", None)
        cfg.pop("head_dim", None)
        cfg["rope_theta"] = rope["rope_theta"]
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        cfg["torch_dtype"] = "bfloat16"
        cfg.pop("dtype", None)
        dump_json(tmp / "config.json", cfg)
        dump_json(
            tmp / "generation_config.json",
            {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.9},
        )
        tok.save(str(tmp / "tokenizer.json"), pretty=True)
        dump_json(
            tmp / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|im_end|>",
                "add_bos_token": False,
                "add_eos_token": False,
                "add_prefix_space": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 256,
                "chat_template": LLAMA_CHAT_TEMPLATE,
            },
        )
        finish_folder(
            tmp, out, ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
        )

    # --- verify HF loads the rewritten (legacy-spelled) config identically -----------------
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rc = reloaded.config
    assert rc.head_dim == 16, rc.head_dim
    rp = dict(rc.rope_parameters)
    for k, v in rope.items():
        assert rp.get(k) == v, ("rope_parameters mismatch", k, rp)
    ref = fresh_f32_copy(LlamaForCausalLM, config, model)
    x = torch.arange(0, 100).remainder(tok.get_vocab_size()).unsqueeze(0)
    with torch.no_grad():
        a = ref(x).logits
        b = reloaded(x).logits
    assert torch.equal(a, b), float((a - b).abs().max())
    for (n1, p1), (n2, p2) in zip(sorted(ref.state_dict().items()), sorted(reloaded.state_dict().items())):
        assert n1 == n2 and torch.equal(p1, p2), n1
    check_tokenizer_roundtrip(out, tok)


# head_dim 16, theta 1e4: wavelengths 2*pi*1e4^(i/8) = 6.3, 19.9, 62.8, 199, 628, ... With an
# original context of 256, low_freq_factor 1 and high_freq_factor 16 the band is (16, 256):
# frequency 0 is high (kept), 1..3 are in the band (smoothed), 4..7 are low (divided by factor).
LLAMA3_BAND_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 16.0,
    "original_max_position_embeddings": 256,
}


def llama3_regions(head_dim: int, rope: dict) -> list[str]:
    """Each frequency's llama3 region ("high", "band", "low"), by transformers' own tests of wavelength."""
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    out = []
    for i in range(head_dim // 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (2 * i / head_dim)
        out.append("high" if wavelen < high_wavelen else "low" if wavelen > low_wavelen else "band")
    return out


def make_tiny_llama3_band() -> None:
    out = FIXTURES / "tiny-llama3-band"
    tok = train_llama_tokenizer()
    rope = dict(LLAMA3_BAND_ROPE)
    regions = llama3_regions(16, rope)
    assert regions.count("band") >= 3 and "high" in regions and "low" in regions, regions
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=dict(rope),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(2468)
    model = LlamaForCausalLM(config).eval()
    reinit_(model, seed=2468)
    model = model.to(torch.bfloat16)

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        model.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["rope_parameters"] = rope
        cfg.pop("rope_scaling", None)
        cfg.pop("rope_theta", None)
        cfg.pop("head_dim", None)
        dump_json(tmp / "config.json", cfg)
        dump_json(tmp / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
        tok.save(str(tmp / "tokenizer.json"), pretty=True)
        dump_json(
            tmp / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|im_end|>",
                "add_bos_token": False,
                "add_eos_token": False,
                "add_prefix_space": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 1024,
            },
        )
        finish_folder(
            tmp, out, ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
        )

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rp = dict(reloaded.config.rope_parameters)
    for k, v in rope.items():
        assert rp.get(k) == v, ("rope_parameters mismatch", k, rp)
    assert reloaded.config.head_dim == 16
    # transformers' llama3 frequencies: the band ones lie strictly between the unscaled and the /factor ones.
    base = 1.0 / rope["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16)
    got = reloaded.model.rotary_emb.inv_freq.to(torch.float64)
    for i, region in enumerate(regions):
        b = float(base[i])
        if region == "band":
            assert b / rope["factor"] < float(got[i]) < b, (i, float(got[i]), b)
        else:
            want = b if region == "high" else b / rope["factor"]
            assert math.isclose(float(got[i]), want, rel_tol=1e-6), (i, region, float(got[i]), want)
    ref = fresh_f32_copy(LlamaForCausalLM, config, model)
    x = torch.arange(0, 600).remainder(tok.get_vocab_size()).unsqueeze(0)
    with torch.no_grad():
        a = ref(x).logits
        b = reloaded(x).logits
    assert torch.equal(a, b), float((a - b).abs().max())
    check_tokenizer_roundtrip(out, tok)


def make_tiny_qwen3() -> None:
    out = FIXTURES / "tiny-qwen3"
    tok = train_qwen_tokenizer()
    base = tok.get_vocab_size(with_added_tokens=False)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    assert ids == {t: base + i for i, t in enumerate(SPECIALS)}, ids
    eot, ims, ime = ids["<|endoftext|>"], ids["<|im_start|>"], ids["<|im_end|>"]
    assert tok.get_vocab_size() <= 512

    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=eot,
        eos_token_id=ime,
        pad_token_id=eot,
    )
    torch.manual_seed(4321)
    model = Qwen3ForCausalLM(config).eval()
    reinit_(model, seed=4321)
    model.tie_weights()
    model = model.to(torch.float16)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        model.save_pretrained(tmp, max_shard_size="150KB")
        index = json.loads((tmp / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) >= 2, shards
        assert "lm_head.weight" not in index["weight_map"]
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("rope_scaling", None)
        cfg.pop("rope_theta", None)
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        cfg["head_dim"] = 32
        dump_json(tmp / "config.json", cfg)
        dump_json(tmp / "model.safetensors.index.json", index)
        dump_json(
            tmp / "generation_config.json",
            {
                "bos_token_id": eot,
                "eos_token_id": [ime, eot],
                "pad_token_id": eot,
                "do_sample": True,
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
            },
        )
        tok.save(str(tmp / "tokenizer.json"), pretty=True)
        dump_json(
            tmp / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "unk_token": None,
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "add_prefix_space": False,
                "clean_up_tokenization_spaces": False,
                "split_special_tokens": False,
                "model_max_length": 1024,
            },
        )
        (tmp / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE, encoding="utf-8")
        finish_folder(
            tmp,
            out,
            ["config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja"] + shards,
        )

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rc = reloaded.config
    assert rc.head_dim == 32 and rc.tie_word_embeddings
    assert rc.rope_parameters["rope_theta"] == 1000000.0 and rc.rope_parameters["rope_type"] == "default"
    ref = fresh_f32_copy(Qwen3ForCausalLM, config, model)
    x = torch.arange(0, 100).remainder(tok.get_vocab_size()).unsqueeze(0)
    with torch.no_grad():
        a = ref(x).logits
        b = reloaded(x).logits
    assert torch.equal(a, b), float((a - b).abs().max())
    hf_tok = AutoTokenizer.from_pretrained(out)
    assert hf_tok.chat_template == QWEN_CHAT_TEMPLATE, "chat_template.jinja not picked up"
    check_tokenizer_roundtrip(out, tok)


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main() -> None:
    make_tiny_llama()
    make_tiny_qwen3()
    make_tiny_llama3_band()
    names = ("tiny-llama", "tiny-qwen3", "tiny-llama3-band")
    for name in names:
        folder = FIXTURES / name
        total = sum(p.stat().st_size for p in folder.iterdir())
        assert total < 1_000_000, (name, total)
        print(f"{name}: {total} bytes")
        for p in sorted(folder.iterdir()):
            print(f"  {p.name:32s} {p.stat().st_size:8d}")
    if "--check" in sys.argv:
        first = {n: digest(FIXTURES / n) for n in names}
        make_tiny_llama()
        make_tiny_qwen3()
        make_tiny_llama3_band()
        second = {n: digest(FIXTURES / n) for n in names}
        assert first == second, "fixtures are not deterministic"
        print("deterministic: OK (two builds byte-identical)")


if __name__ == "__main__":
    main()
