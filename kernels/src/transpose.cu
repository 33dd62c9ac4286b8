// transpose_bf16: out[c][r] = in[r][c] for a [rows][cols] bf16 matrix. The
// megakernel's MLP instruction reads the down-projection by columns (each SM
// multiplies the act slice it computed), so it keeps a transposed copy, made
// once when the megakernel is set up. grid = (ceil(cols / 32), ceil(rows / 32)),
// block = 256 (32 x 8: each thread moves 4 elements each way through a padded tile).
#include "common.cuh"

ROCKET_KERNEL void transpose_bf16(const uint16_t* __restrict__ in, uint16_t* __restrict__ out, int rows, int cols) {
    pdl_enter();
    __shared__ uint16_t tile[32][33];  // +1 column: the transposed reads hit distinct banks
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int r0 = blockIdx.y * 32, c0 = blockIdx.x * 32;
    for (int j = ty; j < 32; j += 8) {
        const int r = r0 + j, c = c0 + tx;
        if (r < rows && c < cols) tile[j][tx] = in[(size_t)r * cols + c];
    }
    __syncthreads();
    for (int j = ty; j < 32; j += 8) {
        const int c = c0 + j, r = r0 + tx;
        if (c < cols && r < rows) out[(size_t)c * rows + r] = tile[tx][j];
    }
}
