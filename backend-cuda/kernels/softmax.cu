// Softmax over rows of length d. One block of 256 per row: max, then sum of exponentials.
extern "C" __global__ void softmax(const float* x, float* out, unsigned int rows, unsigned int d) {
    __shared__ float red[256];
    unsigned int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * d;
    float m = -3.0e38f;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) m = fmaxf(m, xr[i]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (unsigned int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + o]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();
    float s = 0.f;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) s += expf(xr[i] - m);
    red[threadIdx.x] = s;
    __syncthreads();
    for (unsigned int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    s = red[0];
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) out[(size_t)r * d + i] = expf(xr[i] - m) / s;
}
