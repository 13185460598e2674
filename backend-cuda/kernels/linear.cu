// y[m, col0 + c] = sum_k x[m, k] * w[c, k] (+ b) with a dense f32 weight. One warp per output.
extern "C" __global__ void linear(const float* x, const float* w, const float* bias, float* out,
                                  unsigned int rows, unsigned int n, unsigned int k, unsigned int has_bias,
                                  unsigned int n_total, unsigned int col0) {
    // 64-bit: 32 threads per output, so rows * n past 2^27 would wrap a 32-bit thread index.
    unsigned long long warp = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    unsigned int lane = threadIdx.x & 31;
    if (warp >= (unsigned long long)rows * n) return;
    unsigned int m = (unsigned int)(warp / n), c = (unsigned int)(warp % n);
    float acc = 0.f;
    for (unsigned int kk = lane; kk < k; kk += 32) acc += x[(size_t)m * k + kk] * w[(size_t)c * k + kk];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) out[(size_t)m * n_total + col0 + c] = acc + (has_bias ? bias[col0 + c] : 0.f);
}
