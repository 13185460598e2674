// out = x * sigmoid(x).
extern "C" __global__ void silu(const float* x, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] / (1.f + expf(-x[i]));
}
