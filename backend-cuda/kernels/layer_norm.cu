// out = (x - mean) / sqrt(var + eps) (* w + b when affine) over rows of length d. One block of
// 256 per row, two reductions.
extern "C" __global__ void layer_norm(const float* x, const float* w, const float* b, float* out,
                                      unsigned int rows, unsigned int d, float eps, unsigned int affine) {
    __shared__ float red[256];
    unsigned int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * d;
    float s = 0.f;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i];
    red[threadIdx.x] = s;
    __syncthreads();
    for (unsigned int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    float mean = red[0] / d;
    __syncthreads();
    float v = 0.f;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) { float c = xr[i] - mean; v += c * c; }
    red[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    float inv = rsqrtf(red[0] / d + eps);
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) {
        float y = (xr[i] - mean) * inv;
        out[(size_t)r * d + i] = affine ? y * w[i] + b[i] : y;
    }
}
