#!/usr/bin/env bash
# Builds rocket's kernels with the pinned CUDA 13.0 compiler from PyPI (the pip
# packages below; no system CUDA install needed). It matches the oldest driver
# rocket targets, CUDA 13.0 (driver 580, PTX ISA 9.0): PTX from nvcc 13.1 or newer
# may not load on it.
#   build/rocket.ptx          PTX for sm_90 (JIT-compiled on other GPUs >= 9.0)
#   build/rocket.sm_90a.cubin machine code for Hopper, loaded without a JIT
#   build/diagnostics.*       the same pair for the probes (src/diagnostics.cu),
#                             embedded only by rocket-core's `diagnostics` feature
#   build/MANIFEST            hashes of the sources they came from, checked by
#                             a test so a stale artifact fails CI
# Usage: kernels/build.sh            (installs nvcc into kernels/.nvcc-venv once)
#        NVCC=/path/to/nvcc kernels/build.sh
set -euo pipefail
cd "$(dirname "$0")"

if [[ -z "${NVCC:-}" ]]; then
    VENV=.nvcc-venv
    if [[ ! -x "$VENV/bin/python" ]]; then
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
            nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
    fi
    NVCC="$("$VENV/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "bin", "nvcc"))')"
fi
VERSION="$("$NVCC" --version | grep -o 'V[0-9][0-9.]*' | head -1)"
[[ "$VERSION" == V13.0.* ]] || { echo "need nvcc 13.0.x, found $VERSION" >&2; exit 1; }

FLAGS=(-std=c++17 -O3)
mkdir -p build
# NAME.ptx and NAME.sm_90a.cubin from src/NAME.cu; ptxas's report in NAME's logs.
image() {
    local name="$1" log="$2" summary="$3"
    "$NVCC" "${FLAGS[@]}" -arch=sm_90 --ptx "src/$name.cu" -o "build/$name.ptx"
    "$NVCC" "${FLAGS[@]}" -gencode=arch=compute_90a,code=sm_90a --cubin -Xptxas -v "src/$name.cu" \
        -o "build/$name.sm_90a.cubin" 2> "build/$log"
    grep -E "Compiling entry|registers|spill" "build/$log" | sed 's/ptxas info    : //' > "build/$summary"
}
image rocket ptxas.log ptxas-summary.txt
image diagnostics ptxas-diagnostics.log ptxas-diagnostics-summary.txt

{
    echo "# nvcc $VERSION flags: ${FLAGS[*]}"
    (cd src && sha256sum $(ls *.cu *.cuh | sort))
    (cd build && sha256sum rocket.ptx rocket.sm_90a.cubin diagnostics.ptx diagnostics.sm_90a.cubin | sed 's/  /  build\//')
} > build/MANIFEST
echo "built: $(ls build)"
