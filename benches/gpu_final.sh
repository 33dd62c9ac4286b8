#!/usr/bin/env bash
# One call that checks and measures a submission on the GPU machine (after
# benches/gpu_pack.sh): the CUDA tests, `rocket bench` defaults per fuel and the
# torch peer (benches/gpu_run.sh tests bench peer), greedy batched == solo with
# every pass on the tensor cores, compute-sanitizer memcheck of the tensor-core
# test (tiny fixture + SmolLM2), then the megakernel tests with what time is left.
# Usage (device run): LOGS=$OUT/logs benches/gpu_final.sh
set -uo pipefail
LOGS=${LOGS:-/tmp/rocket-logs}
CK=${CK:-/tmp/rocket-ckpt}
CARRY=.device-carry
export LOGS CK
BENCH_CONFIGS=default timeout 330 bash benches/gpu_run.sh tests bench peer 2>&1 | grep -v "^MATMUL" | tail -42

fixtures=$PWD/tests/parity/fixtures
ROCKET_DECODE=graph ROCKET_MATMUL=tensor ROCKET_FIXTURES=$fixtures \
ROCKET_GPU_CHECKPOINTS=$CK/smollm2-135m,$CK/qwen3-0.6b,$CK/llama-3.2-1b,$CK/qwen3-1.7b \
    timeout 100 "$CARRY/cuda-test" --test-threads=1 --nocapture greedy > "$LOGS/greedy-tensor.log" 2>&1
echo "greedy (ROCKET_MATMUL=tensor) rc=$?"
grep -E "GREEDY|test result|panicked" "$LOGS/greedy-tensor.log" | tail -8

SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
ROCKET_FIXTURES=$fixtures ROCKET_GPU_CHECKPOINTS=$CK/smollm2-135m timeout 120 "$SAN" --tool memcheck \
    "$CARRY/cuda-test" --test-threads=1 tensor_core_matmul > "$LOGS/sanitize-tc.log" 2>&1
echo "memcheck (tensor-core test) rc=$?: $(grep -E 'ERROR SUMMARY' "$LOGS/sanitize-tc.log" | tail -1)"

ROCKET_DECODE=megakernel ROCKET_LOOP_SAMPLING=1 ROCKET_GPU_CHECKPOINTS=$(for f in smollm2-135m qwen3-0.6b llama-3.2-1b qwen3-1.7b; do printf '%s,' "$CK/$f"; done) \
    timeout "${MK_TIMEOUT:-150}" "$CARRY/cuda-megakernel-test" --test-threads=1 --nocapture > "$LOGS/mk-test.log" 2>&1
echo "megakernel tests rc=$?"
grep -E "MK-PARITY|MK-AGREE|MK-GREEDY|test result|FAILED|panicked" "$LOGS/mk-test.log" | head -30
