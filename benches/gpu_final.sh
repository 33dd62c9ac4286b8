#!/usr/bin/env bash
# One call that checks and measures a submission on the GPU machine (after
# benches/gpu_pack.sh): the CUDA tests, `rocket bench` defaults per fuel and the
# torch peer (benches/gpu_run.sh tests bench peer), greedy batched == solo on
# every fuel (the test runs the graph path with the GEMV and with every pass on
# the tensor cores), compute-sanitizer memcheck of the tensor-core test (tiny
# fixture + SmolLM2), then the megakernel tests with what time is left.
# The test binaries' tests are #[ignore]d (they need a GPU) and run with
# --include-ignored. Each check prints PASS or FAIL; the script exits 1 when any failed.
# Usage (device run): LOGS=$OUT/logs benches/gpu_final.sh
set -uo pipefail
LOGS=${LOGS:-/tmp/rocket-logs}
CK=${CK:-/tmp/rocket-ckpt}
CARRY=.device-carry
export LOGS CK
FAILED=()
check() {  # check NAME RC: one check's outcome, remembered for the exit status
    if [[ $2 == 0 ]]; then echo "PASS $1"; else echo "FAIL $1 (rc=$2)"; FAILED+=("$1"); fi
}
BENCH_CONFIGS=default timeout 330 bash benches/gpu_run.sh tests bench peer > "$LOGS/gpu-run.out" 2>&1
check "benches/gpu_run.sh tests bench peer" $?
grep -v "^MATMUL" "$LOGS/gpu-run.out" | tail -42

fixtures=$PWD/tests/parity/fixtures
ROCKET_FIXTURES=$fixtures ROCKET_GPU_CHECKPOINTS=$CK/smollm2-135m,$CK/qwen3-0.6b,$CK/llama-3.2-1b,$CK/qwen3-1.7b \
    timeout 200 "$CARRY/cuda-test" --include-ignored --test-threads=1 --nocapture greedy > "$LOGS/greedy.log" 2>&1
check "greedy on every fuel" $?
grep -E "GREEDY|test result|panicked" "$LOGS/greedy.log" | tail -16

SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
ROCKET_FIXTURES=$fixtures ROCKET_GPU_CHECKPOINTS=$CK/smollm2-135m timeout 120 "$SAN" --tool memcheck \
    "$CARRY/cuda-test" --include-ignored --test-threads=1 tensor_core_matmul > "$LOGS/sanitize-tc.log" 2>&1
rc=$?
summary=$(grep -E 'ERROR SUMMARY' "$LOGS/sanitize-tc.log" | tail -1)
echo "memcheck (tensor-core test) rc=$rc: $summary"
[[ $rc == 0 && $summary == *"ERROR SUMMARY: 0 errors"* ]] || { [[ $rc == 0 ]] && rc=1; }
check "memcheck (tensor-core test)" "$rc"

ROCKET_GPU_CHECKPOINTS=$(for f in smollm2-135m qwen3-0.6b llama-3.2-1b qwen3-1.7b; do printf '%s,' "$CK/$f"; done) \
    timeout "${MK_TIMEOUT:-150}" "$CARRY/cuda-megakernel-test" --include-ignored --test-threads=1 --nocapture > "$LOGS/mk-test.log" 2>&1
check "megakernel tests" $?
grep -E "MK-PARITY|MK-AGREE|MK-GREEDY|test result|FAILED|panicked" "$LOGS/mk-test.log" | head -30

if (( ${#FAILED[@]} )); then
    echo "FAIL: ${#FAILED[@]} check(s) failed: ${FAILED[*]}"
    exit 1
fi
echo "PASS: every check passed"
