#!/usr/bin/env bash
# The pending patch's GPU checks, on a build of main with benches/pending/pass-rows-at-any-length.patch
# applied (benches/gpu_pack.sh; a chunk-512 CLI in .device-carry/base/rocket.xz): the row bits first,
# then the reuse tests, the chat case and TTFT against the base.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
B=/tmp/rocket-bin; mkdir -p $B; xz -dc .device-carry/cuda-test.xz > $B/ct; chmod +x $B/ct
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
ROCKET_FIXTURES=$PWD/tests/parity/fixtures timeout 100 $B/ct --include-ignored --exact --nocapture cublas_rows_keep_their_bits_across_pass_lengths > $OUT/rowbits.log 2>&1
echo "rowbits rc=$?"; grep -E "SUMMARY|test result|panicked" $OUT/rowbits.log
CUDA_TEST_FILTER="prefix_reuse pass_length" timeout 230 benches/gpu_run.sh tests chat 2>&1 | grep -E "PASS|FAIL|PREFIX-REUSE|PASS-LEN|REUSE block|test result|panicked" | head -40
cp /tmp/rocket-logs/cuda-test.log $OUT/ 2>/dev/null
FUELS="llama-3.2-1b qwen3-0.6b" timeout 100 benches/gpu_run.sh ttftab 2>&1 | grep -E "TTFT-AB|^\|" | grep -v -- "---" | head -60
# The path users run, where the call has time left for it (about 100 s of its 420 s limit).
if (( SECONDS < 330 )); then
    PROD_TIMEOUT=$((540 - SECONDS)) timeout $((550 - SECONDS)) benches/gpu_run.sh prod 2>&1 | grep -E "PROD|^FAIL|PASS|test result|panicked" | tail -30
    cp /tmp/rocket-logs/prod-test.log $OUT/ 2>/dev/null
else
    echo "prod: skipped, $SECONDS s gone"
fi
