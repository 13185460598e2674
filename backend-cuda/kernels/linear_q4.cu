// GEMV path of the 4-bit linear (decode, few rows): y[m, col0 + c] = sum_k x[m, k] * W[c, k] + b
// with W in bitsandbytes 4-bit, dequantized in registers. One warp per output column and row:
// each lane reads 16 bytes (32 codes) of the packed row at a time with one 128-bit load when the
// row is 16-byte aligned, the code table lives in shared memory, f32 accumulation, then a warp
// shuffle reduction.
extern "C" __global__ void linear_q4(const float* x, const unsigned char* packed, const float* absmax,
                                     const float* code, const float* bias, float* out, unsigned int rows,
                                     unsigned int n, unsigned int k, unsigned int blocksize,
                                     unsigned int has_bias, unsigned int n_total, unsigned int col0) {
    __shared__ float table[16];
    if (threadIdx.x < 16) table[threadIdx.x] = code[threadIdx.x];
    __syncthreads();
    // 64-bit: 32 threads per output, so rows * n past 2^27 would wrap a 32-bit thread index.
    unsigned long long warp = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    unsigned int lane = threadIdx.x & 31;
    if (warp >= (unsigned long long)rows * n) return;
    unsigned int m = (unsigned int)(warp / n);
    unsigned int c = (unsigned int)(warp % n);
    const float* xr = x + (size_t)m * k;
    size_t base = (size_t)c * k;  // first element of this weight row
    float acc = 0.f;
    bool vec16 = (base % 32 == 0) && (k % 32 == 0) && (((size_t)packed) % 16 == 0);
    if (vec16) {
        const uint4* p = (const uint4*)(packed + base / 2);
        for (unsigned int chunk = lane; chunk < k / 32; chunk += 32) {
            uint4 v = p[chunk];
            unsigned int words[4] = {v.x, v.y, v.z, v.w};
            size_t e0 = base + (size_t)chunk * 32;
            float s = absmax[e0 / blocksize];  // 32 codes never straddle a block (blocksize >= 32)
#pragma unroll
            for (int w = 0; w < 4; w++) {
#pragma unroll
                for (int byte = 0; byte < 4; byte++) {
                    unsigned int b = (words[w] >> (8 * byte)) & 0xFF;
                    unsigned int kk = chunk * 32 + w * 8 + byte * 2;
                    acc += xr[kk] * __fmul_rn(table[b >> 4], s);
                    acc += xr[kk + 1] * __fmul_rn(table[b & 0xF], s);
                }
            }
        }
    } else {
        for (unsigned int kk = lane; kk < k; kk += 32) {
            size_t e = base + kk;
            unsigned char b = packed[e >> 1];
            unsigned int q = (e & 1) ? (b & 0xF) : (b >> 4);
            acc += xr[kk] * __fmul_rn(table[q], absmax[e / blocksize]);
        }
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) {
        if (has_bias) acc += bias[col0 + c];
        out[(size_t)m * n_total + col0 + c] = acc;
    }
}
