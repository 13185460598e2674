// out = x / sqrt(mean(x^2) + eps) * w over rows of length d. One block of 256 per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, unsigned int rows,
                                    unsigned int d, float eps) {
    __shared__ float red[256];
    unsigned int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * d;
    float s = 0.f;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i] * xr[i];
    red[threadIdx.x] = s;
    __syncthreads();
    for (unsigned int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    float inv = rsqrtf(red[0] / d + eps);
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) out[(size_t)r * d + i] = xr[i] * inv * w[i];
}
