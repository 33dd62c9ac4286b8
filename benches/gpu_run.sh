#!/usr/bin/env bash
# One GPU-machine session, run from the repo root there (see benches/NOTES.md):
# exact-shape random checkpoints for every fuel, the CUDA tests against the CPU
# reference, `rocket bench` per fuel, then the plain-PyTorch peer on the same
# checkpoints. Binaries were built on the CPU machine and carried in
# .device-carry/ (bin/rocket, cuda-test, tok/). Logs and JSON are written to
# $LOGS and packed into $OUT/logs.tgz (few files come back from the machine).
# Usage: benches/gpu_run.sh [tests] [bench] [peer]   (default: all three)
set -uo pipefail
CARRY=.device-carry
RESULT_DIR=${OUT:-/tmp/rocket-out}
OUT=${LOGS:-/tmp/rocket-logs}
CK=${CK:-/tmp/rocket-ckpt}
mkdir -p "$RESULT_DIR" "$OUT" "$CK"
trap 'tar czf "$RESULT_DIR/logs.tgz" -C "$OUT" .' EXIT
export PYTHONUNBUFFERED=1
STEPS=${*:-tests bench peer}
FUELS="smollm2-135m qwen3-0.6b llama-3.2-1b qwen3-1.7b"
tokdir() { case $1 in llama*) echo llama3;; qwen*) echo qwen3;; smol*) echo smollm2;; esac; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
for f in $FUELS; do
    python3 benches/make_checkpoint.py --fuel "$f" --tokenizer-dir "$CARRY/tok/$(tokdir "$f")" --out "$CK/$f" --device cuda \
        >> "$OUT/checkpoints.log" 2>&1 || { echo "checkpoint $f failed"; tail -5 "$OUT/checkpoints.log"; }
done

if [[ $STEPS == *tests* ]]; then
    ROCKET_FIXTURES=$PWD/tests/parity/fixtures ROCKET_GPU_CHECKPOINTS=$CK/smollm2-135m,$CK/qwen3-0.6b,$CK/llama-3.2-1b \
        timeout 240 "$CARRY/cuda-test" --test-threads=1 --nocapture > "$OUT/cuda-test.log" 2>&1
    echo "cuda tests rc=$?"
    grep -E "PARITY|GREEDY|MODULE|test result|FAILED|panicked|skipped" "$OUT/cuda-test.log"
fi

if [[ $STEPS == *bench* ]]; then
    for f in $FUELS; do
        timeout 120 "$CARRY/bin/rocket" bench --model "$CK/$f" --device cuda --batch 1,16 --prompt-len 128 --gen-len 256 \
            --reps 5 --json "$OUT/bench-$f.json" > "$OUT/bench-$f.txt" 2> "$OUT/bench-$f.err" || { echo "bench $f failed"; tail -3 "$OUT/bench-$f.err"; }
    done
fi

if [[ $STEPS == *peer* ]]; then
    for f in ${PEER_FUELS:-llama-3.2-1b}; do
        timeout 400 python3 benches/torch_peer.py --model "$CK/$f" --batch 1,16 --prompt-len 128 --gen-len 256 --reps 3 \
            --json "$OUT/peer-$f.json" > "$OUT/peer-$f.txt" 2> "$OUT/peer-$f.err" || { echo "peer $f failed"; tail -5 "$OUT/peer-$f.err"; }
    done
fi

echo "=== summary"
for f in $FUELS; do [[ -f $OUT/bench-$f.txt ]] && { echo "--- rocket $f"; cat "$OUT/bench-$f.txt"; }; done
for f in $OUT/peer-*.txt; do [[ -f $f ]] && { echo "--- peer $(basename "$f")"; tail -12 "$f"; }; done
