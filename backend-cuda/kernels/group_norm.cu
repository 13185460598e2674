// Group normalization of x[C, S] in `groups` groups of C / groups channels, then * w[C] + b[C].
// One block of 256 per group: strided partial sums reduced in shared memory for the mean, then
// for the variance, then every thread writes its share.
__device__ float block_sum(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    float total = red[0];
    __syncthreads();
    return total;
}

extern "C" __global__ void group_norm(const float* x, const float* w, const float* b, float* out,
                                      unsigned int c, unsigned int s, unsigned int groups,
                                      float eps) {
    __shared__ float red[256];
    unsigned int g = blockIdx.x;
    if (g >= groups) return;
    unsigned int cg = c / groups;
    size_t n = (size_t)cg * s, base = (size_t)g * n;
    float acc = 0.f;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) acc += x[base + i];
    float mean = block_sum(acc, red) / (float)n;
    float v = 0.f;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) { float d = x[base + i] - mean; v += d * d; }
    float inv = rsqrtf(block_sum(v, red) / (float)n + eps);
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
        unsigned int ch = g * cg + (unsigned int)(i / s);
        out[base + i] = (x[base + i] - mean) * inv * w[ch] + b[ch];
    }
}
