// The module rocket loads: every op, compiled together (one PTX, one cubin).
// The measurement probes are a module of their own (diagnostics.cu).
#include "embed.cu"
#include "rms_norm.cu"
#include "gemv.cu"
#include "gemm_tc.cu"
#include "rope_kv.cu"
#include "attention.cu"
#include "silu_mul.cu"
#include "to_bf16.cu"
#include "transpose.cu"
#include "argmax.cu"
#include "sample.cu"
#include "megakernel.cu"
