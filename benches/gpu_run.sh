#!/usr/bin/env bash
# One GPU-machine session, run from the repo root there (what it measured goes
# into the bench notes; benches/summarize_results.py condenses its logs).
# Binaries and tokenizers come from benches/gpu_pack.sh (built on the CPU
# machine) in .device-carry/. Exact-shape random checkpoints for every fuel are
# made first (kept in $CK across calls while the machine stays warm). Steps:
#   tests     CUDA backend (kernel per op, CUDA graphs, tensor-core matmul) against the CPU reference,
#             and the probes, but the hand-off probe and the cuBLASLt checks (steps of their own)
#   handoff   the hand-off probe alone (HANDOFF lines: what one grid-wide hand-off costs in each protocol
#             beside the weight stream; its own step and timeout, so a protocol that hangs costs only it)
#   mk        the megakernel against the CPU reference and the graph path (MK_FILTER: a test name filter)
#   prod      the path users run (crates/rocket-core/tests/cuda_prod_path.rs): graph-path prefill
#             at prompts of 1, 17, 128 and 1000 tokens, then megakernel decode across three
#             launches, logits and greedy tokens against the CPU reference and the graph path
#   long-ref  Llama-3.2-1B and Qwen3-0.6B at 2K, 4K and 16K tokens, both GPU paths against an fp32
#             transformers forward (benches/long_context_check.py, with .device-carry/logits-at.xz)
#   gguf      GGUF files on the megakernel (benches/gguf_gpu_check.py; Llama-3.2-1B and Qwen3 fuels in
#             FUELS): the gguf package (carried wheel) writes each checkpoint as a BF16 GGUF and a
#             Q4_K_M-like GGUF plus an HF copy of the latter's dequantized weights; rocket on each GGUF
#             and its HF twin must agree (greedy ids and logprobs through `rocket generate`, 200 greedy
#             megakernel tokens over two launches with every step's logits from logits-at, bitwise
#             where the rotary frequencies are identical), `rocket bench` must decode the GGUFs on the
#             megakernel; then GGUF-LOAD lines: load time of a Llama-3.2-1B-shaped Q4_K_M file
#             (tests/gguf/make_1b_q4_k_m.py) with --device cuda and cpu
#   bench     `rocket bench` per fuel at batch 1 and 16: the defaults (ROCKET_DECODE and
#             ROCKET_MATMUL auto), the graph path with the GEMV only, the megakernel;
#             BENCH_CONFIGS="default graph" runs a subset; "nopdl" / "nofuse" run the
#             defaults with ROCKET_PDL=0 / ROCKET_FUSE=0 (plain launches / unfused RMSNorm
#             and SiLU) for an A/B
#   cublas    `--matmul cublas` (cuBLASLt, from CUBLAS_LIB, default the toolkit's lib64): the matmul
#             check at every fuel shape beside rocket's tensor-core GEMM and the parity test
#             (CUBLAS lines), then `rocket bench` TTFT at 128 and 4096 tokens and batch 16 with
#             `--matmul tensor` and `cublas` (Llama-3.2-1B, Qwen3-0.6B; CUBLAS_BENCH_MATMULS picks a subset,
#             set empty for the checks alone),
#             and `cublas` with the baseline build (.device-carry/base/rocket.xz) where one is carried
#   splitk    cuBLASLt's fp16 products of Llama-3.2-1B and Qwen3-0.6B at 128 rows made to split K (the
#             heuristic's first two candidates, 2-8 splits, each reduction scheme), checked, tested for
#             repeatable bits and timed (CUBLAS-SPLITK lines; CUBLAS-SPLITK-BEST: the first pick against
#             the fastest repeatable split)
#   f16gemm   rocket's fp16 GEMM (gemm_f16.cu, the products of passes of 33-256 rows) at every fuel's
#             four products against the host, timed beside cuBLASLt's fp16 products (F16GEMM lines), and a
#             row's bits at 33-200 rows against 256 (F16GEMM-ROW-BITS)
#   algos     cuBLASLt's heuristic candidates for the fp16 products of Llama-3.2-1B and Qwen3-0.6B
#             at 4, 128, 512 and 2,048 rows, each checked and timed (CUBLAS-ALGO lines; CUBLAS-BEST:
#             the first pick, which the forward pass runs, against the fastest)
#             then whether a row keeps its bits at pass lengths of 128 to 2,052 rows, under
#             each row count's own pick and under one pinned algorithm (ROW-BITS lines)
#   interference  `rocket serve` on Llama-3.2-1B: 8 greedy streams decode while a 16K-token prompt
#             arrives (benches/interference.py; prefix blocks in INTERFERENCE_BLOCKS, default
#             512: the block no longer changes the passes); the streams' p99 gap while it prefills must stay <= 3x their median
#   devices   one engine per GPU behind the router (issue 25): crates/rocket-core/tests/cuda_devices.rs,
#             each test in a process of its own (a fault test breaks its GPU's context for the
#             rest of the process): the one-GPU router against solo outputs and a fault on the
#             only GPU, and with two GPUs or more every GPU serving and a fault on cuda:1 mid-run;
#             then benches/devices.py on Llama-3.2-1B (DEVICES lines): `rocket serve --devices 0`
#             and, with several GPUs, `--devices all`, 32 streams of 128 greedy tokens per GPU,
#             load to ready and tokens/s, and again on batch-independent passes (graph path,
#             GEMV) with every stream checked against its text alone
#   tcb1      the tensor-core matmul at batch 1 (Llama-3.2-1B, Qwen3-0.6B)
#   sampled   sampled decode (Qwen3 settings): graph path with the device sampler and with the
#             host sampler, and the megakernel sampling in its token loop (ROCKET_LOOP_SAMPLING=1)
#   race      batch-1 sampled decode per fuel (greedy, T 1.0, T 0.8 + repetition penalty,
#             + min-p, T 0.7 + top-p 0.9, T 0.6 + top-k 20 + top-p 0.95, greedy with logprobs 5),
#             each on its default path,
#             and batch 16 greedy and T 0.6 + top-k 20 + top-p 0.95 on Qwen3-0.6B and Llama-3.2-1B
#             (RACE_MODES: a subset of greedy t1 t08rp minp topp topk lp5; RACE16=0 skips batch 16)
#             RATIO lines: each mode's step over greedy's (benches/race_ratios.py)
#   attnprof  Nsight Compute sections (throughput, stalls, occupancy) of the prompt attention's
#             launches in a 4,096-token Llama-3.2-1B prefill (PROFILE_FUEL picks another)
#   mkstall   Nsight Compute's warp stall reasons (cycles per issued instruction) of one megakernel
#             launch per fuel in MKSTALL_FUELS (default Qwen3-0.6B), greedy and each RACE_MODES mode
#             (default greedy topp topk): whether sampled steps stall on instruction fetch (the
#             sampler's code is ~260 KB of the kernel's ~520 KB of SASS) where greedy ones do not
#             (no instruction: 2.4% of stalls, greedy, Session 17). MKSTALL lines per run
#   ttft      TTFT per fuel at prompts of 128, 1K, 4K (and 16K for Llama-3.2-1B), prompt attention on
#             the tensor cores (attention_prefill.cu) and with ROCKET_TC_ATTENTION=0 (the split kernel),
#             and the chat case (below); PASS lines: the last prompt pass's host issue time against
#             its whole time
#   chat      the chat case alone: Llama-3.2-1B, 4,000 cached + 100 new prompt tokens at prefix
#             blocks 512 and 128 (REUSE lines), and the baseline build's (.device-carry/base) where there is one,
#             and this build under each TTFTAB_ENV set (below)
#   long      Llama-3.2-1B decode at 1K, 4K and 16K contexts, both paths
#   sanitize  compute-sanitizer memcheck on every fuel's megakernel (short launches of every
#             sampling mode, and a teacher-forced launch on SmolLM2) and on the prompt attention (the
#             tensor-core attention test on the tiny fixture, SmolLM2 and Qwen3-0.6B), racecheck on SmolLM2's and on the
#             prompt attention (its short cases); SANITIZE_TOOLS picks memcheck, racecheck, attention (both tools on
#             the prompt attention alone) or attention-racecheck
#   soak      benches/soak.py against `rocket serve` on the GPU (SOAK_S seconds, SOAK_FUEL), started
#             in its own process session so it outlives the call; SOAK_WAIT bounds the wait per call
#   peer      the plain-PyTorch peer (benches/torch_peer.py) on Llama-3.2-1B
#   profile   Nsight Compute's time per kernel of one batch-16 decode step and one 128-token
#             prefill (PROFILE_FUEL, default Llama-3.2-1B; graph path, kernels launched one by
#             one), summarised by benches/ncu_step.py; PROFILE_SHAPES="B P G PASS|..." picks
#             other runs (batch, prompt length, gen length, which pass from the end)
#   ttftab    TTFT at 128/1K/4K (Llama also 16K) of this build, the baseline build's
#             (.device-carry/base/rocket.xz, where one is carried) and every .device-carry/variants/NAME.xz (rows
#             ttftab-NAME), interleaved per fuel, two rounds; TTFTAB_ENV="NAME=VALUE ...|..." adds this
#             build under each set of variables (rows ttftab-envK), TTFTAB_LENS=128,512,... other prompt lengths
#   ab        the megakernel of this build against a baseline build's (.device-carry/base/
#             rocket.xz, packed by hand), interleaved per fuel, batch 1 (and the baseline's
#             megakernel tests' MK-PROFILE lines when base/cuda-megakernel-test.xz is there);
#             AB_ENV="NAME=VALUE ...|NAME=VALUE ..." adds this build under each set of
#             variables (ab-envK rows, K counting the sets from 0); AB_BASE=0 skips the baseline;
#             every .device-carry/variants/NAME.xz (other builds' rocket, packed by hand) adds
#             ab-NAME rows
#   abshort   the same at prompt 16, generate 128 (contexts like the megakernel tests' traced step)
# POWER_LOG=1 samples the GPU's SM clock and power draw every 50 ms into $LOGS/power.csv
# (each bench's start and end time go to $LOGS/bench.times), to tell a kernel
# change from the clock moving under it.
# The test binaries' tests are #[ignore]d (they need a GPU), so they run with
# --include-ignored. Every check (checkpoints, test binaries, benches, sanitizers)
# prints PASS or FAIL; the script exits 1 when any failed.
# Bench settings travel as the CLI's ROCKET_* variables (not flags), which the
# baseline builds of `ab` read too.
# Usage: benches/gpu_run.sh [steps...]   (default: tests mk prod bench)
# Logs and JSON go to $LOGS and are packed into $OUT/logs.tgz; a summary prints last.
set -uo pipefail
CARRY=.device-carry
RESULT_DIR=${OUT:-/tmp/rocket-out}
LOGS=${LOGS:-/tmp/rocket-logs}
CK=${CK:-/tmp/rocket-ckpt}
mkdir -p "$RESULT_DIR" "$LOGS" "$CK"
# A warm machine keeps $LOGS across calls: the last call's logs go, so that logs.tgz holds this
# call's alone (the soak's stay: a soak outlives the call that started it).
find "$LOGS" -mindepth 1 -maxdepth 1 ! -name 'soak*' -exec rm -rf {} +
if [[ ${POWER_LOG:-0} == 1 ]]; then
    TZ=UTC nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader -lms 50 > "$LOGS/power.csv" &
    POWER_PID=$!
fi
trap '[[ -n ${POWER_PID:-} ]] && kill "$POWER_PID"; tar czf "$RESULT_DIR/logs.tgz" -C "$LOGS" .' EXIT
export PYTHONUNBUFFERED=1
STEPS=" ${*:-tests mk prod bench} "
FUELS=${FUELS:-"smollm2-135m qwen3-0.6b llama-3.2-1b qwen3-1.7b"}  # a subset saves device time
CKPTS=$(for f in $FUELS; do printf '%s,' "$CK/$f"; done)
TOK=/tmp/rocket-tok
[[ -d $TOK/tok ]] || { mkdir -p "$TOK" && tar -C "$TOK" -xJf "$CARRY/tok.tar.xz"; }
tokdir() { case $1 in llama*) echo llama3;; qwen*) echo qwen3;; smol*) echo smollm2;; esac; }
has() { [[ $STEPS == *" $1 "* ]]; }
# The carry's xz-compressed binaries, unpacked at every use (a warm machine may hold an older carry's).
BIN=/tmp/rocket-bin
unpacked() {  # unpacked NAME: the path of .device-carry/NAME.xz, decompressed (NAME may be base/rocket)
    mkdir -p "$(dirname "$BIN/$1")" && xz -dc "$CARRY/$1.xz" > "$BIN/$1" && chmod +x "$BIN/$1"
    echo "$BIN/$1"
}
ROCKET=$(unpacked rocket)  # this build's CLI
unpack_variants() {  # every .device-carry/variants/NAME.xz into $BIN/variants/NAME
    rm -rf "$BIN/variants"  # (a warm machine keeps the last call's)
    for v in "$CARRY"/variants/*.xz; do
        [[ -f $v ]] && unpacked "variants/$(basename "$v" .xz)" > /dev/null
    done
}
FAILED=()
check() {  # check NAME RC: one check's outcome, remembered for the exit status
    if [[ $2 == 0 ]]; then echo "PASS $1"; else echo "FAIL $1 (rc=$2)"; FAILED+=("$1"); fi
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv | tee "$LOGS/gpu.txt"
for f in $FUELS; do
    python3 benches/make_checkpoint.py --fuel "$f" --tokenizer-dir "$TOK/tok/$(tokdir "$f")" --out "$CK/$f" --device cuda \
        >> "$LOGS/checkpoints.log" 2>&1 || { check "checkpoint $f" 1; tail -5 "$LOGS/checkpoints.log"; }
done

if has soak; then
    # First, so that a later call's other steps wait for it to finish.
    # `rocket serve` on the GPU under benches/soak.py's mixed traffic for SOAK_S seconds
    # (default 600) on SOAK_FUEL (default qwen3-0.6b: its tokenizer has a chat template). A
    # 10-minute soak does not fit one device call, so it runs in its own process session,
    # which outlives the call while the machine stays warm: `soak` starts it (once per
    # machine) and waits up to SOAK_WAIT seconds; calling `soak` again waits for the same run.
    sf=${SOAK_FUEL:-qwen3-0.6b}
    if [[ ! -f $LOGS/soak.started ]]; then
        date +%s > "$LOGS/soak.started"
        # Its own copy of the CLI: the next call's carry replaces .device-carry under it.
        mkdir -p "$BIN" && cp "$ROCKET" "$BIN/rocket-soak"
        setsid bash -c "python3 benches/soak.py --rocket '$BIN/rocket-soak' --model '$CK/$sf' --device cuda \
            --duration ${SOAK_S:-600} --json '$LOGS/soak.json' > '$LOGS/soak.txt' 2>&1; echo \$? > '$LOGS/soak.rc'" < /dev/null > /dev/null 2>&1 &
    fi
    until [[ -f $LOGS/soak.rc ]] || (( $(date +%s) - $(cat "$LOGS/soak.started") > ${SOAK_WAIT:-570} )); do sleep 5; done
    if [[ -f $LOGS/soak.rc ]]; then
        check "soak ($sf, ${SOAK_S:-600} s)" "$(cat "$LOGS/soak.rc")"
        tail -40 "$LOGS/soak.txt"
    else
        echo "soak: still running, $(( $(date +%s) - $(cat "$LOGS/soak.started") )) s since it started: call the soak step again"
        tail -3 "$LOGS/soak.txt"
    fi
fi

if has tests; then
    # The tests pick their paths themselves (the greedy test asserts batched == solo
    # bit for bit on the graph path with each fixed matmul kernel).
    ROCKET_FIXTURES=$PWD/tests/parity/fixtures ROCKET_GPU_CHECKPOINTS=$CK/smollm2-135m,$CK/qwen3-0.6b,$CK/llama-3.2-1b \
        timeout 420 "$(unpacked cuda-test)" --include-ignored --test-threads=1 --nocapture --skip handoff_probe --skip cublas_matmul --skip cublas_rows --skip f16_gemm --skip fp16_products_redo --skip attention_outputs_past ${CUDA_TEST_FILTER:-} > "$LOGS/cuda-test.log" 2>&1
    check "cuda tests" $?
    grep -E "PARITY|GREEDY|MODULE|TC |SAMPLE|MATMUL|FENCE|F16|KV-ONLY|PASS-LEN|PROMPT-GRAPH|PREFIX-REUSE|test result|FAILED|panicked" "$LOGS/cuda-test.log"
fi

if has handoff; then
    ROCKET_FIXTURES=$PWD/tests/parity/fixtures timeout 120 "$(unpacked cuda-test)" --include-ignored --exact --nocapture \
        handoff_probe_times_each_protocol_beside_the_weight_stream > "$LOGS/handoff.log" 2>&1
    check "hand-off probe" $?
    grep -E "HANDOFF|test result|FAILED|panicked" "$LOGS/handoff.log"
fi

if has mk; then
    # The tests load the megakernel (and the GEMV for the graph path's side) themselves.
    ROCKET_GPU_CHECKPOINTS=$CKPTS \
        timeout "${MK_TIMEOUT:-420}" "$(unpacked cuda-megakernel-test)" --include-ignored --test-threads=1 --nocapture ${MK_FILTER:-} > "$LOGS/mk-test.log" 2>&1
    check "megakernel tests" $?
    grep -E "MK-|test result|FAILED|panicked|error" "$LOGS/mk-test.log" | grep -v "MK-PROFILE.*|" | grep -v "MK-PROFILE-SAMPLED" | head -40
    # What sampling adds to a traced step's LM head phase (the SMs' parts and the merge).
    grep "MK-PROFILE-SAMPLED" "$LOGS/mk-test.log"
fi

if has prod; then
    # Default GPU options, as users run; every fuel; the CPU reference is most of the time.
    ROCKET_GPU_CHECKPOINTS=$CKPTS \
        timeout "${PROD_TIMEOUT:-420}" "$(unpacked cuda-prod-path-test)" --include-ignored --test-threads=1 --nocapture > "$LOGS/prod-test.log" 2>&1
    check "production-path tests" $?
    grep -E "PROD|^FAIL|test result|panicked" "$LOGS/prod-test.log" | head -100
fi

if has gguf; then
    GG_SITE=/tmp/rocket-gguf-site  # the gguf package is not installed there: its carried wheel
    rm -rf "$GG_SITE" && python3 -m zipfile -e "$CARRY"/wheels/gguf-*.whl "$GG_SITE" && PYTHONPATH=$GG_SITE python3 -c "import gguf, yaml, numpy"
    check "gguf package (carried wheel) imports" $?
    gg_ckpts=$(for f in $FUELS; do case $f in llama-3.2-1b|qwen3-*) printf '%s,' "$CK/$f";; esac; done)
    PYTHONPATH=$GG_SITE${PYTHONPATH:+:$PYTHONPATH} timeout "${GGUF_TIMEOUT:-420}" python3 benches/gguf_gpu_check.py --ckpt "$gg_ckpts" \
        --rocket "$ROCKET" --logits-at "$(unpacked logits-at)" --device cuda --work /tmp/rocket-gguf \
        --load-file /tmp/rocket-gguf/llama-3.2-1b-q4_k_m.gguf > "$LOGS/gguf.txt" 2> "$LOGS/gguf.err"
    check "gguf files against HF folders" $?
    tail -5 "$LOGS/gguf.err"; grep -E "^(PASS|FAIL|GGUF-LOAD)" "$LOGS/gguf.txt"
fi

if has long-ref; then
    timeout "${LONG_REF_TIMEOUT:-540}" python3 benches/long_context_check.py --ckpt-dir "$CK" --bin "$(unpacked logits-at)" \
        --json "$LOGS/long-ref.json" > "$LOGS/long-ref.txt" 2> "$LOGS/long-ref.err"
    check "long contexts vs fp32 torch" $?
    tail -5 "$LOGS/long-ref.err"; cat "$LOGS/long-ref.txt"
fi

bench() {  # bench NAME DECODE BATCHES PROMPT GEN REPS FUEL [MATMUL]; ROCKET_BIN picks another binary
    echo "$1 start $(date +%s.%N)" >> "$LOGS/bench.times"
    ROCKET_DECODE=$2 ROCKET_MATMUL=${8:-auto} timeout 180 "${ROCKET_BIN:-$ROCKET}" bench --model "$CK/$7" --device cuda --batch "$3" --prompt-len "$4" \
        --gen-len "$5" --reps "$6" ${BENCH_EXTRA:-} --json "$LOGS/$1.json" > "$LOGS/$1.txt" 2> "$LOGS/$1.err" ||
        { check "bench $1" 1; tail -3 "$LOGS/$1.err"; }
    echo "$1 end $(date +%s.%N)" >> "$LOGS/bench.times"
}
if has bench; then
    configs=" ${BENCH_CONFIGS:-default graph mk} "  # a subset saves device time
    for f in $FUELS; do
        [[ $configs == *" default "* ]] && bench "bench-default-$f" auto 1,16 128 256 5 "$f"
        [[ $configs == *" graph "* ]] && bench "bench-graph-$f" graph 1,16 128 256 5 "$f" gemv
        [[ $configs == *" mk "* ]] && bench "bench-mk-$f" megakernel 1 128 256 5 "$f"
        [[ $configs == *" nopdl "* ]] && ROCKET_PDL=0 bench "bench-nopdl-$f" auto 1,16 128 256 5 "$f"
        [[ $configs == *" nofuse "* ]] && ROCKET_FUSE=0 bench "bench-nofuse-$f" auto 1,16 128 256 5 "$f"
    done
fi
# cuBLASLt for `--matmul cublas`: the toolkit's copy, not on the loader path there (MACHINES.md).
CUBLAS_LIB=${CUBLAS_LIB:-/usr/local/cuda/lib64}
if has algos; then  # cuBLASLt's candidate algorithms per product and row count
    LD_LIBRARY_PATH=$CUBLAS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ROCKET_FIXTURES=$PWD/tests/parity/fixtures \
        timeout 300 "$(unpacked cuda-test)" --include-ignored --exact --nocapture cublas_matmul_candidates_at_prompt_rows > "$LOGS/algos.log" 2>&1
    check "cublas candidates" $?
    grep -E "CUBLAS-BEST|test result|FAILED|panicked" "$LOGS/algos.log"
    LD_LIBRARY_PATH=$CUBLAS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ROCKET_FIXTURES=$PWD/tests/parity/fixtures \
        timeout 200 "$(unpacked cuda-test)" --include-ignored --exact --nocapture cublas_rows_keep_their_bits_across_pass_lengths > "$LOGS/row-bits.log" 2>&1
    check "cublas rows' bits across pass lengths" $?
    grep -E "ROW-BITS-SUMMARY|test result|FAILED|panicked" "$LOGS/row-bits.log"
fi
if has splitk; then  # cuBLASLt's short-pass products split K
    LD_LIBRARY_PATH=$CUBLAS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ROCKET_FIXTURES=$PWD/tests/parity/fixtures \
        timeout 240 "$(unpacked cuda-test)" --include-ignored --exact --nocapture cublas_split_k_at_short_prompt_rows > "$LOGS/splitk.log" 2>&1
    check "cublas split K at short passes" $?
    grep -E "CUBLAS-SPLITK-BEST|test result|FAILED|panicked" "$LOGS/splitk.log"
fi
if has f16gemm; then  # rocket's fp16 GEMM against the host and beside cuBLASLt's fp16 products (F16GEMM lines)
    LD_LIBRARY_PATH=$CUBLAS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ROCKET_FIXTURES=$PWD/tests/parity/fixtures \
        timeout 300 "$(unpacked cuda-test)" --include-ignored --exact --nocapture \
        f16_gemm_matches_the_host_and_keeps_a_rows_bits > "$LOGS/f16gemm.log" 2>&1
    check "fp16 GEMM checks" $?
    grep -E "F16GEMM-LAYER|test result|FAILED|panicked" "$LOGS/f16gemm.log"
    grep -E "^F16GEMM " "$LOGS/f16gemm.log" | grep -E "rows (33|128|256) "
    grep -c "F16GEMM-ROW-BITS.*: 0 of" "$LOGS/f16gemm.log" | sed 's/^/F16GEMM-ROW-BITS equal: /'
fi

if has cublas; then  # cuBLASLt against rocket's tensor-core GEMM: its checks (CUBLAS lines), then TTFT and batch 16
    LD_LIBRARY_PATH=$CUBLAS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ROCKET_FIXTURES=$PWD/tests/parity/fixtures \
        ROCKET_GPU_CHECKPOINTS=$CK/qwen3-0.6b,$CK/llama-3.2-1b timeout 300 "$(unpacked cuda-test)" --include-ignored --exact --nocapture \
        cublas_matmul_matches_the_host_and_the_reference fp16_products_redo_a_pass_past_the_range_on_bf16_parts \
        attention_outputs_past_the_fp16_range_redo_the_pass > "$LOGS/cublas.log" 2>&1
    check "cublas checks" $?
    grep -E "CUBLAS|F16-RANGE|F16-ATTN-RANGE|test result|FAILED|panicked" "$LOGS/cublas.log"
    cublas_matmuls=${CUBLAS_BENCH_MATMULS-tensor cublas}  # set empty: the checks alone
    for f in llama-3.2-1b qwen3-0.6b; do
        for m in $cublas_matmuls; do
            LD_LIBRARY_PATH=$CUBLAS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} bench "ttft-$m-$f" auto 1,16 128,4096 8 3 "$f" "$m"
            echo "--- $f matmul $m"; cat "$LOGS/ttft-$m-$f.txt"
        done
        if [[ -f $CARRY/base/rocket.xz && " $cublas_matmuls " == *" cublas "* ]]; then  # the baseline build's cuBLASLt path, in the same call
            LD_LIBRARY_PATH=$CUBLAS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ROCKET_BIN=$(unpacked base/rocket) bench "ttft-cublas-base-$f" auto 1,16 128,4096 8 3 "$f" cublas
            echo "--- $f matmul cublas, baseline build"; cat "$LOGS/ttft-cublas-base-$f.txt"
        fi
    done
fi
if has interference; then  # 8 streams decoding while a 16K-token prompt prefills
    for block in ${INTERFERENCE_BLOCKS:-512}; do
        timeout 240 python3 benches/interference.py --rocket "$ROCKET" --model "$CK/llama-3.2-1b" --device cuda \
            --streams 8 --prompt-len 16384 --max-tokens 4096 --prefix-block "$block" --json "$LOGS/interference-$block.json" \
            > "$LOGS/interference-$block.txt" 2>&1
        check "interference, prefix block $block" $?
        cat "$LOGS/interference-$block.txt"
    done
fi
if has devices; then  # one engine per GPU behind the router
    gpus=$(nvidia-smi --list-gpus | grep -c '^GPU ')
    tests="one_gpu_through_the_router_equals_solo a_fault_on_the_only_gpu_fails_its_requests_and_refuses_new_ones_at_once"
    (( gpus > 1 )) && tests+=" every_gpu_serves_and_outputs_equal_solo a_fault_on_one_gpu_mid_run_leaves_the_others_serving"
    for t in $tests; do
        ROCKET_FIXTURES=$PWD/tests/parity/fixtures timeout 180 "$(unpacked cuda-devices-test)" --include-ignored --exact --nocapture "$t" \
            > "$LOGS/devices-$t.log" 2>&1
        check "devices test $t" $?
        grep -E "DEVICES|test result|panicked" "$LOGS/devices-$t.log"
    done
    timeout 300 python3 benches/devices.py --rocket "$ROCKET" --model "$CK/llama-3.2-1b" --device cuda \
        --json "$LOGS/devices.json" > "$LOGS/devices.txt" 2>&1
    check "devices bench" $?
    grep -E "DEVICES|FAIL|PASS" "$LOGS/devices.txt"
    timeout 300 python3 benches/devices.py --rocket "$ROCKET" --model "$CK/llama-3.2-1b" --device cuda --check-solo \
        --server-arg=--decode=graph --server-arg=--matmul=gemv --json "$LOGS/devices-solo.json" > "$LOGS/devices-solo.txt" 2>&1
    check "devices bench, streams against their text alone" $?
    grep -E "DEVICES|FAIL|PASS" "$LOGS/devices-solo.txt"
fi
if has tcb1; then  # the tensor-core matmul at batch 1 (every pass uses it when enabled)
    for f in llama-3.2-1b qwen3-0.6b; do
        bench "bench-tc1-$f" graph 1 128 256 3 "$f" tensor
    done
fi
if has sampled; then  # top-k 20 / top-p 0.95 / temperature 0.7 on the device sampler, then on the host
    for f in qwen3-0.6b llama-3.2-1b; do
        BENCH_EXTRA="--temperature 0.7 --top-p 0.95 --top-k 20" bench "sampled-device-$f" auto 1,16 128 256 3 "$f"
        ROCKET_SAMPLER=host BENCH_EXTRA="--temperature 0.7 --top-p 0.95 --top-k 20" bench "sampled-host-$f" auto 1,16 128 256 3 "$f"
        ROCKET_LOOP_SAMPLING=1 BENCH_EXTRA="--temperature 0.7 --top-p 0.95 --top-k 20" bench "sampled-mk-$f" megakernel 1 128 256 3 "$f"
    done
fi
# The sampling settings of the race and mkstall steps' modes.
race_args() {
    case $1 in
        greedy) echo "";;
        t1) echo "--temperature 1.0";;
        t08rp) echo "--temperature 0.8 --repetition-penalty 1.1";;
        minp) echo "--temperature 0.8 --min-p 0.05 --repetition-penalty 1.1";;
        topp) echo "--temperature 0.7 --top-p 0.9";;
        topk) echo "--temperature 0.6 --top-k 20 --top-p 0.95";;
        lp5) echo "--logprobs 5";;
        *) echo "unknown sampling mode $1" >&2; return 1;;
    esac
}
if has race; then  # batch-1 sampled decode per fuel: the issue's settings, against the same build's greedy
    RACE_MODES=${RACE_MODES:-"greedy t1 t08rp minp topp topk lp5"}  # a subset saves device time
    for f in $FUELS; do
        for n in $RACE_MODES; do
            BENCH_EXTRA=$(race_args "$n") bench "race-$n-$f" auto 1 128 256 3 "$f"
        done
    done
    for f in $FUELS; do
        for n in $RACE_MODES; do
            printf 'RACE %-14s %-7s %s\n' "$f" "$n" "$(grep -E '^\| 1 \|' "$LOGS/race-$n-$f.txt" | head -1)"
        done
    done
    python3 benches/race_ratios.py --logs "$LOGS" --prefix race --fuels "$FUELS" --modes "$RACE_MODES"
    # Batch 16 (the graph path; sampled rows on the device sampler's split paths): issue 21's
    # batch target, T 0.6 + top-k 20 + top-p 0.95 (the top-k lists) and T 0.6 + top-p 0.9
    # (the bins) against greedy.
    race16_fuels="qwen3-0.6b llama-3.2-1b"
    for f in $race16_fuels; do
        [[ " $FUELS " == *" $f "* && ${RACE16:-1} == 1 ]] || continue
        bench "race16-greedy-$f" auto 16 128 256 3 "$f"
        BENCH_EXTRA=$(race_args topk) bench "race16-topk-$f" auto 16 128 256 3 "$f"
        BENCH_EXTRA="--temperature 0.6 --top-p 0.9" bench "race16-topp-$f" auto 16 128 256 3 "$f"
        for n in greedy topk topp; do
            printf 'RACE16 %-14s %-7s %s\n' "$f" "$n" "$(grep -E '^\| 16 \|' "$LOGS/race16-$n-$f.txt" | head -1)"
        done
    done
    [[ ${RACE16:-1} == 0 ]] || python3 benches/race_ratios.py --logs "$LOGS" --prefix race16 --fuels "$race16_fuels" --modes "greedy topk topp"
fi
if has ttft; then  # time to first token per prompt length, prompt attention on the tensor cores and off
    for f in $FUELS; do
        for p in 128 1024 4096 16384; do
            [[ $p == 16384 && $f != llama-3.2-1b ]] && continue
            ROCKET_LOG=warn,rocket_core::backend::cuda=debug bench "ttft-tc-$f-$p" auto 1 "$p" 4 3 "$f"
            ROCKET_TC_ATTENTION=0 bench "ttft-split-$f-$p" auto 1 "$p" 4 3 "$f"
        done
    done
    for f in "$LOGS"/ttft-tc-*.txt; do
        n=${f#"$LOGS"/ttft-tc-}; n=${n%.txt}
        printf 'TTFT %-22s tensor cores: %s | split kernel: %s\n' "$n" "$(grep -E '^\| 1 ' "$f" | cut -d'|' -f4)" \
            "$(grep -E '^\| 1 ' "$LOGS/ttft-split-$n.txt" | cut -d'|' -f4)"
        # The last prompt pass's host issue time against its whole time (launch-bound when close).
        printf 'PASS %-22s %s\n' "$n" "$(grep 'decode=false' "$LOGS/ttft-tc-$n.err" | tail -1 | grep -oE 'rows=.*')"
    done
fi
if has ttft || has chat; then  # issue 22's chat case: 4,000 cached prompt tokens, 100 new, per prefix block
    chat_builds=(new)
    [[ -f $CARRY/base/rocket.xz ]] && chat_builds+=(base)
    IFS='|' read -ra chat_envs <<< "${TTFTAB_ENV:-}"  # this build under each set too (rows envK)
    for k in "${!chat_envs[@]}"; do chat_builds+=("env$k"); done
    for blk in 512 128; do
        for b in "${chat_builds[@]}"; do  # with a baseline build (.device-carry/base/rocket.xz), its figure beside
            bin=$ROCKET vars=
            [[ $b == base ]] && bin=$(unpacked base/rocket)
            [[ $b == env* ]] && vars=${chat_envs[${b#env}]}
            (if [[ -n $vars ]]; then export $vars; fi; ROCKET_BIN=$bin ROCKET_PREFIX_BLOCK=$blk BENCH_EXTRA="--prefix-reuse 4000" bench "reuse-$b-$blk" auto 1 100 4 3 llama-3.2-1b)
            printf 'REUSE %-4s block %-4s %s\n' "$b" "$blk" "$(grep -A2 '^| prefix reuse' "$LOGS/reuse-$b-$blk.txt" | tail -1)"
        done
    done
fi
if has ttftab; then  # TTFT of this build, the baseline build's (.device-carry/base/rocket.xz, where carried) and the variants', interleaved
    base_rocket=
    [[ -f $CARRY/base/rocket.xz ]] && base_rocket=$(unpacked base/rocket)
    unpack_variants
    IFS='|' read -ra ttft_envs <<< "${TTFTAB_ENV:-}"
    for round in 1 2; do
        for f in $FUELS; do
            lens=${TTFTAB_LENS:-128,1024,4096}
            [[ $f == llama-3.2-1b && -z ${TTFTAB_LENS:-} ]] && lens=$lens,16384
            [[ -n $base_rocket ]] && ROCKET_BIN=$base_rocket bench "ttftab-base$round-$f" auto 1 "$lens" 2 3 "$f"
            bench "ttftab-new$round-$f" auto 1 "$lens" 2 3 "$f"
            for k in "${!ttft_envs[@]}"; do
                (export ${ttft_envs[$k]}; bench "ttftab-env$k$round-$f" auto 1 "$lens" 2 3 "$f")
            done
            for v in "$BIN"/variants/*; do
                [[ -x $v ]] && ROCKET_BIN=$v bench "ttftab-$(basename "$v")$round-$f" auto 1 "$lens" 2 3 "$f"
            done
        done
    done
    builds=(new)
    [[ -n $base_rocket ]] && builds=(base new)
    for k in "${!ttft_envs[@]}"; do builds+=("env$k"); done
    for v in "$BIN"/variants/*; do [[ -x $v ]] && builds+=("$(basename "$v")"); done
    for f in $FUELS; do
        for b in "${builds[@]/%/1}" "${builds[@]/%/2}"; do
            echo "--- TTFT-AB $f $b"
            grep -E '^\|' "$LOGS/ttftab-$b-$f.txt" | grep -v -- '---'
        done
    done
fi
if has long; then
    for p in 1024 4096 16384; do
        bench "long-graph-$p" graph 1 "$p" 64 2 llama-3.2-1b
        bench "long-mk-$p" megakernel 1 "$p" 64 2 llama-3.2-1b
    done
fi

if has sanitize; then
    # memcheck: every fuel's megakernel instantiation (a short teacher-forced launch and a
    # 3-step loop per sampling mode, each token checked against the host sampler), then the
    # longer teacher-forced comparison on SmolLM2; racecheck: the short launches on SmolLM2
    # (the 128-position test does not finish under racecheck in minutes; what it reports there
    # is the weight ring's bulk copies, which its mbarriers order and racecheck does not track),
    # and the prompt attention's cp.async double buffering and barriers (the tensor-core
    # attention test, which its CPU twin does not model).
    SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    sanitize() {  # sanitize NAME TOOL CHECKPOINTS BINARY TEST [sanitizer options...]
        local name=$1 tool=$2 ckpts=$3 binary=$4 test=$5 t0=$SECONDS rc summary
        shift 5
        # ROCKET_WATCHDOG_MS: the megakernel test's watchdog, long enough for the sanitizer's pace.
        ROCKET_WATCHDOG_MS=120000 ROCKET_GPU_CHECKPOINTS=$ckpts ROCKET_MK_PROMPTS=1 ROCKET_FIXTURES=$PWD/tests/parity/fixtures \
            timeout "${SANITIZE_TIMEOUT:-240}" "$SAN" --tool "$tool" "$@" "$(unpacked "$binary")" --include-ignored \
            --test-threads=1 --nocapture "$test" > "$LOGS/sanitize-$name.log" 2>&1
        rc=$?
        summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/sanitize-$name.log" | tail -1)
        echo "compute-sanitizer $name rc=$rc ($((SECONDS - t0)) s): $summary"
        grep -E "MK-SHORT|MK-AGREE" "$LOGS/sanitize-$name.log"
        [[ $rc == 0 && $summary =~ SUMMARY:\ 0\ (errors|hazards) ]] || { [[ $rc == 0 ]] && rc=1; grep -m 20 -E "Error|Hazard|Race|at .*0x" "$LOGS/sanitize-$name.log"; }
        check "compute-sanitizer $name" "$rc"
    }
    # The tiny fixture's head_dim (32) runs the mma.sync attention; on Hopper SmolLM2 (64) and
    # Qwen3-0.6B (128) run the wgmma one (attention_prefill_wg.cu).
    attention_memcheck() {
        sanitize memcheck-attention memcheck "$CK/smollm2-135m,$CK/qwen3-0.6b" cuda-test prompt_attention_on_the_tensor_cores
    }
    # Racecheck runs the attention test's short cases (ROCKET_TC_ATTN_SHORT, which also leaves
    # out the backends that load cuBLASLt: with it loaded the sanitizer stopped at the first
    # backend, "Internal Sanitizer Error ... failed to handle a hardware exception") and
    # instruments the prompt attention kernels alone (--kernel-name; both the mma.sync and the
    # wgmma kernel): with every kernel of the forward passes instrumented, even the short cases
    # did not finish in 100 s.
    attention_racecheck() {
        ROCKET_TC_ATTN_SHORT=1 sanitize racecheck-attention racecheck "$CK/smollm2-135m,$CK/qwen3-0.6b" cuda-test \
            prompt_attention_on_the_tensor_cores --kernel-name kns=attn_prefill --racecheck-report analysis --print-limit 40
    }
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        case $tool in
            memcheck)
                sanitize memcheck-short memcheck "$CKPTS" cuda-megakernel-test short_launches_of_every_mode_for_the_sanitizers
                sanitize memcheck-forced memcheck "$CK/smollm2-135m" cuda-megakernel-test teacher_forced_top1_agrees
                attention_memcheck ;;
            racecheck)
                attention_racecheck
                sanitize racecheck-short racecheck "$CK/smollm2-135m" cuda-megakernel-test short_launches_of_every_mode_for_the_sanitizers \
                    --racecheck-report analysis --print-limit 40 ;;
            attention)  # the prompt attention alone, both tools
                attention_memcheck
                attention_racecheck ;;
            attention-racecheck) attention_racecheck ;;
            *) check "sanitize: unknown tool $tool (memcheck, racecheck, attention, attention-racecheck)" 1 ;;
        esac
    done
fi

ab_round() {  # ab_round PREFIX PROMPT GEN: this build, the baseline and the AB_ENV sets, twice per fuel
    for f in $FUELS; do
        for round in 1 2; do
            bench "$1-new$round-$f" megakernel 1 "$2" "$3" 3 "$f"
            [[ ${AB_BASE:-1} == 0 ]] || ROCKET_BIN=$base_rocket bench "$1-base$round-$f" megakernel 1 "$2" "$3" 3 "$f"
            IFS='|' read -ra variants <<< "${AB_ENV:-}"
            for k in "${!variants[@]}"; do
                (export ${variants[$k]}; bench "$1-env$k-$round-$f" megakernel 1 "$2" "$3" 3 "$f")
            done
            for v in "$BIN"/variants/*; do
                [[ -x $v ]] && ROCKET_BIN=$v bench "$1-$(basename "$v")$round-$f" megakernel 1 "$2" "$3" 3 "$f"
            done
        done
    done
}
if (has ab || has abshort) && [[ -f $CARRY/base/rocket.xz ]]; then
    base_rocket=$(unpacked base/rocket)
    unpack_variants
    has ab && ab_round ab 128 256
    has abshort && ab_round abshort 16 128
fi
if has ab && [[ -f $CARRY/base/rocket.xz ]]; then
    if [[ -f $CARRY/base/cuda-megakernel-test.xz ]]; then
        # ROCKET_DECODE for baseline builds from before the tests chose their options.
        ROCKET_DECODE=megakernel ROCKET_GPU_CHECKPOINTS=$CKPTS timeout 120 "$(unpacked base/cuda-megakernel-test)" --include-ignored --test-threads=1 --nocapture \
            a_traced_step > "$LOGS/ab-base-profile.log" 2>&1
        grep -c "MK-PROFILE" "$LOGS/ab-base-profile.log"
    fi
fi

if has peer; then
    timeout 240 python3 benches/torch_peer.py --model "$CK/llama-3.2-1b" --batch 1,16 --prompt-len 128 --gen-len 256 --reps 2 \
        --json "$LOGS/peer-llama-3.2-1b.json" > "$LOGS/peer-llama-3.2-1b.txt" 2> "$LOGS/peer-llama-3.2-1b.err" ||
        { check "peer" 1; tail -5 "$LOGS/peer-llama-3.2-1b.err"; }
fi

if has profile; then
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    pf=${PROFILE_FUEL:-llama-3.2-1b}
    # batch, prompt, gen, pass: a decode step at batch 16, the 128-token prefill at batch 1
    # (PROFILE_SHAPES="1 4096 2 -2" splits a 4K prefill's time by kernel).
    IFS='|' read -ra shapes <<< "${PROFILE_SHAPES:-16 128 3 -1|1 128 2 -2}"
    for shape in "${shapes[@]}"; do
        set -- $shape
        ROCKET_DECODE=graph ROCKET_CUDA_GRAPHS=0 timeout 240 "$NCU" --clock-control none --metrics gpu__time_duration.sum \
            --csv "$ROCKET" bench --model "$CK/$pf" --device cuda --batch "$1" --prompt-len "$2" --gen-len "$3" \
            --reps 1 > "$LOGS/profile-b$1-p$2.csv" 2> "$LOGS/profile-b$1-p$2.err" || { check "ncu batch $1 prompt $2" 1; tail -2 "$LOGS/profile-b$1-p$2.err"; }
        echo "--- ncu $pf batch $1, prompt $2, pass $4"
        python3 benches/ncu_step.py "$LOGS/profile-b$1-p$2.csv" "$4"
    done
fi
if has mkstall; then  # warp stall reasons of one megakernel launch, greedy against sampled
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    for f in ${MKSTALL_FUELS:-qwen3-0.6b}; do
        for n in ${RACE_MODES:-greedy topp topk}; do
            out="$LOGS/mkstall-$n-$f"
            # Application replay: the launch talks to the host through mapped memory, so
            # each pass reruns the whole bench rather than replaying the kernel alone.
            timeout 240 "$NCU" --replay-mode application --clock-control none -k regex:megakernel -c 1 \
                --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' --csv \
                "$ROCKET" bench --model "$CK/$f" --device cuda --batch 1 --prompt-len 128 --gen-len 128 --reps 1 \
                $(race_args "$n") > "$out.csv" 2> "$out.err" || { check "ncu megakernel $f $n" 1; tail -3 "$out.err"; continue; }
            python3 - "$out.csv" "$f" "$n" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head = next((r for r in rows if "Metric Name" in r), None)
if head is None:
    print(f"MKSTALL {sys.argv[2]} {sys.argv[3]}: no metrics in the report"); sys.exit(0)
name, value = head.index("Metric Name"), head.index("Metric Value")
stalls = {}
for r in rows[rows.index(head) + 1:]:
    m = re.match(r"smsp__average_warps_issue_stalled_(.*)_per_issue_active\.ratio", r[name])
    if m:
        stalls[m.group(1)] = float(r[value].replace(",", ""))
total = sum(stalls.values())
top = sorted(stalls.items(), key=lambda kv: -kv[1])[:8]
print(f"MKSTALL {sys.argv[2]} {sys.argv[3]}: {total:.2f} cycles per issue; no_instruction "
      f"{stalls.get('no_instruction', 0):.2f} ({100 * stalls.get('no_instruction', 0) / max(total, 1e-9):.1f}%); "
      + ", ".join(f"{k} {v:.2f}" for k, v in top))
PY
        done
    done
fi
if has attnprof; then  # where the prompt attention's time goes: Nsight Compute on its launches of a 4K prompt
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    pf=${PROFILE_FUEL:-llama-3.2-1b}
    # The last layers' launches (their context is the deepest); the split merge's too.
    timeout 300 "$NCU" --clock-control none --kernel-name regex:attn_prefill --launch-skip 40 --launch-count 4 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
        "$ROCKET" bench --model "$CK/$pf" --device cuda --batch 1 --prompt-len 4096 --gen-len 2 --reps 1 \
        > "$LOGS/attnprof.txt" 2> "$LOGS/attnprof.err" || { check "ncu prompt attention" 1; tail -3 "$LOGS/attnprof.err"; }
    grep -E "attn_prefill|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Stall|L1/TEX Hit|L2 Hit|Executed Ipc|est\. Speedup" \
        "$LOGS/attnprof.txt" | head -80
fi

echo "=== summary"
for f in "$LOGS"/bench-*.txt "$LOGS"/sampled-*.txt "$LOGS"/long-*.txt; do
    [[ -f $f ]] && { echo "--- $(basename "$f" .txt)"; tail -n +3 "$f"; }
done
for f in "$LOGS"/ab-*.txt "$LOGS"/abshort-*.txt; do  # one row each
    [[ -f $f ]] && echo "$(basename "$f" .txt) $(grep '^| 1 ' "$f")"
done
[[ -f $LOGS/peer-llama-3.2-1b.txt ]] && { echo "--- peer"; tail -12 "$LOGS/peer-llama-3.2-1b.txt"; }
[[ -f $LOGS/power.csv ]] && { echo "--- SM clock and power per bench"; python3 benches/power_summary.py "$LOGS/power.csv" "$LOGS/bench.times"; }
if (( ${#FAILED[@]} )); then
    echo "FAIL: ${#FAILED[@]} check(s) failed: ${FAILED[*]}"
    exit 1
fi
echo "PASS: every check passed"
