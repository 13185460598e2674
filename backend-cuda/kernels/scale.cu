// out = x * factor.
extern "C" __global__ void scale(const float* x, float* out, unsigned int n, float factor) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] * factor;
}
