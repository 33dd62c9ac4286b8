#!/usr/bin/env bash
# The checks run before a release, on the GPU machine after benches/gpu_pack.sh, in two
# device calls (each within the 600 s one call may run):
#   benches/gpu_final.sh checks     the CUDA tests, the megakernel's and the production path's
#                                   (benches/gpu_run.sh tests mk prod)
#   benches/gpu_final.sh measures   `rocket bench` with the defaults per fuel, the torch peer, and
#                                   compute-sanitizer memcheck of every fuel's megakernel and of
#                                   the prompt attention (gpu_run.sh bench peer sanitize)
# Every check prints PASS or FAIL, and the call exits 1 when any failed (gpu_run.sh).
set -euo pipefail
here=$(dirname "$0")
case ${1:-} in
    checks) exec bash "$here/gpu_run.sh" tests mk prod ;;
    measures) BENCH_CONFIGS=default SANITIZE_TOOLS=memcheck exec bash "$here/gpu_run.sh" bench peer sanitize ;;
    *) echo "usage: benches/gpu_final.sh checks|measures" >&2; exit 2 ;;
esac
