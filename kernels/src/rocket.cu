// The one module rocket loads: every op, compiled together (one PTX, one cubin).
#include "embed.cu"
#include "rms_norm.cu"
#include "gemv.cu"
#include "rope_kv.cu"
#include "attention.cu"
#include "silu_mul.cu"
#include "argmax.cu"
#include "megakernel.cu"
