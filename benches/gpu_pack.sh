#!/usr/bin/env bash
# Builds, on the CPU machine, everything one GPU-machine session needs into
# .device-carry/ (ignored by git; name it in the device tool's `carry`):
#   rocket.xz                   the CLI (rocket bench), release build
#   cuda-test.xz                crates/rocket-core/tests/cuda.rs (CUDA backend vs CPU reference)
#   cuda-megakernel-test.xz     crates/rocket-core/tests/cuda_megakernel.rs
#   cuda-prod-path-test.xz      crates/rocket-core/tests/cuda_prod_path.rs (graph prefill, then
#                               megakernel decode across launches, against the CPU reference)
#                               (the three built with rocket-core's `diagnostics` feature: the probes,
#                               the matmul check and the megakernel's test entry points)
#   cuda-devices-test.xz        crates/rocket-core/tests/cuda_devices.rs (one engine per GPU behind
#                               the router; a fault injected on one GPU)
#   logits-at.xz                crates/rocket-core/examples/logits_at.rs: logits at chosen positions
#                               from either GPU path, for benches/long_context_check.py
#   wheels/gguf-0.19.0-*.whl    the `gguf` package (gpu_run.sh's gguf step writes GGUF files with it;
#                               its imports numpy and pyyaml are on the GPU machine already)
#   tok.tar.xz                  the fuels' real tokenizers (benches/export_tokenizers.py):
#                               tok/{llama3,qwen3,smollm2}, compressed to leave room under the limit
# The GPU machine has no cargo, and its glibc (2.39) runs binaries built here (2.36).
# Binaries are stripped and xz-compressed (gpu_run.sh unpacks them), so the
# carry stays under the 64 MiB a run can take.
# Usage: benches/gpu_pack.sh, then on the GPU machine: benches/gpu_run.sh [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.device-carry
mkdir -p "$OUT"
rm -rf "$OUT/bin"  # the CLI's old place, uncompressed

cargo build --release --locked -p rocket-cli
cp target/release/rocket "$OUT/rocket"

# The path of a test binary, from cargo's JSON messages.
test_binary() {
    cargo test --release --locked -p rocket-core --features diagnostics --test "$1" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1"
}
cp "$(test_binary cuda)" "$OUT/cuda-test"
cp "$(test_binary cuda_megakernel)" "$OUT/cuda-megakernel-test"
cp "$(test_binary cuda_prod_path)" "$OUT/cuda-prod-path-test"
cp "$(test_binary cuda_devices)" "$OUT/cuda-devices-test"
cargo build --release --locked -p rocket-core --features diagnostics --example logits_at
cp target/release/examples/logits_at "$OUT/logits-at"
strip "$OUT/rocket" "$OUT/cuda-test" "$OUT/cuda-megakernel-test" "$OUT/cuda-prod-path-test" "$OUT/cuda-devices-test" "$OUT/logits-at"
xz -f -T0 "$OUT/rocket" "$OUT/cuda-test" "$OUT/cuda-megakernel-test" "$OUT/cuda-prod-path-test" "$OUT/cuda-devices-test" "$OUT/logits-at"

ls "$OUT"/wheels/gguf-0.19.0-*.whl > /dev/null 2>&1 || python3 -m pip download -q --no-deps gguf==0.19.0 -d "$OUT/wheels"

if [[ ! -f $OUT/tok.tar.xz ]]; then
    python3 benches/export_tokenizers.py --out "$OUT/tok" --rocket target/release/rocket
    tar -C "$OUT" -cJf "$OUT/tok.tar.xz" tok && rm -r "$OUT/tok"
fi
du -sh "$OUT"/* | sort -h
total=$(du -sm "$OUT" | cut -f1)
(( total < 60 )) || { echo "$OUT is ${total} MiB: over what one run can carry" >&2; exit 1; }
